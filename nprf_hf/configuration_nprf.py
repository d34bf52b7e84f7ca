# coding=utf-8
"""Configurations of the NPRF (normalized positive random feature + relative positional encoding)
models, one per family of `families.FAMILIES` (Luo et al., "Stable, Fast and Accurate: Kernelized
Attention with Relative Positional Encoding", NeurIPS 2021).

Every family's NPRF config is the HF config plus the fields of `NPRF_FIELDS` (name, type, default,
allowed values, help: declared once; the CLI options, the model card and the validation derive from it).
Why each default:

- `attention_variant`: "nprf", the paper's attention. The other values are the arms of its ablations in the
  same classes ("prf": Performer's unnormalized features, "elu_linear", and the exact kernels
  "normalized_softmax" and "softmax", quadratic), so a from-scratch study or the switch of a trained model
  (`set_attention_variant`) is one setting. "nprf_near" (beyond the paper) keeps NPRF for far pairs and computes
  the exact kernel within `near_field_width` (linear cost).
- `relative_position_bias`: on, as in the paper (RPE is what keeps NPRF attention sharp); off = b = 0 and no
  table, the "without RPE" arm.
- `num_random_features`: m, the number of random features per head. 64 equals the head size of
  BERT-base, so the feature map costs about what the head itself costs; since queries and keys are
  L2-normalized the kernel exp(q.k) lies in [1/e, e] and 64 features already estimate it with a small
  variance. Raise it for a closer approximation.
- `feature_map`: "orf" draws blocks of orthogonal rows (lower variance, the usual choice),
  "prf" draws iid Gaussian rows.
- `feature_redraw_interval`: 0 keeps the projection fixed (it is saved with the weights, so a
  reloaded model gives identical outputs); N > 0 redraws it every N training forward passes (never
  in eval), deterministically from `projection_seed`, the layer index and the redraw count.
- `projection_seed`: seed of the deterministic draw of every layer's projection.
- `rpe_num_buckets`: T5's relative position buckets (T5's default, 32).
- `rpe_max_distance`: the distance from which the buckets, and so the bias, are constant (T5's 128); it sets
  the band of the banded algorithm and of the decoding cache.
- `rpe_shared_across_layers`: one bias table for all layers, as in the paper.
- `rpe_far_bias`: 0 (off) or a fixed value for b_r beyond the band (T5's last bucket each way, |r| >=
  `rpe_band_width`) instead of the learned one. A source that attended within 512 positions has never seen
  thousands of far keys; their summed weight swamps the near ones in a whole long document. -30 zeroes them
  (attention local to the band, still one exact linear-time pass, and texts shorter than the band unchanged).
  Not saved with the weights: `from_pretrained(path, rpe_far_bias=-30)` sets it on any NPRF model.
- `near_field_width`: with attention_variant "nprf_near", the pairs with |j - i| below it weigh the exact kernel
  exp(s q.k) instead of its random-feature estimate; 0 (the default) means the RPE band (`rpe_band_width`, 91 for
  T5's defaults): the distances the bias tells apart, where softmax sources put most of their attention. Not saved
  with the weights: a wider or narrower field is one setting, though a transferred model fits its own.
- `attention_algorithm`: "dense", "fft" or "banded" (exact and equal up to rounding, they
  differ in speed only); "auto" picks the fastest for the input length.
- `attention_recompute`: "auto" recomputes the banded / fft attention's features in backward (and for fft the
  Toeplitz product; banded keeps its output instead) once a layer's features take 16 MiB (long inputs, where
  they are most of the activations), and keeps them for short inputs, where recomputing costs time for little memory.
- `position_embedding_type`: "absolute" keeps the learned position table of the
  source checkpoint (inputs up to `max_position_embeddings`); "none" drops it, the model then
  knows positions only through the relative bias and takes inputs of any length.
- `logit_scale_max`: with normalized q and k the content logits q.k lie in [-1, 1], so
  content alone can favour one key over another by at most e^2. A value > 1 gives every layer a
  learnable per-head scale s in (0, logit_scale_max) of those logits (kernel exp(s q.k)), starting at
  s = 1. Off by default: the default is the paper's NPRF, and the random-feature estimate's variance
  grows with s (benchmarks/approximation.py).
- `segment_bias`: a learned per-head bias beta (per layer, starting at 0) added to the
  relative bias of every query/key pair in different segments of a sentence pair (token_type_ids;
  RoBERTa, which has none, takes the segments from the separator tokens), so that attention can tell
  "same sentence" from "other sentence". Exact and linear-time: one Toeplitz product per segment
  (about 2x for pairs). Off by default: it has not yet earned its place (model_cards/GLUE_RESULTS.md).
- `token_match`: a learned per-head weight mu >= 0 (per layer,
  starting at 0) that adds phi(q).phi(k) * mu to the attention weight of a query and a key that are
  the same token in different segments: exact word matching across the two sentences of a pair,
  which NPRF's bounded logits cannot learn (benchmarks/pair_attention.py). Linear-time and exact.
- `first_token_bias`: a learned per-head bias gamma (per layer, starting at 0) added to the logit of the first
  key ([CLS] / <s>). Softmax encoders park much of their attention there (an attention sink); NPRF's normalized
  logits cannot single one key out that much. A factor of that key alone, so free in every algorithm. Off by
  default: it did not raise the attention transfer's fidelity (docs/RESULTS.md). Encoders only (a decoder's
  recurrent state keeps no per-key factor).
- `output_attentions_max_length`: `output_attentions=True` materializes the implied n x n
  attention matrix per head; beyond this length it raises instead of exhausting memory.
"""

