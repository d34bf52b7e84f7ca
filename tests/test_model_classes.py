"""The model classes are code you can find (issue 23): every public class a `class` statement in
nprf_hf/modeling_nprf.py, written by utils/generate_model_classes.py from families.py (checked current here), the
base models' forward spelled with their family's parameters, the heads built by transformers' own `__init__`."""

import importlib.util
import inspect
import os

import pytest
import torch
import transformers

import nprf_hf
from nprf_hf import modeling_nprf
from nprf_hf.configuration_nprf import NPRF_CONFIG_CLASSES
from nprf_hf.families import FAMILIES
from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = [cls for classes in NPRF_MODEL_CLASSES.values() for cls in classes.values()]


def generator():
    path = os.path.join(ROOT, "utils", "generate_model_classes.py")
    spec = importlib.util.spec_from_file_location("generate_model_classes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def forget_captured_outputs(cls):
    """Drop transformers' record (filled when a model of the class is built) of the modules whose outputs `cls`
    captures, where transformers keeps one."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    _CAN_RECORD_REGISTRY.pop(str(cls), None)


def tiny_sizes(family):
    sizes = dict(vocab_size=99, max_position_embeddings=64, pad_token_id=1)
    if family.layout == "distilbert":
        return dict(sizes, dim=32, n_heads=2, n_layers=2, hidden_dim=37)
    sizes.update(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=37)
    return dict(sizes, embedding_size=16) if family.model_type == "electra" else sizes


def tiny_config(family):
    return NPRF_CONFIG_CLASSES[family.model_type](**tiny_sizes(family), num_random_features=8)


def test_generated_classes_are_current():
    """modeling_nprf.py holds exactly what the generator writes from families.py and the installed transformers
    (else: run `python utils/generate_model_classes.py`)."""
    assert generator().main(["--check"]) == 0


def test_check_mode_sees_a_stale_file(tmp_path, monkeypatch):
    module = generator()
    stale = tmp_path / "modeling_nprf.py"
    with open(module.TARGET, encoding="utf-8") as handle:
        text = handle.read()
    stale.write_text(text.replace(module.END, "edited_by_hand = True\n" + module.END), encoding="utf-8")
    monkeypatch.setattr(module, "TARGET", str(stale))
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0 and stale.read_text(encoding="utf-8") == text  # written back as it was


def test_every_public_class_is_a_class_statement_of_modeling_nprf():
    source = inspect.getsource(modeling_nprf)
    expected = {family.nprf_prefix + "PreTrainedModel" for family in FAMILIES.values()}
    expected |= {family.class_name(head) for family in FAMILIES.values() for head in family.heads}
    assert {cls.__name__ for cls in CLASSES} == expected
    for cls in CLASSES:
        assert cls.__module__ == "nprf_hf.modeling_nprf" and cls.__qualname__ == cls.__name__
        assert getattr(modeling_nprf, cls.__name__) is cls and getattr(nprf_hf, cls.__name__) is cls
        assert inspect.getsource(cls).startswith(f"class {cls.__name__}(")
        assert source.count(f"\nclass {cls.__name__}(") == 1
        # what a class defines itself is written in this file, with this module's globals (nothing rebound)
        for name in ("__init__", "forward"):
            method = cls.__dict__.get(name)
            if method is not None:
                assert method.__globals__ is vars(modeling_nprf)
                assert inspect.getsourcefile(method) == inspect.getsourcefile(modeling_nprf)
    assert not hasattr(modeling_nprf, "_with_base_model") and not hasattr(modeling_nprf, "_nprf_classes")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_base_model_forward_spells_the_family_parameters(model_type):
    """What transformers' test_model_main_input_name checks, and the family's parameters in its order."""
    family = FAMILIES[model_type]
    hf_model = getattr(transformers, family.class_name("model", nprf=False))
    for cls in NPRF_MODEL_CLASSES[model_type].values():
        if cls is NPRF_MODEL_CLASSES[model_type][None]:
            continue
        names = list(inspect.signature(cls.forward).parameters)
        assert names[1] == cls.main_input_name == "input_ids"
    model = NPRF_MODEL_CLASSES[model_type]["model"]
    # the cache under transformers 5.24's name whichever version is installed (the generator's RENAMED_PARAMETERS)
    renamed = generator().RENAMED_PARAMETERS
    expected = [renamed.get(name, name) for name in inspect.signature(hf_model.forward).parameters]
    assert list(inspect.signature(model.forward).parameters) == expected
    assert "forward" in model.__dict__


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_positional_and_named_arguments_are_one_call(model_type):
    family = FAMILIES[model_type]
    model = NPRF_MODEL_CLASSES[model_type]["model"](tiny_config(family)).eval()
    input_ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    with torch.no_grad():
        named = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        positional = model(input_ids, attention_mask).last_hidden_state
        explicit_none = model(input_ids, attention_mask, inputs_embeds=None, position_ids=None).last_hidden_state
    assert torch.equal(named, positional) and torch.equal(named, explicit_none)
    with pytest.raises(TypeError):
        model(input_ids, input_ids=input_ids)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_head_builds_its_base_model_as_the_nprf_class_does(model_type):
    """The head's `__init__` is transformers' (with its own arguments: RoBERTa's heads drop the pooler), its base
    model made NPRF in place (`adopt`): of the NPRF class, with its settings, its attentions and hidden states
    captured. Making it NPRF draws no random numbers: under one seed every tensor is the transformers head's,
    and the state dict is the transformers head's plus the NPRF tensors."""
    family = FAMILIES[model_type]
    classes = NPRF_MODEL_CLASSES[model_type]
    config = tiny_config(family)
    direct = classes["model"](config)
    layers = config.num_hidden_layers if family.layout != "distilbert" else config.n_layers
    for head in family.heads:
        if head == "model":
            continue
        forget_captured_outputs(classes["model"])  # as in a process that never built the base model class itself
        torch.manual_seed(0)
        model = classes[head](config).eval()
        input_ids = torch.randint(3, 99, (2, 3, 9) if head == "multiple-choice" else (2, 9))
        with torch.no_grad():
            out = model(input_ids, output_attentions=True, output_hidden_states=True)
        assert len(out.attentions) == layers and out.attentions[0].shape[-2:] == (9, 9)
        assert len(out.hidden_states) == layers + 1
        base = model.base_model
        assert type(base) is classes["model"] and base is getattr(model, model.base_model_prefix)
        assert base._no_split_modules == direct._no_split_modules and "NPRFEmbeddings" in model._no_split_modules
        hf_head = getattr(transformers, family.class_name(head, nprf=False))
        torch.manual_seed(0)
        source = hf_head(getattr(transformers, family.prefix + "Config")(**tiny_sizes(family))).state_dict()
        state = model.state_dict()
        nprf_keys = {key for key in state if key.endswith((".projection", "rpe_table"))}
        assert set(state) == set(source) | nprf_keys and nprf_keys
        for key, value in source.items():
            assert torch.equal(state[key], value), key
        if head in ("masked-lm", "causal-lm"):  # weight tying as transformers' head ties
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with pytest.raises(TypeError, match="adopt takes a"):
        classes["model"].adopt(direct)
