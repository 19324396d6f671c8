"""COSTA: pre-train a discriminative text encoder by contrastive span prediction.

Ma et al., SIGIR 2022 (arXiv:2204.10641, section 3.2-3.3, Algorithm 1). With --gwc_weight 0 it is the
papers' BERT/MLM baseline. The paper's equations, in order, and the function that computes each:

    eq. 1-3   span length ~ Beta, start ~ Uniform, the span          sample_spans
    eq. 4     the encoder's output vectors h_0 .. h_n                  Encoder.forward (end of file)
    eq. 5-6   the text vector z_0 = Tanh(FFN(h_0))                     text_vector, Projector
    eq. 7     a span's vector: the mean of its tokens' h               span_vectors
    eq. 8     group-wise contrastive loss (GWC), text vs its spans     gwc_loss
    eq. 9     masked language modelling                                mlm_loss
    eq. 10    L = lambda L_GWC + L_MLM                                 PretrainModel.terms

Top to bottom: config, model, loss, data, the training loop (train), which wraps the method's pieces from
outside (fp32, every rank's negatives); then the blocks every method file owns a copy of (the BERT encoder, the
distributed gather). The run machinery (run folder, resume, checkpoints, progress, Ctrl-C) is in run/, one call each
from train(). Each departure from the paper is said where it happens, tagged; docs/departures.md lists them.

    python costa.py --preset lab                     # first: its head learns, on a CPU (docs/lab.md)
    python costa.py                                  # small model, bundled Wikipedia slice, CPU, from scratch
    python costa.py --steps 1000 --lr 3e-4           # any Config field (here or run.TrainConfig) by name
    torchrun --nproc_per_node=4 costa.py --preset paper --init bert-base-uncased/
    python costa.py --resume                         # continue from out_dir/state.pt exactly
    python costa.py --overwrite                      # start again in an out_dir that holds a run (else refused)
    python costa.py --gwc_weight 0                   # MLM only (the BERT baseline)
    python costa.py --granularities word,phrase,sentence --span_T 4 --tau 1 --epochs 3   # Table 4, no paragraphs

(Section 5.3's ablations, Tables 4-7, ran with T = 3, tau = 1 and 3 epochs, not the main run's 5, 0.1
and 6; Table 4 keeps 12 spans per text, so 3 granularities take T = 4.)

The encoder is written to {out_dir}/encoder as a Hugging Face BERT folder for finetune.py.
"""
import contextlib
import datetime
import functools
import os
from dataclasses import dataclass

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
    """COSTA's own flags (section 3.2 and 4.5.1; ablations in Tables 4-7). The flags every method
    shares (corpus, model size, optimisation, run folder) are run.TrainConfig's."""
    gwc_weight: float = 0.1       # lambda in L = lambda L_GWC + L_MLM (eq. 10); 0 = MLM-only baseline
    tau: float = 0.1              # temperature of eq. 8 (Table 7 tries 10, 1, 0.1, 0.01)
    span_T: int = 5               # spans per granularity per text, T (Table 5 tries 3, 5, 10, 20)
    granularities: str = "word,phrase,sentence,paragraph"  # which span levels; drop one for Table 4
    span_alpha: float = 4.0       # span length p ~ Beta(alpha, beta) (eq. 1): 4, 2 favours long spans
    span_beta: float = 2.0        # see span_alpha
    span_resample: bool = False   # fresh spans at every step (ours); default: Algorithm 1's, once per window, seeded
    projector: str = "nonlinear"  # text vector head (eq. 5): nonlinear = Tanh(Linear), linear, none (Table 6)
    gwc_sim: str = "dot"          # sim of eq. 8: "dot" (the paper's) or "cos" (cosine, bounded logits: +-1 / tau)
    out_dir: str = "runs/costa"   # checkpoints, config.json and log.jsonl go here


