"""The frozen SEED decoder trial (research.mechanisms --frozen seed, results/mechanisms/): the whole trial as the first
round's code (FIRST_ROUND, the commit of results/mechanisms/rows/frozen_seed-*.json) ran it against today's, the
same flags, steps and evaluation schedule, alternated (--trials of each, each trial a fresh process on the same
corpora and cached vectors, its time the row's own `seconds`: the steps and the evaluations); then where its time
goes and what makes its step faster: its own step (seed.WeakDecoder at all-MiniLM-L6-v2's sizes, 3 blocks, span 2, batch
16 x 128 windows, the tied 30,522-word embedding frozen, AdamW, bf16 autocast where the CPU has it) on
random vectors and tokens (the step's cost depends on the shapes only), timed round-robin in one process
(median of --reps), each variant's first step apart (a compile is in it), and torch.profiler's self time of
the as-shipped step by op kind. What it prints is written to results/speed/frozen_seed.md.

    python results/speed/frozen_seed.py --trials 2 --steps 100 --eval_every 100   # the trials, then the step
    python results/speed/frozen_seed.py --trials 0                                  # the step only
"""
import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from profile_ops import OP_GROUPS, op_group

import run
import seed
from research import benchmark

ROOT = Path(__file__).resolve().parents[2]
FIRST_ROUND = "a4678b4"   # results/mechanisms/rows/frozen_seed-*.json's commit: 1,437-2,053 s per 600 steps (AMD)
CORPORA = ROOT / "runs" / "frozen-speed"   # wiki-train / dev / test as results/mechanisms/confirm/make.sh makes them
MINILM = dict(hidden_size=384, num_heads=12, ffn_size=1536, vocab_size=30522, max_position=128, dec_layers=3,
              dec_span=2)


def frozen_step(loss_of, batch=16, length=128, seed_=0):
    """One frozen-trial step (mechanisms.frozen_trial's, SEED): decoder forward, eq. 9, backward, clip, AdamW.
    loss_of(states, weight, targets) -> (loss, n_correct) is the eq. 9 function the variant runs."""
    torch.manual_seed(seed_)
    c = seed.Config(**MINILM)
    embedding = nn.Embedding(c.vocab_size, c.hidden_size).requires_grad_(False)   # the frozen encoder's, at
    nn.init.normal_(embedding.weight, std=0.05)                                   # a trained embedding's scale
    decoder = seed.WeakDecoder(c, embedding)
    params = [p for p in decoder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    ids = torch.randint(1000, c.vocab_size, (batch, length))
    mask = torch.ones_like(ids)
    mask[: batch // 4, length - 30:] = 0                                            # some shorter windows
    h0 = torch.randn(batch, c.hidden_size)
    decoder_input, targets = seed.decoder_inputs_and_targets(ids, mask)

    def step(rng_seed=None):
        if rng_seed is not None:                                                    # the same dropout masks
            torch.manual_seed(rng_seed)
        decoder.train()
        times = [time.perf_counter()]
        with run.autocast_bf16(torch.device("cpu")):
            states = decoder(decoder_input, h0)                                     # (b, L-1, H)
            times.append(time.perf_counter())
            loss = loss_of(states, embedding.weight, targets)[0]
            times.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        times.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        times.append(time.perf_counter())
        step.phases.append(np.diff(times))                                          # the four phases' seconds
        return loss.item()
    step.phases = []
    return step


def make_corpora(folder):
    """wiki-{train,dev,test}.jsonl as make.sh's prepare(): the bundled slice's i % 5 != 4 (train) and the new texts
    split 1:2 (dev, test)."""
    folder.mkdir(parents=True, exist_ok=True)
    bundled, new = (gzip.decompress((ROOT / "data" / name).read_bytes()).decode().splitlines(keepends=True)
                    for name in ("wiki.jsonl.gz", "wiki-confirm.jsonl.gz"))
    for name, lines, keep in (("train", bundled, lambda i: i % 5 != 4), ("dev", new, lambda k: k % 3 == 0),
                              ("test", new, lambda k: k % 3 != 0)):
        if not (folder / f"wiki-{name}.jsonl").is_file():
            (folder / f"wiki-{name}.jsonl").write_text("".join(line for i, line in enumerate(lines) if keep(i)))


def first_round_tree():
    """A worktree of FIRST_ROUND's code (git worktree add, once) in the system's temporary folder."""
    tree = Path("/tmp") / f"frozen-seed-{FIRST_ROUND}"
    if not (tree / "mechanisms.py").is_file():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), FIRST_ROUND], check=True,
                       capture_output=True)
    return tree


