# coding=utf-8
"""Triton kernels of the banded NPRF product (`nprf_triton` launches them and holds their autograd Function).

Per (sequence, head) and block of BT rows. T5 buckets make b_r constant for |r| >= W, so for a query block the
keys split into the REACH = ceil((W - 1) / BT) key blocks on either side of it (the band: weights
c_{j-i} phi_q . phi_k computed exactly, tile by tile, with c read per pair) and every block beyond them (far:
one constant c per direction, so a linear attention read from prefix sums of per-block states
S = sum_j phi_k [v, 1]^T: [B*H, NC, BM * (BV + 1)], per block [BM, BV] states then [BM] sums, scanned on the device
in two levels: prefix sums within splits of blocks by the states kernel, the splits' totals added by `_blocks`).
phi is computed once per token: phi_k (padded keys zeroed) by the states kernel, phi_q by the forward kernel, each
stored [B, H, N, M] in the dots' dtype (`nprf_triton._features`); the band tiles, forward and backward, load
them (a key's features were recomputed by every band tile that read it, about 20 times a token in all). The backward
kernels are in `nprf_triton_backward`. A tile kept across a band loop only as a dot operand is held in the dot's
16-bit dtype (`_operand`), and what only the end of a kernel reads is read again there: at 64 rows and 4 warps every
kernel then fits sm_90's 255 registers a thread without spilling (benchmarks/kernel_resources.py).
"""

try:
    import triton
    import triton.language as tl
except ImportError as error:  # only `nprf_triton` imports this file, after checking that Triton imports
    raise ImportError("the Triton kernels of nprf-hf need the `triton` package: pip install triton") from error


@triton.jit
def _dot(a, b, HALF: tl.constexpr):
    """a @ b with fp32 accumulation: HALF = 1, bf16 operands on tensor cores (half inputs); 2, fp16 operands (the
    same under Triton's interpreter, whose bf16 dot is wrong); 3, TF32 operands (fp32 inputs where torch allows TF32
    matmuls); 0, full fp32."""
    # (one return: Triton compiles the statements after a taken constexpr branch's return too)
    if HALF == 3:
        out = tl.dot(a, b, input_precision="tf32")
    elif HALF == 1:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif HALF == 2:
        out = tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _operand(x, HALF: tl.constexpr):
    """x in the dtype `_dot` feeds the tensor cores: a tile kept across a loop only as a dot operand holds half the
    registers in 16 bits (the same products: `_dot` rounds to it anyway)."""
    if HALF == 1:
        x = x.to(tl.bfloat16)
    elif HALF == 2:
        x = x.to(tl.float16)
    return x


@triton.jit
def _load_rows(ptr, rows, n, cols, width, stride_n, stride_d):
    """[BT, BD] fp32 rows of a [n, width] matrix, zeros outside."""
    mask = (rows[:, None] < n) & (cols[None, :] < width)
    return tl.load(ptr + rows[:, None] * stride_n + cols[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _normalized(x, root, EPS: tl.constexpr):
    """(y = root x / max(|x|, EPS) for x [BT, BD], x's inverse norm times root)."""
    inverse = root / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), EPS)
    return x * inverse[:, None], inverse


@triton.jit
def _features(x, w, root, m, log_m_half, EPS: tl.constexpr, HALF: tl.constexpr):
    """phi(y) = exp(W y - |y|^2 / 2) / sqrt(m) of y = root x / max(|x|, EPS) for x [BT, BD], w [BM, BD];
    returns (phi [BT, BM] with the columns >= m zeroed, y, x's inverse norm)."""
    y, inverse = _normalized(x, root, EPS)
    shift = 0.5 * tl.sum(y * y, axis=1) + log_m_half
    wy = _dot(y, tl.trans(w), HALF)
    features = tl.arange(0, w.shape[0])
    phi = tl.where(features[None, :] < m, tl.exp(wy - shift[:, None]), 0.0)
    return phi, y, inverse


