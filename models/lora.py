"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen base
linear plus a trained low-rank update, y = x W^T + b + (alpha / r) (x A^T) B^T, A [r, in] and
B [out, r]; B starts at 0, so step 0 is the base model. PEFT's initialisation of A (Kaiming-
uniform, a = sqrt(5), as nn.Linear's) and its names, so that an export is a PEFT adapter.

Chosen before the loop by --lora-rank (`LoraArgs`; 0: off, full fine-tuning). The adapters
live on our own linear modules (`add`: `model.layers.0.self_attn.q_proj.lora_A`), FSDP2 shards
them with their block; only they train and only they are in the optimizer and the checkpoints.
The reference policy is the actor with its adapters switched off (`Reference`: no second
model). The native engine takes the base once, then the adapters alone, and merges them itself
(W + (alpha / r) B A in fp32, then its dtype; it keeps the base between steps); vLLM takes the
merged weights (`merged`) through the same sync as full weights, or serves the adapters. The
export is a PEFT directory (`export`), or with --merge-on-export a full HF checkpoint.
"""
import json
import math
import os
import re
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from models.hf import copy_tokenizer, save_model
from utils.errors import UserError, check_rules

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraArgs:
    lora_rank: int = 0
    """LoRA adapters of this rank on --lora-targets; only they train (0: off, the full model trains).
    RL needs little capacity: rank 1-32 at ~10x full fine-tuning's --lr ("LoRA Without Regret", 2025)"""
    lora_alpha: float = 16.0
    """--lora-rank: the adapters' update is scaled by alpha / rank"""
    lora_targets: str = "all-linear"
    """--lora-rank: the linear layers that get adapters: all-linear (q/k/v/o and gate/up/down of every
    block; not the LM head), or names, comma-separated, such as q_proj,v_proj"""
    lora_vllm: Literal["merged", "adapters"] = "merged"
    """--lora-rank with vLLM engines: merged: vLLM takes W + (alpha/r) B A through the weight transfer
    (exact in fp32); adapters: vLLM serves the adapters itself on its own load of the base (enable_lora),
    each sync written as a PEFT directory under a new path and id (the old one removed)"""
    merge_on_export: bool = False
    """--lora-rank: export the final policy as a full HF checkpoint with the adapters merged in (default:
    a PEFT adapter directory, adapter_config.json + adapter_model.safetensors)"""
    APPLIES: ClassVar = {k: ("lora_rank", lambda r: r > 0, "a --lora-rank above 0")
                         for k in ("lora_alpha", "lora_targets", "lora_vllm", "merge_on_export")}

    def check(self, engine: str = "native", placement: str = "colocate"):
        check_rules(self, [
            ("lora_rank", self.lora_rank >= 0, "use 0 (off) or a rank such as 8"),
            ("lora_alpha", 0 < self.lora_alpha < math.inf, "use a positive scale such as 16"),
            ("lora_vllm", self.lora_vllm == "merged" or engine == "vllm",
             "adapters is vLLM's mode (the native engine takes the base once and then the adapters alone "
             "already): use merged, or --engine vllm"),
            ("lora_vllm", self.lora_vllm == "merged" or placement != "partial",
             "in partial placement the judge ranks take part in the samplers' weight gathers: use merged"),
            ("lora_rank", self.lora_vllm == "merged" or self.lora_rank <= VLLM_RANKS[-1],
             f"vLLM serves adapters up to rank {VLLM_RANKS[-1]}: use at most {VLLM_RANKS[-1]}, or "
             f"--lora-vllm merged")])
        if self.lora_rank:
            self.targets()

    def targets(self) -> tuple[str, ...]:
        if self.lora_targets == "all-linear":
            return ALL_LINEAR
        names = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        unknown = [t for t in names if t not in ALL_LINEAR]
        if not names or unknown:
            raise UserError(f"--lora-targets {self.lora_targets}: {unknown or 'no name'} matches no linear "
                            f"layer of the model; use all-linear or names among {', '.join(ALL_LINEAR)}")
        return names


class Switch:
    """Whether a model's adapters are on (the reference policy switches them off)."""
    on = True


class LoraLinear(nn.Linear):
    """An nn.Linear that `add` gave lora_A [r, in] and lora_B [out, r] (its weight and bias frozen)."""
    switch: Switch
    scale: float

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.switch.on:
            return y
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale  # [..., out]


