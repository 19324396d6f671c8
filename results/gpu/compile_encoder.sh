#!/bin/bash
# One lent GPU, from the repository root, within 8 minutes: each method's real loop (torchrun, --preset paper: BERT-base
# from random weights, bf16, 4 loader workers; 32 x 512 a step for all three) eager, then with --compile (the encoder
# compiled, and CPDAE's and SEED's vocabulary-sized losses), then, while time is left, COSTA compiled with the
# encoder's dropout drawn by inductor's own generator instead of eager's (what equal-to-eager masks cost); then
# results/gpu/compile_encoder.py: tokens/s and MFU against the nominal bf16 peak and against a bf16 matmul measured on
# the card. Under $OUT (the device tool's; ./results/gpu/out elsewhere), 4 files: compile_encoder.md (the table),
# log.txt (the machine, the parts and their times), loops.txt (every loop's output), runs.tar.gz (each run's
# log.jsonl and config.json). Every part has its own timeout, each cut to what is left of the 8 minutes.
#   bash results/gpu/compile_encoder.sh              # on the GPU
#   DRY=1 bash results/gpu/compile_encoder.sh        # on a CPU: tiny sizes, a few steps: checks that the script works
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-./results/gpu/out}
RUNS=/tmp/compile-encoder-runs   # the runs (weights, checkpoints) stay on the machine; their logs go to $OUT
mkdir -p "$OUT" && rm -rf "$RUNS" && mkdir -p "$RUNS" && : > "$OUT/loops.txt"
T0=$SECONDS
say() { echo "[compile_encoder.sh $((SECONDS - T0)) s] $*" | tee -a "$OUT/log.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/log.txt"
check='import sys, torch, numpy, tokenizers, safetensors; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
if ! timeout 60 python3 -c "$check" 2>&1 | tee -a "$OUT/log.txt"; then
  say "imports failed: pip install -r requirements.txt (at most 30 s)"
  timeout 30 python3 -m pip install -q -r requirements.txt 2>&1 | tail -3 | tee -a "$OUT/log.txt"
  python3 -c "$check" 2>&1 | tee -a "$OUT/log.txt" || { say "imports still fail: stopping"; exit 1; }
fi
if [ -n "$DRY" ]; then   # CPU: tiny model and windows, a few steps, no deadline to speak of
  SIZES="--hidden_size 64 --num_layers 2 --num_heads 2 --ffn_size 128 --max_len 64 --workers 1 --global_batch 8"
  STEPS=(6 4 6); LOG=2; EAGER_S=120; COMPILED_S=400; DEADLINE=3000; TABLE_S=300
else                     # BERT-base (the preset's sizes) at 32 x 512, the issue's size for all three
  SIZES="--global_batch 32"
  STEPS=(120 80 120); LOG=20; EAGER_S=50; COMPILED_S=110; DEADLINE=420; TABLE_S=50   # 420 + 50 s < 8 minutes
fi
COMMON="--preset paper --epochs 0 --log_every $LOG --save_every 100000 --cache_dir /tmp/compile-encoder-cache $SIZES"
left() { echo $((DEADLINE - (SECONDS - T0))); }
loop() {   # method, arm, steps, timeout s, launcher (its script's path follows)
  local limit=$(( $4 < $(left) ? $4 : $(left) ))
  if [ "$limit" -lt 15 ]; then say "$1 $2: skipped, $(left) s left"; return; fi
  say "$1 $2: $3 steps (timeout $limit s)"
  echo "=== $1 $2" >> "$OUT/loops.txt"
  timeout -k 5 "$limit" torchrun --standalone --nproc_per_node=1 $5 "$1.py" $COMMON --steps "$3" \
    --out_dir "$RUNS/$1-$2" --overwrite --compile "$([ "$2" = eager ] && echo false || echo true)" 2>&1 \
    | grep -v "^token cache\|^data:" | tee -a "$OUT/loops.txt"
  say "$1 $2: exit ${PIPESTATUS[0]} (124: stopped by the timeout; its logged steps still count)"
}
i=0
for method in costa cpdae seed; do loop "$method" eager "${STEPS[$i]}" "$EAGER_S"; i=$((i + 1)); done
i=0
for method in costa cpdae seed; do loop "$method" compiled "${STEPS[$i]}" "$COMPILED_S"; i=$((i + 1)); done
loop costa compiled-inductor-rng "${STEPS[0]}" "$COMPILED_S" "results/gpu/compile_encoder.py --inductor_rng"
say "the table (timeout $TABLE_S s)"
timeout -k 5 "$TABLE_S" python3 results/gpu/compile_encoder.py "$RUNS" 2>&1 | grep -v "^token cache\|^data:" \
  | tee "$OUT/compile_encoder.md"
tar -czf "$OUT/runs.tar.gz" -C "$RUNS" $(cd "$RUNS" && ls -d */log.jsonl */config.json 2>/dev/null)
say "done"
