# coding=utf-8
"""Relative positions of NPRF attention: T5's buckets, the per-distance bias b_r, and the Toeplitz coefficients
c_r = exp(b_r) that every algorithm multiplies in (Luo et al., NeurIPS 2021, section 3.2).

Pure functions, no state. A bias is [H, 2n - 1] with entry r + n - 1 holding b_r for r = j - i.
"""

import math

import torch
import torch.nn.functional as F

from .nprf_schedule import SERIAL


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


def far_bucket_table(table, far_bias, bidirectional=True):
    """The bucket table with the farthest bucket of each direction fixed at `far_bias` (0 = the table as it is).

    T5's last bucket holds every |r| >= `rpe_band_width`, so this fixes b_r beyond the band. A large negative
    value (-30: c_r ~ 1e-13) makes attention local to the band: what a whole long document needs, when the
    source only ever attended within its position limit. The filled entries get no gradient.

    Args:
        table: [H, num_buckets].
    Returns:
        [H, num_buckets].
    """
    if not far_bias:
        return table
    buckets = table.shape[-1]
    farthest = torch.arange(buckets, device=table.device) == buckets - 1
    if bidirectional:  # the last bucket of r < 0 too
        farthest = farthest | (torch.arange(buckets, device=table.device) == buckets // 2 - 1)
    return table.masked_fill(farthest, far_bias)


def relative_position_bias(table, seq_len, bidirectional=True, num_buckets=32, max_distance=128, threads=SERIAL):
    """Expand a bucket table into the per-distance bias b_r.

    Args:
        table: [H, num_buckets].
        threads: an `nprf_schedule` scheduler (the CPU's, from the edge).
    Returns:
        [H, 2 * seq_len - 1]; entry r + seq_len - 1 holds b_r for r = j - i.
    """
    if table.dim() != 2 or table.shape[-1] != num_buckets:
        raise ValueError(f"table must be [num_heads, num_buckets={num_buckets}], got {tuple(table.shape)}")
    if torch.compiler.is_compiling():
        # The same values through a one-hot matmul, whose backward is a matmul too: inductor (torch 2.13, CPU)
        # can generate the gather's scatter-add backward with wrong indices, writing out of bounds (see `diagonals`).
        buckets = _distance_buckets(seq_len, bidirectional, num_buckets, max_distance, table.device)
        return table @ F.one_hot(buckets, num_buckets).to(table.dtype).t()
    with threads.small():  # [H, 2n - 1]: operators too small to split (each split a barrier)
        return _BucketGather.apply(table, seq_len, bidirectional, max_distance)


def _distance_buckets(seq_len, bidirectional, num_buckets, max_distance, device):
    """[2 seq_len - 1] bucket of every r = -(seq_len - 1) .. seq_len - 1."""
    r = torch.arange(-(seq_len - 1), seq_len, device=device)
    return t5_relative_position_bucket(r, bidirectional, num_buckets, max_distance)


class _BucketGather(torch.autograd.Function):
    """table[:, buckets] whose backward rebuilds the bucket index instead of keeping it: a gather keeps its
    [2n - 1] int64 index from forward to backward, 0.25 MiB at 16k tokens that long-input training then holds."""

    @staticmethod
    def forward(ctx, table, seq_len, bidirectional, max_distance):
        ctx.setup = (seq_len, bidirectional, table.shape[-1], max_distance)
        return table[:, _distance_buckets(*ctx.setup, table.device)]

    @staticmethod
    def backward(ctx, grad_bias):
        buckets = _distance_buckets(*ctx.setup, grad_bias.device)
        grad_table = grad_bias.new_zeros(grad_bias.shape[0], ctx.setup[2]).index_add(1, buckets, grad_bias)
        return grad_table, None, None, None


def masked_bias(bias, n, causal):
    """[H, 2n-1] bias with -inf for r > 0 when causal."""
    if not causal:
        return bias
    future = torch.arange(2 * n - 1, device=bias.device) > n - 1
    return bias.masked_fill(future, float("-inf"))


def toeplitz_coefficients(bias):
    """(c [H, 2n - 1], shift [H]): c_r = exp(b_r - max b) <= 1 (the ratios are shift-invariant) and the shift
    exp(-max b) that a summand term is scaled by."""
    top = bias.amax(dim=-1, keepdim=True).detach()
    return torch.exp(bias - top), torch.exp(-top[:, 0])


def toeplitz_matrix(c, n):
    """[H, 2n-1] -> [H, n, n] with entry (i, j) = c_{j-i}."""
    if torch.compiler.is_compiling():
        return diagonals(c, n, n)
    positions = torch.arange(n, device=c.device)
    return c[:, positions[None, :] - positions[:, None] + n - 1]


def diagonals(sequence, rows, cols):
    """[..., rows, cols] with entry (a, w) = sequence[..., w - a + rows - 1], from sequence [..., rows + cols - 1],
    by reshapes alone: the rows, each padded by one element and laid end to end, are read back one element short,
    so row a starts a elements later. For torch.compile: the backward of a gather is a scatter-add, which
    inductor (torch 2.13, CPU) can fuse with its neighbours into wrong results; the backward of this is sums."""
    batch, length = sequence.shape[:-1], sequence.shape[-1]
    padded = F.pad(sequence.unsqueeze(-2).expand(*batch, rows, length), (0, 1))
    skewed = padded.reshape(*batch, rows * (length + 1))[..., : rows * length].view(*batch, rows, length)
    return skewed[..., rows - 1 :]


def infer_band_width(bias, n):
    """Smallest W with bias[:, r] constant over r >= W and over r <= -W (W = n: no band)."""
    after = (bias[:, n:] != bias[:, -1:]).any(0)  # r = 1 .. n-1
    before = (bias[:, : n - 1] != bias[:, :1]).any(0)  # r = -(n-1) .. -1
    width_after = int(after.nonzero().max().item()) + 2 if bool(after.any()) else 1
    width_before = n - int(before.nonzero().min().item()) if bool(before.any()) else 1
    return max(width_after, width_before)


def pair_ids(ids, pairs=None):
    """(query side, key side) of per-token ids [B, n], broadcastable against weights [B, H, n, n] (pairs None) or
    against the layout of `pairs` (query positions, key positions: index tensors broadcastable to each other)."""
    if pairs is None:
        return ids[:, None, :, None], ids[:, None, None, :]
    return ids[:, pairs[0]].unsqueeze(1), ids[:, pairs[1]].unsqueeze(1)


def per_head(values, like):
    """values [H] shaped to broadcast against `like` [B, H, ...]."""
    return values.view(-1, *([1] * (like.dim() - 2)))
