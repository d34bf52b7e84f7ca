# coding=utf-8
"""The NPRF self-attention of every family (`NPRFSelfAttention`), with the mask forms it reads and the packing of
padding-free batches; the model classes that hold it are in `modeling_nprf`.

The layer projects q/k/v with the family's own modules (`families.ATTENTION_LAYOUTS`), then hands them to one
of four paths: the decoder's constant-size cache (`cache_nprf.NPRFCache`), a sequence sharded over processes
(`nprf_context_parallel`), the dense weights (attention weights asked for, or a mask that is not a padding mask),
or `functional.nprf_attention`, the fast exact algorithms.

Design notes:
- Masks. The base model's forward turns the attention mask into one of two forms, once per forward:
  a key padding mask [B, 1, 1, Lk] (bool, True = keep; padding, plus causality for a decoder) or a
  general bool mask [B, 1|H, Lq, Lk], applied exactly through the dense weights. Both are 4D, so
  transformers' mask builders pass them through untouched (no L x L mask is built for padding).
- Packed sequences. A batch without padding between its sequences (transformers' `DataCollatorWithFlattening`:
  sequences concatenated in a row, `position_ids` starting again at each) is found from the position ids when no
  cache is passed (`PackedSequences`); every layer then attends each sequence alone (one row per sequence inside
  the attention: its own relative positions, far sums and optional terms), and a decoder makes no cache.
- Attention dropout (`attention_probs_dropout_prob`) is not applied: the fast algorithms never
  build an attention matrix to drop from.
"""

import contextlib
import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import EncoderDecoderCache

from .cache_nprf import CausalBuckets, find_nprf_cache
from .families import ATTENTION_LAYOUTS, family_of
from .functional import (
    draw_projection,
    far_bucket_table,
    normalize_attention,
    nprf_attention,
    nprf_attention_weights,
    relative_position_bias,
    rpe_band_width,
)
from .nprf_context_parallel import context_parallel_attention
from .nprf_cpu_threads import threads_for
from .nprf_dispatch import LayerCall, choose_route
from .nprf_dispatch import logger as route_logger
from .nprf_terms import ATTENTION_TERMS, AttentionTerms
from .options import RECOMPUTE_MODES


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
# Context parallelism: which process group the layers shard over (the math takes the group as an argument)
# ---------------------------------------------------------------------------------------------

# The process groups of the active `context_parallel` blocks, innermost last: state of the models' edge, not of the
# math. A plain list, not a ContextVar: torch.compile traces a read of it (fullgraph), and guards on it.
_GROUPS = []


