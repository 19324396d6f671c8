"""Candidate changes to the shared encoder, each measured on finetune.py's own step (MiniLM, batch 32
queries + 32 positives + 32 negatives, bf16): its time, round-robin in one process in a new order each
pass (speed against as shipped); its first loss from the same seed (a change that only reorders the
arithmetic moves it by rounding at most); and the peak RSS of its steps in a fresh process with malloc's
mmap threshold pinned (st.py --one). What it prints is written to
results/speed/levers.md.

    python results/speed/levers.py              # every lever
    python results/speed/levers.py --reps 3 --no_memory
"""
import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))   # the repository root
import run
from research import benchmark

LEVERS = ("as shipped", "fused qkv", "attention recomputed in the backward", "no attention dropout",
          "no attention dropout, SDPA", "fused qkv + no attention dropout, SDPA")


class FusedQKV(torch.nn.Module):
    """A candidate: q, k and v from one (H -> 3H) projection holding the three's weights, so that the
    forward and each backward matmul run once at 3x the width instead of three times."""

    def __init__(self, attn, module):
        super().__init__()
        self.heads, self.dropout, self.out, self.module = attn.heads, attn.dropout, attn.out, module
        H = attn.query.in_features
        self.qkv = torch.nn.Linear(H, 3 * H)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([attn.query.weight, attn.key.weight, attn.value.weight]))   # (3H, H)
            self.qkv.bias.copy_(torch.cat([attn.query.bias, attn.key.bias, attn.value.bias]))           # (3H,)

    def forward(self, x, attend):                                                  # (B, L, H)
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, heads, L, d)
        y = self.module.attention(q, k, v, attend, self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, L, H))                        # (B, L, H)


def apply_lever(lever, encoder):
    """Apply one of LEVERS to this encoder: module swaps now, and a context that swaps the attention
    function of the encoder's module (evaluate's, finetune's or a method file's) for the step only."""
    if lever not in LEVERS:
        raise ValueError(f"unknown lever {lever!r}; choose from {', '.join(LEVERS)}")
    module = sys.modules[type(encoder).__module__]
    shipped = module.attention
    if "fused qkv" in lever:
        for block in encoder.blocks:
            block.attn = FusedQKV(block.attn, module)
    sdpa = lambda q, k, v, attend, p: F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
    swap = {"attention recomputed in the backward":        # keeps q, k, v; the (L x L) maps are made again
                lambda q, k, v, attend, p: checkpoint(shipped, q, k, v, attend, p, use_reentrant=False),
            "no attention dropout": lambda q, k, v, attend, p: shipped(q, k, v, attend, 0.0),
            "no attention dropout, SDPA": sdpa, "fused qkv + no attention dropout, SDPA": sdpa}

    @contextlib.contextmanager
    def context():
        module.attention = swap.get(lever, shipped)
        try:
            yield
        finally:
            module.attention = shipped
    return context


def lever_table(reps, memory=True):
    """Each lever's step on the batches of st.py with random negatives (times, first loss) and, with
    memory, on its BM25 batches (peak RSS)."""
    batches, *_ = benchmark.finetune_batches(4)
    init = str(run.hub.resolve_model("minilm"))
    steps, losses = {}, {}
    for lever in LEVERS:
        torch.manual_seed(0)
        steps[lever] = benchmark.finetune_step(batches, init, lambda encoder, lever=lever: apply_lever(lever, encoder))
        torch.manual_seed(1)
        losses[lever] = steps[lever](optimize=False)
    times, order = {lever: [] for lever in LEVERS}, np.random.default_rng(0)
    for i in range(reps + 1):
        for lever in order.permutation(LEVERS):          # a new order each pass: no lever always runs first
            t0 = time.perf_counter()
            steps[lever]()
            if i:
                times[lever].append(time.perf_counter() - t0)
    base = np.median(times["as shipped"])
    print("\n| finetune.py step, MiniLM, batch 32 x (1 + 2) texts | ms/step | speed vs as shipped | first loss "
          "(seed 1) | peak RSS MiB, fresh process |\n|---|---|---|---|---|")
    for lever in LEVERS:
        peak = ""
        if memory:
            try:
                r = benchmark.in_fresh_process(HERE / "st.py", "--one", f"ours:2:1:{lever}",
                                               env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
                peak = f"{r['peak_mib']:,.0f}"
            except RuntimeError:
                peak = "failed"
        ms = 1000 * np.median(times[lever])
        print(f"| {lever} | {ms:,.0f} | {1000 * base / ms:.2f}x | {losses[lever]:.6f} | {peak} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed round-robin passes")
    parser.add_argument("--no_memory", action="store_true", help="leave out the peak RSS column")
    args = parser.parse_args()
    with benchmark.recorded(HERE / "levers.md"):
        lever_table(args.reps, memory=not args.no_memory)
