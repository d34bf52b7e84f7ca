"""The GPU benchmark of issues 43 and 55, in one run that fits one device loan (at most 8 minutes):

1. a check of the kernels on the device against the float64 reference (values and gradients, fp32 and bf16,
   padding, causal, the short path and the banded one; the decode step), so that nothing wrong is timed;
2. attention alone (B = 1, H = 12, d = 64, m = 64, T5's default buckets), forward and forward + backward, the
   Triton kernels (`algorithm="triton"`) against SDPA (its flash kernel in bf16), 1,024 to 65,536 tokens, with the
   kernels' achieved TFLOP/s and the share of the device's nominal bf16 peak, and each call replayed from a CUDA
   graph (the device's time alone: what is left when no Python launches the kernels), the share of issue 55's
   roofline bound that forward + backward reaches (`roofline`: useful FLOPs or bytes, whichever binds), and
   forward + backward with the bias table trained (a model's case) by either way of summing its gradient
   (`nprf_triton.DIAGONAL_SUMS`), and up to `both_paths_max` tokens both paths of the kernels, the short one (no block
   states) and the banded one: where `nprf_triton_short.SHORT_LENGTH`, their crossover, should be;
3. a whole RoBERTa-base-sized masked LM (12 layers, 768 wide; NPRF with `attention_algorithm="auto"`, which is the
   kernels on CUDA) against the same model with SDPA softmax: forward and training step (forward, loss, backward)
   at 32 x 128, 8 x 512, 1 x 4,096 and 1 x 16,384, with peak memory;
4. the model of 3, both `torch.compile`d (inductor, mode="reduce-overhead": CUDA graphs, no Python per kernel launch;
   the kernels are custom ops, traced without a graph break): training step and forward at 1 x 16,384 (always),
   then 8 x 512, 32 x 128 and 1 x 4,096 as the time allows, with each compile's time, the graph breaks dynamo
   counted and the training step's peak memory;
5. decoding, time per token at 512 and 8,192 tokens of context, batch 1 and 16: the NPRF decoder's constant-size
   cache against softmax's growing one.

Every NPRF time sits beside the softmax time of the same point, measured in the same process. Writes JSON (the
device named) and a plot:

    bash benchmarks/gpu.sh                                   # on a CUDA machine: the measurement
    TRITON_INTERPRET=1 python benchmarks/gpu.py --tiny --output /tmp/gpu_tiny.json   # the same code, CPU, tiny sizes

`--tiny` runs every part at toy sizes through Triton's interpreter, so that the one GPU run cannot fail on a typo
(tests/test_benchmark_scripts.py runs it).
"""

import argparse
import contextlib
import gc
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F

# the clone's nprf_hf: installed (`pip install -e .`), or on PYTHONPATH as benchmarks/gpu.sh puts it
from nprf_hf.benchmarking import device_name, median_time, peak_memory, synchronize, timed, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUTPUT = os.path.join(HERE, "results", "gpu_cuda_bf16.json")
# Nominal dense bf16 tensor-core peaks (TFLOP/s) and memory bandwidths (TB/s) of the SXM parts, from their data sheets
PEAKS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8), "A100": (312.0, 2.0)}
FULL = dict(lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536), heads=12, head_dim=64, features=64,
            model_points=((32, 128), (8, 512), (1, 4096), (1, 16384)), decode_contexts=(512, 8192),
            decode_batches=(1, 16), layers=12, hidden=768, vocab=50265, repeats=10, decode_steps=32,
            algorithm="auto",  # "auto" is the kernels on CUDA: what a user gets
            tiles=((32, 4), (64, 8)),  # besides the default (64 rows, 4 warps); 128 rows overflow shared memory

            # the launch-bound points (eager NPRF 1.64-1.79x SDPA's training step there); inductor with CUDA graphs
            # (16,384 first: issue 55's compiled-step target, <= 0.4x SDPA, with its memory, is always measured)
            compiled_points=((1, 16384), (8, 512), (32, 128), (1, 4096)), compile_backend="inductor",
            # the device's check in bf16 alone: fp32 products are FMA loops there, whose compiles take minutes
            # (tf32: fp32 inputs with torch's TF32 matmuls allowed, the kernels' TF32 products)
            compile_mode="reduce-overhead", check_lengths=(1000,), check_batch=2, check_dtypes=("bfloat16", "tf32"),
            graphed=True, both_paths_max=4096)
# the same at fewer points and repeats: for a device loan with only a few minutes left
QUICK = dict(FULL, lengths=(1024, 4096, 16384, 65536), repeats=5, tiles=((32, 4),), decode_batches=(1, 16),
             decode_steps=16)
