# coding=utf-8
"""The "triton" algorithm: the banded NPRF product as fused GPU kernels (`nprf_triton_kernels`), forward and
backward, bidirectional and causal, with key padding and the logit scale. The feature map and the q / k
normalization run inside the kernels: what is kept for backward is q, k, v, the output, its denominator and the
per-block key states (n / BT x m x d_v per head), never the [n, m] features.

Triton is optional: this file imports it only when the algorithm runs (a model's remote code must load on
machines without it), and on CPU tensors only under TRITON_INTERPRET=1 (Triton's interpreter, which the tests
use).
"""

import logging
import math
import os

import torch

from .nprf_features import NORM_EPS


logger = logging.getLogger(__name__)

# Rows per block (queries and keys alike): the band is REACH = ceil((W - 1) / BLOCK) key blocks on either side
# of a query block. 64 rows and 4 warps, flash attention's usual tile for d = 64: on an H200 (benchmarks/gpu.py)
# 32 rows were 3-30% faster up to 4,096 tokens, where launches bound the time anyway, and 20-40% slower from 16,384.
BLOCK = 64
NUM_WARPS = 4
_told = set()  # the fallback reasons already logged
_disabled = []  # why the kernels failed in this process, if they did


def triton_available():
    """Whether Triton imports (a CUDA device or its interpreter is still needed to run the kernels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def disable_triton(reason):
    """Stop "auto" from choosing the kernels in this process (they failed here), and say why once."""
    _disabled.append(reason)
    log_fallback_once(reason)


def triton_cannot_run(query):
    """None where the kernels can run on query's device, else why not."""
    if _disabled:
        return _disabled[0]
    if not triton_available():
        return "Triton does not import (pip install triton)"
    if not (query.is_cuda or interpreting()):
        return f"the inputs are on {query.device.type}, and Triton runs on CUDA devices (or with TRITON_INTERPRET=1)"
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


def log_fallback_once(reason):
    """One log line per reason and process: a call that asked for "triton" (or got it from "auto") and runs the
    PyTorch algorithms instead."""
    if reason not in _told:
        _told.add(reason)
        logger.warning("nprf_attention: the Triton kernels do not run here (%s); using the PyTorch algorithms", reason)


