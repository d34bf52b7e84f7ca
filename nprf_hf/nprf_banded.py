# coding=utf-8
"""The banded algorithm: C = far constants + a band of width W, in O(n (W + m e)). Exact for a bias that is
constant beyond the band (T5's buckets are: `nprf_positions.rpe_band_width`).

Execution modes side by side: the near product (the band) is one custom op with its backward, eager kernels that
work a group of chunks at a time in cache, which torch.compile keeps opaque (`nprf_banded_window`); the far sums
are in `nprf_banded_far`; the backward alone from the inputs runs a sequence at a time (`banded_toeplitz_backward`,
for the lean training mode of `nprf_banded_recompute`).
"""

import torch
import torch.nn.functional as F

from .nprf_banded_far import FarStates, far_states_compiled, far_sums, far_sums_backward
from .nprf_banded_window import _band_window_backward, window_product
from .nprf_dense import dense_toeplitz_attention
from .nprf_features import values_and_ones
from .nprf_near_field import split_near
from .nprf_positions import diagonals
from .nprf_schedule import SERIAL


# Smallest chunk of the banded algorithm: below this the chunked matmuls are too small to be fast.
BANDED_MIN_CHUNK = 16
# Chunks of reach R: a query chunk's window is 2R + 1 chunks (R s >= W - 1).
BANDED_REACH = 1
# Chunks of reach with the exact near field: its window's inner chunks need no feature scores and its outer ones
# few, so smaller chunks save more than they cost (docs/RESULTS.md, "Exact near field").
NEAR_FIELD_REACH = 2


