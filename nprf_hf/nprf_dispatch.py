# coding=utf-8
"""What runs: `choose_route` is the one decision for every caller, a layer's path (`LayerCall`), an attention call
(`AttentionCall`: functional, the cache's prefill) and a decode step (`StepCall`): the algorithm ("auto" resolved per
backend and shape), the band width, the execution mode and whether the fused kernels (`nprf_triton`) take it, with why
(`Route.reason`; logged at DEBUG, `nprf_hf.explain`). What then runs is one row of PRODUCTS, (backend, algorithm, mode)
-> the row, whose flags say what it reads: callers read those, never an algorithm's name. The options (crossovers,
kernel devices, recompute size) are one `Routing` object, `ROUTING` unless the caller passes another."""

import logging
from types import MappingProxyType
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from .nprf_banded import banded_chunking, banded_toeplitz_attention, banded_window
from .nprf_banded_recompute import banded_attention_recomputed
from .nprf_dense import dense_toeplitz_attention, dense_toeplitz_inference, dense_toeplitz_training
from .nprf_dense_near import far_rows
from .nprf_features import compute_dtype
from .nprf_fft import fft_kernel, fft_toeplitz_attention, fft_toeplitz_inference
from .nprf_positions import infer_band_width
from .nprf_schedule import SERIAL
from .nprf_triton import log_fallback_once, triton_decode_step, triton_unfused
from .nprf_triton_short import triton_attention, triton_cannot_run
from .options import NEAR_FIELD_VARIANTS, QUADRATIC_VARIANTS


logger = logging.getLogger(__name__)


class Crossovers(NamedTuple):
    """Where `auto` switches between one backend's algorithms (`measured_on` says where they were timed). dense_factor*:
    dense while n <= factor x the banded window (eager autograd, compiled, inference); fft_min_length: fft from here."""

    dense_factor: float
    dense_factor_compiled: float
    dense_factor_inference: float
    fft_min_length: int
    measured_on: str
    dense_factor_near: float = 1.4  # the exact near field, eager (RESULTS "What `auto` runs"); compiled as the rest


# `recompute=None` recomputes banded / fft in backward from this size of one call's [B, H, n, m] features on (16 MiB:
# B x n = 5,461 at H = 12, m = 64; RESULTS "What `auto` runs"); dense keeps them (it rebuilds only its n x n weights)
RECOMPUTE_MIN_BYTES = 16 << 20
RECOMPUTE_ALGORITHMS = ("banded", "fft")


class Routing(NamedTuple):
    """The router's options (tests and benchmarks pass their own): the PyTorch algorithms' crossovers (measured on the
    2-core CPU), where "auto" runs the fused kernels (RESULTS, "What `auto` runs"), RECOMPUTE_MIN_BYTES, and whether
    the edge runs CPU calls on its threads (`nprf_cpu_threads.threads_for`; False: torch's own, `SERIAL`)."""

    crossovers: Crossovers = Crossovers(1.7, 1.0, 1.6, 8192, "2-core CPU, torch 2.13 (no GPU timing of these rows)")
    kernel_devices: tuple = ("cuda",)
    recompute_min_bytes: int = RECOMPUTE_MIN_BYTES
    cpu_threads: bool = True


ROUTING = Routing()


def kernel_or_auto(algorithm, query, projection, variant, terms, kernels=True, routing=ROUTING):
    """("triton", why) where the fused kernels run this call ("auto": on `routing.kernel_devices`, eager or compiled),
    else ("auto", why); PyTorch's algorithms as they are. An explicit "triton" where Triton cannot run is an error; a
    call the kernels do not fuse runs PyTorch's, said once in the log; so does "auto" without `kernels`."""
    if algorithm not in ("auto", "triton"):
        return algorithm, "as requested"
    if algorithm == "auto" and not kernels:
        return "auto", "the kernels failed on this call"
    if algorithm == "auto" and query.device.type not in routing.kernel_devices:
        return "auto", f"no fused kernels on {query.device.type}"
    reason = triton_cannot_run(query)
    if reason is not None and algorithm == "triton":
        raise ValueError(f"algorithm='triton' cannot run: {reason}")
    reason = reason or triton_unfused(query, projection, variant, terms)
    if reason is None:
        return "triton", f"{algorithm}: the fused kernels compute this call"
    log_fallback_once(reason)
    return "auto", f"the kernels do not run it: {reason}"


