# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""The `nprf-hf` command line: one subcommand per task.

    nprf-hf convert SRC OUT [--num-random-features M] [--feature-map orf|prf] ...
    nprf-hf card MODEL_DIR [--eval-results eval_results.json] [--base-model ID] ...
    nprf-hf push MODEL_DIR REPO_ID [--private] [--revision REV] [--create-pr]

A subcommand is a pair of functions: `add_<name>_parser(subparsers)` declares its arguments and sets
`func` to the function that runs it (taking the parsed namespace, returning an exit code). Add a new
one to `SUBCOMMANDS`.

`--help`, `--version` and argument errors must not wait for torch and transformers (seconds): the package
is lazy (`nprf_hf/__init__.py`), the parser reads the torch-free declarations `options.py` and `families.py`,
the argument checks `checkpoint_files.py`, and a subcommand imports the rest when it runs.
"""

import argparse
import os
import sys

from . import options
from .checkpoint_files import check_output_dir
from .families import FAMILIES, HEADS
from .hub import PushError, check_source


def _bool(value):
    lowered = value.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _add_recipe_options(group, prefix, declared, defaults, metavar, text_help, choices=None):
    """A recipe's options: `--<prefix>-text PATH` (its texts; omitted = no recipe) and `--<prefix>-<name>` for
    each declared option (name: (type, help)), with its default; integers show as N, other numbers as `metavar`."""
    group.add_argument(f"--{prefix}-text", metavar="PATH", help=text_help)
    for name, (kind, text) in declared.items():
        default = defaults[name]
        shown = dict(choices=choices[name]) if name in (choices or {}) else dict(metavar="N" if kind is int else metavar)
        group.add_argument(
            f"--{prefix}-" + name.replace("_", "-"), type=kind, default=default,
            help=text if default is None else f"{text} (default: %(default)s)", **shown,
        )


def _add_nprf_options(parser):
    """`convert`'s NPRF config fields, position table and RPE table start."""
    nprf = parser.add_argument_group(
        "NPRF settings", "config fields of the NPRF model (nprf_hf.configuration_nprf.NPRF_FIELDS); default: the field's"
    )
    for field in options.NPRF_FIELDS:
        if not field.convert_option:
            continue
        kind = {"bool": dict(type=_bool, metavar="true|false"), "str": dict(choices=field.choices)}.get(
            field.type.__name__, dict(type=field.type)
        )
        nprf.add_argument(
            "--" + field.name.replace("_", "-"), **kind, help=f"{field.help} (default: {field.default})"
        )
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        help="extend the absolute position table to N rows by tiling the learned rows (RoBERTa: N-2 usable); "
        "default: the source's",
    )
    parser.add_argument(
        "--rpe-init",
        choices=options.RPE_INITS,
        default="zeros",
        help="start of the RPE table: zeros (the paper), or calibrated from the source's own attention per "
        "distance (needs --calibration-text) (default: %(default)s)",
    )
    parser.add_argument("--calibration-text", metavar="PATH", help="plain text file for --rpe-init calibrated")
    parser.add_argument(
        "--calibration-blocks", type=int, default=32, metavar="N", help="number of calibration blocks (default: %(default)s)"
    )
    parser.add_argument(
        "--calibration-block-size", type=int, default=128, metavar="N",
        help="tokens per calibration block (default: %(default)s)",
    )


def _add_training_options(parser):
    """`convert`'s training after the conversion: attention transfer, then the long-context recipe."""
    _add_recipe_options(
        parser.add_argument_group("attention transfer", "after converting, train the NPRF attention (query/key "
                                  "projections, RPE table, logit scales; the feature map's projection too with "
                                  "--attention-transfer-projection-learning-rate) so that every layer reproduces the source's "
                                  "softmax attention output on unlabeled text (nprf_hf.attention_transfer)"),
        "attention-transfer", options.TRANSFER_OPTIONS, options.TRANSFER_DEFAULTS, "RATE", "plain text file (one text "
        "per line) or GLUE task folder (its train.tsv sentences / pairs); omitted = no transfer",
    )
    _add_recipe_options(
        parser.add_argument_group("long-context recipe", "after converting (and the attention transfer), teach the "
                                  "model to embed a whole document like the source's chunk-and-pool, and passages and "
                                  "short texts like the source (nprf_hf.long_context_distillation); the model needs "
                                  "--max-position-embeddings for --long-context-document-length tokens"),
        "long-context", options.LONG_CONTEXT_OPTIONS, options.LONG_CONTEXT_DEFAULTS, "X", "plain text file of long "
        "documents (WikiText: split at its article titles; else at blank lines); omitted = no recipe",
        choices={"train": options.LONG_CONTEXT_TRAIN},
    )


