"""Bad and extreme inputs (issue 6): clear errors naming the problem, never NaN, nothing silently wrong.

References are float64 and written here from the paper's formula (T5 buckets from HF's T5Attention)."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Attention

from nprf_hf import NPRFBertConfig, NPRFBertModel, NPRFRobertaConfig, NPRFRobertaForCausalLM, NPRFRobertaModel
from nprf_hf import cli, convert_to_nprf
from nprf_hf import functional as Fn
from nprf_hf import nprf_banded
from nprf_hf.modeling_nprf import NPRFSelfAttention

from conftest import tiny_nprf_config
from tolerances import assert_within, attention_rounding, unit_roundoff


TINY = tiny_nprf_config(rpe_max_distance=20)
H, D = 2, 16


def bert(**overrides):
    return NPRFBertModel(NPRFBertConfig(**{**TINY, **overrides}), add_pooling_layer=False).eval()


def roberta(**overrides):
    return NPRFRobertaModel(NPRFRobertaConfig(**{**TINY, "pad_token_id": 1, **overrides}), add_pooling_layer=False).eval()


def randomize_rpe(model, std=0.5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("rpe_table"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


def ids(batch, length, seed=0):
    return torch.randint(3, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_self_attention(attention, hidden, table, keep, causal=False):
    """Float64 NPRF self-attention of `attention` (an NPRFSelfAttention) on hidden [B, L, hidden] with a
    boolean mask `keep` [B, 1 or H, L, L] (True = attend): rows renormalized over the allowed keys,
    rows with no allowed key are zero."""
    batch, length, _ = hidden.shape
    weights = {name: (getattr(attention, name).weight.double(), getattr(attention, name).bias.double()) for name in ("query", "key", "value")}

    def heads(name):
        w, b = weights[name]
        return (hidden.double() @ w.t() + b).view(batch, length, H, -1).transpose(1, 2)

    q, k, v = heads("query"), heads("key"), heads("value")
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    projection = attention.projection.double()
    m = projection.shape[1]
    phi_q = torch.exp(torch.einsum("bhnd,hmd->bhnm", q, projection) - 0.5) / math.sqrt(m)
    phi_k = torch.exp(torch.einsum("bhnd,hmd->bhnm", k, projection) - 0.5) / math.sqrt(m)
    relative = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    buckets = T5Attention._relative_position_bucket(relative, not causal, TINY["rpe_num_buckets"], TINY["rpe_max_distance"])
    c = torch.exp(table.double()[:, buckets])  # [H, L, L]
    scores = phi_q @ phi_k.transpose(-1, -2) * c * keep
    if causal:
        scores = scores * (relative <= 0)
    total = scores.sum(-1, keepdim=True)
    out = torch.where(total > 0, scores @ v / torch.where(total > 0, total, 1.0), 0.0)
    return out.transpose(1, 2).reshape(batch, length, -1)


def self_attention_bound(attention, hidden, table, expected, causal=False):
    """Bound [B, L, H d] on the module's float64 output against `reference_self_attention`'s (`expected`): the
    attention's direct rounding on both sides (`tolerances.attention_rounding`, dense) plus the q, k, v projections
    computed twice (nn.Linear's addmm here, matmul + add there): each element off by <= (hidden + 1) u of its
    terms |h| |W| + |b|, which moves z by at most max |dv| and the weights, through q_hat . w and k_hat . w, by a
    relative 2 |w| (|dq| / |q| + |dk| / |k|)."""
    batch, length, width = hidden.shape
    u = unit_roundoff(torch.float64)
    h = hidden.double()

    def heads(name, absolute=False):
        w, b = getattr(attention, name).weight.double(), getattr(attention, name).bias.double()
        out = h.abs() @ w.abs().t() + b.abs() if absolute else h @ w.t() + b
        return out.view(batch, length, H, -1).transpose(1, 2)

    q, k, v = heads("query"), heads("key"), heads("value")
    dq, dk, dv = (2 * (width + 1) * u * heads(name, absolute=True) for name in ("query", "key", "value"))
    relative = torch.arange(-(length - 1), length)
    bias = table.double()[:, T5Attention._relative_position_bucket(relative, not causal, TINY["rpe_num_buckets"],
                                                                   TINY["rpe_max_distance"])]
    z = expected.double().view(batch, length, H, -1).transpose(1, 2)
    bound = attention_rounding(q, k, v, bias, attention.projection, z, None, causal, "dense").values
    w = attention.projection.double().norm(dim=-1).max()
    exponent = 2 * w * ((dq.norm(dim=-1) / q.norm(dim=-1)).amax(-1) + (dk.norm(dim=-1) / k.norm(dim=-1)).amax(-1))
    bound = bound + exponent[..., None, None] * (v.abs().amax(-2, keepdim=True) + z.abs()) + dv.amax(-2, keepdim=True)
    return bound.transpose(1, 2).reshape(batch, length, -1)


def capture_first_attention(model, inputs):
    """Run the model; return (input hidden states, output) of the first layer's self-attention."""
    attention = model.base_model.encoder.layer[0].attention.self
    captured = {}
    hook = attention.register_forward_hook(lambda module, args, out: captured.update(hidden=args[0], out=out[0]))
    try:
        output = model(**inputs)
    finally:
        hook.remove()
    return captured["hidden"], captured["out"], output


# ---------------------------------------------------------------------------------------------
# 4D masks that are not padding masks: applied exactly (dense weights)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation,form,per_head", [("sdpa", "bool", False), ("eager", "additive", False), ("sdpa", "bool", True)])
def test_general_4d_mask_matches_float64_reference(implementation, form, per_head):
    model = bert().double()
    model.set_attn_implementation(implementation)
    randomize_rpe(model)
    batch, length = 3, 12
    generator = torch.Generator().manual_seed(1)
    keep = torch.rand(batch, H if per_head else 1, length, length, generator=generator) > 0.4
    keep[0, :, 5, :] = False  # a real query that may attend to nothing: zeros, not NaN
    keep[1] = True  # a row with no restriction at all
    mask = keep if form == "bool" else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    hidden, out, output = capture_first_attention(model, {"input_ids": ids(batch, length), "attention_mask": mask})
    attention = model.encoder.layer[0].attention.self
    expected = reference_self_attention(attention, hidden, model.encoder.rpe_table, keep)
    assert_within(out, expected, self_attention_bound(attention, hidden, model.encoder.rpe_table, expected))
    assert (out[0, 5] == 0).all() and torch.isfinite(output.last_hidden_state).all()


def test_general_mask_in_a_decoder_combines_with_causality():
    model = NPRFRobertaForCausalLM(NPRFRobertaConfig(**TINY, pad_token_id=1, is_decoder=True)).eval().double()
    randomize_rpe(model)
    length = 10
    keep = torch.ones(2, 1, length, length, dtype=torch.bool).tril()
    keep[:, :, 6:, :3] = False  # a sliding window on top of the causal pattern: not a padding mask
    hidden, out, _ = capture_first_attention(model, {"input_ids": ids(2, length), "attention_mask": keep})
    attention = model.roberta.encoder.layer[0].attention.self
    expected = reference_self_attention(attention, hidden, model.roberta.encoder.rpe_table, keep, causal=True)
    assert_within(out, expected, self_attention_bound(attention, hidden, model.roberta.encoder.rpe_table, expected,
                                                      causal=True))


def test_self_attention_module_checks_its_mask():
    attention = NPRFSelfAttention(NPRFBertConfig(**TINY)).eval()
    hidden = torch.randn(2, 6, 32)
    table = torch.zeros(H, TINY["rpe_num_buckets"])
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch=2, .*got \(1, 1, 6, 6\)"):
        attention(hidden, attention_mask=torch.rand(1, 1, 6, 6) > 0.5, rpe_table=table)
    with pytest.raises(ValueError, match=r"1 or num_heads=2"):
        attention(hidden, attention_mask=torch.rand(2, 3, 6, 6) > 0.5, rpe_table=table)
    with pytest.raises(ValueError, match=r"2D attention_mask must be \[batch=2, key_length=6\]"):
        attention(hidden, attention_mask=torch.ones(1, 6, dtype=torch.bool), rpe_table=table)


# ---------------------------------------------------------------------------------------------
# Shapes and values of masks and ids: a ValueError naming the problem
# ---------------------------------------------------------------------------------------------


BAD_MASKS = [
    ("1D", lambda b, n: torch.ones(n, dtype=torch.long), "got a 1D tensor"),
    ("3D", lambda b, n: torch.ones(b, n, n, dtype=torch.long), "got a 3D tensor"),
    ("2D batch 1", lambda b, n: torch.ones(1, n, dtype=torch.long), "batch size 1 but the input has batch size 3"),
    ("2D batch 2", lambda b, n: torch.ones(2, n, dtype=torch.long), "batch size 2 but the input has batch size 3"),
    ("2D short", lambda b, n: torch.ones(b, n - 1, dtype=torch.long), r"key_length=8\] \(1 = keep\), got \(3, 7\)"),
    ("2D long", lambda b, n: torch.ones(b, n + 1, dtype=torch.long), r"key_length=8\] \(1 = keep\), got \(3, 9\)"),
    ("2D additive", lambda b, n: torch.zeros(b, n).index_fill(1, torch.tensor([6, 7]), -1e4), "only 0/1"),
    ("2D fractional", lambda b, n: torch.full((b, n), 0.5), "only 0/1"),
    ("4D batch 1 padding", lambda b, n: torch.ones(1, 1, n, n, dtype=torch.bool), "batch size 1 but the input"),
    ("4D batch 1 general", lambda b, n: torch.ones(1, 1, n, n, dtype=torch.bool).tril(), "batch size 1 but the input"),
    ("4D heads", lambda b, n: torch.ones(b, 3, n, n, dtype=torch.bool).tril(), r"1 or num_heads=2"),
    ("4D keys", lambda b, n: torch.ones(b, 1, n, n - 1, dtype=torch.bool), r"key_length=8\], got \(3, 1, 8, 7\)"),
    ("4D bias", lambda b, n: torch.rand(b, 1, n, n), "additive attention bias"),
]


@pytest.mark.parametrize("make_mask,match", [case[1:] for case in BAD_MASKS], ids=[case[0] for case in BAD_MASKS])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_mismatched_masks_raise(family, make_mask, match):
    model = bert() if family == "bert" else roberta()
    with pytest.raises(ValueError, match=match):
        model(ids(3, 8), attention_mask=make_mask(3, 8))


def test_ids_out_of_range_raise():
    model = bert()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=99\), got values in \[3, 120\]"):
        model(torch.tensor([[3, 120]]))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=99\), got values in \[-1, 5\]"):
        model(torch.tensor([[-1, 5]]))
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, type_vocab_size=2\)"):
        model(ids(1, 4), token_type_ids=torch.full((1, 4), 2))
    # RoBERTa has one token type: a BERT-style pair encoding fails clearly
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, type_vocab_size=1\)"):
        roberta(type_vocab_size=1)(ids(1, 4), token_type_ids=torch.tensor([[0, 0, 1, 1]]))


