"""The papers' figures, and each paper's mechanism measured against its own ablation (docs/mechanisms.md),
on encoders that evaluate.py's retrieval layer loads. The one module besides the training drivers that
imports method files (cpdae.py's decoder, seed.py's, a run's own PretrainModel): evaluate.py imports none.

What each paper claims or draws, and the function that measures it:
    COSTA Figure 3   t-SNE of one query and its top 100, relevant marked, a panel per model  plot_tsne
    COSTA 5.4        relevant documents against BM25's other top 100 (auc, margin)          discrimination
    CPDAE Table 4    the decoder's word distribution, summed over each word's pieces        word_distribution
    CPDAE 3.3        z_tilde's share on the common words and on the text's own              cpdae_word_shares
    SEED 3.2-3.4     the decoder's loss with its own h0 against another text's              seed_decoder_reliance
    SEED Figure 4    cosine of the decoder's states with h0, by position                    cosine_by_position
    SEED Figure 5    cosine of random text pairs' vectors, by length                        cls_similarity_by_length
    every run        each term of its own objective on held-out windows, beside chance      held_out_heads

    python -m research.mechanisms --model DIR --tsne auto                           # COSTA Figure 3 for one query
    python -m research.mechanisms --model minilm,DIR --tsne auto                    # the same, a panel per model
    python -m research.mechanisms --model runs/cpdae/encoder --words "Some text"    # CPDAE Table 4 figure
    python -m research.mechanisms --model minilm,runs/seed/encoder --cls_by_length  # SEED Figure 5, a line per model
    python -m research.mechanisms --model A,B --tag on,off --word_shares --corpus T # CPDAE 3.3, a row per model
    python -m research.mechanisms --model A,B --decoder_reliance --corpus T         # SEED h0 swap and Figure 4, ditto
    python -m research.mechanisms --model A,B --discrimination --split test         # COSTA 5.4 over every test query
    python -m research.mechanisms --model A,B --heads --corpus HELD_OUT             # each run's own held-out losses

Outputs in out_dir (default: the first model's, as evaluate.py's): the figures as PNG, and each measurement's
JSON rows, one file a row (write_rows), each with the command that remakes it. The flags are evaluate.py's
(its Config, for the models' pooling, lengths and the split) and the ones below.
"""
import dataclasses
import hashlib
import importlib
import math
import shlex
import sys
import textwrap
import time
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats

import cpdae
import data
import evaluate
import run
import seed
from evaluate import (
    BM25,
    _pyplot,
    _save_figure,
    default_out_dir,
    encode,
    evaluate_encoder,
    git_state,
    load_eval_split,
    load_model,
    model_settings,
    passage_text,
    pool,
    rank_and_world,
    trec_order,
    trec_tag,
)


# ==============================================================================================
# Config
# ==============================================================================================
@dataclass
class Config(evaluate.Config):
    tsne: str = ""                # query id for the COSTA Figure 3 t-SNE, or "auto" (most relevant documents, a hit for every model)
    words: str = ""               # text for the CPDAE Table 4 figure (needs the CPDAE decoder)
    cls_by_length: bool = False   # SEED-Encoder Figure 5: cosine of random text pairs of the corpus by length, no retrieval
    decoder: str = ""             # folder with cpdae.py's decoder.safetensors; "" = the model folder
    word_shares: bool = False     # CPDAE 3.3: z_tilde's share on common words and on the text's own; JSON rows
    decoder_reliance: bool = False  # SEED 3.2-3.4: decoder loss with its own h0 against another text's, Figure 4; JSON rows
    discrimination: bool = False  # COSTA 5.4: relevant documents against the other top 100, every query; JSON rows
    heads: bool = False           # each run's own objective (every loss term, accuracy, chance) on --corpus's windows; JSON rows
    n_texts: int = 1000           # --word_shares, --decoder_reliance, --heads: a fixed sample of this many texts (--heads: windows)
    n_common: int = 100           # --word_shares, --frozen cpdae: the common words, the tokens of lowest IDF in the run's pre-training corpus
    # --frozen: train only a paper's decoder on a frozen --model's vectors (decoder-side claims; JSON rows)
    frozen: str = ""              # "cpdae" (section 3.3: the MLP decoder) or "seed" (3.2-3.4, Figure 4: the weak decoder)
    train_corpus: str = ""        # --frozen: the texts whose windows the decoder trains on
    dev_corpus: str = ""          # --frozen: held-out texts where settings are chosen (--corpus: where claims are judged)
    frozen_cache: str = "runs/frozen-vectors"  # --frozen: the encoder's vectors of each corpus's windows, computed once
    max_len: int = 128            # --frozen: window length, [CLS] and [SEP] included
    seed: int = 0                 # --frozen: the trial's seed (decoder init, batch order, dropout)
    steps: int = 600              # --frozen: decoder steps
    eval_every: int = 100         # --frozen: held-out measures every this many steps (and at the end)
    batch_size: int = 16          # --frozen: windows a step (CPDAE's m: each with its two masked views)
    lr: float = 1e-3              # --frozen: AdamW's lr after WARMUP_STEPS of linear warm-up, then constant
    cl_weight: float = 0.1        # --frozen cpdae: lambda of eq. 6 (0 = "w/o CL")
    cl_tau: float = 1.0           # --frozen cpdae: eq. 5's s = -JS / tau (1 = the paper's)
    rec_reduction: str = "sum"    # --frozen cpdae: eq. 4 over the vocabulary, "sum" (the paper's) or "mean"
    dec_span: int = 2             # --frozen seed: the decoder's attention span (2 = the paper's weak one; 0 = full causal)
    dec_layers: int = 3           # --frozen seed: decoder blocks (the paper's 3)
    mask_seed: int = 0            # --frozen: the draw of every window's two masked views (0: the first round's one draw)
    cl_positive: str = "own"      # --frozen cpdae: a view's positive: its text's other view, "other" (the confirmatory
    #                               control) or "matched" (the matched control: the next window of the same batch)
    confirm: bool = False         # --frozen: the confirmatory round's measures too (rank AUCs, entropy, per text; no-[SEP] slopes)
    device: str = "cpu"           # --frozen: where the decoder trains ("cuda", "cuda:1"); the encoder's vectors: on the CPU
    compile: bool = False         # --frozen seed: eq. 9 compiled (run.speed.fused); equal to eager to fp tolerance, not bit for bit


# The domain of each numeric flag of its own, checked by run.cli.parse_config before any work (evaluate.py's too).
FLAG_RULES = {**evaluate.FLAG_RULES, "n_texts": ">= 2", "n_common": ">= 1", "frozen": "one of {cpdae, seed} or empty",
              "max_len": ">= 8", "steps": ">= 1", "eval_every": ">= 1", "batch_size": ">= 2", "lr": "> 0",
              "cl_weight": ">= 0", "cl_tau": "> 0", "rec_reduction": "one of {sum, mean}", "dec_span": ">= 0",
              "dec_layers": ">= 1", "mask_seed": ">= 0", "cl_positive": "one of {own, other, matched}"}
FIGURES = ("tsne", "words", "cls_by_length")   # the figures' flags (MECHANISMS: the measurements')


# ---------------------------------------------------------------------------------------------
# Figures (matplotlib, Agg backend)
# ---------------------------------------------------------------------------------------------
def plot_tsne(panels, path, title="", seed=0):
    """COSTA Figure 3: t-SNE of one query and its candidates, the relevant ones marked, one panel per
    encoder side by side. panels: [(panel title, query vector (H,), candidate vectors (K, H), relevant
    (K,) bool)]. Each panel is a t-SNE of its own, so compare how the points group, not the axes.
    Returns each panel's (K + 1, 2) coordinates, query first."""
    from sklearn.manifold import TSNE

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 5.4), squeeze=False, layout="constrained")
    coords = []
    for ax, (name, query_vec, doc_vecs, relevant) in zip(axes[0], panels):
        points = np.vstack([np.asarray(query_vec, np.float32)[None], np.asarray(doc_vecs, np.float32)])  # (K+1, H)
        relevant = np.asarray(relevant, dtype=bool)
        perplexity = min(30.0, (len(points) - 1) / 3.0)  # must stay below the number of points
        tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed, method="exact")  # ~100 points
        xy = tsne.fit_transform(points)                                                 # (K+1, 2)
        ax.scatter(*xy[1:][~relevant].T, s=14, c="#9e9e9e", label="candidate")
        ax.scatter(*xy[1:][relevant].T, s=60, c="#d62728", marker="o", label="relevant")
        ax.scatter(*xy[:1].T, s=200, c="#1f77b4", marker="*", label="query")
        ax.set(xticks=[], yticks=[], xlabel="t-SNE dimension 1", ylabel="t-SNE dimension 2", title=name)
        coords.append(xy)
    axes[0][0].legend(loc="best", fontsize=8)
    fig.suptitle(title)
    _save_figure(fig, path)
    return coords


