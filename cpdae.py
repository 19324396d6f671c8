"""CPDAE: contrastive pre-training of a discriminative autoencoder with an MLP decoder.

Ma et al., CIKM 2022 (arXiv:2208.09846, section 3). Every text is masked twice; an MLP decoder turns
the text vector into a word distribution; the loss reconstructs the text's bag of words and contrasts
the two views' word distributions. The paper's equations, in order, and the function that computes each:

    eq. 1     the text vector h_[CLS] of a masked view                 text_vector (Encoder.forward at the end)
    eq. 2-3   decoder z = MLP(h_[CLS]); z_hat = sigmoid(z) and the     Decoder, word_distribution
              word distribution z_tilde = z_hat / sum_j z_hat_j
    eq. 4     bag-of-words reconstruction (binary cross-entropy)      reconstruction_loss (IDF-REC: idf_from_df)
    eq. 5     contrastive loss between the views' distributions       contrastive_loss
    eq. 6     L = L_REC + L_MLM + lambda L_CL                          PretrainModel.terms (L_MLM: mlm_loss)
    eq. 7     the similarity s = -JS(z_tilde', z_tilde'')              js_similarity (CPDAE_R: cosine_similarity)

It has costa.py's skeleton section for section, COSTA's own parts swapped for CPDAE's (`diff costa.py
cpdae.py`). The run machinery (run folder, resume, checkpoints, progress, Ctrl-C) is in run/, one call each
from train(). Each departure from the paper is said where it happens, tagged; docs/departures.md lists them.

    python cpdae.py --preset lab                     # first: its head learns, on a CPU (docs/lab.md)
    python cpdae.py                                  # small model, bundled Wikipedia slice, CPU, from scratch
    python cpdae.py --cl_weight 0                    # Table 2 "w/o CL"; add --idf_rec: Table 2 "IDF-REC" (no CL)
    python cpdae.py --cl_mode cls                    # CPDAE_R (Table 1): contrast the [CLS] vectors
    torchrun --nproc_per_node=4 cpdae.py --preset paper --init bert-base-uncased/
    python cpdae.py --resume                         # continue from out_dir/state.pt exactly
    python cpdae.py --overwrite                      # start again in an out_dir that holds a run (else refused)

The encoder is written to {out_dir}/encoder as a Hugging Face BERT folder for finetune.py, with the MLP
decoder beside it in decoder.safetensors (Decoder.from_pretrained; the Table 4 figure needs it).
"""
import contextlib
import datetime
import json
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import data
import run


# ==============================================================================================
# Config
# ==============================================================================================
@dataclass
class Config(run.TrainConfig):
    """CPDAE's own flags (section 3.2, eq. 6; variants of Tables 1-2). batch_size counts texts: 2 views
    each. The flags every method shares (corpus, model size, optimisation, run folder) are run.TrainConfig's."""
    cl_weight: float = 0.1        # lambda in L = L_REC + L_MLM + lambda * L_CL (eq. 6); 0 = Table 2 "w/o CL"
    cl_mode: str = "js"           # "js": -JS between word distributions (eq. 5); "cls": CPDAE_R, [CLS] vectors
    cls_temperature: float = 0.1  # CPDAE_R similarity = cosine / temperature (the paper gives none: our choice)
    idf_rec: bool = False         # weight eq. 4's word terms by corpus IDF; with --cl_weight 0, Table 2's "IDF-REC"
    js_chunk: int = 8             # eager: anchors per block of pairwise JS: peak ~5 x js_chunk x 2M x |V| fp32
    cl_tau: float = 1.0           # eq. 5's similarity is -JS / cl_tau (1 = the paper's; -JS alone keeps L_CL near ln(2m-1))
    rec_reduction: str = "sum"    # eq. 4 over the vocabulary: "sum" (the paper's) or "mean" (/|V|, as DupMAE's BoW loss)

    compile: bool = True          # eq. 5 fused, the encoder compiled: 1.92x on a CPU (results/speed/compile-encoder.md)
    out_dir: str = "runs/cpdae"   # checkpoints, config.json and log.jsonl go here


