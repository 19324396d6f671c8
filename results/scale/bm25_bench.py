"""evaluate.BM25's top-k at MS MARCO-like sizes: the dense rows (dense_search: every query scored against
every passage, what search() did at every size before) against the sparse top-k (sparse_search: only the
passages that share a term with the query, what search() does above BM25.DENSE_UP_TO passages), on
generated corpora. Each (size, path) runs in a fresh process (the peak RSS is a high-water mark); both
paths' top-k scores are compared. What it prints is written to results/scale/bm25_bench.md.

The passages and queries are generated: words of a 200,000-word vocabulary drawn with Zipf-like
frequencies (p ~ 1 / rank^1.1), the 318 most frequent being scikit-learn's English stopwords (which BM25
drops, as the most frequent English words mostly are), 56 words a passage and 6 a query on average (MS
MARCO's lengths), seeded.

    python results/scale/bm25_bench.py 300000,3000000          # what bm25_bench.md holds
    python results/scale/bm25_bench.py 20000 --queries 200     # a quick check
"""
import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import evaluate

VOCAB = 200_000
STOPWORDS = sorted(ENGLISH_STOP_WORDS)   # BM25's tokenizer drops them (318 words)


def words(n_texts, mean_len, seed):
    """n_texts generated texts of about mean_len words: Zipf-like word ids spelled as letters."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, VOCAB + 1) ** 1.1
    letters = np.array(list("qwrtypsdfghjklzxcvbnm"))            # 21 consonants: no made-up word is a stopword
    digits = (np.arange(VOCAB)[:, None] // 21 ** np.arange(5)) % 21                          # (VOCAB, 5)
    spelled = np.array(["".join(row) for row in letters[digits]])  # 'qqqqq', 'wqqqq', ...
    spelled[:len(STOPWORDS)] = STOPWORDS                         # the most frequent words are stopwords, as in English
    texts = []
    for start in range(0, n_texts, 50_000):                      # in blocks: the word arrays stay small
        lengths = rng.poisson(mean_len - 1, min(50_000, n_texts - start)) + 1
        ids = rng.choice(VOCAB, size=int(lengths.sum()), p=p / p.sum())
        texts += [" ".join(chunk) for chunk in np.split(spelled[ids], np.cumsum(lengths)[:-1])]
    return texts


def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bm25_one(paths, n_docs, n_queries, k, scores_file):
    """Index n_docs generated passages, search n_queries generated queries for their top k with each path
    of paths ("dense", "sparse"), in that order; times and peak RSS (MiB) in this process after each step;
    each path's scores saved to scores_file with the path's name in it."""
    docs, queries = words(n_docs, 56, seed=0), words(n_queries, 6, seed=1)
    out = {"generated": peak_mib()}
    t0 = time.time()
    bm25 = evaluate.BM25(docs, 1.2, 0.75)
    del docs
    out.update(index_s=time.time() - t0, indexed=peak_mib(), postings=int(bm25.weights_t.nnz))
    for path in paths:
        t0 = time.time()
        scores, _ = getattr(bm25, f"{path}_search")(queries, k)
        out[path] = {"search_s": time.time() - t0, "searched": peak_mib()}
        np.save(scores_file.format(path), scores)
    return out


def bm25_table(sizes, n_queries, k, one_process_from):
    print(f"evaluate.BM25 top-{k} of {n_queries:,} generated queries over generated passages; peak RSS in MiB "
          f"(ru_maxrss) after generating the texts, after indexing, after searching. Below {one_process_from:,} "
          f"passages each path runs in a fresh process; from there both run after one index in one process, "
          f"sparse first, so the dense row's peak is the larger of the two")
    print("| passages | postings | top-k from | index | s per 1,000 queries | peak RSS: texts | indexed | searched |"
          "\n|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            file = str(Path(tmp) / f"{n}-{{}}.npy")
            groups = [["sparse", "dense"]] if n >= one_process_from else [["dense"], ["sparse"]]
            rows = {}
            for paths in groups:
                r = benchmark.in_fresh_process(__file__, "--child", "bm25_one", json.dumps([paths, n, n_queries, k,
                                                                                            file]))
                rows.update({path: {**r, **r[path]} for path in paths})
            for path in ("dense", "sparse"):
                r = rows[path]
                print(f"| {n:,} | {r['postings']:,} | {path} rows | {r['index_s']:.1f} s | "
                      f"{r['search_s'] / n_queries * 1000:.2f} | {r['generated']:,.0f} | {r['indexed']:,.0f} | "
                      f"{r['searched']:,.0f} |", flush=True)
            same = np.array_equal(np.load(file.format("dense")), np.load(file.format("sparse")))
            speedup = rows["dense"]["search_s"] / rows["sparse"]["search_s"]
            print(f"| {n:,} | | sparse against dense | | {speedup:.1f}x faster | | | top-{k} scores identical: "
                  f"{'yes' if same else 'NO'} |", flush=True)


CHILDREN = {f.__name__: f for f in (bm25_one,)}   # run by benchmark.in_fresh_process


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="?", default="300000,3000000", help="passages, comma-separated")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=100, help="top-k (finetune.py's --bm25_depth)")
    parser.add_argument("--one_process_from", type=int, default=1_000_000, help="passages from which both paths "
                        "share one index in one process (indexing is most of the time)")
    parser.add_argument("--child", nargs=2, metavar=("FUNCTION", "ARGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](*json.loads(args.child[1]))))
    else:
        with benchmark.recorded(Path(__file__).parent / "bm25_bench.md"):
            bm25_table([int(s) for s in args.sizes.split(",")], args.queries, args.k, args.one_process_from)
