#!/usr/bin/env python
# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Causal language modeling with an NPRF decoder (or a softmax baseline): from scratch or from a checkpoint.

Plain text in, contiguous blocks of `--block_size` tokens out (the text's lines joined, no special tokens),
an Accelerate loop (DDP over processes, `--mixed_precision bf16|fp16`), AdamW with linear warm-up and
cosine decay, gradient clipping, and a JSON line per step (`train_log.jsonl`: loss, gradient norm before
clipping, learning rate, seconds). A non-finite loss stops the run and is recorded (`"diverged": true`),
since the stability of the attention is what some runs measure. `results.json` holds the validation
perplexity (mean token loss over every block of `--validation_file`, exponentiated).

    # from scratch: a fresh NPRF RoBERTa decoder (any config field through --config_overrides)
    python examples/run_clm.py --model_type nprf_roberta --tokenizer_name TOKENIZER \\
        --config_overrides '{"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}' \\
        --train_file ../shared/data/wikitext-2/valid.txt --validation_file ../shared/data/wikitext-2/test.txt \\
        --block_size 256 --max_steps 300 --output_dir runs/clm-nprf
    # the softmax baseline: --model_type roberta; a checkpoint: --model_name_or_path DIR (NPRF or softmax)
    accelerate launch --config_file examples/accelerate/cpu_ddp.yaml examples/run_clm.py ... --threads 1
    # one long block over two processes (an NPRF decoder): each runs half of every block's tokens
    accelerate launch --config_file examples/accelerate/cpu_ddp.yaml examples/run_clm.py ... --context_parallel

The output folder is written whole at the end (a temporary sibling moved into place); a non-empty one is
refused unless `--overwrite_output_dir`.
"""

import argparse
import json
import math
import os
import sys
import time

try:
    import nprf_hf  # noqa: F401  (lazy: torch and transformers come later)
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nprf_hf.hub import SourceNotFoundError, check_load_source


# fresh decoders: --model_type -> the family whose classes build it (the NPRF one is registered by nprf_hf)
FRESH_MODEL_TYPES = ("nprf_roberta", "roberta", "nprf_xlm-roberta", "xlm-roberta")
MIXED_PRECISION = ("no", "bf16", "fp16")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_argument_group("model")
    source.add_argument("--model_name_or_path", help="a causal-LM checkpoint (NPRF or softmax); omit to train from scratch")
    source.add_argument("--model_type", choices=FRESH_MODEL_TYPES, help="architecture of a fresh model (from scratch)")
    source.add_argument("--config_overrides", default="{}",
                        help="JSON object of config fields for a fresh model, e.g. '{\"hidden_size\": 128}'")
    source.add_argument("--tokenizer_name", help="tokenizer (default: the checkpoint's; required from scratch)")
    data = parser.add_argument_group("data")
    data.add_argument("--train_file", required=True, help="plain text file")
    data.add_argument("--validation_file", help="plain text file for the perplexity (omitted: no evaluation)")
    data.add_argument("--block_size", type=int, default=256, help="tokens per training block (default: %(default)s)")
    train = parser.add_argument_group("training")
    train.add_argument("--max_steps", type=int, default=100)
    train.add_argument("--per_device_train_batch_size", type=int, default=8)
    train.add_argument("--per_device_eval_batch_size", type=int, default=8)
    train.add_argument("--learning_rate", type=float, default=5e-4)
    train.add_argument("--weight_decay", type=float, default=0.01)
    train.add_argument("--warmup_steps", type=int, default=0)
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="clip the gradient norm (0 = no clipping)")
    train.add_argument("--mixed_precision", choices=MIXED_PRECISION, default="no",
                       help="autocast dtype (bf16 on CPU and recent GPUs; fp16 on GPUs, with loss scaling)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, help="torch threads per process (processes x threads <= cores)")
    train.add_argument("--context_parallel", action="store_true",
                       help="NPRF decoders: every process takes the same blocks and runs its contiguous shard of their "
                            "tokens (nprf_hf.context_parallel); the loss and gradients are those of the whole blocks")
    out = parser.add_argument_group("output")
    out.add_argument("--output_dir", required=True)
    out.add_argument("--overwrite_output_dir", action="store_true", help="replace a non-empty --output_dir")
    out.add_argument("--no_save_model", action="store_true", help="write the logs and results only (studies)")
    args = parser.parse_args(argv)

    if (args.model_name_or_path is None) == (args.model_type is None):
        parser.error("give either --model_name_or_path (a checkpoint) or --model_type (a fresh model from scratch)")
    if args.model_type is not None and args.tokenizer_name is None:
        parser.error("a fresh model needs --tokenizer_name (its vocabulary sets the embedding size)")
    try:
        overrides = json.loads(args.config_overrides)
    except ValueError as error:
        parser.error(f"--config_overrides is not JSON: {error}")
    if not isinstance(overrides, dict):
        parser.error(f"--config_overrides must be a JSON object, got {args.config_overrides!r}")
    if overrides and args.model_type is None:
        parser.error("--config_overrides applies to a fresh model (--model_type); a checkpoint keeps its config")
    args.config_overrides = overrides
    for name in ("train_file", "validation_file"):
        if getattr(args, name) is not None and not os.path.isfile(getattr(args, name)):
            parser.error(f"--{name} {getattr(args, name)}: no such file")
    if args.block_size < 2 or args.max_steps < 1 or args.per_device_train_batch_size < 1 or args.learning_rate <= 0:
        parser.error("need --block_size >= 2, --max_steps >= 1, --per_device_train_batch_size >= 1, --learning_rate > 0")
    for option in ("model_name_or_path", "tokenizer_name"):
        try:  # a source that is nowhere: one line now, not a network error after seconds of imports
            check_load_source(getattr(args, option))
        except SourceNotFoundError as error:
            parser.exit(2, f"{parser.prog}: error: --{option}: {error}\n")
    from nprf_hf.checkpoint_files import check_output_dir

    try:
        check_output_dir(args.output_dir, args.model_name_or_path, args.overwrite_output_dir, "--overwrite_output_dir")
    except ValueError as error:
        parser.error(f"--output_dir: {error}")
    return args


def token_blocks(tokenizer, path, block_size):
    """[N, block_size] long tensor: the file's non-empty lines tokenized (no special tokens), joined, cut."""
    import torch

    with open(path, encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    ids = [token for encoded in tokenizer(lines, add_special_tokens=False)["input_ids"] for token in encoded]
    count = len(ids) // block_size
    if count == 0:
        raise SystemExit(f"error: {path} has {len(ids)} tokens, fewer than one block of {block_size}")
    return torch.tensor(ids[: count * block_size]).view(count, block_size)


def build_model(args, tokenizer):
    """The decoder to train: the checkpoint, or a fresh `--model_type` model with `--config_overrides`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model_name_or_path is not None:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
        if not getattr(model.config, "is_decoder", True):
            raise SystemExit(f"error: {args.model_name_or_path} is not a decoder (is_decoder=false): convert it with "
                             "`nprf-hf convert SRC OUT --head causal-lm`")
        return model
    values = dict(vocab_size=len(tokenizer), is_decoder=True, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id or tokenizer.cls_token_id,
                  eos_token_id=tokenizer.eos_token_id or tokenizer.sep_token_id)
    values.update(args.config_overrides)
    try:
        config = AutoConfig.for_model(args.model_type, **values)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"error: --config_overrides: {error}")
    if hasattr(config, "max_position_embeddings") and getattr(config, "position_embedding_type", "absolute") == "absolute":
        from nprf_hf.families import position_offset

        needed = args.block_size + position_offset(config)
        if config.max_position_embeddings < needed:
            raise SystemExit(f"error: --block_size {args.block_size} needs max_position_embeddings >= {needed}: "
                             "add it to --config_overrides")
    return AutoModelForCausalLM.from_config(config)


def evaluate(model, blocks, batch_size, accelerator=None):
    """exp(mean token loss) over `blocks`, split across processes (`accelerator`; None: one process, no autocast);
    every token predicted once."""
    import contextlib

    import torch

    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    device = accelerator.device if accelerator else next(model.parameters()).device
    autocast = accelerator.autocast if accelerator else contextlib.nullcontext
    was_training = model.training
    model.eval()
    shard = blocks[rank::world]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, predicted tokens
    with torch.no_grad():
        for start in range(0, len(shard), batch_size):
            batch = shard[start : start + batch_size].to(device)
            with autocast():
                logits = model(input_ids=batch, use_cache=False).logits
            losses = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
            count = torch.tensor(batch[:, 1:].numel(), dtype=torch.float64, device=device)
            total += torch.stack([losses.double(), count])
    if accelerator:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    mean = (total[0] / total[1]).item()
    return {"eval_loss": mean, "perplexity": math.exp(min(mean, 700.0)), "eval_tokens": int(total[1].item())}


def context_parallel_setup(args, model, accelerator):
    """(process group, (lo, hi)) of this process's shard of every block under --context_parallel, else None. The
    shards' attention runs on a group of its own, apart from DDP's gradient all-reduces."""
    import torch

    if not args.context_parallel or accelerator.num_processes == 1:
        return None
    if not model.config.model_type.startswith("nprf"):
        raise SystemExit(f"error: --context_parallel shards NPRF attention; {model.config.model_type} is not an NPRF model")
    world, rank = accelerator.num_processes, accelerator.process_index
    size = -(-args.block_size // world)  # equal shards except the last
    if (world - 1) * size >= args.block_size:
        raise SystemExit(f"error: --block_size {args.block_size} leaves a process of {world} without tokens")
    return torch.distributed.new_group(), (rank * size, min(args.block_size, (rank + 1) * size))


def sharded_loss(model, batch, accelerator, group, bounds):
    """(loss to backpropagate, the blocks' mean token loss) of this process's shard of `batch` [B, block_size]: its
    tokens predict the next ones, the last shard's last token predicts none. The loss is this shard's share of the
    whole blocks' mean, times the processes: DDP averages the gradients, the shards' gradients add up."""
    import torch

    import nprf_hf

    lo, hi = bounds
    targets = batch[:, lo + 1 : hi + 1]
    with nprf_hf.context_parallel(group), accelerator.autocast():
        logits = model(input_ids=batch[:, lo:hi], use_cache=False).logits
    summed = torch.nn.functional.cross_entropy(
        logits[:, : targets.shape[1]].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    mean = summed / (batch.shape[0] * (batch.shape[1] - 1))
    loss_value = accelerator.reduce(mean.detach(), reduction="sum").item()
    return mean * accelerator.num_processes, loss_value


def main(argv=None):
    args = parse_args(argv)
    import torch
    from accelerate import Accelerator
    from transformers import AutoTokenizer, get_cosine_schedule_with_warmup, set_seed

    import nprf_hf  # noqa: F401  (registers the NPRF classes with the Auto classes)
    from nprf_hf.checkpoint_files import staged_output_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)
    # cpu=True without a GPU: accelerate then forms a gloo process group from the launcher's variables
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path)
    model = build_model(args, tokenizer)
    train_blocks = token_blocks(tokenizer, args.train_file, args.block_size)
    eval_blocks = token_blocks(tokenizer, args.validation_file, args.block_size) if args.validation_file else None

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "rpe_table" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "rpe_table" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.learning_rate)
    schedule = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)
    model.train()
    sharding = context_parallel_setup(args, model, accelerator)
    model, optimizer = accelerator.prepare(model, optimizer)

    # every process draws its own blocks from one seeded order (no block twice per epoch across processes)
    generator = torch.Generator().manual_seed(args.seed)
    order, position = torch.randperm(len(train_blocks), generator=generator), 0
    log, diverged, start_all = [], False, time.perf_counter()
    batch_size, world = args.per_device_train_batch_size, accelerator.num_processes
    for step in range(1, args.max_steps + 1):
        start = time.perf_counter()
        needed = batch_size * (1 if sharding else world)  # context parallel: every process takes the same blocks
        if position + needed > len(order):
            order, position = torch.randperm(len(train_blocks), generator=generator), 0
        mine = order[position : position + needed]
        mine = mine if sharding else mine[accelerator.process_index :: world]
        position += needed
        batch = train_blocks[mine].to(accelerator.device)
        if sharding:
            loss, loss_value = sharded_loss(model, batch, accelerator, *sharding)
        else:
            with accelerator.autocast():
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            loss_value = accelerator.reduce(loss.detach().float(), reduction="mean").item()
        if not math.isfinite(loss_value):
            diverged = True
            log.append({"step": step, "loss": loss_value, "grad_norm": None, "learning_rate": schedule.get_last_lr()[0],
                        "seconds": time.perf_counter() - start})
            break
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        if args.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()
                                                              if p.grad is not None]))
        optimizer.step()
        log.append({"step": step, "loss": loss_value, "grad_norm": float(grad_norm),
                    "learning_rate": schedule.get_last_lr()[0], "seconds": time.perf_counter() - start})
        schedule.step()
        if accelerator.is_main_process and (step == 1 or step % 10 == 0 or step == args.max_steps):
            print(json.dumps(log[-1]), flush=True)

    core = accelerator.unwrap_model(model)
    results = {
        "model": args.model_name_or_path or args.model_type, "config_overrides": args.config_overrides,
        "steps": len(log), "diverged": diverged, "final_loss": log[-1]["loss"], "block_size": args.block_size,
        "batch_size": batch_size * (1 if sharding else world), "processes": world,
        "context_parallel": bool(sharding), "mixed_precision": accelerator.mixed_precision,
        # what `accelerate launch` made of the model: FSDP2 leaves its parameters as sharded DTensors
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "sharded_parameters": any(type(p).__name__ == "DTensor" for p in model.parameters()),
        "learning_rate": args.learning_rate, "max_grad_norm": args.max_grad_norm, "seed": args.seed,
        "train_seconds": time.perf_counter() - start_all, "parameters": sum(p.numel() for p in core.parameters()),
    }
    if eval_blocks is not None and not diverged:
        results.update(evaluate(model, eval_blocks, args.per_device_eval_batch_size, accelerator))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with staged_output_dir(args.output_dir, args.model_name_or_path, args.overwrite_output_dir,
                               "--overwrite_output_dir") as staging:
            if not args.no_save_model:
                core.save_pretrained(staging)
                tokenizer.save_pretrained(staging)
            with open(os.path.join(staging, "train_log.jsonl"), "w") as handle:
                handle.writelines(json.dumps(entry) + "\n" for entry in log)
            with open(os.path.join(staging, "results.json"), "w") as handle:
                json.dump(results, handle, indent=1)
        print(json.dumps(results), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
