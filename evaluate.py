"""Evaluate a dense retriever or BM25 the way the papers report it: metrics as trec_eval computes
them, TREC run files, paired two-tailed t-tests, and the papers' figures (COSTA Figure 3 t-SNE,
CPDAE Table 4 word distributions). One file, top to bottom: config, metrics, significance, retrieval
runs, figures, command line.

    python evaluate.py --bm25 --data data/scifact --split test          # BM25 baseline row
    python evaluate.py --model runs/finetune/encoder --split test       # any saved encoder (HF BERT folder)
    torchrun --nproc_per_node=4 evaluate.py --model DIR                 # corpus encoding sharded across ranks
    python evaluate.py --compare runs/a/run.trec,runs/b/run.trec        # paired t-tests per metric
    python evaluate.py --model DIR --tsne auto                          # + COSTA Figure 3 for one query
    python evaluate.py --model runs/cpdae/encoder --words "Some text"   # CPDAE Table 4 figure
    python evaluate.py --corpus collection.tsv --queries queries.dev.small.tsv --qrels qrels.dev.small.tsv --bm25

Outputs in out_dir: run.trec (qid Q0 docid rank score tag), metrics.json (means, per-query values,
timings), and the figures as PNG. The encoder comes from finetune.py (the shared BERT block, the same
bytes as costa.py's), so any Hugging Face BERT folder loads.
"""
import dataclasses
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import data
from finetune import (BM25, encode, load_encoder, load_split, passage_text, rank_and_world,
                      retrieve, setup_distributed)


# ==============================================================================================
# Config
# ==============================================================================================
SCIFACT, VOCAB = str(data.SCIFACT), str(data.VOCAB)  # (inside Config, `data` is the field, not the module)


@dataclass
class Config:
    model: str = ""               # BERT folder to evaluate (ours, any BERT or sentence-transformers one), hub id, or "minilm"
    bm25: bool = False            # evaluate BM25 instead of a model
    data: str = SCIFACT           # BEIR folder: corpus.jsonl, queries.jsonl, qrels/{split}.tsv ('.gz' ok)
    split: str = "test"           # qrels/{split}.tsv
    corpus: str = ""              # explicit corpus (BEIR .jsonl or MS MARCO collection.tsv); overrides data
    queries: str = ""             # explicit queries file (with corpus)
    qrels: str = ""               # explicit qrels file (with corpus; also the qrels for --compare)
    pooling: str = ""             # "cls" or "mean"; "" = what the folder declares (retriever.json, sentence-transformers), else "cls"
    similarity: str = ""          # "dot" or "cos"; "" = what the folder declares (a Normalize module = cos), else "dot"
    vocab: str = ""               # WordPiece vocab; "" = the model folder's vocab.txt, else the bundled one
    query_len: int = 0            # query tokens incl. [CLS]/[SEP]; 0 = the folder's retriever.json, else 32
    passage_len: int = 0          # passage tokens incl. [CLS]/[SEP]; 0 = retriever.json, else 128 (documents: 512)
    depth: int = 1000             # documents retrieved per query (Recall@1000 needs 1000)
    encode_batch: int = 128       # texts per forward pass
    k1: float = 1.2               # BM25 term-frequency saturation (Elasticsearch / BEIR)
    b: float = 0.75               # BM25 document-length normalisation
    bf16: bool = True             # bf16 autocast on GPU and on CPUs with native bf16 (AVX512-BF16, AMX)
    out_dir: str = ""             # "" = next to the model ({model}/../eval-{split}) or runs/bm25-{data}-{split}
    tag: str = ""                 # run tag in the TREC file; "" = the model folder or "bm25"
    compare: str = ""             # "A.trec,B.trec": paired two-tailed t-test of A vs B per metric (needs qrels)
    tsne: str = ""                # query id for the COSTA Figure 3 t-SNE, or "auto" (first query with a hit)
    words: str = ""               # text for the CPDAE Table 4 figure (needs the CPDAE decoder)
    decoder: str = ""             # folder with cpdae.py's decoder.safetensors; "" = the model folder
    preset: str = ""              # unused here; the shared config parser knows this field


PAPER_PRESET = {}


