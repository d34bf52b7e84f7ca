# coding=utf-8
"""Recurrent NPRF decoding: a `transformers` Cache whose size does not grow with the context.

The math (the state of the keys older than the band, and the recurrent step that reads and advances it) is in
`nprf_recurrent`; `NPRFCacheLayer` / `NPRFCache` keep its results between calls, and `NPRFStaticCache` keeps the
same state in place, for a compiled decode step (`generate(..., cache_implementation="static")`).
"""


import torch

from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache, StaticCache
from transformers.masking_utils import create_masks_for_generate

from .functional import nprf_attention, nprf_attention_weights
from .nprf_cpu_threads import ThreadChoice
from .nprf_positions import relative_position_bias
from .nprf_recurrent import (  # noqa: F401  (DECODE_BLOCK, recurrent_attention: public here as before)
    DECODE_BLOCK, causal_distance_bias, key_features_and_values, recurrent_attention, recurrent_state_from_prefill,
    recurrent_step,
)
from .nprf_terms import AttentionTerms
from .options import KEY_VALUE_CACHE_VARIANTS


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
        raise NotImplementedError("NPRFCacheLayer builds its state from the prompt (NPRFCache.attend), not from keys")

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

    def __init__(self, max_cache_len=None, **kwargs):
        super().__init__()
        self.cumulative_length = None
        self.max_cache_len = max_cache_len  # set: also keep every key (output_attentions=True), up to this length
        self.key_mask = None

    def get_max_length(self):
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self):
        self.__init__(self.max_cache_len)

    def keep_keys(self, key, value, new_mask, start):
        """With `max_cache_len`: write the new keys, values and their padding [B, L] at positions start.. of
        [B, H, max_cache_len, d] buffers (allocated at the first call); returns those positions."""
        batch, heads, length, dim = key.shape
        if not torch.compiler.is_compiling() and int(start) + length > self.max_cache_len:
            raise ValueError(f"NPRFStaticCache keeps keys up to max_cache_len={self.max_cache_len}, got "
                             f"{int(start) + length} tokens")
        if self.keys is None:
            self.keys = key.new_zeros(batch, heads, self.max_cache_len, dim)
            self.values = value.new_zeros(batch, heads, self.max_cache_len, value.shape[-1])
            self.key_mask = torch.zeros(batch, self.max_cache_len, dtype=torch.bool, device=key.device)
            if not torch.compiler.is_compiling():
                for tensor in (self.keys, self.values, self.key_mask):
                    torch._dynamo.mark_static_address(tensor)
        positions = torch.arange(length, device=key.device) + start
        real = torch.ones(batch, length, dtype=torch.bool, device=key.device) if new_mask is None else new_mask
        self.keys.index_copy_(2, positions, key.to(self.keys.dtype))
        self.values.index_copy_(2, positions, value.to(self.values.dtype))
        self.key_mask.index_copy_(1, positions, real)
        return positions

    def _tensors(self):
        kept = () if self.keys is None else ("keys", "values", "key_mask")
        return super()._tensors() + kept

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
        for name, new in zip(("far_states", "ring_features", "ring_values"), (far_states, ring_features, ring_values)):
            getattr(self, name).copy_(new)
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


