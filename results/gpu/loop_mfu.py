"""The real training loop against research/benchmark.py's step, per method: each run folder's logged tokens/s (its
log.jsonl, the median of its log intervals after the first, which holds the start-up) next to the same model,
batch and precision timed as benchmark.pretrain_step does (no data loader, no logging, no checkpoints), and
both as MFU: FLOPs per token (torch's FlopCounterMode on one step, forward + backward) x tokens/s over the
card's nominal dense bf16 peak (benchmark.NOMINAL_BF16_TFLOPS). results/gpu/loop.sh runs it after the loops.

    python results/gpu/loop_mfu.py RUNS_DIR [--device cuda] [--steps 10 --warmup 3]
"""
import argparse
import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from research import benchmark


def loop_tokens_per_s(folder):
    """Median tokens/s of the run's log intervals after the first (the first holds the start and warm-up)."""
    rows = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows[1:]] or [r["tokens_per_s"] for r in rows]
    return float(np.median(rates)), len(rows), rows[-1]["step"] if rows else 0


def step_row(module, c, device, steps, warmup):
    """benchmark.pretrain_step at the run's config: (tokens/s, FLOPs per token, peak GiB)."""
    torch.manual_seed(0)
    batches = benchmark.load_batches(module, c, 4, n_texts=400)
    step = benchmark.pretrain_step(module, c, batches, device)
    step()
    flops = benchmark.counted_flops(step, optimize=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return tokens / seconds, flops / tokens, peak


def mfu(tokens_per_s, flops_per_token, nominal_tflops):
    return f"{tokens_per_s * flops_per_token / 1e12 / nominal_tflops:.1%}" if nominal_tflops else "?"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", help="a folder of run folders named after their method (costa, cpdae, seed)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    nominal = next((v for k, v in benchmark.NOMINAL_BF16_TFLOPS.items() if k in name), None)
    print(f"{name}: nominal dense bf16 peak {nominal or '?'} TFLOP/s; torch {torch.__version__}")
    print("| method | batch x length | loop steps logged | loop tokens/s | step tokens/s | loop / step | GFLOP per token "
          "| loop MFU | step MFU | step peak GiB |\n|---|---|---|---|---|---|---|---|---|---|")
    for folder in sorted(p for p in Path(args.runs).iterdir() if (p / "log.jsonl").is_file()):
        module = importlib.import_module(folder.name)
        saved = json.loads((folder / "config.json").read_text())
        fields = {f.name for f in dataclasses.fields(module.Config)}
        c = module.Config(**{k: v for k, v in saved.items() if k in fields})
        c.steps = 10 ** 6
        loop, n_logged, last_step = loop_tokens_per_s(folder)
        step, per_token, peak = step_row(module, c, device, args.steps, args.warmup)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"| {folder.name} | {c.batch_size * c.grad_accum} x {c.max_len} | {n_logged} (to step {last_step}) | "
              f"{loop:,.0f} | {step:,.0f} | {loop / step:.2f} | {per_token / 1e9:.3f} | {mfu(loop, per_token, nominal)} | "
              f"{mfu(step, per_token, nominal)} | "
              f"{peak:.1f} |", flush=True)


if __name__ == "__main__":
    main()
