"""A bounded competing load for the timing benchmarks (issue 45): one process spinning on each named core, as a
laptop, a CI runner or a shared server has, started and stopped around a block so that a benchmark can time the
same points quiet and busy in one run.

    with competing_load([0]):   # one busy process pinned to core 0
        ...                     # timed here: the busy figures

The benchmarks share the rest too: `add_busy_cores_argument` and `parse_busy_cores` (the `--busy-cores CORE...`
option, and its error for a core the machine lacks),
`quiet_then_busy` (one measurement taken quiet, then again under the load), `busy_comparison` (quiet, busy and
busy / quiet per method, and each method's busy / quiet over the baseline's: issue 45's target is <= 1.2 for NPRF
against SDPA or chunk-and-pool) and `busy_line` (that comparison as one printed line).
"""

import contextlib
import os
import subprocess
import sys
import time

# the spinning child: pinned to its core, killed by the kernel when the process that started it dies (a benchmark's
# worker killed at its time cap, or by the OOM killer, cannot stop it), and gone after `max_seconds` in any case
SPIN = ("import ctypes, os, signal, sys, time\n"
        "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"  # PR_SET_PDEATHSIG
        "if os.getppid() != int(sys.argv[3]):\n"
        "    sys.exit()\n"  # that process had died already
        "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
        "end = time.monotonic() + float(sys.argv[2])\n"
        "while time.monotonic() < end:\n"
        "    pass\n")


def check_cores(cores):
    """The named cores, or a ValueError naming the ones this machine does not have."""
    if not cores:
        return []
    if not hasattr(os, "sched_getaffinity"):  # the spinners pin themselves to a core: Linux's calls
        raise ValueError("--busy-cores pins one spinning process per core, which needs Linux (os.sched_setaffinity)")
    available = sorted(os.sched_getaffinity(0))
    missing = [core for core in cores if core not in available]
    if missing:
        raise ValueError(f"--busy-cores {missing}: this process may run on cores {available} only")
    return list(cores)


def add_busy_cores_argument(parser, when="right after its quiet timing"):
    """The `--busy-cores CORE...` option (default: none, quiet only); check it with `parse_busy_cores`."""
    parser.add_argument("--busy-cores", nargs="+", type=int, default=[], metavar="CORE",
                        help=f"{when}, time every point again with one spinning process on each of these cores, "
                        "and report busy / quiet beside each other (issue 45; default: none, quiet only)")


def parse_busy_cores(parser, args):
    """args.busy_cores, or parser.error naming the cores this machine does not have."""
    try:
        return check_cores(args.busy_cores)
    except ValueError as error:
        parser.error(str(error))


def busy_over_quiet(quiet, busy):
    """{method: busy time / quiet time} for every method timed busy."""
    return {name: busy[name] / quiet[name] for name in busy}


def quiet_then_busy(measure, cores, max_seconds=3600.0):
    """(measure() on the machine as it is, measure() again under `competing_load(cores)`, or None without cores)."""
    quiet = measure()
    if not cores:
        return quiet, None
    with competing_load(cores, max_seconds):
        return quiet, measure()


def busy_comparison(quiet, busy, baseline):
    """One point's busy figures from its quiet and busy {method: seconds}: both, busy / quiet per method, and each
    other method's busy / quiet over the baseline's (NPRF's slowdown over SDPA's or chunk-and-pool's)."""
    slowdown = busy_over_quiet(quiet, busy)
    return {
        "quiet_s": dict(quiet),
        "busy_s": dict(busy),
        "busy_over_quiet": slowdown,
        "baseline": baseline,
        "slowdown_over_baseline": {name: slowdown[name] / slowdown[baseline] for name in slowdown if name != baseline},
    }


def busy_line(comparison, unit="s", scale=1.0):
    """`busy_comparison` as one line: each method's busy time and busy / quiet, then each slowdown over the
    baseline's."""
    cells = [f"{name} {comparison['busy_s'][name] * scale:.4g} {unit} busy ({ratio:.2f}x quiet)"
             for name, ratio in comparison["busy_over_quiet"].items()]
    cells += [f"{name}'s slowdown / {comparison['baseline']}'s {ratio:.2f}"
              for name, ratio in comparison["slowdown_over_baseline"].items()]
    return "  ".join(cells)


@contextlib.contextmanager
def competing_load(cores, max_seconds=3600.0):
    """One spinning process per core in `cores` while the block runs (each also stops by itself after
    `max_seconds`); they are killed when the block ends, however it ends, and by the kernel if this process dies
    first (started from the main thread: the parent-death signal follows the thread that started them)."""
    processes = [subprocess.Popen([sys.executable, "-c", SPIN, str(core), str(max_seconds), str(os.getpid())])
                 for core in check_cores(cores)]
    try:
        time.sleep(0.5)  # running, pinned and spinning before the first timed call
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
