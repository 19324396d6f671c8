"""The token cache, beneath run/__init__.py (load_windows calls token_windows): a corpus tokenized once, by rank 0
and a pool of workers, into memory-mapped arrays (tokens, word starts, document offsets) that every later run, rank
and --resume maps; a manifest of sizes and CRC-32s vouches for them, and a changed corpus or a damaged file is one
line."""
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import socket
import time
import zlib
from pathlib import Path

import numpy as np
import torch

import data
from run import files, ranks

# ----------------------------------------------------------------------------------------------
# Token cache: a corpus tokenized once into memory-mapped arrays, windows cut from them
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
SHARED_WAIT_S = 60           # how long every rank looks for the marker rank 0 leaves in the cache folder (NFS may
                             # show another node's new file up to its attribute cache's 60 s late)
TOKEN_FILES = ("tokens.bin", "word_starts.bin", "doc_offsets.npy")   # what the manifest vouches for
CRC_EVERY_USE_BYTES = 1 << 30   # files up to this total have their CRC-32s checked on every use
UNOWNED_TEMP_S = 3600        # a temporary whose name has no PID is stale when unwritten this long


def corpus_signature(corpus, vocab):
    """What a token cache was built from: a cache whose manifest differs in any of these is stale."""
    records = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in data.corpus_files(corpus)]
    return {"version": TOKEN_CACHE_VERSION, "files": records, "vocab_sha256": files.sha256_of(vocab)}


