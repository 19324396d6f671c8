"""--compile keeps the run's guarantees, each run against itself: resume is bit for bit (a run halted at step 2
and resumed logs the losses of the straight run: CPDAE and SEED, the methods --compile changes, tiny sizes on
the bundled corpus' first articles, 4 steps, each run compiling in its own process), and 2 processes give 1
process's loss and gradients (CPDAE's eq. 5 gathered across ranks with the compiled -JS, 2 gloo processes
against 1, as test_losses.py checks it eager). What it prints is written to results/speed/compile_exact.md.

    python results/speed/compile_exact.py
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import torch

import conftest
import cpdae
import data
import run
from research import benchmark

TINY = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "64", "--max_len", "64",
        "--log_every", "1", "--steps", "4", "--compile", "true"]
KEYS = {"cpdae": ("rec", "mlm", "cl"), "seed": ("mlm", "dec")}


def train(method, corpus, out, *extra, ranks=1):
    """One run of method.py; its log rows."""
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                                   if ranks > 1 else [])
    cmd = launcher + [str(ROOT / f"{method}.py"), "--corpus", str(corpus), *TINY, "--out_dir", str(out), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            timeout=1800)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {result.stderr.strip().splitlines()[-1:]}")
    said = [line for line in result.stdout.splitlines() if line.startswith("--compile")]
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()], said


def main():
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "wiki.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in data.read_pretraining_texts(data.WIKI)[:8]))
        print("| method | check | losses (first run) | losses (second run) | equal |\n|---|---|---|---|---|")
        for method, keys in KEYS.items():
            straight, said = train(method, corpus, Path(tmp) / f"{method}-straight", "--batch_size", "8")
            train(method, corpus, Path(tmp) / f"{method}-resumed", "--batch_size", "8", "--halt_at", "2")
            resumed, _ = train(method, corpus, Path(tmp) / f"{method}-resumed", "--batch_size", "8", "--resume")
            losses = lambda rows, keys=keys: [[r[k] for k in keys] for r in rows]
            print(f"| {method} ({', '.join(keys)}) | resume at step 2, bit for bit | {losses(straight)} | "
                  f"{losses(resumed)} | {'yes' if losses(straight) == losses(resumed) else 'NO'} |", flush=True)
            print(f"\n{method}: " + "; ".join(said) + "\n", flush=True)


def _gathered_worker(rank, world, tmp_path, full1, full2):
    """One rank of two: eq. 5 over every rank's views (cpdae.contrastive_loss, as training runs it), -JS compiled."""
    m = full1.shape[0] // world
    x1, x2 = (x[rank * m:(rank + 1) * m].clone().requires_grad_() for x in (full1, full2))
    similarity = run.speed.fused(cpdae.js_similarity, SimpleNamespace(compile=True), sweep_per_input=True)
    loss, _ = cpdae.contrastive_loss(cpdae.word_distribution(x1), cpdae.word_distribution(x2), similarity)
    loss.backward()
    torch.save({"loss": loss.detach(), "g1": x1.grad, "g2": x2.grad}, Path(tmp_path) / f"rank{rank}.pt")


def two_processes_equal_one():
    """CPDAE's gathered eq. 5 with the compiled -JS: the mean of 2 ranks' losses and their gradients (W x the
    one-process gradient of their rows) against 1 process, to test_losses.py's default tolerance."""
    g = torch.Generator().manual_seed(0)
    full1 = torch.randn(8, 300, generator=g)
    full2 = full1 + 0.5 * torch.randn(8, 300, generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = conftest._run_on_two_ranks(_gathered_worker, Path(tmp), full1, full2)
    x1, x2 = full1.clone().requires_grad_(), full2.clone().requires_grad_()
    similarity = run.speed.fused(cpdae.js_similarity, SimpleNamespace(compile=True), sweep_per_input=True)
    loss = cpdae.contrastive_loss(cpdae.word_distribution(x1), cpdae.word_distribution(x2), similarity)[0]
    loss.backward()
    checks = {"loss": ((ranks[0]["loss"] + ranks[1]["loss"]) / 2, loss.detach()),
              "gradients": (torch.cat([r[k] for k in ("g1", "g2") for r in ranks]),
                            2 * torch.cat([x1.grad[:4], x1.grad[4:], x2.grad[:4], x2.grad[4:]]))}
    for name, (two, one) in checks.items():
        equal = torch.allclose(two, one, rtol=1.3e-6, atol=1e-5)
        print(f"| cpdae, eq. 5 gathered, --compile | 2 processes = 1: {name} | {one.flatten()[:3].tolist()} | "
              f"{two.flatten()[:3].tolist()} | {'yes' if equal else 'NO'} (max difference "
              f"{(two - one).abs().max().item():.2e}) |", flush=True)


if __name__ == "__main__":
    with benchmark.recorded(Path(__file__).with_suffix(".md")):
        main()
        two_processes_equal_one()
