"""Test nDCG@10 on SciFact, finetune.py against sentence-transformers at the same recipe: one full
fine-tuning of all-MiniLM-L6-v2 per tool and seed, scored by evaluate.py; a row per run in this folder
(ours-seedS.json, st-seedS.json; a row already here is kept, not run again), which research/benchmark.py's goals
table reads. See README.md here.

    python results/st-ndcg/st_ndcg.py 0,1,2                  # seeds; run folders in runs/st-ndcg
    python results/st-ndcg/st_ndcg.py 0,1,2 --out_dir DIR
"""
import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
import data
import evaluate
import finetune
import run
from research import benchmark


def st_triplets(batches, step):
    """finetune.py's batch at `step` (TrainBatches, one rank, one negative) as sentence-transformers' texts:
    (queries, positives, negatives), in the batch's order."""
    c, examples, doc_texts = batches.c, batches.examples, batches.doc_texts
    rows = data.batch_indices(len(examples), c.batch_size, 0, 1, c.seed, step)      # TrainBatches' own rows
    docs = batches[step]["p_doc"].tolist()                                          # positive, negative, ...
    return [examples[i].query for i in rows], [doc_texts[d] for d in docs[0::2]], [doc_texts[d] for d in docs[1::2]]


def st_ndcg_one(which, seed, out_root):
    """One full fine-tuning of all-MiniLM-L6-v2 on SciFact train, evaluated on test, with finetune.py's
    recipe and seed: "ours" runs `finetune.py --init minilm --seed S` (BM25 negatives, 2 epochs, lr 1e-4,
    batch 32 + 1 negative, 64/128 tokens, bf16); "st" trains sentence-transformers'
    MultipleNegativesRankingLoss (scale 20 = finetune.py's tau 0.05) on the same (query, positive,
    negative) triplets in the same order (TrainBatches' draws for that seed, from ours' BM25 pools), with
    finetune.py's optimizer and schedule (run.make_optimizer), clipping and autocast; then encodes with
    SentenceTransformer.encode and is scored by evaluate.py like ours. Returns the test metrics row."""
    ours_dir = out_root / f"ours-seed{seed}"
    if which == "ours":
        cmd = [sys.executable, str(ROOT / "finetune.py"), "--init", "minilm", "--seed", str(seed),
               "--out_dir", str(ours_dir), "--overwrite"]
        if subprocess.run(cmd, check=False).returncode:
            sys.exit(f"error: {' '.join(cmd)} failed")
        return json.loads((ours_dir / "eval-test" / "metrics.json").read_text())
    from sentence_transformers import SentenceTransformer, losses
    init = str(run.hub.resolve_model("minilm"))
    c = finetune.retriever_settings(finetune.Config(init=init, seed=seed))
    corpus, queries, qrels = data.load_beir(str(data.SCIFACT), "train")
    doc_ids = list(corpus)
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    doc_texts = [evaluate.passage_text(corpus[d]) for d in doc_ids]
    ours_dir.mkdir(parents=True, exist_ok=True)                  # ours' BM25 pools, made again if gone
    examples = finetune.bm25_negative_pools(dataclasses.replace(c, resume=True), finetune.make_examples(
        queries, qrels, doc_index), doc_texts, doc_ids, doc_index, ours_dir / "negatives_bm25.tsv", torch.device("cpu"), True)
    c.steps = finetune.stage_steps(c, len(examples), c.epochs, 1)
    batches = finetune.TrainBatches(c, examples, doc_texts, data.load_tokenizer(), 0, 1)
    torch.manual_seed(seed)
    model = SentenceTransformer(init, device="cpu")
    model.max_seq_length = c.passage_len
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=1 / c.tau)
    optimizer, scheduler = run.make_optimizer(model, c)
    model.train()
    t0 = time.time()
    for step in range(c.steps):
        texts = st_triplets(batches, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16 and benchmark.cpu_bf16()):
            loss = loss_fn([model.tokenize(t) for t in texts], None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 10 == 0 or step + 1 == c.steps:
            rate = (step + 1) / (time.time() - t0)
            print(f"st seed {seed}: step {step + 1}/{c.steps} | loss {loss.item():.4f} | {rate * 60:.1f} steps/min | "
                  f"eta {(c.steps - step - 1) / rate:.0f}s", flush=True)
    model.eval()
    corpus, queries, qrels = data.load_beir(str(data.SCIFACT), "test")
    doc_ids, qids = list(corpus), sorted(qrels)
    encode = lambda texts: model.encode(texts, batch_size=c.encode_batch, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=True).astype(np.float32)
    doc_vecs, query_vecs = encode([evaluate.passage_text(corpus[d]) for d in doc_ids]), encode([queries[q] for q in qids])
    scores, ids = evaluate.search(query_vecs, doc_vecs, 1000)
    ranking = {q: {doc_ids[j]: float(s) for s, j in zip(scores[r], ids[r]) if j >= 0} for r, q in enumerate(qids)}
    out = out_root / f"st-seed{seed}" / "eval-test"
    out.mkdir(parents=True, exist_ok=True)
    evaluate.save_and_score(ranking, qrels, out, "sentence-transformers", {"steps": c.steps, "seed": seed})
    return json.loads((out / "metrics.json").read_text())


def st_ndcg_table(seeds, out_root, results=HERE):
    """One full run per tool and seed (each seed: the same batches for both), a row each in results,
    resumed from there; then benchmark.st_ndcg_summary of the rows."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    for seed in seeds:
        for which in ("ours", "st"):                       # ours first: st reads its BM25 pools
            path = results / f"{which}-seed{seed}.json"
            if path.is_file():
                continue
            t0 = time.time()
            m = st_ndcg_one(which, seed, out_root)
            command = f"python results/st-ndcg/st_ndcg.py {','.join(map(str, seeds))}"
            where = benchmark.machine(command)          # the CPU, its native bf16 and so both tools' precision
            row = {"which": which, "seed": seed, "metrics": m["metrics"], "per_query": m["per_query"],
                   "seconds": round(time.time() - t0), "commit": commit, "torch": torch.__version__,
                   "command": command, **{k: where[k] for k in ("cpu", "cpu_bf16", "precision", "date")}}
            run.files.atomic_write_json(path, row)
            print(f"{which} seed {seed}: test nDCG@10 {m['metrics']['NDCG@10']:.4f} ({row['seconds']} s) -> {path}",
                  flush=True)
    print(benchmark.st_ndcg_summary(results) or "no rows")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seeds", help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--out_dir", default="runs/st-ndcg", help="run folders (not committed)")
    args = parser.parse_args()
    st_ndcg_table([int(x) for x in args.seeds.split(",")], Path(args.out_dir))
