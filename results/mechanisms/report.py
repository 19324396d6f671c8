"""results/mechanisms/plan.md applied to the rows: the pilot's choices, each gate against its threshold, the
primary tests with Holm's correction, the exploratory numbers, and the figures.

    python results/mechanisms/report.py results/mechanisms                 # make.sh runs it last
    python results/mechanisms/report.py results/mechanisms --choose cpdae  # a pilot's choice (make.sh asks)

Reads {folder}/rows/ (research/mechanisms.py's JSON rows, one file a row), writes {folder}/table.md and the figures
beside it. It trains and measures nothing: on a fresh clone it reprints the committed table.md exactly.
"""
import json
import sys
import warnings
from pathlib import Path

import numpy as np
from scipy import optimize, stats

CPDAE_ORDER = ("paper", "mean-l0.003", "mean-l0.01", "mean", "mean-tau")   # the pilot's variants, nearest the paper's first
CPDAE_STEPS, SEED_STEPS, ENCODER_STEPS = 600, range(100, 601, 100), (100, 200)
CPDAE_SEEDS, SEED_SEEDS, ENCODER_SEEDS = range(5), range(3), range(3)
NDCG_FLOOR = 0.7252   # command 1's fine-tuned MiniLM on SciFact dev (0.7452: quickstart/rows/no-pretrain/eval-dev) - 0.02


def read_row(folder, name):
    """The row rows/{name}.json, or None where make.sh has not written it yet."""
    path = Path(folder, "rows", f"{name}.json")
    return json.loads(path.read_text()) if path.is_file() else None


def at_step(row, step):
    """A --frozen row's measures at a step: {"dev": {...}, "test": {...}} (None where it has none)."""
    return next((point for point in row["curve"] if point["step"] == step), None) if row else None


# ---------------------------------------------------------------------------------------------
# The gates (plan.md): each -> [(what, value, threshold text, holds)]
# ---------------------------------------------------------------------------------------------
def cpdae_gates(cl, nocl, cl_weight):
    """CPDAE's three gates from the dev measures of the CL arm (and of its ablation, where given)."""
    gates = [("CL arm: held-out L_REC / the constant predictor's", cl["rec"] / cl["rec_constant"], "<= 0.99",
              cl["rec"] <= 0.99 * cl["rec_constant"])]
    if nocl is not None:
        gates.append(("no-CL arm: held-out L_REC / the constant predictor's", nocl["rec"] / nocl["rec_constant"],
                      "<= 0.99", nocl["rec"] <= 0.99 * nocl["rec_constant"]))
    accuracy = "CL arm: contrastive accuracy / chance"
    if nocl is not None:   # the frozen encoder's two views are near each other already: the gate cannot fail
        accuracy += f" (uninformative: the no-CL arm's is {nocl['cl_acc'] / nocl['cl_chance']:.4g})"
    gates += [(accuracy, cl["cl_acc"] / cl["cl_chance"], ">= 10", cl["cl_acc"] >= 10 * cl["cl_chance"]),
              ("CL arm: lambda x norm(dL_CL/dz) / norm(dL_REC/dz)", cl_weight * cl["grad_cl_over_rec"], ">= 0.1",
               cl_weight * cl["grad_cl_over_rec"] >= 0.1)]
    return gates


def seed_gates(weak, strong):
    """SEED's three decoder gates from the two decoders' dev measures."""
    return [("weak decoder: held-out loss - unigram's", weak["loss_own"] - weak["unigram"], "< 0",
             weak["loss_own"] < weak["unigram"]),
            ("strong decoder: held-out loss - unigram's", strong["loss_own"] - strong["unigram"], "< 0",
             strong["loss_own"] < strong["unigram"]),
            ("strong - weak decoder: held-out loss", strong["loss_own"] - weak["loss_own"], "< 0",
             strong["loss_own"] < weak["loss_own"]),
            ("weak decoder: h0-swap gap / its loss", weak["gap"] / weak["loss_own"], ">= 0.02",
             weak["gap"] >= 0.02 * weak["loss_own"])]


def encoder_gates(costa, mlm):
    """The encoder side's pilot gates from COSTA's and MLM-only's dev heads."""
    return [("COSTA: group-wise accuracy / chance", costa["gwc_acc"] / costa["gwc_chance"], ">= 10",
             costa["gwc_acc"] >= 10 * costa["gwc_chance"]),
            ("MLM-only: MLM accuracy / most frequent token's", mlm["mlm_acc"] / mlm["mlm_chance"], ">= 2",
             mlm["mlm_acc"] >= 2 * mlm["mlm_chance"])]


