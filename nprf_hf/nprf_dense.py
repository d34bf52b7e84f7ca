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
from .nprf_dense_near import FarPairs, far_grads, far_grads_of_group, far_pairs, near_kernel
from .nprf_near_field import near_field_kernel
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


def _feature_scores(phi_q, phi_k, out):
    """out [h, n, l] = phi_q phi_k^T for phi_q [h, n, m], phi_k [h, l, m]."""
    return torch.matmul(phi_q, phi_k.transpose(-1, -2), out=out)


def _holes(key_mask, key_lengths):
    """[B] bools: whether sequence b has a padded key before its last kept one (a hole its length cannot cut off:
    only then the exact kernel needs the mask; a host sync)."""
    if key_mask is None:
        return [False] * len(key_lengths)
    return [kept < length for kept, length in zip(key_mask.sum(-1).tolist(), key_lengths)]


def _dense_forward(phi_q, phi_k, q_near, k_near, width, key_mask, exponential, value, c, key_lengths, normalized,
                   threads=SERIAL):
    """(out, divisors, holes): `dense_toeplitz_inference`'s output, when normalized the divisors [B, H, n, 1] used
    (the denominators, inf for rows with no key), and `_holes` (backward reads them too); the near field given as
    `_kernel_inputs`."""
    batch, heads, n, _ = value.shape  # (phi_q may hold the far rows alone)
    d = value.shape[-1]
    toeplitz = toeplitz_matrix(c, n)
    holes = _holes(key_mask, key_lengths)
    far = far_pairs(phi_q, phi_k, n, width, key_lengths) if q_near is not None else None
    group = _head_group(heads, n, phi_q.element_size(), 1)
    # per slot of `threads` (a sequence per item; on the CPU per thread)
    buffers = [(phi_q.new_empty(group * n * n), None if normalized else phi_q.new_empty(group, n, d))
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
        weights_buffer, numerator = buffers[slot]
        mask = key_mask[b, :length] if holes[b] else None
        for first in range(0, heads, group):
            last = min(first + group, heads)
            weights = weights_buffer[: (last - first) * n * length].view(last - first, n, length)
            if q_near is not None:
                near_kernel(q_near[b, first:last], k_near[b, first:last, :length], phi_q, phi_k, far,
                            (b, slice(first, last)), mask, weights)
            else:
                _feature_scores(phi_q[b, first:last], phi_k[b, first:last, :length], weights)
                if exponential:  # the exact kernel: zero for padded keys
                    weights.exp_()
                    if mask is not None:
                        weights.mul_(mask)
            weights.mul_(toeplitz[first:last, :, :length])
            if normalized:
                divisor = divisors[b, first:last]
                divisor.copy_(kept_denominator(weights.sum(-1, keepdim=True)))
                torch.matmul(weights, value[b, first:last, :length], out=out[b, first:last]).div_(divisor)
            else:
                out[b, first:last, :, :d] = torch.matmul(weights, value[b, first:last, :length],
                                                         out=numerator[: last - first])
                torch.sum(weights, dim=-1, keepdim=True, out=out[b, first:last, :, d:])

    threads.items(batch, sequence_forward)
    return out, divisors, holes


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
        out, divisors, ctx.holes = _dense_forward(phi_q, phi_k, q_near, k_near, width, key_mask, exponential, value, c,
                                                  lengths, normalized, threads)
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
        batch, heads, n, _ = saved[2].shape  # (the values: phi_q may hold the far rows alone)
        call = _backward_call(ctx, grad_out, saved)
        need_c, near = ctx.needs_input_grad[8], call.q_near is not None
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
        if near:
            far_grads(call.far, call.phi_q, call.phi_k, call.grad_q, call.grad_k)
        grad_c = _coefficient_grad(c, [buffer[2] for buffer in buffers]) if need_c else None
        return call.grad_q, call.grad_k, call.grad_q_near, call.grad_k_near, None, None, None, call.grad_v, grad_c, None


class _DenseBackward(NamedTuple):
    """One backward of `_DenseToeplitzProduct`: its saved inputs and options, C [H, n, n], which sequences need the key
    mask (`_holes`, from forward), the upstream gradient of a sequence's heads and the gradients asked for
    (`_asked_grad`; None where not asked for)."""

    phi_q: torch.Tensor
    phi_k: torch.Tensor
    value: torch.Tensor
    q_near: Optional[torch.Tensor]
    k_near: Optional[torch.Tensor]
    key_mask: Optional[torch.Tensor]
    width: Optional[int]
    exponential: bool
    toeplitz: torch.Tensor
    holes: list
    far: Optional[FarPairs]  # the near field's
    upstream: Callable  # (b, heads) -> (dL/dnumerator [h, n, d_v], dL/ddenominator [h, n, 1])
    grad_q: Optional[torch.Tensor]
    grad_k: Optional[torch.Tensor]
    grad_q_near: Optional[torch.Tensor]
    grad_k_near: Optional[torch.Tensor]
    grad_v: Optional[torch.Tensor]


def _backward_call(ctx, grad_out, saved):
    """The `_DenseBackward` of `_DenseToeplitzProduct.backward`'s context, upstream gradient and saved tensors."""
    phi_q, phi_k, value, c, q_near, k_near, key_mask, *normalized = saved
    n = value.shape[-2]
    needs = (*ctx.needs_input_grad[:4], ctx.needs_input_grad[7])
    asked = [_asked_grad(x, index, ctx.lengths, q_near is not None) if need else None
             for index, (x, need) in enumerate(zip((phi_q, phi_k, q_near, k_near, value), needs))]
    upstream = _upstream(grad_out, value.shape[-1], normalized if ctx.normalized else None)
    far = far_pairs(phi_q, phi_k, n, ctx.width, ctx.lengths, backward=True) if q_near is not None else None
    return _DenseBackward(phi_q, phi_k, value, q_near, k_near, key_mask, ctx.width, ctx.exponential,
                          toeplitz_matrix(c, n), ctx.holes, far, upstream, *asked)


def _asked_grad(x, index, lengths, near):
    """The gradient of x, input `index` of (phi_q, phi_k, q_near, k_near, value), allocated with zeros where the
    groups' backward writes nothing: a key's row after its sequence's length, a sequence without keys, the far
    features' rows off a far block (the near field's compact features: zeros, they are few)."""
    if near and index < 2:
        return torch.zeros_like(x)
    grad = torch.empty_like(x)
    for b, length in enumerate(lengths):
        stop = length if index in (1, 3, 4) or length == 0 else x.shape[-2]
        if stop < x.shape[-2]:
            grad[b, :, stop:].zero_()
    return grad


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


def _head_group_backward(call, buffer, b, heads, length):
    """The gradients of sequence b's `heads` (its first `length` keys) into `call`'s, and C's into the slot's buffer:
    w = kernel * C with kernel phi_q . phi_k, exp(q . k) (`exponential`), or the near field's
    (`nprf_dense_near.near_kernel`)."""
    g, grad_denominator = call.upstream(b, heads)
    scale = call.toeplitz[heads, :, :length]
    kernels, grad_buffer, grad_toeplitz, weights_buffer = buffer
    shape = (heads.stop - heads.start, call.value.shape[-2], length)
    kernel = kernels[: math.prod(shape)].view(shape)
    mask = call.key_mask[b, :length] if call.holes[b] else None
    if call.q_near is not None:
        near_kernel(call.q_near[b, heads], call.k_near[b, heads, :length], call.phi_q, call.phi_k, call.far,
                    (b, heads), mask, kernel)
    else:
        _feature_scores(call.phi_q[b, heads], call.phi_k[b, heads, :length], kernel)
        if call.exponential:
            kernel.exp_()
            if mask is not None:
                kernel.mul_(mask)
    grad_kernel = grad_buffer[: kernel.numel()].view(shape)
    if call.grad_v is not None:  # dL/dv_j = sum_i w_ij dL/dnumerator_i
        weights = torch.mul(kernel, scale, out=grad_kernel if weights_buffer is None else
                            weights_buffer[: kernel.numel()].view(shape))
        torch.matmul(weights.transpose(-1, -2), g, out=call.grad_v[b, heads, :length])
    # dL/dw_ij = dL/dnumerator_i . v_j + dL/ddenominator_i
    torch.baddbmm(grad_denominator, g, call.value[b, heads, :length].transpose(-1, -2), out=grad_kernel)
    if grad_toeplitz is not None:  # dL/dC_ij = dL/dw_ij kernel_ij
        grad_toeplitz[heads, :, :length].addcmul_(grad_kernel, kernel)
    grad_kernel.mul_(scale)  # dL/dkernel
    phi_q, phi_k = call.phi_q[b, heads], call.phi_k[b, heads, :length]
    grad_q = None if call.grad_q is None else call.grad_q[b, heads]
    grad_k = None if call.grad_k is None else call.grad_k[b, heads, :length]
    if call.q_near is None:
        if call.exponential:  # dL/d(q_i . k_j) = dL/dkernel_ij kernel_ij
            grad_kernel.mul_(kernel)
        _feature_grads(grad_kernel, phi_q, phi_k, grad_q, grad_k)
        return
    far_grads_of_group(call.far, grad_kernel, kernel, (b, heads), call.phi_q, call.phi_k, call.grad_q, call.grad_k)
    if call.grad_q_near is not None or call.grad_k_near is not None:
        grad_logits = kernel.mul_(grad_kernel)  # dL/dlogit = dL/dkernel exp(logit) (zero for padded keys)
        if call.grad_q_near is not None:
            torch.matmul(grad_logits, call.k_near[b, heads, :length], out=call.grad_q_near[b, heads])
        if call.grad_k_near is not None:
            torch.matmul(grad_logits.transpose(-1, -2), call.q_near[b, heads], out=call.grad_k_near[b, heads, :length])


def _feature_grads(grad_scores, phi_q, phi_k, grad_q, grad_k):
    """grad_q = grad_scores phi_k, grad_k = grad_scores^T phi_q (None: not asked for) for grad_scores [h, n, l],
    phi_q [h, n, m], phi_k [h, l, m]."""
    if grad_q is not None:
        torch.matmul(grad_scores, phi_k, out=grad_q)
    if grad_k is not None:
        torch.matmul(grad_scores.transpose(-1, -2), phi_q, out=grad_k)


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
