"""Attention transfer (nprf_hf.transfer) on tiny models: it lowers the layer-wise loss, trains only the
attention's own parameters, ignores padded positions, is seeded, and runs from the CLI and both GLUE
scripts."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertModel, RobertaConfig, RobertaForCausalLM

import nprf_hf
from nprf_hf import transfer
from nprf_hf.cli import main as cli_main

from conftest import needs_shared_data, shared_data_path, tiny_config


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE = shared_data_path("glue")
TEXTS = [
    "the cat sat on the mat and looked at the dog",
    "a short one",
    "attention transfer teaches each layer to reproduce the softmax attention of its source",
    "padding must never count in the loss",
    "relative positions are all the converted model knows besides the absolute table",
    "yes",
    "the quick brown fox jumps over the lazy dog again and again until it is tired",
    "kernels with random features estimate the exponential of a dot product",
]


@pytest.fixture(scope="module")
def tokenizer(minilm_tokenizer):
    return minilm_tokenizer


def tiny_bert(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = BertConfig(**tiny_config(vocab_size=tokenizer.vocab_size, num_attention_heads=4, max_position_embeddings=128))
    return BertModel(config).eval()


def snapshot(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_transfer_lowers_loss_and_trains_only_attention(tokenizer):
    teacher = tiny_bert(tokenizer)
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16, logit_scale_max=4.0)
    teacher_before, student_before = snapshot(teacher), snapshot(student)
    report = nprf_hf.attention_transfer(
        student, teacher, tokenizer, TEXTS, steps=40, batch_size=4, learning_rate=1e-2, show_progress=False
    )
    assert len(report.loss_before) == len(report.loss_after) == 2
    assert sum(report.loss_after) < 0.8 * sum(report.loss_before), report.format()
    assert len(report.history) == 40 and all(torch.isfinite(torch.tensor(loss)) for _, loss in report.history)

    trained = set(report.trainable)
    assert trained == {
        "encoder.rpe_table",
        *(f"encoder.layer.{i}.attention.self.{p}" for i in range(2)
          for p in ("query.weight", "query.bias", "key.weight", "key.bias", "logit_scale_logit")),
    }
    after = student.state_dict()
    for name, tensor in student_before.items():
        if name in trained:
            assert not torch.equal(after[name], tensor), f"{name} did not train"
        else:
            assert torch.equal(after[name], tensor), f"{name} changed although frozen"
    for name, tensor in teacher.state_dict().items():
        assert torch.equal(tensor, teacher_before[name])
    # the student is left as it was found: every parameter trainable, eval mode
    assert all(p.requires_grad for p in student.parameters()) and not student.training
    scales = student.encoder.layer[0].attention.self.logit_scale()
    assert ((scales > 0) & (scales < 4.0)).all() and not torch.allclose(scales, torch.ones_like(scales))


def test_train_value_output_adds_value_and_output_projections(tokenizer):
    teacher = tiny_bert(tokenizer)
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16)
    report = nprf_hf.attention_transfer(
        student, teacher, tokenizer, TEXTS, steps=2, batch_size=4, train_value_output=True, show_progress=False
    )
    assert "encoder.layer.1.attention.self.value.weight" in report.trainable
    assert "encoder.layer.1.attention.output.dense.weight" in report.trainable
    assert not any("LayerNorm" in name or "intermediate" in name for name in report.trainable)


def test_projection_learning_rate_learns_the_feature_map(tokenizer, tmp_path):
    """projection_learning_rate > 0 trains each layer's projection buffer as well, and nothing beyond what it
    reports, and the saved model loads with the learned map; a student that redraws its projection in training, or
    has none, is refused."""
    teacher = tiny_bert(tokenizer)
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16, logit_scale_max=4.0)
    before = snapshot(student)
    report = nprf_hf.attention_transfer(
        student, teacher, tokenizer, TEXTS, steps=3, batch_size=4, projection_learning_rate=1e-2, show_progress=False
    )
    projections = {f"encoder.layer.{i}.attention.self.projection" for i in range(2)}
    assert projections <= set(report.trainable)
    after = student.state_dict()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor) == (name not in report.trainable), name
    assert not any(b.requires_grad for b in student.buffers())  # buffers are left as they were found
    student.save_pretrained(tmp_path)  # the learned map is what a user loads, not a fresh draw
    reloaded = type(student).from_pretrained(tmp_path)
    assert torch.equal(reloaded.encoder.layer[1].attention.self.projection, after["encoder.layer.1.attention.self.projection"])
    redrawing = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16, feature_redraw_interval=10)
    with pytest.raises(ValueError, match="feature_redraw_interval"):
        nprf_hf.attention_transfer(redrawing, teacher, tokenizer, TEXTS, projection_learning_rate=1e-2,
                                   show_progress=False)
    linear = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, attention_variant="elu_linear")
    with pytest.raises(ValueError, match="'elu_linear' has none"):
        nprf_hf.attention_transfer(linear, teacher, tokenizer, TEXTS, projection_learning_rate=1e-2,
                                   show_progress=False)
    with pytest.raises(ValueError, match="projection_learning_rate >= 0"):
        nprf_hf.attention_transfer(student, teacher, tokenizer, TEXTS, projection_learning_rate=-1.0,
                                   show_progress=False)


def layer_errors(student, teacher, batch):
    """The transfer's per-layer relative errors for one encoded batch."""
    recorder = transfer._TeacherRecorder(list(teacher.encoder.layer))
    try:
        with torch.no_grad():
            teacher(**batch)
            return transfer._layer_errors(
                list(student.encoder.layer), student.encoder, recorder, batch["attention_mask"].bool()
            )
    finally:
        recorder.remove()


