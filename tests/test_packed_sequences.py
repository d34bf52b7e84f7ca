"""Padding-free batches (issue 47): sequences packed into one row, `position_ids` starting again at 0 at each
(transformers' `DataCollatorWithFlattening`), give every sequence exactly what it gets alone: NPRF attention
restricted to each sequence, its relative positions, causal order, far sums and optional terms its own. The
reference is each sequence run alone through the same model (float64); with padding; through the gradients."""

import pytest
import torch

from nprf_hf.configuration_nprf import NPRF_CONFIG_CLASSES
from nprf_hf.families import FAMILIES
from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES, PackedSequences

from tolerances import assert_within, attention_checked_against, model_rounding

LENGTHS = (5, 3, 7)  # the sequences of the first packed row; the second row packs (4, 6) and is padded


def tiny_model(model_type, head="model", is_decoder=False, **fields):
    family = FAMILIES[model_type]
    sizes = dict(vocab_size=60, max_position_embeddings=64, pad_token_id=1, eos_token_id=2)
    if family.layout == "distilbert":
        sizes.update(dim=32, n_heads=2, n_layers=2, hidden_dim=37)
    else:
        sizes.update(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=37,
                     is_decoder=is_decoder)
        if model_type == "electra":
            sizes.update(embedding_size=16)
    fields = dict(dict(num_random_features=16, rpe_num_buckets=8, rpe_max_distance=16), **fields)
    config = NPRF_CONFIG_CLASSES[model_type](**sizes, **fields)
    torch.manual_seed(0)
    model = NPRF_MODEL_CLASSES[model_type][head](config).double().eval()
    with torch.no_grad():  # every learned bias away from its neutral start, so that each shows in the outputs
        for name, parameter in model.named_parameters():
            if any(key in name for key in ("rpe_table", "cross_segment_bias", "token_match_weight",
                                           "logit_scale_logit", "first_token_bias")):
                parameter.uniform_(0.2, 1.5)
    return model


def output(model, **inputs):
    result = model(**inputs, use_cache=False) if getattr(model.config, "is_decoder", False) else model(**inputs)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def assert_as_alone(model, packed, alone, n, batch=1, gradient=False, scale=None):
    """A packed sequence's outputs (or gradients) as alone: the same function in other shapes, float64 rounding
    (`tolerances.model_rounding`) of the largest entry (`scale`, else `alone`'s)."""
    scale = alone.abs().max() if scale is None else scale
    assert_within(packed, alone, model_rounding(model, n, batch, gradient=gradient) * scale)


