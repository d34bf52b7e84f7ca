# coding=utf-8
"""The banded algorithm's near product (`nprf_banded`): out[k] = ((q[k] @ K_k) * coefficients) @ U_k for every
query chunk k and its window of keys, one custom op with its backward (torch.compile keeps it opaque), eager
kernels that work a group of chunks of one sequence at a time, in cache (a sequence per item of the caller's
`nprf_schedule` scheduler: on the CPU a sequence per thread). With the exact near field the window's weights add
exp(q_near[k] @ K_near_k) times the near coefficients, and the feature scores are computed only on the window's
blocks that hold far pairs.
"""

import collections
import itertools
import math
import re
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .nprf_schedule import SERIAL


# Chunks per group of the window product: [32, s, 3s] weights stay in cache.
BANDED_GROUP = 32


def _free_library(base, op):
    """`base`, or `base` with the first free number appended, where `op` is not registered yet: a second copy of
    this module (the package loaded again as remote code, or the same file run again) registers ops of its own."""
    for index in itertools.count():
        library = f"{base}{index or ''}"
        if not hasattr(getattr(torch.ops, library), op):
            return library


WindowOps = collections.namedtuple("WindowOps", "library product backward")


def define_window_ops(base, scheduler):
    """The two opaque ops torch.compile sees for the window product, forward and backward (traced as whole-tensor ops
    it computed every chunk's weights at once and ran 5-6% slower than eager at 4k-16k tokens), registered under a
    free library named after `base`. An op takes no scheduler argument: they run their sequences on `scheduler()`,
    asked when they run, so that the edge can register a pair on its threads."""
    library = _free_library(re.sub(r"\W", "_", base), "band_window_product")

    @torch.library.custom_op(f"{library}::band_window_product", mutates_args=())
    def product(
        q: torch.Tensor, k_rows: torch.Tensor, u_rows: torch.Tensor, coefficients: torch.Tensor,
        q_near: Optional[torch.Tensor] = None, k_near_rows: Optional[torch.Tensor] = None,
        near_coefficients: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return _window_product(q, k_rows, u_rows, coefficients, q_near, k_near_rows, near_coefficients, scheduler())

    @product.register_fake
    def _(q, k_rows, u_rows, coefficients, q_near=None, k_near_rows=None, near_coefficients=None):
        return q.new_empty(q.shape[0], coefficients.shape[1], u_rows.shape[-1])

    @torch.library.custom_op(f"{library}::band_window_product_backward", mutates_args=())
    def backward(
        q: torch.Tensor, k_rows: torch.Tensor, u_rows: torch.Tensor, coefficients: torch.Tensor,
        grad_out: torch.Tensor, needs_coefficients: bool, q_near: Optional[torch.Tensor] = None,
        k_near_rows: Optional[torch.Tensor] = None, near_coefficients: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        grads = _band_window_backward(q, k_rows, u_rows, coefficients, grad_out, needs_coefficients,
                                      q_near, k_near_rows, near_coefficients, threads=scheduler())
        return tuple(coefficients.new_empty(0) if grad is None else grad for grad in grads)  # (distinct: no aliases)

    @backward.register_fake
    def _(q, k_rows, u_rows, coefficients, grad_out, needs_coefficients, q_near=None, k_near_rows=None,
          near_coefficients=None):
        def like(t, needed=True):
            return torch.empty_like(t) if t is not None and needed else coefficients.new_empty(0)

        return (like(q), like(k_rows), like(u_rows), like(coefficients, needs_coefficients), like(q_near),
                like(k_near_rows), like(near_coefficients, needs_coefficients))

    def grad(ctx, grad_out):
        needs_coefficients = ctx.needs_input_grad[3] or (len(ctx.needs_input_grad) > 6 and ctx.needs_input_grad[6])
        q, k_rows, u_rows, coefficients, *near = ctx.saved_tensors
        grads = backward(q, k_rows, u_rows, coefficients, grad_out, needs_coefficients, *near)
        return tuple(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad))

    product.register_autograd(grad, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
    return WindowOps(library, product, backward)


def _window_product(q, k_rows, u_rows, coefficients, q_near, k_near_rows, near_coefficients, threads):
    """out[k] = ((q[k] @ K_k) * coefficients) @ U_k for every chunk k, K_k / U_k its window of keys; the sequences
    are the items of `threads` (an `nprf_schedule` scheduler).

    q: [B*H*chunks, s, m]; k_rows: [B*H, rows, m], u_rows: [B*H, rows, e] with chunk k's window at
    rows k*s .. k*s + window of its head; coefficients: [H, s, window]. Returns [B*H*chunks, s, e]. The
    [chunks, s, window] weights are the largest tensors of the banded algorithm: they are scaled in place, a group
    of chunks at a time so that they stay in cache, and backward recomputes them instead of keeping them.
    The exact near field (all three or none): q_near [B*H*chunks, s, f], k_near_rows [B*H, rows, f] and
    near_coefficients [H, s, window] add exp(q_near[k] @ K_near_k) * near_coefficients to the weights.
    """
    heads, chunk, window = coefficients.shape
    sequences = k_rows.shape[0]
    num_chunks = q.shape[0] // sequences
    k_windows = k_rows.unfold(1, window, chunk)  # [B*H, chunks, m, window], a view
    u_windows = u_rows.unfold(1, window, chunk).transpose(-1, -2)  # [B*H, chunks, window, e]
    near = q_near is not None
    k_near_windows = k_near_rows.unfold(1, window, chunk) if near else None
    far_columns = _far_columns(coefficients, chunk) if near else None
    out = q.new_empty(q.shape[0], chunk, u_rows.shape[-1])
    # one buffer per thread (two with the near field), reused: no allocation per group
    buffers = [q.new_empty(1 + near, min(BANDED_GROUP, num_chunks) * chunk * window)
               for _ in range(threads.slots(sequences))]

    def sequence_product(sequence, slot):
        coefficient = coefficients[sequence % heads]
        for first, last, rows in _chunk_groups(sequence, num_chunks):
            weights = buffers[slot][0, : (last - first) * chunk * window].view(last - first, chunk, window)
            if not near:
                torch.bmm(q[rows], k_windows[sequence, first:last], out=weights).mul_(coefficient)
            else:  # the exact kernel on the window, the features only on the blocks that hold far pairs
                torch.bmm(q_near[rows], k_near_windows[sequence, first:last], out=weights).exp_()
                weights.mul_(near_coefficients[sequence % heads])
                for start, stop in far_columns:
                    scores = buffers[slot][1, : (last - first) * chunk * (stop - start)]
                    scores = torch.bmm(q[rows], k_windows[sequence, first:last, :, start:stop],
                                       out=scores.view(last - first, chunk, stop - start))
                    weights[:, :, start:stop].addcmul_(scores, coefficient[:, start:stop])
            torch.bmm(weights, u_windows[sequence, first:last], out=out[rows])

    threads.items(sequences, sequence_product)
    return out


# the ops compiled code runs unless the caller's scheduler brings its own (`compiled_window_product`)
_LIBRARY, band_window_product, band_window_product_backward = define_window_ops(__name__, lambda: SERIAL)


def window_product(q, k_rows, u_rows, coefficients, *near, threads=SERIAL):
    """`band_window_product` (`near`: its three near-field inputs or none), its sequences the items of `threads`
    where eager; compiled, the opaque op."""
    if torch.compiler.is_compiling():  # an op takes no scheduler: the caller's may bring ops on its threads
        return getattr(threads, "compiled_window_product", band_window_product)(q, k_rows, u_rows, coefficients, *near)
    return _WindowProduct.apply(threads, q, k_rows, u_rows, coefficients, *near)


class _WindowProduct(torch.autograd.Function):
    """The eager `band_window_product` and its backward on the caller's scheduler (which an op could not take)."""

    @staticmethod
    def forward(ctx, threads, q, k_rows, u_rows, coefficients, *near):
        ctx.save_for_backward(q, k_rows, u_rows, coefficients, *near)
        ctx.threads = threads
        return _window_product(q, k_rows, u_rows, coefficients, *(near or (None, None, None)), threads)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        needs = ctx.needs_input_grad[1:]
        needs_coefficients = needs[3] or (len(needs) > 6 and needs[6])
        q, k_rows, u_rows, coefficients, *near = ctx.saved_tensors
        grads = _band_window_backward(q, k_rows, u_rows, coefficients, grad_out, needs_coefficients, *near,
                                      threads=ctx.threads)
        return (None, *(grad if needed else None for grad, needed in zip(grads, needs)))


def _band_window_backward(q, k_rows, u_rows, coefficients, grad_out, needs_coefficients, q_near=None,
                          k_near_rows=None, near_coefficients=None, threads=SERIAL):
    """(grad q, k_rows, u_rows, coefficients or None, q_near, k_near_rows, near_coefficients: None without the near
    field) of `band_window_product` for grad_out [B*H*chunks, s, e], its sequences the items of `threads`."""
    heads, chunk, window = coefficients.shape
    sequences = k_rows.shape[0]
    num_chunks = q.shape[0] // sequences
    k_windows = k_rows.unfold(1, window, chunk)  # [B*H, chunks, m, window]
    u_windows = u_rows.unfold(1, window, chunk)  # [B*H, chunks, e, window]
    near = q_near is not None
    grad_out = grad_out.contiguous()
    grad_q = torch.zeros_like(q) if near else torch.empty_like(q)  # (no far block: no feature gradient)
    grad_k = torch.zeros_like(k_rows)
    grad_u = torch.zeros_like(u_rows)
    # per sequence (summed over the batch at the end, in a fixed order)
    grad_coefficients = q.new_zeros(1 + near, sequences, chunk, window) if needs_coefficients else None
    grad_q_near = torch.empty_like(q_near) if near else None
    grad_k_near = torch.zeros_like(k_near_rows) if near else None
    k_near_windows = k_near_rows.unfold(1, window, chunk) if near else None
    # the feature scores' columns: the whole window, or with the near field its blocks that hold far pairs
    columns = _far_columns(coefficients, chunk) if near else [(0, window)]
    group = min(BANDED_GROUP, num_chunks)  # per-thread buffers, reused: no allocation per group
    buffers = [(*(q.new_empty(group, chunk, window) for _ in range(3 + 3 * near)),
                q.new_empty(group, window, u_rows.shape[-1]), q.new_empty(group, window, q.shape[-1]),
                q.new_empty(group, window, q_near.shape[-1]) if near else None)
               for _ in range(threads.slots(sequences))]

    def sequence_backward(sequence, slot):
        scores_buffer, grad_weights_buffer, product_buffer, *near_buffers, grad_u_windows, grad_k_windows, \
            grad_k_near_windows = buffers[slot]
        for first, last, rows in _chunk_groups(sequence, num_chunks):
            coefficient, count = coefficients[sequence % heads], last - first
            q_group, grad_group = q[rows], grad_out[rows]
            k_group, u_group = k_windows[sequence, first:last], u_windows[sequence, first:last]
            grad_weights = torch.bmm(grad_group, u_group, out=grad_weights_buffer[:count])
            weights = None
            if near:  # w = exp(q_near K_near) near_coefficients + (q K) coefficients on the far blocks
                near_coefficient = near_coefficients[sequence % heads]
                k_near_group = k_near_windows[sequence, first:last]
                exact = torch.bmm(q_near[rows], k_near_group, out=near_buffers[0][:count]).exp_()
                exact_grad = None  # exp(.) dL/dw, kept for the logits' gradient below
                if grad_coefficients is not None:
                    exact_grad = torch.mul(exact, grad_weights, out=product_buffer[:count])
                    grad_coefficients[1, sequence] += exact_grad.sum(0)
                weights = torch.mul(exact, near_coefficient, out=near_buffers[1][:count])
            for start, stop in columns:
                scores = _flat(scores_buffer, count, chunk, stop - start)
                torch.bmm(q_group, k_group[:, :, start:stop], out=scores)
                if grad_coefficients is not None:
                    product = _flat(near_buffers[2] if near else product_buffer, count, chunk, stop - start)
                    grad_coefficients[0, sequence, :, start:stop] += torch.mul(scores, grad_weights[:, :, start:stop],
                                                                               out=product).sum(0)
                if weights is None:  # (without the near field: the one column range, the whole window)
                    weights = scores.mul_(coefficient)
                else:
                    weights[:, :, start:stop].addcmul_(scores, coefficient[:, start:stop])
            if near:  # the logits' gradient: exp(.) dL/dw near_coefficients
                grad_logits = (exact.mul_(grad_weights) if exact_grad is None else exact_grad).mul_(near_coefficient)
                torch.bmm(grad_logits, k_near_group.transpose(-1, -2), out=grad_q_near[rows])
                torch.bmm(grad_logits.transpose(-1, -2), q_near[rows], out=grad_k_near_windows[:count])
                _fold_windows(grad_k_near_windows[:count], grad_k_near[sequence], first, chunk)
            torch.bmm(weights.transpose(-1, -2), grad_group, out=grad_u_windows[:count])
            _fold_windows(grad_u_windows[:count], grad_u[sequence], first, chunk)
            _feature_column_grads(grad_weights, coefficient, columns, near_buffers[2] if near else None, q_group, k_group,
                           grad_q[rows], grad_k[sequence], grad_k_windows, first)

    threads.items(sequences, sequence_backward)
    grad_near_coefficients = None
    if grad_coefficients is not None:
        grad_coefficients = grad_coefficients.view(1 + near, -1, heads, chunk, window).sum(1)
        # (copies: an op's outputs may not alias each other)
        grad_near_coefficients = grad_coefficients[1].clone() if near else None
        grad_coefficients = grad_coefficients[0].clone()
    return grad_q, grad_k, grad_u, grad_coefficients, grad_q_near, grad_k_near, grad_near_coefficients


def _feature_column_grads(grad_weights, coefficient, columns, scratch, q_group, k_group, grad_q, grad_k, grad_k_windows,
                   first):
    """Backward of a group's feature scores on their `columns` of the window: grad_q [G, s, m] (written), grad_k
    (the sequence's key rows, added to through `_fold_windows`) from dL/dw [G, s, window] times the coefficient block
    [s, window]: in place on the whole window without the near field, else on its far blocks alone into `scratch`."""
    count, chunk = grad_weights.shape[:2]
    grad_scores = grad_weights.mul_(coefficient) if scratch is None else None
    for index, (start, stop) in enumerate(columns):
        k_block = k_group[:, :, start:stop]
        grad_block = grad_scores if scratch is None else torch.mul(
            grad_weights[:, :, start:stop], coefficient[:, start:stop], out=_flat(scratch, count, chunk, stop - start))
        if index == 0:
            torch.bmm(grad_block, k_block.transpose(-1, -2), out=grad_q)
        else:
            grad_q.baddbmm_(grad_block, k_block.transpose(-1, -2))
        grad_k_block = torch.bmm(grad_block.transpose(-1, -2), q_group,
                                 out=_flat(grad_k_windows, count, stop - start, q_group.shape[-1]))
        _fold_windows(grad_k_block, grad_k, first + start // chunk, chunk)


def _far_columns(coefficients, chunk):
    """[(start, stop)]: the window's column blocks (whole chunks, adjacent ones merged) where the far coefficients
    [H, s, window] are not all zero: with the near field, outside them every pair is near and its feature scores
    would be multiplied by zero (a host sync of the window's block flags)."""
    heads, _, window = coefficients.shape
    flags = coefficients.view(heads, chunk, window // chunk, chunk).ne(0).any(-1).any(1).any(0).tolist()
    columns = []
    for block, far in enumerate(flags):
        if far and columns and columns[-1][1] == block * chunk:
            columns[-1] = (columns[-1][0], (block + 1) * chunk)
        elif far:
            columns.append((block * chunk, (block + 1) * chunk))
    return columns


def _flat(buffer, *shape):
    """A contiguous [*shape] view of the front of `buffer` (a matmul's out= must be contiguous)."""
    return buffer.view(-1)[: math.prod(shape)].view(shape)


def _chunk_groups(sequence, num_chunks):
    """(first, last, rows): a sequence's groups of BANDED_GROUP chunks, rows their slice of [B*H*chunks, ...]."""
    for first in range(0, num_chunks, BANDED_GROUP):
        last = min(first + BANDED_GROUP, num_chunks)
        yield first, last, slice(sequence * num_chunks + first, sequence * num_chunks + last)


def _fold_windows(window_grads, rows, first, chunk):
    """Add the gradients of overlapping windows onto their rows: window_grads [G, window, f] belongs to
    windows first .. first + G, window k covering rows k*s .. k*s + window of `rows` [rows, f]."""
    count, window, features = window_grads.shape
    for block in range(window // chunk):  # window_grads[k, block] belongs to rows (first + k + block) * s ...
        start = (first + block) * chunk
        rows[start : start + count * chunk].view(count, chunk, features).add_(window_grads[:, block * chunk : (block + 1) * chunk])
