"""The Triton kernels (`algorithm="triton"`), run on the CPU by Triton's interpreter: values and the gradients of
q, k, v, the bias table and the logit scale against the float64 reference, bidirectional and causal, with key
padding, lengths that are not a multiple of the block, per-head and shared projections; the fallbacks; and a
model whose attention runs the kernels."""

import importlib
import logging
import os

import pytest
import torch

# The interpreter is chosen when Triton is imported (conftest sets TRITON_INTERPRET=1 before anything imports it).
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the kernels through Triton's interpreter: TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
from nprf_hf import nprf_triton_backward, nprf_triton_decode, nprf_triton_kernels  # noqa: E402
from nprf_hf import nprf_triton_short_kernels  # noqa: E402

if type(nprf_triton_kernels.nprf_forward_kernel).__name__ != "InterpretedFunction":  # imported before, compiled
    importlib.reload(nprf_triton_kernels)
    importlib.reload(nprf_triton_decode)
    importlib.reload(nprf_triton_backward)
    importlib.reload(nprf_triton_short_kernels)  # (after the modules whose helpers it calls)

from conftest import tiny_nprf_config  # noqa: E402

from nprf_hf import functional as Fn  # noqa: E402
from nprf_hf import nprf_triton, nprf_triton_short  # noqa: E402
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


PATHS = ("short", "banded")


def on_path(path, monkeypatch):
    """Makes the kernels' entry (`nprf_triton_short.triton_attention`, what `nprf_attention` calls) take `path` at any
    length: the short path's kernels, or the banded ones with their block states."""
    monkeypatch.setattr(nprf_triton_short, "SHORT_LENGTH", 1 << 30 if path == "short" else 0)


def assert_matches_reference(q, k, v, table, projection, mask, width, causal, block, generator, attention=None):
    """The kernels' output and the gradients of q, k, v, the bucket table and a drawn logit scale against the float64
    reference; returns the kernels' gradients. `attention`: the banded kernels' launcher unless given."""
    n = q.shape[2]
    scale = (torch.rand(2, generator=generator) * 2 + 0.5).requires_grad_(True)
    attention = nprf_triton.triton_attention if attention is None else attention
    out = attention(q, k, v, tied_table_bias(table, n, width), projection, mask, scale, width + 1, causal, block=block)
    ref = naive_attention(q, k, v, tied_table_bias(table, n, width), projection, mask, causal, logit_scale=scale)
    assert relative_error(out, ref) < 1e-5
    grad_out = torch.randn(out.shape, generator=generator)
    got = torch.autograd.grad(out, (q, k, v, table, scale), grad_out)
    want = torch.autograd.grad(ref, (q, k, v, table, scale), grad_out.double())
    for name, a, b in zip(("q", "k", "v", "table", "logit_scale"), got, want):
        assert relative_error(a, b) < 1e-4, name
    return got


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_the_float64_reference(case, causal, path, monkeypatch):
    """Both paths (the short one's tiles beyond the band take their side's constant: the band of CASES[0] and
    CASES[2] is narrower than the sequence by more than a block)."""
    on_path(path, monkeypatch)
    n, d, m, width, block, per_head = case
    generator = torch.Generator().manual_seed(n * 7 + d + int(causal))
    q, k, v, table, projection, mask = inputs(2, 2, n, d, m, width, generator, per_head)
    got = assert_matches_reference(q, k, v, table, projection, mask, width, causal, block, generator,
                                   nprf_triton_short.triton_attention)
    if mask is not None:  # padded keys get no gradient at all
        assert got[1][~mask[:, None, :, None].expand_as(got[1])].abs().max() == 0
        assert got[2][~mask[:, None, :, None].expand_as(got[2])].abs().max() == 0


class CountedLaunch:
    """A kernel whose launches `kernel[grid](...)` append its name to `launches`, then run."""

    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("causal", [False, True])
