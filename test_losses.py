"""Each loss against its paper's equation, written term by term; 2-process runs against one process.

    pytest -q test_losses.py

Sections: COSTA (arXiv:2204.10641 eq. 1-10), CPDAE (arXiv:2208.09846 eq. 3-6), SEED-Encoder
(arXiv:2102.09206 3.4, eq. 9-10). Naive references are plain Python loops over the equations'
indices, in float64 where the comparison is numerical.
"""
import ast
import dataclasses
import importlib
import inspect
import itertools
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import costa
import cpdae
import data
import run
import seed

ROOT = Path(__file__).resolve().parent

torch.set_num_threads(1)


# ==============================================================================================
# COSTA: span sampling (eq. 1-3), span vectors (eq. 7), group-wise contrastive loss (eq. 8)
# ==============================================================================================
def span_config(**changes):
    fields = dict(span_T=5, granularities="word,phrase,sentence,paragraph", span_alpha=4.0, span_beta=2.0)
    return SimpleNamespace(**{**fields, **changes})


# ---------------------------------------------------------------- eq. 8, written term by term
def naive_gwc(text, spans, tau):
    """L = mean_i -1/S sum_{p in S(i)} log exp(z_i.z_p/tau) / sum_{j != i} exp(z_i.z_j/tau), j over all N(S+1)."""
    N, S, _ = spans.shape
    vectors = [text[j] for j in range(N)] + [spans[j, k] for j in range(N) for k in range(S)]
    total = 0.0
    for i in range(N):
        denominator = 0.0
        for j, z_j in enumerate(vectors):
            if j != i:  # 1[i != j]: only z_i itself is left out
                denominator = denominator + torch.exp(text[i] @ z_j / tau)
        for p in range(S):
            total = total - torch.log(torch.exp(text[i] @ spans[i, p] / tau) / denominator) / S
    return total / N


def random_group(N=4, S=3, H=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, generator=g, dtype=dtype), torch.randn(N, S, H, generator=g, dtype=dtype)


def test_gwc_loss_matches_naive_loop_value_and_gradient():
    text, spans = random_group()
    text.requires_grad_(True)
    spans.requires_grad_(True)
    for tau in (0.1, 1.0):
        fast, naive = costa.gwc_loss(text, spans, tau)[0], naive_gwc(text, spans, tau)
        assert fast.dtype == torch.float64
        torch.testing.assert_close(fast, naive, rtol=1e-10, atol=1e-10)
        for a, b in zip(torch.autograd.grad(fast, (text, spans)), torch.autograd.grad(naive, (text, spans))):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_gwc_loss_spans_equal_to_their_text_has_analytic_value():
    # z_i = sqrt(c) e_i (orthogonal texts, |z_i|^2 = c) and each of the S spans of text i equals z_i. For anchor i:
    # numerator e^{c/tau}; denominator (z_i left out): its own S spans S e^{c/tau}, plus, for each of the N-1
    # other texts, the text and its S spans, all orthogonal to z_i: (N-1)(S+1) e^0. So every positive gives
    # -log(e^{c/tau} / (S e^{c/tau} + (N-1)(S+1))) = log(S + (N-1)(S+1) e^{-c/tau}), and so does the mean.
    N, S, c, tau = 4, 3, 0.5, 0.25
    text = math.sqrt(c) * torch.eye(N, 6, dtype=torch.float64)
    spans = text[:, None, :].expand(N, S, 6)
    expected = math.log(S + (N - 1) * (S + 1) * math.exp(-c / tau))
    assert costa.gwc_loss(text, spans, tau)[0].item() == pytest.approx(expected, rel=1e-12)


def test_gwc_loss_ignores_batch_order():
    text, spans = random_group(N=6)
    order = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(costa.gwc_loss(text[order], spans[order], 0.1)[0], costa.gwc_loss(text, spans, 0.1)[0])


def test_gwc_loss_leaves_the_anchor_out_of_its_own_denominator():
    # Scaling z_0 up makes z_0.z_0 huge; if it were in the denominator the loss would jump. Compare to the loop.
    text, spans = random_group()
    text[0] *= 30.0
    torch.testing.assert_close(costa.gwc_loss(text, spans, 1.0)[0], naive_gwc(text, spans, 1.0), rtol=1e-10, atol=1e-10)


def test_gwc_accuracy_counts_anchors_whose_best_candidate_is_an_own_span():
    text = torch.eye(3, 4, dtype=torch.float64)  # text i = e_i; every text scores 0 against the other texts
    spans = torch.zeros(3, 2, 4, dtype=torch.float64)
    spans[0, 0, 0] = 2.0  # anchor 0: best is its own span (2.0) -> right
    spans[2, 1, 1] = 0.5  # anchor 1: best is a span of text 2 (0.5), its own spans score 0 -> wrong
    spans[1, 0, 2] = 2.0  # anchor 2: best is a span of text 1 (2.0) -> wrong
    _, accuracy = costa.gwc_loss(text, spans, 1.0)
    assert accuracy.item() == pytest.approx(1 / 3)


def _gwc_worker(rank, world, tmp_path, text, spans, tau):
    n = text.shape[0] // world
    local_text = text[rank * n:(rank + 1) * n].clone().requires_grad_(True)  # different inputs on each rank
    local_spans = spans[rank * n:(rank + 1) * n].clone().requires_grad_(True)
    gwc_loss = run.across_ranks(costa.gwc_loss, costa.gather_across_ranks)     # as costa.train() wraps it
    loss, accuracy = gwc_loss(local_text, local_spans, tau)
    loss.backward()
    torch.save({"loss": loss.detach(), "accuracy": accuracy, "text_grad": local_text.grad,
                "span_grad": local_spans.grad}, tmp_path / f"rank{rank}.pt")


def test_gwc_loss_two_processes_equal_one_process_with_both_halves(tmp_path, run_on_two_ranks):
    text, spans = random_group(N=6, S=4, H=8, dtype=torch.float64)
    results = run_on_two_ranks(_gwc_worker, tmp_path, text, spans, 0.1)
    text.requires_grad_(True)
    spans.requires_grad_(True)
    loss, accuracy = costa.gwc_loss(text, spans, 0.1)
    text_grad, span_grad = torch.autograd.grad(loss, (text, spans))
    torch.testing.assert_close((results[0]["loss"] + results[1]["loss"]) / 2, loss.detach())
    torch.testing.assert_close((results[0]["accuracy"] + results[1]["accuracy"]) / 2, accuracy)
    # all_gather's backward sums the gradient of every rank's loss: each rank sees 2 x the single-process grad.
    torch.testing.assert_close(torch.cat([r["text_grad"] for r in results]), 2 * text_grad)
    torch.testing.assert_close(torch.cat([r["span_grad"] for r in results]), 2 * span_grad)


# ---------------------------------------------------------------- eq. 7 and the projector
def test_span_vectors_are_means_over_the_span():
    hidden = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(0))
    spans = torch.tensor([[[1, 2], [1, 6], [3, 5]], [[2, 4], [5, 6], [1, 3]]])
    out = costa.span_vectors(hidden, spans)
    assert out.shape == (2, 3, 3)
    for b in range(2):
        for s in range(3):
            start, end = spans[b, s].tolist()
            torch.testing.assert_close(out[b, s], hidden[b, start:end].mean(dim=0))


def test_projector_kinds():
    h0 = torch.randn(4, 8)
    nonlinear, linear, none = (costa.Projector(8, kind) for kind in ("nonlinear", "linear", "none"))
    layer = nonlinear.net[0]
    torch.testing.assert_close(nonlinear(h0), torch.tanh(h0 @ layer.weight.T + layer.bias))
    torch.testing.assert_close(linear(h0), h0 @ linear.net.weight.T + linear.net.bias)
    assert torch.equal(none(h0), h0) and not list(none.parameters())
    with pytest.raises(ValueError):
        costa.Projector(8, "mlp")


# ---------------------------------------------------------------- span sampling (eq. 1-3)
def body_of(n_tokens, n_pad=0):
    """word_starts for [CLS] w ... w [SEP] [PAD]...: every body token a one-piece word."""
    return [False] + [True] * (n_tokens - 2) + [False] * (1 + n_pad)


def test_spans_have_fixed_count_lengths_in_range_and_stay_inside_the_body():
    rng = np.random.default_rng(0)
    n_tokens = 300  # longer than every l_max, so nothing is clipped
    spans = costa.sample_spans(body_of(n_tokens, n_pad=20), n_tokens, span_config(), rng)
    assert len(spans) == 20
    limits = [(1, 1)] * 5 + [costa.SPAN_LENGTHS[g] for g in ("phrase", "sentence", "paragraph") for _ in range(5)]
    for (start, end), (l_min, l_max) in zip(spans, limits):
        assert 1 <= start < end <= n_tokens - 1  # never [CLS] (0), [SEP] (n-1) or padding (>= n)
        assert l_min <= end - start <= l_max


def test_dropping_a_granularity_and_changing_T():
    spans = costa.sample_spans(body_of(200), 200, span_config(span_T=4, granularities="word,phrase,sentence"),
                         np.random.default_rng(0))
    assert len(spans) == 12 and max(e - s for s, e in spans) <= 64
    with pytest.raises(ValueError):
        costa.sample_spans(body_of(200), 200, span_config(granularities="word,clause"), np.random.default_rng(0))


def test_span_lengths_follow_beta_4_2():
    rng = np.random.default_rng(1)
    config = span_config(span_T=1000, granularities="paragraph")
    relative = []
    for _ in range(5):  # 5,000 draws
        relative += [(e - s - 64) / (128 - 64) for s, e in costa.sample_spans(body_of(400), 400, config, rng)]
    mean = float(np.mean(relative))
    assert abs(mean - 4 / 6) < 0.02 and mean > 0.6  # Beta(4, 2) mean 2/3: skewed towards long spans
    starts = [s for s, e in costa.sample_spans(body_of(400), 400, config, rng)]
    assert min(starts) == 1  # the first body token can start a span


def test_short_text_clips_spans_to_the_body():
    rng = np.random.default_rng(0)
    for n_tokens in (3, 4, 10, 40, 100):
        for start, end in costa.sample_spans(body_of(n_tokens), n_tokens, span_config(), rng):
            assert 1 <= start < end <= n_tokens - 1
    spans = costa.sample_spans(body_of(10), 10, span_config(granularities="sentence,paragraph"), rng)
    assert spans == [(1, 9)] * 10  # 8 body tokens < 16: every span is the whole body
    with pytest.raises(ValueError):
        costa.sample_spans([False, False], 2, span_config(), rng)


@pytest.fixture(scope="module")
def vocab_tokens(tokenizer):
    return [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]


