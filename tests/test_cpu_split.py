"""One attention call cut into items of (sequences, heads) on the CPU threads (`nprf_cpu_split`, issue 45): the items
cover every sequence and head once, a split call equals the float64 reference and the unsplit call (values and
gradients of every input, padding, causal, every algorithm and term, both execution modes), the same on every run,
and what must not be split is not."""

import itertools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nprf_hf import functional as Fn
from nprf_hf import nprf_cpu_split, nprf_cpu_threads
from nprf_hf.nprf_naive import naive_attention
from nprf_hf.nprf_terms import AttentionTerms, FirstTokenBias

from tolerances import assert_within, attention_rounding, model_rounding

pytestmark = pytest.mark.skipif(not nprf_cpu_threads.available(), reason="this torch build has no per-thread "
                                "OpenMP / MKL thread count: calls run whole")
BAND = 9  # the bias is tied beyond |r| = 8: the banded algorithm has a band and far sums at these lengths


@pytest.fixture
def split_everything(monkeypatch, two_threads):
    """Every call split, however small, and the number of items of each split call recorded."""
    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_ELEMENTS", 0)
    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_LENGTH", 0)
    counts = []
    run = nprf_cpu_threads.CpuThreads.items

    def counted(self, count, task, static=False):
        if task.__module__ == nprf_cpu_split.__name__:  # the split's items (not the products' sequences inside them)
            counts.append(count)
        return run(self, count, task, static)

    monkeypatch.setattr(nprf_cpu_threads.CpuThreads, "items", counted)
    return counts


def case(batch, heads, n=37, d=8, m=6, per_head_projection=True, seed=0):
    """float64 leaves q, k, v [B, H, n, d], a bias [H, 2n - 1] tied beyond BAND, a projection, a padding mask (the
    first sequence's last three keys dropped) and every term's tensors, from a fresh generator."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    r = torch.arange(-(n - 1), n).abs().clamp(max=BAND - 1)
    bias = torch.randn(heads, BAND, dtype=torch.float64, generator=g)[:, r].requires_grad_()
    projection = torch.randn(*((heads,) if per_head_projection else ()), m, d, dtype=torch.float64, generator=g)
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[0, -3:] = False
    per_head = [torch.rand(heads, dtype=torch.float64, generator=g).add(0.5).requires_grad_() for _ in range(4)]
    terms = dict(logit_scale=per_head[0], segment_ids=(torch.arange(n) >= n // 3).long().repeat(batch, 1),
                 segment_bias=per_head[1], token_ids=torch.randint(0, 4, (batch, n), generator=g),
                 match_weight=per_head[2], first_key_bias=per_head[3])
    return (q, k, v, bias, projection.requires_grad_(), mask), terms


def attend(inputs, terms, names, causal, algorithm, recompute=None):
    q, k, v, bias, projection, mask = inputs
    chosen = {name: terms[name] for name in names}
    first = chosen.pop("first_key_bias", None)
    extra = AttentionTerms.from_arguments(**chosen)
    if first is not None:
        extra = AttentionTerms(*extra.terms, FirstTokenBias(first))
    return Fn.nprf_attention(q, k, v, bias, projection, key_padding_mask=mask, algorithm=algorithm, causal=causal,
                             band_width=BAND, terms=extra, recompute=recompute)


def values_and_gradients(inputs, terms, names, causal, algorithm, recompute=None):
    return _with_gradients(attend(inputs, terms, names, causal, algorithm, recompute), inputs, terms, names)


def reference_values_and_gradients(inputs, terms, names, causal):
    q, k, v, bias, projection, mask = inputs
    keywords = {name: terms[name] for name in names}
    return _with_gradients(naive_attention(q, k, v, bias, projection, mask, causal, **keywords), inputs, terms, names)


def _with_gradients(out, inputs, terms, names):
    """[z, the gradients of a random weighting of z for every leaf the call read]."""
    leaves = [t for t in inputs if t.requires_grad] + [terms[name] for name in names if terms[name].requires_grad]
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
    return [out.detach(), *torch.autograd.grad((out * weights).sum(), leaves)]


def assert_close_to(got, expected, inputs, terms, names, causal, algorithm, other="reference"):
    """[z, gradients] of `algorithm` against `other`'s ("reference": the float64 reference; an algorithm: the call
    unsplit) within the bounds derived for these inputs (`tolerances.attention_rounding`)."""
    q, k, v, bias, projection, mask = inputs
    rounding = attention_rounding(q, k, v, bias, projection, expected[0], mask, causal, algorithm, other=other,
                                  **{name: terms[name] for name in names})
    rounding.assert_values(got[0], expected[0])
    rounding.assert_gradients(got[1:], expected[1:])


TERM_SETS = {"none": (), "logit_scale": ("logit_scale",),
             "pair": ("logit_scale", "segment_ids", "segment_bias", "token_ids", "match_weight"),
             "first_key_bias": ("first_key_bias",)}


@pytest.mark.parametrize("batch, heads", [(1, 5), (3, 2), (6, 3)])
def test_items_cover_every_sequence_and_head_once(batch, heads):
    for count in (2, 4, 6, 9):
        cover = torch.zeros(batch, heads, dtype=torch.long)
        items = nprf_cpu_split.items_of(batch, heads, count)
        for rows, cut in items:
            cover[rows, cut] += 1
        assert bool((cover == 1).all()), (count, items)
        assert len(items) >= min(count, batch * heads)


@pytest.mark.parametrize("algorithm", ["dense", "fft", "banded", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_split_call_equals_the_reference_and_the_whole_call(split_everything, algorithm, causal):
    """Every term set, per-head and shared projections, batches split by sequences and by heads: values and the
    gradients of q, k, v, the bias, the projection and the terms' parameters."""
    for (batch, heads), terms_name, per_head in itertools.product([(1, 5), (7, 2)], TERM_SETS, [True, False]):
        names = TERM_SETS[terms_name]
        if causal and terms_name in ("pair", "first_key_bias"):
            continue  # encoder terms
        inputs, terms = case(batch, heads, per_head_projection=per_head, seed=batch + heads)
        del split_everything[:]
        split = values_and_gradients(inputs, terms, names, causal, algorithm)
        assert split_everything and split_everything[0] >= 2, "the call was not split"
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(nprf_cpu_split, "SPLIT_MIN_ELEMENTS", 1 << 62)
            whole = values_and_gradients(inputs, terms, names, causal, algorithm)
        expected = reference_values_and_gradients(inputs, terms, names, causal)
        assert_close_to(split, expected, inputs, terms, names, causal, algorithm)
        assert_close_to(split, whole, inputs, terms, names, causal, algorithm, other=algorithm)

