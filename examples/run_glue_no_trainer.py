#!/usr/bin/env python
# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Fine-tune any HF sequence-classification model on GLUE with a plain Accelerate training loop.

Shaped like transformers' `run_glue_no_trainer.py`; the data and metric code is `nprf_hf.glue`, and
what it shares with `run_glue.py` beyond them is `glue_scripts.py` beside it. Gradient accumulation, `--mixed_precision`, checkpoints
(`--checkpointing_steps N|epoch`, `--resume_from_checkpoint DIR|latest`) and `--push_to_hub` (once, last, what
`--output_dir` holds: if the Hub fails, one line names the `nprf-hf push` command that sends it later).

    accelerate launch examples/run_glue_no_trainer.py --model_name_or_path <bert dir> \
        --convert_to_nprf --task_name sst2 --glue_dir ../shared/data/glue --output_dir out/sst2

Writes `eval_results.json` (the metrics after the last epoch) and `all_results.json` on the main
process.
"""

import argparse
import json
import logging
import math
import os
import re
import sys

try:
    import nprf_hf  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nprf_hf.hub import exit_if_missing_source

if __name__ == "__main__":  # a model that is nowhere: one line now, not after seconds of imports
    exit_if_missing_source("run_glue_no_trainer.py", ("--model_name_or_path", "--tokenizer_name"))

import datasets  # noqa: E402
import torch
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    SchedulerType,
    default_data_collator,
    get_scheduler,
)

from nprf_hf import glue  # noqa: E402
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # glue_scripts.py beside this script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import glue_scripts  # noqa: E402
from nprf_hf.modelcard import push_saved_model, script_card_kwargs, write_nprf_card  # noqa: E402
from nprf_hf.options import GLUE_TRANSFER_OPTIONS, TRANSFER_DEFAULTS, TRANSFER_OPTIONS  # noqa: E402


logger = get_logger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^(epoch|step)_(\d+)$")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Fine-tune a sequence-classification model on GLUE (Accelerate).")
    data = parser.add_argument_group("data")
    data.add_argument("--task_name", type=str, default=None, help="GLUE task: " + ", ".join(glue.GLUE_TASKS) + ".")
    data.add_argument("--glue_dir", type=str, default=None, help="glue_data root (or the task's folder) of TSVs.")
    data.add_argument("--train_file", type=str, default=None, help="csv/tsv/json(l) training file.")
    data.add_argument("--validation_file", type=str, default=None, help="csv/tsv/json(l) validation file.")
    data.add_argument("--max_seq_length", "--max_length", dest="max_seq_length", type=int, default=128)
    data.add_argument("--pad_to_max_length", action="store_true", help="Pad to max_seq_length, not per batch.")
    data.add_argument("--max_train_samples", type=int, default=None, help="Use only the first N training rows.")
    data.add_argument("--max_eval_samples", type=int, default=None, help="Use only the first N rows per eval split.")

    model = parser.add_argument_group("model")
    model.add_argument("--model_name_or_path", type=str, required=True, help="Local directory or Hub id.")
    model.add_argument("--tokenizer_name", type=str, default=None)
    model.add_argument("--trust_remote_code", action="store_true", help="Allow modeling code from the checkpoint.")
    model.add_argument("--ignore_mismatched_sizes", action="store_true", help="Re-init a head of another size.")
    model.add_argument("--convert_to_nprf", action="store_true", help="Convert the model to NPRF attention first.")
    model.add_argument("--nprf_config", type=str, default=None, help="JSON of arguments for convert_to_nprf.")
    model.add_argument("--rpe_learning_rate", type=float, default=None,
                       help="NPRF models: a learning rate of its own for the relative-position table (rpe_table).")
    model.add_argument("--attention_transfer_steps", type=int, default=0,
                       help="With --convert_to_nprf: first train the NPRF attention for N steps to reproduce the "
                       "source's softmax attention layer by layer (nprf_hf.attention_transfer); 0 = no transfer.")
    model.add_argument("--attention_transfer_text", type=str, default=None,
                       help="Texts for the transfer: a plain text file or a GLUE task folder "
                       "(default: the task's training texts).")
    for name in GLUE_TRANSFER_OPTIONS:  # declared once, in nprf_hf.options
        kind, text = TRANSFER_OPTIONS[name]
        model.add_argument(f"--attention_transfer_{name}", type=kind, default=TRANSFER_DEFAULTS[name],
                           help=f"attention transfer: {text} (default: %(default)s)")

    train = parser.add_argument_group("training")
    train.add_argument("--output_dir", type=str, default=None, help="Where the model, checkpoints and metrics go.")
    train.add_argument("--per_device_train_batch_size", type=int, default=8)
    train.add_argument("--per_device_eval_batch_size", type=int, default=8)
    train.add_argument("--learning_rate", type=float, default=5e-5)
    train.add_argument("--weight_decay", type=float, default=0.0)
    train.add_argument("--num_train_epochs", type=int, default=3)
    train.add_argument("--max_train_steps", type=int, default=None, help="Overrides num_train_epochs.")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear", choices=list(SchedulerType))
    train.add_argument("--num_warmup_steps", type=int, default=0)
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16"],
                       help="Default: what `accelerate config` / `accelerate launch` says.")
    train.add_argument("--cpu", action="store_true", help="Train on the CPU even if an accelerator is present.")
    train.add_argument("--checkpointing_steps", type=str, default=None,
                       help="Save the training state every N optimizer steps, or 'epoch'.")
    train.add_argument("--resume_from_checkpoint", type=str, default=None,
                       help="A checkpoint folder (step_N / epoch_N), or 'latest' for the newest in output_dir.")
    train.add_argument("--with_tracking", action="store_true", help="Log to the trackers of --report_to.")
    train.add_argument("--report_to", type=str, default="all")

    hub = parser.add_argument_group("hub")
    hub.add_argument("--push_to_hub", action="store_true", help="Upload the final model to the Hub.")
    hub.add_argument("--hub_model_id", type=str, default=None, help="Repo id (default: the output_dir name).")
    hub.add_argument("--hub_token", type=str, default=None)

    args = parser.parse_args(argv)
    if args.task_name is not None:
        args.task_name = glue.normalize_task_name(args.task_name)
    elif args.glue_dir is not None:
        parser.error("--glue_dir needs --task_name")
    elif args.train_file is None or args.validation_file is None:
        parser.error("give --task_name, or both --train_file and --validation_file")
    if args.checkpointing_steps is not None and args.checkpointing_steps != "epoch":
        if not args.checkpointing_steps.isdigit() or int(args.checkpointing_steps) < 1:
            parser.error(f"--checkpointing_steps must be a positive integer or 'epoch', got {args.checkpointing_steps!r}")
    if args.push_to_hub and args.output_dir is None:
        parser.error("--push_to_hub needs --output_dir")
    if args.gradient_accumulation_steps < 1:
        parser.error("--gradient_accumulation_steps must be >= 1")
    return args


def find_checkpoint(args):
    """(path, kind, number) of the checkpoint to resume from; kind is 'epoch' or 'step'."""
    path = args.resume_from_checkpoint
    if path == "latest":
        found = [
            (int(m.group(2)) if m.group(1) == "step" else math.inf, os.path.getmtime(os.path.join(args.output_dir, d)), d)
            for d in os.listdir(args.output_dir or ".")
            if (m := CHECKPOINT_PATTERN.match(d)) and os.path.isdir(os.path.join(args.output_dir, d))
        ]
        if not found:
            raise glue.UsageError(f"--resume_from_checkpoint latest: no epoch_N / step_N folder in {args.output_dir}")
        path = os.path.join(args.output_dir, max(found, key=lambda item: item[1])[2])
    match = CHECKPOINT_PATTERN.match(os.path.basename(os.path.normpath(path)))
    if not os.path.isdir(path) or match is None:
        raise glue.UsageError(f"--resume_from_checkpoint must be an epoch_N or step_N folder written by this script: {path!r}")
    return path, match.group(1), int(match.group(2))


def evaluate(model, dataloader, accelerator, info):
    """Predictions over the whole split, gathered across processes (padding duplicates dropped)."""
    model.eval()
    all_predictions, all_references = [], []
    for batch in dataloader:
        with torch.no_grad():
            logits = model(**batch).logits
        predictions = logits.squeeze(-1) if info.is_regression else logits.argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        all_predictions.append(predictions.float().cpu() if info.is_regression else predictions.cpu())
        all_references.append(references.cpu())
    predictions = torch.cat(all_predictions).numpy()
    references = torch.cat(all_references).numpy()
    metrics = glue.compute_glue_metrics(predictions, references, info.task_name, info.is_regression)
    return metrics, len(references)


def main(argv=None):
    args = parse_args(argv)
    glue_scripts.check_model_path(args.model_name_or_path, args.tokenizer_name)

    accelerator_kwargs = {"gradient_accumulation_steps": args.gradient_accumulation_steps, "cpu": args.cpu}
    if args.mixed_precision is not None:
        accelerator_kwargs["mixed_precision"] = args.mixed_precision
    if args.with_tracking:
        accelerator_kwargs["log_with"] = args.report_to
        accelerator_kwargs["project_dir"] = args.output_dir
    # A seedable sampler makes each epoch's order a function of (seed, epoch): exact resumes.
    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed), **accelerator_kwargs
    )

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO,
    )
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_info()
    else:
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
    glue_scripts.quiet_unless_main(accelerator.is_main_process)

    set_seed(args.seed)

    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    # Data: the same columns from the Hub, a glue_data directory or local files.
    raw_datasets = glue.load_glue_raw(
        task_name=args.task_name,
        glue_dir=args.glue_dir,
        train_file=args.train_file,
        validation_file=args.validation_file,
    )
    info = glue.glue_task_info(raw_datasets, args.task_name)
    if "train" not in raw_datasets or not info.eval_splits:
        raise glue.UsageError(f"need a train and a validation split; have {list(raw_datasets)}")

    config = AutoConfig.from_pretrained(
        args.model_name_or_path,
        num_labels=info.num_labels,
        finetuning_task=info.task_name,
        trust_remote_code=args.trust_remote_code,
    )
    glue_scripts.record_task(config, info.task_name)
    tokenizer = AutoTokenizer.from_pretrained(
        args.tokenizer_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path,
        config=config,
        ignore_mismatched_sizes=args.ignore_mismatched_sizes,
        trust_remote_code=args.trust_remote_code,
    )
    glue_scripts.check_conversion_flags(args)

    label_to_id, label2id = glue.resolve_label_ids(info, getattr(model.config, "label2id", None))
    if label2id is not None:
        model.config.label2id = label2id
        model.config.id2label = {i: name for name, i in label2id.items()}

    max_samples = {"train": args.max_train_samples, **{s: args.max_eval_samples for s in info.eval_splits}}
    raw_datasets = type(raw_datasets)({s: glue.take_first(raw_datasets[s], n) for s, n in max_samples.items()})
    if args.convert_to_nprf:  # after the cut: the transfer reads the rows the run trains on
        model = glue_scripts.convert_and_transfer(
            model,
            tokenizer,
            args,
            train_texts=glue.training_texts(raw_datasets["train"], info.sentence1_key, info.sentence2_key),
            max_length=args.max_seq_length,
            seed=args.seed,
            show_progress=accelerator.is_local_main_process,
            main_process=accelerator.is_main_process,
            output_dir=args.output_dir,
        )
    with accelerator.main_process_first():
        processed = glue.tokenize_glue(
            raw_datasets,
            info,
            tokenizer,
            max_seq_length=args.max_seq_length,
            label_to_id=label_to_id,
            pad_to_max_length=args.pad_to_max_length,
        )
    train_dataset = processed["train"]

    if args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        pad_to_multiple_of = 16 if accelerator.mixed_precision == "fp8" else 8 if accelerator.mixed_precision != "no" else None
        data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloaders = {
        split: DataLoader(processed[split], collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)
        for split in info.eval_splits
    }

    no_decay = ["bias", "LayerNorm.weight", "layer_norm.weight"]
    grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(grouped_parameters, lr=args.learning_rate)
    if args.rpe_learning_rate is not None:
        glue_scripts.set_rpe_learning_rate(optimizer, model, args.rpe_learning_rate)

    # Optimizer steps per epoch (the last partial accumulation of an epoch also steps), as the
    # prepared dataloader will count them: each process sees ceil(N / (batch * processes)) batches.
    batches_per_epoch = math.ceil(len(train_dataset) / (args.per_device_train_batch_size * accelerator.num_processes))
    steps_per_epoch = math.ceil(batches_per_epoch / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    # The prepared scheduler steps once per process at every optimizer step.
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    eval_dataloaders = {split: accelerator.prepare(dl) for split, dl in eval_dataloaders.items()}

    if len(train_dataloader) != batches_per_epoch:
        raise RuntimeError(f"prepared dataloader has {len(train_dataloader)} batches, expected {batches_per_epoch}")
    num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps != "epoch":
        checkpointing_steps = int(checkpointing_steps)

    if args.with_tracking:
        experiment_config = {k: (v.value if hasattr(v, "value") else v) for k, v in vars(args).items()}
        accelerator.init_trackers("glue_no_trainer", experiment_config)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Num epochs = {num_train_epochs}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Gradient accumulation steps = {args.gradient_accumulation_steps}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")

    completed_steps = 0
    starting_epoch = 0
    skip_batches = 0
    if args.resume_from_checkpoint:
        path, kind, number = find_checkpoint(args)
        accelerator.print(f"Resumed from checkpoint: {path}")
        accelerator.load_state(path)
        if kind == "epoch":
            starting_epoch = number + 1
            completed_steps = starting_epoch * steps_per_epoch
        else:
            completed_steps = number
            starting_epoch = completed_steps // steps_per_epoch
            skip_batches = (completed_steps % steps_per_epoch) * args.gradient_accumulation_steps

    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    progress_bar.update(completed_steps)

    all_metrics = {}
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        total_loss = 0.0
        train_dataloader.set_epoch(epoch)
        if epoch == starting_epoch and skip_batches:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, skip_batches)
        else:
            active_dataloader = train_dataloader
        first_batch = skip_batches if epoch == starting_epoch else 0
        for batch_index, batch in enumerate(active_dataloader, start=first_batch):
            if completed_steps >= args.max_train_steps:
                break
            # Dropout randomness is a function of (seed, epoch, batch, process), not of the RNG's history
            # (data loaders and evaluation draw from it too): a resumed run repeats the uninterrupted one.
            micro_batch = (epoch * len(train_dataloader) + batch_index) * accelerator.num_processes
            torch.manual_seed(args.seed + 1 + micro_batch + accelerator.process_index)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                total_loss += loss.detach().float().item()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
                if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0:
                    if args.output_dir is not None:
                        accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))

        all_metrics = {}
        for split, dataloader in eval_dataloaders.items():
            metrics, num_examples = evaluate(model, dataloader, accelerator, info)
            suffix = glue.metric_suffix(split)
            all_metrics.update({f"eval_{k}{suffix}": v for k, v in metrics.items()})
            all_metrics[f"eval_samples{suffix}"] = num_examples
        all_metrics["epoch"] = epoch
        all_metrics["train_steps"] = completed_steps
        logger.info(f"epoch {epoch}: {all_metrics}")
        if args.with_tracking:
            accelerator.log({**all_metrics, "train_loss": total_loss / max(len(active_dataloader), 1)}, step=completed_steps)

        if checkpointing_steps == "epoch" and args.output_dir is not None:
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if completed_steps >= args.max_train_steps:
            break

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save
        )
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
            for name in ("eval_results.json", "all_results.json"):
                path = os.path.join(args.output_dir, name)
                with open(path, "w") as f:
                    json.dump(all_metrics, f, indent=4, sort_keys=True)
            logger.info(
                f"Wrote {os.path.join(args.output_dir, 'eval_results.json')} "
                f"(process {accelerator.process_index} of {accelerator.num_processes})",
                main_process_only=False,
            )
            write_nprf_card(args.output_dir, unwrapped_model, info.task_name, args.model_name_or_path)
        accelerator.wait_for_everyone()
    accelerator.end_training()
    # last, once everything is saved and the processes are done with each other: a Hub that fails loses nothing
    if args.push_to_hub and accelerator.is_main_process:
        push_saved_model(
            args.output_dir, args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir)),
            card_kwargs=script_card_kwargs(args.output_dir, info.task_name, args.model_name_or_path),
            token=args.hub_token, commit_message="End of training",
        )
    return all_metrics


if __name__ == "__main__":
    glue_scripts.run_script(main, "run_glue_no_trainer.py")
