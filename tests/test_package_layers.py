"""The package's import graph: every module sits in one layer (declarations <- math <- edge <- model <- tools), imports
run only down the layers or within one, never in a circle, and never to the package face (`__init__`) or the
scripts; the math files stay small enough to read (one file per algorithm), and so do the functions (issue 56)."""

import ast
import os

import pytest


PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nprf_hf")
# A new module must be given a layer here: where it sits is a design decision, not an accident.
LAYERS = {
    "declarations": ("options", "families", "hub", "checkpoint_files"),  # torch-free: the CLI reads them without torch
    "math": ("nprf_schedule", "nprf_cpu_split", "nprf_positions", "nprf_features", "nprf_dense_near", "nprf_dense", "nprf_fft", "nprf_near_field", "nprf_banded_far", "nprf_banded_window", "nprf_banded", "nprf_banded_recompute",
             "nprf_terms", "nprf_naive", "nprf_triton_plan", "nprf_triton", "nprf_triton_kernels",
             "nprf_triton_decode", "nprf_triton_backward", "nprf_triton_short", "nprf_triton_short_kernels",
             "nprf_dispatch",
             "nprf_recurrent", "nprf_context_parallel"),
    # around an attention call and a decode step: the CPU's threads (issue 56), the public functional entry
    "edge": ("nprf_cpu_threads", "functional"),
    "model": ("configuration_nprf", "cache_nprf", "attention_nprf", "modeling_nprf"),
    "tools": ("glue", "transfer", "long_context", "convert", "modelcard", "benchmarking", "cli"),
}
ORDER = list(LAYERS)
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}
MATH_MAX_LINES = 400
DISPATCHER_MAX_LINES = 350


