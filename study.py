"""The study: SEED-Encoder, CPDAE and COSTA compared at an equal budget, as a results section.

Every arm starts from the same checkpoint (--init), continues pre-training on the same corpus for the
same number of steps (the same batch and window length, so the same corpus tokens), and is fine-tuned
identically by finetune.py; "none" fine-tunes the checkpoint directly and "mlm" is costa.py with
--gwc_weight 0 (the papers' BERT baseline). Each seed varies pre-training (masks, spans, data order)
and fine-tuning (order, negatives). Then the low-resource curve (CPDAE Table 3, COSTA Figure 4):
fine-tuning on a few training queries, for "none", "mlm" and the best method.

    python study.py                                    # everything, resumable: rerun to continue
    python study.py --seeds 0 --low_resource ""        # one seed, no curve
    python study.py --pretrain_steps 400 --finetune_args "--epochs 3"

Outputs in out_dir: one folder per run (pre-training, fine-tuning, evaluation), results.jsonl (one
line per finished run, written as soon as it finishes: a killed study continues from it), table.md,
bars.png, low_resource.png and (with the cpdae arm) cpdae_gradients.md: each term of CPDAE's eq. 6 and
the gradient norm it sends into the encoder, at the start and after pre-training.
"""
import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import data
import evaluate
import finetune


@dataclass
class Config:
    init: str = "minilm"          # the starting checkpoint of every arm (folder, hub id or "minilm")
    arms: str = "none,mlm,seed,cpdae,costa"  # none = no continued pre-training; mlm = costa.py --gwc_weight 0
    seeds: str = "0,1,2"          # one run per arm and seed
    pretrain_steps: int = 50      # continued pre-training steps of every method (batch 32 x 128 tokens each; 2 h in all on 2 cores)
    pretrain_args: str = ""       # more flags for every pre-training script, e.g. "--batch_size 16"
    finetune_args: str = ""       # more flags for every fine-tuning, e.g. "--epochs 3"
    low_resource: str = "50,100,200"  # training-query counts of the curve ("" = no curve); all 809 = the seed runs
    samples: int = 3              # random query samples per count
    out_dir: str = "runs/study"   # runs, results.jsonl, table.md and the figures go here
    preset: str = ""              # (no preset; the shared parser knows this field)


FLAG_RULES = {"pretrain_steps": ">= 1", "samples": ">= 1", "arms": "names from {none, mlm, seed, cpdae, costa}"}
ARMS = {"none": None, "mlm": ("costa", "--gwc_weight 0"), "seed": ("seed", ""), "cpdae": ("cpdae", ""),
        "costa": ("costa", "")}
REPORTED = ("NDCG@10", "MRR@10", "Recall@100")


