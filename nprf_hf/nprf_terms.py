# coding=utf-8
"""The optional terms of NPRF attention: each one class, its math beside it.

Without a term, the weight of query i and key j is  w_ij = kappa(q_i, k_j) c_{j-i},  c_r = exp(b_r). A term
changes it in one of three ways, the hook it implements:
  - `feature_scale`: a per-head scale of q_hat and k_hat before the feature map (`LogitScale`);
  - a factor f_ij > 0 (`SegmentBias`): `factor_product` splits the fast Toeplitz product, `factor_weights`
    multiplies the dense weights;
  - a summand g_ij kappa(q_i, k_j) (`TokenMatch`): `summand_product` adds to the fast product,
    `summand_weights` to the dense weights.
Exponentials are computed divided by their maximum (the ratios are what count); each factor returns that shift
[H], and a summand is multiplied by the shifts applied before it, so that its ratio to the rest stays exact.

A model builds its terms once per forward (`NPRFSelfAttention.attention_terms`): a term's per-layer parameter
(`parameter`, created when its config field `field` is on) with the inputs the base model derives once per
forward (`term_inputs`); `nprf_attention` builds the same object from its keyword arguments. A new term is one
class here, listed in `ATTENTION_TERMS`, plus its config field in `options.NPRF_FIELDS`.
"""

import copy
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .nprf_positions import pair_ids, per_head
from .options import ATTENTION_VARIANTS, NORMALIZED_VARIANTS


class AttentionTerm:
    """One optional term (see the module docstring). Subclasses set `field`, `parameter`, the variants it
    applies to, and implement `of_layer`, `check` and their hooks."""

    field: str = None  # the config field that turns the term on (`options.NPRF_FIELDS`)
    parameter: str = None  # its per-layer [H] parameter of `NPRFSelfAttention`
    name: str = None  # its keyword in `nprf_attention` (error messages)
    variants = ATTENTION_VARIANTS
    causal = True  # whether it applies to causal attention
    inside_product = False  # its tensors enter the Toeplitz product itself (not only scale its output)
    tensor_fields = ()  # its attributes that hold tensors a gradient may flow to
    batch_fields = ()  # its attributes that hold [B, n] ids (one row per sequence)

    @classmethod
    def enabled(cls, config):
        return bool(getattr(config, cls.field))

    @classmethod
    def initial_value(cls, config):
        """The parameter's initial value, the term's identity (a converted model is unchanged by it)."""
        return 0.0

    @classmethod
    def of_layer(cls, attention, inputs):
        """The term of one `NPRFSelfAttention` for one forward, or None where it does not apply.
        inputs: `term_inputs(...)` of the base model."""
        raise NotImplementedError

    def check(self, batch, heads, n):
        """A ValueError naming the problem for tensors of the wrong shape or value."""

    def tensors(self):
        """The tensors a gradient may flow to."""
        return tuple(getattr(self, name) for name in self.tensor_fields)

    def feature_scale(self):
        return None


class LogitScale(AttentionTerm):
    """s [H] > 0 scales the normalized content logits: the kernel becomes exp(s q_hat . k_hat), estimated with
    features of norm sqrt(s) (the estimate's variance grows with s). The model bounds it: s = logit_scale_max
    sigmoid(logit_scale_logit)."""

    field, parameter, name = "logit_scale_max", "logit_scale_logit", "logit_scale"
    variants = NORMALIZED_VARIANTS  # it scales normalized logits
    tensor_fields = ("scale",)

    def __init__(self, scale):
        self.scale = scale

    @classmethod
    def enabled(cls, config):
        return config.logit_scale_max > 0

    @classmethod
    def initial_value(cls, config):
        """The logit that gives s = 1 (the paper's NPRF) under `logit_scale_max`."""
        return -math.log(config.logit_scale_max - 1.0)

    @classmethod
    def of_layer(cls, attention, inputs):
        logit = attention.logit_scale_logit
        return None if logit is None else cls(attention.config.logit_scale_max * torch.sigmoid(logit.float()))

    def check(self, batch, heads, n):
        _check_per_head(self.scale, heads, "logit_scale", "scale")
        if not torch.compiler.is_compiling() and not bool((self.scale > 0).all()):
            raise ValueError("logit_scale must be > 0 for every head")

    def feature_scale(self):
        return self.scale


