"""Tolerances of the comparisons with the float64 reference (`nprf_hf.nprf_naive`), derived from the computation
rather than fitted to one machine's rounding.

Every exact algorithm returns z_i = N_i / D_i, N_i = sum_j w_ij v_j, D_i = sum_j w_ij, over the keys j that row i
may see, with positive weights w_ij = c_{j-i} sum_f phi_q_if phi_k_jf (x pair factors): a weighted average of
the values. Two kinds of rounding reach it (u = the unit roundoff, eps / 2; first order in u throughout):

* Direct sums (the reference, "dense", "banded", and every algorithm's feature maps and read-out): every weight is
  a product of exps and sums of positive numbers, so it carries a relative error delta_w <= u K_w (the exponents
  rounded relative to their magnitude E, `feature_rounding`); the sums over n keys add gamma_n ~ n u of
  sum_j w_ij |v_j| (any order of summation, blocking or FMA: Higham, Accuracy and Stability of Numerical
  Algorithms, 2nd ed., §3.1 and §4.2). As the weights are positive, |dz_i| <= u (K_w + n + 2) (max_j |v_j| + |z_i|):
  no conditioning enters, whatever the logit scale or the bias.
* The FFT ("fft", and "auto" where it picks it): D_i and N_i come out of a circular convolution of each channel
  x_fe = phi_k_f u_e (u = [v | 1]) with c, through rfft and irfft of length L. Componentwise, an FFT of
  log2(L) passes with radix <= 5 and accurate twiddles puts an error <= eta = 10 u (log2 L + 1) |x|_1 on every
  output (Higham §24.1: eta ~ (mu + gamma_4 (sqrt 2 + mu)) per pass; radix 3 and 5 passes and the real-FFT
  post-pass are the +1 and the margin from ~6 u to 10 u per pass); the convolution's three transforms and the
  pointwise product then put |dy_i| <= (3 eta + 5 u) |c|_1 |x|_1 on *every* position i: an error relative to the
  whole sequence, not to row i's own sum. Row i reads sum_f phi_q_if y_fe,i, so
      |dz_ie| <= u K_fft(n) |c|_1 sum_f phi_q_if (|phi_k_f v_e|_1 + |z_ie| |phi_k_f|_1) / D_i,
  the amplification |c|_1 sum_f phi_q_if |phi_k_f|_1 / D_i being the reference's conditioning for this algorithm.
  It is large where D_i is small next to the sequence's largest terms: a causal row that sees few keys while other
  keys' features are e^(2 sqrt(s) |w|) larger (a logit scale s multiplies the exponents by sqrt(s) on each side),
  a wide range of exp(b) across distances. Computed per element from the inputs (`fft_conditioning`).

The bound compares two computations, so both errors count: the reference's and the algorithm's.

Two models of the roundings (`roundings`):
* WORST (float64, the default): N roundings cost N u, a first-order worst case that holds for any summation order,
  vector width or FFT plan. Real errors sit 10-1000x below it. It still tells a wrong term from rounding: a
  relative change of 1e-6 in one weight moves z by ~1e-6 p_ij |v_j|, orders of magnitude above the bound in all but
  the worst-conditioned rows (which stay checked, at their own bound); test_functional's
  test_stress_bounds_catch_a_wrong_term checks it.
* PROBABLE (float32 and below, where N u is too coarse to catch precision lost to a half-precision step):
  N roundings cost LAMBDA sqrt(N) u, Higham and Mary's probabilistic bound (SIAM J. Sci. Comput. 41(5), 2019,
  Theorem 2.4: with independent mean-zero rounding errors, as round-to-nearest on random data gives, it holds
  with probability >= 1 - 2 N exp(-LAMBDA^2 (1 - u)^2 / 2)); LAMBDA = 10 puts a failure below 1e-18 per element.
  Magnitude factors (the exponents' E, the FFT's conditioning) stay as they are: only counts are rooted.
"""

import contextlib
import math

import torch


WORST, PROBABLE = "worst", "probable"
LAMBDA = 10.0  # PROBABLE's confidence multiple (module docstring)


