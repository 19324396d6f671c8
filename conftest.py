"""Helpers shared by test_losses.py and test_pipeline.py: the BERT tokenizer, and running a function
on 2 or more gloo processes (the check that an N-process run equals one process holding every part)."""
import contextlib
import datetime
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import data
import run

# The suite is the CPU suite that CI runs, and it runs the same on a GPU machine: its torchrun tests start
# 2 processes, which NCCL would refuse on one GPU. The GPU path is measured by python -m research.benchmark --gpu.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Every test under a bound: a hang is a failed test with the traceback of where it waited, not a suite that
# never ends. The longest test takes about 3 minutes on a 2-core machine that other jobs share.
TEST_TIMEOUT_S = int(os.environ.get("TEST_TIMEOUT_S", "600"))


@contextlib.contextmanager
def _bounded(item, phase):
    """SIGALRM raises in the main thread whatever it waits on (a join, a pipe, a lock, a sleep). pytest.fail
    raises no Exception (no OSError, as TimeoutError is), so no `except` of the code under test swallows it."""
    if not hasattr(signal, "SIGALRM"):                 # (Windows)
        yield
        return

    def ran_over(signum, frame):
        pytest.fail(f"{item.nodeid}: {phase} ran over {TEST_TIMEOUT_S} s (TEST_TIMEOUT_S, conftest.py)")
    previous = signal.signal(signal.SIGALRM, ran_over)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _bounded(item, "its setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _bounded(item, "the test"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _bounded(item, "its teardown"):
        return (yield)


@pytest.fixture(autouse=True)
def release_run_folders():
    """A run that stopped with an error keeps its run folder locked until its process ends; a test is
    not the end of the pytest process, so the next test's subprocess may use the folder again."""
    yield
    for folder in list(run.folders._LOCKS):
        run.folders.release_run_folder(folder)


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer()


def _init_and_run(rank, world, worker, tmp_path, args, timeout_s=120):
    # Rendezvous through a file in tmp_path: no port is picked, released and maybe taken by another
    # process before the ranks bind it. The timeout turns a lost peer into an error, not a hang.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        worker(rank, world, tmp_path, *args)
        dist.barrier()   # both ranks leave the last collective before either leaves
    except BaseException:
        dist.destroy_process_group()
        raise
    # The results are on disk (torch.save). Leave without tearing gloo down: its teardown still aborted a
    # rank now and then ("terminate called without an active exception", SIGABRT), barrier or not.
    os._exit(0)


def _run_on_ranks(world, worker, tmp_path, *args, timeout_s=120):
    """Run worker(rank, world, tmp_path, *args) in `world` gloo processes whose collectives time out after
    timeout_s; return the objects each rank saved with torch.save(obj, tmp_path / f"rank{rank}.pt"), in
    rank order."""
    mp.spawn(_init_and_run, args=(world, worker, tmp_path, args, timeout_s), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _run_on_two_ranks(worker, tmp_path, *args):
    return _run_on_ranks(2, worker, tmp_path, *args)


@pytest.fixture
def run_on_two_ranks():
    """run_on_two_ranks(worker, tmp_path, *args): worker must be a module-level function (it is pickled)."""
    return _run_on_two_ranks


@pytest.fixture
def run_on_ranks():
    """run_on_ranks(world, worker, tmp_path, *args, timeout_s=120): as run_on_two_ranks on `world` processes."""
    return _run_on_ranks
