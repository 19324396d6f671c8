#!/usr/bin/env bash
# Each paper's mechanism against its own ablation, where its precondition holds: results/mechanisms/plan.md says
# what runs, where, with how many seeds, the gates and the tests; report.py applies it to the rows.
#   decoder side, all-MiniLM-L6-v2 frozen (research.mechanisms --frozen):
#     cpdae-cl-VARIANT / cpdae-nocl-REDUCTION   CPDAE's MLP decoder with and without L_CL (section 3.3)
#     seed-weak / seed-strong                   SEED's decoder, span 2 and full causal (sections 3.2-3.4, Figure 4)
#   encoder side, MiniLM pre-trained further on wiki-train, then fine-tuned on SciFact:
#     costa / mlm / seed                        costa.py, costa.py --gwc_weight 0, seed.py (Figure 5; COSTA 5.4)
# Run from the repository root: bash results/mechanisms/make.sh (PYTHON=... picks the interpreter). It resumes:
# a row in results/mechanisms/rows is never made again, a pre-training run continues from its checkpoint. On a
# fresh clone, with every row committed, it only reprints table.md and the figures (report.py).
# Its budget: at most 4 hours on 2 CPU cores (what it printed on one: results/mechanisms/output.txt).
set -euo pipefail
export PYTHONUNBUFFERED=1   # progress lines reach the log as they come
PY=${PYTHON:-python}
echo "== make.sh started: $(date -u +%H:%M:%S)"   # its time on a machine: from here to its last line
RUNS=runs/mechanisms
OUT=results/mechanisms
ROWS=$OUT/rows
CPDAE_SEEDS=(0 1 2 3 4)
SEED_SEEDS=(0 1 2)
ENCODER_SEEDS=(0 1 2)
# CPDAE's pilot variants, in order of distance from the paper's weights (plan.md)
declare -A CPDAE_FLAGS=([paper]="--rec_reduction sum --cl_tau 1" [mean-l0.003]="--rec_reduction mean --cl_weight 0.003"
                        [mean-l0.01]="--rec_reduction mean --cl_weight 0.01" [mean]="--rec_reduction mean --cl_tau 1"
                        [mean-tau]="--rec_reduction mean --cl_tau 0.02")
CPDAE_ORDER=(paper mean-l0.003 mean-l0.01 mean mean-tau)

