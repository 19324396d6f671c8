"""SEED-Encoder: pre-train a text encoder whose [CLS] vector must feed a weak decoder.

Lu et al., EMNLP 2021 (arXiv:2102.09206, section 3.4, eq. 9-10). One file, top to bottom: config,
model, loss, data, training loop, checkpoint, the Figure 5 diagnostic; then the blocks every method
shares (the BERT encoder, distributed and training helpers). It has costa.py's skeleton section for
section, with COSTA's own parts (spans, projector, eq. 8) swapped for a weak decoder: `diff costa.py
seed.py` shows that swap section by section; the skeleton and the shared blocks give no diff lines.

    python seed.py                                   # small model, bundled Wikipedia slice, CPU
    python seed.py --dec_span 0 --dec_layers 5       # Figure 3's "strong decoder" ablation
    torchrun --nproc_per_node=4 seed.py --preset paper
    python seed.py --resume                          # continue from out_dir/state.pt exactly
    python seed.py --overwrite                       # start again in an out_dir that holds a run (else refused)
    python seed.py --diagnose runs/seed/encoder      # Figure 5: [CLS] cosine of random text pairs by length

The encoder is written to {out_dir}/encoder as a Hugging Face BERT folder for finetune.py; the decoder
lives only in {out_dir}/state.pt (the training state). To compare with an MLM-only encoder, train one with
`python costa.py --gwc_weight 0` and run --diagnose on both folders (--max_len sets the longest length).
"""
import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import data


# ==============================================================================================
# Config
# ==============================================================================================
@dataclass
class Config:
    # --- data
    corpus: str = str(data.WIKI)  # pre-training corpus: .txt / .jsonl file or folder ('.gz' ok)
    vocab: str = str(data.VOCAB)  # WordPiece vocab.txt (BERT uncased, 30,522 entries)
    max_len: int = 128            # tokens per window incl. [CLS] and [SEP] (paper: 512)
    # --- model (CPU default is small; --preset paper gives BERT-base)
    vocab_size: int = 30522       # rows of the token embedding; must match the vocab file (paper: 32,768)
    hidden_size: int = 256        # H (paper: 768)
    num_layers: int = 4           # Transformer blocks (paper: 12)
    num_heads: int = 4            # attention heads (paper: 12, BERT-base's; its text says 8)
    ffn_size: int = 1024          # feed-forward inner size (paper: 3072)
    max_position: int = 512       # learned absolute positions
    type_vocab_size: int = 2      # token types (all 0 here; kept for BERT checkpoint compatibility)
    dropout: float = 0.1          # hidden and attention dropout
    layer_norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    init: str = ""                # start from: a BERT folder, a hub id, or "minilm" (offline package); "" = random
    bottleneck: str = "cls"       # the decoder's memory: "cls" (the paper's) or "mean" (masked mean, MiniLM's pooling)
    # --- optimisation
    steps: int = 300              # optimizer steps (paper: 1M steps, 4.1)
    epochs: float = 0.0           # > 0: passes over the windows; sets steps from windows and global batch
    batch_size: int = 32          # texts per rank per micro-step
    global_batch: int = 0         # > 0: texts per optimizer step on all ranks; sets batch_size (paper: 256, 4.1)
    grad_accum: int = 1           # micro-steps per optimizer step (adds no negatives to the contrastive loss)
    lr: float = 5e-4              # peak learning rate (paper: 1e-4, from scratch, 4.1)
    weight_decay: float = 0.01    # AdamW weight decay (not on biases and LayerNorm)
    warmup: float = 0.1           # fraction of steps of linear warm-up, then linear decay to 0 (paper: 10k of 1M)
    clip: float = 1.0             # max gradient norm
    head_warmup: int = 0          # first steps (of --steps) train only the heads new to the checkpoint, encoder frozen
    head_lr: float = 1.0          # lr multiplier of those new heads (1 = one lr for all, the papers')
    mask_prob: float = 0.15       # MLM: fraction of tokens chosen
    seed: int = 0                 # model init, data order and masks
    bf16: bool = True             # bf16 autocast on GPU and on CPUs with native bf16 (AVX512-BF16, AMX)
    workers: int = 0              # data-loader worker processes building batches
    cache_dir: str = ""           # token cache folder ("" = next to the corpus; see data.token_windows)
    prep_workers: int = 0         # processes tokenizing the corpus into the cache, first run only (0 = all cores)
    # --- bookkeeping
    out_dir: str = "runs/seed"    # checkpoints, config.json and log.jsonl go here
    log_every: int = 10           # steps between progress lines
    save_every: int = 100         # steps between checkpoints (and one at the end)
    resume: bool = False          # continue from out_dir/state.pt
    overwrite: bool = False       # replace a run already in out_dir (without it or --resume: refused)
    halt_at: int = 0              # stop after this step as if killed (0 = never); to test --resume
    preset: str = ""              # "paper": BERT-base sizes and the paper's hyper-parameters
    # --- SEED-Encoder's weak decoder (section 3.4; Figure 3 ablations)
    dec_layers: int = 3           # decoder Transformer blocks (paper: 3; Figure 3 also tries 1 and 5)
    dec_span: int = 2             # self-attention span k of eq. 9 (paper: 2); 0 = full causal, the "strong decoder"
    dec_weight: float = 1.0       # weight of L_dec in eq. 10 (paper: 1, L_MLM + L_dec)
    dec_chunk: int = 2048         # decoder positions per chunk of vocabulary logits (peak ~ chunk x |V| fp32); 0 = all
    diagnose: str = ""            # encoder folder: print Figure 5's [CLS] cosine by length, then exit (no training)


# Section 4.1: from scratch, peak lr 1e-4, 10k of 1M steps warm-up.
# Departure (seed-heads): 12 heads, BERT-base's and the authors' code's (encoder_attention_heads=12), where
# the paper's text says eight (it also says "the same with BERT-base", which has 12).
# --preset paper: section 4.1 "Pre-training Details". From scratch (no --init), BERT-base sizes, 1M steps
# at batch 256 over all ranks (global_batch: batch_size = 256 / processes), maximum length 512, 15% masks,
# Adam eps 1e-6 (make_optimizer's call in train) and betas (0.9, 0.999), peak lr 1e-4 after 10k warm-up
# steps (0.01 of 1M; with --steps or --epochs the fraction stays 1%), then linear decay to zero, dropout
# 0.1, clip 1.0, weight decay 0.01 (Config's defaults).
# Departure (seed-vocab): the paper's 32,768-token vocabulary (Ke et al., 2020) is not available; we use
# BERT's 30,522.
PAPER_PRESET = dict(hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072, max_len=512, lr=1e-4,
                    warmup=0.01, steps=1_000_000, global_batch=256, mask_prob=0.15, dropout=0.1, clip=1.0,
                    weight_decay=0.01)


