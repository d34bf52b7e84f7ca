# coding=utf-8
"""NPRF attention with relative positional encoding: the public functions and their input checks; what runs a
call (algorithm, band width, execution mode, PyTorch or the Triton kernels) is decided in `nprf_dispatch`, whose
table PRODUCTS holds every product (one `ToeplitzCall` each) and the whole-attention kernels.

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

Nothing here holds state: every function takes tensors and returns tensors. This is the edge of the math around an
attention call: the CPU's thread pool and thread controls (`nprf_cpu_threads`) are chosen here, once per call, and
passed in as the call's `nprf_schedule` scheduler (`Routing.cpu_threads=False`: torch's own threads).
"""

from typing import Optional

import torch

from .nprf_cpu_split import attention_in_items
from .nprf_cpu_threads import threads_for
from .nprf_dense import exact_kernel, key_lengths
from .nprf_dispatch import RECOMPUTE_MIN_BYTES  # noqa: F401  (public here: the rule is `nprf_dispatch.choose_route`)
from .nprf_dispatch import ROUTING, AttentionCall, Routing, ToeplitzCall, choose_route, run_attention, toeplitz_product
from .nprf_dispatch import resolve_algorithm as _resolve_algorithm  # noqa: F401  (tests and benchmarks read it here)
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
from .options import ALGORITHMS  # noqa: F401  (the PyTorch algorithms: read here by tests and benchmarks)
from .nprf_near_field import near_field_correction, near_field_inputs, near_field_kernel
from .options import ATTENTION_ALGORITHMS, ATTENTION_VARIANTS, NEAR_FIELD_VARIANTS, QUADRATIC_VARIANTS
from .options import WEIGHTS_ALGORITHMS


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
    near_field_width: Optional[int] = None,
    routing: Optional[Routing] = None,
):
    """Normalized positive random feature attention with a relative position bias.

    Args:
        query, key: [B, H, n, d] (L2-normalized here). value: [B, H, n, d_v].
        rpe_bias: [H, 2n - 1]; entry r + n - 1 holds b_r for r = j - i.
        projection: [m, d] or [H, m, d].
        key_padding_mask: [B, n], bool or 0/1; True/1 = keep. Padded keys count in neither sum.
        algorithm: "auto", "dense", "fft", "banded" or "triton" (all exact; they differ in speed only). "triton"
            runs on CUDA tensors (CPU ones under TRITON_INTERPRET=1), and "auto" picks it there (eager or compiled); a
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
            feature map (same algorithms and terms); "nprf_near" weighs the pairs with |j - i| < near_field_width
            by the exact kernel exp(s q_hat . k_hat) and the rest by NPRF's estimate (`nprf_near_field`; every
            PyTorch algorithm, linear cost); "normalized_softmax" and "softmax" compute the exact kernels
            exp(s q_hat . k_hat) and exp(q . k / sqrt(d)) from the n x n weights (`nprf_attention_weights`).
        terms: the optional terms as one `nprf_terms.AttentionTerms` (what the models pass), instead of the
            keyword pairs logit_scale, segment_ids / segment_bias, token_ids / match_weight and num_segments.
        near_field_width: variant "nprf_near": the pairs with |j - i| below it use the exact kernel; None = the
            band width (given, or inferred from the bias).
        routing: what "auto" reads (`nprf_dispatch.Routing`: crossovers, kernel devices, recompute size) and whether
            a CPU call runs on the package's threads (`cpu_threads`); None = `nprf_dispatch.ROUTING`.
    Returns:
        [B, H, n, d_v]. Queries with no key to attend to give zeros.
    """
    # The math picks its own precision (float32 for half inputs): under autocast, matmuls would otherwise
    # come back in half precision and the in-place products would mix dtypes.
    with torch.autocast(query.device.type, enabled=False):
        terms = _terms(terms, logit_scale, segment_ids, segment_bias, token_ids, match_weight, num_segments)
        # (its biases are set once the inputs are checked: `_attention`)
        call = AttentionCall(query, key, value, rpe_bias, None, projection, key_padding_mask, terms, causal, variant,
                             band_width, recompute, near_field_width=near_field_width,
                             routing=ROUTING if routing is None else routing)
        return _attention(call, algorithm)


