# coding=utf-8
"""PyTorch NPRF-BERT and NPRF-RoBERTa: BERT / RoBERTa with normalized positive random feature
attention and a T5-bucketed relative positional encoding (Luo et al., NeurIPS 2021).

The HF module chain is subclassed, names and shapes unchanged, so checkpoints map one-to-one:

    NPRF...Model -> NPRFEncoder -> NPRFLayer -> NPRFAttention -> NPRFSelfAttention

The state_dict of an NPRF model is the source BERT / RoBERTa state_dict plus
- `encoder.rpe_table` [H, rpe_num_buckets] (shared across layers, the default), or
  `encoder.layer.{i}.attention.self.rpe_table` per layer (`rpe_shared_across_layers=False`);
- `encoder.layer.{i}.attention.self.projection` [H, m, d], the random projection (persistent buffer).
RoBERTa's encoder modules are verbatim copies of BERT's in transformers, so both families share the
NPRF encoder classes; only embeddings and heads differ.

Design notes:
- Masks. HF builds 4D masks ([B, 1, L, L], bool under sdpa, additive float under eager, None when
  there is no padding). We keep HF's choice of `config._attn_implementation` ("sdpa" by default,
  "eager" accepted; flash / flex are declared unsupported so masks always arrive in one of those
  two forms). The encoder turns a pure padding mask (or padding + causal for `is_decoder`) into a
  key padding mask [B, L] once; any other mask is applied exactly through the dense weights.
- Cross-attention (decoder with `add_cross_attention=True`) is HF's softmax cross-attention,
  unchanged: the paper's RPE has no meaning between two different sequences.
- Attention dropout (`attention_probs_dropout_prob`) is not applied: the fast algorithms never
  build an attention matrix to drop from.
- The RPE table starts at zeros (c_r = 1 for every distance): a converted checkpoint starts as
  plain normalized random-feature attention and learns its positional bias while fine-tuning (or,
  better, during attention transfer: `nprf_hf.transfer`).
- Optional, off by default (each adds a small per-layer parameter of its own):
  `logit_scale_max` > 1 gives `logit_scale_logit` [H] (s = max * sigmoid, starting at s = 1);
  `segment_bias=True` gives `cross_segment_bias` [H] (0 at start), fed with the segment ids that the
  base models derive from token_type_ids (BERT) or the separators (RoBERTa); `token_match=True` gives
  `token_match_weight` [H] (0 at start), fed with the input ids.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

from transformers import initialization as init
from transformers.cache_utils import EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.modeling_utils import PreTrainedModel
from transformers.models.bert.modeling_bert import (
    BertAttention,
    BertCrossAttention,
    BertEmbeddings,
    BertEncoder,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertIntermediate,
    BertLayer,
    BertModel,
    BertOnlyMLMHead,
    BertOutput,
    BertPooler,
    BertPreTrainedModel,
    BertSelfAttention,
    BertSelfOutput,
)
from transformers.models.roberta.modeling_roberta import (
    RobertaClassificationHead,
    RobertaEmbeddings,
    RobertaForCausalLM,
    RobertaForMaskedLM,
    RobertaForMultipleChoice,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaLMHead,
    RobertaModel,
    RobertaPooler,
    RobertaPreTrainedModel,
)
from transformers.utils import logging

from .cache_nprf import NPRFGenerationMixin, default_decoder_cache, find_nprf_cache
from .configuration_nprf import NPRFBertConfig, NPRFRobertaConfig, validate_nprf_fields
from .functional import (
    draw_projection,
    nprf_attention,
    nprf_attention_weights,
    relative_position_bias,
    rpe_band_width,
)


logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------


def _mask_to_bool(attention_mask):
    """A 4D HF mask (bool, True = attend; or additive float, 0 = attend) -> bool, True = attend."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if not attention_mask.is_floating_point():
        return attention_mask != 0
    blocked = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
    if not bool(((attention_mask == 0) | blocked).all()):
        raise ValueError(
            "NPRF attention accepts masks (0 = attend, a very negative value = blocked) but got an additive "
            "attention bias with other values; add such biases to the RPE table instead."
        )
    return ~blocked


