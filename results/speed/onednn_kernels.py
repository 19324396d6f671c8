"""oneDNN primitives created per step of seed.py's default (4 x 256) pre-training step on its own batches: with the
decoder's kept positions padded by run.speed.pad_rows to a multiple of one eighth of their most, as seed.py does,
against the kept positions unpadded (their count changes with every batch), and against the MLM head's masked positions
padded as well (a multiple of 64). On a CPU with AMX (or AVX512) oneDNN builds a
kernel for each new matmul shape (a primitive cache miss, printed by its verbose mode on creation) and then reuses
it; a step that builds none runs on kernels it has. Each variant runs in a fresh process (the primitive cache is
per process), --steps steps on the same batches, bf16 autocast where the CPU has it; what it prints goes to
results/speed/onednn_kernels.md (benchmark.recorded).

    python results/speed/onednn_kernels.py --steps 20
    python results/speed/onednn_kernels.py --shapes   # the kernels one step builds (onednn_kernels-shapes.md)
"""
import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import run
import seed
from research import benchmark

VARIANTS = {"padded": "run.speed.pad_rows as seed.py calls it (multiples of 1/8 of the most kept positions)",
            "unpadded": "run.speed.pad_rows a no-op: the kept positions as they are",
            "mlm padded": "padded, and the MLM head's masked positions too (run.speed.pad_rows, multiples of 64)"}
MLM_BUCKET = 64


def padded_mlm_loss(hidden, labels, head):
    """seed.mlm_loss with the masked positions padded by run.speed.pad_rows to a multiple of MLM_BUCKET before the head
    (zero rows, target -100: the same loss; the head's matmuls see a few shapes, not one per batch)."""
    chosen = labels != -100                                                         # (B, L)
    rows, targets = run.speed.pad_rows(hidden[chosen], labels[chosen], MLM_BUCKET)        # (M', H), (M',)
    logits = head(rows).float()                                                     # (M', V)
    n_correct = (logits.argmax(-1) == targets).sum()                                # () padding never counts
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100), n_correct, int(chosen.sum())


def created(step, lines_of=None):
    """Run step() and count the oneDNN primitives it created (verbose mode 2: creation lines on stdout, fd 1,
    captured in a file): -> (cache misses: kernels built, cache hits, seconds)."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile(mode="w+") as log:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
                t0 = time.perf_counter()
                step()
                seconds = time.perf_counter() - t0
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = [line for line in log if line.startswith("onednn_verbose") and ",create:" in line]
    if lines_of is not None:
        lines_of += [line.strip() for line in lines if "cache_miss" in line]
    return sum("cache_miss" in line for line in lines), sum("cache_hit" in line for line in lines), seconds


def one(variant, steps):
    """In this (fresh) process: kernels built and time of each of `steps` SEED steps. -> JSON on the last line."""
    if variant == "unpadded":
        run.speed.pad_rows = lambda rows, targets, bucket, ignore_index=-100: (rows, targets)
    if variant == "mlm padded":
        seed.mlm_loss = padded_mlm_loss
    torch.manual_seed(0)
    c = seed.Config()
    c.steps = 10 ** 6
    batches = benchmark.load_batches(seed, c, steps)
    kept = [int((b["decoder_targets"] != -100).sum()) for b in batches]
    step = benchmark.pretrain_step(seed, c, batches)
    rows = [created(step) for _ in range(steps)]
    print(json.dumps({"kept": kept, "built": [r[0] for r in rows], "hits": [r[1] for r in rows],
                      "seconds": [round(r[2], 3) for r in rows]}))


def shapes():
    """As shipped, the kernels the second step builds: each one's primitive kind and shapes (oneDNN's verbose line),
    beside each batch's masked (MLM) and kept decoder positions."""
    torch.manual_seed(0)
    c = seed.Config()
    c.steps = 10 ** 6
    batches = benchmark.load_batches(seed, c, 2)
    step = benchmark.pretrain_step(seed, c, batches)
    step()
    lines = []
    created(step, lines)
    print(f"seed.py's default step as shipped: masked (MLM) positions per batch "
          f"{[int((b['labels'] != -100).sum()) for b in batches]}, kept decoder positions "
          f"{[int((b['decoder_targets'] != -100).sum()) for b in batches]}; the kernels its second step built:\n")
    print("| primitive | shapes |\n|---|---|")
    for line in lines:
        fields = line.split(",")
        print(f"| {fields[5]} | {fields[-2]} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)   # a child: one variant
    parser.add_argument("--shapes", action="store_true", help="which kernels a step builds, as shipped")
    args = parser.parse_args()
    if args.shapes:
        return shapes()
    if args.one:
        return one(args.one, args.steps)
    out = {v: benchmark.in_fresh_process(__file__, "--one", v, "--steps", args.steps) for v in VARIANTS}
    bucket = -(-seed.Config().batch_size * (seed.Config().max_len - 1) // 8)
    print(f"seed.py's default step (4 x 256, batch {seed.Config().batch_size} x {seed.Config().max_len}), {args.steps} "
          f"steps on its first {args.steps} batches; kept decoder positions per batch: {out['padded']['kept']}; "
          f"padded to multiples of {bucket}\n")
    print("| variant | oneDNN kernels built (primitive cache misses) per step | steps 2 on: total, steps that built any "
          "| median s/step, steps 2 on |\n|---|---|---|---|")
    for v, text in VARIANTS.items():
        built, seconds = out[v]["built"], sorted(out[v]["seconds"][1:])
        print(f"| {v}: {text} | {', '.join(map(str, built))} | {sum(built[1:])}, {sum(b > 0 for b in built[1:])} of "
              f"{len(built) - 1} | {seconds[len(seconds) // 2]:.2f} |")


if __name__ == "__main__":
    if "--one" in sys.argv:
        main()
    else:
        name = "onednn_kernels-shapes.md" if "--shapes" in sys.argv else "onednn_kernels.md"
        with benchmark.recorded(Path(__file__).with_name(name)):
            main()
