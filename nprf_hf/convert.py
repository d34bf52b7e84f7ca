# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""Conversion of checkpoints of every family of `families.FAMILIES` (BERT, RoBERTa, XLM-RoBERTa, ELECTRA,
DistilBERT) to NPRF attention.

The NPRF models keep every tensor of the source model under the same name and shape (Q/K/V, output
projections, layer norms, embeddings, heads) and add only the relative-position bias table(s) and the
random-feature projection buffers. Converting is therefore: build the NPRF config from the source
config, build the matching NPRF class, copy the source state dict in bit for bit, and initialise
the new tensors (RPE table: zeros, or calibrated from the source model's own softmax attention).

Optionally the absolute position table is extended past its trained length by tiling the learned
rows (RoBERTa's `padding_idx + 1` offset rows stay in place).
"""

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn

from .checkpoint_files import (
    carry_sentence_transformers_files,
    check_output_dir,
    replaced_contents,
    set_max_seq_length,
    staged_output_dir,
    write_conversion_report,
)
from .families import FAMILIES, HEADS, family_of, position_offset
from .hub import check_load_source
# not through functional.py, whose kernels import torch._dynamo (a second): a source that is nowhere is named
# about a second after `nprf_hf.convert_checkpoint(...)` is called in a fresh process
from .nprf_positions import t5_relative_position_bucket
from .options import RPE_INITS, TRANSFER_RECIPE


logger = logging.getLogger(__name__)

# What a user gets from a bare conversion, and what fixes it. No numbers: the ones measured (MiniLM's sentence
# embeddings, benchmarks/transfer.py) would be quoted for every model and head; the results page has them.
NEEDS_TRANSFER_MESSAGE = (
    "converted without attention transfer: the attention changed, so the outputs are not yet the source's (how "
    "far, and how much the transfer wins back, is measured in docs/RESULTS.md#attention-transfer). Fix: nprf-hf "
    "convert SRC OUT --attention-transfer-text FILE (plain text, one text per line; it converts with the exact near "
    "field, attention_variant nprf_near, the recipe measured best), or fine-tune the model on your task."
)
# An encoder made a decoder has no causal attention to copy: attention transfer refuses it.
NEEDS_LANGUAGE_MODELLING_MESSAGE = (
    "converted an encoder to a decoder: its attention is new and now sees only the left context, so it generates "
    "noise until trained as a language model (e.g. examples/run_clm.py); attention transfer does not apply, the "
    "source attends in both directions."
)

@dataclass
class ConversionReport:
    """What a conversion did, tensor by tensor (names are state-dict keys of the converted model)."""

    source_model_type: str
    source_architecture: str
    target_class: str
    copied: list = field(default_factory=list)  # source tensors copied bit for bit
    extended: dict = field(default_factory=dict)  # name -> (old rows, new rows), first rows bit-identical
    new: dict = field(default_factory=dict)  # name -> shape, tensors that did not exist in the source
    dropped: list = field(default_factory=list)  # source tensors the NPRF model has no place for
    rpe_init: str = "zeros"
    transfer: Optional[object] = None  # the TransferReport when attention transfer ran
    long_context: Optional[object] = None  # the LongContextReport when the long-context recipe ran
    # head tensors the source lacked: randomly initialised, the head gives noise until trained
    untrained_head: list = field(default_factory=list)
    tied: dict = field(default_factory=dict)  # name -> the tensor it shares storage with (not new, not saved twice)
    sentence_transformers_files: list = field(default_factory=list)  # carried by convert_checkpoint
    # longest input the absolute position table takes (None: no table); (source's, saved) sentence-transformers
    # max_seq_length when convert_checkpoint carried one: a silent cut of long inputs otherwise
    max_input_length: Optional[int] = None
    max_seq_length: Optional[tuple] = None
    encoder_to_decoder: bool = False  # a causal-lm head on an encoder: causal attention the source never had

    def format(self):
        lines = [
            f"Converted {self.source_architecture} ({self.source_model_type}) -> {self.target_class}",
            f"  copied bit-identically: {len(self.copied)} source tensors",
        ]
        for name, (old, new) in self.extended.items():
            lines.append(f"  extended: {name}  {old} -> {new} rows (first {old} rows bit-identical, rest tiled)")
        lines.append(f"  new tensors ({len(self.new)}), RPE init '{self.rpe_init}':")
        lines.extend(f"    + {name}  {list(shape)}" for name, shape in self.new.items())
        lines.extend(f"  tied: {name} = {other}" for name, other in self.tied.items())
        if self.dropped:
            lines.append(f"  dropped source tensors ({len(self.dropped)}):")
            lines.extend(f"    - {name}" for name in self.dropped)
        if self.sentence_transformers_files:
            lines.append(f"  sentence-transformers files carried over: {', '.join(self.sentence_transformers_files)}")
        if self.max_seq_length is not None and self.max_seq_length[0] != self.max_seq_length[1]:
            lines.append(f"  sentence-transformers max_seq_length {self.max_seq_length[0]} -> {self.max_seq_length[1]} "
                         "(the converted model's position table)")
        if self.max_input_length is not None:
            lines.append(
                f"  takes inputs up to {self.max_input_length} tokens (its position table); for longer ones convert "
                "with --max-position-embeddings N (Python: max_position_embeddings=N), which tiles the learned rows"
            )
        if self.untrained_head:
            lines.append("WARNING: " + untrained_head_message(self))
        if self.transfer is not None:
            lines.append(self.transfer.format())
        if self.long_context is not None:
            lines.append(self.long_context.format())
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Pure tensor helpers
# ----------------------------------------------------------------------------------------------


def extend_position_embeddings(weight: torch.Tensor, new_num_positions: int, offset: int = 0) -> torch.Tensor:
    """Extend an absolute position table `[P, hidden]` to `[new_num_positions, hidden]`.

    Rows `[:offset]` (RoBERTa: `padding_idx + 1` rows that are never real positions) stay in place; the
    learned rows `weight[offset:]` are tiled to fill `new_num_positions - offset` rows. The first `P`
    rows of the result equal `weight` bit for bit.
    """
    num_positions = weight.shape[0]
    if new_num_positions < num_positions:
        raise ValueError(
            f"max_position_embeddings={new_num_positions} is smaller than the source table ({num_positions} rows); "
            "only extension is supported"
        )
    learned = weight[offset:]
    if learned.shape[0] == 0:
        raise ValueError(f"position table has {num_positions} rows, no learned rows after offset {offset}")
    repeats = math.ceil((new_num_positions - offset) / learned.shape[0])
    tiled = learned.repeat(repeats, 1)[: new_num_positions - offset]
    return torch.cat([weight[:offset], tiled], dim=0).contiguous()


def bucket_attention_bias(
    attentions,
    query_mask: torch.Tensor,
    key_mask: torch.Tensor,
    num_buckets: int = 32,
    max_distance: int = 128,
    causal: bool = False,
    floor: float = 1e-6,
) -> torch.Tensor:
    """Per-layer, per-head log attention preference per relative-position bucket.

    attentions: sequence over layers of `[B, H, n, n]` softmax attention (rows sum to 1).
    query_mask, key_mask: `[B, n]` bool, which queries / keys take part (e.g. no padding, no special
    tokens). Rows are renormalised over the kept keys. causal: decoder attention (keys j <= i only,
    unidirectional buckets, as T5's decoder).
    Returns `[L, H, num_buckets]`: `log(mean over the bucket's (query, key) pairs of the pair's attention
    weight relative to uniform over its query's kept keys)`, centred to mean zero over the buckets seen.
    Buckets with no pair (distances longer than the text) take the value of the nearest seen bucket on
    the same side. `floor` bounds that ratio from below.
    """
    n = attentions[0].shape[-1]
    positions = torch.arange(n)
    buckets = t5_relative_position_bucket(
        positions[None, :] - positions[:, None], bidirectional=not causal, num_buckets=num_buckets,
        max_distance=max_distance,
    )  # [n, n], entry (i, j) holds bucket(j - i)
    one_hot = nn.functional.one_hot(buckets, num_buckets).to(torch.float64)  # [n, n, nb]
    pair_mask = query_mask[:, :, None] & key_mask[:, None, :]  # [B, n, n]
    if causal:
        pair_mask = pair_mask & torch.ones(n, n, dtype=torch.bool).tril()
    key_mask = key_mask[:, None, None, :] if not causal else pair_mask[:, None]  # [B, 1, 1 or n, n]
    # Causal row i has i + 1 keys, so its raw weights are larger the shorter the row, and near distances
    # occur mostly in short rows: weighing each row by its key count makes uniform attention flat.
    keys_per_row = key_mask.sum(-1, keepdim=True).to(torch.float64)  # [B, 1, 1 or n, 1]
    pair_mask = pair_mask.to(torch.float64)
    pair_count = torch.einsum("bij,ijk->k", pair_mask, one_hot)  # [nb]
    seen = pair_count > 0
    if not seen.any():
        raise ValueError("calibration text gave no (query, key) pair: is it empty?")
    biases = []
    for attn in attentions:
        attn = attn.detach().to(torch.float64) * key_mask
        attn = attn / attn.sum(-1, keepdim=True).clamp_min(1e-30) * keys_per_row
        attn = attn * query_mask[:, None, :, None]
        mass = torch.einsum("bhij,ijk->hk", attn, one_hot)  # [H, nb]
        mean_ratio = mass / pair_count.clamp_min(1)
        log_weight = mean_ratio.clamp_min(floor).log()
        log_weight = log_weight - log_weight[:, seen].mean(-1, keepdim=True)
        biases.append(_fill_unseen_buckets(log_weight, seen, causal))
    return torch.stack(biases).to(torch.float32)


def _fill_unseen_buckets(values: torch.Tensor, seen: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Fill unseen buckets `[H, nb]` from the nearest seen one on the same side (T5 bidirectional
    buckets: `[0, nb/2)` for key index <= query index, `[nb/2, nb)` after; unidirectional: one side;
    |distance| grows with the index)."""
    values = values.clone()
    nb = values.shape[-1]
    sides = ((0, nb),) if causal else ((0, nb // 2), (nb // 2, nb))
    for start, stop in sides:
        side_seen = [b for b in range(start, stop) if seen[b]]
        for b in range(start, stop):
            if not seen[b]:
                pool = side_seen or [int(i) for i in torch.nonzero(seen)]
                nearest = min(pool, key=lambda s: (abs(s - b), -s))
                values[:, b] = values[:, nearest]
    return values


# ----------------------------------------------------------------------------------------------
# Source loading and class selection
# ----------------------------------------------------------------------------------------------


def _source_family(model_type):
    """The Family of a source checkpoint's model_type (an NPRF checkpoint is not a source)."""
    if model_type not in FAMILIES:
        family_of(model_type)  # names the supported families
        raise ValueError(
            f"Unsupported model_type '{model_type}': the checkpoint is already NPRF; nprf-hf converts "
            f"{', '.join(FAMILIES)} checkpoints (convert its softmax source instead)"
        )
    return FAMILIES[model_type]


def _head_from_architecture(architecture: str, family) -> str:
    head = family.head_of_architecture(architecture)
    if head is None:
        raise ValueError(
            f"Unsupported architecture '{architecture}' for model_type '{family.model_type}'; supported: "
            f"{', '.join(family.source_architectures())} (or pass head= one of {', '.join(family.heads)})"
        )
    return head


def _load_source(model_or_path, tokenizer=None, **from_pretrained_kwargs):
    """Returns (source model, its architecture name, tokenizer or None)."""
    check_load_source(model_or_path, files=False, **from_pretrained_kwargs)  # before transformers: a typo, at once
    import transformers

    if isinstance(model_or_path, nn.Module):
        config = getattr(model_or_path, "config", None)
        if config is None:
            raise ValueError("model_or_path is a torch module without a `.config`: pass a transformers model of a supported family")
        _source_family(config.model_type)
        return model_or_path, type(model_or_path).__name__, tokenizer
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise ValueError(f"model_or_path must be a model, a local directory or a Hub id, got {type(model_or_path)}")
    path = str(model_or_path)
    config = transformers.AutoConfig.from_pretrained(path, **from_pretrained_kwargs)
    family = _source_family(config.model_type)
    architecture = (config.architectures or [family.class_name("model", nprf=False)])[0]
    _head_from_architecture(architecture, family)  # refuse early on unsupported heads
    model = getattr(transformers, architecture).from_pretrained(path, dtype="auto", **from_pretrained_kwargs)
    model.eval()
    if tokenizer is None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, **from_pretrained_kwargs)
        except (OSError, ValueError, TypeError) as error:
            logger.info("no tokenizer loaded from %s (%s)", path, error)
    return model, architecture, tokenizer


def build_nprf_config(source_config, **overrides):
    """NPRF config with every field of the `source_config` (any family), plus `overrides` (NPRF fields
    such as num_random_features, feature_map, rpe_num_buckets, ...). Unknown override names raise."""
    from .configuration_nprf import NPRF_CONFIG_CLASSES

    config_class = NPRF_CONFIG_CLASSES[_source_family(source_config.model_type).model_type]
    reference = config_class()
    unknown = [key for key in overrides if not hasattr(reference, key)]
    if unknown:
        raise ValueError(f"Unknown config field(s) {unknown} for {config_class.__name__}")
    values = source_config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path", "name_or_path"):
        values.pop(key, None)
    # position_embedding_type: the source's "absolute" carries over; v4-only values (relative_key...) are gone in v5
    if values.get("position_embedding_type") not in (None, "absolute", "none"):
        raise ValueError(
            f"position_embedding_type='{values['position_embedding_type']}' of the source is not supported "
            "(allowed: 'absolute', 'none')"
        )
    values.update(overrides)
    return config_class(**values)


# ----------------------------------------------------------------------------------------------
# RPE calibration
# ----------------------------------------------------------------------------------------------


def _rpe_tables(model):
    """The RPE bias parameters of an NPRF model: list of (parameter [H, nb], layer index or None if shared)."""
    base = model.base_model
    shared = base.layer_stack.rpe_table
    if shared is not None:
        return [(shared, None)]
    # none without a relative position bias (`relative_position_bias=False`)
    return [(a.rpe_table, a.layer_idx) for a in base.nprf_attentions() if a.rpe_table is not None]


def _calibration_blocks(tokenizer, text_file, block_size, num_blocks):
    """`[N, block_size]` input ids: the text file's tokens cut into blocks, each wrapped in cls/sep."""
    with open(text_file, encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError("calibration needs a tokenizer with cls and sep tokens")
    body = block_size - 2
    ids = []
    for line in lines:
        ids.extend(tokenizer(line, add_special_tokens=False, truncation=False)["input_ids"])
        if len(ids) >= body * num_blocks:
            break
    blocks = [ids[i : i + body] for i in range(0, len(ids) - body + 1, body)][:num_blocks]
    if not blocks:
        raise ValueError(f"calibration text {text_file} has fewer than {body} tokens")
    return torch.tensor([[tokenizer.cls_token_id] + block + [tokenizer.sep_token_id] for block in blocks])


@torch.no_grad()
def calibrate_rpe(
    source_model, tokenizer, text_file, num_buckets=32, max_distance=128, block_size=128, num_blocks=32, batch_size=8
) -> torch.Tensor:
    """`[L, H, num_buckets]` bucket biases from the softmax attention of `source_model` on `text_file`.

    Special tokens ([CLS]/[SEP], <s>/</s>) are left out as queries and keys, so the biases describe
    how content tokens weigh each other by distance, not the attention sinks.
    """
    base = source_model.base_model
    causal = bool(getattr(base.config, "is_decoder", False))
    max_len = base.config.max_position_embeddings - position_offset(base.config)
    block_size = min(block_size, max_len)
    input_ids = _calibration_blocks(tokenizer, text_file, block_size, num_blocks)
    special = torch.tensor([tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id])
    keep = ~torch.isin(input_ids, special)
    previous_impl, was_training = base.config._attn_implementation, base.training
    base.set_attn_implementation("eager")
    base.eval()
    try:
        chunks = []
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start : start + batch_size].to(base.device)
            out = base(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
            mask = keep[start : start + batch_size]
            bias = bucket_attention_bias(
                [a.float().cpu() for a in out.attentions], mask, mask, num_buckets, max_distance, causal=causal
            )
            chunks.append((bias, ids.shape[0]))
    finally:
        base.set_attn_implementation(previous_impl)
        base.train(was_training)
    # blocks all have the same length, so batches weigh by their size
    total = sum(count for _, count in chunks)
    return sum(bias * count for bias, count in chunks) / total


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------


def with_transfer_recipe(config_overrides):
    """The config fields of a conversion followed by attention transfer: `options.TRANSFER_RECIPE` unless the caller
    chose an attention_variant (then theirs alone), under the caller's own fields."""
    if "attention_variant" in config_overrides:
        return dict(config_overrides)
    return {**TRANSFER_RECIPE, **config_overrides}


def _take_fields(cls, keywords):
    """The dataclass `cls` of its fields found among `convert_to_nprf`'s keywords (removed from `keywords`)."""
    return cls(**{f.name: keywords.pop(f.name) for f in dataclasses.fields(cls) if f.name in keywords})


@dataclass
class RPEInit:
    """How conversion starts the RPE table(s): "zeros", or "calibrated" from the source's attention on
    `calibration_text` (a plain text file), run on `calibration_blocks` blocks of `calibration_block_size` tokens."""

    rpe_init: str = "zeros"
    calibration_text: Optional[str] = None
    calibration_blocks: int = 32
    calibration_block_size: int = 128

    @classmethod
    def take(cls, keywords):
        return _take_fields(cls, keywords)

    def check(self):
        if self.rpe_init not in RPE_INITS:
            raise ValueError(f"rpe_init='{self.rpe_init}' is not supported; allowed: {', '.join(RPE_INITS)}")
        if self.rpe_init == "calibrated" and self.calibration_text is None:
            raise ValueError("rpe_init='calibrated' needs calibration_text (a plain text file)")
        if self.rpe_init == "zeros" and self.calibration_text is not None:
            raise ValueError("calibration_text is only used with rpe_init='calibrated'")

    def initialize(self, target, source, tokenizer):
        """Fill `target`'s RPE table(s): zeros, or the source's calibrated biases (the layers' mean for a shared one)."""
        config = target.config
        if self.rpe_init == "calibrated":
            biases = calibrate_rpe(
                source,
                tokenizer,
                self.calibration_text,
                num_buckets=config.rpe_num_buckets,
                max_distance=config.rpe_max_distance,
                block_size=self.calibration_block_size,
                num_blocks=self.calibration_blocks,
            )  # [L, H, nb]
        with torch.no_grad():
            for param, layer in _rpe_tables(target):
                if self.rpe_init == "zeros":
                    param.zero_()
                    continue
                bias = biases.mean(0) if layer is None else biases[layer]
                param.copy_(bias.to(param.dtype))


@dataclass
class TrainingSteps:
    """What trains a converted model after its conversion, in this order: attention transfer on `transfer_texts`
    (`transfer.attention_transfer`, its options in `transfer_options`), then the long-context recipe on
    `long_context_texts` (`long_context.long_context_distillation`, options in `long_context_options`: it starts
    from attention that already imitates). `device`: where they train (default: where the source is)."""

    transfer_texts: Optional[Sequence] = None
    transfer_options: Optional[dict] = None
    long_context_texts: Optional[Sequence] = None
    long_context_options: Optional[dict] = None
    device: Optional[Union[str, torch.device]] = None

    @classmethod
    def take(cls, keywords):
        return _take_fields(cls, keywords)

    @property
    def trains(self):
        return self.transfer_texts is not None or self.long_context_texts is not None

    def check(self, tokenizer, architecture, changes_direction):
        """Before converting: what these steps need of the conversion (`changes_direction`: an encoder made a
        decoder, or the reverse)."""
        if self.transfer_texts is not None and tokenizer is None:
            raise ValueError("attention transfer needs the source tokenizer: pass tokenizer=")
        if self.long_context_texts is not None and tokenizer is None:
            raise ValueError("the long-context recipe needs the source tokenizer: pass tokenizer=")
        if changes_direction and self.trains:
            raise ValueError(
                f"the source {architecture} attends in both directions and the converted decoder only to the left, "
                "so attention transfer and the long-context recipe have no attention to copy: convert without them "
                "and train the decoder as a language model"
            )
        if self.device is not None and not self.trains:
            raise ValueError("device= sets where attention transfer and the long-context recipe train: pass "
                             "transfer_texts or long_context_texts, or leave device out")

    def run(self, target, source, tokenizer, report):
        """Train `target` (the conversion of `source`) in place; the reports go into `report`."""
        source_device = next(source.parameters()).device
        moved = self.trains and self.device is not None
        if moved:
            source.to(self.device)
            target.to(self.device)
        try:
            if self.transfer_texts is not None:
                from .transfer import attention_transfer

                report.transfer = attention_transfer(target, source, tokenizer, self.transfer_texts,
                                                     **(self.transfer_options or {}))
            if self.long_context_texts is not None:
                from .long_context import long_context_distillation

                report.long_context = long_context_distillation(
                    target, source, tokenizer, self.long_context_texts, **(self.long_context_options or {})
                )
        finally:
            if moved:  # the caller's source stays where it was; the result comes back as loaded
                source.to(source_device)
                target.to(source_device)


def _convert(model_or_path, tokenizer=None, head=None, from_pretrained_kwargs=None, **keywords):
    """(the NPRF model, the tokenizer, the `ConversionReport`) of `convert_to_nprf`'s keywords: the conversion,
    then the training steps (`TrainingSteps`) it was given."""
    rpe, training = RPEInit.take(keywords), TrainingSteps.take(keywords)
    config_overrides = keywords  # what is left: NPRF config fields
    rpe.check()
    if head is not None and head not in HEADS:
        raise ValueError(f"head='{head}' is not supported; allowed: {', '.join(HEADS)}")

    source, architecture, tokenizer = _load_source(model_or_path, tokenizer, **(from_pretrained_kwargs or {}))
    source_config = source.config
    family = FAMILIES[source_config.model_type]
    if head is None:
        head = _head_from_architecture(architecture, family)
    elif head not in family.heads:
        raise ValueError(f"head='{head}' does not exist for {family.display_name}; allowed: {', '.join(family.heads)}")
    if rpe.rpe_init == "calibrated" and config_overrides.get("relative_position_bias") is False:
        raise ValueError("rpe_init='calibrated' fills the relative position bias table: it needs relative_position_bias=True")
    if rpe.rpe_init == "calibrated" and tokenizer is None:
        raise ValueError("rpe_init='calibrated' needs the source tokenizer: pass tokenizer=")
    if head == "causal-lm" and not getattr(source_config, "is_decoder", False):
        # an encoder converted to a causal-LM head only generates as a decoder (causal attention, a cache)
        config_overrides.setdefault("is_decoder", True)
    source_is_decoder = bool(getattr(source_config, "is_decoder", False))
    training.check(tokenizer, architecture, config_overrides.get("is_decoder", source_is_decoder) != source_is_decoder)
    if training.transfer_texts is not None:
        config_overrides = with_transfer_recipe(config_overrides)

    target, report = _build_target(source, architecture, head, rpe.rpe_init, config_overrides)
    rpe.initialize(target, source, tokenizer)
    training.run(target, source, tokenizer, report)
    config = target.config
    if config.position_embedding_type != "none":
        report.max_input_length = config.max_position_embeddings - position_offset(config)
    if tokenizer is not None and "max_position_embeddings" in config_overrides:
        tokenizer.model_max_length = config.max_position_embeddings - position_offset(config)
    return target, tokenizer, report


def _build_target(source, architecture, head, rpe_init, config_overrides):
    """(the NPRF model of `head` holding every tensor of `source`, in eval mode; its `ConversionReport`)."""
    from .modeling_nprf import NPRF_MODEL_CLASSES

    source_config = source.config
    family = FAMILIES[source_config.model_type]
    config = build_nprf_config(source_config, **config_overrides)
    target_class = NPRF_MODEL_CLASSES[source_config.model_type][head]
    target = target_class(config).eval()
    report = ConversionReport(source_config.model_type, architecture, target_class.__name__, rpe_init=rpe_init)
    source_is_decoder = bool(getattr(source_config, "is_decoder", False))
    report.encoder_to_decoder = bool(getattr(config, "is_decoder", False)) and not source_is_decoder
    loaded = _copy_source_tensors(source, target, architecture, family, head, report)
    _mark_tied_and_untrained_head(report, target, loaded, family.class_name(head, nprf=False))
    return target, report


def _copy_source_tensors(source, target, architecture, family, head, report):
    """Load every source tensor into `target` bit for bit (the position table extended when the NPRF config
    has more rows), check the copy, and fill the report's copied / extended / dropped / new. Returns the
    {name: source tensor} loaded."""
    config = target.config
    source_state = source.state_dict()
    # the source may be a different head than the target (head= given): align the base-model prefix
    source_state = _align_prefix(source_state, source, target)
    target_state = target.state_dict()
    position_key = next((k for k in source_state if k.endswith("embeddings.position_embeddings.weight")), None)
    if position_key is not None and position_key in target_state:
        old_rows, new_rows = source_state[position_key].shape[0], target_state[position_key].shape[0]
        if new_rows != old_rows:
            source_state[position_key] = extend_position_embeddings(
                source_state[position_key], new_rows, position_offset(source.config)
            )
            report.extended[position_key] = (old_rows, new_rows)

    source_head = family.head_of_architecture(architecture)
    # tensors of a source alias (BertForPreTraining's next-sentence head) that the NPRF head has no place for
    droppable = family.dropped_prefixes if architecture[len(family.prefix) :] in dict(family.source_aliases) else ()
    to_load = {}
    for name, tensor in source_state.items():
        if name in target_state and target_state[name].shape == tensor.shape:
            to_load[name] = tensor
        elif name in target_state and head == source_head:
            raise ValueError(
                f"{name}: source shape {list(tensor.shape)} != NPRF shape {list(target_state[name].shape)}"
            )
        elif name == position_key and config.position_embedding_type == "none":
            report.dropped.append(name)
        elif name.startswith(droppable) or head != source_head:
            report.dropped.append(name)
        else:
            raise RuntimeError(f"source tensor {name} has no counterpart in {type(target).__name__}")
    target.load_state_dict(to_load, strict=False)
    target.to(source.dtype)  # built in float32, takes the source's dtype

    # the check that the copy is exact (cheap, and catches tying / renaming surprises)
    final_state = target.state_dict()
    for name, tensor in to_load.items():
        if not torch.equal(final_state[name].cpu(), tensor.to(final_state[name].dtype).cpu()):
            raise RuntimeError(f"tensor {name} was not copied exactly")
    report.copied = sorted(name for name in to_load if name not in report.extended)
    report.new = {name: tuple(t.shape) for name, t in final_state.items() if name not in to_load}
    return to_load


def untrained_head_message(report):
    """The warning for a head that the source did not have (e.g. `--head masked-lm` on a bare encoder)."""
    return (
        f"{report.source_architecture} has no weights for the {report.target_class} head: "
        f"{len(report.untrained_head)} tensor(s) ({', '.join(report.untrained_head)}) are randomly initialised "
        "and saved with the checkpoint, so later loads report nothing missing. Train the head before using its "
        "outputs (e.g. fill-mask gives noise), or convert a checkpoint that has this head."
    )


def _mark_tied_and_untrained_head(report, target, to_load, reference_class_name):
    """Split `report.new` into what is really new: tensors sharing storage with another one are tied (e.g.
    `cls.predictions.decoder.weight` is the word embedding table), and tensors of the plain HF class
    `reference_class_name` (e.g. BertForMaskedLM) are head weights the source lacked (randomly initialised)."""
    import transformers

    tensors = dict(target.state_dict(keep_vars=True))
    owners = {}  # storage pointer -> first name, copied tensors first (empty tensors share pointer 0: skipped)
    for name in list(to_load) + list(report.new):
        if tensors[name].numel():
            owners.setdefault(tensors[name].data_ptr(), name)
    for name in list(report.new):
        owner = owners.get(tensors[name].data_ptr(), name) if tensors[name].numel() else name
        if owner != name:
            report.tied[name] = owner
            del report.new[name]
    with torch.device("meta"):
        reference = getattr(transformers, reference_class_name)(target.config)
    standard = set(reference.state_dict())
    report.untrained_head = [name for name in report.new if name in standard]
    if report.untrained_head:
        logger.warning(untrained_head_message(report))


def _align_prefix(source_state, source, target):
    """Rename keys when source and target differ in having the base-model prefix (e.g. a BertModel
    converted to a ForMaskedLM head, or a ForSequenceClassification checkpoint to a base model)."""
    prefix = target.base_model_prefix
    source_has = source is not source.base_model
    target_has = target is not target.base_model
    if source_has == target_has:
        return dict(source_state)
    if target_has:  # base -> head: add prefix
        return {f"{prefix}.{k}": v for k, v in source_state.items()}
    # head -> base: keep only the base model's tensors
    return {k[len(prefix) + 1 :]: v for k, v in source_state.items() if k.startswith(prefix + ".")} | {
        k: v for k, v in source_state.items() if not k.startswith(prefix + ".")
    }


def convert_to_nprf(
    model_or_path: Union[str, os.PathLike, nn.Module],
    *,
    tokenizer=None,
    head: Optional[str] = None,
    rpe_init: str = "zeros",
    calibration_text: Optional[str] = None,
    calibration_blocks: int = 32,
    calibration_block_size: int = 128,
    return_report: bool = False,
    from_pretrained_kwargs: Optional[dict] = None,
    **config_overrides,
):
    """Convert a model of a supported family (in memory, local directory or Hub id) into its NPRF counterpart.

    Every source tensor is copied bit for bit (same names and shapes); the RPE table(s) and random
    projections are new. The head follows the source's class (`config.architectures` for a path),
    or `head=` one of "model", "masked-lm", "sequence-classification", "token-classification",
    "question-answering", "multiple-choice", "causal-lm" (RoBERTa).

    config_overrides: NPRF config fields (num_random_features, feature_map, rpe_num_buckets,
    rpe_max_distance, rpe_shared_across_layers, feature_redraw_interval, attention_algorithm,
    position_embedding_type, max_position_embeddings (tiles the learned position rows), ...).
    rpe_init: "zeros" or "calibrated" (needs `calibration_text`, a plain text file, and a tokenizer:
    loaded from the path, or passed as `tokenizer=` with an in-memory model); calibration runs the
    source on `calibration_blocks` blocks of `calibration_block_size` tokens.
    from_pretrained_kwargs: passed when loading from a path (revision, trust_remote_code, ...).
    Training after the conversion is a separate step (`attention_transfer`, `long_context_distillation` on the
    returned model, as the GLUE scripts do); for compatibility `config_overrides` also takes the fields of
    `TrainingSteps`, run right after the conversion: transfer_texts (strings or sentence pairs, e.g. from
    `read_transfer_texts`) with transfer_options, long_context_texts (long documents, e.g. from `read_long_text`:
    the model learns to embed a whole document like the source's chunk-and-pool) with long_context_options, and
    device (where they train; the model is returned on the source's device).
    Returns the NPRF model in eval mode (and a `ConversionReport` if `return_report`). To save it with its
    tokenizer (for `pipeline`, `AutoTokenizer`, sentence-transformers), use `convert_checkpoint(src, out_dir)`.
    """
    model, _, report = _convert(
        model_or_path, tokenizer=tokenizer, head=head, from_pretrained_kwargs=from_pretrained_kwargs,
        rpe_init=rpe_init, calibration_text=calibration_text, calibration_blocks=calibration_blocks,
        calibration_block_size=calibration_block_size, **config_overrides,
    )
    logger.info(report.format())
    return (model, report) if return_report else model


def convert_checkpoint(src, out_dir, *, tokenizer=None, overwrite: bool = False, **kwargs) -> ConversionReport:
    """Convert `src` (model, local dir or Hub id) and save everything a HF user loads to `out_dir`: the NPRF
    model (safetensors + remote code), the tokenizer (loaded from `src`, or `tokenizer=`), a sentence-transformers
    model's files (`modules.json`, `1_Pooling/`, ...; `max_seq_length` is the position table's length),
    `conversion_report.json` and, after attention transfer, `attention_transfer.json`. The one call to use when
    the output goes to `pipeline(...)`, `AutoTokenizer` or `SentenceTransformer`
    (`convert_to_nprf(...).save_pretrained(dir)` saves the model alone).

    The source is never touched: `out_dir` may not be `src`, lie inside it or contain it; a non-empty `out_dir`
    is refused unless `overwrite=True`; everything is written to a temporary sibling folder that replaces
    `out_dir` only once complete (an error or interruption leaves `out_dir` as it was).
    kwargs as in `convert_to_nprf`. Returns the `ConversionReport`."""
    # before minutes of loading and training: a source that is nowhere, an output that would harm something
    check_load_source(src, files=False, **(kwargs.get("from_pretrained_kwargs") or {}))
    check_output_dir(out_dir, src, overwrite, "overwrite=True")
    replaced = replaced_contents(out_dir) if overwrite else None
    if replaced is not None:
        logger.warning(replaced)
    model, tokenizer, report = _convert(src, tokenizer=tokenizer, **kwargs)
    with staged_output_dir(out_dir, src, overwrite, "overwrite=True") as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _save_extra_files(src, staging, model.config, report, kwargs)
    if report.encoder_to_decoder:
        logger.warning(NEEDS_LANGUAGE_MODELLING_MESSAGE)
    elif report.transfer is None and report.long_context is None:
        logger.warning(NEEDS_TRANSFER_MESSAGE)
    return report


def _save_extra_files(src, out_dir, config, report, kwargs):
    """sentence-transformers files and the report. Their max_seq_length follows the position table: the source's
    value (MiniLM: 256, its training length) would cut long inputs without a word, in a model converted for them."""
    revision = (kwargs.get("from_pretrained_kwargs") or {}).get("revision")
    report.sentence_transformers_files = carry_sentence_transformers_files(src, out_dir, None, revision)
    if report.sentence_transformers_files and report.max_input_length is not None:
        previous = set_max_seq_length(out_dir, report.max_input_length)
        report.max_seq_length = (previous, report.max_input_length)
    write_conversion_report(report, out_dir)
