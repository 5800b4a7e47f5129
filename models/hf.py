"""Hugging Face checkpoints in and out: a local directory (or a hub id's snapshot), its config read,
the model class it builds (the decoder, or Qwen2-VL's subclass for a config with `vision`), its
safetensors streamed in by name and written back, and the tokenizer files copied beside them.
"""
import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.config import ModelConfig, read_json
from models.decoder import Transformer
from models.qwen2_vl import VLTransformer
from models.tokenizer import Tokenizer
from utils.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "preprocessor_config.json")  # the last: Qwen2-VL's images


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]  # config, weights, tokenizer


def local_dir(path: str, flag: str = "--model") -> str:
    """A checkpoint directory: `path` itself, or, for a hub id (ORG/NAME) that is no local path,
    its snapshot in the Hugging Face cache (downloaded with huggingface_hub: config, weights and
    tokenizer files only). Without the network, one error that says to pass a local directory."""
    parts = path.split("/")
    if os.path.exists(path) or len(parts) != 2 or not all(parts) or path.startswith((".", "~")):
        return path  # a local path (read_config says what is missing)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, unknown id, no access: the same advice
        raise UserError(f"{flag} {path}: no such local directory, and downloading it from the Hugging Face "
                        f"hub failed ({type(e).__name__}); without the network, pass a local checkpoint "
                        "directory (config.json, *.safetensors, tokenizer.json)") from None


def read_config(path: str) -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(
            f"{path!r} has no config.json; point --model at a Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer.json)")
    d = read_json(cfg_file)
    try:
        return ModelConfig.from_hf(d)
    except KeyError as e:
        raise UserError(f"{cfg_file} has no {e} (is it a Qwen2 / Llama config.json?)") from None


def model_class(cfg: ModelConfig) -> type:
    """Transformer, or for a config with `vision` (Qwen2-VL) its subclass models.qwen2_vl.VLTransformer."""
    if cfg.vision is None:
        return Transformer
    return VLTransformer


