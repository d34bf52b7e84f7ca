#!/usr/bin/env python
# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Fine-tune any HF sequence-classification model on GLUE with the `Trainer`.

Shaped like transformers' `examples/pytorch/text-classification/run_glue.py`, updated for
transformers 5, with the data and metric code in `nprf_hf.glue` and the rest it shares with
`run_glue_no_trainer.py` in `glue_scripts.py` beside it. Softmax baselines and NPRF models use the same script;
`--convert_to_nprf` converts a softmax checkpoint on the fly (`--nprf_config` passes convert options,
e.g. a calibrated RPE init), and `--rpe_learning_rate` gives an NPRF model's RPE table its own rate.

Data: `--task_name` (one of the nine GLUE tasks) from the Hub (`nyu-mll/glue`), or from the original
`glue_data` TSV release with `--glue_dir`, or custom `--train_file/--validation_file` (csv/tsv/json).

    # offline, from the glue_data TSVs, converted from a softmax checkpoint
    python examples/run_glue.py --model_name_or_path <bert dir> --convert_to_nprf \
        --task_name sst2 --glue_dir ../shared/data/glue --do_train --do_eval --output_dir out/sst2

    # from the Hub
    python examples/run_glue.py --model_name_or_path roberta-base --task_name sst2 \
        --do_train --do_eval --output_dir out/sst2

