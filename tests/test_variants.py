"""The attention variants of the paper's ablations (`attention_variant`, `relative_position_bias`): each against
the independent float64 dense reference `nprf_hf.nprf_naive` (values, gradients, padding, causal, the optional terms),
through the models (padding, causality, cached generation), and the switch of a trained model to NPRF."""

import pytest
import torch

import nprf_hf
from nprf_hf import functional as Fn
from nprf_hf import nprf_banded
from nprf_hf.nprf_naive import naive_attention
from nprf_hf.options import ATTENTION_VARIANTS

from tolerances import attention_rounding


LINEAR = ("nprf", "prf", "elu_linear")  # kernels factored into features: every exact algorithm applies
QUADRATIC = ("normalized_softmax", "softmax")  # the exact kernels, computed densely
NEAR = ("nprf_near",)  # the exact kernel inside a band, features beyond (tests/test_near_field.py)


def reference_variant(query, key, value, bias, projection, variant, mask=None, causal=False, logit_scale=None,
                      segment_ids=None, segment_bias=None, token_ids=None, match_weight=None):
    """The package's float64 reference (`nprf_hf.nprf_naive`, checked against softmax in test_nprf_naive.py)."""
    return naive_attention(query, key, value, bias, projection, mask, causal, logit_scale=logit_scale,
                           segment_ids=segment_ids, segment_bias=segment_bias, token_ids=token_ids,
                           match_weight=match_weight, variant=variant)


def random_case(batch=3, heads=2, n=37, d=8, m=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, dtype=torch.float64, generator=generator) for _ in range(3))
    projection = Fn.draw_projection(m, d, "orf", num_heads=heads, dtype=torch.float64, generator=generator)
    table = torch.randn(heads, 16, dtype=torch.float64, generator=generator)
    lengths = torch.tensor([n, max(n // 2, 1), 1])[:batch]
    mask = torch.arange(n)[None, :] < lengths[:, None]
    return q, k, v, projection, table, mask


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(nprf_banded, "BANDED_MIN_CHUNK", 4)


def test_variants_are_declared_once():
    assert set(ATTENTION_VARIANTS) == set(LINEAR) | set(QUADRATIC) | set(NEAR)
    assert nprf_hf.NPRFRobertaConfig().attention_variant == "nprf"
    assert nprf_hf.NPRFRobertaConfig().relative_position_bias is True
    with pytest.raises(ValueError, match="attention_variant must be one of"):
        nprf_hf.NPRFRobertaConfig(attention_variant="flash")


@pytest.mark.parametrize("variant", LINEAR + QUADRATIC)
@pytest.mark.parametrize("algorithm", ["auto", "dense", "fft", "banded"])
@pytest.mark.parametrize("causal", [False, True])
def test_variant_matches_reference_with_gradients(variant, algorithm, causal, small_chunks):
    if variant in QUADRATIC and algorithm in ("fft", "banded"):
        pytest.skip("the exact kernels are dense only (tested below)")
    q, k, v, projection, table, mask = random_case()
    n = q.shape[2]
    for t in (q, k, v, table):
        t.requires_grad_(True)
    bias = Fn.relative_position_bias(table, n, not causal, 16, 40)
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, causal=causal,
                            band_width=Fn.rpe_band_width(16, 40, not causal), variant=variant)
    ref = reference_variant(q, k, v, bias, projection, variant, mask, causal)
    rounding = attention_rounding(q, k, v, bias, projection, ref, mask, causal, algorithm, variant=variant)
    rounding.assert_values(out, ref)
    weights = torch.randn_like(ref)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v, table), retain_graph=True)
    expected = torch.autograd.grad((ref * weights).sum(), (q, k, v, table))
    rounding.assert_gradients(grads, expected, ("q", "k", "v", "table"))
    implied = Fn.nprf_attention_weights(q, k, bias, projection, mask, causal=causal, variant=variant)
    attention_rounding(q, k, v, bias, projection, ref, mask, causal, "dense", variant=variant).assert_values(
        implied @ v, ref, "implied weights")
    with torch.no_grad():  # the inference paths
        rounding.assert_values(Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, causal=causal,
                                                 variant=variant), ref, "inference")


@pytest.mark.parametrize("variant", LINEAR + QUADRATIC)
def test_variant_terms_match_reference(variant):
    """Logit scale (normalized variants), segment bias and word matching enter every variant the same way."""
    q, k, v, projection, table, mask = random_case(n=20, seed=1)
    n = q.shape[2]
    bias = Fn.relative_position_bias(table, n, True, 16, 40)
    segment_ids = (torch.arange(n)[None, :] >= torch.tensor([[7], [5], [9]])).long()
    token_ids = torch.randint(0, 4, (3, n))
    beta = torch.tensor([-1.0, 0.7], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([2.0, 5.0], dtype=torch.float64) if variant in ("nprf", "normalized_softmax") else None
    terms = dict(segment_ids=segment_ids, segment_bias=beta, token_ids=token_ids, match_weight=mu)
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, variant=variant, logit_scale=scale, **terms)
    ref = reference_variant(q, k, v, bias, projection, variant, mask, logit_scale=scale, **terms)
    rounding = attention_rounding(q, k, v, bias, projection, ref, mask, False, "auto", logit_scale=scale,
                                  variant=variant, **terms)
    rounding.assert_values(out, ref)
    grads = torch.autograd.grad(out.sum(), (beta, mu), retain_graph=True)
    expected = torch.autograd.grad(ref.sum(), (beta, mu))
    rounding.assert_gradients(grads, expected, ("segment_bias", "match_weight"))