def token_cache_folder(corpus, vocab, cache_dir="", max_len=None, flag="--cache_dir DIR", suffix=""):
    """<corpus>.tokens-<vocab hash><suffix> next to the corpus, or inside cache_dir. Next to a read-only corpus only a
    complete cache (_is_complete, with the windows of max_len) is used as it is; else one line naming `flag`."""
    corpus = Path(corpus)
    parent = Path(cache_dir) if cache_dir else corpus.resolve().parent
    folder = parent / f"{corpus.name}.tokens-{files.sha256_of(vocab)[:8]}{suffix}"
    if not cache_dir and not os.access(parent, os.W_OK) and not _is_complete(folder, corpus, vocab, max_len):
        raise data.DataError(f"{parent}: cannot write the token cache next to the corpus (read-only), and no complete "
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
    _worker_tokenizer = data.load_tokenizer(vocab)


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
    for file in data.corpus_files(corpus):
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
            raise data.DataError(_stuck_line(pool, folder)) from None


def _close_pool(pool, folder):
    """The workers leave when the tasks run out: wait for each, at most WORKER_SILENCE_S in all."""
    pool.close()
    deadline = time.monotonic() + WORKER_SILENCE_S
    for worker in pool._pool:                        # (the pool's processes: Pool has no public name for them)
        worker.join(max(0.0, deadline - time.monotonic()))
    if any(worker.is_alive() for worker in pool._pool):
        raise data.DataError(_stuck_line(pool, folder))
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


def build_token_cache(corpus, vocab, folder, workers=0, chunk_chars=1 << 19, verbose=True, bad_bytes="stop",
                      texts=None):
    """Tokenize the corpus into folder (see above): documents stream through worker processes, their ids appended in
    order; every file written under a temporary name and renamed, the manifest last. texts: the documents, when they
    are not the corpus's pre-training texts (data.iter_pretraining_texts): fine-tuning's passages (run/passages.py)."""
    folder = Path(folder)
    signature = corpus_signature(corpus, vocab)    # (a missing corpus stops here, before any folder exists)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    files.remove_dead_temporaries(folder, verbose)
    (folder / "manifest.json").unlink(missing_ok=True)    # first: no rank maps the files while they change
    try:
        _build_token_cache(corpus, vocab, folder, signature, workers, chunk_chars, verbose, bad_bytes, texts)
    except BaseException as e:
        if created:                                 # a corpus error (or Ctrl-C) leaves no half-built cache
            shutil.rmtree(folder, ignore_errors=True)
        if files.is_disk_full(e):
            raise files.disk_full_line(folder, "the token cache needs about", cache_bytes_needed(corpus, vocab), "",
                                 "free some space, or give --cache_dir on another disk") from None
        raise


def cache_bytes_needed(corpus, vocab, chars_per_token=4.0):
    """About the bytes of a corpus's token cache: per token its id (2 or 4) and word start (1), ~4 characters each."""
    return int(corpus_chars(corpus) / chars_per_token * ((2 if data.vocab_size_of(vocab) <= 1 << 16 else 4) + 1))


def _build_token_cache(corpus, vocab, folder, signature, workers, chunk_chars, verbose, bad_bytes="stop", texts=None):
    dtype = np.uint16 if data.vocab_size_of(vocab) <= 1 << 16 else np.uint32
    tmp = {name: files.temporary_name(folder / name) for name in ("tokens.bin", "word_starts.bin")}
    lengths, n_tokens, over_long, t0 = [np.zeros(1, np.int64)], 0, 0, time.time()
    progress = files.ProgressLine(f"tokenizing {corpus}:", corpus_chars(corpus), "chars", rank=0 if verbose else 1)
    try:
        with open(tmp["tokens.bin"], "wb") as tok_f, open(tmp["word_starts.bin"], "wb") as ws_f:
            pool = _pool(vocab, workers)
            try:
                texts = data.iter_pretraining_texts(corpus, bad_bytes) if texts is None else texts
                chunks = _chunks(texts, chunk_chars)
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
            raise data.DataError(f"{corpus}: empty corpus (no non-blank document)" if len(lengths) == 1 else
                            f"{corpus}: every document tokenized to nothing")
        for name, path in tmp.items():
            os.replace(path, folder / name)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    offsets = np.cumsum(np.concatenate(lengths))
    files.atomic_save_npy(folder / "doc_offsets.npy", offsets)
    for stale in [*folder.glob("windows-*"), *folder.glob("idf-*.npy")]:    # cut or counted from the old tokens
        stale.unlink()
    seconds = time.time() - t0
    files.atomic_write_json(folder / "manifest.json", {
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
        cuts = data._cut_points(word_starts[a:b].tolist(), body)
        out.extend((a + x, a + y) for x, y in itertools.pairwise(cuts) if y - x >= min_tokens or len(cuts) == 2)
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _unreadable(folder, what):
    return data.DataError(f"{folder}: cannot read the token cache ({what}); delete the folder to rebuild it "
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
        raise data.DataError(f"{folder}: no windows: every document tokenized to nothing")
    n_tokens = int((bounds[:, 1] - bounds[:, 0]).sum()) + 2 * len(bounds)     # [CLS] and [SEP] included
    files.atomic_save_npy(Path(folder) / name, bounds)
    files.atomic_write_json(Path(folder) / f"windows-L{max_len}.json",                  # last: its presence means done
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
        return data.Window([self.special["cls"]] + self.tokens[a:b].tolist() + [self.special["sep"]],
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
            raise data.DataError(f"rank {rank}: waited {time.time() - t0:.0f} s for rank 0 to build {what}{quiet}; "
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


def check_every_rank_sees(folder):
    """Under torchrun, before the cache is built or read: the folder rank 0 writes must be the one every rank reads.
    Rank 0 leaves a marker file in it and every rank looks for it, at most SHARED_WAIT_S; a cache folder that some
    node cannot see (a node-local --cache_dir, or a corpus on each node's own disk) is one line within a minute,
    naming the hosts, where their ranks would otherwise wait CACHE_STALL_S for files that never appear."""
    if not ranks._distributed():
        return
    marker = [""]
    if ranks._rank() == 0:
        with contextlib.suppress(OSError):   # (a folder rank 0 cannot write: the build says so, in one line)
            folder.mkdir(parents=True, exist_ok=True)
            path = files.temporary_name(folder / "rank0-marker")   # '.NAME.PID@HOST.tmp': a killed run's goes
            path.write_bytes(b"")
            marker[0] = path.name
    torch.distributed.broadcast_object_list(marker, src=0)
    if not marker[0]:
        return
    deadline = time.time() + SHARED_WAIT_S
    while not (seen := (folder / marker[0]).exists()) and time.time() < deadline:
        time.sleep(1)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (seen, socket.gethostname()))
    if ranks._rank() == 0:
        (folder / marker[0]).unlink(missing_ok=True)
    if blind := sorted({host for seen, host in everyone if not seen}):
        raise data.DataError(f"{folder}: the token cache folder that rank 0 writes on {everyone[0][1]} is not visible "
                             f"from {', '.join(blind)} (waited {SHARED_WAIT_S} s for a file rank 0 wrote in it); give "
                             f"--cache_dir a folder on a file system that every node shares")


def token_windows(corpus, vocab, max_len, rank=0, cache_dir="", workers=0, verbose=True, bad_bytes="stop"):
    """A corpus's pre-training windows (TokenWindows) from its token cache: built once (rank 0), checked every use."""
    folder = token_cache_folder(corpus, vocab, cache_dir, max_len)
    check_every_rank_sees(folder)                          # under torchrun: one folder for all nodes
    signature = corpus_signature(corpus, vocab)
    if rank == 0 and folder.is_dir():
        files.remove_dead_temporaries(folder, verbose)
    rank0_builds(lambda: _is_ready(_cache_problem(folder, signature), folder, "rebuilding it", rank == 0),
                 lambda: build_token_cache(corpus, vocab, folder, workers, verbose=verbose, bad_bytes=bad_bytes), rank,
                 f"the token cache {folder}", folder)
    rank0_builds(lambda: _is_ready(_windows_problem(folder, max_len), folder, "cutting the windows again", rank == 0),
                 lambda: _write_windows(folder, max_len), rank, str(folder / f"windows-L{max_len}.npy"))
    return TokenWindows(folder, max_len, data.special_ids(data.load_tokenizer(vocab)))
