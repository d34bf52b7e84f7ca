"""The paper's from-scratch experiments in miniature: language modeling, stability, and the conversion study.

Luo et al. (NeurIPS 2021) claim that NPRF attention with RPE trains stably and as well as softmax, that PRF
(unnormalized) attention is unstable, and (their Figure 2) that a model trained with *normalized* attention
loses little when its exact attention is swapped for the NPRF estimate without any fine-tuning, while a model
trained with standard attention loses a lot. This script reruns those claims at a size a 2-core CPU trains in
minutes, every run through `examples/run_clm.py` (one subprocess per run, so each is a real user run):

  a. causal LM from scratch, per seed: softmax, elu+1 linear, PRF, NPRF without RPE, NPRF with RPE; test
     perplexity and loss curves;
  b. stability: the same arms at a high learning rate, under bf16 autocast, and both (--conditions): which runs
     diverge (a non-finite loss, or a final loss above the minimum by more than --spike), gradient-norm traces;
  c. Figure 2: standard and normalized softmax attention, each with and without RPE, trained, then switched to
     NPRF (`nprf_hf.set_attention_variant`, weights untouched) at m = 16, 32, 64, 128: test perplexity before and
     after (the standard-without-RPE arm is a.'s softmax run).
  d. the paper's Table 1 in miniature: a masked LM pre-trained from scratch (`examples/run_mlm.py`, the same
     size, steps and learning rate as a.) with softmax and with NPRF + RPE, then each fine-tuned on SST-2 and
     MRPC (`examples/run_glue.py` with the GLUE protocol of `examples/glue_recipes.py`): MLM test perplexity
     and dev scores.

Data: WikiText-2 `valid.txt` trains, `test.txt` is the reported perplexity; a byte-level BPE vocabulary of
--vocab-size is trained on the training text first. Sizes (--size): `cpu` (the default: 4 layers, 4 heads,
hidden 128, FFN 512, blocks of 256 tokens, m = 32) and `gpu` (the paper's WikiText-103 model: 6 layers, 8 heads,
hidden 512, FFN 2048, blocks of 512, m = 64; pass --device-flags for your launcher).

    python benchmarks/stable_study.py --parts a c --seeds 0 1 --steps 300      # CPU: about 2 min per run
    python benchmarks/stable_study.py --size gpu --steps 20000 --parts a b c d # a GPU-sized study

Writes OUTPUT/results.json (every run's settings, log summary and perplexities), OUTPUT/results.md (the tables)
and OUTPUT/{loss_curves,grad_norms,figure2,perplexity_vs_m}.png.
"""

import argparse
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

from nprf_hf.benchmarking import write_json


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "wikitext-2")
DEFAULT_OUTPUT = os.path.join(ROOT, "runs", "stable_study")

# arm -> the NPRF config fields that make it (one model class for all: `attention_variant` and
# `relative_position_bias` are the ablation switches); the paper's names in the comments
ARMS = {
    "softmax": {"attention_variant": "softmax", "relative_position_bias": False},  # standard attention
    "softmax+rpe": {"attention_variant": "softmax", "relative_position_bias": True},
    "normalized": {"attention_variant": "normalized_softmax", "relative_position_bias": False},
    "normalized+rpe": {"attention_variant": "normalized_softmax", "relative_position_bias": True},
    "elu_linear": {"attention_variant": "elu_linear", "relative_position_bias": False},  # linear transformer
    "prf": {"attention_variant": "prf", "relative_position_bias": False},  # Performer
    "nprf": {"attention_variant": "nprf", "relative_position_bias": False},  # NPRF without RPE
    "nprf+rpe": {"attention_variant": "nprf", "relative_position_bias": True},  # the paper's model
}
PART_ARMS = {
    "a": ("softmax", "elu_linear", "prf", "nprf", "nprf+rpe"),
    "b": ("softmax", "elu_linear", "prf", "nprf", "nprf+rpe"),
    "c": ("softmax", "softmax+rpe", "normalized", "normalized+rpe"),
    "d": ("softmax", "nprf+rpe"),
}
GLUE_DIR = os.path.join(os.path.dirname(ROOT), "shared", "data", "glue")
FINE_TUNE_TASKS = ("sst2", "mrpc")
SIZES = {
    "cpu": dict(config={"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "intermediate_size": 512, "num_random_features": 32},
                block_size=256, batch_size=8, learning_rate=1e-3, high_learning_rate=1e-2),
    "gpu": dict(config={"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
                        "intermediate_size": 2048, "num_random_features": 64},
                block_size=512, batch_size=32, learning_rate=5e-4, high_learning_rate=5e-3),
}
SIZES["tiny"] = dict(config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                             "num_random_features": 8}, block_size=32, batch_size=4, learning_rate=1e-3,
                     high_learning_rate=1e-2)  # for the script's own test
