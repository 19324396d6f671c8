"""Speed and memory: each training step against this machine's matmul rate, the goals, and the
throughput and peak memory of each method and of transformers' BertForMaskedLM.

The default run prints, in one run (so that whatever else the machine does slows every row alike):
this machine's bf16 and fp32 matmul rate at the models' shapes; each training step (the encoder alone
at MiniLM's size, every method at the CPU default size and at MiniLM's, a finetune.py step), timed
round-robin in one process, with its FLOPs (counted from the matmul shapes by torch's FlopCounterMode,
forward + backward; the encoder's also analytically: 6 x non-embedding weights x tokens + attention)
and the share of the matmul rate it reaches; the goals table (measure | goal | today); then the
per-variant table: every variant trains on the same real batches (the bundled Wikipedia slice, the
method's own masking), with the same model size and batch, for --steps optimizer steps after
--warmup untimed ones, in a fresh process of its own so that peak memory is its own:

    python benchmark.py                                   # speed table, goals, then all variants
    python benchmark.py --st                              # ... plus finetune.py against sentence-transformers
    python benchmark.py --st_ndcg 0,1,2                   # test nDCG@10, finetune.py against sentence-transformers, per seed
    python benchmark.py --st_memory                       # fine-tuning memory: live vs kept by malloc, both tools
    python benchmark.py --micro                           # dropout and attention: ours against torch's
    python benchmark.py --levers                          # candidate encoder changes on finetune.py's step: time, loss, memory
    python benchmark.py --profile costa-mlm,cpdae,seed    # each step's time by op kind (torch.profiler)
    python benchmark.py --gpu                             # BERT-base, batch 32 x 512, on one GPU: MFU per method
    python benchmark.py --variants costa-mlm,hf-bert-mlm --steps 20
    python benchmark.py --set batch_size=64 --set max_len=256
    python benchmark.py --js                              # CPDAE's contrastive loss: chunked vs naive memory
    python benchmark.py --index_bench                     # faiss indexes: build, memory, queries/s, Recall@100
    python benchmark.py --index_bench --vectors docs.npy[,queries.npy]   # ... on real (e.g. SciFact) vectors
    python benchmark.py --vectors_rss 300000              # peak RSS of encode + search: float32 in memory vs fp16 memmap
    python benchmark.py --scale 1,20,200                  # start-up time and peak RSS per rank against corpus size

tokens/s counts real (non-padding) tokens through forward, backward and the AdamW step.
peak memory: max resident set size of the process on CPU (model, optimizer, activations and the
few documents loaded), torch.cuda.max_memory_allocated on GPU.

--index_bench builds each faiss index_factory string with evaluate.build_index (trained on a sample
of 40 vectors per inverted list) and reports build time (train + add), index size
(faiss.serialize_index), queries/s (all queries in one call on faiss's OpenMP threads; the best of
up to 3 calls when one takes under 2 s) and Recall@100
against exact search (the share of the exact top-100 ids found). Data: a SciFact-sized set (5,183
documents; real vectors with --vectors, else synthetic), then synthetic sets of 100,000 and 1,000,000
(--sizes) 384-d vectors, so that the per-query cost from 100k to 1M can be compared. IVF lists scale
as the square root of the corpus (a power of two), as usual.
"""
import argparse
import dataclasses
import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import data
import evaluate

# variant -> (module, Config overrides). "costa-mlm" is the papers' BERT/MLM baseline.
VARIANTS = {
    "costa-mlm": ("costa", {"gwc_weight": 0.0}),
    "costa": ("costa", {}),
    "cpdae": ("cpdae", {}),
    "seed": ("seed", {}),
    "hf-bert-mlm": ("costa", {"gwc_weight": 0.0}),   # same batches, transformers' model
}


def load_batches(module, c, n_batches, n_texts=40):
    """The first n_batches of the method's own data path, built from n_texts real articles."""
    texts = data.read_pretraining_texts(c.corpus)[:n_texts]
    with tempfile.TemporaryDirectory() as tmp:
        c.corpus = str(Path(tmp) / "corpus.jsonl")
        Path(c.corpus).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        dataset = module.Batches(c, data.load_windows(c, 0), 0, 1)
        return [dataset[i] for i in range(n_batches)]


def reset_peak_rss():
    """Zero this process's peak-RSS mark (Linux: VmHWM, via /proc/self/clear_refs), so that the peak read
    next is the training steps', not the setup's (reading the corpus, BM25). False where it cannot."""
    import gc
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib():
    """This process's peak RSS in MiB since the last reset_peak_rss (else since it started)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib():
    """This process's resident set now, MiB (Linux; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return 0.0


def st_memory_table(n_steps=2, warmup=1):
    """Fine-tuning memory, ours and sentence-transformers', each in a fresh process, with glibc's malloc as
    is and with its mmap threshold pinned at 64 KiB (freed activations go back to the OS, so the peak is
    live memory and the resident set between steps is what the step keeps): how much of each peak is
    memory that malloc retained rather than memory the step needs."""
    print("| fine-tuning step, MiniLM, batch 32 x (1 + 2) texts | malloc | resident between steps MiB | peak MiB |\n"
          "|---|---|---|---|")
    for which in ("ours", "st"):
        for name, env in (("as is", os.environ), ("mmap threshold 64 KiB", {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})):
            cmd = [sys.executable, __file__, "--st-one", f"{which}:{n_steps}:{warmup}"]
            result = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if result.returncode:
                print(f"| {which} | {name} | failed: {(result.stderr.strip().splitlines() or ['?'])[-1]} | |")
                continue
            r = json.loads(result.stdout.strip().splitlines()[-1])
            label = "finetune.py" if which == "ours" else "sentence-transformers"
            print(f"| {label} | {name} | {r['between_mib']:,.0f} | {r['peak_mib']:,.0f} |", flush=True)


def hf_model(c):
    import transformers
    config = transformers.BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                     intermediate_size=c.ffn_size, max_position_embeddings=c.max_position,
                                     hidden_dropout_prob=c.dropout, attention_probs_dropout_prob=c.dropout)
    model = transformers.BertForMaskedLM(config)
    return lambda batch: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=batch["labels"]).loss, model


