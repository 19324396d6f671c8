"""The run: what a method's train() calls around its method, in train()'s order. Beneath it (a student never
needs to open them): run/folders.py (run folder, resume, checkpoints, a clean stop), run/files.py (checksums,
atomic writes), run/hub.py (Hugging Face folders, --init), run/cache.py (the token cache), run/passages.py
(fine-tuning's corpus in it), run/speed.py (--compile's wrappers), run/cli.py (flags, signals, exit lines),
run/ranks.py (torchrun's ranks). It imports data.py, never a method file.

  TrainConfig, PAPER_RUN, LAB_PRESET  the flags every method shares, and what --preset paper / lab add to them
  start_run          before any work: --init found, the run folder free and locked, the batch split
  init_encoder       the encoder: BERT's random init, or the --init checkpoint
  resolve_vocab      the vocabulary (--vocab, else --init's, else BERT's), checked against the model
  load_windows       the corpus' windows (data.Window: token ids, word_starts), mapped from its token cache
  resolve_schedule   --epochs -> steps; the batch split checked again
  in_fp32            a loss or module with autocast off, in fp32: train() wraps the method's vector-sized terms
  across_ranks       a contrastive loss over every rank's vectors (its negatives): train() wraps it under torchrun
  make_optimizer     the papers' Adam with warm-up; new heads alone first under --head_warmup (the encoder frozen)
  TrainingRun        resume, run folder, log, checkpoints, --halt_at, a clean stop; the loop calls its methods
  batches            the method's batches (a torch Dataset) from the resumed step on, built ahead by --workers
  autocast_bf16      bf16 autocast where the device computes bf16 natively
  Progress           the progress line (losses, lr, tokens/s, ETA) and log.jsonl; each accuracy against its chance
  main               a method file's command line: its Config from the flags, then train(c), failures in one line
"""
import contextlib
import dataclasses
import functools
import json
import signal
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch

import data
from run import cache, cli, files, folders, hub, passages, ranks, speed  # noqa: F401 (run.speed, ... for callers)
from run.cache import rank0_builds  # noqa: F401  (CPDAE's IDF: built once by rank 0, beneath)
from run.files import atomic_save_npy, load_tensors, save_tensors  # noqa: F401  (CPDAE's decoder file, beneath)

# The methods, each a file <name>.py with a Config, a train() and a main(): finetune.py --pretrain, research's
# study and benchmark, and the tests read this list, so a new method is its file plus one entry here.
METHODS = ("seed", "cpdae", "costa")


