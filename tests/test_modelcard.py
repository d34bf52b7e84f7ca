"""Model cards (nprf_hf.modelcard) and Hub publishing, tested offline with a mocked Hub API (issue 6)."""

import argparse
import json
import os
import shlex
from unittest import mock

import pytest
import yaml
from conftest import tiny_config
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl
from transformers import BertConfig, BertTokenizerFast

from nprf_hf import (
    NPRFBertConfig,
    NPRFBertForSequenceClassification,
    NPRFRobertaConfig,
    cli,
    modelcard,
)
from nprf_hf.checkpoint_files import remote_code_files
from nprf_hf.cli import build_parser

TINY = tiny_config(num_random_features=16)
GLUE_RESULTS = {
    "epoch": 3.0,
    "eval_accuracy": 0.8125,
    "eval_f1": 0.8571,
    "eval_loss": 0.43,
    "eval_runtime": 2.5,
    "eval_samples": 408,
    "eval_samples_per_second": 160.0,
}
CODE_FILES = set(remote_code_files())


def save_config(path, architecture, family="bert", **overrides):
    config_class = NPRFBertConfig if family == "bert" else NPRFRobertaConfig
    config = config_class(**TINY, **overrides)
    config.architectures = [architecture]
    config.save_pretrained(path)
    return str(path)


def front_matter(path):
    text = open(path).read()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def bash_block_after(body, heading):
    block = body.split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.replace("\\\n", " ")


@pytest.fixture
def glue_dir(tmp_path):
    model_dir = save_config(tmp_path / "nprf-minilm-mrpc", "NPRFBertForSequenceClassification", finetuning_task="mrpc")
    with open(os.path.join(model_dir, "eval_results.json"), "w") as f:
        json.dump(GLUE_RESULTS, f)
    return model_dir


def tiny_tokenizer(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "nprf", "attention", "is", "fast"]))
    return BertTokenizerFast(vocab_file=str(vocab))


# ---------------------------------------------------------------------------------------------
# The card
# ---------------------------------------------------------------------------------------------


def test_glue_card_front_matter_and_model_index(glue_dir):
    path = modelcard.write_model_card(glue_dir, base_model="sentence-transformers/all-MiniLM-L6-v2")
    assert path == os.path.join(glue_dir, "README.md")
    meta, body = front_matter(path)
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-classification"
    assert {"nprf", "kernelized-attention", "relative-position", "bert", "glue", "mrpc"} <= set(meta["tags"])
    assert meta["datasets"] == ["nyu-mll/glue"]
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert meta["metrics"] == ["accuracy", "f1"]  # no loss, runtime, sample counts
    (index,) = meta["model-index"]
    assert index["name"] == "nprf-minilm-mrpc"
    (result,) = index["results"]
    assert result["task"]["type"] == "text-classification"
    assert result["dataset"] == {"name": "GLUE MRPC", "type": "nyu-mll/glue", "config": "mrpc", "split": "validation"}
    assert {m["type"]: m["value"] for m in result["metrics"]} == {"accuracy": 0.8125, "f1": 0.8571}
    # huggingface_hub reads the same model-index back
    card = ModelCard.load(path)
    assert sorted((r.metric_type, r.metric_value) for r in card.data.eval_results) == [("accuracy", 0.8125), ("f1", 0.8571)]
    assert "| nyu-mll/glue | mrpc | validation | Accuracy | 0.8125 |" in body


def test_card_body_usage_settings_and_limits(glue_dir):
    path = modelcard.write_model_card(
        glue_dir, base_model="sentence-transformers/all-MiniLM-L6-v2", repo_id="someone/nprf-minilm-mrpc"
    )
    _, body = front_matter(path)
    assert 'AutoModelForSequenceClassification.from_pretrained("someone/nprf-minilm-mrpc", trust_remote_code=True)' in body
    assert 'pipeline("text-classification", model="someone/nprf-minilm-mrpc", trust_remote_code=True)' in body
    assert "| `num_random_features` | `16` |" in body
    assert "| `max_position_embeddings` | `64` |" in body
    assert "Inputs are limited to 64 tokens" in body and "--max-position-embeddings" in body
    assert "must be fine-tuned" in body
    assert "@inproceedings{luo2021stable" in body