class SegmentBias(AttentionTerm):
    """beta [H] added to the relative bias of every query / key pair in different segments (the two sentences of
    a pair): the factor exp(beta [s_i != s_j]). exp of a sum is a product, so the Toeplitz product splits exactly
    into one product per key segment (cost x the number of segments)."""

    field, parameter, name = "segment_bias", "cross_segment_bias", "segment_bias"
    tensor_fields, batch_fields = ("bias",), ("segment_ids",)

    def __init__(self, segment_ids, bias, num_segments=None):
        """segment_ids [B, n] integer; bias [H]; num_segments: None or S when every id is known to lie in
        [0, S) (read only under torch.compile, which cannot read the segments present on the host)."""
        self.segment_ids, self.bias, self.num_segments = segment_ids, bias, num_segments

    @classmethod
    def of_layer(cls, attention, inputs):
        if attention.cross_segment_bias is None or inputs.get("segment_ids") is None:
            return None
        return cls(inputs["segment_ids"], attention.cross_segment_bias, attention.num_segments)

    def check(self, batch, heads, n):
        _check_ids(self.segment_ids, batch, n, "segment_ids")
        _check_per_head(self.bias, heads, "segment_bias", "bias")

    def factors(self, dtype):
        """exp(0) and exp(beta) per head [H], both divided by the larger: <= 1."""
        return _shifted_exp(self.bias.to(dtype))

    def factor_product(self, toeplitz_product, dtype):
        """(the product with the factor, its shift [H]): one Toeplitz product per key segment (keys of the other
        segments zeroed), each weighted per query by exp(0) or exp(beta). Segments: those present (a host sync),
        or under torch.compile all of range(num_segments) when given."""
        same, other = self.factors(dtype)

        def product(phi_k):
            segment_ids = self.segment_ids.to(phi_k.device)
            if self.num_segments is not None and torch.compiler.is_compiling():
                segments = range(self.num_segments)
            else:
                segments = torch.unique(segment_ids).tolist()
            out = None
            for segment in segments:
                in_segment = segment_ids == segment  # [B, n]
                part = toeplitz_product(phi_k * in_segment[:, None, :, None].to(phi_k.dtype))
                weight = torch.where(in_segment[:, None, :, None], same[:, None, None], other[:, None, None])
                out = part * weight if out is None else out + part * weight
            return out

        return product, same

    def factor_weights(self, weights, dtype, pairs=None):
        """(weights [B, H, n, n] (or laid out as `pairs`: `AttentionTerms.weights`) times the factor, its shift)."""
        same, other = self.factors(dtype)
        query_ids, key_ids = pair_ids(self.segment_ids.to(weights.device), pairs)
        crossing = query_ids != key_ids  # [B, 1, n, n]
        return weights * torch.where(crossing, per_head(other, weights), per_head(same, weights)), same


