# coding=utf-8
"""Recurrent NPRF decoding: a `transformers` Cache whose size does not grow with the context. The math (the state
of the keys older than the band, and the step that reads and advances it) is in `nprf_recurrent`; `NPRFCache` keeps
its results between calls, `NPRFStaticCache` the same state in place, for a compiled decode step."""

import inspect

import torch

from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache, StaticCache
from transformers.masking_utils import create_masks_for_generate

from .functional import nprf_attention, nprf_attention_weights
from .nprf_cpu_threads import ThreadChoice, threads_for
from .nprf_positions import relative_position_bias
from .nprf_recurrent import (  # noqa: F401  (DECODE_BLOCK, recurrent_attention: public here as before)
    DECODE_BLOCK, CausalBuckets, causal_distance_bias, key_features_and_values, recurrent_attention,
    recurrent_state_from_prefill, recurrent_step,
)
from .nprf_terms import AttentionTerms
from .options import KEY_VALUE_CACHE_VARIANTS


# The cache's argument name (forward, generate()'s model kwargs, the mask builders): `cache` from transformers 5.24 on,
# `past_key_values` before (taken with a warning until 5.40); read from transformers' signature, not a version.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(create_masks_for_generate).parameters else "past_key_values"


def pop_cache_argument(kwargs):
    """The cache in `kwargs` (a model's forward keywords) under either name, removed from it; None if absent."""
    cache, legacy = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    if cache is not None and legacy is not None:
        raise ValueError("both `cache` and `past_key_values` were given: pass the cache once")
    return legacy if cache is None else cache


class NPRFCacheLayer(CacheLayerMixin):
    """The recurrent state of one NPRF decoder layer (shapes: `nprf_recurrent`), with `seq_length` (tokens seen,
    padding included), `real_tokens` [B] (tokens not padding: later masks must agree) and the identity of the
    projection the features were computed with (a feature redraw invalidates the state)."""

    is_compileable = False
    is_croppable = False  # the far sums cannot give a key back
    supports_early_init = False
    max_cache_len = None  # keeps no key: no attention weights
    STATE = ("far_states", "ring_features", "ring_values")  # what a decode step replaces

    def __init__(self, **kwargs):
        super().__init__()
        self.far_states = self.ring_features = self.ring_values = self.real_tokens = self.projection_id = None
        self.seq_length = 0

    def lazy_initialization(self, key_states, value_states):
        raise NotImplementedError("NPRFCacheLayer builds its state from the prompt (NPRFCache.attend), not from keys")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("NPRFCache holds recurrent NPRF state, not keys and values: only NPRF decoder "
                                  "self-attention uses it (NPRFCache.attend); pass a DynamicCache to other modules.")

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
        return -1 if self.max_cache_len is None else self.max_cache_len

    @property
    def batch_size(self):
        return -1 if self.far_states is None else self.far_states.shape[0]

    @property
    def nbytes(self):
        """Bytes held by the state (constant in the context length)."""
        tensors = (self.far_states, self.ring_features, self.ring_values, self.real_tokens)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _tensors(self):
        return self.STATE + ("real_tokens",)

    def _apply(self, fn):
        for name in self._tensors() if self.has_state else ():
            setattr(self, name, fn(getattr(self, name)))

    def check_mask(self, layer_idx, batch, length, key_padding_mask, projection):
        """The key padding mask as bool [B, past + L] or [B, L] (or None); a ValueError for what the state cannot
        honour. Under torch.compile only the shapes are checked: the rest reads the state on the host."""
        mask, name = key_padding_mask, f"NPRFCache layer {layer_idx}"
        if mask is not None:
            if mask.dim() != 2 or mask.shape[0] != batch:
                raise ValueError(f"{name}: the key padding mask must be [B={batch}, past + new] or [B={batch}, new], "
                                 f"got {tuple(mask.shape)}")
            mask = mask.bool()
        if not self.has_state:
            if mask is not None and mask.shape[-1] != length:
                raise ValueError(f"{name} has seen no token: the attention_mask must be [B={batch}, {length}], got "
                                 f"{tuple(mask.shape)}")
            return mask
        if self.far_states.shape[0] != batch:
            raise ValueError(f"{name} holds a batch of {self.far_states.shape[0]} sequences, got {batch} new ones")
        if torch.compiler.is_compiling():
            return mask
        if self.projection_id is not None and self.projection_id != _projection_id(projection):
            raise ValueError(f"the random projection of layer {layer_idx} changed since NPRFCache was built (a redraw "
                             "or new weights): its state holds the old features; start again with a new cache")
        # layer 0 alone reads the mask back (one host sync per step: every layer has the same); new tokens' has no past
        if layer_idx != 0 or (mask is not None and mask.shape[-1] == length):
            return mask
        past = int(self.get_seq_length())
        if mask is not None and mask.shape[-1] != past + length:
            raise ValueError(f"{name} has seen {past} tokens: the attention_mask must be [B={batch}, past + new = "
                             f"{past + length}] or [B={batch}, new = {length}], got {tuple(mask.shape)}")
        seen = torch.full_like(self.real_tokens, past) if mask is None else mask[:, :past].sum(-1)
        if not bool((seen == self.real_tokens).all()):
            raise ValueError("the attention mask of the past tokens differs from the one NPRFCache saw (past padding "
                             "cannot change after the fact: their keys are already in the far sums S, z)")
        return mask

    def kept_key_weights(self, layer_idx, *args):
        raise ValueError(f"output_attentions=True needs every past key, which {type(self).__name__} (layer "
                         f"{layer_idx}) does not keep: generate with cache_implementation='static' (keys kept up to "
                         "the static length), 'dynamic', or use_cache=False")

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

    prefetch = offload


