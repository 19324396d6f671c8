"""CPDAE's eq. 5 loss: peak memory of the chunked JS divergence (cpdae.js_divergence, chunks of 1 to 16
anchors) against the naive (m, 2m, V) mixture, forward + backward on one thread, each variant in a fresh
process, as is and with glibc's mmap threshold pinned at 1 MiB (so that the peak is live memory). The
output is written to results/speed/js_memory.md.

    python results/speed/js_memory.py              # the paper's batch: 64 texts x 2 views, |V| = 30,522
    python results/speed/js_memory.py --texts 4    # a quick check
"""
import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark


def js_memory_one(variant, chunk, m, vocab):
    """Forward + backward of CPDAE's eq. 5 loss on m texts x 2 views over |V| words, in this process.
    'baseline' does everything but the pairwise JS, so (variant - baseline) is the JS's own peak."""
    import cpdae
    torch.set_num_threads(1)
    tiny = torch.rand(2, 4, requires_grad=True)
    cpdae.js_divergence(tiny, tiny).sum().backward()      # one-time imports paid by every variant
    torch.manual_seed(0)
    logits1, logits2 = (torch.randn(m, vocab, requires_grad=True) for _ in range(2))
    start = time.perf_counter()
    dist1, dist2 = cpdae.word_distribution(logits1), cpdae.word_distribution(logits2)   # (m, V) each
    candidates = torch.cat([dist1, dist2])                                             # (2m, V)
    if variant == "baseline":
        sim = -(dist1 @ candidates.T)                                                  # (m, 2m)
    elif variant == "chunked":
        sim = -cpdae.js_divergence(dist1, candidates, chunk_size=chunk)                # (m, 2m)
    else:  # naive: the whole (m, 2m, V) mixture at once, kept by autograd
        mix = 0.5 * (dist1[:, None, :] + candidates[None, :, :])                       # (m, 2m, V)
        entropies = torch.xlogy(dist1, dist1).sum(-1)[:, None] + torch.xlogy(candidates, candidates).sum(-1)[None, :]
        sim = torch.xlogy(mix, mix).sum(-1) - 0.5 * entropies                          # -JS, (m, 2m)
    loss, _ = cpdae.contrastive_loss(dist1, dist2, lambda anchors, candidates: sim)   # eq. 5 on sim
    loss.backward()
    return {"variant": variant, "chunk": chunk, "loss": loss.item(), "seconds": time.perf_counter() - start,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def js_memory_table(m, vocab):
    """Each variant in a fresh process (ru_maxrss is a high-water mark), twice: as is, and with glibc's
    mmap threshold pinned at 1 MiB so that freed blocks go back to the OS and the peak is live memory."""
    print(f"CPDAE contrastive loss (eq. 5), {m} texts x 2 views, |V| = {vocab:,}, forward + backward, 1 thread")
    print(f"{'variant':<12}{'peak-baseline MiB':>19}{'(pinned malloc)':>17}{'seconds':>9}  loss")
    base = None
    for variant, chunk in [("baseline", 0), ("chunked", 1), ("chunked", 4), ("chunked", 8), ("chunked", 16),
                           ("naive", 0)]:
        rows = [benchmark.in_fresh_process(__file__, "--child", "js_memory_one", json.dumps([variant, chunk, m, vocab]),
                                           env=env)
                for env in (os.environ, {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})]
        base = base or rows
        name = f"{variant} {chunk}" if variant == "chunked" else variant
        print(f"{name:<12}{rows[0]['peak_mib'] - base[0]['peak_mib']:>19,.0f}"
              f"{rows[1]['peak_mib'] - base[1]['peak_mib']:>17,.0f}{rows[0]['seconds']:>9.1f}  {rows[0]['loss']:.6f}",
              flush=True)


CHILDREN = {f.__name__: f for f in (js_memory_one,)}   # run by benchmark.in_fresh_process


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=64, help="texts (x 2 views); the paper's batch is 64")
    parser.add_argument("--child", nargs=2, metavar=("FUNCTION", "ARGS"), help=argparse.SUPPRESS)  # in_fresh_process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](*json.loads(args.child[1]))))
    else:
        with benchmark.recorded(Path(__file__).parent / "js_memory.md"):
            js_memory_table(args.texts, 30522)
