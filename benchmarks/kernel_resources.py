"""What the Triton kernels will cost a GPU's SM, seen without a GPU (issue 55, item 0): every kernel of the package
compiled ahead of time for sm_90 and sm_80, as the launcher launches it, with its registers per thread, spill bytes,
shared memory and resident warps per SM. This is how a kernel is tuned between device loans.

The kernels' arguments are not written here a second time: the launcher's own functions (`triton_attention` forward
and backward, the short path's up to `nprf_triton_short.SHORT_LENGTH` tokens and the banded one's beyond,
`triton_decode_step`) run on meta tensors (no data, no device) with every kernel replaced by a recorder
of its launch, so each compiled variant is one the launcher would launch: its tile (`nprf_triton.BLOCK` rows,
`NUM_WARPS` warps, `NUM_STAGES` stages), its constexprs, its dtypes, and the specializations the JIT makes on the
arguments (unit strides, multiples of 16). The dot precision (`HALF`) is the launcher's choice on a CUDA device
(`_dot_precision`): bf16 inputs take bf16 operands; fp32 inputs take TF32 operands where torch allows TF32 matmuls
(rows "tf32"), else exact fp32 FMA loops (rows "fp32", torch's default; `--inputs fp32`: their compile is the slow
one, about 10 minutes more on 2 busy cores). The shape is the issue's target: B = 1, 12 heads, 4,096 tokens,
d = m = 64, a band of 91 (T5's default buckets); the short path's calls take 512 tokens (a GLUE batch's length).
The calls (`CALLS`): by default an encoder's training step (bidirectional, padded, the bias trained: all five banded
kernels), the same at 512 tokens (the short path's three) and a decode step; `--calls` adds causal training steps,
`--all-flags` compiles every combination of causal, mask, trained bias and per-head projection at both lengths, and
`--tiles 32x4 64x8` other tiles than the launcher's (`triton_attention(block=, num_warps=)`).

Each variant goes through `triton.compile(..., target=GPUTarget("cuda", arch, 32))` into a fresh temporary cache
(nothing is kept): registers and spill stores + loads from ptxas's report (per thread), registers, stack and static
shared memory (the 1 KiB per block that CUDA reserves from sm_80 on) from `cuobjdump -res-usage` of the cubin,
dynamic shared memory from Triton's metadata. Resident warps per SM as CUDA's occupancy calculator counts them:
registers allocated per warp in units of 256 (65,536 per SM), shared memory per block (228 KiB per SM on sm_90,
164 KiB on sm_80; a block over 227 / 163 KiB cannot launch), at most 64 warps and 32 blocks per SM. The table has
a row per compiled variant; the last line sums it up (K: the rows):

    python benchmarks/kernel_resources.py [--arch 90 80] [--inputs bf16 tf32 fp32] [--calls encoder decoder decode]
        [--all-flags] [--tiles 64x4] [--json PATH]

The default run compiles 36 variants in about 1-1.5 minutes on 2 busy cores (no GPU needed; Triton's bundled ptxas
and cuobjdump). tests/test_kernel_resources.py runs it for sm_90 and bf16.
"""

import argparse
import contextlib
import io
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace
from unittest import mock

if __name__ == "__main__":  # before Triton is imported: compiled kernels (JIT functions), not the interpreter's
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from nprf_hf import nprf_triton, nprf_triton_backward, nprf_triton_decode, nprf_triton_kernels  # noqa: E402
from nprf_hf import nprf_triton_short, nprf_triton_short_kernels  # noqa: E402
from nprf_hf.benchmarking import write_json  # noqa: E402

KERNEL_MODULES = (nprf_triton_kernels, nprf_triton_backward, nprf_triton_decode, nprf_triton_short_kernels)
# The SM of each architecture: registers per SM and their allocation unit per warp, shared memory per SM and per
# block, resident warps and blocks per SM (CUDA C Programming Guide, compute capabilities 8.0 and 9.0).
SM = {
    90: dict(regs=65536, reg_unit=256, shared=228 * 1024, shared_block=227 * 1024, warps=64, blocks=32),
    80: dict(regs=65536, reg_unit=256, shared=164 * 1024, shared_block=163 * 1024, warps=64, blocks=32),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The issue's shape: B = 1, H = 12, n = 4,096, d = m = 64, band width 91 (T5's 32 buckets, 128 positions)