def tokenize(text, tokenizer, vocab_tokens):
    """One window of real text through the project's data path; returns (ids, tokens, word_starts, skip mask)."""
    (window,) = data.make_windows(tokenizer, [text], max_len=64)
    mask = data.skip_word_mask(window.input_ids, window.word_starts, vocab_tokens)
    return window.input_ids, [vocab_tokens[i] for i in window.input_ids], window.word_starts, mask


def test_word_spans_are_whole_non_stopwords_on_real_tokenization(tokenizer, vocab_tokens):
    ids, tokens, word_starts, mask = tokenize("The hippopotamus is swimming in an unfathomably deep river, "
                                              "and nobody noticed it.", tokenizer, vocab_tokens)
    spans = costa.sample_spans(word_starts, len(ids), span_config(span_T=200, granularities="word"), np.random.default_rng(0),
                         stopword_mask=mask)
    words = set()
    for start, end in spans:
        assert word_starts[start] and (end == len(ids) - 1 or word_starts[end])  # whole word, from start to next
        assert all(t.startswith("##") for t in tokens[start + 1:end])
        words.add(tokens[start] + "".join(t[2:] for t in tokens[start + 1:end]))
    assert words <= {"hippopotamus", "swimming", "unfathomably", "deep", "river", "noticed"}
    assert {"hippopotamus", "unfathomably"} <= words  # multi-piece words are sampled whole
    assert not words & {"the", "is", "in", "an", "and", "nobody", "it", ",", "."}


def test_multi_piece_stopwords_are_masked(tokenizer, vocab_tokens):
    _ids, tokens, _word_starts, mask = tokenize("hereafter cats", tokenizer, vocab_tokens)
    assert len(tokens) > 4  # "hereafter" is more than one piece in BERT's vocabulary
    assert mask[1] and not mask[tokens.index("cats")]


def test_all_stopword_text_falls_back_to_any_whole_word(tokenizer, vocab_tokens):
    ids, _tokens, word_starts, mask = tokenize("it is what it is", tokenizer, vocab_tokens)
    assert all(mask[i] for i in range(1, len(ids) - 1))
    spans = costa.sample_spans(word_starts, len(ids), span_config(span_T=50, granularities="word"), np.random.default_rng(0),
                         stopword_mask=mask)
    assert len(spans) == 50 and set(spans) == {(i, i + 1) for i in range(1, len(ids) - 1)}


def _loop_skip_word_mask(input_ids, word_starts, vocab_tokens):
    """data.skip_word_mask as it was first written, a Python loop over the words: the reference."""
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS
    mask = [False] * len(input_ids)
    starts = [i for i, start in enumerate(word_starts) if start] + [len(input_ids)]
    for start, end in itertools.pairwise(starts):
        pieces = [vocab_tokens[t] for t in input_ids[start:end]]
        word = pieces[0] + "".join(p[2:] for p in pieces[1:] if p.startswith("##"))
        mask[start] = word in ENGLISH_STOP_WORDS or not any(ch.isalnum() for ch in word)
    return mask


def _loop_sample_spans(word_starts, n_tokens, config, rng, stopword_mask=None):
    """costa.sample_spans with the first word_spans (lists of tuples): the reference of the draws."""
    sep = n_tokens - 1
    starts = [i for i in range(1, sep) if word_starts[i]]
    words = list(zip(starts, starts[1:] + [sep]))
    content = [w for w in words if stopword_mask is None or not stopword_mask[w[0]]]
    words, spans = content or words or [(1, sep)], []
    for name in costa.parse_granularities(config.granularities):
        if name == "word":
            spans += [words[k] for k in rng.integers(len(words), size=config.span_T)]
            continue
        l_min, l_max = costa.SPAN_LENGTHS[name]
        p = rng.beta(config.span_alpha, config.span_beta, size=config.span_T)
        lengths = np.minimum(np.rint(l_min + p * (l_max - l_min)).astype(int), n_tokens - 2)
        starts = rng.integers(1, n_tokens - lengths)
        spans += list(zip(starts, starts + lengths))
    return [(int(start), int(end)) for start, end in spans]


def test_span_sampling_draws_exactly_what_the_python_loops_drew(tokenizer, vocab_tokens):
    """The vectorised word tables and word spans give the loops' masks and the same spans from the same seed, on
    real windows of 512 and 128 tokens (COSTA's batches, and README command 1, bit for bit). Seen failing with
    a multi-piece word decided by its first piece alone ("in" + "##fin" + "##itive" taken for the stopword)."""
    texts, tables = data.read_pretraining_texts(data.WIKI)[:12], data.word_tables(vocab_tokens)
    config = span_config(granularities="word,phrase,sentence,paragraph")
    for max_len in (512, 128):
        for k, w in enumerate(data.make_windows(tokenizer, texts, max_len=max_len)):
            ids, starts = np.asarray(w.input_ids), np.asarray(w.word_starts, dtype=bool)
            mask = data.skip_word_mask(ids, starts, vocab_tokens, tables)
            assert mask.tolist() == _loop_skip_word_mask(w.input_ids, w.word_starts, vocab_tokens), (max_len, k)
            assert (costa.sample_spans(starts, len(ids), config, np.random.default_rng([0, k]), mask) ==
                    _loop_sample_spans(w.word_starts, len(ids), config, np.random.default_rng([0, k]), mask))


def test_window_starting_inside_a_word_skips_the_leading_fragment():
    # [CLS] ##ing ##ly cat ##s run [SEP]: the "##" run belongs to a word cut by the previous window.
    word_starts = [False, False, False, True, False, True, False]
    spans = costa.sample_spans(word_starts, 7, span_config(span_T=50, granularities="word"), np.random.default_rng(0))
    assert set(spans) == {(3, 5), (5, 6)}
    # the whole window is a fragment: it is the only "word" there is
    spans = costa.sample_spans([False, False, False, False], 4, span_config(granularities="word"), np.random.default_rng(0))
    assert spans == [(1, 3)] * 5


# ---------------------------------------------------------------- the pieces together: batches and the model
def tiny_costa_config(**changes):
    fields = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_len=64, batch_size=4, steps=3,
                  dropout=0.0, span_T=2)
    return costa.Config(**{**fields, **changes})


@pytest.fixture(scope="module")
def windows(tokenizer):
    return data.make_windows(tokenizer, data.read_pretraining_texts(data.WIKI)[:2], max_len=64)


def test_batches_carry_spans_inside_each_window(windows, tokenizer, vocab_tokens):
    c = tiny_costa_config()
    batches = costa.Batches(c, windows, 0, 1)
    batch = batches[1]
    B, _L = batch["input_ids"].shape
    assert batch["spans"].shape == (B, 4 * c.span_T, 2) and batch["spans"].dtype == torch.long
    lengths = batch["attention_mask"].sum(dim=1, keepdim=True)  # (B, 1) real tokens incl. [CLS]/[SEP]
    start, end = batch["spans"][..., 0], batch["spans"][..., 1]
    assert (start >= 1).all() and (start < end).all() and (end <= lengths - 1).all()
    assert torch.equal(batches[1]["spans"], batch["spans"])  # a function of (seed, rank, step): resumable
    assert not torch.equal(batches[2]["spans"], batch["spans"])
    baseline = costa.Batches(tiny_costa_config(gwc_weight=0.0), windows, 0, 1)
    assert "spans" not in baseline[1]


def test_spans_are_sampled_once_per_window_unless_resampled(windows, tokenizer, vocab_tokens):
    """Algorithm 1 samples each text's 4T spans once, before training, and reuses them every epoch."""
    few = windows[:4]

    def spans_by_window(c, micro_step):
        rows = data.batch_indices(len(few), c.batch_size, 0, 1, c.seed, micro_step)
        spans = costa.Batches(c, few, 0, 1)[micro_step]["spans"]
        return {int(r): s for r, s in zip(rows, spans)}

    once = tiny_costa_config(batch_size=4)
    a, b = spans_by_window(once, 0), spans_by_window(once, 2)            # every window in both batches
    assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a)
    redraw = tiny_costa_config(batch_size=4, span_resample=True)
    a, b = spans_by_window(redraw, 0), spans_by_window(redraw, 2)
    assert not all(torch.equal(a[i], b[i]) for i in a)


def test_model_total_loss_is_lambda_gwc_plus_mlm(windows, tokenizer, vocab_tokens):
    torch.manual_seed(0)
    c = tiny_costa_config(gwc_weight=0.5, tau=1.0)
    batch = costa.Batches(c, windows, 0, 1)[0]
    model = costa.PretrainModel(c, costa.Encoder(c)).eval()
    total, metrics = model(batch)
    assert set(metrics) == {"mlm", "mlm_acc", "mlm_chance", "gwc", "gwc_acc", "gwc_chance"}
    torch.testing.assert_close(total, 0.5 * metrics["gwc"] + metrics["mlm"])
    hidden = model.encoder(batch["input_ids"], batch["attention_mask"])
    text_vecs = torch.tanh(model.projector.net[0](hidden[:, 0]))  # eq. 5-6
    spans = torch.stack([torch.stack([hidden[b, s:e].mean(dim=0) for s, e in row.tolist()])
                         for b, row in enumerate(batch["spans"])])  # eq. 7, one span at a time
    torch.testing.assert_close(metrics["gwc"], costa.gwc_loss(text_vecs, spans, 1.0)[0])
    baseline = costa.PretrainModel(tiny_costa_config(gwc_weight=0.0), model.encoder)
    loss, metrics = baseline(batch)
    assert baseline.projector is None and set(metrics) == {"mlm", "mlm_acc", "mlm_chance"}
    torch.testing.assert_close(loss, metrics["mlm"])  # gwc_weight 0: the MLM-only baseline


def test_gwc_logits_stay_fp32_under_bf16_autocast():
    # autocast runs a matmul in bf16 even on .float() inputs; with tau = 0.1 that error is visible in the loss
    text, spans = random_group(N=8, S=5, H=64, dtype=torch.float32)
    text, spans = 3 * text, 3 * spans
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = run.in_fp32(costa.gwc_loss)(text, spans, 0.1)[0]                # as costa.train() wraps it
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, costa.gwc_loss(text, spans, 0.1)[0], rtol=1e-6, atol=1e-6)


# ==============================================================================================
# CPDAE: reconstruction (eq. 3-4), Jensen-Shannon contrastive loss (eq. 5), total (eq. 6)
# ==============================================================================================


# ----------------------------------------------------------------------------- plain references
def js_loop(p, q):
    """JS(P, Q) = 1/2 KL(P||M) + 1/2 KL(Q||M), M = (P+Q)/2, one word at a time, in float64."""
    total = 0.0
    for px, qx in zip(p.double().tolist(), q.double().tolist()):
        mx = (px + qx) / 2
        if px > 0:
            total += 0.5 * px * math.log(px / mx)
        if qx > 0:
            total += 0.5 * qx * math.log(qx / mx)
    return total


