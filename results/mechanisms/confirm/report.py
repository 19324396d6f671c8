"""The confirmatory round's table.md and figures from its rows, judged by the plan that plan.md's JSON block states:
its arms' rows, gates, thresholds, tests, family and seeds are read from there, nothing of them is written here.
It trains and measures nothing, so on a clone with the rows committed it reprints the same files.

    python results/mechanisms/confirm/report.py results/mechanisms/confirm

Rows made under another plan (rows/PLAN.sha256, which make.sh writes before its first row, is not plan.md's
sha256: the plan was edited after its rows) are refused in one line, and so are rows without that stamp."""
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
from scipy import stats


def _first_round():   # the first round's statistics (paired t-test, Holm, noncentral-t detectable effect)
    path = Path(__file__).resolve().parent.parent / "report.py"
    spec = importlib.util.spec_from_file_location("mechanisms_first_round_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIRST = _first_round()
OPS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}


class PlanError(Exception):
    """plan.md or the rows' stamp does not allow a judgement; its message is the one line printed."""


AFTER_ROWS = b"\n## Corrections after the rows"   # what follows this heading in plan.md binds nothing


def read_plan(folder):
    """plan.md's JSON block (the plan that binds) and the sha256 of the plan's binding text: the file up to a
    heading "## Corrections after the rows", under which wording corrections are appended once rows exist
    (they change no gate, test or threshold: the JSON block sits above it). -> (spec, sha256 hex)."""
    path = Path(folder) / "plan.md"
    if not path.is_file():
        raise PlanError(f"{path}: no plan")
    text = path.read_bytes().split(AFTER_ROWS)[0]
    block = re.search(r"```json\n(.*?)\n```", text.decode("utf-8"), re.DOTALL)
    if not block:
        raise PlanError(f"{path}: no ```json block (the plan that binds)")
    try:
        spec = json.loads(block.group(1))
    except json.JSONDecodeError as error:
        raise PlanError(f"{path}: its JSON block does not parse ({error})") from None
    return spec, hashlib.sha256(text).hexdigest()


def check_binding(folder, sha):
    """The rows' stamp against the plan: None without rows; else raises PlanError unless rows/PLAN.sha256 is
    plan.md's sha256 (make.sh writes it before the first row)."""
    rows = Path(folder) / "rows"
    made = sorted(rows.rglob("*.json")) if rows.is_dir() else []
    stamp = rows / "PLAN.sha256"
    if not made:
        return None
    if not stamp.is_file():
        raise PlanError(f"{rows}: {len(made)} rows but no PLAN.sha256: not made by make.sh under this plan")
    made_under = stamp.read_text().split()[0]
    if made_under != sha:
        raise PlanError(f"{Path(folder) / 'plan.md'}: edited after its rows (sha256 {sha[:12]}, the rows were made "
                        f"under {made_under[:12]}): restore the plan they were made under, or start a new round")
    return made_under


def arm_rows(folder, spec, arm, split):
    """{seed: row} of the plan's seeds whose row of `arm` (on `split` for a --heads row) is there."""
    pattern = spec["arms"][arm]["row"]
    out = {}
    for seed in spec["seeds"]:
        path = Path(folder) / "rows" / (pattern.format(seed=seed, split=split) + ".json")
        if path.is_file():
            out[seed] = json.loads(path.read_text())
    return out


def expected_rows(spec):
    """Every row the plan asks for, as paths under rows/: each arm at each planned seed (an arm that only the
    lambda series uses: at its seeds), a --heads arm on the gate split and the test split."""
    tested = {t[k] for t in spec["tests"] for k in ("arm", "ablation")}
    series_only = set(spec["lambda_series"]["arms"].values()) - tested
    paths = []
    for arm, where in spec["arms"].items():
        seeds = spec["lambda_series"]["seeds"] if arm in series_only else spec["seeds"]
        splits = (spec["gate_split"], spec["test_split"]) if "{split}" in where["row"] else ("",)
        paths += [where["row"].format(seed=s, split=split) + ".json" for s in seeds for split in splits]
    return paths


def lookup(row, key, split, step):
    """A row's number: a --frozen row's measure on `split` at `step` (else its setting), a --heads row's
    field (a dotted path: cosine_by_length.128). None when absent."""
    if "curve" in row:
        point = next((p for p in row["curve"] if p["step"] == step), None)
        if point is None:
            return None
        return point[split].get(key, row.get("settings", {}).get(key))
    value = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def term_values(folder, spec, term, split):
    """{seed: value} of "arm:key" over the seeds that have it, or of a number (every seed)."""
    if ":" not in term:
        return {s: float(term) for s in spec["seeds"]}
    arm, key = term.split(":", 1)
    rows = arm_rows(folder, spec, arm, split)
    return {s: float(v) for s, r in rows.items() if (v := lookup(r, key, split, spec["step"])) is not None}