def unit_roundoff(dtype):
    """u = eps / 2: float64 1.1e-16, float32 6.0e-8, bfloat16 3.9e-3, float16 4.9e-4."""
    return torch.finfo(dtype).eps / 2


def roundings(count, model=WORST):
    """The error of `count` roundings in units of u: count (WORST), or LAMBDA sqrt(count) (PROBABLE) where that is
    smaller (below LAMBDA^2 = 100 roundings the worst case is the tighter bound, and it always holds)."""
    if model == WORST:
        return count
    if model == PROBABLE:
        return min(count, LAMBDA * math.sqrt(count))
    raise ValueError(f"model must be {WORST!r} or {PROBABLE!r}, got {model!r}")


def fft_rounding(n, model=WORST):
    """K_fft(n), in units of u: per-position error of the length-L circular convolution (L < 4n: the next
    2^a 3^b 5^c >= 2n - 1) relative to |c|_1 |x|_1, 3 transforms of eta = 10 (log2 L + 1) each plus the product's
    5 (module docstring)."""
    return roundings(3 * 10 * (math.log2(4 * max(n, 1)) + 1) + 5, model)


def direct_rounding(n, features, exponent, exponent_roundings, exponent_range, model=WORST):
    """K_direct, in units of u, for one direct computation of the output (reference, dense, banded, and the
    fft's feature maps and read-out): |dz_ie| <= u K_direct (max_j |v_je| + |z_ie|).

    Per weight: two features (or one exact-kernel entry), each off by E x (its exponent's roundings) + 1 (the exp:
    `feature_rounding`'s (E, count)); the m-term positive sum of phi_q . phi_k; the coefficient exp(b_r - max b)
    and the pair terms, 2 roundings relative to their exponents' range, + 1 for the exp; the product. Per row: the
    n-term sums of N_i and D_i and the division (n + 2)."""
    feature = exponent * roundings(exponent_roundings, model) + roundings(1, model)
    weight = (2 * feature + roundings(features, model) + (exponent_range + 1) * roundings(2, model)
              + roundings(1, model))
    return weight + roundings(n + 2, model)


def feature_rounding(query, key, projection, variant="nprf", logit_scale=None):
    """(E, count): one feature's relative error is u (E x count roundings + 1), E the largest magnitude of the
    quantity whose absolute error exp turns into a relative one. "nprf": the exponent
    a = sqrt(s) w . x_hat - s/2 - log(m)/2, a d-term dot product of normalized inputs (each a few roundings off)
    and the shift: <= 1.5 d + 5 <= 2 (d + 3) roundings of E = max_f sqrt(s) |w_f| + s/2 + log(m)/2. "prf": the
    same for x' = x d^-1/4, E = |w| |x'| + |x'|^2/2 + log(m)/2. "elu_linear": elu(x) + 1 = e^x for x < 0 is
    expm1(x) + 1, 2 roundings relative to E = 1 + e^-x. The exact kernels ("softmax", "normalized_softmax"):
    exp(logit - row max), the logits a d-term dot product of size <= L = max |q| |k| / sqrt(d) (or s), so E = 2 L."""
    q, k = query.detach().double(), key.detach().double()
    d = q.shape[-1]
    heads = q.shape[1]
    if variant == "elu_linear":
        low = torch.cat([q.flatten(), k.flatten()]).clamp_max(0.0)
        return 1.0 + math.exp(-low.min().item()), 2
    scale = torch.ones(heads, dtype=torch.float64) if logit_scale is None else logit_scale.detach().double().cpu()
    if variant == "softmax":
        return 2 * (q.norm(dim=-1).amax() * k.norm(dim=-1).amax()).item() / math.sqrt(d), d + 2
    if variant == "normalized_softmax":
        return 2 * scale.max().item(), 2 * (d + 3)
    w = projection.detach().double().cpu().norm(dim=-1).amax().item()
    if variant == "prf":
        radius = max(q.norm(dim=-1).amax().item(), k.norm(dim=-1).amax().item()) * d ** -0.25
        exponent = w * radius + radius ** 2 / 2
    else:
        root = scale.sqrt()
        exponent = (w * root + scale / 2).max().item()
    return exponent + math.log(projection.shape[-2]) / 2, 2 * (d + 3)


