# coding=utf-8
"""PyTorch NPRF models: every family of `families.FAMILIES` (BERT, RoBERTa, XLM-RoBERTa, ELECTRA,
DistilBERT) with normalized positive random feature attention and a T5-bucketed relative positional
encoding (Luo et al., NeurIPS 2021).

An NPRF model is its family's transformers model with one module swapped: every layer's
self-attention becomes an [`NPRFSelfAttention`], which adopts the family's own q/k/v (and, for
DistilBERT, output) projections under their own names, so checkpoints map one-to-one. What differs
between families is data (`families.ATTENTION_LAYOUTS`: where the self-attention and its projections
live); the classes of this file are built from that table, one per family and head:

    NPRF<Family><Head>  =  <Family><Head> (transformers)  with its base model  NPRF<Family>Model

The state_dict of an NPRF model is the source's plus
- `<encoder>.rpe_table` [H, rpe_num_buckets] (shared across layers, the default), or
  `<encoder>.layer.{i}.<self-attention>.rpe_table` per layer (`rpe_shared_across_layers=False`);
- `<encoder>.layer.{i}.<self-attention>.projection` [H, m, d], the random projection (persistent buffer);
- the optional per-layer `logit_scale_logit`, `cross_segment_bias`, `token_match_weight` [H].
(`<encoder>` is `encoder` for BERT-layout families, `transformer` for DistilBERT.)

Design notes:
- Masks. The base model's forward turns the attention mask into one of two forms, once per forward:
  a key padding mask [B, 1, 1, Lk] (bool, True = keep; padding, plus causality for a decoder) or a
  general bool mask [B, 1|H, Lq, Lk], applied exactly through the dense weights. Both are 4D, so
  transformers' mask builders pass them through untouched (no L x L mask is built for padding), and
  `_create_attention_masks` keeps None as None.
- Generation: NPRF decoders decode through `cache_nprf.NPRFCache` (the far sums S, z and the last W - 1
  keys: constant cost and memory per token, exact); a growing HF cache still works (zero queries are
  padded in front of the cached positions and their rows dropped).
- Packed sequences. A batch without padding between its sequences (transformers' `DataCollatorWithFlattening`:
  sequences concatenated in a row, `position_ids` starting again at each) is found from the position ids when no
  cache is passed (`PackedSequences`); every layer then attends each sequence alone (one row per sequence inside
  the attention: its own relative positions, far sums and optional terms), and a decoder makes no cache.
- Cross-attention (decoder with `add_cross_attention=True`) is HF's softmax cross-attention,
  unchanged: the paper's RPE has no meaning between two different sequences.
- Attention dropout (`attention_probs_dropout_prob`) is not applied: the fast algorithms never
  build an attention matrix to drop from.
- The RPE table starts at zeros (c_r = 1 for every distance): a converted checkpoint starts as
  plain normalized random-feature attention and learns its positional bias while fine-tuning (or,
  better, during attention transfer: `nprf_hf.transfer`).
- `position_embedding_type="none"` drops the absolute position table: [`NPRFEmbeddings`] replaces the
  family's embeddings (same submodules and names) so that inputs of any length work.
"""

import torch
import transformers
from torch import nn
from torch.nn import functional as F
try:  # (inside try: transformers' remote-code import check then asks for no package beyond torch and itself)
    from typing import Unpack  # Python 3.11+
except ImportError:
    from typing_extensions import Unpack

from transformers import GenerationMixin, PreTrainedConfig
from transformers import initialization as init
from transformers.cache_utils import EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask
from transformers.utils import TransformersKwargs, logging

from .cache_nprf import NPRFGenerationMixin, default_decoder_cache, find_nprf_cache
from .configuration_nprf import NPRF_CONFIG_CLASSES, validate_nprf_fields
from .families import ATTENTION_LAYOUTS, FAMILIES, HEADS, family_of
from .options import NPRF_FIELDS, RECOMPUTE_MODES
from .functional import (
    draw_projection,
    far_bucket_table,
    normalize_attention,
    nprf_attention,
    nprf_attention_weights,
    relative_position_bias,
    rpe_band_width,
)
from .nprf_terms import ATTENTION_TERMS, AttentionTerms
from .nprf_context_parallel import context_parallel_attention, context_parallel_group, shard_position_offset


logger = logging.get_logger(__name__)

# from_pretrained keywords that say where the saved config is (to compare a requested NPRF field with it); not
# trust_remote_code: reading a config dict runs no code, and transformers warns that it is ignored there
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


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
    if not torch.compiler.is_compiling() and not bool(((attention_mask == 0) | blocked).all()):  # a host sync
        raise ValueError(
            "NPRF attention accepts masks (0 = attend, a very negative value = blocked) but got an additive "
            "attention bias with other values; add such biases to the RPE table instead."
        )
    return ~blocked


