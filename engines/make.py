"""Which engine a run gets (`--engine`, `--gen-tp`): checked before the process group (`check_engine`),
resolved for the device (`engine_kind`) and made (`make_engine`).
"""
import importlib.util

import torch

from engines import tp
from engines.native import NativeEngine
from engines.vllm_engine import PLUGIN_NEEDED, VLLM_NEEDED, VLLMEngine
from models.config import ModelConfig
from utils.errors import UserError


def check_engine(kind: str, placement: str):
    """--engine vllm, before the process group, so that every rank says the same one line instead of
    a rollout rank saying it while its trainers break off in the weight transfer's set-up: vLLM is
    installed and, for a rollout rank's engine in its own process, our transfer's entry point."""
    if kind != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"{VLLM_NEEDED} (vllm is not installed)")
    if placement == "disaggregate" and not torch.cuda.is_available():  # the gloo backend (nccl: vLLM's own)
        from engines import vllm_transfer  # defers vllm

        if not vllm_transfer.plugin_installed():
            raise UserError(PLUGIN_NEEDED)


def engine_kind(kind: str, device) -> str:
    """--engine auto: vLLM on GPU when it is installed, else the native engine."""
    if kind != "auto":
        return kind
    return "vllm" if torch.device(device).type == "cuda" and importlib.util.find_spec("vllm") else "native"


def make_engine(kind: str, model_dir: str, cfg: ModelConfig, tokenizer, device, dtype, max_model_len: int,
                seed=0, own_process=False, lora_rank: int = 0, max_images: int = 1, tp_group=None,
                routes: bool = False):
    """The engine --engine names (`engine_kind`). lora_rank: a vLLM engine serving LoRA adapters of
    this rank (--lora-vllm adapters); max_images: the most images in one of the run's prompts (vLLM
    reserves room for them; a Qwen2-VL checkpoint only); tp_group: --gen-tp's group of this rank, a
    native engine over this rank's part of the model (engines/tp.py); routes (--routing-replay): the
    native engine records each token's experts (a MoE model; flags refuse it with vLLM)."""
    k = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    if engine_kind(kind, device) == "vllm":
        engine = VLLMEngine(model_dir, tokenizer, device, dtype, max_model_len, seed, own_process=own_process,
                            lora_rank=lora_rank, max_images=max_images, tp=k)
        if k == 1:
            return engine
        return tp.TPEngine(engine, tp_group, split=False)  # vLLM's loader takes each worker's shard
    if tp_group is not None:
        return tp.TPEngine(NativeEngine(tp.config(cfg, k), tokenizer, device, dtype, tp_group), tp_group)
    return NativeEngine(cfg, tokenizer, device, dtype, routes=routes)