# ---------------------------------------------------------------------------------------------
# The pilot's choices (plan.md), from seed 0's dev rows only
# ---------------------------------------------------------------------------------------------
def choose_cpdae(folder):
    """The first variant, nearest the paper's weights first, whose CPDAE gates hold on dev at step 600."""
    for variant in CPDAE_ORDER:
        row = read_row(folder, f"frozen_cpdae-cpdae-cl-{variant}-seed0")
        point = at_step(row, CPDAE_STEPS)
        if not point:
            return "pending"
        if all(holds for *_, holds in cpdae_gates(point["dev"], None, row["settings"]["cl_weight"])):
            return variant
    return "none"


def choose_seed(folder):
    """The first step (of 100, 200, ...) at which every SEED gate holds on dev, both decoders at seed 0."""
    weak, strong = (read_row(folder, f"frozen_seed-seed-{arm}-seed0") for arm in ("weak", "strong"))
    for step in SEED_STEPS:
        a, b = at_step(weak, step), at_step(strong, step)
        if not (a and b):
            return "pending"
        if all(holds for *_, holds in seed_gates(a["dev"], b["dev"])):
            return step
    return "none"


def choose_encoder(folder):
    """The first pilot step (100, 200) at which COSTA's and MLM-only's gates hold on dev (seed 0)."""
    for step in ENCODER_STEPS:
        costa, mlm = (read_row(folder, f"heads-dev/heads-pilot-{arm}-seed0-step{step}") for arm in ("costa", "mlm"))
        if not (costa and mlm):
            return "pending"
        if all(holds for *_, holds in encoder_gates(costa, mlm)):
            return step
    return "none"


CHOICES = {"cpdae": choose_cpdae, "seed": choose_seed, "encoder": choose_encoder}


# ---------------------------------------------------------------------------------------------
# The primary tests and Holm's correction
# ---------------------------------------------------------------------------------------------
def paired_test(arm, ablation, sign):
    """One-sided paired t-test over the seeds both dicts {seed: value} hold; sign +1: arm above. -> (diffs, p)."""
    seeds = sorted(set(arm) & set(ablation))
    diffs = np.array([arm[s] - ablation[s] for s in seeds], dtype=float)
    with warnings.catch_warnings():   # all differences alike: p is nan, reported as 1
        warnings.simplefilter("ignore", RuntimeWarning)
        p = stats.ttest_1samp(diffs, 0.0, alternative="greater" if sign > 0 else "less").pvalue if len(diffs) > 1 else 1.0
    return diffs, 1.0 if np.isnan(p) else float(p)


def holm(pvalues):
    """Holm-Bonferroni adjusted p-values, in the input's order."""
    order = np.argsort(pvalues)
    adjusted, running = np.empty(len(pvalues)), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted.tolist()


def detectable(n, sd, alpha, power=0.8):
    """The smallest true mean difference a one-sided paired t-test over n seeds finds with this power at alpha:
    the effect d (in sd) at which the noncentral t (df n - 1, noncentrality d sqrt(n)) passes the critical value
    with probability `power`."""
    critical = stats.t.ppf(1 - alpha, n - 1)
    d = optimize.brentq(lambda d: stats.nct.sf(critical, n - 1, d * np.sqrt(n)) - power, 1e-6, 100.0)
    return d * sd


# ---------------------------------------------------------------------------------------------
# What the rows hold, claim by claim (None where make.sh has not written them yet)
# ---------------------------------------------------------------------------------------------
def cpdae_rows(folder):
    """{"variant", "cl": {seed: row}, "nocl": {seed: row}, "step"} of the chosen CPDAE variant, or None."""
    variant = choose_cpdae(folder)
    if variant in ("none", "pending"):
        return None
    cl = read_row(folder, f"frozen_cpdae-cpdae-cl-{variant}-seed0")
    reduction = cl["settings"]["rec_reduction"]
    arms = {"cl": f"cpdae-cl-{variant}", "nocl": f"cpdae-nocl-{reduction}"}
    rows = {k: {s: r for s in CPDAE_SEEDS if (r := read_row(folder, f"frozen_cpdae-{arm}-seed{s}"))}
            for k, arm in arms.items()}
    return {"variant": variant, "arms": arms, "step": CPDAE_STEPS, "cl_weight": cl["settings"]["cl_weight"], **rows}


def seed_rows(folder):
    """{"weak": {seed: row}, "strong": {seed: row}, "step"} at the step the pilot chose, or None."""
    step = choose_seed(folder)
    if step in ("none", "pending"):
        return None
    return {"step": step, **{k: {s: r for s in SEED_SEEDS if (r := read_row(folder, f"frozen_seed-seed-{k}-seed{s}"))}
                             for k in ("weak", "strong")}}