# --preset paper: section 4.1.3. From BERT's checkpoint (--init bert-base-uncased), BERT-base sizes, lr 5e-5 with
# Adam and 10% linear warm-up, 3 epochs of Wikipedia, batch m = 64 texts (x 2 views) over all ranks, lambda 0.1
# (Config's default). Silent: the maximum length (512: BERT's and the authors' COSTA), Adam's epsilon (torch's
# 1e-8), the decay after warm-up (linear), weight decay and clipping.
PAPER_PRESET = dict(hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072, max_len=512, lr=5e-5,
                    warmup=0.1, epochs=3.0, global_batch=64, **run.PAPER_RUN)   # PAPER_RUN: workers, checkpoints
# --preset lab: run.LAB_PRESET (MiniLM on SciFact, 50 steps), eq. 4 per word and -JS / 0.02 (eq. 5 then moves).
LAB_PRESET = dict(run.LAB_PRESET, rec_reduction="mean", cl_tau=0.02)


# The domain of each of CPDAE's flags, checked when the flags are parsed, before any work (with TrainConfig's).
FLAG_RULES = {
    "cl_weight": ">= 0", "cls_temperature": "> 0", "js_chunk": ">= 1", "cl_mode": "one of {js, cls}",
    "cl_tau": "> 0", "rec_reduction": "one of {sum, mean}",
}


# ==============================================================================================
# Model: the encoder (eq. 1) is the shared block at the end of this file; CPDAE adds the decoder
# ==============================================================================================
# --- shared: begin text vector ---
BOTTLENECKS = ("cls", "mean")   # --bottleneck: which vector of the encoder a method trains as the text's


def text_vector(hidden, attention_mask, bottleneck="cls"):
    """The text's vector, the one a method trains (and retrieval should read): "cls" = the last layer's [CLS]
    state, the papers'; "mean" = the mean of the output tokens over the attention mask (padding not), MiniLM's
    pooling. Departure (option-bottleneck-mean): the papers bottleneck through [CLS].
    hidden (B, L, H), attention_mask (B, L) 1 = token -> (B, H)."""
    if bottleneck == "cls":
        return hidden[:, 0]                                                      # (B, H)
    weights = attention_mask.to(hidden.dtype)[..., None]                         # (B, L, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)     # (B, H)
# --- shared: end text vector ---


class Decoder(nn.Module):
    """MLP decoder (3.1.2, eq. 2): z = Linear(H, |V|)(LayerNorm(GELU(Linear(H, H)(h_[CLS])))), one logit per
    vocabulary entry: our reading of "two layers of FFN with GELU and a LayerNorm" (BERT's MLM head, untied; the
    paper gives no order or size). Dropped for fine-tuning, kept beside the encoder for the Table 4 figure."""

    def __init__(self, hidden_size, vocab_size, layer_norm_eps=1e-12):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.out = nn.Linear(hidden_size, vocab_size)
        for linear in (self.dense, self.out):               # BERT's initialisation, as the encoder's
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, h_cls):                                                    # (N, H)
        h = self.norm(F.gelu(self.dense(h_cls)))                                 # (N, H)
        return self.out(h)                                                       # (N, V) logits z (train(): fp32)

    @classmethod
    def from_pretrained(cls, folder):
        """The decoder that save_checkpoint wrote beside the encoder (folder/decoder.safetensors)."""
        state = run.load_tensors(Path(folder) / "decoder.safetensors")
        eps = json.loads((Path(folder) / "config.json").read_text()).get("layer_norm_eps", 1e-12)
        decoder = cls(state["out.weight"].shape[1], state["out.weight"].shape[0], eps)
        decoder.load_state_dict(state)
        return decoder


