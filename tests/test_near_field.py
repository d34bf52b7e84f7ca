"""The exact near field (attention_variant "nprf_near", `nprf_hf.nprf_near_field`): every PyTorch algorithm and
execution mode against the independent float64 reference `nprf_naive` (values, gradients, padding, causal, every
term), its limits (a width that covers every pair is the exact normalized kernel), and through the models."""

import pytest
import torch

import nprf_hf
from nprf_hf import functional as Fn
from nprf_hf import nprf_banded
from nprf_hf.nprf_naive import naive_attention

# float64 throughout: the reference and the algorithms agree to rounding, a few hundred eps of the largest terms
# (exp(s) with s <= 4 below, summed over n <= 300 keys); a wrong band, a missing term or a lost mask is off by O(1).
TOLERANCE = dict(rtol=1e-9, atol=1e-9)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(nprf_banded, "BANDED_MIN_CHUNK", 4)


def random_case(batch=3, heads=3, n=70, d=8, m=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, dtype=torch.float64, generator=generator) for _ in range(3))
    projection = Fn.draw_projection(m, d, "orf", num_heads=heads, dtype=torch.float64, generator=generator)
    table = torch.randn(heads, 16, dtype=torch.float64, generator=generator)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[-1, n // 2 + 3 :] = False
    mask[0, 10:14] = False  # a hole before the last kept key: the exact kernel needs the mask there
    if batch > 2:
        mask[1] = False  # a sequence with no key at all: zero output and gradients, no NaN
    scale = 1.0 + 3.0 * torch.rand(heads, dtype=torch.float64, generator=generator)
    ids = dict(
        segment_ids=(torch.arange(n) >= n // 3).long().expand(batch, n).clone(),
        segment_bias=torch.randn(heads, dtype=torch.float64, generator=generator),
        token_ids=torch.randint(0, 5, (batch, n), generator=generator),
        match_weight=torch.rand(heads, dtype=torch.float64, generator=generator),
    )
    return q, k, v, projection, table, mask, scale, ids


@pytest.mark.parametrize("algorithm", ["auto", "dense", "fft", "banded"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("width", [1, 6, 23, 40, 80])
@pytest.mark.parametrize("pair_terms", [False, True])
def test_near_field_matches_reference_with_gradients(algorithm, causal, width, pair_terms, small_chunks):
    if pair_terms and causal:
        pytest.skip("the word-matching term is an encoder's")
    q, k, v, projection, table, mask, scale, ids = random_case()
    n = q.shape[2]
    terms = ids if pair_terms else {}
    leaves = [q, k, v, table, scale] + [terms[name] for name in ("segment_bias", "match_weight") if name in terms]
    for t in leaves:
        t.requires_grad_(True)
    # 16 buckets reaching 40 positions: a band of 23 (21 causal), so that the banded algorithm (chunks of 4 here) cuts the
    # sequence into windows and the correction's chunks do not cover it whole
    bias = Fn.relative_position_bias(table, n, not causal, 16, 40)
    band = Fn.rpe_band_width(16, 40, not causal)
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, causal=causal, band_width=band,
                            logit_scale=scale, variant="nprf_near", near_field_width=width, **terms)
    expected = naive_attention(q, k, v, bias, projection, mask, causal, logit_scale=scale, variant="nprf_near",
                               near_field_width=width, **terms)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad((out * grad).sum(), leaves)
    want = torch.autograd.grad((expected * grad).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE)
    with torch.no_grad():  # the inference rows (in cache, without autograd)
        again = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, causal=causal, band_width=band,
                                  logit_scale=scale, variant="nprf_near", near_field_width=width, **terms)
    torch.testing.assert_close(again, expected, **TOLERANCE)


@pytest.mark.parametrize("algorithm", ["dense", "banded"])
def test_near_field_first_token_bias(algorithm, small_chunks):
    from nprf_hf.nprf_terms import AttentionTerms, FirstTokenBias, LogitScale

    q, k, v, projection, table, mask, scale, _ = random_case(seed=1)
    n = q.shape[2]
    gamma = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64, requires_grad=True)
    bias = Fn.relative_position_bias(table, n, True, 16, 40)
    terms = AttentionTerms(LogitScale(scale), FirstTokenBias(gamma))
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, band_width=Fn.rpe_band_width(16, 40), variant="nprf_near",
                            near_field_width=9, terms=terms)
    expected = naive_attention(q, k, v, bias, projection, mask, logit_scale=scale, first_key_bias=gamma,
                               variant="nprf_near", near_field_width=9)
    torch.testing.assert_close(out, expected, **TOLERANCE)
    torch.testing.assert_close(*(torch.autograd.grad(x.sum(), gamma)[0] for x in (out, expected)), **TOLERANCE)


