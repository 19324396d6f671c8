"""Grade a lab exercises file against the method files' own functions, on random inputs of several seeds and
shapes: the values and, where there is one, the gradient (torch.autograd.grad on both; inputs fp64; equal to
1e-5 of the largest entry, plus 1e-5); sample_spans: the same spans from the same seeded numpy Generator.

    python -m lab.check                      # lab/exercises.py, the solved copy: every line PASS
    python -m lab.check my_exercises.py      # a student's copy
    python -m lab.check --stub OUT.py        # write the students' copy: each body a `raise NotImplementedError`

One line per exercise, PASS or FAIL with what differs and where; the exit status is 0 only if all pass.
"""
import argparse
import functools
import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the method files, whatever the working directory

import costa
import cpdae
import seed

SOLVED = Path(__file__).with_name("exercises.py")
BEGIN, END = "# --- your code ---", "# --- end ---"
# Equal: |mine - reference| <= RTOL max|reference| + ATOL. Not fp64's 1e-12: cpdae.contrastive_loss and
# seed.decoder_loss compute in fp32, so a loss or gradient summed from logits of size 1/tau = 50 is off by ~2e-6.
RTOL, ATOL = 1e-5, 1e-5


class Mismatch(Exception):
    """What differs between the exercise and the method's function, and on which inputs."""