# ==============================================================================================
# Loss
# ==============================================================================================
# --- shared: begin mlm loss ---
def mlm_loss(hidden, labels, head):
    """Masked language modelling, BERT's loss, which every method adds to its own (L_MLM):

        L_MLM = - sum_{x^ in m(x)} log p(x^ | x without m(x)),   m(x) = the masked positions

    hidden (B, L, H), labels (B, L) -100 = not masked, head: the MLMHead, which only the masked positions go
    through -> (loss, n_correct, n_masked)."""
    # Departure (mlm-mean): the mean over the masked tokens where the papers sum (as BERT's and SEED's code do), so a
    # loss weight does not depend on how many tokens a batch masks; under torchrun, over this rank's tokens.
    chosen = labels != -100                                     # (B, L)
    if not chosen.any():     # nothing masked: a zero loss that still reaches every head parameter
        return head(hidden[:1, 0]).sum() * 0.0, 0, 0
    logits = head(hidden[chosen]).float()                       # (M, V) fp32 for the softmax
    targets = labels[chosen]                                    # (M,)
    n_correct = (logits.argmax(-1) == targets).sum()            # () a tensor: no GPU sync here
    return F.cross_entropy(logits, targets), n_correct, targets.numel()
# --- shared: end mlm loss ---



def reconstruction_loss(logits, bag, idf=None, reduction="sum"):
    """Non-autoregressive reconstruction, eq. 3-4 (multi-label binary cross-entropy), eq. 3's sigmoid inside it:

        L_REC = - sum_j w_j [ y^j log sigmoid(z^j) + (1 - y^j) log(1 - sigmoid(z^j)) ]

    logits z (N, V); bag y (N, V), 1 iff word j occurs in the text (bag_of_words); idf (V,) the w_j of IDF-REC, or
    None (w_j = 1). Summed over the vocabulary (reduction "sum", eq. 4's) or averaged ("mean"); mean over texts."""
    # Departure (cpdae-eq4-typo): eq. 4 as printed has log z_hat^j in its second term, a typo; log(1 - z_hat^j) here.
    # Departure (option-cpdae-rec-mean): --rec_reduction mean divides the sum by |V|, as DupMAE does.
    per_word = F.binary_cross_entropy_with_logits(
        logits.float(), bag.float(), reduction="none")                 # (N, V) -[y log z + (1-y) log(1-z)]
    if idf is not None:
        per_word = per_word * idf.float()                                        # (N, V) word j's term x idf[j]
    per_text = per_word.sum(dim=1) if reduction == "sum" else per_word.mean(dim=1)  # (N,) over V
    return per_text.mean()                                                       # mean over texts


def word_distribution(logits):
    """z_tilde = z_hat / sum_j z_hat^j, z_hat = sigmoid(z) (3.2.2): the sigmoid outputs normalised. fp32."""
    z_hat = torch.sigmoid(logits.float())                                        # (N, V)
    return z_hat / z_hat.sum(dim=-1, keepdim=True)                               # (N, V) rows sum to 1


def _xlogx(x):
    """x log x with 0 log 0 = 0 and a finite gradient at 0 (the log of a clamped x)."""
    return x * torch.log(x.clamp_min(torch.finfo(x.dtype).tiny))


def js_similarity(anchors, candidates, tau=1.0):
    """CPDAE's similarity s = -JS / tau of two word distributions (eq. 5, 7), for every row pair:

        JS(P, Q) = 1/2 sum p log p + 1/2 sum q log q - sum m log m,   M = (P + Q) / 2

    anchors P (a, V), candidates Q (b, V), rows summing to 1 -> (a, b) -JS(P, Q) / tau, in [-ln 2 / tau, 0]. The
    mixture M is (a, b, V): train() runs this compiled, or a few anchors at a time (docs/speed.md). fp32."""
    # Departure (cpdae-true-js): eq. 7 writes 2 (ln 2 - JS); the true -JS here (the constant cancels in eq. 5).
    # Departure (option-cpdae-cl-tau): tau = --cl_tau (1, the paper's: no temperature) widens the logits.
    dtype = torch.promote_types(anchors.dtype, torch.float32)                  # fp32 (fp64 stays, for tests)
    p, q = anchors.to(dtype), candidates.to(dtype)                              # (a, V), (b, V)
    m = 0.5 * (p[:, None, :] + q[None, :, :])                                    # (a, b, V) M = (P + Q) / 2
    half_p = 0.5 * _xlogx(p).sum(dim=-1)                                         # (a,) 1/2 sum p log p
    half_q = 0.5 * _xlogx(q).sum(dim=-1)                                         # (b,) 1/2 sum q log q
    return -(half_p[:, None] + half_q[None, :] - _xlogx(m).sum(dim=-1)) / tau    # (a, b) -JS / tau