# The domain of each numeric or choice flag, checked by data.parse_config before any work.
FLAG_RULES = {
    "max_len": ">= 10",  # 8 tokens between [CLS] and [SEP]: shorter windows are dropped (data.make_windows)
    "vocab_size": ">= 1", "hidden_size": ">= 1", "num_layers": ">= 1", "num_heads": ">= 1", "ffn_size": ">= 1",
    "max_position": ">= 1", "type_vocab_size": ">= 1", "dropout": "in [0, 1)", "layer_norm_eps": "> 0",
    "steps": ">= 1", "epochs": ">= 0", "batch_size": ">= 1", "global_batch": ">= 0", "grad_accum": ">= 1", "lr": "> 0", "weight_decay": ">= 0",
    "warmup": "in [0, 1]", "clip": "> 0", "mask_prob": "in [0, 1]", "workers": ">= 0", "log_every": ">= 1",
    "save_every": ">= 1", "halt_at": ">= 0", "prep_workers": ">= 0",
    "dec_layers": ">= 1", "dec_span": ">= 0", "dec_chunk": ">= 0", "dec_weight": "> 0",
    "head_warmup": ">= 0", "head_lr": "> 0", "bottleneck": "one of {cls, mean}",
}


# ==============================================================================================
# Model
# ==============================================================================================
# (The BERT encoder itself, Encoder, is a shared block at the end of this file.)


# --- shared: begin text vector ---
BOTTLENECKS = ("cls", "mean")   # --bottleneck: which vector of the encoder a method trains as the text's


def text_vector(hidden, attention_mask, bottleneck="cls"):
    """The text's vector, the one a method trains (and retrieval should read): "cls" = the last layer's
    [CLS] state, the papers'; "mean" = the mean of the output tokens over the attention mask ([CLS],
    [SEP] and [MASK] included, padding not), the pooling all-MiniLM-L6-v2 was trained with and
    finetune.py reads for it. Departure (option-bottleneck-mean): the papers bottleneck through [CLS].
    hidden (B, L, H), attention_mask (B, L) 1 = token -> (B, H)."""
    if bottleneck == "cls":
        return hidden[:, 0]                                                      # (B, H)
    weights = attention_mask.to(hidden.dtype)[..., None]                         # (B, L, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)     # (B, H)
# --- shared: end text vector ---


def window_mask(length, k=2, device=None):
    """The weak decoder's self-attention mask (eq. 9), True = may attend: query i sees keys
    {0} U {i-k+1, ..., i}, i.e. itself, the k-1 previous positions and the start symbol at 0 (as the
    authors' code does). k = 0, None or "full" gives the plain causal mask: Figure 3's "strong decoder".
    Applied in every layer, so the receptive field grows with depth (3 layers, k = 2: 0 and i-3..i)."""
    query = torch.arange(length, device=device)[:, None]                        # (L, 1)
    key = torch.arange(length, device=device)[None, :]                          # (1, L)
    causal = key <= query                                                       # (L, L)
    if k in (0, None, "full"):
        return causal
    if int(k) < 1:
        raise ValueError(f"span k must be >= 1, or 0 / None / 'full' for causal; got {k!r}")
    return causal & ((key > query - int(k)) | (key == 0))                       # (L, L)


class DecoderBlock(nn.Module):
    """Pre-LN block: restricted self-attention, cross-attention to the encoder's [CLS], GELU FFN, each
    x + f(LN(x)). The final LayerNorm that pre-LN needs is WeakDecoder's.
    Departure (seed-pre-ln): the paper keeps "all else the same with the encoder", BERT, which is
    post-LN; we follow the authors' code, a fairseq decoder with decoder_normalize_before=True."""

    def __init__(self, c):
        super().__init__()
        self.attn = SelfAttention(c)                  # the encoder's attention, given the window mask
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        # Cross-attention to a memory of ONE vector, [CLS]: softmax over a single key is exactly 1, so
        # every position receives out(value(h0)) whatever the query and key projections (those would
        # only ever get zero gradient). We compute that directly (test_losses.py checks the equality),
        # Departure (seed-cross-dropout): without the attention-probability dropout of the authors' and
        # BERT's attention, which would zero the single weight 10% of the time.
        self.cross_value = nn.Linear(c.hidden_size, c.hidden_size)
        self.cross_out = nn.Linear(c.hidden_size, c.hidden_size)
        self.ffn_in = nn.Linear(c.hidden_size, c.ffn_size)
        self.ffn_out = nn.Linear(c.ffn_size, c.hidden_size)
        self.ffn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x, h0, attend):                    # x (B, L, H); h0 (B, H); attend (L, L) bool
        x = x + self.dropout(self.attn(self.attn_norm(x), attend))                       # (B, L, H)
        cross = self.cross_out(self.cross_value(h0))[:, None, :].expand_as(x)            # (B, L, H)
        x = x + self.dropout(cross)   # no LayerNorm here: it would only feed the query, which one key ignores
        return x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(self.ffn_norm(x)))))     # (B, L, H)


class WeakDecoder(nn.Module):
    """SEED's weak decoder (section 3.4): `dec_layers` blocks with self-attention span `dec_span`;
    its only view of the encoder is the last-layer [CLS] vector h0, in every block. It shares the
    encoder's token embedding for its input and its output projection (as the authors do) and has
    its own learned positions. Its embedded input goes through a LayerNorm, as in the authors' code
    (layernorm_embedding=True in their config) and in BERT's encoder. Dropped after pre-training."""

    def __init__(self, c, word_embedding):
        super().__init__()
        self.span = c.dec_span
        self.position = nn.Embedding(c.max_position, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(c) for _ in range(c.dec_layers))
        self.final_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)   # pre-LN's last LayerNorm
        self.word_embedding = [word_embedding]  # a list, so the tied matrix is not registered twice
        self.apply(Encoder._init_weights)

    def embed(self, input_ids):                                                 # (B, L)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)   # (L,)
        x = self.word_embedding[0](input_ids) + self.position(positions)        # (B, L, H)
        return self.dropout(self.norm(x))

    def decode(self, x, h0):                                 # x (B, L, H) embedded input; h0 (B, H)
        attend = window_mask(x.shape[1], self.span, x.device)                   # (L, L)
        for block in self.blocks:
            x = block(x, h0, attend)
        return self.final_norm(x)                                               # (B, L, H)

    def forward(self, input_ids, encoder_hidden):     # (B, L) shifted-right text; (B, L_enc, H)
        return self.decode(self.embed(input_ids), encoder_hidden[:, 0])  # [CLS] is the only bridge