def expression_values(folder, spec, expression, split):
    """{seed: value} of the plan's "A", "A / B", "A - B" or "A * B" (terms "arm:key" or numbers), per seed."""
    parts = expression.split()
    if len(parts) == 1:
        return term_values(folder, spec, parts[0], split)
    if len(parts) != 3 or parts[1] not in ("/", "-", "*"):
        raise PlanError(f"plan.md: '{expression}': a gate's value is 'A', 'A / B', 'A - B' or 'A * B'")
    a, b = term_values(folder, spec, parts[0], split), term_values(folder, spec, parts[2], split)
    op = {"/": np.divide, "-": np.subtract, "*": np.multiply}[parts[1]]
    return {s: float(op(a[s], b[s])) for s in sorted(set(a) & set(b))}


def gates(folder, spec):
    """Each of the plan's gates on its gate split: (gate, seeds in, mean over them, holds: None until every
    planned seed is in)."""
    out = []
    for gate in spec["gates"]:
        values = expression_values(folder, spec, gate["value"], spec["gate_split"])
        mean = float(np.mean(list(values.values()))) if values else None
        complete = len(values) == len(spec["seeds"])
        out.append((gate, len(values), mean, bool(OPS[gate["op"]](mean, gate["threshold"])) if complete else None))
    return out


def judge(folder, spec):
    """Each test of the family: its paired differences, p, Holm p and verdict. A test is judged only with every
    planned seed of both arms in and its claim's gates on them; a failed gate counts with p = 1; Holm's
    adjustment runs over the plan's tests only, once every one of them is settled."""
    gate_rows = gates(folder, spec)
    results = []
    for test in spec["tests"]:
        own = [g for g in gate_rows if g[0]["claim"] == test["claim"]]
        arm = term_values(folder, spec, f"{test['arm']}:{test['measure']}", spec["test_split"])
        ablation = term_values(folder, spec, f"{test['ablation']}:{test['measure']}", spec["test_split"])
        complete = len(set(arm) & set(ablation)) == len(spec["seeds"]) and all(g[3] is not None for g in own)
        failed = [g for g in own if g[3] is False]
        diffs, p = FIRST.paired_test(arm, ablation, 1 if test["direction"] == ">" else -1)
        state = "pending" if not complete else "gate" if failed else "judged"
        results.append({"test": test, "diffs": diffs, "p": 1.0 if state == "gate" else p, "state": state,
                        "failed": failed})
    settled = all(r["state"] != "pending" for r in results)
    adjusted = FIRST.holm([r["p"] for r in results]) if settled else [None] * len(results)
    for result, holm_p in zip(results, adjusted):
        result["holm"] = holm_p
        if result["state"] == "pending":
            result["verdict"] = "pending (not every planned seed or gate is in)"
        elif result["state"] == "gate":
            g = result["failed"][0]
            result["verdict"] = (f"not testable in this regime (gate: {g[0]['what']}: {g[2]:.4g}, needs "
                                 f"{g[0]['op']} {g[0]['threshold']})")
        elif holm_p is None:
            result["verdict"] = "pending (Holm's adjustment waits for the family's other tests)"
        else:
            result["verdict"] = "shown" if holm_p < spec["alpha"] else "not shown"
    return results, gate_rows


def per_text_test(folder, spec, test):
    """Exploratory: the per-text difference (arm - ablation), averaged over the seeds both arms have, and the
    one-sided Wilcoxon signed-rank p over the texts. -> (mean difference, n texts, p) or None."""
    if "per_text" not in test:
        return None
    split, key = spec["test_split"], test["per_text"]
    arm, ablation = (arm_rows(folder, spec, test[k], split) for k in ("arm", "ablation"))
    seeds = sorted(set(arm) & set(ablation))
    grids = [np.subtract(lookup(arm[s], key, split, spec["step"]), lookup(ablation[s], key, split, spec["step"]))
             for s in seeds if lookup(arm[s], key, split, spec["step"]) is not None]
    if not grids:
        return None
    diffs = np.nanmean(grids, axis=0)
    diffs = diffs[~np.isnan(diffs)]
    p = stats.wilcoxon(diffs, alternative="greater" if test["direction"] == ">" else "less").pvalue
    return float(diffs.mean()), len(diffs), float(p)


