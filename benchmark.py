"""Throughput and peak memory of each pre-training method, and of transformers' BertForMaskedLM.

Every variant trains on the same real batches (the bundled Wikipedia slice, the method's own
masking), with the same model size and batch, for --steps optimizer steps after --warmup untimed
ones, in a fresh process of its own so that peak memory is its own:

    python benchmark.py                                   # all variants, the CPU default config
    python benchmark.py --variants costa-mlm,hf-bert-mlm --steps 20
    python benchmark.py --set batch_size=64 --set max_len=256
    python benchmark.py --js                              # CPDAE's contrastive loss: chunked vs naive memory

tokens/s counts real (non-padding) tokens through forward, backward and the AdamW step.
peak memory: max resident set size of the process on CPU (model, optimizer, activations and the
few documents loaded), torch.cuda.max_memory_allocated on GPU.
"""
import argparse
import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import data

# variant -> (module, Config overrides). "costa-mlm" is the papers' BERT/MLM baseline.
VARIANTS = {
    "costa-mlm": ("costa", {"gwc_weight": 0.0}),
    "costa": ("costa", {}),
    "cpdae": ("cpdae", {}),
    "seed": ("seed", {}),
    "hf-bert-mlm": ("costa", {"gwc_weight": 0.0}),   # same batches, transformers' model
}


def load_batches(module, c, n_batches):
    """The first n_batches of the method's own data path, built from 40 real articles."""
    texts = data.read_pretraining_texts(c.corpus)[:40]
    with tempfile.TemporaryDirectory() as tmp:
        c.corpus = str(Path(tmp) / "corpus.jsonl")
        Path(c.corpus).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        windows, special, *extra = module.load_windows(c, 0)
        dataset = module.Batches(c, windows, special, 0, 1, *extra)
        return [dataset[i] for i in range(n_batches)]


def hf_model(c):
    import transformers
    config = transformers.BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                                     intermediate_size=c.ffn_size, max_position_embeddings=c.max_position,
                                     hidden_dropout_prob=c.dropout, attention_probs_dropout_prob=c.dropout)
    model = transformers.BertForMaskedLM(config)
    return lambda batch: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=batch["labels"]).loss, model


