"""nprf-hf: kernelized attention with relative positional encoding (Luo et al., NeurIPS 2021) for
HuggingFace BERT and RoBERTa. Importing the package registers every model with the Auto classes."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import functional
from .configuration_nprf import NPRFBertConfig, NPRFRobertaConfig
from .convert import convert_checkpoint, convert_to_nprf
from .transfer import TransferReport, attention_transfer, read_transfer_texts
from .modeling_nprf import (
    NPRFBertForMaskedLM,
    NPRFBertForMultipleChoice,
    NPRFBertForQuestionAnswering,
    NPRFBertForSequenceClassification,
    NPRFBertForTokenClassification,
    NPRFBertModel,
    NPRFBertPreTrainedModel,
    NPRFRobertaForCausalLM,
    NPRFRobertaForMaskedLM,
    NPRFRobertaForMultipleChoice,
    NPRFRobertaForQuestionAnswering,
    NPRFRobertaForSequenceClassification,
    NPRFRobertaForTokenClassification,
    NPRFRobertaModel,
    NPRFRobertaPreTrainedModel,
)


__version__ = "0.1.0"

AutoConfig.register(NPRFBertConfig.model_type, NPRFBertConfig, exist_ok=True)
AutoConfig.register(NPRFRobertaConfig.model_type, NPRFRobertaConfig, exist_ok=True)
for _auto, _bert, _roberta in [
    (AutoModel, NPRFBertModel, NPRFRobertaModel),
    (AutoModelForMaskedLM, NPRFBertForMaskedLM, NPRFRobertaForMaskedLM),
    (AutoModelForSequenceClassification, NPRFBertForSequenceClassification, NPRFRobertaForSequenceClassification),
    (AutoModelForTokenClassification, NPRFBertForTokenClassification, NPRFRobertaForTokenClassification),
    (AutoModelForQuestionAnswering, NPRFBertForQuestionAnswering, NPRFRobertaForQuestionAnswering),
    (AutoModelForMultipleChoice, NPRFBertForMultipleChoice, NPRFRobertaForMultipleChoice),
]:
    _auto.register(NPRFBertConfig, _bert, exist_ok=True)
    _auto.register(NPRFRobertaConfig, _roberta, exist_ok=True)
AutoModelForCausalLM.register(NPRFRobertaConfig, NPRFRobertaForCausalLM, exist_ok=True)


__all__ = [
    "functional",
    "convert_to_nprf",
    "convert_checkpoint",
    "attention_transfer",
    "read_transfer_texts",
    "TransferReport",
    "NPRFBertConfig",
    "NPRFRobertaConfig",
    "NPRFBertModel",
    "NPRFBertForMaskedLM",
    "NPRFBertForSequenceClassification",
    "NPRFBertForTokenClassification",
    "NPRFBertForQuestionAnswering",
    "NPRFBertForMultipleChoice",
    "NPRFBertPreTrainedModel",
    "NPRFRobertaModel",
    "NPRFRobertaForMaskedLM",
    "NPRFRobertaForSequenceClassification",
    "NPRFRobertaForTokenClassification",
    "NPRFRobertaForQuestionAnswering",
    "NPRFRobertaForMultipleChoice",
    "NPRFRobertaForCausalLM",
    "NPRFRobertaPreTrainedModel",
]
