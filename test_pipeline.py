"""Pipeline tests: data.py, the shared encoder, the training loop (torchrun, resume), the method files'
shared blocks, fine-tuning and evaluation. Loss equations are proven in test_losses.py.

    pytest -q test_pipeline.py
"""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import costa
import data

HERE = Path(__file__).resolve().parent
PY = sys.executable


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer()


@pytest.fixture(scope="module")
def wiki_texts():
    return data.read_pretraining_texts(data.WIKI)[:20]


def tiny_config(**overrides):
    fields = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_len=64, batch_size=4,
                  dropout=0.1, steps=6, log_every=1, save_every=100)
    return costa.Config(**{**fields, **overrides})


# ----------------------------------------------------------------------------------------------
# Tokenizer, windows, masking
# ----------------------------------------------------------------------------------------------
def test_tokenizer_is_bert_uncased(tokenizer):
    assert tokenizer.get_vocab_size() == 30522
    assert data.special_ids(tokenizer) == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    assert tokenizer.encode("Héllo, Anarchism!").tokens == ["hello", ",", "ana", "##rch", "##ism", "!"]


def test_train_wordpiece_on_a_small_corpus(tmp_path, wiki_texts):
    new = data.train_wordpiece(wiki_texts, tmp_path / "vocab.txt", vocab_size=2000)
    assert 1000 < new.get_vocab_size() <= 2000
    assert data.special_ids(new)["pad"] == 0
    assert len(new.encode("the political philosophy").ids) >= 3


def test_windows_are_bounded_and_mark_word_starts(tokenizer, wiki_texts):
    windows = data.make_windows(tokenizer, wiki_texts, max_len=64)
    assert len(windows) > 50
    for w in windows:
        assert len(w.input_ids) <= 64 and len(w.input_ids) == len(w.word_starts)
        assert w.input_ids[0] == 101 and w.input_ids[-1] == 102
        assert not w.word_starts[0] and not w.word_starts[-1]
        tokens = [tokenizer.id_to_token(i) for i in w.input_ids[1:-1]]
        for token, start in zip(tokens, w.word_starts[1:-1]):
            if token.startswith("##"):
                assert not start, token          # a continuation piece never starts a word
        assert w.word_starts[1] or tokens[0].startswith("##")  # windows start on a word if they can


def test_windows_do_not_split_words_and_lose_no_tokens(tokenizer):
    text = "internationalization " * 200
    windows = data.make_windows(tokenizer, [text], max_len=16, min_tokens=1)
    pieces = tokenizer.encode("internationalization").tokens
    body = [i for w in windows for i in w.input_ids[1:-1]]
    assert body == tokenizer.encode(text).ids                 # every token, in order, exactly once
    for w in windows:
        assert len(w.input_ids[1:-1]) % len(pieces) == 0      # cut between whole words only


def test_masking_statistics_on_real_text(tokenizer, wiki_texts):
    windows = data.make_windows(tokenizer, wiki_texts, max_len=128)
    ids, attention = data.pad_batch([w.input_ids for w in windows])
    maskable = attention.bool() & (ids != 101) & (ids != 102)
    masked, labels = data.mask_tokens(ids, maskable, 30522, 103, torch.Generator().manual_seed(0))
    chosen = labels != -100
    assert not chosen[~maskable].any()                        # never [CLS], [SEP] or padding
    assert torch.equal(labels[chosen], ids[chosen])
    assert abs(chosen.sum() / maskable.sum() - 0.15) < 0.01
    to_mask = (masked == 103) & chosen
    unchanged = (masked == ids) & chosen
    assert abs(to_mask.sum() / chosen.sum() - 0.8) < 0.02
    assert abs(unchanged.sum() / chosen.sum() - 0.1) < 0.02   # (random ids rarely hit the original)
    assert torch.equal(masked[~chosen], ids[~chosen])         # tokens not chosen are untouched