# ----------------------------------------------------------------------------------------------
# 1. The flags (TrainConfig), then what train() calls before its loop, in that order
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainConfig:
    # --- data
    corpus: str = str(data.WIKI)       # pre-training corpus: .txt / .jsonl file or folder ('.gz' ok; WikiExtractor's)
    vocab: str = str(data.VOCAB)       # WordPiece vocab.txt (BERT uncased, 30,522 entries)
    max_len: int = 128            # tokens per window incl. [CLS] and [SEP] (the papers: 512)
    # --- model (CPU default is small; --preset paper gives BERT-base)
    vocab_size: int = 30522       # rows of the token embedding; must match the vocab file
    hidden_size: int = 256        # H (BERT-base: 768)
    num_layers: int = 4           # Transformer blocks (BERT-base: 12)
    num_heads: int = 4            # attention heads (BERT-base: 12)
    ffn_size: int = 1024          # feed-forward inner size (BERT-base: 3072)
    max_position: int = 512       # learned absolute positions
    type_vocab_size: int = 2      # token types (all 0 here; kept for BERT checkpoint compatibility)
    dropout: float = 0.1          # hidden and attention dropout
    layer_norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    init: str = ""                # start from: a BERT folder, a hub id, or "minilm" (offline package); "" = random
    bottleneck: str = "cls"       # the text vector trained: "cls" (the papers') or "mean" (masked mean, MiniLM's pooling)
    # --- optimisation (each method's PAPER_PRESET comment gives its paper's values)
    steps: int = 300              # optimizer steps
    epochs: float = 0.0           # > 0: passes over the windows; sets steps from windows and global batch
    batch_size: int = 32          # texts per rank per micro-step
    global_batch: int = 0         # > 0: texts per optimizer step on all ranks; sets batch_size
    grad_accum: int = 1           # micro-steps per optimizer step (adds no negatives to a contrastive loss)
    lr: float = 5e-4              # peak learning rate
    weight_decay: float = 0.01    # AdamW weight decay (not on biases and LayerNorm)
    warmup: float = 0.1           # fraction of steps of linear warm-up, then linear decay to 0
    clip: float = 1.0             # max gradient norm
    head_warmup: int = 0          # first steps (of --steps) train only the heads new to the checkpoint, encoder frozen
    head_lr: float = 1.0          # lr multiplier of those new heads (1 = one lr for all, the papers')
    mask_prob: float = 0.15       # MLM: fraction of tokens chosen
    seed: int = 0                 # model init, data order and masks
    bf16: bool = True             # bf16 autocast on GPU and on CPUs with native bf16 (AVX512-BF16, AMX)
    compile: bool = False         # torch.compile the encoder and the method's vocabulary-sized loss (run.speed)
    workers: int = 0              # data-loader worker processes building batches
    cache_dir: str = ""           # token cache folder ("" = next to the corpus; see token_windows)
    prep_workers: int = 0         # processes tokenizing the corpus into the cache, first run only (0 = all cores)
    bad_bytes: str = "stop"       # a corpus line that is not UTF-8: "stop" the run, or "skip" it (counted in one line)
    dist_timeout: float = 600.0   # torchrun: seconds a rank waits for the others at a collective before the job ends
    # --- bookkeeping
    out_dir: str = "runs/run"     # checkpoints, config.json and log.jsonl go here (each method sets its own)
    log_every: int = 10           # steps between progress lines
    save_every: int = 100         # steps between checkpoints (and one at the end)
    save_minutes: float = 0.0     # > 0: a checkpoint too when this many minutes passed since the last (on log steps)
    keep_last: int = 1            # checkpoints kept: the last (out_dir/state.pt, encoder/); N > 1 keeps N-1 older ones in out_dir/checkpoints/
    resume: bool = False          # continue from out_dir/state.pt
    new_corpus: bool = False      # --resume on a corpus that changed since the run's checkpoint (else refused)
    overwrite: bool = False       # replace a run already in out_dir (without it or --resume: refused)
    halt_at: int = 0              # stop after this step as if killed (0 = never); to test --resume
    preset: str = ""              # "lab": a run that learns in minutes on a CPU; "paper": BERT-base, the paper's settings

    # The fields that may change on --resume (from the next step): how and where, not what; every other
    # field is frozen, a new one too until its Config lists it. (out_dir: a moved run resumes where it is.)
    RESUMABLE: ClassVar[tuple] = ("steps", "epochs", "lr", "weight_decay", "warmup", "clip", "bf16", "compile", "workers",
                                  "log_every", "save_every", "preset", "cache_dir", "prep_workers", "out_dir", "new_corpus",
                                  "save_minutes", "keep_last", "bad_bytes", "dist_timeout")


# What every method's --preset paper adds for a multi-GPU run (docs/paper-scale.md): 4 loader processes per GPU;
# a log line and a host sync every 100 steps; a checkpoint every 30 minutes or 20,000 steps, the 2 before it kept;
# the encoder and the vocabulary-sized losses compiled (--compile: on one H200 the losses alone made CPDAE's step
# 1.11x, SEED's 1.31x as fast, results/gpu).
PAPER_RUN = dict(workers=4, log_every=100, save_every=20_000, save_minutes=30.0, keep_last=3, compile=True)


# --preset lab (each method adds its own head's flags): heads that learn on a 2-core CPU in minutes: MiniLM on
# SciFact's corpus, 50 steps of 32 x 128 tokens, the mean vector, the new heads alone for the first 20 steps at 20x
# the lr (results/figures/make.sh's settings, and README command 1's pre-training).
LAB_PRESET = dict(init="minilm", corpus=str(data.SCIFACT / "corpus.jsonl.gz"), lr=5e-5, steps=50, bottleneck="mean",
                  head_warmup=20, head_lr=20.0)