# The domain of each numeric flag, checked by parse_config before any work.
FLAG_RULES = {"query_len": "0 or >= 3", "passage_len": "0 or >= 3", "depth": ">= 1", "encode_batch": ">= 1",
              "k1": ">= 0", "b": "in [0, 1]"}


# --- shared: begin config parsing ---
BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_config(argv):
    """Config from the command line: '--field value' for any field, '--flag' alone for a bool.
    Every value is checked here, before any work: its type, its domain (FLAG_RULES) and the preset."""
    if argv[:1] in (["-h"], ["--help"]):               # the docstring, then every field with its comment
        try:
            print(__doc__, inspect.getsource(Config), sep="\n", flush=True)
        except BrokenPipeError:                         # `x.py --help | head` stopped reading: fine
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    overrides, i = {}, 0
    while i < len(argv):
        name = argv[i].removeprefix("--").replace("-", "_")
        if not argv[i].startswith("--") or name not in fields:
            sys.exit(f"error: unknown argument {argv[i]!r}; fields are: {', '.join(fields)}")
        kind = type(fields[name].default)
        if kind is bool and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            overrides[name], i = True, i + 1
            continue
        if i + 1 == len(argv):
            sys.exit(f"error: --{name} needs a value")
        value = argv[i + 1]
        if kind is bool and value.lower() not in BOOLEANS:
            sys.exit(f"error: --{name} expects true or false (also 1/0, yes/no), got {value!r}")
        try:
            overrides[name] = BOOLEANS[value.lower()] if kind is bool else kind(value)
        except ValueError:
            sys.exit(f"error: --{name} expects {kind.__name__}, got {value!r}")
        i += 2
    if overrides.get("preset", "") not in ("", "paper"):
        sys.exit(f"error: --preset must be paper (or empty), got {overrides['preset']!r}")
    preset = PAPER_PRESET if overrides.get("preset") == "paper" else {}
    c = Config(**{**preset, **overrides})
    for name, rule in FLAG_RULES.items():
        if not satisfies(getattr(c, name), rule):
            sys.exit(f"error: --{name} must be {rule}, got {getattr(c, name)!r}")
    return c


def satisfies(value, rule):
    """A FLAG_RULES rule: '> 0', '>= 1', '0 or >= 3', 'in [0, 1]' or 'in [0, 1)'. NaN satisfies none."""
    if rule.startswith("0 or "):
        return value == 0 or satisfies(value, rule.removeprefix("0 or "))
    if rule.startswith("in "):
        low, high = (float(x) for x in rule[4:-1].split(","))
        return low <= value and (value <= high if rule.endswith("]") else value < high)
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)
# --- shared: end config parsing ---


# ---------------------------------------------------------------------------------------------
# Metrics, computed the way trec_eval does
# ---------------------------------------------------------------------------------------------
METRICS = ("MRR@10", "MRR@100", "Recall@10", "Recall@100", "Recall@1000", "NDCG@10")


def trec_order(docs):
    """[(docid, score)] best first, ties broken by docid DESCENDING as trec_eval does
    (its qsort compares score, then strcmp(docno2, docno1)); docid compared as a string."""
    return sorted(docs.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)


def query_metrics(ranked_docids, judged):
    """Metric values for one query. ranked_docids: docids best first; judged: {docid: grade}.
    Relevant means grade > 0 (trec_eval's default relevance level 1 for integer grades). A query
    with no relevant document scores 0 on every metric, as in trec_eval."""
    relevant = {d for d, g in judged.items() if g > 0}
    gains = [max(judged.get(d, 0), 0) for d in ranked_docids[:10]]  # raw grade as gain (ndcg_cut)
    ideal = sorted((g for g in judged.values() if g > 0), reverse=True)[:10]
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    first = next((i for i, d in enumerate(ranked_docids) if d in relevant), None)  # 0-based rank
    out = {}
    for k in (10, 100):
        out[f"MRR@{k}"] = 1.0 / (first + 1) if first is not None and first < k else 0.0
    for k in (10, 100, 1000):
        out[f"Recall@{k}"] = len(relevant.intersection(ranked_docids[:k])) / len(relevant) if relevant else 0.0
    out["NDCG@10"] = dcg / idcg if idcg > 0 else 0.0
    return out


