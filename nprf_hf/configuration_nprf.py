# coding=utf-8
"""Configurations of the NPRF (normalized positive random feature + relative positional encoding)
BERT and RoBERTa models (Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative
Positional Encoding", NeurIPS 2021).

Both configs are the HF ones plus the fields below (defaults and why):

- `num_random_features` (64): m, the number of random features per head. 64 equals the head size of
  BERT-base, so the feature map costs about what the head itself costs; since queries and keys are
  L2-normalized the kernel exp(q.k) lies in [1/e, e] and 64 features already estimate it with a small
  variance. Raise it for a closer approximation.
- `feature_map` ("orf"): "orf" draws blocks of orthogonal rows (lower variance, the usual choice),
  "prf" draws iid Gaussian rows.
- `feature_redraw_interval` (0): 0 keeps the projection fixed (it is saved with the weights, so a
  reloaded model gives identical outputs); N > 0 redraws it every N training forward passes (never
  in eval), deterministically from `projection_seed`, the layer index and the redraw count.
- `projection_seed` (0): seed of the deterministic draw of every layer's projection.
- `rpe_num_buckets` (32), `rpe_max_distance` (128): T5's relative position buckets (T5's defaults).
- `rpe_shared_across_layers` (True): one bias table for all layers, as in the paper.
- `attention_algorithm` ("auto"): "dense", "fft" or "banded" (exact and equal up to rounding, they
  differ in speed only); "auto" picks the fastest for the input length.
- `position_embedding_type` ("absolute"): "absolute" keeps the learned position table of the
  source checkpoint (inputs up to `max_position_embeddings`); "none" drops it, the model then
  knows positions only through the relative bias and takes inputs of any length.
- `logit_scale_max` (0.0 = off): with normalized q and k the content logits q.k lie in [-1, 1], so
  content alone can favour one key over another by at most e^2. A value > 1 gives every layer a
  learnable per-head scale s in (0, logit_scale_max) of those logits (kernel exp(s q.k)), starting at
  s = 1. Off by default: the default is the paper's NPRF, and the random-feature estimate's variance
  grows with s (benchmarks/approximation.py).
- `segment_bias` (False): a learned per-head bias beta (per layer, starting at 0) added to the
  relative bias of every query/key pair in different segments of a sentence pair (token_type_ids;
  RoBERTa, which has none, takes the segments from the separator tokens), so that attention can tell
  "same sentence" from "other sentence". Exact and linear-time: one Toeplitz product per segment
  (about 2x for pairs). Off by default: it has not yet earned its place (model_cards/GLUE_RESULTS.md).
- `token_match` (False, needs `segment_bias`): a learned per-head weight mu >= 0 (per layer,
  starting at 0) that adds phi(q).phi(k) * mu to the attention weight of a query and a key that are
  the same token in different segments: exact word matching across the two sentences of a pair,
  which NPRF's bounded logits cannot learn (benchmarks/pair_attention.py). Linear-time and exact.
- `output_attentions_max_length` (4096): `output_attentions=True` materializes the implied n x n
  attention matrix per head; beyond this length it raises instead of exhausting memory.
"""

from transformers import BertConfig, RobertaConfig

from .functional import ALGORITHMS as ATTENTION_ALGORITHMS
from .functional import FEATURE_MAPS


POSITION_EMBEDDING_TYPES = ("absolute", "none")

