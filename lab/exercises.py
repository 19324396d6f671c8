"""The lab's exercises (lab/sheet.md): seven functions of the three papers, written from scratch between
`# --- your code ---` and `# --- end ---`. lab/exercises.py is solved; the copy a course hands out is not:

    python -m lab.check --stub my_exercises.py     # a copy of lab/exercises.py, each body a `raise`
    python -m lab.check my_exercises.py            # grade it against costa.py, cpdae.py and seed.py

Each function takes what the method file's function of the same name takes (less its distributed-training
arguments), and must return the same values and gradients. Only torch and numpy: no import of the method files.
"""
import numpy as np
import torch


# ==============================================================================================
# COSTA (Ma et al., SIGIR 2022): a text against its own spans
# ==============================================================================================
def gwc_loss(text_vecs, span_vecs, tau, sim="dot"):
    """COSTA eq. 8, the group-wise contrastive loss, averaged over the N anchors (the texts):
        L_i = -1/S sum_{p in S(i)} log( exp(sim(z_i, z_p) / tau) / sum_{j != i} exp(sim(z_i, z_j) / tau) )
    text_vecs (N, H): the z_i; span_vecs (N, S, H): text i's S spans, its positives S(i). The candidates z_j are
    the N texts, then the N*S spans (text 0's first); z_i itself is left out (j != i). sim: "dot" or "cos".
    Returns (loss: a scalar tensor, accuracy: the fraction of texts whose top candidate is one of their spans)."""
    # --- your code ---
    N, S = span_vecs.shape[:2]
    candidates = torch.cat([text_vecs, span_vecs.reshape(N * S, -1)])          # (N + N*S, H): texts, then spans
    if sim == "cos":
        candidates = candidates / candidates.norm(dim=-1, keepdim=True)        # unit vectors: dot = cosine
    logits = candidates[:N] @ candidates.T / tau                               # (N, N + N*S): text i vs all
    logits = logits.masked_fill(torch.eye(N, N + N * S, dtype=torch.bool), float("-inf"))  # j != i
    own = N + torch.arange(N)[:, None] * S + torch.arange(S)                   # (N, S): the columns of S(i)
    log_prob = logits.log_softmax(dim=1).gather(1, own)                        # (N, S)
    top_is_own = (logits.argmax(dim=1)[:, None] == own).any(dim=1)             # (N,)
    return -log_prob.mean(), top_is_own.float().mean()
    # --- end ---


def span_vectors(hidden, spans):
    """COSTA eq. 7: a span's vector is the mean of its tokens' output vectors h_a .. h_(b-1).
    hidden (B, L, H): the encoder's output; spans (B, S, 2) long: text b's S spans (start a, end b), end exclusive.
    Returns (B, S, H)."""
    # --- your code ---
    texts = []
    for h, text_spans in zip(hidden, spans):                                   # h (L, H); text_spans (S, 2)
        texts.append(torch.stack([h[start:end].mean(dim=0) for start, end in text_spans.tolist()]))
    return torch.stack(texts)                                                  # (B, S, H)
    # --- end ---


SPAN_LENGTHS = {"phrase": (4, 16), "sentence": (16, 64), "paragraph": (64, 128)}  # (l_min, l_max): COSTA 4.5.1


def sample_spans(n_tokens, config, rng):
    """COSTA eq. 1-3 for one window [CLS] x_1 .. x_m [SEP] of n_tokens = m + 2: for each granularity of
    config.granularities ("phrase,sentence,paragraph"; the word level is not an exercise), config.span_T spans
        l = round(l_min + p (l_max - l_min)), p ~ Beta(config.span_alpha, config.span_beta), at most m   (eq. 1)
        start ~ Uniform{1, ..., n_tokens - 1 - l}; the span is (start, start + l), end exclusive       (eq. 2-3)
    rng: a numpy Generator. To draw what costa.py draws: per granularity, first its T p's in one rng.beta call,
    then its T starts in one rng.integers call. Returns a list of (start, end) pairs of ints."""
    # --- your code ---
    m, T, spans = n_tokens - 2, config.span_T, []
    for name in config.granularities.split(","):
        l_min, l_max = SPAN_LENGTHS[name]
        p = rng.beta(config.span_alpha, config.span_beta, size=T)               # (T,) eq. 1
        lengths = np.minimum(np.rint(l_min + p * (l_max - l_min)), m).astype(int)
        starts = rng.integers(1, n_tokens - lengths)                            # (T,) eq. 2: high is exclusive
        spans += [(int(a), int(a + length)) for a, length in zip(starts, lengths)]  # eq. 3
    return spans
    # --- end ---


