# Copyright 2025 The nprf-hf authors. Licensed under the Apache License, Version 2.0.
"""The declared options of nprf-hf: the NPRF config fields (`NPRF_FIELDS`), the algorithm and feature-map
names, the RPE inits and the attention transfer's defaults. Imports nothing (no torch, no transformers), so
the `nprf-hf` command line builds its parser and answers `--help` without loading the models; the
configs, `functional`, `convert`, `transfer` and the CLI all read these declarations.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional


ALGORITHMS = ("auto", "dense", "fft", "banded")  # exact algorithms of `functional.nprf_attention` (+ auto), PyTorch
# the same product as fused kernels (`nprf_triton`): CUDA devices, or the CPU under Triton's interpreter
KERNEL_ALGORITHMS = ("triton",)
# attention_variant -> what the self-attention computes: the paper's NPRF and the arms of its ablations, as
# settings of the same model classes. The first three factor their kernel into features (every algorithm,
# linear cost, the NPRF cache); the last two are the exact kernels, computed densely (quadratic).
ATTENTION_VARIANTS = {
    "nprf": "the paper's NPRF: random features of L2-normalized q, k (kernel exp(s q_hat . k_hat))",
    "prf": "Performer's PRF: random features of q, k scaled by d^(-1/4), not normalized (kernel exp(q . k / sqrt(d)))",
    "elu_linear": "linear attention with phi(x) = elu(x) + 1 (Katharopoulos et al. 2020)",
    "nprf_near": "NPRF with an exact near field: the exact kernel exp(s q_hat . k_hat) for pairs closer than "
                 "near_field_width (default: the RPE band), NPRF's random features beyond; linear cost",
    "normalized_softmax": "the exact kernel NPRF estimates: softmax(s q_hat . k_hat + b), dense",
    "softmax": "standard attention: softmax(q . k / sqrt(d) + b), dense",
}
QUADRATIC_VARIANTS = ("normalized_softmax", "softmax")  # computed from the n x n weights
# the algorithms a quadratic variant takes: its n x n weights are dense
WEIGHTS_ALGORITHMS = ("auto", "dense")
# the exact kernel inside a band of pairs, NPRF's features beyond (`nprf_near_field`)
NEAR_FIELD_VARIANTS = ("nprf_near",)
# decoded with a key/value cache: the NPRF cache's running sums hold features only
KEY_VALUE_CACHE_VARIANTS = QUADRATIC_VARIANTS + NEAR_FIELD_VARIANTS
NORMALIZED_VARIANTS = ("nprf", "nprf_near", "normalized_softmax")  # q, k L2-normalized: the logit scale applies
PROJECTED_VARIANTS = ("nprf", "nprf_near", "prf")  # features exp(W x ...): what a learned feature map trains
FEATURE_MAPS = ("orf", "prf")
ATTENTION_ALGORITHMS = ALGORITHMS + KERNEL_ALGORITHMS
# attention_recompute -> `nprf_attention(recompute=...)`: auto (None) = the long-input algorithms only
RECOMPUTE_MODES = {"auto": None, "always": True, "never": False}
RPE_INITS = ("zeros", "calibrated")  # how conversion starts the RPE table
# `attention_transfer`'s defaults for what the CLI and the GLUE scripts expose
TRANSFER_DEFAULTS = {
    "steps": 500,
    "batch_size": 16,
    "max_length": 128,
    "learning_rate": 1e-3,
    "table_learning_rate": 2e-2,
    "projection_learning_rate": 0.0,
    "seed": 0,
}

# The config a conversion with attention transfer gets where its caller sets no attention_variant (issue 54,
# docs/RESULTS.md "Exact near field"): the RPE band's pairs exact, NPRF beyond, and a logit scale up to 30, which the
# exact kernel follows and the random-feature estimate could not. attention_variant="nprf" gives the paper's NPRF.
TRANSFER_RECIPE = {"attention_variant": "nprf_near", "logit_scale_max": 30.0}

# attention_transfer keyword -> (type, help): the one declaration of its options, `--attention-transfer-*` in the
# CLI and `--attention_transfer_*` in the GLUE scripts (which set max_length and seed from their own arguments)
TRANSFER_OPTIONS = {
    "steps": (int, "optimisation steps"),
    "batch_size": (int, "texts per step"),
    "max_length": (int, "tokens per text (longer ones are truncated)"),
    "learning_rate": (float, "Adam rate of the query/key projections"),
    "table_learning_rate": (float, "Adam rate of the RPE table(s) and logit scales"),
    "projection_learning_rate": (float, "Adam rate of the feature map's projection: > 0 learns the feature map "
                                 "(e.g. 1e-2), 0 keeps the random draw"),
    "seed": (int, "seed of the text order"),
}
# the GLUE scripts' own besides steps
GLUE_TRANSFER_OPTIONS = ("batch_size", "learning_rate", "table_learning_rate", "projection_learning_rate")

# `long_context_distillation`'s trainable sets and defaults (the CLI's --long-context-* options read them)
LONG_CONTEXT_TRAIN = ("attention", "encoder")
LONG_CONTEXT_DEFAULTS = {
    "steps": 150,
    "batch_size": 4,
    "document_length": 2048,
    "passage_length": 64,
    "passages_per_document": 2,
    "short_batch_size": 16,
    "window": None,
    "overlap": 0,
    "contrastive_weight": 0.1,
    "token_weight": 0.0,
    "temperature": 0.05,
    "negatives": 0,
    "learning_rate": 1e-4,
    "table_learning_rate": 5e-3,
    "train": "attention",
    "seed": 0,
}

# long_context_distillation keyword -> (type, help) of its `--long-context-*` option (defaults just above)
LONG_CONTEXT_OPTIONS = {
    "steps": (int, "optimisation steps"),
    "batch_size": (int, "documents per step (the other documents are a passage's negatives)"),
    "document_length": (int, "content tokens per training document (the model needs 2 positions more)"),
    "passage_length": (int, "tokens per passage cut out of a document"),
    "passages_per_document": (int, "passages per document and step"),
    "short_batch_size": (int, "short texts per step kept faithful to the source (0 = none)"),
    "window": (int, "the source's chunk-and-pool window, content tokens (default: all the source's positions)"),
    "overlap": (int, "tokens shared by consecutive windows"),
    "contrastive_weight": (float, "weight of the passage -> document contrastive term"),
    "token_weight": (float, "weight of the per-token term: each token's state vs the source's in its window"),
    "temperature": (float, "temperature of the contrastive term"),
    "negatives": (int, "memory of earlier documents, the contrastive term's extra negatives (0 = the batch's only)"),
    "learning_rate": (float, "Adam rate of the trained weights"),
    "table_learning_rate": (float, "Adam rate of the RPE table(s) and logit scales"),
    "train": (str, "what trains: attention (as attention transfer) or encoder (the whole layer stack)"),
    "seed": (int, "seed of the documents, passages and text order"),
}


POSITION_EMBEDDING_TYPES = ("absolute", "none")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class NPRFField:
    """One NPRF config field. `check(value)` -> bool and `rule` (the allowed values in words) give the
    error message; `choices` replaces both for enumerations. `convert_option`: `nprf-hf convert` sets it.
    `saved_with_weights`: the trained weights depend on it (a tensor's shape, its values, or what they mean),
    so it cannot change when a saved model is loaded. `encoder_only`: a decoder (is_decoder=True) refuses it on."""

    name: str
    type: type
    default: object
    help: str
    choices: Optional[tuple] = None
    check: Optional[Callable] = None
    rule: str = ""
    convert_option: bool = True
    saved_with_weights: bool = True
    encoder_only: bool = False

    def validate(self, value):
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(f"{self.name} must be one of {self.choices}, got {value!r}")
        elif self.type is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{self.name} must be True or False, got {value!r}")
        elif not self.check(value):
            raise ValueError(f"{self.name} must be {self.rule}, got {value!r}")


NPRF_FIELDS = (
    NPRFField(
        "attention_variant", str, "nprf",
        "what the attention computes (nprf = the paper; the rest are its ablations, see options.ATTENTION_VARIANTS); "
        "nprf_hf.set_attention_variant switches a trained model without touching its weights",
        choices=tuple(ATTENTION_VARIANTS), saved_with_weights=False,
    ),
    NPRFField(
        "relative_position_bias", bool, True,
        "the T5-bucketed relative position bias b (RPE); false = no table, b = 0 (absolute positions only)",
    ),
    NPRFField(
        "num_random_features", int, 64, "m, random features per head",
        check=lambda v: _is_int(v) and v >= 1, rule="a positive integer",
    ),
    NPRFField("feature_map", str, "orf", "orf: orthogonal random rows; prf: iid Gaussian rows", choices=FEATURE_MAPS),
    NPRFField(
        "feature_redraw_interval", int, 0, "0 = fixed projection; N = redraw it every N training forward passes",
        check=lambda v: _is_int(v) and v >= 0,
        rule="an integer >= 0 (0 = fixed projection, N = redraw every N training forward passes)",
        saved_with_weights=False,
    ),
    NPRFField(
        "projection_seed", int, 0, "seed of every layer's random projection",
        check=lambda v: _is_int(v) and v >= 0, rule="an integer >= 0",
    ),
    NPRFField(
        "rpe_num_buckets", int, 32, "T5 relative position buckets", check=lambda v: _is_int(v) and v >= 4,
        rule="an integer >= 4",
    ),
    NPRFField(
        "rpe_max_distance", int, 128, "distance beyond which T5 buckets are constant (> rpe_num_buckets // 2)",
        check=_is_int, rule="an integer",
    ),
    NPRFField("rpe_shared_across_layers", bool, True, "one RPE table for all layers (the paper) or one per layer"),
    NPRFField(
        "rpe_far_bias", float, 0.0,
        "0 = off; < 0: the bias of every distance beyond the RPE band (rpe_band_width: 91 for rpe_max_distance 128, "
        "305 for 512) fixed at this value instead of learned; -30 makes attention local to the band (long documents)",
        check=lambda v: _is_number(v) and math.isfinite(v) and v <= 0,
        rule="0 (off: learned like the other buckets) or a finite negative number (e.g. -30: attention local to the band)",
        saved_with_weights=False,
    ),
    NPRFField(
        "near_field_width", int, 0,
        "attention_variant nprf_near: pairs with |j - i| below this use the exact kernel; 0 = the RPE band "
        "(rpe_band_width: 91 for rpe_max_distance 128)",
        check=lambda v: _is_int(v) and v >= 0, rule="an integer >= 0 (0 = the RPE band)", saved_with_weights=False,
    ),
    NPRFField(
        "attention_algorithm", str, "auto", "exact algorithm of the Toeplitz product; auto picks by length",
        choices=ATTENTION_ALGORITHMS, saved_with_weights=False,
    ),
    NPRFField(
        "attention_recompute", str, "auto",
        "training: recompute the features and the Toeplitz product in backward instead of keeping them "
        "(less memory, one more attention forward); auto = for banded / fft once a layer's features take 16 MiB "
        "(long inputs), not for dense",
        choices=tuple(RECOMPUTE_MODES), saved_with_weights=False,
    ),
    NPRFField(
        "position_embedding_type", str, "absolute",
        "absolute: keep the source's position table; none: relative positions only, any length",
        choices=POSITION_EMBEDDING_TYPES,
    ),
    NPRFField(
        "logit_scale_max", float, 0.0,
        "0 = off; > 1: a learnable per-head scale (starting at 1, bounded by this) of the normalized content logits",
        check=lambda v: _is_number(v) and (v == 0 or v > 1),
        rule="0 (off: the paper's NPRF) or a number > 1 (the bound of the learnable per-head logit scale, which starts at 1)",
    ),
    NPRFField(
        "segment_bias", bool, False,
        "a learned per-head bias for query/key pairs in different segments of a sentence pair",
    ),
    NPRFField(
        "token_match", bool, False,
        "a learned per-head weight for the same token in the other segment (needs segment_bias)",
    ),
    NPRFField(
        "first_token_bias", bool, False,
        "a learned per-head bias on the first key ([CLS] / <s>), the softmax source's attention sink (encoders)",
        encoder_only=True,
    ),
    NPRFField(
        "output_attentions_max_length", int, 4096,
        "longest input for which output_attentions / a non-padding mask may build the dense n x n weights",
        check=lambda v: _is_int(v) and v >= 1, rule="a positive integer", convert_option=False,
        saved_with_weights=False,
    ),
)
