"""benchmarks/stable_study.py end to end at a tiny size: every part writes its runs, tables, JSON and plots, the
switch to NPRF is evaluated per m, part d pre-trains and fine-tunes the arm it names, and a finished run is not
trained again."""

import importlib.util
import json
import os

import pytest

from conftest import shared_data


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("stable_study", os.path.join(ROOT, "benchmarks", "stable_study.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_study_runs_every_part_and_resumes(study, tmp_path):
    for name, lines in (("train.txt", 200), ("test.txt", 60)):
        with open(shared_data("wikitext-2", "valid.txt" if name == "train.txt" else "test.txt"), encoding="utf-8") as f:
            (tmp_path / name).write_text("".join(next(f) for _ in range(lines)), encoding="utf-8")
    argv = ["--size", "tiny", "--parts", "a", "b", "c", "d", "--arms", "softmax", "normalized", "--seeds", "0",
            "--steps", "3", "--vocab-size", "300", "--train-file", str(tmp_path / "train.txt"),
            "--test-file", str(tmp_path / "test.txt"), "--threads", "1", "--output", str(tmp_path / "out"),
            "--max-fine-tune-samples", "16"]
    report = study.main(argv)
    assert [r["arm"] for r in report["a"]] == ["softmax"]
    conditions = sorted(study.STABILITY_CONDITIONS)  # all of them by default
    assert sorted((r["arm"], r["condition"]) for r in report["b"]) == [("softmax", c) for c in conditions]
    assert [r["arm"] for r in report["c"]] == ["softmax", "normalized"]
    for run in report["c"]:
        assert sorted(run["swapped"]) == list(study.SWAP_FEATURES) and all(p > 1 for p in run["swapped"].values())
        assert len(run["losses"]) == 3 and run["perplexity"] > 1
    (pretrained,) = report["d"]  # part d: the softmax arm (nprf+rpe is not among --arms)
    assert pretrained["arm"] == "softmax" and pretrained["perplexity"] > 1 and len(pretrained["losses"]) == 3
    assert sorted(pretrained["glue"]) == ["mrpc", "sst2"]
    assert all(0 <= v <= 1 for scores in pretrained["glue"].values() for v in scores.values())
    fine_tuned = json.load(open(tmp_path / "out" / "runs" / "d-softmax-sst2-s0" / "config.json"))
    assert fine_tuned["attention_variant"] == "softmax" and fine_tuned["architectures"][0].endswith("SequenceClassification")
    saved = json.load(open(tmp_path / "out" / "results.json"))
    assert saved["c"][1]["swapped"]["64"] == report["c"][1]["swapped"][64]
    tables = (tmp_path / "out" / "results.md").read_text()
    assert "Figure 2" in tables and "| normalized | 0 |" in tables and "## d. MLM from scratch" in tables
    for plot in ("loss_curves", "grad_norms", "figure2", "mlm_loss_curves"):
        assert (tmp_path / "out" / f"{plot}.png").stat().st_size > 0
    # resumable: the finished runs are read back, not trained again
    finished = [tmp_path / "out" / "runs" / name for name in ("a-softmax-s0/results.json", "d-softmax-mlm-s0/eval_results.json",
                                                                "d-softmax-mrpc-s0/eval_results.json")]
    stamps = [os.path.getmtime(path) for path in finished]
    again = study.main(argv)
    assert [os.path.getmtime(path) for path in finished] == stamps
    assert again["c"][1]["swapped"] == report["c"][1]["swapped"]
    only_bf16 = study.main(argv + ["--parts", "b", "--conditions", "bf16"])  # the later --parts wins
    assert [(r["arm"], r["condition"]) for r in only_bf16["b"]] == [("softmax", "bf16")] and not only_bf16["a"]
