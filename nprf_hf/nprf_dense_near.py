# coding=utf-8
"""The exact near field in the dense products (`nprf_dense`): the kernel is exp(q_near . k_near) for the pairs closer
than the width and phi_q . phi_k beyond, which lie on two corner blocks of the n x n kernel while W < n <= 2 W (GLUE
lengths with the RPE band: 92 to 182 tokens), 2 (n - W)^2 of its n^2 pairs. The features are computed only for the
rows of those blocks and taken compact (`far_rows`); where the blocks are corners their scores, and in backward
their gradients' matmuls, are one matmul per block for the whole batch instead of one per head group. Pure functions.
"""

from typing import NamedTuple, Optional

import torch


def _far_blocks(n, length, width):
    """(rows, keys) slices of the two corner blocks of an [n, length] kernel that hold every pair with
    |j - i| >= width: 2 (n - W)^2 of its n^2 pairs; every pair outside them is near. Below n = 2 W they would
    overlap (and most pairs are far): the whole kernel then."""
    if 2 * width < n:
        return [(slice(0, n), slice(0, length))]
    blocks = []
    if length > width:  # j - i >= W: queries before length - W, keys from W on
        blocks.append((slice(0, length - width), slice(width, length)))
    if n > width:  # i - j >= W: queries from W on, keys before n - W
        blocks.append((slice(width, n), slice(0, min(n - width, length))))
    return blocks


def far_rows(n, width):
    """[(start, stop)]: the rows of an n-token input (queries or keys) on `_far_blocks` of a near field of `width`
    (narrower than n): the in-cache products read only their features, given compact (these ranges one after the
    other, [B, H, r, m])."""
    return [(0, n)] if 2 * width < n else [(0, n - width), (width, n)]


class FarBlock(NamedTuple):
    """One of `_far_blocks` of an [n, length] kernel: its rows and keys, where their features sit among the compact
    rows of `far_rows`, and [r, k] masks in the features' dtype (float: a multiply is several times faster than a
    boolean select on these small blocks), 1 where a pair is at distance >= width (far) and where it is not (near)."""

    rows: slice
    keys: slice
    compact_rows: slice
    compact_keys: slice
    far: torch.Tensor
    near: torch.Tensor


def _far_layout(n, length, width, like):
    """[`FarBlock`] of an [n, length] kernel, masks like the tensor `like`."""
    ranges = far_rows(n, width)

    def compact(span):
        offset = 0
        for start, stop in ranges:
            if start <= span.start and span.stop <= stop:
                return slice(offset + span.start - start, offset + span.stop - start)
            offset += stop - start
        raise AssertionError("a far block outside the far rows")

    layout = []
    for rows, keys in _far_blocks(n, length, width):
        distance = torch.arange(keys.start, keys.stop, device=like.device)[None, :] - torch.arange(
            rows.start, rows.stop, device=like.device)[:, None]
        far = (distance.abs() >= width).to(like.dtype)
        layout.append(FarBlock(rows, keys, compact(rows), compact(keys), far, 1.0 - far))
    return layout


class FarPairs(NamedTuple):
    """The near field's far pairs in a dense product call: per key length its `_far_layout`; where they lie on two
    corner blocks (2 W >= n), their feature scores for every sequence and head at once, one matmul per block, far
    pairs' alone (a sequence's block of fewer keys is the top-left corner of its block at full length): [B, H, r, k]
    by (first row, first key) of the block, and the full length's layout, else None (a matmul per group then); in
    backward, zeros of their shapes that the groups fill with the scores' gradients."""

    layouts: dict
    scores: Optional[dict]
    full: list
    grad_scores: Optional[dict] = None