def finite_range(tensor):
    """max - min over the finite entries (the causal bias holds -inf for the future)."""
    finite = tensor.detach().double()[torch.isfinite(tensor)]
    return (finite.max() - finite.min()).item() if finite.numel() else 0.0


def _features(query, key, projection, mask, variant, logit_scale):
    """phi_q, phi_k [B, H, n, m] float64 of the factored variants (the reference's formulas), padded keys zero."""
    q, k = query.detach().double(), key.detach().double()
    if variant == "elu_linear":
        phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    else:
        heads, d = q.shape[1], q.shape[-1]
        if variant == "prf":
            q, k = q * d ** -0.25, k * d ** -0.25
        else:
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
            if logit_scale is not None:
                root = logit_scale.detach().double().sqrt()[:, None, None]
                q, k = q * root, k * root
        w = projection.detach().double()
        w = w.expand(heads, *w.shape) if w.dim() == 2 else w
        m = w.shape[1]

        def phi(x):
            return torch.exp(torch.einsum("bhnd,hmd->bhnm", x, w) - 0.5 * x.square().sum(-1, keepdim=True)) / math.sqrt(m)

        phi_q, phi_k = phi(q), phi(k)
    if mask is not None:
        phi_k = phi_k * mask.double()[:, None, :, None]
    return phi_q, phi_k


def fft_conditioning(phi_q, phi_k, value, reference, bias, causal, pair_factor=None):
    """The fft's amplification of its rounding, per element (module docstring): (numerator [B, H, n, d_v],
    denominator [B, H, n]) = (|c|_1 sum_f phi_q_if (|phi_k_f v_e|_1 + |z_ie| |phi_k_f|_1) / D_i,
    |c|_1 sum_f phi_q_if |phi_k_f|_1 / D_i), each times max_j pair_ij (the keys the FFT runs on are scaled by the
    pair factors; with one product per key segment, their 1-norms add up to the plain ones). Rows with no key
    (D_i = 0) give 0: both sides are exactly zero there."""
    n = phi_q.shape[-2]
    b = bias.detach().double()
    if causal:
        b = b.masked_fill(torch.arange(2 * n - 1) > n - 1, float("-inf"))
    c = torch.exp(b - b.amax(-1, keepdim=True))  # [H, 2n - 1], as the algorithm's (the bound is shift-invariant)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    weights = (phi_q @ phi_k.transpose(-1, -2)) * c[:, j - i + n - 1]
    top = torch.ones(weights.shape[:-1], dtype=torch.float64)
    if pair_factor is not None:
        weights = weights * pair_factor
        top = pair_factor.expand_as(weights).amax(-1)
    denominator = weights.sum(-1)  # D_i [B, H, n]
    has_keys = denominator > 0
    scale = torch.where(has_keys, c.sum(-1)[None, :, None] * top / denominator.clamp_min(1e-300), 0.0)
    v = value.detach().double()
    numerators = torch.einsum("bhnf,bhne->bhfe", phi_k, v.abs())  # |phi_k_f v_e|_1  [B, H, m, d_v]
    ones = phi_k.sum(-2)[..., None]  # |phi_k_f|_1  [B, H, m, 1]
    z = reference.detach().double().abs()
    spread = phi_q @ numerators + z * (phi_q @ ones)
    return scale[..., None] * spread, scale * (phi_q @ ones)[..., 0]


class Rounding:
    """The derived bounds of one comparison with the reference (`attention_rounding`).

    values: [B, H, n, d_v], the bound on |out - reference| per element.
    gradient: the bound on |grad - reference grad| relative to the reference gradient's largest entry (one number
        for every gradient of the comparison: normwise, see `attention_rounding`).
    """

    def __init__(self, values, gradient):
        self.values, self.gradient = values, gradient

    def assert_values(self, actual, expected, msg="values", equal_nan=False):
        assert_within(actual, expected, self.values, msg, equal_nan)

    def assert_gradients(self, got, want, names=None):
        for index, (g, w) in enumerate(zip(got, want)):
            name = names[index] if names else f"gradient {index}"
            assert_within(g, w, self.gradient * w.detach().abs().max().double(), name)


