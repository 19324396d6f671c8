#!/bin/bash
# The study's dev choices on the "none" arm: fine-tuning lr and the vector (mean vs cls); dev split only
cd /work/main
for spec in "0 2e-4 mean" "2 2e-4 mean" "2 4e-4 mean" "0 4e-4 mean" "1 2e-4 mean" "1 4e-4 mean"; do
  set -- $spec
  out=runs/dev/none-s$1-lr$2-$3
  [ -f $out/eval-dev/metrics.json ] && continue
  echo "== $spec $(date +%T)"
  /work/venv/bin/python finetune.py --init minilm --dev_queries 150 --eval_split "" --lr $2 --seed $1 --pooling $3 --similarity cos --out_dir $out --overwrite > $out.log 2>&1
  python3 -c "import json,sys; print(sys.argv[1], json.load(open(sys.argv[1]+'/eval-dev/metrics.json'))['metrics']['NDCG@10'])" $out
done
echo done $(date +%T)