def test_the_short_path_runs_up_to_its_crossover(causal, monkeypatch):
    """The kernels' entry runs the short path's kernels (one forward launch, two backward) up to SHORT_LENGTH tokens
    and the banded ones (two forward, three backward) beyond; nprf_attention, a model's call, goes through it."""
    from nprf_hf import nprf_triton_short_kernels as short_kernels

    monkeypatch.setattr(nprf_triton_short, "SHORT_LENGTH", 40)
    calls, launches = [], []
    for module, name in ((nprf_triton_short, "_short_forward"), (nprf_triton_short, "_short_backward"),
                         (nprf_triton, "_attention_forward"), (nprf_triton, "_attention_backward")):
        count_calls(module, name, calls, monkeypatch)
    for module in (nprf_triton_kernels, nprf_triton_backward, short_kernels):
        for name in [name for name in vars(module) if name.endswith("_kernel")]:
            monkeypatch.setattr(module, name, CountedLaunch(getattr(module, name), name, launches))
    want = {40: ["_short_forward", "_short_backward"], 41: ["_attention_forward", "_attention_backward"]}
    for n, expected in want.items():
        calls.clear(), launches.clear()
        generator = torch.Generator().manual_seed(n)
        q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, 6, generator)
        out = Fn.nprf_attention(q, k, v, tied_table_bias(table, n, 6), projection, mask, algorithm="triton",
                                causal=causal, band_width=7)
        torch.autograd.grad(out, (q, k, v, table), torch.randn(out.shape, generator=generator))
        assert calls == expected, n
        assert len(launches) == (3 if n == 40 else 5) and all(("short" in x) == (n == 40) for x in launches), launches
        ref = naive_attention(q, k, v, tied_table_bias(table, n, 6), projection, mask, causal)
        assert relative_error(out, ref) < 1e-5


