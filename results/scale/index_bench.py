"""faiss indexes for dense retrieval, as evaluate.build_index builds them and evaluate.set_search_parameters
sets them: build time, index size, queries/s and Recall@100 against exact search, for Flat, HNSW32 and
inverted lists (exact and 8-bit codes) at several search settings. First a SciFact-sized set (real vectors
from --vectors, else synthetic), then synthetic 384-d sets of each of --sizes, and how each setting's
per-query cost grows between them. What it prints is written to
results/scale/index_bench.md.

    python results/scale/index_bench.py                                  # synthetic: SciFact's size, 100k, 1M
    python results/scale/index_bench.py --vectors docs.npy,queries.npy   # ... SciFact's part on real vectors
    python results/scale/index_bench.py --sizes 20000 --queries 50       # a quick check
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import evaluate


def synthetic_vectors(n, dim=384, seed=0, rank=64, clusters=20000, chunk=100_000):
    """(n, dim) unit float32 vectors shaped like real embeddings, not uniform noise (on which every
    index looks bad): a mixture of `clusters` Gaussians in a rank-64 space, of Zipf-like sizes and
    spreads from 0.3 to 1 (so clusters overlap, and match no index's lists), randomly projected to
    dim, plus a little full-rank noise. Made chunk rows at a time; the first m rows of a larger set
    are the set of size m (same seed), so 100k is a prefix of 1M."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, rank)).astype(np.float32)                   # (C, r)
    spread = rng.uniform(0.3, 1.0, (clusters, 1)).astype(np.float32)                     # (C, 1)
    weights = 1 / np.arange(1, clusters + 1) ** 0.7                                      # (C,)
    projection = rng.standard_normal((rank, dim)).astype(np.float32) / np.sqrt(rank)     # (r, dim)
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        c = rng.choice(clusters, size=m, p=weights / weights.sum())                     # (m,)
        z = centres[c] + spread[c] * rng.standard_normal((m, rank), dtype=np.float32)   # (m, r)
        x = z @ projection + 0.1 * rng.standard_normal((m, dim), dtype=np.float32)      # (m, dim)
        out[start:start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def queries_near(docs, n_queries, seed=1, noise=0.5):
    """Queries drawn near documents: a random document plus Gaussian noise of norm ~noise, unit length."""
    rng = np.random.default_rng(seed)
    base = docs[np.sort(rng.choice(len(docs), n_queries, replace=False))]               # (Q, dim)
    q = base + noise / np.sqrt(docs.shape[1]) * rng.standard_normal(base.shape, dtype=np.float32)
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def index_specs(n):
    """(index_factory string, [(search knob, values)]) to measure on n vectors: exact, a graph, and
    inverted lists (exact codes and 8-bit scalar-quantised) with sqrt(n) lists."""
    nlist = 2 ** max(4, round(np.log2(np.sqrt(n))))
    return [("Flat", [("", [0])]),
            ("HNSW32", [("efSearch", [128, 256, 512, 1024, 2048])]),
            (f"IVF{nlist},Flat", [("nprobe", [32, 64, 128, 256])]),
            (f"IVF{nlist},SQ8", [("nprobe", [64, 128, 256])])]


def timed_search(index, queries, k, repeat_under=2.0):
    """(seconds, ids (Q, k)): the fastest of up to 3 runs while a run takes under repeat_under seconds,
    so that a short search is not measured by whatever else the machine did at that moment."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _, ids = index.search(queries, k)                                                # (Q, k)
        best = min(best, time.perf_counter() - t0)
        if best >= repeat_under:
            break
    return best, ids


def bench_indexes(name, docs, queries, k=100):
    """One row per index and search setting: build s, index MiB, queries/s, Recall@100 vs Flat."""
    import faiss
    rows, exact = [], None
    for spec, knobs in index_specs(len(docs)):
        nlist = int(spec[3:].split(",")[0]) if spec.startswith("IVF") else 1
        t0 = time.perf_counter()
        index = evaluate.build_index(docs, spec, train_size=40 * nlist)
        build_s = time.perf_counter() - t0
        mib = faiss.serialize_index(index).nbytes / 2**20
        for knob, values in knobs:
            for value in values:
                evaluate.set_search_parameters(index, **({"nprobe": value} if knob == "nprobe" else {"ef_search": value}))
                seconds, ids = timed_search(index, queries, k)                           # (Q, k)
                exact = ids if exact is None else exact
                recall = np.mean([len(np.intersect1d(a, b)) / k for a, b in zip(ids, exact)])
                rows.append({"data": name, "n": len(docs), "index": spec, "knob": f"{knob} {value}" if knob else "exact",
                             "build_s": build_s, "mib": mib, "qps": len(queries) / seconds,
                             "ms_per_query": 1000 * seconds / len(queries), "recall": recall})
                print(f"  {name} {len(docs):,} {spec} {knob} {value}: {rows[-1]['qps']:,.0f} q/s, "
                      f"recall {recall:.3f}", file=sys.stderr, flush=True)
        del index
    return rows


def index_table(rows):
    """Markdown: every measured row, then the per-query cost growth of each setting between sizes."""
    lines = ["| data | N | index | search | build s | index MiB | queries/s | ms/query | Recall@100 |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['data']} | {r['n']:,} | {r['index']} | {r['knob']} | {r['build_s']:.1f} | {r['mib']:,.0f} | "
              f"{r['qps']:,.0f} | {r['ms_per_query']:.3f} | {r['recall']:.3f} |" for r in rows]
    synth = [r for r in rows if r["data"] == "synthetic"]
    sizes = sorted({r["n"] for r in synth})
    if len(sizes) >= 2:
        small, large = sizes[0], sizes[-1]
        family = lambda r: (r["index"].split(",")[1] if r["index"].startswith("IVF") else r["index"], r["knob"])
        by = {(r["n"], family(r)): r for r in synth}
        header = (f"| index | search | ms/query {small:,} | ms/query {large:,} | growth (N x{large // small}) "
                  f"| Recall@100 {small:,} | Recall@100 {large:,} |")
        lines += ["", header, "|---|---|---|---|---|---|---|"]
        for r in (r for r in synth if r["n"] == large):
            a = by.get((small, family(r)))
            if a:
                lines.append(f"| {a['index']} -> {r['index']} | {r['knob']} | {a['ms_per_query']:.3f} | "
                             f"{r['ms_per_query']:.3f} | x{r['ms_per_query'] / a['ms_per_query']:.1f} | "
                             f"{a['recall']:.3f} | {r['recall']:.3f} |")
    return "\n".join(lines)


def index_bench(vectors, sizes, n_queries):
    """Each faiss index_factory string built by evaluate.build_index (trained on 40 vectors per inverted
    list): build time (train + add), index size (faiss.serialize_index), queries/s (all queries in one call
    on faiss's OpenMP threads; the best of up to 3 calls when one takes under 2 s) and Recall@100 against
    exact search (the share of the exact top-100 ids found). Data: a SciFact-sized set (5,183 documents;
    real vectors from `vectors`, else synthetic), then synthetic 384-d sets of each of sizes, so that the
    per-query cost from 100k to 1M can be compared. IVF lists scale as the square root of the corpus."""
    import faiss
    t0 = time.perf_counter()
    if vectors:
        paths = vectors.split(",")
        docs = np.ascontiguousarray(np.load(paths[0], mmap_mode="r"), dtype=np.float32)
        queries = np.load(paths[1]).astype(np.float32) if len(paths) > 1 else queries_near(docs, n_queries)
        rows = bench_indexes("scifact", docs, queries)
    else:
        docs = synthetic_vectors(5183, seed=2)                       # SciFact's corpus size
        rows = bench_indexes("scifact-size synthetic", docs, queries_near(docs, 300))
    if sizes:
        docs = synthetic_vectors(max(sizes))
        queries = queries_near(docs[:min(sizes)], n_queries)
        for n in sizes:
            rows += bench_indexes("synthetic", docs[:n], queries)
    print(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} thread(s), "
          f"{n_queries} queries (synthetic), k = 100, {time.perf_counter() - t0:.0f} s in all\n")
    print(index_table(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", default="", help="DOCS.npy[,QUERIES.npy]: real vectors for the SciFact-size part "
                                                      "(else synthetic; without QUERIES, queries near the documents)")
    parser.add_argument("--sizes", default="100000,1000000", help="synthetic corpus sizes ('' = none)")
    parser.add_argument("--queries", type=int, default=500, help="synthetic queries")
    args = parser.parse_args()
    with benchmark.recorded(Path(__file__).parent / "index_bench.md"):
        index_bench(args.vectors, [int(float(x)) for x in args.sizes.split(",") if x], args.queries)
