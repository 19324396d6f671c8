"""SEED-Encoder: pre-train a text encoder whose [CLS] vector must feed a weak decoder.

Lu et al., EMNLP 2021 (arXiv:2102.09206, section 3.4). A decoder too weak to lean on its own context
(3 layers; in each, a token attends only to the k = 2 positions up to itself and the start, so after
3 layers it sees 4 tokens back) must rebuild the text from the encoder's [CLS] vector, so that vector
has to carry the text. The paper's equations and the functions:

    eq. 9     L_dec = - sum_t log P(x_t | x_{t-k..t-1}, [CLS])         decoder_loss (chunked: chunked_decoder_loss),
              the restricted span and the shifted text                 window_mask, decoder_inputs_and_targets,
              the decoder that reads only [CLS]                        WeakDecoder
    eq. 10    L = L_MLM + L_dec                                        PretrainModel.terms (L_MLM: mlm_loss)
    Figure 5  [CLS] cosine of random text pairs by length               research.mechanisms --cls_by_length

It has costa.py's skeleton section for section, COSTA's own parts swapped for the weak decoder (`diff costa.py
seed.py`). The run machinery (run folder, resume, checkpoints, progress, Ctrl-C) is in run/, one call each from
train(). Each departure from the paper is said where it happens, tagged with its key; docs/departures.md lists them.

    python seed.py --preset lab                      # first: its head learns, on a CPU (docs/lab.md)
    python seed.py                                   # small model, bundled Wikipedia slice, CPU, from scratch
    python seed.py --dec_span 0 --dec_layers 5       # Figure 3's "strong decoder" ablation
    torchrun --nproc_per_node=4 seed.py --preset paper
    python seed.py --resume                          # continue from out_dir/state.pt exactly
    python seed.py --overwrite                       # start again in an out_dir that holds a run (else refused)

The encoder is written to {out_dir}/encoder as a Hugging Face BERT folder for finetune.py; the decoder
lives only in {out_dir}/state.pt (the training state). Figure 5 for it and an MLM-only encoder
(`python costa.py --gwc_weight 0`): `python -m research.mechanisms --model A,B --cls_by_length`.
"""
import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import data
import run


# ==============================================================================================
# Config
# ==============================================================================================
@dataclass
class Config(run.TrainConfig):
    """SEED-Encoder's own flags (section 3.4; Figure 3 ablations); those every method shares are run.TrainConfig's.
    With --bottleneck mean the decoder reads the masked mean of the output tokens instead of [CLS]."""
    dec_layers: int = 3           # decoder Transformer blocks (paper: 3; Figure 3 also tries 1 and 5)
    dec_span: int = 2             # self-attention span k of eq. 9 (paper: 2); 0 = full causal, the "strong decoder"
    dec_weight: float = 1.0       # weight of L_dec in eq. 10 (paper: 1, L_MLM + L_dec)
    dec_chunk: int = 2048         # decoder positions per chunk of vocabulary logits (peak ~ chunk x |V| fp32); 0 = all
    compile: bool = True          # eq. 9 fused, the encoder compiled: 1.68x on a CPU (results/speed/compile-encoder.md)
    out_dir: str = "runs/seed"    # checkpoints, config.json and log.jsonl go here


# --preset paper: section 4.1. From scratch, BERT-base sizes, 1M steps at batch 256 over all ranks, length 512,
# 15% masks, Adam eps 1e-6 (train's make_optimizer) and betas (0.9, 0.999), lr 1e-4 after 1% warm-up, then
# linear decay to zero, dropout 0.1, clip 1.0, weight decay 0.01 (Config's defaults).
# Departure (seed-heads): 12 heads, BERT-base's and the authors' code's, where the paper's text says eight.
# Departure (seed-vocab): BERT's 30,522-token vocabulary; the paper's 32,768 (Ke et al., 2020) is not available.
PAPER_PRESET = dict(hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072, max_len=512, lr=1e-4,
                    warmup=0.01, steps=1_000_000, global_batch=256, mask_prob=0.15, dropout=0.1, clip=1.0,
                    weight_decay=0.01, **run.PAPER_RUN)   # PAPER_RUN: workers, checkpoints
