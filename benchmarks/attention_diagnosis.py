"""Where a converted model's attention departs from its softmax source: per layer and head, on held-back sentences.

For every query row (padding excluded) of every layer and head: the KL divergence KL(teacher || student) and the
total variation between the source's softmax attention and the student's, the teacher's logit range (log max p -
log min p over the row's keys), how much of the teacher's mass lies inside the RPE band (|j - i| < W) and on the
first token ([CLS] / <s>), and what the student puts there. Heads are then labelled by the teacher's pattern
(sharp: its largest weight averages > 0.5; local: > 0.5 within |j - i| <= 2; first-token: > 0.3 on the first key)
and the heads the student misses most are listed.

Either a converted folder against its source:

    python benchmarks/attention_diagnosis.py --student runs/minilm-nprf --teacher $MINILM

or, to split the loss between its two parts (softmax -> the exact normalized kernel, the exact kernel -> its
random-feature estimate), each variant converted from the source and transferred on its own (WikiText-2 valid):

    python benchmarks/attention_diagnosis.py --teacher $MINILM --variants normalized_softmax:30 nprf:8 nprf_near:30 \
        --transfer-steps 150 --output benchmarks/results/attention_diagnosis_cpu.json

`--tasks sst2 cola mrpc` holds back each task's dev inputs instead (MRPC's as sentence pairs) and ends with one
table: each student's mean KL / TV on every task.
"""

import argparse
import math
import os
import time

import torch
from transformers import AutoModel, AutoTokenizer

import nprf_hf
from nprf_hf.benchmarking import wheel_minilm as default_teacher, write_json
from nprf_hf.functional import rpe_band_width


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")


