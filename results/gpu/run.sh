#!/bin/bash
# The GPU path, run on the device machine from the repository root (files land in $OUT).
# python -m research.benchmark --gpu (BERT-base bf16, batch 32 x 512, MFU per method), then COSTA's paper preset under
# torchrun for 40 steps (random init: the device has no internet for bert-base-uncased), then finetune.py
# from that encoder on SciFact (BM25, faiss mining, evaluation) on the GPU.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/env.txt
if [ -d .whl ]; then   # faiss-cpu, which the device image lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import sys, torch, faiss, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'faiss', faiss.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/env.txt
python3 -m research.benchmark --gpu --steps 10 --warmup 3 2>&1 | tee $OUT/benchmark_gpu.txt
/usr/bin/time -v torchrun --nproc_per_node=1 costa.py --preset paper --epochs 0 --steps 40 --log_every 5 \
  --out_dir /tmp/costa-paper 2>&1 | tee $OUT/costa_paper.txt
cp /tmp/costa-paper/log.jsonl $OUT/costa_paper_log.jsonl
/usr/bin/time -v python3 finetune.py --init /tmp/costa-paper/encoder --out_dir /tmp/ft 2>&1 | tee $OUT/finetune.txt