def test_logit_scale_needs_a_normalized_variant_and_quadratic_needs_dense():
    q, k, v, projection, table, mask = random_case(n=8)
    bias = Fn.relative_position_bias(table, 8, True, 16, 40)
    with pytest.raises(ValueError, match="logit_scale.*normalized"):
        Fn.nprf_attention(q, k, v, bias, projection, mask, variant="softmax", logit_scale=torch.ones(2))
    with pytest.raises(ValueError, match="variant='softmax'.*dense"):
        Fn.nprf_attention(q, k, v, bias, projection, mask, variant="softmax", algorithm="fft")
    with pytest.raises(ValueError, match="variant='relu'.*one of"):
        Fn.nprf_attention(q, k, v, bias, projection, mask, variant="relu")


# ---------------------------------------------------------------------------------------------
# Through the models
# ---------------------------------------------------------------------------------------------


def tiny_decoder(variant, relative_position_bias=True, seed=0, **kwargs):
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=80, is_decoder=True, num_random_features=16, attention_variant=variant,
        relative_position_bias=relative_position_bias, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        rpe_num_buckets=8, rpe_max_distance=20,
    )
    config = nprf_hf.NPRFRobertaConfig(**{**settings, **kwargs})
    model = nprf_hf.NPRFRobertaForCausalLM(config).eval()
    with torch.no_grad():  # a non-zero relative bias, so that it matters
        for name, param in model.named_parameters():
            if "rpe_table" in name:
                param.normal_()
    return model


@pytest.mark.parametrize("variant", LINEAR + QUADRATIC)
def test_models_are_causal_padding_invariant_and_generate_with_their_cache(variant):
    model = tiny_decoder(variant)
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        torch.testing.assert_close(full[:, :5], model(input_ids=ids[:, :5]).logits, atol=1e-5, rtol=1e-5)
        padded = torch.cat([ids, torch.ones(2, 4, dtype=torch.long)], 1)
        mask = torch.cat([torch.ones(2, 12), torch.zeros(2, 4)], 1).long()
        torch.testing.assert_close(model(input_ids=padded, attention_mask=mask).logits[:, :12], full,
                                   atol=1e-5, rtol=1e-5)
    prompt = ids[:, :4]
    cached = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1)
    uncached = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1, use_cache=False)
    assert torch.equal(cached, uncached)


def test_without_relative_position_bias_there_is_no_table():
    model = tiny_decoder("nprf", relative_position_bias=False)
    assert not [name for name, _ in model.named_parameters() if "rpe_table" in name]
    q, k, v, projection, _, mask = random_case(n=10)
    zero = torch.zeros(2, 19, dtype=torch.float64)
    ref = reference_variant(q, k, v, zero, projection, "nprf", mask)
    attention_rounding(q, k, v, zero, projection, ref, mask, False, "auto").assert_values(
        Fn.nprf_attention(q, k, v, zero, projection, mask), ref)


@pytest.mark.parametrize("trained", ["normalized_softmax", "softmax"])
def test_switch_to_nprf_keeps_every_weight(trained):
    model = tiny_decoder(trained, logit_scale_max=8.0 if trained == "normalized_softmax" else 0.0)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    nprf_hf.set_attention_variant(model, "nprf", num_random_features=24, projection_seed=3)
    after = model.state_dict()
    assert model.config.attention_variant == "nprf" and model.config.num_random_features == 24
    for name, tensor in before.items():
        if name.endswith(".projection"):
            assert after[name].shape[-2] == 24  # a fresh draw of the new size
        else:
            assert torch.equal(after[name], tensor), name
    # the switched model is the NPRF model with those weights
    reference = tiny_decoder("nprf", logit_scale_max=model.config.logit_scale_max, num_random_features=24,
                             projection_seed=3)
    reference.load_state_dict(after)
    ids = torch.randint(3, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    if trained == "normalized_softmax":  # NPRF estimates exactly this kernel: close with many features
        exact = tiny_decoder(trained, logit_scale_max=8.0)
        nprf_hf.set_attention_variant(exact, "nprf", num_random_features=4096)
        with torch.no_grad():
            estimate, target = exact(input_ids=ids).logits, tiny_decoder(trained, logit_scale_max=8.0)(input_ids=ids).logits
        assert (estimate - target).abs().max() < 0.1 * target.abs().max()
    with pytest.raises(ValueError, match="attention_variant"):
        nprf_hf.set_attention_variant(model, "performer")


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_conversion_to_the_softmax_variant_reproduces_the_source(family):
    """`attention_variant="softmax"` without RPE is the source's own attention: a conversion then changes nothing
    (to rounding), padding included; the switch to NPRF afterwards keeps every weight."""
    import transformers

    torch.manual_seed(0)
    config_class = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig,
                    "distilbert": transformers.DistilBertConfig}[family]
    sizes = (dict(dim=32, n_layers=2, n_heads=4, hidden_dim=37) if family == "distilbert" else
             dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37))
    source = transformers.AutoModel.from_config(config_class(vocab_size=60, max_position_embeddings=64, **sizes)).eval()
    model = nprf_hf.convert_to_nprf(source, attention_variant="softmax", relative_position_bias=False)
    ids = torch.randint(3, 60, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    with torch.no_grad():
        expected = source(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)
    nprf_hf.set_attention_variant(model, "nprf")
    with torch.no_grad():
        switched = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(switched).all() and (switched - got).abs().max() > 1e-3
