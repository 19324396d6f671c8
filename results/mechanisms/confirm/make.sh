#!/usr/bin/env bash
# The confirmatory mechanisms round: every run plan.md fixes (read it first), on the new held-out texts
# (data/wiki-confirm.jsonl.gz), seeds 5-9, no pilot and no choice:
#   decoder side, all-MiniLM-L6-v2 frozen (research.mechanisms --frozen --confirm, --mask_seed = the seed):
#     cpdae-cl / cpdae-nocl / cpdae-control   CPDAE's MLP decoder, eq. 4 averaged, lambda 0.003 / 0 / 0.003 with
#                                             positives from other texts (section 3.3)
#     seed-weak / seed-strong                 SEED's decoder, span 2 and full causal (sections 3.2-3.4, Figure 4)
#   encoder side: mlm / seed                  MiniLM pre-trained further on wiki-train (costa.py --gwc_weight 0,
#                                             seed.py), 100 steps of a 200-step schedule; Figure 5's cosine
#   exploratory, last: cpdae-l0.001 / cpdae-l0.01 / cpdae-l0.03 at seeds 5-7 (the lambda series)
# Run from the repository root: bash results/mechanisms/confirm/make.sh (PYTHON=... picks the interpreter). Before
# its first row it writes plan.md's sha256 to rows/PLAN.sha256, and it stops in one line if plan.md has changed
# since. It resumes: a row in rows/ is never made again, a pre-training run continues from its checkpoint, the
# encoder's vectors of each seed's mask draw are computed once (runs/mechanisms-confirm/vectors). What it prints
# while it has rows to make goes to output.txt as well (appended, with times); with every row there (a fresh
# clone of the finished round) it only reprints table.md and the figures, and writes nothing else.
# Its budget, from the first round's rows (`seconds`) and output.txt on this 2-core machine (in seconds): the
# vectors of one seed's draw ~435 (wiki-train 351, the new dev and test ~85) x 5 = 2,200; CPDAE 5 x (CL 220 +
# no CL 160 + control 220, each + ~15 for the rank measures) = 3,200; SEED 10 trials of 600 steps: 1,437-2,053 s
# each in the first round (measured 6 times there, once here), at most a third of that with the frozen SEED
# trial's speed-up (<= 5,800); Figure 5 5 x (MLM-only 160 + SEED 540 + heads 150) = 4,250: the primary rows
# ~4.3 hours, the lambda series 9 x 235 = 2,100 more: ~4.9 hours in all, on a machine no one else uses. Without
# the SEED speed-up its trials take up to ~17,500 s and the round ~8 hours (the primary rows ~7.5): then run it
# in two sittings (it resumes).
set -euo pipefail
export PYTHONUNBUFFERED=1   # progress lines reach the log as they come
PY=${PYTHON:-python}
RUNS=runs/mechanisms-confirm
OUT=results/mechanisms/confirm
ROWS=$OUT/rows
SEEDS=(5 6 7 8 9)
SERIES_SEEDS=(5 6 7)
CPDAE="--rec_reduction mean --cl_tau 1"   # plan.md: eq. 4 averaged over |V|, eq. 5's s = -JS
declare -A ARM_FLAGS=([cpdae-cl]="$CPDAE --cl_weight 0.003" [cpdae-nocl]="$CPDAE --cl_weight 0"
                      [cpdae-control]="$CPDAE --cl_weight 0.003 --cl_positive other"
                      [cpdae-l0.001]="$CPDAE --cl_weight 0.001" [cpdae-l0.01]="$CPDAE --cl_weight 0.01"
                      [cpdae-l0.03]="$CPDAE --cl_weight 0.03" [seed-weak]="--dec_span 2" [seed-strong]="--dec_span 0")

# the plan binds: its sha256 stamped before the first row, checked on every start (report.py says why, in one line)
if [ ! -f "$ROWS/PLAN.sha256" ] && [ -z "$(find "$ROWS" -name '*.json' 2>/dev/null | head -1)" ]; then
    mkdir -p "$ROWS"
    sha256sum "$OUT/plan.md" | awk '{print $1}' > "$ROWS/PLAN.sha256"
fi
"$PY" "$OUT/report.py" "$OUT" --check
if [ "$("$PY" "$OUT/report.py" "$OUT" --missing)" = 0 ]; then
    "$PY" "$OUT/report.py" "$OUT"   # every row is there: table.md and the figures, nothing trained
    exit 0
fi
exec > >(tee -a "$OUT/output.txt") 2>&1
echo "== make.sh started: $(date -u +%H:%M:%S) (code $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"

