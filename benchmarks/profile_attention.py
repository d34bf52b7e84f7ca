"""Where the time of `nprf_attention` goes on a GPU: one forward + backward under torch.profiler.

For each (length, algorithm) it prints the wall time, the time the GPU was busy, the number of kernel
launches and the kernels that took longest. B=1, H=12, d=64, m=64, bf16 inputs, after three warm-ups.

    python benchmarks/profile_attention.py > benchmarks/results/attention_cuda_bf16_profile.txt
"""
import torch
from torch.profiler import profile, ProfilerActivity
from nprf_hf import functional as Fn
from nprf_hf.benchmarking import attention_inputs, timed
dev = "cuda"  # a profile of launches and kernels: a GPU question
for n, alg in [(4096, "auto"), (16384, "auto"), (1024, "dense")]:
    q, k, v, table, P = attention_inputs(1, 12, n, 64, 64, dev, True, torch.bfloat16)
    w = Fn.rpe_band_width()
    def run():
        out = Fn.nprf_attention(q, k, v, Fn.relative_position_bias(table, n), P, algorithm=alg, band_width=w)
        out.sum().backward()
    for _ in range(3): run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(run, dev)[0]
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"### n={n} {alg} fwd+bwd: wall {wall*1e3:.1f} ms, GPU busy {gpu_us/1e3:.1f} ms ({100*gpu_us/1e3/(wall*1e3):.0f}%), {kernels} kernel launches")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