def attention_rounding(query, key, value, bias, projection, reference, mask=None, causal=False, algorithm="dense",
                       logit_scale=None, variant="nprf", pair_factor=None, dtype=torch.float64, other="reference",
                       model=WORST, output_dtype=None, segment_ids=None, segment_bias=None, first_key_bias=None,
                       **matches):
    """The bounds on `nprf_attention`'s output computed in `dtype` (float64, or float32 for half-precision inputs)
    with `algorithm` against `other` on the same inputs (module docstring), as a `Rounding`: "reference"
    (`naive_attention`, float64) or a second algorithm's output (`reference` is then that output: the bounds only
    read its magnitudes).

    Values, per element: each side's direct rounding, u K_direct (max_j |v_j| + |z_i|), and for "fft" / "auto"
    (which picks the fft for long inputs without a band) the FFT's, u K_fft(n) x `fft_conditioning`; with
    `output_dtype` (half-precision inputs: the result is rounded to it) the final rounding u_out |z|.

    Gradients: the backward runs the forward's products again (the weights, or the FFT's channels, against the
    upstream gradient divided by D_i), so its rounding is twice the forward's direct one plus the final sums over
    the batch, the positions and the features (B n m terms: the logit scale's, the bias table's and the
    projection's gradients), and for the fft K_fft(n) times the largest amplification of any row (the transposed
    convolution mixes every row's upstream gradient, divided by its D_i, into every key). Relative to the tensor's
    largest entry, not per entry: an entry's terms (the normalization's projection, values of both signs) may
    cancel, so its own size does not bound them.

    pair_factor: the positive factor the pair terms put on w_ij ([B, H, n, n] or broadcastable), whose keys the
    algorithm scales before the FFT; segment_ids / segment_bias (exp(beta [s_i != s_j])) and first_key_bias
    (exp(gamma [j = 0])) add theirs, as `naive_attention` takes them. The word-matching term (`matches`:
    token_ids, match_weight) adds mu kappa_ij through direct group sums: it only raises D_i, so the bounds
    without it hold.
    """
    batch, _, n, _ = query.shape
    assert set(matches) <= {"token_ids", "match_weight"}, matches
    if segment_ids is not None:
        crossing = (segment_ids[:, :, None] != segment_ids[:, None, :])[:, None]
        factor = torch.exp(segment_bias.detach().double()[None, :, None, None] * crossing)
        pair_factor = factor if pair_factor is None else pair_factor * factor
    if first_key_bias is not None:
        factor = torch.ones(1, first_key_bias.shape[0], 1, n, dtype=torch.float64)
        factor[..., 0] = torch.exp(first_key_bias.detach().double())[None, :, None]
        pair_factor = factor if pair_factor is None else pair_factor * factor
    features = 1 if variant in ("softmax", "normalized_softmax") else (
        query.shape[-1] if variant == "elu_linear" else projection.shape[-2])
    extra = 0.0 if pair_factor is None else finite_range(torch.log(pair_factor))
    exponent, exponent_roundings = feature_rounding(query, key, projection, variant, logit_scale)
    direct = direct_rounding(n, features, exponent, exponent_roundings, finite_range(bias) + extra, model)
    v = value.detach().double()
    z = reference.detach().double().abs()
    magnitude = v.abs().amax(-2, keepdim=True) + z
    conditioning = None
    values, gradient = 0.0, 0.0
    for side in (other, algorithm):
        u = unit_roundoff(torch.float64 if side == "reference" else dtype)
        values = values + u * direct * magnitude
        gradient = gradient + u * (2 * direct + roundings(batch * n * features, model))
        if side in ("fft", "auto") and variant in ("nprf", "prf", "elu_linear"):
            if conditioning is None:
                phi_q, phi_k = _features(query, key, projection, mask, variant, logit_scale)
                conditioning = fft_conditioning(phi_q, phi_k, v, z, bias, causal, pair_factor)
            values = values + u * fft_rounding(n, model) * conditioning[0]
            gradient = gradient + u * fft_rounding(n, model) * conditioning[1].max().item()
    if output_dtype is not None:
        values = values + unit_roundoff(output_dtype) * (z + values)
    return Rounding(values, gradient)


