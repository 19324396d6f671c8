"""Speed and memory: each training step against this machine's matmul rate, the goals, and the
throughput and peak memory of each method and of transformers' BertForMaskedLM.

The default run prints, in one run (so that whatever else the machine does slows every row alike):
this machine's bf16 and fp32 matmul rate at the models' shapes; each training step (the encoder alone
at MiniLM's size, every method at the CPU default size and at MiniLM's, a finetune.py step), timed
round-robin in one process, with its FLOPs (counted from the matmul shapes by torch's FlopCounterMode,
forward + backward; the encoder's also analytically: 6 x non-embedding weights x tokens + attention)
and the share of the matmul rate it reaches; the goals table (measure | goal | today); then the
per-variant table: every variant trains on the same real batches (the bundled Wikipedia slice, the
method's own masking), with the same model size and batch, for --steps optimizer steps after
--warmup untimed ones, in a fresh process of its own so that peak memory is its own:

    python -m research.benchmark                          # speed table, goals, then all variants
    python -m research.benchmark --quick --variants ''    # the methods at 4 x 256 only, eager and --compile
    python -m research.benchmark --variants costa-mlm,hf-bert-mlm --steps 20
    python -m research.benchmark --set batch_size=64 --set max_len=256
    python -m research.benchmark --gpu                    # BERT-base, batch 32 x 512, on one GPU: MFU per method
    python -m research.benchmark --gpu --compile          # ... each method eager and with --compile

Each run writes what it prints to results/speed/benchmark.md (--gpu: results/gpu/benchmark-gpu.md; --out
FILE elsewhere), under a head naming the commit, the command, the CPU, its native bf16 support, the
precision, the date and the run time (recorded), so that a page can cite the file.

tokens/s counts real (non-padding) tokens through forward, backward and the AdamW step.
peak memory: max resident set size of the process on CPU (model, optimizer, activations and the
few documents loaded), torch.cuda.max_memory_allocated on GPU.

One-off experiments live beside the numbers they produced, as scripts that take the helpers they share
from this file: results/speed/ (finetune.py against sentence-transformers, encoder levers,
micro-benchmarks, profiles, the memory of CPDAE's contrastive loss), results/st-ndcg/ (test nDCG@10
against sentence-transformers), results/scale/ (start-up time and peak memory against corpus size, with
the in-memory data path the token cache replaced; peak memory of encode + search; faiss indexes). Each
writes what it prints to a file beside it, the same way.
"""
import argparse
import contextlib
import dataclasses
import gc
import importlib
import io
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import data
import evaluate
import run

ROOT = Path(__file__).resolve().parent.parent   # the repository root
# variant -> (module, Config overrides). "costa-mlm" is the papers' BERT/MLM baseline.
VARIANTS = {
    "costa-mlm": ("costa", {"gwc_weight": 0.0}),
    **{m: (m, {}) for m in run.METHODS},
    "hf-bert-mlm": ("costa", {"gwc_weight": 0.0}),   # same batches, transformers' model
}
MINILM = {"hidden_size": 384, "num_layers": 6, "num_heads": 12, "ffn_size": 1536}   # all-MiniLM-L6-v2's sizes
BERT_BASE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "ffn_size": 3072}
# --compile compiles every method's encoder (run.speed.compiled_encoder), and CPDAE's and SEED's vocabulary-sized loss
# too (run.speed.fused): each method runs eager and compiled here (MLM-only, COSTA's own encoder, eager: a second
# compile of one file's encoder would reuse the first's); FLOP_RATIO: the methods of the FLOP-ratio goal
COMPILED, FLOP_RATIO = run.METHODS, ("cpdae", "seed")
FORMER = "costa-mlm, former encoder"   # the speed table's row of the encoder before it became plain torch
DEFAULT_STEPS = run.TrainConfig.steps   # a default run's steps (each method's Config): the payback's horizon
GOALS = {"encoder": 0.40, "st_speed": 1.5, "method_vs_flops": 1.1, "st_rss": 0.5, "plain_encoder": 1.15}   # the goals table's
ST_NDCG_RESULTS = ROOT / "results" / "st-ndcg"   # st_ndcg.py's rows there (committed): the goals table reads them