prepare() {   # the split by article: train (i % 5 != 4), dev (i % 10 == 4), test (i % 10 == 9)
    [ -f "$RUNS/wiki-test.jsonl" ] && return
    mkdir -p "$RUNS"
    "$PY" -c "
import gzip, sys
lines = gzip.open('data/wiki.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
for name, keep in (('train', lambda i: i % 5 != 4), ('dev', lambda i: i % 10 == 4), ('test', lambda i: i % 10 == 9)):
    open(f'{sys.argv[1]}/wiki-{name}.jsonl', 'w').writelines(l for i, l in enumerate(lines) if keep(i))
    print(name, sum(keep(i) for i in range(len(lines))), 'articles')" "$RUNS"
}

frozen() {   # frozen KIND TAG SEED STEPS EVAL_EVERY FLAGS...: one decoder trial's row (skipped when it is there)
    local kind=$1 tag=$2 seed=$3 steps=$4 every=$5
    shift 5
    [ -f "$ROWS/frozen_$kind-$tag-seed$seed.json" ] && return 0
    prepare
    echo "== $kind $tag seed $seed: $(date -u +%H:%M:%S)"
    "$PY" -m research.mechanisms --model minilm --frozen "$kind" --tag "$tag" --seed "$seed" --steps "$steps" \
        --eval_every "$every" --n_texts 384 --train_corpus "$RUNS/wiki-train.jsonl" --dev_corpus "$RUNS/wiki-dev.jsonl" \
        --corpus "$RUNS/wiki-test.jsonl" --frozen_cache "$RUNS/vectors" --out_dir "$ROWS" "$@"
}

choice() {   # choice WHAT: report.py applies plan.md's rule to the pilot's rows and prints what it chose
    local chosen
    chosen=$("$PY" "$OUT/report.py" "$OUT" --choose "$1")
    [ "$chosen" = pending ] && { echo "$1: the pilot's rows are not all there" >&2; exit 1; }
    echo "$chosen"
}

# CPDAE: the pilot (seed 0, every variant, measured every 100 steps), then the chosen variant and its ablation
for variant in "${CPDAE_ORDER[@]}"; do
    # shellcheck disable=SC2086
    frozen cpdae "cpdae-cl-$variant" 0 600 100 ${CPDAE_FLAGS[$variant]}
done
variant=$(choice cpdae)
echo "== CPDAE: variant '$variant' (plan.md's rule on the pilot's dev rows)"
if [ "$variant" != none ]; then
    reduction=$(echo "${CPDAE_FLAGS[$variant]}" | awk '{print $2}')
    for seed in "${CPDAE_SEEDS[@]}"; do
        # shellcheck disable=SC2086
        frozen cpdae "cpdae-cl-$variant" "$seed" 600 600 ${CPDAE_FLAGS[$variant]}
        frozen cpdae "cpdae-nocl-$reduction" "$seed" 600 600 --rec_reduction "$reduction" --cl_weight 0
    done
fi

# SEED's decoders: the pilot (seed 0, 600 steps, measured every 100), then the other seeds at the chosen step
frozen seed seed-weak 0 600 100 --dec_span 2
frozen seed seed-strong 0 600 100 --dec_span 0
steps=$(choice seed)
echo "== SEED: step '$steps' (plan.md's rule on the pilot's dev rows)"
if [ "$steps" != none ]; then
    for seed in "${SEED_SEEDS[@]:1}"; do
        frozen seed seed-weak "$seed" "$steps" "$steps" --dec_span 2
        frozen seed seed-strong "$seed" "$steps" "$steps" --dec_span 0
    done
fi

# The encoder side: continued pre-training from MiniLM (command 1's settings) on wiki-train
declare -A SCRIPT=([costa]=costa.py [mlm]=costa.py [seed]=seed.py)
declare -A FLAGS=([costa]="--gwc_sim cos" [mlm]="--gwc_weight 0" [seed]="")

step_of() {   # the step of a run folder's checkpoint (0 without one)
    [ -f "$1/state.pt" ] || { echo 0; return; }
    "$PY" -c "import sys, run; print(run.folders.load_training_state(sys.argv[1])['step'])" "$1/state.pt"
}

pretrain() {   # pretrain ARM SEED STEPS [HALT [PREFIX]]: the run, continued from its checkpoint if it has one
    local arm=$1 seed=$2 steps=$3 halt=${4:-0} folder=$RUNS/${5:-enc}-$1-seed$2 start=--overwrite target
    target=$([ "$halt" = 0 ] && echo "$steps" || echo "$halt")
    [ "$(step_of "$folder")" -ge "$target" ] && return 0
    [ -f "$folder/state.pt" ] && start=--resume
    prepare
    echo "== pre-training $arm seed $seed to step $target: $(date -u +%H:%M:%S)"
    # shellcheck disable=SC2086
    "$PY" "${SCRIPT[$arm]}" --init minilm --corpus "$RUNS/wiki-train.jsonl" --lr 5e-5 --steps "$steps" \
        --bottleneck mean --head_warmup 20 --head_lr 20 ${FLAGS[$arm]} --save_every 100 --seed "$seed" \
        --halt_at "$halt" --out_dir "$folder" $start 2>&1 | tee -a "$folder.log" | grep -v "^step " || true
    [ "$(step_of "$folder")" -ge "$target" ] || { echo "$folder: did not reach step $target (see $folder.log)"; exit 1; }
}

heads() {   # heads SPLIT SEED ARM...: each run's own heads on the split's windows, and its random-pair cosine
    local split=$1 seed=$2 models="" tags="" arm
    shift 2
    for arm in "$@"; do models+="${models:+,}$RUNS/enc-$arm-seed$seed/encoder"; tags+="${tags:+,}$arm"; done
    "$PY" -m research.mechanisms --model "$models" --tag "$tags" --heads --corpus "$RUNS/wiki-$split.jsonl" --n_texts 384 \
        --out_dir "$ROWS/heads-$split"
}

finetuned() {   # finetuned ARM SEED: fine-tune the pre-trained encoder as command 1 does; its dev and test rows
    local ft=$RUNS/ft-$1-seed$2 row=$ROWS/finetune-$1-seed$2.json
    [ -f "$row" ] && return 0
    echo "== fine-tuning $1 seed $2: $(date -u +%H:%M:%S)"
    [ -f "$ft/eval-test/metrics.json" ] || "$PY" finetune.py --init "$RUNS/enc-$1-seed$2/encoder" --lr 2e-4 \
        --dev_queries 150 --seed "$2" --out_dir "$ft" --overwrite 2>&1 | grep -v "^step " || true
    "$PY" -c "
import json, sys, data, evaluate
ft, arm, seed, row = sys.argv[1:5]
commit, dirty = evaluate.git_state()
means = {split: json.load(open(f'{ft}/eval-{split}/metrics.json'))['metrics'] for split in ('dev', 'test')}
run.files.atomic_write_json(row, {'measure': 'finetune', 'arm': arm, 'seed': int(seed), 'commit': commit, 'dirty': dirty,
    'command': f'python finetune.py --init {sys.argv[5]} --lr 2e-4 --dev_queries 150 --seed {seed}', **means})
" "$ft" "$1" "$2" "$row" "$RUNS/enc-$1-seed$2/encoder"
}

# the pilot: COSTA and MLM-only at seed 0 on the 200-step schedule, their heads on dev at 100, then (unless the
# gates hold there, and the pilot's runs stop at S = 100) at 200
for halt in 100 200; do
    for arm in costa mlm; do
        [ -f "$ROWS/heads-dev/heads-pilot-$arm-seed0-step$halt.json" ] && continue
        pretrain "$arm" 0 200 "$halt" pilot
        "$PY" -m research.mechanisms --model "$RUNS/pilot-$arm-seed0/encoder" --tag "pilot-$arm" --heads \
            --corpus "$RUNS/wiki-dev.jsonl" --n_texts 384 --out_dir "$ROWS/heads-dev"
    done
    [ "$("$PY" "$OUT/report.py" "$OUT" --choose encoder)" = 100 ] && break
done
steps=$(choice encoder)
echo "== the encoder side: $steps steps (plan.md's rule on the pilot's dev rows)"
if [ "$steps" != none ]; then
    for seed in "${ENCODER_SEEDS[@]}"; do
        [ -f "$ROWS/discrimination-seed-seed$seed.json" ] && continue
        for arm in costa mlm seed; do
            if [ "$seed" = 0 ] && [ "$arm" != seed ] && [ -d "$RUNS/pilot-$arm-seed0" ] && [ ! -e "$RUNS/enc-$arm-seed0" ]; then
                ln -s "pilot-$arm-seed0" "$RUNS/enc-$arm-seed0"   # the pilot's run is that run (stopped at S)
            fi
            pretrain "$arm" "$seed" 200 "$steps"   # plan.md: a 200-step schedule, stopped at S
            [ -f "$ROWS/heads-dev/heads-$arm-seed$seed-step$steps.json" ] || heads dev "$seed" "$arm"
            [ -f "$ROWS/heads-test/heads-$arm-seed$seed-step$steps.json" ] || heads test "$seed" "$arm"
            finetuned "$arm" "$seed"
        done
        "$PY" -m research.mechanisms --model "$RUNS/ft-costa-seed$seed/encoder,$RUNS/ft-mlm-seed$seed/encoder,$RUNS/ft-seed-seed$seed/encoder" \
            --tag costa,mlm,seed --discrimination --dataset data/scifact --split test --out_dir "$ROWS"
    done
fi

"$PY" "$OUT/report.py" "$OUT"   # table.md and the figures from the rows
echo "== make.sh ended: $(date -u +%H:%M:%S)"
