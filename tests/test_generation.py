"""Recurrent NPRF decoding (issue 14): generate() through NPRFCache gives the logits of one full forward pass
at every generated position; tiny decoders on CPU. Issue 25: position ids passed to generate(), and the static
cache (NPRFStaticCache) with generate()'s compiled decode step, after transformers' own generation tests."""

import os

import pytest
import torch
from torch._dynamo.utils import counters

from nprf_hf import NPRFRobertaConfig, NPRFRobertaForCausalLM
from nprf_hf import cache_nprf, nprf_banded, nprf_recurrent
from nprf_hf.cache_nprf import (
    NPRFCache,
    NPRFStaticCache,
    causal_distance_bias,
    recurrent_attention,
    recurrent_state_from_prefill,
)
from nprf_hf.functional import relative_position_bias, rpe_band_width
from nprf_hf.nprf_features import values_and_ones
from nprf_hf.nprf_positions import toeplitz_matrix
from transformers import CompileConfig, DynamicCache, StaticCache

from conftest import tiny_nprf_config
from tolerances import assert_within, attention_checked_against, model_rounding, product_bound, unit_roundoff


# 8 buckets / max distance 16 give a band of W = 12 (unidirectional): prompts of 5 and 30 tokens lie on
# both sides of it, and 30 + the new tokens let keys leave the band during generation.
TINY = tiny_nprf_config(max_position_embeddings=512, position_embedding_type="none", is_decoder=True, pad_token_id=1)
W = rpe_band_width(8, 16, bidirectional=False)


def decoder(dtype=torch.float64, seed=0, **overrides):
    """A decoder whose every weight matters: all parameters drawn at a scale where attention moves the logits."""
    model = NPRFRobertaForCausalLM(NPRFRobertaConfig(**{**TINY, **overrides})).eval().to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 1.0 if name.endswith("rpe_table") else 0.3
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * std)
    return model


def left_padded(batch_lengths, total, seed=0):
    """input_ids [B, total] and attention_mask with row b's last batch_lengths[b] tokens real."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, TINY["vocab_size"], (len(batch_lengths), total), generator=generator)
    mask = torch.zeros_like(input_ids)
    for row, length in enumerate(batch_lengths):
        mask[row, total - length :] = 1
        input_ids[row, : total - length] = TINY["pad_token_id"]
    return input_ids, mask


def decode_logits(model, input_ids, attention_mask, prompt_length, cache=None):
    """Logits of every position from prompt_length - 1 on: prefill, then one token per forward."""
    out = model(input_ids[:, :prompt_length], attention_mask=attention_mask[:, :prompt_length], past_key_values=cache)
    cache, logits = out.past_key_values, [out.logits[:, -1]]
    for t in range(prompt_length, input_ids.shape[1]):
        out = model(input_ids[:, t : t + 1], attention_mask=attention_mask[:, : t + 1], past_key_values=cache)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), cache


# ---------------------------------------------------------------------------------------------
# The pure functions against a float64 dense reference
# ---------------------------------------------------------------------------------------------


def assert_as_full(model, got, full, n, batch=2):
    """Decoding against one full forward pass, float64: the same function in another order, with direct attention
    (a model with fft attention runs under `attention_checked_against`), `tolerances.model_rounding` of the
    logits' size (was a fixed atol of 1e-10)."""
    assert_within(got, full, model_rounding(model, n, batch) * full.abs().max(), "logits")


def dense_causal_reference(phi_q, phi_k, u, table, num_buckets=8, max_distance=16):
    """sum_{j <= i} c_{j-i} phi(q_i).phi(k_j) u_j with the whole unidirectional Toeplitz matrix."""
    n = phi_q.shape[-2]
    bias = relative_position_bias(table, n, False, num_buckets, max_distance)
    c = torch.exp(bias).masked_fill(torch.arange(2 * n - 1) > n - 1, 0.0)
    return ((phi_q @ phi_k.transpose(-1, -2)) * toeplitz_matrix(c, n)) @ u


