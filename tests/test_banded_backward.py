"""The banded algorithm's lean training mode (`nprf_banded_recompute`, `recompute=True` with "banded"): the output
kept, only the features rebuilt in backward, the product's backward run without its forward. Gradients against the
float64 dense reference and gradcheck, with padding, causal and bidirectional, the variants and the terms."""

import functools

import pytest
import torch
from conftest import tiny_nprf_config
from tolerances import PROBABLE, assert_within, attention_rounding, model_rounding, unit_roundoff

from nprf_hf import NPRFBertConfig, NPRFBertModel, nprf_banded, nprf_banded_window, nprf_dispatch
from nprf_hf import functional as Fn
from nprf_hf.nprf_naive import naive_attention
from nprf_hf.nprf_terms import (
    AttentionTerms,
    FirstTokenBias,
    LogitScale,
    SegmentBias,
    TokenMatch,
)

BUCKETS, DISTANCE = 8, 12  # a band of 7 (bidirectional): with chunks of 6, many chunks at a few dozen tokens


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 6 and groups of 3 chunks: the chunked window product, its groups and the far sums at small n."""
    monkeypatch.setattr(nprf_banded, "BANDED_MIN_CHUNK", 2)
    monkeypatch.setattr(nprf_banded_window, "BANDED_GROUP", 3)


def case(n, batch=3, heads=2, d=6, m=5, seed=0):
    """q, k, v [B, n, H, d] leaves (the models' layout: the attention sees [B, H, n, d] views), a per-head
    projection, a bucket table leaf and a padding mask (full row, half row, one token)."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, heads, d, dtype=torch.float64, generator=generator).requires_grad_(True)
               for _ in range(3))
    projection = Fn.draw_projection(m, d, "orf", num_heads=heads, dtype=torch.float64, generator=generator)
    table = torch.randn(heads, BUCKETS, dtype=torch.float64, generator=generator).requires_grad_(True)
    mask = torch.arange(n)[None, :] < torch.tensor([n, n // 2, 1])[:batch, None]
    return q, k, v, projection, table, mask


def views(q, k, v):
    return tuple(t.transpose(1, 2) for t in (q, k, v))


def kept_output_used(out):
    return type(out.grad_fn).__name__ == "_KeptOutputAttentionBackward"


TERMS = ("none", "logit_scale", "first_token_bias", "token_match", "frozen_segment_bias")


def term_case(name, batch, heads, n, generator):
    """(terms for `nprf_attention`, their trained tensors, the reference's keyword arguments)."""
    def per_head(low, high):
        return (torch.rand(heads, dtype=torch.float64, generator=generator) * (high - low) + low).requires_grad_(True)

    if name == "none":
        return AttentionTerms(), (), {}
    if name == "logit_scale":
        scale = per_head(0.5, 4.0)
        return AttentionTerms(LogitScale(scale)), (scale,), {"logit_scale": scale}
    if name == "first_token_bias":
        gamma = per_head(-2.0, 2.0)
        return AttentionTerms(FirstTokenBias(gamma)), (gamma,), {"first_key_bias": gamma}
    segments = (torch.arange(n)[None, :] >= torch.tensor([n // 2, n // 3, 0])[:batch, None]).long()
    beta = per_head(-1.5, 1.5).detach()  # frozen: its gradient would read the product's value
    kwargs = {"segment_ids": segments, "segment_bias": beta}
    if name == "frozen_segment_bias":
        return AttentionTerms(SegmentBias(segments, beta)), (), kwargs
    tokens = torch.randint(0, 4, (batch, n), generator=generator)
    mu = per_head(0.5, 2.0)
    terms = AttentionTerms(SegmentBias(segments, beta), TokenMatch(tokens, mu, segments))
    return terms, (mu,), {**kwargs, "token_ids": tokens, "match_weight": mu}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("term", TERMS)
@pytest.mark.parametrize("n", [5, 61])  # 5: one window covers all (the dense fallback); 61: 11 chunks
def test_gradients_match_the_reference(causal, term, n, small_chunks):
    """Values and gradients of q, k, v, the bucket table and the term's tensors equal the float64 reference's."""
    if causal and term in ("first_token_bias", "token_match"):
        pytest.skip("an encoder term")
    q, k, v, projection, table, mask = case(n)
    generator = torch.Generator().manual_seed(1)
    terms, trained, kwargs = term_case(term, 3, 2, n, generator)
    bias = Fn.relative_position_bias(table, n, not causal, BUCKETS, DISTANCE)
    band = Fn.rpe_band_width(BUCKETS, DISTANCE, not causal)
    out = Fn.nprf_attention(*views(q, k, v), bias, projection, mask, "banded", causal, band_width=band, recompute=True,
                            terms=terms)
    assert kept_output_used(out)
    ref = naive_attention(*views(q, k, v), bias, projection, mask, causal, **kwargs)
    rounding = attention_rounding(*views(q, k, v), bias, projection, ref, mask, causal, "banded", **kwargs)
    rounding.assert_values(out, ref)
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=generator)
    leaves = (q, k, v, table, *trained)
    got = torch.autograd.grad((out * weights).sum(), leaves, retain_graph=True)  # bias: both graphs'
    want = torch.autograd.grad((ref * weights).sum(), leaves)
    rounding.assert_gradients(got, want, ("q", "k", "v", "table", "term"))
    assert got[3].abs().sum() > 0 and got[1][2, 1:].abs().sum() == 0  # the table trains; padded keys get nothing


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, width", [(5, 4), (61, 4), (61, 7)])  # 5: the dense fallback; 61: chunks of 3 and 6
def test_near_field_lean_mode_matches_the_reference(causal, n, width, small_chunks):
    """The exact near field in the lean mode (its unit vectors rebuilt in backward with the features, the window
    product's backward reading them): values and gradients of q, k, v, the bucket table and a logit scale equal
    the float64 reference's, with padding (a padded key's exact weight is not zero unless masked)."""
    q, k, v, projection, table, mask = case(n, seed=4)
    scale = torch.tensor([3.0, 12.0], dtype=torch.float64, requires_grad=True)
    bias = Fn.relative_position_bias(table, n, not causal, BUCKETS, DISTANCE)
    band = Fn.rpe_band_width(BUCKETS, DISTANCE, not causal)
    kwargs = dict(logit_scale=scale, variant="nprf_near", near_field_width=width)
    out = Fn.nprf_attention(*views(q, k, v), bias, projection, mask, "banded", causal, band_width=band, recompute=True,
                            **kwargs)
    assert kept_output_used(out)
    ref = naive_attention(*views(q, k, v), bias, projection, mask, causal, **kwargs)
    # (float64, well conditioned: the derived bounds of `tolerances` do not cover the near field's exact kernel)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    leaves = (q, k, v, table, scale)
    got = torch.autograd.grad((out * weights).sum(), leaves, retain_graph=True)
    want = torch.autograd.grad((ref * weights).sum(), leaves)
    for name, a, b in zip(("q", "k", "v", "table", "logit_scale"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)
    assert got[1][2, 1:].abs().sum() == 0 and got[2][2, 1:].abs().sum() == 0  # padded keys get nothing


@pytest.mark.parametrize("variant", ["prf", "elu_linear"])
def test_other_feature_maps_match_the_reference(variant, small_chunks):
    q, k, v, projection, table, mask = case(40, seed=2)
    bias = Fn.relative_position_bias(table, 40, True, BUCKETS, DISTANCE)
    out = Fn.nprf_attention(*views(q, k, v), bias, projection, mask, "banded", band_width=Fn.rpe_band_width(
        BUCKETS, DISTANCE), recompute=True, variant=variant)
    assert kept_output_used(out)
    ref = naive_attention(*views(q, k, v), bias, projection, mask, variant=variant)
    rounding = attention_rounding(*views(q, k, v), bias, projection, ref, mask, False, "banded", variant=variant)
    rounding.assert_values(out, ref)
    got = torch.autograd.grad(out.square().sum(), (q, k, v, table), retain_graph=True)
    want = torch.autograd.grad(ref.square().sum(), (q, k, v, table))
    rounding.assert_gradients(got, want, ("q", "k", "v", "table"))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal, small_chunks):
    """The backward is the derivative of the forward: q, k, v, the bucket table and a logit scale, padding."""
    batch, heads, n = 2, 2, 26
    q, k, v, projection, table, mask = case(n, batch=batch, heads=heads, d=3, m=3, seed=3)
    scale = torch.tensor([0.7, 2.0], dtype=torch.float64, requires_grad=True)
    band = Fn.rpe_band_width(BUCKETS, DISTANCE, not causal)

    def attention(q, k, v, table, scale):
        bias = Fn.relative_position_bias(table, n, not causal, BUCKETS, DISTANCE)
        out = Fn.nprf_attention(*views(q, k, v), bias, projection, mask[:batch], "banded", causal, band_width=band,
                                logit_scale=scale, recompute=True)
        assert kept_output_used(out)
        return out

    inputs = tuple(t.detach().requires_grad_(True) for t in (q, k, v, table, scale))
    # central differences, h = 1e-6: truncation h^2 |f^(3)| / 6 ~ 1e-12, rounding ~ u |f| / h ~ 1e-10 for outputs
    # of size ~1 (float64's u on any machine): atol 1e-6, rtol 1e-4 cover both and reject a wrong gradient term
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_equals_keeping_the_features_and_keeps_only_inputs_and_output(small_chunks, causal):
    """Same values as recompute=False (bit for bit) and the same gradients to rounding; autograd holds no
    [B, H, n, m] tensor; the output has the layout of the models' [B, n, H, d] views, so their transpose back to
    [B, n, H d] (and the output projection's saved input) is that very tensor."""
    n, m = 61, 16
    q, k, v, projection, table, mask = case(n, m=m, seed=4)
    results = {}
    for recompute in (False, True):
        saved, shapes = {}, {}
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(record, saved, shapes), lambda tensor: tensor):
            bias = Fn.relative_position_bias(table, n, True, BUCKETS, DISTANCE)
            out = Fn.nprf_attention(*views(q, k, v), bias, projection, mask, "banded", causal,
                                    band_width=Fn.rpe_band_width(BUCKETS, DISTANCE), recompute=recompute)
        for tensor in (q, k, v, out, bias):
            saved.pop(tensor.untyped_storage().data_ptr(), None)
            shapes.pop(tensor.untyped_storage().data_ptr(), None)
        if recompute:
            assert kept_output_used(out) and out.transpose(1, 2).is_contiguous()
            # the denominators, the projection, the bias's band (and, causal, the future's [2n - 1] mask of a
            # discarded masked copy): no [H, 2n - 1] bias, coefficients or bucket index
            band = Fn.rpe_band_width(BUCKETS, DISTANCE)
            assert not [shape for shape, dtype in shapes.values()
                        if shape == (2, 2 * n - 1) or (shape == (2 * n - 1,) and dtype != torch.bool)], shapes
            assert sum(saved.values()) <= 3 * 2 * n * 8 + projection.numel() * 8 + 2 * (2 * band + 1) * 8 + (
                2 * n - 1 if causal else 0), saved
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)).sum(),
                                    (q, k, v, table))
        results[recompute] = out.detach(), grads
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0)
    # the gradients: two orders of the same backward, the algorithm's gradient rounding twice
    bias = Fn.relative_position_bias(table, n, True, BUCKETS, DISTANCE)
    rounding = attention_rounding(*views(q, k, v), bias, projection, results[False][0], mask, causal, "banded",
                                  other="banded")
    rounding.assert_gradients(results[True][1], results[False][1], ("q", "k", "v", "table"))


