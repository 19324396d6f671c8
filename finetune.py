"""Fine-tune a pre-trained encoder into a dense retriever, as the papers do (COSTA 4.5.2, CPDAE 4.1.3,
SEED-Encoder 4.2): a bi-encoder with ONE shared BERT, softmax over the positive, its sampled negatives and
every other passage of the global batch (CPDAE 4.1.3's pairwise loss: --loss hinge). The papers use [CLS]
and a dot product; a sentence-transformers starting point (--init minilm) brings its mean pooling and cosine.
Top to bottom: config, model, loss, data, mining (through evaluate.py, the retrieval layer, which has the
shared encoder), training loop, checkpoint, pipeline.

    python finetune.py --pretrain costa                   # the quick start: minilm zero-shot, fine-tuned, + costa
    python finetune.py --init runs/costa/encoder          # stage 1 (BM25 negatives), test metrics
    python finetune.py --init X --rounds 1                # then one stage of mined hard negatives (papers' passages)
    python finetune.py --init X --rounds 2                # mine twice after the BM25 stage
    python finetune.py --init PASSAGE_MODEL --epochs 0 --rounds 2 --hard_epochs 1   # the document-ranking recipe
    python finetune.py --init X --n_queries 100 --seed 1  # low-resource setting: 100 random training queries
    torchrun --nproc_per_node=4 finetune.py --preset paper --init bert-base-uncased
    python finetune.py --init X --resume                  # continue where a killed run stopped
    python finetune.py --init X --overwrite               # start again in an out_dir that holds a run (else refused)

Stage 1: each epoch, every query's negatives are sampled from BM25's top `bm25_depth` minus its positives
(`--epochs 0` skips it: COSTA and CPDAE fine-tune documents from the passage-tuned model, mining twice);
--bm25_negatives reads the rankings instead (MS MARCO: Tevatron's file; its queries without a line are dropped).
Stage 2 (`rounds` times): hard negatives mined ONCE per round from the current model (top `hard_depth`, the
first `hard_skip` skipped, positives removed), trained with a fresh optimizer and warm-up (Tevatron's recipe).
--preset paper: the papers' recipe (docs/paper-scale.md's table), 64 queries a step over all ranks whatever their
number (--global_batch; --batch_size is per rank). The corpus is tokenized once into a passage cache that every rank
and loader worker maps (run/passages.py). Outputs in out_dir: stage1/, stage2/, ... (encoder/, state.pt, log.jsonl,
config.json each), the negatives files, the final encoder/ and eval-{split}/ (see evaluate.py).
"""
import contextlib
import dataclasses
import importlib
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import evaluate  # the retrieval layer: BM25, encode, exact search, metrics
import run
from evaluate import Encoder, gather_across_ranks, rank_and_world, setup_distributed  # the shared encoder


