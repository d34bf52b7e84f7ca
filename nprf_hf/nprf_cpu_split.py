# coding=utf-8
"""One attention call on the CPU as items of (sequences, heads), each item computed whole on one thread.

Why (issue 45): PyTorch splits every CPU operator over its threads, so one attention call is a few hundred parallel
regions (the feature map's and the division's elementwise operators, the products, their autograd backward), and
each region's barrier waits for a thread the OS may have parked behind another process (measured: docs/RESULTS.md
"On a busy CPU"); SDPA's fused kernel is a single region. Here a call is cut into items of a few heads (over
all its sequences, or with fewer heads than items over groups of them), and whichever of the threads is free computes
an item entirely (features, Toeplitz product, terms, division) with single-threaded operators (the call's
`nprf_schedule` scheduler: on the CPU the edge's pool, `nprf_cpu_threads`): one region per call, and a descheduled
thread simply takes fewer items. Under autograd each item keeps its own graph and the backward runs the items'
graphs the same way. An item of a few heads also keeps its [n, m] features in the core's cache.

Exact: every item is the same math on its own rows and heads; gradients of tensors shared by items (the bias
table, a shared projection, the terms' parameters) are summed in the items' order, the same on every run.
"""

import torch
from torch.autograd.function import once_differentiable

from .nprf_features import empty_like_query
from .nprf_positions import masked_bias


# Calls smaller than this many elements of features and values (B x H x n x (m + d_v)), or of shorter sequences, run
# as one item: there each item's Python (and the products' per-sequence loops, which every item repeats) costs more
# than the split saves (docs/RESULTS.md "One region per attention call: the call as items")
SPLIT_MIN_ELEMENTS = 1 << 20
SPLIT_MIN_LENGTH = 512
# Items per thread: more than one, so that a thread the OS parks takes fewer of them and the others the rest; more
# than two cost time on a quiet machine (same RESULTS section)
ITEMS_PER_THREAD = 2


def attention_in_items(call, route, run):
    """`run(call, route)` (z [B, H, n, d_v] of an `nprf_dispatch.AttentionCall`), cut into items computed on the CPU
    threads where that pays (`split_items`), else as it is."""
    tensors = _inputs(call)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    items = split_items(call, route, needs_grad)
    if items is None:
        return run(call, route)
    if needs_grad:
        return _ItemsAttention.apply(call, route, run, items, *tensors)
    out = empty_like_query(call.query, call.value.shape[-1])

    def item(index, slot):
        rows, cut = items[index]
        parts = [_cut(t, rows, cut, i) for i, t in enumerate(tensors)]
        out[rows, cut] = run(_item_call(call, parts, rows), route)

    call.threads.items(len(items), item)
    return out


def split_items(call, route, needs_grad):
    """[(rows, heads)] slices covering the call, or None where it runs as one item: one thread,
    a small call or short sequences, a key padding mask that wants a gradient, or under autograd (`needs_grad`:
    a gradient flows to one of the call's tensors) saved-tensor hooks on this thread (activation checkpointing or
    offloading: an item's graph, kept by the autograd Function, would escape them)."""
    query, value = call.query, call.value
    batch, heads, n, _ = query.shape
    if n < SPLIT_MIN_LENGTH or (
        batch * heads * n * (call.projection.shape[-2] + value.shape[-1]) < SPLIT_MIN_ELEMENTS
    ):
        return None
    threads = call.threads.slots(batch * heads)
    mask = call.key_padding_mask
    if threads == 1 or (mask is not None and mask.requires_grad):
        return None
    # Under autograd not under saved-tensor hooks (see the docstring).
    if needs_grad and _saved_tensor_hooks_active():
        return None
    return items_of(batch, heads, threads * ITEMS_PER_THREAD)


def _saved_tensor_hooks_active():
    """Whether saved-tensor hooks are set on this thread (True where this torch cannot say)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _inputs(call):
    """The call's tensors a gradient may flow to, in the order `_cut` and `_item_call` read them."""
    return (call.query, call.key, call.value, call.rpe_bias, call.projection, *call.terms.tensors())


