"""nprf_hf/benchmarking.py, the benchmark scripts' one harness (issue 56): which calls the timers time and when they
stop, that a CUDA timing waits for the device on both sides, what the memory measures count, and that a results
file is written whole or not at all. Times come from a fake clock: nothing here depends on the machine's speed."""

import json
import mmap
import os
import time

import pytest
import torch

from nprf_hf import benchmarking


class FakeClock:
    """time.perf_counter for the harness, advanced only by the calls under test (by binary fractions: exact sums)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(benchmarking.time, "perf_counter", fake)
    return fake


def calls_taking(clock, durations):
    """fn() whose k-th call takes durations[k] seconds of the fake clock; fn.calls counts them."""
    def fn():
        clock.now += durations[fn.calls]
        fn.calls += 1
        return fn.calls

    fn.calls = 0
    return fn


def test_repeat_times_never_times_the_warm_up(clock):
    fn = calls_taking(clock, [50.0, 7.0, 1.0, 2.0, 3.0])  # the first two are warm-ups: a cold start and a compile
    assert benchmarking.repeat_times(fn, repeats=3, warmup=2) == [1.0, 2.0, 3.0]
    assert fn.calls == 5
    fn = calls_taking(clock, [50.0, 4.0, 1.0, 9.0])
    assert benchmarking.median_time(fn, repeats=3) == 4.0  # the median, not the mean (a stall moves the mean)


def test_repeat_times_stops_at_min_time(clock):
    # at least two timed calls, then stop once they add up to min_time
    fn = calls_taking(clock, [0.0, 0.25, 0.375, 0.5, 0.625])
    assert benchmarking.repeat_times(fn, repeats=10, min_time=1.0) == [0.25, 0.375, 0.5]
    # a first call over ten times min_time is not run again
    fn = calls_taking(clock, [0.0, 12.0, 1.0])
    assert benchmarking.repeat_times(fn, repeats=5, min_time=1.0) == [12.0]
    # never past repeats, whatever min_time asks
    fn = calls_taking(clock, [0.0] + [0.125] * 10)
    assert len(benchmarking.repeat_times(fn, repeats=4, min_time=100.0)) == 4
    # min_time 0: a single timed call (how the smoke tests keep the scripts short)
    fn = calls_taking(clock, [0.0, 0.25, 0.25])
    assert benchmarking.repeat_times(fn, repeats=5, min_time=0) == [0.25]
    with pytest.raises(ValueError, match="repeats=0"):
        benchmarking.repeat_times(fn, repeats=0)


def test_alternating_times_takes_turns_and_resets_untimed(clock):
    log = []

    def call(name, seconds):
        def fn():
            log.append(name)
            clock.now += seconds
        return fn

    def after(name):
        log.append(f"reset {name}")
        clock.now += 1000.0  # untimed: must not reach any time

    times = benchmarking.alternating_times({"a": call("a", 1.0), "b": call("b", 2.0)}, repeats=2, warmup=1, after=after)
    assert times == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    assert log == ["a", "reset a", "b", "reset b"] + ["a", "reset a", "b", "reset b"] * 2


def test_timed_waits_for_the_device_on_both_sides(clock, monkeypatch):
    """CUDA runs asynchronously: without a synchronize before, a timing counts the work queued earlier; without
    one after, it counts only the launch. On the CPU nothing waits (and torch.cuda is not touched)."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))

    def fn():
        events.append("call")
        clock.now += 0.5
        return "out"

    assert benchmarking.timed(fn, "cuda:0") == (0.5, "out")
    assert events == [("sync", "cuda:0"), "call", ("sync", "cuda:0")]
    events.clear()
    assert benchmarking.timed(fn, torch.device("cpu")) == (0.5, "out") and events == ["call"]
    assert benchmarking.timed(fn) == (0.5, "out") and events == ["call", "call"]


def hold(nbytes, seconds=0.0):
    """Map and touch `nbytes` of fresh pages (resident while held), hold them `seconds`, unmap them. (An mmap, not a
    heap block: after an earlier test's model step glibc serves a 96 MiB bytearray from memory still resident.)"""
    block = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        block[offset] = 1
    time.sleep(seconds)
    block.close()


MIB = 2**20


@pytest.mark.skipif(not os.path.exists(benchmarking.PeakMemory.CLEAR_REFS), reason="Linux's /proc/self/clear_refs")
def test_peak_memory_counts_a_freed_block_at_its_peak():
    """A block allocated and freed inside the measure still counts (the peak, not what is left), and what was
    resident before the measure does not."""
    kept = bytearray(64 * MIB)
    kept[::4096] = b"\1" * len(kept[::4096])
    with benchmarking.PeakMemory("cpu") as memory:
        hold(96 * MIB)
    assert 90 * MIB <= memory.increase < 140 * MIB, memory.increase
    assert "clear_refs" in memory.method
    assert benchmarking.peak_memory(lambda: None) < 16 * MIB
    del kept


def test_peak_memory_without_clear_refs_samples_the_resident_set(monkeypatch):
    """Where /proc/self/clear_refs cannot be written (macOS, some containers) a thread samples the RSS instead."""
    monkeypatch.setattr(benchmarking.PeakMemory, "CLEAR_REFS", "/nonexistent/clear_refs")
    with benchmarking.PeakMemory("cpu") as memory:
        hold(96 * MIB, seconds=0.2)  # held long enough for a 1 ms sampler to see it
    assert "sampled" in memory.method
    assert 80 * MIB <= memory.increase < 140 * MIB, memory.increase
    assert not memory._thread.is_alive()


def test_peak_allocated_counts_tensors_at_their_peak():
    """torch's allocations only, in time order: two 4 MiB tensors one after the other peak at 4 MiB, at once at 8."""
    def one_after_the_other():
        a = torch.ones(MIB)
        del a
        b = torch.ones(MIB)
        del b

    def both():
        a, b = torch.ones(MIB), torch.ones(MIB)
        del a, b

    assert 4 * MIB <= benchmarking.peak_allocated(one_after_the_other) < 5 * MIB
    assert 8 * MIB <= benchmarking.peak_allocated(both) < 9 * MIB


def test_write_json_is_whole_or_nothing(tmp_path):
    path = tmp_path / "results" / "deeper" / "run.json"  # folders made as needed
    benchmarking.write_json(str(path), {"rows": [1, 2], "n": 3})
    assert json.loads(path.read_text()) == {"rows": [1, 2], "n": 3}
    assert path.read_text().startswith('{\n "rows"')  # the committed results' layout (indent 1), diff-friendly
    with pytest.raises(TypeError):
        benchmarking.write_json(str(path), {"rows": [object()]})  # fails half-way through the dump
    assert json.loads(path.read_text()) == {"rows": [1, 2], "n": 3}  # the previous results, untouched
    assert sorted(os.listdir(path.parent)) == ["run.json"]  # no partial file left behind
    benchmarking.write_json(str(path), [1], indent=None)
    assert path.read_text() == "[1]"


def test_dtype_names_are_the_torch_dtypes():
    assert [benchmarking.torch_dtype(name) for name in benchmarking.DTYPE_NAMES] == [
        torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="float64"):
        benchmarking.torch_dtype("float64")


def test_the_harness_imports_neither_torch_nor_transformers():
    """The busy load and the JSON writer serve scripts before (or without) torch: importing the harness is light."""
    import subprocess
    import sys

    code = ("import sys\nfrom nprf_hf import benchmarking\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