# --preset paper: section 4.5.1. From BERT's checkpoint (--init bert-base-uncased), BERT-base sizes, lr 5e-5 with
# Adam and 10% linear warm-up (then linear decay: the paper does not say), 6 epochs of Wikipedia, chunks of at
# most 512 tokens, tau 0.1, lambda 0.1 (Config's defaults). Silent: the batch size (we keep --batch_size 32 per
# rank on its up to 4 GPUs; --global_batch fixes it), Adam's epsilon (torch's 1e-8), weight decay and clipping.
PAPER_PRESET = dict(hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072, max_len=512, lr=5e-5,
                    warmup=0.1, epochs=6.0, **run.PAPER_RUN)   # PAPER_RUN: workers, checkpoints
# --preset lab: run.LAB_PRESET (from MiniLM on SciFact, 50 steps), eq. 8 on cosines: the dot product of
# MiniLM's vectors gives logits too large to learn from in 50 steps.
LAB_PRESET = dict(run.LAB_PRESET, gwc_sim="cos")


# The domain of each of COSTA's flags, checked when the flags are parsed, before any work (with TrainConfig's).
FLAG_RULES = {
    "gwc_weight": ">= 0", "tau": "> 0", "span_T": ">= 1", "span_alpha": "> 0", "span_beta": "> 0",
    "projector": "one of {nonlinear, linear, none}", "granularities": "names from {word, phrase, sentence, paragraph}",
    "gwc_sim": "one of {dot, cos}",
}


# ==============================================================================================
# Model: the encoder (eq. 4) is the shared block at the end of this file; COSTA adds the vectors
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


PROJECTORS = ("nonlinear", "linear", "none")


class Projector(nn.Module):
    """Text vector z_0 = projector(h_0) (eq. 5-6). kind "nonlinear" = Tanh(Linear(H, H)), our reading of
    the paper's "Tanh(FFN)" (it does not say how many layers the FFN has; one Linear, as BERT's pooler);
    "linear" = Linear(H, H); "none" = identity (the Table 6 ablations). Pre-training only: it is saved
    in the training state, not in the encoder folder."""

    def __init__(self, hidden_size, kind="nonlinear"):
        super().__init__()
        if kind not in PROJECTORS:
            raise ValueError(f"--projector must be one of {', '.join(PROJECTORS)}, got {kind!r}")
        self.net = {"nonlinear": lambda: nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh()),
                    "linear": lambda: nn.Linear(hidden_size, hidden_size),
                    "none": nn.Identity}[kind]()

    def forward(self, h0):                                                       # (B, H)
        return self.net(h0)                                                      # (B, H)


