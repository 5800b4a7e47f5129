"""Run under torchrun by tests/test_critic.py: each rank whitens its rows of a saved batch with
the moments summed over all ranks (as PPO whitens its advantages) and saves them to out.<rank>."""
import os
import sys

import torch
import torch.distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from rl import algos
from tasks.data import rank_slice
from utils import dist

batch_file, out = sys.argv[1], sys.argv[2]
rank, world, device = dist.init(timeout_s=60)
full = torch.load(batch_file)
rows = rank_slice(list(range(len(full["x"]))), rank, world)
x, mask = full["x"][rows[0]:rows[-1] + 1], full["mask"][rows[0]:rows[-1] + 1]  # [n, T]
moments = torch.stack(algos.masked_moments(x, mask))  # [3] float64: sum, sum of squares, count
torch.distributed.all_reduce(moments)  # the default group: every rank
torch.save(algos.whiten(x, mask, *moments), f"{out}.{rank}")
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
