"""Fine-tuning the papers' way on MS MARCO-format files, and its corpus through the passage cache: --global_batch,
queries without negatives dropped and counted (or filled from BM25), negatives in the file's ranking order, the
three-column corpus.tsv with its titles, and the passages read from the cache as the texts would be tokenized.
Tiny models, tiny files, no downloads.

    python -m pytest -q tests/test_finetune_recipe.py
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import evaluate
import finetune
import run

HERE = Path(__file__).resolve().parent.parent   # the repository root
TINY = ["--init", "", "--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "64",
        "--passage_len", "32", "--query_len", "16", "--log_every", "1", "--bf16", "false"]
WORDS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "olive", "peach", "pear", "plum", "river",
         "mountain", "forest", "desert", "ocean", "island", "valley", "canyon", "glacier", "engine", "rocket"]


def tiny_marco(folder, n_passages=40, n_queries=12, missing=(2, 5, 9)):
    """MS MARCO-format files: collection.tsv with titles (pid, title, text), queries.train.tsv, TREC qrels (query q's
    positive is passage p{2q}), a negatives TSV without lines for the queries in `missing`, and 4 eval queries."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    text = lambda n: " ".join(rng.choice(WORDS, n))
    (folder / "collection.tsv").write_text("".join(f"p{i}\ttitle {i} {text(2)}\t{text(12)}\n" for i in range(n_passages)))
    queries = {f"q{q}": text(4) for q in range(n_queries + 4)}
    (folder / "queries.tsv").write_text("".join(f"{q}\t{t}\n" for q, t in queries.items()))
    qrels = lambda qs: "".join(f"q{q} 0 p{2 * q} 1\n" for q in qs)
    (folder / "qrels.train.tsv").write_text(qrels(range(n_queries)))
    (folder / "qrels.dev.tsv").write_text(qrels(range(n_queries, n_queries + 4)))
    negatives = {q: [p for p in rng.permutation(n_passages) if p != 2 * q][:20] for q in range(n_queries) if q not in missing}
    (folder / "negatives.tsv").write_text("".join(f"q{q}\t{','.join(f'p{p}' for p in ps)}\n" for q, ps in negatives.items()))
    return ["--corpus", folder / "collection.tsv", "--queries", folder / "queries.tsv", "--qrels", folder / "qrels.train.tsv",
            "--bm25_negatives", folder / "negatives.tsv", "--eval_queries", folder / "queries.tsv",
            "--eval_qrels", folder / "qrels.dev.tsv"]