def js_divergence(p, q):
    """Pairwise JS(P, Q), rows of p (a, V) x rows of q (b, V) -> (a, b): minus js_similarity."""
    return -js_similarity(p, q)


def cosine_similarity(anchors, candidates, temperature=0.1):
    """CPDAE_R's similarity of [CLS] vectors: cos / temperature, (a, H) x (b, H) -> (a, b) (train(): fp32)."""
    # Departure (cpdae-r-cosine): the paper names no similarity for CPDAE_R; cosine / 0.1 (as SimCLR's) is ours.
    a = F.normalize(anchors, dim=-1)                                             # (a, H)
    b = F.normalize(candidates, dim=-1)                                          # (b, H)
    return a @ b.T / temperature                                                 # (a, b)


def contrastive_loss(view1, view2, similarity, n_anchors=None):
    """CPDAE's contrastive loss (eq. 5): each text's first view d'_i against its second view d''_i:

        L_CL = - sum_{i=1..m} log  exp(s(z'_i, z''_i)) / sum_{k=1..2m} 1[k != i] exp(s(z'_i, z_k))

    view1, view2 (M, D): the M texts' first and second views; z_k runs over [view1; view2]; similarity(a, b):
    (n, D) x (2M, D) -> (n, 2M). n_anchors (passed by train()'s all-ranks wrapper): first views 0..n-1 anchor.
    -> (loss, accuracy: the share of anchors whose second view scores highest; chance 1 / (2M - 1))."""
    # Departure (cpdae-cl-mean): the mean over anchors where eq. 5 sums, so lambda does not depend on the batch.
    M = view1.shape[0]
    n = M if n_anchors is None else n_anchors
    sim = similarity(view1[:n], torch.cat([view1, view2])).float()               # (n, 2M) s(z'_i, z_k)
    rows = torch.arange(n, device=sim.device)                                    # (n,)
    sim = sim.masked_fill(F.one_hot(rows, 2 * M).bool(), float("-inf"))         # (n, 2M) 1[k != i]
    positive = M + rows                                                          # (n,) z''_i
    accuracy = (sim.argmax(dim=1) == positive).float().mean()
    return F.cross_entropy(sim, positive), accuracy                              # mean over anchors