@pytest.mark.parametrize("prompt", [1, 5, W - 1, W, 30])
@pytest.mark.parametrize("block", [1, 4, 128])
def test_recurrent_attention_equals_the_dense_product(prompt, block, monkeypatch):
    monkeypatch.setattr(nprf_recurrent, "DECODE_BLOCK", block)
    generator = torch.Generator().manual_seed(prompt)
    batch, heads, n, m, d = 2, 3, 45, 6, 5
    phi_q, phi_k = torch.rand(2, batch, heads, n, m, generator=generator, dtype=torch.float64).unbind(0)
    phi_k[1, :, :3] = 0.0  # left padding of row 1
    u = values_and_ones(torch.randn(batch, heads, n, d, generator=generator, dtype=torch.float64))
    table = torch.randn(heads, 8, generator=generator, dtype=torch.float64)
    expected = dense_causal_reference(phi_q, phi_k, u, table)

    state = recurrent_state_from_prefill(phi_k[:, :, :prompt], u[:, :, :prompt], W)
    assert state[1].shape == (batch, heads, W - 1, m) and state[2].shape == (batch, heads, W - 1, d + 1)
    c = torch.exp(causal_distance_bias(table, W, 8, 16))
    # the rest in two calls: a chunk of several tokens, then one token at a time
    outs, middle = [], min(prompt + 17, n)
    for start, stop in [(prompt, middle)] + [(t, t + 1) for t in range(middle, n)]:
        new = slice(start, stop)
        out, *state = recurrent_attention(phi_q[:, :, new], phi_k[:, :, new], u[:, :, new], *state, c)
        outs.append(out)
    # two direct evaluations of the same sums (`tolerances.product_bound`)
    causal_c = torch.exp(relative_position_bias(table, n, False, 8, 16)).masked_fill(torch.arange(2 * n - 1) > n - 1, 0.0)
    bound = product_bound(phi_q, phi_k, u, causal_c)
    assert_within(torch.cat(outs, -2), expected[:, :, prompt:], bound[:, :, prompt:], "decoded")
    # S, z hold exactly the keys older than the band: sums of `far` products, gamma_far each way
    far = n - (W - 1)
    magnitude = phi_k[:, :, :far].transpose(-1, -2) @ u[:, :, :far].abs()
    assert_within(state[0], phi_k[:, :, :far].transpose(-1, -2) @ u[:, :, :far],
                  2 * (far + 2) * unit_roundoff(torch.float64) * magnitude, "far state")


def test_far_bias_is_constant_beyond_the_band():
    table = torch.randn(2, 8, dtype=torch.float64)
    bias = relative_position_bias(table, 200, False, 8, 16)[:, :200].flip(-1)  # b_{-delta}, delta = 0 .. 199
    by_distance = causal_distance_bias(table, W, 8, 16)
    torch.testing.assert_close(bias[:, :W], by_distance[:, :W])
    assert (bias[:, W:] == by_distance[:, W:]).all()
    assert not (bias[:, W - 1] == by_distance[:, W]).all()  # W is the smallest such width


# ---------------------------------------------------------------------------------------------
# The model: every generated position equals one full forward pass
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["dense", "fft", "banded", "auto"])
# 60 > 3 chunks of 16 tokens: the banded prefill really uses its band (below that it is the dense product)
@pytest.mark.parametrize("prompt_lengths", [(5, 3), (60, 47)], ids=["shorter-than-W", "longer-than-W"])
def test_cached_decoding_equals_the_full_forward_float64(algorithm, prompt_lengths, monkeypatch):
    model = decoder(attention_algorithm=algorithm)
    prompt, new = max(prompt_lengths), 20
    input_ids, mask = left_padded(prompt_lengths, prompt + new)
    mask[:, prompt:] = 1
    band_products = []
    original = nprf_banded.window_product
    monkeypatch.setattr(nprf_banded, "window_product",
                        lambda *args, **kwargs: band_products.append(1) or original(*args, **kwargs))
    with attention_checked_against("dense"):  # the fft's conditioning checked per layer, against dense
        full = model(input_ids, attention_mask=mask, use_cache=False).logits
        logits, cache = decode_logits(model, input_ids, mask, prompt)
    assert bool(band_products) == (algorithm == "banded" and prompt > 48)  # the banded prefill used its band
    assert isinstance(cache, NPRFCache) and cache.get_seq_length() == prompt + new
    real = mask[:, prompt - 1 :].bool()
    assert_as_full(model, logits[real], full[:, prompt - 1 :][real], prompt + new)
    # the keys older than the band matter: without their far sums the logits are not these
    assert (logits - full.roll(1, dims=1)[:, prompt - 1 :]).abs().max() > 1e-3


def test_exactness_check_can_fail(monkeypatch):
    model = decoder()
    input_ids, mask = left_padded((30, 22), 50)
    mask[:, 30:] = 1
    full = model(input_ids, attention_mask=mask, use_cache=False).logits
    wrong = causal_distance_bias

    def wrong_far_bias(*args, **kwargs):
        bias = wrong(*args, **kwargs).clone()
        bias[:, -1] += 1e-3
        return bias

    monkeypatch.setattr(nprf_recurrent, "causal_distance_bias", wrong_far_bias)
    logits, _ = decode_logits(model, input_ids, mask, 30)
    assert (logits - full[:, 29:]).abs().max() > 1e-8


def test_multi_token_continuation_and_logit_scale():
    model = decoder(logit_scale_max=4.0)
    with torch.no_grad():
        for layer in model.roberta.encoder.layer:
            layer.attention.self.logit_scale_logit.normal_(0.0, 1.0)
    input_ids, mask = left_padded((40, 33), 60)
    mask[:, 40:] = 1
    with attention_checked_against("dense"):  # whatever "auto" picks
        full = model(input_ids, attention_mask=mask, use_cache=False).logits
        first = model(input_ids[:, :9], attention_mask=mask[:, :9])
        rest = model(input_ids[:, 9:], attention_mask=mask, past_key_values=first.past_key_values)
    got = torch.cat([first.logits, rest.logits], 1)
    real = mask.bool()
    assert_as_full(model, got[real], full[real], 60)