@contextlib.contextmanager
def context_parallel(group=None):
    """NPRF self-attention over a sequence sharded across the ranks of `group` (None: the default process group)
    while the block is active.

    Each rank passes its contiguous shard of every sequence (`input_ids[:, lo:hi]`, the ranks in order; equal
    shards except the last, or any lengths >= 1) and gets its shard of the one-process outputs: position ids and
    the relative position bias follow global positions. Gradients summed over the ranks equal one process's. A
    decoder called without `use_cache` runs without a cache (`use_cache=True` is refused). Gradient checkpointing
    (untested) recomputes layers in backward, which must then run inside the block too. Attention weights
    (`output_attentions`), general 4D masks and the segment / word-matching / first-key terms are not supported.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel needs torch.distributed initialized (dist.init_process_group)")
    _GROUPS.append(dist.group.WORLD if group is None else group)
    try:
        yield
    finally:
        _GROUPS.pop()


def context_parallel_group():
    """The process group of the active `context_parallel` block, or None outside one."""
    return _GROUPS[-1] if _GROUPS else None


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
        self.routing = None  # what "auto" reads (`nprf_dispatch.Routing`); None: the package's `ROUTING`

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
        # the layers hand the cache on as `cache` from transformers 5.24 on, as `past_key_values` before
        past_key_values = kwargs.pop("cache", past_key_values)
        input_shape = hidden_states.shape[:-1]
        query, key, value = self.split_heads(hidden_states)
        output_attentions = self._output_attentions(kwargs)

        nprf_cache, group = find_nprf_cache(past_key_values), context_parallel_group()
        if nprf_cache is None:
            if packed_sequences is not None:
                query, key, value = self._unpack(packed_sequences, past_key_values, query, key, value)
                attention_mask = packed_sequences.valid
            key, value = self._with_cached_keys(past_key_values, key, value)
            query_length, key_length = query.shape[2], key.shape[2]
            query = self._pad_cached_queries(query, key_length)
            masks = self.mask_forms(attention_mask, query_length, key_length, query.shape[0])
        # the one decision of what runs (`nprf_dispatch.choose_route`): the path here, the algorithm inside it
        route = choose_route(LayerCall(
            nprf_cache is not None, group is not None, nprf_cache is None and masks[1] is not None,
            bool(output_attentions), nprf_cache is None and key_length > query_length, packed_sequences is not None,
        ), self.config.attention_algorithm)
        if nprf_cache is not None:
            attn_output, attn_weights = self._recurrent_attention(
                nprf_cache, query, key, value, attention_mask, rpe_table, output_attentions
            )
            return self.merge_heads(attn_output, input_shape), attn_weights

        rpe_bias = self._rpe_bias(rpe_table, rpe_bias, key_length)
        terms = self.attention_terms(segment_ids, token_ids)
        if output_attentions or masks[1] is not None:
            self._check_dense_length(key_length, output_attentions)
        first = key_length - query_length  # rows of the current queries
        attn_output, attn_weights = self._attend(
            route.mode, query, key, value, rpe_bias, rpe_table, masks, terms, first, group
        )
        if packed_sequences is not None:
            attn_output = packed_sequences.pack(attn_output)
            if attn_weights is not None:
                attn_weights = packed_sequences.pack_weights(attn_weights)
        return self.merge_heads(attn_output, input_shape), (attn_weights if output_attentions else None)

    def split_heads(self, hidden_states):
        """[B, L, hidden] -> query, key, value [B, H, L, d], through the family's projections."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        layout = self.layout
        return tuple(
            getattr(self, name)(hidden_states).view(hidden_shape).transpose(1, 2)
            for name in (layout.query, layout.key, layout.value)
        )

    def merge_heads(self, attn_output, input_shape):
        """[B, H, Lq, d] -> [B, Lq, hidden], through the family's output projection where it has one here."""
        attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        if self.layout.output is not None:
            attn_output = getattr(self, self.layout.output)(attn_output)
        return attn_output

    def _output_attentions(self, kwargs):
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        return output_attentions

    @staticmethod
    def _unpack(packed_sequences, past_key_values, query, key, value):
        """[B, H, L, d] each -> [N, H, Lmax, d]: one row per sequence, from here on the attention of a padded batch
        (packed back at the end)."""
        if past_key_values is not None:
            raise ValueError(
                "packed sequences (position ids starting again within a row) cannot be cached: use_cache=False"
            )
        return tuple(packed_sequences.unpack(states) for states in (query, key, value))

    def _with_cached_keys(self, past_key_values, key, value):
        """The keys and values of every position so far, [B, H, Lk, d], from a growing HF cache (or the new ones)."""
        if past_key_values is None:
            return key, value
        cache = past_key_values
        if isinstance(past_key_values, EncoderDecoderCache):
            cache = past_key_values.self_attention_cache
        return cache.update(key, value, self.layer_idx)

    def _pad_cached_queries(self, query, key_length):
        """Queries are the last positions: the cached ones get zero queries, whose rows `_attend` drops."""
        query_length = query.shape[2]
        if query_length == key_length:
            return query
        if not self.is_causal:
            raise ValueError("cached keys/values need causal attention (config.is_decoder=True)")
        return F.pad(query, (0, 0, key_length - query_length, 0))

    def _rpe_bias(self, rpe_table, rpe_bias, key_length):
        """[H, 2 Lk - 1]: the base model's shared bias when it fits this layer, else this layer's own."""
        if self.rpe_table is not None or rpe_bias is None or rpe_bias.shape[-1] != 2 * key_length - 1:
            table = self.bucket_table(rpe_table)
            rpe_bias = relative_position_bias(  # (on the CPU threads the attention call will run on)
                table, key_length, self.bidirectional, self.config.rpe_num_buckets, self.config.rpe_max_distance,
                threads_for(table.device, self.routing),
            )
        return rpe_bias

    def _check_dense_length(self, key_length, output_attentions):
        """Attention weights and general masks need the dense Lk x Lk matrix: bounded by the config."""
        limit = self.config.output_attentions_max_length
        if key_length > limit:
            what = "output_attentions=True" if output_attentions else "an attention mask that is not a padding mask"
            raise ValueError(
                f"{what} needs the dense {key_length} x {key_length} attention matrix, longer than "
                f"config.output_attentions_max_length={limit}; raise that limit or use a padding mask / "
                "output_attentions=False."
            )

    def _attend(self, path, query, key, value, rpe_bias, rpe_table, masks, terms, first, group):
        """The attention of the queries' rows `first:` ([B, H, Lk, d] each in) -> (output [B, H, Lq, d], weights
        [B, H, Lq, Lk] or None) by the router's `path` (`nprf_dispatch.LAYER_PATHS`): over the shards of
        `context_parallel` (`group`), exactly through the dense weights for a general mask, through the returned
        weights with `output_attentions`, else the fast algorithms."""
        key_padding_mask, general_mask = masks
        if path == "sharded":
            return self._sharded_attention(query, key, value, rpe_table, key_padding_mask, terms, group), None
        if path == "masked":
            return self._masked_attention(query, key, value, rpe_bias, general_mask, terms, first)
        if path == "weights":
            # The output is computed from the returned weights, so they are part of the graph (attribution
            # through `attentions[i].retain_grad()` works); dense, hence the length limit.
            attn_weights = nprf_attention_weights(
                query, key, rpe_bias, self.projection, key_padding_mask=key_padding_mask, causal=self.is_causal,
                variant=self.config.attention_variant, terms=terms, near_field_width=self.near_field_width,
            )[:, :, first:]
            return (attn_weights.to(value.dtype) @ value).to(value.dtype), attn_weights
        attn_output = nprf_attention(
            query, key, value, rpe_bias, self.projection, key_padding_mask=key_padding_mask,
            algorithm=self.config.attention_algorithm, causal=self.is_causal, band_width=self.band_width,
            recompute=RECOMPUTE_MODES[self.config.attention_recompute], variant=self.config.attention_variant,
            terms=terms, near_field_width=self.near_field_width, routing=self.routing,
        )
        return attn_output[:, :, first:], None

    def _sharded_attention(self, query, key, value, rpe_table, key_padding_mask, terms, group):
        """This rank's shard of the sequence attends the whole sequence (`nprf_context_parallel`)."""
        # the bias of r = -W .. W (the ends stand for every farther distance): the shard's own may reach less far
        band_bias = relative_position_bias(self.bucket_table(rpe_table), self.band_width + 1, self.bidirectional,
                                           self.config.rpe_num_buckets, self.config.rpe_max_distance)
        return context_parallel_attention(
            query, key, value, band_bias, self.projection, self.band_width, key_padding_mask, self.is_causal,
            self.config.attention_variant, terms, group=group, recompute=RECOMPUTE_MODES[self.config.attention_recompute],
        )

    def _masked_attention(self, query, key, value, rpe_bias, general_mask, terms, first):
        """Exact for any mask [B, 1|H, Lq, Lk]: the unmasked weights restricted to the allowed keys and renormalized,
        in float32 for half inputs (the allowed keys' share of a row can underflow float16)."""
        compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        weights = nprf_attention_weights(
            query.to(compute_dtype), key.to(compute_dtype), rpe_bias, self.projection,
            variant=self.config.attention_variant, terms=terms, near_field_width=self.near_field_width,
        )
        weights = weights[:, :, first:] * general_mask
        attn_weights = normalize_attention(weights, weights.sum(-1, keepdim=True))
        attn_output = (attn_weights @ value.to(compute_dtype)).to(value.dtype)
        return attn_output, attn_weights.to(value.dtype)

    def _recurrent_attention(self, cache, query, key, value, attention_mask, rpe_table, output_attentions):
        """Decoder self-attention through an NPRFCache (`cache_nprf`): constant cost per generated token.
        query / key / value [B, H, Lq, d] of the new tokens -> ([B, H, Lq, d], the weights [B, H, Lq, Lk] with
        output_attentions, from an NPRFStaticCache that keeps the keys, or None)."""
        if not self.is_causal:
            raise ValueError("NPRFCache is for decoder self-attention (config.is_decoder=True)")
        table = self.bucket_table(rpe_table)
        result = cache.attend(
            self.layer_idx,
            query,
            key,
            value,
            self._cache_padding_mask(cache, attention_mask, query),
            CausalBuckets(table, self.band_width, self.config.rpe_num_buckets, self.config.rpe_max_distance),
            self.projection,
            algorithm=self.config.attention_algorithm,
            variant=self.config.attention_variant,
            terms=self.attention_terms(),
            output_attentions=bool(output_attentions),
            routing=self.routing,
        )
        return result if output_attentions else (result, None)

    def _cache_padding_mask(self, cache, attention_mask, query):
        """The key padding mask an NPRFCache takes, [B, past + Lq] or [B, Lq] (or None); a mask that is not a
        padding mask is refused."""
        if attention_mask is None or attention_mask.dim() == 2:
            return attention_mask
        if attention_mask.dtype == torch.bool and attention_mask.shape[1:3] == (1, 1):
            # the base model's key padding form, [B, past + L] or [B, L]: the cache checks which (its length may be
            # a tensor, NPRFStaticCache, which a compiled step must not compare on the host)
            return attention_mask[:, 0, 0, :]
        query_length = query.shape[2]
        key_length = int(cache.get_seq_length(self.layer_idx)) + query_length
        key_padding_mask, general_mask = self.mask_forms(attention_mask, query_length, key_length, query.shape[0])
        if general_mask is not None:
            raise ValueError(
                "NPRFCache applies padding masks (with the causal pattern) only; for another attention mask use "
                "cache_implementation='dynamic' or use_cache=False"
            )
        return key_padding_mask