# --preset lab: run.LAB_PRESET (MiniLM on SciFact), L_dec x 8, 100 steps of 16 windows; eager (docs/lab.md says why).
LAB_PRESET = dict(run.LAB_PRESET, dec_weight=8.0, steps=100, batch_size=16, compile=False)


# The domain of each of SEED's flags, checked when the flags are parsed, before any work (with TrainConfig's).
FLAG_RULES = {"dec_layers": ">= 1", "dec_span": ">= 0", "dec_chunk": ">= 0", "dec_weight": "> 0"}


# ==============================================================================================
# Model: the encoder is the shared block at the end of this file; SEED adds the weak decoder
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


def window_mask(length, k=2, device=None):
    """The weak decoder's self-attention mask (eq. 9), True = may attend: query i sees keys {0} U {i-k+1, ..., i},
    itself, the k-1 previous positions and the start symbol at 0 (as the authors' code). k = 0, None or "full": the
    causal mask, Figure 3's "strong decoder". In every layer, as the authors', so the receptive field grows with
    depth (3 layers, k = 2: 0 and i-3..i); eq. 9's condition on x_{t-k..t-1} holds exactly for one layer."""
    query = torch.arange(length, device=device)[:, None]                        # (L, 1)
    key = torch.arange(length, device=device)[None, :]                          # (1, L)
    causal = key <= query                                                       # (L, L)
    if k in (0, None, "full"):
        return causal
    if int(k) < 1:
        raise ValueError(f"span k must be >= 1, or 0 / None / 'full' for causal; got {k!r}")
    return causal & ((key > query - int(k)) | (key == 0))                       # (L, L)


def decoder_inputs_and_targets(input_ids, attention_mask, ignore_index=-100):
    """`[CLS] x1..xn [SEP] [PAD]..` (unmasked) -> the decoder's input `[CLS] x1..xn` (the text shifted right,
    [CLS] the start symbol) and its target `x1..xn [SEP]`, padding targets = ignore_index (a row's [SEP]/[PAD]
    tail in the input is unseen: the mask is causal). Position t-1 holds x_{t-1} and predicts x_t."""
    decoder_input = input_ids[:, :-1]                                                 # (B, L-1)
    targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, ignore_index)  # (B, L-1)
    return decoder_input, targets


class WindowSelfAttention(nn.Module):
    """The decoder's self-attention, the encoder's with the window mask: softmax(q k^T / sqrt(d) + mask) v."""

    def __init__(self, c):
        super().__init__()
        self.heads, self.dropout = c.num_heads, c.dropout
        self.query, self.key, self.value, self.out = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(4))

    def forward(self, x, attend):                               # x (B, L, H); attend (L, L) True = key visible
        B, L, H = x.shape
        split = lambda t: t.view(B, L, self.heads, H // self.heads).transpose(1, 2)  # (B, heads, L, H/heads)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, L, H))                      # (B, L, H)


class DecoderBlock(nn.Module):
    """Pre-LN block: restricted self-attention, cross-attention to the encoder's [CLS], GELU FFN, each
    x + f(LN(x)). The final LayerNorm that pre-LN needs is WeakDecoder's.
    Departure (seed-pre-ln): the paper keeps "all else the same with the encoder", BERT, which is
    post-LN; we follow the authors' code, a fairseq decoder with decoder_normalize_before=True."""

    def __init__(self, c):
        super().__init__()
        self.attn = WindowSelfAttention(c)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        # Cross-attention to a memory of ONE vector, [CLS]: softmax over a single key is exactly 1, so every position
        # receives out(value(h0)) whatever the query and key projections: computed directly (test_losses checks).
        # Departure (seed-cross-dropout): no attention-probability dropout here (it would zero the single weight).
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
    """SEED's weak decoder (section 3.4): `dec_layers` blocks of self-attention span `dec_span`, reading the
    encoder only through h0, in every block. Input and output projection: the encoder's token embedding (as the
    authors'); its own positions and embedding LayerNorm (layernorm_embedding=True). Dropped after pre-training."""

    def __init__(self, c, word_embedding):
        super().__init__()
        self.span = c.dec_span
        self.position = nn.Embedding(c.max_position, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(c) for _ in range(c.dec_layers))
        self.final_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)   # pre-LN's last LayerNorm
        self.word_embedding = [word_embedding]  # a list, so the tied matrix is not registered twice
        for module in self.modules():                       # BERT's initialisation, as the encoder's
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def embed(self, input_ids):                                                 # (B, L)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)   # (L,)
        x = self.word_embedding[0](input_ids) + self.position(positions)        # (B, L, H)
        return self.dropout(self.norm(x))

    def decode(self, x, h0):                                 # x (B, L, H) embedded input; h0 (B, H)
        attend = window_mask(x.shape[1], self.span, x.device)                   # (L, L)
        for block in self.blocks:
            x = block(x, h0, attend)
        return self.final_norm(x)                                               # (B, L, H)

    def forward(self, input_ids, h0):                # (B, L) shifted-right text; (B, H) the text vector
        return self.decode(self.embed(input_ids), h0)  # h0 ([CLS]) is its only view of the encoder


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