# Measurement helpers ------------------------------------------------------------------------------
def in_fresh_process(script, *argv, env=None, hours=6.0):
    """Run `python script *argv` in a new process (so that its peak RSS is its own) and return the JSON
    of its last stdout line; RuntimeError with its last stderr line if it fails. script: a file, or a module of
    this repository as its dotted name (a str not ending in .py, e.g. "research.benchmark"), run as `python -m`
    from the repository root. A measurement takes minutes: one still running after `hours` is taken for hung,
    killed and named (RuntimeError too)."""
    module = isinstance(script, str) and not script.endswith(".py")
    cmd = [sys.executable, *(["-m", script] if module else [str(script)]), *map(str, argv)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=hours * 3600,
                                cwd=ROOT if module else None)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"still running after {run.files.format_seconds(hours * 3600)}, taken for hung and killed: "
                           f"{shlex.join(cmd)}") from None
    if result.returncode:
        raise RuntimeError((result.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(result.stdout.strip().splitlines()[-1])


def reset_peak_rss():
    """Zero this process's peak-RSS mark (Linux: VmHWM, via /proc/self/clear_refs), so that the peak read
    next is the training steps', not the setup's (reading the corpus, BM25). False where it cannot."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib():
    """This process's peak RSS in MiB since the last reset_peak_rss (else since it started)."""
    try:
        return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return run.ranks.max_rss_mib()


def cpu_bf16():
    """Whether training autocasts to bf16 on this CPU (the rule of run.autocast_bf16)."""
    return any(getattr(torch.cpu, f"_is_{x}_supported", lambda: False)() for x in ("avx512_bf16", "amx_tile"))


def machine(command):
    """Where and how a measurement ran, for the head of its results file: the commit (with "+changes" when
    the code differs from it, as evaluate.git_state says), the command, the CPU's model, its native bf16
    (AVX512-BF16, AMX) and so the precision training autocasts to there, the threads, torch's version and the
    date (UTC)."""
    commit, dirty = evaluate.git_state()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        cpu = platform.processor() or platform.machine()
    native = {x: getattr(torch.cpu, f"_is_{x}_supported", lambda: False)() for x in ("avx512_bf16", "amx_tile")}
    return {"commit": commit[:7] + ("+changes" if dirty else ""),
            "command": command, "cpu": cpu, "cpu_bf16": native,
            "precision": "bf16" if any(native.values()) else "fp32", "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


class _Tee:
    """A stream that writes to several streams (recorded's stdout)."""
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self):
        for stream in self.streams:
            stream.flush()


def command_line():
    """This process's command as typed: `python -m research.benchmark ...` for a module run with -m (sys.argv[0] is
    then its file's full path), else `python script ...`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return shlex.join(["python", *(["-m", spec.name, *sys.argv[1:]] if spec else sys.argv)])


@contextlib.contextmanager
def recorded(path):
    """Print as usual, and when the command finishes write what it printed to `path` (markdown, under
    results/), under a head from machine(): the commit, the command, the CPU, its native bf16 and so the
    precision, the date and how long it took. A page cites that file; a run that fails writes nothing."""
    command = command_line()
    head, buffer, stdout, t0 = machine(command), io.StringIO(), sys.stdout, time.time()
    sys.stdout = _Tee(stdout, buffer)
    try:
        yield
    finally:
        sys.stdout = stdout
    native = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in head["cpu_bf16"].items())
    text = (f"# `{command}`\n\nWhat the command printed, as written by it (`benchmark.recorded`).\n\n"
            f"| commit | CPU | native bf16 | precision | threads | torch | date | took |\n|---|---|---|---|---|---|---|---|\n"
            f"| {head['commit']} | {head['cpu']} | {native} | {head['precision']} | {head['threads']} | {head['torch']} "
            f"| {head['date']} | {time.time() - t0:,.0f} s |\n\n{buffer.getvalue()}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    run.files.atomic_write_text(Path(path), text)
    print(f"(written to {path})")


def matmul_rate(m, k, n, dtype, reps=15):
    """GFLOP/s of one (m, k) @ (k, n) matmul in dtype on this process's threads: the median of reps."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / np.median(times) / 1e9


def encoder_flops(c, batch, length):
    """Analytic FLOPs of one forward + backward of the encoder: 6 x non-embedding weights x tokens (2 for
    the forward's multiply-adds, 4 for the backward's two gradients) plus the attention's two (L x L)
    matmuls per layer (12 x layers x B x L^2 x H)."""
    per_layer = 4 * c.hidden_size ** 2 + 2 * c.hidden_size * c.ffn_size           # q, k, v, out; ffn in and out
    return 6 * c.num_layers * per_layer * batch * length + 12 * c.num_layers * batch * length ** 2 * c.hidden_size


def counted_flops(fn, *args, **kwargs):
    """Matmul FLOPs of fn(*args, **kwargs) as run, counted from the shapes by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


def eager_flops(step):
    """counted_flops of step(optimize=False), of its eager twin where it has one (step.eager: the same model and
    batches with --compile off): inside a compiled loss the counter sees no op, and the compiled step computes the
    same matmuls."""
    return counted_flops(step.eager() if hasattr(step, "eager") else step, optimize=False)


def load_batches(module, c, n_batches, n_texts=40):
    """The first n_batches of the method's own data path (its Batches), built from n_texts real articles."""
    texts = data.read_pretraining_texts(c.corpus)[:n_texts]
    with tempfile.TemporaryDirectory() as tmp:
        c.corpus = str(Path(tmp) / "corpus.jsonl")
        Path(c.corpus).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        dataset = module.Batches(c, run.load_windows(c, 0), 0, 1)
        return [dataset[i] for i in range(n_batches)]


def hf_model(c):
    """transformers' BertForMaskedLM at c's sizes, and its loss on one of our MLM batches."""
    import transformers
    config = transformers.BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                     intermediate_size=c.ffn_size, max_position_embeddings=c.max_position,
                                     hidden_dropout_prob=c.dropout, attention_probs_dropout_prob=c.dropout)
    model = transformers.BertForMaskedLM(config)
    return lambda batch: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=batch["labels"]).loss, model