# ==============================================================================================
# Config
# ==============================================================================================
@dataclass
class Config:
    # --- data
    dataset: str = str(data.SCIFACT)  # BEIR folder: corpus.jsonl, queries.jsonl, qrels/{split}.tsv ('.gz' ok)
    corpus: str = ""              # explicit corpus (BEIR .jsonl or MS MARCO collection.tsv); overrides dataset
    queries: str = ""             # explicit training queries (.jsonl or .tsv); overrides dataset
    qrels: str = ""               # explicit training qrels (BEIR .tsv or TREC qrels); overrides dataset
    eval_queries: str = ""        # explicit evaluation queries (with corpus/queries/qrels)
    eval_qrels: str = ""          # explicit evaluation qrels; "" with explicit files = no evaluation
    train_split: str = "train"    # qrels/{train_split}.tsv: training queries and their positives
    eval_split: str = "test"      # evaluated at the end with evaluate.py's metrics ("" = skip)
    vocab: str = str(data.VOCAB)  # WordPiece vocab.txt; not given: the init folder's if it has one, else this
    query_len: int = 64           # query tokens incl. [CLS]/[SEP] (papers: 32 for MS MARCO; SciFact's claims reach 62)
    passage_len: int = 128        # passage tokens incl. [CLS]/[SEP] (papers: 128; documents 512)
    n_queries: int = 0            # low-resource setting: train on this many random training queries (0 = all)
    dev_queries: int = 0          # hold out this many training queries as split "dev" (a fixed sample, evaluate.carve_dev): never trained on, evaluated at the end (eval-dev/)
    # --- model (sizes come from the init folder; these are for --init "")
    init: str = "minilm"          # a BERT folder, a hub id, or "minilm" (offline all-MiniLM-L6-v2); "" = random init
    pooling: str = ""             # text vector: "cls" (the papers) or "mean"; "" = what init declares, else "cls"
    similarity: str = ""          # "dot" (the papers) or "cos" (sentence-transformers); "" = what init declares, else "dot"
    tau: float = 0.05             # softmax temperature with "cos" (sentence-transformers' scale 20); "dot" uses none
    vocab_size: int = 30522       # rows of the token embedding; must match the vocab file
    hidden_size: int = 256        # H (paper: 768)
    num_layers: int = 4           # Transformer blocks (paper: 12)
    num_heads: int = 4            # attention heads (paper: 12)
    ffn_size: int = 1024          # feed-forward inner size (paper: 3072)
    max_position: int = 512       # learned absolute positions
    type_vocab_size: int = 2      # token types (all 0 here; kept for BERT checkpoint compatibility)
    dropout: float = 0.1          # hidden and attention dropout
    layer_norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    # --- pipeline
    pretrain: str = ""            # "costa", "seed" or "cpdae": init zero-shot, continued pre-training, fine-tune, table vs BM25
    pretrain_steps: int = 50      # continued pre-training steps on the corpus (at 5e-5, batch 32 x 128 tokens)
    pretrain_args: str = ""       # more options for the pre-training script, e.g. "--batch_size 16 --gwc_weight 0"
    baseline: bool = True         # the pipeline also fine-tunes init without continued pre-training (one more row)
    # --- loss
    loss: str = "softmax"         # "softmax" (CE over positive + negatives + in-batch) or "hinge" (SEED's relu(1 - (s+ - s-)))
    n_negatives: int = 1          # sampled negatives per query, besides the in-batch ones (papers: 7)
    # --- negatives
    bm25_depth: int = 100         # stage 1 samples negatives from BM25's top-k minus the positives
    bm25_negatives: str = ""      # negatives to use instead of computing BM25: TSV 'qid<TAB>docid,docid,...' in ranking order (Tevatron's MS MARCO file: random order), or a TREC run file (ranked by score)
    missing_negatives: str = "drop"  # training queries with no line in --bm25_negatives: "drop" them (Tevatron's training set is the file's lines; one line counts them) or fill them from "bm25" over the corpus
    k1: float = 1.2               # BM25 term-frequency saturation (Elasticsearch / BEIR)
    b: float = 0.75               # BM25 document-length normalisation
    rounds: int = 0               # hard-negative rounds after stage 1 (papers: passages 1, documents 2; 0 = BM25 only)
    # (--epochs 0 skips stage 1: the document-ranking recipe starts mining from a passage-tuned --init)
    hard_depth: int = 200         # hard negatives come from the model's top-k minus the positives
    hard_skip: int = 0            # skip the first ranks of that list (likely unlabelled positives)
    # --- optimisation
    epochs: float = 2.0           # stage-1 epochs over the training queries (papers: 3)
    hard_epochs: float = 1.0      # epochs of each hard-negative round (papers: 2-3 passages, 1 documents)
    steps: int = 0                # optimizer steps per stage; 0 = from epochs (set per stage, then saved)
    batch_size: int = 32          # queries per rank per micro-step, each with 1 + n_negatives passages; set by --global_batch when that is > 0
    global_batch: int = 0         # > 0: queries per optimizer step over all ranks (papers: 64), whatever the process count: batch_size = global_batch / (ranks x grad_accum), or one error if it does not divide
    grad_accum: int = 1           # micro-steps per optimizer step (adds NO in-batch negatives: those come from one micro-step)
    lr: float = 1e-4              # peak learning rate (papers: 5e-6 from BERT-base; MiniLM on SciFact: measured best of 2e-5, 5e-5, 1e-4)
    weight_decay: float = 0.01    # AdamW weight decay (not on biases and LayerNorm; papers: Adam, so 0 under --preset paper)
    warmup: float = 0.1           # fraction of steps of linear warm-up, then linear decay to 0 (papers: 10%)
    clip: float = 1.0             # max gradient norm
    seed: int = 0                 # query sample, data order, negative sampling, random init
    bf16: bool = True             # bf16 autocast on GPU and on CPUs with native bf16 (AVX512-BF16, AMX); scores and losses in fp32
    workers: int = 0              # data-loader worker processes building batches
    encode_batch: int = 128       # texts per forward pass when encoding a corpus
    index: str = "Flat"           # faiss index_factory string for dense search: "Flat" = exact; "HNSW32", "IVF256,PQ32", ...
    nprobe: int = 0               # IVF indexes: inverted lists visited per query (0 = faiss's default, 1)
    ef_search: int = 0            # HNSW indexes: candidate list size per query (0 = faiss's default, 16)
    index_train: int = 100000     # corpus vectors sampled to train an index that needs it (IVF, PQ)
    vectors_dir: str = ""         # folder for the corpus vectors as fp16 .npy memmaps, one per rank, searched in chunks; "" = float32 in memory
    cache_dir: str = ""           # where the corpus's passage cache goes (tokenized once, mapped by every rank); "" = next to the corpus
    # --- bookkeeping
    out_dir: str = "runs/finetune"  # stages, negatives, final encoder/ and eval-{split}/ go here
    log_every: int = 10           # steps between progress lines
    save_every: int = 100         # steps between checkpoints (and one at the end of each stage)
    resume: bool = False          # continue from the last finished stage / the current stage's state.pt
    overwrite: bool = False       # replace a run already in out_dir (without it or --resume: refused)
    halt_at: int = 0              # stop after this optimizer step (counted across stages) as if killed; 0 = never
    preset: str = ""              # "paper": the papers' fine-tuning hyper-parameters

    # The fields that may differ on --resume (today's value applies from the next step): how and where, not
    # what (run.TrainConfig.RESUMABLE says why). A new field is frozen until it is listed here.
    RESUMABLE: ClassVar[tuple] = ("steps", "epochs", "hard_epochs", "lr", "weight_decay", "warmup", "clip", "bf16",
                                  "workers", "log_every", "save_every", "encode_batch", "preset", "eval_split",
                                  "eval_queries", "eval_qrels", "index", "nprobe", "ef_search", "index_train",
                                  "vectors_dir", "cache_dir", "out_dir")


# COSTA 4.5.2, CPDAE 4.1.3 (docs/paper-scale.md's table, row by row): Adam (no weight decay, Tevatron's default),
# 64 queries a step over all ranks, 7 negatives, 3 epochs on BM25 negatives, one mined round of 2 epochs
PAPER_PRESET = dict(lr=5e-6, weight_decay=0.0, global_batch=64, epochs=3.0, hard_epochs=2.0, n_negatives=7, rounds=1,
                    query_len=32, workers=4, log_every=100, save_every=1000)   # the run's: batches built ahead, checkpoints