def run_one(variant, overrides, steps, warmup):
    module_name, fixed = VARIANTS[variant]
    module = importlib.import_module(module_name)
    torch.manual_seed(0)
    known = {f for f in module.Config.__dataclass_fields__}
    c = module.Config(**{k: v for k, v in {**fixed, **overrides}.items() if k in known})
    c.steps = steps + warmup
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = load_batches(module, c, steps + warmup)
    if variant == "hf-bert-mlm":
        forward, model = hf_model(c)
    else:
        model = module.PretrainModel(c, module.Encoder(c))
        forward = lambda batch: model(batch)[0]
    model.to(device).train()
    optimizer, _ = data.make_optimizer(model, c, eps=adam_eps(module))
    autocast = data.autocast_bf16(device)            # as training runs: bf16 on GPUs and bf16-capable CPUs
    tokens, t0 = 0, None
    reset_peak_rss()                                 # the training steps' peak, not the corpus reading's
    for i, batch in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            tokens, t0 = 0, time.perf_counter()
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast:
            loss = forward(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(batch["attention_mask"].sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else peak_rss_mib() * 2**20) / 2**20
    n_params = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "tokens_per_s": tokens / elapsed, "peak_mib": peak, "device": device.type,
            "params_m": n_params / 1e6, "batch_size": c.batch_size, "max_len": c.max_len,
            "hidden_size": c.hidden_size, "num_layers": c.num_layers, "threads": torch.get_num_threads()}


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
        js = 0.5 * (torch.xlogy(dist1, dist1).sum(-1)[:, None] + torch.xlogy(candidates, candidates).sum(-1)[None, :]) \
            - torch.xlogy(mix, mix).sum(-1)
        sim = -js
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
        cmd = [sys.executable, __file__, "--js-one", f"{variant}:{chunk}:{m}:{vocab}"]
        rows = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
                for env in (os.environ, {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})]
        base = base or rows
        name = f"{variant} {chunk}" if variant == "chunked" else variant
        print(f"{name:<12}{rows[0]['peak_mib'] - base[0]['peak_mib']:>19,.0f}"
              f"{rows[1]['peak_mib'] - base[1]['peak_mib']:>17,.0f}{rows[0]['seconds']:>9.1f}  {rows[0]['loss']:.6f}",
              flush=True)


# ----------------------------------------------------------------------------------------------
# --scale: start-up time and peak memory against corpus size, token cache vs the in-memory windows
# ----------------------------------------------------------------------------------------------
TINY_MODEL = ["--hidden_size", "64", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "128",
              "--batch_size", "32", "--max_len", "128", "--steps", "2", "--log_every", "1", "--save_every", "1000",
              "--bf16", "false", "--overwrite"]   # a tiny model: what grows with the corpus is the data path


def synthetic_corpus(folder, millions):
    """A plain-text corpus of about `millions` million WordPiece tokens: the bundled Wikipedia slice
    (1.17 M tokens) repeated, its documents shuffled in every copy, blank lines between documents."""
    texts = data.read_pretraining_texts(data.WIKI)
    per_copy = sum(len(e.ids) for e in data.load_tokenizer().encode_batch(texts, add_special_tokens=False))
    copies = max(1, round(millions * 1e6 / per_copy))
    path = Path(folder) / f"corpus-{millions}M" / "corpus.txt"
    if not path.is_file():
        rng = np.random.default_rng(0)

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                for _ in range(copies):
                    for i in rng.permutation(len(texts)):
                        f.write(texts[i].replace("\n\n", "\n") + "\n\n")
        data._atomic(path, write)
    return path, copies * per_copy


def legacy_load_windows(c, rank):
    """The data path before the token cache: every rank reads and tokenizes the whole corpus into
    Python lists (make_windows). For --scale's "before" rows only."""
    tokenizer = data.load_tokenizer(c.vocab)
    windows = data.make_windows(tokenizer, data.read_pretraining_texts(c.corpus), c.max_len)
    return LegacyWindows(windows, data.special_ids(tokenizer))


class LegacyWindows(list):
    """make_windows' list with the special ids beside it, as TokenWindows has them."""

    def __init__(self, windows, special):
        super().__init__(windows)
        self.special = special


def run_legacy_costa(argv):
    import costa
    data.load_windows = legacy_load_windows
    costa.train(data.parse_config(costa.Config, argv, costa.__doc__, costa.PAPER_PRESET, costa.FLAG_RULES))


def measure(cmd):
    """Run cmd in a fresh wrapper process; return (seconds to the first 'step' line, wall seconds,
    peak RSS in MiB of the largest process it started (a rank; ru_maxrss of the children))."""
    wrapper = ("import json, resource, subprocess, sys, time\n"
               "t0 = time.time(); first = None\n"
               "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)\n"
               "for line in p.stdout:\n"
               "    if first is None and line.startswith('step'): first = time.time() - t0\n"
               "    tail = line\n"
               "if p.wait(): sys.exit('failed: ' + tail)\n"
               "print(json.dumps([first, time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))\n")
    result = subprocess.run([sys.executable, "-c", wrapper] + cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: {result.stderr.strip() or result.stdout.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def scale_table(sizes, procs, before_max, folder, workers):
    """Rows: corpus size x processes x (before | after, first run | second run)."""
    print("| corpus | processes | data path | run | time to first step | peak RSS per rank |")
    print("|---|---|---|---|---|---|")
    built = []
    for millions in sizes:
        corpus, n_tokens = synthetic_corpus(folder, millions)
        for n in procs:
            if n == procs[0]:
                for cache in Path(corpus).parent.glob("*.tokens-*"):
                    shutil.rmtree(cache)                      # the first run builds the cache
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
            common = ["--corpus", str(corpus), "--out_dir", str(Path(folder) / "run"), "--prep_workers", str(workers)]
            variants = [("token cache", "first (builds it)", launch + ["costa.py"])] if n == procs[0] else []
            variants.append(("token cache", "second", launch + ["costa.py"]))
            if millions <= before_max:
                variants.insert(0, ("in memory (before)", "every run", launch + [__file__, "--legacy_costa"]))
            for path_name, run, cmd in variants:
                first, wall, rss = measure(cmd + common + TINY_MODEL)
                print(f"| {n_tokens / 1e6:,.0f} M tokens | {n} | {path_name} | {run} | {first:.1f} s | {rss:,.0f} MiB |",
                      flush=True)
        (manifest,) = Path(corpus).parent.glob("*.tokens-*/manifest.json")
        m = json.loads(manifest.read_text())
        disk = sum(f.stat().st_size for f in manifest.parent.iterdir()) / 2**20
        built.append(f"{m['n_tokens']:,} tokens: tokenized in {m['seconds']} s ({m['tokens_per_s']:,} tokens/s, "
                     f"{workers or os.cpu_count()} workers), cache {disk:,.0f} MiB on disk")
    print("\n" + "\n".join(built))


# ---------------------------------------------------------------------------------------------
# --index_bench: faiss indexes for dense retrieval (evaluate.build_index / set_search_parameters)
# ---------------------------------------------------------------------------------------------
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
        lines += ["", f"| index | search | ms/query {small:,} | ms/query {large:,} | growth (N x{large // small}) "
                      f"| Recall@100 {small:,} | Recall@100 {large:,} |", "|---|---|---|---|---|---|---|"]
        for r in (r for r in synth if r["n"] == large):
            a = by.get((small, family(r)))
            if a:
                lines.append(f"| {a['index']} -> {r['index']} | {r['knob']} | {a['ms_per_query']:.3f} | "
                             f"{r['ms_per_query']:.3f} | x{r['ms_per_query'] / a['ms_per_query']:.1f} | "
                             f"{a['recall']:.3f} | {r['recall']:.3f} |")
    return "\n".join(lines)


def index_bench(args):
    """--index_bench: SciFact-sized (real with --vectors) then synthetic sets of each --sizes."""
    t0 = time.perf_counter()
    rows = []
    if args.vectors:
        paths = args.vectors.split(",")
        docs = np.ascontiguousarray(np.load(paths[0], mmap_mode="r"), dtype=np.float32)
        queries = np.load(paths[1]).astype(np.float32) if len(paths) > 1 else queries_near(docs, args.queries)
        rows += bench_indexes("scifact", docs, queries)
    else:
        docs = synthetic_vectors(5183, seed=2)                       # SciFact's corpus size
        rows += bench_indexes("scifact-size synthetic", docs, queries_near(docs, 300))
    sizes = [int(float(x)) for x in args.sizes.split(",") if x]
    docs = synthetic_vectors(max(sizes)) if sizes else None
    queries = queries_near(docs[:min(sizes)], args.queries) if sizes else None
    for n in sizes:
        rows += bench_indexes("synthetic", docs[:n], queries)
    import faiss
    print(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} thread(s), "
          f"{args.queries} queries (synthetic), k = 100, {time.perf_counter() - t0:.0f} s in all\n")
    print(index_table(rows))


# ---------------------------------------------------------------------------------------------
# --vectors_rss: peak memory of encode + search, vectors in memory (float32) or on disk (fp16)
# ---------------------------------------------------------------------------------------------
class RandomEncoder(torch.nn.Module):
    """Stands in for the encoder in evaluate.encode: random hidden states, so that the run measures
    the vectors and the search, not a model."""
    def __init__(self, hidden_size):
        super().__init__()
        self.config = evaluate.EncoderConfig(hidden_size=hidden_size)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, ids, mask):
        return torch.randn(*ids.shape, self.config.hidden_size, generator=self.generator)   # (b, L, H)


