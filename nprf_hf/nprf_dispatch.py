# coding=utf-8
"""What runs a call of `nprf_attention`: the algorithm ("auto" resolved per backend and shape), the band width the
banded products use, the execution mode, and whether the fused kernels (`nprf_triton`) take it. The crossovers are
one table per backend: the PyTorch algorithms' were measured on the 2-core CPU; on a CUDA device "auto" is the Triton
kernels wherever they compute the call (eager or compiled: they are custom ops), and the PyTorch crossovers
otherwise. What then runs is one row of PRODUCTS, (backend, algorithm, mode) -> the row, every Toeplitz product
called with one `ToeplitzCall`.
"""

from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from .nprf_banded import banded_chunking, banded_toeplitz_attention, banded_window
from .nprf_banded_recompute import banded_attention_recomputed
from .nprf_dense import dense_toeplitz_attention, dense_toeplitz_inference, dense_toeplitz_training
from .nprf_features import compute_dtype
from .nprf_fft import fft_kernel, fft_toeplitz_attention, fft_toeplitz_inference
from .nprf_positions import infer_band_width
from .nprf_triton import log_fallback_once, triton_attention, triton_cannot_run, triton_unfused
from .options import NEAR_FIELD_VARIANTS


class Crossovers(NamedTuple):
    """Where `auto` switches between one backend's algorithms (`measured_on` says where they were timed).
    dense_factor*: dense while n <= factor x the banded window (eager autograd, compiled, inference);
    fft_min_length: without a band, fft from this length on."""

    dense_factor: float
    dense_factor_compiled: float
    dense_factor_inference: float
    fft_min_length: int
    measured_on: str
    dense_factor_near: float = 1.0  # the exact near field: its dense product computes both kernels on every pair


# The PyTorch algorithms' crossovers on the 2-core CPU; the measurements behind each: docs/RESULTS.md "What `auto` runs"
CROSSOVERS = {"torch": Crossovers(1.7, 1.0, 1.6, 8192, "2-core CPU, torch 2.13 (no GPU timing of these rows)", 1.0)}
# On a CUDA device: the fused kernels (`nprf_triton`) for every length they compute (RESULTS, "What `auto` runs")
KERNEL_OF_DEVICE = {"cuda": "triton"}


def kernel_or_auto(algorithm, query, projection, variant, terms, kernels=True):
    """"triton" where the fused kernels can run this call ("auto": on a CUDA device, eager or under torch.compile,
    which traces the kernels' custom ops), else "auto" (any other algorithm is returned as it is: the user chose
    PyTorch's). An explicit "triton" where Triton cannot run is an error; a call with something the kernels do not
    fuse runs the PyTorch algorithms, said once in the log; so does "auto" without `kernels` (they failed on it)."""
    if algorithm not in ("auto", "triton"):
        return algorithm
    if algorithm == "auto" and (not kernels or KERNEL_OF_DEVICE.get(query.device.type) != "triton"):
        return "auto"
    reason = triton_cannot_run(query)
    if reason is not None and algorithm == "triton":
        raise ValueError(f"algorithm='triton' cannot run: {reason}")
    reason = reason or triton_unfused(query, projection, variant, terms)
    if reason is None:
        return "triton"
    log_fallback_once(reason)
    return "auto"


def resolve_algorithm(algorithm, bias, n, band_width, m, e, inference=False, near=False):
    """Pick the algorithm for `auto` (`inference`: no autograd, whose dense-banded crossover is measured apart;
    `near`: the exact near field's) and the band width for `banded`."""
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
    crossovers = CROSSOVERS["torch"]  # "auto" reaches here only for the PyTorch algorithms
    reach, chunk = banded_chunking(band_width, near)
    has_band = (2 * reach + 1) * chunk < n
    if has_band:
        factor = crossovers.dense_factor_compiled if torch.compiler.is_compiling() else crossovers.dense_factor
        factor = crossovers.dense_factor_inference if inference else factor
        factor = crossovers.dense_factor_near if near else factor
        return ("dense" if n <= factor * banded_window(band_width, m, e, near) else "banded"), band_width
    return ("fft" if n >= crossovers.fft_min_length else "dense"), band_width


# `recompute=None` recomputes the banded / fft attention in backward from this size of one call's [B, H, n, m]
# features on (16 MiB: B x n = 5,461 tokens at H = 12, m = 64): the about ten feature-sized tensors a layer
# would keep matter there, while for short batches the second forward costs time for little memory (a MiniLM
# training step at 8 x 512 took 1.46x SDPA's with it, 1.33x without). Dense keeps its features (it rebuilds only its
# n x n weights in backward).
RECOMPUTE_MIN_BYTES = 16 << 20
RECOMPUTE_ALGORITHMS = ("banded", "fft")


