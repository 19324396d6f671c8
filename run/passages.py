"""Fine-tuning's corpus as a token cache, beneath finetune.py: each passage ('title text', data.passage_text)
tokenized once, by rank 0 and run/cache.py's pool of workers, into that module's memory-mapped arrays, with the doc
ids (in corpus order, and sorted once for lookups) and each text's length beside them. Every rank and every loader
worker maps the same files, so no process holds the corpus as Python objects: a rank holds its batch.

  load_passages   the corpus's Passages: built once (rank 0), checked at every use, like pre-training's token cache
  Passages        a batch of passages as data.encode_texts would tokenize them (the same ids), doc ids both ways
"""
import itertools
import json
from pathlib import Path

import numpy as np

import data
from run import cache, files

# The folder <corpus>.tokens-<vocab hash>-passages/ holds the token cache's files (run/cache.py: tokens.bin,
# word_starts.bin, doc_offsets.npy, manifest.json), one document per passage, and these, which passages.json
# (written last) records with the corpus signature they were made from:
#   doc_ids.npy      (N,) fixed-width bytes: row -> doc id
#   sorted_ids.npy   (N,) the ids sorted, and sorted_rows.npy (N,) int64 their rows: doc id -> row by binary search
#                    (a dict would hold millions of Python strings on every rank)
#   chars.npy        (N,) int64 each passage text's length in characters: encode()'s order, shortest first
ID_FILES = ("doc_ids.npy", "sorted_ids.npy", "sorted_rows.npy", "chars.npy")


def load_passages(corpus, vocab, rank=0, cache_dir="", workers=0, verbose=True):
    """The corpus's Passages from its passage cache (next to it, or in cache_dir): built once by rank 0, checked at
    every use."""
    folder = passage_cache_folder(corpus, vocab, cache_dir)
    cache.check_every_rank_sees(folder)                       # under torchrun: one folder for all nodes
    signature = cache.corpus_signature(corpus, vocab)
    if rank == 0 and folder.is_dir():
        files.remove_dead_temporaries(folder, verbose)
    cache.rank0_builds(lambda: cache._is_ready(cache._cache_problem(folder, signature), folder, "rebuilding it", rank == 0),
                       lambda: cache.build_token_cache(corpus, vocab, folder, workers, verbose=verbose,
                                                       texts=_texts(corpus)),
                       rank, f"the passage cache {folder}", folder)
    cache.rank0_builds(lambda: cache._is_ready(_ids_problem(folder, signature), folder, "indexing its ids again",
                                               rank == 0),
                       lambda: _write_ids(folder, corpus, signature), rank, str(folder / "passages.json"), folder)
    passages = Passages(folder, corpus, data.special_ids(data.load_tokenizer(vocab)))
    if passages.empty[0]:      # qrels may name them, so they stay; no query finds them by their words: said each run
        data.say_once(f"warning: {corpus}: {passages.empty[0]:,} of {len(passages):,} documents have no text (the "
                      f"first at line {passages.empty[1]}); they stay in the corpus")
    return passages


def passage_cache_folder(corpus, vocab, cache_dir=""):
    """<corpus>.tokens-<vocab hash>-passages next to the corpus, or in cache_dir; one line naming --cache_dir if the
    corpus's folder is read-only and holds no complete one (run.cache.token_cache_folder)."""
    return cache.token_cache_folder(corpus, vocab, cache_dir, flag="--cache_dir DIR", suffix="-passages")


def _texts(corpus):
    """The corpus's passages as one string each, in its order (what retrieval encodes, and BM25 indexes)."""
    for _, _, title, text in data.iter_corpus(corpus):
        yield data.passage_text({"title": title, "text": text})


def _ids_problem(folder, signature):
    """Why the id files cannot be used: '' never written, a line if stale or damaged; None: ready."""
    path = Path(folder) / "passages.json"
    if not path.is_file():
        return ""
    try:
        record = json.loads(path.read_text())
        built_from, records = record["signature"], record["files"]
    except (ValueError, KeyError, TypeError):
        return "passages.json is not a record of the passage ids"
    if built_from != signature:
        return cache.what_changed(built_from, signature)
    return cache._damage(folder, records, "passages.json")


def _write_ids(folder, corpus, signature, chunk=1 << 16):
    """The id files from a second pass over the corpus (no tokenizing), then passages.json. Numpy arrays a chunk at
    a time: a list of millions of Python strings would be this rank's peak."""
    empty = [0, 0]                           # passages with neither title nor text: how many, the first's line
    rows = _ids_and_lengths(corpus, empty)
    ids, chars = [], []
    while part := list(itertools.islice(rows, chunk)):
        ids.append(np.array([docid for docid, _ in part]))
        chars.append(np.array([n for _, n in part], dtype=np.int64))
    ids, chars = np.concatenate(ids), np.concatenate(chars)
    if len(ids) != cache._read(folder, "manifest.json")["n_docs"]:
        raise data.DataError(f"{corpus}: changed while its passage cache was built; run again")
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    if len(twice := np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])):
        raise data.DataError(f"{corpus}: duplicate document id {sorted_ids[twice[0]].decode()!r} (each may appear once)")
    (Path(folder) / "passages.json").unlink(missing_ok=True)     # first: no rank maps the files while they change
    for name, array in zip(ID_FILES, (ids, sorted_ids, order.astype(np.int64), chars)):
        files.atomic_save_npy(Path(folder) / name, array)
    files.atomic_write_json(Path(folder) / "passages.json", {"signature": signature, "n_passages": len(ids),
                            "empty": empty,
                            "files": {name: cache.file_record(Path(folder) / name) for name in ID_FILES}})


