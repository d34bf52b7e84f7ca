# coding=utf-8
"""Feature maps of NPRF attention and of its variants: phi(x) with E[phi(x) . phi(y)] = exp(x . y).

"nprf" (the paper): phi(sqrt(s) x / |x|), positive random features of the L2-normalized query / key;
"prf": Performer's phi(x d^(-1/4)); "elu_linear": elu(x) + 1. Also the values' ones column that every
product carries for the denominator, and the final division by it. Pure functions, no state.
"""

import math

import torch
import torch.nn.functional as F

from .nprf_schedule import SERIAL
from .options import FEATURE_MAPS


# Guard of the L2 normalization (as F.normalize): zero rows stay zero.
NORM_EPS = 1e-12


def compute_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def draw_projection(
    num_features, head_dim, kind="orf", num_heads=None, generator=None, device=None, dtype=torch.float32
):
    """Draw the random projection W of the feature map.

    "prf": rows iid N(0, I_d). "orf": blocks of d orthogonal rows (QR of a Gaussian matrix), each row
    rescaled to the norm of a Gaussian vector, so every row is still marginally N(0, I_d).

    Returns:
        [m, d], or [H, m, d] when `num_heads` is given.
    """
    if kind not in FEATURE_MAPS:
        raise ValueError(f"feature map kind must be one of {FEATURE_MAPS}, got {kind!r}")
    if num_features < 1 or head_dim < 1:
        raise ValueError(f"num_features and head_dim must be positive, got {num_features}, {head_dim}")
    shape = (num_heads or 1, num_features, head_dim)
    gaussian = torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == "prf":
        projection = gaussian
    else:
        num_blocks = -(-num_features // head_dim)
        square = torch.randn((shape[0], num_blocks, head_dim, head_dim), generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(square)
        # Fix the signs so that q is Haar-distributed.
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
        rows = q.transpose(-1, -2).reshape(shape[0], num_blocks * head_dim, head_dim)[:, :num_features]
        projection = rows * gaussian.norm(dim=-1, keepdim=True)
    projection = projection.to(device=device, dtype=dtype)
    return projection if num_heads is not None else projection[0]


def positive_random_features(x, projection):
    """phi(x) = exp(W x - |x|^2 / 2) / sqrt(m), so that E[phi(x) . phi(y)] = exp(x . y).

    Args:
        x: [..., d]; with a per-head projection, x is [B, H, n, d].
        projection: [m, d] or [H, m, d].
    Returns:
        [..., m]. The exponent is computed in float32 for half-precision inputs and the result is
        float32 then (the features can exceed the float16 range).
    """
    dtype = compute_dtype(x.dtype)
    x = x.to(dtype)
    squared_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()
    return _feature_exponent(_project(x, projection), squared_norm, projection.shape[-2])


def normalized_features(x, projection, logit_scale=None, head_major=False, with_units=False, rows=None):
    """phi(sqrt(s) x / |x|) for x [B, H, n, d] (zero rows stay zero, as in F.normalize). `logit_scale` s [H]
    (None = 1) scales both sides, so phi(q).phi(k) estimates exp(s q.k). `with_units`: (phi, sqrt(s) x / |x|),
    the unit vectors that the exact near field's logits need too. `rows`: [(start, stop)] the only rows whose
    features a consumer reads: the features [B, H, r, m] of these ranges, one after the other.

    head_major: (a per-head projection [H, m, d]) the features are a [B, H, n, m] view of [H, B, n, m]
        storage: one matmul per head over every sequence, without a copy of the projection per sequence;
        for a consumer that reads one head at a time (the dense inference product).
    """
    norm = row_norms(x)
    inverse = 1.0 / norm.clamp_min(NORM_EPS)
    if logit_scale is not None:
        inverse = inverse * logit_scale.to(x.dtype).sqrt()[:, None, None]
    num_features = projection.shape[-2]
    # |x_hat|^2 / 2 + log(m) / 2. (Padded keys are zeroed after the map, not here with an exponent of -inf:
    # exp is many times slower on -inf and other underflowing inputs.)
    shift = 0.5 * (norm * inverse).square() + 0.5 * math.log(num_features)
    if head_major and projection.dim() == 3 and rows is None:
        batch, heads, n, d = x.shape
        projection = projection.to(device=x.device, dtype=x.dtype)
        scaled = x.new_empty(heads, batch, n, d)  # x_hat, written once in head-major order (cheaper than W x when d < m)
        torch.mul(x.transpose(0, 1), inverse.transpose(0, 1), out=scaled)
        wx = torch.bmm(scaled.view(heads, batch * n, d), projection.transpose(-1, -2)).view(heads, batch, n, num_features)
        features = wx.sub_(shift.transpose(0, 1)).exp_().transpose(0, 1)
        return (features, scaled.transpose(0, 1)) if with_units else features
    # x_hat first, not (W x) / |x|: in training the product's backward then needs only x (the projection's
    # output, kept anyway) and not a copy of W x; and with d <= m it is the smaller tensor to scale. Adding the
    # negated shift rather than subtracting it: backward then negates the [B, H, n, 1] sum, not the [B, H, n, m]
    # gradient (a pass over the features that short inputs feel).
    units = x * inverse
    if rows is None:
        features = _project(units, projection).add_(-shift).exp_()
    else:  # (the near field's dense product: the unit vectors of every row, the features of a few, compact)
        features = _project(_rows(units, rows), projection).add_(-_rows(shift, rows)).exp_()
    return (features, units) if with_units else features


def _rows(x, rows, dim=2):
    """x [B, H, n, f] (or any x along `dim`) cut to `rows` ([(start, stop)], one after the other): [B, H, r, f]. (One
    index_select: its backward is one scatter into zeros, where a cat of slices zero-fills x's size per slice.)"""
    if rows == [(0, x.shape[dim])]:
        return x
    index = torch.cat([torch.arange(start, stop, device=x.device) for start, stop in rows])
    return x.index_select(dim, index)


def empty_like_query(query, dv, dtype=None):
    """An empty attention output [B, H, n, d_v] laid out as query: a [B, H, n, d] view of [B, n, H, d] storage, as
    the models pass it, gets the same layout, so that their transpose back to [B, n, H * d_v] is free (and an output
    kept for backward is the very tensor the output projection keeps). Strided, not a view: a custom Function's
    output may then be changed in place."""
    batch, heads, n, _ = query.shape
    if query.transpose(1, 2).is_contiguous():
        return query.new_empty_strided((batch, heads, n, dv), (n * heads * dv, dv, heads * dv, 1), dtype=dtype)
    return query.new_empty(batch, heads, n, dv, dtype=dtype)


def row_norms(x):
    """|x| over the last dim, [B, H, n, 1]. The models' q / k are [B, H, n, d] views of [B, n, H, d]: reducing
    in that storage order is about twice as fast as through the view."""
    if x.dim() == 4 and x.transpose(1, 2).is_contiguous():
        return torch.linalg.vector_norm(x.transpose(1, 2), dim=-1, keepdim=True).transpose(1, 2)
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def _feature_exponent(wx, squared_norm, num_features):
    """exp(Wx - |x|^2/2 - log(m)/2) = phi(x), in place on wx [..., m] (the matmul's backward does not need
    its output, and exp_'s backward uses its result), so the [..., m] tensor is written only twice; the shift is
    negated before it is added, as in `normalized_features`."""
    return wx.add_(-(0.5 * squared_norm + 0.5 * math.log(num_features))).exp_()


def _project(x, projection):
    """W x: x [..., d] (with a per-head projection [B, H, n, d]), projection [m, d] or [H, m, d] -> [..., m]."""
    if projection.shape[-1] != x.shape[-1]:
        raise ValueError(f"projection is {tuple(projection.shape)} but x has size {x.shape[-1]} in its last dim")
    projection = projection.to(device=x.device, dtype=x.dtype)
    if projection.dim() == 3:
        if x.dim() < 3 or x.shape[-3] != projection.shape[0]:
            raise ValueError(f"per-head projection {tuple(projection.shape)} needs x [..., H, n, d], got {tuple(x.shape)}")
        return x @ projection.transpose(-1, -2)
    if projection.dim() != 2:
        raise ValueError(f"projection must be [m, d] or [H, m, d], got {tuple(projection.shape)}")
    return x @ projection.t()


def variant_features(x, projection, variant="nprf", logit_scale=None):
    """phi(x) [B, H, n, m] of a variant whose kernel factors into features, for x [B, H, n, d] in a float dtype:
    "nprf": phi(sqrt(s) x / |x|) (`normalized_features`); "prf": phi(x d^(-1/4)) (Performer: the estimate of
    exp(q . k / sqrt(d)), not normalized); "elu_linear": elu(x) + 1 (m = d, no projection)."""
    if variant in ("nprf", "nprf_near"):  # (the near field's far part)
        return normalized_features(x, projection, logit_scale)
    if variant == "prf":
        return positive_random_features(x * x.shape[-1] ** -0.25, projection)
    if variant == "elu_linear":
        return F.elu(x) + 1.0
    raise ValueError(f"variant={variant!r} has no feature map; those with one: nprf, prf, elu_linear")


def query_key_features(query, key, projection, mask, dtype, logit_scale=None, head_major=False, variant="nprf",
                       units=None, rows=None):
    """phi(q_hat), phi(k_hat) [B, H, n, m] in `dtype` (the variant's feature map), padded keys zeroed (after the
    map: phi(0) != 0). `units`: a list that gets the unit vectors sqrt(s) q / |q|, sqrt(s) k / |k| ("nprf_near");
    `rows`: as `normalized_features` takes it, for both (their features [B, H, r, m] then)."""
    if variant in ("nprf", "nprf_near"):
        phi_q = normalized_features(query.to(dtype), projection, logit_scale, head_major, units is not None, rows)
        phi_k = normalized_features(key.to(dtype), projection, logit_scale, head_major, units is not None, rows)
        if units is not None:
            (phi_q, q_unit), (phi_k, k_unit) = phi_q, phi_k
            units.extend((q_unit, k_unit))
    else:
        phi_q, phi_k = (variant_features(x.to(dtype), projection, variant) for x in (query, key))
    if mask is not None:  # in place when autograd does not need the features as they are
        keep = (mask if rows is None else _rows(mask, rows, dim=1))[:, None, :, None]
        phi_k = phi_k * keep if torch.is_grad_enabled() and phi_k.requires_grad else phi_k.mul_(keep)
    return phi_q, phi_k


def values_and_ones(value, before=0, after=0, threads=SERIAL):
    """[B, H, before + n + after, d_v + 1]: the numerator's values and the denominator's ones column for
    the n rows of `value` [B, H, n, d_v], with zero rows before and after; every element written once (`threads`: an
    `nprf_schedule` scheduler)."""
    batch, heads, n, d = value.shape
    u = value.new_empty(batch, heads, before + n + after, d + 1)
    with threads.small():  # the padding rows and the ones column: too small to split
        u[:, :, :before] = 0.0
        u[:, :, before + n :] = 0.0
        u[:, :, before : before + n, d] = 1.0
    u[:, :, before : before + n, :d] = value
    return u


def normalize_attention(numerator, denominator, valid=None, in_place=False):
    """numerator / denominator [..., 1], zero where the denominator is 0 (a query with no key: its numerator is
    a sum over no key) or `valid` is False. Division by inf gives those zeros without another pass; a NaN stays
    NaN, so a diverging run is not hidden. in_place: divide `numerator` itself (inference)."""
    denominator = kept_denominator(denominator, valid)
    return numerator.div_(denominator) if in_place else numerator / denominator


def kept_denominator(denominator, valid=None):
    """The divisor of `normalize_attention`: the denominator, inf where it is 0 or `valid` is False."""
    keep = denominator != 0
    if valid is not None:
        keep = keep & valid
    return torch.where(keep, denominator, torch.full_like(denominator, float("inf")))


def rows_with_keys(mask, causal):
    """None (no mask) or [B, 1, n, 1] bool: the query rows with at least one kept key (before them when causal)
    for the float mask [B, n]: FFT rounding can leave tiny non-zero sums on the others."""
    if mask is None:
        return None
    kept = mask > 0
    has_key = kept.cumsum(-1) > 0 if causal else kept.any(-1, keepdim=True)
    return has_key[:, None, :, None]