def compute_metrics(run, qrels):
    """run = {qid: {docid: score}}, qrels = {qid: {docid: grade}} -> (means, per_query).

    Counted queries: every query of the qrels, as trec_eval -c and pytrec_eval (BEIR) count them: one
    whose judgments are all grade 0 scores 0, and so does one missing from the run; run queries absent
    from the qrels are ignored. means = {metric: mean over counted queries}; per_query = {qid: {metric: value}}."""
    per_query = {}
    for qid, judged in qrels.items():
        ranked = [d for d, _ in trec_order(run.get(qid, {}))]
        per_query[qid] = query_metrics(ranked, judged)
    n = len(per_query)
    means = {m: (sum(v[m] for v in per_query.values()) / n if n else 0.0) for m in METRICS}
    return means, per_query


# ---------------------------------------------------------------------------------------------
# Paired two-tailed t-test (no scipy): Student's t CDF via the regularized incomplete beta
# ---------------------------------------------------------------------------------------------
def _beta_continued_fraction(a, b, x, max_iter=500, eps=1e-15):
    """Continued fraction of I_x(a, b) (modified Lentz; Numerical Recipes 6.4 `betacf`)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        for aa in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # even step
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # odd step
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a, b, x):
    """Regularized incomplete beta function I_x(a, b) for a, b > 0, 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_tailed_p(t, df):
    """P(|T| >= |t|) for Student's t with df degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def paired_t_test(a, b):
    """Two-tailed paired t-test of per-query values a vs b (same queries, same order) -> (t, p).
    t = mean(d) / (sd(d) / sqrt(n)), d = a - b, sd with n - 1; df = n - 1."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = len(d)
    if n < 2:
        return float("nan"), float("nan")
    mean, sd = d.mean(), d.std(ddof=1)
    if sd == 0.0:
        return (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    t = float(mean / (sd / math.sqrt(n)))
    return t, t_two_tailed_p(t, n - 1)


def compare_per_query(per_query_a, per_query_b, metrics=METRICS):
    """Paired t-test of two systems' per-query metrics over the queries both were scored on
    (with the same qrels that is every counted query). -> {metric: {mean_a, mean_b, t, p, n}}."""
    qids = sorted(set(per_query_a) & set(per_query_b))
    out = {}
    for m in metrics:
        a = [per_query_a[q][m] for q in qids]
        b = [per_query_b[q][m] for q in qids]
        t, p = paired_t_test(a, b)
        out[m] = {"mean_a": float(np.mean(a)) if a else 0.0, "mean_b": float(np.mean(b)) if b else 0.0,
                  "t": t, "p": p, "n": len(qids)}
    return out


# ---------------------------------------------------------------------------------------------
# Runs: BM25 and dense retrieval, saved and scored
# ---------------------------------------------------------------------------------------------
def save_and_score(run, qrels, out_dir, tag, info=None):
    """Write run.trec, then score the run AS READ BACK from that file (so the numbers are exactly
    what trec_eval would report on it, rounding of the written scores included), and write
    metrics.json with the means, the per-query values and `info`. Returns (means, per_query)."""
    out_dir = Path(out_dir)
    data.write_run(out_dir / "run.trec", run, tag)
    means, per_query = compute_metrics(data.read_run(out_dir / "run.trec"), qrels)
    data.atomic_write_json(out_dir / "metrics.json", {"tag": tag, "n_queries": len(per_query), "metrics": means,
                                                      "info": info or {}, "per_query": per_query})
    return means, per_query


def evaluate_bm25(corpus, queries, qrels, out_dir, k1=1.2, b=0.75, depth=1000, verbose=True):
    """The papers' BM25 row: finetune.BM25 over the corpus, top `depth` per judged query.
    Documents sharing no term with the query (score 0) are not retrieved, as in Lucene."""
    doc_ids = list(corpus)
    qids = sorted(qrels)
    t0 = time.time()
    bm25 = BM25([passage_text(corpus[d]) for d in doc_ids], k1, b)
    t1 = time.time()
    scores, ids = bm25.search([queries[q] for q in qids], depth)
    t2 = time.time()
    run = {q: {doc_ids[j]: float(s) for s, j in zip(scores[r], ids[r]) if s > 0} for r, q in enumerate(qids)}
    info = {"k1": k1, "b": b, "depth": depth, "index_s": t1 - t0, "search_s": t2 - t1}
    result = save_and_score(run, qrels, out_dir, "bm25", info)
    if verbose:
        print(f"BM25 (k1={k1}, b={b}): indexed {len(doc_ids):,} documents in {t1 - t0:.1f}s, "
              f"searched {len(qids)} queries in {t2 - t1:.1f}s -> {Path(out_dir) / 'run.trec'}")
    return result


def evaluate_encoder(encoder, pooling, tokenizer, corpus, queries, qrels, out_dir, c, device, tag="dense",
                     tsne="", depth=1000):
    """Dense retrieval with finetune.retrieve (corpus sharded across ranks, exact faiss search), then
    rank 0 saves and scores the run, prints the metrics and returns (means, per_query); other ranks
    return None. tsne: a query id or "auto" for the COSTA Figure 3 plot. Every rank must call this."""
    rank, world = rank_and_world()
    doc_ids = list(corpus)
    doc_texts = [passage_text(corpus[d]) for d in doc_ids]
    qids = sorted(qrels)
    timings = {}
    t0 = time.time()
    scores, ids = retrieve(encoder, pooling, tokenizer, doc_texts, [queries[q] for q in qids], depth, c,
                           device, timings)
    timings["total_s"] = time.time() - t0
    if rank != 0:
        return None
    run = {q: {doc_ids[j]: float(s) for s, j in zip(scores[r], ids[r])} for r, q in enumerate(qids)}
    info = {"pooling": pooling, "similarity": c.similarity, "world": world, "device": device.type, "n_docs": len(doc_ids), **timings}
    means, per_query = save_and_score(run, qrels, out_dir, tag, info)
    print(f"{tag}: encoded {len(doc_ids):,} passages in {timings['encode_docs_s']:.1f}s "
          f"({timings['docs_per_s_per_rank'] * world:,.0f} docs/s over {world} process(es)), "
          f"{len(qids)} queries in {timings['encode_queries_s']:.1f}s, exact search {timings['search_s']:.2f}s "
          f"-> {Path(out_dir) / 'run.trec'}")
    print(format_table({tag: (means, per_query)}))
    if tsne:
        qid = pick_tsne_query(run, qrels) if tsne == "auto" else tsne
        if qid not in run:
            raise data.DataError(f"--tsne {qid}: no such query id in the qrels of this split")
        top = [d for d, _ in trec_order(run[qid])[:100]]
        vecs = encode(encoder, pooling, tokenizer, [passage_text(corpus[d]) for d in top], c.passage_len,
                      c.encode_batch, device, c.bf16, c.similarity)
        qvec = encode(encoder, pooling, tokenizer, [queries[qid]], c.query_len, 1, device, c.bf16, c.similarity)[0]
        relevant = [qrels[qid].get(d, 0) > 0 for d in top]
        path = Path(out_dir) / f"tsne-{qid}.png"
        plot_tsne(qvec, vecs, relevant, path, title=f"{tag}: query {qid}, top {len(top)} ({sum(relevant)} relevant)")
        print(f"t-SNE of query {qid} and its top {len(top)}: {path}")
    return means, per_query


def pick_tsne_query(run, qrels):
    """The first query (by id) with a relevant document in its top 100 and at least 10 candidates."""
    for qid in sorted(qrels):
        top = [d for d, _ in trec_order(run.get(qid, {}))[:100]]
        if len(top) >= 10 and any(qrels[qid].get(d, 0) > 0 for d in top):
            return qid
    raise data.DataError("--tsne auto: no query has a relevant document in its top 100")


def format_table(rows, title="", baseline=None, metrics=METRICS):
    """Metrics table, one row per system: rows = {name: (means, per_query)}. With a baseline row,
    '*' marks a significant difference from it (paired two-tailed t-test, p <= 0.05)."""
    width = max([len(n) for n in rows] + [len(title), 6])
    lines = [f"{title:<{width}}  " + "  ".join(f"{m:>11}" for m in metrics)]
    for name, (means, per_query) in rows.items():
        tests = compare_per_query(per_query, rows[baseline][1], metrics) if baseline and name != baseline else {}
        cells = [f"{means[m]:.4f}{'*' if m in tests and tests[m]['p'] <= 0.05 else ' '}" for m in metrics]
        lines.append(f"{name:<{width}}  " + "  ".join(f"{c:>11}" for c in cells))
    if baseline and len(rows) > 1:
        lines.append(f"* p <= 0.05 against {baseline}, paired two-tailed t-test over the queries")
    return "\n".join(lines)


def format_pairs(rows, names, metrics=("NDCG@10", "Recall@100")):
    """One line per pair of the named rows (each against every row before it): the difference of the
    means and the paired two-tailed t-test's p per metric."""
    lines = []
    for i, b in enumerate(names):
        for a in names[:i]:
            tests = compare_per_query(rows[b][1], rows[a][1], metrics)
            cells = ", ".join(f"{m} {tests[m]['mean_a'] - tests[m]['mean_b']:+.4f} (p = {tests[m]['p']:.3g})"
                              for m in metrics)
            lines.append(f"{b} vs {a}: {cells}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figures (matplotlib, Agg backend)
# ---------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tsne(query_vec, doc_vecs, relevant, path, title="", seed=0):
    """COSTA Figure 3: t-SNE of one query (H,) and its candidates (K, H), relevant (K,) bool marked.
    Returns the (K + 1, 2) coordinates, query first."""
    from sklearn.manifold import TSNE

    plt = _pyplot()
    points = np.vstack([np.asarray(query_vec, np.float32)[None], np.asarray(doc_vecs, np.float32)])  # (K+1, H)
    relevant = np.asarray(relevant, dtype=bool)
    perplexity = min(30.0, (len(points) - 1) / 3.0)  # must stay below the number of points
    xy = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(points)
    fig, ax = plt.subplots(figsize=(5, 5))
    other = xy[1:][~relevant]
    rel = xy[1:][relevant]
    ax.scatter(other[:, 0], other[:, 1], s=14, c="#9e9e9e", label="candidate")
    ax.scatter(rel[:, 0], rel[:, 1], s=40, c="#d62728", marker="o", label="relevant")
    ax.scatter(xy[:1, 0], xy[:1, 1], s=160, c="#1f77b4", marker="*", label="query")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    _save_figure(fig, path)
    return xy


def word_probabilities(probs, text, tokenizer):
    """CPDAE Table 4: each whole word of `text` with the summed normalised probability of its
    WordPiece pieces. probs: (V,) normalised word distribution (z~ = sigmoid(z) / sum).
    Returns [(word as written in text, value, start offset)] in text order."""
    probs = np.asarray(probs, dtype=np.float64)
    enc = tokenizer.encode(text, add_special_tokens=False)
    words = {}  # word index -> [start, end, value]
    for token_id, word, (start, end) in zip(enc.ids, enc.word_ids, enc.offsets):
        if word is None:
            continue
        entry = words.setdefault(word, [start, end, 0.0])
        entry[1] = max(entry[1], end)
        entry[2] += float(probs[token_id])
    return [(text[s:e], v, s) for s, e, v in (words[w] for w in sorted(words))]


def plot_word_distribution(probs, text, tokenizer, path, vmax=None, width_in=8.0, cmap="Reds"):
    """Shade each whole word of `text` by the summed probability of its pieces (CPDAE Table 4).
    vmax: value of the darkest shade (the paper's legend tops at 0.5); None -> the largest word
    value, because with a 30,522-word vocabulary a small model's values are often far below 0.5."""
    import matplotlib.colors as mcolors

    plt = _pyplot()
    words = word_probabilities(probs, text, tokenizer)
    top = vmax if vmax is not None else max([v for _, v, _ in words] + [1e-12])
    norm = mcolors.Normalize(vmin=0.0, vmax=top)
    colors = plt.get_cmap(cmap)
    font, line_h, margin = 11, 0.32, 0.15  # points, inches, inches

    # Lay words out in inches: measure each word with a throwaway renderer, wrap at width_in.
    probe = plt.figure(figsize=(width_in, 1))
    renderer = probe.canvas.get_renderer()
    positions, x, line = [], margin, 0
    prev_end = None
    for word, value, start in words:
        t = probe.text(0, 0, word, fontsize=font)
        w = t.get_window_extent(renderer).width / probe.dpi + 2 * 1.5 / 72  # text + bbox padding
        gap = 0.07 if prev_end is not None and start > prev_end else 0.0  # keep "word," together
        if x + gap + w > width_in - margin and x > margin:
            x, line, gap = margin, line + 1, 0.0
        positions.append((x + gap, line))
        x += gap + w
        prev_end = start + len(word)
    plt.close(probe)

    height = 2 * margin + (line + 1) * line_h + 0.6  # text plus a colour bar
    fig = plt.figure(figsize=(width_in, height))
    for (word, value, _), (x, ln) in zip(words, positions):
        shade = colors(norm(value))
        dark = norm(value) > 0.6
        fig.text(x / width_in, 1 - (margin + (ln + 0.5) * line_h) / height, word, fontsize=font,
                 va="center", color="white" if dark else "black",
                 bbox=dict(facecolor=shade, edgecolor="none", pad=1.5))
    bar = fig.add_axes([margin / width_in, 0.25 / height, 0.5, 0.12 / height])
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=colors), cax=bar, orientation="horizontal")
    bar.set_xlabel("summed normalised probability of the word's pieces", fontsize=8)
    bar.tick_params(labelsize=7)
    _save_figure(fig, path)
    return words