def as_trained(module, model, c):
    """The wrappers module.train() puts on its PretrainModel's pieces, one process (across_ranks is the identity):
    the same attribute names as train() assigns (a test compares them), so a step here is training's step."""
    name = module.__name__
    if name == "costa":
        model.span_vectors = run.in_fp32(module.span_vectors)
        model.gwc_loss = run.across_ranks(run.in_fp32(module.gwc_loss), module.gather_across_ranks)
        if model.projector:
            model.projector.forward = run.in_fp32(model.projector.forward)
        model.encoder.forward = run.speed.compiled_encoder(model.encoder, c)
    elif name == "cpdae":
        model.decoder.out.forward = run.in_fp32(model.decoder.out.forward)
        model.cosine_similarity = run.in_fp32(module.cosine_similarity)
        model.js_similarity = run.speed.fused(module.js_similarity, c, run.speed.in_row_chunks(
            module.js_similarity, c.js_chunk), sweep_per_input=True)
        model.contrastive_loss = run.across_ranks(module.contrastive_loss, module.gather_across_ranks)
        model.encoder.forward = run.speed.compiled_encoder(model.encoder, c)
    elif name == "seed":
        eq9 = run.speed.fused(module.decoder_loss, c, lambda *a: module.chunked_decoder_loss(*a, c.dec_chunk))
        model.decoder_loss = run.speed.padded_rows(eq9, bucket=-(-c.batch_size * (c.max_len - 1) // 8))
        model.encoder.forward = run.speed.compiled_encoder(model.encoder, c)
    return model


def pretrain_step(module, c, batches, device=None, hf=False):
    """A closure running one full pre-training step (forward, backward, AdamW) on the next batch, cycling;
    with hf, of transformers' BertForMaskedLM on the same batches. step.model is the model."""
    device = device or torch.device("cpu")
    if hf:
        forward, model = hf_model(c)
    else:
        model = as_trained(module, module.PretrainModel(c, module.Encoder(c)), c)
        forward = lambda batch: model(batch)[0]
    model.to(device).train()
    optimizer, _ = run.make_optimizer(model, c, eps=1e-6 if module.__name__ == "seed" else 1e-8)   # as train()
    batches = [{k: v.to(device) for k, v in batch.items()} for batch in batches]
    autocast, it = run.autocast_bf16(device, c.bf16), iter(batches * 1000)

    def step(optimize=True):
        with autocast:
            loss = forward(next(it))
        loss.backward()
        if optimize:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step.model = model
    if getattr(c, "compile", False) and not hf:   # the FLOP count's twin: --compile's wrappers are bound at build
        step.eager = lambda: pretrain_step(module, dataclasses.replace(c, compile=False), batches, device)
    return step


def finetune_batches(n_batches, bm25=False):
    """finetune.py's own batches (TrainBatches) from SciFact's training queries: 32 queries x (positive + 1
    negative), 64 / 128 tokens. Negatives from BM25 (as finetune.py's stage 1) with bm25, else random
    documents (the step's cost depends on the lengths only). Returns (batches, doc_texts, queries, c)."""
    import finetune
    c = finetune.Config(steps=n_batches)
    corpus, queries, qrels = data.load_beir(str(data.SCIFACT), "train")
    doc_ids = list(corpus)
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    doc_texts = [evaluate.passage_text(corpus[d]) for d in doc_ids]
    examples = finetune.make_examples(queries, qrels, doc_index)
    if bm25:
        with tempfile.TemporaryDirectory() as tmp:
            examples = finetune.bm25_negative_pools(c, examples, doc_texts, doc_ids, doc_index,
                                                    Path(tmp) / "neg.tsv", torch.device("cpu"), False)
    dataset = finetune.TrainBatches(c, examples, doc_texts, data.load_tokenizer(), 0, 1)
    return [dataset[i] for i in range(n_batches)], doc_texts, [ex.query for ex in examples], c


def finetune_step(batches, init="", change=None):
    """A closure running one finetune.py step as train_stage runs it: BiEncoder forward (autocast), backward,
    clipping, AdamW; from the checkpoint init, else a random MiniLM-size encoder. change(encoder), if given,
    alters the encoder and returns the context each step runs in (results/speed/levers.py)."""
    import finetune
    c = finetune.retriever_settings(finetune.Config(init=init)) if init else \
        finetune.Config(pooling="mean", similarity="cos", **MINILM)
    encoder = evaluate.load_encoder(init, c) if init else evaluate.Encoder(c)
    encoder.mlm_head, c = None, encoder.config
    model = finetune.BiEncoder(encoder, c).train()
    context = change(encoder) if change else contextlib.nullcontext       # before the optimizer: new weights
    optimizer, _ = run.make_optimizer(model, dataclasses.replace(c, steps=10 ** 6))
    autocast, it = run.autocast_bf16(torch.device("cpu"), c.bf16), iter(batches * 1000)

    def step(optimize=True):
        with context():
            with autocast:
                loss, _ = model(next(it))
            loss.backward()
        if optimize:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


# The encoder as it was before it became plain torch (numpy's PCG64 dropout masks, a CPU attention path apart from
# SDPA): timed in the same run as the plain one, so that the plain encoder's cost on the CPU is a ratio of one run.
def _former_drop_mask(shape, p):
    n = int(np.prod(shape))
    bits = np.random.PCG64(int(torch.randint(2**62, ()))).random_raw((n + 1) // 2)   # uint64: 2 draws each
    draws = torch.from_numpy(bits.view(np.int32)[:n]).view(shape)                   # uniform int32
    return draws < round(p * 2**32) - 2**31


def _former_dropout(x, p, training=True):
    if not training or p == 0.0:
        return x
    return x.masked_fill(_former_drop_mask(x.shape, p), 0.0) * (1 / (1 - p))


def _former_attention(q, k, v, attend, p=0.0):
    if not torch.is_grad_enabled():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p)
    hide = torch.zeros(attend.shape).masked_fill(~attend, torch.finfo(torch.float32).min)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2) + hide
    probs = scores.softmax(-1).to(v.dtype)
    if p == 0:
        return probs @ v
    return (probs.masked_fill(_former_drop_mask(probs.shape, p), 0.0) @ v) * (1 / (1 - p))


class _FormerFunctional:
    """torch.nn.functional, its dropout the former CPU one."""
    dropout = staticmethod(_former_dropout)

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)


