"""The lazy package (`nprf_hf/__init__.py`): `import nprf_hf` and the `nprf-hf` command line's `--help` and argument
errors import neither torch nor transformers, while every NPRF class still reaches the Auto classes, whichever of
nprf_hf and transformers a user imports first."""

import subprocess
import sys
import textwrap

import pytest

import nprf_hf
from nprf_hf.configuration_nprf import NPRF_CONFIG_CLASSES
from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES

from conftest import tiny_config


def run_python(code, *args):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def test_import_is_light():
    result = run_python("""
        import sys
        import nprf_hf
        assert "NPRFBertModel" in nprf_hf.__all__ and "NPRFBertModel" in dir(nprf_hf)
        assert nprf_hf.options.NPRF_FIELDS and nprf_hf.__version__
        try:
            nprf_hf.no_such_name
        except AttributeError as error:
            print("ERROR", error)
        print("LOADED", sorted(name for name in ("torch", "transformers") if name in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert "ERROR module 'nprf_hf' has no attribute 'no_such_name'" in result.stdout
    assert "LOADED []" in result.stdout


def test_all_names_every_config_and_model_class():
    classes = [cls for model_type, config_class in NPRF_CONFIG_CLASSES.items()
               for cls in (config_class, *NPRF_MODEL_CLASSES[model_type].values())]
    assert nprf_hf.__all__[-len(classes):] == [cls.__name__ for cls in classes]  # derived without importing them
    for name in nprf_hf.__all__:
        assert getattr(nprf_hf, name) is not None, name
    assert all(getattr(nprf_hf, cls.__name__) is cls for cls in classes)


@pytest.fixture(scope="module")
def nprf_dir(tmp_path_factory):
    from nprf_hf import NPRFBertConfig, NPRFBertModel

    path = str(tmp_path_factory.mktemp("nprf_bert"))
    NPRFBertModel(NPRFBertConfig(**tiny_config(num_random_features=8))).save_pretrained(path)
    return path


@pytest.mark.parametrize("first", [
    "import nprf_hf",  # the README's way
    "import transformers; import nprf_hf",  # transformers first: registered at `import nprf_hf`
    "from nprf_hf.cache_nprf import NPRFCache",  # an nprf_hf module that imports transformers half-way through
    "",  # control: without nprf_hf the Auto classes do not know the model (it would need trust_remote_code=True)
])
def test_auto_classes_know_the_models_after_import(nprf_dir, first):
    result = run_python(f"""
        {first}
        from transformers import AutoModel
        try:
            model = AutoModel.from_pretrained({nprf_dir!r})
        except ValueError as error:
            print("REFUSED", error)
        else:
            print("LOADED", type(model).__module__, type(model).__name__)
    """)
    assert result.returncode == 0, result.stderr
    if first:
        assert "LOADED nprf_hf.modeling_nprf NPRFBertModel" in result.stdout, result.stdout
    else:
        assert "REFUSED" in result.stdout and "trust_remote_code" in result.stdout, result.stdout


FAST_CLI = """
import sys
from nprf_hf.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    print("EXIT", exit.code)
print("LOADED", sorted(name for name in ("torch", "transformers", "nprf_hf.modeling_nprf") if name in sys.modules))
"""


@pytest.mark.parametrize("args,code", [(["--help"], 0), (["convert", "--help"], 0), (["convert", "--bogus"], 2),
                                       (["card"], 2)])
def test_cli_help_and_argument_errors_import_neither_torch_nor_the_models(args, code):
    """`nprf-hf --help` and argument errors are answered from the torch-free declarations."""
    completed = run_python(FAST_CLI, *args)
    assert f"EXIT {code}" in completed.stdout, completed.stdout + completed.stderr
    assert "LOADED []" in completed.stdout, completed.stdout
    if args[-1] == "--help" and args[0] == "convert":
        from nprf_hf.options import NPRF_FIELDS

        assert all("--" + f.name.replace("_", "-") in completed.stdout for f in NPRF_FIELDS if f.convert_option)