def _save_figure(fig, path):
    """Save a PNG atomically and close the figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CPDAE decoder (cpdae.py) for the word-distribution figure
# ---------------------------------------------------------------------------------------------
def word_distribution(encoder, decoder, tokenizer, text, max_len, device):
    """CPDAE eq. 2-3 and 3.2.2: z~ = sigmoid(decoder(h_cls)) / sum, the (V,) word distribution of `text`."""
    ids, mask = data.encode_texts(tokenizer, [text], max_len)                          # (1, L)
    encoder.eval()
    decoder.eval()
    with torch.no_grad():
        h_cls = encoder(ids.to(device), mask.to(device))[:, 0]                         # (1, H)
        z_hat = torch.sigmoid(decoder(h_cls).float())[0]                                # (V,)
    return (z_hat / z_hat.sum()).cpu().numpy()


def load_cpdae_decoder(folder):
    """cpdae.py's MLP decoder from {folder}/decoder.safetensors (cpdae.py saves it beside the encoder)."""
    if not (Path(folder) / "decoder.safetensors").is_file():
        raise data.DataError(f"{Path(folder) / 'decoder.safetensors'}: not found; the word-distribution figure "
                             f"needs an encoder folder written by cpdae.py (or --decoder FOLDER)")
    import cpdae

    return cpdae.Decoder.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def resolve_retriever(c):
    """Pooling, similarity and lengths: the command line, else what the folder declares (finetune.py's
    retriever.json, or a sentence-transformers layout), else the papers' defaults (cls, dot, 32, 128)."""
    saved = data.read_retriever_settings(c.model) if c.model else {}
    c = dataclasses.replace(c, pooling=c.pooling or saved.get("pooling", "cls"),
                            similarity=c.similarity or saved.get("similarity", "dot"),
                            query_len=c.query_len or saved.get("query_len", 32),
                            passage_len=c.passage_len or saved.get("passage_len", 128))
    if c.pooling not in ("cls", "mean") or c.similarity not in ("dot", "cos"):
        raise data.DataError(f"--pooling must be cls or mean and --similarity dot or cos, got "
                             f"{c.pooling!r}, {c.similarity!r}")
    return c


