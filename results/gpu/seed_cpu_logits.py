"""SEED's CPU step at 4x256 and 6x384: decoder logits in fp32 (autocast off) against autocast's bf16 (as
seed.decoder_loss computes them), alternated
in one process. What it prints is written to results/gpu/seed_cpu_logits.md.
Usage: python results/gpu/seed_cpu_logits.py"""
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import costa
import seed


def old_decoder_loss(states, weight, targets, reduction="mean"):
    targets = targets.reshape(-1)
    with torch.autocast(states.device.type, enabled=False):
        logits = states.float().reshape(-1, states.shape[-1]) @ weight.float().T
        total = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    n_correct = (logits.argmax(-1) == targets).sum()
    if reduction == "sum":
        return total, n_correct
    return total / targets.ne(-100).sum().clamp_min(1), n_correct
new = seed.decoder_loss
with benchmark.recorded(Path(__file__).parent / "seed_cpu_logits.md"):
    for size, fields in (("4x256", {}), ("6x384", benchmark.MINILM)):
        c = seed.Config(**fields); c.steps = 10**6
        torch.manual_seed(0)
        step = benchmark.pretrain_step(seed, c, benchmark.load_batches(seed, c, 4))
        base = benchmark.pretrain_step(costa, costa.Config(gwc_weight=0.0, **fields), benchmark.load_batches(costa, costa.Config(gwc_weight=0.0, **fields), 4))
        times = {"fp32": [], "bf16": [], "mlm": []}
        for fn in (old_decoder_loss, new): seed.decoder_loss = fn; step()
        base()
        for _ in range(4):
            for name, fn in (("fp32", old_decoder_loss), ("bf16", new)):
                seed.decoder_loss = fn; t0 = time.perf_counter(); step(); times[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter(); base(); times["mlm"].append(time.perf_counter() - t0)
        m = {k: 1000 * np.median(v) for k, v in times.items()}
        print(f"{size}: seed fp32 logits {m['fp32']:.0f} ms, bf16 logits {m['bf16']:.0f} ms ({m['fp32']/m['bf16']:.2f}x), MLM-only {m['mlm']:.0f} ms", flush=True)
