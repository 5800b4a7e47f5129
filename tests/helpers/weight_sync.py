"""Run under torchrun by tests/test_disaggregate.py (2 trainers + 2 rollout ranks): one weight
sync per bucket size through placement.sync -> RemoteEngine -> rollout.serve; between syncs
the trainers scale their shards so every sync carries new values. Trainer 0 writes the full
weights it sent, each rollout rank what its engine was given."""
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from engines.base import Engine
from roles.actor import Actor  # noqa: E402
from roles.rollout import RemoteEngine, serve  # noqa: E402
from utils import dist  # noqa: E402

model_dir, out, sizes = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3:]]
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("disaggregate", rank, world, device, prompts_per_step=2, rollout_ranks=2, timeout_s=60)


class Recorder(Engine):
    """An engine that keeps a copy of every set of weights it is given."""

    def __init__(self):
        self.got = []

    def load_weights(self, weights):
        self.got.append({name: t.clone() for name, t in weights})


if plan.role == "rollout":
    engine = Recorder()
    serve(plan, engine)
    for i, weights in enumerate(engine.got):
        save_file(weights, os.path.join(out, f"rank{rank}_sync{i}.safetensors"))
else:
    actor = Actor(model_dir, plan.mesh, device, lr=1e-3, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0)
    for i, size in enumerate(sizes):
        engine = RemoteEngine(plan, actor.weight_specs(), size)
        placement.sync(plan, actor, engine, version=i)
        full = {name: t.clone() for name, t in actor.full_weights()}
        if rank == 0:
            save_file(full, os.path.join(out, f"sent_sync{i}.safetensors"))
        with torch.no_grad():
            for p in actor.model.parameters():
                p.to_local().mul_(1.5)
    engine.close()
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