# The domain of each shared flag, checked by parse_config before any work (a method adds its own).
TRAIN_RULES = {
    "max_len": ">= 10",  # 8 tokens between [CLS] and [SEP]: shorter windows are dropped (make_windows)
    "vocab_size": ">= 1", "hidden_size": ">= 1", "num_layers": ">= 1", "num_heads": ">= 1", "ffn_size": ">= 1",
    "max_position": ">= 1", "type_vocab_size": ">= 1", "dropout": "in [0, 1)", "layer_norm_eps": "> 0", "steps": ">= 1",
    "epochs": ">= 0", "batch_size": ">= 1", "global_batch": ">= 0", "grad_accum": ">= 1", "lr": "> 0", "clip": "> 0",
    "weight_decay": ">= 0", "warmup": "in [0, 1]", "mask_prob": "in [0, 1]", "workers": ">= 0", "log_every": ">= 1",
    "save_every": ">= 1", "save_minutes": ">= 0", "keep_last": ">= 1", "halt_at": ">= 0", "prep_workers": ">= 0",
    "head_warmup": ">= 0", "head_lr": "> 0", "bottleneck": "one of {cls, mean}", "bad_bytes": "one of {stop, skip}",
    "dist_timeout": "> 0"}


def start_run(c, world):
    """The checks that need no model, before any work: --init resolved to a folder, the run folder (free,
    no run in it unless --resume or --overwrite), the batch arithmetic. Returns c with both resolved."""
    c = dataclasses.replace(c, init=hub.resolve_model(c.init))
    folders.check_run_folder(c)                      # a run folder is never overwritten silently
    folders.lock_run_folder(c.out_dir)               # ... nor shared by two runs at once (if it exists yet)
    return resolve_batch(c, world)           # before the token cache


def resolve_batch(c, world):
    """Before the token cache: --global_batch must split evenly over ranks and micro-steps, and an explicit
    --batch_size (not Config's default) must agree with it. Returns a new Config with batch_size set."""
    if c.global_batch <= 0:
        return c
    batch_size, rest = divmod(c.global_batch, world * c.grad_accum)
    if rest or batch_size == 0:
        raise ValueError(f"--global_batch {c.global_batch} is not a multiple of {world} process(es) x "
                         f"--grad_accum {c.grad_accum}")
    default = next(f.default for f in dataclasses.fields(c) if f.name == "batch_size")
    if c.batch_size not in (default, batch_size):
        raise ValueError(f"--batch_size {c.batch_size} disagrees with --global_batch {c.global_batch} on {world} "
                         f"process(es) x --grad_accum {c.grad_accum} (= {batch_size} per rank); give one of them")
    return dataclasses.replace(c, batch_size=batch_size)


def init_encoder(Encoder, c):
    """The run's encoder: BERT's random init, or the --init checkpoint (its sizes replace c's; no MLM head: said)."""
    if not c.init:
        return Encoder(c)
    encoder = hub.load_pretrained(Encoder, c.init, c)
    if ranks._rank() == 0 and encoder.new_mlm_head:
        print(f"{c.init}: {encoder.new_head_line}")    # the whole head, or the tensors of it the checkpoint lacks
    return encoder


def resolve_vocab(c):
    """Before any work: the run's vocabulary (run_vocab) must match the model's embeddings, --max_len its positions."""
    c = dataclasses.replace(c, vocab=run_vocab(c))
    n = data.vocab_size_of(c.vocab) if Path(c.vocab).is_file() else c.vocab_size  # (missing: load_tokenizer says)
    model = f"the --init model {c.init}" if c.init else "the model"
    if n != c.vocab_size:
        raise data.DataError(f"{c.vocab}: {n} entries, but {model} has vocab_size {c.vocab_size}")
    hub.check_vocab(c.vocab, c.init)         # each token once, and the one the --init folder records
    if c.max_len > c.max_position:
        raise ValueError(f"--max_len {c.max_len} is more than the {c.max_position} positions of {model} (max_position)")
    return c


def run_vocab(c):
    """The vocabulary a run tokenizes with: --vocab when given, else the --init folder's vocab.txt, else BERT's."""
    own = Path(c.init) / "vocab.txt" if c.init else None
    return str(own) if c.vocab == str(data.VOCAB) and own and own.is_file() else c.vocab


def load_windows(c, rank):
    """The corpus' windows, mapped from its token cache (built by rank 0 on the first run)."""
    t0 = time.time()
    windows = cache.token_windows(c.corpus, c.vocab, c.max_len, rank, c.cache_dir, c.prep_workers, rank == 0,
                                 c.bad_bytes)
    if rank == 0:
        print(f"data: {c.corpus}: {len(windows):,} windows, {windows.n_tokens:,} tokens, mapped from "
              f"{windows.folder} ({time.time() - t0:.1f}s)")
    return windows


