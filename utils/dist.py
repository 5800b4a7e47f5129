"""torch.distributed plumbing: process group set-up, FSDP2 sharding, metric reduction."""
import datetime
import os

import torch
import torch.distributed as dist


def init(timeout_s: float = 300) -> tuple[int, int, torch.device]:
    """Join the torchrun world (a world of 1 when run as a plain script). gloo on CPU, NCCL on
    GPU. The timeout makes a dead peer fail its collectives instead of hanging forever."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if "MASTER_ADDR" not in os.environ:  # plain `python train_grpo.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 20000))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # ranks on one machine share its cores: one intra-op pool per rank, not per core
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # our own key prefix per torchrun restart: after a rank dies and torchrun restarts the
        # workers, no key of the failed attempt (e.g. a dead rank's address) can be read back
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent, timeout=timeout)
        store = dist.PrefixStore(f"rl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return rank, world, device


def close():
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32):
    """FSDP2, torchtitan's order: each decoder block, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def load_sharded(path: str, mesh, device, param_dtype=torch.float32):
    """Build on meta, shard with FSDP2, allocate only this rank's shards, then copy each
    checkpoint tensor's slice in (torchtitan's order: no rank ever holds a full model)."""
    from utils.model import Transformer, iter_checkpoint, load_state, read_config

    with torch.device("meta"):
        model = Transformer(read_config(path))
    shard(model, mesh, param_dtype=param_dtype)
    model.to_empty(device=device)
    model.init_buffers()
    load_state(model, iter_checkpoint(path))
    return model


def full_tensors(model):
    """(hf_name, full tensor) one parameter at a time: each DTensor shard is all-gathered
    when it is reached, so the extra memory is one tensor, not the model. Every rank of
    the mesh must iterate in step (the gathers are collectives)."""
    for name, p in model.named_parameters():
        t = p.detach()
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def reduce(values: dict, op=dist.ReduceOp.SUM, group=None) -> dict[str, float]:
    """Reduce each metric over ranks with one all_reduce; returns Python floats (log time only)."""
    names = sorted(values)
    t = torch.tensor([float(values[k]) for k in names], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)
    return dict(zip(names, t.tolist()))
