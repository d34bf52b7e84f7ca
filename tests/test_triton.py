"""The Triton kernels (`algorithm="triton"`), run on the CPU by Triton's interpreter: values and the gradients of
q, k, v, the bias table and the logit scale against the float64 reference, bidirectional and causal, with key
padding, lengths that are not a multiple of the block, per-head and shared projections; the fallbacks; and a
model whose attention runs the kernels."""

import importlib
import logging
import os

import pytest
import torch

# The interpreter is chosen when Triton is imported and the kernels are decorated: set it before either.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
from nprf_hf import nprf_triton_kernels  # noqa: E402

if type(nprf_triton_kernels.nprf_forward_kernel).__name__ != "InterpretedFunction":  # imported before, compiled
    importlib.reload(nprf_triton_kernels)

from conftest import tiny_nprf_config  # noqa: E402

from nprf_hf import functional as Fn  # noqa: E402
from nprf_hf import nprf_triton  # noqa: E402
from nprf_hf.nprf_naive import naive_attention  # noqa: E402


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tied_table_bias(table, n, width):
    """[H, 2n - 1] bias gathered from a table [H, 2 width + 1]: b_r = table[clamp(r)], constant for |r| >= width."""
    r = torch.arange(-(n - 1), n).clamp(-width, width) + width
    return table[:, r]