class ToeplitzCall(NamedTuple):
    """One call of a Toeplitz product, what every product row of PRODUCTS takes: sum_j c_{j-i} (phi_q_i . phi_k_j)
    [v_j | 1], [B, H, n, d_v + 1]; with `normalized` (the in-cache rows) divided by its last column: [B, H, n, d_v],
    rows with no key zero."""

    phi_q: torch.Tensor  # [B, H, n, m]
    phi_k: torch.Tensor  # [B, H, n, m], padded keys zero
    value: torch.Tensor  # [B, H, n, d_v]
    c: torch.Tensor  # [H, 2n - 1]: c_{j-i} at j - i + n - 1 (0 for the future when causal)
    u: Optional[torch.Tensor] = None  # [v | 1] for the rows that read it, built once per attention call
    causal: bool = False
    band_width: Optional[int] = None  # W of the banded rows
    lengths: Optional[Sequence[int]] = None  # the in-cache rows' [B] key lengths (`nprf_dense.key_lengths`)
    normalized: bool = False
    near: Optional[object] = None  # the exact near field (`nprf_near_field.NearField`), for the rows that read it


class AttentionCall(NamedTuple):
    """One checked call of `functional.nprf_attention` (biases in the compute dtype): what `choose_route` reads, and
    what the whole-attention rows and functional's pipeline (features, product with the terms, division) compute."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    rpe_bias: torch.Tensor  # [H, 2n - 1], unmasked
    bias: torch.Tensor  # rpe_bias with -inf for the future when causal
    projection: torch.Tensor
    key_padding_mask: Optional[torch.Tensor]
    terms: object  # `nprf_terms.AttentionTerms`
    causal: bool
    variant: str
    band_width: Optional[int]  # as given (None: inferred from the bias)
    recompute: Optional[bool]  # as given
    # the lean mode keeps its output for backward unless its caller does (`nprf_cpu_split`: one kept output per call)
    output_kept_outside: bool = False
    near_field_width: Optional[int] = None  # variant "nprf_near": as given (None: the band width)


class Route(NamedTuple):
    """What runs an `AttentionCall`: PRODUCTS' row (backend, algorithm, mode), or for the mode "checkpoint" the
    pipeline under activation checkpointing; `requested`: the caller's algorithm."""

    backend: str
    algorithm: str
    mode: str
    band_width: Optional[int]  # resolved (None: an explicit dense or fft call without one)
    requested: str


class Product(NamedTuple):
    """A row of PRODUCTS. `run`: a Toeplitz product (a `ToeplitzCall` -> its sums), inside functional's pipeline; or
    `whole`, the whole attention ((AttentionCall, Route) -> z: the features computed inside)."""

    run: Callable
    whole: bool = False
    in_cache: bool = False  # reads the key lengths (a host sync: eager only) and can divide in cache (`normalized`)
    head_major: bool = False  # reads head-major features
    reads_u: bool = False  # reads `ToeplitzCall.u`
    near: bool = False  # reads `ToeplitzCall.near` (the others' near field is their output's correction)


def _dense(call):
    return dense_toeplitz_attention(call.phi_q, call.phi_k, call.u, call.c, call.near)


def _dense_training(call):
    return dense_toeplitz_training(call.phi_q, call.phi_k, call.value, call.c, call.lengths, call.normalized, call.near)


def _dense_inference(call):
    return dense_toeplitz_inference(call.phi_q, call.phi_k, call.value, call.c, call.lengths, call.normalized,
                                    call.near)


def _fft(call):
    return fft_toeplitz_attention(call.phi_q, call.phi_k, call.u, call.c)


def _fft_inference(call):
    return fft_toeplitz_inference(call.phi_q, call.phi_k, call.u, *fft_kernel(call.c, call.phi_q.shape[-2]))


def _banded(call):
    return banded_toeplitz_attention(call.phi_q, call.phi_k, call.value, call.c, call.band_width, call.causal, call.near)


def _banded_recomputed(call, route):
    # the unmasked bias (the Function masks it itself): a causally masked copy would keep its mask per layer
    return banded_attention_recomputed(call.query, call.key, call.value, call.rpe_bias, call.projection,
                                       call.key_padding_mask, call.terms, route.band_width, call.causal, call.variant,
                                       call.output_kept_outside)


def _triton(call, route):
    return triton_attention(call.query, call.key, call.value, call.rpe_bias, call.projection, call.key_padding_mask,
                            call.terms.logit_scale, route.band_width, call.causal)