def numbers(text):
    return [int(x) for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------------------------
# Runs: one pre-training (unless "none") and one fine-tuning each, recorded in results.jsonl
# ----------------------------------------------------------------------------------------------
def finished_runs(path):
    return {r["key"]: r for r in map(json.loads, path.read_text().splitlines())} if path.is_file() else {}


def run_one(c, key, arm, seed, n_queries=0, init=""):
    """Pre-train (arm's method, unless init is given or the arm is "none"), fine-tune, evaluate.
    A run that did not finish before a crash starts again from scratch (--overwrite)."""
    folder = Path(c.out_dir) / key
    argv = ["--init", c.init, "--out_dir", str(folder), "--seed", str(seed), "--overwrite",
            "--n_queries", str(n_queries), "--pretrain_steps", str(c.pretrain_steps)] + shlex.split(c.finetune_args)
    fc = data.parse_config(finetune.Config, argv, "", finetune.PAPER_PRESET, finetune.FLAG_RULES)
    # Pooling and similarity come from the starting checkpoint (MiniLM: mean, cosine), for every arm: a
    # pre-trained folder declares none, and would otherwise fall back to the papers' [CLS] and dot product.
    fc = finetune.retriever_settings(dataclasses.replace(fc, init=data.resolve_model(fc.init)))
    if init:                                         # the curve: an arm's pre-trained encoder, or c.init
        fc = dataclasses.replace(fc, init=init)
    elif ARMS[arm]:
        method, args = ARMS[arm]
        fc = dataclasses.replace(fc, pretrain=method, pretrain_args=f"{args} {c.pretrain_args}")
        fc = dataclasses.replace(fc, init=finetune.pretrain(fc))
    means, _ = finetune.train(fc, name=key)
    _, queries, qrels = evaluate.load_split(fc, fc.train_split, fc.queries, fc.qrels)
    n_train = n_queries or sum(any(g > 0 for g in judged.values()) for judged in qrels.values())  # as finetune counts
    return {"key": key, "arm": arm, "seed": seed, "n_queries": n_queries, "n_train": n_train, "metrics": means,
            "per_query": str(folder / f"eval-{fc.eval_split}" / "metrics.json"),
            "pretrained": fc.init if ARMS[arm] else ""}


def run_all(c):
    """Every run the study needs, skipping those already in results.jsonl; returns them all."""
    path = Path(c.out_dir) / "results.jsonl"
    done = finished_runs(path)
    plan = [(f"{arm}/seed{s}", arm, s, 0, "") for arm in c.arms.split(",") for s in numbers(c.seeds)]
    for key, arm, seed, n, init in plan:
        if key not in done:
            done[key] = run_one(c, key, arm, seed, n, init)
            with open(path, "a", encoding="utf-8") as f:   # one line per finished run, at once
                f.write(json.dumps(done[key]) + "\n")
    if numbers(c.low_resource):
        for arm in curve_arms(c, done):
            pretrained = done[f"{arm}/seed{numbers(c.seeds)[0]}"]["pretrained"]
            for n in numbers(c.low_resource):
                for s in range(c.samples):
                    key = f"{arm}/n{n}/sample{s}"
                    if key not in done:
                        done[key] = run_one(c, key, arm, s, n, pretrained)
                        with open(path, "a", encoding="utf-8") as f:
                            f.write(json.dumps(done[key]) + "\n")
    return done


def curve_arms(c, done):
    """none, mlm and the method with the best mean nDCG@10 over the seeds (when they were run)."""
    methods = [a for a in c.arms.split(",") if a not in ("none", "mlm")]
    mean = lambda arm: np.mean([r["metrics"]["NDCG@10"] for r in done.values() if r["arm"] == arm and not r["n_queries"]])
    best = [max(methods, key=mean)] if methods else []
    return [a for a in ("none", "mlm") if a in c.arms.split(",")] + best


# ----------------------------------------------------------------------------------------------
# Why CPDAE does (not) help: the gradient each term of eq. 6 sends into the encoder
# ----------------------------------------------------------------------------------------------
def cpdae_gradient_norms(pretrain_folder, n_batches=4):
    """L2 norm of each term's gradient on the encoder's parameters (mean over n_batches training
    batches), at the start (the init checkpoint, new decoder) and after pre-training (state.pt)."""
    import cpdae
    c = cpdae.Config(**data.read_json(Path(pretrain_folder) / "config.json"))
    windows = cpdae.load_windows(c, 0)
    batches = cpdae.Batches(c, windows, windows.special, 0, 1)
    rows = {}
    for when in ("start", "after"):
        torch.manual_seed(c.seed)                                                # the same new decoder as the run's
        model = cpdae.PretrainModel(c, cpdae.Encoder.from_pretrained(c.init, c) if c.init else cpdae.Encoder(c))
        if when == "after":
            model.load_state_dict(data.load_training_state(Path(pretrain_folder) / "state.pt")["model"])
        params = [p for p in model.encoder.parameters() if p.requires_grad]
        norms = {}
        for i in range(n_batches):
            torch.manual_seed(data.step_seed(c.seed, 0, i))                      # dropout as in training
            for name, loss in model.terms(batches[i])[0].items():
                grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None))
                norms.setdefault(name, []).append((loss.item(), norm.item()))
        rows[when] = {name: np.mean(v, axis=0).tolist() for name, v in norms.items()}
    return rows