# The pre-training objective (eq. 6), built from the model pieces and the losses above.
class PretrainModel(nn.Module):
    """The encoder plus what pre-training adds on top of it. Returns the loss and what to log.
    Both masked views of the B texts go through the encoder as one batch of 2B rows."""

    def __init__(self, c, encoder, idf=None, frequent_token=None, world=1):
        super().__init__()
        self.config, self.encoder = c, encoder
        self.decoder = Decoder(c.hidden_size, c.vocab_size, c.layer_norm_eps)
        self.register_buffer("idf", idf)                                         # (V,) or None: IDF-REC
        self.frequent_token = frequent_token   # the corpus' most frequent token: MLM's trivial baseline
        self.js_similarity, self.cosine_similarity = js_similarity, cosine_similarity   # train() wraps them
        self.contrastive_loss = contrastive_loss                                 # (--compile, fp32, all ranks)
        self.world = world                     # processes whose views are eq. 5's candidates (cl_chance's 2M)

    def new_parameters(self):
        """What the checkpoint did not bring (--head_warmup trains these first): the MLP decoder, and the
        MLM head's dense, LayerNorm and bias when the checkpoint has none (its decoder is the embedding)."""
        mlm_head = self.encoder.mlm_head.parameters() if getattr(self.encoder, "new_mlm_head", True) else []
        return [*self.decoder.parameters(), *mlm_head]

    def terms(self, batch):
        """Eq. 6 term by term, {name: weighted scalar}, and what to log: each accuracy X_acc with its
        trivial baseline X_chance (research/study.py measures each term's gradient on the encoder)."""
        c = self.config
        attention_mask = batch["attention_mask"].repeat(2, 1)                    # (2B, L) views share padding
        hidden = self.encoder(batch["input_ids"], attention_mask)                # (2B, L, H) [d'; d'']
        mlm, n_correct, n_masked = mlm_loss(hidden, batch["labels"], self.encoder.mlm_head)  # MLM on both views
        h_cls = text_vector(hidden, attention_mask, c.bottleneck)                # (2B, H) eq. 1: [CLS] or mean
        logits = self.decoder(h_cls)                                             # (2B, V) eq. 2
        rec = reconstruction_loss(logits, batch["bag"].repeat(2, 1), self.idf, c.rec_reduction)  # each view its text
        per_word = rec.detach() / (c.vocab_size if c.rec_reduction == "sum" else 1)  # eq. 4's sum over |V| words
        metrics = {"rec": rec.detach(), "rec_per_word": per_word, "mlm": mlm.detach(), "mlm_acc": n_correct / max(n_masked, 1),
                   "mlm_chance": data.most_frequent_accuracy(batch["labels"], self.frequent_token)}
        if not c.cl_weight:                                                      # Table 2 "w/o CL"
            return {"L_REC": rec, "L_MLM": mlm}, metrics
        if c.cl_mode == "js":                                                    # CPDAE, eq. 5
            view1, view2 = word_distribution(logits).chunk(2)                    # (B, V) each, z_tilde
            similarity = partial(self.js_similarity, tau=c.cl_tau)
        else:                                                                    # CPDAE_R
            view1, view2 = h_cls.chunk(2)                                        # (B, H) each
            similarity = partial(self.cosine_similarity, temperature=c.cls_temperature)
        cl, accuracy = self.contrastive_loss(view1, view2, similarity)          # eq. 5
        terms = {"L_REC": rec, "L_MLM": mlm, "lambda L_CL": c.cl_weight * cl}   # eq. 6: L_REC + L_MLM + lambda L_CL
        views = 2 * view1.shape[0] * self.world                                  # 2M views: one micro-step, all ranks
        return terms, {**metrics, "cl": cl.detach(), "cl_acc": accuracy, "cl_chance": 1 / (views - 1)}

    def forward(self, batch):
        terms, metrics = self.terms(batch)
        return sum(terms.values()), metrics                                      # eq. 6


# ==============================================================================================
# Data
# ==============================================================================================
def bag_of_words(input_ids, vocab_size, special_ids):
    """y of eq. 4: (B, V) float, 1 where vocabulary id j occurs in the ORIGINAL (unmasked) text.
    Padding and special tokens ([PAD] [UNK] [CLS] [SEP] [MASK]) are never targets."""
    bag = torch.zeros(input_ids.shape[0], vocab_size)                          # (B, V)
    bag.scatter_(1, input_ids, 1.0)                                            # (B, V) padding too, for now
    bag[:, list(special_ids)] = 0.0                                            # (B, V)
    return bag


def idf_from_df(df, n_texts):
    """IDF of every vocabulary id (Table 2, IDF-REC) from df (V,) over the N pre-training windows:

        idf(j) = log((N + 1) / (df(j) + 1)) + 1,   df(j) = number of texts containing j

    (smoothed, as scikit-learn; the paper gives no formula). Always >= 1: an unsmoothed one turns negative."""
    df = torch.from_numpy(df.astype(np.float64))                                         # (V,)
    return (torch.log((n_texts + 1.0) / (df + 1.0)) + 1.0).float()                       # (V,)


def document_frequency(ids, offsets, vocab_size):
    """df (V,) int64: in how many texts each id occurs. Vectorised: a (text, id) pair counts once
    (distinct keys text x V + id, sorted), then np.bincount of the ids of the distinct pairs."""
    n_texts = len(offsets) - 1
    text_of_token = np.repeat(np.arange(n_texts, dtype=np.int64), np.diff(offsets))     # (T,)
    keys = np.sort(text_of_token * vocab_size + ids)                                    # (T,) (text, id) keys
    pairs = keys[np.concatenate([keys[:1] == keys[:1], keys[1:] != keys[:-1]])]          # (P,) distinct pairs (the first key, if any, is new)
    return np.bincount(pairs % vocab_size, minlength=vocab_size)                        # (V,)