NPRF_BERT_AUTO_MAP = {
    "AutoConfig": "configuration_nprf.NPRFBertConfig",
    "AutoModel": "modeling_nprf.NPRFBertModel",
    "AutoModelForMaskedLM": "modeling_nprf.NPRFBertForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_nprf.NPRFBertForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_nprf.NPRFBertForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_nprf.NPRFBertForQuestionAnswering",
    "AutoModelForMultipleChoice": "modeling_nprf.NPRFBertForMultipleChoice",
}
NPRF_ROBERTA_AUTO_MAP = {
    "AutoConfig": "configuration_nprf.NPRFRobertaConfig",
    "AutoModel": "modeling_nprf.NPRFRobertaModel",
    "AutoModelForMaskedLM": "modeling_nprf.NPRFRobertaForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_nprf.NPRFRobertaForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_nprf.NPRFRobertaForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_nprf.NPRFRobertaForQuestionAnswering",
    "AutoModelForMultipleChoice": "modeling_nprf.NPRFRobertaForMultipleChoice",
    "AutoModelForCausalLM": "modeling_nprf.NPRFRobertaForCausalLM",
}


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def validate_nprf_fields(config):
    """Raise a ValueError naming the field and its allowed values for every invalid NPRF field."""
    if not _is_int(config.num_random_features) or config.num_random_features < 1:
        raise ValueError(f"num_random_features must be a positive integer, got {config.num_random_features!r}")
    if config.feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {config.feature_map!r}")
    if not _is_int(config.feature_redraw_interval) or config.feature_redraw_interval < 0:
        raise ValueError(
            "feature_redraw_interval must be an integer >= 0 (0 = fixed projection, N = redraw every N training "
            f"forward passes), got {config.feature_redraw_interval!r}"
        )
    if not _is_int(config.projection_seed) or config.projection_seed < 0:
        raise ValueError(f"projection_seed must be an integer >= 0, got {config.projection_seed!r}")
    if not _is_int(config.rpe_num_buckets) or config.rpe_num_buckets < 4:
        raise ValueError(f"rpe_num_buckets must be an integer >= 4, got {config.rpe_num_buckets!r}")
    if not _is_int(config.rpe_max_distance) or config.rpe_max_distance <= config.rpe_num_buckets // 2:
        raise ValueError(
            f"rpe_max_distance must be an integer > rpe_num_buckets // 2 = {config.rpe_num_buckets // 2}, "
            f"got {config.rpe_max_distance!r}"
        )
    if not isinstance(config.rpe_shared_across_layers, bool):
        raise ValueError(f"rpe_shared_across_layers must be True or False, got {config.rpe_shared_across_layers!r}")
    if config.attention_algorithm not in ATTENTION_ALGORITHMS:
        raise ValueError(
            f"attention_algorithm must be one of {ATTENTION_ALGORITHMS}, got {config.attention_algorithm!r}"
        )
    if config.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ValueError(
            f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES} ('none' = relative positions only, "
            f"any length), got {config.position_embedding_type!r}"
        )
    if (
        isinstance(config.logit_scale_max, bool)
        or not isinstance(config.logit_scale_max, (int, float))
        or not (config.logit_scale_max == 0 or config.logit_scale_max > 1)
    ):
        raise ValueError(
            "logit_scale_max must be 0 (off: the paper's NPRF) or a number > 1 (the bound of the learnable "
            f"per-head logit scale, which starts at 1), got {config.logit_scale_max!r}"
        )
    if not isinstance(config.segment_bias, bool):
        raise ValueError(f"segment_bias must be True or False, got {config.segment_bias!r}")
    if config.segment_bias and config.is_decoder:
        raise ValueError("segment_bias=True is for encoders reading sentence pairs; a decoder (is_decoder=True) has no segments")
    if not isinstance(config.token_match, bool):
        raise ValueError(f"token_match must be True or False, got {config.token_match!r}")
    if config.token_match and not config.segment_bias:
        raise ValueError("token_match=True matches tokens across segments: it needs segment_bias=True too")
    if not _is_int(config.output_attentions_max_length) or config.output_attentions_max_length < 1:
        raise ValueError(
            f"output_attentions_max_length must be a positive integer, got {config.output_attentions_max_length!r}"
        )
    if config.hidden_size % config.num_attention_heads != 0:
        raise ValueError(
            f"hidden_size ({config.hidden_size}) must be a multiple of num_attention_heads "
            f"({config.num_attention_heads})"
        )


class NPRFBertConfig(BertConfig):
    r"""[`BertConfig`] plus the NPRF attention fields (see the module docstring for each default and why).

    Example:

    ```python
    >>> from nprf_hf import NPRFBertConfig, NPRFBertModel
    >>> config = NPRFBertConfig(num_random_features=64, attention_algorithm="auto")
    >>> model = NPRFBertModel(config)
    ```"""

    model_type = "nprf_bert"

    num_random_features: int = 64
    feature_map: str = "orf"
    feature_redraw_interval: int = 0
    projection_seed: int = 0
    rpe_num_buckets: int = 32
    rpe_max_distance: int = 128
    rpe_shared_across_layers: bool = True
    attention_algorithm: str = "auto"
    position_embedding_type: str = "absolute"
    logit_scale_max: float = 0.0
    segment_bias: bool = False
    token_match: bool = False
    output_attentions_max_length: int = 4096

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        validate_nprf_fields(self)
        if getattr(self, "auto_map", None) is None:
            self.auto_map = dict(NPRF_BERT_AUTO_MAP)


class NPRFRobertaConfig(RobertaConfig):
    r"""[`RobertaConfig`] plus the NPRF attention fields (see the module docstring for each default and why).

    With `is_decoder=True` ([`NPRFRobertaForCausalLM`]) the self-attention is causal and the relative
    buckets are unidirectional (as in T5's decoder).
    """

    model_type = "nprf_roberta"

    num_random_features: int = 64
    feature_map: str = "orf"
    feature_redraw_interval: int = 0
    projection_seed: int = 0
    rpe_num_buckets: int = 32
    rpe_max_distance: int = 128
    rpe_shared_across_layers: bool = True
    attention_algorithm: str = "auto"
    position_embedding_type: str = "absolute"
    logit_scale_max: float = 0.0
    segment_bias: bool = False
    token_match: bool = False
    output_attentions_max_length: int = 4096

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        validate_nprf_fields(self)
        if getattr(self, "auto_map", None) is None:
            self.auto_map = dict(NPRF_ROBERTA_AUTO_MAP)


__all__ = ["NPRFBertConfig", "NPRFRobertaConfig"]