def triton_attention(query, key, value, rpe_bias, projection, key_padding_mask, logit_scale, band_width, causal,
                     block=BLOCK, num_warps=NUM_WARPS):
    """`nprf_attention` through the kernels: query, key [B, H, n, d], value [B, H, n, d_v], rpe_bias [H, 2n - 1]
    (unmasked; tied beyond `band_width`), projection [m, d] or [H, m, d], key_padding_mask [B, n] or None,
    logit_scale [H] or None. Returns [B, H, n, d_v] in value's dtype."""
    heads, n = query.shape[1], query.shape[2]
    bias = rpe_bias.float()
    # c_r = exp(b_r - max b) <= 1; the ratios are shift-invariant, and the kernels read c, not b
    c = torch.exp(bias - bias.detach().amax(dim=-1, keepdim=True))
    root = _feature_root(logit_scale, heads, query.device)
    reach = -(-(min(band_width, n) - 1) // block)
    return _TritonProduct.apply(query, key, value, c, root, projection, key_padding_mask, causal, reach,
                                (block, num_warps))


def _feature_root(logit_scale, heads, device):
    """sqrt(s) [H] fp32, the scale of the normalized q, k in the feature map (ones without a logit scale)."""
    return torch.ones(heads, device=device) if logit_scale is None else logit_scale.float().sqrt()


def _block_size(x):
    """The power of two >= x and >= 16 that a kernel's block of x columns takes (tl.dot's smallest size)."""
    return max(16, 1 << (x - 1).bit_length())


def _launch(query, value, projection, tile):
    """What forward and backward launch with: (sizes s, the kernels' shared meta-parameters, their shared size
    arguments, log(m) / 2, the grid (blocks, B * H))."""
    block, num_warps = tile
    batch, heads, n, d = query.shape
    m, dv = projection.shape[-2], value.shape[-1]
    s = dict(batch=batch, heads=heads, n=n, d=d, dv=dv, m=m, blocks=-(-n // block), BV=_block_size(dv),
             BM=_block_size(m))
    common = dict(W_PER_HEAD=int(projection.dim() == 3), EPS=NORM_EPS, HALF=_dot_precision(query), BT=block,
                  BD=_block_size(d), BV=s["BV"], BM=s["BM"], num_warps=num_warps)
    return s, common, (heads, n, d, dv, m, s["blocks"]), 0.5 * math.log(m), (s["blocks"], batch * heads)


def _dot_precision(query):
    """The kernels' HALF: fp32 products for fp32 inputs; bf16 operands for half ones (bf16's range: the feature
    products and g = dz / den can leave fp16's), fp16 under the interpreter (its bf16 dot is wrong in Triton 3.x)."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        return 0
    return 2 if interpreting() else 1


def _prefix(states):
    """[BH, NC, ...] per-block sums -> [BH, NC + 1, ...] exclusive prefix sums (entry NC is the total)."""
    prefix = states.new_zeros(states.shape[0], states.shape[1] + 1, *states.shape[2:])
    torch.cumsum(states, dim=1, out=prefix[:, 1:])
    return prefix


def _mask_arg(key_padding_mask, query):
    if key_padding_mask is None:
        return torch.zeros(1, dtype=torch.int8, device=query.device), 0, False
    mask = key_padding_mask.to(device=query.device, dtype=torch.int8).contiguous()
    return mask, mask.stride(0), True


class _TritonProduct(torch.autograd.Function):
    """z = NPRF attention of (q, k, v) with Toeplitz coefficients c [H, 2n - 1] and feature scale root [H]."""

    @staticmethod
    def forward(ctx, query, key, value, c, root, projection, key_padding_mask, causal, reach, tile):
        # (`from .x import`, the form transformers follows to copy a remote-code file's siblings)
        from .nprf_triton_kernels import nprf_forward_kernel, nprf_key_states_kernel

        s, common, sizes, log_m_half, grid = _launch(query, value, projection, tile)
        projection = projection.detach().float().contiguous()
        c, root = c.detach().float().contiguous(), root.detach().float().contiguous()
        mask, stride_mb, has_mask = _mask_arg(key_padding_mask, query)
        states = query.new_empty(*grid[::-1], s["BM"], s["BV"], dtype=torch.float32)
        sums = query.new_empty(*grid[::-1], s["BM"], dtype=torch.float32)
        nprf_key_states_kernel[grid](
            key, value, projection, mask, root, states, sums, *key.stride(), *value.stride(), stride_mb,
            *sizes, log_m_half, HAS_MASK=has_mask, **common,
        )
        prefix, prefix_sums = _prefix(states), _prefix(sums)
        out = torch.empty(s["batch"], s["heads"], s["n"], s["dv"], device=query.device, dtype=value.dtype)
        denominator = torch.empty(s["batch"], s["heads"], s["n"], device=query.device, dtype=torch.float32)
        nprf_forward_kernel[grid](
            query, key, value, projection, mask, root, c, prefix, prefix_sums, out, denominator,
            *query.stride(), *key.stride(), *value.stride(), stride_mb, *sizes, reach, log_m_half,
            CAUSAL=causal, HAS_MASK=has_mask, **common,
        )
        ctx.save_for_backward(query, key, value, c, root, projection, mask, prefix, prefix_sums, out, denominator)
        ctx.settings = (causal, reach, tile, has_mask, stride_mb)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from .nprf_triton_kernels import nprf_key_grad_kernel, nprf_query_grad_kernel, nprf_query_states_kernel

        query, key, value, c, root, projection, mask, prefix, prefix_sums, out, denominator = ctx.saved_tensors
        causal, reach, tile, has_mask, stride_mb = ctx.settings
        s, common, sizes, log_m_half, grid = _launch(query, value, projection, tile)
        # dz_i / den_i and -(that . z_i): the gradient of weight (i, j) is g_i . v_j + delta_i
        kept = denominator > 0
        g = torch.where(kept[..., None], grad_out.float() / torch.where(kept, denominator, 1.0)[..., None], 0.0)
        delta = -(g * out.float()).sum(-1)
        g, delta = g.contiguous(), delta.contiguous()
        query_states = query.new_empty(*grid[::-1], s["BM"], s["BV"], dtype=torch.float32)
        query_sums = query.new_empty(*grid[::-1], s["BM"], dtype=torch.float32)
        nprf_query_states_kernel[grid](
            query, g, delta, projection, root, query_states, query_sums, *query.stride(), *sizes, log_m_half,
            **common,
        )
        query_prefix, query_prefix_sums = _prefix(query_states), _prefix(query_sums)
        dq = torch.empty(s["batch"], s["heads"], s["n"], s["d"], device=query.device, dtype=torch.float32)
        dk, dv = torch.empty_like(dq), torch.empty(*dq.shape[:3], s["dv"], device=query.device, dtype=torch.float32)
        dc = c.new_zeros(s["batch"], *c.shape)  # [B, H, 2n - 1], summed over the batch below
        droot = torch.zeros_like(root)
        strides = (*query.stride(), *key.stride(), *value.stride(), stride_mb)
        nprf_query_grad_kernel[grid](
            query, key, value, projection, mask, root, c, prefix, prefix_sums, g, delta, dq, dc, droot,
            *strides, *sizes, reach, log_m_half, CAUSAL=causal, HAS_MASK=has_mask, NEED_DC=ctx.needs_input_grad[3],
            **common,
        )
        nprf_key_grad_kernel[grid](
            query, key, value, projection, mask, root, c, query_prefix, query_prefix_sums, g, delta, dk, dv, droot,
            *strides, *sizes, reach, log_m_half, CAUSAL=causal, HAS_MASK=has_mask, **common,
        )
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dc.sum(0), droot, None, None, None, None,
                None)


def triton_decode_step(query, key, value, new_mask, state, c, projection, logit_scale):
    """One token's recurrent step (`nprf_recurrent.recurrent_step` with L = 1) as one kernel launch per layer.

    query, key, value [B, H, 1, d]; new_mask None or bool [B, 1]; state (far_states [B, H, m, d + 1], ring_features
    [B, H, W - 1, m], ring_values [B, H, W - 1, d + 1]) in fp32; c [H, W + 1] exp(bias) by distance, entry W the far
    one. Returns (out [B, H, 1, d] in query's dtype, the new state; the old one is not modified)."""
    from .nprf_triton_kernels import nprf_decode_kernel

    batch, heads, _, d = query.shape
    dv, m = value.shape[-1], projection.shape[-2]
    far_states, ring_features, ring_values = (t.contiguous() for t in state)
    ring = ring_features.shape[-2]
    root = _feature_root(logit_scale, heads, query.device)
    mask, _, has_mask = _mask_arg(None if new_mask is None else new_mask[:, -1:], query)  # [B, 1]: the kernel reads b
    out = torch.empty(batch, heads, 1, dv, device=query.device, dtype=query.dtype)
    new_state = [torch.empty_like(t) for t in (far_states, ring_features, ring_values)]
    nprf_decode_kernel[(batch * heads,)](
        query, key, value, mask, projection.detach().float().contiguous(), root.contiguous(), c.float().contiguous(),
        far_states, ring_features, ring_values, out, *new_state,
        query.stride(0), query.stride(1), query.stride(3), key.stride(0), key.stride(1), key.stride(3),
        value.stride(0), value.stride(1), value.stride(3),
        heads, d, dv, m, ring, 0.5 * math.log(m),
        HAS_MASK=has_mask, W_PER_HEAD=int(projection.dim() == 3), EPS=NORM_EPS,
        BD=_block_size(d), BE=_block_size(dv + 1), BM=_block_size(m), BR=_block_size(ring + 1),
    )
    return out, new_state
