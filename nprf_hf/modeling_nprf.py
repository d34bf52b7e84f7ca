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

Design notes (the self-attention's own, on masks and packed sequences, are in `attention_nprf`):
- Masks. The base model normalizes the attention mask once per forward (`normalize_attention_mask`) and
  `_create_attention_masks` keeps None as None: no L x L mask is built for padding.
- Generation: NPRF decoders decode through `cache_nprf.NPRFCache` (the far sums S, z and the last W - 1
  keys: constant cost and memory per token, exact); a growing HF cache still works (zero queries are
  padded in front of the cached positions and their rows dropped).
- Packed sequences (a padding-free batch, `PackedSequences`) are found by the base model from the position ids
  when no cache is passed; a decoder then makes no cache.
- Cross-attention (decoder with `add_cross_attention=True`) is HF's softmax cross-attention,
  unchanged: the paper's RPE has no meaning between two different sequences.
- The RPE table starts at zeros (c_r = 1 for every distance): a converted checkpoint starts as
  plain normalized random-feature attention and learns its positional bias while fine-tuning (or,
  better, during attention transfer: `nprf_hf.transfer`).
- `position_embedding_type="none"` drops the absolute position table: [`NPRFEmbeddings`] replaces the
  family's embeddings (same submodules and names) so that inputs of any length work.
"""

import torch
import transformers
from torch import nn
try:  # (inside try: transformers' remote-code import check then asks for no package beyond torch and itself)
    from typing import Unpack  # Python 3.11+
except ImportError:
    from typing_extensions import Unpack

from transformers import GenerationMixin, PreTrainedConfig
from transformers import initialization as init
from transformers.masking_utils import create_bidirectional_mask
from transformers.utils import TransformersKwargs, logging

# the self-attention, its masks and packed sequences: importable from here as before the split
from .attention_nprf import (  # noqa: F401
    NPRFSelfAttention,
    PackedSequences,
    context_parallel_group,
    normalize_attention_mask,
    projection_generator,
    split_attention_mask,
)
from .cache_nprf import (
    CACHE_ARGUMENT, NPRFGenerationMixin, default_decoder_cache, find_nprf_cache, pop_cache_argument,
)
from .configuration_nprf import NPRF_CONFIG_CLASSES, validate_nprf_fields
from .families import ATTENTION_LAYOUTS, FAMILIES, HEADS, family_of
from .options import NPRF_FIELDS
from .functional import far_bucket_table, relative_position_bias
from .nprf_terms import ATTENTION_TERMS
from .nprf_context_parallel import shard_position_offset


logger = logging.get_logger(__name__)

# from_pretrained keywords that say where the saved config is (to compare a requested NPRF field with it); not
# trust_remote_code: reading a config dict runs no code, and transformers warns that it is ignored there
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


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

    def make_position_ids(self, input_ids, inputs_embeds, cache_length):
        """[B or 1, L] position of every token."""
        reference = input_ids if input_ids is not None else inputs_embeds
        device, length = reference.device, reference.shape[1]
        # a shard of a sequence sharded over ranks (`context_parallel`) counts on from the shards before it
        cache_length = cache_length + shard_position_offset(input_ids, length, self.padding_idx, device, context_parallel_group())
        # cache_length: an int, or a 0-d tensor (NPRFStaticCache) added without reading it on the host
        if self.padding_idx is None:
            return (torch.arange(length, device=device) + cache_length)[None]
        if input_ids is None:  # every token is real
            return (torch.arange(length, device=device) + (self.padding_idx + 1) + cache_length)[None]
        real = input_ids.ne(self.padding_idx).long()
        return (torch.cumsum(real, dim=1) + cache_length) * real + self.padding_idx

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, cache_length=0,
                past_key_values_length=0):
        # the family's model hands the cached length on as `cache_length` from transformers 5.24 on, as
        # `past_key_values_length` before: one of the two is 0
        cache_length = cache_length + past_key_values_length
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
                position_ids = self.make_position_ids(input_ids, inputs_embeds, cache_length)
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
        self, attention_mask, encoder_attention_mask, embedding_output, encoder_hidden_states, *args, **kwargs
    ):
        """For the families whose model builds its masks here: the self-attention mask as `forward` normalized
        it (None stays None: no L x L causal mask, causality comes from `is_decoder`); the cross-attention
        mask is HF's. The cache (transformers' last argument, `past_key_values` or `cache` by version) is not read."""
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
        Arguments left at None are not handed on (every parameter of those forwards defaults to None: the same call).
        The cache comes as `cache` or `past_key_values` and goes on under the installed transformers' name."""
        arguments = {name: value for name, value in arguments.items() if value is not None}
        past = pop_cache_argument(arguments)
        if past is not None:
            arguments[CACHE_ARGUMENT] = past
        input_ids, inputs_embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
        reference = input_ids if input_ids is not None else inputs_embeds
        attention_mask = arguments.get("attention_mask")
        causal = bool(getattr(self.config, "is_decoder", False))
        query_length = key_length = None
        if reference is not None:
            query_length, key_length = reference.shape[1], self._key_length(reference, attention_mask, past)
        if attention_mask is not None and reference is not None:
            check_model_attention_mask(attention_mask, reference.shape[0])
            arguments["attention_mask"] = normalize_attention_mask(
                attention_mask, query_length, key_length, causal, self.config.num_attention_heads
            )
        self.maybe_redraw_projections()
        packed = self._find_packed_sequences(arguments, reference, past, key_length == query_length)
        if packed is not None:
            # no cache: each sequence is attended alone, and a cache of the row could continue none of them
            arguments["use_cache"] = False
            key_length = packed.max_length  # of the unpacked rows, which the shared bias is for
        if causal and past is None and self._wants_nprf_cache(arguments, attention_mask):
            # instead of HF's growing key/value cache (which attention weights and general 4D masks need)
            cross_attention = arguments.get("encoder_hidden_states") is not None
            past = arguments[CACHE_ARGUMENT] = default_decoder_cache(self.config, cross_attention)
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

    @staticmethod
    def _key_length(reference, attention_mask, past):
        """Lk: the new tokens and the cached ones."""
        if find_nprf_cache(past) is not None and attention_mask is not None and attention_mask.dim() == 2:
            # an NPRF cache takes the whole sequence's padding or the new tokens' only (a compiled decode step's
            # one shape) and checks which; its length may be a tensor (NPRFStaticCache)
            return attention_mask.shape[-1]
        return reference.shape[1] + (int(past.get_seq_length()) if past is not None else 0)

    @staticmethod
    def _find_packed_sequences(arguments, reference, past, uncached):
        """The `PackedSequences` of a padding-free batch (sequences packed into a row, position ids starting again
        at each), also handed on in `arguments`; None for any other batch."""
        position_ids = arguments.get("position_ids")
        if arguments.get("cu_seq_lens_q") is not None and position_ids is None:
            raise ValueError(
                "cu_seq_lens_q (flash-attention's packed-sequence boundaries) without position_ids: NPRF models find "
                "packed sequences from the position ids, which the absolute position embeddings read too; pass them "
                "(DataCollatorWithFlattening returns them unless return_position_ids=False)"
            )
        mask = arguments.get("attention_mask")
        if (
            position_ids is None
            or reference is None
            or past is not None
            or not (mask is None or mask.shape[1:3] == (1, 1))  # a general mask says itself what each query sees
            or not uncached
        ):
            return None
        packed = arguments["packed_sequences"] = PackedSequences.find(
            position_ids, None if mask is None else mask[:, 0, 0, :], reference.shape[0]
        )
        return packed

    def _wants_nprf_cache(self, arguments, attention_mask):
        """Whether a decoder called without a cache gets an NPRFCache: caching asked for (or the config's default),
        no attention weights, and a padding mask."""
        use_cache, output_attentions = arguments.get("use_cache"), arguments.get("output_attentions")
        if use_cache is None and context_parallel_group() is not None:
            # a sharded sequence cannot be cached (an NPRFCache holds one process's whole sequence): without a
            # use_cache of the caller's, the decoder runs without a cache; use_cache=True is refused by the layers
            use_cache = arguments["use_cache"] = False
        return (
            (use_cache or (use_cache is None and self.config.use_cache))
            and not (output_attentions or (output_attentions is None and self.config.output_attentions))
            and (attention_mask is None or attention_mask.dim() == 2)
        )


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
        cache=None,
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
            cache=cache,
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
        cache=None,
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
            cache=cache,
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
        cache=None,
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
            cache=cache,
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
        cache=None,
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
            cache=cache,
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
