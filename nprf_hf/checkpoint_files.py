# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""What a converted checkpoint needs besides weights, config and tokenizer, and the checks on a
source argument before any loading.

- sentence-transformers files: a sentence-transformers model (`modules.json`, `1_Pooling/`,
  `sentence_bert_config.json`, ...) stays one after conversion, so that
  `SentenceTransformer(out_dir, trust_remote_code=True)` works.
- `conversion_report.json`: what the conversion copied, extended, dropped and initialised fresh, so
  that later tools (the model card) can say which tensors were never trained; `attention_transfer.json`:
  the transfer's per-layer errors and cosine to the source.
- `check_local_path`, `check_source`: a source that is neither a local folder nor on the Hub, named at once
  (they live in `hub.py`, which configuration_nprf.py ships as remote code; imported here for older callers).
- `check_output_dir` / `staged_output_dir`: a command never writes into its source, never replaces a
  user's non-empty folder unasked, and never leaves a half-written one (everything is written to a
  temporary sibling and moved into place at the end, with the modes the user's umask gives);
  `replaced_contents`: what an overwrite will remove, to say before removing it.

This module imports no torch, so the CLI checks its arguments before loading anything.
"""

import ast
import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile

from .hub import HUB_ID, check_local_path, check_source, looks_like_path  # noqa: F401  (their home before hub.py)


logger = logging.getLogger(__name__)

# sentence-transformers' own files at the top of a model folder
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json")
SENTENCE_BERT_CONFIG = "sentence_bert_config.json"
CONVERSION_REPORT = "conversion_report.json"
ATTENTION_TRANSFER_REPORT = "attention_transfer.json"  # written by convert and by the GLUE scripts


@functools.lru_cache(maxsize=None)
def remote_code_files():
    """The package files that `save_pretrained` copies beside a model (its remote code), sorted: the files of the
    configs' `auto_map` (configuration_nprf.py, modeling_nprf.py) and every sibling they import with a single-dot
    import, transitively, as transformers follows them. Read from the code, so a new math file counts at once."""
    folder = os.path.dirname(os.path.abspath(__file__))
    found, pending = set(), ["configuration_nprf", "modeling_nprf"]
    while pending:
        module = pending.pop()
        if module in found:
            continue
        found.add(module)
        with open(os.path.join(folder, module + ".py"), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                pending.extend([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    return tuple(sorted(module + ".py" for module in found))


def _inside(path, folder):
    """True when `path` is `folder` or lies inside it (both already resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output_dir(out_dir, src=None, overwrite=False, overwrite_flag="--overwrite"):
    """Raise `ValueError` naming the problem when writing `out_dir` could harm anything: `out_dir` is `src`,
    lies inside it or contains it (replacing it would delete the source), is a file, or is a non-empty
    folder and `overwrite` is False. `src` may be a Hub id or a model object (then only `out_dir` is checked).
    Returns the resolved `out_dir`."""
    out = os.path.realpath(os.path.expanduser(os.fspath(out_dir)))
    if isinstance(src, (str, os.PathLike)) and os.path.exists(os.path.expanduser(os.fspath(src))):
        source = os.path.realpath(os.path.expanduser(os.fspath(src)))
        if _inside(out, source):
            raise ValueError(
                f"output folder {os.fspath(out_dir)} is the source {os.fspath(src)} or inside it: writing there "
                "would overwrite the source checkpoint; give a new folder"
            )
        if _inside(source, out):
            raise ValueError(
                f"output folder {os.fspath(out_dir)} contains the source {os.fspath(src)}: replacing it would "
                "delete the source checkpoint; give a new folder"
            )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"output folder {os.fspath(out_dir)} is a file: give a folder path")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ValueError(
            f"output folder {os.fspath(out_dir)} is not empty: give a new folder, or {overwrite_flag} to replace "
            "its contents"
        )
    return out


def replaced_contents(out_dir, shown=20):
    """The warning that replacing `out_dir` will remove what it holds (its top-level entries, folders marked with
    `/`), or None when it holds nothing."""
    try:
        names = sorted(os.listdir(out_dir))
    except OSError:
        return None
    if not names:
        return None
    listed = [name + ("/" if os.path.isdir(os.path.join(out_dir, name)) else "") for name in names[:shown]]
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return (
        f"replacing {os.fspath(out_dir)}: its {len(names)} entr{'y' if len(names) == 1 else 'ies'} "
        f"({', '.join(listed)}{more}) will be removed once the new output is complete (an error or Ctrl-C before "
        "then leaves them as they are)"
    )


def _umask():
    """The process's umask (read from /proc where it can be: setting it to read it back is not thread-safe)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask(folder):
    """Give `folder` and everything in it the modes the umask gives new files: mkdtemp makes the staging folder
    0700 and safetensors writes its weights 0600, which would make a converted model unreadable to other users."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for parent, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(parent, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o111
                os.chmod(path, (0o777 if executable else 0o666) & ~mask)


