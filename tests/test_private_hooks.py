"""The private transformers internals the package relies on (docs/DESIGN.md, "Private hooks"), each checked on its
own: a transformers release that renames or reshapes one fails here, by name, before the tests of what it serves
(generation, masks, captured outputs) fail further away from the cause."""

import inspect
from unittest import mock

import torch
import transformers

import nprf_hf
from nprf_hf.cache_nprf import CACHE_ARGUMENT, NPRFCache, NPRFGenerationMixin, find_nprf_cache
from nprf_hf.modeling_nprf import NPRFModelMixin


def tiny_decoder(head="model"):
    config = nprf_hf.NPRFRobertaConfig(
        vocab_size=99, hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=1, num_random_features=8, is_decoder=True,
    )
    cls = nprf_hf.NPRFRobertaModel if head == "model" else nprf_hf.NPRFRobertaForCausalLM
    return cls(config).eval()


def padded_batch():
    input_ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    return input_ids, attention_mask


def test_the_cache_argument_is_transformers_own_name():
    """`CACHE_ARGUMENT` (read from the mask builder's signature) is what the models' forward and generate's step
    inputs call the cache in the installed transformers: `past_key_values` up to 5.23, `cache` from 5.24 on."""
    assert CACHE_ARGUMENT in inspect.signature(transformers.RobertaModel.forward).parameters
    assert CACHE_ARGUMENT in inspect.signature(transformers.GenerationMixin.prepare_inputs_for_generation).parameters
    model = tiny_decoder("causal-lm")
    input_ids, attention_mask = padded_batch()
    cache = NPRFCache(model.config)
    inputs = model.prepare_inputs_for_generation(input_ids, attention_mask=attention_mask, **{CACHE_ARGUMENT: cache})
    assert inputs[CACHE_ARGUMENT] is cache and inputs["attention_mask"] is attention_mask


def test_create_attention_masks_is_the_family_models_mask_builder():
    """transformers' BERT-layout models build both masks in `_create_attention_masks`, which the NPRF base models
    override: a padded decoder batch reaches the layers as the key padding mask `_nprf_forward` made, without the
    L x L causal mask transformers would build (which the layers would have to treat as a general mask)."""
    assert "self._create_attention_masks(" in inspect.getsource(transformers.RobertaModel.forward)
    model = tiny_decoder()
    input_ids, attention_mask = padded_batch()
    seen = []
    hook = model.encoder.layer[0].attention.self.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    override = mock.patch.object(
        NPRFModelMixin, "_create_attention_masks", autospec=True, side_effect=NPRFModelMixin._create_attention_masks
    )
    causal = mock.patch.object(transformers.models.roberta.modeling_roberta, "create_causal_mask",
                               side_effect=AssertionError("transformers built the causal mask"))
    with override as spy, causal, torch.no_grad():
        model(input_ids, attention_mask=attention_mask, use_cache=False)
    hook.remove()
    assert spy.call_count == 1
    assert seen[0].dtype == torch.bool and seen[0].shape == (2, 1, 1, 7)


def test_prepare_cache_for_generation_makes_generate_use_an_nprf_cache():
    """generate() asks `_prepare_cache_for_generation` (generation_config, model_kwargs, generation_mode, batch_size,
    max_cache_length) for its cache; the NPRF override puts an NPRFCache under `CACHE_ARGUMENT` in model_kwargs."""
    parameters = list(inspect.signature(transformers.GenerationMixin._prepare_cache_for_generation).parameters)
    assert parameters[1:6] == ["generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"]
    model = tiny_decoder("causal-lm")
    input_ids, attention_mask = padded_batch()
    override = mock.patch.object(
        NPRFGenerationMixin, "_prepare_cache_for_generation", autospec=True,
        side_effect=NPRFGenerationMixin._prepare_cache_for_generation,
    )
    with override as spy:
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=1)
    assert spy.call_count == 1
    assert type(find_nprf_cache(out[CACHE_ARGUMENT])) is NPRFCache


def test_output_capture_registry_records_the_adopted_base_model():
    """transformers records per class which modules `output_attentions` captures, when the class is built; a head's
    base model is built as transformers' class and then adopted, so `adopt` records the NPRF class in
    `_CAN_RECORD_REGISTRY` (keyed by str(class)) for the NPRF self-attention to be captured. Where transformers has no
    registry (it then reads `_can_record_outputs` from the model) the captured attentions are what is checked."""
    model = tiny_decoder("causal-lm")
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        pass
    else:
        recorded = dict.get(_CAN_RECORD_REGISTRY, str(type(model.base_model))) or {}
        assert recorded.get("attentions") is nprf_hf.modeling_nprf.NPRFSelfAttention
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_attentions=True, use_cache=False)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 2, 7, 7)


def test_attn_implementation_requested_through_the_config_is_read():
    """AutoModel hands `attn_implementation` to the class inside the config, where it is kept as
    `_attn_implementation_internal`; the NPRF `from_pretrained` reads it there to warn that it changes nothing."""
    config = nprf_hf.NPRFRobertaConfig()
    config._attn_implementation = "sdpa"
    assert config._attn_implementation_internal == "sdpa"