def test_gradients_equal_the_reference_through_each_execution_mode(split_everything):
    """banded, fft and dense under activation checkpointing (recompute=True with the pair terms, whose trained
    segment bias reads the product's value), split: gradients against the float64 reference's, with padding."""
    names = TERM_SETS["pair"]
    inputs, terms = case(2, 3, seed=3)
    expected = reference_values_and_gradients(inputs, terms, names, False)
    for algorithm in ("banded", "fft", "dense"):
        del split_everything[:]
        got = values_and_gradients(inputs, terms, names, False, algorithm, recompute=True)
        assert split_everything, "the call was not split"
        assert_close_to(got, expected, inputs, terms, names, False, algorithm)

@pytest.mark.parametrize("causal", [False, True])
def test_the_lean_mode_split_keeps_one_output(split_everything, causal):
    """The lean banded mode (recompute=True: the features rebuilt in backward, the output kept), split under autograd:
    values and gradients equal the reference's and the whole call's, with padding and a logit scale; the items'
    Functions keep no output of their own (each reads its part of the call's output, which the call keeps once)."""
    names = ("logit_scale",)
    inputs, terms = case(3, 4, seed=4 + causal)
    trims = []
    with pytest.MonkeyPatch.context() as patch:  # the threads' freed heap memory handed back after forward, backward
        patch.setattr(nprf_cpu_threads, "_MALLOC_TRIM", lambda pad: trims.append(pad))
        out = attend(inputs, terms, names, causal, "banded", recompute=True)
        assert split_everything and trims == [0], "the call was not split, or not trimmed after its items"
        node = out.grad_fn
        assert type(node).__name__ == "_ItemsAttentionBackward"
        (kept,) = node.saved_tensors
        assert kept.data_ptr() == out.data_ptr(), "the call does not keep its output"
        item_nodes = [graph[2] for graph in node.graphs]
        assert all(type(n).__name__ == "_KeptOutputAttentionBackward" for n in item_nodes), "the items are not lean"
        assert all(n.saved_tensors[5] is None for n in item_nodes), "an item keeps its own output"
        got = _with_gradients(out, inputs, terms, names)
        assert trims == [0, 0], "not trimmed after backward's items"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nprf_cpu_split, "SPLIT_MIN_ELEMENTS", 1 << 62)
        whole = values_and_gradients(inputs, terms, names, causal, "banded", recompute=True)
    assert_close_to(got, reference_values_and_gradients(inputs, terms, names, causal), inputs, terms, names, causal,
                    "banded")
    assert_close_to(got, whole, inputs, terms, names, causal, "banded", other="banded")


def test_a_split_output_laid_out_as_the_models_query_can_be_changed_in_place(split_everything):
    """Queries as the models pass them ([B, H, n, d] views of [B, n, H, d]): the split call's output has the same
    layout (their transpose back is free) and, like any tensor, can be scaled in place; gradients follow."""
    inputs, terms = case(2, 3, seed=6)
    q, k, v, bias, projection, mask = inputs
    laid_out = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    out = Fn.nprf_attention(*laid_out, bias, projection, key_padding_mask=mask, algorithm="banded", band_width=BAND)
    assert split_everything, "the call was not split"
    assert out.transpose(1, 2).is_contiguous()
    out.mul_(2.0)
    got = torch.autograd.grad(out.sum(), laid_out)
    ref = naive_attention(q, k, v, bias, projection, mask)
    want = torch.autograd.grad(2 * ref.sum(), (q, k, v))
    attention_rounding(q, k, v, bias, projection, ref, mask, False, "banded").assert_gradients(got, want, "qkv")


