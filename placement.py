"""Which rank plays which role, the device meshes, and moving weights between phases.

colocate (G-Core's full colocation): every rank is a trainer and a rollout engine at once,
taking turns on the same device. Before generation each rank all-gathers the actor's FSDP2
shards tensor by tensor straight into its own engine; after generation the engine drops its
weights and cache so that training gets the memory back.
"""
import time
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh


@dataclass
class Layout:
    """The parallel degrees of a run; their product must be the torchrun world size."""
    mode: str
    world: int
    dp: int  # data-parallel trainer ranks (FSDP2 shards over these)

    def __post_init__(self):
        if self.mode != "colocate":
            raise ValueError(f"--placement {self.mode!r} is not available; use colocate")
        if self.dp != self.world:
            raise ValueError(f"colocate runs one trainer per rank: dp={self.dp} must equal the world size "
                             f"{self.world}; launch with torchrun --nproc-per-node {self.dp}")


@dataclass
class Plan:
    layout: Layout
    rank: int
    mesh: object  # the trainers' 1-D DeviceMesh ("dp")

    @property
    def world(self):
        return self.layout.world


def plan(mode: str, rank: int, world: int, device: torch.device, prompts_per_step: int) -> Plan:
    layout = Layout(mode, world, dp=world)
    if prompts_per_step % layout.dp:
        fits = [k * layout.dp for k in range(1, 4)]
        raise ValueError(f"--prompts-per-step {prompts_per_step} does not split over {layout.dp} trainer ranks "
                         f"(each rank is the controller of its own prompts); use a multiple such as {fits}")
    mesh = init_device_mesh(device.type, (layout.dp,), mesh_dim_names=("dp",))
    return Plan(layout, rank, mesh)


def sync(actor, engine) -> dict:
    """Fill the local engine with the actor's current full weights (colocate). Returns the
    seconds and bytes moved."""
    t, nbytes = time.perf_counter(), 0

    def counted():
        nonlocal nbytes
        for name, tensor in actor.full_weights():
            nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    engine.load_weights(counted())
    return {"sync_s": time.perf_counter() - t, "sync_bytes": nbytes}


def release(engine):
    """Give the engine's memory back before training (colocate)."""
    engine.release()
