"""Text and tokens: the data module every script shares. It imports no other module of this project.

What a method's train() calls from here, in this order (sections 1-2):
  most_frequent_token     1. the corpus' most frequent token: the MLM accuracy's trivial baseline
  load_tokenizer          1. BERT's uncased WordPiece (Batches loads it once)
  special_ids             1. the ids of [PAD], [UNK], [CLS], [SEP] and [MASK]
  batch_indices           2. which windows this rank trains on at a micro-step (a function of the step alone)
  batch_generator         2. the seeded generator a batch's masks are drawn from
  pad_batch               2. token-id lists -> a padded (B, L) batch and its attention mask
  mask_tokens             2. BERT's masking: 15 % of the tokens, 80/10/10, labels -100 elsewhere
  step_seed               2. the seed of one micro-step's stream: COSTA's spans, every method's dropout
  DataError               2. bad input in one line, 'file:line: what is wrong' (COSTA's span sampling raises it)
  most_frequent_accuracy  2. an accuracy's chance: how often always predicting the most frequent token is right
Its windows come from run.load_windows: a TokenWindows (5) of Window (4: token ids and word_starts). CPDAE's
--idf_rec adds rank0_builds (5) and atomic_save_npy (6). Then what builds them: 3. the readers, each bad line
one DataError naming the file and line; 4. windows; 5. the token cache; 6. files written whole or not at all.
"""
import contextlib
import functools
import gzip
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
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
# 1. What train() calls first from here: the corpus' most frequent token, then the tokenizer
# ----------------------------------------------------------------------------------------------
def most_frequent_token(windows, chunk=1 << 24):
    """The corpus' most frequent token between [CLS] and [SEP] ('.' in SciFact): always predicting it is the MLM and
    SEED-decoder accuracies' trivial baseline. A bincount, `chunk` tokens at a time; None if no tokens."""
    counts = np.zeros(1, np.int64)
    parts = ((windows.tokens[a:a + chunk] for a in range(0, len(windows.tokens), chunk))
             if isinstance(windows, TokenWindows) else (w.input_ids[1:-1] for w in windows))
    for part in parts:
        part_counts = np.bincount(np.asarray(part, dtype=np.int64))
        if len(part_counts) > len(counts):
            counts = np.pad(counts, (0, len(part_counts) - len(counts)))
        counts[:len(part_counts)] += part_counts
    return int(counts.argmax()) if counts.any() else None


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
    if missing := [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]:
        raise DataError(f"{vocab}: vocabulary lacks the special tokens {missing}")
    return tokenizer


def special_ids(tokenizer):
    """{'pad': 0, 'unk': 100, 'cls': 101, 'sep': 102, 'mask': 103} for BERT's vocabulary."""
    return {t.strip("[]").lower(): tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}


def vocab_size_of(vocab_path):
    return sum(1 for _ in read_lines(vocab_path))  # (read_lines: a non-UTF-8 byte is one clear line)


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
# 2. One micro-step: its batch (windows, padding, masks, random streams), bad input, each accuracy's chance
# ----------------------------------------------------------------------------------------------
def batch_indices(n_examples, batch_size, rank, world, seed, micro_step):
    """This rank's example indices at a micro-step, a function of the step alone (ranks: slices of one global batch)."""
    per_epoch = batches_per_epoch(n_examples, batch_size, world)
    epoch, index = divmod(micro_step, per_epoch)
    order = _epoch_order(n_examples, seed, epoch)
    start = (index * world + rank) * batch_size
    return order[start:start + batch_size].tolist()


@functools.lru_cache(maxsize=2)
def _epoch_order(n_examples, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_examples)


def batches_per_epoch(n_examples, batch_size, world):
    """Global batches per epoch; each epoch's leftover n % (batch_size * world) examples sit out that epoch only."""
    count = n_examples // (batch_size * world)
    if count == 0:
        fix = "lower --batch_size" if batch_size > 1 else "add text to the corpus"
        raise DataError(f"only {n_examples} example(s): fewer than one global batch ({batch_size} per rank x "
                        f"{world} ranks); {fix}{', or run fewer processes' if world > 1 else ''}")
    return count


def batch_generator(seed, rank, micro_step):
    """The generator of one batch's masks: a function of the step alone, on the "masks" stream (not dropout's)."""
    return torch.Generator().manual_seed(step_seed(seed, rank, micro_step, "masks"))


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
    """BERT's masking: choose mask_prob of the maskable tokens ((B, L) bool, False at [CLS], [SEP], padding); of those
    80% -> [MASK], 10% -> a random token of the whole vocabulary, 10% unchanged. -> (masked_ids, labels, -100 else)."""
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
    """One seed per (run seed, rank, micro-step, stream): "dropout", "masks" (batch_generator) or "spans" (COSTA's
    --span_resample), hashed by numpy's SeedSequence: independent streams, the same whether a run was resumed."""
    entropy = [seed % 2**64, rank, micro_step, STREAMS.index(stream)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)  # < 2**63


class DataError(ValueError):
    """Bad input. The message is one line: 'file:line: what is wrong'. Scripts print it and exit."""


def most_frequent_accuracy(targets, token=None):
    """X_chance beside X_acc: the accuracy of always predicting `token` (most_frequent_token; None: this batch's most
    frequent target). targets (N,) or (B, L), -100 = no target -> () fp32."""
    targets = targets[targets != -100]                                           # (N,)
    if targets.numel() == 0:
        return torch.zeros((), device=targets.device)
    if token is None:
        return targets.bincount().max().float() / targets.numel()
    return (targets == token).float().mean()


