"""Run under torchrun by tests/test_checkpoint.py: a checkpoint saved by an optimizer without
fused AdamW (as every checkpoint before it was) resumes into the actor's fused one, and the
actor keeps stepping fused; the restored state is the saved one."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from roles.actor import Actor  # noqa: E402
from utils import checkpoint, dist  # noqa: E402

model_dir, run_dir = sys.argv[1], sys.argv[2]
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
old = Actor(model_dir, plan.mesh, device, lr=1e-2, warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0)
for g in old.opt.param_groups:
    g["fused"] = None  # what a checkpoint from before fused AdamW holds
for p in old.model.parameters():
    p.grad = torch.ones_like(p)
old.opt.step()
path = checkpoint.save(run_dir, 1, old, keep=1, rank=rank)["path"]
new = Actor(model_dir, plan.mesh, device, lr=1e-2, warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0)
checkpoint.load(path, new, rank)
assert all(g["fused"] for g in new.opt.param_groups), [g["fused"] for g in new.opt.param_groups]
for p_old, p_new in zip(old.opt.state.values(), new.opt.state.values()):
    assert torch.equal(p_old["exp_avg"].full_tensor(), p_new["exp_avg"].full_tensor())
if rank == 0:
    open(os.path.join(run_dir, "ok"), "w").write("ok")
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
