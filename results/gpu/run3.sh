#!/bin/bash
# Third GPU pass: where the GPU steps go (profiler), torchrun with more processes than GPUs (one line, exit 1),
# and the test suite on the GPU machine (a CPU suite: conftest hides the GPU; the offline MiniLM package is absent there).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 results/gpu/gpu_profile.py costa-mlm seed cpdae 2>&1 | grep -v "^token cache\|^data:" | tee $OUT/profile.txt
torchrun --nproc_per_node=2 costa.py --steps 2 --out_dir /tmp/two > $OUT/two_on_one_gpu.txt 2>&1; echo "exit code $?" >> $OUT/two_on_one_gpu.txt
cat $OUT/two_on_one_gpu.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider test_losses.py test_pipeline.py -k "not minilm_short_name and not minilm_with_a_different" 2>&1 | tee $OUT/pytest_gpu.txt | tail -15