@torch.no_grad()
def cls_similarity_by_length(encoder, tokenizer, texts, lengths=(32, 64, 128, 256, 512), n_pairs=200, seed=0,
                             batch_size=16, pooling="cls"):
    """SEED-Encoder section 4.6.2 / Figure 5: mean cosine similarity of the [CLS] vectors of random pairs of
    different texts, each cut to exactly `length` tokens ([CLS] + length-2 pieces + [SEP]). A
    collapsed encoder (Optimus in Figure 1b) gives values near 1 for long texts. Returns {length: cos}.
    Only texts with >= length-2 pieces take part at a length; a length with < 2 of them is left out.
    pooling: the vector compared, "cls" (the paper's) or "mean" (pool())."""
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    pieces = [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    device, was_training = next(encoder.parameters()).device, encoder.training
    encoder.eval()
    generator = torch.Generator().manual_seed(seed)
    result = {}
    for length in lengths:
        eligible = [ids for ids in pieces if len(ids) >= length - 2]
        if len(eligible) < 2:
            continue
        first = torch.randint(len(eligible), (n_pairs,), generator=generator)            # (P,)
        second = (first + torch.randint(1, len(eligible), (n_pairs,), generator=generator)) % len(eligible)
        used = torch.cat([first, second]).unique()                                       # (U,) sorted
        rows = torch.tensor([[cls_id] + eligible[i][:length - 2] + [sep_id] for i in used.tolist()])  # (U, len)
        vectors = []
        for chunk in rows.split(batch_size):
            ids = chunk.to(device)
            mask = torch.ones_like(ids)
            vectors.append(pool(encoder(ids, mask), mask, pooling).float().cpu())       # (b, H)
        vectors = torch.cat(vectors)                                                     # (U, H)
        a, b = vectors[torch.searchsorted(used, first)], vectors[torch.searchsorted(used, second)]  # (P, H)
        result[length] = F.cosine_similarity(a, b, dim=-1).mean().item()
    encoder.train(was_training)
    return result


def plot_cls_by_length(curves, path, title=""):
    """SEED-Encoder Figure 5 (and Figure 1b): the mean cosine similarity of random pairs of texts against
    their length, one line per model and vector. curves: {(model label, "cls" or "mean"): {length: cos}}
    (cls_similarity_by_length); a model keeps its colour, [CLS] is solid and the mean dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(m for m, _ in curves))}
    for (model, vector), values in curves.items():
        label = f"{model}: {'[CLS]' if vector == 'cls' else 'mean'} vector"
        ax.plot(list(values), list(values.values()), marker="o", color=colors[model],
                linestyle="-" if vector == "cls" else "--", label=label)
    lengths = sorted({n for values in curves.values() for n in values})
    ax.set_xscale("log", base=2)
    lowest = min(min(values.values()) for values in curves.values())
    ax.set(xticks=lengths, xticklabels=[str(n) for n in lengths], ylim=(min(0.0, lowest), 1.0), title=title,
           xlabel="text length (tokens, [CLS] and [SEP] included)", ylabel="mean cosine of random text pairs")
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save_figure(fig, path)


def word_probabilities(probs, text, tokenizer):
    """CPDAE Table 4: each whole word of `text` with the summed normalised probability of its
    WordPiece pieces. probs: (V,) normalised word distribution (z~ = sigmoid(z) / sum).
    Returns [(word as written in text, value, start offset)] in text order."""
    probs = np.asarray(probs, dtype=np.float64)
    enc = tokenizer.encode(text, add_special_tokens=False)
    words = {}  # word index -> [start, end, value]
    for token_id, word, (start, end) in zip(enc.ids, enc.word_ids, enc.offsets):
        if word is None:
            continue
        entry = words.setdefault(word, [start, end, 0.0])
        entry[1] = max(entry[1], end)
        entry[2] += float(probs[token_id])
    return [(text[s:e], v, s) for s, e, v in (words[w] for w in sorted(words))]


def plot_word_distribution(probs, text, tokenizer, path, vmax=None, width_in=8.0, cmap="Reds"):
    """Shade each whole word of `text` by the summed probability of its pieces (CPDAE Table 4).
    vmax: value of the darkest shade (the paper's legend tops at 0.5); None -> the largest word
    value, because with a 30,522-word vocabulary a small model's values are often far below 0.5."""
    return plot_words(word_probabilities(probs, text, tokenizer), path, vmax, width_in, cmap)


def plot_words(words, path, vmax=None, width_in=8.0, cmap="Reds"):
    """plot_word_distribution's figure from word_probabilities' [(word, value, start)] (a row keeps those)."""
    import matplotlib.colors as mcolors

    plt = _pyplot()
    top = vmax if vmax is not None else max([v for _, v, _ in words] + [1e-12])
    norm = mcolors.Normalize(vmin=0.0, vmax=top)
    colors = plt.get_cmap(cmap)
    font, line_h, margin = 11, 0.32, 0.15  # points, inches, inches

    # Lay words out in inches: measure each word with a throwaway renderer, wrap at width_in.
    probe = plt.figure(figsize=(width_in, 1))
    renderer = probe.canvas.get_renderer()
    positions, x, line = [], margin, 0
    prev_end = None
    for word, value, start in words:
        t = probe.text(0, 0, word, fontsize=font)
        w = t.get_window_extent(renderer).width / probe.dpi + 2 * 1.5 / 72  # text + bbox padding
        gap = 0.07 if prev_end is not None and start > prev_end else 0.0  # keep "word," together
        if x + gap + w > width_in - margin and x > margin:
            x, line, gap = margin, line + 1, 0.0
        positions.append((x + gap, line))
        x += gap + w
        prev_end = start + len(word)
    plt.close(probe)

    height = 2 * margin + (line + 1) * line_h + 0.6  # text plus a colour bar
    fig = plt.figure(figsize=(width_in, height))
    for (word, value, _), (x, ln) in zip(words, positions):
        shade = colors(norm(value))
        dark = norm(value) > 0.6
        fig.text(x / width_in, 1 - (margin + (ln + 0.5) * line_h) / height, word, fontsize=font,
                 va="center", color="white" if dark else "black",
                 bbox=dict(facecolor=shade, edgecolor="none", pad=1.5))
    bar = fig.add_axes([margin / width_in, 0.25 / height, 0.5, 0.12 / height])
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=colors), cax=bar, orientation="horizontal")
    bar.set_xlabel("summed normalised probability of the word's pieces", fontsize=8)
    bar.tick_params(labelsize=7)
    _save_figure(fig, path)
    return words


# ---------------------------------------------------------------------------------------------
# CPDAE decoder (cpdae.py) for the word-distribution figure
# ---------------------------------------------------------------------------------------------
def word_distribution(encoder, decoder, tokenizer, text, max_len, device, bottleneck="cls"):
    """CPDAE eq. 2-3 and 3.2.2, by cpdae.word_distribution itself: z~ = sigmoid(decoder(h_cls)) / sum,
    the (V,) word distribution of `text`. bottleneck: the vector the decoder was trained on (cpdae.py
    --bottleneck): [CLS] (the paper's) or the mean of the output tokens."""
    ids, mask = data.encode_texts(tokenizer, [text], max_len)                          # (1, L)
    ids, mask = ids.to(device), mask.to(device)
    encoder.eval()
    decoder.eval()
    with torch.no_grad():
        h_cls = pool(encoder(ids, mask), mask, bottleneck)                              # (1, H)
        return cpdae.word_distribution(decoder(h_cls))[0].cpu().numpy()               # (V,)


def trained_bottleneck(folder):
    """The --bottleneck a pre-training run trained, from its config.json beside the encoder folder; "cls"
    when there is none (the papers')."""
    run_config = Path(folder).parent / "config.json"
    return data.read_json(run_config).get("bottleneck", "cls") if run_config.is_file() else "cls"


def load_cpdae_decoder(folder):
    """cpdae.py's MLP decoder from {folder}/decoder.safetensors (cpdae.py saves it beside the encoder)."""
    if not (Path(folder) / "decoder.safetensors").is_file():
        raise data.DataError(f"{Path(folder) / 'decoder.safetensors'}: not found; the word-distribution figure "
                             f"needs an encoder folder written by cpdae.py (or --decoder FOLDER)")
    return cpdae.Decoder.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------
# Mechanisms: each paper's claim measured directly, to set against its own ablation
# ---------------------------------------------------------------------------------------------
def held_out_sample(texts, n, seed=0):
    """A fixed sample of n of the texts (all of them when there are fewer) in a fixed random order, numpy
    default_rng(seed): every model and arm of a comparison reads the same texts, and neighbours (between
    whom --decoder_reliance swaps h0) are unrelated texts, not a file's consecutive ones."""
    order = np.random.default_rng(seed).permutation(len(texts))[:n]
    return [texts[i] for i in order]


def common_token_ids(idf, n, special_ids):
    """CPDAE section 3.3's common words S: the n tokens of lowest IDF (cpdae.cached_idf over the
    corpus the decoder was pre-trained on, the table IDF-REC weighs by), i.e. found in the most texts;
    special tokens never. Section 3.3's argument is about words that "appear in almost every document"
    of the training batches with the same high probability: the training corpus's document frequency
    says which those are. z_tilde is over WordPiece tokens, and a stopword list of English words
    would miss the punctuation and pieces ("," "." "##s") that take its mass. idf (V,) -> (n,) sorted ids."""
    idf = np.asarray(idf, dtype=np.float64).copy()
    idf[list(special_ids)] = np.inf
    order = np.lexsort((np.arange(len(idf)), idf))          # lowest IDF first, ties by the lower id
    return np.sort(order[:n])


def word_shares(probs, bag, common):
    """CPDAE section 3.3, measured per text: the mass of its word distribution z_tilde on the common
    words, sum_{j in S} z~_j, and on the text's representative words (in the text, not common),
    sum_{j in text \\ S} z~_j; beside each, the same share under a uniform z_tilde (|S| / V and
    |text \\ S| / V), the level a decoder that knows nothing reaches. Contrastive pre-training should
    lower the first and raise the second (claims 1 and 2). probs (N, V) rows summing to 1; bag (N, V)
    0/1, the text's tokens (cpdae.bag_of_words: never a special token); common (V,) bool.
    -> {name: (N,) per text}."""
    probs, bag, common = probs.float(), bag.bool(), common.bool()
    representative = bag & ~common                                                   # (N, V)
    vocab = probs.shape[1]
    return {"common": probs[:, common].sum(1), "representative": (probs * representative).sum(1),
            "common_uniform": torch.full((len(probs),), common.sum().item() / vocab),
            "representative_uniform": representative.sum(1).float() / vocab}


@torch.no_grad()
def cpdae_word_shares(encoder, decoder, tokenizer, texts, common_ids, max_len, bottleneck="cls", batch_size=32):
    """word_shares averaged over the texts: each text (unmasked, cut to max_len) encoded, its vector
    (bottleneck: the one the decoder was trained on) through the decoder, z_tilde by
    cpdae.word_distribution itself. -> {share: mean over texts, "n_texts": N}."""
    device = next(encoder.parameters()).device
    encoder.eval()
    decoder.eval()
    vocab, special = decoder.out.weight.shape[0], data.special_ids(tokenizer).values()
    common = torch.zeros(vocab, dtype=torch.bool)
    common[torch.as_tensor(np.asarray(common_ids), dtype=torch.long)] = True
    parts = []
    for start in range(0, len(texts), batch_size):
        ids, mask = data.encode_texts(tokenizer, texts[start:start + batch_size], max_len)      # (b, L)
        h = pool(encoder(ids.to(device), mask.to(device)), mask.to(device), bottleneck)        # (b, H)
        probs = cpdae.word_distribution(decoder(h)).cpu()                                      # (b, V)
        parts.append(word_shares(probs, cpdae.bag_of_words(ids, vocab, special), common))
    return {**{k: torch.cat([p[k] for p in parts]).mean().item() for k in parts[0]}, "n_texts": len(texts)}


