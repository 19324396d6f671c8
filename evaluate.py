"""Evaluate a dense retriever or BM25 the way the papers report it: metrics as trec_eval computes them, TREC run
files, paired two-tailed t-tests. The retrieval layer finetune.py trains with lives here too; this file imports
neither finetune.py nor a method file. Top to bottom: config, retrieval, metrics, significance, runs, command
line, shared blocks.

    python evaluate.py --bm25 --dataset data/scifact --split test          # BM25 baseline row
    python evaluate.py --model runs/finetune/encoder --split test       # any saved encoder (HF BERT folder)
    torchrun --nproc_per_node=4 evaluate.py --model DIR                 # corpus encoding sharded across ranks
    python evaluate.py --model DIR --vectors_dir runs/vectors           # corpus vectors as fp16 memmaps on disk
    python evaluate.py --compare runs/a/run.trec,runs/b/run.trec        # paired t-tests per metric
    python evaluate.py --corpus collection.tsv --queries queries.dev.small.tsv --qrels qrels.dev.small.tsv --bm25

Outputs in out_dir: run.trec (qid Q0 docid rank score tag) and metrics.json (means, per-query values, timings).
The encoder is the shared BERT block (costa.py's bytes, at the end): any Hugging Face BERT folder loads.
"""
import contextlib
import dataclasses
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data
import run


# ==============================================================================================
# Config
# ==============================================================================================
@dataclass
class Config:
    model: str = ""               # BERT folder to evaluate (ours, any BERT or sentence-transformers one), hub id, or "minilm"; several, comma-separated, in research.mechanisms (a path that exists is one model, commas and all)
    bm25: bool = False            # evaluate BM25 instead of a model
    dataset: str = str(data.SCIFACT)  # BEIR folder: corpus.jsonl, queries.jsonl, qrels/{split}.tsv ('.gz' ok)
    split: str = "test"           # qrels/{split}.tsv; several, comma-separated (dev,test): one encoding of the corpus, split s in {out_dir}/eval-{s}
    corpus: str = ""              # explicit corpus (BEIR .jsonl or MS MARCO collection.tsv); overrides dataset
    queries: str = ""             # explicit queries file (with corpus)
    qrels: str = ""               # explicit qrels file (with corpus; also the qrels for --compare)
    pooling: str = ""             # "cls" or "mean"; "" = what the folder declares (retriever.json, sentence-transformers), else "cls"
    similarity: str = ""          # "dot" or "cos"; "" = what the folder declares (a Normalize module = cos), else "dot"
    vocab: str = ""               # WordPiece vocab; "" = the model folder's vocab.txt, else the bundled one
    query_len: int = 0            # query tokens incl. [CLS]/[SEP]; 0 = the folder's retriever.json, else 32
    passage_len: int = 0          # passage tokens incl. [CLS]/[SEP]; 0 = retriever.json, else 128 (documents: 512)
    depth: int = 1000             # documents retrieved per query (Recall@1000 needs 1000)
    encode_batch: int = 128       # texts per forward pass
    index: str = "Flat"           # faiss index_factory string for dense search: "Flat" = exact; "HNSW32", "IVF256,PQ32", ...
    nprobe: int = 0               # IVF indexes: inverted lists visited per query (0 = faiss's default, 1)
    ef_search: int = 0            # HNSW indexes: candidate list size per query (0 = faiss's default, 16)
    index_train: int = 100000     # corpus vectors sampled to train an index that needs it (IVF, PQ)
    vectors_dir: str = ""         # folder for the corpus vectors as fp16 .npy memmaps, one per rank, searched in chunks; "" = float32 in memory
    k1: float = 1.2               # BM25 term-frequency saturation (Elasticsearch / BEIR)
    b: float = 0.75               # BM25 document-length normalisation
    bf16: bool = True             # bf16 autocast on GPU and on CPUs with native bf16 (AVX512-BF16, AMX)
    out_dir: str = ""             # "" = next to the model ({model}/../eval-{split}) or runs/bm25-{data}-{split}
    tag: str = ""                 # run tag in the TREC file and figure label; "" = the model folder or "bm25"; one per --model, comma-separated
    compare: str = ""             # "A.trec,B.trec": paired two-tailed t-test of A vs B per metric (needs qrels)
    dev_queries: int = 0          # with --split dev: the fixed sample of this many train queries that finetune.py --dev_queries holds out


# The domain of each numeric or choice flag, checked by run.cli.parse_config before any work.
FLAG_RULES = {"query_len": "0 or >= 3", "passage_len": "0 or >= 3", "depth": ">= 1", "encode_batch": ">= 1",
              "k1": ">= 0", "b": "in [0, 1]", "nprobe": ">= 0", "ef_search": ">= 0", "index_train": ">= 1",
              "index": "a faiss index_factory string", "pooling": "one of {cls, mean} or empty",
              "similarity": "one of {dot, cos} or empty",
              "dev_queries": ">= 0"}


# ==============================================================================================
# Retrieval: the text vector, the split, BM25, encode (sharded across ranks), exact search
# (finetune.py trains with these; this file imports nothing from it)
# ==============================================================================================
POOLINGS, SIMILARITIES = ("cls", "mean"), ("dot", "cos")


def check_pooling_and_similarity(pooling, similarity):
    """The one place where --pooling and --similarity are checked (for finetune.py too)."""
    if pooling not in POOLINGS or similarity not in SIMILARITIES:
        raise ValueError(f"--pooling must be cls or mean and --similarity dot or cos, got {pooling!r}, "
                         f"{similarity!r}")


def pool(hidden, attention_mask, pooling):
    """Text vectors from last hidden states (B, L, H): [CLS] (position 0) or the mean over real tokens."""
    if pooling == "cls":
        return hidden[:, 0]                                                        # (B, H)
    if pooling == "mean":
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)                          # (B, L, 1)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)                         # (B, H)
    raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")


def text_vectors(hidden, attention_mask, pooling, similarity):
    """Pooled text vectors, L2-normalised for cosine similarity (so that a dot product is the cosine)."""
    vecs = pool(hidden, attention_mask, pooling)                                   # (B, H)
    return F.normalize(vecs.float(), dim=-1) if similarity == "cos" else vecs      # (B, H)


@dataclass
class EncoderConfig:
    """The shared Encoder's fields (as the method files' Config names them); load_encoder fills them in."""
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    ffn_size: int = 3072
    max_position: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12


def load_encoder(folder, c=None):
    """Encoder from a Hugging Face BERT folder, without the MLM head (unused, it would make DDP fail). c: a Config
    with the encoder's fields (finetune.py's), else EncoderConfig; the folder's config.json replaces its sizes."""
    encoder = run.hub.load_pretrained(Encoder, folder, c or EncoderConfig())
    encoder.mlm_head = None
    encoder.source = str(folder)    # what check_finite names
    return encoder


passage_text = data.passage_text   # a document as one string, title then text: the one the passage cache holds too


def load_split(c, split, explicit_queries="", explicit_qrels="", corpus=None):
    """(corpus, queries, qrels) from the BEIR folder c.dataset, or from explicit files when c.corpus is set.
    corpus: that corpus already read for another split (every split shares it), so it is not read again."""
    if c.corpus:
        if not (explicit_queries and explicit_qrels):
            raise data.DataError(f"{c.corpus}: with an explicit corpus give the queries and qrels files too")
        corpus = data.read_corpus(c.corpus) if corpus is None else corpus
        queries = data.read_queries(explicit_queries)
        qrels = data.read_qrels(explicit_qrels)
        data.check_qrels(qrels, queries, corpus, explicit_qrels)
        return corpus, {q: queries[q] for q in qrels}, qrels
    return data.load_beir(c.dataset, split, corpus)


