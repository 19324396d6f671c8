"""The checks of dress_rehearsal.sh for one size: python results/gpu/dress_check.py RUN OUT STEPS LOG_EVERY NPROC TOL.
RUN holds the runs (stopped/: stopped by SIGTERM, then resumed; uninterrupted/), OUT their outputs (stopped.txt,
resumed.txt, uninterrupted.txt). One line per check, then tokens/s; exit code 1 if a check failed."""
import json
import re
import statistics
import sys
from pathlib import Path

run, out = Path(sys.argv[1]), Path(sys.argv[2])
steps, log_every, nproc, tol = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
failed = []


def check(ok, what):
    print(f"{out.name}: {'ok' if ok else 'FAILED'}: {what}", flush=True)
    if not ok:
        failed.append(what)


def text(name):
    path = out / name
    return path.read_text(errors="replace") if path.is_file() else ""


def logged(folder):
    path = run / folder / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# 1. The stop: one line naming the step and the last checkpoint, which state.pt holds
stop = re.search(r"terminated \(SIGTERM\) at step (\d+); (?:last checkpoint at step (\d+)|no checkpoint yet)", text("stopped.txt"))
stopped_at, saved = (int(stop[1]), int(stop[2] or 0)) if stop else (0, 0)
check(stop is not None and 0 < saved <= stopped_at < steps,
      f"SIGTERM stopped the run at step {stopped_at} with its last checkpoint at step {saved}"
      if stop else "the stopped run printed no 'terminated (SIGTERM) at step N; last checkpoint at step M' line")
# 2. The resume: from that checkpoint, to the last step
resumed = re.search(r"resume: \S+ at step (\d+)", text("resumed.txt"))
check(resumed is not None and int(resumed[1]) == saved and "done: " in text("resumed.txt"),
      f"--resume continued from step {resumed[1] if resumed else '?'} and ended ('done:')")
# 3. The log across the stop: every log step once, in order
log, reference = logged("stopped"), logged("uninterrupted")
want = list(range(log_every, steps + 1, log_every))
check([r["step"] for r in log] == want, f"log.jsonl holds steps {log_every}..{steps} every {log_every}, each once "
      f"({len(log)} lines)")
# 4. The losses after the resume are the uninterrupted run's
check([r["step"] for r in reference] == want, "the uninterrupted run logged the same steps")
keys = [k for k in (reference[0] if reference else {}) if k not in ("step", "lr", "head_lr", "tokens_per_s", "elapsed_s")]
# (a logged value is the mean over its interval: the resume's first interval, cut by the checkpoint, is left out)
after = [(a, b) for a, b in zip(log, reference) if a["step"] - log_every >= saved]
worst = max((abs(a[k] - b[k]) / max(abs(b[k]), 1.0), k, a["step"]) for a, b in after for k in keys) if after else (0, "", 0)
check(bool(after) and worst[0] <= tol, f"after the resume, every logged loss and accuracy ({', '.join(keys)}) is the "
      f"uninterrupted run's within {tol:g} (largest difference {worst[0]:.2e}, relative to max(|value|, 1): "
      f"{worst[1]} at step {worst[2]}; {len(after)} logged steps compared)")
# 5. Speed: median tokens/s of the logged intervals (the first after each start left out: it holds the start)
for name, rows in (("uninterrupted", reference[1:]), ("resumed", [r for r in log if r["step"] > saved + log_every])):
    if rows:
        rate = statistics.median(r["tokens_per_s"] for r in rows)
        print(f"{out.name}: {name} run: {rate:,.0f} tokens/s on {nproc} process(es), {rate / nproc:,.0f} per process "
              f"(median of {len(rows)} logged intervals)", flush=True)
for line in text("uninterrupted.txt").splitlines():
    if line.startswith(("model:", "done:")):
        print(f"{out.name}: uninterrupted run: {line}", flush=True)
sys.exit(1 if failed else 0)
