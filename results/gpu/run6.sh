#!/bin/bash
# Sixth GPU pass (the same machine, right after run5.sh): the real loops of SEED and CPDAE with --compile, paper
# preset, 200 steps each, for their tokens/s against run5.sh's eager loops (loop.sh). faiss from .whl as in run5.sh.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
for m in seed cpdae; do f=""; [ $m = seed ] && f="--global_batch 32"; timeout -k 5 100 torchrun --standalone --nproc_per_node=1 $m.py --preset paper --epochs 0 --steps 200 --log_every 20 --save_every 100000 --cache_dir /tmp/c --compile $f --out_dir /tmp/r-$m --overwrite 2>&1 | grep -v "^token cache\|^data:" | tee $OUT/${m}_compile_loop.txt | tail -14; done