# ----------------------------------------------------------------------------------------------
# 3. Readers: pre-training text, BEIR, MS MARCO, TREC qrels and run files; a rank's share of a list
# ----------------------------------------------------------------------------------------------
def read_lines(path, bad_bytes="stop"):
    """Yield (line_number, line) of a text file ('.gz' gunzipped), '\\r\\n' read as '\\n'. A byte not UTF-8 stops
    the run with the file, line and offset (bad_bytes="skip": the line is dropped, counted in one line per file);
    so do a truncated '.gz' and a '.gz' that is not gzip."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    gz, number, offset, skipped, first = path.suffix == ".gz", 0, 0, 0, 0
    try:
        with gzip.open(path, "rb") if gz else open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                line = _decode(raw, path, number, offset, gz, skip=bad_bytes == "skip")
                offset += len(raw)
                if line is None:
                    skipped, first = skipped + 1, first or number
                    continue
                yield number, line
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
    if skipped:
        say_once(f"warning: {path}: skipped {skipped:,} lines with bytes that are not UTF-8 (--bad_bytes skip; "
                 f"the first at line {first})")


def _decode(raw, path, number, offset, gz, skip=False):
    """One raw line as text, or a DataError naming the file, the line and the bad byte's offset (None if skip)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if skip:
            return None
        where = f"byte offset {offset + e.start}" + (" of the uncompressed text" if gz else "")
        raise DataError(f"{path}:{number}: byte 0x{raw[e.start]:02x} at {where} is not UTF-8; convert the "
                        f"file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if number == 1:
        line = line.removeprefix("\ufeff")                  # a byte-order mark is not text
    return line[:-2] + "\n" if line.endswith("\r\n") else line


def find_file(folder, name):
    """folder/name or folder/name.gz, whichever exists."""
    for candidate in (Path(folder) / name, Path(folder) / (name + ".gz")):
        if candidate.is_file():
            return candidate
    raise DataError(f"{Path(folder) / name}: file not found (nor {name}.gz)")


def iter_jsonl(path, bad_bytes="stop"):
    """Yield (line_number, object) for each non-blank line of a JSONL file."""
    for number, line in read_lines(path, bad_bytes):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: malformed JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def iter_tsv(path, n_columns, header=None):
    """Yield (line_number, fields) of a TSV file of n_columns per line, a header line (first field `header`) skipped."""
    for number, line in read_lines(path):
        fields = line.rstrip("\r\n").split("\t")
        if not line.strip() or (number == 1 and header is not None and fields[0] == header):
            continue
        if len(fields) != n_columns:
            raise DataError(f"{path}:{number}: expected {n_columns} tab-separated fields, found {len(fields)}")
        yield number, fields


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None


def read_pretraining_texts(path, bad_bytes="stop"):
    """Documents for pre-training from a file or a folder of files, its subfolders too ('.gz' read transparently):
    - '.jsonl': one document per line with a "text" field (WikiExtractor, BEIR corpus), its "title" (if any) in front;
    - no extension (WikiExtractor's wiki_00, ...): JSON lines if the file starts with '{' (--json), else its
      '<doc ...>' blocks, whose first line is the title (its default output);
    - anything else: plain text, documents separated by blank lines (BERT's pre-training format)."""
    texts = list(iter_pretraining_texts(path, bad_bytes))
    if not texts:
        raise DataError(f"{path}: empty corpus (no non-blank document)")
    return texts


CORPUS_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")   # what a corpus folder's files may be (and
# files with no extension that hold WikiExtractor's output: corpus_kind)


def corpus_files(path):
    """The files of a corpus in reading order: the file itself, or a folder's (and subfolders') visible .txt / .jsonl
    files ('.gz' ok) and WikiExtractor files, sorted by path; the others are named once and skipped."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        is_read = [p.name.endswith(CORPUS_SUFFIXES) or corpus_kind(p) != "plain" for p in files]
        read = [p for p, yes in zip(files, is_read) if yes]
        skipped = [str(p.relative_to(path)) for p, yes in zip(files, is_read) if not yes]
        if skipped:
            shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
            say_once(f"{path}: skipping {shown} (a corpus folder reads only {', '.join(CORPUS_SUFFIXES)} files "
                     f"and WikiExtractor's)")
        return read
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    return [path]


@functools.cache
def say_once(line):
    """A line about the input, on rank 0, once per process (a script may read an input more than once)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def iter_pretraining_texts(path, bad_bytes="stop"):
    """read_pretraining_texts one document at a time (a corpus larger than memory streams through)."""
    readers = {"jsonl": _jsonl_texts, "doc": _doc_texts, "plain": _plain_texts}
    for file in corpus_files(path):
        yield from readers[corpus_kind(file)](file, bad_bytes)


def corpus_kind(file):
    """How a corpus file is read: "jsonl" (.jsonl, or no extension and starting with '{': WikiExtractor --json),
    "doc" (no extension, starting with '<doc': WikiExtractor's default), else "plain"."""
    file = Path(file)
    if ".jsonl" in file.suffixes:
        return "jsonl"
    if file.suffix or not file.is_file():
        return "plain"
    with open(file, "rb") as f:
        head = f.read(4096).lstrip()
    return "jsonl" if head.startswith(b"{") else "doc" if head.startswith(b"<doc") else "plain"


def _jsonl_texts(file, bad_bytes="stop"):
    """A JSONL file's documents; those whose title and text are only whitespace are left out, one line says how many."""
    total, dropped, first = 0, 0, 0
    for number, obj in iter_jsonl(file, bad_bytes):
        if not isinstance(obj.get("text"), str):
            raise DataError(f"{file}:{number}: no string field \"text\"")
        title = obj.get("title") or ""
        text = f"{title}. {obj['text']}" if str(title).strip() else obj["text"]   # (a blank title adds no '. ')
        total += 1
        if text.strip():
            yield text
        else:
            dropped, first = dropped + 1, first or number
    if dropped:
        say_once(f"warning: {file}: {dropped:,} of {total:,} documents are only whitespace (the first at line "
                 f"{first}); they are left out")


def _doc_texts(file, bad_bytes="stop"):
    """WikiExtractor's default output: documents between a '<doc id=... title=...>' line and '</doc>', the first
    line the title; read as its --json output is ("title. text"). A <doc> left open is one line naming it."""
    start, lines = 0, []
    for number, line in read_lines(file, bad_bytes):
        if line.startswith("<doc"):
            if start:
                raise DataError(f"{file}:{number}: a <doc> begins before the one at line {start} ended (</doc>)")
            start, lines = number, []
        elif line.strip() == "</doc>" and start:
            title, _, text = "".join(lines).strip().partition("\n")
            if text.strip() or title:
                yield f"{title}. {text.strip()}" if text.strip() else title
            start = 0
        elif start:
            lines.append(line)
    if start:
        raise DataError(f"{file}:{start}: this <doc> has no </doc> (a file cut short?)")


def _plain_texts(file, bad_bytes="stop"):
    """A plain-text file's documents: a line that is just '\n' ends one, the same split as text.split('\n\n')."""
    lines = []
    for _, line in itertools.chain(read_lines(file, bad_bytes), [(0, "\n")]):
        if line == "\n":
            text = "".join(lines).strip()
            if text:
                yield text
            lines = []
        else:
            lines.append(line)


def add_once(table, key, value, path, number, what):
    """table[key] = value, refusing a key seen before: last-wins would silently drop data."""
    if key in table:
        raise DataError(f"{path}:{number}: duplicate {what} (each may appear once)")
    table[key] = value


def read_corpus(path):
    """Retrieval corpus {docid: {"title", "text"}} from BEIR corpus.jsonl or MS MARCO collection.tsv."""
    corpus, first_empty = {}, 0
    if ".jsonl" in Path(path).suffixes:
        for number, obj in iter_jsonl(path):
            if "_id" not in obj or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{number}: a corpus line needs \"_id\" and a string \"text\"")
            if not isinstance(obj.get("title") or "", str):
                raise DataError(f"{path}:{number}: \"title\" must be a string")
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
        raise DataError(f"{path}:{number}: empty query text")


