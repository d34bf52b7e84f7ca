"""examples/run_glue.py and examples/run_glue_no_trainer.py (with examples/glue_scripts.py, which they share) end
to end on a tiny BERT (seconds each), and both under real 2-process CPU data parallelism with `accelerate launch`."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import minilm_path, needs_shared_data, shared_data_path, tiny_config
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertModel,
)

from nprf_hf import glue
from nprf_hf.checkpoint_files import remote_code_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = shared_data_path("glue")
RUN_GLUE = os.path.join(ROOT, "examples", "run_glue.py")
RUN_GLUE_NO_TRAINER = os.path.join(ROOT, "examples", "run_glue_no_trainer.py")
needs_data = needs_shared_data("glue")


def load_script(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_glue = load_script(RUN_GLUE)
run_glue_no_trainer = load_script(RUN_GLUE_NO_TRAINER)
glue_scripts = run_glue.glue_scripts  # what both scripts share, from their folder


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other jobs for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process run builds its own Accelerator (mixed precision differs between tests)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random 2-layer BERT (hidden 32) without a head, like the MiniLM checkpoint, with its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = BertConfig(**tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=128))
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny_bert"))
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_tsv(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\n".join("\t".join(row) for row in rows) + "\n")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def recomputed_metrics(model_dir, task, max_eval_samples, split="validation"):
    """Metrics of a saved model on the first rows of the real glue_data dev set, in this process."""
    raw = glue.load_glue_dir(DATA, task)
    info = glue.glue_task_info(raw, task)
    rows = glue.take_first(raw[split], max_eval_samples)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    texts = [list(rows[info.sentence1_key])] + ([list(rows[info.sentence2_key])] if info.sentence2_key else [])
    batch = tokenizer(*texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    labels = torch.tensor(list(rows["label"]))
    with torch.no_grad():
        logits = model(**batch).logits
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    return glue.compute_glue_metrics(logits.numpy(), labels.numpy(), task), loss


# ----------------------------------------------------------------------------------------------
# run_glue.py (Trainer)
# ----------------------------------------------------------------------------------------------


@needs_data
def test_run_glue_mrpc_from_glue_dir(tiny_model, tmp_path):
    out = tmp_path / "out"
    run_glue.main([
        "--model_name_or_path", tiny_model, "--task_name", "MRPC", "--glue_dir", DATA,
        "--do_train", "--do_eval", "--max_train_samples", "24", "--max_eval_samples", "13",
        "--per_device_train_batch_size", "8", "--num_train_epochs", "1", "--learning_rate", "1e-3",
        "--save_strategy", "no", "--output_dir", str(out),
    ])
    results = read_json(out / "eval_results.json")
    assert results["eval_samples"] == 13
    assert read_json(out / "train_results.json")["train_samples"] == 24
    expected, loss = recomputed_metrics(str(out), "mrpc", 13)
    for name in ("accuracy", "f1", "combined_score"):
        assert results[f"eval_{name}"] == pytest.approx(expected[name])
    assert results["eval_loss"] == pytest.approx(loss, rel=1e-4)
    config = read_json(out / "config.json")
    assert config["id2label"] == {"0": "not_equivalent", "1": "equivalent"}
    # the trained weights moved away from the checkpoint
    before, after = load_file(os.path.join(tiny_model, "model.safetensors")), load_file(out / "model.safetensors")
    name = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(before[name], after["bert." + name])


def test_run_glue_regression_and_mnli_layouts(tiny_model, tmp_path):
    stsb_header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"]
    rows = [[str(i), "g", "f", "2012", str(i), "s", "s", f"a man plays {i}", f"a dog runs {i % 3}", f"{i % 5 + 0.25}"]
            for i in range(12)]
    write_tsv(tmp_path / "glue" / "STS-B" / "train.tsv", [stsb_header] + rows)
    write_tsv(tmp_path / "glue" / "STS-B" / "dev.tsv", [stsb_header] + rows[:7])
    run_glue.main([
        "--model_name_or_path", tiny_model, "--task_name", "sts-b", "--glue_dir", str(tmp_path / "glue"),
        "--do_train", "--do_eval", "--max_steps", "2", "--output_dir", str(tmp_path / "stsb"), "--save_strategy", "no",
    ])
    results = read_json(tmp_path / "stsb" / "eval_results.json")
    assert {"eval_pearson", "eval_spearmanr", "eval_combined_score"} <= set(results)
    assert -1 <= results["eval_pearson"] <= 1 and results["eval_samples"] == 7
    assert len(read_json(tmp_path / "stsb" / "config.json")["id2label"]) == 1  # one output: regression

    header = ["index", "promptID", "pairID", "genre", "s1b", "s2b", "s1p", "s2p", "sentence1", "sentence2", "label1", "gold_label"]
    labels = ["entailment", "neutral", "contradiction"]
    rows = [[str(i), "p", "q", "g", "b", "b", "p", "p", f"premise {i}", f"hypothesis {i}", "x", labels[i % 3]]
            for i in range(9)]
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        write_tsv(tmp_path / "glue" / "MNLI" / name, [header] + rows)
    run_glue.main([
        "--model_name_or_path", tiny_model, "--task_name", "mnli", "--glue_dir", str(tmp_path / "glue"),
        "--do_eval", "--max_eval_samples", "5", "--output_dir", str(tmp_path / "mnli"),
    ])
    results = read_json(tmp_path / "mnli" / "eval_results.json")
    assert {"eval_accuracy", "eval_accuracy_mm", "eval_samples", "eval_samples_mm"} <= set(results)
    assert results["eval_samples"] == results["eval_samples_mm"] == 5
    assert results["eval_accuracy"] == results["eval_accuracy_mm"]  # same rows in both files


def test_run_glue_local_files_and_predict(tiny_model, tmp_path):
    train = [["text", "label"]] + [[f"{word} film number {i}", word] for i, word in enumerate(["good", "bad", "fine"] * 4)]
    write_tsv(tmp_path / "train.tsv", train)
    write_tsv(tmp_path / "dev.tsv", train[:6])
    write_tsv(tmp_path / "test.tsv", [["text", "label"], ['a "good film', "good"], ["bad one", "bad"]])
    out = tmp_path / "out"
    run_glue.main([
        "--model_name_or_path", tiny_model, "--train_file", str(tmp_path / "train.tsv"),
        "--validation_file", str(tmp_path / "dev.tsv"), "--test_file", str(tmp_path / "test.tsv"),
        "--do_train", "--do_eval", "--do_predict", "--max_steps", "1", "--output_dir", str(out), "--save_strategy", "no",
    ])
    results = read_json(out / "eval_results.json")
    assert set(k for k in results if not k.startswith("eval_") or "runtime" in k or "per_second" in k) <= {
        "epoch", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
    assert 0 <= results["eval_accuracy"] <= 1 and results["eval_samples"] == 5
    assert read_json(out / "config.json")["label2id"] == {"bad": 0, "fine": 1, "good": 2}
    lines = (out / "predict_results_data.txt").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 3
    assert all(line.split("\t")[1] in {"bad", "fine", "good"} for line in lines[1:])


def assert_nprf_card_and_task(out, task):
    """A fine-tuned NPRF model records its task in config.json and gets the NPRF card (not the Trainer's), and
    `nprf-hf card` on the folder works without --task-name (issue 13, item 5)."""
    from nprf_hf.cli import main as cli_main

    assert read_json(out / "config.json")["finetuning_task"] == task
    card = (out / "README.md").read_text()
    assert "trust_remote_code=True" in card and "NPRF" in card and f"Task: `{task}`" in card
    assert "base_model:" not in card  # the source was a local folder: no local path as base_model
    assert cli_main(["card", str(out), "--output", str(out / "CARD.md")]) == 0
    assert f"Task: `{task}`" in (out / "CARD.md").read_text()


@needs_data
def test_run_glue_convert_to_nprf(tiny_model, tmp_path):
    out = tmp_path / "out"
    run_glue.main([
        "--model_name_or_path", tiny_model, "--convert_to_nprf", "--nprf_config", '{"num_random_features": 16}',
        "--task_name", "sst2", "--glue_dir", DATA, "--do_train", "--do_eval", "--max_train_samples", "16",
        "--max_eval_samples", "8", "--output_dir", str(out), "--save_strategy", "no",
    ])
    config = read_json(out / "config.json")
    assert config["model_type"] == "nprf_bert" and config["num_random_features"] == 16
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert "AutoModelForSequenceClassification" in config["auto_map"]
    results = read_json(out / "eval_results.json")
    assert results["eval_samples"] == 8 and 0 <= results["eval_accuracy"] <= 1
    # the saved NPRF model reproduces the reported accuracy
    expected, _ = recomputed_metrics(str(out), "sst2", 8)
    assert results["eval_accuracy"] == pytest.approx(expected["accuracy"])
    assert_nprf_card_and_task(out, "sst2")
    with pytest.raises(ValueError, match="--nprf_config is only used with --convert_to_nprf"):
        run_glue.main(["--model_name_or_path", tiny_model, "--nprf_config", "{}", "--task_name", "sst2",
                       "--glue_dir", DATA, "--do_eval", "--output_dir", str(tmp_path / "x")])


@needs_data
def test_run_glue_trains_normalized_then_switches_to_nprf(tiny_model, tmp_path):
    """--final_attention_variant: fine-tuned with the exact normalized kernel, then switched to NPRF
    (`set_attention_variant`, whose weights are tested in test_variants); the dev scores of both are reported and
    the saved model is the NPRF one."""
    out = tmp_path / "out"
    results = run_glue.main([
        "--model_name_or_path", tiny_model, "--convert_to_nprf",
        "--nprf_config", '{"num_random_features": 16, "attention_variant": "normalized_softmax"}',
        "--final_attention_variant", "nprf", "--task_name", "sst2", "--glue_dir", DATA, "--do_train", "--do_eval",
        "--max_train_samples", "16", "--max_eval_samples", "8", "--output_dir", str(out), "--save_strategy", "no",
    ])
    assert read_json(out / "config.json")["attention_variant"] == "nprf"
    assert 0 <= results["before_switch_accuracy"] <= 1 and 0 <= results["eval_accuracy"] <= 1
    assert results["before_switch_loss"] != results["eval_loss"]  # another attention: other logits
    expected, _ = recomputed_metrics(str(out), "sst2", 8)  # the saved model is the switched one
    assert results["eval_accuracy"] == pytest.approx(expected["accuracy"])
    for bad, message in (
        (["--final_attention_variant", "nprf"], "is not one: add --convert_to_nprf"),
        (["--convert_to_nprf", "--final_attention_variant", "exact"], "must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            run_glue.main(["--model_name_or_path", tiny_model, *bad, "--task_name", "sst2", "--glue_dir", DATA,
                           "--do_eval", "--max_eval_samples", "8", "--output_dir", str(tmp_path / "x")])


@needs_data
@pytest.mark.parametrize("script", ["trainer", "no_trainer"])
def test_rpe_learning_rate(tiny_model, tmp_path, script):
    """--rpe_learning_rate trains the (zero-initialised) RPE table at its own rate in both scripts."""
    largest = {}
    for name, extra in [("shared", []), ("own", ["--rpe_learning_rate", "0.05"])]:
        out = tmp_path / name
        common = ["--model_name_or_path", tiny_model, "--convert_to_nprf", "--task_name", "sst2", "--glue_dir", DATA,
                  "--max_train_samples", "16", "--max_eval_samples", "8", "--per_device_train_batch_size", "8",
                  "--learning_rate", "1e-6", "--output_dir", str(out)] + extra
        if script == "trainer":
            run_glue.main(common + ["--do_train", "--save_strategy", "no", "--report_to", "none"])
        else:
            run_glue_no_trainer.main(common + ["--num_train_epochs", "1", "--report_to", "none"])
        largest[name] = load_file(str(out / "model.safetensors"))["bert.encoder.rpe_table"].abs().max().item()
        assert_nprf_card_and_task(out, "sst2")
    assert largest["shared"] < 1e-5 < 0.01 < largest["own"]
    if script == "trainer":
        with pytest.raises(ValueError, match="no rpe_table"):
            run_glue.main(["--model_name_or_path", tiny_model, "--task_name", "sst2", "--glue_dir", DATA, "--do_train",
                           "--max_train_samples", "8", "--rpe_learning_rate", "0.1", "--report_to", "none",
                           "--output_dir", str(tmp_path / "softmax")])


def test_set_rpe_learning_rate_moves_only_the_rpe_table_fast():
    from nprf_hf import NPRFBertConfig, NPRFBertForSequenceClassification

    config = NPRFBertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=20, num_random_features=8)
    torch.manual_seed(0)
    model = NPRFBertForSequenceClassification(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(
        [{"params": list(model.parameters()), "weight_decay": 0.01}, {"params": [], "weight_decay": 0.0}], lr=1e-7
    )
    moved = glue_scripts.set_rpe_learning_rate(optimizer, model, 0.1)
    assert [id(p) for p in moved] == [id(model.bert.encoder.rpe_table)]
    assert optimizer.param_groups[-1]["lr"] == 0.1 and optimizer.param_groups[-1]["weight_decay"] == 0.0
    assert all(id(p) not in {id(q) for q in moved} for g in optimizer.param_groups[:-1] for p in g["params"])
    ids = torch.randint(0, 50, (4, 12))
    model(input_ids=ids, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    optimizer.step()
    change = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()}
    assert change["bert.encoder.rpe_table"] > 0.05  # Adam's first step moves each entry by about lr
    assert max(v for n, v in change.items() if n != "bert.encoder.rpe_table") < 1e-5

    softmax = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=20))
    with pytest.raises(ValueError, match="no rpe_table"):
        glue_scripts.set_rpe_learning_rate(torch.optim.AdamW(softmax.parameters()), softmax, 0.1)


class FakeHubApi:
    """Records what would go to the Hub."""

    calls = []

    def __init__(self, *args, **kwargs):
        pass

    def create_repo(self, repo_id, **kwargs):
        FakeHubApi.calls.append(("create_repo", repo_id))
        return SimpleNamespace(repo_id=f"someone/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        FakeHubApi.calls.append(("create_commit", repo_id, sorted(op.path_in_repo for op in operations)))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")


def test_run_glue_push_to_hub(tiny_model, tmp_path, monkeypatch):
    import huggingface_hub

    FakeHubApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHubApi)
    write_tsv(tmp_path / "SST-2" / "train.tsv", [["sentence", "label"]] + [["nice", "1"], ["awful", "0"]] * 2)
    write_tsv(tmp_path / "SST-2" / "dev.tsv", [["sentence", "label"], ["nice", "1"], ["awful", "0"]])
    run_glue.main([
        "--model_name_or_path", tiny_model, "--task_name", "sst2", "--glue_dir", str(tmp_path), "--do_train",
        "--max_steps", "1", "--output_dir", str(tmp_path / "my-model"), "--save_strategy", "no",
        "--push_to_hub", "--hub_strategy", "end",
    ])
    assert FakeHubApi.calls[0] == ("create_repo", "my-model") and len(FakeHubApi.calls) == 2  # once, at the end
    kind, repo_id, files = FakeHubApi.calls[-1]
    assert (kind, repo_id) == ("create_commit", "someone/my-model")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)


def test_run_glue_push_to_hub_nprf_uploads_code_and_card(tiny_model, tmp_path):
    """A converted NPRF model goes up in one commit with its remote code and an NPRF model card."""
    from unittest import mock

    from huggingface_hub import HfApi

    commits = []

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=f"someone/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        commits.append((repo_id, {op.path_in_repo: op.path_or_fileobj for op in operations}))
        card = [op.path_or_fileobj for op in operations if op.path_in_repo == "README.md"][0]
        commits[-1] += (open(card).read(),)
        return SimpleNamespace(oid="0" * 40)

    write_tsv(tmp_path / "SST-2" / "train.tsv", [["sentence", "label"]] + [["nice", "1"], ["awful", "0"]] * 2)
    write_tsv(tmp_path / "SST-2" / "dev.tsv", [["sentence", "label"], ["nice", "1"], ["awful", "0"]])
    with mock.patch.object(HfApi, "create_repo", create_repo), mock.patch.object(HfApi, "create_commit", create_commit):
        run_glue.main([
            "--model_name_or_path", tiny_model, "--convert_to_nprf", "--task_name", "sst2", "--glue_dir", str(tmp_path),
            "--do_train", "--do_eval", "--max_steps", "1", "--output_dir", str(tmp_path / "nprf-model"),
            "--save_strategy", "no", "--push_to_hub",
        ])
    assert len(commits) == 1
    repo_id, files, card = commits[0]
    assert repo_id == "someone/nprf-model"
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", *remote_code_files()} <= set(files)
    assert "trust_remote_code=True" in card and "model-index" in card and "accuracy" in card


# ----------------------------------------------------------------------------------------------
# run_glue_no_trainer.py (Accelerate)
# ----------------------------------------------------------------------------------------------


@needs_data
def test_no_trainer_cola_with_accumulation_and_checkpoints(tiny_model, tmp_path):
    out = tmp_path / "out"
    metrics = run_glue_no_trainer.main([
        "--model_name_or_path", tiny_model, "--task_name", "cola", "--glue_dir", DATA,
        "--max_train_samples", "40", "--max_eval_samples", "17", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "3", "--num_train_epochs", "2", "--checkpointing_steps", "epoch",
        "--output_dir", str(out),
    ])
    results = read_json(out / "eval_results.json")
    assert results == metrics == read_json(out / "all_results.json")
    # 10 batches per epoch, 3 per step: 4 optimizer steps per epoch (the last one partial)
    assert results["train_steps"] == 8 and results["epoch"] == 1 and results["eval_samples"] == 17
    assert sorted(d for d in os.listdir(out) if d.startswith("epoch_")) == ["epoch_0", "epoch_1"]
    expected, _ = recomputed_metrics(str(out), "cola", 17)
    assert results["eval_matthews_correlation"] == pytest.approx(expected["matthews_correlation"])


@needs_data
def test_no_trainer_resume_reproduces_uninterrupted_run(tiny_model, tmp_path):
    """A run resumed from a mid-epoch checkpoint ends with bit-identical weights (dropout on)."""
    common = [
        "--model_name_or_path", tiny_model, "--task_name", "sst2", "--glue_dir", DATA,
        "--max_train_samples", "24", "--max_eval_samples", "8", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "2", "--num_train_epochs", "2", "--learning_rate", "1e-3",
    ]
    run_glue_no_trainer.main(common + ["--output_dir", str(tmp_path / "full")])
    run_glue_no_trainer.main(common + ["--output_dir", str(tmp_path / "ckpt"), "--checkpointing_steps", "2"])
    assert sorted(d for d in os.listdir(tmp_path / "ckpt") if d.startswith("step_")) == ["step_2", "step_4", "step_6"]
    full = load_file(tmp_path / "full" / "model.safetensors")
    assert all(torch.equal(full[k], v) for k, v in load_file(tmp_path / "ckpt" / "model.safetensors").items())

    # step_4 lies inside the second epoch (3 steps per epoch): resume there
    run_glue_no_trainer.main(common + ["--output_dir", str(tmp_path / "resumed"),
                                       "--resume_from_checkpoint", str(tmp_path / "ckpt" / "step_4")])
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(full[k], v) for k, v in resumed.items())
    assert read_json(tmp_path / "resumed" / "eval_results.json") == read_json(tmp_path / "full" / "eval_results.json")

    # "latest" picks the newest checkpoint folder of output_dir
    shutil.rmtree(tmp_path / "ckpt" / "step_6")
    os.remove(tmp_path / "ckpt" / "model.safetensors")
    run_glue_no_trainer.main(common + ["--output_dir", str(tmp_path / "ckpt"), "--resume_from_checkpoint", "latest"])
    assert all(torch.equal(full[k], v) for k, v in load_file(tmp_path / "ckpt" / "model.safetensors").items())


def test_no_trainer_bf16_and_push_to_hub(tiny_model, tmp_path, monkeypatch):
    import huggingface_hub

    FakeHubApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHubApi)
    write_tsv(tmp_path / "RTE" / "train.tsv", [["index", "sentence1", "sentence2", "label"]]
              + [[str(i), f"premise {i}", f"hypothesis {i}", ["entailment", "not_entailment"][i % 2]] for i in range(8)])
    write_tsv(tmp_path / "RTE" / "dev.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "entailment"]])
    out = tmp_path / "rte-model"
    metrics = run_glue_no_trainer.main([
        "--model_name_or_path", tiny_model, "--task_name", "rte", "--glue_dir", str(tmp_path / "RTE"),
        "--mixed_precision", "bf16", "--max_train_steps", "2", "--checkpointing_steps", "1",
        "--output_dir", str(out), "--push_to_hub", "--hub_model_id", "rte-tiny",
    ])
    assert metrics["train_steps"] == 2 and set(metrics) >= {"eval_accuracy", "eval_samples"}
    assert FakeHubApi.calls[0] == ("create_repo", "rte-tiny")
    kind, repo_id, files = FakeHubApi.calls[-1]
    assert (kind, repo_id) == ("create_commit", "someone/rte-tiny")
    assert {"config.json", "model.safetensors", "eval_results.json"} <= set(files)


def test_no_trainer_argument_errors(tiny_model, tmp_path):
    base = ["--model_name_or_path", tiny_model, "--task_name", "sst2", "--output_dir", str(tmp_path)]
    for bad in (["--checkpointing_steps", "often"], ["--checkpointing_steps", "0"], ["--task_name", "squad"]):
        with pytest.raises((SystemExit, ValueError)):
            run_glue_no_trainer.parse_args(base + bad)
    with pytest.raises(SystemExit):
        run_glue_no_trainer.parse_args(["--model_name_or_path", tiny_model, "--glue_dir", DATA])
    args = run_glue_no_trainer.parse_args(base + ["--resume_from_checkpoint", str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="epoch_N or step_N folder"):
        run_glue_no_trainer.find_checkpoint(args)


# ----------------------------------------------------------------------------------------------
# Two CPU processes with accelerate launch
# ----------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_data
@pytest.mark.parametrize("script", [RUN_GLUE_NO_TRAINER, RUN_GLUE], ids=["no_trainer", "trainer"])
def test_two_process_data_parallel(tiny_model, tmp_path, script):
    """Real 2-process DDP on CPU: eval_results.json is written once, by process 0, and holds the
    metrics of the whole (odd-sized) eval slice, each row counted once."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    out = tmp_path / "out"
    command = [
        accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), script,
        "--model_name_or_path", tiny_model, "--task_name", "mrpc", "--glue_dir", DATA, "--output_dir", str(out),
        "--max_train_samples", "24", "--max_eval_samples", "21", "--per_device_train_batch_size", "4",
        "--num_train_epochs", "1", "--learning_rate", "1e-3", "--convert_to_nprf",
    ]
    if script == RUN_GLUE:
        command += ["--do_train", "--do_eval", "--save_strategy", "no"]
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert "Num processes: 2" in log or "world size: 2" in log
    writes = re.findall(r"Wrote \S*eval_results\.json \(process (\d+) of (\d+)\)", log)
    assert writes == [("0", "2")], log[-5000:]
    # the conversion report and the tokenization progress bars come from the main process only
    assert log.count("Converted BertForSequenceClassification (bert) -> NPRFBertForSequenceClassification") <= 1, log
    segments = [segment.strip() for segment in re.split(r"[\r\n]", log)]
    tokenized = [s for s in segments if s.startswith("Tokenizing: 100%")]
    assert len(tokenized) <= 2, tokenized  # train + validation, not once per process
    assert len([s for s in segments if s.startswith("Loading weights: 100%")]) <= 1, log[-5000:]

    results = read_json(out / "eval_results.json")
    assert results["eval_samples"] == 21
    expected, loss = recomputed_metrics(str(out), "mrpc", 21)
    assert results["eval_accuracy"] == pytest.approx(expected["accuracy"])
    assert results["eval_f1"] == pytest.approx(expected["f1"])
    if "eval_loss" in results:  # the Trainer's loss is not scaled by the number of processes
        assert results["eval_loss"] == pytest.approx(loss, rel=1e-3)
