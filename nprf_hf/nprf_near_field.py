# coding=utf-8
"""The exact near field ("nprf_near"): pairs closer than W (|j - i| < W, by default the RPE band) weigh the exact
kernel exp(s q_hat . k_hat) instead of its random-feature estimate phi(q_hat) . phi(k_hat); farther pairs keep NPRF.
E[phi(x) . phi(y)] = exp(x . y), so both halves are on one scale and the normalizer stays one sum:

    w_ij = P_ij (exp(s q_hat_i . k_hat_j) [|j - i| < W] + phi_i . phi_j [|j - i| >= W])

with P_ij the position factor of every other term (c_{j-i}, segment and first-key factors, word matching). Three
forms: the `NearField` that the dense and banded products read themselves (their coefficient tile split into a far
part, times phi_q phi_k^T, and a near part, times exp(q_unit k_unit^T), in cache); the n x n kernel
(`near_field_kernel`, for the attention weights and dense calls with pair terms); and for the others (fft, or pair
terms, whose factors scale the keys a product is given) the band's correction (`near_field_correction`), which the
NPRF product's sums then add: sum_{|j-i|<W} P_ij (exp(s q_hat_i . k_hat_j) - phi_i . phi_j) [v_j | 1],
O(n W (d + m + e)), a chunk of queries at a time against the window of keys their band reaches. Pure functions.
"""

from typing import NamedTuple, Optional

import torch

from .nprf_features import NORM_EPS, row_norms


class NearField(NamedTuple):
    """The exact near field as a Toeplitz product reads it: exp(query_i . key_j) is the exact kernel of the pairs
    with |j - i| < width. query, key [B, H, n, d]: sqrt(s) x / |x|; key_mask [B, n] float (1 = keep) or None: a
    padded key's exact weight must be zeroed by the product (its features are zero, its unit vector is not)."""

    query: torch.Tensor
    key: torch.Tensor
    width: int
    key_mask: Optional[torch.Tensor] = None


def near_field_inputs(query, key, mask, logit_scale, width, dtype, units=()):
    """The `NearField` of query, key [B, H, n, d] (in `dtype`), mask [B, n] float (1 = keep) or None; `units`: their
    unit vectors sqrt(s) x / |x| if the feature map computed them already."""
    if not units:
        units = scaled_unit(query.to(dtype), logit_scale), scaled_unit(key.to(dtype), logit_scale)
    return NearField(*units, width, mask)


def split_near(coefficients, distance, width):
    """(far, near) parts of a coefficient tile by the distance j - i of its entries (broadcastable to it)."""
    inside = distance.abs() < width
    return coefficients.masked_fill(inside, 0.0), coefficients.masked_fill(~inside, 0.0)


def scaled_unit(x, logit_scale=None):
    """sqrt(s) x / |x| for x [B, H, n, d] (zero rows stay zero), s [H] or None (1): the vectors whose dot product
    is the near field's logit s q_hat . k_hat."""
    inverse = 1.0 / row_norms(x).clamp_min(NORM_EPS)
    if logit_scale is not None:
        inverse = inverse * logit_scale.to(x.dtype).sqrt()[:, None, None]
    return x * inverse


def band_of(n, width, device):
    """[n, n] bool: |j - i| < width."""
    positions = torch.arange(n, device=device)
    return (positions[None, :] - positions[:, None]).abs() < width


def near_field_kernel(phi_q, phi_k, near):
    """[B, H, n, n]: the exact kernel exp(near.query_i . near.key_j) inside the band |j - i| < near.width (zero for
    padded keys), phi_q_i . phi_k_j beyond (the features have padded keys zeroed already)."""
    exact = torch.exp(near.query @ near.key.transpose(-1, -2))
    if near.key_mask is not None:  # (a padded key's features are zero, its unit vector is not)
        exact = exact * near.key_mask[:, None, None, :]
    return torch.where(band_of(near.query.shape[-2], near.width, exact.device), exact, phi_q @ phi_k.transpose(-1, -2))


def near_field_chunk(width):
    """Queries per chunk of the correction: half the band (its window then holds about 2.5 W keys, of which 2 W - 1
    are in the band), at least 16 for matmuls worth their call."""
    return max(16, -(-width // 2))


def near_field_correction(near, phi_q, phi_k, u, c, causal, terms, shift, dtype):
    """sum over keys j with |j - i| < `near.width` (and j <= i when causal, j kept) of P_ij (exp(s q_hat_i . k_hat_j)
    - phi_q_i . phi_k_j) u_j: [B, H, n, e], what turns the NPRF product's sums into the near field's.

    near: the `NearField` of the call (`near_field_inputs`: unit vectors sqrt(s) x / |x| [B, H, n, d] in `dtype`,
    width, float key mask [B, n] or None); phi_q, phi_k [B, H, n, m] (padded keys zeroed, no term applied); u
    [B, H, n, e]; c [H, 2n - 1] the Toeplitz coefficients (0 for the future when causal); terms:
    `nprf_terms.AttentionTerms` (their pair weights on the window layout, `terms.weights`); shift [H]: the shift of
    c, as for the product."""
    batch, heads, n, _ = near.query.shape
    width, mask = near.width, near.key_mask
    chunk = near_field_chunk(width)
    chunks = -(-n // chunk)
    before, after = width - 1, 0 if causal else width - 1
    window = chunk + before + after
    keys_padded = chunks * chunk + before + after  # key rows: `before` in front, then n, then the rest
    device = near.query.device

    def windows(x):  # [B, H, n, f] -> [B, H, chunks, window, f]: chunk t's keys start at row t * chunk
        padded = x.new_zeros(batch, heads, keys_padded, x.shape[-1])
        padded[:, :, before : before + n] = x
        return padded.unfold(2, window, chunk).transpose(-1, -2)

    def queries(x):  # [B, H, n, f] -> [B, H, chunks, chunk, f]
        if chunks * chunk != n:
            x = torch.cat([x, x.new_zeros(batch, heads, chunks * chunk - n, x.shape[-1])], dim=2)
        return x.view(batch, heads, chunks, chunk, x.shape[-1])

    # positions of the window layout: query t * chunk + a, key t * chunk - before + w
    starts = torch.arange(chunks, device=device)[:, None] * chunk
    query_positions = (starts + torch.arange(chunk, device=device))[:, :, None]
    key_positions = (starts - before + torch.arange(window, device=device))[:, None, :]
    distance = key_positions - query_positions  # [chunks, chunk, window]
    inside = (distance.abs() < width) & (key_positions >= 0) & (key_positions < n) & (query_positions < n)
    if causal:
        inside = inside & (distance <= 0)
    exact = torch.exp(queries(near.query) @ windows(near.key).transpose(-1, -2))
    estimate = queries(phi_q) @ windows(phi_k).transpose(-1, -2)
    keep = inside.to(dtype)[None, None]
    if mask is not None:
        keep = keep * windows(mask[:, None, :, None].expand(batch, 1, n, 1)).transpose(-1, -2)
    difference = (exact - estimate) * keep  # [B, H, chunks, chunk, window]
    # the distance of (a, w) is the same in every chunk: one [H, 1, chunk, window] block of c serves them all
    coefficients = c[:, (distance[:1].clamp(-(n - 1), n - 1) + n - 1)]
    pairs = (query_positions.clamp_max(n - 1), key_positions.clamp(0, n - 1))
    weights = terms.weights(difference, coefficients[None], shift, dtype, pairs=pairs)
    out = weights @ windows(u)  # [B, H, chunks, chunk, e]
    return out.reshape(batch, heads, chunks * chunk, -1)[:, :, :n]

