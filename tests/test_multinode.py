"""Several nodes and shared file systems, on one CPU machine: the run folder's lock where the file system has no
flock (flock made to fail as NFS's or Lustre's does), a token cache folder that another node cannot see (each rank
given its own --cache_dir, as two nodes' local disks), and `srun python costa.py` (Slurm's variables set by hand)."""
import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import costa
import data
import run

HERE = Path(__file__).resolve().parent.parent   # the repository root
PY = sys.executable
TINY_ARGS = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "64", "--max_len", "64",
             "--batch_size", "4", "--log_every", "1", "--prep_workers", "1"]

# `python -c NO_FLOCK script args...`: the script, run with every flock failing as on NFS without locks (ENOLCK)
NO_FLOCK = ("import errno, fcntl, runpy, sys\n"
            "def no_flock(fd, operation):\n"
            "    raise OSError(errno.ENOLCK, 'No locks available')\n"
            "fcntl.flock = no_flock\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
HOLD = "import sys, time, run\nrun.folders.lock_run_folder(sys.argv[1], create=True)\nprint('locked', flush=True)\ntime.sleep(600)\n"


@pytest.fixture
def no_flock(monkeypatch):
    """flock fails in this process as on an NFS mount without locks; the one line about it is said afresh."""
    import fcntl

    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", refuse)
    monkeypatch.setattr(run.folders, "_LOCK_FILES_SAID", [])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few real Wikipedia articles: enough windows for a tiny run, fast to tokenize."""
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in data.read_pretraining_texts(data.WIKI)[:8]))
    return path


def _holder(folder, script):
    """Another process that takes folder's lock without flock and keeps it until killed."""
    holder = subprocess.Popen([PY, "-c", NO_FLOCK, script, str(folder)], cwd=HERE, stdout=subprocess.PIPE, text=True)
    assert "no flock on this file system" in holder.stdout.readline()
    assert holder.stdout.readline().strip() == "locked"
    return holder


# ----------------------------------------------------------------------------------------------
# The run folder's lock without flock: a lock file made with O_EXCL
# ----------------------------------------------------------------------------------------------
def test_without_flock_a_lock_file_keeps_one_run_per_folder_and_a_dead_ones_is_taken_over(tmp_path, no_flock, capsys):
    folder = (tmp_path / "run").resolve()
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    holder = _holder(folder, script)
    lock = folder / run.folders.LOCK_FILE
    try:
        assert json.loads(lock.read_text())["pid"] == holder.pid                  # host, pid, start
        with pytest.raises(data.DataError, match=f"^{folder} is in use by another run \\(pid {holder.pid} on "):
            run.folders.lock_run_folder(folder)
        assert run.folders.held_by_another_run(folder)
        said = capsys.readouterr().out         # this process's first lock file: why, in one line
        assert said == (f"{folder}: no flock on this file system (No locks available); the run holds the lock file "
                        f"{lock} instead, removed when it ends\n")
    finally:
        holder.kill()                          # kill -9: nothing removes its lock file ...
        holder.wait()
    assert lock.exists() and not run.folders.held_by_another_run(folder)
    run.folders.lock_run_folder(folder)        # ... and the next run of this host takes it over, in one line
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"{lock}: left by pid {holder.pid} on this host since ")
    assert out[0].endswith("which is no longer running; taking the run folder over")
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    run.folders.release_run_folder(folder)     # release removes it
    assert not lock.exists() and not list(folder.iterdir())


def test_a_lock_file_of_another_host_or_unreadable_is_refused_naming_it(tmp_path, no_flock):
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / run.folders.LOCK_FILE
    lock.write_text(json.dumps({"host": "node-b", "pid": 1, "started": "2025-01-01 00:00:00"}))
    with pytest.raises(data.DataError) as e:
        run.folders.lock_run_folder(folder)
    assert str(e.value) == (f"{folder} is locked by {lock} (pid 1 on node-b, since 2025-01-01 00:00:00); this host "
                            f"cannot tell whether that run is alive: if it is not, delete {lock} and start again, else "
                            f"give another --out_dir")
    lock.write_text("")                        # a writer killed between its create and its write
    with pytest.raises(data.DataError, match=f"names no run .* delete {lock} and start again"):
        run.folders.lock_run_folder(folder)
    assert run.folders.held_by_another_run(folder) and lock.exists()            # refused, nothing removed