class NPRFStaticCacheLayer(NPRFCacheLayer):
    """`NPRFCacheLayer` for a compiled decode step (`torch.compile`, CUDA graphs): the state is allocated after the
    prompt and later steps write into it in place (fixed shapes and addresses); the token count is a tensor,
    `cumulative_length`, so a growing context changes no value a graph is guarded on. For generation only."""

    is_compileable = True

    def __init__(self, max_cache_len=None, **kwargs):
        super().__init__()
        self.cumulative_length = None
        self.max_cache_len = max_cache_len  # set: also keep every key (output_attentions=True), up to this length
        self.key_mask = None

    def reset(self):
        self.__init__(self.max_cache_len)

    def _tensors(self):
        kept = () if self.keys is None else ("keys", "values", "key_mask")
        return super()._tensors() + kept

    def kept_key_weights(self, layer_idx, query, key, value, new_mask, buckets, projection, variant, terms,
                         output_attentions):
        """Write the new keys, values and padding at their positions of [B, H, max_cache_len, d] buffers (allocated
        at the first call) and return the new queries' weights over every kept position, [B, H, L, max_cache_len],
        from the dense weights of the whole static length (None without output_attentions)."""
        if self.max_cache_len is None:
            return super().kept_key_weights(layer_idx)
        start, (batch, heads, length, dim) = self.get_seq_length(), key.shape
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
        for buffer, new, axis in ((self.keys, key, 2), (self.values, value, 2), (self.key_mask, real, 1)):
            buffer.index_copy_(axis, positions, new.to(buffer.dtype))
        if not output_attentions:
            return None
        full = query.new_zeros(*query.shape[:2], self.max_cache_len, query.shape[-1]).index_copy(2, positions, query)
        bias = relative_position_bias(buckets.table, self.max_cache_len, False, buckets.num_buckets,
                                      buckets.max_distance)
        weights = nprf_attention_weights(full, self.keys, bias, projection, key_padding_mask=self.key_mask,
                                         causal=True, variant=variant, terms=terms)
        return weights.index_select(2, positions).to(query.dtype)

    def store(self, far_states, ring_features, ring_values, real_tokens, length):
        if self.has_state and not far_states.requires_grad:  # in place: the addresses a compiled step was recorded with
            for name, new in zip(self.STATE, (far_states, ring_features, ring_values)):
                getattr(self, name).copy_(new)
            self.real_tokens.add_(real_tokens)
            self.cumulative_length.add_(length)
            return
        # after the prompt: the buffers every later step writes into. With autograd through the state (no generate()
        # step) an in-place write would change tensors saved for backward: keep the new ones (CUDA graphs record again)
        first = not self.has_state
        self.far_states, self.ring_features, self.ring_values = far_states, ring_features, ring_values
        self.real_tokens = real_tokens if first else self.real_tokens + real_tokens
        self.cumulative_length = (torch.tensor(length, dtype=torch.long, device=far_states.device) if first
                                  else self.cumulative_length + length)
        if first and not torch.compiler.is_compiling():  # (not allowed while tracing: a compiled prefill skips it)
            for name in self._tensors() + ("cumulative_length",):
                torch._dynamo.mark_static_address(getattr(self, name))

    def get_seq_length(self):
        return self.cumulative_length if self.has_state else 0

    def _apply(self, fn):
        # in place where the shape stays (beam reordering): the addresses a compiled step was recorded with
        for name in self._tensors() if self.has_state else ():
            old, new = getattr(self, name), fn(getattr(self, name))
            if new.shape == old.shape:
                old.copy_(new)
            else:
                setattr(self, name, new)
                torch._dynamo.mark_static_address(new)


