"""Conversion of BERT / RoBERTa checkpoints to NPRF (nprf_hf.convert, `nprf-hf convert`)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import minilm_path, shared_data, tiny_config
from safetensors import safe_open
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForPreTraining,
    BertForSequenceClassification,
    BertForNextSentencePrediction,
    BertLMHeadModel,
    GPT2Config,
    RobertaConfig,
    RobertaForCausalLM,
    RobertaForSequenceClassification,
    T5Config,
)

import nprf_hf
from nprf_hf import NPRFBertModel, NPRFRobertaForMaskedLM
from nprf_hf.checkpoint_files import remote_code_files
from nprf_hf.cli import main as cli_main
from nprf_hf.convert import (
    bucket_attention_bias,
    convert_checkpoint,
    convert_to_nprf,
    extend_position_embeddings,
)
from nprf_hf.functional import t5_relative_position_bucket

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read_safetensors(path):
    with safe_open(path, "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    """A few hundred lines of real text (WikiText-2 valid)."""
    wikitext = shared_data("wikitext-2", "valid.txt")
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    with open(wikitext, encoding="utf-8") as handle:
        lines = [next(handle) for _ in range(300)]
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def minilm_converted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("minilm_nprf"))
    report = convert_checkpoint(minilm_path(), out, num_random_features=32)
    return out, report


def _tiny_bert_config(**kwargs):
    return BertConfig(**tiny_config(vocab_size=100, num_attention_heads=4, intermediate_size=64, **kwargs))


# ---------------------------------------------------------------------------------------------
# The real pretrained MiniLM (BERT)
# ---------------------------------------------------------------------------------------------


def test_minilm_tensors_copied_bit_identically(minilm_converted):
    out, report = minilm_converted
    source = _read_safetensors(os.path.join(minilm_path(), "model.safetensors"))
    converted = _read_safetensors(os.path.join(out, "model.safetensors"))
    # the source file carries the legacy position_ids buffer, non-persistent in transformers 5
    legacy = {"embeddings.position_ids"}
    for name, tensor in source.items():
        if name in legacy:
            continue
        assert name in converted, name
        assert converted[name].dtype == tensor.dtype and torch.equal(converted[name], tensor), name
    new = set(converted) - set(source)
    assert new == set(report.new)
    assert new == {"encoder.rpe_table"} | {f"encoder.layer.{i}.attention.self.projection" for i in range(6)}
    assert torch.count_nonzero(converted["encoder.rpe_table"]) == 0
    assert converted["encoder.layer.0.attention.self.projection"].shape == (12, 32, 32)
    model = NPRFBertModel.from_pretrained(out)
    assert torch.equal(model.embeddings.position_ids, source["embeddings.position_ids"])


def test_minilm_converted_runs_and_reloads_via_auto(minilm_converted):
    out, _ = minilm_converted
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "nprf_bert" and config["architectures"] == ["NPRFBertModel"]
    assert config["num_random_features"] == 32 and "AutoModel" in config["auto_map"]
    for code in remote_code_files():
        assert os.path.isfile(os.path.join(out, code)), code
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["The tower is 324 metres tall.", "A short one."], padding=True, return_tensors="pt")
    model = AutoModel.from_pretrained(out)
    assert isinstance(model, NPRFBertModel) and not model.training
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape == (2, batch["input_ids"].shape[1], 384) and torch.isfinite(hidden).all()
    # the sequence-classification head builds on the converted base (new classifier only)
    classifier = AutoModelForSequenceClassification.from_pretrained(out, num_labels=3)
    assert torch.equal(classifier.bert.encoder.rpe_table, model.encoder.rpe_table)
    with torch.no_grad():
        assert classifier(**batch).logits.shape == (2, 3)


def test_minilm_reloads_with_remote_code_in_clean_process(minilm_converted, tmp_path):
    out, _ = minilm_converted
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["Remote code loads the same model."], return_tensors="pt")
    with torch.no_grad():
        expected = NPRFBertModel.from_pretrained(out)(**batch).last_hidden_state
    torch.save({"batch": dict(batch), "expected": expected}, tmp_path / "io.pt")
    script = f"""
