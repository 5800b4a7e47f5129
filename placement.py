"""Which rank plays which role (`plan`), the engine each rank gets (`engine_for`), moving weights
from the trainers to the engines (`sync`); for a --rebalance move in process (rebalance.py), the
new layout's groups and mesh (`replan`) and the trainers' state moved onto it (`reshard`).

colocate (G-Core's full colocation): every rank trains and generates, taking turns on its device;
before generation it all-gathers the actor's FSDP2 shards block by block straight into its own
engine, which drops its weights and cache after generation so that training gets the memory back.
partial (G-Core's partial colocation, with a generative judge): every rank trains; for the rollout
the first S ranks sample while the other N - S judge, at the same time, finished groups streaming
from sampler to judge (rollouts.py `Streamed`); the weights go to the sampler ranks only.
disaggregate: ranks 0..N-K-1 train (FSDP2 over their own mesh), ranks N-K..N-1 only generate;
trainer i talks point to point to rollout rank N-K + i % K (roles/rollout.py); after each step the
trainers gather the full weights block by block and trainer 0 broadcasts them in buckets over its
own group (NCCL on GPU, gloo on CPU), or into vLLM workers through vLLM's weight-transfer layer
(engines/vllm_transfer.py).
"""
import datetime
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engines import tp
from engines.base import NoEngine
from roles.rollout import RemoteEngine, agree_on_transfer
from utils.dist import (broadcast_buckets, destroy_groups, filled, measured, outline, own_part, plan_buckets,
                        receive_buckets, slots)
from utils.errors import UserError, check_rules
from utils.logger import Timer

MOVES = itertools.count(1)  # moves in process (every rank counts alike): each new mesh is named by one


@dataclass
class PlacementArgs:
    placement: Literal["colocate", "disaggregate", "partial"] = "colocate"
    """colocate: every rank trains and generates, taking turns; disaggregate: --rollout-ranks ranks
    only generate while the others only train; partial (train_grpo.py, with --judge-model): every
    rank trains, and for the rollout the first --sampler-ranks sample while the others judge, at the
    same time"""
    sampler_ranks: int = 0
    """partial: the first S ranks generate with the policy, the other world - S run the judge"""
    rollout_ranks: int = 0
    """disaggregate: the last K ranks generate (each serves (world - K) / K trainers)"""
    max_staleness: int = 0
    """disaggregate: generate up to this many steps ahead while training, so samples are up to this
    many policy versions old (0: on-policy, the same run as colocate)"""
    sync_bucket_mb: float = 64.0
    """disaggregate: weights are gathered and broadcast to the rollout ranks in buckets of this size"""
    gen_tp: int = 1
    """colocate: generate tensor-parallel over groups of this many ranks (engines/tp.py), the engine
    holding 1/K of each block; training stays FSDP2 over all ranks"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "sync_bucket_mb": ("placement", lambda p: p == "disaggregate", "--placement disaggregate")}

    def layout_of(self, world: int, prompts_per_step: int) -> "Layout":
        """The flags' ranges, then the layout (`layout_of`): no process group needed."""
        check_rules(self, [
            ("gen_tp", self.gen_tp == 1 or self.placement == "colocate",
             f"it splits colocated generation, which --placement {self.placement} has not: add --placement "
             f"colocate, or drop --gen-tp"),
            ("rollout_ranks", self.rollout_ranks >= 0, "use 0 (colocate) or more"),
            ("sync_bucket_mb", 0 < self.sync_bucket_mb < math.inf, "use a positive size in MiB")])
        return layout_of(self.placement, world, prompts_per_step, self.rollout_ranks, self.max_staleness,
                     self.sampler_ranks)


