# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""The Hub, seen from the package: where a model comes from, and where a saved one goes.

- `check_source` (and `check_local_path`, `check_load_source`, `exit_if_missing_source`): a model argument that is
  neither a local folder nor a model on the Hub (or in its cache) is named at once, in one line, as
  `SourceNotFoundError`, before anything is loaded: transformers answers it with a network error, after half a minute
  of retries when the Hub is unreachable. Offline, only the Hub cache is looked at; online, the Hub is asked once.
- `push_folder`: uploading a saved model folder is a run's last step; a failure (offline, no credentials, no network)
  raises `PushError`, one line naming what failed and the command that pushes the folder later.

Imports only the standard library (huggingface_hub when a function runs): the `nprf-hf` command line and the
scripts check their arguments before seconds of torch and transformers, and `configuration_nprf.py`, whose
`from_pretrained` checks its source, ships this file beside every saved model as remote code.
"""

import os
import re
import shlex
import sys


# a Hub id: "name" or "org/name" (letters, digits, "-", "_", "."; not starting with "." or "-")
HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")


class SourceNotFoundError(FileNotFoundError):
    """A model source that is neither a local folder nor a model on the Hub or in its cache. An `OSError`, as
    transformers' own errors for a missing model: `except OSError` catches both."""


class PushError(OSError):
    """A push to the Hub that failed. `str(error)` is one line: what failed (`reason`), where the model is saved and
    the command that pushes it later (`command`; None when nothing was saved)."""

    def __init__(self, message, reason=None, command=None):
        super().__init__(message)
        self.reason, self.command = reason, command


def looks_like_path(value) -> bool:
    """True when `value` is meant as a local path, not a Hub id: it starts with `.`, `/` or `~`, or holds a path
    separator and is not of the Hub's `org/name` form."""
    value = os.fspath(value)
    if value.startswith((".", "/", "~")):
        return True
    has_separator = os.sep in value or (os.altsep is not None and os.altsep in value)
    return has_separator and not HUB_ID.fullmatch(value)


def check_local_path(value, what="model directory"):
    """Raise `SourceNotFoundError("no such directory: ...")` at once when `value` looks like a local path and does
    not exist (instead of HF's "Repo id must use alphanumeric chars" or retries against the Hub)."""
    if looks_like_path(value) and not os.path.exists(os.path.expanduser(os.fspath(value))):
        raise SourceNotFoundError(f"no such directory: {os.fspath(value)} (pass an existing {what} or a Hub id)")


def check_source(value, revision=None, *, cache_dir=None, token=None, local_files_only=False, subfolder=None):
    """Raise at once, with one line, when `value` is neither an existing local folder nor a Hub model that can be
    loaded (`SourceNotFoundError`; `ValueError` for a file given for the folder). A typo of a local folder
    (`src_minlm`) has a Hub id's form: offline (`HF_HUB_OFFLINE=1`, or `local_files_only`), only the Hub cache
    (`cache_dir`) is looked at; online, the Hub is asked once (with `token`)."""
    value = os.fspath(value)
    check_local_path(value, "checkpoint directory")
    path = os.path.expanduser(value)
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ValueError(f"{value} is a file: give the checkpoint's folder (config.json and weights) or a Hub id")
    if not HUB_ID.fullmatch(value):
        raise SourceNotFoundError(f"no local folder '{value}' (and not a Hub id)")
    reason = _why_not_on_the_hub(value, revision, cache_dir, token, local_files_only, subfolder)
    if reason is not None:
        raise SourceNotFoundError(f"no local folder '{value}' (and not found on the Hub: {reason})")