def test_generate_float32_greedy_sampling_and_beams():
    model = decoder(dtype=torch.float32)
    input_ids, mask = left_padded((30, 17), 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True, output_logits=True,
                  pad_token_id=1)
    greedy = model.generate(input_ids, do_sample=False, **kwargs)
    assert isinstance(greedy.past_key_values, NPRFCache)
    full_mask = torch.cat([mask, torch.ones(2, 24, dtype=mask.dtype)], 1)
    full = model(greedy.sequences, attention_mask=full_mask, use_cache=False).logits
    torch.testing.assert_close(torch.stack(greedy.logits, 1), full[:, 29:-1], rtol=0, atol=1e-5)
    uncached = model.generate(input_ids, do_sample=False, use_cache=False, **kwargs)
    dynamic = model.generate(input_ids, do_sample=False, cache_implementation="dynamic", **kwargs)
    assert isinstance(dynamic.past_key_values, DynamicCache)
    assert torch.equal(greedy.sequences, uncached.sequences) and torch.equal(greedy.sequences, dynamic.sequences)

    sampled = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        sampled.append(model.generate(input_ids, do_sample=True, top_k=0, use_cache=use_cache, **kwargs))
    assert torch.equal(sampled[0].sequences, sampled[1].sequences)
    assert not torch.equal(sampled[0].sequences, greedy.sequences)  # it did sample
    full = model(sampled[0].sequences, attention_mask=full_mask, use_cache=False).logits
    torch.testing.assert_close(torch.stack(sampled[0].logits, 1), full[:, 29:-1], rtol=0, atol=1e-5)

    beams = {}
    options_by_name = {"nprf": {}, "uncached": {"use_cache": False}, "dynamic": {"cache_implementation": "dynamic"}}
    for name, options in options_by_name.items():
        beams[name] = model.generate(
            input_ids, attention_mask=mask, max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False,
            return_dict_in_generate=True, output_scores=True, pad_token_id=1, **options,
        )
    assert isinstance(beams["nprf"].past_key_values, NPRFCache)
    for name in ("uncached", "dynamic"):
        assert torch.equal(beams["nprf"].sequences, beams[name].sequences), name
        torch.testing.assert_close(beams["nprf"].sequences_scores, beams[name].sequences_scores, rtol=0, atol=1e-5)


def test_returned_cache_continues_generation():
    model = decoder()
    input_ids, mask = left_padded((30, 17), 30)
    first = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1,
                           return_dict_in_generate=True)
    cache = first.past_key_values
    assert isinstance(cache, NPRFCache) and cache.get_seq_length() == 37  # the last token is not yet in it
    mask2 = torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], 1)
    again = model.generate(first.sequences, attention_mask=mask2, past_key_values=cache, max_new_tokens=10,
                           do_sample=False, pad_token_id=1)
    scratch = model.generate(first.sequences, attention_mask=mask2, max_new_tokens=10, do_sample=False, pad_token_id=1)
    assert torch.equal(again, scratch)
    assert torch.equal(again[:, :38], first.sequences)


def test_generation_never_redraws_the_features():
    model = decoder(feature_redraw_interval=1).train()  # dropout is 0: train mode only enables redraws
    input_ids, mask = left_padded((30, 17), 30)
    projections = [layer.attention.self.projection.clone() for layer in model.roberta.encoder.layer]
    for use_cache in (True, False):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=15, do_sample=False, pad_token_id=1,
                             use_cache=use_cache)
    for layer, projection in zip(model.roberta.encoder.layer, projections):
        assert torch.equal(layer.attention.self.projection, projection)
    assert not model.roberta.encoder.redraw_suspended
    full_mask = torch.cat([mask, torch.ones(2, 15, dtype=mask.dtype)], 1)
    expected = model.eval().generate(input_ids, attention_mask=mask, max_new_tokens=15, do_sample=False, pad_token_id=1)
    assert torch.equal(out, expected)
    # a redraw between calls invalidates a cache: a clear error instead of features of two draws
    cache = model(out, attention_mask=full_mask).past_key_values
    model.roberta.encoder.layer[0].attention.self.redraw_projection(5)
    with pytest.raises(ValueError, match="projection of layer 0 changed"):
        model(out[:, -1:], attention_mask=torch.cat([full_mask, full_mask[:, :1]], 1), past_key_values=cache)
    # and training forward passes still redraw
    model.train()(out)
    assert not torch.equal(model.roberta.encoder.layer[1].attention.self.projection, projections[1])