def warn_empty_documents(corpus, path, first_line):
    """Documents with neither title nor text stay (qrels may name them), never found by their words: one line."""
    empty = sum(1 for doc in corpus.values() if not (doc["title"].strip() or doc["text"].strip()))
    if empty:
        say_once(f"warning: {path}: {empty:,} of {len(corpus):,} documents have no text (the first at line "
                 f"{first_line}); they stay in the corpus")


def read_queries(path):
    """Queries {qid: text} from BEIR queries.jsonl or MS MARCO queries.tsv."""
    queries = {}
    if ".jsonl" in Path(path).suffixes:
        for number, obj in iter_jsonl(path):
            if "_id" not in obj or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{number}: a query line needs \"_id\" and a string \"text\"")
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
    """Relevance judgments {qid: {docid: grade}} from BEIR qrels/*.tsv or TREC qrels ('qid iteration docid grade')."""
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
            raise DataError(f"{path}:{number}: expected 'qid docid grade' or "
                            f"'qid 0 docid grade', found {len(fields)} fields")
        grade = parse_grade(grade, path, number)
        add_once(qrels.setdefault(qid, {}), docid, grade, path, number,
                  f"judgment of document {docid!r} for query {qid!r}")
    if not qrels:
        raise DataError(f"{path}: no judgments")
    return qrels


def parse_grade(text, path, number):
    """A relevance grade: an integer ('2', '-1', also '1.0'); '1.7', 'inf' or 'x' stop with file:line."""
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{path}:{number}: relevance grade {text!r} is not a number") from None
    if not math.isfinite(value) or value != int(value):
        raise DataError(f"{path}:{number}: relevance grade {text!r} is not an integer")
    return int(value)


def check_qrels(qrels, queries, corpus, path):
    """Every judged query and document must exist: otherwise a metric would silently be wrong."""
    for qid, docs in qrels.items():
        if qid not in queries:
            raise DataError(f"{path}: query id {qid!r} is not in the queries file")
        for docid in docs:
            if docid not in corpus:
                raise DataError(f"{path}: document id {docid!r} (query {qid!r}) is not in the corpus")


def load_beir(folder, split="test", corpus=None):
    """A BEIR-layout folder (corpus.jsonl, queries.jsonl, qrels/{split}.tsv; '.gz' ok) -> (corpus {docid: {"title",
    "text"}}, the split's judged queries {qid: text}, qrels {qid: {docid: grade}}); corpus: one already read."""
    qrels_path = find_file(Path(folder) / "qrels", f"{split}.tsv")
    corpus = read_corpus(find_file(folder, "corpus.jsonl")) if corpus is None else corpus
    queries = read_queries(find_file(folder, "queries.jsonl"))
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
            raise DataError(f"{path}:{number}: expected 6 fields 'qid Q0 docid rank score tag', found {len(fields)}")
        try:
            score = float(fields[4])
        except ValueError:
            raise DataError(f"{path}:{number}: score {fields[4]!r} is not a number") from None
        add_once(run.setdefault(fields[0], {}), fields[2], score, path, number,
                  f"document {fields[2]!r} for query {fields[0]!r}")
    return run


def write_run(path, run, tag="dense"):
    """Write {qid: {docid: score}} as a TREC run file, each query ranked by score (atomic)."""
    lines = []
    for qid, scores in run.items():
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += [f"{qid} Q0 {docid} {rank} {score:.6f} {tag}\n" for rank, (docid, score) in enumerate(ranked, start=1)]
    atomic_write_text(path, "".join(lines))