def test_a_run_without_flock_holds_a_lock_file_and_resumes_after_kill_9(tmp_path, corpus):
    """End to end, every flock failing: costa.py killed with -9 mid-run leaves its lock file; --resume takes it over
    in one line, continues, and leaves no lock file behind."""
    out = tmp_path / "run"
    args = [PY, "-c", NO_FLOCK, "costa.py", "--corpus", str(corpus), *TINY_ARGS, "--save_every", "2",
            "--out_dir", str(out), "--steps", "400"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(args, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not (lines and lines[-1].startswith("step      3/")):               # past its first checkpoint
            lines.append(first.stdout.readline())
            assert lines[-1], "".join(lines)
        assert any("no flock on this file system" in line for line in lines)
        assert json.loads((out / run.folders.LOCK_FILE).read_text())["pid"] == first.pid
    finally:
        first.kill()
        first.wait()
    assert (out / run.folders.LOCK_FILE).exists()
    saved = run.folders.load_training_state(out / "state.pt")["step"]
    again = subprocess.run([*args[:-1], str(saved + 3), "--resume"], cwd=HERE, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    taken = [line for line in again.stdout.splitlines() if "no longer running" in line]
    assert len(taken) == 1 and taken[0].startswith(f"{out.resolve() / run.folders.LOCK_FILE}: left by pid {first.pid}")
    assert f"at step {saved}" in again.stdout
    assert run.folders.load_training_state(out / "state.pt")["step"] == saved + 3
    assert not (out / run.folders.LOCK_FILE).exists()


# ----------------------------------------------------------------------------------------------
# A token cache folder that another node cannot see
# ----------------------------------------------------------------------------------------------
def _cache_seen_by_two_ranks(rank, world, tmp_path, corpus):
    """Each rank its own --cache_dir, as two nodes' local disks; then one folder both share."""
    run.cache.SHARED_WAIT_S = 2                # (this spawned process's copy of the module)
    t0 = time.time()
    try:
        run.cache.token_windows(corpus, data.VOCAB, 64, rank, str(tmp_path / f"node{rank}"), workers=1, verbose=False)
        local = "built"
    except data.DataError as e:
        local = str(e)
    seconds = time.time() - t0
    shared = run.cache.token_windows(corpus, data.VOCAB, 64, rank, str(tmp_path / "shared"), workers=1, verbose=False)
    torch.save({"local": local, "seconds": seconds, "shared": len(shared)}, tmp_path / f"rank{rank}.pt")


def test_a_cache_folder_another_node_cannot_see_is_named_within_the_wait(tmp_path, corpus, run_on_two_ranks):
    ranks = run_on_two_ranks(_cache_seen_by_two_ranks, tmp_path, str(corpus))
    host = socket.gethostname()
    for r, answer in enumerate(ranks):         # every rank stops with the same line, after about SHARED_WAIT_S
        folder = run.cache.token_cache_folder(corpus, data.VOCAB, tmp_path / f"node{r}")    # (its own, here)
        assert answer["local"] == (f"{folder}: the token cache folder that rank 0 writes on {host} is not visible "
                                   f"from {host} (waited 2 s for a file rank 0 wrote in it); give --cache_dir a "
                                   f"folder on a file system that every node shares"), answer["local"]
        assert answer["seconds"] < 30
    assert ranks[0]["shared"] == ranks[1]["shared"] > 0                          # shared: built once, read by both
    assert not list((tmp_path / "node0").rglob(".*.tmp"))                        # rank 0's marker removed
    assert not (tmp_path / "node1").exists()                                     # rank 1 wrote nothing


# ----------------------------------------------------------------------------------------------
# srun python costa.py: one independent run per Slurm task, refused
# ----------------------------------------------------------------------------------------------
def test_plain_srun_is_refused_in_one_line_naming_torchrun_per_node(tmp_path, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["costa.py"])
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "3")
    with pytest.raises(SystemExit) as e:       # tasks other than 0 leave quietly
        run.cli.parse_config(costa.Config, [])
    assert e.value.code == 1 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "3")            # torchrun's worker under srun: fine
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert run.cli.parse_config(costa.Config, []).steps > 0
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")     # a batch script's own process: SLURM_NTASKS of the allocation
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert run.cli.parse_config(costa.Config, []).steps > 0
    env = {**os.environ, "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "0", "OMP_NUM_THREADS": "1"}   # task 0, for real
    result = subprocess.run([PY, "costa.py", "--out_dir", str(tmp_path / "run")], cwd=HERE, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        "error: srun started costa.py as 8 tasks (SLURM_STEP_NUM_TASKS), each an independent run without torchrun's "
        "RANK and WORLD_SIZE; launch one torchrun per node instead: srun --ntasks-per-node=1 bash -c 'torchrun "
        "--nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID --nproc_per_node=GPUS --master_addr=FIRST_HOST "
        "--master_port=29500 costa.py ...' (docs/paper-scale.md, Several nodes)")
    assert not (tmp_path / "run").exists()
