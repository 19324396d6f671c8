"""The study: SEED-Encoder, CPDAE and COSTA compared at an equal budget, as a results section.

Every arm starts from the same checkpoint (--init), continues pre-training on the same corpus for the same
steps, batch and window length, and is fine-tuned identically by finetune.py; "none" fine-tunes the checkpoint
directly, "mlm" is costa.py --gwc_weight 0 (the papers' BERT baseline). One vector throughout (--vector): what
each objective trains (--bottleneck), fine-tuning trains and evaluation reads (--pooling).

Design:
- No test leakage: a fixed sample of training queries is held out as "dev" (evaluate.carve_dev); every setting
  is chosen on dev; test is evaluated once per run.
- Common random numbers: seed s gives every arm the same data order, masks, head init, dropout, fine-tuning
  sample and negatives.
- Statistics: paired t-test over seeds (each seed's mean, df = seeds - 1), beside a 95% percentile interval from
  a bootstrap over queries x seeds (evaluate.bootstrap_difference); std over seeds with ddof=1.
- Zero-shot column: every pre-trained encoder before fine-tuning, with the vector it was trained on.
- Low-resource curve: n training queries (sample s with seed-s encoders), the full-data run's steps at every n,
  for none, mlm and the best method on DEV.
- Provenance: each row records the commit, dirty, a hash of the scripts (`code`), every stage's command, torch
  and the settings; a table never mixes codes or settings unless --allow_mixed (rows all of one other code are
  reported with it named). Each stage is its own process, so an edit cannot mix versions mid-run.

    python -m research.study                              # the whole study; rerun it to continue, or for the table
    python -m research.study --seeds 0 --low_resource ""  # one seed, no curve
    python -m research.study --arm_args "costa:--head_warmup 20;cpdae:--cl_weight 1" --vector cls
    python -m research.study --report_only                # the table from the rows there are (a study part-way)
    python -m research.study --quick --out_dir /tmp/q     # tiny end-to-end check (a tiny model on a SciFact subset)

Outputs: results_dir (committed) holds runs/*.json (a row per finished run, with per-query nDCG@10 / MRR@10 /
Recall@100 on dev and test), table.md and the figures; out_dir the run folders. A rerun skips every run whose
row exists, so a fresh clone prints the same table without training.
"""
import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import data
import evaluate
import run

HERE = Path(__file__).resolve().parent.parent   # the repository root: the stages run there, the scripts are read there


@dataclass
class Config:
    init: str = "minilm"          # the starting checkpoint of every arm (folder, hub id or "minilm")
    arms: str = "none,mlm,seed,cpdae,costa"  # none = no continued pre-training; mlm = costa.py --gwc_weight 0
    seeds: str = "0,1,2,3,4"      # one run per arm and seed; seed s is the same random numbers in every arm
    vector: str = "mean"          # "cls" or "mean": what pre-training trains (--bottleneck), fine-tuning and evaluation read (--pooling)
    similarity: str = ""          # "dot" or "cos" for fine-tuning and evaluation; "" = what init declares (MiniLM: cos), else dot
    pretrain_steps: int = 50      # continued pre-training steps of every method (batch 32 x 128 tokens each)
    pretrain_lr: float = 5e-5     # continued pre-training learning rate of every method
    pretrain_args: str = "--head_warmup 20 --head_lr 20"  # more flags for every pre-training script (the heads' warm-up: results/levers)
    arm_args: str = "costa:--gwc_sim cos;cpdae:--rec_reduction mean --cl_tau 0.02;seed:--dec_weight 8"  # more flags per arm, "arm:flags;arm:flags" (results/levers)
    finetune_args: str = "--lr 2e-4"  # more flags for every fine-tuning (lr: best mean dev nDCG@10 of the none arm, results/dev)
    dataset: str = str(data.SCIFACT)  # BEIR folder: pre-training corpus, training queries (minus dev), test
    dev_queries: int = 150        # training queries held out as the dev split (fixed: evaluate.carve_dev)
    query_len: int = 64           # query tokens, fine-tuning and evaluation alike
    passage_len: int = 128        # passage tokens, fine-tuning and evaluation alike
    low_resource: str = "50"      # training-query counts of the curve, e.g. "50,100,200" ("" = no curve); 50: the low-resource regime studied
    curve_arms: str = ""          # arms of the curve; "" = none, mlm and the method with the best DEV nDCG@10
    resamples: int = 10000        # bootstrap resamples (queries x seeds) per interval
    out_dir: str = "runs/study"   # run folders: checkpoints, logs (not committed)
    results_dir: str = "results/study"  # per-run rows (committed), table.md and figures
    allow_mixed: bool = False     # make one table from rows of several codes or settings (refused otherwise)
    report_only: bool = False     # print the table from the rows there are (a study part-way), run nothing
    quick: bool = False           # tiny end-to-end check: a tiny model on a SciFact subset, seconds per run
    stage_hours: float = 24.0     # a stage still running after this is taken for hung: killed, named, the study stops
    preset: str = ""              # (no preset; the shared parser knows this field)


ARMS = {"none": None, "mlm": ("costa", "--gwc_weight 0"), **{m: (m, "") for m in run.METHODS}}   # arm -> (script, flags)
FLAG_RULES = {"pretrain_steps": ">= 1", "pretrain_lr": "> 0", "dev_queries": ">= 1", "query_len": ">= 3",
              "passage_len": ">= 3", "resamples": ">= 100", "stage_hours": "> 0",
              "arms": f"names from {{{', '.join(ARMS)}}}", "vector": "one of {cls, mean}",
              "similarity": "one of {dot, cos} or empty", "curve_arms": f"names from {{{', '.join(ARMS)}}} or empty"}