def test_use_cache_false_and_explicit_dynamic_cache_keep_the_old_paths():
    model = decoder()
    input_ids, mask = left_padded((30, 17), 30)
    out = model(input_ids, attention_mask=mask, use_cache=False)
    assert out.past_key_values is None
    cached = model(input_ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config))
    assert isinstance(cached.past_key_values, DynamicCache)
    # one forward pass: the caches only keep the keys (or build states from them) beside the same attention call on
    # the same inputs, so the logits are equal to the bit (was atol 1e-12)
    torch.testing.assert_close(cached.logits, out.logits, rtol=0, atol=0)
    default = model(input_ids, attention_mask=mask)
    assert isinstance(default.past_key_values, NPRFCache)
    torch.testing.assert_close(default.logits, out.logits, rtol=0, atol=0)


def test_cache_memory_is_constant_in_the_context_length():
    model = decoder(dtype=torch.float32)
    sizes = []
    for length in (5, 30, 200):
        cache = model(torch.randint(3, 99, (1, length))).past_key_values
        sizes.append([cache.nbytes(i) for i in range(TINY["num_hidden_layers"])])
    assert sizes[0] == sizes[1] == sizes[2]
    # and no state tensor is a view that keeps a larger buffer (the prompt's features, a decode window) alive
    model(torch.randint(3, 99, (1, 3)), past_key_values=cache)
    for layer in cache.layers:
        for tensor in (layer.far_states, layer.ring_features, layer.ring_values):
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    heads, m, d = 2, 16, 16
    assert sizes[0][0] == 4 * heads * (m * (d + 1) + (W - 1) * (m + d + 1)) + 8  # + the real-token count


@pytest.mark.parametrize("cache_class", [NPRFCache, NPRFStaticCache])
def test_bad_uses_of_the_cache_raise(cache_class):
    model = decoder()
    input_ids, mask = left_padded((30, 17), 31)
    cache = model(input_ids[:, :30], attention_mask=mask[:, :30], past_key_values=cache_class(model.config)).past_key_values
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids[:, 30:], attention_mask=mask, past_key_values=cache, output_attentions=True)
    changed = mask.clone()
    changed[1, 20] = 0  # past padding cannot change after the fact
    with pytest.raises(ValueError, match="attention mask of the past tokens"):
        model(input_ids[:, 30:], attention_mask=changed, past_key_values=cache)
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(input_ids[:, 30:], attention_mask=mask[:, 1:], past_key_values=cache)
    with pytest.raises(ValueError, match="batch of 2"):
        model(input_ids[:1, 30:], past_key_values=cache)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(NotImplementedError, match="recurrent NPRF state"):
        cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
    two = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    block = two.bool()[:, None, None, :] & torch.ones(32, 32, dtype=torch.bool).tril()[None, None, 30:]
    block[0, 0, 1, 5] = False  # the second new token may not see a key the first one sees: not padding
    with pytest.raises(ValueError, match="padding masks"):
        model(torch.cat([input_ids[:, 30:], input_ids[:, 30:]], 1), attention_mask=block, past_key_values=cache)
    encoder = decoder(is_decoder=False)
    with pytest.raises(ValueError, match="decoder self-attention"):
        encoder.roberta(input_ids, past_key_values=NPRFCache())


def test_output_attentions_falls_back_to_the_dynamic_cache():
    model = decoder()
    input_ids, mask = left_padded((30, 17), 30)
    out = model(input_ids, attention_mask=mask, output_attentions=True)
    assert isinstance(out.past_key_values, DynamicCache) and out.attentions[0].shape == (2, 2, 30, 30)
    generated = model.generate(input_ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1,
                               output_attentions=True, return_dict_in_generate=True)
    assert isinstance(generated.past_key_values, DynamicCache) and len(generated.attentions) == 3
    four_d = mask.bool()[:, None, None, :] & torch.ones(30, 30, dtype=torch.bool).tril()  # a 4D mask: the old path too
    assert isinstance(model(input_ids, attention_mask=four_d).past_key_values, DynamicCache)


@pytest.mark.parametrize("cache_class", [NPRFCache, NPRFStaticCache])
def test_gradients_through_the_cache_equal_those_of_the_full_forward(cache_class):
    # (NPRFStaticCache writes in place only without autograd through the state: no generate() step)
    model = decoder().train()  # dropout is 0
    input_ids, mask = left_padded((40, 33), 60)
    with attention_checked_against("dense"):  # whatever "auto" picks
        model(input_ids, attention_mask=mask, use_cache=False).logits.sum().backward()
        expected = {name: param.grad.clone() for name, param in model.named_parameters()}
        model.zero_grad()
        first = model(input_ids[:, :25], attention_mask=mask[:, :25], past_key_values=cache_class(model.config))
        rest = model(input_ids[:, 25:], attention_mask=mask, past_key_values=first.past_key_values)
        (first.logits.sum() + rest.logits.sum()).backward()
    # `tolerances.model_rounding` of the largest parameter gradient (backward rounds relative to the upstream)
    bound = model_rounding(model, 60, 2, gradient=True) * max(grad.abs().max() for grad in expected.values())
    for name, param in model.named_parameters():
        assert_within(param.grad, expected[name], bound, name)
    assert expected["roberta.encoder.rpe_table"].abs().max() > 0


