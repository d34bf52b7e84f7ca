# coding=utf-8
"""NPRF attention with relative positional encoding: the public functions and their input checks; what runs a
call (algorithm, band width, PyTorch or the Triton kernels) is decided in `nprf_dispatch`.

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative Positional Encoding"
(NeurIPS 2021). Per head, with n tokens, head size d and m random features:

    z_i = sum_j c_{j-i} phi(q_i) . phi(k_j) v_j  /  sum_j c_{j-i} phi(q_i) . phi(k_j),   c_r = exp(b_r)

where q, k are L2-normalized, phi is the positive random feature map of the softmax kernel and
b_r is a (T5-bucketed) relative position bias. The Toeplitz matrix C = [c_{j-i}] is applied by one
of three exact algorithms, a file each: "dense" (`nprf_dense`: n x n weights), "fft" (`nprf_fft`: the
paper's Toeplitz product through real FFTs) and "banded" (`nprf_banded`: C = far constants + a band;
its lean training mode, features rebuilt in backward, in `nprf_banded_recompute`); "triton" is the banded
product as fused GPU kernels (`nprf_triton`, kernels in `nprf_triton_kernels`). The feature maps are in
`nprf_features`, positions in `nprf_positions`, the optional terms (logit scale, segment bias, word matching)
in `nprf_terms`, the recurrent decoding step in `nprf_recurrent`, and the float64
reference every algorithm is tested against in `nprf_naive`.

Nothing here holds state: every function takes tensors and returns tensors.
"""

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .nprf_banded import banded_toeplitz_attention
from .nprf_banded_recompute import banded_attention_recomputed
from .nprf_cpu_threads import single_threaded
from .nprf_dense import dense_toeplitz_attention, dense_toeplitz_inference, dense_toeplitz_training, exact_kernel
from .nprf_dense import key_lengths
from .nprf_features import (  # noqa: F401  (draw_projection, positive_random_features, normalize_attention)
    compute_dtype,
    draw_projection,
    normalize_attention,
    positive_random_features,
    query_key_features,
    rows_with_keys,
    values_and_ones,
    variant_features,
)
from .nprf_fft import fft_toeplitz_attention
from .nprf_positions import (  # noqa: F401  (the bias helpers: public here)
    far_bucket_table,
    infer_band_width,
    masked_bias,
    relative_position_bias,
    rpe_band_width,
    t5_relative_position_bucket,
    toeplitz_coefficients,
    toeplitz_matrix,
)
from .nprf_terms import AttentionTerms
from .nprf_dispatch import kernel_or_auto
from .nprf_dispatch import resolve_algorithm as _resolve_algorithm  # noqa: F401  (tests and benchmarks read it here)
from .nprf_triton import disable_triton, triton_attention
from .options import ALGORITHMS  # noqa: F401  (the PyTorch algorithms: read here by tests and benchmarks)
from .options import ATTENTION_ALGORITHMS, ATTENTION_VARIANTS, QUADRATIC_VARIANTS


# `recompute=None` recomputes the banded / fft attention in backward from this size of one call's [B, H, n, m]
# features on (16 MiB: B x n = 5,461 tokens at H = 12, m = 64): the about ten feature-sized tensors a layer
# would keep matter there, while for short batches the second forward costs time for little memory (a MiniLM
# training step at 8 x 512 took 1.46x SDPA's with it, 1.33x without).
RECOMPUTE_MIN_BYTES = 16 << 20