def resolve_vocab(c):
    if c.vocab:
        return c.vocab
    own = Path(c.model) / "vocab.txt"
    return str(own) if c.model and own.is_file() else str(data.VOCAB)


def check_lengths(c, max_position):
    """Before any work: queries and passages are cut to these lengths, which must fit the model's positions."""
    for flag in ("query_len", "passage_len"):
        if getattr(c, flag) > max_position:
            raise data.DataError(f"--{flag} {getattr(c, flag)} is more than the {max_position} positions of the "
                                 f"model {c.model} (max_position)")


def default_out_dir(c):
    if c.out_dir:
        return Path(c.out_dir)
    if c.bm25:
        name = Path(c.corpus).parent.name if c.corpus else Path(c.data).name
        return Path("runs") / f"bm25-{name}-{c.split}"
    if not Path(c.model).is_dir():   # 'minilm' or a hub id: never write into a package or the hub cache
        return Path("runs") / f"eval-{c.model.replace('/', '--')}-{c.split}"
    return Path(c.model).resolve().parent / f"eval-{c.split}"


def load_qrels_only(c):
    """--qrels, else {data}/qrels/{split}.tsv (or .tsv.gz)."""
    if c.qrels:
        return data.read_qrels(c.qrels)
    path = Path(c.data) / "qrels" / f"{c.split}.tsv"
    return data.read_qrels(path if path.is_file() or not path.with_suffix(".tsv.gz").is_file()
                           else path.with_suffix(".tsv.gz"))