def encoder_rows(folder):
    """{"step", arm: {seed: {"heads_dev", "heads_test", "finetune", "discrimination"}}} or None."""
    step = choose_encoder(folder)
    if step in ("none", "pending"):
        return None
    names = {"heads_dev": "heads-dev/heads-{arm}-seed{s}-step{step}", "heads_test": "heads-test/heads-{arm}-seed{s}-step{step}",
             "finetune": "finetune-{arm}-seed{s}", "discrimination": "discrimination-{arm}-seed{s}"}
    return {"step": step, **{arm: {s: {k: read_row(folder, n.format(arm=arm, s=s, step=step)) for k, n in names.items()}
                                   for s in ENCODER_SEEDS} for arm in ("costa", "mlm", "seed")}}


def values(rows, split, key, step):
    """{seed: rows[seed]'s measure `key` on `split` at `step`} over the seeds that have it."""
    out = {}
    for s, row in rows.items():
        point = at_step(row, step)
        if point and key in point[split]:
            out[s] = point[split][key]
    return out


def mean_dict(dicts):
    """The mean over seeds of each number of a list of measure dicts (lists, such as curves, are left out)."""
    keys = [k for k, v in dicts[0].items() if isinstance(v, (int, float))]
    return {k: float(np.mean([d[k] for d in dicts])) for k in keys}


def fmt(x):
    return "-" if x is None else f"{x:.4g}"


def interval(diffs, level=0.95):
    """The paired differences' mean and its two-sided t interval, as text ('-' under two seeds)."""
    if len(diffs) < 2:
        return "-"
    half = stats.t.ppf(0.5 + level / 2, len(diffs) - 1) * np.std(diffs, ddof=1) / np.sqrt(len(diffs))
    return f"{np.mean(diffs):+.4g} [{np.mean(diffs) - half:+.3g}, {np.mean(diffs) + half:+.3g}]"


def mean_sd(v):
    v = np.asarray(list(v), dtype=float)
    return "-" if len(v) == 0 else f"{v.mean():.4g} ± {(v.std(ddof=1) if len(v) > 1 else 0.0):.2g}"


# ---------------------------------------------------------------------------------------------
# Gates at the chosen step (dev, mean over seeds) and the primary family
# ---------------------------------------------------------------------------------------------
def all_gates(folder):
    """({claim group: [(what, value, threshold, holds)]}, {claim group: the seeds averaged}); a group with no rows
    yet is absent. A pilot that found nothing gives its own gates (seed 0), so the failed values are printed."""
    gates, seeds = {}, {}
    c = cpdae_rows(folder)
    if c and c["cl"] and c["nocl"]:
        dev = {k: mean_dict([at_step(r, c["step"])["dev"] for r in c[k].values()]) for k in ("cl", "nocl")}
        gates["cpdae"], seeds["cpdae"] = cpdae_gates(dev["cl"], dev["nocl"], c["cl_weight"]), len(set(c["cl"]) & set(c["nocl"]))
    elif choose_cpdae(folder) == "none":   # the variant nearest the paper's weights: its failed gates
        row = read_row(folder, f"frozen_cpdae-cpdae-cl-{CPDAE_ORDER[0]}-seed0")
        gates["cpdae"], seeds["cpdae"] = cpdae_gates(at_step(row, CPDAE_STEPS)["dev"], None, row["settings"]["cl_weight"]), 1
    sd = seed_rows(folder)
    if sd and sd["weak"] and sd["strong"]:
        dev = {k: mean_dict([at_step(r, sd["step"])["dev"] for r in sd[k].values()]) for k in ("weak", "strong")}
        gates["seed"], seeds["seed"] = seed_gates(dev["weak"], dev["strong"]), len(set(sd["weak"]) & set(sd["strong"]))
    elif choose_seed(folder) == "none":   # the pilot's last step: its failed gates
        weak, strong = (read_row(folder, f"frozen_seed-seed-{arm}-seed0") for arm in ("weak", "strong"))
        gates["seed"], seeds["seed"] = seed_gates(weak["curve"][-1]["dev"], strong["curve"][-1]["dev"]), 1
    e = encoder_rows(folder)
    if e:
        heads = {arm: [r["heads_dev"] for r in e[arm].values() if r["heads_dev"]] for arm in ("costa", "mlm", "seed")}
        if heads["costa"] and heads["mlm"]:
            gates["encoder"] = encoder_gates(mean_dict(heads["costa"]), mean_dict(heads["mlm"]))
            seeds["encoder"] = min(len(heads["costa"]), len(heads["mlm"]))
        if heads["seed"]:
            seeds["encoder"] = min(seeds.get("encoder", len(heads["seed"])), len(heads["seed"]))
            h = mean_dict(heads["seed"])
            gates.setdefault("encoder", []).append(("SEED: decoder accuracy / most frequent token's",
                                                    h["dec_acc"] / h["dec_chance"], ">= 2", h["dec_acc"] >= 2 * h["dec_chance"]))
        for arm in ("costa", "mlm", "seed"):
            ndcg = [r["finetune"]["dev"]["NDCG@10"] for r in e[arm].values() if r["finetune"]]
            if ndcg:
                seeds["costa"] = min(seeds.get("costa", len(ndcg)), len(ndcg))
                gates.setdefault("costa", []).append((f"{arm}, fine-tuned: SciFact dev nDCG@10", float(np.mean(ndcg)),
                                                      f">= {NDCG_FLOOR}", float(np.mean(ndcg)) >= NDCG_FLOOR))
    elif choose_encoder(folder) == "none":   # the pilot's last step: its failed gates
        costa, mlm = (read_row(folder, f"heads-dev/heads-pilot-{arm}-seed0-step{ENCODER_STEPS[-1]}") for arm in ("costa", "mlm"))
        gates["encoder"], seeds["encoder"] = encoder_gates(costa, mlm), 1
    return gates, seeds


