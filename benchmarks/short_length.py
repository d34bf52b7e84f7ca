"""GLUE-length benchmark: a whole NPRF model against its softmax source (SDPA), side by side in one run.

For each model size (MiniLM: 6 layers, hidden 384, 12 heads; RoBERTa-base: 12 layers, hidden 768, 12
heads) and each (batch, length) point: a random softmax BERT with SDPA and its NPRF conversion (the same
weights, `convert_to_nprf`), padded batches (every row a random length between half and all of the
length, as tokenized GLUE batches are), median time of the forward pass (inference mode) and of a
training step (forward + backward of the summed outputs), and the ratio NPRF / SDPA. Runs alternate
between the two models so that drifts of the machine hit both. Training steps are timed at each --dropout
(hidden and attention dropout of both models): 0 is SDPA's best case (its fused kernel), 0.1 is what
fine-tuning a BERT checkpoint gets (SDPA then takes its unfused path; NPRF applies no attention dropout).
Several `--features` values convert one NPRF model per m and time them all in the same alternating runs (the
product's FLOPs grow with m: what a smaller m buys at these lengths).

    python benchmarks/short_length.py --threads 2 --output benchmarks/results/short_length_cpu.json
    python benchmarks/short_length.py --sizes minilm --features 16 32 64 --dropout 0 --output ...
    python benchmarks/short_length.py --sizes minilm --features 16 --modes eager compiled --dropout 0 --output ...
    python benchmarks/short_length.py --device cuda --dtype bfloat16 [--compile] --output ...

`--dtype` casts both models (parameters and compute); `--modes eager compiled` times every model both eagerly and
through `torch.compile` in the same alternating runs (`--compile` = `--modes compiled`), the untimed warm-ups
absorbing the compile: each row compares NPRF with SDPA in its own mode, and also with the faster SDPA of the
modes run (what a user who may compile either model compares). On CUDA the padded batches give SDPA a mask, so
it runs its memory-efficient kernel rather than flash (what a padded GLUE batch gets).

`--busy-cores CORE...` (issue 45): every forward and training-step timing is taken again right after the quiet one,
in the same process and the same alternating runs, with one spinning process on each named core
(`benchmarking.competing_load`); each row gains `forward_busy` and `train_step_busy`: both models' busy seconds, busy /
quiet, and NPRF's busy / quiet over SDPA's (the target is <= 1.2):

    python benchmarks/short_length.py --sizes minilm --points 32x128 8x512 --dropout 0 --threads 2 --busy-cores 0
"""

import argparse
import os
import statistics
import sys

import torch

from nprf_hf import convert_to_nprf
from nprf_hf.benchmarking import (DTYPE_NAMES, MODEL_SIZES as SIZES, add_busy_cores_argument, alternating_times,
                                  busy_comparison, busy_line, device_name, padded_batch, parse_busy_cores,
                                  quiet_then_busy, torch_dtype, write_json)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(ROOT, "runs", "benchmarks", "short_length.json")
MODES = ("eager", "compiled")


def step(model, inputs, train):
    if not train:
        with torch.inference_mode():
            model(**inputs)
        return
    model(**inputs).last_hidden_state.sum().backward()


