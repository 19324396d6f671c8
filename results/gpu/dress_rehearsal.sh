#!/bin/bash
# The multi-GPU dress rehearsal, from the repository root, in one call (about 4 minutes on GPUs): costa.py under
# torchrun on every GPU of the machine (4, or 1), for a few hundred steps at each size of $SIZES; a SIGTERM to the
# whole process group mid-run, as Slurm sends at a time limit or a preemption; the same command with --resume; and
# an uninterrupted run with the same flags beside it. dress_check.py then checks, for each size, that
#   - the stopped run said "terminated (SIGTERM) at step N; last checkpoint at step M" and its checkpoint holds M;
#   - the resumed run said "resume: ... at step M" and ended at the last step;
#   - log.jsonl holds every log step once, in order, across the stop;
#   - the losses logged after the resume are the uninterrupted run's (batches, masks, dropout are functions of the
#     step: equal on the CPU, within TOL on GPUs, whose reductions are not bit-reproducible);
# and prints tokens/s (median of the logged intervals, and per GPU). Outputs under $OUT (the device tool's;
# ./results/gpu/out elsewhere): dress_rehearsal.txt (what it printed) and each run's output, log.jsonl and
# config.json; the runs themselves (weights, checkpoints) stay in $WORK. Every part has its own timeout.
#   bash results/gpu/dress_rehearsal.sh                      # a GPU machine: every GPU (NPROC=N to choose)
#   CPU=1 nice -n 10 bash results/gpu/dress_rehearsal.sh     # a CPU: 2 gloo ranks, a tiny model, 60 steps
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-./results/gpu/out}; WORK=${WORK:-/tmp/dress-rehearsal}; PY=${PY:-python3}
rm -rf "$WORK"; mkdir -p "$OUT" "$WORK"
T0=$SECONDS
say() { echo "[dress_rehearsal.sh $((SECONDS - T0)) s] $*" | tee -a "$OUT/dress_rehearsal.txt"; }
if [ -n "$CPU" ]; then       # the dry run: gloo on the CPU, a tiny model, a few seconds a run
  export CUDA_VISIBLE_DEVICES=""
  NPROC=${NPROC:-2}; SIZES=${SIZES:-tiny}; TOL=${TOL:-1e-5}; LIMIT=${LIMIT:-300}
else
  NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")}; SIZES=${SIZES:-"small base"}; TOL=${TOL:-0.05}
  LIMIT=${LIMIT:-150}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/dress_rehearsal.txt"
fi
$PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
  "GPUs", torch.cuda.device_count())' 2>&1 | tee -a "$OUT/dress_rehearsal.txt"
[ "$NPROC" -ge 1 ] 2>/dev/null || { say "no GPU found (nvidia-smi -L); CPU=1 runs the dry run"; exit 1; }

# size: flags; steps; SIGTERM once this step is logged; checkpoint every; log every
flags() {
  case $1 in
    tiny)  echo "--hidden_size 32 --num_layers 2 --num_heads 2 --ffn_size 64 --max_len 64 --batch_size 4 --workers 1 \
                 --prep_workers 1|60|30|20|2" ;;
    small) echo "--hidden_size 256 --num_layers 4 --num_heads 4 --ffn_size 1024 --max_len 128 --batch_size 32 \
                 --workers 2|400|200|100|10" ;;
    base)  echo "--preset paper --epochs 0 --max_len 512 --batch_size 32 --workers 4 --save_minutes 0 --keep_last 1 \
                 --compile false|300|150|100|10" ;;   # BERT-base from random weights, 32 x 512 per GPU
  esac
}
# torchrun under a timeout, which leads a process group of its own (torchrun, its ranks, their loader workers) and,
# once signalled, kills what is left 30 s later, as Slurm does after its KillWait (default 30 s)
TORCHRUN=(timeout -k 30 "$LIMIT" $PY -m torch.distributed.run --standalone --nproc_per_node="$NPROC")
status=0
for size in $SIZES; do
  IFS="|" read -r sizing steps stop_at save log <<< "$(flags "$size")"
  run="$WORK/$size"; mkdir -p "$OUT/$size"
  common=(costa.py $sizing --steps "$steps" --save_every "$save" --log_every "$log" --cache_dir "$WORK/cache")
  say "$size: $NPROC process(es), $steps steps, SIGTERM to the process group once step $stop_at is logged"
  "${TORCHRUN[@]}" "${common[@]}" --out_dir "$run/stopped" > "$OUT/$size/stopped.txt" 2>&1 &
  pid=$!                                # timeout's pid: its process group's id
  until grep -q "\"step\": $stop_at," "$run/stopped/log.jsonl" 2>/dev/null || ! kill -0 "$pid" 2>/dev/null; do
    sleep 0.2
  done
  kill -TERM -- "-$pid" 2>/dev/null     # to every process of the run at once, as Slurm does
  sent=$SECONDS; wait "$pid"; code=$?
  say "$size: the stopped run exited with $code $((SECONDS - sent)) s after the SIGTERM (torchrun's own traceback of" \
      "its SignalException is expected); rank 0: $(grep -o "terminated (SIGTERM).*" "$OUT/$size/stopped.txt")"
  "${TORCHRUN[@]}" "${common[@]}" --out_dir "$run/stopped" --resume > "$OUT/$size/resumed.txt" 2>&1
  say "$size: the resumed run exited with $?"
  "${TORCHRUN[@]}" "${common[@]}" --out_dir "$run/uninterrupted" > "$OUT/$size/uninterrupted.txt" 2>&1
  say "$size: the uninterrupted run exited with $?"
  for r in stopped uninterrupted; do cp "$run/$r/log.jsonl" "$OUT/$size/$r.log.jsonl" 2>/dev/null; done
  cp "$run/stopped/config.json" "$OUT/$size/" 2>/dev/null
  timeout 120 $PY results/gpu/dress_check.py "$run" "$OUT/$size" "$steps" "$log" "$NPROC" "$TOL" 2>&1 \
    | tee -a "$OUT/dress_rehearsal.txt" || status=1
done
say "done: $([ $status = 0 ] && echo "every check passed" || echo "a check FAILED (above)")"
exit $status