def record(saved, shapes, tensor):
    """A saved-tensors hook: note the tensor's storage, its size, its shape and dtype."""
    saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    shapes[tensor.untyped_storage().data_ptr()] = (tuple(tensor.shape), tensor.dtype)
    return tensor


def test_trained_segment_bias_recomputes_the_whole_call(small_chunks):
    """A trained segment bias's gradient reads the product's value: that call is checkpointed as before, exact."""
    n = 40
    q, k, v, projection, table, mask = case(n, seed=5)
    _, _, kwargs = term_case("frozen_segment_bias", 3, 2, n, torch.Generator().manual_seed(0))
    beta = kwargs["segment_bias"].clone().requires_grad_(True)
    bias = Fn.relative_position_bias(table, n, True, BUCKETS, DISTANCE)
    out = Fn.nprf_attention(*views(q, k, v), bias, projection, mask, "banded", band_width=Fn.rpe_band_width(
        BUCKETS, DISTANCE), recompute=True, segment_ids=kwargs["segment_ids"], segment_bias=beta)
    assert not kept_output_used(out)
    ref = naive_attention(*views(q, k, v), bias, projection, mask, segment_ids=kwargs["segment_ids"], segment_bias=beta)
    got = torch.autograd.grad(out.sum(), (q, beta, table), retain_graph=True)
    rounding = attention_rounding(*views(q, k, v), bias, projection, ref, mask, False, "banded", **kwargs)
    rounding.assert_gradients(got, torch.autograd.grad(ref.sum(), (q, beta, table)), ("q", "segment_bias", "table"))


