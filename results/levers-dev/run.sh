#!/usr/bin/env bash
# Each pre-training lever's effect on DEV nDCG@10, one run per lever at seed $SEED (0).
# Each run is the study's seed-s command for its arm (results/study/runs/<arm>-seed<s>.json, "commands")
# with one lever undone or changed, so common random numbers pair it with that row: same data order,
# masks, dropout, head init, fine-tuning sample and negatives. Test is never evaluated (--eval_split "").
# Resumable: a lever whose results/levers-dev/<name>/metrics.json exists is skipped.
#   PYTHON=/path/to/python bash results/levers-dev/run.sh
#   SEED=1 ONLY="cpdae-literal" bash results/levers-dev/run.sh    # one lever at another seed (<name>-seed1)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
CORPUS=data/scifact/corpus.jsonl.gz
SEED=${SEED:-0}
COMMON="--init minilm --corpus $CORPUS --lr 5e-05 --seed $SEED --overwrite --bottleneck mean"
lever() {  # name, script, flags
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]] && return
  local name=$1$([ "$SEED" = 0 ] || echo "-seed$SEED")
  local script=$2 flags=$3 out=runs/levers-dev/$name keep=results/levers-dev/$name
  [ -f "$keep/metrics.json" ] && { echo "$name: done"; return; }
  mkdir -p "$out" "$keep"
  echo "$name: $script $flags ($(date -u +%H:%M:%S))"
  $PY "$script" $COMMON --out_dir "$out/pretrain" $flags > "$out/pretrain.log" 2>&1
  $PY finetune.py --init "$out/pretrain/encoder" --seed $SEED --out_dir "$out/finetune" --overwrite \
      --dataset data/scifact --dev_queries 150 --eval_split "" --pooling mean --similarity cos \
      --query_len 64 --passage_len 128 --lr 2e-4 > "$out/finetune.log" 2>&1
  cp "$out/finetune/eval-dev/metrics.json" "$keep/metrics.json.tmp"
  tail -n 1 "$out/pretrain/log.jsonl" > "$keep/pretrain_last_log.json"
  printf '%s\n' "$script $COMMON --out_dir $out/pretrain $flags" > "$keep/command.txt"
  git rev-parse HEAD >> "$keep/command.txt"
  mv "$keep/metrics.json.tmp" "$keep/metrics.json"
  echo "$name: finished ($(date -u +%H:%M:%S))"
}
lever mlm-no-warmup   costa.py "--steps 50 --gwc_weight 0"                                  # vs mlm: heads' warm-up off
lever costa-dot       costa.py "--steps 50 --head_warmup 20 --head_lr 20"                    # vs costa: eq. 8 as published (dot / 0.1)
lever cpdae-literal   cpdae.py "--steps 50 --head_warmup 20 --head_lr 20"                    # vs cpdae: eq. 4 sum, eq. 5 without temperature
lever costa-200-steps costa.py "--steps 200 --head_warmup 20 --head_lr 20 --gwc_sim cos"     # vs costa: 4x the budget
lever mlm-200-steps   costa.py "--steps 200 --head_warmup 20 --head_lr 20 --gwc_weight 0"    # vs mlm: 4x the budget
