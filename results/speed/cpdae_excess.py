"""Where CPDAE's compiled step spends the time its FLOPs do not count: MLM-only's step, CPDAE's `--compile` step,
and, at the step's own shapes (32 anchors against 64 views, |V| = 30,522, fp32), eq. 5's -JS as `--compile` runs
it (run.compiled_per_input: forward + backward) and its compiled forward alone (one sweep over the (a, b, |V|)
mixture), all round-robin in one process (median of --reps), at 4 x 256 and 6 x 384 (batch 32 x 128, bf16 where
the CPU has it). It prints each step's time over MLM-only's, over their FLOP ratio (benchmark.py's goal <= 1.1),
with and without the eq. 5 call's time: -JS is elementwise work over m x 2m x |V| terms, which the FLOP count
(matmuls) does not see. What it prints is written to results/speed/cpdae_excess.md.

    python results/speed/cpdae_excess.py
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import costa
import cpdae
import run


def eq5_calls(anchors, views):
    """(forward + backward, forward alone) of the compiled -JS on word distributions of the step's shapes."""
    g = torch.Generator().manual_seed(0)
    vocab = cpdae.Config().vocab_size
    p, q = (cpdae.word_distribution(2 * torch.randn(n, vocab, generator=g)).requires_grad_() for n in (anchors, views))
    upstream = torch.randn(anchors, views, generator=g)
    both, forward = run.compiled_per_input(cpdae.js_similarity), torch.compile(cpdae.js_similarity)

    def forward_backward():
        torch.autograd.grad(both(p, q), (p, q), upstream)

    def forward_alone():
        with torch.no_grad():
            forward(p, q)
    return forward_backward, forward_alone


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9, help="timed round-robin passes (median)")
    args = parser.parse_args()
    with benchmark.recorded(Path(__file__).parent / "cpdae_excess.md"):
        torch.manual_seed(0)
        rows = {}
        for size, fields in (("4x256", {}), ("6x384", benchmark.MINILM)):
            for name, module, fixed in (("MLM-only", costa, {"gwc_weight": 0.0}), ("CPDAE --compile", cpdae, {})):
                c = module.Config(**fixed, **fields, compile=module is cpdae)
                c.steps = 10 ** 6
                rows[name, size] = benchmark.pretrain_step(module, c, benchmark.load_batches(module, c, 4))
        c = cpdae.Config()
        both, forward = eq5_calls(c.batch_size, 2 * c.batch_size)
        rows["eq. 5 forward + backward", ""], rows["eq. 5 forward alone", ""] = both, forward
        flops = {}
        for key, step in rows.items():
            step()
            flops[key] = benchmark.eager_flops(step) if key[1] else 0
            step()
        times = {key: [] for key in rows}
        for _ in range(args.reps):
            for key, step in rows.items():
                t0 = time.perf_counter()
                step()
                times[key].append(time.perf_counter() - t0)
        ms = {key: 1000 * float(np.median(t)) for key, t in times.items()}
        rate = benchmark.matmul_rate(4096, 256, 1024, torch.bfloat16)
        print(f"{torch.get_num_threads()} threads (bf16 matmul rate at 4x256: {rate:,.0f} GFLOP/s), median of {args.reps} round-robin passes; eq. 5 at "
              f"{c.batch_size} x {2 * c.batch_size} x {c.vocab_size:,}, fp32\n")
        print("| call | size | ms | GFLOP counted |\n|---|---|---|---|")
        for (name, size), t in ms.items():
            print(f"| {name} | {size or 'as in the step'} | {t:,.0f} | {flops[name, size] / 1e9:.1f} |")
        eq5 = ms["eq. 5 forward + backward", ""]
        print(f"\neq. 5's forward + backward is {eq5 / ms['eq. 5 forward alone', '']:.1f} times its forward alone "
              "(one sweep over the mixture)\n")
        print("| size | CPDAE --compile time / MLM-only's over the FLOP ratio (goal <= 1.1) | the same, less the eq. 5 "
              "call | eq. 5's share of the step |\n|---|---|---|---|")
        for size in ("4x256", "6x384"):
            base, step = ms["MLM-only", size], ms["CPDAE --compile", size]
            flop_ratio = flops["CPDAE --compile", size] / flops["MLM-only", size]
            print(f"| {size} | {step / base / flop_ratio:.2f} ({step / base:.2f}x time for {flop_ratio:.2f}x FLOPs) "
                  f"| {(step - eq5) / base / flop_ratio:.2f} | {eq5 / step:.0%} |")


if __name__ == "__main__":
    main()
