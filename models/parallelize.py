"""FSDP2 over our models, torchtitan's order (its parallelize.py beside each model): each vision
block and each decoder block its own unit, then the root; built on meta and loaded shard by shard
from a checkpoint, so no rank ever holds the full model.
"""
import torch

from models import lora as lora_lib
from models.hf import iter_checkpoint, load_state, model_class, read_config
from utils.dist import vision_blocks
from utils.errors import UserError


def shard(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, compile: bool = False):
    """FSDP2, torchtitan's order: each decoder block, then the root (embeddings, norm, head).
    compile: torch.compile each block's forward first (torchtitan's per-block compile: the
    blocks are alike, so one graph serves all; FSDP2's all-gather hooks stay outside it, and
    the parameter names stay HF's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in vision_blocks(model):  # Qwen2-VL: each vision block a unit too (it runs every forward)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    for layer in model.model.layers:
        if compile:
            layer.forward = torch.compile(layer.forward, fullgraph=True, dynamic=True)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def load_sharded(path: str, mesh, device, param_dtype=torch.float32, value_head: bool = False,
                 compile: bool = False, lora=None, seed: int = 0):
    """Build on meta, shard with FSDP2, allocate only this rank's shards, then copy each
    checkpoint tensor's slice in (torchtitan's order: no rank ever holds a full model).
    value_head: a value model with one score: a score checkpoint's own head, or a causal
    checkpoint's decoder with a zero head (every value starts at 0, as the critic's baseline).
    lora: models.lora.LoraArgs with a rank: adapters added before sharding (in the same FSDP units
    as their base), started from `seed`; every other parameter frozen."""

    cfg = read_config(path)
    fresh_head = value_head and not cfg.scores
    if fresh_head:
        cfg = cfg.with_score_head(1)
    if value_head and cfg.num_labels != 1:
        raise UserError(f"{path} scores {cfg.num_labels} labels; a value model needs one")
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    adapters = ()
    if lora is not None and lora.lora_rank:
        lora_lib.add(model, lora)
        adapters = tuple(n for n, _ in model.named_parameters() if lora_lib.is_adapter(n))
    shard(model, mesh, param_dtype=param_dtype, compile=compile)
    model.to_empty(device=device)
    model.init_buffers()
    load_state(model, iter_checkpoint(path), may_lack=("score.weight",) if fresh_head else adapters)
    if adapters:
        load_state(model, lora_lib.initial(model, seed), strict=False)
    if fresh_head:
        with torch.no_grad():
            model.score.weight.zero_()
    return model
