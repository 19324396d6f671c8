"""CPDAE's eq. 5 similarity (cpdae.js_similarity, -JS over (a, b, |V|)) forward + backward at the default run's
batch (32 anchors against 64 views, |V| = 30,522, fp32), three ways: eager as `--compile false` runs it (chunks
of --js_chunk anchors, checkpointed), torch.compile's own forward and backward, and with the backward one compiled
sweep per input (run.speed.compiled_per_input, as `--compile` runs it). Times: the three ways round-robin in one process
(so that load on the machine slows each alike), the median of `--steps` passes after two untimed calls each.
Memory: each way in a fresh process, its peak RSS over two calls above what it held before them (the (a, b, V)
intermediates it allocates). Gradients against the fp64 eager ones. What it prints is written to
results/speed/js_backward.md.

    python results/speed/js_backward.py
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import cpdae
import run
from research import benchmark

WAYS = {"eager (--compile false)": "eager", "torch.compile's backward": "compile",
        "a sweep per input (--compile)": "per_input"}


def similarity(way, js_chunk):
    """One way's js_similarity (not run.speed.fused's: it keeps one compiled form per loss and process)."""
    if way == "eager":
        return run.speed.in_row_chunks(cpdae.js_similarity, js_chunk)
    return torch.compile(cpdae.js_similarity) if way == "compile" else run.speed.compiled_per_input(cpdae.js_similarity)


def inputs(anchors, views):
    """Seeded word distributions P (anchors, V) and Q (views, V), and an upstream gradient (anchors, views)."""
    g = torch.Generator().manual_seed(0)
    vocab = cpdae.Config().vocab_size
    p, q = (cpdae.word_distribution(2 * torch.randn(n, vocab, generator=g)).requires_grad_() for n in (anchors, views))
    return p, q, torch.randn(anchors, views, generator=g)


def peak_of_one_way(way, anchors, views, js_chunk):
    """This process's peak RSS over two forward + backward calls of one way, above what it held before them."""
    p, q, upstream = inputs(anchors, views)
    fn = similarity(way, js_chunk)
    torch.autograd.grad(fn(p, q), (p, q), upstream)                  # compiles (its buffers are freed after)
    benchmark.reset_peak_rss()
    held = benchmark.peak_rss_mib()
    for _ in range(2):
        torch.autograd.grad(fn(p, q), (p, q), upstream)
    return benchmark.peak_rss_mib() - held


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=9, help="timed round-robin passes (median)")
    parser.add_argument("--anchors", type=int, default=32, help="a: the anchors (the default run's texts)")
    parser.add_argument("--views", type=int, default=64, help="b: the views compared with (2 per text)")
    parser.add_argument("--peak_of", choices=list(WAYS.values()), help=argparse.SUPPRESS)   # one process's way
    args = parser.parse_args()
    js_chunk = cpdae.Config().js_chunk
    if args.peak_of:
        print(json.dumps(peak_of_one_way(args.peak_of, args.anchors, args.views, js_chunk)))
        return
    with benchmark.recorded(Path(__file__).parent / "js_backward.md"):
        print(f"cpdae.js_similarity forward + backward, {args.anchors} x {args.views} x {cpdae.Config().vocab_size:,} "
              f"fp32, {torch.get_num_threads()} threads; eager in chunks of {js_chunk} anchors; round-robin in one "
              f"process, median of {args.steps} passes; peak memory from a fresh process per way\n")
        p, q, upstream = inputs(args.anchors, args.views)
        exact = torch.autograd.grad(cpdae.js_similarity(p.double(), q.double()), (p, q), upstream.double())
        fns = {name: similarity(way, js_chunk) for name, way in WAYS.items()}
        errors, times = {}, {name: [] for name in WAYS}
        for name, fn in fns.items():
            grads = [torch.autograd.grad(fn(p, q), (p, q), upstream) for _ in range(2)][-1]
            errors[name] = max(float((got - want).abs().max()) for got, want in zip(grads, exact))
        for _ in range(args.steps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                torch.autograd.grad(fn(p, q), (p, q), upstream)
                times[name].append(time.perf_counter() - t0)
        peaks = {}
        for name, way in WAYS.items():
            cmd = [sys.executable, __file__, "--peak_of", way, "--anchors", str(args.anchors), "--views", str(args.views)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
            peaks[name] = json.loads(out.strip().splitlines()[-1])
        ms = {name: 1000 * float(np.median(t)) for name, t in times.items()}
        base = ms["torch.compile's backward"]
        print("| way | ms per call | peak RSS above the inputs, MiB | max gradient error vs fp64 | speed against "
              "torch.compile's backward |\n|---|---|---|---|---|")
        for name in WAYS:
            print(f"| {name} | {ms[name]:,.0f} | {peaks[name]:,.0f} | {errors[name]:.1e} | {base / ms[name]:.2f}x |")


if __name__ == "__main__":
    main()