def assert_within(actual, expected, bound, msg="", equal_nan=False):
    """|actual - expected| <= bound elementwise (with `equal_nan`, NaN where both are NaN passes), with the worst
    element and its ratio to the bound in the message."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    difference = (actual.detach().double() - expected.detach().double()).abs()
    if equal_nan:
        difference = torch.where(torch.isnan(actual) & torch.isnan(expected), 0.0, difference)
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(difference)
    ratio = difference / bound.clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(ratio.flatten().nan_to_num(float("inf")).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), difference.shape))
    assert not (difference > bound).any() and not torch.isnan(difference).any(), (
        f"{msg}: |difference| {difference[index].item():.3e} at {index} exceeds its derived bound "
        f"{bound[index].item():.3e} ({ratio[index].item():.3g}x); "
        f"{int((difference > bound).sum())} of {difference.numel()} elements over")


# --- the Toeplitz products alone (`nprf_dense`, `nprf_fft`, `nprf_banded`, `nprf_dispatch.PRODUCTS`) -------------


def _plain_product(phi_q, phi_k, u, c):
    """sum_j c_{j-i} (phi_q_i . phi_k_j) u_j [B, H, n, e] in float64: the products' formula, for their bounds."""
    n = phi_q.shape[-2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return ((phi_q @ phi_k.transpose(-1, -2)) * c[:, j - i + n - 1]) @ u


def product_bound(phi_q, phi_k, u, c, algorithm="dense", computations=2, dtype=torch.float64):
    """Per-element bound [B, H, n, e] on the difference of `computations` evaluations of the Toeplitz product
    P = sum_j c_{j-i} (phi_q_i . phi_k_j) u_j (phi, c >= 0; u of any sign), each off by at most
    u (n + m + 2) sum_j c_{j-i} (phi_q_i . phi_k_j) |u_j| when summed directly (m-term dot products, n-term sums:
    gamma_(n + m + 2), any order), and for the fft by u K_fft(n) |c|_1 sum_f phi_q_if |phi_k_f u_e|_1 more (the
    module docstring's convolution bound, which is relative to the whole sequence)."""
    phi_q, phi_k, u_abs, c = (t.detach().double() for t in (phi_q, phi_k, u.abs(), c))
    n, m = phi_q.shape[-2], phi_q.shape[-1]
    bound = computations * unit_roundoff(dtype) * (n + m + 2) * _plain_product(phi_q, phi_k, u_abs, c)
    if algorithm == "fft":
        channels = torch.einsum("bhnf,bhne->bhfe", phi_k, u_abs)  # |phi_k_f u_e|_1
        bound = bound + unit_roundoff(dtype) * fft_rounding(n) * c.sum(-1)[None, :, None, None] * (phi_q @ channels)
    return bound


def normalized_product_bound(phi_q, phi_k, value, c, reference, algorithm="dense", computations=2,
                             dtype=torch.float64):
    """`product_bound` for N / D (the in-cache products' `normalized=True`; u = [v | 1]): (|dN| + |z| |dD|) / D,
    zero for rows with no key."""
    ones = torch.ones_like(value[..., :1])
    bound = product_bound(phi_q, phi_k, torch.cat([value, ones], -1), c, algorithm, computations, dtype)
    denominator = _plain_product(phi_q.detach().double(), phi_k.detach().double(), ones.double(), c.detach().double())
    z = reference.detach().double().abs()
    return torch.where(denominator > 0, (bound[..., :-1] + z * bound[..., -1:]) / denominator.clamp_min(1e-300), 0.0)


def product_gradient_bounds(phi_q, phi_k, u, c, grad_out, wanted, computations=2, dtype=torch.float64, extra_terms=0):
    """Per-element bounds on the gradients of (P * grad_out).sum() (P: `product_bound`'s product, computed
    directly) for the inputs named in `wanted` (of "phi_q", "phi_k", "u", "c"). Every gradient entry is a sum
    of products of the same positive weights with u and grad_out (grad phi_q_if = sum_j c phi_k_jf (u_j . g_i),
    grad c_r = sum_(j - i = r) (phi_q_i . phi_k_j) (u_j . g_i), ...): n + m + e + 3 roundings (plus
    `extra_terms` of the upstream gradient's own) of a sum whose terms have the magnitudes of the same gradient
    with |u| and |grad_out| (computed here: the terms may cancel, their absolute values do not)."""
    leaves = {name: t.detach().double().abs().requires_grad_(name in wanted)
              for name, t in (("phi_q", phi_q), ("phi_k", phi_k), ("u", u), ("c", c))}
    product = _plain_product(leaves["phi_q"], leaves["phi_k"], leaves["u"], leaves["c"])
    magnitudes = torch.autograd.grad((product * grad_out.detach().double().abs()).sum(),
                                     [leaves[name] for name in wanted])
    n, m, e = phi_q.shape[-2], phi_q.shape[-1], u.shape[-1]
    return [computations * unit_roundoff(dtype) * (n + m + e + 3 + extra_terms) * g for g in magnitudes]


def normalized_product_gradient_bounds(phi_q, phi_k, value, c, reference, grad_out, wanted, computations=2,
                                       dtype=torch.float64):
    """`product_gradient_bounds` for (N / D * grad_out).sum() (u = [v | 1]; "u" names the values): the product's
    upstream gradient is G_i / D_i for N_i and -sum_e G_ie z_ie / D_i for D_i (e + 2 more roundings of it),
    bounded in magnitude by |G_i| / D_i and sum_e |G_ie| |z_ie| / D_i."""
    phi_q64, phi_k64, c64 = (t.detach().double() for t in (phi_q, phi_k, c))
    ones = torch.ones_like(value[..., :1]).double()
    denominator = _plain_product(phi_q64, phi_k64, ones, c64)
    inverse = torch.where(denominator > 0, 1 / denominator.clamp_min(1e-300), 0.0)
    g = grad_out.detach().double().abs()
    upstream = torch.cat([g * inverse, (g * reference.detach().double().abs()).sum(-1, keepdim=True) * inverse], -1)
    bounds = product_gradient_bounds(phi_q, phi_k, torch.cat([value.detach().double(), ones], -1), c, upstream,
                                     wanted, computations, dtype, extra_terms=value.shape[-1] + 2)
    return [b[..., :-1] if name == "u" else b for name, b in zip(wanted, bounds)]


# --- inside the models ----------------------------------------------------------------------------------------


def _term_keywords(terms):
    """`attention_rounding`'s keywords for an `nprf_terms.AttentionTerms` (the models pass their terms as one object)."""
    from nprf_hf.nprf_terms import FirstTokenBias, LogitScale, SegmentBias, TokenMatch

    keywords = {}
    for term in () if terms is None else terms.terms:
        if isinstance(term, LogitScale):
            keywords["logit_scale"] = term.scale
        elif isinstance(term, SegmentBias):
            keywords.update(segment_ids=term.segment_ids, segment_bias=term.bias)
        elif isinstance(term, FirstTokenBias):
            keywords["first_key_bias"] = term.bias
        elif not isinstance(term, TokenMatch):  # the matches only raise D_i (`attention_rounding`)
            raise NotImplementedError(f"no bounds for the term {type(term).__name__}")
    return keywords


@contextlib.contextmanager
def attention_checked_against(against="dense", model=WORST, replace=True):
    """Inside the models (`nprf_attention` as `attention_nprf` and the decoders' cache `cache_nprf` call it):
    every attention computed with another algorithm is checked, per element, against the same call with `against`
    (`attention_rounding`'s bounds for these very inputs, whose conditioning a model's hidden states set), and
    the model goes on with `against`'s output. A model configured with another algorithm then returns the
    `against`-configured model's output to the bit (the same numbers through the same layers), so the comparison
    of the two needs no tolerance, and the layers after an attention cannot amplify its rounding past a bound
    that was derived for its output alone.

    replace=False: the model goes on with its own algorithm's output (its backward then runs too); the context
    yields a list that collects, per checked call, (the values' bound relative to max |v| + max |z|, the
    gradients' relative bound), for a bound on the model's outputs and gradients (`model_rounding`'s gain)."""
    from nprf_hf import attention_nprf, cache_nprf

    original = attention_nprf.nprf_attention
    assert cache_nprf.nprf_attention is original
    recorded = []

    def checked(query, key, value, rpe_bias, projection, key_padding_mask=None, algorithm="auto", causal=False,
                **options):
        out = original(query, key, value, rpe_bias, projection, key_padding_mask, algorithm, causal, **options)
        if algorithm == against:
            return out
        with torch.set_grad_enabled(replace and torch.is_grad_enabled()):  # kept: the model goes on with it
            expected = original(query, key, value, rpe_bias, projection, key_padding_mask, against, causal, **options)
        mask = None if key_padding_mask is None else key_padding_mask.bool()
        dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        rounding = attention_rounding(query, key, value, rpe_bias, projection, expected, mask, causal, algorithm,
                                      variant=options.get("variant", "nprf"), other=against, dtype=dtype,
                                      model=model, **_term_keywords(options.get("terms")))
        # (rows the model discards, as a packed batch's padding, may be NaN in both)
        rounding.assert_values(out, expected, f"{algorithm} against {against} inside the model", equal_nan=True)
        scale = value.detach().double().abs().max() + expected.detach().double().abs().max()
        recorded.append(((rounding.values.nan_to_num(0.0).max() / scale).item(), rounding.gradient))
        return expected if replace else out

    attention_nprf.nprf_attention = cache_nprf.nprf_attention = checked
    try:
        yield recorded
    finally:
        attention_nprf.nprf_attention = cache_nprf.nprf_attention = original


MODEL_GAIN = 10.0  # per layer (`model_rounding`)


def model_rounding(model, n, batch, gradient=False, dtype=torch.float64, rounding_model=WORST):
    """The rounding of a tiny model's output (or, `gradient`, of its parameters' gradients) relative to its
    largest entry, for two runs that compute the same function in different orders (shapes, padding, recomputed
    backward, a cache) with direct attention (dense, banded: no FFT conditioning in it).

    Per layer: its attention's K_direct (`direct_rounding` for the layer's projection and bucket table at length n;
    for gradients twice that plus the B n m final sums) and the layer's own dot products and LayerNorm,
    K_layer = hidden + intermediate + 10; two runs. Every layer carries an error on at most MODEL_GAIN times: a
    residual block with LayerNorm and weights ~N(0, 0.02) has an O(1) Jacobian, the next attention reaches its
    normalized q, k through 1 / |q| ~ 10. That gain is an estimate, not a bound: the one factor of these
    tolerances that is not derived (the errors seen sit >= 1e4x below them). A model with fft attention: run it
    under `attention_checked_against`, which bounds each fft attention by its own conditioning and goes on
    with the dense one."""
    u = unit_roundoff(dtype)
    layers = [module for module in model.modules() if hasattr(module, "projection") and hasattr(module, "bucket_table")]
    config = model.config
    total = 0.0
    for layer in layers:
        projection = layer.projection.detach().double()
        scale = layer.logit_scale()
        s = 1.0 if scale is None else scale.detach().double().max().item()
        w = projection.norm(dim=-1).amax().item()
        m, d = projection.shape[-2], projection.shape[-1]
        exponent = w * math.sqrt(s) + s / 2 + math.log(m) / 2
        table = layer.bucket_table(None if layer.rpe_table is not None else next(
            module.rpe_table for module in model.modules()
            if getattr(module, "rpe_table", None) is not None and not hasattr(module, "bucket_table")))
        span = finite_range(table) + sum(  # the pair terms' exponents: exp(beta), exp(gamma)
            getattr(layer, name).detach().abs().max().item() for name in ("cross_segment_bias", "first_key_bias")
            if getattr(layer, name, None) is not None)
        direct = direct_rounding(n, m, exponent, 2 * (d + 3), span, rounding_model)
        if gradient:
            direct = 2 * direct + roundings(batch * n * m, rounding_model)
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", 0)  # DistilBERT's
        own = roundings(config.hidden_size + intermediate + 10, rounding_model)
        total += 2 * u * (direct + own)
    return total * MODEL_GAIN ** len(layers)