def first_sha(path, commit):
    """The sha256 of plan.md's binding text as `commit` held it (git), or None outside a clone."""
    try:
        out = subprocess.run(["git", "show", f"{commit}:./{Path(path).name}"], cwd=Path(path).parent,
                             capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return hashlib.sha256(out.stdout.split(AFTER_ROWS)[0]).hexdigest() if out.returncode == 0 else None


def plan_provenance(path, sha):
    """table.md's words on the plan's hash: the one the rows were made under, and its first commit's where the
    wording corrections made before any row changed it."""
    commit = first_commit(path)
    if not commit:
        return f"plan.md sha256 `{sha}`"
    first = first_sha(path, commit)
    if first in (None, sha):
        return f"plan.md sha256 `{sha}` (first commit {commit})"
    return (f"plan.md sha256 `{sha}`; its first commit {commit} held sha256 `{first[:12]}…`, and the wording "
            f"corrections appended before any row (its JSON block unchanged) made `{sha[:12]}…`")


def first_commit(path):
    """The short hash of the commit that added `path` (git), or None outside a clone."""
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "--", Path(path).name],
                             cwd=Path(path).parent, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[-1] if out.returncode == 0 and lines else None


def fmt(x):
    return "-" if x is None else f"{x:.4g}"


def claim_lines(results, spec):
    """One line per claim, for the README: its verdict, each test's effect with its 95 % interval, the round.
    A claim is a `shown_together` group of the plan, or a test of no group."""
    by_id = {r["test"]["id"]: r for r in results}
    grouped = {i for ids in spec.get("shown_together", {}).values() for i in ids}
    claims = [(name, ids) for name, ids in spec.get("shown_together", {}).items()]
    claims += [(r["test"]["what"], [r["test"]["id"]]) for r in results if r["test"]["id"] not in grouped]
    seeds = spec["seeds"]
    lines = []
    for name, ids in claims:
        verdicts = [by_id[i]["verdict"] for i in ids]
        word = ("shown" if all(v == "shown" for v in verdicts) else "pending" if any(v.startswith("pending")
                for v in verdicts) else verdicts[0] if len(ids) == 1 else "not shown")
        settled = word != "pending"   # no interim look: a claim's effects are printed once its tests are settled
        effects = "; ".join((f"test {i}, {by_id[i]['test']['what']}: " if len(ids) > 1 else f"test {i}: ")
                            + FIRST.interval(by_id[i]["diffs"]) for i in ids) if settled else "not every row is in"
        lines.append(f"- {by_id[ids[0]]['test']['paper']}, {name}: **{word}**; {effects} (confirmatory round, seeds "
                     f"{seeds[0]}-{seeds[-1]}, {spec['test_split']} split; mean [95 % t interval])")
    return lines