import os, sys
sys.modules["nprf_hf"] = None  # the installed package must not be used
sys.path = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != {REPO_ROOT!r}]
import torch
from transformers import AutoModel
io = torch.load({str(tmp_path / 'io.pt')!r})
model = AutoModel.from_pretrained({out!r}, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    got = model(**io["batch"]).last_hidden_state
assert torch.allclose(got, io["expected"], atol=1e-5), (got - io["expected"]).abs().max()
print("REMOTE_OK", type(model).__name__)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE_OK NPRFBertModel" in result.stdout


def test_minilm_position_extension_and_long_input(tmp_path):
    out = str(tmp_path / "long")
    report = convert_checkpoint(minilm_path(), out, max_position_embeddings=700, num_random_features=16)
    assert report.extended == {"embeddings.position_embeddings.weight": (512, 700)}
    source = _read_safetensors(os.path.join(minilm_path(), "model.safetensors"))["embeddings.position_embeddings.weight"]
    table = _read_safetensors(os.path.join(out, "model.safetensors"))["embeddings.position_embeddings.weight"]
    assert table.shape == (700, 384)
    assert torch.equal(table[:512], source) and torch.equal(table[512:], source[:188])
    assert AutoTokenizer.from_pretrained(out).model_max_length == 700
    model = AutoModel.from_pretrained(out)
    assert model.embeddings.position_embeddings.num_embeddings == 700
    input_ids = torch.randint(1000, 20000, (1, 700))
    with torch.no_grad():
        hidden = model(input_ids=input_ids).last_hidden_state
    assert hidden.shape == (1, 700, 384) and torch.isfinite(hidden).all()


def test_minilm_in_memory_with_head_and_calibration(calibration_file):
    from transformers import BertModel

    source = BertModel.from_pretrained(minilm_path())
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    before = {k: v.clone() for k, v in source.state_dict().items()}
    model, report = convert_to_nprf(
        source, tokenizer=tokenizer, head="masked-lm", rpe_init="calibrated", calibration_text=calibration_file,
        rpe_shared_across_layers=False, return_report=True, calibration_blocks=8,
    )
    assert type(model).__name__ == "NPRFBertForMaskedLM"
    # the source model is left as it was (weights, attention implementation, mode)
    assert all(torch.equal(v, before[k]) for k, v in source.state_dict().items())
    assert source.config._attn_implementation == "sdpa" and not source.training
    state = model.state_dict()
    for name, tensor in before.items():
        if not name.startswith("pooler."):  # a masked-LM BERT has no pooler
            assert torch.equal(state["bert." + name], tensor), name
    assert sorted(report.dropped) == ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]
    # the MLM transform and bias are new; the decoder is tied to the (copied) word embeddings
    assert "cls.predictions.transform.dense.weight" in report.new
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    tables = torch.stack([layer.attention.self.rpe_table.detach() for layer in model.bert.encoder.layer])
    assert tables.shape == (6, 12, 32) and torch.isfinite(tables).all()
    assert tables.abs().amax() > 0.05  # the source's distance preferences are not flat
    assert not torch.allclose(tables[0], tables[5])  # one table per layer
    # heads differ in their preferred distance
    seen = [b for b in range(32) if b != 16]  # bucket 16 = "distance 0 after the query": never occurs
    assert tables[:, :, seen].argmax(-1).unique().numel() > 1