def with_former_encoder(module, step):
    """step() with module's encoder as it was: its attention and dropout swapped in for the step, then back."""
    def former_step(optimize=True):
        plain = module.attention, module.F
        module.attention, module.F = _former_attention, _FormerFunctional()
        try:
            step(optimize)
        finally:
            module.attention, module.F = plain
    former_step.model = step.model
    return former_step


# The default run: the speed table, the goals, the per-variant table -------------------------------
def speed_variants(quick=False):
    """(name, size, step closure, analytic FLOPs or None) for every row of the speed table: each method eager
    and with --compile (its encoder compiled, and CPDAE's and SEED's vocabulary-sized loss), against MLM-only. quick:
    the methods at 4 x 256 only (no encoder, 6 x 384 or finetune rows)."""
    import costa
    rows = []
    if not quick:
        big = costa.Config(**MINILM)
        encoder = costa.Encoder(big).train()
        ids, mask = torch.randint(1000, 30000, (32, 128)), torch.ones(32, 128, dtype=torch.long)

        def encoder_step(optimize=True):
            with run.autocast_bf16(torch.device("cpu")):
                hidden = encoder(ids, mask)                                      # (32, 128, 384)
            hidden.float().square().mean().backward()
            encoder.zero_grad(set_to_none=True)
        rows.append(("encoder fwd+bwd", "6x384", encoder_step, encoder_flops(big, 32, 128)))
    for size, fields in [("4x256", {})] + ([] if quick else [("6x384", MINILM)]):
        for variant in ("costa-mlm", *run.METHODS):
            module_name, fixed = VARIANTS[variant]
            module = importlib.import_module(module_name)
            for compiled in (False, True) if variant in COMPILED else (False,):
                c = module.Config(**{**fixed, **fields}, compile=compiled)
                c.steps = 10 ** 6
                name = variant + (" --compile" if compiled else "")
                batches = load_batches(module, c, 4)
                rows.append((name, size, pretrain_step(module, c, batches), None))
                if variant == "costa-mlm" and size == "4x256" and not compiled:   # the same step, the encoder as it was
                    rows.append((FORMER, size, with_former_encoder(module, pretrain_step(module, c, batches)), None))
    if not quick:
        ft_batches, *_ = finetune_batches(4)
        rows.append(("finetune", "6x384", finetune_step(ft_batches), None))
    return rows


