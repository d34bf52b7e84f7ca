"""What a HuggingFace user touches first (issue 13): one call that saves model + tokenizer (pipelines work),
tokenizer loading without prompts or warnings, loud warnings for untrained heads, sentence-transformers
round trips, and clear errors for missing paths."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

import nprf_hf
from nprf_hf import NPRFBertModel, convert_checkpoint
from nprf_hf.checkpoint_files import check_local_path, looks_like_path, read_conversion_report
from nprf_hf.cli import main as cli_main
from nprf_hf.convert import NEEDS_TRANSFER_MESSAGE
from nprf_hf.modelcard import build_model_card

from conftest import minilm_path, tiny_config


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_sentence_transformers = pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None, reason="sentence-transformers not installed"
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """MiniLM (a sentence-transformers model) converted with a 1024-row position table, through the one call."""
    out = str(tmp_path_factory.mktemp("minilm_nprf_1024"))
    report = convert_checkpoint(minilm_path(), out, num_random_features=16, max_position_embeddings=1024)
    return out, report


def _run_clean(script, tmp_path, with_package):
    """Run `script` in a fresh interpreter with stdin closed and the Hub offline; without the package, nprf_hf
    cannot be imported (only the checkpoint's remote code can run)."""
    prelude = "" if with_package else textwrap.dedent(
        f"""
        import os, sys
        sys.modules["nprf_hf"] = None
        sys.path = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != {REPO_ROOT!r}]
        """
    )
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"),
        PYTHONPATH=REPO_ROOT if with_package else "",
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True, text=True, env=env,
        cwd=str(tmp_path), stdin=subprocess.DEVNULL, timeout=300,
    )


# ---- 1. one call saves model + tokenizer; pipelines work ----------------------------------------------


def test_convert_checkpoint_is_the_exported_one_call(converted):
    out, _ = converted
    assert nprf_hf.convert_checkpoint is convert_checkpoint
    for name in ("model.safetensors", "config.json", "modeling_nprf.py", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, name)), name


