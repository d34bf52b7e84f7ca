"""How well positive random features estimate softmax attention, and why RPE keeps it sharp.

Part 1, the paper's Figure 1(b). Queries and keys are random unit vectors scaled by a factor a
(so |q| = |k| = a and the exact attention is softmax over q.k = a^2 cos). For feature counts m
the script compares each row of the exact softmax attention with its PRF estimate
phi(q).phi(k_j) / sum_j phi(q).phi(k_j), both iid Gaussian ("prf") and orthogonal ("orf")
projections, and reports the total-variation distance 0.5 * sum_j |A_ij - A^_ij| averaged over
rows and over random draws of data and projection. The variance of the estimate grows like
exp(|q|^2 + |k|^2), so the error is small at a <= 1 (what NPRF's normalization guarantees) and
grows fast with a; at a fixed a it falls with m.

Part 2, sharpness. With |q| = |k| = 1 the logits lie in [-1, 1], so softmax attention over n keys
can put at most e^2 / (e^2 + n - 1) on one key (0.055 at n = 128): normalized attention alone is
nearly uniform. A relative position bias b_r adds exp(b_r) to the weights, and NPRF + RPE can be
as sharp as needed. The script gives the bias a peak of height beta at r = -1 (each token should
look at the previous one) and reports, for NPRF + RPE (`nprf_attention_weights`) and the exact
normalized softmax with the same bias, the mean weight on the previous token, the mean maximum
weight and the mean row entropy.

All feature maps come from `nprf_hf.functional` (draw_projection, positive_random_features,
nprf_attention_weights). Computed in float64; runs in well under a minute on 2 CPU cores:

    python benchmarks/approximation.py
"""

import argparse
import math
import os
import sys
import time

import torch

from nprf_hf.benchmarking import write_json
from nprf_hf.functional import draw_projection, nprf_attention_weights, positive_random_features


# a scratch folder (git-ignored): a trial run must not overwrite the README's committed plot; --output publishes
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "benchmarks", "approximation")
DTYPE = torch.float64


def random_unit(shape, generator):
    """Gaussian vectors normalized to unit length: [..., d]."""
    x = torch.randn(shape, generator=generator, dtype=DTYPE)
    return x / x.norm(dim=-1, keepdim=True)


def total_variation(p, q):
    """Mean over rows of 0.5 * sum_j |p_ij - q_ij|; p, q [..., n, n] with rows summing to 1."""
    return 0.5 * (p - q).abs().sum(-1).mean().item()


def row_entropy(p):
    """Mean over rows of -sum_j p_ij log p_ij (nats)."""
    return -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1).mean().item()


def approximation_error(scale, num_features, kind, args, generator):
    """Total-variation error of the PRF estimate of softmax attention, averaged over draws -> (mean, std)."""
    errors = []
    for _ in range(args.draws):
        query = scale * random_unit((args.num_tokens, args.head_dim), generator)
        key = scale * random_unit((args.num_tokens, args.head_dim), generator)
        exact = torch.softmax(query @ key.t(), dim=-1)
        projection = draw_projection(num_features, args.head_dim, kind=kind, generator=generator, dtype=DTYPE)
        kernel = positive_random_features(query, projection) @ positive_random_features(key, projection).t()
        estimate = kernel / kernel.sum(-1, keepdim=True)
        errors.append(total_variation(exact, estimate))
    errors = torch.tensor(errors, dtype=DTYPE)
    return errors.mean().item(), (errors.std().item() if len(errors) > 1 else 0.0)


def previous_token_bias(beta, n, num_heads):
    """rpe_bias [H, 2n-1] that is beta at r = j - i = -1 and 0 elsewhere."""
    bias = torch.zeros(num_heads, 2 * n - 1, dtype=DTYPE)
    bias[:, n - 2] = beta
    return bias


def toeplitz_bias(bias, n):
    """[H, 2n-1] -> [H, n, n] with entry (i, j) = b_{j-i}."""
    i = torch.arange(n)
    return bias[:, (i[None, :] - i[:, None]) + n - 1]


