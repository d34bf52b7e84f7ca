"""Tests of the NPRF configs and models (issue 3), tiny configs on CPU."""

import os
import re

import pytest
import torch
from torch import nn

import nprf_hf
from nprf_hf import (
    NPRFBertConfig,
    NPRFBertForMaskedLM,
    NPRFBertForMultipleChoice,
    NPRFBertForQuestionAnswering,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertModel,
    NPRFRobertaConfig,
    NPRFRobertaForCausalLM,
    NPRFRobertaForMaskedLM,
    NPRFRobertaForMultipleChoice,
    NPRFRobertaForQuestionAnswering,
    NPRFRobertaForSequenceClassification,
    NPRFRobertaForTokenClassification,
    NPRFRobertaModel,
)
from nprf_hf import functional
from nprf_hf.modeling_nprf import NPRFSelfAttention, split_attention_mask

from tolerances import MODEL_GAIN, assert_within, attention_checked_against, model_rounding


TINY = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=37,
    max_position_embeddings=64,
    num_random_features=16,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)

BERT_CLASSES = [
    NPRFBertModel,
    NPRFBertForMaskedLM,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertForQuestionAnswering,
    NPRFBertForMultipleChoice,
]
ROBERTA_CLASSES = [
    NPRFRobertaModel,
    NPRFRobertaForMaskedLM,
    NPRFRobertaForSequenceClassification,
    NPRFRobertaForTokenClassification,
    NPRFRobertaForQuestionAnswering,
    NPRFRobertaForMultipleChoice,
    NPRFRobertaForCausalLM,
]


def tiny_config(family="bert", **overrides):
    kwargs = {**TINY, **overrides}
    if family == "bert":
        return NPRFBertConfig(**kwargs)
    if overrides.get("is_decoder"):
        kwargs.setdefault("pad_token_id", 1)
    return NPRFRobertaConfig(**kwargs)


def config_for(cls, **overrides):
    family = "bert" if cls.__name__.startswith("NPRFBert") else "roberta"
    if cls is NPRFRobertaForCausalLM:
        overrides.setdefault("is_decoder", True)
    return tiny_config(family, **overrides)