REPORTED = ("NDCG@10", "MRR@10", "Recall@100")       # what the rows keep per query
RUN_FILES = tuple(sorted(str(p.relative_to(HERE)) for p in (HERE / "run").rglob("*.py")))   # the run package's
SHARED = ("research/study.py", "data.py", *RUN_FILES, "evaluate.py", "finetune.py")   # what every row's stages run
SCRIPTS = SHARED + tuple(f"{m}.py" for m in run.METHODS)
SET_BY_STUDY = ("init", "seed", "out_dir", "pooling", "similarity", "bottleneck", "dev_queries", "n_queries",
                "dataset", "corpus", "query_len", "passage_len", "overwrite", "resume")
DEFAULT_SECONDS = {"pretrain": 300, "zero_shot": 110, "finetune": 250, "gradients": 60}  # MiniLM, 2 CPU cores
QUICK = dict(arms="none,costa", seeds="0,1", pretrain_steps=2, dev_queries=4, query_len=32, passage_len=64,
             pretrain_args="--batch_size 4 --max_len 64 --log_every 1", arm_args="",
             finetune_args="--steps 2 --batch_size 4 --log_every 1", low_resource="4", curve_arms="",
             resamples=1000)


def numbers(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_arm_args(text, arms):
    """'arm:flags;arm:flags' -> {arm: flags}; an arm not in ARMS is one clear error."""
    out = {}
    for part in filter(str.strip, text.split(";")):
        arm, sep, flags = part.partition(":")
        if not sep or arm.strip() not in ARMS:
            raise ValueError(f"--arm_args: expected 'arm:flags' with arm one of {', '.join(ARMS)}, got {part!r}")
        out[arm.strip()] = f"{out.get(arm.strip(), '')} {flags}".strip()
    return out


def check_flags(c):
    """Before any work (after FLAG_RULES): no flag the study sets itself inside the free-form flags."""
    for name, text in (("pretrain_args", c.pretrain_args), ("finetune_args", c.finetune_args),
                       *(("arm_args", t) for t in parse_arm_args(c.arm_args, ARMS).values())):
        given = {f.removeprefix("--") for f in shlex.split(text) if f.startswith("--")}
        clash = sorted(given & set(SET_BY_STUDY))
        if clash:
            raise ValueError(f"--{name}: --{clash[0]} is set by the study itself (use the study's own flag)")


# ----------------------------------------------------------------------------------------------
# Provenance: the commit, a hash of the scripts, each stage's command
# ----------------------------------------------------------------------------------------------
def scripts_of(arm):
    """The scripts an arm's stages run: the shared ones and its method file ("none": no method file)."""
    return SHARED + ((f"{ARMS[arm][0]}.py",) if ARMS[arm] else ())


def code_hash(names=SCRIPTS):
    """sha256 of the scripts (12 hex digits, paths from the repository root): rows with the same hash of their arm's
    scripts ran the same code (an edit to seed.py leaves the other arms' rows). The run package without its METHODS
    table: a new method changes no arm."""
    h = hashlib.sha256()
    for name in names:
        text = (HERE / name).read_bytes()
        if Path(name).parts[0] == "run":
            text = re.sub(rb"(?ms)^METHODS = \(.*?\)$", b"METHODS = ...", text)
        h.update(name.encode() + b"\0" + text + b"\0")
    return h.hexdigest()[:12]


def machine():
    """Where the stages ran: the GPU, else the CPU's model and vector unit (bf16 rounds differently on AMX)."""
    import torch
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)}"
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
    amx = " + AMX" if re.search(r"^flags\s*:.*\bamx_tile\b", info, re.MULTILINE) else ""
    return (f"cpu: {name.group(1).strip() if name else platform.processor() or 'unknown'}, "
            f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}{amx}")


def portable(path):
    """A path inside this repository as a relative one, so that a row reads the same in any clone."""
    try:
        return str(Path(path).resolve().relative_to(HERE))
    except ValueError:
        return str(path)


def settings(c, arm):
    """What a row's numbers depend on besides code and seed (the arm's own flags only): other settings, other rows."""
    out = {"init": c.init if c.init == "minilm" else portable(c.init), "vector": c.vector,
           "similarity": c.similarity, "dataset": portable(c.dataset), "dev_queries": c.dev_queries,
           "query_len": c.query_len, "passage_len": c.passage_len, "finetune_args": c.finetune_args}
    if ARMS[arm]:
        flags = [ARMS[arm][1], c.pretrain_args, parse_arm_args(c.arm_args, ARMS).get(arm, "")]
        out.update(pretrain_steps=c.pretrain_steps, pretrain_lr=c.pretrain_lr,
                   pretrain_flags=" ".join(f for f in flags if f))
    return out


def provenance(c, arm):
    commit, dirty = evaluate.git_state()
    return {"commit": commit, "dirty": dirty, "code": code_hash(scripts_of(arm)), "shared_code": code_hash(SHARED),
            "torch": importlib.metadata.version("torch"),
            "python": sys.version.split()[0], "machine": machine()}