def split_attention_mask(attention_mask, query_length, key_length, causal, batch_size=None, num_heads=None):
    """Split an attention mask into what NPRF attention can apply fast and what it cannot.

    Args:
        attention_mask: None, a key padding mask [B, key_length] (True/1 = keep), or a 4D HF mask
            [B, 1 or H, query_length, key_length]; queries are the last `query_length` positions.
        causal: whether the attention is causal (`is_decoder`).
        batch_size, num_heads: when given, the mask's batch size must equal `batch_size` and its
            head dim be 1 or `num_heads` (no silent broadcasting of a mask over the batch).
    Returns:
        (key_padding_mask [B, key_length] bool or None, general_mask bool [B, 1|H, Lq, Lk] or None).
        The general mask is returned only when the 4D mask is not a padding mask (+ the causal
        pattern when `causal`); it must then be applied exactly through the dense weights. Rows of
        padded queries (tokens no query attends to) are not checked: their outputs are never used.
    """
    if attention_mask is None:
        return None, None
    batch = "batch" if batch_size is None else f"batch={batch_size}"
    batch_ok = batch_size is None or attention_mask.shape[0] == batch_size
    if attention_mask.dim() == 2:
        if attention_mask.shape[-1] != key_length or not batch_ok:
            raise ValueError(
                f"2D attention_mask must be [{batch}, key_length={key_length}] (1 = keep), got {tuple(attention_mask.shape)}"
            )
        return attention_mask.bool(), None
    heads = "1" if num_heads is None else f"1 or num_heads={num_heads}"
    if (
        attention_mask.dim() != 4
        or attention_mask.shape[-2:] != (query_length, key_length)
        or not batch_ok
        or attention_mask.shape[1] not in (1, num_heads or 1)
    ):
        raise ValueError(
            f"attention_mask must be [{batch}, key_length={key_length}] or [{batch}, {heads}, "
            f"query_length={query_length}, key_length={key_length}], got {tuple(attention_mask.shape)}"
        )
    keep = _mask_to_bool(attention_mask)
    key_padding_mask = keep.any(dim=2).any(dim=1)  # a key is real if some query may attend to it
    expected = key_padding_mask[:, None, None, :]
    if causal:
        positions = torch.arange(key_length, device=keep.device)
        query_positions = positions[key_length - query_length :]
        expected = expected & (positions[None, :] <= query_positions[:, None])
    padded_queries = ~key_padding_mask[:, None, key_length - query_length :, None]
    if bool(((keep == expected) | padded_queries).all()):
        return key_padding_mask, None
    return None, keep


# ---------------------------------------------------------------------------------------------
# Encoder modules (shared by the BERT and RoBERTa families)
# ---------------------------------------------------------------------------------------------


def projection_generator(seed, layer_idx, draw_index):
    """The torch.Generator of one projection draw: a fixed function of (seed, layer, draw count)."""
    combined = ((seed * 100_003 + layer_idx) * 1_000_000_007 + draw_index) % 2**63
    return torch.Generator(device="cpu").manual_seed(combined)