def banded_toeplitz_attention(phi_q, phi_k, value, c, band_width, causal, near=None, threads=SERIAL):
    """C = c_far^- [j < i] + c_far^+ [j > i] + a band of width W, all matmuls.

    The sequence is cut into chunks of size s with R s >= W - 1 (R chunks of reach). Queries of
    chunk k see the keys of chunks k-R .. k+R (a window of (2R+1)s keys) with their exact
    coefficients c_{j-i} (one [s, (2R+1)s] Toeplitz block shared by all chunks); every key of chunks
    <= k-R-1 is at distance >= Rs + 1 >= W and weighs c_far^-, every key of chunks >= k+R+1 weighs
    c_far^+: those enter through prefix / suffix sums of the chunk states phi_k^T u. Causal drops
    the chunks after k and the suffix sums. `near` (an `nprf_near_field.NearField` no wider than the band): the
    window's pairs closer than its width weigh its exact kernel instead of phi_q . phi_k. `threads`: the
    `nprf_schedule` scheduler of the window product's sequences and of the small operators.
    """
    batch, heads, n, m = phi_q.shape
    e = value.shape[-1] + 1
    reach, chunk = banded_chunking(band_width, near is not None)
    num_chunks = -(-n // chunk)
    if num_chunks <= 2 * reach + 1:  # the window covers the whole sequence: this is the dense product
        return dense_toeplitz_attention(phi_q, phi_k, values_and_ones(value, threads=threads), c, near)
    q_chunks, k_rows, u_rows, window = _band_layout(phi_q, phi_k, value, reach, chunk, causal, threads)

    # Near part. Query a and window key w are at distance r = w - R s - a; one [H, s, window]
    # coefficient block serves every chunk (clamped entries only ever meet zero keys).
    # Compiled, the block is built without a gather (`diagonals`: inductor can miscompile a gather's backward,
    # see there): c extended by its edge values is c clamped.
    compiling = torch.compiler.is_compiling()
    if compiling:
        edge = (reach + 1) * chunk
        extended = torch.cat([c[:, :1].expand(-1, edge), c, c[:, -1:].expand(-1, edge)], dim=-1)
        start = n - (reach + 1) * chunk + edge
        coefficients = diagonals(extended[:, start : start + chunk + window - 1], chunk, window)
    else:
        with threads.small():  # [H, s, window]: too small to split
            coefficients = c[:, _coefficient_index(n, chunk, reach, window, c.device)]
    near_inputs = ()
    if near is not None:  # the window holds every pair closer than the band: the exact kernel's too
        coefficients, near_inputs = _near_window(coefficients, near, chunk, reach, causal, u_rows, threads)
    out = window_product(q_chunks, k_rows, u_rows, coefficients, *near_inputs, threads=threads)

    # Far part: chunk k gets c_far^- times the states of chunks <= k-R-1 (and c_far^+ times those >= k+R+1).
    states = _chunk_states(k_rows, u_rows, chunk).view(batch, heads, -1, m * e)
    c_after = None if causal else c[:, -1]
    if compiling:
        far = far_states_compiled(states, c[:, 0], c_after, num_chunks, reach)
    else:
        far = FarStates.apply(states, c[:, 0], c_after, num_chunks, reach, threads)
    out = out.baddbmm_(q_chunks, far.view(-1, m, e))
    return out.view(batch, heads, -1, e)[:, :, :n]


def _band_layout(phi_q, phi_k, value, reach, chunk, causal, threads=SERIAL):
    """(q_chunks [B*H*chunks, s, m], k_rows [B*H, rows, m], u_rows [B*H, rows, e], window): the sequence padded to
    whole chunks, the keys and [v | 1] with R zero chunks in front (and behind, unless causal): chunk k's window
    then starts at row k s of its head's rows, so unfolding the rows with step s yields exactly one window per chunk."""
    batch, heads, n, m = phi_q.shape
    padded = -(-n // chunk) * chunk
    window = (2 * reach + 1 if not causal else reach + 1) * chunk
    before, after = reach * chunk, padded - n + (0 if causal else reach * chunk)
    k_rows = _zero_padded(phi_k, before, after, threads).view(batch * heads, -1, m)
    u_rows = values_and_ones(value, before, after, threads).view(batch * heads, -1, value.shape[-1] + 1)
    q_chunks = (_zero_padded(phi_q, 0, padded - n, threads) if padded > n else phi_q).reshape(-1, chunk, m)
    return q_chunks, k_rows, u_rows, window


def _near_window(coefficients, near, chunk, reach, causal, u_rows, threads=SERIAL):
    """(the far coefficients, the window product's near inputs: q_near, k_near rows and the near coefficients) of the
    window's coefficient block [H, s, window] and the `NearField` (u_rows as `_near_window_inputs` takes it)."""
    distance = _offsets(chunk, reach, coefficients.shape[-1], coefficients.device)
    coefficients, near_coefficients = split_near(coefficients, distance, near.width)
    return coefficients, (*_near_window_inputs(near, chunk, reach, causal, u_rows, threads), near_coefficients)


def _near_window_inputs(near, chunk, reach, causal, u_rows, threads=SERIAL):
    """(q_near [B*H*chunks, s, f], k_near rows [B*H, rows, f]): the near field's unit vectors in the window product's
    layout (as `_band_layout`'s); a padded key's [v | 1] row in u_rows [B*H, rows, e] is zeroed in place, since its
    exact weight is not zero (its features are)."""
    batch, heads, n, f = near.query.shape
    padded = -(-n // chunk) * chunk
    query = _zero_padded(near.query, 0, padded - n, threads).reshape(-1, chunk, f)
    keys = _zero_padded(near.key, reach * chunk, padded - n + (0 if causal else reach * chunk), threads)
    if near.key_mask is not None:
        keys_u = u_rows.view(batch, heads, -1, u_rows.shape[-1])[:, :, reach * chunk : reach * chunk + n]
        keys_u.mul_(near.key_mask[:, None, :, None])
    return query, keys.view(batch * heads, -1, f)


def _zero_padded(x, before, after, threads=SERIAL):
    """x [B, H, n, m] with `before` zero rows in front and `after` behind, every element written once (F.pad
    zero-fills the whole output and then copies x in: at 8,192 tokens that fill was 3% of a MiniLM forward)."""
    batch, heads, n, m = x.shape
    out = x.new_empty(batch, heads, before + n + after, m)
    with threads.small():  # R chunks each side: too small to split
        out[:, :, :before] = 0.0
        out[:, :, before + n :] = 0.0
    out[:, :, before : before + n] = x
    return out


def _chunk_states(k_rows, u_rows, chunk):
    """[B*H * (R + chunks (+ R)), m, e]: each chunk's phi_k^T [v | 1] (the padding chunks hold zeros)."""
    m, e = k_rows.shape[-1], u_rows.shape[-1]
    return torch.bmm(k_rows.view(-1, chunk, m).transpose(-1, -2), u_rows.view(-1, chunk, e))


def _coefficient_index(n, chunk, reach, window, device):
    """[s, window] entries of c [H, 2n - 1] for query a and window key w, at distance r = w - R s - a (clamped
    entries only ever meet zero keys)."""
    return (_offsets(chunk, reach, window, device) + n - 1).clamp(0, 2 * n - 2)


def _offsets(chunk, reach, window, device):
    """[s, window] distances r = w - R s - a of query a and window key w."""
    return torch.arange(window, device=device)[None, :] - reach * chunk - torch.arange(chunk, device=device)[:, None]


def banded_toeplitz_backward(phi_q, phi_k, value, c, band_width, causal, grad_out, needs_c=True, near=None,
                             threads=SERIAL):
    """The gradients (phi_q, phi_k, value, c, near.query, near.key; c's None unless `needs_c`, the near field's
    None without it) of `banded_toeplitz_attention` for grad_out [B, H, n, e], from its inputs alone: its forward is
    not run. One sequence (batch row, head) at a time, an item of `threads` each, so that the padded copies, the
    chunk states and the work buffers are those of one head."""
    batch, heads, n, _ = phi_q.shape
    reach, chunk = banded_chunking(band_width, near is not None)
    if -(-n // chunk) <= 2 * reach + 1:  # dense (short inputs): its forward costs little, autograd derives the rest
        return _dense_backward(phi_q, phi_k, value, c, grad_out, needs_c, near, threads)
    grads = [torch.empty_like(t) for t in (phi_q, phi_k, value)]
    grads.append(c.new_empty(batch, *c.shape) if needs_c else None)  # per sequence, summed over the batch at the end
    grads += [None, None] if near is None else [torch.empty_like(near.query), torch.empty_like(near.key)]

    def sequence_backward(sequence, slot):
        b, h = divmod(sequence, heads)
        one = (slice(b, b + 1), slice(h, h + 1))
        near_one = None if near is None else near._replace(
            query=near.query[one], key=near.key[one],
            key_mask=None if near.key_mask is None else near.key_mask[b : b + 1])
        sequence_grads = _sequence_backward(phi_q[one], phi_k[one], value[one], c[h : h + 1], reach, chunk, causal,
                                            grad_out[one], needs_c, near_one, threads)
        for target, grad in zip(grads, sequence_grads):
            if target is not None:
                target[b, h] = grad[0] if grad.dim() == 2 else grad[0, 0]

    threads.items(batch * heads, sequence_backward)
    if needs_c:
        grads[3] = grads[3].sum(0)
    return tuple(grads)


def _dense_backward(phi_q, phi_k, value, c, grad_out, needs_c, near, threads):
    """`banded_toeplitz_backward` where the window covers the sequence: autograd through the dense product."""
    with torch.enable_grad():
        inputs = (phi_q, phi_k, value, c) + (() if near is None else (near.query, near.key))
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        near_leaves = None if near is None else near._replace(query=leaves[4], key=leaves[5])
        out = dense_toeplitz_attention(leaves[0], leaves[1], values_and_ones(leaves[2], threads=threads), leaves[3],
                                       near_leaves)
        grads = torch.autograd.grad(out, leaves, grad_out)
    return (*grads[:3], grads[3] if needs_c else None, *(grads[4:] if near is not None else (None, None)))


def _sequence_backward(phi_q, phi_k, value, c, reach, chunk, causal, grad_out, needs_c, near=None, threads=SERIAL):
    """`banded_toeplitz_backward` of one sequence ([1, 1, n, .] inputs, c [1, 2n - 1]); the gradients are views of
    padded buffers. The far part's states and prefix sums are rebuilt (O(n m e)); the band's [s, window] weights
    are rebuilt by the window product's backward anyway."""
    _, _, n, m = phi_q.shape
    e = value.shape[-1] + 1
    num_chunks = -(-n // chunk)
    q_chunks, k_rows, u_rows, window = _band_layout(phi_q, phi_k, value, reach, chunk, causal, threads)
    index = _coefficient_index(n, chunk, reach, window, c.device)
    coefficients, near_inputs = c[:, index], ()
    if near is not None:
        coefficients, near_inputs = _near_window(coefficients, near, chunk, reach, causal, u_rows, threads)
    grad_chunks = F.pad(grad_out, (0, 0, 0, num_chunks * chunk - n)).reshape(-1, chunk, e)
    grad_q, grad_k, grad_u, grad_coefficients, grad_q_near, grad_k_near, grad_near_coefficients = _band_window_backward(
        q_chunks, k_rows, u_rows, coefficients, grad_chunks, needs_c, *near_inputs, threads=threads)
    # Far part, out[k] += q[k] @ far[k] with far the prefix / suffix sums of the chunk states k_s^T u_s.
    states = _chunk_states(k_rows, u_rows, chunk).view(1, 1, -1, m * e)
    c_after = None if causal else c[:, -1]
    far = far_sums(states, c[:, 0], c_after, num_chunks, reach, threads)
    grad_q.baddbmm_(grad_chunks, far.view(-1, m, e).transpose(-1, -2))
    grad_far = torch.bmm(q_chunks.transpose(-1, -2), grad_chunks).view(1, 1, num_chunks, m * e)
    grad_states, grad_before, grad_after = far_sums_backward(
        states, c[:, 0], c_after, grad_far, num_chunks, reach, needs_c, needs_c, threads
    )
    grad_states = grad_states.view(-1, m, e)
    grad_k.view(-1, chunk, m).baddbmm_(u_rows.view(-1, chunk, e), grad_states.transpose(-1, -2))
    grad_u.view(-1, chunk, e).baddbmm_(k_rows.view(-1, chunk, m), grad_states)
    front = reach * chunk
    grad_c = None
    if needs_c:
        if near is not None:  # both parts read c at the same entries, each where its mask keeps it
            inside = _offsets(chunk, reach, window, c.device).abs() < near.width
            grad_coefficients = torch.where(inside, grad_near_coefficients, grad_coefficients)
        grad_c = torch.zeros_like(c).index_add_(1, index.flatten(), grad_coefficients.flatten(1))
        grad_c[:, 0] += grad_before
        if grad_after is not None:
            grad_c[:, -1] += grad_after
    grad_u = grad_u.view(1, 1, -1, e)[:, :, front : front + n, :-1]
    near_grads = (None, None)
    if near is not None:  # (u rows of padded keys were masked: so is their gradient)
        if near.key_mask is not None:
            grad_u = grad_u * near.key_mask[:, None, :, None]
        near_grads = (grad_q_near.view(1, 1, -1, grad_q_near.shape[-1])[:, :, :n],
                      grad_k_near.view(1, 1, -1, grad_k_near.shape[-1])[:, :, front : front + n])
    return (grad_q.view(1, 1, -1, m)[:, :, :n], grad_k.view(1, 1, -1, m)[:, :, front : front + n], grad_u, grad_c,
            *near_grads)


def banded_chunking(band_width, near=False):
    """(reach R, chunk size s) with R s >= W - 1: smaller chunks waste less of the window; `near`: for the exact
    near field, whose window pays an exp per entry and needs the features only in its outermost chunks."""
    reach = NEAR_FIELD_REACH if near else BANDED_REACH
    chunk = max(-(-(band_width - 1) // reach), BANDED_MIN_CHUNK)
    return reach, chunk


def banded_window(band_width, m, e, near=False):
    """Per-token cost proxy of the banded algorithm, in keys of a dense row."""
    reach, chunk = banded_chunking(band_width, near)
    return (2 * reach + 1) * chunk + 2 * m * e / (m + e)
