"""finetune.py against sentence-transformers at the same recipe and on the same batches (all-MiniLM-L6-v2,
lr 1e-4, batch 32 + 1 BM25 negative, 64 / 128 tokens): step time and peak RSS, each tool in a fresh
process, and where fine-tuning's memory goes. Both tools run in the precision a user gets on this CPU:
bf16 autocast where the CPU has native bf16 (AVX512-BF16 or AMX), fp32 elsewhere, the rule of
run.autocast_bf16 that finetune.py follows (emulated bf16 is slower than fp32, so autocasting only the
peer there would report a speed-up that is only the precision). Each row records its precision and the
CPU's bf16 support. What a run prints is written to results/speed/st.md (--memory: st-memory.md), which
docs/speed.md cites.

    python results/speed/st.py                  # s/step and peak RSS of both tools, then the two goals
    python results/speed/st.py --memory         # resident between steps and peak: malloc as is and pinned
    python results/speed/st.py --one ours:8:2   # one tool in this process (steps:warmup), as JSON
    python results/speed/st.py --profile        # where each tool's step time goes, by op kind (st-profile.md)
    python results/speed/st.py --one "ours:8:2:fused qkv"   # ... with one of levers.py's encoder changes
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import data
import run
from research import benchmark


def rss_mib():
    """This process's resident set now, MiB (Linux; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return 0.0


def st_one(which, n_steps, warmup, lever="as shipped"):
    """One side of the comparison in this (fresh) process: "ours" (finetune.py's step, with a lever of
    levers.py) or "st" (sentence-transformers' MultipleNegativesRankingLoss) on finetune.py's BM25 batches.
    Returns the median step seconds, the peak RSS of the steps and the resident set between two steps."""
    batches, doc_texts, _, c = benchmark.finetune_batches(n_steps + warmup, bm25=True)
    init = str(run.hub.resolve_model("minilm"))
    torch.manual_seed(0)
    if which == "ours":
        from levers import apply_lever  # beside this file
        step = benchmark.finetune_step(batches, init, lambda encoder: apply_lever(lever, encoder))
    else:
        from sentence_transformers import SentenceTransformer, losses
        model = SentenceTransformer(init, device="cpu")
        model.max_seq_length = c.passage_len
        loss_fn = losses.MultipleNegativesRankingLoss(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        tokenizer = data.load_tokenizer()
        queries = lambda ids: [tokenizer.decode(row.tolist()) for row in ids]     # the batch's queries, back
        passages = lambda docs: [doc_texts[d] for d in docs.tolist()]
        it = iter([(queries(b["q_ids"]), passages(b["p_doc"][0::2]), passages(b["p_doc"][1::2])) for b in batches])
        model.train()

        def step():
            features = [model.tokenize(x) for x in next(it)]                     # queries, positives, negatives
            with run.autocast_bf16(torch.device("cpu")):                      # as finetune.py's step
                loss = loss_fn(features, None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if os.environ.get("ST_PROFILE"):   # --profile's child: the op kinds' shares of the timed steps' self time
        return profiled(step, n_steps, warmup)
    times, between = [], 0.0
    benchmark.reset_peak_rss()            # the training steps' peak: BM25 and the batches are the same for both
    for i in range(n_steps + warmup):
        if i == warmup:
            between = rss_mib()           # resident between two steps: weights, optimizer, and what malloc kept
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"which": which, "step_s": float(np.median(times[warmup:])), "peak_mib": benchmark.peak_rss_mib(),
            "between_mib": between, "precision": "bf16" if benchmark.cpu_bf16() else "fp32",
            "cpu_bf16": benchmark.machine("")["cpu_bf16"]}


def profiled(step, n_steps, warmup):
    """torch.profiler's self time of n_steps steps after warmup, by op kind (profile_ops.py's groups), top ops."""
    from profile_ops import OP_GROUPS, op_group  # beside this file
    for _ in range(warmup):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n_steps):
            step()
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in ops) or 1
    share = dict.fromkeys([g for g, _ in OP_GROUPS] + ["elementwise and other"], 0.0)
    for name, t in ops:
        share[op_group(name)] += t / total
    top = [(n.split("::")[-1], t / total) for n, t in sorted(ops, key=lambda o: -o[1])[:6]]
    return {"ms_per_step": total / 1000 / n_steps, "share": share, "top": top}


