"""Generation benchmark: time and memory per new token against the context length (issue 14).

A RoBERTa-base-sized causal LM (12 layers, hidden 768, 12 heads, feed-forward 3072, vocabulary 50265),
batch 1: a random prompt of `context` tokens is prefilled, then `--new-tokens` tokens are decoded
greedily, one forward pass per token, under `torch.inference_mode()`: the loop of
`generate(do_sample=False)` without its logits processors, and like it computing the logits of the
last position only (`logits_to_keep=1`). Variants:

* ``nprf``: `NPRFRobertaForCausalLM` (`position_embedding_type="none"`, unidirectional T5 buckets) with
  its default `NPRFCache`: per layer the far sums S, z and the last W - 1 keys' features and values;
* ``softmax``: `RobertaForCausalLM` with SDPA attention and HF's `DynamicCache` (keys and values of
  every past token), its absolute position table extended to the longest context + new tokens;
* ``nprf_kv`` (not run by default): the NPRF model with a `DynamicCache`, the path NPRF decoders took
  before issue 14 (the attention over every cached key recomputed at each step);
* ``nprf_static`` (not run by default): the NPRF model with `NPRFStaticCache` (issue 25, what
  `generate(cache_implementation="static")` uses: the same state, written in place), eager;
* ``nprf_compiled`` (not run by default): the same with every decode step through
  `torch.compile(model, fullgraph=True, dynamic=False)` (`--compile-backend`, `--compile-mode`), the
  prefill eager as in generate(); compiled during the untimed warm-up tokens (at least one), and the
  number of graphs compiled is reported (1: no recompile as the context grows).

Reported per (variant, context): prefill time; time per new token (the median over the decoded
tokens, and their mean; the first `--warmup-tokens` decoded tokens are not timed); the peak memory
increase while decoding (over the model, the prompt and the prefilled cache); the cache's bytes per
layer after the last token.
Memory is measured as in `long_sequence.py` (peak RSS on CPU, `max_memory_allocated` on CUDA), each
(variant, context) in a fresh forked (CPU) or spawned (CUDA) process (``--isolation process``).

``--dtype`` (default float32) casts every variant's model, the softmax baseline included, with
`model.to(dtype)`. The KV cache follows the dtype; the NPRF caches stay in float32 (the attention
computes its features and sums in float32 under bfloat16/float16), so ``cache_bytes_per_layer`` is
what each cache really stores. The dtype is recorded on every result and in ``meta.dtype``.

The full run (see the README for its run time):

    python benchmarks/generation.py --device cpu --threads 2 --contexts 512 1024 2048 4096 8192 16384 --new-tokens 256

`--busy-cores CORE...` (issue 45): in the same process, right after a point's quiet decode, the prompt is prefilled
into a fresh cache and decoded again (the same tokens, the same contexts) with one spinning process on each named
core (`benchmarking.competing_load`): each result gains its busy prefill and time per token and their busy / quiet,
the ratios NPRF's busy / quiet per token over softmax's, and a busy table is printed:

    python benchmarks/generation.py --contexts 512 8192 --new-tokens 64 --threads 2 --busy-cores 0 \
        --output runs/benchmarks/generation_busy.json --plot ''

On a CUDA GPU in bfloat16:

    python benchmarks/generation.py --device cuda --dtype bfloat16 --variants nprf softmax nprf_compiled \\
        --output runs/benchmarks/generation_cuda_bf16.json --plot runs/benchmarks/generation_cuda_bf16.png
"""

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import time
import traceback

import torch

from nprf_hf.benchmarking import (DTYPE_NAMES, PeakMemory, add_busy_cores_argument, busy_comparison, busy_line,
                                  competing_load, machine_description, parse_busy_cores, timed, torch_dtype,
                                  write_json)


VARIANTS = ("nprf", "softmax", "nprf_kv", "nprf_static", "nprf_compiled")
DEFAULT_VARIANTS = ("nprf", "softmax")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUTPUT = os.path.join(HERE, "results", "generation_cpu.json")
DEFAULT_PLOT = os.path.join(HERE, "plots", "generation.png")


def build_model(variant, args, max_length):
    """The causal LM of one variant: random weights, eval mode, on args.device in args.dtype."""
    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=4 * args.hidden_size,
        is_decoder=True,
        pad_token_id=1,
    )
    if variant.startswith("nprf"):
        from nprf_hf import NPRFRobertaConfig, NPRFRobertaForCausalLM

        extra = {} if args.num_features is None else {"num_random_features": args.num_features}
        extra["attention_algorithm"] = args.algorithm
        config = NPRFRobertaConfig(position_embedding_type="none", **common, **extra)
        model = NPRFRobertaForCausalLM(config)
    else:
        from transformers import RobertaConfig, RobertaForCausalLM

        config = RobertaConfig(max_position_embeddings=max_length + 2, **common)
        config._attn_implementation = "sdpa"
        model = RobertaForCausalLM(config)
        if model.config._attn_implementation != "sdpa":
            raise RuntimeError("RobertaForCausalLM did not keep attn_implementation='sdpa'")
    return model.eval().to(device=args.device, dtype=torch_dtype(args.dtype))


