"""Fine-tune a pre-trained encoder into a dense retriever (bi-encoder, [CLS] vectors, dot product).

PHASE 1 SKELETON: only BM25 and exact search so far; the training loop arrives with the foundation.
"""
import math

import numpy as np
from sklearn.feature_extraction.text import CountVectorizer


# ---------------------------------------------------------------------------------------------
# BM25 (stage-1 negatives, and the papers' first baseline row)
# ---------------------------------------------------------------------------------------------
class BM25:
    """Okapi BM25 over a fixed corpus, scored the way Lucene (Elasticsearch, Anserini, BEIR) does:

        score(q, d) = sum_{t in q} idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
        idf(t)      = log(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

    Tokenizer: lowercase, tokens of 2+ word characters (scikit-learn's default pattern), scikit-learn's
    English stopword list removed, NO stemming. |d| counts the tokens left after stopword removal.
    Departures from Lucene, none of which changes a ranking except the last: no (k1 + 1) factor in the
    numerator (Lucene 8+ dropped it too); a repeated query term counts once per occurrence (as a Lucene
    BooleanQuery of its terms); exact document lengths instead of Lucene's lossy one-byte length norm.
    Defaults k1 = 1.2, b = 0.75 are Elasticsearch's (the BEIR paper's BM25 row); Anserini / Pyserini
    use k1 = 0.9, b = 0.4.
    """

    def __init__(self, doc_texts, k1=1.2, b=0.75):
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b = k1, b
        self.vectorizer = CountVectorizer(lowercase=True, stop_words="english", dtype=np.float32)
        tf = self.vectorizer.fit_transform(doc_texts).tocsr()  # (N, T) term counts
        n_docs = tf.shape[0]
        doc_len = np.asarray(tf.sum(axis=1)).ravel()  # (N,) tokens per document
        df = np.bincount(tf.indices, minlength=tf.shape[1])  # (T,) documents containing each term
        self.idf = np.log1p((n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)  # (T,)
        # Precompute each (document, term) contribution once; a query then only sums columns.
        rows = np.repeat(np.arange(n_docs), np.diff(tf.indptr))  # (nnz,) document of each entry
        norm = k1 * (1 - b + b * doc_len / max(doc_len.mean(), 1e-9))  # (N,)
        weights = tf.copy()
        weights.data = self.idf[tf.indices] * tf.data / (tf.data + norm[rows])  # (nnz,)
        self.weights_t = weights.T.tocsr()  # (T, N): query (M, T) @ weights_t -> (M, N)
        self.n_docs = n_docs

    def score(self, query_texts):
        """Dense (M, N) float32 score matrix; use search() for large corpora."""
        q = self.vectorizer.transform(query_texts)  # (M, T) query term counts
        return np.asarray((q @ self.weights_t).todense(), dtype=np.float32)  # (M, N)

    def search(self, query_texts, k):
        """Top-k documents per query: (scores (M, k) float32, indices (M, k) int64), best first.
        Documents with score 0 (no query term) fill the tail when fewer than k match."""
        k = min(k, self.n_docs)
        chunk = max(1, int(2e7 // max(self.n_docs, 1)))  # bound the dense block to ~80 MB
        all_scores, all_ids = [], []
        for start in range(0, len(query_texts), chunk):
            s = self.score(query_texts[start:start + chunk])  # (m, N)
            top = np.argpartition(-s, k - 1, axis=1)[:, :k] if k < s.shape[1] else np.tile(np.arange(s.shape[1]), (len(s), 1))
            top_s = np.take_along_axis(s, top, axis=1)  # (m, k)
            order = np.argsort(-top_s, axis=1, kind="stable")  # (m, k)
            all_ids.append(np.take_along_axis(top, order, axis=1))
            all_scores.append(np.take_along_axis(top_s, order, axis=1))
        if not all_ids:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate(all_scores), np.concatenate(all_ids).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Exact inner-product search (faiss)
# ---------------------------------------------------------------------------------------------
def exact_search(query_vecs, doc_vecs, k, batch=1024):
    """Exact maximum inner product search with faiss.IndexFlatIP.
    query_vecs (M, H), doc_vecs (N, H) float32 -> (scores (M, k), indices (M, k) int64), best first."""
    import faiss

    doc_vecs = np.ascontiguousarray(doc_vecs, dtype=np.float32)
    query_vecs = np.ascontiguousarray(query_vecs, dtype=np.float32)
    k = min(k, len(doc_vecs))
    index = faiss.IndexFlatIP(doc_vecs.shape[1])
    index.add(doc_vecs)
    scores, ids = [], []
    for start in range(0, len(query_vecs), batch):
        s, i = index.search(query_vecs[start:start + batch], k)  # (m, k) each
        scores.append(s)
        ids.append(i)
    if not ids:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    return np.concatenate(scores), np.concatenate(ids).astype(np.int64)
