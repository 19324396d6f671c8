"""Where the frozen SEED decoder trial's time goes (mechanisms.py --frozen seed, results/mechanisms/), and what
makes its step faster: its own step (seed.WeakDecoder at all-MiniLM-L6-v2's sizes, 3 blocks, span 2, batch
16 x 128 windows, the tied 30,522-word embedding frozen, AdamW, bf16 autocast where the CPU has it) on
random vectors and tokens (the step's cost depends on the shapes only), timed round-robin in one process
(median of --reps), each variant's first step apart (a compile is in it), and torch.profiler's self time of
the as-shipped step by op kind. What it prints is written to results/speed/frozen_seed.md.

    python results/speed/frozen_seed.py
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from profile_ops import OP_GROUPS, op_group

import benchmark
import run
import seed

MINILM = dict(hidden_size=384, num_heads=12, ffn_size=1536, vocab_size=30522, max_position=128, dec_layers=3,
              dec_span=2)


def frozen_step(loss_of, batch=16, length=128, seed_=0):
    """One frozen-trial step (mechanisms.frozen_trial's, SEED): decoder forward, eq. 9, backward, clip, AdamW.
    loss_of(states, weight, targets) -> (loss, n_correct) is the eq. 9 function the variant runs."""
    torch.manual_seed(seed_)
    c = seed.Config(**MINILM)
    embedding = nn.Embedding(c.vocab_size, c.hidden_size).requires_grad_(False)   # the frozen encoder's, at
    nn.init.normal_(embedding.weight, std=0.05)                                   # a trained embedding's scale
    decoder = seed.WeakDecoder(c, embedding)
    params = [p for p in decoder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    ids = torch.randint(1000, c.vocab_size, (batch, length))
    mask = torch.ones_like(ids)
    mask[: batch // 4, length - 30:] = 0                                            # some shorter windows
    h0 = torch.randn(batch, c.hidden_size)
    decoder_input, targets = seed.decoder_inputs_and_targets(ids, mask)

    def step(rng_seed=None):
        if rng_seed is not None:                                                    # the same dropout masks
            torch.manual_seed(rng_seed)
        decoder.train()
        with run.autocast_bf16(torch.device("cpu")):
            states = decoder(decoder_input, h0)                                     # (b, L-1, H)
            loss = loss_of(states, embedding.weight, targets)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss.item()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    variants = {"as shipped (seed.decoder_loss, eager)": frozen_step(seed.decoder_loss),
                "--compile (run.fused(seed.decoder_loss))": frozen_step(run.fused(seed.decoder_loss,
                                                                                  argparse.Namespace(compile=True)))}
    first, times, losses = {}, {k: [] for k in variants}, {}
    for name, step in variants.items():
        t0 = time.perf_counter()
        losses[name] = step(rng_seed=1)
        first[name] = time.perf_counter() - t0
        step()
    for _ in range(args.reps):
        for name, step in variants.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    base = np.median(times[next(iter(variants))])
    print(f"\n| frozen SEED step, 16 x 128, 6x384 sizes | ms/step (median of {args.reps}) | first step s | speed vs as "
          f"shipped | first loss |\n|---|---|---|---|---|")
    for name in variants:
        ms = 1000 * np.median(times[name])
        print(f"| {name} | {ms:,.0f} | {first[name]:.1f} | {1000 * base / ms:.2f}x | {losses[name]:.6f} |", flush=True)
    step = frozen_step(seed.decoder_loss)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in ops) or 1
    share = dict.fromkeys([g for g, _ in OP_GROUPS] + ["elementwise and other"], 0.0)
    for name, t in ops:
        share[op_group(name)] += t / total
    print("\nThe as-shipped step's self time by op kind (torch.profiler, 2 steps): " +
          ", ".join(f"{g} {v:.0%}" for g, v in share.items()) + "; top 5 ops: " +
          ", ".join(f"{n.split('::')[-1]} {t / total:.0%}" for n, t in sorted(ops, key=lambda o: -o[1])[:5]))


if __name__ == "__main__":
    with benchmark.recorded(Path(__file__).with_suffix(".md")):
        main()