@pytest.mark.parametrize("trained", ["values", "table"])
def test_only_some_inputs_train(trained, small_chunks):
    """Gradients reach what requires them and nothing else is asked for (frozen q, k: no feature gradients)."""
    n = 40
    q, k, v, projection, table, mask = case(n, seed=6)
    q, k = q.detach(), k.detach()
    v = v if trained == "values" else v.detach()
    table = table if trained == "table" else table.detach()
    leaf = v if trained == "values" else table
    bias = Fn.relative_position_bias(table, n, True, BUCKETS, DISTANCE)
    out = Fn.nprf_attention(*views(q, k, v), bias, projection, mask, "banded", band_width=Fn.rpe_band_width(
        BUCKETS, DISTANCE), recompute=True)
    assert kept_output_used(out)
    ref = naive_attention(*views(q, k, v), bias, projection, mask)
    got = torch.autograd.grad(out.sum(), leaf, retain_graph=True)
    attention_rounding(*views(q, k, v), bias, projection, ref, mask, False, "banded").assert_gradients(
        got, torch.autograd.grad(ref.sum(), leaf), (trained,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_matches_keeping_the_features(dtype, small_chunks):
    """float32 / bfloat16 inputs: the math runs in float32 either way; gradients as recompute=False's up to the
    rounding of the kept output (bfloat16: as flash attention, the backward reads the output in the input dtype)."""
    n = 61
    q, k, v, projection, table, mask = case(n, seed=7)
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    grads = {}
    for recompute in (False, True):
        bias = Fn.relative_position_bias(table.float(), n, True, BUCKETS, DISTANCE)
        out = Fn.nprf_attention(*views(q, k, v), bias, projection.float(), mask, "banded",
                                band_width=Fn.rpe_band_width(BUCKETS, DISTANCE), recompute=recompute)
        assert out.dtype == dtype and kept_output_used(out) == recompute
        grads[recompute] = torch.autograd.grad(out.float().square().sum(), (q, k, v, table))
    # float32 either way: the gradient's PROBABLE bound for two roundings of the algorithm (was a fitted 1e-5
    # normwise); bfloat16: the recomputing backward reads the output rounded to bfloat16 (u_bf16 each element),
    # which enters every gradient through the denominator's upstream term -G z / D, a part of the gradient's terms:
    # a few u_bf16 of its norm (5 u_bf16, as before: 2e-2)
    rounding = attention_rounding(*views(q, k, v), bias, projection, out.float(), mask, False, "banded",
                                  dtype=torch.float32, model=PROBABLE, other="banded")
    for a, b, name in zip(grads[True], grads[False], "qkvt"):
        assert a.dtype == b.dtype
        if dtype == torch.float32:
            rounding.assert_gradients([a], [b], [name])
        else:
            assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 5 * unit_roundoff(dtype), name


def test_model_training_step_equals_keeping_the_features(small_chunks, monkeypatch):
    """A tiny BERT (banded, chunks of 5, padding): attention_recompute="always" takes this path in every layer, never
    the checkpointed one, and gives the parameters the gradients of "never" (to rounding)."""
    input_ids = torch.randint(5, 99, (2, 60), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 35:] = 0
    grads = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        config = NPRFBertConfig(**tiny_nprf_config(attention_algorithm="banded", position_embedding_type="none",
                                                   attention_recompute=mode))
        model = NPRFBertModel(config).double().train()
        if mode == "always":
            monkeypatch.setattr(nprf_dispatch, "checkpoint", None)  # would raise if called
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden.square().mean().backward()
        grads[mode] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads["always"].keys() == grads["never"].keys() and any("rpe" in name for name in grads["never"])
    # two orders of the same backward, float64 (`model_rounding`), relative to the largest parameter gradient: backward
    # rounds relative to the upstream gradients, and a parameter's own gradient may be a cancelling sum of them
    bound = model_rounding(model, 60, 2, gradient=True) * max(want.abs().max() for want in grads["never"].values())
    for name, want in grads["never"].items():
        assert_within(grads["always"][name], want, bound, name)

