"""The from-scratch regime's tables and figures, from its rows (evaluate.py's JSON rows, one file a row), kept
as the record of the gates that failed there (docs/mechanisms.md); make.sh at its commits (6f305f5, eae4f19) wrote
the rows, from a 2-layer BERT trained from scratch; the measurements are research/mechanisms.py's now.

    python results/mechanisms/from-scratch/report.py results/mechanisms/from-scratch

Reads {folder}/rows/*.json, writes {folder}/table.md and the figures beside it; it trains and measures
nothing, so on a fresh clone it reprints the committed table.md exactly (and the figures, byte for byte
with the same matplotlib and FreeType). A claim is "shown" when its difference with the ablation, paired
by seed, has the claimed sign in every seed and a one-sided paired t-test over the seeds gives p < 0.05:
the rule fixed before any claim was measured (docs/mechanisms.md).
"""
import json
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy import stats

OWN_HEAD = {   # each arm's own objective: the accuracy its head is judged by, and that head's loss
    "costa": ("gwc_acc", "gwc_chance", "gwc"), "mlm": ("mlm_acc", "mlm_chance", "mlm"),
    "seed-weak": ("dec_acc", "dec_chance", "dec"), "seed-strong": ("dec_acc", "dec_chance", "dec"),
    "cpdae-cl": ("cl_acc", "cl_chance", "rec"), "cpdae-nocl": (None, None, "rec")}
ARMS = list(OWN_HEAD)


def load_rows(folder):
    """{measure: {(arm, seed, step or None): row}} of every row file."""
    rows = defaultdict(dict)
    for path in sorted(Path(folder, "rows").glob("*.json")):
        row = json.loads(path.read_text())
        rows[row["measure"]][row["arm"], row["seed"], row.get("step")] = row
    return rows


def by_seed(rows, arm, key, step=None):
    """{seed: row[key]} of one arm (heads rows at `step`)."""
    return {s: r[key] for (a, s, st), r in sorted(rows.items()) if a == arm and st == step}


def mean_sd(values):
    values = np.asarray(list(values), dtype=float)
    sd = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.4g} ± {sd if sd > 1e-12 * abs(values.mean()) else 0:.2g}"   # equal values: sd 0, not 4e-18


def difference(rows, arm, ablation, key, sign):
    """The claim's difference arm - ablation, paired by seed, with the claimed sign (+1: arm above, -1:
    below): its mean ± sd, the seeds that agree, the one-sided paired t-test's p and the verdict."""
    a, b = by_seed(rows, arm, key), by_seed(rows, ablation, key)
    diffs = np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])
    agree = int(sum(np.sign(diffs) == sign))
    with warnings.catch_warnings():   # differences all alike (a claim that does not act): p is nan, "not shown"
        warnings.simplefilter("ignore", RuntimeWarning)
        p = stats.ttest_1samp(diffs, 0.0, alternative="greater" if sign > 0 else "less").pvalue if len(diffs) > 1 else np.nan
    verdict = "shown" if agree == len(diffs) > 1 and p < 0.05 else "not shown"
    return (f"{mean_sd(diffs)}; {agree} of {len(diffs)} seeds {'>' if sign > 0 else '<'} 0, one-sided paired "
            f"t-test p = {p:.3g}: **{verdict}**")


