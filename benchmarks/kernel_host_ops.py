"""What a GPU waits for around the Triton kernels, measured on any machine (issue 43): the PyTorch operators of one
`nprf_attention(..., algorithm="triton")` call and their host time, with the kernels stubbed out.

Below 16,384 tokens the kernels' calls were host-bound on an H200 (RESULTS, "On a GPU"): every operator around the
kernels is a launch and some microseconds of Python. This counts them under Triton's interpreter (TRITON_INTERPRET=1,
set here) with every kernel replaced by a stub that only counts its launches: ATen operators that write memory
("launch-like": a kernel on a GPU), allocations and views apart, inside the kernels' custom ops too; and the median
host time per call at a tiny shape on one thread, through the short path's kernels (64 tokens: `nprf_triton_short`)
and, in the rows named "banded", the banded kernels that longer sequences run. A proxy: no GPU time is measured, and
the band-width check that `nprf_dispatch.resolve_algorithm` makes on CPU tensors only (skipped for the kernels on
CUDA) is stubbed out.

    python benchmarks/kernel_host_ops.py [--dtype bfloat16] [--mask] [--batch 1] [--repeats 300] [--verbose] [--model]

`--model` also times the host side of a whole training step, a tiny 12-layer RoBERTa-like masked LM whose attention
runs the (stubbed) kernels through `attention_algorithm="auto"` as on a GPU, against the same model with SDPA: what
NPRF adds to each eager step on a host-bound GPU.
"""

import argparse
import collections
import os
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: CPU tensors reach the kernels' wrappers

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from nprf_hf import functional as Fn  # noqa: E402
from nprf_hf import nprf_dispatch, nprf_triton, nprf_triton_backward, nprf_triton_decode  # noqa: E402
from nprf_hf import nprf_triton_kernels, nprf_triton_short, nprf_triton_short_kernels  # noqa: E402
from nprf_hf.benchmarking import median_time  # noqa: E402


class KernelStub:
    """A kernel whose launch `kernel[grid](...)` only counts itself."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.update([self.name])


class CountOperators(TorchDispatchMode):
    """ATen operators by kind: "launch" (writes memory), "alloc" (empty*), "view" (returns its input's storage
    unwritten); a custom op of the kernels is entered and its operators counted."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace != "aten":  # the kernels' custom op: run its Python implementation, counting inside
            op = getattr(nprf_triton, name, None) or getattr(nprf_triton_short, name)
            with CountOperators(self.ops):
                return op._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name.startswith(("empty", "new_empty")):
            kind = "alloc"
        elif outputs and all(t.untyped_storage().data_ptr() in inputs for t in outputs) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        ):
            kind = "view"
        else:
            kind = "launch"
        self.ops[kind, name] += 1
        return out


