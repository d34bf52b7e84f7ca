"""benchmarks/kernel_resources.py (issue 55, item 0): the Triton kernels compiled ahead of time for a GPU this machine
does not have, and what they cost an SM. The script runs once here (sm_90, bf16: the issue's target; an encoder's
and a decoder's training step, at 4,096 tokens (the banded kernels) and at 512 (the short path's), and a decode step,
16 variants), in a process of its own (this session runs Triton's interpreter, whose kernels cannot be compiled), and
every kernel meets the issue's targets there: no spill, >= 8 resident warps per SM. (sm_80 and fp32 inputs with TF32
dots still spill in backward: the script's other rows, not a test; on sm_80, ptxas 12.9 gives the short path's
key_grad 32 registers and about 26 KB of spill. At sm_90 bf16, `--all-flags` compiles every combination of causal,
padding, trained bias and per-head projection, at both lengths, without a spill.)
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernel_resources.py")
SUMMARY = re.compile(r"^(\d+) kernels: worst spill (\d+) bytes, fewest resident warps per SM (\d+)$")


def _cannot_compile():
    """Why Triton cannot compile CUDA kernels on this machine (no GPU needed), or None."""
    try:
        from triton import knobs
        from triton.backends import backends
    except ImportError as error:
        return f"this Triton cannot compile ahead of time ({error})"
    if "nvidia" not in backends:
        return "this Triton has no CUDA backend"
    for tool in ("ptxas", "cuobjdump"):
        try:
            path = getattr(knobs.nvidia, tool).path
        except Exception as error:  # noqa: BLE001 (a missing or unreadable tool, however Triton says so)
            return f"no {tool} for Triton's CUDA backend ({type(error).__name__}: {error})"
        if not (path and os.access(path, os.X_OK)):
            return f"no {tool} for Triton's CUDA backend ({path!r} does not run)"
    return None


def _script():
    """The script as a module (its functions), imported without running it."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("kernel_resources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package_kernels():
    """The names of the package's @triton.jit kernels, read from its sources."""
    names = set()
    for name in ("nprf_triton_kernels.py", "nprf_triton_backward.py", "nprf_triton_decode.py",
                 "nprf_triton_short_kernels.py"):
        with open(os.path.join(ROOT, "nprf_hf", name)) as f:
            names.update(re.findall(r"^@triton\.jit\ndef (\w+_kernel)\(", f.read(), re.M))
    return names


@pytest.fixture(scope="module")
def sm90_bf16(tmp_path_factory):
    """(stdout, the JSON rows) of `kernel_resources.py --arch 90 --inputs bf16`."""
    pytest.importorskip("triton")
    reason = _cannot_compile()
    if reason:
        pytest.skip(reason)
    path = tmp_path_factory.mktemp("kernel_resources") / "sm90_bf16.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, SCRIPT, "--arch", "90", "--inputs", "bf16", "--calls", "encoder", "decoder",
                           "short_encoder", "short_decoder", "decode", "--json", str(path)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:  # (pytest.fail, not an assertion: the xfail below expects only AssertionError)
        pytest.fail(f"kernel_resources.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    with open(path) as f:
        return done.stdout, json.load(f)["kernels"]


def test_report_covers_every_kernel_with_plausible_resources(sm90_bf16):
    """A row per compiled variant, every kernel of the package among them at the launcher's tile, numbers a GPU could
    have, and the summary line last, computed from the rows."""
    from nprf_hf import nprf_triton

    stdout, rows = sm90_bf16
    lines = stdout.strip().splitlines()
    summary = SUMMARY.match(lines[-1])
    assert summary, lines[-1]
    assert int(summary.group(1)) == len(rows)
    assert int(summary.group(2)) == max(r["spill"] for r in rows)
    assert int(summary.group(3)) == min(r["resident_warps"] for r in rows)
    assert {r["kernel"] for r in rows} == _package_kernels()
    for r in rows:
        name = r["kernel"].removeprefix("nprf_").removesuffix("_kernel")
        assert any(line.split()[:3] == [name, "90", "bf16"] for line in lines), name  # its row in the table
        assert r["arch"] == 90 and r["inputs"] == ["bf16"]
        assert 1 <= r["registers"] <= 255, r
        assert r["spill"] == r["spill_stores"] + r["spill_loads"] >= 0, r
        assert r["shared"] >= 1024, r  # at least CUDA's reserved 1 KiB a block
        assert r["num_warps"] == nprf_triton.NUM_WARPS
        assert r["rows"] == (None if name == "decode" else nprf_triton.BLOCK)
        assert name == "decode" or r["num_stages"] == nprf_triton.NUM_STAGES
        assert 1 <= r["blocks"] <= 32 and r["resident_warps"] == r["blocks"] * r["num_warps"] <= 64, r


def test_occupancy_counts_as_cudas_calculator():
    """Resident warps per SM from registers (256 a warp's allocation unit), shared memory and the SM's limits."""
    script = _script()
    sm90, sm80 = script.SM[90], script.SM[80]
    # the issue's forward: 255 registers (8,192 a warp) and 104 KiB + 1 KiB of shared memory, 4 warps: 2 blocks
    assert script.occupancy(255, 107520, 4, sm90) == dict(blocks=2, resident_warps=8, limited_by="registers+shared")
    assert script.occupancy(128, 1024, 4, sm90)["resident_warps"] == 16  # 4,096 registers a warp
    assert script.occupancy(129, 1024, 4, sm90)["resident_warps"] == 12  # rounded up to 4,352
    assert script.occupancy(32, 1024, 4, sm90) == dict(blocks=16, resident_warps=64, limited_by="registers+warps")
    assert script.occupancy(16, 1024, 1, sm90) == dict(blocks=32, resident_warps=32, limited_by="blocks")
    assert script.occupancy(64, 100 * 1024, 4, sm80)["blocks"] == 1  # 164 KiB an SM on sm_80
    assert script.occupancy(64, 100 * 1024, 4, sm90)["blocks"] == 2  # 228 KiB on sm_90
    too_big = script.occupancy(64, 170 * 1024, 4, sm80)
    assert too_big["resident_warps"] == 0 and "cannot launch" in too_big["limited_by"]
    rows = [dict(spill=0, resident_warps=16), dict(spill=96, resident_warps=8)]
    assert script.summary(rows) == "2 kernels: worst spill 96 bytes, fewest resident warps per SM 8"


def test_every_kernel_meets_the_issue_targets_on_sm90(sm90_bf16):
    """Issue 55's targets at the chosen config (sm_90, bf16, the launcher's tile and stages): no spill, and at least 8
    resident warps per SM, for every kernel (before: query_grad 384 B and key_grad 996 B of spill at 255 registers,
    the decode step 8,232 B at 32)."""
    _, rows = sm90_bf16
    missed = [f"{r['kernel']} ({'; '.join(r['flags'])}): {r['registers']} registers, {r['spill']} B of spill, "
              f"{r['resident_warps']} warps per SM" for r in rows if r["spill"] > 0 or r["resident_warps"] < 8]
    assert not missed, "\n".join(missed)
