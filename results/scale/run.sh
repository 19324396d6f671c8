#!/usr/bin/env bash
# Fine-tuning's data path at 1 M and 3 M generated passages: peak RSS per rank and the time to encode the corpus,
# the code before the passage cache (9d6e50b) against this tree, in one run (results/scale/measure.py says how).
# Writes results/scale/measure.md and measure.json; the data, the old code and the runs go to runs/scale-finetune/.
# Run it from anywhere on an otherwise idle machine (the times are the CPU's; the memory is not):
#   bash results/scale/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
python results/scale/measure.py --sizes 1000000,3000000 --before 9d6e50b "$@"
