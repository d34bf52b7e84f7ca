# coding=utf-8
"""The recurrent NPRF decode step: the math of `cache_nprf`'s constant-size state, pure functions.

With T5's unidirectional buckets the causal bias is constant for every distance >= W (W =
`rpe_band_width(num_buckets, max_distance, bidirectional=False)`), so for the query at position p

    numerator_p   = phi(q_p)^T [ c_far S_{p-W} + sum_{p-W < j <= p} c_{p-j} phi(k_j) v_j^T ]
    denominator_p = phi(q_p)^T [ c_far z_{p-W} + sum_{p-W < j <= p} c_{p-j} phi(k_j) ]

with S_t = sum_{j <= t} phi(k_j) v_j^T [m, d] and z_t = sum_{j <= t} phi(k_j) [m] (c_delta = exp(b_{-delta})).
A decoder therefore needs, per layer and head, only S, z of the keys older than the band and the
features and values of the last W - 1 keys: memory and time per generated token independent of the
context length. The prompt is attended by `nprf_attention` (dense / fft / banded, any length), then
the state is built from its keys.

Layout of the state (per layer): `far_states` [B, H, m, d + 1] holds [S | z] (one matmul serves
numerator and denominator), `ring_features` [B, H, W - 1, m] and `ring_values` [B, H, W - 1, d + 1]
the last W - 1 keys' phi(k) and [v | 1], oldest first (padded keys have phi(k) = 0: they count in
no sum). A step of one new token runs as one fused kernel per layer where `nprf_dispatch` chooses the Triton
kernels (`nprf_triton.triton_decode_step`), and as the PyTorch product below otherwise.
"""

from typing import NamedTuple

import torch

from .nprf_dispatch import ROUTING, StepCall, choose_route, run_step
from .nprf_features import compute_dtype, normalize_attention, values_and_ones, variant_features
from .nprf_positions import t5_relative_position_bucket, toeplitz_coefficients
from .nprf_schedule import SERIAL


# New tokens of one forward call are attended in blocks of at most this many queries: the dense
# [block, W - 1 + block] weights of a block stay small, and the cost stays linear in the block count.
DECODE_BLOCK = 128


class CausalBuckets(NamedTuple):
    """A decoder's unidirectional T5 bias: the bucket table [H, num_buckets] of distances up to max_distance, and W
    (`rpe_band_width(num_buckets, max_distance, bidirectional=False)`), from which the bias is constant."""

    table: torch.Tensor
    band_width: int
    num_buckets: int = 32
    max_distance: int = 128


def causal_distance_bias(table, band_width, num_buckets=32, max_distance=128):
    """The unidirectional bias by distance: [H, W + 1], entry delta = b_{-delta} for delta < W and entry W
    the far bias shared by every distance >= W.

    Args:
        table: [H, num_buckets] bucket table.
    """
    distance = torch.arange(band_width + 1, device=table.device)
    return table[:, t5_relative_position_bucket(-distance, False, num_buckets, max_distance)]


def recurrent_state_from_prefill(phi_k, u, band_width):
    """The state after a prompt of n keys: S, z of keys 0 .. n - W and the last W - 1 keys.

    Args:
        phi_k: [B, H, n, m] key features (padded keys zeroed). u: [B, H, n, e] values with a ones column.
    Returns:
        far_states [B, H, m, e], ring_features [B, H, W - 1, m], ring_values [B, H, W - 1, e]
        (zero rows in front when n < W - 1).
    """
    n = phi_k.shape[-2]
    ring = band_width - 1
    far = max(n - ring, 0)
    far_states = phi_k[:, :, :far].transpose(-1, -2) @ u[:, :, :far]
    missing = max(ring - n, 0)  # keys before the sequence start: zero rows, no weight
    # copies, not views: the state must not keep the whole prompt's features alive
    ring_features = torch.nn.functional.pad(phi_k[:, :, far:], (0, 0, missing, 0)).clone()
    ring_values = torch.nn.functional.pad(u[:, :, far:], (0, 0, missing, 0)).clone()
    return far_states, ring_features, ring_values


