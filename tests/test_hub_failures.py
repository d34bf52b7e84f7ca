"""The Hub missing (issue 57). A model source that is neither a local folder nor on the Hub (nor in its cache) is
one line and a `SourceNotFoundError` from every entry point, before anything is loaded: the `nprf-hf` CLI, the
scripts, `convert_checkpoint`, `convert_to_nprf` and the NPRF classes' `from_pretrained`. A push is a run's last
step: when it fails (offline, no credentials), the model and its card are saved, and one line names the command
that pushes them later (`nprf-hf push DIR REPO_ID`), exit code 1, no traceback."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import LocalTokenNotFoundError
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

import nprf_hf
from nprf_hf import cli
from nprf_hf.hub import PushError, SourceNotFoundError, push_folder
from nprf_hf.modelcard import push_nprf_to_hub

from conftest import minilm_path, tiny_config
from test_examples_glue import run_glue_no_trainer, write_tsv
from test_run_mlm import run_mlm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = "org/nowhere-model"
OFFLINE = f"no local folder '{MISSING}' (and not found on the Hub: offline, and not in the Hub cache)"
SWITCHED_OFF = "the Hub is switched off here (HF_HUB_OFFLINE=1)"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """The Hub switched off (as HF_HUB_OFFLINE=1 does), and an empty Hub cache."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture
def tiny_bert(tmp_path_factory):
    """A random 2-layer BERT (hidden 32) with MiniLM's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    path = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    BertModel(BertConfig(**tiny_config(vocab_size=len(tokenizer), max_position_embeddings=128))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def one_error_line(stderr, prefix):
    """The one line of `stderr` that says `error:` (the scripts log much else there), checked to start with `prefix`."""
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(prefix), stderr[-3000:]
    return errors[0][len(prefix):]


# ---- a source that is nowhere ------------------------------------------------------------------------------

PROBE = textwrap.dedent("""
    import runpy, sys
    target, sys.argv = sys.argv[1], sys.argv[1:]
    try:
        if target.endswith(".py"):
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        print("EXIT", exit.code, "torch loaded:", "torch" in sys.modules)
""")


@pytest.mark.parametrize("entry, args, prefix", [
    ("nprf_hf.cli", ["convert", MISSING, "out"], "nprf-hf convert: error: "),
    ("run_glue.py", ["--model_name_or_path", MISSING, "--task_name", "sst2", "--output_dir", "out"],
     "run_glue.py: error: --model_name_or_path: "),
    ("run_glue_no_trainer.py", ["--model_name_or_path", MISSING, "--task_name", "sst2", "--output_dir", "out"],
     "run_glue_no_trainer.py: error: --model_name_or_path: "),
    ("run_mlm.py", ["--model_name_or_path", "./here", "--tokenizer_name", MISSING, "--output_dir", "out"],
     "run_mlm.py: error: --tokenizer_name: "),
    ("run_clm.py", ["--model_name_or_path", MISSING, "--train_file", "train.txt", "--output_dir", "out"],
     "run_clm.py: error: --model_name_or_path: "),
])
def test_commands_name_a_missing_source_in_one_line_before_loading_torch(tmp_path, entry, args, prefix):
    """Offline, each command says in one line that the source is neither here nor on the Hub, exit code 2, before
    it imports torch (seconds): not transformers' "We couldn't connect to 'https://huggingface.co'" after them."""
    (tmp_path / "here").mkdir()
    (tmp_path / "train.txt").write_text("some text\n")
    target = entry if entry.startswith("nprf_hf") else os.path.join(REPO_ROOT, "examples", entry)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", PROBE, target, *args], capture_output=True, text=True,
                            cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL, timeout=120)
    assert "EXIT 2 torch loaded: False" in result.stdout, result.stdout + result.stderr[-3000:]
    assert result.stderr.splitlines() == [prefix + OFFLINE]
    assert not (tmp_path / "out").exists()


def test_python_entry_points_raise_source_not_found(offline, tmp_path, monkeypatch):
    """`convert_checkpoint`, `convert_to_nprf`, and the NPRF classes' `from_pretrained` raise the documented
    `nprf_hf.SourceNotFoundError` (an OSError, as transformers' own) with the CLI's line, and never ask transformers."""
    import transformers

    def asked(*args, **kwargs):
        raise AssertionError("transformers was asked to load a source that is nowhere")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    calls = {
        "convert_checkpoint": lambda: nprf_hf.convert_checkpoint(MISSING, str(tmp_path / "out")),
        "convert_to_nprf": lambda: nprf_hf.convert_to_nprf(MISSING),
        "model from_pretrained": lambda: nprf_hf.NPRFBertForSequenceClassification.from_pretrained(MISSING),
        "config from_pretrained": lambda: nprf_hf.NPRFRobertaConfig.from_pretrained(MISSING, revision="v1"),
    }
    for name, call in calls.items():
        with pytest.raises(nprf_hf.SourceNotFoundError) as caught:
            call()
        assert isinstance(caught.value, OSError) and str(caught.value) == OFFLINE, name
    assert nprf_hf.SourceNotFoundError is SourceNotFoundError and not (tmp_path / "out").exists()
    with pytest.raises(SourceNotFoundError, match=r"^no such directory: \./nowhere \(pass an existing"):
        nprf_hf.NPRFBertModel.from_pretrained("./nowhere")


