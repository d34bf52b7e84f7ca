"""The CPU threads of the banded loops (`nprf_cpu_threads`, issue 45): every item runs once, on threads whose
operators are single-threaded, without changing any other thread's count; and the banded algorithm run over
them (forward, its backward, the lean training mode's backward) equals the float64 reference, the same on every
run. The suite's workers run one thread each (conftest), so these tests ask for two themselves."""

import multiprocessing
import threading

import pytest
import torch
from test_banded_backward import BUCKETS, DISTANCE, case, small_chunks, views  # noqa: F401  (a fixture)

from nprf_hf import functional as Fn
from nprf_hf import nprf_cpu_threads, nprf_dispatch
from nprf_hf.nprf_schedule import SERIAL
from nprf_hf.nprf_naive import naive_attention

from tolerances import (assert_within, attention_rounding, normalized_product_bound, normalized_product_gradient_bounds,
                        product_bound, product_gradient_bounds)

pytestmark = pytest.mark.skipif(not nprf_cpu_threads.available(), reason="this torch build has no per-thread "
                                "OpenMP / MKL thread count: the banded loops run as plain loops")


def test_every_item_runs_once_on_single_threaded_threads(two_threads):
    """Two threads take items (the first item waits until another thread has taken one), each sees one intra-op
    thread while it runs, and the caller's count is back afterwards; a thread started later has the default."""
    assert nprf_cpu_threads.parallel_slots(8, "cpu") == 2
    seen, counts, lock, other = [], set(), threading.Lock(), threading.Event()

    def task(item, slot):
        if item == 0:
            assert other.wait(timeout=30), "no second thread took an item"
        elif slot != 0 or item > 3:
            other.set()
        with lock:
            seen.append((item, slot))
            counts.add(torch.get_num_threads())

    nprf_cpu_threads.parallel_items(8, task, "cpu")
    assert sorted(item for item, _ in seen) == list(range(8))
    assert {slot for _, slot in seen} == {0, 1}
    assert counts == {1}
    assert torch.get_num_threads() == 2
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [2]


def test_an_item_error_reaches_the_caller_and_the_threads_go_on(two_threads):
    def task(item, slot):
        if item == 5:
            raise ValueError("item 5")

    with pytest.raises(ValueError, match="item 5"):
        nprf_cpu_threads.parallel_items(12, task, "cpu")
    assert torch.get_num_threads() == 2
    done = []
    nprf_cpu_threads.parallel_items(6, lambda item, slot: done.append(item), "cpu")
    assert sorted(done) == list(range(6))


def test_plain_loop_where_nothing_splits(two_threads):
    """One item, or a device other than the CPU: the caller's own thread, its count untouched."""
    assert nprf_cpu_threads.parallel_slots(1, "cpu") == 1
    assert nprf_cpu_threads.parallel_slots(8, "meta") == 1
    counts = []
    nprf_cpu_threads.parallel_items(3, lambda item, slot: counts.append((slot, torch.get_num_threads())), "meta")
    assert counts == [(0, 2)] * 3


def _child_runs_items(queue):
    done = []
    nprf_cpu_threads.parallel_items(6, lambda item, slot: done.append(item), "cpu")
    queue.put(sorted(done))


