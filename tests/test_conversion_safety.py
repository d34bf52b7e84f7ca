"""What a new user must be able to trust: conversion never harms its source nor half-writes its output,
a conversion that needs attention transfer says so, a causal-LM conversion generates, and user mistakes
(a head the family lacks, a saved field changed at load) get a clear error at once."""

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig, BertModel, pipeline

import nprf_hf
from nprf_hf import convert as convert_module
from nprf_hf.cli import main as cli_main
from nprf_hf.convert import NEEDS_TRANSFER_MESSAGE, convert_checkpoint
from nprf_hf.modelcard import build_model_card

from conftest import tiny_config


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(os.path.dirname(sys.executable), "nprf-hf")
TEXTS = [f"sentence number {i} says something about the {word} and the weather" for i, word in
         enumerate(("cat", "dog", "river", "city", "model", "house", "tree", "road") * 6)]


@pytest.fixture
def bert_source(tmp_path, minilm_tokenizer):
    """A tiny BERT checkpoint (random weights) with the real MiniLM tokenizer, in tmp_path/src."""
    torch.manual_seed(0)
    config = BertConfig(**tiny_config(vocab_size=minilm_tokenizer.vocab_size, num_attention_heads=4))
    source = tmp_path / "src"
    BertModel(config).save_pretrained(source)
    minilm_tokenizer.save_pretrained(source)
    return str(source)


def folder_digest(path):
    """{relative path: sha256} of every file under `path`."""
    digest = {}
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            with open(full, "rb") as handle:
                digest[os.path.relpath(full, path)] = hashlib.sha256(handle.read()).hexdigest()
    return digest


def leftovers(parent):
    return sorted(name for name in os.listdir(parent) if name.startswith((".tmp-", ".old-")))


# ---------------------------------------------------------------------------------------------
# Conversion never harms its source or half-writes its output
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_convert_refuses_output_that_touches_the_source(bert_source, tmp_path, capsys, where):
    out = {"same": bert_source, "inside": os.path.join(bert_source, "nprf"), "parent": str(tmp_path)}[where]
    before = folder_digest(bert_source)
    assert cli_main(["convert", bert_source, out, "--overwrite"]) == 2
    error = capsys.readouterr().err
    assert "source" in error and "give a new folder" in error and "Traceback" not in error
    with pytest.raises(ValueError, match="source"):
        convert_checkpoint(bert_source, out, overwrite=True)
    assert folder_digest(bert_source) == before
    assert not os.path.exists(os.path.join(bert_source, "nprf"))