@pytest.mark.parametrize("algorithm", ["dense", "fft", "banded"])
def test_a_width_covering_every_pair_is_the_exact_kernel(algorithm, small_chunks):
    """|j - i| < n for every pair: nothing is estimated, and the attention is the exact normalized kernel's."""
    q, k, v, projection, table, mask, scale, _ = random_case(seed=2, n=45)
    bias = Fn.relative_position_bias(table, 45, True, 16, 40)
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, band_width=Fn.rpe_band_width(16, 40), logit_scale=scale,
                            variant="nprf_near", near_field_width=45)
    exact = naive_attention(q, k, v, bias, projection, mask, logit_scale=scale, variant="normalized_softmax")
    torch.testing.assert_close(out, exact, **TOLERANCE)


def test_near_field_in_float32_on_long_inputs(two_threads, monkeypatch):
    """A call the CPU split cuts into items (>= 512 tokens, B H n (m + d) >= 2^20) and the real banded chunking, in
    float32, against the float64 reference: rounding of float32 sums of ~1,000 positive terms (eps 1.2e-7)."""
    from nprf_hf import nprf_cpu_split

    splits = []
    split_items = nprf_cpu_split.split_items
    monkeypatch.setattr(nprf_cpu_split, "split_items", lambda *a: splits.append(split_items(*a)) or splits[-1])
    generator = torch.Generator().manual_seed(3)
    batch, heads, n, d, m = 1, 12, 1000, 32, 64
    q, k, v = (torch.randn(batch, heads, n, d, generator=generator) for _ in range(3))
    projection = Fn.draw_projection(m, d, "orf", num_heads=heads, generator=generator)
    bias = Fn.relative_position_bias(torch.randn(heads, 32, generator=generator) * 0.3, n, True, 32, 128)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, -50:] = False
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="banded", band_width=91, variant="nprf_near")
    expected = naive_attention(q, k, v, bias, projection, mask, variant="nprf_near", near_field_width=91)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    assert splits and splits[0] is not None  # it ran as items
    weights = Fn.nprf_attention_weights(q, k, bias, projection, mask, variant="nprf_near", near_field_width=91)
    torch.testing.assert_close((weights.double() @ v.double()), expected, rtol=1e-4, atol=1e-5)


def test_bad_near_field_width_is_refused():
    q, k, v, projection, table, mask, scale, _ = random_case()
    bias = Fn.relative_position_bias(table, q.shape[2], True, 16, 40)
    with pytest.raises(ValueError, match="near_field_width must be a positive integer"):
        Fn.nprf_attention(q, k, v, bias, projection, variant="nprf_near", near_field_width=0)
    with pytest.raises(ValueError, match="near_field_width must be"):
        nprf_hf.NPRFBertConfig(near_field_width=-1)


def tiny_config(cls, **overrides):
    return cls(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
               max_position_embeddings=96, num_random_features=16, **overrides)


def test_model_with_a_full_width_near_field_is_the_exact_kernel_model():
    """Through the layer: with the band covering the input, nprf_near computes what normalized_softmax does, and the
    padded positions change nothing; with a narrow band it does not."""
    torch.manual_seed(0)
    model = nprf_hf.NPRFBertModel(tiny_config(nprf_hf.NPRFBertConfig, attention_variant="nprf_near",
                                              logit_scale_max=8.0)).eval()
    ids = torch.randint(5, 50, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 25:] = 0
    with torch.no_grad():
        near = model(ids, attention_mask=mask).last_hidden_state
        nprf_hf.set_attention_variant(model, "normalized_softmax")
        exact = model(ids, attention_mask=mask).last_hidden_state
        nprf_hf.set_attention_variant(model, "nprf_near")
        model.config.near_field_width = 3
        narrow = model(ids, attention_mask=mask).last_hidden_state
        short = model(ids[1:, :25]).last_hidden_state
    torch.testing.assert_close(near, exact, rtol=1e-4, atol=1e-5)
    assert (narrow - exact).abs().max() > 1e-3
    torch.testing.assert_close(narrow[1:, :25], short, rtol=1e-4, atol=1e-5)