# The domain of each numeric or choice flag, checked by run.cli.parse_config before any work.
FLAG_RULES = {
    "query_len": ">= 3", "passage_len": ">= 3", "n_queries": ">= 0", "dev_queries": ">= 0",  # lengths: [CLS], a token, [SEP]
    "vocab_size": ">= 1", "hidden_size": ">= 1", "num_layers": ">= 1", "num_heads": ">= 1", "ffn_size": ">= 1",
    "max_position": ">= 1", "type_vocab_size": ">= 1", "dropout": "in [0, 1)", "layer_norm_eps": "> 0",
    "pretrain_steps": ">= 0", "n_negatives": ">= 0", "bm25_depth": ">= 1", "k1": ">= 0", "b": "in [0, 1]",
    "rounds": ">= 0", "hard_depth": ">= 1", "hard_skip": ">= 0", "epochs": ">= 0", "hard_epochs": "> 0",
    "steps": ">= 0", "batch_size": ">= 1", "global_batch": ">= 0", "grad_accum": ">= 1", "lr": "> 0", "weight_decay": ">= 0",
    "warmup": "in [0, 1]", "clip": "> 0", "workers": ">= 0", "encode_batch": ">= 1", "log_every": ">= 1",
    "nprobe": ">= 0", "ef_search": ">= 0", "index_train": ">= 1",
    "save_every": ">= 1", "halt_at": ">= 0",
    "index": "a faiss index_factory string", "loss": "one of {softmax, hinge}", "missing_negatives": "one of {drop, bm25}",
    "pooling": "one of {cls, mean} or empty", "similarity": "one of {dot, cos} or empty",
    "pretrain": f"one of {{{', '.join(run.METHODS)}}} or empty",
}


# ==============================================================================================
# Model
# ==============================================================================================
# (The BERT encoder itself, Encoder, is evaluate.py's copy of the shared block.)


def retriever_settings(c):
    """c with pooling and similarity: the flags, else what the init folder declares, else the papers' cls and dot."""
    declared = evaluate.read_retriever_settings(c.init) if c.init else {}
    c = dataclasses.replace(c, pooling=c.pooling or declared.get("pooling", "cls"),
                            similarity=c.similarity or declared.get("similarity", "dot"))
    evaluate.check_pooling_and_similarity(c.pooling, c.similarity)
    return c


class BiEncoder(nn.Module):
    """One shared encoder for queries and passages; relevance: the pooled vectors' dot product (cosine: / tau)."""

    def __init__(self, encoder, c):
        super().__init__()
        self.encoder, self.pooling, self.loss_fn = encoder, c.pooling, loss_function(c.loss)
        self.similarity, self.tau = c.similarity, c.tau if c.similarity == "cos" else 1.0

    def encode(self, ids, mask):                                                   # (B, L)
        return evaluate.text_vectors(self.encoder(ids, mask), mask, self.pooling, self.similarity)  # (B, H)

    def forward(self, batch):
        """batch: q_ids/q_mask (B, Lq); p_ids/p_mask (B*(1+n), Lp), query i's passages at rows
        i*(1+n) .. i*(1+n)+n, positive first; p_doc (B*(1+n),) corpus index of each passage;
        q_pos (B, P) corpus indices of each query's positives (-1 = padding)."""
        q = self.encode(batch["q_ids"], batch["q_mask"])                           # (B, H)
        p = self.encode(batch["p_ids"], batch["p_mask"])                           # (B*(1+n), H)
        rank, _ = rank_and_world()
        p_all = gather_across_ranks(p)                                             # (N, H) global candidates
        doc_all = gather_across_ranks(batch["p_doc"])                              # (N,)
        per_query = p.shape[0] // q.shape[0]                                       # 1 + n
        labels = rank * p.shape[0] + torch.arange(q.shape[0], device=q.device) * per_query  # (B,)
        exclude = other_positives(doc_all, batch["q_pos"], labels)                 # (B, N)
        loss, scores = self.loss_fn(q, p_all, labels, exclude, self.tau)
        accuracy = (scores.argmax(1) == labels).float().mean()
        return loss, {"loss": loss.detach(), "acc": accuracy.detach()}


# ==============================================================================================
# Loss
# ==============================================================================================
LOSSES = ("softmax", "hinge")


def loss_function(name):
    """The loss --loss names; the one place where --loss is checked."""
    if name not in LOSSES:
        raise ValueError(f"--loss must be softmax or hinge, got {name!r}")
    return softmax_loss if name == "softmax" else hinge_loss


def other_positives(candidate_docs, query_positives, labels):
    """(B, N) True where candidate j is a known positive of query i other than its target (queries can share one):
    not a negative. candidate_docs (N,) corpus indices; query_positives (B, P) padded with -1; labels (B,)."""
    same = (candidate_docs[None, :, None] == query_positives[:, None, :]).any(-1)  # (B, N)
    target = F.one_hot(labels, candidate_docs.shape[0]).bool()                     # (B, N)
    return same & ~target


def softmax_loss(q, p, labels, exclude=None, tau=1.0):
    """Contrastive cross-entropy of dense retrieval (DPR; Tevatron's loss; COSTA 4.5.2 gives no
    equation). The default. Departure (finetune-softmax): CPDAE 4.1.3 fine-tunes with a pairwise loss (--loss hinge).
        L = -1/B sum_i log( exp(q_i . p_i+ / tau) / sum_j exp(q_i . p_j / tau) ),
    j over the global batch's passages: the query's positive, its own negatives and every other
    query's passages. The papers: dot product, tau = 1; cosine needs a small tau (sentence-transformers': 0.05).
    q (B, H) local anchors; p (N, H) candidates from every rank; labels (B,) global index of the positive;
    exclude (B, N) True = not in the denominator (other known positives). -> (loss, fp32 scores (B, N))."""
    with torch.autocast(q.device.type, enabled=False):   # fp32 scores even under bf16 autocast
        scores = q.float() @ p.float().T / tau                                     # (B, N)
    if exclude is not None:
        scores = scores.masked_fill(exclude, float("-inf"))                        # (B, N)
    return F.cross_entropy(scores, labels), scores


def hinge_loss(q, p, labels, exclude=None, tau=1.0, margin=1.0):
    """SEED-Encoder 4.2 (unnumbered equation), and the pairwise loss of CPDAE 4.1.3 (which gives no
    equation): L = sum relu(1 - (s(q, d+) - s(q, d-))) over triples.
    Here: mean over each query's negatives (its own and the batch's), then over queries (the paper sums; a mean
    keeps the lr independent of the batch size). softmax_loss's arguments and returns; tau unused."""
    with torch.autocast(q.device.type, enabled=False):   # fp32 scores even under bf16 autocast
        scores = q.float() @ p.float().T                                           # (B, N)
    positive = scores.gather(1, labels[:, None])                                   # (B, 1)
    negative = ~F.one_hot(labels, p.shape[0]).bool()                               # (B, N)
    if exclude is not None:
        negative = negative & ~exclude                                             # (B, N)
    hinge = F.relu(margin - (positive - scores)) * negative                        # (B, N)
    loss = (hinge.sum(1) / negative.sum(1).clamp(min=1)).mean()                    # ()
    return loss, scores.masked_fill(exclude, float("-inf")) if exclude is not None else scores


