# coding=utf-8
"""The backward kernels of the banded NPRF product (`nprf_triton` launches them; the shared pieces are in
`nprf_triton_kernels`, with the forward's).

With g_i = dz_i / den_i and delta_i = -g_i . z_i (the gradient of the product's weights is dA_ij = g_i . v_j +
delta_i): dphi_q reads the forward's key states, dphi_k and dv read the same kind of states built from (phi_q, g,
delta), and the bias gets dA_ij phi_q . phi_k per pair (the far blocks' sum goes to the outermost entry of each
direction, r = +-(n - 1), exact for a bias tied beyond W). phi_q and phi_k are the features forward stored: the
band tiles load them, and each program turns its rows' dphi (band + far, summed) into dq or dk once, at its end.
query_grad's band loops carry one accumulator each (dphi_q, then the bias's per-pair sums: together they spilled
registers on sm_90); key_grad's one loop carries dv and dphi_k, which fit now that no tile recomputes features.
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only `nprf_triton` imports this file, after checking that Triton imports
    raise ImportError("the Triton kernels of nprf-hf need the `triton` package: pip install triton") from error

from .nprf_triton_kernels import _band_tile, _bias_shift, _blocks, _dot, _input_grad, _load_features, _load_rows
from .nprf_triton_kernels import _key_side, _normalized, _operand, _projection, _store_block

HAS_GATHER = hasattr(tl, "gather")  # (Triton 3.2+) what `_add_diagonals` needs


@triton.jit
def _query_block(FQ, G, DELTA, bh, rows, N, DV, M, HALF: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr):
    """A block of queries in backward: (phi_q [BT, BM] (stored by forward) and g [BT, BV] as dot operands, delta
    [BT]), zeros past the end."""
    phi = _load_features(FQ, bh, rows, N, M, HALF, BM)
    g = _load_rows(G + bh * N * DV, rows, N, tl.arange(0, BV), DV, DV, 1)
    delta = tl.load(DELTA + bh * N + rows, mask=rows < N, other=0.0)
    return phi, _operand(g, HALF), delta


@triton.jit
def _rows_grad(X, F, W, ROOT, b, h, bh, rows, stride_b, stride_h, stride_n, stride_d, dphi, N, D, M, DX,
               W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr):
    """Stores dx [BT, BD] of rows of X from dphi through `_features`, with their stored features F (fp32 from here
    on) and the projection read only now (neither is live through the band loops); returns d root summed over the
    rows."""
    cols = tl.arange(0, BD)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD, HALF)
    y, inverse = _normalized(_load_rows(X + b * stride_b + h * stride_h, rows, N, cols, D, stride_n, stride_d), root,
                             EPS)
    phi = _load_features(F, bh, rows, N, M, 0, BM).to(tl.float32)
    dx, droot = _input_grad(dphi, phi, y, inverse, w, root, HALF)
    tl.store(DX + (bh * N + rows[:, None]) * D + cols[None, :], dx, mask=(rows[:, None] < N) & (cols[None, :] < D))
    return droot


@triton.jit
def _query_tile(FQ, G, DELTA, C, shift, h, bh, rows_k, keep, query_block, N, DV, M, CAUSAL: tl.constexpr,
                HALF: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr):
    """One query block of a key block's band (backward): (phi_q [BT, BM] and g [BT, BV] as dot operands, delta [BT],
    c_{j-i} [BT k, BT q], keys down the rows, zeros where a key is padded or (causal) after the query)."""
    rows_q = query_block * BT + tl.arange(0, BT)
    phi_q, g, delta = _query_block(FQ, G, DELTA, bh, rows_q, N, DV, M, HALF, BV, BM)
    relative = rows_k[:, None] - rows_q[None, :]
    valid = keep[:, None] & (rows_q[None, :] < N)
    if CAUSAL:
        valid = valid & (relative <= 0)
    c = tl.exp(tl.load(C + h * (2 * N - 1) + relative + N - 1, mask=valid, other=float("-inf")) - shift)
    return phi_q, g, delta, c


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
def _batch_sum(DC, h, block, N, H, B, BT: tl.constexpr):
    """Entries block * 2 BT .. + 2 BT - 1 of head h's bias gradient summed over the batch's rows DC [B*H, 2N - 1]
    into the first sequence's row (the gradient returned: no torch sum over the batch after the kernels)."""
    at = block * 2 * BT + tl.arange(0, 2 * BT)
    inside = at < 2 * N - 1
    total = tl.load(DC + h * (2 * N - 1) + at, mask=inside, other=0.0)
    for b in range(1, B):
        total += tl.load(DC + (b * H + h) * (2 * N - 1) + at, mask=inside, other=0.0)
    tl.store(DC + h * (2 * N - 1) + at, total, mask=inside)