def test_an_unreachable_hub_is_asked_once(tmp_path, monkeypatch):
    """Online without a network, the Hub is asked once and the answer is the error, instead of transformers' half
    a minute of retries; a model in the Hub cache loads without asking."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    asked = []

    def unreachable(self, repo_id, **kwargs):
        asked.append(repo_id)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "repo_exists", unreachable)
    for call in (lambda: nprf_hf.convert_checkpoint(MISSING, str(tmp_path / "out")),
                 lambda: nprf_hf.NPRFBertModel.from_pretrained(MISSING)):
        with pytest.raises(SourceNotFoundError, match=r"it could not be reached \(Name or service not known\)\)$"):
            call()
    assert asked == [MISSING, MISSING]

    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    nprf_hf.NPRFBertModel(nprf_hf.NPRFBertConfig(**tiny_config(num_random_features=8))).save_pretrained(snapshot)
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # transformers reads the cache offline
    assert type(nprf_hf.NPRFBertModel.from_pretrained("org/cached")).__name__ == "NPRFBertModel"
    assert asked == [MISSING, MISSING]


# ---- a push that fails ---------------------------------------------------------------------------------------


def saved_nprf_model(folder):
    nprf_hf.NPRFBertForSequenceClassification(nprf_hf.NPRFBertConfig(**tiny_config(num_random_features=8))
                                              ).save_pretrained(folder)
    return str(folder)


def test_a_push_offline_keeps_the_model_and_its_card_and_names_the_command(offline, tmp_path, capsys):
    out = saved_nprf_model(tmp_path / "run dir")  # a space: the command quotes it
    later = f"nprf-hf push '{out}' user/run"
    expected = f"could not push {out} to user/run: {SWITCHED_OFF}; the model stays saved in {out}, push it later with: {later}"
    with pytest.raises(nprf_hf.PushError) as caught:
        push_nprf_to_hub(out, "user/run")
    assert str(caught.value) == expected and caught.value.command == later and isinstance(caught.value, OSError)
    card = open(os.path.join(out, "README.md")).read()
    assert 'from_pretrained("user/run", trust_remote_code=True)' in card  # written before the Hub was asked

    os.remove(os.path.join(out, "README.md"))
    capsys.readouterr()
    assert cli.main(["push", out, "user/run"]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"nprf-hf push: error: {expected}\n" and os.path.isfile(os.path.join(out, "README.md"))

    with pytest.raises(PushError) as caught:  # a model in memory: nothing on disk to push later
        push_nprf_to_hub(nprf_hf.NPRFBertModel(nprf_hf.NPRFBertConfig(**tiny_config())), "user/run")
    assert str(caught.value) == (f"could not push the model to user/run: {SWITCHED_OFF}; nothing was saved: save it "
                                 "with model.save_pretrained(DIR), then run nprf-hf push DIR user/run")


def test_the_named_command_pushes_the_saved_folder(tmp_path, monkeypatch, capsys):
    out = saved_nprf_model(tmp_path / "run")
    open(os.path.join(out, "README.md"), "w").write("the card the run wrote")
    os.makedirs(os.path.join(out, "checkpoint-1"))
    commits = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": "someone/" + repo_id})()

    def create_commit(self, repo_id, operations, **kwargs):
        commits.append((repo_id, {op.path_in_repo: open(op.path_or_fileobj, "rb").read() for op in operations}, kwargs))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    assert cli.main(["push", out, "run", "--revision", "dev"]) == 0
    assert capsys.readouterr().out == f"Pushed {out} to https://huggingface.co/someone/run/commit/0\n"
    (repo_id, files, kwargs), = commits
    assert repo_id == "someone/run" and kwargs["revision"] == "dev"
    assert files["README.md"] == b"the card the run wrote" and "config.json" in files and "modeling_nprf.py" in files
    assert not any(name.startswith("checkpoint-") for name in files)


def test_a_push_without_credentials_names_the_login(tmp_path, monkeypatch):
    out = tmp_path / "softmax"
    BertModel(BertConfig(**tiny_config())).save_pretrained(out)

    def no_token(self, repo_id, **kwargs):
        raise LocalTokenNotFoundError("Token is required (`token=True`), but no token found.")

    monkeypatch.setattr(HfApi, "create_repo", no_token)
    with pytest.raises(PushError) as caught:
        push_folder(out, "user/softmax", private=True)
    assert str(caught.value) == (
        f"could not push {out} to user/softmax: no Hub credentials (log in with `hf auth login`, or pass a token); "
        f"the model stays saved in {out}, push it later with: nprf-hf push {out} user/softmax --private"
    )


def test_run_glue_push_offline_saves_everything_then_fails_in_one_line(tiny_bert, tmp_path):
    """The issue's case: `run_glue.py --push_to_hub` without the Hub trains, saves the model and its NPRF card,
    and ends with one line and exit code 1 (it used to end in an OfflineModeIsEnabled traceback, card unwritten)."""
    write_tsv(tmp_path / "SST-2" / "train.tsv", [["sentence", "label"]] + [["nice", "1"], ["awful", "0"]] * 2)
    write_tsv(tmp_path / "SST-2" / "dev.tsv", [["sentence", "label"], ["nice", "1"], ["awful", "0"]])
    out = str(tmp_path / "nprf-sst2")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    result = subprocess.run([
        sys.executable, os.path.join(REPO_ROOT, "examples", "run_glue.py"), "--model_name_or_path", tiny_bert,
        "--convert_to_nprf", "--nprf_config", '{"num_random_features": 8}', "--task_name", "sst2", "--glue_dir",
        str(tmp_path), "--do_train", "--do_eval", "--max_steps", "1", "--output_dir", out, "--save_strategy", "no",
        "--report_to", "none", "--push_to_hub", "--hub_model_id", "me/nprf-sst2",
    ], capture_output=True, text=True, cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert one_error_line(result.stderr, "run_glue.py: error: ") == (
        f"could not push {out} to me/nprf-sst2: {SWITCHED_OFF}; the model stays saved in {out}, push it later with: "
        f"nprf-hf push {out} me/nprf-sst2"
    )
    assert {"model.safetensors", "config.json", "tokenizer.json", "eval_results.json"} <= set(os.listdir(out))
    card = open(os.path.join(out, "README.md")).read()
    assert 'from_pretrained("me/nprf-sst2", trust_remote_code=True)' in card and "accuracy" in card


def test_the_other_scripts_push_last(offline, tiny_bert, tmp_path):
    """run_glue_no_trainer.py and run_mlm.py: the Hub is not asked before training (it was: the repository was created
    first), and a failed push raises `PushError` once the model (and card) are saved."""
    write_tsv(tmp_path / "RTE" / "train.tsv", [["index", "sentence1", "sentence2", "label"]]
              + [[str(i), f"premise {i}", f"hypothesis {i}", ["entailment", "not_entailment"][i % 2]] for i in range(4)])
    write_tsv(tmp_path / "RTE" / "dev.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "entailment"]])
    out = str(tmp_path / "rte")
    with pytest.raises(PushError, match=f"^could not push {out} to me/rte: .*push it later with: nprf-hf push {out} me/rte$"):
        run_glue_no_trainer.main([
            "--model_name_or_path", tiny_bert, "--convert_to_nprf", "--task_name", "rte", "--glue_dir",
            str(tmp_path / "RTE"), "--max_train_steps", "1", "--output_dir", out, "--push_to_hub", "--hub_model_id",
            "me/rte",
        ])
    assert {"model.safetensors", "eval_results.json", "README.md"} <= set(os.listdir(out))

    mlm = tmp_path / "mlm-source"
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    BertForMaskedLM(BertConfig(**tiny_config(vocab_size=len(tokenizer)))).save_pretrained(mlm)
    tokenizer.save_pretrained(mlm)
    (tmp_path / "train.txt").write_text("a line of text to learn from, long enough for a block\n" * 8)
    out = str(tmp_path / "mlm")
    with pytest.raises(PushError, match=f"^could not push {out} to me/mlm: .*nprf-hf push {out} me/mlm$"):
        run_mlm.main([
            "--model_name_or_path", str(mlm), "--train_file", str(tmp_path / "train.txt"), "--max_seq_length", "16",
            "--do_train", "--max_steps", "1", "--output_dir", out, "--use_cpu", "--report_to", "none",
            "--save_strategy", "no", "--push_to_hub", "--hub_model_id", "me/mlm",
        ])
    assert {"model.safetensors", "README.md"} <= set(os.listdir(out))
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["BertForMaskedLM"]