# ==============================================================================================
# Data: training examples, negatives, batches
# ==============================================================================================


class Example(NamedTuple):
    qid: str
    query: str
    positives: list   # corpus indices, grade > 0
    negatives: list   # corpus indices to sample negatives from (never a positive)


def make_examples(queries, qrels, doc_index, n_queries=0, seed=0):
    """Training examples, one per query with a relevant document; n_queries > 0: a seeded sample (low-resource)."""
    examples = [Example(q, queries[q], [doc_index[d] for d, g in qrels[q].items() if g > 0], [])
                for q in sorted(qrels) if any(g > 0 for g in qrels[q].values())]
    if n_queries:
        if n_queries > len(examples):
            raise data.DataError(f"--n_queries {n_queries}: only {len(examples)} training queries have a positive")
        keep = np.sort(np.random.default_rng(seed).choice(len(examples), n_queries, replace=False))
        examples = [examples[i] for i in keep]
    return examples


def negatives_from_ranking(ranked, positives, skip=0):
    """A query's candidate negatives: its ranking after the first `skip`, positives and repeats removed, in order."""
    positives = set(positives)
    return [d for d in dict.fromkeys(int(d) for d in ranked[skip:]) if d >= 0 and d not in positives]


def sample_negatives(pool, positives, n, n_docs, rng):
    """n negatives from a query's pool, without replacement; a short pool topped up with random non-positives."""
    if len(pool) >= n:
        return [int(pool[i]) for i in rng.choice(len(pool), n, replace=False)]
    out, positives = list(pool), set(positives)
    while len(out) < n:
        d = int(rng.integers(n_docs))
        if d not in positives or len(positives) >= n_docs:
            out.append(d)
    return out


class TrainBatches(torch.utils.data.Dataset):
    """Item m is this rank's batch at micro-step m, a pure function of (seed, rank, m): each epoch draws a fresh
    positive and fresh negatives per query; a resumed run sees exactly the same batches. doc_texts: the corpus's
    passage cache (run/passages.py: the passages read as tokenized, in whichever loader worker), or its texts."""

    def __init__(self, c, examples, doc_texts, tokenizer, rank, world):
        self.c, self.examples, self.doc_texts, self.tokenizer = c, examples, doc_texts, tokenizer
        self.rank, self.world = rank, world
        self.per_epoch = data.batches_per_epoch(len(examples), c.batch_size, world)

    def __len__(self):
        return self.c.steps * self.c.grad_accum

    def __getitem__(self, micro_step):
        c = self.c
        rows = data.batch_indices(len(self.examples), c.batch_size, self.rank, self.world, c.seed, micro_step)
        epoch = micro_step // self.per_epoch
        docs, queries = [], []
        for i in rows:
            ex = self.examples[i]
            rng = np.random.default_rng([c.seed, epoch, i])
            positive = int(ex.positives[rng.integers(len(ex.positives))])
            docs += [positive] + sample_negatives(ex.negatives, ex.positives, c.n_negatives, len(self.doc_texts), rng)
            queries.append(ex.query)
        q_ids, q_mask = data.encode_texts(self.tokenizer, queries, c.query_len)          # (B, Lq)
        p_ids, p_mask = evaluate.passage_batch(self.doc_texts, docs, self.tokenizer, c.passage_len)  # (B*(1+n), Lp)
        width = max(len(self.examples[i].positives) for i in rows)
        q_pos = torch.full((len(rows), width), -1, dtype=torch.long)                    # (B, P)
        for r, i in enumerate(rows):
            q_pos[r, :len(self.examples[i].positives)] = torch.tensor(self.examples[i].positives)
        return {"q_ids": q_ids, "q_mask": q_mask, "p_ids": p_ids, "p_mask": p_mask,
                "p_doc": torch.tensor(docs, dtype=torch.long), "q_pos": q_pos}


def read_negatives(path, doc_index, depth=0):
    """{qid: (k,) int64 corpus indices}, each query's first `depth` (0: all) in the file's ranking order: a TSV
    'qid<TAB>docid,docid,...' as listed (this script writes them best first; Tevatron's MS MARCO file lists BM25's top
    1,000 in random order), or a TREC run file 'qid Q0 docid rank score tag' by score, best first (trec_eval's)."""
    if _is_run_file(path):
        lines = ((None, q, [d for d, _ in evaluate.trec_order(docs)]) for q, docs in evaluate.read_run(path).items())
    else:
        lines = ((number, qid, [d for d in docids.split(",") if d]) for number, (qid, docids) in data.iter_tsv(path, 2))
    out = {}
    for number, qid, docids in lines:
        where = f"{path}:{number}" if number else f"{path} (query {qid!r})"
        try:
            rows = _rows(doc_index, docids[:depth or None])
        except KeyError as e:
            raise data.DataError(f"{where}: document id {e.args[0]!r} is not in the corpus") from None
        data.add_once(out, qid, rows, path, number, f"query id {qid!r}")
    return out


def _is_run_file(path):
    """A TREC run file's lines have 6 fields ('qid Q0 docid rank score tag'); a negatives TSV's have 2."""
    return len(next((line for _, line in data.read_lines(path) if line.strip()), "").split()) == 6


def _rows(doc_index, docids):
    """(k,) int64 corpus indices of these doc ids: a passage cache's index looks them up at once (run/passages.py)."""
    if isinstance(doc_index, run.passages.DocIndex):
        return doc_index.rows(docids)
    return np.array([doc_index[d] for d in docids], dtype=np.int64)


def write_negatives(path, negatives, doc_ids):
    """Atomic TSV 'qid<TAB>docid,docid,...' of {qid: [corpus index]}."""
    run.files.atomic_write_text(path, "".join(f"{q}\t{','.join(doc_ids[d] for d in negs)}\n"
                                         for q, negs in negatives.items()))


