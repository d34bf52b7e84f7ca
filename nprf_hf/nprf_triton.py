# coding=utf-8
"""The "triton" algorithm: the banded NPRF product as fused GPU kernels (`nprf_triton_kernels`), forward and
backward, bidirectional and causal, with key padding and the logit scale. The feature map and the q / k
normalization run inside the kernels, once per token: phi_q and phi_k [B, H, n, m] are stored (`_features`) for
the band tiles and backward, which keeps them with q, k, v, the output, its denominator and the per-block key states.

The launches are custom ops (`attention_forward` with its autograd, `attention_backward`, `decode_step`), with
shape-only fake implementations: torch.compile traces a call without a graph break, and a compiled model's kernels
run with no Python per launch (under CUDA graphs, none at all).

Triton is optional: this file imports it only when the algorithm runs (a model's remote code must load on
machines without it; registering the ops needs only torch), and on CPU tensors only under TRITON_INTERPRET=1
(Triton's interpreter, which the tests use).
"""

import functools
import logging
import math
import os
import re
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .nprf_banded_window import _free_library
from .nprf_features import NORM_EPS
from .nprf_triton_plan import block_size, build_plan, launch_plan


logger = logging.getLogger(__name__)

# Rows per block (queries and keys alike): the band is REACH = ceil((W - 1) / BLOCK) key blocks on either side
# of a query block. 64 rows and 4 warps, flash attention's usual tile for d = 64: on an H200 (benchmarks/gpu.py)
# 32 rows (4 warps) and 8 warps were within the noise of host-bound calls up to 8,192 tokens, 15-40% slower beyond.
BLOCK = 64
NUM_WARPS = 4
# One stage: with Triton's 3 (or 2) the band loops' next loads stayed live and backward spilled (kernel_resources).
NUM_STAGES = 1
# The block states' scan on the device, in two levels: a states program sums a split of ceil(blocks / SPLITS) blocks
SPLITS = 16  # in order, and a reader adds up to SPLITS split totals (`nprf_triton_kernels._blocks`). Untimed.


def triton_available():
    """Whether Triton imports (a CUDA device or its interpreter is still needed to run the kernels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_cannot_run(query):
    """None where the kernels can run on query's device, else why not."""
    if not triton_available():
        return "Triton does not import (pip install triton)"
    if not (query.is_cuda or interpreting()):
        return f"the inputs are on {query.device.type}, and Triton runs on CUDA devices (or with TRITON_INTERPRET=1)"
    if torch.compiler.is_compiling():
        return kernels_fail_on(query.device, query.dtype)
    return None


@torch.compiler.assume_constant_result
def kernels_fail_on(device, dtype):
    """None where the kernels build and run on `device` in `dtype`, else why not: a tiny forward and backward, once
    per process, run while torch.compile traces (a failure inside a compiled graph could not fall back, as an eager
    call does); a failure is said once and keeps the compiled calls on that device and dtype on PyTorch's path."""
    return _probe(device, dtype)


