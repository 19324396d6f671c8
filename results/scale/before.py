"""The "in memory (before)" rows of scale.py's table: the data path before the token cache, where
every rank read and tokenized the whole corpus into Python lists (data.make_windows) at every start.
Measured as scale.py measures the token cache (the same synthetic corpora, costa.py with a tiny model
for 2 steps under torchrun, time to the first step, peak RSS of the largest process). What it prints is written
to results/scale/before.md.

    python results/scale/before.py 1,20                      # sizes in million tokens; --procs 1,2
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import scale  # scale.py beside this file: the same corpora and timing

import data
import run


class LegacyWindows(list):
    """make_windows' list with the special ids beside it, as TokenWindows has them."""

    def __init__(self, windows, special):
        super().__init__(windows)
        self.special = special


def legacy_load_windows(c, rank):
    """run.load_windows as it was: every rank tokenizes the whole corpus into Python lists."""
    tokenizer = data.load_tokenizer(c.vocab)
    return LegacyWindows(data.make_windows(tokenizer, data.read_pretraining_texts(c.corpus), c.max_len),
                         data.special_ids(tokenizer))


def train_costa(argv):
    """costa.py's command line, on the old data path (what each torchrun rank runs)."""
    import costa
    run.load_windows = legacy_load_windows
    run.run_command_line(lambda: costa.train(run.parse_config(costa.Config, argv, costa.__doc__,
                                                              costa.PAPER_PRESET, costa.FLAG_RULES)))


def before_table(sizes, procs, folder):
    print("| corpus | processes | data path | run | time to first step | peak RSS per rank |\n|---|---|---|---|---|---|")
    for millions in sizes:
        corpus, n_tokens = scale.synthetic_corpus(folder, millions)
        for n in procs:
            first, rss = scale.time_to_first_step(Path(__file__).resolve(), corpus, n, folder, 0)
            print(f"| {n_tokens / 1e6:,.0f} M tokens | {n} | in memory (before) | every run | {first:.1f} s | "
                  f"{rss:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:                  # a torchrun rank, launched by before_table
        train_costa(sys.argv[1:])
        sys.exit()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", help="million tokens, e.g. 1,20 (memory grows with the corpus here: see results/scale/before.md)")
    parser.add_argument("--procs", default="1,2", help="torchrun processes")
    parser.add_argument("--dir", default="runs/bench-scale", help="synthetic corpora (shared with scale.py)")
    args = parser.parse_args()
    with scale.benchmark.recorded(Path(__file__).parent / "before.md"):
        before_table([float(x) if "." in x else int(x) for x in args.sizes.split(",")],
                     [int(x) for x in args.procs.split(",")], args.dir)