def resolve_schedule(c, world, n_windows):
    """Pre-training's batch and length from the global flags: --global_batch > 0 sets batch_size (resolve_batch),
    --epochs > 0 sets steps = epochs x windows / global batch (rounded, >= 1; batches_per_epoch). A new Config."""
    c = resolve_batch(c, world)
    per_epoch = data.batches_per_epoch(n_windows, c.batch_size, world)   # always: fewer than one batch fails here
    steps = max(1, round(c.epochs * per_epoch / c.grad_accum)) if c.epochs > 0 else c.steps
    return dataclasses.replace(c, steps=steps)


def make_optimizer(model, c, eps=1e-8):
    """AdamW (eps: Adam's epsilon) without weight decay on biases and LayerNorm; linear warm-up, then linear decay
    to 0. Departure (optimizer-decay): COSTA and CPDAE say only "Adam with warm-up"; weight decay and linear decay
    are BERT's and SEED's recipe, kept for every method. Heads new to the checkpoint (model.new_parameters()) learn
    alone for the first --head_warmup steps at --head_lr times the lr (Kumar et al., ICLR 2022): the encoder's
    groups get lr factor 0 (frozen, yet in the optimizer), then their own warm-up and decay."""
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
    on_gpu = next(model.parameters()).is_cuda
    if on_gpu:   # fp32 matmuls (outside bf16 autocast) in TF32, as cuBLAS allows on Ampere and later
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # fused=True on a GPU: one kernel for every parameter's update (AdamW.step was ~18 % of the step's CUDA time)
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=c.lr, eps=eps, fused=True if on_gpu else None)

    def schedule(step, start=0, factor=1.0):          # warm-up, then decay to 0 at c.steps, from `start`
        steps, step = c.steps - start, step - start
        warmup = max(1, int(c.warmup * steps))
        return 0.0 if step < 0 else factor * min((step + 1) / warmup, max(0.0, (steps - step) / max(1, steps - warmup)))
    lambdas = [(lambda step: schedule(step, factor=head_lr)) if group["head"] else
               (lambda step: schedule(step, start=head_warmup)) for group in optimizer.param_groups]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def encoder_and_head_lr(optimizer, scheduler):
    """(the encoder's lr, 0 while the heads warm up alone; the new heads' lr where it differs, else None)."""
    lrs = scheduler.get_last_lr()                                   # group 0 is the encoder's
    heads = [lr for lr, group in zip(lrs, optimizer.param_groups) if group["head"] and lr != lrs[0]]
    return lrs[0], (heads[0] if heads else None)