def h0_reliance(decoder, weight, h0, decoder_input, targets):
    """SEED sections 3.2-3.4, measured: how much the decoder uses h0. Its eq. 9 loss (seed.decoder_loss,
    summed over the target tokens) with each text's own h0, and with another text's: h0 rolled by one
    row, so text i gets text i-1's (a permutation with no fixed point; the texts must differ). A
    decoder that bypasses the encoder, predicting from its own context, loses nothing when h0 is
    swapped (gap 0); one that reads the text from h0 loses what h0 told it. decoder(input, h0) ->
    (B, L, H) states; weight (V, H) its output projection; h0 (B, H); decoder_input, targets (B, L)
    (seed.decoder_inputs_and_targets). -> (own loss sum, other loss sum, target tokens, own states)."""
    states = decoder(decoder_input, h0)                                                        # (B, L, H)
    own = seed.decoder_loss(states, weight, targets, "sum")[0]
    other = seed.decoder_loss(decoder(decoder_input, h0.roll(1, 0)), weight, targets, "sum")[0]
    return own.item(), other.item(), int(targets.ne(-100).sum()), states


def cosine_by_position(states, h0, mask):
    """SEED Figure 4 for one batch: the cosine between the decoder's last-layer state at each position
    and the text's h0, summed over the texts that have that position. states (B, L, H); h0 (B, H);
    mask (B, L) 1 = a real input position. -> (sums (L,), counts (L,))."""
    mask = mask.float()
    cos = F.cosine_similarity(states.float(), h0.float()[:, None, :].expand_as(states), dim=-1)   # (B, L)
    return (cos * mask).sum(0), mask.sum(0)


@torch.no_grad()
def seed_decoder_reliance(encoder, decoder, ids, mask, bottleneck="cls", batch_size=32):
    """SEED's two measurements over held-out texts (ids, mask (N, L), '[CLS] .. [SEP]' unmasked): the
    encoder reads each text, the decoder rebuilds it from h0 (h0_reliance), and the cosine of its
    states with h0 by position (cosine_by_position). The states are WeakDecoder's output, the last
    layer after its final LayerNorm: what its output projection reads. Batches of near-equal size
    (at least 2 texts each: the swap needs another text). -> {"loss_own", "loss_other", "gap" (nats
    per token, other - own), "cosine_by_position" [position 0 = the start symbol, ...], "n_texts",
    "n_tokens"}."""
    if len(ids) < 2:
        raise ValueError(f"--decoder_reliance needs at least 2 texts (h0 is swapped between them); got {len(ids)}")
    device = next(encoder.parameters()).device
    encoder.eval()
    decoder.eval()
    own = other = 0.0
    n_tokens, sums, counts = 0, torch.zeros(ids.shape[1] - 1), torch.zeros(ids.shape[1] - 1)
    for rows in np.array_split(np.arange(len(ids)), math.ceil(len(ids) / batch_size)):
        batch_ids, batch_mask = ids[rows].to(device), mask[rows].to(device)                    # (b, L)
        h0 = pool(encoder(batch_ids, batch_mask), batch_mask, bottleneck)                      # (b, H)
        decoder_input, targets = seed.decoder_inputs_and_targets(batch_ids, batch_mask)        # (b, L-1)
        o, x, n, states = h0_reliance(decoder, decoder.word_embedding[0].weight, h0, decoder_input, targets)
        s, k = cosine_by_position(states, h0, batch_mask[:, :-1])                              # (L-1,)
        own, other, n_tokens, sums, counts = own + o, other + x, n_tokens + n, sums + s.cpu(), counts + k.cpu()
    return {"loss_own": own / n_tokens, "loss_other": other / n_tokens, "gap": (other - own) / n_tokens,
            "cosine_by_position": (sums / counts.clamp_min(1))[counts > 0].tolist(), "n_texts": len(ids),
            "n_tokens": n_tokens}


def load_seed_decoder(folder, encoder):
    """seed.py's weak decoder, from the state.pt of the run whose encoder folder is `folder` (seed.py
    keeps its decoder only there), its output projection tied to `encoder`'s word embedding, as in
    training. -> (decoder, the run's seed.Config)."""
    path = Path(folder).resolve().parent / "state.pt"
    if run_config(folder).get("script") != "seed.py":
        raise data.DataError(f"{folder}: not the encoder of a seed.py run (no {path.parent / 'config.json'} "
                             f"naming seed.py); --decoder_reliance needs SEED's decoder")
    state = run.folders.load_training_state(path)
    names = {f.name for f in dataclasses.fields(seed.Config)}
    c = seed.Config(**{k: v for k, v in state["config"].items() if k in names})
    decoder = seed.WeakDecoder(c, encoder.embeddings.word)
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in state["model"].items() if k.startswith("decoder.")})
    return decoder.to(next(encoder.parameters()).device), c


def separation(query_vec, doc_vecs, relevant):
    """COSTA section 5.4 / Figure 3 as numbers for one query: how far its relevant documents sit from
    it against its other candidates, in cosine (the geometry Figure 3 draws, whatever the vectors'
    lengths). auc: the fraction of (relevant, other) pairs whose relevant document is the closer
    (ties count half): 1 = every relevant one closer than every other, 0.5 = no better than chance.
    margin: (mean cosine of the relevant - mean of the others) / the others' sd (population): how many
    spreads of the crowd the relevant sit ahead of it; nan when the others' cosines are all equal.
    query_vec (H,), doc_vecs (K, H), relevant (K,) bool with at least one of each. -> (auc, margin)."""
    cos = F.cosine_similarity(torch.as_tensor(doc_vecs, dtype=torch.float64),
                              torch.as_tensor(query_vec, dtype=torch.float64)[None], dim=-1).numpy()   # (K,)
    relevant = np.asarray(relevant, dtype=bool)
    if relevant.all() or not relevant.any():
        raise ValueError("separation needs at least one relevant document and one other")
    near, far = cos[relevant], cos[~relevant]
    auc = ((near[:, None] > far[None]).mean() + 0.5 * (near[:, None] == far[None]).mean())
    spread = far.std()
    return float(auc), float((near.mean() - far.mean()) / spread) if spread > 0 else math.nan


def discrimination(query_vecs, doc_vecs, candidates, relevant):
    """COSTA's discriminativeness over every query: separation of each query's relevant documents against
    its other candidates. query_vecs (Q, H), doc_vecs (N, H); candidates and relevant: Q lists of rows of
    doc_vecs (the relevant ones are added to the candidates). A query whose candidates are all relevant
    has nothing to be set against: left out (None in per_query). -> {"auc", "margin": means over the
    queries measured (margin over those where it is defined; None if none), "n_queries" (measured),
    "n_left_out", "per_query": [(auc, margin or None) or None]}."""
    per_query = []
    for q, rows in enumerate(relevant):
        pool = np.array(sorted(set(candidates[q]) | set(rows)))                                     # (K,)
        is_relevant = np.isin(pool, rows)                                                          # (K,)
        per_query.append(separation(query_vecs[q], doc_vecs[pool], is_relevant) if not is_relevant.all() else None)
    measured = [p for p in per_query if p is not None]
    margins = [m for _, m in measured if not math.isnan(m)]
    return {"auc": float(np.mean([a for a, _ in measured])) if measured else None,
            "margin": float(np.mean(margins)) if margins else None, "n_queries": len(measured),
            "n_left_out": len(per_query) - len(measured),
            "per_query": [p and (p[0], None if math.isnan(p[1]) else p[1]) for p in per_query]}


