# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""What `run_glue.py` (Trainer) and `run_glue_no_trainer.py` (Accelerate) share beyond the GLUE data and
metrics (those are `nprf_hf.glue`): running a script so that a `UsageError` (or a source that is nowhere) is one
line and exit code 2 and a failed push one line and exit code 1, the checks of their arguments, the push at the end, `--convert_to_nprf` (conversion, then attention transfer), `--rpe_learning_rate`, and
quiet logs on every process but the main one.

The scripts import this module from their own folder; it takes their parsed arguments and sits above the
package (it imports `nprf_hf`), which never imports it.
"""

import json
import logging
import os
import sys
from typing import Optional

from nprf_hf.checkpoint_files import write_transfer_report
from nprf_hf.glue import UsageError
from nprf_hf.hub import PushError, SourceNotFoundError, check_load_source
from nprf_hf.options import GLUE_TRANSFER_OPTIONS


logger = logging.getLogger(__name__)


def run_script(main, prog, argv=None):
    """Run a GLUE script's `main(argv)`: a `UsageError` or `SourceNotFoundError` prints `prog: error: ...` to stderr
    and exits 2; a `PushError` (the run is saved, the Hub failed) prints its line and exits 1."""
    try:
        return main(argv)
    except (UsageError, SourceNotFoundError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except PushError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def check_model_path(*values, **hub_kwargs):
    """`SourceNotFoundError` for a model / config / tokenizer argument that is neither an existing path nor a Hub
    model (in the cache, or on the Hub; hub_kwargs: revision, cache_dir, token): otherwise HF says "Repo id must
    use alphanumeric chars", or retries an unreachable Hub for half a minute."""
    for value in values:
        if value is not None:
            check_load_source(value, **hub_kwargs)


def set_rpe_learning_rate(optimizer, model, learning_rate: float):
    """Move the relative-position tables of an NPRF `model` (parameters named `*rpe_table`) into a
    param group of their own in `optimizer`, with `learning_rate` and no weight decay.

    A converted model starts with a zero RPE table; at the learning rate that suits the pretrained
    weights it hardly moves during fine-tuning. Learning-rate schedulers created afterwards scale
    this group like the others. Returns the moved parameters.
    """
    rpe = [p for n, p in model.named_parameters() if n.endswith("rpe_table") and p.requires_grad]
    if not rpe:
        raise UsageError("a separate RPE learning rate needs an NPRF model: this one has no rpe_table parameters")
    moved = {id(p) for p in rpe}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in moved]
    optimizer.add_param_group({"params": rpe, "lr": learning_rate, "weight_decay": 0.0})
    return rpe


# The conversion options both GLUE scripts declare (as attributes of their parsed arguments).
CONVERSION_OPTIONS = ("nprf_config", "attention_transfer_steps", "attention_transfer_text")


def check_conversion_flags(args):
    """A ValueError naming the first conversion option of `args` that is set without --convert_to_nprf."""
    if args.convert_to_nprf:
        return
    for name in CONVERSION_OPTIONS:
        if getattr(args, name):
            raise UsageError(f"--{name} is only used with --convert_to_nprf")


def check_final_attention_variant(model, variant):
    """A UsageError unless `model` is an NPRF model and `variant` one of its attention variants
    (`--final_attention_variant`)."""
    from nprf_hf.options import ATTENTION_VARIANTS

    if not model.config.model_type.startswith("nprf_"):
        raise UsageError(f"--final_attention_variant switches an NPRF model's attention; {model.config.model_type} "
                         "is not one: add --convert_to_nprf")
    if variant not in ATTENTION_VARIANTS:
        raise UsageError(f"--final_attention_variant must be one of {', '.join(ATTENTION_VARIANTS)}, got {variant!r}")


def quiet_unless_main(main_process):
    """On every process but the main one: no INFO logs from nprf_hf (conversion report, transfer report) and no
    datasets / transformers progress bars, so a multi-process run (accelerate launch, torchrun) prints each of them once."""
    if main_process:
        return
    logging.getLogger("nprf_hf").setLevel(logging.WARNING)
    logger.setLevel(logging.WARNING)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars


def record_task(config, task_name):
    """Store the task in `config.finetuning_task`: transformers 5 drops `from_pretrained(finetuning_task=...)`,
    and the saved config is where `nprf-hf card` (and other tools) look for it."""
    if task_name is not None:
        config.finetuning_task = task_name
    return config


def convert_and_transfer(
    model,
    tokenizer,
    args,
    train_texts: Optional[list] = None,
    max_length: int = 128,
    seed: int = 0,
    show_progress: bool = True,
    main_process: bool = True,
    output_dir: Optional[str] = None,
):
    """What `--convert_to_nprf` does in both GLUE scripts, from their parsed `args` (`nprf_config`,
    `attention_transfer_*`): convert `model` (with the JSON `nprf_config` of convert_to_nprf arguments),
    then, if `attention_transfer_steps > 0`, run attention transfer from the softmax model on
    `attention_transfer_text` (a text file or GLUE task folder) or else on `train_texts` (the task's own
    training texts, as Hedgehog does); the main process logs its report and saves it as
    `attention_transfer.json` in `output_dir` (if given). Returns the NPRF model."""
    import nprf_hf

    overrides = json.loads(args.nprf_config) if args.nprf_config else {}
    if not isinstance(overrides, dict):
        raise UsageError(f"--nprf_config must be a JSON object, got {args.nprf_config!r}")
    if args.attention_transfer_steps > 0:  # the recipe a transfer is measured best with (options.TRANSFER_RECIPE)
        from nprf_hf.convert import with_transfer_recipe

        overrides = with_transfer_recipe(overrides)
    student = nprf_hf.convert_to_nprf(model, tokenizer=tokenizer, **overrides)
    logger.info("Converted to %s", type(student).__name__)
    if args.attention_transfer_steps <= 0:
        if args.attention_transfer_text is not None:
            raise UsageError("--attention_transfer_text needs --attention_transfer_steps N (N > 0)")
        return student
    text = args.attention_transfer_text
    texts = nprf_hf.read_transfer_texts(text) if text is not None else train_texts
    if not texts:
        raise UsageError("attention transfer needs texts: give --attention_transfer_text or a training split")
    report = nprf_hf.attention_transfer(
        student,
        model,
        tokenizer,
        texts,
        steps=args.attention_transfer_steps,
        **{name: getattr(args, "attention_transfer_" + name) for name in GLUE_TRANSFER_OPTIONS},
        max_length=max_length,
        seed=seed,
        show_progress=show_progress,
    )
    if main_process:
        logger.warning(report.format())
    if main_process and output_dir is not None:
        os.makedirs(output_dir, exist_ok=True)
        write_transfer_report(report.to_dict(), output_dir)
    return student
