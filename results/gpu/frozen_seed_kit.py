"""What results/gpu/frozen_seed.sh needs on a GPU machine that has neither the MiniLM package nor internet, in one
folder small enough to travel with the working tree (the device tool sends the tree and its `carry` paths, 64 MiB
in all, of which the tracked files are ~14; MiniLM's weights are 87 MiB): runs/gpu-frozen-seed/, 47.8 MiB.

The frozen SEED trial (research.mechanisms --frozen seed) reads two things of all-MiniLM-L6-v2: the encoder's vector of
each window's first masked view (h0, computed once on the CPU and kept in --frozen_cache) and its word embedding
(the decoder's input embedding and its tied output projection). Both are carried exactly, fp32 bit for bit: the
decoder looks its input up in fp32 (autocast leaves embedding lookups alone), so bf16 weights would change its
numbers, and the vectors are the CPU's own. Only the words no window holds (5,519 of 30,522) are never looked
up: the output projection alone reads them, in bf16 under autocast, so the kit keeps them rounded to bf16 (their
low bytes zero, which compress away): bf16(bf16(w)) = bf16(w), exact wherever the trial runs under bf16 autocast
(a GPU; a CPU with AVX512-BF16 or AMX). The kit holds
    encoder/            MiniLM's config.json with 1 layer, of zeros (a config needs one; nothing of the encoder
                        runs there), vocab.txt and the files that declare its pooling (mean), so that
                        research/mechanisms.py loads it as it loads 'minilm'
    packed.safetensors  MiniLM's embedding layer and each corpus's view1 vectors, each fp32 tensor's 4 byte planes
                        zlib-compressed (lossless; the exponent bytes compress: 72 % of the size), CRC-32 checked
    kit.json            the mask draw, the shapes and checksums
The windows' ids and masks are not carried: `place` rebuilds them there from the corpus files (made from the
tracked data/ as results/mechanisms/confirm/make.sh makes them), checks them against the kit's checksums, writes
the encoder folder with its weights unpacked and each corpus's cache file where research/mechanisms.py looks for it.

    python results/gpu/frozen_seed_kit.py export --corpora runs/frozen-speed --mask_seed 5   # here (a CPU)
    python results/gpu/frozen_seed_kit.py place --corpora /tmp/w --encoder /tmp/w/encoder --cache /tmp/w/vec  # there

`export` reads the vectors from --cache (--frozen_cache of research.mechanisms; default runs/frozen-speed/vectors, which
results/speed/frozen_seed.py's SEED trials read too), else computes view1's as mechanisms.frozen_vectors does (the
full MiniLM on this CPU, the same draw of the masks) and keeps them there: a cache of view1 alone, for SEED trials.
"""
import argparse
import dataclasses
import json
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
import data
import evaluate
import run
from research import mechanisms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speed"))   # make_corpora: make.sh's wiki-*.jsonl
from frozen_seed import make_corpora

KIT = Path("runs/gpu-frozen-seed")
CORPORA = ("wiki-train", "wiki-dev", "wiki-test")   # make.sh's: trained on, dev, test
RETRIEVER_FILES = ("vocab.txt", *run.hub.RETRIEVER_FILES)


def settings(model, mask_seed, cache, max_len=128):
    """research/mechanisms.py's Config as frozen_command has it for --model (the name as given, which the cache's key
    reads; its pooling the folder's: MiniLM's mean)."""
    c = mechanisms.Config(model=str(model), mask_seed=mask_seed, frozen_cache=str(cache), max_len=max_len)
    return dataclasses.replace(c, pooling=evaluate.model_settings(c, c.model, "").pooling)


def windows_of(c, corpus):
    """The corpus's windows' ids and mask, padded as frozen_vectors pads them, and their checksum."""
    windows = run.cache.token_windows(corpus, c.vocab or data.VOCAB, c.max_len, 0, "")
    ids, mask = data.pad_batch([windows[i].input_ids for i in range(len(windows))])            # (N, L)
    return ids, mask, zlib.crc32(ids.numpy().tobytes()) ^ zlib.crc32(mask.numpy().tobytes())


def pack(tensor):
    """An fp32 tensor as its 4 byte planes, zlib-compressed: (uint8 blob, its shape and CRC-32)."""
    raw = tensor.contiguous().numpy().view(np.uint8).reshape(-1, 4)                            # (n, 4)
    blob = zlib.compress(np.ascontiguousarray(raw.T).tobytes(), 9)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), {"shape": list(tensor.shape),
                                                                   "crc": zlib.crc32(raw.tobytes())}


def unpack(blob, info):
    """pack's inverse, checked against the CRC-32 of the original bytes."""
    planes = np.frombuffer(zlib.decompress(blob.numpy().tobytes()), dtype=np.uint8).reshape(4, -1)
    raw = np.ascontiguousarray(planes.T)                                                       # (n, 4)
    if zlib.crc32(raw.tobytes()) != info["crc"]:
        raise SystemExit("the kit's packed tensors are damaged (CRC-32): export it again")
    return torch.from_numpy(raw.view(np.float32).reshape(info["shape"]).copy())