def compare_command(c):
    """--compare A,B: per-metric means and paired two-tailed t-tests of run A against run B."""
    paths = [p for p in c.compare.split(",") if p]
    if len(paths) != 2:
        raise data.DataError(f"--compare expects two run files 'A.trec,B.trec', got {c.compare!r}")
    qrels = load_qrels_only(c)
    (_, a), (_, b) = (compute_metrics(data.read_run(p), qrels) for p in paths)
    tests = compare_per_query(a, b)
    print(f"A = {paths[0]}\nB = {paths[1]}\n{len(a)} queries, paired two-tailed t-test")
    print(f"{'metric':<12} {'A':>8} {'B':>8} {'t':>8} {'p':>8}")
    for m, r in tests.items():
        print(f"{m:<12} {r['mean_a']:>8.4f} {r['mean_b']:>8.4f} {r['t']:>8.3f} {r['p']:>8.4f}")
    return tests


def main(c):
    if c.compare:
        return compare_command(c)
    if not c.bm25 and not c.model:
        raise data.DataError("give --model FOLDER (a saved encoder) or --bm25")
    rank, world, device = setup_distributed()
    out_dir = default_out_dir(c)
    tag = c.tag or (Path(c.model).resolve().parent.name if Path(c.model).is_dir() else c.model)
    c = dataclasses.replace(c, model=data.resolve_model(c.model))    # 'minilm' or a hub id -> a folder
    c = resolve_retriever(c)
    try:
        if c.words:
            if rank == 0:
                encoder = load_encoder(c.model).to(device)
                check_lengths(c, encoder.config.max_position)
                tokenizer = data.load_tokenizer(resolve_vocab(c))
                decoder = load_cpdae_decoder(c.decoder or c.model).to(device)
                probs = word_distribution(encoder, decoder, tokenizer, c.words, c.passage_len, device)
                path = out_dir / "words.png"
                words = plot_word_distribution(probs, c.words, tokenizer, path)
                print(" ".join(f"{w}:{v:.3g}" for w, v, _ in words))
                print(f"word distribution: {path}")
            return None
        corpus, queries, qrels = load_split(c, c.split, c.queries, c.qrels)
        if c.bm25:
            if rank != 0:
                return None
            result = evaluate_bm25(corpus, queries, qrels, out_dir, c.k1, c.b, c.depth)
            print(format_table({f"BM25 (k1={c.k1}, b={c.b})": result}, title=f"{c.split}: {len(result[1])} queries"))
            return result
        encoder = load_encoder(c.model).to(device)
        check_lengths(c, encoder.config.max_position)
        tokenizer = data.load_tokenizer(resolve_vocab(c))
        return evaluate_encoder(encoder, c.pooling, tokenizer, corpus, queries, qrels, out_dir, c,
                                device, tag, c.tsne, c.depth)
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main(parse_config(sys.argv[1:]))
    except data.DataError as e:
        sys.exit(f"error: {e}")
