#!/bin/bash
# Fifth GPU pass, one call: results/gpu/loop.sh (each method's real loop, --preset paper) then results/gpu/compile.sh
# (python -m research.benchmark --gpu, eager against --compile). faiss-cpu travels as a wheel in .whl/ (the machine reaches no index).
# The device tool brings back at most 8 files: the scripts write to a scratch folder, which is packed into one
# archive beside the few text files a reader opens first.
set -o pipefail
export PYTHONUNBUFFERED=1
FINAL=${OUT:-results/gpu/out}
export OUT=/tmp/gpu5
mkdir -p "$OUT" "$FINAL"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
git log -1 --format='commit %H' 2>/dev/null | tee "$OUT/commit.txt"
timeout -k 5 250 bash results/gpu/loop.sh
timeout -k 5 260 bash results/gpu/compile.sh
tar -czf "$FINAL/gpu5.tgz" -C "$OUT" .
cp "$OUT"/loop_mfu.txt "$OUT"/loop.txt "$OUT"/benchmark_gpu_compile.txt "$OUT"/env.txt "$FINAL"/ 2>/dev/null
ls -la "$FINAL"