@functools.cache  # (once per process, device, dtype and entry, default `triton_attention`: they build there or not)
def _probe(device, dtype, attention=None):
    try:
        with torch.enable_grad():
            q, k, v = (torch.randn(1, 1, BLOCK + 1, 16, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            bias, projection = torch.zeros(1, 2 * BLOCK + 1, device=device), torch.randn(16, 16, device=device)
            (attention or triton_attention)(q, k, v, bias, projection, None, None, 2, False).sum().backward()
    except Exception as error:  # noqa: BLE001
        reason = f"the kernels failed here ({type(error).__name__}: {error})"
        log_fallback_once(reason)
        return reason
    return None


def triton_unfused(query, projection, variant, terms):
    """None when the kernels compute this call, else what they do not fuse (it runs the PyTorch algorithms)."""
    if query.dtype == torch.float64:
        return "float64 inputs (the kernels compute in float32)"
    if variant != "nprf":
        return f"variant={variant!r} (the kernels compute the paper's NPRF features)"
    unfused = [term.name for term in terms.terms if term.feature_scale() is None]
    if unfused:
        return f"the terms {', '.join(unfused)} are not fused (the logit scale is)"
    if projection.requires_grad and torch.is_grad_enabled():
        return "a learned feature map (the kernels do not compute the projection's gradient)"
    return None


# (run as it is while torch.compile traces, its result a constant: a log call in the graph would break it)
@torch.compiler.assume_constant_result
def log_fallback_once(reason):
    """One log line per reason and process: a call that asked for "triton" (or got it from "auto") and runs the
    PyTorch algorithms instead."""
    return _log_once(reason)


@functools.cache  # (each reason once per process)
def _log_once(reason):
    logger.warning("nprf_attention: the Triton kernels do not run here (%s); using the PyTorch algorithms", reason)
    return True


def triton_attention(query, key, value, rpe_bias, projection, key_padding_mask, logit_scale, band_width, causal,
                     block=BLOCK, num_warps=NUM_WARPS):
    """`nprf_attention` through the kernels: query, key [B, H, n, d], value [B, H, n, d_v], rpe_bias [H, 2n - 1]
    (unmasked; tied beyond `band_width`), projection [m, d] or [H, m, d], key_padding_mask [B, n] or None,
    logit_scale [H] or None. Returns [B, H, n, d_v] in value's dtype."""
    heads, n = query.shape[1], query.shape[2]
    # (the kernels read b and take c_r = exp(b_r - max b) <= 1 themselves, and return b's gradient)
    bias = rpe_bias.float()
    root = _feature_root(logit_scale, heads, query.device, _plain_eager(query))
    reach = -(-(min(band_width, n) - 1) // block)
    # (the projection is a constant to the kernels: they do not compute its gradient)
    forward = _EagerAttention.apply if _plain_eager(query) else attention_forward
    return forward(query, key, value, bias, root, projection.detach(), key_padding_mask, causal, reach, block,
                   num_warps)[0]


def _plain_eager(query):
    """Whether this call runs eagerly on real tensors: then the ops' implementations are called without the custom
    ops' dispatch (`_EagerAttention`). Traced (torch.compile, export, opcheck) or under a dispatch mode, the ops."""
    return (not torch.compiler.is_compiling() and type(query) is torch.Tensor
            and torch._C._len_torch_dispatch_stack() == 0)


def _feature_root(logit_scale, heads, device, eager=False):
    """sqrt(s) [H] fp32, the scale of the normalized q, k in the feature map (ones without a logit scale: kept for
    `eager` calls, where a fill per call is a launch; traced calls build theirs, a constant of the graph)."""
    if logit_scale is not None:
        return logit_scale.float().sqrt()
    return _ones(heads, device) if eager else torch.ones(heads, device=device)


_ones = functools.lru_cache(maxsize=None)(lambda heads, device: torch.ones(heads, device=device))


def _launch(query, value, projection, block, num_warps):
    """The call's `nprf_triton_plan.Plan`: (sizes s, the kernels' meta-parameters, their size arguments, log(m) / 2,
    the grid (blocks, B * H)); s["grid"] is the states kernels'. Cached per shape (eager); traced, built."""
    key = (tuple(query.shape), value.shape[-1], projection.shape[-2], projection.dim() == 3, _dot_precision(query),
           NORM_EPS, block, num_warps, NUM_STAGES, SPLITS)
    return (launch_plan if all(type(x) is int for x in key[0]) else build_plan)(*key)


def _dot_precision(query):
    """The kernels' HALF: bf16 operands for half inputs (bf16's range: the feature products and g = dz / den can
    leave fp16's), fp16 under the interpreter (its bf16 dot is wrong in Triton 3.x); for fp32 inputs TF32 operands on
    a CUDA device where torch allows TF32 matmuls, as its own products, else exact fp32 (FMA loops, not tensor cores:
    on an H200 their first compile took about 100 s and they run slower)."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return 2 if interpreting() else 1
    # (not on ROCm, whose Triton takes TF32 products on few chips and whose torch rarely allows them)
    return 3 if query.is_cuda and torch.version.hip is None and not interpreting() and _tf32_allowed() else 0


def _tf32_allowed():
    """Whether torch's CUDA matmuls may use TF32: `torch.backends.cuda.matmul.fp32_precision = "tf32"` (torch >= 2.9),
    or the older `allow_tf32` / `torch.set_float32_matmul_precision("high")` (torch refuses to read the one after
    the other was set)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision not in (None, "none"):
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False


# A band tile's bias gradient summed per diagonal in registers, one atomic add per diagonal instead of per pair
# (`nprf_query_grad_kernel`'s DIAGONALS; Triton's `tl.gather`, 3.2+). Off until measured on a device: on an H200 the
# per-pair atomics made that kernel 0.35 ms a layer in an 8 x 512 training step, 0.09 ms without a bias gradient.
DIAGONAL_SUMS = False


def _features(query, s):
    """(phi_q, phi_k) [B, H, n, m] for the forward and states kernels to fill: bf16 for half inputs (what the dots
    read; exp features leave fp16's range), fp32 for fp32 inputs."""
    dtype = torch.bfloat16 if query.dtype in (torch.float16, torch.bfloat16) else torch.float32
    return tuple(query.new_empty(s["batch"], s["heads"], s["n"], s["m"], dtype=dtype) for _ in "qk")


def _block_states(query, s):
    """The buffer a states kernel fills, [B*H, NC, BM * (BV + 1)] fp32: per block its [BM, BV] states, then its [BM]
    sums, summed since the start of its split (`_launch`'s s["grid"]; the kernels' `_blocks` reads it)."""
    return query.new_empty(s["batch"] * s["heads"], s["blocks"], s["BM"] * (s["BV"] + 1), dtype=torch.float32)


def _mask_arg(mask, query):
    """(the key padding mask [B, n] as the kernels read it (`!= 0`, unit stride along n), its batch stride, whether
    there is one); without a mask, query stands in for the pointer (never read)."""
    if mask is None:
        return query, 0, False
    if mask.device != query.device or mask.stride(-1) != 1 or mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        mask = mask.to(device=query.device, dtype=torch.int8).contiguous()
    return mask, mask.stride(0), True


# The kernels as custom ops (forward, backward, decode step): torch.compile traces a call as one opaque op with its
# shapes from the fake implementations (no graph break, no Python per launch under CUDA graphs), and the eager path
# runs the same ops. A second copy of this file (the package loaded again as remote code) registers ops of its own.
_LIBRARY = _free_library(re.sub(r"\W", "_", __name__), "attention_forward")


def _attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, root: torch.Tensor,
    projection: torch.Tensor, key_padding_mask: Optional[torch.Tensor], causal: bool, reach: int, block: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """z [B, H, n, d_v] of q, k, v with Toeplitz coefficients exp(bias) (bias [H, 2n - 1] fp32, tied beyond the
    band) and feature scale root [H], and what backward reads: its denominator [B, H, n], the key states summed
    within splits of blocks (`_block_states`) and the features phi_q, phi_k (`_features`)."""
    # (`from .x import`, the form transformers follows to copy a remote-code file's siblings)
    from .nprf_triton_kernels import nprf_forward_kernel, nprf_key_states_kernel

    s, common, sizes, log_m_half, grid = _launch(query, value, projection, block, num_warps)
    # (the projection in its own dtype: the kernels convert it as they load it)
    projection, bias, root = projection.contiguous(), bias.float().contiguous(), root.float().contiguous()
    mask, stride_mb, has_mask = _mask_arg(key_padding_mask, query)
    prefix, (phi_q, phi_k) = _block_states(query, s), _features(query, s)
    nprf_key_states_kernel[s["grid"]](
        key, value, projection, mask, root, prefix, phi_k, *key.stride(), *value.stride(), stride_mb,
        *sizes, log_m_half, HAS_MASK=has_mask, **common,
    )
    out = torch.empty(s["batch"], s["heads"], s["n"], s["dv"], device=query.device, dtype=value.dtype)
    denominator = torch.empty(s["batch"], s["heads"], s["n"], device=query.device, dtype=torch.float32)
    nprf_forward_kernel[grid](
        query, value, projection, root, bias, prefix, phi_k, phi_q, out, denominator,
        *query.stride(), *value.stride(), *sizes, reach, log_m_half, CAUSAL=causal, **common,
    )
    return out, denominator, prefix, phi_q, phi_k


attention_forward = torch.library.custom_op(f"{_LIBRARY}::attention_forward", mutates_args=())(_attention_forward)


@attention_forward.register_fake
def _(query, key, value, bias, root, projection, key_padding_mask, causal, reach, block, num_warps):
    s = _launch(query, value, projection, block, num_warps)[0]
    return (query.new_empty(s["batch"], s["heads"], s["n"], s["dv"], dtype=value.dtype),
            query.new_empty(s["batch"], s["heads"], s["n"], dtype=torch.float32), _block_states(query, s),
            *_features(query, s))


def _attention_backward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, root: torch.Tensor,
    projection: torch.Tensor, key_padding_mask: Optional[torch.Tensor], out: torch.Tensor, denominator: torch.Tensor,
    prefix: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor, grad_out: torch.Tensor, causal: bool, reach: int,
    block: int, num_warps: int, needs_c: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv in their inputs' dtypes, d bias [H, 2n - 1] (not written unless `needs_c`), d root [H]) of
    `attention_forward` from what it returned and grad_out [B, H, n, d_v]."""
    from .nprf_triton_backward import HAS_GATHER, nprf_key_grad_kernel, nprf_query_grad_kernel, nprf_query_states_kernel

    s, common, sizes, log_m_half, grid = _launch(query, value, projection, block, num_warps)
    projection, bias, root = projection.contiguous(), bias.float().contiguous(), root.float().contiguous()
    # (the kernels index these as laid out by forward: contiguous, whatever a compiler passes)
    out, denominator, prefix, phi_q, phi_k = (t.contiguous() for t in (out, denominator, prefix, phi_q, phi_k))
    mask, stride_mb, has_mask = _mask_arg(key_padding_mask, query)
    # g = dz / den [B, H, n, d_v] and delta = -(g . z) [B, H, n] (the gradient of weight (i, j) is g_i . v_j +
    # delta_i), fp32: the query-states kernel computes them from grad_out (any strides) and stores them for the others
    g = torch.empty(s["batch"], s["heads"], s["n"], s["dv"], device=query.device, dtype=torch.float32)
    delta, query_prefix = g.new_empty(g.shape[:3]), _block_states(query, s)
    # d root [H] and d bias [B, H, 2n - 1] (a row per sequence) take atomic sums, zeroed by the query-states kernel
    droot = root.new_empty(root.shape)
    dc = bias.new_empty(s["batch"], *bias.shape) if needs_c else droot  # (not read without NEED_DC)
    nprf_query_states_kernel[s["grid"]](
        phi_q, grad_out, out, denominator, g, delta, query_prefix, dc, droot, *grad_out.stride(), *sizes, log_m_half,
        NEED_DC=needs_c, **common,
    )
    dq, dk, dv = (torch.empty(t.shape, device=query.device, dtype=t.dtype) for t in (query, key, value))  # (as stored)
    nprf_query_grad_kernel[grid](
        query, value, projection, mask, root, bias, prefix, phi_q, phi_k, g, delta, dq, dc, droot, *query.stride(),
        *value.stride(), stride_mb, *sizes, reach, log_m_half, CAUSAL=causal, HAS_MASK=has_mask, NEED_DC=needs_c,
        DIAGONALS=DIAGONAL_SUMS and HAS_GATHER, **common,
    )
    nprf_key_grad_kernel[grid](
        key, value, projection, mask, root, bias, query_prefix, phi_q, phi_k, g, delta, dk, dv, droot, dc,
        *key.stride(), *value.stride(), stride_mb, *sizes, reach, log_m_half, CAUSAL=causal, HAS_MASK=has_mask,
        NEED_DC=needs_c and s["batch"] > 1, **common,
    )
    dbias = dc[0] if needs_c else bias.new_empty(bias.shape)  # (key_grad summed the batch's rows into the first)
    return dq, dk, dv, dbias, droot


attention_backward = torch.library.custom_op(f"{_LIBRARY}::attention_backward", mutates_args=())(_attention_backward)


@attention_backward.register_fake
def _(query, key, value, bias, root, projection, key_padding_mask, out, denominator, prefix, phi_q, phi_k, grad_out,
      causal, reach, block, num_warps, needs_c):
    # (contiguous, as the kernels write them, whatever the inputs' strides: a model's q, k, v are transposed views)
    return (*(t.new_empty(t.shape) for t in (query, key, value)), bias.new_empty(bias.shape, dtype=torch.float32),
            root.new_empty(root.shape, dtype=torch.float32))


def _keep_for_backward(ctx, inputs, output):
    *tensors, causal, reach, block, num_warps = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.settings = (causal, reach, block, num_warps)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # (no zero gradients built for the outputs only backward reads)


def _attention_grad(ctx, grad_out, *_, backward=None):
    """Gradients of q, k, v, the bias and root; none for the projection (a constant here) and the mask. `backward`:
    the backward op (default) or, for `_EagerAttention`, its implementation."""
    backward = attention_backward if backward is None else backward
    dq, dk, dv, dc, droot = backward(*ctx.saved_tensors, grad_out, *ctx.settings, ctx.needs_input_grad[3])
    return dq, dk, dv, dc, droot, None, None, None, None, None, None


attention_forward.register_autograd(_attention_grad, setup_context=_keep_for_backward)


class _EagerAttention(torch.autograd.Function):
    """`attention_forward` with its autograd outside torch.compile: the same implementations and the same glue
    without the custom op's dispatch, which cost about 80-120 us of host time per call forward + backward (2 threads
    of this project's CPU, kernels stubbed): time a GPU waits for below 16,384 tokens, where eager calls are
    host-bound (RESULTS, "On a GPU")."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _attention_forward(*inputs)
        _keep_for_backward(ctx, inputs, output)
        return output

    @staticmethod
    @once_differentiable  # (as the op, whose backward has no autograd formula: a second derivative is an error)
    def backward(ctx, grad_out, *_):
        # (compiled autograd traces this backward: there, the op)
        backward = attention_backward if torch.compiler.is_compiling() else _attention_backward
        return _attention_grad(ctx, grad_out, backward=backward)


def triton_decode_step(query, key, value, new_mask, state, c, projection, logit_scale):
    """One token's recurrent step (`nprf_recurrent.recurrent_step` with L = 1) as one kernel launch per layer.

    query, key, value [B, H, 1, d]; new_mask None or bool [B, 1]; state (far_states [B, H, m, d + 1], ring_features
    [B, H, W - 1, m], ring_values [B, H, W - 1, d + 1]) in fp32; c [H, W + 1] exp(bias) by distance, entry W the far
    one. Returns (out [B, H, 1, d] in query's dtype, the new state; the old one is not modified)."""
    root = _feature_root(logit_scale, query.shape[1], query.device, _plain_eager(query))
    step = _decode_step if _plain_eager(query) else decode_step
    out, *new_state = step(query, key, value, None if new_mask is None else new_mask[:, -1:], *state, c,
                           projection.detach(), root)
    return out, new_state


def _decode_step(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, new_mask: Optional[torch.Tensor],
    far_states: torch.Tensor, ring_features: torch.Tensor, ring_values: torch.Tensor, c: torch.Tensor,
    projection: torch.Tensor, root: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`triton_decode_step`'s launch (new_mask None or [B, 1], root [H]): (out, far_states, ring_features,
    ring_values), the new state contiguous."""
    from .nprf_triton_decode import nprf_decode_kernel

    batch, heads, _, d = query.shape
    dv, m = value.shape[-1], projection.shape[-2]
    far_states, ring_features, ring_values = (t.contiguous() for t in (far_states, ring_features, ring_values))
    ring = ring_features.shape[-2]
    # [B, 1]: the kernel reads entry b
    mask, _, has_mask = _mask_arg(None if new_mask is None else new_mask.contiguous(), query)
    out = torch.empty(batch, heads, 1, dv, device=query.device, dtype=query.dtype)
    new_state = [torch.empty_like(t) for t in (far_states, ring_features, ring_values)]
    nprf_decode_kernel[(batch * heads,)](
        query, key, value, mask, projection.contiguous(), root.float().contiguous(), c.float().contiguous(),
        far_states, ring_features, ring_values, out, *new_state,
        query.stride(0), query.stride(1), query.stride(3), key.stride(0), key.stride(1), key.stride(3),
        value.stride(0), value.stride(1), value.stride(3),
        heads, d, dv, m, ring, 0.5 * math.log(m),
        HAS_MASK=has_mask, HAS_RING=ring > 0, W_PER_HEAD=int(projection.dim() == 3), EPS=NORM_EPS,
        BD=block_size(d), BV=block_size(dv), BM=block_size(m), BR=16,  # (ring rows a loop step: all spilled)
    )
    return out, *new_state


decode_step = torch.library.custom_op(f"{_LIBRARY}::decode_step", mutates_args=())(_decode_step)


@decode_step.register_fake
def _(query, key, value, new_mask, far_states, ring_features, ring_values, c, projection, root):
    out = query.new_empty(*query.shape[:3], value.shape[-1])
    return out, *(t.new_empty(t.shape) for t in (far_states, ring_features, ring_values))
