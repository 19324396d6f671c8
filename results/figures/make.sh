#!/usr/bin/env bash
# The three papers' figures from real runs (what each shows: results/figures/README.md):
#   costa_tsne.png          COSTA Figure 3: t-SNE of one SciFact query's top 100, MiniLM before and after COSTA
#   cpdae_words.png         CPDAE Table 4: the word distribution of one text from a CPDAE decoder
#   seed_cls_by_length.png  SEED-Encoder Figure 5: cosine of random text pairs by length, before and after SEED
# Run from the repository root: bash results/figures/make.sh (PYTHON=... picks the interpreter).
# Runs and logs go to runs/figures/, the figures to results/figures/. About an hour on 2 CPU cores.
set -euo pipefail
export PYTHONUNBUFFERED=1   # progress lines reach the log as they come
PY=${PYTHON:-python}
RUNS=runs/figures
FIGS=results/figures
CORPUS=data/scifact/corpus.jsonl.gz
mkdir -p "$RUNS" "$FIGS"
START=$SECONDS

step() {   # step NAME COMMAND...: run it, its output also in $RUNS/NAME.log, and say how long it took
    local name=$1 t0=$SECONDS
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$RUNS/$name.log"
    echo "== $name: $((SECONDS - t0)) s"
}

# Continued pre-training of all-MiniLM-L6-v2 on the SciFact corpus, 50 steps of 32 x 128 tokens at lr 5e-5,
# seed 0, with the study's levers (research/study.py's defaults): the mean of the output tokens is the trained
# vector, the new heads train alone for 20 steps at 20x the lr, and each method's own flags.
PRETRAIN=(--init minilm --corpus "$CORPUS" --lr 5e-5 --steps 50 --seed 0 --overwrite)
LEVERS=(--head_warmup 20 --head_lr 20)
RETRIEVER=(--pooling mean --similarity cos --query_len 64 --passage_len 128)   # README command 1's

# 1. COSTA Figure 3. The pre-training that README command 1 runs (finetune.py --pretrain costa
#    --pretrain_args "--bottleneck mean --head_warmup 20 --head_lr 20 --gwc_sim cos", finetune.pretrain).
step costa "$PY" costa.py "${PRETRAIN[@]}" --bottleneck mean "${LEVERS[@]}" --gwc_sim cos --out_dir "$RUNS/costa"
rm -rf "$RUNS/tsne"
step tsne "$PY" -m research.mechanisms --model "minilm,$RUNS/costa/encoder" --tag "MiniLM,MiniLM + COSTA" --tsne auto \
    --split test "${RETRIEVER[@]}" --out_dir "$RUNS/tsne"
cp "$RUNS"/tsne/tsne-*.png "$FIGS/costa_tsne.png"

# 2. CPDAE Table 4: the study's cpdae arm (python -m research.study --arm_args), and the paper's own Table 4 text
#    (Wikipedia's "Nanotechnology"), which is not in the SciFact corpus.
step cpdae "$PY" cpdae.py "${PRETRAIN[@]}" --bottleneck mean "${LEVERS[@]}" --rec_reduction mean --cl_tau 0.02 \
    --out_dir "$RUNS/cpdae"
TEXT="Nanotechnology raises many of the same issues as any new technology, including concerns about the toxicity \
and environmental impact of nanomaterials, and their potential effects on global economics, as well as speculation"
step words "$PY" -m research.mechanisms --model "$RUNS/cpdae/encoder" --words "$TEXT" --out_dir "$RUNS/words"
cp "$RUNS/words/words.png" "$FIGS/cpdae_words.png"

# 3. SEED-Encoder Figure 5: the study's seed arm (its decoder reads the mean) and the same with the
#    paper's [CLS] bottleneck (python -m research.study --vector cls), against MiniLM, on the SciFact corpus's texts.
step seed "$PY" seed.py "${PRETRAIN[@]}" --bottleneck mean "${LEVERS[@]}" --dec_weight 8 --out_dir "$RUNS/seed"
step seed-cls "$PY" seed.py "${PRETRAIN[@]}" --bottleneck cls "${LEVERS[@]}" --dec_weight 8 --out_dir "$RUNS/seed-cls"
step cls_by_length "$PY" -m research.mechanisms --model "minilm,$RUNS/seed/encoder,$RUNS/seed-cls/encoder" \
    --tag "MiniLM,MiniLM + SEED (mean bottleneck),MiniLM + SEED ([CLS] bottleneck)" --cls_by_length \
    --dataset data/scifact --out_dir "$RUNS/cls_by_length"
cp "$RUNS/cls_by_length/cls_by_length.png" "$FIGS/seed_cls_by_length.png"
cp "$RUNS/cls_by_length/cls_by_length.json" "$FIGS/seed_cls_by_length.json"

echo "== all figures in $FIGS: $((SECONDS - START)) s"
