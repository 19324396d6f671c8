#!/bin/bash
# Second GPU pass: each method file under torchrun on one GPU for 20 steps
# at the paper preset (teardown without NCCL warnings), where SEED's and CPDAE's GPU steps go (profiler),
# and the test suite on the GPU machine (the two tests of the offline MiniLM package left out: it is not there).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
for m in costa cpdae seed; do
  torchrun --nproc_per_node=1 $m.py --preset paper --epochs 0 --steps 20 --log_every 10 --out_dir /tmp/$m-paper 2>&1 | tee $OUT/${m}_paper.txt
done
python3 results/gpu/gpu_profile.py costa-mlm seed cpdae 2>&1 | grep -v "^token cache\|^data:" | tee $OUT/profile.txt
timeout 300 python3 -m pytest -q -x -p no:cacheprovider test_losses.py test_pipeline.py -k "not minilm_short_name and not minilm_with_a_different" 2>&1 | tee $OUT/pytest_gpu.txt
