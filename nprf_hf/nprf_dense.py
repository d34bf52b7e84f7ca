# coding=utf-8
"""The dense algorithm: the n x n weights kappa(q_i, k_j) c_{j-i}, then one matmul. O(n^2 (m + e)); the fastest
below about 1.6 banded windows (`functional.AUTO_DENSE_FACTOR*`) and the only one for the quadratic variants,
whose exact kernels (`exact_kernel`) do not factor into features.

Products take phi_q, phi_k [B, H, n, m] (padded keys zeroed), u [B, H, n, e] and c [H, 2n - 1] and return
sum_j c_{j-i} (phi_q_i . phi_k_j) u_j: [B, H, n, e]. Two execution modes side by side: autograd
(`dense_toeplitz_attention`) and inference in cache (`dense_toeplitz_inference`).
"""

import math

import torch

from .nprf_features import NORM_EPS, row_norms
from .nprf_positions import toeplitz_matrix


# Bytes of n x n weights the dense inference product scales and reads in one group: they stay in a
# core's L2 cache (2 MiB here) between the two matmuls instead of going to memory and back.
DENSE_GROUP_BYTES = 1 << 20


def dense_toeplitz_attention(phi_q, phi_k, u, c):
    """O(n^2 (m + e)): the n x n weights, then one matmul."""
    weights = (phi_q @ phi_k.transpose(-1, -2)) * toeplitz_matrix(c, phi_q.shape[-2])
    return weights @ u


def dense_toeplitz_inference(phi_q, phi_k, value, c, key_lengths):
    """`dense_toeplitz_attention` without autograd, from the values [B, H, n, d_v] (the denominators are the
    weights' row sums): a few heads at a time, so that their n x n weights are scaled by C and read twice
    while they are in cache, and each sequence's keys cut after its last kept one (`key_lengths` [B] ints;
    the keys after it are padding, whose features are zero). Features may be strided (head-major)."""
    batch, heads, n, _ = phi_q.shape
    d = value.shape[-1]
    toeplitz = toeplitz_matrix(c, n)
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


def key_lengths(mask, batch, n):
    """[B] Python ints: one past each sequence's last kept key (n without a mask); a host sync."""
    if mask is None:
        return [n] * batch
    positions = torch.arange(1, n + 1, device=mask.device, dtype=mask.dtype)
    return (mask * positions).amax(-1).to(torch.long).tolist()


def exact_kernel(query, key, mask, causal, logit_scale, variant):
    """[B, H, n, n] exp(logits - row max) of the exact variants, zero for padded and (causal) future keys:
    logits s q_hat . k_hat ("normalized_softmax") or q . k / sqrt(d) ("softmax"). A per-row factor cancels in
    the normalization (the word-matching term is a multiple of the kernel too)."""
    n, head_dim = query.shape[-2], query.shape[-1]
    if variant == "normalized_softmax":
        query = query / row_norms(query).clamp_min(NORM_EPS)
        key = key / row_norms(key).clamp_min(NORM_EPS)
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