def vectors_rss_one(where, search, n, dim=768):
    """evaluate.encode of n texts then a top-100 search of 100 queries, in this process; the peak RSS
    (MiB) after each. where: "memory" (float32 array) or "memmap" (fp16 file); search: a faiss
    index_factory string, or "torch" (evaluate.torch_exact_search, what a GPU runs, here on the CPU)."""
    tokenizer, cpu, encoder = data.load_tokenizer(), torch.device("cpu"), RandomEncoder(dim)
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = peak()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "docs.npy") if where == "memmap" else ""
        docs = evaluate.encode(encoder, "cls", tokenizer, ["cell"] * n, 4, 512, cpu, False, "dot", path)  # (n, H)
        encoded = peak()
        queries = evaluate.encode(encoder, "cls", tokenizer, ["gene"] * 100, 4, 512, cpu, False)          # (100, H)
        if search == "torch":
            evaluate.torch_exact_search(queries, docs, 100, cpu)
        else:
            evaluate.search(queries, docs, 100, search)
    return {"where": where, "search": search, "start": start, "encoded": encoded, "searched": peak()}


def vectors_rss_table(n):
    """Each case in a fresh process (ru_maxrss is a high-water mark)."""
    print(f"peak RSS (MiB) of evaluate.encode + search, {n:,} x 768 vectors, 100 queries, top-100")
    print("| vectors | search | start | after encode | after search |\n|---|---|---|---|---|")
    for where, search in [("memory", "Flat"), ("memmap", "Flat"), ("memmap", "torch"),
                          ("memory", "IVF256,SQ8"), ("memmap", "IVF256,SQ8")]:
        cmd = [sys.executable, __file__, "--rss-one", f"{where}:{search}:{n}"]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        name = "float32 in memory" if where == "memory" else "fp16 memmap"
        print(f"| {name} | {search} | {r['start']:,.0f} | {r['encoded']:,.0f} | {r['searched']:,.0f} |", flush=True)


# ----------------------------------------------------------------------------------------------
# Speed (the default run): each training step's FLOP/s as a share of this machine's matmul rate,
# the method ratios, fine-tuning against sentence-transformers (--st), and the goals
# ----------------------------------------------------------------------------------------------
MINILM = {"hidden_size": 384, "num_layers": 6, "num_heads": 12, "ffn_size": 1536}   # all-MiniLM-L6-v2's sizes
ST_NDCG_RESULTS = Path(__file__).resolve().parent / "results" / "st-ndcg"   # --st_ndcg's rows (committed)
GOALS = {"encoder": 0.40, "st_speed": 1.5, "method_vs_flops": 1.1, "st_rss": 0.5}      # issue 17


def cpu_bf16():
    """Whether training autocasts to bf16 on this CPU (the rule of the method files' autocast_bf16)."""
    return any(getattr(torch.cpu, f"_is_{x}_supported", lambda: False)() for x in ("avx512_bf16", "amx_tile"))


def matmul_rate(m, k, n, dtype, reps=15):
    """GFLOP/s of one (m, k) @ (k, n) matmul in dtype on this process's threads: the median of reps."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / np.median(times) / 1e9


def encoder_flops(c, batch, length, masked=0):
    """Analytic FLOPs of one forward + backward of the encoder: 6 x non-embedding weights x tokens (2 for
    the forward's multiply-adds, 4 for the backward's two gradients), the attention's two (L x L) matmuls
    per layer (12 x layers x B x L^2 x H), and the MLM head on `masked` positions (dense + vocabulary)."""
    tokens = batch * length
    per_layer = 4 * c.hidden_size ** 2 + 2 * c.hidden_size * c.ffn_size           # q, k, v, out; ffn in and out
    flops = 6 * c.num_layers * per_layer * tokens + 12 * c.num_layers * batch * length ** 2 * c.hidden_size
    return flops + 6 * masked * (c.hidden_size ** 2 + c.hidden_size * c.vocab_size)


def counted_flops(fn, *args, **kwargs):
    """Matmul FLOPs of fn(*args, **kwargs) as run, counted from the shapes by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def adam_eps(module):
    """Adam's epsilon as the method's train() passes it to data.make_optimizer: SEED's 1e-6, else torch's."""
    return 1e-6 if module.__name__ == "seed" else 1e-8


def pretrain_step(module, c, batches, device=torch.device("cpu"), hf=False):
    """A closure running one full pre-training step (forward, backward, AdamW) on the next batch; with hf,
    of transformers' BertForMaskedLM on the same batches."""
    if hf:
        forward, model = hf_model(c)
    else:
        model = module.PretrainModel(c, module.Encoder(c))
        forward = lambda batch: model(batch)[0]
    model.to(device).train()
    optimizer, _ = data.make_optimizer(model, c, eps=adam_eps(module))
    batches = [{k: v.to(device) for k, v in batch.items()} for batch in batches]
    autocast, it = data.autocast_bf16(device, c.bf16), iter(batches * 1000)

    def step(optimize=True):
        with autocast:
            loss = forward(next(it))
        loss.backward()
        if optimize:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def finetune_batches(n_batches, bm25=False):
    """finetune.py's own batches (TrainBatches) from SciFact's training queries: 32 queries x (positive + 1
    negative), 64 / 128 tokens. Negatives from BM25 (as finetune.py's stage 1) with bm25, else random
    documents (the step's cost depends on the lengths only)."""
    import finetune
    c = finetune.Config(steps=n_batches)
    corpus, queries, qrels = data.load_beir(str(data.SCIFACT), "train")
    doc_ids = list(corpus)
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    doc_texts = [evaluate.passage_text(corpus[d]) for d in doc_ids]
    examples = finetune.make_examples(queries, qrels, doc_index)
    if bm25:
        with tempfile.TemporaryDirectory() as tmp:
            examples = finetune.bm25_negative_pools(c, examples, doc_texts, doc_ids, doc_index,
                                                    Path(tmp) / "neg.tsv", torch.device("cpu"), False)
    dataset = finetune.TrainBatches(c, examples, doc_texts, data.load_tokenizer(), 0, 1)
    return [dataset[i] for i in range(n_batches)], doc_texts, [ex.query for ex in examples], c


