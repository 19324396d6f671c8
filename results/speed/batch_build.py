"""How long each method's data path takes to build one batch of 32 x 512 tokens on one core (its Batches,
torch and numpy on 1 thread), from the bundled Wikipedia slice through the token cache: MLM-only (costa.py
--gwc_weight 0), COSTA, CPDAE, SEED; and COSTA's span sampling as it was before its word tables (costa.py
at --old, imported from git), which draws the same spans (test_losses.py checks it). Round-robin, a new
order each pass; per method the median over passes of the mean ms per batch, so that another job on the
machine moves every method alike. What it prints is written to results/speed/batch_build.md.

    python results/speed/batch_build.py                     # 8 passes of 10 batches
    python results/speed/batch_build.py --passes 2 --batches 3 --max_len 128   # a quick check
"""
import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the repository root
import benchmark
import run


def module_at(commit, name):
    """The module name.py as it was at commit, imported under another name (it imports this tree's data, run)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{name}.py"], capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / f"{name}_at_{commit[:7]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def datasets(max_len, batch, cache_dir, old):
    """{row name: a method's Batches} at batch x max_len over the bundled slice's windows."""
    import costa
    import cpdae
    import seed
    rows = {"MLM-only (costa.py --gwc_weight 0)": (costa, {"gwc_weight": 0.0}), "COSTA": (costa, {}),
            f"COSTA, span sampling before the word tables ({old})": (module_at(old, "costa"), {}),
            "CPDAE": (cpdae, {}), "SEED": (seed, {})}
    out = {}
    for name, (module, flags) in rows.items():
        c = module.Config(max_len=max_len, batch_size=batch, steps=10_000, cache_dir=cache_dir, **flags)
        out[name] = module.Batches(c, run.load_windows(c, 0), 0, 1)
    return out


def build_times(max_len, batch, passes, n_batches, old):
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        sets = datasets(max_len, batch, cache, old)
        for dataset in sets.values():
            dataset[0]                                           # warm: the tables, the first mapping
        times, order = {name: [] for name in sets}, list(sets)
        for p in range(passes):
            random.Random(p).shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                for m in range(1 + p * n_batches, 1 + (p + 1) * n_batches):
                    sets[name][m]
                times[name].append((time.perf_counter() - t0) / n_batches * 1000)
    return {name: float(np.median(t)) for name, t in times.items()}


def table(max_len, batch, passes, n_batches, old):
    ms = build_times(max_len, batch, passes, n_batches, old)
    base = ms["MLM-only (costa.py --gwc_weight 0)"]
    print(f"one batch of {batch} x {max_len} tokens built by each method's Batches on 1 thread; median over {passes} "
          f"passes of the mean of {n_batches} batches (round-robin)")
    print("| data path | ms per batch | against MLM-only |\n|---|---|---|")
    for name, value in ms.items():
        print(f"| {name} | {value:.1f} | {value / base:.2f}x |")
    worst = max(v / base for k, v in ms.items() if "before" not in k)
    print(f"\ngoal: every method's batch in at most 2x MLM-only's time: {'met' if worst <= 2 else 'NOT met'} "
          f"(the slowest at {worst:.2f}x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=8)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--old", default="e8cb494", help="the commit whose costa.py is the 'before' row")
    args = parser.parse_args()
    with benchmark.recorded(Path(__file__).parent / "batch_build.md"):
        table(args.max_len, args.batch, args.passes, args.batches, args.old)
