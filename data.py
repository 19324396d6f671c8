"""Text and tokens: the data module every script shares; it imports no other module of this project. What a
method file uses from it, in its reading order (run.load_windows maps the windows from the token cache, run/cache.py):
  Window, word_starts      a window [CLS] x_1 .. x_m [SEP] of token ids; word_starts[i] = 1 where a word begins
  most_frequent_token      the corpus' most frequent token: the MLM and decoder accuracies' trivial baseline
  load_tokenizer, special_ids   BERT's uncased WordPiece; the ids of [PAD], [UNK], [CLS], [SEP] and [MASK]
  batch_indices            which windows a rank trains on at a micro-step (a function of the step alone: exact resume)
  batch_generator, step_seed   the seeded streams of one micro-step: masks, COSTA's spans, dropout
  pad_batch, mask_tokens   a padded (B, L) batch and its attention mask; BERT's masking (15 %, 80/10/10, -100 else)
  skip_word_mask, word_tables  COSTA's word spans: which words are stopwords or punctuation
  most_frequent_accuracy   an accuracy's chance: how often always predicting the most frequent token is right
  DataError                bad input in one line, 'file:line: what is wrong'
Then the readers (pre-training text, BEIR, MS MARCO, TREC qrels), each bad line one DataError.
"""
import functools
import gzip
import itertools
import json
import math
import os
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
             if hasattr(windows, "tokens") else (w.input_ids[1:-1] for w in windows))
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
# 3. Windows: documents -> [CLS] ... [SEP] of at most max_len tokens, with word starts
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
# 4. Readers: pre-training text, BEIR, MS MARCO, TREC qrels; a rank's share of a list
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
    """Yield (line_number, fields) of a TSV file of n_columns per line (a tuple: the first line's count, if one of them,
    then that count on every line), a header line (first field `header`) skipped."""
    for number, line in read_lines(path):
        fields = line.rstrip("\r\n").split("\t")
        if not line.strip() or (number == 1 and header is not None and fields[0] == header):
            continue
        n_columns = len(fields) if isinstance(n_columns, tuple) and len(fields) in n_columns else n_columns
        if len(fields) != n_columns:
            expected = " or ".join(map(str, n_columns)) if isinstance(n_columns, tuple) else n_columns
            raise DataError(f"{path}:{number}: expected {expected} tab-separated fields, found {len(fields)}")
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


def iter_corpus(path):
    """Yield (line_number, docid, title, text) of a retrieval corpus: BEIR corpus.jsonl, MS MARCO collection.tsv
    ('pid<TAB>text') or Tevatron's corpus.tsv ('pid<TAB>title<TAB>text'; the first line decides which)."""
    if ".jsonl" not in Path(path).suffixes:
        for number, fields in iter_tsv(path, (2, 3)):
            yield number, fields[0], fields[1] if len(fields) == 3 else "", fields[-1]
        return
    for number, obj in iter_jsonl(path):
        if "_id" not in obj or not isinstance(obj.get("text"), str) or not isinstance(obj.get("title") or "", str):
            raise DataError(f"{path}:{number}: a corpus line needs \"_id\", a string \"text\" and a string \"title\" or none")
        yield number, str(obj["_id"]), obj.get("title") or "", obj["text"]


def read_corpus(path):
    """Retrieval corpus {docid: {"title", "text"}} from a file iter_corpus reads."""
    corpus, first_empty = {}, 0
    for number, docid, title, text in iter_corpus(path):
        add_once(corpus, docid, {"title": title, "text": text}, path, number, f"document id {docid!r}")
        first_empty = first_empty or (number if not (title.strip() or text.strip()) else 0)
    if not corpus:
        raise DataError(f"{path}: empty corpus")
    if first_empty:
        warn_empty_documents(corpus, path, first_empty)
    return corpus


def passage_text(doc):
    """A document as one string: title then text (BEIR's and Tevatron's convention)."""
    return f"{doc['title']} {doc['text']}".strip() if doc.get("title") else doc["text"]


def warn_empty_documents(corpus, path, first_line):
    """Documents with neither title nor text stay (qrels may name them), never found by their words: one line."""
    empty = sum(1 for doc in corpus.values() if not (doc["title"].strip() or doc["text"].strip()))
    if empty:
        say_once(f"warning: {path}: {empty:,} of {len(corpus):,} documents have no text (the first at line "
                 f"{first_line}); they stay in the corpus")


def read_queries(path):
    """Queries {qid: text} from BEIR queries.jsonl or MS MARCO queries.tsv; an empty query is refused (it would still
    be scored, and rank some document first)."""
    queries = {}
    for number, row in iter_jsonl(path) if ".jsonl" in Path(path).suffixes else iter_tsv(path, 2):
        if isinstance(row, dict) and ("_id" not in row or not isinstance(row.get("text"), str)):
            raise DataError(f"{path}:{number}: a query line needs \"_id\" and a string \"text\"")
        qid, text = (str(row["_id"]), row["text"]) if isinstance(row, dict) else row
        if not text.strip():
            raise DataError(f"{path}:{number}: empty query text")
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


def shard(n_items, rank, world):
    """Contiguous shard of range(n_items) for a rank (sizes differ by at most one; no item twice or lost)."""
    bounds = np.linspace(0, n_items, world + 1).round().astype(int)
    return range(bounds[rank], bounds[rank + 1])