def test_a_forked_child_starts_its_own_threads(two_threads):
    nprf_cpu_threads.parallel_items(4, lambda item, slot: None, "cpu")  # the parent's workers exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_runs_items, args=(queue,))
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert result == list(range(6)) and child.exitcode == 0


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_banded_over_threads_matches_the_reference(two_threads, small_chunks, causal, recompute):
    """Values and the gradients of q, k, v and the bucket table against the float64 reference, with padding;
    twice, bit for bit the same (the bias table's gradient is summed in a fixed order whichever thread ran what)."""
    n = 61
    q, k, v, projection, table, mask = case(n, batch=3, heads=3, seed=4)
    bias_of = lambda table: Fn.relative_position_bias(table, n, not causal, BUCKETS, DISTANCE)  # noqa: E731
    band = Fn.rpe_band_width(BUCKETS, DISTANCE, not causal)
    ref = naive_attention(*views(q, k, v), bias_of(table), projection, mask, causal)
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v, table))
    rounding = attention_rounding(*views(q, k, v), bias_of(table), projection, ref, mask, causal, "banded")
    runs = []
    for _ in range(2):
        out = Fn.nprf_attention(*views(q, k, v), bias_of(table), projection, mask, "banded", causal, band_width=band,
                                recompute=recompute)
        rounding.assert_values(out, ref)
        got = torch.autograd.grad((out * weights).sum(), (q, k, v, table))
        rounding.assert_gradients(got, want, ("q", "k", "v", "table"))
        runs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_banded_over_threads_under_inference_mode(two_threads, small_chunks):
    """The workers take the caller's inference mode (in-place work on inference tensors is refused outside it)."""
    q, k, v, projection, table, mask = case(50, batch=2, heads=2, seed=6)
    bias = Fn.relative_position_bias(table, 50, True, BUCKETS, DISTANCE).detach()
    args = (*(t.detach().transpose(1, 2) for t in (q, k, v)), bias, projection, mask, "banded")
    band = Fn.rpe_band_width(BUCKETS, DISTANCE)
    with torch.inference_mode():
        out = Fn.nprf_attention(*args, band_width=band)
    ref = naive_attention(*args[:6])
    attention_rounding(*args[:5], ref, args[5], False, "banded").assert_values(out, ref)


@pytest.mark.parametrize("normalized", [False, True])
def test_dense_in_cache_over_threads_matches_autograd(two_threads, normalized):
    """The in-cache dense products (a sequence per thread) against plain autograd through the n x n weights, float64,
    with a sequence cut short and one with no key; the gradients twice bit for bit the same."""
    from nprf_hf.nprf_dense import dense_toeplitz_attention, dense_toeplitz_inference, dense_toeplitz_training
    from nprf_hf.nprf_features import values_and_ones
    generator = torch.Generator().manual_seed(7)
    batch, heads, n, m, d = 5, 3, 24, 4, 5
    lengths = [n, 17, 0, 1, n]
    kept = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)[:, None, :, None]
    phi_q = torch.rand(batch, heads, n, m, dtype=torch.float64, generator=generator).requires_grad_(True)
    phi_k = torch.rand(batch, heads, n, m, dtype=torch.float64, generator=generator).requires_grad_(True)
    value = torch.randn(batch, heads, n, d, dtype=torch.float64, generator=generator).requires_grad_(True)
    c = torch.rand(heads, 2 * n - 1, dtype=torch.float64, generator=generator).requires_grad_(True)
    sums = dense_toeplitz_attention(phi_q, phi_k * kept, values_and_ones(value), c)
    ref = sums
    if normalized:
        denominators = sums[..., -1:]
        ref = torch.where(denominators > 0, sums[..., :-1] / denominators.clamp_min(1e-300), 0.0)
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=generator)
    want = torch.autograd.grad((ref * weights).sum(), (phi_q, phi_k, value, c))
    names = ("phi_q", "phi_k", "u", "c")
    if normalized:  # the derived bounds of two direct evaluations (`tolerances`)
        bound = normalized_product_bound(phi_q, phi_k * kept, value, c, ref)
        grad_bounds = normalized_product_gradient_bounds(phi_q, phi_k * kept, value, c, ref, weights, names)
    else:
        bound = product_bound(phi_q, phi_k * kept, values_and_ones(value), c)
        grad_bounds = product_gradient_bounds(phi_q, phi_k * kept, values_and_ones(value), c, weights, names)
        grad_bounds[2] = grad_bounds[2][..., :d]  # the values: u's first d columns
    with torch.no_grad():
        assert_within(dense_toeplitz_inference(phi_q, phi_k * kept, value, c, lengths, normalized), ref, bound,
                      "inference")
    runs = []
    for _ in range(2):
        out = dense_toeplitz_training(phi_q, phi_k * kept, value, c, lengths, normalized)
        assert_within(out, ref, bound, "training")
        got = torch.autograd.grad((out * weights).sum(), (phi_q, phi_k, value, c))
        for a, b, grad_bound, name in zip(got, want, grad_bounds, names):
            assert_within(a, b, grad_bound, name)
        runs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("limit", [1 << 18, 0, None])
