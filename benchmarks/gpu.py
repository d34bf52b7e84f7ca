"""The GPU benchmark of issue 43, in one run that fits one device loan (about 8 minutes on an H100):

1. attention alone (B = 1, H = 12, d = 64, m = 64, T5's default buckets), forward and forward + backward, the
   Triton kernels (`algorithm="triton"`) against SDPA (its flash kernel in bf16), 1,024 to 65,536 tokens, with the
   kernels' achieved TFLOP/s and the share of the device's nominal bf16 peak;
2. a whole RoBERTa-base-sized masked LM (12 layers, 768 wide; NPRF with `attention_algorithm="auto"`, which is the
   kernels on CUDA) against the same model with SDPA softmax: forward and training step (forward, loss, backward)
   at 32 x 128, 8 x 512, 1 x 4,096 and 1 x 16,384, with peak memory;
3. decoding, time per token at 512 and 8,192 tokens of context, batch 1 and 16: the NPRF decoder's constant-size
   cache against softmax's growing one;
4. the model of 2, both `torch.compile`d (inductor, mode="reduce-overhead": CUDA graphs, no Python per kernel launch;
   the kernels are custom ops, traced without a graph break): training step and forward at 32 x 128, 8 x 512 and
   1 x 4,096, with each compile's time and the graph breaks dynamo counted.

Every NPRF time sits beside the softmax time of the same point, measured in the same process. Writes JSON (the
device named) and a plot:

    bash benchmarks/gpu.sh                                   # on a CUDA machine: the measurement
    TRITON_INTERPRET=1 python benchmarks/gpu.py --tiny --output /tmp/gpu_tiny.json   # the same code, CPU, tiny sizes

`--tiny` runs every part at toy sizes through Triton's interpreter, so that the one GPU run cannot fail on a typo
(tests/test_benchmark_scripts.py runs it).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the clone's nprf_hf, uninstalled

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUTPUT = os.path.join(HERE, "results", "gpu_cuda_bf16.json")
# Nominal dense bf16 tensor-core peaks (TFLOP/s) and memory bandwidths (TB/s) of the SXM parts, from their data sheets
PEAKS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8), "A100": (312.0, 2.0)}
FULL = dict(lengths=(1024, 2048, 4096, 8192, 16384, 32768, 65536), heads=12, head_dim=64, features=64,
            model_points=((32, 128), (8, 512), (1, 4096), (1, 16384)), decode_contexts=(512, 8192),
            decode_batches=(1, 16), layers=12, hidden=768, vocab=50265, repeats=10, decode_steps=32,
            algorithm="auto",  # "auto" is the kernels on CUDA: what a user gets
            tiles=((32, 4), (64, 8), (128, 8)),  # besides the default (64 rows, 4 warps)
            # the launch-bound points (eager NPRF 1.64-1.79x SDPA's training step there); inductor with CUDA graphs
            compiled_points=((32, 128), (8, 512), (1, 4096)), compile_backend="inductor",
            compile_mode="reduce-overhead")
# the same at fewer points and repeats: for a device loan with only a few minutes left
QUICK = dict(FULL, lengths=(1024, 4096, 16384, 65536), repeats=5, tiles=((32, 4),), decode_batches=(1, 16),
             decode_steps=16)
TINY = dict(lengths=(40, 72), heads=2, head_dim=16, features=16, model_points=((2, 24), (1, 40)),
            decode_contexts=(16, 40), decode_batches=(1, 2), layers=1, hidden=32, vocab=99, repeats=2, decode_steps=3,
            algorithm="triton", tiles=((16, 4), (32, 4)),
            # aot_eager: dynamo and AOTAutograd (what decides graph breaks and the backward graph) without inductor's
            # code generation (minutes of C++ compiles on 2 cores)
            compiled_points=((2, 24), (1, 40)), compile_backend="aot_eager", compile_mode=None)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, repeats):
    """Median seconds of `fn()` over `repeats` calls after one untimed warm-up (which compiles the kernels)."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn, device):
    """Peak allocated bytes of one call above what was allocated before it (CUDA only; None on the CPU)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


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


def attention_part(s, device, dtype, log):
    from nprf_hf import functional as Fn
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
        # the other tiles (rows per block, warps), for the next choice of the default
        row["tiles"] = {}
        for block, warps in s["tiles"]:
            def tiled():
                return triton_attention(q, k, v, bias, projection, None, None, width, False, block, warps)

            with torch.no_grad():
                forward = median_time(tiled, device, s["repeats"])
            row["tiles"][f"{block}x{warps}"] = {"forward_s": forward, "train_s": median_time(
                lambda: tiled().backward(grad), device, s["repeats"])}
        for mode in ("forward", "train"):
            row[f"speedup_{mode}"] = row[f"sdpa_{mode}_s"] / row[f"nprf_{mode}_s"]
            row[f"nprf_{mode}_tflops"] = attention_flops(n, s, mode == "train") / row[f"nprf_{mode}_s"] / 1e12
            if peak_tflops:
                row[f"nprf_{mode}_share_of_peak"] = row[f"nprf_{mode}_tflops"] / peak_tflops
        rows.append(row)
        best = min(row["tiles"].items(), key=lambda item: item[1]["train_s"], default=(None, None))[0]
        log(f"attention n={n} (fastest other tile {best}): forward NPRF {row['nprf_forward_s'] * 1e3:.2f} ms, SDPA {row['sdpa_forward_s'] * 1e3:.2f} ms "
            f"({row['speedup_forward']:.2f}x); fwd+bwd {row['nprf_train_s'] * 1e3:.2f} / {row['sdpa_train_s'] * 1e3:.2f} ms "
            f"({row['speedup_train']:.2f}x); NPRF {row['nprf_train_tflops']:.1f} TFLOP/s")
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
                    begin = time.perf_counter()
                    fn()  # compiles (under CUDA graphs: a warm-up run; the next call, median_time's, records)
                    synchronize(device)
                    row[f"{name}_{mode}_compile_s"] = time.perf_counter() - begin
                    row[f"{name}_{mode}_graph_breaks"] = sum(counters["graph_break"].values()) - breaks
                    row[f"{name}_{mode}_s"] = median_time(fn, device, s["repeats"])
            except Exception as error:  # noqa: BLE001  (one device call: keep the other model's numbers)
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"[:2000]
                log(f"compiled {name} {batch}x{n} failed: {row[f'{name}_error'][:500]}")
        for mode in ("forward", "train"):
            if f"nprf_{mode}_s" in row and f"sdpa_{mode}_s" in row:
                row[f"nprf_over_sdpa_{mode}"] = row[f"nprf_{mode}_s"] / row[f"sdpa_{mode}_s"]
        rows.append(row)
        last = time.perf_counter() - started
        if "nprf_over_sdpa_train" in row:
            log(f"compiled model {batch}x{n}: training step NPRF {row['nprf_train_s'] * 1e3:.1f} ms, SDPA "
                f"{row['sdpa_train_s'] * 1e3:.1f} ms ({row['nprf_over_sdpa_train']:.2f}x of SDPA's time), forward "
                f"{row.get('nprf_over_sdpa_forward', float('nan')):.2f}x; NPRF graph breaks "
                f"{row['nprf_train_graph_breaks']}; {last:.0f} s with its compiles")
    del compiled, models
    torch._dynamo.reset()
    return rows


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
                    synchronize(device)
                    start = time.perf_counter()
                    for _ in range(s["decode_steps"]):
                        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    synchronize(device)
                row[f"{name}_per_token_s"] = (time.perf_counter() - start) / s["decode_steps"]
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


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


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


# name -> the part, in the order they run and `--budget-s` lists them
PARTS = {"attention": attention_part, "model": model_part, "decode": decode_part, "compiled": compiled_part}
# Seconds each part may start new points for, 490 s in all, the rest of a 10-minute call for the points started last
# and the start-up (the eager parts took 65 s in all on an H200 with --quick; the compiled part's points are mostly
# its four compiles each, and it starts a point only while the time left covers the last one's).
BUDGETS_S = (150.0, 100.0, 60.0, 180.0)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON to write (a .png plot beside it)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU through Triton's interpreter")
    parser.add_argument("--quick", action="store_true", help="fewer lengths, repeats and tiles (a short device loan)")
    parser.add_argument("--profile", action="store_true", help="also profile the shortest points (a .txt beside the JSON)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--budget-s", nargs="+", type=float, default=list(BUDGETS_S), metavar="S",
                        help="seconds each part may start new points for, in the order ATTENTION MODEL DECODE "
                        f"[COMPILED] (default {' '.join(map(str, BUDGETS_S))}: the whole run fits one 10-minute device call)")
    args = parser.parse_args(argv)
    if len(args.budget_s) not in (3, 4):
        parser.error("--budget-s takes 3 or 4 values (ATTENTION MODEL DECODE [COMPILED])")
    args.budget_s = [*args.budget_s, *BUDGETS_S[len(args.budget_s):]]
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

    budgets = dict(zip(PARTS, args.budget_s))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    from nprf_hf import nprf_triton

    for part in args.parts:
        _deadline[0] = time.perf_counter() + budgets[part]
        try:
            results[part] = PARTS[part](sizes, device, dtype, log)
        except Exception as error:  # noqa: BLE001  (one device call: keep the other parts' numbers)
            results[f"{part}_error"] = f"{type(error).__name__}: {error}"[:2000]
            log(f"{part} failed: {results[f'{part}_error'][:500]}")
        # "auto" falls back to PyTorch when the kernels fail on the device: then these numbers are not the kernels'
        results[f"{part}_kernels_disabled"] = list(nprf_triton._disabled)
        results["total_s"] = time.perf_counter() - started
        with open(args.output, "w") as handle:  # after every part: a run cut short keeps what it measured
            json.dump(results, handle, indent=1)
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