@dataclass
class Layout:
    """The parallel degrees of a run; trainers + rollout ranks must be the torchrun world size."""
    mode: str
    world: int
    dp: int  # data-parallel trainer ranks (FSDP2 shards over these)
    rollout_ranks: int = 0  # generation-only ranks (disaggregate)
    sampler_ranks: int = 0  # partial: the first S ranks sample; the other dp - S judge

    def __post_init__(self):
        if self.sampler_ranks and self.mode != "partial":
            raise UserError("--sampler-ranks applies to --placement partial only (drop the flag, or add "
                            "--placement partial)")
        if self.mode == "partial":
            if self.rollout_ranks:
                raise UserError("--rollout-ranks applies to --placement disaggregate only; partial splits "
                                "its ranks with --sampler-ranks")
            if self.world < 2:
                raise UserError("--placement partial needs at least 2 ranks (a sampler and a judge): launch "
                                "with torchrun --nproc-per-node 2 or more")
            if not 1 <= self.sampler_ranks < self.world:
                raise UserError(f"--sampler-ranks {self.sampler_ranks} does not fit a world of {self.world}: "
                                f"the first S ranks sample and the rest judge, so fits: --sampler-ranks in "
                                f"{list(range(1, self.world))}")
        elif self.mode == "colocate":
            if self.rollout_ranks:
                raise UserError("--rollout-ranks applies to --placement disaggregate only; colocate "
                                "generates on every rank (drop the flag, or add --placement disaggregate)")
            if self.dp != self.world:
                raise UserError(f"colocate runs one trainer per rank: dp={self.dp} must equal the world "
                                f"size {self.world}; launch with torchrun --nproc-per-node {self.dp}")
        elif self.mode == "disaggregate":
            if self.world < 2:
                raise UserError("--placement disaggregate needs at least 2 ranks (one trainer, one "
                                "rollout): launch with torchrun --nproc-per-node 2 or more, or use "
                                "--placement colocate")
            fits = [k for k in range(1, self.world) if (self.world - k) % k == 0]
            if not 1 <= self.rollout_ranks < self.world or self.dp % self.rollout_ranks:
                raise UserError(f"--rollout-ranks {self.rollout_ranks} does not fit a world of {self.world}: "
                                f"it needs 1 <= K < {self.world} and every rollout rank serving the same "
                                f"number of trainers ({self.world} - K divisible by K); fits: "
                                f"--rollout-ranks in {fits}")
        else:
            raise UserError(f"--placement {self.mode!r} is not available; use colocate, disaggregate or "
                            "partial")

    @property
    def judge(self) -> int:
        """partial: the judge ranks."""
        return self.dp - self.sampler_ranks if self.mode == "partial" else 0

    def sampler_of(self, rank: int) -> int:
        """partial: the sampler rank that generates `rank`'s prompts (a sampler's are its own)."""
        if rank < self.sampler_ranks:
            return rank
        return (rank - self.sampler_ranks) % self.sampler_ranks

    def judges_of(self, sampler: int) -> list[int]:
        """partial: the judge ranks among which a sampler deals its own prompts' chunks: those it
        generates for (a judge rank judges its own prompts), or one when it has none (G < S)."""
        judges = [j for j in range(self.sampler_ranks, self.world) if self.sampler_of(j) == sampler]
        if not judges:
            judges = [self.sampler_ranks + sampler % self.judge]
        return judges


@dataclass
class Plan:
    """This rank's part in the run. Each group is named by what travels on it."""
    layout: Layout
    rank: int
    device: torch.device
    # "trainer" trains (colocate, partial: and generates); "rollout" only generates (disaggregate)
    role: Literal["trainer", "rollout"]
    mesh: DeviceMesh | None = None  # the trainers' 1-D mesh that FSDP2 shards over; None on rollout ranks
    trainer_group: ProcessGroup | None = None  # the trainers: reductions, loss normalisers, checkpoints
    weight_group: ProcessGroup | None = None  # disaggregate: trainer 0 + rollout ranks, the weights
    # disaggregate: every rank, with a week's timeout: the trainers' requests, which a rollout rank
    # waits for through whole training steps (a trainer that dies still fails it at once: its
    # connections close). The replies travel on the default group.
    request_group: ProcessGroup | None = None
    rollout_peer: int | None = None  # disaggregate: a trainer's rollout rank
    served: list[int] = field(default_factory=list)  # a rollout rank's trainers, in serving order
    timeout_s: float = 300  # --timeout-s: how long a collective waits for a rank that hangs
    gen_group: ProcessGroup | None = None  # colocate, --gen-tp K: the K ranks that generate as one

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def is_sampler(self) -> bool:
        """partial: this rank samples with the policy (else it judges)."""
        return self.rank < self.layout.sampler_ranks

    @property
    def dp(self) -> int:
        return self.layout.dp


def plan(mode: str, rank: int, world: int, device: torch.device, prompts_per_step: int,
         rollout_ranks: int = 0, max_staleness: int = 0, timeout_s: float = 300,
         sampler_ranks: int = 0, gen_tp: int = 1) -> Plan:
    """This rank's Plan. Checks that the layout fits the world and the batch, saying what would."""
    layout = layout_of(mode, world, prompts_per_step, rollout_ranks, max_staleness, sampler_ranks)
    if mode in ("colocate", "partial"):
        mesh = init_device_mesh(device.type, (layout.dp,), mesh_dim_names=("dp",))
        return Plan(layout, rank, device, "trainer", mesh, trainer_group=mesh.get_group(),
                    gen_group=tp.group_of(rank, world, gen_tp, timeout_s), timeout_s=timeout_s)
    return _disaggregated(layout, rank, device, timeout_s)