class NPRFSelfAttention(BertSelfAttention):
    """Self-attention with NPRF attention and a relative position bias.

    `query`, `key`, `value` keep BERT's names and shapes (PEFT / LoRA target them by name).
    Buffers and parameters of its own:
        projection: [H, m, d] persistent buffer, the random projection of the feature map.
        rpe_table: [H, rpe_num_buckets] parameter when `rpe_shared_across_layers=False`, else None
            (the encoder owns the shared table and passes it as `rpe_table=` to forward).
    """

    def __init__(self, config, is_causal=False, layer_idx=None):
        super().__init__(config, is_causal=is_causal, layer_idx=layer_idx)
        self.layer_idx = 0 if layer_idx is None else layer_idx
        self.bidirectional = not is_causal
        with torch.device("cpu"):  # a plain int, also when the model is built on the meta device
            self.band_width = rpe_band_width(config.rpe_num_buckets, config.rpe_max_distance, self.bidirectional)
        self.projection = nn.Buffer(self.draw_projection(0), persistent=True)
        if config.rpe_shared_across_layers:
            self.rpe_table = None
        else:
            self.rpe_table = nn.Parameter(torch.zeros(self.num_attention_heads, config.rpe_num_buckets))
        # s = logit_scale_max * sigmoid(logit_scale_logit): bounded, so the PRF estimate's variance stays bounded
        if config.logit_scale_max > 0:
            self.logit_scale_logit = nn.Parameter(torch.full((self.num_attention_heads,), _unit_scale_logit(config)))
        else:
            self.logit_scale_logit = None
        # beta_h, added to the relative bias of pairs in different segments (0 = distance only)
        if config.segment_bias:
            self.cross_segment_bias = nn.Parameter(torch.zeros(self.num_attention_heads))
        else:
            self.cross_segment_bias = None
        # mu_h >= 0, the weight of the same token in the other segment (0 = no word matching)
        if config.token_match:
            self.token_match_weight = nn.Parameter(torch.zeros(self.num_attention_heads))
        else:
            self.token_match_weight = None

    def logit_scale(self):
        """[H] per-head scale s of the normalized content logits, or None (s = 1, the paper's NPRF)."""
        if self.logit_scale_logit is None:
            return None
        return self.config.logit_scale_max * torch.sigmoid(self.logit_scale_logit.float())

    def draw_projection(self, draw_index):
        """[H, m, d] float32 on CPU, drawn from `projection_generator(projection_seed, layer, draw_index)`."""
        generator = projection_generator(self.config.projection_seed, self.layer_idx, draw_index)
        with torch.device("cpu"):
            return draw_projection(
                self.config.num_random_features,
                self.attention_head_size,
                kind=self.config.feature_map,
                num_heads=self.num_attention_heads,
                generator=generator,
            )

    @torch.no_grad()
    def redraw_projection(self, draw_index):
        self.projection.copy_(self.draw_projection(draw_index))

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        past_key_values=None,
        rpe_table=None,
        segment_ids=None,
        token_ids=None,
        **kwargs,
    ):
        """
        Args:
            hidden_states: [B, Lq, hidden].
            attention_mask: None, [B, Lk] key padding mask, or a 4D HF mask [B, 1, Lq, Lk].
            past_key_values: a Cache (decoder generation); keys/values are then [B, H, Lk, d] with
                Lk >= Lq and the queries are the last Lq positions.
            rpe_table: [H, rpe_num_buckets], the shared table (when this module has none).
            segment_ids: [B, L] segment of every token (`segment_ids_from_inputs`), used with
                `config.segment_bias`; None = one segment.
            token_ids: [B, L] input ids, used with `config.token_match`.
        Returns:
            (attn_output [B, Lq, hidden], attn_weights [B, H, Lq, Lk] or None).
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.value(hidden_states).view(hidden_shape).transpose(1, 2)

        nprf_cache = find_nprf_cache(past_key_values)
        if nprf_cache is not None:
            attn_output = self._recurrent_attention(nprf_cache, query, key, value, attention_mask, rpe_table, kwargs)
            return attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous(), None

        if past_key_values is not None:
            cache = past_key_values
            if isinstance(past_key_values, EncoderDecoderCache):
                cache = past_key_values.self_attention_cache
            key, value = cache.update(key, value, self.layer_idx)

        query_length, key_length = query.shape[2], key.shape[2]
        if query_length != key_length:
            if not self.is_causal:
                raise ValueError("cached keys/values need causal attention (config.is_decoder=True)")
            # Queries are the last positions: give the cached ones zero queries, drop their rows below.
            query = F.pad(query, (0, 0, key_length - query_length, 0))

        table = self.rpe_table if self.rpe_table is not None else rpe_table
        if table is None:
            raise ValueError("rpe_shared_across_layers=True: the encoder must pass its rpe_table to the self-attention")
        rpe_bias = relative_position_bias(
            table, key_length, self.bidirectional, self.config.rpe_num_buckets, self.config.rpe_max_distance
        )
        key_padding_mask, general_mask = split_attention_mask(
            attention_mask, query_length, key_length, self.is_causal, query.shape[0], self.num_attention_heads
        )

        logit_scale = self.logit_scale()
        segments = {}
        if self.cross_segment_bias is not None and segment_ids is not None:
            segments = {"segment_ids": segment_ids, "segment_bias": self.cross_segment_bias}
            if self.token_match_weight is not None and token_ids is not None:
                segments.update(token_ids=token_ids, match_weight=self.token_match_weight.clamp_min(0.0))
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        attn_weights = None
        if output_attentions or general_mask is not None:
            limit = self.config.output_attentions_max_length
            if key_length > limit:
                what = "output_attentions=True" if output_attentions else "an attention mask that is not a padding mask"
                raise ValueError(
                    f"{what} needs the dense {key_length} x {key_length} attention matrix, longer than "
                    f"config.output_attentions_max_length={limit}; raise that limit or use a padding mask / "
                    "output_attentions=False."
                )

        first = key_length - query_length  # rows of the current queries
        if general_mask is None:
            attn_output = nprf_attention(
                query,
                key,
                value,
                rpe_bias,
                self.projection,
                key_padding_mask=key_padding_mask,
                algorithm=self.config.attention_algorithm,
                causal=self.is_causal,
                band_width=self.band_width,
                logit_scale=logit_scale,
                **segments,
            )[:, :, first:]
            if output_attentions:
                attn_weights = nprf_attention_weights(
                    query,
                    key,
                    rpe_bias,
                    self.projection,
                    key_padding_mask=key_padding_mask,
                    causal=self.is_causal,
                    logit_scale=logit_scale,
                    **segments,
                )[:, :, first:]
        else:
            # Exact for any mask: restrict the unmasked weights to the allowed keys and renormalize, in
            # float32 for half inputs (the allowed keys' share of a row can underflow float16).
            compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
            weights = nprf_attention_weights(
                query.to(compute_dtype), key.to(compute_dtype), rpe_bias, self.projection, logit_scale=logit_scale, **segments
            )
            weights = weights[:, :, first:] * general_mask
            total = weights.sum(-1, keepdim=True)
            attn_weights = weights / torch.where(total > 0, total, torch.ones_like(total))
            attn_output = (attn_weights @ value.to(compute_dtype)).to(value.dtype)
            attn_weights = attn_weights.to(value.dtype)

        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return attn_output, (attn_weights if output_attentions else None)

    def _recurrent_attention(self, cache, query, key, value, attention_mask, rpe_table, kwargs):
        """Decoder self-attention through an NPRFCache (`cache_nprf`): constant cost per generated token.
        query / key / value [B, H, Lq, d] of the new tokens -> [B, H, Lq, d]."""
        if not self.is_causal:
            raise ValueError("NPRFCache is for decoder self-attention (config.is_decoder=True)")
        output_attentions = kwargs.get("output_attentions")
        if output_attentions or (output_attentions is None and getattr(self.config, "output_attentions", False)):
            raise ValueError(
                "output_attentions=True needs every past key, which NPRFCache does not keep: generate with "
                "cache_implementation='dynamic' (or use_cache=False) to get attention weights"
            )
        table = self.rpe_table if self.rpe_table is not None else rpe_table
        if table is None:
            raise ValueError("rpe_shared_across_layers=True: the encoder must pass its rpe_table to the self-attention")
        query_length = query.shape[2]
        key_length = cache.get_seq_length(self.layer_idx) + query_length
        key_padding_mask, general_mask = split_attention_mask(
            attention_mask, query_length, key_length, True, query.shape[0], self.num_attention_heads
        )
        if general_mask is not None:
            raise ValueError(
                "NPRFCache applies padding masks (with the causal pattern) only; for another attention mask use "
                "cache_implementation='dynamic' or use_cache=False"
            )
        return cache.attend(
            self.layer_idx,
            query,
            key,
            value,
            key_padding_mask,
            table,
            self.projection,
            self.band_width,
            num_buckets=self.config.rpe_num_buckets,
            max_distance=self.config.rpe_max_distance,
            algorithm=self.config.attention_algorithm,
            logit_scale=self.logit_scale(),
        )


class NPRFAttention(BertAttention):
    """BertAttention with NPRF self-attention (`.self`) and BERT's output block (`.output`)."""

    def __init__(self, config, is_causal=False, layer_idx=None):
        nn.Module.__init__(self)
        self.is_cross_attention = False
        self.self = NPRFSelfAttention(config, is_causal=is_causal, layer_idx=layer_idx)
        self.output = BertSelfOutput(config)