import transformers

from .families import FAMILIES, HEADS, family_of
from .hub import check_load_source
from .options import NORMALIZED_VARIANTS, NPRF_FIELDS, QUADRATIC_VARIANTS, WEIGHTS_ALGORITHMS


NPRF_FIELD_NAMES = tuple(field.name for field in NPRF_FIELDS)


def validate_nprf_fields(config):
    """Raise a ValueError naming the field and its allowed values for every invalid NPRF field."""
    for field in NPRF_FIELDS:
        field.validate(getattr(config, field.name))
    if config.rpe_max_distance <= config.rpe_num_buckets // 2:
        raise ValueError(
            f"rpe_max_distance must be an integer > rpe_num_buckets // 2 = {config.rpe_num_buckets // 2}, "
            f"got {config.rpe_max_distance!r}"
        )
    family = family_of(config.model_type)
    for field in NPRF_FIELDS:
        if field.encoder_only and getattr(config, field.name) and getattr(config, "is_decoder", False):
            raise ValueError(f"{field.name} is for encoders; a decoder (is_decoder=True) cannot use it: leave it off")
    if config.segment_bias and getattr(config, "is_decoder", False):
        raise ValueError("segment_bias=True is for encoders reading sentence pairs; a decoder (is_decoder=True) has no segments")
    if config.segment_bias and family.segments is None:
        raise ValueError(
            f"segment_bias=True needs the segments of a sentence pair, which {family.display_name} inputs do not mark "
            "(no token_type_ids, no separator rule): leave segment_bias off"
        )
    if config.token_match and not config.segment_bias:
        raise ValueError("token_match=True matches tokens across segments: it needs segment_bias=True too")
    if config.logit_scale_max and config.attention_variant not in NORMALIZED_VARIANTS:
        raise ValueError(
            f"logit_scale_max scales normalized logits: it applies to attention_variant in {NORMALIZED_VARIANTS}, "
            f"not {config.attention_variant!r} (set logit_scale_max=0)"
        )
    if config.attention_variant in QUADRATIC_VARIANTS and config.attention_algorithm not in WEIGHTS_ALGORITHMS:
        raise ValueError(
            f"attention_variant={config.attention_variant!r} is computed from the dense n x n weights: "
            f"attention_algorithm must be 'auto' or 'dense', not {config.attention_algorithm!r}"
        )


def nprf_auto_map(family):
    """The config's `auto_map` (remote code): the config class and one model class per head of the family."""
    auto_map = {"AutoConfig": f"configuration_nprf.{family.nprf_prefix}Config"}
    auto_map.update({HEADS[h].auto_class: f"modeling_nprf.{family.class_name(h)}" for h in family.heads})
    return auto_map


def _nprf_config_class(family):
    """`NPRF<Family>Config`: the family's HF config plus the NPRF fields (a dataclass field each)."""
    hf_config = getattr(transformers, family.prefix + "Config")

    def __post_init__(self, **kwargs):
        hf_config.__post_init__(self, **kwargs)
        validate_nprf_fields(self)
        if getattr(self, "auto_map", None) is None:
            self.auto_map = nprf_auto_map(family)

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # transformers answers a source that is nowhere with a network error (after half a minute of retries
        # without a network); every NPRF model's from_pretrained reads its config through here
        check_load_source(pretrained_model_name_or_path, **kwargs)
        return hf_config.from_pretrained.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)

    from_pretrained.__doc__ = (
        f"As [`{hf_config.__name__}.from_pretrained`]; a source that is neither a local path nor a model on the Hub "
        "or in its cache raises `hub.SourceNotFoundError` at once, in one line."
    )
    name = family.nprf_prefix + "Config"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"[`{hf_config.__name__}`] plus the NPRF attention fields (`NPRF_FIELDS`; the module docstring says why).",
        "__annotations__": {field.name: field.type for field in NPRF_FIELDS},
        "model_type": family.nprf_model_type,
        "__post_init__": __post_init__,
        "from_pretrained": classmethod(from_pretrained),
        **{field.name: field.default for field in NPRF_FIELDS},
    }
    return type(name, (hf_config,), namespace)


# NPRFBertConfig, NPRFRobertaConfig, ...: one per family
NPRF_CONFIG_CLASSES = {model_type: _nprf_config_class(family) for model_type, family in FAMILIES.items()}
globals().update({cls.__name__: cls for cls in NPRF_CONFIG_CLASSES.values()})

__all__ = [cls.__name__ for cls in NPRF_CONFIG_CLASSES.values()]