def random_distributions(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(n, v, generator=g), dim=-1)


# ----------------------------------------------------------------------------- decoder, targets, IDF
def test_decoder_is_linear_gelu_layernorm_linear():
    dec = cpdae.Decoder(hidden_size=16, vocab_size=50)
    assert [type(m) for m in dec.children()] == [nn.Linear, nn.LayerNorm, nn.Linear]
    h = torch.randn(3, 16)
    expected = dec.out(dec.norm(torch.nn.functional.gelu(dec.dense(h))))
    assert dec(h).shape == (3, 50)
    torch.testing.assert_close(dec(h), expected)


def test_bag_of_words_marks_words_of_the_original_text_only():
    ids = torch.tensor([[101, 2023, 2003, 2023, 102, 0], [101, 103, 100, 7592, 102, 0]])
    bag = cpdae.bag_of_words(ids, 30522, special_ids=(0, 100, 101, 102, 103))
    assert bag.shape == (2, 30522)
    assert bag[0].nonzero().flatten().tolist() == [2003, 2023]  # duplicates once, [CLS]/[SEP]/[PAD] out
    assert bag[1].nonzero().flatten().tolist() == [7592]  # [MASK] and [UNK] out


def compute_idf(texts, vocab_size):
    """IDF of in-memory texts (token-id lists or Windows): cpdae's document_frequency and idf_from_df
    without the token cache (training runs cpdae.cached_idf over the cache)."""
    windows = len(texts) > 0 and isinstance(texts[0], tuple)                    # Window = (input_ids, word_starts)
    id_lists = [text[0] for text in texts] if windows else texts
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))    # (N,)
    ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)])                                  # (N + 1,)
    return cpdae.idf_from_df(cpdae.document_frequency(ids, offsets, vocab_size), len(id_lists))


def _idf_by_python_loop(texts, vocab_size):
    """compute_idf as it was before np.bincount: one torch.unique per window (the reference)."""
    df = torch.zeros(vocab_size, dtype=torch.float64)
    for text in texts:
        ids = text[0] if isinstance(text, tuple) else text
        df[torch.unique(torch.as_tensor(ids, dtype=torch.long))] += 1.0
    return (torch.log((len(texts) + 1.0) / (df + 1.0)) + 1.0).float()


def test_compute_idf_equals_the_per_window_loop_on_real_text(tokenizer):
    windows = data.make_windows(tokenizer, data.read_pretraining_texts(data.WIKI)[:60], max_len=128)
    assert len(windows) > 200
    idf = compute_idf(windows, 30522)
    assert torch.equal(idf, _idf_by_python_loop(windows, 30522))
    assert len(set(idf.tolist())) > 20                                         # not a constant vector
    assert torch.equal(compute_idf([], 7), _idf_by_python_loop([], 7))  # no windows: all ones


def test_compute_idf_formula_on_windows_and_id_lists():
    texts = [[5, 6, 6], [5, 7], [5, 8, 9], [9]]
    idf = compute_idf(texts, vocab_size=12)
    n = len(texts)
    for j in range(12):
        df = sum(j in t for t in texts)
        assert abs(idf[j].item() - (math.log((n + 1) / (df + 1)) + 1)) < 1e-6
    windows = [(t, [True] * len(t)) for t in texts]  # Window = (input_ids, word_starts)
    torch.testing.assert_close(compute_idf(windows, 12), idf)
    assert idf[5] < idf[9] < idf[7] < idf[0]  # rarer words weigh more


# ----------------------------------------------------------------------------- Jensen-Shannon
def test_js_is_symmetric_zero_on_identical_and_log2_on_disjoint():
    p = random_distributions(5, 40, seed=0)
    q = random_distributions(4, 40, seed=1)
    torch.testing.assert_close(cpdae.js_divergence(p, q), cpdae.js_divergence(q, p).T)
    assert cpdae.js_divergence(p, p).diagonal().abs().max() < 1e-6
    disjoint_a = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    disjoint_b = torch.tensor([[0.0, 0.0, 0.3, 0.7]])
    assert abs(cpdae.js_divergence(disjoint_a, disjoint_b).item() - math.log(2)) < 1e-6


def test_js_equals_float64_loop_on_random_distributions():
    p = random_distributions(3, 30, seed=2)
    q = random_distributions(4, 30, seed=3)
    q[0, :10] = 0.0  # exact zeros: 0 log 0 = 0
    q = q / q.sum(-1, keepdim=True)
    got = -run.speed.in_row_chunks(cpdae.js_similarity, 2)(p, q)                 # eager training's form
    for a in range(3):
        for b in range(4):
            assert abs(got[a, b].item() - js_loop(p[a], q[b])) < 1e-6


def test_chunked_pairwise_js_equals_naive_values_and_gradients():
    m, v = 6, 300
    logits = torch.randn(2 * m, v, requires_grad=True)
    weights = torch.randn(2 * m, 2 * m)

    def naive(z):  # the whole (2m, 2m, V) tensor at once
        pq = cpdae.word_distribution(z)
        mix = 0.5 * (pq[:, None, :] + pq[None, :, :])
        kl = lambda a, b: (torch.xlogy(a, a) - torch.xlogy(a, b)).sum(-1)
        return 0.5 * kl(pq[:, None, :], mix) + 0.5 * kl(pq[None, :, :], mix)

    ref = naive(logits)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    for chunk in (0, 1, 5, 12, 64):                                     # 0: js_similarity in one piece
        dist = cpdae.word_distribution(logits)
        got = -(run.speed.in_row_chunks(cpdae.js_similarity, chunk) if chunk else cpdae.js_similarity)(dist, dist)
        (grad,) = torch.autograd.grad((got * weights).sum(), logits)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------- reconstruction (eq. 3-4)
def reconstruction_loop(logits, bag, idf=None):
    """Eq. 4 with the typo fixed: -sum_j w_j [y log z_hat + (1 - y) log(1 - z_hat)], mean over texts."""
    n, v = logits.shape
    total = 0.0
    for i in range(n):
        for j in range(v):
            z_hat = torch.sigmoid(logits[i, j].double())
            y = bag[i, j].double()
            w = 1.0 if idf is None else idf[j].double()
            total = total - w * (y * torch.log(z_hat) + (1 - y) * torch.log(1 - z_hat))
    return total / n


def test_reconstruction_equals_eq4_loop_with_gradient():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 20, generator=g)).requires_grad_()
    bag = (torch.rand(3, 20, generator=g) < 0.3).float()
    for idf in (None, 1 + 4 * torch.rand(20, generator=g)):
        got = cpdae.reconstruction_loss(logits, bag, idf)
        (grad,) = torch.autograd.grad(got, logits)
        ref = reconstruction_loop(logits, bag, idf)
        (ref_grad,) = torch.autograd.grad(ref, logits)
        assert abs(got.item() - ref.item()) < 1e-4
        torch.testing.assert_close(grad, ref_grad.float(), atol=1e-6, rtol=1e-5)


def test_idf_weighting_scales_each_word_term():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 10, generator=g, requires_grad=True)
    bag = (torch.rand(4, 10, generator=g) < 0.5).float()
    idf = torch.arange(1.0, 11.0)
    (plain,) = torch.autograd.grad(cpdae.reconstruction_loss(logits, bag), logits)
    (weighted,) = torch.autograd.grad(cpdae.reconstruction_loss(logits, bag, idf), logits)
    torch.testing.assert_close(weighted, plain * idf)  # word j's term (and gradient) times idf[j]
    one_hot_idf = torch.zeros(10)
    one_hot_idf[3] = 1.0
    only_word_3 = cpdae.reconstruction_loss(logits[:, 3:4], bag[:, 3:4])
    torch.testing.assert_close(cpdae.reconstruction_loss(logits, bag, one_hot_idf), only_word_3)


def test_reconstruction_is_finite_for_extreme_logits():
    logits = torch.tensor([[200.0, -200.0, 200.0, -200.0]], requires_grad=True)
    bag = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    loss = cpdae.reconstruction_loss(logits, bag)
    loss.backward()
    assert abs(loss.item() - 400.0) < 1e-3  # two confidently wrong words, 200 nats each
    assert torch.isfinite(logits.grad).all()


# ----------------------------------------------------------------------------- contrastive (eq. 5)
def contrastive_loop(dist1, dist2):
    """Eq. 5 term by term: anchors d'_i (i = 1..m), positive d''_i, denominator all k != i of 2m."""
    m = dist1.shape[0]
    views = list(dist1) + list(dist2)  # z_1..z_2m, z_i = d'_i, z_{m+i} = d''_i
    total = 0.0
    for i in range(m):
        numerator = math.exp(-js_loop(views[i], views[m + i]))
        denominator = sum(math.exp(-js_loop(views[i], views[k])) for k in range(2 * m) if k != i)
        total += -math.log(numerator / denominator)
    return total / m  # mean over anchors (eq. 5 sums; documented departure)


def cosine_contrastive_loop(h1, h2, temperature):
    """CPDAE_R: eq. 5 with s(a, b) = cos(a, b) / temperature on [CLS] vectors, term by term."""
    m = h1.shape[0]
    views = list(h1) + list(h2)
    cos = lambda a, b: float(a @ b) / math.sqrt(float(a @ a) * float(b @ b)) / temperature
    total = 0.0
    for i in range(m):
        denominator = sum(math.exp(cos(views[i], views[k])) for k in range(2 * m) if k != i)
        total += -math.log(math.exp(cos(views[i], views[m + i])) / denominator)
    return total / m


def test_cpdae_r_cosine_contrastive_equals_eq5_loop():
    g = torch.Generator().manual_seed(11)
    h1, h2 = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    loss, _ = cpdae.contrastive_loss(h1, h2, partial(cpdae.cosine_similarity, temperature=0.1))
    assert abs(loss.item() - cosine_contrastive_loop(h1.double(), h2.double(), 0.1)) < 1e-5


def test_js_contrastive_equals_eq5_loop():
    m, v = 4, 25
    dist1 = random_distributions(m, v, seed=4)
    dist2 = random_distributions(m, v, seed=5)
    got = cpdae.contrastive_loss(dist1, dist2, run.speed.in_row_chunks(cpdae.js_similarity, 3))[0]
    assert abs(got.item() - contrastive_loop(dist1, dist2)) < 1e-5


