"""Where CPDAE's compiled step spends the time its FLOPs do not count: MLM-only's step, CPDAE's `--compile` step,
and, at the step's own shapes (32 anchors against 64 views, |V| = 30,522, fp32), eq. 5's -JS as `--compile` runs
it (run.speed.compiled_per_input: forward + backward) and its compiled forward alone (one sweep over the (a, b, |V|)
mixture), all round-robin in one process (median of --reps), at 4 x 256 and 6 x 384 (batch 32 x 128, bf16 where
the CPU has it). It prints each step's time over MLM-only's, over their FLOP ratio (research.benchmark's goal <= 1.1),
as measured, less the eq. 5 call's time (-JS is elementwise work over m x 2m x |V| terms, which the FLOP count of
matmuls does not see), and with eq. 5's backward written out by hand instead (an estimate: the step less its eq. 5
call plus the hand-written one's time; not shipped, autograd derives the gradient in training); and against
MLM-only at 64 texts, as many sequences through the encoder as CPDAE's 32 texts in two views. What it prints is
written to results/speed/cpdae_excess.md.

    python results/speed/cpdae_excess.py
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import js_backward  # this script's folder (results/speed) is on the path when it runs

import costa
import cpdae
import run
from research import benchmark


def minus_js_grads(grad, p, q):
    """The gradients of sum(grad * -JS(P, Q)) in P and Q written out (not shipped: autograd derives them in
    training): d JS / dp = (log p - log m) / 2, the +1 of d(x log x) cancelling between p's term and m's."""
    tiny = torch.finfo(p.dtype).tiny
    log_m_ab = torch.log((0.5 * (p[:, None, :] + q[None, :, :])).clamp_min(tiny))         # (a, b, V)
    log_m_ba = torch.log((0.5 * (q[:, None, :] + p[None, :, :])).clamp_min(tiny))         # (b, a, V)
    grad_p = torch.log(p.clamp_min(tiny)) * grad.sum(1)[:, None] - (grad.T[:, :, None] * log_m_ba).sum(0)
    grad_q = torch.log(q.clamp_min(tiny)) * grad.sum(0)[:, None] - (grad[:, :, None] * log_m_ab).sum(0)
    return -0.5 * grad_p, -0.5 * grad_q          # each summed over the outer axis: the faster order for inductor


def eq5_calls(anchors, views):
    """(forward + backward, forward alone, forward + the hand-written backward) of the compiled -JS on word
    distributions of the step's shapes."""
    p, q, upstream = js_backward.inputs(anchors, views)
    both, forward = run.speed.compiled_per_input(cpdae.js_similarity), torch.compile(cpdae.js_similarity)
    by_hand = torch.compile(minus_js_grads)
    exact = torch.autograd.grad(cpdae.js_similarity(p.double(), q.double()), (p, q), upstream.double())
    error = max(float((got - want).abs().max()) for got, want in zip(by_hand(upstream, p.detach(), q.detach()), exact))

    def forward_backward():
        torch.autograd.grad(both(p, q), (p, q), upstream)

    def forward_alone():
        with torch.no_grad():
            forward(p, q)

    def forward_hand_backward():
        with torch.no_grad():
            forward(p, q), by_hand(upstream, p, q)
    return forward_backward, forward_alone, forward_hand_backward, error


MLM_64 = "MLM-only, 64 texts (as many encoded sequences as CPDAE's two views of 32)"


def spread(steps, bases, flop_ratio):
    """min, median and max over passes of one pass's step time / its MLM-only time, over the FLOP ratio."""
    ratios = np.array(steps) / np.array(bases) / flop_ratio
    return f"{ratios.min():.2f}, {np.median(ratios):.2f}, {ratios.max():.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed round-robin passes (median)")
    args = parser.parse_args()
    with benchmark.recorded(Path(__file__).parent / "cpdae_excess.md"):
        torch.manual_seed(0)
        rows = {}
        for size, fields in (("4x256", {}), ("6x384", benchmark.MINILM)):
            for name, module, fixed in (("MLM-only", costa, {"gwc_weight": 0.0}), ("CPDAE --compile", cpdae, {}),
                                        (MLM_64, costa, {"gwc_weight": 0.0, "batch_size": 64})):
                c = module.Config(**fixed, **fields, compile=module is cpdae)
                c.steps = 10 ** 6
                rows[name, size] = benchmark.pretrain_step(module, c, benchmark.load_batches(module, c, 4))
        c = cpdae.Config()
        both, forward, by_hand, error = eq5_calls(c.batch_size, 2 * c.batch_size)
        rows["eq. 5 forward + backward", ""], rows["eq. 5 forward alone", ""] = both, forward
        rows["eq. 5 forward + a hand-written backward (not shipped)", ""] = by_hand
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
        print(f"{torch.get_num_threads()} threads (bf16 matmul rate at 4x256: {rate:,.0f} GFLOP/s), median of "
              f"{args.reps} round-robin passes; eq. 5 at {c.batch_size} x {2 * c.batch_size} x {c.vocab_size:,}, fp32\n")
        print("| call | size | ms | GFLOP counted |\n|---|---|---|---|")
        for (name, size), t in ms.items():
            print(f"| {name} | {size or 'as in the step'} | {t:,.0f} | {flops[name, size] / 1e9:.1f} |")
        eq5, hand = ms["eq. 5 forward + backward", ""], ms["eq. 5 forward + a hand-written backward (not shipped)", ""]
        print(f"\neq. 5's forward + backward is {eq5 / ms['eq. 5 forward alone', '']:.1f} times its forward alone "
              f"(one sweep over the mixture); the hand-written backward's gradients are within {error:.1e} of fp64's\n")
        print("| size | CPDAE --compile time / MLM-only's over the FLOP ratio (goal <= 1.1) | the same, less the eq. 5 "
              "call | the same, eq. 5's backward written by hand (estimated) | eq. 5's share of the step | the first "
              "column per pass (the two steps of one round-robin pass): min, median, max | the first column against "
              "MLM-only at 64 texts |\n|---|---|---|---|---|---|---|")
        for size in ("4x256", "6x384"):
            base, step = ms["MLM-only", size], ms["CPDAE --compile", size]
            flop_ratio = flops["CPDAE --compile", size] / flops["MLM-only", size]
            print(f"| {size} | {step / base / flop_ratio:.2f} ({step / base:.2f}x time for {flop_ratio:.2f}x FLOPs) "
                  f"| {(step - eq5) / base / flop_ratio:.2f} | {(step - eq5 + hand) / base / flop_ratio:.2f} "
                  f"| {eq5 / step:.0%} | {spread(times['CPDAE --compile', size], times['MLM-only', size], flop_ratio)} "
                  f"| {step / ms[MLM_64, size] / (flops['CPDAE --compile', size] / flops[MLM_64, size]):.2f} |")


if __name__ == "__main__":
    main()
