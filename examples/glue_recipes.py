#!/usr/bin/env python
# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""The GLUE protocol of our results table: softmax vs NPRF conversion recipes, several seeds.

Every run is one `examples/run_glue.py` command (printed, and stored with its result), so any row
can be re-run by hand. Budgets (one place, `TASKS`): SST-2 the first 20,000 training rows x 1 epoch,
CoLA and MRPC their full training sets x 3 epochs; full dev sets; lr 1e-4 with 10% linear warm-up and
linear decay, batch 16, length 128, AdamW, no weight decay.

Recipes (`RECIPES`):
- softmax: the checkpoint as it is.
- nprf: converted at load time (the paper's NPRF: zero RPE table, 64 ORF features).
- nprf+transfer: converted, then attention transfer on the task's own training texts, then fine-tuned.
- nprf+scale8+transfer: the same with a learnable per-head logit scale (`logit_scale_max=8`).
- nprf+scale8: the logit scale alone, no transfer.
- nprf+scale8+calibrated+transfer: the RPE table starts from the source's attention per distance.
- nprf+scale8+wikitext-transfer: transfer on generic text (WikiText-2) instead: protocol (a).
- nprf+scale8+m256+transfer: 256 random features (a less noisy estimate of the scaled kernel).
- nprf+scale8+segment+transfer: plus a learned bias for query/key pairs in different sentences.
- nprf+scale8+segment+match+transfer: plus a learned weight for the same word in the other sentence.
- default+transfer: what `--convert_to_nprf --attention_transfer_steps N` does with no `--nprf_config`
  (`options.TRANSFER_RECIPE`, the same as near+scale30+transfer).
- near+scale8+transfer, near+scale30+transfer: the exact near field (`attention_variant="nprf_near"`: the RPE
  band's pairs weigh the exact kernel, farther ones NPRF) with a logit scale up to 8 or 30, transferred, fine-tuned.
- hedgehog: protocol (b), as in Hedgehog: the *fine-tuned softmax* model of the same task and seed
  is converted (scale8), transferred on the task's texts, then fine-tuned for one epoch.
- normalized-then-nprf, scale8+normalized-then-nprf: converted with the exact kernel NPRF estimates (softmax of
  normalized q . k with the RPE bias, `attention_variant="normalized_softmax"`; quadratic, fine at these
  lengths), fine-tuned so, then switched to NPRF with no further training (`--final_attention_variant nprf`;
  `before_switch_*` holds the exact kernel's dev scores): the paper's Figure 2 as a conversion route.

    python examples/glue_recipes.py --model_name_or_path $MINILM --tasks mrpc --recipes softmax nprf \
        --seeds 42 --output_dir runs/glue_recipes
    python examples/glue_recipes.py ... --workers 8        # on a GPU: several runs side by side

Writes OUTPUT_DIR/results.json (every run: command, metrics, seconds) and prints a markdown table
of mean +- std over seeds.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nprf_hf.transfer import TRANSFER_DEFAULTS  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data")

# task -> (extra run_glue arguments, metrics reported)
TASKS = {
    "sst2": (["--max_train_samples", "20000", "--num_train_epochs", "1"], ["accuracy"]),
    "cola": (["--num_train_epochs", "3"], ["matthews_correlation"]),
    "mrpc": (["--num_train_epochs", "3"], ["f1", "accuracy"]),
}
COMMON = [  # every run, before the task's and the recipe's arguments (later ones win)
    "--do_train", "--do_eval", "--learning_rate", "1e-4", "--warmup_steps", "0.1",
    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "64", "--max_seq_length", "128",
    "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
]

CALIBRATED = {"rpe_init": "calibrated", "calibration_text": os.path.join(DATA, "wikitext-2", "valid.txt")}
# recipe -> how it differs from softmax: NPRF config (None: stays softmax), transfer text ("task": the
# task's own training texts), the recipe whose fine-tuned output it starts from, epochs override.
RECIPES = {
    "softmax": {"nprf": None},
    "nprf": {"nprf": {}},
    "nprf+transfer": {"nprf": {"attention_variant": "nprf"}, "transfer": "task"},
    "nprf+scale8+transfer": {"nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0}, "transfer": "task"},
    "nprf+scale8": {"nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0}},
    "nprf+scale8+calibrated+transfer": {"nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0, **CALIBRATED}, "transfer": "task"},
    "nprf+scale8+wikitext-transfer": {"nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0}, "transfer": "wikitext"},
    "nprf+scale8+m256+transfer": {"nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0, "num_random_features": 256}, "transfer": "task"},
    "nprf+scale8+segment+transfer": {"nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0, "segment_bias": True}, "transfer": "task"},
    "nprf+scale8+segment+match+transfer": {
        "nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0, "segment_bias": True, "token_match": True},
        "transfer": "task",
    },
    # what --attention_transfer_steps does with no --nprf_config (options.TRANSFER_RECIPE: near+scale30+transfer)
    "default+transfer": {"nprf": {}, "transfer": "task"},
    # the exact near field (issue 54): the band's pairs exact, NPRF beyond, a sharper scale the exact kernel follows
    "near+scale8+transfer": {"nprf": {"attention_variant": "nprf_near", "logit_scale_max": 8.0}, "transfer": "task"},
    "near+scale30+transfer": {"nprf": {"attention_variant": "nprf_near", "logit_scale_max": 30.0}, "transfer": "task"},
    "hedgehog": {"nprf": {"attention_variant": "nprf", "logit_scale_max": 8.0}, "transfer": "task", "source": "softmax", "epochs": 1},
    # issue 22's Figure-2 route: fine-tuned with the exact kernel NPRF estimates, then switched to NPRF
    "normalized-then-nprf": {"nprf": {"attention_variant": "normalized_softmax"}, "final": "nprf"},
    "scale8+normalized-then-nprf": {"nprf": {"logit_scale_max": 8.0, "attention_variant": "normalized_softmax"},
                                    "final": "nprf"},
}


def recipe_arguments(recipe, transfer_steps):
    spec = RECIPES[recipe]
    if spec["nprf"] is None:
        return []
    extra = ["--convert_to_nprf"]
    if spec["nprf"]:
        extra += ["--nprf_config", json.dumps(spec["nprf"])]
    if spec.get("transfer"):
        extra += ["--attention_transfer_steps", str(transfer_steps)]
    if spec.get("transfer") == "wikitext":
        extra += ["--attention_transfer_text", os.path.join(DATA, "wikitext-2", "valid.txt")]
    if spec.get("epochs"):
        extra += ["--num_train_epochs", str(spec["epochs"])]
    if spec.get("final"):
        extra += ["--final_attention_variant", spec["final"]]
    return extra


def run_dir(output_dir, task, recipe, seed):
    safe = recipe.replace("+", "_")
    return os.path.join(output_dir, task, safe, f"seed{seed}")


def command(args, task, recipe, seed):
    extra, source = recipe_arguments(recipe, args.attention_transfer_steps), RECIPES[recipe].get("source")
    model = run_dir(args.output_dir, task, source, seed) if source else args.model_name_or_path
    task_args, _ = TASKS[task]
    return [
        sys.executable, os.path.join(HERE, "run_glue.py"), "--model_name_or_path", model, "--task_name", task,
        "--glue_dir", args.glue_dir, *COMMON, *task_args, "--seed", str(seed),
        "--output_dir", run_dir(args.output_dir, task, recipe, seed), *args.extra, *extra,
    ]


def run_one(args, task, recipe, seed):
    out = run_dir(args.output_dir, task, recipe, seed)
    results_path = os.path.join(out, "eval_results.json")
    cmd = command(args, task, recipe, seed)
    if args.reuse and os.path.isfile(results_path):
        seconds = None
    else:
        os.makedirs(out, exist_ok=True)
        start = time.perf_counter()
        with open(os.path.join(out, "log.txt"), "w") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
        if code != 0:
            print(f"FAILED ({code}): {task} {recipe} seed {seed}; see {out}/log.txt", flush=True)
            return None
    with open(results_path) as handle:
        metrics = json.load(handle)
    row = {"task": task, "recipe": recipe, "seed": seed, "seconds": seconds, "metrics": metrics,
           "command": shlex.join(cmd[1:])}
    transfer_path = os.path.join(out, "attention_transfer.json")
    if os.path.isfile(transfer_path):
        with open(transfer_path) as handle:
            report = json.load(handle)
        row["transfer"] = {k: report[k] for k in ("steps", "seconds", "loss_before", "loss_after")}
    shown = ", ".join(f"{m} {100 * metrics['eval_' + m]:.2f}" for m in TASKS[task][1])
    print(f"{task:<5} {recipe:<32} seed {seed}: {shown}  ({seconds or 0:.0f} s)", flush=True)
    return row


def table(rows, tasks, recipes):
    lines = ["| task | metric | " + " | ".join(recipes) + " |", "|---|---|" + "---|" * len(recipes)]
    for task in tasks:
        for metric in TASKS[task][1]:
            cells = []
            for recipe in recipes:
                values = [100 * r["metrics"]["eval_" + metric] for r in rows if r["task"] == task and r["recipe"] == recipe]
                if not values:
                    cells.append("–")
                elif len(values) == 1:
                    cells.append(f"{values[0]:.2f}")
                else:
                    cells.append(f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f} (n={len(values)})")
            lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="softmax checkpoint of a supported family")
    parser.add_argument("--glue_dir", default=os.path.join(DATA, "glue"), help="glue_data root")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--attention_transfer_steps", type=int, default=TRANSFER_DEFAULTS["steps"], help="transfer steps of the recipes that transfer")
    parser.add_argument("--workers", type=int, default=1, help="runs side by side (1 on a 2-core CPU)")
    parser.add_argument("--output_dir", default="runs/glue_recipes", help="one folder per task/recipe/seed")
    parser.add_argument("--reuse", action="store_true", help="keep runs that already have eval_results.json")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more run_glue.py arguments for every run")
    args = parser.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    for recipe in args.recipes:
        source = RECIPES[recipe].get("source")
        if source is not None and source not in args.recipes:
            parser.error(f"recipe {recipe} starts from the {source} runs: add {source} to --recipes")

    jobs = [(t, r, s) for t in args.tasks for r in args.recipes for s in args.seeds]
    first = [j for j in jobs if RECIPES[j[1]].get("source") is None]
    second = [j for j in jobs if RECIPES[j[1]].get("source") is not None]
    rows = []
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        for phase in (first, second):
            rows += [r for r in pool.map(lambda job: run_one(args, *job), phase) if r is not None]
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as handle:
        json.dump(rows, handle, indent=2)
    print(table(rows, args.tasks, args.recipes))
    return 0 if len(rows) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