class NPRFCacheMixin:
    """What `NPRFCache` and `NPRFStaticCache` share: a `layer_class(**layer_kwargs)` per hidden layer of `config` (or
    added as first used); `attend(...)`, which NPRF self-attention calls instead of `update(...)`; `thread_choice`,
    the CPU threads of its decode steps (`NPRFGenerationMixin.__call__`)."""

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

    def attend(self, layer_idx, query, key, value, key_padding_mask, buckets, projection, algorithm="auto",
               variant="nprf", terms=None, output_attentions=False, routing=None):
        """Causal NPRF attention of the new tokens (query, key, value [B, H, L, d]) to everything the layer has seen,
        advancing its state: the prompt through `nprf_attention(algorithm=...)`, later tokens through the state.
        key_padding_mask: None or bool, True = keep, [B, past + L] (as generate() passes it; the past must agree with
        what the cache saw) or [B, L] (a compiled step's one shape). buckets: the layer's `CausalBuckets` (its
        unidirectional [H, num_buckets] table and band width W); projection: [H, m, d] or [m, d]; terms: feature
        terms only (`nprf_terms.AttentionTerms`); variant: one whose kernel factors into features. Returns
        [B, H, L, d], and with output_attentions the weights [B, H, L, max_cache_len] (zero past the tokens seen) from
        the keys an NPRFStaticCache with `max_cache_len` keeps (a ValueError for a cache that keeps none)."""
        terms = AttentionTerms() if terms is None else terms
        if variant in KEY_VALUE_CACHE_VARIANTS:
            raise ValueError(f"NPRFCache's running sums hold features: attention_variant={variant!r} decodes with "
                             "cache_implementation='dynamic' (the default for it)")
        if terms.pair_terms:
            raise ValueError(f"NPRFCache's recurrent state applies feature terms only, not {terms.pair_terms[0].name}")
        terms.check(query.shape[0], query.shape[1], query.shape[2], True, variant)
        layer, batch, length = self.layer(layer_idx), query.shape[0], query.shape[2]
        prefill = not layer.has_state
        mask = layer.check_mask(layer_idx, batch, length, key_padding_mask, projection)
        new_mask = None if mask is None else mask[:, mask.shape[-1] - length :]  # (the whole sequence's, or theirs)
        threads = threads_for(query.device, routing)  # the math's edge: this call's threads (`Routing.cpu_threads`)
        if hasattr(self, "thread_choice"):  # and the model's next decode steps' (a cache pickled before has none)
            self.thread_choice.enabled = routing is None or routing.cpu_threads
        if prefill:  # the fast exact algorithms over the prompt, then the state from its keys
            bias = relative_position_bias(buckets.table, length, False, buckets.num_buckets, buckets.max_distance,
                                          threads)
            out = nprf_attention(query, key, value, bias, projection, key_padding_mask=mask, algorithm=algorithm,
                                 causal=True, band_width=buckets.band_width, variant=variant, terms=terms,
                                 routing=routing)
            phi_k, u = key_features_and_values(key, value, new_mask, projection, variant, terms.logit_scale, threads)
            state = recurrent_state_from_prefill(phi_k, u, buckets.band_width)
        else:
            state = (layer.far_states, layer.ring_features, layer.ring_values)
            out, state = recurrent_step(query, key, value, new_mask, state, buckets, projection, algorithm, variant,
                                        terms, routing, threads)
        if output_attentions or layer.max_cache_len is not None:
            weights = layer.kept_key_weights(layer_idx, query, key, value, new_mask, buckets, projection, variant,
                                             terms, output_attentions)
        real = torch.full((batch,), length, device=query.device) if new_mask is None else new_mask.sum(-1)
        layer.store(*state, real, length)
        if not torch.compiler.is_compiling():  # storage ids cannot be traced; generate() keeps the projection anyway
            layer.projection_id = _projection_id(projection)
        return (out, weights) if output_attentions else out


