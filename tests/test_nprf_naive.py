"""The package's float64 reference (`nprf_hf.nprf_naive`), which every algorithm and variant is tested against,
checked itself against torch's own softmax: the exact kernels with the bias and the segment term added to the
logits, padding, causality, word matching as extra weight, and the random-feature variants' expectation."""

import math

import torch

from nprf_hf.nprf_naive import naive_attention, naive_attention_weights

from tolerances import direct_rounding, feature_rounding, unit_roundoff


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


# --- the first-key bias and the random-feature and elu kernels, against sums written out by hand ----------------


Q = [[[0.5, -1.0], [1.5, 0.25], [-0.75, 0.5]], [[-0.3, 0.8], [0.0, -1.2], [1.1, 1.0]]]  # [H=2][n=3][d=2]
K = [[[1.0, 0.5], [-0.5, -0.25], [0.25, 1.25]], [[0.6, -0.9], [-1.4, 0.2], [0.7, 0.3]]]
BIAS = [[0.1, -0.4, 0.3, 0.8, -0.2], [0.0, 0.5, -0.6, 0.2, 0.9]]  # [H][2n - 1]: entry j - i + n - 1
W = [[0.9, -0.3], [-0.6, 1.2], [0.4, 0.7]]  # [m=3][d=2]


def tensors(*lists):
    return (torch.tensor(x, dtype=torch.float64) for x in lists)


def hand_rtol(variant, gamma=(0.0, 0.0)):
    """Relative tolerance of the reference's weights against `hand_weights`: two direct float64 evaluations of the
    same normalized weights, `tolerances.direct_rounding` for these sizes (n = 3, d = 2, m = 3) and exponents each
    (was a fixed 1e-12)."""
    q, k, w = tensors([Q], [K], W)
    exponent, count = feature_rounding(q, k, w, variant)
    features = {"softmax": 1, "elu_linear": 2}.get(variant, 3)
    span = max(max(row) - min(row) for row in BIAS) + max(abs(g) for g in gamma)
    return 2 * unit_roundoff(torch.float64) * direct_rounding(3, features, exponent, count, span)


def hand_weights(kappa, first_key_bias=None, causal=False):
    """[1, H, n, n]: w_ij = kappa(h, q_i, k_j) exp(b_{j-i} + gamma [j = 0]), rows normalised, with loops."""
    heads, n = len(Q), len(Q[0])
    out = [[[0.0] * n for _ in range(n)] for _ in range(heads)]
    for h in range(heads):
        for i in range(n):
            row = []
            for j in range(n):
                exponent = BIAS[h][j - i + n - 1] + (first_key_bias[h] if first_key_bias is not None and j == 0 else 0.0)
                row.append(0.0 if causal and j > i else kappa(h, Q[h][i], K[h][j]) * math.exp(exponent))
            out[h][i] = [w / sum(row) for w in row]
    return torch.tensor([out], dtype=torch.float64)


def dot(x, y):
    return sum(a * b for a, b in zip(x, y))


def softmax_kappa(h, x, y):
    return math.exp(dot(x, y) / math.sqrt(len(x)))


def prf_features(x, w):
    """phi(x d^-1/4): exp(w_r . x' - |x'|^2 / 2) / sqrt(m) for each row w_r of w."""
    scaled = [a * len(x) ** -0.25 for a in x]
    return [math.exp(dot(row, scaled) - dot(scaled, scaled) / 2) / math.sqrt(len(w)) for row in w]


def elu_plus_one(x):
    return [a + 1 if a > 0 else math.exp(a) for a in x]


def test_first_key_bias_adds_gamma_to_the_exponent_of_key_zero_only():
    q, k, bias, gamma = tensors([Q], [K], BIAS, [1.5, -2.0])
    for causal in (False, True):
        expected = hand_weights(softmax_kappa, [1.5, -2.0], causal)
        weights = naive_attention_weights(q, k, bias, None, None, causal, variant="softmax", first_key_bias=gamma)
        torch.testing.assert_close(weights, expected, rtol=hand_rtol("softmax", [1.5, -2.0]), atol=0)
    # the bias moves weight onto key 0 in head 0 and off it in head 1
    plain = naive_attention_weights(q, k, bias, None, variant="softmax")
    biased = naive_attention_weights(q, k, bias, None, variant="softmax", first_key_bias=gamma)
    assert (biased[0, 0, :, 0] > plain[0, 0, :, 0]).all() and (biased[0, 1, :, 0] < plain[0, 1, :, 0]).all()


def test_prf_kernel_is_the_feature_dot_product_of_d_quarter_scaled_inputs():
    q, k, bias, w = tensors([Q], [K], BIAS, W)

    def kappa(h, x, y):
        return dot(prf_features(x, W), prf_features(y, W))

    for causal in (False, True):
        weights = naive_attention_weights(q, k, bias, w, None, causal, variant="prf")
        torch.testing.assert_close(weights, hand_weights(kappa, causal=causal), rtol=hand_rtol("prf"), atol=0)
    # per-head projections: head h uses its own rows
    other = [[-0.2, 0.5], [1.1, 0.1], [0.3, -0.8]]

    def per_head(h, x, y):
        rows = (W, other)[h]
        return dot(prf_features(x, rows), prf_features(y, rows))

    weights = naive_attention_weights(q, k, bias, torch.tensor([W, other], dtype=torch.float64), variant="prf")
    torch.testing.assert_close(weights, hand_weights(per_head), rtol=hand_rtol("prf"), atol=0)


def test_elu_linear_kernel_is_the_dot_product_of_elu_plus_one():
    q, k, bias = tensors([Q], [K], BIAS)

    def kappa(h, x, y):
        return dot(elu_plus_one(x), elu_plus_one(y))

    for causal in (False, True):
        weights = naive_attention_weights(q, k, bias, None, None, causal, variant="elu_linear")
        torch.testing.assert_close(weights, hand_weights(kappa, causal=causal), rtol=hand_rtol("elu_linear"), atol=0)
