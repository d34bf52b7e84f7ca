"""What the exact near field (attention_variant "nprf_near") costs against NPRF, side by side in one run: attention
alone, forward and forward + backward, at long lengths (the banded algorithm, as `auto` runs it there) and at GLUE
lengths (`auto`: the dense algorithm), B x n per point, H = 12, d = 64, m = 64, the T5 band (W = 91).

    python benchmarks/near_field_cost.py --threads 2 --output benchmarks/results/near_field_cost_cpu.json
"""

import argparse

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", default=["32x128", "8x512", "1x4096", "1x16384"], help="BxN")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=1.0)
    parser.add_argument("--output", default=None, help="JSON path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'B x n':>9} {'pass':>8} " + " ".join(f"{v:>10}" for v in VARIANTS) + f" {'near/nprf':>10}")
    for point in args.points:
        batch, n = (int(x) for x in point.split("x"))
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
            print(f"{point:>9} {row['pass']:>8} " + " ".join(f"{seconds[v]:10.4f}" for v in VARIANTS)
                  + f" {row['ratio']:10.2f}", flush=True)
    if args.output:
        write_json(args.output, {"threads": args.threads, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