def finetune_step(batches, init="", lever="as shipped"):
    """One finetune.py step as train_stage runs it: BiEncoder forward (autocast), backward, clipping, AdamW;
    with a candidate change to the encoder (LEVERS) applied for the step."""
    import finetune
    c = finetune.retriever_settings(finetune.Config(init=init)) if init else \
        finetune.Config(pooling="mean", similarity="cos", **MINILM)
    encoder = evaluate.load_encoder(init, c) if init else evaluate.Encoder(c)
    encoder.mlm_head, c = None, encoder.config
    model = finetune.BiEncoder(encoder, c).train()
    lever_context = apply_lever(lever, encoder)
    optimizer, _ = data.make_optimizer(model, dataclasses.replace(c, steps=10 ** 6))
    autocast, it = data.autocast_bf16(torch.device("cpu"), c.bf16), iter(batches * 1000)

    def step(optimize=True):
        with lever_context():
            with autocast:
                loss, _ = model(next(it))
            loss.backward()
        if optimize:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


# --levers: the encoder changes issue 17 left as candidates, each on finetune.py's step
# ----------------------------------------------------------------------------------------------
LEVERS = ("as shipped", "fused qkv", "attention recomputed in the backward", "no attention dropout",
          "no attention dropout, SDPA", "fused qkv + no attention dropout, SDPA")


class FusedQKV(torch.nn.Module):
    """A candidate (issue 17): q, k and v from one (H -> 3H) projection holding the three's weights, so that
    the forward and each backward matmul run once at 3x the width instead of three times."""

    def __init__(self, attn, module):
        super().__init__()
        self.heads, self.dropout, self.out, self.module = attn.heads, attn.dropout, attn.out, module
        H = attn.query.in_features
        self.qkv = torch.nn.Linear(H, 3 * H)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([attn.query.weight, attn.key.weight, attn.value.weight]))   # (3H, H)
            self.qkv.bias.copy_(torch.cat([attn.query.bias, attn.key.bias, attn.value.bias]))           # (3H,)

    def forward(self, x, attend):                                                  # (B, L, H)
        B, L, H = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, heads, L, d)
        y = self.module.attention(q, k, v, attend, self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, L, H))                        # (B, L, H)


def apply_lever(lever, encoder):
    """Apply one of LEVERS to this encoder: module swaps now, and a context that swaps the attention
    function of the encoder's module (evaluate's, finetune's or a method file's) for the step only."""
    import contextlib
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    if lever not in LEVERS:
        raise ValueError(f"unknown lever {lever!r}; choose from {', '.join(LEVERS)}")
    module = sys.modules[type(encoder).__module__]
    shipped = module.attention
    if "fused qkv" in lever:
        for block in encoder.blocks:
            block.attn = FusedQKV(block.attn, module)
    swap = {"attention recomputed in the backward":        # keeps q, k, v; the (L x L) maps are made again
                lambda q, k, v, attend, p: checkpoint(shipped, q, k, v, attend, p, use_reentrant=False),
            "no attention dropout": lambda q, k, v, attend, p: shipped(q, k, v, attend, 0.0),
            "no attention dropout, SDPA": lambda q, k, v, attend, p: F.scaled_dot_product_attention(q, k, v, attn_mask=attend)}
    swap["fused qkv + no attention dropout, SDPA"] = swap["no attention dropout, SDPA"]

    @contextlib.contextmanager
    def context():
        module.attention = swap.get(lever, shipped)
        try:
            yield
        finally:
            module.attention = shipped
    return context


def lever_table(reps, memory=True):
    """Each lever's finetune.py step (MiniLM, the --st recipe's batches with random negatives): its time,
    round-robin in this process in a shuffled order each pass (ratio to as shipped); its first loss from
    the same seed (a lever that only reorders the arithmetic moves it by rounding at most); and, each in a
    fresh process with malloc's mmap threshold pinned (freed activations go back to the OS), the peak RSS
    of its steps on the --st recipe's BM25 batches."""
    batches, *_ = finetune_batches(4)
    init = str(data.resolve_model("minilm"))
    steps, losses = {}, {}
    for lever in LEVERS:
        torch.manual_seed(0)
        steps[lever] = finetune_step(batches, init, lever)
        torch.manual_seed(1)
        losses[lever] = steps[lever](optimize=False)
    times, order = {lever: [] for lever in LEVERS}, np.random.default_rng(0)
    for i in range(reps + 1):
        for lever in order.permutation(LEVERS):          # a new order each pass: no lever always runs first
            t0 = time.perf_counter()
            steps[lever]()
            if i:
                times[lever].append(time.perf_counter() - t0)
    base = np.median(times["as shipped"])
    print(f"\n| finetune.py step, MiniLM, batch 32 x (1 + 2) texts | ms/step | speed vs as shipped | first loss "
          f"(seed 1) | peak RSS MiB, fresh process |\n|---|---|---|---|---|")
    for lever in LEVERS:
        peak = ""
        if memory:
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            r = subprocess.run([sys.executable, __file__, "--st-one", f"ours:2:1:{lever}"], capture_output=True, text=True, env=env)
            peak = f"{json.loads(r.stdout.strip().splitlines()[-1])['peak_mib']:,.0f}" if r.returncode == 0 else "failed"
        ms = 1000 * np.median(times[lever])
        print(f"| {lever} | {ms:,.0f} | {1000 * base / ms:.2f}x | {losses[lever]:.6f} | {peak} |", flush=True)


def speed_variants(quick=False):
    """(name, size, step closure, analytic FLOPs or None) for every row of the speed table."""
    import torch.nn.functional as F
    import costa
    rows = []
    big = costa.Config(**MINILM)
    encoder = costa.Encoder(big).train()
    ids, mask = torch.randint(1000, 30000, (32, 128)), torch.ones(32, 128, dtype=torch.long)

    def encoder_step(optimize=True):
        with data.autocast_bf16(torch.device("cpu")):
            hidden = encoder(ids, mask)                                          # (32, 128, 384)
        hidden.float().square().mean().backward()
        encoder.zero_grad(set_to_none=True)
    rows.append(("encoder fwd+bwd", "6x384", encoder_step, encoder_flops(big, 32, 128)))

    def before_step(optimize=True):   # the same step with torch's dropout and SDPA: the encoder before issue 17
        ours = costa.dropout, costa.attention
        costa.dropout = F.dropout
        costa.attention = lambda q, k, v, attend, p: F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p)
        try:
            encoder_step()
        finally:
            costa.dropout, costa.attention = ours
    rows.append(("encoder fwd+bwd, torch's dropout + SDPA (before)", "6x384", before_step, encoder_flops(big, 32, 128)))
    sizes = [("4x256", {})] + ([] if quick else [("6x384", MINILM)])
    for size, fields in sizes:
        for variant in ("costa-mlm", "costa", "cpdae", "seed"):
            module_name, fixed = VARIANTS[variant]
            module = importlib.import_module(module_name)
            c = module.Config(**{**fixed, **fields})
            c.steps = 10 ** 6
            rows.append((variant, size, pretrain_step(module, c, load_batches(module, c, 4)), None))
    ft_batches, *_ = finetune_batches(4)
    rows.append(("finetune", "6x384", finetune_step(ft_batches), None))
    return rows


