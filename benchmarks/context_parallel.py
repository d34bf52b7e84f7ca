"""Context parallelism on the CPU: one long sequence on 1 process, then sharded over P gloo processes
(`nprf_hf.context_parallel`), one training step (forward + backward) of an NPRF BERT encoder.

Reported per (length, P), for every process: peak memory of the step, time per step, and the bytes one rank
receives per layer in the forward all-gather (counted from the tensors gathered, and checked against
`nprf_context_parallel.communicated_bytes`), beside what ring attention would receive for the same shards (every
other shard's K and V: 2 (P - 1) / P n d H bytes per element). Backward all-reduces the gradient of the same
gathered tensor (gloo has no reduce-scatter): P times the forward's elements.

Memory: the increase of the process's peak resident set size over its size just before the step (Linux: the peak
is reset by writing "5" to /proc/self/clear_refs, then read from VmHWM), on the first step in a fresh process, with
the model and the inputs in the baseline. Time: the second step (the first is a warm-up), or the first alone when
it took longer than --single-step-above seconds. Every process runs --threads-per-process threads (default 1: on a
shared 2-core machine one process with 2 OpenMP threads ran a 1,024-token step 12x slower than with 1, waiting on
its busy second core), so P processes use P cores: times compare one core with P.

Example (MiniLM-L6's shape; benchmarks/results/context_parallel_cpu16.json ran on an idle 16-core host, where at
32,768 tokens P = 2 took 0.55x one process's peak memory per process and 0.52x its time per step;
context_parallel_cpu.json on the shared 2-core machine, whose times wait for cores):

    python benchmarks/context_parallel.py --lengths 8192 32768 --world-sizes 1 2

At 8,192 tokens the ratio is higher (0.87x there): a 4,096-token shard's features fall under the size from which
training recomputes them in backward (`RECOMPUTE_MIN_BYTES`), so the shards keep theirs while one process recomputes.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch

from nprf_hf.benchmarking import PeakMemory, write_json


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-layers", type=int, default=6)  # MiniLM-L6 shape
    parser.add_argument("--hidden-size", type=int, default=384)  # MiniLM's width: 12 heads of 32
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--num-random-features", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--threads-per-process", type=int, default=1)
    parser.add_argument("--single-step-above", type=float, default=60.0)
    parser.add_argument("--output", default=None, help="a JSON file for the results")
    return parser.parse_args(argv)


def free_port():
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def build_model(args):
    from nprf_hf import NPRFBertConfig, NPRFBertModel

    config = NPRFBertConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, intermediate_size=args.intermediate_size,
        num_random_features=args.num_random_features, position_embedding_type="none",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)  # the same weights on every rank
    return NPRFBertModel(config).train()


def worker(rank, world_size, port, length, args, out_dir):
    import torch.distributed as dist

    import nprf_hf
    from nprf_hf import nprf_context_parallel as cp

    torch.set_num_threads(args.threads_per_process)
    sharded = world_size > 1
    if sharded:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = build_model(args)
    input_ids = torch.randint(0, args.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    size = -(-length // world_size)
    lo, hi = rank * size, min(length, (rank + 1) * size)
    shard = input_ids[:, lo:hi].clone()

    cpu_seconds = []  # CPU time of each step: on a busy shared machine wall time also counts the waits for a core
    received = []  # bytes this rank received per all-gather (the others' parts of the gathered tensor)
    gather = cp.all_gather

    def counting_gather(tensor, group=None):
        out = gather(tensor, group)
        received.append((out.shape[0] - 1) * tensor.numel() * tensor.element_size())
        return out

    cp.all_gather = counting_gather

    def step():
        model.zero_grad(set_to_none=True)
        start, cpu = time.perf_counter(), time.process_time()
        if sharded:
            with nprf_hf.context_parallel():
                model(input_ids=shard).last_hidden_state.square().mean().backward()
        else:
            model(input_ids=shard).last_hidden_state.square().mean().backward()
        cpu_seconds.append(time.process_time() - cpu)
        return time.perf_counter() - start

    with PeakMemory("cpu") as memory:
        first = step()
    per_layer = received[: args.num_layers]
    timed = first if first > args.single_step_above else step()
    head_dim = args.hidden_size // args.num_heads
    band = model.encoder.layer[0].attention.self.band_width
    result = {
        "length": length, "world_size": world_size, "rank": rank, "shard": [lo, hi], "threads": torch.get_num_threads(),
        "peak_memory_bytes": memory.increase, "memory_method": memory.method,
        "first_step_s": first, "step_s": timed, "step_cpu_s": cpu_seconds[-1],
        "received_bytes_per_layer": per_layer[0] if per_layer else 0,
        "formula_bytes_per_layer": cp.communicated_bytes(1, args.num_heads, head_dim, args.num_random_features, band,
                                                         world_size) if sharded else 0,
        "ring_attention_bytes_per_layer": cp.ring_attention_bytes(1, args.num_heads, head_dim, length, world_size),
        "band_width": band,
    }
    write_json(os.path.join(out_dir, f"{rank}.json"), result, indent=None)
    if sharded:
        dist.destroy_process_group()


def run_point(length, world_size, args):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(world_size, free_port(), length, args, out_dir), nprocs=world_size, join=True)
        return [json.load(open(os.path.join(out_dir, f"{rank}.json"))) for rank in range(world_size)]


def main(argv=None):
    args = parse_args(argv)
    results = []
    print(f"{'n':>7} {'P':>2} {'rank':>4} {'peak MiB':>9} {'step s':>7} {'cpu s':>7} {'recv KiB/layer':>14} {'ring KiB/layer':>14} "
          f"{'ratio':>7}")
    for length in args.lengths:
        for world_size in args.world_sizes:
            for row in run_point(length, world_size, args):
                results.append(row)
                ring = row["ring_attention_bytes_per_layer"]
                ratio = row["received_bytes_per_layer"] / ring if ring else 0.0
                print(f"{length:>7} {world_size:>2} {row['rank']:>4} {row['peak_memory_bytes'] / 2**20:>9.0f} "
                      f"{row['step_s']:>7.2f} {row['step_cpu_s']:>7.2f} {row['received_bytes_per_layer'] / 1024:>14.1f} {ring / 1024:>14.1f} "
                      f"{ratio:>7.4f}", flush=True)
    for length in args.lengths:
        one = [r["peak_memory_bytes"] for r in results if r["length"] == length and r["world_size"] == 1]
        for world_size in args.world_sizes:
            if world_size > 1 and one:
                most = max(r["peak_memory_bytes"] for r in results if r["length"] == length and r["world_size"] == world_size)
                print(f"n={length}: largest per-process peak at P={world_size} is {most / one[0]:.2f}x one process's")
    if args.output:
        meta = {"args": vars(args), "torch": torch.__version__, "cpus": os.cpu_count(), "argv": sys.argv[1:]}
        write_json(args.output, {"meta": meta, "results": results})
    return results


if __name__ == "__main__":
    main()
