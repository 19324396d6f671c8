"""The run folder, beneath run/__init__.py (TrainingRun calls it): one run at a time in a folder (an exclusive
flock, or a lock file where the file system has no flock), never overwritten without --overwrite; --resume's checks
(the frozen flags, the process count, the corpus) and the training state; checkpoints switched whole (the encoder
and state.pt together), a full disk in one line; a clean stop on Ctrl-C or SIGTERM, with the step and the last
checkpoint named."""
import atexit
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

import data
from run import cache, cli, files, hub, ranks


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
    terminate = _all_ranks_agree(bool(cli.STOP_SIGNALS["term"]), device)
    if due or (terminate and step - saved > save_every / 2):   # SIGTERM: save first if it is worth it
        with cli.hold_ctrl_c():   # a Ctrl-C now stops after the checkpoint, which the line then names
            save()
    if terminate:
        raise cli.Terminated
    if cli.STOP_SIGNALS["int"]:       # a Ctrl-C held during the save, or whose KeyboardInterrupt Python dropped
        raise KeyboardInterrupt


@contextlib.contextmanager
def stops_cleanly(where):
    """Around a training loop: Ctrl-C or SIGTERM becomes one line with the step and the last checkpoint.
    where() -> (step, step of the last checkpoint, the folder that holds it), read when the signal comes."""
    restore = cli.catch_stop_signals(defer_term=True)
    try:
        yield
    except (KeyboardInterrupt, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not cli.STOP_SIGNALS["term"] and not cli.timed_out(e):
            raise
        step, saved, folder = where()        # (a RuntimeError after SIGTERM: the next batch's worker had ended)
        last = f"last checkpoint at step {saved} in {folder}" if saved else f"no checkpoint yet in {folder}"
        if isinstance(e, RuntimeError) and not cli.STOP_SIGNALS["term"]:
            raise cli.RankTimeout(f"{cli.rank_timeout_line(e)} at step {step}; {last}; continue with --resume") from None
        kind = cli.Interrupted if isinstance(e, KeyboardInterrupt) and not isinstance(e, cli.Terminated) else cli.Terminated
        what = "terminated (SIGTERM)" if kind is cli.Terminated else "interrupted"
        raise kind(f"{what} at step {step}; {last}; continue with --resume") from None
    finally:
        restore()   # the caller's own handlers again (a test, a notebook, research/study.py)


def _all_ranks_agree(flag, device):
    """True on all ranks if any saw it (a tiny all-reduce under torchrun): they stop together, collectives matched."""
    return ranks.average_across_ranks({"flag": float(flag)}, device)["flag"] > 0


def stop_if_not_finite(grad_norm, step, c, last_saved=0):
    """A NaN or infinite loss makes the gradient norm so on every rank alike (DDP sums the gradients): all
    stop together before the optimizer step, and no checkpoint holds such weights (one sync per step)."""
    if not torch.isfinite(grad_norm):
        kept = (f"{c.out_dir} keeps its last good checkpoint, step {last_saved}" if last_saved else
                "no checkpoint was written")
        raise data.DataError(f"step {step}: the loss is not finite (gradient norm {float(grad_norm)}); stopped "
                             f"without saving; {kept}")


# ----------------------------------------------------------------------------------------------
# Resume: a run continues exactly from its last checkpoint
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
    check_resumable(c.out_dir)
    if not os.path.lexists(path):             # not there in any form: only then is it a run not begun
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
        what = cache.what_changed(old["signature"], new["signature"]) if old["signature"] != new["signature"] else \
            "other tokens"
        raise data.DataError(f"{c.corpus}: the corpus changed since the run's checkpoint of step {step} ({what}; "
                             f"{old['n_windows']:,} -> {new['n_windows']:,} windows); resume on the corpus the run "
                             f"started with, or pass --new_corpus to continue on this one")
    return f"--new_corpus: the corpus changed since step {step}; the data differ from step {step + 1}"


def save_training_state(path, state):
    """What resuming needs, in one file (atomic); no RNG state: batches, masks, dropout are functions of the step."""
    files.atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_training_state(path):
    """The dict save_training_state wrote; one line (a DataError) for a missing, empty, truncated, damaged (its
    checksum) or foreign file, or one whose weights or optimizer state are not finite."""
    if not Path(path).is_file():
        raise data.DataError(f"{path}: no training state to resume from")
    files.check_checksum(path, "resume from a copy of the run")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- EOFError, RuntimeError, UnpicklingError, ...
        raise data.DataError(f"{path}: not a readable training state ({type(e).__name__}); the file is "
                             f"truncated or not a state.pt; start again with --overwrite") from None
    if not isinstance(state, dict) or not {"step", "model", "optimizer", "scheduler", "config"} <= set(state):
        raise data.DataError(f"{path}: not a training state written by these scripts")
    files.check_finite({"model": state["model"], "optimizer": state["optimizer"]}, path, "the checkpoint is damaged; "
                 "resume from a copy of the run, or start again with --overwrite")
    return state


# ----------------------------------------------------------------------------------------------
# Run folders: one run at a time, never overwritten silently
# ----------------------------------------------------------------------------------------------
RUN_FILES = ("state.pt", "log.jsonl", "encoder")     # these show that a folder holds a pre-training run
_LOCKS = {}              # folder -> the open folder this process holds flocked, or the Path of its lock file
LOCK_FILE = ".run.lock"  # the lock where the file system has no flock (_take_lock_file)
_LOCK_FILES_SAID = []    # the first lock file this process took (its one line says why)


def script_of(c):
    """The script whose Config c is ("costa.py"): a run folder's config.json names it."""
    return Path(sys.modules[type(c).__module__].__file__).name


def write_config(folder, c):
    """config.json: the script that writes the run, then its flags."""
    files.atomic_write_json(Path(folder) / "config.json", {"script": script_of(c), **dataclasses.asdict(c)})


def check_run_folder(c, names=RUN_FILES):
    """Before any work: a fresh run into a folder holding a run needs --overwrite (--resume continues it);
    neither may take a folder that holds another script's run (its config.json says whose)."""
    written = data.read_json(Path(c.out_dir) / "config.json") if (Path(c.out_dir) / "config.json").is_file() else {}
    owner = written.get("script") if isinstance(written, dict) else None
    if owner and owner != script_of(c):
        raise data.DataError(f"{c.out_dir} holds a run of {owner}, not of {script_of(c)}; give another --out_dir "
                             f"(or delete the folder to reuse its name)")
    held = [name for name in names if os.path.lexists(Path(c.out_dir) / name)]
    if c.resume and c.overwrite:
        raise ValueError("--resume continues the run in out_dir and --overwrite replaces it: give one")
    if c.resume:
        check_resumable(c.out_dir)
    if held and not (c.resume or c.overwrite):
        raise data.DataError(f"{c.out_dir} already holds a run ({', '.join(held)}); continue it with --resume "
                             f"or replace it with --overwrite")
    check_writable(c.out_dir)


def check_resumable(out_dir):
    """--resume, before any work: what a run resumes from is of its kind wherever it is there in any form (state.pt,
    its checksum, log.jsonl: readable files; encoder/: a folder). A link that leads nowhere, /dev/zero or a folder in
    state.pt's place is one line naming it, never taken for a run not begun (which would start over on top of it)."""
    for name in ("state.pt", files.checksum_file("state.pt").name, "log.jsonl", "encoder"):
        path = Path(out_dir) / name
        if why := files.entry_problem(path, folder=name == "encoder"):
            need = "a folder" if name == "encoder" else "a readable file"
            raise data.DataError(f"{path}: {why}, where --resume needs {need}; the run is left as it is: put the "
                                 f"{'folder' if name == 'encoder' else 'file'} back (mount its disk, or copy it from "
                                 f"a copy of the run), then --resume again")


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
    or the process ends; where the file system has no flock (NFS, Lustre), a lock file instead (_take_lock_file).
    Rank 0 takes it, every rank hears: a second run is refused in one line; create: mkdir."""
    import fcntl
    folder = Path(folder).resolve()
    error = ""
    if ranks._rank() == 0 and folder not in _LOCKS and (create or folder.is_dir()):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _LOCKS[folder] = fd
        except BlockingIOError:
            os.close(fd)
            error = f"{folder} is in use by another run; wait for it to end, or give another --out_dir"
        except OSError as e:      # no flock here: NFS (ENOLCK; EBADF, its flock wants a file open for writing),
            os.close(fd)          # Lustre mounted without flock (ENOSYS), FUSE (EOPNOTSUPP), ...
            error = _take_lock_file(folder, e)
    if ranks._distributed():
        shared = [error]
        torch.distributed.broadcast_object_list(shared, src=0)   # the other ranks wait on rank 0's check
        error = shared[0]
    if error:
        raise data.DataError(error)


def _take_lock_file(folder, no_flock):
    """The lock as a file, folder/.run.lock, created with O_EXCL (one creator wins, on a local disk, NFS v3+ and
    Lustre alike) and holding its run's host, pid and start; release_run_folder removes it. One left by a dead
    process of this host (kill -9) is taken over with one line; one of another host is refused, since this host
    cannot tell whether that run is alive. -> '' (held) or the line that refuses."""
    path = folder / LOCK_FILE
    if not _LOCK_FILES_SAID:
        _LOCK_FILES_SAID.append(path)
        print(f"{folder}: no flock on this file system ({no_flock.strerror}); the run holds the lock file {path} "
              f"instead, removed when it ends", flush=True)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _lock_holder(path)
            if not holder:
                return (f"{folder} is locked by {path}, which names no run (cut while written?); if no run uses "
                        f"the folder, delete {path} and start again, else give another --out_dir")
            who = f"pid {holder['pid']} on {holder['host']}, since {holder['started']}"
            if holder["host"] != socket.gethostname():
                return (f"{folder} is locked by {path} ({who}); this host cannot tell whether that run is alive: if "
                        f"it is not, delete {path} and start again, else give another --out_dir")
            if files._is_alive(holder["pid"]):
                return f"{folder} is in use by another run ({who}; {path}); wait for it to end, or give another --out_dir"
            stale = path.with_name(f"{path.name}.{os.getpid()}.stale")
            with contextlib.suppress(FileNotFoundError):   # (another run took it over first: try again)
                os.rename(path, stale)                     # of two runs taking it over, one moves it ...
                if _lock_holder(stale) != holder:          # ... and it is the dead run's, not one made meanwhile
                    os.rename(stale, path)
                    continue
                stale.unlink()
                print(f"{path}: left by pid {holder['pid']} on this host since {holder['started']}, which is no "
                      f"longer running; taking the run folder over", flush=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
        _LOCKS[folder] = path
        return ""
    return f"{folder} is in use by another run ({path}); wait for it to end, or give another --out_dir"


def _lock_holder(path):
    """A lock file's {'host', 'pid', 'started'}, or None when it cannot be read as one."""
    try:
        holder = json.loads(Path(path).read_text())
        return holder if isinstance(holder, dict) and {"host", "pid", "started"} <= set(holder) else None
    except (OSError, ValueError):
        return None


def release_run_folder(folder):
    held = _LOCKS.pop(Path(folder).resolve(), None)
    if isinstance(held, Path):
        held.unlink(missing_ok=True)    # the lock file
    elif held is not None:
        os.close(held)                  # closing it drops the flock


@atexit.register
def release_lock_files():
    """At the process's end, and before os._exit (run.cli): this process's lock files go (a flock goes with the
    process by itself); only a kill -9 or a crash leaves one, which the next run on this host takes over."""
    for folder, held in list(_LOCKS.items()):
        if isinstance(held, Path):
            release_run_folder(folder)


def held_by_another_run(folder):
    """Whether another process holds folder locked (lock_run_folder): its live lock file, or a shared flock
    refused (asked, then let go at once)."""
    import fcntl
    folder = Path(folder).resolve()
    if folder in _LOCKS or not folder.is_dir():
        return False
    if (folder / LOCK_FILE).exists():       # a lock file: held unless its run, of this host, is gone
        holder = _lock_holder(folder / LOCK_FILE)
        return not holder or holder["host"] != socket.gethostname() or files._is_alive(holder["pid"])
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:                 # no flock here, and no lock file: free
        return False
    finally:
        os.close(fd)                    # closing it drops the shared flock


def prepare_run_folder(c):
    """Rank 0, after the last check: killed writes' temporaries go, a cut checkpoint switch is finished, and with
    --overwrite the replaced run's checkpoint and log go."""
    out = Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files.remove_dead_temporaries(out, locked=True)
    finish_checkpoint_switch(out)           # a save cut short by a kill: complete it or drop it
    if c.overwrite:     # each entry goes whatever its form (a folder in state.pt's place, a file in encoder's)
        for name in ("state.pt", files.checksum_file("state.pt").name, "log.jsonl", "encoder", "checkpoints"):
            remove_entry(out / name)                                    # checkpoints: --keep_last's older ones


def remove_entry(path):
    """Remove a file, a link (never what it leads to) or a folder; nothing there is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# Checkpoints: the encoder and the training state switched together; a full disk in one line
# ----------------------------------------------------------------------------------------------
def save_checkpoint(c, model, optimizer, scheduler, step, is_rank0, last_saved=0, extra_files=None, stream=None):
    """Rank 0 writes the encoder (a Hugging Face folder, plus extra_files(folder)) and the training state, both to
    temporaries switched only when both are whole (finish_checkpoint_switch): a kill or a full disk (one line) leaves
    the last checkpoint whole. Weights that are not finite are never saved: every rank stops alike."""
    kept = f"{c.out_dir} keeps its last good checkpoint, step {last_saved}" if last_saved else "no checkpoint was written"
    files.check_finite(model.state_dict(), f"step {step}", f"stopped without saving; {kept}")
    if is_rank0:
        out = Path(c.out_dir)
        new_encoder, new_state = out / ".encoder.new", out / ".state.pt.new"
        target = out / "encoder"
        out.mkdir(parents=True, exist_ok=True)
        try:
            new_state.write_bytes(b"")              # while it exists, the switch has not begun
            shutil.rmtree(new_encoder, ignore_errors=True)
            hub.save_pretrained(model.encoder, new_encoder, c.vocab)
            if c.init:   # the starting checkpoint's pooling and similarity (sentence-transformers files)
                hub.copy_retriever_settings(c.init, new_encoder)
            if extra_files:
                extra_files(new_encoder)
            target = out / "state.pt"
            save_training_state(new_state, {
                "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "config": dataclasses.asdict(c), "stream": stream or {}})
        except Exception as e:      # torch.save reports a full disk as a RuntimeError: catch all, then sort
            shutil.rmtree(new_encoder, ignore_errors=True)
            new_state.unlink(missing_ok=True)
            if files.is_disk_full(e, out):
                raise disk_full_error(target, out, last_saved) from None
            raise
        files.replace_checked(new_state, out / "state.pt")    # the commit: from here on step `step` is the checkpoint
        finish_checkpoint_switch(out)
    ranks.barrier()   # short: nobody races ahead of a checkpoint being written


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
    need = (f"a checkpoint needs {files.format_bytes(sum(p.stat().st_size for p in kept))}, "
            f"{files.format_bytes(free)} free" if kept else f"a checkpoint needs more than the {files.format_bytes(free)} free")
    held = f"{out} keeps the checkpoint of step {last_saved}" if last_saved else f"{out} holds no checkpoint yet"
    return data.DataError(f"{target}: the disk is full ({need}); {held}; free some space, or copy the run's "
                          f"--out_dir to a bigger disk, and continue with --resume (--out_dir the new place)")