def test_cache_implementations_without_a_constant_size_state_are_refused():
    model = decoder()
    input_ids, mask = left_padded((30, 17), 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=2, pad_token_id=1)
    for implementation in ("offloaded_static", "sliding_window"):
        with pytest.raises(ValueError, match=f"cache_implementation='{implementation}' is not supported"):
            model.generate(input_ids, cache_implementation=implementation, **kwargs)
    exact = decoder(attention_variant="softmax")
    with pytest.raises(ValueError, match="'static' .* attention_variant='softmax' weighs every past key"):
        exact.generate(input_ids, cache_implementation="static", **kwargs)


def test_static_cache_keeps_the_keys_for_output_attentions(fresh_dynamo):
    # test_generate_compilation_all_outputs (issue 47): with output_attentions=True, cache_implementation="static"
    # keeps every key up to the static length, as transformers' StaticCache does (only then: the state alone
    # otherwise); the weights are those of the dynamic cache, zero past the tokens seen, compiled or not
    model = decoder(dtype=torch.float32, position_embedding_type="absolute", max_position_embeddings=80, seed=3)
    input_ids, mask = left_padded((30, 17), 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=1, return_dict_in_generate=True,
                  output_attentions=True, output_scores=True)
    dynamic = model.generate(input_ids, **kwargs)
    assert isinstance(dynamic.past_key_values, DynamicCache) and not isinstance(dynamic.past_key_values, NPRFCache)
    plain = model.generate(input_ids, cache_implementation="static", **{**kwargs, "output_attentions": False})
    assert plain.past_key_values.layers[0].keys is None  # no keys kept without output_attentions
    for compile_config in (None, forced_compile_config()):
        static = model.generate(input_ids, cache_implementation="static", compile_config=compile_config, **kwargs)
        cache = static.past_key_values
        assert isinstance(cache, StaticCache) and isinstance(cache, NPRFStaticCache)
        assert hasattr(model, "_compiled_call") == (compile_config is not None)
        assert cache.get_max_length() == 33 and cache.layers[0].keys.shape == (2, 2, 33, 16)
        assert_same_generation(static, dynamic, atol=1e-5)
        for step, (got, expected) in enumerate(zip(static.attentions, dynamic.attentions)):
            for layer_got, layer_expected in zip(got, expected):
                seen = layer_expected.shape[-1]
                assert layer_got.shape == (*layer_expected.shape[:-1], 33)
                torch.testing.assert_close(layer_got[..., :seen], layer_expected, rtol=0, atol=1e-5)
                assert not layer_got[..., seen:].any()
    # the default cache keeps no key: attention weights from it are refused, not made up
    cache = model(input_ids, attention_mask=mask, past_key_values=NPRFStaticCache(model.config)).past_key_values
    with pytest.raises(ValueError, match="output_attentions=True needs every past key"):
        model(input_ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), past_key_values=cache,
              output_attentions=True)


def test_absolute_positions_are_numbered_as_in_a_forward_pass():
    # generate() numbers positions from 0; RoBERTa's embeddings from padding_idx + 1 (HF's own
    # RobertaForCausalLM is off by padding_idx + 1 in transformers 5.23)
    model = decoder(position_embedding_type="absolute", max_position_embeddings=80)
    input_ids, mask = left_padded((30, 17), 30)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=1,
                         return_dict_in_generate=True, output_logits=True)
    full_mask = torch.cat([mask, torch.ones(2, 10, dtype=mask.dtype)], 1)
    full = model(out.sequences, attention_mask=full_mask, use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, 1).double(), full[:, 29:-1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", ["nprf", "dynamic", "uncached"])
def test_explicit_position_ids_give_the_tokens_of_implicit_ones(cache):
    # transformers' test_generate_with_and_without_position_ids: position ids passed to generate() follow its
    # convention (attention_mask.cumsum(-1) - 1); RoBERTa's shift by padding_idx + 1 was applied only to the ones
    # generate() made itself, so explicit ones moved every absolute position by 2 (logits off by ~0.05 here)
    model = decoder(position_embedding_type="absolute", max_position_embeddings=80, seed=3)
    input_ids, mask = left_padded((30, 17), 30)
    options = {"nprf": {}, "dynamic": {"cache_implementation": "dynamic"}, "uncached": {"use_cache": False}}[cache]
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1, return_dict_in_generate=True,
                  output_logits=True, **options)
    implicit = model.generate(input_ids, **kwargs)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    explicit = model.generate(input_ids, position_ids=position_ids, **kwargs)
    assert torch.equal(explicit.sequences, implicit.sequences)
    assert torch.equal(torch.stack(explicit.logits), torch.stack(implicit.logits))
    # and both are the logits of a forward pass without position ids
    full_mask = torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], 1)
    full = model(explicit.sequences, attention_mask=full_mask, use_cache=False).logits
    torch.testing.assert_close(torch.stack(explicit.logits, 1).double(), full[:, 29:-1], rtol=0, atol=1e-6)  # float32 logits