def resolve_algorithm(algorithm, bias, n, band_width, m, e, inference=False, near=False, routing=ROUTING):
    """Pick the algorithm for `auto` (`inference`: no autograd, whose dense-banded crossover is measured apart;
    `near`: the exact near field's) and the band width for `banded`; with why, (algorithm, band_width, reason)."""
    tied = band_width is not None
    # a host sync: eager only, and not for the GPU's kernels, whose queue a sync per layer would stall (models pass
    # the band of their own bucket table, right by construction)
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
        return algorithm, band_width, "as requested"
    crossovers = routing.crossovers  # "auto" reaches here only for the PyTorch algorithms
    reach, chunk = banded_chunking(band_width, near)
    has_band = (2 * reach + 1) * chunk < n
    # (the reasons name no length: formatting a size would specialize a compiled graph on it)
    if has_band:
        factor = crossovers.dense_factor_compiled if torch.compiler.is_compiling() else crossovers.dense_factor
        factor = crossovers.dense_factor_inference if inference else factor
        factor = crossovers.dense_factor_near if near and not torch.compiler.is_compiling() else factor
        if n <= factor * banded_window(band_width, m, e, near):
            return "dense", band_width, f"auto: n within {factor} banded windows"
        return "banded", band_width, f"auto: n beyond {factor} banded windows"
    if n >= crossovers.fft_min_length:
        return "fft", band_width, f"auto: the band spans the input, n >= {crossovers.fft_min_length}"
    return "dense", band_width, f"auto: the band spans the input, n < {crossovers.fft_min_length}"


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
    threads: object = SERIAL  # the `nprf_schedule` scheduler the products run their items on


class AttentionCall(NamedTuple):
    """One checked call of `functional.nprf_attention` (biases in the compute dtype): what `choose_route` reads, and
    what the whole-attention rows and functional's pipeline (features, product with the terms, division) compute."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    rpe_bias: torch.Tensor  # [H, 2n - 1], unmasked
    bias: Optional[torch.Tensor]  # rpe_bias with -inf for the future when causal (None until checked: functional)
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
    routing: Routing = ROUTING
    threads: object = SERIAL  # the `nprf_schedule` scheduler (on the CPU the edge's `nprf_cpu_threads.CpuThreads`)


class StepCall(NamedTuple):
    """A decode step (`nprf_recurrent.recurrent_step`): the new tokens' q, k, v, mask, the state, c [H, W + 1]."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    new_mask: Optional[torch.Tensor]
    state: tuple
    c: torch.Tensor
    projection: torch.Tensor
    terms: object
    variant: str
    routing: Routing = ROUTING
    threads: object = SERIAL  # the `nprf_schedule` scheduler (its `small` blocks: a decode step's operators)


class LayerCall(NamedTuple):
    """What `NPRFSelfAttention.forward` knows when it picks its path (LAYER_PATHS): an `NPRFCache` holds its state,
    inside `context_parallel`, a mask that is not a padding mask, output_attentions, queries after cached keys (a
    key/value cache), packed sequences."""

    nprf_cache: bool
    sharded: bool
    general_mask: bool
    output_attentions: bool
    cached_keys: bool
    packed: bool