def test_help_names_global_batch_and_the_paper_preset_sets_the_papers_global_batch():
    result = subprocess.run([sys.executable, "finetune.py", "--help"], cwd=HERE, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "global_batch" in result.stdout
    c = run.cli.parse_config(finetune.Config, ["--preset", "paper"], "", finetune.PAPER_PRESET, finetune.FLAG_RULES)
    paper = dict(global_batch=64, lr=5e-6, weight_decay=0.0, warmup=0.1, n_negatives=7, epochs=3.0, rounds=1,
                 hard_epochs=2.0, hard_depth=200, query_len=32, passage_len=128, loss="softmax", missing_negatives="drop")
    assert {k: getattr(c, k) for k in paper} == paper            # docs/paper-scale.md's table, row by row
    assert [run.resolve_batch(c, world).batch_size for world in (1, 2, 4)] == [64, 32, 16]
    with pytest.raises(ValueError, match="--global_batch 64 is not a multiple of 3 process"):
        run.resolve_batch(c, 3)


def test_a_tiny_ms_marco_run_trains_and_counts_the_queries_without_negatives(tmp_path):
    """Done when: a three-column collection.tsv, TREC qrels, a negatives file missing 3 of 12 training queries: rc 0,
    and one line holding the number 3 names the queries without negatives."""
    files = tiny_marco(tmp_path / "marco")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [*files, *TINY, "--steps", "2", "--global_batch", "4", "--n_negatives", "2", "--out_dir", tmp_path / "ft"]
    result = subprocess.run([sys.executable, "finetune.py", *map(str, args)], cwd=HERE, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    line = re.search(r"^negatives: 3 of 12 training queries have no line in .*negatives\.tsv; left out of training.*$",
                     result.stdout, re.MULTILINE)
    assert line, result.stdout
    assert re.search(r"^stage1: 9 queries \| 2 steps", result.stdout, re.MULTILINE)       # the 9 with a line train
    assert (tmp_path / "ft" / "encoder" / "model.safetensors").is_file()
    assert (tmp_path / "ft" / "eval-test" / "metrics.json").is_file()
    assert data.read_corpus(tmp_path / "marco" / "collection.tsv")["p3"]["title"].startswith("title 3 ")


def test_missing_negatives_bm25_fills_them_and_trains_every_query(tmp_path, capsys):
    files = tiny_marco(tmp_path / "marco")
    finetune.main([*map(str, files), *TINY, "--steps", "1", "--batch_size", "4", "--eval_split", "",
                   "--missing_negatives", "bm25", "--out_dir", str(tmp_path / "ft")])
    printed = capsys.readouterr().out
    assert "negatives: 3 of 12 training queries have no line in" in printed and "come from BM25" in printed
    assert re.search(r"^stage1: 12 queries", printed, re.MULTILINE)
    corpus = run.passages.load_passages(tmp_path / "marco" / "collection.tsv", data.VOCAB)
    searched = finetune.read_negatives(tmp_path / "ft" / "negatives_bm25.tsv", corpus.index)
    assert sorted(searched) == ["q2", "q5", "q9"]                  # BM25 searched only the queries the file lacks


def test_negatives_are_read_in_the_files_ranking_order_up_to_the_depth(tmp_path):
    index = {f"p{i}": i for i in range(10)}
    tsv = tmp_path / "negatives.tsv"
    tsv.write_text("q1\tp7,p3,p9,p1\nq2\tp2\n")
    got = finetune.read_negatives(tsv, index, depth=3)
    assert got["q1"].tolist() == [7, 3, 9] and got["q2"].tolist() == [2]          # as listed, the first 3
    trec = tmp_path / "bm25.trec"                                                  # a run file: by score, not by line
    trec.write_text("q1 Q0 p4 3 1.5 bm25\nq1 Q0 p8 1 9.0 bm25\nq1 Q0 p6 2 4.0 bm25\nq2 Q0 p5 1 2.0 bm25\n")
    got = finetune.read_negatives(trec, index, depth=2)
    assert got["q1"].tolist() == [8, 6] and got["q2"].tolist() == [5]
    tsv.write_text("q1\tp7,p99\n")
    with pytest.raises(data.DataError, match=r"negatives\.tsv:1: document id 'p99' is not in the corpus"):
        finetune.read_negatives(tsv, index)


def test_the_passage_cache_reads_what_the_texts_tokenize_to_and_looks_ids_up(tmp_path):
    tiny_marco(tmp_path / "marco")
    collection = tmp_path / "marco" / "collection.tsv"
    corpus, tokenizer = run.passages.load_passages(collection, data.VOCAB), data.load_tokenizer()
    texts = [data.passage_text(doc) for doc in data.read_corpus(collection).values()]
    assert len(corpus) == 40 and corpus.chars.tolist() == [len(t) for t in texts]
    rows = [5, 0, 39, 5]
    for max_len in (4, 12, 64):                                     # cut inside the title, the text, not at all
        ids, mask = corpus.batch(rows, max_len)
        want_ids, want_mask = data.encode_texts(tokenizer, [texts[r] for r in rows], max_len)
        assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask)
    assert [corpus.doc_ids[r] for r in rows] == ["p5", "p0", "p39", "p5"] and corpus.index["p17"] == 17
    assert corpus.index.rows(["p3", "p30"]).tolist() == [3, 30] and "p40" not in corpus and "p4" in corpus
    shard = corpus[10:20]                                            # a rank's share: rows count from its start
    assert len(shard) == 10 and torch.equal(shard.batch([0], 12)[0], corpus.batch([10], 12)[0])
    folder = corpus.folder
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    run.passages.load_passages(collection, data.VOCAB)                # mapped again, not rebuilt
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    with open(collection, "a") as f:
        f.write("p0\tagain\ta duplicate id\n")
    with pytest.raises(data.DataError, match="duplicate document id 'p0'"):
        run.passages.load_passages(collection, data.VOCAB)


def test_encoding_through_the_loader_gives_the_same_vectors_from_texts_or_the_cache(tmp_path):
    tiny_marco(tmp_path / "marco")
    collection = tmp_path / "marco" / "collection.tsv"
    corpus, tokenizer = run.passages.load_passages(collection, data.VOCAB), data.load_tokenizer()
    texts = [data.passage_text(doc) for doc in data.read_corpus(collection).values()]
    torch.manual_seed(0)
    encoder = finetune.Encoder(finetune.Config(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64)).eval()
    cpu = torch.device("cpu")
    encode = lambda source, workers: evaluate.encode(encoder, "cls", tokenizer, source, 24, 8, cpu, False,
                                                      workers=workers)
    reference = encode(texts, 0)                                    # (40, 32)
    for source, workers in ((texts, 2), (corpus, 0), (corpus, 2)):
        assert np.array_equal(encode(source, workers), reference)   # bit for bit
