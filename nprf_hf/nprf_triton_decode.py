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
    HAS_MASK: tl.constexpr, HAS_RING: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr,
    BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
):
    """One decode step of one (sequence, head): the new query attends the window (the ring's R = W - 1 keys, oldest
    first, then the new key) with c by distance, and the far state [S | z] with c_far = C[h, R + 1]; the window's
    oldest key then joins the far state and the ring moves on by one. State [B, H, ...] contiguous fp32, values
    with their ones column (DV <= BV values, then the ones); O [B, H, 1, DV]. The ring is read and moved BR rows at
    a time, and the ones column apart from the values: the whole window in registers (128 x 128 tiles) spilled."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    cols_d, cols_v, feats = tl.arange(0, BD), tl.arange(0, BV), tl.arange(0, BM)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD, 0)
    q = tl.load(Q + b * stride_qb + h * stride_qh + cols_d * stride_qd, mask=cols_d < D, other=0.0).to(tl.float32)
    k = tl.load(K + b * stride_kb + h * stride_kh + cols_d * stride_kd, mask=cols_d < D, other=0.0).to(tl.float32)
    phi_q = _row_features(q, w, root, M, log_m_half, EPS)
    phi_k = _row_features(k, w, root, M, log_m_half, EPS)
    if HAS_MASK:
        phi_k = phi_k * (tl.load(MASK + b) != 0).to(tl.float32)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols_v * stride_vd, mask=cols_v < DV, other=0.0).to(tl.float32)
    c_row, e = C + h * (R + 2), DV + 1
    # the new key (distance 0) and the far state, with c_far
    weight = tl.sum(phi_q * phi_k, axis=0) * tl.load(c_row)
    has_v = (feats[:, None] < M) & (cols_v[None, :] < DV)
    state = tl.load(S + (bh * M + feats[:, None]) * e + cols_v[None, :], mask=has_v, other=0.0)
    z = tl.load(S + (bh * M + feats) * e + DV, mask=feats < M, other=0.0)
    c_far = tl.load(c_row + R + 1)
    numerator = weight * v + c_far * tl.sum(phi_q[:, None] * state, axis=0)
    denominator = weight + c_far * tl.sum(phi_q * z, axis=0)
    # the window key that leaves the band for good (the ring's oldest, or the new key without a ring): into [S | z]
    oldest_f, oldest_v, oldest_one = phi_k, v, 1.0
    if HAS_RING:
        oldest_f = tl.load(RF + bh * R * M + feats, mask=feats < M, other=0.0)
        oldest_v = tl.load(RV + bh * R * e + cols_v, mask=cols_v < DV, other=0.0)
        oldest_one = tl.load(RV + bh * R * e + DV)
    tl.store(S_OUT + (bh * M + feats[:, None]) * e + cols_v[None, :], state + oldest_f[:, None] * oldest_v[None, :],
             mask=has_v)
    tl.store(S_OUT + (bh * M + feats) * e + DV, z + oldest_f * oldest_one, mask=feats < M)
    for start in range(0, R, BR):  # the ring, oldest first: ring row r is at distance R - r, and moves to r - 1
        rows = start + tl.arange(0, BR)
        ring = rows[:, None] < R
        f = tl.load(RF + (bh * R + rows[:, None]) * M + feats[None, :], mask=ring & (feats[None, :] < M), other=0.0)
        at_v = RV + (bh * R + rows[:, None]) * e + cols_v[None, :]
        values = tl.load(at_v, mask=ring & (cols_v[None, :] < DV), other=0.0)
        ones = tl.load(RV + (bh * R + rows) * e + DV, mask=rows < R, other=0.0)
        weights = tl.sum(f * phi_q[None, :], axis=1) * tl.load(c_row + R - rows, mask=rows < R, other=0.0)
        numerator += tl.sum(weights[:, None] * values, axis=0)
        denominator += tl.sum(weights * ones, axis=0)
        moved = ring & (rows[:, None] >= 1)
        tl.store(RF_OUT + (bh * R + rows[:, None] - 1) * M + feats[None, :], f, mask=moved & (feats[None, :] < M))
        tl.store(RV_OUT + (bh * R + rows[:, None] - 1) * e + cols_v[None, :], values,
                 mask=moved & (cols_v[None, :] < DV))
        tl.store(RV_OUT + (bh * R + rows - 1) * e + DV, ones, mask=(rows < R) & (rows >= 1))
    if HAS_RING:  # the new key joins the ring last
        tl.store(RF_OUT + (bh * R + R - 1) * M + feats, phi_k, mask=feats < M)
        tl.store(RV_OUT + (bh * R + R - 1) * e + cols_v, v, mask=cols_v < DV)
        tl.store(RV_OUT + (bh * R + R - 1) * e + DV, 1.0)
    out = tl.where(denominator > 0, numerator / tl.where(denominator > 0, denominator, 1.0), 0.0)
    tl.store(O + bh * DV + cols_v, out.to(O.dtype.element_ty), mask=cols_v < DV)