def sequences(generator, lengths, eos=2):
    out = []
    for length in lengths:
        ids = torch.randint(3, 60, (length,), generator=generator)
        if length > 3:
            ids[length // 2] = eos  # a sentence pair: <s> A </s> B (the separator rule's segments)
        out.append(ids)
    return out


def packed_batch(rows, pad_id=1):
    """rows: a list of lists of 1D id tensors -> (input_ids [B, L], position_ids [B, L], attention_mask [B, L])
    with each row right-padded to the longest."""
    width = max(sum(len(s) for s in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        flat = torch.cat(row)
        ids[b, : len(flat)] = flat
        positions[b, : len(flat)] = torch.cat([torch.arange(len(s)) for s in row])
        mask[b, : len(flat)] = 1
    return ids, positions, mask


CASES = [
    ("bert", "model", False, {}),
    ("bert", "model", False, {"segment_bias": True, "token_match": True, "logit_scale_max": 4.0}),
    ("roberta", "masked-lm", False, {"segment_bias": True, "token_match": True, "first_token_bias": True}),
    ("roberta", "causal-lm", True, {}),
    ("roberta", "causal-lm", True, {"attention_algorithm": "fft"}),
    ("xlm-roberta", "model", False, {"attention_algorithm": "banded", "rpe_num_buckets": 6, "rpe_max_distance": 4}),
    ("roberta", "causal-lm", True, {"attention_algorithm": "banded", "rpe_num_buckets": 6, "rpe_max_distance": 4}),
    ("electra", "causal-lm", True, {"attention_algorithm": "dense", "logit_scale_max": 4.0}),
    ("distilbert", "model", False, {}),
]


@pytest.mark.parametrize("model_type,head,is_decoder,fields", CASES, ids=lambda v: str(v))
def test_each_packed_sequence_gets_what_it_gets_alone(model_type, head, is_decoder, fields):
    model = tiny_model(model_type, head, is_decoder, **fields)
    generator = torch.Generator().manual_seed(1)
    rows = [sequences(generator, LENGTHS), sequences(generator, (4, 6))]
    ids, positions, mask = packed_batch(rows)
    assert mask[1].sum() < mask.shape[1]  # the second row is padded

    # every fft / banded attention within its own bounds of the dense one and replaced by it (the fft's
    # conditioning stays in that check), so that the packed and lone runs differ by direct rounding only
    with attention_checked_against("dense"):
        packed = output(model, input_ids=ids, position_ids=positions, attention_mask=mask)
        for b, row in enumerate(rows):
            start = 0
            for sequence in row:
                alone = output(model, input_ids=sequence[None], position_ids=torch.arange(len(sequence))[None])
                assert_as_alone(model, packed[b, start : start + len(sequence)], alone[0], ids.shape[1], len(rows))
                start += len(sequence)
    # without the position ids the row is one sequence, attended across the boundaries: a different output
    whole = output(model, input_ids=ids, attention_mask=mask)
    assert (whole[0] - packed[0]).abs().max() > 1e-3


@pytest.mark.parametrize("model_type,head,is_decoder,fields", [CASES[1], CASES[3], CASES[7]], ids=lambda v: str(v))
def test_packed_gradients_are_the_sum_of_each_sequence_alone(model_type, head, is_decoder, fields):
    model = tiny_model(model_type, head, is_decoder, **fields)
    generator = torch.Generator().manual_seed(2)
    rows = [sequences(generator, LENGTHS), sequences(generator, (4, 6))]
    ids, positions, mask = packed_batch(rows)
    with torch.no_grad():
        width = output(model, input_ids=ids[:1, :2]).shape[-1]
    weights = torch.randn(*ids.shape, width, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    model.zero_grad()
    packed = output(model, input_ids=ids, position_ids=positions, attention_mask=mask)
    (packed * weights * mask[..., None]).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    for b, row in enumerate(rows):
        start = 0
        for sequence in row:
            alone = output(model, input_ids=sequence[None], position_ids=torch.arange(len(sequence))[None])
            (alone[0] * weights[b, start : start + len(sequence)]).sum().backward()
            start += len(sequence)
    alone = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    assert set(packed) == set(alone) and any("rpe_table" in name for name in packed)
    scale = max(gradient.abs().max() for gradient in alone.values())  # backward rounds relative to the upstream
    for name in packed:
        assert_as_alone(model, packed[name], alone[name], ids.shape[1], len(rows), gradient=True, scale=scale)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_packed_attention_weights_are_each_sequence_s_own(is_decoder):
    model = tiny_model("roberta", "causal-lm" if is_decoder else "model", is_decoder)
    generator = torch.Generator().manual_seed(4)
    row = sequences(generator, LENGTHS)
    ids, positions, _ = packed_batch([row])
    kwargs = {"use_cache": False} if is_decoder else {}
    packed = model(input_ids=ids, position_ids=positions, output_attentions=True, **kwargs).attentions
    start = 0
    for sequence in row:
        alone = model(input_ids=sequence[None], position_ids=torch.arange(len(sequence))[None],
                      output_attentions=True, **kwargs).attentions
        stop = start + len(sequence)
        for layer, weights in zip(packed, alone):
            assert_as_alone(model, layer[0, :, start:stop, start:stop], weights[0], ids.shape[1], scale=1.0)
            assert layer[0, :, start:stop, :start].abs().sum() == 0
            assert layer[0, :, start:stop, stop:].abs().sum() == 0
        start = stop


def test_a_decoder_returns_no_cache_for_packed_sequences():
    """A cache of a packed row could continue none of its sequences: none is made (use_cache left to the config)."""
    model = tiny_model("roberta", "causal-lm", True)
    generator = torch.Generator().manual_seed(5)
    row = sequences(generator, LENGTHS)
    ids, positions, _ = packed_batch([row])
    result = model(input_ids=ids, position_ids=positions)
    assert result.past_key_values is None
    last = row[-1]
    alone = model(input_ids=last[None], position_ids=torch.arange(len(last))[None], use_cache=False).logits
    assert_as_alone(model, result.logits[0, -len(last):], alone[0], ids.shape[1])


def test_data_collator_with_flattening():
    """The batch transformers' DataCollatorWithFlattening makes (one row, position ids per sequence)."""
    from transformers import DataCollatorWithFlattening

    model = tiny_model("bert", "masked-lm")
    generator = torch.Generator().manual_seed(6)
    row = sequences(generator, LENGTHS)
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s.tolist()} for s in row])
    batch.pop("labels")
    packed = model(**batch).logits
    start = 0
    for sequence in row:
        alone = model(input_ids=sequence[None]).logits
        assert_as_alone(model, packed[0, start : start + len(sequence)], alone[0], packed.shape[1])
        start += len(sequence)


def test_flash_attention_boundaries_without_position_ids_are_refused():
    """cu_seq_lens_q alone (DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False))
    would otherwise be ignored: one sequence across the boundaries."""
    from transformers import DataCollatorWithFlattening

    model = tiny_model("bert", "masked-lm")
    row = sequences(torch.Generator().manual_seed(7), LENGTHS)
    features = [{"input_ids": s.tolist()} for s in row]
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True,
                                       return_position_ids=False)(features)
    batch.pop("labels")
    with pytest.raises(ValueError, match="cu_seq_lens_q .* without position_ids.*return_position_ids"):
        model(**batch)
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(features)
    batch.pop("labels")
    packed = model(**batch).logits
    alone = model(input_ids=row[1][None]).logits
    assert_as_alone(model, packed[0, LENGTHS[0] : LENGTHS[0] + LENGTHS[1]], alone[0], packed.shape[1])


def test_find_packed_sequences():
    find = PackedSequences.find
    # one sequence per row: plain positions, right / left padding with any position of the padding, holes
    assert find(torch.arange(6)[None], None, 2) is None
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1]]).bool()
    positions = torch.tensor([[0, 1, 2, 3, 1, 1], [1, 1, 0, 1, 2, 3], [0, 0, 1, 2, 0, 3]])
    assert find(positions, mask, 3) is None
    assert find(positions + 2, mask, 3) is None  # RoBERTa's numbering from padding_idx + 1
    # packed: (3, 3) in row 0; (2, 1, 2) in row 1, whose last column is padding; positions of padding ignored
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 1, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]).bool()
    found = find(positions, mask, 2)
    assert found.max_length == 3 and found.rows.tolist() == [0, 0, 1, 1, 1]
    assert found.valid.sum(-1).tolist() == [3, 3, 2, 1, 2]
    assert found.slots[found.valid].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # unpack then pack is the identity on real tokens, zeros on padding
    states = torch.randn(2, 3, 6, 4)
    back = found.pack(found.unpack(states))
    torch.testing.assert_close(back[1, :, :5], states[1, :, :5])
    torch.testing.assert_close(back[0], states[0])
    assert back[1, :, 5].abs().max() == 0
