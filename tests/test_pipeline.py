"""Pipeline tests: data.py, the shared encoder, the training loop (torchrun, resume), the method files'
shared blocks, fine-tuning and evaluation. Loss equations are proven in test_losses.py.

    pytest -q test_pipeline.py
"""
import ast
import contextlib
import dataclasses
import gzip
import importlib
import importlib.util
import io
import json
import math
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import costa
import data
import evaluate
import finetune
import run
import run.vocab
from research import mechanisms

HERE = Path(__file__).resolve().parent.parent   # the repository root
PY = sys.executable


@pytest.fixture(scope="module")
def wiki_texts():
    return data.read_pretraining_texts(data.WIKI)[:20]


def tiny_config(**overrides):
    fields = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_len=64, batch_size=4,
                  dropout=0.1, steps=6, log_every=1, save_every=100)
    return costa.Config(**{**fields, **overrides})


# ----------------------------------------------------------------------------------------------
# Tokenizer, windows, masking
# ----------------------------------------------------------------------------------------------
def test_tokenizer_is_bert_uncased(tokenizer):
    assert tokenizer.get_vocab_size() == 30522
    assert data.special_ids(tokenizer) == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    assert tokenizer.encode("Héllo, Anarchism!").tokens == ["hello", ",", "ana", "##rch", "##ism", "!"]


def test_train_wordpiece_on_a_small_corpus(tmp_path, wiki_texts):
    new = run.vocab.train_wordpiece(wiki_texts, tmp_path / "vocab.txt", vocab_size=2000)
    assert 1000 < new.get_vocab_size() <= 2000
    assert data.special_ids(new)["pad"] == 0
    assert len(new.encode("the political philosophy").ids) >= 3


