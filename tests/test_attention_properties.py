"""Property tests (hypothesis) of NPRF attention, random shapes and masks (issue 6):

- every exact algorithm (dense, fft, banded, auto; band width given or inferred) equals a float64 reference;
- padding invariance: a padded sequence's real positions equal the sequence alone;
- batch independence: a sequence's output does not depend on its batch mates;
both for nprf_hf.functional.nprf_attention and through tiny models (BERT encoder, RoBERTa decoder).
Everything is float64, with the tolerances derived from each drawn input (`tolerances`): hypothesis draws new
cases every run, so a tolerance fitted to the cases seen so far would fail on the next ill-conditioned one.
BANDED_MIN_CHUNK is lowered to 4 for this module so that the chunked banded algorithm runs at these small lengths.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.t5.modeling_t5 import T5Attention

from nprf_hf import NPRFBertConfig, NPRFBertModel, NPRFRobertaConfig, NPRFRobertaForCausalLM
from nprf_hf import functional as Fn
from nprf_hf import nprf_banded

from conftest import tiny_nprf_config
from tolerances import assert_within, attention_checked_against, attention_rounding, model_rounding


SETTINGS = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
EXACT = ("dense", "fft", "banded")
BUCKETS = [(4, 8), (8, 20), (16, 32)]  # (num_buckets, max_distance): band widths 1..27


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nprf_banded, "BANDED_MIN_CHUNK", 4)
        yield


def model_close(model, actual, expected):
    """Two float64 runs of a tiny model that differ only in rounding (shapes, padding: the same direct attention),
    within `tolerances.model_rounding` of the outputs' size."""
    bound = model_rounding(model, expected.shape[1], expected.shape[0]) * expected.abs().max()
    assert_within(actual, expected, bound, "model output")


# ---------------------------------------------------------------------------------------------
# The functional API
# ---------------------------------------------------------------------------------------------


@st.composite
def attention_cases(draw):
    batch, n = draw(st.integers(1, 3)), draw(st.integers(1, 48))
    return {
        "batch": batch,
        "heads": draw(st.integers(1, 2)),
        "n": n,
        "d": draw(st.sampled_from([2, 4, 8])),
        "m": draw(st.integers(1, 12)),
        "buckets": draw(st.sampled_from(BUCKETS)),
        "bias_scale": draw(st.sampled_from([0.1, 1.0, 3.0])),
        "causal": draw(st.booleans()),
        "per_head": draw(st.booleans()),
        "lengths": draw(st.lists(st.integers(0, n), min_size=batch, max_size=batch)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def build(case):
    """(query, key, value, bias table, projection, key padding mask [B, n] bool) from a case."""
    generator = torch.Generator().manual_seed(case["seed"])
    batch, heads, n, d = case["batch"], case["heads"], case["n"], case["d"]
    q, k, v = torch.randn(3, batch, heads, n, d, generator=generator, dtype=torch.float64).unbind(0)
    table = torch.randn(heads, case["buckets"][0], generator=generator, dtype=torch.float64) * case["bias_scale"]
    projection = Fn.draw_projection(
        case["m"], d, num_heads=heads if case["per_head"] else None, generator=generator, dtype=torch.float64
    )
    mask = torch.arange(n)[None, :] < torch.tensor(case["lengths"])[:, None]
    return q, k, v, table, projection, mask


def bias_for(case, table, n):
    num_buckets, max_distance = case["buckets"]
    return Fn.relative_position_bias(table, n, not case["causal"], num_buckets, max_distance)


def band_width(case):
    return Fn.rpe_band_width(*case["buckets"], bidirectional=not case["causal"])


def reference(case, q, k, v, table, projection, mask):
    """Float64 n x n formula of the paper, buckets from HF's T5Attention; rows with no key are zero."""
    n = q.shape[-2]
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    if projection.dim() == 2:
        projection = projection.expand(q.shape[1], *projection.shape)
    m = projection.shape[1]
    phi_q = torch.exp(torch.einsum("bhnd,hmd->bhnm", q, projection) - 0.5) / math.sqrt(m)
    phi_k = torch.exp(torch.einsum("bhnd,hmd->bhnm", k, projection) - 0.5) / math.sqrt(m)
    relative = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    buckets = T5Attention._relative_position_bucket(relative, not case["causal"], *case["buckets"])
    weights = phi_q @ phi_k.transpose(-1, -2) * torch.exp(table[:, buckets]) * mask[:, None, None, :]
    if case["causal"]:
        weights = weights * (relative <= 0)
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, weights @ v / torch.where(total > 0, total, 1.0), 0.0)


@SETTINGS
@given(case=attention_cases())
def test_every_exact_algorithm_equals_the_float64_reference(case):
    q, k, v, table, projection, mask = build(case)
    bias = bias_for(case, table, case["n"])
    expected = reference(case, q, k, v, table, projection, mask)
    for algorithm in (*EXACT, "auto"):
        rounding = attention_rounding(q, k, v, bias, projection, expected, mask, case["causal"], algorithm)
        for width in (None, band_width(case)):
            out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm, case["causal"], width)
            rounding.assert_values(out, expected, algorithm)
    assert (expected[torch.tensor(case["lengths"]) == 0] == 0).all()  # sequences with no token at all