def speed_table(reps, quick=False):
    """Step times measured round-robin in this one process (median of reps), so that whatever else the
    machine does slows every row alike; FLOPs counted per step; shares of the bf16 matmul rate. The first
    step of each row is timed apart: with --compile it holds the compile, from an empty cache (first_ms)."""
    from torch._inductor.utils import fresh_cache  # inductor's own: an empty compile cache, in-memory ones cleared
    torch.manual_seed(0)
    bf16 = cpu_bf16()
    rate = {size: (matmul_rate(4096, h, f, torch.bfloat16), matmul_rate(4096, h, f, torch.float32))
            for size, h, f in (("4x256", 256, 1024), ("6x384", 384, 1536))}
    print(f"matmul rate, (4096 x H) @ (H x 4H), {torch.get_num_threads()} threads: " + "; ".join(
        f"{size}: bf16 {b:,.0f} GFLOP/s, fp32 {f:,.0f} GFLOP/s" for size, (b, f) in rate.items()) +
        f" (training autocasts to {'bf16' if bf16 else 'nothing: fp32'})", flush=True)
    rows = speed_variants(quick)
    flops, first, times = [], [], [[] for _ in rows]
    for name, _, step, _ in rows:
        # a compiled row's first step compiles from an empty cache, as a first run on a machine does (else the later
        # rows would reuse the kernels of the first: the same encoder at the same shapes)
        with fresh_cache() if name.endswith(" --compile") else contextlib.nullcontext():
            t0 = time.perf_counter()
            step()
            first.append(1000 * (time.perf_counter() - t0))
        flops.append(eager_flops(step))
        step()
    for _ in range(reps):
        for i, (_, _, step, _) in enumerate(rows):
            t0 = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - t0)
    out = []
    print(f"\n| step (batch 32 x 128) | size | ms/step | first step ms | GFLOP/step | GFLOP/s | share of the "
          f"{'bf16' if bf16 else 'fp32'} matmul rate |\n|---|---|---|---|---|---|---|")
    for (name, size, _, analytic), f, t, t1 in zip(rows, flops, times, first):
        ms = 1000 * float(np.median(t))
        achieved = f / (ms / 1000) / 1e9
        share = achieved / rate[size][0 if bf16 else 1]
        check = f" (analytic {analytic / 1e9:.1f})" if analytic else ""
        print(f"| {name} | {size} | {ms:,.0f} | {t1:,.0f} | {f / 1e9:.1f}{check} | {achieved:,.0f} | {share:.0%} |",
              flush=True)
        out.append({"name": name, "size": size, "ms": ms, "first_ms": t1, "flops": f, "share": share})
    return out