def _why_not_on_the_hub(repo_id, revision=None, cache_dir=None, token=None, local_files_only=False, subfolder=None):
    """Why the Hub model `repo_id` cannot be loaded, or None when it can (in the Hub cache, or on the Hub)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache

    # config.json for a model, tokenizer_config.json for a tokenizer alone (--tokenizer_name)
    for name in ("config.json", "tokenizer_config.json"):
        name = f"{subfolder}/{name}" if subfolder else name
        if isinstance(try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=revision), str):
            return None
    if constants.is_offline_mode():
        return "offline, and not in the Hub cache"
    if local_files_only:
        return "local_files_only, and not in the Hub cache"
    try:
        found = HfApi(token=token).repo_exists(repo_id)
    except Exception as error:  # a network error of whichever HTTP library huggingface_hub uses
        return f"it could not be reached ({error})"
    return None if found else "no such model repository (or it is private)"


def check_load_source(pretrained_model_name_or_path, *, files=True, cache_dir=None, token=None,
                      local_files_only=False, revision=None, subfolder="", **ignored):
    """`check_source` for a `from_pretrained(path, **kwargs)` call (its other keywords ignored): an existing folder,
    or with `files` an existing file (a config), is left to transformers; anything else must be a Hub model found in
    the cache or on the Hub. A model object passes."""
    if not isinstance(pretrained_model_name_or_path, (str, os.PathLike)):
        return
    value = os.fspath(pretrained_model_name_or_path)
    exists = os.path.exists if files else os.path.isdir
    if exists(os.path.expanduser(value)) or exists(os.path.join(subfolder or "", value)):
        return
    check_source(value, revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
                 subfolder=subfolder or None)


def exit_if_missing_source(prog, options, argv=None):
    """For a script, before its seconds of imports: the value of each command-line option in `options`
    (`--model_name_or_path`, ...) that is neither an existing path nor a Hub model ends the script with one line,
    `PROG: error: ...`, exit code 2. `--model_revision` / `--revision`, `--cache_dir` and `--token` are read too."""
    argv = sys.argv[1:] if argv is None else list(argv)
    given = {}
    for index, argument in enumerate(argv):
        name, equals, value = argument.partition("=")
        if not equals:  # a missing value (the next option instead) is left to the script's own parser
            value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else None
        if name.startswith("--") and value is not None:
            given.setdefault(name, value)
    hub = dict(revision=given.get("--model_revision", given.get("--revision")), cache_dir=given.get("--cache_dir"),
               token=given.get("--token"))
    for option in options:
        if option in given:
            try:
                check_load_source(given[option], **hub)
            except (SourceNotFoundError, ValueError) as error:
                print(f"{prog}: error: {option}: {error}", file=sys.stderr)
                raise SystemExit(2) from None


def push_command(model_dir, repo_id, private=None, revision=None, create_pr=False):
    """The command that pushes the saved folder `model_dir` to `repo_id` (`nprf-hf push`)."""
    words = ["nprf-hf", "push", os.fspath(model_dir), repo_id]
    words += (["--private"] if private else []) + (["--revision", revision] if revision else [])
    words += ["--create-pr"] if create_pr else []
    return " ".join(shlex.quote(word) for word in words)


def _why_the_push_failed(error):
    """One line: what stopped a push, and for the usual causes, the fix."""
    from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

    if isinstance(error, OfflineModeIsEnabled):
        return "the Hub is switched off here (HF_HUB_OFFLINE=1)"
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, LocalTokenNotFoundError) or status == 401:
        return "no Hub credentials (log in with `hf auth login`, or pass a token)"
    text = " ".join(str(error).split())  # the Hub's messages span lines
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def push_folder(model_dir, repo_id, *, token=None, private=None, revision=None, create_pr=False,
                commit_message="Upload model", on_repo=None):
    """Upload the top-level files of the saved model folder `model_dir` (not its checkpoint-* or other folders) to
    the Hub model repository `repo_id` (created if missing) in one commit. `on_repo(full_repo_id)`, when given, runs
    once the repository exists, before the upload (e.g. to write the repository's id into the model card).
    A failure raises `PushError`: what failed, and the command that pushes the folder later (`nprf-hf push`).
    Returns huggingface_hub's CommitInfo."""
    from huggingface_hub import CommitOperationAdd, HfApi

    folder = os.fspath(model_dir)
    try:
        api = HfApi(token=token)
        full_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if on_repo is not None:
            on_repo(full_id)
        operations = [  # listed after on_repo, which may write files
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(folder, name))
            for name in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, name))
        ]
        return api.create_commit(repo_id=full_id, operations=operations, commit_message=commit_message,
                                 revision=revision, create_pr=create_pr)
    except (OSError, ValueError) as error:  # every huggingface_hub error (network, HTTP, no token) is an OSError
        reason, command = _why_the_push_failed(error), push_command(model_dir, repo_id, private, revision, create_pr)
        raise PushError(
            f"could not push {folder} to {repo_id}: {reason}; the model stays saved in {folder}, push it later with: "
            f"{command}", reason, command
        ) from error