def new_cache(variant, model):
    """The cache a variant decodes with."""
    if variant == "nprf":
        from nprf_hf.cache_nprf import NPRFCache

        return NPRFCache(model.config)
    if variant in ("nprf_static", "nprf_compiled"):
        from nprf_hf.cache_nprf import NPRFStaticCache

        return NPRFStaticCache(model.config)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_bytes_per_layer(cache):
    """Bytes of layer 0's cached tensors (every layer holds the same)."""
    layer = cache.layers[0]
    if hasattr(layer, "nbytes"):
        return layer.nbytes
    return sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)


def decode(variant, model, step, prompt, args, memory=None):
    """Prefill `prompt` into a new cache, then decode args.warmup_tokens untimed and args.new_tokens timed greedy
    tokens (the timed ones inside `memory`, a context manager) -> (prefill s, warm-up s, per-token s, cache)."""
    device = prompt.device
    cache = new_cache(variant, model)

    def next_token(token):
        return step(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)

    def warm_up(token):
        for _ in range(args.warmup_tokens):  # untimed: first calls pay one-off costs (the compile, if any)
            token = next_token(token)
        return token

    with torch.inference_mode():
        # as generate(): the prompt's last logits only
        prefill, token = timed(lambda: model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                               .logits[:, -1:].argmax(-1), device)
        warmup, token = timed(lambda: warm_up(token), device)
        times = []
        with memory or contextlib.nullcontext():
            for _ in range(args.new_tokens):
                seconds, token = timed(lambda: next_token(token), device)
                times.append(seconds)
    return prefill, warmup, times, cache


