"""Long-sequence benchmark: NPRF RoBERTa against `RobertaModel` (SDPA and eager attention).

A RoBERTa-base-sized encoder (12 layers, hidden 768, 12 heads, feed-forward 3072), batch 1,
one sequence of n tokens. For every variant and n it measures

* forward: one inference forward pass under `torch.inference_mode()`;
* train: one training step, forward + backward of `mean(last_hidden_state ** 2)`;
* the peak memory of each.

Variants:

* ``nprf``: `NPRFRobertaModel` (`position_embedding_type="none"`, T5 relative buckets);
* ``nprf-keep`` (not run by default): the same with `attention_recompute="never"`, i.e. the attention's
  features kept from forward to backward instead of recomputed there (the default before issue 15);
* ``sdpa`` / ``eager``: `RobertaModel` with its absolute position table extended to the longest n;
* ``floor``: the same `RobertaModel` with every token attending only to itself (the identity map
  on V; Q, K and V projections stay in forward and backward). Projections, feed-forward,
  layer norms and embeddings, about 14 MFLOP per token per layer at hidden 768, cost this much
  whatever the attention: no attention can make the model faster than this row.

Attention dropout is 0 for every variant (hidden dropout keeps RoBERTa's 0.1), so SDPA runs its
fused kernel in training too.

Each (variant, n, mode) point runs in a fresh process (forked on CPU, spawned on CUDA) (``--isolation process``, the
default): a point that runs out of memory or past ``--time-cap`` is reported as such and the
sweep goes on; larger n of that variant and mode are then skipped. A point is also skipped when
its time, extrapolated from the two previous lengths, would pass the cap, or (eager) when its
n x n score matrices would not fit in ``--mem-budget-gb``.

Memory. CUDA: `torch.cuda.max_memory_allocated()` minus the memory allocated before the step.
CPU: the increase of the process's peak resident set size over its size just before the step.
On Linux the peak (VmHWM in /proc/self/status) is reset to the current RSS by writing "5" to
/proc/self/clear_refs right before the step, so the kernel itself tracks the exact peak; where
that file is missing a thread samples the RSS every millisecond (psutil). The peak is taken on
the first step in the fresh process (later steps reuse memory that glibc keeps after a free),
with the model, its weights and the inputs already in the baseline; a training step's peak
includes the gradients it allocates.

Times: the first step is a warm-up and is never the reported time (a cold step pays one-off
costs, and a cold long step next to a warm short one skews a ratio); the reported time is the
fastest of ``--repeats`` further steps, or of a single one when the warm-up took longer than
``--single-run-above`` seconds.

``--dtype`` (default float32) casts every variant's model, NPRF, SDPA, eager and floor alike, with
`model.to(dtype)`: parameters and compute in that dtype, training step included (the inputs are
token ids; the loss is reduced in float32). On CUDA in bfloat16/float16 (no mask, no attention
dropout) PyTorch's SDPA can use its flash kernel. ``--compile`` wraps each variant's model in
`torch.compile(model)` (default options). A compiled point first makes one extra call, neither
timed nor measured, that compiles (its seconds are reported as ``compile_s``); then the usual
warm-up step (the memory step) and the timed steps run the compiled model, so no compile time is
ever reported, ``--repeats 0`` included. On CPU `malloc_trim` hands the compile's freed memory
back to the kernel before the memory step, so that its RSS baseline is not inflated (the CUDA
measure counts allocated bytes and needs no trim); one-off buffers that the compile call keeps
(thread pools, kernel scratch) are in the baseline, though, so on CPU compare peak memory between
compiled and uncompiled runs with care. The JSON records dtype and compile in ``meta.settings``
and on every result row; the tables and the plot name them.

Example (the full sweep; see the README for its run time):

    python benchmarks/long_sequence.py --device cpu --threads 2 --lengths 512 1024 2048 4096 8192 16384

On a CUDA GPU in bfloat16, not compiled, then compiled:

    python benchmarks/long_sequence.py --device cuda --dtype bfloat16 --output runs/benchmarks/long_sequence_cuda_bf16
    python benchmarks/long_sequence.py --device cuda --dtype bfloat16 --compile \\
        --output runs/benchmarks/long_sequence_cuda_bf16_compiled
"""

