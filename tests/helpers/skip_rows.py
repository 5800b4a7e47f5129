"""Run under torchrun by tests/test_fsdp.py: one FSDP2 train step where some rows have advantage
0, once with those rows skipped (skip_zero_adv_rows) and once with every row run. Rank 0
writes both steps' full gradients and the rows each rank trained."""
import json
import os
import sys
from functools import partial

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from roles.actor import Actor  # noqa: E402
from tasks.data import make_batch
from train_grpo import Args, loss_fn  # noqa: E402
from utils import dist  # noqa: E402

model_dir, out = sys.argv[1], sys.argv[2]
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
# rank 0 has 3 rows with a nonzero advantage, rank 1 has 1: both must train 3 rows
ADV = [[0.0, 1.2, 0.0, -0.5, 0.3, 0.0], [0.0, 0.0, 0.7, 0.0, 0.0, 0.0]]


def step(skip: bool):
    actor = Actor(model_dir, plan.mesh, device, lr=1e-2, warmup_steps=1, weight_decay=0.1, max_grad_norm=1e9,
                  temperature=1.0, micro_batch_size=2)
    grads, opt_step = {}, actor.opt.step

    def capture():  # the full gradients as the optimizer sees them
        grads.update({n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()})
        opt_step()

    actor.opt.step = capture
    g = torch.Generator().manual_seed(rank)
    N, T = 6, 5
    prompts = [torch.randint(1, 200, (3,), generator=g).tolist() for _ in range(N)]
    batch = make_batch(prompts, torch.randint(1, 200, (N, T), generator=g), torch.full((N,), T), 0)
    batch["old_logp"] = -torch.rand(N, T, generator=g) * 3
    batch["adv"] = torch.tensor(ADV[rank])[:, None].expand(N, T)
    loss = partial(loss_fn, args=Args(clip_low=0.2, clip_high=0.2, kl_coef=0.0, loss_agg="token"))
    sums, _ = actor.train_step(batch, loss, norm=N * T, skip_zero_adv_rows=skip)
    return grads, dist.reduce({f"rows{rank}": sums["rows"], f"rows{1 - rank}": 0}, group=actor.group)


skipped, rows_skip = step(True)
full, rows_full = step(False)
if rank == 0:
    save_file({f"skip.{k}": v for k, v in skipped.items()} | {f"full.{k}": v for k, v in full.items()}, out)
    with open(out + ".rows", "w") as f:
        json.dump({"skip": rows_skip, "full": rows_full}, f)
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