def test_js_contrastive_gradient_matches_float64():
    m, v = 3, 15
    logits = torch.randn(2 * m, v, dtype=torch.float64, requires_grad=True)
    dist = cpdae.word_distribution(logits).double()  # fp32 path as in training
    got = cpdae.contrastive_loss(dist[:m], dist[m:], run.speed.in_row_chunks(cpdae.js_similarity, 2))[0]
    (grad,) = torch.autograd.grad(got, logits)
    p = torch.sigmoid(logits)
    p = p / p.sum(-1, keepdim=True)  # float64 reference, same formula through autograd
    js = lambda a, b: 0.5 * (a * (a / (0.5 * (a + b))).log()).sum() + 0.5 * (b * (b / (0.5 * (a + b))).log()).sum()
    ref = 0.0
    for i in range(m):
        logit_row = torch.stack([-js(p[i], p[k]) for k in range(2 * m) if k != i])
        positive = -js(p[i], p[m + i])
        ref = ref - (positive - torch.logsumexp(logit_row, 0))
    ref = ref / m
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert abs(got.item() - ref.item()) < 1e-5
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-3)


def _contrastive_worker(rank, world, tmp_path, inputs):
    contrastive_loss = run.across_ranks(cpdae.contrastive_loss, cpdae.gather_across_ranks)   # as cpdae.train() wraps it
    result = {}
    for mode, (full1, full2) in inputs.items():
        m = full1.shape[0] // world
        x1 = full1[rank * m:(rank + 1) * m].clone().requires_grad_()
        x2 = full2[rank * m:(rank + 1) * m].clone().requires_grad_()
        if mode == "js":
            loss, _ = contrastive_loss(cpdae.word_distribution(x1), cpdae.word_distribution(x2),
                                       run.speed.in_row_chunks(cpdae.js_similarity, 2))
        else:
            loss, _ = contrastive_loss(x1, x2, partial(cpdae.cosine_similarity, temperature=0.1))
        loss.backward()
        result[mode] = {"loss": loss.detach(), "g1": x1.grad, "g2": x2.grad}
    torch.save(result, tmp_path / f"rank{rank}.pt")


def _one_process(mode, full1, full2):
    x1, x2 = full1.clone().requires_grad_(), full2.clone().requires_grad_()
    if mode == "js":
        loss = cpdae.contrastive_loss(cpdae.word_distribution(x1), cpdae.word_distribution(x2), cpdae.js_similarity)[0]
    else:
        loss, _ = cpdae.contrastive_loss(x1, x2, partial(cpdae.cosine_similarity, temperature=0.1))
    loss.backward()
    return loss.detach(), x1.grad, x2.grad


def test_two_processes_equal_one_process_with_both_halves(tmp_path, run_on_two_ranks):
    """Word distributions (CPDAE) and [CLS] vectors (CPDAE_R), 2 gloo ranks x 3 texts."""
    g = torch.Generator().manual_seed(8)
    inputs = {}
    for mode, dim in (("js", 40), ("cls", 16)):
        full1 = torch.randn(6, dim, generator=g)  # logits (js) or [CLS] vectors (cls)
        inputs[mode] = (full1, full1 + 0.5 * torch.randn(6, dim, generator=g))
    results = run_on_two_ranks(_contrastive_worker, tmp_path, inputs)
    for mode, (full1, full2) in inputs.items():
        loss, g1, g2 = _one_process(mode, full1, full2)
        ranks = [results[0][mode], results[1][mode]]
        torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, loss)
        for rank in range(2):  # all_gather's backward sums over ranks: W x the one-process gradient
            torch.testing.assert_close(ranks[rank]["g1"], 2 * g1[rank * 3:(rank + 1) * 3])
            torch.testing.assert_close(ranks[rank]["g2"], 2 * g2[rank * 3:(rank + 1) * 3])


# ----------------------------------------------------------------------------- section 3.3 claim
def test_contrastive_loss_suppresses_shared_words_and_highlights_unique_words():
    """3.3: with words S shared by every text and words unique to one text, descending L_CL alone
    lowers the probability of S and raises that of the unique words."""
    m, n_shared, n_unique, n_other = 6, 5, 3, 20
    v = n_shared + m * n_unique + n_other
    shared = torch.arange(n_shared)
    unique = [torch.arange(n_shared + i * n_unique, n_shared + (i + 1) * n_unique) for i in range(m)]
    base = torch.full((m, v), -4.0)  # words absent from the text: low probability
    base[:, shared] = 1.0  # common words: equally probable in every text
    for i in range(m):
        base[i, unique[i]] = 1.0  # representative words: as probable as the common ones at first
    g = torch.Generator().manual_seed(9)
    logits1 = (base + 0.1 * torch.randn(m, v, generator=g)).requires_grad_()  # view d'
    logits2 = (base + 0.1 * torch.randn(m, v, generator=g)).requires_grad_()  # view d''
    optimizer = torch.optim.SGD([logits1, logits2], lr=50.0)  # large: -JS lies in [-log 2, 0], no temperature

    def probabilities():
        z_hat = torch.sigmoid(torch.cat([logits1, logits2]).detach())  # (2m, V) eq. 3
        z_tilde = z_hat / z_hat.sum(-1, keepdim=True)
        own = torch.stack([z_hat[i, unique[i % m]].mean() for i in range(2 * m)]).mean()  # both views
        own_tilde = torch.stack([z_tilde[i, unique[i % m]].sum() for i in range(2 * m)]).mean()
        return z_hat[:, shared].mean(), own, z_tilde[:, shared].sum(-1).mean(), own_tilde

    shared0, unique0, shared_mass0, unique_mass0 = probabilities()
    losses = []
    for _ in range(10):
        loss = cpdae.contrastive_loss(cpdae.word_distribution(logits1), cpdae.word_distribution(logits2), cpdae.js_similarity)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    shared1, unique1, shared_mass1, unique_mass1 = probabilities()
    assert losses[-1] < losses[0]
    assert shared1 < shared0 - 0.02 and unique1 > unique0 + 0.02  # sigmoid probabilities z_hat
    assert shared_mass1 < shared_mass0 and unique_mass1 > unique_mass0  # normalised z_tilde


# ----------------------------------------------------------------------------- the training pieces
SPECIAL = {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}


def tiny_cpdae(**overrides):
    fields = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_len=64, batch_size=4,
                  steps=2, dropout=0.0)
    return cpdae.Config(**{**fields, **overrides})


def tiny_windows():
    return [data.Window([101] + list(range(2000 + 7 * i, 2030 + 7 * i)) + [102], [False] + [True] * 30 + [False])
            for i in range(8)]


def test_batches_hold_two_independent_masks_of_one_text_and_its_bag():
    batch = cpdae.Batches(tiny_cpdae(), tiny_windows(), 0, 1)[0]
    assert batch["input_ids"].shape == batch["labels"].shape == (8, 32)      # [d'; d''] of 4 texts
    assert batch["attention_mask"].shape == (4, 32) and batch["bag"].shape == (4, 30522)
    original = torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])  # unmask
    first, second = original.chunk(2)
    assert torch.equal(first, second)                                         # views of the same texts
    assert not torch.equal(batch["labels"][:4] != -100, batch["labels"][4:] != -100)  # masked differently
    for row, bag in zip(first.tolist(), batch["bag"]):
        assert bag.nonzero().flatten().tolist() == sorted(set(row) - set(SPECIAL.values()))


@pytest.mark.parametrize("mode", ["js", "cls"])
def test_total_loss_is_rec_plus_mlm_plus_lambda_cl(mode):
    torch.manual_seed(0)
    c = tiny_cpdae(cl_mode=mode)
    model = cpdae.PretrainModel(c, cpdae.Encoder(c)).eval()
    batch = cpdae.Batches(c, tiny_windows(), 0, 1)[0]
    total, metrics = model(batch)
    assert set(metrics) == {"rec", "rec_per_word", "mlm", "mlm_acc", "mlm_chance", "cl", "cl_acc", "cl_chance"}
    torch.testing.assert_close(metrics["rec_per_word"], metrics["rec"] / 30522)                 # eq. 4's sum / |V|
    torch.testing.assert_close(total, metrics["rec"] + metrics["mlm"] + 0.1 * metrics["cl"])
    with torch.no_grad():
        h_cls = model.encoder(batch["input_ids"], batch["attention_mask"].repeat(2, 1))[:, 0]  # (8, H)
        logits = model.decoder(h_cls)
        rec = cpdae.reconstruction_loss(logits, batch["bag"].repeat(2, 1))
        if mode == "js":
            cl = cpdae.contrastive_loss(*cpdae.word_distribution(logits).chunk(2), cpdae.js_similarity)[0]
        else:
            cl, _ = cpdae.contrastive_loss(*h_cls.chunk(2), partial(cpdae.cosine_similarity, temperature=0.1))
    torch.testing.assert_close(metrics["rec"], rec)
    torch.testing.assert_close(metrics["cl"], cl)
    model.config = tiny_cpdae(cl_weight=0.0)                                   # Table 2 "w/o CL"
    total, metrics = model(batch)
    assert "cl" not in metrics
    torch.testing.assert_close(total, metrics["rec"] + metrics["mlm"])


def test_idf_rec_uses_corpus_idf():
    c = tiny_cpdae(idf_rec=True)
    windows = tiny_windows()
    idf = compute_idf(windows, c.vocab_size)
    model = cpdae.PretrainModel(c, cpdae.Encoder(c), idf).eval()
    batch = cpdae.Batches(c, windows, 0, 1)[0]
    _, metrics = model(batch)
    with torch.no_grad():
        h_cls = model.encoder(batch["input_ids"], batch["attention_mask"].repeat(2, 1))[:, 0]
        expected = cpdae.reconstruction_loss(model.decoder(h_cls), batch["bag"].repeat(2, 1), idf)
    torch.testing.assert_close(metrics["rec"], expected)
    assert "idf" in model.state_dict()                                         # travels with the training state


def test_checkpoint_keeps_the_decoder_beside_the_encoder(tmp_path):
    transformers = pytest.importorskip("transformers")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"text number {i} about cats and dogs and the river bank" for i in range(12)))
    c = tiny_cpdae(out_dir=str(tmp_path / "run"), corpus=str(corpus), steps=1, batch_size=2, bf16=False)
    cpdae.train(c)                                              # train() hands save_checkpoint the decoder
    decoder = cpdae.Decoder.from_pretrained(tmp_path / "run" / "encoder")
    state = run.folders.load_training_state(tmp_path / "run" / "state.pt")
    for name, tensor in decoder.state_dict().items():
        assert torch.equal(state["model"][f"decoder.{name}"], tensor)
    assert transformers.AutoModel.from_pretrained(tmp_path / "run" / "encoder").config.hidden_size == 32


# ==============================================================================================
# SEED-Encoder: weak decoder window (3.4), decoder loss (eq. 9-10), [CLS] diagnostic (Figure 5)
# ==============================================================================================
SMALL_VOCAB = 128  # covers [CLS]=101, [SEP]=102


