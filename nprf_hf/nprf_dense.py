# coding=utf-8
"""The dense algorithm: the n x n weights kappa(q_i, k_j) c_{j-i}, then one matmul. O(n^2 (m + e)); the fastest
below about 1.6-1.7 banded windows (`nprf_dispatch.Routing`) and the only one for the quadratic variants,
whose exact kernels (`exact_kernel`) do not factor into features.

Products take phi_q, phi_k [B, H, n, m] (padded keys zeroed), u [B, H, n, e] and c [H, 2n - 1] and return
sum_j c_{j-i} (phi_q_i . phi_k_j) u_j: [B, H, n, e]. Three execution modes side by side: plain autograd
(`dense_toeplitz_attention`, the reference, and what torch.compile traces), training in cache
(`dense_toeplitz_training`: the n x n weights are never kept, a few heads at a time are rebuilt in backward) and
inference in cache (`dense_toeplitz_inference`). The two in-cache modes can also divide by the denominators in
cache (`normalized=True`, for attention without pair terms): the [B, H, n, d_v + 1] sums, their strided division
and its backward then never pass through memory (7-18% of the attention's forward + backward at 128 tokens).
"""

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from .nprf_features import NORM_EPS, kept_denominator, row_norms
from .nprf_near_field import band_of, near_field_kernel
from .nprf_positions import toeplitz_matrix
from .nprf_schedule import SERIAL


# Bytes of n x n weights the in-cache products scale and read in one group: they stay in cache between the two
# matmuls instead of going to memory and back, and larger groups mean fewer Python-level iterations. On a 2-core
# AMD EPYC (512 KiB L2 per core, 32 MiB L3), attention forward + backward: 4 MiB took 0.91-0.97x the time of
# 1 MiB at 32 x 128 and 8 x 512 (inference 0.92-1.0x), 8 MiB 1.11-1.26x at 8 x 512.
DENSE_GROUP_BYTES = 1 << 22


def dense_toeplitz_attention(phi_q, phi_k, u, c, near=None):
    """O(n^2 (m + e)): the n x n weights, then one matmul. `near`: an `nprf_near_field.NearField`, whose exact
    kernel replaces phi_q . phi_k for the pairs closer than its width."""
    kernel = phi_q @ phi_k.transpose(-1, -2) if near is None else near_field_kernel(phi_q, phi_k, near)
    return (kernel * toeplitz_matrix(c, phi_q.shape[-2])) @ u


def dense_toeplitz_inference(phi_q, phi_k, value, c, key_lengths, normalized=False, near=None, threads=SERIAL):
    """`dense_toeplitz_attention` without autograd, from the values [B, H, n, d_v] (the denominators are the
    weights' row sums): a few heads at a time, so that their n x n weights are scaled by C and read twice
    while they are in cache, and each sequence's keys cut after its last kept one (`key_lengths` [B] ints;
    the keys after it are padding, whose features are zero). Features may be strided (head-major).
    Returns [B, H, n, d_v + 1], or with `normalized` the attention output [B, H, n, d_v] (divided by
    `kept_denominator`: rows with no key, whose denominator is exactly 0 here, give zeros). `near`: an
    `nprf_near_field.NearField` (as in `dense_toeplitz_attention`)."""
    return _dense_forward(*_kernel_inputs(phi_q, phi_k, near), value, c, key_lengths, normalized, threads)[0]


def _kernel_inputs(phi_q, phi_k, near):
    """(phi_q, phi_k, q_near, k_near, width, key_mask, exponential) of the products: where the near field covers
    every pair (width >= n), its exact kernel alone, exp(q_near . k_near), in place of the features (which may then
    be None): what GLUE-length inputs with the RPE band (91) get."""
    if near is None:
        return phi_q, phi_k, None, None, None, None, False
    if near.width >= near.query.shape[-2]:
        return near.query, near.key, None, None, None, near.key_mask, True
    return phi_q, phi_k, near.query, near.key, near.width, near.key_mask, False


def _far_blocks(n, length, width):
    """(rows, keys) slices of the two corner blocks of an [n, length] kernel that hold every pair with
    |j - i| >= width: 2 (n - W)^2 of its n^2 pairs; every pair outside them is near. Below n = 2 W they would
    overlap (and most pairs are far): the whole kernel then."""
    if 2 * width < n:
        return [(slice(0, n), slice(0, length))]
    blocks = []
    if length > width:  # j - i >= W: queries before length - W, keys from W on
        blocks.append((slice(0, length - width), slice(width, length)))
    if n > width:  # i - j >= W: queries from W on, keys before n - W
        blocks.append((slice(width, n), slice(0, min(n - width, length))))
    return blocks