# ==============================================================================================
# Loss
# ==============================================================================================
# --- shared: begin mlm loss ---
def mlm_loss(hidden, labels, head):
    """Masked language modelling, the loss every method shares (BERT's; COSTA eq. 9, CPDAE eq. 6's
    L_MLM, SEED eq. 10's L_MLM):

        L_MLM = -1/|m(x)| * sum_{x^ in m(x)} log p(x^ | x without m(x)),   m(x) = masked positions

    Departure (mlm-mean): the papers write a sum; we take the mean over the masked tokens, as BERT's
    and SEED's code do, so that a loss weight (lambda) does not depend on how many tokens a batch masks. Only the masked
    positions go through `head` (the vocabulary projection is most of the cost). hidden (B, L, H),
    labels (B, L) with -100 where nothing is predicted, head: MLMHead. Returns (loss, n_correct,
    n_masked). Under torchrun the mean is over this rank's masked tokens; DDP averages the ranks."""
    chosen = labels != -100                                     # (B, L)
    if not chosen.any():     # nothing masked: a zero loss that still reaches the head (DDP needs it)
        return head(hidden[:1, 0]).sum() * 0.0, 0, 0
    logits = head(hidden[chosen]).float()                       # (M, V) fp32 for the softmax
    targets = labels[chosen]                                    # (M,)
    n_correct = (logits.argmax(-1) == targets).sum()            # () a tensor: no GPU sync here
    return F.cross_entropy(logits, targets), n_correct, targets.numel()
# --- shared: end mlm loss ---


# --- shared: begin chance ---
def most_frequent_accuracy(targets, token=None):
    """The trivial baseline of a token prediction (logged as X_chance beside X_acc): the accuracy of
    always predicting `token`, the corpus' most frequent token (data.most_frequent_token), i.e. the
    fraction of the targets equal to it. token None: this batch's most frequent target instead (a
    slightly higher bar). targets (N,) or (B, L), -100 = no target -> () fp32."""
    targets = targets[targets != -100]                                           # (N,)
    if targets.numel() == 0:
        return torch.zeros((), device=targets.device)
    if token is None:
        return targets.bincount().max().float() / targets.numel()
    return (targets == token).float().mean()
# --- shared: end chance ---



def decoder_loss(states, weight, targets, reduction="mean"):
    """Weak-decoder reconstruction loss, eq. 9, the function training runs (chunked_decoder_loss calls
    it one chunk of positions at a time):

        L_dec = - sum_t log P(x_t | x_{t-k..t-1}, h0),   P(. | ...) = softmax(s_t E^T)

    states (..., H): the decoder's outputs s_t; weight (V, H): the token embedding E, shared with the
    encoder as the decoder's output projection (as in the authors' code); targets (...): x_t, -100
    where nothing is predicted (padding). The (N, H) x (H, V) matmul runs in autocast's dtype, as the
    MLM head's does (in fp32 it was 45 % of SEED's BERT-base step on an H100), the softmax in fp32.
    Departure (seed-dec-mean): the mean over the target tokens where eq. 9 sums over t (as the
    authors' code does), so the loss does not grow with text length; reduction "sum" gives eq. 9's sum.
    Returns (loss, n_correct: targets that are the top-1 logit)."""
    targets = targets.reshape(-1)                                                   # (N,)
    logits = (states.reshape(-1, states.shape[-1]) @ weight.T).float()              # (N, V) s_t E^T
    total = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")      # () sum of -log P
    n_correct = (logits.argmax(-1) == targets).sum()                               # ()
    if reduction == "sum":
        return total, n_correct
    return total / targets.ne(-100).sum().clamp_min(1), n_correct                  # mean over tokens


def chunked_decoder_loss(states, weight, targets, chunk):
    """decoder_loss (eq. 9) computed `chunk` positions at a time: the sum of each chunk's decoder_loss,
    over the N target tokens. Each chunk runs under activation checkpointing: its (chunk, V) logits are
    freed after its forward and rebuilt in the backward, so the peak holds one chunk's logits instead of
    all N x V (2 GB fp32 for 32 x 511 tokens at BERT's |V|). Same loss and gradients as decoder_loss
    in one piece (test_losses). chunk 0 = all at once.
    states (N, H), weight (V, H) the tied embedding, targets (N,) -> (loss (), n_correct ())."""
    if chunk == 0 or states.shape[0] <= chunk:
        return decoder_loss(states, weight, targets)                                # (), ()
    total, correct = states.new_zeros((), dtype=torch.float32), 0
    for start in range(0, states.shape[0], chunk):
        part = slice(start, start + chunk)
        chunk_total, chunk_correct = checkpoint(decoder_loss, states[part], weight, targets[part], "sum",
                                                use_reentrant=False)                # (), ()
        total, correct = total + chunk_total, correct + chunk_correct
    return total / targets.numel(), correct                                         # mean over N tokens


# The pre-training objective (eq. 10), built from the model pieces and the losses above.
class PretrainModel(nn.Module):
    """The encoder plus what pre-training adds on top of it. Returns the loss and what to log."""

    def __init__(self, c, encoder, frequent_token=None):
        super().__init__()
        self.config, self.encoder = c, encoder
        self.decoder = WeakDecoder(c, encoder.embeddings.word)
        self.frequent_token = frequent_token   # the corpus' most frequent token: the unigram baseline

    def new_parameters(self):
        """What the checkpoint did not bring (--head_warmup trains these first): the weak decoder (its
        output projection is the encoder's embedding), and the MLM head's dense, LayerNorm and bias when
        the checkpoint has none (its decoder is the embedding too)."""
        mlm_head = self.encoder.mlm_head.parameters() if getattr(self.encoder, "new_mlm_head", True) else []
        return [*self.decoder.parameters(), *mlm_head]

    def forward(self, batch):
        terms, metrics = self.terms(batch)
        return sum(terms.values()), metrics                                      # eq. 10

    def terms(self, batch):
        """Eq. 10 term by term, {name: weighted scalar}, and what to log: each accuracy X_acc with its
        trivial baseline X_chance, always predicting the corpus' most frequent token."""
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])       # (B, L, H) masked text
        mlm, n_correct, n_masked = mlm_loss(hidden, batch["labels"], self.encoder.mlm_head)
        h0 = text_vector(hidden, batch["attention_mask"], self.config.bottleneck)  # (B, H) the only bridge
        states = self.decoder.decode(self.decoder.embed(batch["decoder_input"]), h0)  # (B, L-1, H)
        kept = batch["decoder_targets"] != -100                                  # (B, L-1) every real token
        targets = batch["decoder_targets"][kept]                                 # (N,)
        dec, dec_correct = chunked_decoder_loss(                                 # eq. 9 (decoder_loss)
            states[kept], self.decoder.word_embedding[0].weight, targets, self.config.dec_chunk)
        # Eq. 10 as the paper writes it, weights 1:1. (The authors' code uses 0.5:0.5, which only halves
        # the gradient: AdamW's update is unchanged by that (up to eps), the clip norm (1.0) binds later.)
        # Departure (option-seed-dec-weight): off by default; --dec_weight w weighs L_dec w times L_MLM.
        terms = {"L_MLM": mlm, "L_dec": dec} if self.config.dec_weight == 1 else \
            {"L_MLM": mlm, "w L_dec": self.config.dec_weight * dec}
        return terms, {
            "mlm": mlm.detach(), "mlm_acc": n_correct / max(n_masked, 1),
            "mlm_chance": most_frequent_accuracy(batch["labels"], self.frequent_token),
            "dec": dec.detach(), "dec_acc": dec_correct / max(targets.numel(), 1),
            "dec_chance": most_frequent_accuracy(targets, self.frequent_token)}


