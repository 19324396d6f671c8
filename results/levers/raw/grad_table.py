"""Per-term gradient norm on the encoder (new heads excluded):
    python results/levers/raw/grad_table.py METHOD [state.pt|-] --flag value ...
Same construction as study.cpdae_gradient_norms: init checkpoint, seed-c.seed heads, batches 0..n-1,
dropout as in training."""
import importlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
import data
import run

method, state = sys.argv[1], sys.argv[2]
module = importlib.import_module(method)
argv = ["--init", "minilm", "--corpus", "data/scifact/corpus.jsonl.gz", "--lr", "5e-5", "--steps", "50"] + sys.argv[3:]
c = run.parse_config(module.Config, argv, "", module.PAPER_PRESET, module.FLAG_RULES)
import dataclasses

c = dataclasses.replace(c, init=run.resolve_model(c.init))
torch.set_num_threads(1)
out = module.load_windows(c, 0)
windows, special = out[0], out[1]
extra = out[2:]
batches = module.Batches(c, windows, special, 0, 1, *extra)
torch.manual_seed(c.seed)
encoder = module.Encoder.from_pretrained(c.init, c)
c = encoder.config
model = module.PretrainModel(c, encoder, frequent_token=data.most_frequent_token(windows))
if state != "-":
    model.load_state_dict(run.load_training_state(state)["model"])
new = {id(p) for p in model.new_parameters()}
params = [p for p in model.encoder.parameters() if id(p) not in new]
norms = {}
n = int(__import__("os").environ.get("NB", "2"))
t0 = time.time()
for i in range(n):
    torch.manual_seed(data.step_seed(c.seed, 0, i))
    with module.autocast_bf16(torch.device("cpu"), c.bf16):
        terms, metrics = model.terms(batches[i])
    for name, loss in terms.items():
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None))
        norms.setdefault(name, []).append((loss.item(), norm.item()))
    print({k: round(float(v), 4) for k, v in metrics.items()}, flush=True)
print(f"{method} {' '.join(sys.argv[3:])} state={state} ({time.time()-t0:.0f}s, {n} batches)")
for name, v in norms.items():
    loss, norm = np.mean(v, axis=0)
    print(f"| {name} | {loss:,.4f} | {norm:.4g} |")