def small_config(**changes):
    sizes = dict(vocab_size=SMALL_VOCAB, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_position=64,
                 dec_layers=3, dec_span=2)
    return dataclasses.replace(seed.Config(), **{**sizes, **changes})


def make_decoder(init_seed=0, **changes):
    torch.manual_seed(init_seed)
    config = small_config(**changes)
    return seed.WeakDecoder(config, nn.Embedding(config.vocab_size, config.hidden_size)).eval()


def test_window_mask_span_2_matches_design():
    # DESIGN.md: query i sees {0} U {i-1, i}
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(seed.window_mask(6, 2), expected)


def test_window_mask_full_is_causal():
    causal = torch.ones(6, 6).tril().bool()
    for k in (None, "full", 0):  # 0 is the config's spelling (--dec_span 0)
        assert torch.equal(seed.window_mask(6, k), causal)
    assert torch.equal(seed.window_mask(6, 6), causal)  # a span as long as the text is causal too


def receptive_field(decoder, position, length=14):
    """Input positions whose embeddings the output at `position` depends on (by autograd)."""
    ids = torch.randint(SMALL_VOCAB, (1, length))
    x = decoder.embed(ids).detach().requires_grad_(True)  # (1, L, H)
    h0 = torch.randn(1, x.shape[-1])
    out = decoder.decode(x, h0)  # (1, L, H)
    # a random direction: the plain sum of a LayerNorm output has zero gradient
    (out[0, position] * torch.randn(x.shape[-1])).sum().backward()
    return set(torch.nonzero(x.grad[0].abs().sum(-1) > 0).flatten().tolist())


def test_receptive_field_3_layers_span_2():
    assert receptive_field(make_decoder(dec_layers=3, dec_span=2), 10) == {0, 7, 8, 9, 10}


def test_receptive_field_full_span_is_causal():
    assert receptive_field(make_decoder(dec_layers=3, dec_span=0), 10) == set(range(11))


def test_every_decoder_position_sees_the_text_vector():
    """The decoder's only view of the encoder is h0 (WeakDecoder.forward takes nothing else; that only
    [CLS] of the encoder's output gets L_dec's gradient is test_decoder_loss_reaches_the_encoder_only_through_cls)."""
    decoder = make_decoder()
    ids = torch.randint(SMALL_VOCAB, (2, 12))
    h0 = torch.randn(2, 32)                                  # a text vector (B, H)
    base = decoder(ids, h0)
    changed = (decoder(ids, h0 + torch.randn(2, 32)) - base).abs().amax(-1)  # (B, L)
    assert (changed > 1e-4).all(), "every output position must see h0"


def test_cross_attention_shortcut_equals_attention_over_one_key():
    layer = make_decoder().blocks[0]
    x, h0 = torch.randn(2, 5, 32), torch.randn(2, 32)
    q = nn.Linear(32, 32)(x).view(2, 5, 4, 8).transpose(1, 2)  # (B, nh, L, dh) any query projection
    k = nn.Linear(32, 32)(h0).view(2, 1, 4, 8).transpose(1, 2)  # (B, nh, 1, dh) one key
    v = layer.cross_value(h0).view(2, 1, 4, 8).transpose(1, 2)  # (B, nh, 1, dh)
    attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32)  # (B, L, H)
    literal = layer.cross_out(attended)
    shortcut = layer.cross_out(layer.cross_value(h0))[:, None, :].expand(2, 5, 32)
    torch.testing.assert_close(literal, shortcut)


def test_decoder_is_pre_ln_with_a_final_layer_norm():
    """The authors' fairseq decoder (decoder_normalize_before=True): x + f(LN(x)) per sub-layer, then a
    final LayerNorm."""
    decoder = make_decoder()
    x, h0 = torch.randn(2, 6, 32), torch.randn(2, 32)
    attend = seed.window_mask(6, decoder.span, x.device)
    expected = x
    for b in decoder.blocks:
        expected = expected + b.attn(b.attn_norm(expected), attend)
        expected = expected + b.cross_out(b.cross_value(h0))[:, None, :]
        expected = expected + b.ffn_out(F.gelu(b.ffn_in(b.ffn_norm(expected))))
    torch.testing.assert_close(decoder.decode(x, h0), decoder.final_norm(expected))


def test_resuming_a_state_of_another_decoder_layout_is_one_clear_error(tmp_path):
    c = dataclasses.replace(small_config(), out_dir=str(tmp_path))
    model = seed.PretrainModel(c, seed.Encoder(c))
    optimizer, scheduler = run.make_optimizer(model, c)
    old = {k: v for k, v in model.state_dict().items() if not k.startswith("decoder.final_norm.")}  # post-LN days
    run.folders.save_training_state(tmp_path / "state.pt", {"step": 1, "model": old, "optimizer": optimizer.state_dict(),
                                                    "scheduler": scheduler.state_dict(), "config": dataclasses.asdict(c)})
    with pytest.raises(data.DataError, match=r"state\.pt: its weights do not fit this model \(Missing key"):
        run.folders.load_checkpoint(c, model, optimizer, scheduler, True)


def test_seed_uses_the_papers_adam_epsilon():
    c = small_config()
    model = seed.PretrainModel(c, seed.Encoder(c))
    inspect = __import__("inspect")
    assert "run.make_optimizer(model, c, eps=1e-6)" in inspect.getsource(seed.train)         # SEED 4.1
    for module in (costa, cpdae):                                                            # torch's default
        assert "run.make_optimizer(model, c, eps=1e-8)" in inspect.getsource(module.train)
    assert run.make_optimizer(model, c, eps=1e-6)[0].defaults["eps"] == 1e-6


def test_padding_does_not_change_real_positions():
    decoder = make_decoder()
    ids = torch.randint(1, SMALL_VOCAB, (1, 8))
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    h0 = torch.randn(1, 32)
    torch.testing.assert_close(decoder(padded, h0)[:, :8], decoder(ids, h0))


def test_inputs_and_targets_shift_right():
    cls, sep, pad = 101, 102, 0
    ids = torch.tensor([[cls, 5, 6, 7, sep], [cls, 8, sep, pad, pad]])
    mask = (ids != pad).long()
    decoder_input, targets = seed.decoder_inputs_and_targets(ids, mask)
    assert decoder_input.tolist() == [[cls, 5, 6, 7], [cls, 8, sep, pad]]
    assert targets.tolist() == [[5, 6, 7, sep], [8, sep, -100, -100]]


def test_decoder_loss_term_by_term_and_padding_ignored():
    torch.manual_seed(0)
    states, weight = torch.randn(2, 4, 8), torch.randn(SMALL_VOCAB, 8)
    logits = states @ weight.T                                                     # (2, 4, V)
    targets = torch.tensor([[3, 9, 1, 7], [4, 2, -100, -100]])
    total, count = 0.0, 0
    for b in range(2):
        for t in range(4):
            if targets[b, t] == -100:
                continue
            row = logits[b, t].double()
            total += -(row[targets[b, t]] - math.log(row.exp().sum()))
            count += 1
    assert count == 6
    loss, correct = seed.decoder_loss(states, weight, targets)
    torch.testing.assert_close(loss.double(), torch.tensor(float(total) / count, dtype=torch.double))
    assert int(correct) == int(((logits.argmax(-1) == targets) & (targets != -100)).sum())
    torch.testing.assert_close(seed.decoder_loss(states, weight, targets, "sum")[0].double(),
                               torch.tensor(float(total), dtype=torch.double))  # eq. 9's sum
    scrambled = states.clone()
    scrambled[1, 2:] = torch.randn(2, 8) * 100  # padded positions: must not matter
    assert torch.equal(seed.decoder_loss(scrambled, weight, targets)[0], loss)


def _decoder_loss_and_grads(states, weight, targets, chunk):
    """chunked_decoder_loss's loss, correct count and gradients, and the largest tensor autograd kept
    outside the checkpointed chunks (numel)."""
    states, weight = states.clone().requires_grad_(), weight.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss, correct = seed.chunked_decoder_loss(states, weight, targets, chunk)
    (loss * 3.0).backward()
    return loss, correct, states.grad, weight.grad, max(saved)


@pytest.mark.parametrize("chunk", [1, 3, 16, 39])
def test_chunked_decoder_loss_equals_unchunked(chunk):
    torch.manual_seed(0)
    n, vocab = 40, SMALL_VOCAB                      # N x V logits outweigh the (V, 8) embedding
    states, weight = torch.randn(n, 8), torch.randn(vocab, 8)                  # fp32, as the loss computes
    targets = torch.randint(0, vocab, (n,))
    reference = F.cross_entropy(states @ weight.T, targets)                      # eq. 9's mean, the plain form
    full = _decoder_loss_and_grads(states, weight, targets, 0)
    part = _decoder_loss_and_grads(states, weight, targets, chunk)
    torch.testing.assert_close(full[0], reference)
    torch.testing.assert_close(part[0], full[0])                                 # same loss
    assert int(part[1]) == int(full[1]) == int(((states @ weight.T).argmax(-1) == targets).sum())
    torch.testing.assert_close(part[2], full[2])                                 # d loss / d states
    torch.testing.assert_close(part[3], full[3])                                 # d loss / d embedding
    assert full[4] >= n * vocab                     # unchunked: autograd keeps all N x V logits
    assert part[4] < n * vocab and part[4] <= max(chunk * vocab, weight.numel())  # chunked: at most one chunk


def test_logits_use_the_shared_embedding():
    decoder = make_decoder()
    states = decoder(torch.tensor([[1, 2, 3]]), torch.randn(1, 32))                   # (1, 3, H)
    embedding = decoder.word_embedding[0].weight                                      # (V, H)
    targets = torch.tensor([[2, 3, 4]])
    loss, _ = seed.decoder_loss(states, embedding, targets)
    torch.testing.assert_close(loss, F.cross_entropy((states @ embedding.t())[0], targets[0]))
    loss.backward()
    assert decoder.word_embedding[0].weight.grad.abs().sum() > 0


def test_pretrain_model_trains_decoder_with_encoder():
    torch.manual_seed(0)
    c = small_config()
    model = seed.PretrainModel(c, seed.Encoder(c)).eval()
    optimizer, _ = run.make_optimizer(model, c)
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(in_optimizer) == len({id(p) for p in in_optimizer})  # the shared embedding only once
    assert {id(p) for p in model.decoder.parameters()} <= {id(p) for p in in_optimizer}
    assert any(k.startswith("decoder.blocks.") for k in model.state_dict())  # resume restores it
    assert model.decoder.word_embedding[0] is model.encoder.embeddings.word
    ids, mask = data.pad_batch([[101, 5, 6, 7, 8, 102], [101, 9, 10, 102]])
    labels = torch.full_like(ids, -100)
    labels[0, 2] = 6
    decoder_input, decoder_targets = seed.decoder_inputs_and_targets(ids, mask)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels, decoder_input=decoder_input,
                 decoder_targets=decoder_targets)
    loss, metrics = model(batch)
    torch.testing.assert_close(loss, metrics["mlm"] + metrics["dec"])  # eq. 10
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.decoder.parameters())