class NPRFCache(NPRFCacheMixin, DynamicCache):
    """Constant-size cache of NPRF decoder self-attention for `generate()`: per layer the far sums S, z and the last
    W - 1 keys' features and values, so a token costs O(W (m + d) + m d) per head whatever the context. A
    `DynamicCache` to transformers (not compiled by generate()), keeping no keys. config: the model's, or None."""


class NPRFStaticCache(NPRFCacheMixin, StaticCache):
    """`NPRFCache`'s state written in place so the decode step compiles, one graph for every context length: what
    `generate(..., cache_implementation="static")` builds, a `StaticCache` to transformers. With `max_cache_len`
    (when `output_attentions=True`) it also keeps every key and value, [B, H, max_cache_len, d], for the weights."""

    layer_class = NPRFStaticCacheLayer

    def __init__(self, config=None, max_cache_len=None):
        super().__init__(config, max_cache_len=max_cache_len)


def _projection_id(projection):
    """Identity of a projection's values: storage and version counter (bumped by a redraw or load_state_dict)."""
    return (projection.data_ptr(), projection._version, projection.dtype, projection.device)


def find_nprf_cache(past_key_values):
    """The NPRF cache in `past_key_values` (itself, or an EncoderDecoderCache's self-attention part), or None."""
    cache = getattr(past_key_values, "self_attention_cache", past_key_values)
    return cache if isinstance(cache, NPRFCacheMixin) else None


def default_decoder_cache(config, cross_attention=False, static=False, max_cache_len=None):
    """The cache of an NPRF decoder given none: an NPRFCache (an NPRFStaticCache when `static`) for self-attention,
    plus a DynamicCache for HF's cross-attention; for the variants whose kernels are not all features to sum
    (`KEY_VALUE_CACHE_VARIANTS`), HF's growing key/value cache."""
    if config.attention_variant in KEY_VALUE_CACHE_VARIANTS:
        cache = DynamicCache(config=config)
    else:
        cache = NPRFStaticCache(config, max_cache_len) if static else NPRFCache(config)
    return EncoderDecoderCache(cache, DynamicCache(config=config)) if cross_attention else cache