def primary(folder):
    """The plan's 8 tests: [(number, paper, measure, group of gates, sign, {seed: arm}, {seed: ablation})]."""
    c, sd, e = cpdae_rows(folder), seed_rows(folder), encoder_rows(folder)
    empty = {}

    def cp(key):
        return (values(c["cl"], "test", key, c["step"]), values(c["nocl"], "test", key, c["step"])) if c else (empty, empty)

    def sp(key):
        return (values(sd["weak"], "test", key, sd["step"]), values(sd["strong"], "test", key, sd["step"])) if sd else (empty, empty)

    def enc(arm, kind, pick):
        return {s: pick(r[kind]) for s, r in e[arm].items() if r[kind]} if e else empty

    def cosine128(row):
        return row["cosine_by_length"]["128"] if "128" in row["cosine_by_length"] else row["cosine_by_length"][128]

    return [(1, "CPDAE 3.3", "z~ on the common words, CL - no CL", "cpdae", -1, *cp("common")),
            (2, "CPDAE 3.3", "z~ on the text's own other words, CL - no CL", "cpdae", +1, *cp("representative")),
            (3, "SEED 3.4", "h0-swap gap (nats/token), weak - strong", "seed", +1, *sp("gap")),
            (4, "SEED Fig. 4", "slope of the h0-swap gap by position (/100 positions), weak - strong", "seed", +1,
             *sp("gap_slope")),
            (5, "SEED Fig. 4", "slope of cos(state, h0) by position (/100 positions), weak - strong", "seed", +1,
             *sp("cosine_slope")),
            (6, "SEED Fig. 5", "random test pairs' cosine at 128 tokens, SEED - MLM-only", "encoder", -1,
             enc("seed", "heads_test", cosine128), enc("mlm", "heads_test", cosine128)),
            (7, "COSTA 5.4", "AUC after fine-tuning (SciFact test), COSTA - MLM-only", "costa", +1,
             enc("costa", "discrimination", lambda r: r["auc"]), enc("mlm", "discrimination", lambda r: r["auc"])),
            (8, "COSTA 5.4", "AUC after fine-tuning (SciFact test), COSTA - SEED", "costa", +1,
             enc("costa", "discrimination", lambda r: r["auc"]), enc("seed", "discrimination", lambda r: r["auc"]))]


GATE_GROUPS = {"cpdae": ("cpdae",), "seed": ("seed",), "encoder": ("encoder",), "costa": ("encoder", "costa")}
PLANNED_SEEDS = {"cpdae": CPDAE_SEEDS, "seed": SEED_SEEDS, "encoder": ENCODER_SEEDS, "costa": ENCODER_SEEDS}


# Tests whose plan was revised after rows with their test numbers existed (plan.md's revision (1)): their verdict is
# printed as the rule gives it, and labelled exploratory.
EXPLORATORY = {1: " (exploratory: plan revised after the pilot's test numbers)",
               2: " (exploratory: plan revised after the pilot's test numbers)"}


