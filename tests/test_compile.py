"""torch.compile of NPRF models (issue 15): compiled forward and backward equal eager for every attention
algorithm, with padding, without graph breaks (fullgraph=True). Tiny models on CPU; most cases trace with
the "aot_eager" backend (dynamo + AOTAutograd, what decides graph breaks and the backward graph) and one
case goes through inductor (a ~40 s compile on 2 cores); the other inductor cases need NPRF_RUN_SLOW=1."""

import copy
import importlib.util
import json
import os

import pytest
import torch

from nprf_hf import (
    NPRFBertConfig,
    NPRFBertForSequenceClassification,
    NPRFBertModel,
    NPRFRobertaConfig,
    NPRFRobertaForCausalLM,
    functional,
)
from nprf_hf import nprf_banded, nprf_terms
from nprf_hf.cache_nprf import NPRFCache
from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES

from conftest import tiny_nprf_config


# 8 buckets / max distance 16: a band of W = 6, so at 80 tokens the banded algorithm really bands
# (5 chunks of 16 > the 3-chunk window) and `auto` picks it (test_auto_picks_banded_at_the_test_length).
TINY = tiny_nprf_config(num_attention_heads=4, max_position_embeddings=512)
LENGTH = 80
ATOL, RTOL = 1e-5, 1e-4
slow = pytest.mark.skipif(
    not os.environ.get("NPRF_RUN_SLOW"), reason="an inductor compile takes ~45-80 s on 2 CPU cores; set NPRF_RUN_SLOW=1"
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(cls, seed=0, **overrides):
    """A model whose RPE table is not zero (so that the Toeplitz products matter), dropout off."""
    torch.manual_seed(seed)
    model = cls(NPRFBertConfig(**{**TINY, **overrides}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("rpe_table", "cross_segment_bias", "token_match_weight")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def inputs(batch=2, length=LENGTH, labels=False, seed=0):
    """Row 1 padded from 3/5 of the length; two segments; few distinct tokens (so that tokens repeat)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 12, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, 3 * length // 5 :] = 0
    token_type_ids = (torch.arange(length) >= length // 3).long().expand(batch, length).contiguous()
    result = dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    if labels:
        result["labels"] = torch.arange(batch) % 2
    return result


def training_step(model, batch, call=None):
    """(logits, loss, {name: grad}) of one forward + backward of `call` (default: the model), which runs `model`."""
    model.zero_grad(set_to_none=True)
    output = (model if call is None else call)(**batch)
    output.loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return output.logits.detach(), output.loss.detach(), grads


def assert_training_matches(model, compiled, batch):
    logits, loss, grads = training_step(model, batch)
    compiled_logits, compiled_loss, compiled_grads = training_step(compiled._orig_mod, batch, compiled)
    torch.testing.assert_close(compiled_logits, logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(compiled_loss, loss, atol=ATOL, rtol=RTOL)
    assert compiled_grads.keys() == grads.keys() and any(name.endswith("rpe_table") for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(
            compiled_grads[name], grad, atol=ATOL, rtol=RTOL, msg=lambda message, name=name: f"gradient of {name}: {message}"
        )


def assert_inference_matches(model, compiled, batch):
    with torch.inference_mode():
        expected = model(**batch).last_hidden_state
        actual = compiled(**batch).last_hidden_state
    keep = batch["attention_mask"].bool()  # padded rows are never read
    torch.testing.assert_close(actual[keep], expected[keep], atol=ATOL, rtol=RTOL)


def test_auto_picks_banded_at_the_test_length(monkeypatch):
    attention = build(NPRFBertModel).encoder.layer[0].attention.self
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # eager training keeps dense longer
    bias = torch.zeros(TINY["num_attention_heads"], 2 * LENGTH - 1)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    features = TINY["num_random_features"]
    # in training (without autograd auto keeps dense longer: the inference tests' "auto" runs dense)
    picked = functional._resolve_algorithm("auto", bias, LENGTH, attention.band_width, features, head_dim + 1)[0]
    assert picked == "banded"
    assert -(-LENGTH // nprf_banded.banded_chunking(attention.band_width)[1]) > 3  # more chunks than one window


@pytest.mark.parametrize("algorithm", functional.ALGORITHMS)
def test_compiled_training_matches_eager(algorithm):
    """Classification head in train mode, fullgraph: logits, loss and every parameter's gradient."""
    model = build(NPRFBertForSequenceClassification, attention_algorithm=algorithm).train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_training_matches(model, compiled, inputs(labels=True))


@pytest.mark.parametrize("algorithm", functional.ALGORITHMS)
def test_compiled_inference_matches_eager(algorithm):
    """Base model under inference_mode (fft and banded take other code paths there), fullgraph."""
    model = build(NPRFBertModel, attention_algorithm=algorithm).eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_inference_matches(model, compiled, inputs())


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_dense_has_no_graph_break(training):
    model = build(NPRFBertForSequenceClassification, attention_algorithm="dense").train(training)
    with torch.set_grad_enabled(training):
        explanation = torch._dynamo.explain(model)(**inputs(labels=True))
    assert explanation.graph_break_count == 0, [reason.reason for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_compiled_segments_and_word_matching_match_eager():
    """segment_bias + token_match on the banded path: segments from a static bound (`num_segments`), token
    groups from sorts, where eager reads them on the host (torch.unique)."""
    pair = dict(segment_bias=True, token_match=True, num_hidden_layers=1)
    model = build(NPRFBertForSequenceClassification, attention_algorithm="banded", **pair)
    compiled = torch.compile(model.train(), backend="aot_eager", fullgraph=True)
    assert_training_matches(model, compiled, inputs(labels=True))
    one_segment = {**inputs(labels=True), "token_type_ids": torch.zeros(2, LENGTH, dtype=torch.long)}  # segment 1 absent
    assert_training_matches(model, compiled, one_segment)


def test_group_ids_compiled_equal_unique():
    generator = torch.Generator().manual_seed(0)
    keys = torch.stack([torch.arange(3).repeat_interleave(20), torch.randint(0, 2, (60,), generator=generator),
                        torch.randint(0, 5, (60,), generator=generator)])
    expected, count = nprf_terms.group_ids(keys)
    inverse, bound = torch.compile(nprf_terms.group_ids, backend="eager", fullgraph=True)(keys)
    assert bound == keys.shape[1] and count == int(expected.max()) + 1
    assert torch.equal(inverse, expected)


def test_feature_redraw_under_compile():
    """Redrawing reads the step counter on the host: it runs eagerly (one graph break) and draws what eager draws."""
    model = build(
        NPRFBertForSequenceClassification, attention_algorithm="banded", feature_redraw_interval=1, num_hidden_layers=1
    ).train()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager")
    batch = inputs(labels=True)
    for _ in range(2):
        assert_training_matches(model, compiled, batch)
    projection = model.bert.encoder.layer[0].attention.self.projection
    assert torch.equal(twin.bert.encoder.layer[0].attention.self.projection, projection)
    assert not torch.equal(projection, model.bert.encoder.layer[0].attention.self.draw_projection(0))


def test_compiled_decoder_prefill_fills_the_nprf_cache():
    """A decoder's compiled forward (an NPRFCache by default) equals eager, and decoding goes on from its cache."""
    config = NPRFRobertaConfig(**TINY, is_decoder=True, pad_token_id=1, position_embedding_type="none")
    torch.manual_seed(0)
    model = NPRFRobertaForCausalLM(config).eval()
    batch = inputs()
    batch.pop("token_type_ids")
    batch["attention_mask"] = batch["attention_mask"].flip(-1)  # left padding
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        expected, actual = model(**batch), compiled(**batch)
        assert isinstance(actual.past_key_values, NPRFCache)
        keep = batch["attention_mask"].bool()
        torch.testing.assert_close(actual.logits[keep], expected.logits[keep], atol=ATOL, rtol=RTOL)
        mask = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
        step = dict(input_ids=torch.tensor([[5], [7]]), attention_mask=mask)
        torch.testing.assert_close(
            model(**step, past_key_values=actual.past_key_values).logits,
            model(**step, past_key_values=expected.past_key_values).logits,
            atol=ATOL,
            rtol=RTOL,
        )


def test_compile_flags_and_generate_keeps_the_nprf_cache():
    """`_can_compile_fullgraph` is declared on every class; generate() still decodes through NPRFCache (transformers
    compiles generate's forward only with a compileable cache, which NPRFCache is not)."""
    for classes in NPRF_MODEL_CLASSES.values():
        for cls in classes.values():
            assert cls._can_compile_fullgraph is True and cls._supports_attention_backend is False
    config = NPRFRobertaConfig(**TINY, is_decoder=True, pad_token_id=1, position_embedding_type="none")
    assert NPRFCache(config).is_compileable is False
    model = NPRFRobertaForCausalLM(config).eval()
    output = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(output.past_key_values, NPRFCache) and output.sequences.shape == (1, 6)


def test_inductor_default_config_training_matches_eager(two_threads):
    """The default algorithm (auto: banded here) through inductor, fullgraph, forward + backward (one layer: the
    compile time grows with the graph)."""
    model = build(NPRFBertForSequenceClassification, num_hidden_layers=1).train()
    compiled = torch.compile(model, fullgraph=True)
    assert_training_matches(model, compiled, inputs(labels=True))


@slow
@pytest.mark.parametrize("algorithm", functional.ALGORITHMS)
def test_inductor_training_and_inference_match_eager(algorithm, two_threads):
    model = build(NPRFBertForSequenceClassification, attention_algorithm=algorithm, segment_bias=True, token_match=True)
    assert_training_matches(model.train(), torch.compile(model, fullgraph=True), inputs(labels=True))
    torch._dynamo.reset()
    model = build(NPRFBertModel, attention_algorithm=algorithm).eval()
    assert_inference_matches(model, torch.compile(model, fullgraph=True), inputs())


def test_compile_benchmark_reports_eager_compiled_and_fullgraph(tmp_path, capsys):
    """benchmarks/compile.py end to end at a minimal point, tracing with aot_eager (no inductor compile)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "compile.py")
    spec = importlib.util.spec_from_file_location("benchmark_compile", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    output = tmp_path / "compile.json"
    result = benchmark.main(["--size", "minilm", "--points", "2x16", "--repeats", "1", "--threads", "1",
                             "--backend", "aot_eager", "--output", str(output)])
    (row,) = result["rows"]
    assert row["runs"] == "dense" and row["max_abs_difference"] < 1e-5 and row["fullgraph_max_abs_difference"] < 1e-5
    assert row["compiled_s"] > 0 and row["compile_s"] > 0 and row["fullgraph_compile_s"] > 0
    assert json.loads(output.read_text())["rows"] == result["rows"]
    assert "compile s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark.main(["--points", "2x16:softmax"])


def test_dynamic_padding_compiles_a_bounded_number_of_graphs():
    """A Trainer with dynamic padding under `torch.compile` (dynamic=None): after a new length and a new batch size
    dynamo makes both dimensions symbolic, so later batches of other shapes reuse the graph. Nothing of the model may
    specialize on the batch size or length (formatting a size into an error message did, once: a graph per batch
    size, until dynamo's recompile limit sent training back to eager)."""
    from torch._dynamo.utils import counters

    model = build(NPRFBertForSequenceClassification)
    compiled = torch.compile(model, backend="aot_eager", dynamic=None)
    counters.clear()
    for batch, length in ((2, 80), (2, 96), (3, 88), (4, 72), (5, 100)):
        logits, loss, grads = training_step(model, inputs(batch, length, labels=True))
        compiled_logits, compiled_loss, _ = training_step(model, inputs(batch, length, labels=True), compiled)
        torch.testing.assert_close(compiled_logits, logits, atol=ATOL, rtol=RTOL)
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("variant", ["nprf", "nprf_near"])
def test_compiled_window_product_runs_on_the_edges_threads(variant):
    """Compiled, the banded window product is an opaque op, which cannot take a scheduler: the edge's scheduler
    brings ops of its own that run the sequences on its threads (the math's ran them serially, 1.3-3.7x slower at
    4 x 2,048), `Routing(cpu_threads=False)` gets the math's; both equal eager, values and gradients."""
    from nprf_hf import nprf_banded_window, nprf_cpu_threads
    from nprf_hf.nprf_dispatch import Routing

    generator = torch.Generator().manual_seed(0)
    # 200 tokens: more chunks than the near field's window (fewer run the dense product)
    q, k, v = (torch.randn(3, 2, 200, 8, generator=generator, requires_grad=True) for _ in range(3))
    bias = functional.relative_position_bias(torch.randn(2, 8, generator=generator), 200, num_buckets=8, max_distance=16)
    projection = torch.randn(2, 8, 8, generator=generator)
    width = functional.rpe_band_width(8, 16)
    libraries = {None: nprf_cpu_threads._POOLED_WINDOW_OPS.library, False: nprf_banded_window._LIBRARY}
    for threads, library in libraries.items():
        routing = None if threads is None else Routing(cpu_threads=False)

        def attention(q, k, v):
            return functional.nprf_attention(q, k, v, bias, projection, algorithm="banded", band_width=width,
                                             variant=variant, routing=routing)

        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm.code)
            return gm.forward

        expected = attention(q, k, v)
        expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
        torch._dynamo.reset()
        got = torch.compile(attention, backend=backend, fullgraph=True)(q, k, v)
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        assert any(f"{library}.band_window_product" in code for code in graphs), library
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
        for grad, want in zip(grads, expected_grads):
            torch.testing.assert_close(grad, want, atol=ATOL, rtol=RTOL)
