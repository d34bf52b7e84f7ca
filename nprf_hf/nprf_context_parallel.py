# coding=utf-8
"""Context parallelism: NPRF attention over a sequence sharded across the ranks of a process group, exact.

Rank p holds the contiguous shard [lo, hi) of the N tokens (the ranks in order). T5's buckets make b_r constant for
|r| >= W (`nprf_positions.rpe_band_width`), so for the queries of a shard

    keys in [lo - (W - 1), hi + (W - 1))  (the shard and a halo of W - 1 keys each side): exact coefficients c_{j-i},
        through the banded product of one process (`nprf_banded`) on that window;
    keys before / after that window: c_far^- phi_q . S^- and c_far^+ phi_q . S^+, where S^-/+ are the sums
        phi_k [v | 1]^T (m x (d_v + 1) per head) of those keys.

One collective per layer brings both: an all-gather of every rank's shard length, shard sum phi_k^T [v | 1] and
first and last W - 1 keys, values and padding flags (a halo wider than a neighbour's shard reads the shards beyond
it; the receiver maps the keys itself: d numbers a key, not m). S^- is the gathered sums of the shards before this
one minus the left halo's (counted exactly already), S^+ likewise; causal attention drops the keys after the query
(no right halo, no S^+). The all-gather is differentiable, so the
gradients summed over the ranks (as DDP and FSDP sum them) are one process's. Softmax's ring attention passes every
shard's K and V around the ring instead: (P - 1) / P x N x d x 2 per head and rank, growing with N.

`attention_nprf.context_parallel()` makes the NPRF models use this: the layers read its group at the edge and pass
it in; nothing here keeps state.
"""

import bisect
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from .nprf_banded import banded_toeplitz_attention
from .nprf_banded_recompute import _BandedBackward
# (training recomputes a shard's features in backward from the size at which one process's attention does)
from .nprf_dispatch import RECOMPUTE_MIN_BYTES
from .nprf_features import compute_dtype, normalize_attention, query_key_features, values_and_ones, variant_features
from .nprf_positions import masked_bias
from .nprf_schedule import SERIAL
from .options import ATTENTION_VARIANTS, KEY_VALUE_CACHE_VARIANTS


# The variants whose kernel factors into features (the quadratic ones build n x n weights: nothing to shard).
# (The exact near field's band is not sharded yet: the halo carries its keys, but the correction does not run here.)
FEATURE_VARIANTS = tuple(v for v in ATTENTION_VARIANTS if v not in KEY_VALUE_CACHE_VARIANTS)


class FeatureMap(NamedTuple):
    """phi of a variant (`nprf_features.variant_features`): its projection [m, d] or [H, m, d] and logit scale s [H]
    (None: 1), which every rank applies to its own keys and to the halo's."""

    projection: torch.Tensor
    variant: str
    logit_scale: Optional[torch.Tensor] = None

    def __call__(self, x):
        return variant_features(x, self.projection, self.variant, self.logit_scale)


class Halo(NamedTuple):
    """One side's halo, read from its owners' edges: keys [B, H, G, d], values [B, H, G, d_v], keep flags
    [B, 1, G, 1] (0 for a padded key)."""

    keys: torch.Tensor
    values: torch.Tensor
    keep: torch.Tensor


class _AllGather(torch.autograd.Function):
    """[P, ...]: every rank's `tensor`, in rank order. Backward sums every rank's gradient of this rank's slice
    (a reduce-scatter on NCCL; gloo has none, so an all-reduce there)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.new_empty(dist.get_world_size(group), *tensor.shape)
        dist.all_gather(list(out.unbind(0)), tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if dist.get_backend(ctx.group) == "nccl":
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
            return mine, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(tensor, group=None):
    """Differentiable all-gather: [P, *tensor.shape]."""
    return _AllGather.apply(tensor, dist.group.WORLD if group is None else group)


def shard_lengths(n, device, group=None):
    """[n_0, ..., n_{P-1}]: every rank's shard length (host ints; one small all-gather)."""
    group = dist.group.WORLD if group is None else group
    lengths = torch.zeros(dist.get_world_size(group), 1, dtype=torch.long, device=device)
    dist.all_gather(list(lengths.unbind(0)), torch.tensor([n], dtype=torch.long, device=device), group=group)
    return lengths[:, 0].tolist()