def test_calibrated_rpe_moves_nprf_attention_towards_source(calibration_file):
    """The calibrated table makes the NPRF model's implied attention-by-distance profile closer to the
    softmax source's than the zeros table does (measured on held-out text)."""
    from transformers import BertModel

    source = BertModel.from_pretrained(minilm_path())
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    with open(shared_data("wikitext-2", "valid.txt"), encoding="utf-8") as handle:
        text = " ".join(line.strip() for _, line in zip(range(700), handle) if line.strip())[-4000:]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:126]
    input_ids = torch.tensor([[tokenizer.cls_token_id] + ids + [tokenizer.sep_token_id]])
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    keep[:, 0] = keep[:, -1] = False

    def profile(model):
        with torch.no_grad():
            attentions = model(input_ids=input_ids, output_attentions=True).attentions
        return bucket_attention_bias([a.float() for a in attentions], keep, keep).mean(1)  # [L, nb]

    source.set_attn_implementation("eager")
    target = profile(source)
    errors = {}
    for init in ("zeros", "calibrated"):
        kwargs = {"calibration_text": calibration_file, "calibration_blocks": 8} if init == "calibrated" else {}
        model = convert_to_nprf(source, tokenizer=tokenizer, rpe_init=init, rpe_shared_across_layers=False,
                                num_random_features=64, **kwargs)
        errors[init] = (profile(model) - target).pow(2).mean().item()
    assert errors["calibrated"] < 0.25 * errors["zeros"], errors  # measured: 0.017 vs 0.55


# ---------------------------------------------------------------------------------------------
# RoBERTa (tiny, random weights, saved here)
# ---------------------------------------------------------------------------------------------