SWAP_FEATURES = (16, 32, 64, 128)
# part b's conditions -> (the size's learning-rate key, run_clm's --mixed_precision). "high-lr-bf16" is both at
# once: where a CPU without bf16 units (about 13x slower under autocast) can afford only a short run, the high rate
# is what makes a short run a stability test at all.
STABILITY_CONDITIONS = {"high-lr": ("high_learning_rate", "no"), "bf16": ("learning_rate", "bf16"),
                        "high-lr-bf16": ("high_learning_rate", "bf16")}


def train_tokenizer(train_file, vocab_size, folder):
    """A byte-level BPE tokenizer trained on the training text (RoBERTa's special tokens), saved in `folder`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    with open(train_file, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tokenizer = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, model_max_length=1_000_000)
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>",
                                  "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>"})
    tokenizer.save_pretrained(folder)
    return folder


def run_clm(args, name, arm, seed, tokenizer, learning_rate, mixed_precision="no", save_model=False):
    """One `examples/run_clm.py` run in its own process; returns its results dict (and its log)."""
    out = os.path.join(args.output, "runs", name)
    if os.path.isfile(os.path.join(out, "results.json")) and not args.rerun:  # resumable study
        return read_run(out)
    size = SIZES[args.size]
    config = {**size["config"], **ARMS[arm], "max_position_embeddings": size["block_size"] + 2}
    command = [
        sys.executable, os.path.join(ROOT, "examples", "run_clm.py"), "--model_type", "nprf_roberta",
        "--tokenizer_name", tokenizer, "--config_overrides", json.dumps(config), "--train_file", args.train_file,
        "--validation_file", args.test_file, "--block_size", str(size["block_size"]), "--max_steps", str(args.steps),
        "--per_device_train_batch_size", str(size["batch_size"]), "--learning_rate", str(learning_rate),
        "--warmup_steps", str(max(args.steps // 20, 1)), "--mixed_precision", mixed_precision, "--seed", str(seed),
        "--output_dir", out, "--overwrite_output_dir", *(["--threads", str(args.threads)] if args.threads else []),
        *([] if save_model else ["--no_save_model"]),
    ]
    _subprocess(command, name, None)  # run_clm.py sets its threads itself (--threads)
    return read_run(out)


def run_mlm(args, name, arm, seed, tokenizer, learning_rate):
    """One `examples/run_mlm.py` pre-training run from a fresh config, in its own process; returns its folder and
    its metrics (MLM perplexity on the test text, and the per-step loss and gradient norm of the Trainer's log)."""
    out = os.path.join(args.output, "runs", name)
    if not (os.path.isfile(os.path.join(out, "eval_results.json")) and not args.rerun):
        size = SIZES[args.size]
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(tokenizer))
        config = {"model_type": "nprf_roberta", "vocab_size": vocab, **size["config"], **ARMS[arm],
                  "max_position_embeddings": size["block_size"] + 2, "pad_token_id": 1, "bos_token_id": 0,
                  "eos_token_id": 2, "type_vocab_size": 1}
        os.makedirs(out, exist_ok=True)
        config_path = os.path.join(out, "fresh_config.json")
        with open(config_path, "w") as handle:
            json.dump(config, handle)
        command = [
            sys.executable, os.path.join(ROOT, "examples", "run_mlm.py"), "--config_name", config_path,
            "--tokenizer_name", tokenizer, "--train_file", args.train_file, "--validation_file", args.test_file,
            "--max_seq_length", str(size["block_size"]), "--do_train", "--do_eval", "--max_steps", str(args.steps),
            "--per_device_train_batch_size", str(size["batch_size"]), "--learning_rate", str(learning_rate),
            "--warmup_steps", str(max(args.steps // 20, 1)), "--lr_scheduler_type", "cosine", "--max_grad_norm", "1.0",
            "--seed", str(seed), "--output_dir", out, "--save_strategy", "no", "--logging_steps", "1",
            "--report_to", "none", "--disable_tqdm", "true",
        ]
        _subprocess(command, name, args.threads)
    with open(os.path.join(out, "eval_results.json")) as handle:
        metrics = json.load(handle)
    with open(os.path.join(out, "trainer_state.json")) as handle:
        history = [e for e in json.load(handle)["log_history"] if "loss" in e]
    return {"output_dir": out, "perplexity": metrics["perplexity"], "losses": [e["loss"] for e in history],
            "grad_norms": [e.get("grad_norm") for e in history]}


def fine_tune(args, name, model_dir, task, seed):
    """`examples/run_glue.py` on one GLUE task from a pre-trained folder, with `glue_recipes`' protocol (`TASKS`,
    `COMMON`); returns the dev metrics."""
    recipes = example("glue_recipes")
    COMMON, TASKS = recipes.COMMON, recipes.TASKS

    out = os.path.join(args.output, "runs", name)
    if not (os.path.isfile(os.path.join(out, "eval_results.json")) and not args.rerun):
        command = [sys.executable, os.path.join(ROOT, "examples", "run_glue.py"), "--model_name_or_path", model_dir,
                   "--task_name", task, "--glue_dir", args.glue_dir, *COMMON, *TASKS[task][0], "--seed", str(seed),
                   "--max_seq_length", str(min(128, SIZES[args.size]["block_size"])), "--output_dir", out,
                   *(["--max_train_samples", str(args.max_fine_tune_samples)] if args.max_fine_tune_samples else [])]
        _subprocess(command, name, args.threads)
    with open(os.path.join(out, "eval_results.json")) as handle:
        metrics = json.load(handle)
    return {metric: metrics["eval_" + metric] for metric in TASKS[task][1]}


@functools.lru_cache(maxsize=None)
def example(name):
    """examples/NAME.py as a module, loaded from its file: the study runs the examples' own GLUE protocol and
    perplexity, not copies (examples/ is no package, and no folder is added to the import path)."""
    spec = importlib.util.spec_from_file_location(f"nprf_examples_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _subprocess(command, name, threads):
    """Run one example script offline (threads: its OMP_NUM_THREADS, None = inherited); exit with its stderr's tail
    if it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{result.stderr[-4000:]}")
    print(f"  {name}: {time.perf_counter() - start:.0f} s", flush=True)


def read_run(out):
    with open(os.path.join(out, "results.json")) as handle:
        results = json.load(handle)
    with open(os.path.join(out, "train_log.jsonl")) as handle:
        results["log"] = [json.loads(line) for line in handle]
    results["output_dir"] = out
    return results


def diverged(results, spike):
    """A non-finite loss, or a final loss (mean of the last 5% of steps) above the run's minimum by `spike` nats."""
    if results["diverged"]:
        return True
    losses = [entry["loss"] for entry in results["log"]]
    tail = losses[-max(len(losses) // 20, 1):]
    return sum(tail) / len(tail) > min(losses) + spike


_TEST_BLOCKS = {}


def swapped_perplexity(run, tokenizer, test_file, block_size, num_random_features, seed):
    """Test perplexity of a trained run's model with its attention switched to NPRF (weights untouched); kept in
    the run's folder (`swapped.json`), so that a study resumes without evaluating twice."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import nprf_hf

    run_clm = example("run_clm")
    evaluate, token_blocks = run_clm.evaluate, run_clm.token_blocks

    path = os.path.join(run["output_dir"], "swapped.json")
    done = json.load(open(path)) if os.path.isfile(path) else {}
    if str(num_random_features) in done:
        return done[str(num_random_features)]
    model = AutoModelForCausalLM.from_pretrained(run["output_dir"]).eval()
    nprf_hf.set_attention_variant(model, "nprf", num_random_features=num_random_features, projection_seed=seed)
    key = (tokenizer, test_file, block_size)
    if key not in _TEST_BLOCKS:
        _TEST_BLOCKS[key] = token_blocks(AutoTokenizer.from_pretrained(tokenizer), test_file, block_size)
    with torch.no_grad():
        done[str(num_random_features)] = evaluate(model, _TEST_BLOCKS[key], 8, None)["perplexity"]
    write_json(path, done, indent=None)
    return done[str(num_random_features)]


def mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=sorted(PART_ARMS), default=["a", "b", "c"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="only these arms of each part (default: all)")
    parser.add_argument("--conditions", nargs="+", choices=sorted(STABILITY_CONDITIONS), default=list(STABILITY_CONDITIONS),
                        help="part b: only these conditions (default: all)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--train-file", default=os.path.join(DATA, "valid.txt"))
    parser.add_argument("--test-file", default=os.path.join(DATA, "test.txt"))
    parser.add_argument("--glue-dir", default=GLUE_DIR, help="glue_data root, for part d")
    parser.add_argument("--max-fine-tune-samples", type=int, help="part d: at most N training rows per task")
    parser.add_argument("--spike", type=float, default=1.0, help="nats above the minimum that count as not recovered")
    parser.add_argument("--threads", type=int, help="torch threads of each run")
    parser.add_argument("--rerun", action="store_true", help="rerun runs whose results exist")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    for name in ("train_file", "test_file"):
        if not os.path.isfile(getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: no such file")
    if "d" in args.parts and not os.path.isdir(args.glue_dir):
        parser.error(f"--glue-dir {args.glue_dir}: no such folder (part d fine-tunes on its SST-2 and MRPC)")
    os.makedirs(args.output, exist_ok=True)
    size = SIZES[args.size]
    tokenizer = train_tokenizer(args.train_file, args.vocab_size, os.path.join(args.output, "tokenizer"))
    report = {"settings": {**vars(args), "size_settings": size, "arms": ARMS}, "a": [], "b": [], "c": [], "d": []}
    part_arms = {part: [a for a in arms if args.arms is None or a in args.arms] for part, arms in PART_ARMS.items()}

    def summary(run, **extra):
        return {"final_loss": run["final_loss"], "perplexity": run.get("perplexity"), "diverged": run["diverged"],
                "steps": run["steps"], "train_seconds": run["train_seconds"], "parameters": run["parameters"],
                "losses": [e["loss"] for e in run["log"]], "grad_norms": [e["grad_norm"] for e in run["log"]], **extra}

    base_runs = {}
    if "a" in args.parts or "c" in args.parts:
        arms = set(part_arms["a"] if "a" in args.parts else ()) | ({"softmax"} & set(part_arms["c"]) if "c" in args.parts else set())
        for arm in [a for a in ARMS if a in arms]:
            for seed in args.seeds:
                base_runs[arm, seed] = run_clm(args, f"a-{arm}-s{seed}", arm, seed, tokenizer, size["learning_rate"],
                                               save_model=arm == "softmax")
                report["a"].append(summary(base_runs[arm, seed], arm=arm, seed=seed))
    if "b" in args.parts:
        for arm in part_arms["b"]:
            for condition in args.conditions:
                rate, precision = STABILITY_CONDITIONS[condition]
                run = run_clm(args, f"b-{arm}-{condition}-s{args.seeds[0]}", arm, args.seeds[0], tokenizer, size[rate],
                              precision)
                report["b"].append(summary(run, arm=arm, condition=condition, seed=args.seeds[0],
                                           unstable=diverged(run, args.spike)))
    if "c" in args.parts:
        for arm in part_arms["c"]:
            for seed in args.seeds:
                run = base_runs.get((arm, seed)) or run_clm(args, f"c-{arm}-s{seed}", arm, seed, tokenizer,
                                                            size["learning_rate"], save_model=True)
                swapped = {m: swapped_perplexity(run, tokenizer, args.test_file, size["block_size"], m, seed)
                           for m in SWAP_FEATURES}
                report["c"].append(summary(run, arm=arm, seed=seed, swapped=swapped))
    if "d" in args.parts:
        for arm in part_arms["d"]:
            for seed in args.seeds:
                mlm = run_mlm(args, f"d-{arm}-mlm-s{seed}", arm, seed, tokenizer, size["learning_rate"])
                scores = {task: fine_tune(args, f"d-{arm}-{task}-s{seed}", mlm["output_dir"], task, seed)
                          for task in FINE_TUNE_TASKS}
                report["d"].append({"arm": arm, "seed": seed, **mlm, "glue": scores})
    write_json(os.path.join(args.output, "results.json"), report)
    tables = write_tables(report, args)
    print(tables)
    if not args.no_plot:
        plot(report, args.output)
    return report


def write_tables(report, args):
    lines = [f"# From-scratch study ({args.size} size, {args.steps} steps, seeds {args.seeds})", ""]
    if report["a"]:
        lines += ["## a. Causal LM from scratch: test perplexity", "", "| arm | " + " | ".join(
            f"seed {s}" for s in args.seeds) + " | mean |", "|---|" + "---|" * (len(args.seeds) + 1)]
        for arm in dict.fromkeys(r["arm"] for r in report["a"]):
            values = [next((r["perplexity"] for r in report["a"] if r["arm"] == arm and r["seed"] == s), None)
                      for s in args.seeds]
            lines.append(f"| {arm} | " + " | ".join(f"{v:.1f}" if v else "diverged" for v in values)
                         + f" | {mean(values):.1f} |")
        lines.append("")
    if report["b"]:
        lines += ["## b. Stability: diverged or unrecovered runs", "", "| arm | condition | unstable | final loss | "
                  "max grad norm |", "|---|---|---|---|---|"]
        for r in report["b"]:
            norms = [g for g in r["grad_norms"] if g is not None]
            lines.append(f"| {r['arm']} | {r['condition']} | {'yes' if r['unstable'] else 'no'} | "
                         f"{r['final_loss']:.3f} | {max(norms) if norms else float('nan'):.2f} |")
        lines.append("")
    if report["c"]:
        lines += ["## c. Figure 2: test perplexity of the trained attention, then switched to NPRF (no fine-tuning)",
                  "", "| arm | seed | trained | " + " | ".join(f"NPRF m={m}" for m in SWAP_FEATURES) + " |",
                  "|---|---|---|" + "---|" * len(SWAP_FEATURES)]
        for r in report["c"]:
            lines.append(f"| {r['arm']} | {r['seed']} | {r['perplexity']:.1f} | " + " | ".join(
                f"{r['swapped'][m]:.1f}" for m in SWAP_FEATURES) + " |")
        lines.append("")
    if report["d"]:
        metrics = [(task, metric) for task in FINE_TUNE_TASKS for metric in report["d"][0]["glue"][task]]
        lines += ["## d. MLM from scratch, then fine-tuned (dev)", "", "| arm | seed | MLM test perplexity | "
                  + " | ".join(f"{task} {metric}" for task, metric in metrics) + " |", "|---|---|---|" + "---|" * len(metrics)]
        for r in report["d"]:
            lines.append(f"| {r['arm']} | {r['seed']} | {r['perplexity']:.1f} | "
                         + " | ".join(f"{100 * r['glue'][task][metric]:.1f}" for task, metric in metrics) + " |")
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(args.output, "results.md"), "w") as handle:
        handle.write(text)
    return text


def plot(report, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for part, key, name, ylabel in (("a", "losses", "loss_curves", "training loss"),
                                    ("b", "grad_norms", "grad_norms", "gradient norm (before clipping)"),
                                    ("d", "losses", "mlm_loss_curves", "MLM training loss")):
        if not report[part]:
            continue
        figure, axis = plt.subplots(figsize=(7, 4))
        for r in report[part]:
            values = [v if v is not None else float("nan") for v in r[key]]
            label = r["arm"] + (f" {r['condition']}" if "condition" in r else "") + f" s{r['seed']}"
            axis.plot(range(1, len(values) + 1), values, label=label, linewidth=0.8)
        axis.set_xlabel("step")
        axis.set_ylabel(ylabel)
        if part == "b":
            axis.set_yscale("log")
        axis.legend(fontsize=6, ncol=2)
        figure.tight_layout()
        figure.savefig(os.path.join(output, name + ".png"), dpi=120)
        plt.close(figure)
    if report["c"]:
        arms = list(dict.fromkeys(r["arm"] for r in report["c"]))
        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for index, arm in enumerate(arms):
            runs = [r for r in report["c"] if r["arm"] == arm]
            trained, swapped = mean([r["perplexity"] for r in runs]), mean([r["swapped"][64] for r in runs])
            left.bar([index - 0.2, index + 0.2], [trained, swapped], width=0.4, color=["tab:blue", "tab:orange"])
            right.plot(SWAP_FEATURES, [mean([r["swapped"][m] for r in runs]) for m in SWAP_FEATURES], marker="o", label=arm)
        left.set_xticks(range(len(arms)), arms, rotation=20)
        left.set_ylabel("test perplexity (blue: trained attention, orange: NPRF m=64)")
        left.set_yscale("log")
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.set_xlabel("m (random features)")
        right.set_ylabel("test perplexity after the switch to NPRF")
        right.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(os.path.join(output, "figure2.png"), dpi=120)
        plt.close(figure)


if __name__ == "__main__":
    main()