def shard_position_offset(input_ids, length, padding_idx, device, group):
    """What this rank's position ids start from, added to `past_key_values_length`: 0 outside `context_parallel`
    (`group` None); else the number of tokens in the shards before it, or with `padding_idx` (RoBERTa's positions
    count the real tokens) and input ids, [B, 1] counts of their real tokens per sequence."""
    if group is None:
        return 0
    if padding_idx is None or input_ids is None:
        return sum(shard_lengths(length, device, group)[: dist.get_rank(group)])
    counts = input_ids.ne(padding_idx).sum(1)  # [B]
    gathered = counts.new_empty(dist.get_world_size(group), *counts.shape)
    dist.all_gather(list(gathered.unbind(0)), counts.contiguous(), group=group)
    return gathered[: dist.get_rank(group)].sum(0)[:, None]


def band_bias(rpe_bias, band_width, total_length):
    """[H, 2W + 1]: b_r for r = -W .. W, from a bias [H, 2K - 1] (entry r + K - 1 holds b_r) tied beyond W; the
    ends (r = +-W) stand for every farther distance. A bias shorter than the band (K <= W) covers a sequence of
    at most K tokens only."""
    reach = (rpe_bias.shape[-1] + 1) // 2  # K
    if reach <= band_width and total_length > reach:
        raise ValueError(
            f"rpe_bias covers |r| <= {reach - 1}, but the sequence has {total_length} tokens and the band is "
            f"{band_width} wide: pass the bias of at least band_width + 1 distances (relative_position_bias(table, "
            "band_width + 1, ...))"
        )
    r = torch.arange(-band_width, band_width + 1, device=rpe_bias.device).clamp(-(reach - 1), reach - 1)
    return rpe_bias[:, r + reach - 1]


def halo_index(bounds, rank, halo, side):
    """(owner ranks, rows) of the halo keys of `rank` on one side ("left": the `halo` keys before its shard,
    "right": after it), clipped to the sequence: rows into the owners' last (left) or first (right) `halo` keys."""
    lo, hi = bounds[rank]
    total = bounds[-1][1]
    positions = range(max(0, lo - halo), lo) if side == "left" else range(hi, min(total, hi + halo))
    starts = [start for start, _ in bounds]
    owners, rows = [], []
    for g in positions:
        q = bisect.bisect_right(starts, g) - 1
        owners.append(q)
        rows.append(g - (bounds[q][1] - halo) if side == "left" else g - bounds[q][0])
    return owners, rows


def _edge(x, halo, side):
    """[B, H, halo, f]: the last (side "left": what later ranks' left halos read) or first ("right": what earlier
    ranks' right halos read) `halo` rows of x [B, H, n, f], zero rows filling a shard shorter than the halo."""
    n = x.shape[-2]
    rows = x[:, :, n - min(halo, n):] if side == "left" else x[:, :, : min(halo, n)]
    pad = x.new_zeros(*x.shape[:2], halo - rows.shape[-2], x.shape[-1])
    return torch.cat([pad, rows] if side == "left" else [rows, pad], dim=-2)


