"""Frozen-encoder plateau of a new MLM head on MiniLM features (SciFact, batch 32 x 128, BERT masking):
cache the encoder's last hidden states at masked positions for NB batches (eval, no grad), then train a
fresh MLMHead (decoder tied to MiniLM's frozen embeddings) with AdamW at several lrs; accuracy on a held-out batch."""
import dataclasses
import sys
import time

import torch

sys.path.insert(0, ".")
import costa
import data
import run

torch.set_num_threads(1)
c = run.parse_config(costa.Config, ["--init", "minilm", "--corpus", "data/scifact/corpus.jsonl.gz", "--gwc_weight", "0"], "", {}, {})
c = dataclasses.replace(c, init=run.resolve_model(c.init))
enc = costa.Encoder.from_pretrained(c.init, c).eval(); c = enc.config
windows, special, vocab_tokens = costa.load_windows(c, 0)
top = data.most_frequent_token(windows)
batches = costa.Batches(c, windows, special, 0, 1, vocab_tokens)
NB = int(sys.argv[1]) if len(sys.argv) > 1 else 9
feats, labels = [], []
t0 = time.time()
with torch.no_grad(), costa.autocast_bf16(torch.device("cpu")):
    for i in range(NB):
        b = batches[i]
        h = enc(b["input_ids"], b["attention_mask"]).float()
        m = b["labels"] != -100
        feats.append(h[m]); labels.append(b["labels"][m])
print(f"cached {NB} batches in {time.time()-t0:.0f}s")
test_x, test_y = feats[-1], labels[-1]
print("chance (most frequent token) on held-out:", float((test_y == top).float().mean()))
for lr in [float(x) for x in sys.argv[2:]] or [5e-5, 1e-3, 5e-3, 2e-2]:
    torch.manual_seed(0)
    head = costa.MLMHead(c, enc.embeddings.word)
    head.apply(costa.Encoder._init_weights)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    accs = []
    STEPS = int(__import__("os").environ.get("STEPS", "40"))
    for step in range(STEPS):
        x, y = feats[step % (NB - 1)], labels[step % (NB - 1)]
        loss = torch.nn.functional.cross_entropy(head(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
        if (step + 1) % max(1, STEPS // 6) == 0:
            with torch.no_grad():
                acc = float((head(test_x).argmax(-1) == test_y).float().mean())
            accs.append((step + 1, round(loss.item(), 3), round(acc, 4)))
    print(f"lr {lr:g}: (step, train loss, held-out acc) {accs}", flush=True)