# ----------------------------------------------------------------------------------------------
# Stages: each its own process, its output in a log file next to its outputs
# ----------------------------------------------------------------------------------------------
def run_stage(cmd, log_path, hours):
    """One stage as `sys.executable script.py ...`, its output in log_path -> (command line, seconds). A failed stage
    stops the study with its last lines; one still running after `hours` is killed, named in one line."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            code = subprocess.run(cmd, cwd=HERE, stdout=log, stderr=subprocess.STDOUT, timeout=hours * 3600).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"stage still running after {run.files.format_seconds(hours * 3600)}, taken for hung and "
                               f"killed (--stage_hours): {shlex.join(cmd)} (its output: {log_path})") from None
    if code:
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
        raise RuntimeError(f"stage failed (exit {code}): {shlex.join(cmd)}\n--- {log_path} (last lines)\n{tail}")
    return shlex.join(cmd), time.time() - t0


def pretrain_command(c, arm, seed, folder):
    method, own = ARMS[arm]
    corpus = data.find_file(c.dataset, "corpus.jsonl")
    return ([sys.executable, f"{method}.py", "--init", c.init, "--corpus", str(corpus), "--lr", str(c.pretrain_lr),
             "--steps", str(c.pretrain_steps), "--seed", str(seed), "--out_dir", str(folder), "--overwrite", "--bottleneck", c.vector]
            + shlex.split(own) + shlex.split(c.pretrain_args) + shlex.split(parse_arm_args(c.arm_args, ARMS).get(arm, "")))


def retriever_flags(c):
    return ["--dataset", c.dataset, "--dev_queries", str(c.dev_queries), "--pooling", c.vector,
            "--similarity", c.similarity, "--query_len", str(c.query_len), "--passage_len", str(c.passage_len)]


def read_metrics(folder):
    """metrics.json -> (means of REPORTED, {qid: [values of REPORTED], rounded})."""
    m = json.loads((Path(folder) / "metrics.json").read_text())
    per_query = {q: [round(v[k], 4) for k in REPORTED] for q, v in m["per_query"].items()}
    return {k: m["metrics"][k] for k in REPORTED}, per_query


def last_log_line(folder):
    lines = (Path(folder) / "log.jsonl").read_text().splitlines() if (Path(folder) / "log.jsonl").is_file() else []
    return json.loads(lines[-1]) if lines else {}


def pretrained_encoder(c, arm, seed, record):
    """The arm's seed-`seed` encoder folder, pre-trained unless a finished one is there; "none": the checkpoint."""
    if not ARMS[arm]:
        return c.init
    folder = Path(c.out_dir) / arm / f"seed{seed}" / "pretrain"
    cmd = pretrain_command(c, arm, seed, folder)
    done = folder / "study-done.json"
    marker = {"command": shlex.join(cmd), "code": code_hash(scripts_of(arm))}
    if not (done.is_file() and json.loads(done.read_text()) == marker):
        record["commands"]["pretrain"], record["seconds"]["pretrain"] = run_stage(cmd, folder.parent / "pretrain.log",
                                                                                  c.stage_hours)
        run.files.atomic_write_json(done, marker)
    record["commands"].setdefault("pretrain", shlex.join(cmd))
    record["pretrain_log"] = last_log_line(folder)
    return str(folder / "encoder")


def zero_shot(c, arm, seed, encoder, row):
    """The encoder before fine-tuning, on dev and test (one evaluate.py), with the vector it was trained on: {split:
    means}. "none" has one encoder for every seed, evaluated once."""
    out = Path(c.out_dir) / arm / (f"seed{seed}" if ARMS[arm] else "") / "zero-shot"
    cmd = [sys.executable, "evaluate.py", "--model", encoder, "--split", "dev,test", "--out_dir", str(out),
           "--tag", f"{arm}-zero-shot", *retriever_flags(c)]
    marker = {"command": shlex.join(cmd), "code": code_hash(scripts_of(arm))}
    if not ((out / "study-done.json").is_file() and json.loads((out / "study-done.json").read_text()) == marker):
        row["seconds"]["zero_shot"] = run_stage(cmd, out / "log.txt", c.stage_hours)[1]
        run.files.atomic_write_json(out / "study-done.json", marker)
    row["commands"]["zero_shot"] = shlex.join(cmd)
    return {split: read_metrics(out / f"eval-{split}")[0] for split in ("dev", "test")}


def run_one(c, arm, seed, n_queries=0, steps=0):
    """One row: pre-training (unless "none"), zero-shot (full-data runs), fine-tuning and its evaluation on dev
    and test. n_queries > 0: the curve, with --steps steps."""
    key = f"{arm}/seed{seed}" if not n_queries else f"{arm}/n{n_queries}/seed{seed}"
    folder = Path(c.out_dir) / key
    row = {"key": key, "arm": arm, "seed": seed, "n_queries": n_queries, "vector": c.vector,
           "similarity": c.similarity, "settings": settings(c, arm), **provenance(c, arm), "commands": {}, "seconds": {}}
    encoder = pretrained_encoder(c, arm, seed, row)
    if not n_queries:
        row["zero_shot"] = zero_shot(c, arm, seed, encoder, row)
        if ARMS[arm] and seed == numbers(c.seeds)[0]:
            row["gradients"] = gradients_in_subprocess(ARMS[arm][0], Path(encoder).parent, row, c.stage_hours)
    cmd = ([sys.executable, "finetune.py", "--init", encoder, "--seed", str(seed), "--out_dir", str(folder / "finetune"),
            "--overwrite", *retriever_flags(c)] + shlex.split(c.finetune_args)
           + (["--n_queries", str(n_queries), "--steps", str(steps)] if n_queries else []))
    row["commands"]["finetune"], row["seconds"]["finetune"] = run_stage(cmd, folder / "finetune.log", c.stage_hours)
    row["finetune_steps"] = json.loads((folder / "finetune" / "stage1" / "config.json").read_text())["steps"]
    row["n_train"] = int(re.search(r"stage1: (\d+) queries", (folder / "finetune.log").read_text()).group(1))
    row["metrics"], row["per_query"] = {}, {}
    for split in ("dev", "test"):
        row["metrics"][split], row["per_query"][split] = read_metrics(folder / "finetune" / f"eval-{split}")
    return row