def run_one(variant, overrides, steps, warmup):
    module_name, fixed = VARIANTS[variant]
    module = importlib.import_module(module_name)
    torch.manual_seed(0)
    known = {f for f in module.Config.__dataclass_fields__}
    c = module.Config(**{k: v for k, v in {**fixed, **overrides}.items() if k in known})
    c.steps = steps + warmup
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = load_batches(module, c, steps + warmup)
    if variant == "hf-bert-mlm":
        forward, model = hf_model(c)
    else:
        model = module.PretrainModel(c, module.Encoder(c))
        forward = lambda batch: model(batch)[0]
    model.to(device).train()
    optimizer, _ = module.make_optimizer(model, c)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens, t0 = 0, None
    for i, batch in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            tokens, t0 = 0, time.perf_counter()
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast:
            loss = forward(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(batch["attention_mask"].sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20
    n_params = sum(p.numel() for p in model.parameters())
    return {"variant": variant, "tokens_per_s": tokens / elapsed, "peak_mib": peak, "device": device.type,
            "params_m": n_params / 1e6, "batch_size": c.batch_size, "max_len": c.max_len,
            "hidden_size": c.hidden_size, "num_layers": c.num_layers, "threads": torch.get_num_threads()}


def js_memory_one(variant, chunk, m, vocab):
    """Forward + backward of CPDAE's eq. 5 loss on m texts x 2 views over |V| words, in this process.
    'baseline' does everything but the pairwise JS, so (variant - baseline) is the JS's own peak."""
    import cpdae
    torch.set_num_threads(1)
    tiny = torch.rand(2, 4, requires_grad=True)
    cpdae.js_divergence(tiny, tiny).sum().backward()      # one-time imports paid by every variant
    torch.manual_seed(0)
    logits1, logits2 = (torch.randn(m, vocab, requires_grad=True) for _ in range(2))
    start = time.perf_counter()
    dist1, dist2 = cpdae.word_distribution(logits1), cpdae.word_distribution(logits2)   # (m, V) each
    candidates = torch.cat([dist1, dist2])                                             # (2m, V)
    if variant == "baseline":
        sim = -(dist1 @ candidates.T)                                                  # (m, 2m)
    elif variant == "chunked":
        sim = -cpdae.js_divergence(dist1, candidates, chunk_size=chunk)                # (m, 2m)
    else:  # naive: the whole (m, 2m, V) mixture at once, kept by autograd
        mix = 0.5 * (dist1[:, None, :] + candidates[None, :, :])                       # (m, 2m, V)
        js = 0.5 * (torch.xlogy(dist1, dist1).sum(-1)[:, None] + torch.xlogy(candidates, candidates).sum(-1)[None, :]) \
            - torch.xlogy(mix, mix).sum(-1)
        sim = -js
    loss, _ = cpdae.two_view_contrastive_loss(sim)
    loss.backward()
    return {"variant": variant, "chunk": chunk, "loss": loss.item(), "seconds": time.perf_counter() - start,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def js_memory_table(m, vocab):
    """Each variant in a fresh process (ru_maxrss is a high-water mark), twice: as is, and with glibc's
    mmap threshold pinned at 1 MiB so that freed blocks go back to the OS and the peak is live memory."""
    print(f"CPDAE contrastive loss (eq. 5), {m} texts x 2 views, |V| = {vocab:,}, forward + backward, 1 thread")
    print(f"{'variant':<12}{'peak-baseline MiB':>19}{'(pinned malloc)':>17}{'seconds':>9}  loss")
    base = None
    for variant, chunk in [("baseline", 0), ("chunked", 1), ("chunked", 4), ("chunked", 8), ("chunked", 16),
                           ("naive", 0)]:
        cmd = [sys.executable, __file__, "--js-one", f"{variant}:{chunk}:{m}:{vocab}"]
        rows = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
                for env in (os.environ, {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)})]
        base = base or rows
        name = f"{variant} {chunk}" if variant == "chunked" else variant
        print(f"{name:<12}{rows[0]['peak_mib'] - base[0]['peak_mib']:>19,.0f}"
              f"{rows[1]['peak_mib'] - base[1]['peak_mib']:>17,.0f}{rows[0]['seconds']:>9.1f}  {rows[0]['loss']:.6f}",
              flush=True)


# ----------------------------------------------------------------------------------------------
# --scale: start-up time and peak memory against corpus size, token cache vs the in-memory windows
# ----------------------------------------------------------------------------------------------
TINY_MODEL = ["--hidden_size", "64", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "128",
              "--batch_size", "32", "--max_len", "128", "--steps", "2", "--log_every", "1", "--save_every", "1000",
              "--bf16", "false", "--overwrite"]   # a tiny model: what grows with the corpus is the data path


def synthetic_corpus(folder, millions):
    """A plain-text corpus of about `millions` million WordPiece tokens: the bundled Wikipedia slice
    (1.17 M tokens) repeated, its documents shuffled in every copy, blank lines between documents."""
    texts = data.read_pretraining_texts(data.WIKI)
    per_copy = sum(len(e.ids) for e in data.load_tokenizer().encode_batch(texts, add_special_tokens=False))
    copies = max(1, round(millions * 1e6 / per_copy))
    path = Path(folder) / f"corpus-{millions}M" / "corpus.txt"
    if not path.is_file():
        rng = np.random.default_rng(0)

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                for _ in range(copies):
                    for i in rng.permutation(len(texts)):
                        f.write(texts[i].replace("\n\n", "\n") + "\n\n")
        data._atomic(path, write)
    return path, copies * per_copy


def legacy_load_windows(c, rank):
    """The data path before the token cache: every rank reads and tokenizes the whole corpus into
    Python lists (make_windows). For --scale's "before" rows only."""
    tokenizer = data.load_tokenizer(c.vocab)
    windows = data.make_windows(tokenizer, data.read_pretraining_texts(c.corpus), c.max_len)
    vocab_tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    return windows, data.special_ids(tokenizer), vocab_tokens


def run_legacy_costa(argv):
    import costa
    costa.load_windows = legacy_load_windows
    costa.train(data.parse_config(costa.Config, argv, costa.__doc__, costa.PAPER_PRESET, costa.FLAG_RULES))


def measure(cmd):
    """Run cmd in a fresh wrapper process; return (seconds to the first 'step' line, wall seconds,
    peak RSS in MiB of the largest process it started (a rank; ru_maxrss of the children))."""
    wrapper = ("import json, resource, subprocess, sys, time\n"
               "t0 = time.time(); first = None\n"
               "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)\n"
               "for line in p.stdout:\n"
               "    if first is None and line.startswith('step'): first = time.time() - t0\n"
               "    tail = line\n"
               "if p.wait(): sys.exit('failed: ' + tail)\n"
               "print(json.dumps([first, time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))\n")
    result = subprocess.run([sys.executable, "-c", wrapper] + cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: {result.stderr.strip() or result.stdout.strip()}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def scale_table(sizes, procs, before_max, folder, workers):
    """Rows: corpus size x processes x (before | after, first run | second run)."""
    print("| corpus | processes | data path | run | time to first step | peak RSS per rank |")
    print("|---|---|---|---|---|---|")
    built = []
    for millions in sizes:
        corpus, n_tokens = synthetic_corpus(folder, millions)
        for n in procs:
            if n == procs[0]:
                for cache in Path(corpus).parent.glob("*.tokens-*"):
                    shutil.rmtree(cache)                      # the first run builds the cache
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
            common = ["--corpus", str(corpus), "--out_dir", str(Path(folder) / "run"), "--prep_workers", str(workers)]
            variants = [("token cache", "first (builds it)", launch + ["costa.py"])] if n == procs[0] else []
            variants.append(("token cache", "second", launch + ["costa.py"]))
            if millions <= before_max:
                variants.insert(0, ("in memory (before)", "every run", launch + [__file__, "--legacy_costa"]))
            for path_name, run, cmd in variants:
                first, wall, rss = measure(cmd + common + TINY_MODEL)
                print(f"| {n_tokens / 1e6:,.0f} M tokens | {n} | {path_name} | {run} | {first:.1f} s | {rss:,.0f} MiB |",
                      flush=True)
        (manifest,) = Path(corpus).parent.glob("*.tokens-*/manifest.json")
        m = json.loads(manifest.read_text())
        disk = sum(f.stat().st_size for f in manifest.parent.iterdir()) / 2**20
        built.append(f"{m['n_tokens']:,} tokens: tokenized in {m['seconds']} s ({m['tokens_per_s']:,} tokens/s, "
                     f"{workers or os.cpu_count()} workers), cache {disk:,.0f} MiB on disk")
    print("\n" + "\n".join(built))


def parse_value(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="Config override for every variant, e.g. batch_size=64")
    parser.add_argument("--js", action="store_true", help="CPDAE's JS loss memory, chunked vs naive")
    parser.add_argument("--js_texts", type=int, default=64, help="texts (x 2 views) for --js")
    parser.add_argument("--scale", default="", metavar="SIZES",
                        help="start-up time and peak RSS against corpus size, e.g. 1,20,200 (million tokens)")
    parser.add_argument("--scale_procs", default="1,2", help="torchrun processes for --scale")
    parser.add_argument("--scale_before_max", type=float, default=20,
                        help="largest size (million tokens) also run on the old in-memory path")
    parser.add_argument("--scale_dir", default="runs/bench-scale", help="synthetic corpora and caches for --scale")
    parser.add_argument("--prep_workers", type=int, default=0, help="tokenizing processes (0 = all cores)")
    parser.add_argument("--legacy_costa", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--one", help=argparse.SUPPRESS)          # internal: run one variant, print JSON
    parser.add_argument("--js-one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.legacy_costa is not None:
        run_legacy_costa(args.legacy_costa)
        return
    if args.scale:
        scale_table([float(x) if "." in x else int(x) for x in args.scale.split(",")],
                    [int(x) for x in args.scale_procs.split(",")], args.scale_before_max, args.scale_dir,
                    args.prep_workers)
        return
    if args.js_one:
        variant, chunk, m, vocab = args.js_one.split(":")
        print(json.dumps(js_memory_one(variant, int(chunk), int(m), int(vocab))))
        return
    if args.js:
        js_memory_table(args.js_texts, 30522)
        return
    if args.one:
        print(json.dumps(run_one(args.one, overrides, args.steps, args.warmup)))
        return
    print(f"{'variant':<14}{'tokens/s':>10}{'peak MiB':>10}  setup")
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            sys.exit(f"error: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        cmd = [sys.executable, __file__, "--one", variant, "--steps", str(args.steps),
               "--warmup", str(args.warmup)] + [x for s in args.set for x in ("--set", s)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{variant:<14}{'failed':>10}  {last}")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{variant:<14}{r['tokens_per_s']:>10,.0f}{r['peak_mib']:>10,.0f}  {r['params_m']:.1f}M params, "
              f"{r['num_layers']}x{r['hidden_size']}, batch {r['batch_size']}x{r['max_len']}, "
              f"{r['device']} ({r['threads']} threads)", flush=True)


if __name__ == "__main__":
    main()
