"""Which rank plays which role, the device meshes and groups, and moving weights between
the trainers and the engines.

colocate (G-Core's full colocation): every rank is a trainer and a rollout engine at once,
taking turns on the same device. Before generation each rank all-gathers the actor's FSDP2
shards block by block straight into its own engine; after generation the engine drops its
weights and cache so that training gets the memory back.

disaggregate: ranks 0..N-K-1 train (FSDP2 over their own mesh), ranks N-K..N-1 only
generate, at the same time. Trainer i is paired with rollout rank N-K + i % K and talks to
it point to point (its prompts out, its samples back); after each optimizer step the
trainers gather the full weights block by block and trainer 0 broadcasts them in buckets
of bounded bytes to the rollout ranks over their own group (NCCL on GPU, gloo on CPU).
"""
import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class Layout:
    """The parallel degrees of a run; trainers + rollout ranks must be the torchrun world size."""
    mode: str
    world: int
    dp: int  # data-parallel trainer ranks (FSDP2 shards over these)
    rollout: int = 0  # generation-only ranks (disaggregate)

    def __post_init__(self):
        if self.mode == "colocate":
            if self.rollout:
                raise ValueError("--rollout-ranks applies to --placement disaggregate only; colocate generates "
                                 "on every rank (drop the flag, or add --placement disaggregate)")
            if self.dp != self.world:
                raise ValueError(f"colocate runs one trainer per rank: dp={self.dp} must equal the world size "
                                 f"{self.world}; launch with torchrun --nproc-per-node {self.dp}")
        elif self.mode == "disaggregate":
            if self.world < 2:
                raise ValueError("--placement disaggregate needs at least 2 ranks (one trainer, one rollout): "
                                 "launch with torchrun --nproc-per-node 2 or more, or use --placement colocate")
            fits = [k for k in range(1, self.world) if (self.world - k) % k == 0]
            if not 1 <= self.rollout < self.world or self.dp % self.rollout:
                raise ValueError(f"--rollout-ranks {self.rollout} does not fit a world of {self.world}: it needs "
                                 f"1 <= K < {self.world} and every rollout rank serving the same number of "
                                 f"trainers ({self.world} - K divisible by K); fits: --rollout-ranks in {fits}")
        else:
            raise ValueError(f"--placement {self.mode!r} is not available; use colocate or disaggregate")


@dataclass
class Plan:
    layout: Layout
    rank: int
    role: str  # "trainer" (colocate: trainer and engine) | "rollout"
    mesh: object = None  # the trainers' 1-D DeviceMesh ("dp"); None on rollout ranks
    group: object = None  # the trainers' process group: metric reductions, checkpoints
    sync_group: object = None  # trainer 0 + the rollout ranks: the weight broadcast (disaggregate)
    requests: object = None  # all ranks, long timeout: trainers' requests, which rollout ranks wait for
    peer: int | None = None  # a trainer's rollout rank (disaggregate)
    trainers: list = field(default_factory=list)  # a rollout rank's trainers, in the order it serves them

    @property
    def dp(self):
        return self.layout.dp


def plan(mode: str, rank: int, world: int, device: torch.device, prompts_per_step: int, rollout_ranks: int = 0,
         max_staleness: int = 0, timeout_s: float = 300) -> Plan:
    layout = Layout(mode, world, dp=world - rollout_ranks, rollout=rollout_ranks)
    if max_staleness < 0:
        raise ValueError(f"--max-staleness {max_staleness}: use 0 (on-policy) or a positive number of versions")
    if max_staleness and mode != "disaggregate":
        raise ValueError(f"--max-staleness {max_staleness} overlaps generation with training, which needs "
                         "separate rollout ranks: add --placement disaggregate --rollout-ranks K, or drop the flag")
    if prompts_per_step % layout.dp:
        fits = [k * layout.dp for k in range(1, 4)]
        raise ValueError(f"--prompts-per-step {prompts_per_step} does not split over {layout.dp} trainer ranks "
                         f"(each rank is the controller of its own prompts); use a multiple such as {fits}")
    if mode == "colocate":
        mesh = init_device_mesh(device.type, (layout.dp,), mesh_dim_names=("dp",))
        return Plan(layout, rank, "trainer", mesh, mesh.get_group())
    # every rank must create every group, in the same order (new_group is collective)
    timeout = datetime.timedelta(seconds=timeout_s)
    trainers = dist.new_group(list(range(layout.dp)), timeout=timeout)
    sync_group = dist.new_group([0, *range(layout.dp, world)], timeout=timeout)
    # a rollout rank waits for its next request through whole training steps, checkpoints and
    # exports: no timeout there (a week); a trainer that dies still fails it at once (closed socket)
    requests = dist.new_group(list(range(world)), timeout=datetime.timedelta(days=7))
    peer_of = lambda i: layout.dp + i % layout.rollout  # noqa: E731
    if rank < layout.dp:
        mesh = DeviceMesh.from_group(trainers, device.type, mesh_dim_names=("dp",))
        return Plan(layout, rank, "trainer", mesh, trainers, sync_group, requests, peer=peer_of(rank))
    return Plan(layout, rank, "rollout", sync_group=sync_group, requests=requests,
                trainers=[i for i in range(layout.dp) if peer_of(i) == rank])


def sync(actor, engine, version: int) -> dict:
    """Give the engine the actor's current full weights, as policy `version` (the number of
    optimizer steps behind them). colocate: straight into the local engine; disaggregate: the
    remote engine broadcasts them in buckets (every trainer joins the gathers). Returns the
    seconds (all, and those spent gathering FSDP shards) and the bytes moved."""
    t, gather_s, nbytes = time.perf_counter(), 0.0, 0

    def counted():
        nonlocal gather_s, nbytes
        weights = actor.full_weights()
        while True:
            t0 = time.perf_counter()
            item = next(weights, None)
            gather_s += time.perf_counter() - t0
            if item is None:
                return
            nbytes += item[1].numel() * item[1].element_size()
            yield item

    engine.version = version
    weights = counted()
    engine.load_weights(weights)
    # the gathers are collectives: finish them whatever the engine consumed (a remote engine on
    # trainers > 0 takes none; one that stops at the last tensor would leave its block unsharded)
    for _ in weights:
        pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the broadcast and copies run asynchronously: time them whole
    return {"sync_s": time.perf_counter() - t, "sync_gather_s": gather_s, "sync_bytes": nbytes}


def release(engine):
    """Give the engine's memory back before training (colocate; a remote engine keeps its own)."""
    engine.release()
