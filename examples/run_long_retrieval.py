#!/usr/bin/env python
# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Fine-tune an embedder for long-document retrieval on passage/document pairs mined from unlabeled long text.

Each step draws `--batch_size` random spans of `--document_length` tokens from `--train_file` (a WikiText file
splits at its article titles, any other at blank lines) and `--passages_per_document` passages of
`--passage_length` tokens from each; the loss is the in-batch contrastive loss of sentence-transformers'
MultipleNegativesRankingLoss (passage -> its document, the batch's other documents as negatives, scale
1 / `--temperature`), on mean-pooled normalized embeddings. The document embedding is

* an NPRF model's whole-document pass (the default; `attention_recompute` and gradient checkpointing keep
  the memory of long inputs down), or
* with `--chunk_and_pool`, the softmax model's chunk-and-pool embedding (windows of `--window` tokens,
  trained through every window): the baseline a softmax user would fine-tune instead.

Runs under `accelerate launch` (DDP over CPU processes or GPUs; `examples/accelerate/` has configs; each
process mines its own batch, negatives stay within a process), with `--mixed_precision bf16|fp16` where the
device supports it and gradient clipping. Writes `train_log.jsonl` (per step: loss, gradient norm, seconds)
and `train_results.json` (median step time, peak memory); the model goes to `--output_dir` with its
tokenizer and sentence-transformers files, written to a temporary sibling folder and moved into place.

    python examples/run_long_retrieval.py --model_name_or_path runs/minilm-8k-long \\
        --train_file ../shared/data/wikitext-2/valid.txt --document_length 4096 --batch_size 2 \\
        --max_steps 100 --gradient_checkpointing --output_dir runs/long-retrieval
    accelerate launch --config_file examples/accelerate/cpu_ddp.yaml examples/run_long_retrieval.py ... --threads 1

With `--context_parallel` (NPRF models, 2+ processes) the processes share one batch instead: each runs its
contiguous shard of every document (`nprf_hf.context_parallel`), the mean pooling sums the shards, and the loss
and averaged gradients are one process's on that batch, with 1 / P of a document's activations per process.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
from torch.nn import functional as F


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="an NPRF model (nprf-hf convert output) or, "
                        "with --chunk_and_pool, a softmax BERT-family embedder")
    parser.add_argument("--train_file", required=True, help="plain text file of long documents")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--overwrite_output_dir", action="store_true", help="replace a non-empty --output_dir")
    parser.add_argument("--chunk_and_pool", action="store_true", help="document embedding = chunk-and-pool (softmax)")
    parser.add_argument("--window", type=int, default=None, help="chunk-and-pool window, content tokens (default: all positions)")
    parser.add_argument("--document_length", type=int, default=4096)
    parser.add_argument("--passage_length", type=int, default=64)
    parser.add_argument("--passages_per_document", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=2, help="documents per step and process")
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--context_parallel", action="store_true",
                        help="NPRF models: every process runs its shard of each document of one shared batch")
    parser.add_argument("--attention_recompute", choices=("auto", "always", "never"), default=None,
                        help="NPRF models: recompute attention in backward (default: the model's)")
    parser.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default=None,
                        help="default: accelerate's setting (accelerate launch / config)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    args = parser.parse_args(argv)
    if min(args.document_length, args.batch_size, args.max_steps, args.passages_per_document) < 1:
        parser.error("--document_length, --batch_size, --max_steps and --passages_per_document must be >= 1")
    if args.batch_size < 2:
        parser.error("--batch_size must be >= 2: the other documents of the batch are the negatives")
    if args.passage_length < 1 or args.passage_length >= args.document_length:
        parser.error("need 1 <= --passage_length < --document_length")
    if args.context_parallel and (args.chunk_and_pool or args.gradient_checkpointing):
        parser.error("--context_parallel shards NPRF whole-document passes, without --chunk_and_pool or "
                     "--gradient_checkpointing (its recomputed layers would run outside the shards' context)")
    if not os.path.isfile(args.train_file):
        parser.error(f"--train_file {args.train_file}: no such file")
    from nprf_hf.checkpoint_files import check_output_dir

    try:  # the model being trained is never overwritten, a non-empty folder only when asked
        check_output_dir(args.output_dir, args.model_name_or_path, args.overwrite_output_dir, "--overwrite_output_dir")
    except ValueError as error:
        parser.error(f"--output_dir: {error}")
    return args


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # Linux reports ru_maxrss in KiB: the process's peak resident memory (model, data and activations)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None):
    args = parse_args(argv)
    from accelerate import Accelerator
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    import nprf_hf  # noqa: F401  (registers the NPRF families)
    from nprf_hf.checkpoint_files import carry_sentence_transformers_files
    from nprf_hf.families import position_offset
    from nprf_hf.long_context import (
        chunk_and_pool, content_length, embed_documents, encode_token_ids, read_long_text, sample_documents,
        sample_passages, teacher_window, token_stream,
    )

    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = {} if args.mixed_precision is None else {"mixed_precision": args.mixed_precision}
    # cpu=True where there is no GPU: accelerate then forms a gloo process group from torchrun's variables
    # (DDP over CPU processes without MPI)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    config = AutoConfig.from_pretrained(args.model_name_or_path)
    is_nprf = config.model_type.startswith("nprf_")
    if is_nprf == args.chunk_and_pool:
        raise SystemExit("error: " + ("--chunk_and_pool trains a softmax model; this one is NPRF (drop the flag)"
                                      if is_nprf else "a softmax model reads long documents by --chunk_and_pool; "
                                      "or convert it first: nprf-hf convert SRC OUT --max-position-embeddings N"))
    overrides = {}
    if args.attention_recompute is not None:
        if not is_nprf:
            raise SystemExit("error: --attention_recompute applies to NPRF models only")
        overrides["attention_recompute"] = args.attention_recompute
    model = AutoModel.from_pretrained(args.model_name_or_path, **overrides)
    if is_nprf and getattr(config, "position_embedding_type", "absolute") == "absolute":
        limit = content_length(tokenizer, config.max_position_embeddings - position_offset(config))
        if args.document_length > limit:
            raise SystemExit(f"error: --document_length {args.document_length} exceeds the model's {limit} content "
                             f"positions: convert with --max-position-embeddings >= {args.document_length + 2}")
    window = args.window or (teacher_window(model, tokenizer) if args.chunk_and_pool else None)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # not wrapped in DDP: the encoder runs several times per step (documents, passages), which DDP's hooks do
    # not allow; every process loads the same weights, and the gradients are averaged after backward instead
    core = model.to(accelerator.device)
    optimizer = accelerator.prepare(optimizer)

    stream = token_stream(tokenizer, read_long_text(args.train_file))
    sharded = args.context_parallel and accelerator.num_processes > 1
    # each process mines its own batch; under context parallelism they share one
    generator = torch.Generator().manual_seed(args.seed + (0 if sharded else accelerator.process_index))
    log, seconds = [], []
    for step in range(1, args.max_steps + 1):
        start = time.perf_counter()
        docs = sample_documents(stream, args.batch_size, args.document_length, generator)
        passages = sample_passages(docs, args.passages_per_document, args.passage_length, generator)
        with accelerator.autocast():
            if args.chunk_and_pool:
                documents = chunk_and_pool(core, tokenizer, docs, window)
            elif sharded:
                documents = torch.cat([sharded_document(core, tokenizer, ids, accelerator) for ids in docs])
            else:
                documents = embed_documents(core, tokenizer, docs)
            queries = encode_token_ids(core, tokenizer, passages)
            logits = queries.float() @ documents.float().T / args.temperature
            labels = torch.arange(len(docs), device=logits.device).repeat_interleave(args.passages_per_document)
            loss = F.cross_entropy(logits, labels)
        if not torch.isfinite(loss):
            raise SystemExit(f"error: non-finite loss at step {step}: lower --learning_rate")
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        if accelerator.num_processes > 1:
            for param in core.parameters():
                if param.grad is not None:
                    param.grad = accelerator.reduce(param.grad, reduction="mean")
        grad_norm = accelerator.clip_grad_norm_(core.parameters(), args.max_grad_norm)
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        log.append({"step": step, "loss": loss.item(), "grad_norm": float(grad_norm), "seconds": seconds[-1]})
        if accelerator.is_main_process:
            print(json.dumps(log[-1]), flush=True)

    results = {
        "model": args.model_name_or_path, "mode": "chunk-and-pool" if args.chunk_and_pool else "whole document",
        "document_length": args.document_length, "batch_size": args.batch_size, "steps": args.max_steps,
        "processes": accelerator.num_processes, "context_parallel": sharded,
        "mixed_precision": accelerator.mixed_precision,
        "gradient_checkpointing": args.gradient_checkpointing, "window": window,
        "median_step_seconds": statistics.median(seconds[1:] or seconds),  # the first step warms up
        "peak_memory_bytes": peak_memory_bytes(accelerator.device), "final_loss": log[-1]["loss"],
        "threads": torch.get_num_threads(),
    }
    # every process must end with the same weights (gradients averaged by hand above)
    checksum = torch.stack([p.detach().double().sum() for p in core.parameters()]).sum().reshape(1).to(accelerator.device)
    checksums = accelerator.gather(checksum)
    results["parameters_in_sync"] = bool(torch.allclose(checksums, checksums[:1].expand_as(checksums)))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save(core, tokenizer, args, log, results, carry_sentence_transformers_files)
        print(json.dumps(results))
    return results


