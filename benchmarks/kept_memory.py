"""What a training step keeps from forward to backward, and its peak allocation, NPRF against SDPA, in bytes.

`long_sequence.py` measures peak memory as the process's resident set, which is what a user sees but moves by tens
of MiB from run to run. This script counts instead, for the same models (`nprf_hf.benchmarking.long_sequence_model`),
one step of `mean(last_hidden_state ** 2)`:

* kept: every tensor autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`), each storage once,
  parameters and buffers left out (they are held anyway), listed by shape;
* peak: the most bytes the allocator held above the start of the step (CPU: torch.profiler's memory events; CUDA:
  `torch.cuda.max_memory_allocated`).

Both are exact and repeat to the byte, so a difference of one tensor shows. Example (the 16,384-token training
memory of issue 25, at 2 layers):

    python benchmarks/kept_memory.py --lengths 16384 --num-layers 2 --output benchmarks/results/kept_memory_16k
"""

import argparse
import collections
import sys

import torch

from nprf_hf.benchmarking import long_sequence_model, peak_allocated, write_json

VARIANTS = ("nprf", "nprf-keep", "sdpa")


def kept_for_backward(model, input_ids):
    """(bytes, {(shape, dtype): count}) of the tensors autograd keeps for backward, and the step's output."""
    held = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = (storage.nbytes(), (tuple(tensor.shape), str(tensor.dtype)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden = model(input_ids=input_ids).last_hidden_state
    shapes = collections.Counter(key for _, key in seen.values())
    return sum(nbytes for nbytes, _ in seen.values()), shapes, hidden


def measure(variant, n, args):
    torch.manual_seed(0)
    model = long_sequence_model(variant, args, n).to(args.device).train()
    input_ids = torch.randint(5, args.vocab_size, (1, n), device=args.device)
    kept, shapes, hidden = kept_for_backward(model, input_ids)
    del hidden
    model.zero_grad(set_to_none=True)
    peak = peak_allocated(lambda: model(input_ids=input_ids).last_hidden_state.float().pow(2).mean().backward(),
                          args.device)
    return {"variant": variant, "n": n, "kept_bytes": kept, "peak_bytes": peak,
            "kept_by_shape": [[list(shape), dtype, count] for (shape, dtype), count in sorted(shapes.items())]}


def table(results, variants):
    mib = 2**20
    lines = ["    n  " + "  ".join(f"{v + ' kept':>14}  {v + ' peak':>14}" for v in variants)
             + ("  " + "  ".join(f"{v + '-sdpa kept':>16}  {v + '-sdpa peak':>16}" for v in variants if v != "sdpa")
                if "sdpa" in variants else "")]
    for n in sorted({r["n"] for r in results}):
        row = {r["variant"]: r for r in results if r["n"] == n}
        cells = [f"{row[v]['kept_bytes'] / mib:14.2f}  {row[v]['peak_bytes'] / mib:14.2f}" for v in variants]
        if "sdpa" in variants:
            base = row["sdpa"]
            cells += [f"{(row[v]['kept_bytes'] - base['kept_bytes']) / mib:+16.3f}  "
                      f"{(row[v]['peak_bytes'] - base['peak_bytes']) / mib:+16.3f}" for v in variants if v != "sdpa"]
        lines.append(f"{n:5d}  " + "  ".join(cells))
    return "MiB; kept = saved for backward, peak = allocated above the start of the step\n" + "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384], help="tokens per step (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="as in long_sequence.py (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=2, help="encoder layers (default: %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=768, help="model width (default: %(default)s)")
    parser.add_argument("--num-heads", type=int, default=12, help="attention heads (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=50265, help="embedding rows (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--output", default=None, help="path stem: writes STEM.json (default: print only)")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.lengths) or args.num_layers < 1 or args.hidden_size % args.num_heads:
        parser.error("need positive --lengths and --num-layers, and --hidden-size a multiple of --num-heads")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    args.num_features = args.algorithm = None  # the config's defaults, as long_sequence.py without its options
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [measure(variant, n, args) for n in args.lengths for variant in args.variants]
    text = table(results, args.variants)
    print(text)
    if args.output:
        command = "python benchmarks/kept_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_json(args.output + ".json", {"meta": {"command": command, "args": vars(args), "torch": torch.__version__},
                                           "results": results, "table": text})
    return results


if __name__ == "__main__":
    main()