def verdicts(folder):
    """Each primary test with its p, Holm's adjusted p over all 8 (a test not run: p = 1) and its verdict."""
    gates, seeds = all_gates(folder)
    tests = []
    for number, paper, what, group, sign, arm, ablation in primary(folder):
        failed = [g for name in GATE_GROUPS[group] for g in gates.get(name, []) if not g[3]]
        planned = len(PLANNED_SEEDS[group])   # judged once every planned seed is in, on both arms and every gate
        complete = (set(PLANNED_SEEDS[group]) <= set(arm) & set(ablation)
                    and all(seeds.get(name, 0) >= planned for name in GATE_GROUPS[group]))
        ran = complete and not failed and all(gates.get(n) for n in GATE_GROUPS[group])
        diffs, p = paired_test(arm, ablation, sign) if ran else (np.array([]), 1.0)
        tests.append({"number": number, "paper": paper, "what": what, "sign": sign, "diffs": diffs, "p": p,
                      "failed": failed, "ran": ran, "seeds_in": len(set(arm) & set(ablation)),
                      # a gate group whose pilot found nothing: its claims are not testable, whatever the seeds
                      "pilot_found_none": any(CHOICES[name](folder) == "none" for name in GATE_GROUPS[group]
                                              if name in CHOICES),
                      "planned": planned})
    for test, adjusted in zip(tests, holm([t["p"] for t in tests])):
        test["holm"] = adjusted
        if test["failed"] and (test["pilot_found_none"] or test["seeds_in"] >= test["planned"]):
            what, value, threshold, _ = test["failed"][0]
            test["verdict"] = f"not testable in this regime (gate: {what} {value:.3g}, needs {threshold})"
        elif test["seeds_in"] < test["planned"]:
            test["verdict"] = (f"not judged yet: the rows of {test['seeds_in']} of its {test['planned']} seeds "
                               f"(bash results/mechanisms/make.sh goes on from there)")
        elif not test["ran"]:
            test["verdict"] = "not judged yet: its gates' rows are not all in"
        else:
            test["verdict"] = "shown" if adjusted < 0.05 else "not shown"
    return tests, gates, seeds