def test_a_small_decode_step_runs_on_one_thread(two_threads, monkeypatch, limit):
    """The recurrent step of one token touches [B, H, m, e] states: on the CPU's scheduler (the cache's) its operators
    run on one thread (each split would be a parallel region), unless the states are larger than the limit; on the
    math's default (None: `SERIAL`) on torch's; the caller's count is back after."""
    from nprf_hf import nprf_recurrent
    monkeypatch.setattr(nprf_cpu_threads, "SINGLE_THREAD_MAX_ELEMENTS", limit or 0)
    threads = SERIAL if limit is None else nprf_cpu_threads.CpuThreads("cpu")
    seen = []
    real = nprf_recurrent.recurrent_attention

    def recording(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(nprf_recurrent, "recurrent_attention", recording)
    generator = torch.Generator().manual_seed(8)
    batch, heads, d, m, band = 2, 3, 4, 5, 7
    query, key, value = (torch.randn(batch, heads, 1, d, generator=generator) for _ in range(3))
    state = (torch.rand(batch, heads, m, d + 1, generator=generator), torch.rand(batch, heads, band - 1, m,
             generator=generator), torch.rand(batch, heads, band - 1, d + 1, generator=generator))
    projection = Fn.draw_projection(m, d, "orf", num_heads=heads, generator=generator)
    table = torch.randn(heads, BUCKETS, generator=generator)
    from nprf_hf.nprf_terms import AttentionTerms
    out, _ = nprf_recurrent.recurrent_step(query, key, value, None, state,
                                           nprf_recurrent.CausalBuckets(table, band, BUCKETS, DISTANCE), projection,
                                           "auto", "nprf", AttentionTerms(), threads=threads)
    assert seen == [1 if limit else 2] and torch.get_num_threads() == 2 and torch.isfinite(out).all()


class _StepClock:
    """A clock for ThreadChoice whose every step takes `seconds[single]`, single read from the thread count at the
    step's end (inside the step's block)."""

    def __init__(self, multi, single):
        self.now, self.seconds = 0.0, {False: multi, True: single}

    def __call__(self):
        self.now += self.seconds[torch.get_num_threads() == 1] / 2  # two readings per step
        return self.now


def test_thread_choice_follows_the_faster_way_and_probes_the_other(two_threads):
    """Each way once, then the faster (quiet: all threads), the other every PROBE_EVERY-th step; one slow step of
    the way in use (a stall) does not switch; when the machine gets busy (all threads slower) the next step is
    single-threaded, and back once a probe finds it quiet again. The count inside a step is what the choice says,
    and the caller's is back after every step."""
    clock = _StepClock(multi=1.0, single=1.5)
    choice = nprf_cpu_threads.ThreadChoice(clock=clock)
    probe = choice.PROBE_EVERY

    def steps(count):
        seen = []
        for _ in range(count):
            with choice.step("cpu"):
                seen.append(torch.get_num_threads())
            assert torch.get_num_threads() == 2
        return seen

    quiet = steps(2 * probe + 1)
    assert quiet[:2] == [2, 1]
    assert [i for i, n in enumerate(quiet) if n == 1] == [1, probe, 2 * probe]
    clock.seconds[False] = 1.8  # one stall, slower than a single-threaded step, right after a probe
    assert steps(1) == [2]
    clock.seconds[False] = 1.0
    assert steps(2) == [2, 2]  # still all threads: the stall was averaged with the estimate, not taken alone
    clock.seconds[False] = 6.0  # another process on a core: each of the step's regions waits for a parked thread
    busy = steps(probe + 2)  # steps 2 * probe + 4 on
    # the step that found it slow, then one thread but for the probe (step 3 * probe overall)
    assert [i for i, n in enumerate(busy) if n == 2] == [0, probe - 4]
    clock.seconds[False] = 1.0
    again = steps(probe)  # quiet again from step 3 * probe + 6: found at the next probe, step 4 * probe
    assert again == [1] * (probe - 6) + [2] * 6
    with choice.step("meta"):  # another device: nothing changes, nothing counted
        assert torch.get_num_threads() == 2
    assert choice.steps == 2 * probe + 4 + probe + 2 + probe


def test_decode_steps_run_as_their_cache_chooses_and_give_the_same_tokens(two_threads):
    """generate() through an NPRF cache: the prompt on every thread, each decode step on the threads its cache's
    choice says (single-threaded when timed faster), the caller's count back after; the scores equal those of
    steps all on two threads."""
    from nprf_hf import NPRFCache
    from test_generation import decoder

    model = decoder(torch.float32, seed=3)
    seen = []
    model.roberta.encoder.layer[0].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    prompt = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    runs = []
    for single_faster in (True, False):
        cache = NPRFCache(model.config)
        cache.thread_choice = nprf_cpu_threads.ThreadChoice(_StepClock(multi=2.0, single=1.0 if single_faster else 3.0))
        seen.clear()
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        assert torch.get_num_threads() == 2
        # prefill, then the steps: each way once, then the faster
        assert seen == ([2, 2, 1, 1, 1, 1] if single_faster else [2, 2, 1, 2, 2, 2])
        runs.append(out)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[0].scores), torch.stack(runs[1].scores))
    # steps given inputs_embeds are steps too
    cache = NPRFCache(model.config)
    cache.thread_choice = nprf_cpu_threads.ThreadChoice(_StepClock(multi=2.0, single=1.0))
    with torch.no_grad():
        model(prompt, past_key_values=cache)
        seen.clear()
        for token in prompt[:, :3].T:
            model(inputs_embeds=model.get_input_embeddings()(token[:, None]), past_key_values=cache)
    assert seen == [2, 1, 1] and torch.get_num_threads() == 2


