"""The package's float64 reference (`nprf_hf.nprf_naive`), which every algorithm and variant is tested against,
checked itself against torch's own softmax: the exact kernels with the bias and the segment term added to the
logits, padding, causality, word matching as extra weight, and the random-feature variants' expectation."""

import math

import torch

from nprf_hf.nprf_naive import naive_attention, naive_attention_weights


def case(batch=2, heads=3, n=11, d=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, dtype=torch.float64, generator=generator) for _ in range(3))
    bias = torch.randn(heads, 2 * n - 1, dtype=torch.float64, generator=generator)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[-1, n // 2 :] = False
    segments = (torch.arange(n) >= n // 3).long().expand(batch, n)
    return q, k, v, bias, mask, segments


def softmax_weights(logits, mask=None, causal=False):
    n = logits.shape[-1]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    allowed = allowed.expand(logits.shape[0], 1, n, n)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)


def relative(bias, n):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return bias[:, j - i + n - 1]


def test_softmax_variant_is_softmax_of_scaled_logits_plus_bias_and_segment_bias():
    q, k, v, bias, mask, segments = case()
    beta = torch.tensor([0.7, -1.2, 0.0], dtype=torch.float64)
    for causal in (False, True):
        crossing = (segments[:, :, None] != segments[:, None, :])[:, None]
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + relative(bias, q.shape[2]) + beta[:, None, None] * crossing
        expected = softmax_weights(logits, mask, causal)
        weights = naive_attention_weights(q, k, bias, None, mask, causal, segment_ids=segments, segment_bias=beta,
                                          variant="softmax")
        torch.testing.assert_close(weights, expected)
        torch.testing.assert_close(naive_attention(q, k, v, bias, None, mask, causal, segment_ids=segments,
                                                   segment_bias=beta, variant="softmax"), expected @ v)


def test_normalized_softmax_scales_unit_vectors():
    q, k, v, bias, mask, _ = case(seed=1)
    scale = torch.tensor([1.0, 4.0, 0.25], dtype=torch.float64)
    unit_q, unit_k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    logits = scale[:, None, None] * (unit_q @ unit_k.transpose(-1, -2)) + relative(bias, q.shape[2])
    weights = naive_attention_weights(q, k, bias, None, mask, logit_scale=scale, variant="normalized_softmax")
    torch.testing.assert_close(weights, softmax_weights(logits, mask))


def test_word_matching_adds_mu_times_the_kernel_across_segments():
    q, k, v, bias, mask, segments = case(seed=2)
    tokens = torch.randint(0, 3, segments.shape, generator=torch.Generator().manual_seed(0))
    beta, mu = torch.tensor([0.3, 0.0, -0.4], dtype=torch.float64), torch.tensor([2.0, 0.0, 0.5], dtype=torch.float64)
    n = q.shape[2]
    crossing = (segments[:, :, None] != segments[:, None, :])[:, None]
    same_token = (tokens[:, :, None] == tokens[:, None, :])[:, None]
    kernel = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
    raw = kernel * (torch.exp(relative(bias, n) + beta[:, None, None] * crossing) + mu[:, None, None] * (crossing & same_token))
    raw = raw * mask[:, None, None, :]
    expected = raw / raw.sum(-1, keepdim=True)
    weights = naive_attention_weights(q, k, bias, None, mask, segment_ids=segments, segment_bias=beta, token_ids=tokens,
                                      match_weight=mu, variant="softmax")
    torch.testing.assert_close(weights, expected)


def test_random_features_estimate_the_normalized_kernel():
    """nprf with many features approaches normalized_softmax (E[phi(x) . phi(y)] = exp(x . y))."""
    q, k, v, bias, mask, _ = case(batch=1, heads=1, n=6, d=4, seed=3)
    generator = torch.Generator().manual_seed(1)
    projection = torch.randn(200_000, 4, dtype=torch.float64, generator=generator)
    estimate = naive_attention_weights(q, k, bias, projection, variant="nprf")
    exact = naive_attention_weights(q, k, bias, None, variant="normalized_softmax")
    assert (estimate - exact).abs().max() < 0.01


def test_rows_without_keys_are_zero_and_gradients_are_finite():
    q, k, v, bias, mask, _ = case(seed=4)
    mask[1] = False
    q.requires_grad_(True)
    out = naive_attention(q, k, v, bias, torch.randn(8, 4, dtype=torch.float64), mask, variant="nprf")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[0].abs().sum() > 0