BATCH, HEADS, LENGTH, DIM, FEATURES, BAND = 1, 12, 4096, 64, 64, 91
SHORT = 512  # the short path's calls (at most nprf_triton_short.SHORT_LENGTH tokens)
FLAGS = ("causal", "mask", "trained_bias", "per_head")
# The calls `--calls` picks from: an encoder's training step (bidirectional, padded, the bias table trained), a
# decoder's (causal, unpadded), the same two at SHORT tokens (the short path's kernels) and the generation step;
# `--all-flags` compiles every combination of FLAGS at both lengths instead.
CALLS = dict(encoder=dict(mask=True, trained_bias=True), decoder=dict(causal=True, trained_bias=True),
             short_encoder=dict(mask=True, trained_bias=True, length=SHORT),
             short_decoder=dict(causal=True, trained_bias=True, length=SHORT), decode=dict(decode=True))
DEFAULT_CALLS = ("encoder", "short_encoder", "decode")
# bf16 inputs, and fp32 inputs with TF32 dots; `--inputs fp32` adds exact fp32 dots (their compile is the slow one)
DEFAULT_INPUTS = ("bf16", "tf32")


class _Recorder:
    """A kernel whose launch `kernel[grid](*args, **kwargs)` is only recorded."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def package_kernels():
    """(module, name) of every @triton.jit kernel of the package (its helpers, called from kernels, excluded)."""
    found = [(module, name) for module in KERNEL_MODULES for name, fn in vars(module).items()
             if name.endswith("_kernel") and getattr(fn, "__module__", None) == module.__name__]
    interpreted = [name for module, name in found if not isinstance(getattr(module, name), JITFunction)]
    if interpreted:
        raise SystemExit(f"{', '.join(interpreted)} are wrapped for Triton's interpreter: run this script in a "
                         "process where TRITON_INTERPRET=1 was not set before Triton was imported")
    return found


def record(call):
    """The launches [(kernel, args, kwargs)] of one call of the launcher on meta tensors."""
    launches = []
    with contextlib.ExitStack() as stack:
        for module, name in package_kernels():
            stack.enter_context(mock.patch.object(module, name, _Recorder(getattr(module, name), launches)))
        stack.enter_context(mock.patch.object(nprf_triton, "_dot_precision", lambda query: call["half"]))
        meta = dict(device="meta")
        per_head = (HEADS,) if call.get("per_head") else ()
        projection = torch.empty(*per_head, FEATURES, DIM, **meta)
        if call.get("decode"):
            q, k, v = (torch.empty(BATCH, HEADS, 1, DIM, dtype=call["dtype"], **meta) for _ in range(3))
            state = (torch.empty(BATCH, HEADS, FEATURES, DIM + 1, **meta),
                     torch.empty(BATCH, HEADS, BAND - 1, FEATURES, **meta),
                     torch.empty(BATCH, HEADS, BAND - 1, DIM + 1, **meta))
            new_mask = torch.empty(BATCH, 1, dtype=torch.bool, **meta) if call.get("mask") else None
            nprf_triton.triton_decode_step(q, k, v, new_mask, state, torch.empty(HEADS, BAND + 1, **meta),
                                           projection, None)
        else:
            n = call.get("length", LENGTH)
            q, k, v = (torch.empty(BATCH, HEADS, n, DIM, dtype=call["dtype"], requires_grad=True, **meta)
                       for _ in range(3))
            bias = torch.empty(HEADS, 2 * n - 1, requires_grad=bool(call.get("trained_bias")), **meta)
            mask = torch.empty(BATCH, n, dtype=torch.bool, **meta) if call.get("mask") else None
            out = nprf_triton_short.triton_attention(q, k, v, bias, projection, mask, None, BAND,
                                                     bool(call.get("causal")), *call["tile"])
            out.sum().backward()
    return launches


def precisions(dtype):
    """{HALF: its row's name} that the launcher picks for `dtype` inputs on a CUDA device, TF32 matmuls off and on."""
    found = {}
    for tf32 in (False, True):
        with mock.patch.object(nprf_triton, "_tf32_allowed", lambda: tf32):
            half = nprf_triton._dot_precision(SimpleNamespace(dtype=dtype, is_cuda=True))
        found.setdefault(half, "tf32" if half == 3 else next(k for k, v in DTYPES.items() if v == dtype))
    return found


def variants(archs, inputs, calls, all_flags, tiles):
    """The distinct compilations: a list of dicts (kernel, arch, inputs, flags, what `triton.compile` takes).
    tiles: (rows, warps) of the attention kernels (the decode kernel has no tile: compiled with the first)."""
    calls = ([dict(zip(FLAGS, bits), length=n) for n in (LENGTH, SHORT)
              for bits in itertools.product((False, True), repeat=len(FLAGS))]
             + [dict(decode=True, mask=mask, per_head=per_head) for mask in (False, True) for per_head in (False, True)]
             if all_flags else [CALLS[name] for name in calls])
    calls = [dict(call, tile=tile) for i, tile in enumerate(tiles) for call in calls
             if i == 0 or not call.get("decode")]
    found = {}
    for dtype in DTYPES.values():
        for half, name in precisions(dtype).items():
            if name not in inputs:
                continue
            for call in calls:
                flags = " ".join(f for f in ("decode", *FLAGS) if call.get(f)) or "-"
                if not call.get("decode") and call.get("length", LENGTH) <= nprf_triton_short.SHORT_LENGTH:
                    flags = f"n={call['length']} {flags}"
                for kernel, args, kwargs in record(dict(call, dtype=dtype, half=half)):
                    for arch in archs:
                        backend = make_backend(GPUTarget("cuda", arch, 32))
                        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
                        kwargs = dict(kwargs, debug=kernel.debug or knobs.runtime.debug)
                        bound, specialization, options = binder(*args, **kwargs)
                        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                                                  specialization, options)
                        key = (kernel.__name__, arch, str(signature), str(constexprs), str(attrs), str(options))
                        tile = (kernel.arg_names.index("BT"),) if "BT" in kernel.arg_names else None
                        entry = found.setdefault(key, dict(
                            kernel=kernel.__name__, module=kernel.__module__, arch=arch, inputs=[], flags=[],
                            rows=constexprs.get(tile), num_warps=options.num_warps, num_stages=options.num_stages,
                            compile=(signature, constexprs, attrs, options.__dict__)))
                        for field, value in (("inputs", name), ("flags", flags)):
                            if value not in entry[field]:
                                entry[field].append(value)
    missing = [name for _, name in package_kernels() if not any(v["kernel"] == name for v in found.values())]
    if missing:  # (the default calls launch every kernel: tests/test_kernel_resources.py checks it)
        print(f"not compiled: {', '.join(missing)} (launched by none of these calls)", file=sys.stderr)
    return list(found.values())


