"""Run under torchrun by tests/test_critic.py: `steps` critic train steps on a fixed global batch
(each rank takes its rows). old: "rollout" keeps the values of the first rollout as every step's
old values (PPO's epochs over one batch), "refresh" takes the critic's current values before each
step (a new rollout of the same batch). Rank 0 writes the gathered full weights after each step
(out.step<k>), the gradients each step's optimizer took (out.grads<k>), and the metrics summed
over ranks, with the same sums computed outside train_step from the values before the step
(out.json)."""
import json
import os
import sys

import torch
import torch.distributed
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from rl import algos
from roles.critic import Critic  # noqa: E402
from tasks.data import make_batch, rank_slice, take_rows
from tests.helpers.runs import record_grads  # noqa: E402
from utils import dist

model_dir, out, steps, micro, old = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
lr = float(sys.argv[6]) if len(sys.argv) > 6 else 1e-2
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
critic = Critic(model_dir, plan.mesh, device, lr=lr, warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0,
                value_clip=0.2, micro_batch_size=micro)
grads = record_grads(critic.model, critic.opt)

g = torch.Generator().manual_seed(0)
N, T = 8, 5
prompts = [torch.randint(1, 200, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
           for _ in range(N)]
tokens = torch.randint(1, 200, (N, T), generator=g)
lengths = torch.randint(1, T + 1, (N,), generator=g)
batch = make_batch(prompts, tokens, lengths, 0)
returns = torch.randn(N, T, generator=g) * batch["loss_mask"]  # [N, T]
norm = batch["loss_mask"].sum().item() / world
rows = rank_slice(list(range(N)), rank, world)
mine = take_rows(batch, slice(rows[0], rows[-1] + 1))
mine["returns"] = returns[rows[0]:rows[-1] + 1]


def over_ranks(x, op=torch.distributed.ReduceOp.SUM) -> float:
    """x (a scalar) reduced over every rank, in float64."""
    x = torch.as_tensor(x, dtype=torch.float64).clone()
    torch.distributed.all_reduce(x, op=op)
    return x.item()


def most(x) -> float:
    return over_ranks(x, torch.distributed.ReduceOp.MAX)


rollout_values = critic.values(mine)  # [n, T]
log = {"first_values_abs_max": most(rollout_values.abs().max()),
       "tokens": over_ranks(mine["loss_mask"].sum()), "steps": []}
previous = None
for k in range(steps):
    now = critic.values(mine)  # [n, T]: what train_step's forward will see
    mine["values"] = rollout_values if old == "rollout" else now
    loss, clipped = algos.clipped_value_loss(now, mine["values"], mine["returns"], 0.2)  # [n, T]
    mask = mine["loss_mask"]
    sums, maxima = critic.train_step(mine, norm)
    log["steps"].append({
        "value_loss": over_ranks(sums["value_loss"]), "value_clipped": over_ranks(sums["value_clipped"]),
        "want_loss": over_ranks((loss * mask).sum()),
        "want_clipped": over_ranks((clipped & (mask > 0)).sum()),
        "grad_norm": maxima["value_grad_norm"].item(),
        "values_moved": most((now - previous).abs().max()) if previous is not None else None})
    previous = now
    weights = {name: t.clone() for name, t in dist.full_tensors(critic.model, exact=True)}
    if rank == 0:
        save_file(weights, f"{out}.step{k}")
        save_file(grads[k], f"{out}.grads{k}")
if rank == 0:
    with open(out + ".json", "w") as f:
        json.dump(log, f)
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
