"""Fine-tuning's data path against corpus size: peak RSS per rank and the time to encode the corpus, finetune.py as
it was before the passage cache (the commit --before, unpacked beside the data) against this tree, in one run.

The data are generated in MS MARCO's format: N passages of 56 words (MS MARCO's mean), each word a whole-word
entry of BERT's vocabulary (two letters or more) drawn with Zipf-like frequencies (p ~ 1 / rank^1.1 in the
vocabulary's order), so a word is one token; N / 20 training queries of 6 words (MS MARCO has one per 17.6
passages), each with one judged passage and a negatives line of 100 random passages (Tevatron's 'qid<TAB>pid,...');
200 dev queries. collection.tsv has two columns, as the code before reads no titles. Every run: torchrun, 2
processes, a random 2 x 16 encoder (what grows is the data path, not the model), 2 loader workers a rank, 20 steps
of stage 1 from the negatives file, then the dev evaluation, which encodes the corpus once (its 'encoded N passages
in S s' line) and searches it (fp16 vectors in --vectors_dir, faiss Flat). This tree runs twice: the first run
builds the passage cache, the second maps it.

Peak RSS per rank: each rank's high-water mark (VmHWM, read from /proc every 0.2 s), the larger of the two. Apart,
the most memory any child of a rank added (its loader workers; on a first run also the tokenizing pool): its
Private_Dirty in /proc/PID/smaps_rollup, read as often. A forked worker's RSS starts as a copy of its rank's (shared
pages), so what a worker adds is the pages it wrote to: its own allocations, and the rank's pages it copied by
writing to them, as Python does to every object it reads (its reference count). Pages of a file it maps are the
page cache's, not counted. What it prints goes to results/scale/measure.md (benchmark.recorded), the rows to
measure.json.

    python results/scale/measure.py                                   # 1 M and 3 M passages (run.sh)
    python results/scale/measure.py --sizes 20000 --out /tmp/measure  # a quick check: /tmp/measure/measure.md
"""
import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the repository root
import data
from research import benchmark

WORDS_PER_PASSAGE, WORDS_PER_QUERY, NEGATIVES, DEV_QUERIES = 56, 6, 100, 200
RUN_FLAGS = ["--init", "", "--hidden_size", "16", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "32",
             "--steps", "20", "--batch_size", "32", "--n_negatives", "7", "--workers", "2", "--rounds", "0",
             "--log_every", "10", "--save_every", "1000", "--overwrite"]


def vocabulary_words():
    """BERT's whole-word entries of two letters or more, in the vocabulary's order (roughly by frequency)."""
    return np.array([w for w in data.VOCAB.read_text(encoding="utf-8").split("\n")
                     if w.isalpha() and w.isascii() and len(w) > 1])


def write_texts(path, n, n_words, rng, words, prefix):
    """'{prefix}{i}<TAB>text' lines for i < n, the texts drawn a block at a time (the arrays stay small)."""
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, 50_000):
            count = min(50_000, n - start)
            drawn = words[rng.choice(len(words), size=count * n_words, p=p / p.sum())].reshape(count, n_words)
            f.writelines(f"{prefix}{start + i}\t{' '.join(row)}\n" for i, row in enumerate(drawn))


def generate(folder, n):
    """The MS MARCO-format files of n passages in folder (made once); the finetune.py flags that read them."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {name: folder / name for name in ("collection.tsv", "queries.tsv", "qrels.train.tsv", "qrels.dev.tsv",
                                               "negatives.tsv")}
    if not all(path.is_file() for path in files.values()):
        rng, words, n_train = np.random.default_rng(0), vocabulary_words(), n // 20
        write_texts(files["collection.tsv"], n, WORDS_PER_PASSAGE, rng, words, "")
        write_texts(files["queries.tsv"], n_train + DEV_QUERIES, WORDS_PER_QUERY, rng, words, "q")
        positive = rng.integers(n, size=n_train + DEV_QUERIES)
        files["qrels.train.tsv"].write_text("".join(f"q{q} 0 {positive[q]} 1\n" for q in range(n_train)))
        files["qrels.dev.tsv"].write_text("".join(f"q{q} 0 {positive[q]} 1\n" for q in range(n_train, len(positive))))
        with open(files["negatives.tsv"], "w") as f:
            f.writelines(f"q{q}\t{','.join(map(str, rng.integers(n, size=NEGATIVES)))}\n" for q in range(n_train))
    return ["--corpus", files["collection.tsv"], "--queries", files["queries.tsv"], "--qrels", files["qrels.train.tsv"],
            "--bm25_negatives", files["negatives.tsv"], "--eval_queries", files["queries.tsv"],
            "--eval_qrels", files["qrels.dev.tsv"]]


def code_before(commit, folder):
    """The repository at `commit`, unpacked into folder (git archive: no worktree to clean up); its path."""
    if not (folder / "finetune.py").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        blob = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(blob)) as archive:
            archive.extractall(folder, filter="data")
    return folder


def process_tree():
    """{pid: parent pid} of every process, from /proc."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def kib(path, *fields):
    """The sum of these 'Name:  N kB' fields of a /proc file (0 once the process is gone)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return 0
    return sum(int(m[1]) for field in fields for m in re.finditer(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE))


def watched(cmd, cwd, every_s=0.2):
    """Run cmd (torchrun); (its output, the seconds it took, the peak RSS MiB of its larger rank (VmHWM), the most
    memory MiB any child of a rank wrote to (Private_Dirty)), read every every_s seconds while it runs."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    peaks = {}                                                       # pid -> (depth below torchrun, KiB)
    while proc.poll() is None:
        parents, depth = process_tree(), {proc.pid: 0}
        for _ in range(4):                                           # ranks (1), their workers (2), and below
            depth.update({pid: depth[parent] + 1 for pid, parent in parents.items() if parent in depth and pid not in depth})
        for pid, d in depth.items():
            if d:
                now = kib(f"/proc/{pid}/status", "VmHWM") if d == 1 else \
                    kib(f"/proc/{pid}/smaps_rollup", "Private_Dirty")
                peaks[pid] = (d, max(peaks.get(pid, (d, 0))[1], now))
        time.sleep(every_s)
    reader.join()
    output = "".join(lines)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{output[-3000:]}")
    top = lambda level: max((kib for d, kib in peaks.values() if d == level), default=0) / 1024
    return output, time.time() - t0, top(1), max(top(2), top(3))


