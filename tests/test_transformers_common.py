"""transformers' own common tests (`ModelTesterMixin`, `GenerationTesterMixin`) run against the NPRF classes.

The test classes are transformers' (tests/transformers_common/, copied from transformers' test tree with their
licence headers; where they came from is in tests/transformers_common/README.md); each NPRF test class here is
transformers' test class of the family with the NPRF config and classes in place of the plain ones, and the
per-family settings transformers' own test class makes (`prepare_config_and_inputs_for_generate` marking the
config a decoder, the pre-training labels). Only the common tests run: the per-model tests of transformers'
files (`test_model`, `test_for_masked_lm`, ...) call the plain classes by name.

Nothing is skipped here beyond what transformers' mixins skip themselves for the plain models. Where the NPRF classes
differ from the plain ones on purpose: transformers' padding-free tests, which read packed-sequence support from
`_supports_attention_backend`, run with that flag set for their duration (`_PackedSequences`: NPRF models pack, but
are no softmax attention backend); the flash- / flex-attention tests, which run for the plain models on a GPU with
those kernels, skip for the NPRF ones saying why (`explain_kernel_skips`). BERT's NPRF classes have no causal LM
head (transformers' `BertLMHeadModel`), so transformers' generation tests and `test_causal_lm_loss_honors_shift_labels`
(skipped: no decoder-only head) have nothing of BERT's to run on.
"""

import contextlib
import functools
import os
import re
import unittest
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("parameterized")  # transformers' test files use it (the dev extra installs it)

_COPIED = ("generation/test_utils.py", "exporters/test_export.py", "utils/test_configuration_utils.py",
           *(f"models/{m}/test_modeling_{m}.py" for m in ("roberta", "bert", "electra", "distilbert")))
_MISSING = [f for f in _COPIED if not os.path.exists(os.path.join(os.path.dirname(__file__), "transformers_common", f))]
if _MISSING:
    pytest.skip(f"transformers' test files {_MISSING} are not in tests/transformers_common (its README.md says where "
                "they come from)", allow_module_level=True)

# the marks transformers' test files use (its own conftest.py registers them)
_config = getattr(pytest.mark, "_config", None)
for _mark in ("generate", "torch_compile_test", "torch_export_test", "onnx_export_test", "executorch_export_test",
              "timeout", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "accelerate_tests", "slow"):
    if _config is not None:
        _config.addinivalue_line("markers", f"{_mark}: transformers' test mark")

import transformers  # noqa: E402
from transformers import MODEL_FOR_PRETRAINING_MAPPING  # noqa: E402
from transformers.models.auto import get_values  # noqa: E402
from transformers.testing_utils import torch_device  # noqa: E402

import nprf_hf  # noqa: E402
from nprf_hf.cache_nprf import find_nprf_cache  # noqa: E402
from transformers_common.generation.test_utils import GenerationTesterMixin  # noqa: E402
from transformers_common.models.bert.test_modeling_bert import BertModelTester  # noqa: E402
from transformers_common.models.distilbert.test_modeling_distilbert import DistilBertModelTester  # noqa: E402
from transformers_common.models.electra.test_modeling_electra import ElectraModelTester  # noqa: E402
from transformers_common.models.roberta.test_modeling_roberta import RobertaModelTester  # noqa: E402
from transformers_common.test_modeling_common import ModelTesterMixin  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def nprf_auto_mapping_names():
    """transformers' tests pick the inputs and labels of a class by its name in the Auto classes' name tables
    (`MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES`, ...), where every transformers model is listed; the NPRF classes are
    registered with the Auto classes (`_extra_content`), which those tables do not show: listed there for these
    tests, under their model types (absent from CONFIG_MAPPING_NAMES, so no Auto lookup goes through them)."""
    from nprf_hf.configuration_nprf import NPRF_CONFIG_CLASSES
    from nprf_hf.families import HEADS
    from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES

    added = []
    for family, config_class in NPRF_CONFIG_CLASSES.items():
        for head, model_class in NPRF_MODEL_CLASSES[family].items():
            if head is not None:
                names = getattr(transformers, HEADS[head].auto_class)._model_mapping._model_mapping
                names[config_class.model_type] = model_class.__name__
                added.append((names, config_class.model_type))
    yield
    for names, model_type in added:
        names.pop(model_type, None)


# By default (the whole set takes ~3.5 min per family on 2 CPU cores) only these run, for RoBERTa's classes: the
# generation tests of issue 47 (the static cache, compiled generation) and a few of the model tests; every test of
# every family with NPRF_RUN_SLOW=1 (the suite's opt-in for slow tests).
DEFAULT = {
    "NPRFRobertaModelTest": {
        "test_generate_with_static_cache", "test_generate_from_inputs_embeds_with_static_cache",
        "test_generate_compile_model_forward_fullgraph", "test_generate_compilation_all_outputs",
        "test_static_cache_no_recompile_with_smaller_length", "test_past_key_values_format",
        "test_greedy_generate_dict_outputs_use_cache", "test_beam_search_generate_dict_outputs_use_cache",
        "test_generate_continue_from_past_key_values", "test_left_padding_compatibility", "test_save_load",
        "test_attention_outputs", "test_training", "test_eager_padding_matches_padding_free_with_position_ids",
    },
}


