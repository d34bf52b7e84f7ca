# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""The model families and heads nprf-hf supports: the one place that spells them.

Configs, model classes, Auto registration, conversion, model cards and the example scripts all derive
from `FAMILIES` and `HEADS`. Adding a family whose encoder has BERT's layout is one row of `FAMILIES`;
a family with another attention layout adds one row of `ATTENTION_LAYOUTS` too. No torch import here
(the CLI reads this table to answer `--help` quickly).
"""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Head:
    """A task head: `name` is what `--head` / `head=` take; `suffix` ends every class name of it
    (`BertForMaskedLM`, `NPRFBertForMaskedLM`); `auto_class` and `pipeline_tag` are transformers'."""

    name: str
    suffix: str
    auto_class: str
    pipeline_tag: Optional[str]


HEADS = {
    head.name: head
    for head in (
        Head("model", "Model", "AutoModel", "feature-extraction"),
        Head("masked-lm", "ForMaskedLM", "AutoModelForMaskedLM", "fill-mask"),
        Head("sequence-classification", "ForSequenceClassification", "AutoModelForSequenceClassification", "text-classification"),
        Head("token-classification", "ForTokenClassification", "AutoModelForTokenClassification", "token-classification"),
        Head("question-answering", "ForQuestionAnswering", "AutoModelForQuestionAnswering", "question-answering"),
        Head("multiple-choice", "ForMultipleChoice", "AutoModelForMultipleChoice", "multiple-choice"),
        Head("causal-lm", "ForCausalLM", "AutoModelForCausalLM", "text-generation"),
        # ELECTRA's discriminator (replaced-token detection); BERT's ForPreTraining maps onto masked-lm instead
        Head("pretraining", "ForPreTraining", "AutoModelForPreTraining", None),
    )
}


@dataclass(frozen=True)
class AttentionLayout:
    """Where a family keeps its self-attention, by attribute path (as in the state dict).

    encoder: the base model's layer stack module; layers: the ModuleList in it; self_attention: the
    module in a layer that projects q/k/v; query/key/value: its projections; output: its output
    projection when it applies one itself (DistilBERT), None when the layer applies it (BERT);
    output_projection: the path of that output projection from the layer (attention transfer)."""

    encoder: str
    layers: str
    self_attention: str
    query: str
    key: str
    value: str
    output_projection: str
    output: Optional[str] = None

    @property
    def projections(self):
        """The names of the projections the self-attention module itself holds."""
        return (self.query, self.key, self.value) + ((self.output,) if self.output else ())


ATTENTION_LAYOUTS = {
    "bert": AttentionLayout("encoder", "layer", "attention.self", "query", "key", "value", "attention.output.dense"),
    "distilbert": AttentionLayout(
        "transformer", "layer", "attention", "q_lin", "k_lin", "v_lin", "attention.out_lin", output="out_lin"
    ),
}


@dataclass(frozen=True)
class Family:
    """One model family of transformers that converts to NPRF.

    model_type: the source's `config.model_type`; prefix: transformers' class prefix (`Bert`);
    heads: the `HEADS` the family has in transformers; layout: a key of `ATTENTION_LAYOUTS`;
    position_offset: "padding_idx" when positions start after `pad_token_id` (RoBERTa), else "zero";
    segments: how a sentence pair's segments are told apart for `segment_bias`: "token_type_ids",
    "separators" (tokens after the first `eos_token_id`), or None (refused);
    source_aliases: source class suffixes that convert to another head (`BertForPreTraining` -> masked-lm,
    dropping the tensors listed in `dropped_prefixes`)."""

    model_type: str
    prefix: str
    display_name: str
    heads: tuple
    layout: str = "bert"
    position_offset: str = "zero"
    segments: Optional[str] = "token_type_ids"
    source_aliases: tuple = ()
    dropped_prefixes: tuple = ()
    # (head, class suffix) where transformers names the family's class of a head otherwise (`BertLMHeadModel`)
    class_suffixes: tuple = ()

    @property
    def nprf_model_type(self):
        return "nprf_" + self.model_type.replace("-", "_")

    @property
    def nprf_prefix(self):
        return "NPRF" + self.prefix

    def class_name(self, head, nprf=True):
        """`NPRFBertForMaskedLM` (nprf) or `BertForMaskedLM` for a head name."""
        return (self.nprf_prefix if nprf else self.prefix) + dict(self.class_suffixes).get(head, HEADS[head].suffix)

    def head_of_architecture(self, architecture):
        """The head a source class (`RobertaForCausalLM`, `BertForPreTraining`) converts to, or None."""
        if not architecture.startswith(self.prefix):
            return None
        suffix = architecture[len(self.prefix) :]
        aliases = dict(self.source_aliases)
        if suffix in aliases:
            return aliases[suffix]
        return next((h for h in self.heads if self.class_name(h, nprf=False) == architecture), None)

    def source_architectures(self):
        return [self.class_name(h, nprf=False) for h in self.heads] + [self.prefix + s for s, _ in self.source_aliases]


ENCODER_HEADS = ("model", "masked-lm", "sequence-classification", "token-classification", "question-answering", "multiple-choice")

FAMILIES = {
    family.model_type: family
    for family in (
        Family(
            "bert", "Bert", "BERT", ENCODER_HEADS + ("causal-lm",),
            source_aliases=(("ForPreTraining", "masked-lm"),), class_suffixes=(("causal-lm", "LMHeadModel"),),
            dropped_prefixes=("cls.seq_relationship.", "bert.pooler."),
        ),
        Family("roberta", "Roberta", "RoBERTa", ENCODER_HEADS + ("causal-lm",), position_offset="padding_idx", segments="separators"),
        Family(
            "xlm-roberta", "XLMRoberta", "XLM-RoBERTa", ENCODER_HEADS + ("causal-lm",),
            position_offset="padding_idx", segments="separators",
        ),
        Family("electra", "Electra", "ELECTRA", ENCODER_HEADS + ("causal-lm", "pretraining")),
        Family("distilbert", "DistilBert", "DistilBERT", ENCODER_HEADS, layout="distilbert", segments=None),
    )
}
NPRF_FAMILIES = {family.nprf_model_type: family for family in FAMILIES.values()}


def family_of(model_type):
    """The Family of a source (`bert`) or NPRF (`nprf_bert`) model type; a ValueError naming the supported ones."""
    family = FAMILIES.get(model_type) or NPRF_FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"Unsupported model_type '{model_type}': nprf-hf converts {', '.join(FAMILIES)} checkpoints "
            f"({', '.join(f.display_name for f in FAMILIES.values())}, any head)"
        )
    return family


def position_offset(config):
    """Rows of the absolute position table before the first real position (RoBERTa: padding_idx + 1).
    `config`: a config, or a dict of one (config.json)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    if family_of(get("model_type")).position_offset == "padding_idx":
        pad_token_id = get("pad_token_id")
        return (1 if pad_token_id is None else pad_token_id) + 1
    return 0