# ----------------------------------------------------------------------------------------------
# Comparing: values, then gradients
# ----------------------------------------------------------------------------------------------
def call(function, args, where, **kwargs):
    """function(*args, **kwargs); the exercise's errors become a Mismatch that names the inputs (not written yet
    stays NotImplementedError)."""
    try:
        return function(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:  # any error in a student's code is a result to report
        raise Mismatch(f"{type(e).__name__}: {e} at {where}") from e


def same(what, mine, reference, where):
    """Raise Mismatch unless mine (the exercise's) equals reference (the method's) to RTOL, ATOL."""
    if not torch.is_tensor(mine):
        raise Mismatch(f"{what} is a {type(mine).__name__}, not a tensor, at {where}")
    if mine.shape != reference.shape:
        raise Mismatch(f"{what} has shape {tuple(mine.shape)} vs {tuple(reference.shape)} at {where}")
    mine, reference = mine.detach().double(), reference.detach().double()
    gap = (mine - reference).abs().nan_to_num(float("inf"))
    if gap.max() <= RTOL * reference.abs().max() + ATOL:
        return
    worst = np.unravel_index(int(gap.argmax()), mine.shape) if mine.dim() else ()
    at = f"[{', '.join(map(str, worst))}] " if worst else ""
    raise Mismatch(f"{what} {at}{mine[worst].item():.6g} vs {reference[worst].item():.6g} at {where}")


def leaves(tensors):
    """Fresh fp64 copies that require grad: each function gets its own, so the two gradients are independent."""
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def grads(scalar, inputs, names, where):
    """d scalar / d each input, or a Mismatch when the exercise's output does not reach an input."""
    if not scalar.requires_grad:
        raise Mismatch(f"no gradient: the output does not depend on {', '.join(names)} through torch, at {where}")
    found = torch.autograd.grad(scalar, inputs, allow_unused=True)
    for g, name in zip(found, names):
        if g is None:
            raise Mismatch(f"no gradient reaches {name} at {where}")
    return found


def first(output):
    return output[0] if isinstance(output, tuple) else output                  # (loss, accuracy): the loss


def same_with_grads(what, exercise, method, tensors, names, where, *args, **kwargs):
    """Call exercise(*tensors, *args, **kwargs) and method(...), each on fresh copies of tensors; compare their
    outputs (the first, if a tuple) and the gradients of that output (a loss; else its sum along a random
    direction) with respect to every tensor. Returns the two outputs, for the rest of a tuple."""
    mine_in, ref_in = leaves(tensors), leaves(tensors)
    mine, ref = call(exercise, [*mine_in, *args], where, **kwargs), method(*ref_in, *args, **kwargs)
    mine_value, ref_value = call(first, [mine], where), first(ref)
    same(what, mine_value, ref_value, where)
    probe = torch.randn(ref_value.shape, generator=torch.Generator().manual_seed(0), dtype=ref_value.dtype)
    mine_scalar, ref_scalar = (mine_value * probe).sum(), (ref_value * probe).sum()
    for name, g_mine, g_ref in zip(names, grads(mine_scalar, mine_in, names, where),
                                   torch.autograd.grad(ref_scalar, ref_in)):
        same(f"d {what} / d {name}", g_mine, g_ref, where)
    return mine, ref


# ----------------------------------------------------------------------------------------------
# The exercises: each check raises Mismatch at its first difference
# ----------------------------------------------------------------------------------------------
def check_gwc_loss(ex):
    for case, (N, S, H) in enumerate([(2, 3, 4), (3, 4, 8), (5, 2, 16), (4, 6, 8)]):
        g = torch.Generator().manual_seed(case)
        texts = torch.randn(N, H, generator=g, dtype=torch.float64)
        spans = torch.randn(N, S, H, generator=g, dtype=torch.float64) + case % 2 * texts[:, None]  # odd: lean to own
        for tau in (1.0, 0.1):
            for sim in ("dot", "cos"):
                where = f"N={N},S={S},H={H},tau={tau},sim={sim}"
                mine, ref = same_with_grads("loss", ex.gwc_loss, costa.gwc_loss, [texts, spans],
                                            ["text_vecs", "span_vecs"], where, tau, sim=sim)
                same("accuracy", torch.as_tensor(mine[1]), ref[1], where)


def check_span_vectors(ex):
    for case, (B, S, L, H) in enumerate([(1, 1, 3, 2), (2, 3, 8, 4), (3, 5, 16, 8)]):
        g = torch.Generator().manual_seed(case)
        hidden = torch.randn(B, L, H, generator=g, dtype=torch.float64)
        starts = torch.randint(0, L - 1, (B, S, 1), generator=g)
        ends = starts + 1 + (torch.rand(B, S, 1, generator=g) * (L - starts)).long()   # start < end <= L
        spans, where = torch.cat([starts, ends], dim=-1), f"B={B},S={S},L={L},H={H}"
        same_with_grads("span vectors", ex.span_vectors, costa.span_vectors, [hidden], ["hidden"], where, spans)


def as_pairs(spans):
    return [tuple(int(x) for x in span) for span in spans]     # numpy ints, lists or tuples: plain (start, end)


def check_sample_spans(ex):
    cases = [(130, "phrase,sentence,paragraph", 5, 4.0, 2.0), (40, "sentence,phrase", 3, 4.0, 2.0),
             (10, "paragraph", 2, 1.0, 1.0), (514, "phrase,sentence,paragraph", 4, 2.0, 5.0), (3, "phrase", 3, 4.0, 2.0)]
    for n_tokens, granularities, T, alpha, beta in cases:
        config = costa.Config(span_T=T, granularities=granularities, span_alpha=alpha, span_beta=beta)
        for rng_seed in range(3):
            where = f"n_tokens={n_tokens},{granularities},T={T},Beta({alpha:g}, {beta:g}),rng seed {rng_seed}"
            mine = call(ex.sample_spans, [n_tokens, config, np.random.default_rng(rng_seed)], where)
            mine = call(as_pairs, [mine], where)
            word_starts = np.ones(n_tokens, dtype=bool)   # unused: no word level here
            ref = as_pairs(costa.sample_spans(word_starts, n_tokens, config, np.random.default_rng(rng_seed)))
            if len(mine) != len(ref):
                raise Mismatch(f"{len(mine)} spans vs {len(ref)} at {where}")
            for i, (a, b) in enumerate(zip(mine, ref)):
                if a != b:
                    name = granularities.split(",")[i // T]
                    raise Mismatch(f"span {i} ({name}) {a} vs {b} at {where}")


def distributions(rows, V, g):
    return torch.softmax(2 * torch.randn(rows, V, generator=g, dtype=torch.float64), dim=-1)  # positive, sum 1


def check_js_similarity(ex):
    for case, (a, b, V) in enumerate([(1, 1, 2), (2, 3, 5), (4, 6, 30)]):
        g = torch.Generator().manual_seed(case)
        p, q = distributions(a, V, g), distributions(b, V, g)
        for tau in (1.0, 0.05):
            where = f"a={a},b={b},V={V},tau={tau}"
            same_with_grads("-JS", ex.js_similarity, cpdae.js_similarity, [p, q], ["anchors", "candidates"], where, tau)


def check_contrastive_loss(ex):
    similarities = {"-JS (cpdae.js_similarity)": cpdae.js_similarity,
                    "-JS/0.02": functools.partial(cpdae.js_similarity, tau=0.02),
                    "cos/0.1 (cpdae.cosine_similarity)": cpdae.cosine_similarity}
    for case, (M, V) in enumerate([(2, 4), (3, 10), (8, 20)]):
        g = torch.Generator().manual_seed(case)
        view1 = distributions(M, V, g)
        view2 = view1 + 0.1 * torch.rand(M, V, generator=g, dtype=torch.float64)   # near their first view
        view2 = view2 / view2.sum(dim=-1, keepdim=True)
        for name, similarity in similarities.items():
            where = f"M={M},D={V},s={name}"
            mine, ref = same_with_grads("loss", ex.contrastive_loss, cpdae.contrastive_loss, [view1, view2],
                                        ["view1", "view2"], where, similarity)
            same("accuracy", torch.as_tensor(mine[1]), ref[1], where)


def check_window_mask(ex):
    for length in (1, 2, 5, 9):
        for k in (1, 2, 3, 0):
            where = f"L={length},k={k}"
            mine, ref = call(ex.window_mask, [length, k], where), seed.window_mask(length, k)
            if not torch.is_tensor(mine) or mine.dtype != torch.bool or mine.shape != ref.shape:
                kind = f"{mine.dtype} {tuple(mine.shape)}" if torch.is_tensor(mine) else type(mine).__name__
                raise Mismatch(f"a {kind} vs torch.bool {tuple(ref.shape)} at {where}")
            if not torch.equal(mine, ref):
                i, j = (mine != ref).nonzero()[0].tolist()
                raise Mismatch(f"query {i} key {j}: {bool(mine[i, j])} vs {bool(ref[i, j])} at {where}")


def check_decoder_loss(ex):
    for case, (B, T, H, V) in enumerate([(1, 3, 4, 5), (2, 5, 8, 11), (3, 7, 6, 13)]):
        g = torch.Generator().manual_seed(case)
        states = torch.randn(B, T, H, generator=g, dtype=torch.float64)
        weight = torch.randn(V, H, generator=g, dtype=torch.float64)
        targets = torch.randint(0, V, (B, T), generator=g)
        targets[:, T - case:] = -100                                   # padding: the last `case` targets of each row
        for reduction in ("mean", "sum"):
            where = f"states ({B}, {T}, {H}),V={V},{case} padding targets a row,reduction={reduction}"
            mine, ref = same_with_grads("loss", ex.decoder_loss, seed.decoder_loss, [states, weight],
                                        ["states", "weight"], where, targets, reduction)
            same("n_correct", torch.as_tensor(mine[1]), ref[1], where)


EXERCISES = [   # (name, where in the papers, check)
    ("gwc_loss", "COSTA eq. 8", check_gwc_loss),
    ("span_vectors", "COSTA eq. 7", check_span_vectors),
    ("sample_spans", "COSTA eq. 1-3", check_sample_spans),
    ("js_similarity", "CPDAE eq. 7", check_js_similarity),
    ("contrastive_loss", "CPDAE eq. 5", check_contrastive_loss),
    ("window_mask", "SEED eq. 9", check_window_mask),
    ("decoder_loss", "SEED eq. 9", check_decoder_loss),
]


# ----------------------------------------------------------------------------------------------
# Grading a file, and writing the students' copy
# ----------------------------------------------------------------------------------------------
def load(path):
    """The exercises file as a module, by path (it need not be importable by name)."""
    spec = importlib.util.spec_from_file_location("exercises_under_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grade(module):
    """One line per exercise; True when all pass."""
    passed = 0
    for name, equation, check in EXERCISES:
        try:
            if not hasattr(module, name):
                raise Mismatch(f"no function {name} in the file")
            check(module)
            print(f"PASS {name} ({equation})")
            passed += 1
        except NotImplementedError:
            print(f"FAIL {name} ({equation}): NotImplementedError: not written yet")
        except Mismatch as e:
            print(f"FAIL {name} ({equation}): {e}")
    legend = "" if passed == len(EXERCISES) else " (a FAIL line: your value vs the method file's, on the inputs named)"
    print(f"{passed} of {len(EXERCISES)} pass{legend}")
    return passed == len(EXERCISES)


def stub(source):
    """source with every body between BEGIN and END replaced by a raise naming its function."""
    out, function, inside = [], None, False
    for line in source.splitlines(keepends=True):
        if match := re.match(r"def (\w+)\(", line):
            function = match[1]
        if line.strip() == END:
            inside = False
        if not inside:
            out.append(line)
        if line.strip() == BEGIN:
            inside = True
            indent = line[:len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("exercise: {function}")\n')
    return "".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default=str(SOLVED), help="the exercises file (default: lab/exercises.py)")
    parser.add_argument("--stub", metavar="OUT", help="write the students' copy of FILE to OUT instead")
    args = parser.parse_args(argv)
    if args.stub:
        if Path(args.stub).resolve() == Path(args.file).resolve():
            sys.exit(f"--stub {args.stub}: that is the file itself; write the copy elsewhere")
        copy = stub(Path(args.file).read_text())
        Path(args.stub).write_text(copy)
        n_stubs = copy.count('raise NotImplementedError("exercise: ')
        print(f"wrote {args.stub}: {n_stubs} exercises to write")
        return
    try:
        module = load(args.file)
    except Exception as e:  # noqa: BLE001 -- a file that does not even load: say why, grade nothing
        print(f"FAIL {args.file}: cannot load it: {type(e).__name__}: {e}")
        sys.exit(2)
    sys.exit(0 if grade(module) else 1)


if __name__ == "__main__":
    main()