def test_decoder_loss_reaches_the_encoder_only_through_cls():
    """No stop-gradient (DESIGN.md): L_dec alone trains the encoder's blocks, and only via h_0."""
    torch.manual_seed(0)
    c = small_config()
    model = seed.PretrainModel(c, seed.Encoder(c)).eval()
    ids, mask = data.pad_batch([[101, 5, 6, 7, 8, 102], [101, 9, 10, 102]])
    decoder_input, decoder_targets = seed.decoder_inputs_and_targets(ids, mask)
    hidden = model.encoder(ids, mask)                                        # (B, L, H)
    hidden.retain_grad()
    states = model.decoder(decoder_input, hidden[:, 0])                      # (B, L-1, H) what training runs
    loss, _ = seed.decoder_loss(states, model.decoder.word_embedding[0].weight, decoder_targets)  # L_dec alone
    loss.backward()
    assert hidden.grad[:, 0].abs().sum() > 0                                 # [CLS] gets the gradient
    assert hidden.grad[:, 1:].abs().sum() == 0                               # nothing else does
    last_block = model.encoder.blocks[-1]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in last_block.parameters())


def test_batches_give_the_decoder_the_unmasked_text():
    c = dataclasses.replace(seed.Config(), batch_size=4, mask_prob=0.5, steps=1)
    windows = [data.Window([101] + list(range(1000 + 10 * i, 1010 + 10 * i)) + [102], [False] * 12) for i in range(4)]
    batch = seed.Batches(c, windows, rank=0, world=1)[0]
    chosen = batch["labels"] != -100  # (B, L) masked positions, never [CLS] or [SEP]
    assert (batch["input_ids"][chosen] == 103).any()
    # decoder_input[:, j] is token j and decoder_targets[:, j] token j + 1 of the ORIGINAL text
    assert torch.equal(batch["decoder_input"][chosen[:, :-1]], batch["labels"][:, :-1][chosen[:, :-1]])
    assert torch.equal(batch["decoder_targets"][chosen[:, 1:]], batch["labels"][:, 1:][chosen[:, 1:]])


# ==============================================================================================
# The function that shows an equation is the one training runs
# ==============================================================================================
def test_training_runs_the_functions_that_show_the_equations(monkeypatch):
    """A breakpoint in each equation's function stops in a training step (forward + backward)."""
    calls = set()
    for module, name in [(costa, "gwc_loss"), (cpdae, "contrastive_loss"), (cpdae, "js_similarity"),
                         (cpdae, "reconstruction_loss"), (seed, "decoder_loss")]:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=f"{module.__name__}.{name}", **kwargs):   # bound now, not at call time
            calls.add(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    torch.manual_seed(0)
    ids = torch.randint(5, 100, (4, 12))
    ids[:, 0], ids[:, -1] = 101, 102
    mask, labels = torch.ones_like(ids), torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    c = tiny_costa_config(gwc_weight=0.5)                                        # eq. 8
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "spans": torch.tensor([[[1, 3], [2, 5]]] * 4)}
    costa.PretrainModel(c, costa.Encoder(c))(batch)[0].backward()
    c = tiny_cpdae()                                                             # eq. 4, eq. 5 with -JS
    cpdae.PretrainModel(c, cpdae.Encoder(c))(cpdae.Batches(c, tiny_windows(), 0, 1)[0])[0].backward()
    c = small_config(dec_chunk=5)                                                # eq. 9, chunked: 44 positions
    decoder_input, decoder_targets = seed.decoder_inputs_and_targets(ids, mask)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "decoder_input": decoder_input,
             "decoder_targets": decoder_targets}
    seed.PretrainModel(c, seed.Encoder(c))(batch)[0].backward()
    assert calls == {"costa.gwc_loss", "cpdae.contrastive_loss", "cpdae.js_similarity", "cpdae.reconstruction_loss",
                     "seed.decoder_loss"}


# ==============================================================================================
# Levers shared by the three methods: heads that learn before they are judged
# (--head_warmup, --head_lr), the trained text vector (--bottleneck), each term at a scale where it
# acts (CPDAE --cl_tau / --rec_reduction, COSTA --gwc_sim), and each accuracy beside its chance
# ==============================================================================================
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_len=64, batch_size=4, dropout=0.0)


def tiny_method(name, **changes):
    """(module, PretrainModel, batch) of a tiny model of method `name` on tiny_windows()."""
    module = importlib.import_module(name)
    c = module.Config(**{**TINY, "steps": 4, "warmup": 0.0, **changes})
    batch = module.Batches(c, tiny_windows(), 0, 1)[0]
    torch.manual_seed(0)
    return module, module.PretrainModel(c, module.Encoder(c)), batch


def optimizer_step(module, model, batch, optimizer, scheduler):
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", run.METHODS)
def test_head_warmup_freezes_exactly_the_encoder_then_trains_it(name):
    module, model, batch = tiny_method(name, head_warmup=2)
    new = {id(p) for p in model.new_parameters()}
    heads = {n for n, p in model.named_parameters() if id(p) in new}
    own_heads = {f"{child}." for child, _ in model.named_children() if child != "encoder"}   # COSTA's projector, ...
    assert own_heads and {n.split(".")[0] + "." for n in heads} == own_heads | {"encoder."}   # + the new MLM head
    assert {n for n in heads if n.startswith("encoder.")} == {f"encoder.mlm_head.{k}" for k in
                                                               ("bias", "dense.weight", "dense.bias", "norm.weight", "norm.bias")}
    optimizer, scheduler = run.make_optimizer(model, model.config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(2):                                                              # the warm-up
        optimizer_step(module, model, batch, optimizer, scheduler)
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]) != (n in heads), (step, n)                 # heads move, encoder not
    optimizer_step(module, model, batch, optimizer, scheduler)                         # step 3: the encoder trains
    assert not torch.equal(model.encoder.embeddings.word.weight, before["encoder.embeddings.word.weight"])
    assert not torch.equal(model.encoder.blocks[0].ffn_in.weight, before["encoder.blocks.0.ffn_in.weight"])


def test_progress_prints_the_heads_lr_while_the_encoder_waits(tmp_path, capsys):
    _, model, _ = tiny_method("costa", head_warmup=2, head_lr=5.0, out_dir=str(tmp_path))
    optimizer, scheduler = run.make_optimizer(model, model.config)
    lr, head_lr = run.encoder_and_head_lr(optimizer, scheduler)
    assert lr == 0.0 and head_lr == scheduler.get_last_lr()[-1] > 0                      # the heads alone
    progress = run.Progress(model.config, 0, True)
    progress.add({"mlm": 1.0}, 10)
    progress.report(1, lr, "cpu", head_lr)
    assert f"| encoder frozen (--head_warmup) | heads' lr {head_lr:.2e} |" in capsys.readouterr().out
    optimizer, scheduler = run.make_optimizer(model, dataclasses.replace(model.config, head_warmup=0, head_lr=1.0))
    assert run.encoder_and_head_lr(optimizer, scheduler) == (scheduler.get_last_lr()[0], None)   # one lr: printed once


def test_head_schedule_and_groups():
    """No head flags: two groups and the plain schedule (finetune.py's). --head_warmup W: the encoder's
    factor is 0 for W steps, then its own warm-up and decay over the rest; heads: --head_lr x the plain one."""
    c = tiny_cpdae(steps=20, warmup=0.1)
    plain = lambda step, steps=20, start=0: (0.0 if step < start else min(
        (step - start + 1) / max(1, int(0.1 * (steps - start))),
        max(0.0, (steps - step) / max(1, steps - start - max(1, int(0.1 * (steps - start)))))))
    encoder = cpdae.Encoder(c)
    optimizer, scheduler = run.make_optimizer(encoder, c)                               # no new_parameters()
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert [scheduler.lr_lambdas[0](s) for s in range(20)] == [plain(s) for s in range(20)]
    model = cpdae.PretrainModel(c, encoder)
    c = tiny_cpdae(steps=20, warmup=0.1, head_warmup=5, head_lr=10.0)
    optimizer, scheduler = run.make_optimizer(model, c)
    assert [(g["head"], g["decay"]) for g in optimizer.param_groups] == [(False, True), (False, False), (True, True), (True, False)]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        expected = [10 * plain(s) for s in range(20)] if group["head"] else [plain(s, start=5) for s in range(20)]
        assert [factor(s) for s in range(20)] == pytest.approx(expected)
    assert [factor(4) for factor in scheduler.lr_lambdas[:2]] == [0.0, 0.0]
    with pytest.raises(ValueError, match="--head_warmup 20 leaves none of the 20 steps"):
        run.make_optimizer(model, dataclasses.replace(c, head_warmup=20))


def test_checkpoint_heads_are_new_only_where_the_checkpoint_lacks_them():
    _, model, _ = tiny_method("costa")
    model.encoder.new_mlm_head = False                                 # a BERT checkpoint with its MLM head
    assert {id(p) for p in model.new_parameters()} == {id(p) for p in model.projector.parameters()}
    _, model, _ = tiny_method("costa", gwc_weight=0.0)                  # the MLM baseline: the MLM head only
    assert {id(p) for p in model.new_parameters()} == {id(p) for p in model.encoder.mlm_head.parameters()}
    assert model.encoder.embeddings.word.weight not in set(model.new_parameters())  # the tied decoder stays frozen


def test_text_vector_mean_is_the_masked_mean():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 6, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    got = costa.text_vector(hidden, mask, "mean")
    for b in range(3):
        n = int(mask[b].sum())
        torch.testing.assert_close(got[b], sum(hidden[b, t] for t in range(n)) / n)
    assert torch.equal(costa.text_vector(hidden, mask, "cls"), hidden[:, 0])
    assert torch.equal(costa.text_vector(hidden, mask), hidden[:, 0])                   # the papers' by default