def span_vectors(hidden, spans):
    """Span vector = mean of the output token vectors over [start, end) (eq. 7), all spans at once:
    a (B, S, L) averaging matrix times the hidden states. hidden (B, L, H); spans (B, S, 2) long."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)            # (L,)
    start, end = spans[..., :1], spans[..., 1:]                                 # (B, S, 1) each
    weights = ((positions >= start) & (positions < end)) / (end - start)        # (B, S, L) rows sum to 1
    return torch.bmm(weights.to(hidden.dtype), hidden)                          # (B, S, H)


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


def gwc_loss(text_vecs, span_vecs, tau, n_anchors=None, sim="dot"):
    """Group-wise contrastive loss (eq. 8): each text's vector z_i against its own S = 4T spans S(i), its positives:

        L_GWC = sum_i -1/(4T) sum_{p in S(i)} log( exp(sim(z_i, z_p) / tau) / sum_{j != i} exp(sim(z_i, z_j) / tau) )

    text_vecs (N, H), span_vecs (N, S, H); j runs over the N texts and N*S spans. Columns for N = 2, S = 3: 0-1 the
    texts, 2-4 text 0's spans, 5-7 text 1's. n_anchors (passed by train()'s all-ranks wrapper): texts 0..n-1 anchor.
    -> (loss, accuracy: the share of anchors whose best candidate is one of their own spans)."""
    # Departure (costa-gwc-mean): the mean over the anchors where eq. 8 sums, so lambda does not scale with the batch.
    # Departure (option-costa-gwc-cos): sim="cos" is cosine / tau, bounded by 1 / tau (the paper's: "dot").
    N, S = span_vecs.shape[:2]
    n = N if n_anchors is None else n_anchors
    candidates = torch.cat([text_vecs, span_vecs.reshape(N * S, -1)])           # (N(S+1), H) all z_j
    if sim == "cos":
        candidates = F.normalize(candidates, dim=-1)
    logits = candidates[:n] @ candidates.T / tau                                 # (n, N(S+1)) anchors z_i
    rows = torch.arange(n, device=text_vecs.device)                             # (n,)
    logits[rows, rows] = float("-inf")                                           # 1[i != j]: drop z_i itself
    positives = N + rows[:, None] * S + torch.arange(S, device=text_vecs.device)  # (n, S) columns of S(i)
    log_prob = logits.gather(1, positives) - logits.logsumexp(dim=1, keepdim=True)  # (n, S)
    best = logits.argmax(dim=1)                                                  # (n,)
    accuracy = ((best >= positives[:, 0]) & (best <= positives[:, -1])).float().mean()
    return -log_prob.mean(), accuracy


# The pre-training objective (eq. 10), built from the model pieces and the losses above.
class PretrainModel(nn.Module):
    """The encoder plus what pre-training adds on top of it. Returns the loss and what to log.
    One forward pass over the masked text gives the MLM logits, h_0 and the span vectors: eq. 8 is
    computed on the MASKED input, in the MLM forward pass (our choice: the paper does not say which
    input eq. 5-7 see; one pass costs half of two)."""

    def __init__(self, c, encoder, frequent_token=None, world=1):
        super().__init__()
        self.config, self.encoder = c, encoder
        # no projector in the MLM-only baseline: under torchrun every parameter must get a gradient
        self.projector = Projector(c.hidden_size, c.projector) if c.gwc_weight else None
        self.frequent_token = frequent_token   # the corpus' most frequent token: MLM's trivial baseline
        self.span_vectors, self.gwc_loss = span_vectors, gwc_loss   # eq. 7 and 8 (train() wraps them: fp32, ranks)
        self.world = world                     # processes whose texts are eq. 8's candidates (gwc_chance's N)

    def new_parameters(self):
        """What the checkpoint did not bring (--head_warmup trains these first): the projector, and the
        MLM head's dense, LayerNorm and bias when the checkpoint has none (its decoder is the embedding)."""
        mlm_head = self.encoder.mlm_head.parameters() if getattr(self.encoder, "new_mlm_head", True) else []
        return [*(self.projector.parameters() if self.projector else []), *mlm_head]

    def terms(self, batch):
        """Eq. 10 term by term, {name: weighted scalar}, and what to log: each accuracy X_acc with its
        trivial baseline X_chance (research/study.py measures each term's gradient on the encoder)."""
        c = self.config
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])       # (B, L, H)
        mlm, n_correct, n_masked = mlm_loss(hidden, batch["labels"], self.encoder.mlm_head)
        metrics = {"mlm": mlm.detach(), "mlm_acc": n_correct / max(n_masked, 1),
                   "mlm_chance": data.most_frequent_accuracy(batch["labels"], self.frequent_token)}
        if not c.gwc_weight:
            return {"L_MLM": mlm}, metrics
        h0 = text_vector(hidden, batch["attention_mask"], c.bottleneck)          # (B, H) [CLS] or mean
        text_vecs = self.projector(h0)                                           # (B, H) z_0, eq. 6
        span_vecs = self.span_vectors(hidden, batch["spans"])                    # (B, S, H) eq. 7
        gwc, accuracy = self.gwc_loss(text_vecs, span_vecs, c.tau, sim=c.gwc_sim)  # eq. 8
        N, S = text_vecs.shape[0] * self.world, span_vecs.shape[1]               # texts of one micro-step, all ranks
        return {"L_MLM": mlm, "lambda L_GWC": c.gwc_weight * gwc}, {             # eq. 10: lambda L_GWC + L_MLM
            **metrics, "gwc": gwc.detach(), "gwc_acc": accuracy, "gwc_chance": S / (N * (S + 1) - 1)}

    def forward(self, batch):
        terms, metrics = self.terms(batch)
        return sum(terms.values()), metrics                                      # eq. 10


