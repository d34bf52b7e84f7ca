"""torch.compile benchmark: an NPRF encoder's inference forward, eager against `torch.compile(model)`, side by side.

An NPRF RoBERTa encoder with random weights (`NPRFRobertaConfig` / `NPRFRobertaModel`, `position_embedding_type="none"`,
so any length works; RoBERTa-base: 12 layers, hidden 768, 12 heads, feed-forward 3072; MiniLM: 6 layers, hidden 384,
12 heads, feed-forward 1536), dropout off. For every point (batch x length, attention algorithm): a padded batch (every
row a random length between half and all of the length, the first row full, as tokenized batches are), then

* eager: the model's forward under `torch.inference_mode()`;
* compiled: `torch.compile(model)` (inductor, default mode) on the same model; its first call, compilation included,
  is reported as the compile time;
* fullgraph (points whose algorithm is dense, or per `--fullgraph`): then `torch.compile(model, fullgraph=True)`
  compiled anew, which also checks that the forward has no graph break;

median time of `--repeats` runs after one warm-up each, runs alternating with eager so that drifts of the machine
hit both, and the largest absolute difference of the outputs (compiled - eager, over real tokens). Dynamo's caches
are reset before every compilation, so every point compiles for its own shapes.

    python benchmarks/compile.py --threads 2
    python benchmarks/compile.py --size minilm --points 8x128 --repeats 3
"""

import argparse
import os
import statistics
import sys

import torch

from nprf_hf import NPRFRobertaConfig, NPRFRobertaModel, functional
# the GLUE-length benchmark's (short_length.py) sizes and batches
from nprf_hf.benchmarking import MODEL_SIZES as SIZES, alternating_times, device_name, padded_batch, timed, write_json


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DEFAULT_POINTS = ["32x128", "8x512", "1x4096", "1x16384:banded"]
DEFAULT_OUTPUT = os.path.join(ROOT, "runs", "benchmarks", "compile.json")


def parse_point(text, algorithms):
    """'BxN' (one point per algorithm of `algorithms`) or 'BxN:algorithm' -> [(batch, length, algorithm)]."""
    size, _, algorithm = text.partition(":")
    batch, length = (int(v) for v in size.lower().split("x"))
    if min(batch, length) < 1 or (algorithm and algorithm not in functional.ALGORITHMS):
        raise ValueError(text)
    return [(batch, length, a) for a in ([algorithm] if algorithm else algorithms)]


def resolved_algorithm(model, algorithm, length):
    """The algorithm `nprf_attention` runs at this length (what `auto` picks)."""
    attention = model.encoder.layer[0].attention.self
    bias = torch.zeros(attention.num_attention_heads, 2 * length - 1)
    features, head_dim = attention.projection.shape[-2], attention.attention_head_size
    return functional._resolve_algorithm(algorithm, bias, length, attention.band_width, features, head_dim + 1, inference=True)[0]


def forward(model, inputs):
    with torch.inference_mode():
        return model(**inputs).last_hidden_state


def time_point(model, inputs, variants, repeats):
    """{variant: (median seconds, first-call seconds, max |output - eager output|)}, runs alternating."""
    calls = {name: (lambda call=call: forward(call, inputs)) for name, call in variants.items()}
    first, outputs = {}, {}
    for name, call in calls.items():
        first[name], outputs[name] = timed(call)  # compiles the compiled variants
    times = alternating_times(calls, repeats)  # after one more warm-up call each
    keep = inputs["attention_mask"].bool()
    difference = {name: (outputs[name][keep] - outputs["eager"][keep]).abs().max().item() for name in variants}
    return {name: (statistics.median(times[name]), first[name], difference[name]) for name in variants}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="roberta-base", choices=list(SIZES), help="model size (default: %(default)s)")
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, metavar="BxN[:ALGORITHM]",
                        help="batch x length points, each with its algorithm or else every one of --algorithms "
                             "(default: %(default)s)")
    parser.add_argument("--algorithms", nargs="+", default=["auto"], choices=functional.ALGORITHMS,
                        help="attention algorithms of the points that name none (default: %(default)s)")
    parser.add_argument("--fullgraph", default="dense", choices=["dense", "all", "none"],
                        help="points that also time torch.compile(fullgraph=True): those that run the dense algorithm "
                             "(auto included), all, or none (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per variant and point, median (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--features", type=int, default=64, help="NPRF random features m (default: %(default)s)")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend; 'aot_eager' checks tracing without inductor's compile time "
                             "(default: %(default)s)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON path (default: a scratch file under runs/)")
    args = parser.parse_args(argv)
    try:
        points = [point for text in args.points for point in parse_point(text, args.algorithms)]
    except ValueError:
        parser.error(f"--points takes BxN or BxN:ALGORITHM (one of {functional.ALGORITHMS}) with positive B and N, "
                     f"got {args.points}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    torch.set_num_threads(args.threads)

    config = NPRFRobertaConfig(**SIZES[args.size], num_random_features=args.features, position_embedding_type="none",
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)
    torch.manual_seed(0)
    model = NPRFRobertaModel(config).eval()
    rows = []
    header = (f"{'point':<22} {'eager s':>9} {'compiled s':>10} {'ratio':>6} {'compile s':>9} {'max |diff|':>10}"
              f" {'fullgraph s':>11} {'fg compile s':>12}")
    print(header, flush=True)
    for batch, length, algorithm in points:
        model.config.attention_algorithm = algorithm
        runs = resolved_algorithm(model, algorithm, length)
        input_ids, attention_mask = padded_batch(batch, length, config.vocab_size, pad_token_id=config.pad_token_id)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=args.backend)
        measured = time_point(model, inputs, {"eager": model, "compiled": compiled}, args.repeats)
        if args.fullgraph == "all" or (args.fullgraph == "dense" and runs == "dense"):
            torch._dynamo.reset()  # or the fullgraph model would reuse the graph just compiled (dynamo caches per code)
            strict = torch.compile(model, backend=args.backend, fullgraph=True)
            variants = {"eager": model, "fullgraph": strict}
            measured["fullgraph"] = time_point(model, inputs, variants, args.repeats)["fullgraph"]
        eager_s, (compiled_s, compile_s, difference) = measured["eager"][0], measured["compiled"]
        row = {
            "batch": batch, "length": length, "algorithm": algorithm, "runs": runs,
            "eager_s": eager_s, "compiled_s": compiled_s, "compiled_over_eager": compiled_s / eager_s,
            "compile_s": compile_s, "max_abs_difference": difference,
        }
        fullgraph_columns = ""
        if "fullgraph" in measured:
            row.update(fullgraph_s=measured["fullgraph"][0], fullgraph_compile_s=measured["fullgraph"][1],
                       fullgraph_max_abs_difference=measured["fullgraph"][2])
            fullgraph_columns = f" {row['fullgraph_s']:>11.3f} {row['fullgraph_compile_s']:>12.1f}"
        rows.append(row)
        point = f"{batch}x{length} {algorithm}" + (f" ({runs})" if runs != algorithm else "")
        print(f"{point:<22} {eager_s:>9.3f} {compiled_s:>10.3f} {row['compiled_over_eager']:>6.2f} {compile_s:>9.1f} "
              f"{difference:>10.1e}{fullgraph_columns}", flush=True)
    result = {
        "settings": {**vars(args), "torch": torch.__version__, "machine": device_name("cpu")},
        "rows": rows,
        "command": "python benchmarks/compile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