# ----------------------------------------------------------------------------------------------
# Why a method does (not) act: the gradient each term of its objective sends into the encoder
# ----------------------------------------------------------------------------------------------
def gradient_norms(method, pretrain_folder, n_batches=4):
    """L2 norm of each term's (PretrainModel.terms) gradient on the encoder (mean over the run's first n_batches),
    at the start (as the run seeded it) and after pre-training: {when: {term: [loss, norm]}}. In its own process."""
    import torch
    module = importlib.import_module(method)
    saved = data.read_json(Path(pretrain_folder) / "config.json")
    c = module.Config(**{f.name: saved[f.name] for f in dataclasses.fields(module.Config) if f.name in saved})
    windows = run.load_windows(c, 0)
    batches = module.Batches(c, windows, 0, 1)                               # the run's batches, in its order
    idf = {"idf": module.cached_idf(windows, c.vocab_size, 0)} if getattr(c, "idf_rec", False) else {}
    rows = {}
    for when in ("start", "after"):
        torch.manual_seed(c.seed)                                                # the same new heads as the run's
        encoder = run.init_encoder(module.Encoder, c)
        model = module.PretrainModel(c, encoder, frequent_token=data.most_frequent_token(windows), **idf)  # as train() builds it
        if when == "after":
            model.load_state_dict(run.folders.load_training_state(Path(pretrain_folder) / "state.pt")["model"])
        params = [p for p in model.encoder.parameters() if p.requires_grad]
        norms = {}
        for i in range(n_batches):
            torch.manual_seed(data.step_seed(c.seed, 0, i))                      # dropout as in training
            for name, loss in model.terms(batches[i])[0].items():
                grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None) + 0.0)
                norms.setdefault(name, []).append((loss.item(), float(norm)))
        rows[when] = {name: np.mean(v, axis=0).tolist() for name, v in norms.items()}
    return rows


def gradients_in_subprocess(method, folder, row, hours):
    code = "import json, sys; from research import study; print(json.dumps(study.gradient_norms(*sys.argv[1:3])))"
    cmd = [sys.executable, "-c", code, method, str(folder)]
    log = Path(folder).parent / "gradients.log"
    row["commands"]["gradients"], row["seconds"]["gradients"] = run_stage(cmd, log, hours)
    return json.loads(log.read_text().strip().splitlines()[-1])


