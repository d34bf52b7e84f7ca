# coding=utf-8
"""CPU threads for the banded algorithm's loops: one parallel region per call instead of one per operator.

Why (issue 45): PyTorch runs each CPU operator as an OpenMP region split evenly over its threads, and a thread
that finishes early spin-waits at the region's end. The banded loops run a few hundred such regions per attention
call (each chunk group's matmuls, each chunk's running sums); once a core is shared, the spinning and the split
that cannot move work off the slow thread cost about a scheduler slice per region (docs/RESULTS.md "On a busy
CPU"). Here the loop's items are taken instead by whichever thread is free (the calling thread and
`torch.get_num_threads() - 1` workers), each running its operators on one thread: no barrier until the last item,
and a descheduled thread simply takes fewer items. Quiet, the same work runs as fast as before.

Only the calling thread's own settings change, and only while a call runs: OpenMP's per-thread thread count
(`omp_set_num_threads` from a thread outside any parallel region sets that thread's value) and MKL's
thread-local count (`mkl_set_num_threads_local`). Where this torch build exposes neither (another OpenMP
runtime, no MKL symbols), everything runs as before: `parallel_items` loops on the calling thread.

This module sits at the edge of the math (issue 56): the math imports none of it, and runs its loops on the
`nprf_schedule` scheduler it is given; `threads_for` builds the CPU's (`CpuThreads`) for an attention call or a
decode step, or `SERIAL` where `Routing.cpu_threads` is False.
"""

import contextlib
import ctypes
import functools
import os
import threading
import time

import torch

from .nprf_banded_window import define_window_ops
from .nprf_schedule import SERIAL


