#!/bin/bash
# SEED's two decoders on one GPU, 5,000 steps each: the frozen SEED trial of results/mechanisms/confirm/make.sh
# (python -m research.mechanisms --frozen seed --confirm, seed 5 and its mask draw 5 (the kit's), the weak decoder --dec_span 2 and the
# strong one --dec_span 0, held-out measures on 384 dev and 384 test windows) run 5,000 steps instead of 600, measured
# every 250, with --device cuda. The machine has no MiniLM package and no internet: it reads the kit that
# results/gpu/frozen_seed_kit.py exports here (runs/gpu-frozen-seed: MiniLM's embedding layer and the cached h0
# vectors, exact, packed), carried with the working tree. The whole within 8 minutes, every trial under its own timeout;
# what it writes goes to $OUT (default results/gpu/out): frozen_seed.txt (what it printed) and frozen_seed.tar.gz
# (the two rows, each trial's log, the environment).
#   python results/gpu/frozen_seed_kit.py export --corpora runs/frozen-speed   # first, here (docs/speed.md)
#   bash results/gpu/frozen_seed.sh                                            # on the GPU
#   DEVICE=cpu STEPS=2 EVERY=2 NTEXTS=32 LIMIT=900 bash results/gpu/frozen_seed.sh   # the same path on a CPU
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu/out}
DEVICE=${DEVICE:-cuda}; STEPS=${STEPS:-5000}; EVERY=${EVERY:-250}; LIMIT=${LIMIT:-210}; NTEXTS=${NTEXTS:-384}
WORK=/tmp/frozen-seed-gpu; KIT=runs/gpu-frozen-seed
rm -rf "$WORK"; mkdir -p "$OUT" "$WORK/rows" "$WORK/logs"   # nothing of an earlier run
T0=$SECONDS
say() { echo "[frozen_seed.sh $((SECONDS - T0)) s] $*" | tee -a "$OUT/frozen_seed.txt"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
  timeout 60 python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda",
    torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")'
} 2>&1 | tee "$WORK/logs/env.txt" | tee -a "$OUT/frozen_seed.txt"
[ -f "$KIT/kit.json" ] || { say "no $KIT here: export it first (python results/gpu/frozen_seed_kit.py export) and carry it"; exit 1; }
# the corpora as make.sh's prepare() makes them, from the tracked data/
timeout 60 python3 -c "
import gzip, sys
bundled = gzip.open('data/wiki.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
new = gzip.open('data/wiki-confirm.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
for name, lines, keep in (('train', bundled, lambda i: i % 5 != 4), ('dev', new, lambda k: k % 3 == 0),
                          ('test', new, lambda k: k % 3 != 0)):
    open(f'{sys.argv[1]}/wiki-{name}.jsonl', 'w').writelines(l for i, l in enumerate(lines) if keep(i))" "$WORK" \
  && timeout 120 python3 results/gpu/frozen_seed_kit.py place --corpora "$WORK" --encoder "$WORK/encoder" \
       --cache "$WORK/vectors" 2>&1 \
  | grep -v "^token cache" | tee -a "$OUT/frozen_seed.txt" || { say "the kit could not be placed: stopping"; exit 1; }
status=0
SEED=$(python3 -c "import json; print(json.load(open('$KIT/kit.json'))['mask_seed'])")   # make.sh: --seed = --mask_seed
for arm in weak:2 strong:0; do
  tag=seed-${arm%%:*}; span=${arm##*:}
  say "$tag (--dec_span $span): $STEPS steps on $DEVICE (timeout $LIMIT s)"
  timeout -k 5 "$LIMIT" python3 -m research.mechanisms --model "$WORK/encoder" --frozen seed --confirm --tag "$tag" \
    --seed "$SEED" --mask_seed "$SEED" --steps "$STEPS" --eval_every "$EVERY" --n_texts "$NTEXTS" --train_corpus "$WORK/wiki-train.jsonl" \
    --dev_corpus "$WORK/wiki-dev.jsonl" --corpus "$WORK/wiki-test.jsonl" --frozen_cache "$WORK/vectors" \
    --out_dir "$WORK/rows" --dec_span "$span" --device "$DEVICE" 2>&1 | grep -v "^token cache" | tee "$WORK/logs/$tag.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1
  say "$tag: exit $rc (124: stopped by the timeout; its row is written only at the end)"
  if grep -q "windows encoded" "$WORK/logs/$tag.txt"; then   # the kit's encoder is zeros: never encode with it
    say "$tag encoded windows itself: the kit's vectors were not found, its row is not the trial's"; exit 1
  fi
done
tar -czf "$OUT/frozen_seed.tar.gz" -C "$WORK" rows logs
say "done ($([ $status = 0 ] && echo "both trials ran" || echo "a trial failed: its log is in the tar")): $OUT/frozen_seed.tar.gz"
exit $status
