"""The README's figure: time and memory against sequence length, NPRF against softmax SDPA, attention alone and the
whole model, drawn from the committed benchmark JSON (nothing is measured here).

    python utils/readme_figure.py                      # writes docs/readme_figure.png

Rows 1-2, CPU (2 threads), time and memory: attention alone (B = 1, H = 12, d = 64, m = 64) from `benchmarks/results/attention_cpu.json`
(times) and `attention_long_cpu.json` (peak memory, measured at 4,096 and 16,384 only: the first file's memory
fields came from a method since replaced); the RoBERTa-base-sized model from `benchmarks/plots/long_sequence.json`
(its training rows predate `attention_recompute`) and, at 16,384 tokens, the training step with
`attention_recompute` (the default) from `benchmarks/results/long_sequence_train16k_nobias_cpu.json`.
Rows 3-4, GPU: added only when `benchmarks/results/gpu_cuda_bf16.json` (`bash benchmarks/gpu.sh`) exists (a part
that file lacks gets an empty panel that says so).
A required file that is missing stops the script with the command that makes it.
"""

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MIB = 2**20

# input -> (default path, the command that writes it)
INPUTS = {
    "attention": (os.path.join(RESULTS, "attention_cpu.json"),
                  "python benchmarks/attention.py --threads 2 --min-time 0.5 --output benchmarks/results/attention_cpu.json"),
    "attention_memory": (os.path.join(RESULTS, "attention_long_cpu.json"),
                         "python benchmarks/attention.py --threads 2 --min-time 0.5 --lengths 4096 16384 "
                         "--output benchmarks/results/attention_long_cpu.json"),
    "model": (os.path.join(ROOT, "benchmarks", "plots", "long_sequence.json"),
              "python benchmarks/long_sequence.py --output benchmarks/plots/long_sequence"),
    "model_recompute": (os.path.join(RESULTS, "long_sequence_train16k_nobias_cpu.json"),
                        "python benchmarks/long_sequence.py --device cpu --threads 2 --lengths 16384 --modes train "
                        "--variants nprf sdpa --repeats 0 --time-cap 1400 --no-plot "
                        "--output benchmarks/results/long_sequence_train16k_nobias_cpu"),
    "gpu": (os.path.join(RESULTS, "gpu_cuda_bf16.json"), "bash benchmarks/gpu.sh"),
}
NPRF, SDPA = "C1", "C0"


def load(name, path, required=True):
    """The JSON at `path`; None for a missing optional input; SystemExit naming the file and its command."""
    if not os.path.isfile(path):
        if not required:
            return None
        sys.exit(f"readme_figure: missing {path} ({name}); it is written by: {INPUTS[name][1]}")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def attention_times(data):
    """{(variant, pass): ([n], [seconds])} of attention.py's rows, variant 'auto' (NPRF) and 'sdpa'."""
    series = {}
    for row in data["rows"]:
        for variant in ("auto", "sdpa"):
            seconds = row["seconds"].get(variant)
            if seconds is not None:
                xs, ys = series.setdefault((variant, row["pass"]), ([], []))
                xs.append(row["n"])
                ys.append(seconds)
    return series


def attention_memory(data):
    """{(variant, pass): ([n], [MiB])} of attention.py's peak_bytes."""
    series = {}
    for row in data["rows"]:
        for variant in ("auto", "sdpa"):
            peak = row.get("peak_bytes", {}).get(variant)
            if peak is not None:
                xs, ys = series.setdefault((variant, row["pass"]), ([], []))
                xs.append(row["n"])
                ys.append(peak / MIB)
    return series


def model_series(data, field):
    """{(variant, mode): ([n], [value])} of long_sequence.py's measured points (time_s or peak MiB)."""
    series = {}
    for point in data["results"]:
        if point.get("status") != "ok" or point["variant"] not in ("nprf", "sdpa"):
            continue
        value = point["time_s"] if field == "time" else point["peak_memory_bytes"] / MIB
        xs, ys = series.setdefault((point["variant"], point["mode"]), ([], []))
        xs.append(point["n"])
        ys.append(value)
    return series


def gpu_series(rows, keys):
    """{(variant, mode): ([n], [value])} of gpu.py's rows for the `{variant}_{key}` fields present."""
    series = {}
    for row in rows:
        for variant in ("nprf", "sdpa"):
            for mode, key, scale in keys:
                value = row.get(f"{variant}_{key}")
                if value is not None:
                    xs, ys = series.setdefault((variant, mode), ([], []))
                    xs.append(row["n"])
                    ys.append(value * scale)
    return series