import argparse
import math
import multiprocessing
import os
import sys
import time
import traceback

import torch

from nprf_hf.benchmarking import (DTYPE_NAMES, LONG_SEQUENCE_VARIANTS as VARIANTS, PeakMemory, machine_description,
                                  synchronize, timed, torch_dtype, write_json)
from nprf_hf.benchmarking import long_sequence_model as build_model  # noqa: F401  (kept_memory.py measures the same)
from nprf_hf.functional import ALGORITHMS
from nprf_hf.nprf_cpu_threads import release_freed_memory


DEFAULT_VARIANTS = VARIANTS[:4]
MODES = ("forward", "train")

# a scratch folder (git-ignored): a trial run must not overwrite the README's committed plot; --output publishes
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "benchmarks", "long_sequence")


def setting(args):
    """The dtype and compile state of a run, e.g. "bfloat16, compiled", for titles and labels."""
    return f"{args.dtype}, " + ("compiled" if args.compile else "not compiled")


def measure_point(variant, mode, n, args, max_length):
    """Time and peak memory of one (variant, mode, n) point in this process -> result dict."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = build_model(variant, args, max_length).to(device=device, dtype=torch_dtype(args.dtype))
    if args.compile:
        torch._dynamo.reset()  # with --isolation none, no graph or recompile budget carried over from another point
        model = torch.compile(model)
    input_ids = torch.randint(3, args.vocab_size, (1, n), device=device)

    if mode == "forward":
        model.eval()

        def step():
            with torch.inference_mode():
                model(input_ids=input_ids).last_hidden_state.sum().item()

    else:
        model.train()

        def step():
            model.zero_grad(set_to_none=True)
            hidden = model(input_ids=input_ids).last_hidden_state
            hidden.float().pow(2).mean().backward()
            synchronize(device)

    compiled = {}
    if args.compile:
        # compile outside the timed and measured steps: the warm-up below must be a compiled step
        compiled["compile_s"] = timed(step, device)[0]
        if device.type == "cpu":
            release_freed_memory()
    with PeakMemory(device) as memory:
        warmup = timed(step, device)[0]
    repeats = args.repeats if warmup <= args.single_run_above else min(args.repeats, 1)
    times = [timed(step, device)[0] for _ in range(repeats)]
    return {
        "status": "ok",
        "time_s": min(times) if times else warmup,
        "times_s": times,
        "warmup_s": warmup,
        "peak_memory_bytes": memory.increase,
        "memory_method": memory.method,
        **compiled,
    }


def _is_oom(error):
    text = str(error).lower()
    return isinstance(error, MemoryError) or "out of memory" in text or "can't allocate memory" in text


def _safe_measure(variant, mode, n, args, max_length):
    try:
        return measure_point(variant, mode, n, args, max_length)
    except Exception as error:  # reported in the results, the sweep goes on
        status = "out of memory" if _is_oom(error) else "error"
        return {"status": status, "error": f"{type(error).__name__}: {str(error)[:300]}",
                "traceback": traceback.format_exc()[-2000:]}


def _child(connection, variant, mode, n, args, max_length):
    connection.send(_safe_measure(variant, mode, n, args, max_length))
    connection.close()


def run_point(variant, mode, n, args, max_length):
    """One point, isolated in a forked process unless --isolation none."""
    if args.isolation == "none":
        return _safe_measure(variant, mode, n, args, max_length)
    # fork is quick (no re-import); CUDA cannot be used in a forked child, so spawn there.
    context = multiprocessing.get_context("spawn" if args.device.startswith("cuda") else "fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(sender, variant, mode, n, args, max_length))
    start = time.perf_counter()
    process.start()
    sender.close()
    result = None
    if receiver.poll(args.time_cap):
        try:
            result = receiver.recv()
        except EOFError:
            result = None
    elapsed = time.perf_counter() - start
    if process.is_alive() and result is None:
        process.kill()
        process.join()
        return {"status": "time cap", "error": f"no result within --time-cap {args.time_cap:g} s"}
    process.join()
    if result is None:
        signal = -process.exitcode if process.exitcode is not None and process.exitcode < 0 else None
        reason = "killed by SIGKILL (most likely out of memory)" if signal == 9 else f"exit code {process.exitcode}"
        return {"status": "out of memory" if signal == 9 else "error", "error": f"worker died after {elapsed:.0f} s: {reason}"}
    return result


def skip_reason(variant, mode, n, args, done):
    """Why (variant, mode, n) is not worth running, from the points already measured, else None."""
    previous = [r for r in done if r["variant"] == variant and r["mode"] == mode]
    failed = [r for r in previous if r["status"] not in ("ok", "skipped")]
    if failed:
        return f"{failed[0]['status']} at n={failed[0]['n']}"
    skipped = [r for r in previous if r["status"] == "skipped"]
    if skipped:
        return f"skipped at n={skipped[0]['n']}"
    if variant == "eager" and args.device == "cpu":
        matrices = 3 if mode == "forward" else 2 * args.num_layers + 3
        need = matrices * args.num_heads * n * n * torch_dtype(args.dtype).itemsize
        if need > args.mem_budget_gb * 2**30:
            return f"predicted out of memory: ~{need / 2**30:.0f} GiB of n x n scores > --mem-budget-gb {args.mem_budget_gb:g}"
    ok = [r for r in previous if r["status"] == "ok"]
    if ok:
        last = ok[-1]
        exponent = 2.0
        if len(ok) >= 2 and ok[-1]["time_s"] > 0 and ok[-2]["time_s"] > 0:
            exponent = math.log(ok[-1]["time_s"] / ok[-2]["time_s"]) / math.log(ok[-1]["n"] / ok[-2]["n"])
            exponent = min(2.0, max(1.0, exponent))
        predicted = last["warmup_s"] * (n / last["n"]) ** exponent
        if predicted > args.time_cap:
            return f"predicted {predicted:.0f} s > --time-cap {args.time_cap:g} s"
    return None


def _cell(result, key="time_s", scale=1.0, fmt="{:.3f}"):
    if result is None:
        return "-"
    if result["status"] != "ok":
        return {"out of memory": "OOM", "time cap": "cap", "skipped": "skip"}.get(result["status"], "err")
    return fmt.format(result[key] * scale)


def _ratio(a, b, key="time_s"):
    """b's time (or `key`) divided by a's."""
    if a is None or b is None or a["status"] != "ok" or b["status"] != "ok" or a[key] <= 0:
        return "-"
    return f"{b[key] / a[key]:.2f}x"


def summary_table(results, variants, lengths, run_setting=""):
    """Plain-text tables: times, ratios against NPRF, peak memory; `run_setting` (dtype, compile) in each title."""
    index = {(r["variant"], r["mode"], r["n"]): r for r in results}
    lines = []
    for mode in MODES:
        title = "forward (inference)" if mode == "forward" else "training step (forward + backward)"
        header = ["n"] + [f"{v} s" for v in variants]
        if "nprf" in variants:
            header += [f"{v}/nprf" for v in variants if v in ("sdpa", "eager")]
            if "floor" in variants:
                header.append("nprf/floor")
        keep = "nprf" in variants and "nprf-keep" in variants
        if keep:
            header.append("nprf/nprf-keep")
        header += [f"{v} MiB" for v in variants]
        if "nprf" in variants:
            header += [f"nprf/{v} MiB" for v in variants if v in ("sdpa", "nprf-keep")]
        rows = []
        for n in lengths:
            get = lambda v: index.get((v, mode, n))  # noqa: E731
            row = [str(n)] + [_cell(get(v)) for v in variants]
            if "nprf" in variants:
                row += [_ratio(get("nprf"), get(v)) for v in variants if v in ("sdpa", "eager")]
                if "floor" in variants:
                    row.append(_ratio(get("floor"), get("nprf")))
            if keep:
                row.append(_ratio(get("nprf-keep"), get("nprf")))
            row += [_cell(get(v), "peak_memory_bytes", 2**-20, "{:.0f}") for v in variants]
            if "nprf" in variants:
                row += [_ratio(get(v), get("nprf"), "peak_memory_bytes") for v in variants if v in ("sdpa", "nprf-keep")]
            rows.append(row)
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        lines.append(f"== {title}{', ' + run_setting if run_setting else ''} ==")
        for row in [header] + rows:
            lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
        lines.append("")
    notes = [r for r in results if r["status"] != "ok"]
    for r in notes:
        lines.append(f"{r['variant']} {r['mode']} n={r['n']}: {r['status']} ({r.get('error', '')})")
    return "\n".join(lines)


COLORS = {"nprf": "tab:red", "sdpa": "tab:blue", "eager": "tab:green", "floor": "tab:gray", "nprf-keep": "tab:orange"}
LABELS = {"nprf": "NPRF + RPE", "sdpa": "RoBERTa SDPA", "eager": "RoBERTa eager", "floor": "floor (no attention)",
          "nprf-keep": "NPRF, features kept for backward"}


def plot(results, meta, path):
    """2 x 2 log-log panels: forward / training-step time and peak memory against n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    panels = [("forward", "time_s", "forward time (s)"), ("train", "time_s", "training step time (s)"),
              ("forward", "peak_memory_bytes", "forward peak memory (MiB)"),
              ("train", "peak_memory_bytes", "training step peak memory (MiB)")]
    for axis, (mode, key, ylabel) in zip(axes.flat, panels):
        scale = 2**-20 if key == "peak_memory_bytes" else 1.0
        for variant in meta["variants"]:
            points = sorted((r for r in results if r["variant"] == variant and r["mode"] == mode), key=lambda r: r["n"])
            ok = [r for r in points if r["status"] == "ok"]
            if not ok:
                continue
            style = "--" if variant == "floor" else "-"
            axis.plot([r["n"] for r in ok], [max(r[key] * scale, 1e-3) for r in ok], style, marker="o",
                      color=COLORS[variant], label=LABELS[variant])
            failed = [r for r in points if r["status"] != "ok"]
            if failed:
                first = failed[0]
                status = {"out of memory": "OOM", "time cap": "time cap"}.get(first["status"], first["status"])
                if first["status"] == "skipped":
                    status = "skipped (over --mem-budget-gb)" if "memory" in first.get("error", "") else "skipped"
                axis.annotate(f"{status} at {first['n']}", (ok[-1]["n"], ok[-1][key] * scale), fontsize=8,
                              color=COLORS[variant], xytext=(4, 6), textcoords="offset points")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length n")
        axis.set_ylabel(ylabel)
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # a panel with no finished point has nothing to label
            axis.legend(fontsize=8)
    machine = meta["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, {meta['args']['threads']} threads"
    run_setting = meta.get("settings", {}).get("label", "float32, not compiled")
    figure.suptitle(f"RoBERTa-base-sized encoder, {meta['args']['num_layers']} layer(s), batch 1, "
                    f"{run_setting} ({where})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:0, ...) (default: %(default)s)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384],
                        help="sequence lengths n, one sequence of n tokens per step (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=12,
                        help="encoder layers (times and ratios hold per layer) (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS,
                        help="models to time; floor = the same RoBERTa with attention replaced by the identity; "
                        "nprf-keep = NPRF with attention_recompute='never' (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="forward: inference forward pass; train: forward + backward (default: both)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed steps after the warm-up; the fastest is reported (0: the warm-up is) "
                        "(default: %(default)s)")
    parser.add_argument("--single-run-above", type=float, default=20.0,
                        help="seconds: after a warm-up step longer than this, time one step only (not --repeats) "
                        "(default: %(default)s)")
    parser.add_argument("--time-cap", type=float, default=900.0,
                        help="seconds per point (warm-up + repeats) (default: %(default)s)")
    parser.add_argument("--mem-budget-gb", type=float, default=None,
                        help="eager points predicted to need more are skipped (default: 80%% of available RAM)")
    parser.add_argument("--isolation", default="process", choices=("process", "none"),
                        help="process: each point in a forked process (clean memory, survives OOM); none: in-process "
                        "(default: %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=768, help="model width (default: %(default)s, RoBERTa-base)")
    parser.add_argument("--num-heads", type=int, default=12, help="attention heads (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=50265, help="embedding rows (default: %(default)s)")
    parser.add_argument("--num-features", type=int, default=None,
                        help="NPRF random features m (default: the config's, 64)")
    parser.add_argument("--algorithm", default=None, choices=ALGORITHMS,
                        help="NPRF attention_algorithm (default: the config's, auto)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help="path stem: writes STEM.json and STEM.png (default: %(default)s, a git-ignored scratch "
                        "folder; pass benchmarks/plots/long_sequence to update the README's plot)")
    parser.add_argument("--no-plot", action="store_true", help="write the JSON only")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="every variant's parameters and compute (model.to(dtype)); bfloat16 on CUDA lets SDPA "
                        "use its flash kernel (default: %(default)s)")
    parser.add_argument("--compile", action="store_true",
                        help="wrap each variant's model in torch.compile(model); an extra untimed call per point "
                        "compiles (default: not compiled)")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.lengths):
        parser.error("--lengths must be positive")
    if args.num_layers < 1 or args.threads < 1 or args.repeats < 0:
        parser.error("--num-layers and --threads must be >= 1, --repeats >= 0")
    if args.hidden_size % args.num_heads:
        parser.error(f"--hidden-size {args.hidden_size} is not a multiple of --num-heads {args.num_heads}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cpu or cuda[:i], got {args.device!r}")
    if args.mem_budget_gb is None:
        try:
            import psutil

            args.mem_budget_gb = 0.8 * psutil.virtual_memory().available / 2**30
        except ImportError:
            args.mem_budget_gb = 16.0
    args.lengths = sorted(set(args.lengths))
    return args


def main(argv=None):
    args = parse_args(argv)
    from tqdm import tqdm

    started = time.perf_counter()
    max_length = max(args.lengths)
    points = [(n, variant, mode) for n in args.lengths for variant in args.variants for mode in args.modes]
    results = []
    bar = tqdm(points, desc=f"long-sequence sweep ({setting(args)})", unit="point")
    for n, variant, mode in bar:
        bar.set_postfix_str(f"{variant} {mode} n={n}")
        reason = skip_reason(variant, mode, n, args, results)
        if reason is not None:
            result = {"status": "skipped", "error": reason}
        else:
            result = run_point(variant, mode, n, args, max_length)
        result.update(variant=variant, mode=mode, n=n, dtype=args.dtype, compiled=args.compile)
        results.append(result)
        if result["status"] != "ok":
            tqdm.write(f"{variant} {mode} n={n}: {result['status']} ({result.get('error', '')})")
    meta = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (sys.argv[1:] if argv is None else list(argv))),
        "args": {k: v for k, v in vars(args).items()},
        "variants": args.variants,
        "settings": {"dtype": args.dtype, "compiled": args.compile, "label": setting(args)},
        "machine": machine_description(args.device, args.threads),
        "memory_method": next((r["memory_method"] for r in results if r.get("memory_method")), None),
        "total_runtime_s": round(time.perf_counter() - started, 1),
    }
    table = summary_table(results, args.variants, args.lengths, setting(args))
    print(table)
    print(f"total runtime {meta['total_runtime_s']:.0f} s; command: {meta['command']}")
    write_json(args.output + ".json", {"meta": meta, "results": results, "table": table})
    if not args.no_plot:
        plot(results, meta, args.output + ".png")
    print(f"wrote {args.output}.json" + ("" if args.no_plot else f" and {args.output}.png"))
    return results


if __name__ == "__main__":
    main()
