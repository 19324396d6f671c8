"""Evaluate a dense retriever or BM25: metrics as trec_eval computes them, TREC run files,
paired t-tests, and the papers' figures (COSTA Figure 3 t-SNE, CPDAE Table 4 word distributions).

PHASE 1: pure parts (metrics, t-test, run files, figures). Encoding and the command line follow.
"""
import math
import os
import tempfile
from pathlib import Path

import numpy as np


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
    Relevant means grade > 0 (trec_eval's default relevance level 1 for integer grades)."""
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
        out[f"Recall@{k}"] = len(relevant.intersection(ranked_docids[:k])) / len(relevant)
    out["NDCG@10"] = dcg / idcg
    return out


def compute_metrics(run, qrels):
    """run = {qid: {docid: score}}, qrels = {qid: {docid: grade}} -> (means, per_query).

    Counted queries: those with at least one relevant (grade > 0) document in the qrels. A counted
    query missing from the run scores 0 (trec_eval -c); run queries absent from the qrels are
    ignored. means = {metric: mean over counted queries}; per_query = {qid: {metric: value}}."""
    per_query = {}
    for qid, judged in qrels.items():
        if not any(g > 0 for g in judged.values()):
            continue
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
# TREC run files (local versions; data.py's read_run / write_run replace them when ready)
# ---------------------------------------------------------------------------------------------
def atomic_write_text(path, text):
    """Write text to path via a temporary file in the same folder and os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_run(path, run, tag="run"):
    """TREC run file `qid Q0 docid rank score tag`, trec_eval order; scores written with repr so
    reading the file back gives the same floats (and so the same tie order)."""
    lines = []
    for qid in sorted(run):
        for rank, (docid, score) in enumerate(trec_order(run[qid]), start=1):
            lines.append(f"{qid} Q0 {docid} {rank} {float(score)!r} {tag}\n")
    atomic_write_text(path, "".join(lines))


def read_run(path):
    """{qid: {docid: score}} from a TREC run file; a bad line raises ValueError naming file:line."""
    run = {}
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 6:
                raise ValueError(f"{path}:{n}: expected 'qid Q0 docid rank score tag', got {line.strip()!r}")
            qid, _, docid, _, score, _ = parts
            try:
                value = float(score)
            except ValueError:
                raise ValueError(f"{path}:{n}: score {score!r} is not a number") from None
            if docid in run.setdefault(qid, {}):
                raise ValueError(f"{path}:{n}: document {docid} appears twice for query {qid}")
            run[qid][docid] = value
    return run


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
