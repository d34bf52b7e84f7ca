"""What the exact near field (attention_variant "nprf_near") costs against NPRF, side by side in one run: attention
alone, forward and forward + backward, at long lengths (the banded algorithm, as `auto` runs it there) and at GLUE
lengths (`auto`: the dense algorithm), B x n per point, H = 12, d = 64, m = 64, the T5 band (W = 91).

    python benchmarks/near_field_cost.py --threads 2 --output benchmarks/results/near_field_cost_cpu.json

`--against DIR` (another checkout of this repository, e.g. `git worktree add /tmp/base main`) times both trees:
one persistent process per tree (`benchmarking.TreeWorkers`: this script with that tree's package), their calls
alternated round by round, best of `--rounds` medians.
"""

import argparse
import os
import statistics
import sys
import time

import torch

from nprf_hf import functional as Fn
from nprf_hf.benchmarking import attention_inputs, median_time, write_json

VARIANTS = ("nprf", "nprf_near")


def step(variant, inputs, n, backward):
    q, k, v, table, projection = inputs
    width = Fn.rpe_band_width()

    def run():
        bias = Fn.relative_position_bias(table, n)
        out = Fn.nprf_attention(q, k, v, bias, projection, band_width=width, variant=variant)
        if backward:
            out.sum().backward()
        return out

    return run


def _points(points):
    return [tuple(int(x) for x in point.split("x")) for point in points]


def _one_tree(args):
    rows = []
    print(f"{'B x n':>9} {'pass':>8} " + " ".join(f"{v:>10}" for v in VARIANTS) + f" {'near/nprf':>10}")
    for batch, n in _points(args.points):
        for backward in (False, True):
            seconds = {}
            with torch.enable_grad() if backward else torch.inference_mode():
                inputs = attention_inputs(batch, 12, n, 64, 64, torch.device("cpu"), backward)
                for _ in range(2):  # interleaved twice: each variant's best of its two medians
                    for variant in VARIANTS:
                        t = median_time(step(variant, inputs, n, backward), min_time=args.min_time)
                        seconds[variant] = min(seconds.get(variant, t), t)
                        for x in inputs:
                            x.grad = None
            row = {"batch": batch, "n": n, "pass": "fwd+bwd" if backward else "fwd", "seconds": seconds,
                   "ratio": seconds["nprf_near"] / seconds["nprf"]}
            rows.append(row)
            print(f"{batch:>3}x{n:<5} {row['pass']:>8} " + " ".join(f"{seconds[v]:10.4f}" for v in VARIANTS)
                  + f" {row['ratio']:10.2f}", flush=True)
    return {"threads": args.threads, "torch": torch.__version__, "rows": rows}


def _worker():
    """Reads `B n pass variant repeats` lines, answers each with the median seconds of that many calls."""
    inputs = {}
    for line in sys.stdin:
        batch, n, mode, variant, repeats = line.split()
        batch, n, repeats, backward = int(batch), int(n), int(repeats), mode != "fwd"
        with torch.enable_grad() if backward else torch.inference_mode():
            key = (batch, n, backward)
            if key not in inputs:
                inputs = {key: attention_inputs(batch, 12, n, 64, 64, torch.device("cpu"), backward)}
            run, times = step(variant, inputs[key], n, backward), []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
                for x in inputs[key]:
                    x.grad = None
        print(statistics.median(times), flush=True)


def _two_trees(args):
    from nprf_hf.benchmarking import TreeWorkers  # here: the workers import the other tree's package, maybe older

    this = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": this, "against": os.path.abspath(args.against)}
    rows = []
    with TreeWorkers(trees, os.path.abspath(__file__), ["--worker", "--threads", args.threads]) as workers:
        ask = workers.ask
        for batch, n in _points(args.points):
            for mode in ("fwd", "fwd+bwd"):
                for name in trees:  # warm-up, and the repeats that fill --min-time
                    for variant in VARIANTS:
                        ask(name, batch, n, mode, variant, 2)
                repeats = max(3, int(args.min_time / ask("this", batch, n, mode, "nprf", 1)))
                best = {}
                for _ in range(args.rounds):
                    for name in trees:
                        for variant in VARIANTS:
                            t = ask(name, batch, n, mode, variant, repeats)
                            best[name, variant] = min(best.get((name, variant), t), t)
                row = {"batch": batch, "n": n, "pass": mode, "seconds": {f"{a}/{b}": t for (a, b), t in best.items()},
                       "ratio": best["this", "nprf_near"] / best["this", "nprf"],
                       "ratio_against": best["against", "nprf_near"] / best["against", "nprf"]}
                rows.append(row)
                print(f"{batch:>3}x{n:<5} {mode:>8} this: nprf {best['this', 'nprf'] * 1e3:8.1f} near "
                      f"{best['this', 'nprf_near'] * 1e3:8.1f} ms ({row['ratio']:.2f}) | against: nprf "
                      f"{best['against', 'nprf'] * 1e3:8.1f} near {best['against', 'nprf_near'] * 1e3:8.1f} ms "
                      f"({row['ratio_against']:.2f})", flush=True)
    return {"threads": args.threads, "torch": torch.__version__, "against": trees["against"], "rows": rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", default=["32x128", "8x512", "1x4096", "1x16384"], help="BxN")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--against", default=None, help="another checkout: both trees timed, alternated")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: rounds of alternated medians")
    parser.add_argument("--output", default=None, help="JSON path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        return _worker()
    if args.against is not None and not os.path.isfile(os.path.join(args.against, "nprf_hf", "functional.py")):
        parser.error(f"--against {args.against!r} is not a checkout of this repository "
                     "(it has no nprf_hf/functional.py)")
    result = _one_tree(args) if args.against is None else _two_trees(args)
    if args.output:
        write_json(args.output, result)


if __name__ == "__main__":
    main()
