#!/bin/bash
# On a CPU, the path of frozen_seed.sh end to end and its exactness: the kit (runs/gpu-frozen-seed, as exported)
# placed and the weak decoder's trial run from it, 2 steps with one evaluation of 32 windows a split, against the
# same trial from the MiniLM package and the cached vectors it was exported from (runs/frozen-speed); the rows'
# curves must be equal, every number. What it prints goes to results/gpu/frozen_seed_check.txt.
#   bash results/gpu/frozen_seed_check.sh
set -o pipefail
exec > >(tee results/gpu/frozen_seed_check.txt) 2>&1
echo "== $(date -u +%F\ %H:%M) UTC, code $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- '*.py' '*.sh' || echo +changes), $(lscpu | sed -n 's/^Model name: *//p')"
PY=${PYTHON:-python}; OUT=/tmp/frozen-seed-check; R=runs/frozen-speed
rm -rf "$OUT"; mkdir -p "$OUT"
DEVICE=cpu STEPS=2 EVERY=2 NTEXTS=32 LIMIT=900 OUT=$OUT bash results/gpu/frozen_seed.sh | grep "^\[\|windows$" || exit 1
SEED=$("$PY" -c "import json; print(json.load(open('runs/gpu-frozen-seed/kit.json'))['mask_seed'])")
"$PY" -m research.mechanisms --model minilm --frozen seed --confirm --tag seed-weak --seed "$SEED" --mask_seed "$SEED" --steps 2 \
  --eval_every 2 --n_texts 32 --train_corpus $R/wiki-train.jsonl --dev_corpus $R/wiki-dev.jsonl --corpus $R/wiki-test.jsonl \
  --frozen_cache $R/vectors --out_dir "$OUT/minilm" --dec_span 2 2>&1 | grep -v "^token cache" || exit 1
tar -xzf "$OUT/frozen_seed.tar.gz" -C "$OUT"
"$PY" - "$OUT" "$SEED" <<'EOF'
import json, sys
kit, minilm = (json.load(open(f"{sys.argv[1]}/{d}/frozen_seed-seed-weak-seed{sys.argv[2]}.json")) for d in ("rows", "minilm"))
same = kit["curve"] == minilm["curve"] and kit["settings"] == minilm["settings"]
print(f"kit trial against MiniLM trial: curves {'equal, every number' if same else 'DIFFER'}; train loss "
      f"{kit['curve'][-1]['train_loss']!r} against {minilm['curve'][-1]['train_loss']!r}, dev loss_own "
      f"{kit['curve'][-1]['dev']['loss_own']!r} against {minilm['curve'][-1]['dev']['loss_own']!r}")
sys.exit(0 if same else 1)
EOF