def replan(old: Plan, layout: Layout) -> Plan:
    """A --rebalance move in process, every rank: this rank's Plan in `layout`, new groups and
    trainer mesh, its dim named by the move: DTensor caches plans by mesh equality (ranks
    and names), and an earlier equal mesh's plans hold its groups, which `reshard` destroys."""
    dim, timeout = f"dp_{next(MOVES)}", datetime.timedelta(seconds=old.timeout_s)
    if layout.mode == "partial":  # every rank trains in both: a new mesh over them all, S' samplers
        group = dist.new_group(list(range(layout.world)), timeout=timeout)
        mesh = DeviceMesh.from_group(group, old.device.type, mesh_dim_names=(dim,))
        return Plan(layout, old.rank, old.device, "trainer", mesh, trainer_group=group,
                    timeout_s=old.timeout_s)
    return _disaggregated(layout, old.rank, old.device, old.timeout_s, dim)


def _disaggregated(layout: Layout, rank: int, device, timeout_s: float, dim: str = "dp") -> Plan:
    # every rank must create every group, in the same order (new_group is collective)
    world = layout.world
    timeout = datetime.timedelta(seconds=timeout_s)
    trainer_group = dist.new_group(list(range(layout.dp)), timeout=timeout)
    weight_group = dist.new_group([0, *range(layout.dp, world)], timeout=timeout)
    request_group = dist.new_group(list(range(world)), timeout=datetime.timedelta(days=7))
    if rank < layout.dp:
        mesh = DeviceMesh.from_group(trainer_group, device.type, mesh_dim_names=(dim,))
        return Plan(layout, rank, device, "trainer", mesh, trainer_group, weight_group, request_group,
                    rollout_peer=rollout_rank_of(rank, layout), timeout_s=timeout_s)
    served = []
    for trainer in range(layout.dp):
        if rollout_rank_of(trainer, layout) == rank:
            served.append(trainer)
    return Plan(layout, rank, device, "rollout", weight_group=weight_group, request_group=request_group,
                served=served, timeout_s=timeout_s)


def layout_of(mode: str, world: int, prompts_per_step: int, rollout_ranks: int = 0,
          max_staleness: int = 0, sampler_ranks: int = 0) -> Layout:
    """The layout of a world of `world` ranks, or a UserError that says which flag to change
    (no process group needed: the script calls it before starting one)."""
    layout = Layout(mode, world, dp=world - rollout_ranks, rollout_ranks=rollout_ranks,
                    sampler_ranks=sampler_ranks)
    if max_staleness < 0:
        raise UserError(f"--max-staleness {max_staleness}: use 0 (on-policy) or a positive number of "
                        "versions")
    if max_staleness and mode == "partial":
        raise UserError(f"--max-staleness {max_staleness}: partial placement is on-policy (as in G-Core: "
                        "its samplers wait for the weights of each step); drop the flag, or use --placement "
                        "disaggregate to overlap generation with training")
    if max_staleness and mode != "disaggregate":
        raise UserError(f"--max-staleness {max_staleness} overlaps generation with training, which "
                        "needs separate rollout ranks: add --placement disaggregate --rollout-ranks K, or "
                        "drop the flag")
    if prompts_per_step % layout.dp:
        fits = [k * layout.dp for k in range(1, 4)]
        raise UserError(f"--prompts-per-step {prompts_per_step} does not split over {layout.dp} trainer "
                        f"ranks (each rank is the controller of its own prompts); use a multiple such as "
                        f"{fits}")
    return layout


def reshard(old: Plan, new: Plan, state: dict | None, bucket_bytes: int) -> tuple[dict | None, dict]:
    """A --rebalance move in process, every rank: the old trainers' `state` (nested dicts of FSDP2
    DTensors over old.mesh, and plain values) onto new.mesh. The old trainers gather each tensor
    whole over their group, one at a time; trainer 0 broadcasts them in buckets to the ranks that
    only now train; each new trainer keeps its own slice (FSDP2's Shard(0)) as a DTensor over
    new.mesh (`redistribute` changes placements within one mesh, not across meshes); then the old
    groups go. -> (the state on a new trainer, else None; {"state_s", "state_bytes": full size})."""
    t, tensors = time.perf_counter(), []
    shape = [outline(state, tensors) if state is not None else None]  # every old trainer: its shards
    dist.broadcast_object_list(shape, src=0)  # what every rank walks, in the same order (trainer 0's)
    order, joiners = slots(shape[0]), list(range(old.dp, new.dp))  # joiners: trainer 0 sends them all
    group = dist.new_group([0, *joiners], timeout=datetime.timedelta(seconds=new.timeout_s))  # collective
    specs = [(str(s.index), s.shape, s.dtype) for s in order]
    buckets, kept = plan_buckets(specs, bucket_bytes), {}

    def keep(stream):
        for name, full in stream:
            if new.role == "trainer":
                kept[int(name)] = own_part(full, order[int(name)], new.mesh, new.device)
            yield name, full

    if old.role == "trainer":  # each tensor whole, in order: a gather over the old trainers
        stream = keep((str(s.index), x.full_tensor() if s.placements else x) for s, x in zip(order, tensors))
        if old.rank == 0 and joiners:
            broadcast_buckets(stream, buckets, 0, group, new.device, {})
        else:
            for _ in stream:
                pass
    elif new.role == "trainer":
        for _ in keep(receive_buckets(buckets, dict(s[:2] for s in specs), 0, group, new.device, {})):
            pass
    destroy_groups([group, old.trainer_group, old.weight_group, old.request_group])
    size = sum(math.prod(s.shape) * s.dtype.itemsize for s in order)
    return (filled(shape[0], kept) if new.role == "trainer" else None), {
        "state_s": time.perf_counter() - t, "state_bytes": size}


