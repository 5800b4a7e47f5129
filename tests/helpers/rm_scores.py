"""Run under torchrun by tests/test_reward_model.py: the reward-model role, sharded over the
ranks, scores its rows of a saved batch (each rank its own share, one row per micro-batch, each
cut to its own columns: tasks.data.forward_batches) and writes them to out.rank<r>.pt. argv:
checkpoint, policy checkpoint (for reward_model.check), batch.pt (input_ids, valid, prompt_len), out."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import placement  # noqa: E402
from roles import reward_model  # noqa: E402
from tasks.data import rank_slice, take_rows
from utils import dist  # noqa: E402

path, policy, batch_file, out = sys.argv[1:5]
reward_model.check(path, policy)
rank, world, device = dist.init(timeout_s=60)
plan = placement.plan("colocate", rank, world, device, prompts_per_step=world)
rm = reward_model.RewardModel(path, plan.mesh, device, micro_batch_size=1)
batch = torch.load(batch_file)
rows = rank_slice(list(range(len(batch["input_ids"]))), rank, world)
torch.save(rm.score(take_rows(batch, slice(rows[0], rows[-1] + 1))), f"{out}.rank{rank}.pt")
dist.exit_now(0)
