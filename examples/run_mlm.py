#!/usr/bin/env python
# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Masked-language-model uptraining of an NPRF model (converted or fresh) or a softmax baseline.

Plain text files in, blocks of `--max_seq_length` tokens ([CLS] ... [SEP]) out, Trainer for the
loop. Evaluation masks are drawn once with a fixed seed, so eval losses of different models are on
the same masked tokens; `eval_results.json` holds eval_loss and perplexity.

    # uptrain a converted checkpoint (`nprf-hf convert ... OUT`)
    python examples/run_mlm.py --model_name_or_path OUT \\
        --train_file ../shared/data/wikitext-2/valid.txt --validation_file ../shared/data/wikitext-2/test.txt \\
        --max_seq_length 128 --do_train --do_eval --max_steps 300 --output_dir runs/mlm

    # softmax baseline: the same with a softmax checkpoint; or convert in-process:
    python examples/run_mlm.py --model_name_or_path bert-dir --convert_to_nprf --rpe_init calibrated ...

Resume with `--resume_from_checkpoint runs/mlm/checkpoint-200` (or `last`: the newest in output_dir).
`--push_to_hub` uploads once, last, what `--output_dir` holds (an NPRF model with its NPRF model card); if the Hub
fails, the run ends with one line naming the `nprf-hf push` command that sends it later.
"""

import hashlib
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

try:
    import nprf_hf  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nprf_hf.hub import PushError, SourceNotFoundError, check_load_source, exit_if_missing_source

if __name__ == "__main__":  # a model that is nowhere: one line now, not after seconds of imports
    exit_if_missing_source("run_mlm.py", ("--model_name_or_path", "--config_name", "--tokenizer_name"))

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from nprf_hf.families import position_offset  # noqa: E402
from nprf_hf.modelcard import push_saved_model, script_card_kwargs  # noqa: E402


logger = logging.getLogger(__name__)

@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "NPRF dir or softmax checkpoint (dir or Hub id); omit to train from scratch"}
    )
    config_name: Optional[str] = field(default=None, metadata={"help": "config (dir or json) for a fresh model"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "tokenizer, if not the model's"})
    convert_to_nprf: bool = field(default=False, metadata={"help": "convert a softmax checkpoint to NPRF first"})
    rpe_init: str = field(default="zeros", metadata={"help": "with --convert_to_nprf: zeros or calibrated"})
    calibration_text: Optional[str] = field(default=None, metadata={"help": "text file for --rpe_init calibrated"})
    num_random_features: Optional[int] = field(default=None, metadata={"help": "with --convert_to_nprf"})
    feature_map: Optional[str] = field(default=None, metadata={"help": "with --convert_to_nprf: orf or prf"})
    attention_algorithm: Optional[str] = field(default=None, metadata={"help": "auto, dense, fft or banded"})
    rpe_shared_across_layers: Optional[bool] = field(default=None, metadata={"help": "with --convert_to_nprf"})
    max_position_embeddings: Optional[int] = field(default=None, metadata={"help": "with --convert_to_nprf"})
    position_embedding_type: Optional[str] = field(default=None, metadata={"help": "with --convert_to_nprf"})
    trust_remote_code: bool = field(default=False)


@dataclass
class DataArguments:
    train_file: Optional[str] = field(default=None, metadata={"help": "plain text file(s) for training"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "plain text file for evaluation"})
    max_seq_length: int = field(default=128, metadata={"help": "tokens per block, [CLS] and [SEP] included"})
    mlm_probability: float = field(default=0.15)
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N training blocks"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N evaluation blocks"})
    eval_mask_seed: int = field(default=1234, metadata={"help": "seed of the fixed evaluation masks"})


def load_model(model_args, tokenizer):
    """The masked-LM model: an NPRF dir (fresh MLM head if it has none), a softmax checkpoint
    (optionally converted in-process), or a fresh model from `config_name`."""
    from nprf_hf.configuration_nprf import NPRF_FIELDS
    from nprf_hf.convert import convert_to_nprf
    from nprf_hf.families import NPRF_FAMILIES
    from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES

    def masked_lm_class(model_type):
        return NPRF_MODEL_CLASSES[NPRF_FAMILIES[model_type].model_type]["masked-lm"]

    kwargs = {"trust_remote_code": model_args.trust_remote_code}
    if model_args.model_name_or_path is None:
        if model_args.config_name is None:
            raise ValueError("pass --model_name_or_path or --config_name")
        config = _load_config(model_args.config_name, **kwargs)
        model_type = config.model_type
        if model_type in NPRF_FAMILIES:
            return masked_lm_class(model_type)(config)
        model = AutoModelForMaskedLM.from_config(config, **kwargs)
    else:
        path = model_args.model_name_or_path
        model_type = _load_config(path, **kwargs).model_type
        if model_type in NPRF_FAMILIES:
            if model_args.convert_to_nprf:
                raise ValueError(f"--convert_to_nprf: {path} is already an NPRF model ({model_type})")
            return masked_lm_class(model_type).from_pretrained(path)
        model = AutoModelForMaskedLM.from_pretrained(path, **kwargs)
    if not model_args.convert_to_nprf:
        return model
    names = [f.name for f in NPRF_FIELDS if hasattr(model_args, f.name)] + ["max_position_embeddings"]
    overrides = {name: getattr(model_args, name) for name in names if getattr(model_args, name) is not None}
    model, report = convert_to_nprf(
        model,
        tokenizer=tokenizer,
        head="masked-lm",
        rpe_init=model_args.rpe_init,
        calibration_text=model_args.calibration_text,
        return_report=True,
        **overrides,
    )
    logger.info(report.format())
    return model


def _load_config(name_or_path, **kwargs):
    """Config of a dir / json / Hub id; NPRF configs load without remote code."""
    from nprf_hf.configuration_nprf import NPRF_CONFIG_CLASSES
    from nprf_hf.families import NPRF_FAMILIES

    config_file = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as handle:
            model_type = json.load(handle).get("model_type")
        if model_type in NPRF_FAMILIES:
            return NPRF_CONFIG_CLASSES[NPRF_FAMILIES[model_type].model_type].from_pretrained(name_or_path)
    return AutoConfig.from_pretrained(name_or_path, **kwargs)


def make_blocks(dataset, tokenizer, block_size):
    """Tokenize lines, concatenate them, cut into `[CLS] + (block_size - 2) tokens + [SEP]` blocks."""
    body = block_size - 2
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id

    def tokenize(batch):
        lines = [line.strip() for line in batch["text"] if line.strip()]
        return {"ids": tokenizer(lines, add_special_tokens=False, truncation=False)["input_ids"] if lines else []}

    def group(batch):
        ids = [token for line in batch["ids"] for token in line]
        blocks = [[cls_id] + ids[i : i + body] + [sep_id] for i in range(0, len(ids) - body + 1, body)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="tokenize")
    # batches of 1000 lines: the tail of each batch (< one block) is dropped
    return tokenized.map(group, batched=True, batch_size=1000, remove_columns=["ids"], desc="group")


def mask_once(dataset, tokenizer, mlm_probability, seed):
    """Fixed MLM masks for evaluation: adds `labels` (-100 where not masked), input_ids masked."""
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability, seed=seed)

    def apply(batch):
        masked = collator([{"input_ids": ids} for ids in batch["input_ids"]])
        return {"input_ids": masked["input_ids"].tolist(), "labels": masked["labels"].tolist()}

    return dataset.map(apply, batched=True, desc="mask eval")


class MaskedLMCollator:
    """Training batches: fresh MLM masks drawn from a generator seeded by `seed` and the batch's
    token ids, not from the global RNG. Accelerate's dataloader collates one batch ahead, so a
    checkpoint's saved RNG state is already past the next batch's masks; seeding by content makes a
    resumed run draw the same masks as an uninterrupted one. Evaluation batches come pre-masked
    (they carry labels)."""

    def __init__(self, tokenizer, mlm_probability, seed):
        self.mlm = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability)
        self.seed = seed

    def __call__(self, features):
        if "labels" in features[0]:
            return default_data_collator(features)
        digest = hashlib.sha256(repr([f["input_ids"] for f in features]).encode()).digest()
        self.mlm.generator = torch.Generator().manual_seed((int.from_bytes(digest[:7], "little") + self.seed) % 2**63)
        return self.mlm(features)


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    if training_args.device.type == "cpu":
        training_args.dataloader_pin_memory = False  # pinning needs an accelerator; on CPU torch only warns
    if training_args.do_train and data_args.train_file is None:
        raise ValueError("--do_train needs --train_file")
    if training_args.do_eval and data_args.validation_file is None:
        raise ValueError("--do_eval needs --validation_file")
    if data_args.max_seq_length < 3:
        raise ValueError(f"max_seq_length must be >= 3, got {data_args.max_seq_length}")

    resume = training_args.resume_from_checkpoint
    if resume is not None and resume.lower() in ("last", "true"):
        output_dir = training_args.output_dir
        resume = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if resume is None:
            raise ValueError(f"--resume_from_checkpoint last: no checkpoint in {training_args.output_dir}")
    elif resume is not None and not os.path.isdir(resume):
        raise ValueError(f"--resume_from_checkpoint {resume}: not a directory")

    for source in (model_args.model_name_or_path, model_args.config_name, model_args.tokenizer_name):
        check_load_source(source)  # a source that is nowhere: SourceNotFoundError now, not a network error later
    set_seed(training_args.seed)
    tokenizer_source = model_args.tokenizer_name or model_args.model_name_or_path
    if tokenizer_source is None:
        raise ValueError("a fresh model (--config_name) needs --tokenizer_name")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=model_args.trust_remote_code)
    model = load_model(model_args, tokenizer)
    config = model.config
    offset = position_offset(config)
    usable = config.max_position_embeddings - offset
    if getattr(config, "position_embedding_type", "absolute") != "none" and data_args.max_seq_length > usable:
        raise ValueError(
            f"max_seq_length={data_args.max_seq_length} exceeds the model's {usable} positions "
            "(convert with --max_position_embeddings, or position_embedding_type none)"
        )
    if tokenizer.model_max_length < data_args.max_seq_length:
        tokenizer.model_max_length = data_args.max_seq_length
    logger.info("model %s, %.1fM parameters", type(model).__name__, sum(p.numel() for p in model.parameters()) / 1e6)

    train_dataset = eval_dataset = None
    with training_args.main_process_first(desc="dataset preprocessing"):
        if training_args.do_train:
            raw = load_dataset("text", data_files={"train": data_args.train_file})["train"]
            train_dataset = make_blocks(raw, tokenizer, data_args.max_seq_length)
            if data_args.max_train_samples is not None:
                train_dataset = train_dataset.select(range(min(data_args.max_train_samples, len(train_dataset))))
        if training_args.do_eval:
            raw = load_dataset("text", data_files={"validation": data_args.validation_file})["validation"]
            eval_dataset = make_blocks(raw, tokenizer, data_args.max_seq_length)
            if data_args.max_eval_samples is not None:
                eval_dataset = eval_dataset.select(range(min(data_args.max_eval_samples, len(eval_dataset))))
            eval_dataset = mask_once(eval_dataset, tokenizer, data_args.mlm_probability, data_args.eval_mask_seed)
    for name, dataset in (("train", train_dataset), ("eval", eval_dataset)):
        if dataset is not None and len(dataset) == 0:
            raise ValueError(f"the {name} file has fewer than {data_args.max_seq_length - 2} tokens: no block")

    # Pushed once, last, once everything is saved: the Trainer's own pushes would create the repository before
    # training (a Hub that is down ends the run before it starts) and push on every save.
    push, training_args.push_to_hub = training_args.push_to_hub, False
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=MaskedLMCollator(tokenizer, data_args.mlm_probability, training_args.seed),
    )

    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=resume)
        trainer.save_model()
        metrics = dict(result.metrics, train_samples=len(train_dataset))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    metrics = None
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else float("inf")
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if push:
        if not training_args.do_train:
            trainer.save_model()  # what is pushed is what is saved
        if trainer.is_world_process_zero():
            output_dir = training_args.output_dir
            if not model.config.model_type.startswith("nprf_"):
                trainer.create_model_card()  # an NPRF model gets its own card from push_saved_model
            push_saved_model(
                output_dir, training_args.hub_model_id or os.path.basename(os.path.abspath(output_dir)),
                card_kwargs=script_card_kwargs(output_dir, None, model_args.model_name_or_path),
                token=training_args.hub_token, private=training_args.hub_private_repo,
                revision=training_args.hub_revision, commit_message="End of training",
            )
    return metrics


if __name__ == "__main__":
    try:
        main()
    except (SourceNotFoundError, PushError) as error:  # a source that is nowhere (2); a push that failed, all saved (1)
        print(f"run_mlm.py: error: {error}", file=sys.stderr)
        sys.exit(2 if isinstance(error, SourceNotFoundError) else 1)
