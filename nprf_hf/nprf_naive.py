# coding=utf-8
"""The float64 reference of NPRF attention and its variants: the formulas of the paper written out with explicit
n x n matrices, sharing no code with the algorithms it checks (`functional`). Slow and exact; for tests.

    z_i = sum_j w_ij v_j / sum_j w_ij,
    w_ij = kappa(q_i, k_j) (exp(b_{j-i} + beta [s_i != s_j] + gamma [j = 0]) + mu [t_i = t_j, s_i != s_j])

for the keys j that are kept (padding) and allowed (j <= i when causal); rows with no such key are zero.
kappa per variant: phi(q_hat) . phi(k_hat) ("nprf", q_hat = sqrt(s) q / |q|), phi(q d^-1/4) . phi(k d^-1/4)
("prf"), (elu(q) + 1) . (elu(k) + 1) ("elu_linear"), exp(s q_hat . k_hat / ...) ("normalized_softmax": the kernel
NPRF estimates), exp(q . k / sqrt(d)) ("softmax"); phi(x) = exp(W x - |x|^2 / 2) / sqrt(m). "nprf_near": the exact
exp(q_hat . k_hat) for |j - i| < near_field_width, phi(q_hat) . phi(k_hat) beyond.
"""

import math

import torch


# The optional terms: keywords of `naive_attention_weights` as of `nprf_attention` (first_key_bias: gamma [H])
TERMS = ("logit_scale", "segment_ids", "segment_bias", "token_ids", "match_weight", "first_key_bias")


def naive_attention_weights(query, key, rpe_bias, projection=None, key_padding_mask=None, causal=False, variant="nprf",
                            near_field_width=None, **terms):
    """[B, H, n, n] float64 row-normalized weights; arguments as `functional.nprf_attention`, `terms` those of TERMS."""
    unknown = sorted(set(terms) - set(TERMS))
    if unknown:
        raise TypeError(f"naive_attention_weights got unknown terms {unknown}; known: {TERMS}")
    q, k, bias = (t.double() for t in (query, key, rpe_bias))
    batch, heads, n, _ = q.shape
    kernel = _kernel(q, k, projection, variant, terms.get("logit_scale"), near_field_width)
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    weights = kernel * _position_factor(bias[:, j - i + n - 1].expand(batch, heads, n, n), j, terms)
    allowed = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        allowed = j <= i
    allowed = allowed.expand(batch, 1, n, n)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.bool()[:, None, None, :]
    weights = torch.where(allowed, weights, 0.0)
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights / torch.where(total > 0, total, 1.0), 0.0)


def _kernel(q, k, projection, variant, logit_scale, near_field_width):
    """kappa(q_i, k_j) of the variant, [B, H, n, n], from q, k [B, H, n, d] in float64."""
    heads, n, d = q.shape[1:]
    if variant in ("nprf", "nprf_near", "normalized_softmax"):
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        if logit_scale is not None:
            root = logit_scale.double().sqrt()[:, None, None]
            q, k = q * root, k * root
    if variant in ("nprf", "nprf_near", "prf"):
        if variant == "prf":
            q, k = q * d ** -0.25, k * d ** -0.25
        w = projection.double()
        w = w.expand(heads, *w.shape) if w.dim() == 2 else w
        m = w.shape[1]
        phi_q = torch.exp(torch.einsum("bhnd,hmd->bhnm", q, w) - 0.5 * q.square().sum(-1, keepdim=True)) / math.sqrt(m)
        phi_k = torch.exp(torch.einsum("bhnd,hmd->bhnm", k, w) - 0.5 * k.square().sum(-1, keepdim=True)) / math.sqrt(m)
        kernel = phi_q @ phi_k.transpose(-1, -2)
        if variant == "nprf_near":
            rows, cols = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
            near = ((cols - rows).abs() < near_field_width).to(q.device)
            kernel = torch.where(near, torch.exp(q @ k.transpose(-1, -2)), kernel)
    elif variant == "elu_linear":
        kernel = (torch.nn.functional.elu(q) + 1) @ (torch.nn.functional.elu(k) + 1).transpose(-1, -2)
    elif variant == "normalized_softmax":
        kernel = torch.exp(q @ k.transpose(-1, -2))
    elif variant == "softmax":
        kernel = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(d))
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return kernel


def _position_factor(exponent, j, terms):
    """exp(b_{j-i} + beta [s_i != s_j] + gamma [j = 0]) + mu [t_i = t_j, s_i != s_j], [B, H, n, n], from the
    relative bias b_{j-i} laid out as the weights (`exponent`), the key positions j [1, n] and the terms (a dict)."""
    segment_ids, token_ids = terms.get("segment_ids"), terms.get("token_ids")
    first_key_bias = terms.get("first_key_bias")
    if segment_ids is not None:
        crossing = (segment_ids[:, :, None] != segment_ids[:, None, :])[:, None]
        exponent = exponent + terms["segment_bias"].double()[:, None, None] * crossing
    if first_key_bias is not None:  # gamma [j = 0]
        exponent = exponent + first_key_bias.double()[:, None, None] * (j == 0)
    position = torch.exp(exponent)
    if token_ids is not None:
        matches = crossing & (token_ids[:, :, None] == token_ids[:, None, :])[:, None]
        position = position + terms["match_weight"].double()[:, None, None] * matches
    return position


def naive_attention(query, key, value, rpe_bias, projection=None, key_padding_mask=None, causal=False, **terms):
    """[B, H, n, d_v] float64: `naive_attention_weights` (same keywords) times the values."""
    weights = naive_attention_weights(query, key, rpe_bias, projection, key_padding_mask, causal, **terms)
    return weights @ value.double()
