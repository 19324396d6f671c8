#!/bin/bash
# Fourth GPU pass: python -m research.benchmark --gpu after SEED's decoder logits moved to autocast's dtype (bf16).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m research.benchmark --gpu --steps 10 --warmup 3 2>&1 | grep -v "^token cache\|^data:" | tee $OUT/benchmark_gpu.txt