def add(model, cfg: LoraArgs) -> Switch:
    """Gives the targeted linears of `model` (built, not yet sharded; meta is fine) their adapters
    and freezes every other parameter. Returns the model's switch."""
    switch, targets = Switch(), cfg.targets()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets and ".layers." in f".{name}":
            module.__class__ = LoraLinear
            module.switch, module.scale = switch, cfg.lora_alpha / cfg.lora_rank
            device = module.weight.device
            module.lora_A = nn.Parameter(torch.zeros(cfg.lora_rank, module.in_features, device=device))
            module.lora_B = nn.Parameter(torch.zeros(module.out_features, cfg.lora_rank, device=device))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    model.lora = switch
    return switch


def count(cfg, args: LoraArgs) -> int:
    """The adapter parameters --lora-* gives a model of config `cfg`: r (in + out) per target per
    block (0 with LoRA off)."""
    return cfg.num_hidden_layers * args.lora_rank * sum(i + o for i, o in _shapes(cfg, args))


def adapted(cfg, args: LoraArgs) -> int:
    """The elements of the weights --lora-* adapts, in x out per target per block (0 with LoRA off):
    what an engine merging the adapters into its base holds a second time."""
    return cfg.num_hidden_layers * sum(i * o for i, o in _shapes(cfg, args))


def _shapes(cfg, args: LoraArgs) -> list[tuple[int, int]]:
    """(in, out) of each targeted linear of one block; none with LoRA off."""
    if not args.lora_rank:
        return []
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    return [shapes[t] for t in args.targets()]


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def initial(model, seed: int):
    """(name, full tensor) of every adapter at its start, deterministic in `seed` whatever the
    ranks: A Kaiming-uniform (a = sqrt(5): bound 1 / sqrt(in), as nn.Linear's and PEFT's), B 0."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".lora_A"):
            bound = 1 / math.sqrt(p.shape[1])
            yield name, torch.rand(tuple(p.shape), generator=g) * 2 * bound - bound
        elif name.endswith(".lora_B"):
            yield name, torch.zeros(tuple(p.shape))


def merged(weights, scales: dict):
    """A (name, tensor) stream of a model with adapters -> the same stream with each adapted
    weight replaced by W + scale B A (in fp32, then W's dtype) and the adapters left out: what an
    engine without LoRA takes, in the same order as before (`weight_specs`'). Within a module the
    weight (and bias) come before its lora_A and lora_B (registration order), so they are held
    until those come; all belong to one FSDP unit, whose tensors stay valid until its last is taken."""
    held = {}  # module prefix -> {"weight": tensor, "bias": tensor, "lora_A": tensor}
    for name, t in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix not in scales:
            yield name, t
            continue
        held.setdefault(prefix, {})[leaf] = t
        if leaf == "lora_B":
            part = held.pop(prefix)
            w, a = part["weight"], part["lora_A"]
            yield f"{prefix}.weight", (w.float() + scales[prefix] * (t.float() @ a.float())).to(w.dtype)
            if "bias" in part:
                yield f"{prefix}.bias", part["bias"]


def scales(model) -> dict:
    """{module prefix: alpha / r} of every adapted linear."""
    return {name: m.scale for name, m in model.named_modules() if isinstance(m, LoraLinear)}


class Reference:
    """The reference policy for free: the actor's model with its adapters switched off (the KL term
    costs one forward, no second model)."""

    def __init__(self, actor):
        self.actor = actor

    @torch.no_grad()
    def logprobs(self, batch):
        switch = self.actor.model.lora
        switch.on = False
        try:
            return self.actor.logprobs(batch)
        finally:
            switch.on = True


def write_peft(path: str, adapters: dict, rank: int, alpha: float, base: str = ""):
    """A PEFT adapter directory: adapter_model.safetensors (PEFT's key names) and adapter_config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {f"base_model.model.{name}.weight": t.contiguous() for name, t in adapters.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    targets = sorted({re.sub(r"\.lora_[AB]$", "", n).rsplit(".", 1)[-1] for n in adapters})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": rank, "lora_alpha": alpha, "target_modules": targets,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's max_lora_rank choices (config/lora.py)


def vllm_max_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that serves `rank`."""
    return min(r for r in VLLM_RANKS if r >= rank)


def export(actor, path: str, rank: int, tokenizer_dir: str, cfg: LoraArgs, base: str):
    """The final policy: a PEFT adapter directory (PEFT's names and config, for transformers +
    peft on `base`), or with --merge-on-export a full HF checkpoint. Every rank joins the gathers."""

    full = [(name, t.cpu()) for name, t in actor.full_weights(exact=True)]
    if cfg.merge_on_export:
        weights = list(merged(full, scales(actor.model)))
        if rank == 0:
            save_model(weights, actor.config, path, tokenizer_dir=tokenizer_dir)
        return
    if rank != 0:
        return
    write_peft(path, {name: t for name, t in full if is_adapter(name)}, cfg.lora_rank, cfg.lora_alpha, base)
    copy_tokenizer(tokenizer_dir, path)