def _load_controls():
    """(set_omp, get_omp, set_mkl_local): ctypes functions setting / reading the calling thread's OpenMP count and
    setting its MKL count (None without MKL), or None where this torch build does not expose them (then nothing
    here changes any thread count)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None  # torch's native pool has no per-thread count
    try:
        process = ctypes.CDLL(None)
        set_omp, get_omp = process.omp_set_num_threads, process.omp_get_max_threads
    except (AttributeError, OSError):
        return None
    set_mkl = None
    if torch.backends.mkl.is_available():
        try:
            set_mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
                                  ).MKL_Set_Num_Threads_Local
        except (AttributeError, OSError):
            return None  # MKL would keep its own threads in every worker: no per-thread control
    set_omp.argtypes, get_omp.restype = [ctypes.c_int], ctypes.c_int
    if set_mkl is not None:
        set_mkl.argtypes, set_mkl.restype = [ctypes.c_int], ctypes.c_int
    return set_omp, get_omp, set_mkl


@functools.cache  # (looked up once per process: the symbols do not change)
def _controls():
    return _load_controls()


def _malloc_trim():
    """glibc's `malloc_trim` from the process's own symbols, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_freed_memory():
    """Hand the heap memory freed on any thread back to the OS (glibc's `malloc_trim`; nothing elsewhere). glibc keeps
    a thread's freed blocks in that thread's arena, and once a large block is freed it serves blocks of that size
    from the arenas instead of fresh mappings, so work spread over threads keeps resident memory it no longer holds
    (`nprf_cpu_split`: 502 MiB at a 12-layer 16,384-token training step). An action, not a setting: nothing of the
    allocator's behaviour is changed."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def available():
    """Whether this torch build lets one thread run its operators single-threaded without touching others."""
    return _controls() is not None


def _controls_for(device):
    """`_controls()` where a block on `device` can be made single-threaded: the CPU, not under torch.compile
    (nothing to trace here: inductor's own loops are one region each), more than one thread; else None."""
    if torch.device(device).type != "cpu" or torch.compiler.is_compiling():
        return None
    controls = _controls()
    # get_num_threads also completes torch's per-thread init, which would otherwise undo a count set before it
    return None if controls is None or torch.get_num_threads() == 1 else controls


@contextlib.contextmanager
def single_threaded(device):
    """The calling thread's CPU operators run on one thread inside the block (its OpenMP and MKL counts are put
    back after; other threads are unaffected). For loops of operators too small to split: each split is a
    parallel region whose barrier a busy core makes expensive. Does nothing for another device, under
    torch.compile, with one thread, or where `available()` is False."""
    controls = _controls_for(device)
    if controls is None:
        yield
        return
    set_omp, get_omp, set_mkl = controls
    omp = get_omp()
    set_omp(1)
    mkl = set_mkl(1) if set_mkl is not None else None
    try:
        yield
    finally:
        set_omp(omp)
        if set_mkl is not None:
            set_mkl(mkl)


# Operators on at most this many elements run on one thread where `single_threaded_below` is used: split over
# threads they gain little, and each split is a parallel region (the recurrent decode step: [B, H, m, d + 1] states).
SINGLE_THREAD_MAX_ELEMENTS = 1 << 18


def single_threaded_below(elements, device):
    """`single_threaded(device)` when the work's operators touch at most SINGLE_THREAD_MAX_ELEMENTS elements, else
    a block that changes nothing."""
    return single_threaded(device) if elements <= SINGLE_THREAD_MAX_ELEMENTS else contextlib.nullcontext()


class ThreadChoice:
    """All of torch's threads or one for a small step run many times over (a decoder's decode step: one token per
    sequence through every layer, a few dozen matrix-vector products and no work worth splitting elsewhere),
    whichever the steps themselves were timed faster with.

    Why (issue 45): every product is a parallel region, and once another process shares a core each region waits
    about a scheduler slice for the thread the OS has parked; quiet, the second thread pays, so no size rule picks
    both (measured: docs/RESULTS.md "Decode steps on the threads they are faster on"). The faster way is used, and
    every `PROBE_EVERY`-th step runs the other way, to notice when the machine's load changes. A probe's step is
    taken as it is (fresh news of the way not in use); a step of the way in use is averaged with its estimate (one
    stall does not send the next steps the slower way; a busy core's steady slowdown does at once). Only the calling
    thread's count changes, and only during a step (`single_threaded`)."""

    PROBE_EVERY = 32

    def __init__(self, clock=None):
        self.enabled = True  # False: the steps run as they are (the layers' `Routing.cpu_threads`, set by the cache)
        self.seconds = {False: None, True: None}  # single-threaded? -> the estimate of a step's seconds that way
        # not time.perf_counter itself: a cache made inside a compiled forward could not be returned holding it
        self.steps, self.clock = 0, clock

    def single(self):
        """Whether the next step runs on one thread."""
        if None in self.seconds.values():
            return self.seconds[False] is not None  # each way once first
        return (self.seconds[True] < self.seconds[False]) != self.probing()

    def probing(self):
        """Whether the next step runs the way not in use, to time it again."""
        return None not in self.seconds.values() and self.steps % self.PROBE_EVERY == 0

    @contextlib.contextmanager
    def step(self, device):
        """A block run as one step: on one thread or all, as `single()` says, and timed. Changes nothing on another
        device, under torch.compile (whose graph is one region per fused loop), with one thread, or where
        `available()` is False."""
        if not getattr(self, "enabled", True) or _controls_for(device) is None:  # (one pickled before: enabled)
            yield
            return
        single = self.single()
        estimate = None if self.probing() else self.seconds[single]
        self.steps += 1
        clock = self.clock or time.perf_counter
        start = clock()
        with single_threaded(device) if single else contextlib.nullcontext():
            yield
            elapsed = clock() - start
        self.seconds[single] = elapsed if estimate is None else (estimate + elapsed) / 2


class _Job:
    """One `parallel_items` call: items handed out one at a time to whichever thread asks."""

    def __init__(self, count, task, inference, workers, threads, static):
        self.count, self.task, self.inference = count, task, inference
        self.threads, self.static = threads, static
        self.next, self.lock = 0, threading.Lock()
        self.pending, self.done = workers, threading.Event()
        self.error = None

    def take(self):
        with self.lock:
            if self.error is not None or self.next >= self.count:
                return None
            self.next += 1
            return self.next - 1

    def items(self, slot):
        if self.static:  # slot s runs items s, s + threads, ...: what a slot sums does not depend on timing
            return (item for item in range(slot, self.count, self.threads) if self.error is None)
        return iter(self.take, None)

    def run(self, slot):
        try:
            for item in self.items(slot):
                self.task(item, slot)
        except BaseException as error:  # re-raised by the calling thread
            with self.lock:
                self.error = self.error or error

    def finish_worker(self):
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.done.set()


class _Workers:
    """Persistent worker threads (daemons, started on first use; a forked child starts its own)."""

    def __init__(self):
        self.inboxes, self.lock, self.pid = [], threading.Lock(), os.getpid()

    def ensure(self, count):
        with self.lock:
            if self.pid != os.getpid():  # threads do not survive fork
                self.inboxes, self.pid = [], os.getpid()
            while len(self.inboxes) < count:
                inbox = _Inbox()
                threading.Thread(target=_worker_loop, args=(inbox, len(self.inboxes) + 1), daemon=True,
                                 name=f"nprf-cpu-{len(self.inboxes) + 1}").start()
                self.inboxes.append(inbox)
            return self.inboxes[:count]


class _Inbox:
    def __init__(self):
        self.jobs, self.ready = [], threading.Semaphore(0)

    def put(self, job):
        self.jobs.append(job)
        self.ready.release()

    def get(self):
        self.ready.acquire()
        return self.jobs.pop(0)


def _worker_loop(inbox, slot):
    set_omp, _, set_mkl = _controls()
    torch.get_num_threads()  # torch's per-thread init first, or its first operator would undo the next lines
    set_omp(1)
    if set_mkl is not None:
        set_mkl(1)
    while True:
        job = inbox.get()
        # the caller's autograd and inference modes are thread-local: mirror them (the items never record graphs)
        with torch.inference_mode(job.inference), torch.no_grad():
            job.run(slot)
        job.finish_worker()


_WORKERS = _Workers()


def parallel_items(count, task, device, static=False):
    """task(item, slot) for item in range(count), spread over the calling thread (slot 0) and
    `torch.get_num_threads() - 1` workers (slots 1, 2, ...), each item on one thread with single-threaded
    operators; returns when all have run (the first exception raised by an item is raised here). Items must
    write disjoint outputs; per-thread buffers are indexed by slot (`parallel_slots(count)` of them). Items go to
    whichever thread is free, or with `static` to slot item % threads (for sums per slot that must not depend on
    timing: the same on every run with the same thread count).
    With one thread, one item, a device other than the CPU or no per-thread control, a plain loop on the calling
    thread; so is a call made from inside an item (its thread's count is 1)."""
    threads = parallel_slots(count, device)
    if threads == 1:
        for item in range(count):
            task(item, 0)
        return
    job = _Job(count, task, torch.is_inference_mode_enabled(), threads - 1, threads, static)
    for inbox in _WORKERS.ensure(threads - 1):
        inbox.put(job)
    with single_threaded(device):
        job.run(0)
    job.done.wait()
    if job.error is not None:
        raise job.error


def parallel_slots(count, device):
    """How many threads `parallel_items(count, ..., device)` uses (its task sees slots 0 .. this - 1)."""
    if count < 2 or torch.device(device).type != "cpu" or not available() or torch.compiler.is_compiling():
        return 1
    return max(1, min(torch.get_num_threads(), count))


class CpuThreads:
    """The math's scheduler (`nprf_schedule`) on this module's threads for tensors on `device`: items on the pool,
    small blocks single-threaded, freed memory trimmed. Each method does what its function above does, so on another
    device, under torch.compile, with one thread or inside an item it changes nothing."""

    def __init__(self, device):
        self.device = device

    def items(self, count, task, static=False):
        parallel_items(count, task, self.device, static)

    def slots(self, count):
        return parallel_slots(count, self.device)

    def small(self, elements=None):
        return single_threaded(self.device) if elements is None else single_threaded_below(elements, self.device)

    def release(self):
        release_freed_memory()

    @property
    def compiled_window_product(self):
        """The window product's opaque op for compiled code (which cannot pass a scheduler), sequences on the pool."""
        return _POOLED_WINDOW_OPS.product


# Compiled, the window product's sequences run on the pool as eager calls run them: the math's own ops, serial, were
# 1.3-1.4x slower at 4 x 2,048 quiet and 1.9x busy (docs/RESULTS.md "Threads at the edge").
_POOLED_WINDOW_OPS = define_window_ops(__name__, lambda: CpuThreads("cpu"))


def threads_for(device, routing=None):
    """The scheduler of a call on `device`: `CpuThreads` on the CPU unless `routing.cpu_threads` (an
    `nprf_dispatch.Routing`) is False, else `nprf_schedule.SERIAL`. The one place the edge decides."""
    enabled = routing is None or routing.cpu_threads
    return CpuThreads(device) if enabled and torch.device(device).type == "cpu" else SERIAL