# ==============================================================================================
# Mining: negatives from BM25 and from the current model (evaluate.py's retrieval layer)
# ==============================================================================================
def bm25_negative_pools(c, examples, doc_texts, doc_ids, doc_index, path, device, is_rank0):
    """Stage-1 pools: BM25's top bm25_depth for each training query minus its positives. --bm25_negatives reads the
    rankings instead (MS MARCO: Tevatron's), and the queries it has no line for are dropped, as Tevatron trains on the
    file's lines (--missing_negatives drop; one line counts them), or searched with BM25 (bm25). Returns the
    examples that train, each with its pool."""
    ranked, search = {}, examples
    if c.bm25_negatives:
        ranked = read_negatives(c.bm25_negatives, doc_index, c.bm25_depth)
        search = [ex for ex in examples if ex.qid not in ranked]
        say_missing_negatives(c, search, len(examples), is_rank0)
        if c.missing_negatives == "drop":
            examples, search = [ex for ex in examples if ex.qid in ranked], []
    if search:
        ranked.update(bm25_rankings(c, search, doc_texts, doc_ids, doc_index, path, device, is_rank0))
    return [ex._replace(negatives=negative_pool(ranked.get(ex.qid, [])[:c.bm25_depth], ex.positives)) for ex in examples]


def say_missing_negatives(c, missing, n_examples, is_rank0):
    """One line: how many training queries --bm25_negatives has no line for, and what becomes of them."""
    if len(missing) == n_examples and c.missing_negatives == "drop":
        raise data.DataError(f"{c.bm25_negatives}: no line for any of the {n_examples} training queries (are its query "
                             f"ids those of --qrels?); --missing_negatives bm25 searches BM25 for them")
    if missing and is_rank0:
        fate = ("their negatives come from BM25 over the corpus (--missing_negatives bm25)" if c.missing_negatives ==
                "bm25" else "left out of training, as Tevatron does (--missing_negatives bm25 searches BM25 for them)")
        print(f"negatives: {len(missing):,} of {n_examples:,} training queries have no line in {c.bm25_negatives}; "
              f"{fate}", flush=True)


def bm25_rankings(c, examples, doc_texts, doc_ids, doc_index, path, device, is_rank0):
    """{qid: corpus indices}: BM25's top bm25_depth for these queries. Every rank searches its share of them, exchanged
    through files (run.ranks.share_through_files); rank 0 caches them in `path` for --resume. BM25 indexes the texts
    (a passage cache streams them from the corpus file)."""
    if run.ranks.broadcast_rank0_choice(c.resume and path.is_file(), device):
        return read_negatives(path, doc_index)
    rank, world = rank_and_world()
    tag = run.ranks.broadcast_rank0_int(int(time.time() * 1000) % 2**40, device)   # this run's part files
    t0 = time.time()
    mine = [examples[i] for i in data.shard(len(examples), rank, world)]
    texts = doc_texts.texts() if isinstance(doc_texts, run.passages.Passages) else doc_texts
    _, ids = evaluate.BM25(texts, c.k1, c.b).search([ex.query for ex in mine], c.bm25_depth)
    ranked = {ex.qid: row.tolist() for ex, row in zip(mine, ids)}
    if world > 1:
        ranked = run.ranks.share_through_files(path, ranked, tag, 2 * (time.time() - t0) + 600)
    if is_rank0:
        write_negatives(path, ranked, doc_ids)
    return ranked


def negative_pool(ranked, positives, skip=0):
    """A query's pool (negatives_from_ranking) as an int32 array: 4 bytes an entry, where a list takes about 36."""
    return np.array(negatives_from_ranking(ranked, positives, skip), dtype=np.int32)


def hard_negative_pools(c, encoder, tokenizer, examples, doc_texts, doc_ids, doc_index, path, device, is_rank0):
    """Stage-2 pools, mined once from the current model (evaluate.retrieve): its top hard_depth per training query,
    hard_skip skipped, positives removed; rank 0 caches them in `path` for --resume."""
    if run.ranks.broadcast_rank0_choice(c.resume and path.is_file(), device):
        ranked = read_negatives(path, doc_index)
    else:
        t0 = time.time()
        _, ids = evaluate.retrieve(encoder, tokenizer, doc_texts, [ex.query for ex in examples],
                          c.hard_depth, c, device)
        ranked = {ex.qid: row[row >= 0].tolist() for ex, row in zip(examples, ids)}   # -1: fewer found (retrieve says)
        if is_rank0:
            write_negatives(path, ranked, doc_ids)
            print(f"mined: top-{c.hard_depth} of {len(examples)} queries over {len(doc_texts):,} passages "
                  f"in {run.files.format_seconds(time.time() - t0)} -> {path}", flush=True)
    return [ex._replace(negatives=negative_pool(ranked.get(ex.qid, [])[:c.hard_depth], ex.positives, c.hard_skip))
            for ex in examples]


# ==============================================================================================
# Training loop
# ==============================================================================================


def stage_steps(c, n_examples, epochs, world):
    """Optimizer steps of a stage: c.steps when set, else epochs over the training queries."""
    if c.steps:
        return c.steps
    per_epoch = data.batches_per_epoch(n_examples, c.batch_size, world)
    return max(1, round(epochs * per_epoch / c.grad_accum))


