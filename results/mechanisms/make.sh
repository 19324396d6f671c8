#!/usr/bin/env bash
# Each paper's mechanism against its own ablation (docs/mechanisms.md): six arms, three seeds, one regime.
#   costa / mlm                COSTA and the same run with --gwc_weight 0 (MLM only)
#   seed-weak / seed-strong    SEED-Encoder (span-2 decoder) and the same with --dec_span 0 (full causal)
#   cpdae-cl / cpdae-nocl      CPDAE and the same with --cl_weight 0 (Table 2's "w/o CL")
# The regime: a small BERT (2 layers, H 128) from scratch on 4/5 of the bundled Wikipedia slice, with its
# own 8,192-token WordPiece vocabulary, SEED-Encoder's own setting (from scratch, Wikipedia) at CPU size;
# the other 1/5 of the articles is held out: every measure reads it (or SciFact's test split), never the
# texts trained on. Seed 0 is the pilot: its run stops every PILOT_EVERY steps for its heads' held-out
# losses (mechanisms.py --heads), the curves that say whether STEPS is enough (docs/mechanisms.md); then the
# check: the cheaper pairs (COSTA, CPDAE) again at twice the steps, seed 0, their heads and claims.
# Run from the repository root: bash results/mechanisms/make.sh (PYTHON=... picks the interpreter).
# A run whose rows are in results/mechanisms/rows is not trained again: on a fresh clone this command
# only reprints the tables and figures from the committed rows (report.py). About 80 minutes on 2 CPU cores.
set -euo pipefail
export PYTHONUNBUFFERED=1   # progress lines reach the log as they come
PY=${PYTHON:-python}
RUNS=runs/mechanisms
OUT=results/mechanisms
ROWS=$OUT/rows
STEPS=600
PILOT_EVERY=100
SEEDS=(0 1 2)
ARMS=(costa mlm seed-weak seed-strong cpdae-cl cpdae-nocl)
declare -A SCRIPT=([costa]=costa.py [mlm]=costa.py [seed-weak]=seed.py [seed-strong]=seed.py)
declare -A FLAGS=([costa]="" [mlm]="--gwc_weight 0" [seed-weak]="" [seed-strong]="--dec_span 0")
# CPDAE's pilot (seed 0, STEPS, on the held-out windows): with the paper's temperature (1) -JS / tau spans
# [-0.69, 0] and L_CL cannot leave ln(2m - 1); the study's levers are tried beside it, and the variant
# whose CL head is the most accurate on held-out windows is CPDAE's arm (its ablation adds --cl_weight 0).
declare -A CPDAE_PILOT=([cpdae-paper]="" [cpdae-tau0.02]="--cl_tau 0.02"
                        [cpdae-mean-tau0.02]="--rec_reduction mean --cl_tau 0.02")
for variant in "${!CPDAE_PILOT[@]}"; do SCRIPT[$variant]=cpdae.py; FLAGS[$variant]=${CPDAE_PILOT[$variant]}; done
HELD_OUT=$RUNS/wiki-heldout.jsonl
mkdir -p "$RUNS" "$ROWS"

have_rows() {   # have_rows SEED: every row of this seed is committed
    local seed=$1 arm
    for arm in "${ARMS[@]}"; do [ -f "$ROWS/heads-$arm-seed$seed-step$STEPS.json" ] || return 1; done
    for arm in cpdae-cl cpdae-nocl; do [ -f "$ROWS/word_shares-$arm-seed$seed.json" ] || return 1; done
    for arm in seed-weak seed-strong; do [ -f "$ROWS/decoder_reliance-$arm-seed$seed.json" ] || return 1; done
    for arm in costa mlm seed-weak; do [ -f "$ROWS/discrimination-$arm-seed$seed.json" ] || return 1; done
}