def sharpness(beta, args, generator):
    """Sharpness of NPRF + RPE and of exact normalized softmax + RPE with a previous-token peak beta."""
    n, heads = args.num_tokens, args.num_heads
    stats = {"nprf": [], "exact": []}
    for _ in range(args.draws):
        query = torch.randn(1, heads, n, args.head_dim, generator=generator, dtype=DTYPE)
        key = torch.randn(1, heads, n, args.head_dim, generator=generator, dtype=DTYPE)
        bias = previous_token_bias(beta, n, heads)
        projection = draw_projection(args.sharpness_features, args.head_dim, kind="orf", num_heads=heads,
                                     generator=generator, dtype=DTYPE)
        weights = {"nprf": nprf_attention_weights(query, key, bias, projection)[0]}
        unit_q = query[0] / query[0].norm(dim=-1, keepdim=True)
        unit_k = key[0] / key[0].norm(dim=-1, keepdim=True)
        weights["exact"] = torch.softmax(unit_q @ unit_k.transpose(-1, -2) + toeplitz_bias(bias, n), dim=-1)
        for name, w in weights.items():
            stats[name].append({
                "previous_token_weight": w[:, 1:, :].diagonal(offset=0, dim1=-2, dim2=-1).mean().item(),
                "max_weight": w.amax(-1).mean().item(),
                "entropy": row_entropy(w),
            })
    return {name: {key: sum(s[key] for s in values) / len(values) for key in values[0]} for name, values in stats.items()}


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = result["args"]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    axis = axes[0]
    colors = plt.cm.viridis([0.9 * i / max(1, len(args["scales"]) - 1) for i in range(len(args["scales"]))])
    for color, scale in zip(colors, args["scales"]):
        for kind, style in (("orf", "-"), ("prf", "--")):
            rows = [r for r in result["approximation"] if r["scale"] == scale and r["kind"] == kind]
            axis.plot([r["num_features"] for r in rows], [r["tv_error"] for r in rows], style, marker=".",
                      color=color, label=f"a = {scale:g} ({kind.upper()})")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("random features m")
    axis.set_ylabel("total-variation error of attention rows")
    axis.set_title(f"(a) PRF estimate of softmax, |q| = |k| = a (d={args['head_dim']}, n={args['num_tokens']})",
                   fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, ncol=2)

    betas = [r["beta"] for r in result["sharpness"]]
    n = args["num_tokens"]
    for axis, key, ylabel, title in (
        (axes[1], "previous_token_weight", "mean weight on the previous token", "(b) RPE makes normalized attention sharp"),
        (axes[2], "entropy", "mean row entropy (nats)", "(c) attention entropy"),
    ):
        axis.plot(betas, [r["nprf"][key] for r in result["sharpness"]], "o-", color="tab:red",
                  label=f"NPRF + RPE (m={args['sharpness_features']})")
        axis.plot(betas, [r["exact"][key] for r in result["sharpness"]], "s--", color="tab:blue",
                  label="exact softmax(q̂·k̂ + b)")
        if key == "previous_token_weight":
            axis.axhline(result["max_weight_bound_without_rpe"], color="gray", linestyle=":",
                         label="max possible without RPE: e²/(e²+n−1)")
            axis.set_ylim(0, 1.02)
        else:
            axis.axhline(math.log(n), color="gray", linestyle=":", label="uniform: log n")
        axis.set_xlabel("bias peak β at r = −1")
        axis.set_ylabel(ylabel)
        axis.set_title(title, fontsize=10)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0], help="norm a of q and k")
    parser.add_argument("--num-features", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--kinds", nargs="+", default=["orf", "prf"], choices=["orf", "prf"])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=128, help="n: queries and keys per draw")
    parser.add_argument("--draws", type=int, default=20, help="random draws (data and projection) averaged")
    parser.add_argument("--betas", type=float, nargs="+", default=[0, 1, 2, 3, 4, 5, 6, 8, 10])
    parser.add_argument("--num-heads", type=int, default=4, help="heads in the sharpness part")
    parser.add_argument("--sharpness-features", type=int, default=64, help="m in the sharpness part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help="path stem: writes STEM.json and STEM.png (default: a git-ignored scratch folder; pass "
                        "benchmarks/plots/approximation to update the README's plot)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if min(args.num_features) < 1 or args.head_dim < 1 or args.num_tokens < 2 or args.draws < 1:
        parser.error("--num-features, --head-dim, --draws must be >= 1 and --num-tokens >= 2")
    if min(args.scales) <= 0:
        parser.error("--scales must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    approximation = []
    for scale in args.scales:
        for kind in args.kinds:
            for m in args.num_features:
                mean, std = approximation_error(scale, m, kind, args, generator)
                approximation.append({"scale": scale, "kind": kind, "num_features": m, "tv_error": mean, "tv_error_std": std})
    sharp = [{"beta": beta, **sharpness(beta, args, generator)} for beta in args.betas]
    n = args.num_tokens
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (sys.argv[1:] if argv is None else list(argv))),
        "args": vars(args),
        "metric": "total variation 0.5 * sum_j |softmax - PRF estimate|, mean over rows and draws",
        "approximation": approximation,
        "max_weight_bound_without_rpe": math.e**2 / (math.e**2 + n - 1),
        "sharpness": sharp,
        "runtime_s": round(time.perf_counter() - started, 1),
    }

    kinds = args.kinds
    print(f"total-variation error (d={args.head_dim}, n={n}, {args.draws} draws); columns: m")
    print("scale kind " + " ".join(f"{m:>7d}" for m in args.num_features))
    for scale in args.scales:
        for kind in kinds:
            row = [r["tv_error"] for r in approximation if r["scale"] == scale and r["kind"] == kind]
            print(f"{scale:5g} {kind:4s} " + " ".join(f"{e:7.4f}" for e in row))
    print(f"\nprevious-token peak beta; bound without RPE on any single weight: {result['max_weight_bound_without_rpe']:.3f}, "
          f"uniform entropy log n = {math.log(n):.2f}")
    print(" beta  nprf prev-weight  exact prev-weight  nprf max  nprf entropy  exact entropy")
    for r in sharp:
        print(f"{r['beta']:5g}  {r['nprf']['previous_token_weight']:16.3f}  {r['exact']['previous_token_weight']:17.3f}"
              f"  {r['nprf']['max_weight']:8.3f}  {r['nprf']['entropy']:12.3f}  {r['exact']['entropy']:13.3f}")
    write_json(args.output + ".json", result)
    if not args.no_plot:
        plot(result, args.output + ".png")
    print(f"runtime {result['runtime_s']:.1f} s; wrote {args.output}.json" + ("" if args.no_plot else f" and {args.output}.png"))
    return result


if __name__ == "__main__":
    main()