def encoding_line(output):
    """(passages, seconds) of the evaluation's 'encoded N passages in S s' line."""
    match = re.search(r"encoded ([\d,]+) passages in ([\d.]+)s", output)
    return int(match[1].replace(",", "")), float(match[2])


def measure(sizes, before, folder):
    old = code_before(before, folder / f"code-{before}")
    print(f"finetune.py under torchrun, 2 processes, on generated MS MARCO-format data; code: {before} (before the "
          f"passage cache) and this tree; peak RSS per rank: VmHWM; what a worker adds: its Private_Dirty; read every 0.2 s")
    print("| passages | code | run | wall time | encoding the corpus | peak RSS per rank | a worker adds |\n"
          "|---|---|---|---|---|---|---|")
    rows = []
    for n in sizes:
        files = generate(folder / f"marco-{n}", n)
        for cache in (folder / f"marco-{n}").glob("*.tokens-*"):
            subprocess.run(["rm", "-r", str(cache)], check=True)          # this tree's first run builds it
        for code, run_name, cwd in ((before, "every run", old), ("this tree", "first (builds the cache)", ROOT),
                                    ("this tree", "second (maps it)", ROOT)):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "finetune.py",
                   *map(str, files), *RUN_FLAGS, "--out_dir", str(folder / f"run-{n}"),
                   "--vectors_dir", str(folder / f"vectors-{n}")]
            output, seconds, rank_mib, worker_mib = watched(cmd, cwd)
            encoded, encode_s = encoding_line(output)
            rows.append({"passages": n, "code": code, "run": run_name, "wall_s": round(seconds, 1),
                         "encode_s": encode_s, "encoded": encoded, "peak_rss_rank_mib": round(rank_mib),
                         "peak_worker_private_dirty_mib": round(worker_mib)})
            print(f"| {n:,} | {code} | {run_name} | {seconds:,.0f} s | {encode_s:,.1f} s ({encoded / encode_s:,.0f} "
                  f"passages/s) | {rank_mib:,.0f} MiB | {worker_mib:,.0f} MiB |", flush=True)
    print()
    for n in sizes:
        mine = [r for r in rows if r["passages"] == n]
        ratio = mine[2]["peak_rss_rank_mib"] / mine[0]["peak_rss_rank_mib"]
        print(f"{n:,} passages: this tree's peak RSS per rank (second run) is {ratio:.2f} of {before}'s "
              f"({mine[2]['peak_rss_rank_mib']:,} against {mine[0]['peak_rss_rank_mib']:,} MiB); encoding "
              f"{mine[0]['encode_s'] / mine[2]['encode_s']:.2f}x as fast")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,3000000", help="passages, comma-separated")
    parser.add_argument("--before", default="9d6e50b", help="the commit of the code before the passage cache")
    parser.add_argument("--dir", default="runs/scale-finetune", help="generated data, the old code, the runs")
    parser.add_argument("--out", default=str(Path(__file__).parent), help="where measure.md and measure.json go")
    args = parser.parse_args()
    out = Path(args.out)
    with benchmark.recorded(out / "measure.md"):
        rows = measure([int(x) for x in args.sizes.split(",")], args.before, Path(args.dir).resolve())
    (out / "measure.json").write_text(json.dumps(rows, indent=1) + "\n")