def decoder_loss(states, weight, targets, reduction="mean"):
    """The weak decoder's reconstruction loss (eq. 9), the softmax over the tied token embedding E:

        L_dec = - sum_t log P(x_t | x_{t-k..t-1}, h0),   P(. | ...) = softmax(s_t E^T)

    states (..., H): the decoder's outputs s_t; weight (V, H): E, the encoder's embedding; targets (...): x_t,
    -100 = none (padding). -> (loss, n_correct: targets that are the top-1 logit); the softmax in fp32."""
    # Departure (seed-dec-mean): the mean over the target tokens where eq. 9 sums (as the authors' code); "sum": eq. 9.
    targets = targets.reshape(-1)                                                   # (N,)
    logits = (states.reshape(-1, states.shape[-1]) @ weight.T).float()              # (N, V) s_t E^T
    total = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")      # () sum of -log P
    n_correct = (logits.argmax(-1) == targets).sum()                               # ()
    if reduction == "sum":
        return total, n_correct
    return total / targets.ne(-100).sum().clamp_min(1), n_correct                  # mean over tokens


def chunked_decoder_loss(states, weight, targets, chunk):
    """decoder_loss (eq. 9) `chunk` positions at a time (0 = all at once), each under activation checkpointing, so
    the peak holds one chunk's (chunk, V) logits, not all N x V; the same loss and gradients (test_losses).
    states (N, H), weight (V, H) the tied embedding, targets (N,) -100 = none -> (loss (), n_correct ())."""
    if chunk == 0 or states.shape[0] <= chunk:
        return decoder_loss(states, weight, targets)                                # (), ()
    total, correct = states.new_zeros((), dtype=torch.float32), 0
    for start in range(0, states.shape[0], chunk):
        part = slice(start, start + chunk)
        part_total, part_correct = checkpoint(decoder_loss, states[part], weight, targets[part], "sum", use_reentrant=False)
        total, correct = total + part_total, correct + part_correct                 # (), ()
    return total / targets.ne(-100).sum().clamp_min(1), correct                     # mean over tokens