@triton.jit
def _load_features(F, bh, rows, N, M, HALF: tl.constexpr, BM: tl.constexpr):
    """Rows of sequence bh's stored features F [B*H, N, M] as a dot operand [BT, BM] (`_operand`), zeros outside."""
    cols = tl.arange(0, BM)
    tile = tl.load(F + (bh * N + rows[:, None]) * M + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < M),
                   other=0.0)
    return _operand(tile, HALF)


@triton.jit
def _store_features(F, bh, rows, phi, N, M, BM: tl.constexpr):
    """phi [BT, BM] into rows of F [B*H, N, M] in F's dtype (the columns < M, the rows < N)."""
    cols = tl.arange(0, BM)
    tl.store(F + (bh * N + rows[:, None]) * M + cols[None, :], phi.to(F.dtype.element_ty),
             mask=(rows[:, None] < N) & (cols[None, :] < M))


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
def _projection(W, ROOT, h, M, D, W_PER_HEAD: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                HALF: tl.constexpr):
    """Head h's projection [BM, BD] (zero rows and columns beyond m, d) as a dot operand (`_operand`: only dots
    read it) and its feature scale sqrt(s)."""
    feats, cols = tl.arange(0, BM), tl.arange(0, BD)
    w = tl.load(W + W_PER_HEAD * h * M * D + feats[:, None] * D + cols[None, :],
                mask=(feats[:, None] < M) & (cols[None, :] < D), other=0.0).to(tl.float32)
    return _operand(w, HALF), tl.load(ROOT + h)


@triton.jit
def _prefix(P, bh, j, NC, BM: tl.constexpr, BV: tl.constexpr):
    """Row j of sequence bh in P [B*H, NC, BM * (BV + 1)] as (states [BM, BV], sums [BM]); zeros for j < 0."""
    feats, row = tl.arange(0, BM), BM * (BV + 1)
    has = feats >= BM * (0 - j)  # all or none: j >= 0 as a [BM] mask
    at = P + (bh * NC + j) * row
    states = tl.load(at + feats[:, None] * BV + tl.arange(0, BV)[None, :], mask=has[:, None], other=0.0)
    return states, tl.load(at + BM * BV + feats, mask=has, other=0.0)


@triton.jit
def _blocks(P, bh, lo, hi, NC, SPLIT, BM: tl.constexpr, BV: tl.constexpr):
    """Blocks lo .. hi - 1 of sequence bh summed, from P [B*H, NC, BM * (BV + 1)] as a states kernel leaves it: the
    prefix sums within each split of SPLIT blocks (the scan's first level), so that a split's last row is its total
    (the second level, summed here: the splits from lo - 1's up to hi - 1's). Returns (states [BM, BV], sums [BM])."""
    first, last = tl.maximum(lo - 1, 0) // SPLIT, tl.maximum(hi - 1, 0) // SPLIT  # (no negative division)
    states, sums = _prefix(P, bh, hi - 1, NC, BM, BV)
    low, low_sums = _prefix(P, bh, lo - 1, NC, BM, BV)
    states, sums = states - low, sums - low_sums
    for split in range(first, last):
        total, total_sums = _prefix(P, bh, split * SPLIT + SPLIT - 1, NC, BM, BV)
        states, sums = states + total, sums + total_sums
    return states, sums


@triton.jit
def _store_block(S, bh, block, NC, states, sums, BM: tl.constexpr, BV: tl.constexpr):
    """Block `block` of sequence bh's row of S [B*H, NC, BM * (BV + 1)] (what `_blocks` reads): states [BM, BV],
    then sums [BM]."""
    feats, row = tl.arange(0, BM), S + (bh * NC + block) * (BM * (BV + 1))
    tl.store(row + feats[:, None] * BV + tl.arange(0, BV)[None, :], states)
    tl.store(row + BM * BV + feats, sums)