def recurrent_attention(phi_q, phi_k, u, far_states, ring_features, ring_values, c):
    """Attend L new tokens to the state of the keys before them and to each other, and advance the state.

    Args:
        phi_q, phi_k: [B, H, L, m] features of the new queries and keys (padded keys zeroed).
        u: [B, H, L, e] new values with a ones column.
        far_states, ring_features, ring_values: the state before the new tokens (see the module docstring).
        c: [H, W + 1] exp(bias) by distance (`causal_distance_bias`, shifted as the caller likes: ratios count).
    Returns:
        (out [B, H, L, e]: sum_j c phi(q).phi(k_j) [v_j | 1], the numerator and denominator of each query;
        far_states, ring_features, ring_values: the state after the new tokens). The inputs are not modified.
    """
    ring = ring_features.shape[-2]
    outputs = []
    for start in range(0, phi_q.shape[-2], DECODE_BLOCK):
        stop = min(start + DECODE_BLOCK, phi_q.shape[-2])
        q, length = phi_q[:, :, start:stop], stop - start
        # The window: the W - 1 previous keys then the block's own, oldest first.
        window_features = torch.cat([ring_features, phi_k[:, :, start:stop]], dim=-2)
        window_values = torch.cat([ring_values, u[:, :, start:stop]], dim=-2)
        # Query a of the block sits at window row ring + a; key w is at distance ring + a - w (< 0: future).
        distance = ring + torch.arange(length, device=c.device)[:, None] - torch.arange(ring + length, device=c.device)
        weights = torch.where(distance >= 0, c[:, distance.clamp(0, ring + 1)], 0.0)  # [H, length, window]
        out = ((q @ window_features.transpose(-1, -2)) * weights) @ window_values
        out = out.addcmul_(q @ far_states, c[:, -1, None, None])  # keys older than the band: c_far [S | z]
        outputs.append(out)
        # The first `length` window keys leave the band for good: into S, z.
        far_states = far_states + window_features[:, :, :length].transpose(-1, -2) @ window_values[:, :, :length]
        ring_features, ring_values = window_features[:, :, length:].clone(), window_values[:, :, length:].clone()
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)
    return out, far_states, ring_features, ring_values


def key_features_and_values(key, value, new_mask, projection, variant, logit_scale, threads=SERIAL):
    """phi(k) [B, H, L, m] of the new keys (padded ones zeroed after the map: phi(0) != 0) and [v | 1]
    [B, H, L, d + 1], in the compute dtype."""
    dtype = compute_dtype(key.dtype)
    phi_k = variant_features(key.to(dtype), projection, variant, logit_scale)
    if new_mask is not None:
        phi_k = phi_k * new_mask[:, None, :, None].to(dtype)
    return phi_k, values_and_ones(value.to(dtype), threads=threads)


def recurrent_step(query, key, value, new_mask, state, buckets, projection, algorithm, variant, terms, routing=None,
                   threads=SERIAL):
    """Attend L new tokens to the state of the keys before them: (out [B, H, L, d], the state after them).

    query, key, value [B, H, L, d]; new_mask None or bool [B, L] of the new tokens; state (far_states,
    ring_features, ring_values); buckets: the `CausalBuckets` of the bias; terms: feature terms only; routing:
    `nprf_dispatch.Routing` (None: ROUTING); threads: the `nprf_schedule` scheduler (the cache's). What runs (one
    token on the fused kernel, or the PyTorch step) is `nprf_dispatch.choose_route`'s decision."""
    dtype = compute_dtype(query.dtype)
    c, _ = toeplitz_coefficients(causal_distance_bias(*buckets).to(dtype))
    step = StepCall(query, key, value, new_mask, tuple(state), c, projection, terms, variant, routing or ROUTING,
                    threads)
    return run_step(step, choose_route(step, algorithm), _pytorch_step)


def _pytorch_step(step):
    """`recurrent_step` by the PyTorch products."""
    query, dtype, logit_scale = step.query, compute_dtype(step.query.dtype), step.terms.logit_scale
    with step.threads.small(step.state[0].numel() * query.shape[2]):  # a decode step: small operators
        phi_k, u = key_features_and_values(step.key, step.value, step.new_mask, step.projection, step.variant,
                                           logit_scale, step.threads)
        phi_q = variant_features(query.to(dtype), step.projection, step.variant, logit_scale)
        sums, *state = recurrent_attention(phi_q, phi_k, u, *step.state, step.c)
        return normalize_attention(sums[..., :-1], sums[..., -1:]).to(query.dtype), state
