"""The first-key bias (`nprf_terms.FirstTokenBias`, config `first_token_bias`), the first term added through
`nprf_terms` after the terms became one object: every algorithm against the float64 reference with padding,
gradients and the other terms, and through the models (identity at its initial value, trained by the transfer,
refused by decoders)."""

import pytest
import torch

from nprf_hf import NPRFBertConfig, NPRFBertModel, NPRFRobertaConfig
from nprf_hf import functional as Fn
from nprf_hf import nprf_banded
from nprf_hf.nprf_naive import naive_attention, naive_attention_weights
from nprf_hf.nprf_terms import AttentionTerms, FirstTokenBias, SegmentBias, TokenMatch
from nprf_hf.transfer import TABLE_PARAMETERS

from tolerances import attention_rounding


def case(n, seed=0, batch=3, heads=2, d=8, m=6):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, dtype=torch.float64, generator=generator, requires_grad=True)
               for _ in range(3))
    projection = Fn.draw_projection(m, d, "orf", num_heads=heads, dtype=torch.float64, generator=generator)
    table = torch.randn(heads, 16, dtype=torch.float64, generator=generator)
    bias = Fn.relative_position_bias(table, n, True, 16, 40)
    mask = torch.arange(n)[None, :] < torch.tensor([n, n // 2, 1])[:, None]
    return q, k, v, projection, bias, mask


def first_key_factor(gamma, n):
    """exp(gamma [j = 0]) [1, H, 1, n]: the term's factor on w_ij (for `attention_rounding`)."""
    factor = torch.ones(1, gamma.shape[0], 1, n, dtype=torch.float64)
    factor[..., 0] = torch.exp(gamma.detach().double())[None, :, None]
    return factor


@pytest.mark.parametrize("algorithm", ["dense", "fft", "banded", "auto"])
@pytest.mark.parametrize("n", [9, 120])
def test_every_algorithm_matches_the_reference_with_gradients(algorithm, n, monkeypatch):
    monkeypatch.setattr(nprf_banded, "BANDED_MIN_CHUNK", 4)  # the chunked banded path at small n
    q, k, v, projection, bias, mask = case(n)
    gamma = torch.tensor([2.5, -1.0], dtype=torch.float64, requires_grad=True)
    terms = AttentionTerms(FirstTokenBias(gamma))
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm,
                            band_width=Fn.rpe_band_width(16, 40), terms=terms)
    ref = naive_attention(q, k, v, bias, projection, mask, first_key_bias=gamma)
    rounding = attention_rounding(q, k, v, bias, projection, ref, mask, False, algorithm,
                                  pair_factor=first_key_factor(gamma, n))
    rounding.assert_values(out, ref)
    assert (out - naive_attention(q, k, v, bias, projection, mask)).abs().max() > 1e-3  # the term does something
    weights = torch.randn_like(ref)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v, gamma))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v, gamma))
    rounding.assert_gradients(got, want, ("q", "k", "v", "first_key_bias"))
    with torch.no_grad():  # the inference paths
        rounding.assert_values(Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, terms=terms),
                               ref, "inference")
    torch.testing.assert_close(Fn.nprf_attention_weights(q, k, bias, projection, mask, terms=terms),
                               naive_attention_weights(q, k, bias, projection, mask, first_key_bias=gamma))


@pytest.mark.parametrize("algorithm", ["dense", "fft", "banded"])
def test_only_the_bias_trains(algorithm):
    """Gradients reach the bias when nothing else requires them (the products' inference paths must not be used)."""
    q, k, v, projection, bias, mask = case(40, seed=3)
    q, k, v = (t.detach() for t in (q, k, v))
    gamma = torch.tensor([1.5, -0.5], dtype=torch.float64, requires_grad=True)
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, band_width=Fn.rpe_band_width(16, 40),
                            terms=AttentionTerms(FirstTokenBias(gamma)))
    ref = naive_attention(q, k, v, bias, projection, mask, first_key_bias=gamma)
    weights = torch.randn_like(ref)
    rounding = attention_rounding(q, k, v, bias, projection, ref, mask, False, algorithm,
                                  pair_factor=first_key_factor(gamma, 40))
    rounding.assert_gradients(torch.autograd.grad((out * weights).sum(), gamma),
                              torch.autograd.grad((ref * weights).sum(), gamma), ("first_key_bias",))