def _number(pattern, text, what):
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"no {what} in:\n{text}")
    return int(found.group(1))


def measure(variant):
    """Compile one variant and read its resources (a dict), in a fresh cache (TRITON_CACHE_DIR, set by `main`)."""
    start = time.perf_counter()
    kernel = getattr(sys.modules[variant["module"]], variant["kernel"])
    signature, constexprs, attrs, options = variant["compile"]
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", variant["arch"], 32), options=options)
    ptxas = report.getvalue()  # (TRITON_DUMP_PTXAS_LOG=1: ptxas -v's report, printed)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    regs = _number(r"REG:(\d+)", usage, "registers")
    if regs != _number(r"Used (\d+) registers", ptxas, "registers in ptxas's report"):
        raise RuntimeError(f"cuobjdump and ptxas disagree on the registers:\n{usage}\n{ptxas}")
    result = dict(
        {k: v for k, v in variant.items() if k != "compile"}, registers=regs,
        spill_stores=_number(r"(\d+) bytes spill stores", ptxas, "spill stores"),
        spill_loads=_number(r"(\d+) bytes spill loads", ptxas, "spill loads"),
        stack=_number(r"STACK:(\d+)", usage, "stack"), local=_number(r"LOCAL:(\d+)", usage, "local memory"),
        shared=compiled.metadata.shared + _number(r"SHARED:(\d+)", usage, "static shared memory"),
        compile_s=round(time.perf_counter() - start, 1),
    )
    result["spill"] = result["spill_stores"] + result["spill_loads"]
    result.update(occupancy(regs, result["shared"], variant["num_warps"], SM[variant["arch"]]))
    return result


