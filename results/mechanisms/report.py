"""results/mechanisms/plan.md applied to the rows: the pilot's choices, each gate against its threshold, the
primary tests with Holm's correction, the exploratory numbers, and the figures.

    python results/mechanisms/report.py results/mechanisms                 # make.sh runs it last
    python results/mechanisms/report.py results/mechanisms --choose cpdae  # a pilot's choice (make.sh asks)

Reads {folder}/rows/ (mechanisms.py's JSON rows, one file a row), writes {folder}/table.md and the figures beside
it. It trains and measures nothing: on a fresh clone it reprints the committed table.md exactly.
"""
import json
import sys
import warnings
from pathlib import Path

import numpy as np
from scipy import stats

CPDAE_ORDER = ("paper", "mean", "mean-tau")    # the pilot's variants, nearest the paper's weights first (plan.md)
CPDAE_STEPS, SEED_STEPS, ENCODER_STEPS = 600, range(100, 601, 100), (100, 200)
CPDAE_SEEDS, SEED_SEEDS, ENCODER_SEEDS = range(5), range(3), range(3)
NDCG_FLOOR = 0.7252   # command 1's fine-tuned MiniLM on SciFact dev (0.7452, results/quickstart/rows) - 0.02


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
    gates += [("CL arm: contrastive accuracy / chance", cl["cl_acc"] / cl["cl_chance"], ">= 10",
               cl["cl_acc"] >= 10 * cl["cl_chance"]),
              ("CL arm: lambda |dL_CL/dz| / |dL_REC/dz|", cl_weight * cl["grad_cl_over_rec"], ">= 0.1",
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
        if point and all(holds for *_, holds in cpdae_gates(point["dev"], None, row["settings"]["cl_weight"])):
            return variant
    return "none"


def choose_seed(folder):
    """The first step (of 100, 200, ...) at which every SEED gate holds on dev, both decoders at seed 0."""
    weak, strong = (read_row(folder, f"frozen_seed-seed-{arm}-seed0") for arm in ("weak", "strong"))
    for step in SEED_STEPS:
        a, b = at_step(weak, step), at_step(strong, step)
        if a and b and all(holds for *_, holds in seed_gates(a["dev"], b["dev"])):
            return step
    return "none"


def choose_encoder(folder):
    """The first pilot step (100, 200) at which COSTA's and MLM-only's gates hold on dev (seed 0)."""
    for step in ENCODER_STEPS:
        costa, mlm = (read_row(folder, f"heads-dev/heads-pilot-{arm}-seed0-step{step}") for arm in ("costa", "mlm"))
        if costa and mlm and all(holds for *_, holds in encoder_gates(costa, mlm)):
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
    """The smallest true mean difference a one-sided paired t-test over n seeds finds with this power at alpha."""
    return (stats.t.ppf(1 - alpha, n - 1) + stats.t.ppf(power, n - 1)) * sd / np.sqrt(n)


def main(folder, argv):
    if argv[:1] == ["--choose"]:
        print(CHOICES[argv[1]](folder))
        return
    raise SystemExit("the tables: not written yet")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