DEV_SEED = 20221   # the dev carve's own seed, apart from every run's --seed: one dev split for all runs


def carve_dev(qrels, n, seed=DEV_SEED):
    """Training qrels split into (train, dev): dev = a fixed random sample of n queries that have a positive, the
    same for every run and script (finetune.py and evaluate.py --dev_queries n); train = the rest. Settings are
    chosen on dev, so the test split chooses nothing."""
    judged = sorted(q for q, docs in qrels.items() if any(g > 0 for g in docs.values()))
    if n > len(judged):
        raise data.DataError(f"--dev_queries {n}: only {len(judged)} training queries have a positive")
    dev = sorted(judged[i] for i in np.random.default_rng(seed).choice(len(judged), n, replace=False))
    return {q: r for q, r in qrels.items() if q not in set(dev)}, {q: qrels[q] for q in dev}


# ---------------------------------------------------------------------------------------------
# BM25 (the papers' first baseline row, and finetune.py's stage-1 negatives)
# ---------------------------------------------------------------------------------------------
class BM25:
    """Okapi BM25 over a fixed corpus, scored the way Lucene (Elasticsearch, Anserini, BEIR) does:

        score(q, d) = sum_{t in q} idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
        idf(t)      = log(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

    Tokenizer: lowercase, tokens of 2+ word characters, scikit-learn's English stopwords removed (|d| counts
    the rest), NO stemming; a repeated query term counts once per occurrence. Unlike Lucene: no (k1 + 1) in the
    numerator (no ranking changes; Lucene 8+ dropped it too), exact document lengths (Lucene's are lossy).
    k1 = 1.2, b = 0.75: Elasticsearch's (the BEIR paper's BM25 row); Anserini uses 0.9, 0.4.
    """

    def __init__(self, doc_texts, k1=1.2, b=0.75):
        from sklearn.feature_extraction.text import CountVectorizer

        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b = k1, b
        self.vectorizer = CountVectorizer(lowercase=True, stop_words="english", dtype=np.float32)
        progress = run.files.ProgressLine("BM25 indexing:", len(doc_texts), "documents")
        tf = self.vectorizer.fit_transform(run.files.counted(doc_texts, progress)).tocsr()  # (N, T) term counts
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
        self.n_docs, self.df = n_docs, df

    def score(self, query_texts):
        """Dense (M, N) float32 score matrix; use search() for large corpora."""
        q = self.vectorizer.transform(query_texts)  # (M, T) query term counts
        return np.asarray((q @ self.weights_t).todense(), dtype=np.float32)  # (M, N)

    # Up to this many documents the top-k is taken from dense rows, as it always was: numpy's argpartition
    # then orders equal scores, and that order is what command 1's negatives and rankings were made with.
    DENSE_UP_TO = 100_000

    def search(self, query_texts, k):
        """Top-k documents per query: (scores (M, k) float32, indices (M, k) int64), best first, score-0 documents
        filling the tail. Above DENSE_UP_TO documents from the sparse scores (sparse_search)."""
        if self.n_docs > self.DENSE_UP_TO:
            return self.sparse_search(query_texts, k)
        return self.dense_search(query_texts, k)

    def sparse_search(self, query_texts, k, postings_per_chunk=10_000_000):
        """search() from the sparse (M, N) scores: only documents sharing a term with the query are scored (ties:
        the lower index first; the score-0 tail: the lowest indices not matched), about postings_per_chunk at once."""
        k = min(k, self.n_docs)
        q = self.vectorizer.transform(query_texts).tocsr()  # (M, T) query term counts
        cost = np.cumsum((q > 0).astype(np.int64) @ self.df.astype(np.int64))  # (M,) postings up to each query
        scores, ids = np.zeros((len(query_texts), k), np.float32), np.zeros((len(query_texts), k), np.int64)
        progress = run.files.ProgressLine("BM25 search:", len(query_texts), "queries")
        start = 0
        while start < len(query_texts):
            done = cost[start - 1] if start else 0
            stop = max(start + 1, int(np.searchsorted(cost, done + postings_per_chunk, side="right")))
            s = (q[start:stop] @ self.weights_t).tocsr()  # (m, N) sparse: the matching documents only
            for row in range(stop - start):
                lo, hi = s.indptr[row], s.indptr[row + 1]
                scores[start + row], ids[start + row] = top_k_sparse(s.data[lo:hi], s.indices[lo:hi], k)
            progress.add(stop - start)
            start = stop
        return scores, ids

    def dense_search(self, query_texts, k):
        """search() from dense (m, N) score rows: argpartition over every document of every query."""
        k = min(k, self.n_docs)
        chunk = max(1, int(2e7 // max(self.n_docs, 1)))  # bound the dense block to ~80 MB
        all_scores, all_ids = [np.zeros((0, k), np.float32)], [np.zeros((0, k), np.int64)]
        progress = run.files.ProgressLine("BM25 search:", len(query_texts), "queries")
        for start in range(0, len(query_texts), chunk):
            s = self.score(query_texts[start:start + chunk])  # (m, N)
            progress.add(len(s))
            top = np.argpartition(-s, k - 1, axis=1)[:, :k] if k < self.n_docs else np.tile(np.arange(k), (len(s), 1))
            top_s = np.take_along_axis(s, top, axis=1)  # (m, k)
            order = np.argsort(-top_s, axis=1, kind="stable")  # (m, k)
            all_ids.append(np.take_along_axis(top, order, axis=1).astype(np.int64))
            all_scores.append(np.take_along_axis(top_s, order, axis=1))
        return np.concatenate(all_scores), np.concatenate(all_ids)


def top_k_sparse(values, docs, k):
    """One query's k best matched documents (values > 0 at docs): score desc, index asc; then score-0 documents."""
    if len(values) > k:
        kth = -np.partition(-values, k - 1)[k - 1]                  # the k-th best score
        keep = values >= kth                                        # every document tied with it too
        values, docs = values[keep], docs[keep]
    order = np.lexsort((docs, -values))[:k]                         # (<= k,) score desc, index asc
    top_ids, top_scores = docs[order].astype(np.int64), values[order]
    if len(order) < k:
        need = k - len(order)
        fill = np.setdiff1d(np.arange(k), top_ids, assume_unique=True)[:need]  # k indices hold need free ones
        top_ids = np.concatenate([top_ids, fill])
        top_scores = np.concatenate([top_scores, np.zeros(need, np.float32)])
    return top_scores, top_ids


# ---------------------------------------------------------------------------------------------
# Dense retrieval: encode, search (exact or a faiss index), the cross-rank top-k merge
# ---------------------------------------------------------------------------------------------
def new_index(spec, dim):
    """An empty faiss index from an index_factory string, inner-product metric; one line when faiss refuses it."""
    import faiss

    try:
        return faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:   # faiss's message is several lines; the last names the problem
        raise ValueError(f"--index {spec!r} is not a faiss index_factory string for {dim}-d vectors "
                         f"({str(e).strip().split(': ')[-1]})") from None


def row_chunks(vecs, chunk=65536, dtype=np.float32):
    """(start, rows (c, H) as dtype; None = their own) over an (N, H) array, chunk rows at a time; an fp16 memmap
    through a mapping of its own per chunk (_fresh_map): never all resident. Drop each chunk before the next."""
    for start in range(0, len(vecs), chunk):
        yield start, _read_rows(vecs, start, start + chunk, dtype)                          # (c, H)


def _read_rows(vecs, start, stop, dtype):
    """vecs[start:stop] as a C-contiguous array of dtype (None: its own); a memmap's rows from a throwaway mapping."""
    part = _fresh_map(vecs)[start:stop]
    if isinstance(part, np.memmap):
        return np.array(part, dtype=dtype or part.dtype, order="C")
    return np.ascontiguousarray(part, dtype=dtype or part.dtype)


def _fresh_map(vecs):
    """A new read-only mapping of the .npy file the memmap vecs maps whole (its pages freed when dropped), else vecs."""
    if isinstance(vecs, np.memmap) and vecs.filename and str(vecs.filename).endswith(".npy"):
        whole = np.load(vecs.filename, mmap_mode="r")
        if whole.shape == vecs.shape and whole.dtype == vecs.dtype:
            return whole
    return vecs


def build_index(doc_vecs, spec="Flat", train_size=100_000, seed=0, chunk=65536):
    """A faiss index (inner product) over doc_vecs (N, H) (float32, or an fp16 memmap) from an index_factory string
    ("Flat", "HNSW32", "IVF256,PQ32", ...), trained if it needs it on a seeded sample of at most train_size rows."""
    index = new_index(spec, doc_vecs.shape[1])
    if not index.is_trained:
        rows = np.random.default_rng(seed).permutation(len(doc_vecs))[:train_size]
        index.train(np.ascontiguousarray(_fresh_map(doc_vecs)[np.sort(rows)], dtype=np.float32))  # (t, H)
    reserve(index, len(doc_vecs))
    for _, rows in row_chunks(doc_vecs, chunk):
        index.add(rows)
        del rows                                   # before the next chunk is read
    return index


def reserve(index, n):
    """Allocate a flat-coded faiss index's storage for n vectors at once (appends would double it, old and new held)."""
    import faiss

    flat = faiss.downcast_index(index.storage) if hasattr(index, "storage") else index
    if isinstance(flat, faiss.IndexFlatCodes) and flat.ntotal == 0:
        flat.codes.resize(n * flat.code_size)
        flat.codes.resize(0)


def set_search_parameters(index, nprobe=0, ef_search=0):
    """nprobe (IVF) and efSearch (HNSW) of an approximate index; 0 = faiss's default; a knob it lacks is left."""
    import faiss

    for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
        if value > 0:
            try:
                faiss.ParameterSpace().set_index_parameter(index, name, value)
            except RuntimeError:   # e.g. efSearch on an IVF index
                pass


def search(query_vecs, doc_vecs, k, index="Flat", nprobe=0, ef_search=0, train_size=100_000, batch=1024):
    """Maximum inner product search with a faiss index (build_index): exact for "Flat", approximate otherwise.
    query_vecs (M, H), doc_vecs (N, H) (or an fp16 memmap) -> (scores (M, k), indices (M, k) int64), best first;
    fewer than k found: the tail is index -1, score -inf."""
    query_vecs = np.ascontiguousarray(query_vecs, dtype=np.float32)
    k = min(k, len(doc_vecs))
    index = build_index(doc_vecs, index, train_size)
    set_search_parameters(index, nprobe, ef_search)
    scores, ids = [np.zeros((0, k), np.float32)], [np.zeros((0, k), np.int64)]
    progress = run.files.ProgressLine("searching:", len(query_vecs), "queries")
    for start in range(0, len(query_vecs), batch):
        s, i = index.search(query_vecs[start:start + batch], k)  # (m, k) each
        progress.add(len(s))
        scores.append(s)
        ids.append(i.astype(np.int64))
    scores, ids = np.concatenate(scores), np.concatenate(ids)
    return np.where(ids >= 0, scores, -np.inf).astype(np.float32), ids


@torch.no_grad()
def torch_exact_search(query_vecs, doc_vecs, k, device, chunk=65536, batch=4096):
    """search() as matmuls on `device`, retrieve()'s "Flat" on a GPU (faiss here is CPU-only). Documents go to the
    device chunk rows at a time, the matmul in their dtype (fp16: near-ties may swap); every query keeps a running
    top-k, so neither the (M, N) scores nor the corpus are ever whole on the device."""
    k = min(k, len(doc_vecs))
    dtype = torch.from_numpy(np.zeros(0, doc_vecs.dtype)).dtype
    queries = torch.from_numpy(np.ascontiguousarray(query_vecs, dtype=np.float32)).to(device, dtype)  # (M, H)
    top_s = torch.zeros((len(queries), 0), device=device)                                 # (M, k') float32
    top_i = torch.zeros((len(queries), 0), dtype=torch.long, device=device)                # (M, k')
    for start, docs in row_chunks(doc_vecs, chunk, dtype=None):
        docs = torch.from_numpy(docs).to(device)                                           # (c, H)
        width = min(k, start + len(docs))
        new_s = torch.empty((len(queries), width), device=device)                          # (M, k'')
        new_i = torch.empty((len(queries), width), dtype=torch.long, device=device)        # (M, k'')
        ids = torch.arange(start, start + len(docs), device=device)                        # (c,)
        for q in range(0, len(queries), batch):
            s = torch.cat([top_s[q:q + batch], (queries[q:q + batch] @ docs.T).float()], 1)  # (b, k' + c)
            i = torch.cat([top_i[q:q + batch], ids.expand(len(s), -1)], 1)                  # (b, k' + c)
            new_s[q:q + batch], best = s.topk(width, dim=1)                                 # (b, k'')
            new_i[q:q + batch] = i.gather(1, best)
        top_s, top_i = new_s, new_i
        del docs                                   # before the next chunk is read
    return top_s.cpu().numpy(), top_i.cpu().numpy()


@torch.no_grad()
def encode(encoder, pooling, tokenizer, texts, max_len, batch_size, device, bf16=True, similarity="dot", path="",
           workers=0):
    """(len(texts), H) float32 numpy vectors (unit length for "cos"), encoded sorted by length. texts: strings, or a
    passage cache's Passages (run/passages.py: read, not tokenized). With a path, into an fp16 .npy memmap there
    instead (atomic), returned opened read-only: a corpus never held in memory. workers: loader processes that build
    the batches ahead (EncodeBatches) while this one runs the encoder."""
    shape = (len(texts), encoder.config.hidden_size)
    args = (encoder, pooling, tokenizer, texts, max_len, batch_size, device, bf16, similarity, workers)
    if not path:
        return _encode_into(np.zeros(shape, dtype=np.float32), *args)

    def write(tmp):
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape)   # (N, H)
        reserve_space(tmp, out.offset)
        _encode_into(out, *args)
        out.flush()
        del out                                    # unmapped: its written pages leave this process
    try:
        run.files.atomic_write(path, write)
    except Exception as e:
        if not run.files.is_disk_full(e, Path(path).parent):
            raise
        raise run.files.disk_full_line(Path(path).parent, "the corpus vectors need", shape[0] * shape[1] * 2, "",
                                  "free some space, or give another --vectors_dir") from None
    return np.load(path, mmap_mode="r")


def reserve_space(path, start=0, chunk=1 << 24):
    """Allocate the whole of a file on its disk now: a memmap the disk cannot hold dies of SIGBUS (no line); reserved,
    a full disk is an OSError here. Without posix_fallocate (macOS) the zeros from `start` are written through."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            for offset in range(start, size, chunk):
                os.pwrite(fd, bytes(min(chunk, size - offset)), offset)
    finally:
        os.close(fd)


@torch.no_grad()
def _encode_into(out, encoder, pooling, tokenizer, texts, max_len, batch_size, device, bf16, similarity, workers=0):
    """Fill out (N, H) row by row with encode()'s vectors, in its dtype; returns out."""
    was_training = encoder.training
    encoder.eval()
    autocast = run.autocast_bf16(device, bf16)
    batches = EncodeBatches(texts, tokenizer, max_len, batch_size)
    progress = run.files.ProgressLine("encoding:", len(texts), "texts")
    for rows, ids, mask in run.batches(batches, workers, range(len(batches))):              # (b,), (b, L), (b, L)
        rows = rows.numpy()
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        with autocast:
            vecs = text_vectors(encoder(ids, mask), mask, pooling, similarity)                 # (b, H)
        check_finite(vecs, encoder, rows, texts)
        out[rows] = vecs.float().cpu().numpy()
        progress.add(len(rows))
    encoder.train(was_training)
    return out


def check_finite(vecs, encoder, rows, texts):
    """A NaN or inf vector would rank nothing, silently: one line naming the model and the first text giving one."""
    bad = (~torch.isfinite(vecs)).any(1).nonzero()
    if len(bad):
        i = int(rows[int(bad[0])])
        what = texts.label(i) if isinstance(texts, run.passages.Passages) else repr(texts[i][:40])
        raise data.DataError(f"{getattr(encoder, 'source', 'the encoder')}: the model gives a non-finite vector "
                             f"(NaN or inf) for text {i} of {len(texts)} ({what}); its weights hold NaN "
                             f"or inf (a damaged or diverged checkpoint?)")


class EncodeBatches(torch.utils.data.Dataset):
    """encode()'s batch b, built in a loader worker: (rows, ids, mask) of the texts at rows order[b*size:(b+1)*size],
    the texts sorted by length (each batch pads the least)."""

    def __init__(self, texts, tokenizer, max_len, batch_size):
        self.texts, self.tokenizer, self.max_len, self.size = texts, tokenizer, max_len, batch_size
        lengths = texts.chars if isinstance(texts, run.passages.Passages) else [len(t) for t in texts]
        self.order = np.argsort(lengths, kind="stable")                                     # (N,)

    def __len__(self):
        return (len(self.order) + self.size - 1) // self.size

    def __getitem__(self, b):
        rows = self.order[b * self.size:(b + 1) * self.size]                                 # (b,)
        return rows, *passage_batch(self.texts, rows, self.tokenizer, self.max_len)


def passage_batch(texts, rows, tokenizer, max_len):
    """Padded '[CLS] text [SEP]' ids and mask (B, L) of texts[rows]: a passage cache's Passages read as it was
    tokenized, strings tokenized now (data.encode_texts); the same ids either way."""
    if isinstance(texts, run.passages.Passages):
        return texts.batch(rows, max_len)
    return data.encode_texts(tokenizer, [texts[i] for i in rows], max_len)


def _all_gather(t, device):
    """Non-differentiable all-gather of equal-shaped tensors along a new first dimension -> (W, ...)."""
    parts = [torch.empty_like(t.to(device)) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.to(device).contiguous())
    return torch.stack(parts).cpu()


def merge_topk_across_ranks(scores, ids, k, device, chunk=16384):
    """Each rank's top-k of its own corpus shard all-gathered, the global top-k kept. scores (Q, k'), ids (Q, k')."""
    pad = k - scores.shape[1]  # a shard smaller than k
    scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
    ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
    out_s, out_i = [], []
    for start in range(0, max(len(scores), 1), chunk):  # bounded all-gather messages
        s = _all_gather(torch.from_numpy(scores[start:start + chunk]), device)             # (W, q, k)
        i = _all_gather(torch.from_numpy(ids[start:start + chunk]), device)                # (W, q, k)
        s, i = s.permute(1, 0, 2).flatten(1), i.permute(1, 0, 2).flatten(1)               # (q, W*k)
        top_s, top = s.topk(k, dim=1)                                                      # (q, k)
        out_s.append(top_s.numpy())
        out_i.append(i.gather(1, top).numpy())
    return np.concatenate(out_s)[:len(scores)], np.concatenate(out_i)[:len(scores)]


def encode_corpus_shard(encoder, tokenizer, doc_texts, c, device):
    """This rank's shard of the corpus encoded (in memory, or fp16 in c.vectors_dir), for retrieve(doc_vecs=)."""
    rank, world = rank_and_world()
    shard = data.shard(len(doc_texts), rank, world)
    path = Path(c.vectors_dir) / f"docs-{rank}-of-{world}.npy" if c.vectors_dir else ""
    return encode(encoder, c.pooling, tokenizer, doc_texts[shard.start:shard.stop], c.passage_len,
                  c.encode_batch, device, c.bf16, c.similarity, path, getattr(c, "workers", 0))   # (n, H)


def retrieve(encoder, tokenizer, doc_texts, query_texts, k, c, device, timings=None, doc_vecs=None):
    """Dense retrieval: (scores (Q, k), corpus indices (Q, k)) best first, on EVERY rank, with c.index (search();
    "Flat" on a GPU: torch_exact_search). doc_vecs: this rank's shard as encode_corpus_shard() gave it.
    Under torchrun each rank encodes and searches only its shard of the corpus (data.shard), and the per-shard
    top-k lists are all-gathered and merged: the same work on every rank, none holds the whole corpus' vectors.
    Every rank encodes all the queries (few and short)."""
    rank, world = rank_and_world()
    k = min(k, len(doc_texts))
    new_index(c.index, encoder.config.hidden_size)  # a bad --index fails now, not after encoding the corpus
    shard = data.shard(len(doc_texts), rank, world)
    t0, encodes_corpus = time.time(), doc_vecs is None
    if encodes_corpus:
        doc_vecs = encode_corpus_shard(encoder, tokenizer, doc_texts, c, device)          # (n, H)
    elif len(doc_vecs) != len(shard):
        raise ValueError(f"doc_vecs has {len(doc_vecs)} rows but this rank's shard of the corpus has {len(shard)}")
    t1 = time.time()
    query_vecs = encode(encoder, c.pooling, tokenizer, list(query_texts), c.query_len, c.encode_batch, device,
                        c.bf16, c.similarity, workers=getattr(c, "workers", 0))            # (Q, H)
    t2 = time.time()
    if len(shard):
        if device.type == "cuda" and c.index == "Flat":
            scores, ids = torch_exact_search(query_vecs, doc_vecs, k, device)
        else:
            scores, ids = search(query_vecs, doc_vecs, k, c.index, c.nprobe, c.ef_search, c.index_train)
        ids = np.where(ids >= 0, ids + shard.start, -1)                                   # -1: not found
    else:
        scores, ids = np.zeros((len(query_texts), 0), np.float32), np.zeros((len(query_texts), 0), np.int64)
    t3 = time.time()
    if world > 1:
        scores, ids = merge_topk_across_ranks(scores, ids, k, device)
    say_short_rankings(ids, k, c.index, rank)
    if timings is not None:     # vectors the caller encoded (evaluate_splits) have no encoding time here
        if encodes_corpus:
            timings.update(encode_docs_s=t1 - t0, docs_per_s_per_rank=len(shard) / max(t1 - t0, 1e-9))
        timings.update(encode_queries_s=t2 - t1, search_s=t3 - t2, merge_s=time.time() - t3)
    return scores, ids


def say_short_rankings(ids, k, index, rank):
    """An approximate index may find fewer than k documents for a query (id -1): rank 0 says for how many."""
    short = int((ids < 0).any(1).sum()) if ids.size else 0
    if short and rank == 0:
        print(f"note: the {index} index found fewer than {k} documents for {short} of {len(ids)} queries; their "
              f"rankings are shorter (a larger --nprobe or --ef_search finds more)", flush=True)


# ---------------------------------------------------------------------------------------------
# Metrics, computed the way trec_eval does
# ---------------------------------------------------------------------------------------------
METRICS = ("MRR@10", "MRR@100", "Recall@10", "Recall@100", "Recall@1000", "NDCG@10")


def trec_order(docs):
    """[(docid, score)] best first, ties broken by docid (a string) DESCENDING, as trec_eval's qsort does."""
    return sorted(docs.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)


def query_metrics(ranked_docids, judged):
    """Metric values for one query. ranked_docids: docids best first; judged: {docid: grade}. Relevant: grade > 0
    (trec_eval's default); a query with no relevant document scores 0 on every metric, as in trec_eval."""
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
    """run = {qid: {docid: score}}, qrels = {qid: {docid: grade}} -> (means, per_query {qid: {metric: value}}).
    Every query of the qrels counts, as in trec_eval -c and pytrec_eval (BEIR): one missing from the run or with
    no relevant document scores 0; run queries absent from the qrels are ignored."""
    per_query = {}
    for qid, judged in qrels.items():
        ranked = [d for d, _ in trec_order(run.get(qid, {}))]
        per_query[qid] = query_metrics(ranked, judged)
    n = len(per_query)
    means = {m: (sum(v[m] for v in per_query.values()) / n if n else 0.0) for m in METRICS}
    return means, per_query


# ---------------------------------------------------------------------------------------------
# Paired two-tailed t-test (scipy.stats.ttest_rel)
# ---------------------------------------------------------------------------------------------
def paired_t_test(a, b):
    """Two-tailed paired t-test of per-query values a vs b -> (t, p): t = mean(d) / (sd(d) / sqrt(n)), d = a - b,
    df = n - 1 (scipy.stats.ttest_rel). Where scipy says nan: sd 0 gives t 0, p 1 (identical runs), or t = +-inf,
    p 0 (a constant difference). Fewer than 2 queries: (nan, nan)."""
    from scipy.stats import ttest_rel  # here: scipy takes a second to import

    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if len(d) < 2:
        return float("nan"), float("nan")
    mean, sd = d.mean(), d.std(ddof=1)
    if sd == 0.0:
        return (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    result = ttest_rel(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    return float(result.statistic), float(result.pvalue)


def bootstrap_difference(a, b, resamples=10000, seed=0, level=0.95):
    """Percentile interval of mean(a - b) from a paired bootstrap over seeds x queries: a, b (seeds, queries), row
    s from seed s. A resample's mean is w_s' D w_q / (S Q), D = a - b, w the draw counts. -> (low, high)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)             # (S, Q)
    n_seeds, n_queries = d.shape
    rng = np.random.default_rng(seed)
    w_seeds = rng.multinomial(n_seeds, np.full(n_seeds, 1 / n_seeds), size=resamples)        # (R, S)
    w_queries = rng.multinomial(n_queries, np.full(n_queries, 1 / n_queries), size=resamples)  # (R, Q)
    means = np.einsum("rs,sq,rq->r", w_seeds, d, w_queries) / (n_seeds * n_queries)    # (R,)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def compare_per_query(per_query_a, per_query_b, metrics=METRICS):
    """Paired t-test of two systems' per-query metrics over common queries -> {metric: {mean_a, mean_b, t, p, n}}."""
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
def trec_tag(tag):
    """The tag as one word (spaces -> '-'), so that every line of a run file keeps its 6 fields."""
    return "-".join(str(tag).split()) or "run"


def read_run(path):
    """TREC run file 'qid Q0 docid rank score tag' -> {qid: {docid: score}}."""
    ranking = {}
    for number, line in data.read_lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 6:
            raise data.DataError(f"{path}:{number}: expected 6 fields 'qid Q0 docid rank score tag', found {len(fields)}")
        try:
            score = float(fields[4])
        except ValueError:
            raise data.DataError(f"{path}:{number}: score {fields[4]!r} is not a number") from None
        data.add_once(ranking.setdefault(fields[0], {}), fields[2], score, path, number,
                       f"document {fields[2]!r} for query {fields[0]!r}")
    return ranking


def write_run(path, ranking, tag="dense"):
    """Write {qid: {docid: score}} as a TREC run file, each query ranked by score (atomic)."""
    lines = []
    for qid, scores in ranking.items():
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += [f"{qid} Q0 {docid} {rank} {score:.6f} {tag}\n" for rank, (docid, score) in enumerate(ranked, start=1)]
    run.files.atomic_write_text(path, "".join(lines))


def save_and_score(ranking, qrels, out_dir, tag, info=None):
    """Write run.trec, score the run AS READ BACK from it (what trec_eval would report, rounding included), and
    write metrics.json (means, per-query values, `info`). run.trec is renamed into place last: a failed evaluation
    (a full disk is one line) leaves the previous pair as it was. Returns (means, per_query)."""
    out_dir, tag, scored = Path(out_dir), trec_tag(tag), []

    def write_and_score(tmp):
        write_run(tmp, ranking, tag)
        scored.extend(compute_metrics(read_run(tmp), qrels))
        run.files.atomic_write_json(out_dir / "metrics.json", {"tag": tag, "n_queries": len(scored[1]), "metrics": scored[0],
                                                          "info": info or {}, "per_query": scored[1]})
    try:
        run.files.atomic_write(out_dir / "run.trec", write_and_score)
    except Exception as e:
        if not run.files.is_disk_full(e, out_dir):
            raise
        needs = sum(len(f"{q} Q0 {d} {len(docs)} {score:.6f} {tag}\n") for q, docs in ranking.items()   # write_run's
                    for d, score in docs.items())                                                       # lines, at most
        raise run.files.disk_full_line(out_dir, "run.trec needs", needs, "its run.trec and metrics.json are the previous ones; ",
                                  "free some space, or give another --out_dir") from None
    return tuple(scored)


def evaluate_bm25(corpus, queries, qrels, out_dir, k1=1.2, b=0.75, depth=1000, verbose=True):
    """The papers' BM25 row: top `depth` per judged query; score-0 documents are not retrieved, as in Lucene."""
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


def evaluate_encoder(encoder, tokenizer, corpus, queries, qrels, out_dir, c, device, tag="dense",
                     depth=1000, doc_vecs=None):
    """retrieve(), then rank 0 saves and scores the run, prints the metrics and returns (means, per_query); other
    ranks None. doc_vecs: this rank's corpus shard already encoded (evaluate_splits). Every rank calls this."""
    rank, world = rank_and_world()
    tag = trec_tag(tag)                            # the run file's, in the printouts too
    doc_texts, doc_ids = corpus_texts(corpus)
    qids = sorted(qrels)
    timings = {}
    t0 = time.time()
    scores, ids = retrieve(encoder, tokenizer, doc_texts, [queries[q] for q in qids], depth, c,
                           device, timings, doc_vecs)
    timings["total_s"] = time.time() - t0
    if rank != 0:
        return None
    run = {q: {doc_ids[j]: float(s) for s, j in zip(scores[r], ids[r]) if j >= 0} for r, q in enumerate(qids)}
    info = {"pooling": c.pooling, "similarity": c.similarity, "world": world, "device": device.type, "n_docs": len(doc_ids), **timings}
    means, per_query = save_and_score(run, qrels, out_dir, tag, info)
    encoded = ("the corpus vectors encoded once for every split" if doc_vecs is not None else
               f"encoded {len(doc_ids):,} passages in {timings['encode_docs_s']:.1f}s "
               f"({timings['docs_per_s_per_rank'] * world:,.0f} docs/s over {world} process(es))")
    print(f"{tag}: {encoded}, {len(qids)} queries in {timings['encode_queries_s']:.1f}s, {c.index} search {timings['search_s']:.2f}s "
          f"-> {Path(out_dir) / 'run.trec'}")
    print(format_table({tag: (means, per_query)}))
    return means, per_query


def corpus_texts(corpus):
    """(what retrieve() reads of a corpus, its doc ids by row): a passage cache's Passages (run/passages.py) as they
    are, a dict {docid: {"title", "text"}} as lists of its passage texts and ids."""
    if isinstance(corpus, run.passages.Passages):
        return corpus, corpus.doc_ids
    doc_ids = list(corpus)
    return [passage_text(corpus[d]) for d in doc_ids], doc_ids


def same_corpus(a, b):
    """Whether corpus a is b, or (dicts) has the same ids in the same order and the same texts: encoded once."""
    return b is not None and (a is b or (isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b) and a == b))


def evaluate_splits(encoder, tokenizer, splits, c, device, tag="dense", depth=1000):
    """evaluate_encoder on each (corpus, queries, qrels, out_dir), a shared corpus encoded once; every rank calls it."""
    results, encoded = [], (None, None)                    # (the corpus, this rank's shard vectors)
    for corpus, queries, qrels, out_dir in splits:
        if not same_corpus(corpus, encoded[0]):
            t0 = time.time()
            encoded = (corpus, encode_corpus_shard(encoder, tokenizer, corpus_texts(corpus)[0], c, device))
            rank, world = rank_and_world()
            if rank == 0:
                seconds = time.time() - t0
                print(f"{tag}: encoded {len(corpus):,} passages in {seconds:.1f}s ({len(corpus) / max(seconds, 1e-9):,.0f} "
                      f"docs/s over {world} process(es))", flush=True)
        results.append(evaluate_encoder(encoder, tokenizer, corpus, queries, qrels, out_dir, c, device, tag,
                                        depth=depth, doc_vecs=encoded[1]))
    return results


def format_table(rows, title="", baseline=None, metrics=METRICS):
    """Metrics table of rows = {name: (means, per_query)}; '*': p <= 0.05 against the baseline row (paired t-test)."""
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
    """One line per pair of the named rows (each against every one before it): the difference and the t-test's p."""
    lines = []
    for i, b in enumerate(names):
        for a in names[:i]:
            tests = compare_per_query(rows[b][1], rows[a][1], metrics)
            cells = ", ".join(f"{m} {tests[m]['mean_a'] - tests[m]['mean_b']:+.4f} (p = {tests[m]['p']:.3g})"
                              for m in metrics)
            lines.append(f"{b} vs {a}: {cells}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figures and provenance, for the scripts that report (research: study, benchmark, mechanisms)
# ---------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path):
    """Save a PNG atomically and close the figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    import matplotlib.pyplot as plt

    plt.close(fig)


def git_state(folder=data.HERE):
    """(commit, dirty: a non-test .py file differs from the commit or is new) of a checkout; else ('unknown', False)."""
    import subprocess

    def git(*args):           # its output, or None where git fails (no repository, no git); a hang is one line
        try:
            r = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise data.DataError(f"git {' '.join(args)}: no answer in {GIT_TIMEOUT_S} s (a lock? a dead mount?); "
                                 f"killed") from None
        except FileNotFoundError:
            return None
        return r.stdout.strip() if r.returncode == 0 else None
    changed = git("status", "--porcelain", "--", "*.py", ":(exclude)test_*.py", ":(exclude)conftest.py", ":(exclude)tests/")
    return git("rev-parse", "HEAD") or "unknown", bool(changed)


GIT_TIMEOUT_S = 60   # git answers these in well under a second; a minute without one is a hang


# ---------------------------------------------------------------------------------------------
# How a model folder declares its pooling, similarity and lengths (finetune.py writes them)
# ---------------------------------------------------------------------------------------------
def read_retriever_settings(folder):
    """{'pooling', 'similarity', 'query_len', 'passage_len'} as a model folder declares them: finetune.py's
    retriever.json, or a sentence-transformers layout (a Normalize module = cosine; max_seq_length for both
    lengths). {} when it declares nothing."""
    folder = Path(folder)
    if (folder / "retriever.json").is_file():
        return data.read_json(folder / "retriever.json")
    if not (folder / "modules.json").is_file():
        return {}
    settings = {}
    for module in data.read_json(folder / "modules.json"):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Normalize":
            settings["similarity"] = "cos"
        if kind == "Pooling":
            path = folder / module["path"] / "config.json"
            active = [k.removeprefix("pooling_mode_") for k, v in data.read_json(path).items()
                      if k.startswith("pooling_mode_") and v is True]
            if active not in (["cls_token"], ["mean_tokens"]):
                raise data.DataError(f"{path}: only cls or mean pooling is supported, the folder declares {active}")
            settings["pooling"] = {"cls_token": "cls", "mean_tokens": "mean"}[active[0]]
    bert_config = folder / "sentence_bert_config.json"        # its length, for queries and passages alike
    if bert_config.is_file() and data.read_json(bert_config).get("max_seq_length"):
        settings["query_len"] = settings["passage_len"] = int(data.read_json(bert_config)["max_seq_length"])
    declared = folder / "config_sentence_transformers.json"    # newer sentence-transformers say it here
    if declared.is_file() and data.read_json(declared).get("similarity_fn_name") in ("cosine", "dot"):
        settings.setdefault("similarity", {"cosine": "cos", "dot": "dot"}[data.read_json(declared)["similarity_fn_name"]])
    settings.setdefault("similarity", "dot")
    return settings


def write_retriever_settings(folder, pooling, similarity, query_len, passage_len):
    """retriever.json plus the sentence-transformers files: SentenceTransformer(folder) pools as fine-tuning did."""
    folder = Path(folder)
    run.files.atomic_write_json(folder / "retriever.json", {"pooling": pooling, "similarity": similarity,
                                                       "query_len": query_len, "passage_len": passage_len})
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if similarity == "cos":
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    hidden = data.read_json(folder / "config.json")["hidden_size"]
    run.files.atomic_write_json(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    run.files.atomic_write_json(folder / "modules.json", modules)
    run.files.atomic_write_json(folder / "sentence_bert_config.json", {"max_seq_length": passage_len, "do_lower_case": False})
    run.files.atomic_write_json(folder / "config_sentence_transformers.json",
                           {"similarity_fn_name": "cosine" if similarity == "cos" else "dot"})


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def resolve_retriever(c):
    """Pooling, similarity and lengths: the flags, else what the folder declares, else (cls, dot, 32, 128)."""
    saved = read_retriever_settings(c.model) if c.model else {}
    c = dataclasses.replace(c, pooling=c.pooling or saved.get("pooling", "cls"),
                            similarity=c.similarity or saved.get("similarity", "dot"),
                            query_len=c.query_len or saved.get("query_len", 32),
                            passage_len=c.passage_len or saved.get("passage_len", 128))
    check_pooling_and_similarity(c.pooling, c.similarity)
    return c


def resolve_vocab(c):
    if c.vocab:
        return c.vocab
    own = Path(c.model) / "vocab.txt"
    return str(own) if c.model and own.is_file() else str(data.VOCAB)


def check_lengths(c, max_position, model):
    """Before any work: queries and passages are cut to these lengths, which must fit the model's positions."""
    for flag in ("query_len", "passage_len"):
        if getattr(c, flag) > max_position:
            raise ValueError(f"--{flag} {getattr(c, flag)} is more than the {max_position} positions of the "
                             f"model{f' {model}' if model else ''} (max_position)")


def default_out_dir(c):
    if c.out_dir:
        return Path(c.out_dir)
    if c.bm25:
        name = Path(c.corpus).parent.name if c.corpus else Path(c.dataset).name
        return Path("runs") / f"bm25-{name}-{c.split}"
    if not Path(c.model).is_dir():   # 'minilm' or a hub id: never write into a package or the hub cache
        return Path("runs") / f"eval-{c.model.replace('/', '--')}-{c.split}"
    return Path(c.model).resolve().parent / f"eval-{c.split}"


def load_qrels_only(c):
    """--qrels, else {data}/qrels/{split}.tsv (or .tsv.gz)."""
    if c.qrels:
        return data.read_qrels(c.qrels)
    path = Path(c.dataset) / "qrels" / f"{c.split}.tsv"
    return data.read_qrels(path if path.is_file() or not path.with_suffix(".tsv.gz").is_file()
                           else path.with_suffix(".tsv.gz"))


def compare_command(c):
    """--compare A,B: per-metric means and paired t-tests over the judged queries both runs have (at least 2)."""
    paths = [p for p in c.compare.split(",") if p]
    if len(paths) != 2:
        raise ValueError(f"--compare expects two run files 'A.trec,B.trec', got {c.compare!r}")
    qrels = load_qrels_only(c)
    run_a, run_b = (read_run(p) for p in paths)
    in_a, in_b = set(run_a) & set(qrels), set(run_b) & set(qrels)          # the judged queries of each run
    shared = in_a & in_b
    if len(shared) < 2:
        raise data.DataError(f"--compare: {paths[0]} and {paths[1]} have {len(shared)} judged "
                             f"quer{'y' if len(shared) == 1 else 'ies'} in common (of {len(in_a)} and {len(in_b)}); "
                             f"a paired t-test needs at least 2")
    (_, a), (_, b) = (compute_metrics(run, {q: qrels[q] for q in sorted(shared)}) for run in (run_a, run_b))
    tests = compare_per_query(a, b)
    print(f"A = {paths[0]}\nB = {paths[1]}\n{len(a)} queries, paired two-tailed t-test")
    if len(shared) < len(qrels):
        print(f"left out: {len(in_a - shared)} judged queries that only A has, {len(in_b - shared)} that only B has, "
              f"{len(set(qrels) - in_a - in_b)} that neither has")
    print(f"{'metric':<12} {'A':>8} {'B':>8} {'t':>8} {'p':>8}")
    for m, r in tests.items():
        print(f"{m:<12} {r['mean_a']:>8.4f} {r['mean_b']:>8.4f} {r['t']:>8.3f} {r['p']:>8.4f}")
    return tests


def main(c):
    names = split_names(c)
    if c.compare:
        return compare_command(c)
    if not c.bm25 and not c.model:
        raise ValueError("give --model FOLDER (a saved encoder) or --bm25")
    if c.bm25 and c.vocab:
        raise ValueError(f"--vocab {c.vocab} is not used by --bm25 (it splits words itself); drop --vocab")
    if c.model:
        model_list(c)   # one model: several go with research.mechanisms' figures and measurements
    rank, _, device = setup_distributed()
    out_dirs = [split_out_dir(c, name, len(names) > 1) for name in names]   # before 'minilm' becomes a folder
    new = sorted({p for f in out_dirs for p in (f, *f.absolute().parents) if not p.exists()}, key=lambda p: -len(p.parts))
    try:
        hold_out_dirs(out_dirs)
        return run_commands(c, names, out_dirs, rank, device)
    finally:
        for folder in out_dirs:
            run.folders.release_run_folder(folder)
        for folder in new if rank == 0 else []:    # a refused run leaves no folder it made (deepest first;
            with contextlib.suppress(OSError):     # one with files in it stays)
                folder.rmdir()


def hold_out_dirs(folders):
    """evaluate.py never writes where a live run does: refused in one line when an output folder, or the one that
    holds it (eval-{split}/ is inside the model's run folder), is held by another run; else each is locked."""
    for folder in folders:
        run.folders.check_writable(folder)
        above = Path(folder).resolve().parent
        if run.folders.held_by_another_run(above):
            raise data.DataError(f"{above} is in use by another run, and {folder} is inside it; wait for it to "
                                 f"end, or give another --out_dir")
        run.folders.lock_run_folder(folder, create=True)


def run_commands(c, names, out_dirs, rank, device):
    """main's work, in the folders it holds: the evaluation of --model or --bm25 on each split."""
    tag = c.tag or (Path(c.model).resolve().parent.name if Path(c.model).is_dir() else c.model)
    c = resolve_retriever(dataclasses.replace(c, model=run.hub.resolve_model(c.model)))    # 'minilm', a hub id -> a folder
    splits = [(*load_eval_split(c, name), out) for name, out in zip(names, out_dirs)]
    if c.bm25:
        if rank != 0:
            return None
        results = []
        for name, (corpus, queries, qrels, out) in zip(names, splits):
            results.append(evaluate_bm25(corpus, queries, qrels, out, c.k1, c.b, c.depth))
            print(format_table({f"BM25 (k1={c.k1}, b={c.b})": results[-1]}, title=f"{name}: {len(results[-1][1])} queries"))
    else:
        encoder, tokenizer = load_model(c, device)
        if len(names) == 1:
            results = [evaluate_encoder(encoder, tokenizer, *splits[0], c, device, tag, c.depth)]
        else:
            results = evaluate_splits(encoder, tokenizer, splits, c, device, tag, c.depth)
    return results[0] if len(names) == 1 else dict(zip(names, results))


def model_list(c, several=False):
    """--model and --tag as [(model, tag)]: one model when the whole is a path that exists, else comma-separated
    (several: research.mechanisms). No --tag: each folder's parent name or the model id; the paths where those clash."""
    models = [c.model] if Path(c.model).exists() else [m.strip() for m in c.model.split(",") if m.strip()]
    if len(models) > 1 and not several:
        raise ValueError(f"--model {c.model}: several models go with --tsne or --cls_by_length (or --word_shares, "
                         f"--decoder_reliance, --discrimination, --heads) of research.mechanisms only")
    names = [Path(m).resolve().parent.name if Path(m).is_dir() else m for m in models]
    tags = c.tag.split(",") if c.tag else names if len(set(names)) == len(names) else models
    if len(tags) != len(models) or len(set(tags)) < len(tags):
        raise ValueError(f"--tag {c.tag!r}: give one tag per model of --model ({len(models)}), all different")
    return list(zip(models, tags))


def model_settings(c, model, tag):
    """c for one model: its folder ('minilm' or a hub id resolved), its tag, pooling, similarity, lengths."""
    return resolve_retriever(dataclasses.replace(c, model=run.hub.resolve_model(model), tag=tag))


def load_model(c, device):
    """(encoder, tokenizer) of c.model, checked against c's lengths and its vocabulary's size."""
    encoder = load_encoder(c.model).to(device)
    check_lengths(c, encoder.config.max_position, c.model)
    vocab = resolve_vocab(c)
    if Path(vocab).is_file() and data.vocab_size_of(vocab) != encoder.config.vocab_size:   # (missing: load_tokenizer)
        raise data.DataError(f"{vocab}: {data.vocab_size_of(vocab)} entries, but the model {c.model} has vocab_size "
                             f"{encoder.config.vocab_size}")
    run.hub.check_vocab(vocab, c.model)          # each token once, and the one the model folder records
    return encoder, data.load_tokenizer(vocab)


def split_names(c, one_split=("corpus", "compare")):
    """--split as a list. Several (dev,test) share one corpus encoding (BEIR only), not with one_split's flags."""
    names = [s.strip() for s in c.split.split(",") if s.strip()]
    if not names:
        raise ValueError("--split: give a split (test) or several, comma-separated (dev,test)")
    several = len(names) > 1
    for flag in one_split:
        if several and getattr(c, flag):
            raise ValueError(f"--split {c.split}: several splits need the BEIR folder (--dataset) and cannot "
                             f"go with --{flag}; give one split")
    return names


def split_out_dir(c, split, several):
    """One split: --out_dir, else default_out_dir. Several: split s goes to {out_dir}/eval-{s}, else to its default."""
    if several and c.out_dir:
        return Path(c.out_dir) / f"eval-{split}"
    return default_out_dir(dataclasses.replace(c, split=split))


def load_eval_split(c, split):
    """(corpus, queries, qrels) of one split; "dev" with --dev_queries is the sample finetune.py held out."""
    if split == "dev" and c.dev_queries:
        corpus, queries, qrels = load_split(c, "train", c.queries, c.qrels)
        qrels = carve_dev(qrels, c.dev_queries)[1]
        return corpus, {q: queries[q] for q in qrels}, qrels
    return load_split(c, split, c.queries, c.qrels)


# ==============================================================================================
# Shared blocks: the BERT encoder, distributed helpers and bf16 autocast, byte-identical in every
# file that has them (a test checks); read them once in costa.py
# ==============================================================================================
# --- shared: begin encoder ---
class Embeddings(nn.Module):
    """Token + learned absolute position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, c):
        super().__init__()
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_position, c.hidden_size)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = c.dropout

    def forward(self, input_ids):                                               # (B, L)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)   # (L,)
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]  # (B, L, H)
        return F.dropout(self.norm(x), self.dropout, self.training)


def attention(q, k, v, attend, p=0.0):
    """softmax(q k^T / sqrt(d)) v per head, dropout p on the probabilities. q, k, v (B, heads, L, d); attend
    (B, 1, 1, L) or (L, L), True = key visible."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5            # (B, heads, L, L) fp32 softmax
    scores = scores.masked_fill(~attend, torch.finfo(torch.float32).min)        # a hidden key gets weight 0
    probs = F.dropout(scores.softmax(-1), p, training=p > 0)                     # (B, heads, L, L)
    return probs.to(v.dtype) @ v                                                 # (B, heads, L, d)


class SelfAttention(nn.Module):
    """Multi-head self-attention, BERT's: projections, attention() per head, output projection."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.dropout = c.num_heads, c.dropout
        self.query, self.key, self.value, self.out = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(4))

    def forward(self, x, attend):                       # x (B, L, H); attend (B, 1, 1, L) True = key visible
        B, L, H = x.shape
        split = lambda t: t.view(B, L, self.heads, H // self.heads).transpose(1, 2)  # (B, heads, L, H/heads)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        y = attention(q, k, v, attend, self.dropout if self.training else 0.0)      # (B, heads, L, H/heads)
        return self.out(y.transpose(1, 2).reshape(B, L, H))                      # (B, L, H)


class Block(nn.Module):
    """Post-LN Transformer block, as in BERT: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, c):
        super().__init__()
        self.attn = SelfAttention(c)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.ffn_in = nn.Linear(c.hidden_size, c.ffn_size)
        self.ffn_out = nn.Linear(c.ffn_size, c.hidden_size)
        self.ffn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = c.dropout

    def forward(self, x, attend):                                                    # (B, L, H)
        x = self.attn_norm(x + F.dropout(self.attn(x, attend), self.dropout, self.training))
        ffn = self.ffn_out(F.gelu(self.ffn_in(x)))                                   # (B, L, H)
        return self.ffn_norm(x + F.dropout(ffn, self.dropout, self.training))        # (B, L, H)


class MLMHead(nn.Module):
    """BERT's MLM head: dense, GELU, LayerNorm, then the token embedding matrix (tied) plus a bias."""

    def __init__(self, c, word_embedding):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.word_embedding = [word_embedding]  # a list, so the tied matrix is not registered twice

    def forward(self, h):                                                        # (M, H)
        h = self.norm(F.gelu(self.dense(h)))                                     # (M, H)
        return h @ self.word_embedding[0].weight.T + self.bias                   # (M, V)


class Encoder(nn.Module):
    """BERT: embeddings, N post-LN blocks, an MLM head tied to the input embeddings; no pooler. forward returns
    the last hidden states. As a Hugging Face BERT folder: load_pretrained and save_pretrained in run/hub.py.
    """

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.mlm_head = MLMHead(c, self.embeddings.word)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids, attention_mask):                  # (B, L), (B, L) 1 = token, 0 = pad
        attend = attention_mask.bool()[:, None, None, :]            # (B, 1, 1, L)
        x = self.embeddings(input_ids)                              # (B, L, H)
        for block in self.blocks:
            x = block(x, attend)
        return x                                                    # (B, L, H)
# --- shared: end encoder ---


# --- shared: begin distributed ---
def setup_distributed(timeout_s=600.0):
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK: one process per device, NCCL on GPUs, gloo on CPU; plain
    `python x.py` runs one. A rank that waits timeout_s at a collective ends the job. -> (rank, world, device)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "nccl" and local_world > torch.cuda.device_count():
        raise ValueError(f"torchrun --nproc_per_node={local_world}, but this machine has {torch.cuda.device_count()} "
                         f"GPU(s): one process per GPU (CUDA_VISIBLE_DEVICES= runs every process on the CPU)")
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None,   # NCCL bound to its GPU
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def rank_and_world():
    """(global rank, world size); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GatherWithGrad(torch.autograd.Function):
    """all_gather that keeps gradients: every rank's loss used this rank's vectors as candidates, so backward
    hands each rank the sum over ranks of the gradient of its own slice (equal sizes on every rank)."""

    @staticmethod
    def forward(ctx, t):                                                  # (n, ...)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=0)                                    # (world * n, ...)

    @staticmethod
    def backward(ctx, grad):                                              # (world * n, ...)
        grad = grad.contiguous()
        dist.all_reduce(grad)                                             # sum over every rank's loss
        return grad.chunk(dist.get_world_size(), dim=0)[dist.get_rank()]  # (n, ...)


def gather_across_ranks(t):
    """Concatenate `t` from every rank along dim 0, keeping the autograd graph (candidates)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    return GatherWithGrad.apply(t.contiguous())
# --- shared: end distributed ---


if __name__ == "__main__":
    run.cli.run_command_line(lambda: main(run.cli.parse_config(Config, sys.argv[1:], __doc__, rules=FLAG_RULES)),
                         interrupted="interrupted; run it again to evaluate")