@triton.jit
def nprf_query_states_kernel(
    FQ, DO, O, DEN, G, DELTA, S, DC, DROOT,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, D, DV, M, NC, SPLIT, log_m_half,
    NEED_DC: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per split of SPLIT query blocks, in order (backward): g = dz / den and delta = -g . z from DO (strided) and
    forward's O, DEN, stored to G [B, H, N, DV], DELTA [B, H, N] (fp32, for the gradient kernels), and
    S = [phi_q^T g | phi_q^T delta] (phi_q as forward stored it, FQ) summed since the split's start (as
    `nprf_key_states_kernel`'s). It also zeroes what the gradient kernels add to atomically, launched after it:
    DROOT [H] and (NEED_DC) the bias gradient's rows DC [B*H, 2N - 1], 2 BT entries a block (no fill launched
    before)."""
    split, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    tl.store(DROOT + bh, 0.0, mask=(split == 0) & (bh < H))
    cols_v = tl.arange(0, BV)
    states, sums = tl.zeros([BM, BV], dtype=tl.float32), tl.zeros([BM], dtype=tl.float32)
    for block in range(split * SPLIT, tl.minimum(split * SPLIT + SPLIT, NC)):
        if NEED_DC:
            at = block * 2 * BT + tl.arange(0, 2 * BT)
            tl.store(DC + bh * (2 * N - 1) + at, tl.zeros([2 * BT], dtype=tl.float32), mask=at < 2 * N - 1)
        rows = block * BT + tl.arange(0, BT)
        phi = _load_features(FQ, bh, rows, N, M, HALF, BM)
        den = tl.load(DEN + bh * N + rows, mask=rows < N, other=0.0)
        dz = _load_rows(DO + b * stride_ob + h * stride_oh, rows, N, cols_v, DV, stride_on, stride_od)
        g = tl.where(den[:, None] > 0, dz / tl.where(den > 0, den, 1.0)[:, None], 0.0)  # no key: z = 0 whatever dz
        delta = -tl.sum(g * _load_rows(O + bh * N * DV, rows, N, cols_v, DV, DV, 1), axis=1)
        tl.store(G + (bh * N + rows[:, None]) * DV + cols_v[None, :], g,
                 mask=(rows[:, None] < N) & (cols_v[None, :] < DV))
        tl.store(DELTA + bh * N + rows, delta, mask=rows < N)
        states += _dot(tl.trans(phi), g, HALF)
        sums += tl.sum(phi.to(tl.float32) * delta[:, None], axis=0)
        _store_block(S, bh, block, NC, states, sums, BM, BV)


@triton.jit
def nprf_query_grad_kernel(
    Q, V, W, MASK, ROOT, C, P, FQ, FK, G, DELTA, DQ, DC, DROOT,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, SPLIT, REACH, log_m_half,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    NEED_DC: tl.constexpr, DIAGONALS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    BM: tl.constexpr,
):
    """Per query block: dphi_q (far + band, from the stored key features FK), then dq (through phi_q and the
    normalization), the bias's gradient (atomically: in the band per pair, or with DIAGONALS per diagonal of each
    tile; per direction for the far blocks) and the logit scale's (d root, atomically per head)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows_q = block * BT + tl.arange(0, BT)
    phi_q, g, delta = _query_block(FQ, G, DELTA, bh, rows_q, N, DV, M, HALF, BV, BM)
    c_row = C + h * (2 * N - 1)
    shift = _bias_shift(c_row, N, REACH, BT)
    dc_row = DC + bh * (2 * N - 1)  # a row per sequence: the batch's atomics do not contend
    lo = tl.maximum(block - REACH, 0)
    hi = tl.minimum(block + REACH, NC - 1)
    if CAUSAL:
        hi = block
    # far: dphi_q = c (S g + Z delta), and dc = sum_i phi_q . (S g + Z delta)
    before, before_sum = _blocks(P, bh, 0, lo, NC, SPLIT, BM, BV)
    far = _dot(g, tl.trans(before), HALF) + delta[:, None] * before_sum[None, :]
    c_before = tl.exp(tl.load(c_row) - shift)
    dphi = c_before * far
    if NEED_DC:
        tl.atomic_add(dc_row, c_before * tl.sum(tl.sum(phi_q.to(tl.float32) * far, axis=1), axis=0))
    if not CAUSAL:
        after, after_sum = _blocks(P, bh, hi + 1, NC, NC, SPLIT, BM, BV)
        far = _dot(g, tl.trans(after), HALF) + delta[:, None] * after_sum[None, :]
        c_after = tl.exp(tl.load(c_row + 2 * N - 2) - shift)
        dphi += c_after * far
        if NEED_DC:
            tl.atomic_add(dc_row + 2 * N - 2, c_after * tl.sum(tl.sum(phi_q.to(tl.float32) * far, axis=1), axis=0))
    for key_block in range(lo, hi + 1):
        # (padded keys' stored features are zero: so is their term, without the mask read here)
        phi_k, v, c, _, _ = _band_tile(FK, V, C, shift, MASK, b, h, bh, rows_q, key_block, stride_vb, stride_vh,
                                       stride_vn, stride_vd, stride_mb, N, DV, M, CAUSAL, False, HALF, BT, BV, BM)
        dphi += _dot((_dot(g, tl.trans(v), HALF) + delta[:, None]) * c, phi_k, HALF)
    droot = _rows_grad(Q, FQ, W, ROOT, b, h, bh, rows_q, stride_qb, stride_qh, stride_qn, stride_qd, dphi, N, D, M, DQ,
                       W_PER_HEAD, EPS, HALF, BD, BM)
    tl.atomic_add(DROOT + h, droot)
    # the band's bias gradient in a loop of its own, after dq is stored: its per-pair addresses and the
    # accumulator live together spilled registers (phi_q, g and delta read again, not kept through dq's conversion)
    if NEED_DC:
        phi_q, g, delta = _query_block(FQ, G, DELTA, bh, rows_q, N, DV, M, HALF, BV, BM)
        for key_block in range(lo, hi + 1):
            phi_k, v, c, relative, valid = _band_tile(
                FK, V, C, shift, MASK, b, h, bh, rows_q, key_block, stride_vb, stride_vh, stride_vn, stride_vd,
                stride_mb, N, DV, M, CAUSAL, HAS_MASK, HALF, BT, BV, BM)
            weights = _dot(phi_q, tl.trans(phi_k), HALF) * c
            pair = (_dot(g, tl.trans(v), HALF) + delta[:, None]) * weights
            if DIAGONALS:
                _add_diagonals(dc_row, tl.where(valid, pair, 0.0), (key_block - block) * BT, N, BT)
            else:
                tl.atomic_add(dc_row + relative + N - 1, pair, mask=valid)


