#!/usr/bin/env bash
# Issues 43 and 55's GPU measurement in one command, sized for one device loan (at most 8 minutes, H100 or H200):
# the Triton kernels against SDPA's flash kernel (attention alone, 1k-64k tokens, with the share of issue 55's
# roofline bound), a RoBERTa-base-sized model's forward and training step, eager and compiled (16,384 tokens
# first, with peak memory), and decoding. Needs a CUDA build of torch, transformers and Triton (no install here:
# the device machines have them and no network). Writes benchmarks/results/gpu_cuda_bf16.json and its plot.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device'" 
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
# the clone's nprf_hf, installed or not (a device machine has no network to install it): the scripts import it
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" benchmarks/gpu.py --output "${OUTPUT:-benchmarks/results/gpu_cuda_bf16.json}" "$@"
