"""The lab (lab/sheet.md): its grader passes the solved exercises and fails stubbed or wrong ones, the walkthrough
runs without the lab and draws its figures, and the side-by-side diffs are current. Each test runs its command as
the sheet does, in a subprocess.

    pytest -q tests/test_lab.py
"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLVED = ROOT / "lab" / "exercises.py"
NAMES = ["gwc_loss", "span_vectors", "sample_spans", "js_similarity", "contrastive_loss", "window_mask", "decoder_loss"]


def run(*args):
    """python ARGS in the repository root -> (exit status, stdout + stderr)."""
    done = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def result_lines(output):
    return [line for line in output.splitlines() if line.startswith(("PASS ", "FAIL "))]


def test_check_passes_the_solved_exercises():
    status, output = run("-m", "lab.check")
    assert status == 0, output
    lines = result_lines(output)
    assert len(lines) >= 6 and all(line.startswith("PASS ") for line in lines), output
    assert [line.split()[1] for line in lines] == NAMES


def test_check_fails_each_stubbed_exercise_by_name(tmp_path):
    stub = tmp_path / "stub.py"
    assert run("-m", "lab.check", "--stub", stub)[0] == 0
    assert stub.read_text().count("raise NotImplementedError(") == len(NAMES)
    status, output = run("-m", "lab.check", stub)
    assert status != 0
    for name in NAMES:
        assert f"FAIL {name} " in output and f"exercise: {name}" in stub.read_text(), output
    assert "not written yet" in output


def test_check_fails_a_gwc_loss_that_keeps_the_anchor_itself(tmp_path):
    drop_self = '    logits = logits.masked_fill(torch.eye(N, N + N * S, dtype=torch.bool), float("-inf"))  # j != i\n'
    source = SOLVED.read_text()
    assert drop_self in source      # the line this test removes: if it changed, change the test with it
    wrong = tmp_path / "wrong.py"
    wrong.write_text(source.replace(drop_self, ""))
    status, output = run("-m", "lab.check", wrong)
    assert status != 0
    assert "FAIL gwc_loss (COSTA eq. 8): loss" in output, output
    assert sum(line.startswith("PASS ") for line in result_lines(output)) == len(NAMES) - 1, output


# The walkthrough never imports lab/: a stubbed lab/exercises.py (the copy a course hands out) cannot break it.
NO_LAB = ("import runpy, sys; runpy.run_path('walkthrough.py', run_name='__main__'); "
          "lab = [m for m in sys.modules if m == 'lab' or m.startswith('lab.')]; assert not lab, lab")


def test_walkthrough_runs_without_importing_the_lab():
    status, output = run("-c", NO_LAB)
    assert status == 0, output
    assert "L_GWC" in output and "L_CL" in output and "window mask" in output


def test_walkthrough_plots_writes_its_figures(tmp_path):
    status, output = run("-c", f"import sys; sys.argv[1:] = ['--plots', {str(tmp_path)!r}]; {NO_LAB}")
    assert status == 0, output
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) >= 3 and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs), output


def test_side_by_side_diffs_are_current():
    status, output = run("-m", "lab.diffs", "--check")
    assert status == 0, output
