"""The README's generated parts: the figure (utils/readme_figure.py, drawn from the committed benchmark JSON), the
families x heads table (utils/readme_families.py, from nprf_hf/families.py) and the memory numbers the README quotes
from that JSON. None of them may go stale or fail silently."""

import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURE = os.path.join(ROOT, "utils", "readme_figure.py")
README = os.path.join(ROOT, "README.md")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "utils", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_figure(*args):
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, FIGURE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _readme():
    with open(README, encoding="utf-8") as handle:
        return handle.read()


def _is_png(path):
    with open(path, "rb") as handle:
        return handle.read(8) == PNG_SIGNATURE


def test_figure_is_written_from_the_committed_json(tmp_path):
    output = tmp_path / "sub" / "figure.png"
    result = _run_figure("--output", str(output))
    assert result.returncode == 0, result.stderr
    assert output.is_file() and _is_png(output) and output.stat().st_size > 10_000
    gpu = os.path.isfile(os.path.join(ROOT, "benchmarks", "results", "gpu_cuda_bf16.json"))
    assert ("with GPU panels" if gpu else "CPU only") in result.stdout


@pytest.mark.parametrize("option", ["--attention", "--attention-memory", "--model", "--model-recompute", "--gpu"])
def test_figure_fails_clearly_when_a_json_is_missing(tmp_path, option):
    missing = tmp_path / "nothing_here.json"
    output = tmp_path / "figure.png"
    result = _run_figure(option, str(missing), "--output", str(output))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert f"missing {missing}" in result.stderr and "it is written by:" in result.stderr, result.stderr
    assert not output.exists()


def test_figure_draws_gpu_panels_from_gpu_py_results(tmp_path):
    """A results file in benchmarks/gpu.py's layout (the keys its attention and model parts write) adds the GPU row."""
    attention = [{"n": n, "nprf_forward_s": 1e-4 * n / 1024, "sdpa_forward_s": 2e-5 * (n / 1024) ** 2,
                  "nprf_train_s": 3e-4 * n / 1024, "sdpa_train_s": 6e-5 * (n / 1024) ** 2,
                  "nprf_train_peak_bytes": 1000 * n, "sdpa_train_peak_bytes": 800 * n} for n in (1024, 4096, 16384)]
    model = [{"batch": b, "n": n, "nprf_forward_s": 0.01 * b * n / 512, "sdpa_forward_s": 0.012 * b * n / 512,
              "nprf_train_s": 0.03 * b * n / 512, "sdpa_train_s": 0.035 * b * n / 512,
              "nprf_train_peak_bytes": 2**20 * b * n, "sdpa_train_peak_bytes": 2**20 * b * n * 0.9}
             for b, n in ((32, 128), (8, 512), (1, 4096))]
    gpu = tmp_path / "gpu_cuda_bf16.json"
    gpu.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "attention": attention,
                               "model": model}))
    output = tmp_path / "figure.png"
    result = _run_figure("--gpu", str(gpu), "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert "with GPU panels" in result.stdout and _is_png(output)
    # gpu.py writes its JSON after every part: a file cut short after the attention part still draws
    gpu.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "attention": attention}))
    output.unlink()
    result = _run_figure("--gpu", str(gpu), "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert "with GPU panels" in result.stdout and _is_png(output)


def _png_size(path):
    with open(path, "rb") as handle:
        header = handle.read(24)
    return struct.unpack(">II", header[16:24])


def test_readme_shows_the_figure():
    text = _readme()
    assert "](docs/readme_figure.png)" in text
    committed = os.path.join(ROOT, "docs", "readme_figure.png")
    assert os.path.isfile(committed) and _is_png(committed)
    # once the GPU results are committed, the committed figure must be redrawn with their rows (twice as tall)
    gpu = os.path.isfile(os.path.join(ROOT, "benchmarks", "results", "gpu_cuda_bf16.json"))
    width, height = _png_size(committed)
    assert (width, height) == (880, 1184 if gpu else 592), (
        "docs/readme_figure.png is stale: run python utils/readme_figure.py")
    # the figure opens the section that tells a user when to use the package
    section = text.split("## When to use it", 1)[1].lstrip()
    assert section.startswith("![") and "(docs/readme_figure.png)" in section.splitlines()[0]


def test_readme_families_table_matches_families_py():
    families = _load("readme_families")
    text = _readme()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| family |"))
    end = next(i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].startswith("|"))
    assert "\n".join(lines[start:end]) == families.families_table(), (
        "the README's families table is stale: paste `python utils/readme_families.py` over it")
    for note in families.alias_notes():
        assert note in text, f"the README does not say {note}"


def _mib(value):
    return value / 2**20


def test_readme_memory_numbers_are_the_jsons():
    """The training-memory fact the README states, recomputed from the JSON the figure draws."""
    text = " ".join(_readme().split())
    with open(os.path.join(ROOT, "benchmarks", "plots", "long_sequence.json")) as handle:
        sweep = {(p["variant"], p["mode"], p["n"]): p for p in json.load(handle)["results"] if p["status"] == "ok"}
    lengths = sorted({n for _, mode, n in sweep if mode == "train"})
    ratios = {n: sweep["nprf", "train", n]["peak_memory_bytes"] / sweep["sdpa", "train", n]["peak_memory_bytes"]
              for n in lengths}
    assert all(ratio > 1 for ratio in ratios.values())  # "NPRF training used more memory at every length"
    rest = [ratios[n] for n in lengths[1:]]
    assert f"{ratios[lengths[0]]:.2f}× SDPA's memory at {lengths[0]} tokens" in text
    assert f"{min(rest):.2f}–{max(rest):.2f}× from {lengths[1]:,} to {lengths[-1]:,}" in text
    longest = lengths[-1]
    assert (f"({_mib(sweep['nprf', 'train', longest]['peak_memory_bytes']):,.0f} against "
            f"{_mib(sweep['sdpa', 'train', longest]['peak_memory_bytes']):,.0f} MiB)") in text
    with open(os.path.join(ROOT, "benchmarks", "results", "long_sequence_train16k_nobias_cpu.json")) as handle:
        later = {p["variant"]: _mib(p["peak_memory_bytes"]) for p in json.load(handle)["results"]}
    assert f"{later['nprf']:,.0f} against {later['sdpa']:,.0f} MiB ({later['nprf'] / later['sdpa']:.3f}×" in text
    with open(os.path.join(ROOT, "benchmarks", "results", "attention_long_cpu.json")) as handle:
        rows = json.load(handle)["rows"]
    attention = [row["peak_bytes"]["auto"] / row["peak_bytes"]["sdpa"] for row in rows]
    assert f"Attention alone peaks at {min(attention):.1f}–{max(attention):.1f}× SDPA's memory" in text