def context_parallel_attention(
    query,
    key,
    value,
    rpe_bias,
    projection,
    band_width,
    key_padding_mask=None,
    causal=False,
    variant="nprf",
    terms=None,
    group=None,
    recompute=None,
):
    """`functional.nprf_attention` of a sequence sharded across the ranks of `group`, for this rank's shard.

    Args:
        query, key: [B, H, n_p, d], value: [B, H, n_p, d_v]: this rank's contiguous shard (the ranks in order).
        rpe_bias: [H, 2K - 1] (entry r + K - 1 holds b_r), constant beyond `band_width` (W); K >= W + 1, e.g.
            `relative_position_bias(table, W + 1, ...)`, or the one-process bias [H, 2N - 1].
        projection: [m, d] or [H, m, d]. key_padding_mask: [B, n_p] (True / 1 = keep) of this shard.
        terms: None or an `nprf_terms.AttentionTerms` holding the logit scale only.
        group: the process group (None: the default one).
        recompute: under autograd, keep only the inputs of the shard's products and recompute them in backward
            (None: when the shard's features take RECOMPUTE_MIN_BYTES), as `nprf_attention`'s.
    Returns:
        [B, H, n_p, d_v], this shard's rows of the one-process output.
    """
    group = dist.group.WORLD if group is None else group
    logit_scale = None
    if terms is not None:
        for term in terms.terms:
            if term.name != "logit_scale":
                raise NotImplementedError(f"context-parallel attention does not support the {term.name} term yet")
        logit_scale = terms.logit_scale
    if variant not in FEATURE_VARIANTS:
        raise NotImplementedError(f"context-parallel attention runs the feature variants {FEATURE_VARIANTS}, "
                                  f"not {variant!r} (the quadratic variants' n x n weights do not shard; the exact "
                                  "near field's band correction is not sharded yet: run it on one process)")
    if query.dim() != 4 or key.shape != query.shape or value.shape[:3] != query.shape[:3]:
        raise ValueError(f"query, key and value must be [B, H, n, d], got {tuple(query.shape)}, {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    with torch.autocast(query.device.type, enabled=False):
        out = sharded_attention(query, key, value, rpe_bias, band_width, FeatureMap(projection, variant, logit_scale),
                                key_padding_mask, causal, dist.get_rank(group), group, recompute)
    return out.to(query.dtype)


def sharded_attention(query, key, value, rpe_bias, band_width, features, key_padding_mask, causal, rank, group,
                      recompute=None):
    """`context_parallel_attention` of rank `rank`, autocast off; features: the `FeatureMap` phi."""
    halo = band_width - 1
    dtype = compute_dtype(query.dtype)
    mask = None if key_padding_mask is None else key_padding_mask.to(device=query.device, dtype=dtype)
    key, value = key.to(dtype), value.to(dtype)
    batch, heads, n, d = value.shape
    run = _stage_runner(query, key, value, rpe_bias, features, recompute)

    # One all-gather: the shard's length, its sum phi_k^T [v | 1] and its edge keys, values and flags (last W - 1,
    # and first W - 1 unless causal: sizes that do not depend on the shards' lengths, read from the same gather).
    state = run(_shard_state, key, value, mask, features)  # [B, H, m, e]
    keep = value.new_ones(batch, 1, n, 1) if mask is None else mask[:, None, :, None]
    sides = ("left",) if causal else ("left", "right")
    edges = [key, value, keep]
    parts = [value.new_full((1,), n), state] + [_edge(x, halo, side) for side in sides for x in edges]
    gathered = all_gather(torch.cat([p.flatten() for p in parts]), group)  # [P, F]
    pieces = gathered.split([p.numel() for p in parts], dim=1)
    lengths = [int(length) for length in pieces[0][:, 0].tolist()]
    if min(lengths) < 1:
        raise ValueError(f"every rank needs at least one token of the sequence; shard lengths {lengths}")
    ends = torch.tensor(lengths).cumsum(0).tolist()
    bounds = [(end - length, end) for length, end in zip(lengths, ends)]
    bias = band_bias(rpe_bias, band_width, ends[-1])
    world = gathered.shape[0]
    states = pieces[1].view(world, *state.shape)
    pieces = pieces[1:]
    halos = {"right": Halo(*(x.new_zeros(batch, x.shape[1], 0, x.shape[-1]) for x in edges))}
    for index, side in enumerate(sides):
        owners, rows = halo_index(bounds, rank, halo, side)
        owners, rows = (torch.tensor(x, dtype=torch.long, device=query.device) for x in (owners, rows))
        halos[side] = Halo(*(  # [B, H or 1, G, f]: the halo's rows, from their owners' edges
            piece.view(world, x.shape[0], x.shape[1], halo, x.shape[-1])[owners, :, :, rows].permute(1, 2, 0, 3)
            for piece, x in zip(pieces[1 + 3 * index : 4 + 3 * index], edges)
        ))
    bias = masked_bias(bias.to(dtype), band_width + 1, causal)
    c = torch.exp(bias - bias.amax(-1, keepdim=True).detach())  # [H, 2W + 1]; the far parts share its scale
    after = None if causal else states[rank + 1 :].sum(0)
    return run(_window_attention, query, key, value, mask, halos["left"], halos["right"], states[:rank].sum(0), after,
               c, features, causal)


def _stage_runner(query, key, value, bias, features, recompute):
    """How a stage runs: as it is, or (training on long shards) under non-reentrant checkpointing, which keeps only
    its inputs and recomputes its [B, H, n, m] features and products in backward, as `nprf_attention`'s recompute
    does. Only the stages without a collective are checkpointed: a recomputed collective would need every rank
    to recompute in the same order."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias, features.projection, features.logit_scale)
    )
    if recompute is None:
        feature_bytes = query.shape[0] * query.shape[1] * query.shape[2] * features.projection.shape[-2]
        feature_bytes *= value.element_size()
        recompute = feature_bytes >= RECOMPUTE_MIN_BYTES
    if not (recompute and needs_grad) or torch.compiler.is_compiling():
        return lambda stage, *inputs: stage(*inputs)
    return lambda stage, *inputs: checkpoint(stage, *inputs, use_reentrant=False, preserve_rng_state=False)


def _shard_state(key, value, mask, features):
    """[B, H, m, e]: sum_j phi_k_j [v_j | 1]^T over the shard's (kept) keys."""
    phi_k = features(key)
    if mask is not None:
        phi_k = phi_k * mask[:, None, :, None]
    return phi_k.transpose(-1, -2) @ values_and_ones(value)


def _window_attention(query, key, value, mask, left, right, before, after, c, features, causal):
    """The shard's output [B, H, n, d_v]: the window [lo - (W - 1), hi + (W - 1)) with its exact coefficients `c`
    [H, 2W + 1] (the `Halo`s `left`, `right`; the right one empty when causal), the keys beyond it through
    the gathered sums of the shards before / after this one (`before`, `after` [B, H, m, e]; None when causal)
    less the halo's, which the window counts."""
    band_width = (c.shape[-1] - 1) // 2
    dtype = value.dtype
    phi_q, phi_k = query_key_features(query, key, features.projection, mask, dtype, features.logit_scale,
                                      variant=features.variant)
    left_k, right_k = (features(halo.keys) * halo.keep for halo in (left, right))
    left_v, right_v = left.values, right.values
    batch, heads, n, m = phi_q.shape
    lead, trail = left_k.shape[-2], right_k.shape[-2]
    window = lead + n + trail
    r = torch.arange(-(window - 1), window, device=c.device).clamp(-band_width, band_width)
    q_window = torch.cat([phi_q.new_zeros(batch, heads, lead, m), phi_q, phi_q.new_zeros(batch, heads, trail, m)], 2)
    near = _BandedProduct.apply(  # the halo rows' queries are zero, their rows dropped
        q_window, torch.cat([left_k, phi_k, right_k], 2), torch.cat([left_v, value, right_v], 2),
        c[:, r + band_width], max(band_width, 1), causal,
    )[:, :, lead : lead + n]
    far = (before - left_k.transpose(-1, -2) @ values_and_ones(left_v)) * c[:, 0, None, None]
    if after is not None:
        far = far + (after - right_k.transpose(-1, -2) @ values_and_ones(right_v)) * c[:, -1, None, None]
    out = near + phi_q @ far
    return normalize_attention(out[..., :-1], out[..., -1:])


class _BandedProduct(_BandedBackward):
    """`banded_toeplitz_attention` that keeps only its inputs: its backward (`banded_toeplitz_backward`, inherited)
    works one sequence and head at a time, so a layer's backward holds one head's chunk buffers, not every head's."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, value, c, band_width, causal):
        ctx.save_for_backward(phi_q, phi_k, value, c)
        ctx.band_width, ctx.causal, ctx.threads = band_width, causal, SERIAL  # (the shards' threads: torch's)
        return banded_toeplitz_attention(phi_q, phi_k, value, c, band_width, causal)


def communicated_bytes(batch, heads, head_dim, num_features, band_width, world_size, causal=False, element_size=4):
    """Bytes one rank receives per layer in the forward all-gather: the other ranks' shard lengths (one number),
    shard sums (m x (d + 1) per head) and edge keys, values ((W - 1) x 2d per head) and padding flags (W - 1), once
    per side; per sequence, whatever the length."""
    sides = 1 if causal else 2
    per_rank = heads * (num_features * (head_dim + 1) + sides * (band_width - 1) * 2 * head_dim) + sides * (band_width - 1)
    return (world_size - 1) * (batch * per_rank + 1) * element_size


def ring_attention_bytes(batch, heads, head_dim, length, world_size, element_size=4):
    """Bytes one rank receives per layer in ring attention: every other shard's keys and values."""
    return 2 * (world_size - 1) * (length // world_size) * batch * heads * head_dim * element_size