def test_padded_positions_do_not_change_the_loss(tokenizer):
    teacher = tiny_bert(tokenizer)
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16)
    with torch.no_grad():
        student.encoder.rpe_table.normal_()  # a non-trivial student
    text = TEXTS[2]
    exact = tokenizer([text], return_tensors="pt")
    length = exact["input_ids"].shape[1]
    padded = tokenizer([text], padding="max_length", max_length=length + 9, return_tensors="pt")
    assert padded["attention_mask"][0, length:].eq(0).all()
    torch.testing.assert_close(layer_errors(student, teacher, padded), layer_errors(student, teacher, exact))
    # what the padded rows hold must not matter either: change the pad token id
    garbage = {k: v.clone() for k, v in padded.items()}
    garbage["input_ids"][0, length:] = 1000
    torch.testing.assert_close(layer_errors(student, teacher, garbage), layer_errors(student, teacher, exact))


def test_transfer_is_deterministic_under_a_seed(tokenizer):
    teacher = tiny_bert(tokenizer)
    states = []
    for seed in (3, 3, 4):
        student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16)
        nprf_hf.attention_transfer(student, teacher, tokenizer, TEXTS, steps=5, batch_size=3, seed=seed, show_progress=False)
        states.append(student.state_dict())
    name = "encoder.layer.0.attention.self.query.weight"
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not torch.equal(states[0][name], states[2][name])


def test_transfer_on_sentence_pairs_and_a_causal_decoder(tokenizer):
    teacher = tiny_bert(tokenizer)
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16)
    pairs = list(zip(TEXTS[::2], TEXTS[1::2]))
    report = nprf_hf.attention_transfer(student, teacher, tokenizer, pairs, steps=3, batch_size=2, show_progress=False)
    assert report.num_texts == 4 and len(report.history) == 3

    torch.manual_seed(0)
    config = RobertaConfig(**tiny_config(vocab_size=tokenizer.vocab_size, num_attention_heads=4,
                                         max_position_embeddings=140, is_decoder=True, pad_token_id=0))
    decoder = RobertaForCausalLM(config).eval()
    student = nprf_hf.convert_to_nprf(decoder, tokenizer=tokenizer, num_random_features=16)
    report = nprf_hf.attention_transfer(
        student, decoder, tokenizer, TEXTS, steps=30, batch_size=4, learning_rate=1e-2, show_progress=False
    )
    assert sum(report.loss_after) < sum(report.loss_before)


def test_bad_inputs_are_refused(tokenizer):
    teacher = tiny_bert(tokenizer)
    student = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16)
    with pytest.raises(ValueError, match="at least one text"):
        nprf_hf.attention_transfer(student, teacher, tokenizer, [], show_progress=False)
    with pytest.raises(ValueError, match="steps >= 0"):
        nprf_hf.attention_transfer(student, teacher, tokenizer, TEXTS, steps=-1, show_progress=False)
    with pytest.raises(ValueError, match="softmax source"):
        nprf_hf.attention_transfer(student, student, tokenizer, TEXTS, show_progress=False)
    with pytest.raises(ValueError, match="must be an NPRF model"):
        nprf_hf.attention_transfer(teacher, teacher, tokenizer, TEXTS, show_progress=False)
    other = BertModel(BertConfig(**tiny_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=3,
                                               num_attention_heads=4, max_position_embeddings=512)))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        nprf_hf.attention_transfer(student, other, tokenizer, TEXTS, show_progress=False)
    with pytest.raises(ValueError, match="max_length=600 exceeds the source's 128 positions"):
        nprf_hf.attention_transfer(student, teacher, tokenizer, TEXTS, max_length=600, show_progress=False)
    with pytest.raises(ValueError, match="eval_texts is empty"):
        nprf_hf.attention_transfer(student, teacher, tokenizer, TEXTS, eval_texts=[], show_progress=False)
    assert all(p.requires_grad for p in student.parameters())  # a refused call changes nothing
    with pytest.raises(ValueError, match="no such file"):
        nprf_hf.read_transfer_texts("/no/such/file.txt")