def trial(tree, tag, args, extra=()):
    """One frozen SEED trial (the weak decoder, seed 0, 384 held-out windows) with `tree`'s mechanisms.py in a fresh
    process (run from this checkout, so that both codes read the same cached vectors); its row's seconds (steps +
    evaluations), the wall time and the final train loss. The first round's mechanisms.py sits at its tree's root;
    today's is research/mechanisms.py, run as `python -m research.mechanisms` (tree is then this checkout, the cwd)."""
    out = CORPORA / "rows" / tag
    script = [str(tree / "mechanisms.py")] if (tree / "mechanisms.py").is_file() else ["-m", "research.mechanisms"]
    command = [sys.executable, *script, "--model", "minilm", "--frozen", "seed", "--tag", tag, "--seed", "0",
               "--steps", str(args.steps), "--eval_every", str(args.eval_every), "--n_texts", str(args.n_texts),
               "--train_corpus", str(CORPORA / "wiki-train.jsonl"), "--dev_corpus", str(CORPORA / "wiki-dev.jsonl"),
               "--corpus", str(CORPORA / "wiki-test.jsonl"), "--frozen_cache", str(CORPORA / "vectors"),
               "--out_dir", str(out), "--dec_span", "2", *extra]
    t0 = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)   # here: --model minilm's cache key
    if result.returncode:
        raise SystemExit(f"{tree}: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    row = json.loads((out / f"frozen_seed-{tag}-seed0.json").read_text())
    return {"seconds": row["seconds"], "wall": time.perf_counter() - t0, "loss": row["curve"][-1]["train_loss"],
            "commit": row.get("commit", "?")[:7]}


def trials_table(args):
    """--trials of the first round's code and today's, alternated; each one's seconds and the ratio."""
    make_corpora(CORPORA)
    arms = {f"first round ({FIRST_ROUND})": (first_round_tree(), ()), "today": (ROOT, ())}
    if args.compile_arm:
        arms["today, --compile (eq. 9 compiled: not bit for bit)"] = (ROOT, ("--compile",))
    runs = {name: [] for name in arms}
    for rep in range(args.trials):
        for i, (name, (tree, extra)) in enumerate(arms.items()):
            runs[name].append(trial(tree, f"speed-{i}-{rep}", args, extra))
            print(f"  trial {rep + 1}, {name}: {runs[name][-1]}", flush=True)
    print(f"\n| frozen SEED trial, weak decoder, {args.steps} steps, measured every {args.eval_every} ({args.n_texts} dev + "
          f"{args.n_texts} test windows) | row seconds, each trial | median | wall s, median | final train loss |\n|---|---|---|---|---|")
    medians = {}
    for name, rows in runs.items():
        medians[name] = float(np.median([r["seconds"] for r in rows]))
        print(f"| {name}, code {rows[0]['commit']} | {', '.join(str(r['seconds']) for r in rows)} | {medians[name]:,.0f} "
              f"| {np.median([r['wall'] for r in rows]):,.0f} | {rows[-1]['loss']:.4f} |")
    first, *others = runs
    for name in others:
        pairs = [a["seconds"] / b["seconds"] for a, b in zip(runs[first], runs[name])]
        print(f"\n{name} against the first round's code, alternated on this machine: {medians[first] / medians[name]:.2f}x "
              f"as fast (medians); per pair {', '.join(f'{r:.2f}x' for r in pairs)}.", flush=True)


def bf16_logits_loss(states, weight, targets):
    """seed.decoder_loss with its (N, V) logits left in autocast's bf16 (no fp32 copy; cross_entropy's CPU kernel
    accumulates in fp32 within a row): a lever that changes the numbers."""
    targets = targets.reshape(-1)                                                   # (N,)
    logits = states.reshape(-1, states.shape[-1]) @ weight.T                        # (N, V) bf16
    total = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return total / targets.ne(-100).sum().clamp_min(1), (logits.argmax(-1) == targets).sum()


def chunked(chunk):
    """seed.chunked_decoder_loss, `chunk` positions at a time (each chunk's logits rebuilt in the backward)."""
    return lambda states, weight, targets: seed.chunked_decoder_loss(states.reshape(-1, states.shape[-1]), weight,
                                                                     targets.reshape(-1), chunk)


PHASES = ("decoder forward", "eq. 9 forward (logits, softmax)", "backward", "clip + AdamW")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="the step's timings (0: none)")
    parser.add_argument("--trials", type=int, default=2, help="trials of each code, alternated (0: none)")
    parser.add_argument("--steps", type=int, default=100, help="each trial's steps")
    parser.add_argument("--eval_every", type=int, default=100, help="each trial's evaluation schedule")
    parser.add_argument("--n_texts", type=int, default=384, help="held-out windows per split, each evaluation")
    parser.add_argument("--compile_arm", action="store_true", help="a third arm: today's trial with --compile")
    args = parser.parse_args()
    if args.trials:
        trials_table(args)
    if not args.reps:
        return
    variants = {"as shipped (seed.decoder_loss, eager)": frozen_step(seed.decoder_loss),
                "--compile (run.speed.fused(seed.decoder_loss))": frozen_step(run.speed.fused(seed.decoder_loss,
                                                                                  argparse.Namespace(compile=True))),
                "logits kept in bf16 (no fp32 copy)": frozen_step(bf16_logits_loss),
                "128 positions at a time, checkpointed (seed.chunked_decoder_loss)": frozen_step(chunked(128)),
                "512 positions at a time, checkpointed": frozen_step(chunked(512))}
    first, times, losses = {}, {k: [] for k in variants}, {}
    for name, step in variants.items():
        t0 = time.perf_counter()
        losses[name] = step(rng_seed=1)
        first[name] = time.perf_counter() - t0
        step()
    for _ in range(args.reps):
        for name, step in variants.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    base = np.median(times[next(iter(variants))])
    print(f"\n| frozen SEED step, 16 x 128, 6x384 sizes | ms/step (median of {args.reps}) | first step s | speed vs as "
          f"shipped | first loss |\n|---|---|---|---|---|")
    for name in variants:
        ms = 1000 * np.median(times[name])
        print(f"| {name} | {ms:,.0f} | {first[name]:.1f} | {1000 * base / ms:.2f}x | {losses[name]:.6f} |", flush=True)
    print("\n| step phase, median of the timed steps | " + " | ".join(PHASES) + " |\n|---|" + "---|" * len(PHASES))
    for name, step in variants.items():
        phases = np.median(np.array(step.phases[2:]), axis=0)                       # the timed steps'
        print(f"| {name} | " + " | ".join(f"{1000 * t:,.0f} ms ({t / phases.sum():.0%})" for t in phases) + " |")
    step = frozen_step(seed.decoder_loss)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in ops) or 1
    share = dict.fromkeys([g for g, _ in OP_GROUPS] + ["elementwise and other"], 0.0)
    for name, t in ops:
        share[op_group(name)] += t / total
    print("\nThe as-shipped step's self time by op kind (torch.profiler, 2 steps): " +
          ", ".join(f"{g} {v:.0%}" for g, v in share.items()) + "; top 5 ops: " +
          ", ".join(f"{n.split('::')[-1]} {t / total:.0%}" for n, t in sorted(ops, key=lambda o: -o[1])[:5]))


if __name__ == "__main__":
    with benchmark.recorded(Path(__file__).with_suffix(".md")):
        main()