# ==============================================================================================
# Data
# ==============================================================================================
# (l_min, l_max) in tokens, 4.5.1. At the default 128-token window (paper: 512) a "paragraph" span of
# 64-128 tokens covers 50-100 % of the text; use --max_len 512 for the paper's proportions.
SPAN_LENGTHS = {"phrase": (4, 16), "sentence": (16, 64), "paragraph": (64, 128)}
GRANULARITIES = ("word", *SPAN_LENGTHS)


@functools.cache   # every window's sample_spans reads the flag
def parse_granularities(text):
    """"word,phrase,sentence,paragraph" -> a list of distinct known names (Table 4 drops one)."""
    names = [g.strip() for g in text.split(",") if g.strip()]
    if not names or len(set(names)) != len(names) or not set(names) <= set(GRANULARITIES):
        raise ValueError(f"--granularities must be distinct names from {','.join(GRANULARITIES)}, "
                             f"got {text!r}")
    return names


def word_spans(word_starts, n_tokens, stopword_mask=None):
    """Candidate word-level spans [start, end), (n, 2): the whole words between [CLS] and [SEP]."""
    sep = n_tokens - 1
    starts = np.flatnonzero(word_starts[1:sep]) + 1
    words = np.stack([starts, np.append(starts[1:], sep)[:len(starts)]], axis=1)  # (a leading "##" run is left out)
    content = words if stopword_mask is None else words[~np.asarray(stopword_mask, dtype=bool)[starts]]
    return content if len(content) else words if len(words) else np.array([[1, sep]])  # all stopwords: any word; no word start: the fragment


def sample_spans(word_starts, n_tokens, config, rng, stopword_mask=None):
    """Multi-granularity span sampling for one window [CLS] x_1 .. x_m [SEP] (eq. 1-3): config.span_T spans
    [start, end) per granularity of config.granularities, in that order, all within tokens 1 .. m.
    - phrase / sentence / paragraph: l = round(l_min + p (l_max - l_min)), p ~ Beta(span_alpha, span_beta) (eq. 1);
      start ~ U(1, n_tokens - 1 - l) (eq. 2, the paper's n being m + 1); the span [start, start + l) (eq. 3).
    - word: one whole word (its first piece and its "##" pieces), uniform over the words that are not stopwords
      (stopword_mask[i] for the word starting at token i), with replacement (our choice: the paper does not say).
    word_starts (n_tokens,) bool: True where a word begins; rng: a numpy Generator. DataError if m = 0."""
    # Departure (costa-short-text): the paper's lengths assume a text longer than l; l is clipped to m here.
    # A window cut inside a word starts with "##" pieces: not a whole word, skipped unless it has no word start.
    body = n_tokens - 2                                                          # m
    if body < 1:
        raise data.DataError("span sampling needs a window with a token between [CLS] and [SEP]")
    T, spans = config.span_T, []
    for name in parse_granularities(config.granularities):
        if name == "word":
            words = word_spans(word_starts, n_tokens, stopword_mask)              # (n, 2)
            spans += map(tuple, words[rng.integers(len(words), size=T)].tolist())
            continue
        l_min, l_max = SPAN_LENGTHS[name]
        p = rng.beta(config.span_alpha, config.span_beta, size=T)              # eq. 1
        lengths = np.minimum(np.rint(l_min + p * (l_max - l_min)).astype(int), body)
        starts = rng.integers(1, n_tokens - lengths)                             # eq. 2: 1 .. n_tokens-1-l
        spans += zip(starts.tolist(), (starts + lengths).tolist())               # eq. 3
    return spans