def far_pairs(phi_q, phi_k, n, width, lengths, backward=False):
    """The `FarPairs` of compact far-row features phi_q, phi_k [B, H, r, m] and key lengths [B] ints."""
    kept = {length for length in lengths if length} | {n}  # (n: the full length's layout, `FarPairs.full`)
    layouts = {length: _far_layout(n, length, width, phi_q) for length in kept}
    full = layouts[n]
    if 2 * width < n:
        return FarPairs(layouts, None, full)
    scores = {(block.rows.start, block.keys.start): torch.matmul(
        phi_q[:, :, block.compact_rows], phi_k[:, :, block.compact_keys].transpose(-1, -2)).mul_(block.far)
        for block in full}
    grad_scores = {key: torch.zeros_like(t) for key, t in scores.items()} if backward else None
    return FarPairs(layouts, scores, full, grad_scores)


def near_kernel(q_near, k_near, phi_q, phi_k, far, sequence, key_mask, out):
    """out [h, n, l] = the near field's kernel of `sequence` = (b, heads): exp(q_near . k_near) for |j - i| < width
    (q_near [h, n, f], k_near [h, l, f]; times key_mask [l], None where no key before l is padded), phi_q . phi_k
    beyond (phi_q, phi_k [B, H, r, m]: the compact far rows, padded keys' zero; `far` their `FarPairs`); the scale C
    then multiplies it whole, as NPRF's feature scores."""
    torch.matmul(q_near, k_near.transpose(-1, -2), out=out).exp_()
    if key_mask is not None:
        out.mul_(key_mask)
    for block in far.layouts[out.shape[-1]]:
        # (a far pair's exp(q_near . k_near), finite for a logit scale below 88, is multiplied by zero)
        corner = out[:, block.rows, block.keys].mul_(block.near)
        if far.scores is None:
            scores = phi_q[sequence][:, block.compact_rows] @ phi_k[sequence][:, block.compact_keys].transpose(-1, -2)
            corner.addcmul_(scores, block.far)
        else:
            corner.add_(far.scores[block.rows.start, block.keys.start][sequence][:, : block.far.shape[0],
                                                                                   : block.far.shape[1]])


def far_grads_of_group(far, grad_kernel, kernel, sequence, phi_q, phi_k, grad_q, grad_k):
    """Backward of `near_kernel` for one group, `sequence` = (b, heads), on its far blocks: dL/dscores =
    dL/dkernel there, into `far.grad_scores` (or with the far features' gradients at once where there is none); the
    kernel's far pairs zeroed, so that kernel * dL/dkernel is then the logits' gradient. grad_kernel, kernel
    [h, n, length]; phi_q, phi_k, grad_q, grad_k [B, H, r, m] (the grads None if not asked for)."""
    for block in far.layouts[kernel.shape[-1]]:
        grad_block = grad_kernel[:, block.rows, block.keys]
        if far.grad_scores is not None:  # (their feature gradients: one matmul per block, `far_grads`)
            grad_scores = far.grad_scores[block.rows.start, block.keys.start][sequence]
            torch.mul(grad_block, block.far, out=grad_scores[:, : block.far.shape[0], : block.far.shape[1]])
        else:
            _set_feature_grads(grad_block * block.far, (*sequence, block.compact_rows),
                               (*sequence, block.compact_keys), phi_q, phi_k, grad_q, grad_k)
        kernel[:, block.rows, block.keys].mul_(block.near)


def far_grads(far, phi_q, phi_k, grad_q, grad_k):
    """The far features' gradients from `far.grad_scores`, every sequence and head at once (nothing without them)."""
    for block in far.full if far.grad_scores is not None else ():
        everything = (slice(None), slice(None))
        _set_feature_grads(far.grad_scores[block.rows.start, block.keys.start], (*everything, block.compact_rows),
                           (*everything, block.compact_keys), phi_q, phi_k, grad_q, grad_k)


def _set_feature_grads(grad_scores, rows, keys, phi_q, phi_k, grad_q, grad_k):
    """grad_q[rows] = grad_scores phi_k[keys], grad_k[keys] = grad_scores^T phi_q[rows] (None: not asked for) for
    indices `rows`, `keys` of the compact far features: each compact row is on one far block only (set, not added)."""
    if grad_q is not None:
        grad_q[rows] = grad_scores @ phi_k[keys]
    if grad_k is not None:
        grad_k[keys] = grad_scores.transpose(-1, -2) @ phi_q[rows]
