"""--compile keeps the run's guarantees, each run against itself: resume is bit for bit (a run halted at step 2
and resumed logs the losses of the straight run), and 2 processes give 1 process's losses (torchrun, the
global batch split). CPDAE and SEED (the methods --compile changes), tiny sizes on the bundled corpus' first
articles, 4 steps; each run compiles in its own process. What it prints is written to
results/speed/compile_exact.md.

    python results/speed/compile_exact.py
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import benchmark
import data

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
            two, _ = train(method, corpus, Path(tmp) / f"{method}-two", "--global_batch", "8", ranks=2)
            losses = lambda rows, keys=keys: [[r[k] for k in keys] for r in rows]
            for check, other, equal in (
                    ("resume at step 2, bit for bit", resumed, losses(straight) == losses(resumed)),
                    ("2 processes = 1, to 1e-5", two, all(abs(a - b) <= 1e-5 * max(1, abs(b)) for x, y in
                                                           zip(losses(two), losses(straight)) for a, b in zip(x, y)))):
                print(f"| {method} ({', '.join(keys)}) | {check} | {losses(straight)} | {losses(other)} | "
                      f"{'yes' if equal else 'NO'} |", flush=True)
            print(f"\n{method}: " + "; ".join(said) + "\n", flush=True)


if __name__ == "__main__":
    with benchmark.recorded(Path(__file__).with_suffix(".md")):
        main()