def profile_table(n_steps, warmup):
    """Each tool's step by op kind, each in a fresh process (torch.profiler slows both: read the shares)."""
    env = {**os.environ, "ST_PROFILE": "1"}
    rows = {which: fresh(which, n_steps, warmup, env) for which in ("ours", "st")}
    groups = list(rows["ours"]["share"])
    print(f"Fine-tuning step by op kind, self time of {n_steps} steps after {warmup} (torch.profiler):\n")
    print("| tool | profiled ms/step | " + " | ".join(groups) + " | top ops |\n|---|---|" + "---|" * len(groups) + "---|")
    for which, r in rows.items():
        print(f"| {'finetune.py' if which == 'ours' else 'sentence-transformers'} | {r['ms_per_step']:,.0f} | " +
              " | ".join(f"{r['share'][g]:.0%}" for g in groups) + " | " +
              ", ".join(f"{n} {t:.0%}" for n, t in r["top"]) + " |")


def fresh(which, n_steps, warmup, env=None):
    """st_one in a fresh process (peak RSS is a high-water mark)."""
    return benchmark.in_fresh_process(__file__, "--one", f"{which}:{n_steps}:{warmup}", env=env)


def st_table(n_steps, warmup, pairs):
    """Ours and sentence-transformers, each in a fresh process, alternated `pairs` times; medians; then the
    goals table's two rows for them."""
    rows = {"ours": [], "st": []}
    for _ in range(pairs):
        for which, runs in rows.items():
            runs.append(fresh(which, n_steps, warmup))
    med = {w: {k: float(np.median([r[k] for r in rs])) for k in ("step_s", "peak_mib")} for w, rs in rows.items()}
    native = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in rows["ours"][0]["cpu_bf16"].items())
    print(f"Fine-tuning step, same recipe and batches (all-MiniLM-L6-v2, lr 1e-4, batch 32 + 1 BM25 negative, "
          f"64/128 tokens; median of {n_steps} steps after {warmup}, {pairs} process pairs):\n")
    print("| | precision | CPU's native bf16 | s/step | peak RSS MiB during the steps |\n|---|---|---|---|---|")
    for w, name in (("ours", "finetune.py"), ("st", "sentence-transformers (MultipleNegativesRankingLoss)")):
        print(f"| {name} | {rows[w][0]['precision']} | {native} | {med[w]['step_s']:.2f} | {med[w]['peak_mib']:,.0f} |")
    goals = benchmark.GOALS
    print(f"\n| measure | goal | today |\n|---|---|---|\n"
          f"| finetune.py step vs sentence-transformers', same recipe: speed | >= {goals['st_speed']}x | "
          f"{med['st']['step_s'] / med['ours']['step_s']:.2f}x |\n"
          f"| finetune.py peak RSS / sentence-transformers' | <= {goals['st_rss']}x | "
          f"{med['ours']['peak_mib'] / med['st']['peak_mib']:.2f}x |")


def st_memory_table(n_steps=2, warmup=1):
    """Fine-tuning memory, ours and sentence-transformers', each in a fresh process, with glibc's malloc as
    is and with its mmap threshold pinned at 64 KiB (freed activations go back to the OS, so the peak is
    live memory and the resident set between steps is what the step keeps): how much of each peak is
    memory that malloc retained rather than memory the step needs."""
    print("| fine-tuning step, MiniLM, batch 32 x (1 + 2) texts | malloc | precision | resident between steps MiB | "
          "peak MiB |\n|---|---|---|---|---|")
    for which, label in (("ours", "finetune.py"), ("st", "sentence-transformers")):
        for name, env in (("as is", None), ("mmap threshold 64 KiB", {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})):
            try:
                r = fresh(which, n_steps, warmup, env)
            except RuntimeError as e:
                print(f"| {label} | {name} | | failed: {e} | |")
                continue
            print(f"| {label} | {name} | {r['precision']} | {r['between_mib']:,.0f} | {r['peak_mib']:,.0f} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", action="store_true", help="where fine-tuning's memory goes, malloc as is and pinned")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per process")
    parser.add_argument("--pairs", type=int, default=2, help="process pairs, alternated")
    parser.add_argument("--profile", action="store_true", help="each tool's step by op kind (torch.profiler)")
    parser.add_argument("--one", metavar="WHICH:STEPS:WARMUP[:LEVER]", help="one tool in this process, as JSON")
    args = parser.parse_args()
    if args.one:
        which, n_steps, warmup, *lever = args.one.split(":")
        print(json.dumps(st_one(which, int(n_steps), int(warmup), *lever)))
    elif args.profile:
        with benchmark.recorded(Path(__file__).parent / "st-profile.md"):
            profile_table(3, 1)
    elif args.memory:
        with benchmark.recorded(Path(__file__).parent / "st-memory.md"):
            st_memory_table()
    else:
        with benchmark.recorded(Path(__file__).parent / "st.md"):
            st_table(args.steps, 2, args.pairs)
