# coding=utf-8
"""The "triton" algorithm's entry (`triton_attention`): up to SHORT_LENGTH tokens the short path, one forward kernel
and two backward kernels with no block states (`nprf_triton_short_kernels`), else the banded kernels
(`nprf_triton.triton_attention`). At GLUE lengths a sequence is a few blocks: the states and their scan buy nothing
there, and an eager step is bound by its launches (on an H200, 5 a layer made an eager RoBERTa-base training step
1.52x SDPA's at 32 x 128 and 1.57x at 8 x 512; issue 55). The short path takes every argument the banded one does
(padding, causal, the bias and logit scale with their gradients, a per-head projection, fp32 / bf16 / fp16) and
returns the same values: both compute the banded product exactly.

Its launches are custom ops as the banded path's (`short_forward` with its autograd, `short_backward`), in the same
library, with shape-only fakes; eager calls run their implementations through a plain autograd.Function.
"""

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import nprf_triton
from .nprf_triton import BLOCK, NUM_WARPS, _LIBRARY, _features, _launch, _mask_arg


# The longest sequence the short path takes. Unmeasured until a GPU run times both paths (benchmarks/gpu.py: the
# model points 32 x 128 and 8 x 512 run the short path, the attention part from 1,024 tokens both sides of it): the
# issue's "n up to about 1,024", where a query block's loop over every key block is 16 tiles, the banded band's 5
# plus two reads of the states. Tests set it lower to run both paths at small sizes.
SHORT_LENGTH = 1024


def takes_short_path(n, device):
    """Whether a call of n tokens on `device` runs the short path's kernels (read at every call: tests change
    SHORT_LENGTH)."""
    return n <= SHORT_LENGTH and short_path_fits(device)


@torch.compiler.assume_constant_result
def short_path_fits(device):
    """False on CUDA devices before sm_90: ptxas spills the short key-gradient kernel there (about 26 KB a thread at
    sm_80 bf16, benchmarks/kernel_resources.py), so they keep the banded kernels until it is reworked."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def triton_cannot_run(query):
    """`nprf_triton.triton_cannot_run`, which, while torch.compile traces, probes the banded kernels on the device;
    then the short path's are probed too (a failure inside a compiled graph could not fall back)."""
    reason = nprf_triton.triton_cannot_run(query)
    if reason is None and torch.compiler.is_compiling():
        reason = short_kernels_fail_on(query.device, query.dtype)
    return reason


@torch.compiler.assume_constant_result
def short_kernels_fail_on(device, dtype):
    """None where the short path's kernels build and run on `device` in `dtype`, else why not (as
    `nprf_triton.kernels_fail_on`: once per process, device and dtype; a failure is said once)."""
    return nprf_triton._probe(device, dtype, _short_path)


def _short_path(query, key, value, rpe_bias, projection, key_padding_mask, logit_scale, band_width, causal):
    """The short path's kernels at the default tile (what `short_kernels_fail_on` probes)."""
    return _short_attention(query, key, value, rpe_bias, projection, key_padding_mask, logit_scale, band_width, causal,
                            BLOCK, NUM_WARPS)


def triton_attention(query, key, value, rpe_bias, projection, key_padding_mask, logit_scale, band_width, causal,
                     block=BLOCK, num_warps=NUM_WARPS):
    """`nprf_triton.triton_attention`'s call, the same arguments and result: the short path's kernels up to
    SHORT_LENGTH tokens, the banded kernels beyond."""
    attention = _short_attention if takes_short_path(query.shape[2], query.device) else nprf_triton.triton_attention
    return attention(query, key, value, rpe_bias, projection, key_padding_mask, logit_scale, band_width, causal, block,
                     num_warps)