def _feature_scores(phi_q, phi_k, width, out):
    """out [h, n, l] = phi_q phi_k^T for phi_q [h, n, m], phi_k [h, l, m]; with a near-field `width` only on
    `_far_blocks`, zero elsewhere (there every pair is near: its feature score meets a zero far coefficient)."""
    if width is None:
        return torch.matmul(phi_q, phi_k.transpose(-1, -2), out=out)
    out.zero_()
    for rows, keys in _far_blocks(out.shape[-2], out.shape[-1], width):
        out[:, rows, keys] = phi_q[:, rows] @ phi_k[:, keys].transpose(-1, -2)
    return out


def _feature_grads(grad_scores, phi_q, phi_k, width, grad_q, grad_k):
    """grad_q = grad_scores phi_k [h, n, m], grad_k = grad_scores^T phi_q [h, l, m] (None: not needed); with a
    near-field `width` from `_far_blocks` alone (grad_scores is zero elsewhere)."""
    if width is None:
        if grad_q is not None:
            torch.matmul(grad_scores, phi_k, out=grad_q)
        if grad_k is not None:
            torch.matmul(grad_scores.transpose(-1, -2), phi_q, out=grad_k)
        return
    for grad in (grad_q, grad_k):
        if grad is not None:
            grad.zero_()
    for rows, keys in _far_blocks(grad_scores.shape[-2], grad_scores.shape[-1], width):
        block = grad_scores[:, rows, keys]
        if grad_q is not None:
            grad_q[:, rows] += block @ phi_k[:, keys]
        if grad_k is not None:
            grad_k[:, keys] += block.transpose(-1, -2) @ phi_q[:, rows]


def _near_toeplitz(c, n, width):
    """(C far, C near) [H, n, n]: C without, and only, the pairs closer than `width` (C alone without a width)."""
    toeplitz = toeplitz_matrix(c, n)
    if width is None:
        return toeplitz, None
    inside = band_of(n, width, c.device)
    return toeplitz.masked_fill(inside, 0.0), toeplitz.masked_fill(~inside, 0.0)


def _dense_forward(phi_q, phi_k, q_near, k_near, width, key_mask, exponential, value, c, key_lengths, normalized,
                   threads=SERIAL):
    """(out, divisors): `dense_toeplitz_inference`'s output and, when normalized, the divisors [B, H, n, 1] used
    (the denominators, inf for rows with no key); the near field given as `_kernel_inputs`."""
    batch, heads, n, _ = phi_q.shape
    d = value.shape[-1]
    toeplitz, near_toeplitz = _near_toeplitz(c, n, width)
    near = near_toeplitz is not None
    group = _head_group(heads, n, phi_q.element_size(), 1 + near)
    # per slot of `threads` (a sequence per item; on the CPU per thread)
    buffers = [(phi_q.new_empty(group * n * n), None if normalized else phi_q.new_empty(group, n, d),
                phi_q.new_empty(group * n * n) if near else None)
               for _ in range(threads.slots(batch))]
    out = phi_q.new_empty(batch, heads, n, d if normalized else d + 1)
    divisors = phi_q.new_empty(batch, heads, n, 1) if normalized else None

    def sequence_forward(b, slot):
        length = key_lengths[b]
        if length == 0:
            out[b].zero_()
            if normalized:
                divisors[b].fill_(float("inf"))
            return
        weights_buffer, numerator, exact_buffer = buffers[slot]
        for first in range(0, heads, group):
            last = min(first + group, heads)
            weights = weights_buffer[: (last - first) * n * length].view(last - first, n, length)
            _feature_scores(phi_q[b, first:last], phi_k[b, first:last, :length], width, weights)
            if exponential:  # the exact kernel: zero for padded keys
                weights.exp_()
                if key_mask is not None:
                    weights.mul_(key_mask[b, :length])
            weights.mul_(toeplitz[first:last, :, :length])
            if near:
                exact = exact_buffer[: (last - first) * n * length].view(last - first, n, length)
                torch.matmul(q_near[b, first:last], k_near[b, first:last, :length].transpose(-1, -2), out=exact)
                exact.exp_()
                if key_mask is not None:
                    exact.mul_(key_mask[b, :length])
                weights.addcmul_(exact, near_toeplitz[first:last, :, :length])
            if normalized:
                divisor = divisors[b, first:last]
                divisor.copy_(kept_denominator(weights.sum(-1, keepdim=True)))
                torch.matmul(weights, value[b, first:last, :length], out=out[b, first:last]).div_(divisor)
            else:
                out[b, first:last, :, :d] = torch.matmul(weights, value[b, first:last, :length],
                                                         out=numerator[: last - first])
                torch.sum(weights, dim=-1, keepdim=True, out=out[b, first:last, :, d:])

    threads.items(batch, sequence_forward)
    return out, divisors


