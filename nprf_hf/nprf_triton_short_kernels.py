# coding=utf-8
"""Triton kernels of the short path (`nprf_triton_short` launches them): the banded NPRF product for sequences of a
few blocks, where the block states and their scan buy nothing and an eager call is bound by its launches.

Per (sequence, head) and block of BT rows, every query block meets every key block (causal: every key block up to
its own) as one tile: a tile within REACH blocks of the diagonal is in the band and reads c_{j-i} per pair, a tile
beyond it takes its direction's constant c (the bias is tied beyond the band), which is what the banded kernels'
far states sum. Forward is one launch: each program computes its queries' features (stored for backward) and the
features of every key block it meets (a key's are computed once per query block: no program waits for another's);
the program of the diagonal also stores its keys' features, so that backward computes none. Backward is two
launches, the key side (dv, dk) and then the query side (dq, the bias gradient), each computing g = dz / den and
delta = -g . z of the query tiles it reads; the key side zeroes what the query side adds to atomically (the bias and
logit scale gradients) and leaves its programs' d root for it to add: no fill, scan or sum launched around them.
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only `nprf_triton_short` imports this file, after checking that Triton imports
    raise ImportError("the Triton kernels of nprf-hf need the `triton` package: pip install triton") from error

from .nprf_triton_backward import _add_diagonals, _rows_grad
from .nprf_triton_kernels import _bias_shift, _dot, _features, _key_block, _load_features, _load_rows, _operand
from .nprf_triton_kernels import _key_side, _projection, _store_features, _store_output


@triton.jit
def _ends(C_ROW, N, REACH, BT: tl.constexpr):
    """(the shift of c_r = exp(b_r - shift) <= 1 (`_bias_shift`), c_{-(n-1)}, c_{n-1}): the far constants."""
    shift = _bias_shift(C_ROW, N, REACH, BT)
    return shift, tl.exp(tl.load(C_ROW) - shift), tl.exp(tl.load(C_ROW + 2 * N - 2) - shift)


@triton.jit
def _tile_coefficients(C_ROW, shift, relative, valid, band, c_far, N):
    """c_{j-i} of a tile (relative = j - i, in either orientation): read per pair in the band, the constant c_far
    beyond it (no load, no exp); zeros where not `valid`."""
    if band:
        c = tl.exp(tl.load(C_ROW + relative + N - 1, mask=valid, other=float("-inf")) - shift)
    else:
        c = tl.where(valid, c_far, 0.0)
    return c


@triton.jit
def _output_grad(DO, O, DEN, b, h, bh, rows, stride_ob, stride_oh, stride_on, stride_od, N, DV, BV: tl.constexpr):
    """(g = dz / den [BT, BV], delta = -g . z [BT]) of a block of queries, from DO (any strides) and forward's O and
    DEN; zeros past the end and for a query with no key (its z is 0 whatever dz)."""
    cols = tl.arange(0, BV)
    den = tl.load(DEN + bh * N + rows, mask=rows < N, other=0.0)
    dz = _load_rows(DO + b * stride_ob + h * stride_oh, rows, N, cols, DV, stride_on, stride_od)
    g = tl.where(den[:, None] > 0, dz / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    return g, -tl.sum(g * _load_rows(O + bh * N * DV, rows, N, cols, DV, DV, 1), axis=1)


@triton.jit
def _bias_grad(V, C, FQ, FK, DO, O, DEN, DC, b, h, bh, block, rows_q, shift, c_before, c_after, stride_vb, stride_vh,
               stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od, N, DV, M, hi, REACH,
               CAUSAL: tl.constexpr, HALF: tl.constexpr, DIAGONALS: tl.constexpr, BT: tl.constexpr,
               BV: tl.constexpr, BM: tl.constexpr):
    """A query block's share of the bias gradient DC [H, 2N - 1], dA_ij w_ij summed per r = j - i: atomically per
    pair (or per diagonal) in the band's tiles, and per tile beyond it, at its side's outermost entry (r = +-(n - 1),
    as the banded kernels give it). phi_q, g and delta are read again (not kept live through dq's conversion)."""
    c_row, dc_row = C + h * (2 * N - 1), DC + h * (2 * N - 1)
    phi_q = _load_features(FQ, bh, rows_q, N, M, HALF, BM)
    g, delta = _output_grad(DO, O, DEN, b, h, bh, rows_q, stride_ob, stride_oh, stride_on, stride_od, N, DV, BV)
    g = _operand(g, HALF)
    # per-pair atomics take half a key block a step (a whole block's addresses, pairs and weights together spilled
    # registers on sm_90, causal); the diagonal sums (`_add_diagonals`) read a whole block's tile. A far tile's sum
    # is added at once: summed across the loop it spilled too
    KT: tl.constexpr = BT // (2 - DIAGONALS)
    for part in range(0, (hi + 1) * (BT // KT)):
        key_block = part // (BT // KT)
        rows_k = part * KT + tl.arange(0, KT)
        phi_k = _load_features(FK, bh, rows_k, N, M, HALF, BM)
        v = _operand(_load_rows(V + b * stride_vb + h * stride_vh, rows_k, N, tl.arange(0, BV), DV, stride_vn,
                                stride_vd), HALF)
        relative = rows_k[None, :] - rows_q[:, None]
        if CAUSAL:  # (keys up to a query inside the sequence are inside it)
            valid = (rows_q[:, None] < N) & (relative <= 0)
        else:
            valid = (rows_q[:, None] < N) & (rows_k[None, :] < N)
        band = tl.abs(key_block - block) <= REACH
        c = _tile_coefficients(c_row, shift, relative, valid, band, tl.where(key_block < block, c_before, c_after),
                               N)
        weights = _dot(phi_q, tl.trans(phi_k), HALF) * c
        pair = (_dot(g, tl.trans(v), HALF) + delta[:, None]) * weights
        if band:
            if DIAGONALS:
                _add_diagonals(dc_row, pair, (key_block - block) * BT, N, BT)
            else:
                tl.atomic_add(dc_row + relative + N - 1, pair, mask=valid)
        else:  # (pair is zero where not valid: so is c)
            tl.atomic_add(dc_row + tl.where(key_block < block, 0, 2 * N - 2), tl.sum(tl.sum(pair, axis=1), axis=0))


@triton.jit
def nprf_short_forward_kernel(
    Q, K, V, W, MASK, ROOT, C, FQ, FK, O, DEN,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, REACH, log_m_half,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per query block: phi_q, stored to FQ [B, H, N, M], and z = sum over the key blocks of c phi_q . phi_k v / its
    denominator; O [B, H, N, DV], DEN [B, H, N]; the diagonal's key features (padded keys zero) stored to FK."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows_q = block * BT + tl.arange(0, BT)
    cols_v = tl.arange(0, BV)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD, HALF)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows_q, N, tl.arange(0, BD), D, stride_qn, stride_qd)
    phi_q, _q_unit, _q_inverse = _features(q, w, root, M, log_m_half, EPS, HALF)
    _store_features(FQ, bh, rows_q, phi_q, N, M, BM)
    phi_q = _operand(phi_q, HALF)
    c_row = C + h * (2 * N - 1)
    shift, c_before, c_after = _ends(c_row, N, REACH, BT)
    hi = NC - 1
    if CAUSAL:
        hi = block
    numerator = tl.zeros([BT, BV], dtype=tl.float32)
    denominator = tl.zeros([BT], dtype=tl.float32)
    for key_block in range(0, hi + 1):
        rows_k = key_block * BT + tl.arange(0, BT)
        # (names of their own for what is not read: a name bound before the loop would be loop-carried)
        phi_k, _k_unit, _k_inverse, v, _kept = _key_block(
            K, V, MASK, b, h, rows_k, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn,
            stride_vd, stride_mb, w, root, N, D, DV, M, log_m_half, HAS_MASK, EPS, HALF, BD, BV)
        if key_block == block:
            _store_features(FK, bh, rows_k, phi_k, N, M, BM)
        relative = rows_k[None, :] - rows_q[:, None]
        valid = (rows_q[:, None] < N) & (rows_k[None, :] < N)
        if CAUSAL:
            valid = valid & (relative <= 0)
        c = _tile_coefficients(c_row, shift, relative, valid, tl.abs(key_block - block) <= REACH,
                               tl.where(key_block < block, c_before, c_after), N)
        weights = _dot(phi_q, tl.trans(_operand(phi_k, HALF)), HALF) * c
        numerator += _dot(weights, _operand(v, HALF), HALF)
        denominator += tl.sum(weights, axis=1)
    _store_output(O, DEN, bh, rows_q, cols_v, numerator, denominator, N, DV)


@triton.jit
def nprf_short_key_grad_kernel(
    K, V, W, MASK, ROOT, C, FQ, FK, DO, O, DEN, DK, DV_OUT, PART, DROOT, DC,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od, stride_mb,
    H, N, D, DV, M, NC, REACH, log_m_half,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    NEED_DC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per key block: dv and dphi_k over every query block that reads it (the stored features FQ, FK), then dk and
    its d root, stored to PART [B*H, NC] for the query kernel. It zeroes what the query kernel, launched after it,
    adds to: DROOT [H] and (NEED_DC) the bias gradient DC [H, 2N - 1], 2 BT entries a block."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    tl.store(DROOT + bh, 0.0, mask=(block == 0) & (bh < H))
    if NEED_DC:
        if b == 0:
            at = block * 2 * BT + tl.arange(0, 2 * BT)
            tl.store(DC + h * (2 * N - 1) + at, tl.zeros([2 * BT], dtype=tl.float32), mask=at < 2 * N - 1)
    rows_k = block * BT + tl.arange(0, BT)
    cols_v = tl.arange(0, BV)
    keep, phi_k, v = _key_side(FK, V, MASK, b, h, bh, rows_k, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
                               N, DV, M, HAS_MASK, HALF, BV, BM)
    c_row = C + h * (2 * N - 1)
    shift, c_before, c_after = _ends(c_row, N, REACH, BT)
    lo = 0
    if CAUSAL:
        lo = block
    dv = tl.zeros([BT, BV], dtype=tl.float32)
    dphi = tl.zeros([BT, BM], dtype=tl.float32)
    for query_block in range(lo, NC):
        rows_q = query_block * BT + tl.arange(0, BT)
        phi_q = _load_features(FQ, bh, rows_q, N, M, HALF, BM)
        g, delta = _output_grad(DO, O, DEN, b, h, bh, rows_q, stride_ob, stride_oh, stride_on, stride_od, N, DV, BV)
        g = _operand(g, HALF)
        relative = rows_k[:, None] - rows_q[None, :]  # keys down the rows
        valid = keep[:, None] & (rows_q[None, :] < N)
        if CAUSAL:
            valid = valid & (relative <= 0)
        # (queries after these keys read them with c_{-(n-1)})
        c = _tile_coefficients(c_row, shift, relative, valid, tl.abs(query_block - block) <= REACH,
                               tl.where(query_block > block, c_before, c_after), N)
        dv += _dot(_dot(phi_k, tl.trans(phi_q), HALF) * c, g, HALF)
        dphi += _dot((_dot(v, tl.trans(g), HALF) + delta[None, :]) * c, phi_q, HALF)
    tl.store(DV_OUT + (bh * N + rows_k[:, None]) * DV + cols_v[None, :], dv,
             mask=(rows_k[:, None] < N) & (cols_v[None, :] < DV))
    dphi = tl.where(keep[:, None], dphi, 0.0)
    droot = _rows_grad(K, FK, W, ROOT, b, h, bh, rows_k, stride_kb, stride_kh, stride_kn, stride_kd, dphi, N, D, M, DK,
                       W_PER_HEAD, EPS, HALF, BD, BM)
    tl.store(PART + bh * NC + block, droot)


@triton.jit
def nprf_short_query_grad_kernel(
    Q, V, W, ROOT, C, FQ, FK, DO, O, DEN, DQ, PART, DROOT, DC,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, D, DV, M, NC, REACH, log_m_half,
    CAUSAL: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr, NEED_DC: tl.constexpr,
    DIAGONALS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per query block (after the key kernel): dphi_q over every key block it reads, then dq and d root (its own and
    the key kernel's program of the same block, added atomically per head) and (NEED_DC) the bias gradient, in a loop
    of its own (`_bias_grad`)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows_q = block * BT + tl.arange(0, BT)
    phi_q = _load_features(FQ, bh, rows_q, N, M, HALF, BM)
    g, delta = _output_grad(DO, O, DEN, b, h, bh, rows_q, stride_ob, stride_oh, stride_on, stride_od, N, DV, BV)
    g = _operand(g, HALF)
    c_row = C + h * (2 * N - 1)
    shift, c_before, c_after = _ends(c_row, N, REACH, BT)
    hi = NC - 1
    if CAUSAL:
        hi = block
    dphi = tl.zeros([BT, BM], dtype=tl.float32)
    for key_block in range(0, hi + 1):
        # (padded keys' stored features are zero: so is their term, without the mask read here)
        rows_k = key_block * BT + tl.arange(0, BT)
        phi_k = _load_features(FK, bh, rows_k, N, M, HALF, BM)
        v = _operand(_load_rows(V + b * stride_vb + h * stride_vh, rows_k, N, tl.arange(0, BV), DV, stride_vn,
                                stride_vd), HALF)
        relative = rows_k[None, :] - rows_q[:, None]
        valid = (rows_q[:, None] < N) & (rows_k[None, :] < N)
        if CAUSAL:
            valid = valid & (relative <= 0)
        c = _tile_coefficients(c_row, shift, relative, valid, tl.abs(key_block - block) <= REACH,
                               tl.where(key_block < block, c_before, c_after), N)
        dphi += _dot((_dot(g, tl.trans(v), HALF) + delta[:, None]) * c, phi_k, HALF)
    droot = _rows_grad(Q, FQ, W, ROOT, b, h, bh, rows_q, stride_qb, stride_qh, stride_qn, stride_qd, dphi, N, D, M, DQ,
                       W_PER_HEAD, EPS, HALF, BD, BM)
    tl.atomic_add(DROOT + h, droot + tl.load(PART + bh * NC + block))
    if NEED_DC:
        _bias_grad(V, C, FQ, FK, DO, O, DEN, DC, b, h, bh, block, rows_q, shift, c_before, c_after, stride_vb,
                   stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od, N, DV, M, hi, REACH,
                   CAUSAL, HALF, DIAGONALS, BT, BV, BM)