# ---- threads at the edge (issue 56): the math runs on the scheduler it is given, and one setting turns them off ----

class _SpyThreads:
    """An `nprf_schedule` scheduler that records what the math asks of it and runs it serially."""

    def __init__(self):
        self.calls = []

    def items(self, count, task, static=False):
        self.calls.append(("items", count))
        SERIAL.items(count, task, static)

    def slots(self, count):
        return 1

    def small(self, elements=None):
        self.calls.append(("small", elements))
        return SERIAL.small()

    def release(self):
        self.calls.append(("release",))


def test_the_math_runs_its_loops_on_the_scheduler_it_is_given(small_chunks):
    """The banded product, forward and backward, and the dense in-cache rows ask the scheduler they are given for
    their sequences and small blocks (nothing else decides where they run), and give what the serial default gives."""
    from nprf_hf.nprf_banded import banded_toeplitz_attention, banded_toeplitz_backward
    from nprf_hf.nprf_dense import dense_toeplitz_inference

    g = torch.Generator().manual_seed(5)
    batch, heads, n, m, d = 2, 3, 90, 4, 5
    phi_q, phi_k = (torch.rand(batch, heads, n, m, dtype=torch.float64, generator=g) for _ in range(2))
    value = torch.randn(batch, heads, n, d, dtype=torch.float64, generator=g)
    c = torch.rand(heads, 2 * n - 1, dtype=torch.float64, generator=g)
    spy = _SpyThreads()
    out = banded_toeplitz_attention(phi_q, phi_k, value, c, 9, False, threads=spy)
    torch.testing.assert_close(out, banded_toeplitz_attention(phi_q, phi_k, value, c, 9, False), rtol=0, atol=0)
    assert ("items", batch * heads) in spy.calls and any(call[0] == "small" for call in spy.calls)
    spy.calls.clear()
    grad = torch.randn(batch, heads, n, d + 1, dtype=torch.float64, generator=g)
    banded_toeplitz_backward(phi_q, phi_k, value, c, 9, False, grad, threads=spy)
    assert spy.calls[0] == ("items", batch * heads)  # (then each sequence's own blocks)
    spy.calls.clear()
    dense_toeplitz_inference(phi_q, phi_k, value, c, [n, n - 4], threads=spy)
    assert spy.calls == [("items", batch)]