def test_with_the_pair_terms_and_an_exact_variant():
    q, k, v, projection, bias, mask = case(30, seed=1)
    generator = torch.Generator().manual_seed(2)
    segments = (torch.arange(30) >= 12).long().expand(3, 30)
    tokens = torch.randint(0, 4, (3, 30), generator=generator)
    beta, mu = torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([1.5, 0.0], dtype=torch.float64)
    gamma = torch.tensor([-0.7, 3.0], dtype=torch.float64)
    terms = AttentionTerms(SegmentBias(segments, beta), TokenMatch(tokens, mu, segments), FirstTokenBias(gamma))
    expected = dict(segment_ids=segments, segment_bias=beta, token_ids=tokens, match_weight=mu, first_key_bias=gamma)
    crossing = (segments[:, :, None] != segments[:, None, :])[:, None]
    factor = torch.exp(beta[None, :, None, None] * crossing) * first_key_factor(gamma, 30)  # the matches only add
    ref = naive_attention(q, k, v, bias, projection, mask, **expected)
    for algorithm in ("dense", "banded", "fft"):
        out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, terms=terms)
        attention_rounding(q, k, v, bias, projection, ref, mask, False, algorithm, pair_factor=factor).assert_values(
            out, ref, algorithm)
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, terms=AttentionTerms(FirstTokenBias(gamma)),
                            variant="softmax")
    ref = naive_attention(q, k, v, bias, None, mask, variant="softmax", first_key_bias=gamma)
    attention_rounding(q, k, v, bias, None, ref, mask, False, "dense", variant="softmax",
                       pair_factor=first_key_factor(gamma, 30)).assert_values(out, ref, "softmax")


def test_wrong_shape_and_causal_use_are_refused():
    q, k, v, projection, bias, mask = case(10)
    with pytest.raises(ValueError, match="first_key_bias must be \\[H=2\\]"):
        Fn.nprf_attention(q, k, v, bias, projection, terms=AttentionTerms(FirstTokenBias(torch.zeros(3))))
    with pytest.raises(ValueError, match="causal=False"):
        Fn.nprf_attention(q, k, v, bias, projection, causal=True, terms=AttentionTerms(FirstTokenBias(torch.zeros(2))))


def test_models_start_unchanged_learn_it_and_decoders_refuse_it():
    tiny = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                num_random_features=8, max_position_embeddings=64)
    torch.manual_seed(0)
    plain = NPRFBertModel(NPRFBertConfig(**tiny)).eval()
    biased = NPRFBertModel(NPRFBertConfig(**tiny, first_token_bias=True)).eval()
    missing, unexpected = biased.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == [f"encoder.layer.{i}.attention.self.first_key_bias" for i in range(2)]
    ids = torch.randint(3, 64, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    with torch.no_grad():
        torch.testing.assert_close(biased(ids, attention_mask=mask).last_hidden_state,
                                   plain(ids, attention_mask=mask).last_hidden_state)
    biased.train()
    biased(ids, attention_mask=mask).last_hidden_state.square().sum().backward()
    assert biased.encoder.layer[0].attention.self.first_key_bias.grad.abs().min() > 0
    assert "first_key_bias" in TABLE_PARAMETERS  # the transfer trains it at the table learning rate
    with pytest.raises(ValueError, match="first_token_bias is for encoders"):
        NPRFRobertaConfig(**tiny, is_decoder=True, first_token_bias=True)
