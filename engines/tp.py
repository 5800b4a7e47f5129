"""Tensor-parallel generation (--gen-tp K, colocate): every group of K consecutive ranks generates
as one native engine while training stays FSDP2 over all ranks.

Megatron-LM's split of a decoder block (Shoeybi et al. 2019): q/k/v and gate/up are
column-parallel (each rank keeps its rows: H/K query heads, KV/K key-value heads, I/K of the MLP),
o_proj and down_proj row-parallel (each rank keeps the matching columns and computes a partial
sum, all-reduced over the group: two all-reduces per block, engines/decode.py `FusedDecoder`); the
embedding, the norms and the head stay whole on every rank, so each rank computes the same
logits and samples the same tokens. Each sync gathers the full weights block by block from the
FSDP2 shards, as colocate always does (placement.sync), and each rank keeps its part (`part`):
the engine holds 1/K of the blocks' weights and of the KV cache's heads. The K ranks of a group
generate their prompts together, in lockstep (`TPEngine`). With --engine vllm the group is vLLM's
own tensor-parallel workers in the same ranks (its external_launcher executor): they take the
full weights and shard them by vLLM's loader (engines/native.py `make_engine`).
"""
import dataclasses
import datetime

import torch
import torch.distributed as dist

from engines.base import Engine, Samples
from models.hf import read_config
from utils.errors import UserError

COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # their output rows split
ROWS = ("o_proj", "down_proj")  # their input columns split


def check(cfg, k: int, world: int):
    """--gen-tp K against the world and the model: one line that says what would fit."""
    if k < 1 or world % k:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise UserError(f"--gen-tp {k}: groups of K ranks must split the {world} ranks; fits: --gen-tp in "
                        f"{fits}")
    sizes = {"attention heads": cfg.num_attention_heads, "key-value heads": cfg.num_key_value_heads,
             "MLP width": cfg.intermediate_size}
    for what, size in sizes.items():
        if size % k:
            fits = [d for d in range(1, world + 1)
                    if world % d == 0 and all(s % d == 0 for s in sizes.values())]
            raise UserError(f"--gen-tp {k}: the model's {size} {what} do not split over {k} ranks; fits: "
                            f"--gen-tp in {fits}")


def config(cfg, k: int):
    """The config of one rank's part: the same blocks with H/K, KV/K heads and I/K of the MLP
    (head_dim is kept, so the projections' shapes follow)."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // k,
                               num_key_value_heads=cfg.num_key_value_heads // k,
                               intermediate_size=cfg.intermediate_size // k)


def part(name: str, full: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """Rank r's part of a full tensor (hf name): rows of a column-parallel weight or bias, columns
    of a row-parallel weight (whose bias stays whole: added after the sum), else the whole."""
    module = name.split(".")[-2] if "." in name else ""
    if module in COLUMNS:
        return full.chunk(k, 0)[r]
    if module in ROWS and name.endswith(".weight"):
        return full.chunk(k, 1)[r]
    return full


class TPEngine(Engine):
    """A native engine over one rank's part (`part`, `config`), generating in lockstep with the
    other K - 1 ranks of its group: each call gathers the group's prompts, generates them all
    (the same batch on every rank of the group: its all-reduces pair up) and returns this rank's
    own. Every rank of a group must call `generate` alike, with no prompts too (`collective`)."""
    collective = True
    takes_adapters, has_base = False, False  # LoRA is refused with --gen-tp

    def __init__(self, inner, group, split: bool = True):
        """split: the sync's full weights are cut here (`part`: the native engine); False: the inner
        engine takes them whole and shards them itself (vLLM's TP workers)."""
        self.inner, self.group, self.split = inner, group, split
        self.r, self.k = dist.get_rank(group), dist.get_world_size(group)

    @property
    def version(self):
        return self.inner.version

    @version.setter
    def version(self, value):
        self.inner.version = value

    def load_weights(self, weights):
        if not self.split:
            return self.inner.load_weights(weights)
        self.inner.load_weights((name, part(name, t, self.r, self.k)) for name, t in weights)

    def generate(self, prompts, params, seeds) -> Samples:
        shares = [None] * self.k
        dist.all_gather_object(shares, (prompts, seeds), group=self.group)
        every = [p for ps, _ in shares for p in ps]
        if not every:
            return Samples.empty(self.version)
        out = self.inner.generate(every, params, [s for _, ss in shares for s in ss])
        if not prompts:
            return Samples.empty(self.version)
        start = params.n * sum(len(ps) for ps, _ in shares[:self.r])
        mine = out.take(list(range(start, start + params.n * len(prompts))))
        T = int(mine.lengths.max())  # as wide as this rank's own batch would have been
        return dataclasses.replace(mine, tokens=mine.tokens[:, :T], logprobs=mine.logprobs[:, :T])

    def release(self):
        self.inner.release()

    def close(self):
        self.inner.close()


def group_of(rank: int, world: int, k: int, timeout_s: float):
    """This rank's group of K consecutive ranks (every rank makes every group: new_group is
    collective); None for K = 1."""
    if k == 1:
        return None
    mine = None
    for first in range(0, world, k):
        group = dist.new_group(list(range(first, first + k)), timeout=datetime.timedelta(seconds=timeout_s))
        if first <= rank < first + k:
            mine = group
    return mine


def check_args(args, world: int):
    """--gen-tp against the other flags and the model (after the model is resolved): what it is
    not built for is refused with what to change."""
    k = args.placement.gen_tp
    if k == 1:
        return

    cfg = read_config(args.data.model)
    env = getattr(args, "env", None)
    refused = [("LoRA", args.lora.lora_rank > 0, "the adapters are not split; drop --lora-rank or --gen-tp"),
               ("a vision-language --model", cfg.vision is not None, "its vision tower is not split"),
               ("--env / --tools", env is not None and (env.env or env.tools),
                "episodes take turns per rank, not in lockstep"),
               ("--agent", getattr(getattr(args, "agent", None), "agent", None) is not None,
                "agents' requests come to each rank's engine at their own times, not in lockstep")]
    for what, holds, why in refused:
        if holds:
            raise UserError(f"--gen-tp {k} with {what}: {why} (or drop --gen-tp)")
    check(cfg, k, world)