def _terms(terms, logit_scale, segment_ids, segment_bias, token_ids, match_weight, num_segments):
    """`terms`, or the terms of the keyword pairs (not both)."""
    keywords = (logit_scale, segment_ids, segment_bias, token_ids, match_weight)
    if terms is None:
        return AttentionTerms.from_arguments(logit_scale, segment_ids, segment_bias, token_ids, match_weight, num_segments)
    if any(value is not None for value in keywords):
        raise ValueError("give the optional terms either as terms= or as keyword arguments (logit_scale, "
                         "segment_ids, ...), not both")
    return terms


def _attention(call, algorithm):
    """`nprf_attention` of `call`, its arguments as given (`bias` unset), autocast off."""
    query = call.query
    batch, heads, n, _ = _check_inputs(query, call.key, call.value, call.rpe_bias, call.projection,
                                       call.key_padding_mask, algorithm)
    _check_variant(call.variant, algorithm, call.near_field_width)
    call.terms.check(batch, heads, n, call.causal, call.variant)
    dtype = compute_dtype(query.dtype)
    threads = threads_for(query.device, call.routing)
    with threads.small():  # [H, 2n - 1] biases: operators too small to split (each split a barrier)
        rpe_bias = call.rpe_bias.to(dtype)
        call = call._replace(rpe_bias=rpe_bias, bias=masked_bias(rpe_bias, n, call.causal), threads=threads)
        route = choose_route(call, algorithm)
    # (the CPU's items where the route's row allows: the kernels and the n x n weights run whole)
    return attention_in_items(call, route, _run) if toeplitz_product(route, True).items else _run(call, route)


def _run(call, route):
    return run_attention(call, route, _nprf_attention)


def _nprf_attention(call, route):
    """`nprf_attention` once its inputs are checked and its route chosen (`nprf_dispatch`): the features, the route's
    Toeplitz product with the terms, the division; `call.bias` [H, 2n - 1] has -inf for the future when causal."""
    query, key, terms, causal, threads = call.query, call.key, call.terms, call.causal, call.threads
    batch, heads, n, _ = query.shape
    dtype = compute_dtype(query.dtype)
    with threads.small():  # [B, n] masks and [H, 2n - 1] coefficients: too small to split
        mask = None if call.key_padding_mask is None else call.key_padding_mask.to(device=query.device, dtype=dtype)
        c, shift = toeplitz_coefficients(call.bias)
        valid = rows_with_keys(mask, causal)
    value = call.value.to(dtype)
    logit_scale = terms.logit_scale
    near = call.variant in NEAR_FIELD_VARIANTS
    near_width = None
    if near:  # (the band width: given, resolved, or inferred from the bias)
        near_width = call.near_field_width or route.band_width or infer_band_width(call.bias.detach(), n)
    # Without autograd through the product's own inputs (the features read the mask too), its "inference" row. Only
    # those count here, not the route's: a training segment bias or match weight multiplies the product's output
    # and needs no graph inside it.
    inference = not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad
        for t in (query, key, value, c, call.projection, mask, logit_scale, *terms.tensors(inside_product=True))
    )
    product = toeplitz_product(route, inference)
    if product.weights:  # the n x n weights: an exact kernel, or every term as in the weights
        weights = _weights(query, key, call.bias, call.projection, mask, causal, terms, call.variant, near_width)
        return (weights @ value).to(query.dtype)
    # The near field inside the product where it can read it (the pair terms scale the keys it is given, which the
    # exact kernel's keys would miss); else the band's correction of the product's sums.
    reads_near = near and product.near and not terms.pair_terms
    band_width = route.band_width
    if reads_near:  # the banded window must hold the near pairs
        band_width = max(band_width or near_width, near_width)
    lengths = key_lengths(mask, batch, n) if product.in_cache else None  # (a host sync)
    units = []  # the near field's unit vectors: the feature map computes them anyway
    if reads_near and product.in_cache and near_width >= n:  # every pair near: no features to compute
        phi_q = phi_k = None
    else:  # (with the near field, a product may read the features of a few rows only)
        rows = product.feature_rows(n, near_width) if reads_near and product.feature_rows else None
        phi_q, phi_k = query_key_features(query, key, call.projection, mask, dtype, logit_scale, product.head_major,
                                          call.variant, units if reads_near else None, rows)
    near_field = near_field_inputs(query, key, mask, logit_scale, near_width, dtype, units) if reads_near else None
    if product.in_cache and not terms.pair_terms and (near_field is not None or not near):  # it divides in cache too
        return product.run(ToeplitzCall(phi_q, phi_k, value, c, lengths=lengths, normalized=True, near=near_field,
                                        threads=threads)).to(query.dtype)
    u = values_and_ones(value, threads=threads) if product.reads_u else None
    out = terms.product(
        lambda keys: product.run(ToeplitzCall(phi_q, keys, value, c, u, causal, band_width, lengths, near=near_field,
                                              threads=threads)),
        phi_q, phi_k, lambda: values_and_ones(value, threads=threads) if u is None else u, shift, product.pairwise,
        dtype,
    )
    if near and near_field is None:  # the band's pairs: the exact kernel in place of the estimate
        u = values_and_ones(value, threads=threads) if u is None else u
        near_field = near_field_inputs(query, key, mask, logit_scale, near_width, dtype)
        out = out + near_field_correction(near_field, phi_q, phi_k, u, c, causal, terms, shift, dtype)
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
    near_field_width: Optional[int] = None,
):
    """The attention matrix implied by `nprf_attention` (same arguments), computed densely.

    Returns:
        [B, H, n, n]; row i holds the weights of the keys for query i (rows sum to 1, rows with no
        key to attend to are zero).
    """
    with torch.autocast(query.device.type, enabled=False):
        batch, heads, n, _ = _check_inputs(query, key, key, rpe_bias, projection, key_padding_mask, "dense")
        _check_variant(variant, "dense", near_field_width)
        terms = _terms(terms, logit_scale, segment_ids, segment_bias, token_ids, match_weight, None)
        terms.check(batch, heads, n, causal, variant)
        return _attention_weights(query, key, rpe_bias, projection, key_padding_mask, causal, terms, variant,
                                  near_field_width)