def test_recipe_is_a_valid_convert_command_with_the_models_settings(tmp_path):
    model_dir = save_config(
        tmp_path / "m", "NPRFRobertaForMaskedLM", "roberta", feature_map="prf", rpe_num_buckets=16,
        rpe_max_distance=64, rpe_shared_across_layers=False, position_embedding_type="none",
    )
    _, body = front_matter(modelcard.write_model_card(model_dir, base_model="FacebookAI/roberta-base"))
    recipe = bash_block_after(body, "## How it was made")
    command = next(line for line in recipe.splitlines() if line.startswith("nprf-hf convert"))
    args = build_parser().parse_args(shlex.split(command)[1:])  # the real `nprf-hf` parser accepts it
    assert (args.src, args.num_random_features, args.feature_map) == ("FacebookAI/roberta-base", 16, "prf")
    assert (args.rpe_num_buckets, args.rpe_max_distance, args.rpe_shared_across_layers) == (16, 64, False)
    assert args.position_embedding_type == "none"
    assert "inputs of any length" in body


@pytest.mark.parametrize(
    "architecture,family,pipeline_tag,auto_class",
    [
        ("NPRFBertModel", "bert", "feature-extraction", "AutoModel"),
        ("NPRFBertForMaskedLM", "bert", "fill-mask", "AutoModelForMaskedLM"),
        ("NPRFBertForSequenceClassification", "bert", "text-classification", "AutoModelForSequenceClassification"),
        ("NPRFBertForTokenClassification", "bert", "token-classification", "AutoModelForTokenClassification"),
        ("NPRFBertForQuestionAnswering", "bert", "question-answering", "AutoModelForQuestionAnswering"),
        ("NPRFRobertaForMultipleChoice", "roberta", "multiple-choice", "AutoModelForMultipleChoice"),
        ("NPRFRobertaForCausalLM", "roberta", "text-generation", "AutoModelForCausalLM"),
    ],
)
def test_pipeline_tag_follows_the_architecture(tmp_path, architecture, family, pipeline_tag, auto_class):
    model_dir = save_config(tmp_path / "m", architecture, family)
    meta, body = front_matter(modelcard.write_model_card(model_dir))
    assert meta["pipeline_tag"] == pipeline_tag
    assert family in meta["tags"]
    assert f"{auto_class}.from_pretrained(" in body
    assert "model-index" not in meta and "No evaluation results were given" in body


def test_mnli_splits_cola_metric_and_task_name_sources(tmp_path):
    mnli = save_config(tmp_path / "mnli", "NPRFBertForSequenceClassification")
    results = {"eval_accuracy": 0.7, "eval_accuracy_mm": 0.71, "eval_loss_mm": 0.9, "task_name": "mnli"}
    meta, _ = front_matter(modelcard.write_model_card(mnli, eval_results=results))  # task name from the results
    splits = {r["dataset"]["split"]: r["metrics"][0]["value"] for r in meta["model-index"][0]["results"]}
    assert splits == {"validation_matched": 0.7, "validation_mismatched": 0.71}

    cola = save_config(tmp_path / "cola", "NPRFBertForSequenceClassification", finetuning_task="cola")
    meta, _ = front_matter(modelcard.write_model_card(cola, eval_results={"eval_matthews_correlation": 0.31}))
    (result,) = meta["model-index"][0]["results"]
    assert result["dataset"]["config"] == "cola"  # task name from config.finetuning_task
    assert result["metrics"] == [{"type": "matthews_correlation", "value": 0.31, "name": "Matthews Correlation"}]

    # an explicit task name wins; a non-GLUE dataset needs datasets=
    mlm = save_config(tmp_path / "mlm", "NPRFBertForMaskedLM")
    meta, body = front_matter(
        modelcard.write_model_card(
            mlm, eval_results={"perplexity": 12.5, "eval_loss": 2.5}, datasets=["Salesforce/wikitext"],
            task_name="wikitext-2-v1", eval_split="test", notes="First 192 blocks of 128 tokens.",
        )
    )
    (result,) = meta["model-index"][0]["results"]
    assert result["dataset"]["type"] == "Salesforce/wikitext" and result["dataset"]["config"] == "wikitext-2-v1"
    assert result["dataset"]["split"] == "test"
    assert result["metrics"][0]["type"] == "perplexity" and result["metrics"][0]["value"] == 12.5
    assert "| Perplexity | 12.5000 |\n\nFirst 192 blocks of 128 tokens." in body