def test_pad_batch():
    ids, mask = data.pad_batch([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_rank_batches_cover_each_epoch_once_without_overlap():
    n, b, world = 103, 5, 3
    per_epoch = data.batches_per_epoch(n, b, world)
    for epoch in range(2):
        seen = []
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            batches = [data.batch_indices(n, b, r, world, 0, step) for r in range(world)]
            assert all(len(x) == b for x in batches)
            seen += [i for x in batches for i in x]
        assert len(seen) == len(set(seen)) == n - n % (b * world)
    assert data.batch_indices(n, b, 1, world, 0, 7) == data.batch_indices(n, b, 1, world, 0, 7)
    assert data.batch_indices(n, b, 1, world, 0, 0) != data.batch_indices(n, b, 1, world, 0, per_epoch)
    with pytest.raises(data.DataError, match="fewer than one global batch"):
        data.batches_per_epoch(10, 5, 3)


def test_shard_covers_everything_once():
    for n in (0, 1, 7, 100):
        items = [i for r in range(3) for i in data.shard(n, r, 3)]
        assert items == list(range(n))


# ----------------------------------------------------------------------------------------------
# Readers (small fixtures, malformed lines included)
# ----------------------------------------------------------------------------------------------
def write(path, text, compress=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_pretraining_readers(tmp_path):
    jsonl = write(tmp_path / "a.jsonl.gz", '{"title": "T", "text": "one two"}\n\n{"text": "three"}\n', True)
    assert data.read_pretraining_texts(jsonl) == ["T. one two", "three"]
    plain = write(tmp_path / "b.txt", "first doc.\nstill first.\n\nsecond doc.\n")
    assert data.read_pretraining_texts(plain) == ["first doc.\nstill first.", "second doc."]
    assert len(data.read_pretraining_texts(tmp_path)) == 4                      # a folder of both
    with pytest.raises(data.DataError, match=r"c\.jsonl:2: malformed JSON"):
        data.read_pretraining_texts(write(tmp_path / "c.jsonl", '{"text": "ok"}\n{"text": "bad\n'))
    with pytest.raises(data.DataError, match=r"d\.jsonl:1: no string field \"text\""):
        data.read_pretraining_texts(write(tmp_path / "d.jsonl", '{"body": "x"}\n'))
    with pytest.raises(data.DataError, match="empty corpus"):
        data.read_pretraining_texts(write(tmp_path / "e.txt", "\n\n  \n"))
    with pytest.raises(data.DataError, match="file not found"):
        data.read_pretraining_texts(tmp_path / "missing.txt")


def test_beir_readers_and_errors(tmp_path):
    beir = tmp_path / "beir"
    write(beir / "corpus.jsonl", '{"_id": "d1", "title": "A", "text": "x"}\n{"_id": "d2", "text": "y"}\n')
    write(beir / "queries.jsonl.gz", '{"_id": "q1", "text": "what"}\n{"_id": "q2", "text": "who"}\n', True)
    write(beir / "qrels" / "test.tsv", "query-id\tcorpus-id\tscore\nq1\td2\t2\n")
    corpus, queries, qrels = data.load_beir(beir, "test")
    assert corpus == {"d1": {"title": "A", "text": "x"}, "d2": {"title": "", "text": "y"}}
    assert queries == {"q1": "what"} and qrels == {"q1": {"d2": 2}}
    write(beir / "qrels" / "bad.tsv", "query-id\tcorpus-id\tscore\nq1\td9\t1\n")
    with pytest.raises(data.DataError, match="'d9'.*not in the corpus"):
        data.load_beir(beir, "bad")
    write(beir / "qrels" / "badq.tsv", "q7\td1\t1\n")
    with pytest.raises(data.DataError, match="'q7' is not in the queries"):
        data.load_beir(beir, "badq")
    write(beir / "qrels" / "short.tsv", "query-id\tcorpus-id\tscore\nq1\td1\n")
    with pytest.raises(data.DataError, match=r"short\.tsv:2: expected"):
        data.load_beir(beir, "short")
    write(beir / "qrels" / "nan.tsv", "q1 0 d1 high\n")
    with pytest.raises(data.DataError, match=r"nan\.tsv:1: relevance grade 'high'"):
        data.load_beir(beir, "nan")
    with pytest.raises(data.DataError, match=r"corpus\.jsonl:1: a corpus line needs"):
        data.read_corpus(write(tmp_path / "c2" / "corpus.jsonl", '{"id": "d1", "text": "x"}\n'))
    with pytest.raises(data.DataError, match="dev.tsv: file not found"):
        data.load_beir(beir, "dev")


def test_msmarco_and_trec_readers(tmp_path):
    collection = write(tmp_path / "collection.tsv", "0\tthe first passage\n1\tthe second\n")
    assert data.read_corpus(collection)["1"] == {"title": "", "text": "the second"}
    queries = write(tmp_path / "queries.dev.tsv", "42\twhat is it\n")
    assert data.read_queries(queries) == {"42": "what is it"}
    qrels = write(tmp_path / "qrels.dev.tsv", "42 0 1 1\n42 0 0 0\n")
    assert data.read_qrels(qrels) == {"42": {"1": 1, "0": 0}}
    with pytest.raises(data.DataError, match=r"bad\.tsv:2: expected 2 tab-separated fields, found 1"):
        data.read_corpus(write(tmp_path / "bad.tsv", "0\tok\nbroken line\n"))


def test_run_files_round_trip_atomically(tmp_path):
    run = {"q1": {"d1": 0.5, "d2": 1.5}, "q2": {"d3": -1.0}}
    path = tmp_path / "run.trec"
    data.write_run(path, run, tag="test")
    lines = path.read_text().splitlines()
    assert lines[0] == "q1 Q0 d2 1 1.500000 test" and lines[1] == "q1 Q0 d1 2 0.500000 test"
    assert data.read_run(path) == run
    assert [p.name for p in tmp_path.iterdir()] == ["run.trec"]               # no temporary left over
    with pytest.raises(data.DataError, match=r"bad\.trec:1: expected 6 fields"):
        data.read_run(write(tmp_path / "bad.trec", "q1 Q0 d1 1 0.5\n"))


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "state.pt"
    data.atomic_torch_save(path, {"step": 1})

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        data.atomic_torch_save(path, {"step": 2, "bad": Unpicklable()})
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


# ----------------------------------------------------------------------------------------------
# The shared encoder against transformers' BERT, and the Hugging Face folder
# ----------------------------------------------------------------------------------------------
def random_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 30000, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_encoder_equals_transformers_bert(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_size=128)
    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(config).eval()   # transformers' own random init
    reference.save_pretrained(tmp_path)
    ours = costa.Encoder.from_pretrained(tmp_path).eval()
    assert (ours.config.hidden_size, ours.config.num_layers, ours.config.num_heads) == (64, 3, 4)
    ids, mask = random_inputs()
    with torch.no_grad():
        theirs = reference.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        mine = ours(ids, mask)
        real = mask.bool()
        assert (mine - theirs)[real].abs().max() <= 1e-5
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.3] = -100
        labels[mask == 0] = -100
        mlm, _, n = ours.mlm_loss(mine, labels)
        assert n > 0 and abs(mlm - reference(input_ids=ids, attention_mask=mask, labels=labels).loss) < 1e-5


def test_hf_folder_round_trip_and_bin_checkpoints(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = costa.Encoder(tiny_config(dropout=0.0)).eval()
    ours.save_pretrained(tmp_path / "enc")
    assert {p.name for p in (tmp_path / "enc").iterdir()} == {
        "config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json"}
    hf = transformers.AutoModel.from_pretrained(tmp_path / "enc").eval()
    ids, mask = random_inputs()
    with torch.no_grad():
        expected = ours(ids, mask)
        assert (hf(input_ids=ids, attention_mask=mask).last_hidden_state - expected)[mask.bool()].abs().max() < 1e-5
        back = costa.Encoder.from_pretrained(tmp_path / "enc").eval()
        assert torch.equal(back(ids, mask), expected)
        assert torch.equal(back.mlm_head.bias, ours.mlm_head.bias)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "enc")
    assert tok("Hello world")["input_ids"] == [101, 7592, 2088, 102]
    # An old-style folder: pytorch_model.bin, 'bert.' prefix, LayerNorm gamma/beta, a pooler to ignore.
    old = tmp_path / "old"
    old.mkdir()
    state = {costa.to_hf_name(k).replace("LayerNorm.weight", "LayerNorm.gamma")
             .replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in ours.state_dict().items()}
    state["bert.pooler.dense.weight"] = torch.zeros(32, 32)
    torch.save(state, old / "pytorch_model.bin")
    (old / "config.json").write_text((tmp_path / "enc" / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(costa.Encoder.from_pretrained(old).eval()(ids, mask), expected)


def test_checkpoint_errors_name_the_problem(tmp_path):
    ours = costa.Encoder(tiny_config())
    ours.save_pretrained(tmp_path / "enc")
    with pytest.raises(data.DataError, match="not a Hugging Face model folder"):
        costa.Encoder.from_pretrained(tmp_path)
    (tmp_path / "enc" / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    with pytest.raises(data.DataError, match="vocab.txt: 2 entries, but config.json says vocab_size 30522"):
        costa.Encoder.from_pretrained(tmp_path / "enc")
    bad = {costa.to_hf_name(k): v for k, v in ours.state_dict().items()}
    bad["bert.encoder.layer.0.attention.self.query.weight"] = torch.zeros(8, 8)
    data.save_encoder_folder(tmp_path / "bad", bad, ours.hf_config())
    with pytest.raises(data.DataError, match=r"attention\.self\.query\.weight has shape \(8, 8\)"):
        costa.Encoder.from_pretrained(tmp_path / "bad")


# ----------------------------------------------------------------------------------------------
# Config and command line
# ----------------------------------------------------------------------------------------------
def test_config_overrides_by_field_name():
    c = costa.parse_config(["--lr", "1e-4", "--steps", "7", "--resume", "--bf16", "false"])
    assert (c.lr, c.steps, c.resume, c.bf16) == (1e-4, 7, True, False)
    paper = costa.parse_config(["--preset", "paper", "--num_layers", "2"])
    assert (paper.hidden_size, paper.num_layers, paper.max_len) == (768, 2, 512)
    with pytest.raises(SystemExit, match="unknown argument '--learning_rate'"):
        costa.parse_config(["--learning_rate", "1"])
    with pytest.raises(SystemExit, match="--steps expects int"):
        costa.parse_config(["--steps", "many"])


# ----------------------------------------------------------------------------------------------
# Training runs: one process, torchrun with 2 processes, resume
# ----------------------------------------------------------------------------------------------
TINY_ARGS = ["--hidden_size", "32", "--num_layers", "2", "--num_heads", "2", "--ffn_size", "64",
             "--max_len", "64", "--batch_size", "4", "--log_every", "1"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few real Wikipedia articles and snippets of mixed length (so batches pad differently on
    each rank): enough windows for the runs below, fast to tokenize."""
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    articles = data.read_pretraining_texts(data.WIKI)[:8]
    texts = articles[:5] + [" ".join(a.split()[:n]) for a in articles[5:] for n in (6, 15, 30, 45)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run_script(args, cwd, torchrun=False, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
           if torchrun else [PY]) + args
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, **kw)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def read_log(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def test_resume_continues_exactly(tmp_path, small_corpus):
    script = str(HERE / "costa.py")
    common = [script, "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "6"]
    run_script(common + ["--out_dir", str(tmp_path / "straight")], tmp_path)
    run_script(common + ["--out_dir", str(tmp_path / "resumed"), "--halt_at", "3"], tmp_path)
    assert len(read_log(tmp_path / "resumed")) == 3
    out = run_script(common + ["--out_dir", str(tmp_path / "resumed"), "--resume"], tmp_path)
    assert "resume:" in out and "at step 3" in out
    straight, resumed = read_log(tmp_path / "straight"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["mlm"] for r in straight] == [r["mlm"] for r in resumed]        # bit-identical losses
    assert (tmp_path / "straight" / "encoder" / "model.safetensors").is_file()
    saved = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert saved["steps"] == 6 and saved["hidden_size"] == 32


def test_resume_continues_exactly_with_two_processes(tmp_path, small_corpus):
    common = [str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "4"]
    run_script(common + ["--out_dir", str(tmp_path / "straight")], tmp_path, torchrun=True)
    run_script(common + ["--out_dir", str(tmp_path / "resumed"), "--halt_at", "2"], tmp_path, torchrun=True)
    run_script(common + ["--out_dir", str(tmp_path / "resumed"), "--resume"], tmp_path, torchrun=True)
    straight, resumed = read_log(tmp_path / "straight"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("mlm", "gwc", "gwc_acc"):
        assert [r[key] for r in straight] == [r[key] for r in resumed], key


def test_torchrun_two_processes_on_cpu(tmp_path, small_corpus):
    out = run_script([str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2",
                      "--out_dir", str(tmp_path / "ddp")], tmp_path, torchrun=True)
    assert "2 process(es)" in out and "done:" in out
    assert [r["step"] for r in read_log(tmp_path / "ddp")] == [1, 2]
    assert costa.Encoder.from_pretrained(tmp_path / "ddp" / "encoder").config.hidden_size == 32


def test_bad_input_gives_one_line_error(tmp_path):
    bad = write(tmp_path / "bad.jsonl", '{"text": "fine"}\n{oops}\n')
    result = subprocess.run([PY, str(HERE / "costa.py"), "--corpus", str(bad), "--out_dir", str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: {bad}:2: malformed JSON (Expecting property name enclosed in double quotes)"


# ----------------------------------------------------------------------------------------------
# The shared blocks are byte-identical in every file that carries them
# ----------------------------------------------------------------------------------------------
SHARED = re.compile(r"^# --- shared: begin (.+?) ---$(.*?)^# --- shared: end \1 ---$", re.M | re.S)
CARRIERS = ["costa.py", "cpdae.py", "seed.py", "finetune.py"]


def shared_blocks(name):
    return dict(SHARED.findall((HERE / name).read_text()))


def test_shared_blocks_are_identical_across_files():
    reference = shared_blocks("costa.py")
    assert set(reference) >= {"config parsing", "encoder", "distributed"}
    carriers = [name for name in CARRIERS if (HERE / name).exists()]
    assert carriers == CARRIERS, f"missing method files: {set(CARRIERS) - set(carriers)}"
    for name in carriers[1:]:
        blocks = shared_blocks(name)
        for block in ("config parsing", "encoder", "distributed"):
            assert blocks.get(block) == reference[block], f"{name}: shared block '{block}' differs from costa.py"
        for block, text in blocks.items():
            assert text == reference.get(block), f"{name}: shared block '{block}' differs from costa.py"
