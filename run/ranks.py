"""Ranks under torchrun, beneath run/__init__.py: whether this process is one of several, its rank, the means and
broadcasts the log and the checks need, a merge through files for ranks that finish at different times, and peak
memory. Every function is the identity (or rank 0's answer) in a single process."""
import json
import os
import sys
import time

import torch

import data
from run import files


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
    files.atomic_write_text(parts[rank], json.dumps(mine))
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