def nprf_attention(
    query,
    key,
    value,
    rpe_bias,
    projection,
    key_padding_mask=None,
    algorithm="auto",
    causal=False,
    band_width: Optional[int] = None,
    logit_scale: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    segment_bias: Optional[torch.Tensor] = None,
    token_ids: Optional[torch.Tensor] = None,
    match_weight: Optional[torch.Tensor] = None,
    recompute: Optional[bool] = None,
    num_segments: Optional[int] = None,
    variant: str = "nprf",
    terms: Optional[AttentionTerms] = None,
):
    """Normalized positive random feature attention with a relative position bias.

    Args:
        query, key: [B, H, n, d] (L2-normalized here). value: [B, H, n, d_v].
        rpe_bias: [H, 2n - 1]; entry r + n - 1 holds b_r for r = j - i.
        projection: [m, d] or [H, m, d].
        key_padding_mask: [B, n], bool or 0/1; True/1 = keep. Padded keys count in neither sum.
        algorithm: "auto", "dense", "fft", "banded" or "triton" (all exact; they differ in speed only). "triton"
            runs on CUDA tensors (CPU ones under TRITON_INTERPRET=1), and "auto" picks it there in eager mode; a
            call with a term it does not fuse (segment bias, word matching, first-key bias), another variant or a
            projection that requires grad runs the PyTorch algorithms, said once in the log.
        causal: drop keys after the query (j > i).
        band_width: W of the bias's tied structure (b_r constant for r >= W and for r <= -W), e.g.
            `rpe_band_width(...)` for a T5 bucket table. None infers it from the values. The banded
            algorithm sends the gradient of the constant tails to the outermost entries (r = +-(n-1)),
            which is exact for a bias tied beyond W; so a bias that requires grad needs band_width
            for "banded" (and "auto" only uses banded then).
        logit_scale: None (the paper: content logits q_hat . k_hat in [-1, 1]) or s [H] > 0, a per-head
            scale of the normalized logits: the kernel becomes exp(s q_hat . k_hat), estimated with
            features of norm sqrt(s) (the estimate's variance grows with s).
        segment_ids: None or [B, n] integer segment of every token (e.g. token_type_ids of a sentence
            pair), with `segment_bias` [H]: beta_h is added to the bias of every query/key pair in
            different segments. exp of a sum is a product, so the Toeplitz product splits exactly into
            one product per key segment (cost x number of segments).
        token_ids: None or [B, n] token ids, with `match_weight` mu [H] >= 0 (and segment_ids): the
            weight of a query and a key that are the same token in different segments becomes
            phi_q . phi_k (exp(b_{j-i}) + mu), an exact word-matching term. Linear time: the keys'
            phi_k u^T are summed per (token, segment) group and each query reads the groups of its own
            token in the other segments.
        recompute: under autograd, keep only the inputs (and for "banded" the output) for backward: the
            [B, H, n, m] features and their padded copies are then not held from forward to backward. "banded"
            rebuilds only the features in backward (`nprf_banded_recompute`; with a trained segment bias, whose
            gradient reads the product's value, as the others do); the others recompute the whole call there.
            None = for the "banded" and "fft" algorithms once the features take RECOMPUTE_MIN_BYTES (long
            inputs, where they are most of a layer's activations), not for "dense". Ignored under torch.compile.
        num_segments: None or S, when every segment id is known to lie in [0, S) (e.g. token types below
            `type_vocab_size`). Only read under torch.compile, where the segments present cannot be read
            on the host: one product per possible segment then (an absent segment adds exact zeros).
        variant: one of `options.ATTENTION_VARIANTS`: "nprf" (the above); "prf" and "elu_linear" replace the
            feature map (same algorithms and terms); "normalized_softmax" and "softmax" compute the exact kernels
            exp(s q_hat . k_hat) and exp(q . k / sqrt(d)) from the n x n weights (`nprf_attention_weights`).
        terms: the optional terms as one `nprf_terms.AttentionTerms` (what the models pass), instead of the
            keyword pairs logit_scale, segment_ids / segment_bias, token_ids / match_weight and num_segments.
    Returns:
        [B, H, n, d_v]. Queries with no key to attend to give zeros.
    """
    # The math picks its own precision (float32 for half inputs): under autocast, matmuls would otherwise
    # come back in half precision and the in-place products would mix dtypes.
    with torch.autocast(query.device.type, enabled=False):
        terms = _terms(terms, logit_scale, segment_ids, segment_bias, token_ids, match_weight, num_segments)
        return _attention(
            query, key, value, rpe_bias, projection, key_padding_mask, algorithm, causal, band_width, terms, recompute,
            variant,
        )


def _terms(terms, logit_scale, segment_ids, segment_bias, token_ids, match_weight, num_segments):
    """`terms`, or the terms of the keyword pairs (not both)."""
    keywords = (logit_scale, segment_ids, segment_bias, token_ids, match_weight)
    if terms is None:
        return AttentionTerms.from_arguments(logit_scale, segment_ids, segment_bias, token_ids, match_weight, num_segments)
    if any(value is not None for value in keywords):
        raise ValueError("give the optional terms either as terms= or as keyword arguments (logit_scale, "
                         "segment_ids, ...), not both")
    return terms


