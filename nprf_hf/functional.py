# coding=utf-8
"""Pure tensor functions for NPRF attention with relative positional encoding.

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative Positional Encoding"
(NeurIPS 2021). Per head, with n tokens, head size d and m random features:

    z_i = sum_j c_{j-i} phi(q_i) . phi(k_j) v_j  /  sum_j c_{j-i} phi(q_i) . phi(k_j),   c_r = exp(b_r)

where q, k are L2-normalized, phi is the positive random feature map of the softmax kernel and
b_r is a (T5-bucketed) relative position bias. The Toeplitz matrix C = [c_{j-i}] is applied by one
of three exact algorithms: "dense" (n x n weights), "fft" (the paper's Toeplitz product through
real FFTs) and "banded" (C = far constants + a band, using running sums and local attention).

Nothing here holds state: every function takes tensors and returns tensors.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .options import (  # declared with the other options (no torch there)
    ALGORITHMS,
    ATTENTION_VARIANTS,
    FEATURE_MAPS,
    NORMALIZED_VARIANTS,
    QUADRATIC_VARIANTS,
)


# Smallest chunk of the banded algorithm: below this the chunked matmuls are too small to be fast.
BANDED_MIN_CHUNK = 16
BANDED_REACH = 1
# Slots per product in the banded forward: [32, s, 3s] weights stay in cache.
BANDED_GROUP = 32
# `auto` crossovers, measured on the 2-core CPU (B=1, H=12, d=64, m=64, forward and forward+backward):
# with a band, dense beats banded up to about the banded window's cost (about 334 tokens for T5's
# default buckets: at 320 they tie, at 384 banded is 1.2x / 1.4x faster forward / forward+backward,
# at 512 2.6x / 1.8x); without a band (a bias learned per distance),
# fft only beats dense from about 8192 tokens (dense at 2048: 0.46 s vs fft 1.95 s forward, one
# thread), where dense's n x n weights also stop fitting in memory.
AUTO_DENSE_FACTOR = 1.0
# Without autograd the dense product runs in cache and skips padded keys (`_dense_toeplitz_inference`): on padded
# batches (B=8, H=12, m=64, T5's default buckets: a window of 334) it takes 0.93x (d=32) / 0.89x (d=64) of banded's
# time at 512 tokens, 1.8x / 1.6x at 768: they cross at about 540 tokens, 1.6 windows.
AUTO_DENSE_FACTOR_INFERENCE = 1.6
AUTO_FFT_MIN_LENGTH = 8192
# Bytes of n x n weights the dense inference product scales and reads in one group: they stay in a
# core's L2 cache (2 MiB here) between the two matmuls instead of going to memory and back.
DENSE_GROUP_BYTES = 1 << 20
# `recompute=None` recomputes the banded / fft attention in backward from this size of one call's [B, H, n, m]
# features on (16 MiB: B x n = 5,461 tokens at H = 12, m = 64): the about ten feature-sized tensors a layer
# would keep matter there, while for short batches the second forward costs time for little memory (a MiniLM
# training step at 8 x 512 took 1.46x SDPA's with it, 1.33x without).
RECOMPUTE_MIN_BYTES = 16 << 20
# Guard of the L2 normalization (as F.normalize): zero rows stay zero.
NORM_EPS = 1e-12


# ---------------------------------------------------------------------------------------------
# Relative positions
# ---------------------------------------------------------------------------------------------


def t5_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """T5's bucketing of relative positions (key index - query index), bit-identical to HF T5.

    Args:
        relative_position: integer tensor of any shape, r = j - i.
    Returns:
        LongTensor of the same shape with values in [0, num_buckets).
    """
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


def rpe_band_width(num_buckets=32, max_distance=128, bidirectional=True):
    """Smallest W such that the T5 bucket of r is the same for all r >= W and for all r <= -W.

    A bias gathered from a bucket table is then constant beyond the band |r| < W whatever the
    table holds (91 for the defaults 32 / 128).
    """
    reach = max(max_distance, num_buckets) + 2
    r = torch.arange(-reach, reach + 1)
    buckets = t5_relative_position_bucket(r, bidirectional, num_buckets, max_distance)
    differs = buckets != torch.where(r > 0, buckets[-1], buckets[0])
    return int(r[differs].abs().max().item()) + 1 if bool(differs.any()) else 1


def relative_position_bias(table, seq_len, bidirectional=True, num_buckets=32, max_distance=128):
    """Expand a bucket table into the per-distance bias b_r.

    Args:
        table: [H, num_buckets].
    Returns:
        [H, 2 * seq_len - 1]; entry r + seq_len - 1 holds b_r for r = j - i.
    """
    if table.dim() != 2 or table.shape[-1] != num_buckets:
        raise ValueError(f"table must be [num_heads, num_buckets={num_buckets}], got {tuple(table.shape)}")
    r = torch.arange(-(seq_len - 1), seq_len, device=table.device)
    buckets = t5_relative_position_bucket(r, bidirectional, num_buckets, max_distance)
    if torch.compiler.is_compiling():
        # The same values through a one-hot matmul, whose backward is a matmul too: inductor (torch 2.13, CPU)
        # can generate the gather's scatter-add backward with wrong indices, writing out of bounds (see `_diagonals`).
        return table @ F.one_hot(buckets, num_buckets).to(table.dtype).t()
    return table[:, buckets]


# ---------------------------------------------------------------------------------------------
# Random features
# ---------------------------------------------------------------------------------------------


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
    dtype = _compute_dtype(x.dtype)
    x = x.to(dtype)
    squared_norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()
    return _feature_exponent(_project(x, projection), squared_norm, projection.shape[-2])


def _normalized_features(x, projection, logit_scale=None, head_major=False):
    """phi(sqrt(s) x / |x|) for x [B, H, n, d] (zero rows stay zero, as in F.normalize). `logit_scale` s [H]
    (None = 1) scales both sides, so phi(q).phi(k) estimates exp(s q.k).

    head_major: (a per-head projection [H, m, d]) the features are a [B, H, n, m] view of [H, B, n, m]
        storage: one matmul per head over every sequence, without a copy of the projection per sequence;
        for a consumer that reads one head at a time (the dense inference product).
    """
    norm = _row_norms(x)
    inverse = 1.0 / norm.clamp_min(NORM_EPS)
    if logit_scale is not None:
        inverse = inverse * logit_scale.to(x.dtype).sqrt()[:, None, None]
    num_features = projection.shape[-2]
    # |x_hat|^2 / 2 + log(m) / 2. (Padded keys are zeroed after the map, not here with an exponent of -inf:
    # exp is many times slower on -inf and other underflowing inputs.)
    shift = 0.5 * (norm * inverse).square() + 0.5 * math.log(num_features)
    if head_major and projection.dim() == 3:
        batch, heads, n, d = x.shape
        projection = projection.to(device=x.device, dtype=x.dtype)
        scaled = x.new_empty(heads, batch, n, d)  # x_hat, written once in head-major order (cheaper than W x when d < m)
        torch.mul(x.transpose(0, 1), inverse.transpose(0, 1), out=scaled)
        wx = torch.bmm(scaled.view(heads, batch * n, d), projection.transpose(-1, -2)).view(heads, batch, n, num_features)
        return wx.sub_(shift.transpose(0, 1)).exp_().transpose(0, 1)
    # x_hat first, not (W x) / |x|: in training the product's backward then needs only x (the projection's
    # output, kept anyway) and not a copy of W x; and with d <= m it is the smaller tensor to scale.
    return _project(x * inverse, projection).sub_(shift).exp_()


def _row_norms(x):
    """|x| over the last dim, [B, H, n, 1]. The models' q / k are [B, H, n, d] views of [B, n, H, d]: reducing
    in that storage order is about twice as fast as through the view."""
    if x.dim() == 4 and x.transpose(1, 2).is_contiguous():
        return torch.linalg.vector_norm(x.transpose(1, 2), dim=-1, keepdim=True).transpose(1, 2)
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def _feature_exponent(wx, squared_norm, num_features):
    """exp(Wx - |x|^2/2 - log(m)/2) = phi(x), in place on wx [..., m] (the matmul's backward does not need
    its output, and exp_'s backward uses its result), so the [..., m] tensor is written only twice."""
    return wx.sub_(0.5 * squared_norm + 0.5 * math.log(num_features)).exp_()


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
    "nprf": phi(sqrt(s) x / |x|) (`_normalized_features`); "prf": phi(x d^(-1/4)) (Performer: the estimate of
    exp(q . k / sqrt(d)), not normalized); "elu_linear": elu(x) + 1 (m = d, no projection)."""
    if variant == "nprf":
        return _normalized_features(x, projection, logit_scale)
    if variant == "prf":
        return positive_random_features(x * x.shape[-1] ** -0.25, projection)
    if variant == "elu_linear":
        return F.elu(x) + 1.0
    raise ValueError(f"variant={variant!r} has no feature map; those with one: nprf, prf, elu_linear")


def _check_variant(variant, algorithm, logit_scale):
    if variant not in ATTENTION_VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; allowed: one of {', '.join(ATTENTION_VARIANTS)}")
    if variant in QUADRATIC_VARIANTS and algorithm not in ("auto", "dense"):
        raise ValueError(f"variant={variant!r} is computed from the dense n x n weights: algorithm must be auto or dense")
    if logit_scale is not None and variant not in NORMALIZED_VARIANTS:
        raise ValueError(f"logit_scale scales normalized logits: it applies to the normalized variants "
                         f"{NORMALIZED_VARIANTS}, not {variant!r}")


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def nprf_attention(
    query,
    key,
    value,
    rpe_bias,
    projection,
    key_padding_mask=None,
    algorithm="auto",
    causal=False,
    band_width: Optional[int] = None,
    logit_scale: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    segment_bias: Optional[torch.Tensor] = None,
    token_ids: Optional[torch.Tensor] = None,
    match_weight: Optional[torch.Tensor] = None,
    recompute: Optional[bool] = None,
    num_segments: Optional[int] = None,
    variant: str = "nprf",
):
    """Normalized positive random feature attention with a relative position bias.

    Args:
        query, key: [B, H, n, d] (L2-normalized here). value: [B, H, n, d_v].
        rpe_bias: [H, 2n - 1]; entry r + n - 1 holds b_r for r = j - i.
        projection: [m, d] or [H, m, d].
        key_padding_mask: [B, n], bool or 0/1; True/1 = keep. Padded keys count in neither sum.
        algorithm: "auto", "dense", "fft" or "banded" (all exact; they differ in speed only).
        causal: drop keys after the query (j > i).
        band_width: W of the bias's tied structure (b_r constant for r >= W and for r <= -W), e.g.
            `rpe_band_width(...)` for a T5 bucket table. None infers it from the values. The banded
            algorithm sends the gradient of the constant tails to the outermost entries (r = +-(n-1)),
            which is exact for a bias tied beyond W; so a bias that requires grad needs band_width
            for "banded" (and "auto" only uses banded then).
        logit_scale: None (the paper: content logits q_hat . k_hat in [-1, 1]) or s [H] > 0, a per-head
            scale of the normalized logits: the kernel becomes exp(s q_hat . k_hat), estimated with
            features of norm sqrt(s) (the estimate's variance grows with s).
        segment_ids: None or [B, n] integer segment of every token (e.g. token_type_ids of a sentence
            pair), with `segment_bias` [H]: beta_h is added to the bias of every query/key pair in
            different segments. exp of a sum is a product, so the Toeplitz product splits exactly into
            one product per key segment (cost x number of segments).
        token_ids: None or [B, n] token ids, with `match_weight` mu [H] >= 0 (and segment_ids): the
            weight of a query and a key that are the same token in different segments becomes
            phi_q . phi_k (exp(b_{j-i}) + mu), an exact word-matching term. Linear time: the keys'
            phi_k u^T are summed per (token, segment) group and each query reads the groups of its own
            token in the other segments.
        recompute: under autograd, keep only the inputs for backward and recompute the features and the
            products there (activation checkpointing of this function): the [B, H, n, m] features and
            their padded copies are then not held from forward to backward.
            None = for the "banded" and "fft" algorithms once the features take RECOMPUTE_MIN_BYTES (long
            inputs, where they are most of a layer's activations), not for "dense". Ignored under torch.compile.
        num_segments: None or S, when every segment id is known to lie in [0, S) (e.g. token types below
            `type_vocab_size`). Only read under torch.compile, where the segments present cannot be read
            on the host: one product per possible segment then (an absent segment adds exact zeros).
        variant: one of `options.ATTENTION_VARIANTS`: "nprf" (the above); "prf" and "elu_linear" replace the
            feature map (same algorithms and terms); "normalized_softmax" and "softmax" compute the exact kernels
            exp(s q_hat . k_hat) and exp(q . k / sqrt(d)) from the n x n weights (`nprf_attention_weights`).
    Returns:
        [B, H, n, d_v]. Queries with no key to attend to give zeros.
    """
    # The math picks its own precision (float32 for half inputs): under autocast, matmuls would otherwise
    # come back in half precision and the in-place products would mix dtypes.
    with torch.autocast(query.device.type, enabled=False):
        return _attention(
            query, key, value, rpe_bias, projection, key_padding_mask, algorithm, causal, band_width, logit_scale,
            segment_ids, segment_bias, token_ids, match_weight, recompute, num_segments, variant,
        )


def _attention(
    query, key, value, rpe_bias, projection, key_padding_mask, algorithm, causal, band_width, logit_scale, segment_ids,
    segment_bias, token_ids, match_weight, recompute, num_segments, variant,
):
    """`nprf_attention` (its arguments), autocast off."""
    batch, heads, n, head_dim = _check_inputs(query, key, value, rpe_bias, projection, key_padding_mask, algorithm)
    _check_variant(variant, algorithm, logit_scale)
    if variant in QUADRATIC_VARIANTS:
        weights = nprf_attention_weights(
            query, key, rpe_bias, projection, key_padding_mask, causal, logit_scale, segment_ids, segment_bias,
            token_ids, match_weight, variant,
        )
        return (weights.to(_compute_dtype(value.dtype)) @ value.to(_compute_dtype(value.dtype))).to(value.dtype)
    _check_logit_scale(logit_scale, heads)
    _check_segments(segment_ids, segment_bias, batch, heads, n)
    _check_matches(token_ids, match_weight, segment_ids, batch, heads, n, causal)
    dtype = _compute_dtype(query.dtype)
    bias = _masked_bias(rpe_bias.to(dtype), n, causal)
    inputs = (query, key, value, bias, projection, key_padding_mask, logit_scale, segment_ids, segment_bias, token_ids, match_weight)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    algorithm, band_width = _resolve_algorithm(
        algorithm, bias, n, band_width, projection.shape[-2], value.shape[-1] + 1, inference=not needs_grad
    )
    if recompute is None:
        feature_bytes = batch * heads * n * projection.shape[-2] * torch.finfo(dtype).bits // 8
        recompute = algorithm in ("banded", "fft") and feature_bytes >= RECOMPUTE_MIN_BYTES
    # (not under torch.compile, whose partitioner decides itself what backward recomputes)
    if not (recompute and needs_grad and not torch.compiler.is_compiling()):
        return _nprf_attention(*inputs, algorithm, band_width, causal, num_segments, variant)
    # No random numbers inside: the recomputation repeats the forward exactly without saving RNG state.
    return checkpoint(
        _nprf_attention, *inputs, algorithm, band_width, causal, num_segments, variant, use_reentrant=False,
        preserve_rng_state=False,
    )


def _nprf_attention(
    query, key, value, bias, projection, key_padding_mask, logit_scale, segment_ids, segment_bias, token_ids, match_weight,
    algorithm, band_width, causal, num_segments, variant="nprf",
):
    """`nprf_attention` once its inputs are checked and the algorithm chosen; `bias` [H, 2n - 1] has -inf for
    the future when causal."""
    batch, heads, n, _ = query.shape
    dtype = _compute_dtype(query.dtype)
    mask = None if key_padding_mask is None else key_padding_mask.to(device=query.device, dtype=dtype)
    value = value.to(dtype)
    c = torch.exp(bias - bias.amax(dim=-1, keepdim=True).detach())  # ratios are shift-invariant; c <= 1
    # Without autograd the dense product runs head by head in cache and skips the keys after the last kept one
    # (a host sync, hence eager only). Only the product's own inputs count here, not the wrapper's `needs_grad`:
    # a training segment bias or match weight multiplies the product's output and needs no graph inside it.
    inference = not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in (query, key, value, c, projection, logit_scale)
    )
    key_lengths = None
    if algorithm == "dense" and inference and not torch.compiler.is_compiling():
        key_lengths = _key_lengths(mask, batch, n)
    phi_q, phi_k = _features(query, key, projection, mask, dtype, logit_scale, key_lengths is not None, variant)
    u = None if algorithm == "banded" or key_lengths is not None else _values_and_ones(value)

    def toeplitz_product(keys):
        if key_lengths is not None:
            return _dense_toeplitz_inference(phi_q, keys, value, c, key_lengths)
        if algorithm == "dense":
            return _dense_toeplitz_attention(phi_q, keys, u, c)
        if algorithm == "fft":
            return _fft_toeplitz_attention(phi_q, keys, u, c)
        return _banded_toeplitz_attention(phi_q, keys, value, c, band_width, causal)

    if segment_ids is None:
        out = toeplitz_product(phi_k)
    else:
        segment_ids = segment_ids.to(query.device)
        out = _segmented_product(toeplitz_product, phi_k, segment_ids, segment_bias.to(dtype), num_segments)
    if token_ids is not None:
        u = _values_and_ones(value) if u is None else u
        match = _match_product(phi_q, phi_k, u, token_ids.to(query.device), segment_ids.to(query.device), algorithm)
        out = out + match * _match_scale(match_weight.to(dtype), bias, segment_bias.to(dtype))[:, None, None]

    numerator, denominator = out[..., :-1], out[..., -1:]
    valid = denominator != 0  # exact sums are >= 0; NaN stays NaN, so a diverging run is not hidden
    if mask is not None:  # FFT rounding can leave tiny non-zero sums on rows with no key at all
        kept = mask > 0
        has_key = kept.cumsum(-1) > 0 if causal else kept.any(-1, keepdim=True)
        valid = valid & has_key[:, None, :, None]
    # rows with no key: dividing by inf gives their zeros (numerators are sums over no key) without another pass
    denominator = torch.where(valid, denominator, torch.full_like(denominator, float("inf")))
    if torch.is_grad_enabled() and out.requires_grad:
        out = numerator / denominator
    else:  # inference: divide in place, no new [B, H, n, d_v] tensor
        out = numerator.div_(denominator)
    return out.to(query.dtype)


def nprf_attention_weights(
    query,
    key,
    rpe_bias,
    projection,
    key_padding_mask=None,
    causal=False,
    logit_scale=None,
    segment_ids=None,
    segment_bias=None,
    token_ids=None,
    match_weight=None,
    variant="nprf",
):
    """The attention matrix implied by `nprf_attention` (same arguments), computed densely.

    Returns:
        [B, H, n, n]; row i holds the weights of the keys for query i (rows sum to 1, rows with no
        key to attend to are zero).
    """
    batch, heads, n, _ = _check_inputs(query, key, key, rpe_bias, projection, key_padding_mask, "dense")
    _check_variant(variant, "dense", logit_scale)
    _check_logit_scale(logit_scale, heads)
    _check_segments(segment_ids, segment_bias, batch, heads, n)
    _check_matches(token_ids, match_weight, segment_ids, batch, heads, n, causal)
    dtype = _compute_dtype(query.dtype)
    mask = None if key_padding_mask is None else key_padding_mask.to(device=query.device, dtype=dtype)
    bias = _masked_bias(rpe_bias.to(dtype), n, causal)
    c = torch.exp(bias - bias.amax(dim=-1, keepdim=True).detach())
    if variant in QUADRATIC_VARIANTS:
        kernel = _exact_kernel(query.to(dtype), key.to(dtype), mask, causal, logit_scale, variant)
    else:
        phi_q, phi_k = _features(query, key, projection, mask, dtype, logit_scale, variant=variant)
        kernel = phi_q @ phi_k.transpose(-1, -2)
    weights = kernel * _toeplitz(c, n)
    if segment_ids is not None:
        same, other = _segment_factors(segment_bias.to(dtype))
        segment_ids = segment_ids.to(query.device)
        crossing = (segment_ids[:, :, None] != segment_ids[:, None, :])[:, None]  # [B, 1, n, n]
        weights = weights * torch.where(crossing, other[:, None, None], same[:, None, None])
    if token_ids is not None:
        matches = _token_matches(token_ids.to(query.device), segment_ids)[:, None]
        weights = weights + kernel * matches * _match_scale(match_weight.to(dtype), bias, segment_bias.to(dtype))[:, None, None]
    total = weights.sum(-1, keepdim=True)
    valid = total > 0
    weights = torch.where(valid, weights / torch.where(valid, total, torch.ones_like(total)), 0.0)
    return weights.to(query.dtype)


# ---------------------------------------------------------------------------------------------
# The three exact Toeplitz products. All take phi_q, phi_k [B, H, n, m] (padded keys zeroed),
# u [B, H, n, e] and c [H, 2n - 1], and return sum_j c_{j-i} (phi_q_i . phi_k_j) u_j: [B, H, n, e].
# ---------------------------------------------------------------------------------------------


def _dense_toeplitz_attention(phi_q, phi_k, u, c):
    """O(n^2 (m + e)): the n x n weights, then one matmul."""
    weights = (phi_q @ phi_k.transpose(-1, -2)) * _toeplitz(c, phi_q.shape[-2])
    return weights @ u


def _dense_toeplitz_inference(phi_q, phi_k, value, c, key_lengths):
    """`_dense_toeplitz_attention` without autograd, from the values [B, H, n, d_v] (the denominators are the
    weights' row sums): a few heads at a time, so that their n x n weights are scaled by C and read twice
    while they are in cache, and each sequence's keys cut after its last kept one (`key_lengths` [B] ints;
    the keys after it are padding, whose features are zero). Features may be strided (head-major)."""
    batch, heads, n, _ = phi_q.shape
    d = value.shape[-1]
    toeplitz = _toeplitz(c, n)
    group = max(1, min(heads, DENSE_GROUP_BYTES // (n * n * phi_q.element_size())))
    weights_buffer = phi_q.new_empty(group * n * n)
    numerator = phi_q.new_empty(group, n, d)
    out = phi_q.new_empty(batch, heads, n, d + 1)
    for b, length in enumerate(key_lengths):
        if length == 0:
            out[b].zero_()
            continue
        for first in range(0, heads, group):
            last = min(first + group, heads)
            weights = weights_buffer[: (last - first) * n * length].view(last - first, n, length)
            torch.matmul(phi_q[b, first:last], phi_k[b, first:last, :length].transpose(-1, -2), out=weights)
            weights.mul_(toeplitz[first:last, :, :length])
            out[b, first:last, :, :d] = torch.matmul(weights, value[b, first:last, :length], out=numerator[: last - first])
            torch.sum(weights, dim=-1, keepdim=True, out=out[b, first:last, :, d:])
    return out


def _key_lengths(mask, batch, n):
    """[B] Python ints: one past each sequence's last kept key (n without a mask); a host sync."""
    if mask is None:
        return [n] * batch
    positions = torch.arange(1, n + 1, device=mask.device, dtype=mask.dtype)
    return (mask * positions).amax(-1).to(torch.long).tolist()


def _fft_toeplitz_attention(phi_q, phi_k, u, c):
    """The paper's algorithm: D_i = sum_j c_{j-i} phi_k_j u_j^T for all i through real FFTs of the
    m * e channels of phi_k u^T over the (contiguous) sequence axis, then z_i = phi_q_i^T D_i.
    One head at a time, to bound the memory of the [B, m, e, n] channel tensor."""
    n = phi_q.shape[-2]
    length = _fft_length(2 * n - 1)
    # Convolution kernel k_t = c_{-t}, placed circularly: t = 0..n-1 first, t = -(n-1)..-1 last.
    zeros = c.new_zeros(c.shape[0], length - (2 * n - 1))
    kernel = torch.cat([c[:, :n].flip(-1), zeros, c[:, n:].flip(-1)], dim=-1)
    kernel_f = torch.fft.rfft(kernel, n=length)  # [H, length // 2 + 1]
    # The inference path writes into strided `out=` views, which dynamo cannot trace; compiled, the per-head
    # path below is traced instead (inductor plans its buffers itself).
    if not torch.compiler.is_compiling() and (
        not torch.is_grad_enabled() or not any(t.requires_grad for t in (phi_q, phi_k, u, kernel_f))
    ):
        return _fft_toeplitz_inference(phi_q, phi_k, u, kernel_f, length)
    heads = []
    for h in range(phi_q.shape[1]):
        channels = phi_k[:, h].transpose(-1, -2).unsqueeze(2) * u[:, h].transpose(-1, -2).unsqueeze(1)  # [B, m, e, n]
        spectrum = torch.fft.rfft(F.pad(channels, (0, length - n)))  # padding first is much faster than rfft(n=)
        toeplitz = torch.fft.irfft(spectrum * kernel_f[h], n=length)[..., :n]  # D_i for every i: [B, m, e, n]
        heads.append((toeplitz * phi_q[:, h].transpose(-1, -2).unsqueeze(2)).sum(1).transpose(-1, -2))
    return torch.stack(heads, dim=1)


def _fft_toeplitz_inference(phi_q, phi_k, u, kernel_f, length):
    """`_fft_toeplitz_attention` without autograd: the channels are written straight into one zero-padded
    buffer, the FFTs reuse their outputs across heads, and the readout accumulates over the m features,
    so that the FFTs are most of the time."""
    batch, heads, n, m = phi_q.shape
    e = u.shape[-1]
    channels = phi_q.new_zeros(batch, m, e, length)  # the tail [n, length) stays zero for every head
    spectrum = toeplitz = None
    out = phi_q.new_empty(batch, heads, e, n)
    for h in range(heads):
        torch.mul(phi_k[:, h].transpose(-1, -2).unsqueeze(2), u[:, h].transpose(-1, -2).unsqueeze(1), out=channels[..., :n])
        spectrum = torch.fft.rfft(channels, out=spectrum)
        spectrum.mul_(kernel_f[h])
        toeplitz = torch.fft.irfft(spectrum, n=length, out=toeplitz)  # D_i for every i in [..., :n]
        q_h = phi_q[:, h].transpose(-1, -2).unsqueeze(2)  # [B, m, 1, n]
        acc = torch.mul(toeplitz[:, 0, :, :n], q_h[:, 0], out=out[:, h])
        for feature in range(1, m):
            acc.addcmul_(toeplitz[:, feature, :, :n], q_h[:, feature])
    return out.transpose(-1, -2)


def _banded_toeplitz_attention(phi_q, phi_k, value, c, band_width, causal):
    """C = c_far^- [j < i] + c_far^+ [j > i] + a band of width W, all matmuls.

    The sequence is cut into chunks of size s with R s >= W - 1 (R chunks of reach). Queries of
    chunk k see the keys of chunks k-R .. k+R (a window of (2R+1)s keys) with their exact
    coefficients c_{j-i} (one [s, (2R+1)s] Toeplitz block shared by all chunks); every key of chunks
    <= k-R-1 is at distance >= Rs + 1 >= W and weighs c_far^-, every key of chunks >= k+R+1 weighs
    c_far^+: those enter through prefix / suffix sums of the chunk states phi_k^T u. Causal drops
    the chunks after k and the suffix sums.
    """
    batch, heads, n, m = phi_q.shape
    e = value.shape[-1] + 1
    reach, chunk = _banded_chunking(band_width)
    num_chunks = -(-n // chunk)
    if num_chunks <= 2 * reach + 1:  # the window covers the whole sequence: this is the dense product
        return _dense_toeplitz_attention(phi_q, phi_k, _values_and_ones(value), c)
    padded = num_chunks * chunk
    window = (2 * reach + 1 if not causal else reach + 1) * chunk
    # Keys get R zero chunks in front (and behind, unless causal): chunk k's window then starts at
    # row k s of its head's keys, so unfolding the rows with step s yields exactly one window per chunk.
    pads = (0, 0, reach * chunk, padded - n + (0 if causal else reach * chunk))
    k_rows = F.pad(phi_k, pads).view(batch * heads, -1, m)
    u_rows = _values_and_ones(value, pads[2], pads[3]).view(batch * heads, -1, e)
    q_chunks = (F.pad(phi_q, (0, 0, 0, padded - n)) if padded > n else phi_q).reshape(-1, chunk, m)

    # Near part. Query a and window key w are at distance r = w - R s - a; one [H, s, window]
    # coefficient block serves every chunk (clamped entries only ever meet zero keys).
    # The autograd.Functions loop over groups of chunks and write into strided `out=` views, which dynamo
    # cannot trace (and would unroll per chunk); compiled, the same products are traced as whole-tensor ops,
    # and the block is built without a gather (`_diagonals`): c extended by its edge values is c clamped.
    compiling = torch.compiler.is_compiling()
    if compiling:
        edge = (reach + 1) * chunk
        extended = torch.cat([c[:, :1].expand(-1, edge), c, c[:, -1:].expand(-1, edge)], dim=-1)
        start = n - (reach + 1) * chunk + edge
        coefficients = _diagonals(extended[:, start : start + chunk + window - 1], chunk, window)
        out = _band_window_product(q_chunks, k_rows, u_rows, coefficients)
    else:
        offsets = torch.arange(window, device=c.device)[None, :] - reach * chunk - torch.arange(chunk, device=c.device)[:, None]
        coefficients = c[:, (offsets + n - 1).clamp(0, 2 * n - 2)]
        out = _BandWindowProduct.apply(q_chunks, k_rows, u_rows, coefficients)

    # Far part: chunk k gets c_far^- times the states of chunks <= k-R-1 (and c_far^+ times those >= k+R+1).
    states = torch.bmm(k_rows.view(-1, chunk, m).transpose(-1, -2), u_rows.view(-1, chunk, e))
    states = states.view(batch, heads, -1, m * e)  # [B, H, R + chunks (+ R), m e], the padding chunks hold zeros
    far_states = _far_states if compiling else _FarStates.apply
    far = far_states(states, c[:, 0], None if causal else c[:, -1], num_chunks, reach)
    out = out.baddbmm_(q_chunks, far.view(-1, m, e))
    return out.view(batch, heads, padded, e)[:, :, :n]


def _band_window_product(q, k_rows, u_rows, coefficients):
    """`_BandWindowProduct` in whole-tensor ops (for torch.compile; autograd derives the backward): all
    chunks' [s, window] weights at once instead of a group at a time."""
    heads, chunk, window = coefficients.shape
    sequences = k_rows.shape[0]
    k_windows = _chunk_windows(k_rows, chunk, window // chunk)  # [B*H, chunks, window, m]
    u_windows = _chunk_windows(u_rows, chunk, window // chunk)  # [B*H, chunks, window, e]
    weights = q.view(sequences, -1, chunk, q.shape[-1]) @ k_windows.transpose(-1, -2)  # [B*H, chunks, s, window]
    weights = weights.view(-1, heads, *weights.shape[1:]) * coefficients[:, None]  # sequence b*H + h has head h
    return (weights.view(sequences, *weights.shape[2:]) @ u_windows).view(q.shape[0], chunk, u_rows.shape[-1])


def _chunk_windows(rows, chunk, width):
    """[B*H, chunks, width * s, f]: chunk k's window, rows k s .. (k + width) s of rows [B*H, (chunks + width - 1) s,
    f], as whole chunks side by side. Not `unfold`: inductor (torch 2.13, CPU, more than one thread) computes the
    backward of overlapping windows wrong."""
    sequences, length, features = rows.shape
    chunks = rows.view(sequences, length // chunk, chunk, features)
    count = length // chunk - width + 1
    return torch.cat([chunks[:, offset : offset + count] for offset in range(width)], dim=2)


def _far_states(states, c_before, c_after, num_chunks, reach):
    """`_FarStates` in whole-tensor ops (for torch.compile): prefix and suffix sums through cumsum."""
    heads = states.shape[1]
    # before[k] = sum_{j <= k-1} states[j]
    before = F.pad(states[:, :, : num_chunks - 1].cumsum(2), (0, 0, 1, 0))
    far = before * c_before.view(1, heads, 1, 1)
    if c_after is not None:
        # after[k] = sum_{j >= k+2R+1} states[j]; nothing for the last chunk
        tail = states[:, :, 2 * reach + 1 :].flip(2).cumsum(2).flip(2)
        far = far + F.pad(tail, (0, 0, 0, 1)) * c_after.view(1, heads, 1, 1)
    return far


class _BandWindowProduct(torch.autograd.Function):
    """out[k] = ((q[k] @ K_k) * coefficients) @ U_k for every chunk k, K_k / U_k its window of keys.

    q: [B*H*chunks, s, m]; k_rows: [B*H, rows, m], u_rows: [B*H, rows, e] with chunk k's window at
    rows k*s .. k*s + window of its head; coefficients: [H, s, window]. The [chunks, s, window]
    weights are the largest tensors of the banded algorithm: forward scales them in place, a group of
    chunks at a time so that they stay in cache, and backward recomputes them instead of keeping them.
    """

    @staticmethod
    def forward(ctx, q, k_rows, u_rows, coefficients):
        heads, chunk, window = coefficients.shape
        sequences = k_rows.shape[0]
        num_chunks = q.shape[0] // sequences
        k_windows = k_rows.unfold(1, window, chunk)  # [B*H, chunks, m, window], a view
        u_windows = u_rows.unfold(1, window, chunk).transpose(-1, -2)  # [B*H, chunks, window, e]
        out = q.new_empty(q.shape[0], chunk, u_rows.shape[-1])
        buffer = q.new_empty(min(BANDED_GROUP, num_chunks), chunk, window)  # reused: no allocation per group
        for sequence, first, last, rows in _chunk_groups(sequences, num_chunks):
            weights = torch.bmm(q[rows], k_windows[sequence, first:last], out=buffer[: last - first])
            torch.bmm(weights.mul_(coefficients[sequence % heads]), u_windows[sequence, first:last], out=out[rows])
        ctx.save_for_backward(q, k_rows, u_rows, coefficients)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_rows, u_rows, coefficients = ctx.saved_tensors
        heads, chunk, window = coefficients.shape
        sequences = k_rows.shape[0]
        num_chunks = q.shape[0] // sequences
        k_windows = k_rows.unfold(1, window, chunk)  # [B*H, chunks, m, window]
        u_windows = u_rows.unfold(1, window, chunk)  # [B*H, chunks, e, window]
        grad_out = grad_out.contiguous()
        grad_q = torch.empty_like(q)
        grad_k = torch.zeros_like(k_rows)
        grad_u = torch.zeros_like(u_rows)
        grad_coefficients = torch.zeros_like(coefficients) if ctx.needs_input_grad[3] else None
        group = min(BANDED_GROUP, num_chunks)  # per-group buffers, reused: no allocation per group
        buffers = [q.new_empty(group, chunk, window) for _ in range(3)]
        grad_u_windows = q.new_empty(group, window, u_rows.shape[-1])
        grad_k_windows = q.new_empty(group, window, q.shape[-1])
        for sequence, first, last, rows in _chunk_groups(sequences, num_chunks):
            coefficient, count = coefficients[sequence % heads], last - first
            q_group, grad_group = q[rows], grad_out[rows]
            k_group, u_group = k_windows[sequence, first:last], u_windows[sequence, first:last]
            scores = torch.bmm(q_group, k_group, out=buffers[0][:count])
            grad_weights = torch.bmm(grad_group, u_group, out=buffers[1][:count])
            if grad_coefficients is not None:
                grad_coefficients[sequence % heads] += torch.mul(scores, grad_weights, out=buffers[2][:count]).sum(0)
            weights = scores.mul_(coefficient)
            torch.bmm(weights.transpose(-1, -2), grad_group, out=grad_u_windows[:count])
            _fold_windows(grad_u_windows[:count], grad_u[sequence], first, chunk)
            grad_scores = grad_weights.mul_(coefficient)
            torch.bmm(grad_scores, k_group.transpose(-1, -2), out=grad_q[rows])
            torch.bmm(grad_scores.transpose(-1, -2), q_group, out=grad_k_windows[:count])
            _fold_windows(grad_k_windows[:count], grad_k[sequence], first, chunk)
        return grad_q, grad_k, grad_u, grad_coefficients


def _chunk_groups(sequences, num_chunks):
    """(sequence, first, last, rows): groups of BANDED_GROUP chunks, rows their slice of [B*H*chunks, ...]."""
    for sequence in range(sequences):
        for first in range(0, num_chunks, BANDED_GROUP):
            last = min(first + BANDED_GROUP, num_chunks)
            yield sequence, first, last, slice(sequence * num_chunks + first, sequence * num_chunks + last)


def _fold_windows(window_grads, rows, first, chunk):
    """Add the gradients of overlapping windows onto their rows: window_grads [G, window, f] belongs to
    windows first .. first + G, window k covering rows k*s .. k*s + window of `rows` [rows, f]."""
    count, window, features = window_grads.shape
    for block in range(window // chunk):  # window_grads[k, block] belongs to rows (first + k + block) * s ...
        start = (first + block) * chunk
        rows[start : start + count * chunk].view(count, chunk, features).add_(window_grads[:, block * chunk : (block + 1) * chunk])


class _FarStates(torch.autograd.Function):
    """far[k] = c_before * sum_{j <= k-1} states[j] + c_after * sum_{j >= k+2R+1} states[j] for k < chunks.

    states: [B, H, S, f] chunk states in the padded layout (R zero chunks in front, so j <= k-1 are
    the chunks at least R+1 before chunk k); c_before, c_after: [H] (c_after None when causal).
    Returns [B, H, chunks, f]. Running sums updated in place, one chunk at a time: a single pass over
    the states each way (torch.cumsum plus flips and pads cost many more on CPU).
    """

    @staticmethod
    def forward(ctx, states, c_before, c_after, num_chunks, reach):
        batch, heads, slots, features = states.shape
        far = states.new_empty(batch, heads, num_chunks, features)
        far[:, :, 0].zero_()
        scale = c_before.view(1, heads, 1)
        for k in range(1, num_chunks):
            torch.addcmul(far[:, :, k - 1], states[:, :, k - 1], scale, out=far[:, :, k])
        if c_after is not None:
            scale = c_after.view(1, heads, 1)
            running = states.new_zeros(batch, heads, features)
            for k in range(num_chunks - 2, -1, -1):
                running.addcmul_(states[:, :, k + 2 * reach + 1], scale)
                far[:, :, k].add_(running)
        ctx.save_for_backward(states, c_before, c_after)
        ctx.num_chunks, ctx.reach = num_chunks, reach
        return far

    @staticmethod
    def backward(ctx, grad_far):
        states, c_before, c_after = ctx.saved_tensors
        num_chunks, gap = ctx.num_chunks, 2 * ctx.reach + 1
        batch, heads, slots, features = states.shape
        # before[j] = sum_{k > j} grad_far[k]; after[j] = sum_{k <= j - gap} grad_far[k].
        before = torch.zeros_like(states)
        for j in range(num_chunks - 2, -1, -1):
            torch.add(before[:, :, j + 1], grad_far[:, :, j + 1], out=before[:, :, j])
        grad_before = (before * states).sum((0, 2, 3)) if ctx.needs_input_grad[1] else None
        grad_states = before.mul_(c_before.view(1, heads, 1, 1))
        grad_after = None
        if c_after is not None:
            after = torch.zeros_like(states)
            for j in range(gap, gap + num_chunks - 1):
                torch.add(after[:, :, j - 1], grad_far[:, :, j - gap], out=after[:, :, j])
            if ctx.needs_input_grad[2]:
                grad_after = (after * states).sum((0, 2, 3))
            grad_states.add_(after.mul_(c_after.view(1, heads, 1, 1)))
        return grad_states, grad_before, grad_after, None, None


def _banded_chunking(band_width):
    """(reach R, chunk size s) with R s >= W - 1: smaller chunks waste less of the window."""
    reach = BANDED_REACH
    chunk = max(-(-(band_width - 1) // reach), BANDED_MIN_CHUNK)
    return reach, chunk


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _compute_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _features(query, key, projection, mask, dtype, logit_scale=None, head_major=False, variant="nprf"):
    """phi(q_hat), phi(k_hat) [B, H, n, m] in `dtype` (the variant's feature map), padded keys zeroed (after the
    map: phi(0) != 0)."""
    if variant == "nprf":
        phi_q = _normalized_features(query.to(dtype), projection, logit_scale, head_major)
        phi_k = _normalized_features(key.to(dtype), projection, logit_scale, head_major)
    else:
        phi_q, phi_k = (variant_features(x.to(dtype), projection, variant) for x in (query, key))
    if mask is not None:  # in place when autograd does not need the features as they are
        keep = mask[:, None, :, None]
        phi_k = phi_k * keep if torch.is_grad_enabled() and phi_k.requires_grad else phi_k.mul_(keep)
    return phi_q, phi_k


def _exact_kernel(query, key, mask, causal, logit_scale, variant):
    """[B, H, n, n] exp(logits - row max) of the exact variants, zero for padded and (causal) future keys:
    logits s q_hat . k_hat ("normalized_softmax") or q . k / sqrt(d) ("softmax"). A per-row factor cancels in
    the normalization (the word-matching term is a multiple of the kernel too)."""
    n, head_dim = query.shape[-2], query.shape[-1]
    if variant == "normalized_softmax":
        query = query / _row_norms(query).clamp_min(NORM_EPS)
        key = key / _row_norms(key).clamp_min(NORM_EPS)
        if logit_scale is not None:
            query = query * logit_scale.to(query.dtype)[:, None, None]
        logits = query @ key.transpose(-1, -2)
    else:
        logits = query @ key.transpose(-1, -2) / math.sqrt(head_dim)
    allowed = torch.ones(n, n, dtype=torch.bool, device=query.device)
    if causal:
        allowed = torch.tril(allowed)
    allowed = allowed[None, None] if mask is None else allowed & (mask[:, None, None, :] > 0)
    shift = logits.masked_fill(~allowed, float("-inf")).amax(-1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # rows with no key
    return torch.exp((logits - shift).masked_fill(~allowed, float("-inf")))


def _masked_bias(bias, n, causal):
    """[H, 2n-1] bias with -inf for r > 0 when causal."""
    if not causal:
        return bias
    future = torch.arange(2 * n - 1, device=bias.device) > n - 1
    return bias.masked_fill(future, float("-inf"))


def _values_and_ones(value, before=0, after=0):
    """[B, H, before + n + after, d_v + 1]: the numerator's values and the denominator's ones column for
    the n rows of `value` [B, H, n, d_v], with zero rows before and after; every element written once."""
    batch, heads, n, d = value.shape
    u = value.new_empty(batch, heads, before + n + after, d + 1)
    u[:, :, :before] = 0.0
    u[:, :, before + n :] = 0.0
    u[:, :, before : before + n, :d] = value
    u[:, :, before : before + n, d] = 1.0
    return u


def _toeplitz(c, n):
    """[H, 2n-1] -> [H, n, n] with entry (i, j) = c_{j-i}."""
    if torch.compiler.is_compiling():
        return _diagonals(c, n, n)
    positions = torch.arange(n, device=c.device)
    return c[:, positions[None, :] - positions[:, None] + n - 1]


def _diagonals(sequence, rows, cols):
    """[..., rows, cols] with entry (a, w) = sequence[..., w - a + rows - 1], from sequence [..., rows + cols - 1],
    by reshapes alone: the rows, each padded by one element and laid end to end, are read back one element short,
    so row a starts a elements later. For torch.compile: the backward of a gather is a scatter-add, which
    inductor (torch 2.13, CPU) can fuse with its neighbours into wrong results; the backward of this is sums."""
    batch, length = sequence.shape[:-1], sequence.shape[-1]
    padded = F.pad(sequence.unsqueeze(-2).expand(*batch, rows, length), (0, 1))
    skewed = padded.reshape(*batch, rows * (length + 1))[..., : rows * length].view(*batch, rows, length)
    return skewed[..., rows - 1 :]


def _infer_band_width(bias, n):
    """Smallest W with bias[:, r] constant over r >= W and over r <= -W (W = n: no band)."""
    after = (bias[:, n:] != bias[:, -1:]).any(0)  # r = 1 .. n-1
    before = (bias[:, : n - 1] != bias[:, :1]).any(0)  # r = -(n-1) .. -1
    width_after = int(after.nonzero().max().item()) + 2 if bool(after.any()) else 1
    width_before = n - int(before.nonzero().min().item()) if bool(before.any()) else 1
    return max(width_after, width_before)


def _fft_length(minimum):
    """Smallest 2^a 3^b 5^c >= minimum (fast sizes for pocketfft / cuFFT)."""
    best = 1 << max(minimum - 1, 0).bit_length()
    power5 = 1
    while power5 < best:
        power35 = power5
        while power35 < best:
            size = power35
            while size < minimum:
                size *= 2
            best = min(best, size)
            power35 *= 3
        power5 *= 5
    return best


def _banded_window(band_width, m, e):
    """Per-token cost proxy of the banded algorithm, in keys of a dense row."""
    reach, chunk = _banded_chunking(band_width)
    return (2 * reach + 1) * chunk + 2 * m * e / (m + e)


def _resolve_algorithm(algorithm, bias, n, band_width, m, e, inference=False):
    """Pick the algorithm for `auto` (`inference`: no autograd, which favours dense longer) and the band width
    for `banded`."""
    tied = band_width is not None
    if tied and algorithm in ("auto", "banded") and not torch.compiler.is_compiling():
        inferred = _infer_band_width(bias.detach(), n)  # a host sync: checked in eager mode only
        if inferred > band_width:
            raise ValueError(
                f"band_width={band_width} but rpe_bias is not constant beyond it (it varies up to |r| = {inferred - 1})"
            )
    if not tied and algorithm in ("auto", "banded"):
        band_width = _infer_band_width(bias.detach(), n)
        if bias.requires_grad and torch.is_grad_enabled():
            if algorithm == "banded":
                raise ValueError(
                    "algorithm='banded' with an rpe_bias that requires grad needs band_width (the width of the "
                    "bias's tied structure, e.g. rpe_band_width(num_buckets, max_distance)) for exact gradients"
                )
            band_width = n  # without the tied structure auto may not use banded
    if algorithm != "auto":
        return algorithm, band_width
    reach, chunk = _banded_chunking(band_width)
    has_band = (2 * reach + 1) * chunk < n
    if has_band:
        factor = AUTO_DENSE_FACTOR_INFERENCE if inference else AUTO_DENSE_FACTOR
        return ("dense" if n <= factor * _banded_window(band_width, m, e) else "banded"), band_width
    return ("fft" if n >= AUTO_FFT_MIN_LENGTH else "dense"), band_width


def _check_inputs(query, key, value, rpe_bias, projection, key_padding_mask, algorithm):
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if query.dim() != 4 or key.shape != query.shape:
        raise ValueError(f"query and key must both be [B, H, n, d], got {tuple(query.shape)} and {tuple(key.shape)}")
    batch, heads, n, head_dim = query.shape
    if value.dim() != 4 or value.shape[:3] != query.shape[:3]:
        raise ValueError(f"value must be [B={batch}, H={heads}, n={n}, d_v], got {tuple(value.shape)}")
    if n < 1:
        raise ValueError("the sequence is empty (n = 0)")
    if rpe_bias.shape != (heads, 2 * n - 1):
        raise ValueError(f"rpe_bias must be [H={heads}, 2n-1={2 * n - 1}], got {tuple(rpe_bias.shape)}")
    if projection.dim() not in (2, 3) or projection.shape[-1] != head_dim or (
        projection.dim() == 3 and projection.shape[0] != heads
    ):
        raise ValueError(f"projection must be [m, d={head_dim}] or [H={heads}, m, d={head_dim}], got {tuple(projection.shape)}")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, n):
            raise ValueError(
                f"key_padding_mask must be [B={batch}, n={n}] (True/1 = keep), got {tuple(key_padding_mask.shape)}"
            )
        if (
            key_padding_mask.dtype != torch.bool
            and not torch.compiler.is_compiling()  # a host sync: checked in eager mode only
            and not bool(((key_padding_mask == 0) | (key_padding_mask == 1)).all())
        ):
            raise ValueError("key_padding_mask must be boolean or hold only 0/1 (1 = keep); got other values")
    return batch, heads, n, head_dim


def _segment_factors(segment_bias):
    """exp(0) and exp(beta) per head [H], both divided by the larger (ratios are what count): <= 1."""
    top = segment_bias.clamp_min(0.0)
    return torch.exp(-top), torch.exp(segment_bias - top)


def _segmented_product(toeplitz_product, phi_k, segment_ids, segment_bias, num_segments=None):
    """sum_j c_{j-i} exp(beta [s_i != s_j]) (phi_q_i . phi_k_j) u_j: one Toeplitz product per key segment
    (keys of the other segments zeroed), each weighted per query by exp(0) or exp(beta). Segments: those
    present (a host sync), or under torch.compile all of range(num_segments) when given."""
    same, other = _segment_factors(segment_bias)
    out = None
    if num_segments is not None and torch.compiler.is_compiling():
        segments = range(num_segments)
    else:
        segments = torch.unique(segment_ids).tolist()
    for segment in segments:
        in_segment = segment_ids == segment  # [B, n]
        part = toeplitz_product(phi_k * in_segment[:, None, :, None].to(phi_k.dtype))
        weight = torch.where(in_segment[:, None, :, None], same[:, None, None], other[:, None, None])  # [B, H, n, 1]
        out = part * weight if out is None else out + part * weight
    return out


def _match_product(phi_q, phi_k, u, token_ids, segment_ids, algorithm="banded"):
    """sum over keys j with t_j = t_i and s_j != s_i of (phi_q_i . phi_k_j) u_j: [B, H, n, e]. Where the
    attention itself is dense (short inputs), the n x n match mask is cheapest; otherwise the keys' states
    phi_k u^T are summed per (batch, token) and per (batch, segment, token) group (linear in n) and a
    query reads its token's total minus its own segment's part."""
    if algorithm == "dense":
        matches = _token_matches(token_ids, segment_ids)[:, None].to(phi_q.dtype)
        return ((phi_q @ phi_k.transpose(-1, -2)) * matches) @ u
    batch, heads, n, m = phi_k.shape
    e = u.shape[-1]
    states = (phi_k.unsqueeze(-1) * u.unsqueeze(-2)).transpose(1, 2).reshape(batch * n, heads, m, e)
    rows = torch.arange(batch, device=token_ids.device)[:, None].expand(batch, n)
    by_token, token_groups = _group_ids(torch.stack([rows, token_ids]).reshape(2, -1))
    by_segment, segment_groups = _group_ids(torch.stack([rows, segment_ids, token_ids]).reshape(3, -1))
    totals = states.new_zeros(token_groups, heads, m, e).index_add(0, by_token, states)
    parts = states.new_zeros(segment_groups, heads, m, e).index_add(0, by_segment, states)
    others = (totals[by_token] - parts[by_segment]).view(batch, n, heads, m, e)
    return torch.einsum("bhnm,bnhme->bhne", phi_q, others)


def _group_ids(keys):
    """(group of every column of keys [k, N], number of groups): equal columns share a group, numbered in
    the lexicographic order of the columns (as torch.unique's inverse). In eager mode the groups are counted
    (a host sync); under torch.compile, whose shapes must not depend on values, they come from stable sorts,
    one key at a time from the last, and N (every column alone) bounds their number."""
    if not torch.compiler.is_compiling():
        _, inverse = torch.unique(keys, dim=1, return_inverse=True)
        return inverse, int(inverse.max()) + 1
    order = torch.arange(keys.shape[1], device=keys.device)
    for key in reversed(keys):
        order = order[torch.argsort(key[order], stable=True)]
    ordered = keys[:, order]
    starts = F.pad((ordered[:, 1:] != ordered[:, :-1]).any(0), (1, 0))
    inverse = torch.empty_like(order).scatter_(0, order, starts.cumsum(0))
    return inverse, keys.shape[1]


def _token_matches(token_ids, segment_ids):
    """[B, n, n] bool: key j is query i's token in another segment."""
    return (token_ids[:, :, None] == token_ids[:, None, :]) & (segment_ids[:, :, None] != segment_ids[:, None, :])


def _match_scale(match_weight, bias, segment_bias):
    """mu [H] under the shifts of c (exp(-max b)) and of the segment factors (exp(-max(beta, 0))), so that
    exp(b + beta [s_i != s_j]) + mu keeps its ratios after both."""
    return match_weight * torch.exp(-bias.amax(dim=-1).detach()) * _segment_factors(segment_bias)[0]


def _check_matches(token_ids, match_weight, segment_ids, batch, heads, n, causal):
    if (token_ids is None) != (match_weight is None):
        raise ValueError("token_ids and match_weight go together: give both or neither")
    if token_ids is None:
        return
    if segment_ids is None or causal:
        raise ValueError("the word-matching term needs segment_ids (it matches tokens across segments) and causal=False")
    if token_ids.shape != (batch, n) or token_ids.is_floating_point():
        raise ValueError(f"token_ids must be integer [B={batch}, n={n}], got {token_ids.dtype} {tuple(token_ids.shape)}")
    if match_weight.shape != (heads,):
        raise ValueError(f"match_weight must be [H={heads}] (one weight per head), got {tuple(match_weight.shape)}")
    if not torch.compiler.is_compiling() and not bool((match_weight >= 0).all()):
        raise ValueError("match_weight must be >= 0 (it adds attention weight to matching tokens)")


def _check_segments(segment_ids, segment_bias, batch, heads, n):
    if (segment_ids is None) != (segment_bias is None):
        raise ValueError("segment_ids and segment_bias go together: give both or neither")
    if segment_ids is None:
        return
    if segment_ids.shape != (batch, n) or segment_ids.is_floating_point():
        raise ValueError(f"segment_ids must be integer [B={batch}, n={n}], got {segment_ids.dtype} {tuple(segment_ids.shape)}")
    if segment_bias.shape != (heads,):
        raise ValueError(f"segment_bias must be [H={heads}] (one bias per head), got {tuple(segment_bias.shape)}")


def _check_logit_scale(logit_scale, heads):
    if logit_scale is None:
        return
    if logit_scale.shape != (heads,):
        raise ValueError(f"logit_scale must be [H={heads}] (one scale per head), got {tuple(logit_scale.shape)}")
    if not torch.compiler.is_compiling() and not bool((logit_scale > 0).all()):
        raise ValueError("logit_scale must be > 0 for every head")
