"""examples/run_mlm.py end to end on a tiny model: train, evaluate, resume."""

import importlib.util
import json
import math
import os
import shutil

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, AutoTokenizer, BertConfig, BertForMaskedLM

from nprf_hf import NPRFBertForMaskedLM
from nprf_hf.convert import convert_checkpoint

from conftest import minilm_path, shared_data, tiny_config


ROOT = os.path.join(os.path.dirname(__file__), "..")


def _load_script():
    spec = importlib.util.spec_from_file_location("run_mlm", os.path.join(ROOT, "examples", "run_mlm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_mlm = _load_script()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Tiny softmax BERT MLM (MiniLM's tokenizer), its NPRF conversion, and small text files."""
    wikitext = shared_data("wikitext-2", "valid.txt")
    root = tmp_path_factory.mktemp("mlm")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = BertConfig(**tiny_config(vocab_size=len(tokenizer), num_attention_heads=4, intermediate_size=64))
    torch.manual_seed(0)
    softmax_dir = str(root / "softmax")
    BertForMaskedLM(config).save_pretrained(softmax_dir)
    tokenizer.save_pretrained(softmax_dir)
    nprf_dir = str(root / "nprf")
    convert_checkpoint(softmax_dir, nprf_dir, num_random_features=16)
    for name, start, count in (("train.txt", 0, 120), ("eval.txt", 200, 60)):
        with open(wikitext, encoding="utf-8") as handle:
            lines = handle.readlines()[start : start + count]
        (root / name).write_text("".join(lines), encoding="utf-8")
    return root, softmax_dir, nprf_dir


def _args(root, model, output_dir, *extra):
    return [
        "--model_name_or_path", model,
        "--train_file", str(root / "train.txt"),
        "--validation_file", str(root / "eval.txt"),
        "--max_seq_length", "32",
        "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8",
        "--max_eval_samples", "16",
        "--learning_rate", "1e-3",
        "--output_dir", str(output_dir),
        "--use_cpu",
        "--report_to", "none",
        "--seed", "7",
        "--save_strategy", "steps",
        "--save_steps", "2",
        "--logging_steps", "1",
        "--dataloader_num_workers", "0",
        *extra,
    ]


def test_train_eval_and_resume_matches_uninterrupted_run(workdir, tmp_path):
    root, _, nprf_dir = workdir
    # uninterrupted: 6 steps
    full = tmp_path / "full"
    metrics = run_mlm.main(_args(root, nprf_dir, full, "--do_train", "--do_eval", "--max_steps", "6"))
    results = json.load(open(full / "eval_results.json"))
    assert math.isfinite(results["eval_loss"]) and results["perplexity"] == pytest.approx(math.exp(results["eval_loss"]))
    assert results["eval_samples"] == 16 and metrics["eval_loss"] == results["eval_loss"]
    assert json.load(open(full / "trainer_state.json"))["global_step"] == 6
    reloaded = AutoModelForMaskedLM.from_pretrained(str(full))
    assert isinstance(reloaded, NPRFBertForMaskedLM)
    assert os.path.isfile(full / "modeling_nprf.py") and os.path.isfile(full / "tokenizer.json")
    # training moved the weights, including the RPE table (learned, started at zeros)
    start = load_file(os.path.join(nprf_dir, "model.safetensors"))
    end = load_file(str(full / "model.safetensors"))
    assert not torch.equal(end["bert.encoder.rpe_table"], start["bert.encoder.rpe_table"])

    # a run interrupted after step 4 (checkpoint-6 and the final model lost), resumed with "last":
    # the same weights, log and evaluation as the uninterrupted run
    part = tmp_path / "part"
    shutil.copytree(full / "checkpoint-4", part / "checkpoint-4")
    shutil.copytree(full / "checkpoint-2", part / "checkpoint-2")
    run_mlm.main(_args(root, nprf_dir, part, "--do_train", "--do_eval", "--max_steps", "6",
                       "--resume_from_checkpoint", "last"))
    state = json.load(open(part / "trainer_state.json"))
    assert state["global_step"] == 6
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3, 4, 5, 6]
    resumed = load_file(str(part / "model.safetensors"))
    for name, tensor in end.items():
        assert torch.allclose(resumed[name], tensor, atol=1e-6), name
    assert json.load(open(part / "eval_results.json"))["eval_loss"] == pytest.approx(results["eval_loss"], abs=1e-5)


@pytest.fixture
def no_datasets_cache():
    """datasets' cache off: with it, a later run reloads the first run's masked eval set whatever drew it."""
    was_enabled = datasets.is_caching_enabled()
    datasets.disable_caching()
    yield
    if was_enabled:
        datasets.enable_caching()


def test_softmax_baseline_and_in_process_conversion_share_eval_masks(workdir, tmp_path, monkeypatch, no_datasets_cache):
    root, softmax_dir, _ = workdir
    eval_sets = []

    class RecordingTrainer(run_mlm.Trainer):
        def __init__(self, *args, **kwargs):
            rows = kwargs["eval_dataset"][:]
            eval_sets.append({key: rows[key] for key in ("input_ids", "labels")})
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(run_mlm, "Trainer", RecordingTrainer)
    baseline = run_mlm.main(_args(root, softmax_dir, tmp_path / "softmax", "--do_eval"))
    assert math.isfinite(baseline["eval_loss"])
    # evaluation masks are fixed: a second evaluation of the same model gives the same loss
    again = run_mlm.main(_args(root, softmax_dir, tmp_path / "softmax2", "--do_eval"))
    assert again["eval_loss"] == pytest.approx(baseline["eval_loss"], abs=1e-6)

    out = tmp_path / "converted"
    run_mlm.main(_args(
        root, softmax_dir, out, "--do_train", "--do_eval", "--max_steps", "2", "--convert_to_nprf",
        "--rpe_init", "calibrated", "--calibration_text", str(root / "train.txt"), "--num_random_features", "8",
        "--rpe_shared_across_layers", "false", "--seed", "11",
    ))
    config = json.load(open(out / "config.json"))
    assert config["model_type"] == "nprf_bert" and config["num_random_features"] == 8
    model = AutoModelForMaskedLM.from_pretrained(str(out))
    assert model.bert.encoder.layer[0].attention.self.rpe_table.abs().amax() > 0
    # another training seed, a conversion and training steps: the NPRF run must still evaluate on the very
    # tokens and masks the softmax baseline did (they come from eval_mask_seed alone)
    assert len(eval_sets) == 3
    labels = torch.tensor(eval_sets[0]["labels"])
    assert labels.shape == (16, 32) and 0 < (labels != -100).sum() < labels.numel()
    for other in eval_sets[1:]:
        assert other["input_ids"] == eval_sets[0]["input_ids"] and other["labels"] == eval_sets[0]["labels"]


def test_bad_arguments(workdir, tmp_path):
    root, softmax_dir, nprf_dir = workdir
    with pytest.raises(ValueError, match="max_seq_length=128 exceeds the model's 64 positions"):
        run_mlm.main(_args(root, softmax_dir, tmp_path / "a", "--do_eval", "--max_seq_length", "128"))
    with pytest.raises(ValueError, match="already an NPRF model"):
        run_mlm.main(_args(root, nprf_dir, tmp_path / "b", "--do_eval", "--convert_to_nprf"))
    with pytest.raises(ValueError, match="no checkpoint"):
        run_mlm.main(_args(root, nprf_dir, tmp_path / "c", "--do_train", "--resume_from_checkpoint", "last"))