def train_stage(c, stage, encoder, examples, doc_texts, tokenizer, device, epochs, is_rank0, step_offset=0):
    """One fine-tuning stage on fixed negative pools, resumable; the trained encoder (also in {stage}/encoder), or
    None when halted (--halt_at counts from the first stage: step_offset = the steps of the stages before)."""
    rank, world = rank_and_world()
    sc = dataclasses.replace(c, out_dir=str(Path(c.out_dir) / stage), vocab=run.run_vocab(c),
                             steps=stage_steps(c, len(examples), epochs, world))
    if run.ranks.broadcast_rank0_choice(c.resume and (Path(sc.out_dir) / "done.json").is_file(), device):
        if is_rank0:
            print(f"{stage}: already finished, loading {Path(sc.out_dir) / 'encoder'}")
        return evaluate.load_encoder(Path(sc.out_dir) / "encoder", c).to(device)
    model = BiEncoder(encoder, c).to(device)
    optimizer, scheduler = run.make_optimizer(model, sc)
    start_step = run.folders.load_checkpoint(sc, model, optimizer, scheduler, is_rank0, {"processes": world}) if c.resume else 0
    global_batch = c.batch_size * world
    if is_rank0:
        Path(sc.out_dir).mkdir(parents=True, exist_ok=True)
        run.folders.write_config(sc.out_dir, sc)
        pools = [len(ex.negatives) for ex in examples]
        print(f"{stage}: {len(examples)} queries | {sc.steps} steps ({sc.steps * global_batch * c.grad_accum / len(examples):.1f} "
              f"epochs) | global batch {global_batch} queries x (1 + {c.n_negatives}) passages | "
              f"negative pools: median {int(np.median(pools))}, min {min(pools)}", flush=True)
        print(f"{stage}: each query sees {global_batch * (1 + c.n_negatives) - 1} negatives: its {c.n_negatives} "
              f"sampled + {(global_batch - 1) * (1 + c.n_negatives)} in-batch (known positives of the query "
              f"are left out of the softmax)", flush=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    batches = run.batches(TrainBatches(sc, examples, doc_texts, tokenizer, rank, world), c.workers,
                          range(start_step * c.grad_accum, sc.steps * c.grad_accum))
    autocast = run.autocast_bf16(device, c.bf16)
    progress = run.Progress(sc, start_step, is_rank0)
    saved, step = start_step, start_step
    model.train()
    with run.folders.stops_cleanly(lambda: (step, saved, sc.out_dir)):    # Ctrl-C, SIGTERM: one line, then --resume
        for step in range(start_step + 1, sc.steps + 1):
            for micro in range(c.grad_accum):
                micro_step = (step_offset + step - 1) * c.grad_accum + micro   # counted across stages
                batch = next(batches)
                n_tokens = int(batch["q_mask"].sum() + batch["p_mask"].sum())
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                # dropout, like the batch, is a function of the step: resume is exact without saving RNG state
                torch.manual_seed(data.step_seed(c.seed, rank, micro_step))
                last = micro == c.grad_accum - 1
                with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():  # DDP syncs on the last
                    with autocast:
                        loss, metrics = ddp(batch)
                    (loss / c.grad_accum).backward()
                progress.add(metrics, n_tokens)
            run.folders.stop_if_not_finite(torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip), step, sc, saved)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % c.log_every == 0 or step == sc.steps:
                progress.report(step, scheduler.get_last_lr()[0], device)
            halt = c.halt_at == step_offset + step
            due = step % c.save_every == 0 or step == sc.steps or halt

            def save(step=step):
                nonlocal saved
                save_checkpoint(sc, model, optimizer, scheduler, step, is_rank0, saved)
                saved = step
            run.folders.checkpoint_or_stop(step, saved, due, c.save_every, save, device)    # SIGTERM: save, then stop
            if halt:
                if is_rank0:
                    print(f"{stage}: halted at step {step} (--halt_at {c.halt_at})")
                return None
    if is_rank0:
        run.files.atomic_write_json(Path(sc.out_dir) / "done.json", {"steps": sc.steps})
        print(f"{stage}: done: {progress.summary(device)}", flush=True)
    run.ranks.barrier()
    return model.encoder