def test_convert_refuses_non_empty_output_unless_overwrite(bert_source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli_main(["convert", bert_source, str(out)]) == 2
    error = capsys.readouterr().err
    assert "is not empty" in error and "--overwrite" in error
    with pytest.raises(ValueError, match="not empty.*overwrite=True"):
        convert_checkpoint(bert_source, str(out))
    assert os.listdir(out) == ["notes.txt"]

    assert cli_main(["convert", bert_source, str(out), "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert type(nprf_hf.NPRFBertModel.from_pretrained(str(out))).__name__ == "NPRFBertModel"
    assert leftovers(tmp_path) == []
    # an empty output folder, e.g. made by the user beforehand, is fine without --overwrite
    (tmp_path / "empty").mkdir()
    assert cli_main(["convert", bert_source, str(tmp_path / "empty")]) == 0


@pytest.mark.parametrize("existing", [False, True])
def test_failed_conversion_leaves_output_as_it_was(bert_source, tmp_path, monkeypatch, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    def fail_midway(src, out_dir, *args):
        assert os.path.isfile(os.path.join(out_dir, "model.safetensors"))  # the save was under way
        raise OSError("disk full")

    monkeypatch.setattr(convert_module, "_save_extra_files", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(bert_source, str(out), overwrite=True)
    assert os.listdir(out) == ["notes.txt"] if existing else not out.exists()
    assert leftovers(tmp_path) == []


KILLED_CONVERSION = """
import sys, time
import nprf_hf.convert as convert

def stall(src, out_dir, *args):  # the weights are written; wait to be killed before the rest
    open(sys.argv[3], "w").write(out_dir)
    time.sleep(120)

convert._save_extra_files = stall
convert.convert_checkpoint(sys.argv[1], sys.argv[2], overwrite=True)
"""


@pytest.mark.parametrize("existing", [False, True])
def test_conversion_killed_midway_leaves_no_partial_output(bert_source, tmp_path, existing):
    out, marker = tmp_path / "out", tmp_path / "marker"
    if existing:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    source_before = folder_digest(bert_source)
    script = tmp_path / "convert_and_stall.py"
    script.write_text(KILLED_CONVERSION)
    process = subprocess.Popen([sys.executable, str(script), bert_source, str(out), str(marker)], cwd=ROOT)
    try:
        deadline = time.time() + 120
        while not marker.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the conversion never reached the save"
        staging = marker.read_text()
        assert os.path.isfile(os.path.join(staging, "model.safetensors"))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert os.listdir(out) == ["notes.txt"] if existing else not out.exists()
    assert folder_digest(bert_source) == source_before
    # what a killed process cannot clean up is one hidden sibling, never a half-written OUT
    assert leftovers(tmp_path) == [os.path.basename(staging)]


# ---------------------------------------------------------------------------------------------
# No silent degradation
# ---------------------------------------------------------------------------------------------


def test_conversion_without_transfer_says_what_it_costs(bert_source, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="nprf_hf.convert"):
        convert_checkpoint(bert_source, str(tmp_path / "plain"))
    assert NEEDS_TRANSFER_MESSAGE in caplog.text and "--attention-transfer-text" in NEEDS_TRANSFER_MESSAGE
    assert not (tmp_path / "plain" / "attention_transfer.json").exists()
    card = build_model_card(str(tmp_path / "plain")).content
    assert "No attention transfer or other training ran after conversion" in card

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nprf_hf.convert"):
        report = convert_checkpoint(
            bert_source, str(tmp_path / "transferred"), transfer_texts=TEXTS,
            transfer_options={"steps": 30, "batch_size": 2, "max_length": 32, "learning_rate": 1e-2}, num_random_features=16,
        )
    assert NEEDS_TRANSFER_MESSAGE not in caplog.text
    saved = json.load(open(tmp_path / "transferred" / "attention_transfer.json"))
    assert saved == json.loads(json.dumps(report.transfer.to_dict()))
    # 48 texts >= 5 x 4 evaluation batches of 2: the last 8 are held out of training
    assert saved["eval_held_out"] and saved["num_eval_texts"] == 8 and saved["num_texts"] == len(TEXTS) - 8
    assert saved["cosine_after"] > saved["cosine_before"]
    card = build_model_card(str(tmp_path / "transferred")).content
    assert "Attention transfer: 30 steps" in card and "--attention-transfer-steps 30" in card
    assert f"{saved['cosine_after']:.3f}" in card


def test_transfer_cosine_is_measured_on_the_evaluation_texts(minilm_tokenizer):
    """The reported cosine is the mean over evaluation texts of cos(student, source) of mean-pooled last hidden
    states: recomputed here independently, for a transfer of 0 steps on given eval texts."""
    torch.manual_seed(0)
    teacher = BertModel(BertConfig(**tiny_config(vocab_size=minilm_tokenizer.vocab_size, num_attention_heads=4))).eval()
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=minilm_tokenizer, num_random_features=16)
    eval_texts = TEXTS[:5]  # 5 texts in batches of 2: a padded last batch of 1
    report = nprf_hf.attention_transfer(student, teacher, minilm_tokenizer, TEXTS, steps=0, batch_size=2, max_length=32,
                                        eval_texts=eval_texts, show_progress=False)
    expected = []
    for text in eval_texts:
        batch = minilm_tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            a = teacher(**batch).last_hidden_state.mean(1)
            b = student(**batch).last_hidden_state.mean(1)
        expected.append(torch.nn.functional.cosine_similarity(a, b).item())
    assert report.cosine_before == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert report.cosine_after == pytest.approx(report.cosine_before, abs=1e-6)
    assert not report.eval_held_out and report.num_eval_texts == 5


# ---------------------------------------------------------------------------------------------
# Generation the obvious way; heads a family lacks
# ---------------------------------------------------------------------------------------------


def test_causal_lm_conversion_saves_a_decoder_that_generates(roberta_source, tmp_path):
    out = str(tmp_path / "decoder")
    assert cli_main(["convert", roberta_source, out, "--head", "causal-lm", "--num-random-features", "8"]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["is_decoder"] is True and config["architectures"] == ["NPRFRobertaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("The game", return_tensors="pt")
    tokens = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokens.shape == (1, prompt["input_ids"].shape[1] + 6)
    # the decoder is causal: a token's output does not depend on later tokens
    ids = tokens[:, :-1]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        prefix = model(input_ids=ids[:, :4]).logits
    torch.testing.assert_close(full[:, :4], prefix, atol=1e-5, rtol=1e-5)
    generator = pipeline("text-generation", model=out, trust_remote_code=True)
    text = generator("The game", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("The game") and len(text) > len("The game")


def test_causal_lm_from_an_encoder_refuses_transfer(roberta_source, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n".join(TEXTS))
    with pytest.raises(ValueError, match="attends in both directions.*language model"):
        convert_checkpoint(roberta_source, str(tmp_path / "out"), head="causal-lm", transfer_texts=TEXTS)
    assert not (tmp_path / "out").exists()


def test_argument_mistakes_are_reported_before_torch_loads(bert_source, tmp_path):
    """A head BERT lacks, a non-empty OUT, and --version: answered by the CLI without importing torch."""
    probe = textwrap.dedent(f"""
        import sys
        from nprf_hf.cli import main
        for argv in (["convert", {bert_source!r}, {str(tmp_path / 'x')!r}, "--head", "pretraining"],
                     ["convert", {bert_source!r}, {bert_source!r}]):
            assert main(argv) == 2
        print("torch loaded:", "torch" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "torch loaded: False" in result.stdout
    assert "--head pretraining does not exist for BERT; allowed: model, masked-lm" in result.stderr
    assert "is the source" in result.stderr
    version = subprocess.run([CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"nprf-hf {nprf_hf.__version__}"


# ---------------------------------------------------------------------------------------------
# Loading: saved fields, attn_implementation
# ---------------------------------------------------------------------------------------------


def test_load_names_fields_saved_with_the_weights(bert_source, tmp_path, caplog):
    from transformers import AutoModel

    out = str(tmp_path / "out")
    convert_checkpoint(bert_source, out, num_random_features=16)
    AutoModel.from_pretrained(out, num_random_features=16)  # the saved value: fine
    reloaded = AutoModel.from_pretrained(out, attention_algorithm="fft")  # an execution choice: free
    assert reloaded.config.attention_algorithm == "fft"
    with pytest.raises(ValueError, match=r"num_random_features=32 \(saved: 16\).*cannot change at load.*"
                       r"convert SRC OUT --num-random-features 32`"):
        AutoModel.from_pretrained(out, num_random_features=32)
    with pytest.raises(ValueError, match=r"rpe_num_buckets=8 \(saved: 32\).*--rpe-num-buckets 8`"):
        nprf_hf.NPRFBertModel.from_pretrained(out, rpe_num_buckets=8)
    config = nprf_hf.NPRFBertConfig.from_pretrained(out)
    config.feature_map = "prf"
    with pytest.raises(ValueError, match=r"feature_map='prf' \(saved: 'orf'\)"):
        AutoModel.from_pretrained(out, config=config)
    for load in (AutoModel.from_pretrained, nprf_hf.NPRFBertModel.from_pretrained):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            load(out, attn_implementation="sdpa")
        assert "self-attention of NPRF models is always NPRF attention" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        AutoModel.from_pretrained(out)
    assert "always NPRF attention" not in caplog.text


# ---------------------------------------------------------------------------------------------
# Command-line mistakes: no abbreviations, the subcommand's own usage
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, command, unrecognized, suggestion", [
    (["convert", "{src}", "{out}", "--num-random-feature", "16"], "convert", "--num-random-feature 16",
     "--num-random-features"),
    (["convert", "{src}", "{out}", "--overwrit"], "convert", "--overwrit", "--overwrite"),
    (["convert", "{src}", "{out}", "--max-position-embedding=1024"], "convert", "--max-position-embedding=1024",
     "--max-position-embeddings"),
    (["card", "{src}", "--eval-result", "r.json"], "card", "--eval-result r.json", "--eval-results"),
])
def test_flag_typos_show_the_subcommands_usage(bert_source, tmp_path, capsys, argv, command, unrecognized,
                                               suggestion):
    """A prefix of an option is a typo, not an abbreviation (argparse's allow_abbrev), and the error is the
    subcommand's, with its usage, not the top-level `nprf-hf COMMAND` usage."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit:
        cli_main([a.format(src=bert_source, out=out) for a in argv])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: nprf-hf {command} ") and "Traceback" not in err
    assert f"nprf-hf {command}: error: unrecognized arguments: {unrecognized}" in err
    assert f"did you mean {suggestion}?" in err
    assert not out.exists()


def test_no_parser_takes_abbreviations(capsys):
    from nprf_hf import cli

    parser = cli.build_parser()
    parsers = [parser, *next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction)).choices.values()]
    assert [p.allow_abbrev for p in parsers] == [False] * len(parsers)
    with pytest.raises(SystemExit) as exit:
        cli_main(["--vers"])
    assert exit.value.code == 2 and capsys.readouterr().out == ""  # not taken for --version


# ---------------------------------------------------------------------------------------------
# Ctrl-C: one line, exit 130, and what it says is what happened
# ---------------------------------------------------------------------------------------------


INTERRUPTED_CONVERSION = """
import signal, sys, time
# Ctrl-C raises KeyboardInterrupt as in a terminal, also when the suite runs as a background job (which starts with
# SIGINT ignored, and passes that on to this child)
signal.signal(signal.SIGINT, signal.default_int_handler)
import nprf_hf.convert as convert
from nprf_hf.cli import main

def stall(src, out_dir, *args):  # the weights are written; wait for Ctrl-C before the rest
    open(sys.argv[3], "w").write(out_dir)
    time.sleep(120)

convert._save_extra_files = stall
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--overwrite"]))
"""


@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_during_convert_ends_in_one_line(bert_source, tmp_path, existing):
    out, marker = tmp_path / "out", tmp_path / "marker"
    if existing:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    script = tmp_path / "convert_until_ctrl_c.py"
    script.write_text(INTERRUPTED_CONVERSION)
    process = subprocess.Popen([sys.executable, str(script), bert_source, str(out), str(marker)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not marker.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the conversion never reached the save"
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    expected = f"{out} was left as it was" if existing else f"{out} was not written"
    assert err.strip().splitlines()[-1] == f"nprf-hf convert: interrupted; {expected}", err
    assert os.listdir(out) == ["notes.txt"] if existing else not out.exists()
    assert leftovers(tmp_path) == []


def test_ctrl_c_after_the_output_is_in_place_says_so(bert_source, tmp_path, monkeypatch, capsys):
    warn = convert_module.logger.warning

    def interrupt_at_the_last_warning(message, *args):
        if message == NEEDS_TRANSFER_MESSAGE:  # logged once the output folder is in place
            raise KeyboardInterrupt
        warn(message, *args)

    monkeypatch.setattr(convert_module.logger, "warning", interrupt_at_the_last_warning)
    out = tmp_path / "out"
    assert cli_main(["convert", bert_source, str(out)]) == 130
    err = capsys.readouterr().err
    assert err.endswith(f"\nnprf-hf convert: interrupted after {out} was written\n") and "Traceback" not in err
    assert (out / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# --overwrite says what it removes; the output is the user's to share
# ---------------------------------------------------------------------------------------------


def test_overwrite_lists_what_it_will_remove_before_removing_it(bert_source, tmp_path, caplog):
    out = tmp_path / "out"
    (out / "old").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "old" / "weights.bin").write_text("")
    seen = []

    class StillThere(logging.Handler):
        def emit(self, record):
            if "notes.txt" in record.getMessage():
                seen.append((record.getMessage(), (out / "notes.txt").exists()))

    handler = StillThere()
    logging.getLogger("nprf_hf.convert").addHandler(handler)
    try:
        assert cli_main(["convert", bert_source, str(out), "--overwrite"]) == 0
    finally:
        logging.getLogger("nprf_hf.convert").removeHandler(handler)
    assert len(seen) == 1 and seen[0][1], seen  # said once, while the files were still there
    assert f"replacing {out}: its 2 entries (notes.txt, old/) will be removed" in seen[0][0]
    assert not (out / "notes.txt").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nprf_hf.convert"):  # a new or empty folder: nothing to say
        convert_checkpoint(bert_source, str(tmp_path / "new"), overwrite=True)
    assert "will be removed" not in caplog.text


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_keeps_the_users_umask(bert_source, tmp_path, umask):
    """The staging folder comes from mkdtemp (0700) and safetensors writes its file 0600: the output must have the
    modes every other file of the user gets, or other users (a shared model folder, a web server) cannot read it."""
    previous = os.umask(umask)
    try:
        out = tmp_path / "out"
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        assert cli_main(["convert", bert_source, str(out), "--overwrite"]) == 0
    finally:
        os.umask(previous)
    modes = {os.path.relpath(os.path.join(folder, name), out): os.stat(os.path.join(folder, name)).st_mode & 0o777
             for folder, folders, files in os.walk(out) for name in folders + files}
    assert "model.safetensors" in modes
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask
    assert {name: mode for name, mode in modes.items() if mode != 0o666 & ~umask} == {}


# ---------------------------------------------------------------------------------------------
# Messages true to the model at hand
# ---------------------------------------------------------------------------------------------


def test_help_says_it_converts_decoders_too():
    from nprf_hf import cli

    description = cli.build_parser().description
    assert "encoders" not in description.replace("encoders and decoders", "")
    assert "decoders" in description and "BERT" in description


def test_untrained_model_warning_quotes_no_other_models_numbers(bert_source, roberta_source, tmp_path, caplog):
    """The bare-conversion warning quoted MiniLM's sentence-embedding cosines for any model and head, and told a
    RoBERTa made a decoder to run attention transfer, which refuses that case."""
    with caplog.at_level(logging.WARNING, logger="nprf_hf.convert"):
        assert cli_main(["convert", bert_source, str(tmp_path / "bert"), "--num-random-features", "8"]) == 0
    said = caplog.text
    assert "--attention-transfer-text" in said
    assert "MiniLM" not in said and "0.49" not in said and "0.92" not in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nprf_hf.convert"):
        assert cli_main(["convert", roberta_source, str(tmp_path / "lm"), "--head", "causal-lm",
                         "--num-random-features", "8"]) == 0
    said = caplog.text
    assert "MiniLM" not in said and "0.49" not in said and "sentence embeddings" not in said
    assert "--attention-transfer-text" not in said and NEEDS_TRANSFER_MESSAGE not in said
    assert "decoder" in said and "language model" in said
