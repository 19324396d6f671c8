#!/usr/bin/env bash
# The matched round: every run plan.md fixes (read it first), on new held-out texts (data/wiki-matched.jsonl.gz),
# seeds 10-14, no pilot and no choice. CPDAE's decoder on all-MiniLM-L6-v2 frozen (research.mechanisms --frozen
# cpdae --confirm, --mask_seed = the seed), eq. 4 averaged, lambda 0.003:
#   cpdae-cl        each text's first view's positive: its own second view (the confirmatory round's CL arm)
#   cpdae-matched   the CL arm's windows in its order, the positive: the next window's second view (--cl_positive matched)
# Run from the repository root: bash results/mechanisms/matched/make.sh (PYTHON=... picks the interpreter). Before
# its first row it writes plan.md's sha256 to rows/PLAN.sha256, and stops in one line if plan.md has changed since.
# It resumes: a row in rows/ is never made again, each seed's vectors are computed once (runs/mechanisms-matched/
# vectors). What it prints while it has rows to make goes to output.txt too (appended, with times); with every row
# there it only reprints table.md and the figure.
# Its budget on this 2-core machine, from the confirmatory round's output.txt: the vectors of one seed's draw ~435 s
# (wiki-train ~350, the new dev and test ~85) x 5 = 2,200 s; 10 trials of ~235 s = 2,350 s: about 75 minutes.
set -euo pipefail
export PYTHONUNBUFFERED=1   # progress lines reach the log as they come
PY=${PYTHON:-python}
RUNS=runs/mechanisms-matched
OUT=results/mechanisms/matched
ROWS=$OUT/rows
SEEDS=(10 11 12 13 14)
CPDAE="--rec_reduction mean --cl_tau 1 --cl_weight 0.003"   # plan.md: eq. 4 averaged over |V|, eq. 5's s = -JS
declare -A ARM_FLAGS=([cpdae-cl]="$CPDAE" [cpdae-matched]="$CPDAE --cl_positive matched")

# the plan binds: its sha256 stamped before the first row, checked on every start (report.py says why, in one line)
if [ ! -f "$ROWS/PLAN.sha256" ] && [ -z "$(find "$ROWS" -name '*.json' 2>/dev/null | head -1)" ]; then
    mkdir -p "$ROWS"
    sha256sum "$OUT/plan.md" | awk '{print $1}' > "$ROWS/PLAN.sha256"
fi
"$PY" "$OUT/report.py" "$OUT" --check
if [ "$("$PY" "$OUT/report.py" "$OUT" --missing)" = 0 ]; then
    "$PY" "$OUT/report.py" "$OUT"   # every row is there: table.md and the figure, nothing trained
    exit 0
fi
exec > >(tee -a "$OUT/output.txt") 2>&1
echo "== make.sh started: $(date -u +%H:%M:%S) (code $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"

prepare() {   # wiki-train as the confirmatory round's (the bundled slice's i % 5 != 4); dev and test: the new texts
    [ -f "$RUNS/wiki-test.jsonl" ] && return
    mkdir -p "$RUNS"
    "$PY" -c "
import gzip, sys, data, run
bundled = gzip.open('data/wiki.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
new = gzip.open('data/wiki-matched.jsonl.gz', 'rt', encoding='utf-8').read().splitlines(keepends=True)
for name, lines, keep in (('train', bundled, lambda i: i % 5 != 4), ('dev', new, lambda k: k % 3 == 0),
                          ('test', new, lambda k: k % 3 != 0)):
    path = f'{sys.argv[1]}/wiki-{name}.jsonl'
    open(path, 'w').writelines(l for i, l in enumerate(lines) if keep(i))
    print(name, sum(keep(i) for i in range(len(lines))), 'articles,',
          len(run.cache.token_windows(path, data.VOCAB, 128, 0, '')), 'windows of 128 tokens')" "$RUNS"
}

frozen() {   # frozen ARM SEED: one decoder trial's row (skipped when it is there), judged at step 600
    local arm=$1 seed=$2
    [ -f "$ROWS/frozen_cpdae-$arm-seed$seed.json" ] && return 0
    prepare
    echo "== $arm seed $seed: $(date -u +%H:%M:%S)"
    # shellcheck disable=SC2086
    "$PY" -m research.mechanisms --model minilm --frozen cpdae --confirm --tag "$arm" --seed "$seed" --mask_seed "$seed" \
        --steps 600 --eval_every 600 --n_texts 384 --train_corpus "$RUNS/wiki-train.jsonl" \
        --dev_corpus "$RUNS/wiki-dev.jsonl" --corpus "$RUNS/wiki-test.jsonl" --frozen_cache "$RUNS/vectors" \
        --out_dir "$ROWS" ${ARM_FLAGS[$arm]}
}

for seed in "${SEEDS[@]}"; do
    for arm in cpdae-cl cpdae-matched; do frozen "$arm" "$seed"; done
done

"$PY" "$OUT/report.py" "$OUT"   # table.md and the figure from the rows, judged by plan.md's block
echo "== make.sh ended: $(date -u +%H:%M:%S)"