def train(c, name=""):
    """Stage 1 (BM25 negatives), then c.rounds stages of mined hard negatives, then the evaluation.
    name: what the printouts call the starting model ("" = the init folder's parent or the hub id)."""
    rank, world, device = setup_distributed()
    is_rank0 = rank == 0
    torch.manual_seed(c.seed)
    out = Path(c.out_dir)
    loss_function(c.loss)                       # a bad --loss stops here, before any work
    if not c.epochs and not c.rounds:
        raise ValueError("--epochs 0 skips the BM25 stage, so --rounds must be >= 1 (else nothing trains)")
    run.folders.check_run_folder(c, RUN_FILES)
    run.folders.lock_run_folder(c.out_dir)               # one run at a time in a run folder (if it exists yet)
    name = name or (Path(c.init).parent.name if Path(c.init).is_dir() else c.init) or "random init"  # for the printouts
    c = retriever_settings(dataclasses.replace(c, init=run.hub.resolve_model(c.init)))
    c = run.resolve_batch(c, world)             # --global_batch: this rank's batch_size, or one line if it does not divide
    tokenizer = data.load_tokenizer(run.run_vocab(c))
    # The corpus, tokenized once into its passage cache (rank 0) and mapped by every rank and loader worker
    corpus = run.passages.load_passages(corpus_file(c), run.run_vocab(c), rank, c.cache_dir, verbose=is_rank0)
    _, queries, qrels = evaluate.load_split(c, c.train_split, c.queries, c.qrels, corpus)
    qrels, dev_qrels = evaluate.carve_dev(qrels, c.dev_queries) if c.dev_queries else (qrels, {})
    # a bad test file stops the run now, not after training
    test = evaluate.load_split(c, c.eval_split, c.eval_queries, c.eval_qrels, corpus) if evaluates(c) else None
    doc_texts, doc_ids, doc_index = corpus, corpus.doc_ids, corpus.index
    examples = make_examples(queries, qrels, doc_index, c.n_queries, c.seed)
    encoder = evaluate.load_encoder(c.init, c) if c.init else _random_encoder(c)
    if encoder.config.vocab_size != tokenizer.get_vocab_size():
        raise data.DataError(f"{run.run_vocab(c)}: {tokenizer.get_vocab_size()} entries but the encoder "
                             f"has vocab_size {encoder.config.vocab_size}")
    run.hub.check_vocab(run.run_vocab(c), c.init)     # each token once, and the one the --init folder records
    c = encoder.config                          # --init brings the checkpoint's model sizes
    evaluate.new_index(c.index, c.hidden_size)  # an --index these vectors cannot use fails now, not after stage 1
    evaluate.check_lengths(c, c.max_position, c.init)
    encoder = encoder.to(device)
    run.folders.lock_run_folder(out, create=True)       # a new folder is locked as it is made
    if is_rank0:
        run.files.remove_dead_temporaries(out, locked=True)
        for stage in out.glob("stage*"):
            run.folders.finish_checkpoint_switch(stage)     # a save cut short by a kill: complete it or drop it
        if not c.resume:
            clear_stale_outputs(out)
        run.folders.write_config(out, c)
        n_params = sum(p.numel() for p in encoder.parameters())
        print(f"model: {name} ({n_params / 1e6:.1f}M parameters, {c.pooling} pooling, "
              f"{c.similarity}{f' / tau {c.tau}' if c.similarity == 'cos' else ''}) | "
              f"{world} process(es) on {device.type} | data: {len(doc_texts):,} passages, {len(examples)} "
              f"training queries{f' (a sample, seed {c.seed})' if c.n_queries else ''}", flush=True)
    offset = 0                                  # steps of the stages before, for --halt_at
    if c.epochs:                                # --epochs 0: no BM25 stage (the document-ranking recipe)
        examples = bm25_negative_pools(c, examples, doc_texts, doc_ids, doc_index, out / "negatives_bm25.tsv",
                                       device, is_rank0)
        encoder = train_stage(c, "stage1", encoder, examples, doc_texts, tokenizer, device, c.epochs, is_rank0)
        offset = stage_steps(c, len(examples), c.epochs, world)
    for r in range(1, c.rounds + 1):
        if encoder is None:
            break
        examples = hard_negative_pools(c, encoder, tokenizer, examples, doc_texts, doc_ids, doc_index,
                                       out / f"negatives_round{r}.tsv", device, is_rank0)
        encoder = train_stage(c, f"stage{r + 1}", encoder, examples, doc_texts, tokenizer, device, c.hard_epochs,
                              is_rank0, offset)
        offset += stage_steps(c, len(examples), c.hard_epochs, world)
    if encoder is None:  # --halt_at
        return None
    if is_rank0:
        save_final_encoder(encoder, out, c)
        print(f"fine-tuned encoder: {out / 'encoder'}", flush=True)
    run.ranks.barrier()
    splits = []                                 # dev (the held-out training queries: where settings are chosen), test
    if dev_qrels:
        splits.append((corpus, {q: queries[q] for q in dev_qrels}, dev_qrels, out / "eval-dev"))
    if evaluates(c):
        splits.append((*test, out / f"eval-{c.eval_split}"))
    results = evaluate.evaluate_splits(encoder, tokenizer, splits, c, device, tag=f"finetune-{name.replace(' ', '-')}")
    return results[-1] if evaluates(c) else None      # one encoding of the corpus when they share it


def corpus_file(c):
    """The retrieval corpus: --corpus, else the --dataset folder's corpus.jsonl."""
    return c.corpus or data.find_file(c.dataset, "corpus.jsonl")


def evaluates(c):
    """Whether the run ends with an evaluation: an eval split, and its files when the corpus is explicit."""
    return bool(c.eval_split and (not c.corpus or (c.eval_queries and c.eval_qrels)))


# What shows that a folder holds a fine-tuning run (the pipeline adds pretrain/).
RUN_FILES = ("config.json", "encoder", "stage1")


def clear_stale_outputs(out):
    """A fresh run removes an older run's finished stages, checkpoints, mined negatives and evaluations (rank 0)."""
    for path in [*out.glob("stage*/done.json"), *out.glob("stage*/state.pt"), *out.glob("negatives_*.tsv")]:
        run.folders.remove_entry(path)
    for folder in out.glob("eval-*"):
        run.folders.remove_entry(folder)


def _random_encoder(c):
    encoder = Encoder(c)
    encoder.mlm_head = None
    return encoder


# ==============================================================================================
# Checkpoint
# ==============================================================================================
def save_encoder(encoder, folder, c, vocab):
    """Hugging Face BERT folder plus how to use it as a retriever (retriever.json, sentence-transformers' files)."""
    run.hub.save_pretrained(encoder, folder, vocab)
    evaluate.write_retriever_settings(folder, c.pooling, c.similarity, c.query_len, c.passage_len)


def save_final_encoder(encoder, out, c):
    """{out}/encoder: the last stage's encoder again; a full disk is one line (the last stage keeps it)."""
    last = out / f"stage{c.rounds + 1}" / "encoder"
    try:
        save_encoder(encoder, out / "encoder", c, run.run_vocab(c))
    except Exception as e:   # safetensors, numpy and torch.save each report a full disk their own way
        if not run.files.is_disk_full(e, out):
            raise
        needs = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
        raise run.files.disk_full_line(out / "encoder", "the encoder needs", needs, f"{last} holds it whole; ",
                                  "free some space and continue with --resume") from None


def save_checkpoint(c, model, optimizer, scheduler, step, is_rank0, last_saved):
    """The stage's encoder (save_encoder's folder) and training state, switched together (run/folders.py)."""
    def settings(folder):   # the retriever's pooling and similarity, beside the encoder (save_encoder's)
        evaluate.write_retriever_settings(folder, c.pooling, c.similarity, c.query_len, c.passage_len)
    run.folders.save_checkpoint(c, model, optimizer, scheduler, step, is_rank0, last_saved, settings,
                        stream={"processes": rank_and_world()[1]})   # what --resume checks besides the flags


# ==============================================================================================
# Pipeline: pre-train, fine-tune, evaluate, compare with BM25
# ==============================================================================================
def pretrain(c):
    """Continue pre-training c.init with {c.pretrain}.py on the corpus into {out_dir}/pretrain; its encoder folder."""
    module, folder, pc = pretrain_config(c)
    if not (c.resume and (folder / "done.json").is_file()):
        if (folder / "done.json").is_file() and os.environ.get("RANK", "0") == "0":
            (folder / "done.json").unlink()  # a fresh run: an older run's marker must not survive a crash
        module.train(pc)
        if rank_and_world()[0] == 0 and (folder / "encoder").is_dir():
            run.files.atomic_write_json(folder / "done.json", {"method": c.pretrain, "steps": pc.steps})
    elif rank_and_world()[0] == 0:
        print(f"pretrain: already finished, using {folder / 'encoder'}")
    return str(folder / "encoder")


