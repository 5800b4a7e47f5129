"""Run under torchrun by tests/test_fsdp.py: one FSDP2 train step on a fixed global batch
(each rank takes its rows), then rank 0 writes the gathered full weights (out) and the gradients
the optimizer stepped with (out.grads)."""
import os
import sys
from functools import partial

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from models.hf import load_model
from roles.actor import Actor  # noqa: E402
from tasks.data import forward_batches, make_batch, rank_slice
from tests.helpers.runs import record_grads  # noqa: E402
from train_grpo import Args, loss_fn  # noqa: E402
from utils import dist  # noqa: E402

model_dir, out, loss_agg = sys.argv[1], sys.argv[2], sys.argv[3]
# rows per micro-batch, or tN: micro-batches of at most N tokens, packed (models/packing.py)
micro, budget = (256, int(sys.argv[4][1:])) if sys.argv[4].startswith("t") else (int(sys.argv[4]), 0)
compiled = sys.argv[5:] == ["compile"]  # each decoder block under torch.compile
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
actor = Actor(model_dir, plan.mesh, device, lr=1e-2, warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0,
              temperature=0.9, micro_batch_size=micro, compile=compiled, micro_batch_tokens=budget)

# the gathered weights equal the checkpoint's, exactly
full = {k: v.clone() for k, v in actor.full_weights()}  # each is valid until the next: copy
ref = load_model(model_dir).state_dict()
ok = all(torch.equal(full[k], ref[k]) for k in full) and set(full) | {"lm_head.weight"} >= set(ref)
ok = ok and all(torch.equal(t, ref[k]) for k, t in actor.full_weights(exact=True))  # the export path too
grads = record_grads(actor.model, actor.opt)

g = torch.Generator().manual_seed(0)
N, T = 8, 5
prompts = [torch.randint(1, 200, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
           for _ in range(N // 2)]
prompts = [p for p in prompts for _ in range(2)]  # groups of 2 samples
tokens = torch.randint(1, 200, (N, T), generator=g)
lengths = torch.randint(1, T + 1, (N,), generator=g)
batch = make_batch(prompts, tokens, lengths, 0)
batch["old_logp"] = -torch.rand(N, T, generator=g) * 3
adv = torch.randn(N, generator=g)
norm = (batch["loss_mask"].sum().item() if loss_agg == "token" else N) / world
rows = rank_slice(list(range(N)), rank, world)
batch["adv"] = adv[:, None].expand(N, T)
mine = {k: (v[rows[0]:rows[-1] + 1] if torch.is_tensor(v) else v) for k, v in batch.items()}
loss = partial(loss_fn, args=Args(clip_low=0.2, clip_high=0.2, kl_coef=0.0, loss_agg=loss_agg))
actor.train_step(mine, loss, norm)
runs = len(list(actor.micro_batches(mine)))  # after the split to the busiest rank's count
planned = [None] * world  # each rank's own plan of packed micro-batches, before that split
mine_planned = len(list(forward_batches(mine, micro, budget))) if budget else 0
torch.distributed.all_gather_object(planned, mine_planned)
after = {k: v.clone() for k, v in actor.full_weights()}
if rank == 0:
    save_file(after, out)
    save_file(grads[0], out + ".grads")
    with open(out + ".gather_ok", "w") as f:
        f.write(str(ok))
    with open(out + ".micro", "w") as f:
        f.write(f"{planned} {runs}")
    if compiled:  # the graphs dynamo made: the compiled path really ran
        from torch._dynamo.utils import counters

        with open(out + ".graphs", "w") as f:
            f.write(str(counters["stats"]["unique_graphs"]))
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
