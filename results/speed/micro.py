"""The encoder's own dropout and attention, each against what it replaced (torch's bernoulli_, F.dropout,
scaled_dot_product_attention), on a MiniLM-size attention map (32 x 12 heads x 128 x 128), and a fused QKV
projection against the three the encoder has; under bf16 autocast where the CPU has it, forward + backward,
round-robin in this process, median of 7. What it prints is written to
results/speed/micro.md.

    python results/speed/micro.py
"""
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import costa


def micro_table(reps=7):
    torch.manual_seed(0)
    p, (B, heads, L, d) = 0.1, (32, 12, 128, 32)
    bf16 = benchmark.cpu_bf16()
    dtype = torch.bfloat16 if bf16 else torch.float32              # what the linear layers hand over
    q, k, v = (torch.randn(B, heads, L, d).to(dtype).requires_grad_() for _ in range(3))
    x = torch.randn(32, 128, 384).to(dtype).requires_grad_()
    attend = torch.ones(B, 1, 1, L, dtype=torch.bool)
    separate, fused = [torch.nn.Linear(384, 384) for _ in range(3)], torch.nn.Linear(384, 3 * 384)
    cases = {"mask only (32, 12, 128, 128): torch's bernoulli_":
                 lambda: torch.empty(B, heads, L, L, dtype=dtype).bernoulli_(1 - p),
             "mask only (32, 12, 128, 128): costa.drop_mask": lambda: costa.drop_mask((B, heads, L, L), p),
             "dropout (32, 128, 384): F.dropout (bernoulli_)": lambda: F.dropout(x, p, True),
             "dropout (32, 128, 384): costa.dropout (PCG64 mask)": lambda: costa.dropout(x, p, True),
             "attention (32, 12, 128, 32), dropout 0.1: F.scaled_dot_product_attention":
                 lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p),
             "attention (32, 12, 128, 32), dropout 0.1: costa.attention": lambda: costa.attention(q, k, v, attend, p),
             "q, k, v projections of (32, 128, 384): three Linear(384, 384), as the encoder has them":
                 lambda: sum(lin(x) for lin in separate),                       # q + k + v: one output to backward
             "q, k, v projections of (32, 128, 384): one fused Linear(384, 1152) (a candidate, levers.py)":
                 lambda: sum(fused(x).chunk(3, -1))}
    times = {name: [] for name in cases}
    for i in range(reps + 1):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = fn()
            if y.requires_grad:
                y.float().sum().backward()
            if i:
                times[name].append(time.perf_counter() - t0)
    print("| forward + backward (masks: drawing only) | ms |\n|---|---|")
    for name, t in times.items():
        print(f"| {name} | {1000 * np.median(t):.1f} |")


if __name__ == "__main__":
    with benchmark.recorded(Path(__file__).parent / "micro.md"):
        micro_table()