@SETTINGS
@given(case=attention_cases(), algorithm=st.sampled_from(EXACT))
def test_padding_invariance_and_batch_independence(case, algorithm):
    q, k, v, table, projection, mask = build(case)
    causal, width = case["causal"], band_width(case)
    bias = bias_for(case, table, case["n"])
    out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm, causal, width)
    for b, length in enumerate(case["lengths"]):
        # two runs of the same algorithm: its rounding twice, bounded for the padded row (the unpadded run's sums
        # and FFT are shorter, its features the same: its bounds are no larger)
        row = slice(b, b + 1)
        rounding = attention_rounding(q[row], k[row], v[row], bias, projection, out[row], mask[row], causal, algorithm,
                                      other=algorithm)
        # batch independence: the same row alone, padding included
        alone = Fn.nprf_attention(q[row], k[row], v[row], bias, projection, mask[row], algorithm, causal, width)
        rounding.assert_values(out[row], alone, "alone")
        if length == 0:
            continue
        # padding invariance: the real tokens alone, without padding and without a mask
        unpadded = Fn.nprf_attention(
            q[row, :, :length], k[row, :, :length], v[row, :, :length],
            bias_for(case, table, length), projection, None, algorithm, causal, width,
        )
        assert_within(out[row, :, :length], unpadded, rounding.values[:, :, :length], "unpadded")


# ---------------------------------------------------------------------------------------------
# Through tiny models
# ---------------------------------------------------------------------------------------------


# smaller still: 6 buckets up to distance 12 give a band width of 4 (encoder) / 8 (decoder), so banded chunks
# from n = 13 / 22 on
TINY = tiny_nprf_config(hidden_size=16, intermediate_size=24, num_random_features=8, rpe_num_buckets=6,
                        rpe_max_distance=12)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    encoder = NPRFBertModel(NPRFBertConfig(**TINY), add_pooling_layer=False)
    decoder = NPRFRobertaForCausalLM(NPRFRobertaConfig(**TINY, pad_token_id=1, is_decoder=True))
    built = {}
    for name, model in (("bert", encoder), ("roberta-decoder", decoder)):
        model = model.double().eval()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("rpe_table"):
                    param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64))
        built[name] = model
    return built


def main_output(model, **inputs):
    output = model(**inputs)
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


@st.composite
def model_cases(draw):
    batch, n = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    return {
        "family": draw(st.sampled_from(["bert", "roberta-decoder"])),
        "batch": batch,
        "n": n,
        "lengths": draw(st.lists(st.integers(1, n), min_size=batch, max_size=batch)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@SETTINGS
@given(case=model_cases())
def test_model_algorithms_agree_padding_invariance_and_batch_independence(models, case):
    model = models[case["family"]]
    pad = model.config.pad_token_id or 0
    generator = torch.Generator().manual_seed(case["seed"])
    input_ids = torch.randint(3, TINY["vocab_size"], (case["batch"], case["n"]), generator=generator)
    mask = torch.arange(case["n"])[None, :] < torch.tensor(case["lengths"])[:, None]
    input_ids = input_ids.masked_fill(~mask, pad)
    outputs = {}
    try:
        # every layer's fft / banded attention within its derived bounds of the dense one on the same inputs
        # (`attention_checked_against`), the model going on with the dense output: the rest of the model must then
        # compute what the dense-configured model does, to the bit
        with attention_checked_against("dense"):
            for algorithm in EXACT:
                model.config.attention_algorithm = algorithm
                outputs[algorithm] = main_output(model, input_ids=input_ids, attention_mask=mask.long())
    finally:
        model.config.attention_algorithm = "auto"
    real = mask[:, :, None].expand_as(outputs["dense"])
    for algorithm in ("fft", "banded"):
        torch.testing.assert_close(outputs[algorithm][real], outputs["dense"][real], rtol=0, atol=0)
    for b, length in enumerate(case["lengths"]):  # each sequence alone, unpadded, no mask ("auto")
        alone = main_output(model, input_ids=input_ids[b : b + 1, :length])
        model_close(model, outputs["dense"][b : b + 1, :length], alone)
