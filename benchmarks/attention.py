"""Attention-kernel benchmark: every exact NPRF algorithm next to softmax SDPA, in one run.

For B=1, H=12, d=64, m=64 and each length n: median forward and forward+backward time, peak
memory, plus two floors: a bare rfft+irfft of the FFT path's own [B*H, m, d+1, n] channel tensor
and the machine's fp32 matmul FLOP rate. Prints a table and writes JSON.

    python benchmarks/attention.py --threads 2 --output benchmarks/results/attention_cpu.json
    python benchmarks/attention.py --device cuda --dtype bfloat16 [--compile] --output ...

On CUDA in bf16 or fp16, SDPA runs its flash kernel (no mask, no dropout here). `--compile` wraps
SDPA and `nprf_attention` alike in `torch.compile`; the untimed warm-up call of each point absorbs
the compile.

Times are taken first, with the allocator as users have it. Peak memory is measured afterwards, in
a child process (one call per point): on CPU the peak resident set size (VmHWM, reset through
/proc/self/clear_refs) above the resident size before the call, with glibc told from the start to
mmap every block over 128 KiB (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set
at once. That setting is kept out of the timings: it turns every large allocation into fresh pages,
which slows allocation-heavy code several-fold. On CUDA it is torch.cuda.max_memory_allocated above
the memory allocated before the call.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

from nprf_hf import functional as Fn
from nprf_hf import nprf_banded, nprf_fft
from nprf_hf.benchmarking import (DTYPE_NAMES, add_busy_cores_argument, attention_inputs, busy_over_quiet,
                                  competing_load, device_name, median_time, parse_busy_cores, peak_memory, torch_dtype,
                                  write_json)
from nprf_hf.options import RECOMPUTE_MODES


ALGORITHMS = ("dense", "fft", "banded", "auto")


def matmul_gflops(device, size=2048, dtype=torch.float32):
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = median_time(lambda: a @ b, device, min_time=1.0)
    return 2 * size**3 / seconds / 1e9


def banded_flops(batch, heads, n, d, m, band_width=91):
    """Multiply-adds x 2 of the banded algorithm's matmuls and feature maps (forward)."""
    reach, chunk = nprf_banded.banded_chunking(band_width)
    window = (2 * reach + 1) * chunk
    chunks = -(-n // chunk)
    e = d + 1
    per_chunk = 2 * chunk * (window * m + window * e + 2 * m * e + 2 * m * d)
    return batch * heads * chunks * per_chunk


def nprf_step(algorithm, inputs, n, backward, recompute=None, attention=Fn.nprf_attention):
    q, k, v, table, projection = inputs
    width = Fn.rpe_band_width()

    def run():
        bias = Fn.relative_position_bias(table, n)
        out = attention(q, k, v, bias, projection, algorithm=algorithm, band_width=width, recompute=recompute)
        if backward:
            out.sum().backward()
        return out

    return run


def sdpa_step(inputs, backward, attention=F.scaled_dot_product_attention):
    q, k, v = inputs[:3]

    def run():
        out = attention(q, k, v)
        if backward:
            out.sum().backward()
        return out

    return run


def fft_floor_step(batch, heads, n, d, m, device):
    length = nprf_fft.fft_length(2 * n - 1)
    channels = F.pad(torch.randn(batch * heads, m, d + 1, n, device=device), (0, length - n))  # as the fft path pads
    return lambda: torch.fft.irfft(torch.fft.rfft(channels), n=length)


def fits(name, batch, heads, n, backward, budget_bytes):
    """Skip the quadratic dense path where its n x n tensors would not fit."""
    if name != "dense":
        return True
    copies = 8 if backward else 4
    return copies * 4 * batch * heads * n * n <= budget_bytes


# a scratch folder (git-ignored): a trial run must not overwrite committed results; --output publishes
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "benchmarks", "attention.json")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192, 16384],
                        help="sequence lengths n (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads H (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=64, help="head size d (default: %(default)s)")
    parser.add_argument("--features", type=int, default=64, help="NPRF random features m (default: %(default)s)")
    parser.add_argument("--recompute", default="auto", choices=list(RECOMPUTE_MODES),
                        help="nprf_attention(recompute=...) in fwd+bwd: auto recomputes the banded / fft features and "
                        "products in backward instead of keeping them, never keeps them (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:0, ...) (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="q, k, v, the RPE table and the projection in this dtype (default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="torch.compile SDPA and nprf_attention (default: eager)")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS,
                        help="NPRF algorithms to time (default: all; the speed-up column needs auto)")
    parser.add_argument("--matmul-size", type=int, default=2048,
                        help="side of the square matmul whose rate is the floor's reference (default: %(default)s)")
    parser.add_argument("--skip-memory", action="store_true", help="times only (no peak-memory pass in a child process)")
    parser.add_argument("--memory-budget-gb", type=float, default=12.0,
                        help="skip dense beyond this memory estimate (default: %(default)s)")
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="seconds of repeats per point (default: %(default)s)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help="JSON file (default: %(default)s, a git-ignored scratch folder; pass "
                        "benchmarks/results/attention_cpu.json to update the README's numbers)")
    add_busy_cores_argument(parser, when="after the quiet timings")
    parser.add_argument("--memory-pass", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    parse_busy_cores(parser, args)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch_dtype(args.dtype)
    algorithms = tuple(a for a in ALGORITHMS if a in args.algorithms)
    b, h, d, m = args.batch, args.heads, args.head_dim, args.features
    sdpa, nprf = F.scaled_dot_product_attention, Fn.nprf_attention
    if args.compile:
        # one graph per (length, algorithm, grad mode): far more than dynamo's default cache, past which it
        # would silently fall back to eager and the "compiled" column would time eager code
        torch._dynamo.config.cache_size_limit = 1024
        sdpa, nprf = torch.compile(sdpa), torch.compile(nprf)
    machine = {
        "device": device_name(device),
        "threads": args.threads,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "compiled": args.compile,
        "matmul_gflops": None if args.memory_pass else matmul_gflops(device, args.matmul_size, dtype),
    }
    if not args.memory_pass:
        print(f"# B={b} H={h} d={d} m={m} device={device} dtype={args.dtype} compiled={args.compile} "
              f"threads={args.threads} torch={torch.__version__}")
        print(f"# {args.dtype} matmul: {machine['matmul_gflops']:.1f} GFLOP/s")
        print(f"{'n':>6} {'pass':>8} {'sdpa':>9} " + " ".join(f"{a:>9}" for a in algorithms) + f" {'fftfloor':>9} {'sdpa/auto':>9}")

    def points(n, backward):
        """(inputs, {name: step}) for one row; the grad context must be entered by the caller."""
        inputs = attention_inputs(b, h, n, d, m, device, backward, dtype)
        steps = {"sdpa": sdpa_step(inputs, backward, sdpa)}
        for name in algorithms:
            if fits(name, b, h, n, backward, args.memory_budget_gb * 2**30):
                steps[name] = nprf_step(name, inputs, n, backward, RECOMPUTE_MODES[args.recompute], nprf)
        if not backward:
            steps["fft_floor"] = fft_floor_step(b, h, n, d, m, device)
        return inputs, steps

    if args.memory_pass:  # the child: peak memory of one call per point, written as a list of rows
        peaks = []
        for n in args.lengths:
            for backward in (False, True):
                peak = {}
                with torch.enable_grad() if backward else torch.inference_mode():
                    inputs, steps = points(n, backward)
                    for name, step in steps.items():
                        if name != "fft_floor":
                            peak[name] = peak_memory(step, device)
                            for t in inputs:
                                t.grad = None
                peaks.append(peak)
        write_json(args.output, peaks, indent=None)
        return

    rows = []
    for n in args.lengths:
        for backward in (False, True):
            row = {"n": n, "pass": "fwd+bwd" if backward else "fwd", "seconds": {}, "peak_bytes": {}}
            with torch.enable_grad() if backward else torch.inference_mode():
                inputs, steps = points(n, backward)
                for name, step in steps.items():
                    row["seconds"][name] = median_time(step, device, min_time=args.min_time)
                    for t in inputs:
                        t.grad = None
            if not backward and "banded" in row["seconds"]:
                row["banded_gflops"] = banded_flops(b, h, n, d, m) / row["seconds"]["banded"] / 1e9
            seconds = row["seconds"]
            cells = " ".join(f"{seconds[a]:9.4f}" if a in seconds else f"{'skip':>9}" for a in algorithms)
            floor = f"{seconds['fft_floor']:9.4f}" if "fft_floor" in seconds else f"{'':>9}"
            speedup = f"{seconds['sdpa'] / seconds['auto']:9.2f}" if "auto" in seconds else f"{'':>9}"
            print(f"{n:>6} {row['pass']:>8} {seconds['sdpa']:9.4f} {cells} {floor} {speedup}", flush=True)
            rows.append(row)

    if args.busy_cores:  # the same points again, busy: how much each method loses to a competing process
        print(f"# busy: one spinning process on core(s) {args.busy_cores}; busy / quiet time per method")
        with competing_load(args.busy_cores):
            for row in rows:
                row["busy_seconds"] = {}
                with torch.enable_grad() if row["pass"] == "fwd+bwd" else torch.inference_mode():
                    inputs, steps = points(row["n"], row["pass"] == "fwd+bwd")
                    for name, step in steps.items():
                        if name != "fft_floor":
                            row["busy_seconds"][name] = median_time(step, device, min_time=args.min_time)
                        for t in inputs:
                            t.grad = None
                slowdown = busy_over_quiet(row["seconds"], row["busy_seconds"])
                row["busy_over_quiet"] = slowdown
                cells = " ".join(f"{slowdown[a]:9.2f}" if a in slowdown else f"{'skip':>9}" for a in algorithms)
                print(f"{row['n']:>6} {row['pass']:>8} {slowdown['sdpa']:9.2f} {cells}", flush=True)
    machine["memory_method"] = (
        "VmHWM above the resident size before the call, in a child process with MALLOC_MMAP_THRESHOLD_=131072"
        if device.type == "cpu" else "torch.cuda.max_memory_allocated above the allocation before the call"
    )
    if not args.skip_memory:
        with tempfile.TemporaryDirectory() as folder:
            peaks_file = os.path.join(folder, "peaks.json")
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
            command = [sys.executable, os.path.abspath(__file__), "--memory-pass"] + list(argv if argv is not None else sys.argv[1:])
            subprocess.run(command + ["--output", peaks_file], env=env, check=True)
            with open(peaks_file) as f:
                peaks = json.load(f)
        print(f"# peak memory, MiB, one call each ({machine['memory_method']})")
        print(f"{'n':>6} {'pass':>8} {'sdpa':>9} " + " ".join(f"{a:>9}" for a in algorithms))
        for row, peak in zip(rows, peaks):
            row["peak_bytes"] = peak
            cells = " ".join(f"{peak[a] / 2**20:9.0f}" if a in peak else f"{'skip':>9}" for a in algorithms)
            print(f"{row['n']:>6} {row['pass']:>8} {peak['sdpa'] / 2**20:9.0f} {cells}", flush=True)
    summary = summarize(rows, machine)
    for line in summary["lines"]:
        print(line)
    write_json(args.output, {"config": vars(args), "machine": machine, "rows": rows, "summary": summary})
    print(f"wrote {args.output}")


def summarize(rows, machine):
    """The ratios the core issue targets, computed from this run."""
    table = {(r["n"], r["pass"]): r for r in rows}
    lines, ratios = [], {}

    def add(name, value, text):
        ratios[name] = value
        lines.append(f"{text}: {value:.2f}")

    lengths = sorted({r["n"] for r in rows})
    for n in lengths:
        for kind in ("fwd", "fwd+bwd"):
            seconds = table[(n, kind)]["seconds"]
            if "auto" not in seconds:
                continue
            exact = [seconds[a] for a in ("dense", "fft", "banded") if a in seconds]
            if exact:
                add(f"auto_over_fastest_{kind}_{n}", seconds["auto"] / min(exact), f"n={n} {kind}: auto / fastest exact")
            add(f"sdpa_over_auto_{kind}_{n}", seconds["sdpa"] / seconds["auto"], f"n={n} {kind}: sdpa / auto (speed-up)")
        forward = table[(n, "fwd")]
        if "banded_gflops" in forward:
            add(f"banded_matmul_fraction_{n}", forward["banded_gflops"] / machine["matmul_gflops"], f"n={n}: banded GFLOP/s / matmul GFLOP/s")
        if "fft" in forward["seconds"]:
            add(f"fft_over_floor_{n}", forward["seconds"]["fft"] / forward["seconds"]["fft_floor"], f"n={n}: fft / bare rfft+irfft")
        for kind in ("fwd", "fwd+bwd"):
            slowdown = table[(n, kind)].get("busy_over_quiet", {})
            if "auto" in slowdown:
                # the target of issue 45: NPRF's busy / quiet no worse than 1.2x SDPA's own
                add(f"busy_slowdown_auto_over_sdpa_{kind}_{n}", slowdown["auto"] / slowdown["sdpa"],
                    f"n={n} {kind}: (busy / quiet of auto) / (busy / quiet of sdpa)")
    for a, b in zip(lengths, lengths[1:]):
        if b == 2 * a and "auto" in table[(b, "fwd")]["seconds"]:
            add(f"auto_time_scaling_{b}", table[(b, "fwd")]["seconds"]["auto"] / table[(a, "fwd")]["seconds"]["auto"], f"auto fwd time({b}) / time({a})")
        if b == 2 * a and "auto" in table[(b, "fwd")]["peak_bytes"]:
            add(f"auto_memory_scaling_{b}", table[(b, "fwd")]["peak_bytes"]["auto"] / max(table[(a, "fwd")]["peak_bytes"]["auto"], 1), f"auto fwd peak memory({b}) / memory({a})")
    return {"ratios": ratios, "lines": lines}


if __name__ == "__main__":
    main()