# ---------------------------------------------------------------------------------------------
# Lengths: the position table and the dense attention matrix
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,limit", [("bert", 64), ("roberta", 62)])  # RoBERTa: 64 - (padding_idx + 1)
def test_input_longer_than_the_position_table(family, limit):
    model = bert() if family == "bert" else roberta()
    assert torch.isfinite(model(ids(1, limit)).last_hidden_state).all()
    for inputs in ({"input_ids": ids(1, limit + 1)}, {"inputs_embeds": torch.randn(1, limit + 1, 32)}):
        with pytest.raises(ValueError, match=r"max_position_embeddings=64.*nprf-hf convert --max-position-embeddings"):
            model(**inputs)
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, max_position_embeddings=64\).*--max-position-embeddings"):
        model(ids(1, 4), position_ids=torch.tensor([[0, 1, 2, 64]]))
    free = bert(position_embedding_type="none") if family == "bert" else roberta(position_embedding_type="none")
    assert torch.isfinite(free(ids(1, 3 * limit)).last_hidden_state).all()  # relative positions only: any length


def test_output_attentions_beyond_the_documented_length():
    model = bert(output_attentions_max_length=12)
    assert model(ids(1, 12), output_attentions=True).attentions[0].shape == (1, H, 12, 12)
    with pytest.raises(ValueError, match=r"output_attentions=True .*13 x 13.*output_attentions_max_length=12"):
        model(ids(1, 13), output_attentions=True)
    model.set_attn_implementation("eager")  # HF allows config.output_attentions only with eager
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions_max_length=12"):
        model(ids(1, 13))
    model.config.output_attentions = False
    general = torch.ones(1, 1, 13, 13, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"not a padding mask .*output_attentions_max_length=12"):
        model(ids(1, 13), attention_mask=general)
    assert torch.isfinite(model(ids(1, 13), attention_mask=torch.ones(1, 13)).last_hidden_state).all()