def st_ndcg_summary(results):
    """'ours mean ± std against st mean ± std, paired t over seeds' from results/st-ndcg's rows, or ''."""
    rows = {}
    for path in sorted(Path(results).glob("*-seed*.json")):
        r = json.loads(path.read_text())
        rows.setdefault(r["which"], {})[r["seed"]] = r["metrics"]["NDCG@10"]
    seeds = sorted(set(rows.get("ours", {})) & set(rows.get("st", {})))
    if not seeds:
        return ""
    ours, st = ([rows[w][s] for s in seeds] for w in ("ours", "st"))
    sd = lambda x: np.std(x, ddof=1) if len(x) > 1 else float("nan")
    _, p = evaluate.paired_t_test(ours, st)
    return (f"{np.mean(ours):.4f} ± {sd(ours):.4f} against {np.mean(st):.4f} ± {sd(st):.4f} (mean ± std over "
            f"seeds {','.join(map(str, seeds))}; difference {np.mean(ours) - np.mean(st):+.4f}, paired t over "
            f"seeds p = {p:.2f})")


def goals_table(speed):
    """measure | goal | today, from this run's numbers (and results/st-ndcg's rows)."""
    by = {(r["name"], r["size"]): r for r in speed}
    lines = ["\n| measure | goal | today |", "|---|---|---|"]
    enc = by.get(("encoder fwd+bwd", "6x384"))
    if enc:
        lines.append(f"| encoder fwd+bwd, 6x384, batch 32 x 128: share of the bf16 matmul rate | >= {GOALS['encoder']:.0%} "
                     f"| {enc['share']:.0%} |")
    for size in ("4x256", "6x384"):
        base = by.get(("costa-mlm", size))
        for method in FLOP_RATIO:
            for name in (method, method + " --compile"):
                r = by.get((name, size))
                if base and r:
                    time_ratio, flop_ratio = r["ms"] / base["ms"], r["flops"] / base["flops"]
                    lines.append(f"| {name} step time / MLM-only's, {size}, over their FLOP ratio ({time_ratio:.2f}x / "
                                 f"{flop_ratio:.2f}x) | <= {GOALS['method_vs_flops']} | {time_ratio / flop_ratio:.2f} |")
        for method in COMPILED:
            eager, compiled = by.get((method, size)), by.get((method + " --compile", size))
            if eager and compiled:
                lines.append(f"| {method} --compile against eager, {size}: step speed-up; compile paid back after "
                             f"| faster; within a default run ({DEFAULT_STEPS} steps) | "
                             f"{compiled_payoff(eager, compiled)} |")
    plain, former = by.get(("costa-mlm", "4x256")), by.get((FORMER, "4x256"))
    if plain and former:
        lines.append(f"| the plain encoder (torch's dropout, attention as its formula): MLM-only's step against the "
                     f"former encoder's (PCG64 masks, a CPU attention path), 4x256 | <= {GOALS['plain_encoder']}x | "
                     f"{plain['ms'] / former['ms']:.2f}x |")
    lines.append(f"| finetune.py vs sentence-transformers: speed, peak RSS | >= {GOALS['st_speed']}x, "
                 f"<= {GOALS['st_rss']}x | not run here (python results/speed/st.py) |")
    ndcg = st_ndcg_summary(ST_NDCG_RESULTS)
    lines.append(f"| finetune.py vs sentence-transformers: test nDCG@10, 3 seeds each | at least equal | "
                 f"{ndcg + ', results/st-ndcg' if ndcg else 'not measured (python results/st-ndcg/st_ndcg.py 0,1,2)'} |")
    print("\n".join(lines))


def compiled_payoff(eager, compiled):
    """'1.9x as fast; compile (60 s) paid back after 80 steps: pays in a default run' from two speed-table rows: the
    compiled step's speed-up, and after how many steps its first step's extra time (the compile, from an empty cache:
    speed_table) is recovered by the faster steps, against a default run's DEFAULT_STEPS."""
    saved = eager["ms"] - compiled["ms"]                                  # per step, once compiled
    extra = compiled["first_ms"] - compiled["ms"] - (eager["first_ms"] - eager["ms"])   # the compile
    speedup = f"{eager['ms'] / compiled['ms']:.2f}x as fast"
    if extra <= 0:   # within the first steps' noise
        return f"{speedup}; no compile time above the first step's noise"
    if saved <= 0:
        return f"{speedup}; compile ({extra / 1000:.0f} s) never paid back: **does not pay**"
    after = math.ceil(extra / saved)
    verdict = "pays in a default run" if after <= DEFAULT_STEPS else "**does not pay** in a default run"
    return f"{speedup}; compile ({extra / 1000:.0f} s) paid back after {after:,} steps: {verdict}"