def rollout_rank_of(trainer: int, layout: Layout) -> int:
    """Trainer i is served by rollout rank dp + i % K."""
    return layout.dp + trainer % layout.rollout_ranks


def engine_for(plan: Plan, local_engine, weight_specs=None, bucket_bytes: int = 0, kept=None):
    """The engine this rank generates with, behind one interface (engines/native.py).
    colocate: `local_engine()`, in this process, taking turns with training on the device;
    disaggregate, trainer: its rollout rank, behind a `RemoteEngine` that expects `weight_specs`;
    disaggregate, rollout rank: `local_engine(own_process=True)`: a vLLM engine's core then runs
    in a child process with a world of its own (in-process, it would build its groups over the
    whole torchrun world, which the trainers never join); the native engine is the same either
    way. Which local engine (native or vLLM) is `engines.make.make_engine`'s choice; how the
    rollout ranks take their weights is agreed here too (roles/rollout.py `agree_on_transfer`)."""
    if plan.mode == "colocate":
        return local_engine(tp_group=plan.gen_group) if plan.gen_group else local_engine()
    if plan.mode == "partial":  # a judge rank joins its samplers' weight gathers: it takes what they take
        engine = local_engine() if plan.is_sampler else NoEngine()
        said = [engine.takes_adapters]
        dist.broadcast_object_list(said, src=0)
        engine.takes_adapters = said[0]
        return engine
    if plan.role == "trainer":
        engine = RemoteEngine(plan, weight_specs, bucket_bytes)
    else:  # a rollout rank that stays one through a --rebalance move keeps its engine
        engine = kept or local_engine(own_process=True)
    agree_on_transfer(plan, engine, weight_specs, bucket_bytes)
    return engine


def sync(plan: Plan, actor, engine, version: int, timer=None) -> dict:
    """Give the engine the actor's current full weights as policy `version` (the number of
    optimizer steps behind them), once it has answered every request sent ahead (disaggregate:
    the rollout ranks serve in order; the `wait` phase). The weights come from FSDP2 all-gathers,
    one block at a time, in which every trainer takes part. Returns the seconds (all, and those
    spent gathering) and the bytes moved."""
    timer = timer or Timer()
    with timer("wait"):
        engine.collect()
    with timer("sync"):
        return _sync(plan, actor, engine, version)


def _sync(plan: Plan, actor, engine, version: int) -> dict:
    t = time.perf_counter()
    stats = {"sync_gather_s": 0.0, "sync_bytes": 0}
    engine.version = version
    # LoRA, engines that take adapters alone (native ones merge them into the base, loaded once
    # unmerged; vLLM ones with --lora-vllm adapters have their own base): them alone after that
    lora_adapters = bool(actor.scales) and engine.takes_adapters
    if not (lora_adapters and engine.has_base):
        _give(plan, engine, measured(actor.full_weights(base=lora_adapters), stats))
        engine.has_base = lora_adapters
    if lora_adapters:
        _give(plan, engine, measured(actor.adapter_weights(), stats), (actor.adapter_specs(), actor.scales))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the broadcast and copies run asynchronously: time them whole
    return {"sync_s": time.perf_counter() - t, **stats}


def _give(plan: Plan, engine, weights, adapters: tuple | None = None):
    """colocate, partial: into this rank's engine. disaggregate: every trainer tells its rollout
    rank that a version (or LoRA's `adapters`: specs and scales) is coming; trainer 0 broadcasts it
    in buckets to all rollout ranks, the others join the gathers making it."""
    if plan.mode != "disaggregate":
        return engine.load_adapters(weights, adapters[1]) if adapters else engine.load_weights(weights)
    engine.announce_weights(adapters)
    if plan.rank == 0:
        engine.broadcast_weights(weights, adapters is not None)
    else:
        for _ in weights:
            pass