def _attention(query, key, value, rpe_bias, projection, key_padding_mask, algorithm, causal, band_width, terms, recompute,
               variant):
    """`nprf_attention` (its arguments, the terms as one object), autocast off."""
    batch, heads, n, head_dim = _check_inputs(query, key, value, rpe_bias, projection, key_padding_mask, algorithm)
    _check_variant(variant, algorithm)
    terms.check(batch, heads, n, causal, variant)
    if variant in QUADRATIC_VARIANTS:
        weights = _attention_weights(query, key, rpe_bias, projection, key_padding_mask, causal, terms, variant)
        dtype = compute_dtype(value.dtype)
        return (weights.to(dtype) @ value.to(dtype)).to(value.dtype)
    dtype = compute_dtype(query.dtype)
    with single_threaded(query.device):  # [H, 2n - 1] biases: operators too small to split (each split a barrier)
        rpe_bias = rpe_bias.to(dtype)
        bias = masked_bias(rpe_bias, n, causal)
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, bias, projection, *terms.tensors())
        )
        requested, given_band_width = algorithm, band_width
        algorithm = kernel_or_auto(algorithm, query, projection, variant, terms)
        algorithm, band_width = _resolve_algorithm(
            algorithm, bias, n, band_width, projection.shape[-2], value.shape[-1] + 1, inference=not needs_grad
        )
    inputs = (query, key, value, bias, projection, key_padding_mask, terms)
    if algorithm == "triton":
        try:
            return triton_attention(query, key, value, rpe_bias, projection, key_padding_mask, terms.logit_scale,
                                    band_width, causal)
        except Exception as error:  # noqa: BLE001
            if requested == "triton" or isinstance(error, torch.OutOfMemoryError):  # (PyTorch's path needs more)
                raise
            # "auto" chose kernels that failed to build or launch on this device: the model still runs, said once
            disable_triton(f"the kernels failed here ({type(error).__name__}: {error})")
            algorithm, band_width = _resolve_algorithm(
                "auto", bias, n, given_band_width, projection.shape[-2], value.shape[-1] + 1, inference=not needs_grad
            )
    if recompute is None:
        feature_bytes = batch * heads * n * projection.shape[-2] * torch.finfo(dtype).bits // 8
        recompute = algorithm in ("banded", "fft") and feature_bytes >= RECOMPUTE_MIN_BYTES
    # (not under torch.compile, whose partitioner decides itself what backward recomputes)
    if not (recompute and needs_grad and not torch.compiler.is_compiling()):
        return _nprf_attention(*inputs, algorithm, band_width, causal, variant)
    if algorithm == "banded" and not terms.product_value_read():  # features rebuilt, the product's forward not rerun
        # the unmasked bias (the Function masks it itself): a causally masked copy would keep its mask per layer
        return banded_attention_recomputed(query, key, value, rpe_bias, projection, key_padding_mask, terms,
                                           band_width, causal, variant)
    # No random numbers inside: the recomputation repeats the forward exactly without saving RNG state.
    return checkpoint(
        _nprf_attention, *inputs, algorithm, band_width, causal, variant, use_reentrant=False, preserve_rng_state=False,
    )


def _nprf_attention(query, key, value, bias, projection, key_padding_mask, terms, algorithm, band_width, causal, variant):
    """`nprf_attention` once its inputs are checked and the algorithm chosen; `bias` [H, 2n - 1] has -inf for
    the future when causal."""
    batch, heads, n, _ = query.shape
    dtype = compute_dtype(query.dtype)
    with single_threaded(query.device):  # [B, n] masks and [H, 2n - 1] coefficients: too small to split
        mask = None if key_padding_mask is None else key_padding_mask.to(device=query.device, dtype=dtype)
        c, shift = toeplitz_coefficients(bias)
        valid = rows_with_keys(mask, causal)
    value = value.to(dtype)
    logit_scale = terms.logit_scale
    # Without autograd the dense product runs head by head in cache and skips the keys after the last kept one
    # (a host sync, hence eager only). Only the product's own inputs count here, not the wrapper's `needs_grad`:
    # a training segment bias or match weight multiplies the product's output and needs no graph inside it.
    inference = not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad
        for t in (query, key, value, c, projection, logit_scale, *terms.tensors(inside_product=True))
    )
    # Eager dense runs in cache (a few heads at a time; training rebuilds the n x n weights in backward instead of
    # keeping them) and skips the keys after each sequence's last kept one: `lengths`, a host sync.
    lengths = None
    if algorithm == "dense" and not torch.compiler.is_compiling():
        lengths = key_lengths(mask, batch, n)
    in_cache = None if lengths is None else dense_toeplitz_inference if inference else dense_toeplitz_training
    head_major = in_cache is dense_toeplitz_inference
    phi_q, phi_k = query_key_features(query, key, projection, mask, dtype, logit_scale, head_major, variant)
    if in_cache is not None and not terms.pair_terms:  # the product alone: it divides in cache too
        return in_cache(phi_q, phi_k, value, c, lengths, normalized=True).to(query.dtype)
    u = None if algorithm == "banded" or in_cache is not None else values_and_ones(value)

    def toeplitz_product(keys):
        if in_cache is not None:
            return in_cache(phi_q, keys, value, c, lengths)
        if algorithm == "dense":
            return dense_toeplitz_attention(phi_q, keys, u, c)
        if algorithm == "fft":
            return fft_toeplitz_attention(phi_q, keys, u, c)
        return banded_toeplitz_attention(phi_q, keys, value, c, band_width, causal)

    out = terms.product(
        toeplitz_product, phi_q, phi_k, lambda: values_and_ones(value) if u is None else u, shift, algorithm, dtype
    )
    in_place = not (torch.is_grad_enabled() and out.requires_grad)  # inference: no new [B, H, n, d_v] tensor
    return normalize_attention(out[..., :-1], out[..., -1:], valid, in_place).to(query.dtype)