@triton.jit
def _bias_shift(BIAS_ROW, N, REACH, BT: tl.constexpr):
    """max_r b_r of a head's bias row [2N - 1], tied beyond the band: the band's entries and the two ends. Every
    program of a head computes the same shift, forward and backward, and reads c_r = exp(b_r - shift) <= 1 (the
    ratios do not change: no exp, amax or subtraction over [H, 2N - 1] before the kernels)."""
    span = tl.minimum(REACH * BT, N - 1)
    shift = tl.maximum(tl.load(BIAS_ROW), tl.load(BIAS_ROW + 2 * N - 2))
    for start in range(N - 1 - span, N + span, 2 * BT):
        at = start + tl.arange(0, 2 * BT)
        shift = tl.maximum(shift, tl.max(tl.load(BIAS_ROW + at, mask=at < N + span, other=float("-inf")), axis=0))
    return shift


@triton.jit
def _band_tile(FK, V, C, shift, MASK, b, h, bh, rows_q, key_block, stride_vb, stride_vh, stride_vn, stride_vd,
               stride_mb, N, DV, M, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HALF: tl.constexpr,
               BT: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr):
    """One key block of a query block's band: (phi_k [BT, BM] (stored, padded keys zero) and v [BT, BV] as dot
    operands, c_{j-i} [BT q, BT k] (from the bias C and its `_bias_shift`) with zeros past the end, (causal) after
    the query and, with HAS_MASK, where a key is padded (only where the mask saves work: the per-pair atomics), and
    that mask)."""
    rows_k = key_block * BT + tl.arange(0, BT)
    phi_k = _load_features(FK, bh, rows_k, N, M, HALF, BM)
    v = _load_rows(V + b * stride_vb + h * stride_vh, rows_k, N, tl.arange(0, BV), DV, stride_vn, stride_vd)
    relative = rows_k[None, :] - rows_q[:, None]
    if CAUSAL:  # (keys up to a query inside the sequence are inside it)
        valid = (rows_q[:, None] < N) & (relative <= 0)
    else:
        valid = (rows_q[:, None] < N) & (rows_k[None, :] < N)
    if HAS_MASK:
        valid = valid & (tl.load(MASK + b * stride_mb + rows_k, mask=rows_k < N, other=0) != 0)[None, :]
    c = tl.exp(tl.load(C + h * (2 * N - 1) + relative + N - 1, mask=valid, other=float("-inf")) - shift)
    return phi_k, _operand(v, HALF), c, relative, valid


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
def _store_output(O, DEN, bh, rows_q, cols_v, numerator, denominator, N, DV):
    """z = numerator / denominator into O [B, H, N, DV] and the denominator into DEN [B, H, N] (backward reads it);
    a query with no key gets zeros, and no division by 0."""
    kept = denominator > 0
    out = tl.where(kept[:, None], numerator / tl.where(kept, denominator, 1.0)[:, None], 0.0)
    tl.store(O + (bh * N + rows_q[:, None]) * DV + cols_v[None, :], out.to(O.dtype.element_ty),
             mask=(rows_q[:, None] < N) & (cols_v[None, :] < DV))
    tl.store(DEN + bh * N + rows_q, denominator, mask=rows_q < N)


@triton.jit
def _key_side(FK, V, MASK, b, h, bh, rows_k, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, N, DV, M,
              HAS_MASK: tl.constexpr, HALF: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr):
    """(keep [BT]: in range and not padded, phi_k [BT, BM] stored by forward, v [BT, BV] as a dot operand) of a
    key-gradient program's rows."""
    keep = rows_k < N
    if HAS_MASK:
        keep = keep & (tl.load(MASK + b * stride_mb + rows_k, mask=rows_k < N, other=0) != 0)
    phi_k = _load_features(FK, bh, rows_k, N, M, HALF, BM)  # (zero for padded keys: so is their dv)
    v = _operand(_load_rows(V + b * stride_vb + h * stride_vh, rows_k, N, tl.arange(0, BV), DV, stride_vn,
                            stride_vd), HALF)
    return keep, phi_k, v