def heads_table(rows, steps):
    header = (f"| arm | own head: accuracy / loss | held-out accuracy at step {steps} | its chance | held-out loss | "
              "MLM accuracy | MLM chance |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        acc, chance, loss = OWN_HEAD[arm]
        cells = [mean_sd(by_seed(rows, arm, k, steps).values()) if k else "-" for k in (acc, chance, loss)]
        cells += [mean_sd(by_seed(rows, arm, k, steps).values()) for k in ("mlm_acc", "mlm_chance")]
        lines.append(f"| {arm} | {acc or '-'} / {loss} | " + " | ".join(cells) + " |")
    return lines


def cpdae_section(ws, end, steps):
    lines = ["## CPDAE section 3.3: z~ on common words and on the text's own words (`word_shares-*`)", "",
             "| arm | common | uniform | representative | uniform |", "|---|---|---|---|---|"]
    for arm in ("cpdae-cl", "cpdae-nocl"):
        keys = ("common", "common_uniform", "representative", "representative_uniform")
        lines.append(f"| {arm} | " + " | ".join(mean_sd(by_seed(ws, arm, k).values()) for k in keys) + " |")
    common = difference(ws, "cpdae-cl", "cpdae-nocl", "common", -1)
    representative = difference(ws, "cpdae-cl", "cpdae-nocl", "representative", +1)
    cl, chance = by_seed(end, "cpdae-cl", "cl", steps).values(), by_seed(end, "cpdae-cl", "cl_chance", steps).values()
    blind = (f"- L_CL of cpdae-cl on the held-out windows at step {steps}: {mean_sd(cl)}; a loss blind to which "
             f"view is which: ln(2m - 1) = {np.log(1 / np.mean(list(chance))):.4f}")
    return lines + ["", f"- common, CL on - off (claimed < 0): {common}",
                    f"- representative, CL on - off (claimed > 0): {representative}", blind, ""]


def seed_section(dr, end, steps):
    lines = ["## SEED-Encoder sections 3.2-3.4: does the decoder read h0? (`decoder_reliance-*`)", "",
             ("| arm | loss, own h0 | loss, another text's h0 | gap (nats/token) | cos(state, h0) at t=1 | at the last t "
             "| mean over t |"), "|---|---|---|---|---|---|---|"]
    for arm in ("seed-weak", "seed-strong"):
        curves = by_seed(dr, arm, "cosine_by_position").values()
        cells = [mean_sd(by_seed(dr, arm, k).values()) for k in ("loss_own", "loss_other", "gap")]
        cells += [mean_sd(c[1] for c in curves), mean_sd(c[-1] for c in curves), mean_sd(np.mean(c) for c in curves)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    figure4 = {k: {"cosine": np.mean(r["cosine_by_position"])} for k, r in dr.items()}
    lines += ["", f"- gap, weak - strong (claimed > 0): {difference(dr, 'seed-weak', 'seed-strong', 'gap', +1)}",
              (f"- Figure 4, cos(state, h0) over t, weak - strong (claimed > 0): "
              f"{difference(figure4, 'seed-weak', 'seed-strong', 'cosine', +1)}"), "",
              "Figure 5, random held-out pairs' cosine of the trained vector by length (`heads-*`):", ""]
    lengths = sorted(next(iter(end.values()))["cosine_by_length"], key=int)
    lines += ["| arm | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for arm in ARMS:
        curves = list(by_seed(end, arm, "cosine_by_length", steps).values())
        lines.append(f"| {arm} | " + " | ".join(mean_sd(c[n] for c in curves) for n in lengths) + " |")
    longest = longest_cosine(end)
    for ablation, name in (("seed-strong", "strong"), ("mlm", "MLM-only")):
        lines.append(f"- cosine at {lengths[-1]} tokens, weak - {name} (claimed < 0): "
                     f"{difference(longest, 'seed-weak', ablation, 'cosine', -1)}")
    return lines + [""]


def costa_section(di, end):
    lines = ["## COSTA section 5.4: relevant documents near, the rest away (`discrimination-*`, SciFact test)", "",
             "| arm | AUC (relevant closer than another BM25 top-100 candidate) | margin (sd) | queries |",
             "|---|---|---|---|"]
    for arm in ("costa", "mlm", "seed-weak"):
        cells = [mean_sd(by_seed(di, arm, k).values()) for k in ("auc", "margin")]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {sorted(set(by_seed(di, arm, 'n_queries').values()))} |")
    lines.append("")
    for key in ("auc", "margin"):
        for ablation, name in (("mlm", "MLM-only"), ("seed-weak", "SEED")):
            lines.append(f"- {key}, COSTA - {name} (claimed > 0): {difference(di, 'costa', ablation, key, +1)}")
    longest = longest_cosine(end)
    length = next(iter(end.values()))["cosine_by_length"]
    for ablation, name in (("mlm", "MLM-only"), ("seed-weak", "SEED")):   # "the rest spread away": Figure 5's curve
        lines.append(f"- random held-out pairs' cosine at {max(length, key=int)} tokens, COSTA - {name} (claimed < 0): "
                     f"{difference(longest, 'costa', ablation, 'cosine', -1)}")
    return lines + [""]


def longest_cosine(end):
    """{(arm, seed, None): {"cosine": the random-pair cosine at the longest length}} of the end-of-run heads rows."""
    return {(a, s, None): {"cosine": r["cosine_by_length"][max(r["cosine_by_length"], key=int)]}
            for (a, s, _), r in end.items()}


def pilot_table(rows, seed, end):
    """Seed `seed`'s heads by step, and in the last column the same arm run for twice the steps (ARM-x2)."""
    steps = sorted({st for (a, s, st) in rows if s == seed and a in ARMS})
    lines = ["| arm | measure | " + " | ".join(f"step {st}" for st in steps) + f" | run of {2 * end} steps, its end |",
             "|---|---|" + "---|" * (len(steps) + 1)]
    for arm in ARMS:
        for key in dict.fromkeys([k for k in OWN_HEAD[arm] if k] + ["mlm_acc"]):
            values = [rows.get((arm, seed, st), {}).get(key) for st in steps]
            values.append(rows.get((f"{arm}-x2", seed, 2 * end), {}).get(key))
            lines.append(f"| {arm} | {key} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in values) + " |")
    return lines, steps


CPDAE_PILOT = {"cpdae-paper": "(the paper's: --cl_tau 1, --rec_reduction sum)", "cpdae-tau0.02": "--cl_tau 0.02",
               "cpdae-mean-tau0.02": "--rec_reduction mean --cl_tau 0.02"}


def cpdae_pilot_table(rows, seed, steps):
    """CPDAE's pilot: each variant's heads on the held-out windows at the end; make.sh takes the variant
    with the most accurate CL head for the cpdae-cl and cpdae-nocl arms."""
    ends = {v: rows[v, seed, steps] for v in CPDAE_PILOT if (v, seed, steps) in rows}
    if not ends:
        return []
    chosen = max(ends, key=lambda v: ends[v]["cl_acc"])
    lines = [f"## CPDAE's pilot: seed {seed}, {steps} steps, heads on the held-out windows (`heads-cpdae-*-seed{seed}`)",
             "", "| variant | flags | cl_acc | cl_chance | L_CL | L_REC | MLM accuracy |", "|---|---|---|---|---|---|---|"]
    for v, r in ends.items():
        lines.append(f"| {v}{' (chosen)' if v == chosen else ''} | {CPDAE_PILOT[v]} | {r['cl_acc']:.4f} | "
                     f"{r['cl_chance']:.4f} | {r['cl']:.4f} | {r['rec']:.4g} | {r['mlm_acc']:.4f} |")
    return lines + [""]


def twice_the_steps(rows, seed, steps):
    """The check of the budget: COSTA's and CPDAE's pairs at 2 x steps (seed `seed`), their heads and
    claims beside the same seed's at `steps`."""
    ws, di, heads = rows["word_shares"], rows["discrimination"], rows["heads"]
    if ("mlm-x2", seed, None) not in di:
        return []
    longest = lambda r: r["cosine_by_length"][max(r["cosine_by_length"], key=int)]
    checks = [(heads, "costa", "gwc_acc"), (heads, "costa", "mlm_acc"), (heads, "mlm", "mlm_acc"),
              (heads, "cpdae-cl", "cl_acc"), (heads, "cpdae-cl", "cl"), (heads, "cpdae-cl", "mlm_acc"),
              (heads, "cpdae-nocl", "mlm_acc"), (ws, "cpdae-cl", "common"), (ws, "cpdae-nocl", "common"),
              (ws, "cpdae-cl", "representative"), (ws, "cpdae-nocl", "representative"), (di, "costa", "auc"),
              (di, "mlm", "auc"), (di, "costa", "margin"), (di, "mlm", "margin"), (heads, "costa", longest),
              (heads, "mlm", longest)]
    lines = [f"## The check: the same seed at {steps} and at {2 * steps} steps (`*-x2-seed{seed}*`)", "",
             f"| arm: measure | at {steps} steps | at {2 * steps} steps |", "|---|---|---|"]
    for measure, arm, key in checks:
        at = (steps, 2 * steps) if measure is heads else (None, None)
        value = key if callable(key) else lambda r, key=key: r[key]
        name = "random pairs' cosine, longest" if callable(key) else key
        lines.append(f"| {arm}: {name} | {value(measure[arm, seed, at[0]]):.4g} | "
                     f"{value(measure[f'{arm}-x2', seed, at[1]]):.4g} |")
    return lines + [""]


def plot_pilot(rows, seed, steps, path):
    """Seed `seed`'s heads by step: each arm's own accuracy beside its chance (CPDAE's L_REC, both arms, on a
    second axis: without CL it has no accuracy), and as a star the end of the run of twice the steps."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("COSTA: GWC / MLM accuracy", ["costa", "mlm"]), ("SEED: decoder accuracy", ["seed-weak", "seed-strong"]),
              ("CPDAE: CL accuracy; L_REC (dashed, right axis)", ["cpdae-cl"])]
    for i, (ax, (title, arms)) in enumerate(zip(axes, panels)):
        for arm in arms:
            acc, chance, _ = OWN_HEAD[arm]
            curve(ax, rows, arm, seed, steps, acc, f"C{arms.index(arm)}", "-", f"{arm}: {acc}")
            curve(ax, rows, arm, seed, steps, chance, f"C{arms.index(arm)}", ":", f"{arm}: chance")
        if i == 2:
            right = ax.twinx()
            for j, arm in enumerate(["cpdae-cl", "cpdae-nocl"]):
                curve(right, rows, arm, seed, steps, "rec", f"C{j + 2}", "--", f"{arm}: L_REC")
            right.legend(fontsize=7, loc="center right")
        ax.set(title=title, xlabel="step")
        ax.legend(fontsize=7, loc="upper left")
    save(fig, path)


def curve(ax, rows, arm, seed, steps, key, color, style, label):
    """One arm's `key` by step, and (a star) its value at the end of the run of twice the steps."""
    ys = [rows[arm, seed, st][key] for st in steps if (arm, seed, st) in rows]
    ax.plot(steps[:len(ys)], ys, marker="o" if style == "-" else None, ls=style, color=color, label=label)
    if style != ":" and (f"{arm}-x2", seed, 2 * steps[-1]) in rows:
        ax.plot([2 * steps[-1]], [rows[f"{arm}-x2", seed, 2 * steps[-1]][key]], marker="*", ms=12, ls="", color=color,
                label=f"{arm}: run of {2 * steps[-1]} steps, end")


def plot_claims(rows, path):
    """One figure, the three claims side by side, each arm's seeds as dots and the mean as a bar."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    panels = [("CPDAE 3.3: z~ on common words", "word_shares", ["cpdae-cl", "cpdae-nocl"], "common", "common_uniform"),
              ("CPDAE 3.3: z~ on the text's own words", "word_shares", ["cpdae-cl", "cpdae-nocl"], "representative",
               "representative_uniform"),
              ("SEED 3.2: decoder loss, other h0 - own (nats)", "decoder_reliance", ["seed-weak", "seed-strong"], "gap",
               None),
              ("COSTA 5.4: relevant closer (AUC, BM25 top 100)", "discrimination", ["costa", "mlm", "seed-weak"], "auc",
               None),
              ("COSTA 5.4: margin (sd of the others)", "discrimination", ["costa", "mlm", "seed-weak"], "margin", None)]
    for ax, (title, measure, arms, key, uniform) in zip(axes, panels):
        for i, arm in enumerate(arms):
            values = list(by_seed(rows[measure], arm, key).values())
            ax.bar(i, np.mean(values), color=f"C{i}", alpha=0.5)
            ax.scatter([i] * len(values), values, color=f"C{i}", zorder=3)
            if uniform:
                ax.hlines(np.mean(list(by_seed(rows[measure], arm, uniform).values())), i - 0.4, i + 0.4,
                          colors="k", linestyles=":", label="uniform z~" if i == 0 else None)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(title, fontsize=9)
        if uniform:
            ax.legend(fontsize=7)
    save(fig, path)


def plot_seed_figures(rows, end, steps, path):
    """SEED-Encoder Figures 4 and 5, the mean over seeds: the decoder's states against h0 by position
    (weak against strong), and random pairs' cosine by length (weak, strong, MLM-only) on held-out texts."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for arm in ("seed-weak", "seed-strong"):
        curves = list(by_seed(rows["decoder_reliance"], arm, "cosine_by_position").values())
        n = min(len(c) for c in curves)
        left.plot(range(n), np.mean([c[:n] for c in curves], axis=0), label=arm)
    left.set(title="Figure 4: cos(decoder state at position t, h0)", xlabel="position t", ylabel="mean cosine")
    left.legend()
    for arm in ("seed-weak", "seed-strong", "mlm"):
        curves = list(by_seed(end, arm, "cosine_by_length", steps).values())
        lengths = sorted(curves[0], key=int)
        right.plot([int(n) for n in lengths], [np.mean([c[n] for c in curves]) for n in lengths], marker="o", label=arm)
    right.set(title="Figure 5: cosine of random held-out pairs by length", xlabel="tokens", ylabel="mean cosine")
    right.legend()
    save(fig, path)


def save(fig, path):
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def main(folder):
    import matplotlib

    matplotlib.use("Agg")
    folder = Path(folder)
    rows = load_rows(folder)
    steps = max(st for (a, _, st) in rows["heads"] if a in ARMS)
    seeds = sorted({s for (a, s, st) in rows["heads"] if st == steps and a in ARMS})
    end = {k: r for k, r in rows["heads"].items() if k[2] == steps and k[0] in ARMS}
    pilot_lines, pilot_steps = pilot_table(rows["heads"], seeds[0], steps)
    commits = sorted({r["commit"][:7] + (" (dirty)" if r["dirty"] else "") for m in rows.values() for r in m.values()})
    written = (f"Written by `python results/mechanisms/from-scratch/report.py results/mechanisms/from-scratch` from "
               f"`rows/`, which `bash results/mechanisms/make.sh` wrote at the commits below (each row holds its own `command`; code: {', '.join(commits)}).")
    out = [f"# Mechanisms: each claim against its own ablation ({len(seeds)} seeds, {steps} steps)", "", written,
           "Values: mean ± sd over the seeds. Differences are paired by seed: arm - ablation.", "",
           "## Each arm's own head on the held-out windows at the end (`heads-*`)", "", *heads_table(end, steps), "",
           *cpdae_section(rows["word_shares"], end, steps), *seed_section(rows["decoder_reliance"], end, steps),
           *costa_section(rows["discrimination"], end),
           f"## The pilot: seed {seeds[0]}'s heads on the held-out windows by step (`heads-*-seed{seeds[0]}-step*`)", "",
           *pilot_lines, "", *cpdae_pilot_table(rows["heads"], seeds[0], steps), *twice_the_steps(rows, seeds[0], steps)]
    (folder / "table.md").write_text("\n".join(out))
    plot_claims(rows, folder / "claims.png")
    plot_seed_figures(rows, end, steps, folder / "seed_figures.png")
    plot_pilot(rows["heads"], seeds[0], pilot_steps, folder / "pilot.png")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