@pytest.fixture(autouse=True)
def slow_unless_default(request):
    if os.environ.get("NPRF_RUN_SLOW") or request.cls is None:  # (a test function of this file's own)
        return
    if request.node.originalname not in DEFAULT.get(request.cls.__name__, ()):
        pytest.skip("one of transformers' common tests outside the default set: set NPRF_RUN_SLOW=1 to run it")


def nprf_tester(tester_class, config_class):
    """`tester_class` (transformers' model tester of a family) whose configs are `config_class` (the NPRF config
    of that family, with the same fields)."""

    class NPRFTester(tester_class):
        def get_config(self):
            return config_class(**super().get_config().to_diff_dict())

    NPRFTester.__name__ = f"NPRF{tester_class.__name__}"
    return NPRFTester


class _DecoderGenerate:
    """transformers' override in RobertaModelTest, BertModelTest, ElectraModelTest: generate() with a decoder."""

    def prepare_config_and_inputs_for_generate(self, batch_size=2):
        config, inputs = super().prepare_config_and_inputs_for_generate(batch_size)
        config.is_decoder = True
        return config, inputs


class _NPRFCacheFormat:
    """transformers' `_check_past_key_values_for_generate` checks every layer's `keys` / `values`, [B, H, length, d];
    for a cache with other layers it asks the model's test class to override it ("The cache is not standard!
    Please overwrite `_check_past_key_values_for_generate`"), as transformers' tests of the recurrent models do.
    An NPRF cache keeps per layer the far sums and the last W - 1 keys' features and values, whose shapes do not
    depend on the length: checked here with the length the cache has seen, and transformers' own check of the keys
    where the cache keeps them (NPRFStaticCache with output_attentions=True)."""

    def _check_past_key_values_for_generate(self, batch_size, past_key_values, seq_length, config):
        cache = find_nprf_cache(past_key_values)
        if cache is None or cache.layers[0].keys is not None:
            return super()._check_past_key_values_for_generate(batch_size, past_key_values, seq_length, config)
        config = config.get_text_config(decoder=True)
        heads, head_size = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.assertEqual(len(cache), config.num_hidden_layers)
        for layer in cache.layers:
            self.assertEqual(int(layer.get_seq_length()), seq_length)
            self.assertEqual(tuple(layer.far_states.shape), (batch_size, heads, config.num_random_features, head_size + 1))
            self.assertEqual(layer.ring_features.shape[:2], (batch_size, heads))
            self.assertEqual(layer.ring_values.shape[:2], (batch_size, heads))
            self.assertEqual(tuple(layer.real_tokens.shape), (batch_size,))


class _PackedSequences:
    """transformers' padding-free tests (`test_eager_padding_matches_padding_free_with_position_ids`, its sdpa twin)
    skip a model whose `_supports_attention_backend` is False, taking that flag as its sign of packed-sequence support
    ("can't infer if new attn mask API is supported by assume that only model with attention backend support it").
    The flag claims more: that the model takes its attention from transformers' table of attention functions (where
    vLLM / TGI put their softmax kernels), which the NPRF self-attention does not (it is not softmax attention), so
    it stays False on the NPRF classes. Packed sequences NPRF models do support (each sequence attended alone, from
    the position ids: tests/test_packed_sequences.py), so here transformers' own test runs with the flag set on the
    generative classes for its duration."""

    def attention_mask_padding_matches_padding_free_with_position_ids(self, attn_implementation, fa_kwargs=False):
        with contextlib.ExitStack() as stack:
            for model_class in self.all_generative_model_classes:
                stack.enter_context(mock.patch.object(model_class, "_supports_attention_backend", True))
            return super().attention_mask_padding_matches_padding_free_with_position_ids(attn_implementation, fa_kwargs)


# transformers' tests of flash- and flex-attention kernels (GPU only: here they skip on their requirements, for the
# plain models too); with a GPU, where they run for the plain models, they skip for the NPRF ones on the classes'
# `_supports_flash_attn` / `_supports_flex_attn` (False), with this reason added to transformers' words
SOFTMAX_KERNELS = (
    "NPRF self-attention is not softmax attention: flash- and flex-attention kernels compute softmax attention and "
    "cannot run it, so the NPRF classes set _supports_flash_attn = _supports_flex_attn = False"
)
_KERNEL_TEST = re.compile(r"^test_.*(flash_attn|flash_attention|flex_attention|_fa[234]_|_on_flash$)")