def variant_row(variant, overrides, steps, warmup):
    """tokens/s and peak memory of `steps` training steps after `warmup` untimed ones, in this process
    (run it in a fresh one: the peak RSS is the process's)."""
    module_name, fixed = VARIANTS[variant]
    module = importlib.import_module(module_name)
    torch.manual_seed(0)
    c = module.Config(**{k: v for k, v in {**fixed, **overrides}.items() if k in module.Config.__dataclass_fields__})
    c.steps = steps + warmup
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = load_batches(module, c, steps + warmup)
    step = pretrain_step(module, c, batches, device, hf=variant == "hf-bert-mlm")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    reset_peak_rss()                                 # the training steps' peak, not the corpus reading's
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    elapsed = time.perf_counter() - t0
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[warmup:])
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mib()
    return {"variant": variant, "tokens_per_s": tokens / elapsed, "peak_mib": peak,
            "device": device.type, "params_m": sum(p.numel() for p in step.model.parameters()) / 1e6,
            "batch_size": c.batch_size, "max_len": c.max_len, "hidden_size": c.hidden_size,
            "num_layers": c.num_layers, "threads": torch.get_num_threads()}


def variant_table(variants, overrides, steps, warmup):
    """variant_row of each variant, each in a fresh process."""
    print(f"\nEach variant in a fresh process, {steps} steps after {warmup} untimed:\n\n"
          "| variant | tokens/s | peak MiB | setup |\n|---|---|---|---|")
    for variant in variants:
        try:
            r = in_fresh_process("research.benchmark", "--child", "variant_row", json.dumps([variant, overrides, steps, warmup]))
        except RuntimeError as e:
            print(f"| {variant} | failed: {e} | | |")
            continue
        print(f"| {variant} | {r['tokens_per_s']:,.0f} | {r['peak_mib']:,.0f} | {r['params_m']:.1f}M params, "
              f"{r['num_layers']}x{r['hidden_size']}, batch {r['batch_size']}x{r['max_len']}, "
              f"{r['device']} ({r['threads']} threads) |", flush=True)


# --gpu: the papers' size on one GPU, as model FLOP utilisation (MFU) ------------------------------
NOMINAL_BF16_TFLOPS = {"H100 80GB HBM3": 989, "H100 PCIe": 756, "H200": 989, "A100": 312}   # dense, spec sheets


def cuda_matmul_rate(m, k, n, reps=20):
    """TFLOP/s of one bf16 (m, k) @ (k, n) matmul on the GPU: the median of reps, each timed by CUDA events."""
    a, b = (torch.randn(m, k, device="cuda").bfloat16(), torch.randn(k, n, device="cuda").bfloat16())
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * m * k * n / np.median(times[3:]) / 1e12


def gpu_row(variant, batch, length, steps, warmup, compile=False, device="cuda", overrides=None):
    """(seconds per step, tokens per step, peak bytes, FLOPs per step, first step's seconds) of one variant at
    BERT-base size; compile: --compile (its encoder compiled, and run.speed.fused), its compile in the first step."""
    module_name, fixed = VARIANTS[variant]
    module = importlib.import_module(module_name)
    c = module.Config(**{**fixed, **BERT_BASE, **(overrides or {}), "max_len": length, "batch_size": batch,
                         "compile": compile})
    c.steps = 10 ** 6
    torch.manual_seed(0)
    batches = load_batches(module, c, 4, n_texts=400)
    step = pretrain_step(module, c, batches, torch.device(device), hf=variant == "hf-bert-mlm")
    gpu = device == "cuda"
    sync = torch.cuda.synchronize if gpu else lambda: None
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    flops = eager_flops(step)
    for _ in range(warmup):
        step()
    sync()
    gpu and torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / steps
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)
    return seconds, tokens, torch.cuda.max_memory_allocated() if gpu else peak_rss_mib() * 2**20, flops, first