def format_gradient_norms(rows, steps):
    lines = ["| when | term | loss | gradient norm on the encoder |", "|---|---|---|---|"]
    for when, terms in rows.items():
        for name, (loss, norm) in terms.items():
            lines.append(f"| {'start' if when == 'start' else f'after {steps} steps'} | {name} | {loss:,.3f} | {norm:.4g} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Report: table with mean +- std over seeds and paired t-tests, figures
# ----------------------------------------------------------------------------------------------
def per_query_mean(runs):
    """Per-query metrics averaged over runs (seeds): the unit of the paired t-test is the query."""
    tables = [json.loads(Path(r["per_query"]).read_text())["per_query"] for r in runs]
    return {q: {m: float(np.mean([t[q][m] for t in tables])) for m in evaluate.METRICS} for q in tables[0]}


def report(c, done):
    arms = c.arms.split(",")
    seed_runs = {a: [r for r in done.values() if r["arm"] == a and not r["n_queries"]] for a in arms}
    averaged = {a: per_query_mean(runs) for a, runs in seed_runs.items()}
    lines = [f"| arm | {' | '.join(REPORTED)} | nDCG@10 p vs mlm | nDCG@10 p vs none |", "|---" * (len(REPORTED) + 3) + "|"]
    for a in arms:
        cells = [f"{np.mean(v):.4f} +- {np.std(v):.4f}" for v in
                 ([r["metrics"][m] for r in seed_runs[a]] for m in REPORTED)]
        tests = [evaluate.compare_per_query(averaged[a], averaged[b], ["NDCG@10"])["NDCG@10"]["p"]
                 if b in averaged and b != a else float("nan") for b in ("mlm", "none")]
        lines.append(f"| {a} | {' | '.join(cells)} | " + " | ".join("" if np.isnan(p) else f"{p:.3g}" for p in tests) + " |")
    table = "\n".join(lines)
    seeds = len(numbers(c.seeds))
    text = (f"{seeds} seeds, mean +- std over seeds; p: paired two-tailed t-test over the test queries of the "
            f"per-query metric averaged over seeds.\n\n{table}\n")
    data.atomic_write_text(Path(c.out_dir) / "table.md", text)
    print(text)
    plot_bars(seed_runs, Path(c.out_dir) / "bars.png")
    if "cpdae" in arms:
        folder = Path(seed_runs["cpdae"][0]["pretrained"]).parent
        norms = format_gradient_norms(cpdae_gradient_norms(folder), c.pretrain_steps)
        print(norms)
        data.atomic_write_text(Path(c.out_dir) / "cpdae_gradients.md", norms + "\n")
    curve = [r for r in done.values() if r["n_queries"]]
    if curve:
        plot_curve(curve, seed_runs, Path(c.out_dir) / "low_resource.png")


def plot_bars(seed_runs, path):
    plt = evaluate._pyplot()
    fig, axes = plt.subplots(1, len(REPORTED), figsize=(4 * len(REPORTED), 3.2))
    for ax, m in zip(axes, REPORTED):
        values = [[r["metrics"][m] for r in runs] for runs in seed_runs.values()]
        ax.bar(list(seed_runs), [np.mean(v) for v in values], yerr=[np.std(v) for v in values], capsize=4,
               color="#4c72b0")
        low = min(min(v) for v in values)
        ax.set_ylim(max(0.0, low - 0.05), None)
        ax.set_title(m)
    fig.suptitle("Continued pre-training, then fine-tuning (mean +- std over seeds)", y=1.04)
    evaluate._save_figure(fig, path)


def plot_curve(curve, seed_runs, path):
    plt = evaluate._pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for arm in dict.fromkeys(r["arm"] for r in curve):
        ns = sorted({r["n_queries"] for r in curve if r["arm"] == arm})
        values = [[r["metrics"]["NDCG@10"] for r in curve if r["arm"] == arm and r["n_queries"] == n] for n in ns]
        ns, values = ns + [seed_runs[arm][0]["n_train"]], values + [[r["metrics"]["NDCG@10"] for r in seed_runs[arm]]]
        ax.errorbar(ns, [np.mean(v) for v in values], yerr=[np.std(v) for v in values], marker="o", capsize=3, label=arm)
    ax.set_xscale("log")
    ticks = sorted({r["n_queries"] for r in curve} | {runs[0]["n_train"] for runs in seed_runs.values() if runs})
    ax.set_xticks(ticks, [str(n) for n in ticks])                 # the counts themselves, not 10^k labels
    ax.minorticks_off()
    ax.set_xlabel("training queries")
    ax.set_ylabel("nDCG@10")
    ax.legend()
    evaluate._save_figure(fig, path)


def main(argv):
    c = data.parse_config(Config, argv, __doc__, {}, FLAG_RULES)
    unknown = [a for a in c.arms.split(",") if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    report(c, run_all(c))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as e:   # data.DataError is one: bad input, one line
        data.exit_with(f"error: {e}", 1)
    except KeyboardInterrupt:
        data.exit_with("interrupted; the same command continues (finished runs are kept in results.jsonl)", 130)
