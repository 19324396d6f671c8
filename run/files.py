"""Files trusted only once checked, and written whole or not at all, beneath run/__init__.py: safetensors with a
sha256 beside each (NAME.sha256, sha256sum's format), every tensor finite; atomic writes through temporaries that a
killed process leaves behind and the next run removes; one line for a full disk; progress lines with an ETA."""
import contextlib
import json
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path

import numpy as np
import torch

import data
from run import cache


# ----------------------------------------------------------------------------------------------
# Hugging Face BERT folders, and the starting checkpoints (a folder, minilm, a hub id)
# ----------------------------------------------------------------------------------------------
def save_tensors(path, tensors):
    """A dict of tensors as safetensors (atomic, its checksum beside it: write_checked); tied tensors cloned."""
    from safetensors.torch import save_file
    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}
    write_checked(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def load_tensors(path, fix="the weights cannot be used", pinned=False):
    """A safetensors file as {name: tensor}, trusted only once checked: its checksum (check_checksum; pinned: checked
    otherwise, as MiniLM's), its format (a damaged, truncated or empty file is one line naming it) and every value
    finite (check_finite)."""
    from safetensors.torch import load_file
    if not Path(path).is_file():
        raise data.DataError(f"{path}: not found")
    check_checksum(path, fix, pinned)
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
# whole. A file without one (a hub folder, a run of an older version) is read unchecked, saying so in one line; one
# that is there but cannot be read as a list of digests is refused, never taken for none.
def checksum_file(path):
    return Path(path).with_name(Path(path).name + ".sha256")


def entry_problem(path, folder=False):
    """'' where path is a readable regular file (folder: a folder), through a link too, or is not there in any form;
    else what is there instead: a link that leads nowhere (a disk not mounted), a folder, a device, no permission."""
    path = Path(path)
    if not os.path.lexists(path):
        return ""
    link = f"a link to {os.readlink(path)}" if path.is_symlink() else ""
    if not path.exists():
        return f"{link} that leads nowhere (a disk not mounted?)"
    mode = path.stat().st_mode
    if folder:
        kind = "" if stat.S_ISDIR(mode) else "a file"
    else:
        kind = ("" if stat.S_ISREG(mode) else "a folder" if stat.S_ISDIR(mode) else
                "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
                "a pipe" if stat.S_ISFIFO(mode) else "not a regular file")
    if not kind and not os.access(path, os.R_OK | (os.X_OK if folder else 0)):
        kind = "not readable (permission denied)"
    return ", ".join(p for p in (link, kind) if p) if kind else ""


def listed_checksums(path):
    """The digests path's checksum file lists; [] where it is not there in any form. One that is there but is no
    list of digests (not a readable file, not UTF-8, empty, malformed) is one line naming it and what to do."""
    sidecar, name = checksum_file(path), Path(path).name
    if not os.path.lexists(sidecar):
        return []
    lines, why = [], entry_problem(sidecar)
    try:
        text = "" if why else sidecar.read_bytes().decode("utf-8")
        lines = [(i, line.split()[0]) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    except UnicodeDecodeError:
        why = "not UTF-8 text"
    why = why or ("empty (no digest)" if not lines else next(
        (f"line {i} does not start with a sha256 digest (64 hex digits)" for i, digest in lines
         if not re.fullmatch(r"[0-9a-fA-F]{64}", digest)), ""))
    if why:
        raise data.DataError(f"{sidecar}: {why}, not a checksum of {name}; if {name} is known good, recompute it "
                             f"({_recompute(path)}), or move it aside to read {name} unchecked")
    return [digest.lower() for _, digest in lines]


def _recompute(path):
    name = Path(path).name
    return f"sha256sum {name} > {name}.sha256, in {Path(path).parent}"


def replace_checked(source, path):
    """os.replace(source, path), path's checksum file listing the new (and, until the rename, the old) digest."""
    path, digest = Path(path), sha256_of(source)
    old = []
    with contextlib.suppress(data.DataError):      # an unusable old checksum file: the new one replaces it
        old = listed_checksums(path)[:1] if path.is_file() else []
    write_checksums = lambda digests: atomic_write_text(checksum_file(path), "".join(
        f"{d}  {path.name}\n" for d in digests))
    write_checksums([digest, *old])
    os.replace(source, path)
    write_checksums([digest])


def write_checked(path, write):
    """write(a temporary path), then the whole file renamed into place with its checksum (replace_checked),
    and the folder's permissions (safetensors writes 0600: a colleague given the folder could not read it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.chmod(tmp, path.parent.stat().st_mode & 0o666)
        replace_checked(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_checksum(path, fix, pinned=False):
    """A file whose checksum file lists another digest is one line: the file, or the checksum file, is damaged.
    Without one it is read unchecked, saying so once (pinned: its digest was checked otherwise, silently)."""
    listed, sidecar = listed_checksums(path), checksum_file(path).name
    if not listed and not pinned:
        data.say_once(f"warning: {path}: no {sidecar} beside it (a folder from elsewhere, or of an older version): "
                      f"read unchecked")
    if listed and (digest := sha256_of(path)) not in listed:
        raise data.DataError(f"{path}: sha256 {digest[:16]}... is not the {listed[0][:16]}... that {sidecar} recorded "
                             f"when it was written: the file is damaged, or its checksum file is; {fix}; if "
                             f"{Path(path).name} is known good, recompute {sidecar} ({_recompute(path)})")


def sha256_of(path):
    """The file's sha256 (hex), read 1 MiB at a time."""
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# Files written whole or not at all, and progress lines on long steps 
# ----------------------------------------------------------------------------------------------
def is_disk_full(error, folder=None):
    """Whether a failed write ran out of space, by what each writer raises (on the error or its cause): ENOSPC or
    EDQUOT as an errno or in safetensors' words, numpy's "N requested and M written", torch.save's "unexpected pos";
    another RuntimeError when less than 1 MiB is left in folder."""
    import errno
    for e in (error, error.__cause__, error.__context__):
        text = str(e) if e is not None else ""
        if (getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or re.search(r"\d+ requested and \d+ written", text)
                or any(w in text for w in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "unexpected pos"))):
            return True
    try:
        return folder is not None and isinstance(error, RuntimeError) and shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def format_bytes(n):
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 2**shift:
            return f"{n / 2**shift:.1f} {unit}"
    return f"{n} B"


def disk_full_line(folder, what, needs, kept, fix):
    """The one line (a DataError) for a write into folder that found the disk full: needs, free, kept, fix."""
    existing = next(p for p in (Path(folder).absolute(), *Path(folder).absolute().parents) if p.exists())
    free = format_bytes(shutil.disk_usage(existing).free)
    return data.DataError(f"{folder}: the disk is full ({what} {format_bytes(needs)}, {free} free); {kept}{fix}")


def temporary_name(path):
    """Where `path` is written before its rename: '.NAME.PID@HOST.tmp' beside it, naming its writer (_is_stale)."""
    path = Path(path)
    return path.parent / f".{path.name}.{os.getpid()}@{socket.gethostname()}.tmp"


def atomic_write(path, write):
    """write(a temporary path), then rename it to path: a kill or a full disk never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path, text):
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_save_npy(path, array):
    def write(tmp):
        with open(tmp, "wb") as f:   # (np.save(name) would append '.npy' to the temporary name)
            np.save(f, array)
    atomic_write(path, write)


def _is_alive(pid):
    if os.name == "nt":           # (there os.kill(pid, 0) would end the process: never judge)
        return True
    try:
        os.kill(pid, 0)           # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:       # another user's
        return True
    return True


def _is_stale(tmp):
    """A temporary no live process will rename: its PID (in the name) is gone from this host (another host's is never
    judged), or, with no PID in the name, nothing wrote to it for UNOWNED_TEMP_S seconds."""
    here = socket.gethostname()
    if owner := re.search(r"\.(\d+)@(.+)\.tmp$", tmp.name):                         # '.NAME.PID@HOST.tmp'
        pid, host = int(owner[1]), owner[2]
    elif owner := re.fullmatch(r"\.(?:tokens|word_starts)\.bin\.(\d+)\.tmp", tmp.name):  # an older data.py's
        pid, host = int(owner[1]), here
    else:
        return time.time() - tmp.stat().st_mtime > cache.UNOWNED_TEMP_S
    return host == here and not _is_alive(pid)


def remove_dead_temporaries(folder, say=False, locked=False):
    """Delete killed writers' temporaries: all, subfolders too, in a folder held locked; else those _is_stale."""
    n, size = 0, 0
    for tmp in (Path(folder).rglob if locked else Path(folder).glob)(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):  # renamed or removed meanwhile, by its writer or another cleaner
            if locked or _is_stale(tmp):
                size += tmp.stat().st_size
                tmp.unlink()
                n += 1
    if n and say:
        print(f"{folder}: removed {n} temporary file(s) of killed writers ({size / 2**20:.1f} MiB)", flush=True)


PROGRESS_EVERY_S = 30.0   # seconds between progress lines (tests set it small)


def format_seconds(s):
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def counted(items, progress):
    """Yield items, counting each on a ProgressLine (for a library call that consumes an iterable)."""
    for item in items:
        progress.add()
        yield item


class ProgressLine:
    """A line every PROGRESS_EVERY_S s on rank 0 while a long step runs (total 0: no ETA); add(n) as items are done."""

    def __init__(self, what, total=0, unit="items", rank=None):
        self.what, self.total, self.unit, self.done = what, total, unit, 0
        self.show = (int(os.environ.get("RANK", "0")) if rank is None else rank) == 0
        self.t0 = self.last = time.time()

    def add(self, n=1):
        self.done += n
        now = time.time()
        if self.show and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            total = f"/{self.total:,}" if self.total else ""
            eta = (f" | eta {format_seconds((self.total - self.done) / max(rate, 1e-9))}" if self.total else "")
            print(f"{self.what} {self.done:,}{total} {self.unit} | {rate:,.0f} {self.unit}/s | "
                  f"elapsed {format_seconds(now - self.t0)}{eta}", flush=True)
