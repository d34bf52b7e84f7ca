"""nprf-hf: kernelized attention with relative positional encoding (Luo et al., NeurIPS 2021) for
HuggingFace encoders: every family of `nprf_hf.families.FAMILIES` (BERT, RoBERTa, XLM-RoBERTa, ELECTRA,
DistilBERT).

The package is lazy (PEP 562): `import nprf_hf` imports neither torch nor transformers (so the `nprf-hf`
command line, `nprf_hf.cli`, answers `--help` at once), and a public name is imported when it is first used.
Every NPRF config and model class is registered with the Auto classes as soon as transformers is there: at
`import nprf_hf` when transformers is already imported, else right after transformers is imported (or an
`nprf_hf` module that imports it is), so `import nprf_hf` followed by `AutoModel.from_pretrained(nprf_dir)`
works in either order."""

import importlib
import importlib.util
import sys
import threading

from .families import FAMILIES, HEADS  # declarations: no imports of their own


__version__ = "0.1.0"


def _class_names():
    """{name: module} of every config and model class, in the order of the families and their heads
    (`NPRFBertConfig`, `NPRFBertPreTrainedModel`, `NPRFBertModel`, `NPRFBertForMaskedLM`, ...), from the
    declarations alone: the classes themselves need torch."""
    names = {}
    for family in FAMILIES.values():
        names[family.nprf_prefix + "Config"] = "configuration_nprf"
        names[family.nprf_prefix + "PreTrainedModel"] = "modeling_nprf"
        for head in ("model", *(head for head in family.heads if head != "model")):
            names[family.class_name(head)] = "modeling_nprf"
    return names


_CLASSES = _class_names()

# public name -> module that defines it
_LAZY = {
    "NPRFCache": "cache_nprf",
    "NPRFStaticCache": "cache_nprf",
    "convert_to_nprf": "convert",
    "convert_checkpoint": "convert",
    "attention_transfer": "transfer",
    "TransferArguments": "transfer",
    "read_transfer_texts": "transfer",
    "TransferReport": "transfer",
    "long_context_distillation": "long_context",
    "LongContextArguments": "long_context",
    "LongContextReport": "long_context",
    "read_long_text": "long_context",
    "chunk_and_pool": "long_context",
    "embed_documents": "long_context",
    "set_attention_variant": "modeling_nprf",
    "context_parallel": "attention_nprf",
    "explain": "attention_nprf",
    "SourceNotFoundError": "hub",
    "PushError": "hub",
    "NPRF_CONFIG_CLASSES": "configuration_nprf",
    "NPRF_MODEL_CLASSES": "modeling_nprf",
    **_CLASSES,
}

__all__ = ["functional", "NPRFCache", "NPRFStaticCache", "convert_to_nprf", "convert_checkpoint", "attention_transfer",
           "TransferArguments", "read_transfer_texts", "TransferReport", "long_context_distillation",
           "LongContextArguments", "LongContextReport", "read_long_text",
           "chunk_and_pool", "embed_documents", "set_attention_variant", "context_parallel", "explain",
           "SourceNotFoundError", "PushError", *_CLASSES]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module("." + _LAZY[name], __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module("." + name, __name__)  # a submodule: nprf_hf.functional, nprf_hf.glue, ...
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# ---------------------------------------------------------------------------------------------
# Auto classes: registered once transformers is imported
# ---------------------------------------------------------------------------------------------

_lock = threading.RLock()
_executing = 0  # nprf_hf modules being executed: registering imports them, so it waits until they are done
_registered = False


def _register_auto_classes():
    """AutoConfig and every head's Auto class learn the NPRF configs and models (`nprf_bert`, ...)."""
    import transformers

    from .configuration_nprf import NPRF_CONFIG_CLASSES
    from .modeling_nprf import NPRF_MODEL_CLASSES

    for model_type, config_class in NPRF_CONFIG_CLASSES.items():
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for head, model_class in NPRF_MODEL_CLASSES[model_type].items():
            if head is not None:
                getattr(transformers, HEADS[head].auto_class).register(config_class, model_class, exist_ok=True)


def _register_when_ready():
    global _registered
    with _lock:  # not held while registering: that imports modules, which other threads may be importing
        if _registered or _executing or "transformers" not in sys.modules:
            return
        _registered = True  # first: registering imports nprf_hf modules, whose completion comes back here
    try:
        _register_auto_classes()
    except BaseException:
        _registered = False
        raise


class _WatchedLoader:
    """Runs a module with its own loader (which the module keeps), then registers the Auto classes if
    transformers is there; counts the nprf_hf modules being run."""

    def __init__(self, loader, ours):
        self.loader, self.ours = loader, ours

    def __getattr__(self, name):  # get_code, get_source, is_package, ... (runpy, inspect)
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        global _executing
        module.__loader__ = module.__spec__.loader = self.loader
        if self.ours:
            with _lock:
                _executing += 1
        try:
            self.loader.exec_module(module)
        finally:
            if self.ours:
                with _lock:
                    _executing -= 1
        _register_when_ready()


class _ImportWatcher:
    """A `sys.meta_path` finder that only wraps the loader of transformers and of nprf_hf's modules."""

    def find_spec(self, fullname, path=None, target=None):
        ours = fullname.startswith(__name__ + ".")
        if not ours and fullname != "transformers":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _WatchedLoader(spec.loader, ours)
        return spec


if not any(type(finder).__name__ == "_ImportWatcher" for finder in sys.meta_path):
    sys.meta_path.insert(0, _ImportWatcher())
_register_when_ready()  # transformers already imported: register now, as an eager package would