class NPRFLayer(BertLayer):
    """BertLayer with NPRF self-attention; cross-attention (if configured) is HF's softmax one."""

    def __init__(self, config, layer_idx=None):
        nn.Module.__init__(self)
        self.chunk_size_feed_forward = config.chunk_size_feed_forward
        self.seq_len_dim = 1
        self.attention = NPRFAttention(config, is_causal=config.is_decoder, layer_idx=layer_idx)
        self.is_decoder = config.is_decoder
        self.add_cross_attention = config.add_cross_attention
        if self.add_cross_attention:
            if not self.is_decoder:
                raise ValueError(f"{self} should be used as a decoder model if cross attention is added")
            self.crossattention = BertAttention(config, is_causal=False, layer_idx=layer_idx, is_cross_attention=True)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)


class NPRFEncoder(BertEncoder):
    """BertEncoder of NPRF layers. Owns the shared RPE table and the projection redraw counter.

    rpe_table: [H, rpe_num_buckets] parameter (None when `rpe_shared_across_layers=False`).
    redraw_step: non-persistent counter of training forward passes (used when
        `feature_redraw_interval > 0`).
    """

    def __init__(self, config):
        nn.Module.__init__(self)
        validate_nprf_fields(config)
        self.config = config
        self.layer = nn.ModuleList([NPRFLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        if config.rpe_shared_across_layers:
            self.rpe_table = nn.Parameter(torch.zeros(config.num_attention_heads, config.rpe_num_buckets))
        else:
            self.rpe_table = None
        self.redraw_step = nn.Buffer(torch.zeros((), dtype=torch.long), persistent=False)
        self.redraw_suspended = False  # set by generate(): cached features must stay valid

    def maybe_redraw_projections(self):
        """Redraw every layer's projection each `feature_redraw_interval` training forward passes."""
        interval = self.config.feature_redraw_interval
        if not (self.training and interval > 0) or self.redraw_suspended:
            return
        self.redraw_step += 1
        step = int(self.redraw_step)
        if step % interval == 0:
            for layer in self.layer:
                layer.attention.self.redraw_projection(step // interval)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        **kwargs,
    ):
        self.maybe_redraw_projections()
        if attention_mask is not None and attention_mask.dim() == 4:
            # Once for all layers: a padding (+ causal) mask becomes a [B, Lk] key padding mask.
            batch_size, query_length = hidden_states.shape[:2]
            past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
            key_padding_mask, _ = split_attention_mask(
                attention_mask,
                query_length,
                past_length + query_length,
                self.config.is_decoder,
                batch_size,
                self.config.num_attention_heads,
            )
            if key_padding_mask is not None:
                attention_mask = key_padding_mask
        if self.rpe_table is not None:
            kwargs["rpe_table"] = self.rpe_table
        for layer_module in self.layer:
            hidden_states = layer_module(
                hidden_states,
                attention_mask,
                encoder_hidden_states,  # as a positional argument for gradient checkpointing
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
        )


def check_model_attention_mask(attention_mask, batch_size):
    """The self-attention mask a model accepts: a 2D padding mask [B, L] of 0/1 or bool (1 = keep),
    or a prepared 4D mask [B, 1 or H, Lq, Lk]; never broadcast over the batch."""
    if attention_mask.dim() not in (2, 4):
        raise ValueError(
            "attention_mask must be 2D [batch, seq_len] (1 = keep, 0 = padding) or a 4D mask "
            f"[batch, 1, query_len, key_len], got a {attention_mask.dim()}D tensor of shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.shape[0] != batch_size:
        raise ValueError(
            f"attention_mask has batch size {attention_mask.shape[0]} but the input has batch size {batch_size} "
            f"(shape {tuple(attention_mask.shape)}; a mask is not broadcast over the batch)"
        )
    if attention_mask.dim() == 2 and attention_mask.dtype != torch.bool and not torch.compiler.is_compiling():
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError(
                "2D attention_mask must hold only 0/1 or booleans (1 = keep, 0 = padding); got other values "
                "(an additive 0 / -inf mask? pass the tokenizer's 0/1 mask instead)"
            )


def create_nprf_attention_masks(
    model, attention_mask, encoder_attention_mask, embedding_output, encoder_hidden_states, past_key_values
):
    """`_create_attention_masks` of the NPRF models. For the self-attention a 2D padding mask [B, Lk]
    (the tokenizer's) stays a bool key padding mask and None stays None (causality comes from
    `is_decoder`), so no L x L mask is ever built; a 4D mask goes through HF's builders as in BERT.
    The cross-attention mask is HF's, unchanged."""
    if attention_mask is not None:
        check_model_attention_mask(attention_mask, embedding_output.shape[0])
    if attention_mask is not None and attention_mask.dim() != 2:
        return BertModel._create_attention_masks(
            model, attention_mask, encoder_attention_mask, embedding_output, encoder_hidden_states, past_key_values
        )
    if attention_mask is not None:
        attention_mask = attention_mask.bool()
    if encoder_attention_mask is not None:
        encoder_attention_mask = create_bidirectional_mask(
            config=model.config,
            inputs_embeds=embedding_output,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )
    return attention_mask, encoder_attention_mask


def _unit_scale_logit(config):
    """The logit_scale_logit that gives s = 1 (the paper's NPRF) under `logit_scale_max`."""
    return -math.log(config.logit_scale_max - 1.0)


def _init_nprf_weights(module):
    """Initialize what the NPRF modules add (called from `_init_weights`, also after a meta-device build)."""
    if isinstance(module, NPRFSelfAttention):
        init.copy_(module.projection, module.draw_projection(0))
        if module.rpe_table is not None:
            init.zeros_(module.rpe_table)
        if module.logit_scale_logit is not None:
            init.constant_(module.logit_scale_logit, _unit_scale_logit(module.config))
        if module.cross_segment_bias is not None:
            init.zeros_(module.cross_segment_bias)
        if module.token_match_weight is not None:
            init.zeros_(module.token_match_weight)
    elif isinstance(module, NPRFEncoder):
        if module.rpe_table is not None:
            init.zeros_(module.rpe_table)
        init.zeros_(module.redraw_step)


def segment_ids_from_inputs(config, input_ids=None, token_type_ids=None):
    """[B, L] segment of every token for `config.segment_bias`, or None when there is nothing to tell
    apart: token_type_ids when given (BERT); for RoBERTa, whose token types are all 0, the pair layout
    `<s> A </s></s> B </s>`: tokens after the first separator (eos_token_id) are segment 1."""
    if config.model_type == "nprf_roberta" and input_ids is not None:
        separators = (input_ids == config.eos_token_id).long()
        return ((separators.cumsum(-1) - separators) > 0).long()
    return token_type_ids


def _forward_with_segments(model_class):
    """`model_class.forward`, plus the segment ids the self-attention needs under `config.segment_bias`."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        if self.config.segment_bias and kwargs.get("segment_ids") is None:
            kwargs["segment_ids"] = segment_ids_from_inputs(self.config, input_ids, token_type_ids)
        if self.config.token_match and kwargs.get("token_ids") is None:
            kwargs["token_ids"] = input_ids
        use_cache, output_attentions = kwargs.get("use_cache"), kwargs.get("output_attentions")
        if (
            self.config.is_decoder
            and kwargs.get("past_key_values") is None
            and (use_cache or (use_cache is None and self.config.use_cache))
            and not (output_attentions or (output_attentions is None and self.config.output_attentions))
            and (attention_mask is None or attention_mask.dim() == 2)
        ):  # instead of HF's growing key/value cache (which attention weights and general 4D masks need)
            cross_attention = kwargs.get("encoder_hidden_states") is not None
            kwargs["past_key_values"] = default_decoder_cache(self.config, cross_attention)
        return model_class.forward(
            self, input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, **kwargs
        )

    forward.__doc__ = model_class.forward.__doc__
    return forward


def _position_limit_error(length, limit):
    return ValueError(
        f"Input of {length} positions but position_embedding_type='absolute' has max_position_embeddings={limit} "
        "positions. Truncate the input, extend the table with `nprf-hf convert --max-position-embeddings N`, or use "
        "position_embedding_type='none' (relative positions only, any length)."
    )


def check_embedding_ids(embeddings, input_ids=None, token_type_ids=None, position_ids=None):
    """A ValueError naming the field, instead of an embedding's IndexError, for ids out of range.
    Skipped under torch.compile (it reads the ids' range on the host)."""
    if torch.compiler.is_compiling():
        return
    checks = [
        (input_ids, embeddings.word_embeddings, "input_ids", "vocab_size"),
        (token_type_ids, embeddings.token_type_embeddings, "token_type_ids", "type_vocab_size"),
        (position_ids, embeddings.position_embeddings, "position_ids", "max_position_embeddings"),
    ]
    for ids, table, name, field in checks:
        if ids is None or table is None or ids.numel() == 0:
            continue
        limit = table.num_embeddings
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= limit:
            hint = ""
            if name == "position_ids":
                hint = (
                    "; extend the table with `nprf-hf convert --max-position-embeddings N` or use "
                    "position_embedding_type='none' (relative positions only, any length)"
                )
            raise ValueError(f"{name} must lie in [0, {field}={limit}), got values in [{low}, {high}]{hint}")


# ---------------------------------------------------------------------------------------------
# BERT
# ---------------------------------------------------------------------------------------------


class NPRFBertEmbeddings(BertEmbeddings):
    """BertEmbeddings; without the absolute position table when `position_embedding_type="none"`."""

    def __init__(self, config):
        super().__init__(config)
        self.position_embedding_type = config.position_embedding_type
        if config.position_embedding_type == "none":
            self.position_embeddings = None

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_key_values_length=0):
        check_embedding_ids(self, input_ids, token_type_ids, position_ids)
        input_shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        seq_length = input_shape[1]
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros(input_shape, dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                limit = self.position_embeddings.num_embeddings
                if past_key_values_length + seq_length > limit:
                    raise _position_limit_error(past_key_values_length + seq_length, limit)
                position_ids = self.position_ids[:, past_key_values_length : past_key_values_length + seq_length]
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class NPRFPreTrainedMixin:
    """What the BERT and RoBERTa NPRF pre-trained bases share: masks come as HF builds them for sdpa /
    eager (no flash / flex / attention backends), and `_init_weights` also (re)builds the NPRF tensors."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    # The heads' losses are batch means that ignore `num_items_in_batch`: tell the Trainer, or it scales
    # them by the number of processes and skips the division by the accumulation steps.
    accepts_loss_kwargs = False
    _can_record_outputs = {
        "hidden_states": NPRFLayer,
        "attentions": NPRFSelfAttention,
        "cross_attentions": BertCrossAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        _init_nprf_weights(module)


class NPRFBertPreTrainedModel(NPRFPreTrainedMixin, BertPreTrainedModel):
    config: NPRFBertConfig
    config_class = NPRFBertConfig
    base_model_prefix = "bert"
    _no_split_modules = ["NPRFBertEmbeddings", "NPRFLayer"]


class NPRFBertModel(NPRFBertPreTrainedModel, BertModel):
    """BertModel with NPRF attention. Forward: as [`BertModel`]."""

    def __init__(self, config, add_pooling_layer=True):
        PreTrainedModel.__init__(self, config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = NPRFBertEmbeddings(config)
        self.encoder = NPRFEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()

    _create_attention_masks = create_nprf_attention_masks

    forward = _forward_with_segments(BertModel)


class NPRFBertForMaskedLM(NPRFBertPreTrainedModel, BertForMaskedLM):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        if config.is_decoder:
            logger.warning("NPRFBertForMaskedLM wants config.is_decoder=False for bi-directional self-attention.")
        self.bert = NPRFBertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()


class NPRFBertForSequenceClassification(NPRFBertPreTrainedModel, BertForSequenceClassification):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.config = config
        self.bert = NPRFBertModel(config)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class NPRFBertForTokenClassification(NPRFBertPreTrainedModel, BertForTokenClassification):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = NPRFBertModel(config, add_pooling_layer=False)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class NPRFBertForQuestionAnswering(NPRFBertPreTrainedModel, BertForQuestionAnswering):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = NPRFBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class NPRFBertForMultipleChoice(NPRFBertPreTrainedModel, BertForMultipleChoice):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.bert = NPRFBertModel(config)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()


# ---------------------------------------------------------------------------------------------
# RoBERTa
# ---------------------------------------------------------------------------------------------


class NPRFRobertaEmbeddings(RobertaEmbeddings):
    """RobertaEmbeddings (positions from padding_idx + 1); no position table when `position_embedding_type="none"`."""

    def __init__(self, config):
        super().__init__(config)
        self.position_embedding_type = config.position_embedding_type
        if config.position_embedding_type == "none":
            self.position_embeddings = None

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_key_values_length=0):
        check_embedding_ids(self, input_ids, token_type_ids, position_ids)
        input_shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        seq_length = input_shape[1]
        if token_type_ids is None:
            device = input_ids.device if input_ids is not None else inputs_embeds.device
            token_type_ids = torch.zeros(input_shape, dtype=torch.long, device=device)
        if self.position_embeddings is not None and position_ids is None:
            limit = self.position_embeddings.num_embeddings
            if past_key_values_length + seq_length + self.padding_idx + 1 > limit:
                raise _position_limit_error(past_key_values_length + seq_length + self.padding_idx + 1, limit)
            if input_ids is not None:
                position_ids = self.create_position_ids_from_input_ids(input_ids, self.padding_idx, past_key_values_length)
            else:
                position_ids = self.create_position_ids_from_inputs_embeds(inputs_embeds, self.padding_idx)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class NPRFRobertaPreTrainedModel(NPRFPreTrainedMixin, RobertaPreTrainedModel):
    config: NPRFRobertaConfig
    config_class = NPRFRobertaConfig
    base_model_prefix = "roberta"
    _no_split_modules = ["NPRFRobertaEmbeddings", "NPRFLayer"]


class NPRFRobertaModel(NPRFRobertaPreTrainedModel, RobertaModel):
    """RobertaModel with NPRF attention. Forward: as [`RobertaModel`]."""

    def __init__(self, config, add_pooling_layer=True):
        PreTrainedModel.__init__(self, config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = NPRFRobertaEmbeddings(config)
        self.encoder = NPRFEncoder(config)
        self.pooler = RobertaPooler(config) if add_pooling_layer else None
        self.post_init()

    _create_attention_masks = create_nprf_attention_masks
    forward = _forward_with_segments(RobertaModel)


class NPRFRobertaForCausalLM(NPRFGenerationMixin, NPRFRobertaPreTrainedModel, RobertaForCausalLM):
    """Causal LM: with `config.is_decoder=True` the NPRF self-attention is causal (unidirectional buckets).
    generate() decodes with an `NPRFCache` (constant cost and memory per token) unless told otherwise."""

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        if not config.is_decoder:
            logger.warning("If you want to use `NPRFRobertaForCausalLM` as a standalone, add `is_decoder=True.`")
        self.roberta = NPRFRobertaModel(config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)
        self.post_init()


class NPRFRobertaForMaskedLM(NPRFRobertaPreTrainedModel, RobertaForMaskedLM):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        if config.is_decoder:
            logger.warning("NPRFRobertaForMaskedLM wants config.is_decoder=False for bi-directional self-attention.")
        self.roberta = NPRFRobertaModel(config, add_pooling_layer=False)
        self.lm_head = RobertaLMHead(config)
        self.post_init()


class NPRFRobertaForSequenceClassification(NPRFRobertaPreTrainedModel, RobertaForSequenceClassification):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.config = config
        self.roberta = NPRFRobertaModel(config, add_pooling_layer=False)
        self.classifier = RobertaClassificationHead(config)
        self.post_init()


class NPRFRobertaForTokenClassification(NPRFRobertaPreTrainedModel, RobertaForTokenClassification):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.roberta = NPRFRobertaModel(config, add_pooling_layer=False)
        classifier_dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        )
        self.dropout = nn.Dropout(classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class NPRFRobertaForQuestionAnswering(NPRFRobertaPreTrainedModel, RobertaForQuestionAnswering):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.roberta = NPRFRobertaModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class NPRFRobertaForMultipleChoice(NPRFRobertaPreTrainedModel, RobertaForMultipleChoice):
    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.roberta = NPRFRobertaModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()


# ---------------------------------------------------------------------------------------------
# Remote code: save_pretrained copies this file, configuration_nprf.py and functional.py next to
# the weights; the configs carry the full auto_map (configuration_nprf.NPRF_*_AUTO_MAP).
# ---------------------------------------------------------------------------------------------

AUTO_CLASSES = {
    "AutoModel": (NPRFBertModel, NPRFRobertaModel),
    "AutoModelForMaskedLM": (NPRFBertForMaskedLM, NPRFRobertaForMaskedLM),
    "AutoModelForSequenceClassification": (NPRFBertForSequenceClassification, NPRFRobertaForSequenceClassification),
    "AutoModelForTokenClassification": (NPRFBertForTokenClassification, NPRFRobertaForTokenClassification),
    "AutoModelForQuestionAnswering": (NPRFBertForQuestionAnswering, NPRFRobertaForQuestionAnswering),
    "AutoModelForMultipleChoice": (NPRFBertForMultipleChoice, NPRFRobertaForMultipleChoice),
    "AutoModelForCausalLM": (NPRFRobertaForCausalLM,),
}
for _auto_class, _model_classes in AUTO_CLASSES.items():
    for _model_class in _model_classes:
        _model_class.register_for_auto_class(_auto_class)
NPRFBertConfig.register_for_auto_class()
NPRFRobertaConfig.register_for_auto_class()


__all__ = [
    "NPRFBertModel",
    "NPRFBertForMaskedLM",
    "NPRFBertForSequenceClassification",
    "NPRFBertForTokenClassification",
    "NPRFBertForQuestionAnswering",
    "NPRFBertForMultipleChoice",
    "NPRFBertPreTrainedModel",
    "NPRFRobertaModel",
    "NPRFRobertaForMaskedLM",
    "NPRFRobertaForSequenceClassification",
    "NPRFRobertaForTokenClassification",
    "NPRFRobertaForQuestionAnswering",
    "NPRFRobertaForMultipleChoice",
    "NPRFRobertaForCausalLM",
    "NPRFRobertaPreTrainedModel",
]
