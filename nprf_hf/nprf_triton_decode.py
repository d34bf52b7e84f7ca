# coding=utf-8
"""The Triton kernel of one decode step (`nprf_triton.decode_step` launches it): a new token attends the window of
the last W - 1 keys exactly (c by distance) and the far keys through their state [S | z] (one c), then the window's
oldest key joins the far state. One program per (sequence, head); no dot products (one query, one key)."""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only `nprf_triton` imports this file, after checking that Triton imports
    raise ImportError("the Triton kernels of nprf-hf need the `triton` package: pip install triton") from error

from .nprf_triton_kernels import _projection


@triton.jit
def _row_features(x, w, root, m, log_m_half, EPS: tl.constexpr):
    """`_features` of one row x [BD] (no dot: a decode step has one query and one key): phi [BM]."""
    inverse = root / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), EPS)
    y = x * inverse
    wy = tl.sum(w * y[None, :], axis=1)
    features = tl.arange(0, w.shape[0])
    return tl.where(features < m, tl.exp(wy - (0.5 * tl.sum(y * y, axis=0) + log_m_half)), 0.0)


@triton.jit
def nprf_decode_kernel(
    Q, K, V, MASK, W, ROOT, C, S, RF, RV, O, S_OUT, RF_OUT, RV_OUT,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd,
    H, D, DV, M, R, log_m_half,
    HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr,
    BD: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
):
    """One decode step of one (sequence, head): the new query attends the window (the ring's R = W - 1 keys, oldest
    first, then the new key) with c by distance, and the far state [S | z] with c_far = C[h, R + 1]; the window's
    oldest key then joins the far state and the ring moves on by one. State [B, H, ...] contiguous fp32, values
    with their ones column (E = DV + 1 <= BE); O [B, H, 1, DV]."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    cols_d, cols_e, feats, rows = tl.arange(0, BD), tl.arange(0, BE), tl.arange(0, BM), tl.arange(0, BR)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD)
    q = tl.load(Q + b * stride_qb + h * stride_qh + cols_d * stride_qd, mask=cols_d < D, other=0.0).to(tl.float32)
    k = tl.load(K + b * stride_kb + h * stride_kh + cols_d * stride_kd, mask=cols_d < D, other=0.0).to(tl.float32)
    phi_q = _row_features(q, w, root, M, log_m_half, EPS)
    phi_k = _row_features(k, w, root, M, log_m_half, EPS)
    if HAS_MASK:
        phi_k = phi_k * (tl.load(MASK + b) != 0).to(tl.float32)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols_e * stride_vd, mask=cols_e < DV, other=0.0).to(tl.float32)
    u = tl.where(cols_e == DV, 1.0, v)
    in_ring = rows[:, None] < R
    window_f = tl.load(RF + (bh * R + rows[:, None]) * M + feats[None, :], mask=in_ring & (feats[None, :] < M), other=0.0)
    window_v = tl.load(RV + (bh * R + rows[:, None]) * (DV + 1) + cols_e[None, :],
                       mask=in_ring & (cols_e[None, :] < DV + 1), other=0.0)
    new = rows[:, None] == R
    window_f = tl.where(new, phi_k[None, :], window_f)
    window_v = tl.where(new, u[None, :], window_v)
    c = tl.load(C + h * (R + 2) + R - rows, mask=rows <= R, other=0.0)  # window row w is at distance R - w
    weights = tl.sum(window_f * phi_q[None, :], axis=1) * c
    state = tl.load(S + (bh * M + feats[:, None]) * (DV + 1) + cols_e[None, :],
                    mask=(feats[:, None] < M) & (cols_e[None, :] < DV + 1), other=0.0)
    sums = tl.sum(weights[:, None] * window_v, axis=0) + tl.load(C + h * (R + 2) + R + 1) * tl.sum(
        phi_q[:, None] * state, axis=0)
    denominator = tl.sum(tl.where(cols_e == DV, sums, 0.0), axis=0)
    out = tl.where(denominator > 0, sums / tl.where(denominator > 0, denominator, 1.0), 0.0)
    tl.store(O + bh * DV + cols_e, out.to(O.dtype.element_ty), mask=cols_e < DV)
    # the oldest window key leaves the band for good: into [S | z]
    oldest_f = tl.sum(tl.where(rows[:, None] == 0, window_f, 0.0), axis=0)
    oldest_v = tl.sum(tl.where(rows[:, None] == 0, window_v, 0.0), axis=0)
    tl.store(S_OUT + (bh * M + feats[:, None]) * (DV + 1) + cols_e[None, :], state + oldest_f[:, None] * oldest_v[None, :],
             mask=(feats[:, None] < M) & (cols_e[None, :] < DV + 1))
    moved = (rows[:, None] >= 1) & (rows[:, None] <= R)
    tl.store(RF_OUT + (bh * R + rows[:, None] - 1) * M + feats[None, :], window_f, mask=moved & (feats[None, :] < M))
    tl.store(RV_OUT + (bh * R + rows[:, None] - 1) * (DV + 1) + cols_e[None, :], window_v,
             mask=moved & (cols_e[None, :] < DV + 1))