def test_data_py_trains_a_vocabulary_from_the_command_line(tmp_path, small_corpus):
    out = subprocess.run([PY, "-m", "run.vocab", str(small_corpus), str(tmp_path / "v.txt"), "1000"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n = data.vocab_size_of(tmp_path / "v.txt")
    assert 500 < n <= 1000 and out.stdout.strip() == f"{tmp_path / 'v.txt'}: {n:,} entries, trained on {small_corpus}"
    bad = subprocess.run([PY, "-m", "run.vocab", str(tmp_path / "missing.txt"), str(tmp_path / "w.txt")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "missing.txt" in bad.stderr
    assert not (tmp_path / "w.txt").exists()


def test_windows_are_bounded_and_mark_word_starts(tokenizer, wiki_texts):
    windows = data.make_windows(tokenizer, wiki_texts, max_len=64)
    assert len(windows) > 50
    for w in windows:
        assert len(w.input_ids) <= 64 and len(w.input_ids) == len(w.word_starts)
        assert w.input_ids[0] == 101 and w.input_ids[-1] == 102
        assert not w.word_starts[0] and not w.word_starts[-1]
        tokens = [tokenizer.id_to_token(i) for i in w.input_ids[1:-1]]
        for token, start in zip(tokens, w.word_starts[1:-1]):
            if token.startswith("##"):
                assert not start, token          # a continuation piece never starts a word
        assert w.word_starts[1] or tokens[0].startswith("##")  # windows start on a word if they can


def test_windows_do_not_split_words_and_lose_no_tokens(tokenizer):
    text = "internationalization " * 200
    windows = data.make_windows(tokenizer, [text], max_len=16, min_tokens=1)
    pieces = tokenizer.encode("internationalization").tokens
    body = [i for w in windows for i in w.input_ids[1:-1]]
    assert body == tokenizer.encode(text).ids                 # every token, in order, exactly once
    for w in windows:
        assert len(w.input_ids[1:-1]) % len(pieces) == 0      # cut between whole words only


def test_a_document_of_no_tokens_gives_no_window_and_costa_batches_still_build(tokenizer):
    texts = ["\u200b\u200b\u200d", "the political philosophy of a small town in the north of england"]
    windows = data.make_windows(tokenizer, texts, max_len=16, min_tokens=1)
    assert windows and all(len(w.input_ids) > 2 for w in windows)   # was a bare [CLS] [SEP] window
    c = costa.Config(batch_size=len(windows), steps=1)
    batch = costa.Batches(c, windows, 0, 1)[0]  # sample_spans raised
    assert batch["spans"].shape == (len(windows), 4 * c.span_T, 2)


def test_masking_statistics_on_real_text(tokenizer, wiki_texts):
    windows = data.make_windows(tokenizer, wiki_texts, max_len=128)
    ids, attention = data.pad_batch([w.input_ids for w in windows])
    maskable = attention.bool() & (ids != 101) & (ids != 102)
    masked, labels = data.mask_tokens(ids, maskable, 30522, 103, torch.Generator().manual_seed(0))
    chosen = labels != -100
    assert not chosen[~maskable].any()                        # never [CLS], [SEP] or padding
    assert torch.equal(labels[chosen], ids[chosen])
    assert abs(chosen.sum() / maskable.sum() - 0.15) < 0.01
    to_mask = (masked == 103) & chosen
    unchanged = (masked == ids) & chosen
    assert abs(to_mask.sum() / chosen.sum() - 0.8) < 0.02
    assert abs(unchanged.sum() / chosen.sum() - 0.1) < 0.02   # (random ids rarely hit the original)
    assert torch.equal(masked[~chosen], ids[~chosen])         # tokens not chosen are untouched


def test_pad_batch():
    ids, mask = data.pad_batch([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_rank_batches_cover_each_epoch_once_without_overlap():
    n, b, world = 103, 5, 3
    per_epoch = data.batches_per_epoch(n, b, world)
    for epoch in range(2):
        seen = []
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            batches = [data.batch_indices(n, b, r, world, 0, step) for r in range(world)]
            assert all(len(x) == b for x in batches)
            seen += [i for x in batches for i in x]
        assert len(seen) == len(set(seen)) == n - n % (b * world)
    assert data.batch_indices(n, b, 1, world, 0, 7) == data.batch_indices(n, b, 1, world, 0, 7)
    assert data.batch_indices(n, b, 1, world, 0, 0) != data.batch_indices(n, b, 1, world, 0, per_epoch)
    with pytest.raises(data.DataError, match="fewer than one global batch"):
        data.batches_per_epoch(10, 5, 3)


def test_shard_covers_everything_once():
    for n in (0, 1, 7, 100):
        items = [i for r in range(3) for i in data.shard(n, r, 3)]
        assert items == list(range(n))


# ----------------------------------------------------------------------------------------------
# Readers (small fixtures, malformed lines included)
# ----------------------------------------------------------------------------------------------
def write(path, text, compress=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_pretraining_readers(tmp_path):
    jsonl = write(tmp_path / "a.jsonl.gz", '{"title": "T", "text": "one two"}\n\n{"text": "three"}\n', True)
    assert data.read_pretraining_texts(jsonl) == ["T. one two", "three"]
    plain = write(tmp_path / "b.txt", "first doc.\nstill first.\n\nsecond doc.\n")
    assert data.read_pretraining_texts(plain) == ["first doc.\nstill first.", "second doc."]
    assert len(data.read_pretraining_texts(tmp_path)) == 4                      # a folder of both
    with pytest.raises(data.DataError, match=r"c\.jsonl:2: malformed JSON"):
        data.read_pretraining_texts(write(tmp_path / "c.jsonl", '{"text": "ok"}\n{"text": "bad\n'))
    with pytest.raises(data.DataError, match=r"d\.jsonl:1: no string field \"text\""):
        data.read_pretraining_texts(write(tmp_path / "d.jsonl", '{"body": "x"}\n'))
    with pytest.raises(data.DataError, match="empty corpus"):
        data.read_pretraining_texts(write(tmp_path / "e.txt", "\n\n  \n"))
    with pytest.raises(data.DataError, match="file not found"):
        data.read_pretraining_texts(tmp_path / "missing.txt")


def test_wikiextractor_folders_are_read_recursively_in_both_formats_and_bad_bytes_can_be_skipped(
        tmp_path, capsys):
    """WikiExtractor writes text/AA/wiki_00 (no extension), as JSON lines (--json) or <doc> blocks; both read as
    the same documents, its nested folders too. Seen failing on the old code (the folder read nothing)."""
    docs = [("Anarchism", "Anarchism is a philosophy.\nIt has a history."), ("Autism", "Autism is a condition.")]
    as_json = "".join(json.dumps({"id": str(i), "url": "u", "title": t, "text": x}) + "\n"
                      for i, (t, x) in enumerate(docs))
    as_doc = "".join(f'<doc id="{i}" url="u" title="{t}">\n{t}\n\n{x}\n</doc>\n' for i, (t, x) in enumerate(docs))
    write(tmp_path / "json" / "AA" / "wiki_00", as_json)
    write(tmp_path / "doc" / "AA" / "wiki_00", as_doc)
    write(tmp_path / "doc" / "AB" / "wiki_01", as_doc)
    expected = [f"{t}. {x}" for t, x in docs]
    assert data.read_pretraining_texts(tmp_path / "json") == expected
    assert data.read_pretraining_texts(tmp_path / "doc") == expected * 2                # AA then AB
    with pytest.raises(data.DataError, match=r"wiki_02:7: this <doc> has no </doc>"):
        data.read_pretraining_texts(write(tmp_path / "cut" / "wiki_02", as_doc[:-7]))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"first doc.\n\nsecond \xff doc.\n\nthird doc.\n")
    with pytest.raises(data.DataError, match=r"bad\.txt:3: byte 0xff"):
        data.read_pretraining_texts(bad)                                              # --bad_bytes stop
    capsys.readouterr()
    assert data.read_pretraining_texts(bad, bad_bytes="skip") == ["first doc.", "third doc."]
    assert capsys.readouterr().out == (f"warning: {bad}: skipped 1 lines with bytes that are not UTF-8 "
                                       f"(--bad_bytes skip; the first at line 3)\n")


def test_streaming_reader_splits_plain_text_as_split_on_blank_lines(tmp_path):
    text = "\nfirst\n\n\n\nsecond\n \nstill second\n\n  \n\nthird\r\n\r\nfourth"
    path = write(tmp_path / "odd.txt", text)
    expected = [d.strip() for d in text.replace("\r\n", "\n").split("\n\n") if d.strip()]
    assert list(data.iter_pretraining_texts(path)) == expected == ["first", "second\n \nstill second", "third", "fourth"]


# ----------------------------------------------------------------------------------------------
# Token cache: memory-mapped shards, windows cut from them
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def small_cache_corpus(tmp_path, wiki_texts):
    """Real Wikipedia documents in two files of a folder (jsonl.gz and plain text) plus an empty one."""
    folder = tmp_path / "corpus"
    write(folder / "a.jsonl.gz", "".join(json.dumps({"text": t}) + "\n" for t in wiki_texts[:6]), True)
    write(folder / "b.txt", "\n\n".join(wiki_texts[6:10] + ["\u200b\u200b"]) + "\n")
    return folder


def test_token_cache_windows_equal_make_windows(tokenizer, small_cache_corpus):
    texts = data.read_pretraining_texts(small_cache_corpus)
    for max_len in (64, 128):
        windows = run.cache.token_windows(small_cache_corpus, data.VOCAB, max_len, workers=2, verbose=False)
        expected = data.make_windows(tokenizer, texts, max_len)
        assert len(windows) == len(expected) and [windows[i] for i in range(len(windows))] == expected
        assert windows.n_tokens == sum(len(w.input_ids) for w in expected)
    manifest = json.loads((windows.folder / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["n_docs"] == len(texts)   # the zero-width one: no token, no window
    assert windows.folder.parent == small_cache_corpus.parent                   # next to the corpus


def test_token_cache_is_reused_and_rebuilt_when_the_corpus_changes(small_cache_corpus, monkeypatch):
    first = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
    built = []
    real_build = run.cache.build_token_cache
    monkeypatch.setattr(run.cache, "build_token_cache", lambda *a, **k: built.append(1) or real_build(*a, **k))
    again = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
    assert built == [] and len(again) == len(first)                             # second run: no tokenizing
    with open(small_cache_corpus / "b.txt", "a", encoding="utf-8") as f:
        f.write("\na new document about the political philosophy of anarchism and its history\n")
    changed = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
    assert built == [1] and len(changed) == len(first) + 1
    assert not list(changed.folder.glob(".*.tmp"))                              # no temporary left behind


def test_token_windows_pickle_as_their_folder_and_feed_costa_batches(small_cache_corpus, tokenizer):
    import pickle
    windows = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
    blob = pickle.dumps(windows)
    assert len(blob) < 1000                                                     # not the arrays
    assert pickle.loads(blob)[3] == windows[3]
    c = costa.Config(batch_size=8, steps=1)
    from_cache = costa.Batches(c, windows, 0, 1)[0]
    in_memory = costa.Batches(c, [windows[i] for i in range(len(windows))], 0, 1)[0]
    assert all(torch.equal(from_cache[k], in_memory[k]) for k in in_memory)


def test_cpdae_cached_idf_equals_compute_idf(small_cache_corpus):
    import cpdae
    from test_losses import compute_idf
    windows = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
    idf = cpdae.cached_idf(windows, 30522, rank=0, chunk=7)                     # chunks that cut anywhere
    assert torch.equal(idf, compute_idf([windows[i] for i in range(len(windows))], 30522))
    assert torch.equal(cpdae.cached_idf(windows, 30522, rank=1), idf)           # read back, not rebuilt


def test_token_cache_refuses_an_empty_corpus_and_keeps_nothing(tmp_path):
    for name, text in (("blank.txt", "\n\n  \n"), ("invisible.txt", "\u200b\u200d\n\n\u200b\n")):
        with pytest.raises(data.DataError, match="empty corpus" if name == "blank.txt" else "tokenized to nothing"):
            run.cache.token_windows(write(tmp_path / name, text), data.VOCAB, 64, verbose=False)
        folder = run.cache.token_cache_folder(tmp_path / name, data.VOCAB)
        assert not folder.exists() or not any(folder.iterdir())              # no manifest, no temporary


def test_other_ranks_wait_for_rank0_and_give_up_with_a_clear_error(monkeypatch):
    calls = []
    run.cache.rank0_builds(lambda: False, lambda: calls.append("built"), 0, "x")
    run.cache.rank0_builds(lambda: True, lambda: calls.append("built by rank 1"), 1, "x")
    assert calls == ["built"]
    monkeypatch.setattr(run.cache, "CACHE_WAIT_S", 0)
    with pytest.raises(data.DataError, match="rank 1: waited 0 s for rank 0 to build the cache; did rank 0 fail"):
        run.cache.rank0_builds(lambda: False, lambda: None, 1, "the cache")


def test_other_ranks_name_a_rank0_whose_cache_folder_stopped_changing(tmp_path, monkeypatch):
    """Under torchrun the other ranks wait for rank 0's build; a rank 0 that writes nothing for CACHE_STALL_S is
    named (its folder, how long), not waited on for CACHE_WAIT_S (6 hours)."""
    (tmp_path / ".tokens.bin.123@host.tmp").write_bytes(b"x")
    os.utime(tmp_path / ".tokens.bin.123@host.tmp", (time.time() - 30, time.time() - 30))
    monkeypatch.setattr(run.cache, "CACHE_STALL_S", 2)
    t0 = time.time()
    with pytest.raises(data.DataError, match=rf"rank 1: waited \d+ s for rank 0 to build the cache; nothing in "
                                             rf"{re.escape(str(tmp_path))} changed for \d+ s; did rank 0 fail or hang"):
        run.cache.rank0_builds(lambda: False, lambda: None, 1, "the cache", tmp_path)
    assert time.time() - t0 < 10


def test_token_cache_in_cache_dir_when_the_corpus_folder_is_read_only(tmp_path, small_cache_corpus):
    if os.geteuid() == 0:    # root writes anywhere: simulate the read-only folder
        real_access = os.access
        os.access = lambda path, mode: False if Path(path) == small_cache_corpus.parent else real_access(path, mode)
    else:
        small_cache_corpus.parent.chmod(0o555)
    try:
        with pytest.raises(data.DataError, match="read-only.*--cache_dir"):
            run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
        windows = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, cache_dir=tmp_path / "cache", verbose=False)
        assert windows.folder.parent == tmp_path / "cache" and len(windows) > 0
    finally:
        if os.geteuid() == 0:
            os.access = real_access
        else:
            small_cache_corpus.parent.chmod(0o755)


def test_beir_readers_and_errors(tmp_path):
    beir = tmp_path / "beir"
    write(beir / "corpus.jsonl", '{"_id": "d1", "title": "A", "text": "x"}\n{"_id": "d2", "text": "y"}\n')
    write(beir / "queries.jsonl.gz", '{"_id": "q1", "text": "what"}\n{"_id": "q2", "text": "who"}\n', True)
    write(beir / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\nq1\td2\t2\n")
    corpus, queries, qrels = data.load_beir(beir, "test")
    assert corpus == {"d1": {"title": "A", "text": "x"}, "d2": {"title": "", "text": "y"}}
    assert queries == {"q1": "what"} and qrels == {"q1": {"d2": 2}}
    write(beir / "qrels" / "bad.tsv", "query-id\tcorpus-id\tscore\nq1\td9\t1\n")
    with pytest.raises(data.DataError, match="'d9'.*not in the corpus"):
        data.load_beir(beir, "bad")
    write(beir / "qrels" / "badq.tsv", "q7\td1\t1\n")
    with pytest.raises(data.DataError, match="'q7' is not in the queries"):
        data.load_beir(beir, "badq")
    write(beir / "qrels" / "short.tsv", "query-id\tcorpus-id\tscore\nq1\td1\n")
    with pytest.raises(data.DataError, match=r"short\.tsv:2: expected"):
        data.load_beir(beir, "short")
    write(beir / "qrels" / "nan.tsv", "q1 0 d1 high\n")
    with pytest.raises(data.DataError, match=r"nan\.tsv:1: relevance grade 'high'"):
        data.load_beir(beir, "nan")
    with pytest.raises(data.DataError, match=r"corpus\.jsonl:1: a corpus line needs"):
        data.read_corpus(write(tmp_path / "c2" / "corpus.jsonl", '{"id": "d1", "text": "x"}\n'))
    with pytest.raises(data.DataError, match="dev.tsv: file not found"):
        data.load_beir(beir, "dev")


def test_msmarco_and_trec_readers(tmp_path):
    collection = write(tmp_path / "collection.tsv", "0\tthe first passage\n1\tthe second\n")
    assert data.read_corpus(collection)["1"] == {"title": "", "text": "the second"}
    queries = write(tmp_path / "queries.dev.tsv", "42\twhat is it\n")
    assert data.read_queries(queries) == {"42": "what is it"}
    qrels = write(tmp_path / "qrels.dev.tsv", "42 0 1 1\n42 0 0 0\n")
    assert data.read_qrels(qrels) == {"42": {"1": 1, "0": 0}}
    with pytest.raises(data.DataError, match=r"bad\.tsv:2: expected 2 tab-separated fields, found 1"):
        data.read_corpus(write(tmp_path / "bad.tsv", "0\tok\nbroken line\n"))


def test_run_files_round_trip_atomically(tmp_path):
    run = {"q1": {"d1": 0.5, "d2": 1.5}, "q2": {"d3": -1.0}}
    path = tmp_path / "run.trec"
    evaluate.write_run(path, run, tag="test")
    lines = path.read_text().splitlines()
    assert lines[0] == "q1 Q0 d2 1 1.500000 test" and lines[1] == "q1 Q0 d1 2 0.500000 test"
    assert evaluate.read_run(path) == run
    assert [p.name for p in tmp_path.iterdir()] == ["run.trec"]               # no temporary left over
    with pytest.raises(data.DataError, match=r"bad\.trec:1: expected 6 fields"):
        evaluate.read_run(write(tmp_path / "bad.trec", "q1 Q0 d1 1 0.5\n"))


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "state.pt"
    run.folders.save_training_state(path, {"step": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        run.folders.save_training_state(path, {"step": 2, "bad": Unpicklable()})
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


# ----------------------------------------------------------------------------------------------
# The shared encoder against transformers' BERT, and the Hugging Face folder
# ----------------------------------------------------------------------------------------------
def random_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 30000, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_encoder_equals_transformers_bert(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_size=128)
    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(config).eval()   # transformers' own random init
    reference.save_pretrained(tmp_path)
    ours = run.hub.load_pretrained(costa.Encoder, tmp_path, costa.Config()).eval()
    assert (ours.config.hidden_size, ours.config.num_layers, ours.config.num_heads) == (64, 3, 4)
    ids, mask = random_inputs()
    with torch.no_grad():
        theirs = reference.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        mine = ours(ids, mask)
        real = mask.bool()
        assert (mine - theirs)[real].abs().max() <= 1e-5
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.3] = -100
        labels[mask == 0] = -100
        mlm, _, n = costa.mlm_loss(mine, labels, ours.mlm_head)
        assert n > 0 and abs(mlm - reference(input_ids=ids, attention_mask=mask, labels=labels).loss) < 1e-5


def test_the_plain_attention_is_sdpa_and_the_former_encoder_computes_the_same_function():
    """The shared encoder is plain torch: attention as its formula equals SDPA (a hidden key gets weight 0), dropout
    is torch's (the same mask for the same seed, 1 / (1 - p) on the rest); the benchmark's former encoder (PCG64
    masks, a CPU attention path) computes the same function with dropout off, so its row times the same step."""
    from research import benchmark
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 4, generator=g) for _ in range(3))
    attend = torch.ones(3, 1, 1, 7, dtype=torch.bool)
    attend[0, ..., 4:] = False
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
    torch.testing.assert_close(costa.attention(q, k, v, attend), sdpa)
    torch.testing.assert_close(benchmark._former_attention(q, k, v, attend), sdpa)
    torch.manual_seed(3)
    dropped = costa.attention(q, k, v, attend, 0.5)
    torch.manual_seed(3)
    assert torch.equal(costa.attention(q, k, v, attend, 0.5), dropped) and not torch.allclose(dropped, sdpa)
    x = torch.randn(1000, 100)
    y = benchmark._former_dropout(x, 0.1)
    assert torch.allclose(y[y != 0], x[y != 0] / 0.9) and abs((y == 0).float().mean().item() - 0.1) < 0.01


def test_hf_folder_round_trip_and_bin_checkpoints(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = costa.Encoder(tiny_config(dropout=0.0)).eval()
    run.hub.save_pretrained(ours, tmp_path / "enc")
    assert {p.name for p in (tmp_path / "enc").iterdir()} == {
        "config.json", "model.safetensors", "model.safetensors.sha256", "vocab.txt", "tokenizer_config.json"}
    hf = transformers.AutoModel.from_pretrained(tmp_path / "enc").eval()
    ids, mask = random_inputs()
    with torch.no_grad():
        expected = ours(ids, mask)
        assert (hf(input_ids=ids, attention_mask=mask).last_hidden_state - expected)[mask.bool()].abs().max() < 1e-5
        back = run.hub.load_pretrained(costa.Encoder, tmp_path / "enc", costa.Config()).eval()
        assert torch.equal(back(ids, mask), expected)
        assert torch.equal(back.mlm_head.bias, ours.mlm_head.bias)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "enc")
    assert tok("Hello world")["input_ids"] == [101, 7592, 2088, 102]
    # An old-style folder: pytorch_model.bin, 'bert.' prefix, LayerNorm gamma/beta, a pooler to ignore.
    old = tmp_path / "old"
    old.mkdir()
    state = {run.hub.to_hf_name(k).replace("LayerNorm.weight", "LayerNorm.gamma")
             .replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in ours.state_dict().items()}
    state["bert.pooler.dense.weight"] = torch.zeros(32, 32)
    torch.save(state, old / "pytorch_model.bin")
    (old / "config.json").write_text((tmp_path / "enc" / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(run.hub.load_pretrained(costa.Encoder, old, costa.Config()).eval()(ids, mask), expected)


def test_checkpoint_errors_name_the_problem(tmp_path):
    ours = costa.Encoder(tiny_config())
    run.hub.save_pretrained(ours, tmp_path / "enc")
    with pytest.raises(data.DataError, match="not a Hugging Face model folder"):
        run.hub.load_pretrained(costa.Encoder, tmp_path, costa.Config())
    (tmp_path / "enc" / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    with pytest.raises(data.DataError, match="vocab.txt: 2 entries, but config.json says vocab_size 30522"):
        run.hub.load_pretrained(costa.Encoder, tmp_path / "enc", costa.Config())
    bad = {run.hub.to_hf_name(k): v for k, v in ours.state_dict().items()}
    bad["bert.encoder.layer.0.attention.self.query.weight"] = torch.zeros(8, 8)
    run.hub.save_encoder_folder(tmp_path / "bad", bad, run.hub.hf_config(ours.config))
    with pytest.raises(data.DataError, match=r"attention\.self\.query\.weight has shape \(8, 8\)"):
        run.hub.load_pretrained(costa.Encoder, tmp_path / "bad", costa.Config())


# ----------------------------------------------------------------------------------------------
# Config and command line
# ----------------------------------------------------------------------------------------------
def test_config_overrides_by_field_name():
    parse = lambda argv: run.cli.parse_config(costa.Config, argv, costa.__doc__, costa.PAPER_PRESET, costa.FLAG_RULES)
    c = parse(["--lr", "1e-4", "--steps", "7", "--resume", "--bf16", "false"])
    assert (c.lr, c.steps, c.resume, c.bf16) == (1e-4, 7, True, False)
    paper = parse(["--preset", "paper", "--num_layers", "2"])
    assert (paper.hidden_size, paper.num_layers, paper.max_len) == (768, 2, 512)
    with pytest.raises(SystemExit, match="unknown argument '--learning_rate'"):
        parse(["--learning_rate", "1"])
    with pytest.raises(SystemExit, match="--steps expects int"):
        parse(["--steps", "many"])


@pytest.mark.parametrize("script, expected", [
    # COSTA 4.5.1: 6 epochs, lr 5e-5, 10% warm-up, length 512 (batch not given: no global_batch)
    ("costa", dict(epochs=6.0, lr=5e-5, warmup=0.1, max_len=512, global_batch=0, steps=300)),
    # CPDAE 4.1.3: 3 epochs at m = 64, lr 5e-5, 10% warm-up
    ("cpdae", dict(epochs=3.0, lr=5e-5, warmup=0.1, max_len=512, global_batch=64)),
    # SEED 4.1: 1M steps at 256, lr 1e-4, 10k warm-up steps, length 512, from scratch
    ("seed", dict(steps=1_000_000, epochs=0.0, lr=1e-4, max_len=512, global_batch=256, init="")),
])
def test_paper_presets_follow_the_papers(script, expected):
    module = __import__(script)
    c = run.cli.parse_config(module.Config, ["--preset", "paper"], "", module.PAPER_PRESET, module.FLAG_RULES)
    assert {k: getattr(c, k) for k in expected} == expected
    assert (c.hidden_size, c.num_layers, c.num_heads, c.ffn_size) == (768, 12, 12, 3072)
    if script == "seed":
        assert int(c.warmup * c.steps) == 10_000                                 # 10k warm-up steps
    source = Path(module.__file__).read_text()
    assert "paper: 6 epochs" not in source or script == "costa"                  # copied comments are gone
    assert "5e-5 from BERT's checkpoint" not in source or script != "seed"


def test_resolve_schedule_from_epochs_and_global_batch():
    c = costa.Config(batch_size=32, grad_accum=1, steps=300)
    assert run.resolve_schedule(c, world=1, n_windows=1000) == c              # both 0: unchanged
    c = dataclasses.replace(c, global_batch=64, epochs=3.0)
    two = run.resolve_schedule(c, world=2, n_windows=1000)
    assert (two.batch_size, two.steps) == (32, 3 * (1000 // 64))                # 15 batches of 64 per epoch
    accum = run.resolve_schedule(dataclasses.replace(c, grad_accum=2), world=4, n_windows=1000)
    assert (accum.batch_size, accum.steps) == (8, 3 * (1000 // 32) // 2)        # epochs count micro-steps
    assert run.resolve_schedule(dataclasses.replace(c, epochs=0.5), 1, 1000).steps == round(0.5 * 15)
    with pytest.raises(ValueError, match="--global_batch 64 is not a multiple of 3 process"):
        run.resolve_schedule(c, world=3, n_windows=1000)


# ----------------------------------------------------------------------------------------------
# Training runs: one process, torchrun with 2 processes, resume
# ----------------------------------------------------------------------------------------------
TINY_ARGS = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "64",
             "--max_len", "64", "--batch_size", "4", "--log_every", "1"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few real Wikipedia articles and snippets of mixed length (so batches pad differently on
    each rank): enough windows for the runs below, fast to tokenize."""
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    articles = data.read_pretraining_texts(data.WIKI)[:8]
    texts = articles[:5] + [" ".join(a.split()[:n]) for a in articles[5:] for n in (6, 15, 30, 45)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run_script(args, cwd, torchrun=False, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
           if torchrun else [PY]) + args
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def read_log(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def test_resume_continues_exactly(tmp_path, small_corpus):
    script = str(HERE / "costa.py")
    common = [script, "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "6"]
    main_run(common + ["--out_dir", str(tmp_path / "straight")], tmp_path)
    main_run(common + ["--out_dir", str(tmp_path / "resumed"), "--halt_at", "3"], tmp_path)
    assert len(read_log(tmp_path / "resumed")) == 3
    out = run_script(common + ["--out_dir", str(tmp_path / "resumed"), "--resume"], tmp_path)   # a new process
    assert "resume:" in out and "at step 3" in out
    straight, resumed = read_log(tmp_path / "straight"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["mlm"] for r in straight] == [r["mlm"] for r in resumed]        # bit-identical losses
    assert (tmp_path / "straight" / "encoder" / "model.safetensors").is_file()
    saved = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert saved["steps"] == 6 and saved["hidden_size"] == 32


def test_epochs_sets_steps_and_both_are_saved(tmp_path, small_corpus):
    out = tmp_path / "run"
    no_batch_size = [a for i, a in enumerate(TINY_ARGS) if "--batch_size" not in TINY_ARGS[max(i - 1, 0):i + 1]]
    corpus = write(tmp_path / "short.jsonl", "".join(small_corpus.read_text().splitlines(True)[2:]))  # ~60 windows
    main_run([str(HERE / "seed.py"), "--corpus", str(corpus), *no_batch_size, "--epochs", "1",
              "--global_batch", "8", "--dec_layers", "1", "--out_dir", str(out)], tmp_path)
    tokenizer = data.load_tokenizer(data.VOCAB)
    n_windows = len(data.make_windows(tokenizer, data.read_pretraining_texts(corpus), 64))
    saved = json.loads((out / "config.json").read_text())
    assert (saved["epochs"], saved["global_batch"], saved["batch_size"]) == (1.0, 8, 8)
    assert saved["steps"] == n_windows // 8 != 300
    assert [r["step"] for r in read_log(out)] == list(range(1, n_windows // 8 + 1))


def test_resume_continues_exactly_with_two_processes(tmp_path, small_corpus):
    common = [str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "4"]
    run_script(common + ["--out_dir", str(tmp_path / "straight")], tmp_path, torchrun=True)
    run_script(common + ["--out_dir", str(tmp_path / "resumed"), "--halt_at", "2"], tmp_path, torchrun=True)
    run_script(common + ["--out_dir", str(tmp_path / "resumed"), "--resume"], tmp_path, torchrun=True)
    straight, resumed = read_log(tmp_path / "straight"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("mlm", "gwc", "gwc_acc"):
        assert [r[key] for r in straight] == [r[key] for r in resumed], key


def test_torchrun_two_processes_on_cpu(tmp_path, small_corpus):
    out = run_script([str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2",
                      "--out_dir", str(tmp_path / "ddp")], tmp_path, torchrun=True)
    assert "2 process(es)" in out and "done:" in out
    assert [r["step"] for r in read_log(tmp_path / "ddp")] == [1, 2]
    assert run.hub.load_pretrained(costa.Encoder, tmp_path / "ddp" / "encoder", costa.Config()).config.hidden_size == 32


def test_bad_input_gives_one_line_error(tmp_path):
    bad = write(tmp_path / "bad.jsonl", '{"text": "fine"}\n{oops}\n')
    result = subprocess.run([PY, str(HERE / "costa.py"), "--corpus", str(bad), "--out_dir", str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: {bad}:2: malformed JSON (Expecting property name enclosed in double quotes)"


# ----------------------------------------------------------------------------------------------
# The shared blocks are byte-identical in every file that carries them
# ----------------------------------------------------------------------------------------------
SHARED_MARKER = re.compile(r"^# --- shared: (begin|end) (.+?) ---$", re.MULTILINE)
METHOD_FILES = [f"{m}.py" for m in run.METHODS]
# Blocks that only some method files carry, each with the reason: {name: "why"}. None today.
METHOD_SPECIFIC = {}


def shared_blocks(name):
    """{block name: text between its markers} of one file. Markers must pair up: each begin closed by
    the end of the same name before the next begin (no nesting), each name once per file."""
    text = (HERE / name).read_text()
    blocks, open_name, start = {}, None, 0
    for marker in SHARED_MARKER.finditer(text):
        kind, block = marker.groups()
        line = text.count("\n", 0, marker.start()) + 1
        if kind == "begin":
            assert open_name is None, f"{name}:{line}: begin '{block}' inside block '{open_name}'"
            assert block not in blocks, f"{name}:{line}: a second block '{block}'"
            open_name, start = block, marker.end()
        else:
            assert open_name == block, f"{name}:{line}: end '{block}' without its begin (open: {open_name})"
            blocks[block], open_name = text[start:marker.start()], None
    assert open_name is None, f"{name}: block '{open_name}' is never closed"
    return blocks


def training_steps(name):
    """The text of train()'s steps in a method file: from its autocast line to training.finish()."""
    text = (HERE / name).read_text()
    start = text.index("    autocast = run.autocast_bf16(device, c.bf16)\n", text.index("\ndef train("))
    return text[start:text.index("    training.finish()\n", start)]


def test_shared_blocks_are_identical_across_files():
    """Every marked block in any .py file: markers balanced, byte-identical wherever it appears, and
    every method file carries every block any method file has (unless METHOD_SPECIFIC says why not)."""
    carriers = {path.name: shared_blocks(path.name) for path in sorted(HERE.glob("*.py"))
                if SHARED_MARKER.search(path.read_text())}
    assert set(METHOD_FILES) <= set(carriers), f"method files without shared blocks: {set(METHOD_FILES) - set(carriers)}"
    method_blocks = set().union(*(carriers[name] for name in METHOD_FILES))
    assert {"encoder", "mlm loss", "distributed", "text vector"} <= method_blocks
    for name in METHOD_FILES:
        missing = method_blocks - set(carriers[name]) - set(METHOD_SPECIFIC)
        assert not missing, f"{name}: no shared block(s) {sorted(missing)} (other method files have them)"
    for block in set().union(*carriers.values()):
        holders = {name: blocks[block] for name, blocks in carriers.items() if block in blocks}
        assert len(holders) > 1 or block in METHOD_SPECIFIC, f"shared block '{block}' appears only in {list(holders)}"
        first, text = next(iter(holders.items()))
        for name, other in holders.items():
            assert other == text, f"{name}: shared block '{block}' differs from {first}"
    steps = {name: training_steps(name) for name in METHOD_FILES}   # train()'s loop: the same in every method file
    assert all(steps.values()) and len(set(steps.values())) == 1, {name: len(text) for name, text in steps.items()}
    assert {"encoder", "distributed"} <= set(carriers["evaluate.py"])  # the retrieval layer's (finetune.py imports it)
    assert "finetune.py" not in carriers                                 # no copies: it imports evaluate.py's
    assert "mechanisms.py" not in carriers                               # nor does mechanisms.py


def test_method_files_read_in_one_sitting():
    """Each method file: its own train() early and short, then only the shared copies the mission asks it
    to own (the encoder, the distributed steps, and the text vector and MLM loss its objective uses)."""
    budgets = {"cpdae.py": (700, 500)}                   # (lines, train() ends by); every other method (650, 450)
    for name, (max_lines, train_by) in ((name, budgets.get(name, (650, 450))) for name in METHOD_FILES):
        lines = (HERE / name).read_text().splitlines()
        start = next(i for i, line in enumerate(lines, 1) if line.startswith("def train("))
        end = next(i for i, line in enumerate(lines[start:], start + 1) if line and not line[0].isspace())
        shared = sum(len(block.splitlines()) + 2 for block in shared_blocks(name).values())
        assert len(lines) <= max_lines and start <= train_by, (name, len(lines), start)
        assert end - start <= 90, f"{name}: train() is {end - start} lines"
        assert shared <= 250, f"{name}: {shared} lines of shared copies"


@pytest.mark.skipif(shutil.which("diff") is None, reason="needs the diff command")
def test_readme_reading_guide_states_the_files_as_they_are():
    """The README's reading guide gives costa.py's size, where train() and the shared copies are, and the
    sizes of `diff costa.py cpdae.py` and `diff costa.py seed.py`: each number as the files have it."""
    readme = (HERE / "README.md").read_text()
    lines = (HERE / "costa.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.startswith("def train("))
    end = next(i for i, line in enumerate(lines[start:], start + 1) if line and not line[0].isspace()) - 1
    while not lines[end - 1].strip():
        end -= 1
    shared = next(i for i, line in enumerate(lines, 1) if line.startswith("# --- shared: begin encoder"))
    guide = " ".join(readme.split())
    assert f"In `costa.py` ({len(lines)} lines)" in guide
    assert f"`train()` ({start}-{end}). By line {end} you have read the whole method" in guide
    assert f"lines {shared - 4}-{len(lines)} are the shared copies" in guide   # from the banner above them
    sizes = [len(subprocess.run(["diff", "costa.py", other], cwd=HERE, capture_output=True, text=True).stdout.splitlines())
             for other in ("cpdae.py", "seed.py")]
    assert f"`diff costa.py cpdae.py` ({sizes[0]} lines; {sizes[1]} for `seed.py`)" in guide
    hunks = [sum(start <= int(re.match(r"\d+", line)[0]) <= end for line in
                 subprocess.run(["diff", "costa.py", other], cwd=HERE, capture_output=True, text=True).stdout.splitlines()
                 if re.match(r"\d", line)) for other in ("cpdae.py", "seed.py")]
    assert f"hunks too ({hunks[0]} against `cpdae.py`, {hunks[1]} against `seed.py`)" in guide


def _markdown_table(text, header_start):
    """The body of the first markdown table in text whose header line starts with header_start, as lists
    of stripped cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


QUICKSTART_ROWS = {"BM25 (k1=1.2, b=0.75)": "eval-test-bm25", "minilm zero-shot": "zero-shot/eval-test",
                   "minilm + fine-tune": "no-pretrain/eval-test", "minilm + costa + fine-tune": "eval-test"}


def test_readme_command1_table_is_its_committed_files():
    """README's table of command 1 is what results/quickstart/rows/ holds: each row's means (4 decimals, as
    the command prints them) from its metrics.json, and '*' where the paired t-test over the queries against
    the BM25 row (evaluate.paired_t_test on the per-query values there) gives p <= 0.05."""
    rows = {name: json.loads((HERE / "results" / "quickstart" / "rows" / folder / "metrics.json").read_text())
            for name, folder in QUICKSTART_ROWS.items()}
    bm25 = rows["BM25 (k1=1.2, b=0.75)"]["per_query"]
    expected = []
    for name, row in rows.items():
        cells = [name]
        for metric in ("MRR@10", "Recall@100", "NDCG@10"):
            qids = sorted(set(row["per_query"]) & set(bm25))
            _, p = evaluate.paired_t_test([row["per_query"][q][metric] for q in qids], [bm25[q][metric] for q in qids])
            star = "*" if row["per_query"] is not bm25 and p <= 0.05 else ""
            cells.append(f"{row['metrics'][metric]:.4f}{star}")
        expected.append(cells)
    readme = (HERE / "README.md").read_text()
    assert _markdown_table(readme, "| command 1, SciFact test (300 queries) |") == expected


def test_docs_study_table_is_results_study_table():
    """docs/study.md's full-data table is the test table of results/study/table.md, cell for cell: the arms (in
    its order), the zero-shot and nDCG@10 columns, and each comparison's diff [interval], p (Holm)."""
    table = (HERE / "results" / "study" / "table.md").read_text()
    test_part = table[table.index("## test"):table.index("## dev")]
    header = [cell.strip() for cell in next(line for line in test_part.splitlines()
                                            if line.startswith("| arm |")).strip("|").split("|")]
    names = {"none": "none (fine-tuning only)", "mlm": "MLM-only", "seed": "SEED", "cpdae": "CPDAE", "costa": "COSTA"}
    pair = lambda diff, p: f"{diff}, {p.replace('(Holm ', '(')}" if diff else ""
    expected = []
    for cells in _markdown_table(test_part, "| arm |"):
        row = dict(zip(header, cells))
        expected.append([names[row["arm"]], row["zero-shot nDCG@10"].replace(" (one encoder)", ""), row["NDCG@10"],
                         pair(row["nDCG@10 diff [95% CI] vs none"], row["nDCG@10 p (paired t over seeds) vs none"]),
                         pair(row["nDCG@10 diff [95% CI] vs mlm"], row["nDCG@10 p (paired t over seeds) vs mlm"])])
    page = _markdown_table((HERE / "docs" / "study.md").read_text(), "| arm | zero-shot | fine-tuned |")
    assert [[row[0].split(" (")[0].replace("none", "none (fine-tuning only)")] + row[1:] for row in page] == expected


def test_results_mechanisms_reprint_from_their_rows_and_the_pages_quote_them(tmp_path):
    """results/mechanisms/report.py (and from-scratch/, confirm/, matched/report.py) train and measure nothing: from
    a copy of the committed rows each writes its table.md as committed (the same figures' names beside it); every
    table row and every verdict line that the README's figures section and docs/mechanisms.md give is a line of a
    table.md."""
    tables = []
    for folder in (HERE / "results" / "mechanisms", HERE / "results" / "mechanisms" / "from-scratch"):
        copy = tmp_path / folder.name
        shutil.copytree(folder / "rows", copy / "rows")
        subprocess.run([PY, str(folder / "report.py"), str(copy)], check=True, capture_output=True, timeout=300)
        tables.append((folder / "table.md").read_text())
        assert (copy / "table.md").read_text() == tables[-1]
        assert {p.name for p in copy.glob("*.png")} <= {p.name for p in folder.glob("*.png")}
    confirm = HERE / "results" / "mechanisms" / "confirm"   # its table names plan.md's first commit: git only
    copy = tmp_path / "confirm"
    shutil.copytree(confirm / "rows", copy / "rows")
    shutil.copy(confirm / "plan.md", copy)
    subprocess.run([PY, str(confirm / "report.py"), str(copy)], check=True, capture_output=True, timeout=300)
    tables.append((confirm / "table.md").read_text())
    outside_git = r"`; its first commit \w+ held sha256 `\w+…`, and the wording corrections .*? made `\w+…"
    assert (copy / "table.md").read_text() == re.sub(outside_git, "", tables[-1])
    matched = HERE / "results" / "mechanisms" / "matched"   # judged beside the confirmatory round's verdicts
    shutil.copytree(matched / "rows", tmp_path / "matched" / "rows")
    shutil.copy(matched / "plan.md", tmp_path / "matched")
    subprocess.run([PY, str(matched / "report.py"), str(tmp_path / "matched")], check=True, capture_output=True,
                   timeout=300)
    tables.append((matched / "table.md").read_text())
    assert (tmp_path / "matched" / "table.md").read_text() == re.sub(
        r", committed in \w+ before any of this round's code or rows", "", tables[-1])
    table = "\n".join(tables)
    readme = (HERE / "README.md").read_text()
    figures = readme[readme.index("## Figures"):readme.index("## The study, in brief")]
    docs = (HERE / "docs" / "mechanisms.md").read_text()
    quoted = [line for page in (figures, docs) for line in page.splitlines()   # a table row with a bare number
              if re.match(r"\| .*\| -?\d+\.\d+ ", line) or line.startswith("- ") and "t-test p = " in line]
    assert len(quoted) >= 10, "the pages quote the mechanisms' table"
    claims = [line for line in figures.splitlines() if line.startswith("- ") and " round" in line and "**" in line]
    assert len(claims) >= 8, "the README gives one line per claim, from a table.md"
    quoted += claims
    assert [line for line in quoted if line not in table.splitlines()] == []


# ----------------------------------------------------------------------------------------------
# Every departure from a paper, marked where it happens, is listed in docs/departures.md
# ----------------------------------------------------------------------------------------------
DEPARTURE = re.compile(r"Departure \(([a-z0-9-]+)\):")


def test_every_departure_in_the_code_is_listed_in_the_docs():
    """`Departure (key):` in any .py file (docstring or comment) <-> one `- `key`:` line in docs/departures.md's
    departure list, both ways; a departure without a key would escape the list, so none may exist."""
    in_code = {}
    for path in sorted([*HERE.glob("*.py"), *HERE.glob("run/*.py"), *HERE.glob("research/*.py")]):
        if path.name.startswith("test_"):
            continue
        text = path.read_text()
        unkeyed = [line.strip() for line in text.splitlines() if re.search(r"\bDeparture\b(?! \([a-z0-9-]+\):)", line)]
        assert not unkeyed, f"{path.name}: a departure without a key: {unkeyed[0]!r}"
        for key in DEPARTURE.findall(text):
            in_code.setdefault(key, []).append(path.name)
    readme = (HERE / "docs" / "departures.md").read_text()
    assert "<!-- departures: begin -->" in readme and "<!-- departures: end -->" in readme, "docs/departures.md: no list"
    listing = readme[readme.index("<!-- departures: begin -->"):readme.index("<!-- departures: end -->")]
    listed = re.findall(r"^- `([a-z0-9-]+)`: \S", listing, re.MULTILINE)
    assert len(listed) == len(set(listed)), f"README lists a departure twice: {sorted(listed)}"
    assert len(in_code) >= 10, sorted(in_code)
    unlisted = sorted(set(in_code) - set(listed))
    assert not unlisted, "departures in the code missing from the README's list: " + \
        ", ".join(f"{k} ({', '.join(sorted(set(in_code[k])))})" for k in unlisted)
    stale = sorted(set(listed) - set(in_code))
    assert not stale, f"README lists departures the code no longer marks: {stale}"


def test_step_seed_streams_are_independent_and_deterministic():
    """Masks (batch_generator), dropout (the global RNG the loop seeds) and COSTA's resampled spans each
    have their own seed per (seed, rank, micro-step): no stream repeats another's numbers."""
    seeds = {(s, r, m): data.step_seed(0, r, m, s) for s in data.STREAMS for r in range(2) for m in range(100)}
    assert len(set(seeds.values())) == len(seeds)                 # no two streams, ranks or steps share a seed
    assert data.step_seed(3, 1, 7, "masks") == data.step_seed(3, 1, 7, "masks")   # a function of the step
    assert data.step_seed(-1, 0, 0) != data.step_seed(0, 0, 0)
    masks = torch.rand(4000, generator=data.batch_generator(0, 0, 5))
    torch.manual_seed(data.step_seed(0, 0, 5))
    dropout = torch.rand(4000)
    assert abs(float(np.corrcoef(masks.numpy(), dropout.numpy())[0, 1])) < 0.1


def test_evaluate_imports_nothing_from_finetune():
    """One arrow, finetune -> evaluate: evaluate.py is the retrieval layer, loading no training code."""
    assert not re.search(r"^\s*(from|import) finetune", (HERE / "evaluate.py").read_text(), re.MULTILINE)
    probe = "import sys, evaluate; print('finetune' in sys.modules)"
    result = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert result.stdout.strip() == "False", result.stderr


def test_evaluate_imports_no_method_file():
    """evaluate.py is retrieval, metrics, statistics and runs: it imports no method file, at its top or inside
    a function, by name or by importlib (mechanisms.py is the one module besides the drivers that does)."""
    tree = ast.parse((HERE / "evaluate.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                             if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & set(run.METHODS), sorted(imported & set(run.METHODS))
    dynamic = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
               and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")]
    assert not dynamic, f"evaluate.py imports a module by name at line(s) {dynamic}"


def imports_of(path):
    """The top-level names a file imports (`import run.cache` -> run, `from run import files` -> run)."""
    tree = ast.parse(Path(path).read_text())
    return {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
            for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                         if isinstance(node, ast.ImportFrom) and node.module}


def lines_of(path):
    return len(Path(path).read_text().splitlines())


CARD = {"costa.py", "cpdae.py", "seed.py", "finetune.py", "evaluate.py", "data.py", "test_losses.py",
        "walkthrough.py", "conftest.py"}   # the design card's top level; the machinery and the research in packages


def test_the_top_level_is_the_card_and_a_method_reads_in_under_1900_lines():
    """The course path: a method file plus the project modules it imports directly (for the package run, its
    __init__.py: the loop layer; costa.py names no submodule of it) stays under 1,900 lines; data.py is a small data
    module (at most 600 lines) that imports none of ours; run/ and research/ import no method file; run's loop layer
    is at most ~700 lines."""
    assert {p.name for p in HERE.glob("*.py")} == CARD
    assert lines_of(HERE / "data.py") <= 600 and lines_of(HERE / "run" / "__init__.py") <= 700
    assert lines_of(HERE / "evaluate.py") <= 1320                         # retrieval, metrics, statistics, runs
    for method in METHOD_FILES:
        text = (HERE / method).read_text()
        named = {node.value.attr for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Attribute)   # run.X.f
                 and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                 and node.value.value.id == "run" and (HERE / "run" / f"{node.value.attr}.py").is_file()}
        reach = lines_of(HERE / method) + lines_of(HERE / "data.py") + lines_of(HERE / "run" / "__init__.py") + sum(
            lines_of(HERE / "run" / f"{sub}.py") for sub in named)
        assert imports_of(HERE / method) & {p.stem for p in HERE.glob("*.py")} | {"run"} >= {"data", "run"}
        assert reach <= 1900, (method, named, reach)
    assert imports_of(HERE / "data.py") & ({p.stem for p in HERE.glob("*.py")} | {"run", "research", "lab"}) == set()
    methods = {m.removesuffix(".py") for m in METHOD_FILES}
    for path in [*HERE.glob("run/*.py"), *HERE.glob("research/*.py")]:
        assert not imports_of(path) & methods or path.name in ("mechanisms.py", "study.py", "benchmark.py"), path


@pytest.mark.parametrize("script", [*METHOD_FILES, "finetune.py", "evaluate.py", "research/mechanisms.py"])
def test_help_prints_the_docstring_and_every_field(script):
    name = script.removesuffix(".py").replace("/", ".")
    result = subprocess.run([PY, "-m", name, "--help"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    module = importlib.import_module(name)
    assert "class Config" in result.stdout                      # a method's own fields, then run.TrainConfig's
    missing = [f for f in module.Config.__dataclass_fields__ if f"    {f}: " not in result.stdout]
    assert not missing, f"{script} --help leaves out {missing}"


# ----------------------------------------------------------------------------------------------
# Fine-tuning and evaluation (finetune.py, evaluate.py)
# ----------------------------------------------------------------------------------------------
def _tokenizer():
    return data.load_tokenizer()


# ------------------------------------------------------------------ metrics (hand-computed values)
def test_metrics_ties_are_broken_by_docid_descending():
    # d3 first by score; d1 and d2 tie: trec_eval puts d2 before d1, so the relevant d1 is at rank 3.
    _means, per_query = evaluate.compute_metrics({"q": {"d1": 1.0, "d2": 1.0, "d3": 2.0}}, {"q": {"d1": 1}})
    assert per_query["q"]["MRR@10"] == pytest.approx(1 / 3)
    assert per_query["q"]["NDCG@10"] == pytest.approx(1 / math.log2(4))
    # docids compare as strings: "9" > "10", so "9" comes first on a tie.
    _, pq = evaluate.compute_metrics({"q": {"10": 0.5, "9": 0.5}}, {"q": {"10": 1}})
    assert pq["q"]["MRR@10"] == pytest.approx(1 / 2)


def test_metrics_graded_relevance():
    # Ranking x, b, a, c; grades a=2, b=1, c=0 (not relevant), e=1 (not retrieved).
    run = {"q": {"x": 0.9, "b": 0.8, "a": 0.7, "c": 0.6}}
    qrels = {"q": {"a": 2, "b": 1, "c": 0, "e": 1}}
    _, pq = evaluate.compute_metrics(run, qrels)
    dcg = 0 + 1 / math.log2(3) + 2 / math.log2(4) + 0
    idcg = 2 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(4)
    assert pq["q"]["NDCG@10"] == pytest.approx(dcg / idcg)
    assert pq["q"]["MRR@10"] == pytest.approx(1 / 2)
    assert pq["q"]["Recall@10"] == pytest.approx(2 / 3)


def test_metrics_cutoffs_missing_and_unjudged_queries():
    # q1: the only relevant document at rank 50.
    run = {"q1": {f"d{i:03d}": 100.0 - i for i in range(1, 61)}}
    qrels = {"q1": {"d050": 1},
             "q2": {"z": 1},          # relevant document, but q2 is absent from the run: scores 0
             "q3": {"y": 0},          # no relevant document: counted, scores 0 (trec_eval)
             "q4": {"w": 1, "v": 1}}  # in the run with no results: scores 0
    run["q4"] = {}
    run["q5"] = {"w": 1.0}            # not in the qrels: ignored
    means, pq = evaluate.compute_metrics(run, qrels)
    assert set(pq) == {"q1", "q2", "q3", "q4"}
    assert pq["q1"]["MRR@10"] == 0.0 and pq["q1"]["MRR@100"] == pytest.approx(1 / 50)
    assert pq["q1"]["Recall@10"] == 0.0 and pq["q1"]["Recall@100"] == 1.0 and pq["q1"]["Recall@1000"] == 1.0
    assert pq["q1"]["NDCG@10"] == 0.0
    assert all(v == 0.0 for q in ("q2", "q3", "q4") for v in pq[q].values())
    assert means["MRR@100"] == pytest.approx((1 / 50) / 4)
    assert means["Recall@100"] == pytest.approx(1 / 4)
    assert set(means) == {"MRR@10", "MRR@100", "Recall@10", "Recall@100", "Recall@1000", "NDCG@10"}


def test_metrics_recall_counts_only_top_k():
    docs = {f"d{i:04d}": 2000.0 - i for i in range(1, 1201)}  # d0001 best ... d1200 worst
    qrels = {"q": {"d0005": 1, "d0500": 1, "d1100": 1, "missing": 1}}
    _, pq = evaluate.compute_metrics({"q": docs}, qrels)
    assert pq["q"]["Recall@10"] == pytest.approx(1 / 4)
    assert pq["q"]["Recall@100"] == pytest.approx(1 / 4)
    assert pq["q"]["Recall@1000"] == pytest.approx(2 / 4)
    assert pq["q"]["MRR@10"] == pytest.approx(1 / 5)


# ------------------------------------------------------------------ t-test
@pytest.mark.parametrize("d", [[0.3, -0.1], [0.5, 0.1, 0.2], [0.9, -0.2, 0.4, 0.05], [-1.0, -0.2, -0.7]])
def test_paired_t_test_p_matches_closed_forms_of_students_t(d):
    a = abs(evaluate.paired_t_test(d, [0.0] * len(d))[0])
    p = evaluate.paired_t_test(d, [0.0] * len(d))[1]
    df = len(d) - 1
    cdf3 = 0.5 + (a / (math.sqrt(3) * (1 + a * a / 3)) + math.atan(a / math.sqrt(3))) / math.pi
    closed = {1: 1 - 2 / math.pi * math.atan(a), 2: 1 - a / math.sqrt(2 + a * a), 3: 2 * (1 - cdf3)}[df]
    assert p == pytest.approx(closed, abs=1e-12)


def test_paired_t_test_by_hand():
    a, b = [0.5, 0.7, 0.2, 0.9, 0.4], [0.4, 0.4, 0.3, 0.6, 0.1]
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    t, p = evaluate.paired_t_test(a, b)
    assert t == pytest.approx(mean / (sd / math.sqrt(5)))
    assert 0.0 < p < 1.0
    assert evaluate.paired_t_test([1, 2, 3], [1, 2, 3]) == (0.0, 1.0)
    assert evaluate.paired_t_test([1, 2, 3], [0, 1, 2]) == (math.inf, 0.0)


# ------------------------------------------------------------------ BM25
def test_bm25_matches_term_by_term_formula():
    docs = ["The cat sat on the mat", "Dogs and cats are friends", "A cat chased a cat"]
    tokens = [["cat", "sat", "mat"], ["dogs", "cats", "friends"], ["cat", "chased", "cat"]]  # stopwords gone
    k1, b = 1.2, 0.75
    bm25 = evaluate.BM25(docs, k1=k1, b=b)
    avgdl = sum(len(t) for t in tokens) / 3
    queries = ["cat on the mat", "friendly dogs", "cat cat"]
    q_tokens = [["cat", "mat"], ["dogs"], ["cat", "cat"]]
    expected = np.zeros((3, 3))
    for qi, qt in enumerate(q_tokens):
        for di, dt in enumerate(tokens):
            for term in qt:
                df = sum(term in t for t in tokens)
                idf = math.log(1 + (3 - df + 0.5) / (df + 0.5))
                tf = dt.count(term)
                expected[qi, di] += idf * tf / (tf + k1 * (1 - b + b * len(dt) / avgdl))
    np.testing.assert_allclose(bm25.score(queries), expected, rtol=1e-5, atol=1e-7)
    scores, ids = bm25.search(queries, 2)
    assert ids[0].tolist() == [0, 2] and ids[1, 0] == 1
    np.testing.assert_allclose(scores, np.take_along_axis(expected, ids, 1), rtol=1e-5)


def test_bm25_sparse_top_k_equals_the_dense_rows_and_scifact_keeps_its_rankings(monkeypatch):
    """The sparse top-k (large corpora) scores exactly what the dense rows hold and orders ties by document
    index; SciFact stays on the dense path, so command 1's rankings and negatives keep argpartition's tie
    order. Seen failing on the old code (no sparse_search) and with the tie rows at the k-th score dropped."""
    corpus, queries, qrels = data.load_beir(HERE / "data" / "scifact", "test")
    bm25 = evaluate.BM25([evaluate.passage_text(corpus[d]) for d in corpus])
    texts = [queries[q] for q in sorted(qrels)]
    assert bm25.n_docs <= bm25.DENSE_UP_TO
    dense_scores, dense_ids = bm25.dense_search(texts, 1000)
    got_scores, got_ids = bm25.search(texts, 1000)
    np.testing.assert_array_equal(got_ids, dense_ids)                   # SciFact: the old path, bit for bit
    np.testing.assert_array_equal(got_scores, dense_scores)
    sparse_scores, sparse_ids = bm25.sparse_search(texts, 1000, postings_per_chunk=50_000)   # several chunks
    full = bm25.score(texts)                                            # (300, 5183)
    by_score_then_index = np.lexsort((np.broadcast_to(np.arange(full.shape[1]), full.shape), -full), axis=1)
    np.testing.assert_array_equal(sparse_ids, by_score_then_index[:, :1000])
    np.testing.assert_array_equal(sparse_scores, dense_scores)         # the same values, bit for bit
    monkeypatch.setattr(evaluate.BM25, "DENSE_UP_TO", 1000)
    np.testing.assert_array_equal(bm25.search(texts[:20], 50)[1], sparse_ids[:20, :50])
    tiny = evaluate.BM25(["cats sleep", "dogs bark", "cats purr loudly", "birds sing"])
    scores, ids = tiny.sparse_search(["cats"], 4)                       # two match; the tail: 1, 3 (score 0)
    assert ids.tolist() == [[0, 2, 1, 3]] and scores[0, 2:].tolist() == [0.0, 0.0] and (scores[0, :2] > 0).all()


def _share_worker(rank, world, tmp_path):
    if rank == 1:
        time.sleep(4)                      # a slower BM25 share: longer than the group's 2 s collective timeout
    ranked = run.ranks.share_through_files(tmp_path / "negatives_bm25.tsv", {f"q{rank}": [rank, 5]}, tag=7, patience_s=60)
    torch.save(ranked, tmp_path / f"rank{rank}.pt")


def test_bm25_shares_reach_every_rank_without_a_collective_timing_out(tmp_path, run_on_ranks):
    """Seen failing with all_gather_object in place of the files (gloo's 2 s timeout expires while rank 1
    still searches)."""
    r0, r1 = run_on_ranks(2, _share_worker, tmp_path, timeout_s=2)
    assert r0 == r1 == {"q0": [0, 5], "q1": [1, 5]}
    assert not list(tmp_path.glob("negatives_bm25.7.part*"))     # rank 0 removed the parts once all had read them


# ------------------------------------------------------------------ search
def test_exact_search_matches_numpy_brute_force():
    rng = np.random.default_rng(0)
    docs = rng.standard_normal((500, 16)).astype(np.float32)
    queries = rng.standard_normal((7, 16)).astype(np.float32)
    scores, ids = evaluate.search(queries, docs, 20)
    full = queries @ docs.T
    want = np.argsort(-full, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(scores, np.take_along_axis(full, want, 1), rtol=1e-5, atol=1e-5)


def test_index_flat_equals_exact_search():
    import faiss
    rng = np.random.default_rng(1)
    docs = rng.standard_normal((400, 16)).astype(np.float32) * rng.uniform(0.2, 3, (400, 1)).astype(np.float32)
    queries = rng.standard_normal((9, 16)).astype(np.float32)
    flat = faiss.IndexFlatIP(16)
    flat.add(docs)
    want_s, want_i = flat.search(queries, 25)
    scores, ids = evaluate.search(queries, docs, 25, "Flat")
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(scores, want_s)
    full = queries @ docs.T                          # inner product, not L2: the norms vary
    np.testing.assert_array_equal(ids, np.argsort(-full, axis=1, kind="stable")[:, :25])


def _top10_hits(ids, exact_ids):
    return np.mean([set(a) == set(b) for a, b in zip(ids[:, :10], exact_ids[:, :10])])


def test_hnsw_and_ivf_indexes_find_the_exact_top10():
    rng = np.random.default_rng(0)
    docs = rng.standard_normal((3000, 32)).astype(np.float32)
    queries = docs[rng.choice(3000, 100, replace=False)] + 0.5 * rng.standard_normal((100, 32)).astype(np.float32)
    _, exact = evaluate.search(queries, docs, 10, "Flat")
    _, hnsw = evaluate.search(queries, docs, 10, "HNSW32", ef_search=128)
    assert _top10_hits(hnsw, exact) >= 0.9                                      # most queries: the exact top-10
    _, all_lists = evaluate.search(queries, docs, 10, "IVF16,Flat", nprobe=16)  # every list probed: exact
    assert _top10_hits(all_lists, exact) == 1.0
    _, one_list = evaluate.search(queries, docs, 10, "IVF16,Flat", nprobe=1)    # nprobe reaches the index
    assert _top10_hits(one_list, exact) < 0.9
    index = evaluate.build_index(docs, "HNSW32")
    evaluate.set_search_parameters(index, nprobe=5, ef_search=77)               # nprobe: HNSW has none
    assert index.hnsw.efSearch == 77
    with pytest.raises(ValueError, match="--index 'PQ7' is not a faiss index_factory string for 32-d"):
        evaluate.search(queries, docs, 10, "PQ7")


def test_retrieve_with_an_index_from_the_config():
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    c = finetune.Config(**TINY, encode_batch=8, query_len=16, passage_len=24, pooling="cls",
                        index="IVF2,Flat", nprobe=2)                            # both lists: exact
    texts = _toy_texts()
    s, i = evaluate.retrieve(encoder, _tokenizer(), texts, texts[:5], 10, c, torch.device("cpu"))
    _assert_same_topk(s, i, _brute_force(encoder, texts, texts[:5], c), 10)
    with pytest.raises(ValueError, match="--index 'IVF2,Bogus'"):
        evaluate.retrieve(encoder, _tokenizer(), texts, texts[:5], 10,
                          dataclasses.replace(c, index="IVF2,Bogus"), torch.device("cpu"))


def test_torch_exact_search_equals_faiss_flat_across_chunks():
    rng = np.random.default_rng(4)
    docs = rng.standard_normal((1000, 16)).astype(np.float32) * rng.uniform(0.2, 3, (1000, 1)).astype(np.float32)
    queries = rng.standard_normal((7, 16)).astype(np.float32)
    cpu = torch.device("cpu")
    want_s, want_i = evaluate.search(queries, docs, 300, "Flat")          # faiss IndexFlatIP
    scores, ids = evaluate.torch_exact_search(queries, docs, 300, cpu, chunk=128, batch=3)  # 1000 = 7 x 128 + 104
    assert scores.dtype == np.float32 and ids.dtype == np.int64 and ids.shape == (7, 300)
    np.testing.assert_array_equal(ids, want_i)                           # k > chunk: the running top-k carries over
    np.testing.assert_allclose(scores, want_s, rtol=1e-5, atol=1e-5)
    s, i = evaluate.torch_exact_search(queries, docs[:50], 300, cpu, chunk=16)   # k > N: every document once
    assert i.shape == (7, 50) and all(sorted(row) == list(range(50)) for row in i)
    half = docs.astype(np.float16)                                       # fp16 vectors: an fp16 matmul
    full = queries.astype(np.float16).astype(np.float32) @ half.astype(np.float32).T
    s, i = evaluate.torch_exact_search(queries, half, 100, cpu, chunk=128)
    want = -np.sort(-full, axis=1)[:, :100]
    np.testing.assert_allclose(np.take_along_axis(full, i, 1), want, atol=0.02)  # a true top-100 up to fp16 ties
    np.testing.assert_allclose(s, want, atol=0.02)


def test_encode_to_an_fp16_memmap_and_retrieve_from_it(tmp_path):
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    texts, tok, cpu = _toy_texts(), _tokenizer(), torch.device("cpu")
    ref = evaluate.encode(encoder, "cls", tok, texts, 24, 8, cpu)                                # (N, H) float32
    mem = evaluate.encode(encoder, "cls", tok, texts, 24, 8, cpu, path=tmp_path / "v" / "docs.npy")
    assert isinstance(mem, np.memmap) and mem.dtype == np.float16 and not mem.flags.writeable
    np.testing.assert_array_equal(mem, ref.astype(np.float16))           # every row filled, in place
    assert [f.name for f in (tmp_path / "v").iterdir()] == ["docs.npy"]  # the temporary name is gone
    index = evaluate.build_index(mem, "Flat", chunk=8)                   # added 8 rows at a time
    assert index.ntotal == len(texts)
    np.testing.assert_array_equal(index.reconstruct_n(0, len(texts)), ref.astype(np.float16).astype(np.float32))
    c = finetune.Config(**TINY, encode_batch=8, query_len=16, passage_len=24, pooling="cls",
                        vectors_dir=str(tmp_path / "vd"))
    s, i = evaluate.retrieve(encoder, tok, texts, texts[:5], 10, c, cpu)
    assert (tmp_path / "vd" / "docs-0-of-1.npy").is_file()
    queries = evaluate.encode(encoder, "cls", tok, texts[:5], 16, 8, cpu)                      # (5, H)
    _assert_same_topk(s, i, queries @ mem.astype(np.float32).T, 10)     # exact over the fp16 vectors


# ------------------------------------------------------------------ figures
def test_word_probabilities_sum_pieces():
    tok = _tokenizer()
    text = "Nanotechnology raises issues."
    enc = tok.encode(text, add_special_tokens=False)  # nano ##tech ##nology raises issues .
    probs = np.zeros(30522)
    probs[enc.ids] = np.arange(1, len(enc.ids) + 1) / 100.0
    words = mechanisms.word_probabilities(probs, text, tok)
    assert [w for w, _, _ in words] == ["Nanotechnology", "raises", "issues", "."]
    assert words[0][1] == pytest.approx(0.01 + 0.02 + 0.03)
    assert words[1][1] == pytest.approx(0.04)


def test_figures_are_written(tmp_path):
    rng = np.random.default_rng(0)
    panels = [(name, rng.standard_normal(8), rng.standard_normal((30, 8)), np.arange(30) < 2) for name in "ab"]
    coords = mechanisms.plot_tsne(panels, tmp_path / "tsne.png", title="q")
    assert [xy.shape for xy in coords] == [(31, 2), (31, 2)]
    probs = rng.random(30522)
    probs /= probs.sum()
    mechanisms.plot_word_distribution(probs, "Nanotechnology raises many of the same issues " * 6,
                                      _tokenizer(), tmp_path / "words.png")
    for name in ("tsne.png", "words.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


class FakeTokenizer:
    """Words are their own ids (integers in the text); [CLS] = 101, [SEP] = 102."""

    def token_to_id(self, token):
        return {"[CLS]": 101, "[SEP]": 102}[token]

    def encode_batch(self, texts, add_special_tokens=True):
        return [types.SimpleNamespace(ids=[int(w) for w in t.split()]) for t in texts]


class MeanEmbeddingEncoder(torch.nn.Module):
    """Puts the mean token embedding at position 0, and records the input lengths it is given."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.word = torch.nn.Embedding(200, 8)
        self.lengths = set()

    def forward(self, input_ids, attention_mask):
        self.lengths.add(input_ids.shape[1])
        return self.word(input_ids).mean(1, keepdim=True).expand(-1, input_ids.shape[1], -1)


def test_cls_similarity_by_length():
    texts = [" ".join(str(1 + (7 * i + j) % 90) for j in range(n)) for i, n in enumerate([40, 40, 40, 10, 10])]
    encoder = MeanEmbeddingEncoder()
    result = mechanisms.cls_similarity_by_length(encoder, FakeTokenizer(), texts, lengths=(8, 32, 64), n_pairs=20, seed=1)
    assert set(result) == {8, 32}  # no two texts have 62 pieces
    assert encoder.lengths == {8, 32}  # every sequence truncated to exactly the length
    assert all(-1.0 <= v <= 1.0 for v in result.values())
    # three identical texts: every pair has cosine 1
    same = mechanisms.cls_similarity_by_length(encoder, FakeTokenizer(), [texts[0]] * 3, lengths=(16,), n_pairs=5)
    assert abs(same[16] - 1.0) < 1e-6
    assert result == mechanisms.cls_similarity_by_length(encoder, FakeTokenizer(), texts, lengths=(8, 32, 64), n_pairs=20, seed=1)
    # every position holds the same vector here, so the mean of the tokens is the [CLS] vector
    mean = mechanisms.cls_similarity_by_length(encoder, FakeTokenizer(), texts, lengths=(8, 32, 64), n_pairs=20, seed=1,
                                               pooling="mean")
    assert mean == pytest.approx(result)


def test_cls_by_length_and_side_by_side_tsne_one_line_or_panel_per_model(tmp_path):
    """SEED Figure 5 and COSTA Figure 3 from the command line, two tiny models in one figure each."""
    corpus = tmp_path / "corpus.jsonl"
    words = ["cells", "protein", "gene", "blood", "heart", "brain", "virus", "drug", "dose", "risk", "trial", "mice", "tumor", "immune"]
    rng = np.random.default_rng(0)
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n" for n in (140, 150, 160, 200)))
    a = _tiny_init(tmp_path / "a")
    torch.manual_seed(1)
    run.hub.save_pretrained(finetune.Encoder(finetune.Config(**TINY)), tmp_path / "b")
    models = f"{a},{tmp_path / 'b'}"
    curves = mechanisms.main(mechanisms.Config(model=models, tag="A,B", cls_by_length=True, corpus=str(corpus),
                                               out_dir=str(tmp_path / "fig")))
    assert list(curves) == [("A", "cls"), ("A", "mean"), ("B", "cls"), ("B", "mean")]
    assert all(list(values) == [32, 64, 128] for values in curves.values())   # no text is 254 pieces long
    texts = data.read_pretraining_texts(corpus)
    assert curves["B", "cls"] == mechanisms.cls_similarity_by_length(evaluate.load_encoder(tmp_path / "b"), _tokenizer(),
                                                                     texts, (32, 64, 128))
    saved = json.loads((tmp_path / "fig" / "cls_by_length.json").read_text())
    assert [(r["model"], r["vector"]) for r in saved] == list(curves)
    beir = tiny_beir(tmp_path / "beir")
    mean_cos = dict(pooling="mean", similarity="cos", dataset=str(beir), depth=10)
    result = mechanisms.main(mechanisms.Config(model=models, tag="A,B b", tsne="q1", out_dir=str(tmp_path / "fig"), **mean_cos))
    assert set(result[1]) == {"q1", "q2"}
    assert (tmp_path / "fig" / "A" / "run.trec").is_file() and (tmp_path / "fig" / "Bb" / "run.trec").is_file()
    for name in ("cls_by_length.png", "tsne-q1.png"):
        assert (tmp_path / "fig" / name).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="several models go with --tsne or --cls_by_length"):
        evaluate.main(evaluate.Config(model=models, dataset=str(beir)))
    for tag in ("A", "A,A"):
        with pytest.raises(ValueError, match="one tag per model"):
            mechanisms.main(mechanisms.Config(model=models, tag=tag, cls_by_length=True, corpus=str(corpus)))


# ------------------------------------------------------------------ negatives
def test_negatives_never_contain_a_positive():
    docs = {f"d{i}": i for i in range(40)}
    qrels = {"q1": {"d1": 1, "d2": 2, "d3": 0}, "q2": {"d5": 1}, "q3": {"d7": 0}}
    examples = finetune.make_examples({"q1": "a", "q2": "b", "q3": "c"}, qrels, docs)
    assert [ex.qid for ex in examples] == ["q1", "q2"]  # q3 has no relevant document
    assert examples[0].positives == [1, 2]               # grade 0 is not a positive
    ranked = [1, 9, 2, 9, 4, 1, 3, -1]                    # positives, a duplicate, padding (-1)
    pool = finetune.negatives_from_ranking(ranked, [1, 2])
    assert pool == [9, 4, 3]
    assert finetune.negatives_from_ranking(ranked, [1, 2], skip=2) == [9, 4, 3]
    assert finetune.negatives_from_ranking(ranked, [1, 2], skip=4) == [4, 3]
    rng = np.random.default_rng(0)
    for pool_size in (0, 2, 30):  # empty pool, short pool (topped up at random), large pool
        pool = [d for d in range(3, 3 + pool_size)]
        for _ in range(50):
            negs = finetune.sample_negatives(pool, [1, 2], 7, 40, rng)
            assert len(negs) == 7 and not {1, 2} & set(negs)
    # Through the training batches: each query's own negatives exclude all its positives.
    examples = [ex._replace(negatives=finetune.negatives_from_ranking(list(range(40)), ex.positives))
                for ex in examples]
    c = finetune.Config(batch_size=2, n_negatives=5, steps=3)
    batches = finetune.TrainBatches(c, examples, [f"text {i}" for i in range(40)], _tokenizer(), 0, 1)
    for m in range(3):
        b = batches[m]
        docs_by_query = b["p_doc"].view(2, 6)
        for row, pos in zip(docs_by_query, b["q_pos"]):
            pos = set(pos[pos >= 0].tolist())
            assert row[0].item() in pos and not pos & set(row[1:].tolist())


# ------------------------------------------------------------------ 2-process loss = 1-process loss
TINY = dict(vocab_size=30522, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, dropout=0.0)


def _toy_batch(n_queries=4, per_query=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_ids = torch.randint(1000, 2000, (n_queries, 6), generator=g)
    p_ids = torch.randint(1000, 2000, (n_queries * per_query, 10), generator=g)
    q_mask, p_mask = torch.ones_like(q_ids), torch.ones_like(p_ids)
    q_mask[0, 4:] = 0
    p_mask[1, 7:] = 0
    p_doc = torch.arange(n_queries * per_query) + 100
    q_pos = torch.full((n_queries, 2), -1)
    q_pos[:, 0] = p_doc[::per_query]
    q_pos[0, 1] = p_doc[2 * per_query]  # query 0 shares query 2's positive: masked out, not a negative
    return {"q_ids": q_ids, "q_mask": q_mask, "p_ids": p_ids, "p_mask": p_mask, "p_doc": p_doc, "q_pos": q_pos}


def _local(batch, rank, world):
    b = batch["q_ids"].shape[0] // world
    per_query = batch["p_ids"].shape[0] // batch["q_ids"].shape[0]
    qs, ps = slice(rank * b, (rank + 1) * b), slice(rank * b * per_query, (rank + 1) * b * per_query)
    return {k: v[qs] if k.startswith("q_") else v[ps] for k, v in batch.items()}


def _tiny_bi_encoder(loss):
    torch.manual_seed(0)
    return finetune.BiEncoder(finetune.Encoder(finetune.Config(**TINY)), finetune.Config(pooling="cls", loss=loss))


def _loss_worker(rank, world, tmp_path, loss_name):
    model = _tiny_bi_encoder(loss_name)
    loss, _ = model(_local(_toy_batch(), rank, world))
    loss.backward()
    # Loss level with leaf tensors: gradient wrt this rank's vectors.
    g = torch.Generator().manual_seed(1)
    q, p = torch.randn(4, 8, generator=g), torch.randn(12, 8, generator=g)
    q_loc, p_loc = q[rank * 2:(rank + 1) * 2].clone().requires_grad_(), p[rank * 6:(rank + 1) * 6].clone().requires_grad_()
    labels = rank * 6 + torch.arange(2) * 3
    fn = finetune.softmax_loss if loss_name == "softmax" else finetune.hinge_loss
    vec_loss, _ = fn(q_loc, finetune.gather_across_ranks(p_loc), labels)
    vec_loss.backward()
    torch.save({"loss": loss.detach(), "grads": {n: t.grad for n, t in model.named_parameters() if t.grad is not None},
                "vec_loss": vec_loss.detach(), "q_grad": q_loc.grad, "p_grad": p_loc.grad}, tmp_path / f"rank{rank}.pt")


@pytest.mark.parametrize("loss_name", ["softmax", "hinge"])
def test_two_process_loss_and_gradients_equal_one_process(tmp_path, loss_name, run_on_two_ranks):
    r0, r1 = run_on_two_ranks(_loss_worker, tmp_path, loss_name)
    model = _tiny_bi_encoder(loss_name)
    loss, _ = model(_toy_batch())
    loss.backward()
    assert torch.allclose((r0["loss"] + r1["loss"]) / 2, loss.detach(), atol=1e-6)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        # all_gather's backward sums over ranks; DDP then averages: (g0 + g1) / 2 = single-process gradient.
        assert torch.allclose((r0["grads"][name] + r1["grads"][name]) / 2, p.grad, atol=1e-5), name
    g = torch.Generator().manual_seed(1)
    q, p = torch.randn(4, 8, generator=g).requires_grad_(), torch.randn(12, 8, generator=g).requires_grad_()
    fn = finetune.softmax_loss if loss_name == "softmax" else finetune.hinge_loss
    vec_loss, _ = fn(q, p, torch.arange(4) * 3)
    vec_loss.backward()
    assert torch.allclose((r0["vec_loss"] + r1["vec_loss"]) / 2, vec_loss.detach(), atol=1e-6)
    # Gradient wrt a rank's own vectors = W x the single-process gradient (W = 2).
    assert torch.allclose(torch.cat([r0["q_grad"], r1["q_grad"]]), 2 * q.grad, atol=1e-6)
    assert torch.allclose(torch.cat([r0["p_grad"], r1["p_grad"]]), 2 * p.grad, atol=1e-6)


def _four_rank_worker(rank, world, tmp_path, text, spans, view1, view2):
    """COSTA's eq. 8, CPDAE's eq. 5 (JS) and fine-tuning's loss on this rank's quarter of one global batch."""
    cpdae, out = importlib.import_module("cpdae"), {}
    n, m = text.shape[0] // world, view1.shape[0] // world
    local = [t[rank * n:(rank + 1) * n].clone().requires_grad_() for t in (text, spans)]
    gwc_loss = run.across_ranks(run.in_fp32(costa.gwc_loss), costa.gather_across_ranks)   # as costa.train() wraps it
    loss, _ = gwc_loss(*local, 0.1)
    loss.backward()
    out["costa"] = (loss.detach(), local[0].grad, local[1].grad)
    local = [v[rank * m:(rank + 1) * m].clone().requires_grad_() for v in (view1, view2)]
    contrastive_loss = run.across_ranks(cpdae.contrastive_loss, cpdae.gather_across_ranks)   # as cpdae.train() wraps it
    loss, _ = contrastive_loss(*map(cpdae.word_distribution, local), cpdae.js_similarity)
    loss.backward()
    out["cpdae"] = (loss.detach(), local[0].grad, local[1].grad)
    model = _tiny_bi_encoder("softmax")
    loss, _ = model(_local(_toy_batch(n_queries=8), rank, world))
    loss.backward()
    out["finetune"] = (loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    torch.save(out, tmp_path / f"rank{rank}.pt")


def test_four_processes_equal_one_process_for_every_gathered_loss(tmp_path, run_on_ranks):
    """4 gloo ranks x 2 texts (or queries) each against one process on all 8: COSTA, CPDAE and fine-tuning, loss
    and gradients; and each rank's own loss is that of its own texts as the anchors. A wrong direction of the
    anchors' rotation (roll(+rank n) for roll(-rank n)) leaves the sums over ranks as they are, and with 2 ranks
    it changes nothing at all; here rank 1 then takes rank 3's texts as anchors (seen failing so in costa.py
    and in cpdae.py, each alone)."""
    cpdae, g = importlib.import_module("cpdae"), torch.Generator().manual_seed(3)
    text, spans = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, 6, generator=g, dtype=torch.float64)
    view1 = torch.randn(8, 30, generator=g, dtype=torch.float64)
    view2 = view1 + 0.5 * torch.randn(8, 30, generator=g, dtype=torch.float64)
    ranks = run_on_ranks(4, _four_rank_worker, tmp_path, text, spans, view1, view2)
    one = {}
    gwc_loss, contrastive_loss = costa.gwc_loss, cpdae.contrastive_loss   # eq. 8, eq. 5 alone: one process
    for name, (a, b), fn in (("costa", (text, spans), lambda a, b: gwc_loss(a, b, 0.1)[0]),
                             ("cpdae", (view1, view2), lambda a, b: contrastive_loss(
                                 cpdae.word_distribution(a), cpdae.word_distribution(b), cpdae.js_similarity)[0])):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        loss = fn(a, b)
        one[name] = (loss.detach(), *torch.autograd.grad(loss, (a, b)))
        torch.testing.assert_close(sum(r[name][0] for r in ranks) / 4, one[name][0])
        for rank, r in enumerate(ranks):   # its own 2 texts first, as the anchors
            mine = [x.roll(-2 * rank, dims=0) for x in (a, b)]
            own = (gwc_loss(*mine, 0.1, n_anchors=2)[0] if name == "costa" else contrastive_loss(
                *map(cpdae.word_distribution, mine), cpdae.js_similarity, n_anchors=2)[0])
            torch.testing.assert_close(r[name][0], own.detach())
        for i in (1, 2):   # all_gather's backward sums over the ranks: each rank's rows get 4 x the gradient
            torch.testing.assert_close(torch.cat([r[name][i] for r in ranks]), 4 * one[name][i])
    model = _tiny_bi_encoder("softmax")
    loss, _ = model(_toy_batch(n_queries=8))
    loss.backward()
    torch.testing.assert_close(sum(r["finetune"][0] for r in ranks) / 4, loss.detach(), atol=1e-6, rtol=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:   # DDP averages the ranks' gradients
            torch.testing.assert_close(sum(r["finetune"][1][name] for r in ranks) / 4, p.grad, atol=1e-5, rtol=1e-4)


def test_softmax_loss_by_hand_with_excluded_candidate():
    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    p = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 1.0], [1.0, -1.0]])
    exclude = torch.tensor([[False, True, False, False], [False, False, False, False]])
    loss, _ = finetune.softmax_loss(q, p, torch.tensor([0, 2]), exclude)
    s0 = [1.0, 0.0, 1.0]          # candidate 1 excluded for query 0
    s1 = [2.0, 0.0, 2.0, -2.0]
    want = (-(1.0 - math.log(sum(math.exp(x) for x in s0))) - (2.0 - math.log(sum(math.exp(x) for x in s1)))) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    hinge, _ = finetune.hinge_loss(q, p, torch.tensor([0, 2]), exclude)
    h0 = [max(0, 1 - (1 - s)) for s in (0.0, 1.0)]       # negatives 2, 3 of query 0
    h1 = [max(0, 1 - (2 - s)) for s in (2.0, 0.0, -2.0)]  # negatives 0, 1, 3 of query 1
    assert hinge.item() == pytest.approx((sum(h0) / 2 + sum(h1) / 3) / 2)


# ------------------------------------------------------------------ sharded encode + search
def _toy_texts(n=37):
    rng = np.random.default_rng(3)
    words = ["protein", "cell", "gene", "cancer", "brain", "virus", "dose", "trial", "risk", "model", "blood", "liver", "heart", "mouse"]
    return [" ".join(rng.choice(words, rng.integers(3, 30))) for _ in range(n)]


def _retrieve_worker(rank, world, tmp_path):
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    c = finetune.Config(**TINY, encode_batch=8, query_len=16, passage_len=24, pooling="cls")
    texts = _toy_texts()
    shard = data.shard(len(texts), rank, world)
    s, i = evaluate.retrieve(encoder, _tokenizer(), texts, texts[:5], len(texts), c, torch.device("cpu"))
    torch.save({"scores": torch.from_numpy(s), "ids": torch.from_numpy(i), "shard": list(shard)}, tmp_path / f"rank{rank}.pt")


def _brute_force(encoder, texts, queries, c):
    tok = _tokenizer()
    one = lambda t, n: evaluate.encode(encoder, "cls", tok, [t], n, 1, torch.device("cpu"))[0]  # no padding at all
    docs = np.stack([one(t, c.passage_len) for t in texts])
    qs = np.stack([one(t, c.query_len) for t in queries])
    return qs @ docs.T  # (Q, N)


def _assert_same_topk(scores, ids, full, k):
    want = np.sort(full, axis=1)[:, ::-1][:, :k]
    np.testing.assert_allclose(scores, want, atol=1e-4)                                # same scores, best first
    np.testing.assert_allclose(np.take_along_axis(full, ids, 1), want, atol=1e-4)      # the ids carry those scores
    gaps = np.diff(want, axis=1)
    clear = np.concatenate([np.full((len(want), 1), True), np.abs(gaps) > 1e-4], 1) & \
        np.concatenate([np.abs(gaps) > 1e-4, np.full((len(want), 1), True)], 1)
    np.testing.assert_array_equal(ids[clear], np.argsort(-full, axis=1, kind="stable")[:, :k][clear])


def test_retrieve_matches_brute_force_single_and_two_ranks(tmp_path, run_on_two_ranks):
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    c = finetune.Config(**TINY, encode_batch=8, query_len=16, passage_len=24, pooling="cls")
    texts = _toy_texts()
    full = _brute_force(encoder, texts, texts[:5], c)
    s, i = evaluate.retrieve(encoder, _tokenizer(), texts, texts[:5], 10, c, torch.device("cpu"))
    _assert_same_topk(s, i, full, 10)
    r0, r1 = run_on_two_ranks(_retrieve_worker, tmp_path)
    assert sorted(r0["shard"] + r1["shard"]) == list(range(len(texts)))               # no document twice or lost
    for r in (r0, r1):
        ids = r["ids"].numpy()
        assert all(sorted(row) == list(range(len(texts))) for row in ids)              # k = N: each doc once
        _assert_same_topk(r["scores"].numpy(), ids, full, len(texts))


def test_other_positives_masks_shared_positives_but_not_the_target():
    candidates = torch.tensor([10, 11, 12, 13, 10])         # document 10 appears twice in the batch
    query_positives = torch.tensor([[10, -1], [12, 10]])    # -1 pads
    mask = finetune.other_positives(candidates, query_positives, torch.tensor([0, 2]))
    assert mask.tolist() == [[False, False, False, False, True], [True, False, False, False, True]]


# ------------------------------------------------------------------ end to end on a SciFact subset
FT_TINY_ARGS = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "64"]


def _scifact_subset(folder, n_train=24, n_test=16, n_other=120):
    """A small BEIR folder cut from the bundled SciFact: the judged documents of a few queries plus
    some others, so that an end-to-end run takes seconds."""
    import gzip

    src = HERE / "data" / "scifact"
    corpus, _, train = data.load_beir(src, "train")
    _, _, test = data.load_beir(src, "test")
    queries = data.read_queries(src / "queries.jsonl.gz")
    train = dict(sorted(train.items())[:n_train])
    test = dict(sorted(test.items())[:n_test])
    keep = {d for qr in (train, test) for docs in qr.values() for d in docs}
    keep |= set(list(corpus)[:n_other])
    (folder / "qrels").mkdir(parents=True)
    with gzip.open(folder / "corpus.jsonl.gz", "wt") as f:
        for d in sorted(keep):
            f.write(json.dumps({"_id": d, "title": corpus[d]["title"], "text": corpus[d]["text"]}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        f.writelines(json.dumps({"_id": q, "text": queries[q]}) + "\n" for q in list(train) + list(test))
    for name, qr in (("train", train), ("test", test)):
        lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{g}" for q, docs in qr.items() for d, g in docs.items()]
        (folder / "qrels" / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    return folder


def _tiny_init(folder):
    """A small random BERT folder, the starting checkpoint of the pipeline tests."""
    torch.manual_seed(0)
    run.hub.save_pretrained(finetune.Encoder(finetune.Config(**TINY)), folder)
    return str(folder)


def _count_corpus_encodings(monkeypatch):
    calls, real = [], evaluate.encode_corpus_shard
    monkeypatch.setattr(evaluate, "encode_corpus_shard", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_several_splits_share_one_encoding_of_the_corpus(tmp_path, monkeypatch):
    beir, init = _scifact_subset(tmp_path / "beir"), _tiny_init(tmp_path / "tiny")
    calls = _count_corpus_encodings(monkeypatch)
    flags = dict(model=init, dataset=str(beir), dev_queries=4, pooling="mean", similarity="cos")
    both = evaluate.main(evaluate.Config(split="dev,test", out_dir=str(tmp_path / "both"), **flags))
    assert len(calls) == 1 and set(both) == {"dev", "test"}
    for split in ("dev", "test"):   # the same run, file for file, as each split evaluated alone
        alone = evaluate.main(evaluate.Config(split=split, out_dir=str(tmp_path / split), **flags))
        assert alone[0] == both[split][0] and len(alone[1]) == (4 if split == "dev" else 16)
        assert (tmp_path / "both" / f"eval-{split}" / "run.trec").read_bytes() == (tmp_path / split / "run.trec").read_bytes()
        timed = set(data.read_json(tmp_path / "both" / f"eval-{split}" / "metrics.json")["info"])  # shared vectors:
        assert "encode_docs_s" not in timed and "encode_queries_s" in timed       # no encoding time of their own
    assert len(calls) == 3
    for module, bad in ((mechanisms, dict(split="dev,test", tsne="auto")), (evaluate, dict(split=" , "))):
        with pytest.raises(ValueError, match="--split"):
            module.main(module.Config(**{**flags, **bad}))


def test_finetune_evaluates_dev_and_test_on_one_encoding_of_the_corpus(tmp_path, monkeypatch):
    beir = _scifact_subset(tmp_path / "beir")
    calls = _count_corpus_encodings(monkeypatch)
    finetune.main(["--init", _tiny_init(tmp_path / "tiny"), "--dataset", str(beir), "--dev_queries", "4", "--steps", "1",
                   "--batch_size", "4", "--passage_len", "64", "--log_every", "1", "--out_dir", str(tmp_path / "ft")])
    assert len(calls) == 1
    for split, n in (("dev", 4), ("test", 16)):
        assert json.loads((tmp_path / "ft" / f"eval-{split}" / "metrics.json").read_text())["n_queries"] == n
    # --overwrite without test: the old run's eval-test/ goes, so no older metrics sit beside the new encoder.
    finetune.main(["--init", _tiny_init(tmp_path / "tiny"), "--dataset", str(beir), "--dev_queries", "4", "--steps", "1",
                   "--batch_size", "4", "--passage_len", "64", "--out_dir", str(tmp_path / "ft"), "--overwrite",
                   "--eval_split", ""])
    assert (tmp_path / "ft" / "eval-dev" / "metrics.json").is_file() and not (tmp_path / "ft" / "eval-test").exists()


def test_end_to_end_pretrain_finetune_evaluate(tmp_path, capsys):
    beir = _scifact_subset(tmp_path / "beir")
    out = tmp_path / "run"
    # The pipeline command: init zero-shot, continued pre-training (costa), fine-tuning (BM25 then mined
    # negatives) with and without it (--baseline), each evaluated, then the table vs BM25.
    finetune.main(["--pretrain", "costa", "--pretrain_steps", "2", "--init", _tiny_init(tmp_path / "tiny"), "--baseline",
                   "--pretrain_args", "--batch_size 4 --max_len 64 --log_every 1",
                   "--dataset", str(beir), "--steps", "2", "--batch_size", "4", "--n_negatives", "3",
                   "--passage_len", "64", "--rounds", "1", "--hard_depth", "30", "--log_every", "1", "--out_dir", str(out)])
    printed = capsys.readouterr().out
    assert "each query sees 15 negatives" in printed and "BM25 (k1=1.2, b=0.75)" in printed
    for row in ("tiny zero-shot", "tiny + fine-tune", "tiny + costa + fine-tune"):
        assert re.search(rf"^{re.escape(row)} +0\.\d{{4}}", printed, re.MULTILINE), row      # a row of the table
    assert "tiny + costa + fine-tune vs tiny + fine-tune: NDCG@10" in printed                 # its t-test
    assert (out / "zero-shot" / "eval-test" / "metrics.json").is_file()
    assert (out / "no-pretrain" / "encoder" / "retriever.json").is_file()
    assert (out / "pretrain" / "encoder" / "config.json").is_file()
    assert (out / "negatives_bm25.tsv").is_file() and (out / "negatives_round1.tsv").is_file()
    saved = json.loads((out / "eval-test" / "metrics.json").read_text())
    assert saved["n_queries"] == 16 and set(saved["per_query"]) <= set(data.read_qrels(beir / "qrels" / "test.tsv"))
    assert all(0.0 <= v <= 1.0 for v in saved["metrics"].values())
    # evaluate.py on the saved encoder gives the same numbers as the evaluation at the end of fine-tuning.
    means, _ = evaluate.main(evaluate.Config(model=str(out / "encoder"), dataset=str(beir), out_dir=str(tmp_path / "ev")))
    assert means == pytest.approx(saved["metrics"])
    bm25, _ = evaluate.main(evaluate.Config(bm25=True, dataset=str(beir), out_dir=str(tmp_path / "bm25")))
    bm25_saved = json.loads((out / "eval-test-bm25" / "metrics.json").read_text())
    assert bm25 == pytest.approx(bm25_saved["metrics"]) and bm25["Recall@1000"] > 0.9
    # The pools built from the cached rankings never hold a positive of their query.
    corpus, _, qrels = data.load_beir(beir, "train")
    doc_index = {d: i for i, d in enumerate(corpus)}
    for name in ("negatives_bm25.tsv", "negatives_round1.tsv"):
        for qid, ranked in finetune.read_negatives(out / name, doc_index).items():
            positives = [doc_index[d] for d, g in qrels[qid].items() if g > 0]
            assert len(ranked) > 0 and not set(positives) & set(finetune.negatives_from_ranking(ranked, positives))


# ------------------------------------------------------------------ starting checkpoints (--init / --model)
def test_minilm_short_name_is_the_checked_offline_package():
    folder = run.hub.resolve_model("minilm")
    assert Path(folder).is_dir() and (Path(folder) / "model.safetensors").is_file()
    # A sentence-transformers folder: its declared mean pooling and Normalize module (= cosine) are read.
    assert evaluate.read_retriever_settings(folder) == {"pooling": "mean", "similarity": "cos", "query_len": 256,
                                                   "passage_len": 256}
    encoder = evaluate.load_encoder("minilm")
    assert (encoder.config.hidden_size, encoder.config.num_layers, encoder.new_mlm_head) == (384, 6, True)


def test_minilm_with_a_different_sha256_is_refused(monkeypatch):
    monkeypatch.setattr(run.hub, "MINILM_SHA256", "0" * 64)
    run.hub._minilm_folder.cache_clear()
    try:
        with pytest.raises(data.DataError, match=r"model.safetensors: sha256 53aa5117\w+, expected 0{64}"):
            run.hub.resolve_model("minilm")
    finally:
        run.hub._minilm_folder.cache_clear()


def _fake_hub_cache(root, repo_id, save):
    """A cache folder laid out as huggingface_hub lays it out: refs/main names a snapshot folder."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save(repo / "snapshots" / commit)
    return {**os.environ, "HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"}


def test_hub_id_is_read_from_the_cache_offline_and_a_missing_one_is_one_line(tmp_path):
    pytest.importorskip("huggingface_hub")
    beir = _scifact_subset(tmp_path / "beir", n_train=2, n_test=4, n_other=20)
    env = _fake_hub_cache(tmp_path / "hub", "org/tiny-bert", _tiny_init)
    ok = subprocess.run([PY, str(HERE / "evaluate.py"), "--model", "org/tiny-bert", "--dataset", str(beir),
                         "--out_dir", str(tmp_path / "ev")], capture_output=True, text=True, timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["n_queries"] == 4
    missing = subprocess.run([PY, str(HERE / "evaluate.py"), "--model", "org/absent", "--dataset", str(beir)],
                             capture_output=True, text=True, timeout=300, env=env)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert missing.stderr.startswith("error: 'org/absent': not a local folder, and the hub could not provide it")


def test_hub_id_without_huggingface_hub_says_what_to_install(tmp_path):
    (tmp_path / "huggingface_hub").mkdir()      # an import of huggingface_hub that fails, as when it is absent
    (tmp_path / "huggingface_hub" / "__init__.py").write_text("raise ImportError('absent')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(HERE)])}
    result = subprocess.run([PY, str(HERE / "costa.py"), "--init", "bert-base-uncased", "--out_dir", str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: 'bert-base-uncased' is neither a folder nor 'minilm'; to fetch it as a "
                                     "Hugging Face hub id, pip install huggingface_hub")


def test_exported_encoder_declares_its_pooling_and_similarity_for_sentence_transformers(tmp_path):
    encoder = evaluate.load_encoder(_tiny_init(tmp_path / "tiny"))
    c = finetune.Config(pooling="mean", similarity="cos", passage_len=96)
    finetune.save_encoder(encoder, tmp_path / "out", c, data.VOCAB)
    out = tmp_path / "out"
    assert evaluate.read_retriever_settings(out) == {"pooling": "mean", "similarity": "cos", "query_len": 64, "passage_len": 96}
    (out / "retriever.json").unlink()          # what sentence-transformers reads says the same
    assert evaluate.read_retriever_settings(out) == {"pooling": "mean", "similarity": "cos", "query_len": 96, "passage_len": 96}
    assert [m["type"].rsplit(".", 1)[1] for m in json.loads((out / "modules.json").read_text())] == \
        ["Transformer", "Pooling", "Normalize"]
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["word_embedding_dimension"] == 32
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 96
    c = finetune.retriever_settings(finetune.Config(init=str(out), pooling="cls"))   # the command line wins
    assert (c.pooling, c.similarity) == ("cls", "cos")


def test_cosine_bi_encoder_scores_are_cosines_over_tau():
    torch.manual_seed(0)
    model = finetune.BiEncoder(finetune.Encoder(finetune.Config(**TINY)),
                               finetune.Config(pooling="mean", loss="softmax", similarity="cos", tau=0.05))
    batch = _toy_batch()
    q = model.encode(batch["q_ids"], batch["q_mask"])
    assert torch.allclose(q.norm(dim=1), torch.ones(len(q)), atol=1e-5)
    h = model.encoder(batch["p_ids"], batch["p_mask"])
    m = batch["p_mask"].unsqueeze(-1).float()
    p = (h * m).sum(1) / m.sum(1)
    want = F.cosine_similarity(q[:, None], p[None], dim=-1) / 0.05                          # (B, N)
    _, scores = finetune.softmax_loss(q, model.encode(batch["p_ids"], batch["p_mask"]), torch.zeros(4, dtype=torch.long), tau=0.05)
    assert torch.allclose(scores, want, atol=1e-4)


def test_a_checkpoint_without_mlm_head_gets_a_new_tied_one(tmp_path, wiki_texts):
    corpus = write(tmp_path / "corpus.txt", "\n\n".join(wiki_texts))
    run.hub.save_pretrained(evaluate.load_encoder(_tiny_init(tmp_path / "full")), tmp_path / "bare")    # no MLM head saved
    evaluate.write_retriever_settings(tmp_path / "bare", "mean", "cos", 64, 256)    # as a sentence-transformers folder
    encoder = run.hub.load_pretrained(costa.Encoder, tmp_path / "bare", costa.Config())
    assert encoder.new_mlm_head and encoder.mlm_head.word_embedding[0] is encoder.embeddings.word
    printed = main_run([HERE / "costa.py", "--init", tmp_path / "bare", "--steps", "1", "--corpus", corpus,
                        "--batch_size", "2", "--max_len", "32", "--out_dir", tmp_path / "o"], HERE)
    assert f"{tmp_path / 'bare'}: no MLM head in the checkpoint; training a new one" in printed
    # The pre-trained encoder keeps the checkpoint's pooling and similarity, for fine-tuning it alone.
    assert evaluate.read_retriever_settings(tmp_path / "o" / "encoder") == {"pooling": "mean", "similarity": "cos",
                                                                         "query_len": 64, "passage_len": 256}


def test_halt_and_resume_equals_uninterrupted_run(tmp_path):
    beir = _scifact_subset(tmp_path / "beir")
    base = ["--init", "", *FT_TINY_ARGS, "--dataset", str(beir), "--steps", "3", "--batch_size", "4", "--n_negatives", "3",
            "--passage_len", "48", "--rounds", "1", "--hard_depth", "30", "--eval_split", "", "--log_every", "1"]
    finetune.main(base + ["--out_dir", str(tmp_path / "a")])
    finetune.main(base + ["--out_dir", str(tmp_path / "b"), "--halt_at", "4"])  # killed at step 1 of stage 2
    assert not (tmp_path / "b" / "encoder").exists() and (tmp_path / "b" / "stage2" / "state.pt").is_file()
    finetune.main(base + ["--out_dir", str(tmp_path / "b"), "--resume"])
    a, b = (run.files.load_tensors(tmp_path / x / "encoder" / "model.safetensors") for x in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "negatives_round1.tsv").read_text() == (tmp_path / "b" / "negatives_round1.tsv").read_text()


def test_document_recipe_skips_the_bm25_stage_with_epochs_0(tmp_path):
    """COSTA 4.5.2 / CPDAE 4.1.3: documents start from the passage model and only mine (no BM25 stage)."""
    beir = _scifact_subset(tmp_path / "beir")
    args = ["--init", _tiny_init(tmp_path / "tiny"), *FT_TINY_ARGS, "--dataset", str(beir), "--steps", "2",
            "--batch_size", "4", "--n_negatives", "3", "--passage_len", "48", "--hard_depth", "30", "--eval_split", ""]
    finetune.main(args + ["--epochs", "0", "--rounds", "1", "--out_dir", str(tmp_path / "doc")])
    assert not (tmp_path / "doc" / "stage1").exists() and not (tmp_path / "doc" / "negatives_bm25.tsv").exists()
    assert (tmp_path / "doc" / "negatives_round1.tsv").is_file() and (tmp_path / "doc" / "encoder").is_dir()
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        finetune.main(args + ["--epochs", "0", "--rounds", "0", "--out_dir", str(tmp_path / "none")])


def test_word_distribution_figure_from_a_cpdae_folder(tmp_path):
    import cpdae

    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    run.hub.save_pretrained(encoder, tmp_path / "enc")
    decoder = cpdae.Decoder(TINY["hidden_size"], TINY["vocab_size"])
    run.files.save_tensors(tmp_path / "enc" / "decoder.safetensors", decoder.state_dict())
    text = "Nanotechnology raises many of the same issues as any new technology."
    probs = mechanisms.word_distribution(evaluate.load_encoder(tmp_path / "enc"), decoder, _tokenizer(), text, 64,
                                         torch.device("cpu"))
    assert probs.shape == (30522,) and probs.sum() == pytest.approx(1.0, abs=1e-5) and (probs > 0).all()
    assert mechanisms.trained_bottleneck(tmp_path / "enc") == "cls"   # no run config beside it: the paper's
    (tmp_path / "config.json").write_text(json.dumps({"bottleneck": "mean"}))   # cpdae.py --bottleneck mean's run
    assert mechanisms.trained_bottleneck(tmp_path / "enc") == "mean"
    mean = mechanisms.word_distribution(evaluate.load_encoder(tmp_path / "enc"), decoder, _tokenizer(), text, 64,
                                        torch.device("cpu"), "mean")
    assert not np.allclose(mean, probs)
    mechanisms.main(mechanisms.Config(model=str(tmp_path / "enc"), words=text, out_dir=str(tmp_path / "fig")))
    assert (tmp_path / "fig" / "words.png").read_bytes()[:4] == b"\x89PNG"
    run.hub.save_pretrained(encoder, tmp_path / "plain")   # an encoder without a CPDAE decoder: a clear error
    with pytest.raises(data.DataError, match="decoder.safetensors: not found"):
        mechanisms.main(mechanisms.Config(model=str(tmp_path / "plain"), words=text))


# ----------------------------------------------------------------------------------------------
# Mechanisms: each measurement on a case whose answer is known
# ----------------------------------------------------------------------------------------------
def test_common_words_are_the_lowest_idf_tokens_never_a_special_one():
    idf = np.array([0.1, 3.0, 1.0, 0.5, 2.0, 1.0, 9.0])           # id 0 and 3 special; 2 and 5 tie
    assert mechanisms.common_token_ids(idf, 3, [0, 3]).tolist() == [2, 4, 5]
    assert mechanisms.common_token_ids(idf, 2, [0, 3]).tolist() == [2, 5]   # the tie goes to the lower id


def test_held_out_sample_is_fixed_and_shuffled():
    texts = [f"t{i}" for i in range(50)]
    sample = mechanisms.held_out_sample(texts, 10)
    assert sample == mechanisms.held_out_sample(texts, 10) and len(set(sample)) == 10 and sample != sorted(sample)
    assert sorted(mechanisms.held_out_sample(texts, 99)) == sorted(texts)


def test_word_shares_known_answers():
    common = torch.tensor([True, True, False, False, False, False])
    bag = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0]])    # text 0: words 1 2 3; text 1: word 4
    probs = torch.tensor([[1.0, 0, 0, 0, 0, 0], [1 / 6] * 6])       # all on a common word; uniform
    shares = mechanisms.word_shares(probs, bag, common)
    assert shares["common"].tolist() == pytest.approx([1.0, 2 / 6])
    assert shares["representative"].tolist() == pytest.approx([0.0, 1 / 6])   # word 1 is common: not the text's own
    assert shares["common_uniform"].tolist() == pytest.approx([2 / 6, 2 / 6])
    assert shares["representative_uniform"].tolist() == pytest.approx([2 / 6, 1 / 6])
    on_own = torch.tensor([[0, 0, 0.5, 0.5, 0, 0], [0, 0, 0, 0, 1.0, 0]])      # all on the text's own words
    assert mechanisms.word_shares(on_own, bag, common)["representative"].tolist() == pytest.approx([1.0, 1.0])


def _fake_run(folder, script, config, model, extra=None):
    """A pre-training run folder as run.py leaves one (config.json, state.pt, encoder/), without training."""
    folder.mkdir(parents=True)
    run.files.atomic_write_json(folder / "config.json", {"script": script, **dataclasses.asdict(config)})
    run.folders.save_training_state(folder / "state.pt", {"step": 0, "model": model.state_dict(), "optimizer": {},
                                                  "scheduler": {}, "config": dataclasses.asdict(config)})
    run.hub.save_pretrained(model.encoder, folder / "encoder")
    if extra:
        extra(folder / "encoder")
    return str(folder / "encoder")


def test_word_shares_of_a_decoder_that_knows_nothing_is_the_uniform_level(tmp_path, wiki_texts):
    """A CPDAE decoder with zero weights and biases gives every word the same z_tilde: both shares sit at
    their uniform level exactly; the common words are the corpus's own ("the", ",")."""
    import cpdae

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in wiki_texts))
    torch.manual_seed(0)
    c = cpdae.Config(**TINY, max_len=64, corpus=str(corpus), cache_dir=str(tmp_path / "cache"))
    model = cpdae.PretrainModel(c, cpdae.Encoder(c))
    torch.nn.init.zeros_(model.decoder.out.weight)
    torch.nn.init.zeros_(model.decoder.out.bias)
    save = lambda enc: run.files.save_tensors(enc / "decoder.safetensors", model.decoder.state_dict())
    folder = _fake_run(tmp_path / "cpdae", "cpdae.py", c, model, save)
    rows = mechanisms.main(mechanisms.Config(model=folder, tag="cl on", word_shares=True, corpus=str(corpus), n_texts=8,
                                             n_common=10, out_dir=str(tmp_path / "out")))["word_shares"]
    row = rows[0]
    assert row["common"] == pytest.approx(10 / 30522) and row["common"] == pytest.approx(row["common_uniform"])
    assert row["representative"] == pytest.approx(row["representative_uniform"]) and row["representative"] > 0
    assert {"the", ",", "."} <= set(row["common_words"]) and len(row["common_words"]) == 10
    assert (row["method"], row["arm"], row["seed"], row["n_texts"], row["held_out"]) == ("cpdae", "cl on", 0, 8, False)
    assert row["command"].startswith("python -m research.mechanisms --model ") and "--word_shares --n_texts 8" in row["command"]
    assert json.loads((tmp_path / "out" / "word_shares-cl-on-seed0.json").read_text()) == row
    with pytest.raises(data.DataError, match="not the encoder of a cpdae.py run"):
        mechanisms.main(mechanisms.Config(model=_tiny_init(tmp_path / "plain"), word_shares=True, corpus=str(corpus)))


def test_h0_reliance_known_gaps():
    """A decoder that reads the text only from h0 loses exactly a nats a token when h0 is swapped (h0 = a e_i,
    output projection I: own loss log(1 + (V-1) e^-a), other log(e^a + V - 1)); one that ignores h0, none."""
    a, vocab = 3.0, 5
    ids = torch.tensor([[1] * 4, [2] * 4, [3] * 4])                                 # text i: token i+1 repeated
    h0 = a * torch.eye(vocab)[ids[:, 0]]                                            # (3, 5)
    reads_h0 = lambda inputs, h: h[:, None, :].expand(-1, inputs.shape[1], -1)
    own, other, n, _ = mechanisms.h0_reliance(reads_h0, torch.eye(vocab), h0, ids, ids)
    assert n == 12 and own / n == pytest.approx(math.log(1 + (vocab - 1) * math.exp(-a)), rel=1e-5)
    assert (other - own) / n == pytest.approx(a, rel=1e-5)
    ignores_h0 = lambda inputs, h: torch.eye(vocab)[inputs]
    own, other, _, _ = mechanisms.h0_reliance(ignores_h0, torch.eye(vocab), h0, ids, ids)
    assert own == other


def test_cosine_by_position_known_values():
    h0 = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    states = torch.stack([torch.stack([h0[0], torch.tensor([0.0, 5.0]), -h0[0]]),      # 1, 0, -1
                          torch.stack([h0[1], 3 * h0[1], torch.tensor([9.0, 9.0])])])   # 1, 1, (padding)
    sums, counts = mechanisms.cosine_by_position(states, h0, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert (sums / counts).tolist() == pytest.approx([1.0, 0.5, -1.0]) and counts.tolist() == [2, 2, 1]


def _frozen_corpora(tmp_path, wiki_texts):
    paths = {}
    for name, texts in (("train", wiki_texts[:4]), ("dev", wiki_texts[4:6]), ("test", wiki_texts[6:8])):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return {"train_corpus": str(paths["train"]), "dev_corpus": str(paths["dev"]), "corpus": str(paths["test"])}


def test_a_frozen_cpdae_trial_starts_at_the_constant_predictor_and_writes_one_row(tmp_path, wiki_texts, capsys):
    """--frozen cpdae: the decoder's output bias starts at the training windows' document-frequency log-odds, so
    after one step at a negligible lr its held-out L_REC is the constant predictor's (from bias 0 it would be near
    |V| ln 2 = 21,156); the row holds each held-out split at every --eval_every step, the settings and the Table 4
    words; the encoder's vectors are computed once (a second trial reads them from --frozen_cache); its progress
    lines print dev's measures and nothing of test (a pilot chooses from what it sees)."""
    flags = dict(model=_tiny_init(tmp_path / "enc"), frozen="cpdae", tag="cl", max_len=32, batch_size=4, n_texts=8,
                 frozen_cache=str(tmp_path / "cache"), out_dir=str(tmp_path / "rows"), **_frozen_corpora(tmp_path, wiki_texts))
    row = mechanisms.main(mechanisms.Config(steps=1, eval_every=1, lr=1e-12, **flags))[0]
    dev = row["curve"][0]["dev"]
    assert dev["rec"] == pytest.approx(dev["rec_constant"], rel=0.02) and dev["rec_constant"] < 1000
    assert dev["common"] == pytest.approx(dev["constant_common"], rel=0.05)
    out = capsys.readouterr().out
    assert "kept in" in out and "; dev: rec " in out and "test: rec" not in out   # nothing of test on the screen
    row = mechanisms.main(mechanisms.Config(steps=3, eval_every=2, cl_weight=0, seed=1, **flags))[0]
    assert "kept in" not in capsys.readouterr().out                                 # the vectors, read again
    assert [point["step"] for point in row["curve"]] == [2, 3] and set(row["curve"][0]) >= {"dev", "test"}
    assert row["settings"]["cl_weight"] == 0 and row["seed"] == 1 and row["measure"] == "frozen_cpdae"
    assert [w for w, _, _ in row["curve"][-1]["table4_words"]][:2] == ["Nanotechnology", "raises"]
    assert json.loads((tmp_path / "rows" / "frozen_cpdae-cl-seed1.json").read_text()) == json.loads(json.dumps(row))


def test_frozen_device_absent_or_unknown_is_one_line_before_any_work(tmp_path, wiki_texts):
    """--device names where a --frozen trial's decoder trains (the CPU by default); a GPU this machine lacks, or a
    name that is no device, stops it before any work with one line naming the flag, and --device without --frozen
    is refused."""
    flags = dict(model=str(tmp_path / "no-model-read"), frozen="seed", out_dir=str(tmp_path / "rows"),
                 **_frozen_corpora(tmp_path, wiki_texts))
    assert mechanisms.Config().device == "cpu"
    for name, said in (("cuda:99", "--device cuda:99: this machine has"), ("nowhere", "--device nowhere: not a")):
        with pytest.raises(ValueError, match=said):
            mechanisms.main(mechanisms.Config(device=name, **flags))
    with pytest.raises(ValueError, match="is --frozen's"):
        mechanisms.main(mechanisms.Config(**{**flags, "frozen": "", "heads": True, "device": "cuda"}))
    assert not (tmp_path / "rows").exists()


def test_seed_measures_no_gap_when_h0_is_cut_off_and_slopes_of_a_line():
    """The h0-swap gap is 0 at every position for a decoder whose cross-attention output is zero, and not for one
    that reads h0; slope() is per 100 positions, fitted from position 1."""
    import seed

    assert mechanisms.slope([9.0, 0.0, 2.0, 4.0, 6.0]) == pytest.approx(200.0)
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 16)
    c = seed.Config(hidden_size=16, num_heads=2, ffn_size=32, vocab_size=50, max_position=12, dec_span=0, dropout=0.0)
    decoder = seed.WeakDecoder(c, embedding)
    held = {"ids": torch.randint(5, 50, (6, 12)), "mask": torch.ones(6, 12, dtype=torch.long), "view1": torch.randn(6, 16)}
    unigram = torch.full((50,), -math.log(50))
    reads = mechanisms.seed_measures(decoder, held, unigram, batch=3)
    assert abs(reads["gap"]) > 1e-4 and len(reads["gap_by_position"]) == 11 and reads["unigram"] == pytest.approx(math.log(50))
    for block in decoder.blocks:
        torch.nn.init.zeros_(block.cross_out.weight)
        torch.nn.init.zeros_(block.cross_out.bias)
    cut = mechanisms.seed_measures(decoder, held, unigram, batch=3)
    assert cut["gap"] == pytest.approx(0.0, abs=1e-6) and max(map(abs, cut["gap_by_position"])) < 1e-5


def test_cpdae_gradient_ratio_scales_as_the_weights_do():
    """Eq. 4 averaged over |V| instead of summed makes L_REC's gradient |V| times smaller, tau 0.5 L_CL's about
    twice larger: the ratio moves by exactly |V|, and grows with 1 / tau."""
    torch.manual_seed(0)
    logits, bag = torch.randn(8, 40), (torch.rand(4, 40) < 0.2).float()
    ratio = {(r, t): mechanisms.cpdae_gradient_ratio(logits, bag, mechanisms.Config(rec_reduction=r, cl_tau=t))
             for r in ("sum", "mean") for t in (1.0, 0.5)}
    assert ratio["mean", 1.0] == pytest.approx(40 * ratio["sum", 1.0], rel=1e-4)
    assert ratio["sum", 0.5] > 1.5 * ratio["sum", 1.0]


def _report():
    spec = importlib.util.spec_from_file_location("mechanisms_report", HERE / "results" / "mechanisms" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mechanisms_report_holm_and_the_pilots_rules(tmp_path):
    """Holm's adjusted p-values (known values, monotone in the raw order); the CPDAE pilot waits for every row,
    takes the first variant whose gates hold on dev, and says none when none does."""
    report = _report()
    assert report.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert report.detectable(5, 1.0, 0.05 / 8) == pytest.approx(2.48, abs=0.01)   # the noncentral t's, not 2.35
    assert report.detectable(3, 2.0, 0.05) == pytest.approx(2 * 2.30, abs=0.02)
    rows = tmp_path / "rows"
    rows.mkdir()

    def pilot(variant, rec, acc, ratio):
        dev = {"rec": rec, "rec_constant": 100.0, "cl_acc": acc, "cl_chance": 1 / 31, "grad_cl_over_rec": ratio}
        run.files.atomic_write_json(rows / f"frozen_cpdae-cpdae-cl-{variant}-seed0.json",
                               {"settings": {"cl_weight": 0.1}, "curve": [{"step": 600, "dev": dev}]})
    assert report.CPDAE_ORDER[0] == "paper"
    pilot("paper", 90.0, 0.9, 1e-4)                         # the gradient gate fails
    assert report.choose_cpdae(tmp_path) == "pending"
    for variant in report.CPDAE_ORDER[1:]:
        pilot(variant, 90.0, 0.9, 3.0)
    assert report.choose_cpdae(tmp_path) == report.CPDAE_ORDER[1]
    pilot(report.CPDAE_ORDER[1], 99.5, 0.9, 3.0)            # L_REC not 1 % below the constant predictor's
    assert report.choose_cpdae(tmp_path) == report.CPDAE_ORDER[2]
    for variant in report.CPDAE_ORDER[2:]:
        pilot(variant, 90.0, 0.2, 3.0)                      # contrastive accuracy 6.2 x chance
    assert report.choose_cpdae(tmp_path) == "none"


def test_mechanisms_report_judges_the_encoder_side_only_with_every_seed_and_gate(tmp_path):
    """Tests 6-8 from the encoder side's rows: "not judged yet" while one planned seed's row of a gate (SEED's
    fine-tuned nDCG) is missing, though both arms of test 7 have every seed; then judged, in the claimed direction;
    a fine-tuned arm below command 1's level makes tests 7 and 8 not testable, and test 6 (its gates hold) stays."""
    report = _report()
    rows = tmp_path / "rows"
    heads = {"costa": {"gwc_acc": 0.5, "gwc_chance": 0.03}, "mlm": {"mlm_acc": 0.16, "mlm_chance": 0.05},
             "seed": {"dec_acc": 0.14, "dec_chance": 0.05}}
    for arm in ("costa", "mlm"):
        run.files.atomic_write_json(rows / "heads-dev" / f"heads-pilot-{arm}-seed0-step100.json", heads[arm])
    assert report.choose_encoder(tmp_path) == 100
    auc, cosine = {"costa": 0.96, "mlm": 0.955, "seed": 0.954}, {"costa": 0.2, "mlm": 0.3, "seed": 0.28}

    def write(arm, s, ndcg=0.74):
        wiggle = 0.001 * s * (s - 1)   # paired differences that vary over the seeds
        run.files.atomic_write_json(rows / "heads-dev" / f"heads-{arm}-seed{s}-step100.json", heads[arm])
        run.files.atomic_write_json(rows / "heads-test" / f"heads-{arm}-seed{s}-step100.json",
                               {"cosine_by_length": {"128": cosine[arm] + wiggle}})
        run.files.atomic_write_json(rows / f"finetune-{arm}-seed{s}.json", {"dev": {"NDCG@10": ndcg}})
        run.files.atomic_write_json(rows / f"discrimination-{arm}-seed{s}.json", {"auc": auc[arm] + wiggle / 3})
    for s in report.ENCODER_SEEDS:
        for arm in ("costa", "mlm", "seed"):
            write(arm, s)
    last = max(report.ENCODER_SEEDS)
    (rows / f"finetune-seed-seed{last}.json").unlink()
    tests = {t["number"]: t for t in report.verdicts(tmp_path)[0]}
    assert tests[7]["verdict"].startswith("not judged yet") and tests[7]["p"] == 1.0
    write("seed", last)
    tests = {t["number"]: t for t in report.verdicts(tmp_path)[0]}
    assert all(tests[n]["ran"] and tests[n]["p"] < 0.05 for n in (6, 7, 8))
    assert tests[6]["diffs"].mean() == pytest.approx(cosine["seed"] - cosine["mlm"])
    write("mlm", 0, ndcg=0.60)   # the mean over the seeds below 0.7252: COSTA 5.4's gate fails
    tests = {t["number"]: t for t in report.verdicts(tmp_path)[0]}
    assert tests[7]["verdict"].startswith("not testable") and tests[8]["verdict"].startswith("not testable")
    assert tests[6]["ran"]


def _confirm_report():
    spec = importlib.util.spec_from_file_location("confirm_report", HERE / "results" / "mechanisms" / "confirm" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _confirm_rows(folder, report, control_auc=0.86, skip=()):
    """Synthetic rows of every arm and seed the confirmatory plan asks for (CL's AUCs above no-CL's by 0.05, the
    control's at control_auc, SEED's and Figure 5's in the claimed direction), stamped with plan.md's sha256."""
    shutil.copy(HERE / "results" / "mechanisms" / "confirm" / "plan.md", folder / "plan.md")
    plan, sha = report.read_plan(folder)
    (folder / "rows").mkdir()
    (folder / "rows" / "PLAN.sha256").write_text(sha + "\n")
    rng = np.random.default_rng(0)
    auc = {"cpdae-cl": 0.9, "cpdae-nocl": 0.85, "cpdae-control": control_auc, "cpdae-l0.001": 0.87,
           "cpdae-l0.01": 0.88, "cpdae-l0.03": 0.8}
    for s in plan["seeds"]:
        for arm, path in plan["arms"].items():
            if (arm, s) in skip:
                continue
            noise = float(rng.normal(0, 0.002))
            if arm in auc:
                point = {"rec": 90.0, "rec_constant": 100.0, "grad_cl_over_rec": 30.0, "auc_text": auc[arm] + noise,
                         "auc_common": auc[arm] - 0.1 + noise, "auc_text_by_text": [auc[arm] + noise] * 4,
                         "auc_common_by_text": [auc[arm] - 0.1 + noise] * 4, "representative": auc[arm] / 20,
                         "representative_uniform": 0.0018, "constant_representative": 0.009}
            elif arm.startswith("seed-"):
                weak = arm == "seed-weak"
                point = {"loss_own": 5.7, "unigram": 7.3, "loss_other": 6.4 if weak else 6.3, "gap": 0.6 + 0.2 * weak
                         + noise, "gap_slope_nosep": 0.1 * weak + noise, "cosine_slope_nosep": 0.1 * weak + noise}
            else:
                for split in ("dev", "test"):
                    run.files.atomic_write_json(folder / "rows" / (path["row"].format(seed=s, split=split) + ".json"),
                                           {"mlm_acc": 0.16, "mlm_chance": 0.05, "dec_acc": 0.14, "dec_chance": 0.05,
                                            "cosine_by_length": {"128": 0.29 - 0.03 * (arm == "seed") + noise}})
                continue
            run.files.atomic_write_json(folder / "rows" / (path["row"].format(seed=s) + ".json"),
                                   {"settings": {"cl_weight": 0.003}, "curve": [{"step": 600, "dev": point, "test": point}]})
    return plan, sha


def test_confirm_report_judges_by_its_plan_with_every_seed_the_control_beaten_and_holm_over_its_family(tmp_path):
    """results/mechanisms/confirm/report.py: with every planned row in, the 8 tests are judged, Holm's adjustment
    over those 8 only; a test waits for every seed of its arms and gates (a missing control row leaves CPDAE's
    tests and the Holm column pending); CPDAE's claim needs the control beaten as well as no-CL; a threshold
    edited in plan.md changes the gate (the report reads the plan); edited after the rows, it is refused, while
    corrections under "## Corrections after the rows" bind nothing."""
    report = _confirm_report()
    plan, sha = _confirm_rows(tmp_path, report)
    results, gates = report.judge(tmp_path, plan)
    assert len(results) == 8 and all(g[3] for g in gates)
    assert [r["verdict"] for r in results] == ["shown"] * 8
    smallest = min(r["p"] for r in results)
    assert min(r["holm"] for r in results) == pytest.approx(min(1.0, 8 * smallest))    # the family is these 8
    assert report.main(tmp_path) == 0 and f"`{sha}`" in (tmp_path / "table.md").read_text()

    missing = tmp_path / "miss"
    missing.mkdir()
    plan, _ = _confirm_rows(missing, report, skip={("cpdae-control", 9)})
    results, _ = report.judge(missing, plan)
    assert [r["state"] for r in results][:5] == ["pending"] * 4 + ["judged"]   # the control's gate lacks seed 9 too
    assert all(r["holm"] is None for r in results)                                      # not until all are settled

    beaten = tmp_path / "control"
    beaten.mkdir()
    plan, _ = _confirm_rows(beaten, report, control_auc=0.95)                            # the control beats CL
    results, _ = report.judge(beaten, plan)
    assert results[0]["verdict"] == "shown" and results[1]["verdict"] == "not shown"
    report.main(beaten)
    assert "CL moves z~ onto the text's own words (tests 1, 2): **not shown**" in (beaten / "table.md").read_text()

    strong = json.loads((beaten / "rows" / "frozen_seed-seed-strong-seed5.json").read_text())
    strong["curve"][0]["dev"]["loss_other"] = 9.0                   # the full-causal decoder: the worse language model
    run.files.atomic_write_json(beaten / "rows" / "frozen_seed-seed-strong-seed5.json", strong)
    results, _ = report.judge(beaten, plan)
    assert all(r["verdict"].startswith("not testable") and r["p"] == 1.0 for r in results[4:7])
    assert results[7]["verdict"] != "pending" and results[0]["verdict"] == "shown"

    plan_md = tmp_path / "plan.md"
    plan_md.write_text(plan_md.read_text() + "\n## Corrections after the rows\n\nWording only.\n")
    assert report.check_binding(tmp_path, report.read_plan(tmp_path)[1]) == sha       # what follows binds nothing
    plan_md.write_text(plan_md.read_text().replace('"op": "<=", "threshold": 0.99}', '"op": "<=", "threshold": 0.5}'))
    spec, new_sha = report.read_plan(tmp_path)
    assert report.gates(tmp_path, spec)[0][3] is False                                 # read from plan.md itself
    with pytest.raises(report.PlanError, match="plan.md: edited after its rows"):
        report.check_binding(tmp_path, new_sha)
    assert report.main(tmp_path) == 1


def test_confirm_make_sh_with_every_row_only_reprints_and_stops_on_an_edited_plan(tmp_path):
    """results/mechanisms/confirm/make.sh in a tree whose rows are all in trains nothing: it writes table.md and
    the figures and no output.txt (a fresh clone stays clean); with plan.md edited after the rows it stops in one
    line naming plan.md, before any work."""
    report = _confirm_report()
    folder = tmp_path / "results" / "mechanisms" / "confirm"
    folder.mkdir(parents=True)
    shutil.copy(HERE / "results" / "mechanisms" / "report.py", folder.parent / "report.py")
    for name in ("make.sh", "report.py"):
        shutil.copy(HERE / "results" / "mechanisms" / "confirm" / name, folder / name)
    _confirm_rows(folder, report)
    run_make = lambda: subprocess.run(["bash", "results/mechanisms/confirm/make.sh"], cwd=tmp_path, text=True,
                                      capture_output=True, env={**os.environ, "PYTHON": PY}, timeout=300)
    done = run_make()
    assert done.returncode == 0, done.stderr
    assert (folder / "table.md").is_file() and (folder / "cpdae_lambda.png").is_file()
    assert (folder / "cpdae_arms.png").read_bytes()[:4] == b"\x89PNG"
    assert not (folder / "output.txt").exists() and not (tmp_path / "runs").exists()
    (folder / "plan.md").write_text((folder / "plan.md").read_text().replace("## Seeds", "## Seeds\n\nan edit"))
    stopped = run_make()
    assert stopped.returncode == 1 and stopped.stderr.strip().count("\n") == 0
    assert "plan.md: edited after its rows" in stopped.stderr


def test_confirm_measures_read_the_order_of_z_tilde_so_flattening_moves_the_old_share_only():
    """The confirmatory CPDAE measures (rank AUCs) on known cases: 1 when the text's words lead, 0 when they trail,
    1/2 for ties; a flatter z~ (mixed with the uniform, or a temperature on the logits) leaves them unchanged,
    while the first round's share of the text's words, z~'s entropy and the sum of the sigmoids move."""
    import cpdae

    scores = torch.tensor([[5.0, 4.0, 1.0, 0.0, 9.0], [0.0, 1.0, 4.0, 5.0, 9.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    positive = torch.tensor([[1, 1, 0, 0, 0]] * 3, dtype=torch.bool)
    negative = torch.tensor([[0, 0, 1, 1, 0]] * 3, dtype=torch.bool)                     # column 4: neither
    assert mechanisms.rank_auc(scores, positive, negative).tolist() == [1.0, 0.0, 0.5]
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 2
    bag = (torch.rand(6, 300) < 0.1).float()
    bag[:, :3] = 0
    common = torch.zeros(300, dtype=torch.bool)
    common[3:20] = True
    special = [0, 1, 2]
    before = mechanisms.text_word_measures(logits, bag, common, special)
    hotter = mechanisms.text_word_measures(logits * 0.3, bag, common, special)          # sigmoid's temperature
    for name in ("auc_text", "auc_common"):
        assert torch.allclose(before[name], hotter[name]) and 0.2 < before[name].mean() < 0.8
    assert not torch.allclose(before["entropy"], hotter["entropy"])
    assert not torch.allclose(before["sigmoid_sum"], hotter["sigmoid_sum"])
    probs = cpdae.word_distribution(logits)
    flat = 0.5 * probs + 0.5 / 300                                                       # mixed with the uniform
    own, absent = bag.bool() & ~common, ~bag.bool() & ~common
    absent[:, special] = False
    assert torch.allclose(mechanisms.rank_auc(probs, own, absent), mechanisms.rank_auc(flat, own, absent))
    old = mechanisms.word_shares(probs, bag, common)["representative"]
    assert not torch.allclose(old, mechanisms.word_shares(flat, bag, common)["representative"], rtol=0.05)


def test_cpdae_control_arm_pairs_each_view_with_another_texts_and_seeds_draw_their_own_masks(tmp_path, wiki_texts):
    """The control arm's second texts are m others (none of the step's), its loss is L_REC over the 2m views with
    their own texts' bags plus lambda x eq. 5 with text i's positive the view of other[i]; a --confirm trial of it
    writes every test text's AUC, and --mask_seed draws (and caches apart) its own masked views."""
    import cpdae

    torch.manual_seed(0)
    n, m, vocab = 12, 4, 30
    train = {"view1": torch.randn(n, 8), "view2": torch.randn(n, 8), "ids": torch.randint(5, vocab, (n, 6))}
    rows = torch.tensor([0, 3, 5, 7])
    other = mechanisms.other_texts(np.random.default_rng(0), n, rows)
    assert len(other) == m and not set(other.tolist()) & set(rows.tolist()) and len(set(other.tolist())) == m
    decoder = cpdae.Decoder(8, vocab, 1e-12)
    bag = cpdae.bag_of_words(train["ids"][rows], vocab, [0])
    c = mechanisms.Config(rec_reduction="mean", cl_weight=0.5)
    loss = mechanisms.cpdae_control_step(decoder, train, rows, other, bag, vocab, [0], c)
    logits = decoder(torch.cat([train["view1"][rows], train["view2"][other]]))
    rec = cpdae.reconstruction_loss(logits, torch.cat([bag, cpdae.bag_of_words(train["ids"][other], vocab, [0])]),
                                    None, "mean")
    cl, _ = cpdae.contrastive_loss(*cpdae.word_distribution(logits).chunk(2), cpdae.js_similarity)
    assert loss.item() == pytest.approx((rec + 0.5 * cl).item(), rel=1e-5)
    corpora = _frozen_corpora(tmp_path, [text[:700] for text in wiki_texts])   # a few windows each: cheap
    flags = dict(model=_tiny_init(tmp_path / "enc"), frozen="cpdae", max_len=32, batch_size=4, n_texts=8, steps=1,
                 frozen_cache=str(tmp_path / "cache"), out_dir=str(tmp_path / "rows"), confirm=True, **corpora)
    row = mechanisms.main(mechanisms.Config(tag="control", cl_positive="other", mask_seed=5, seed=5, **flags))[0]
    test = row["curve"][-1]["test"]
    assert len(test["auc_text_by_text"]) == 8 and 0 <= test["auc_text"] <= 1 and test["entropy"] > 0
    assert row["settings"]["cl_positive"] == "other" and row["settings"]["mask_seed"] == 5
    cached = sorted(p.name for p in (tmp_path / "cache").glob("train-*.safetensors"))
    assert len(cached) == 1 and cached[0].endswith("-m5.safetensors")
    encoder = evaluate.load_encoder(tmp_path / "enc")
    windows = run.cache.token_windows(corpora["corpus"], data.VOCAB, 32, 0, "")
    draws = [mechanisms.frozen_vectors(encoder, windows, "cls", seed) for seed in (0, 5)]
    assert torch.equal(draws[0]["plain"], draws[1]["plain"]) and not torch.equal(draws[0]["view1"], draws[1]["view1"])


def test_matched_control_trains_on_the_cl_arms_windows_with_another_windows_positive(tmp_path, wiki_texts):
    """The matched control's eq. 5 (written out here as a loop): anchor i's positive is window i+1's second view,
    its own second view neither positive nor negative; a trial of it draws the CL arm's windows in the CL arm's
    order (same count of distinct windows, same digest) and measures L_CL and its pull on its own pairs."""
    import cpdae

    torch.manual_seed(0)
    m = 5
    view1, view2 = torch.rand(m, 7).softmax(-1), torch.rand(m, 7).softmax(-1)
    loss, _ = mechanisms.matched_contrastive_loss(view1, view2, cpdae.js_similarity)
    z = torch.cat([view1, view2])
    terms = []
    for i in range(m):
        candidates = [k for k in range(2 * m) if k not in (i, m + i)]
        scores = torch.stack([cpdae.js_similarity(view1[i:i + 1], z[k:k + 1])[0, 0] for k in candidates])
        terms.append(-(scores[candidates.index(m + (i + 1) % m)] - scores.logsumexp(0)))
    assert loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-5)
    corpora = _frozen_corpora(tmp_path, [text[:700] for text in wiki_texts])
    flags = dict(model=_tiny_init(tmp_path / "enc"), frozen="cpdae", max_len=32, batch_size=4, n_texts=8, steps=3,
                 eval_every=3, frozen_cache=str(tmp_path / "cache"), out_dir=str(tmp_path / "rows"), confirm=True,
                 cl_weight=0.5, mask_seed=11, seed=11, **corpora)
    rows = {arm: mechanisms.main(mechanisms.Config(tag=arm, cl_positive=positive, **flags))[0]["curve"][-1]
            for arm, positive in (("cl", "own"), ("matched", "matched"))}
    assert rows["cl"]["windows"] == rows["matched"]["windows"] and 4 <= rows["cl"]["windows"]["distinct"] <= 12
    assert rows["cl"]["dev"]["cl"] != rows["matched"]["dev"]["cl"]              # each measured on its own pairs
    assert rows["cl"]["dev"]["grad_cl_over_rec"] != rows["matched"]["dev"]["grad_cl_over_rec"]


def test_seed_confirm_measures_leave_the_sep_target_out_of_the_slopes_only():
    """seed_confirm_measures gives seed_measures' numbers, and slopes without each window's final [SEP] target:
    on full windows ending in [SEP] the no-[SEP] curves are one position shorter; the per-text gaps average to
    the gap; a decoder whose cross-attention output is zero has no gap anywhere."""
    import seed

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 16)
    c = seed.Config(hidden_size=16, num_heads=2, ffn_size=32, vocab_size=50, max_position=12, dec_span=0, dropout=0.0)
    decoder = seed.WeakDecoder(c, embedding)
    ids = torch.randint(5, 50, (6, 12))
    ids[:, 0], ids[:, -1] = 3, 4                                                          # [CLS] ... [SEP]
    held = {"ids": ids, "mask": torch.ones(6, 12, dtype=torch.long), "view1": torch.randn(6, 16)}
    unigram = torch.full((50,), -math.log(50))
    old = mechanisms.seed_measures(decoder, held, unigram, batch=3)
    new = mechanisms.seed_confirm_measures(decoder, held, unigram, sep=4, batch=3)
    for name in ("loss_own", "loss_other", "gap", "unigram", "gap_slope", "cosine_slope"):
        assert new[name] == pytest.approx(old[name], rel=1e-5, abs=1e-7)
    assert len(new["gap_by_position_nosep"]) == len(old["gap_by_position"]) - 1 == 10
    assert new["gap_by_position_nosep"] == pytest.approx(old["gap_by_position"][:-1], abs=1e-6)
    assert new["gap_slope_nosep"] == pytest.approx(mechanisms.slope(old["gap_by_position"][:-1]), abs=1e-4)
    assert np.mean(new["gap_by_text"]) == pytest.approx(new["gap"], abs=1e-5) and len(new["gap_by_text"]) == 6
    for block in decoder.blocks:
        torch.nn.init.zeros_(block.cross_out.weight)
        torch.nn.init.zeros_(block.cross_out.bias)
    cut = mechanisms.seed_confirm_measures(decoder, held, unigram, sep=4, batch=3)
    assert max(map(abs, cut["gap_by_text"])) < 1e-5 and abs(cut["gap_slope_nosep"]) < 1e-3


def _seed_run(folder, dec_span, ignore_h0=False):
    import seed

    torch.manual_seed(0)
    c = seed.Config(**TINY, max_len=32, dec_span=dec_span)
    model = seed.PretrainModel(c, seed.Encoder(c))
    if ignore_h0:   # the cross-attention's output zero: h0 never reaches the decoder's states
        for block in model.decoder.blocks:
            torch.nn.init.zeros_(block.cross_out.weight)
            torch.nn.init.zeros_(block.cross_out.bias)
    return _fake_run(folder, "seed.py", c, model)


def test_decoder_reliance_from_seed_runs_zero_gap_when_h0_is_ignored(tmp_path, wiki_texts):
    """Two seed.py runs from the command line: a strong decoder whose cross-attention is cut off (gap exactly
    0) and a weak one that reads h0 (a gap); one row each, Figure 4 with one line each."""
    corpus = tmp_path / "held_out.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in wiki_texts))
    weak, strong = _seed_run(tmp_path / "weak", 2), _seed_run(tmp_path / "strong", 0, ignore_h0=True)
    rows = mechanisms.main(mechanisms.Config(model=f"{weak},{strong}", tag="weak,strong", decoder_reliance=True,
                                             corpus=str(corpus), n_texts=5, out_dir=str(tmp_path / "out")))["decoder_reliance"]
    assert [(r["arm"], r["dec_span"], r["method"], r["held_out"]) for r in rows] == [
        ("weak", 2, "seed", True), ("strong", 0, "seed", True)]
    assert rows[1]["gap"] == 0.0 and rows[1]["loss_own"] == rows[1]["loss_other"]
    assert rows[0]["gap"] != 0.0 and rows[0]["n_texts"] == 5
    assert len(rows[0]["cosine_by_position"]) == 31 and all(-1 <= v <= 1 for v in rows[0]["cosine_by_position"])
    assert rows[0]["cosine_by_length"] and all(-1 <= v <= 1 for v in rows[0]["cosine_by_length"].values())
    assert (tmp_path / "out" / "decoder_cosine.png").read_bytes()[:4] == b"\x89PNG"
    assert {p.name for p in (tmp_path / "out").glob("*.json")} == {"decoder_reliance-weak-seed0.json",
                                                                 "decoder_reliance-strong-seed0.json"}
    with pytest.raises(data.DataError, match="not the encoder of a seed.py run"):
        mechanisms.main(mechanisms.Config(model=_tiny_init(tmp_path / "plain"), decoder_reliance=True, corpus=str(corpus)))


def test_heads_rebuild_the_runs_objective_and_a_unigram_head_sits_at_chance(tmp_path, wiki_texts):
    """--heads: a costa.py run whose MLM head always answers the training corpus's most frequent token
    scores exactly its chance on held-out windows; every number is the mean of the run's own
    PretrainModel.terms over its Batches of those windows, dropout off; one row per step."""
    train, held_out = tmp_path / "train.jsonl", tmp_path / "held_out.jsonl"
    for path, texts in ((train, wiki_texts[:10]), (held_out, wiki_texts[10:])):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    torch.manual_seed(0)
    c = costa.Config(**TINY, max_len=64, batch_size=4, corpus=str(train), cache_dir=str(tmp_path / "cache"))
    frequent = data.most_frequent_token(run.cache.token_windows(c.corpus, c.vocab, c.max_len, 0, c.cache_dir))
    model = costa.PretrainModel(c, costa.Encoder(c), frequent_token=frequent)
    with torch.no_grad():
        model.encoder.mlm_head.bias[frequent] = 1e4                  # argmax = the most frequent token, always
    encoder = _fake_run(tmp_path / "run", "costa.py", c, model)
    rows = mechanisms.main(mechanisms.Config(model=encoder, tag="unigram", heads=True, corpus=str(held_out), n_texts=8,
                                             out_dir=str(tmp_path / "out")))["heads"]
    assert [(r["arm"], r["method"], r["step"], r["n_windows"], r["held_out"]) for r in rows] == [
        ("unigram", "costa", 0, 8, True)]
    assert rows[0]["mlm_acc"] == rows[0]["mlm_chance"] > 0
    model.eval()
    batches = costa.Batches(dataclasses.replace(c, steps=2), run.cache.token_windows(str(held_out), c.vocab, 64, 0, ""), 0, 1)
    with torch.no_grad():
        expected = [{**terms, **metrics} for terms, metrics in (model.terms(batches[i]) for i in range(2))]
    for name in ("L_MLM", "lambda L_GWC", "gwc", "gwc_acc", "gwc_chance"):
        assert rows[0][name] == pytest.approx((float(expected[0][name]) + float(expected[1][name])) / 2, rel=1e-5)
    assert set(rows[0]["cosine_by_length"]) == {32, 64, 128, 256, 512}
    assert [p.name for p in (tmp_path / "out").glob("*.json")] == ["heads-unigram-seed0-step0.json"]
    with pytest.raises(data.DataError, match="not the encoder of one of our pre-training runs"):
        mechanisms.main(mechanisms.Config(model=_tiny_init(tmp_path / "plain"), heads=True, corpus=str(held_out)))


def test_separation_known_values():
    at = lambda cos: [cos, math.sqrt(1 - cos * cos)]                 # a unit vector at that cosine to (1, 0)
    query, others = [1.0, 0.0], [at(0.1), at(0.3)]                   # mean 0.2, population sd 0.1
    assert mechanisms.separation(query, [at(0.5)] + others, [True, False, False]) == pytest.approx((1.0, 3.0))
    assert mechanisms.separation(query, [at(0.0)] + others, [True, False, False]) == pytest.approx((0.0, -2.0))
    assert mechanisms.separation(query, [at(0.3)] + others, [True, False, False])[0] == pytest.approx(0.75)  # a tie: half
    assert math.isnan(mechanisms.separation(query, [at(0.5), at(0.2), at(0.2)], [True, False, False])[1])


def test_discrimination_known_values_and_chance_for_a_blind_encoder():
    docs = np.array([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [-1.0, 0.0]], np.float32)
    queries = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)
    result = mechanisms.discrimination(queries, docs, [[1, 2], [0, 1, 2]], [[0], [3]])  # q1's relevant: the farthest
    # q0: relevant at cosine 1, others 0.8 and 0.6 (mean 0.7, sd 0.1); q1: relevant at -1, others 1, 0.8, 0.6
    assert result["per_query"] == [(1.0, pytest.approx(3.0)), (0.0, pytest.approx(-1.8 / math.sqrt(0.08 / 3)))]
    assert result["auc"] == pytest.approx(0.5) and (result["n_queries"], result["n_left_out"]) == (2, 0)
    assert mechanisms.discrimination(queries, docs, [[0], [1, 2]], [[0], [1]])["per_query"][0] is None  # only relevant
    rng = np.random.default_rng(0)                      # vectors that know nothing of relevance: auc near 0.5
    blind = mechanisms.discrimination(rng.standard_normal((20, 16)), rng.standard_normal((400, 16)),
                                      [list(range(400))] * 20, [list(range(q * 10, q * 10 + 10)) for q in range(20)])
    assert abs(blind["auc"] - 0.5) < 0.05 and abs(blind["margin"]) < 0.3


def test_discrimination_command_one_row_per_model(tmp_path):
    texts = {"d1": "apples are red", "d2": "bananas are yellow", "d3": "red and yellow grapes", "d4": "plums"}
    beir = tiny_beir(tmp_path / "beir", corpus_lines=[json.dumps({"_id": d, "text": t}) for d, t in texts.items()])
    models = f"{_tiny_init(tmp_path / 'a')},{_tiny_init(tmp_path / 'b')}"
    rows = mechanisms.main(mechanisms.Config(model=models, tag="costa,mlm", discrimination=True, dataset=str(beir),
                                             out_dir=str(tmp_path / "out")))["discrimination"]
    assert [(r["arm"], r["method"], r["seed"], r["n_queries"], r["n_left_out"], r["split"]) for r in rows] == [
        ("costa", None, None, 2, 0, "test"), ("mlm", None, None, 2, 0, "test")]   # d3 is each query's other candidate
    assert set(rows[0]["per_query"]) == {"q1", "q2"} and rows[0]["auc"] in (0.0, 0.5, 1.0)
    assert rows[0]["candidates"] == "bm25 top 100"
    assert rows[0]["auc"] == rows[1]["auc"]                           # the same weights: the same numbers
    assert (tmp_path / "out" / "discrimination-costa.json").is_file()
    assert mechanisms.command_line(mechanisms.Config(model="m", discrimination=True, n_texts=5)) == \
        "python -m research.mechanisms --model m --discrimination --n_texts 5"


def test_compare_command_and_one_line_errors(tmp_path, capsys):
    import subprocess

    qrels = tmp_path / "qrels.tsv"
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\nq3\td3\t1\n")
    a, b = tmp_path / "a.trec", tmp_path / "b.trec"
    a.write_text("q1 Q0 d1 1 3.0 a\nq2 Q0 d2 1 2.0 a\nq3 Q0 x 1 2.0 a\nq3 Q0 d3 2 1.0 a\n")
    b.write_text("q1 Q0 x 1 3.0 b\nq1 Q0 d1 2 1.0 b\nq2 Q0 x 1 2.0 b\nq2 Q0 d2 2 1.0 b\nq3 Q0 x 1 2.0 b\n")
    tests = evaluate.main(evaluate.Config(compare=f"{a},{b}", qrels=str(qrels)))
    assert tests["MRR@10"]["mean_a"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert tests["MRR@10"]["mean_b"] == pytest.approx((0.5 + 0.5 + 0) / 3)
    assert tests["MRR@10"]["t"] == pytest.approx(evaluate.paired_t_test([1, 1, 0.5], [0.5, 0.5, 0])[0])
    assert "paired two-tailed t-test" in capsys.readouterr().out
    b.write_text("q1 Q0 x 1 3.0 b\nq1 Q0 d1 two 1.0\n")
    result = subprocess.run([sys.executable, str(HERE / "evaluate.py"), "--compare", f"{a},{b}", "--qrels", str(qrels)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: {b}:2: expected 6 fields 'qid Q0 docid rank score tag', found 5"


def test_low_resource_sample_is_seeded():
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(50)}
    queries = {q: q for q in qrels}
    docs = {f"d{i}": i for i in range(50)}
    pick = lambda n, seed: [ex.qid for ex in finetune.make_examples(queries, qrels, docs, n, seed)]
    assert len(pick(10, 1)) == 10 and pick(10, 1) == pick(10, 1) and pick(10, 1) != pick(10, 2)
    assert len(pick(0, 1)) == 50
    with pytest.raises(data.DataError, match="only 50 training queries"):
        pick(51, 0)


# ----------------------------------------------------------------------------------------------
# Bad input through the command line: one line naming the file and what is wrong, exit code 1
# ----------------------------------------------------------------------------------------------
def run_error(args, cwd):
    """Run a script expected to refuse its input: (exit code, stderr stripped)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([PY, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stderr.strip()


def run_in_process(args, cwd):
    """`python *args` from cwd, run in this process: (exit code, stdout, stderr), stderr with the warnings Python
    would print. A new interpreter spends seconds importing torch; this is for the checks that need no process of
    their own. Signals, torchrun, locks a killed process held and resumes compared bit for bit keep theirs, and
    each script's one-line refusals are also checked in a process of its own (run_error)."""
    script, *argv = map(str, args)
    out, err, held, cwd_before, argv_before = io.StringIO(), io.StringIO(), set(run.folders._LOCKS), os.getcwd(), sys.argv
    quiet = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)  # Python's default
    code, threads = 0, torch.get_num_threads()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as shown, \
            torch.random.fork_rng(devices=[]):        # this process's random numbers stay as they were
        warnings.simplefilter("default")
        torch.set_num_threads(1)                      # as OMP_NUM_THREADS=1 in run_script and run_error
        os.chdir(cwd)
        sys.argv = [script, *argv] if script != "-c" else ["-c", *argv[1:]]
        try:
            if script == "-c":
                exec(compile(argv[0], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 -- python -c, here
            else:
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:               # as the interpreter ends: an int is the code, anything else is printed
            code = e.code if e.code is None or isinstance(e.code, int) else print(e.code, file=sys.stderr) or 1
        finally:
            os.chdir(cwd_before)
            sys.argv = argv_before
            torch.set_num_threads(threads)
            for folder in set(run.folders._LOCKS) - held:      # the end of the process would have let them go
                run.folders.release_run_folder(folder)
    for w in shown:
        if not issubclass(w.category, quiet):
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    return code or 0, out.getvalue(), err.getvalue()


def main_error(args, cwd):
    """run_error in this process (run_in_process): (exit code, stderr stripped)."""
    code, _, err = run_in_process(args, cwd)
    assert "Traceback" not in err, err
    return code, err.strip()


def main_run(args, cwd):
    """run_script in this process (run_in_process): what it printed."""
    code, out, err = run_in_process(args, cwd)
    assert code == 0, out + err
    return out


def tiny_beir(folder, corpus_lines=None, queries_lines=None, qrels_text=None):
    """A three-document BEIR folder; any of its files can be replaced by bad content (bytes or str)."""
    corpus = corpus_lines or ['{"_id": "d1", "text": "apples are red"}', '{"_id": "d2", "text": "bananas are yellow"}',
                              '{"_id": "d3", "text": "grapes are green"}']
    queries = queries_lines or ['{"_id": "q1", "text": "red apples"}', '{"_id": "q2", "text": "yellow"}']
    (folder / "qrels").mkdir(parents=True)
    for name, content in (("corpus.jsonl", corpus), ("queries.jsonl", queries)):
        content = b"\n".join(c if isinstance(c, bytes) else c.encode() for c in content) + b"\n"
        (folder / name).write_bytes(content)
    (folder / "qrels" / "test.tsv").write_text(qrels_text or "query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    return folder


def test_class1_undecodable_bytes_are_refused_with_file_line_and_offset(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"first document.\n\nsecond " + "café".encode("latin-1") + b" document.\n")
    code, err = main_error([HERE / "costa.py", "--corpus", corpus, "--out_dir", tmp_path / "o"], tmp_path)
    assert code == 1
    assert err == (f"error: {corpus}:3: byte 0xe9 at byte offset 27 is not UTF-8; convert the file to UTF-8 "
                   f"(e.g. iconv -f latin1 -t utf-8)")
    beir = tiny_beir(tmp_path / "beir", corpus_lines=['{"_id": "d1", "text": "ok"}', '{"_id": "d2", "text": "caf\xe9"}'
                                                      .encode("latin-1")])
    code, err = main_error([HERE / "evaluate.py", "--bm25", "--dataset", beir, "--out_dir", tmp_path / "ev"], tmp_path)
    assert code == 1
    assert err == (f"error: {beir / 'corpus.jsonl'}:2: byte 0xe9 at byte offset 54 is not UTF-8; convert the file "
                   f"to UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def test_class2_truncated_or_fake_gzip_names_the_file(tmp_path):
    whole = gzip.compress(("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(200))).encode())
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(whole[:len(whole) // 2])
    code, err = run_error([HERE / "seed.py", "--corpus", truncated, "--out_dir", tmp_path / "o"], tmp_path)
    assert code == 1 and re.fullmatch(rf"error: {re.escape(str(truncated))}: truncated gzip file \(it ends after "
                                      rf"line \d+, before the end-of-stream marker\)", err), err
    fake = write(tmp_path / "fake.jsonl.gz", '{"text": "plain text, not gzip"}\n')
    code, err = run_error([HERE / "cpdae.py", "--corpus", fake, "--out_dir", tmp_path / "o"], tmp_path)
    assert (code, err) == (1, f"error: {fake}: not a gzip file, although its name ends in .gz")
    damaged = tmp_path / "crc.jsonl.gz"                # a real gzip file whose checksum no longer matches
    damaged.write_bytes(whole[:-8] + bytes([whole[-8] ^ 1]) + whole[-7:])
    with pytest.raises(data.DataError, match=re.escape(f"{damaged}: damaged gzip data (its CRC-32 does not match)")):
        list(data.read_lines(damaged))


def test_class3_duplicate_ids_and_judgments_are_refused(tmp_path):
    beir = tiny_beir(tmp_path / "a", corpus_lines=['{"_id": "d1", "text": "x"}', '{"_id": "d2", "text": "y"}',
                                                   '{"_id": "d1", "text": "z"}'])
    code, err = main_error([HERE / "evaluate.py", "--bm25", "--dataset", beir, "--out_dir", tmp_path / "ev"], tmp_path)
    assert (code, err) == (1, f"error: {beir / 'corpus.jsonl'}:3: duplicate document id 'd1' (each may appear once)")
    beir = tiny_beir(tmp_path / "b", queries_lines=['{"_id": "q1", "text": "x"}', '{"_id": "q1", "text": "y"}'])
    code, err = main_error([HERE / "evaluate.py", "--bm25", "--dataset", beir, "--out_dir", tmp_path / "ev"], tmp_path)
    assert (code, err) == (1, f"error: {beir / 'queries.jsonl'}:2: duplicate query id 'q1' (each may appear once)")
    beir = tiny_beir(tmp_path / "c", qrels_text="query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td1\t0\n")
    code, err = main_error([HERE / "evaluate.py", "--bm25", "--dataset", beir, "--out_dir", tmp_path / "ev"], tmp_path)
    assert (code, err) == (1, (f"error: {beir / 'qrels' / 'test.tsv'}:3: duplicate judgment of document 'd1' "
                              f"for query 'q1' (each may appear once)"))


def test_class4_init_vocabulary_and_mismatched_state(tmp_path, small_corpus):
    # An --init folder with its own (smaller) vocabulary: pre-training uses the folder's vocab.txt.
    new = run.vocab.train_wordpiece(data.read_pretraining_texts(small_corpus), tmp_path / "v.txt", vocab_size=1000)
    torch.manual_seed(0)
    run.hub.save_pretrained(costa.Encoder(tiny_config(vocab_size=new.get_vocab_size())), tmp_path / "init", tmp_path / "v.txt")
    common = ["--corpus", small_corpus, *TINY_ARGS, "--steps", "1", "--init", tmp_path / "init"]
    main_run([str(a) for a in [HERE / "cpdae.py", *common, "--out_dir", tmp_path / "a"]], tmp_path)
    assert data.vocab_size_of(tmp_path / "a" / "encoder" / "vocab.txt") == new.get_vocab_size()
    bert = write(tmp_path / "bert_vocab.txt", data.VOCAB.read_text(encoding="utf-8"))  # an explicit, other vocab
    code, err = main_error([HERE / "costa.py", *common, "--vocab", bert, "--out_dir", tmp_path / "b"], tmp_path)
    assert (code, err) == (1, (f"error: {bert}: 30522 entries, but the --init model {tmp_path / 'init'} "
                              f"has vocab_size {new.get_vocab_size()}"))
    # Resuming from another method's state.pt, a truncated one, or with other sizes.
    code, err = main_error([HERE / "costa.py", *common, "--out_dir", tmp_path / "a", "--resume"], tmp_path)
    assert (code, err) == (1, (f"error: {tmp_path / 'a'} holds a run of cpdae.py, not of costa.py; give another "
                              f"--out_dir (or delete the folder to reuse its name)"))
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    del saved["script"]                                                # a folder written before config.json said whose
    (tmp_path / "a" / "config.json").write_text(json.dumps(saved))
    code, err = main_error([HERE / "costa.py", *common, "--out_dir", tmp_path / "a", "--resume"], tmp_path)
    assert (code, err) == (1, (f"error: {tmp_path / 'a' / 'state.pt'}: written by another script (it has --cl_mode); "
                              f"resume it with that script, or start again with --overwrite"))
    state = (tmp_path / "a" / "state.pt").read_bytes()
    (tmp_path / "a" / "state.pt").write_bytes(state[:len(state) // 2])
    code, err = main_error([HERE / "cpdae.py", *common, "--out_dir", tmp_path / "a", "--resume"], tmp_path)
    assert code == 1 and err.startswith(f"error: {tmp_path / 'a' / 'state.pt'}: sha256 ") and err.endswith(
        "that state.pt.sha256 recorded when it was written: the file is damaged, or its checksum file is; resume from "
        "a copy of the run; if state.pt is known good, recompute state.pt.sha256 (sha256sum state.pt > "
        f"state.pt.sha256, in {tmp_path / 'a'})")                        # its checksum catches it first
    sidecar = (tmp_path / "a" / "state.pt.sha256").read_bytes()
    (tmp_path / "a" / "state.pt.sha256").unlink()                      # ... and without one, torch.load does
    code, err = main_error([HERE / "cpdae.py", *common, "--out_dir", tmp_path / "a", "--resume"], tmp_path)
    assert (code, err) == (1, (f"error: {tmp_path / 'a' / 'state.pt'}: not a readable training state (RuntimeError); "
                              f"the file is truncated or not a state.pt; start again with --overwrite"))
    (tmp_path / "a" / "state.pt").write_bytes(state)
    (tmp_path / "a" / "state.pt.sha256").write_bytes(sidecar)
    code, err = main_error([HERE / "cpdae.py", *common, "--out_dir", tmp_path / "a", "--resume", "--max_len", "32"],
                          tmp_path)
    assert (code, err) == (1, (f"error: {tmp_path / 'a' / 'state.pt'}: these flags cannot change on --resume: "
                              f"--max_len 64 -> 32; resume with the saved values, or start again with --overwrite "
                              f"(a flag that may change on resume is one that its Config lists in RESUMABLE)"))


def test_class5_lengths_are_checked_against_the_model(tmp_path):
    code, err = main_error([HERE / "costa.py", "--max_len", "600", "--out_dir", tmp_path / "o"], tmp_path)
    assert (code, err) == (1, "error: --max_len 600 is more than the 512 positions of the model (max_position)")
    for bad in ("2", "3"):  # used to loop forever / say "every document tokenized to nothing"
        code, err = main_error([HERE / "seed.py", "--max_len", bad, "--out_dir", tmp_path / "o"], tmp_path)
        assert (code, err) == (1, f"error: --max_len must be >= 10, got {bad}")
    beir = tiny_beir(tmp_path / "beir")
    (beir / "qrels" / "train.tsv").write_text("q1\td1\t1\nq2\td2\t1\n")
    code, err = main_error([HERE / "finetune.py", "--init", "", "--dataset", beir, "--passage_len", "600",
                           "--out_dir", tmp_path / "ft"], tmp_path)
    assert (code, err) == (1, "error: --passage_len 600 is more than the 512 positions of the model (max_position)")
    assert not (tmp_path / "ft").exists()


def test_class6_flag_domains_and_non_finite_loss(tmp_path, small_corpus):
    for flag, value, rule in (("tau", "0", "> 0"), ("span_T", "-1", ">= 1"), ("span_alpha", "0", "> 0")):
        code, err = main_error([HERE / "costa.py", f"--{flag}", value, "--out_dir", tmp_path / "o"], tmp_path)
        assert (code, err) == (1, f"error: --{flag} must be {rule}, got {type(getattr(costa.Config, flag))(value)!r}")
    # A learning rate so large that step 2's loss is NaN: the run stops there, step 1's checkpoint stays.
    out = tmp_path / "nan"
    code, err = main_error([HERE / "costa.py", "--corpus", small_corpus, *TINY_ARGS, "--steps", "5", "--lr", "1e30",
                           "--warmup", "0", "--save_every", "1", "--out_dir", out], tmp_path)
    assert (code, err) == (1, (f"error: step 2: the loss is not finite (gradient norm nan); stopped without saving; "
                              f"{out} keeps its last good checkpoint, step 1"))
    state = run.folders.load_training_state(out / "state.pt")
    assert state["step"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_flag_errors_from_inside_modules_are_value_errors_and_print_one_line(tmp_path):
    for call, message in ((lambda: costa.parse_granularities("word,word"), "--granularities must be distinct"),
                          (lambda: costa.Projector(8, "deep"), "--projector must be one of"),
                          (lambda: finetune.loss_function("ranknet"), "--loss must be softmax or hinge"),
                          (lambda: evaluate.check_pooling_and_similarity("max", "dot"), "--pooling must be cls")):
        with pytest.raises(ValueError, match=message) as caught:
            call()
        assert not isinstance(caught.value, data.DataError)     # a flag, not a file
    code, err = main_error([HERE / "costa.py", "--granularities", "word,word", "--out_dir", tmp_path / "o"], tmp_path)
    assert (code, err) == (1, ("error: --granularities must be names from {word, phrase, sentence, paragraph}, "
                              "got 'word,word'"))
    code, err = main_error([HERE / "finetune.py", "--loss", "ranknet", "--out_dir", tmp_path / "f"], tmp_path)
    assert (code, err) == (1, "error: --loss must be one of {softmax, hinge}, got 'ranknet'")


def test_class7_resume_overwrite_logs_and_flags(tmp_path, small_corpus):
    out = tmp_path / "r"
    common = [HERE / "costa.py", "--corpus", small_corpus, *TINY_ARGS, "--steps", "4", "--out_dir", out]
    main_run([str(a) for a in common + ["--halt_at", "2"]], tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "state.pt").st_mode & 0o777 == 0o666 & ~umask            # not 0600
    code, err = main_error(common, tmp_path)                                        # no --resume, no --overwrite
    assert (code, err) == (1, (f"error: {out} already holds a run (state.pt, log.jsonl, encoder); continue it "
                              f"with --resume or replace it with --overwrite"))
    with open(out / "log.jsonl", "a") as f:                  # as if killed after logging step 3, before saving it
        f.write(json.dumps({"step": 3, "mlm": 0.0}) + "\n")
    (out / ".state.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    printed = main_run([str(a) for a in common + ["--resume", "--lr", "1e-3"]], tmp_path)
    assert "changed flags apply from now: --lr 0.0005 -> 0.001" in printed
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4] and not (out / ".state.pt.x1y2.tmp").exists()
    assert log[2]["lr"] == pytest.approx(1e-3 * (4 - 3) / 3)                     # the new lr, on the schedule
    main_run([str(a) for a in common + ["--steps", "1", "--overwrite"]], tmp_path)
    assert [r["step"] for r in read_log(out)] == [1]
    for flag, value, message in (("bf16", "maybe", "--bf16 expects true or false (also 1/0, yes/no), got 'maybe'"),
                                 ("preset", "papr", "--preset must be paper or lab (or empty), got 'papr'")):
        assert main_error([HERE / "costa.py", f"--{flag}", value], tmp_path) == (1, f"error: {message}")
    # --help into a pipe that is already closed (`costa.py --help | head`): no BrokenPipeError traceback.
    help_run = subprocess.Popen([PY, str(HERE / "costa.py"), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    help_run.stdout.close()
    assert (help_run.wait(timeout=60), help_run.stderr.read()) == (0, b"")
    # finetune.py checks the test qrels before training, not after both stages.
    beir = tiny_beir(tmp_path / "beir", qrels_text="query-id\tcorpus-id\tscore\nq1\td9\t1\n")
    (beir / "qrels" / "train.tsv").write_text("q1\td1\t1\nq2\td2\t1\n")
    code, err = main_error([HERE / "finetune.py", "--init", "", "--dataset", beir, "--out_dir", tmp_path / "ft"], tmp_path)
    assert (code, err) == (1, f"error: {beir / 'qrels' / 'test.tsv'}: document id 'd9' (query 'q1') is not in the corpus")
    assert not (tmp_path / "ft" / "stage1").exists()


def test_class8_all_zero_judged_queries_count_as_zero_like_trec_eval(tmp_path):
    # q2's only judgment is grade 0: trec_eval -c and pytrec_eval count it, with 0 on every metric.
    qrels = write(tmp_path / "qrels.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t2\nq1\td3\t1\nq2\td2\t0\n")
    a = write(tmp_path / "a.trec", "q1 Q0 d3 1 3.0 a\nq1 Q0 d1 2 2.0 a\nq2 Q0 d2 1 1.0 a\n")
    b = write(tmp_path / "b.trec", "q1 Q0 d1 1 3.0 b\nq2 Q0 d2 1 1.0 b\n")
    result = subprocess.run([PY, str(HERE / "evaluate.py"), "--compare", f"{a},{b}", "--qrels", str(qrels)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: [float(x) for x in line.split()[1:3]] for line in result.stdout.splitlines()
            if line.split() and line.split()[0] in evaluate.METRICS}
    ndcg_a = (1 / math.log2(2) + 2 / math.log2(3)) / (2 / math.log2(2) + 1 / math.log2(3))  # q1; q2 scores 0
    ndcg_b = (2 / math.log2(2)) / (2 / math.log2(2) + 1 / math.log2(3))
    assert "2 queries" in result.stdout
    assert rows["MRR@10"] == pytest.approx([(1 + 0) / 2, (1 + 0) / 2])
    assert rows["Recall@10"] == pytest.approx([(1 + 0) / 2, (0.5 + 0) / 2])
    assert rows["NDCG@10"] == pytest.approx([ndcg_a / 2, ndcg_b / 2], abs=1e-4)


# ------------------------------------------------------------------ the study (study.py)
def test_dev_split_is_fixed_and_disjoint_from_training_and_test():
    _, _, train = data.load_beir(data.SCIFACT, "train")
    _, _, test = data.load_beir(data.SCIFACT, "test")
    rest, dev = evaluate.carve_dev(train, 150)
    assert len(dev) == 150 and len(rest) == len(train) - 150
    assert not set(dev) & set(rest) and not set(dev) & set(test)
    assert all(any(g > 0 for g in dev[q].values()) for q in dev)            # dev queries have a positive
    shuffled = dict(sorted(train.items(), reverse=True))                    # the carve ignores dict order
    assert evaluate.carve_dev(shuffled, 150)[1] == dev
    assert list(evaluate.carve_dev(train, 150, seed=1)[1]) != list(dev)     # it is the fixed seed that fixes it
    with pytest.raises(data.DataError, match="--dev_queries 5000"):
        evaluate.carve_dev(train, 5000)


def test_seed_level_paired_t_test_by_hand():
    # Seed means of A and B differ by 0.01 .. 0.05: mean 0.03, sd sqrt(2.5) * 0.01, t = 0.03 / (sd / sqrt 5),
    # df = 4; two-tailed p from Student's t table: 0.013236.
    b = np.array([0.60, 0.62, 0.58, 0.61, 0.59])
    a = b + np.array([1, 2, 3, 4, 5]) / 100
    t, p = evaluate.paired_t_test(a, b)
    assert t == pytest.approx(0.03 / (math.sqrt(2.5) * 0.01 / math.sqrt(5)))
    assert t == pytest.approx(4.242641, abs=1e-5) and p == pytest.approx(0.013236, abs=1e-6)


def test_bootstrap_difference_against_exact_enumeration():
    # Constant difference: the interval is that difference.
    assert evaluate.bootstrap_difference(np.full((3, 4), 0.7), np.full((3, 4), 0.5), 500) == pytest.approx((0.2, 0.2))
    # 2 seeds, 1 query, differences 0 and 1: resample means 0, 0.5, 1 with chances 1/4, 1/2, 1/4,
    # so the 2.5% and 97.5% points are exactly 0 and 1.
    assert evaluate.bootstrap_difference(np.array([[0.0], [1.0]]), np.zeros((2, 1)), 4000) == (0.0, 1.0)
    # 3 seeds x 3 queries: every one of the 27 x 27 equally likely resamples, enumerated.
    d = np.random.default_rng(5).normal(size=(3, 3))
    import itertools
    draws = list(itertools.product(range(3), repeat=3))
    exact = [d[np.ix_(s, q)].mean() for s in draws for q in draws]
    low, high = evaluate.bootstrap_difference(d, np.zeros_like(d), 100_000)
    spread = np.ptp(exact)
    assert low == pytest.approx(np.percentile(exact, 2.5), abs=0.01 * spread)
    assert high == pytest.approx(np.percentile(exact, 97.5), abs=0.01 * spread)
    # Pairing kept: a large seed effect shared by A and B cancels; the interval is the constant 0.01.
    seed_effect = np.array([[0.0], [0.3], [-0.2]])
    b = np.full((3, 5), 0.5) + seed_effect
    assert evaluate.bootstrap_difference(b + 0.01, b, 500) == pytest.approx((0.01, 0.01))


def test_study_flags_per_arm_and_refuses_its_own():
    from research import study

    assert study.parse_arm_args("costa:--head_warmup 20;cpdae:--cl_weight 1; costa:--tau 0.1", study.ARMS) == {
        "costa": "--head_warmup 20 --tau 0.1", "cpdae": "--cl_weight 1"}
    c = study.Config(arm_args="mlm:--mask_prob 0.3", pretrain_args="--batch_size 8")
    cmd = study.pretrain_command(c, "mlm", 3, "out")
    assert cmd[1] == "costa.py" and " --gwc_weight 0 --batch_size 8 --mask_prob 0.3" in " ".join(cmd)
    assert cmd[cmd.index("--bottleneck") + 1] == c.vector        # the vector pre-training trains is the one read
    for bad, match in ((dict(finetune_args="--pooling cls"), "--pooling is set by the study"),
                       (dict(arm_args="cpdae:--seed 3"), "--seed is set by the study"),
                       (dict(arm_args="bert:--x 1"), "arm:flags")):
        with pytest.raises(ValueError, match=match):
            study.check_flags(dataclasses.replace(c, **bad))
    for flags in (["--vector", "max"], ["--arms", "none,bert"], ["--arms", "none,none"]):
        with pytest.raises(SystemExit, match=f"--{flags[0][2:]}"):
            run.cli.parse_config(study.Config, flags, "", {}, study.FLAG_RULES)


def test_study_quick_end_to_end_resumes_without_training_and_refuses_mixed_code(tmp_path, capsys, monkeypatch):
    from research import study

    out, results = tmp_path / "study", tmp_path / "results"
    argv = ["--quick", "--out_dir", str(out), "--results_dir", str(results)]
    real_stage, kinds = study.run_stage, set()

    def stage(cmd, log, hours):   # each kind of stage once in its own process, as the study runs it; its repeats here
        kind = cmd[1] if cmd[1] != "-c" else cmd[2]
        if kind not in kinds:
            kinds.add(kind)
            return real_stage(cmd, log, hours)
        t0 = time.time()
        code, printed, err = run_in_process(cmd[1:], HERE)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(printed + err)
        assert code == 0, (cmd, printed + err)
        return shlex.join(cmd), time.time() - t0
    monkeypatch.setattr(study, "run_stage", stage)
    study.main(argv)
    assert len(kinds) == 5                     # the tiny model, pre-training, zero-shot, gradients, fine-tuning
    rows = {p.stem: json.loads(p.read_text()) for p in (results / "runs").glob("*.json")}
    full = [f"{a}-seed{s}" for a in ("none", "costa") for s in (0, 1)]
    assert sorted(rows) == sorted(full + [f"{a}-n4-seed{s}" for a in ("none", "costa") for s in (0, 1)])
    _, _, train = data.load_beir(out / "quick-data" / "scifact-subset", "train")
    _, _, test = data.load_beir(out / "quick-data" / "scifact-subset", "test")
    for key in full:
        r = rows[key]
        assert r["code"] == study.code_hash(study.scripts_of(r["arm"])) and r["shared_code"] == study.code_hash(study.SHARED)
        assert len(r["commit"]) == 40 and r["torch"] and r["machine"].startswith("cpu: ")
        assert sorted(r["per_query"]["dev"]) == sorted(evaluate.carve_dev(train, 4)[1])   # the fixed dev queries
        assert sorted(r["per_query"]["test"]) == sorted(test)
        assert r["n_train"] == len(train) - 4                                               # dev is not trained on
        assert "--pooling mean" in r["commands"]["finetune"] and "--split dev,test" in r["commands"]["zero_shot"]
        assert set(r["zero_shot"]) == {"dev", "test"}
    assert rows["costa-seed0"]["commands"]["pretrain"].split()[1] == "costa.py"
    assert "pretrain_log" in rows["costa-seed1"] and "gradients" in rows["costa-seed0"]
    for s in (0, 1):   # the curve: sample s with seed s, as many steps as the full-data run
        assert f"--n_queries 4 --steps {rows[f'none-seed{s}']['finetune_steps']}" in rows[f"costa-n4-seed{s}"]["commands"]["finetune"]
    table = (results / "table.md").read_text()
    assert "paired t-test over seeds" in table and "bootstrap over queries x seeds" in table
    assert re.search(r"^\| costa \| 2 \| \d+ \| 0\.\d{4} \+- 0\.\d{4} \| .* \| [+-]0\.\d{4} \[[+-]0\.\d{4}, [+-]0\.\d{4}\] \| [\d.]+", table, re.MULTILINE)
    assert "## dev (4 queries" in table and re.search(r"^\| costa \| mlm_acc \| 0\.\d{4} \| 0\.\d{4} \| \d+\.\d\d \|$", table, re.MULTILINE)
    assert "Holm" in table and "fewer than the 5" in table and "| none | 2 |  | 0." in table and "(one encoder)" in table
    assert "| arm | zero-shot (n = 0) | n = 4 |" in table                     # the curve starts from each arm's zero-shot
    for r in rows.values():                    # what the numbers depend on, besides code and seed
        assert r["settings"]["vector"] == "mean" and r["settings"]["dev_queries"] == 4
    assert "pretrain_flags" in rows["costa-seed0"]["settings"] and "pretrain_flags" not in rows["none-seed0"]["settings"]
    for figure in ("differences.png", "low_resource.png"):
        assert (results / figure).stat().st_size > 1000
    # A rerun (a fresh clone: no run folders) trains nothing and prints the same table.
    shutil.rmtree(out / "none")
    calls = []
    monkeypatch.setattr(study, "run_stage", lambda cmd, log, hours: calls.append(cmd) or pytest.fail(f"ran {cmd}"))
    capsys.readouterr()
    study.main(argv)
    assert not calls and (results / "table.md").read_text() == table and table in capsys.readouterr().out
    # Other settings: the rows are refused, not reused (here: the vector).
    with pytest.raises(data.DataError, match=r"seed0.json: made with vector 'mean', this study has 'cls'"):
        study.main(argv + ["--vector", "cls"])
    # --report_only: the table from the rows there are, running nothing (a study part-way: seed 0 only).
    for key in ("none-seed1", "costa-seed1", "none-n4-seed1", "costa-n4-seed1"):
        (results / "runs" / f"{key}.json").rename(tmp_path / f"{key}.json")
    capsys.readouterr()
    study.main(argv + ["--report_only"])
    partial = capsys.readouterr().out
    assert not calls and "| costa | 1 |" in partial and "n/a (1 seed)" in partial and "(queries only)" in partial
    for key in ("none-seed1", "costa-seed1", "none-n4-seed1", "costa-n4-seed1"):
        (tmp_path / f"{key}.json").rename(results / "runs" / f"{key}.json")
    # An arm's rows from other code (an edit to its method file), nothing of it left to run: reported, named.
    for path in (results / "runs").glob("costa-*.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "code": "0123456789ab"}))
    capsys.readouterr()
    study.main(argv)
    assert not calls and "costa 0123456789ab (" in capsys.readouterr().out
    # ... but with one of its runs left, the new row would join them: refused (the other arms' are not).
    (results / "runs" / "costa-n4-seed1.json").rename(tmp_path / "costa-n4-seed1.json")
    with pytest.raises(data.DataError, match="rows of other code than this one would share a table"):
        study.main(argv)
    (tmp_path / "costa-n4-seed1.json").rename(results / "runs" / "costa-n4-seed1.json")
    # Rows of two codes for one arm are refused, unless asked for.
    row = json.loads((results / "runs" / "none-seed1.json").read_text())
    (results / "runs" / "none-seed1.json").write_text(json.dumps({**row, "code": "ba9876543210"}))
    with pytest.raises(data.DataError, match="rows of other code than this one would share a table"):
        study.main(argv)
    study.main(argv + ["--allow_mixed"])


def test_study_code_hash_covers_the_shared_scripts_and_the_arms_own_method_file():
    from research import study

    assert study.scripts_of("none") == study.SHARED and "finetune.py" in study.SHARED and "data.py" in study.SHARED
    assert study.scripts_of("mlm") == study.scripts_of("costa") == study.SHARED + ("costa.py",)
    assert all(study.scripts_of(method)[-1] == f"{method}.py" for method in run.METHODS)
    hashes = {arm: study.code_hash(study.scripts_of(arm)) for arm in study.ARMS}
    assert len(set(hashes.values())) == len(study.ARMS) - 1 and hashes["mlm"] == hashes["costa"]
    import evaluate
    import finetune
    for module in (evaluate, finetune):      # the shared scripts import no method file: an edit to one cannot reach them
        assert not set(run.METHODS) & set(vars(module)), module.__name__



def test_study_code_hash_stays_for_every_other_arm_when_a_method_is_added(tmp_path, monkeypatch):
    """A new method is its file plus one entry in run.METHODS: that entry is no code any other arm runs,
    so their hashes stay and their rows stand. Any other edit to run.py is code: every arm's hash moves."""
    from research import study

    for name in study.SCRIPTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(HERE / name, tmp_path / name)
    monkeypatch.setattr(study, "HERE", tmp_path)
    before = {arm: study.code_hash(study.scripts_of(arm)) for arm in study.ARMS}
    run_py = tmp_path / "run" / "__init__.py"
    text = run_py.read_text()
    assert text.count("\nMETHODS = (") == 1
    run_py.write_text(text.replace("\nMETHODS = (", '\nMETHODS = ("costa2", '))
    assert {arm: study.code_hash(study.scripts_of(arm)) for arm in study.ARMS} == before
    run_py.write_text(text + "\n# an edit\n")
    assert all(study.code_hash(study.scripts_of(arm)) != before[arm] for arm in study.ARMS)


def test_git_state_is_one_rule_dirty_is_a_script_changed_or_new(tmp_path):
    """One git_state (evaluate.py's) for every row that records its code: dirty = a .py file other than the
    tests differs from the commit or is not in it; a page or a test edited is not."""
    assert [p.name for p in sorted(HERE.glob("*.py")) if not p.name.startswith("test_")
            and "def git_state(" in p.read_text()] == ["evaluate.py"]
    git = lambda *argv: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=tmp_path,
                                       check=True, capture_output=True, text=True).stdout.strip()
    files = {"costa.py": "x = 1\n", "test_x.py": "y = 1\n", "conftest.py": "z = 1\n", "README.md": "a\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    commit = git("rev-parse", "HEAD")
    assert evaluate.git_state(tmp_path) == (commit, False)
    for name in ("test_x.py", "conftest.py", "README.md"):
        (tmp_path / name).write_text("edited\n")
    (tmp_path / "notes.md").write_text("new page\n")
    assert evaluate.git_state(tmp_path) == (commit, False)
    (tmp_path / "scratch.py").write_text("new script\n")
    assert evaluate.git_state(tmp_path) == (commit, True)
    (tmp_path / "scratch.py").unlink()
    (tmp_path / "costa.py").write_text("x = 2\n")
    assert evaluate.git_state(tmp_path) == (commit, True)

def test_holm_adjustment_by_hand():
    from research import study

    # sorted 0.01, 0.03, 0.04: x3 = 0.03, x2 = 0.06, x1 = 0.04 -> 0.06 (never below the one before)
    assert study.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": None}) == pytest.approx(
        {"a": 0.03, "b": 0.06, "c": 0.06, "d": None})
    assert study.holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}               # capped at 1


def test_gradient_norms_per_term_start_where_training_started(tmp_path, small_corpus):
    from research import study

    main_run([str(a) for a in [HERE / "cpdae.py", "--corpus", small_corpus, *TINY_ARGS, "--steps", "2",
                               "--bf16", "false", "--out_dir", tmp_path / "cp"]], tmp_path)
    rows = study.gradient_norms("cpdae", tmp_path / "cp", n_batches=1)
    first = json.loads((tmp_path / "cp" / "log.jsonl").read_text().splitlines()[0])    # step 1: batch 0
    assert first["step"] == 1
    start = rows["start"]
    assert start["L_REC"][0] == pytest.approx(first["rec"], rel=1e-4)     # the run's own first batch, term by term
    assert start["L_MLM"][0] == pytest.approx(first["mlm"], rel=1e-4)
    assert start["lambda L_CL"][0] == pytest.approx(0.1 * first["cl"], rel=1e-4)
    for when in ("start", "after"):
        assert all(math.isfinite(norm) and norm > 0 for _, norm in rows[when].values())
    assert rows["after"]["L_REC"] != start["L_REC"]                        # state.pt was loaded
    assert "| start | lambda L_CL |" in study.format_gradient_norms(rows, 2)


# ----------------------------------------------------------------------------------------------
# Reliability: every check before any work; nothing lost on --overwrite, a full disk or
# Ctrl-C; one line for bad input; progress on long steps
# ----------------------------------------------------------------------------------------------
def folder_bytes(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_overwrite_that_fails_a_check_leaves_the_old_run_byte_identical(tmp_path, small_corpus):
    out = tmp_path / "run"
    common = [HERE / "costa.py", "--corpus", small_corpus, *TINY_ARGS, "--out_dir", out]
    main_run([str(a) for a in common + ["--steps", "2"]], tmp_path)
    before = folder_bytes(out)
    assert {"state.pt", "log.jsonl", "encoder/model.safetensors"} <= set(before)
    tiny = write(tmp_path / "tiny.jsonl", json.dumps({"text": data.read_pretraining_texts(small_corpus)[0][:300]}) + "\n")
    n_windows = len(data.make_windows(data.load_tokenizer(), data.read_pretraining_texts(tiny), 64))
    for extra, message in (
            (["--corpus", tiny, "--batch_size", str(n_windows + 1)], "fewer than one global batch"),
            (["--projector", "bogus"], "--projector must be one of {nonlinear, linear, none}, got 'bogus'"),
            (["--global_batch", "6", "--grad_accum", "4"], "--global_batch 6 is not a multiple of 1 process(es)")):
        code, err = main_error(common + ["--overwrite", *extra], tmp_path)
        assert code == 1 and message in err, err
        assert folder_bytes(out) == before, extra


def test_choice_flags_and_batch_arithmetic_fail_before_the_token_cache(tmp_path, small_corpus):
    corpus = write(tmp_path / "c" / "corpus.jsonl", small_corpus.read_text())
    for script, extra, message in (
            ("costa.py", ["--projector", "bogus"], "--projector must be one of {nonlinear, linear, none}, got 'bogus'"),
            ("costa.py", ["--granularities", "word,clause"],
             "--granularities must be names from {word, phrase, sentence, paragraph}, got 'word,clause'"),
            ("cpdae.py", ["--cl_mode", "bogus"], "--cl_mode must be one of {js, cls}, got 'bogus'"),
            ("seed.py", ["--global_batch", "6", "--grad_accum", "4"], "--global_batch 6 is not a multiple of"),
            ("seed.py", ["--global_batch", "8", "--batch_size", "16"],
             "--batch_size 16 disagrees with --global_batch 8 on 1 process(es) x --grad_accum 1 (= 8 per rank)")):
        code, err = main_error([HERE / script, "--corpus", corpus, "--out_dir", tmp_path / "o", *extra], tmp_path)
        assert code == 1 and err.startswith("error: ") and message in err, err
        assert list((tmp_path / "c").iterdir()) == [corpus], script      # no token cache was built
        assert not (tmp_path / "o").exists()
    beir = tiny_beir(tmp_path / "beir")
    (beir / "qrels" / "train.tsv").write_text("q1\td1\t1\nq2\td2\t1\n")
    code, err = main_error([HERE / "finetune.py", "--init", "", "--dataset", beir, "--index", "bogus", "--rounds", "1",
                           "--out_dir", tmp_path / "ft"], tmp_path)
    assert (code, err) == (1, "error: --index must be a faiss index_factory string, got 'bogus'")
    assert not (tmp_path / "ft").exists()
    code, err = main_error([HERE / "research" / "study.py", "--arms", "none,bogus", "--out_dir", tmp_path / "st"], tmp_path)
    arms = ", ".join(["none", "mlm", *run.METHODS])
    assert (code, err) == (1, f"error: --arms must be names from {{{arms}}}, got 'none,bogus'")


def _tiny_training(tmp_path, small_corpus):
    import cpdae
    c = cpdae.Config(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_len=64, corpus=str(small_corpus),
                     out_dir=str(tmp_path / "run"))
    torch.manual_seed(0)
    model = cpdae.PretrainModel(c, cpdae.Encoder(c))
    optimizer, scheduler = run.make_optimizer(model, c)
    return cpdae, c, model, optimizer, scheduler


@pytest.mark.parametrize("fails", ["encoder", "state"])
def test_a_full_disk_keeps_the_last_checkpoint_whole_and_says_so(tmp_path, small_corpus, monkeypatch, fails):
    import errno
    _cpdae, c, model, optimizer, scheduler = _tiny_training(tmp_path, small_corpus)
    out = Path(c.out_dir)
    run.folders.save_checkpoint(c, model, optimizer, scheduler, 2, True)
    before = folder_bytes(out)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)                                            # step 4's weights differ from step 2's

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    if fails == "encoder":
        monkeypatch.setattr(run.files, "save_tensors", full)
    else:   # torch.save reports a full disk as "RuntimeError: [enforce fail at inline_container.cc] unexpected pos"
        monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("unexpected pos")))
        monkeypatch.setattr(shutil, "disk_usage", lambda folder: shutil_usage(free=0))
    with pytest.raises(data.DataError) as caught:
        run.folders.save_checkpoint(c, model, optimizer, scheduler, 4, True, 2)
    target = out / ("encoder" if fails == "encoder" else "state.pt")
    size = sum(p.stat().st_size for p in [out / "state.pt", *(out / "encoder").rglob("*")] if p.is_file())
    assert re.fullmatch(rf"{re.escape(str(target))}: the disk is full \(a checkpoint needs {size / 2**20:.1f} MiB, "
                        rf"[\d.]+ (?:B|KiB|MiB|GiB) free\); {re.escape(str(out))} keeps the checkpoint of step 2; free some space, "
                        r"or copy the run's --out_dir to a bigger disk, and continue with --resume \(--out_dir the new "
                        r"place\)", str(caught.value)), caught.value
    assert folder_bytes(out) == before                             # encoder/ and state.pt both still step 2


def shutil_usage(free):
    import collections
    return collections.namedtuple("usage", "total used free")(1 << 30, (1 << 30) - free, free)


def test_a_checkpoint_switch_cut_by_a_kill_is_completed_or_dropped(tmp_path, small_corpus):
    _cpdae, c, model, optimizer, scheduler = _tiny_training(tmp_path, small_corpus)
    out = Path(c.out_dir)
    run.folders.save_checkpoint(c, model, optimizer, scheduler, 2, True)
    step2 = folder_bytes(out)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_replace, calls = os.replace, []

    def killed_after_commit(src, dst):    # the kill lands right after state.pt was replaced
        real_replace(src, dst)
        calls.append(dst)
        if Path(dst).name == "state.pt":
            raise KeyboardInterrupt
    with pytest.MonkeyPatch.context() as m:
        m.setattr(data.os, "replace", killed_after_commit)
        with pytest.raises(KeyboardInterrupt):
            run.folders.save_checkpoint(c, model, optimizer, scheduler, 4, True, 2)
    assert (out / ".encoder.new").is_dir() and run.folders.load_training_state(out / "state.pt")["step"] == 4
    run.folders.prepare_run_folder(dataclasses.replace(c, resume=True))    # the next start completes the switch
    assert not (out / ".encoder.new").exists() and not (out / ".encoder.old").exists()
    assert (out / "encoder" / "model.safetensors").read_bytes() != step2["encoder/model.safetensors"]
    # Killed before the commit: the new files are dropped, step 2 stays.
    (out / ".state.pt.new").write_bytes(b"")
    (out / ".encoder.new").mkdir()
    run.folders.prepare_run_folder(dataclasses.replace(c, resume=True))
    assert not (out / ".encoder.new").exists() and not (out / ".state.pt.new").exists()


def test_resume_from_a_run_folder_that_was_moved(tmp_path, small_corpus):
    import shutil
    common = [HERE / "costa.py", "--corpus", small_corpus, *TINY_ARGS, "--steps", "4"]
    main_run([str(a) for a in common + ["--out_dir", tmp_path / "straight"]], tmp_path)
    main_run([str(a) for a in common + ["--out_dir", tmp_path / "old", "--halt_at", "2"]], tmp_path)
    shutil.move(tmp_path / "old", tmp_path / "bigger_disk")
    printed = run_script([str(a) for a in common + ["--out_dir", tmp_path / "bigger_disk", "--resume"]], tmp_path)
    assert "at step 2" in printed
    assert [r["mlm"] for r in read_log(tmp_path / "bigger_disk")] == [r["mlm"] for r in read_log(tmp_path / "straight")]


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, small_corpus):
    import signal
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([PY, str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "100000",
                             "--save_every", "2", "--out_dir", str(out)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal: a suite started in the background (nohup ... &) ignores
                            # SIGINT, and an ignored signal stays ignored across exec
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509 -- no threads yet
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (out / "log.jsonl").is_file() or len(read_log(out)) < 3:
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    saved = run.folders.load_training_state(out / "state.pt")["step"]
    assert proc.returncode == 130 and "Traceback" not in err
    match = re.fullmatch(rf"interrupted at step (\d+); last checkpoint at step {saved} in {re.escape(str(out))}; "
                         rf"continue with --resume", err.strip())
    assert match and int(match.group(1)) >= 3 and saved >= 2, err


@pytest.mark.parametrize("name", [*run.METHODS, "finetune", "evaluate"])
def test_more_processes_than_gpus_is_one_error_before_the_process_group(name, monkeypatch):
    module = importlib.import_module(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"--nproc_per_node=2, but this machine has 1 GPU\(s\)"):
        module.setup_distributed()
    assert not torch.distributed.is_initialized()


def test_leave_distributed_ends_a_gloo_process_at_once_with_its_output_flushed(tmp_path):
    # gloo's teardown aborted a rank now and then (SIGABRT): the process leaves with os._exit(code) instead,
    # after flushing what it printed; outside torchrun leave_distributed does nothing
    script = ("import datetime, sys, torch.distributed as dist, run\n"
              "run.cli.leave_distributed(5)\n"
              "dist.init_process_group('gloo', init_method=sys.argv[1], rank=0, world_size=1,"
              " timeout=datetime.timedelta(seconds=60))\n"
              "print('written', end='')\n"
              "run.cli.leave_distributed(7)\n"
              "print('never')\n")
    result = subprocess.run([PY, "-c", script, f"file://{tmp_path}/rendezvous"], cwd=HERE, capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout) == (7, "written"), result.stderr


def test_ctrl_c_during_a_checkpoint_finishes_it_and_names_it(tmp_path, small_corpus, monkeypatch):
    # A Ctrl-C that landed after state.pt was replaced but before the loop noted the step said "last
    # checkpoint at step 2" with step 4 on disk (1 in 10 runs of the test above, under load); now a
    # Ctrl-C during the save is held until the checkpoint is whole, and the line names it.
    import signal
    real = run.folders.finish_checkpoint_switch
    def switch_then_ctrl_c(out):
        if (Path(out) / ".encoder.new").is_dir():         # in save_checkpoint (train's start calls it too)
            os.kill(os.getpid(), signal.SIGINT)           # delivered here, between the commit and the return
        real(out)
    monkeypatch.setattr(run.folders, "finish_checkpoint_switch", switch_then_ctrl_c)
    out = tmp_path / "run"
    c = run.cli.parse_config(costa.Config, ["--corpus", str(small_corpus), *TINY_ARGS, "--steps", "6", "--save_every", "2",
                                        "--out_dir", str(out)], "", {}, costa.FLAG_RULES)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)   # as Python starts from a terminal
    try:
        with pytest.raises(run.cli.Interrupted) as stopped:
            costa.train(c)
    finally:
        signal.signal(signal.SIGINT, outer)
    assert str(stopped.value) == f"interrupted at step 2; last checkpoint at step 2 in {out}; continue with --resume"
    assert run.folders.load_training_state(out / "state.pt")["step"] == 2 and (out / "encoder" / "config.json").is_file()
    assert not (out / ".encoder.new").exists()


def test_catch_stop_signals_records_them_and_puts_the_old_handlers_back():
    import signal
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)   # as Python starts from a terminal
    term_before, chld_before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGCHLD)
    try:
        restore = run.cli.catch_stop_signals(defer_term=True)             # as the training loop installs them
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        with run.cli.hold_ctrl_c():                                        # held: recorded only
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        assert run.cli.STOP_SIGNALS["int"] == [signal.SIGINT] * 2
        with pytest.raises(KeyboardInterrupt):                         # and raised again after the hold
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)         # deferred to the end of the step
        assert run.cli.STOP_SIGNALS["term"] == [signal.SIGTERM] and signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
        run.cli.watch_children_again()
        assert signal.getsignal(signal.SIGCHLD) == chld_before
        restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is term_before
        restore = run.cli.catch_stop_signals()                             # outside the loop: SIGTERM stops at once
        with pytest.raises(run.cli.Terminated):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        restore()
    finally:
        signal.signal(signal.SIGINT, outer)   # a suite started with nohup ... & ignores SIGINT
        signal.signal(signal.SIGTERM, term_before)
        run.cli.watch_children_again()            # torch's SIGCHLD handler, which the deferred SIGTERM set aside


def test_bad_files_give_one_line_not_a_traceback(tmp_path):
    for grade, message in (("inf", "is not an integer"), ("1.7", "is not an integer"), ("x", "is not a number")):
        path = write(tmp_path / f"q-{grade}.tsv", f"query-id\tcorpus-id\tscore\nq1\td1\t{grade}\n")
        with pytest.raises(data.DataError, match=re.escape(f"{path}:2: relevance grade {grade!r} {message}")):
            data.read_qrels(path)
    assert data.read_qrels(write(tmp_path / "ok.tsv", "q1\td1\t2.0\nq1\td2\t-1\n")) == {"q1": {"d1": 2, "d2": -1}}
    init = Path(_tiny_init(tmp_path / "init"))
    for text, message in (("[1, 2]", "expected a JSON object, got list"),
                          ('{"hidden_size": "32"}', '"hidden_size" must be a positive integer, got \'32\''),
                          ('{"layer_norm_eps": "x"}', '"layer_norm_eps" must be a number, got \'x\'')):
        (init / "config.json").write_text(text)
        code, err = main_error([HERE / "costa.py", "--init", init, "--out_dir", tmp_path / "o"], tmp_path)
        assert (code, err) == (1, f"error: {init / 'config.json'}: {message}")


def test_a_sigterm_while_an_error_is_cleaned_up_ends_the_process_without_a_traceback(tmp_path):
    """torchrun stops the other ranks (SIGTERM) once one fails; a rank that is itself cleaning up after the same
    error (run_command_line's finally) must then end by the signal, not with a traceback of run.cli.Terminated (seen
    in a loaded .ci/run: the torchrun test below, flaky). Here the SIGTERM comes exactly then, every time."""
    script = tmp_path / "late_sigterm.py"
    script.write_text(textwrap.dedent(f"""
        import gc, os, signal, sys
        sys.path.insert(0, {str(HERE)!r})
        import run
        collect = gc.collect
        gc.collect = lambda *a: (os.kill(os.getpid(), signal.SIGTERM), collect(*a))[1]

        def bad_flag():
            raise ValueError("bad flag")
        run.cli.run_command_line(bad_flag)
    """))
    result = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr and result.returncode == -signal.SIGTERM, result.stderr


def test_torchrun_error_is_one_line_from_rank0_and_exit_code_1(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(HERE / "costa.py"), "--corpus", str(tmp_path / "missing.jsonl"),
                             "--out_dir", str(tmp_path / "o")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert lines == [f"error: {tmp_path / 'missing.jsonl'}: file not found"]
    # The workers print no traceback: one of theirs would start at the script's own frame (costa.py, run by
    # torchrun as a file). What is left is torchrun's (its ChildFailedError summary, and under a loaded CI
    # once a second of its own), whose frames are torch's (under HERE when the venv is, as in CI).
    output = result.stdout + result.stderr
    assert not [name for name in (*METHOD_FILES, "data.py", "run.py")
                if f'File "{HERE / name}"' in output], output


def test_silent_inputs_are_refused_or_named(tmp_path, capsys, monkeypatch):
    # A path that looks local never goes to the hub.
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run.hub, "_hub_folder", lambda name: pytest.fail(f"{name} was sent to the hub"))
    for name in ("runs/nonexistent_model", "./model", "/no/such/folder"):
        with pytest.raises(data.DataError, match=re.escape(f"{name}: no such model folder")):
            run.hub.resolve_model(name)
    # Empty queries are refused with file:line; empty documents are counted once.
    queries = write(tmp_path / "queries.jsonl", '{"_id": "q1", "text": "apples"}\n{"_id": "q2", "text": "  "}\n')
    with pytest.raises(data.DataError, match=re.escape(f"{queries}:2: empty query text")):
        data.read_queries(queries)
    corpus = write(tmp_path / "corpus.jsonl", '{"_id": "d1", "text": "x"}\n{"_id": "d2", "text": ""}\n'
                                              '{"_id": "d3", "text": " ", "title": ""}\n')
    capsys.readouterr()
    assert len(data.read_corpus(corpus)) == 3
    assert capsys.readouterr().out == (f"warning: {corpus}: 2 of 3 documents have no text (the first at line 2); "
                                       f"they stay in the corpus\n")
    # A corpus folder reads only .txt / .jsonl (.gz) and names what it skips.
    folder = tmp_path / "pre"
    write(folder / "a.txt", "first document\n\nsecond document\n")
    write(folder / "notes.csv", "id,text\n1,not a document\n")
    assert data.read_pretraining_texts(folder) == ["first document", "second document"]
    assert capsys.readouterr().out == (f"{folder}: skipping notes.csv (a corpus folder reads only .txt, .jsonl, "
                                       f".txt.gz, .jsonl.gz files and WikiExtractor's)\n")
    # A corpus error leaves no empty token cache folder behind.
    empty = write(tmp_path / "empty" / "blank.txt", "\n\n\n")
    with pytest.raises(data.DataError, match="empty corpus"):
        run.cache.token_windows(empty, data.VOCAB, 64, verbose=False)
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["blank.txt"]


def test_long_steps_print_progress_with_rate_and_eta(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run.files, "PROGRESS_EVERY_S", 0.0)
    texts = data.read_pretraining_texts(data.WIKI)[:20]
    corpus = write(tmp_path / "wiki.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts))
    run.cache.build_token_cache(corpus, data.VOCAB, tmp_path / "cache", workers=1, chunk_chars=20_000)
    index = evaluate.BM25(texts)
    index.search(["the first query", "another one"], 3)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    evaluate.encode(encoder, "cls", data.load_tokenizer(), texts, 32, 4, torch.device("cpu"))
    evaluate.search(np.ones((3, 32), np.float32), np.ones((20, 32), np.float32), 2, batch=1)
    printed = capsys.readouterr().out
    number, time_ = r"[\d,]+", r"\d+m\d\ds"
    for what, unit in (("tokenizing " + re.escape(str(corpus)) + ":", "chars"), ("BM25 indexing:", "documents"),
                       ("BM25 search:", "queries"), ("encoding:", "texts"), ("searching:", "queries")):
        assert re.search(rf"^{what} {number}/{number} {unit} \| {number} {unit}/s \| elapsed {time_} \| eta {time_}$",
                         printed, re.MULTILINE), (what, printed)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_benchmark_peak_rss_counts_the_steps_not_the_setup():
    from research import benchmark

    setup = np.ones(300 * 2**20, dtype=np.uint8)          # 300 MiB touched, as reading a corpus would
    before = benchmark.peak_rss_mib()
    del setup
    assert benchmark.reset_peak_rss()
    assert benchmark.peak_rss_mib() < before - 200        # the setup's peak is gone from the mark


def _results_script(path):
    """A script under results/ (a folder, not a package), imported by its path."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(Path(path).stem, HERE / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_st_triplets_are_finetune_batches():
    """results/st-ndcg/st_ndcg.py trains sentence-transformers on finetune.py's own batches: the texts it
    hands over tokenize back to the batch's queries and its (positive, negative) passages, in order."""
    st_ndcg = _results_script("results/st-ndcg/st_ndcg.py")

    queries = {f"q{i}": f"claim number {i} about cells" for i in range(7)}
    qrels = {f"q{i}": {f"d{i}": 1, f"d{i + 10}": 1} for i in range(7)}
    docs = {f"d{i}": i for i in range(30)}
    doc_texts = [f"passage {i} on topic {i % 4}" for i in range(30)]
    examples = [ex._replace(negatives=finetune.negatives_from_ranking(list(range(30)), ex.positives))
                for ex in finetune.make_examples(queries, qrels, docs)]
    c = finetune.Config(batch_size=3, n_negatives=1, steps=5, seed=3)
    batches = finetune.TrainBatches(c, examples, doc_texts, _tokenizer(), 0, 1)
    for step in range(5):                                    # 2 batches per epoch: crosses epochs
        b = batches[step]
        q, pos, neg = st_ndcg.st_triplets(batches, step)
        assert torch.equal(data.encode_texts(_tokenizer(), q, c.query_len)[0], b["q_ids"])
        interleaved = [t for pair in zip(pos, neg) for t in pair]
        assert torch.equal(data.encode_texts(_tokenizer(), interleaved, c.passage_len)[0], b["p_ids"])


def test_benchmark_st_ndcg_summary_pairs_the_seeds(tmp_path):
    from scipy.stats import ttest_rel

    from research import benchmark

    ours, st = [0.72, 0.73, 0.71], [0.70, 0.74, 0.69]
    for which, values in (("ours", ours), ("st", st)):
        for seed, v in enumerate(values):
            (tmp_path / f"{which}-seed{seed}.json").write_text(
                json.dumps({"which": which, "seed": seed, "metrics": {"NDCG@10": v}}))
    (tmp_path / "ours-seed5.json").write_text(json.dumps({"which": "ours", "seed": 5, "metrics": {"NDCG@10": 0.9}}))
    line = benchmark.st_ndcg_summary(tmp_path)              # seed 5 has no sentence-transformers run: left out
    p = ttest_rel(ours, st).pvalue
    assert line.startswith(f"{np.mean(ours):.4f} ± {np.std(ours, ddof=1):.4f} against "
                           f"{np.mean(st):.4f} ± {np.std(st, ddof=1):.4f}")
    assert "seeds 0,1,2" in line and f"p = {p:.2f}" in line and f"{np.mean(ours) - np.mean(st):+.4f}" in line
    assert benchmark.st_ndcg_summary(tmp_path / "none") == ""


def test_benchmark_levers_change_the_arithmetic_only():
    """results/speed/levers.py: the fused QKV projection and the recomputed attention compute the same
    function as the shipped encoder (outputs in eval mode; loss and gradients in train mode, dropout on,
    from the same seed), and the attention swap lasts for the step only."""
    levers = _results_script("results/speed/levers.py")

    c = evaluate.EncoderConfig(vocab_size=120, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=16)
    ids, mask = torch.randint(5, 120, (3, 12)), torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0

    def run(lever, train):
        torch.manual_seed(0)
        encoder = evaluate.Encoder(c)
        encoder.mlm_head = None
        context = levers.apply_lever(lever, encoder)
        encoder.train(train)
        torch.manual_seed(1)
        with context():
            out = encoder(ids, mask)
            out.square().mean().backward()
        grads = {n: p.grad for n, p in encoder.named_parameters() if p.grad is not None}
        if lever == "fused qkv":                       # the fused weight's rows are q's, k's, v's
            for i, block in enumerate(encoder.blocks):
                g = grads.pop(f"blocks.{i}.attn.qkv.weight").chunk(3)
                gb = grads.pop(f"blocks.{i}.attn.qkv.bias").chunk(3)
                for j, name in enumerate(("query", "key", "value")):
                    grads[f"blocks.{i}.attn.{name}.weight"], grads[f"blocks.{i}.attn.{name}.bias"] = g[j], gb[j]
        return out, grads

    for train in (False, True):
        ref_out, ref_grads = run("as shipped", train)
        for lever in ("fused qkv", "attention recomputed in the backward"):
            out, grads = run(lever, train)
            assert torch.allclose(out, ref_out, atol=1e-5), (lever, train)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                assert torch.allclose(g, ref_grads[name], atol=1e-5), (lever, train, name)
    shipped = evaluate.attention
    context = levers.apply_lever("no attention dropout, SDPA", evaluate.Encoder(c))
    with context():
        assert evaluate.attention is not shipped
    assert evaluate.attention is shipped
    with pytest.raises(ValueError, match="unknown lever"):
        levers.apply_lever("faster", evaluate.Encoder(c))


# ----------------------------------------------------------------------------------------------
# Faults: one line each, nothing already written lost
# ----------------------------------------------------------------------------------------------
def _held_by_another_process(folder):
    """A process that takes the run folder's lock and keeps it until killed."""
    script = ("import sys, time, run; run.folders.lock_run_folder(sys.argv[1], create=True); print('locked', flush=True); "
              "time.sleep(600)")
    holder = subprocess.Popen([PY, "-c", script, str(folder)], cwd=HERE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_run_folder_in_use_refuses_a_second_run_and_kill_9_frees_it(tmp_path, small_corpus):
    out = tmp_path / "run"
    holder = _held_by_another_process(out)
    try:
        for script, flags in (("costa.py", ["--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2", "--out_dir",
                                            str(out), "--overwrite"]),
                              ("finetune.py", ["--init", "minilm", "--out_dir", str(out), "--overwrite"]),
                              ("-m research.study", ["--results_dir", str(out), "--report_only"])):
            result = subprocess.run([PY, *script.split(), *flags], cwd=HERE, capture_output=True, text=True, timeout=300)
            assert result.returncode == 1, (script, result.stderr)
            assert result.stderr.strip() == f"error: {out} is in use by another run; wait for it to end, or give another --out_dir", script
            assert not list(out.iterdir())                                       # nothing touched
    finally:
        holder.kill()                                                            # kill -9: the kernel drops the lock
        holder.wait()
    main_run(["costa.py", "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2", "--out_dir", str(out)], HERE)
    assert run.folders.load_training_state(out / "state.pt")["step"] == 2


def test_an_os_error_is_one_line_naming_the_path(tmp_path, small_corpus, monkeypatch, capsys):
    import errno
    a_file = write(tmp_path / "a_file", "not a folder\n")
    beir, init = tiny_beir(tmp_path / "beir"), _tiny_init(tmp_path / "init")
    for script, extra in (("costa.py", ["--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2"]),
                          ("finetune.py", ["--init", str(init), "--dataset", str(beir), "--train_split", "test"]),
                          ("evaluate.py", ["--model", str(init), "--dataset", str(beir)])):
        result = subprocess.run([PY, script, *extra, "--out_dir", str(a_file / "run")], cwd=HERE,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 1, (script, result.stderr)
        line = result.stderr.strip()
        assert "\n" not in line and line.startswith("error: ") and str(a_file) in line, (script, line)
        assert "is a file, not a folder" in line or "already exists as a file" in line, (script, line)
    # Permission denied and a read-only file system (root ignores chmod, so the error is injected).
    c = run.cli.parse_config(costa.Config, ["--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2",
                                        "--out_dir", str(tmp_path / "ro" / "run")], "", {}, costa.FLAG_RULES)
    for code, words in ((errno.EACCES, "permission denied"), (errno.EROFS, "read-only file system")):
        def refuse(self, *args, code=code, real=Path.mkdir, **kwargs):   # in ro/ only (not the token cache)
            if tmp_path / "ro" not in (self, *self.parents):
                return real(self, *args, **kwargs)
            raise OSError(code, os.strerror(code), str(self))
        monkeypatch.setattr(Path, "mkdir", refuse)
        with pytest.raises(SystemExit) as stopped:
            run.cli.run_command_line(lambda: costa.train(c))
        monkeypatch.undo()
        assert stopped.value.code == f"error: {tmp_path / 'ro' / 'run'}: {words}; " + {
            errno.EACCES: "choose a folder you can write to (--out_dir) or fix its permissions",
            errno.EROFS: "choose a folder on a writable disk"}[code]


def test_an_unwritable_out_dir_stops_the_run_before_the_token_cache_is_built(tmp_path, small_cache_corpus,
                                                                             monkeypatch):
    """A file on the way or a read-only disk is found by the first check, not after the token cache
    (hours at paper scale); the line names the part of the path that is the problem."""
    a_file = write(tmp_path / "a_file", "not a folder\n")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(
        f_flag=os.ST_RDONLY if Path(path) == read_only else real_statvfs(path).f_flag))
    for out_dir, problem, words in ((a_file / "run", a_file, "a path on the way is a file, not a folder"),
                                    (read_only / "new" / "run", read_only, "read-only file system")):
        c = run.cli.parse_config(costa.Config, ["--corpus", str(small_cache_corpus), *TINY_ARGS, "--steps", "2",
                                            "--out_dir", str(out_dir)], "", {}, costa.FLAG_RULES)
        with pytest.raises(SystemExit) as stopped:
            run.cli.run_command_line(lambda c=c: costa.train(c))
        assert str(stopped.value.code).startswith(f"error: {problem}: {words}; "), stopped.value.code
        assert not list(small_cache_corpus.parent.glob("*.tokens-*")), "the token cache was built first"
    assert not (read_only / "new").exists()


def test_sigterm_saves_a_checkpoint_and_stops_with_one_line(tmp_path, small_corpus):
    import signal
    out = tmp_path / "run"
    cmd = [PY, "costa.py", "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2000", "--save_every", "4",
           "--out_dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line.startswith("step      3/"):
            break
    proc.send_signal(signal.SIGTERM)                     # what a scheduler sends before it kills the job
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    last = re.fullmatch(rf"terminated \(SIGTERM\) at step (\d+); last checkpoint at step (\d+) in {re.escape(str(out))}; "
                        r"continue with --resume", stderr.strip().splitlines()[-1])
    assert last, stderr
    stopped, saved = int(last[1]), int(last[2])
    # the step in progress finished; a checkpoint more than --save_every / 2 = 2 steps old was renewed first
    assert 3 <= stopped and 0 <= stopped - saved <= 2 and saved >= 3
    assert run.folders.load_training_state(out / "state.pt")["step"] == saved
    code, printed, err = run_in_process(cmd[1:-2] + ["--steps", str(stopped + 2), "--out_dir", str(out), "--resume"], HERE)
    assert code == 0, err                               # and it continues from there
    assert f"resume: {out / 'state.pt'} at step {saved}" in printed


def test_finetune_sigterm_saves_a_checkpoint_and_stops_with_one_line(tmp_path):
    """finetune.py's stage loop stops as pre-training does: the step in progress finishes, a checkpoint
    older than --save_every / 2 steps is renewed first, one line names both, and --resume continues."""
    import signal
    beir, init, out = tiny_beir(tmp_path / "beir"), _tiny_init(tmp_path / "init"), tmp_path / "ft"
    cmd = [PY, "finetune.py", "--init", init, "--dataset", str(beir), "--train_split", "test", "--eval_split", "",
           "--batch_size", "1", "--query_len", "16", "--passage_len", "16", "--bf16", "false", "--log_every", "1",
           "--save_every", "4", "--out_dir", str(out)]
    proc = subprocess.Popen(cmd + ["--steps", "2000"], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line.startswith("step      3/"):
            break
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    stage = out / "stage1"
    last = re.fullmatch(rf"terminated \(SIGTERM\) at step (\d+); last checkpoint at step (\d+) in {re.escape(str(stage))}; "
                        r"continue with --resume", stderr.strip().splitlines()[-1])
    assert last, stderr
    stopped, saved = int(last[1]), int(last[2])
    assert 3 <= stopped and 0 <= stopped - saved <= 2 and saved >= 3
    assert run.folders.load_training_state(stage / "state.pt")["step"] == saved
    code, printed, err = run_in_process(cmd[1:] + ["--steps", str(stopped + 2), "--resume"], HERE)
    assert code == 0, err
    assert f"resume: {stage / 'state.pt'} at step {saved}" in printed


def test_non_finite_flags_are_refused_when_parsed():
    import finetune
    for module, flag in ((costa, "--lr"), (costa, "--tau"), (finetune, "--lr"), (evaluate, "--k1")):
        for value in ("inf", "nan", "-inf"):
            with pytest.raises(SystemExit) as stopped:
                run.cli.parse_config(module.Config, [flag, value], "", {}, getattr(module, "FLAG_RULES", {}))
            assert stopped.value.code == f"error: {flag} must be a finite number, got {float(value)!r}"


def test_a_non_finite_loss_says_whether_a_checkpoint_is_kept(tmp_path):
    c = costa.Config(out_dir=str(tmp_path))
    with pytest.raises(data.DataError, match=r"stopped without saving; no checkpoint was written$"):
        run.folders.stop_if_not_finite(torch.tensor(float("nan")), 2, c, last_saved=0)
    with pytest.raises(data.DataError, match=rf"{re.escape(str(tmp_path))} keeps its last good checkpoint, step 100$"):
        run.folders.stop_if_not_finite(torch.tensor(float("inf")), 120, c, last_saved=100)


def test_keep_last_keeps_older_checkpoints_as_hard_links_and_prunes_them(tmp_path):
    """--keep_last 3: before each save the current checkpoint stays in checkpoints/step-N (no copy), the 2 newest
    kept. Seen failing on the old code (no keep_previous_checkpoint) and with the prune's count off by one."""
    for step in (10, 20, 30, 40):
        if step > 10:
            run.folders.keep_previous_checkpoint(tmp_path, step - 10, keep_last=3)
        (tmp_path / "state.pt").unlink(missing_ok=True)               # as save_checkpoint's os.replace does
        (tmp_path / "encoder").mkdir(exist_ok=True)
        (tmp_path / "encoder" / "model.safetensors").unlink(missing_ok=True)
        (tmp_path / "state.pt").write_text(f"state {step}")
        (tmp_path / "encoder" / "model.safetensors").write_text(f"weights {step}")
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-20", "step-30"]
    assert (tmp_path / "checkpoints" / "step-30" / "state.pt").read_text() == "state 30"
    assert (tmp_path / "checkpoints" / "step-20" / "encoder" / "model.safetensors").read_text() == "weights 20"
    assert (tmp_path / "state.pt").read_text() == "state 40"


def test_on_a_gpu_the_finite_check_waits_for_a_log_step_and_names_the_first_bad_step(tmp_path):
    """On CUDA the loop syncs with the host only on log and checkpoint steps: a NaN at step 2 is found at step 5
    (log_every 5), named as step 2, before any checkpoint. Seen failing on the old code (it checked, and synced,
    at every step: the NaN raised at step 2)."""
    c = costa.Config(out_dir=str(tmp_path), log_every=5, save_every=100, steps=50)
    training = types.SimpleNamespace(c=c, device=torch.device("cuda"), saved=0, unchecked=[], step=0)
    training.waits_on_device = types.MethodType(run.TrainingRun.waits_on_device, training)
    check = types.MethodType(run.TrainingRun.stop_if_not_finite, training)
    for step, norm in ((1, 1.0), (2, float("nan")), (3, 2.0), (4, float("inf"))):
        check(torch.tensor(norm), step)                                # no sync, no stop yet
    with pytest.raises(data.DataError, match=r"^step 2: the loss is not finite \(gradient norm nan\)"):
        check(torch.tensor(1.0), 5)
    assert [training.waits_on_device(s) for s in (99, 100, 50)] == [False, True, True]


def test_paper_presets_build_batches_ahead_and_checkpoint_by_the_clock():
    """Seen failing on the old code (--workers 0, a checkpoint every 100 steps, nothing kept)."""
    for module in (costa, importlib.import_module("cpdae"), importlib.import_module("seed")):
        c = run.cli.parse_config(module.Config, ["--preset", "paper"], "", module.PAPER_PRESET, module.FLAG_RULES)
        assert c.workers >= 1 and c.save_minutes > 0 and c.save_every >= 10_000 and c.keep_last > 1, module
        assert c.compile, module                                       # it pays on a GPU at the paper's size
    c = run.cli.parse_config(finetune.Config, ["--preset", "paper"], "", finetune.PAPER_PRESET, finetune.FLAG_RULES)
    assert c.workers >= 1 and c.save_every >= 1000


# Token cache: it proves itself before use; killed builds' temporaries; dropped and empty documents
# ----------------------------------------------------------------------------------------------
def _windows_of(corpus, **kwargs):
    """The corpus' 64-token windows from its token cache, as lists (and the cache folder)."""
    windows = run.cache.token_windows(corpus, data.VOCAB, 64, verbose=False, **kwargs)
    return [windows[i] for i in range(len(windows))], windows.folder


def test_whitespace_only_documents_are_left_out_with_one_line(tmp_path, capsys):
    corpus = write(tmp_path / "c.jsonl", '{"text": "the first document"}\n{"text": "  \\n\\t "}\n\n'
                                         '{"title": "", "text": "the second one"}\n{"title": " ", "text": " "}\n')
    said = f"warning: {corpus}: 2 of 4 documents are only whitespace (the first at line 2); they are left out\n"
    windows, _ = _windows_of(corpus)
    assert len(windows) == 2 and capsys.readouterr().out == said
    assert data.read_pretraining_texts(corpus) == ["the first document", "the second one"]
    assert capsys.readouterr().out == ""                     # once a process (the cache build said it)


def test_finetune_warns_of_empty_documents_once(tmp_path, capsys):
    beir = _scifact_subset(tmp_path / "beir", n_train=8, n_test=4, n_other=20)
    with gzip.open(beir / "corpus.jsonl.gz", "rt") as f:
        lines = f.read().splitlines()
    doc = json.loads(lines[3])
    lines[3] = json.dumps({**doc, "title": "", "text": "  "})
    write(beir / "corpus.jsonl.gz", "\n".join(lines) + "\n", True)
    finetune.main(["--init", _tiny_init(tmp_path / "tiny"), "--dataset", str(beir), "--steps", "1", "--batch_size", "4",
                   "--passage_len", "32", "--out_dir", str(tmp_path / "ft")])
    warnings = [line for line in capsys.readouterr().out.splitlines() if "have no text" in line]
    assert warnings == [(f"warning: {beir / 'corpus.jsonl.gz'}: 1 of {len(lines)} documents have no text "
                        f"(the first at line 4); they stay in the corpus")]


def _flip_a_byte(path):
    """Change one byte in the middle of a file, keeping its size (and its time: a copy back in place)."""
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    stat = path.stat()
    path.write_bytes(bytes(blob))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_damaged_token_cache_is_rebuilt_saying_which_file_and_what_differed(small_cache_corpus, capsys):
    expected, folder = _windows_of(small_cache_corpus)
    sizes = {name: (folder / name).stat().st_size for name in ("tokens.bin", "word_starts.bin", "doc_offsets.npy")}
    damages = [("tokens.bin", lambda p: os.truncate(p, sizes["tokens.bin"] - 2000),        # even: used to crash in COSTA
                rf"tokens\.bin has {sizes['tokens.bin'] - 2000:,} bytes, its manifest says {sizes['tokens.bin']:,}"),
               ("tokens.bin", lambda p: os.truncate(p, sizes["tokens.bin"] - 1),           # odd: numpy's line, no file
                rf"tokens\.bin has {sizes['tokens.bin'] - 1:,} bytes, its manifest says {sizes['tokens.bin']:,}"),
               ("word_starts.bin", _flip_a_byte, r"word_starts\.bin's CRC-32 is [0-9a-f]{8}, its manifest says [0-9a-f]{8}"),
               ("doc_offsets.npy", lambda p: p.unlink(), r"doc_offsets\.npy is missing"),
               ("windows-L64.npy", _flip_a_byte, r"windows-L64\.npy's CRC-32 is [0-9a-f]{8}, windows-L64\.json says")]
    capsys.readouterr()
    for name, damage, said in damages:
        damage(folder / name)
        again, _ = _windows_of(small_cache_corpus)
        assert again == expected, name
        out = capsys.readouterr().out
        assert re.fullmatch(rf"token cache {re.escape(str(folder))}: {said}.*; (rebuilding it|cutting the windows again)\n",
                            out), (name, out)
        assert _windows_of(small_cache_corpus)[0] == expected and capsys.readouterr().out == ""   # proven: no word


def test_a_large_token_cache_reads_its_checksums_only_for_files_whose_time_changed(small_cache_corpus, capsys,
                                                                                   monkeypatch):
    expected, folder = _windows_of(small_cache_corpus)
    monkeypatch.setattr(run.cache, "CRC_EVERY_USE_BYTES", 0, raising=False)        # every cache is large now
    read, real = [], run.cache.file_record if hasattr(run.cache, "file_record") else None
    monkeypatch.setattr(run.cache, "file_record", lambda path, *a: read.append(Path(path).name) or real(path, *a),
                        raising=False)
    capsys.readouterr()
    assert _windows_of(small_cache_corpus)[0] == expected and read == []    # sizes and times: no file read
    os.utime(folder / "tokens.bin")                                          # (as a copy without -p would)
    assert _windows_of(small_cache_corpus)[0] == expected and read == ["tokens.bin"] and capsys.readouterr().out == ""
    with open(folder / "word_starts.bin", "r+b") as f:                       # written in place: a new time
        f.seek(100)
        f.write(bytes([1 - f.read(1)[0]]))
    assert _windows_of(small_cache_corpus)[0] == expected
    assert re.fullmatch(rf"token cache {re.escape(str(folder))}: word_starts\.bin's CRC-32 is [0-9a-f]{{8}}, its "
                        rf"manifest says [0-9a-f]{{8}} .*; rebuilding it\n", capsys.readouterr().out)


def test_other_ranks_never_map_a_damaged_token_cache(small_cache_corpus, monkeypatch):
    expected, folder = _windows_of(small_cache_corpus)
    _flip_a_byte(folder / "tokens.bin")
    monkeypatch.setattr(run.cache, "CACHE_WAIT_S", 0)
    with pytest.raises(data.DataError, match="rank 1: waited 0 s for rank 0 to build the token cache"):
        run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, rank=1, verbose=False)
    assert _windows_of(small_cache_corpus)[0] == expected                      # rank 0 rebuilds it


def test_a_token_cache_from_the_older_manifest_is_rebuilt_once_saying_so(small_cache_corpus, capsys):
    expected, folder = _windows_of(small_cache_corpus)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("files", None)
    manifest["signature"]["version"] = 1                                     # as the older data.py wrote it
    (folder / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert _windows_of(small_cache_corpus)[0] == expected
    out = capsys.readouterr().out
    assert re.fullmatch(rf"token cache {re.escape(str(folder))}: written by an older data\.py .*; rebuilding it\n", out), out
    assert _windows_of(small_cache_corpus)[0] == expected and capsys.readouterr().out == ""


def test_reading_a_broken_token_cache_names_the_folder_and_how_to_rebuild(small_cache_corpus):
    _, folder = _windows_of(small_cache_corpus)
    special = data.special_ids(data.load_tokenizer())
    tokens = folder / "tokens.bin"
    for size in (tokens.stat().st_size - 1, tokens.stat().st_size - 2000, 0):  # numpy's error, an IndexError later, none
        os.truncate(tokens, size)
        with pytest.raises(data.DataError) as error:
            run.cache.TokenWindows(folder, 64, special)                            # (as a data-loader worker maps it)
        assert str(error.value).startswith(f"{folder}: ") and "tokens.bin" in str(error.value), str(error.value)
        assert f"delete the folder to rebuild it (rm -r {folder})" in str(error.value)
    (folder / "windows-L64.json").unlink()
    with pytest.raises(data.DataError, match=re.escape(f"{folder}: ") + ".*windows-L64.json.*rm -r"):
        run.cache.TokenWindows(folder, 64, special)


def test_resume_on_another_process_count_is_refused_naming_it(tmp_path, small_corpus):
    """Each rank's masks and dropout are drawn per rank: a run resumed on another number of processes
    would train on other batches. It is refused in one line that names the count and what to run."""
    common = [str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "4"]
    run_script(common + ["--out_dir", str(tmp_path / "two"), "--halt_at", "2"], tmp_path, torchrun=True)
    want = (f"error: {tmp_path / 'two' / 'state.pt'}: written by 2 processes, this run has 1 (each rank draws its "
            f"own masks and dropout); resume it with torchrun --nproc_per_node=2, or start again with --overwrite")
    assert main_error([*common, "--out_dir", tmp_path / "two", "--resume"], tmp_path) == (1, want)
    # --global_batch keeps the batch the same size on 1 process; the data stream would still differ.
    run_script(common + ["--out_dir", str(tmp_path / "g"), "--halt_at", "2", "--global_batch", "8",
                         "--batch_size", "4"], tmp_path, torchrun=True)
    code, err = main_error([*common, "--out_dir", tmp_path / "g", "--resume", "--global_batch", "8",
                           "--batch_size", "8"], tmp_path)
    assert code == 1 and "written by 2 processes, this run has 1" in err and "--batch_size" not in err


def test_resume_on_a_changed_corpus_is_refused_unless_meant(tmp_path, small_corpus):
    """The run records its corpus's tokens (the token cache's CRC-32 and window count): a corpus edited
    between a run and its --resume is refused in one line naming the file; --new_corpus continues on it
    and says from which step the data differ. A corpus only touched (same text) resumes as before."""
    corpus = tmp_path / "wiki.jsonl"
    shutil.copyfile(small_corpus, corpus)
    common = [HERE / "costa.py", "--corpus", corpus, *TINY_ARGS, "--steps", "4", "--out_dir", tmp_path / "o"]
    main_run([str(a) for a in [*common, "--halt_at", "2"]], tmp_path)
    os.utime(corpus, (time.time() + 5,) * 2)                                  # touched: the same tokens
    assert "at step 2" in main_run([str(a) for a in [*common, "--halt_at", "3", "--resume"]], tmp_path)
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "A new document about retrieval joins the corpus after step 3."}) + "\n")
    code, err = main_error([*common, "--resume"], tmp_path)
    assert code == 1 and err.startswith(f"error: {corpus}: the corpus changed since the run's checkpoint of step 3 ("), err
    assert err.endswith("resume on the corpus the run started with, or pass --new_corpus to continue on this one")
    out = main_run([str(a) for a in [*common, "--resume", "--new_corpus"]], tmp_path)
    assert "resume: --new_corpus: the corpus changed since step 3; the data differ from step 4" in out
    assert [r["step"] for r in read_log(tmp_path / "o")] == [1, 2, 3, 4]


def test_a_run_folder_says_which_script_wrote_it(tmp_path, small_corpus):
    """finetune.py --overwrite into a pre-training run's folder, or a method's --resume into another
    script's run, is refused in one line before any work: each script's config.json names it."""
    main_run([str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "1",
                "--out_dir", str(tmp_path / "p")], tmp_path)
    assert json.loads((tmp_path / "p" / "config.json").read_text())["script"] == "costa.py"
    code, err = main_error([HERE / "finetune.py", "--init", "", *FT_TINY_ARGS, "--dataset", tiny_beir(tmp_path / "beir"),
                           "--out_dir", tmp_path / "p", "--overwrite"], tmp_path)
    assert (code, err) == (1, (f"error: {tmp_path / 'p'} holds a run of costa.py, not of finetune.py; give "
                              f"another --out_dir (or delete the folder to reuse its name)"))
    assert (tmp_path / "p" / "state.pt").is_file()                              # untouched
    code, err = main_error([HERE / "cpdae.py", "--corpus", small_corpus, *TINY_ARGS, "--steps", "1",
                           "--out_dir", tmp_path / "p", "--resume"], tmp_path)
    assert (code, err) == (1, (f"error: {tmp_path / 'p'} holds a run of costa.py, not of cpdae.py; give "
                              f"another --out_dir (or delete the folder to reuse its name)"))


def test_a_full_disk_while_building_the_token_cache_is_one_line(tmp_path, small_corpus, monkeypatch):
    """ENOSPC while the cache is written (numpy and file writes raise OSError): one line naming the folder,
    about how much space the cache needs and the flag that moves it; no half-built cache is left."""
    import errno
    folder = tmp_path / "cache" / "c"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / ".doc_offsets.npy.1@h.tmp"))
    monkeypatch.setattr(run.files, "atomic_save_npy", full)
    with pytest.raises(data.DataError) as e:
        run.cache.build_token_cache(small_corpus, data.VOCAB, folder, workers=1, verbose=False)
    need = run.cache.cache_bytes_needed(small_corpus, data.VOCAB)
    free = run.files.format_bytes(shutil.disk_usage(tmp_path).free)
    assert str(e.value) == (f"{folder}: the disk is full (the token cache needs about {run.files.format_bytes(need)}, "
                            f"{free} free); free some space, or give --cache_dir on another disk")
    assert not folder.exists()


def test_ctrl_c_to_the_process_group_during_the_token_cache_build_prints_one_line(tmp_path, small_corpus):
    """Ctrl-C in a terminal reaches every process of the group: the pool's workers too. They ignore it
    (the parent stops them), so the run prints its one line and no worker's traceback."""
    import signal
    started = tmp_path / "started"
    code = ("import pathlib, runpy, sys, time, data, run\n"                # a worker that is surely mid-chunk
            "def slow(texts):\n"
            f"    pathlib.Path({str(started)!r}).touch()\n"
            "    time.sleep(600)\n"
            "run.cache._tokenize_chunk = slow\n"
            "sys.argv = ['costa.py', *sys.argv[1:]]\n"
            "runpy.run_path('costa.py', run_name='__main__')\n")
    proc = subprocess.Popen([PY, "-c", code, "--corpus", str(small_corpus), "--cache_dir", str(tmp_path / "cache"),
                             *TINY_ARGS, "--prep_workers", "1", "--out_dir", str(tmp_path / "o")], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        deadline = time.time() + 120
        while not started.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert started.exists() and proc.returncode == 130
    assert err.strip() == "interrupted before the first step; nothing was trained", err
    assert not list((tmp_path / "cache").glob("*"))                   # the half-built cache is gone


# --- the token cache's pool: its workers always end, whatever handlers the parent installed ---
def _signal_masks(pid):
    """{'SigBlk': int, 'SigIgn': int, 'SigCgt': int} of a process, from /proc (bit n - 1 is signal n)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: int(value, 16) for key, value in (line.split(":\t") for line in lines)
            if key in ("SigBlk", "SigIgn", "SigCgt")}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads signal masks from Linux's /proc")
def test_token_cache_workers_die_on_sigterm_and_ignore_ctrl_c_whatever_the_parent_installed():
    """Every script installs run.cli.catch_stop_signals before it builds a cache, and a forked worker inherits
    Python handlers: a SIGTERM that came while the worker started was lost in them, and pool.terminate()
    then waited without end (command 1 hung so). A worker runs neither handler: SIGTERM is at its default,
    SIGINT ignored, both blocked from the fork until they are."""
    import signal
    term, ctrl_c = 1 << (signal.SIGTERM - 1), 1 << (signal.SIGINT - 1)
    restore = run.cli.catch_stop_signals()
    try:
        pool = run.cache._pool(data.VOCAB, 2)
        try:
            pool.map(len, ["a", "bb"] * 8)
            deadline = time.time() + 60
            for worker in pool._pool:
                while _signal_masks(worker.pid)["SigBlk"] & term and time.time() < deadline:
                    time.sleep(0.01)                  # still starting: blocked, as it should be until it is set
                masks = _signal_masks(worker.pid)
                assert not masks["SigBlk"] & (term | ctrl_c), masks
                assert not masks["SigCgt"] & term and masks["SigIgn"] & ctrl_c, masks
        finally:
            pool.terminate()
    finally:
        restore()


POOL_CYCLES = """
import sys, tempfile, torch, data, run
run.cli.catch_stop_signals()                                # what every script installs first
torch.ones(8, 8) @ torch.ones(8, 8)                     # torch's threads started, as in a run
for _ in range(150):
    run.cache._pool(data.VOCAB, 2).terminate()               # workers still starting when SIGTERM comes
with tempfile.TemporaryDirectory() as tmp:
    for i in range(10):
        run.cache.build_token_cache(sys.argv[1], data.VOCAB, f"{tmp}/{i}", workers=2, verbose=False)
"""


def test_token_cache_pools_end_every_time_with_the_stop_handlers_installed(small_corpus):
    """The hang itself, under a bound: 150 pools created and terminated, then 10 builds. Before the workers
    reset their signals, 3 of 3 such loops of pools hung within 180 cycles (SIGTERM lost, terminate() joined
    a live worker for ever)."""
    import signal
    proc = subprocess.Popen([PY, "-c", POOL_CYCLES, str(small_corpus)], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("a token-cache pool did not end within 240 s: a worker outlived pool.terminate()")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)                # the script and a worker it could not end
    assert proc.returncode == 0, stderr


def _sleep_for_ever(texts):
    time.sleep(600)


def test_a_stuck_tokenizing_worker_is_named_and_the_build_stops_keeping_nothing(tmp_path, small_corpus,
                                                                                 monkeypatch):
    monkeypatch.setattr(run.cache, "_tokenize_chunk_sized", _sleep_for_ever)    # (the forked workers find it by name)
    monkeypatch.setattr(run.cache, "WORKER_SILENCE_S", 1)
    t0 = time.time()
    with pytest.raises(data.DataError) as stopped:
        run.cache.build_token_cache(small_corpus, data.VOCAB, tmp_path / "cache", workers=2, verbose=False)
    line = str(stopped.value)
    assert re.fullmatch(rf"token cache {re.escape(str(tmp_path / 'cache'))}: the tokenizing workers \(pids \d+, \d+\) "
                        r"gave nothing back for 1 s; they were stopped and no half-built cache is kept\. Run the "
                        r"command again \(pre-training: --prep_workers 1 tokenizes in one worker\)", line), line
    assert time.time() - t0 < 60 and not (tmp_path / "cache").exists()


def test_a_word_too_long_for_wordpiece_is_counted_in_the_cache_line(tmp_path, capsys):
    """A 200,000-character word is one [UNK] token: the build says how many characters went that way."""
    corpus = write(tmp_path / "c.jsonl", json.dumps({"text": "a short first document about proteins"}) + "\n"
                   + json.dumps({"text": "x" * 200_000 + " and " + "y" * 150}) + "\n")
    run.cache.build_token_cache(corpus, data.VOCAB, tmp_path / "cache", workers=1)
    assert ("token cache: 200,150 characters were in words over 100 characters long, each word now one [UNK] "
            "token (BERT's WordPiece reads no longer word)") in capsys.readouterr().out


def test_a_process_group_sigterm_with_data_loader_workers_saves_and_stops_with_one_line(tmp_path, small_corpus):
    """Slurm and systemd send SIGTERM to the whole process group: the data-loader workers leave stopping to
    the run (no 'DataLoader worker killed by signal'), which ends its step, checkpoints and says so."""
    import signal
    out = tmp_path / "run"
    proc = subprocess.Popen([PY, "costa.py", "--corpus", str(small_corpus), *TINY_ARGS, "--workers", "2", "--steps",
                             "2000", "--save_every", "4", "--out_dir", str(out)], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("step      3/"):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr
    last = re.fullmatch(rf"terminated \(SIGTERM\) at step (\d+); last checkpoint at step (\d+) in {re.escape(str(out))}; "
                        r"continue with --resume", stderr.strip().splitlines()[-1])
    assert last and "DataLoader" not in stderr, stderr
    assert run.folders.load_training_state(out / "state.pt")["step"] == int(last[2])


def test_a_test_that_hangs_fails_with_its_traceback_and_the_suite_goes_on(tmp_path):
    """conftest.py bounds every test (TEST_TIMEOUT_S): a hang is a red test that says where it waited."""
    write(tmp_path / "test_hang.py", "import time\n\ndef test_hangs():\n    time.sleep(600)\n\n"
                                     "def test_next():\n    pass\n")
    result = subprocess.run([PY, "-m", "pytest", "-q", "-p", "conftest", "--rootdir", str(tmp_path),
                             str(tmp_path / "test_hang.py")], cwd=HERE, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TEST_TIMEOUT_S": "2", "PYTHONPATH": str(HERE)})
    assert result.returncode == 1 and "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert "test_hang.py::test_hangs: the test ran over 2 s (TEST_TIMEOUT_S, conftest.py)" in result.stdout
    assert "time.sleep(600)" in result.stdout                   # the line it waited on


@pytest.mark.parametrize("stop, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_stop_during_the_token_cache_build_inside_finetune_is_one_line_and_keeps_no_cache(tmp_path, stop, code):
    """finetune.py --pretrain builds the cache in its own process, its stop handlers installed: SIGTERM (to the
    whole group, as Slurm sends it) or Ctrl-C mid-build ends it with one line, and no half-built cache stays.
    Of the 2 workers one waits for a task, holding the task queue's lock: the group's SIGTERM kills it so, and
    Pool.terminate() then waited for that lock for ever."""
    import signal
    beir, started = _scifact_subset(tmp_path / "beir", n_train=8, n_test=4, n_other=20), tmp_path / "started"
    code_text = ("import pathlib, runpy, sys, time, data, run\n"                 # a worker that is surely mid-chunk
                 "def slow(texts):\n"
                 f"    pathlib.Path({str(started)!r}).touch()\n"
                 "    time.sleep(600)\n"
                 "run.cache._tokenize_chunk = slow\n"
                 "sys.argv = ['finetune.py', *sys.argv[1:]]\n"
                 "runpy.run_path('finetune.py', run_name='__main__')\n")
    flags = ["--pretrain", "costa", "--pretrain_steps", "1", "--init", _tiny_init(tmp_path / "tiny"), "--baseline",
             "false", "--dataset", str(beir), "--steps", "1", "--batch_size", "4", "--passage_len", "64",
             "--pretrain_args", f"--batch_size 4 --max_len 64 --prep_workers 2 --cache_dir {tmp_path / 'cache'}",
             "--out_dir", str(tmp_path / "run")]
    proc = subprocess.Popen([PY, "-c", code_text, *flags], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    try:
        deadline = time.time() + 240
        while not started.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, getattr(signal, stop))
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert started.exists() and proc.returncode == code, err
    what = "terminated (SIGTERM)" if stop == "SIGTERM" else "interrupted"
    assert err.strip() == f"{what}; continue with --resume (each stage from its last checkpoint)", err
    assert not list((tmp_path / "cache").glob("*"))                   # the half-built cache is gone


def test_the_next_build_removes_the_temporaries_of_a_killed_build(tmp_path, wiki_texts):
    import signal
    corpus = write(tmp_path / "wiki.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in wiki_texts))
    folder = run.cache.token_cache_folder(corpus, data.VOCAB)
    # A build that hangs after its first documents (so it is surely mid-write), then is killed with -9.
    code = ("import sys, time, data, run.cache\n"
            "real = data.iter_pretraining_texts\n"
            "def texts(*args):\n"
            "    yield from real(*args)\n"
            "    time.sleep(600)\n"
            "data.iter_pretraining_texts = texts\n"
            "run.cache.build_token_cache(sys.argv[1], data.VOCAB, sys.argv[2], workers=1, chunk_chars=2000)\n")
    build = subprocess.Popen([PY, "-c", code, str(corpus), str(folder)], cwd=HERE, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not list(folder.glob(".tokens.bin.*.tmp")) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(build.pid, signal.SIGKILL)                 # the builder and its pool worker
        build.wait()
    [killed] = folder.glob(".tokens.bin.*.tmp")
    assert str(build.pid) in killed.name
    live = folder / killed.name.replace(str(build.pid), str(os.getppid()))    # a live builder's (our parent's pid)
    shutil.copyfile(killed, live)
    unowned_old, unowned_new = folder / ".manifest.json.k3j4h5l6.tmp", folder / ".idf-L64-V30522.npy.a1b2c3d4.tmp"
    for path in (unowned_old, unowned_new):                  # _atomic's names say no process: judged by age
        path.write_text("x")
    shutil.copyfile(killed, folder / f".word_starts.bin.{build.pid}.tmp")     # the name an older data.py gave
    os.utime(unowned_old, (time.time() - 2 * 3600,) * 2)
    windows, _ = _windows_of(corpus)
    assert len(windows) > 0 and sorted(folder.glob(".*.tmp")) == sorted([live, unowned_new])
    # Any later use of the folder removes them too, the built cache untouched.
    live.rename(killed)
    assert _windows_of(corpus)[0] == windows and sorted(folder.glob(".*.tmp")) == [unowned_new]


# --- evaluate.py and finetune.py faults ---
def test_a_tag_with_spaces_is_one_word_in_the_run_file_and_a_failed_evaluation_keeps_the_old_files(tmp_path,
                                                                                                      monkeypatch):
    """The default tag is the model folder's parent name, and the default out_dir the fine-tuning run's own
    eval-test/: a space in that name used to spoil the run's run.trec (7 fields a line, unreadable)."""
    beir, run = tiny_beir(tmp_path / "beir"), tmp_path / "ft run"
    _tiny_init(run / "encoder")
    flags = dict(model=str(run / "encoder"), dataset=str(beir), depth=10)
    out = run / "eval-test"
    for tag, written in (("", "ft-run"), ("my model", "my-model"), ("a\tb", "a-b")):
        means, _ = evaluate.main(evaluate.Config(**flags, tag=tag))
        lines = (out / "run.trec").read_text().splitlines()
        assert lines and {line.split(" ")[5] for line in lines} == {written}, tag   # 6 fields, the tag one word
        saved = json.loads((out / "metrics.json").read_text())
        assert saved["tag"] == written and saved["metrics"] == means
        assert evaluate.compute_metrics(evaluate.read_run(out / "run.trec"), data.read_qrels(beir / "qrels" / "test.tsv"))[0] == means
    before = folder_bytes(out)
    monkeypatch.setattr(evaluate, "read_run", lambda path: (_ for _ in ()).throw(data.DataError(f"{path}: unreadable")))
    with pytest.raises(data.DataError, match="unreadable"):
        evaluate.main(evaluate.Config(**flags, tag="other"))
    assert folder_bytes(out) == before and sorted(p.name for p in out.iterdir()) == ["metrics.json", "run.trec"]


def test_evaluate_never_writes_into_a_folder_that_a_live_run_holds(tmp_path):
    beir, ft = tiny_beir(tmp_path / "beir"), tmp_path / "ft"
    _tiny_init(ft / "encoder")
    ev = tmp_path / "ev"
    for held, out_dir, line in (
            (ft, "", (f"error: {ft} is in use by another run, and {ft / 'eval-test'} is inside it; wait for "
                      f"it to end, or give another --out_dir")),     # the default out_dir, inside the live run
            (ev, str(ev), f"error: {ev} is in use by another run; wait for it to end, or give another --out_dir")):
        holder = _held_by_another_process(held)
        try:
            before = folder_bytes(tmp_path)
            with pytest.raises(SystemExit) as stopped:
                run.cli.run_command_line(lambda out_dir=out_dir: evaluate.main(evaluate.Config(
                    model=str(ft / "encoder"), dataset=str(beir), out_dir=out_dir)))
            assert stopped.value.code == line
            assert folder_bytes(tmp_path) == before and not (ft / "eval-test").exists()
        finally:
            holder.kill()                                   # kill -9: the kernel drops the lock
            holder.wait()
    evaluate.main(evaluate.Config(model=str(ft / "encoder"), dataset=str(beir), out_dir=str(ev)))
    assert (ev / "run.trec").is_file()


def test_compare_pairs_only_the_queries_both_runs_have_and_refuses_fewer_than_two(tmp_path, capsys):
    qrels = write(tmp_path / "qrels.tsv", "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(1, 6)))
    a = write(tmp_path / "a.trec", "".join(f"q{i} Q0 d{i} 1 2.0 a\n" for i in (1, 2, 3, 4)))    # q5: in neither run
    b = write(tmp_path / "b.trec", "q1 Q0 x 1 3.0 b\nq1 Q0 d1 2 1.0 b\nq2 Q0 d2 1 1.0 b\nq9 Q0 d1 1 1.0 b\n")
    tests = evaluate.main(evaluate.Config(compare=f"{a},{b}", qrels=str(qrels)))
    assert {(r["n"], r["mean_a"]) for r in tests.values()} == {(2, 1.0)}       # q1 and q2 only, not q3, q4 (0 in B)
    assert tests["MRR@10"]["mean_b"] == 0.75 and tests["MRR@10"]["p"] == pytest.approx(0.5)
    printed = capsys.readouterr().out
    assert "left out: 2 judged queries that only A has, 0 that only B has, 1 that neither has" in printed
    for b_text, n in (("q5 Q0 d5 1 1.0 b\n", 0), ("q1 Q0 d1 1 1.0 b\nq5 Q0 d5 1 1.0 b\n", 1)):
        b.write_text(b_text)
        with pytest.raises(SystemExit) as stopped:
            run.cli.run_command_line(lambda: evaluate.main(evaluate.Config(compare=f"{a},{b}", qrels=str(qrels))))
        assert stopped.value.code == (f"error: --compare: {a} and {b} have {n} judged quer{'y' if n == 1 else 'ies'} "
                                      f"in common (of 4 and {n + 1}); a paired t-test needs at least 2")
        assert " inf " not in capsys.readouterr().out


def test_a_full_disk_is_recognised_by_what_each_writer_raises(tmp_path):
    """The temporaries of the failed write are deleted before the question is asked, so the disk has room
    again (tmp_path has): the error itself must say it. The messages are those measured on a full tmpfs."""
    import errno

    from safetensors import SafetensorError
    for error in (OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
                  SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                  OSError("100000 requested and 8176 written"),                                    # numpy's tofile
                  RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")):  # torch.save
        assert run.files.is_disk_full(error, tmp_path), error
    for error in (OSError(errno.EACCES, "Permission denied"), RuntimeError("CUDA error: out of memory"),
                  KeyError("state.pt")):
        assert not run.files.is_disk_full(error, tmp_path), error


def _ft_command(tmp_path, out):
    beir, init = tmp_path / "beir", tmp_path / "init"
    if not beir.exists():
        tiny_beir(beir)
        _tiny_init(init)
    return ["--init", str(init), "--dataset", str(beir), "--train_split", "test", "--eval_split", "", "--batch_size", "1",
            "--query_len", "16", "--passage_len", "16", "--steps", "4", "--save_every", "2", "--log_every", "1",
            "--out_dir", str(out)]


def _encoder_is_the_state(stage):
    """The stage's encoder/ holds the weights of its state.pt: the checkpoint is one unit. -> state's step."""
    state = run.folders.load_training_state(stage / "state.pt")
    encoder = run.files.load_tensors(stage / "encoder" / "model.safetensors")
    weights = {run.hub.to_hf_name(k.removeprefix("encoder.")): v for k, v in state["model"].items()}
    assert weights.keys() == encoder.keys() and all(torch.equal(weights[k], encoder[k]) for k in weights)
    return state["step"]


def _same_encoder(a, b):
    a, b = (run.files.load_tensors(Path(x) / "encoder" / "model.safetensors") for x in (a, b))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kill", ["before the switch", "after state.pt"])
def test_finetune_checkpoint_switches_encoder_and_state_together(tmp_path, monkeypatch, kill):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    finetune.main(_ft_command(tmp_path, straight))
    real_save, real_replace = run.folders.save_training_state, os.replace

    def killed_writing_state(path, state):            # the kill lands after the encoder, before the state
        if state["step"] == 4:
            raise KeyboardInterrupt
        real_save(path, state)

    def killed_after_state(src, dst):                 # ... or right after state.pt was replaced
        real_replace(src, dst)
        if Path(dst).name == "state.pt" and run.folders.load_training_state(dst)["step"] == 4:
            raise KeyboardInterrupt
    with monkeypatch.context() as m:
        if kill == "before the switch":
            m.setattr(run.folders, "save_training_state", killed_writing_state)
        else:
            m.setattr(data.os, "replace", killed_after_state)
        with pytest.raises(KeyboardInterrupt):
            finetune.main(_ft_command(tmp_path, cut))
    if kill == "before the switch":
        assert _encoder_is_the_state(cut / "stage1") == 2                  # encoder/ is not step 4's
    run.folders.release_run_folder(cut)
    finetune.main(_ft_command(tmp_path, cut) + ["--resume"])               # completes or drops the cut switch
    assert _encoder_is_the_state(cut / "stage1") == 4
    assert not [p.name for p in (cut / "stage1").iterdir() if p.name.startswith(".")]
    assert _same_encoder(straight, cut) and _same_encoder(straight / "stage1", cut / "stage1")


@pytest.mark.parametrize("fails", ["checkpoint", "final encoder"])
def test_finetune_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, fails):
    import safetensors.torch
    from safetensors import SafetensorError
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    finetune.main(_ft_command(tmp_path, straight))
    real, saves = safetensors.torch.save_file, []

    def full(tensors, path, *args, **kwargs):          # the checkpoint of step 4, or the final encoder, finds the disk full
        saves.append(path)
        if len(saves) == (2 if fails == "checkpoint" else 3):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *args, **kwargs)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(SystemExit) as stopped:
        run.cli.run_command_line(lambda: finetune.main(_ft_command(tmp_path, cut)))
    stage = cut / "stage1"
    if fails == "checkpoint":
        size = sum(p.stat().st_size for p in [stage / "state.pt", *(stage / "encoder").rglob("*")] if p.is_file())
        assert re.fullmatch(rf"error: {re.escape(str(stage / 'encoder'))}: the disk is full \(a checkpoint needs "
                            rf"{size / 2**20:.1f} MiB, [\d.]+ [MG]iB free\); {re.escape(str(stage))} keeps the checkpoint "
                            r"of step 2; free some space, or copy the run's --out_dir to a bigger disk, and continue "
                            r"with --resume \(--out_dir the new place\)", stopped.value.code), stopped.value.code
        assert _encoder_is_the_state(stage) == 2
    else:
        size = sum(p.stat().st_size for p in (stage / "encoder").rglob("*") if p.is_file())
        assert re.fullmatch(rf"error: {re.escape(str(cut / 'encoder'))}: the disk is full \(the encoder needs "
                            rf"{size / 2**20:.1f} MiB, [\d.]+ [MG]iB free\); {re.escape(str(stage / 'encoder'))} holds "
                            r"it whole; free some space and continue with --resume", stopped.value.code), stopped.value.code
        assert _encoder_is_the_state(stage) == 4
    assert not [p for p in stage.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    finetune.main(_ft_command(tmp_path, cut) + ["--resume"])
    assert _same_encoder(straight, cut)


def test_evaluate_full_disk_is_one_line_and_keeps_the_previous_files(tmp_path, monkeypatch):
    import errno
    beir, init, out = tiny_beir(tmp_path / "beir"), _tiny_init(tmp_path / "init"), tmp_path / "ev"
    flags = dict(model=init, dataset=str(beir), depth=10, out_dir=str(out))
    evaluate.main(evaluate.Config(**flags))
    before = folder_bytes(out)

    def full(*args, **kwargs):                          # what a text write on a full disk raises
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(run.files, "atomic_write_text", full)
        with pytest.raises(SystemExit) as stopped:
            run.cli.run_command_line(lambda: evaluate.main(evaluate.Config(**flags, tag="new")))
    line = re.fullmatch(rf"error: {re.escape(str(out))}: the disk is full \(run.trec needs (\d+) B, [\d.]+ [KMG]iB "
                        r"free\); its run.trec and metrics.json are the previous ones; free some space, or give another "
                        r"--out_dir", stopped.value.code)
    assert line, stopped.value.code
    evaluate.write_run(tmp_path / "new.trec", evaluate.read_run(out / "run.trec"), "new")      # what the write needed
    assert (tmp_path / "new.trec").stat().st_size <= int(line[1]) <= 1.1 * (tmp_path / "new.trec").stat().st_size
    assert folder_bytes(out) == before
    # The corpus vectors (--vectors_dir): their space is reserved before the mapping is written (a full
    # disk under a mapping is a SIGBUS, exit 135, not an error).
    vectors = tmp_path / "vectors"
    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", lambda fd, offset, size: full())
        with pytest.raises(SystemExit) as stopped:
            run.cli.run_command_line(lambda: evaluate.main(evaluate.Config(**flags, vectors_dir=str(vectors))))
    assert re.fullmatch(rf"error: {re.escape(str(vectors))}: the disk is full \(the corpus vectors need "
                        rf"{3 * 32 * 2} B, [\d.]+ [KMG]iB free\); free some space, or give another "
                        r"--vectors_dir", stopped.value.code), stopped.value.code    # 3 documents x 32 fp16 values
    assert not list(vectors.iterdir()) and folder_bytes(out) == before


# ----------------------------------------------------------------------------------------------
# Faults that used to pass silently or hang: each is one line now
# ----------------------------------------------------------------------------------------------
def _nan_model(folder):
    """A tiny BERT folder whose weights are finite (so it loads) but one matrix so large that every vector it
    gives overflows to NaN."""
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    with torch.no_grad():
        encoder.blocks[1].ffn_out.weight.fill_(1e38)
    run.hub.save_pretrained(encoder, folder)
    return folder


def test_a_model_that_gives_nan_vectors_is_one_line_naming_it(tmp_path):
    beir, model = tiny_beir(tmp_path / "beir"), _nan_model(tmp_path / "nan")
    names_it = rf"^{re.escape(str(model))}: the model gives a non-finite vector"
    with pytest.raises(data.DataError, match=names_it):
        evaluate.main(evaluate.Config(model=str(model), dataset=str(beir), out_dir=str(tmp_path / "ev")))
    assert not (tmp_path / "ev" / "run.trec").exists()
    c = finetune.retriever_settings(finetune.Config(init=str(model), dataset=str(beir)))   # --pretrain's zero-shot row
    with pytest.raises(data.DataError, match=names_it):
        finetune.evaluate_folder(c, c.init, tmp_path / "zero-shot", "zero-shot")
    code, line = main_error([HERE / "evaluate.py", "--model", model, "--dataset", beir, "--out_dir", tmp_path / "ev"],
                            tmp_path)
    assert code == 1 and re.match(rf"error: {names_it[1:]}", line) and "\n" not in line, line


def test_an_index_that_finds_fewer_documents_says_so(tmp_path, capsys):
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    c = finetune.Config(**TINY, encode_batch=8, query_len=16, passage_len=24, pooling="cls", index="IVF8,Flat",
                        index_train=37)
    texts = _toy_texts()
    _, ids = evaluate.retrieve(encoder, _tokenizer(), texts, texts[:5], 30, c, torch.device("cpu"))
    short = int((ids < 0).any(1).sum())
    assert short > 0          # nprobe 1 of 8 lists: fewer than 30 documents for some queries
    assert (f"the IVF8,Flat index found fewer than 30 documents for {short} of 5 queries"
            in capsys.readouterr().out)


def test_several_models_need_no_tag_and_a_path_with_a_comma_is_one_model(tmp_path):
    corpus = write(tmp_path / "corpus.jsonl", "".join(json.dumps({"text": " ".join(["cells protein gene"] * n)}) + "\n"
                                                      for n in (20, 25, 30)))
    a, b = _tiny_init(tmp_path / "a" / "encoder"), _tiny_init(tmp_path / "b" / "encoder")
    curves = mechanisms.main(mechanisms.Config(model=f"{a},{b}", cls_by_length=True, corpus=str(corpus),
                                               out_dir=str(tmp_path / "fig")))
    assert list(curves) == [("a", "cls"), ("a", "mean"), ("b", "cls"), ("b", "mean")]   # the run folders' names
    c, d = _tiny_init(tmp_path / "c"), _tiny_init(tmp_path / "d")          # one folder holds both: their paths
    assert mechanisms.model_list(mechanisms.Config(model=f"{c},{d}", tsne="auto")) == [(c, c), (d, d)]
    comma = _tiny_init(tmp_path / "x,y" / "encoder")
    assert evaluate.model_list(evaluate.Config(model=comma)) == [(comma, "x,y")]   # it exists: one model
    evaluate.main(evaluate.Config(model=comma, dataset=str(tiny_beir(tmp_path / "beir")), depth=10))
    assert (tmp_path / "x,y" / "eval-test" / "run.trec").is_file()


def test_vectors_dir_without_posix_fallocate_as_on_macos(tmp_path, monkeypatch):
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(**TINY))
    texts, cpu = _toy_texts(), torch.device("cpu")
    ref = evaluate.encode(encoder, "cls", _tokenizer(), texts, 24, 8, cpu)
    monkeypatch.delattr(os, "posix_fallocate")
    mem = evaluate.encode(encoder, "cls", _tokenizer(), texts, 24, 8, cpu, path=tmp_path / "docs.npy")
    np.testing.assert_array_equal(mem, ref.astype(np.float16))       # the .npy header and every row intact


def test_peak_memory_reads_ru_maxrss_in_bytes_on_macos(monkeypatch):
    import resource

    from research import benchmark
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=3 * 2**30))  # macOS: bytes
    monkeypatch.setattr(sys, "platform", "darwin")
    no_proc = types.SimpleNamespace(read_text=lambda: (_ for _ in ()).throw(FileNotFoundError("/proc")))
    monkeypatch.setattr(benchmark, "Path", lambda path: no_proc)                                   # macOS: no /proc
    assert run.ranks.peak_memory_mb(torch.device("cpu")) == benchmark.peak_rss_mib() == 3072
    monkeypatch.setattr(sys, "platform", "linux")                                                  # Linux: KiB
    assert run.ranks.peak_memory_mb(torch.device("cpu")) == 3 * 2**20


def test_apple_silicon_is_told_once_why_its_gpu_is_not_used(monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    for platform, lines in (("linux", 0), ("darwin", 1)):
        monkeypatch.setattr(sys, "platform", platform)
        if hasattr(run.cli.say_mps_is_not_used, "cache_clear"):
            run.cli.say_mps_is_not_used.cache_clear()
        for _ in range(2):                               # finetune.py --pretrain parses the method's flags too
            run.cli.parse_config(evaluate.Config, ["--split", "dev"])
        said = re.findall(r"^note: .*MPS.* not used.*$", capsys.readouterr().out, re.MULTILINE)
        assert len(said) == lines, (platform, said)


def test_a_hung_child_of_the_study_or_the_benchmark_is_killed_and_named(tmp_path, monkeypatch):
    from research import benchmark, study
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(120)\n")
    t0 = time.time()
    with pytest.raises(RuntimeError) as stopped:
        study.run_stage([PY, str(hang)], tmp_path / "stage.log", hours=1 / 3600)
    assert re.fullmatch(rf"stage still running after 0m01s, taken for hung and killed \(--stage_hours\): "
                        rf"{re.escape(PY)} {re.escape(str(hang))} \(its output: {re.escape(str(tmp_path))}/stage.log\)",
                        str(stopped.value)), str(stopped.value)
    with pytest.raises(RuntimeError, match=rf"still running after 0m01s, taken for hung and killed: .*{hang.name}"):
        benchmark.in_fresh_process(hang, hours=1 / 3600)
    fake_git = tmp_path / "bin" / "git"                       # a git that never answers (a lock, a dead mount)
    fake_git.parent.mkdir()
    fake_git.write_text(f"#!{PY}\nimport time\ntime.sleep(120)\n")
    fake_git.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_git.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(evaluate, "GIT_TIMEOUT_S", 1)
    for git_state in (evaluate.git_state, lambda: benchmark.machine("x"), lambda: study.provenance(study.Config(), "none")):
        with pytest.raises(data.DataError, match=r"^git (rev-parse HEAD|status .*): no answer in 1 s \(a lock\? "
                                                 r"a dead mount\?\); killed"):
            git_state()
    assert time.time() - t0 < 15


@contextlib.contextmanager
def read_only(folder):
    """The folder cannot be written: chmod; as root, who writes anywhere, os.access says so (what the code asks),
    and the test checks that nothing was written."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    real_access = os.access

    def access(path, mode, **kw):
        return False if mode & os.W_OK and Path(path).resolve() == folder.resolve() else real_access(path, mode, **kw)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "access", access)
        yield


def test_a_complete_token_cache_next_to_a_read_only_corpus_is_read_as_it_is(tmp_path, small_cache_corpus):
    built = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
    before = folder_bytes(built.folder)
    with read_only(tmp_path):
        windows = run.cache.token_windows(small_cache_corpus, data.VOCAB, 64, verbose=False)
        assert windows.folder == built.folder and [windows[i] for i in range(5)] == [built[i] for i in range(5)]
        with pytest.raises(data.DataError, match=r"read-only\), and no complete one is there; pass --cache_dir DIR"):
            run.cache.token_windows(small_cache_corpus, data.VOCAB, 128, verbose=False)    # these windows were never cut
    assert folder_bytes(built.folder) == before


def test_pretrain_on_a_read_only_corpus_stops_before_any_work_naming_a_flag_that_works(tmp_path):
    beir, out = _scifact_subset(tmp_path / "ro" / "beir", n_train=8, n_test=4, n_other=20), tmp_path / "run"
    flags = ["--pretrain", "costa", "--pretrain_steps", "1", "--init", _tiny_init(tmp_path / "tiny"), "--baseline",
             "false", "--dataset", str(beir), "--steps", "1", "--batch_size", "4", "--passage_len", "64",
             "--out_dir", str(out)]
    before = folder_bytes(beir)
    with read_only(beir):
        with pytest.raises(data.DataError, match=r'read-only\), and no complete one is there; pass --pretrain_args '
                                                 r'"--cache_dir DIR"$'):
            finetune.main(flags + ["--pretrain_args", "--batch_size 4 --max_len 64"])
        assert not out.exists()                                          # no zero-shot row, no fine-tuning
        with pytest.raises(data.DataError, match=r"read-only\), and no complete one is there; pass --cache_dir DIR$"):
            finetune.main(flags + ["--pretrain_args", f"--batch_size 4 --max_len 64 --cache_dir {tmp_path / 'cache'}"])
        assert not out.exists()                                          # fine-tuning's passage cache: its own flag
        finetune.main(flags + ["--pretrain_args", f"--batch_size 4 --max_len 64 --cache_dir {tmp_path / 'cache'}",
                               "--cache_dir", str(tmp_path / "cache")])
    assert (out / "pretrain" / "done.json").is_file() and list((tmp_path / "cache").glob("corpus.jsonl.gz.tokens-*"))
    assert folder_bytes(beir) == before


# ----------------------------------------------------------------------------------------------
# Every file read is checked before it is trusted: damaged or non-finite weights, checksums,
# vocabularies, a rank that stops answering
# ----------------------------------------------------------------------------------------------
def _one_line_failure(call):
    """The line run.cli.run_command_line prints for call()'s failure (exit code 1)."""
    with pytest.raises(SystemExit) as stopped:
        run.cli.run_command_line(call)
    assert isinstance(stopped.value.code, str) and "\n" not in stopped.value.code
    return stopped.value.code


def _damage(path, how):
    """A weight file halved, its header's first byte flipped, emptied, or 200 bytes flipped in its data."""
    b = bytearray(path.read_bytes())
    if how == "halved":
        b = b[:len(b) // 2]
    elif how == "header":
        b[10] ^= 0xFF
    elif how == "emptied":
        b = bytearray()
    else:
        for i in range(len(b) - 400, len(b) - 200):
            b[i] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("how", ["halved", "header", "emptied", "flipped"])
def test_a_damaged_model_or_decoder_is_one_line_naming_the_file(tmp_path, how):
    import cpdae
    init = Path(_tiny_init(tmp_path / "run" / "encoder"))
    torch.manual_seed(0)
    run.files.save_tensors(init / "decoder.safetensors", cpdae.Decoder(32, 30522, 1e-12).state_dict())
    assert (init / "model.safetensors.sha256").is_file() and (init / "decoder.safetensors.sha256").is_file()
    beir = tiny_beir(tmp_path / "beir")
    for name in ("model.safetensors", "decoder.safetensors"):
        _damage(init / name, how)
    if how != "flipped":      # a folder the project did not write (no checksum): its format is still checked
        (init / "model.safetensors.sha256").unlink()
    before = folder_bytes(tmp_path)
    line = _one_line_failure(lambda: evaluate.main(evaluate.Config(model=str(init), dataset=str(beir))))
    why = {"halved": r"not a readable safetensors file \(.*incomplete metadata.*\); the file is damaged or truncated",
           "header": r"not a readable safetensors file \(.*invalid UTF-8.*\)",
           "emptied": r"not a readable safetensors file \(empty\)",
           "flipped": r"sha256 \w{16}\.\.\. is not the \w{16}\.\.\. that model.safetensors.sha256 recorded"}[how]
    assert re.match(rf"error: {re.escape(str(init / 'model.safetensors'))}: {why}", line), line
    with pytest.raises(data.DataError, match=rf"^{re.escape(str(init / 'model.safetensors'))}: {why}"):
        costa.train(costa.Config(init=str(init), out_dir=str(tmp_path / "costa")))   # --init, before any work
    with pytest.raises(data.DataError, match=rf"^{re.escape(str(init / 'decoder.safetensors'))}: "):
        mechanisms.load_cpdae_decoder(init)                                  # the mechanisms' reader
    assert folder_bytes(tmp_path) == before and not (tmp_path / "run" / "eval-test").exists()  # nothing written
    assert not (tmp_path / "costa").exists()


@pytest.mark.parametrize("where", ["word row", "position row"])
def test_non_finite_weights_are_named_before_any_work(tmp_path, where):
    init = Path(_tiny_init(tmp_path / "init"))
    state = run.files.load_tensors(init / "model.safetensors")
    name = "bert.embeddings." + ("word_embeddings.weight" if where == "word row" else "position_embeddings.weight")
    state[name][5 if where == "word row" else 500] = float("nan") if where == "word row" else float("inf")
    run.files.save_tensors(init / "model.safetensors", state)                     # a NaN the checksum vouches for
    beir, expected = tiny_beir(tmp_path / "beir"), rf"error: {re.escape(str(init / 'model.safetensors'))}: {name} holds 32 non-finite"
    line = _one_line_failure(lambda: evaluate.main(evaluate.Config(model=str(init), dataset=str(beir))))
    assert re.match(expected, line), line
    out = tmp_path / "ft"
    line = _one_line_failure(lambda: finetune.main(["--init", str(init), "--dataset", str(beir), "--train_split", "test",
                                                    "--steps", "1", "--out_dir", str(out)]))
    assert re.match(expected, line) and not out.exists(), line


def test_a_damaged_training_state_is_refused_and_non_finite_weights_are_never_saved(tmp_path, small_corpus):
    _cpdae, c, model, optimizer, scheduler = _tiny_training(tmp_path, small_corpus)
    out = Path(c.out_dir)
    run.folders.save_checkpoint(c, model, optimizer, scheduler, 2, True)
    assert sorted(p.name for p in out.iterdir()) == ["encoder", "state.pt", "state.pt.sha256"]
    assert run.folders.load_training_state(out / "state.pt")["step"] == 2
    step2 = folder_bytes(out)
    with torch.no_grad():
        model.encoder.embeddings.word.weight[7, :3] = float("nan")
    with pytest.raises(data.DataError, match=r"^step 4: encoder.embeddings.word.weight holds 3 non-finite value\(s\) .*; "
                                             rf"stopped without saving; {re.escape(str(out))} keeps its last good "
                                             r"checkpoint, step 2$"):
        run.folders.save_checkpoint(c, model, optimizer, scheduler, 4, True, 2)
    assert folder_bytes(out) == step2
    _damage(out / "state.pt", "flipped")                                    # 200 bytes in its tensor data
    with pytest.raises(data.DataError, match=r"state.pt: sha256 \w{16}\.\.\. is not the \w{16}\.\.\. that state.pt.sha256 "
                                             r"recorded when it was written: the file is damaged"):
        run.folders.load_training_state(out / "state.pt")
    nan_state = {"step": 2, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "config": {}}
    run.folders.save_training_state(tmp_path / "state.pt", nan_state)               # no checksum: finiteness still checked
    with pytest.raises(data.DataError, match=r"state.pt: model.encoder.embeddings.word.weight holds 3 non-finite"):
        run.folders.load_training_state(tmp_path / "state.pt")


def test_a_checksum_names_what_the_file_holds_at_every_moment_of_a_switch(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    run.files.save_tensors(path, {"w": torch.zeros(2)})
    real = os.replace

    def killed_after(src, dst):          # the kill lands right after the file was replaced, before its checksum
        real(src, dst)
        if Path(dst) == path:
            raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", killed_after)
    with pytest.raises(KeyboardInterrupt):
        run.files.save_tensors(path, {"w": torch.ones(2)})
    monkeypatch.undo()
    assert run.files.load_tensors(path)["w"].tolist() == [1.0, 1.0]               # the new file, verified
    assert len(run.files.listed_checksums(path)) == 2 and not list(tmp_path.glob(".*.tmp"))


def test_weight_files_get_the_folders_permissions(tmp_path):
    folder = tmp_path / "enc"
    _tiny_init(folder)
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == folder.stat().st_mode & 0o666, modes


def test_evaluate_checks_vocab_against_the_model_and_leaves_no_folder(tmp_path):
    init, beir = _tiny_init(tmp_path / "run" / "encoder"), tiny_beir(tmp_path / "beir")
    lines = data.VOCAB.read_text(encoding="utf-8").splitlines()
    for n in (30523, 30000):
        vocab = tmp_path / f"vocab{n}.txt"
        vocab.write_text("\n".join((lines + ["[extra]"])[:n]) + "\n", encoding="utf-8")
        c = evaluate.Config(model=init, dataset=str(beir), vocab=str(vocab), out_dir=str(tmp_path / "new" / "eval"))
        line = _one_line_failure(lambda c=c: evaluate.main(c))
        assert line == f"error: {vocab}: {n} entries, but the model {init} has vocab_size 30522", line
        assert not (tmp_path / "new").exists()                              # a refused run leaves no folder it made
    line = _one_line_failure(lambda: evaluate.main(evaluate.Config(bm25=True, dataset=str(beir), vocab=str(vocab))))
    assert line.startswith(f"error: --vocab {vocab} is not used by --bm25"), line


def test_finetune_uses_an_explicit_vocab_over_the_init_folders(tmp_path):
    init, vocab = _tiny_init(tmp_path / "init"), tmp_path / "vocab.txt"
    shutil.copyfile(data.VOCAB, vocab)
    assert run.run_vocab(finetune.Config(init=init, vocab=str(vocab))) == str(vocab)
    assert run.run_vocab(finetune.Config(init=init)) == str(Path(init) / "vocab.txt")


def test_a_chance_of_zero_has_no_ratio():
    assert run.chance_lines({"mlm_acc": 0.0, "mlm_chance": 0.0, "cl_acc": 0.5, "cl_chance": 0.25}) == [
        "mlm: accuracy 0.0000, chance 0.0000, ratio n/a", "cl: accuracy 0.5000, chance 0.2500, ratio 2.00"]


RANK_TIMEOUT_SCRIPT = """
import os, signal, sys, time
import torch
import costa, run
def work():
    costa.setup_distributed(timeout_s=float(sys.argv[1]))
    torch.distributed.all_reduce(torch.ones(1))                 # both ranks are past gloo's connect (see below)
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGSTOP)                    # rank 0 stops answering
    with run.folders.stops_cleanly(lambda: (6, 5, "runs/x")):
        torch.distributed.all_reduce(torch.ones(1))
run.cli.run_command_line(work)
"""


def test_a_rank_that_stops_answering_ends_the_job_within_dist_timeout(tmp_path):
    """Rank 0 stops after a first collective: one stopped inside init_process_group, during gloo's connect, left
    rank 1 waiting past the timeout in 1 of 3 loaded runs (gloo's listener drops it: pytorch/gloo#520)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(HERE)}
    ranks = [subprocess.Popen([PY, "-c", RANK_TIMEOUT_SCRIPT, "3"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    try:
        _, err = ranks[1].communicate(timeout=90)
    finally:
        ranks[0].kill()
        ranks[0].wait()
    assert ranks[1].returncode == 1
    assert err.strip().splitlines()[-1] == (
        "error: rank 1 of 2: no answer from rank 0 within the process-group timeout (3 s, --dist_timeout; it stopped, "
        "hung or died); the job ends at step 6; last checkpoint at step 5 in runs/x; continue with --resume"), err