def cached_idf(windows, vocab_size, rank, chunk=1 << 16):
    """IDF (idf_from_df) over a token cache's windows, the one training runs: df counted a chunk of windows at a
    time, built once by rank 0 into the cache folder, then read by every rank and run."""
    path = windows.folder / f"idf-L{windows.max_len}-V{vocab_size}.npy"

    def build():
        df = np.zeros(vocab_size, np.int64)                                                  # (V,)
        for start in range(0, len(windows), chunk):
            bounds = np.asarray(windows.bounds[start:start + chunk])                         # (n, 2) body [a, b)
            lengths = bounds[:, 1] - bounds[:, 0]                                            # (n,)
            offsets = np.concatenate([[0], np.cumsum(lengths)])                              # (n + 1,)
            positions = np.repeat(bounds[:, 0] - offsets[:-1], lengths) + np.arange(offsets[-1])  # (T,)
            df += document_frequency(windows.tokens[positions].astype(np.int64), offsets, vocab_size)
        for token in (windows.special["cls"], windows.special["sep"]):   # once in every window
            df[token] = len(windows)
        run.atomic_save_npy(path, df)

    run.rank0_builds(path.is_file, build, rank, str(path))
    return idf_from_df(np.load(path), len(windows))


class Batches(torch.utils.data.Dataset):
    """Item m is this rank's batch at micro-step m: a pure function of (seed, rank, m), so data-loader
    workers can build batches ahead on the CPU and a resumed run sees exactly the same batches.
    CPDAE: every window masked twice: input_ids, labels (2B, L) = [d'; d'']; attention_mask (B, L); bag (B, V) y."""

    def __init__(self, c, windows, rank, world):
        self.c, self.windows, self.rank, self.world = c, windows, rank, world
        self.special = data.special_ids(data.load_tokenizer(c.vocab))   # {"cls": 101, "sep": 102, "mask": 103, ...}

    def __len__(self):
        return self.c.steps * self.c.grad_accum

    def __getitem__(self, micro_step):
        c = self.c
        rows = data.batch_indices(len(self.windows), c.batch_size, self.rank, self.world, c.seed, micro_step)
        generator = data.batch_generator(c.seed, self.rank, micro_step)
        ids, attention_mask = data.pad_batch([self.windows[i].input_ids for i in rows])   # (B, L)
        maskable = attention_mask.bool() & (ids != self.special["cls"]) & (ids != self.special["sep"])
        views = [data.mask_tokens(ids, maskable, c.vocab_size, self.special["mask"], generator, c.mask_prob)
                 for _ in range(2)]                                            # d', d'': two independent draws
        return {"input_ids": torch.cat([v[0] for v in views]), "labels": torch.cat([v[1] for v in views]),
                "attention_mask": attention_mask, "bag": bag_of_words(ids, c.vocab_size, self.special.values())}


