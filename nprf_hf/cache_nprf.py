# coding=utf-8
"""Recurrent NPRF decoding: a `transformers` Cache whose size does not grow with the context.

The math (the state of the keys older than the band, and the recurrent step that reads and advances it) is in
`nprf_recurrent`; `NPRFCacheLayer` / `NPRFCache` keep its results between calls, and `NPRFStaticCache` keeps the
same state in place, for a compiled decode step (`generate(..., cache_implementation="static")`).
"""


import torch

from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_masks_for_generate

from .functional import nprf_attention
from .nprf_positions import relative_position_bias
from .nprf_recurrent import (  # noqa: F401  (DECODE_BLOCK, recurrent_attention: public here as before)
    DECODE_BLOCK,
    causal_distance_bias,
    recurrent_attention,
    recurrent_state_from_prefill,
    recurrent_step,
    key_features_and_values,
)
from .nprf_terms import AttentionTerms
from .options import QUADRATIC_VARIANTS


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


class NPRFCacheLayer(CacheLayerMixin):
    """The recurrent state of one NPRF decoder layer (shapes in the module docstring).

    Also kept: `seq_length` (tokens seen, padding included), `real_tokens` [B] (tokens that were not
    padding: the attention masks of later calls must agree) and the identity of the projection the
    features were computed with (a feature redraw invalidates the state).
    """

    is_compileable = False
    is_croppable = False  # the far sums cannot give a key back
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self.far_states = None
        self.ring_features = None
        self.ring_values = None
        self.real_tokens = None
        self.seq_length = 0
        self.projection_id = None

    def lazy_initialization(self, key_states, value_states):
        raise NotImplementedError(
            "NPRFCacheLayer builds its state from the prompt (NPRFCache.attend), not from keys and values"
        )

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(
            "NPRFCache holds recurrent NPRF state, not keys and values: only NPRF decoder self-attention can use it "
            "(through NPRFCache.attend). Pass a DynamicCache for other attention modules."
        )

    @property
    def has_state(self):
        """Whether the prompt was consumed (later calls continue from the state)."""
        return self.far_states is not None

    def store(self, far_states, ring_features, ring_values, real_tokens, length):
        """Keep the state after `length` new tokens, `real_tokens` [B] of them not padding."""
        self.far_states, self.ring_features, self.ring_values = far_states, ring_features, ring_values
        self.real_tokens = real_tokens if self.real_tokens is None else self.real_tokens + real_tokens
        self.seq_length += length

    def get_seq_length(self):
        return self.seq_length

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return -1

    @property
    def batch_size(self):
        return -1 if self.far_states is None else self.far_states.shape[0]

    @property
    def nbytes(self):
        """Bytes held by the state (constant in the context length)."""
        tensors = (self.far_states, self.ring_features, self.ring_values, self.real_tokens)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _tensors(self):
        return ("far_states", "ring_features", "ring_values", "real_tokens")

    def _apply(self, fn):
        if self.far_states is not None:
            for name in self._tensors():
                setattr(self, name, fn(getattr(self, name)))

    def reset(self):
        self.__init__()

    def reorder_cache(self, beam_idx):
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._apply(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove):
        raise ValueError(
            "NPRFCache cannot be cropped: its far sums S, z cannot give tokens back. Use "
            "cache_implementation='dynamic' (a growing key/value cache) for assisted decoding or other rollbacks."
        )

    def offload(self):  # a few hundred KiB per layer whatever the context: nothing worth offloading
        pass

    def prefetch(self):
        pass


class NPRFStaticCacheLayer(NPRFCacheLayer):
    """`NPRFCacheLayer` for a compiled decode step (`torch.compile`, CUDA graphs): the state tensors are allocated
    once, after the prompt, and later steps write into them in place (fixed shapes and addresses); the token count
    is a tensor, `cumulative_length`, so that a growing context changes no value a compiled graph is guarded on.
    For generation: the in-place writes leave no autograd graph through the state.
    """

    is_compileable = True

    def __init__(self, **kwargs):
        super().__init__()
        self.cumulative_length = None

    def store(self, far_states, ring_features, ring_values, real_tokens, length):
        if self.has_state and far_states.requires_grad:
            # autograd through the state (no generate() step): an in-place write would change tensors saved for
            # backward, so keep the new ones (no longer at the recorded addresses: CUDA graphs record again)
            self.far_states, self.ring_features, self.ring_values = far_states, ring_features, ring_values
            self.real_tokens = self.real_tokens + real_tokens
            self.cumulative_length = self.cumulative_length + length
            return
        if not self.has_state:  # after the prompt: the buffers every later step writes into
            self.far_states, self.ring_features, self.ring_values = far_states, ring_features, ring_values
            self.real_tokens = real_tokens
            self.cumulative_length = torch.tensor(length, dtype=torch.long, device=far_states.device)
            if not torch.compiler.is_compiling():  # (not allowed while tracing: a compiled prefill skips it)
                for name in self._tensors() + ("cumulative_length",):
                    torch._dynamo.mark_static_address(getattr(self, name))
            return
        self.far_states.copy_(far_states)
        self.ring_features.copy_(ring_features)
        self.ring_values.copy_(ring_values)
        self.real_tokens.add_(real_tokens)
        self.cumulative_length.add_(length)

    def get_seq_length(self):
        return self.cumulative_length if self.has_state else 0

    def _apply(self, fn):
        # in place where the shape stays (beam reordering): the addresses a compiled step was recorded with
        if self.has_state:
            for name in self._tensors():
                old = getattr(self, name)
                new = fn(old)
                if new.shape == old.shape:
                    old.copy_(new)
                else:
                    setattr(self, name, new)
                    torch._dynamo.mark_static_address(new)