def time_pair(models, inputs, train, repeats, device=torch.device("cpu"), warmups=1):
    """Median seconds of each model, runs alternating (`warmups` untimed runs each first: a compiled model may
    compile again on its second call)."""
    for model in models.values():
        model.train(train)
    calls = {name: (lambda model=model: step(model, inputs, train)) for name, model in models.items()}
    times = alternating_times(calls, repeats, device, warmup=warmups,
                              after=lambda name: models[name].zero_grad(set_to_none=True))
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="model sizes (default: all)")
    parser.add_argument("--points", nargs="+", default=["32x128", "8x512"], metavar="BxN",
                        help="batch x length points (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per model and point (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:0, ...) (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="both models' dtype (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=MODES,
                        help="eager and/or torch.compile'd models, all timed in the same alternating runs "
                             "(default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="the same as --modes compiled")
    parser.add_argument("--features", type=int, nargs="+", default=[64],
                        help="NPRF random features m; several values time one NPRF model each in the same alternating "
                             "runs, one row per m (default: %(default)s)")
    parser.add_argument("--dropout", nargs="+", type=float, default=[0.0, 0.1],
                        help="dropout probabilities of the training steps (default: %(default)s)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON path (default: a scratch file under runs/)")
    add_busy_cores_argument(parser)
    args = parser.parse_args(argv)
    parse_busy_cores(parser, args)
    try:
        points = [tuple(int(v) for v in point.lower().split("x")) for point in args.points]
    except ValueError:
        parser.error(f"--points takes BxN pairs such as 32x128, got {args.points}")
    if any(len(p) != 2 or min(p) < 1 for p in points):
        parser.error(f"--points takes BxN pairs of positive integers, got {args.points}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if min(args.features) < 1:
        parser.error(f"--features takes positive integers, got {args.features}")
    args.features = list(dict.fromkeys(args.features))  # one model per m
    if any(not 0 <= p < 1 for p in args.dropout):
        parser.error(f"--dropout takes probabilities in [0, 1), got {args.dropout}")
    if args.compile:
        args.modes = ["compiled"]
    args.modes = list(dict.fromkeys(args.modes))
    compiling = "compiled" in args.modes
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warmups = 2 if compiling else 1
    if compiling:
        # dropout changes and train/eval switches retrace: keep them compiled instead of falling back to eager
        torch._dynamo.config.cache_size_limit = 64
    from transformers import BertConfig, BertModel

    rows = []
    for size in args.sizes:
        longest = max(n for _, n in points)
        config = BertConfig(**SIZES[size], max_position_embeddings=max(512, longest), hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        torch.manual_seed(0)
        softmax = BertModel(config)
        eager = {"sdpa": softmax, **{m: convert_to_nprf(softmax, num_random_features=m) for m in args.features}}
        for model in eager.values():
            model.to(device=device, dtype=torch_dtype(args.dtype))
        # a compiled model wraps the eager one: the same parameters, no second copy
        models = {(mode, name): torch.compile(model) if mode == "compiled" else model
                  for mode in args.modes for name, model in eager.items()}
        for batch, length in points:
            input_ids, attention_mask = padded_batch(batch, length, config.vocab_size)
            inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
            forward, forward_busy = quiet_then_busy(  # eval mode: no dropout
                lambda: time_pair(models, inputs, train=False, repeats=args.repeats, device=device, warmups=warmups),
                args.busy_cores)
            for probability in args.dropout:
                for model in models.values():
                    for module in model.modules():
                        if isinstance(module, torch.nn.Dropout):
                            module.p = probability
                training, training_busy = quiet_then_busy(
                    lambda: time_pair(models, inputs, train=True, repeats=args.repeats, device=device, warmups=warmups),
                    args.busy_cores)
                timed = {"forward": forward, "train_step": training}
                busy = {"forward": forward_busy, "train_step": training_busy}
                # one row per mode and NPRF model, each against the SDPA times of the same runs
                for mode in args.modes:
                    for m in args.features:
                        row = {"size": size, "batch": batch, "length": length, "dropout": probability, "features": m,
                               "mode": mode}
                        text = []
                        for kind, times in timed.items():
                            sdpa, nprf = times[(mode, "sdpa")], times[(mode, m)]
                            fastest = min(times[(other, "sdpa")] for other in args.modes)
                            row[f"{kind}_s"] = {"sdpa": sdpa, "nprf": nprf}
                            row[f"{kind}_nprf_over_sdpa"] = nprf / sdpa
                            row[f"{kind}_nprf_over_fastest_sdpa"] = nprf / fastest
                            text.append(f"{kind.replace('_', ' ')} sdpa {1e3 * sdpa:8.1f} ms  nprf {1e3 * nprf:8.1f} ms  "
                                        f"ratio {nprf / sdpa:.2f} (fastest sdpa {nprf / fastest:.2f})")
                        rows.append(row)
                        print(f"{size:<13} B={batch:<3} n={length:<5} {mode:<8} m={m:<4} dropout {probability}  "
                              + "   ".join(text), flush=True)
                        if args.busy_cores:  # the same runs under the load: what each model loses to it
                            for kind, times in busy.items():
                                quiet = {"sdpa": timed[kind][(mode, "sdpa")], "nprf": timed[kind][(mode, m)]}
                                row[f"{kind}_busy"] = busy_comparison(
                                    quiet, {"sdpa": times[(mode, "sdpa")], "nprf": times[(mode, m)]}, baseline="sdpa")
                                print(f"{'':<13} busy (cores {args.busy_cores}) {kind.replace('_', ' ')}: "
                                      + busy_line(row[f"{kind}_busy"], "ms", 1e3), flush=True)
    result = {
        "settings": {**vars(args), "torch": torch.__version__, "machine": device_name(device)},
        "rows": rows,
        "command": "python benchmarks/short_length.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