def test_eval_results_default_and_opt_out(glue_dir):
    meta, _ = front_matter(modelcard.write_model_card(glue_dir))  # MODEL_DIR/eval_results.json by default
    assert meta["metrics"] == ["accuracy", "f1"]
    meta, _ = front_matter(modelcard.write_model_card(glue_dir, eval_results=False))
    assert "model-index" not in meta and "metrics" not in meta


def test_bad_inputs_give_clear_errors(tmp_path):
    bert_dir = tmp_path / "bert"
    BertConfig(**tiny_config()).save_pretrained(bert_dir)
    with pytest.raises(ValueError, match="model_type='bert', not an NPRF model.*nprf-hf convert"):
        modelcard.write_model_card(str(bert_dir))
    with pytest.raises(ValueError, match="no config.json"):
        modelcard.write_model_card(str(tmp_path))
    model_dir = save_config(tmp_path / "m", "NPRFBertForSequenceClassification")
    with pytest.raises(ValueError, match="base_model must be a Hub model id"):
        modelcard.write_model_card(model_dir, base_model="/local/path/to/model")
    with pytest.raises(ValueError, match="dataset is unknown"):
        modelcard.write_model_card(model_dir, eval_results={"eval_accuracy": 0.5})
    with pytest.raises(ValueError, match="does not exist"):
        modelcard.write_model_card(model_dir, eval_results=str(tmp_path / "missing.json"))
    weird = save_config(tmp_path / "w", "BertForSequenceClassification")
    with pytest.raises(ValueError, match="not an NPRF class"):
        modelcard.write_model_card(weird)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def test_cli_main_writes_the_card(glue_dir, tmp_path, capsys):
    results = tmp_path / "other_results.json"
    results.write_text(json.dumps({"eval_accuracy": 0.5}))
    output = tmp_path / "card.md"
    code = cli.main(
        ["card", glue_dir, "--eval-results", str(results), "--base-model", "google-bert/bert-base-uncased",
         "--dataset", "nyu-mll/glue", "--task-name", "sst2", "--tag", "demo", "--output", str(output)]
    )
    assert code == 0 and f"Wrote {output}" in capsys.readouterr().out
    meta, _ = front_matter(output)
    assert meta["base_model"] == "google-bert/bert-base-uncased" and "demo" in meta["tags"]
    (result,) = meta["model-index"][0]["results"]
    assert result["dataset"]["config"] == "sst2" and result["metrics"][0]["value"] == 0.5
    assert not os.path.exists(os.path.join(glue_dir, "README.md"))

    assert cli.main(["card", str(tmp_path / "nowhere")]) == 2
    assert "nprf-hf card: error:" in capsys.readouterr().err


def test_add_card_subcommand_registers_card(glue_dir):
    parser = argparse.ArgumentParser(prog="nprf-hf")
    cli.add_card_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["card", glue_dir, "--no-eval-results"])
    assert args.func(args) == 0
    meta, _ = front_matter(os.path.join(glue_dir, "README.md"))
    assert "model-index" not in meta