def test_a_split_call_is_the_same_on_every_run(split_everything):
    inputs, terms = case(1, 6, n=64, seed=5)
    first = values_and_gradients(inputs, terms, ("logit_scale",), False, "banded")
    for _ in range(3):
        again = values_and_gradients(inputs, terms, ("logit_scale",), False, "banded")
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_inference_is_split_and_equal(split_everything):
    inputs, terms = case(3, 4, seed=2)
    expected = attend(inputs, terms, (), False, "auto").detach()
    for mode in (torch.no_grad, torch.inference_mode):
        del split_everything[:]
        with mode():
            got = attend(inputs, terms, (), False, "auto")
        assert split_everything, "the call was not split"
        q, k, v, bias, projection, mask = inputs
        attention_rounding(q, k, v, bias, projection, expected, mask, False, "auto", other="auto").assert_values(
            got, expected)


def test_what_is_not_split(monkeypatch, split_everything):
    """Short sequences (with or without autograd), calls under saved-tensor hooks (activation checkpointing) and calls
    below the size run whole, and equal; the same calls split once the limits allow or without autograd; one thread
    splits nothing."""
    inputs, terms = case(2, 3, n=37)
    q, k, v, bias, projection, mask = inputs

    def checkpointed():
        out = checkpoint(lambda *t: Fn.nprf_attention(*t, key_padding_mask=mask, band_width=BAND), q, k, v, bias,
                         projection, use_reentrant=False)
        out.sum().backward()
        return out

    expected = attend(inputs, terms, (), False, "auto")
    assert split_everything, "the call was not split"
    del split_everything[:]
    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_LENGTH", 38)
    torch.testing.assert_close(attend(inputs, terms, (), False, "auto"), expected)
    with torch.no_grad():
        attend(inputs, terms, (), False, "auto")
    assert split_everything == [], "short sequences split"
    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_LENGTH", 37)
    torch.testing.assert_close(checkpointed(), expected)
    assert split_everything == [], "split under checkpointing's saved-tensor hooks"
    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_ELEMENTS", 2 * 3 * 37 * (6 + 8) + 1)
    with torch.no_grad():
        attend(inputs, terms, (), False, "auto")
    assert split_everything == [], "a call below the size split"
    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_ELEMENTS", 2 * 3 * 37 * (6 + 8))
    with torch.no_grad():
        attend(inputs, terms, (), False, "auto")
    assert split_everything, "the limits are not what they say"
    del split_everything[:]
    torch.set_num_threads(1)
    with torch.no_grad():
        attend(inputs, terms, (), False, "auto")
    assert split_everything == []


def test_a_second_backward_is_a_clear_error(split_everything):
    inputs, terms = case(2, 3)
    out = attend(inputs, terms, (), False, "banded")
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already back-propagated"):
        out.sum().backward()


def test_a_model_splits_its_attention_and_trains_the_same(split_everything):
    """A tiny NPRF BERT with the pair terms (segment bias, word matching, logit scale), padded: logits and every
    parameter's gradient are those of the same model with nothing split, and every layer's call was split."""
    from conftest import tiny_nprf_config

    from nprf_hf import NPRFBertConfig, NPRFBertForMaskedLM

    config = NPRFBertConfig(**tiny_nprf_config(num_hidden_layers=2, logit_scale_max=4.0, segment_bias=True,
                                               token_match=True))
    torch.manual_seed(0)
    model = NPRFBertForMaskedLM(config).double()
    ids = torch.randint(3, 99, (3, 40))
    types = (torch.arange(40) >= 17).long().repeat(3, 1)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 29:] = 0

    def logits_and_gradients():
        model.zero_grad()
        logits = model(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
        logits.square().mean().backward()
        return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    split = logits_and_gradients()
    # a split per layer forward and another backward
    assert len(split_everything) == 2 * config.num_hidden_layers and min(split_everything) >= 2
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nprf_cpu_split, "SPLIT_MIN_ELEMENTS", 1 << 62)
        whole = logits_and_gradients()
    assert len(split) == len(whole) > 10
    # the same (direct) attention per sequence and head instead of per call: rounding only (`model_rounding`), of
    # the logits' size and of the gradients' (backward rounds relative to the upstream gradients, which the largest
    # parameter gradient measures: the logit scale's own gradient is ~1e-7 of it, its terms cancel)
    assert_within(split[0], whole[0], model_rounding(model, 40, 3) * whole[0].abs().max(), "logits")
    scale = max(b.abs().max() for b in whole[1:])
    for index, (a, b) in enumerate(zip(split[1:], whole[1:])):
        assert_within(a, b, model_rounding(model, 40, 3, gradient=True) * scale, f"gradient {index}")