@needs_shared_data("glue")
def test_read_transfer_texts_from_a_glue_task_folder_and_a_text_file(tmp_path):
    pairs = nprf_hf.read_transfer_texts(os.path.join(GLUE, "MRPC"))
    assert len(pairs) == 3667 and all(isinstance(p, tuple) and len(p) == 2 for p in pairs[:5])
    sentences = nprf_hf.read_transfer_texts(os.path.join(GLUE, "SST-2"))
    assert len(sentences) == 67349 and isinstance(sentences[0], str)
    path = tmp_path / "t.txt"
    path.write_text(" = Heading = \n\nfirst line\n  second line  \n")
    assert nprf_hf.read_transfer_texts(str(path)) == ["first line", "second line"]


def saved_source_and_texts(tokenizer, tmp_path):
    """(source folder of a tiny BERT + its tokenizer, the BERT, a text file of TEXTS) for the CLI."""
    source = str(tmp_path / "source")
    teacher = tiny_bert(tokenizer)
    teacher.save_pretrained(source)
    tokenizer.save_pretrained(source)
    text = tmp_path / "texts.txt"
    text.write_text("\n".join(TEXTS) + "\n")
    return source, teacher, text


def test_cli_convert_with_attention_transfer(tokenizer, tmp_path, capsys):
    source, teacher, text = saved_source_and_texts(tokenizer, tmp_path)
    out = str(tmp_path / "out")
    code = cli_main([
        "convert", source, out, "--num-random-features", "16", "--attention-transfer-text", str(text),
        "--attention-transfer-steps", "4", "--attention-transfer-batch-size", "4",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Attention transfer: 4 steps on 8 texts" in printed
    saved = load_file(os.path.join(out, "model.safetensors"))
    converted = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16)
    name = "encoder.layer.0.attention.self.key.weight"
    assert not torch.equal(saved[name], converted.state_dict()[name])  # trained
    name = "encoder.layer.0.attention.self.value.weight"
    assert torch.equal(saved[name], converted.state_dict()[name])  # frozen
    assert cli_main(["convert", source, str(tmp_path / "bad"), "--attention-transfer-text", "/no/such.txt"]) == 2
    assert "no such file or directory: /no/such.txt" in capsys.readouterr().err


def test_cli_convert_trains_on_the_device_given_and_refuses_bad_devices(tokenizer, tmp_path, capsys):
    source, teacher, text = saved_source_and_texts(tokenizer, tmp_path)
    common = ["--num-random-features", "16", "--attention-transfer-text", str(text), "--attention-transfer-steps", "2",
              "--attention-transfer-batch-size", "4"]
    assert cli_main(["convert", source, str(tmp_path / "cpu"), *common]) == 0
    assert cli_main(["convert", source, str(tmp_path / "dev"), *common, "--device", "cpu"]) == 0
    first, second = (load_file(os.path.join(tmp_path / name, "model.safetensors")) for name in ("cpu", "dev"))
    assert all(torch.equal(first[name], second[name]) for name in first)  # same device, same seed: same model
    capsys.readouterr()
    for device, message in [("gpu0", "is not a torch device"), ("cuda:7", "no CUDA GPU")]:
        if device.startswith("cuda") and torch.cuda.is_available():
            continue
        assert cli_main(["convert", source, str(tmp_path / "bad"), *common, "--device", device]) == 2
        assert message in capsys.readouterr().err
    assert cli_main(["convert", source, str(tmp_path / "bad"), "--device", "cpu"]) == 2
    assert "--device sets where attention transfer" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad")
    with pytest.raises(ValueError, match="device= sets where"):
        nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, device="cpu")