@pytest.mark.parametrize("name", ["costa", "cpdae", "seed"])
def test_bottleneck_mean_feeds_each_methods_head(name):
    """The vector of --bottleneck mean (not [CLS]) is what COSTA projects, CPDAE decodes, SEED remembers."""
    _module, model, batch = tiny_method(name, bottleneck="mean")
    model.eval()
    _, metrics = model(batch)
    mask = batch["attention_mask"].repeat(2 if name == "cpdae" else 1, 1)
    with torch.no_grad():
        hidden = model.encoder(batch["input_ids"], mask)
        mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)           # (B, H)
        if name == "costa":
            spans = costa.span_vectors(hidden, batch["spans"])
            term, expected = "gwc", costa.gwc_loss(model.projector(mean), spans, model.config.tau)[0]
        elif name == "cpdae":
            term, expected = "rec", cpdae.reconstruction_loss(model.decoder(mean), batch["bag"].repeat(2, 1))
        else:
            states = model.decoder.decode(model.decoder.embed(batch["decoder_input"]), mean)
            kept = batch["decoder_targets"] != -100
            weight = model.decoder.word_embedding[0].weight
            term, expected = "dec", seed.decoder_loss(states[kept], weight, batch["decoder_targets"][kept])[0]
    torch.testing.assert_close(metrics[term], expected)
    cls_model = tiny_method(name)[1].eval()
    assert not torch.allclose(cls_model(batch)[1][term], metrics[term])


@pytest.mark.parametrize("name", run.METHODS)
def test_terms_sum_to_the_loss_and_every_accuracy_has_its_chance(name):
    _module, model, batch = tiny_method(name)
    model.eval()
    terms, metrics = model.terms(batch)
    loss, _ = model(batch)
    torch.testing.assert_close(loss, sum(terms.values()))
    assert "L_MLM" in terms and len(terms) > 1                                          # MLM and the method's own
    accuracies = {k[:-4] for k in metrics if k.endswith("_acc")}
    assert accuracies and {k[:-7] for k in metrics if k.endswith("_chance")} == accuracies
    labels = batch["labels"][batch["labels"] != -100]
    top = int(labels.bincount().argmax())                                               # no corpus token: the batch's
    assert float(metrics["mlm_chance"]) == pytest.approx(float((labels == top).float().mean()))
    B = batch["attention_mask"].shape[0]
    if name == "costa":                                  # a random guess among N(S+1) - 1 candidates, S of them right
        assert set(terms) == {"L_MLM", "lambda L_GWC"}
        S = batch["spans"].shape[1]
        assert metrics["gwc_chance"] == S / (B * (S + 1) - 1)
    if name == "cpdae":                                  # a random guess among the 2m - 1 other views
        assert set(terms) == {"L_REC", "L_MLM", "lambda L_CL"}
        assert metrics["cl_chance"] == 1 / (2 * B - 1)
    if name == "seed":
        assert set(terms) == {"L_MLM", "L_dec"}
        model.frequent_token = 2003
        targets = batch["decoder_targets"][batch["decoder_targets"] != -100]
        assert float(model.terms(batch)[1]["dec_chance"]) == pytest.approx(float((targets == 2003).float().mean()))


def test_seed_dec_weight_scales_only_the_decoder_term():
    _, plain, batch = tiny_method("seed")
    _, weighted, _ = tiny_method("seed", dec_weight=3.0)            # same seed: the same weights
    plain.eval(), weighted.eval()
    terms, weighted_terms = plain.terms(batch)[0], weighted.terms(batch)[0]
    assert set(weighted_terms) == {"L_MLM", "w L_dec"}
    torch.testing.assert_close(weighted_terms["L_MLM"], terms["L_MLM"])
    torch.testing.assert_close(weighted_terms["w L_dec"], 3.0 * terms["L_dec"])
    torch.testing.assert_close(weighted(batch)[0], terms["L_MLM"] + 3.0 * terms["L_dec"])     # eq. 10, weighted


def test_most_frequent_token_and_its_accuracy():
    windows = [data.Window([101, 7, 7, 9, 102], [False] * 5), data.Window([101, 9, 7, 102], [False] * 4)]
    assert data.most_frequent_token(windows) == 7                                       # [CLS], [SEP] not counted
    targets = torch.tensor([[7, -100, 9], [7, 7, -100]])
    assert float(data.most_frequent_accuracy(targets, 7)) == 0.75
    assert float(data.most_frequent_accuracy(targets, 9)) == 0.25
    assert float(data.most_frequent_accuracy(targets)) == 0.75                           # the batch's own
    lines = run.chance_lines({"mlm": 2.0, "mlm_acc": 0.3, "mlm_chance": 0.1, "x_acc": 0.5})
    assert lines == ["mlm: accuracy 0.3000, chance 0.1000, ratio 3.00"]


def test_rec_reduction_mean_is_eq4_over_the_vocabulary_size():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 20, generator=g)).requires_grad_()
    bag = (torch.rand(3, 20, generator=g) < 0.3).float()
    ref = reconstruction_loop(logits, bag)
    assert abs(cpdae.reconstruction_loss(logits, bag).item() - ref.item()) < 1e-4        # default: eq. 4's sum
    assert abs(cpdae.reconstruction_loss(logits, bag, reduction="mean").item() - ref.item() / 20) < 1e-5


def test_cl_tau_divides_minus_js_and_tau_1_is_eq5():
    m, v = 4, 25
    dist1, dist2 = random_distributions(m, v, seed=4), random_distributions(m, v, seed=5)
    literal = cpdae.contrastive_loss(dist1, dist2, cpdae.js_similarity)[0]
    assert abs(literal.item() - contrastive_loop(dist1, dist2)) < 1e-5                    # tau 1: eq. 5
    assert math.log(m) <= literal.item() <= math.log(2 * m - 1)                          # the bound of eq. 5
    views = list(dist1) + list(dist2)
    s = lambda a, b: -js_loop(a, b) / 0.05
    expected = sum(-math.log(math.exp(s(views[i], views[m + i])) /
                             sum(math.exp(s(views[i], views[k])) for k in range(2 * m) if k != i)) for i in range(m)) / m
    got = cpdae.contrastive_loss(dist1, dist2, partial(cpdae.js_similarity, tau=0.05))[0]
    assert abs(got.item() - expected) < 1e-4


def test_gwc_cosine_is_eq8_on_unit_vectors_and_dot_is_the_default():
    text, spans = random_group()
    unit_text, unit_spans = F.normalize(text, dim=-1), F.normalize(spans, dim=-1)
    torch.testing.assert_close(costa.gwc_loss(text, spans, 0.1, sim="cos")[0], naive_gwc(unit_text, unit_spans, 0.1))
    torch.testing.assert_close(costa.gwc_loss(text, spans, 0.1)[0], naive_gwc(text, spans, 0.1))


@pytest.mark.parametrize("name,flag", [("costa", "bottleneck"), ("costa", "gwc_sim"), ("cpdae", "rec_reduction"),
                                       ("cpdae", "cl_mode"), ("seed", "bottleneck")])
def test_string_flags_are_checked_against_their_choices(name, flag):
    module = importlib.import_module(name)
    run.cli.parse_config(module.Config, [], "", module.PAPER_PRESET, module.FLAG_RULES)
    with pytest.raises(SystemExit, match=f"--{flag} must be one of .*, got 'avg'"):
        run.cli.parse_config(module.Config, [f"--{flag}", "avg"], "", module.PAPER_PRESET, module.FLAG_RULES)


# ==============================================================================================
# --compile (run.speed.fused): the compiled losses equal the eager ones; a compiler failure leaves the run eager
# ==============================================================================================
def _contrastive_and_decoder(js, dec, dist_logits, states, weight, targets):
    """Eq. 5 with similarity js and eq. 9 by dec: (values (L_CL, L_dec, n_correct), their summed loss's gradients)."""
    cl = cpdae.contrastive_loss(*cpdae.word_distribution(dist_logits).chunk(2), js)[0]
    loss, correct = dec(states, weight, targets)
    return (cl, loss, correct), torch.autograd.grad(cl + loss, (dist_logits, states, weight))


