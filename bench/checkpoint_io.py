"""Checkpoint save and load seconds (DCP, sharded over the ranks) for the default tiny model
and a ~100M-parameter random one, and the overhead of saving every k steps.

    torchrun --standalone --nproc-per-node 2 bench/checkpoint_io.py
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import placement  # noqa: E402
from assets.make import random_checkpoint
from roles.actor import Actor  # noqa: E402
from tasks.data import make_batch
from train_grpo import Args, loss_fn  # noqa: E402
from utils import checkpoint, dist  # noqa: E402

rank, world, device = dist.init(timeout_s=600)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
work = tempfile.mkdtemp() if rank == 0 else None
holder = [work]
torch.distributed.broadcast_object_list(holder)
work = holder[0]
big = os.path.join(work, "rand-100m")
if rank == 0:
    random_checkpoint(big, vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, head_dim=64)
torch.distributed.barrier()
rows = []
for name, path in (("arith-tiny (default)", "assets/arith-tiny"), ("random ~100M", big)):
    actor = Actor(path, plan.mesh, device, lr=1e-5, warmup_steps=1, weight_decay=0.0, max_grad_norm=1.0)
    b = make_batch([[1, 2, 3]] * 4, torch.ones(4, 4, dtype=torch.long), torch.full((4,), 4), 0)
    b.update(old_logp=torch.zeros(4, 4), adv=torch.ones(4, 4))
    actor.train_step(b, partial(loss_fn, args=Args()), norm=16.0)  # the optimizer has its state now
    run = os.path.join(work, name.split()[0])
    saves, loads = [], []
    for i in range(3):
        saves.append(checkpoint.save(run, i + 1, actor, keep=1, rank=rank)["seconds"])
        torch.distributed.barrier()
        t = time.perf_counter()
        checkpoint.load(checkpoint.find(run)[0], actor, rank)
        loads.append(time.perf_counter() - t)
    size = sum(os.path.getsize(os.path.join(dp, f))
               for dp, _, fs in os.walk(checkpoint.find(run)[0]) for f in fs)
    rows.append((name, actor.config.num_params() / 1e6, size / 2**20, statistics.median(saves),
                 statistics.median(loads)))
    del actor
if rank == 0:
    print(f"\n{world} ranks, CPU, gloo; median of 3\n")
    print(f"| {'model':<22} | {'params M':>8} | {'size MiB':>8} | {'save s':>6} | {'load s':>6} |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 8}|")
    for r in rows:
        print(f"| {r[0]:<22} | {r[1]:8.1f} | {r[2]:8.1f} | {r[3]:6.2f} | {r[4]:6.2f} |")
    tiny_save = rows[0][3]
    # the default run's step: 800 in ~230 s, see docs/tiny-model.md
    step_s = float(os.environ.get("STEP_S", "0.28"))
    for k in (10, 50):
        print(f"default run, --save-every {k}: {tiny_save / (k * step_s):.2%} of step time "
              f"(save {tiny_save:.2f}s / ({k} x {step_s}s per step))")
    shutil.rmtree(work, ignore_errors=True)
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
