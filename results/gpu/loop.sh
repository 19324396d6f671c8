#!/bin/bash
# One lent GPU, from the repository root, in about 4 minutes: each method's real loop (torchrun, --preset paper:
# BERT-base sizes from random weights, bf16, 4 loader workers, fused AdamW, TF32; logged every 20 steps) for a few
# hundred steps, then results/gpu/loop_mfu.py: the loop's tokens/s and MFU against research/benchmark.py's step at the same
# config. Outputs under $OUT (the device tool's; ./results/gpu/out elsewhere). Every part has its own timeout.
#   bash results/gpu/loop.sh              # on the GPU
#   DRY=1 bash results/gpu/loop.sh        # on a CPU: tiny sizes, a few steps: checks that the script works
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-./results/gpu/out}
RUNS=/tmp/loop-runs           # the runs (weights, checkpoints) stay on the machine; their logs go to $OUT/runs
mkdir -p "$OUT/runs" "$RUNS"
T0=$SECONDS
say() { echo "[loop.sh $((SECONDS - T0)) s] $*" | tee -a "$OUT/loop.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/env.txt"
check='import sys, torch, numpy, tokenizers, safetensors, sklearn; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
if ! python3 -c "$check" 2>&1 | tee -a "$OUT/env.txt"; then
  say "imports failed: pip install -r requirements.txt (at most 30 s)"
  timeout 30 python3 -m pip install -q -r requirements.txt 2>&1 | tail -3 | tee -a "$OUT/env.txt"
  python3 -c "$check" 2>&1 | tee -a "$OUT/env.txt" || { say "imports still fail: stopping"; exit 1; }
fi
if [ -n "$DRY" ]; then   # CPU: tiny model and windows, a few steps
  SIZES="--hidden_size 64 --num_layers 2 --num_heads 2 --ffn_size 128 --max_len 64 --workers 1"
  COSTA_STEPS=6; CPDAE_STEPS=4; SEED_STEPS=6; LOG=2; LIMIT=120; GB="--global_batch 8"; BATCH="--batch_size 8"
else                     # BERT-base (the preset's sizes), 32 x 512 a step except CPDAE's preset (64 x 512)
  SIZES=""; COSTA_STEPS=250; CPDAE_STEPS=100; SEED_STEPS=250; LOG=20; LIMIT=55; GB="--global_batch 32"; BATCH=""
fi
COMMON="--preset paper --epochs 0 --log_every $LOG --save_every 100000 --cache_dir /tmp/loop-cache $SIZES"
loop() {   # method, steps, extra flags
  say "$1: $2 steps (timeout $LIMIT s)"
  timeout -k 5 "$LIMIT" torchrun --standalone --nproc_per_node=1 "$1.py" $COMMON --steps "$2" --out_dir "$RUNS/$1" \
    --overwrite $3 2>&1 | grep -v "^token cache\|^data:" | tee "$OUT/$1_loop.txt"
  say "$1: exit ${PIPESTATUS[0]} (124: stopped by the timeout; its logged steps still count)"
  mkdir -p "$OUT/runs/$1" && cp "$RUNS/$1"/log.jsonl "$RUNS/$1"/config.json "$OUT/runs/$1/"   # not the weights
}
loop costa "$COSTA_STEPS" "$BATCH"
loop cpdae "$CPDAE_STEPS" "$([ -n "$DRY" ] && echo "$GB")"
loop seed "$SEED_STEPS" "$GB"      # SEED's preset is 256 x 512 a step (66 GiB): 32 x 512 here, as COSTA's
say "loop against benchmark step (timeout 50 s)"
timeout -k 5 50 python3 results/gpu/loop_mfu.py "$OUT/runs" $([ -n "$DRY" ] && echo "--steps 2 --warmup 1") 2>&1 \
  | grep -v "^token cache\|^data:" | tee "$OUT/loop_mfu.txt"
say "done"
