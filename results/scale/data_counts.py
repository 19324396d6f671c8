"""The bundled data's counts, which data/README.md and docs/running.md give: the Wikipedia slice's articles,
characters, WordPiece tokens (the token cache's, titles included, no special tokens) and its 128-token
windows (what pre-training reads, [CLS] and [SEP] counted in each); SciFact's abstracts, queries and
judgments; the vocabulary's entries. What it prints is written to results/scale/data_counts.md.

    python results/scale/data_counts.py
"""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import data


def main():
    with benchmark.recorded(Path(__file__).with_name("data_counts.md")), tempfile.TemporaryDirectory() as cache:
        articles = [obj for _, obj in data.iter_jsonl(data.WIKI)]
        windows = data.token_windows(str(data.WIKI), str(data.VOCAB), 128, cache_dir=cache, verbose=False)
        tokens = json.loads((windows.folder / "manifest.json").read_text())["n_tokens"]
        print(f"{data.WIKI.name}: {len(articles):,} articles, {sum(len(a['text']) for a in articles):,} characters "
              f"in their text fields; {tokens:,} WordPiece tokens (title. text, no special tokens); "
              f"{len(windows):,} windows of at most 128 tokens holding {windows.n_tokens:,} tokens with "
              f"[CLS] and [SEP] ({tokens + 2 * len(windows) - windows.n_tokens:,} tokens in last windows "
              f"too short to keep)")
        corpus = data.read_corpus(data.find_file(data.SCIFACT, "corpus.jsonl"))
        queries = data.read_queries(data.find_file(data.SCIFACT, "queries.jsonl"))
        print(f"scifact: {len(corpus):,} abstracts, {len(queries):,} queries", end="")
        for split in ("train", "test"):
            qrels = data.load_beir(data.SCIFACT, split)[2]
            print(f"; {split} {len(qrels):,} queries / {sum(map(len, qrels.values())):,} judgments", end="")
        print(f"\n{data.VOCAB.name}: {data.vocab_size_of(data.VOCAB):,} entries")


if __name__ == "__main__":
    main()
