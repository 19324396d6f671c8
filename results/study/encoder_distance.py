"""How far each arm's pre-training moved the encoder, and how far its own term moved it beyond MLM-only.

For every seed whose checkpoints are in runs/study (not committed: rerun the study's runs to make them),
the relative distance ||A - B|| / ||B|| over the encoder's Transformer weights (embeddings and heads left
out) between:
  - each arm's pre-trained encoder and the starting checkpoint (what pre-training moved);
  - each method's pre-trained encoder and MLM-only's of the same seed (what the method's own term moved,
    since every method also trains MLM, with the same data order, masks and dropout: common random numbers);
  - each arm's fine-tuned encoder and "none"'s fine-tuned encoder of the same seed.

    python results/study/encoder_distance.py            # writes results/study/encoder_distance.md
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
import run


def transformer_weights(folder):
    """{name: tensor} of the Transformer layers, names without the 'bert.' prefix."""
    weights = load_file(str(Path(folder) / "model.safetensors"))
    return {k.removeprefix("bert."): v.float() for k, v in weights.items() if ".layer." in k}


def distance(a, b):
    """||a - b|| / ||b|| over the names both have."""
    keys = sorted(set(a) & set(b))
    num = sum(((a[k] - b[k]) ** 2).sum() for k in keys)
    return float(torch.sqrt(num / sum((b[k] ** 2).sum() for k in keys)))


def main(runs=ROOT / "runs" / "study", out=HERE / "encoder_distance.md"):
    start = transformer_weights(run.resolve_model("minilm"))
    methods = ("seed", "cpdae", "costa")
    header = ("| seed | arm | pre-trained vs start | pre-trained vs mlm's (same seed) | / mlm's own move | "
              "fine-tuned vs none's fine-tuned (same seed) |")
    lines = [header, "|---" * 6 + "|"]
    for seed_dir in sorted((runs / "mlm").glob("seed*")):
        seed = seed_dir.name
        mlm = transformer_weights(seed_dir / "pretrain" / "encoder")
        mlm_move = distance(mlm, start)
        none_ft = runs / "none" / seed / "finetune" / "encoder"
        for arm in ("mlm",) + methods:
            pre, ft = runs / arm / seed / "pretrain" / "encoder", runs / arm / seed / "finetune" / "encoder"
            if not (pre / "model.safetensors").is_file():
                continue
            w = transformer_weights(pre)
            vs_mlm = distance(w, mlm) if arm != "mlm" else None
            ft_cell = (f"{distance(transformer_weights(ft), transformer_weights(none_ft)):.5f}"
                       if (ft / "model.safetensors").is_file() and (none_ft / "model.safetensors").is_file() else "")
            lines.append(f"| {seed} | {arm} | {distance(w, start):.5f} | "
                         + (f"{vs_mlm:.5f} | {vs_mlm / mlm_move:.3f} |" if vs_mlm is not None else " | |")
                         + f" {ft_cell} |")
    text = ("# How far pre-training moved the encoder (`python results/study/encoder_distance.py`)\n\n"
            "||A - B|| / ||B|| over the Transformer layers' weights.\n\n" + "\n".join(lines) + "\n")
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