# ==============================================================================================
# Data
# ==============================================================================================
class Batches(torch.utils.data.Dataset):
    """Item m is this rank's batch at micro-step m: a pure function of (seed, rank, m), so data-loader
    workers can build batches ahead on the CPU and a resumed run sees exactly the same batches."""

    def __init__(self, c, windows, special, rank, world):
        self.c, self.windows, self.special, self.rank, self.world = c, windows, special, rank, world

    def __len__(self):
        return self.c.steps * self.c.grad_accum

    def __getitem__(self, micro_step):
        c = self.c
        rows = data.batch_indices(len(self.windows), c.batch_size, self.rank, self.world, c.seed, micro_step)
        generator = data.batch_generator(c.seed, self.rank, micro_step)
        ids, attention_mask = data.pad_batch([self.windows[i].input_ids for i in rows])   # (B, L)
        maskable = attention_mask.bool() & (ids != self.special["cls"]) & (ids != self.special["sep"])
        masked, labels = data.mask_tokens(ids, maskable, c.vocab_size, self.special["mask"],
                                          generator, c.mask_prob)
        decoder_input, decoder_targets = decoder_inputs_and_targets(ids, attention_mask)  # unmasked text
        return {"input_ids": masked, "attention_mask": attention_mask, "labels": labels,
                "decoder_input": decoder_input, "decoder_targets": decoder_targets}


def decoder_inputs_and_targets(input_ids, attention_mask, ignore_index=-100):
    """`[CLS] x1..xn [SEP] [PAD]..` (unmasked) -> the decoder's input `[CLS] x1..xn`, the text shifted
    right with [CLS] as start symbol, and its target `x1..xn [SEP]`; padding targets = ignore_index.
    A shorter row's input keeps its [SEP]/[PAD] tail: the mask is causal, so no real position sees it."""
    decoder_input = input_ids[:, :-1]                                                 # (B, L-1)
    targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, ignore_index)  # (B, L-1)
    return decoder_input, targets


def make_batches(c, windows, rank, world):
    """This method's Batches for the shared train loop."""
    return Batches(c, windows, windows.special, rank, world)


# ==============================================================================================
# Training loop
# ==============================================================================================


# The loop itself, train(), is the shared block "train" at the end of this file; SEED's parts of it:
ADAM_EPS = 1e-6   # SEED 4.1: Adam epsilon 1e-6


def build_model(c, encoder, windows, rank):
    """The encoder plus SEED's weak decoder (section 3)."""
    return PretrainModel(c, encoder, data.most_frequent_token(windows))


# ==============================================================================================
# Checkpoint
# ==============================================================================================
# save_checkpoint() is the shared block "train" at the end of this file; SEED's part of it:
def save_extra_files(c, model, folder):
    """Nothing beyond the encoder: the weak decoder is pre-training only (it is in state.pt for --resume)."""


# ==============================================================================================
# Diagnostic: Figure 5
# ==============================================================================================
@torch.no_grad()
def cls_similarity_by_length(encoder, tokenizer, texts, lengths=(32, 64, 128, 256, 512), n_pairs=200, seed=0,
                             batch_size=16):
    """Section 4.6.2 / Figure 5: mean cosine similarity of the [CLS] vectors of random pairs of
    different texts, each cut to exactly `length` tokens ([CLS] + length-2 pieces + [SEP]). A
    collapsed encoder (Optimus in Figure 1b) gives values near 1 for long texts. Returns {length: cos}.
    Only texts with >= length-2 pieces take part at a length; a length with < 2 of them is left out."""
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    pieces = [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    device, was_training = next(encoder.parameters()).device, encoder.training
    encoder.eval()
    generator = torch.Generator().manual_seed(seed)
    result = {}
    for length in lengths:
        eligible = [ids for ids in pieces if len(ids) >= length - 2]
        if len(eligible) < 2:
            continue
        first = torch.randint(len(eligible), (n_pairs,), generator=generator)            # (P,)
        second = (first + torch.randint(1, len(eligible), (n_pairs,), generator=generator)) % len(eligible)
        used = torch.cat([first, second]).unique()                                       # (U,) sorted
        rows = torch.tensor([[cls_id] + eligible[i][:length - 2] + [sep_id] for i in used.tolist()])  # (U, len)
        vectors = torch.cat([encoder(chunk.to(device), torch.ones_like(chunk, device=device))[:, 0].float().cpu()
                             for chunk in rows.split(batch_size)])                       # (U, H)
        a, b = vectors[torch.searchsorted(used, first)], vectors[torch.searchsorted(used, second)]  # (P, H)
        result[length] = F.cosine_similarity(a, b, dim=-1).mean().item()
    encoder.train(was_training)
    return result


def diagnose(c):
    """`python seed.py --diagnose FOLDER`: Figure 5 for an exported encoder on texts of c.corpus,
    lengths 32, 64, ... up to --max_len (default 128, the small model's training length)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    encoder = Encoder.from_pretrained(c.diagnose, c).to(device)
    lengths = [n for n in (32, 64, 128, 256, 512) if n <= min(c.max_len, encoder.config.max_position)]
    texts = data.read_pretraining_texts(c.corpus)
    n_pairs = 200
    result = cls_similarity_by_length(encoder, data.load_tokenizer(c.vocab), texts, lengths, n_pairs, c.seed)
    print(f"{c.diagnose}: mean cosine of [CLS] vectors of {n_pairs} random text pairs (seed {c.seed})")
    for length, cosine in result.items():
        print(f"  length {length:>4}: {cosine:.3f}")


# ==============================================================================================
# Shared blocks, below the method: the BERT encoder, distributed helpers, bf16 autocast, training
# helpers, resume, run setup and the training loop itself (train, save_checkpoint, with this method's
# hooks above). Byte-identical in every file that has them (a test checks, and
# `diff costa.py cpdae.py` skips them): read them once, in costa.py.
# ==============================================================================================
# --- shared: begin encoder ---
def drop_mask(shape, p):
    """A boolean mask, each element True (dropped) with probability p, for dropout on CPU. It comes from
    numpy's PCG64, seeded from torch's generator (so torch.manual_seed still fixes every mask), one
    uniform 32-bit integer per element: P(True) = round(p * 2^32) / 2^32. 4x faster than torch's
    bernoulli_, which was a third of the training step (benchmark.py --micro)."""
    n = int(np.prod(shape))
    bits = np.random.PCG64(int(torch.randint(2**62, ()))).random_raw((n + 1) // 2)   # uint64: 2 draws each
    draws = torch.from_numpy(bits.view(np.int32)[:n]).view(shape)                   # uniform int32
    return draws < round(p * 2**32) - 2**31


def dropout(x, p, training):
    """BERT's dropout: each element zeroed with probability p, the others scaled by 1 / (1 - p);
    drop_mask on CPU, F.dropout on GPU."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    return x.masked_fill(drop_mask(x.shape, p), 0.0) * (1 / (1 - p))


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
        return dropout(self.norm(x), self.dropout, self.training)


def attention(q, k, v, attend, p):
    """softmax(q k^T / sqrt(d)) v per head, with dropout p on the probabilities (BERT's attention
    dropout). q, k, v (B, heads, L, d); attend (B, 1, 1, L) or (L, L), True = key visible.
    scaled_dot_product_attention (fused kernels) on GPU, and on CPU without gradients (encoding).
    Training on CPU writes the equation out: 2x faster there than SDPA, whose CPU kernel has no
    dropout (it falls back to its math path and torch's slow dropout) and a slow backward
    (benchmark.py --micro)."""
    if q.device.type != "cpu" or not torch.is_grad_enabled():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p)
    hide = torch.zeros(attend.shape).masked_fill(~attend, torch.finfo(torch.float32).min)  # like attend
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2) + hide              # (B, heads, L, L) fp32
    probs = scores.softmax(-1).to(v.dtype)                                       # (B, heads, L, L)
    if p == 0:
        return probs @ v                                                         # (B, heads, L, d)
    # dropout on the probabilities; its 1 / (1 - p) is applied to the 4x smaller output
    return (probs.masked_fill(drop_mask(probs.shape, p), 0.0) @ v) * (1 / (1 - p))   # (B, heads, L, d)