# ----------------------------------------------------------------------------------------------
# 2. A training run: the loop's bookkeeping in one object, then the forward's precision
# ----------------------------------------------------------------------------------------------
class TrainingRun:
    """What a pre-training loop does around its steps: --resume, the run folder made ready (only now does --overwrite
    delete), config.json, progress and log, checkpoints, --halt_at, a clean stop on Ctrl-C or SIGTERM."""

    def __init__(self, c, model, optimizer, scheduler, device, windows, extra_files=None):
        self.c, self.model, self.optimizer, self.scheduler, self.device = c, model, optimizer, scheduler, device
        self.rank, self.world = (ranks._rank(), torch.distributed.get_world_size()) if ranks._distributed() else (0, 1)
        self.is_rank0, self.extra_files, n_windows = self.rank == 0, extra_files, len(windows)
        self.stream = {"processes": self.world, "corpus": getattr(windows, "identity", None)}   # check_stream
        self.start_step = folders.load_checkpoint(c, model, optimizer, scheduler, self.is_rank0, self.stream) if c.resume else 0
        self.saved = self.step = self.start_step
        self.saved_at, self.unchecked = time.time(), []    # (step, gradient norm) not yet checked on a GPU
        folders.lock_run_folder(c.out_dir, create=True)         # a new folder is locked as it is made
        if self.is_rank0:
            folders.prepare_run_folder(c)                       # after the last check: --overwrite deletes only now
            folders.write_config(c.out_dir, c)
            n_params = sum(p.numel() for p in model.parameters())
            left_out = n_windows % (c.batch_size * self.world)
            print(f"model: {n_params / 1e6:.1f}M parameters | {self.world} process(es) on {device.type} | "
                  f"global batch {c.batch_size * self.world * c.grad_accum} | {left_out} windows sit out each epoch")
        self.progress = Progress(c, self.start_step, self.is_rank0)

    def waits_on_device(self, step):
        """Whether this step may sync with the GPU: on the CPU always; on a GPU at log, checkpoint and last steps."""
        c = self.c
        return (self.device.type != "cuda" or step % c.log_every == 0 or step % c.save_every == 0
                or step in (c.steps, c.halt_at))

    def stop_if_not_finite(self, grad_norm, step):
        """run.stop_if_not_finite, on a GPU at the next step that syncs anyway; every checkpoint comes after it."""
        self.step = step
        self.unchecked.append((step, grad_norm))
        if self.waits_on_device(step):
            steps, norms = zip(*self.unchecked)
            self.unchecked, bad = [], (~torch.isfinite(torch.stack(norms))).nonzero().flatten().tolist()
            if bad:
                folders.stop_if_not_finite(norms[bad[0]], steps[bad[0]], self.c, self.saved)

    def end_of_step(self, step):
        """After the optimizer step: log, checkpoint; True to stop (--halt_at; SIGTERM waits for a syncing step)."""
        c, self.step = self.c, step
        logs = step % c.log_every == 0 or step == c.steps
        if logs:
            lr, head_lr = encoder_and_head_lr(self.optimizer, self.scheduler)
            self.progress.report(step, lr, self.device, head_lr)
        if not self.waits_on_device(step):
            return False
        late = c.save_minutes and logs and time.time() - self.saved_at >= c.save_minutes * 60
        due = step % c.save_every == 0 or step == c.steps or step == c.halt_at or (
            c.save_minutes and logs and folders._all_ranks_agree(late, self.device))   # the ranks' clocks differ

        def save():
            if self.is_rank0 and c.keep_last > 1 and self.saved:
                folders.keep_previous_checkpoint(Path(c.out_dir), self.saved, c.keep_last)
            folders.save_checkpoint(c, self.model, self.optimizer, self.scheduler, step, self.is_rank0, self.saved,
                            self.extra_files, self.stream)
            self.saved, self.saved_at = step, time.time()
        folders.checkpoint_or_stop(step, self.saved, due, c.save_every, save, self.device)
        return step == c.halt_at

    @contextlib.contextmanager
    def stops_cleanly(self):
        """Around the loop: Ctrl-C or SIGTERM becomes one line with the step and the last checkpoint."""
        try:
            with folders.stops_cleanly(lambda: (self.step, self.saved, self.c.out_dir)):
                yield
        finally:
            folders.release_run_folder(self.c.out_dir)

    def finish(self):
        if self.is_rank0:
            print(f"done: {self.progress.summary(self.device)}; encoder in {Path(self.c.out_dir) / 'encoder'}")
        ranks.barrier()   # every rank is past its last collective (the group ends in leave_distributed)