def nprf_attention_weights(
    query,
    key,
    rpe_bias,
    projection,
    key_padding_mask=None,
    causal=False,
    logit_scale=None,
    segment_ids=None,
    segment_bias=None,
    token_ids=None,
    match_weight=None,
    variant="nprf",
    terms: Optional[AttentionTerms] = None,
):
    """The attention matrix implied by `nprf_attention` (same arguments), computed densely.

    Returns:
        [B, H, n, n]; row i holds the weights of the keys for query i (rows sum to 1, rows with no
        key to attend to are zero).
    """
    with torch.autocast(query.device.type, enabled=False):
        batch, heads, n, _ = _check_inputs(query, key, key, rpe_bias, projection, key_padding_mask, "dense")
        _check_variant(variant, "dense")
        terms = _terms(terms, logit_scale, segment_ids, segment_bias, token_ids, match_weight, None)
        terms.check(batch, heads, n, causal, variant)
        return _attention_weights(query, key, rpe_bias, projection, key_padding_mask, causal, terms, variant)


def _attention_weights(query, key, rpe_bias, projection, key_padding_mask, causal, terms, variant):
    """`nprf_attention_weights` once its inputs are checked."""
    n = query.shape[-2]
    dtype = compute_dtype(query.dtype)
    mask = None if key_padding_mask is None else key_padding_mask.to(device=query.device, dtype=dtype)
    c, shift = toeplitz_coefficients(masked_bias(rpe_bias.to(dtype), n, causal))
    if variant in QUADRATIC_VARIANTS:
        kernel = exact_kernel(query.to(dtype), key.to(dtype), mask, causal, terms.logit_scale, variant)
    else:
        phi_q, phi_k = query_key_features(query, key, projection, mask, dtype, terms.logit_scale, variant=variant)
        kernel = phi_q @ phi_k.transpose(-1, -2)
    weights = terms.weights(kernel, toeplitz_matrix(c, n), shift, dtype)
    return normalize_attention(weights, weights.sum(-1, keepdim=True)).to(query.dtype)


def _check_variant(variant, algorithm):
    if variant not in ATTENTION_VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; allowed: one of {', '.join(ATTENTION_VARIANTS)}")
    if variant in QUADRATIC_VARIANTS and algorithm not in ("auto", "dense"):
        raise ValueError(f"variant={variant!r} is computed from the dense n x n weights: algorithm must be auto or dense")


def _check_inputs(query, key, value, rpe_bias, projection, key_padding_mask, algorithm):
    if algorithm not in ATTENTION_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ATTENTION_ALGORITHMS}, got {algorithm!r}")
    if query.dim() != 4 or key.shape != query.shape:
        raise ValueError(f"query and key must both be [B, H, n, d], got {tuple(query.shape)} and {tuple(key.shape)}")
    batch, heads, n, head_dim = query.shape
    if value.dim() != 4 or value.shape[:3] != query.shape[:3]:
        raise ValueError(f"value must be [B={batch}, H={heads}, n={n}, d_v], got {tuple(value.shape)}")
    if n < 1:
        raise ValueError("the sequence is empty (n = 0)")
    if rpe_bias.shape != (heads, 2 * n - 1):
        raise ValueError(f"rpe_bias must be [H={heads}, 2n-1={2 * n - 1}], got {tuple(rpe_bias.shape)}")
    if projection.dim() not in (2, 3) or projection.shape[-1] != head_dim or (
        projection.dim() == 3 and projection.shape[0] != heads
    ):
        raise ValueError(f"projection must be [m, d={head_dim}] or [H={heads}, m, d={head_dim}], got {tuple(projection.shape)}")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, n):
            raise ValueError(
                f"key_padding_mask must be [B={batch}, n={n}] (True/1 = keep), got {tuple(key_padding_mask.shape)}"
            )
        if (
            key_padding_mask.dtype != torch.bool
            and not torch.compiler.is_compiling()  # a host sync: checked in eager mode only
            and not bool(((key_padding_mask == 0) | (key_padding_mask == 1)).all())
        ):
            raise ValueError("key_padding_mask must be boolean or hold only 0/1 (1 = keep); got other values")
    return batch, heads, n, head_dim