def inputs(batch, heads, n, d, m, width, generator, per_head=False, pad=True):
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k, v = (randn(batch, heads, n, d).requires_grad_(True) for _ in range(3))
    table = randn(heads, 2 * width + 1).requires_grad_(True)
    projection = Fn.draw_projection(m, d, num_heads=heads if per_head else None, generator=generator)
    mask = None
    if pad:
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[-1, n - n // 3:] = False  # right padding, as a padded GLUE batch
        if batch > 1:
            mask[0, :2] = False  # left padding: the first causal queries have no key
    return q, k, v, table, projection, mask


CASES = [  # (n, d, m, width, block, per_head): lengths off the block, a band narrower and wider than one block
    (45, 16, 16, 6, 16, False),
    (37, 24, 20, 20, 16, True),
    (16, 16, 32, 3, 16, False),
    (70, 16, 16, 91, 32, True),  # T5's default band (91) wider than the sequence: every pair in the band
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_the_float64_reference(case, causal):
    n, d, m, width, block, per_head = case
    generator = torch.Generator().manual_seed(n * 7 + d + int(causal))
    q, k, v, table, projection, mask = inputs(2, 2, n, d, m, width, generator, per_head)
    scale = (torch.rand(2, generator=generator) * 2 + 0.5).requires_grad_(True)
    out = nprf_triton.triton_attention(q, k, v, tied_table_bias(table, n, width), projection, mask, scale,
                                       width + 1, causal, block=block)
    ref = naive_attention(q, k, v, tied_table_bias(table, n, width), projection, mask, causal, logit_scale=scale)
    assert relative_error(out, ref) < 1e-5
    grad_out = torch.randn(out.shape, generator=generator)
    got = torch.autograd.grad(out, (q, k, v, table, scale), grad_out)
    want = torch.autograd.grad(ref, (q, k, v, table, scale), grad_out.double())
    for name, a, b in zip(("q", "k", "v", "table", "logit_scale"), got, want):
        assert relative_error(a, b) < 1e-4, name
    if mask is not None:  # padded keys get no gradient at all
        assert got[1][~mask[:, None, :, None].expand_as(got[1])].abs().max() == 0
        assert got[2][~mask[:, None, :, None].expand_as(got[2])].abs().max() == 0


@pytest.mark.parametrize("causal", [False, True])
def test_the_public_function_runs_the_kernels(causal, monkeypatch):
    """nprf_attention(algorithm="triton") is the kernels (not a fallback), equal to "banded"; rows without keys are
    zeros; the band width is inferred when not given."""
    generator = torch.Generator().manual_seed(3)
    n, width = 40, 7
    q, k, v, table, projection, mask = inputs(3, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    calls = []
    original = nprf_triton._TritonProduct.apply
    monkeypatch.setattr(nprf_triton._TritonProduct, "apply", lambda *a: calls.append(1) or original(*a))
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton", causal=causal)
    banded = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="banded", causal=causal, band_width=width + 1)
    assert calls, "algorithm='triton' did not run the kernels"
    assert relative_error(out, banded) < 1e-5
    if causal:  # sequence 0 is padded at its first two keys: its first two queries see nothing
        assert out[0, :, :2].abs().max() == 0


def test_half_precision_inputs():
    """bf16 q, k, v: bf16 operands with fp32 accumulation, within bf16's rounding of the float64 reference."""
    generator = torch.Generator().manual_seed(5)
    n, width = 48, 8
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    q, k, v = (t.detach().bfloat16().requires_grad_(True) for t in (q, k, v))
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton", band_width=width + 1)
    assert out.dtype == torch.bfloat16
    ref = naive_attention(q, k, v, bias, projection, mask)
    assert relative_error(out, ref) < 2e-2
    grad_q = torch.autograd.grad(out.float().square().sum(), q)[0]
    want = torch.autograd.grad(ref.square().sum(), q)[0]
    assert relative_error(grad_q, want) < 5e-2


def test_unfused_terms_fall_back_with_one_log_line(caplog):
    """A segment bias is not fused: algorithm="triton" gives the PyTorch result and says so once."""
    generator = torch.Generator().manual_seed(11)
    n, width = 24, 5
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    segments = (torch.arange(n) >= n // 2).long().expand(2, n)
    beta = torch.tensor([0.5, -1.0])
    nprf_triton._told.clear()
    with caplog.at_level(logging.WARNING, logger="nprf_hf.nprf_triton"):
        for _ in range(2):
            out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton", segment_ids=segments,
                                    segment_bias=beta)
    said = [r.getMessage() for r in caplog.records if "Triton kernels do not run" in r.getMessage()]
    assert len(said) == 1 and "segment_bias" in said[0]
    ref = naive_attention(q, k, v, bias, projection, mask, segment_ids=segments, segment_bias=beta)
    assert relative_error(out, ref) < 1e-5


def test_triton_on_the_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    generator = torch.Generator().manual_seed(1)
    q, k, v, table, projection, mask = inputs(1, 2, 8, 16, 16, 2, generator, pad=False)
    with pytest.raises(ValueError, match="algorithm='triton' cannot run: the inputs are on cpu"):
        Fn.nprf_attention(q, k, v, tied_table_bias(table, 8, 2), projection, algorithm="triton")
    # "auto" on the CPU never asks for the kernels
    Fn.nprf_attention(q, k, v, tied_table_bias(table, 8, 2), projection, algorithm="auto")


@pytest.mark.parametrize("decoder", [False, True])
def test_a_model_trains_through_the_kernels(decoder):
    """A tiny RoBERTa (encoder, and decoder) with attention_algorithm="triton": logits and every parameter's
    gradient (the shared RPE table's included) equal those of "banded"."""
    from nprf_hf import NPRFRobertaConfig, NPRFRobertaForCausalLM, NPRFRobertaForMaskedLM

    cls = NPRFRobertaForCausalLM if decoder else NPRFRobertaForMaskedLM
    config = NPRFRobertaConfig(**tiny_nprf_config(num_hidden_layers=1), is_decoder=decoder)
    torch.manual_seed(0)
    model = cls(config)
    ids = torch.randint(3, 99, (2, 40))
    attention_mask = torch.ones(2, 40, dtype=torch.long)
    attention_mask[1, 31:] = 0
    results = {}
    for algorithm in ("banded", "triton"):
        model.config.attention_algorithm = algorithm  # the layers read the shared config at every call
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=attention_mask).logits
        logits.square().mean().backward()
        results[algorithm] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert relative_error(results["triton"][0], results["banded"][0]) < 1e-5
    assert results["triton"][1].keys() == results["banded"][1].keys()
    for name, grad in results["banded"][1].items():
        assert relative_error(results["triton"][1][name], grad) < 1e-4, name


def test_remote_code_imports_only_torch_transformers_and_the_standard_library():
    """transformers checks every remote-code file's imports statically when a model loads from the Hub (imports
    inside `try` are not listed): an unguarded `import triton` would break Hub loading wherever Triton is missing."""
    import sys

    from transformers.dynamic_module_utils import get_imports

    from nprf_hf.checkpoint_files import remote_code_files

    folder = os.path.dirname(nprf_triton.__file__)
    files = remote_code_files()
    assert "nprf_triton.py" in files and "nprf_triton_kernels.py" in files  # the check covers the kernels
    for name in files:
        found = set(get_imports(os.path.join(folder, name)))
        assert found <= {"torch", "transformers"} | set(sys.stdlib_module_names), (name, found)


def test_auto_falls_back_once_when_the_kernels_fail_on_the_device(monkeypatch, caplog):
    """"auto" picks the kernels on a CUDA device; should they fail to build there, the call (and every later one)
    runs the PyTorch algorithms with one log line; an explicit "triton" raises the error instead."""
    from nprf_hf import nprf_dispatch

    monkeypatch.setattr(nprf_dispatch, "KERNEL_OF_DEVICE", {"cpu": "triton"})  # the CPU plays the CUDA device
    monkeypatch.setattr(nprf_triton, "_disabled", [])
    monkeypatch.setattr(nprf_triton, "_told", set())
    attempts = []

    def broken(*args):
        attempts.append(1)
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(nprf_triton._TritonProduct, "apply", broken)
    generator = torch.Generator().manual_seed(2)
    n, width = 30, 4
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    with pytest.raises(RuntimeError, match="PTX"):
        Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton")
    with caplog.at_level(logging.WARNING, logger="nprf_hf.nprf_triton"):
        outs = [Fn.nprf_attention(q, k, v, bias, projection, mask) for _ in range(2)]
    assert len(attempts) == 2  # the explicit call, then auto's first; not auto's second
    said = [r.getMessage() for r in caplog.records if "PTX assembly failed" in r.getMessage()]
    assert len(said) == 1
    ref = naive_attention(q, k, v, bias, projection, mask)
    assert all(relative_error(out, ref) < 1e-5 for out in outs)