class SelfAttention(nn.Module):
    """Multi-head self-attention, BERT's: projections, attention() per head, output projection."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.dropout = c.num_heads, c.dropout
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.out = nn.Linear(c.hidden_size, c.hidden_size)

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
        x = self.attn_norm(x + dropout(self.attn(x, attend), self.dropout, self.training))
        ffn = self.ffn_out(F.gelu(self.ffn_in(x)))                                   # (B, L, H)
        return self.ffn_norm(x + dropout(ffn, self.dropout, self.training))          # (B, L, H)


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
    """BERT: embeddings, N post-LN blocks, an MLM head tied to the input embeddings; no pooler.
    forward returns the last hidden states; the text vector is position 0 ([CLS])."""

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

    def hf_config(self):
        c = {theirs: getattr(self.config, ours) for ours, theirs in data.HF_CONFIG_KEYS.items()}
        return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_act": "gelu",
                "attention_probs_dropout_prob": self.config.dropout, "initializer_range": 0.02,
                "pad_token_id": 0, "position_embedding_type": "absolute", **c}

    def save_pretrained(self, folder, vocab=data.VOCAB):
        """Hugging Face BERT folder; transformers.AutoModel.from_pretrained(folder) loads it."""
        state = {data.to_hf_name(k): v for k, v in self.state_dict().items()}
        data.save_encoder_folder(folder, state, self.hf_config(), vocab)

    @classmethod
    def from_pretrained(cls, folder, config=None):
        """Load a Hugging Face BERT folder (ours, or e.g. bert-base-uncased downloaded by the user).
        config: a Config whose model fields are replaced by the folder's config.json."""
        hf_config, hf_state = data.load_encoder_folder(folder)
        sizes = {ours: hf_config[theirs] for ours, theirs in data.HF_CONFIG_KEYS.items() if theirs in hf_config}
        model = cls(dataclasses.replace(config or Config(), **sizes))
        state = {data.from_hf_name(k): v for k, v in hf_state.items()}
        ours = model.state_dict()
        for name, tensor in state.items():
            if name in ours and ours[name].shape != tensor.shape:
                raise data.DataError(f"{folder}: {data.to_hf_name(name)} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(ours[name].shape)}")
        state = {k: v for k, v in state.items() if k in ours}       # drop pooler, NSP head, buffers
        missing = [k for k in ours if k not in state]
        if [k for k in missing if not k.startswith("mlm_head.")]:
            raise data.DataError(f"{folder}: missing encoder weights, e.g. {data.to_hf_name(missing[0])}")
        model.load_state_dict(state, strict=False)                  # a bare BertModel has no MLM head
        model.new_mlm_head = bool(missing)    # then it keeps its fresh init, decoder tied to the embeddings
        return model
# --- shared: end encoder ---


# --- shared: begin distributed ---
def setup_distributed():
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK: one process per device, NCCL on GPUs, gloo on
    CPU. Plain `python x.py` runs one process. Returns (rank, world, device)."""
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
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)   # NCCL bound to its GPU
    return dist.get_rank(), dist.get_world_size(), device


def rank_and_world():
    """(global rank, world size); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GatherWithGrad(torch.autograd.Function):
    """all_gather that keeps gradients: every rank's loss used this rank's vectors as candidates, so
    backward hands each rank the sum over ranks of the gradient of its own slice. (The same as the
    deprecated torch.distributed.nn.functional.all_gather; equal sizes on every rank.)"""

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