def shard(n_items, rank, world):
    """Contiguous shard of range(n_items) for a rank (sizes differ by at most one; no item twice or lost)."""
    bounds = np.linspace(0, n_items, world + 1).round().astype(int)
    return range(bounds[rank], bounds[rank + 1])


# ----------------------------------------------------------------------------------------------
# 4. Windows: documents -> [CLS] ... [SEP] of at most max_len tokens, with word starts
# ----------------------------------------------------------------------------------------------
class Window(NamedTuple):
    input_ids: list    # [CLS] tokens... [SEP]
    word_starts: list  # True where a whole word starts; False at [CLS], [SEP] and '##' pieces


def _cut_points(word_start, body):
    """Chunk boundaries: at most `body` tokens each, moved back to the start of the word they would split."""
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
    """Tokenize documents and cut each into windows '[CLS] ... [SEP]' of at most max_len tokens, ending on word
    boundaries where possible. A last window shorter than min_tokens is dropped unless it is the whole document;
    a document of no token at all gives no window."""
    ids = special_ids(tokenizer)
    body = max_len - 2
    windows = []
    for encoding in _encode_in_chunks(tokenizer, texts):
        word_ids, tokens = encoding.word_ids, encoding.ids
        if not tokens:
            continue
        word_start = [i == 0 or word_ids[i] != word_ids[i - 1] for i in range(len(tokens))]
        cuts = _cut_points(word_start, body)
        for a, b in itertools.pairwise(cuts):
            if b - a < min_tokens and len(cuts) > 2:
                continue
            windows.append(Window([ids["cls"]] + tokens[a:b] + [ids["sep"]], [False] + word_start[a:b] + [False]))
    if not windows:
        raise DataError("no windows: every document tokenized to nothing")
    return windows


def encode_texts(tokenizer, texts, max_len):
    """Queries or passages -> padded ('[CLS] text [SEP]', truncated to max_len) ids and mask."""
    ids = special_ids(tokenizer)
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    seqs = [[ids["cls"]] + e.ids[:max_len - 2] + [ids["sep"]] for e in encodings]
    return pad_batch(seqs, ids["pad"])


# COSTA's word spans (costa.sample_spans) skip stopwords and words with no letter or digit: which words
# those are is text machinery, not the paper's math
def skip_word_mask(input_ids, word_starts, vocab_tokens, tables=None):
    """True at the start of each word that must not be a word-level span: an English stopword (scikit-learn's
    list, the whole word) or a word with no letter or digit. Departure (costa-word-punct): the paper filters
    stopwords only; punctuation makes an equally empty positive. tables: word_tables(vocab_tokens), made once."""
    skip_alone, is_piece, may_join = tables or word_tables(vocab_tokens)
    ids, starts = np.asarray(input_ids), np.flatnonzero(word_starts)            # (L,), (W,) word starts
    ends = np.append(starts[1:], len(ids))                                       # (W,)
    joined = np.logical_or.reduceat(is_piece[ids], starts) if len(starts) else starts > 0  # (W,) has "##" pieces
    mask = np.zeros(len(ids), dtype=bool)
    mask[starts] = skip_alone[ids[starts]] & ~joined                             # one-piece words: the table
    for start, end in zip(*(x[joined & may_join[ids[starts]]].tolist() for x in (starts, ends))):
        parts = [vocab_tokens[t] for t in input_ids[start:end]]                  # a word of several pieces
        word = parts[0] + "".join(p[2:] for p in parts[1:] if p.startswith("##"))  # not [SEP]
        mask[start] = word in stopwords() or not any(ch.isalnum() for ch in word)
    return mask


@functools.cache
def stopwords():
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS  # here: sklearn takes seconds to import
    return ENGLISH_STOP_WORDS


def word_tables(vocab_tokens):
    """skip_word_mask's tables, (V,) bool each: skip_alone (the entry, as a whole word, is skipped); is_piece
    (a "##" piece); may_join (a word that starts with it may join its pieces into a skipped word: it has no
    letter or digit, or it begins a stopword that is no entry, WordPiece taking the longest prefix first)."""
    index = {token: i for i, token in enumerate(vocab_tokens)}
    no_alnum = np.array([not any(ch.isalnum() for ch in t) for t in vocab_tokens], dtype=bool)
    skip_alone = no_alnum | np.array([t in stopwords() for t in vocab_tokens], dtype=bool)
    may_join = no_alnum.copy()
    for word in stopwords() - index.keys():
        prefix = next((word[:k] for k in range(len(word) - 1, 0, -1) if word[:k] in index), None)
        if prefix:
            may_join[index[prefix]] = True
    return skip_alone, np.array([t.startswith("##") for t in vocab_tokens], dtype=bool), may_join


