"""Where a method's GPU step goes: torch.profiler over 3 steps of BERT-base, batch 32 x 512, bf16 autocast,
after 3 warm-up steps; the top CUDA kernels by time. Usage: python3 results/gpu/gpu_profile.py seed [cpdae ...]"""
import importlib
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import benchmark

for variant in sys.argv[1:]:
    module_name, fixed = benchmark.VARIANTS[variant]
    module = importlib.import_module(module_name)
    c = module.Config(**{**fixed, **benchmark.BERT_BASE, "max_len": 512, "batch_size": 32})
    c.steps = 10 ** 6
    torch.manual_seed(0)
    step = benchmark.pretrain_step(module, c, benchmark.load_batches(module, c, 4, n_texts=400),
                                   torch.device("cuda"), hf=variant == "hf-bert-mlm")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"\n== {variant}: 3 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