def average_across_ranks(values, device):
    """Mean of a dict of floats over ranks, for logging (every rank must call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(values, (t / dist.get_world_size()).tolist()))
# --- shared: end distributed ---


# --- shared: begin autocast ---
def autocast_bf16(device, enabled=True):
    """bf16 autocast on GPUs and on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX, about twice
    as fast as fp32 there); off elsewhere, where emulated bf16 would be slower than fp32."""
    cpu_bf16 = [getattr(torch.cpu, f"_is_{x}_supported", lambda: False)() for x in ("avx512_bf16", "amx_tile")]
    native = device.type == "cuda" or (device.type == "cpu" and any(cpu_bf16))
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and native)
# --- shared: end autocast ---


# --- shared: begin training helpers ---
def make_optimizer(model, c, eps=1e-8):
    """AdamW without weight decay on biases and LayerNorm; linear warm-up then linear decay to 0.
    Departure (optimizer-decay): COSTA and CPDAE say only "Adam with warm-up"; weight decay and linear
    decay are BERT's and SEED's recipe, kept for every method so that they differ only in their losses.
    eps: Adam's epsilon.
    Heads new to the checkpoint (model.new_parameters(): a fresh MLM head, a projector, a decoder) learn
    alone for the first --head_warmup steps, at --head_lr times the lr (a random head's gradients would
    otherwise distort the pre-trained features; Kumar et al., ICLR 2022): the encoder's groups get lr
    factor 0 (DDP-safe: every parameter still gets its gradient), then their own warm-up and decay over
    the steps left. Without those flags (finetune.py has none) the groups and schedule are the plain ones."""
    head_warmup, head_lr = getattr(c, "head_warmup", 0), getattr(c, "head_lr", 1.0)
    if head_warmup >= c.steps:
        raise ValueError(f"--head_warmup {head_warmup} leaves none of the {c.steps} steps to the encoder")
    new = {id(p) for p in (model.new_parameters() if hasattr(model, "new_parameters") else [])}
    groups = []
    for head in (False, True):            # encoder groups first: group 0 is the encoder's decayed one
        params = [p for p in model.parameters() if (id(p) in new) == head]
        groups += [{"params": [p for p in params if p.ndim >= 2], "weight_decay": c.weight_decay, "decay": True,
                    "head": head},
                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "decay": False, "head": head}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=c.lr, eps=eps)

    def schedule(step, start=0, factor=1.0):          # warm-up, then decay to 0 at c.steps, from `start`
        steps, step = c.steps - start, step - start
        warmup = max(1, int(c.warmup * steps))
        return 0.0 if step < 0 else factor * min((step + 1) / warmup, max(0.0, (steps - step) / max(1, steps - warmup)))
    lambdas = [(lambda step: schedule(step, factor=head_lr)) if group["head"] else
               (lambda step: schedule(step, start=head_warmup)) for group in optimizer.param_groups]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


# Flags that may differ on --resume: today's value applies from the next step. Every other flag defines
# the model, the data or the batches of the saved run, so a resumed run refuses to change it.
RESUMABLE = ("steps", "epochs", "hard_epochs", "lr", "weight_decay", "warmup", "clip", "bf16", "workers",
             "log_every", "save_every", "encode_batch", "preset", "eval_split", "eval_queries", "eval_qrels",
             "cache_dir", "prep_workers", "index", "nprobe", "ef_search", "index_train", "vectors_dir",
             "out_dir")  # where and how, not what (out_dir: a run folder moved or copied resumes where it is)


def check_resume_flags(c, saved, path):
    """Stop with one line if state.pt is another script's, or if a flag that cannot change on resume
    did. Returns the changed flags that may change, as '--lr 0.0005 -> 0.001' (or "")."""
    now = dataclasses.asdict(c)
    foreign = sorted(set(saved) - set(now))
    if foreign:
        raise data.DataError(f"{path}: written by another script (it has --{foreign[0]}); resume it with that "
                             f"script, or start again with --overwrite")
    changed = {k: (v, now[k]) for k, v in saved.items() if now[k] != v and k not in ("resume", "overwrite", "halt_at")}
    frozen = ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in changed.items() if k not in RESUMABLE)
    if frozen:
        raise data.DataError(f"{path}: these flags cannot change on --resume: {frozen}; resume with the saved "
                             f"values, or start again with --overwrite")
    return ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in changed.items())


def apply_resume_flags(c, optimizer, scheduler):
    """The state_dicts bring back the saved lr and weight decay: put today's in (the same numbers when
    unchanged). The schedule itself is today's: make_optimizer built it from today's steps and warmup."""
    scheduler.base_lrs = [c.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = c.lr, c.lr * factor(scheduler.last_epoch)
    for group in optimizer.param_groups:              # the decayed groups (group 0 in an older state.pt)
        if group.get("decay", group is optimizer.param_groups[0]):
            group["weight_decay"] = c.weight_decay


def stop_if_not_finite(grad_norm, step, c):
    """A NaN or infinite loss makes the gradient norm NaN or infinite on every rank alike (DDP sums the
    gradients), so all ranks stop together, before the optimizer step: no checkpoint ever holds such
    weights. (One host-device sync per step: the price of never saving NaNs.)"""
    if not torch.isfinite(grad_norm):
        raise data.DataError(f"step {step}: the loss is not finite (gradient norm {float(grad_norm)}); stopped "
                             f"without saving, so {c.out_dir} keeps its last good checkpoint")


def keep_log_until(path, step):
    """Drop the log lines after `step` (written after the checkpoint a resumed run restarts from, or by a
    replaced run) and a line cut by a kill, so that the log holds each step once."""
    def logged(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            return False
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        data.atomic_write_text(path, "".join(line + "\n" for line in lines if logged(line)))


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10   # Linux reports KiB


def format_seconds(s):
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def chance_lines(means):
    """'X: accuracy a, chance b, ratio a/b' for every logged accuracy X_acc that has its baseline X_chance
    (the accuracy of a trivial guess: the most frequent token, or a random candidate)."""
    return [f"{k[:-4]}: accuracy {v:.4f}, chance {means[k[:-4] + '_chance']:.4f}, "
            f"ratio {v / max(means[k[:-4] + '_chance'], 1e-12):.2f}" for k, v in means.items()
            if k.endswith("_acc") and k[:-4] + "_chance" in means]


class Progress:
    """One line per log interval on rank 0 (step, losses, lr, tokens/s, ETA) and a JSONL log."""

    def __init__(self, c, start_step, is_rank0):
        self.c, self.is_rank0, self.start_step = c, is_rank0, start_step
        self.t0 = self.t_last = time.time()
        self.tokens = self.tokens_total = 0
        self.sums, self.count = {}, 0
        self.log_path = Path(c.out_dir) / "log.jsonl"
        if is_rank0:
            keep_log_until(self.log_path, start_step)

    def add(self, metrics, n_tokens):
        for k, v in metrics.items():   # tensors stay on the device until report(): no sync per step
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.tokens += n_tokens

    def report(self, step, lr, device):
        """Every rank calls this at log steps (the average is a collective); rank 0 prints."""
        means = average_across_ranks({k: float(v) / self.count for k, v in self.sums.items()}, device)
        now, (_, world) = time.time(), rank_and_world()
        tok_per_s = self.tokens * world / (now - self.t_last)
        self.tokens_total += self.tokens * world
        done = step - self.start_step
        eta = (now - self.t0) / done * (self.c.steps - step)
        if self.is_rank0:
            parts = " | ".join(f"{k} {v:.4f}" for k, v in means.items())
            print(f"step {step:>6}/{self.c.steps} | {parts} | lr {lr:.2e} | {tok_per_s:,.0f} tok/s | "
                  f"elapsed {format_seconds(now - self.t0)} | eta {format_seconds(eta)}", flush=True)
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **means, "lr": lr, "tokens_per_s": tok_per_s,
                                    "elapsed_s": now - self.t0}) + "\n")
            for line in chance_lines(means) if step == self.c.steps else []:  # at the end: each objective
                print(line, flush=True)                                          # against its trivial baseline
        self.sums, self.count, self.tokens, self.t_last = {}, 0, 0, now

    def summary(self, device):
        elapsed = time.time() - self.t0
        return (f"{self.tokens_total / max(elapsed, 1e-9):,.0f} tokens/s over {format_seconds(elapsed)}, "
                f"peak memory {peak_memory_mb(device):,.0f} MiB ({device.type})")
# --- shared: end training helpers ---


# --- shared: begin resume ---
def load_checkpoint(c, model, optimizer, scheduler, is_rank0):
    """Restore out_dir/state.pt; returns the step to continue from (0 if there is none yet). Batches,
    masks and dropout are functions of the step, so nothing else needs restoring. The flags in force
    are today's; one that cannot change on resume stops the run (check_resume_flags)."""
    path = Path(c.out_dir) / "state.pt"
    if not path.is_file():
        if is_rank0:
            print(f"resume: no {path} yet, starting from step 0")
        return 0
    state = data.load_training_state(path)
    changed = check_resume_flags(c, state["config"], path)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:     # same flags, other weights: a state.pt from an older layout of the model
        raise data.DataError(f"{path}: its weights do not fit this model ({str(e).splitlines()[-1].strip()}); "
                             f"start again with --overwrite") from None
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    apply_resume_flags(c, optimizer, scheduler)
    if is_rank0:
        print(f"resume: {path} at step {state['step']}"
              + (f"; changed flags apply from now: {changed}" if changed else ""))
    return state["step"]