def sentences(path, limit):
    """The first `limit` sentences of a GLUE-style TSV (header, text first) or lines of a text file."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    if path.endswith(".tsv"):
        lines = [line.split("\t")[0] for line in lines[1:]]
    return [line.strip() for line in lines if len(line.strip().split()) >= 3][:limit]


# Each GLUE task's dev file and the columns that hold its text (two for a sentence pair); read by tabs, as the data
# README asks, since the files hold bare quotes.
TASKS = {
    "sst2": ("SST-2", True, (0,)),
    "cola": ("CoLA", False, (3,)),
    "mrpc": ("MRPC", True, (3, 4)),
}


def task_texts(task, limit):
    """The first `limit` dev inputs of a GLUE task: strings, or (first, second) pairs for a sentence-pair task."""
    folder, header, columns = TASKS[task]
    with open(os.path.join(DATA, "glue", folder, "dev.tsv"), encoding="utf-8-sig") as handle:
        rows = [line.split("\t") for line in handle.read().splitlines()[int(header):]]
    texts = [tuple(row[c].strip() for c in columns) for row in rows if len(row) > max(columns)]
    return [t[0] if len(t) == 1 else t for t in texts][:limit]


@torch.no_grad()
def attention_statistics(teacher, student, tokenizer, texts, band_width, batch_size=32, max_length=128):
    """{statistic: [layers, heads] tensor}, each a mean over the query rows of every text (padding excluded)."""
    sums, rows = None, 0
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        pairs = [list(side) for side in zip(*chunk)] if isinstance(chunk[0], tuple) else [chunk]
        batch = tokenizer(*pairs, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        p_all = teacher(**batch, output_attentions=True).attentions  # L x [B, H, n, n]
        q_all = student.base_model(**batch, output_attentions=True).attentions
        mask = batch["attention_mask"].bool()
        n = mask.shape[1]
        positions = torch.arange(n)
        band = ((positions[None, :] - positions[:, None]).abs() < band_width).double()
        local = ((positions[None, :] - positions[:, None]).abs() <= 2).double()
        keys = mask[:, None, None, :]
        valid = mask[:, None, :].double()  # query rows [B, 1, n]
        stats = []
        for p, q in zip(p_all, q_all):
            p, q = p.double(), q.double()
            log_p, log_q = p.clamp_min(1e-30).log(), q.clamp_min(1e-30).log()
            kl = torch.where(keys, p * (log_p - log_q), 0.0).sum(-1)
            tv = 0.5 * torch.where(keys, (p - q).abs(), 0.0).sum(-1)
            logit_range = torch.where(keys, log_p, -math.inf).amax(-1) - torch.where(keys, log_p, math.inf).amin(-1)
            values = {
                "kl": kl, "tv": tv, "teacher_logit_range": logit_range,
                "teacher_band_mass": (p * band).sum(-1), "student_band_mass": (q * band).sum(-1),
                "teacher_first_token": p[..., 0], "student_first_token": q[..., 0],
                "teacher_max": p.amax(-1), "teacher_local_mass": (p * local).sum(-1),
            }
            stats.append({k: (v * valid).sum((0, 2)) for k, v in values.items()})  # [H] sums over rows
        layer_sums = {k: torch.stack([s[k] for s in stats]) for k in stats[0]}
        sums = layer_sums if sums is None else {k: sums[k] + layer_sums[k] for k in sums}
        rows += int(mask.sum())
    return {k: v / rows for k, v in sums.items()}


def head_pattern(stats, layer, head):
    labels = []
    if stats["teacher_max"][layer, head] > 0.5:
        labels.append("sharp")
    if stats["teacher_local_mass"][layer, head] > 0.5:
        labels.append("local")
    if stats["teacher_first_token"][layer, head] > 0.3:
        labels.append("first-token")
    return "+".join(labels) or "spread"


def report(name, stats, worst=8):
    layers, heads = stats["kl"].shape
    print(f"\n## {name}: mean KL {stats['kl'].mean():.3f}, total variation {stats['tv'].mean():.3f}")
    print(f"{'layer':>5} {'KL':>6} {'TV':>6} {'logit range':>11} {'band mass T/S':>14} {'first token T/S':>16}")
    for layer in range(layers):
        print(f"{layer:>5} {stats['kl'][layer].mean():6.3f} {stats['tv'][layer].mean():6.3f} "
              f"{stats['teacher_logit_range'][layer].mean():11.2f} "
              f"{stats['teacher_band_mass'][layer].mean():6.3f}/{stats['student_band_mass'][layer].mean():.3f} "
              f"{stats['teacher_first_token'][layer].mean():7.3f}/{stats['student_first_token'][layer].mean():.3f}")
    order = stats["kl"].flatten().argsort(descending=True)[:worst]
    print(f"heads missed most (layer.head: KL, TV, teacher pattern, first-token mass T/S):")
    for index in order.tolist():
        layer, head = divmod(index, heads)
        print(f"  {layer}.{head}: KL {stats['kl'][layer, head]:.3f}, TV {stats['tv'][layer, head]:.3f}, "
              f"{head_pattern(stats, layer, head)}, {stats['teacher_first_token'][layer, head]:.2f}/"
              f"{stats['student_first_token'][layer, head]:.2f}")
    patterns = {}
    for layer in range(layers):
        for head in range(heads):
            patterns.setdefault(head_pattern(stats, layer, head), []).append(float(stats["kl"][layer, head]))
    print("mean KL by teacher pattern: " + ", ".join(f"{k} {sum(v) / len(v):.3f} ({len(v)} heads)"
                                                     for k, v in sorted(patterns.items())))


def transferred_student(teacher_path, tokenizer, variant, scale, steps, text_path, seed, terms=()):
    """The source converted with `variant` (logit scale up to `scale`; 0: none; `terms`: boolean config fields
    switched on, e.g. first_token_bias) and transferred `steps` steps."""
    overrides = {"attention_variant": variant, **{term: True for term in terms}}
    if scale:
        overrides["logit_scale_max"] = float(scale)
    teacher = AutoModel.from_pretrained(teacher_path)
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, **overrides)
    if steps:
        texts = nprf_hf.read_transfer_texts(text_path)
        nprf_hf.attention_transfer(student, teacher, tokenizer, texts, steps=steps, seed=seed, show_progress=False)
    return student.eval()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", default=default_teacher(), help="the softmax source (default: MiniLM of the wheel)")
    parser.add_argument("--student", default=None, help="a converted folder (else --variants converts and transfers)")
    parser.add_argument("--variants", nargs="+", default=["normalized_softmax:30", "nprf:8", "nprf_near:30"],
                        help="VARIANT:LOGIT_SCALE_MAX[+TERM...] (0 = none; TERM: a boolean config field switched on, "
                        "e.g. first_token_bias), each converted and transferred on its own")
    parser.add_argument("--transfer-steps", type=int, default=150)
    parser.add_argument("--transfer-text", default=os.path.join(DATA, "wikitext-2", "valid.txt"))
    parser.add_argument("--held-out", default=os.path.join(DATA, "glue", "SST-2", "dev.tsv"),
                        help="held-back sentences: a GLUE TSV (text first) or a text file")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None,
                        help="instead of --held-out: each GLUE task's dev inputs (MRPC as sentence pairs)")
    parser.add_argument("--sentences", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="JSON path for every statistic")
    args = parser.parse_args(argv)
    if args.teacher is None:
        parser.error("--teacher: the softmax source of the student (a folder or Hub id)")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.teacher)
    teacher = AutoModel.from_pretrained(args.teacher, attn_implementation="eager").eval()
    if args.tasks:
        held_out = {task: task_texts(task, args.sentences) for task in args.tasks}
    else:
        held_out = {os.path.basename(os.path.dirname(args.held_out)) or args.held_out:
                    sentences(args.held_out, args.sentences)}
    students = {}
    if args.student:
        students[args.student] = lambda: AutoModel.from_pretrained(args.student, trust_remote_code=True).eval()
    else:
        for spec in args.variants:
            variant, _, rest = spec.partition(":")
            scale, *terms = rest.split("+")
            students[spec] = (lambda v=variant, s=scale, t=tuple(terms): transferred_student(
                args.teacher, tokenizer, v, float(s or 0), args.transfer_steps, args.transfer_text, args.seed, t))
    results = {label: {} for label in held_out}
    for name, build in students.items():
        start = time.perf_counter()
        student = build()
        config = student.config
        band = rpe_band_width(config.rpe_num_buckets, config.rpe_max_distance)
        for label, texts in held_out.items():
            stats = attention_statistics(teacher, student, tokenizer, texts, band)
            report(f"{label}, {name} ({config.attention_variant}, logit_scale_max {config.logit_scale_max}; "
                   f"{time.perf_counter() - start:.0f} s)", stats)
            results[label][name] = {k: v.tolist() for k, v in stats.items()}
    summary(results)
    if args.output:
        write_json(args.output, {"teacher": args.teacher, "held_out": {k: len(v) for k, v in held_out.items()},
                                 "transfer_steps": None if args.student else args.transfer_steps,
                                 "transfer_text": None if args.student else args.transfer_text, "results": results})


def summary(results):
    """One line per student: mean KL / TV on each held-out set, side by side (the split of the loss)."""
    labels = list(results)
    print("\n## mean KL / total variation to the teacher, per held-out set")
    print(f"{'student':<24}" + "".join(f"{label:>16}" for label in labels))
    for name in results[labels[0]]:
        cells = (results[label][name] for label in labels)
        print(f"{name:<24}" + "".join(f"{torch.tensor(c['kl']).mean():>9.3f} / {torch.tensor(c['tv']).mean():.3f}"
                                      for c in cells))


if __name__ == "__main__":
    main()