def dense_toeplitz_training(phi_q, phi_k, value, c, key_lengths, normalized=False, near=None, threads=SERIAL):
    """`dense_toeplitz_attention` for autograd, from the values [B, H, n, d_v] as `dense_toeplitz_inference` (the
    denominators are the weights' row sums), without its two [B, H, n, n] tensors (phi_q phi_k^T and the weights)
    kept from forward to backward: forward and backward run a few heads of one sequence at a time, so that their
    n x n weights stay in cache, and backward rebuilds them (one more n x n x m matmul) from the kept inputs.
    The keys of sequence b from `key_lengths[b]` on are skipped (they must be zero: padding), and their gradient
    is returned as zero: the features of padded keys are the mask times the feature map, so it reaches nothing.
    Returns [B, H, n, d_v + 1], or with `normalized` the attention output [B, H, n, d_v] (rows with no key zero;
    it then also keeps that output and the divisors [B, H, n, 1], whose backward it computes in cache). `near`: an
    `nprf_near_field.NearField` (as in `dense_toeplitz_attention`)."""
    setup = (tuple(key_lengths), normalized, threads)
    return _DenseToeplitzProduct.apply(*_kernel_inputs(phi_q, phi_k, near), value, c, setup)


def _head_group(heads, n, element_size, buffers):
    """Heads per group: `buffers` n x n tensors of a group fit in DENSE_GROUP_BYTES."""
    return max(1, min(heads, DENSE_GROUP_BYTES // (buffers * n * n * element_size)))


class _DenseToeplitzProduct(torch.autograd.Function):
    """[sum_j w_ij v_j | sum_j w_ij] with w_ij = c_{j-i} (phi_q_i . phi_k_j), or normalized their quotient, see
    `dense_toeplitz_training`."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, q_near, k_near, width, key_mask, exponential, value, c, setup):
        lengths, normalized, threads = setup  # (key lengths, normalized?, the `nprf_schedule` scheduler)
        out, divisors = _dense_forward(phi_q, phi_k, q_near, k_near, width, key_mask, exponential, value, c, lengths,
                                       normalized, threads)
        ctx.save_for_backward(phi_q, phi_k, value, c, q_near, k_near, key_mask,
                              *((out, divisors) if normalized else ()))
        ctx.lengths, ctx.normalized, ctx.width, ctx.exponential = lengths, normalized, width, exponential
        ctx.threads = threads
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        phi_q, c = saved[0], saved[3]
        batch, heads, n, _ = phi_q.shape
        call = _backward_call(ctx, grad_out, saved)
        need_c, near = ctx.needs_input_grad[8], call.near_toeplitz is not None
        group = _head_group(heads, n, phi_q.element_size(), 2 + near)
        # per thread, a sequence per thread on the CPU; C's gradient summed per thread, each thread's sequences
        # fixed (`static`), then over the threads in order: the same on every run
        buffers = [(phi_q.new_empty(group * n * n), phi_q.new_empty(group * n * n),
                    phi_q.new_zeros(heads, n, n) if need_c else None, phi_q.new_empty(group * n * n) if near else None)
                   for _ in range(ctx.threads.slots(batch))]

        def sequence_backward(b, slot):
            length = ctx.lengths[b]
            if length == 0:  # (its gradients stay zero)
                return
            for first in range(0, heads, group):
                _head_group_backward(call, buffers[slot], b, slice(first, min(first + group, heads)), length)

        ctx.threads.items(batch, sequence_backward, static=True)
        grad_c = _coefficient_grad(c, [buffer[2] for buffer in buffers]) if need_c else None
        return call.grad_q, call.grad_k, call.grad_q_near, call.grad_k_near, None, None, None, call.grad_v, grad_c, None


class _DenseBackward(NamedTuple):
    """One backward of `_DenseToeplitzProduct`: its saved inputs and options, C [H, n, n] split at the near field
    (`_near_toeplitz`; `inside`: [n, n] |j - i| < width), the upstream gradient of a sequence's heads and the
    gradients asked for (zero-filled here, None where not asked for)."""

    phi_q: torch.Tensor
    phi_k: torch.Tensor
    value: torch.Tensor
    q_near: Optional[torch.Tensor]
    k_near: Optional[torch.Tensor]
    key_mask: Optional[torch.Tensor]
    width: Optional[int]
    exponential: bool
    toeplitz: torch.Tensor
    near_toeplitz: Optional[torch.Tensor]
    inside: Optional[torch.Tensor]
    upstream: Callable  # (b, heads) -> (dL/dnumerator [h, n, d_v], dL/ddenominator [h, n, 1])
    grad_q: Optional[torch.Tensor]
    grad_k: Optional[torch.Tensor]
    grad_q_near: Optional[torch.Tensor]
    grad_k_near: Optional[torch.Tensor]
    grad_v: Optional[torch.Tensor]


def _backward_call(ctx, grad_out, saved):
    """The `_DenseBackward` of `_DenseToeplitzProduct.backward`'s context, upstream gradient and saved tensors."""
    phi_q, phi_k, value, c, q_near, k_near, key_mask, *normalized = saved
    n = phi_q.shape[-2]
    toeplitz, near_toeplitz = _near_toeplitz(c, n, ctx.width)
    inside = band_of(n, ctx.width, c.device) if near_toeplitz is not None else None
    needs = (*ctx.needs_input_grad[:4], ctx.needs_input_grad[7])
    asked = [torch.zeros_like(x) if need else None for x, need in zip((phi_q, phi_k, q_near, k_near, value), needs)]
    upstream = _upstream(grad_out, value.shape[-1], normalized if ctx.normalized else None)
    return _DenseBackward(phi_q, phi_k, value, q_near, k_near, key_mask, ctx.width, ctx.exponential, toeplitz,
                          near_toeplitz, inside, upstream, *asked)


def _upstream(grad_out, d, normalized):
    """(b, heads) -> (dL/dnumerator, dL/ddenominator) of sequence b's heads: grad_out's two parts, or through the
    division y = numerator / divisor (`normalized`: (y, divisors)): g / divisor and -(g / divisor) . y."""
    if not normalized:
        grad_numerator, grad_denominator = grad_out[..., :d].contiguous(), grad_out[..., d:].contiguous()
        return lambda b, heads: (grad_numerator[b, heads], grad_denominator[b, heads])
    out, divisors = normalized
    grad_out = grad_out.contiguous()

    def rows(b, heads):
        g = grad_out[b, heads] / divisors[b, heads]
        return g, -(g * out[b, heads]).sum(-1, keepdim=True)

    return rows


def _backward_kernels(call, buffer, b, heads, length):
    """The forward's kernel tiles [h, n, length] of sequence b's `heads`, rebuilt in the slot's buffers: (phi_q .
    phi_k, or the exact kernel exp(q . k); the near field's exp(q_near . k_near), or None), padded keys' exact
    kernels zero."""
    products, _, _, exact_buffer = buffer
    shape = (heads.stop - heads.start, call.phi_q.shape[-2], length)
    product = products[: math.prod(shape)].view(shape)
    _feature_scores(call.phi_q[b, heads], call.phi_k[b, heads, :length], call.width, product)
    if call.exponential:
        product.exp_()
        if call.key_mask is not None:
            product.mul_(call.key_mask[b, :length])
    if call.near_toeplitz is None:
        return product, None
    exact = exact_buffer[: math.prod(shape)].view(shape)
    torch.matmul(call.q_near[b, heads], call.k_near[b, heads, :length].transpose(-1, -2), out=exact).exp_()
    if call.key_mask is not None:
        exact.mul_(call.key_mask[b, :length])
    return product, exact


def _head_group_backward(call, buffer, b, heads, length):
    """The gradients of sequence b's `heads` (its first `length` keys) into `call`'s, and C's into the slot's buffer.
    With the near field, w = (phi_q . phi_k) C_far + exp(q_near . k_near) C_near."""
    g, grad_denominator = call.upstream(b, heads)
    scale = call.toeplitz[heads, :, :length]
    product, exact = _backward_kernels(call, buffer, b, heads, length)
    near_scale = None if exact is None else call.near_toeplitz[heads, :, :length]
    grad_weights = buffer[1][: product.numel()].view(product.shape)
    if call.grad_v is not None:  # dL/dv_j = sum_i w_ij dL/dnumerator_i
        torch.mul(product, scale, out=grad_weights)
        if exact is not None:
            grad_weights.addcmul_(exact, near_scale)
        torch.matmul(grad_weights.transpose(-1, -2), g, out=call.grad_v[b, heads, :length])
    # dL/dw_ij = dL/dnumerator_i . v_j + dL/ddenominator_i
    torch.baddbmm(grad_denominator, g, call.value[b, heads, :length].transpose(-1, -2), out=grad_weights)
    if buffer[2] is not None:  # dL/dC_ij = dL/dw_ij (phi_q_i . phi_k_j), or exp(q_near . k_near) in the near field
        grad_toeplitz = buffer[2][heads, :, :length]
        grad_toeplitz.addcmul_(grad_weights, product)
        if exact is not None:
            grad_toeplitz.addcmul_(grad_weights, torch.where(call.inside[:, :length], exact - product, 0.0))
    if exact is not None and (call.grad_q_near is not None or call.grad_k_near is not None):
        grad_logits = exact.mul_(grad_weights).mul_(near_scale)  # dL/dlogit = dL/dw exp(logit) C_near
        if call.grad_q_near is not None:
            torch.matmul(grad_logits, call.k_near[b, heads, :length], out=call.grad_q_near[b, heads])
        if call.grad_k_near is not None:
            torch.matmul(grad_logits.transpose(-1, -2), call.q_near[b, heads], out=call.grad_k_near[b, heads, :length])
    grad_weights.mul_(scale)  # dL/d(phi_q_i . phi_k_j)
    if call.exponential:  # dL/d(q_i . k_j) = dL/dkernel_ij kernel_ij
        grad_weights.mul_(product)
    _feature_grads(grad_weights, call.phi_q[b, heads], call.phi_k[b, heads, :length], call.width,
                   None if call.grad_q is None else call.grad_q[b, heads],
                   None if call.grad_k is None else call.grad_k[b, heads, :length])


def _coefficient_grad(c, per_slot):
    """dL/dc [H, 2n - 1] from each slot's dL/dC [H, n, n], added in slot order: C_ij = c_{j-i}, so each coefficient
    gets the sum of its diagonal."""
    heads, n = per_slot[0].shape[:2]
    positions = torch.arange(n, device=c.device)
    index = (positions[None, :] - positions[:, None] + n - 1).reshape(1, -1).expand(heads, -1)
    grad_toeplitz = per_slot[0]
    for buffer in per_slot[1:]:
        grad_toeplitz.add_(buffer)
    return torch.zeros_like(c).scatter_add_(1, index, grad_toeplitz.reshape(heads, -1))


def key_lengths(mask, batch, n):
    """[B] Python ints: one past each sequence's last kept key (n without a mask); a host sync."""
    if mask is None:
        return [n] * batch
    positions = torch.arange(1, n + 1, device=mask.device, dtype=mask.dtype)
    return (mask * positions).amax(-1).to(torch.long).tolist()


def exact_kernel(query, key, mask, causal, logit_scale, variant):
    """[B, H, n, n] exp(logits - row max) of the exact variants, zero for padded and (causal) future keys:
    logits s q_hat . k_hat ("normalized_softmax") or q . k / sqrt(d) ("softmax"). A per-row factor cancels in
    the normalization (the word-matching term is a multiple of the kernel too)."""
    n, head_dim = query.shape[-2], query.shape[-1]
    if variant == "normalized_softmax":
        query = query / row_norms(query).clamp_min(NORM_EPS)
        key = key / row_norms(key).clamp_min(NORM_EPS)
        if logit_scale is not None:
            query = query * logit_scale.to(query.dtype)[:, None, None]
        logits = query @ key.transpose(-1, -2)
    else:
        logits = query @ key.transpose(-1, -2) / math.sqrt(head_dim)
    allowed = torch.ones(n, n, dtype=torch.bool, device=query.device)
    if causal:
        allowed = torch.tril(allowed)
    allowed = allowed[None, None] if mask is None else allowed & (mask[:, None, None, :] > 0)
    shift = logits.masked_fill(~allowed, float("-inf")).amax(-1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # rows with no key
    return torch.exp((logits - shift).masked_fill(~allowed, float("-inf")))
