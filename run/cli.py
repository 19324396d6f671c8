"""The command line and the end of a script, beneath run/__init__.py: a Config from '--field value' flags, each
checked against its rule before any work; Ctrl-C and SIGTERM as one line with the step (exit 130, 143); every
expected failure (bad flag, bad file, OS error, a rank that stops answering) as one line, no traceback."""
import contextlib
import dataclasses
import errno
import functools
import gc
import inspect
import math
import os
import re
import signal
import sys
import time

import torch

import run
from run import ranks

# ----------------------------------------------------------------------------------------------
# Command line: a script's Config from its flags, each checked before any work
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
    refuse_plain_srun()
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
    if issubclass(Config, run.TrainConfig):                # the shared pre-training flags' rules, then the method's
        rules = {**run.TRAIN_RULES, **(rules or {})}
    for name, rule in (rules or {}).items():
        if not satisfies(getattr(c, name), rule):
            exit_with(f"error: --{name} must be {rule}, got {getattr(c, name)!r}", 1)
    say_mps_is_not_used()
    return c


def refuse_plain_srun():
    """`srun python costa.py` starts one copy of the script per Slurm task, each without torchrun's RANK and
    WORLD_SIZE: as many independent runs, each with its own model, into one --out_dir. Refused in one line, from task
    0 (every task exits 1), naming the launch that works: one torchrun per node (docs/paper-scale.md). Counted from
    SLURM_STEP_NUM_TASKS, which srun sets for its tasks; not SLURM_NTASKS, which a batch script's own single process
    also holds."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)
    if tasks <= 1 or "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    if os.environ.get("SLURM_PROCID", "0") != "0":
        sys.exit(1)
    script = os.path.basename(sys.argv[0]) or "the script"
    exit_with(f"error: srun started {script} as {tasks} tasks (SLURM_STEP_NUM_TASKS), each an independent run without "
              f"torchrun's RANK and WORLD_SIZE; launch one torchrun per node instead: srun --ntasks-per-node=1 bash -c "
              f"'torchrun --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID --nproc_per_node=GPUS --master_addr=FIRST_HOST "
              f"--master_port=29500 {script} ...' (docs/paper-scale.md, Several nodes)", 1)


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
# Signals: Ctrl-C and SIGTERM
# ----------------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):   # Ctrl-C or SIGTERM in training, with the line saying where it stopped
    code = 130


class Terminated(Interrupted):          # SIGTERM, what a cluster scheduler sends before it kills a job
    code = 143


class RankTimeout(RuntimeError):        # under torchrun, a collective that another rank never joined
    pass


def timed_out(error):
    """Whether a collective's RuntimeError is gloo's process-group timeout (NCCL's watchdog ends the process)."""
    return ranks._distributed() and bool(re.search(r"timed out|timeout", str(error), re.IGNORECASE))


def rank_timeout_line(error):
    """'rank 1 of 2: no answer from rank 0 within the process-group timeout (600 s, --dist_timeout; ...)'."""
    rank, world = ranks._rank(), torch.distributed.get_world_size()
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
# The end of a script: one line for every expected failure
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
        _release_lock_files()
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
    if ranks._distributed():
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
    if not ranks._distributed():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    _release_lock_files()
    os._exit(code)


def _release_lock_files():
    """Before os._exit, which runs no atexit: the run folders' lock files go (run.folders.release_lock_files)."""
    from run import folders  # (here: run/folders.py imports this module)
    folders.release_lock_files()