# ---------------------------------------------------------------------------------------------
# table.md
# ---------------------------------------------------------------------------------------------
def write_table(folder, tests, gates, seeds):
    commits = sorted({json.loads(f.read_text())["commit"][:7] for f in Path(folder, "rows").rglob("*.json")})
    lines = ["# Mechanisms: each claim where its precondition holds", "",
             (f"Written by `python results/mechanisms/report.py results/mechanisms` from `rows/`, which `bash "
              f"results/mechanisms/make.sh` wrote (each row holds the command that remakes it; code: {', '.join(commits)}). "
              "The rules, gates and tests are [plan.md](plan.md)'s (first commit 3a8e19e). Its first revision (eaad4a0, the "
              "two CPDAE lambdas between the paper's weights and `mean`) was made after the first pilot's rows, their test "
              "numbers printed, existed: CPDAE's verdicts (tests 1-2) are exploratory, whatever this table says of them; "
              "the regime they come from weighs L_CL about 900x the paper's weights against L_REC. Values: mean ± sd over "
              "the seeds; a difference is arm - ablation, paired by seed."), "",
             "## The primary tests (test split; one-sided paired t-tests over seeds; Holm-Bonferroni over all 8)", "",
             ("| # | paper | measure | difference | seeds | in the claimed direction | p | Holm p | smallest detectable "
              "(Holm's strictest / 0.05) | verdict |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for t in tests:
        d, n = t["diffs"], len(t["diffs"])
        sd = d.std(ddof=1) if n > 1 else float("nan")
        agree = int(np.sum(np.sign(d) == t["sign"]))
        mde = f"{detectable(n, sd, 0.05 / len(tests)):.2g} / {detectable(n, sd, 0.05):.2g}" if n > 1 else "-"
        lines.append(f"| {t['number']} | {t['paper']} | {t['what']} ({'>' if t['sign'] > 0 else '<'} 0) | "
                     f"{mean_sd(d)} | {n} | {agree if n else '-'} | {fmt(t['p']) if n else '-'} | "
                     f"{fmt(t['holm']) if n else '-'} | {mde} | **{t['verdict']}**{EXPLORATORY.get(t['number'], '')} |")
    lines += ["", "## One line per claim (the README quotes these)", ""]
    lines += [f"- {t['paper']}, {t['what']}: **{t['verdict']}**{EXPLORATORY.get(t['number'], '')}; "
              + (f"{interval(t['diffs'])} (first round, {len(t['diffs'])} seeds, test split; mean [95 % t interval])"
                 if len(t["diffs"]) > 1 else "no test run (first round)") for t in tests]
    lines += ["", "## The gates (dev split; at the chosen step, mean over the seeds in)", "",
              "| claim | gate | seeds | value | threshold | holds |", "|---|---|---|---|---|---|"]
    for group, rows in gates.items():
        planned = len(PLANNED_SEEDS[group])
        lines += [f"| {group} | {what} | {seeds[group]} of {planned} | {value:.4g} | {threshold} | {'yes' if holds else '**no**'} |"
                  for what, value, threshold, holds in rows]
    seconds = [json.loads(f.read_text())["seconds"] for f in Path(folder, "rows").glob("frozen_*.json")]
    lines += ["", (f"The {len(seconds)} frozen-encoder trials' training and measuring took {sum(seconds):,} s on the "
                   "machine that wrote them (each row's `seconds`), besides the vectors, computed once.")]
    return lines + pilot_tables(folder) + exploratory_tables(folder)


def pilot_tables(folder):
    lines = ["", "## The pilot's choices (seed 0, dev split; plan.md's rules)", "",
             f"CPDAE's weights, at step {CPDAE_STEPS} (chosen: **{choose_cpdae(folder)}**):", "",
             "| variant | flags | L_REC / constant | contrastive accuracy / chance | lambda x gradient ratio | gates hold |",
             "|---|---|---|---|---|---|"]
    for variant in CPDAE_ORDER:
        row = read_row(folder, f"frozen_cpdae-cpdae-cl-{variant}-seed0")
        if row:
            st, g = row["settings"], cpdae_gates(at_step(row, CPDAE_STEPS)["dev"], None, row["settings"]["cl_weight"])
            lines.append(f"| {variant} | lambda {st['cl_weight']}, tau {st['cl_tau']}, eq. 4 {st['rec_reduction']} | "
                         + " | ".join(f"{v:.4g}" for _, v, _, _ in g) + f" | {'yes' if all(h for *_, h in g) else 'no'} |")
    lines += ["", f"SEED's steps (chosen: **{choose_seed(folder)}**):", "",
              "| step | weak: loss | strong: loss | unigram | weak: gap / loss | gates hold |", "|---|---|---|---|---|---|"]
    weak, strong = (read_row(folder, f"frozen_seed-seed-{arm}-seed0") for arm in ("weak", "strong"))
    for step in SEED_STEPS:
        a, b = at_step(weak, step), at_step(strong, step)
        if a and b:
            w, g = a["dev"], seed_gates(a["dev"], b["dev"])
            lines.append(f"| {step} | {w['loss_own']:.4f} | {b['dev']['loss_own']:.4f} | {w['unigram']:.4f} | "
                         f"{w['gap'] / w['loss_own']:.4f} | {'yes' if all(h for *_, h in g) else 'no'} |")
    lines += ["", f"The encoder side's steps (chosen: **{choose_encoder(folder)}**):", "",
              "| step | COSTA: group-wise accuracy / chance | MLM-only: MLM accuracy / chance | gates hold |", "|---|---|---|---|"]
    for step in ENCODER_STEPS:
        costa, mlm = (read_row(folder, f"heads-dev/heads-pilot-{arm}-seed0-step{step}") for arm in ("costa", "mlm"))
        if costa and mlm:
            g = encoder_gates(costa, mlm)
            lines.append(f"| {step} | {g[0][1]:.4g} | {g[1][1]:.4g} | {'yes' if all(h for *_, h in g) else 'no'} |")
    return lines


def exploratory_tables(folder):
    lines = ["", "## Exploratory (test split; not corrected, not judged)", ""]
    c = cpdae_rows(folder)
    if c and c["cl"]:
        keys = ("common", "representative", "constant_common", "constant_representative", "rec", "rec_constant", "cl_acc")
        lines += [f"CPDAE, variant {c['variant']}, step {c['step']}:", "", "| arm | " + " | ".join(keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for k in ("cl", "nocl"):
            lines.append(f"| {c['arms'][k]} | " + " | ".join(mean_sd(values(c[k], 'test', key, c['step']).values())
                                                          for key in keys) + " |")
        lines.append("")
    sd = seed_rows(folder)
    if sd and sd["weak"]:
        keys = ("loss_own", "loss_other", "gap", "gap_slope", "cosine_slope", "unigram")
        lines += [(f"SEED's decoders, step {sd['step']} (the gap in the first and last 32 positions from t = 1: "
                   "gap_first, gap_last):"), "", "| decoder | " + " | ".join(keys) + " | gap_first | gap_last |",
                  "|---|" + "---|" * (len(keys) + 2)]
        for k in ("weak", "strong"):
            quarters = [(np.mean(at_step(r, sd["step"])["test"]["gap_by_position"][1:33]),
                         np.mean(at_step(r, sd["step"])["test"]["gap_by_position"][-32:])) for r in sd[k].values()]
            lines.append(f"| {k} | " + " | ".join(mean_sd(values(sd[k], 'test', key, sd['step']).values()) for key in keys)
                         + f" | {mean_sd(q[0] for q in quarters)} | {mean_sd(q[1] for q in quarters)} |")
        lines.append("")
    e = encoder_rows(folder)
    if e:
        lines += [f"The encoder side, {e['step']} steps of continued pre-training:", "",
                  "| arm | cosine 32 | cosine 64 | cosine 128 | AUC | margin | nDCG@10 dev | nDCG@10 test |",
                  "|---|---|---|---|---|---|---|---|"]
        for arm in ("costa", "mlm", "seed"):
            rs = [r for r in e[arm].values()]
            cos = [mean_sd(r["heads_test"]["cosine_by_length"][str(n)] for r in rs if r["heads_test"]) for n in (32, 64, 128)]
            disc = [mean_sd(r["discrimination"][k] for r in rs if r["discrimination"]) for k in ("auc", "margin")]
            ndcg = [mean_sd(r["finetune"][split]["NDCG@10"] for r in rs if r["finetune"]) for split in ("dev", "test")]
            lines.append(f"| {arm} | " + " | ".join(cos + disc + ndcg) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# The figures
# ---------------------------------------------------------------------------------------------
def draw_figures(folder):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from research import mechanisms  # the repository's: its plotting helpers

    plt = mechanisms._pyplot()
    c, sd = cpdae_rows(folder), seed_rows(folder)
    if c and c["cl"] and c["nocl"]:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), layout="constrained")
        for ax, key, title in zip(axes, ("common", "representative"), ("on the 100 tokens in the most windows",
                                                                        "on the text's own other words")):
            pairs = {k: values(c[k], "test", key, c["step"]) for k in ("cl", "nocl")}
            for seed in set(pairs["cl"]) & set(pairs["nocl"]):   # a seed's two arms joined
                ax.plot([0, 1], [pairs["cl"][seed], pairs["nocl"][seed]], color="grey", linewidth=0.6)
            for x, k in enumerate(("cl", "nocl")):
                ax.scatter([x] * len(pairs[k]), list(pairs[k].values()), color=f"C{x}", zorder=3)
            constant = np.mean(list(values(c["cl"], "test", f"constant_{key}", c["step"]).values()))
            ax.axhline(constant, color="grey", linestyle="--", label="constant predictor")
            ax.set(xticks=[0, 1], xticklabels=["with CL", "without CL"], xlim=(-0.5, 1.5), title=f"z~ {title}",
                   ylabel="share of z~ (test windows)")
            ax.legend(fontsize=8)
        fig.suptitle(f"CPDAE 3.3 on a frozen MiniLM ({c['variant']}: L_CL at ~900x the paper's weight; each dot a seed; exploratory)")
        mechanisms._save_figure(fig, Path(folder, "cpdae_shares.png"))
        words = {k: c[k][0]["curve"][-1]["table4_words"] for k in ("cl", "nocl") if 0 in c[k]}
        top = max(v for ws in words.values() for _, v, _ in ws)   # one colour scale: the two figures compare
        for k, ws in words.items():
            mechanisms.plot_words(ws, Path(folder, f"cpdae_words-{k}.png"), vmax=top)
    title = "SEED Figure 4 on a frozen MiniLM, step {step} (thin: a seed; thick: their mean)"
    if not sd and choose_seed(folder) == "none":   # the pilot's seed 0 at its last step, its gate failed: still drawn
        pilot = {k: {0: read_row(folder, f"frozen_seed-seed-{k}-seed0")} for k in ("weak", "strong")}
        sd = {"step": pilot["weak"][0]["curve"][-1]["step"], **pilot}
        title = "SEED Figure 4 on a frozen MiniLM: the pilot, seed 0, step {step} (not judged: a gate failed)"
    if sd and sd["weak"] and sd["strong"]:
        fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True, layout="constrained")
        for col, (k, panel) in enumerate((("strong", "(a) full attention"), ("weak", "(b) attention span 2"))):
            for row, (key, label) in enumerate((("cosine_by_position", "cos(decoder state, h0)"),
                                                ("gap_by_position", "h0-swap gap (nats/token)"))):
                ax = axes[row][col]
                curves = [at_step(r, sd["step"])["test"][key] for r in sd[k].values()]
                for curve in curves:
                    ax.plot(curve, color="C0", alpha=0.3, linewidth=0.8)
                ax.plot(np.mean(curves, axis=0), color="C0", linewidth=2)
                ax.axhline(0, color="grey", linewidth=0.5)
                ax.set(title=f"{panel}: {label}", ylabel=label)
                if row == 1:
                    ax.set_xlabel("decoder position (0 = the start symbol)")
        fig.suptitle(title.format(step=sd["step"]))
        mechanisms._save_figure(fig, Path(folder, "seed_figure4.png"))
    draw_encoder_side(folder, plt, mechanisms)
    draw_pilot(folder, plt, mechanisms)


def draw_encoder_side(folder, plt, mechanisms):
    """SEED Figure 5 and COSTA's random-pair curve (test texts, by length) beside COSTA 5.4's AUC and its paired
    differences (tests 7 and 8), seeds as dots."""
    e = encoder_rows(folder)
    if not e:
        return
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4), layout="constrained")
    lengths, auc = [32, 64, 128], {}
    for i, arm in enumerate(("costa", "mlm", "seed")):
        rows = [r["heads_test"] for r in e[arm].values() if r["heads_test"]]
        if rows:
            lengths = sorted(int(n) for n in rows[0]["cosine_by_length"])
            curves = np.array([[r["cosine_by_length"][str(n)] for n in lengths] for r in rows])
            left.plot(lengths, curves.mean(0), color=f"C{i}", marker="o", label=arm)
            for curve in curves:
                left.scatter(lengths, curve, color=f"C{i}", s=10, alpha=0.5)
        auc[arm] = {s: r["discrimination"]["auc"] for s, r in e[arm].items() if r["discrimination"]}
        middle.scatter([i] * len(auc[arm]), list(auc[arm].values()), color=f"C{i}", zorder=3)
    left.set(xscale="log", xlabel="text length (tokens)", ylabel="mean cosine of random test-text pairs",
             title=f"SEED Fig. 5 / COSTA: random pairs, {e['step']} steps from MiniLM")
    left.set_xticks(lengths, [str(n) for n in lengths])
    left.minorticks_off()
    left.legend(fontsize=8)
    middle.axhline(0.5, color="grey", linestyle="--", label="chance")
    middle.set(xticks=[0, 1, 2], xticklabels=["costa", "mlm", "seed"], xlim=(-0.5, 2.5), ylabel="AUC",
               title="COSTA 5.4 after fine-tuning (SciFact test)")
    middle.legend(fontsize=8)
    for x, ablation in enumerate(("mlm", "seed")):   # tests 7 and 8: COSTA - ablation, paired by seed
        diffs = [auc["costa"][s] - auc[ablation][s] for s in set(auc["costa"]) & set(auc[ablation])]
        right.scatter([x] * len(diffs), diffs, color=f"C{x + 1}", zorder=3)
    right.axhline(0, color="grey", linestyle="--", label="no difference")
    right.set(xticks=[0, 1], xticklabels=["costa - mlm", "costa - seed"], xlim=(-0.5, 1.5),
              ylabel="AUC difference (a dot per seed)", title="COSTA 5.4: against its ablations")
    right.legend(fontsize=8)
    mechanisms._save_figure(fig, Path(folder, "encoder_side.png"))