# --- shared: end resume ---


# --- shared: begin run setup ---
# A run folder is never overwritten silently: these files show that one holds a run.
RUN_FILES = ("state.pt", "log.jsonl", "encoder")


def check_run_folder(c):
    """Before any work: a fresh run into a folder holding a run needs --overwrite (--resume continues it)."""
    held = [name for name in RUN_FILES if (Path(c.out_dir) / name).exists()]
    if c.resume and c.overwrite:
        raise ValueError("--resume continues the run in out_dir and --overwrite replaces it: give one")
    if held and not (c.resume or c.overwrite):
        raise data.DataError(f"{c.out_dir} already holds a run ({', '.join(held)}); continue it with --resume "
                             f"or replace it with --overwrite")


def prepare_run_folder(c):
    """Rank 0, after the last input check (train calls it last), before the first write: remove the
    .tmp files of killed writes, finish a cut checkpoint switch and, with --overwrite, remove the
    replaced run's checkpoint (Progress trims its log)."""
    out = Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data.remove_stale_temporaries(out)
    finish_checkpoint_switch(out)           # a save cut short by a kill: complete it or drop it
    if c.overwrite:
        (out / "state.pt").unlink(missing_ok=True)
        shutil.rmtree(out / "encoder", ignore_errors=True)


def resolve_vocab(c):
    """Before any work: the vocabulary is --vocab when given, else the --init folder's vocab.txt (its
    embedding rows are that vocabulary's), else BERT's bundled one. It must match the model, and the
    windows must fit the model's learned positions."""
    own = Path(c.init) / "vocab.txt" if c.init else None
    if c.vocab == str(data.VOCAB) and own and own.is_file():
        c = dataclasses.replace(c, vocab=str(own))
    n = data.vocab_size_of(c.vocab) if Path(c.vocab).is_file() else c.vocab_size  # (missing: load_tokenizer says)
    model = f"the --init model {c.init}" if c.init else "the model"
    if n != c.vocab_size:
        raise data.DataError(f"{c.vocab}: {n} entries, but {model} has vocab_size {c.vocab_size}")
    if c.max_len > c.max_position:
        raise ValueError(f"--max_len {c.max_len} is more than the {c.max_position} positions of {model} "
                             f"(max_position)")
    return c
# --- shared: end run setup ---


