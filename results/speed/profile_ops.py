"""Where a method's step time goes beyond its FLOP ratio to MLM-only: torch.profiler's self CPU time of
2 full training steps per variant (4 x 256, batch 32 x 128, bf16 where the CPU has it), grouped by op kind,
next to the step's matmul FLOPs. A method whose time share outside matmul is large spends it on work that
the FLOP ratio does not count. What it prints is written
to results/speed/profile_ops.md.

    python results/speed/profile_ops.py costa-mlm,cpdae,seed
"""
import importlib
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
from research import benchmark

OP_GROUPS = (("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
             ("softmax / log-softmax", ("_softmax", "_log_softmax", "_softmax_backward_data",
                                        "_log_softmax_backward_data")),
             ("copies and casts", ("copy_", "to", "_to_copy", "clone", "contiguous")),
             ("fills and masks", ("fill_", "zero_", "masked_fill_", "bernoulli_", "where")))


def op_group(name):
    """The group of a profiler op name (aten::mm -> matmul); everything else is elementwise / other."""
    op = name.split("::")[-1]
    return next((group for group, ops in OP_GROUPS if op in ops), "elementwise and other")


def profile_table(variants, steps=2):
    groups = [g for g, _ in OP_GROUPS] + ["elementwise and other"]
    print("| variant | ms/step | GFLOP/step | " + " | ".join(groups) + " | top 3 ops (share of self time) |\n|" +
          "---|" * (len(groups) + 4))
    for variant in variants:
        module_name, fixed = benchmark.VARIANTS[variant]
        module = importlib.import_module(module_name)
        c = module.Config(**fixed)
        c.steps = 10 ** 6
        step = benchmark.pretrain_step(module, c, benchmark.load_batches(module, c, 4))
        step()
        flops = benchmark.counted_flops(step, optimize=False)
        step()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        ms = 1000 * (time.perf_counter() - t0) / steps
        ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        total = sum(t for _, t in ops) or 1
        share = dict.fromkeys(groups, 0.0)
        for name, t in ops:
            share[op_group(name)] += t / total
        top = ", ".join(f"{name.split('::')[-1]} {t / total:.0%}" for name, t in sorted(ops, key=lambda o: -o[1])[:3])
        print(f"| {variant} | {ms:,.0f} | {flops / 1e9:.1f} | " + " | ".join(f"{v:.0%}" for v in share.values()) +
              f" | {top} |", flush=True)


if __name__ == "__main__":
    variants = sys.argv[1].split(",") if len(sys.argv) > 1 else ["costa-mlm", "cpdae", "seed"]
    unknown = [v for v in variants if v not in benchmark.VARIANTS or v == "hf-bert-mlm"]
    if unknown:
        sys.exit(f"error: unknown {unknown}; choose from costa-mlm, costa, cpdae, seed")
    with benchmark.recorded(Path(__file__).parent / "profile_ops.md"):
        profile_table(variants)