def test_pipeline_feature_extraction_in_clean_process(converted, tmp_path):
    out, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["Pipelines load the converted model."], return_tensors="pt")
    with torch.no_grad():
        expected = NPRFBertModel.from_pretrained(out)(**batch).last_hidden_state[0]
    torch.save(expected, tmp_path / "expected.pt")
    result = _run_clean(
        f"""
        import torch
        from transformers import pipeline
        extract = pipeline("feature-extraction", model={out!r}, trust_remote_code=True)
        got = torch.tensor(extract("Pipelines load the converted model.")[0])
        expected = torch.load({str(tmp_path / 'expected.pt')!r})
        assert got.shape == expected.shape, (got.shape, expected.shape)
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
        print("PIPELINE_OK", type(extract.model).__name__)
        """,
        tmp_path, with_package=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PIPELINE_OK NPRFBertModel" in result.stdout


# ---- 2. the tokenizer loads without prompts or warnings -------------------------------------------------

TOKENIZER_SCRIPT = """
from transformers import AutoTokenizer, BertTokenizer
tokenizer = {load}
ids = tokenizer("Tokenizers need no model code.")["input_ids"]
print("TOKENIZER_OK", type(tokenizer).__name__, ids)
"""


@pytest.mark.parametrize(
    "with_package, load",
    [
        (True, "__import__('nprf_hf') and AutoTokenizer.from_pretrained({out!r})"),
        (False, "AutoTokenizer.from_pretrained({out!r}, trust_remote_code=True)"),
        (False, "BertTokenizer.from_pretrained({out!r})"),
    ],
    ids=["package-imported", "trust-remote-code", "tokenizer-class"],
)
def test_tokenizer_loads_without_prompt_or_warning(converted, tmp_path, with_package, load):
    out, _ = converted
    expected = AutoTokenizer.from_pretrained(minilm_path())("Tokenizers need no model code.")["input_ids"]
    result = _run_clean(TOKENIZER_SCRIPT.format(load=load.format(out=out)), tmp_path, with_package)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"TOKENIZER_OK BertTokenizer {expected}" in result.stdout
    for noise in ("custom code", "[y/N]", "model of type", "Warning", "warning"):
        assert noise not in result.stderr + result.stdout, result.stderr


FALSE_WARNINGS = ("is to be used with Auto classes", "It has no effect here and is ignored")


@needs_sentence_transformers
def test_loads_as_the_readme_shows_give_no_false_warning(converted, roberta_source, tmp_path):
    """pipeline / SentenceTransformer with trust_remote_code=True go through the package's from_pretrained, which
    must not hand trust_remote_code on to where transformers calls it useless."""
    import warnings

    from sentence_transformers import SentenceTransformer
    from transformers import AutoModelForCausalLM, pipeline
    from transformers.utils import logging as hf_logging

    out, _ = converted
    decoder = str(tmp_path / "decoder")
    convert_checkpoint(roberta_source, decoder, head="causal-lm", num_random_features=8)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipeline("feature-extraction", model=out, trust_remote_code=True)
            SentenceTransformer(out, trust_remote_code=True, device="cpu")
            AutoModelForCausalLM.from_pretrained(decoder)
            AutoModelForCausalLM.from_pretrained(decoder, trust_remote_code=True)
            pipeline("text-generation", model=decoder, trust_remote_code=True)
            NPRFBertModel.from_pretrained(out)
    finally:
        hf_logger.removeHandler(handler)
    said = [record.getMessage() for record in records] + [str(warning.message) for warning in caught]
    assert not [message for message in said if any(text in message for text in FALSE_WARNINGS)], said


def test_tokenizer_config_names_the_plain_tokenizer(converted):
    out, _ = converted
    tokenizer_config = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert tokenizer_config["tokenizer_class"] in ("BertTokenizer", "BertTokenizerFast")
    assert "AutoTokenizer" not in tokenizer_config.get("auto_map", {})  # nothing custom to run for the tokenizer
    assert AutoTokenizer.from_pretrained(out).model_max_length == 1024


# ---- 3. a head the source lacks is reported, tied weights are not ----------------------------------------


def test_untrained_head_warns_and_lands_in_report_and_card(tmp_path, caplog):
    out = str(tmp_path / "mlm")
    with caplog.at_level(logging.WARNING, logger="nprf_hf.convert"):
        report = convert_checkpoint(minilm_path(), out, head="masked-lm", num_random_features=16)
    head = sorted(report.untrained_head)
    assert head and all(name.startswith("cls.predictions.") for name in head)
    assert "cls.predictions.decoder.weight" not in report.new and "cls.predictions.decoder.weight" not in head
    assert report.tied["cls.predictions.decoder.weight"] == "bert.embeddings.word_embeddings.weight"
    assert not any("projection" in name or "rpe" in name for name in head)  # NPRF's own tensors are not "head"
    assert any("randomly initialised" in r.getMessage() and "NPRFBertForMaskedLM" in r.getMessage() for r in caplog.records)
    assert "WARNING:" in report.format()
    saved = read_conversion_report(out)
    assert sorted(saved["untrained_head"]) == head
    card = str(build_model_card(out))
    assert "Untrained head" in card and "cls.predictions.transform.dense.weight" in card


def test_source_with_the_head_reports_no_untrained_head(tmp_path, caplog):
    config = BertConfig(**tiny_config(vocab_size=100, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    src = str(tmp_path / "src")
    BertForMaskedLM(config).save_pretrained(src)
    with caplog.at_level(logging.WARNING, logger="nprf_hf.convert"):
        report = convert_checkpoint(src, str(tmp_path / "out"), num_random_features=8)
    assert report.untrained_head == []
    warnings = [r.getMessage() for r in caplog.records if r.name == "nprf_hf.convert" and r.levelno >= logging.WARNING]
    assert warnings == [NEEDS_TRANSFER_MESSAGE]  # no untrained-head warning; only the one about the transfer
    assert "cls.predictions.decoder.weight" not in report.new
    assert "Untrained head" not in str(build_model_card(str(tmp_path / "out")))


def test_cli_prints_the_untrained_head_warning(tmp_path, capsys):
    assert cli_main(["convert", minilm_path(), str(tmp_path / "o"), "--head", "masked-lm", "--num-random-features", "8"]) == 0
    assert "WARNING:" in capsys.readouterr().out


# ---- 4. sentence-transformers ---------------------------------------------------------------------------


def test_sentence_transformers_files_carried_and_max_seq_length_extended(converted):
    out, report = converted
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert "1_Pooling/" in report.sentence_transformers_files
    source_settings = json.load(open(os.path.join(minilm_path(), "sentence_bert_config.json")))
    settings = json.load(open(os.path.join(out, "sentence_bert_config.json")))
    assert settings["max_seq_length"] == 1024 != source_settings["max_seq_length"]
    assert settings["do_lower_case"] == source_settings["do_lower_case"]


@needs_sentence_transformers
def test_bare_conversion_keeps_long_inputs_long(tmp_path, capsys):
    """MiniLM's sentence-transformers config says max_seq_length 256, for the source's training length: the
    converted model must take its whole position table (512), and the summary must say so and how to go further."""
    from sentence_transformers import SentenceTransformer

    out = str(tmp_path / "minilm-nprf")
    assert cli_main(["convert", minilm_path(), out, "--num-random-features", "8"]) == 0
    summary = capsys.readouterr().out
    assert json.load(open(os.path.join(out, "sentence_bert_config.json")))["max_seq_length"] == 512
    assert "inputs up to 512 tokens" in summary and "--max-position-embeddings" in summary
    assert "max_seq_length 256 -> 512" in summary  # the source's own limit is not silently replaced either
    assert read_conversion_report(out)["max_input_length"] == 512
    model = SentenceTransformer(out, trust_remote_code=True, device="cpu")
    assert model.max_seq_length == 512
    assert model.tokenize([" ".join(["word"] * 2000)])["input_ids"].shape[1] == 512

    longer = str(tmp_path / "minilm-nprf-2k")
    assert cli_main(["convert", minilm_path(), longer, "--num-random-features", "8",
                     "--max-position-embeddings", "2048"]) == 0
    summary = capsys.readouterr().out
    assert "inputs up to 2048 tokens" in summary and "max_seq_length 256 -> 2048" in summary
    assert SentenceTransformer(longer, trust_remote_code=True, device="cpu").max_seq_length == 2048


def test_summary_names_the_usable_positions_of_an_offset_family(roberta_source, tmp_path, capsys):
    """RoBERTa's first padding_idx + 1 rows are no positions: 66 rows take 64 tokens."""
    assert cli_main(["convert", roberta_source, str(tmp_path / "o"), "--num-random-features", "8"]) == 0
    assert "inputs up to 64 tokens" in capsys.readouterr().out
    assert cli_main(["convert", roberta_source, str(tmp_path / "p"), "--num-random-features", "8",
                     "--max-position-embeddings", "130"]) == 0
    assert "inputs up to 128 tokens" in capsys.readouterr().out


def test_plain_checkpoint_carries_no_sentence_transformers_files(tmp_path):
    config = BertConfig(**tiny_config(vocab_size=100, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=512))
    src = str(tmp_path / "src")
    BertForMaskedLM(config).save_pretrained(src)
    report = convert_checkpoint(src, str(tmp_path / "out"), num_random_features=8)
    assert report.sentence_transformers_files == [] and not os.path.exists(tmp_path / "out" / "modules.json")


@needs_sentence_transformers
def test_sentence_transformer_round_trip_long_document(converted):
    from sentence_transformers import SentenceTransformer

    out, _ = converted
    model = SentenceTransformer(out, trust_remote_code=True, device="cpu")
    assert model.max_seq_length == 1024
    tokenizer = AutoTokenizer.from_pretrained(out)
    words = ("kernelized attention reads long documents " * 200).split()
    document = " ".join(words[:700])
    length = len(tokenizer(document)["input_ids"])
    assert 600 < length <= 1024  # longer than the source's 512 positions, within the extended table
    short = " ".join(words[:100])
    embeddings = model.encode([document, short], convert_to_tensor=True)
    assert embeddings.shape == (2, 384)
    assert torch.allclose(embeddings.norm(dim=-1), torch.ones(2), atol=1e-5)  # the Normalize module ran
    # the same numbers as mean pooling the converted model by hand, over the whole (untruncated) document
    nprf = NPRFBertModel.from_pretrained(out).eval()
    batch = tokenizer([document], return_tensors="pt")
    with torch.no_grad():
        hidden = nprf(**batch).last_hidden_state[0]
    pooled = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
    assert torch.allclose(embeddings[0], pooled, atol=1e-4), (embeddings[0] - pooled).abs().max()


# ---- 8. a missing local path is named at once -------------------------------------------------------------


@pytest.mark.parametrize("value, is_path", [
    ("./missing", True), ("/abs/missing", True), ("~/missing", True), ("a/b/c", True),
    ("roberta-base", False), ("sentence-transformers/all-MiniLM-L6-v2", False),
])
def test_looks_like_path(value, is_path):
    assert looks_like_path(value) is is_path


def test_missing_local_path_is_reported_at_once(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        check_local_path(missing)
    check_local_path(str(tmp_path))  # existing paths pass
    check_local_path("org/name")  # Hub ids pass
    assert cli_main(["convert", missing, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"no such directory: {missing}" in err and "Repo id" not in err and len(err.strip().splitlines()) == 1


def test_mistyped_local_folder_offline_is_named_at_once(tmp_path):
    """`src_minlm` (a typo of a local folder) has a Hub id's form: offline, the CLI says at once that it is neither,
    before loading torch, instead of transformers' "We couldn't connect to 'https://huggingface.co'"."""
    probe = textwrap.dedent(f"""
        import sys
        from nprf_hf.cli import main
        code = main(["convert", "src_minlm", {str(tmp_path / 'out')!r}])
        print("exit", code, "torch loaded:", "torch" in sys.modules)
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                            stdin=subprocess.DEVNULL, timeout=120)
    assert "exit 2 torch loaded: False" in result.stdout, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "nprf-hf convert: error: no local folder 'src_minlm' (and not found on the Hub: offline, and not in the Hub "
        "cache)"
    ]
    assert not (tmp_path / "out").exists()


def test_source_neither_local_nor_on_the_hub(tmp_path, monkeypatch, capsys):
    """Online, a Hub id is asked for once (no retries): a missing repository, an unreachable Hub and a file given
    for a folder are one-line errors; an id found in the Hub cache, or on the Hub, passes."""
    import huggingface_hub
    from huggingface_hub import constants

    from nprf_hf.checkpoint_files import check_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    asked = []

    def answer(self, repo_id, **kwargs):
        asked.append(repo_id)
        if repo_id == "down/model":
            raise ConnectionError("Name or service not known")
        return repo_id == "org/model"

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_exists", answer)
    check_source("org/model")
    for value, reason in [("src_minlm", "not found on the Hub: no such model repository (or it is private)"),
                          ("down/model", "not found on the Hub: it could not be reached (Name or service not known)")]:
        assert cli_main(["convert", value, str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err == f"nprf-hf convert: error: no local folder '{value}' (and {reason})\n"
    assert asked == ["org/model", "src_minlm", "down/model"]
    (tmp_path / "weights.bin").write_text("")
    assert cli_main(["convert", "weights.bin", str(tmp_path / "out")]) == 2
    assert "weights.bin is a file: give the checkpoint's folder" in capsys.readouterr().err
    snapshot = tmp_path / "hub" / "models--cached--model" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--cached--model" / "refs").mkdir()
    (tmp_path / "hub" / "models--cached--model" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check_source("cached/model")  # offline, but in the cache: transformers will load it from there
    with pytest.raises(FileNotFoundError, match="offline"):
        check_source("cached/model", revision="v2")
    assert asked == ["org/model", "src_minlm", "down/model"]


# ---- 9. the GLUE scripts report user errors in one line, exit 2 -------------------------------------------


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("run_glue.py", ["--task_name", "sst-3"], "task_name='sst-3' is not a GLUE task; allowed values: cola"),
        ("run_glue.py", ["--task_name", "sst2", "--glue_dir", "{tmp}/no-glue"], "no such directory: glue_dir="),
        ("run_glue_no_trainer.py", ["--model_name_or_path", "./no-model", "--task_name", "sst2"],
         "no such directory: ./no-model"),
    ],
)
def test_glue_scripts_report_user_errors_in_one_line(tmp_path, script, args, message):
    args = [a.format(tmp=tmp_path) for a in args]
    if "--model_name_or_path" not in args:
        args = ["--model_name_or_path", minilm_path(), *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", script), *args, "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), stdin=subprocess.DEVNULL, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [f"{script}: error: " + errors[0].split("error: ", 1)[1]] and message in errors[0], result.stderr


@needs_sentence_transformers
def test_sentence_embedding_benchmark_small(tmp_path):
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    try:
        import sentence_embedding
    finally:
        sys.path.pop(0)
    results = sentence_embedding.main(
        ["--length", "600", "--docs", "1", "--num-random-features", "8", "--threads", "1", "--output", str(tmp_path / "r")]
    )
    saved = json.load(open(tmp_path / "r.json"))
    assert saved["length"] == 600 and set(saved["variants"]) == {"nprf", "softmax"}
    assert all(v["seconds_per_doc"] > 0 for v in saved["variants"].values())
    assert saved["softmax_over_nprf"] == pytest.approx(
        results["variants"]["softmax"]["seconds_per_doc"] / results["variants"]["nprf"]["seconds_per_doc"]
    )


# ---- 6. every option has help, and shows its default --------------------------------------------------------


def _parser_of(main, monkeypatch):
    """The ArgumentParser that `main` builds (its parse_args is stopped before anything runs)."""
    import argparse

    class Built(Exception):
        pass

    def stop(self, *args, **kwargs):
        raise Built(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(Built) as built:
        main([])
    return built.value.args[0]


def _undocumented(parser, skip=()):
    import argparse

    problems = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        if action.dest in skip:
            continue
        if not action.help:
            problems.append(f"{action.option_strings[0]}: no help")
        elif action.default not in (None, False) and "default" not in parser._get_formatter()._get_help_string(action):
            problems.append(f"{action.option_strings[0]}: default {action.default!r} not shown")
    return problems


@pytest.mark.parametrize("script", ["attention", "long_sequence", "sentence_embedding"])
def test_benchmark_options_have_help_and_defaults(script, monkeypatch):
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    try:
        module = __import__(script)
    finally:
        sys.path.pop(0)
    main = module.parse_args if hasattr(module, "parse_args") else module.main
    parser = _parser_of(main, monkeypatch)
    assert _undocumented(parser) == []
    assert "runs" in parser.get_default("output").split(os.sep)  # scratch by default, --output publishes


def test_cli_convert_options_have_help_and_defaults(monkeypatch):
    from nprf_hf import cli

    parser = cli.build_parser()
    convert = next(a for a in parser._actions if hasattr(a, "choices") and a.choices and "convert" in a.choices)
    subparser = convert.choices["convert"]
    assert _undocumented(subparser) == []
    # the NPRF config-field options take help and default from the one declaration of the fields
    from nprf_hf.configuration_nprf import NPRF_FIELDS

    helps = {a.dest: a.help for a in subparser._actions}
    for field in NPRF_FIELDS:
        if field.convert_option:
            assert helps[field.name] == f"{field.help} (default: {field.default})", field.name


def test_sentence_transformers_files_from_a_hub_id(tmp_path, monkeypatch):
    """A Hub id source: modules.json is fetched first, then only the files and module folders it names."""
    import huggingface_hub

    from nprf_hf.checkpoint_files import carry_sentence_transformers_files

    asked = {}

    def fake_download(repo_id, filename, revision=None, **kwargs):
        asked["file"] = (repo_id, filename, revision)
        return os.path.join(minilm_path(), filename)

    def fake_snapshot(repo_id, revision=None, allow_patterns=None, **kwargs):
        asked["patterns"] = sorted(allow_patterns)
        return minilm_path()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    copied = carry_sentence_transformers_files("org/some-model", str(tmp_path), max_seq_length=300, revision="v1")
    assert asked["file"] == ("org/some-model", "modules.json", "v1")
    assert "1_Pooling/*" in asked["patterns"] and "2_Normalize/*" in asked["patterns"] and "model.safetensors" not in asked["patterns"]
    assert "1_Pooling/" in copied and json.load(open(tmp_path / "sentence_bert_config.json"))["max_seq_length"] == 300


@needs_sentence_transformers
@pytest.mark.skipif(not os.environ.get("NPRF_RUN_SLOW"), reason="an 8,192-token document: ~15-30 s on 2 CPU cores; set NPRF_RUN_SLOW=1")
def test_sentence_transformer_encodes_an_8k_token_document(tmp_path):
    from sentence_transformers import SentenceTransformer

    out = str(tmp_path / "minilm-8k")
    convert_checkpoint(minilm_path(), out, max_position_embeddings=8192)
    model = SentenceTransformer(out, trust_remote_code=True, device="cpu")
    assert model.max_seq_length == 8192
    document = " ".join(["long documents are what kernelized attention is for"] * 1200)
    features = model.tokenize([document])
    assert features["input_ids"].shape[1] == 8192  # truncated to the extended length, not to the source's 512
    embedding = model.encode([document], convert_to_tensor=True)
    assert embedding.shape == (1, 384) and torch.isfinite(embedding).all()