class TokenMatch(AttentionTerm):
    """mu [H] >= 0, the weight of a query and a key that are the same token in different segments: the summand
    mu [t_i = t_j, s_i != s_j] kappa(q_i, k_j), an exact word-matching term. Linear time: the keys' phi_k u^T are
    summed per (token, segment) group and each query reads the groups of its own token in the other segments."""

    field, parameter, name = "token_match", "token_match_weight", "the word-matching term"
    causal, tensor_fields, batch_fields = False, ("weight",), ("token_ids", "segment_ids")

    def __init__(self, token_ids, weight, segment_ids):
        """token_ids, segment_ids [B, n] integer; weight [H] >= 0."""
        self.token_ids, self.weight, self.segment_ids = token_ids, weight, segment_ids

    @classmethod
    def of_layer(cls, attention, inputs):
        if attention.token_match_weight is None or inputs.get("token_ids") is None or inputs.get("segment_ids") is None:
            return None
        weight = attention.token_match_weight  # `where`: clamp_min's gradient at 0, its start, is 0 in torch 2.14
        return cls(inputs["token_ids"], torch.where(weight >= 0, weight, 0.0), inputs["segment_ids"])

    def check(self, batch, heads, n):
        _check_ids(self.token_ids, batch, n, "token_ids")
        _check_per_head(self.weight, heads, "match_weight", "weight")
        if not torch.compiler.is_compiling() and not bool((self.weight >= 0).all()):
            raise ValueError("match_weight must be >= 0 (it adds attention weight to matching tokens)")

    def matches(self, device, pairs=None):
        """[B, 1, n, n] bool (or on the layout of `pairs`): key j is query i's token in another segment."""
        query_tokens, key_tokens = pair_ids(self.token_ids.to(device), pairs)
        query_segments, key_segments = pair_ids(self.segment_ids.to(device), pairs)
        return (query_tokens == key_tokens) & (query_segments != key_segments)

    def summand_product(self, phi_q, phi_k, u, pairwise):
        """sum over keys j with t_j = t_i and s_j != s_i of (phi_q_i . phi_k_j) u_j: [B, H, n, e]. Where the
        product builds the n x n pairs anyway (`pairwise`: dense), the n x n match mask is cheapest; otherwise the
        keys' states phi_k u^T are summed per (batch, token) and per (batch, segment, token) group (linear in n) and
        a query reads its token's total minus its own segment's part."""
        if pairwise:
            return ((phi_q @ phi_k.transpose(-1, -2)) * self.matches(phi_q.device).to(phi_q.dtype)) @ u
        token_ids, segment_ids = self.token_ids.to(phi_q.device), self.segment_ids.to(phi_q.device)
        batch, heads, n, m = phi_k.shape
        e = u.shape[-1]
        states = (phi_k.unsqueeze(-1) * u.unsqueeze(-2)).transpose(1, 2).reshape(batch * n, heads, m, e)
        rows = torch.arange(batch, device=token_ids.device)[:, None].expand(batch, n)
        by_token, token_groups = group_ids(torch.stack([rows, token_ids]).reshape(2, -1))
        by_segment, segment_groups = group_ids(torch.stack([rows, segment_ids, token_ids]).reshape(3, -1))
        totals = states.new_zeros(token_groups, heads, m, e).index_add(0, by_token, states)
        parts = states.new_zeros(segment_groups, heads, m, e).index_add(0, by_segment, states)
        others = (totals[by_token] - parts[by_segment]).view(batch, n, heads, m, e)
        return torch.einsum("bhnm,bnhme->bhne", phi_q, others)

    def summand_weights(self, kernel, pairs=None):
        """[B, H, n, n] (or on the layout of `pairs`): the term's weights before mu."""
        return kernel * self.matches(kernel.device, pairs)


