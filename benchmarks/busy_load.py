"""A bounded competing load for the timing benchmarks (issue 45): one process spinning on each named core, as a
laptop, a CI runner or a shared server has, started and stopped around a block so that a benchmark can time the
same points quiet and busy in one run.

    with competing_load([0]):   # one busy process pinned to core 0
        ...                     # timed here: the busy figures
"""

import contextlib
import os
import subprocess
import sys
import time

# the spinning child: pinned to its core, and gone after `max_seconds` even if its parent dies without stopping it
SPIN = ("import os, sys, time\n"
        "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
        "end = time.monotonic() + float(sys.argv[2])\n"
        "while time.monotonic() < end:\n"
        "    pass\n")


def check_cores(cores):
    """The named cores, or a ValueError naming the ones this machine does not have."""
    available = sorted(os.sched_getaffinity(0))
    missing = [core for core in cores if core not in available]
    if missing:
        raise ValueError(f"--busy-cores {missing}: this process may run on cores {available} only")
    return list(cores)


@contextlib.contextmanager
def competing_load(cores, max_seconds=3600.0):
    """One spinning process per core in `cores` while the block runs (each also stops by itself after
    `max_seconds`); they are killed when the block ends, however it ends."""
    processes = [subprocess.Popen([sys.executable, "-c", SPIN, str(core), str(max_seconds)]) for core in check_cores(cores)]
    try:
        time.sleep(0.5)  # running, pinned and spinning before the first timed call
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