def batches(dataset, workers, micro_steps):
    """dataset[i] for each micro-step i of the range, built ahead by `workers` processes (dropout's RNG untouched)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, sampler=micro_steps,
                                         generator=torch.Generator(), worker_init_fn=_leave_sigterm_to_the_run,
                                         pin_memory=torch.cuda.is_available())   # page-locked: copied to the GPU async
    return iter(loader)


def _leave_sigterm_to_the_run(worker_id):
    """In each data-loader worker: a SIGTERM to the whole process group (Slurm, systemd) is the run's to act on
    (end the step, checkpoint, shut the workers down); a second one (the loader's terminate()) ends the worker."""
    signal.signal(signal.SIGTERM, lambda *_: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def autocast_bf16(device, enabled=True):
    """bf16 autocast on GPUs and on CPUs with native bf16 (AVX512-BF16, AMX: ~2x fp32); off where it is emulated."""
    cpu_bf16 = [getattr(torch.cpu, f"_is_{x}_supported", lambda: False)() for x in ("avx512_bf16", "amx_tile")]
    native = device.type == "cuda" or (device.type == "cpu" and any(cpu_bf16))
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled and native)


def across_ranks(loss, gather):
    """loss(a, b, *args) over every rank's a and b (gather: all-gather with gradients), this rank's n first as the
    anchors (n_anchors=n; the sums are over sets); in one process the loss itself. Keeps loss's name and docstring."""
    @functools.wraps(loss)
    def gathered(a, b, *args, **kwargs):                                  # a (n, ...), b (n, ...)
        n = a.shape[0]
        rank = torch.distributed.get_rank() if ranks._distributed() else 0
        a, b = (gather(t).roll(-rank * n, dims=0) for t in (a, b))        # (world * n, ...) each
        return loss(a, b, *args, n_anchors=n, **kwargs)
    return gathered


def in_fp32(f):
    """f with autocast off and its floating tensor arguments in fp32 at least (fp64 stays): the guard a method file
    puts around its losses from outside (under autocast a matmul runs in bf16 even on fp32 inputs)."""
    def fp32(*args, **kwargs):
        device = next(a.device.type for a in args if torch.is_tensor(a))
        up = lambda a: a.to(torch.promote_types(a.dtype, torch.float32)) if torch.is_tensor(a) and a.is_floating_point() else a
        with torch.autocast(device, enabled=False):
            return f(*map(up, args), **kwargs)
    fp32.__doc__, fp32.__wrapped__ = f.__doc__, f
    return fp32


# ----------------------------------------------------------------------------------------------
# 3. Progress lines and the training log
# ----------------------------------------------------------------------------------------------
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

    def report(self, step, lr, device, head_lr=None):
        """At log steps, on every rank (the mean is a collective); rank 0 prints. head_lr: the heads' if it differs."""
        means = ranks.average_across_ranks({k: float(v) / self.count for k, v in self.sums.items()}, device)
        now = time.time()
        world = torch.distributed.get_world_size() if ranks._distributed() else 1
        tok_per_s = self.tokens * world / (now - self.t_last)
        self.tokens_total += self.tokens * world
        eta = (now - self.t0) / (step - self.start_step) * (self.c.steps - step)
        if self.is_rank0:
            parts = " | ".join(f"{k} {v:.4f}" for k, v in means.items())
            heads = "" if head_lr is None else f" | heads' lr {head_lr:.2e}"
            encoder = "encoder frozen (--head_warmup)" if lr == 0 and head_lr else f"lr {lr:.2e}"
            print(f"step {step:>6}/{self.c.steps} | {parts} | {encoder}{heads} | {tok_per_s:,.0f} tok/s | "
                  f"elapsed {files.format_seconds(now - self.t0)} | eta {files.format_seconds(eta)}", flush=True)
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **means, "lr": lr, **({} if head_lr is None else {"head_lr": head_lr}),
                                    "tokens_per_s": tok_per_s, "elapsed_s": now - self.t0}) + "\n")
            for line in chance_lines(means) if step == self.c.steps else []:  # at the end: each objective
                print(line, flush=True)                                          # against its trivial baseline
        self.sums, self.count, self.tokens, self.t_last = {}, 0, 0, now

    def summary(self, device):
        elapsed = time.time() - self.t0
        return (f"{self.tokens_total / max(elapsed, 1e-9):,.0f} tokens/s over {files.format_seconds(elapsed)}, "
                f"peak memory {ranks.peak_memory_mb(device):,.0f} MiB ({device.type})")


def keep_log_until(path, step):
    """Drop the log lines after `step` (a resumed or replaced run's) and a line cut by a kill: each step once."""
    def logged(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            return False
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        files.atomic_write_text(path, "".join(line + "\n" for line in lines if logged(line)))


def chance_lines(means):
    """'X: accuracy a, chance b, ratio a/b' for every logged accuracy X_acc that has its baseline X_chance
    (the accuracy of a trivial guess: the most frequent token, or a random candidate); a chance of 0 has no ratio."""
    def ratio(accuracy, chance):
        return f"{accuracy / chance:.2f}" if chance > 0 else "n/a"
    return [f"{k[:-4]}: accuracy {v:.4f}, chance {means[k[:-4] + '_chance']:.4f}, "
            f"ratio {ratio(v, means[k[:-4] + '_chance'])}" for k, v in means.items()
            if k.endswith("_acc") and k[:-4] + "_chance" in means]


def main(train, Config, doc, paper_preset, rules, presets):
    """A method file's command line: its Config from sys.argv (each flag checked against its rule before any work;
    --help prints doc and the fields), then train(c); a bad flag or file, Ctrl-C or SIGTERM end in one line."""
    cli.run_command_line(lambda: train(cli.parse_config(Config, sys.argv[1:], doc, paper_preset, rules, presets)))