class Batches(torch.utils.data.Dataset):
    """Item m is this rank's batch at micro-step m: a pure function of (seed, rank, m), so data-loader
    workers can build batches ahead on the CPU and a resumed run sees exactly the same batches.
    With gwc_weight > 0 a batch also holds "spans" (B, S, 2): COSTA's sampled spans of each window,
    as Algorithm 1 samples them: once per window before training, reused in every epoch (here a pure
    function of (seed, window), the same thing without holding them all); --span_resample draws fresh
    spans at every step instead."""

    def __init__(self, c, windows, rank, world):
        self.c, self.windows, self.rank, self.world = c, windows, rank, world
        tokenizer = data.load_tokenizer(c.vocab)
        self.special = data.special_ids(tokenizer)                 # {"cls": 101, "sep": 102, "mask": 103, ...}
        self.vocab_tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]  # to find stopwords
        self.word_tables = data.word_tables(self.vocab_tokens)

    def __len__(self):
        return self.c.steps * self.c.grad_accum

    def __getitem__(self, micro_step):
        c = self.c
        rows = data.batch_indices(len(self.windows), c.batch_size, self.rank, self.world, c.seed, micro_step)
        generator = data.batch_generator(c.seed, self.rank, micro_step)
        windows = [self.windows[i] for i in rows]
        ids, attention_mask = data.pad_batch([w.input_ids for w in windows])   # (B, L)
        maskable = attention_mask.bool() & (ids != self.special["cls"]) & (ids != self.special["sep"])
        masked, labels = data.mask_tokens(ids, maskable, c.vocab_size, self.special["mask"],
                                          generator, c.mask_prob)
        batch = {"input_ids": masked, "attention_mask": attention_mask, "labels": labels}
        if c.gwc_weight:  # spans on the unmasked windows' words; the model sees the masked text
            step_rng = np.random.default_rng(data.step_seed(c.seed, self.rank, micro_step, "spans"))
            rng = lambda i: step_rng if c.span_resample else np.random.default_rng([c.seed, i])  # per window
            spans = []
            for i, w in zip(rows, windows):   # word spans skip stopwords and punctuation (data.py: costa-word-punct)
                tokens, starts = np.asarray(w.input_ids), np.asarray(w.word_starts, dtype=bool)
                spans.append(sample_spans(starts, len(tokens), c, rng(i),
                                          data.skip_word_mask(tokens, starts, self.vocab_tokens, self.word_tables)))
            batch["spans"] = torch.from_numpy(np.array(spans, dtype=np.int64))   # (B, S, 2)
        return batch


# ==============================================================================================
# Training loop
# ==============================================================================================
def train(c):
    """Pre-train with COSTA. Every check comes first (flags when parsed; here the run folder, --init, the
    vocabulary, the batch arithmetic, the corpus), then the steps. Run machinery: one call each into run/."""
    rank, world, device = setup_distributed(c.dist_timeout)      # torchrun: one process per device
    torch.manual_seed(c.seed)                                    # the encoder's and the heads' init
    c = run.start_run(c, world)                                  # --init found, run folder free, batch split
    encoder = run.init_encoder(Encoder, c)                       # random, or the --init checkpoint
    c = run.resolve_vocab(encoder.config)                        # --init brings its sizes and vocabulary
    windows = run.load_windows(c, rank)                          # the token cache, built once by rank 0
    c = run.resolve_schedule(c, world, len(windows))             # --epochs -> steps
    model = PretrainModel(c, encoder, data.most_frequent_token(windows), world).to(device)
    # The method's pieces as training runs them, a wrapper a line: eq. 5-8 in fp32 (under bf16 autocast a matmul runs
    # in bf16, even on fp32 inputs), and eq. 8 against every rank's texts and spans (its negatives; n_anchors).
    model.span_vectors = run.in_fp32(span_vectors)
    model.gwc_loss = run.across_ranks(run.in_fp32(gwc_loss), gather_across_ranks)
    if model.projector:
        model.projector.forward = run.in_fp32(model.projector.forward)
    model.encoder.forward = run.speed.compiled_encoder(model.encoder, c)   # --compile: its elementwise work fused
    optimizer, scheduler = run.make_optimizer(model, c, eps=1e-8)    # Adam's eps: torch's (the paper gives none)
    training = run.TrainingRun(c, model, optimizer, scheduler, device, windows)  # resume, run folder, log
    # Each rank trains on its own slice of every global batch (data.batch_indices); DDP averages the
    # gradients over the ranks, and eq. 8 sees every rank's texts (gather_across_ranks).
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
