"""examples/run_clm.py: causal LM from scratch (NPRF and softmax) or from a converted checkpoint, per-step log,
perplexity, bf16 autocast, a 2-process `accelerate launch`, and clear errors for user mistakes."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import nprf_hf  # noqa: F401
from nprf_hf.options import ATTENTION_VARIANTS

from conftest import shared_data


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 40}


@pytest.fixture(scope="module")
def clm():
    spec = importlib.util.spec_from_file_location("run_clm", os.path.join(ROOT, "examples", "run_clm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps one state per process; each in-process run picks its own mixed precision."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory, roberta_source):
    """(tokenizer dir, train file, validation file): real WikiText-2 lines, a small BPE tokenizer."""
    folder = tmp_path_factory.mktemp("clm_data")
    with open(shared_data("wikitext-2", "valid.txt"), encoding="utf-8") as handle:
        lines = [next(handle) for _ in range(300)]
    (folder / "train.txt").write_text("".join(lines[:250]), encoding="utf-8")
    (folder / "valid.txt").write_text("".join(lines[250:]), encoding="utf-8")
    return roberta_source, str(folder / "train.txt"), str(folder / "valid.txt")


def run(clm, data, out, *extra, model_type="nprf_roberta", overrides=TINY):
    tokenizer, train, valid = data
    return clm.main([
        "--model_type", model_type, "--tokenizer_name", tokenizer, "--config_overrides", json.dumps(overrides),
        "--train_file", train, "--validation_file", valid, "--block_size", "32", "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--output_dir", str(out), "--threads", "1", *extra,
    ])


@pytest.mark.parametrize("model_type,variant", [("roberta", None)] + [("nprf_roberta", v) for v in ATTENTION_VARIANTS])
def test_from_scratch_lowers_loss_and_logs_every_step(clm, data, tmp_path, model_type, variant):
    overrides = TINY if variant is None else {**TINY, "attention_variant": variant}
    results = run(clm, data, tmp_path / "out", "--max_steps", "30", model_type=model_type, overrides=overrides)
    log = [json.loads(line) for line in open(tmp_path / "out" / "train_log.jsonl")]
    assert [entry["step"] for entry in log] == list(range(1, 31)) and not results["diverged"]
    assert all(entry["grad_norm"] > 0 and entry["seconds"] > 0 for entry in log)
    first, last = sum(e["loss"] for e in log[:3]) / 3, sum(e["loss"] for e in log[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert results["perplexity"] == pytest.approx(float(torch.tensor(results["eval_loss"]).exp()), rel=1e-6)
    assert results["perplexity"] < float(torch.tensor(first).exp())  # learned something that generalizes
    assert json.load(open(tmp_path / "out" / "results.json")) == json.loads(json.dumps(results))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert model.config.model_type == model_type and model.config.is_decoder
    assert getattr(model.config, "attention_variant", None) == variant
    ids = torch.randint(5, model.config.vocab_size, (2, 24))
    with torch.no_grad():  # causal: a position's logits never see later tokens
        full, prefix = model(input_ids=ids).logits, model(input_ids=ids[:, :10]).logits
    torch.testing.assert_close(full[:, :10], prefix, atol=1e-4, rtol=1e-4)


def test_bf16_autocast_trains_and_evaluates(clm, data, tmp_path):
    results = run(clm, data, tmp_path / "bf16", "--max_steps", "3", "--mixed_precision", "bf16", "--no_save_model")
    assert results["mixed_precision"] == "bf16" and not results["diverged"] and results["perplexity"] > 1
    assert sorted(os.listdir(tmp_path / "bf16")) == ["results.json", "train_log.jsonl"]


def test_a_converted_checkpoint_trains(clm, data, tmp_path, roberta_source):
    decoder = tmp_path / "decoder"
    nprf_hf.convert_checkpoint(roberta_source, str(decoder), head="causal-lm", num_random_features=8)
    _, train, valid = data
    results = clm.main(["--model_name_or_path", str(decoder), "--train_file", train, "--validation_file", valid,
                        "--block_size", "32", "--max_steps", "2", "--output_dir", str(tmp_path / "tuned"),
                        "--threads", "1"])
    assert results["steps"] == 2 and results["perplexity"] > 1


def test_a_non_finite_loss_is_recorded_not_raised(clm, data, tmp_path):
    # no clipping and an absurd rate: the weights blow up within a few steps
    results = run(clm, data, tmp_path / "boom", "--max_steps", "40", "--learning_rate", "1e6", "--max_grad_norm", "0",
                  "--no_save_model")
    log = [json.loads(line) for line in open(tmp_path / "boom" / "train_log.jsonl")]
    assert results["diverged"] and results["steps"] == len(log) < 40
    assert "perplexity" not in results and log[-1]["grad_norm"] is None


def test_user_mistakes_get_clear_errors(clm, data, tmp_path, capsys, roberta_source):
    tokenizer, train, _ = data
    base = ["--train_file", train, "--output_dir", str(tmp_path / "o")]
    cases = [
        (["--tokenizer_name", tokenizer, *base], "either --model_name_or_path"),
        (["--model_type", "nprf_roberta", *base], "needs --tokenizer_name"),
        (["--model_type", "nprf_roberta", "--tokenizer_name", tokenizer, "--config_overrides", "{bad", *base],
         "not JSON"),
        (["--model_name_or_path", roberta_source, "--config_overrides", '{"hidden_size": 8}', *base],
         "applies to a fresh model"),
        (["--model_name_or_path", roberta_source, "--train_file", train, "--output_dir", roberta_source],
         "source"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            clm.main(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="is not a decoder.*--head causal-lm"):
        clm.main(["--model_name_or_path", roberta_source, *base, "--max_steps", "1"])
    with pytest.raises(SystemExit, match="max_position_embeddings >= 34"):
        run(clm, data, tmp_path / "short", "--max_steps", "1", overrides={**TINY, "max_position_embeddings": 20})


def test_accelerate_launch_ddp_on_two_cpu_processes(data, tmp_path):
    tokenizer, train, valid = data
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               os.path.join(ROOT, "examples", "accelerate", "cpu_ddp.yaml"), os.path.join(ROOT, "examples", "run_clm.py"),
               "--model_type", "nprf_roberta", "--tokenizer_name", tokenizer, "--config_overrides", json.dumps(TINY),
               "--train_file", train, "--validation_file", valid, "--block_size", "32", "--max_steps", "3",
               "--per_device_train_batch_size", "2", "--output_dir", str(tmp_path / "ddp"), "--threads", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.load(open(tmp_path / "ddp" / "results.json"))
    assert results["processes"] == 2 and results["batch_size"] == 4 and results["steps"] == 3
    assert results["perplexity"] > 1
    assert results["distributed_type"] == "MULTI_CPU" and not results["sharded_parameters"]