# ----------------------------------------------------------------------------------------------
# 5. Token cache: a corpus tokenized once into memory-mapped arrays, windows cut from them
# ----------------------------------------------------------------------------------------------
# Like nanoGPT's prepare.py writing train.bin, for documents: the first run tokenizes the corpus
# (worker processes, batch encoding) into a folder next to it (or in --cache_dir):
#   tokens.bin           every document's WordPiece ids, concatenated (uint16 when the vocab fits)
#   word_starts.bin      uint8, 1 where a whole word starts (COSTA's spans, word-boundary cuts)
#   doc_offsets.npy      int64 (n_docs + 1,): document i is tokens[doc_offsets[i]:doc_offsets[i + 1]]
#   windows-L{max_len}.npy  int64 (n_windows, 2): each window's [start, end) in tokens, per max_len
#   windows-L{max_len}.json its counts and the .npy's size, time and CRC-32; written after the .npy
#   manifest.json        corpus files (size, mtime), the vocab's sha256, format version, counts, and each file
#                        above's size, time and CRC-32; written last, so a folder with a matching manifest is complete
# Every later run, rank and --resume maps these files: memory holds the batch, not the corpus; the windows are
# make_windows' (a test checks). Before every use the cache proves itself against its records: sizes always,
# CRC-32s while the files total at most CRC_EVERY_USE_BYTES, beyond that of files whose time changed; a failed
# check rebuilds it, saying what differed. Files are written under '.NAME.PID@HOST.tmp' and renamed.
TOKEN_CACHE_VERSION = 2      # 2: the manifest records each file's size, time and CRC-32 (1 recorded none)
CACHE_WAIT_S = 6 * 3600      # how long ranks > 0 wait for rank 0 to build a cache before giving up
WORKER_SILENCE_S = 600       # a tokenizing worker that gives nothing back this long is stuck: named, stopped
CACHE_STALL_S = 2 * WORKER_SILENCE_S   # ranks > 0 give up when rank 0's cache folder is unchanged this long
TOKEN_FILES = ("tokens.bin", "word_starts.bin", "doc_offsets.npy")   # what the manifest vouches for
CRC_EVERY_USE_BYTES = 1 << 30   # files up to this total have their CRC-32s checked on every use
UNOWNED_TEMP_S = 3600        # a temporary whose name has no PID is stale when unwritten this long


def sha256_of(path):
    """The file's sha256 (hex), read 1 MiB at a time."""
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def corpus_signature(corpus, vocab):
    """What a token cache was built from: a cache whose manifest differs in any of these is stale."""
    files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in corpus_files(corpus)]
    return {"version": TOKEN_CACHE_VERSION, "files": files, "vocab_sha256": sha256_of(vocab)}


def token_cache_folder(corpus, vocab, cache_dir="", max_len=None, flag="--cache_dir DIR"):
    """<corpus>.tokens-<vocab hash> next to the corpus, or inside cache_dir. Next to a read-only corpus only a
    complete cache (_is_complete, with the windows of max_len) is used as it is; else one line naming `flag`."""
    corpus = Path(corpus)
    parent = Path(cache_dir) if cache_dir else corpus.resolve().parent
    folder = parent / f"{corpus.name}.tokens-{sha256_of(vocab)[:8]}"
    if not cache_dir and not os.access(parent, os.W_OK) and not _is_complete(folder, corpus, vocab, max_len):
        raise DataError(f"{parent}: cannot write the token cache next to the corpus (read-only), and no complete "
                        f"one is there; pass {flag}")
    return folder


def _is_complete(folder, corpus, vocab, max_len=None):
    """Whether the token cache in folder is whole, of this corpus and vocab, with the windows of max_len (None: any)."""
    return (_cache_problem(folder, corpus_signature(corpus, vocab)) is None
            and (max_len is None or _windows_problem(folder, max_len) is None))


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
    """How the cache files differ from their records (sizes, then CRC-32s: see CRC_EVERY_USE_BYTES), or None."""
    if problem := _size_problem(folder, records, where):
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


def what_changed(old, new):
    """The first difference between the signature a cache was built from and the corpus's now, in words."""
    if old["vocab_sha256"] != new["vocab_sha256"]:
        return "the vocabulary changed"
    before, now = ({path: rest for path, *rest in s["files"]} for s in (old, new))
    for path, stat in now.items():
        if before.get(path) != stat:
            return f"{path} {'changed (size or time)' if path in before else 'joined the corpus'}"
    return f"{next(path for path in before if path not in now)} left the corpus"


def _cache_problem(folder, signature):
    """Why the token cache cannot be used: '' never finished (no manifest), a line if stale or damaged; None: ready."""
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
        return what_changed(built_from, signature)
    if not isinstance(manifest.get("files"), dict):
        return "manifest.json has no record of the cache's files"
    return _damage(folder, manifest["files"], "its manifest")


def _is_ready(problem, folder, redo, say=False):
    """Whether a part of the cache can be used as it is (its problem is None); say: print why not, and `redo`."""
    if problem and say:
        print(f"token cache {folder}: {problem}; {redo}", flush=True)
    return problem is None


def _start_worker(vocab):
    global _worker_tokenizer
    # Whatever handlers it inherited through fork: SIGTERM ends a worker (Pool.terminate sends it), Ctrl-C is the
    # parent's. Both were blocked since before the fork (_pool), so one sent while the worker started acts here.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # one thread per worker process: the pool is the parallelism
    _worker_tokenizer = load_tokenizer(vocab)


def _tokenize_chunk(texts):
    """Documents -> (ids (T,) uint32, word_starts (T,) uint8, lengths (D,) int64, _over_long_chars), in a worker."""
    encodings = _worker_tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.uint32, count=total)
    words = np.fromiter(itertools.chain.from_iterable(e.word_ids for e in encodings), dtype=np.int64, count=total)
    starts = np.ones(total, dtype=bool)                  # a token starts a word when its word id changes,
    starts[1:] = words[1:] != words[:-1]                 # and every document starts with a word
    starts[np.cumsum(lengths)[:-1][lengths[1:] > 0]] = True
    return ids, starts.astype(np.uint8), lengths, _over_long_chars(encodings)


def _over_long_chars(encodings):
    """Characters in words longer than WordPiece reads (100): each such word became one [UNK] token."""
    unk, longest = _worker_tokenizer.token_to_id("[UNK]"), _worker_tokenizer.model.max_input_chars_per_word
    return sum(end - start for e in encodings if unk in e.ids
               for token, (start, end) in zip(e.ids, e.offsets) if token == unk and end - start > longest)


def _tokenize_chunk_sized(texts):
    """_tokenize_chunk plus the chunk's characters (for the progress line)."""
    return (*_tokenize_chunk(texts), sum(len(t) for t in texts))


