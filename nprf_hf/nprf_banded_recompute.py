# coding=utf-8
"""The banded algorithm's lean training mode (long inputs, `recompute`): one autograd.Function around the feature
maps, the banded Toeplitz product with its terms and the normalization, that keeps from forward to backward only
its inputs, its output z and the denominators [B, H, n, 1].

Activation checkpointing of the whole call (what `recompute` does for the other algorithms) would run the product's
forward twice. Backward here rebuilds only the features (two [n, d] x [d, m] matmuls and an exp per head), and the
product's backward (`banded_toeplitz_backward`) needs its inputs, not its output: from z and the denominators the
gradient of the normalization is known, so the product's forward is never run again. The Toeplitz coefficients
c = exp(b - max b) are rebuilt too, from the band of the bias b alone (b is constant beyond it): a [H, 2n - 1]
tensor kept per layer, or even once, is what kept training memory above SDPA's at 16k tokens (1.5 MiB each).
"""

import torch
from torch.autograd.function import once_differentiable

from .nprf_banded import banded_toeplitz_attention, banded_toeplitz_backward
from .nprf_features import (
    compute_dtype,
    empty_like_query,
    kept_denominator,
    query_key_features,
    rows_with_keys,
    values_and_ones,
)
from .nprf_near_field import NearField, near_field_inputs
from .nprf_positions import masked_bias, toeplitz_coefficients
from .nprf_schedule import SERIAL
from .options import NEAR_FIELD_VARIANTS


def banded_attention_recomputed(call, band_width):
    """z [B, H, n, d_v] of the banded algorithm under autograd, the features rebuilt in backward, for `call` (an
    `nprf_dispatch.AttentionCall`; it reads rpe_bias [H, 2n - 1], without the -inf of the future, applied here when
    causal; its terms an `AttentionTerms` whose trained tensors do not read the product's value, see
    `AttentionTerms.product_value_read`) and the resolved band width.

    The output is laid out as query (a [B, H, n, d] view of [B, n, H, d] storage, as the models pass it, gives the
    same view): the models' transpose back to [B, n, H * d] is then free, and the output projection keeps for its
    own backward the very tensor kept here.

    `output_kept_outside`: z is not kept here; before backward the caller sets the Function's `kept_output` (its
    grad_fn's attribute) to a tensor equal to z. `nprf_cpu_split` does, for the items of one call: it keeps the one
    output the call returns, where each item keeping its own z would keep a second copy per layer.

    `call.near_field_width`: with variant "nprf_near" (terms without pair terms) the exact near field's width (None:
    the band width), whose unit vectors are rebuilt in backward with the features. `call.threads`: the banded
    product's `nprf_schedule` scheduler, forward and backward."""
    query, terms, variant = call.query, call.terms, call.variant
    dtype = compute_dtype(query.dtype)
    mask = None if call.key_padding_mask is None else call.key_padding_mask.to(device=query.device, dtype=dtype)
    near_field_width = (call.near_field_width or band_width) if variant in NEAR_FIELD_VARIANTS else None
    if near_field_width is not None:  # the window must hold the near pairs
        band_width = max(band_width, near_field_width)
    setup = (mask, terms, band_width, call.causal, variant, call.output_kept_outside, near_field_width, call.threads)
    return _KeptOutputAttention.apply(setup, query, call.key, call.value, call.rpe_bias, call.projection,
                                      *terms.tensors())


def _product(phi_q, phi_k, value, c, shift, terms, band_width, causal, product, near=None, threads=SERIAL):
    """sum_j w_ij [v_j | 1] [B, H, n, e] with every term, `product(phi_q, keys, value, c, band_width, causal, near,
    threads)` the banded product."""
    return terms.product(
        lambda keys: product(phi_q, keys, value, c, band_width, causal, near, threads), phi_q, phi_k,
        lambda: values_and_ones(value, threads=threads), shift, False, phi_q.dtype,
    )


def _features(query, key, projection, mask, dtype, terms, variant, near_width):
    """(phi_q, phi_k, the `NearField` or None) of the call."""
    units = None if near_width is None else []
    phi_q, phi_k = query_key_features(query, key, projection, mask, dtype, terms.logit_scale, variant=variant,
                                      units=units)
    if near_width is None:
        return phi_q, phi_k, None
    return phi_q, phi_k, near_field_inputs(query, key, mask, terms.logit_scale, near_width, dtype, units)


def _banded_backward(phi_q, phi_k, value, c, band_width, causal, near, threads):
    near_inputs = (None,) * 4 if near is None else (near.query, near.key, near.width, near.key_mask)
    return _BandedBackward.apply(phi_q, phi_k, value, c, band_width, causal, *near_inputs, threads)


