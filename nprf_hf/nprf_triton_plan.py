# coding=utf-8
"""What the Triton kernels of `nprf_triton` launch with that depends on the shapes and settings alone: sizes, the
kernels' shared meta-parameters and size arguments, the grids. An eager call is host-bound on a GPU below 16,384
tokens (RESULTS, "On a GPU"), so a plan is built once per shape and reused (`launch_plan`, a bounded cache: a
training run sees a handful of shapes), rather than two dicts and their sizes rebuilt in every forward and backward.
Torch-free arithmetic: traced calls (symbolic sizes, unhashable) build theirs uncached (`build_plan`).
"""

import functools
import math
import types
from typing import NamedTuple


class Plan(NamedTuple):
    """One shape's launch arguments. sizes: batch, heads, n, d, dv, m, blocks, BV, BM, and grid, the states kernels'
    (splits, B * H); common: the meta-parameters every kernel takes (read-only); args: (H, N, D, DV, M, NC, SPLIT),
    the size arguments every kernel takes (the short path's: the first six); log_m_half: log(m) / 2; grid: the other
    kernels' (blocks, B * H)."""

    sizes: types.MappingProxyType
    common: types.MappingProxyType
    args: tuple
    log_m_half: float
    grid: tuple


def block_size(x):
    """The power of two >= x and >= 16 that a kernel's block of x columns takes (tl.dot's smallest size)."""
    return max(16, 1 << (int(x) - 1).bit_length())


def build_plan(shape, dv, m, per_head, half, eps, block, num_warps, num_stages, splits):
    """The `Plan` of query's shape [B, H, n, d], value's last size dv, m features (a projection per head or not), the
    dot precision `half` (`nprf_triton._dot_precision`), rows per block, warps, pipeline stages and the most splits
    of the block states' scan (a states program sums ceil(blocks / splits) blocks in order)."""
    batch, heads, n, d = shape
    blocks = -(-n // block)
    split = -(-blocks // splits)
    sizes = dict(batch=batch, heads=heads, n=n, d=d, dv=dv, m=m, blocks=blocks, BV=block_size(dv), BM=block_size(m),
                 grid=(-(-blocks // split), batch * heads))
    common = dict(W_PER_HEAD=int(per_head), EPS=eps, HALF=half, BT=block, BD=block_size(d), BV=sizes["BV"],
                  BM=sizes["BM"], num_warps=num_warps, num_stages=num_stages)
    return Plan(types.MappingProxyType(sizes), types.MappingProxyType(common), (heads, n, d, dv, m, blocks, split),
                0.5 * math.log(m), (blocks, batch * heads))


launch_plan = functools.lru_cache(maxsize=64)(build_plan)  # (the same arguments, all plain ints: the same plan)
