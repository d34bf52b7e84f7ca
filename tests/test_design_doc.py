"""docs/DESIGN.md against the code it describes: its file map names every package module, benchmark script and
test file (read from the folders, so a new file fails here until it is mapped) and no file that is gone; its layer
diagram lists every package module once, each on a line below every module it imports; its config table is what
`utils/config_table.py` writes from `options.NPRF_FIELDS`."""

import os
import re
import sys

from test_package_layers import imports


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "DESIGN.md")
# folder -> which of its files the file map must name
MAPPED = {
    "nprf_hf": lambda name: name.endswith(".py"),
    "benchmarks": lambda name: name.endswith((".py", ".sh")),
    "examples": lambda name: name.endswith((".py", ".sh")),
    "tests": lambda name: name.startswith("test_") and name.endswith(".py"),
}


def design_text():
    with open(DESIGN, encoding="utf-8") as handle:
        return handle.read()


def section(text, heading):
    """The text under `## heading`, up to the next heading of that level."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_file_map_names_every_file_and_no_missing_one():
    rows = re.findall(r"^\| `([^`]+)` \|", section(design_text(), "File map"), re.M)
    mapped = set(rows)
    assert len(rows) == len(mapped), f"files mapped twice: {sorted(r for r in mapped if rows.count(r) > 1)}"
    files = [f"{folder}/{name}" for folder, wanted in MAPPED.items()
             for name in sorted(os.listdir(os.path.join(ROOT, folder))) if wanted(name)]
    missing = [path for path in files if path not in mapped]
    assert not missing, f"files missing from the file map of docs/DESIGN.md (add a row saying what each is): {missing}"
    gone = sorted(path for path in mapped if not os.path.exists(os.path.join(ROOT, path)))
    assert not gone, f"docs/DESIGN.md's file map names files that do not exist: {gone}"


def diagram_lines():
    """{module: line index} of the layer diagram (the indented block under "Layers of the code"); a module named
    twice fails. Names after a slash (examples/glue_scripts.py) are scripts, not modules."""
    block = re.search(r"\n\n((?: {4}.*\n)+)", section(design_text(), "Layers of the code")).group(1)
    line_of = {}
    for index, line in enumerate(block.splitlines()):
        for module in re.findall(r"(?<![\w/])(\w+)\.py\b", line):
            assert module not in line_of, f"{module}.py is named twice in DESIGN's layer diagram"
            line_of[module] = index
    return line_of


def test_layer_diagram_lists_every_module_once():
    package = os.path.join(ROOT, "nprf_hf")
    modules = {name[:-3] for name in os.listdir(package) if name.endswith(".py")}
    line_of = diagram_lines()
    assert not modules - set(line_of), f"modules missing from DESIGN's layer diagram: {sorted(modules - set(line_of))}"
    assert not set(line_of) - modules, f"DESIGN's layer diagram names no module: {sorted(set(line_of) - modules)}"


def test_layer_diagram_order_follows_the_imports():
    """Each module sits on the line of, or below, every package module it imports (lazy imports included)."""
    line_of = diagram_lines()
    wrong = [
        f"{module}.py (line {line_of[module]}) imports {target}.py (line {line_of[target]})"
        for module in sorted(line_of) for target in sorted(imports(module))
        if target in line_of and line_of[target] > line_of[module]
    ]
    assert not wrong, "DESIGN's layer diagram has imports running up: move the importer below\n" + "\n".join(wrong)


def test_config_table_is_written_from_the_options():
    sys.path.insert(0, os.path.join(ROOT, "utils"))
    try:
        import config_table
    finally:
        sys.path.pop(0)
    text = design_text()
    assert text.count(config_table.BEGIN) == 1 and text.count(config_table.END) == 1
    table = text[text.index(config_table.BEGIN) + len(config_table.BEGIN):text.index(config_table.END)]
    assert table == config_table.render(), "DESIGN's config table differs from options.NPRF_FIELDS: run python utils/config_table.py"
