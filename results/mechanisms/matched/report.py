"""The matched round's table.md and figure from its rows, judged by plan.md's JSON block (its arms, gates, tests,
family and seeds are read from there). It trains and measures nothing: on a clone with the rows committed it
reprints the same files. Its statistics are the confirmatory round's report.py's (imported from there).

    python results/mechanisms/matched/report.py results/mechanisms/matched

Rows made under another plan, and a seed whose two arms did not train on the same windows in the same order, are
refused in one line."""
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np


def _confirm_report():   # the confirmatory round's plan reading, binding, gates and paired tests
    path = Path(__file__).resolve().parent.parent / "confirm" / "report.py"
    spec = importlib.util.spec_from_file_location("mechanisms_confirm_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIRM = _confirm_report()
FIRST, PlanError, fmt = CONFIRM.FIRST, CONFIRM.PlanError, CONFIRM.fmt


def expected_rows(spec):
    """Every row the plan asks for, as paths under rows/: each arm at each seed."""
    return [where["row"].format(seed=s) + ".json" for where in spec["arms"].values() for s in spec["seeds"]]


def missing_rows(folder, spec):
    return sum(not (Path(folder) / "rows" / path).is_file() for path in expected_rows(spec))


def windows_by_seed(folder, spec):
    """{seed: {arm: what the trial trained on}} (distinct windows, batches' sha256); PlanError where a seed's two
    arms differ: the plan's control must see the CL arm's windows in its order."""
    out = {}
    for arm in spec["arms"]:
        for seed, row in CONFIRM.arm_rows(folder, spec, arm, "").items():
            out.setdefault(seed, {})[arm] = row["curve"][-1].get("windows")
    for seed, arms in out.items():
        if len(arms) == len(spec["arms"]) and len({str(w) for w in arms.values()}) != 1:
            raise PlanError(f"{folder}/rows: seed {seed}: the arms trained on different windows ({arms}): not the "
                            f"plan's matched control")
    return out


def combined_lines(results, spec, confirm_table):
    """One line per CPDAE claim for the README: this round's test with the confirmatory round's it combines with."""
    by_id = {r["test"]["id"]: r for r in results}
    lines = []
    for claim, ids in spec["combined_with_confirm"].items():
        here = by_id[ids["here"]]
        before = confirm_table.get(ids["confirm"], "-")
        if here["verdict"].startswith("pending"):
            word = "pending"
        else:
            word = "shown" if before == "shown" and here["verdict"] == "shown" else "not shown"
        lines.append(f"- CPDAE 3.3, {claim}: **{word}**; the confirmatory round's test {ids['confirm']} (CL - no CL): "
                     f"{before}; the matched round's test {ids['here']} ({here['test']['what']}, replacing the "
                     f"confirmatory round's test {here['test']['replaces']}): {here['verdict']}, "
                     + (FIRST.interval(here["diffs"]) if len(here["diffs"]) else "-")
                     + f" (matched round, seeds {spec['seeds'][0]}-{spec['seeds'][-1]}, {spec['test_split']} split; "
                       f"mean [two-sided 95 % t interval])")
    return lines


def confirm_verdicts(folder):
    """{test id: verdict} of the confirmatory round, judged by its own report from its own rows."""
    confirm = Path(folder).resolve().parent / "confirm"
    spec, sha = CONFIRM.read_plan(confirm)
    CONFIRM.check_binding(confirm, sha)
    return {r["test"]["id"]: r["verdict"] for r in CONFIRM.judge(confirm, spec)[0]}


def table(folder, spec, sha, made_under):
    """table.md's text."""
    results, gate_rows = CONFIRM.judge(folder, spec)
    windows = windows_by_seed(folder, spec)
    n, alpha, family = len(spec["seeds"]), spec["alpha"], len(spec["tests"])
    strict, loose = (FIRST.detectable(n, 1.0, a, spec["power"]) for a in (alpha / family, alpha))
    commit = CONFIRM.first_commit(Path(folder) / "plan.md")
    lines = ["# Mechanisms, the matched round: CPDAE's CL arm against a control on the same windows", "",
             f"Written by `python results/mechanisms/matched/report.py results/mechanisms/matched` from `rows/`, which "
             f"`bash results/mechanisms/matched/make.sh` wrote. The gates, tests and family are [plan.md](plan.md)'s "
             f"JSON block, read by this script: plan.md sha256 `{sha}`" + (f", committed in {commit} before any of "
             "this round's code or rows" if commit else "") + "; the rows were made under "
             + ("the same plan (rows/PLAN.sha256)." if made_under else "no plan yet (no rows)."),
             f"Seeds {', '.join(map(str, spec['seeds']))}; a difference is arm - ablation, paired by seed.", "",
             (f"## The family ({spec['test_split']} split; one-sided paired t-tests over the seeds; Holm-Bonferroni "
              f"over these {family} only)"), "",
             ("| # | replaces the confirmatory round's test | measure | difference, mean ± sd | two-sided 95 % t "
              "interval | seeds in the claimed direction | p | Holm p | smallest detectable (Holm's strictest; 0.05) "
              "| verdict |"), "|---" * 10 + "|"]
    for r in results:
        t, d = r["test"], r["diffs"]
        pending = r["state"] == "pending"   # no interim look: nothing of a test is printed before its rows are in
        sd = float(d.std(ddof=1)) if len(d) > 1 else None
        after = "-" if sd is None or pending else f"{strict * sd:.2g}; {loose * sd:.2g}"
        right = "-" if pending else int(np.sum(d > 0 if t["direction"] == ">" else d < 0))
        lines.append(f"| {t['id']} | {t['replaces']} | {t['what']} ({t['direction']} 0) | "
                     f"{'-' if pending else FIRST.mean_sd(d)} | {'-' if pending else FIRST.interval(d)} | {right} of "
                     f"{len(d)} | {'-' if pending else fmt(r['p'])} | {fmt(r['holm'])} | {strict:.2f} sd / {after} "
                     f"| **{r['verdict']}** |")
    lines += ["", "## The claims, with the confirmatory round's tests they combine with (plan.md)", "",
              *combined_lines(results, spec, confirm_verdicts(folder))]
    lines += ["", f"## The gates ({spec['gate_split']} split; mean over the seeds in)", "",
              "| gate | seeds | value | threshold | holds |", "|---|---|---|---|---|"]
    for gate, seeds, mean, holds in gate_rows:
        word = "-" if holds is None else "yes" if holds else "**no**"
        lines.append(f"| {gate['what']} | {seeds} of {n} | {fmt(mean)} | {gate['op']} {gate['threshold']} | {word} |")
    lines += ["", "## What each arm trained on (each row's record)", "",
              "| seed | " + " | ".join(f"{arm}: distinct windows of the training set" for arm in spec["arms"])
              + " | the same batches in the same order (sha256 of the sequence) |", "|---" * (len(spec["arms"]) + 2) + "|"]
    for seed in sorted(windows):
        arms = windows[seed]
        cells = [f"{arms[a]['distinct']:,} of {arms[a]['of']:,}" if arms.get(a) else "-" for a in spec["arms"]]
        same = "yes, " + next(iter(arms.values()))["batches_sha256"][:12] if len(arms) == len(spec["arms"]) else "-"
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {same} |")
    missing = missing_rows(folder, spec)
    if missing:   # no interim look at the test split
        return "\n".join(lines + ["", f"## Exploratory: printed once every row is in ({missing} to go)"]) + "\n"
    lines += ["", "## Exploratory (not corrected, never a verdict)", "",
              (f"Across texts: the per-text difference averaged over the seeds, one-sided Wilcoxon signed-rank test "
               f"over the {spec['test_split']} texts (they share the decoders: not independent draws of the claim)."),
              "", "| # | mean per-text difference | texts | p |", "|---|---|---|---|"]
    for r in results:
        across = CONFIRM.per_text_test(folder, spec, r["test"])
        if across:
            lines.append(f"| {r['test']['id']} | {across[0]:.4g} | {across[1]} | {across[2]:.4g} |")
    keys = ("auc_text", "auc_common", "rec", "cl", "cl_acc", "cl_chance", "entropy", "common", "representative")
    lines += ["", f"Each arm on the {spec['test_split']} split (mean ± sd over the seeds):", "",
              "| arm | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for arm in spec["arms"]:
        cells = [FIRST.mean_sd(CONFIRM.term_values(folder, spec, f"{arm}:{k}", spec["test_split"]).values()) for k in keys]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def draw_arms(folder, spec, path, plt):
    """Each seed's auc_text and auc_common, CL beside the matched control, a line joining a seed's pair."""
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    arms = list(spec["arms"])
    for ax, key in zip(axes, ("auc_text", "auc_common")):
        values = [CONFIRM.term_values(folder, spec, f"{arm}:{key}", spec["test_split"]) for arm in arms]
        for seed in spec["seeds"]:
            if all(seed in v for v in values):
                ax.plot(range(len(arms)), [v[seed] for v in values], marker="o", label=f"seed {seed}")
        ax.set_xticks(range(len(arms)), ["CL", "matched control"])
        ax.set_xlim(-0.4, len(arms) - 0.6)
        ax.set_title(f"{key} (test texts; claim: CL above)", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle("CPDAE 3.3, MiniLM frozen, step 600, lambda 0.003: the same windows, another positive", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(folder, argv=()):
    try:
        spec, sha = CONFIRM.read_plan(folder)
        made_under = CONFIRM.check_binding(folder, sha)
        windows_by_seed(folder, spec)
        if "--check" in argv:   # make.sh: the plan parses and binds the rows so far
            return 0
        if "--missing" in argv:   # make.sh: how many of the plan's rows are not there yet
            print(missing_rows(folder, spec))
            return 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            text = table(folder, spec, sha, made_under)
    except PlanError as error:
        print(error, file=sys.stderr)
        return 1
    (Path(folder) / "table.md").write_text(text)
    if made_under and not missing_rows(folder, spec):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        draw_arms(folder, spec, Path(folder) / "cpdae_matched.png", plt)
    print(f"{Path(folder) / 'table.md'} written")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python results/mechanisms/matched/report.py results/mechanisms/matched [--check | --missing]")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
