# coding=utf-8
"""The banded algorithm's far part: every key at distance >= W weighs one constant per direction (c_far^-, c_far^+),
so chunk k's far keys enter through prefix / suffix sums of the chunk states phi_k^T [v | 1]
(`nprf_banded.banded_toeplitz_attention`). Eagerly an autograd.Function of running sums (`FarStates`); under
torch.compile whole-tensor ops (`far_states_compiled`)."""

import torch
import torch.nn.functional as F

from .nprf_schedule import SERIAL


def far_states_compiled(states, c_before, c_after, num_chunks, reach):
    """`FarStates` in whole-tensor ops (for torch.compile): prefix and suffix sums through cumsum."""
    heads = states.shape[1]
    # before[k] = sum_{j <= k-1} states[j]
    before = F.pad(states[:, :, : num_chunks - 1].cumsum(2), (0, 0, 1, 0))
    far = before * c_before.view(1, heads, 1, 1)
    if c_after is not None:
        # after[k] = sum_{j >= k+2R+1} states[j]; nothing for the last chunk
        tail = states[:, :, 2 * reach + 1 :].flip(2).cumsum(2).flip(2)
        far = far + F.pad(tail, (0, 0, 0, 1)) * c_after.view(1, heads, 1, 1)
    return far



class FarStates(torch.autograd.Function):
    """far[k] = c_before * sum_{j <= k-1} states[j] + c_after * sum_{j >= k+2R+1} states[j] for k < chunks.

    states: [B, H, S, f] chunk states in the padded layout (R zero chunks in front, so j <= k-1 are
    the chunks at least R+1 before chunk k); c_before, c_after: [H] (c_after None when causal).
    Returns [B, H, chunks, f]. Running sums updated in place, one chunk at a time: a single pass over
    the states each way (torch.cumsum plus flips and pads cost many more on CPU).
    """

    @staticmethod
    def forward(ctx, states, c_before, c_after, num_chunks, reach, threads=SERIAL):
        ctx.save_for_backward(states, c_before, c_after)
        ctx.num_chunks, ctx.reach, ctx.threads = num_chunks, reach, threads
        return far_sums(states, c_before, c_after, num_chunks, reach, threads)

    @staticmethod
    def backward(ctx, grad_far):
        states, c_before, c_after = ctx.saved_tensors
        grads = far_sums_backward(
            states, c_before, c_after, grad_far, ctx.num_chunks, ctx.reach, *ctx.needs_input_grad[1:3], ctx.threads
        )
        return (*grads, None, None, None)


def far_sums(states, c_before, c_after, num_chunks, reach, threads=SERIAL):
    """`FarStates`' forward: running sums updated in place, one chunk at a time (on one CPU thread: each update is
    too small to split, and a split is a parallel region)."""
    with threads.small():
        return _far_sums_loop(states, c_before, c_after, num_chunks, reach)


def _far_sums_loop(states, c_before, c_after, num_chunks, reach):
    batch, heads, slots, features = states.shape
    far = states.new_empty(batch, heads, num_chunks, features)
    far[:, :, 0].zero_()
    scale = c_before.view(1, heads, 1)
    for k in range(1, num_chunks):
        torch.addcmul(far[:, :, k - 1], states[:, :, k - 1], scale, out=far[:, :, k])
    if c_after is not None:
        scale = c_after.view(1, heads, 1)
        running = states.new_zeros(batch, heads, features)
        for k in range(num_chunks - 2, -1, -1):
            running.addcmul_(states[:, :, k + 2 * reach + 1], scale)
            far[:, :, k].add_(running)
    return far


def far_sums_backward(states, c_before, c_after, grad_far, num_chunks, reach, needs_before, needs_after,
                      threads=SERIAL):
    """(grad states, c_before or None, c_after or None) of `FarStates` (on one CPU thread, as `far_sums`)."""
    with threads.small():
        return _far_sums_backward_loop(states, c_before, c_after, grad_far, num_chunks, reach, needs_before,
                                       needs_after)


def _far_sums_backward_loop(states, c_before, c_after, grad_far, num_chunks, reach, needs_before, needs_after):
    gap = 2 * reach + 1
    batch, heads, slots, features = states.shape
    # before[j] = sum_{k > j} grad_far[k]; after[j] = sum_{k <= j - gap} grad_far[k].
    before = torch.zeros_like(states)
    for j in range(num_chunks - 2, -1, -1):
        torch.add(before[:, :, j + 1], grad_far[:, :, j + 1], out=before[:, :, j])
    grad_before = (before * states).sum((0, 2, 3)) if needs_before else None
    grad_states = before.mul_(c_before.view(1, heads, 1, 1))
    grad_after = None
    if c_after is not None:
        after = torch.zeros_like(states)
        for j in range(gap, gap + num_chunks - 1):
            torch.add(after[:, :, j - 1], grad_far[:, :, j - gap], out=after[:, :, j])
        if needs_after:
            grad_after = (after * states).sum((0, 2, 3))
        grad_states.add_(after.mul_(c_after.view(1, heads, 1, 1)))
    return grad_states, grad_before, grad_after
