"""`rpe_far_bias` (issue 21): the bias of every distance beyond the RPE band fixed at one value, e.g. -30 for
attention local to the band on whole long documents. The fixed entries against the unfixed table, the models'
wiring (every algorithm, padding, the decoding cache) against a table holding the value itself, locality, and
the config's checks."""

import pytest
import torch

from nprf_hf import NPRFBertConfig, NPRFBertModel, NPRFRobertaConfig, NPRFRobertaForCausalLM
from nprf_hf.functional import far_bucket_table, relative_position_bias, rpe_band_width

from conftest import tiny_nprf_config
from tolerances import assert_within, attention_checked_against, model_rounding


BUCKETS, DISTANCE = 8, 16  # conftest's tiny RPE: a band of 9 (bidirectional) / 12 (causal)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_exactly_the_distances_beyond_the_band_take_the_value(bidirectional):
    table = torch.randn(3, BUCKETS, dtype=torch.float64, requires_grad=True)
    n = 40
    width = rpe_band_width(BUCKETS, DISTANCE, bidirectional)
    fixed = relative_position_bias(far_bucket_table(table, -7.5, bidirectional), n, bidirectional, BUCKETS, DISTANCE)
    learned = relative_position_bias(table, n, bidirectional, BUCKETS, DISTANCE)
    r = torch.arange(-(n - 1), n)
    beyond = r.abs() >= width if bidirectional else r <= -width
    assert bool((fixed[:, beyond] == -7.5).all())
    assert torch.equal(fixed[:, ~beyond], learned[:, ~beyond])
    assert not torch.equal(fixed, learned)  # the band is narrower than the input: something changed
    # the fixed buckets get no gradient, every other bucket used does
    fixed.sum().backward()
    used = table.grad != 0
    far = [BUCKETS - 1] + ([BUCKETS // 2 - 1] if bidirectional else [])
    assert not bool(used[:, far].any())
    assert bool(used.sum(-1).gt(0).all())
    assert far_bucket_table(table, 0.0, bidirectional) is table  # 0 = off: the table itself


def tiny_encoder(**overrides):
    config = NPRFBertConfig(**tiny_nprf_config(max_position_embeddings=128, **overrides))
    torch.manual_seed(0)  # the same weights for every override
    model = NPRFBertModel(config).eval().double()
    with torch.no_grad():
        model.encoder.rpe_table.normal_()
    return model


@pytest.mark.parametrize("algorithm", ["dense", "fft", "banded"])
def test_the_model_uses_the_value_for_every_far_distance(algorithm):
    """With padding, every algorithm: rpe_far_bias=-4 gives the outputs of a model whose table holds -4 in its
    farthest buckets, and outputs unlike the unfixed model's."""
    fixed = tiny_encoder(attention_algorithm=algorithm, rpe_far_bias=-4.0)
    by_hand = tiny_encoder(attention_algorithm=algorithm)
    with torch.no_grad():
        by_hand.encoder.rpe_table[:, [BUCKETS // 2 - 1, BUCKETS - 1]] = -4.0
    unfixed = tiny_encoder(attention_algorithm=algorithm)
    input_ids = torch.randint(3, 99, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    mask[1, 50:] = 0
    out = fixed(input_ids, attention_mask=mask).last_hidden_state
    # the same bucket table (its far entries set to the same -4.0 either way), the same computation: equal to the
    # bit (was atol 1e-12)
    torch.testing.assert_close(out, by_hand(input_ids, attention_mask=mask).last_hidden_state, rtol=0, atol=0)
    assert (out - unfixed(input_ids, attention_mask=mask).last_hidden_state)[mask.bool()].abs().max() > 1e-3


def test_far_keys_stop_mattering_and_short_inputs_are_unchanged():
    width = rpe_band_width(BUCKETS, DISTANCE)
    one_layer = {"num_hidden_layers": 1}
    local, unfixed = tiny_encoder(rpe_far_bias=-30.0, **one_layer), tiny_encoder(**one_layer)
    input_ids = torch.randint(3, 99, (1, 60), generator=torch.Generator().manual_seed(2))
    changed = input_ids.clone()
    changed[0, 59] = 3 if int(input_ids[0, 59]) != 3 else 4  # a key 59 - width + 1 > 0 positions beyond query 0's band
    for model, moves in ((local, False), (unfixed, True)):
        before, after = (model(ids).last_hidden_state[0, : 59 - width + 1] for ids in (input_ids, changed))
        assert ((before - after).abs().max() > 1e-6) == moves
    short = input_ids[:, :width]  # no pair is as far apart as the band: the far bias never applies
    assert torch.equal(local(short).last_hidden_state, unfixed(short).last_hidden_state)


def test_cached_decoding_uses_it_too():
    config = tiny_nprf_config(max_position_embeddings=256, position_embedding_type="none", is_decoder=True,
                              pad_token_id=1, rpe_far_bias=-3.0)
    model = NPRFRobertaForCausalLM(NPRFRobertaConfig(**config)).eval().double()
    input_ids = torch.randint(3, 99, (1, 40), generator=torch.Generator().manual_seed(3))
    with attention_checked_against("dense"):  # whatever "auto" picks, checked against dense per layer
        full = model(input_ids, use_cache=False).logits
        out = model(input_ids[:, :30], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(30, 40):
            out = model(input_ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    # the recurrent steps against one full pass: direct float64 rounding (`tolerances.model_rounding`; was atol 1e-10)
    assert_within(torch.stack(steps, 1)[:, :-1], full[:, 29:-1], model_rounding(model, 40, 1) * full.abs().max())


def test_it_can_be_set_at_load_and_bad_values_are_named(tmp_path):
    tiny_encoder().save_pretrained(tmp_path)
    loaded = NPRFBertModel.from_pretrained(tmp_path, rpe_far_bias=-30.0)
    assert loaded.config.rpe_far_bias == -30.0
    for bad in (1.0, float("nan"), float("-inf"), "far"):
        with pytest.raises(ValueError, match="rpe_far_bias must be 0 .off"):
            NPRFBertConfig(**tiny_nprf_config(rpe_far_bias=bad))