# --- shared: begin train ---
def load_windows(c, rank):
    """The corpus' windows, mapped from its token cache (built by rank 0 on the first run)."""
    t0 = time.time()
    windows = data.token_windows(c.corpus, c.vocab, c.max_len, rank, c.cache_dir, c.prep_workers, rank == 0)
    if rank == 0:
        print(f"data: {c.corpus}: {len(windows):,} windows, {windows.n_tokens:,} tokens, mapped from "
              f"{windows.folder} ({time.time() - t0:.1f}s)")
    return windows


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training, carrying the one line that says where the run stopped."""


def train(c):
    """Every check first (flags at parse time; here the run folder, --init, the vocab, the batch
    arithmetic, the corpus's windows, a resumed state's flags), then the run folder, then the steps.
    This method's own parts are the hooks in its sections above: make_batches, build_model, ADAM_EPS
    and save_extra_files."""
    rank, world, device = setup_distributed()
    is_rank0 = rank == 0
    torch.manual_seed(c.seed)
    c = dataclasses.replace(c, init=data.resolve_model(c.init))   # 'minilm' or a hub id -> a local folder
    check_run_folder(c)                             # before any work: a run folder is never overwritten silently
    c = data.resolve_batch(c, world)                # --global_batch / --batch_size: before the token cache
    encoder = Encoder.from_pretrained(c.init, c) if c.init else Encoder(c)
    c = resolve_vocab(encoder.config)               # --init brings the checkpoint's model sizes and vocab
    if is_rank0 and getattr(encoder, "new_mlm_head", False):
        print(f"{c.init}: no MLM head in the checkpoint; training a new one, its decoder tied to the word embeddings")
    windows = load_windows(c, rank)
    c = data.resolve_schedule(c, world, len(windows))   # --epochs -> steps; fewer windows than one batch: stop
    model = build_model(c, encoder, windows, rank).to(device)
    optimizer, scheduler = make_optimizer(model, c, eps=ADAM_EPS)
    start_step = load_checkpoint(c, model, optimizer, scheduler, is_rank0) if c.resume else 0
    if is_rank0:
        prepare_run_folder(c)                       # after the last check: --overwrite deletes only now
        data.atomic_write_json(Path(c.out_dir) / "config.json", dataclasses.asdict(c))
        n_params = sum(p.numel() for p in model.parameters())
        left_out = len(windows) % (c.batch_size * world)
        print(f"model: {n_params / 1e6:.1f}M parameters | {world} process(es) on {device.type} | "
              f"global batch {c.batch_size * world * c.grad_accum} | {left_out} windows sit out each epoch")
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    loader = torch.utils.data.DataLoader(
        make_batches(c, windows, rank, world), batch_size=None, num_workers=c.workers,
        sampler=range(start_step * c.grad_accum, c.steps * c.grad_accum),
        generator=torch.Generator())  # its own generator: the global RNG (dropout) resumes exactly
    autocast = autocast_bf16(device, c.bf16)
    progress = Progress(c, start_step, is_rank0)
    batches, step, saved = iter(loader), start_step, start_step
    ctrl_c, hold_ctrl_c, restore_sigint = catch_ctrl_c()
    try:
        for step in range(start_step + 1, c.steps + 1):
            for micro in range(c.grad_accum):
                micro_step = (step - 1) * c.grad_accum + micro
                batch = next(batches)
                progress_tokens = int(batch["attention_mask"].sum())
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                # dropout, like the batch, is a function of the step: resume is exact without saving RNG state
                torch.manual_seed(data.step_seed(c.seed, rank, micro_step))
                last = micro == c.grad_accum - 1
                with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():  # DDP syncs on the last
                    with autocast:
                        loss, metrics = ddp(batch)
                    (loss / c.grad_accum).backward()
                progress.add(metrics, progress_tokens)
            stop_if_not_finite(torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip), step, c)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % c.log_every == 0 or step == c.steps:
                progress.report(step, scheduler.get_last_lr()[0], device)
            if step % c.save_every == 0 or step == c.steps or step == c.halt_at:
                with hold_ctrl_c():   # a Ctrl-C now stops after the checkpoint, which the line then names
                    save_checkpoint(c, model, optimizer, scheduler, step, is_rank0, saved)
                    saved = step
            if step == c.halt_at:
                break
            if ctrl_c:          # a Ctrl-C held during the save, or whose KeyboardInterrupt Python dropped
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        last = f"last checkpoint at step {saved} in {c.out_dir}" if saved else f"no checkpoint yet in {c.out_dir}"
        raise Interrupted(f"interrupted at step {step}; {last}; continue with --resume") from None
    finally:
        restore_sigint()   # the caller's own handler again (a test, a notebook, study.py)
    if is_rank0:
        print(f"done: {progress.summary(device)}; encoder in {Path(c.out_dir) / 'encoder'}")
    if dist.is_initialized():
        dist.barrier()   # every rank is past its last collective (the group ends in data.leave_distributed)


def save_checkpoint(c, model, optimizer, scheduler, step, is_rank0, last_saved=0):
    """Rank 0 writes the encoder (a Hugging Face folder, for fine-tuning, plus save_extra_files) and the
    full training state (every module, optimizer, scheduler) for --resume (batches, masks and dropout
    are functions of the step: no RNG state is saved). Both go to temporaries first and are switched
    only when both are whole (see finish_checkpoint_switch), so a full disk or a kill leaves the last
    checkpoint whole: encoder/ and state.pt never hold different steps. A full disk stops the run with
    one line naming the file and the last good step."""
    if is_rank0:
        out = Path(c.out_dir)
        new_encoder, new_state = out / ".encoder.new", out / ".state.pt.new"
        target = out / "encoder"
        out.mkdir(parents=True, exist_ok=True)
        try:
            new_state.write_bytes(b"")              # while it exists, the switch has not begun
            shutil.rmtree(new_encoder, ignore_errors=True)
            model.encoder.save_pretrained(new_encoder, c.vocab)
            if c.init:   # the starting checkpoint's pooling and similarity (sentence-transformers files)
                data.copy_retriever_settings(c.init, new_encoder)
            save_extra_files(c, model, new_encoder)
            target = out / "state.pt"
            data.save_training_state(new_state, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "config": dataclasses.asdict(c)})
        except Exception as e:  # noqa: BLE001 -- torch.save reports a full disk as a RuntimeError
            shutil.rmtree(new_encoder, ignore_errors=True)
            new_state.unlink(missing_ok=True)
            if data.is_disk_full(e, out):
                raise data.disk_full_error(target, out, last_saved) from None
            raise
        os.replace(new_state, out / "state.pt")     # the commit: from here on step `step` is the checkpoint
        finish_checkpoint_switch(out)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()   # short: nobody races ahead of a checkpoint being written


def finish_checkpoint_switch(out):
    """Complete or undo a checkpoint switch cut short by a kill: .state.pt.new still there = state.pt
    was not replaced yet, so drop the new files; else state.pt is new and .encoder.new its encoder."""
    out = Path(out)
    new_encoder, old_encoder, new_state = out / ".encoder.new", out / ".encoder.old", out / ".state.pt.new"
    if new_state.exists():
        new_state.unlink()
        shutil.rmtree(new_encoder, ignore_errors=True)
    if new_encoder.is_dir():
        shutil.rmtree(old_encoder, ignore_errors=True)
        if (out / "encoder").exists():
            os.replace(out / "encoder", old_encoder)
        os.replace(new_encoder, out / "encoder")
    shutil.rmtree(old_encoder, ignore_errors=True)


def catch_ctrl_c():
    """Ctrl-C raises KeyboardInterrupt as usual, and is also recorded in the returned list: Python drops
    a KeyboardInterrupt raised while it runs a finalizer ("Exception ignored in ..."), and the training
    loop then still stops at the end of the step. Inside hold() a Ctrl-C is only recorded: a checkpoint
    being written is finished, so that "last checkpoint at step M" is the one on disk. A SIGINT that the
    shell ignores stays ignored. Returns (that list, hold, a function that puts the previous handler back)."""
    seen, holding, before = [], [], signal.getsignal(signal.SIGINT)

    @contextlib.contextmanager
    def hold():
        holding.append(True)
        try:
            yield
        finally:
            holding.pop()
    if before is not signal.default_int_handler or threading.current_thread() is not threading.main_thread():
        return seen, hold, lambda: None
    def on_ctrl_c(signum, frame):
        seen.append(signum)
        if not holding:
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_ctrl_c)
    return seen, hold, lambda: signal.signal(signal.SIGINT, before)


def run_command_line(run):
    """run() with one line for each expected failure: a bad flag or input file (ValueError, DataError),
    a full disk (DataError), Ctrl-C (exit code 130). Under torchrun only rank 0 prints, and every rank
    leaves the process group and exits with code 1 (130), without a traceback."""
    try:
        run()
        data.leave_distributed()   # under torchrun: the process group ended, gloo's without its teardown
        return
    except ValueError as e:   # a bad flag (ValueError) or a bad input file (data.DataError, one too)
        line, code = f"error: {e}", 1
    except KeyboardInterrupt as e:
        line, code = str(e) or "interrupted before the first step; nothing was trained", 130
    data.exit_with(line, code)   # one line (rank 0 only under torchrun), the process group left, no traceback
# --- shared: end train ---


if __name__ == "__main__":
    c = data.parse_config(Config, sys.argv[1:], __doc__, PAPER_PRESET, FLAG_RULES)
    run_command_line(lambda: diagnose(c) if c.diagnose else train(c))