TINY = dict(lengths=(40, 72), heads=2, head_dim=16, features=16, model_points=((2, 24), (1, 40)),
            decode_contexts=(16, 40), decode_batches=(1, 2), layers=1, hidden=32, vocab=99, repeats=2, decode_steps=3,
            algorithm="triton", tiles=((16, 4), (32, 4)),
            # aot_eager: dynamo and AOTAutograd (what decides graph breaks and the backward graph) without inductor's
            # code generation (minutes of C++ compiles on 2 cores)
            compiled_points=((2, 24), (1, 40)), compile_backend="aot_eager", compile_mode=None, check_lengths=(45,),
            check_batch=2, check_dtypes=("float32", "bfloat16", "tf32"), graphed=False, both_paths_max=72)


def peak_bytes(fn, device):
    """Peak allocated bytes of one call above what was allocated before it on CUDA; None on the CPU, where the
    --tiny run's resident set under Triton's interpreter would say nothing about the kernels."""
    return peak_memory(fn, device) if device.type == "cuda" else None


def graphed_time(fn, device, repeats):
    """Seconds per call of `fn` captured once in a CUDA graph and replayed `5 x repeats` times back to back: the
    device's time alone, no Python and no launches (what a model step under CUDA graphs pays). None off CUDA or where
    the capture fails (its error logged by the caller)."""
    if device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("error")  # a call that waits for the device cannot be captured: say so before
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-ups off the capturing stream, as torch.cuda.graph asks
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(5 * repeats):
        graph.replay()
    synchronize(device)
    seconds = (time.perf_counter() - start) / (5 * repeats)
    del graph
    return seconds


