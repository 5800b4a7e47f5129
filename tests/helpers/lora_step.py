"""Run under torchrun by tests/test_lora.py: an FSDP2 actor with LoRA adapters takes 3 optimizer
steps on a fixed batch (each rank its rows); rank 0 writes every tensor as it is after them
(base and adapters, exact) and the engine's stream (the merged weights) to OUT and OUT.engine."""
import os
import sys
from functools import partial

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from models.lora import LoraArgs
from roles.actor import Actor  # noqa: E402
from tasks.data import make_batch, rank_slice
from train_grpo import Args, loss_fn  # noqa: E402
from utils import dist  # noqa: E402

model_dir, out, targets = sys.argv[1], sys.argv[2], sys.argv[3]
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
lora = LoraArgs(lora_rank=4, lora_alpha=8.0, lora_targets=targets)
actor = Actor(model_dir, plan.mesh, device, lr=1e-2, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0,
              micro_batch_size=4, lora=lora, seed=3)
trained = sum(p.numel() for group in actor.opt.param_groups for p in group["params"])

g = torch.Generator().manual_seed(0)
N, T = 8, 5
prompts = [torch.randint(1, 200, (4,), generator=g).tolist() for _ in range(N)]
batch = make_batch(prompts, torch.randint(1, 200, (N, T), generator=g), torch.full((N,), T), 0)
batch["old_logp"] = -torch.rand(N, T, generator=g) * 3
batch["adv"] = torch.randn(N, generator=g)[:, None].expand(N, T)
rows = rank_slice(list(range(N)), rank, world)
mine = {k: (v[rows[0]:rows[-1] + 1] if torch.is_tensor(v) else v) for k, v in batch.items()}
for _ in range(3):
    actor.train_step(mine, partial(loss_fn, args=Args(kl_coef=0.0)), float(batch["loss_mask"].sum()) / world)
full = {k: v.clone() for k, v in actor.full_weights(exact=True)}
engine = {k: v.clone() for k, v in actor.full_weights()}
specs = [name for name, _, _ in actor.weight_specs()]
if rank == 0:
    save_file(full, out)
    save_file(engine, out + ".engine")
    with open(out + ".txt", "w") as f:
        f.write(f"{trained} {' '.join(specs) == ' '.join(engine)}")
dist.exit_now(0)