def speed_table(reps, quick=False):
    """Step times measured round-robin in this one process (median of reps), so that whatever else the
    machine does slows every row alike; FLOPs counted per step; shares of the bf16 matmul rate."""
    torch.manual_seed(0)
    bf16 = cpu_bf16()
    rate = {size: (matmul_rate(4096, h, f, torch.bfloat16), matmul_rate(4096, h, f, torch.float32))
            for size, h, f in (("4x256", 256, 1024), ("6x384", 384, 1536))}
    print(f"matmul rate, (4096 x H) @ (H x 4H), {torch.get_num_threads()} threads: " + "; ".join(
        f"{size}: bf16 {b:,.0f} GFLOP/s, fp32 {f:,.0f} GFLOP/s" for size, (b, f) in rate.items()) +
        f" (training autocasts to {'bf16' if bf16 else 'nothing: fp32'})", flush=True)
    rows = speed_variants(quick)
    flops, times = [], [[] for _ in rows]
    for name, size, step, analytic in rows:
        step()
        flops.append(counted_flops(step, optimize=False))
        step()
    for _ in range(reps):
        for i, (_, _, step, _) in enumerate(rows):
            t0 = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - t0)
    out = []
    print(f"\n| step (batch 32 x 128) | size | ms/step | GFLOP/step | GFLOP/s | share of the {'bf16' if bf16 else 'fp32'} "
          f"matmul rate |\n|---|---|---|---|---|---|")
    for (name, size, _, analytic), f, t in zip(rows, flops, times):
        ms = 1000 * float(np.median(t))
        achieved = f / (ms / 1000) / 1e9
        share = achieved / rate[size][0 if bf16 else 1]
        check = f" (analytic {analytic / 1e9:.1f})" if analytic else ""
        print(f"| {name} | {size} | {ms:,.0f} | {f / 1e9:.1f}{check} | {achieved:,.0f} | {share:.0%} |", flush=True)
        out.append({"name": name, "size": size, "ms": ms, "flops": f, "share": share})
    return out


# --gpu: the papers' size on one GPU, as model FLOP utilisation (MFU)
# ----------------------------------------------------------------------------------------------
BERT_BASE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "ffn_size": 3072}
NOMINAL_BF16_TFLOPS = {"H100 80GB HBM3": 989, "H100 PCIe": 756, "H200": 989, "A100": 312}   # dense, spec sheets