class NPRFCacheMixin:
    """What `NPRFCache` and `NPRFStaticCache` share: layers of `layer_class`, one per hidden layer of `config` (or
    added as the attention modules first use them), and `attend(...)`, which NPRF self-attention calls instead of
    `update(...)`. `layer_kwargs`: passed to every layer. `thread_choice`: how many CPU threads the decode steps
    through this cache run on (`NPRFGenerationMixin.__call__`)."""

    layer_class = NPRFCacheLayer

    def __init__(self, config=None, **layer_kwargs):
        self._layer_kwargs = layer_kwargs
        self.thread_choice = ThreadChoice()
        layers = [] if config is None else [self.layer_class(**layer_kwargs) for _ in range(config.num_hidden_layers)]
        Cache.__init__(self, layers=layers)

    def __iter__(self):
        raise TypeError(f"{type(self).__name__} holds recurrent NPRF state, not a key and a value per layer")

    @property
    def is_compileable(self):
        # a class property, also before the layers exist (generate() compiles its decode step for a compileable cache)
        return self.layer_class.is_compileable

    def layer(self, layer_idx):
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class(**self._layer_kwargs))
        return self.layers[layer_idx]

    def nbytes(self, layer_idx=0):
        """Bytes of layer `layer_idx`'s state."""
        return self.layer(layer_idx).nbytes

    def attend(self, layer_idx, query, key, value, key_padding_mask, rpe_table, projection, band_width, num_buckets=32,
               max_distance=128, algorithm="auto", variant="nprf", terms=None, output_attentions=False):
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
            output_attentions: also return the weights [B, H, L, max_cache_len] (zero past the tokens seen), from the
                keys an NPRFStaticCache built with `max_cache_len` keeps; a ValueError for a cache that keeps none.
        Returns:
            [B, H, L, d] attention output (and the weights, with output_attentions).
        """
        terms = AttentionTerms() if terms is None else terms
        if variant in KEY_VALUE_CACHE_VARIANTS:
            raise ValueError(f"NPRFCache's running sums hold features: attention_variant={variant!r} decodes with "
                             "cache_implementation='dynamic' (the default for it)")
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
            out = nprf_attention(query, key, value, bias, projection, key_padding_mask=mask, algorithm=algorithm,
                                 causal=True, band_width=band_width, variant=variant, terms=terms)
            phi_k, u = key_features_and_values(key, value, new_mask, projection, variant, logit_scale)
            state = recurrent_state_from_prefill(phi_k, u, band_width)
        else:
            state = (layer.far_states, layer.ring_features, layer.ring_values)
            out, state = recurrent_step(query, key, value, new_mask, state, rpe_table, projection, band_width,
                                        num_buckets, max_distance, algorithm, variant, terms)
        if output_attentions or getattr(layer, "max_cache_len", None) is not None:
            weights = self._kept_key_weights(layer, layer_idx, query, key, value, new_mask, rpe_table, projection,
                                             num_buckets, max_distance, variant, terms, output_attentions)
        real = torch.full((batch,), length, device=query.device) if new_mask is None else new_mask.sum(-1)
        layer.store(*state, real, length)
        if not torch.compiler.is_compiling():  # storage ids cannot be traced; generate() keeps the projection anyway
            layer.projection_id = _projection_id(projection)
        return (out, weights) if output_attentions else out

    @staticmethod
    def _kept_key_weights(layer, layer_idx, query, key, value, new_mask, rpe_table, projection, num_buckets,
                          max_distance, variant, terms, output_attentions):
        """Keep the new keys (an NPRFStaticCache with `max_cache_len`) and return the new queries' weights over
        every kept position, [B, H, L, max_cache_len], from the dense weights of the whole static length."""
        if getattr(layer, "max_cache_len", None) is None:
            raise ValueError(
                f"output_attentions=True needs every past key, which {type(layer).__name__} (layer {layer_idx}) does "
                "not keep: generate with cache_implementation='static' (keys kept up to the static length), "
                "'dynamic', or use_cache=False"
            )
        positions = layer.keep_keys(key, value, new_mask, layer.get_seq_length())
        if not output_attentions:
            return None
        full = query.new_zeros(*query.shape[:2], layer.max_cache_len, query.shape[-1]).index_copy(2, positions, query)
        bias = relative_position_bias(rpe_table, layer.max_cache_len, False, num_buckets, max_distance)
        weights = nprf_attention_weights(full, layer.keys, bias, projection, key_padding_mask=layer.key_mask,
                                         causal=True, variant=variant, terms=terms)
        return weights.index_select(2, positions).to(query.dtype)

    def _check_call(self, layer, layer_idx, batch, length, key_padding_mask, projection):
        """The key padding mask as bool [B, past + L] or [B, L] (or None); a ValueError for what the state cannot
        honour. Under torch.compile only the shapes are checked: the rest reads the state on the host."""
        if key_padding_mask is not None:
            if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch:
                raise ValueError(f"NPRFCache layer {layer_idx}: the key padding mask must be [B={batch}, past + new] "
                                 f"or [B={batch}, new], got {tuple(key_padding_mask.shape)}")
            key_padding_mask = key_padding_mask.bool()
        if not layer.has_state:
            if key_padding_mask is not None and key_padding_mask.shape[-1] != length:
                raise ValueError(
                    f"NPRFCache layer {layer_idx} has seen no token: the attention_mask must be [B={batch}, {length}], "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            return key_padding_mask
        if layer.far_states.shape[0] != batch:
            raise ValueError(f"NPRFCache layer {layer_idx} holds a batch of {layer.far_states.shape[0]} sequences, "
                             f"got {batch} new ones")
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
        mask = key_padding_mask
        seen = torch.full_like(layer.real_tokens, past) if mask is None else mask[:, :past].sum(-1)
        if not bool((seen == layer.real_tokens).all()):
            raise ValueError(
                "the attention mask of the past tokens differs from the one NPRFCache saw when it consumed them (past "
                "padding cannot be changed after the fact: their keys are already in the far sums S, z)"
            )
        return key_padding_mask


class NPRFCache(NPRFCacheMixin, DynamicCache):
    """Constant-size cache of NPRF decoder self-attention for `generate()`: per layer the far sums S, z and the
    last W - 1 keys' features and values (`NPRFCacheLayer`), so a generated token costs O(W (m + d) + m d) per head
    whatever the context length. A `DynamicCache` to transformers (its default cache, which generate() does not
    compile), though it keeps no keys. config: the model config (one layer per hidden layer), or None (layers
    added as first used)."""


class NPRFStaticCache(NPRFCacheMixin, StaticCache):
    """`NPRFCache`'s state written in place, so that the decode step compiles (`NPRFStaticCacheLayer`): what
    `generate(..., cache_implementation="static")` builds for an NPRF decoder, a `StaticCache` to transformers.
    The state is constant-size: one compiled step serves every context length. Only with `max_cache_len`
    (generate()'s static length, when `output_attentions=True`) does it also keep every key and value,
    [B, H, max_cache_len, d], for the attention weights. config: as NPRFCache's."""

    layer_class = NPRFStaticCacheLayer

    def __init__(self, config=None, max_cache_len=None):
        super().__init__(config, max_cache_len=max_cache_len)


def _projection_id(projection):
    """Identity of a projection's current values: storage and version counter (bumped by in-place writes,
    e.g. a feature redraw or load_state_dict)."""
    return (projection.data_ptr(), projection._version, projection.dtype, projection.device)


def find_nprf_cache(past_key_values):
    """The NPRFCache / NPRFStaticCache in `past_key_values` (itself, or the self-attention part of an
    EncoderDecoderCache), or None."""
    cache = getattr(past_key_values, "self_attention_cache", past_key_values)
    return cache if isinstance(cache, NPRFCacheMixin) else None


def default_decoder_cache(config, cross_attention=False, static=False, max_cache_len=None):
    """The cache an NPRF decoder uses when none is given: an NPRFCache for the self-attention (an NPRFStaticCache
    when `static`: a compileable decode step, keeping every key up to `max_cache_len` if given), with a
    DynamicCache for HF's softmax cross-attention when the decoder reads encoder states; for the exact (quadratic)
    attention variants and the exact near field, whose kernels are not all features to sum, HF's growing key/value
    cache."""
    if config.attention_variant in KEY_VALUE_CACHE_VARIANTS:
        cache = DynamicCache(config=config)
    else:
        cache = NPRFStaticCache(config, max_cache_len) if static else NPRFCache(config)
    return EncoderDecoderCache(cache, DynamicCache(config=config)) if cross_attention else cache


class NPRFGenerationMixin:
    """generate() of the NPRF decoders: an NPRFCache unless told otherwise, no feature redraw while generating, and
    RoBERTa's position numbering for absolute position embeddings.

    `cache_implementation="static"` gives an NPRFStaticCache: the same constant-size state, written in place, so
    that transformers compiles the decode step (on CUDA, or wherever `compile_config._compile_all_devices`), one
    graph for every context length. `cache_implementation="dynamic"` (or a Cache passed as `past_key_values`)
    keeps HF's growing key/value cache, which NPRF attention also accepts (it then recomputes the attention over
    all cached keys at every step). Assisted generation needs a cache that can be cropped, so it keeps the dynamic
    cache too; so does `output_attentions=True` (every past key) unless `cache_implementation="static"`, whose
    NPRFStaticCache then also keeps the keys, up to the static length.
    """

    def __call__(self, *args, **kwargs):
        """A decode step through an NPRF cache (one new token per sequence) runs on the CPU threads its cache's
        earlier steps ran faster with (`nprf_cpu_threads.ThreadChoice`: on a core shared with another process, one
        thread); anything else as `nn.Module.__call__`. Traced by torch.compile, it steps aside; around a model
        compiled in place (`model.compile()`) it times and chooses as for an eager one."""
        cache = None if torch.compiler.is_compiling() else find_nprf_cache(kwargs.get("past_key_values"))
        choice = getattr(cache, "thread_choice", None)  # None too for a cache pickled before it had one
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if choice is None or not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 or tokens.shape[1] != 1:
            return super().__call__(*args, **kwargs)
        with choice.step(self.device):  # the model's: accelerate may hand CPU ids to a model on a GPU
            return super().__call__(*args, **kwargs)

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
        key_value_only = self.config.attention_variant in KEY_VALUE_CACHE_VARIANTS
        if builds and implementation == "static" and (assisted or key_value_only):
            reason = "assisted generation rolls the cache back, which the far sums S, z cannot" if assisted else (
                f"attention_variant={self.config.attention_variant!r} weighs every past key (no constant-size state)")
            raise ValueError(f"cache_implementation='static' (NPRFStaticCache) cannot serve this call: {reason}; use "
                             "cache_implementation='dynamic'")
        # the weights of every step need every past key: a dynamic cache, or a static one that keeps them
        keys_needed = bool(generation_config.output_attentions)
        if builds and not assisted and (implementation == "static" or (implementation is None and not keys_needed)):
            max_cache_len = None
            if keys_needed:  # transformers' static length: (batch_size, max_cache_length) follow generation_mode
                max_cache_len = kwargs.get("max_cache_length", args[1] if len(args) > 1 else None)
                max_cache_len = max(max_cache_len, generation_config.max_cache_len or 0)
            cross_attention = model_kwargs.get("encoder_hidden_states") is not None
            model_kwargs["past_key_values"] = default_decoder_cache(
                self.config, cross_attention, static=implementation == "static", max_cache_len=max_cache_len
            )
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, past_key_values, *args, **kwargs):
        """The attention mask of one step when the cache is compileable (transformers builds it here then).
        An NPRF cache reads only the new tokens' padding: the last L columns of the 2D mask, [B, L], one shape at
        every decode step (no recompile as the context grows) where transformers would build a 4D mask over a
        maximum length; and no mask without padding (generate() drops an all-ones mask; for a compileable cache
        transformers would build a 4D causal one, which a compiled step cannot tell from a general mask). Args as
        `transformers.masking_utils.create_masks_for_generate`; inputs_embeds [B, L, *]."""
        if find_nprf_cache(past_key_values) is not None and attention_mask is None:
            return None
        if find_nprf_cache(past_key_values) is not None and attention_mask is not None and attention_mask.dim() == 2:
            # a copy: the slice's strides follow the growing mask, which a compiled step would recompile for
            # (transformers < 5.2x passes the result on as it is)
            return attention_mask[:, attention_mask.shape[-1] - inputs_embeds.shape[1] :].clone(
                memory_format=torch.contiguous_format
            )
        return create_masks_for_generate(config, inputs_embeds, attention_mask, past_key_values, *args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, past_key_values=None,
                                      attention_mask=None, inputs_embeds=None, is_first_iteration=False, **kwargs):
        """transformers' inputs of one step, with `position_ids` in the numbering of the embeddings.

        generate() keeps position ids in its own convention, `attention_mask.cumsum(-1) - 1` (from 0 over the real
        tokens, 0 on padding), whether it made them or they were passed to it, and extends them by one per step.
        RoBERTa's embeddings number from padding_idx + 1 (padding: padding_idx): they are shifted here, at the one
        place every step goes through, so that explicit and implicit position ids give the same tokens and both
        see what a forward pass without position_ids sees.
        """
        model_inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, past_key_values=past_key_values,
            attention_mask=attention_mask, inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs
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