def sharded_document(model, tokenizer, ids, accelerator):
    """[1, h]: the normalized mean-pooled embedding of one document (content ids, special tokens added), this
    process running its contiguous shard of the tokens. The shards' token sums meet in a differentiable all-gather:
    every process's (identical) loss then sends each shard P times its gradient, which the averaging over the
    processes after backward brings back to one process's gradient (the passages, run whole by every process,
    keep theirs)."""
    import nprf_hf
    from nprf_hf.long_context import _batch
    from nprf_hf.nprf_context_parallel import all_gather

    input_ids, _ = _batch(tokenizer, [ids], next(model.parameters()).device)
    world, rank, n = accelerator.num_processes, accelerator.process_index, input_ids.shape[1]
    size = -(-n // world)  # equal shards except the last
    if (world - 1) * size >= n:
        raise SystemExit(f"error: a document of {n} tokens leaves a process of {world} without tokens")
    with nprf_hf.context_parallel():
        hidden = model.base_model(input_ids=input_ids[:, rank * size : (rank + 1) * size]).last_hidden_state
    pooled = all_gather(hidden.sum(1)).sum(0) / n
    return F.normalize(pooled, dim=-1)


def save(model, tokenizer, args, log, results, carry_sentence_transformers_files):
    """Write everything to a temporary sibling of --output_dir, then move it into place (never half-written)."""
    from nprf_hf.checkpoint_files import staged_output_dir

    with staged_output_dir(
        args.output_dir, args.model_name_or_path, args.overwrite_output_dir, "--overwrite_output_dir"
    ) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        carry_sentence_transformers_files(args.model_name_or_path, staging, None, None)
        with open(os.path.join(staging, "train_log.jsonl"), "w") as handle:
            handle.writelines(json.dumps(entry) + "\n" for entry in log)
        with open(os.path.join(staging, "train_results.json"), "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