def modules():
    return sorted(name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py")


def imports(module):
    """The package modules `module` imports (relative imports, at any depth of the file: lazy ones count too)."""
    with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import x: x must be a module, not a name of the package face
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("nprf_hf"):
            found.add((node.module.split(".") + ["__init__"])[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nprf_hf"):
                    found.add((alias.name.split(".") + ["__init__"])[1])
    return found


def test_every_module_has_a_layer():
    assert set(modules()) == set(LAYER_OF), "give each new module a layer in LAYERS (and remove deleted ones)"


@pytest.mark.parametrize("module", modules())
def test_imports_run_down_the_layers(module):
    for target in imports(module):
        assert target != "__init__", f"{module} imports the package face: import the module that defines the name"
        assert target in LAYER_OF, f"{module} imports {target}, which is not a package module"
        assert ORDER.index(LAYER_OF[target]) <= ORDER.index(LAYER_OF[module]), (
            f"{module} ({LAYER_OF[module]}) imports {target} ({LAYER_OF[target]}): an import back up the layers"
        )


def test_no_import_of_the_scripts():
    """The package never imports from examples/ or benchmarks/ (scripts sit above it, and are not shipped)."""
    root = os.path.dirname(PACKAGE)
    scripts = {"examples", "benchmarks", "utils"} | {
        name[:-3] for folder in ("examples", "benchmarks") for name in os.listdir(os.path.join(root, folder))
        if name.endswith(".py")
    }
    for module in modules() + ["__init__"]:
        with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                assert name.split(".")[0] not in scripts, f"{module} imports {name}, a script outside the package"


def test_no_import_circle():
    graph = {module: imports(module) & set(LAYER_OF) for module in modules()}
    state = {}

    def visit(module, path):
        if state.get(module) == "open":
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if state.get(module) == "done":
            return
        state[module] = "open"
        for target in sorted(graph[module]):
            visit(target, path + [module])
        state[module] = "done"

    for module in graph:
        visit(module, [])


# What only the edge may use: the math takes an `nprf_schedule` scheduler instead (issue 56, "threads at the edge")
THREADING = {"threading", "ctypes", "concurrent", "multiprocessing", "_thread"}


def threading_imports(tree):
    """The threading modules (THREADING, or `nprf_cpu_threads`) a parsed module imports, at any depth."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module.split(".")[0]] if node.module else [alias.name for alias in node.names])
    return found & (THREADING | {"nprf_cpu_threads"})


@pytest.mark.parametrize("module", LAYERS["math"])
def test_math_files_start_no_threads(module):
    """No math file imports threading, ctypes or `nprf_cpu_threads`: thread pools and thread counts are applied at
    the edge (`functional`, the layer, the cache's decode step) and reach the math as a scheduler object."""
    with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
        found = threading_imports(ast.parse(handle.read()))
    assert not found, f"{module} imports {sorted(found)}: take an `nprf_schedule` scheduler from the edge instead"


def test_the_threading_check_finds_imports():
    tree = ast.parse("import threading\nimport ctypes.util\nfrom concurrent.futures import ThreadPoolExecutor\n"
                     "from .nprf_cpu_threads import parallel_items\nfrom . import nprf_cpu_threads\nimport torch\n")
    assert threading_imports(tree) == {"threading", "ctypes", "concurrent", "nprf_cpu_threads"}


def test_math_files_are_small():
    for module in LAYERS["math"] + LAYERS["edge"]:
        with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
            lines = sum(1 for _ in handle)
        limit = DISPATCHER_MAX_LINES if module == "functional" else MATH_MAX_LINES
        assert lines <= limit, f"{module}.py has {lines} lines (at most {limit}): split it by algorithm or term"


FUNCTION_MAX_LINES = 80
FUNCTION_MAX_PARAMETERS = 12  # self / cls not counted
# "module.qualname" of the functions allowed past those limits, or a whole module, and why
LARGE_FUNCTIONS = {
    # the public functional API: one keyword per option of the attention
    "functional.nprf_attention", "functional.nprf_attention_weights",
    # Triton kernels (a parameter per pointer, stride and block size) and the custom ops that launch them (a custom
    # op's signature takes tensors and scalars, not objects)
    "nprf_triton_kernels", "nprf_triton_backward", "nprf_triton_decode", "nprf_triton._attention_backward",
    "nprf_triton._", "nprf_triton_short_kernels", "nprf_triton_short._short_backward", "nprf_triton_short._",
}


def functions(module):
    """(qualname, lines, parameters) of every function of `module`, methods and nested functions included."""
    with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = child.args
                names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
                names += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
                count = len(names) - (isinstance(node, ast.ClassDef) and names[:1] in (["self"], ["cls"]))
                found.append((prefix + child.name, child.end_lineno - child.lineno + 1, count))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_functions_are_small():
    """No function of the package over FUNCTION_MAX_LINES lines or FUNCTION_MAX_PARAMETERS parameters (issue 56):
    group options into a dataclass, split a long body into named steps."""
    offenders = [
        f"{module}.{name}: {lines} lines, {count} parameters"
        for module in modules() + ["__init__"] if module not in LARGE_FUNCTIONS
        for name, lines, count in functions(module)
        if (lines > FUNCTION_MAX_LINES or count > FUNCTION_MAX_PARAMETERS) and f"{module}.{name}" not in LARGE_FUNCTIONS
    ]
    assert not offenders, "functions too large:\n" + "\n".join(offenders)


def test_allowed_large_functions_exist():
    """Every name of LARGE_FUNCTIONS is still a module or a function of the package (no stale exemptions)."""
    known = set(modules())
    for module in modules():
        known.update(f"{module}.{name}" for name, _, _ in functions(module))
    assert LARGE_FUNCTIONS <= known, sorted(LARGE_FUNCTIONS - known)


# ---- one routing decision, and no module state in the math (issue 56) ------------------------------------------------

ROUTER = "nprf_dispatch"
# mutable containers: a module-level assignment of one of these is state (tuples, frozensets, NamedTuples and
# MappingProxyType are constants)
MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "defaultdict", "deque", "OrderedDict", "Counter"}
MUTABLE_LITERALS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
# "module.name" of the math's module state still allowed, and why (each must still exist: no stale exemptions)
MODULE_STATE = {}


def algorithm_names():
    """Every algorithm name, from where they are declared (options)."""
    from nprf_hf import options

    return set(options.ATTENTION_ALGORITHMS)


def _parse(module):
    with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
        return ast.parse(handle.read())


def _names_compared(node, names):
    """The algorithm names a Compare node holds as string constants, alone or in a tuple / list / set literal."""
    found = []
    for operand in (node.left, *node.comparators):
        items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        found += [item.value for item in items if isinstance(item, ast.Constant) and item.value in names]
    return found


def test_only_the_router_compares_algorithm_names():
    """What runs is decided in one place (`nprf_dispatch.choose_route`); everyone else reads the route and its row's
    flags. A comparison with an algorithm name outside the router is a second decision."""
    names = algorithm_names()
    assert names >= {"auto", "dense", "fft", "banded", "triton"}
    offenders = [
        f"{module}.py:{node.lineno}: {ast.unparse(node)}"
        for module in modules() + ["__init__"] if module != ROUTER
        for node in ast.walk(_parse(module)) if isinstance(node, ast.Compare) and _names_compared(node, names)
    ]
    assert not offenders, "algorithm names compared outside the router:\n" + "\n".join(offenders)


def test_the_algorithm_name_check_finds_comparisons():
    """The check above sees the forms it is for (so that its passing means something)."""
    names = algorithm_names()
    tree = ast.parse('a == "dense"\nb in ("auto", "x")\n"fft" != c\nd not in ["banded"]\ne == "nprf"\nf is None')
    found = [_names_compared(node, names) for node in ast.walk(tree) if isinstance(node, ast.Compare)]
    assert found == [["dense"], ["auto"], ["fft"], ["banded"], [], []]


def module_state(tree):
    """["name: why"] of a module's (its parsed `tree`) `global` / `nonlocal` statements and module-level mutable
    containers."""
    found = [f"{', '.join(node.names)}: a {type(node).__name__.lower()} statement (line {node.lineno})"
             for node in ast.walk(tree) if isinstance(node, (ast.Global, ast.Nonlocal))]
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        called = getattr(value.func, "id", getattr(value.func, "attr", None)) if isinstance(value, ast.Call) else None
        if isinstance(value, MUTABLE_LITERALS) or called in MUTABLE_CALLS:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{ast.unparse(target)}: a mutable container (line {node.lineno})" for target in targets]
    return found


def test_math_files_keep_no_module_state():
    """No `global` statement and no module-level list, dict or set in the math: settings come in as arguments or
    objects (`nprf_dispatch.Routing`), per-process state sits at the package's edge (`attention_nprf`'s
    `context_parallel` groups) or in MODULE_STATE with its reason."""
    offenders = [f"{module}.{line}" for module in LAYERS["math"] for line in module_state(_parse(module))
                 if f"{module}.{line.split(':')[0]}" not in MODULE_STATE]
    assert not offenders, "module state in the math files:\n" + "\n".join(offenders)


def test_module_state_check_finds_state_and_its_exemptions_exist():
    """The check sees globals and mutable containers, and passes constants; every MODULE_STATE entry still exists."""
    tree = ast.parse("import types\nA = []\nB = dict()\nC = (1, 2)\nD = frozenset()\nE = types.MappingProxyType({})\n"
                     "def f():\n    global A\n")
    assert [line.split(":")[0] for line in module_state(tree)] == ["A", "A", "B"]
    for name in MODULE_STATE:
        module, variable = name.split(".")
        assert any(line.startswith(variable + ":") for line in module_state(_parse(module))), f"{name}: stale exemption"