@triton.jit
def nprf_key_grad_kernel(
    K, V, W, MASK, ROOT, C, QP, FQ, FK, G, DELTA, DK, DV_OUT, DROOT, DC,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, SPLIT, REACH, log_m_half,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    NEED_DC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per key block: dv and dphi_k (far + band, from the query states QP (prefix sums of
    `nprf_query_states_kernel`) and the stored query features FQ), then dk (through phi_k and the normalization) and
    d root (atomically per head); with NEED_DC, the first sequence's programs also sum the bias gradient's rows DC
    over the batch (`nprf_query_grad_kernel`, launched before, has finished them)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    if NEED_DC:
        if b == 0:
            _batch_sum(DC, h, block, N, H, tl.num_programs(1) // H, BT)
    rows_k = block * BT + tl.arange(0, BT)
    cols_v = tl.arange(0, BV)
    keep, phi_k, v = _key_side(FK, V, MASK, b, h, bh, rows_k, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
                               N, DV, M, HAS_MASK, HALF, BV, BM)
    c_row = C + h * (2 * N - 1)
    shift = _bias_shift(c_row, N, REACH, BT)
    lo = tl.maximum(block - REACH, 0)
    if CAUSAL:
        lo = block
    hi = tl.minimum(block + REACH, NC - 1)
    # far queries after the band read these keys with c_{-(n-1)}: dv = c S^T phi_k, dphi_k = c (S v + Z)
    c_before, c_after = tl.exp(tl.load(c_row) - shift), tl.exp(tl.load(c_row + 2 * N - 2) - shift)
    after, after_sum = _blocks(QP, bh, hi + 1, NC, NC, SPLIT, BM, BV)
    dv = c_before * _dot(phi_k, after, HALF)
    dphi = c_before * (_dot(v, tl.trans(after), HALF) + after_sum[None, :])
    if not CAUSAL:  # far queries before the band, with c_{n-1}
        before, before_sum = _blocks(QP, bh, 0, lo, NC, SPLIT, BM, BV)
        dv += c_after * _dot(phi_k, before, HALF)
        dphi += c_after * (_dot(v, tl.trans(before), HALF) + before_sum[None, :])
    # one loop for both (each query tile read once): with the features loaded, not recomputed, the two accumulators
    # fit sm_90's registers (two loops were needed before)
    for query_block in range(lo, hi + 1):
        phi_q, g, delta, c = _query_tile(FQ, G, DELTA, C, shift, h, bh, rows_k, keep, query_block, N, DV, M, CAUSAL,
                                         HALF, BT, BV, BM)
        dv += _dot(_dot(phi_k, tl.trans(phi_q), HALF) * c, g, HALF)
        dphi += _dot((_dot(v, tl.trans(g), HALF) + delta[None, :]) * c, phi_q, HALF)
    tl.store(DV_OUT + (bh * N + rows_k[:, None]) * DV + cols_v[None, :], dv,
             mask=(rows_k[:, None] < N) & (cols_v[None, :] < DV))
    dphi = tl.where(keep[:, None], dphi, 0.0)
    droot = _rows_grad(K, FK, W, ROOT, b, h, bh, rows_k, stride_kb, stride_kh, stride_kn, stride_kd, dphi, N, D, M, DK,
                       W_PER_HEAD, EPS, HALF, BD, BM)
    tl.atomic_add(DROOT + h, droot)
