#!/bin/bash
# python -m research.benchmark --gpu with and without --compile: BERT-base, batch 32 x 512, bf16 autocast, each of MLM-only,
# CPDAE and SEED (the last two eager and compiled, in one process), MFU against the card's nominal bf16 peak.
# From the repository root; what it prints goes to $OUT (default results/gpu/out). Every step is bounded by
# `timeout`, the whole in about 4 minutes. DRY=1: the same path on the CPU at a tiny size (is it runnable?).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu/out}
mkdir -p "$OUT"
env_check='import sys, torch, research.benchmark   # what research/benchmark.py imports (faiss, sklearn: not needed here)
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
{ date -u; nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3
  timeout 60 python3 -c "$env_check"; } 2>&1 | tee "$OUT/compile_env.txt"
if ! grep -q " torch " "$OUT/compile_env.txt"; then   # the imports failed: install, then say what we have
    timeout 100 python3 -m pip install -q -r requirements.txt 2>&1 | tail -3 | tee -a "$OUT/compile_env.txt"
    timeout 60 python3 -c "$env_check" 2>&1 | tee -a "$OUT/compile_env.txt"
fi
if [ "${DRY:-0}" = 1 ]; then
    args=(--gpu_device cpu --gpu_batch 2 --gpu_len 32 --steps 1 --warmup 0 --set hidden_size=64 --set num_layers=2
          --set num_heads=2 --set ffn_size=128); limit=900
else
    args=(--steps 10 --warmup 3); limit=$((235 - SECONDS))   # the whole script within ~4 minutes
fi
timeout $limit python3 -m research.benchmark --gpu --compile --variants costa-mlm,cpdae,seed "${args[@]}" \
    --out "$OUT/benchmark-gpu-compile.md" 2>&1 | grep -v "^token cache\|^data:" | tee "$OUT/benchmark_gpu_compile.txt"
echo "exit ${PIPESTATUS[0]} at $(date -u)" | tee -a "$OUT/benchmark_gpu_compile.txt"