def _attention_weights(query, key, rpe_bias, projection, key_padding_mask, causal, terms, variant,
                       near_field_width=None):
    """`nprf_attention_weights` once its inputs are checked."""
    n = query.shape[-2]
    dtype = compute_dtype(query.dtype)
    mask = None if key_padding_mask is None else key_padding_mask.to(device=query.device, dtype=dtype)
    bias = masked_bias(rpe_bias.to(dtype), n, causal)
    if variant in NEAR_FIELD_VARIANTS and near_field_width is None:
        near_field_width = infer_band_width(rpe_bias.detach(), n)
    return _weights(query, key, bias, projection, mask, causal, terms, variant, near_field_width).to(query.dtype)


def _weights(query, key, bias, projection, mask, causal, terms, variant, near_field_width):
    """[B, H, n, n] row-normalized weights in the compute dtype, from the (causally masked) bias [H, 2n - 1] and the
    float mask [B, n] or None."""
    n = query.shape[-2]
    dtype = compute_dtype(query.dtype)
    c, shift = toeplitz_coefficients(bias)
    if variant in QUADRATIC_VARIANTS:
        kernel = exact_kernel(query.to(dtype), key.to(dtype), mask, causal, terms.logit_scale, variant)
    else:
        near, units = variant in NEAR_FIELD_VARIANTS, []  # (the feature map's unit vectors serve the near field)
        phi_q, phi_k = query_key_features(query, key, projection, mask, dtype, terms.logit_scale, variant=variant,
                                          units=units if near else None)
        if near:  # (its kernel computes phi_q phi_k^T beyond the band itself)
            near = near_field_inputs(query, key, mask, terms.logit_scale, near_field_width, dtype, units)
            kernel = near_field_kernel(phi_q, phi_k, near)
        else:
            kernel = phi_q @ phi_k.transpose(-1, -2)
    weights = terms.weights(kernel, toeplitz_matrix(c, n), shift, dtype)
    return normalize_attention(weights, weights.sum(-1, keepdim=True))


def _check_variant(variant, algorithm, near_field_width=None):
    if variant not in ATTENTION_VARIANTS:
        raise ValueError(f"variant={variant!r} is not supported; allowed: one of {', '.join(ATTENTION_VARIANTS)}")
    if near_field_width is not None and (not isinstance(near_field_width, int) or near_field_width < 1):
        raise ValueError(f"near_field_width must be a positive integer (None: the band width), got {near_field_width!r}")
    if variant in QUADRATIC_VARIANTS and algorithm not in WEIGHTS_ALGORITHMS:
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