@pytest.mark.parametrize("algorithm, recompute", [("banded", False), ("banded", True), ("dense", None)])
def test_routing_without_cpu_threads_runs_serially_and_the_same(two_threads, monkeypatch, algorithm, recompute):
    """`Routing(cpu_threads=False)` is the one switch: no item of the call (split into items, its products'
    sequences, its small blocks) touches the CPU threads, forward or backward; output and gradients are those of the
    threaded call (split here into items as well)."""
    from nprf_hf import nprf_cpu_split

    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_ELEMENTS", 0)
    monkeypatch.setattr(nprf_cpu_split, "SPLIT_MIN_LENGTH", 0)
    g = torch.Generator().manual_seed(6)
    batch, heads, n, d, m = 2, 3, 70, 6, 5
    q, k, v = (torch.randn(batch, heads, n, d, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    table = torch.randn(heads, BUCKETS, dtype=torch.float64, generator=g).requires_grad_()
    projection = Fn.draw_projection(m, d, "orf", num_heads=heads, generator=g).double()
    mask = torch.ones(batch, n, dtype=torch.bool)
    mask[1, -5:] = False

    def attention(routing):
        bias = Fn.relative_position_bias(table, n, True, BUCKETS, DISTANCE)
        out = Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm=algorithm, causal=True, recompute=recompute,
                                band_width=Fn.rpe_band_width(BUCKETS, DISTANCE), routing=routing)
        return [out, *torch.autograd.grad(out.square().sum(), (q, k, v, table))]

    threaded = attention(None)

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU threads were used with Routing(cpu_threads=False)")

    for name in ("parallel_items", "parallel_slots", "single_threaded", "single_threaded_below",
                 "release_freed_memory"):
        monkeypatch.setattr(nprf_cpu_threads, name, refuse)
    serial = attention(nprf_dispatch.Routing(cpu_threads=False))
    for got, expected in zip(serial, threaded):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_decode_steps_without_cpu_threads_are_not_timed_and_give_the_same_tokens(two_threads):
    """Layers routed with `cpu_threads=False`: generate()'s decode steps run on torch's threads as they are (their
    cache's `ThreadChoice` neither times nor switches them), with the tokens and scores of the threaded steps."""
    from nprf_hf import NPRFCache
    from test_generation import decoder

    model = decoder(torch.float32, seed=3)
    seen = []
    model.roberta.encoder.layer[0].register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    prompt = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    runs = []
    for routing in (None, nprf_dispatch.Routing(cpu_threads=False)):
        for module in model.modules():
            if hasattr(module, "routing"):
                module.routing = routing
        cache = NPRFCache(model.config)
        cache.thread_choice = nprf_cpu_threads.ThreadChoice(_StepClock(multi=2.0, single=1.0))
        seen.clear()
        runs.append(model.generate(prompt, past_key_values=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True))
        assert seen == ([2, 2, 1, 1, 1] if routing is None else [2] * 5) and torch.get_num_threads() == 2
        assert cache.thread_choice.steps == (4 if routing is None else 0)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[0].scores), torch.stack(runs[1].scores))