def _short_attention(query, key, value, rpe_bias, projection, key_padding_mask, logit_scale, band_width, causal,
                     block, num_warps):
    """`triton_attention` on the short path, whatever the length."""
    heads, n = query.shape[1], query.shape[2]
    eager = nprf_triton._plain_eager(query)
    root = nprf_triton._feature_root(logit_scale, heads, query.device, eager)
    # (the band's blocks either side of a query block: its tiles read c per pair, the others their side's constant)
    reach = -(-(min(band_width, n) - 1) // block)
    forward = _EagerShortAttention.apply if eager else short_forward
    return forward(query, key, value, rpe_bias.float(), root, projection.detach(), key_padding_mask, causal, reach,
                   block, num_warps)[0]


def _short_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, root: torch.Tensor,
    projection: torch.Tensor, key_padding_mask: Optional[torch.Tensor], causal: bool, reach: int, block: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """z [B, H, n, d_v] (as `nprf_triton.attention_forward`'s) in one launch, and what backward reads: its
    denominator [B, H, n] and the features phi_q, phi_k (`nprf_triton._features`)."""
    from .nprf_triton_short_kernels import nprf_short_forward_kernel

    s, common, sizes, log_m_half, grid = _launch(query, value, projection, block, num_warps)
    projection, bias, root = projection.contiguous(), bias.float().contiguous(), root.float().contiguous()
    mask, stride_mb, has_mask = _mask_arg(key_padding_mask, query)
    phi_q, phi_k = _features(query, s)
    out = torch.empty(s["batch"], s["heads"], s["n"], s["dv"], device=query.device, dtype=value.dtype)
    denominator = torch.empty(s["batch"], s["heads"], s["n"], device=query.device, dtype=torch.float32)
    nprf_short_forward_kernel[grid](
        query, key, value, projection, mask, root, bias, phi_q, phi_k, out, denominator, *query.stride(),
        *key.stride(), *value.stride(), stride_mb, *sizes[:6], reach, log_m_half, CAUSAL=causal, HAS_MASK=has_mask,
        **common,
    )
    return out, denominator, phi_q, phi_k


short_forward = torch.library.custom_op(f"{_LIBRARY}::short_forward", mutates_args=())(_short_forward)


@short_forward.register_fake
def _(query, key, value, bias, root, projection, key_padding_mask, causal, reach, block, num_warps):
    s = _launch(query, value, projection, block, num_warps)[0]
    return (query.new_empty(s["batch"], s["heads"], s["n"], s["dv"], dtype=value.dtype),
            query.new_empty(s["batch"], s["heads"], s["n"], dtype=torch.float32), *_features(query, s))


def _short_backward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, root: torch.Tensor,
    projection: torch.Tensor, key_padding_mask: Optional[torch.Tensor], out: torch.Tensor, denominator: torch.Tensor,
    phi_q: torch.Tensor, phi_k: torch.Tensor, grad_out: torch.Tensor, causal: bool, reach: int, block: int,
    num_warps: int, needs_c: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv in their inputs' dtypes, d bias [H, 2n - 1] (not written unless `needs_c`), d root [H]) of
    `short_forward` in two launches: the key side, then the query side (which adds the key side's d root)."""
    from .nprf_triton_backward import HAS_GATHER
    from .nprf_triton_short_kernels import nprf_short_key_grad_kernel, nprf_short_query_grad_kernel

    s, common, sizes, log_m_half, grid = _launch(query, value, projection, block, num_warps)
    projection, bias, root = projection.contiguous(), bias.float().contiguous(), root.float().contiguous()
    # (the kernels index these as laid out by forward: contiguous, whatever a compiler passes)
    out, denominator, phi_q, phi_k = (t.contiguous() for t in (out, denominator, phi_q, phi_k))
    mask, stride_mb, has_mask = _mask_arg(key_padding_mask, query)
    dq, dk, dv = (torch.empty(t.shape, device=query.device, dtype=t.dtype) for t in (query, key, value))  # (as stored)
    # d root [H] and d bias [H, 2n - 1] take the query kernel's atomic sums, zeroed by the key kernel; `part`, the key
    # kernel's d root per program [B*H, blocks]
    droot, part = root.new_empty(root.shape), root.new_empty(s["batch"] * s["heads"] * s["blocks"])
    dbias = bias.new_empty(bias.shape)
    nprf_short_key_grad_kernel[grid](
        key, value, projection, mask, root, bias, phi_q, phi_k, grad_out, out, denominator, dk, dv, part, droot, dbias,
        *key.stride(), *value.stride(), *grad_out.stride(), stride_mb, *sizes[:6], reach, log_m_half, CAUSAL=causal,
        HAS_MASK=has_mask, NEED_DC=needs_c, **common,
    )
    nprf_short_query_grad_kernel[grid](
        query, value, projection, root, bias, phi_q, phi_k, grad_out, out, denominator, dq, part, droot, dbias,
        *query.stride(), *value.stride(), *grad_out.stride(), *sizes[:6], reach, log_m_half, CAUSAL=causal,
        NEED_DC=needs_c, DIAGONALS=nprf_triton.DIAGONAL_SUMS and HAS_GATHER, **common,
    )
    return dq, dk, dv, dbias, droot


short_backward = torch.library.custom_op(f"{_LIBRARY}::short_backward", mutates_args=())(_short_backward)


@short_backward.register_fake
def _(query, key, value, bias, root, projection, key_padding_mask, out, denominator, phi_q, phi_k, grad_out, causal,
      reach, block, num_warps, needs_c):
    # (contiguous, as the kernels write them, whatever the inputs' strides: a model's q, k, v are transposed views)
    return (*(t.new_empty(t.shape) for t in (query, key, value)), bias.new_empty(bias.shape, dtype=torch.float32),
            root.new_empty(root.shape, dtype=torch.float32))


def _short_grad(ctx, grad_out, *_, backward=None):
    """`nprf_triton._attention_grad` through the short path's backward: the op (default) or its implementation."""
    return nprf_triton._attention_grad(ctx, grad_out, backward=short_backward if backward is None else backward)


short_forward.register_autograd(_short_grad, setup_context=nprf_triton._keep_for_backward)


class _EagerShortAttention(torch.autograd.Function):
    """`short_forward` with its autograd outside torch.compile, without the custom op's dispatch (as
    `nprf_triton._EagerAttention`: host time a GPU waits for at these lengths)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _short_forward(*inputs)
        nprf_triton._keep_for_backward(ctx, inputs, output)
        return output

    @staticmethod
    @once_differentiable  # (as the op, whose backward has no autograd formula: a second derivative is an error)
    def backward(ctx, grad_out, *_):
        # (compiled autograd traces this backward: there, the op)
        backward = short_backward if torch.compiler.is_compiling() else _short_backward
        return _short_grad(ctx, grad_out, backward=backward)