def attention_flops(n, s, train):
    """2 x the kernels' multiply-adds as launched, per row and head: the features of the query (once) and of the
    keys (in the states kernel and again in each of the 2 REACH + 1 band blocks: 2 d m each), the states (2 m d),
    the far reads (two m x d products) and the band (BT keys per block: scores, 2 m, and weights @ v, 2 d).
    Backward is counted as 2.5x forward (its kernels recompute the features and run about twice the products)."""
    from nprf_hf.nprf_positions import rpe_band_width
    from nprf_hf.nprf_triton import BLOCK

    d, m, h = s["head_dim"], s["features"], s["heads"]
    blocks = 2 * (-(-(rpe_band_width() - 1) // BLOCK)) + 1
    per_row = 2 * d * m * (2 + blocks) + 2 * m * d + 2 * 2 * m * d + blocks * BLOCK * 2 * (m + d)
    return h * n * per_row * (3.5 if train else 1.0)


def roofline(n, s, device, causal=False):
    """Issue 55's lower bound of one attention layer's forward + backward at n tokens (B = 1): the useful FLOPs and
    bytes of a design that does each piece of work once, and the time the device's nominal peaks allow, whichever
    binds. Per head and token, forward: the features of q and k (2 x 2dm), the block states (2m(d + 1)) and their
    far reads (2m(d + 1) per direction), the band of 2W - 1 keys (2(m + d) a pair); backward 2x forward (a chain of
    products' gradients). Bytes, bf16: forward reads q, k, v and writes z and the features (stored once, read again
    by backward), backward reads q, k, v, z, dz and the features and writes dq, dk, dv; plus a denominator (fp32)
    each way. (The issue's own estimate, 5.7 MFLOP and 44 KB a token for 12 heads, counts its tiles' padding and the
    fp32 states too: this bound is the lower one.) Returns {flops, bytes, bound_s, binds} (bound_s None where the
    device's peaks are not known)."""
    from nprf_hf.nprf_positions import rpe_band_width

    d, m, h = s["head_dim"], s["features"], s["heads"]
    band = rpe_band_width() if causal else 2 * rpe_band_width() - 1
    directions = 1 if causal else 2
    forward = 2 * 2 * d * m + 2 * m * (d + 1) * (1 + directions) + band * 2 * (m + d)
    flops = 3 * forward * h * n
    element = 2  # bf16
    per_token = element * ((3 + 1) * d + 2 * m + (5 * d + 2 * m) + 3 * d) + 2 * 4
    total_bytes = per_token * h * n
    peaks = next((v for k, v in PEAKS.items() if k in device_name(device)), None)
    if peaks is None:
        return dict(flops=flops, bytes=total_bytes, bound_s=None, binds=None)
    times = {"flops": flops / (peaks[0] * 1e12), "bytes": total_bytes / (peaks[1] * 1e12)}
    binds = max(times, key=times.get)
    return dict(flops=flops, bytes=total_bytes, bound_s=times[binds], binds=binds)


def roofline_fractions(row, bound):
    """The roofline bound over the kernels' forward + backward time, graphed (the device's time) and eager."""
    if bound["bound_s"] is None:
        return {}
    return {f"roofline_fraction_{kind}": bound["bound_s"] / row[key] for kind, key in (
        ("graphed", "nprf_train_graphed_s"), ("eager", "nprf_train_s")) if row.get(key)}


def attention_part(s, device, dtype, log):
    from nprf_hf import functional as Fn
    from nprf_hf import nprf_triton
    from nprf_hf.nprf_triton import triton_attention

    rows = []
    heads, d, m = s["heads"], s["head_dim"], s["features"]
    table = torch.randn(heads, 32, device=device) * 0.5
    projection = Fn.draw_projection(m, d, device=device)
    width = Fn.rpe_band_width()
    peak_tflops = next((v[0] for k, v in PEAKS.items() if k in device_name(device)), None)
    for n in s["lengths"]:
        if past_budget(log, f"attention n={n}"):
            break
        bias = Fn.relative_position_bias(table, n)
        q, k, v = (torch.randn(1, heads, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, n, d, device=device, dtype=dtype)

        def nprf():
            return Fn.nprf_attention(q, k, v, bias, projection, algorithm="triton", band_width=width)

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v)

        row = {"n": n}
        for name, fn in (("nprf", nprf), ("sdpa", sdpa)):
            with torch.no_grad():
                row[f"{name}_forward_s"] = median_time(fn, device, s["repeats"])
            row[f"{name}_train_s"] = median_time(lambda: fn().backward(grad), device, s["repeats"])
            row[f"{name}_train_peak_bytes"] = peak_bytes(lambda: fn().backward(grad), device)
            if s["graphed"]:
                try:
                    with torch.no_grad():
                        row[f"{name}_forward_graphed_s"] = graphed_time(fn, device, s["repeats"])
                    row[f"{name}_train_graphed_s"] = graphed_time(lambda: fn().backward(grad), device, s["repeats"])
                except Exception as error:  # noqa: BLE001  (one device call: keep the eager numbers)
                    row[f"{name}_graphed_error"] = f"{type(error).__name__}: {error}"[:1000]
                    log(f"graphed {name} n={n} failed: {row[f'{name}_graphed_error'][:300]}")
                q.grad = k.grad = v.grad = None
        # the other tiles (rows per block, warps), for the next choice of the default
        row["tiles"] = {}
        for block, warps in s["tiles"]:
            def tiled():
                return triton_attention(q, k, v, bias, projection, None, None, width, False, block, warps)

            try:
                with torch.no_grad():
                    forward = median_time(tiled, device, s["repeats"])
                row["tiles"][f"{block}x{warps}"] = {"forward_s": forward, "train_s": median_time(
                    lambda: tiled().backward(grad), device, s["repeats"])}
            except Exception as error:  # noqa: BLE001  (a tile the device cannot hold: the others still count)
                log(f"tile {block}x{warps} n={n} failed: {type(error).__name__}: {str(error)[:200]}")
        # the bias table trained, as in a model: its gradient by per-pair atomics (the default) and by diagonal sums
        row["bias_grad"] = {}
        trained = table.clone().requires_grad_(True)

        def trained_step():
            Fn.nprf_attention(q, k, v, Fn.relative_position_bias(trained, n), projection, algorithm="triton",
                              band_width=width).backward(grad)

        default = nprf_triton.DIAGONAL_SUMS
        for label, diagonals in (("atomics", False), ("diagonals", True)):
            nprf_triton.DIAGONAL_SUMS = diagonals
            times = row["bias_grad"][label] = {"train_s": None, "train_graphed_s": None}
            try:
                times["train_s"] = median_time(trained_step, device, s["repeats"])
                if s["graphed"]:
                    times["train_graphed_s"] = graphed_time(trained_step, device, s["repeats"])
            except Exception as error:  # noqa: BLE001  (one device call: keep the other numbers)
                log(f"bias gradient by {label} n={n} failed: {type(error).__name__}: {str(error)[:300]}")
        nprf_triton.DIAGONAL_SUMS = default
        q.grad = k.grad = v.grad = None
        if n <= s["both_paths_max"]:
            row["paths"] = both_paths(nprf, grad, device, s, log)
            log(f"paths n={n}: " + ", ".join(f"{path} fwd {_ms(t['forward_s'])} fwd+bwd {_ms(t['train_s'])} ms"
                                             for path, t in row["paths"].items()))
        row["roofline"] = roofline(n, s, device)
        row.update(roofline_fractions(row, row["roofline"]))
        for mode in ("forward", "train"):
            row[f"speedup_{mode}"] = row[f"sdpa_{mode}_s"] / row[f"nprf_{mode}_s"]
            row[f"nprf_{mode}_tflops"] = attention_flops(n, s, mode == "train") / row[f"nprf_{mode}_s"] / 1e12
            if peak_tflops:
                row[f"nprf_{mode}_share_of_peak"] = row[f"nprf_{mode}_tflops"] / peak_tflops
        rows.append(row)
        best = min(row["tiles"].items(), key=lambda item: item[1]["train_s"], default=(None, None))[0]
        log(f"attention n={n} (fastest other tile {best}): forward NPRF {row['nprf_forward_s'] * 1e3:.2f} ms, SDPA {row['sdpa_forward_s'] * 1e3:.2f} ms "
            f"({row['speedup_forward']:.2f}x); fwd+bwd {row['nprf_train_s'] * 1e3:.2f} / {row['sdpa_train_s'] * 1e3:.2f} ms "
            f"({row['speedup_train']:.2f}x); NPRF {row['nprf_train_tflops']:.1f} TFLOP/s; in CUDA graphs (device time) "
            f"NPRF / SDPA forward {_ms(row.get('nprf_forward_graphed_s'))} / {_ms(row.get('sdpa_forward_graphed_s'))}, "
            f"fwd+bwd {_ms(row.get('nprf_train_graphed_s'))} / {_ms(row.get('sdpa_train_graphed_s'))} ms; with the bias "
            "gradient, fwd+bwd eager (graphed) " + ", ".join(f"{label} {_ms(t['train_s'])} ({_ms(t['train_graphed_s'])})"
                                                            for label, t in row["bias_grad"].items()) + " ms")
        bound = row["roofline"]
        log(f"roofline n={n}: {bound['flops'] / 1e9:.1f} GFLOP, {bound['bytes'] / 1e6:.0f} MB, bound "
            f"{_ms(bound['bound_s'])} ms ({bound['binds']} bind); NPRF fwd+bwd at "
            + ", ".join(f"{row[key]:.1%} of it {key.rsplit('_', 1)[1]}" for key in ("roofline_fraction_graphed",
                                                                                  "roofline_fraction_eager")
                        if key in row))
    return rows


def both_paths(fn, grad, device, s, log):
    """{path: forward and forward + backward times} of `fn` (the kernels through their entry) on the short path and
    on the banded one, whatever `nprf_triton_short.SHORT_LENGTH` picks: the data for the next choice of it."""
    from nprf_hf import nprf_triton_short

    times = {}
    for path in PATHS:
        times[path] = {"forward_s": None, "train_s": None}
        try:
            with on_path(path), torch.no_grad():
                times[path]["forward_s"] = median_time(fn, device, s["repeats"])
            with on_path(path):
                times[path]["train_s"] = median_time(lambda: fn().backward(grad), device, s["repeats"])
        except Exception as error:  # noqa: BLE001  (one device call: keep the other numbers)
            log(f"the {path} path failed: {type(error).__name__}: {str(error)[:300]}")
    return times


PATHS = ("short", "banded")


@contextlib.contextmanager
def on_path(path):
    """Within: the kernels' entry (`nprf_triton_short.triton_attention`) takes `path` at every length."""
    from nprf_hf import nprf_triton_short

    default = nprf_triton_short.SHORT_LENGTH
    nprf_triton_short.SHORT_LENGTH = 1 << 30 if path == "short" else 0
    try:
        yield
    finally:
        nprf_triton_short.SHORT_LENGTH = default


def _ms(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _mb(count):
    return "-" if count is None else f"{count / 2 ** 20:.0f}"


class FallbackReasons(logging.Handler):
    """The reasons the kernels' fallback log line gave (`nprf_triton.log_fallback_once`, once per reason and
    process): "auto" ran the PyTorch algorithms instead."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons = set()

    def emit(self, record):
        self.reasons.update(str(arg) for arg in (record.args or ())[:1])


class tf32_matmuls:
    """Within: torch's CUDA fp32 matmuls may use TF32 (`enabled`), as a Trainer's `--tf32` sets; restored after."""

    def __init__(self, enabled):
        self.enabled = enabled

    def __enter__(self):
        matmul = torch.backends.cuda.matmul
        self.new_api = getattr(matmul, "fp32_precision", None) is not None
        if self.enabled:
            self.before = matmul.fp32_precision if self.new_api else matmul.allow_tf32
            if self.new_api:
                matmul.fp32_precision = "tf32"
            else:
                matmul.allow_tf32 = True

    def __exit__(self, *_):
        if self.enabled:
            if self.new_api:
                torch.backends.cuda.matmul.fp32_precision = self.before
            else:
                torch.backends.cuda.matmul.allow_tf32 = self.before


def check_part(s, device, dtype, log):
    """The compiled kernels on the device against the float64 reference before anything is timed (the suite checks
    the same code under Triton's interpreter, at toy sizes): relative errors of the output and of the gradients of
    q, k, v and the bias table (`check_dtypes`: bf16, fp32 with TF32 allowed, exact fp32), bidirectional and causal,
    with left and right key padding, at lengths off the block, on both paths (`PATHS`); and the decode kernel's output
    and new state against `recurrent_attention`."""
    from nprf_hf import functional as Fn
    from nprf_hf import nprf_recurrent
    from nprf_hf.nprf_features import normalize_attention, normalized_features
    from nprf_hf.nprf_naive import naive_attention
    from nprf_hf.nprf_triton import triton_decode_step
    from nprf_hf.nprf_triton_short import triton_attention

    def error(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    heads, d, m, batch = s["heads"], s["head_dim"], s["features"], s["check_batch"]
    width = Fn.rpe_band_width()
    generator = torch.Generator().manual_seed(0)
    rows = []
    # float32: the kernels' products in exact fp32 (input_precision="ieee"); tf32: fp32 inputs with TF32 matmuls
    # allowed (TF32 products); half: bf16 operands; fp32 sums in every case
    for name in s["check_dtypes"]:
        in_dtype = torch.float32 if name == "tf32" else getattr(torch, name)
        bound = 1e-4 if name == "float32" else 5e-2
        for n, path, causal in ((n, path, causal) for n in s["check_lengths"] for path in PATHS
                                for causal in (False, True)):
            q, k, v = (torch.randn(batch, heads, n, d, generator=generator).to(device) for _ in range(3))
            table = (torch.randn(heads, 32, generator=generator) * 0.5).to(device).requires_grad_(True)
            projection = Fn.draw_projection(m, d, generator=generator).to(device)
            mask = torch.ones(batch, n, dtype=torch.bool, device=device)
            mask[-1, n - n // 3:] = False
            mask[0, :2] = False
            grad_out = torch.randn(batch, heads, n, d, generator=generator).to(device)
            leaves = [t.to(in_dtype).requires_grad_(True) for t in (q, k, v)]
            with tf32_matmuls(name == "tf32"), on_path(path):
                out = triton_attention(*leaves, Fn.relative_position_bias(table, n), projection, mask, None,
                                       width, causal)
                got = torch.autograd.grad(out, (*leaves, table), grad_out.to(out.dtype))
            wide = [t.double().requires_grad_(True) for t in (q, k, v)]
            table64 = table.detach().double().requires_grad_(True)
            ref = naive_attention(*wide, Fn.relative_position_bias(table64, n), projection.double(), mask, causal)
            want = torch.autograd.grad(ref, (*wide, table64), grad_out.double())
            row = {"dtype": name, "n": n, "path": path, "causal": causal, "out": error(out, ref)}
            row.update({f"d{label}": error(a, b) for label, a, b in zip(("q", "k", "v", "table"), got, want)})
            row["ok"] = all(value < bound for key, value in row.items() if key in ("out", "dq", "dk", "dv",
                                                                                     "dtable"))
            rows.append(row)
            log(f"check {name} n={n} {path} causal={causal}: relative errors " + ", ".join(
                f"{key} {row[key]:.1e}" for key in ("out", "dq", "dk", "dv", "dtable")) +
                ("" if row["ok"] else f"  ABOVE {bound:g}"))
    # the decode step: one token against a random state, in fp32
    ring = width - 1
    q, k, v = (torch.randn(batch, heads, 1, d, generator=generator).to(device) for _ in range(3))
    projection = Fn.draw_projection(m, d, num_heads=heads, generator=generator).to(device)
    state = [torch.rand(*shape, generator=generator).to(device) for shape in (
        (batch, heads, m, d + 1), (batch, heads, ring, m), (batch, heads, ring, d + 1))]
    state[2][..., -1] = 1.0
    c = torch.rand(heads, ring + 2, generator=generator).to(device)
    new_mask = torch.ones(batch, 1, dtype=torch.bool, device=device)
    new_mask[-1] = False
    out, new_state = triton_decode_step(q, k, v, new_mask, state, c, projection, None)
    phi_q, phi_k = (normalized_features(x, projection) for x in (q, k))
    sums, *want = nprf_recurrent.recurrent_attention(phi_q, phi_k * new_mask[:, None, :, None],
                                                     torch.cat([v, torch.ones_like(v[..., :1])], -1), *state, c)
    row = {"decode": True, "out": error(out, normalize_attention(sums[..., :-1], sums[..., -1:])),
           "state": max(error(a, b) for a, b in zip(new_state, want))}
    row["ok"] = row["out"] < 1e-4 and row["state"] < 1e-4
    rows.append(row)
    log(f"check decode step: relative errors out {row['out']:.1e}, state {row['state']:.1e}"
        + ("" if row["ok"] else "  ABOVE 1e-4"))
    return rows


def build_models(s, device, dtype, max_positions, decoder=False):
    """(NPRF, softmax SDPA) RoBERTa-base-sized models of the same random weights where they share parameters."""
    from transformers import RobertaConfig, RobertaForCausalLM, RobertaForMaskedLM

    from nprf_hf import NPRFRobertaConfig, NPRFRobertaForCausalLM, NPRFRobertaForMaskedLM

    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], intermediate_size=4 * s["hidden"], hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, max_position_embeddings=max_positions + 2, is_decoder=decoder,
                  pad_token_id=1)
    torch.manual_seed(0)
    nprf_class, softmax_class = (NPRFRobertaForCausalLM, RobertaForCausalLM) if decoder else (
        NPRFRobertaForMaskedLM, RobertaForMaskedLM)
    nprf = nprf_class(NPRFRobertaConfig(num_random_features=s["features"], attention_algorithm=s["algorithm"], **common))
    config = RobertaConfig(**common)
    config._attn_implementation = "sdpa"
    softmax = softmax_class(config)
    return [model.to(device=device, dtype=dtype) for model in (nprf, softmax)]


def model_part(s, device, dtype, log):
    longest = max(n for _, n in s["model_points"])
    models = dict(zip(("nprf", "sdpa"), build_models(s, device, dtype, longest)))
    rows = []
    for batch, n in s["model_points"]:
        if past_budget(log, f"model {batch}x{n}"):
            break
        ids = torch.randint(3, s["vocab"], (batch, n), device=device)
        row = {"batch": batch, "n": n}
        for name, model in models.items():
            model.train()

            def train_step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                model.zero_grad(set_to_none=True)

            def forward():
                with torch.no_grad():
                    model(input_ids=ids)

            row[f"{name}_forward_s"] = median_time(forward, device, s["repeats"])
            row[f"{name}_train_s"] = median_time(train_step, device, s["repeats"])
            row[f"{name}_train_peak_bytes"] = peak_bytes(train_step, device)
        row["nprf_over_sdpa_forward"] = row["nprf_forward_s"] / row["sdpa_forward_s"]
        row["nprf_over_sdpa_train"] = row["nprf_train_s"] / row["sdpa_train_s"]
        rows.append(row)
        log(f"model {batch}x{n}: training step NPRF {row['nprf_train_s'] * 1e3:.1f} ms, SDPA "
            f"{row['sdpa_train_s'] * 1e3:.1f} ms ({row['nprf_over_sdpa_train']:.2f}x of SDPA's time)")
    del models
    return rows


def compiled_part(s, device, dtype, log):
    """`model_part` with both models `torch.compile`d (dynamic=False: one graph per shape, as CUDA graphs want), with
    each compile's time and the graph breaks dynamo counted. A point starts only while the part's time left covers
    the last point's (its compiles dominate it); a model that fails to compile keeps its error in the row."""
    from torch._dynamo.utils import counters

    longest = max(n for _, n in s["compiled_points"])
    models = dict(zip(("nprf", "sdpa"), build_models(s, device, dtype, longest)))
    compiled = {name: torch.compile(model.train(), backend=s["compile_backend"], mode=s["compile_mode"],
                                    dynamic=False) for name, model in models.items()}
    rows, last = [], 0.0
    for batch, n in s["compiled_points"]:
        if past_budget(log, f"compiled model {batch}x{n}", need=last):
            break
        started = time.perf_counter()
        ids = torch.randint(3, s["vocab"], (batch, n), device=device)
        row = {"batch": batch, "n": n, "backend": s["compile_backend"], "mode": s["compile_mode"]}
        for name, model in compiled.items():
            def train_step():
                torch.compiler.cudagraph_mark_step_begin()  # a new step: CUDA graphs may overwrite the last outputs
                model(input_ids=ids, labels=ids).loss.backward()
                models[name].zero_grad(set_to_none=True)

            def forward():
                torch.compiler.cudagraph_mark_step_begin()
                with torch.no_grad():
                    model(input_ids=ids)

            try:
                for mode, fn in (("train", train_step), ("forward", forward)):
                    breaks = sum(counters["graph_break"].values())
                    # compiles (under CUDA graphs: a warm-up run; the next call, median_time's, records)
                    row[f"{name}_{mode}_compile_s"] = timed(fn, device)[0]
                    row[f"{name}_{mode}_graph_breaks"] = sum(counters["graph_break"].values()) - breaks
                    row[f"{name}_{mode}_s"] = median_time(fn, device, s["repeats"])
                row[f"{name}_train_peak_bytes"] = peak_bytes(train_step, device)
            except Exception as error:  # noqa: BLE001  (one device call: keep the other model's numbers)
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:2000]
                log(f"compiled {name} {batch}x{n} failed: {row[f'{name}_error'][:500]}")
                drop_compiled_state(models, device)
        for mode in ("forward", "train"):
            if f"nprf_{mode}_s" in row and f"sdpa_{mode}_s" in row:
                row[f"nprf_over_sdpa_{mode}"] = row[f"nprf_{mode}_s"] / row[f"sdpa_{mode}_s"]
        rows.append(row)
        last = time.perf_counter() - started
        if "nprf_over_sdpa_train" in row:
            log(f"compiled model {batch}x{n}: training step NPRF {row['nprf_train_s'] * 1e3:.1f} ms, SDPA "
                f"{row['sdpa_train_s'] * 1e3:.1f} ms ({row['nprf_over_sdpa_train']:.2f}x of SDPA's time), forward "
                f"{row.get('nprf_over_sdpa_forward', float('nan')):.2f}x; NPRF graph breaks "
                f"{row['nprf_train_graph_breaks']}; peak memory NPRF / SDPA {_mb(row.get('nprf_train_peak_bytes'))} / "
                f"{_mb(row.get('sdpa_train_peak_bytes'))} MB; {last:.0f} s with its compiles")
    del compiled, models
    torch._dynamo.reset()
    return rows


def drop_compiled_state(models, device):
    """After a compiled step failed: dynamo's caches and the CUDA graph trees dropped (the wrappers compile again on
    their next call) and the device's cache emptied. An out-of-memory error inside a recorded graph leaves the tree
    unusable: on the H200 (2026-11-28) every compiled point after SDPA's 16,384-token one failed a bare assertion."""
    for model in models.values():
        model.zero_grad(set_to_none=True)
    torch._dynamo.reset()  # resets the CUDA graph trees too
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_part(s, device, dtype, log):
    from transformers import DynamicCache

    from nprf_hf.cache_nprf import NPRFCache

    longest = max(s["decode_contexts"]) + s["decode_steps"] + 1
    models = dict(zip(("nprf", "sdpa"), (m.eval() for m in build_models(s, device, dtype, longest, decoder=True))))
    rows = []
    for batch in s["decode_batches"]:
        for context in s["decode_contexts"]:
            if past_budget(log, f"decode batch {batch}, context {context}"):
                break
            ids = torch.randint(3, s["vocab"], (batch, context), device=device)
            row = {"batch": batch, "context": context}
            for name, model in models.items():
                with torch.no_grad():
                    cache = NPRFCache(model.config) if name == "nprf" else DynamicCache(config=model.config)
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                    token = out.logits[:, -1:].argmax(-1)
                    model(input_ids=token, past_key_values=cache, use_cache=True)  # warm-up step

                    def steps(token=token, model=model, cache=cache):
                        for _ in range(s["decode_steps"]):
                            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                            token = logits[:, -1:].argmax(-1)

                    seconds = timed(steps, device)[0]
                row[f"{name}_per_token_s"] = seconds / s["decode_steps"]
            row["nprf_over_sdpa"] = row["nprf_per_token_s"] / row["sdpa_per_token_s"]
            rows.append(row)
            log(f"decode batch {batch}, context {context}: NPRF {row['nprf_per_token_s'] * 1e3:.2f} ms/token, "
                f"softmax {row['sdpa_per_token_s'] * 1e3:.2f} ({row['nprf_over_sdpa']:.2f}x)")
    return rows


_deadline = [float("inf")]  # when the running part must stop starting new points (time.perf_counter)


def past_budget(log, point, need=0.0):
    """Whether the part's time is spent (or what is left is under `need` seconds): its remaining points are skipped
    (and said so), so that the whole run fits one device call whatever the kernels' speed."""
    if time.perf_counter() + need < _deadline[0]:
        return False
    log(f"{point} and the rest of this part skipped: its time budget is spent")
    return True


def profile_part(s, device, dtype, log, path):
    """Where the time of the shortest points goes: torch.profiler over one attention forward + backward at 4,096
    tokens and one training step of the model at 8 x 512 (kernels' device time against the wall), as a text table."""
    from torch.profiler import ProfilerActivity, profile

    from nprf_hf import functional as Fn

    heads, d, m = s["heads"], s["head_dim"], s["features"]
    n = min(4096, max(s["lengths"]))
    q, k, v = (torch.randn(1, heads, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    bias = Fn.relative_position_bias(torch.randn(heads, 32, device=device), n)
    projection = Fn.draw_projection(m, d, device=device)
    width = Fn.rpe_band_width()

    def attention():
        Fn.nprf_attention(q, k, v, bias, projection, algorithm="triton", band_width=width).sum().backward()

    nprf, _ = build_models(s, device, dtype, 512)
    nprf.train()
    batch, length = (8, 512) if s is not TINY else (2, 24)
    ids = torch.randint(3, s["vocab"], (batch, length), device=device)

    def step():
        nprf(input_ids=ids, labels=ids).loss.backward()
        nprf.zero_grad(set_to_none=True)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    lines = []
    for name, fn in (("attention fwd+bwd, n=%d" % n, attention), ("model training step %dx%d" % (batch, length), step)):
        fn()
        synchronize(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            fn()
            synchronize(device)
        wall = time.perf_counter() - start
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events) if device.type == "cuda" else 0.0
        lines.append(f"== {name}: wall {wall * 1e3:.2f} ms (profiled), device busy {device_us / 1e3:.2f} ms, "
                     f"{sum(e.count for e in events if e.device_type.name == 'CUDA')} kernels")
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        lines.append(events.table(sort_by=sort, row_limit=25))
        log(lines[-2])
    with open(path, "w") as handle:
        handle.write("\n".join(lines))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["attention"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    lengths = [r["n"] for r in rows]
    for ax, mode, title in zip(axes, ("forward", "train"), ("forward", "forward + backward")):
        ax.loglog(lengths, [r[f"nprf_{mode}_s"] * 1e3 for r in rows], "o-", label="NPRF (Triton)")
        ax.loglog(lengths, [r[f"sdpa_{mode}_s"] * 1e3 for r in rows], "s--", label="SDPA (flash)")
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms")
        ax.set_title(f"attention {title}, {results['device']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# name -> (the part, the seconds it may start new points for), in the order they run: 450 s of points in all, the
# rest of 8 minutes for the start-up and the check (on an H200, 2026-11-27: start-up and check about 25 s,
# attention 34 s, the eager model 20 s, decoding 15 s; each compiled point about 100 s, mostly its four compiles, and
# the compiled part starts a point only while the time left covers the last one's: two points fit, 16,384 first)
PARTS = {"check": (check_part, 0.0), "attention": (attention_part, 100.0), "model": (model_part, 60.0),
         "compiled": (compiled_part, 250.0), "decode": (decode_part, 40.0)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON to write (a .png plot beside it)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU through Triton's interpreter")
    parser.add_argument("--quick", action="store_true", help="fewer lengths, repeats and tiles (a short device loan)")
    parser.add_argument("--profile", action="store_true", help="also profile the shortest points (a .txt beside the JSON)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    defaults = " ".join(f"{name}={budget:g}" for name, (_, budget) in PARTS.items() if budget)
    parser.add_argument("--budget-s", nargs="+", default=[], metavar="PART=S",
                        help=f"seconds a part may start new points for (default {defaults}: the whole run fits one "
                        "8-minute device call)")
    args = parser.parse_args(argv)
    budgets = {name: budget for name, (_, budget) in PARTS.items()}
    for item in args.budget_s:
        name, _, seconds = item.partition("=")
        if name not in PARTS:
            parser.error(f"--budget-s {item!r}: no part {name!r} (the parts: {', '.join(PARTS)})")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            parser.error(f"--budget-s {item!r}: give PART=SECONDS, e.g. compiled=120")
    args.budget_s = budgets
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--tiny runs the kernels on the CPU: set TRITON_INTERPRET=1 before starting Python")
        device, sizes = torch.device("cpu"), TINY
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: this benchmark measures the GPU kernels (use --tiny for the CPU check)")
        device, sizes = torch.device("cuda"), QUICK if args.quick else FULL
    dtype = torch.bfloat16
    results = {"device": device_name(device), "torch": torch.__version__, "dtype": "bfloat16", "tiny": args.tiny,
               "sizes": sizes}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        sys.exit("Triton does not import: pip install triton")
    started = time.perf_counter()

    def log(line):
        print(f"[{time.perf_counter() - started:6.1f} s] {line}", flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fallbacks = FallbackReasons()
    logging.getLogger("nprf_hf.nprf_triton").addHandler(fallbacks)

    for part in args.parts:
        _deadline[0] = time.perf_counter() + args.budget_s[part]
        try:
            results[part] = PARTS[part][0](sizes, device, dtype, log)
        except Exception as error:  # noqa: BLE001  (one device call: keep the other parts' numbers)
            results[f"{part}_error"] = f"{type(error).__name__}: {error}"[:2000]
            log(f"{part} failed: {results[f'{part}_error'][:500]}")
        # "auto" falls back to PyTorch when the kernels fail on the device: then these numbers are not the kernels'
        results[f"{part}_kernels_disabled"] = sorted(reason for reason in fallbacks.reasons if "failed" in reason)
        results["total_s"] = time.perf_counter() - started
        write_json(args.output, results)  # after every part: a run cut short keeps what it measured
    if args.profile:
        try:
            profile_part(sizes, device, dtype, log, os.path.splitext(args.output)[0] + "_profile.txt")
        except Exception as error:  # noqa: BLE001
            log(f"profile failed: {type(error).__name__}: {error}")
    if "attention" in results:
        plot(results, os.path.splitext(args.output)[0] + ".png")
    log(f"wrote {args.output}")


if __name__ == "__main__":
    main()