def test_decoder_with_cross_attention_keeps_its_self_attention_state_in_an_nprf_cache():
    model = decoder(add_cross_attention=True)
    input_ids, mask = left_padded((30, 17), 30)
    encoder_states = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = model.generate(input_ids, attention_mask=mask, encoder_hidden_states=encoder_states, max_new_tokens=10,
                         do_sample=False, pad_token_id=1, return_dict_in_generate=True, output_logits=True)
    assert isinstance(out.past_key_values.self_attention_cache, NPRFCache)
    assert isinstance(out.past_key_values.cross_attention_cache, DynamicCache)
    full_mask = torch.cat([mask, torch.ones(2, 10, dtype=mask.dtype)], 1)
    full = model(out.sequences, attention_mask=full_mask, encoder_hidden_states=encoder_states, use_cache=False).logits
    torch.testing.assert_close(torch.stack(out.logits, 1).double(), full[:, 29:-1], rtol=0, atol=1e-5)


def test_chunked_prefill_goes_through_the_recurrent_continuation():
    model = decoder(dtype=torch.float32)
    input_ids, mask = left_padded((30, 17), 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1, return_dict_in_generate=True,
                  output_logits=True)
    chunked = model.generate(input_ids, prefill_chunk_size=7, **kwargs)  # 7 tokens, then 4 continuations of up to 7
    assert isinstance(chunked.past_key_values, NPRFCache)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert torch.equal(chunked.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(chunked.logits), torch.stack(uncached.logits), rtol=0, atol=1e-5)


def test_half_precision_keeps_the_state_in_float32():
    model = decoder(dtype=torch.bfloat16)
    input_ids, mask = left_padded((30, 17), 40)
    mask[:, 30:] = 1
    full = model(input_ids, attention_mask=mask, use_cache=False).logits.float()
    logits, cache = decode_logits(model, input_ids, mask, 30)
    assert cache.layers[0].far_states.dtype == torch.float32 and logits.dtype == torch.bfloat16
    # the attention runs in float32 on both sides; what differs is rounded to bfloat16 (a few ulps of 2^-7 at most)
    assert (logits.float() - full[:, 29:]).abs().max() <= 0.05


# ---------------------------------------------------------------------------------------------
# Static cache and compiled decoding (issue 25), after transformers' generation tests
# (test_generate_with_static_cache, test_generate_from_inputs_embeds_with_static_cache,
# test_static_cache_no_recompile_with_smaller_length, test_generate_compilation_all_outputs,
# test_generate_compile_model_forward_fullgraph)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    """No compiled code or graph count from another test."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def forced_compile_config(backend="aot_eager"):
    """generate()'s compile options, compiling on CPU too; fullgraph and dynamic=False, so that a graph break is an
    error and every new shape a recompile. aot_eager: dynamo + AOTAutograd (what decides graph breaks and guards)
    without inductor's compile time."""
    options = {} if backend == "inductor" else {"mode": None}  # (reduce-overhead: CUDA graphs, inductor only)
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, **options)
    config._compile_all_devices = True
    return config


def assert_same_generation(actual, expected, atol):
    assert torch.equal(actual.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(actual.scores), torch.stack(expected.scores), rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_static_cache_generates_the_tokens_of_the_default_cache(dtype):
    # test_generate_with_static_cache: cache_implementation="static" (refused before) gives the tokens and scores
    # of every other path and a constant-size state, whatever max_new_tokens
    model = decoder(dtype=dtype, position_embedding_type="absolute", max_position_embeddings=80, seed=3)
    input_ids, mask = left_padded((30, 17), 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=1, return_dict_in_generate=True,
                  output_scores=True, output_logits=True)
    static = model.generate(input_ids, cache_implementation="static", **kwargs)
    cache = static.past_key_values
    assert isinstance(cache, NPRFStaticCache) and cache.is_compileable and len(cache) == TINY["num_hidden_layers"]
    assert int(cache.get_seq_length()) == 30 + 20 - 1  # the last token is not yet in it
    default = model.generate(input_ids, **kwargs)
    assert type(default.past_key_values) is NPRFCache and not default.past_key_values.is_compileable
    assert [cache.nbytes(i) for i in range(2)] == [default.past_key_values.nbytes(i) for i in range(2)]
    # the same operations as the default cache, its state written in place
    assert torch.equal(static.sequences, default.sequences)
    assert torch.equal(torch.stack(static.logits), torch.stack(default.logits))
    atol = 1e-6 if dtype == torch.float64 else 2e-2  # float16: an exact cache vs a different order of operations
    for options in ({"cache_implementation": "dynamic"}, {"use_cache": False}):
        assert_same_generation(static, model.generate(input_ids, **options, **kwargs), atol)
    if dtype == torch.float64:  # and the logits of a forward pass
        full_mask = torch.cat([mask, torch.ones(2, 20, dtype=mask.dtype)], 1)
        full = model(static.sequences, attention_mask=full_mask, use_cache=False).logits
        torch.testing.assert_close(torch.stack(static.logits, 1).double(), full[:, 29:-1], rtol=0, atol=1e-6)


def test_static_cache_beam_search_and_continuation():
    model = decoder(dtype=torch.float32)
    input_ids, mask = left_padded((30, 17), 30)
    beams = dict(attention_mask=mask, max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False,
                 return_dict_in_generate=True, output_scores=True, pad_token_id=1)
    static = model.generate(input_ids, cache_implementation="static", **beams)  # beams reordered in place
    default = model.generate(input_ids, **beams)
    assert isinstance(static.past_key_values, NPRFStaticCache)
    assert torch.equal(static.sequences, default.sequences)
    assert torch.equal(static.sequences_scores, default.sequences_scores)
    # a returned static cache goes on, fed a chunk of several tokens then one at a time
    first = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=1,
                           cache_implementation="static", return_dict_in_generate=True)
    mask2 = torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype)], 1)
    again = model.generate(first.sequences, attention_mask=mask2, past_key_values=first.past_key_values,
                           max_new_tokens=10, do_sample=False, pad_token_id=1)
    scratch = model.generate(first.sequences, attention_mask=mask2, max_new_tokens=10, do_sample=False, pad_token_id=1)
    assert torch.equal(again, scratch) and int(first.past_key_values.get_seq_length()) == 47


