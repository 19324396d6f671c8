#!/bin/bash
# usage: _wip/run.sh NAME METHOD flags...   (batch 32 x 128, lr 5e-5 as finetune.pretrain, SciFact corpus, MiniLM)
name=$1; method=$2; shift 2
OMP_NUM_THREADS=1 nice -n 10 /work/venv/bin/python $method.py --init minilm --corpus data/scifact/corpus.jsonl.gz --lr 5e-5 \
  --out_dir runs/lev_$name --overwrite --log_every 10 --save_every 1000 "$@" > _wip/log_$name.txt 2>&1
echo "$name $method $*" >> _wip/commands.txt