# (backend, algorithm, mode) -> what runs. Modes: "autograd", plain autograd (what torch.compile traces; the row of
# an algorithm without one for the mode wanted); "training" / "inference", eager with / without autograd; "recompute",
# under autograd only the inputs (and output) kept for backward. The "triton" algorithm is the Triton backend's
# banded row. An algorithm without a "recompute" row (or a call whose terms' gradient reads the product's value)
# recomputes as "checkpoint": the whole call under activation checkpointing.
PRODUCTS = {
    ("torch", "dense", "autograd"): Product(_dense, reads_u=True, near=True),
    # in cache, a few heads at a time, keys after each sequence's last kept one skipped; training rebuilds the n x n
    # weights in backward instead of keeping them
    ("torch", "dense", "training"): Product(_dense_training, in_cache=True, near=True),
    ("torch", "dense", "inference"): Product(_dense_inference, in_cache=True, head_major=True, near=True),
    ("torch", "fft", "autograd"): Product(_fft, reads_u=True),  # (takes its inference mode itself without autograd)
    ("torch", "fft", "inference"): Product(_fft_inference, reads_u=True),
    ("torch", "banded", "autograd"): Product(_banded, near=True),  # (compiled: its window product an opaque op)
    ("torch", "banded", "recompute"): Product(_banded_recomputed, whole=True),  # features rebuilt in backward
    ("triton", "banded", "autograd"): Product(_triton, whole=True),  # fused kernels, features inside
}
BACKEND_OF = {"triton": ("triton", "banded")}  # algorithm -> (backend, algorithm) where it is not PyTorch's


def choose_route(call, requested, kernels=True):
    """The `Route` of `call`, whose algorithm is `requested` ("auto", "triton" or one of PyTorch's); `kernels=False`:
    "auto" among PyTorch's algorithms only."""
    query, value, bias, projection, terms = call.query, call.value, call.bias, call.projection, call.terms
    batch, heads, n, _ = query.shape
    m = projection.shape[-2]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, call.key, value, bias, projection, *terms.tensors())
    )
    algorithm = kernel_or_auto(requested, query, projection, call.variant, terms, kernels)
    algorithm, band_width = resolve_algorithm(
        algorithm, bias, n, call.band_width, m, value.shape[-1] + 1, inference=not needs_grad,
        near=call.variant in NEAR_FIELD_VARIANTS,
    )
    backend, algorithm = BACKEND_OF.get(algorithm, ("torch", algorithm))
    recompute = call.recompute
    if recompute is None:
        feature_bytes = batch * heads * n * m * torch.finfo(compute_dtype(query.dtype)).bits // 8
        recompute = algorithm in RECOMPUTE_ALGORITHMS and feature_bytes >= RECOMPUTE_MIN_BYTES
    mode = "autograd"
    # (not under torch.compile, whose partitioner decides itself what backward recomputes; the kernels keep no features)
    if backend == "torch" and recompute and needs_grad and not torch.compiler.is_compiling():
        # (the lean row computes the features' product alone: the near field's band runs in the pipeline)
        lean = (backend, algorithm, "recompute") in PRODUCTS and not terms.product_value_read() and (
            call.variant not in NEAR_FIELD_VARIANTS)
        mode = "recompute" if lean else "checkpoint"
    return Route(backend, algorithm, mode, band_width, requested)


def toeplitz_product(route, inference):
    """The product row functional's pipeline runs for `route`: eager, the algorithm's "inference" row (nothing the
    product reads requires grad) or "training" row; compiled, or where it has none, its "autograd" row."""
    mode = "autograd" if torch.compiler.is_compiling() else "inference" if inference else "training"
    row = PRODUCTS.get((route.backend, route.algorithm, mode))
    return PRODUCTS[route.backend, route.algorithm, "autograd"] if row is None else row


def run_attention(call, route, pipeline):
    """z [B, H, n, d_v] of `call` by `route`: its whole-attention row, or `pipeline(call, route)` (functional's features,
    product and division), under activation checkpointing for the mode "checkpoint". Kernels that "auto" chose and
    that fail make this call run the PyTorch algorithms (said once): nothing is switched off for later calls."""
    if route.mode == "checkpoint":
        # No random numbers inside: the recomputation repeats the forward exactly without saving RNG state. (The
        # pipeline reads the masked bias alone: the unmasked one, a copy for half inputs, is not kept per layer.)
        return checkpoint(pipeline, call._replace(rpe_bias=None), route, use_reentrant=False, preserve_rng_state=False)
    row = PRODUCTS[route.backend, route.algorithm, route.mode]
    if not row.whole:
        return pipeline(call, route)
    try:
        return row.run(call, route)
    except Exception as error:  # noqa: BLE001
        if route.backend != "triton" or route.requested == "triton" or isinstance(error, torch.OutOfMemoryError):
            raise  # (an out-of-memory error: PyTorch's path needs more)
        log_fallback_once(f"the kernels failed here ({type(error).__name__}: {error})")
        return run_attention(call, choose_route(call, "auto", kernels=False), pipeline)