def add_convert_parser(subparsers):
    parser = subparsers.add_parser(
        "convert",
        allow_abbrev=False,
        help="convert a checkpoint (" + ", ".join(f.display_name for f in FAMILIES.values()) + ") to NPRF attention",
        description=(
            "Convert a " + ", ".join(f.display_name for f in FAMILIES.values()) + " checkpoint (local dir or Hub id, "
            "any head) to the matching NPRF model. "
            "Every source tensor is copied bit-identically; the new tensors (RPE table, random projections) "
            "are listed. The output is saved with safetensors and remote code, plus the tokenizer, a sentence-transformers "
            "model's files (pooling, max_seq_length) and conversion_report.json."
        ),
    )
    parser.add_argument("src", help="local directory or Hub id of a softmax checkpoint of a supported family")
    parser.add_argument(
        "out", help="output directory: new or empty (written in a temporary sibling folder, moved into place at the end)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT (never allowed: OUT = SRC)")
    _add_nprf_options(parser)
    _add_training_options(parser)
    heads_help = "; ".join(
        f"{head} ({', '.join(f.display_name for f in FAMILIES.values() if head in f.heads)})"
        for head in HEADS if not all(head in f.heads for f in FAMILIES.values())
    )
    parser.add_argument(
        "--head", choices=list(HEADS),
        help=f"target head (default: from config.architectures); only some families have {heads_help}; causal-lm "
        "saves a decoder (is_decoder=true) for generate() and pipeline('text-generation')",
    )
    parser.add_argument(
        "--device", help="where attention transfer and the long-context recipe train, e.g. cuda (default: the CPU); "
        "the saved model is the same on any device, up to float rounding"
    )
    parser.add_argument("--revision", help="Hub revision of SRC: branch, tag or commit (default: the main branch)")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow modeling code shipped with SRC (a custom checkpoint)"
    )
    parser.set_defaults(func=run_convert)
    return parser


def _local_model_type(src):
    """model_type of a local checkpoint folder read from its config.json, or None (a Hub id, no config)."""
    import json

    path = os.path.join(os.path.expanduser(src), "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle).get("model_type")
    except (OSError, ValueError):
        return None


def check_convert_arguments(args):
    """The checks that need no torch, so that a mistake is reported at once (loading torch takes seconds):
    the source (a local folder, or a Hub id in the cache or on the Hub), the output folder (never the source,
    never a non-empty folder unless --overwrite) and, for a local source, a --head its family has."""
    check_source(args.src, args.revision)
    check_output_dir(args.out, args.src, args.overwrite)
    family = FAMILIES.get(_local_model_type(args.src))
    if args.head is not None and family is not None and args.head not in family.heads:
        raise ValueError(
            f"--head {args.head} does not exist for {family.display_name}; allowed: {', '.join(family.heads)}"
        )


def _check_device(args):
    if args.device is None:
        return
    if args.attention_transfer_text is None and args.long_context_text is None:
        raise ValueError("--device sets where attention transfer and the long-context recipe train: give "
                         "--attention-transfer-text or --long-context-text, or leave --device out")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device} is not a torch device: give cpu, cuda, cuda:1, mps, ...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA GPU here; leave --device out to train on the CPU")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with the one line that says what it left behind."""