# The pre-training objective (eq. 10), built from the model pieces and the losses above.
class PretrainModel(nn.Module):
    """The encoder plus what pre-training adds on top of it. Returns the loss and what to log."""

    def __init__(self, c, encoder, frequent_token=None):
        super().__init__()
        self.config, self.encoder = c, encoder
        self.decoder = WeakDecoder(c, encoder.embeddings.word)
        self.frequent_token = frequent_token   # the corpus' most frequent token: the unigram baseline
        self.decoder_loss = decoder_loss       # eq. 9 (train() wraps it: --compile)

    def new_parameters(self):
        """What the checkpoint did not bring (--head_warmup trains these first): the weak decoder, and the MLM
        head's dense, LayerNorm and bias when the checkpoint has none (both project with the encoder's embedding)."""
        mlm_head = self.encoder.mlm_head.parameters() if getattr(self.encoder, "new_mlm_head", True) else []
        return [*self.decoder.parameters(), *mlm_head]

    def terms(self, batch):
        """Eq. 10 term by term, {name: weighted scalar}, and what to log: each accuracy X_acc with its
        trivial baseline X_chance, always predicting the corpus' most frequent token."""
        c = self.config
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])       # (B, L, H) masked text
        mlm, n_correct, n_masked = mlm_loss(hidden, batch["labels"], self.encoder.mlm_head)
        h0 = text_vector(hidden, batch["attention_mask"], c.bottleneck)  # (B, H) the only bridge
        # The decoder rebuilds the unmasked text, h0 not detached (L_dec trains the encoder): the paper is silent
        states = self.decoder(batch["decoder_input"], h0)                        # (B, L-1, H)
        kept = batch["decoder_targets"] != -100                                  # (B, L-1) every real token
        targets = batch["decoder_targets"][kept]                                 # (N,)
        dec, dec_correct = self.decoder_loss(states[kept], self.decoder.word_embedding[0].weight, targets)  # eq. 9
        # Eq. 10 as the paper writes it, weights 1:1 (the authors' 0.5:0.5 only halves the gradient; AdamW undoes it)
        # Departure (option-seed-dec-weight): off by default; --dec_weight w weighs L_dec w times L_MLM.
        terms = {"L_MLM": mlm, "L_dec": dec} if c.dec_weight == 1 else {"L_MLM": mlm, "w L_dec": c.dec_weight * dec}
        return terms, {
            "mlm": mlm.detach(), "mlm_acc": n_correct / max(n_masked, 1),
            "mlm_chance": data.most_frequent_accuracy(batch["labels"], self.frequent_token),
            "dec": dec.detach(), "dec_acc": dec_correct / max(targets.numel(), 1),
            "dec_chance": data.most_frequent_accuracy(targets, self.frequent_token)}

    def forward(self, batch):
        terms, metrics = self.terms(batch)
        return sum(terms.values()), metrics                                      # eq. 10


# ==============================================================================================
# Data
# ==============================================================================================
class Batches(torch.utils.data.Dataset):
    """Item m is this rank's batch at micro-step m: a pure function of (seed, rank, m), so data-loader
    workers can build batches ahead on the CPU and a resumed run sees exactly the same batches."""

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
        masked, labels = data.mask_tokens(ids, maskable, c.vocab_size, self.special["mask"],
                                          generator, c.mask_prob)
        decoder_input, decoder_targets = decoder_inputs_and_targets(ids, attention_mask)  # unmasked text
        return {"input_ids": masked, "attention_mask": attention_mask, "labels": labels,
                "decoder_input": decoder_input, "decoder_targets": decoder_targets}


# ==============================================================================================
# Training loop
# ==============================================================================================
def train(c):
    """Pre-train with SEED-Encoder. Every check comes first (flags when parsed; here the run folder, --init, the
    vocabulary, the batch arithmetic, the corpus), then the steps. Run machinery: one call each into run/."""
    rank, world, device = setup_distributed(c.dist_timeout)      # torchrun: one process per device
    torch.manual_seed(c.seed)                                    # the encoder's and the decoder's init
    c = run.start_run(c, world)                                  # --init found, run folder free, batch split
    encoder = run.init_encoder(Encoder, c)                       # random, or the --init checkpoint
    c = run.resolve_vocab(encoder.config)                        # --init brings its sizes and vocabulary
    windows = run.load_windows(c, rank)                          # the token cache, built once by rank 0
    c = run.resolve_schedule(c, world, len(windows))             # --epochs -> steps
    model = PretrainModel(c, encoder, data.most_frequent_token(windows)).to(device)
    # Eq. 9 as training runs it: compiled (--compile; else dec_chunk positions at a time, the same values), its rows
    # padded to a multiple of 1/8 of their most, so that the compiled kernel sees a few shapes, not one per batch.
    eq9 = run.speed.fused(decoder_loss, c, lambda *a: chunked_decoder_loss(*a, c.dec_chunk))
    model.decoder_loss = run.speed.padded_rows(eq9, bucket=-(-c.batch_size * (c.max_len - 1) // 8))
    model.encoder.forward = run.speed.compiled_encoder(model.encoder, c)   # --compile: its elementwise work fused
    optimizer, scheduler = run.make_optimizer(model, c, eps=1e-6)    # SEED 4.1: Adam's epsilon 1e-6
    training = run.TrainingRun(c, model, optimizer, scheduler, device, windows)  # resume, run folder, log
    # Each rank trains on its own slice of every global batch (data.batch_indices); DDP averages the
    # gradients over the ranks (SEED's losses are per text: nothing to gather).
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