def corpus_chars(corpus):
    """About how many characters the corpus holds, for the ETA: file sizes (a .gz file's stored uncompressed size)."""
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
    workers = workers or os.cpu_count() or 1
    context = multiprocessing.get_context()   # the platform's: fork on Linux; spawn on macOS (where forking a
    if not hasattr(signal, "pthread_sigmask"):  # process that runs threads is unsafe) and on Windows
        return context.Pool(workers, _start_worker, (str(vocab),))
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # until _start_worker
    try:
        return context.Pool(workers, _start_worker, (str(vocab),))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _results(pool, tasks, folder):
    """Each result of pool.imap in order, at most WORKER_SILENCE_S for each: a stuck worker is named in one line."""
    answers = pool.imap(_tokenize_chunk_sized, tasks)
    while True:
        try:
            yield answers.next(timeout=WORKER_SILENCE_S)
        except StopIteration:
            return
        except multiprocessing.TimeoutError:
            raise DataError(_stuck_line(pool, folder)) from None


def _close_pool(pool, folder):
    """The workers leave when the tasks run out: wait for each, at most WORKER_SILENCE_S in all."""
    pool.close()
    deadline = time.monotonic() + WORKER_SILENCE_S
    for worker in pool._pool:                        # (the pool's processes: Pool has no public name for them)
        worker.join(max(0.0, deadline - time.monotonic()))
    if any(worker.is_alive() for worker in pool._pool):
        raise DataError(_stuck_line(pool, folder))
    pool.join()


def _stop_pool(pool, bound=10):
    """Pool.terminate(), waited on at most `bound` s (a killed worker may hold the queue's lock for ever), then kill."""
    import threading
    stopper = threading.Thread(target=pool.terminate, daemon=True)
    stopper.start()
    stopper.join(bound)
    if stopper.is_alive():
        for worker in pool._pool:
            worker.kill()


def _stuck_line(pool, folder):
    pids = ", ".join(str(worker.pid) for worker in pool._pool if worker.is_alive())
    return (f"token cache {folder}: the tokenizing workers (pids {pids}) gave nothing back for {WORKER_SILENCE_S} s; "
            f"they were stopped and no half-built cache is kept. Run the command again (pre-training: --prep_workers 1 "
            f"tokenizes in one worker)")


def build_token_cache(corpus, vocab, folder, workers=0, chunk_chars=1 << 19, verbose=True, bad_bytes="stop"):
    """Tokenize the corpus into folder (see above): documents stream through worker processes, their ids appended in
    order; every file written under a temporary name and renamed, the manifest last."""
    folder = Path(folder)
    signature = corpus_signature(corpus, vocab)    # (a missing corpus stops here, before any folder exists)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(folder, verbose)
    (folder / "manifest.json").unlink(missing_ok=True)    # first: no rank maps the files while they change
    try:
        _build_token_cache(corpus, vocab, folder, signature, workers, chunk_chars, verbose, bad_bytes)
    except BaseException as e:
        if created:                                 # a corpus error (or Ctrl-C) leaves no half-built cache
            shutil.rmtree(folder, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_line(folder, "the token cache needs about", cache_bytes_needed(corpus, vocab), "",
                                 "free some space, or give --cache_dir on another disk") from None
        raise


def cache_bytes_needed(corpus, vocab, chars_per_token=4.0):
    """About the bytes of a corpus's token cache: per token its id (2 or 4) and word start (1), ~4 characters each."""
    return int(corpus_chars(corpus) / chars_per_token * ((2 if vocab_size_of(vocab) <= 1 << 16 else 4) + 1))


def _build_token_cache(corpus, vocab, folder, signature, workers, chunk_chars, verbose, bad_bytes="stop"):
    dtype = np.uint16 if vocab_size_of(vocab) <= 1 << 16 else np.uint32
    tmp = {name: temporary_name(folder / name) for name in ("tokens.bin", "word_starts.bin")}
    lengths, n_tokens, over_long, t0 = [np.zeros(1, np.int64)], 0, 0, time.time()
    progress = ProgressLine(f"tokenizing {corpus}:", corpus_chars(corpus), "chars", rank=0 if verbose else 1)
    try:
        with open(tmp["tokens.bin"], "wb") as tok_f, open(tmp["word_starts.bin"], "wb") as ws_f:
            pool = _pool(vocab, workers)
            try:
                chunks = _chunks(iter_pretraining_texts(corpus, bad_bytes), chunk_chars)
                for ids, starts, doc_lengths, n_over_long, n_chars in _results(pool, chunks, folder):
                    tok_f.write(ids.astype(dtype).tobytes())
                    ws_f.write(starts.tobytes())
                    lengths.append(doc_lengths)
                    n_tokens, over_long = n_tokens + len(ids), over_long + n_over_long
                    progress.add(n_chars)
                _close_pool(pool, folder)           # every worker ended (terminate() is for errors only)
            finally:
                _stop_pool(pool)                    # after an error; nothing left to do after _close_pool
        if n_tokens == 0:
            raise DataError(f"{corpus}: empty corpus (no non-blank document)" if len(lengths) == 1 else
                            f"{corpus}: every document tokenized to nothing")
        for name, path in tmp.items():
            os.replace(path, folder / name)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    offsets = np.cumsum(np.concatenate(lengths))
    atomic_save_npy(folder / "doc_offsets.npy", offsets)
    for stale in [*folder.glob("windows-*"), *folder.glob("idf-*.npy")]:    # cut or counted from the old tokens
        stale.unlink()
    seconds = time.time() - t0
    atomic_write_json(folder / "manifest.json", {
        "signature": signature, "dtype": np.dtype(dtype).name, "n_docs": len(offsets) - 1,
        "n_tokens": n_tokens, "seconds": round(seconds, 1), "tokens_per_s": round(n_tokens / max(seconds, 1e-9)),
        "files": {name: file_record(folder / name) for name in TOKEN_FILES}})
    if verbose:
        print(f"token cache: {folder}: {len(offsets) - 1:,} documents, {n_tokens:,} tokens in {seconds:.1f}s "
              f"({n_tokens / max(seconds, 1e-9):,.0f} tokens/s)", flush=True)
    if verbose and over_long:
        print(f"token cache: {over_long:,} characters were in words over 100 characters long, each word now one "
              f"[UNK] token (BERT's WordPiece reads no longer word)", flush=True)


def cut_windows(word_starts, doc_offsets, max_len, min_tokens=8):
    """make_windows' cuts on a token cache: (n_windows, 2) int64 [start, end) of each window's body, the same rules."""
    body, out = max_len - 2, []
    for a, b in zip(doc_offsets[:-1].tolist(), doc_offsets[1:].tolist()):
        if a == b:
            continue
        cuts = _cut_points(word_starts[a:b].tolist(), body)
        out.extend((a + x, a + y) for x, y in itertools.pairwise(cuts) if y - x >= min_tokens or len(cuts) == 2)
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _unreadable(folder, what):
    return DataError(f"{folder}: cannot read the token cache ({what}); delete the folder to rebuild it "
                     f"(rm -r {folder})")


def _read(folder, name, dtype=None):
    """A cache file: .bin memory-mapped as dtype, .npy memory-mapped, .json parsed; a failure is one line naming it."""
    path = Path(folder) / name
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text())
        return np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _unreadable(folder, f"{name}: {getattr(e, 'strerror', None) or e}") from None