def pretrain_config(c):
    """(the {c.pretrain}.py module, its run folder, its Config from c and --pretrain_args)."""
    module = importlib.import_module(c.pretrain)
    folder = Path(c.out_dir) / "pretrain"
    corpus = c.corpus or str(data.find_file(c.dataset, "corpus.jsonl"))
    argv = (["--init", c.init, "--corpus", corpus, "--lr", "5e-5", "--steps", str(c.pretrain_steps)]
            + shlex.split(c.pretrain_args) + ["--out_dir", str(folder), "--seed", str(c.seed)]
            + (["--resume"] if c.resume else []) + (["--overwrite"] if c.overwrite else []))
    return module, folder, run.cli.parse_config(module.Config, argv, module.__doc__, module.PAPER_PRESET, module.FLAG_RULES)


def check_pretraining(c):
    """Before any work: --pretrain_args parse, and the token cache has a place (run.cache.token_cache_folder), and so
    has fine-tuning's passage cache."""
    _, _, pc = pretrain_config(c)
    run.cache.token_cache_folder(pc.corpus, run.run_vocab(pc), pc.cache_dir, pc.max_len,
                            flag='--pretrain_args "--cache_dir DIR"')
    run.passages.passage_cache_folder(corpus_file(c), run.run_vocab(c), c.cache_dir)


def evaluate_folder(c, folder, out_dir, tag):
    """Evaluate a model folder as it is (zero-shot), with c's settings: (means, per_query)."""
    corpus, queries, qrels = evaluate.load_split(c, c.eval_split, c.eval_queries, c.eval_qrels)
    if (Path(out_dir) / "metrics.json").is_file() and c.resume:       # done before a crash: reuse it
        return evaluate.compute_metrics(evaluate.read_run(Path(out_dir) / "run.trec"), qrels)
    encoder = evaluate.load_encoder(folder, c)
    return evaluate.evaluate_encoder(encoder, data.load_tokenizer(run.run_vocab(c)), corpus,
                                     queries, qrels, out_dir, c, setup_distributed()[2], tag=tag)


def pipeline(c):
    """--pretrain METHOD, the quick start: from the starting checkpoint c.init,
      1. evaluate it zero-shot;
      2. fine-tune it (BM25 negatives; --rounds N adds rounds of mined hard negatives) and evaluate it,
         the row without continued pre-training (--baseline false skips it);
      3. continue pre-training it with METHOD on the corpus (pretrain_steps steps);
      4. fine-tune that identically and evaluate it;
    then print every row next to BM25 with paired two-tailed t-tests."""
    t0 = time.time()
    if c.pretrain not in run.METHODS:
        raise ValueError(f"--pretrain must be one of {', '.join(run.METHODS)}, got {c.pretrain!r}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The pre-training script ends its process group; a second one in the same processes can meet
        # the first one's stale rendezvous keys (gloo "connectFullMesh failed"), so refuse instead.
        raise ValueError(f"--pretrain runs the whole pipeline in one process; under torchrun run its steps: "
                         f"torchrun ... {c.pretrain}.py --out_dir DIR, then torchrun ... finetune.py --init DIR/encoder")
    if not c.eval_split:
        raise ValueError("--pretrain compares models on the evaluation split: give --eval_split")
    run.folders.check_run_folder(c, RUN_FILES + ("pretrain", "zero-shot", "no-pretrain"))   # before any work, not after it
    run.folders.lock_run_folder(c.out_dir)               # one run at a time in a run folder (if it exists yet)
    out, name = Path(c.out_dir), Path(c.init).name if Path(c.init).is_dir() else c.init
    c = retriever_settings(dataclasses.replace(c, init=run.hub.resolve_model(c.init)))
    run.hub.check_vocab(run.run_vocab(c), c.init)     # before the zero-shot evaluation
    check_pretraining(c)
    run.folders.lock_run_folder(out, create=True)       # a new folder is locked as it is made
    rows = {f"{name} zero-shot": evaluate_folder(c, c.init, out / f"zero-shot/eval-{c.eval_split}", f"{name}-zero-shot")}
    if c.baseline:
        rows[f"{name} + fine-tune"] = train(dataclasses.replace(c, out_dir=str(out / "no-pretrain")), name)
    pretrained = pretrain(c)
    rows[f"{name} + {c.pretrain} + fine-tune"] = train(dataclasses.replace(c, init=pretrained), f"{name}-{c.pretrain}")
    if any(r is None for r in rows.values()):  # halted
        return
    corpus, queries, qrels = evaluate.load_split(c, c.eval_split, c.eval_queries, c.eval_qrels)
    bm25_name = f"BM25 (k1={c.k1}, b={c.b})"
    rows = {bm25_name: evaluate.evaluate_bm25(corpus, queries, qrels, out / f"eval-{c.eval_split}-bm25",
                                              c.k1, c.b, verbose=False), **rows}
    print()
    print(evaluate.format_table(rows, title=f"{c.eval_split} split, {len(qrels)} queries", baseline=bm25_name))
    print(evaluate.format_pairs(rows, list(rows)[1:]))
    print(f"pipeline: {run.files.format_seconds(time.time() - t0)} in all; outputs in {c.out_dir}")


def main(argv):
    c = run.cli.parse_config(Config, argv, __doc__, PAPER_PRESET, FLAG_RULES)
    if c.pretrain:
        pipeline(c)
        run.folders.release_run_folder(c.out_dir)
        return
    train(c)
    run.ranks.barrier()   # every rank is past its last collective before the group ends (run.cli.leave_distributed)
    run.folders.release_run_folder(c.out_dir)


if __name__ == "__main__":
    run.cli.run_command_line(lambda: main(sys.argv[1:]),
                         interrupted="interrupted; continue with --resume (each stage from its last checkpoint)")