# ---------------------------------------------------------------------------------------------
# What ran, and why
# ---------------------------------------------------------------------------------------------


class _RouteRecorder(logging.Handler):
    """Collects the router's DEBUG records (`nprf_dispatch.choose_route`), each under the layer that made it."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.layer, self.lines = "(outside a layer)", []

    def emit(self, record):
        route = record.args[0] if isinstance(record.args, tuple) and record.args else record.getMessage()
        if getattr(route, "backend", None) == "layer":
            self.lines.append(f"{self.layer}: {route.mode} path ({route.reason})")
        else:
            self.lines.append(f"{self.layer}:     {route}")


def explain(model, inputs, show=True):
    """What each NPRF self-attention of `model` ran on `inputs`, and why: one forward of `model(**inputs)` (a mapping,
    e.g. a tokenizer's output) or `model(inputs)` (input ids), in the caller's autograd mode (under `torch.no_grad()`:
    inference's choices), recording every decision of the router (`nprf_dispatch.choose_route`): the layer's path,
    then the algorithm, mode and reason of the attention or decode step it ran. Eager only: a compiled model's
    decisions are traced into its graph, not logged. The same lines reach the logger `nprf_hf.nprf_dispatch` at DEBUG
    without this function. Prints them unless `show=False`; returns them as a list of strings."""
    layers = {module: name for name, module in model.named_modules() if isinstance(module, NPRFSelfAttention)}
    if not layers:
        raise ValueError(f"explain: {type(model).__name__} has no NPRF self-attention (convert_to_nprf makes one)")
    recorder = _RouteRecorder()
    hooks = [module.register_forward_pre_hook(lambda module, args, name=name: setattr(recorder, "layer", name))
             for module, name in layers.items()]
    level, propagate = route_logger.level, route_logger.propagate
    route_logger.addHandler(recorder)
    route_logger.setLevel(logging.DEBUG)
    route_logger.propagate = False  # (the user's handlers keep their own level for this module)
    try:
        model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    finally:
        route_logger.removeHandler(recorder)
        route_logger.setLevel(level)
        route_logger.propagate = propagate
        for hook in hooks:
            hook.remove()
    if show:
        print("\n".join(recorder.lines))
    return recorder.lines