def plot_decoder_cosine(curves, path, title=""):
    """SEED Figure 4: the cosine between the decoder's last-layer state at each position and h0, one
    line per model (the paper: full attention against the span-2 decoder). curves: {model label:
    [cosine at position 0, 1, ...]} (seed_decoder_reliance's "cosine_by_position")."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for model, values in curves.items():
        ax.plot(range(len(values)), values, label=model)
    lowest = min([0.0] + [min(v) for v in curves.values() if v])
    ax.set(xlabel="decoder position (0 = the start symbol, beside [CLS])", ylabel="cosine(decoder state, h0)",
           ylim=(lowest, 1.0), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save_figure(fig, path)


def run_config(folder):
    """The config.json of the pre-training run whose encoder folder is `folder` ({} for a model no run of
    ours wrote: MiniLM, a hub id)."""
    path = Path(folder).resolve().parent / "config.json"
    return data.read_json(path) if path.is_file() else {}


def command_line(c):
    """The command that remakes c: `python -m research.mechanisms` (from the repository root) and every flag that
    differs from its default. (Rows written before the research package recorded it as `python mechanisms.py ...`.)"""
    flags = []
    for f in dataclasses.fields(Config):
        value = getattr(c, f.name)
        if value != f.default:
            flags += [f"--{f.name}"] + ([] if value is True else [str(value).lower() if value is False else str(value)])
    return shlex.join(["python", "-m", "research.mechanisms", *flags])



def mechanism_row(c, measure, model, tag, numbers):
    """One JSON row of a mechanism measurement: the measure, the run (method: the script that trained it;
    arm: --tag, else the run folder's name; seed: its --seed; null for a model no run of ours trained),
    the code (commit, dirty), the command that remakes it, the model folder, then the numbers."""
    config = run_config(model)
    commit, dirty = git_state()
    return {"measure": measure, "method": Path(config["script"]).stem if "script" in config else None, "arm": tag,
            "seed": config.get("seed"), "commit": commit, "dirty": dirty, "command": command_line(c),
            "model": str(model), **numbers}


def write_rows(out_dir, measure, rows):
    """Each row to {out_dir}/{measure}-{arm}-seed{seed}.json ({measure}-{arm}.json for a model without a
    run; -step{step} added for a --heads row), atomically, one file a row: an arm's other seeds and steps
    and the other arms' rows stay as they are."""
    for row in rows:
        seed = "" if row["seed"] is None else f"-seed{row['seed']}"
        step = f"-step{row['step']}" if measure == "heads" else ""
        run.files.atomic_write_json(Path(out_dir) / f"{measure}-{trec_tag(row['arm'])}{seed}{step}.json", row)


def held_out_texts(c, model):
    """The texts of --word_shares and --decoder_reliance: --corpus, else the dataset's corpus.jsonl,
    sampled (held_out_sample, --n_texts). -> (texts, whether they are held out: not the corpus the run
    pre-trained on)."""
    path = Path(c.corpus or data.find_file(c.dataset, "corpus.jsonl")).resolve()
    trained_on = run_config(model).get("corpus")
    texts = held_out_sample(data.read_pretraining_texts(path), c.n_texts)
    return texts, not (trained_on and Path(trained_on).resolve() == path)


def word_shares_command(c, device):
    """--word_shares: CPDAE's claim (section 3.3) for every model of --model (cpdae.py encoder folders,
    each with its decoder): word_shares over the held-out texts, the common words the --n_common of
    lowest IDF in the run's own pre-training corpus (common_token_ids). One row per model."""
    rows = []
    for model, tag in model_list(c):
        m = model_settings(c, model, tag)
        encoder, tokenizer = load_model(m, device)
        config = run_config(m.model)
        if config.get("script") != "cpdae.py":
            raise data.DataError(f"{m.model}: not the encoder of a cpdae.py run (no config.json beside it naming "
                                 f"cpdae.py); --word_shares needs the run's corpus for its common words")
        decoder = load_cpdae_decoder(m.model).to(device)
        windows = run.cache.token_windows(config["corpus"], config["vocab"], config["max_len"], 0, config.get("cache_dir", ""))
        common = common_token_ids(cpdae.cached_idf(windows, decoder.out.weight.shape[0], 0).numpy(), c.n_common,
                                  data.special_ids(tokenizer).values())
        texts, held_out = held_out_texts(c, m.model)
        numbers = cpdae_word_shares(encoder, decoder, tokenizer, texts, common, config["max_len"], config.get("bottleneck", "cls"))
        rows.append(mechanism_row(c, "word_shares", m.model, tag, {**numbers, "held_out": held_out, "n_common": c.n_common,
                                                                   "common_words": [tokenizer.id_to_token(int(i)) for i in common]}))
        print(f"{tag}: z_tilde on the {c.n_common} common words {numbers['common']:.4f} (uniform "
              f"{numbers['common_uniform']:.4f}), on the text's own other words {numbers['representative']:.4f} "
              f"(uniform {numbers['representative_uniform']:.4f}), {len(texts)} texts", flush=True)
    return rows


def decoder_reliance_command(c, out_dir, device):
    """--decoder_reliance: SEED's claim (sections 3.2-3.4, Figures 4-5) for every model of --model
    (seed.py encoder folders; their decoders from state.pt): seed_decoder_reliance over the held-out
    texts cut to the run's --max_len, Figure 5's random-pair cosine by length, and Figure 4, one line
    per model, to decoder_cosine.png. One row per model."""
    rows, curves = [], {}
    for model, tag in model_list(c):
        m = model_settings(c, model, tag)
        encoder, tokenizer = load_model(m, device)
        decoder, run_c = load_seed_decoder(m.model, encoder)
        texts, held_out = held_out_texts(c, m.model)
        ids, mask = data.encode_texts(tokenizer, texts, run_c.max_len)                        # (N, L)
        numbers = seed_decoder_reliance(encoder, decoder, ids, mask, run_c.bottleneck)
        lengths = [n for n in (32, 64, 128, 256, 512) if n <= encoder.config.max_position]
        numbers["cosine_by_length"] = cls_similarity_by_length(encoder, tokenizer, texts, lengths, pooling=run_c.bottleneck)
        rows.append(mechanism_row(c, "decoder_reliance", m.model, tag, {**numbers, "held_out": held_out,
                                                                        "dec_span": run_c.dec_span}))
        curves[f"{tag} (span {run_c.dec_span or 'full'})"] = numbers["cosine_by_position"]
        print(f"{tag}: decoder loss {numbers['loss_own']:.3f} with its own h0, {numbers['loss_other']:.3f} with "
              f"another text's (gap {numbers['gap']:.3f} nats/token), {len(texts)} texts", flush=True)
    path = Path(out_dir) / "decoder_cosine.png"
    plot_decoder_cosine(curves, path, "SEED-Encoder Figure 4: decoder states against h0, by position")
    print(f"cosine of the decoder's states with h0 by position: {path}")
    return rows


CANDIDATES = 100   # --discrimination: each query's candidates, BM25's top 100 (Figure 3 draws a top 100)


def discrimination_command(c, split, device):
    """--discrimination: COSTA's claim (section 5.4, Figure 3) for every model of --model on every judged
    query of the split with a relevant document: discrimination of its relevant documents against the
    other candidates of BM25's top 100 (--k1, --b), the same documents for every model, so that arms
    are set side by side on one pool and a model blind to relevance sits at auc 0.5 (against its own
    top 100 a relevant document it misses would lose every pair, and chance would be near 0). Plus the
    random-pair cosine by length of the corpus's texts (Figure 5's curve). The model's own pooling. One
    row per model."""
    corpus, queries, qrels = load_eval_split(c, split)
    doc_ids = list(corpus)
    row_of = {d: i for i, d in enumerate(doc_ids)}
    qids = [q for q in sorted(qrels) if any(g > 0 and d in row_of for d, g in qrels[q].items())]
    doc_texts = [passage_text(corpus[d]) for d in doc_ids]
    scores, top = BM25(doc_texts, c.k1, c.b).search([queries[q] for q in qids], CANDIDATES)        # (Q, 100)
    candidates = [top[i][scores[i] > 0].tolist() for i in range(len(qids))]                      # as BM25's run
    relevant = [[row_of[d] for d, g in qrels[q].items() if g > 0 and d in row_of] for q in qids]
    used = sorted({r for rows in candidates + relevant for r in rows})       # only these documents are encoded
    place = {r: i for i, r in enumerate(used)}
    candidates, relevant = ([[place[r] for r in rows] for rows in lists] for lists in (candidates, relevant))
    rows = []
    for model, tag in model_list(c):
        m = model_settings(c, model, tag)
        encoder, tokenizer = load_model(m, device)
        args = (m.encode_batch, device, m.bf16, m.similarity)
        doc_vecs = encode(encoder, m.pooling, tokenizer, [doc_texts[r] for r in used], m.passage_len, *args)  # (U, H)
        query_vecs = encode(encoder, m.pooling, tokenizer, [queries[q] for q in qids], m.query_len, *args)    # (Q, H)
        numbers = discrimination(query_vecs, doc_vecs, candidates, relevant)
        numbers["per_query"] = dict(zip(qids, numbers["per_query"]))
        lengths = [n for n in (32, 64, 128, 256, 512) if n <= encoder.config.max_position]
        numbers["cosine_by_length"] = cls_similarity_by_length(encoder, tokenizer, doc_texts, lengths, pooling=m.pooling)
        rows.append(mechanism_row(c, "discrimination", m.model, tag, {**numbers, "split": split,
                                                                      "candidates": f"bm25 top {CANDIDATES}"}))
        print(f"{tag}: relevant closer than BM25's other top-{CANDIDATES} candidates in {numbers['auc'] or math.nan:.3f} "
              f"of the pairs, {numbers['margin'] or math.nan:.2f} sd ahead, over {numbers['n_queries']} queries "
              f"({numbers['n_left_out']} without another candidate)", flush=True)
    return rows


def held_out_heads(folder, corpus, n_windows, device="cpu"):
    """Each term of a pre-training run's own objective on the windows of `corpus`, with what it logs
    (each accuracy X_acc beside its trivial baseline X_chance): the run's PretrainModel rebuilt from
    its state.pt, its own Batches (masks, views, spans as in training; the run's --seed and --batch_size,
    on which a contrastive chance depends, for one process) over n_windows // batch_size batches of them,
    dropout off, in fp32 (training ran under run.autocast_bf16: its logged losses differ by bf16's
    rounding). The pilot's curve of a head against the step, and the check that a head trained past
    chance on windows it never saw. -> {name: mean over the batches}."""
    state = run.folders.load_training_state(Path(folder).resolve().parent / "state.pt")
    module = importlib.import_module(Path(run_config(folder)["script"]).stem)
    names = {f.name for f in dataclasses.fields(module.Config)}
    c = module.Config(**{k: v for k, v in state["config"].items() if k in names})
    c = dataclasses.replace(c, init="", grad_accum=1, steps=max(1, n_windows // c.batch_size))
    trained_on = run.cache.token_windows(c.corpus, c.vocab, c.max_len, 0, c.cache_dir)
    idf = {"idf": module.cached_idf(trained_on, c.vocab_size, 0)} if getattr(c, "idf_rec", False) else {}
    model = module.PretrainModel(c, module.Encoder(c), frequent_token=data.most_frequent_token(trained_on), **idf)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    windows = run.cache.token_windows(corpus, c.vocab, c.max_len, 0, "")
    batches = module.Batches(c, windows, 0, 1)
    sums = {}
    with torch.no_grad():
        for i in range(len(batches)):
            terms, metrics = model.terms({k: v.to(device) for k, v in batches[i].items()})
            for name, value in {**terms, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + float(value)
    return {"step": state["step"], "steps": state["config"]["steps"],
            "n_windows": len(batches) * c.batch_size,
            **{name: total / len(batches) for name, total in sums.items()}}


def heads_command(c, device):
    """--heads: held_out_heads for every model of --model (encoder folders of our pre-training runs) on
    the windows of --corpus, and Figure 5's random-pair cosine by length of its texts (the run's
    bottleneck vector), so every arm, decoder or none, has that curve on the same texts. One row per model."""
    rows = []
    for model, tag in model_list(c):
        m = model_settings(c, model, tag)
        if not c.corpus:
            raise ValueError("--heads: give --corpus, the held-out text whose windows the heads are measured on")
        if "script" not in run_config(m.model):
            raise data.DataError(f"{m.model}: not the encoder of one of our pre-training runs (no config.json beside "
                                 f"it naming its script); --heads needs the run's state.pt")
        encoder, tokenizer = load_model(m, device)
        texts, held_out = held_out_texts(c, m.model)
        numbers = held_out_heads(m.model, c.corpus, c.n_texts, device)
        lengths = [n for n in (32, 64, 128, 256, 512) if n <= encoder.config.max_position]
        numbers["cosine_by_length"] = cls_similarity_by_length(encoder, tokenizer, texts, lengths,
                                                               pooling=trained_bottleneck(m.model))
        rows.append(mechanism_row(c, "heads", m.model, tag, {**numbers, "held_out": held_out}))
        print(f"{tag} at step {numbers['step']}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in numbers.items() if isinstance(v, float)), flush=True)
    return rows


MECHANISMS = ("word_shares", "decoder_reliance", "discrimination", "heads")   # the mechanism measurements' flags


def mechanisms_command(c, split, out_dir, device):
    """--word_shares, --decoder_reliance, --discrimination (any of them together): each measure's rows
    for every model of --model, written to the out_dir (write_rows). -> {measure: rows}."""
    commands = {"word_shares": lambda: word_shares_command(c, device),
                "decoder_reliance": lambda: decoder_reliance_command(c, out_dir, device),
                "discrimination": lambda: discrimination_command(c, split, device),
                "heads": lambda: heads_command(c, device)}
    result = {}
    for measure in MECHANISMS:
        if getattr(c, measure):
            result[measure] = commands[measure]()
            write_rows(out_dir, measure, result[measure])
            print(f"{measure}: {len(result[measure])} row(s) in {out_dir}")
    return result


# ---------------------------------------------------------------------------------------------
# The decoder-side claims on a frozen real encoder (CPDAE 3.3; SEED 3.2-3.4 and Figure 4)
# ---------------------------------------------------------------------------------------------
# Both claims are about what a decoder does with the text vector: CPDAE's MLP turns it into a word
# distribution, SEED's weak decoder rebuilds the text from it. Their precondition is a vector that holds the
# text, which a small encoder trained from scratch here never gave (docs/mechanisms.md). So the encoder is a
# real one (--model minilm), frozen: its vectors of every window are computed once, and only the paper's
# decoder trains, through the method file's own functions (cpdae.reconstruction_loss, contrastive_loss,
# js_similarity; seed.WeakDecoder, decoder_loss), against its ablation, over several seeds.
WARMUP_STEPS = 50   # --frozen: linear warm-up, then a constant lr: a run's state at step s is a run of s steps
TABLE4_TEXT = ("Nanotechnology raises many of the same issues as any new technology, including concerns about the "
               "toxicity and environmental impact of nanomaterials, and their potential effects on global economics, "
               "as well as speculation")   # CPDAE Table 4's figure, drawn from each --frozen cpdae row


@torch.no_grad()
def frozen_vectors(encoder, windows, pooling, mask_seed=0, batch=64, names=("plain", "view1", "view2")):
    """The windows' ids and the frozen encoder's vectors of each: "plain" (the unmasked text: a text's word
    distribution at test time) and two independently masked views, "view1" and "view2" (BERT's 15 % masks, as
    the methods' encoders read them in training: CPDAE's two views, SEED's h0 from view1). The masks are drawn
    once (mask_seed), the same for every trial; names: the vectors to compute. -> {name: tensor}, one row per window."""
    special = windows.special
    ids, mask = data.pad_batch([windows[i].input_ids for i in range(len(windows))])            # (N, L)
    maskable = mask.bool() & (ids != special["cls"]) & (ids != special["sep"])
    generator = torch.Generator().manual_seed(mask_seed)
    views = [data.mask_tokens(ids, maskable, encoder.config.vocab_size, special["mask"], generator)[0]
             for _ in range(2)]                                                              # (N, L) each
    encoder.eval()
    out = {"ids": ids, "mask": mask}
    start = time.time()
    sources = [(name, source) for name, source in (("plain", ids), ("view1", views[0]), ("view2", views[1]))
               if name in names]
    for done, (name, source) in enumerate(sources, 1):
        parts = []
        for rows in torch.arange(len(ids)).split(batch):
            with run.autocast_bf16(torch.device("cpu")):
                hidden = encoder(source[rows], mask[rows])                                     # (b, L, H)
            parts.append(pool(hidden.float(), mask[rows], pooling))                            # (b, H)
        out[name] = torch.cat(parts)                                                           # (N, H)
        elapsed = time.time() - start
        print(f"  {name}: {len(ids):,} windows encoded ({done * len(ids) / elapsed:.0f} windows/s; about "
              f"{elapsed / done * (len(sources) - done):.0f} s to go)", flush=True)
    return out


def frozen_cache_path(c, corpus):
    """Where cached_frozen_vectors keeps corpus's vectors: one file per model, corpus, length, pooling and mask draw."""
    key = zlib.crc32(f"{Path(c.model).resolve()}|{run.cache.corpus_signature(corpus, c.vocab or data.VOCAB)}|"
                     f"{c.max_len}|{c.pooling}".encode())
    masks = f"-m{c.mask_seed}" if c.mask_seed else ""   # each --mask_seed its own draw of the masked views
    return Path(c.frozen_cache) / f"{Path(corpus).stem}-L{c.max_len}-{key:08x}{masks}.safetensors"


def cached_frozen_vectors(c, corpus, encoder):
    """frozen_vectors of corpus's windows (--max_len), computed once per model, corpus and length and kept in
    --frozen_cache (tens of MB), so that every trial and seed reads the same vectors."""
    windows = run.cache.token_windows(corpus, c.vocab or data.VOCAB, c.max_len, 0, "")
    path = frozen_cache_path(c, corpus)
    if path.is_file():
        return run.files.load_tensors(path)
    start = time.time()
    vectors = frozen_vectors(encoder, windows, c.pooling, c.mask_seed)
    run.files.save_tensors(path, vectors)
    print(f"{corpus}: {len(windows):,} windows, the frozen encoder's vectors of each (plain and two masked views) in "
          f"{time.time() - start:.0f} s, kept in {path}", flush=True)
    return vectors


def bag_of_words(ids, vocab_size, special):
    """cpdae.bag_of_words (eq. 4's y, which it builds on the CPU) on the device of ids (B, L). -> (B, V)."""
    return cpdae.bag_of_words(ids.cpu(), vocab_size, special).to(ids.device)


def df_log_odds(ids, vocab_size, special):
    """CPDAE's constant predictor: every text gets the same logits, the log-odds of each word's document
    frequency in the training windows (smoothed by half a window, so every logit is finite). The reference a
    decoder that reads its text must beat. ids (N, L) -> ((V,) logits, (V,) document frequency)."""
    df = bag_of_words(ids, vocab_size, special).sum(0)                                   # (V,) windows
    p = (df + 0.5) / (len(ids) + 1)                                                            # (V,)
    return torch.log(p) - torch.log1p(-p), df


def matched_contrastive_loss(view1, view2, similarity):
    """The matched control's eq. 5: the views of the CL arm's own batch, but anchor i's positive is the second
    view of window i + 1 (mod M) and its own second view is left out of its candidates (neither positive nor
    negative), so L_CL pulls and spreads z~ as in the CL arm but cannot reward or punish a text's two views for
    being alike. view1, view2 (M, D). -> (loss, accuracy: chance 1 / (2M - 2))."""
    M = view1.shape[0]
    sim = similarity(view1, torch.cat([view1, view2])).float()                   # (M, 2M) s(z'_i, z_k)
    rows = torch.arange(M, device=sim.device)                                    # (M,)
    own = F.one_hot(rows, 2 * M).bool() | F.one_hot(M + rows, 2 * M).bool()      # (M, 2M) z'_i itself and z''_i
    sim = sim.masked_fill(own, float("-inf"))
    positive = M + (rows + 1) % M                                                # (M,) z''_{i+1}
    accuracy = (sim.argmax(dim=1) == positive).float().mean()
    return F.cross_entropy(sim, positive), accuracy


def arm_contrastive_loss(c):
    """Eq. 5 as the arm trains it (and as its pull gate measures it): each view's positive its text's other view,
    or with --cl_positive matched matched_contrastive_loss's pairing. -> f(view1, view2, similarity)."""
    return matched_contrastive_loss if c.cl_positive == "matched" else cpdae.contrastive_loss


def cpdae_step(decoder, view1, view2, bag, c):
    """Eq. 6 without L_MLM (the encoder is frozen: L_MLM is a constant): L_REC of both views' word
    distributions against the text's bag of words, + lambda L_CL between the views (eq. 5, s = -JS / tau; the
    matched control's pairing with --cl_positive matched). view1, view2 (m, H); bag (m, V).
    -> (loss, {"rec", "cl", "cl_acc"}, logits (2m, V))."""
    logits = decoder(torch.cat([view1, view2]))                                                # (2m, V) eq. 2
    rec = cpdae.reconstruction_loss(logits, bag.repeat(2, 1), None, c.rec_reduction)           # eq. 4
    similarity = partial(run.speed.in_row_chunks(cpdae.js_similarity, 8), tau=c.cl_tau)
    cl, accuracy = arm_contrastive_loss(c)(*cpdae.word_distribution(logits).chunk(2), similarity)  # eq. 5
    loss = rec + c.cl_weight * cl if c.cl_weight else rec                                      # eq. 6
    return loss, {"rec": rec, "cl": cl, "cl_acc": accuracy}, logits


def cpdae_gradient_ratio(logits, bag, c):
    """How hard L_CL pulls against L_REC where both act, the decoder's output z: |dL_CL/dz| / |dL_REC/dz|
    (Frobenius norms; L_REC with --rec_reduction, L_CL with --cl_tau, unweighted: lambda times it is the
    contrastive term's push on z against the reconstruction's), on the arm's own training pairs
    (arm_contrastive_loss). logits (2m, V) [views 1; views 2], bag (m, V)."""
    z = logits.detach().requires_grad_()                                                       # (2m, V)
    rec = cpdae.reconstruction_loss(z, bag.repeat(2, 1), None, c.rec_reduction)
    cl, _ = arm_contrastive_loss(c)(*cpdae.word_distribution(z).chunk(2),
                                   partial(run.speed.in_row_chunks(cpdae.js_similarity, 8), tau=c.cl_tau))
    return float(torch.autograd.grad(cl, z)[0].norm() / torch.autograd.grad(rec, z)[0].norm())


def cpdae_measures(decoder, held, constant, common, special, c):
    """CPDAE's gates and section 3.3's measures on held-out windows, in batches of m (--batch_size): L_REC
    (eq. 4 summed, as printed) beside the constant predictor's; L_CL and its accuracy (chance 1 / (2m - 1));
    cpdae_gradient_ratio; and the shares of each unmasked text's word distribution on the common words and on
    its own other words (word_shares), the constant predictor's beside them. -> {name: mean over batches}."""
    decoder.eval()
    m, sums = c.batch_size, {}
    batches = [rows for rows in torch.arange(len(held["ids"])).split(m) if len(rows) == m]
    for rows in batches:
        bag = bag_of_words(held["ids"][rows], len(constant), special)                          # (m, V)
        with torch.no_grad():
            _, parts, logits = cpdae_step(decoder, held["view1"][rows], held["view2"][rows], bag,
                                          dataclasses.replace(c, rec_reduction="sum"))
            text = cpdae.word_distribution(decoder(held["plain"][rows]))                       # (m, V)
            numbers = {**parts, "rec_constant": cpdae.reconstruction_loss(constant.expand(m, -1), bag)}
            for prefix, probs in (("", text), ("constant_", cpdae.word_distribution(constant.expand(m, -1)))):
                numbers.update({prefix + k: v.mean() for k, v in word_shares(probs, bag, common).items()})
        numbers["grad_cl_over_rec"] = cpdae_gradient_ratio(logits, bag, c)
        for name, value in numbers.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return {**{k: v / len(batches) for k, v in sums.items()}, "cl_chance": 1 / (2 * m - 1), "n_windows": len(batches) * m}


def other_texts(order, n, rows):
    """The control arm's second texts: len(rows) training windows drawn (numpy Generator `order`) from the n
    windows that are not in rows, so no text is in a step twice. rows (m,) -> (m,) long."""
    rest = np.setdiff1d(np.arange(n), rows.numpy())
    return torch.as_tensor(order.choice(rest, len(rows), replace=False))


def cpdae_control_step(decoder, train, rows, other, bag, vocab, special, c):
    """The control arm (--cl_positive other): the CL arm's pull with no text identity. Eq. 6 as cpdae_step (the
    same L_REC, eq. 5 and lambda) on the first views of texts `rows` and the second views of m other texts
    `other`, each view reconstructing its own text, text i's positive the view of other[i]: L_CL can pull and
    spread z~ as in the CL arm, but no text's two views meet. bag (m, V) the texts of rows. -> the loss."""
    logits = decoder(torch.cat([train["view1"][rows], train["view2"][other]]))                 # (2m, V) eq. 2
    bags = torch.cat([bag, bag_of_words(train["ids"][other], vocab, special)])                 # (2m, V)
    rec = cpdae.reconstruction_loss(logits, bags, None, c.rec_reduction)                       # eq. 4
    similarity = partial(run.speed.in_row_chunks(cpdae.js_similarity, 8), tau=c.cl_tau)
    cl, _ = cpdae.contrastive_loss(*cpdae.word_distribution(logits).chunk(2), similarity)     # eq. 5
    return rec + c.cl_weight * cl                                                              # eq. 6


def rank_auc(scores, positive, negative):
    """Per row, the AUC of its positive entries against its negative ones by score: the chance that a random
    positive scores above a random negative, ties counting one half (average ranks). It reads only the order
    of a row's scores, so any increasing map of them (a rescaling, a temperature, a mix with the uniform)
    leaves it as it is. scores (N, V); positive, negative (N, V) bool, disjoint. -> (N,) float64, nan where a
    row lacks positives or negatives."""
    scores, positive, negative = scores.cpu(), positive.cpu(), negative.cpu()                  # numpy's
    keep = (positive | negative).numpy()
    values = np.where(keep, scores.double().numpy(), -np.inf)                                  # (N, V) the rest lowest
    ranks = stats.rankdata(values, axis=1) - (~keep).sum(1, keepdims=True)                     # (N, V) 1.. among kept
    n_pos, n_neg = positive.sum(1).double().numpy(), negative.sum(1).double().numpy()          # (N,)
    above = (ranks * positive.numpy()).sum(1) - n_pos * (n_pos + 1) / 2                        # (N,) pairs won
    with np.errstate(invalid="ignore", divide="ignore"):
        return torch.as_tensor(np.where((n_pos > 0) & (n_neg > 0), above / (n_pos * n_neg), np.nan))


def text_word_measures(logits, bag, common, special):
    """CPDAE section 3.3 per text in forms a flatter z~ cannot move (the confirmatory round's primary measures),
    beside numbers that show whether it flattened. The text's words: its tokens not common. auc_text: the AUC
    of the text's words against the non-common words not in it; auc_common: against the common words (both by
    z~'s order, read from the logits z, whose order within a text is z~'s). share_noncommon: the text's share
    of z~'s non-common mass; entropy: of z~ (nats); sigmoid_sum: sum_j sigmoid(z_j), which eq. 3 divides by.
    logits (N, V); bag (N, V) 0/1 (never a special token); common (V,) bool; special: ids. -> {name: (N,)}."""
    probs = cpdae.word_distribution(logits)                                                    # (N, V)
    ordinary = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
    ordinary[list(special)] = False                                                            # (V,)
    bag, common = bag.bool(), common.bool()
    own = bag & ~common                                                                        # (N, V)
    absent = ~bag & ~common & ordinary                                                         # (N, V)
    return {"auc_text": rank_auc(logits, own, absent),
            "auc_common": rank_auc(logits, own, common.expand_as(own) & ~own),
            "share_noncommon": (probs * own).sum(1) / (probs * (~common & ordinary)).sum(1),
            "entropy": -(probs * torch.log(probs.clamp_min(1e-30))).sum(1),
            "sigmoid_sum": torch.sigmoid(logits.float()).sum(1)}


@torch.no_grad()
def cpdae_text_measures(decoder, held, common, special, batch_size):
    """text_word_measures of each held-out window's unmasked text, through the decoder: the mean over the texts
    of each, and every text's value (name_by_text, 6 digits) for a test across texts. -> {name: ...}."""
    decoder.eval()
    parts = {}
    for rows in torch.arange(len(held["ids"])).split(batch_size):
        logits = decoder(held["plain"][rows]).float()                                          # (b, V)
        bag = bag_of_words(held["ids"][rows], logits.shape[1], special)                        # (b, V)
        for name, value in text_word_measures(logits, bag, common, special).items():
            parts.setdefault(name, []).append(value.double().cpu())
    out = {}
    for name, chunks in parts.items():
        value = torch.cat(chunks)                                                              # (N,)
        out[name] = float(value.nanmean())
        out[f"{name}_by_text"] = [round(float(v), 6) for v in value]
    return out


def seed_decoder(c, encoder):
    """SEED's weak decoder (seed.WeakDecoder, --dec_layers blocks, span --dec_span: 2 = the paper's weak one,
    0 = full causal, the "strong" one) at the frozen encoder's sizes, its output projection the encoder's word
    embedding, tied as in training and frozen with it."""
    e = encoder.config
    sizes = dict(hidden_size=e.hidden_size, num_heads=e.num_heads, ffn_size=e.ffn_size, vocab_size=e.vocab_size,
                 layer_norm_eps=e.layer_norm_eps, max_position=c.max_len)
    return seed.WeakDecoder(seed.Config(dec_span=c.dec_span, dec_layers=c.dec_layers, **sizes), encoder.embeddings.word)


def seed_token_losses(decoder, h0, ids, mask):
    """Eq. 9's loss of each target token with each text's own h0 and with another text's (h0 rolled by one row:
    text i gets text i-1's), and the cosine of the decoder's last-layer state with h0 (Figure 4), each a (B, L-1)
    grid, 0 where there is no target. h0 (B, H); ids, mask (B, L) the unmasked windows. -> (own, other, cosine,
    kept)."""
    decoder_input, targets = seed.decoder_inputs_and_targets(ids, mask)                       # (B, L-1)
    weight = decoder.word_embedding[0].weight                                                 # (V, H)
    kept = targets != -100                                                                    # (B, L-1)

    def per_token(h):
        states = decoder(decoder_input, h)                                                    # (B, L-1, H)
        logits = (states @ weight.T).float()                                                  # (B, L-1, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets), states

    own, states = per_token(h0)
    other, _ = per_token(h0.roll(1, 0))
    cosine = F.cosine_similarity(states.float(), h0.float()[:, None, :].expand_as(states), dim=-1)  # (B, L-1)
    return own * kept, other * kept, cosine * kept, kept


def slope(curve, first=1):
    """The least-squares slope of a curve over its positions from `first` on, per 100 positions."""
    y = np.asarray(curve[first:], dtype=np.float64)
    return float(np.polyfit(np.arange(first, first + len(y)), y, 1)[0] * 100)


@torch.no_grad()
def seed_measures(decoder, held, unigram, batch=16):
    """SEED's gates and measures on held-out windows: the decoder's loss with its own h0 (view1's vector) and
    with another text's, per token and by position (the h0-swap gap: the causal form of Figure 4), the cosine
    of its states with h0 by position (Figure 4 as drawn), each curve's slope over t >= 1 (per 100 positions),
    and the unigram model's loss (unigram: (V,) log-probabilities of the training tokens)."""
    decoder.eval()
    device = held["ids"].device
    sums = {k: torch.zeros(held["ids"].shape[1] - 1, dtype=torch.float64, device=device)
            for k in ("own", "other", "cosine", "n")}
    for rows in torch.arange(len(held["ids"])).split(batch):
        with run.autocast_bf16(device):   # as in training: the (B, L, V) logits' matmul in bf16
            grids = seed_token_losses(decoder, held["view1"][rows], held["ids"][rows], held["mask"][rows])
        for name, grid in zip(("own", "other", "cosine", "n"), grids):
            sums[name] += grid.double().sum(0)                                               # (L-1,)
    present, n = sums["n"] > 0, sums["n"].clamp_min(1)
    gap = ((sums["other"] - sums["own"]) / n)[present].tolist()
    cosine = (sums["cosine"] / n)[present].tolist()
    targets = seed.decoder_inputs_and_targets(held["ids"], held["mask"])[1]
    tokens = float(sums["n"].sum())
    return {"loss_own": float(sums["own"].sum()) / tokens, "loss_other": float(sums["other"].sum()) / tokens,
            "gap": float((sums["other"] - sums["own"]).sum()) / tokens,
            "unigram": float(-unigram[targets[targets != -100]].mean()), "gap_slope": slope(gap),
            "cosine_slope": slope(cosine), "gap_by_position": gap, "cosine_by_position": cosine,
            "n_windows": len(held["ids"]), "n_tokens": int(tokens)}


@torch.no_grad()
def seed_confirm_measures(decoder, held, unigram, sep, batch=16):
    """seed_measures' numbers in one pass, with the confirmatory round's: the slopes of the gap and of the cosine
    by position with each window's final [SEP] target left out (its gap is about 0, and it sits at the last
    position of nearly every window: it would bend both curves' ends), and each window's own gap (mean over its
    targets, [SEP] included, as "gap") for a test across texts. sep: [SEP]'s id."""
    decoder.eval()
    names = ("own", "other", "cosine", "n", "gap_nosep", "cosine_nosep", "n_nosep")
    device = held["ids"].device
    sums = {k: torch.zeros(held["ids"].shape[1] - 1, dtype=torch.float64, device=device) for k in names}
    gap_by_text = []
    for rows in torch.arange(len(held["ids"])).split(batch):
        with run.autocast_bf16(device):   # as in training: the (B, L, V) logits' matmul in bf16
            own, other, cosine, kept = seed_token_losses(decoder, held["view1"][rows], held["ids"][rows],
                                                         held["mask"][rows])
        targets = seed.decoder_inputs_and_targets(held["ids"][rows], held["mask"][rows])[1]   # (b, L-1)
        gap, nosep = (other - own).double(), (kept & (targets != sep)).double()              # (b, L-1)
        for name, grid in (("own", own), ("other", other), ("cosine", cosine), ("n", kept),
                           ("gap_nosep", gap * nosep), ("cosine_nosep", cosine.double() * nosep), ("n_nosep", nosep)):
            sums[name] += grid.double().sum(0)                                                 # (L-1,)
        gap_by_text += (gap.sum(1) / kept.sum(1).clamp_min(1)).tolist()
    present, n = sums["n"] > 0, sums["n"].clamp_min(1)
    kept_nosep, n_nosep = sums["n_nosep"] > 0, sums["n_nosep"].clamp_min(1)
    gap = ((sums["other"] - sums["own"]) / n)[present].tolist()
    cosine = (sums["cosine"] / n)[present].tolist()
    gap_nosep = (sums["gap_nosep"] / n_nosep)[kept_nosep].tolist()
    cosine_nosep = (sums["cosine_nosep"] / n_nosep)[kept_nosep].tolist()
    targets = seed.decoder_inputs_and_targets(held["ids"], held["mask"])[1]
    tokens = float(sums["n"].sum())
    return {"loss_own": float(sums["own"].sum()) / tokens, "loss_other": float(sums["other"].sum()) / tokens,
            "gap": float((sums["other"] - sums["own"]).sum()) / tokens,
            "unigram": float(-unigram[targets[targets != -100]].mean()), "gap_slope": slope(gap),
            "cosine_slope": slope(cosine), "gap_slope_nosep": slope(gap_nosep),
            "cosine_slope_nosep": slope(cosine_nosep), "gap_by_position": gap, "cosine_by_position": cosine,
            "gap_by_position_nosep": gap_nosep, "cosine_by_position_nosep": cosine_nosep,
            "gap_by_text": [round(v, 6) for v in gap_by_text], "n_windows": len(held["ids"]), "n_tokens": int(tokens)}


def unigram_log_probs(ids, mask, vocab_size):
    """The unigram model of the training windows' decoder targets (every token after [CLS]), add-one smoothed:
    SEED's floor, the loss of a decoder that reads neither h0 nor its context. -> (V,) log-probabilities."""
    counts = torch.bincount(ids[:, 1:][mask[:, 1:] == 1], minlength=vocab_size).double() + 1   # (V,)
    return torch.log(counts / counts.sum())


def frozen_trial(c, encoder, tokenizer, train, held):
    """--frozen cpdae or seed: the paper's decoder (and nothing else) trained on the frozen vectors of the
    training windows, --batch_size windows a step for --steps steps, AdamW at --lr after WARMUP_STEPS of linear
    warm-up, clip 1; every --eval_every steps its measures on each held-out split, on --device (train and held:
    the vectors on the CPU, moved there). -> [{step, split: measures}]."""
    device = torch.device(c.device)
    train = {name: tensor.to(device) for name, tensor in train.items()}
    held = {split: {name: tensor.to(device) for name, tensor in vectors.items()} for split, vectors in held.items()}
    torch.manual_seed(c.seed)
    order = np.random.default_rng(c.seed)
    seen, drawn = torch.zeros(len(train["ids"]), dtype=torch.bool), hashlib.sha256()   # the windows trained on
    special, vocab = list(data.special_ids(tokenizer).values()), encoder.config.vocab_size
    if c.frozen == "cpdae":
        constant, df = df_log_odds(train["ids"], vocab, special)
        common = torch.zeros(vocab, dtype=torch.bool)
        common[torch.as_tensor(common_token_ids(-df.cpu().numpy(), c.n_common, special))] = True   # the most frequent
        decoder = cpdae.Decoder(encoder.config.hidden_size, vocab, encoder.config.layer_norm_eps)
        with torch.no_grad():   # Departure (frozen-df-bias): from BERT's init (bias 0) L_REC stays near |V| ln 2
            decoder.out.bias.copy_(constant)                  # for hundreds of steps; start at the constant predictor
        common = common.to(device)

        def step_loss(rows):
            bag = bag_of_words(train["ids"][rows], vocab, special)                             # (m, V)
            if c.cl_positive == "other":   # the control arm: the second views are m other texts'
                other = other_texts(order, len(train["ids"]), rows)
                seen[other] = True
                return cpdae_control_step(decoder, train, rows, other, bag, vocab, special, c)
            return cpdae_step(decoder, train["view1"][rows], train["view2"][rows], bag, c)[0]

        def measure(split):
            numbers = cpdae_measures(decoder, split, constant, common, special, c)
            return {**numbers, **cpdae_text_measures(decoder, split, common, special, c.batch_size)} if c.confirm \
                else numbers
    else:
        unigram = unigram_log_probs(train["ids"], train["mask"], vocab)
        decoder = seed_decoder(c, encoder)   # its tied embedding (the encoder's) goes to --device with it

        def step_loss(rows):
            decoder_input, targets = seed.decoder_inputs_and_targets(train["ids"][rows], train["mask"][rows])
            states = decoder(decoder_input, train["view1"][rows])                              # (b, L-1, H)
            # every position, padding ignored by its -100 target: one shape a step (a varying count of kept
            # positions makes oneDNN compile a bf16 kernel per shape on CPUs, most of a step's time)
            return run.speed.fused(seed.decoder_loss, c)(states, decoder.word_embedding[0].weight, targets)[0]

        def measure(split):
            if c.confirm:   # the same measures, and the slopes without each window's final [SEP] target
                return seed_confirm_measures(decoder, split, unigram, data.special_ids(tokenizer)["sep"])
            return seed_measures(decoder, split, unigram)
    decoder.to(device)
    params = [p for p in decoder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.01)
    curve, start = [], time.time()
    for step in range(1, c.steps + 1):
        decoder.train()
        for group in optimizer.param_groups:
            group["lr"] = c.lr * min(1.0, step / WARMUP_STEPS)
        rows = torch.as_tensor(order.choice(len(train["ids"]), c.batch_size, replace=False))
        seen[rows] = True
        drawn.update(rows.numpy().tobytes())
        with run.autocast_bf16(device):
            loss = step_loss(rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % c.eval_every == 0 or step == c.steps:
            curve.append({"step": step, "train_loss": loss.item(), **{name: measure(split) for name, split in held.items()}})
            # dev only on the screen: a pilot's choices read dev, and nobody choosing sees test (it is in the row)
            print(f"{c.tag} seed {c.seed} step {step}/{c.steps}: train loss {loss.item():.4f}; dev: " + ", ".join(
                f"{k} {v:.4g}" for k, v in curve[-1]["dev"].items() if isinstance(v, float))
                + f"; test: in the row only ({time.time() - start:.0f} s)", flush=True)
    if c.frozen == "cpdae":   # Table 4's text, for the figure with and without CL
        ids, mask = data.encode_texts(tokenizer, [TABLE4_TEXT], c.max_len)
        with torch.no_grad():
            decoder.eval()
            probs = cpdae.word_distribution(decoder(pool(encoder(ids, mask), mask, c.pooling).to(device)))[0]
        curve[-1]["table4_words"] = word_probabilities(probs.cpu().numpy(), TABLE4_TEXT, tokenizer)
    # what it trained on: two arms with the same digest drew the same windows in the same order
    curve[-1]["windows"] = {"distinct": int(seen.sum()), "of": len(seen), "batches_sha256": drawn.hexdigest()}
    return curve


def held_out_windows(vectors, n, batch_size, corpus):
    """A fixed sample of n of the held-out windows (held_out_sample's order: neighbours, between whom SEED's h0
    is swapped, come from unrelated places), in whole batches of batch_size. {name: (N, ...)} -> the same, n rows."""
    rows = held_out_sample(list(range(len(vectors["ids"]))), n)
    rows = torch.tensor(rows[:len(rows) // batch_size * batch_size], dtype=torch.long)
    if len(rows) < batch_size:
        raise data.DataError(f"{corpus}: {len(vectors['ids'])} windows, fewer than one batch (--batch_size {batch_size})")
    return {name: tensor[rows] for name, tensor in vectors.items()}


def frozen_device(name):
    """--device: a torch device this machine has (the CPU, or a GPU torch sees), else one line naming the flag."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device name (cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s) that torch can use "
                         f"(CUDA available: {torch.cuda.is_available()}); run without --device for the CPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: the frozen trials run on cpu or cuda")
    return device


def frozen_command(c, out_dir):
    """--frozen: frozen_trial of --model's vectors (--train_corpus to train on; --dev_corpus, where the pilot
    chooses, and --corpus, where the claims are judged, held out), one row: {measure}-{tag}-seed{seed}.json. The
    encoder runs on the CPU (its vectors, once per draw, are the same wherever the decoder trains: --device)."""
    m = model_settings(c, c.model, c.tag or Path(c.model).name)
    encoder, tokenizer = load_model(m, torch.device("cpu"))
    encoder.requires_grad_(False)   # frozen: only the decoder trains (SEED's tied output projection included)
    c = dataclasses.replace(c, pooling=m.pooling, tag=m.tag)
    train = cached_frozen_vectors(c, c.train_corpus, encoder)
    held = {name: held_out_windows(cached_frozen_vectors(c, corpus, encoder), c.n_texts, c.batch_size, corpus)
            for name, corpus in (("dev", c.dev_corpus), ("test", c.corpus))}
    start = time.time()
    curve = frozen_trial(c, encoder, tokenizer, train, held)
    settings = {k: getattr(c, k) for k in ("max_len", "pooling", "steps", "eval_every", "batch_size", "lr", "n_texts",
                                           *(("cl_weight", "cl_tau", "rec_reduction", "n_common") if c.frozen == "cpdae"
                                             else ("dec_span", "dec_layers")),
                                           *(("mask_seed", "cl_positive", "confirm") if c.confirm else ()),
                                           *(("device",) if c.device != "cpu" else ()), *(("compile",) if c.compile else ()))}
    row = mechanism_row(c, f"frozen_{c.frozen}", c.model, c.tag, {"settings": settings, "curve": curve,
                                                                  "seconds": round(time.time() - start)})
    row["seed"] = c.seed
    write_rows(out_dir, row["measure"], [row])
    return [row]


# ==============================================================================================
# Command line
# ==============================================================================================
def pick_tsne_query(runs, qrels):
    """The query with the most relevant documents (in the qrels; ties: the first by id) among those with
    a relevant document in the top 100 and at least 10 candidates in every run of runs (one per model)."""
    def shown(run, qid):
        top = [d for d, _ in trec_order(run.get(qid, {}))[:100]]
        return len(top) >= 10 and any(qrels[qid].get(d, 0) > 0 for d in top)

    for qid in sorted(qrels, key=lambda q: (-sum(g > 0 for g in qrels[q].values()), q)):
        if all(shown(run, qid) for run in runs):
            return qid
    raise data.DataError("--tsne auto: no query has a relevant document in the top 100 of every model")


def tsne_panel(encoder, tokenizer, corpus, queries, qrels, run, qid, c, device, tag):
    """One panel of plot_tsne: (title, query vector (H,), vectors of its top 100 in run (K, H), relevant (K,))."""
    top = [d for d, _ in trec_order(run[qid])[:100]]
    vecs = encode(encoder, c.pooling, tokenizer, [passage_text(corpus[d]) for d in top], c.passage_len,
                  c.encode_batch, device, c.bf16, c.similarity)                               # (K, H)
    qvec = encode(encoder, c.pooling, tokenizer, [queries[qid]], c.query_len, 1, device, c.bf16, c.similarity)[0]
    relevant = [qrels[qid].get(d, 0) > 0 for d in top]
    ranks = ", ".join(str(i + 1) for i, r in enumerate(relevant) if r)
    title = f"{tag}\ntop {len(top)}, {sum(relevant)} relevant" + (f" (rank {ranks})" if ranks else "")
    return title, qvec, vecs, relevant


def tsne_command(c, split, device):
    """--tsne: evaluate every model of --model on the split, then COSTA Figure 3 for one query (--tsne ID,
    or "auto": pick_tsne_query over every model's run), one panel per model with its own top 100. One
    model's run goes to the out_dir, several models' to out_dir/{tag without spaces}; the figure,
    tsne-{qid}.png, to the out_dir. Returns the first model's (means, per_query) on rank 0, else None."""
    models = model_list(c)
    out_dir = default_out_dir(dataclasses.replace(c, model=models[0][0]))
    corpus, queries, qrels = load_eval_split(c, split)
    evaluated = []
    for model, tag in models:
        m = model_settings(c, model, tag)
        encoder, tokenizer = load_model(m, device)
        name = "".join(tag.split()).replace("/", "--")           # the tag without spaces: the TREC tag and folder
        folder = out_dir if len(models) == 1 else out_dir / name
        result = evaluate_encoder(encoder, tokenizer, corpus, queries, qrels, folder, m, device, name, c.depth)
        evaluated.append((m, encoder, tokenizer, evaluate.read_run(folder / "run.trec") if result else None, result))
    if rank_and_world()[0] != 0:
        return None
    qid = pick_tsne_query([run for *_, run, _ in evaluated], qrels) if c.tsne == "auto" else c.tsne
    if qid not in qrels:
        raise data.DataError(f"--tsne {qid}: no such query id in the qrels of this split")
    panels = [tsne_panel(encoder, tokenizer, corpus, queries, qrels, run, qid, m, device, m.tag)
              for m, encoder, tokenizer, run, _ in evaluated]
    path = out_dir / f"tsne-{qid}.png"
    plot_tsne(panels, path, title=textwrap.fill(f'COSTA Figure 3, query {qid}: "{queries[qid]}"', 110))
    print(f"t-SNE of query {qid} and its top 100, {len(panels)} model(s): {path}")
    return evaluated[0][-1]


def cls_by_length_command(c, device):
    """--cls_by_length: SEED-Encoder Figure 5 for every model of --model on the texts of the corpus (--corpus,
    else the dataset's corpus.jsonl): 200 random pairs per length, the same for every model, lengths 32 to
    512 within the model's positions, the [CLS] and the mean vector. Writes cls_by_length.png and .json to
    the out_dir (default: the first model's), prints the values. Returns {(tag, vector): {length: cos}}."""
    models = model_list(c)
    out_dir = default_out_dir(dataclasses.replace(c, model=models[0][0]))
    corpus = c.corpus or data.find_file(c.dataset, "corpus.jsonl")
    texts = data.read_pretraining_texts(corpus)
    curves = {}
    for model, tag in models:
        m = model_settings(c, model, tag)
        encoder, tokenizer = load_model(m, device)
        lengths = [n for n in (32, 64, 128, 256, 512) if n <= encoder.config.max_position]
        for vector in ("cls", "mean"):
            curves[tag, vector] = cls_similarity_by_length(encoder, tokenizer, texts, lengths, pooling=vector)
            print(f"{tag}, {vector}: " + ", ".join(f"{n} {v:.3f}" for n, v in curves[tag, vector].items()), flush=True)
    title = f"SEED-Encoder Figure 5: random pairs of {Path(c.corpus or c.dataset).name} texts, 200 per length"
    plot_cls_by_length(curves, out_dir / "cls_by_length.png", title)
    run.files.atomic_write_json(out_dir / "cls_by_length.json", [{"model": tag, "vector": vector, "cosine": values}
                                                            for (tag, vector), values in curves.items()])
    print(f"cosine of random text pairs by length: {out_dir / 'cls_by_length.png'}")
    return curves



def words_command(c, out_dir, device):
    """--words: CPDAE Table 4 for the text, the word distribution of the decoder (--decoder, else the model
    folder's) as words.png in the out_dir; prints each word's value."""
    c = evaluate.resolve_retriever(dataclasses.replace(c, model=run.hub.resolve_model(c.model)))  # 'minilm' -> a folder
    encoder, tokenizer = load_model(c, device)
    decoder = load_cpdae_decoder(c.decoder or c.model).to(device)
    bottleneck = trained_bottleneck(c.decoder or c.model)
    probs = word_distribution(encoder, decoder, tokenizer, c.words, c.passage_len, device, bottleneck)
    path = out_dir / "words.png"
    words = plot_word_distribution(probs, c.words, tokenizer, path)
    print(" ".join(f"{w}:{v:.3g}" for w, v, _ in words))
    print(f"word distribution: {path}")


def model_list(c):
    """evaluate.model_list: several models with the figures that compare them and the measurements."""
    return evaluate.model_list(c, several=bool(c.tsne or c.cls_by_length or any(getattr(c, m) for m in MECHANISMS)))


def main(c):
    names = evaluate.split_names(c, ("corpus", "compare", "tsne", "words", "discrimination"))
    if not any(getattr(c, flag) for flag in FIGURES + MECHANISMS + ("frozen",)):
        raise ValueError("give a figure (--tsne, --words, --cls_by_length) or a measurement (--word_shares, "
                         "--decoder_reliance, --discrimination, --heads, --frozen); evaluate.py evaluates a retriever")
    if c.frozen and not (c.train_corpus and c.dev_corpus and c.corpus):
        raise ValueError("--frozen: give --train_corpus (trained on), --dev_corpus and --corpus (held out)")
    if c.device != "cpu" and not c.frozen:
        raise ValueError(f"--device {c.device} is --frozen's (the other measurements run where evaluate.py's do)")
    frozen_device(c.device)   # before any work
    if c.bm25 or c.compare or not c.model:
        raise ValueError("give --model FOLDER (a saved encoder; several, comma-separated); --bm25 and --compare "
                         "are evaluate.py's")
    out_dir = default_out_dir(dataclasses.replace(c, model=model_list(c)[0][0]))   # before 'minilm' is a folder
    rank, _, device = evaluate.setup_distributed()
    new = [p for p in (out_dir, *out_dir.absolute().parents) if not p.exists()]   # made here: gone if left empty
    evaluate.hold_out_dirs([out_dir])
    try:
        return run_commands(c, names[0], out_dir, rank, device)
    finally:
        run.folders.release_run_folder(out_dir)
        for folder in new if rank == 0 else []:          # a refused run leaves no folder it made (deepest first)
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def run_commands(c, split, out_dir, rank, device):
    """main's work, in the folder it holds: the measurements, else a figure (--cls_by_length, --tsne, --words)."""
    if c.frozen:
        return frozen_command(c, out_dir) if rank == 0 else None
    if any(getattr(c, m) for m in MECHANISMS):
        return mechanisms_command(c, split, out_dir, device) if rank == 0 else None
    if c.cls_by_length:
        return cls_by_length_command(c, device) if rank == 0 else None
    if c.tsne:
        return tsne_command(c, split, device)
    return words_command(c, out_dir, device) if rank == 0 else None


if __name__ == "__main__":
    run.cli.run_command_line(lambda: main(run.cli.parse_config(Config, sys.argv[1:], __doc__, rules=FLAG_RULES)),
                         interrupted="interrupted; run it again to measure (a --frozen trial starts over)")