def _ids_and_lengths(corpus, empty):
    """(doc id as bytes, its passage text's length) of each passage in corpus order; counts in `empty` the passages
    with neither title nor text, and keeps the first one's line."""
    for number, docid, title, text in data.iter_corpus(corpus):
        if not (title.strip() or text.strip()):
            empty[:] = [empty[0] + 1, empty[1] or number]
        yield docid.encode(), len(data.passage_text({"title": title, "text": text}))


class Passages:
    """A corpus's passages, mapped from its passage cache; rows [start, stop) of it (a slice is a view: a rank's
    shard). batch(rows, max_len): (ids, mask) as data.encode_texts gives them for those passages' texts; chars: each
    text's length; doc_ids[row] and index[doc id] over the whole corpus. Pickles as its folder (loader workers)."""

    def __init__(self, folder, corpus, special, start=0, stop=None):
        self.folder, self.corpus, self.special = Path(folder), str(corpus), special
        manifest, ids_record = cache._read(folder, "manifest.json"), cache._read(folder, "passages.json")
        for records, where in ((manifest.get("files", {}), "its manifest"), (ids_record.get("files", {}), "passages.json")):
            if problem := cache._size_problem(folder, records, where):    # a file cut since it was checked is named
                raise cache._unreadable(folder, problem)
        self.dtype, self.n, self.empty = manifest["dtype"], manifest["n_docs"], ids_record.get("empty", [0, 0])
        self.start, self.stop = start, self.n if stop is None else stop
        self.offsets = cache._read(folder, "doc_offsets.npy")                          # (n + 1,)
        self.chars = cache._read(folder, "chars.npy")[self.start:self.stop]            # (stop - start,)
        self.doc_ids = DocIds(cache._read(folder, "doc_ids.npy"))
        self.index = DocIndex(cache._read(folder, "sorted_ids.npy"), cache._read(folder, "sorted_rows.npy"))

    def __len__(self):
        return self.stop - self.start

    def __getitem__(self, rows):
        """A slice of rows: the Passages of those rows (a view); what a rank encodes of the corpus."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("Passages are read by batch (batch()); index them with a slice of rows")
        start, stop, _ = rows.indices(len(self))
        return Passages(self.folder, self.corpus, self.special, self.start + start, self.start + max(start, stop))

    def batch(self, rows, max_len):
        """Padded '[CLS] text [SEP]' ids and mask (B, L) of these rows, each cut at max_len, as data.encode_texts."""
        # A mapping of its own per batch: its pages leave this process's resident set when it is dropped, so a
        # corpus read through at random never piles up in memory (the page cache keeps it, shared)
        tokens = cache._read(self.folder, "tokens.bin", self.dtype)
        rows = np.asarray(rows, dtype=np.int64) + self.start
        body = max_len - 2
        seqs = [[self.special["cls"]] + tokens[a:min(b, a + body)].tolist() + [self.special["sep"]]
                for a, b in zip(self.offsets[rows].tolist(), self.offsets[rows + 1].tolist())]
        return data.pad_batch(seqs, self.special["pad"])

    def label(self, row):
        """How a line names a row: its doc id."""
        return f"passage {self.doc_ids[self.start + row]!r}"

    def texts(self):
        """Every passage's text streamed from the corpus file, in row order (BM25 indexes text, not tokens)."""
        return SizedTexts(self.corpus, self.n)

    def __contains__(self, docid):
        return docid in self.index

    def __getstate__(self):
        return (self.folder, self.corpus, self.special, self.start, self.stop)

    def __setstate__(self, state):
        self.__init__(*state)


class DocIds:
    """Row -> doc id (str), from the mapped fixed-width bytes."""

    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, row):
        return self.ids[row].decode()


class DocIndex:
    """Doc id -> row, by binary search in the ids sorted once; rows(ids) looks up many at once."""

    def __init__(self, sorted_ids, sorted_rows):
        self.sorted_ids, self.sorted_rows = sorted_ids, sorted_rows

    def rows(self, docids):
        """(n,) int64 rows of these doc ids; KeyError naming the first that is not in the corpus."""
        keys = np.array([d.encode() for d in docids] or [b""])[:len(docids)]
        at = np.searchsorted(self.sorted_ids, keys).clip(max=len(self.sorted_ids) - 1)
        found = self.sorted_ids[at] == keys
        if not found.all():
            raise KeyError(docids[int(np.argmin(found))])
        return np.asarray(self.sorted_rows[at])

    def __getitem__(self, docid):
        return int(self.rows([docid])[0])

    def __contains__(self, docid):
        try:
            self.rows([docid])
        except KeyError:
            return False
        return True


class SizedTexts:
    """The passage texts of a corpus file, streamed, with their count (for a progress line's ETA)."""

    def __init__(self, corpus, n):
        self.corpus, self.n = corpus, n

    def __len__(self):
        return self.n

    def __iter__(self):
        return _texts(self.corpus)