# ==============================================================================================
# Training loop
# ==============================================================================================
def train(c):
    """Pre-train with CPDAE. Every check comes first (flags when parsed; here the run folder, --init, the
    vocabulary, the batch arithmetic, the corpus), then the steps. Run machinery: one call each into run/."""
    rank, world, device = setup_distributed(c.dist_timeout)      # torchrun: one process per device
    torch.manual_seed(c.seed)                                    # the encoder's and the decoder's init
    c = run.start_run(c, world)                                  # --init found, run folder free, batch split
    encoder = run.init_encoder(Encoder, c)                       # random, or the --init checkpoint
    c = run.resolve_vocab(encoder.config)                        # --init brings its sizes and vocabulary
    windows = run.load_windows(c, rank)                          # the token cache, built once by rank 0
    c = run.resolve_schedule(c, world, len(windows))             # --epochs -> steps
    idf = cached_idf(windows, c.vocab_size, rank) if c.idf_rec else None   # IDF-REC: once, from the token cache
    model = PretrainModel(c, encoder, idf, data.most_frequent_token(windows), world).to(device)
    # The method's pieces as training runs them, a wrapper a line: eq. 2's logits in fp32 (under bf16 autocast a
    # matmul runs in bf16), eq. 5's -JS compiled (--compile; else js_chunk anchors at a time, the same values), and
    # eq. 5 against every rank's views (its negatives; n_anchors).
    model.decoder.out.forward = run.in_fp32(model.decoder.out.forward)
    model.cosine_similarity = run.in_fp32(cosine_similarity)
    model.js_similarity = run.speed.fused(js_similarity, c, run.speed.in_row_chunks(js_similarity, c.js_chunk),
                                          sweep_per_input=True)
    model.contrastive_loss = run.across_ranks(contrastive_loss, gather_across_ranks)
    model.encoder.forward = run.speed.compiled_encoder(model.encoder, c)   # --compile: its elementwise work fused
    optimizer, scheduler = run.make_optimizer(model, c, eps=1e-8)    # Adam's eps: torch's (the paper gives none)
    save_decoder = lambda folder: run.save_tensors(Path(folder) / "decoder.safetensors", model.decoder.state_dict())
    training = run.TrainingRun(c, model, optimizer, scheduler, device, windows, save_decoder)  # resume, folder, log
    # Each rank trains on its own slice of every global batch (data.batch_indices); DDP averages the
    # gradients over the ranks, and eq. 5 sees every rank's views (gather_across_ranks).
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    batches = run.batches(Batches(c, windows, rank, world), c.workers,      # --workers processes build them ahead,
                          range(training.start_step * c.grad_accum, c.steps * c.grad_accum))  # from the resumed step
    autocast = run.autocast_bf16(device, c.bf16)
    with training.stops_cleanly():                               # Ctrl-C, SIGTERM: one line, then --resume
        for step in range(training.start_step + 1, c.steps + 1):
            for micro in range(c.grad_accum):
                batch = next(batches)
                n_tokens = int(batch["attention_mask"].sum())
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                # dropout, like the batch, is a function of the step: resume is exact without saving RNG state
                torch.manual_seed(data.step_seed(c.seed, rank, (step - 1) * c.grad_accum + micro))
                last = micro == c.grad_accum - 1
                with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():  # DDP syncs on the last
                    with autocast:
                        loss, metrics = ddp(batch)                   # the objective: PretrainModel.forward
                    (loss / c.grad_accum).backward()
                training.progress.add(metrics, n_tokens)
            training.stop_if_not_finite(torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip), step)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if training.end_of_step(step):                       # log, checkpoint; True at --halt_at
                break
    training.finish()


# ==============================================================================================
# The blocks every method file owns a copy of, byte-identical (a test checks; being identical, they
# give no lines in a diff of two method files): the BERT encoder and the distributed steps.
# ==============================================================================================
# --- shared: begin encoder ---
class Embeddings(nn.Module):
    """Token + learned absolute position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, c):
        super().__init__()
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_position, c.hidden_size)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = c.dropout

    def forward(self, input_ids):                                               # (B, L)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)   # (L,)
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]  # (B, L, H)
        return F.dropout(self.norm(x), self.dropout, self.training)


def attention(q, k, v, attend, p=0.0):
    """softmax(q k^T / sqrt(d)) v per head, dropout p on the probabilities. q, k, v (B, heads, L, d); attend
    (B, 1, 1, L) or (L, L), True = key visible."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5            # (B, heads, L, L) fp32 softmax
    scores = scores.masked_fill(~attend, torch.finfo(torch.float32).min)        # a hidden key gets weight 0
    probs = F.dropout(scores.softmax(-1), p, training=p > 0)                     # (B, heads, L, L)
    return probs.to(v.dtype) @ v                                                 # (B, heads, L, d)


