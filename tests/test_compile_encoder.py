"""--compile compiles the encoder (run.speed.compiled_encoder, one line in each method's train()): a tiny costa.py run
says so in one line, its step-1 losses are eager's, its checkpoints and Hugging Face folder are eager's (no compiled
module's prefix in a key), a varying batch length compiles at most once more, and resume stays bit for bit; where no
compiler works, one line and the eager forward."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import costa
import data
import run
from research import benchmark

HERE = Path(__file__).resolve().parent.parent   # the repository root
TINY_ARGS = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "64", "--max_len", "64",
             "--batch_size", "4", "--log_every", "1", "--steps", "6"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Snippets of Wikipedia articles, 8 to 40 words, each one window shorter than 64 tokens: the batches' padded
    length varies from step to step (data.pad_batch pads to the longest window of a batch)."""
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    articles = data.read_pretraining_texts(data.WIKI)[:12]
    texts = [" ".join(a.split()[:n]) for a in articles for n in (8, 16, 24, 32, 40)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def costa_run(corpus, out, *extra):
    """costa.py on the tiny model in a fresh process (a compile of its own, as a user's run), recompiles logged:
    (what it printed, what it logged to stderr, its log.jsonl rows, its run folder)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_LOGS": "recompiles"}
    result = subprocess.run([sys.executable, str(HERE / "costa.py"), "--corpus", str(corpus), *TINY_ARGS,
                             "--out_dir", str(out), *extra], cwd=out.parent, env=env, capture_output=True, text=True,
                            timeout=500)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return result.stdout, result.stderr, rows, out


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """The same tiny run eager and with --compile true, 6 steps each."""
    tmp = tmp_path_factory.mktemp("runs")
    return {name: costa_run(corpus, tmp / name, *extra)
            for name, extra in (("eager", ()), ("compiled", ("--compile", "true")))}


def test_the_encoder_is_compiled_and_step_1_equals_eager(runs):
    """One line names the encoder as compiled; step 1's mlm and gwc equal eager's to 1e-3 (the compiled encoder
    draws eager's dropout masks: the same step, its sums in another order)."""
    said = runs["compiled"][0].splitlines()
    assert sum(line.startswith("--compile: the encoder compiled in ") for line in said) == 1, said
    assert not any("the encoder" in line for line in runs["eager"][0].splitlines())
    eager, compiled = runs["eager"][2][0], runs["compiled"][2][0]
    assert eager["step"] == compiled["step"] == 1
    for key in ("mlm", "gwc"):
        assert abs(compiled[key] - eager[key]) <= 1e-3, (key, compiled[key], eager[key])


def test_a_varying_batch_length_compiles_at_most_once_more(runs, corpus):
    """The batches pad to their longest window, and here their length varies; dynamo compiles a second graph, its
    length dynamic, at the first new length, and none after: no compile per length."""
    c = costa.Config(corpus=str(corpus), max_len=64, batch_size=4, steps=6)
    lengths = [batch["input_ids"].shape[1] for batch in benchmark.load_batches(costa, c, 6, n_texts=100)]
    assert len(set(lengths)) > 2, lengths                          # the compiled run saw several lengths
    recompiles = [line for line in runs["compiled"][1].splitlines() if "Recompiling function" in line]
    assert len(recompiles) <= 1, (lengths, recompiles)


def test_checkpoints_keep_the_plain_keys(runs):
    """The compiled forward replaces the encoder's forward, not the module: state.pt's model and the Hugging Face
    folder hold eager's keys (no `_orig_mod.`), so saving, --resume and export are unchanged."""
    keys = {}
    for name, (*_, folder) in runs.items():
        with safe_open(folder / "encoder" / "model.safetensors", "pt") as f:
            hub_keys = sorted(f.keys())
        state_keys = sorted(torch.load(folder / "state.pt", weights_only=False)["model"])
        keys[name] = (hub_keys, state_keys)
    assert keys["compiled"] == keys["eager"]
    assert not any("_orig_mod" in k for k in keys["compiled"][1])


def test_resume_with_the_encoder_compiled_continues_exactly(runs, corpus, tmp_path):
    """A compiled run halted at step 3 and resumed in a new process (a compile of its own) logs the straight
    compiled run's losses bit for bit."""
    out = tmp_path / "resumed"
    costa_run(corpus, out, "--compile", "true", "--halt_at", "3")
    said, _, resumed, _ = costa_run(corpus, out, "--compile", "true", "--resume")
    assert "resume:" in said and "at step 3" in said
    straight = runs["compiled"][2]
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for key in ("mlm", "gwc", "gwc_acc"):
        assert [r[key] for r in straight] == [r[key] for r in resumed], key


def test_a_compiler_failure_leaves_the_encoder_eager_in_one_line(monkeypatch, capsys):
    """Where torch.compile fails (no C++ compiler, a platform it does not support), --compile says so once for the
    encoder and the run goes on with its eager forward; without --compile the forward is the encoder's own."""
    def failing_compile(fn, **kwargs):
        def call(*args, **kw):
            raise RuntimeError("no C++ compiler found\nmore lines")
        return call
    monkeypatch.setattr(torch, "compile", failing_compile)
    torch.manual_seed(0)
    encoder = costa.Encoder(costa.Config(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64)).eval()
    ids, mask = torch.randint(1000, 2000, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    assert run.speed.compiled_encoder(encoder, SimpleNamespace(compile=False)) == encoder.forward
    want = encoder(ids, mask)
    encoder.forward = run.speed.compiled_encoder(encoder, SimpleNamespace(compile=True))
    for _ in range(2):
        torch.testing.assert_close(encoder(ids, mask), want)
    assert capsys.readouterr().out == "--compile: the encoder not compiled (RuntimeError: no C++ compiler found); eager\n"