prepare() {   # the split by article (every 5th held out) and the vocabulary of the training part
    [ -f "$HELD_OUT" ] && [ -f "$RUNS/vocab.txt" ] && return
    "$PY" -c "
import gzip, sys
lines = gzip.open('data/wiki.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
open(sys.argv[1], 'w').writelines(l for i, l in enumerate(lines) if i % 5 != 4)
open(sys.argv[2], 'w').writelines(l for i, l in enumerate(lines) if i % 5 == 4)
print(f'{len(lines)} articles: {sum(i % 5 != 4 for i in range(len(lines)))} to train on, '
      f'{sum(i % 5 == 4 for i in range(len(lines)))} held out')" "$RUNS/wiki-train.jsonl" "$HELD_OUT"
    "$PY" data.py "$RUNS/wiki-train.jsonl" "$RUNS/vocab.txt" 8192
}

step_of() {   # the step of a run folder's checkpoint (0 without one)
    [ -f "$1/state.pt" ] || { echo 0; return; }
    "$PY" -c "import sys, run; print(run.load_training_state(sys.argv[1])['step'])" "$1/state.pt"
}

train() {   # train ARM SEED [HALT]: the run, continued from its checkpoint if it has one (ARM-x2: 2 x STEPS)
    local arm=${1%-x2} seed=$2 halt=${3:-0} folder=$RUNS/$1-seed$2 steps=$STEPS start=--overwrite target
    [ "$1" != "$arm" ] && steps=$((2 * STEPS))
    target=$([ "$halt" = 0 ] && echo "$steps" || echo "$halt")
    [ "$(step_of "$folder")" -ge "$target" ] && return 0   # there already (a resume would run past --halt_at)
    [ -f "$folder/state.pt" ] && start=--resume
    # shellcheck disable=SC2086
    "$PY" "${SCRIPT[$arm]}" --corpus "$RUNS/wiki-train.jsonl" --vocab "$RUNS/vocab.txt" --vocab_size 8192 \
        --max_len 128 --max_position 128 --hidden_size 128 --num_layers 2 --num_heads 2 --ffn_size 512 \
        --steps $steps --save_every $PILOT_EVERY --seed "$seed" ${FLAGS[$arm]} --halt_at "$halt" \
        --out_dir "$folder" $start 2>&1 | tee -a "$folder.log" | grep -v "^step " || true
    [ "$(step_of "$folder")" -ge "$target" ] || { echo "$folder: did not reach step $target (see $folder.log)"; exit 1; }
}

models() {   # models SEED ARM...: mechanisms.py's --model and --tag for these arms' encoders at this seed
    local seed=$1 models="" tags="" arm
    shift
    for arm in "$@"; do models+="${models:+,}$RUNS/$arm-seed$seed/encoder"; tags+="${tags:+,}$arm"; done
    echo "--model $models --tag $tags"
}

heads() {   # heads SEED ARM...: each run's own losses on the held-out windows, at its checkpoint's step
    # shellcheck disable=SC2046
    "$PY" mechanisms.py $(models "$@") --heads --corpus "$HELD_OUT" --out_dir "$ROWS"
}

word_shares() {   # word_shares SEED [-x2]: CPDAE's claim
    # shellcheck disable=SC2046
    "$PY" mechanisms.py $(models "$1" "cpdae-cl${2:-}" "cpdae-nocl${2:-}") --word_shares --corpus "$HELD_OUT" --out_dir "$ROWS"
}

discrimination() {   # discrimination SEED ARM...: COSTA's claim, on SciFact's test split
    # shellcheck disable=SC2046
    "$PY" mechanisms.py $(models "$@") --discrimination --dataset data/scifact --split test \
        --pooling cls --query_len 64 --passage_len 128 --out_dir "$ROWS"
}

measure() {   # measure SEED: each claim's rows
    word_shares "$1"
    # shellcheck disable=SC2046
    "$PY" mechanisms.py $(models "$1" seed-weak seed-strong) --decoder_reliance --corpus "$HELD_OUT" --out_dir "$ROWS"
    rm -f "$ROWS/decoder_cosine.png"   # one seed's; report.py draws the mean over the seeds
    discrimination "$1" costa mlm seed-weak
}

# CPDAE's pilot, then its two arms with the variant chosen
for variant in cpdae-paper cpdae-tau0.02 cpdae-mean-tau0.02; do
    [ -f "$ROWS/heads-$variant-seed${SEEDS[0]}-step$STEPS.json" ] && continue
    prepare
    echo "== $variant seed ${SEEDS[0]}: $(date -u +%H:%M:%S)"
    train "$variant" "${SEEDS[0]}"
    heads "${SEEDS[0]}" "$variant"
done
CHOSEN=$("$PY" -c "
import json, sys
rows = [json.load(open(f'{sys.argv[1]}/heads-{v}-seed{sys.argv[2]}-step{sys.argv[3]}.json')) for v in sys.argv[4:]]
print(max(rows, key=lambda r: r['cl_acc'])['arm'])" "$ROWS" "${SEEDS[0]}" "$STEPS" cpdae-paper cpdae-tau0.02 cpdae-mean-tau0.02)
echo "== CPDAE: $CHOSEN (flags: ${CPDAE_PILOT[$CHOSEN]:-none}), the most accurate CL head on the held-out windows"
SCRIPT[cpdae-cl]=cpdae.py; FLAGS[cpdae-cl]=${CPDAE_PILOT[$CHOSEN]}
SCRIPT[cpdae-nocl]=cpdae.py; FLAGS[cpdae-nocl]="${CPDAE_PILOT[$CHOSEN]} --cl_weight 0"

for seed in "${SEEDS[@]}"; do
    have_rows "$seed" && continue
    prepare
    for arm in "${ARMS[@]}"; do
        echo "== $arm seed $seed: $(date -u +%H:%M:%S)"
        if [ "$seed" = "${SEEDS[0]}" ]; then   # the pilot: held-out heads every PILOT_EVERY steps
            for ((halt = PILOT_EVERY; halt < STEPS; halt += PILOT_EVERY)); do
                [ -f "$ROWS/heads-$arm-seed$seed-step$halt.json" ] && continue
                [ "$(step_of "$RUNS/$arm-seed$seed")" -le "$halt" ] || { echo "$arm: past step $halt"; exit 1; }
                train "$arm" "$seed" "$halt"
                heads "$seed" "$arm"
            done
        fi
        train "$arm" "$seed"
    done
    heads "$seed" "${ARMS[@]}"
    measure "$seed"
done

# The check of STEPS: COSTA and CPDAE, both arms, seed 0, at twice the steps (SEED's pair, the costliest
# by far, is not: docs/mechanisms.md gives its pilot curve instead).
if [ ! -f "$ROWS/discrimination-mlm-x2-seed${SEEDS[0]}.json" ]; then
    prepare
    for arm in costa-x2 mlm-x2 cpdae-cl-x2 cpdae-nocl-x2; do
        echo "== $arm seed ${SEEDS[0]}: $(date -u +%H:%M:%S)"
        train "$arm" "${SEEDS[0]}"
    done
    heads "${SEEDS[0]}" costa-x2 mlm-x2 cpdae-cl-x2 cpdae-nocl-x2
    word_shares "${SEEDS[0]}" -x2
    discrimination "${SEEDS[0]}" costa-x2 mlm-x2
fi

# CPDAE's Table 4 text with and without CL (seed 0); it needs the models. (COSTA's Figure 3 is not drawn:
# pick_tsne_query's rule, a query with a relevant document in every model's top 100, finds none here.)
if [ ! -f "$OUT/cpdae_words-cl.png" ] || [ ! -f "$OUT/cpdae_words-nocl.png" ]; then
    TEXT="Nanotechnology raises many of the same issues as any new technology, including concerns about the toxicity \
and environmental impact of nanomaterials, and their potential effects on global economics, as well as speculation"
    for arm in cpdae-cl cpdae-nocl; do
        "$PY" mechanisms.py --model "$RUNS/$arm-seed${SEEDS[0]}/encoder" --words "$TEXT" --out_dir "$RUNS/words-$arm"
        cp "$RUNS/words-$arm/words.png" "$OUT/cpdae_words-${arm#cpdae-}.png"
    done
fi

"$PY" "$OUT/report.py" "$OUT"   # the tables (table.md) and the figures from the rows