def tokens_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def draw(ax, series, labels, title, ylabel, ratio=None, extra=()):
    """One log-log panel: NPRF orange, SDPA blue; forward solid circles, training dashed squares. `ratio`: a
    caption of SDPA's value over NPRF's at the longest length both have, per mode ("time" or "memory")."""
    if not series:  # a part the results file does not hold (gpu.py writes its JSON after every part)
        ax.text(0.5, 0.5, "not in the results file", transform=ax.transAxes, ha="center", va="center", fontsize=9)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    lengths = set()
    for (variant, mode), (xs, ys) in sorted(series.items(), key=lambda item: (item[0][0] not in ("auto", "nprf"),
                                                                                item[0][1])):
        nprf = variant in ("auto", "nprf")
        train = mode in ("fwd+bwd", "train")
        ax.plot(xs, ys, ("s--" if train else "o-"), color=NPRF if nprf else SDPA, markersize=4,
                label=f"{'NPRF' if nprf else 'SDPA'} {labels[mode] if isinstance(labels[mode], str) else labels[mode][nprf]}")
        lengths.update(xs)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(lengths)
    ax.set_xticks(ticks, [tokens_label(n) for n in ticks])
    ax.minorticks_off()
    values = [y for _, ys in series.values() for y in ys]
    if values:
        from matplotlib.ticker import FuncFormatter, LogLocator

        decades = math.log10(max(values) / min(values))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("tokens", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left")
    if ratio:
        lines = []
        for mode in labels:
            nprf = next((v for (variant, m), v in series.items() if m == mode and variant in ("auto", "nprf")), None)
            sdpa = series.get(("sdpa", mode))
            if not nprf or not sdpa:
                continue
            common = sorted(set(nprf[0]) & set(sdpa[0]))
            if not common:
                continue
            n = common[-1]
            value = sdpa[1][sdpa[0].index(n)] / nprf[1][nprf[0].index(n)]
            name = labels[mode] if isinstance(labels[mode], str) else labels[mode][True]
            lines.append(f"{name.split(' (')[0]} at {tokens_label(n)}: " + (
                f"NPRF {value:.1f}x faster" if ratio == "time" and value >= 1 else
                f"NPRF {1 / value:.2f}x the time" if ratio == "time" else f"NPRF {1 / value:.2f}x SDPA's memory"))
        lines += list(extra)
        if lines:
            ax.text(0.98, 0.03, "\n".join(lines), transform=ax.transAxes, ha="right", va="bottom", fontsize=7,
                    bbox=dict(boxstyle="round", facecolor="white", alpha=0.8, edgecolor="0.8"))


def make_figure(inputs, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = inputs.get("gpu")
    rows = 4 if gpu else 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.7 * rows))
    attention_labels = {"fwd": "forward", "fwd+bwd": "fwd + bwd"}
    model_labels = {"forward": "forward", "train": "training step"}

    draw(axes[0, 0], attention_times(inputs["attention"]), attention_labels,
         "CPU, 2 threads: attention alone (12 heads, d = 64), time", "seconds (median)", ratio="time")
    draw(axes[0, 1], attention_memory(inputs["attention_memory"]), attention_labels,
         "CPU: attention alone, peak memory (measured at 4k and 16k)", "MiB", ratio="memory")
    draw(axes[1, 0], model_series(inputs["model"], "time"), model_labels,
         "CPU, 2 threads: RoBERTa-base-sized model (12 layers), time", "seconds", ratio="time")
    panel = axes[1, 1]
    later = {(p["variant"], p["n"]): p["peak_memory_bytes"] / MIB for p in inputs["model_recompute"]["results"]
             if p.get("status") == "ok" and p["variant"] in ("nprf", "sdpa")}
    extra = [f"training, recompute, at {tokens_label(n)}: NPRF {later[v, n] / later['sdpa', n]:.3f}x SDPA's memory"
             for v, n in sorted(later) if v == "nprf" and ("sdpa", n) in later]
    draw(panel, model_series(inputs["model"], "memory"),
         {"forward": "forward", "train": {True: "training step (features kept)", False: "training step"}},
         "CPU: RoBERTa-base-sized model, peak memory (RSS)", "MiB", ratio="memory", extra=extra)
    for point in inputs["model_recompute"]["results"]:
        if point.get("status") == "ok" and point["variant"] in ("nprf", "sdpa"):
            nprf = point["variant"] == "nprf"
            panel.plot([point["n"]], [point["peak_memory_bytes"] / MIB], "*" if nprf else "x",
                       color=NPRF if nprf else SDPA, markersize=11 if nprf else 8,
                       label="NPRF training step, attention_recompute (the default now)" if nprf
                       else "SDPA training step, same later run")
    panel.legend(fontsize=6.5, loc="upper left")

    if gpu:
        device = gpu.get("device", "GPU")
        dtype = gpu.get("dtype", "")
        attention = gpu.get("attention") or []
        model = gpu.get("model") or []
        draw(axes[2, 0], gpu_series(attention, (("forward", "forward_s", 1.0), ("train", "train_s", 1.0))),
             {"forward": "forward", "train": "fwd + bwd"}, f"{device}, {dtype}: attention alone, time (Triton / flash)",
             "seconds (median)", ratio="time")
        draw(axes[2, 1], gpu_series(attention, (("train", "train_peak_bytes", 1 / MIB),)), {"train": "fwd + bwd"},
             f"{device}: attention alone, peak memory", "MiB", ratio="memory")
        batches = ", ".join(f"{r['batch']} x {r['n']}" for r in model)
        draw(axes[3, 0], gpu_series(model, (("forward", "forward_s", 1.0), ("train", "train_s", 1.0))), model_labels,
             f"{device}: whole model, time" + (f" (batch x tokens: {batches})" if batches else ""), "seconds",
             ratio="time")
        draw(axes[3, 1], gpu_series(model, (("train", "train_peak_bytes", 1 / MIB),)), {"train": "training step"},
             f"{device}: whole model, peak memory", "MiB", ratio="memory")

    fig.suptitle("NPRF (orange) against softmax SDPA (blue): lower is better", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))  # room for the title
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=80)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    for name, (path, _) in INPUTS.items():
        option = "--" + name.replace("_", "-")
        parser.add_argument(option, default=None, help=f"default: {os.path.relpath(path, ROOT)}"
                            + (" (its row is drawn only when the file exists)" if name == "gpu" else ""))
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "readme_figure.png"))
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    inputs = {}
    for name, (default, _) in INPUTS.items():
        given = getattr(args, name)
        # the GPU file is optional where it is the default; a path the user names must exist
        inputs[name] = load(name, given or default, required=name != "gpu" or given is not None)
    make_figure(inputs, args.output)
    print(f"wrote {args.output}" + (" (with GPU panels)" if inputs["gpu"] else " (CPU only: no GPU results yet)"))


if __name__ == "__main__":
    main()
