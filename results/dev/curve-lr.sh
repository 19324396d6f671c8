#!/usr/bin/env bash
# The study's 50-query curve: is the full-data recipe (lr 2e-4, 40 steps) the right one for 50 queries?
# The "none" arm fine-tuned on the curve's own 50-query samples (--n_queries 50 --steps 40, as research/study.py's
# curve runs) at lower lrs, scored on DEV only (--eval_split ""); the study's curve rows hold lr 2e-4.
#   PYTHON=/path/to/python bash results/dev/curve-lr.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
for spec in "0 5e-5" "1 5e-5" "0 2e-5" "1 2e-5"; do
  set -- $spec
  name=none-n50-s$1-lr$2 out=runs/dev/none-n50-s$1-lr$2 keep=results/dev/none-n50-s$1-lr$2
  [ -f "$keep/metrics.json" ] && { echo "$name: done"; continue; }
  mkdir -p "$out" "$keep"
  echo "$name ($(date -u +%T))"
  $PY finetune.py --init minilm --seed $1 --out_dir "$out" --overwrite --dataset data/scifact --dev_queries 150 \
      --eval_split "" --pooling mean --similarity cos --query_len 64 --passage_len 128 --lr $2 \
      --n_queries 50 --steps 40 > "$out.log" 2>&1
  cp "$out/config.json" "$keep/config.json"
  cp "$out/eval-dev/metrics.json" "$keep/metrics.json"
  python3 -c "import json,sys; print(sys.argv[1], json.load(open(sys.argv[1]+'/metrics.json'))['metrics']['NDCG@10'])" "$keep"
done