def occupancy(regs, shared, num_warps, sm):
    """Resident blocks and warps per SM of a kernel of `regs` registers per thread, `shared` bytes per block and
    `num_warps` warps per block, and what limits them."""
    per_warp = -(-regs * 32 // sm["reg_unit"]) * sm["reg_unit"]
    limits = {
        "registers": sm["regs"] // per_warp // num_warps,
        "shared": (sm["shared"] // shared if shared else sm["blocks"]) if shared <= sm["shared_block"] else 0,
        "warps": sm["warps"] // num_warps,
        "blocks": sm["blocks"],
    }
    blocks = min(limits.values())
    limited_by = "+".join(k for k, v in limits.items() if v == blocks)
    if shared > sm["shared_block"]:
        limited_by = f"shared > {sm['shared_block'] // 1024} KiB a block: cannot launch"
    return dict(blocks=blocks, resident_warps=blocks * num_warps, limited_by=limited_by)


def summary(results):
    return (f"{len(results)} kernels: worst spill {max(r['spill'] for r in results)} bytes, fewest resident warps per "
            f"SM {min(r['resident_warps'] for r in results)}")


def _tile(text):
    rows, warps = (int(x) for x in text.split("x"))
    return rows, warps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", choices=sorted(SM), default=sorted(SM, reverse=True))
    parser.add_argument("--inputs", nargs="+", choices=("bf16", "fp32", "tf32"), default=list(DEFAULT_INPUTS),
                        help="bf16 inputs; fp32 inputs with exact fp32 dots (torch's default: TF32 matmuls off; "
                        "about 10 minutes more to compile on 2 cores); fp32 inputs with TF32 dots")
    parser.add_argument("--calls", nargs="+", choices=list(CALLS), default=list(DEFAULT_CALLS),
                        help="the launcher's calls whose kernels are compiled: an encoder's training step "
                        f"(bidirectional, padded, trained bias), a decoder's (causal), both at {SHORT} tokens (the "
                        "short path), a decode step")
    parser.add_argument("--all-flags", action="store_true", help="every combination of causal, mask, trained bias "
                        "and per-head projection (and of the decode step's) instead of --calls")
    parser.add_argument("--tiles", type=_tile, nargs="+", default=[(nprf_triton.BLOCK, nprf_triton.NUM_WARPS)],
                        metavar="ROWSxWARPS", help="the attention kernels' tiles (default: the launcher's, "
                        f"{nprf_triton.BLOCK}x{nprf_triton.NUM_WARPS}); others as `triton_attention(block=, "
                        "num_warps=)` takes them")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="compiling processes")
    parser.add_argument("--json", help="also write the rows and the summary as JSON to this path")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # (a note on Triton 3.10's default)

    start = time.perf_counter()
    todo = variants(args.arch, args.inputs, args.calls, args.all_flags, args.tiles)
    # the longest first (exact fp32 dots, then the biggest kernels), so that no process is left with them at the end
    source = [len(getattr(sys.modules[v["module"]], v["kernel"]).src) for v in todo]
    order = sorted(range(len(todo)), key=lambda i: ("fp32" not in todo[i]["inputs"], -source[i]))
    with tempfile.TemporaryDirectory(prefix="kernel_resources_") as cache:
        os.environ.update(TRITON_CACHE_DIR=cache, TRITON_DUMP_PTXAS_LOG="1")  # (the workers inherit both)
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                done = dict(zip(order, pool.map(measure, [todo[i] for i in order])))
        else:
            done = {i: measure(todo[i]) for i in order}
    results = [done[i] for i in range(len(todo))]

    print(f"Triton {triton.__version__}; B = {BATCH}, H = {HEADS}, n = {LENGTH} (short path: {SHORT}), d = m = {DIM}, "
          f"band {BAND}; tf32: fp32 inputs, TF32 dots; spill: ptxas's spill stores + loads a thread; shared: a "
          "block's, with CUDA's reserved 1 KiB")
    header = ("kernel", "sm", "inputs", "calls", "rows", "warps", "stages", "regs", "spill B", "stack B",
              "shared KiB", "blocks", "warps/SM", "limited by")
    rows = [(r["kernel"].removeprefix("nprf_").removesuffix("_kernel"), r["arch"], "/".join(r["inputs"]),
             "; ".join(r["flags"]), r["rows"] or "-", r["num_warps"], r["num_stages"], r["registers"], r["spill"],
             r["stack"], f"{r['shared'] / 1024:.1f}", r["blocks"], r["resident_warps"], r["limited_by"])
            for r in results]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    line = summary(results)
    print(f"({time.perf_counter() - start:.0f} s, compiling in {args.jobs} processes)")
    print(line)
    if args.json:
        write_json(args.json, dict(triton=triton.__version__, shape=dict(batch=BATCH, heads=HEADS, length=LENGTH, d=DIM,
                                                                      m=FEATURES, band=BAND),
                                   sm=SM, kernels=results, summary=line))


if __name__ == "__main__":
    main()