@triton.jit
def nprf_key_states_kernel(
    K, V, W, MASK, ROOT, S, FK,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_mb,
    H, N, D, DV, M, NC, SPLIT, log_m_half,
    HAS_MASK: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per split of SPLIT key blocks, in order: each block's phi_k (padded keys zero) stored to FK [B, H, N, M] (what
    every band tile reads), and its S = [phi_k^T v [BM, BV] | sum_j phi_k [BM]] summed since the split's start (the
    first level of the scan that `_blocks` completes)."""
    split, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD, HALF)
    states, sums = tl.zeros([BM, BV], dtype=tl.float32), tl.zeros([BM], dtype=tl.float32)
    for block in range(split * SPLIT, tl.minimum(split * SPLIT + SPLIT, NC)):
        rows = block * BT + tl.arange(0, BT)
        phi, _, _, v, _ = _key_block(K, V, MASK, b, h, rows, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb,
                                     stride_vh, stride_vn, stride_vd, stride_mb, w, root, N, D, DV, M, log_m_half,
                                     HAS_MASK, EPS, HALF, BD, BV)
        _store_features(FK, bh, rows, phi, N, M, BM)
        states += _dot(tl.trans(phi), v, HALF)
        sums += tl.sum(phi, axis=0)
        _store_block(S, bh, block, NC, states, sums, BM, BV)


@triton.jit
def nprf_forward_kernel(
    Q, V, W, ROOT, C, P, FK, FQ, O, DEN,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_vb, stride_vh, stride_vn, stride_vd,
    H, N, D, DV, M, NC, SPLIT, REACH, log_m_half,
    CAUSAL: tl.constexpr, W_PER_HEAD: tl.constexpr, EPS: tl.constexpr, HALF: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
):
    """Per query block: phi_q, stored to FQ [B, H, N, M] for backward, and z = (far states + band tiles of the
    stored key features FK) / their denominator; O [B, H, N, DV], DEN [B, H, N]."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows_q = block * BT + tl.arange(0, BT)
    cols_d, cols_v = tl.arange(0, BD), tl.arange(0, BV)
    w, root = _projection(W, ROOT, h, M, D, W_PER_HEAD, BM, BD, HALF)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows_q, N, cols_d, D, stride_qn, stride_qd)
    phi_q, _, _ = _features(q, w, root, M, log_m_half, EPS, HALF)
    _store_features(FQ, bh, rows_q, phi_q, N, M, BM)
    c_row = C + h * (2 * N - 1)
    shift = _bias_shift(c_row, N, REACH, BT)
    lo = tl.maximum(block - REACH, 0)
    hi = tl.minimum(block + REACH, NC - 1)
    if CAUSAL:  # (a statement, not a conditional expression: the form every Triton version compiles)
        hi = block
    # far keys before the band: the prefix of the blocks before `lo`, weight c_{-(n-1)}
    c_before = tl.exp(tl.load(c_row) - shift)
    before, before_sum = _blocks(P, bh, 0, lo, NC, SPLIT, BM, BV)
    numerator = c_before * _dot(phi_q, before, HALF)
    denominator = c_before * tl.sum(phi_q * before_sum[None, :], axis=1)
    if not CAUSAL:  # far keys after the band: the total minus the prefix through `hi`, weight c_{n-1}
        c_after = tl.exp(tl.load(c_row + 2 * N - 2) - shift)
        after, after_sum = _blocks(P, bh, hi + 1, NC, NC, SPLIT, BM, BV)
        numerator += c_after * _dot(phi_q, after, HALF)
        denominator += c_after * tl.sum(phi_q * after_sum[None, :], axis=1)
    phi_q = _operand(phi_q, HALF)
    for key_block in range(lo, hi + 1):
        # (padded keys' stored features are zero: their weights are, without the mask read here)
        phi_k, v, c, relative, valid = _band_tile(FK, V, C, shift, C, b, h, bh, rows_q, key_block, stride_vb,
                                                  stride_vh, stride_vn, stride_vd, 0, N, DV, M, CAUSAL, False, HALF,
                                                  BT, BV, BM)
        weights = _dot(phi_q, tl.trans(phi_k), HALF) * c
        numerator += _dot(weights, v, HALF)
        denominator += tl.sum(weights, axis=1)
    _store_output(O, DEN, bh, rows_q, cols_v, numerator, denominator, N, DV)
