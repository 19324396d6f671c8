"""A walkthrough of the three methods on toy tensors, for a lecture or a lab: `python walkthrough.py` prints
each step. It calls the functions training runs (costa.gwc_loss, cpdae.contrastive_loss, seed.window_mask...)
on 2-3 texts, so each matrix fits on a slide. The exercises at the end are graded by test_losses.py
(test_walkthrough_exercises): hand them out with their bodies deleted.

COSTA (costa.py)                         CPDAE (cpdae.py)                       SEED (seed.py)
  text ─ Encoder ─ h_0 ─ Projector ─ z_0    d', d'' ─ Encoder ─ h_[CLS]           masked text ─ Encoder ─ h_0
              └─ h_a..h_b ─ mean ─ span z      └─ Decoder ─ z ─ sigmoid ─ z_tilde   text shifted ─ WeakDecoder(h_0)
  eq. 8: z_0 of text i vs its spans        eq. 4: z vs the bag of words           eq. 9: next token, window k
  batch (B, L) + spans (B, S, 2)            eq. 5: -JS(z_tilde', z_tilde'')       batch (B, L) + decoder input (B, L-1)
                                            batch (2B, L) = [d'; d'']
"""
import torch

import costa
import cpdae
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
# Exercises (graded by test_losses.py::test_walkthrough_exercises against the methods' own code)
# ----------------------------------------------------------------------------------------------
def gwc_positive_columns(N, S):
    """Exercise 1 (COSTA eq. 8): the (N, S) columns of the logits [texts; spans] holding text i's own spans."""
    return N + torch.arange(N)[:, None] * S + torch.arange(S)                  # (N, S)


def self_mask(M):
    """Exercise 2 (CPDAE eq. 5): the (M, 2M) boolean mask, True at k = i, the anchor compared with itself."""
    return torch.eye(M, 2 * M, dtype=torch.bool)                               # (M, 2M)


def window(length, k):
    """Exercise 3 (SEED eq. 9): the (L, L) mask, True where query i may attend key j: j = 0 or i-k < j <= i."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return (j <= i) & ((j > i - k) | (j == 0))                                 # (L, L)


if __name__ == "__main__":
    costa_step()
    cpdae_step()
    seed_step()