def gpu_table(batch, length, steps, warmup, variants, compile=False, device="cuda", overrides=None):
    """BERT-base (the papers' size) on one GPU at batch x length, bf16 autocast, one variant after the other
    in this process (each eager, and with compile also with --compile): step time, tokens/s, peak memory,
    FLOPs per step (FlopCounterMode, forward + backward) and MFU, the achieved FLOP/s over the measured bf16
    matmul rate and over the card's nominal peak. device "cpu": a dry run of this path (--gpu_device cpu, where
    --set's overrides make the model small)."""
    gpu = device == "cuda"
    name = torch.cuda.get_device_name() if gpu else "CPU (dry run)"
    nominal = next((v for k, v in NOMINAL_BF16_TFLOPS.items() if k in name), None)
    rate, ceiling = ((cuda_matmul_rate(batch * length, 768, 3072), cuda_matmul_rate(8192, 8192, 8192)) if gpu else
                     (matmul_rate(batch * length, 768, 3072, torch.bfloat16) / 1e3,) * 2)
    print(f"{name}: bf16 matmul {rate:,.0f} TFLOP/s at (B*L x 768) @ (768 x 3072), {ceiling:,.0f} at 8192^3; "
          f"nominal dense bf16 peak {nominal or '?'} TFLOP/s", flush=True)
    print(f"\n| step, 12x768, batch {batch} x {length} | ms/step | first step s | tokens/s | peak GiB | TFLOP/step "
          f"| TFLOP/s | MFU (measured rate) | MFU (nominal) |\n|---|---|---|---|---|---|---|---|---|")
    for variant in variants:
        for compiled in (False, True) if compile and variant in COMPILED else (False,):
            s, tokens, peak, flops, first = gpu_row(variant, batch, length, steps, warmup, compiled, device, overrides)
            gpu and torch.cuda.empty_cache()               # the variant's model and optimizer are gone
            achieved = flops / s / 1e12
            print(f"| {variant}{' --compile' if compiled else ''} | {1000 * s:,.1f} | {first:,.1f} | {tokens / s:,.0f} "
                  f"| {peak / 2**30:.1f} | {flops / 1e12:.2f} | {achieved:,.0f} | {achieved / rate:.0%} | "
                  f"{f'{achieved / nominal:.0%}' if nominal else '?'} |", flush=True)


CHILDREN = {f.__name__: f for f in (variant_row,)}   # run by in_fresh_process


def parse_value(text):
    """A --set value: JSON (numbers, true/false), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main():
    parser = argparse.ArgumentParser(prog="python -m research.benchmark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="per-variant table ('' = none); --gpu's too")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Config override for every variant, e.g. batch_size=64")
    parser.add_argument("--reps", type=int, default=5, help="speed table: timed round-robin passes")
    parser.add_argument("--quick", action="store_true", help="speed table: the methods (eager, --compile) at 4x256 only")
    parser.add_argument("--gpu", action="store_true", help="BERT-base on one GPU: step time, memory and MFU per method")
    parser.add_argument("--compile", action="store_true", help="--gpu: each method eager and with --compile")
    parser.add_argument("--gpu_device", default="cuda", choices=("cuda", "cpu"),
                        help="--gpu on the CPU: a dry run of the GPU path (with a small --gpu_batch and --gpu_len)")
    parser.add_argument("--gpu_batch", type=int, default=32, help="--gpu: texts per step")
    parser.add_argument("--gpu_len", type=int, default=512, help="--gpu: tokens per text")
    parser.add_argument("--out", default="", help="the results file this run writes what it prints to "
                        "(default results/speed/benchmark.md; with --gpu results/gpu/benchmark-gpu.md)")
    parser.add_argument("--child", nargs=2, metavar=("FUNCTION", "ARGS"), help=argparse.SUPPRESS)  # in_fresh_process
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:                                     # before the minutes of the speed table
        sys.exit(f"error: --variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](*json.loads(args.child[1]))))
    elif args.gpu:
        if args.gpu_device == "cuda" and not torch.cuda.is_available():
            sys.exit("error: --gpu: no CUDA device")
        with recorded(args.out or ROOT / "results" / "gpu" / "benchmark-gpu.md"):
            overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
            gpu_table(args.gpu_batch, args.gpu_len, args.steps, args.warmup, variants, args.compile, args.gpu_device,
                      overrides)
    else:
        with recorded(args.out or ROOT / "results" / "speed" / "benchmark.md"):
            t0 = time.perf_counter()
            goals_table(speed_table(args.reps, args.quick))
            print(f"\n(the speed table and the goals: {time.perf_counter() - t0:.0f} s)", flush=True)
            overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
            if variants:
                variant_table(variants, overrides, args.steps, args.warmup)


if __name__ == "__main__":
    main()