prepare() {   # wiki-train as the first round's (the bundled slice's i % 5 != 4); dev and test: the new texts
    [ -f "$RUNS/wiki-test.jsonl" ] && return
    mkdir -p "$RUNS"
    "$PY" -c "
import gzip, sys, data, run
bundled = gzip.open('data/wiki.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
new = gzip.open('data/wiki-confirm.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
for name, lines, keep in (('train', bundled, lambda i: i % 5 != 4), ('dev', new, lambda k: k % 3 == 0),
                          ('test', new, lambda k: k % 3 != 0)):
    path = f'{sys.argv[1]}/wiki-{name}.jsonl'
    open(path, 'w').writelines(l for i, l in enumerate(lines) if keep(i))
    print(name, sum(keep(i) for i in range(len(lines))), 'articles,',
          len(run.cache.token_windows(path, data.VOCAB, 128, 0, '')), 'windows of 128 tokens')" "$RUNS"
}

frozen() {   # frozen KIND ARM SEED: one decoder trial's row (skipped when it is there), judged at step 600
    local kind=$1 arm=$2 seed=$3
    [ -f "$ROWS/frozen_$kind-$arm-seed$seed.json" ] && return 0
    prepare
    echo "== $arm seed $seed: $(date -u +%H:%M:%S)"
    # shellcheck disable=SC2086
    "$PY" -m research.mechanisms --model minilm --frozen "$kind" --confirm --tag "$arm" --seed "$seed" --mask_seed "$seed" \
        --steps 600 --eval_every 600 --n_texts 384 --train_corpus "$RUNS/wiki-train.jsonl" \
        --dev_corpus "$RUNS/wiki-dev.jsonl" --corpus "$RUNS/wiki-test.jsonl" --frozen_cache "$RUNS/vectors" \
        --out_dir "$ROWS" ${ARM_FLAGS[$arm]}
}

declare -A SCRIPT=([mlm]=costa.py [seed]=seed.py)
declare -A FLAGS=([mlm]="--gwc_weight 0" [seed]="")

step_of() {   # the step of a run folder's checkpoint (0 without one)
    [ -f "$1/state.pt" ] || { echo 0; return; }
    "$PY" -c "import sys, run; print(run.folders.load_training_state(sys.argv[1])['step'])" "$1/state.pt"
}

pretrain() {   # pretrain ARM SEED: command 1's settings, the schedule of 200 steps stopped at step 100 (plan.md)
    local arm=$1 seed=$2 folder=$RUNS/enc-$1-seed$2 start=--overwrite
    [ "$(step_of "$folder")" -ge 100 ] && return 0
    [ -f "$folder/state.pt" ] && start=--resume
    prepare
    echo "== pre-training $arm seed $seed to step 100: $(date -u +%H:%M:%S)"
    # shellcheck disable=SC2086
    "$PY" "${SCRIPT[$arm]}" --init minilm --corpus "$RUNS/wiki-train.jsonl" --lr 5e-5 --steps 200 --halt_at 100 \
        --bottleneck mean --head_warmup 20 --head_lr 20 ${FLAGS[$arm]} --save_every 100 --seed "$seed" \
        --out_dir "$folder" $start 2>&1 | tee -a "$folder.log" | grep -v "^step " || true
    [ "$(step_of "$folder")" -ge 100 ] || { echo "$folder: did not reach step 100 (see $folder.log)"; exit 1; }
}

heads() {   # heads ARM SEED SPLIT: the run's own heads on the split's windows and its random-pair cosine by length
    [ -f "$ROWS/heads-$3/heads-$1-seed$2-step100.json" ] && return 0
    "$PY" -m research.mechanisms --model "$RUNS/enc-$1-seed$2/encoder" --tag "$1" --heads --corpus "$RUNS/wiki-$3.jsonl" \
        --n_texts 384 --out_dir "$ROWS/heads-$3"
}

# the primary rows, a seed at a time (one draw of the masked views, its vectors computed once, serves all its trials)
for seed in "${SEEDS[@]}"; do
    for arm in cpdae-cl cpdae-nocl cpdae-control; do frozen cpdae "$arm" "$seed"; done
    for arm in seed-weak seed-strong; do frozen seed "$arm" "$seed"; done
done
for seed in "${SEEDS[@]}"; do
    for arm in mlm seed; do
        pretrain "$arm" "$seed"
        heads "$arm" "$seed" dev
        heads "$arm" "$seed" test
    done
done
# exploratory, last: the lambda series' other weights
for seed in "${SERIES_SEEDS[@]}"; do
    for arm in cpdae-l0.001 cpdae-l0.01 cpdae-l0.03; do frozen cpdae "$arm" "$seed"; done
done

"$PY" "$OUT/report.py" "$OUT"   # table.md and the figures from the rows, judged by plan.md's block
echo "== make.sh ended: $(date -u +%H:%M:%S)"