def test_roberta_converts_with_position_extension(roberta_source, tmp_path):
    out = str(tmp_path / "roberta_nprf")
    report = convert_checkpoint(roberta_source, out, max_position_embeddings=2050, num_random_features=16)
    assert report.target_class == "NPRFRobertaForMaskedLM" and report.source_architecture == "RobertaForMaskedLM"
    source = _read_safetensors(os.path.join(roberta_source, "model.safetensors"))
    converted = _read_safetensors(os.path.join(out, "model.safetensors"))
    key = "roberta.embeddings.position_embeddings.weight"
    for name, tensor in source.items():
        if name != key:
            assert torch.equal(converted[name], tensor), name
    table, old = converted[key], source[key]
    assert table.shape == (2050, 32)
    assert torch.equal(table[:66], old)  # offset rows 0 (and padding row 1) in place, then positions
    assert torch.equal(table[66:130], old[2:66]) and torch.equal(table[2:66], table[2 + 64 * 31 : 2050])
    assert set(converted) - set(source) == set(report.new)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.model_max_length == 2048
    model = AutoModelForMaskedLM.from_pretrained(out)
    assert isinstance(model, NPRFRobertaForMaskedLM)
    assert model.roberta.embeddings.position_ids.shape[-1] == 2050
    text = open(shared_data("wikitext-2", "valid.txt"), encoding="utf-8").read()[:40000]
    batch = tokenizer(text, truncation=True, max_length=2048, return_tensors="pt")
    assert batch["input_ids"].shape[1] == 2048
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, 2048, len(tokenizer)) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "source_class, target_name, auto_class",
    [
        (RobertaForSequenceClassification, "NPRFRobertaForSequenceClassification", AutoModelForSequenceClassification),
        (RobertaForCausalLM, "NPRFRobertaForCausalLM", AutoModelForCausalLM),
    ],
)
def test_roberta_heads_from_architectures(roberta_source, tmp_path, calibration_file, source_class, target_name,
                                          auto_class):
    config = RobertaConfig.from_pretrained(roberta_source, num_labels=3, is_decoder=source_class is RobertaForCausalLM)
    src = str(tmp_path / "src")
    source_class.from_pretrained(roberta_source, config=config).save_pretrained(src)
    AutoTokenizer.from_pretrained(roberta_source).save_pretrained(src)
    out = str(tmp_path / "out")
    report = convert_checkpoint(src, out, rpe_init="calibrated", calibration_text=calibration_file,
                                calibration_block_size=48)
    assert report.target_class == target_name and not report.dropped
    model = auto_class.from_pretrained(out)
    assert type(model).__name__ == target_name
    table = model.roberta.encoder.rpe_table
    assert torch.isfinite(table).all() and table.abs().amax() > 0
    source_state = source_class.from_pretrained(src).state_dict()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in source_state.items())
    batch = AutoTokenizer.from_pretrained(out)(["one sentence here", "two"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def test_extend_position_embeddings_tiles_learned_rows():
    weight = torch.arange(10.0)[:, None].repeat(1, 3)
    extended = extend_position_embeddings(weight, 23, offset=2)
    assert extended[:, 0].tolist() == list(range(10)) + list(range(2, 10)) + list(range(2, 7))
    assert torch.equal(extend_position_embeddings(weight, 10), weight)
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        extend_position_embeddings(weight, 8)


def test_bucket_attention_bias_recovers_distance_preference():
    n, heads = 40, 3
    positions = torch.arange(n)
    relative = positions[None, :] - positions[:, None]
    uniform = torch.full((1, heads, n, n), 1.0 / n)
    previous = (relative == -1).float().expand(1, heads, n, n).clone()
    previous[..., 0, 0] = 1.0  # first query attends to itself
    keep = torch.ones(1, n, dtype=torch.bool)
    bias = bucket_attention_bias([uniform, previous], keep, keep, num_buckets=16, max_distance=32)
    assert bias.shape == (2, heads, 16)
    assert torch.allclose(bias[0], torch.zeros(heads, 16), atol=1e-6)  # uniform attention: flat
    bucket_prev = t5_relative_position_bucket(torch.tensor(-1), num_buckets=16, max_distance=32).item()
    assert (bias[1].argmax(-1) == bucket_prev).all()


def test_bucket_attention_bias_causal_uniform_is_flat_and_previous_token_peaks_at_one():
    """Row i of causal attention has i + 1 keys: a teacher with no distance preference must still calibrate to
    a flat bias, although near distances are seen in more (and shorter) rows than far ones."""
    n, heads = 40, 2
    positions = torch.arange(n)
    relative = positions[None, :] - positions[:, None]
    uniform = (torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]).expand(1, heads, n, n)
    previous = (relative == -1).float().expand(1, heads, n, n).clone()
    previous[..., 0, 0] = 1.0  # first query attends to itself
    keep = torch.ones(1, n, dtype=torch.bool)
    bias = bucket_attention_bias([uniform, previous], keep, keep, num_buckets=16, max_distance=32, causal=True)
    assert bias.shape == (2, heads, 16)
    assert (bias[0].amax(-1) - bias[0].amin(-1) <= 0.05).all(), bias[0]  # was a 1.34-nat recency slope
    bucket_prev = t5_relative_position_bucket(torch.tensor(-1), bidirectional=False, num_buckets=16,
                                              max_distance=32).item()
    assert bucket_prev == 1 and (bias[1].argmax(-1) == bucket_prev).all(), bias[1]
    # special tokens left out (as calibrate_rpe does): row i then has i keys, and uniform is still flat
    keep[0, 0] = keep[0, -1] = False
    uniform = (torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]).expand(1, heads, n, n)
    bias = bucket_attention_bias([uniform], keep, keep, num_buckets=16, max_distance=32, causal=True)
    assert (bias[0].amax(-1) - bias[0].amin(-1) <= 0.05).all(), bias[0]


# ---------------------------------------------------------------------------------------------
# Refusals and CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [GPT2Config(n_layer=1, n_embd=16, n_head=2), T5Config(num_layers=1, d_model=16)])
def test_unsupported_architecture_refused(config, tmp_path):
    config.save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match=rf"model_type '{config.model_type}'.*bert, roberta"):
        convert_to_nprf(str(tmp_path / "src"))
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_bad_arguments_refused(tmp_path):
    model = BertForSequenceClassification(_tiny_bert_config())
    with pytest.raises(ValueError, match="rpe_init='learned'.*zeros, calibrated"):
        convert_to_nprf(model, rpe_init="learned")
    with pytest.raises(ValueError, match="calibration_text"):
        convert_to_nprf(model, rpe_init="calibrated")
    with pytest.raises(ValueError, match="Unknown config field.*num_random_featurez"):
        convert_to_nprf(model, num_random_featurez=8)
    with pytest.raises(ValueError, match="feature_map"):
        convert_to_nprf(model, feature_map="rbf")
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        convert_to_nprf(model, max_position_embeddings=32)
    with pytest.raises(ValueError, match="head='decoder'"):
        convert_to_nprf(model, head="decoder")
    with pytest.raises(ValueError, match="pretraining"):  # ELECTRA's discriminator: not a BERT head
        convert_to_nprf(model, head="pretraining")


