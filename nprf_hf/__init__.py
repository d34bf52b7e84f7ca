"""nprf-hf: kernelized attention with relative positional encoding (Luo et al., NeurIPS 2021) for
HuggingFace encoders: every family of `nprf_hf.families.FAMILIES` (BERT, RoBERTa, XLM-RoBERTa, ELECTRA,
DistilBERT). Importing the package registers every model with the Auto classes."""

import transformers

from . import functional
from .cache_nprf import NPRFCache, NPRFStaticCache
from .configuration_nprf import NPRF_CONFIG_CLASSES
from .convert import convert_checkpoint, convert_to_nprf
from .families import HEADS
from .modeling_nprf import NPRF_MODEL_CLASSES, set_attention_variant
from .long_context import LongContextReport, chunk_and_pool, embed_documents, long_context_distillation, read_long_text
from .transfer import TransferReport, attention_transfer, read_transfer_texts


__version__ = "0.1.0"

# NPRFBertConfig, NPRFBertModel, NPRFBertForMaskedLM, ...: every config and model class, exported and
# registered with its Auto class
_EXPORTS = {}
for _model_type, _config_class in NPRF_CONFIG_CLASSES.items():
    transformers.AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    _EXPORTS[_config_class.__name__] = _config_class
    for _head, _model_class in NPRF_MODEL_CLASSES[_model_type].items():
        _EXPORTS[_model_class.__name__] = _model_class
        if _head is not None:
            getattr(transformers, HEADS[_head].auto_class).register(_config_class, _model_class, exist_ok=True)
globals().update(_EXPORTS)

__all__ = ["functional", "NPRFCache", "NPRFStaticCache", "convert_to_nprf", "convert_checkpoint", "attention_transfer", "read_transfer_texts", "TransferReport",
           "long_context_distillation", "LongContextReport", "read_long_text", "chunk_and_pool", "embed_documents",
           "set_attention_variant",
           *_EXPORTS]