# ---------------------------------------------------------------------------------------------
# Hub (mocked: nothing leaves the machine)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_hub():
    """Patch HfApi.create_repo / create_commit; record each commit's files and keyword arguments."""
    commits = []

    def create_repo(self, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            source = op.path_or_fileobj
            files[op.path_in_repo] = open(source, "rb").read() if isinstance(source, str) else bytes(source)
        commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/{'0' * 40}", commit_message="upload",
            commit_description="", oid="0" * 40, pr_url=None,
        )

    with mock.patch.object(HfApi, "create_repo", create_repo), mock.patch.object(HfApi, "create_commit", create_commit):
        yield commits


def tiny_model():
    config = NPRFBertConfig(**TINY, finetuning_task="sst2")
    return NPRFBertForSequenceClassification(config).eval()


def test_model_push_to_hub_uploads_weights_config_and_code(fake_hub):
    tiny_model().push_to_hub("user/nprf-tiny")
    (commit,) = fake_hub
    assert commit["repo_id"] == "user/nprf-tiny"
    assert {"model.safetensors", "config.json", "README.md"} | CODE_FILES <= set(commit["files"])
    config = json.loads(commit["files"]["config.json"])
    assert config["auto_map"]["AutoModelForSequenceClassification"] == "modeling_nprf.NPRFBertForSequenceClassification"


def test_push_nprf_to_hub_uploads_everything_with_the_nprf_card(fake_hub, tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)
    info = modelcard.push_nprf_to_hub(
        tiny_model(), "user/nprf-tiny-sst2", tokenizer=tokenizer,
        card_kwargs={"eval_results": GLUE_RESULTS, "base_model": "google-bert/bert-base-uncased"},
    )
    assert info.commit_url.startswith("https://huggingface.co/user/nprf-tiny-sst2")
    (commit,) = fake_hub
    files = commit["files"]
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json", "tokenizer_config.json"} | CODE_FILES <= set(files)
    card = files["README.md"].decode()
    meta = yaml.safe_load(card[4:].split("\n---\n", 1)[0])
    assert meta["pipeline_tag"] == "text-classification" and meta["base_model"] == "google-bert/bert-base-uncased"
    assert meta["model-index"][0]["name"] == "nprf-tiny-sst2"
    assert meta["model-index"][0]["results"][0]["dataset"]["config"] == "sst2"  # config.finetuning_task
    assert 'from_pretrained("user/nprf-tiny-sst2", trust_remote_code=True)' in card


def test_push_nprf_to_hub_from_a_saved_directory(fake_hub, tmp_path):
    out = tmp_path / "run"
    tiny_model().save_pretrained(out)
    (out / "eval_results.json").write_text(json.dumps(GLUE_RESULTS))
    (out / "README.md").write_text("stale card from the Trainer")
    (out / "checkpoint-10").mkdir()
    (out / "checkpoint-10" / "optimizer.pt").write_bytes(b"x")
    modelcard.push_nprf_to_hub(str(out), "user/run", commit_message="End of training")
    (commit,) = fake_hub
    files = commit["files"]
    assert {"model.safetensors", "config.json", "eval_results.json", "README.md"} | CODE_FILES <= set(files)
    assert not any(name.startswith("checkpoint-") for name in files)
    assert commit["commit_message"] == "End of training"
    card = files["README.md"].decode()
    assert "stale card" not in card and "value: 0.8125" in card  # results from the directory's eval_results.json
    assert (out / "README.md").read_text() == card  # written in place first: a failed push leaves it saved


def test_push_nprf_to_hub_refuses_other_models(fake_hub, tmp_path):
    BertConfig(**tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not an NPRF model"):
        modelcard.push_nprf_to_hub(str(tmp_path), "user/x")
    assert fake_hub == []