def test_the_short_path_only_on_devices_it_compiles_well_for(monkeypatch):
    """Before sm_90 the short key-gradient kernel spills (ptxas, about 26 KB a thread at sm_80): those devices keep
    the banded kernels at every length; sm_90 and later, and the interpreter's CPU tensors, take the short path."""
    capability = [(8, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert not nprf_triton_short.takes_short_path(128, torch.device("cuda"))
    capability[0] = (9, 0)
    assert nprf_triton_short.takes_short_path(128, torch.device("cuda"))
    assert not nprf_triton_short.takes_short_path(nprf_triton_short.SHORT_LENGTH + 1, torch.device("cuda"))
    assert nprf_triton_short.takes_short_path(128, torch.device("cpu"))


@pytest.mark.parametrize("splits", [3, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_the_block_states_scan_in_two_levels_matches_the_reference(causal, splits, monkeypatch):
    """The states kernels' scan of the block states, in splits of several blocks (the last one short) whose totals
    `_blocks` adds: 7 blocks of 16 in 3 splits (3, 3, 1) or in one of 7; far blocks each side of a band of 2."""
    monkeypatch.setattr(nprf_triton, "SPLITS", splits)
    n, width = 100, 20
    generator = torch.Generator().manual_seed(5 + int(causal))
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    assert_matches_reference(q, k, v, table, projection, mask, width, causal, 16, generator)


def test_launch_plans_are_built_once_per_shape(monkeypatch):
    """An eager forward + backward builds its launch arguments once per shape (`nprf_triton_plan.launch_plan`) and
    reuses them, forward and backward, call after call; another shape or another scan split gets a plan of its own."""
    from nprf_hf import nprf_triton_plan

    nprf_triton_plan.launch_plan.cache_clear()
    generator = torch.Generator().manual_seed(3)
    for n in (20, 20, 33):
        q, k, v, table, projection, mask = inputs(1, 2, n, 16, 16, 4, generator)
        out = nprf_triton.triton_attention(q, k, v, tied_table_bias(table, n, 4), projection, mask, None, 5, False,
                                           block=16)
        torch.autograd.grad(out.sum(), (q, k, v))
    info = nprf_triton_plan.launch_plan.cache_info()
    assert (info.misses, info.hits) == (2, 4)
    monkeypatch.setattr(nprf_triton, "SPLITS", 1)
    plan = nprf_triton._launch(q, v, projection, 16, 4)
    assert nprf_triton_plan.launch_plan.cache_info().misses == 3 and plan.sizes["grid"] == (1, 2)
    assert plan.args == (2, 33, 16, 16, 16, 3, 3) and plan.grid == (3, 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_a_bias_far_from_zero_is_shifted_in_the_kernels(causal, path, monkeypatch):
    """The kernels take exp(b_r - max b) from the bias itself (no exp on the host): a bias 300 above zero (exp
    overflows fp32) or below (underflows) gives the values and gradients of the bias as it is."""
    on_path(path, monkeypatch)
    n, d, m, width, block = 45, 16, 16, 6, 16
    generator = torch.Generator().manual_seed(5 + int(causal))
    q, k, v, table, projection, mask = inputs(2, 2, n, d, m, width, generator)
    grad_out = torch.randn(2, 2, n, d, generator=generator)
    results = []
    for offset in (0.0, 300.0, -300.0):
        out = nprf_triton_short.triton_attention(q, k, v, tied_table_bias(table, n, width) + offset, projection, mask,
                                                 None, width + 1, causal, block=block)
        results.append((out, *torch.autograd.grad(out, (q, k, table), grad_out)))
    for shifted in results[1:]:
        for a, b in zip(shifted, results[0]):
            assert relative_error(a, b) < 1e-5


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]])
def test_the_bias_gradient_by_diagonals_equals_the_reference(case, causal, path, monkeypatch):
    """DIAGONAL_SUMS (each band tile's bias gradient summed per diagonal, one atomic add per diagonal): the bias
    table's gradient equals the float64 reference and the per-pair atomics', at lengths off the block, a band wider
    than the sequence, and with padding; nothing is written outside a sequence's row (the batch's rows differ)."""
    if not nprf_triton_backward.HAS_GATHER:
        pytest.skip("this Triton has no tl.gather")
    on_path(path, monkeypatch)
    n, d, m, width, block, per_head = case
    generator = torch.Generator().manual_seed(11 * n + int(causal))
    q, k, v, table, projection, mask = inputs(3, 2, n, d, m, width, generator, per_head)
    grad_out = torch.randn(3, 2, n, d, generator=generator)
    grads = {}
    for diagonals in (False, True):
        monkeypatch.setattr(nprf_triton, "DIAGONAL_SUMS", diagonals)
        out = nprf_triton_short.triton_attention(q, k, v, tied_table_bias(table, n, width), projection, mask, None,
                                                 width + 1, causal, block=block)
        grads[diagonals] = torch.autograd.grad(out, table, grad_out)[0]
    ref = naive_attention(q, k, v, tied_table_bias(table, n, width), projection, mask, causal)
    want = torch.autograd.grad(ref, table, grad_out.double())[0]
    assert relative_error(grads[True], want) < 1e-4
    assert relative_error(grads[True], grads[False]) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_a_second_derivative_is_a_clear_error(path, monkeypatch):
    """The kernels compute first derivatives only: differentiating their backward raises (eager and op alike), rather
    than returning gradients without the attention's second-order terms."""
    on_path(path, monkeypatch)
    generator = torch.Generator().manual_seed(8)
    q, k, v, table, projection, mask = inputs(1, 2, 20, 16, 16, 4, generator, pad=False)
    out = nprf_triton_short.triton_attention(q, k, v, tied_table_bias(table, 20, 4), projection, None, None, 5, False,
                                             block=16)
    (grad_q,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        grad_q.sum().backward()


def test_fp32_inputs_take_tf32_products_on_cuda_only_where_torch_allows_them(monkeypatch):
    """The kernels' precision follows torch's: TF32 operands for fp32 inputs on a CUDA device with TF32 matmuls
    allowed, exact fp32 otherwise; bf16 operands for half inputs."""
    class Query:
        dtype, is_cuda = torch.float32, True

    monkeypatch.setattr(nprf_triton, "interpreting", lambda: False)
    for allowed, want in ((False, 0), (True, 3)):
        monkeypatch.setattr(nprf_triton, "_tf32_allowed", lambda: allowed)
        assert nprf_triton._dot_precision(Query()) == want
    Query.is_cuda = False
    assert nprf_triton._dot_precision(Query()) == 0
    Query.dtype = torch.bfloat16
    assert nprf_triton._dot_precision(Query()) == 1
    monkeypatch.undo()
    assert not nprf_triton._tf32_allowed()  # torch's default: "highest"
    torch.set_float32_matmul_precision("high")
    try:
        assert nprf_triton._tf32_allowed()
    finally:
        torch.set_float32_matmul_precision("highest")


def count_calls(module, name, calls, monkeypatch):
    """Appends `name` to `calls` whenever module.`name` (a launcher's implementation) runs."""
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(name) or original(*a))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_the_public_function_runs_the_kernels(causal, path, monkeypatch):
    """nprf_attention(algorithm="triton") is the kernels (not a fallback), equal to "banded"; rows without keys are
    zeros; the band width is inferred when not given."""
    on_path(path, monkeypatch)
    generator = torch.Generator().manual_seed(3)
    n, width = 40, 7
    q, k, v, table, projection, mask = inputs(3, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    calls = []
    # (what an eager call runs: the op's implementation, not its dispatch)
    count_calls(*((nprf_triton_short, "_short_forward") if path == "short" else (nprf_triton, "_attention_forward")),
                calls, monkeypatch)
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton", causal=causal)
    banded = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="banded", causal=causal, band_width=width + 1)
    assert calls, "algorithm='triton' did not run the kernels"
    assert relative_error(out, banded) < 1e-5
    if causal:  # sequence 0 is padded at its first two keys: its first two queries see nothing
        assert out[0, :, :2].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS)
def test_half_precision_inputs(path, dtype, monkeypatch):
    """bf16 (fp16) q, k, v: 16-bit operands with fp32 accumulation, within bf16's rounding of the float64 reference."""
    on_path(path, monkeypatch)
    generator = torch.Generator().manual_seed(5)
    n, width = 48, 8
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton", band_width=width + 1)
    assert out.dtype == dtype
    ref = naive_attention(q, k, v, bias, projection, mask)
    assert relative_error(out, ref) < 2e-2
    grad_q = torch.autograd.grad(out.float().square().sum(), q)[0]
    want = torch.autograd.grad(ref.square().sum(), q)[0]
    assert relative_error(grad_q, want) < 5e-2
    # a bf16 projection (a model cast to bf16), which the kernels read as it is: as its fp32 copy, forward and backward
    results = []
    for p in (projection.bfloat16(), projection.bfloat16().float()):
        out = Fn.nprf_attention(q, k, v, bias, p, mask, algorithm="triton", band_width=width + 1)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_features_are_computed_once_and_kept_for_backward():
    """Forward stores phi_q and phi_k [B, H, n, m] (padded keys zero), which every band tile and backward read instead
    of recomputing them: the PyTorch path's feature map, with the logit scale and a per-head projection; bf16 for
    half inputs (exp features leave fp16's range)."""
    from nprf_hf.nprf_features import normalized_features

    generator = torch.Generator().manual_seed(17)
    n, width = 37, 6
    q, k, v, table, projection, mask = inputs(2, 2, n, 24, 20, width, generator, per_head=True)
    q, k, v = (t.detach() for t in (q, k, v))
    scale = torch.rand(2, generator=generator) + 0.5
    settings = (tied_table_bias(table, n, width).detach(), scale.sqrt(), projection, mask, False, 1, 16, 4)
    *_, phi_q, phi_k = nprf_triton._attention_forward(q, k, v, *settings)
    assert phi_q.shape == phi_k.shape == (2, 2, n, 20) and phi_q.dtype == phi_k.dtype == torch.float32
    assert relative_error(phi_q, normalized_features(q, projection, scale)) < 1e-6
    assert relative_error(phi_k, normalized_features(k, projection, scale) * mask[:, None, :, None]) < 1e-6
    for dtype in (torch.float16, torch.bfloat16):
        *_, phi_q, phi_k = nprf_triton._attention_forward(q.to(dtype), k.to(dtype), v.to(dtype), *settings)
        assert phi_q.dtype == phi_k.dtype == torch.bfloat16
        assert relative_error(phi_k, normalized_features(k.to(dtype), projection, scale) * mask[:, None, :, None]) < 2e-2


def test_strided_grads_and_masks_of_any_dtype_are_read_as_they_are():
    """A transposed grad_out (as a model's) and a key padding mask in bool, int8 or float 0/1 (the kernels read the
    first two as they are and convert the third) give the gradients of a contiguous grad_out and an int64 mask."""
    generator = torch.Generator().manual_seed(13)
    n, width = 20, 4
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    grad_out = torch.randn(2, n, 2, 16, generator=generator).transpose(1, 2)  # [B, H, n, d_v], not contiguous
    grads = []
    for key_mask, grad in ((mask.long(), grad_out.contiguous()), (mask, grad_out), (mask.to(torch.int8), grad_out),
                           (mask.float(), grad_out)):
        out = nprf_triton.triton_attention(q, k, v, bias, projection, key_mask, None, width + 1, False, block=16)
        grads.append(torch.autograd.grad(out, (q, k, v), grad))
    for got in grads[1:]:
        for a, b in zip(got, grads[0]):
            assert torch.equal(a, b)


def segment_case(seed, n=24, width=5):
    """Inputs of two sequences of n tokens (a bias tied beyond `width`, padding) with a segment bias, a term the
    kernels do not fuse: (q, k, v, bias, projection, mask, segment ids, segment bias, width)."""
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, torch.Generator().manual_seed(seed))
    segments = (torch.arange(n) >= n // 2).long().expand(2, n)
    return q, k, v, tied_table_bias(table, n, width).detach(), projection, mask, segments, torch.tensor([0.5, -1.0]), width


def test_unfused_terms_fall_back_with_one_log_line(caplog):
    """A segment bias is not fused: algorithm="triton" gives the PyTorch result and says so once."""
    q, k, v, bias, projection, mask, segments, beta, _ = segment_case(11)
    nprf_triton._log_once.cache_clear()
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


def tiny_model_case(cls):
    """A one-layer tiny NPRF RoBERTa of class `cls` (seeded), ids [2, 40] and an attention mask padding the second
    sequence's last 9 tokens."""
    from nprf_hf import NPRFRobertaConfig

    config = NPRFRobertaConfig(**tiny_nprf_config(num_hidden_layers=1), is_decoder=cls.__name__.endswith("CausalLM"))
    torch.manual_seed(0)
    model = cls(config)
    attention_mask = torch.ones(2, 40, dtype=torch.long)
    attention_mask[1, 31:] = 0
    return model, torch.randint(3, 99, (2, 40)), attention_mask


@pytest.mark.parametrize("decoder", [False, True])
def test_a_model_trains_through_the_kernels(decoder):
    """A tiny RoBERTa (encoder, and decoder) with attention_algorithm="triton": logits and every parameter's
    gradient (the shared RPE table's included) equal those of "banded"."""
    from nprf_hf import NPRFRobertaForCausalLM, NPRFRobertaForMaskedLM

    model, ids, attention_mask = tiny_model_case(NPRFRobertaForCausalLM if decoder else NPRFRobertaForMaskedLM)
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
    kernels = {"nprf_triton_kernels.py", "nprf_triton_backward.py", "nprf_triton_decode.py"}
    assert {"nprf_triton.py", *kernels} <= set(files)
    for name in files:
        found = set(get_imports(os.path.join(folder, name)))
        # huggingface_hub (hub.py: a source's check) is transformers' own dependency: present wherever it is
        assert found <= {"torch", "transformers", "huggingface_hub"} | set(sys.stdlib_module_names), (name, found)


def test_auto_falls_back_once_when_the_kernels_fail_on_the_device(monkeypatch, caplog):
    """"auto" picks the kernels on a CUDA device; should they fail to build there, the call runs the PyTorch
    algorithms with one log line, and a later call tries the kernels again (nothing is switched off for the process);
    an explicit "triton" raises the error instead."""
    from nprf_hf import nprf_dispatch

    routing = nprf_dispatch.Routing(kernel_devices=("cpu",))  # the CPU plays the CUDA device
    nprf_triton._log_once.cache_clear()
    attempts = []

    def broken(*args):
        attempts.append(1)
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(nprf_triton, "_attention_forward", broken)
    monkeypatch.setattr(nprf_triton_short, "_short_forward", broken)
    generator = torch.Generator().manual_seed(2)
    n, width = 30, 4
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    bias = tied_table_bias(table, n, width).detach()
    with pytest.raises(RuntimeError, match="PTX"):
        Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton")
    with caplog.at_level(logging.WARNING, logger="nprf_hf.nprf_triton"):
        outs = [Fn.nprf_attention(q, k, v, bias, projection, mask, routing=routing) for _ in range(2)]
    assert len(attempts) == 3  # the explicit call, then each of auto's
    said = [r.getMessage() for r in caplog.records if "PTX assembly failed" in r.getMessage()]
    assert len(said) == 1
    ref = naive_attention(q, k, v, bias, projection, mask)
    assert all(relative_error(out, ref) < 1e-5 for out in outs)


@pytest.mark.parametrize("padded, ring", [(False, 9), (True, 9), (False, 37), (True, 0)])
def test_the_decode_kernel_equals_the_recurrent_step(padded, ring):
    """One token against a random state (logit scale, per-head projection, a padded new token): the kernel's output
    and new state equal `recurrent_attention`'s, and the old state is left as it was; a ring read in several chunks
    (16 rows a loop step) and none (a band of 1)."""
    from nprf_hf import nprf_recurrent
    from nprf_hf.nprf_features import normalized_features, normalize_attention

    generator = torch.Generator().manual_seed(21 + padded)
    batch, heads, d, m = 3, 2, 16, 20
    q, k, v = (torch.randn(batch, heads, 1, d, generator=generator) for _ in range(3))
    projection = Fn.draw_projection(m, d, num_heads=heads, generator=generator)
    scale = torch.rand(heads, generator=generator) + 0.5
    state = [torch.rand(batch, heads, m, d + 1, generator=generator),
             torch.rand(batch, heads, ring, m, generator=generator),
             torch.rand(batch, heads, ring, d + 1, generator=generator)]
    state[2][..., -1] = 1.0
    before = [t.clone() for t in state]
    c = torch.rand(heads, ring + 2, generator=generator)
    new_mask = torch.tensor([[True], [not padded], [True]])
    out, new_state = nprf_triton.triton_decode_step(q, k, v, new_mask, state, c, projection, scale)
    phi_q, phi_k = (normalized_features(x, projection, scale) for x in (q, k))
    phi_k = phi_k * new_mask[:, None, :, None]
    u = torch.cat([v, torch.ones(batch, heads, 1, 1)], -1)
    sums, *want = nprf_recurrent.recurrent_attention(phi_q, phi_k, u, *state, c)
    assert relative_error(out, normalize_attention(sums[..., :-1], sums[..., -1:])) < 1e-5
    for got, expected in zip(new_state, want):
        assert got.shape == expected.shape and (got.numel() == 0 or relative_error(got, expected) < 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(state, before))


def test_generation_through_the_kernels():
    """A tiny decoder with attention_algorithm="triton" (prefill and every decode step through the kernels) gives
    the logits of the PyTorch path, step by step, on a left-padded batch."""
    from nprf_hf import NPRFRobertaConfig, NPRFRobertaForCausalLM, nprf_dispatch
    from nprf_hf.cache_nprf import NPRFCache

    config = NPRFRobertaConfig(**tiny_nprf_config(num_hidden_layers=2, logit_scale_max=4.0), is_decoder=True)
    torch.manual_seed(1)
    model = NPRFRobertaForCausalLM(config).eval()
    ids = torch.randint(3, 99, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :4] = 0
    steps = []
    original = nprf_dispatch.triton_decode_step
    for algorithm in ("banded", "triton"):
        model.config.attention_algorithm = algorithm
        calls = []
        nprf_dispatch.triton_decode_step = lambda *a: calls.append(1) or original(*a)
        try:
            with torch.no_grad():
                cache = NPRFCache(model.config)
                logits = [model(ids[:, :20], attention_mask=mask[:, :20], past_key_values=cache).logits[:, -1]]
                for t in range(20, 30):
                    logits.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache).logits[:, -1])
        finally:
            nprf_dispatch.triton_decode_step = original
        steps.append((torch.stack(logits, 1), len(calls)))
    assert steps[0][1] == 0 and steps[1][1] == 10 * 2  # ten steps, two layers: every step through the kernel
    assert relative_error(steps[1][0], steps[0][0]) < 1e-5