class Route(NamedTuple):
    """What runs a call: PRODUCTS' row (backend, algorithm, mode; "checkpoint": the pipeline under checkpointing), or
    a layer's path (backend "layer", mode one of LAYER_PATHS); `requested`: the caller's algorithm; `reason`: why."""

    backend: str
    algorithm: str
    mode: str
    band_width: Optional[int]  # resolved (None: an explicit dense or fft call without one)
    requested: str
    reason: str = ""

    def __str__(self):
        return f"{self.backend} {self.algorithm} ({self.mode}): {self.reason}"


class Product(NamedTuple):
    """A row of PRODUCTS. `run`: a Toeplitz product (`ToeplitzCall` -> its sums) inside functional's pipeline, or
    `whole`, all of it ((AttentionCall | StepCall, Route) -> z | (out, state)); None: the caller computes it."""

    run: Optional[Callable]
    whole: bool = False
    in_cache: bool = False  # reads the key lengths (a host sync: eager only) and can divide in cache (`normalized`)
    head_major: bool = False  # reads head-major features
    reads_u: bool = False  # reads `ToeplitzCall.u`
    near: bool = False  # reads `ToeplitzCall.near` (the others' near field is their output's correction)
    pairwise: bool = False  # builds the n x n pairs anyway: a term's summand is cheapest as an n x n mask too
    weights: bool = False  # the attention from its n x n weights (functional's pipeline computes them)
    items: bool = True  # may be cut into items on the CPU threads (`nprf_cpu_split`)
    feature_rows: Optional[Callable] = None  # (n, near width) -> the row ranges whose features it reads, near field


def _dense(call):
    return dense_toeplitz_attention(call.phi_q, call.phi_k, call.u, call.c, call.near)


def _dense_training(call):
    return dense_toeplitz_training(*call[:3], call.c, call.lengths, call.normalized, call.near, call.threads)


def _dense_inference(call):
    return dense_toeplitz_inference(*call[:3], call.c, call.lengths, call.normalized, call.near, call.threads)


def _fft(call):
    return fft_toeplitz_attention(call.phi_q, call.phi_k, call.u, call.c)


def _fft_inference(call):
    return fft_toeplitz_inference(call.phi_q, call.phi_k, call.u, *fft_kernel(call.c, call.phi_q.shape[-2]))


def _banded(call):
    return banded_toeplitz_attention(*call[:3], call.c, call.band_width, call.causal, call.near, call.threads)


def _banded_recomputed(call, route):  # (the unmasked bias: a causally masked copy would be kept per layer)
    return banded_attention_recomputed(call, route.band_width)


def _triton(call, route):
    return triton_attention(call.query, call.key, call.value, call.rpe_bias, call.projection, call.key_padding_mask,
                            call.terms.logit_scale, route.band_width, call.causal)


def _triton_step(step, route):
    return triton_decode_step(*step[:7], step.terms.logit_scale)  # (q, k, v, new mask, state, c, projection)