def cuda_matmul_rate(m, k, n, reps=20):
    """TFLOP/s of one bf16 (m, k) @ (k, n) matmul on the GPU: the median of reps, each timed by CUDA events."""
    a, b = (torch.randn(m, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16())
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * m * k * n / np.median(times[3:]) / 1e12


def gpu_table(batch, length, steps, warmup, variants):
    """BERT-base (the papers' size) on one GPU at batch x length, bf16 autocast, one variant after the other
    in this process: step time, tokens/s, peak memory, FLOPs per step (FlopCounterMode, forward + backward)
    and MFU, the achieved FLOP/s over the measured bf16 matmul rate and over the card's nominal peak."""
    device, name = torch.device("cuda"), torch.cuda.get_device_name()
    nominal = next((v for k, v in NOMINAL_BF16_TFLOPS.items() if k in name), None)
    rate, ceiling = cuda_matmul_rate(batch * length, 768, 3072), cuda_matmul_rate(8192, 8192, 8192)
    print(f"{name}: bf16 matmul {rate:,.0f} TFLOP/s at (B*L x 768) @ (768 x 3072), {ceiling:,.0f} at 8192^3; "
          f"nominal dense bf16 peak {nominal or '?'} TFLOP/s", flush=True)
    print(f"\n| step, 12x768, batch {batch} x {length} | ms/step | tokens/s | peak GiB | TFLOP/step | TFLOP/s "
          f"| MFU (measured rate) | MFU (nominal) |\n|---|---|---|---|---|---|---|---|")
    for variant in variants:
        module_name, fixed = VARIANTS[variant]
        module = importlib.import_module(module_name)
        c = module.Config(**{**fixed, **BERT_BASE, "max_len": length, "batch_size": batch})
        c.steps = 10 ** 6
        torch.manual_seed(0)
        batches = load_batches(module, c, 4, n_texts=400)
        step = pretrain_step(module, c, batches, device, hf=variant == "hf-bert-mlm")
        step()
        flops = counted_flops(step, optimize=False)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        s = (time.perf_counter() - t0) / steps
        achieved = flops / s / 1e12
        print(f"| {variant} | {1000 * s:,.1f} | {tokens / s:,.0f} | {torch.cuda.max_memory_allocated() / 2**30:.1f} | "
              f"{flops / 1e12:.2f} | {achieved:,.0f} | {achieved / rate:.0%} | "
              f"{f'{achieved / nominal:.0%}' if nominal else '?'} |", flush=True)
        del step
        torch.cuda.empty_cache()


def st_one(which, n_steps, warmup, lever="as shipped"):
    """One side of the sentence-transformers comparison, in this (fresh) process: all-MiniLM-L6-v2,
    lr 1e-4, batch 32, one BM25 negative, 128 tokens, bf16 autocast, the same batches (finetune.py's).
    Returns median step seconds and the process's peak RSS."""
    batches, doc_texts, _, c = finetune_batches(n_steps + warmup, bm25=True)
    init = str(data.resolve_model("minilm"))
    torch.manual_seed(0)
    if which == "ours":
        step = finetune_step(batches, init, lever)
    else:
        from sentence_transformers import SentenceTransformer, losses
        model = SentenceTransformer(init, device="cpu")
        model.max_seq_length = c.passage_len
        loss_fn = losses.MultipleNegativesRankingLoss(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        tokenizer = data.load_tokenizer()
        queries = lambda ids: [tokenizer.decode(row.tolist()) for row in ids]     # the batch's queries, back
        passages = lambda docs: [doc_texts[d] for d in docs.tolist()]
        texts = [(queries(b["q_ids"]), passages(b["p_doc"][0::2]), passages(b["p_doc"][1::2])) for b in batches]
        it = iter(texts)
        model.train()

        def step(optimize=True):
            q, pos, neg = next(it)
            features = [model.tokenize(x) for x in (q, pos, neg)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(features, None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    times, between = [], 0.0
    reset_peak_rss()                      # the training steps' peak: BM25 and the batches are the same for both
    for i in range(n_steps + warmup):
        if i == warmup:
            between = rss_mib()           # resident between two steps: weights, optimizer, and what malloc kept
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"which": which, "step_s": float(np.median(times[warmup:])), "peak_mib": peak_rss_mib(),
            "between_mib": between}


def st_table(n_steps, warmup, pairs):
    """Ours and sentence-transformers, each in a fresh process (peak RSS is a high-water mark), alternated
    `pairs` times; medians."""
    rows = {"ours": [], "st": []}
    for _ in range(pairs):
        for which in rows:
            cmd = [sys.executable, __file__, "--st-one", f"{which}:{n_steps}:{warmup}"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"error: {which}: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
            rows[which].append(json.loads(result.stdout.strip().splitlines()[-1]))
    med = {w: {k: float(np.median([r[k] for r in rs])) for k in ("step_s", "peak_mib")} for w, rs in rows.items()}
    print(f"\nfine-tuning step, same recipe and batches (all-MiniLM-L6-v2, lr 1e-4, batch 32 + 1 BM25 negative, "
          f"64/128 tokens, bf16; median of {n_steps} steps after {warmup}, {pairs} process pairs)")
    print("| | s/step | peak RSS MiB during the steps |\n|---|---|---|")
    for w, name in (("ours", "finetune.py"), ("st", "sentence-transformers (MultipleNegativesRankingLoss)")):
        print(f"| {name} | {med[w]['step_s']:.2f} | {med[w]['peak_mib']:,.0f} |")
    return med


def st_triplets(batches, step):
    """finetune.py's batch at `step` (TrainBatches, one rank, one negative) as sentence-transformers' texts:
    (queries, positives, negatives), in the batch's order."""
    c, examples, doc_texts = batches.c, batches.examples, batches.doc_texts
    rows = data.batch_indices(len(examples), c.batch_size, 0, 1, c.seed, step)      # TrainBatches' own rows
    docs = batches[step]["p_doc"].tolist()                                          # positive, negative, ...
    return [examples[i].query for i in rows], [doc_texts[d] for d in docs[0::2]], [doc_texts[d] for d in docs[1::2]]


def st_ndcg_one(which, seed, out_root):
    """One full fine-tuning of all-MiniLM-L6-v2 on SciFact train, evaluated on test, with finetune.py's
    recipe and seed: "ours" runs `finetune.py --init minilm --seed S` (BM25 negatives, 2 epochs, lr 1e-4,
    batch 32 + 1 negative, 64/128 tokens, bf16); "st" trains sentence-transformers'
    MultipleNegativesRankingLoss (scale 20 = finetune.py's tau 0.05) on the same (query, positive,
    negative) triplets in the same order (TrainBatches' draws for that seed, from ours' BM25 pools), with
    finetune.py's optimizer and schedule (make_optimizer), clipping and autocast; then encodes with
    SentenceTransformer.encode and is scored by evaluate.py like ours. Returns the test metrics row."""
    import finetune
    ours_dir = out_root / f"ours-seed{seed}"
    if which == "ours":
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "finetune.py"), "--init", "minilm", "--seed", str(seed), "--out_dir", str(ours_dir),
               "--overwrite"]
        if subprocess.run(cmd).returncode:
            sys.exit(f"error: {' '.join(cmd)} failed")
        return json.loads((ours_dir / "eval-test" / "metrics.json").read_text())
    from sentence_transformers import SentenceTransformer, losses
    init = str(data.resolve_model("minilm"))
    c = finetune.retriever_settings(finetune.Config(init=init, seed=seed))
    corpus, queries, qrels = data.load_beir(str(data.SCIFACT), "train")
    doc_ids = list(corpus)
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    doc_texts = [evaluate.passage_text(corpus[d]) for d in doc_ids]
    ours_dir.mkdir(parents=True, exist_ok=True)                  # ours' BM25 pools, made again if gone
    examples = finetune.bm25_negative_pools(dataclasses.replace(c, resume=True), finetune.make_examples(
        queries, qrels, doc_index), doc_texts, doc_ids, doc_index, ours_dir / "negatives_bm25.tsv", torch.device("cpu"), True)
    c.steps = finetune.stage_steps(c, len(examples), c.epochs, 1)
    batches = finetune.TrainBatches(c, examples, doc_texts, data.load_tokenizer(), 0, 1)
    torch.manual_seed(seed)
    model = SentenceTransformer(init, device="cpu")
    model.max_seq_length = c.passage_len
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=1 / c.tau)
    optimizer, scheduler = data.make_optimizer(model, c)
    model.train()
    t0 = time.time()
    for step in range(c.steps):
        texts = st_triplets(batches, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16 and cpu_bf16()):
            loss = loss_fn([model.tokenize(t) for t in texts], None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 10 == 0 or step + 1 == c.steps:
            rate = (step + 1) / (time.time() - t0)
            print(f"st seed {seed}: step {step + 1}/{c.steps} | loss {loss.item():.4f} | {rate * 60:.1f} steps/min | "
                  f"eta {(c.steps - step - 1) / rate:.0f}s", flush=True)
    model.eval()
    corpus, queries, qrels = data.load_beir(str(data.SCIFACT), "test")
    doc_ids, qids = list(corpus), sorted(qrels)
    encode = lambda texts: model.encode(texts, batch_size=c.encode_batch, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=True).astype(np.float32)
    doc_vecs, query_vecs = encode([evaluate.passage_text(corpus[d]) for d in doc_ids]), encode([queries[q] for q in qids])
    scores, ids = evaluate.search(query_vecs, doc_vecs, 1000)
    run = {q: {doc_ids[j]: float(s) for s, j in zip(scores[r], ids[r]) if j >= 0} for r, q in enumerate(qids)}
    out = out_root / f"st-seed{seed}" / "eval-test"
    out.mkdir(parents=True, exist_ok=True)
    evaluate.save_and_score(run, qrels, out, "sentence-transformers", {"steps": c.steps, "seed": seed})
    return json.loads((out / "metrics.json").read_text())


def st_ndcg_table(seeds, out_root, results):
    """nDCG@10 on SciFact test, finetune.py and sentence-transformers at the same recipe, one full run per
    tool and seed (each seed: the same batches for both); a row per run in results/, resumed from there."""
    results.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for seed in seeds:
        for which in ("ours", "st"):                       # ours first: st reads its BM25 pools
            path = results / f"{which}-seed{seed}.json"
            if path.is_file():
                continue
            t0 = time.time()
            m = st_ndcg_one(which, seed, out_root)
            row = {"which": which, "seed": seed, "metrics": m["metrics"], "per_query": m["per_query"],
                   "seconds": round(time.time() - t0), "commit": commit, "torch": torch.__version__,
                   "command": f"python benchmark.py --st_ndcg {','.join(map(str, seeds))}"}
            data.atomic_write_json(path, row)
            print(f"{which} seed {seed}: test nDCG@10 {m['metrics']['NDCG@10']:.4f} ({row['seconds']} s) -> {path}",
                  flush=True)
    print(st_ndcg_summary(results) or "no rows")


def st_ndcg_summary(results):
    """'ours mean ± std vs st mean ± std, paired t over seeds' from the rows in results/, or ''."""
    rows = {}
    for path in sorted(Path(results).glob("*-seed*.json")):
        r = json.loads(path.read_text())
        rows.setdefault(r["which"], {})[r["seed"]] = r["metrics"]["NDCG@10"]
    seeds = sorted(set(rows.get("ours", {})) & set(rows.get("st", {})))
    if not seeds:
        return ""
    ours, st = ([rows[w][s] for s in seeds] for w in ("ours", "st"))
    sd = lambda x: np.std(x, ddof=1) if len(x) > 1 else float("nan")
    t, p = evaluate.paired_t_test(ours, st)
    return (f"{np.mean(ours):.4f} ± {sd(ours):.4f} against {np.mean(st):.4f} ± {sd(st):.4f} (mean ± std over "
            f"seeds {','.join(map(str, seeds))}; difference {np.mean(ours) - np.mean(st):+.4f}, paired t over "
            f"seeds p = {p:.2f})")


def goals_table(speed, st):
    """measure | goal | today, from this run's numbers."""
    by = {(r["name"], r["size"]): r for r in speed}
    lines = ["\n| measure | goal | today |", "|---|---|---|"]
    enc, before = by[("encoder fwd+bwd", "6x384")], by[("encoder fwd+bwd, torch's dropout + SDPA (before)", "6x384")]
    lines.append(f"| encoder fwd+bwd, 6x384, batch 32 x 128: share of the bf16 matmul rate | >= {GOALS['encoder']:.0%} "
                 f"| {enc['share']:.0%} ({before['ms'] / enc['ms']:.2f}x as fast as with torch's dropout and SDPA) |")
    for size in ("4x256", "6x384"):
        base = by.get(("costa-mlm", size))
        for method in ("cpdae", "seed"):
            r = by.get((method, size))
            if base and r:
                time_ratio, flop_ratio = r["ms"] / base["ms"], r["flops"] / base["flops"]
                lines.append(f"| {method} step time / MLM-only's, {size}, over their FLOP ratio ({time_ratio:.2f}x / "
                             f"{flop_ratio:.2f}x) | <= {GOALS['method_vs_flops']} | {time_ratio / flop_ratio:.2f} |")
    if st:
        lines.append(f"| finetune.py step vs sentence-transformers', same recipe: speed | >= {GOALS['st_speed']}x | "
                     f"{st['st']['step_s'] / st['ours']['step_s']:.2f}x |")
        lines.append(f"| finetune.py peak RSS / sentence-transformers' | <= {GOALS['st_rss']}x | "
                     f"{st['ours']['peak_mib'] / st['st']['peak_mib']:.2f}x |")
    else:
        lines.append(f"| finetune.py vs sentence-transformers: speed, peak RSS | >= {GOALS['st_speed']}x, "
                     f"<= {GOALS['st_rss']}x | not run (add --st) |")
    ndcg = st_ndcg_summary(ST_NDCG_RESULTS)
    lines.append(f"| finetune.py vs sentence-transformers: test nDCG@10, 3 seeds each | at least equal | "
                 f"{ndcg + ', results/st-ndcg' if ndcg else 'not measured (--st_ndcg 0,1,2)'} |")
    print("\n".join(lines))


def micro_table(reps=7):
    """The two changes to the encoder, each against what it replaced, on a MiniLM-size attention map
    (32 x 12 heads x 128 x 128), and a fused QKV projection against the three the encoder has, under bf16
    autocast, forward + backward, round-robin in this process."""
    import torch.nn.functional as F
    import costa
    torch.manual_seed(0)
    p, (B, heads, L, d) = 0.1, (32, 12, 128, 32)
    dtype = torch.bfloat16 if cpu_bf16() else torch.float32      # what the linear layers hand over
    q, k, v = (torch.randn(B, heads, L, d).to(dtype).requires_grad_() for _ in range(3))
    x = torch.randn(32, 128, 384).to(dtype).requires_grad_()
    attend = torch.ones(B, 1, 1, L, dtype=torch.bool)
    separate, fused = [torch.nn.Linear(384, 384) for _ in range(3)], torch.nn.Linear(384, 3 * 384)
    cases = {"mask only (32, 12, 128, 128): torch's bernoulli_":
                 lambda: torch.empty(B, heads, L, L, dtype=dtype).bernoulli_(1 - p),
             "mask only (32, 12, 128, 128): costa.drop_mask": lambda: costa.drop_mask((B, heads, L, L), p),
             "dropout (32, 128, 384): F.dropout (bernoulli_)": lambda: F.dropout(x, p, True),
             "dropout (32, 128, 384): costa.dropout (PCG64 mask)": lambda: costa.dropout(x, p, True),
             "attention (32, 12, 128, 32), dropout 0.1: F.scaled_dot_product_attention":
                 lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p),
             "attention (32, 12, 128, 32), dropout 0.1: costa.attention": lambda: costa.attention(q, k, v, attend, p),
             "q, k, v projections of (32, 128, 384): three Linear(384, 384), as the encoder has them":
                 lambda: sum(lin(x) for lin in separate),                       # q + k + v: one output to backward
             "q, k, v projections of (32, 128, 384): one fused Linear(384, 1152) (a candidate, issue 17)": lambda: sum(fused(x).chunk(3, -1))}
    times = {name: [] for name in cases}
    for i in range(reps + 1):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_bf16()):
                y = fn()
            if y.requires_grad:
                y.float().sum().backward()
            if i:
                times[name].append(time.perf_counter() - t0)
    print("| forward + backward (masks: drawing only) | ms |\n|---|---|")
    for name, t in times.items():
        print(f"| {name} | {1000 * np.median(t):.1f} |")


