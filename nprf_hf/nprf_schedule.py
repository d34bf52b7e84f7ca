# coding=utf-8
"""How the math runs its loops of independent items (a sequence, a head, an item of a call): the math takes a
scheduler and never starts threads or changes thread counts itself. `SERIAL` runs everything on the calling thread
with torch's own threading; the CPU's pool (`nprf_cpu_threads.CpuThreads`) is built at the package's edge, around an
attention call (`functional.nprf_attention`, the layer) and a decode step (the cache), and passed in.

A scheduler has `items(count, task, static=False)`: task(item, slot) for every item, slots 0 .. slots(count) - 1
(with `static`, slot item % slots: per-slot sums that do not depend on timing); `slots(count)`: how many slots a
task of `count` items sees (per-slot buffers); `small(elements=None)`: a block of operators too small to split
over threads (all of them, or only while they touch at most the scheduler's threshold of `elements`); `release()`:
hand memory freed on other threads back to the OS.
"""

import contextlib


class SerialThreads:
    """The math's default scheduler: a plain loop on the calling thread, one slot, nothing else changed."""

    def items(self, count, task, static=False):
        for item in range(count):
            task(item, 0)

    def slots(self, count):
        return 1

    def small(self, elements=None):
        return contextlib.nullcontext()

    def release(self):
        pass


SERIAL = SerialThreads()