def _windows_problem(folder, max_len):
    """Why windows-L{max_len}.npy cannot be used: '' never cut, a line if not what its .json recorded; None: ready."""
    counts = Path(folder) / f"windows-L{max_len}.json"
    if not counts.is_file():
        return ""
    try:
        records = {f"windows-L{max_len}.npy": json.loads(counts.read_text())["files"][f"windows-L{max_len}.npy"]}
    except (ValueError, KeyError, TypeError):
        return f"{counts.name} has no record of windows-L{max_len}.npy"
    return _damage(folder, records, counts.name)


def _write_windows(folder, max_len):
    name = f"windows-L{max_len}.npy"
    (Path(folder) / f"windows-L{max_len}.json").unlink(missing_ok=True)   # first: no rank maps a changing .npy
    bounds = cut_windows(_read(folder, "word_starts.bin", np.uint8), _read(folder, "doc_offsets.npy"), max_len)
    if len(bounds) == 0:
        raise DataError(f"{folder}: no windows: every document tokenized to nothing")
    n_tokens = int((bounds[:, 1] - bounds[:, 0]).sum()) + 2 * len(bounds)     # [CLS] and [SEP] included
    atomic_save_npy(Path(folder) / name, bounds)
    atomic_write_json(Path(folder) / f"windows-L{max_len}.json",                  # last: its presence means done
                      {"n_windows": len(bounds), "n_tokens": n_tokens, "files": {name: file_record(Path(folder) / name)}})


class TokenWindows:
    """A token cache's windows as a sequence of Window (make_windows' items), memory-mapped; pickles as its folder."""

    def __init__(self, folder, max_len, special):
        self.folder, self.max_len, self.special = Path(folder), max_len, special
        manifest = _read(folder, "manifest.json")
        counts = _read(folder, f"windows-L{max_len}.json")
        for records, where in ((manifest.get("files", {}), "its manifest"),
                               (counts.get("files", {}), f"windows-L{max_len}.json")):
            problem = _size_problem(folder, records, where)   # a stat each: a file cut since it was checked
            if problem:                                       # (or in a data-loader worker) is named here
                raise _unreadable(folder, problem)
        self.tokens = _read(folder, "tokens.bin", manifest["dtype"])
        self.word_starts = _read(folder, "word_starts.bin", np.uint8)
        self.bounds = _read(folder, f"windows-L{max_len}.npy")     # (N, 2)
        self.n_docs = manifest["n_docs"]
        self.n_tokens = counts["n_tokens"]                         # [CLS] and [SEP] included (counted when cut)
        # For a run to record: the tokens' CRC-32 and window count (alike?), the signature (what_changed)
        self.identity = {"tokens_crc32": manifest["files"]["tokens.bin"]["crc32"], "n_windows": len(self.bounds),
                         "signature": manifest["signature"]}

    def __len__(self):
        return len(self.bounds)

    def __getitem__(self, i):
        a, b = self.bounds[i].tolist()
        return Window([self.special["cls"]] + self.tokens[a:b].tolist() + [self.special["sep"]],
                      [False] + self.word_starts[a:b].astype(bool).tolist() + [False])

    def __getstate__(self):
        return (self.folder, self.max_len, self.special)

    def __setstate__(self, state):
        self.__init__(*state)


def rank0_builds(ready, build, rank, what, watch=None):
    """Rank 0 runs build() unless ready(); the others poll ready() (no collective) at most CACHE_WAIT_S seconds, and
    at most CACHE_STALL_S after the last change in the folder rank 0 writes (watch): a stalled rank 0 is named."""
    if rank == 0:
        if not ready():
            build()
        return
    t0 = last = time.time()
    while not ready():
        changed = _last_change(watch, t0)
        if time.time() - t0 > CACHE_WAIT_S or time.time() - changed > CACHE_STALL_S:
            quiet = f"; nothing in {watch} changed for {time.time() - changed:.0f} s" if watch else ""
            raise DataError(f"rank {rank}: waited {time.time() - t0:.0f} s for rank 0 to build {what}{quiet}; "
                            f"did rank 0 fail or hang? Its output says")
        if time.time() - last > 60:
            last = time.time()
            print(f"rank {rank}: waiting for rank 0 to build {what} ({last - t0:.0f} s)", flush=True)
        time.sleep(1)