def measure_point(variant, context, args):
    """Prefill `context` random tokens, decode args.new_tokens greedily -> result dict (with --busy-cores, all of it
    again under the load)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = build_model(variant, args, context + args.new_tokens + args.warmup_tokens)
    prompt = torch.randint(3, args.vocab_size, (1, context), device=device)
    step = model
    if variant == "nprf_compiled":
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        options = {} if args.compile_mode is None else {"mode": args.compile_mode}
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=args.compile_backend, **options)
    memory = PeakMemory(device)
    prefill, warmup, times, cache = decode(variant, model, step, prompt, args, memory)
    compiled = {}
    if variant == "nprf_compiled":
        compiled = {"compiled_graphs": counters["stats"]["unique_graphs"], "warmup_s": warmup}
    busy = {}
    if args.busy_cores:  # the same decode again, busy; the spinners stop by themselves by the time cap at the latest
        with competing_load(args.busy_cores, max_seconds=args.time_cap):
            busy_prefill, _, busy_times, _ = decode(variant, model, step, prompt, args)
        busy = {
            "busy_prefill_s": busy_prefill,
            "busy_time_per_token_s": statistics.median(busy_times),
            "busy_mean_time_per_token_s": sum(busy_times) / len(busy_times),
            "busy_over_quiet": statistics.median(busy_times) / statistics.median(times),
            "busy_prefill_over_quiet": busy_prefill / prefill,
        }
    return {
        "status": "ok",
        "prefill_s": prefill,
        "decode_s": sum(times),
        "time_per_token_s": statistics.median(times),  # robust to a busy machine's stalls
        "mean_time_per_token_s": sum(times) / len(times),
        "decode_peak_memory_bytes": memory.increase,
        "memory_method": memory.method,
        "cache_bytes_per_layer": cache_bytes_per_layer(cache),
        "cache_class": type(cache).__name__,
        "final_length": int(cache.get_seq_length()),
        **compiled,
        **busy,
    }


def _safe_measure(variant, context, args):
    try:
        return measure_point(variant, context, args)
    except Exception as error:  # reported in the results, the sweep goes on
        text = str(error).lower()
        status = "out of memory" if isinstance(error, MemoryError) or "out of memory" in text else "error"
        error_text = f"{type(error).__name__}: {str(error)[:300]}"
        return {"status": status, "error": error_text, "traceback": traceback.format_exc()[-2000:]}


def _child(connection, variant, context, args):
    connection.send(_safe_measure(variant, context, args))
    connection.close()


def run_point(variant, context, args):
    """One point, in a fresh process unless --isolation none."""
    if args.isolation == "none":
        return _safe_measure(variant, context, args)
    multiprocessing_context = multiprocessing.get_context("spawn" if args.device.startswith("cuda") else "fork")
    receiver, sender = multiprocessing_context.Pipe(duplex=False)
    process = multiprocessing_context.Process(target=_child, args=(sender, variant, context, args))
    process.start()
    sender.close()
    result = None
    if receiver.poll(args.time_cap):
        try:
            result = receiver.recv()
        except EOFError:
            result = None
    if process.is_alive() and result is None:
        process.kill()
        process.join()
        return {"status": "time cap", "error": f"no result within --time-cap {args.time_cap:g} s"}
    process.join()
    if result is None:
        killed = process.exitcode is not None and process.exitcode == -9
        return {"status": "out of memory" if killed else "error", "error": f"worker exit code {process.exitcode}"}
    return result


def ratios(results, contexts):
    """softmax / NPRF time per token at each context; NPRF at the longest / shortest context."""
    index = {(r["variant"], r["context"]): r for r in results if r["status"] == "ok"}
    out = {}
    for context in contexts:
        nprf, softmax = index.get(("nprf", context)), index.get(("softmax", context))
        if nprf and softmax:
            out[f"softmax_over_nprf_per_token_{context}"] = softmax["time_per_token_s"] / nprf["time_per_token_s"]
        if nprf and softmax and "busy_over_quiet" in nprf:
            # issue 45's target: NPRF's busy / quiet per token no worse than 1.2x softmax's
            out[f"busy_slowdown_nprf_over_softmax_{context}"] = nprf["busy_over_quiet"] / softmax["busy_over_quiet"]
    for variant in VARIANTS:
        first, last = index.get((variant, contexts[0])), index.get((variant, contexts[-1]))
        if first and last and len(contexts) > 1:
            growth = last["time_per_token_s"] / first["time_per_token_s"]
            out[f"{variant}_per_token_{contexts[-1]}_over_{contexts[0]}"] = growth
            out[f"{variant}_cache_bytes_{contexts[-1]}_over_{contexts[0]}"] = (
                last["cache_bytes_per_layer"] / first["cache_bytes_per_layer"]
            )
    return out


def summary_table(results, variants, contexts):
    """Plain text: ms per new token side by side, softmax / NPRF, cache MiB per layer, decode peak MiB, prefill s."""
    index = {(r["variant"], r["context"]): r for r in results}

    def cell(variant, context, key, scale, fmt):
        r = index.get((variant, context))
        if r is None:
            return "-"
        if r["status"] != "ok":
            return {"out of memory": "OOM", "time cap": "cap"}.get(r["status"], "err")
        return fmt.format(r[key] * scale)

    header = ["context"] + [f"{v} ms/token" for v in variants]
    if "nprf" in variants and "softmax" in variants:
        header.append("softmax/nprf")
    header += [f"{v} cache MiB/layer" for v in variants] + [f"{v} decode peak MiB" for v in variants]
    header += [f"{v} prefill s" for v in variants]
    rows = []
    for context in contexts:
        row = [str(context)] + [cell(v, context, "time_per_token_s", 1e3, "{:.1f}") for v in variants]
        if "nprf" in variants and "softmax" in variants:
            a, b = index.get(("nprf", context)), index.get(("softmax", context))
            ok = a and b and a["status"] == b["status"] == "ok"
            row.append(f"{b['time_per_token_s'] / a['time_per_token_s']:.2f}x" if ok else "-")
        row += [cell(v, context, "cache_bytes_per_layer", 2**-20, "{:.2f}") for v in variants]
        row += [cell(v, context, "decode_peak_memory_bytes", 2**-20, "{:.0f}") for v in variants]
        row += [cell(v, context, "prefill_s", 1.0, "{:.2f}") for v in variants]
        rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header] + rows]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"{r['variant']} context={r['context']}: {r['status']} ({r.get('error', '')})")
    return "\n".join(lines)


def busy_comparisons(results, contexts):
    """{context: benchmarking.busy_comparison of the time per token of every variant timed busy, against softmax}."""
    out = {}
    for context in contexts:
        timed = [r for r in results if r["context"] == context and r["status"] == "ok" and "busy_over_quiet" in r]
        if timed:
            names = [r["variant"] for r in timed]
            out[context] = busy_comparison({r["variant"]: r["time_per_token_s"] for r in timed},
                                           {r["variant"]: r["busy_time_per_token_s"] for r in timed},
                                           baseline="softmax" if "softmax" in names else names[0])
    return out


COLORS = {"nprf": "tab:red", "softmax": "tab:blue", "nprf_kv": "tab:orange", "nprf_static": "tab:purple",
          "nprf_compiled": "tab:green"}
LABELS = {"nprf": "NPRF + RPE, NPRFCache", "softmax": "RoBERTa SDPA, KV cache", "nprf_kv": "NPRF + RPE, KV cache",
          "nprf_static": "NPRF + RPE, NPRFStaticCache", "nprf_compiled": "NPRF + RPE, NPRFStaticCache, compiled step"}


def plot(results, meta, path):
    """Time per new token and cache bytes per layer against the context length (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [
        ("time_per_token_s", 1e3, "time per new token (ms)"),
        ("cache_bytes_per_layer", 2**-20, "cache per layer (MiB)"),
        ("decode_peak_memory_bytes", 2**-20, "peak memory while decoding (MiB)"),
    ]
    for axis, (key, scale, label) in zip(axes, panels):
        for variant in meta["variants"]:
            ok = [r for r in results if r["variant"] == variant and r["status"] == "ok"]
            ok.sort(key=lambda r: r["context"])
            if ok:
                axis.plot([r["context"] for r in ok], [max(r[key] * scale, 1e-3) for r in ok], marker="o",
                          color=COLORS[variant], label=LABELS[variant])
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("context length (tokens)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    machine = meta["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, {meta['args']['threads']} threads"
    args = meta["args"]
    figure.suptitle(f"Causal LM, {args['num_layers']} layers, hidden {args['hidden_size']}, batch 1, "
                    f"{args['new_tokens']} new tokens, {args.get('dtype', 'float32')} ({where})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:0, ...)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--new-tokens", type=int, default=256, help="timed decoded tokens per context")
    parser.add_argument("--warmup-tokens", type=int, default=4, help="decoded before timing starts")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=50265)
    parser.add_argument("--num-features", type=int, default=None, help="NPRF random features m (default: config's)")
    parser.add_argument("--algorithm", default="auto", help="NPRF attention_algorithm of the prefill")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of nprf_compiled")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode of nprf_compiled (e.g. reduce-overhead)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="every variant's parameters and compute (model.to(dtype)) (default: %(default)s)")
    parser.add_argument("--time-cap", type=float, default=1800.0, help="seconds per (variant, context) point")
    parser.add_argument("--isolation", default="process", choices=("process", "none"))
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON path")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path ('' = no plot)")
    add_busy_cores_argument(parser, when="right after each point's quiet decode, in its process")
    args = parser.parse_args(argv)
    parse_busy_cores(parser, args)
    if any(n < 1 for n in args.contexts) or args.new_tokens < 1 or args.warmup_tokens < 0:
        parser.error("--contexts and --new-tokens must be positive, --warmup-tokens >= 0")
    if "nprf_compiled" in args.variants and args.warmup_tokens < 1:
        parser.error("nprf_compiled compiles during the warm-up: --warmup-tokens >= 1")
    if args.num_layers < 1 or args.threads < 1:
        parser.error("--num-layers and --threads must be >= 1")
    if args.hidden_size % args.num_heads:
        parser.error(f"--hidden-size {args.hidden_size} is not a multiple of --num-heads {args.num_heads}")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cpu or cuda[:i], got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    args.contexts = sorted(set(args.contexts))
    return args


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    results = []
    for context in args.contexts:
        for variant in args.variants:
            result = run_point(variant, context, args)
            result.update(variant=variant, context=context, dtype=args.dtype)
            results.append(result)
            status = result["status"]
            if status == "ok":
                status = f"{result['time_per_token_s'] * 1e3:.1f} ms/token"
                if "busy_over_quiet" in result:
                    status += (f", busy {result['busy_time_per_token_s'] * 1e3:.1f} ms/token "
                               f"({result['busy_over_quiet']:.2f}x quiet)")
            print(f"{variant:>13} {args.dtype} context {context:>6}: {status}", flush=True)
    meta = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (sys.argv[1:] if argv is None else list(argv))),
        "args": dict(vars(args)),
        "variants": args.variants,
        "dtype": args.dtype,
        "machine": machine_description(args.device, args.threads),
        "memory_method": next((r["memory_method"] for r in results if r.get("memory_method")), None),
        "total_runtime_s": round(time.perf_counter() - started, 1),
    }
    table = f"dtype {args.dtype}\n" + summary_table(results, args.variants, args.contexts)
    summary = ratios(results, args.contexts)
    busy = busy_comparisons(results, args.contexts)
    if busy:
        table += f"\nbusy (one spinning process on each of cores {args.busy_cores}), per new token:\n" + "\n".join(
            f"{context:>7}  {busy_line(comparison, 'ms', 1e3)}" for context, comparison in busy.items())
    print(table)
    for name, value in summary.items():
        print(f"{name}: {value:.2f}")
    print(f"total runtime {meta['total_runtime_s']:.0f} s; command: {meta['command']}")
    write_json(args.output, {"meta": meta, "results": results, "ratios": summary, "table": table,
                             **({"busy": busy} if busy else {})})
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot(results, meta, args.plot)
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))
    return results


if __name__ == "__main__":
    main()