class NPRFCache(Cache):
    """Constant-size cache of NPRF decoder self-attention for `generate()`: per layer the far sums S, z and
    the last W - 1 keys' features and values (`NPRFCacheLayer`), so a generated token costs
    O(W (m + d) + m d) per head whatever the context length.

    Args:
        config: the model config (to create one layer per hidden layer up front), or None (layers are
            added as the attention modules first use them).

    The NPRF self-attention calls `attend(...)` instead of `update(...)`.
    """

    layer_class = NPRFCacheLayer

    def __init__(self, config=None):
        layers = [self.layer_class() for _ in range(config.num_hidden_layers)] if config is not None else []
        super().__init__(layers=layers)

    @property
    def is_compileable(self):
        # a class property, also before the layers exist (generate() compiles its decode step for a compileable cache)
        return self.layer_class.is_compileable

    def layer(self, layer_idx):
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class())
        return self.layers[layer_idx]

    def nbytes(self, layer_idx=0):
        """Bytes of layer `layer_idx`'s state."""
        return self.layer(layer_idx).nbytes

    def attend(
        self,
        layer_idx,
        query,
        key,
        value,
        key_padding_mask,
        rpe_table,
        projection,
        band_width,
        num_buckets=32,
        max_distance=128,
        algorithm="auto",
        variant="nprf",
        terms=None,
    ):
        """Causal NPRF attention of the new tokens to everything the layer has seen, advancing its state.
        `variant`: one whose kernel factors into features (`functional.variant_features`).

        The first call (prefill) attends the prompt with `nprf_attention(algorithm=...)` and builds the
        state from its keys; later calls attend the new tokens to the state (`recurrent_attention`).

        Args:
            query, key, value: [B, H, L, d] of the L new tokens.
            key_padding_mask: None or bool, True = keep: [B, past + L] (the whole sequence, as generate()
                passes it; past positions must agree with what the cache saw) or [B, L] (the new tokens only:
                what generate() gives a compiled decode step, one shape however long the context).
            rpe_table: [H, num_buckets] unidirectional bucket table. projection: [H, m, d] or [m, d].
            band_width: W of the unidirectional buckets (`rpe_band_width(..., bidirectional=False)`).
            terms: the layer's optional terms (`nprf_terms.AttentionTerms`); a decoder's apply to the features only.
        Returns:
            [B, H, L, d] attention output.
        """
        terms = AttentionTerms() if terms is None else terms
        if terms.pair_terms:
            raise ValueError(f"NPRFCache's recurrent state applies feature terms only, not {terms.pair_terms[0].name}")
        terms.check(query.shape[0], query.shape[1], query.shape[2], True, variant)
        logit_scale = terms.logit_scale
        layer = self.layer(layer_idx)
        batch, length = query.shape[0], query.shape[2]
        prefill = not layer.has_state
        mask = self._check_call(layer, layer_idx, batch, length, key_padding_mask, projection)
        # the new tokens are the mask's last columns, whether it covers the whole sequence or only them
        new_mask = None if mask is None else mask[:, mask.shape[-1] - length :]
        if prefill:  # the fast exact algorithms over the prompt, then the state from its keys
            bias = relative_position_bias(rpe_table, length, False, num_buckets, max_distance)
            out = nprf_attention(
                query,
                key,
                value,
                bias,
                projection,
                key_padding_mask=mask,
                algorithm=algorithm,
                causal=True,
                band_width=band_width,
                variant=variant,
                terms=terms,
            )
            phi_k, u = key_features_and_values(key, value, new_mask, projection, variant, logit_scale)
            state = recurrent_state_from_prefill(phi_k, u, band_width)
        else:
            state = (layer.far_states, layer.ring_features, layer.ring_values)
            out, state = recurrent_step(query, key, value, new_mask, state, rpe_table, projection, band_width,
                                        num_buckets, max_distance, algorithm, variant, terms)
        real = torch.full((batch,), length, device=query.device) if new_mask is None else new_mask.sum(-1)
        layer.store(*state, real, length)
        if not torch.compiler.is_compiling():  # storage ids cannot be traced; generate() keeps the projection anyway
            layer.projection_id = _projection_id(projection)
        return out

    def _check_call(self, layer, layer_idx, batch, length, key_padding_mask, projection):
        """The key padding mask as bool [B, past + L] or [B, L] (or None); a ValueError for what the state cannot
        honour. Under torch.compile only the shapes are checked: the rest reads the state on the host."""
        if key_padding_mask is not None:
            if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch:
                raise ValueError(
                    f"NPRFCache layer {layer_idx}: the key padding mask must be [B={batch}, past + new] or "
                    f"[B={batch}, new], got {tuple(key_padding_mask.shape)}"
                )
            key_padding_mask = key_padding_mask.bool()
        if not layer.has_state:
            if key_padding_mask is not None and key_padding_mask.shape[-1] != length:
                raise ValueError(
                    f"NPRFCache layer {layer_idx} has seen no token: the attention_mask must be [B={batch}, {length}], "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            return key_padding_mask
        if layer.far_states.shape[0] != batch:
            raise ValueError(
                f"NPRFCache layer {layer_idx} holds a batch of {layer.far_states.shape[0]} sequences, "
                f"got {batch} new ones"
            )
        if torch.compiler.is_compiling():
            return key_padding_mask
        if layer.projection_id is not None and layer.projection_id != _projection_id(projection):
            raise ValueError(
                f"the random projection of layer {layer_idx} changed since NPRFCache was built (a feature redraw "
                "or new weights): its state was computed with the old features; start again with a new cache"
            )
        if layer_idx != 0:  # every layer sees the same mask: one host sync per step
            return key_padding_mask
        past = int(layer.get_seq_length())
        if key_padding_mask is not None and key_padding_mask.shape[-1] not in (past + length, length):
            raise ValueError(
                f"NPRFCache layer {layer_idx} has seen {past} tokens: the attention_mask must be [B={batch}, past + new "
                f"= {past + length}] (the whole sequence) or [B={batch}, new = {length}], got "
                f"{tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask is not None and key_padding_mask.shape[-1] == length:  # the new tokens only
            return key_padding_mask
        seen = (
            torch.full_like(layer.real_tokens, past) if key_padding_mask is None else key_padding_mask[:, :past].sum(-1)
        )
        if not bool((seen == layer.real_tokens).all()):
            raise ValueError(
                "the attention mask of the past tokens differs from the one NPRFCache saw when it consumed them (past "
                "padding cannot be changed after the fact: their keys are already in the far sums S, z)"
            )
        return key_padding_mask


class NPRFStaticCache(NPRFCache):
    """`NPRFCache` whose decode step compiles (`NPRFStaticCacheLayer`): what `generate(...,
    cache_implementation="static")` builds for an NPRF decoder. The state is constant-size anyway, so nothing
    is sized for a maximum length: one compiled step serves every context length.

    Args:
        config: the model config (one layer per hidden layer), or None (layers added as first used).
    """

    layer_class = NPRFStaticCacheLayer


def _projection_id(projection):
    """Identity of a projection's current values: storage and version counter (bumped by in-place writes,
    e.g. a feature redraw or load_state_dict)."""
    return (projection.data_ptr(), projection._version, projection.dtype, projection.device)


def find_nprf_cache(past_key_values):
    """The NPRFCache in `past_key_values` (itself, or the self-attention part of an EncoderDecoderCache), or None."""
    cache = getattr(past_key_values, "self_attention_cache", past_key_values)
    return cache if isinstance(cache, NPRFCache) else None


def default_decoder_cache(config, cross_attention=False, static=False):
    """The cache an NPRF decoder uses when none is given: an NPRFCache for the self-attention (an NPRFStaticCache
    when `static`: a compileable decode step), with a DynamicCache for HF's softmax cross-attention when the
    decoder reads encoder states; for the exact (quadratic) attention variants, whose kernel has no features to
    sum, HF's growing key/value cache."""
    if config.attention_variant in QUADRATIC_VARIANTS:
        cache = DynamicCache(config=config)
    else:
        cache = NPRFStaticCache(config) if static else NPRFCache(config)
    return EncoderDecoderCache(cache, DynamicCache(config=config)) if cross_attention else cache


class NPRFGenerationMixin:
    """generate() of the NPRF decoders: an NPRFCache unless told otherwise, no feature redraw while generating, and
    RoBERTa's position numbering for absolute position embeddings.

    `cache_implementation="static"` gives an NPRFStaticCache: the same constant-size state, written in place, so
    that transformers compiles the decode step (on CUDA, or wherever `compile_config._compile_all_devices`), one
    graph for every context length. `cache_implementation="dynamic"` (or a Cache passed as `past_key_values`)
    keeps HF's growing key/value cache, which NPRF attention also accepts (it then recomputes the attention over
    all cached keys at every step). Assisted generation needs a cache that can be cropped and
    `output_attentions=True` every past key, so both keep the dynamic cache too.
    """

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        implementation = generation_config.cache_implementation
        if implementation not in (None, "dynamic", "offloaded", "static"):
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by NPRF decoders: leave it unset (NPRFCache, "
                "constant size), use 'static' (NPRFStaticCache: the same state, a compileable decode step) or 'dynamic' "
                "(a growing key/value cache)"
            )
        assisted = getattr(generation_mode, "value", generation_mode) == "assisted_generation"
        assisted = assisted or generation_config.is_assistant
        builds = model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False
        if builds and implementation == "static":
            reason = None
            if self.config.attention_variant in QUADRATIC_VARIANTS:
                reason = f"attention_variant={self.config.attention_variant!r} weighs every past key (no constant-size state)"
            elif generation_config.output_attentions:
                reason = "output_attentions=True needs every past key"
            elif assisted:
                reason = "assisted generation rolls the cache back, which the far sums S, z cannot"
            if reason is not None:
                raise ValueError(
                    f"cache_implementation='static' (NPRFStaticCache) cannot serve this call: {reason}; use "
                    "cache_implementation='dynamic'"
                )
        if (
            builds
            and implementation in (None, "static")
            and not assisted
            and not generation_config.output_attentions  # the weights of every step need every past key
        ):
            cross_attention = model_kwargs.get("encoder_hidden_states") is not None
            model_kwargs["past_key_values"] = default_decoder_cache(
                self.config, cross_attention, static=implementation == "static"
            )
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, past_key_values, *args, **kwargs):
        """The attention mask of one step when the cache is compileable (transformers builds it here then).
        An NPRF cache reads only the new tokens' padding: the last L columns of the 2D mask, [B, L], one shape at
        every decode step (no recompile as the context grows) where transformers would build a 4D mask over a
        maximum length. Args as `transformers.masking_utils.create_masks_for_generate`; inputs_embeds [B, L, *]."""
        if find_nprf_cache(past_key_values) is not None and attention_mask is not None and attention_mask.dim() == 2:
            # a copy: the slice's strides follow the growing mask, which a compiled step would recompile for
            # (transformers < 5.2x passes the result on as it is)
            return attention_mask[:, attention_mask.shape[-1] - inputs_embeds.shape[1] :].clone(
                memory_format=torch.contiguous_format
            )
        return create_masks_for_generate(config, inputs_embeds, attention_mask, past_key_values, *args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids,
        next_sequence_length=None,
        past_key_values=None,
        attention_mask=None,
        inputs_embeds=None,
        is_first_iteration=False,
        **kwargs,
    ):
        """transformers' inputs of one step, with `position_ids` in the numbering of the embeddings.

        generate() keeps position ids in its own convention, `attention_mask.cumsum(-1) - 1` (from 0 over the real
        tokens, 0 on padding), whether it made them or they were passed to it, and extends them by one per step.
        RoBERTa's embeddings number from padding_idx + 1 (padding: padding_idx): they are shifted here, at the one
        place every step goes through, so that explicit and implicit position ids give the same tokens and both
        see what a forward pass without position_ids sees.
        """
        model_inputs = super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        position_ids = model_inputs.get("position_ids")
        padding_idx = getattr(getattr(self.base_model, "embeddings", None), "padding_idx", None)
        if padding_idx is None or position_ids is None:  # padding_idx: families whose positions start after it
            return model_inputs
        shifted = position_ids + padding_idx + 1
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[0] == shifted.shape[0]:
            # the mask covers the whole sequence; the step's tokens are its last columns
            shifted = shifted.masked_fill(attention_mask[:, -shifted.shape[-1] :] == 0, padding_idx)
        model_inputs["position_ids"] = shifted
        return model_inputs

    def generate(self, *args, **kwargs):
        # A redraw would change phi for the keys already in the cache (and the sequence's own attention midway).
        suspended = [module for module in self.modules() if hasattr(module, "redraw_suspended")]
        previous = [module.redraw_suspended for module in suspended]
        for module in suspended:
            module.redraw_suspended = True
        try:
            return super().generate(*args, **kwargs)
        finally:
            for module, value in zip(suspended, previous):
                module.redraw_suspended = value


__all__ = [
    "NPRFCache",
    "NPRFGenerationMixin",
    "NPRFCacheLayer",
    "NPRFStaticCache",
    "NPRFStaticCacheLayer",
    "causal_distance_bias",
    "recurrent_attention",
    "recurrent_state_from_prefill",
]