def _last_change(folder, since):
    """The newest modification time of a file in folder (temporaries too), or `since`."""
    times = [since]
    for path in Path(folder).iterdir() if folder and Path(folder).is_dir() else ():
        with contextlib.suppress(FileNotFoundError):   # renamed or removed meanwhile
            times.append(path.stat().st_mtime)
    return max(times)


def token_windows(corpus, vocab, max_len, rank=0, cache_dir="", workers=0, verbose=True, bad_bytes="stop"):
    """A corpus's pre-training windows (TokenWindows) from its token cache: built once (rank 0), checked every use."""
    folder = token_cache_folder(corpus, vocab, cache_dir, max_len)
    signature = corpus_signature(corpus, vocab)
    if rank == 0 and folder.is_dir():
        remove_dead_temporaries(folder, verbose)
    rank0_builds(lambda: _is_ready(_cache_problem(folder, signature), folder, "rebuilding it", rank == 0),
                 lambda: build_token_cache(corpus, vocab, folder, workers, verbose=verbose, bad_bytes=bad_bytes), rank,
                 f"the token cache {folder}", folder)
    rank0_builds(lambda: _is_ready(_windows_problem(folder, max_len), folder, "cutting the windows again", rank == 0),
                 lambda: _write_windows(folder, max_len), rank, str(folder / f"windows-L{max_len}.npy"))
    return TokenWindows(folder, max_len, special_ids(load_tokenizer(vocab)))


# ----------------------------------------------------------------------------------------------
# 6. Files written whole or not at all, and progress lines on long steps (here and in run.py)
# ----------------------------------------------------------------------------------------------
def is_disk_full(error, folder=None):
    """Whether a failed write ran out of space, by what each writer raises (on the error or its cause): ENOSPC or
    EDQUOT as an errno or in safetensors' words, numpy's "N requested and M written", torch.save's "unexpected pos";
    another RuntimeError when less than 1 MiB is left in folder."""
    import errno
    for e in (error, error.__cause__, error.__context__):
        text = str(e) if e is not None else ""
        if (getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or re.search(r"\d+ requested and \d+ written", text)
                or any(w in text for w in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "unexpected pos"))):
            return True
    try:
        return folder is not None and isinstance(error, RuntimeError) and shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def format_bytes(n):
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 2**shift:
            return f"{n / 2**shift:.1f} {unit}"
    return f"{n} B"


def disk_full_line(folder, what, needs, kept, fix):
    """The one line (a DataError) for a write into folder that found the disk full: needs, free, kept, fix."""
    existing = next(p for p in (Path(folder).absolute(), *Path(folder).absolute().parents) if p.exists())
    free = format_bytes(shutil.disk_usage(existing).free)
    return DataError(f"{folder}: the disk is full ({what} {format_bytes(needs)}, {free} free); {kept}{fix}")


def temporary_name(path):
    """Where `path` is written before its rename: '.NAME.PID@HOST.tmp' beside it, naming its writer (_is_stale)."""
    path = Path(path)
    return path.parent / f".{path.name}.{os.getpid()}@{socket.gethostname()}.tmp"


def atomic_write(path, write):
    """write(a temporary path), then rename it to path: a kill or a full disk never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path, text):
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:   # (np.save(name) would append '.npy' to the temporary name)
            np.save(f, array)
    atomic_write(path, write)


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
    """A temporary no live process will rename: its PID (in the name) is gone from this host (another host's is never
    judged), or, with no PID in the name, nothing wrote to it for UNOWNED_TEMP_S seconds."""
    here = socket.gethostname()
    if owner := re.search(r"\.(\d+)@(.+)\.tmp$", tmp.name):                         # '.NAME.PID@HOST.tmp'
        pid, host = int(owner[1]), owner[2]
    elif owner := re.fullmatch(r"\.(?:tokens|word_starts)\.bin\.(\d+)\.tmp", tmp.name):  # an older data.py's
        pid, host = int(owner[1]), here
    else:
        return time.time() - tmp.stat().st_mtime > UNOWNED_TEMP_S
    return host == here and not _is_alive(pid)


def remove_dead_temporaries(folder, say=False, locked=False):
    """Delete killed writers' temporaries: all, subfolders too, in a folder held locked; else those _is_stale."""
    n, size = 0, 0
    for tmp in (Path(folder).rglob if locked else Path(folder).glob)(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):  # renamed or removed meanwhile, by its writer or another cleaner
            if locked or _is_stale(tmp):
                size += tmp.stat().st_size
                tmp.unlink()
                n += 1
    if n and say:
        print(f"{folder}: removed {n} temporary file(s) of killed writers ({size / 2**20:.1f} MiB)", flush=True)


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
    """A line every PROGRESS_EVERY_S s on rank 0 while a long step runs (total 0: no ETA); add(n) as items are done."""

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


def main(argv):
    """python data.py CORPUS OUT_VOCAB [SIZE]: an uncased WordPiece vocabulary of at most SIZE entries (30,522)
    trained on a corpus, for a model trained from scratch (pass it with --vocab and --vocab_size)."""
    if len(argv) not in (2, 3) or (len(argv) == 3 and not argv[2].isdigit()):
        sys.exit("usage: python data.py CORPUS OUT_VOCAB [SIZE]")
    try:
        tokenizer = train_wordpiece(iter_pretraining_texts(argv[0]), argv[1], *map(int, argv[2:]))
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"{argv[1]}: {tokenizer.get_vocab_size():,} entries, trained on {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