# ==============================================================================================
# CPDAE (Ma et al., CIKM 2022): two masked views of a text, compared by their word distributions
# ==============================================================================================
def js_similarity(anchors, candidates, tau=1.0):
    """CPDAE's similarity of two word distributions (eq. 7, as the true Jensen-Shannon divergence), natural log:
        s(P, Q) = -JS(P, Q) / tau,   JS(P, Q) = 1/2 KL(P || M) + 1/2 KL(Q || M),   M = (P + Q) / 2
    anchors P (a, V), candidates Q (b, V): each row a distribution over V words (positive, sums to 1).
    Returns (a, b): s of every anchor with every candidate."""
    # --- your code ---
    p, q = anchors[:, None, :], candidates[None, :, :]                         # (a, 1, V), (1, b, V)
    m = (p + q) / 2                                                            # (a, b, V)
    kl_p = (p * (p / m).log()).sum(dim=-1)                                     # (a, b) KL(P || M)
    kl_q = (q * (q / m).log()).sum(dim=-1)                                     # (a, b) KL(Q || M)
    return -(kl_p + kl_q) / 2 / tau
    # --- end ---


def contrastive_loss(view1, view2, similarity):
    """CPDAE eq. 5, averaged over the M anchors (the first views):
        L_i = -log( exp(s(z'_i, z''_i)) / sum_{k=1..2M, k != i} exp(s(z'_i, z_k)) ),   z_k runs over [view1; view2]
    view1, view2 (M, D): the two views of M texts; similarity(a, b): (n, D) x (k, D) -> (n, k) scores s.
    Returns (loss, accuracy: the fraction of anchors whose top candidate is their own second view)."""
    # --- your code ---
    M = view1.shape[0]
    scores = similarity(view1, torch.cat([view1, view2]))                      # (M, 2M)
    scores = scores.masked_fill(torch.eye(M, 2 * M, dtype=torch.bool), float("-inf"))  # k != i
    rows, positive = torch.arange(M), M + torch.arange(M)                     # z''_i is column M + i
    loss = -scores.log_softmax(dim=1)[rows, positive].mean()
    accuracy = (scores.argmax(dim=1) == positive).float().mean()
    return loss, accuracy
    # --- end ---


# ==============================================================================================
# SEED-Encoder (Lu et al., EMNLP 2021): a weak decoder that must read the text's vector
# ==============================================================================================
def window_mask(length, k=2):
    """SEED's weak decoder attends through this mask (eq. 9): (length, length) bool, True where query i may
    attend key j: j = 0 (the start symbol, [CLS]) or i - k < j <= i (itself and the k - 1 positions before it).
    k = 0: the plain causal mask, j <= i (Figure 3's strong decoder)."""
    # --- your code ---
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]      # (L, 1) queries, (1, L) keys
    causal = j <= i
    if k == 0:
        return causal
    return causal & ((j > i - k) | (j == 0))
    # --- end ---


def decoder_loss(states, weight, targets, reduction="mean"):
    """SEED eq. 9: -log P(x_t | ...), P = softmax(s_t E^T), over the target tokens.
    states (..., H): the decoder's outputs s_t; weight (V, H): the token embedding E; targets (...): the x_t,
    -100 = no target (padding). reduction "sum": eq. 9's sum over t; "mean": that sum / the number of targets.
    Returns (loss, n_correct: how many targets are their position's top-scoring token)."""
    # --- your code ---
    s, x = states.reshape(-1, states.shape[-1]), targets.reshape(-1)          # (N, H), (N,)
    keep = x != -100
    s, x = s[keep], x[keep]                                                    # padding has no target
    log_p = (s @ weight.T).log_softmax(dim=-1)                                 # (n, V)
    total = -log_p[torch.arange(len(x)), x].sum()
    n_correct = (log_p.argmax(dim=-1) == x).sum()
    return (total if reduction == "sum" else total / max(len(x), 1)), n_correct
    # --- end ---
