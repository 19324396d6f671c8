"""Frozen-encoder plateau of each method's new head on MiniLM features (SciFact, batch 32 x 128):
cache MiniLM's last hidden states (eval, no grad, bf16 autocast as training) for NB batches, train only the
head (the method's own PretrainModel pieces and loss functions) with AdamW at a constant lr, report the
head's accuracy vs chance on a held-out batch.
    python _wip/plateau_heads.py METHOD LR STEPS NB --flag value ...
"""
import dataclasses
import importlib
import sys
import time
from functools import partial

import torch

sys.path.insert(0, ".")
import data
import run

torch.set_num_threads(1)
method, lrs, steps, NB = sys.argv[1], [float(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
M = importlib.import_module(method)
argv = ["--init", "minilm", "--corpus", "data/scifact/corpus.jsonl.gz"] + sys.argv[5:]
c = run.parse_config(M.Config, argv, "", {}, {})
c = dataclasses.replace(c, init=run.resolve_model(c.init))
torch.manual_seed(0)
enc = M.Encoder.from_pretrained(c.init, c).eval(); c = dataclasses.replace(enc.config, **{k: getattr(c, k) for k in ("bottleneck",)})
enc.config = c
out = M.load_windows(c, 0)
windows, special, extra = out[0], out[1], out[2:]
top = data.most_frequent_token(windows)
batches = M.Batches(c, windows, special, 0, 1, *extra)
model = M.PretrainModel(c, enc, frequent_token=top)
cache = []
t0 = time.time()
with torch.no_grad(), M.autocast_bf16(torch.device("cpu")):
    for i in range(NB):
        b = batches[i]
        mask = b["attention_mask"].repeat(2, 1) if method == "cpdae" else b["attention_mask"]
        cache.append((b, enc(b["input_ids"], mask).float()))
print(f"{method} {' '.join(sys.argv[5:])} lrs {lrs}: cached {NB} batches in {time.time()-t0:.0f}s", flush=True)


def head_step(b, hidden):
    """(loss, acc, chance) of the method's own head on frozen hidden states, as PretrainModel.terms does."""
    if method == "costa":
        h0 = M.text_vector(hidden, b["attention_mask"], c.bottleneck)
        z, spans = model.projector(h0), M.span_vectors(hidden, b["spans"])
        loss, acc = M.gwc_loss_and_accuracy(z, z, spans, 0, c.tau, c.gwc_sim)
        S = spans.shape[1]
        return loss, acc, S / (z.shape[0] * (S + 1) - 1)
    if method == "seed":
        h0 = M.text_vector(hidden, b["attention_mask"], c.bottleneck)
        states = model.decoder.decode(model.decoder.embed(b["decoder_input"]), h0)
        kept = b["decoder_targets"] != -100
        targets = b["decoder_targets"][kept]
        loss, correct = M.chunked_decoder_loss(states[kept], model.decoder.word_embedding[0].weight, targets, c.dec_chunk)
        return loss, correct / targets.numel(), M.most_frequent_accuracy(targets, top)
    if method == "cpdae":
        mask = b["attention_mask"].repeat(2, 1)
        h = M.text_vector(hidden, mask, c.bottleneck)
        logits = model.decoder(h)
        rec = M.reconstruction_loss(logits, b["bag"].repeat(2, 1), None, c.rec_reduction)
        v1, v2 = M.word_distribution(logits).chunk(2)
        cl, acc = M.gathered_contrastive_loss(v1, v2, partial(M.js_similarity, chunk_size=c.js_chunk, tau=c.cl_tau))
        head_step.extra = (round(float(rec), 4), round(float(cl), 4))
        return rec + c.cl_weight * cl, acc, 1 / (2 * v1.shape[0] - 1)
    if method == "mlm":
        pass


initial = {k: v.clone() for k, v in model.state_dict().items()}
for lr in lrs:
    model.load_state_dict(initial)                                   # the same fresh head for every lr
    params = list(model.new_parameters())
    params = [p for p in params if not any(p is q for q in enc.mlm_head.parameters())]   # the method's own head
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    model.train()
    print(f" lr {lr:g}", flush=True)
    for step in range(1, steps + 1):
        b, hidden = cache[(step - 1) % (NB - 1)]
        loss, acc, chance = head_step(b, hidden)
        loss.backward(); opt.step(); opt.zero_grad()
        if step % max(1, steps // 4) == 0 or step == steps:
            with torch.no_grad():
                model.eval()
                tl, tacc, tch = head_step(*cache[-1])
                model.train()
            ex = getattr(head_step, "extra", None)
            print(f"  step {step}: train loss {float(loss):.4f} | held-out loss {float(tl):.4f} acc {float(tacc):.4f} "
                  f"chance {float(tch):.4f} ratio {float(tacc) / max(float(tch), 1e-9):.2f}" + (f" | rec, cl {ex}" if ex else "")
                  + f" ({time.time()-t0:.0f}s)", flush=True)

if __import__("os").environ.get("GRAD"):
    # per-term gradient norm on the encoder (new heads excluded) with the head as trained above (last lr)
    new = {id(p) for p in model.new_parameters()}
    enc_params = [p for p in enc.parameters() if id(p) not in new]
    for p in enc_params:
        p.requires_grad_(True)
    model.train()
    for i in range(2):
        torch.manual_seed(data.step_seed(c.seed, 0, i))
        with M.autocast_bf16(torch.device("cpu")):
            terms, metrics = model.terms(batches[i])
        for name, loss in terms.items():
            grads = torch.autograd.grad(loss, enc_params, retain_graph=True, allow_unused=True)
            norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads if g is not None))
            print(f"  after head training, batch {i}: | {name} | {loss.item():,.4f} | {norm.item():.4g} |", flush=True)
        print("  metrics", {k: round(float(v), 4) for k, v in metrics.items()}, flush=True)
