#!/usr/bin/env bash
# Command 1 of README.md, exactly as written there, with what it prints and the small files it writes kept
# here: output.txt (its printed output), machine.json (commit, command, CPU, bf16 support, date), and for
# each evaluated row its metrics.json (means and per-query values of every metric) and run.trec.gz (each
# query's top 100 of the ranked list, enough to score MRR@10, Recall@100 and nDCG@10 again).
# The run folder is finetune.py's default, runs/finetune, which must not exist yet (model weights stay there).
#
#     bash results/quickstart/run.sh          # from the repository root; output.txt records 702 s (12 min) on 2 quiet cores
set -euo pipefail
export PYTHONUNBUFFERED=1   # output.txt keeps the order in which lines were printed
cd "$(dirname "$0")/../.."
here=results/quickstart
run=runs/finetune
py=${PYTHON:-python}
if [ -e "$run" ]; then echo "$run exists: move it away first (command 1 writes there)" >&2; exit 1; fi
cmd=(finetune.py --pretrain costa --lr 2e-4 --dev_queries 150
     --pretrain_args "--bottleneck mean --head_warmup 20 --head_lr 20 --gwc_sim cos")
"$py" -c 'import json, sys; from research import benchmark; print(json.dumps(benchmark.machine(sys.argv[1]), indent=1))' \
    'python finetune.py --pretrain costa --lr 2e-4 --dev_queries 150 --pretrain_args "--bottleneck mean --head_warmup 20 --head_lr 20 --gwc_sim cos"' \
    > "$here/machine.json"
start=$(date +%s)
"$py" "${cmd[@]}" 2>&1 | tee "$here/output.txt"
echo "wall clock: $(( $(date +%s) - start )) s" >> "$here/output.txt"
# the evaluated rows: BM25, zero-shot, fine-tuned, COSTA + fine-tuned (test), and the dev evaluations
rm -rf "$here/rows"
for f in $(cd "$run" && find . -name metrics.json -path '*eval-*' | sort); do
    d=$here/rows/$(dirname "${f#./}")
    mkdir -p "$d"
    cp "$run/$f" "$d/metrics.json"
    awk '$4 <= 100' "$run/$(dirname "$f")/run.trec" | gzip -9n > "$d/run.trec.gz"   # each query's top 100
done