class _KeptOutputAttention(torch.autograd.Function):
    """z = numerator / denominator of the banded product of (query, key, value, bias, projection, term tensors),
    see `banded_attention_recomputed`; setup: (mask, terms, band_width, causal, variant, output_kept_outside,
    near_width, threads)."""

    @staticmethod
    def forward(ctx, setup, query, key, value, bias, projection, *term_tensors):
        mask, terms, band_width, causal, variant, output_kept_outside, near_width, threads = setup
        dtype = compute_dtype(query.dtype)
        c, shift = toeplitz_coefficients(masked_bias(bias, query.shape[-2], causal))
        phi_q, phi_k, near = _features(query, key, projection, mask, dtype, terms, variant, near_width)
        out = _product(phi_q, phi_k, value.to(dtype), c, shift, terms, band_width, causal, banded_toeplitz_attention,
                       near, threads)
        del phi_q, phi_k, c, near
        denominator = kept_denominator(out[..., -1:], rows_with_keys(mask, causal))
        z = empty_like_query(query, value.shape[-1], dtype=out.dtype)
        z = torch.div(out[..., :-1], denominator, out=z).to(query.dtype)
        ctx.setup = setup
        kept = None if output_kept_outside else z
        ctx.save_for_backward(query, key, value, _band(bias, band_width), projection, kept, denominator, *term_tensors)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_z):
        mask, terms, band_width, causal, variant, output_kept_outside, near_width, threads = ctx.setup
        query, key, value, band, projection, z, denominator, *term_tensors = ctx.saved_tensors
        if output_kept_outside:
            z, ctx.kept_output = getattr(ctx, "kept_output", None), None
            if z is None:
                raise RuntimeError("the lean banded attention was asked not to keep its output, and no caller gave "
                                   "it back before backward (`kept_output`)")
        bias = _unband(band, query.shape[-2])
        dtype = denominator.dtype
        grad_out = _normalization_backward(grad_z.to(dtype), z.to(dtype), denominator)
        needs = ctx.needs_input_grad[1:]
        inputs = (query, key, value, bias, projection, *term_tensors)
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        query, key, value, bias, projection, *term_tensors = leaves
        terms = terms.with_tensors(term_tensors)
        with torch.enable_grad():
            c, shift = toeplitz_coefficients(masked_bias(bias, query.shape[-2], causal))
            phi_q, phi_k, near = _features(query, key, projection, mask, dtype, terms, variant, near_width)
            out = _product(phi_q, phi_k, value.to(dtype), c, shift, terms, band_width, causal, _banded_backward, near,
                           threads)
            wanted = [leaf for leaf, need in zip(leaves, needs) if need]
            grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, *(next(grads) if need else None for need in needs))


def _band(bias, band_width):
    """[H, 2W + 1] from bias [H, 2n - 1]: b_r for |r| < W and one b_r of each side beyond (where the bias is
    constant: the banded algorithm needs it so), which is all of the bias that backward needs to keep."""
    n = (bias.shape[-1] + 1) // 2
    if band_width >= n:
        return bias
    return torch.cat([bias[:, :1], bias[:, n - band_width : n + band_width - 1], bias[:, -1:]], dim=-1)


def _unband(band, n):
    """The bias [H, 2n - 1] of a `_band`."""
    if band.shape[-1] == 2 * n - 1:
        return band
    heads, far = band.shape[0], n - (band.shape[-1] - 1) // 2
    return torch.cat([band[:, :1].expand(heads, far), band[:, 1:-1], band[:, -1:].expand(heads, far)], dim=-1)


def _normalization_backward(grad_z, z, denominator):
    """[B, H, n, e]: the gradient of the product's output (numerator | denominator) for that of z = N / D:
    dN = dz / D, dD = -(dz . z) / D; both zero on rows without keys (D = inf there, z = 0)."""
    grad_out = grad_z.new_empty(*z.shape[:-1], z.shape[-1] + 1)
    grad_numerator = torch.div(grad_z, denominator, out=grad_out[..., :-1])
    torch.sum(grad_numerator * z, dim=-1, keepdim=True, out=grad_out[..., -1:]).neg_()
    return grad_out


class _BandedBackward(torch.autograd.Function):
    """The banded product's backward alone, for the graph `_KeptOutputAttention` rebuilds in backward: its forward
    returns zeros in the product's shape, a stand-in that routes the kept output's gradient through the terms and
    the features and is never read (a term whose gradient reads the product's value takes the checkpointed path)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, value, c, band_width, causal, q_near=None, k_near=None, near_width=None,
                key_mask=None, threads=SERIAL):
        ctx.save_for_backward(phi_q, phi_k, value, c, q_near, k_near, key_mask)
        ctx.band_width, ctx.causal, ctx.near_width, ctx.threads = band_width, causal, near_width, threads
        return phi_q.new_zeros(()).expand(*phi_q.shape[:-1], value.shape[-1] + 1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        phi_q, phi_k, value, c, *near = ctx.saved_tensors  # (a subclass may keep the first four only)
        near = NearField(*near[:2], ctx.near_width, near[2]) if near and near[0] is not None else None
        grads = banded_toeplitz_backward(
            phi_q, phi_k, value, c, ctx.band_width, ctx.causal, grad_out.contiguous(), ctx.needs_input_grad[3], near,
            ctx.threads
        )
        # (a subclass's forward may take the first six inputs only)
        return (*grads[:4], None, None, *grads[4:], None, None, None)[: len(ctx.needs_input_grad)]