def items_of(batch, heads, count):
    """About `count` (rows, heads) slices covering [batch, heads]: groups of heads over all sequences where there are
    at least `count` heads (what an item computes per head, its Toeplitz coefficients, is then computed once), else
    every head on its own over groups of sequences."""
    head_cuts = _cuts(heads, count)
    row_cuts = _cuts(batch, -(-count // len(head_cuts)))
    return [(rows, cut) for rows in row_cuts for cut in head_cuts]


def _cuts(size, count):
    bounds = [round(i * size / min(count, size)) for i in range(min(count, size) + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


def _item_call(call, parts, rows):
    """The `AttentionCall` of one item: `parts` are the call's tensors (in `attention_in_items`' order) cut by `_cut`
    to the item's sequences `rows` and its heads."""
    query, key, value, rpe_bias, projection, *term_tensors = parts
    return call._replace(
        query=query, key=key, value=value, rpe_bias=rpe_bias, bias=masked_bias(rpe_bias, query.shape[-2], call.causal),
        projection=projection, key_padding_mask=None if call.key_padding_mask is None else call.key_padding_mask[rows],
        terms=call.terms.with_tensors(term_tensors, rows),
    )


def _root(z):
    """Where an item's backward starts: z's gradient edge where this torch has them, so that z itself (a copy of
    the output's part) is freed after forward unless its own graph keeps it; else z."""
    get_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    return z if get_edge is None else get_edge(z)


def _cut(tensor, rows, cut, index):
    """The part of input `index` (in `attention_in_items`' order) an item reads: q, k, v [B, H, ...] by rows and
    heads, the rest [H, ...] by heads, a shared [m, d] projection whole."""
    if index < 3:
        return tensor[rows, cut]
    return tensor if index == 4 and tensor.dim() == 2 else tensor[cut]


class _ItemsAttention(torch.autograd.Function):
    """`attention_in_items` under autograd: each item's graph is recorded on its thread from leaves cut out of the
    inputs, and the backward runs each item's graph on the threads, then gathers the inputs' gradients."""

    @staticmethod
    def forward(ctx, call, route, run, items, *tensors):
        query = tensors[0]
        out = empty_like_query(query, tensors[2].shape[-1])
        graphs = [None] * len(items)
        # The lean mode keeps its output for backward: here the call's output is kept once, and each item's Function
        # reads its part of it (`kept_output`), instead of each keeping its own copy (one more copy per layer)
        lean = route.mode == "recompute"

        def item(index, slot):
            rows, cut = items[index]
            # one leaf per input as this item reads it (per-head tensors cut to its heads)
            leaves = [_cut(t, rows, cut, i).detach().requires_grad_(t.requires_grad) for i, t in enumerate(tensors)]
            with torch.enable_grad():
                z = run(_item_call(call, leaves, rows)._replace(output_kept_outside=lean), route)
            out[rows, cut] = z.detach()
            graphs[index] = (_root(z), leaves, z.grad_fn if lean else None)

        call.threads.items(len(items), item)
        # (the mode exists to save memory: a 12-layer 16,384-token training step split this way peaked 502 MiB
        # higher in resident memory untrimmed, 11,505 against 11,004 MiB unsplit; trimmed, 10,779)
        if lean:
            call.threads.release()
        ctx.graphs, ctx.items, ctx.inputs = graphs, items, [(t.shape, t.dtype) for t in tensors]
        ctx.threads = call.threads
        ctx.save_for_backward(out if lean else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        graphs, items = ctx.graphs, ctx.items
        if graphs is None:
            raise RuntimeError("NPRF attention's items were already back-propagated (their graphs are freed after "
                               "one backward); for a second backward, run the forward again")
        ctx.graphs = None
        (kept,) = ctx.saved_tensors
        wanted = ctx.needs_input_grad[4:]
        # q, k, v: each item writes its own part, on its thread; the rest is summed below over the items in their
        # order (the same sum on every run)
        out = [grad_out.new_empty(shape, dtype=dtype) if want and i < 3 else None
               for i, ((shape, dtype), want) in enumerate(zip(ctx.inputs, wanted))]
        grads = [None] * len(items)

        def item(index, slot):
            rows, cut = items[index]
            root, leaves, lean_node = graphs[index]
            graphs[index] = None
            if lean_node is not None:
                lean_node.kept_output = kept[rows, cut]
            inputs = [leaf for leaf, want in zip(leaves, wanted) if want]
            found = iter(torch.autograd.grad(root, inputs, grad_out[rows, cut], allow_unused=True))
            grads[index] = [next(found) if want else None for want in wanted]
            for i, total in enumerate(out[:3]):
                if total is not None:
                    part, grad, grads[index][i] = _cut(total, rows, cut, i), grads[index][i], None
                    if grad is None:
                        part.zero_()
                    else:
                        part.copy_(grad)

        ctx.threads.items(len(items), item)
        if kept is not None:  # the lean mode
            ctx.threads.release()
        for i, ((shape, dtype), want) in enumerate(zip(ctx.inputs, wanted)):
            if want and i >= 3:
                out[i] = grad_out.new_zeros(shape, dtype=dtype)
                for (rows, cut), item_grads in zip(items, grads):
                    if item_grads[i] is not None:
                        _cut(out[i], rows, cut, i).add_(item_grads[i])
        return (None, None, None, None, *out)