def test_decoder_generates_with_a_key_value_cache():
    """A decoder's steps (HF's dynamic cache: the NPRF cache sums features only) give the logits of the whole
    sequence at once."""
    torch.manual_seed(0)
    config = tiny_config(nprf_hf.NPRFRobertaConfig, attention_variant="nprf_near", near_field_width=5, is_decoder=True,
                         pad_token_id=1, bos_token_id=0, eos_token_id=2)
    model = nprf_hf.NPRFRobertaForCausalLM(config).eval()
    prompt = torch.randint(5, 50, (1, 7))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        whole = model(out).logits
        steps = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12, output_logits=True,
                               return_dict_in_generate=True)
    for t, logits in enumerate(steps.logits):
        torch.testing.assert_close(logits[0], whole[0, 6 + t], rtol=1e-4, atol=1e-4)
    from nprf_hf.cache_nprf import NPRFCache

    with pytest.raises(ValueError, match="cache_implementation='dynamic'"):
        model(prompt, past_key_values=NPRFCache(config), use_cache=True)


TEXTS = [f"sentence number {i} says something about the {word}" for i, word in
         enumerate(("cat", "dog", "river", "city") * 4)]


@pytest.fixture
def bert_source(minilm_tokenizer):
    from transformers import BertConfig, BertModel

    from conftest import tiny_config as source_config

    torch.manual_seed(0)
    return BertModel(BertConfig(**source_config(vocab_size=minilm_tokenizer.vocab_size, num_attention_heads=4))).eval()


def test_a_conversion_with_transfer_defaults_to_the_measured_recipe(bert_source, minilm_tokenizer):
    """`options.TRANSFER_RECIPE` where the caller sets no variant; the paper's NPRF by one field; a plain conversion
    (and so every folder converted before) unchanged."""
    from nprf_hf.options import TRANSFER_RECIPE

    options = {"steps": 2, "batch_size": 4, "max_length": 16}
    transferred = nprf_hf.convert_to_nprf(bert_source, tokenizer=minilm_tokenizer, transfer_texts=TEXTS,
                                          transfer_options=options, num_random_features=8)
    assert {k: getattr(transferred.config, k) for k in TRANSFER_RECIPE} == TRANSFER_RECIPE == {
        "attention_variant": "nprf_near", "logit_scale_max": 30.0}
    paper = nprf_hf.convert_to_nprf(bert_source, tokenizer=minilm_tokenizer, transfer_texts=TEXTS,
                                    transfer_options=options, attention_variant="nprf", num_random_features=8)
    assert (paper.config.attention_variant, paper.config.logit_scale_max) == ("nprf", 0.0)
    plain = nprf_hf.convert_to_nprf(bert_source, num_random_features=8)
    assert (plain.config.attention_variant, plain.config.logit_scale_max) == ("nprf", 0.0)


def test_a_folder_saved_before_the_near_field_loads_as_before(tmp_path):
    """A folder converted before `near_field_width` existed (its config.json without it) loads as the NPRF it was,
    bit for bit."""
    import json

    torch.manual_seed(0)
    model = nprf_hf.NPRFBertModel(tiny_config(nprf_hf.NPRFBertConfig)).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.pop("attention_variant") == "nprf" and saved.pop("near_field_width") == 0
    (tmp_path / "config.json").write_text(json.dumps(saved))  # as a folder of before: the new field absent
    again = nprf_hf.NPRFBertModel.from_pretrained(tmp_path).eval()
    assert (again.config.attention_variant, again.config.near_field_width) == ("nprf", 0)
    ids = torch.randint(5, 50, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).last_hidden_state, model(ids).last_hidden_state, rtol=0, atol=0)