_IN_CACHE = MappingProxyType(dict(in_cache=True, near=True, pairwise=True, feature_rows=far_rows))  # dense, in cache
# (backend, algorithm, mode) -> what runs. Modes: "autograd" (what torch.compile traces; the row of an algorithm
# without one for the mode wanted); "training" / "inference", eager with / without autograd; "recompute", only the
# inputs (and output) kept for backward, else "checkpoint" (the call under activation checkpointing); "weights", from
# the n x n weights (quadratic variants; near field with pair terms on dense); "step", a decode step. The "triton"
# algorithm is the Triton backend's banded row.
PRODUCTS = MappingProxyType({
    ("torch", "dense", "autograd"): Product(_dense, reads_u=True, near=True, pairwise=True),
    # in cache, a few heads at a time, keys after the last kept one skipped; training rebuilds the weights in backward
    ("torch", "dense", "training"): Product(_dense_training, **_IN_CACHE),
    ("torch", "dense", "inference"): Product(_dense_inference, head_major=True, **_IN_CACHE),
    ("torch", "dense", "weights"): Product(None, pairwise=True, weights=True, items=False),
    ("torch", "fft", "autograd"): Product(_fft, reads_u=True),  # (takes its inference mode itself without autograd)
    ("torch", "fft", "inference"): Product(_fft_inference, reads_u=True),
    ("torch", "banded", "autograd"): Product(_banded, near=True),  # (compiled: its window product an opaque op)
    ("torch", "banded", "recompute"): Product(_banded_recomputed, whole=True),  # features rebuilt in backward
    ("torch", "banded", "step"): Product(None, items=False),  # `nprf_recurrent`'s PyTorch step
    ("triton", "banded", "autograd"): Product(_triton, whole=True, items=False),  # fused kernels, features inside
    ("triton", "banded", "step"): Product(_triton_step, whole=True, items=False),
})
BACKEND_OF = MappingProxyType({"triton": ("triton", "banded")})  # algorithm -> (backend, algorithm) if not PyTorch's
# A layer's paths, the first that applies wins (`LayerCall`) -> why
LAYER_PATHS = MappingProxyType({
    "cache": "the NPRF cache: the prompt by nprf_attention, then the recurrent state",
    "sharded": "context_parallel: the banded split over the shards (halo and far sums)",
    "masked": "a mask that is not a padding mask: the dense weights, masked",
    "weights": "output_attentions: the output from the returned dense weights",
    "attention": "nprf_attention",
})


def choose_route(call, requested, kernels=True):
    """The `Route` of `call` (an `AttentionCall`, a `StepCall` or a `LayerCall`), whose algorithm is `requested`
    ("auto", "triton" or one of PyTorch's); `kernels=False`: "auto" among PyTorch's algorithms only. The one decision
    of what runs; logged at DEBUG (not under torch.compile, whose graph a log call would break)."""
    if isinstance(call, LayerCall):
        route = _layer_route(call, requested)
    elif isinstance(call, StepCall):
        route = _step_route(call, requested)
    else:
        route = _attention_route(call, requested, kernels)
    if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s", route)
    return route


def _layer_route(call, requested):
    if call.nprf_cache and call.sharded:  # the cache holds one process's whole sequence
        raise ValueError("context_parallel: run decoders with use_cache=False (NPRFCache decodes on one process)")
    if call.sharded and (call.output_attentions or call.general_mask or call.cached_keys or call.packed):
        raise ValueError("context_parallel takes padding masks only, without output_attentions, a cache or packed "
                         "sequences")
    applies = (call.nprf_cache, call.sharded, call.general_mask, call.output_attentions, True)
    mode = next(mode for mode, applied in zip(LAYER_PATHS, applies) if applied)
    return Route("layer", requested, mode, None, requested, LAYER_PATHS[mode])


def _step_route(step, requested):
    """A decode step: one token without autograd on the kernels where they run the call, else PyTorch's step."""
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (step.query, step.key, step.value, step.c, *step.state))
    if step.query.shape[2] != 1 or needs_grad:
        return Route("torch", "banded", "step", None, requested, "a block of tokens or autograd: PyTorch's step")
    algorithm, why = kernel_or_auto(requested, step.query, step.projection, step.variant, step.terms, True,
                                    step.routing)
    backend, algorithm = BACKEND_OF.get(algorithm, ("torch", "banded"))
    return Route(backend, algorithm, "step", None, requested, why if backend != "torch" else f"PyTorch's step: {why}")


