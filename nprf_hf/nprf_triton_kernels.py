# coding=utf-8
"""Triton kernels of the banded NPRF product (`nprf_triton` launches them and holds their autograd Function).

Per (sequence, head) and block of BT rows. T5 buckets make b_r constant for |r| >= W, so for a query block the
keys split into the REACH = ceil((W - 1) / BT) key blocks on either side of it (the band: weights
c_{j-i} phi_q . phi_k computed exactly, tile by tile, with c read per pair) and every block beyond them (far:
one constant c per direction, so a linear attention read from prefix sums of per-block states
S = sum_j phi_k [v, 1]^T: one cumsum of [B*H, NC, BM * (BV + 1)], per block [BM, BV] states then [BM] sums). phi is
computed in the kernels from q, k and the projection and recomputed in backward; no [n, m] feature tensor is stored.

Backward, with g_i = dz_i / den_i and delta_i = -g_i . z_i (the gradient of the product's weights is
dA_ij = g_i . v_j + delta_i): dphi_q reads the forward's key states, dphi_k and dv read the same kind of states
built from (phi_q, g, delta), and the bias gets dA_ij phi_q . phi_k per pair (the far blocks' sum goes to the
outermost entry of each direction, r = +-(n - 1), exact for a bias tied beyond W).
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only `nprf_triton` imports this file, after checking that Triton imports
    raise ImportError("the Triton kernels of nprf-hf need the `triton` package: pip install triton") from error

HAS_GATHER = hasattr(tl, "gather")  # (Triton 3.2+) what `_add_diagonals` needs


@triton.jit
def _dot(a, b, HALF: tl.constexpr):
    """a @ b with fp32 accumulation: HALF = 1, bf16 operands on tensor cores (half inputs); 2, fp16 operands (the
    same under Triton's interpreter, whose bf16 dot is wrong); 3, TF32 operands (fp32 inputs where torch allows TF32
    matmuls); 0, full fp32."""
    if HALF == 3:
        return tl.dot(a, b, input_precision="tf32")
    if HALF == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    if HALF == 2:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_rows(ptr, rows, n, cols, width, stride_n, stride_d):
    """[BT, BD] fp32 rows of a [n, width] matrix, zeros outside."""
    mask = (rows[:, None] < n) & (cols[None, :] < width)
    return tl.load(ptr + rows[:, None] * stride_n + cols[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _features(x, w, root, m, log_m_half, EPS: tl.constexpr, HALF: tl.constexpr):
    """phi(y) = exp(W y - |y|^2 / 2) / sqrt(m) of y = root x / max(|x|, EPS) for x [BT, BD], w [BM, BD];
    returns (phi [BT, BM] with the columns >= m zeroed, y, x's inverse norm)."""
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    inverse = root / tl.maximum(norm, EPS)
    y = x * inverse[:, None]
    shift = 0.5 * tl.sum(y * y, axis=1) + log_m_half
    wy = _dot(y, tl.trans(w), HALF)
    features = tl.arange(0, w.shape[0])
    phi = tl.where(features[None, :] < m, tl.exp(wy - shift[:, None]), 0.0)
    return phi, y, inverse


@triton.jit
def _input_grad(dphi, phi, y, inverse, w, root, HALF: tl.constexpr):
    """(dx [BT, BD], d root summed over the rows) from dphi [BT, BM] through `_features`."""
    e = dphi * phi
    dy = _dot(e, w, HALF) - y * tl.sum(e, axis=1)[:, None]
    u = y / root  # x / max(|x|, EPS)
    droot = tl.sum(tl.sum(dy * u, axis=1), axis=0)
    # y / root is a unit vector where |x| > EPS (the radial part of dy has no effect there), x / EPS below
    unit = tl.sum(u * u, axis=1) > 0.5
    radial = tl.where(unit, tl.sum(u * dy, axis=1), 0.0)
    dx = (dy - u * radial[:, None]) * inverse[:, None]
    return dx, droot


@triton.jit
def _projection(W, ROOT, h, M, D, W_PER_HEAD: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """Head h's projection [BM, BD] (zero rows and columns beyond m, d) and its feature scale sqrt(s)."""
    feats, cols = tl.arange(0, BM), tl.arange(0, BD)
    w = tl.load(W + W_PER_HEAD * h * M * D + feats[:, None] * D + cols[None, :],
                mask=(feats[:, None] < M) & (cols[None, :] < D), other=0.0).to(tl.float32)
    return w, tl.load(ROOT + h)


@triton.jit
def _blocks(P, bh, lo, hi, NC, BM: tl.constexpr, BV: tl.constexpr):
    """Blocks lo .. hi - 1 of sequence bh summed, from the inclusive prefix sums P [B*H, NC, BM * (BV + 1)] (the
    cumsum of a states kernel's output, no zero row): (states [BM, BV], sums [BM])."""
    feats, row = tl.arange(0, BM), BM * (BV + 1)
    at = P + bh * NC * row + feats[:, None] * BV + tl.arange(0, BV)[None, :]
    has_hi, has_lo = feats >= BM * (1 - hi), feats >= BM * (1 - lo)  # all or none: hi > 0, lo > 0 as [BM] masks
    states = (tl.load(at + (hi - 1) * row, mask=has_hi[:, None], other=0.0)
              - tl.load(at + (lo - 1) * row, mask=has_lo[:, None], other=0.0))
    at = P + bh * NC * row + BM * BV + feats
    sums = tl.load(at + (hi - 1) * row, mask=has_hi, other=0.0) - tl.load(at + (lo - 1) * row, mask=has_lo, other=0.0)
    return states, sums


@triton.jit
def _store_block(S, bh, block, NC, states, sums, BM: tl.constexpr, BV: tl.constexpr):
    """Block `block` of sequence bh's row of S [B*H, NC, BM * (BV + 1)] (what `_blocks` reads once summed): its
    states [BM, BV], then its sums [BM]."""
    feats, row = tl.arange(0, BM), S + (bh * NC + block) * (BM * (BV + 1))
    tl.store(row + feats[:, None] * BV + tl.arange(0, BV)[None, :], states)
    tl.store(row + BM * BV + feats, sums)


@triton.jit
def _band_tile(K, V, C, MASK, b, h, rows_q, key_block, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb,
               stride_vh, stride_vn, stride_vd, stride_mb, w, root, N, D, DV, M, log_m_half, CAUSAL: tl.constexpr,
               HAS_MASK: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
               BV: tl.constexpr):
    """One key block of a query block's band: (phi_k [BT, BM], v [BT, BV], c_{j-i} [BT q, BT k] with zeros where a
    key is padded, past the end or (causal) after the query, and that mask)."""
    rows_k = key_block * BT + tl.arange(0, BT)
    k = _load_rows(K + b * stride_kb + h * stride_kh, rows_k, N, tl.arange(0, BD), D, stride_kn, stride_kd)
    phi_k, _, _ = _features(k, w, root, M, log_m_half, EPS, HALF)
    v = _load_rows(V + b * stride_vb + h * stride_vh, rows_k, N, tl.arange(0, BV), DV, stride_vn, stride_vd)
    relative = rows_k[None, :] - rows_q[:, None]
    valid = (rows_q[:, None] < N) & (rows_k[None, :] < N)
    if HAS_MASK:
        valid = valid & (tl.load(MASK + b * stride_mb + rows_k, mask=rows_k < N, other=0) != 0)[None, :]
    if CAUSAL:
        valid = valid & (relative <= 0)
    c = tl.load(C + h * (2 * N - 1) + relative + N - 1, mask=valid, other=0.0)
    return phi_k, v, c, relative, valid


@triton.jit
def _key_block(K, V, MASK, b, h, rows, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
               stride_vd, stride_mb, w, root, N, D, DV, M, log_m_half, HAS_MASK: tl.constexpr, EPS: tl.constexpr,
               HALF: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr):
    """A block of keys: (phi_k [BT, BM], zero for padded keys and past the end, y and the inverse norm for its
    backward, v [BT, BV], which rows are kept)."""
    k = _load_rows(K + b * stride_kb + h * stride_kh, rows, N, tl.arange(0, BD), D, stride_kn, stride_kd)
    keep = rows < N
    if HAS_MASK:
        keep = keep & (tl.load(MASK + b * stride_mb + rows, mask=rows < N, other=0) != 0)
    phi, y, inverse = _features(k, w, root, M, log_m_half, EPS, HALF)
    v = _load_rows(V + b * stride_vb + h * stride_vh, rows, N, tl.arange(0, BV), DV, stride_vn, stride_vd)
    return tl.where(keep[:, None], phi, 0.0), y, inverse, v, keep


@triton.jit
def _query_block(Q, G, DELTA, b, h, bh, rows, stride_qb, stride_qh, stride_qn, stride_qd, w, root, N, D, DV, M,
                 log_m_half, EPS: tl.constexpr, HALF: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr):
    """A block of queries in backward: (phi_q [BT, BM], y and the inverse norm for its backward, g [BT, BV] and
    delta [BT], zeros past the end)."""
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, N, tl.arange(0, BD), D, stride_qn, stride_qd)
    phi, y, inverse = _features(q, w, root, M, log_m_half, EPS, HALF)
    g = _load_rows(G + bh * N * DV, rows, N, tl.arange(0, BV), DV, DV, 1)
    delta = tl.load(DELTA + bh * N + rows, mask=rows < N, other=0.0)
    return phi, y, inverse, g, delta


@triton.jit
def _add_diagonals(DC_ROW, pair, offset, N, BT: tl.constexpr):
    """DC_ROW[r + N - 1] += the sum of pair [BT q, BT k] over its entries (i, j) at r = offset + j - i: the tile's
    2 BT - 1 diagonal sums, each row's entries gathered into its diagonals' columns, then one atomic add per diagonal
    (pair by pair, the BT atomics of a diagonal queue on one address)."""
    t = tl.arange(0, 2 * BT)
    j = tl.arange(0, BT)[:, None] + t[None, :] - (BT - 1)  # the key column of row i on diagonal t
    inside = (j >= 0) & (j < BT)
    sums = tl.sum(tl.where(inside, tl.gather(pair, tl.where(inside, j, 0), axis=1), 0.0), axis=0)
    r = offset + t - (BT - 1)
    tl.atomic_add(DC_ROW + r + N - 1, sums, mask=(t < 2 * BT - 1) & (r > -N) & (r < N))


@triton.jit
def nprf_key_states_kernel(
    K, V, W, MASK, ROOT, S,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, log_m_half,
    HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per key block: S = [phi_k^T v [BM, BV] | sum_j phi_k [BM]] (padded keys count in neither)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = block * BT + tl.arange(0, BT)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD)
    phi, _, _, v, _ = _key_block(K, V, MASK, b, h, rows, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb,
                                 stride_vh, stride_vn, stride_vd, stride_mb, w, root, N, D, DV, M, log_m_half,
                                 HAS_MASK, EPS, HALF, BD, BV)
    _store_block(S, bh, block, NC, _dot(tl.trans(phi), v, HALF), tl.sum(phi, axis=0), BM, BV)


@triton.jit
def nprf_forward_kernel(
    Q, K, V, W, MASK, ROOT, C, P, O, DEN,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, REACH, log_m_half,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per query block: z = (far states + band tiles) / their denominator; O [B, H, N, DV], DEN [B, H, N]."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows_q = block * BT + tl.arange(0, BT)
    cols_d, cols_v = tl.arange(0, BD), tl.arange(0, BV)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows_q, N, cols_d, D, stride_qn, stride_qd)
    phi_q, _, _ = _features(q, w, root, M, log_m_half, EPS, HALF)
    c_row = C + h * (2 * N - 1)
    lo = tl.maximum(block - REACH, 0)
    hi = tl.minimum(block + REACH, NC - 1)
    if CAUSAL:  # (a statement, not a conditional expression: the form every Triton version compiles)
        hi = block
    # far keys before the band: the prefix of the blocks before `lo`, weight c_{-(n-1)}
    c_before = tl.load(c_row)
    before, before_sum = _blocks(P, bh, 0, lo, NC, BM, BV)
    numerator = c_before * _dot(phi_q, before, HALF)
    denominator = c_before * tl.sum(phi_q * before_sum[None, :], axis=1)
    if not CAUSAL:  # far keys after the band: the total minus the prefix through `hi`, weight c_{n-1}
        c_after = tl.load(c_row + 2 * N - 2)
        after, after_sum = _blocks(P, bh, hi + 1, NC, NC, BM, BV)
        numerator += c_after * _dot(phi_q, after, HALF)
        denominator += c_after * tl.sum(phi_q * after_sum[None, :], axis=1)
    for key_block in range(lo, hi + 1):
        phi_k, v, c, relative, valid = _band_tile(
            K, V, C, MASK, b, h, rows_q, key_block, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
            stride_vn, stride_vd, stride_mb, w, root, N, D, DV, M, log_m_half, CAUSAL, HAS_MASK, EPS, HALF, BT, BD, BV)
        weights = _dot(phi_q, tl.trans(phi_k), HALF) * c
        numerator += _dot(weights, v, HALF)
        denominator += tl.sum(weights, axis=1)
    kept = denominator > 0  # a query with no key gets zeros (and no division by 0)
    out = tl.where(kept[:, None], numerator / tl.where(kept, denominator, 1.0)[:, None], 0.0)
    tl.store(O + (bh * N + rows_q[:, None]) * DV + cols_v[None, :], out.to(O.dtype.element_ty),
             mask=(rows_q[:, None] < N) & (cols_v[None, :] < DV))
    tl.store(DEN + bh * N + rows_q, denominator, mask=rows_q < N)


@triton.jit
def nprf_query_states_kernel(
    Q, DO, O, DEN, G, DELTA, W, ROOT, S,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_ob, stride_oh, stride_on, stride_od,
    H, N, D, DV, M, NC, log_m_half,
    W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per query block (backward): g = dz / den and delta = -g . z from DO (strided) and forward's O, DEN, stored
    to G [B, H, N, DV], DELTA [B, H, N] (fp32, for the gradient kernels), and S = [phi_q^T g | phi_q^T delta]."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = block * BT + tl.arange(0, BT)
    cols_d, cols_v = tl.arange(0, BD), tl.arange(0, BV)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, N, cols_d, D, stride_qn, stride_qd)
    phi, _, _ = _features(q, w, root, M, log_m_half, EPS, HALF)
    den = tl.load(DEN + bh * N + rows, mask=rows < N, other=0.0)
    dz = _load_rows(DO + b * stride_ob + h * stride_oh, rows, N, cols_v, DV, stride_on, stride_od)
    g = tl.where(den[:, None] > 0, dz / tl.where(den > 0, den, 1.0)[:, None], 0.0)  # no key: z = 0 whatever dz
    delta = -tl.sum(g * _load_rows(O + bh * N * DV, rows, N, cols_v, DV, DV, 1), axis=1)
    tl.store(G + (bh * N + rows[:, None]) * DV + cols_v[None, :], g, mask=(rows[:, None] < N) & (cols_v[None, :] < DV))
    tl.store(DELTA + bh * N + rows, delta, mask=rows < N)
    _store_block(S, bh, block, NC, _dot(tl.trans(phi), g, HALF), tl.sum(phi * delta[:, None], axis=0), BM, BV)


@triton.jit
def nprf_query_grad_kernel(
    Q, K, V, W, MASK, ROOT, C, P, G, DELTA, DQ, DC, DROOT,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, REACH, log_m_half,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    NEED_DC: tl.constexpr, DIAGONALS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    BM: tl.constexpr,
):
    """Per query block: dq (through phi_q and the normalization), the bias's gradient (atomically: in the band per
    pair, or with DIAGONALS per diagonal of each tile; per direction for the far blocks) and the logit scale's
    (d root, atomically per head)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows_q, cols_d = block * BT + tl.arange(0, BT), tl.arange(0, BD)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD)
    phi_q, y, inverse, g, delta = _query_block(Q, G, DELTA, b, h, bh, rows_q, stride_qb, stride_qh, stride_qn,
                                               stride_qd, w, root, N, D, DV, M, log_m_half, EPS, HALF, BD, BV)
    c_row = C + h * (2 * N - 1)
    dc_row = DC + bh * (2 * N - 1)  # a row per sequence: the batch's atomics do not contend
    lo = tl.maximum(block - REACH, 0)
    hi = tl.minimum(block + REACH, NC - 1)
    if CAUSAL:
        hi = block
    # far: dphi_q = c (S g + Z delta), and dc = sum_i phi_q . (S g + Z delta)
    before, before_sum = _blocks(P, bh, 0, lo, NC, BM, BV)
    far = _dot(g, tl.trans(before), HALF) + delta[:, None] * before_sum[None, :]
    c_before = tl.load(c_row)
    dphi = c_before * far
    if NEED_DC:
        tl.atomic_add(dc_row, tl.sum(tl.sum(phi_q * far, axis=1), axis=0))
    if not CAUSAL:
        after, after_sum = _blocks(P, bh, hi + 1, NC, NC, BM, BV)
        far = _dot(g, tl.trans(after), HALF) + delta[:, None] * after_sum[None, :]
        dphi += tl.load(c_row + 2 * N - 2) * far
        if NEED_DC:
            tl.atomic_add(dc_row + 2 * N - 2, tl.sum(tl.sum(phi_q * far, axis=1), axis=0))
    for key_block in range(lo, hi + 1):
        phi_k, v, c, relative, valid = _band_tile(
            K, V, C, MASK, b, h, rows_q, key_block, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
            stride_vn, stride_vd, stride_mb, w, root, N, D, DV, M, log_m_half, CAUSAL, HAS_MASK, EPS, HALF, BT, BD, BV)
        d_weights = _dot(g, tl.trans(v), HALF) + delta[:, None]
        dphi += _dot(d_weights * c, phi_k, HALF)
        if NEED_DC:
            pair = d_weights * _dot(phi_q, tl.trans(phi_k), HALF)
            if DIAGONALS:
                _add_diagonals(dc_row, tl.where(valid, pair, 0.0), (key_block - block) * BT, N, BT)
            else:
                tl.atomic_add(dc_row + relative + N - 1, pair, mask=valid)
    dq, droot = _input_grad(dphi, phi_q, y, inverse, w, root, HALF)
    tl.store(DQ + (bh * N + rows_q[:, None]) * D + cols_d[None, :], dq, mask=(rows_q[:, None] < N) & (cols_d[None, :] < D))
    tl.atomic_add(DROOT + h, droot)


@triton.jit
def nprf_key_grad_kernel(
    Q, K, V, W, MASK, ROOT, C, QP, G, DELTA, DK, DV_OUT, DROOT,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, REACH, log_m_half,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per key block: dk (through phi_k and the normalization), dv, and d root (atomically per head), from the
    query states QP (prefix sums of `nprf_query_states_kernel`) and the band's query blocks."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows_k = block * BT + tl.arange(0, BT)
    cols_d, cols_v = tl.arange(0, BD), tl.arange(0, BV)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD)
    phi_k, y, inverse, v, keep = _key_block(K, V, MASK, b, h, rows_k, stride_kb, stride_kh, stride_kn, stride_kd,
                                            stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, w, root, N, D, DV,
                                            M, log_m_half, HAS_MASK, EPS, HALF, BD, BV)
    c_row = C + h * (2 * N - 1)
    lo = tl.maximum(block - REACH, 0)
    if CAUSAL:
        lo = block
    hi = tl.minimum(block + REACH, NC - 1)
    # far queries after the band read these keys with c_{-(n-1)}: dv = c S^T phi_k, dphi_k = c (S v + Z)
    after, after_sum = _blocks(QP, bh, hi + 1, NC, NC, BM, BV)
    c_before = tl.load(c_row)
    dv = c_before * _dot(phi_k, after, HALF)
    dphi = c_before * (_dot(v, tl.trans(after), HALF) + after_sum[None, :])
    if not CAUSAL:  # far queries before the band, with c_{n-1}
        c_after = tl.load(c_row + 2 * N - 2)
        before, before_sum = _blocks(QP, bh, 0, lo, NC, BM, BV)
        dv += c_after * _dot(phi_k, before, HALF)
        dphi += c_after * (_dot(v, tl.trans(before), HALF) + before_sum[None, :])
    for query_block in range(lo, hi + 1):
        rows_q = query_block * BT + tl.arange(0, BT)
        phi_q, _, _, g, delta = _query_block(Q, G, DELTA, b, h, bh, rows_q, stride_qb, stride_qh, stride_qn,
                                             stride_qd, w, root, N, D, DV, M, log_m_half, EPS, HALF, BD, BV)
        relative = rows_k[:, None] - rows_q[None, :]  # j - i, keys down the rows
        valid = keep[:, None] & (rows_q[None, :] < N)
        if CAUSAL:
            valid = valid & (relative <= 0)
        c = tl.load(c_row + relative + N - 1, mask=valid, other=0.0)
        weights = _dot(phi_k, tl.trans(phi_q), HALF) * c
        dv += _dot(weights, g, HALF)
        d_weights = _dot(v, tl.trans(g), HALF) + delta[None, :]
        dphi += _dot(d_weights * c, phi_q, HALF)
    dphi = tl.where(keep[:, None], dphi, 0.0)
    dk, droot = _input_grad(dphi, phi_k, y, inverse, w, root, HALF)
    tl.store(DK + (bh * N + rows_k[:, None]) * D + cols_d[None, :], dk, mask=(rows_k[:, None] < N) & (cols_d[None, :] < D))
    tl.store(DV_OUT + (bh * N + rows_k[:, None]) * DV + cols_v[None, :], dv,
             mask=(rows_k[:, None] < N) & (cols_v[None, :] < DV))
    tl.atomic_add(DROOT + h, droot)
