"""Peak RSS of evaluate.encode + a top-100 search of 100 queries, the corpus vectors float32 in memory
(as before --vectors_dir) or an fp16 memmap on disk, searched by faiss (Flat, IVF256,SQ8) or by
evaluate.torch_exact_search (the GPU path, here on the CPU). The encoder is a stand-in that returns random
hidden states, so that the run measures the vectors and the search, not a model; each case runs in a fresh
process (the peak is a high-water mark). What it prints is written to
results/scale/vectors_rss.md.

    python results/scale/vectors_rss.py 300000             # 300,000 x 768 vectors
    python results/scale/vectors_rss.py 2000               # a quick check
"""
import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import benchmark
import data
import evaluate


class RandomEncoder(torch.nn.Module):
    """Stands in for the encoder in evaluate.encode: random hidden states, so that the run measures
    the vectors and the search, not a model."""
    def __init__(self, hidden_size):
        super().__init__()
        self.config = evaluate.EncoderConfig(hidden_size=hidden_size)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, ids, mask):
        return torch.randn(*ids.shape, self.config.hidden_size, generator=self.generator)   # (b, L, H)


def vectors_rss_one(where, search, n, dim=768):
    """evaluate.encode of n texts then a top-100 search of 100 queries, in this process; the peak RSS
    (MiB) after each. where: "memory" (float32 array) or "memmap" (fp16 file); search: a faiss
    index_factory string, or "torch" (evaluate.torch_exact_search, what a GPU runs, here on the CPU)."""
    tokenizer, cpu, encoder = data.load_tokenizer(), torch.device("cpu"), RandomEncoder(dim)
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = peak()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "docs.npy") if where == "memmap" else ""
        docs = evaluate.encode(encoder, "cls", tokenizer, ["cell"] * n, 4, 512, cpu, False, "dot", path)  # (n, H)
        encoded = peak()
        queries = evaluate.encode(encoder, "cls", tokenizer, ["gene"] * 100, 4, 512, cpu, False)          # (100, H)
        if search == "torch":
            evaluate.torch_exact_search(queries, docs, 100, cpu)
        else:
            evaluate.search(queries, docs, 100, search)
    return {"where": where, "search": search, "start": start, "encoded": encoded, "searched": peak()}


def vectors_rss_table(n):
    """Each case in a fresh process (ru_maxrss is a high-water mark)."""
    print(f"peak RSS (MiB) of evaluate.encode + search, {n:,} x 768 vectors, 100 queries, top-100")
    print("| vectors | search | start | after encode | after search |\n|---|---|---|---|---|")
    for where, search in [("memory", "Flat"), ("memmap", "Flat"), ("memmap", "torch"),
                          ("memory", "IVF256,SQ8"), ("memmap", "IVF256,SQ8")]:
        r = benchmark.in_fresh_process(__file__, "--child", "vectors_rss_one", json.dumps([where, search, n]))
        name = "float32 in memory" if where == "memory" else "fp16 memmap"
        print(f"| {name} | {search} | {r['start']:,.0f} | {r['encoded']:,.0f} | {r['searched']:,.0f} |", flush=True)


CHILDREN = {f.__name__: f for f in (vectors_rss_one,)}   # run by benchmark.in_fresh_process


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=300000, help="corpus vectors (768-d)")
    parser.add_argument("--child", nargs=2, metavar=("FUNCTION", "ARGS"), help=argparse.SUPPRESS)  # in_fresh_process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](*json.loads(args.child[1]))))
    else:
        with benchmark.recorded(Path(__file__).parent / "vectors_rss.md"):
            vectors_rss_table(args.n)
