"""Start-up time and peak memory per rank against corpus size, on the token cache: synthetic corpora of
the given sizes (the bundled Wikipedia slice repeated, its documents shuffled in every copy), costa.py
with a tiny model (2 x 64) for 2 steps under torchrun, so that what grows is the data path; the first run
builds the token cache, the second maps it. Time from the command to the first step's line, peak RSS of
the largest process (a rank). before.py measures the old data path with the same corpora and helpers;
see README.md here. What it prints is
written to results/scale/scale.md.

    python results/scale/scale.py 1,20,200                 # sizes in million tokens; --procs 1,2
    python results/scale/scale.py 0.05 --procs 1 --dir /tmp/bench-scale   # a quick check
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the repository root
import benchmark
import data

TINY_MODEL = ["--hidden_size", "64", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "128",
              "--batch_size", "32", "--max_len", "128", "--steps", "2", "--log_every", "1", "--save_every", "1000",
              "--bf16", "false", "--overwrite"]   # a tiny model: what grows with the corpus is the data path


def synthetic_corpus(folder, millions):
    """A plain-text corpus of about `millions` million WordPiece tokens: the bundled Wikipedia slice
    (1.17 M tokens) repeated, its documents shuffled in every copy, blank lines between documents.
    Returns (path, tokens)."""
    texts = data.read_pretraining_texts(data.WIKI)
    per_copy = sum(len(e.ids) for e in data.load_tokenizer().encode_batch(texts, add_special_tokens=False))
    copies = max(1, round(millions * 1e6 / per_copy))
    path = Path(folder) / f"corpus-{millions}M" / "corpus.txt"
    if not path.is_file():
        rng = np.random.default_rng(0)

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                for _ in range(copies):
                    f.writelines(texts[i].replace("\n\n", "\n") + "\n\n" for i in rng.permutation(len(texts)))
        data.atomic_write(path, write)
    return path, copies * per_copy


def time_to_first_step(script, corpus, n, folder, workers):
    """(seconds from the command to its first 'step' line, peak RSS MiB of its largest process (a rank)) of
    `torchrun --nproc_per_node=n script` training TINY_MODEL on corpus; script: costa.py, or one that
    trains like it (results/scale/before.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(script),
           "--corpus", str(corpus), "--out_dir", str(Path(folder) / "run"), "--prep_workers", str(workers), *TINY_MODEL]
    wrapper = ("import json, resource, subprocess, sys, time\n"
               "t0 = time.time(); first = None\n"
               "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)\n"
               "for line in p.stdout:\n"
               "    if first is None and line.startswith('step'): first = time.time() - t0\n"
               "    tail = line\n"
               "if p.wait(): sys.exit('failed: ' + tail)\n"
               "print(json.dumps([first, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))\n")
    return benchmark.in_fresh_process("-c", wrapper, *cmd)


def scale_table(sizes, procs, folder, workers):
    """Rows: corpus size x processes x run (the first builds the token cache, the second maps it)."""
    print("| corpus | processes | data path | run | time to first step | peak RSS per rank |\n|---|---|---|---|---|---|")
    built = []
    for millions in sizes:
        corpus, n_tokens = synthetic_corpus(folder, millions)
        for cache in Path(corpus).parent.glob("*.tokens-*"):
            shutil.rmtree(cache)                                     # the first run builds the cache
        for n in procs:
            for run in (["first (builds it)"] if n == procs[0] else []) + ["second"]:
                first, rss = time_to_first_step(ROOT / "costa.py", corpus, n, folder, workers)
                print(f"| {n_tokens / 1e6:,.0f} M tokens | {n} | token cache | {run} | {first:.1f} s | {rss:,.0f} MiB |",
                      flush=True)
        (manifest,) = Path(corpus).parent.glob("*.tokens-*/manifest.json")
        m = json.loads(manifest.read_text())
        disk = sum(f.stat().st_size for f in manifest.parent.iterdir()) / 2**20
        built.append(f"{m['n_tokens']:,} tokens: tokenized in {m['seconds']} s ({m['tokens_per_s']:,} tokens/s, "
                     f"{workers or os.cpu_count()} workers), cache {disk:,.0f} MiB on disk")
    print("\n" + "\n".join(built))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", help="corpus sizes in million tokens, e.g. 1,20,200")
    parser.add_argument("--procs", default="1,2", help="torchrun processes")
    parser.add_argument("--dir", default="runs/bench-scale", help="synthetic corpora and caches (shared with before.py)")
    parser.add_argument("--prep_workers", type=int, default=0, help="tokenizing processes (0 = all cores)")
    args = parser.parse_args()
    with benchmark.recorded(Path(__file__).parent / "scale.md"):
        scale_table([float(x) if "." in x else int(x) for x in args.sizes.split(",")],
                    [int(x) for x in args.procs.split(",")], args.dir, args.prep_workers)