class FirstTokenBias(AttentionTerm):
    """gamma [H] added to the logit of the first key ([CLS] / <s>, position 0): the factor exp(gamma [j = 0]).
    Softmax encoders park much of their attention on that token (an attention sink, with logits far above the
    rest); NPRF's normalized logits lie in [-s, s] and cannot single one key out that much, which this bias can.
    A factor of the key alone: it scales phi_k's first row, so every algorithm applies it at no extra cost."""

    field, parameter, name = "first_token_bias", "first_key_bias", "first_key_bias"
    causal = False  # a decoder's recurrent state (`NPRFCache`) keeps no per-key factor
    inside_product = True  # it scales the keys' features
    tensor_fields = ("bias",)

    def __init__(self, bias):
        self.bias = bias

    @classmethod
    def of_layer(cls, attention, inputs):
        return None if attention.first_key_bias is None else cls(attention.first_key_bias)

    def check(self, batch, heads, n):
        _check_per_head(self.bias, heads, "first_key_bias", "bias")

    def key_factors(self, n, dtype, device):
        """([H, n] exp(gamma [j = 0]) divided by its maximum, that shift [H])."""
        rest, first = _shifted_exp(self.bias.to(device=device, dtype=dtype))
        return torch.where(torch.arange(n, device=device) == 0, first[:, None], rest[:, None]), rest

    def factor_product(self, toeplitz_product, dtype):
        def product(phi_k):
            factors, _ = self.key_factors(phi_k.shape[-2], dtype, phi_k.device)
            return toeplitz_product(phi_k * factors[:, :, None])

        return product, _shifted_exp(self.bias.to(dtype))[0]

    def factor_weights(self, weights, dtype, pairs=None):
        rest, first = _shifted_exp(self.bias.to(device=weights.device, dtype=dtype))
        key_positions = torch.arange(weights.shape[-1], device=weights.device) if pairs is None else pairs[1]
        return weights * torch.where(key_positions == 0, per_head(first, weights), per_head(rest, weights)), rest


def _shifted_exp(bias):
    """(exp(0), exp(bias)) per head, both divided by the larger (<= 1): a bias's factor and, first, its shift."""
    top = bias.clamp_min(0.0)
    return torch.exp(-top), torch.exp(bias - top)


def _check_per_head(tensor, heads, name, what):
    if tensor.shape != (heads,):
        raise ValueError(f"{name} must be [H={heads}] (one {what} per head), got {tuple(tensor.shape)}")


def _check_ids(ids, batch, n, name):
    if ids.shape != (batch, n) or ids.is_floating_point():
        raise ValueError(f"{name} must be integer [B={batch}, n={n}], got {ids.dtype} {tuple(ids.shape)}")


def group_ids(keys):
    """(group of every column of keys [k, N], number of groups): equal columns share a group, numbered in
    the lexicographic order of the columns (as torch.unique's inverse). In eager mode the groups are counted
    (a host sync); under torch.compile, whose shapes must not depend on values, they come from stable sorts,
    one key at a time from the last, and N (every column alone) bounds their number."""
    if not torch.compiler.is_compiling():
        _, inverse = torch.unique(keys, dim=1, return_inverse=True)
        return inverse, int(inverse.max()) + 1
    order = torch.arange(keys.shape[1], device=keys.device)
    for key in reversed(keys):
        order = order[torch.argsort(key[order], stable=True)]
    ordered = keys[:, order]
    starts = F.pad((ordered[:, 1:] != ordered[:, :-1]).any(0), (1, 0))
    inverse = torch.empty_like(order).scatter_(0, order, starts.cumsum(0))
    return inverse, keys.shape[1]


# Every term. `AttentionTerms` applies the feature scales, then the factors, then the summands (which read the
# factors' shifts), each kind in this order.
ATTENTION_TERMS = (LogitScale, SegmentBias, TokenMatch, FirstTokenBias)


