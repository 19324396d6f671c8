"""Each method's real loop, eager against --compile (the encoder compiled, and CPDAE's and SEED's vocabulary-sized
losses), as tokens/s and MFU: the loops are results/gpu/compile_encoder.sh's torchrun runs, each run folder named
METHOD-ARM (eager, compiled, compiled-inductor-rng). Tokens/s: the median of the run's logged intervals after the
first (which holds the start and the compile; a later batch length compiles once more inside one interval). FLOPs
per token: torch's FlopCounterMode on one eager step at the run's config (research/benchmark.py's step; the compiled
step computes the same matmuls). MFU against the card's nominal dense bf16 peak and against a bf16 matmul's rate
measured here, at 8192^3 and at the model's (B*L x 768) @ (768 x 3072).

    python results/gpu/compile_encoder.py RUNS_DIR            # the table, after the loops
    python results/gpu/compile_encoder.py --inductor_rng SCRIPT ARGS...   # SCRIPT with the encoder's dropout drawn
                                                              # by inductor's own generator (torchrun runs this file)
"""
import argparse
import dataclasses
import importlib
import json
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]   # the repository root
sys.path.insert(0, str(ROOT))
from research import benchmark

ARMS = ("eager", "compiled", "compiled-inductor-rng")


def with_inductor_rng(script, argv):
    """Run script as __main__ with torch.compile's fallback_random option dropped: run.speed.compiled_encoder's
    compile then draws the encoder's dropout masks with inductor's generator inside its fused kernels, not with
    eager's (what its equality to eager costs)."""
    compile = torch.compile

    def compile_own_rng(*args, options=None, **kwargs):
        options = {k: v for k, v in (options or {}).items() if k != "fallback_random"}
        return compile(*args, options=options or None, **kwargs)
    torch.compile = compile_own_rng
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def logged_tokens_per_s(folder):
    """(median tokens/s of the log intervals after the first, intervals, last step) of a run folder."""
    rows = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows[1:]] or [r["tokens_per_s"] for r in rows]
    return float(np.median(rates)), len(rows), rows[-1]["step"] if rows else 0


def flops_per_token(module, c, device):
    """FlopCounterMode's FLOPs of one eager step (forward + backward) at c, per real token of its batches."""
    torch.manual_seed(0)
    batches = benchmark.load_batches(module, c, 2, n_texts=400)
    step = benchmark.pretrain_step(module, dataclasses.replace(c, compile=False), batches, device)
    step()
    flops = benchmark.counted_flops(step, optimize=False)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)
    del step
    device.type == "cuda" and torch.cuda.empty_cache()
    return flops / tokens


def table(runs, device):
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name() if gpu else "CPU (dry run)"
    nominal = next((v for k, v in benchmark.NOMINAL_BF16_TFLOPS.items() if k in name), None)
    folders = sorted(p for p in Path(runs).iterdir() if (p / "log.jsonl").is_file())
    if not folders:
        sys.exit(f"no run folders with a log.jsonl under {runs}")
    c0 = json.loads((folders[0] / "config.json").read_text())
    rows = c0["batch_size"] * c0["max_len"]
    side = 8192 if gpu else 1024                  # the CPU's dry run: a smaller square
    rate = benchmark.cuda_matmul_rate if gpu else lambda *mkn: benchmark.matmul_rate(*mkn, torch.bfloat16) / 1e3
    big, shaped = rate(side, side, side), rate(rows, c0["hidden_size"], c0["ffn_size"])
    print(f"{name}; torch {torch.__version__}; bf16 matmul measured: {big:,.1f} TFLOP/s at {side}^3, {shaped:,.1f} at "
          f"({rows} x {c0['hidden_size']}) @ ({c0['hidden_size']} x {c0['ffn_size']}); nominal dense bf16 peak "
          f"{nominal or '?'} TFLOP/s\n")
    print("| method | arm | batch x length | intervals logged (to step) | tokens/s | x eager | GFLOP per token | TFLOP/s "
          "| MFU nominal | MFU measured (square) | MFU measured (model's shape) |\n|---|---|---|---|---|---|---|---|---|---|---|")
    per_token, eager = {}, {}
    for folder in sorted(folders, key=lambda p: (p.name.split("-", 1)[0], ARMS.index(p.name.split("-", 1)[1]))):
        method, arm = folder.name.split("-", 1)
        module = importlib.import_module(method)
        saved = json.loads((folder / "config.json").read_text())
        c = module.Config(**{k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(module.Config)}})
        c.steps = 10 ** 6
        if method not in per_token:
            per_token[method] = flops_per_token(module, c, device)
        tokens, n, last = logged_tokens_per_s(folder)
        eager.setdefault(method, tokens if arm == "eager" else None)
        tflops = tokens * per_token[method] / 1e12
        share = lambda rate, tflops=tflops: f"{tflops / rate:.1%}" if rate else "?"
        print(f"| {method} | {arm} | {c.batch_size * c.grad_accum} x {c.max_len} | {n} ({last}) | {tokens:,.0f} | "
              f"{f'{tokens / eager[method]:.2f}' if eager[method] else '?'} | {per_token[method] / 1e9:.3f} | "
              f"{tflops:,.1f} | {share(nominal)} | {share(big)} | {share(shaped)} |", flush=True)


def main():
    if sys.argv[1:2] == ["--inductor_rng"]:
        return with_inductor_rng(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", help="a folder of run folders named METHOD-ARM (costa-eager, costa-compiled, ...)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    table(args.runs, torch.device(args.device))


if __name__ == "__main__":
    main()