def test_compiled_losses_equal_eager_values_and_gradients(monkeypatch, capsys):
    """run.speed.fused with --compile (torch.compile): eq. 5's -JS in a contrastive loss and eq. 9's decoder loss
    give the eager values and gradients within the tolerances above (fp32; fp64 is checked eager)."""
    monkeypatch.setattr(run.speed, "_FUSED", {})   # compiled here, not by an earlier test's run (--compile is the default)
    torch.manual_seed(0)
    dist_logits = torch.randn(6, 50, requires_grad=True)                     # 3 texts x 2 views, V = 50
    states, weight = torch.randn(24, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (24,)).masked_fill(torch.arange(24) >= 20, -100)   # 4 padded positions
    c = SimpleNamespace(compile=True)
    js = run.speed.fused(cpdae.js_similarity, c, sweep_per_input=True)              # as cpdae.py runs it
    compiled = _contrastive_and_decoder(js, run.speed.fused(seed.decoder_loss, c), dist_logits, states, weight, targets)
    said = capsys.readouterr().out
    assert "js_similarity compiled in" in said and "decoder_loss compiled in" in said, said   # not eager
    assert js(dist_logits[:2], dist_logits).grad_fn.name() == "SweepPerInputBackward"    # one sweep per input
    eager = _contrastive_and_decoder(run.speed.in_row_chunks(cpdae.js_similarity, 2),
                                     partial(seed.chunked_decoder_loss, chunk=5), dist_logits, states, weight, targets)
    for got, want in zip(compiled[0], eager[0]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for got, want in zip(compiled[1], eager[1]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_a_compiler_failure_is_one_line_and_the_loss_runs_eager(monkeypatch, capsys):
    """Where torch.compile fails (no C++ compiler, a platform it does not support), --compile says so once and
    the run goes on with the eager loss; without --compile nothing is compiled."""
    def failing_compile(fn):
        def call(*args, **kwargs):
            raise RuntimeError("no C++ compiler found\nmore lines")
        return call
    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setattr(run.speed, "_FUSED", {})
    p, q = random_distributions(3, 20, seed=0), random_distributions(5, 20, seed=1)
    assert run.speed.fused(cpdae.js_similarity, SimpleNamespace(compile=False)) is cpdae.js_similarity
    loss = run.speed.fused(cpdae.js_similarity, SimpleNamespace(compile=True), run.speed.in_row_chunks(cpdae.js_similarity, 2),
                     sweep_per_input=True)
    for _ in range(2):
        torch.testing.assert_close(loss(p, q), cpdae.js_similarity(p, q))
    assert capsys.readouterr().out == ("--compile: js_similarity not compiled (RuntimeError: no C++ compiler found); "
                                       "eager\n")


def test_a_compiler_failure_in_the_backward_alone_is_one_line_and_the_gradient_eager(monkeypatch, capsys):
    """CPDAE's compiled backward (run.speed.compiled_per_input) compiles at the first backward, after the forward
    compiled: a failure there says so once per input and the gradients come from the eager vector-Jacobian
    product, equal to autograd's of the plain loss."""
    def compile_all_but_the_backward(fn):
        def call(*args, **kwargs):
            if "backward" in fn.__name__:
                raise RuntimeError("no vjp here\nmore lines")
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(torch, "compile", compile_all_but_the_backward)
    monkeypatch.setattr(run.speed, "_FUSED", {})
    p, q = (random_distributions(n, 20, seed=n).double().requires_grad_() for n in (3, 5))
    loss = run.speed.fused(cpdae.js_similarity, SimpleNamespace(compile=True), sweep_per_input=True)
    upstream = torch.randn(3, 5, dtype=torch.float64)
    for _ in range(2):
        got = torch.autograd.grad(loss(p, q), (p, q), upstream)
    want = torch.autograd.grad(cpdae.js_similarity(p, q), (p, q), upstream)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("--compile: js_similarity compiled in ") and said[1:] == [
        f"--compile: js_similarity's backward in input {i} not compiled (RuntimeError: no vjp here); eager" for i in (0, 1)]


def test_padding_the_kept_decoder_positions_leaves_the_loss():
    """seed.py pads the N kept decoder positions to a multiple of a bucket (run.speed.pad_rows): a few shapes recur,
    and eq. 9's mean, its correct count and its gradients are those of the N positions alone."""
    torch.manual_seed(0)
    states, weight = torch.randn(13, 8, requires_grad=True), torch.randn(SMALL_VOCAB, 8)
    targets = torch.randint(0, SMALL_VOCAB, (13,))
    padded, padded_targets = run.speed.pad_rows(states, targets, 8)
    assert padded.shape == (16, 8) and padded_targets[13:].eq(-100).all() and run.speed.pad_rows(padded, padded_targets, 8)[0] is padded
    for chunk in (0, 5):
        loss, correct = seed.chunked_decoder_loss(states, weight, targets, chunk)
        padded_loss, padded_correct = seed.chunked_decoder_loss(padded, weight, padded_targets, chunk)
        torch.testing.assert_close(padded_loss, loss)
        assert int(padded_correct) == int(correct)
        torch.testing.assert_close(torch.autograd.grad(padded_loss, states)[0], torch.autograd.grad(loss, states)[0])


# ==============================================================================================
# Every piece the equation tables name copies alone: its section's defs in a file that imports only torch
# ==============================================================================================
BANNER = "# " + "=" * 94


def section_namespace(module, piece):
    """Run, in a fresh namespace that holds only the method file's torch imports, every top-level def
    of the section (between two `# ====` banners) where `piece` is defined, as a student's copy would."""
    source = Path(module.__file__).read_text()
    tree = ast.parse(source)
    banners = [i for i, line in enumerate(source.splitlines(), 1) if line == BANNER]
    line = next(node.lineno for node in tree.body if getattr(node, "name", None) == piece)
    start = max(b for b in banners if b < line)
    end = min([b for b in banners if b > line + 1] + [len(source.splitlines()) + 1])
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
               and all((getattr(node, "module", None) or alias.name).split(".")[0] == "torch" for alias in node.names)]
    defs = [node for node in tree.body if start < node.lineno < end and not isinstance(node, (ast.Import, ast.ImportFrom))]
    namespace = {}
    code = compile(ast.Module(body=imports + defs, type_ignores=[]), f"copy of {module.__name__}.{piece}", "exec")
    exec(code, namespace)  # noqa: S102 (the project's own source, as a student's copy would run it)
    assert "np" not in namespace and "data" not in namespace
    return namespace


def backward_reaches(loss, *inputs):
    """The loss is finite and its gradient reaches every input."""
    loss.backward()
    assert torch.isfinite(loss) and all(x.grad is not None and torch.isfinite(x.grad).all() for x in inputs)


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


DECODER_SIZES = SimpleNamespace(hidden_size=16, num_heads=2, ffn_size=32, dropout=0.1, layer_norm_eps=1e-12,
                                max_position=32, dec_layers=2, dec_span=2)


def run_costa_piece(ns, piece):
    B, S, L, H = 3, 4, 10, 16
    hidden = leaf(B, L, H)
    if piece == "gwc_loss":
        text, spans = leaf(B, H), leaf(B, S, H)
        backward_reaches(ns["gwc_loss"](text, spans, 0.1)[0], text, spans)
    elif piece == "span_vectors":
        spans = torch.tensor([[[1, 3], [2, 7], [4, 5], [1, 9]]] * B)
        backward_reaches(ns["span_vectors"](hidden, spans).sum(), hidden)
    elif piece == "Projector":
        backward_reaches(ns["Projector"](H)(ns["text_vector"](hidden, torch.ones(B, L))).sum(), hidden)


def run_cpdae_piece(ns, piece):
    B, H, V = 3, 16, 50
    h_cls, logits = leaf(2 * B, H), leaf(2 * B, V)
    bag = (torch.rand(2 * B, V) < 0.2).float()
    if piece == "Decoder":
        backward_reaches(ns["Decoder"](H, V)(h_cls).square().mean(), h_cls)
    elif piece == "reconstruction_loss":
        backward_reaches(ns["reconstruction_loss"](logits, bag), logits)
    elif piece in ("contrastive_loss", "js_similarity", "word_distribution"):
        view1, view2 = ns["word_distribution"](logits).chunk(2)
        backward_reaches(ns["contrastive_loss"](view1, view2, ns["js_similarity"])[0], logits)


def run_seed_piece(ns, piece):
    B, L, H, V = 2, 9, 16, 50
    embedding = nn.Embedding(V, H)
    h0, ids = leaf(B, H), torch.randint(V, (B, L))
    if piece == "WeakDecoder":
        decoder_input, _ = ns["decoder_inputs_and_targets"](ids, torch.ones(B, L))
        states = ns["WeakDecoder"](DECODER_SIZES, embedding)(decoder_input, h0)      # (B, L-1, H)
        backward_reaches(states.square().mean(), h0)
    elif piece == "decoder_loss":
        states = leaf(B, L, H)
        backward_reaches(ns["decoder_loss"](states, embedding.weight, ids)[0], states)


COPIED_PIECES = [(costa, "gwc_loss", run_costa_piece), (costa, "span_vectors", run_costa_piece),
                 (costa, "Projector", run_costa_piece),
                 (cpdae, "Decoder", run_cpdae_piece), (cpdae, "reconstruction_loss", run_cpdae_piece),
                 (cpdae, "contrastive_loss", run_cpdae_piece),
                 (seed, "WeakDecoder", run_seed_piece), (seed, "decoder_loss", run_seed_piece)]


@pytest.mark.parametrize("module, piece, run_piece", COPIED_PIECES, ids=[f"{m.__name__}.{p}" for m, p, _ in COPIED_PIECES])
def test_each_piece_copies_alone_into_a_torch_only_file(module, piece, run_piece):
    """The equation tables' pieces (the losses, the heads and the decoders) run forward and backward on
    random tensors with only their own section's defs and torch: nothing from data.py, run.py, numpy or
    the shared encoder at the end of the file. (mlm_loss and text_vector are copied with their sections.)"""
    torch.manual_seed(0)
    namespace = section_namespace(module, piece)
    run_piece(namespace, piece)
    if module is not costa:
        labels = torch.full((2, 5), -100)
        labels[:, 2] = 7
        hidden = leaf(2, 5, 16)
        backward_reaches(section_namespace(module, "mlm_loss")["mlm_loss"](hidden, labels, nn.Linear(16, 50))[0], hidden)


# ==============================================================================================
# walkthrough.py: its steps run, and its helpers match the methods' own code (lab.check grades the exercises)
# ==============================================================================================
def test_walkthrough_runs_and_its_helpers_match_the_methods(capsys):
    import walkthrough
    walkthrough.costa_step(), walkthrough.cpdae_step(), walkthrough.seed_step()
    printed = capsys.readouterr().out
    assert all(word in printed for word in ("L_GWC", "L_CL", "window mask"))
    text, spans = random_group(N=4, S=3, H=5)                                  # 1: eq. 8's positives
    candidates = torch.cat([text, spans.reshape(12, -1)])
    logits = (text @ candidates.T / 0.1).fill_diagonal_(float("-inf"))
    columns = walkthrough.gwc_positive_columns(4, 3)
    mine = -(logits.gather(1, columns) - logits.logsumexp(1, keepdim=True)).mean()
    torch.testing.assert_close(mine, costa.gwc_loss(text, spans, 0.1)[0])
    view1, view2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)  # 2: eq. 5's self-mask
    scores = (view1 @ torch.cat([view1, view2]).T).masked_fill(walkthrough.self_mask(5), float("-inf"))
    mine = F.cross_entropy(scores, 5 + torch.arange(5))
    torch.testing.assert_close(mine.float(), cpdae.contrastive_loss(view1, view2, lambda a, b: a @ b.T)[0])  # fp32


@pytest.mark.parametrize("name", run.METHODS)
def test_no_method_piece_is_rebound_at_module_level_and_train_wraps_what_the_benchmark_wraps(name):
    """The loss a reader reads is the one that runs: no function or class of a method file is reassigned at module
    level, no autocast or torch.distributed code comes before `def train`, and the pieces train() wraps (model.X = ...)
    are the ones research.benchmark.as_trained wraps, so the benchmark times training's step."""
    from research import benchmark
    source = (ROOT / f"{name}.py").read_text()
    tree = ast.parse(source)
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        targets = [t for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets] if not isinstance(
            node, (ast.FunctionDef, ast.ClassDef)) else []
        for target in targets:
            base = target.value if isinstance(target, ast.Attribute) else target
            assert not (isinstance(base, ast.Name) and base.id in defined), (name, ast.unparse(target))
    before_train = source[:source.index("\ndef train(")]
    for code in ("autocast", "dist.", "rank_and_world", "gather_across_ranks", "DistributedDataParallel"):
        assert code not in before_train, (name, code)
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    wrapped = lambda fn: {ast.unparse(t) for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
                          if isinstance(t, ast.Attribute) and ast.unparse(t).startswith("model.")}
    helper = ast.parse(inspect.getsource(benchmark.as_trained))
    branch = next(n for n in ast.walk(helper) if isinstance(n, ast.If) and f"'{name}'" in ast.unparse(n.test))
    assert wrapped(train) == wrapped(ast.Module(body=branch.body, type_ignores=[])) != set()


@pytest.mark.parametrize("name", run.METHODS)
def test_every_docstring_of_a_method_file_fits_a_slide(name):
    """Each loss's and each module's docstring is at most 8 lines (the equation, the shapes, one line of why); the
    departures and the speed notes live in docs/departures.md and docs/speed.md, their tags where they happen."""
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    long = [(node.name, len(ast.get_docstring(node, clean=False).splitlines())) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node, clean=False)
            and len(ast.get_docstring(node, clean=False).splitlines()) > 8]
    assert not long, long