class SelfAttention(nn.Module):
    """Multi-head self-attention, BERT's: projections, attention() per head, output projection."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.dropout = c.num_heads, c.dropout
        self.query, self.key, self.value, self.out = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(4))

    def forward(self, x, attend):                       # x (B, L, H); attend (B, 1, 1, L) True = key visible
        B, L, H = x.shape
        split = lambda t: t.view(B, L, self.heads, H // self.heads).transpose(1, 2)  # (B, heads, L, H/heads)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        y = attention(q, k, v, attend, self.dropout if self.training else 0.0)      # (B, heads, L, H/heads)
        return self.out(y.transpose(1, 2).reshape(B, L, H))                      # (B, L, H)


class Block(nn.Module):
    """Post-LN Transformer block, as in BERT: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, c):
        super().__init__()
        self.attn = SelfAttention(c)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.ffn_in = nn.Linear(c.hidden_size, c.ffn_size)
        self.ffn_out = nn.Linear(c.ffn_size, c.hidden_size)
        self.ffn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = c.dropout

    def forward(self, x, attend):                                                    # (B, L, H)
        x = self.attn_norm(x + F.dropout(self.attn(x, attend), self.dropout, self.training))
        ffn = self.ffn_out(F.gelu(self.ffn_in(x)))                                   # (B, L, H)
        return self.ffn_norm(x + F.dropout(ffn, self.dropout, self.training))        # (B, L, H)


class MLMHead(nn.Module):
    """BERT's MLM head: dense, GELU, LayerNorm, then the token embedding matrix (tied) plus a bias."""

    def __init__(self, c, word_embedding):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.word_embedding = [word_embedding]  # a list, so the tied matrix is not registered twice

    def forward(self, h):                                                        # (M, H)
        h = self.norm(F.gelu(self.dense(h)))                                     # (M, H)
        return h @ self.word_embedding[0].weight.T + self.bias                   # (M, V)


class Encoder(nn.Module):
    """BERT: embeddings, N post-LN blocks, an MLM head tied to the input embeddings; no pooler. forward returns
    the last hidden states. As a Hugging Face BERT folder: load_pretrained and save_pretrained in run/hub.py.
    """

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.mlm_head = MLMHead(c, self.embeddings.word)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids, attention_mask):                  # (B, L), (B, L) 1 = token, 0 = pad
        attend = attention_mask.bool()[:, None, None, :]            # (B, 1, 1, L)
        x = self.embeddings(input_ids)                              # (B, L, H)
        for block in self.blocks:
            x = block(x, attend)
        return x                                                    # (B, L, H)
# --- shared: end encoder ---


# --- shared: begin distributed ---
def setup_distributed(timeout_s=600.0):
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK: one process per device, NCCL on GPUs, gloo on CPU; plain
    `python x.py` runs one. A rank that waits timeout_s at a collective ends the job. -> (rank, world, device)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "nccl" and local_world > torch.cuda.device_count():
        raise ValueError(f"torchrun --nproc_per_node={local_world}, but this machine has {torch.cuda.device_count()} "
                         f"GPU(s): one process per GPU (CUDA_VISIBLE_DEVICES= runs every process on the CPU)")
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None,   # NCCL bound to its GPU
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def rank_and_world():
    """(global rank, world size); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GatherWithGrad(torch.autograd.Function):
    """all_gather that keeps gradients: every rank's loss used this rank's vectors as candidates, so backward
    hands each rank the sum over ranks of the gradient of its own slice (equal sizes on every rank)."""

    @staticmethod
    def forward(ctx, t):                                                  # (n, ...)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=0)                                    # (world * n, ...)

    @staticmethod
    def backward(ctx, grad):                                              # (world * n, ...)
        grad = grad.contiguous()
        dist.all_reduce(grad)                                             # sum over every rank's loss
        return grad.chunk(dist.get_world_size(), dim=0)[dist.get_rank()]  # (n, ...)


def gather_across_ranks(t):
    """Concatenate `t` from every rank along dim 0, keeping the autograd graph (candidates)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    return GatherWithGrad.apply(t.contiguous())
# --- shared: end distributed ---



if __name__ == "__main__":
    run.main(train, Config, __doc__, PAPER_PRESET, FLAG_RULES, {"lab": LAB_PRESET})