def _explained(method):
    @functools.wraps(method)
    def test(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except unittest.SkipTest as skip:
            if "support" in str(skip):  # transformers' "... does not support flash_attention_2" and the like
                raise unittest.SkipTest(f"{skip} ({SOFTMAX_KERNELS})") from None
            raise

    return test


def explain_kernel_skips(cls):
    """`cls` with transformers' kernel tests wrapped: a skip for want of kernel support says why."""
    for name in dir(cls):
        if _KERNEL_TEST.match(name) and callable(getattr(cls, name)):
            setattr(cls, name, _explained(getattr(cls, name)))
    return cls


class _PreTrainingLabels:
    """transformers' `_prepare_for_class` of BertModelTest / ElectraModelTest: labels for the pre-training head."""

    next_sentence_label = False

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class in get_values(MODEL_FOR_PRETRAINING_MAPPING):
            size = (self.model_tester.batch_size, self.model_tester.seq_length)
            inputs_dict["labels"] = torch.zeros(size, dtype=torch.long, device=torch_device)
            if self.next_sentence_label:
                inputs_dict["next_sentence_label"] = torch.zeros(
                    self.model_tester.batch_size, dtype=torch.long, device=torch_device
                )
        return inputs_dict


def _classes(model_type, first="Model"):
    """The family's NPRF classes as the package declares them (`NPRF_MODEL_CLASSES`: a new head is tested at once),
    the one whose name ends in `first` first, as transformers' own test class for the family has it."""
    from nprf_hf.modeling_nprf import NPRF_MODEL_CLASSES

    classes = [cls for cls in NPRF_MODEL_CLASSES[model_type].values() if not cls.__name__.endswith("PreTrainedModel")]
    return tuple(sorted(classes, key=lambda cls: not cls.__name__.endswith(first)))


@explain_kernel_skips
class NPRFRobertaModelTest(_DecoderGenerate, _PackedSequences, _NPRFCacheFormat, ModelTesterMixin,
                           GenerationTesterMixin, unittest.TestCase):
    all_model_classes = _classes("roberta", first="ForCausalLM")
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = nprf_tester(RobertaModelTester, nprf_hf.NPRFRobertaConfig)(self)


@explain_kernel_skips
class NPRFXLMRobertaModelTest(_DecoderGenerate, _PackedSequences, _NPRFCacheFormat, ModelTesterMixin,
                              GenerationTesterMixin, unittest.TestCase):
    """transformers has no common-test class for XLM-RoBERTa (its classes are RoBERTa's): RoBERTa's tester."""

    all_model_classes = _classes("xlm-roberta", first="ForCausalLM")
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = nprf_tester(RobertaModelTester, nprf_hf.NPRFXLMRobertaConfig)(self)


@explain_kernel_skips
class NPRFBertModelTest(_DecoderGenerate, _PackedSequences, _NPRFCacheFormat, _PreTrainingLabels, ModelTesterMixin,
                         GenerationTesterMixin, unittest.TestCase):

    all_model_classes = _classes("bert")
    model_split_percents = [0.5, 0.8, 0.9]
    next_sentence_label = True

    def setUp(self):
        self.model_tester = nprf_tester(BertModelTester, nprf_hf.NPRFBertConfig)(self)


@explain_kernel_skips
class NPRFElectraModelTest(_DecoderGenerate, _PackedSequences, _NPRFCacheFormat, _PreTrainingLabels, ModelTesterMixin,
                           GenerationTesterMixin, unittest.TestCase):
    all_model_classes = _classes("electra")

    def setUp(self):
        self.model_tester = nprf_tester(ElectraModelTester, nprf_hf.NPRFElectraConfig)(self)


@explain_kernel_skips
class NPRFDistilBertModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = _classes("distilbert")
    test_resize_embeddings = True
    test_resize_position_embeddings = True

    def setUp(self):
        self.model_tester = nprf_tester(DistilBertModelTester, nprf_hf.NPRFDistilBertConfig)(self)


def test_kernel_skips_say_why():
    """On a GPU with flash-attn, transformers skips its kernel tests for the NPRF classes ("... does not support
    flash_attention_2"): the reason then says why (here, without one, they skip on their requirements)."""
    def unsupported(self):
        raise unittest.SkipTest("NPRFRobertaForCausalLM does not support flash_attention_2")

    with pytest.raises(unittest.SkipTest, match="does not support flash_attention_2 .NPRF self-attention is not soft"):
        _explained(unsupported)(None)
    names = [name for name in dir(NPRFRobertaModelTest) if _KERNEL_TEST.match(name)]
    assert "test_flex_attention_with_grads" in names and "test_flash_attn_2_inference_equivalence" in names
    assert all(hasattr(getattr(NPRFRobertaModelTest, name), "__wrapped__") for name in names)
