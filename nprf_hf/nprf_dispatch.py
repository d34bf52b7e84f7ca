# coding=utf-8
"""What runs a call of `nprf_attention`: the algorithm ("auto" resolved per backend and shape), the band width the
banded products use, and whether the fused kernels (`nprf_triton`) take it. The crossovers are one table per
backend: the PyTorch algorithms' were measured on the 2-core CPU; on a CUDA device "auto" is the Triton kernels
wherever they compute the call (eager mode), and the PyTorch crossovers otherwise.
"""

import torch

from .nprf_banded import banded_chunking, banded_window
from .nprf_positions import infer_band_width
from .nprf_triton import log_fallback_once, triton_cannot_run, triton_unfused


# The PyTorch algorithms' `auto` crossovers, measured on the 2-core CPU. Under autograd the eager dense product runs
# in cache and rebuilds its weights in backward (`dense_toeplitz_training`): forward + backward on padded batches
# (B=8, H=12, m=64, T5's default buckets: a window of 314 / 334 at d = 32 / 64, one thread) it takes 0.62x / 0.68x of
# banded's time at 384 tokens, 0.94x / 0.90x at 512, 1.19x / 1.07x at 768: they cross at about 1.7 windows
# (with the weights kept by autograd they crossed at one window). Without a band (a bias learned per distance),
# fft only beats dense from about 8192 tokens (dense at 2048: 0.46 s vs fft 1.95 s forward, one
# thread), where dense's n x n weights also stop fitting in memory.
AUTO_DENSE_FACTOR = 1.7
AUTO_DENSE_FACTOR_COMPILED = 1.0  # torch.compile traces the plain autograd product, which keeps its weights
# Without autograd the dense product runs in cache and skips padded keys (`dense_toeplitz_inference`): on padded
# batches (B=8, H=12, m=64, T5's default buckets: a window of 334) it takes 0.93x (d=32) / 0.89x (d=64) of banded's
# time at 512 tokens, 1.8x / 1.6x at 768: they cross at about 540 tokens, 1.6 windows.
AUTO_DENSE_FACTOR_INFERENCE = 1.6
AUTO_FFT_MIN_LENGTH = 8192
# On a CUDA device: the fused kernels (`nprf_triton`) for every length they compute. Not timed against the PyTorch
# algorithms on one device: the kernels' H200 times are 6-90x below the PyTorch path's H100 times of the day
# before (RESULTS, "On a GPU"), at every length both measured.
KERNEL_OF_DEVICE = {"cuda": "triton"}


def kernel_or_auto(algorithm, query, projection, variant, terms):
    """"triton" where the fused kernels can run this call ("auto": on a CUDA device in eager mode), else "auto" (any
    other algorithm is returned as it is: the user chose PyTorch's). An explicit "triton" where Triton cannot run is
    an error; a call with something the kernels do not fuse runs the PyTorch algorithms, said once in the log."""
    if algorithm not in ("auto", "triton"):
        return algorithm
    if algorithm == "auto" and (KERNEL_OF_DEVICE.get(query.device.type) != "triton" or torch.compiler.is_compiling()):
        return "auto"
    reason = triton_cannot_run(query)
    if reason is not None and algorithm == "triton":
        raise ValueError(f"algorithm='triton' cannot run: {reason}")
    reason = reason or triton_unfused(query, projection, variant, terms)
    if reason is None:
        return "triton"
    log_fallback_once(reason)
    return "auto"


def resolve_algorithm(algorithm, bias, n, band_width, m, e, inference=False):
    """Pick the algorithm for `auto` (`inference`: no autograd, whose dense-banded crossover is measured apart) and
    the band width for `banded`."""
    tied = band_width is not None
    # the check is a host sync: eager mode only, and not for the kernels on a GPU, where a sync per layer stalls the
    # queue they keep full (a model passes the band of its own bucket table, right by construction)
    check = not torch.compiler.is_compiling() and not (algorithm == "triton" and bias.device.type == "cuda")
    if tied and algorithm in ("auto", "banded", "triton") and check:
        inferred = infer_band_width(bias.detach(), n)
        if inferred > band_width:
            raise ValueError(
                f"band_width={band_width} but rpe_bias is not constant beyond it (it varies up to |r| = {inferred - 1})"
            )
    if not tied and algorithm in ("auto", "banded", "triton"):
        band_width = infer_band_width(bias.detach(), n)
        if bias.requires_grad and torch.is_grad_enabled():
            if algorithm == "banded":
                raise ValueError(
                    "algorithm='banded' with an rpe_bias that requires grad needs band_width (the width of the "
                    "bias's tied structure, e.g. rpe_band_width(num_buckets, max_distance)) for exact gradients"
                )
            band_width = n  # without the tied structure: auto may not use banded, and triton's band is every pair
    if algorithm != "auto":
        return algorithm, band_width
    reach, chunk = banded_chunking(band_width)
    has_band = (2 * reach + 1) * chunk < n
    if has_band:
        factor = AUTO_DENSE_FACTOR_COMPILED if torch.compiler.is_compiling() else AUTO_DENSE_FACTOR
        factor = AUTO_DENSE_FACTOR_INFERENCE if inference else factor
        return ("dense" if n <= factor * banded_window(band_width, m, e) else "banded"), band_width
    return ("fft" if n >= AUTO_FFT_MIN_LENGTH else "dense"), band_width