# --profile: where a method's step time goes beyond its FLOP ratio to MLM-only
# ----------------------------------------------------------------------------------------------
OP_GROUPS = (("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
             ("softmax / log-softmax", ("_softmax", "_log_softmax", "_softmax_backward_data",
                                        "_log_softmax_backward_data")),
             ("copies and casts", ("copy_", "to", "_to_copy", "clone", "contiguous")),
             ("fills and masks", ("fill_", "zero_", "masked_fill_", "bernoulli_", "where")))


def op_group(name):
    """The group of a profiler op name (aten::mm -> matmul); everything else is elementwise / other."""
    op = name.split("::")[-1]
    return next((group for group, ops in OP_GROUPS if op in ops), "elementwise and other")


def profile_table(variants, steps=2):
    """Self CPU time of steps full training steps per variant (4 x 256, batch 32 x 128, bf16 where the
    CPU has it), grouped by op kind, next to the step's matmul FLOPs: a method whose time share outside
    matmul is large spends it on work that the FLOP ratio does not count."""
    from torch.profiler import ProfilerActivity, profile
    print(f"| variant | ms/step | GFLOP/step | " + " | ".join(g for g, _ in OP_GROUPS) +
          " | elementwise and other | top 3 ops (share of self time) |\n|" + "---|" * (len(OP_GROUPS) + 5))
    for variant in variants:
        module_name, fixed = VARIANTS[variant]
        module = importlib.import_module(module_name)
        c = module.Config(**fixed)
        c.steps = 10 ** 6
        step = pretrain_step(module, c, load_batches(module, c, 4))
        step()
        flops = counted_flops(step, optimize=False)
        step()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        ms = 1000 * (time.perf_counter() - t0) / steps
        ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        total = sum(t for _, t in ops) or 1
        share = {g: 0.0 for g, _ in OP_GROUPS + (("elementwise and other", ()),)}
        for name, t in ops:
            share[op_group(name)] += t / total
        top = ", ".join(f"{name.split('::')[-1]} {t / total:.0%}" for name, t in sorted(ops, key=lambda o: -o[1])[:3])
        print(f"| {variant} | {ms:,.0f} | {flops / 1e9:.1f} | " + " | ".join(f"{v:.0%}" for v in share.values()) +
              f" | {top} |", flush=True)


def parse_value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Config override for every variant, e.g. batch_size=64")
    parser.add_argument("--js", action="store_true", help="CPDAE's JS loss memory, chunked vs naive")
    parser.add_argument("--js_texts", type=int, default=64, help="texts (x 2 views) for --js")
    parser.add_argument("--scale", default="", metavar="SIZES",
                        help="start-up time and peak RSS against corpus size, e.g. 1,20,200 (million tokens)")
    parser.add_argument("--scale_procs", default="1,2", help="torchrun processes for --scale")
    parser.add_argument("--scale_before_max", type=float, default=20,
                        help="largest size (million tokens) also run on the old in-memory path")
    parser.add_argument("--scale_dir", default="runs/bench-scale", help="synthetic corpora and caches for --scale")
    parser.add_argument("--prep_workers", type=int, default=0, help="tokenizing processes (0 = all cores)")
    parser.add_argument("--legacy_costa", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--index_bench", action="store_true", help="faiss indexes: build, size, queries/s, Recall@100")
    parser.add_argument("--vectors", default="", help="--index_bench: DOCS.npy[,QUERIES.npy] real vectors (else synthetic)")
    parser.add_argument("--sizes", default="100000,1000000", help="--index_bench: synthetic corpus sizes")
    parser.add_argument("--queries", type=int, default=500, help="--index_bench: synthetic queries")
    parser.add_argument("--vectors_rss", type=int, default=0, metavar="N", help="peak RSS of encode + search of N vectors")
    parser.add_argument("--rss-one", help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)          # internal: run one variant, print JSON
    parser.add_argument("--reps", type=int, default=5, help="speed table: timed round-robin passes")
    parser.add_argument("--quick", action="store_true", help="speed table: the methods at 4x256 only, not 6x384")
    parser.add_argument("--st", action="store_true",
                        help="also finetune.py against sentence-transformers (needs sentence-transformers)")
    parser.add_argument("--st_memory", action="store_true",
                        help="fine-tuning memory, ours and sentence-transformers', malloc as is and pinned")
    parser.add_argument("--st_steps", type=int, default=8, help="--st: timed steps per process")
    parser.add_argument("--st_pairs", type=int, default=2, help="--st: process pairs, alternated")
    parser.add_argument("--st_ndcg", default="", metavar="SEEDS",
                        help="full fine-tuning, finetune.py and sentence-transformers, test nDCG@10 per seed, e.g. 0,1,2")
    parser.add_argument("--st_ndcg_dir", default="runs/st-ndcg", help="--st_ndcg: run folders (not committed)")
    parser.add_argument("--micro", action="store_true", help="dropout and attention: ours against torch's")
    parser.add_argument("--levers", action="store_true",
                        help="candidate encoder changes (fused QKV, attention recomputed, no attention dropout) on finetune.py's step")
    parser.add_argument("--profile", default="", metavar="VARIANTS",
                        help="torch.profiler: each variant's step time by op kind, e.g. costa-mlm,cpdae,seed")
    parser.add_argument("--gpu", action="store_true", help="BERT-base on one GPU: step time, memory and MFU per method")
    parser.add_argument("--gpu_batch", type=int, default=32, help="--gpu: texts per step")
    parser.add_argument("--gpu_len", type=int, default=512, help="--gpu: tokens per text")
    parser.add_argument("--st-one", help=argparse.SUPPRESS)
    parser.add_argument("--js-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.legacy_costa is not None:
        run_legacy_costa(args.legacy_costa)
        return
    if args.scale:
        scale_table([float(x) if "." in x else int(x) for x in args.scale.split(",")],
                    [int(x) for x in args.scale_procs.split(",")], args.scale_before_max, args.scale_dir,
                    args.prep_workers)
        return
    if args.js_one:
        variant, chunk, m, vocab = args.js_one.split(":")
        print(json.dumps(js_memory_one(variant, int(chunk), int(m), int(vocab))))
        return
    if args.rss_one:
        where, search, n = args.rss_one.split(":")
        print(json.dumps(vectors_rss_one(where, search, int(n))))
        return
    if args.vectors_rss:
        vectors_rss_table(args.vectors_rss)
        return
    if args.index_bench:
        index_bench(args)
        return
    if args.js:
        js_memory_table(args.js_texts, 30522)
        return
    if args.one:
        print(json.dumps(run_one(args.one, overrides, args.steps, args.warmup)))
        return
    if args.st_one:
        which, n_steps, warmup, *lever = args.st_one.split(":")
        print(json.dumps(st_one(which, int(n_steps), int(warmup), *lever)))
        return
    if args.st_ndcg:
        st_ndcg_table([int(x) for x in args.st_ndcg.split(",")], Path(args.st_ndcg_dir), ST_NDCG_RESULTS)
        return
    if args.micro:
        micro_table()
        return
    if args.levers:
        lever_table(args.reps)
        return
    if args.st_memory:
        st_memory_table()
        return
    if args.profile:
        unknown = [v for v in args.profile.split(",") if v not in VARIANTS or v == "hf-bert-mlm"]
        if unknown:
            sys.exit(f"error: --profile: unknown {unknown}; choose from costa-mlm, costa, cpdae, seed")
        profile_table(args.profile.split(","))
        return
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("error: --gpu: no CUDA device")
        gpu_table(args.gpu_batch, args.gpu_len, args.steps, args.warmup, [v for v in args.variants.split(",") if v])
        return
    variants = [v for v in args.variants.split(",") if v]          # "" = no per-variant table
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:                                     # before the minutes of the speed table
        sys.exit(f"error: --variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    t0 = time.perf_counter()
    speed = speed_table(args.reps, args.quick)
    st = st_table(args.st_steps, 2, args.st_pairs) if args.st else None
    goals_table(speed, st)
    print(f"({time.perf_counter() - t0:.0f} s)\n", flush=True)
    if variants:
        print(f"{'variant':<14}{'tokens/s':>10}{'peak MiB':>10}  setup")
    for variant in variants:
        cmd = [sys.executable, __file__, "--one", variant, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + [x for s in args.set for x in ("--set", s)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{variant:<14}{'failed':>10}  {last}")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{variant:<14}{r['tokens_per_s']:>10,.0f}{r['peak_mib']:>10,.0f}  {r['params_m']:.1f}M params, "
              f"{r['num_layers']}x{r['hidden_size']}, batch {r['batch_size']}x{r['max_len']}, "
              f"{r['device']} ({r['threads']} threads)", flush=True)


if __name__ == "__main__":
    main()
