"""Run under torchrun by tests/test_distill.py: one GRPO step of on-policy distillation alone on a
fixed global batch (each rank its rows): the teacher's log-probs of the sampled tokens, the
per-token advantage coef (log teacher - log student) through train_grpo.advantages, one optimizer
step. Rank 0 writes the student's weights after it to OUT, and to OUT.txt whether the teacher's
weights are unchanged with no gradient, whether a teacher that is the student's own checkpoint
gives a term of exactly 0, and whether the teacher, released as on a GPU, frees its shards between
uses and scores the same after."""
import os
import sys
from functools import partial
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from roles.actor import Actor  # noqa: E402
from roles.reward import RewardArgs  # noqa: E402
from roles.teacher import DistillArgs, Teacher  # noqa: E402
from tasks.data import make_batch, rank_slice
from train_grpo import Args, advantages, loss_fn  # noqa: E402
from utils import dist  # noqa: E402
from utils.logger import Timer  # noqa: E402

student, teacher_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
actor = Actor(student, plan.mesh, device, lr=1e-2, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0,
              micro_batch_size=2)
args = Args(num_generations=1, kl_coef=0.0, distill=DistillArgs(teacher_dir, distill_coef=0.5),
            reward=RewardArgs(reward_weights=(0.0,)))
teacher = Teacher(args.distill, plan, device, torch.float32, 1.0, micro_batch=2, releases=True)  # as on a GPU
own = Teacher(DistillArgs(student), plan, device, torch.float32, 1.0, micro_batch=2)
before = {k: v.clone() for k, v in dist.full_tensors(teacher.model.model, exact=True)}

g = torch.Generator().manual_seed(0)
N, T = 8, 5
prompts = [torch.randint(1, 200, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
           for _ in range(N)]
lengths = torch.randint(1, T + 1, (N,), generator=g)  # mixed lengths: the mask must hold
batch = make_batch(prompts, torch.randint(1, 200, (N, T), generator=g), lengths, 0)
rows = rank_slice(list(range(N)), rank, world)
mine = {k: (v[rows[0]:rows[-1] + 1] if torch.is_tensor(v) else v) for k, v in batch.items()}
mine["old_logp"] = actor.logprobs(mine)  # the student's own log-probs of its "samples"
n = len(rows)
got = SimpleNamespace(rewards=torch.zeros(n), scored=torch.ones(n, dtype=torch.bool))
own.score(mine, Timer())
zero = torch.equal(own.model.logprobs(mine), mine["old_logp"])  # the same weights, the same ops
teacher.score(mine, Timer())
released = sum(s.nbytes() for s in teacher.model.shards) == 0  # between uses: no device memory
again = dict(mine)
teacher.score(again, Timer())  # back from the host copy: the same weights, the same ops
released = released and torch.equal(again["teacher_logp"], mine["teacher_logp"])
mine["adv"] = advantages(got, mine, args, plan)  # [n, T]: the distillation term alone
actor.train_step(mine, partial(loss_fn, args=args), float(batch["loss_mask"].sum()) / world)
after = {k: v.clone() for k, v in actor.full_weights()}
teacher.model.load()  # to read its weights
frozen = all(p.grad is None and not p.requires_grad for p in teacher.model.model.parameters())
frozen = frozen and all(torch.equal(v, before[k]) for k, v in dist.full_tensors(teacher.model.model, True))
if rank == 0:
    save_file(after, out)
    with open(out + ".txt", "w") as f:
        f.write(f"{frozen} {zero} {float(mine['adv'].abs().sum()) > 0} {released}")
dist.exit_now(0)
