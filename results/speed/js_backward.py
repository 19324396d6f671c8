"""CPDAE's eq. 5 similarity (cpdae.js_similarity, -JS over (a, b, |V|)) forward + backward at the default run's
batch (32 anchors against 64 views, |V| = 30,522, fp32), three ways: eager as `--compile false` runs it (chunks
of --js_chunk anchors, checkpointed), torch.compile's own forward and backward, and with the backward one compiled
sweep per input (run.compiled_per_input, as `--compile` runs it). Each way in its own process, the processes
alternated (rounds), each timing `--steps` calls after two untimed ones and reading its peak RSS above what it
held before them (the (a, b, V) intermediates it allocates). Gradients against the fp64 eager ones. What it
prints is written to results/speed/js_backward.md.

    python results/speed/js_backward.py
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import cpdae
import run

WAYS = {"eager (--compile false)": "eager", "torch.compile's backward": "compile",
        "a sweep per input (--compile)": "per_input"}


def similarity(way, js_chunk):
    if way == "eager":
        return run.in_row_chunks(cpdae.js_similarity, js_chunk)
    return run.fused(cpdae.js_similarity, SimpleNamespace(compile=True), sweep_per_input=way == "per_input")


def one_way(way, steps, anchors, views, js_chunk):
    """Time `steps` forward + backward calls of one way in this process; its peak RSS above the inputs'."""
    g = torch.Generator().manual_seed(0)
    vocab = cpdae.Config().vocab_size
    p, q = (cpdae.word_distribution(2 * torch.randn(n, vocab, generator=g)).requires_grad_() for n in (anchors, views))
    upstream = torch.randn(anchors, views, generator=g)
    fn = similarity(way, js_chunk)
    grads = [torch.autograd.grad(fn(p, q), (p, q), upstream) for _ in range(2)][-1]
    exact = torch.autograd.grad(cpdae.js_similarity(p.double(), q.double()), (p, q), upstream.double())
    error = max(float((got - want).abs().max()) for got, want in zip(grads, exact))
    benchmark.reset_peak_rss()
    held = benchmark.peak_rss_mib()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        torch.autograd.grad(fn(p, q), (p, q), upstream)
        times.append(time.perf_counter() - t0)
    return {"ms": 1000 * float(np.median(times)), "peak_mib": benchmark.peak_rss_mib() - held, "error": error}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=9, help="timed calls per process (median)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per way, alternated")
    parser.add_argument("--anchors", type=int, default=32, help="a: the anchors (the default run's texts)")
    parser.add_argument("--views", type=int, default=64, help="b: the views compared with (2 per text)")
    parser.add_argument("--way", choices=list(WAYS.values()), help=argparse.SUPPRESS)   # one process's way
    args = parser.parse_args()
    js_chunk = cpdae.Config().js_chunk
    if args.way:
        print(json.dumps(one_way(args.way, args.steps, args.anchors, args.views, js_chunk)))
        return
    with benchmark.recorded(Path(__file__).parent / "js_backward.md"):
        print(f"cpdae.js_similarity forward + backward, {args.anchors} x {args.views} x {cpdae.Config().vocab_size:,} "
              f"fp32, {torch.get_num_threads()} threads; eager in chunks of {js_chunk} anchors; median of {args.steps} "
              f"calls per process, {args.rounds} processes per way, alternated\n")
        rows = {name: [] for name in WAYS}
        for _ in range(args.rounds):
            for name, way in WAYS.items():
                cmd = [sys.executable, __file__, "--way", way, "--steps", str(args.steps),
                       "--anchors", str(args.anchors), "--views", str(args.views)]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
                rows[name].append(json.loads(out.strip().splitlines()[-1]))
        base = np.median([r["ms"] for r in rows["torch.compile's backward"]])
        print("| way | ms per call (median of the processes' medians) | each process | peak RSS above the inputs, "
              "MiB | max gradient error vs fp64 | speed against torch.compile's backward |\n|---|---|---|---|---|---|")
        for name, rs in rows.items():
            ms = np.median([r["ms"] for r in rs])
            each = ", ".join(f"{r['ms']:,.0f}" for r in rs)
            print(f"| {name} | {ms:,.0f} | {each} | "
                  f"{max(r['peak_mib'] for r in rs):,.0f} | {max(r['error'] for r in rs):.1e} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