def normalize_attention_mask(attention_mask, query_length, key_length, causal, num_heads):
    """The mask in the form every NPRF layer reads (see the module docstring), computed once per forward:
    None, a key padding mask [B, 1, 1, Lk] or a general bool mask [B, 1|H, Lq, Lk]."""
    if attention_mask is None:
        return None
    batch_size = attention_mask.shape[0]
    key_padding_mask, general_mask = split_attention_mask(
        attention_mask, query_length, key_length, causal, batch_size, num_heads
    )
    return key_padding_mask[:, None, None, :] if general_mask is None else general_mask


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
    # (the message's text built only for an error: formatting a size would specialize torch.compile's graph on it)
    batch = lambda: "batch" if batch_size is None else f"batch={batch_size}"  # noqa: E731
    batch_ok = batch_size is None or attention_mask.shape[0] == batch_size
    if attention_mask.dim() == 2:
        if attention_mask.shape[-1] != key_length or not batch_ok:
            raise ValueError(
                f"2D attention_mask must be [{batch()}, key_length={key_length}] (1 = keep), got {tuple(attention_mask.shape)}"
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
            f"attention_mask must be [{batch()}, key_length={key_length}] or [{batch()}, {heads}, "
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
# Packed sequences (padding-free batches)
# ---------------------------------------------------------------------------------------------


class PackedSequences:
    """Where the sequences packed into the rows of a padding-free batch lie, and the moves between that layout
    [B, ..., L, ...] and one row per sequence [N, ..., Lmax, ...] (each sequence from slot 0, the rest of its row
    masked as padding): attention run on the unpacked rows is each sequence's attention alone (its own relative
    positions from 0, its own causal order, its own far sums), and nothing crosses a boundary.

    Attributes: `rows` [N] the batch row of each sequence; `slots` [N, Lmax] the flat index (row * L + token) of
    each sequence's tokens, in order; `valid` [N, Lmax] bool; `length` L; `max_length` Lmax."""

    def __init__(self, rows, slots, valid, batch_size, length):
        self.rows, self.slots, self.valid = rows, slots, valid
        self.batch_size, self.length, self.max_length = batch_size, length, valid.shape[-1]

    @classmethod
    @torch.compiler.disable  # reads how many sequences there are and how long on the host (sizes of the unpacked rows)
    def find(cls, position_ids, key_padding_mask, batch_size):
        """The packed sequences of a batch, or None when every row holds one sequence.

        As transformers' `find_packed_sequence_indices`: a sequence starts where the position ids do not go on by
        one, here counted over the real tokens only (`key_padding_mask` [B, L] True = keep, or None), so a padded
        batch (left, right, or with holes, position ids of padding anything) is one sequence per row.
        position_ids: [B or 1, L]."""
        position_ids = position_ids.expand(batch_size, -1)
        length = position_ids.shape[-1]
        real = torch.ones_like(position_ids, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.bool()
        tokens = torch.arange(length, device=position_ids.device).expand_as(position_ids)
        # the index of the previous real token of the row (-1: none)
        previous = torch.cummax(torch.where(real, tokens, -1), dim=-1).values
        previous = F.pad(previous[:, :-1], (1, 0), value=-1)
        previous_position = position_ids.gather(-1, previous.clamp_min(0))
        starts = real & ((previous < 0) | (position_ids != previous_position + 1))
        if not bool((starts.sum(-1) > 1).any()):
            return None
        count = real.long().cumsum(-1) - 1  # real tokens before this one in its row
        rank = count - torch.cummax(torch.where(starts, count, -1), dim=-1).values  # its place in its sequence
        sequence = starts.long().flatten().cumsum(0).view_as(starts) - 1  # its sequence, numbered over the batch
        number, max_length = int(starts.sum()), int(rank[real].max()) + 1
        where = (sequence * max_length + rank)[real]
        slots = position_ids.new_zeros(number * max_length, dtype=torch.long)
        slots[where] = (torch.arange(batch_size, device=tokens.device)[:, None] * length + tokens)[real]
        valid = torch.zeros(number * max_length, dtype=torch.bool, device=tokens.device)
        valid[where] = True
        rows = torch.arange(batch_size, device=tokens.device)[:, None].expand_as(starts)[starts]
        return cls(rows, slots.view(number, max_length), valid.view(number, max_length), batch_size, length)

    def unpack(self, states):
        """[B, H, L, d] -> [N, H, Lmax, d] (zeros in the padding slots: no gradient reaches a token through them)."""
        heads = states.shape[1]
        flat = states.transpose(1, 2).reshape(self.batch_size * self.length, heads, -1)
        unpacked = flat[self.slots] * self.valid[..., None, None].to(flat.dtype)
        return unpacked.transpose(1, 2)

    def unpack_ids(self, ids):
        """[B or 1, L] ids -> [N, Lmax] (0 in the padding slots), or None for None."""
        if ids is None:
            return None
        ids = ids.expand(self.batch_size, -1).reshape(-1)
        return ids[self.slots].masked_fill(~self.valid, 0)

    def pack(self, states):
        """[N, H, Lmax, d] -> [B, H, L, d]; tokens in no sequence (padding) get zeros."""
        heads = states.shape[1]
        flat = states.transpose(1, 2).reshape(-1, heads, states.shape[-1])[self.valid.flatten()]
        packed = flat.new_zeros(self.batch_size * self.length, heads, states.shape[-1])
        packed = packed.index_copy(0, self.slots[self.valid], flat)
        return packed.view(self.batch_size, self.length, heads, -1).transpose(1, 2)

    def pack_weights(self, weights):
        """Attention weights [N, H, Lmax, Lmax] -> [B, H, L, L], zero between different sequences."""
        heads, length = weights.shape[1], self.length
        pairs = self.valid[:, :, None] & self.valid[:, None, :]
        # flat (row, query, key) index of each pair: slots hold row * L + token
        keys = self.slots % length
        index = (self.slots[:, :, None] * length + keys[:, None, :])[pairs]
        flat = weights.permute(0, 2, 3, 1)[pairs]
        packed = flat.new_zeros(self.batch_size * length * length, heads).index_copy(0, index, flat)
        return packed.view(self.batch_size, length, length, heads).permute(0, 3, 1, 2)


# ---------------------------------------------------------------------------------------------
# The NPRF self-attention (every family)
# ---------------------------------------------------------------------------------------------


def projection_generator(seed, layer_idx, draw_index):
    """The torch.Generator of one projection draw: a fixed function of (seed, layer, draw count)."""
    combined = ((seed * 100_003 + layer_idx) * 1_000_000_007 + draw_index) % 2**63
    return torch.Generator(device="cpu").manual_seed(combined)


class NPRFSelfAttention(nn.Module):
    """Self-attention with NPRF attention and a relative position bias, for any family.

    The q/k/v projections (and the output projection where the family's self-attention applies it)
    keep the family's names (`query`/`key`/`value`; DistilBERT's `q_lin`/`k_lin`/`v_lin`/`out_lin`),
    so PEFT / LoRA target them as in the source model; `layout` (a `families.AttentionLayout`) says
    which. Buffers and parameters of its own:
        projection: [H, m, d] persistent buffer, the random projection of the feature map.
        rpe_table: [H, rpe_num_buckets] parameter when `rpe_shared_across_layers=False`, else None
            (the base model owns the shared table and passes it as `rpe_table=` to forward).
        logit_scale_logit, cross_segment_bias, token_match_weight: [H], when configured.
    """

    def __init__(self, config, is_causal=False, layer_idx=None, layout=None, projections=None):
        """projections: the family's projection modules by name (adopted, not copied); None builds
        fresh ones (hidden -> hidden)."""
        super().__init__()
        self.config = config
        self.layout = ATTENTION_LAYOUTS["bert"] if layout is None else layout
        if config.hidden_size % config.num_attention_heads != 0:  # checked by the model, as HF's attentions do
            raise ValueError(
                f"hidden_size ({config.hidden_size}) must be a multiple of num_attention_heads "
                f"({config.num_attention_heads})"
            )
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        if projections is None:
            projections = {name: nn.Linear(config.hidden_size, config.hidden_size) for name in self.layout.projections}
        for name in self.layout.projections:
            self.add_module(name, projections[name])
        self.is_causal = is_causal
        self.layer_idx = 0 if layer_idx is None else layer_idx
        self.bidirectional = not is_causal
        with torch.device("cpu"):  # a plain int, also when the model is built on the meta device
            self.band_width = rpe_band_width(config.rpe_num_buckets, config.rpe_max_distance, self.bidirectional)
        self.projection = nn.Buffer(self.draw_projection(0), persistent=True)
        if config.rpe_shared_across_layers or not config.relative_position_bias:
            self.rpe_table = None
        else:
            self.rpe_table = nn.Parameter(torch.zeros(self.num_attention_heads, config.rpe_num_buckets))
        # the optional terms' per-head parameters (`nprf_terms`), None where their config field is off
        for term in ATTENTION_TERMS:
            value = term.initial_value(config) if term.enabled(config) else None
            parameter = None if value is None else nn.Parameter(torch.full((self.num_attention_heads,), value))
            setattr(self, term.parameter, parameter)
        # a bound on the segment ids, which torch.compile cannot read from them (`nprf_attention`): the token
        # types, or the separator rule's 0 / 1
        separators = family_of(config.model_type).segments == "separators"
        self.num_segments = 2 if separators else getattr(config, "type_vocab_size", None)

    @classmethod
    def adopt(cls, module, config, layout, layer_idx):
        """The NPRF self-attention that takes over the projections of a family's softmax `module`."""
        projections = {name: getattr(module, name) for name in layout.projections}
        return cls(config, bool(getattr(config, "is_decoder", False)), layer_idx, layout, projections)

    def bucket_table(self, rpe_table=None):
        """[H, rpe_num_buckets]: this layer's own table, else the shared one the base model passes, with the
        farthest buckets fixed at `rpe_far_bias` when set."""
        if not self.config.relative_position_bias:  # b = 0: nothing to learn, and every algorithm still applies
            table = self.projection.new_zeros(self.num_attention_heads, self.config.rpe_num_buckets)
        else:
            table = self.rpe_table if self.rpe_table is not None else rpe_table
        if table is None:
            raise ValueError("rpe_shared_across_layers=True: the encoder must pass its rpe_table to the self-attention")
        return far_bucket_table(table, self.config.rpe_far_bias, self.bidirectional)

    def logit_scale(self):
        """[H] per-head scale s of the normalized content logits, or None (s = 1, the paper's NPRF)."""
        return self.attention_terms().logit_scale

    @property
    def near_field_width(self):
        """W of the exact near field (attention_variant "nprf_near"): config.near_field_width, 0 meaning the RPE band."""
        return self.config.near_field_width or self.band_width

    def attention_terms(self, segment_ids=None, token_ids=None):
        """This layer's optional terms for one forward (`nprf_terms.AttentionTerms`), from its parameters and
        the inputs the base model derives once per forward (`term_inputs`)."""
        inputs = {"segment_ids": segment_ids, "token_ids": token_ids}
        return AttentionTerms(*(term.of_layer(self, inputs) for term in ATTENTION_TERMS))

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

    def mask_forms(self, attention_mask, query_length, key_length, batch_size):
        """(key padding mask [B, Lk] or None, general bool mask [B, 1|H, Lq, Lk] or None). The base model
        hands over a key padding mask as [B, 1, 1, Lk] bool (`normalize_attention_mask`), taken as it is;
        any other mask (a 2D mask or an HF 4D mask from a direct call) goes through `split_attention_mask`."""
        if (
            attention_mask is not None
            and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4
            and attention_mask.shape[0] == batch_size
            and attention_mask.shape[1:3] == (1, 1)
            and attention_mask.shape[-1] == key_length
        ):
            return attention_mask[:, 0, 0, :], None
        return split_attention_mask(
            attention_mask, query_length, key_length, self.is_causal, batch_size, self.num_attention_heads
        )

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        past_key_values=None,
        rpe_table=None,
        segment_ids=None,
        token_ids=None,
        rpe_bias=None,
        packed_sequences=None,
        **kwargs,
    ):
        """
        Args:
            hidden_states: [B, Lq, hidden].
            attention_mask: None, a normalized 4D bool mask (see `mask_forms`), a [B, Lk] key padding
                mask, or a 4D HF mask [B, 1, Lq, Lk].
            past_key_values: a Cache (decoder generation); keys/values are then [B, H, Lk, d] with
                Lk >= Lq and the queries are the last Lq positions.
            rpe_table: [H, rpe_num_buckets], the shared table (when this module has none).
            segment_ids: [B, L] segment of every token (`segment_ids_from_inputs`), used with
                `config.segment_bias`; None = one segment.
            token_ids: [B, L] input ids, used with `config.token_match`.
            rpe_bias: [H, 2 Lk - 1], the shared table's relative bias, computed once per forward by the base
                model (layers with a table of their own ignore it).
            packed_sequences: a `PackedSequences` (a padding-free batch, found by the base model from the
                position ids): each sequence attends within itself only, as alone; `attention_mask` is then
                ignored (the padding is in it), `segment_ids` / `token_ids` are in its unpacked layout [N, Lmax]
                and `rpe_bias` is [H, 2 Lmax - 1].
        Returns:
            (attn_output [B, Lq, hidden], attn_weights [B, H, Lq, Lk] or None).
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        layout = self.layout
        query = getattr(self, layout.query)(hidden_states).view(hidden_shape).transpose(1, 2)
        key = getattr(self, layout.key)(hidden_states).view(hidden_shape).transpose(1, 2)
        value = getattr(self, layout.value)(hidden_states).view(hidden_shape).transpose(1, 2)

        nprf_cache = find_nprf_cache(past_key_values)
        if nprf_cache is not None:
            attn_output, attn_weights = self._recurrent_attention(
                nprf_cache, query, key, value, attention_mask, rpe_table, kwargs
            )
            attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
            if layout.output is not None:
                attn_output = getattr(self, layout.output)(attn_output)
            return attn_output, attn_weights

        if packed_sequences is not None:
            if past_key_values is not None:
                raise ValueError(
                    "packed sequences (position ids starting again within a row) cannot be cached: use_cache=False"
                )
            # one row per sequence: from here on the attention of a padded batch, packed back at the end
            query, key, value = (packed_sequences.unpack(states) for states in (query, key, value))
            attention_mask = packed_sequences.valid

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

        if self.rpe_table is not None or rpe_bias is None or rpe_bias.shape[-1] != 2 * key_length - 1:
            table = self.bucket_table(rpe_table)
            rpe_bias = relative_position_bias(
                table, key_length, self.bidirectional, self.config.rpe_num_buckets, self.config.rpe_max_distance
            )
        key_padding_mask, general_mask = self.mask_forms(attention_mask, query_length, key_length, query.shape[0])

        terms = self.attention_terms(segment_ids, token_ids)
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
        sharded = context_parallel_group()  # inside `context_parallel`: this rank holds a shard of the sequence
        if sharded is not None:
            if output_attentions or general_mask is not None or first or packed_sequences is not None:
                raise ValueError("context_parallel takes padding masks only, without output_attentions, a cache or "
                                 "packed sequences")
            # the bias of r = -W .. W (the ends stand for every farther distance): the shard's own may reach less far
            band_bias = relative_position_bias(self.bucket_table(rpe_table), self.band_width + 1, self.bidirectional,
                                               self.config.rpe_num_buckets, self.config.rpe_max_distance)
            attn_output = context_parallel_attention(
                query, key, value, band_bias, self.projection, self.band_width, key_padding_mask, self.is_causal,
                self.config.attention_variant, terms, group=sharded,
                recompute=RECOMPUTE_MODES[self.config.attention_recompute],
            )
        elif general_mask is None and output_attentions:
            # The output is computed from the returned weights, so they are part of the graph (attribution
            # through `attentions[i].retain_grad()` works); dense, hence the length limit above.
            attn_weights = nprf_attention_weights(
                query,
                key,
                rpe_bias,
                self.projection,
                key_padding_mask=key_padding_mask,
                causal=self.is_causal,
                variant=self.config.attention_variant,
                terms=terms,
                near_field_width=self.near_field_width,
            )[:, :, first:]
            attn_output = (attn_weights.to(value.dtype) @ value).to(value.dtype)
        elif general_mask is None:
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
                recompute=RECOMPUTE_MODES[self.config.attention_recompute],
                variant=self.config.attention_variant,
                terms=terms,
                near_field_width=self.near_field_width,
            )[:, :, first:]
        else:
            # Exact for any mask: restrict the unmasked weights to the allowed keys and renormalize, in
            # float32 for half inputs (the allowed keys' share of a row can underflow float16).
            compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
            weights = nprf_attention_weights(
                query.to(compute_dtype), key.to(compute_dtype), rpe_bias, self.projection,
                variant=self.config.attention_variant, terms=terms, near_field_width=self.near_field_width,
            )
            weights = weights[:, :, first:] * general_mask
            attn_weights = normalize_attention(weights, weights.sum(-1, keepdim=True))
            attn_output = (attn_weights @ value.to(compute_dtype)).to(value.dtype)
            attn_weights = attn_weights.to(value.dtype)

        if packed_sequences is not None:
            attn_output = packed_sequences.pack(attn_output)
            if attn_weights is not None:
                attn_weights = packed_sequences.pack_weights(attn_weights)
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        if layout.output is not None:
            attn_output = getattr(self, layout.output)(attn_output)
        return attn_output, (attn_weights if output_attentions else None)


    def _recurrent_attention(self, cache, query, key, value, attention_mask, rpe_table, kwargs):
        """Decoder self-attention through an NPRFCache (`cache_nprf`): constant cost per generated token.
        query / key / value [B, H, Lq, d] of the new tokens -> ([B, H, Lq, d], the weights [B, H, Lq, Lk] with
        output_attentions, from an NPRFStaticCache that keeps the keys, or None)."""
        if not self.is_causal:
            raise ValueError("NPRFCache is for decoder self-attention (config.is_decoder=True)")
        if context_parallel_group() is not None:  # the cache holds one process's whole sequence
            raise ValueError("context_parallel: run decoders with use_cache=False (NPRFCache decodes on one process)")
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        table = self.bucket_table(rpe_table)
        query_length = query.shape[2]
        if attention_mask is None or attention_mask.dim() == 2:
            key_padding_mask = attention_mask
        elif attention_mask.dtype == torch.bool and attention_mask.shape[1:3] == (1, 1):
            # the base model's key padding form, [B, past + L] or [B, L]: the cache checks which (its length may be
            # a tensor, NPRFStaticCache, which a compiled step must not compare on the host)
            key_padding_mask = attention_mask[:, 0, 0, :]
        else:
            key_length = int(cache.get_seq_length(self.layer_idx)) + query_length
            key_padding_mask, general_mask = self.mask_forms(attention_mask, query_length, key_length, query.shape[0])
            if general_mask is not None:
                raise ValueError(
                    "NPRFCache applies padding masks (with the causal pattern) only; for another attention mask use "
                    "cache_implementation='dynamic' or use_cache=False"
                )
        result = cache.attend(
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
            variant=self.config.attention_variant,
            terms=self.attention_terms(),
            output_attentions=bool(output_attentions),
        )
        return result if output_attentions else (result, None)


# ---------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------


class NPRFEmbeddings(nn.Module):
    """The family's embeddings, same submodules and names (`word_embeddings`, `token_type_embeddings`
    where the family has token types, `position_embeddings` unless `position_embedding_type="none"`,
    `LayerNorm`, `dropout`), with one forward for every family: positions count from 0 (BERT) or
    from `padding_idx + 1` over non-padding tokens (RoBERTa), and inputs of any length without a
    position table. Out-of-range ids raise a ValueError naming the field."""

    def __init__(self, config, family, embeddings):
        super().__init__()
        self.word_embeddings = embeddings.word_embeddings
        self.token_type_embeddings = getattr(embeddings, "token_type_embeddings", None)
        self.position_embeddings = None
        if config.position_embedding_type == "absolute":
            self.position_embeddings = embeddings.position_embeddings
        self.LayerNorm = embeddings.LayerNorm
        self.dropout = embeddings.dropout
        self.padding_idx = config.pad_token_id if family.position_offset == "padding_idx" else None
        if isinstance(getattr(embeddings, "position_ids", None), torch.Tensor):  # HF's arange buffer, for code reading it
            self.position_ids = nn.Buffer(embeddings.position_ids, persistent=False)

    def make_position_ids(self, input_ids, inputs_embeds, past_key_values_length):
        """[B or 1, L] position of every token."""
        reference = input_ids if input_ids is not None else inputs_embeds
        device, length = reference.device, reference.shape[1]
        # a shard of a sequence sharded over ranks (`context_parallel`) counts on from the shards before it
        past_key_values_length = past_key_values_length + shard_position_offset(input_ids, length, self.padding_idx, device)
        # past_key_values_length: an int, or a 0-d tensor (NPRFStaticCache) added without reading it on the host
        if self.padding_idx is None:
            return (torch.arange(length, device=device) + past_key_values_length)[None]
        if input_ids is None:  # every token is real
            return (torch.arange(length, device=device) + (self.padding_idx + 1) + past_key_values_length)[None]
        real = input_ids.ne(self.padding_idx).long()
        return (torch.cumsum(real, dim=1) + past_key_values_length) * real + self.padding_idx

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_key_values_length=0):
        check_embedding_ids(self, input_ids, token_type_ids, position_ids)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        embeddings = inputs_embeds
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = self.make_position_ids(input_ids, inputs_embeds, past_key_values_length)
                if not torch.compiler.is_compiling() and position_ids.numel():  # reads the ids on the host
                    last, limit = int(position_ids.max()), self.position_embeddings.num_embeddings
                    if last >= limit:
                        raise _position_limit_error(last + 1, limit)
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class NPRFDistilBertEmbeddings(NPRFEmbeddings):
    """DistilBERT calls its embeddings as (input_ids, inputs_embeds, position_ids)."""

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None):
        return super().forward(input_ids=input_ids, position_ids=position_ids, inputs_embeds=inputs_embeds)


# layout -> the embeddings class that replaces the family's
EMBEDDINGS_CLASSES = {"bert": NPRFEmbeddings, "distilbert": NPRFDistilBertEmbeddings}


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


# ---------------------------------------------------------------------------------------------
# Model classes, built per family from `families.FAMILIES`
# ---------------------------------------------------------------------------------------------


def set_attention_variant(model, variant, num_random_features=None, projection_seed=None, feature_map=None):
    """Switch every NPRF self-attention of `model` to `variant` (one of `options.ATTENTION_VARIANTS`), in place,
    without touching a trained weight: only the random projection is drawn again (from the new
    `num_random_features` / `projection_seed` / `feature_map`, where given). The paper's Figure 2: train with the
    exact kernel ("normalized_softmax"), then estimate it with "nprf". Returns the model."""
    config = model.config
    updates = {"attention_variant": variant, "num_random_features": num_random_features,
               "projection_seed": projection_seed, "feature_map": feature_map}
    updates = {name: value for name, value in updates.items() if value is not None}
    previous = {name: getattr(config, name) for name in updates}
    for name, value in updates.items():
        setattr(config, name, value)
    try:
        validate_nprf_fields(config)
    except ValueError:
        for name, value in previous.items():
            setattr(config, name, value)
        raise
    for module in model.modules():
        if isinstance(module, NPRFSelfAttention):
            module.config = config
            old = module.projection
            module.projection = module.draw_projection(0).to(device=old.device, dtype=old.dtype)
    return model


def segment_ids_from_inputs(config, input_ids=None, token_type_ids=None):
    """[B, L] segment of every token for `config.segment_bias`, or None when there is nothing to tell
    apart: token_type_ids (BERT, ELECTRA); for RoBERTa-style families, whose token types are all 0,
    the pair layout `<s> A </s></s> B </s>`: tokens after the first separator (eos_token_id) are segment 1."""
    if family_of(config.model_type).segments == "separators" and input_ids is not None:
        separators = (input_ids == config.eos_token_id).long()
        return ((separators.cumsum(-1) - separators) > 0).long()
    return token_type_ids


def term_inputs(config, input_ids=None, token_type_ids=None, segment_ids=None, token_ids=None):
    """{"segment_ids", "token_ids"}: what the optional terms (`NPRFSelfAttention.attention_terms`) read from the
    inputs, derived once per forward where the config asks for them (explicit ids are kept); the base model and
    attention transfer both call this."""
    if config.segment_bias and segment_ids is None:
        segment_ids = segment_ids_from_inputs(config, input_ids, token_type_ids)
    if config.token_match and token_ids is None:
        token_ids = input_ids
    return {"segment_ids": segment_ids, "token_ids": token_ids}


class NPRFPreTrainedMixin:
    """What every NPRF pre-trained base adds to its family's: masks come as the NPRF base model builds
    them (no flash / flex / attention backends), and `_init_weights` also (re)builds the NPRF tensors."""

    # The self-attention is NPRF attention whatever `attn_implementation` says: flash / flex attention kernels and
    # transformers' table of attention functions (`_supports_attention_backend`: what vLLM / TGI replace with their
    # softmax kernels) compute softmax attention, which would silently stand in for it. Padding-free batches (packed
    # sequences, which transformers' tests read from `_supports_attention_backend`) the base model handles itself.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    # The heads' losses are batch means that ignore `num_items_in_batch`: tell the Trainer, or it scales
    # them by the number of processes and skips the division by the accumulation steps.
    accepts_loss_kwargs = False
    # transformers guesses from this file's source whether `set_attn_implementation` is safe; it is: the
    # NPRF self-attention reads no implementation, HF's cross-attention and mask builders follow it
    _can_set_attn_implementation_cached_value = True
    # torch.compile(model, fullgraph=True) traces forward and backward without a graph break for every
    # attention algorithm (tests/test_compile.py). Not with what must read tensors on the host: a general 4D
    # attention mask (told apart from a padding mask by its values), `feature_redraw_interval > 0` in training,
    # `position_ids` without a cache (packed sequences are found from them on the host: `PackedSequences.find`).
    # generate() compiles its decode step with a compileable cache: `cache_implementation="static"` (NPRFStaticCache).
    _can_compile_fullgraph = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """As transformers' `from_pretrained`, with two user mistakes named instead of failing obscurely or
        passing silently: a config field the weights depend on (`saved_with_weights` in `NPRF_FIELDS`, e.g.
        `num_random_features`: the projection is saved with the model) set to another value than the saved
        one, and `attn_implementation` (the self-attention is NPRF whatever it says)."""
        requested = dict(kwargs)
        config = kwargs.get("config")
        if isinstance(config, PreTrainedConfig):
            requested.update({f.name: getattr(config, f.name) for f in NPRF_FIELDS if hasattr(config, f.name)})
        asked = [f.name for f in NPRF_FIELDS if f.saved_with_weights and f.name in requested]
        if asked and pretrained_model_name_or_path is not None:
            hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            saved, _ = PreTrainedConfig.get_config_dict(pretrained_model_name_or_path, **hub_kwargs)
            # a softmax checkpoint loaded into an NPRF class has no NPRF tensors yet: every value is free then
            nprf = str(saved.get("model_type", "")).startswith("nprf_")
            changed = [name for name in asked if nprf and name in saved and requested[name] != saved[name]]
            if changed:
                values = ", ".join(f"{name}={requested[name]!r} (saved: {saved[name]!r})" for name in changed)
                flags = " ".join(f"--{name.replace('_', '-')} {requested[name]}" for name in changed)
                raise ValueError(
                    f"{values}: the model's weights were made with the saved value (e.g. the random projection and "
                    "the RPE table are saved with them), so it cannot change at load; load without it, or convert "
                    f"the softmax source again with the new value (`nprf-hf convert SRC OUT {flags}`)"
                )
        # AutoModel hands a requested implementation over inside the config, a direct call as a keyword
        implementation = kwargs.get("attn_implementation") or getattr(config, "_attn_implementation_internal", None)
        if implementation in ("eager", "sdpa"):  # others: transformers' own check names them unsupported
            logger.warning(
                "attn_implementation=%r only picks how masks (and decoder cross-attention, if any) are built: the "
                "self-attention of NPRF models is always NPRF attention.", implementation
            )
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, NPRFSelfAttention):
            init.copy_(module.projection, module.draw_projection(0))
            if module.rpe_table is not None:
                init.zeros_(module.rpe_table)
            for term in ATTENTION_TERMS:
                if getattr(module, term.parameter) is not None:
                    init.constant_(getattr(module, term.parameter), term.initial_value(module.config))
        elif isinstance(module, NPRFEmbeddings) and hasattr(module, "position_ids"):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
        elif isinstance(getattr(module, "redraw_step", None), torch.Tensor):  # the encoder of an NPRF base model
            if module.rpe_table is not None:
                init.zeros_(module.rpe_table)
            init.zeros_(module.redraw_step)


class NPRFModelMixin:
    """The base model of an NPRF family: the family's model with NPRF self-attention in every layer.

    The layer stack (`encoder` / `transformer`) gains the shared `rpe_table` [H, rpe_num_buckets]
    (None when `rpe_shared_across_layers=False`) and `redraw_step`, a non-persistent counter of
    training forward passes (used when `feature_redraw_interval > 0`). Forward: as the family's model.
    Each family's class (`NPRFBertModel`, ... at the end of this file) spells its forward's parameters and hands
    them to `_nprf_forward`.
    """

    family = None  # set per class

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)  # the family's transformers model, as transformers builds it
        self._nprf_layers()

    @classmethod
    def adopt(cls, model):
        """Make `model`, an instance of the family's transformers model (`BertModel`) as a transformers head's
        `__init__` builds it, an instance of `cls` in place, and return it: the same object, submodules and
        tensors (so the head's state_dict keys and weight tying stay), every layer's self-attention made NPRF
        as `__init__` does. The NPRF heads' `__init__` call it: transformers' own head `__init__` builds the base
        model with its own arguments (`add_pooling_layer=False`, ...), then it becomes NPRF; nothing of
        transformers is rebound or patched. Making it NPRF draws no global random numbers, so a seeded head gets
        the weights it got when its base model was built as `cls` directly."""
        family_model = cls.__bases__[-1]  # transformers' model of the family: the last base of every NPRF base model
        if type(model) is not family_model:
            raise TypeError(f"{cls.__name__}.adopt takes a {family_model.__name__}, not a {type(model).__name__}")
        model.__class__ = cls
        # settings that post_init copied from the transformers class onto the instance (`_no_split_modules`,
        # the parallel plans, ...): dropped, so that post_init (in `_nprf_layers`) takes them from `cls`
        for name in [name for name in vars(model) if hasattr(cls, name)]:
            delattr(model, name)
        try:  # which modules' outputs `output_attentions` / `output_hidden_states` capture: transformers records it
            # per class in PreTrainedModel.__init__ (which ran for the transformers class): record cls's
            from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
        except ImportError:  # transformers versions that read `_can_record_outputs` from the model itself
            pass
        else:  # keyed by str(class): a `_CanRecordRegistry` takes the model (5.2x), a plain dict the key itself
            key = str(cls) if type(_CAN_RECORD_REGISTRY) is dict else model
            _CAN_RECORD_REGISTRY[key] = cls._can_record_outputs
        model._nprf_layers()
        return model

    def _nprf_layers(self):
        """NPRF self-attention in every layer (adopting the family's projections), the NPRF embeddings, the
        shared RPE table and the redraw counter; then post_init (which initializes what is new)."""
        config = self.config
        validate_nprf_fields(config)
        layout = ATTENTION_LAYOUTS[self.family.layout]
        self.embeddings = EMBEDDINGS_CLASSES[self.family.layout](config, self.family, self.embeddings)
        encoder = getattr(self, layout.encoder)
        parent_path, _, name = layout.self_attention.rpartition(".")
        for index, layer in enumerate(getattr(encoder, layout.layers)):
            parent = layer.get_submodule(parent_path) if parent_path else layer
            setattr(parent, name, NPRFSelfAttention.adopt(getattr(parent, name), config, layout, index))
        shared = config.rpe_shared_across_layers
        shared = shared and config.relative_position_bias
        encoder.rpe_table = nn.Parameter(torch.zeros(config.num_attention_heads, config.rpe_num_buckets)) if shared else None
        encoder.redraw_step = nn.Buffer(torch.zeros((), dtype=torch.long), persistent=False)
        encoder.redraw_suspended = False  # set by generate(): cached features must stay valid
        self.post_init()

    def _create_attention_masks(
        self, attention_mask, encoder_attention_mask, embedding_output, encoder_hidden_states, past_key_values, **kwargs
    ):
        """For the families whose model builds its masks here: the self-attention mask as `forward` normalized
        it (None stays None: no L x L causal mask, causality comes from `is_decoder`); the cross-attention
        mask is HF's."""
        if encoder_attention_mask is not None:
            encoder_attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=embedding_output,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )
        return attention_mask, encoder_attention_mask

    @property
    def layer_stack(self):
        """The module holding the layers (`encoder`, DistilBERT's `transformer`): the shared table's owner."""
        return getattr(self, ATTENTION_LAYOUTS[self.family.layout].encoder)

    def nprf_attentions(self):
        """The NPRF self-attention of every layer, in order."""
        return [module for module in self.modules() if isinstance(module, NPRFSelfAttention)]

    def maybe_redraw_projections(self):
        """Redraw every layer's projection each `feature_redraw_interval` training forward passes."""
        interval = self.config.feature_redraw_interval
        encoder = self.layer_stack
        if not (self.training and interval > 0) or encoder.redraw_suspended:
            return
        self._advance_redraw(interval)

    @torch.compiler.disable
    def _advance_redraw(self, interval):
        # Reads the counter on the host and draws with a CPU generator (QR in float64): run eagerly under
        # torch.compile (one graph break per training forward, only with `feature_redraw_interval > 0`).
        encoder = self.layer_stack
        encoder.redraw_step += 1
        step = int(encoder.redraw_step)
        if step % interval == 0:
            for attention in self.nprf_attentions():
                attention.redraw_projection(step // interval)

    def _nprf_forward(self, **arguments):
        """The forward of every NPRF base model, given every argument by name (each family's `forward` spells the
        parameters of its transformers model's): the attention mask normalized once, projections redrawn,
        the decoder's NPRFCache, the shared RPE bias, the ids the optional terms read; then the family's forward.
        Arguments left at None are not handed on (every parameter of those forwards defaults to None: the same call)."""
        arguments = {name: value for name, value in arguments.items() if value is not None}
        input_ids, inputs_embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
        reference = input_ids if input_ids is not None else inputs_embeds
        attention_mask, past = arguments.get("attention_mask"), arguments.get("past_key_values")
        causal = bool(getattr(self.config, "is_decoder", False))
        if reference is not None:
            query_length = reference.shape[1]
            if find_nprf_cache(past) is not None and attention_mask is not None and attention_mask.dim() == 2:
                # an NPRF cache takes the whole sequence's padding or the new tokens' only (a compiled decode step's
                # one shape) and checks which; its length may be a tensor (NPRFStaticCache)
                key_length = attention_mask.shape[-1]
            else:
                key_length = query_length + (int(past.get_seq_length()) if past is not None else 0)
        if attention_mask is not None and reference is not None:
            check_model_attention_mask(attention_mask, reference.shape[0])
            arguments["attention_mask"] = normalize_attention_mask(
                attention_mask, query_length, key_length, causal, self.config.num_attention_heads
            )
        self.maybe_redraw_projections()
        packed = None
        position_ids = arguments.get("position_ids")
        if arguments.get("cu_seq_lens_q") is not None and position_ids is None:
            raise ValueError(
                "cu_seq_lens_q (flash-attention's packed-sequence boundaries) without position_ids: NPRF models find "
                "packed sequences from the position ids, which the absolute position embeddings read too; pass them "
                "(DataCollatorWithFlattening returns them unless return_position_ids=False)"
            )
        mask = arguments.get("attention_mask")
        if (
            position_ids is not None
            and reference is not None
            and past is None
            and (mask is None or mask.shape[1:3] == (1, 1))  # a general mask says itself what each query sees
            and key_length == query_length
        ):  # a padding-free batch: sequences packed into a row, position ids starting again at each
            packed = arguments["packed_sequences"] = PackedSequences.find(
                position_ids, None if mask is None else mask[:, 0, 0, :], reference.shape[0]
            )
        if packed is not None:
            # no cache: each sequence is attended alone, and a cache of the row could continue none of them
            arguments["use_cache"] = False
            key_length = packed.max_length  # of the unpacked rows, which the shared bias is for
        use_cache, output_attentions = arguments.get("use_cache"), arguments.get("output_attentions")
        if (
            causal
            and past is None
            and (use_cache or (use_cache is None and self.config.use_cache))
            and not (output_attentions or (output_attentions is None and self.config.output_attentions))
            and (attention_mask is None or attention_mask.dim() == 2)
        ):  # instead of HF's growing key/value cache (which attention weights and general 4D masks need)
            cross_attention = arguments.get("encoder_hidden_states") is not None
            past = arguments["past_key_values"] = default_decoder_cache(self.config, cross_attention)
        table = self.layer_stack.rpe_table
        if table is not None:
            arguments["rpe_table"] = table
            # the shared table's bias, once for all layers; not under reentrant checkpointing, whose recomputed
            # layers would each backpropagate through that one shared graph, nor for an NPRFCache, whose
            # decode step needs only the band's coefficients (a [H, 2 Lk - 1] bias would cost O(context))
            if (
                reference is not None
                # transformers' own property is `is_activation_checkpointing` from 5.2x on, `is_gradient_checkpointing` before
                and not (self.training and any(getattr(m, "gradient_checkpointing", False) for m in self.modules()))
                and find_nprf_cache(past) is None
            ):
                arguments["rpe_bias"] = relative_position_bias(
                    far_bucket_table(table, self.config.rpe_far_bias, not causal), key_length, not causal,
                    self.config.rpe_num_buckets, self.config.rpe_max_distance,
                )
        ids = (input_ids, arguments.get("token_type_ids"), arguments.get("segment_ids"), arguments.get("token_ids"))
        if packed is not None:  # the terms' ids of each sequence alone (RoBERTa's separators counted from its start)
            ids = [packed.unpack_ids(i) for i in ids]
        arguments.update(term_inputs(self.config, *ids))
        return super().forward(**arguments)


# ---------------------------------------------------------------------------------------------
# The model classes, one per family and head of `families.FAMILIES`:
#     NPRF<Family>PreTrainedModel(NPRFPreTrainedMixin, <Family>PreTrainedModel)
#     NPRF<Family>Model(NPRFModelMixin, NPRF<Family>PreTrainedModel, <Family>Model)       forward: <Family>Model's parameters
#     NPRF<Family><Head>(NPRF<Family>PreTrainedModel, <Family><Head>)   transformers' head __init__, base model adopted
# written by utils/generate_model_classes.py from that table and transformers' signatures (tests check it is current).
# Remote code: save_pretrained copies this file, configuration_nprf.py and every sibling they import next to the
# weights (`checkpoint_files.remote_code_files()`); the configs carry the full auto_map (nprf_auto_map).
# ---------------------------------------------------------------------------------------------

# <generated by utils/generate_model_classes.py: do not edit by hand>


# BERT
class NPRFBertPreTrainedModel(NPRFPreTrainedMixin, transformers.BertPreTrainedModel):
    """[`BertPreTrainedModel`] of the NPRF models: config, masks, weight initialization."""

    config_class = NPRF_CONFIG_CLASSES["bert"]
    _no_split_modules = [*(transformers.BertPreTrainedModel._no_split_modules or []), "NPRFEmbeddings"]
    _can_record_outputs = {
        **(transformers.BertPreTrainedModel._can_record_outputs or {}),
        "attentions": NPRFSelfAttention,
    }


class NPRFBertModel(NPRFModelMixin, NPRFBertPreTrainedModel, transformers.BertModel):
    """BertModel with NPRF self-attention. Forward: as [`BertModel`]."""

    family = FAMILIES["bert"]

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        """As [`BertModel.forward`]: the same parameters and outputs, with NPRF self-attention."""
        return self._nprf_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )


class NPRFBertForMaskedLM(NPRFBertPreTrainedModel, transformers.BertForMaskedLM):
    """BertForMaskedLM on [`NPRFBertModel`]. Forward: as [`BertForMaskedLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its BertModel (self.bert)
        NPRFBertModel.adopt(self.bert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFBertForSequenceClassification(NPRFBertPreTrainedModel, transformers.BertForSequenceClassification):
    """BertForSequenceClassification on [`NPRFBertModel`]. Forward: as [`BertForSequenceClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its BertModel (self.bert)
        NPRFBertModel.adopt(self.bert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFBertForTokenClassification(NPRFBertPreTrainedModel, transformers.BertForTokenClassification):
    """BertForTokenClassification on [`NPRFBertModel`]. Forward: as [`BertForTokenClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its BertModel (self.bert)
        NPRFBertModel.adopt(self.bert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFBertForQuestionAnswering(NPRFBertPreTrainedModel, transformers.BertForQuestionAnswering):
    """BertForQuestionAnswering on [`NPRFBertModel`]. Forward: as [`BertForQuestionAnswering`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its BertModel (self.bert)
        NPRFBertModel.adopt(self.bert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFBertForMultipleChoice(NPRFBertPreTrainedModel, transformers.BertForMultipleChoice):
    """BertForMultipleChoice on [`NPRFBertModel`]. Forward: as [`BertForMultipleChoice`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its BertModel (self.bert)
        NPRFBertModel.adopt(self.bert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFBertLMHeadModel(NPRFGenerationMixin, NPRFBertPreTrainedModel, transformers.BertLMHeadModel, GenerationMixin):
    """BertLMHeadModel on [`NPRFBertModel`]. Forward: as [`BertLMHeadModel`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its BertModel (self.bert)
        NPRFBertModel.adopt(self.bert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


# RoBERTa
class NPRFRobertaPreTrainedModel(NPRFPreTrainedMixin, transformers.RobertaPreTrainedModel):
    """[`RobertaPreTrainedModel`] of the NPRF models: config, masks, weight initialization."""

    config_class = NPRF_CONFIG_CLASSES["roberta"]
    _no_split_modules = [*(transformers.RobertaPreTrainedModel._no_split_modules or []), "NPRFEmbeddings"]
    _can_record_outputs = {
        **(transformers.RobertaPreTrainedModel._can_record_outputs or {}),
        "attentions": NPRFSelfAttention,
    }


class NPRFRobertaModel(NPRFModelMixin, NPRFRobertaPreTrainedModel, transformers.RobertaModel):
    """RobertaModel with NPRF self-attention. Forward: as [`RobertaModel`]."""

    family = FAMILIES["roberta"]

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        """As [`RobertaModel.forward`]: the same parameters and outputs, with NPRF self-attention."""
        return self._nprf_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )


class NPRFRobertaForMaskedLM(NPRFRobertaPreTrainedModel, transformers.RobertaForMaskedLM):
    """RobertaForMaskedLM on [`NPRFRobertaModel`]. Forward: as [`RobertaForMaskedLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its RobertaModel (self.roberta)
        NPRFRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFRobertaForSequenceClassification(NPRFRobertaPreTrainedModel, transformers.RobertaForSequenceClassification):
    """RobertaForSequenceClassification on [`NPRFRobertaModel`]. Forward: as [`RobertaForSequenceClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its RobertaModel (self.roberta)
        NPRFRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFRobertaForTokenClassification(NPRFRobertaPreTrainedModel, transformers.RobertaForTokenClassification):
    """RobertaForTokenClassification on [`NPRFRobertaModel`]. Forward: as [`RobertaForTokenClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its RobertaModel (self.roberta)
        NPRFRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFRobertaForQuestionAnswering(NPRFRobertaPreTrainedModel, transformers.RobertaForQuestionAnswering):
    """RobertaForQuestionAnswering on [`NPRFRobertaModel`]. Forward: as [`RobertaForQuestionAnswering`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its RobertaModel (self.roberta)
        NPRFRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFRobertaForMultipleChoice(NPRFRobertaPreTrainedModel, transformers.RobertaForMultipleChoice):
    """RobertaForMultipleChoice on [`NPRFRobertaModel`]. Forward: as [`RobertaForMultipleChoice`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its RobertaModel (self.roberta)
        NPRFRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFRobertaForCausalLM(
    NPRFGenerationMixin, NPRFRobertaPreTrainedModel, transformers.RobertaForCausalLM, GenerationMixin
):
    """RobertaForCausalLM on [`NPRFRobertaModel`]. Forward: as [`RobertaForCausalLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its RobertaModel (self.roberta)
        NPRFRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


# XLM-RoBERTa
class NPRFXLMRobertaPreTrainedModel(NPRFPreTrainedMixin, transformers.XLMRobertaPreTrainedModel):
    """[`XLMRobertaPreTrainedModel`] of the NPRF models: config, masks, weight initialization."""

    config_class = NPRF_CONFIG_CLASSES["xlm-roberta"]
    _no_split_modules = [*(transformers.XLMRobertaPreTrainedModel._no_split_modules or []), "NPRFEmbeddings"]
    _can_record_outputs = {
        **(transformers.XLMRobertaPreTrainedModel._can_record_outputs or {}),
        "attentions": NPRFSelfAttention,
    }


class NPRFXLMRobertaModel(NPRFModelMixin, NPRFXLMRobertaPreTrainedModel, transformers.XLMRobertaModel):
    """XLMRobertaModel with NPRF self-attention. Forward: as [`XLMRobertaModel`]."""

    family = FAMILIES["xlm-roberta"]

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        """As [`XLMRobertaModel.forward`]: the same parameters and outputs, with NPRF self-attention."""
        return self._nprf_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )


class NPRFXLMRobertaForMaskedLM(NPRFXLMRobertaPreTrainedModel, transformers.XLMRobertaForMaskedLM):
    """XLMRobertaForMaskedLM on [`NPRFXLMRobertaModel`]. Forward: as [`XLMRobertaForMaskedLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its XLMRobertaModel (self.roberta)
        NPRFXLMRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFXLMRobertaForSequenceClassification(
    NPRFXLMRobertaPreTrainedModel, transformers.XLMRobertaForSequenceClassification
):
    """XLMRobertaForSequenceClassification on [`NPRFXLMRobertaModel`].
    Forward: as [`XLMRobertaForSequenceClassification`].
    """

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its XLMRobertaModel (self.roberta)
        NPRFXLMRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFXLMRobertaForTokenClassification(
    NPRFXLMRobertaPreTrainedModel, transformers.XLMRobertaForTokenClassification
):
    """XLMRobertaForTokenClassification on [`NPRFXLMRobertaModel`]. Forward: as [`XLMRobertaForTokenClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its XLMRobertaModel (self.roberta)
        NPRFXLMRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFXLMRobertaForQuestionAnswering(NPRFXLMRobertaPreTrainedModel, transformers.XLMRobertaForQuestionAnswering):
    """XLMRobertaForQuestionAnswering on [`NPRFXLMRobertaModel`]. Forward: as [`XLMRobertaForQuestionAnswering`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its XLMRobertaModel (self.roberta)
        NPRFXLMRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFXLMRobertaForMultipleChoice(NPRFXLMRobertaPreTrainedModel, transformers.XLMRobertaForMultipleChoice):
    """XLMRobertaForMultipleChoice on [`NPRFXLMRobertaModel`]. Forward: as [`XLMRobertaForMultipleChoice`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its XLMRobertaModel (self.roberta)
        NPRFXLMRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFXLMRobertaForCausalLM(
    NPRFGenerationMixin, NPRFXLMRobertaPreTrainedModel, transformers.XLMRobertaForCausalLM, GenerationMixin
):
    """XLMRobertaForCausalLM on [`NPRFXLMRobertaModel`]. Forward: as [`XLMRobertaForCausalLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its XLMRobertaModel (self.roberta)
        NPRFXLMRobertaModel.adopt(self.roberta)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


# ELECTRA
class NPRFElectraPreTrainedModel(NPRFPreTrainedMixin, transformers.ElectraPreTrainedModel):
    """[`ElectraPreTrainedModel`] of the NPRF models: config, masks, weight initialization."""

    config_class = NPRF_CONFIG_CLASSES["electra"]
    _no_split_modules = [*(transformers.ElectraPreTrainedModel._no_split_modules or []), "NPRFEmbeddings"]
    _can_record_outputs = {
        **(transformers.ElectraPreTrainedModel._can_record_outputs or {}),
        "attentions": NPRFSelfAttention,
    }


class NPRFElectraModel(NPRFModelMixin, NPRFElectraPreTrainedModel, transformers.ElectraModel):
    """ElectraModel with NPRF self-attention. Forward: as [`ElectraModel`]."""

    family = FAMILIES["electra"]

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        """As [`ElectraModel.forward`]: the same parameters and outputs, with NPRF self-attention."""
        return self._nprf_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )


class NPRFElectraForMaskedLM(NPRFElectraPreTrainedModel, transformers.ElectraForMaskedLM):
    """ElectraForMaskedLM on [`NPRFElectraModel`]. Forward: as [`ElectraForMaskedLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its ElectraModel (self.electra)
        NPRFElectraModel.adopt(self.electra)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFElectraForSequenceClassification(NPRFElectraPreTrainedModel, transformers.ElectraForSequenceClassification):
    """ElectraForSequenceClassification on [`NPRFElectraModel`]. Forward: as [`ElectraForSequenceClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its ElectraModel (self.electra)
        NPRFElectraModel.adopt(self.electra)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFElectraForTokenClassification(NPRFElectraPreTrainedModel, transformers.ElectraForTokenClassification):
    """ElectraForTokenClassification on [`NPRFElectraModel`]. Forward: as [`ElectraForTokenClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its ElectraModel (self.electra)
        NPRFElectraModel.adopt(self.electra)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFElectraForQuestionAnswering(NPRFElectraPreTrainedModel, transformers.ElectraForQuestionAnswering):
    """ElectraForQuestionAnswering on [`NPRFElectraModel`]. Forward: as [`ElectraForQuestionAnswering`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its ElectraModel (self.electra)
        NPRFElectraModel.adopt(self.electra)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFElectraForMultipleChoice(NPRFElectraPreTrainedModel, transformers.ElectraForMultipleChoice):
    """ElectraForMultipleChoice on [`NPRFElectraModel`]. Forward: as [`ElectraForMultipleChoice`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its ElectraModel (self.electra)
        NPRFElectraModel.adopt(self.electra)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFElectraForCausalLM(
    NPRFGenerationMixin, NPRFElectraPreTrainedModel, transformers.ElectraForCausalLM, GenerationMixin
):
    """ElectraForCausalLM on [`NPRFElectraModel`]. Forward: as [`ElectraForCausalLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its ElectraModel (self.electra)
        NPRFElectraModel.adopt(self.electra)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFElectraForPreTraining(NPRFElectraPreTrainedModel, transformers.ElectraForPreTraining):
    """ElectraForPreTraining on [`NPRFElectraModel`]. Forward: as [`ElectraForPreTraining`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its ElectraModel (self.electra)
        NPRFElectraModel.adopt(self.electra)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


# DistilBERT
class NPRFDistilBertPreTrainedModel(NPRFPreTrainedMixin, transformers.DistilBertPreTrainedModel):
    """[`DistilBertPreTrainedModel`] of the NPRF models: config, masks, weight initialization."""

    config_class = NPRF_CONFIG_CLASSES["distilbert"]
    _no_split_modules = [*(transformers.DistilBertPreTrainedModel._no_split_modules or []), "NPRFEmbeddings"]
    _can_record_outputs = {
        **(transformers.DistilBertPreTrainedModel._can_record_outputs or {}),
        "attentions": NPRFSelfAttention,
    }


class NPRFDistilBertModel(NPRFModelMixin, NPRFDistilBertPreTrainedModel, transformers.DistilBertModel):
    """DistilBertModel with NPRF self-attention. Forward: as [`DistilBertModel`]."""

    family = FAMILIES["distilbert"]

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        position_ids=None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        """As [`DistilBertModel.forward`]: the same parameters and outputs, with NPRF self-attention."""
        return self._nprf_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            **kwargs,
        )


class NPRFDistilBertForMaskedLM(NPRFDistilBertPreTrainedModel, transformers.DistilBertForMaskedLM):
    """DistilBertForMaskedLM on [`NPRFDistilBertModel`]. Forward: as [`DistilBertForMaskedLM`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its DistilBertModel (self.distilbert)
        NPRFDistilBertModel.adopt(self.distilbert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFDistilBertForSequenceClassification(
    NPRFDistilBertPreTrainedModel, transformers.DistilBertForSequenceClassification
):
    """DistilBertForSequenceClassification on [`NPRFDistilBertModel`].
    Forward: as [`DistilBertForSequenceClassification`].
    """

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its DistilBertModel (self.distilbert)
        NPRFDistilBertModel.adopt(self.distilbert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFDistilBertForTokenClassification(
    NPRFDistilBertPreTrainedModel, transformers.DistilBertForTokenClassification
):
    """DistilBertForTokenClassification on [`NPRFDistilBertModel`]. Forward: as [`DistilBertForTokenClassification`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its DistilBertModel (self.distilbert)
        NPRFDistilBertModel.adopt(self.distilbert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFDistilBertForQuestionAnswering(NPRFDistilBertPreTrainedModel, transformers.DistilBertForQuestionAnswering):
    """DistilBertForQuestionAnswering on [`NPRFDistilBertModel`]. Forward: as [`DistilBertForQuestionAnswering`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its DistilBertModel (self.distilbert)
        NPRFDistilBertModel.adopt(self.distilbert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


class NPRFDistilBertForMultipleChoice(NPRFDistilBertPreTrainedModel, transformers.DistilBertForMultipleChoice):
    """DistilBertForMultipleChoice on [`NPRFDistilBertModel`]. Forward: as [`DistilBertForMultipleChoice`]."""

    def __init__(self, config):
        super().__init__(config)  # transformers' __init__: the head, its DistilBertModel (self.distilbert)
        NPRFDistilBertModel.adopt(self.distilbert)  # made NPRF in place
        self.post_init()  # again: gathers the NPRF base model's settings


# {model_type: {head: class}}, and the family's pre-trained base class under None
NPRF_MODEL_CLASSES = {
    "bert": {
        None: NPRFBertPreTrainedModel,
        "model": NPRFBertModel,
        "masked-lm": NPRFBertForMaskedLM,
        "sequence-classification": NPRFBertForSequenceClassification,
        "token-classification": NPRFBertForTokenClassification,
        "question-answering": NPRFBertForQuestionAnswering,
        "multiple-choice": NPRFBertForMultipleChoice,
        "causal-lm": NPRFBertLMHeadModel,
    },
    "roberta": {
        None: NPRFRobertaPreTrainedModel,
        "model": NPRFRobertaModel,
        "masked-lm": NPRFRobertaForMaskedLM,
        "sequence-classification": NPRFRobertaForSequenceClassification,
        "token-classification": NPRFRobertaForTokenClassification,
        "question-answering": NPRFRobertaForQuestionAnswering,
        "multiple-choice": NPRFRobertaForMultipleChoice,
        "causal-lm": NPRFRobertaForCausalLM,
    },
    "xlm-roberta": {
        None: NPRFXLMRobertaPreTrainedModel,
        "model": NPRFXLMRobertaModel,
        "masked-lm": NPRFXLMRobertaForMaskedLM,
        "sequence-classification": NPRFXLMRobertaForSequenceClassification,
        "token-classification": NPRFXLMRobertaForTokenClassification,
        "question-answering": NPRFXLMRobertaForQuestionAnswering,
        "multiple-choice": NPRFXLMRobertaForMultipleChoice,
        "causal-lm": NPRFXLMRobertaForCausalLM,
    },
    "electra": {
        None: NPRFElectraPreTrainedModel,
        "model": NPRFElectraModel,
        "masked-lm": NPRFElectraForMaskedLM,
        "sequence-classification": NPRFElectraForSequenceClassification,
        "token-classification": NPRFElectraForTokenClassification,
        "question-answering": NPRFElectraForQuestionAnswering,
        "multiple-choice": NPRFElectraForMultipleChoice,
        "causal-lm": NPRFElectraForCausalLM,
        "pretraining": NPRFElectraForPreTraining,
    },
    "distilbert": {
        None: NPRFDistilBertPreTrainedModel,
        "model": NPRFDistilBertModel,
        "masked-lm": NPRFDistilBertForMaskedLM,
        "sequence-classification": NPRFDistilBertForSequenceClassification,
        "token-classification": NPRFDistilBertForTokenClassification,
        "question-answering": NPRFDistilBertForQuestionAnswering,
        "multiple-choice": NPRFDistilBertForMultipleChoice,
    },
}
# </generated by utils/generate_model_classes.py>

for _family_classes in NPRF_MODEL_CLASSES.values():
    for _head, _model_class in _family_classes.items():
        if _head is not None:
            _model_class.register_for_auto_class(HEADS[_head].auto_class)
for _config_class in NPRF_CONFIG_CLASSES.values():
    _config_class.register_for_auto_class()


__all__ = [cls.__name__ for classes in NPRF_MODEL_CLASSES.values() for cls in classes.values()] + ["set_attention_variant"]


def _position_limit_error(length, limit):
    return ValueError(
        f"Input of {length} positions but position_embedding_type='absolute' has max_position_embeddings={limit} "
        "positions. Truncate the input, extend the table with `nprf-hf convert --max-position-embeddings N`, or use "
        "position_embedding_type='none' (relative positions only, any length)."
    )