# ---- the kernels as custom ops under torch.compile (issue 43) -------------------------------------------------------


def test_the_ops_pass_opcheck():
    """The forward, backward and decode ops (the short path's forward and backward too): schema, fake (shape-only)
    implementations against the real ones, and the autograd registration (torch.library.opcheck), at a tiny shape
    with key padding and a logit scale; q, k, v are transposed views [B, n, H, d] -> [B, H, n, d], as a model's (the
    ops return contiguous tensors)."""
    generator = torch.Generator().manual_seed(31)
    n = 20  # two blocks of 16, one sequence, one head: few programs for the interpreter
    _, _, _, _, projection, mask = inputs(1, 1, n, 16, 16, 4, generator)
    q, k, v = (torch.randn(1, n, 1, 16, generator=generator).transpose(1, 2).requires_grad_(True) for _ in range(3))
    c = torch.rand(1, 2 * n - 1, generator=generator).requires_grad_(True)
    root = (torch.rand(1, generator=generator) + 0.5).requires_grad_(True)
    args = (q, k, v, c, root, projection, mask, True, 1, 16, 4)
    torch.library.opcheck(nprf_triton.attention_forward, args)
    saved = [t.detach() for t in nprf_triton.attention_forward(*args)]
    plain = [t.detach() for t in args[:6]]
    torch.library.opcheck(nprf_triton.attention_backward,
                          (*plain, mask, *saved, torch.randn(q.shape, generator=generator), True, 1, 16, 4, True))
    torch.library.opcheck(nprf_triton_short.short_forward, args)
    saved = [t.detach() for t in nprf_triton_short.short_forward(*args)]
    torch.library.opcheck(nprf_triton_short.short_backward,
                          (*plain, mask, *saved, torch.randn(q.shape, generator=generator), True, 1, 16, 4, True))
    state = [torch.rand(2, 2, 16, 17, generator=generator), torch.rand(2, 2, 3, 16, generator=generator),
             torch.rand(2, 2, 3, 17, generator=generator)]
    token = [torch.randn(2, 2, 1, 16, generator=generator) for _ in range(3)]
    # the step's root has one entry per head (two here; the kernel reads entry h)
    torch.library.opcheck(nprf_triton.decode_step, (*token, torch.tensor([[True], [False]]), *state,
                                                    torch.rand(2, 5, generator=generator), projection,
                                                    torch.rand(2, generator=generator) + 0.5))


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_calls_run_the_kernels_without_a_graph_break(causal, path, monkeypatch):
    """torch.compile(fullgraph=True) of nprf_attention(algorithm="triton") traces the kernels' ops (forward in the
    forward graph, backward in the backward graph), either path's: values and the gradients of q, k, v, the bias
    table and the logit scale equal eager's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    on_path(path, monkeypatch)
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(41 + causal)
    n, width = 36, 5
    q, k, v, table, projection, mask = inputs(2, 2, n, 16, 16, width, generator)
    scale = (torch.rand(2, generator=generator) + 0.5).requires_grad_(True)

    def attention(q, k, v, table, scale):
        return Fn.nprf_attention(q, k, v, tied_table_bias(table, n, width), projection, mask, algorithm="triton",
                                 causal=causal, band_width=width + 1, logit_scale=scale)

    backend = AotEagerAndRecordGraphs()
    leaves = (q, k, v, table, scale)
    compiled = torch.compile(attention, backend=backend, fullgraph=True)(*leaves)
    eager = attention(*leaves)
    grad_out = torch.randn(eager.shape, generator=generator)
    got = torch.autograd.grad(compiled, leaves, grad_out)
    want = torch.autograd.grad(eager, leaves, grad_out)
    assert relative_error(compiled, eager) < 1e-6
    for name, a, b in zip(("q", "k", "v", "table", "logit_scale"), got, want):
        assert relative_error(a, b) < 1e-6, name
    library, op = nprf_triton._LIBRARY, "short" if path == "short" else "attention"
    assert f"{library}.{op}_forward" in backend.fw_graphs[0].code
    assert f"{library}.{op}_backward" in backend.bw_graphs[0].code
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")
def test_compiled_auto_falls_back_without_a_graph_break(monkeypatch, caplog):
    """Compiled (fullgraph=True), "auto" on a CUDA device (the CPU plays one) keeps eager's fallbacks: unfused terms
    run the PyTorch algorithms, and kernels that fail on the device (found by a tiny call while tracing, once per
    device and dtype) keep the compiled calls there on PyTorch's path; each said once in the log."""
    from nprf_hf import nprf_dispatch

    routing = nprf_dispatch.Routing(kernel_devices=("cpu",))
    nprf_triton._log_once.cache_clear()
    nprf_triton._probe.cache_clear()
    q, k, v, bias, projection, mask, segments, beta, width = segment_case(13)

    def attention(q, k, v, **terms):
        return Fn.nprf_attention(q, k, v, bias, projection, mask, band_width=width + 1, routing=routing, **terms)

    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="nprf_hf.nprf_triton"):
        compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
        segmented = compiled(q, k, v, segment_ids=segments, segment_bias=beta, num_segments=2)
        nprf_triton._probe.cache_clear()
        monkeypatch.setattr(nprf_triton, "attention_forward", lambda *a: 1 / 0)
        torch._dynamo.reset()
        plain = compiled(q, k, v)
    said = [r.getMessage() for r in caplog.records if "Triton kernels do not run" in r.getMessage()]
    assert len(said) == 2 and "segment_bias" in said[0] and "ZeroDivisionError" in said[1]
    assert "ZeroDivisionError" in nprf_triton.kernels_fail_on(q.device, q.dtype)
    nprf_triton._probe.cache_clear()  # (the failure was this test's own: the next compiled call probes again)
    want = naive_attention(q, k, v, bias, projection, mask, segment_ids=segments, segment_bias=beta)
    assert relative_error(segmented, want) < 1e-5
    assert relative_error(plain, naive_attention(q, k, v, bias, projection, mask)) < 1e-5
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")
def test_compiled_auto_falls_back_when_the_short_kernels_fail(monkeypatch, caplog):
    """Compiled "auto" probes the short path's kernels as well as the banded ones (once per device and dtype): where
    the short path's fail, the compiled calls there run PyTorch's path (no graph break), said once."""
    from nprf_hf import nprf_dispatch

    routing = nprf_dispatch.Routing(kernel_devices=("cpu",))
    for cached in (nprf_triton._log_once, nprf_triton._probe):
        cached.cache_clear()
    q, k, v, bias, projection, mask, *_, width = segment_case(14)
    monkeypatch.setattr(nprf_triton_short, "short_forward", lambda *a: 1 / 0)

    def attention(q, k, v):
        return Fn.nprf_attention(q, k, v, bias, projection, mask, band_width=width + 1, routing=routing)

    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="nprf_hf.nprf_triton"):
        out = torch.compile(attention, backend="aot_eager", fullgraph=True)(q, k, v)
    said = [r.getMessage() for r in caplog.records if "Triton kernels do not run" in r.getMessage()]
    assert len(said) == 1 and "ZeroDivisionError" in said[0]
    nprf_triton._probe.cache_clear()  # (the failure was this test's own)
    assert relative_error(out, naive_attention(q, k, v, bias, projection, mask)) < 1e-5
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")
def test_compiled_auto_runs_the_kernels_in_a_model(monkeypatch):
    """Under torch.compile "auto" is the kernels on a CUDA device too (the CPU plays one here): a tiny model compiled
    with fullgraph=True runs the forward op and equals the eager PyTorch algorithms in logits and gradients; a
    compiled decode step runs the decode op."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from nprf_hf import NPRFRobertaForCausalLM, nprf_dispatch, nprf_recurrent
    from nprf_hf.attention_nprf import NPRFSelfAttention
    from nprf_hf.nprf_terms import AttentionTerms

    torch._dynamo.reset()
    model, ids, attention_mask = tiny_model_case(NPRFRobertaForCausalLM)
    model.zero_grad()
    eager = model(input_ids=ids, attention_mask=attention_mask).logits  # "auto" on the CPU: PyTorch's algorithms
    eager.square().mean().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    routing = nprf_dispatch.Routing(kernel_devices=("cpu",))
    for layer in model.modules():
        if isinstance(layer, NPRFSelfAttention):
            layer.routing = routing
    backend = AotEagerAndRecordGraphs()
    model.zero_grad()
    logits = torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, attention_mask=attention_mask).logits
    logits.square().mean().backward()
    assert f"{nprf_triton._LIBRARY}.short_forward" in backend.fw_graphs[0].code  # (40 tokens: the short path)
    assert relative_error(logits, eager) < 1e-5
    for name, grad in want.items():
        assert relative_error(model.get_parameter(name).grad, grad) < 1e-4, name
    # a decode step (one token, no autograd)
    generator = torch.Generator().manual_seed(43)
    token = [torch.randn(2, 2, 1, 16, generator=generator) for _ in range(3)]
    state = [torch.rand(2, 2, 16, 17, generator=generator), torch.rand(2, 2, 5, 16, generator=generator),
             torch.rand(2, 2, 5, 17, generator=generator)]
    table = torch.randn(2, 8, generator=generator)  # 8 buckets up to distance 16: a band of W = 6, a ring of 5
    projection = Fn.draw_projection(16, 16, num_heads=2, generator=generator)
    terms = AttentionTerms.from_arguments(logit_scale=torch.rand(2, generator=generator) + 0.5)
    new_mask = torch.tensor([[True], [False]])

    def step(algorithm):
        buckets = nprf_recurrent.CausalBuckets(table, 6, 8, 16)
        return nprf_recurrent.recurrent_step(*token, new_mask, state, buckets, projection, algorithm, "nprf", terms,
                                             routing)

    backend = AotEagerAndRecordGraphs()
    with torch.no_grad():
        (out, new_state), (want_out, want_state) = torch.compile(step, backend=backend, fullgraph=True)("auto"), step(
            "banded")
    assert f"{nprf_triton._LIBRARY}.decode_step" in backend.graphs[0].code
    for got, expected in zip((out, *new_state), (want_out, *want_state)):
        assert relative_error(got, expected) < 1e-5
    torch._dynamo.reset()


def test_a_decode_step_falls_back_when_the_kernel_fails(monkeypatch, caplog):
    """A decode step the router gave the kernel ("auto" on a kernel device: the CPU plays one) that fails there runs
    PyTorch's step for that call, said once, and the next step tries the kernel again; an explicit "triton" raises."""
    from nprf_hf import nprf_dispatch, nprf_recurrent
    from nprf_hf.nprf_terms import AttentionTerms

    nprf_triton._log_once.cache_clear()
    routing = nprf_dispatch.Routing(kernel_devices=("cpu",))
    generator = torch.Generator().manual_seed(44)
    token = [torch.randn(2, 2, 1, 16, generator=generator) for _ in range(3)]
    state = [torch.rand(2, 2, 16, 17, generator=generator), torch.rand(2, 2, 5, 16, generator=generator),
             torch.rand(2, 2, 5, 17, generator=generator)]
    table = torch.randn(2, 8, generator=generator)
    projection = Fn.draw_projection(16, 16, num_heads=2, generator=generator)
    attempts = []

    def broken(*args):
        attempts.append(1)
        raise RuntimeError("decode kernel failed to build")

    monkeypatch.setattr(nprf_dispatch, "triton_decode_step", broken)

    def step(algorithm):
        buckets = nprf_recurrent.CausalBuckets(table, 6, 8, 16)
        return nprf_recurrent.recurrent_step(*token, None, state, buckets, projection, algorithm, "nprf",
                                             AttentionTerms(), routing)

    with torch.no_grad():
        want, _ = step("banded")
        with caplog.at_level(logging.WARNING, logger="nprf_hf.nprf_triton"):
            outs = [step("auto")[0] for _ in range(2)]
        with pytest.raises(RuntimeError, match="failed to build"):
            step("triton")
    assert len(attempts) == 3
    assert len([r for r in caplog.records if "failed to build" in r.getMessage()]) == 1
    for out in outs:
        assert relative_error(out, want) < 1e-6