class NPRFGenerationMixin:
    """generate() of the NPRF decoders: an NPRFCache unless told otherwise, no feature redraw while generating, and
    RoBERTa's position numbering. `cache_implementation="static"`: an NPRFStaticCache, a compiled decode step (on
    CUDA, or wherever `compile_config._compile_all_devices`). `"dynamic"` (or a Cache passed to generate):
    HF's growing key/value cache, which NPRF attention also reads (recomputing over every key at each step);
    assisted generation (which crops) and `output_attentions=True` get it too, unless the latter asks for "static"."""

    def __call__(self, *args, **kwargs):
        """A decode step through an NPRF cache (one new token per sequence) runs on the CPU threads its cache's earlier
        steps ran faster with (`nprf_cpu_threads.ThreadChoice`); anything else, and a traced call, as
        `nn.Module.__call__` (a model compiled in place, `model.compile()`, is timed as an eager one)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # either name: callers may use the older one
        cache = None if torch.compiler.is_compiling() else find_nprf_cache(cache)
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
            raise ValueError(f"cache_implementation={implementation!r} is not supported by NPRF decoders: leave it "
                             "unset (NPRFCache, constant size), use 'static' (NPRFStaticCache: the same state, a "
                             "compileable decode step) or 'dynamic' (a growing key/value cache)")
        assisted = getattr(generation_mode, "value", generation_mode) == "assisted_generation"
        assisted = assisted or generation_config.is_assistant
        builds = model_kwargs.get(CACHE_ARGUMENT) is None and generation_config.use_cache is not False
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
            model_kwargs[CACHE_ARGUMENT] = default_decoder_cache(
                self.config, cross_attention, static=implementation == "static", max_cache_len=max_cache_len
            )
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, *args, **kwargs):
        """The attention mask of one step when the cache is compileable (transformers builds it here then). An NPRF
        cache reads only the new tokens' padding, the last L columns of the 2D mask: one shape at every decode step
        (no recompile as the context grows), and none without padding (transformers' 4D causal mask would look
        general to a compiled step). Args as `transformers.masking_utils.create_masks_for_generate`."""
        cache = args[0] if args else kwargs.get(CACHE_ARGUMENT)  # transformers passes it by name
        if find_nprf_cache(cache) is None or (attention_mask is not None and attention_mask.dim() != 2):
            return create_masks_for_generate(config, inputs_embeds, attention_mask, *args, **kwargs)
        # a copy: the slice's strides follow the growing mask, which a compiled step would recompile for
        new = None if attention_mask is None else attention_mask[:, attention_mask.shape[-1] - inputs_embeds.shape[1] :]
        return None if new is None else new.clone(memory_format=torch.contiguous_format)

    def prepare_inputs_for_generation(self, input_ids, *, attention_mask=None, inputs_embeds=None, **kwargs):
        """transformers' inputs of one step, with `position_ids` in the numbering of the embeddings. generate()
        numbers from 0 over the real tokens (`attention_mask.cumsum(-1) - 1`), given ids or not; RoBERTa's embeddings
        from padding_idx + 1: shifted here, the one place every step goes through, so explicit and implicit ids agree
        with a forward pass without position_ids. Keywords as transformers' (generate passes them by name; whether
        `inputs_embeds` is taken it reads from this signature), the cache named `CACHE_ARGUMENT`."""
        model_inputs = super().prepare_inputs_for_generation(input_ids, attention_mask=attention_mask,
                                                             inputs_embeds=inputs_embeds, **kwargs)
        position_ids = model_inputs.get("position_ids")
        padding_idx = getattr(getattr(self.base_model, "embeddings", None), "padding_idx", None)
        if padding_idx is None or position_ids is None:  # padding_idx: families whose positions start after it
            return model_inputs
        shifted = position_ids + padding_idx + 1
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[0] == shifted.shape[0]:
            shifted = shifted.masked_fill(attention_mask[:, -shifted.shape[-1] :] == 0, padding_idx)  # (its last)
        model_inputs["position_ids"] = shifted
        return model_inputs

    def generate(self, *args, **kwargs):
        # A redraw would change phi for the keys already in the cache (and the sequence's own attention midway).
        previous = {module: module.redraw_suspended for module in self.modules() if hasattr(module, "redraw_suspended")}
        for module in previous:
            module.redraw_suspended = True
        try:
            return super().generate(*args, **kwargs)
        finally:
            for module, value in previous.items():
                module.redraw_suspended = value


__all__ = [
    "NPRFCache", "NPRFGenerationMixin", "NPRFCacheLayer", "NPRFStaticCache", "NPRFStaticCacheLayer",
    "causal_distance_bias", "recurrent_attention", "recurrent_state_from_prefill",
]