def _attention_route(call, requested, kernels):
    query, value, bias, projection, terms = call.query, call.value, call.bias, call.projection, call.terms
    batch, heads, n, _ = query.shape
    m = projection.shape[-2]
    if call.variant in QUADRATIC_VARIANTS:  # (functional checked that `requested` is auto or dense)
        return Route("torch", "dense", "weights", call.band_width, requested,
                     f"variant {call.variant}: an exact kernel, from the n x n weights")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, call.key, value, bias, projection, *terms.tensors())
    )
    near = call.variant in NEAR_FIELD_VARIANTS
    algorithm, kernel_reason = kernel_or_auto(requested, query, projection, call.variant, terms, kernels, call.routing)
    algorithm, band_width, reason = resolve_algorithm(
        algorithm, bias, n, call.band_width, m, value.shape[-1] + 1, not needs_grad, near, call.routing)
    reason = kernel_reason if reason == "as requested" else f"{reason} ({kernel_reason})"
    backend, algorithm = BACKEND_OF.get(algorithm, ("torch", algorithm))
    if near and terms.pair_terms and PRODUCTS[backend, algorithm, "autograd"].pairwise:
        return Route(backend, algorithm, "weights", band_width, requested,
                     f"{reason}; the exact near field with pair terms: the n x n weights, every term in them")
    recompute = call.recompute
    if recompute is None:
        feature_bytes = batch * heads * n * m * torch.finfo(compute_dtype(query.dtype)).bits // 8
        recompute = algorithm in RECOMPUTE_ALGORITHMS and feature_bytes >= call.routing.recompute_min_bytes
    mode = "autograd"
    # (not compiled: the partitioner decides what backward recomputes; the kernels keep their features, stored once)
    if backend == "torch" and recompute and needs_grad and not torch.compiler.is_compiling():
        lean = (backend, algorithm, "recompute") in PRODUCTS and not terms.product_value_read()
        mode = "recompute" if lean and not (near and terms.pair_terms) else "checkpoint"  # (near: read in the product)
        reason += "; training on long inputs: recomputed in backward"
    return Route(backend, algorithm, mode, band_width, requested, reason)


def toeplitz_product(route, inference):
    """The product row functional's pipeline runs for `route`: its own where it is "weights"; eager, the algorithm's
    "inference" row (nothing it reads requires grad) or "training" row; compiled, or where it has none, "autograd"."""
    mode = "autograd" if torch.compiler.is_compiling() else "inference" if inference else "training"
    mode = "weights" if route.mode == "weights" else mode
    row = PRODUCTS.get((route.backend, route.algorithm, mode))
    return PRODUCTS[route.backend, route.algorithm, "autograd"] if row is None else row


def run_attention(call, route, pipeline):
    """z [B, H, n, d_v] of `call` by `route`: its whole-attention row, or `pipeline(call, route)` (functional's features,
    product and division), under activation checkpointing for the mode "checkpoint"."""
    if route.mode == "checkpoint":
        # No random numbers inside: the recomputation repeats the forward exactly without saving RNG state. (The
        # pipeline reads the masked bias alone: the unmasked one, a copy for half inputs, is not kept per layer.)
        return checkpoint(pipeline, call._replace(rpe_bias=None), route, use_reentrant=False, preserve_rng_state=False)
    row = PRODUCTS[route.backend, route.algorithm, route.mode]
    if not row.whole:
        return pipeline(call, route)
    return _run_row(row, call, route, lambda: run_attention(call, choose_route(call, "auto", kernels=False), pipeline))


def run_step(step, route, pytorch_step):
    """(out, state) of a decode step by `route`: its kernel row, or `pytorch_step(step)`."""
    row = PRODUCTS[route.backend, route.algorithm, route.mode]
    return _run_row(row, step, route, lambda: pytorch_step(step)) if row.whole else pytorch_step(step)


def _run_row(row, call, route, fallback):
    """`row.run(call, route)`; kernels that "auto" chose and that fail run `fallback()` for this call (said once):
    nothing is switched off for later calls. An explicit "triton" raises their error."""
    try:
        return row.run(call, route)
    except Exception as error:  # noqa: BLE001
        if route.backend != "triton" or route.requested == "triton" or isinstance(error, torch.OutOfMemoryError):
            raise  # (an out-of-memory error: PyTorch's path needs more)
        log_fallback_once(f"the kernels failed here ({type(error).__name__}: {error})")
        return fallback()