@needs_shared_data("glue")
@pytest.mark.parametrize("script", ["run_glue", "run_glue_no_trainer"])
def test_glue_scripts_run_attention_transfer_before_fine_tuning(tokenizer, tmp_path, script):
    from test_examples_glue import load_script

    source = str(tmp_path / "source")
    tiny_bert(tokenizer).save_pretrained(source)
    tokenizer.save_pretrained(source)
    out = tmp_path / "out"
    common = [
        "--model_name_or_path", source, "--task_name", "mrpc", "--glue_dir", GLUE, "--max_train_samples", "12",
        "--max_eval_samples", "8", "--per_device_train_batch_size", "4", "--output_dir", str(out),
        "--convert_to_nprf", "--nprf_config", '{"num_random_features": 16, "logit_scale_max": 4}',
        "--attention_transfer_steps", "3", "--attention_transfer_batch_size", "4",
    ]
    if script == "run_glue":
        args = common + ["--do_train", "--do_eval", "--max_steps", "1", "--save_strategy", "no", "--report_to", "none"]
    else:
        args = common + ["--max_train_steps", "1", "--cpu", "--report_to", "none"]
    load_script(os.path.join(ROOT, "examples", script + ".py")).main(args)
    report = json.loads((out / "attention_transfer.json").read_text())
    assert report["steps"] == 3 and report["num_texts"] == 12 and len(report["loss_after"]) == 2
    assert "encoder.layer.0.attention.self.logit_scale_logit" in [n.replace("bert.", "", 1) for n in report["trainable"]]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nprf_bert" and config["logit_scale_max"] == 4


def test_glue_recipes_build_valid_run_glue_commands(tmp_path):
    """Every recipe of examples/glue_recipes.py is a run_glue.py command that parses, with the
    conversion / transfer / source its recipe declares."""
    from test_examples_glue import load_script

    recipes = load_script(os.path.join(ROOT, "examples", "glue_recipes.py"))
    run_glue = load_script(os.path.join(ROOT, "examples", "run_glue.py"))
    args = recipes.argparse.Namespace(
        model_name_or_path="minilm", glue_dir=GLUE, output_dir=str(tmp_path), attention_transfer_steps=7, extra=[]
    )
    for recipe, spec in recipes.RECIPES.items():
        command = recipes.command(args, "mrpc", recipe, 43)
        model_args, data_args, training_args = run_glue.parse_args(command[2:])
        assert model_args.convert_to_nprf == (spec["nprf"] is not None)
        assert model_args.attention_transfer_steps == (7 if spec.get("transfer") else 0)
        assert (json.loads(model_args.nprf_config) if model_args.nprf_config else {}) == (spec["nprf"] or {})
        assert training_args.seed == 43 and data_args.task_name == "mrpc"
        assert training_args.num_train_epochs == spec.get("epochs", 3)
        expected_source = recipes.run_dir(str(tmp_path), "mrpc", spec["source"], 43) if spec.get("source") else "minilm"
        assert model_args.model_name_or_path == expected_source


def test_options_are_declared_once_for_every_entry_point():
    """options.py declares each option of the transfer and the long-context recipe once (type, help, default); the
    CLI and the GLUE scripts derive theirs from it, and every one is a field of the arguments of the function it
    configures (`TransferArguments`, `LongContextArguments`: also its keywords)."""
    import dataclasses

    from nprf_hf import options
    from nprf_hf.cli import build_parser
    from nprf_hf.long_context import LongContextArguments
    from nprf_hf.transfer import TransferArguments

    for declared, defaults, arguments, prefix in (
        (options.TRANSFER_OPTIONS, options.TRANSFER_DEFAULTS, TransferArguments, "--attention-transfer-"),
        (options.LONG_CONTEXT_OPTIONS, options.LONG_CONTEXT_DEFAULTS, LongContextArguments, "--long-context-"),
    ):
        assert set(declared) == set(defaults)
        fields = {field.name: field.default for field in dataclasses.fields(arguments)}
        assert all(fields[name] == defaults[name] for name in declared)
        help_text = build_parser()._subparsers._group_actions[0].choices["convert"].format_help()
        assert all(prefix + name.replace("_", "-") in help_text for name in declared)
    assert set(options.GLUE_TRANSFER_OPTIONS) <= set(options.TRANSFER_OPTIONS)


def test_layer_errors_are_the_relative_error_against_independent_students(tokenizer):
    """The transfer's loss at two points known without its code: a student whose attention is the teacher's own
    (the softmax variant with a zero bias) has error 0 in every layer, and one whose attention outputs nothing (zero
    value projection) has error exactly 1, however the teacher's outputs are scaled."""
    teacher = tiny_bert(tokenizer)
    batch = tokenizer(TEXTS[:3], padding=True, return_tensors="pt")
    same = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, attention_variant="softmax")
    assert layer_errors(same, teacher, batch).abs().max() < 1e-10
    silent = nprf_hf.convert_to_nprf(teacher, tokenizer=tokenizer, num_random_features=16)
    with torch.no_grad():
        for layer in silent.encoder.layer:
            layer.attention.self.value.weight.zero_()
            layer.attention.self.value.bias.zero_()
    errors = layer_errors(silent, teacher, batch)
    assert errors.shape == (len(teacher.encoder.layer),)
    torch.testing.assert_close(errors, torch.ones_like(errors), rtol=0, atol=1e-6)