def test_static_cache_generates_from_inputs_embeds():
    # test_generate_from_inputs_embeds_with_static_cache
    model = decoder(dtype=torch.float32, position_embedding_type="absolute", max_position_embeddings=80, seed=3)
    input_ids, mask = left_padded((30, 17), 30)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=1, return_dict_in_generate=True,
                  output_logits=True)
    embeds = model.get_input_embeddings()(input_ids)
    static = model.generate(inputs_embeds=embeds, cache_implementation="static", **kwargs)
    assert isinstance(static.past_key_values, NPRFStaticCache)
    assert int(static.past_key_values.get_seq_length()) == 30 + 10 - 1
    from_ids = model.generate(input_ids, **kwargs)
    assert torch.equal(static.sequences, from_ids.sequences[:, 30:])
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(from_ids.logits), rtol=0, atol=1e-6)


def test_compiled_static_generation_equals_eager_without_recompiling(fresh_dynamo):
    # test_generate_compile_model_forward_fullgraph, test_static_cache_no_recompile_with_smaller_length and
    # test_generate_compilation_all_outputs (less the attention weights: refused with a static cache): generate()
    # compiles its decode step (fullgraph, dynamic=False) once; two inputs of one shape, then shorter and longer
    # contexts and more new tokens (past the band, W = 12) run that one graph, never recompiling
    model = decoder(dtype=torch.float32, position_embedding_type="absolute", max_position_embeddings=120, seed=3)
    kwargs = dict(do_sample=False, pad_token_id=1, return_dict_in_generate=True, output_scores=True, output_logits=True,
                  output_hidden_states=True)
    config = forced_compile_config()
    runs = [((30, 17), 30, 6), ((25, 30), 30, 6), ((9, 4), 9, 3), ((40, 2), 40, 30)]
    for index, (lengths, total, new) in enumerate(runs):
        input_ids, mask = left_padded(lengths, total, seed=index)
        eager = model.generate(input_ids, attention_mask=mask, max_new_tokens=new, **kwargs)
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
            compiled = model.generate(input_ids, attention_mask=mask, max_new_tokens=new, cache_implementation="static",
                                      compile_config=config, **kwargs)
        assert hasattr(model, "_compiled_call") and isinstance(compiled.past_key_values, NPRFStaticCache)
        assert_same_generation(compiled, eager, atol=1e-5)
        torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), rtol=0, atol=1e-5)
        assert len(compiled.hidden_states) == new
        for step, (got, expected) in enumerate(zip(compiled.hidden_states, eager.hidden_states)):
            assert len(got) == TINY["num_hidden_layers"] + 1 and got[-1].shape == (2, total if step == 0 else 1, 32)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # the decode step, for every context length


def test_compiled_static_generation_without_padding(fresh_dynamo):
    # issue 47 (test_generate_compile_model_forward_fullgraph, inputs without padding): generate() drops an all-ones
    # mask, and for a compileable cache transformers would build a 4D causal mask, a graph break under fullgraph
    model = decoder(dtype=torch.float32, seed=3)
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=4, do_sample=False, pad_token_id=1,
                  return_dict_in_generate=True, output_scores=True)
    eager = model.generate(input_ids, **kwargs)
    compiled = model.generate(input_ids, cache_implementation="static", compile_config=forced_compile_config(), **kwargs)
    assert hasattr(model, "_compiled_call")
    assert_same_generation(compiled, eager, atol=1e-5)