def export(corpora, mask_seed, cache, kit):
    """The kit from the frozen cache (view1 computed where it is missing) and the MiniLM package, into kit."""
    c, minilm = settings("minilm", mask_seed, cache), Path(run.hub.resolve_model("minilm"))   # make.sh's --model minilm
    make_corpora(Path(corpora))                                                           # where missing
    encoder, _ = evaluate.load_model(evaluate.model_settings(c, c.model, ""), torch.device("cpu"))
    weights = run.files.load_tensors(minilm / "model.safetensors")
    tensors = {k: v for k, v in weights.items() if ".embeddings." in f".{k}"}
    tensors.update({k: torch.zeros_like(v) for k, v in weights.items() if ".layer.0." in f".{k}"})   # see encoder/
    checksums, looked_up = {}, torch.zeros(encoder.config.vocab_size, dtype=torch.bool)   # ids some window holds
    for name in CORPORA:
        corpus = Path(corpora) / f"{name}.jsonl"
        path = mechanisms.frozen_cache_path(c, corpus)
        if not path.is_file():   # view1 only, all a SEED trial reads (a CPDAE trial needs its own --frozen_cache)
            windows = run.cache.token_windows(corpus, c.vocab or data.VOCAB, c.max_len, 0, "")
            run.files.save_tensors(path, mechanisms.frozen_vectors(encoder, windows, c.pooling, mask_seed, names=("view1",)))
        cached = run.files.load_tensors(path)
        ids, mask, checksums[name] = windows_of(c, corpus)
        if not (torch.equal(ids, cached["ids"]) and torch.equal(mask, cached["mask"])):
            raise SystemExit(f"{corpus}: its windows are not those of the cached vectors")
        tensors[f"{name}.view1"] = cached["view1"]                                             # (N, H) fp32
        looked_up = looked_up | torch.bincount(ids.flatten(), minlength=len(looked_up)).bool()
    word = next(k for k in tensors if k.endswith("word_embeddings.weight"))
    tensors[word] = torch.where(looked_up[:, None], tensors[word], tensors[word].bfloat16().float())   # (V, H)
    packed, shapes = {}, {}
    for name, tensor in tensors.items():
        packed[name], shapes[name] = pack(tensor.float())
    folder = kit / "encoder"
    folder.mkdir(parents=True, exist_ok=True)
    hf = json.loads((minilm / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 1}, indent=1))
    for name in RETRIEVER_FILES:
        if (minilm / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(minilm / name, folder / name)
    run.files.save_tensors(kit / "packed.safetensors", packed)
    (kit / "kit.json").write_text(json.dumps({"mask_seed": mask_seed, "max_len": c.max_len, "windows": checksums,
                                              "tensors": shapes}))
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file()) / 2**20
    print(f"{kit}: {size:.1f} MiB (the device tool sends the working tree and its carry paths, 64 MiB in all)")


def place(corpora, encoder_dir, cache, kit):
    """The encoder folder (the kit's, its embedding layer unpacked) and each corpus's cache file as research.mechanisms
    --model encoder_dir finds it: its windows' ids and mask rebuilt here (checked) and the kit's view1 vectors."""
    info = json.loads((kit / "kit.json").read_text())
    blobs = run.files.load_tensors(kit / "packed.safetensors")
    tensors = {name: unpack(blobs[name], shape) for name, shape in info["tensors"].items()}
    shutil.copytree(kit / "encoder", encoder_dir, dirs_exist_ok=True)
    run.files.save_tensors(Path(encoder_dir) / "model.safetensors", {k: v for k, v in tensors.items() if ".view1" not in k})
    c = settings(encoder_dir, info["mask_seed"], cache, info["max_len"])
    for name in CORPORA:
        corpus = Path(corpora) / f"{name}.jsonl"
        ids, mask, checksum = windows_of(c, corpus)
        if checksum != info["windows"][name]:
            raise SystemExit(f"{corpus}: its windows differ from those the kit's vectors were computed on")
        path = mechanisms.frozen_cache_path(c, corpus)
        path.parent.mkdir(parents=True, exist_ok=True)
        run.files.save_tensors(path, {"ids": ids, "mask": mask, "view1": tensors[f"{name}.view1"]})
        print(f"{path}: {len(ids):,} windows")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("export", "place"))
    parser.add_argument("--corpora", required=True, help="the folder with wiki-{train,dev,test}.jsonl")
    parser.add_argument("--mask_seed", type=int, default=5, help="export: the masked views' draw (make.sh's seed)")
    parser.add_argument("--cache", default="", help="--frozen_cache (export: runs/frozen-speed/vectors)")
    parser.add_argument("--encoder", default="/tmp/frozen-seed-gpu/encoder", help="place: the encoder folder to write")
    parser.add_argument("--kit", default=str(KIT))
    args = parser.parse_args()
    if args.what == "export":
        export(args.corpora, args.mask_seed, args.cache or "runs/frozen-speed/vectors", Path(args.kit))
    else:
        place(args.corpora, args.encoder, args.cache or "/tmp/frozen-seed-gpu/vectors", Path(args.kit))


if __name__ == "__main__":
    main()