def build(cfg: ModelConfig, device="cpu", dtype=torch.float32) -> Transformer:
    """Build on meta, then allocate on `device` (weights uninitialised: load or init them)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and not cfg.scores:  # to_empty/to make a new tensor per module: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_buffers()
    return model


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")


def iter_checkpoint(path: str):
    """Yields (hf_name, tensor) from a checkpoint directory, one tensor at a time (names as
    `legacy_name` gives them)."""
    for file in safetensors_files(path):
        with _open_safetensors(file) as f:
            for name in f.keys():
                yield legacy_name(name), f.get_tensor(name)


# transformers >= 4.52 names Qwen2-VL's parts model.language_model.* and model.visual.* in memory
# (and in some saved files); the older names, which transformers 5 writes and vLLM reads, are ours
NEW_NAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def legacy_name(name: str) -> str:
    for new, old in NEW_NAMES:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def check_checkpoint(path: str):
    """Every safetensors file of a checkpoint opens (its header is whole and covers the file):
    a truncated or foreign file fails here, named, before any process group or model is built."""
    for file in safetensors_files(path):
        with _open_safetensors(file):
            pass


def _open_safetensors(file: str):
    try:
        return safe_open(file, framework="pt")
    except FileNotFoundError:
        raise UserError(f"{file} is listed in the checkpoint's index but does not exist") from None
    except Exception as e:  # safetensors' own error: a bad header, a file cut short
        raise UserError(f"{file} is not a readable safetensors file ({e}): was it cut short while "
                        "copying or downloading? Copy or export it again") from None


def load_state(model: Transformer, weights, strict: bool = True, may_lack: tuple[str, ...] = ()):
    """Copies (hf_name, tensor) pairs into `model` in place (DTensor-aware: a sharded
    parameter takes its local shard of the full tensor). A score model skips a causal
    checkpoint's lm_head; parameters named in `may_lack` keep their values when the checkpoint
    has none (a value head started from a policy)."""
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, tensor in weights:
            name = legacy_name(name)
            if name == "lm_head.weight" and (model.config.tie_word_embeddings or model.config.scores):
                continue
            if name not in params:
                if strict:
                    raise UserError(f"checkpoint tensor {name!r} has no matching parameter")
                continue
            p = params[name]
            if tuple(tensor.shape) != tuple(p.shape):
                raise UserError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                f"model {tuple(p.shape)} (is this checkpoint from a different model config?)")
            if hasattr(p, "device_mesh"):  # DTensor under FSDP2: copy our shard only
                from torch.distributed.tensor import distribute_tensor
                # src_data_rank=None: every rank read the same file, so each slices locally (no traffic)
                tensor = distribute_tensor(tensor.to(p.device, p.dtype), p.device_mesh, p.placements,
                                           src_data_rank=None).to_local()
                p.to_local().copy_(tensor)
            else:
                p.copy_(tensor)
            seen.add(name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(params) - seen - set(may_lack) - tied
    if strict and missing:
        raise UserError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def load_model(path: str, device="cpu", dtype=torch.float32) -> Transformer:
    model = build(read_config(path), device, dtype)
    load_state(model, iter_checkpoint(path))
    return model


def save_model(model_or_state, cfg: ModelConfig, path: str, tokenizer_dir: str | None = None, dtype=None):
    """Writes config.json + model.safetensors (HF layout; tied lm_head left out as HF does),
    and copies tokenizer files from `tokenizer_dir`."""
    os.makedirs(path, exist_ok=True)
    items = model_or_state.state_dict().items() if isinstance(model_or_state, nn.Module) else model_or_state
    state = {}
    for name, t in items:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.detach().cpu()
        state[name] = (t.to(dtype) if dtype else t).contiguous()
    hf = cfg.to_hf()
    hf["torch_dtype"] = hf["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, path)


def copy_tokenizer(src: str, dst: str):
    """The tokenizer files of checkpoint `src` into directory `dst` (a HF export, a PEFT adapter)."""
    if os.path.abspath(src) == os.path.abspath(dst):
        return
    import shutil
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def checked_model(path: str, flag: str = "--model", tokenizer: bool = True) -> str:
    """A checkpoint's config, weights (and tokenizer) read, or one error naming `flag`; a hub id
    becomes its downloaded snapshot, which is returned (computed at runtime)."""
    path = local_dir(path, flag)
    check_model_dir(path, flag)  # config.json, or one line naming `flag` (a LoRA adapter: how to use it)
    try:
        read_config(path)
        if tokenizer:
            Tokenizer(path)
        check_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"{flag}: {e}") from None
    return path


def check_model_dir(path: str, flag: str):
    """A checkpoint directory given to `flag` (--model, --teacher-model, ...) has config.json, else
    one error naming that flag. Here because the usual such directory is a LoRA adapter (what a
    --lora-rank run exports: adapter_config.json and the adapters, no base weights): it says so
    and how an adapter is used. A directory that is not there is left to models.hf.read_config."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return
    adapter = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(adapter):
        raise UserError(f"{flag} {path} has no config.json: point {flag} at a Hugging Face checkpoint "
                        "directory (config.json, *.safetensors, tokenizer.json)")
    try:
        with open(adapter) as f:
            base = json.load(f).get("base_model_name_or_path") or ""
    except (OSError, ValueError, AttributeError):
        base = ""
    base = f" ({base}, as its adapter_config.json says)" if base else ""
    if flag == "--model":
        raise UserError(f"--model {path} is a LoRA adapter (adapter_config.json, no config.json), not a "
                        f"whole model: pass its base model{base} as --model, with --lora-rank R to train "
                        "adapters on it; to start from this adapter, merge it into its base first (peft's "
                        "merge_and_unload, then save_pretrained; a --lora-rank run writes that itself with "
                        "--merge-on-export)")
    raise UserError(f"{flag} {path} is a LoRA adapter (adapter_config.json, no config.json), not a whole "
                    f"model: merge it into its base model{base} (peft's merge_and_unload, then "
                    f"save_pretrained; a --lora-rank run writes that itself with --merge-on-export) and pass "
                    f"that directory as {flag}")