def model_inputs(cls, batch=2, length=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, 3, length) if "MultipleChoice" in cls.__name__ else (batch, length)
    input_ids = torch.randint(3, TINY["vocab_size"], shape, generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[-1, ..., length - 3 :] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def main_output(cls, output):
    if "QuestionAnswering" in cls.__name__:
        return torch.cat([output.start_logits, output.end_logits], dim=-1)
    if cls in (NPRFBertModel, NPRFRobertaModel):
        return output.last_hidden_state
    return output.logits


def randomize_rpe(model, std=0.5, seed=0):
    """Give the (zero-initialized) RPE tables non-trivial values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("rpe_table"):
                param.copy_(torch.randn(param.shape, generator=generator) * std)


# ---------------------------------------------------------------------------------------------
# 1. Config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class", [NPRFBertConfig, NPRFRobertaConfig])
def test_config_defaults_and_roundtrip(config_class, tmp_path):
    config = config_class(**TINY)
    assert config.model_type in ("nprf_bert", "nprf_roberta")
    assert config.feature_map == "orf"
    assert config.feature_redraw_interval == 0
    assert (config.rpe_num_buckets, config.rpe_max_distance) == (32, 128)
    assert config.rpe_shared_across_layers is True
    assert config.attention_algorithm == "auto"
    assert config.position_embedding_type == "absolute"
    config = config_class(**TINY, feature_map="prf", attention_algorithm="banded", position_embedding_type="none")
    config.save_pretrained(tmp_path)
    loaded = config_class.from_pretrained(tmp_path)
    assert (loaded.feature_map, loaded.attention_algorithm, loaded.position_embedding_type) == ("prf", "banded", "none")
    assert loaded.num_random_features == 16


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("feature_map", "gaussian", "orf"),
        ("attention_algorithm", "flash", "banded"),
        ("position_embedding_type", "relative_key", "none"),
        ("num_random_features", 0, "positive"),
        ("feature_redraw_interval", -1, ">= 0"),
        ("rpe_num_buckets", 2, ">= 4"),
        ("rpe_max_distance", 8, "rpe_num_buckets // 2"),
        ("rpe_shared_across_layers", "yes", "True or False"),
        ("output_attentions_max_length", 0, "positive"),
        ("logit_scale_max", 0.5, "> 1"),
        ("logit_scale_max", True, "> 1"),
    ],
)
@pytest.mark.parametrize("config_class", [NPRFBertConfig, NPRFRobertaConfig])
def test_config_invalid_values_raise(config_class, field, value, allowed):
    with pytest.raises(ValueError) as info:
        config_class(**{field: value})
    assert field in str(info.value) and allowed in str(info.value)


# ---------------------------------------------------------------------------------------------
# 2. Models: every head runs, trains, and maps one-to-one onto the HF state_dict
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", BERT_CLASSES + ROBERTA_CLASSES, ids=lambda c: c.__name__)
def test_every_head_forward_and_loss(cls):
    torch.manual_seed(0)
    num_labels = 2 if "QuestionAnswering" in cls.__name__ else 3
    model = cls(config_for(cls, num_labels=num_labels))
    inputs = model_inputs(cls)
    batch = inputs["input_ids"].shape[0]
    length = inputs["input_ids"].shape[-1]
    name = cls.__name__
    if "SequenceClassification" in name:
        inputs["labels"] = torch.tensor([0, 2])
    elif "TokenClassification" in name:
        inputs["labels"] = torch.randint(0, 3, (batch, length))
    elif "MultipleChoice" in name:
        inputs["labels"] = torch.tensor([0, 2])
    elif "QuestionAnswering" in name:
        inputs["start_positions"] = torch.tensor([1, 2])
        inputs["end_positions"] = torch.tensor([3, 4])
    elif "MaskedLM" in name or "CausalLM" in name:
        inputs["labels"] = inputs["input_ids"]
    output = model(**inputs)
    assert torch.isfinite(main_output(cls, output)).all()
    if cls not in (NPRFBertModel, NPRFRobertaModel):
        assert output.loss.ndim == 0 and torch.isfinite(output.loss)
        output.loss.backward()
        table = model.base_model.encoder.rpe_table
        assert table.grad is not None and table.grad.abs().sum() > 0


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_state_dict_is_source_plus_rpe_and_projection(family, shared):
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    hf_config = (BertConfig if family == "bert" else RobertaConfig)(**{k: v for k, v in TINY.items() if k != "num_random_features"})
    source = (BertForMaskedLM if family == "bert" else RobertaForMaskedLM)(hf_config)
    model_class = NPRFBertForMaskedLM if family == "bert" else NPRFRobertaForMaskedLM
    model = model_class(tiny_config(family, rpe_shared_across_layers=shared))
    source_state, state = source.state_dict(), model.state_dict()
    for key, tensor in source_state.items():
        assert state[key].shape == tensor.shape, key
    new = sorted(set(state) - set(source_state))
    prefix = f"{family}.encoder."
    heads, buckets, m, d = 2, 32, 16, 16
    if shared:
        expected = [prefix + "layer.0.attention.self.projection", prefix + "layer.1.attention.self.projection", prefix + "rpe_table"]
    else:
        expected = sorted(
            f"{prefix}layer.{i}.attention.self.{name}" for i in range(2) for name in ("projection", "rpe_table")
        )
    assert new == sorted(expected)
    for key in new:
        assert state[key].shape == ((heads, m, d) if key.endswith("projection") else (heads, buckets))
    # and the source weights load one-to-one
    result = model.load_state_dict(source_state, strict=False)
    assert sorted(result.missing_keys) == new and not result.unexpected_keys


def test_peft_style_access_to_qkv_by_name():
    model = NPRFBertForSequenceClassification(tiny_config())
    names = [name for name, module in model.named_modules() if name.split(".")[-1] in ("query", "key", "value")]
    assert len(names) == 3 * TINY["num_hidden_layers"]
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear) and module.weight.shape == (32, 32)

    class LoRALinear(nn.Module):  # what PEFT does: wrap the Linear found by name
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.lora_a = nn.Parameter(torch.randn(4, base.in_features) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(base.out_features, 4) * 0.1)

        def forward(self, x):
            return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()

    model.eval()
    inputs = model_inputs(NPRFBertForSequenceClassification)
    before = model(**inputs).logits
    for name in names:
        if name.endswith(("query", "value")):
            model.set_submodule(name, LoRALinear(model.get_submodule(name)))
    after = model(**inputs).logits
    assert not torch.allclose(before, after)
    after.sum().backward()
    lora = model.get_submodule(names[0])
    assert lora.lora_b.grad is not None and lora.lora_b.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# 3. The projection: saved, deterministic, redrawn only in training
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [NPRFBertForSequenceClassification, NPRFRobertaForCausalLM], ids=lambda c: c.__name__)
def test_save_reload_is_bit_identical(cls, tmp_path):
    torch.manual_seed(0)
    model = cls(config_for(cls)).eval()
    randomize_rpe(model)
    inputs = model_inputs(cls)
    reference = main_output(cls, model(**inputs))
    assert torch.equal(reference, main_output(cls, model(**inputs)))  # eval is deterministic
    model.save_pretrained(tmp_path)
    first = cls.from_pretrained(tmp_path).eval()
    second = cls.from_pretrained(tmp_path).eval()
    assert torch.equal(main_output(cls, first(**inputs)), reference)
    assert torch.equal(main_output(cls, second(**inputs)), reference)
    assert int(first.base_model.encoder.redraw_step) == 0


def test_projection_is_deterministic_and_depends_on_seed_and_layer():
    a = NPRFBertModel(tiny_config()).encoder.layer
    b = NPRFBertModel(tiny_config()).encoder.layer
    c = NPRFBertModel(tiny_config(projection_seed=1)).encoder.layer
    pa = [layer.attention.self.projection for layer in a]
    assert torch.equal(pa[0], b[0].attention.self.projection) and torch.equal(pa[1], b[1].attention.self.projection)
    assert not torch.equal(pa[0], pa[1])
    assert not torch.equal(pa[0], c[0].attention.self.projection)
    # "orf": rows within a block of d rows are orthogonal
    rows = pa[0][0, :16]
    gram = rows @ rows.t()
    assert torch.allclose(gram - torch.diag(torch.diagonal(gram)), torch.zeros_like(gram), atol=1e-4)


def test_plain_bert_checkpoint_loads_with_deterministic_new_tensors(tmp_path):
    from transformers import BertConfig, BertModel

    source = BertModel(BertConfig(**{k: v for k, v in TINY.items() if k != "num_random_features"}))
    source.save_pretrained(tmp_path)
    first = NPRFBertModel.from_pretrained(tmp_path, num_random_features=16).eval()
    second = NPRFBertModel.from_pretrained(tmp_path, num_random_features=16).eval()
    fresh = NPRFBertModel(tiny_config())
    for i in range(2):
        projection = first.encoder.layer[i].attention.self.projection
        assert torch.equal(projection, second.encoder.layer[i].attention.self.projection)
        assert torch.equal(projection, fresh.encoder.layer[i].attention.self.projection)
        assert torch.equal(first.encoder.layer[i].attention.self.query.weight, source.encoder.layer[i].attention.self.query.weight)
    assert torch.equal(first.encoder.rpe_table, torch.zeros(2, 32))
    ids = model_inputs(NPRFBertModel)["input_ids"]
    assert torch.equal(first(ids).last_hidden_state, second(ids).last_hidden_state)


def test_feature_redraw_interval():
    model = NPRFBertModel(tiny_config(feature_redraw_interval=2))
    twin = NPRFBertModel(tiny_config(feature_redraw_interval=2))
    ids = model_inputs(NPRFBertModel)["input_ids"]
    projection = model.encoder.layer[0].attention.self.projection
    initial = projection.clone()
    model.eval()
    for _ in range(3):
        model(ids)
    assert torch.equal(projection, initial)  # never redrawn in eval
    model.train()
    model(ids)
    assert torch.equal(projection, initial)  # 1 training forward < interval
    model(ids)
    redrawn = projection.clone()
    assert not torch.equal(redrawn, initial)
    model(ids)
    assert torch.equal(projection, redrawn)
    model(ids)
    assert not torch.equal(projection, redrawn)
    twin.train()
    for _ in range(4):
        twin(ids)
    assert torch.equal(twin.encoder.layer[0].attention.self.projection, projection)  # deterministic redraws


# ---------------------------------------------------------------------------------------------
# 4. Auto classes (in-process registration; remote code is in test_remote_code.py)
# ---------------------------------------------------------------------------------------------


def test_auto_classes_registered_in_process():
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForMultipleChoice,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    assert isinstance(AutoConfig.for_model("nprf_bert", **TINY), NPRFBertConfig)
    assert isinstance(AutoConfig.for_model("nprf_roberta", **TINY), NPRFRobertaConfig)
    pairs = [
        (AutoModel, NPRFBertModel, NPRFRobertaModel),
        (AutoModelForMaskedLM, NPRFBertForMaskedLM, NPRFRobertaForMaskedLM),
        (AutoModelForSequenceClassification, NPRFBertForSequenceClassification, NPRFRobertaForSequenceClassification),
        (AutoModelForTokenClassification, NPRFBertForTokenClassification, NPRFRobertaForTokenClassification),
        (AutoModelForQuestionAnswering, NPRFBertForQuestionAnswering, NPRFRobertaForQuestionAnswering),
        (AutoModelForMultipleChoice, NPRFBertForMultipleChoice, NPRFRobertaForMultipleChoice),
    ]
    for auto, bert_class, roberta_class in pairs:
        assert type(auto.from_config(tiny_config("bert"))) is bert_class
        assert type(auto.from_config(tiny_config("roberta"))) is roberta_class
    assert type(AutoModelForCausalLM.from_config(tiny_config("roberta", is_decoder=True))) is NPRFRobertaForCausalLM


# ---------------------------------------------------------------------------------------------
# 5. Training / precision / checkpointing / compile
# ---------------------------------------------------------------------------------------------


def test_trainer_lowers_the_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = NPRFBertForSequenceClassification(tiny_config(num_labels=2))
    generator = torch.Generator().manual_seed(0)
    examples = []
    for _ in range(48):  # the label is written in the first token
        ids = torch.randint(10, 99, (8,), generator=generator)
        label = int(torch.rand((), generator=generator) < 0.5)
        ids[0] = 7 if label else 8
        examples.append({"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long), "labels": label})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_train_epochs=4,
        learning_rate=5e-3,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_pin_memory=False,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=examples)
    # our heads' losses are batch means: the Trainer must not rescale them for num_items_in_batch
    assert trainer.model_accepts_loss_kwargs is False
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) >= 4
    assert losses[-1] < 0.5 * losses[0], losses


def enable_checkpointing(model, use_reentrant):
    """transformers 5.2x names it activation checkpointing; earlier 5.x only has the gradient_checkpointing_* names."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    torch.manual_seed(0)
    model = NPRFBertForSequenceClassification(tiny_config())
    randomize_rpe(model)
    inputs = {**model_inputs(NPRFBertForSequenceClassification), "labels": torch.tensor([0, 1])}
    model.train()
    model(**inputs).loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    enable_checkpointing(model, use_reentrant)
    assert model.bert.encoder.layer[0].gradient_checkpointing
    model(**inputs).loss.backward()
    for name, grad in reference.items():
        assert torch.allclose(dict(model.named_parameters())[name].grad, grad, atol=1e-6), name


@pytest.mark.parametrize("checkpointing", [None, True, False])
def test_attention_recompute_gives_the_same_gradients(checkpointing):
    """attention_recompute="always" (what auto does for banded / fft) changes no gradient, also inside HF's
    activation checkpointing (reentrant or not), where the attention is then recomputed twice."""
    config = tiny_config(attention_algorithm="banded", rpe_num_buckets=8, rpe_max_distance=12, max_position_embeddings=80)
    inputs = {**model_inputs(NPRFBertForSequenceClassification, length=70), "labels": torch.tensor([0, 1])}
    grads = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        model = NPRFBertForSequenceClassification(NPRFBertConfig(**{**config.to_dict(), "attention_recompute": mode}))
        randomize_rpe(model)
        model.train()
        if checkpointing is not None:
            enable_checkpointing(model, checkpointing)
        model(**inputs).loss.backward()
        grads[mode] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads["never"].keys() == grads["always"].keys() and any("rpe_table" in name for name in grads["never"])
    for name, grad in grads["never"].items():
        torch.testing.assert_close(grads["always"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="attention_recompute must be one of"):
        NPRFBertConfig(**{**TINY, "attention_recompute": "sometimes"})


def test_autocast_bf16_and_dtype_casts():
    torch.manual_seed(0)
    model = NPRFBertForSequenceClassification(tiny_config()).eval()
    randomize_rpe(model)
    inputs = model_inputs(NPRFBertForSequenceClassification)
    reference = model(**inputs).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(**inputs).logits
    assert torch.isfinite(mixed).all()
    # the logits are ~1e-2, below any absolute bf16 tolerance: errors are measured relative to the reference's
    # norm (measured: 0.006 autocast, 0.03 bf16 weights), so that zeros (1.0) or a sign flip (2.0) fail
    def relative_error(out):
        return ((out.float() - reference).norm() / reference.norm()).item()

    assert relative_error(mixed) < 0.05
    double = model.to(torch.float64)(**inputs).logits
    assert double.dtype == torch.float64 and torch.allclose(double.float(), reference, atol=1e-5)
    half = model.to(torch.bfloat16)
    assert half.bert.encoder.layer[0].attention.self.projection.dtype == torch.bfloat16
    low = half(**inputs).logits
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert relative_error(low) < 0.15


@pytest.mark.skipif(not os.environ.get("NPRF_RUN_SLOW"), reason="torch.compile takes ~45-80 s on 2 CPU cores; set NPRF_RUN_SLOW=1")
def test_torch_compile_matches_eager():
    model = NPRFBertForSequenceClassification(tiny_config(attention_algorithm="dense")).eval()
    inputs = model_inputs(NPRFBertForSequenceClassification)
    reference = model(**inputs).logits
    compiled = torch.compile(model)
    assert torch.allclose(compiled(**inputs).logits, reference, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 6. Padding invariance, masks, output_attentions, positions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", functional.ALGORITHMS)
@pytest.mark.parametrize("family", ["bert", "roberta", "roberta-causal"])
def test_padding_invariance(family, algorithm):
    # small buckets so that the banded algorithm really bands at this length (W << n)
    overrides = dict(attention_algorithm=algorithm, rpe_num_buckets=8, rpe_max_distance=16, max_position_embeddings=260)
    if family == "bert":
        model = NPRFBertModel(tiny_config("bert", **overrides))
    elif family == "roberta":
        model = NPRFRobertaModel(tiny_config("roberta", **overrides))
    else:
        model = NPRFRobertaForCausalLM(tiny_config("roberta", is_decoder=True, **overrides))
    model.eval()
    randomize_rpe(model)
    generator = torch.Generator().manual_seed(1)
    length, padded = 150, 200
    ids = torch.randint(3, 99, (2, padded), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, length:] = 0
    ids[0, length:] = 1 if family != "bert" else 0
    batch = model(ids, attention_mask=mask)
    alone = model(ids[:1, :length])
    get = (lambda o: o.logits) if family == "roberta-causal" else (lambda o: o.last_hidden_state)
    torch.testing.assert_close(get(batch)[:1, :length], get(alone), atol=2e-5, rtol=1e-4)


def test_algorithms_agree_in_outputs_and_rpe_gradients():
    """fft and banded against dense in a float64 model at 220 tokens: every layer's attention within the bounds
    derived for its inputs (`tolerances.attention_checked_against`), the outputs and the RPE table's gradient within
    those bounds carried through the layers (`tolerances.model_rounding`'s gain). This test ran in float32 with
    atol 1e-5 / 1e-4 and the loss sum(out^2), whose gradient is ~0 (a LayerNorm output's squares sum to about its
    width): the RPE gradients compared were float32 noise of ~3e-9 under an atol of 1e-4 (fft's differed from
    dense's by 90% of them). A weighted sum has real gradients (~3e-2), and float64 bounds of ~1e-9 to hold them."""
    results = {}
    weights = torch.randn(1, 220, TINY["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for algorithm in ("dense", "fft", "banded"):
        torch.manual_seed(0)
        model = NPRFBertModel(tiny_config(attention_algorithm=algorithm, rpe_num_buckets=8, rpe_max_distance=16,
                                          max_position_embeddings=260)).double()
        randomize_rpe(model)
        ids = torch.randint(3, 99, (1, 220), generator=torch.Generator().manual_seed(0))
        with attention_checked_against("dense", replace=False) as calls:
            out = model(ids).last_hidden_state
            (out * weights).sum().backward()
        results[algorithm] = (out.detach(), model.encoder.rpe_table.grad.clone(), calls)
    gain = MODEL_GAIN ** model.config.num_hidden_layers
    dense_out, dense_grad, _ = results["dense"]
    for algorithm in ("fft", "banded"):
        out, grad, calls = results[algorithm]
        assert len(calls) == model.config.num_hidden_layers
        values = model_rounding(model, 220, 1) + gain * max(call[0] for call in calls)
        gradient = model_rounding(model, 220, 1, gradient=True) + gain * max(call[1] for call in calls)
        assert_within(out, dense_out, values * dense_out.abs().max(), f"{algorithm} outputs")
        assert_within(grad, dense_grad, gradient * dense_grad.abs().max(), f"{algorithm} rpe gradient")


def test_eager_and_sdpa_masks_give_the_same_outputs():
    cls = NPRFRobertaForCausalLM
    model = cls(config_for(cls)).eval()
    inputs = model_inputs(cls)
    reference = model(**inputs).logits
    # a 4D mask built by HF (padding + causal) takes the same fast path under both implementations
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        assert torch.allclose(model(**inputs).logits, reference, atol=1e-6)


def test_split_attention_mask_forms():
    kpm = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    bidirectional = kpm[:, None, None, :].expand(2, 1, 4, 4)
    got, general = split_attention_mask(bidirectional, 4, 4, causal=False)
    assert torch.equal(got, kpm) and general is None
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~bidirectional, torch.finfo(torch.float32).min)
    got, general = split_attention_mask(additive, 4, 4, causal=False)
    assert torch.equal(got, kpm) and general is None
    causal = bidirectional & torch.ones(4, 4, dtype=torch.bool).tril()
    got, general = split_attention_mask(causal, 4, 4, causal=True)
    assert torch.equal(got, kpm) and general is None
    got, general = split_attention_mask(causal, 4, 4, causal=False)  # causal pattern on an encoder: not padding
    assert got is None and torch.equal(general, causal)
    got, general = split_attention_mask(kpm.long(), 4, 4, causal=False)
    assert torch.equal(got, kpm) and general is None
    with pytest.raises(ValueError, match="additive attention bias"):
        split_attention_mask(torch.full((2, 1, 4, 4), 0.5), 4, 4, causal=False)
    with pytest.raises(ValueError, match="attention_mask must be"):
        split_attention_mask(torch.ones(2, 4, 4), 4, 4, causal=False)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_general_4d_mask_is_applied_exactly(implementation):
    # Block-diagonal mask over two segments == each segment alone (no absolute positions).
    model = NPRFBertModel(tiny_config(position_embedding_type="none"), add_pooling_layer=False).eval()
    model.set_attn_implementation(implementation)
    randomize_rpe(model)
    ids = torch.randint(3, 99, (1, 10), generator=torch.Generator().manual_seed(0))
    blocks = torch.zeros(1, 1, 10, 10, dtype=torch.bool)
    blocks[..., :4, :4] = True
    blocks[..., 4:, 4:] = True
    out = model(ids, attention_mask=blocks).last_hidden_state
    torch.testing.assert_close(out[:, :4], model(ids[:, :4]).last_hidden_state, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[:, 4:], model(ids[:, 4:]).last_hidden_state, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_output_attentions(causal):
    cls = NPRFRobertaForCausalLM if causal else NPRFBertForSequenceClassification
    model = cls(config_for(cls, output_attentions_max_length=12)).eval()
    randomize_rpe(model)
    inputs = model_inputs(cls, length=10)
    plain = model(**inputs)
    output = model(**inputs, output_attentions=True)
    # with output_attentions the output is computed from the returned weights (dense): equal up to rounding
    torch.testing.assert_close(main_output(cls, plain), main_output(cls, output), rtol=1e-5, atol=1e-5)
    assert len(output.attentions) == TINY["num_hidden_layers"]
    weights = output.attentions[0]
    assert weights.shape == (2, 2, 10, 10)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 10))
    assert (weights[1, :, :, 7:] == 0).all()  # padded keys
    if causal:
        assert (weights.triu(1) == 0).all()
    # the weights reproduce the layer's attention output: z = A v
    attention = model.base_model.encoder.layer[0].attention.self
    captured = {}
    hook = attention.register_forward_hook(lambda module, args, out: captured.update(out=out[0], hidden=args[0]))
    model(**inputs)
    hook.remove()
    value = attention.value(captured["hidden"]).view(2, 10, 2, 16).transpose(1, 2)
    expected = (weights @ value).transpose(1, 2).reshape(2, 10, 32)
    torch.testing.assert_close(captured["out"][0], expected[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(captured["out"][1, :7], expected[1, :7], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="output_attentions_max_length=12"):
        model(**model_inputs(cls, length=13), output_attentions=True)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_position_embedding_types(family):
    model_class = NPRFBertModel if family == "bert" else NPRFRobertaModel
    absolute = model_class(tiny_config(family, max_position_embeddings=20)).eval()
    ids = torch.randint(3, 99, (1, 40))
    with pytest.raises(ValueError, match="max_position_embeddings=20") as info:
        absolute(ids)
    assert "nprf-hf convert --max-position-embeddings" in str(info.value)
    none = model_class(tiny_config(family, max_position_embeddings=20, position_embedding_type="none")).eval()
    assert not any("position_embeddings" in key for key in none.state_dict())
    out = none(ids).last_hidden_state
    assert out.shape == (1, 40, 32) and torch.isfinite(out).all()


def test_causal_lm_is_causal_and_generates_with_cache():
    cls = NPRFRobertaForCausalLM
    model = cls(config_for(cls)).eval()
    randomize_rpe(model)
    ids = torch.randint(3, 99, (1, 12), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits
    torch.testing.assert_close(full[:, :6], model(ids[:, :6]).logits, atol=1e-5, rtol=1e-4)
    cached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
    uncached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_self_attention_needs_a_table():
    config = tiny_config()
    attention = NPRFSelfAttention(config, layer_idx=0)
    with pytest.raises(ValueError, match="rpe_table"):
        attention(torch.randn(1, 5, 32))
    out, _ = attention(torch.randn(1, 5, 32), rpe_table=torch.zeros(2, 32))
    assert out.shape == (1, 5, 32)


def test_package_exports():
    for name in nprf_hf.__all__:
        assert hasattr(nprf_hf, name), name


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_logit_scale_starts_at_one_and_trains(family, tmp_path):
    """logit_scale_max > 1 adds a per-head scale s per layer, starting at s = 1 (today's outputs), that
    gradients reach, that stays below the bound, and that saves and reloads."""
    cls = NPRFBertModel if family == "bert" else NPRFRobertaModel
    plain = cls(tiny_config(family)).eval()
    scaled = cls(tiny_config(family, logit_scale_max=8.0)).eval()
    scaled.load_state_dict(plain.state_dict(), strict=False)
    randomize_rpe(plain)
    randomize_rpe(scaled)
    inputs = model_inputs(cls)
    attention = scaled.encoder.layer[1].attention.self
    torch.testing.assert_close(attention.logit_scale(), torch.ones(TINY["num_attention_heads"]))
    torch.testing.assert_close(scaled(**inputs).last_hidden_state, plain(**inputs).last_hidden_state, rtol=1e-5, atol=1e-5)
    scaled(**inputs).last_hidden_state.square().sum().backward()
    assert attention.logit_scale_logit.grad.abs().min() > 0
    with torch.no_grad():
        attention.logit_scale_logit.fill_(50.0)
    assert torch.allclose(attention.logit_scale(), torch.full((TINY["num_attention_heads"],), 8.0))
    sharp = scaled(**inputs, output_attentions=True)
    assert not torch.allclose(sharp.last_hidden_state, plain(**inputs).last_hidden_state, atol=1e-3)
    # the implied attention matrix reflects the scale: larger logits, lower entropy than at s = 1
    soft = plain(**inputs, output_attentions=True).attentions[1]
    entropy = lambda w: -(w * w.clamp_min(1e-30).log()).sum(-1)[0].mean()
    assert entropy(sharp.attentions[1]) < entropy(soft)
    scaled.save_pretrained(tmp_path)
    reloaded = cls.from_pretrained(tmp_path).eval()
    assert torch.equal(reloaded.encoder.layer[1].attention.self.logit_scale_logit, attention.logit_scale_logit)
    torch.testing.assert_close(reloaded(**inputs).last_hidden_state, scaled(**inputs).last_hidden_state)
    assert "logit_scale_logit" not in " ".join(n for n, _ in plain.named_parameters())


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_segment_bias_zero_is_todays_model_and_learns(family, tmp_path):
    """segment_bias=True adds a per-layer, per-head bias for pairs across segments (token_type_ids for
    BERT, the separators for RoBERTa): at 0 it gives today's outputs, gradients reach it, and the
    implied attention matrix moves mass across segments as its sign says."""
    cls = NPRFBertModel if family == "bert" else NPRFRobertaModel
    plain = cls(tiny_config(family)).eval()
    model = cls(tiny_config(family, segment_bias=True)).eval()
    model.load_state_dict(plain.state_dict(), strict=False)
    randomize_rpe(plain)
    randomize_rpe(model)
    input_ids = torch.randint(5, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, 5:] = 1
    if family == "roberta":  # <s> A </s></s> B </s>: segments come from the separators
        input_ids[:, 0], input_ids[:, 4], input_ids[:, 5], input_ids[:, 11] = 0, 2, 2, 2
        token_type_ids = torch.zeros_like(input_ids)
    inputs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": torch.ones_like(input_ids)}
    torch.testing.assert_close(model(**inputs).last_hidden_state, plain(**inputs).last_hidden_state)
    model(**inputs).last_hidden_state.square().sum().backward()
    assert model.encoder.layer[0].attention.self.cross_segment_bias.grad.abs().min() > 0

    def cross_mass(bias):
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.attention.self.cross_segment_bias.fill_(bias)
        weights = model(**inputs, output_attentions=True).attentions[0]  # [B, H, n, n]
        crossing = torch.zeros(12, 12, dtype=torch.bool)
        crossing[:5, 5:] = crossing[5:, :5] = True
        return (weights * crossing).sum(-1).mean().item()

    assert cross_mass(-3.0) < cross_mass(0.0) < cross_mass(3.0)
    model.save_pretrained(tmp_path)
    reloaded = cls.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(reloaded(**inputs).last_hidden_state, model(**inputs).last_hidden_state)
    with pytest.raises(ValueError, match="decoder"):
        tiny_config("roberta", segment_bias=True, is_decoder=True)


def test_token_match_starts_off_learns_and_raises_word_matching():
    """token_match=True adds a per-layer, per-head weight for the same token in the other segment: 0 at
    start (the segment-bias model's outputs), gradients reach it, and a positive weight moves attention
    onto the matching words of the other sentence."""
    plain = NPRFBertModel(tiny_config("bert", segment_bias=True)).eval()
    model = NPRFBertModel(tiny_config("bert", segment_bias=True, token_match=True)).eval()
    model.load_state_dict(plain.state_dict(), strict=False)
    input_ids = torch.randint(5, 9, (2, 12), generator=torch.Generator().manual_seed(0))  # few ids: many matches
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, 6:] = 1
    inputs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": torch.ones_like(input_ids)}
    torch.testing.assert_close(model(**inputs).last_hidden_state, plain(**inputs).last_hidden_state)
    # a loss that LayerNorm does not make constant (the sum of squares of its output is: its gradient is rounding)
    hidden = model(**inputs).last_hidden_state
    (hidden * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert model.encoder.layer[0].attention.self.token_match_weight.grad.abs().min() > 1e-4
    crossing = token_type_ids[:, :, None] != token_type_ids[:, None, :]
    matches = (crossing & (input_ids[:, :, None] == input_ids[:, None, :]))[:, None]

    def match_mass(weight):
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.attention.self.token_match_weight.fill_(weight)
        return (model(**inputs, output_attentions=True).attentions[0] * matches).sum(-1).mean().item()

    assert match_mass(0.0) < match_mass(5.0)
    with pytest.raises(ValueError, match="needs segment_bias=True"):
        tiny_config("bert", token_match=True)


def test_every_config_field_has_its_reason_in_the_config_docstring():
    """The config module explains why each default is what it is: one entry per field of NPRF_FIELDS."""
    from nprf_hf import configuration_nprf
    from nprf_hf.options import NPRF_FIELDS

    documented = set(re.findall(r"^- `(\w+)`", configuration_nprf.__doc__, re.M))
    assert documented == {field.name for field in NPRF_FIELDS}


def test_explain_prints_what_each_layer_ran_and_why(capsys):
    """`nprf_hf.explain(model, inputs)`: per NPRF layer its path and the attention's route with the reason, printed
    and returned; output_attentions takes the weights path; a model without NPRF layers is refused; the router's
    logger is left as it was."""
    import logging

    from transformers import BertConfig, BertModel

    model = NPRFBertModel(NPRFBertConfig(**TINY)).eval()
    ids = torch.randint(3, 99, (2, 10))
    logger = logging.getLogger("nprf_hf.nprf_dispatch")
    level, propagate = logger.level, logger.propagate
    with torch.no_grad():
        lines = nprf_hf.explain(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    layers = [f"encoder.layer.{i}.attention.self" for i in range(TINY["num_hidden_layers"])]
    assert [line.split(":")[0] for line in lines] == [name for name in layers for _ in range(2)]
    assert lines[0].endswith("attention path (nprf_attention)")
    assert "torch dense (autograd): auto: " in lines[1]
    assert capsys.readouterr().out.splitlines() == lines
    weights = nprf_hf.explain(model, {"input_ids": ids, "output_attentions": True}, show=False)
    assert all("weights path (output_attentions" in line for line in weights) and len(weights) == len(layers)
    assert (logger.level, logger.propagate) == (level, propagate) and not logger.handlers
    with pytest.raises(ValueError, match="no NPRF self-attention"):
        nprf_hf.explain(BertModel(BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=16)), ids)