def calls(dtype, masked, batch=1, heads=2, n=64, d=16, m=16, width=8):
    """{label: a no-argument call}: the public function forward and forward + backward (the short path at n tokens;
    "banded ...", the same through the banded kernels), and the decode step."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    table = torch.randn(heads, 2 * width + 1, generator=g)
    index = torch.arange(-(n - 1), n).clamp(-width, width) + width
    # the [H, 2n - 1] bias as the attention receives it, a leaf: its gather from the table is the caller's operator
    bias = table[:, index].requires_grad_()
    projection = Fn.draw_projection(m, d, num_heads=heads, generator=g).to(dtype)
    grad = torch.randn(batch, heads, n, d, generator=g, dtype=dtype)
    mask = None
    if masked:
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[:, -5:] = False
    state = (torch.rand(batch, heads, m, d + 1, generator=g), torch.rand(batch, heads, width - 1, m, generator=g),
             torch.rand(batch, heads, width - 1, d + 1, generator=g))
    c = torch.rand(heads, width + 1, generator=g)
    token = [torch.randn(batch, heads, 1, d, generator=g, dtype=dtype) for _ in range(3)]

    def forward():
        return Fn.nprf_attention(q, k, v, bias, projection, mask, algorithm="triton", band_width=width + 1)

    def forward_backward():  # (autograd.grad: no accumulation into the leaves' .grad, also the caller's)
        torch.autograd.grad(forward(), (q, k, v, bias), grad)

    def decode():
        with torch.no_grad():
            step_mask = None if mask is None else mask[:, :1]
            return nprf_triton.triton_decode_step(*token, step_mask, state, c, projection, None)

    def banded(call):
        def run():
            with mock.patch.object(nprf_triton_short, "SHORT_LENGTH", 0):  # (what longer sequences run)
                return call()
        return run

    return {"forward": forward, "forward + backward": forward_backward, "banded forward": banded(forward),
            "banded forward + backward": banded(forward_backward), "decode step": decode}


def _eager(query):
    """`nprf_triton._plain_eager` as an eager call outside the counting dispatch mode sees it."""
    return not torch.compiler.is_compiling() and type(query) is torch.Tensor


def model_steps(repeats):
    """Median host seconds of a training step of a tiny 12-layer masked LM, NPRF (the stubbed kernels through "auto",
    the CPU playing a CUDA device) and SDPA, one thread, 2 x 64 tokens, width 64."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    from nprf_hf import NPRFRobertaConfig, NPRFRobertaForMaskedLM

    common = dict(vocab_size=99, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, intermediate_size=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=130,
                  pad_token_id=1)
    torch.manual_seed(0)
    config = RobertaConfig(**common)
    config._attn_implementation = "sdpa"
    models = {"NPRF": NPRFRobertaForMaskedLM(NPRFRobertaConfig(num_random_features=16, **common)),
              "SDPA": RobertaForMaskedLM(config)}
    routing = nprf_dispatch.Routing(kernel_devices=("cpu", "cuda"))  # the CPU plays a CUDA device
    for module in models["NPRF"].modules():
        if hasattr(module, "routing"):
            module.routing = routing
    ids = torch.randint(3, 99, (2, 64))
    seconds = {}
    for name, model in models.items():
        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        seconds[name] = median_time(step, repeats=repeats, warmup=3)
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--mask", action="store_true", help="a key padding mask (bool)")
    parser.add_argument("--batch", type=int, default=1, help="sequences a call (above 1: the bias gradient sums them)")
    parser.add_argument("--repeats", type=int, default=300, help="calls timed per row (median)")
    parser.add_argument("--verbose", action="store_true", help="list the launch-like operators")
    parser.add_argument("--model", action="store_true", help="also a tiny 12-layer model's training step, NPRF and SDPA")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    launches = collections.Counter()
    for module in (nprf_triton_kernels, nprf_triton_backward, nprf_triton_decode, nprf_triton_short_kernels):
        for name in dir(module):
            if name.startswith("nprf_") and name.endswith("_kernel"):
                setattr(module, name, KernelStub(name, launches))
    nprf_dispatch.infer_band_width = lambda bias, n: 0  # the CPU-only check (see the docstring)
    print(f"# {args.dtype}, mask: {args.mask}; B={args.batch} H=2 n=64 d=m=16, one thread; kernels stubbed "
          "(TRITON_INTERPRET=1)")
    for label, call in calls(getattr(torch, args.dtype), args.mask, batch=args.batch).items():
        for _ in range(10):
            call()
        launches.clear()
        ops = collections.Counter()
        # (a dispatch mode makes the launcher take the traced path, the custom ops': counted, it takes eager's)
        with CountOperators(ops), mock.patch.object(nprf_triton, "_plain_eager", _eager):
            call()
        kernels = sum(launches.values())
        kinds = collections.Counter()
        for (kind, _), count in ops.items():
            kinds[kind] += count
        host = median_time(call, repeats=args.repeats, warmup=0)  # warmed up above, before the counted call
        print(f"{label}: {kinds['launch'] + kernels} launches ({kernels} NPRF kernels + {kinds['launch']} ATen "
              f"operators that write memory), {kinds['alloc']} allocations, {kinds['view']} views; host "
              f"{host * 1e6:.0f} us")
        if args.verbose:
            print("    " + ", ".join(f"{name} x{n}" for (kind, name), n in ops.most_common() if kind == "launch"))
    if args.model:
        seconds = model_steps(max(5, args.repeats // 20))
        print(f"model training step (12 layers, 2 x 64 tokens, host): NPRF {seconds['NPRF'] * 1e3:.2f} ms, SDPA "
              f"{seconds['SDPA'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