Runs under `accelerate launch` / `torchrun` too. Writes `eval_results.json` (and `all_results.json`)
into `--output_dir`. `--push_to_hub` uploads once, last, what is saved there (an NPRF model with its remote code and
NPRF model card); if the Hub fails, the run ends with one line naming the `nprf-hf push` command that sends it later.
"""

import logging
import os
import sys
from dataclasses import dataclass, field, make_dataclass
from typing import Optional

try:
    import nprf_hf  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nprf_hf.hub import exit_if_missing_source

if __name__ == "__main__":  # a model that is nowhere: one line now, not after seconds of imports
    exit_if_missing_source("run_glue.py", ("--model_name_or_path", "--config_name", "--tokenizer_name"))

import transformers  # noqa: E402
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from nprf_hf import glue  # noqa: E402
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # glue_scripts.py beside this script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import glue_scripts  # noqa: E402
from nprf_hf.modelcard import push_saved_model, script_card_kwargs, write_nprf_card  # noqa: E402
from nprf_hf.options import GLUE_TRANSFER_OPTIONS, TRANSFER_DEFAULTS, TRANSFER_OPTIONS  # noqa: E402


logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    """What data to train and evaluate on."""

    task_name: Optional[str] = field(
        default=None, metadata={"help": "GLUE task: " + ", ".join(glue.GLUE_TASKS) + " (sst-2, CoLA, ... work too)."}
    )
    glue_dir: Optional[str] = field(
        default=None,
        metadata={"help": "Read the task from the original glue_data TSVs: the glue_data root or the task's folder."},
    )
    train_file: Optional[str] = field(default=None, metadata={"help": "csv/tsv/json(l) training file."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "csv/tsv/json(l) validation file."})
    test_file: Optional[str] = field(default=None, metadata={"help": "csv/tsv/json(l) prediction file."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated."})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every input to max_seq_length (default: pad per batch)."}
    )
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Use only the first N training rows."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Use only the first N rows of each eval split."})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Use only the first N test rows."})
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={"help": "Processes for tokenizing."})

    def __post_init__(self):
        if self.task_name is not None:
            self.task_name = glue.normalize_task_name(self.task_name)
        elif self.glue_dir is not None:
            raise glue.UsageError("--glue_dir needs --task_name (one of: " + ", ".join(glue.GLUE_TASKS) + ")")
        elif self.train_file is None and self.validation_file is None:
            raise glue.UsageError("give --task_name, or --train_file / --validation_file")


@dataclass
class ModelArguments:
    """Which model, config and tokenizer to fine-tune."""

    model_name_or_path: str = field(metadata={"help": "Checkpoint: local directory or Hub id."})
    config_name: Optional[str] = field(default=None, metadata={"help": "Config, if not the model's."})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer, if not the model's."})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where Hub downloads are stored."})
    model_revision: str = field(default="main", metadata={"help": "Hub branch, tag or commit."})
    token: Optional[str] = field(default=None, metadata={"help": "Hub token (default: the cached login)."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow modeling code from the checkpoint (e.g. a saved NPRF model)."}
    )
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Re-initialise a classifier head of another size."}
    )
    convert_to_nprf: bool = field(
        default=False, metadata={"help": "Convert the (softmax) model to NPRF attention before training."}
    )
    nprf_config: Optional[str] = field(
        default=None,
        metadata={"help": 'JSON of arguments for nprf_hf.convert_to_nprf, e.g. \'{"num_random_features": 128}\'.'},
    )
    rpe_learning_rate: Optional[float] = field(
        default=None,
        metadata={"help": "NPRF models: a learning rate of its own for the relative-position table (rpe_table)."},
    )
    attention_transfer_steps: int = field(
        default=0,
        metadata={
            "help": "With --convert_to_nprf: first train the NPRF attention for N steps to reproduce the source's "
            "softmax attention layer by layer (nprf_hf.attention_transfer); 0 = no transfer."
        },
    )
    attention_transfer_text: Optional[str] = field(
        default=None,
        metadata={"help": "Texts for the transfer: a plain text file or a GLUE task folder (default: the task's training texts)."},
    )
    final_attention_variant: Optional[str] = field(
        default=None,
        metadata={
            "help": "NPRF models: after training, switch the attention to this variant (nprf_hf.set_attention_variant, "
            "weights untouched) and evaluate and save it so; the dev scores before the switch are reported as "
            "before_switch_*. E.g. fine-tune with the exact kernel NPRF estimates (--nprf_config "
            '\'{"attention_variant": "normalized_softmax"}\'), then run NPRF: the paper\'s Figure 2 as a recipe.'
        },
    )


# the transfer's own options, declared once in nprf_hf.options, as fields of ModelArguments
ModelArguments = make_dataclass(
    "ModelArguments",
    [
        (f"attention_transfer_{name}", TRANSFER_OPTIONS[name][0],
         field(default=TRANSFER_DEFAULTS[name], metadata={"help": f"attention transfer: {TRANSFER_OPTIONS[name][1]}."}))
        for name in GLUE_TRANSFER_OPTIONS
    ],
    bases=(ModelArguments,),
)


class RPETrainer(Trainer):
    """The Trainer, plus an optimizer group of its own for the RPE table when `rpe_learning_rate` is set."""

    def __init__(self, *args, rpe_learning_rate: Optional[float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rpe_learning_rate = rpe_learning_rate

    def create_optimizer(self, model=None):
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if fresh and self.rpe_learning_rate is not None:
            glue_scripts.set_rpe_learning_rate(optimizer, self.model if model is None else model, self.rpe_learning_rate)
        return optimizer


def parse_args(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(args=argv)


def load_model_and_tokenizer(model_args, num_labels, task_name):
    hub_kwargs = dict(
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )
    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        num_labels=num_labels,
        finetuning_task=task_name,
        **hub_kwargs,
    )
    glue_scripts.record_task(config, task_name)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path, **hub_kwargs)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        config=config,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
        **hub_kwargs,
    )
    glue_scripts.check_conversion_flags(model_args)
    return model, tokenizer


def main(argv=None):
    model_args, data_args, training_args = parse_args(argv)
    glue_scripts.check_model_path(
        model_args.model_name_or_path, model_args.config_name, model_args.tokenizer_name,
        revision=model_args.model_revision, cache_dir=model_args.cache_dir, token=model_args.token,
    )

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    glue.logger.setLevel(log_level)
    glue_scripts.logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.warning(
        "Process rank: %s, world size: %s, device: %s",
        training_args.process_index,
        training_args.world_size,
        training_args.device,
    )
    glue_scripts.quiet_unless_main(training_args.process_index == 0)
    if training_args.device.type == "cpu":
        training_args.dataloader_pin_memory = False  # pinning needs an accelerator; on CPU torch only warns
    logger.info("Training/evaluation parameters %s", training_args)

    set_seed(training_args.seed)

    # Data: the same columns from the Hub, a glue_data directory or local files.
    raw_datasets = glue.load_glue_raw(
        task_name=data_args.task_name,
        glue_dir=data_args.glue_dir,
        train_file=data_args.train_file,
        validation_file=data_args.validation_file,
        test_file=data_args.test_file,
        cache_dir=model_args.cache_dir,
        token=model_args.token,
    )
    info = glue.glue_task_info(raw_datasets, data_args.task_name)

    model, tokenizer = load_model_and_tokenizer(model_args, info.num_labels, info.task_name)
    label_to_id, label2id = glue.resolve_label_ids(info, getattr(model.config, "label2id", None))
    if label2id is not None:
        model.config.label2id = label2id
        model.config.id2label = {i: name for name, i in label2id.items()}

    if training_args.do_train and "train" not in raw_datasets:
        raise glue.UsageError(f"--do_train needs a train split; have {list(raw_datasets)}")
    if training_args.do_eval and not info.eval_splits:
        raise glue.UsageError(f"--do_eval needs a validation split; have {list(raw_datasets)}")
    if training_args.do_predict and not info.test_splits:
        raise glue.UsageError(f"--do_predict needs a test split; have {list(raw_datasets)}")
    needed = (
        (["train"] if training_args.do_train else [])
        + (info.eval_splits if training_args.do_eval else [])
        + (info.test_splits if training_args.do_predict else [])
    )
    max_samples = {"train": data_args.max_train_samples}
    max_samples.update({s: data_args.max_eval_samples for s in info.eval_splits})
    max_samples.update({s: data_args.max_predict_samples for s in info.test_splits})
    raw_datasets = type(raw_datasets)({s: glue.take_first(raw_datasets[s], max_samples[s]) for s in needed})

    if model_args.convert_to_nprf:  # after the cut: the transfer reads the rows the run trains on
        main_process = training_args.process_index == 0
        model = glue_scripts.convert_and_transfer(
            model,
            tokenizer,
            model_args,
            train_texts=(
                glue.training_texts(raw_datasets["train"], info.sentence1_key, info.sentence2_key)
                if "train" in raw_datasets
                else None
            ),
            max_length=data_args.max_seq_length,
            seed=training_args.seed,
            show_progress=main_process and not training_args.disable_tqdm,
            main_process=main_process,
            output_dir=training_args.output_dir,
        )

    with training_args.main_process_first(desc="dataset map pre-processing"):
        datasets = glue.tokenize_glue(
            raw_datasets,
            info,
            tokenizer,
            max_seq_length=data_args.max_seq_length,
            label_to_id=label_to_id,
            pad_to_max_length=data_args.pad_to_max_length,
            num_proc=data_args.preprocessing_num_workers,
        )

    if data_args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        pad_to_multiple_of = 8 if (training_args.fp16 or training_args.bf16) else None
        data_collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    if model_args.final_attention_variant is not None:
        glue_scripts.check_final_attention_variant(model, model_args.final_attention_variant)

    # The transformers 5 Trainer takes a forward(**kwargs) to consume `num_items_in_batch`: it then
    # multiplies the loss by the number of processes and skips the division by the accumulation
    # steps. Sequence-classification heads return a per-batch mean, so turn that off.
    model.accepts_loss_kwargs = False

    # Pushed once, last, once everything is saved (push_saved_model): the Trainer's own pushes would create the
    # repository before training (a Hub that is down ends the run before it starts), push on every save, and give an
    # NPRF model transformers' generic card.
    push, training_args.push_to_hub = training_args.push_to_hub, False

    trainer = RPETrainer(
        model=model,
        rpe_learning_rate=model_args.rpe_learning_rate,
        args=training_args,
        train_dataset=datasets["train"] if training_args.do_train else None,
        eval_dataset=datasets[info.eval_splits[0]] if training_args.do_eval else None,
        compute_metrics=glue.make_compute_metrics(info.task_name, info.is_regression),
        processing_class=tokenizer,
        data_collator=data_collator,
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = train_result.metrics
        metrics["train_samples"] = len(datasets["train"])
        trainer.save_model()  # also saves the tokenizer
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    combined = {}
    if model_args.final_attention_variant is not None:
        if training_args.do_eval:  # the trained variant's scores, for the cost of the switch
            for split in info.eval_splits:
                metrics = trainer.evaluate(eval_dataset=datasets[split], metric_key_prefix="before_switch")
                combined.update({k + glue.metric_suffix(split): v for k, v in metrics.items()})
        import nprf_hf

        nprf_hf.set_attention_variant(model, model_args.final_attention_variant)
        logger.info("Attention switched to %s", model_args.final_attention_variant)
        if training_args.do_train:
            trainer.save_model()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        for split in info.eval_splits:
            metrics = trainer.evaluate(eval_dataset=datasets[split])
            metrics["eval_samples"] = len(datasets[split])
            suffix = glue.metric_suffix(split)
            combined.update({k + suffix: v for k, v in metrics.items()})
        trainer.log_metrics("eval", combined)
        trainer.save_metrics("eval", combined)  # eval_results.json, on the main process only
        if trainer.is_world_process_zero():
            logger.warning(
                "Wrote %s (process %d of %d)",
                os.path.join(training_args.output_dir, "eval_results.json"),
                training_args.process_index,
                training_args.world_size,
            )

    if training_args.do_predict:
        logger.info("*** Predict ***")
        for split in info.test_splits:
            test_dataset = datasets[split].remove_columns("labels")
            outputs = trainer.predict(test_dataset, metric_key_prefix="predict").predictions
            outputs = outputs[0] if isinstance(outputs, tuple) else outputs
            predictions = glue.predictions_from_outputs(outputs, info.is_regression)
            name = f"predict_results_{info.task_name or 'data'}{glue.metric_suffix(split)}.txt"
            if trainer.is_world_process_zero():
                with open(os.path.join(training_args.output_dir, name), "w") as writer:
                    writer.write("index\tprediction\n")
                    for index, item in enumerate(predictions):
                        if info.is_regression:
                            writer.write(f"{index}\t{item:3.3f}\n")
                        else:
                            writer.write(f"{index}\t{model.config.id2label[int(item)]}\n")

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "text-classification"}
    if info.task_name is not None:
        kwargs.update(language="en", dataset_tags="glue", dataset_args=info.task_name, dataset=f"GLUE {info.task_name.upper()}")
    if push and not training_args.do_train:
        trainer.save_model()  # what is pushed is what is saved
    if (push or training_args.do_train) and not write_nprf_card(
        training_args.output_dir, model, info.task_name, model_args.model_name_or_path,
        main_process=trainer.is_world_process_zero(),
    ):
        trainer.create_model_card(**kwargs)
    if push and trainer.is_world_process_zero():
        push_saved_model(
            training_args.output_dir, training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir)),
            card_kwargs=script_card_kwargs(training_args.output_dir, info.task_name, model_args.model_name_or_path),
            token=training_args.hub_token, private=training_args.hub_private_repo, revision=training_args.hub_revision,
            commit_message="End of training",
        )
    return combined if training_args.do_eval else None


if __name__ == "__main__":
    glue_scripts.run_script(main, "run_glue.py")