def format_gradient_norms(rows, steps):
    lines = ["| when | term | loss | gradient norm on the encoder |", "|---|---|---|---|"]
    for when, terms in rows.items():
        for name, (loss, norm) in terms.items():
            lines.append(f"| {'start' if when == 'start' else f'after {steps} steps'} | {name} | {loss:,.3f} | {norm:.4g} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The plan, resumable: a run whose row is in results_dir is never run again
# ----------------------------------------------------------------------------------------------
def row_path(c, key):
    return Path(c.results_dir) / "runs" / (key.replace("/", "-") + ".json")


def load_rows(c):
    """Every row in results_dir, {key: row}."""
    rows = {}
    for path in sorted((Path(c.results_dir) / "runs").glob("*.json")):
        try:
            row = json.loads(path.read_text())
        except ValueError:
            raise data.DataError(f"{path}: not a JSON row (a cut write?); delete it to run it again") from None
        rows[row["key"]] = row
    return rows


def design_order(rows):
    """Rows as the design lists them (full data, then the curve; arms as in ARMS; seeds): one table on every rerun."""
    order = lambda row: (row["n_queries"], list(ARMS).index(row["arm"]) if row["arm"] in ARMS else len(ARMS), row["seed"])
    return {row["key"]: row for row in sorted(rows.values(), key=order)}


def check_rows(c, rows, runs_left):
    """One table, one code per arm and one set of settings (unless --allow_mixed): refused are rows of other
    settings, of several codes for one arm or the shared scripts, and of another code while runs that would join
    them are left (runs_left). Rows of other code with nothing left to run are reported as what they are."""
    if c.allow_mixed:
        return
    for key, row in rows.items():
        want = settings(c, row["arm"])
        if row.get("settings") != want:
            got = row.get("settings") or {}
            field = next((k for k in want if got.get(k) != want[k]), "settings")
            raise data.DataError(f"{row_path(c, key)}: made with {field} {got.get(field)!r}, this study has "
                                 f"{want.get(field)!r}; use another --results_dir (or move the row away to run it again)")
    if not rows:
        return
    shared = {r.get("shared_code") for r in rows.values()}                  # commits may differ, code may not
    per_arm = {a: sorted({r["code"] for r in rows.values() if r["arm"] == a}) for a in {r["arm"] for r in rows.values()}}
    stale = {a for a, codes in per_arm.items() if codes[0] != code_hash(scripts_of(a))}
    arms_left = {p[1] for p in runs_left}
    mixed = len(shared) > 1 or any(len(codes) > 1 for codes in per_arm.values())
    joined = arms_left & stale or (arms_left and shared != {code_hash(SHARED)})  # new rows beside rows of other code
    if mixed or joined:
        raise data.DataError(f"{c.results_dir}: rows of other code than this one would share a table (rows' code "
                             f"by arm: { {a: per_arm[a] for a in sorted(per_arm)} }; this checkout: "
                             f"{ {a: code_hash(scripts_of(a)) for a in sorted(per_arm)} }); move them away to run "
                             f"them again, or pass --allow_mixed to mix them knowingly")


def estimate(rows, stage):
    seen = [s for r in rows.values() for k, s in r["seconds"].items() if k.startswith(stage)]
    return float(np.median(seen)) if seen else DEFAULT_SECONDS[stage]


def run_cost(c, rows, arm, n_queries):
    cost = estimate(rows, "finetune")
    if not n_queries:
        cost += estimate(rows, "zero_shot") + (estimate(rows, "pretrain") if ARMS[arm] else 0)
    return cost


def run_plan(c, plan, rows, t0, done_before):
    """Run every (arm, seed, n, steps) not yet in rows, printing progress and ETA; returns rows."""
    todo = [p for p in plan if p[0] not in rows]
    total = len(plan)
    for i, (key, arm, seed, n, steps) in enumerate(todo):
        left = sum(run_cost(c, rows, a, m) for _, a, _, m, _ in todo[i:])
        print(f"[{total - len(todo) + i + 1}/{total}] {key}: running | elapsed {run.files.format_seconds(time.time() - t0)} | "
              f"eta {run.files.format_seconds(left)}", flush=True)
        before = code_hash(scripts_of(arm))
        row = run_one(c, arm, seed, n, steps)
        if code_hash(scripts_of(arm)) != before:
            raise RuntimeError(f"{key}: the scripts changed while it ran; its row is not written (rerun the study)")
        rows[key] = row
        run.files.atomic_write_json(row_path(c, key), row)    # at once: a killed study continues from it
    return rows


def runs_left(c, rows):
    """The runs of the plan that have no row yet (the curve's once the full-data runs are all there)."""
    todo = [p for p in full_plan(c) if p[0] not in rows]
    if not todo and numbers(c.low_resource):
        todo = [p for p in curve_plan(c, rows) if p[0] not in rows]
    return todo


def full_plan(c):
    """Seed-major: a study stopped part-way holds every arm of its first seeds (paired comparisons)."""
    return [(f"{a}/seed{s}", a, s, 0, 0) for s in numbers(c.seeds) for a in c.arms.split(",")]


def curve_plan(c, rows):
    arms = curve_arms(c, rows)
    return [(f"{a}/n{n}/seed{s}", a, s, n, rows[f"none/seed{s}"]["finetune_steps"] if f"none/seed{s}" in rows
             else rows[f"{a}/seed{s}"]["finetune_steps"]) for s in numbers(c.seeds) for n in numbers(c.low_resource)
            for a in arms]


def curve_arms(c, rows):
    """--curve_arms, else none, mlm and the method with the best mean DEV nDCG@10 over the seeds."""
    if c.curve_arms:
        return c.curve_arms.split(",")
    arms = c.arms.split(",")
    methods = [a for a in arms if a not in ("none", "mlm")]
    dev = lambda arm: np.mean([rows[f"{arm}/seed{s}"]["metrics"]["dev"]["NDCG@10"] for s in numbers(c.seeds)])
    return [a for a in ("none", "mlm") if a in arms] + ([max(methods, key=dev)] if methods else [])


def print_plan(c, rows):
    full = full_plan(c)
    todo = [p for p in full if p[0] not in rows]
    n_curve = len(numbers(c.low_resource)) * len(numbers(c.seeds)) * (len(c.curve_arms.split(",")) if c.curve_arms else
                                                                    min(3, len(c.arms.split(","))))
    seconds = sum(run_cost(c, rows, a, n) for _, a, _, n, _ in todo)
    curve_done = len([k for k, r in rows.items() if r["n_queries"] in numbers(c.low_resource)]) if not todo else 0
    curve_seconds = (n_curve - curve_done) * estimate(rows, "finetune")
    print(f"study plan: {len(full)} full-data runs ({len(full) - len(todo)} done), then {n_curve} curve runs "
          f"({curve_done} done) | "
          f"vector {c.vector}, {c.similarity}, {len(numbers(c.seeds))} seeds, dev {c.dev_queries} queries | estimated "
          f"{run.files.format_seconds(seconds)} + curve up to {run.files.format_seconds(curve_seconds)} (medians of the finished stages, "
          f"else {DEFAULT_SECONDS})", flush=True)


# ----------------------------------------------------------------------------------------------
# Report: seed-level tests, bootstrap intervals, objective vs chance, figures
# ----------------------------------------------------------------------------------------------
def per_query_matrix(runs, split, metric):
    """(seeds, queries) array of one metric, queries in sorted id order; runs sorted by seed."""
    j = REPORTED.index(metric)
    qids = sorted(runs[0]["per_query"][split])
    return np.array([[r["per_query"][split][q][j] for q in qids] for r in runs])


def compare(a_runs, b_runs, split, metric, resamples):
    """A vs B over their common seeds (None: none): difference, paired t over seed means (1 seed: p None), interval."""
    seeds = sorted({r["seed"] for r in a_runs} & {r["seed"] for r in b_runs})
    if not seeds:
        return None
    a = per_query_matrix([r for r in a_runs if r["seed"] in seeds], split, metric)
    b = per_query_matrix([r for r in b_runs if r["seed"] in seeds], split, metric)
    p = evaluate.paired_t_test(a.mean(1), b.mean(1))[1] if len(seeds) > 1 else None   # over seeds, df = seeds - 1
    low, high = evaluate.bootstrap_difference(a, b, resamples)
    return {"diff": float((a - b).mean()), "low": low, "high": high, "p": p, "seeds": len(seeds)}


def holm(pvalues):
    """Holm's step-down adjustment of a family of p-values (None stays None): {key: adjusted p}."""
    ranked = sorted((p, k) for k, p in pvalues.items() if p is not None)
    out, running = {k: None for k, p in pvalues.items() if p is None}, 0.0
    for i, (p, k) in enumerate(ranked):
        running = max(running, min(1.0, (len(ranked) - i) * p))
        out[k] = running
    return out


def format_difference(d, n_runs):
    """The diff [95% CI] and p cells of one comparison; seeds named when fewer than the arm's own."""
    if d is None:
        return ["n/a (no seed in common)", ""]
    paired = f" ({d['seeds']} paired seeds)" if d["seeds"] != n_runs else ""
    interval = f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" + (" (queries only)" if d["seeds"] < 2 else "")
    p = "n/a (1 seed)" if d["p"] is None else f"{d['p']:.3g}" + (f" (Holm {d['holm']:.3g})" if d.get("holm") is not None else "")
    return [interval + paired, p]


def arm_table(c, full, split):
    arms = [a for a in c.arms.split(",") if full.get(a)]
    refs = [b for b in ("none", "mlm") if full.get(b)]
    head = (["arm", "seeds", "pre-training loop s (median)", "zero-shot nDCG@10"] + list(REPORTED)
            + [f"nDCG@10 {w} vs {b}" for b in refs for w in ("diff [95% CI]", "p (paired t over seeds)")])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    pairs = [(a, b) for a in arms for b in refs if a != b and (a, b) != ("none", "mlm")]   # mlm's row has mlm vs none
    diffs = {(a, b): compare(full[a], full[b], split, "NDCG@10", c.resamples) for a, b in pairs}
    for key, adjusted in holm({k: d["p"] for k, d in diffs.items() if d}).items():   # the table's tests: one family
        diffs[key]["holm"] = adjusted
    cell = lambda v: f"{np.mean(v):.4f} +- {np.std(v, ddof=1):.4f}" if len(v) > 1 else f"{np.mean(v):.4f}"
    for a in arms:
        runs = full[a]
        zero = [r["zero_shot"][split]["NDCG@10"] for r in runs]
        seconds = [r["pretrain_log"]["elapsed_s"] for r in runs if "elapsed_s" in (r.get("pretrain_log") or {})]
        cells = [a, str(len(runs)), f"{np.median(seconds):.0f}" if seconds else "",   # equal steps, not equal compute
                 f"{zero[0]:.4f} (one encoder)" if not ARMS[a] else cell(zero)]
        cells += [cell([r["metrics"][split][m] for r in runs]) for m in REPORTED]
        for b in refs:
            cells += format_difference(diffs[(a, b)], len(runs)) if (a, b) in diffs else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chance_table(full):
    """Each pre-training arm's own objective against its trivial baseline at its last logged step."""
    lines = ["| arm | accuracy | at the end | chance | ratio |", "|---|---|---|---|---|"]
    for arm, runs in full.items():
        logs = [r.get("pretrain_log") or {} for r in runs]
        for key in sorted({k for log in logs for k in log if k.endswith("_acc")}):
            acc = np.mean([log[key] for log in logs if key in log])
            chance_key = key.removesuffix("_acc") + "_chance"                    # mlm_acc -> mlm_chance
            chances = [log[chance_key] for log in logs if chance_key in log]
            chance = f"{np.mean(chances):.4f}" if chances else "n/a"
            ratio = f"{acc / np.mean(chances):.2f}" if chances and np.mean(chances) > 0 else "n/a"
            lines.append(f"| {arm} | {key} | {acc:.4f} | {chance} | {ratio} |")
    return "\n".join(lines)


def curve_table(c, rows, split="test"):
    """Mean +- std over seeds at every n; each arm against none and mlm at the same n and seed (Holm over the curve)."""
    curve = [r for r in rows.values() if r["n_queries"]]
    arms = list(dict.fromkeys(r["arm"] for r in curve))
    ns = sorted({r["n_queries"] for r in curve})
    runs = {(a, n): sorted((r for r in curve if r["arm"] == a and r["n_queries"] == n), key=lambda r: r["seed"])
            for a in arms for n in ns}
    lines = ["| arm | zero-shot (n = 0) | " + " | ".join(f"n = {n}" for n in ns) + " |", "|---" * (len(ns) + 2) + "|"]
    for a in arms:
        zero = [r["zero_shot"][split]["NDCG@10"] for r in rows.values() if r["arm"] == a and not r["n_queries"]]
        cells = [f"{np.mean(zero):.4f}" if zero else ""]                  # the fine-tuning's starting point
        for n in ns:
            v = [r["metrics"][split]["NDCG@10"] for r in runs[(a, n)]]
            cells.append(f"{np.mean(v):.4f} +- {np.std(v, ddof=1):.4f}" if len(v) > 1 else f"{np.mean(v):.4f}" if v else "")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    refs = [b for b in ("none", "mlm") if b in arms]
    diffs = {(a, n, b): compare(runs[(a, n)], runs[(b, n)], split, "NDCG@10", c.resamples)
             for a in arms for n in ns for b in refs
             if a != b and (a, b) != ("none", "mlm") and runs[(a, n)] and runs[(b, n)]}
    if diffs:
        for key, adjusted in holm({k: d["p"] for k, d in diffs.items() if d}).items():
            diffs[key]["holm"] = adjusted
        lines += ["", "| arm | n | " + " | ".join(f"vs {b}: diff [95% CI] | p (paired t over seeds)" for b in refs) + " |",
                  "|---" * (2 + 2 * len(refs)) + "|"]
        for a in arms:
            for n in ns:
                if any((a, n, b) in diffs for b in refs):
                    cells = [cell for b in refs for cell in (format_difference(diffs[(a, n, b)], len(runs[(a, n)]))
                                                             if (a, n, b) in diffs else ["", ""])]
                    lines.append(f"| {a} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(c, rows):
    full = {a: sorted((r for r in rows.values() if r["arm"] == a and not r["n_queries"]), key=lambda r: r["seed"])
            for a in c.arms.split(",")}
    full = {a: runs for a, runs in full.items() if runs}
    some = next(iter(rows.values()))
    code = "; ".join(f"{a} {h} ({', '.join(sorted({r['commit'][:10] + ('+dirty' if r['dirty'] else '') for r in rows.values() if r['arm'] == a and r['code'] == h}))})"
                     for a in dict.fromkeys(r["arm"] for r in rows.values())
                     for h in sorted({r["code"] for r in rows.values() if r["arm"] == a}))
    n_seeds = max(len(runs) for runs in full.values())
    parts = [f"# The study\n\nVector {some['vector']} in pre-training, fine-tuning and evaluation ({some['similarity']}); "
             f"code by arm: {code} (scripts hash (commits)); torch {some['torch']}; {some['machine']}.\n"
             + ("" if all(r["code"] == code_hash(scripts_of(r["arm"])) for r in rows.values()) else
                "\nSome rows come from other code than this checkout's (their arm's scripts hash differs): "
                "rerunning them here could give other numbers.\n"),
             "mean +- std over seeds (ddof=1). diff: mean difference in nDCG@10 (arm minus reference), paired by "
             f"seed; [95% CI]: percentile interval from a bootstrap over queries x seeds ({c.resamples} resamples, "
             "pairing kept; not adjusted for multiplicity); p: two-tailed paired t-test over seeds of each seed's mean "
             "nDCG@10 (df = seeds - 1), unadjusted, with Holm's adjustment over the table's tests in brackets. "
             "The none arm's zero-shot is one evaluation of the checkpoint, the same for every seed.\n"
             + (f"\n**{n_seeds} seed(s), fewer than the 5 the design asks for: the study is part-way; read the "
                f"tests as indicative.**\n" if n_seeds < 5 else "")]
    for split in ("test", "dev"):
        n_q = len(next(iter(full.values()))[0]["per_query"][split])
        note = "; settings were chosen on this split, so its p-values are descriptive only" if split == "dev" else ""
        parts.append(f"## {split} ({n_q} queries{note})\n\n{arm_table(c, full, split)}\n")
    parts.append(f"## Each arm's own objective at the end of pre-training vs its chance level (mean over seeds)\n\n"
                 f"{chance_table({a: r for a, r in full.items() if ARMS[a]})}\n")
    for a, runs in full.items():
        with_grads = [r for r in runs if r.get("gradients")]
        if with_grads:
            parts.append(f"## {a}: gradient norm of each term on the encoder (seed {with_grads[0]['seed']})\n\n"
                         f"{format_gradient_norms(with_grads[0]['gradients'], c.pretrain_steps)}\n")
    if any(r["n_queries"] for r in rows.values()):
        arms = list(dict.fromkeys(r["arm"] for r in rows.values() if r["n_queries"]))
        how = "given by --curve_arms" if c.curve_arms else "none, mlm and the method with the best dev nDCG@10"
        parts.append(f"## Low-resource curve, test nDCG@10 (arms {', '.join(arms)}: {how}; "
                     f"the same optimizer steps at every n as the full-data run; sample s with seed-s encoders)\n\n"
                     f"{curve_table(c, rows)}\n")
    text = "\n".join(parts)
    run.files.atomic_write_text(Path(c.results_dir) / "table.md", text)
    print(text)
    plot_differences(c, full, Path(c.results_dir) / "differences.png")
    if any(r["n_queries"] for r in rows.values()):
        plot_curve(rows, full, Path(c.results_dir) / "low_resource.png")
    return text


def plot_differences(c, full, path, split="test"):
    """Each arm minus "none" per metric, with the bootstrap 95% interval; 0 (no difference) marked."""
    if "none" not in full or len(full) < 2:
        return
    plt = evaluate._pyplot()
    shares_a_seed = lambda a: {r["seed"] for r in full[a]} & {r["seed"] for r in full["none"]}
    arms = [a for a in full if a != "none" and shares_a_seed(a)]
    if not arms:
        return
    fig, axes = plt.subplots(1, len(REPORTED), figsize=(4 * len(REPORTED), 3.2), sharey=False)
    for ax, m in zip(axes, REPORTED):
        ds = [compare(full[a], full["none"], split, m, c.resamples) for a in arms]
        ax.errorbar(range(len(arms)), [d["diff"] for d in ds], fmt="o", capsize=4, color="#4c72b0",
                    yerr=[[d["diff"] - d["low"] for d in ds], [d["high"] - d["diff"] for d in ds]])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_title(f"{m}: arm minus none")
    axes[0].set_ylabel("difference (0 = as none)")
    seeds = max(len(full[a]) for a in arms)
    fig.suptitle(f"{split}: difference from fine-tuning the checkpoint directly, 95% bootstrap interval "
                 f"({'queries x seeds' if seeds > 1 else 'queries only: 1 seed'})", y=1.04)
    evaluate._save_figure(fig, path)


def plot_curve(rows, full, path, split="test"):
    """Test nDCG@10 against training queries; bars: std over seeds (ddof=1); dashed: each arm's zero-shot mean."""
    plt = evaluate._pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    curve = [r for r in rows.values() if r["n_queries"]]
    ticks = set()
    for arm in dict.fromkeys(r["arm"] for r in curve):
        ns = sorted({r["n_queries"] for r in curve if r["arm"] == arm})
        values = [[r["metrics"][split]["NDCG@10"] for r in curve if r["arm"] == arm and r["n_queries"] == n] for n in ns]
        if arm in full:                                      # the full-data runs close the curve
            ns, values = ns + [full[arm][0]["n_train"]], values + [[r["metrics"][split]["NDCG@10"] for r in full[arm]]]
        ticks |= set(ns)
        line = ax.errorbar(ns, [np.mean(v) for v in values], yerr=[np.std(v, ddof=1) if len(v) > 1 else 0 for v in values],
                           marker="o", capsize=3, label=arm)
        if arm in full:                                      # where fine-tuning starts: the encoder before it
            ax.axhline(np.mean([r["zero_shot"][split]["NDCG@10"] for r in full[arm]]), linestyle="--",
                       linewidth=0.9, color=line[0].get_color(), label=f"{arm} zero-shot")
    ax.set_xscale("log")
    ax.set_xticks(sorted(ticks), [str(n) for n in sorted(ticks)])
    ax.minorticks_off()
    ax.set_ylim(0, None)
    ax.set_xlabel("training queries (log scale)")
    ax.set_title("mean, bars: std over seeds (ddof=1)", fontsize=9)
    ax.set_ylabel(f"{split} nDCG@10 (axis from 0)")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    evaluate._save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# --quick: a tiny model on a SciFact subset, the whole study in seconds
# ----------------------------------------------------------------------------------------------
def quick_setup(c):
    """Writes (once) a tiny BEIR folder cut from the bundled SciFact and a tiny random BERT under out_dir."""
    root = Path(c.out_dir) / "quick-data"
    beir, init = root / "scifact-subset", root / "tiny-bert"
    if not (init / "config.json").is_file():
        import gzip
        src = Path(data.SCIFACT)
        corpus, _, train = data.load_beir(src, "train")
        _, _, test = data.load_beir(src, "test")
        queries = data.read_queries(data.find_file(src, "queries.jsonl"))
        train, test = dict(sorted(train.items())[:16]), dict(sorted(test.items())[:8])
        keep = sorted({d for qr in (train, test) for docs in qr.values() for d in docs} | set(list(corpus)[:40]))
        (beir / "qrels").mkdir(parents=True, exist_ok=True)
        with gzip.open(beir / "corpus.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"_id": d, "title": corpus[d]["title"], "text": corpus[d]["text"]}) + "\n" for d in keep)
        (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": queries[q]}) + "\n"
                                                    for q in [*train, *test]))
        for name, qr in (("train", train), ("test", test)):
            (beir / "qrels" / f"{name}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
                f"{q}\t{d}\t{g}\n" for q, docs in qr.items() for d, g in docs.items()))
        make_init = ("import sys, torch, run, finetune; torch.manual_seed(0); run.hub.save_pretrained(finetune.Encoder("
                     "finetune.Config(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, dropout=0.0)), sys.argv[1])")
        run_stage([sys.executable, "-c", make_init, str(init)], root / "tiny-bert.log", c.stage_hours)
    return dataclasses.replace(c, **QUICK, init=str(init), dataset=str(beir))


def main(argv):
    c = run.cli.parse_config(Config, argv, __doc__, {}, FLAG_RULES)
    if c.quick:
        if c.out_dir == Config.out_dir:
            c = dataclasses.replace(c, out_dir="runs/study-quick")
        if c.results_dir == Config.results_dir:
            c = dataclasses.replace(c, results_dir=str(Path(c.out_dir) / "results"))
        c = quick_setup(c)
    check_flags(c)
    if not c.similarity:                      # the checkpoint's own similarity (MiniLM: cos), else the papers' dot
        c = dataclasses.replace(c, similarity=evaluate.read_retriever_settings(run.hub.resolve_model(c.init)).get("similarity", "dot"))
    t0 = time.time()
    run.folders.lock_run_folder(c.results_dir)        # one study at a time writes these rows and tables ...
    rows = load_rows(c)
    if c.report_only:
        check_rows(c, rows, [])
        keys = [key for key, *_ in full_plan(c)] + sorted(k for k, r in rows.items() if r["n_queries"])
        present = {key: rows[key] for key in keys if key in rows}
        if not present:
            raise data.DataError(f"{c.results_dir}: no rows yet")
        report(c, design_order(present))                        # a study part-way: what there is
        return
    check_rows(c, rows, runs_left(c, rows))
    run.folders.lock_run_folder(c.results_dir, create=True)
    run.folders.lock_run_folder(c.out_dir, create=True)    # ... and runs in these run folders
    print_plan(c, rows)
    rows = run_plan(c, full_plan(c), rows, t0, len(rows))
    if numbers(c.low_resource):
        rows = run_plan(c, curve_plan(c, rows), rows, t0, len(rows))
    plan = full_plan(c) + (curve_plan(c, rows) if numbers(c.low_resource) else [])
    report(c, design_order({key: rows[key] for key, *_ in plan}))
    print(f"study: {run.files.format_seconds(time.time() - t0)}; rows in {Path(c.results_dir) / 'runs'}")


if __name__ == "__main__":
    def study():
        try:
            main(sys.argv[1:])
        except RuntimeError as e:             # a stage failed, or the scripts changed under a run: say so
            raise data.DataError(str(e)) from None
    run.cli.run_command_line(study, interrupted="interrupted; the same command continues (finished runs are kept in "
                                             "results/study/runs)")