@contextlib.contextmanager
def staged_output_dir(out_dir, src=None, overwrite=False, overwrite_flag="--overwrite"):
    """Yield a fresh temporary folder beside `out_dir` (`.tmp-<name>-*`, same file system); when the block
    ends without error, it replaces `out_dir` (checked first with `check_output_dir`), else it is deleted.
    So an error or an interruption (Ctrl-C) leaves `out_dir` as it was, never half-written; a process
    killed outright can leave only the hidden temporary folder, never a partial `out_dir`."""
    out = check_output_dir(out_dir, src, overwrite, overwrite_flag)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out) + "-", dir=parent)
    try:
        yield staging
        _apply_umask(staging)
        if os.path.exists(out):
            # the old contents go aside first, so that a failure between the two moves loses nothing
            previous = tempfile.mkdtemp(prefix=".old-" + os.path.basename(out) + "-", dir=parent)
            os.replace(out, os.path.join(previous, "contents"))
            try:
                os.replace(staging, out)
            except BaseException:
                os.replace(os.path.join(previous, "contents"), out)
                raise
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _sentence_transformers_source(src, revision=None):
    """Local folder holding the sentence-transformers files of `src` (a local dir, or a Hub id fetched
    through the Hub cache), or None when `src` is no sentence-transformers model."""
    if os.path.isdir(src):
        return src if os.path.isfile(os.path.join(src, "modules.json")) else None
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        modules_file = hf_hub_download(src, "modules.json", revision=revision)
        with open(modules_file, encoding="utf-8") as handle:
            paths = [module.get("path", "") for module in json.load(handle)]
        patterns = list(SENTENCE_TRANSFORMERS_FILES) + [f"{path}/*" for path in paths if path]
        return snapshot_download(src, revision=revision, allow_patterns=patterns)
    except Exception as error:  # no modules.json, or no Hub: not a sentence-transformers model as far as we can tell
        logger.info("no sentence-transformers files for %s (%s)", src, error)
        return None


def carry_sentence_transformers_files(src, out_dir, max_seq_length=None, revision=None):
    """Copy the sentence-transformers files of `src` (its top-level json files and every module folder that
    `modules.json` names, e.g. `1_Pooling/`) into `out_dir`; with `max_seq_length`, write it into
    `sentence_bert_config.json` (the converted model's longer position table). The transformer module's
    files (weights, config, tokenizer) are the converted ones already in `out_dir`.
    Returns the copied paths relative to `out_dir` (empty for a source that is no sentence-transformers model)."""
    if not isinstance(src, (str, os.PathLike)):
        return []
    folder = _sentence_transformers_source(os.fspath(src), revision)
    if folder is None:
        return []
    copied = []
    for name in SENTENCE_TRANSFORMERS_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(out_dir, name))
            copied.append(name)
    with open(os.path.join(folder, "modules.json"), encoding="utf-8") as handle:
        modules = json.load(handle)
    for module in modules:
        path = module.get("path", "")
        # path "" is the transformer itself; a module without a folder (Normalize) has nothing to copy
        if path and os.path.isdir(os.path.join(folder, path)):
            shutil.copytree(os.path.join(folder, path), os.path.join(out_dir, path), dirs_exist_ok=True)
            copied.append(path + "/")
    if max_seq_length is not None:
        set_max_seq_length(out_dir, max_seq_length)
        if SENTENCE_BERT_CONFIG not in copied:
            copied.append(SENTENCE_BERT_CONFIG)
    return copied


def set_max_seq_length(out_dir, max_seq_length):
    """Write `max_seq_length` into `out_dir`'s `sentence_bert_config.json` (created if missing, its other settings
    kept); returns the value it had, or None."""
    config_path = os.path.join(out_dir, SENTENCE_BERT_CONFIG)
    settings = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as handle:
            settings = json.load(handle)
    previous = settings.get("max_seq_length")
    settings["max_seq_length"] = int(max_seq_length)
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(settings, handle, indent=2)
    return previous


def write_conversion_report(report, out_dir):
    """Save the report's tensor lists as `conversion_report.json` next to the weights."""
    data = {
        "source_model_type": report.source_model_type,
        "source_architecture": report.source_architecture,
        "target_class": report.target_class,
        "rpe_init": report.rpe_init,
        "copied": list(report.copied),
        "extended": {name: list(rows) for name, rows in report.extended.items()},
        "new": {name: list(shape) for name, shape in report.new.items()},
        "untrained_head": list(getattr(report, "untrained_head", [])),
        "tied": dict(getattr(report, "tied", {})),
        "dropped": list(report.dropped),
        "sentence_transformers_files": list(getattr(report, "sentence_transformers_files", [])),
        "max_input_length": getattr(report, "max_input_length", None),
    }
    for name in ("transfer", "long_context"):  # what training ran, with its held-out numbers
        if getattr(report, name, None) is not None:
            data[name] = getattr(report, name).to_dict()
    with open(os.path.join(out_dir, CONVERSION_REPORT), "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
    if "transfer" in data:
        write_transfer_report(data["transfer"], out_dir)


def write_transfer_report(transfer, out_dir):
    """Save an attention transfer's report (`TransferReport.to_dict()`) as `attention_transfer.json`."""
    with open(os.path.join(out_dir, ATTENTION_TRANSFER_REPORT), "w", encoding="utf-8") as handle:
        json.dump(transfer, handle, indent=2)


def read_conversion_report(model_dir):
    """The saved conversion report of `model_dir` as a dict, or None when there is none."""
    path = os.path.join(model_dir, CONVERSION_REPORT)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