def table(folder, spec, sha, made_under):
    """table.md's text."""
    results, gate_rows = judge(folder, spec)
    n, alpha, family = len(spec["seeds"]), spec["alpha"], len(spec["tests"])
    strict, loose = (FIRST.detectable(n, 1.0, a, spec["power"]) for a in (alpha / family, alpha))
    lines = ["# Mechanisms, the confirmatory round: each claim under a plan fixed before its rows", "",
             "Written by `python results/mechanisms/confirm/report.py results/mechanisms/confirm` from `rows/`, which "
             "`bash results/mechanisms/confirm/make.sh` wrote. The gates, thresholds, tests and family are "
             "[plan.md](plan.md)'s JSON block, read by this script: "
             + plan_provenance(Path(folder) / "plan.md", sha) + "; the rows were made under "
             + ("the same plan (rows/PLAN.sha256)." if made_under else "no plan yet (no rows)."),
             (f"Seeds {', '.join(map(str, spec['seeds']))}; values: mean ± sd over them; a difference is arm - "
             f"ablation, paired by seed."), "",
             (f"## The primary tests ({spec['test_split']} split; one-sided paired t-tests over the seeds; "
             f"Holm-Bonferroni over these {family} only)"), "",
             ("| # | paper | measure | difference, mean ± sd [95 % t interval] | seeds | in the claimed direction | p | Holm p | smallest "
             "detectable, before (sd units) / after (Holm's strictest; 0.05) | verdict |"), "|---" * 10 + "|"]
    for r in results:
        t, d = r["test"], r["diffs"]
        sd = float(d.std(ddof=1)) if len(d) > 1 else None
        after = "-" if sd is None or r["state"] == "pending" else f"{strict * sd:.2g}; {loose * sd:.2g}"
        right = int(np.sum(d > 0 if t["direction"] == ">" else d < 0)) if len(d) else "-"
        pending = r["state"] == "pending"   # no interim look: nothing of a test is printed before its rows are in
        diff = "-" if pending or not len(d) else FIRST.mean_sd(d) + f" [{FIRST.interval(d).split('[')[1]}"
        right = "-" if pending else right
        lines.append(f"| {t['id']} | {t['paper']} | {t['what']} ({t['direction']} 0) | {diff} | {len(d)} | {right} | "
                     f"{fmt(r['p']) if r['state'] != 'pending' else '-'} | {fmt(r['holm'])} | {strict:.2f} sd / {after} | "
                     f"**{r['verdict']}** |")
    lines += ["", "Claims judged together (shown only if every one of their tests is):", ""]
    by_id = {r["test"]["id"]: r for r in results}
    for claim, ids in spec.get("shown_together", {}).items():
        verdicts = [by_id[i]["verdict"] for i in ids]
        word = "shown" if all(v == "shown" for v in verdicts) else "pending" if any(
            v.startswith("pending") for v in verdicts) else "not shown"
        lines.append(f"- {claim} (tests {', '.join(map(str, ids))}): **{word}**")
    lines += ["", "## One line per claim (the README quotes these)", "", *claim_lines(results, spec)]
    lines += ["", f"## The gates ({spec['gate_split']} split; mean over the seeds in)", "",
              "| claim | gate | seeds | value | threshold | holds |", "|---|---|---|---|---|---|"]
    for gate, seeds, mean, holds in gate_rows:
        word = "-" if holds is None else "yes" if holds else "**no**"
        lines.append(f"| {gate['claim']} | {gate['what']} | {seeds} of {n} | {fmt(mean)} | {gate['op']} "
                     f"{gate['threshold']} | {word} |")
    missing = sum(not (Path(folder) / "rows" / path).is_file() for path in expected_rows(spec))
    if missing:   # no interim look at the test split
        return "\n".join(lines + ["", f"## Exploratory: printed once every row is in ({missing} to go)"]) + "\n"
    lines += ["", "## Exploratory (not corrected, never a verdict)", "",
              (f"Across texts: the per-text difference averaged over the seeds, one-sided Wilcoxon signed-rank test "
              f"over the {spec['test_split']} texts (the texts share the decoders: not independent draws of the claim)."),
              "", "| # | mean per-text difference | texts | p |", "|---|---|---|---|"]
    for r in results:
        across = per_text_test(folder, spec, r["test"])
        if across:
            lines.append(f"| {r['test']['id']} | {across[0]:.4g} | {across[1]} | {across[2]:.4g} |")
    series = spec["lambda_series"]["seeds"]
    lines += ["", (f"CPDAE's lambda series (seeds {', '.join(map(str, series))}; eq. 4 averaged; lambda 0.003 "
                   "weighs L_CL about 900x the paper's weights against L_REC), beside the control arm. A point whose "
                   "decoder fails the plan's reconstruction gate (dev L_REC / the constant predictor's <= 0.99) is not "
                   "in the regime the claims are judged in:"), "",
              ("| lambda | seeds | dev L_REC / constant (gate <= 0.99) | auc_text | auc_common | common share | text's "
               "share | entropy | sum of sigmoids | L_REC |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for label, arm in [*spec["lambda_series"]["arms"].items(), ("control (0.003)", "cpdae-control")]:
        cells = [{s: v for s, v in term_values(folder, spec, f"{arm}:{k}", spec["test_split"]).items() if s in series}
                 for k in ("auc_text", "auc_common", "common", "representative", "entropy", "sigmoid_sum", "rec")]
        ratio = reconstruction_ratio(folder, spec, arm)
        gate = f"{ratio:.4g} ({'holds' if ratio <= RECONSTRUCTION_GATE else '**fails**'})"
        lines.append(f"| {label} | {len(cells[0])} | {gate} | " + " | ".join(FIRST.mean_sd(v.values()) for v in cells)
                     + " |")
    return "\n".join(lines) + "\n"


RECONSTRUCTION_GATE = 0.99   # the plan's CPDAE gate: dev L_REC / the constant predictor's


def reconstruction_ratio(folder, spec, arm):
    """The reconstruction gate's value for an arm of the lambda series: its dev L_REC / the constant predictor's,
    the mean over the series' seeds."""
    values = expression_values(folder, spec, f"{arm}:rec / {arm}:rec_constant", spec["gate_split"])
    return float(np.mean([v for s, v in values.items() if s in spec["lambda_series"]["seeds"]]))


def draw_lambda_series(folder, spec, path, plt):
    """The dose-response: each AUC against lambda (mean ± sd over the series' seeds), the control arm's and
    chance (0.5) as reference levels; a point whose decoder fails the reconstruction gate is drawn hollow."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key in zip(axes, ("auc_text", "auc_common")):
        xs, means, sds, fails = [], [], [], []
        for label, arm in spec["lambda_series"]["arms"].items():
            values = [v for s, v in term_values(folder, spec, f"{arm}:{key}", spec["test_split"]).items()
                      if s in spec["lambda_series"]["seeds"]]
            if values:
                xs.append(float(label) or 3e-4), means.append(np.mean(values)), sds.append(np.std(values))
                fails.append(reconstruction_ratio(folder, spec, arm) > RECONSTRUCTION_GATE)
        line = ax.errorbar(xs, means, yerr=sds, label="CL arm (lambda 0 drawn at 3e-4)")[0]
        for fail, label in ((False, "reconstruction gate holds"), (True, "fails it (dev L_REC / constant > 0.99)")):
            points = [i for i, f in enumerate(fails) if f == fail]
            if points:
                ax.plot([xs[i] for i in points], [means[i] for i in points], "o", color=line.get_color(),
                        markerfacecolor="white" if fail else line.get_color(), label=label)
        control = list(term_values(folder, spec, f"cpdae-control:{key}", spec["test_split"]).values())
        if control:
            ax.axhline(np.mean(control), color="grey", linestyle="--", label="control, lambda 0.003")
        ax.axhline(0.5, color="black", linewidth=0.5, label="chance")
        ax.set(xscale="log", xlabel="lambda (eq. 4 averaged; 0.003: ~900x the paper's pull)", ylabel=key)
        ax.legend(fontsize=7)
    fig.suptitle("CPDAE, MiniLM frozen: the text's words under z~ against lambda (test texts)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_cpdae_arms(folder, spec, path, plt):
    """CPDAE's three arms (mean ± sd over the seeds, test texts): the rank AUCs of the primary tests with chance
    (0.5) as their reference, and z~'s shares of the common and of the text's own words beside the uniform
    distribution's and the constant predictor's (the decoder's best answer without h0)."""
    arms = (("cpdae-cl", "CL"), ("cpdae-nocl", "no CL"), ("cpdae-control", "control: another text's positive"))
    value = lambda arm, key: list(term_values(folder, spec, f"{arm}:{key}", spec["test_split"]).values())
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = (("auc_text", "AUC: own words over absent non-common ones", ()),
              ("auc_common", "AUC: own words over the common words", ()),
              ("representative", "z~'s share on the text's own words",
               (("representative_uniform", "uniform z~", ":"), ("constant_representative", "constant predictor", "--"))))
    for ax, (key, title, references) in zip(axes, panels):
        for x, (arm, label) in enumerate(arms):
            values = value(arm, key)
            ax.errorbar([x], [np.mean(values)], yerr=[np.std(values)], marker="o", capsize=4,
                        label=f"{label}, {len(values)} seeds")
        if key.startswith("auc"):
            ax.axhline(0.5, color="black", linewidth=0.5, label="chance")
            diffs = FIRST.paired_test(*(term_values(folder, spec, f"{a}:{key}", spec["test_split"])
                                        for a in ("cpdae-cl", "cpdae-nocl")), 1)[0]
            if len(diffs) > 1:   # where CL must reach for the test to see it (Holm's strictest level)
                smallest = FIRST.detectable(len(diffs), float(diffs.std(ddof=1)), spec["alpha"] / len(spec["tests"]))
                ax.plot([0], [np.mean(value("cpdae-nocl", key)) + smallest], "k_", markersize=14,
                        label="no CL + the smallest detectable effect")
        for ref, label, style in references:
            ax.axhline(np.mean(value("cpdae-nocl", ref)), color="grey", linestyle=style, label=label)
        ax.set_xticks(range(len(arms)), [a[1].split(":")[0] for a in arms])
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle("CPDAE 3.3, MiniLM frozen, step 600: eq. 4 averaged, lambda 0.003 (~900x the paper's pull on "
                 "L_CL); new test texts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mean_curve(folder, spec, arm, key, split):
    """The mean over the seeds of a list-valued measure (a curve), cut to the shortest seed's. None without rows."""
    curves = [lookup(row, key, split, spec["step"]) for row in arm_rows(folder, spec, arm, split).values()]
    curves = [c for c in curves if c]
    if not curves:
        return None, 0
    length = min(len(c) for c in curves)
    return np.mean([c[:length] for c in curves], axis=0), len(curves)


def draw_seed_figure4(folder, spec, path, plt):
    """SEED's h0-swap gap by position without the [SEP] target (Figure 4's causal form), each decoder's mean over
    its seeds, with 0 (a decoder that ignores h0) as the reference level."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for arm, label in (("seed-weak", "span 2 (the paper's weak decoder)"), ("seed-strong", "full causal")):
        curve, n = mean_curve(folder, spec, arm, "gap_by_position_nosep", spec["test_split"])
        if curve is not None:
            ax.plot(np.arange(len(curve)), curve, label=f"{label}, {n} seeds")
    ax.axhline(0, color="black", linewidth=0.5, label="ignores h0")
    ax.set(xlabel="target position (the final [SEP] left out)", ylabel="h0-swap gap (nats/token)")
    ax.set_title(f"SEED, MiniLM frozen, step {spec['step']}: the decoder's reliance on h0 by position (test texts)",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_figure5(folder, spec, path, plt):
    """Figure 5: the random-pair cosine of the test texts by length, MLM-only and SEED (mean ± sd over the
    seeds), with the smallest effect the plan's seeds can detect at Holm's strictest level, drawn below MLM-only
    at 128 tokens from the observed sd of the difference (its reference, beside 0: unrelated texts)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for arm, label in (("mlm", "MLM-only (costa.py --gwc_weight 0)"), ("seed", "SEED (span 2)")):
        rows = arm_rows(folder, spec, arm, spec["test_split"])
        by_length = [r["cosine_by_length"] for r in rows.values() if "cosine_by_length" in r]
        if by_length:
            lengths = sorted(by_length[0], key=int)
            values = np.array([[c[n] for n in lengths] for c in by_length])
            ax.errorbar([int(n) for n in lengths], values.mean(0), yerr=values.std(0), marker="o",
                        label=f"{label}, {len(values)} seeds")
    test = next(t for t in spec["tests"] if t["measure"].startswith("cosine_by_length"))
    mlm = term_values(folder, spec, f"{test['ablation']}:{test['measure']}", spec["test_split"])
    diffs = FIRST.paired_test(term_values(folder, spec, f"{test['arm']}:{test['measure']}", spec["test_split"]),
                              mlm, -1)[0]
    if len(diffs) > 1:
        smallest = FIRST.detectable(len(diffs), float(diffs.std(ddof=1)), spec["alpha"] / len(spec["tests"]))
        ax.plot([128], [np.mean(list(mlm.values())) - smallest], "k_", markersize=14,
                label="MLM-only - the smallest detectable effect")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set(xscale="log", xlabel="tokens per text", ylabel="cosine of random test-text pairs")
    ax.set_xticks([32, 64, 128, 256, 512], ["32", "64", "128", "256", "512"])
    ax.minorticks_off()
    ax.set_title("SEED Figure 5: MiniLM + 100 steps of continued pre-training (new test texts)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(folder, argv=()):
    try:
        spec, sha = read_plan(folder)
        made_under = check_binding(folder, sha)
    except PlanError as error:
        print(error, file=sys.stderr)
        return 1
    if "--check" in argv:   # make.sh: the plan parses and binds the rows so far
        return 0
    if "--missing" in argv:   # make.sh: how many of the plan's rows are not there yet
        print(sum(not (Path(folder) / "rows" / path).is_file() for path in expected_rows(spec)))
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        text = table(folder, spec, sha, made_under)
        (Path(folder) / "table.md").write_text(text)
        if made_under and not sum(not (Path(folder) / "rows" / p).is_file() for p in expected_rows(spec)):
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            draw_cpdae_arms(folder, spec, Path(folder) / "cpdae_arms.png", plt)
            draw_lambda_series(folder, spec, Path(folder) / "cpdae_lambda.png", plt)
            draw_seed_figure4(folder, spec, Path(folder) / "seed_figure4.png", plt)
            draw_figure5(folder, spec, Path(folder) / "seed_figure5.png", plt)
    print(f"{Path(folder) / 'table.md'} written")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python results/mechanisms/confirm/report.py results/mechanisms/confirm [--check | --missing]")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