def test_pretraining_checkpoint_keeps_mlm_head_drops_nsp():
    torch.manual_seed(0)
    source = BertForPreTraining(_tiny_bert_config()).eval()
    model, report = convert_to_nprf(source, return_report=True)
    assert type(model).__name__ == "NPRFBertForMaskedLM"
    assert sorted(report.dropped) == [
        "bert.pooler.dense.bias", "bert.pooler.dense.weight", "cls.seq_relationship.bias", "cls.seq_relationship.weight"]
    assert torch.equal(model.cls.predictions.transform.dense.weight, source.cls.predictions.transform.dense.weight)
    with pytest.raises(ValueError, match="Unsupported architecture 'BertForNextSentencePrediction'.*BertForMaskedLM"):
        convert_to_nprf(BertForNextSentencePrediction(_tiny_bert_config()))


def test_bert_decoder_converts_to_its_lm_head_model():
    """transformers names BERT's decoder class BertLMHeadModel (not ...ForCausalLM): it converts to
    NPRFBertLMHeadModel with every weight, the same head."""
    torch.manual_seed(0)
    source = BertLMHeadModel(_tiny_bert_config(is_decoder=True)).eval()
    model, report = convert_to_nprf(source, return_report=True)
    assert type(model).__name__ == "NPRFBertLMHeadModel" and model.config.is_decoder
    assert not report.dropped
    assert torch.equal(model.cls.predictions.decoder.weight, source.cls.predictions.decoder.weight)
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, source.config.vocab_size)


def test_in_memory_bert_head_and_position_embedding_none():
    torch.manual_seed(0)
    source = BertForSequenceClassification(_tiny_bert_config(num_labels=2)).eval()
    model, report = convert_to_nprf(source, position_embedding_type="none", return_report=True)
    assert type(model).__name__ == "NPRFBertForSequenceClassification"
    assert report.dropped == ["bert.embeddings.position_embeddings.weight"]
    assert torch.equal(model.classifier.weight, source.classifier.weight)
    with torch.no_grad():  # no absolute table: longer than the source's 64 positions runs
        logits = model(input_ids=torch.randint(5, 100, (2, 200))).logits
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()


def test_cli_convert_calibrated_per_layer(calibration_file, tmp_path, capsys):
    out = str(tmp_path / "cli")
    code = cli_main([
        "convert", minilm_path(), out, "--num-random-features", "16", "--feature-map", "prf",
        "--rpe-init", "calibrated", "--calibration-text", calibration_file, "--calibration-blocks", "4",
        "--rpe-shared-across-layers", "false", "--rpe-num-buckets", "16", "--rpe-max-distance", "64",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    for i in range(6):
        assert f"+ encoder.layer.{i}.attention.self.rpe_table  [12, 16]" in printed
        assert f"+ encoder.layer.{i}.attention.self.projection  [12, 16, 32]" in printed
    assert "copied bit-identically: 103 source tensors" in printed
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["feature_map"], config["rpe_shared_across_layers"], config["rpe_num_buckets"]) == ("prf", False, 16)
    tables = _read_safetensors(os.path.join(out, "model.safetensors"))
    assert tables["encoder.layer.2.attention.self.rpe_table"].abs().amax() > 0


def test_cli_console_script_help():
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "nprf-hf"), "convert", "--help"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for option in ("--max-position-embeddings", "--rpe-init", "--calibration-text", "--position-embedding-type"):
        assert option in result.stdout


def test_package_exports_convert_to_nprf():
    assert nprf_hf.convert_to_nprf is convert_to_nprf