@pytest.mark.parametrize("positions", ["explicit", "implicit"])
def test_compiled_forward_decodes_without_recompiling_float64(positions, fresh_dynamo):
    # torch.compile(model.forward, fullgraph=True) on decode steps through an NPRFStaticCache: one graph from the
    # first step to the 40th (the context crosses the band), the logits of one full forward pass at every position
    model = decoder(position_embedding_type="absolute", max_position_embeddings=80)
    prompt, total = 30, 70
    input_ids, mask = left_padded((30, 17) if positions == "explicit" else (30, 30), prompt)
    new_ids = torch.randint(3, TINY["vocab_size"], (2, total - prompt), generator=torch.Generator().manual_seed(1))
    input_ids, mask = torch.cat([input_ids, new_ids], 1), torch.cat([mask, torch.ones_like(new_ids)], 1)
    full = model(input_ids, attention_mask=mask, use_cache=False).logits
    # RoBERTa's numbering (padding_idx + 1 on over the real tokens), or none: the embeddings count from the
    # cache's length, a tensor (no padding then: that count includes padded tokens)
    position_ids = (mask.cumsum(-1) + 1).masked_fill(mask == 0, 1) if positions == "explicit" else None

    def positions_of(start, stop):
        return {} if position_ids is None else {"position_ids": position_ids[:, start:stop]}

    cache = NPRFStaticCache(model.config)
    step = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        out = model(input_ids[:, :prompt], attention_mask=mask[:, :prompt], past_key_values=cache,
                    **positions_of(0, prompt))
        logits = [out.logits[:, -1]]
        for t in range(prompt, total):
            with torch.compiler.set_stance("fail_on_recompile" if t > prompt else "default"):
                # the new token's padding only ([B, 1], as generate() gives a compiled step): one shape at every step
                out = step(input_ids[:, t : t + 1], attention_mask=mask[:, t : t + 1], past_key_values=cache,
                           **positions_of(t, t + 1))
            logits.append(out.logits[:, -1])
    assert counters["stats"]["unique_graphs"] == 1 and int(cache.get_seq_length()) == total
    real = mask[:, prompt - 1 :].bool()
    assert_as_full(model, torch.stack(logits, 1)[real], full[:, prompt - 1 :][real], total)


def test_a_mask_of_the_new_tokens_only_equals_the_whole_sequence_mask():
    model = decoder()
    input_ids, mask = left_padded((30, 17), 40)
    mask[:, 30:] = 1
    for cache_class in (NPRFCache, NPRFStaticCache):
        results = []
        for new_only in (False, True):
            cache = model(input_ids[:, :30], attention_mask=mask[:, :30], past_key_values=cache_class(model.config))
            cache = cache.past_key_values
            logits = []
            for start, stop in [(30, 34), (34, 35), (35, 40)]:
                step_mask = mask[:, start:stop] if new_only else mask[:, :stop]
                logits.append(model(input_ids[:, start:stop], attention_mask=step_mask, past_key_values=cache).logits)
            results.append(torch.cat(logits, 1))
        assert torch.equal(results[0], results[1])


@pytest.mark.skipif(not os.environ.get("NPRF_RUN_SLOW"), reason="an inductor compile: ~45 s on 2 CPU cores; set NPRF_RUN_SLOW=1")
def test_inductor_compiled_static_generation_equals_eager(fresh_dynamo):
    # generate()'s own compile path with its default backend (inductor), fullgraph
    model = decoder(dtype=torch.float32, seed=3)
    kwargs = dict(do_sample=False, pad_token_id=1, return_dict_in_generate=True, output_scores=True)
    config = forced_compile_config("inductor")
    for index, (lengths, total, new) in enumerate([((30, 17), 30, 8), ((9, 4), 9, 30)]):
        input_ids, mask = left_padded(lengths, total, seed=index)
        eager = model.generate(input_ids, attention_mask=mask, max_new_tokens=new, **kwargs)
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
            compiled = model.generate(input_ids, attention_mask=mask, max_new_tokens=new, cache_implementation="static",
                                      compile_config=config, **kwargs)
        assert_same_generation(compiled, eager, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_generation_benchmark_times_the_static_cache_eager_and_compiled(tmp_path, fresh_dynamo):
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "generation.py")
    spec = importlib.util.spec_from_file_location("benchmark_generation", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out = str(tmp_path / "generation.json")
    results = benchmark.main(["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--vocab-size", "100",
                              "--threads", "1", "--contexts", "16", "80", "--new-tokens", "3", "--warmup-tokens", "1",
                              "--isolation", "none", "--variants", "nprf", "nprf_static", "nprf_compiled",
                              "--compile-backend", "aot_eager", "--output", out, "--plot", ""])
    by = {(r["variant"], r["context"]): r for r in results}
    for r in results:
        assert r["status"] == "ok", r
        assert r["final_length"] == r["context"] + 1 + 3
    for context in (16, 80):
        assert by[("nprf_static", context)]["cache_class"] == by[("nprf_compiled", context)]["cache_class"] == "NPRFStaticCache"
        assert by[("nprf_compiled", context)]["compiled_graphs"] == 1  # compiled in the warm-up, no recompile after
        assert by[("nprf_static", context)]["cache_bytes_per_layer"] == by[("nprf", 16)]["cache_bytes_per_layer"]
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--variants", "nprf_compiled", "--warmup-tokens", "0"])