def _folder_identity(path):
    """What tells a folder apart from the one moved into its place: (device, inode), or None when absent."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def run_convert(args):
    before = _folder_identity(args.out)
    try:
        return _run_convert(args)
    except KeyboardInterrupt:
        # the output is staged in a sibling folder and moved into place at the end: OUT is another folder only
        # if the interrupt came after that move
        if _folder_identity(args.out) != before:
            raise Interrupted(f"interrupted after {args.out} was written") from None
        raise Interrupted(f"interrupted; {args.out} was {'left as it was' if before else 'not written'}") from None


def _run_convert(args):
    check_convert_arguments(args)
    _check_device(args)
    from .convert import convert_checkpoint

    names = [field.name for field in options.NPRF_FIELDS if field.convert_option] + ["max_position_embeddings"]
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    from_pretrained_kwargs = {}
    if args.revision:
        from_pretrained_kwargs["revision"] = args.revision
    if args.trust_remote_code:
        from_pretrained_kwargs["trust_remote_code"] = True
    transfer_texts = None
    if args.attention_transfer_text is not None:
        from .transfer import read_transfer_texts

        transfer_texts = read_transfer_texts(args.attention_transfer_text)
    transfer_options = {name: getattr(args, "attention_transfer_" + name) for name in options.TRANSFER_OPTIONS}
    long_context_texts = None
    if args.long_context_text is not None:
        from .long_context import read_long_text

        long_context_texts = read_long_text(args.long_context_text)
    long_context_options = {name: getattr(args, "long_context_" + name) for name in options.LONG_CONTEXT_OPTIONS}
    report = convert_checkpoint(
        args.src,
        args.out,
        head=args.head,
        rpe_init=args.rpe_init,
        calibration_text=args.calibration_text,
        calibration_blocks=args.calibration_blocks,
        calibration_block_size=args.calibration_block_size,
        from_pretrained_kwargs=from_pretrained_kwargs,
        transfer_texts=transfer_texts,
        transfer_options=transfer_options,
        long_context_texts=long_context_texts,
        long_context_options=long_context_options,
        overwrite=args.overwrite,
        device=args.device,
        **overrides,
    )
    print(report.format())
    print(f"Saved to {args.out}")
    return 0


def _add_card_arguments(parser):
    parser.add_argument("model_dir", help="directory of a saved NPRF model")
    parser.add_argument(
        "--eval-results", help="JSON of metrics, e.g. the GLUE script's eval_results.json (default: MODEL_DIR/eval_results.json if present)"
    )
    parser.add_argument("--no-eval-results", action="store_true", help="write no results even if MODEL_DIR/eval_results.json exists")
    parser.add_argument("--base-model", help="Hub id of the source checkpoint, e.g. sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--dataset", action="append", dest="datasets", help="Hub id of a training/eval dataset (repeatable)")
    parser.add_argument("--task-name", help="GLUE task (sst2, cola, mrpc, ...) or a free task name (default: from the results or config.finetuning_task)")
    parser.add_argument("--eval-split", help="dataset split of the results (default: validation; MNLI: matched/mismatched)")
    parser.add_argument("--notes", help="markdown shown under the results (how they were measured)")
    parser.add_argument("--model-name", help="title and model-index name (default: MODEL_DIR's name)")
    parser.add_argument("--repo-id", help="Hub repo id used in the usage snippet (default: the model name)")
    parser.add_argument("--license")
    parser.add_argument("--language", action="append")
    parser.add_argument("--tag", action="append", dest="tags", help="extra tag (repeatable)")
    parser.add_argument("--output", help="where to write the card (default: MODEL_DIR/README.md)")
    parser.set_defaults(func=run_card)
    return parser


def add_card_parser(subparsers):
    """Register `nprf-hf card` on the subparsers of the `nprf-hf` parser (its `func` runs it)."""
    parser = subparsers.add_parser(
        "card",
        allow_abbrev=False,
        help="write a Hub model card (README.md) for a saved NPRF model",
        description="Write MODEL_DIR/README.md: YAML front matter (pipeline_tag, tags, datasets, metrics, base_model, "
        "model-index from eval_results.json), usage with trust_remote_code=True, NPRF settings, the conversion "
        "recipe and its limits.",
    )
    return _add_card_arguments(parser)


def run_card(args):
    from .modelcard import write_model_card

    eval_results = False if args.no_eval_results else args.eval_results
    names = ("base_model", "datasets", "task_name", "eval_split", "notes", "model_name", "repo_id", "license",
             "language", "tags")  # write_model_card's keywords, under the same names in `args`
    path = write_model_card(args.model_dir, eval_results=eval_results, output_path=args.output,
                            **{name: getattr(args, name) for name in names})
    print(f"Wrote {path}")
    return 0


def add_push_parser(subparsers):
    """Register `nprf-hf push` on the subparsers of the `nprf-hf` parser (its `func` runs it)."""
    parser = subparsers.add_parser(
        "push",
        allow_abbrev=False,
        help="upload a saved model folder to the Hub (what a script's failed --push_to_hub left to push)",
        description="Upload the top-level files of MODEL_DIR (weights, config, remote code, tokenizer, README.md; not "
        "its checkpoint folders) to the Hub model repository REPO_ID, created if missing, in one commit. An NPRF "
        "model without a README.md gets its model card first (`nprf-hf card` writes one with more options). "
        "Credentials: `hf auth login` or HF_TOKEN.",
    )
    parser.add_argument("model_dir", help="directory of a saved model")
    parser.add_argument("repo_id", help="Hub model repository, e.g. user/name (name alone: under your account)")
    parser.add_argument("--private", action="store_true", help="create the repository private (if it is new)")
    parser.add_argument("--revision", help="branch to push to (default: the main branch)")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default="Upload model", help="(default: %(default)s)")
    parser.set_defaults(func=run_push)
    return parser


def run_push(args):
    from .hub import HUB_ID, push_folder

    model_dir = args.model_dir
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir} is not a saved model (no config.json): give the folder save_pretrained wrote")
    if not HUB_ID.fullmatch(args.repo_id):
        raise ValueError(f"{args.repo_id!r} is not a Hub repository id: give user/name or name")
    if not os.path.exists(os.path.join(model_dir, "README.md")) and _is_nprf(model_dir):
        from .modelcard import write_model_card

        try:
            print(f"Wrote {write_model_card(model_dir, repo_id=args.repo_id)}")
        except ValueError as error:
            raise ValueError(f"{model_dir} has no model card, and writing one failed ({error}): write it with "
                             f"`nprf-hf card {model_dir} ...`, then push") from None
    info = push_folder(model_dir, args.repo_id, private=args.private or None, revision=args.revision,
                       create_pr=args.create_pr, commit_message=args.commit_message)
    print(f"Pushed {model_dir} to {getattr(info, 'commit_url', args.repo_id)}")
    return 0


def _is_nprf(model_dir):
    import json

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
        return str(json.load(handle).get("model_type", "")).startswith("nprf_")


SUBCOMMANDS = (add_convert_parser, add_card_parser, add_push_parser)


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nprf-hf")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser():
    families = FAMILIES.values()
    # allow_abbrev=False everywhere: a prefix (`--num-random-feature`) is a typo to report, not an option to guess
    parser = argparse.ArgumentParser(
        prog="nprf-hf",
        allow_abbrev=False,
        description="NPRF attention for HuggingFace models (" + ", ".join(f.display_name for f in families) + "): "
        "encoders and decoders (convert --head causal-lm: "
        + ", ".join(f.display_name for f in families if "causal-lm" in f.heads) + ")",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    parser.subcommand_parsers = subparsers.choices
    return parser


def _reject_unrecognized(parser, extras):
    """Report arguments no option took with the subparser's usage: argparse's own error would come from the
    top-level parser, whose usage (`nprf-hf COMMAND`) does not show the options that were meant. A close option
    name is suggested."""
    import difflib

    known = [name for action in parser._actions for name in action.option_strings]
    guesses = []
    for extra in extras:
        if extra.startswith("-"):
            guesses += difflib.get_close_matches(extra.split("=", 1)[0], known, n=1)
    hint = f" (did you mean {' / '.join(dict.fromkeys(guesses))}?)" if guesses else ""
    parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def main(argv=None):
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _reject_unrecognized(parser.subcommand_parsers.get(args.command, parser), extras)
    try:
        return args.func(args)
    except PushError as error:  # the model is saved: the Hub failed, not the arguments
        print(f"nprf-hf {args.command}: error: {error}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as error:
        print(f"nprf-hf {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # Ctrl-C: a user's choice, not a failure to show a traceback for
        print(f"nprf-hf {args.command}: {interrupt if isinstance(interrupt, Interrupted) else 'interrupted'}",
              file=sys.stderr)
        return 130


if __name__ == "__main__":  # python -m nprf_hf.cli
    sys.exit(main())