def draw_pilot(folder, plt, mechanisms):
    """The pilot's dev curves: SEED's two decoders against the unigram model; CPDAE's variants' gates by step."""
    weak, strong = (read_row(folder, f"frozen_seed-seed-{arm}-seed0") for arm in ("weak", "strong"))
    variants = {v: r for v in CPDAE_ORDER if (r := read_row(folder, f"frozen_cpdae-cpdae-cl-{v}-seed0"))}
    if not (weak and strong) and not variants:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
    if weak and strong:
        for row, label in ((weak, "weak (span 2)"), (strong, "strong (full causal)")):
            axes[0].plot([p["step"] for p in row["curve"]], [p["dev"]["loss_own"] for p in row["curve"]], marker="o",
                         label=label)
        axes[0].axhline(weak["curve"][-1]["dev"]["unigram"], color="grey", linestyle="--", label="unigram")
        axes[0].set(xlabel="step", ylabel="dev loss (nats/token)", title="SEED's decoders (seed 0)")
        axes[0].legend(fontsize=8)
    for name, row in variants.items():
        steps = [p["step"] for p in row["curve"]]
        axes[1].plot(steps, [p["dev"]["rec"] / p["dev"]["rec_constant"] for p in row["curve"]], marker="o", label=name)
        axes[2].plot(steps, [row["settings"]["cl_weight"] * p["dev"]["grad_cl_over_rec"] for p in row["curve"]],
                     marker="o", label=name)
    axes[1].axhline(0.99, color="grey", linestyle="--", label="gate")
    axes[1].set(xlabel="step", ylabel="L_REC / constant predictor's", title="CPDAE's variants: reconstruction (dev)")
    axes[2].axhline(0.1, color="grey", linestyle="--", label="gate")
    axes[2].set(xlabel="step", yscale="log", ylabel="lambda |dL_CL/dz| / |dL_REC/dz|", title="CPDAE: L_CL's pull (dev)")
    for ax in axes[1:]:
        ax.legend(fontsize=8)
    mechanisms._save_figure(fig, Path(folder, "pilot.png"))


def main(folder, argv):
    if argv[:1] == ["--choose"]:
        print(CHOICES[argv[1]](folder))
        return
    tests, gates, seeds = verdicts(folder)
    lines = write_table(folder, tests, gates, seeds)
    Path(folder, "table.md").write_text("\n".join(lines) + "\n")
    draw_figures(folder)
    print(f"{Path(folder, 'table.md')}: {len(lines)} lines")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