class AttentionTerms:
    """The optional terms of one attention call, consumed by the math (`functional`, `cache_nprf`)."""

    def __init__(self, *terms):
        self.terms = tuple(term for term in terms if term is not None)

    @classmethod
    def from_arguments(cls, logit_scale=None, segment_ids=None, segment_bias=None, token_ids=None, match_weight=None,
                       num_segments=None):
        """The terms of `nprf_attention`'s keyword arguments (see there)."""
        if (segment_ids is None) != (segment_bias is None):
            raise ValueError("segment_ids and segment_bias go together: give both or neither")
        if (token_ids is None) != (match_weight is None):
            raise ValueError("token_ids and match_weight go together: give both or neither")
        if token_ids is not None and segment_ids is None:
            raise ValueError("the word-matching term needs segment_ids (it matches tokens across segments)")
        return cls(
            None if logit_scale is None else LogitScale(logit_scale),
            None if segment_ids is None else SegmentBias(segment_ids, segment_bias, num_segments),
            None if token_ids is None else TokenMatch(token_ids, match_weight, segment_ids),
        )

    def __bool__(self):
        return bool(self.terms)

    def check(self, batch, heads, n, causal, variant):
        for term in self.terms:
            name = term.name
            if variant not in term.variants:
                raise ValueError(f"{name} applies to the variants {term.variants}, not {variant!r}")
            if causal and not term.causal:
                raise ValueError(f"{name} needs causal=False: it is a term of encoders")
            term.check(batch, heads, n)

    def tensors(self, inside_product=False):
        """The terms' tensors (inside_product: only those that enter the Toeplitz product itself)."""
        return tuple(t for term in self.terms if term.inside_product or not inside_product for t in term.tensors())

    def with_tensors(self, tensors, rows=None):
        """A copy whose terms hold `tensors` (in the order of `tensors()`) in place of their own; with `rows` (a
        slice of the batch), their ids cut to those sequences."""
        tensors, terms = list(tensors), []
        for term in self.terms:
            term = copy.copy(term)
            for name in term.tensor_fields:
                setattr(term, name, tensors.pop(0))
            for name in term.batch_fields if rows is not None else ():
                setattr(term, name, getattr(term, name)[rows])
            terms.append(term)
        return AttentionTerms(*terms)

    def product_value_read(self):
        """Whether a gradient reads the Toeplitz product's value: that of a factor of its output (not inside it)
        whose tensor requires grad."""
        return any(
            hasattr(term, "factor_product") and not term.inside_product and any(t.requires_grad for t in term.tensors())
            for term in self.terms
        )

    @property
    def pair_terms(self):
        """The terms that relate a query and a key beyond their features (factors and summands)."""
        return tuple(t for t in self.terms if hasattr(t, "factor_product") or hasattr(t, "summand_product"))

    @property
    def logit_scale(self) -> Optional[torch.Tensor]:
        """s [H] of the feature map, or None (s = 1)."""
        scales = [term.feature_scale() for term in self.terms if term.feature_scale() is not None]
        return scales[0] if scales else None

    def product(self, toeplitz_product, phi_q, phi_k, values_and_ones, shift, pairwise, dtype):
        """The Toeplitz product with every term: sum_j w_ij [v_j | 1], [B, H, n, e].

        toeplitz_product: keys [B, H, n, m] -> sum_j c_{j-i} (phi_q_i . phi_k_j) u_j. values_and_ones: () -> u
        [B, H, n, e], built only for a summand. shift: [H] the shift of c (exp(-max b))."""
        shifts = [shift]
        for term in self.terms:
            if hasattr(term, "factor_product"):
                toeplitz_product, factor_shift = term.factor_product(toeplitz_product, dtype)
                shifts.append(factor_shift)
        out = toeplitz_product(phi_k)
        for term in self.terms:
            if hasattr(term, "summand_product"):
                weight = _shifted(term.weight.to(dtype), shifts)
                out = out + term.summand_product(phi_q, phi_k, values_and_ones(), pairwise) * weight[:, None, None]
        return out

    def weights(self, kernel, coefficients, shift, dtype, pairs=None):
        """The dense weights with every term, [B, H, n, n], from the kernel [B, H, n, n] and C [H, n, n]; or laid
        out as `pairs` (query, key positions broadcastable to the kernel's last dims: the near field's windows)."""
        weights, shifts = kernel * coefficients, [shift]
        for term in self.terms:
            if hasattr(term, "factor_weights"):
                weights, factor_shift = term.factor_weights(weights, dtype, pairs)
                shifts.append(factor_shift)
        for term in self.terms:
            if hasattr(term, "summand_weights"):
                weight = per_head(_shifted(term.weight.to(dtype), shifts), kernel)
                weights = weights + term.summand_weights(kernel, pairs) * weight
        return weights


def _shifted(weight, shifts):
    """A summand's weight [H] times every shift applied before it, in order."""
    for shift in shifts:
        weight = weight * shift
    return weight