# ---------------------------------------------------------------------------------------------
# All-padding rows: no NaN, forward or backward, with every algorithm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["dense", "fft", "banded", "auto"])
@pytest.mark.parametrize("decoder", [False, True])
def test_all_padding_rows_give_no_nan(monkeypatch, algorithm, decoder):
    monkeypatch.setattr(nprf_banded, "BANDED_MIN_CHUNK", 4)  # n = 40 then really takes the chunked banded path
    config = NPRFRobertaConfig(**TINY, pad_token_id=1, is_decoder=decoder, attention_algorithm=algorithm)
    model = (NPRFRobertaForCausalLM(config) if decoder else NPRFRobertaModel(config)).train()
    randomize_rpe(model, std=2.0)
    length = 40
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1] = 0  # nothing to attend to at all
    mask[2, :25] = 0  # left padding (a decoder's first real token sees only itself)
    output = model(ids(3, length), attention_mask=mask, output_hidden_states=True)
    hidden = output.hidden_states[-1]
    assert torch.isfinite(hidden).all()
    (hidden.pow(2).mean() + output[0].float().mean()).backward()
    for name, param in model.named_parameters():
        assert param.grad is None or torch.isfinite(param.grad).all(), name


def test_all_padding_rows_in_the_functional_api_and_weights():
    q, k, v = torch.randn(3, 3, 2, 9, 4, dtype=torch.float64).unbind(0)  # each [B=3, H=2, n=9, d=4]
    bias = torch.randn(2, 17, dtype=torch.float64)
    projection = Fn.draw_projection(8, 4, num_heads=2, dtype=torch.float64)
    mask = torch.tensor([[0] * 9, [1] * 4 + [0] * 5, [1] * 9])
    for algorithm in Fn.ALGORITHMS:
        for causal in (False, True):
            out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, causal=causal)
            assert torch.isfinite(out).all() and (out[0] == 0).all()
    weights = Fn.nprf_attention_weights(q, k, bias, projection, mask)
    assert (weights[0] == 0).all()
    torch.testing.assert_close(weights[1:].sum(-1), torch.ones(2, 2, 9, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# Half precision with large activations: what NPRF adds (normalization, features, RPE) stays finite
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 2e4), (torch.bfloat16, 1e6)])
@pytest.mark.parametrize("mask_kind", ["padding", "general"])
def test_half_precision_attention_with_huge_activations(dtype, scale, mask_kind):
    config = NPRFBertConfig(**TINY)
    attention = NPRFSelfAttention(config).eval().to(dtype)
    generator = torch.Generator().manual_seed(0)
    hidden = ((torch.rand(3, 12, 32, generator=generator) * 2 - 1) * scale).to(dtype)
    table = (torch.randn(H, TINY["rpe_num_buckets"], generator=generator) * 10).to(dtype)  # c ratios up to ~e^40
    q = attention.query(hidden)
    assert torch.isfinite(q).all() and q.abs().max() > 1e4  # huge but representable
    if mask_kind == "padding":
        key_padding = torch.ones(3, 12, dtype=torch.bool)
        key_padding[1, 7:] = False
        key_padding[2] = False
        mask, keep = key_padding, key_padding[:, None, None, :]
    else:
        keep = torch.rand(3, 1, 12, 12, generator=generator) > 0.3
        mask = keep
    out, weights = attention(hidden, attention_mask=mask, rpe_table=table, output_attentions=True)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(weights).all()
    expected = reference_self_attention(attention, hidden.double(), table.double(), keep)
    value_scale = attention.value(hidden).double().abs().max()
    # half inputs (the math in float32, whose rounding is ~1e-4 of half's): v comes out of a half Linear (u of its
    # size) and z is rounded to half (u); the weights read w . q_hat and w . k_hat of half q, k (each rounded by u,
    # relative), a relative error of 2 |w| u in every weight, which moves z by up to 2 x that of the values' size:
    # (2 + 4 |w|_max) u, ~25 u here (was 3e-3 = 6 u for float16, 2e-2 = 5 u for bfloat16; seen: < 1 u)
    tolerance = (2 + 4 * attention.projection.double().norm(dim=-1).max().item()) * unit_roundoff(dtype)
    assert ((out.double() - expected).abs().max() / value_scale).item() < tolerance


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 6e4), (torch.bfloat16, 1e15)])
def test_half_precision_model_with_huge_input_embeddings(dtype, scale):
    model = bert().to(dtype)
    randomize_rpe(model, std=20.0)
    embeds = ((torch.rand(2, 10, 32) * 2 - 1) * scale).to(dtype)
    assert torch.isfinite(embeds).all()
    mask = torch.tensor([[1] * 10, [1] * 4 + [0] * 6])
    output = model(inputs_embeds=embeds, attention_mask=mask, output_attentions=True)
    assert torch.isfinite(output.last_hidden_state).all()
    assert all(torch.isfinite(a).all() for a in output.attentions)


# ---------------------------------------------------------------------------------------------
# Conversion of a checkpoint of another architecture
# ---------------------------------------------------------------------------------------------


def tiny_foreign_model(kind):
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    if kind == "t5":
        return T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    return bert()


@pytest.mark.parametrize("kind,model_type", [("gpt2", "gpt2"), ("t5", "t5"), ("nprf", "nprf_bert")])
def test_convert_refuses_other_architectures(tmp_path, capsys, kind, model_type):
    model = tiny_foreign_model(kind)
    src, out = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(src)
    with pytest.raises(ValueError, match=f"Unsupported model_type '{model_type}'.*bert, roberta"):
        convert_to_nprf(str(src))
    with pytest.raises(ValueError, match=f"Unsupported model_type '{model_type}'"):
        convert_to_nprf(model)
    assert cli.main(["convert", str(src), str(out)]) == 2
    assert f"Unsupported model_type '{model_type}'" in capsys.readouterr().err
    assert not out.exists()
