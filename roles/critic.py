"""The critic: a value model (our decoder with a one-score head, HF's ...ForSequenceClassification)
under FSDP2 like the actor, trained on GAE's returns with PPO's clipped value loss. It starts
from the policy's checkpoint (a zero head: every value 0) or a reward model's. Its weights
never go to an engine."""
from functools import partial

import torch

from models.decoder import completion_values
from models.packing import token_budget
from models.parallelize import load_sharded
from rl import algos
from roles.actor import lr_factor, optimizer_step
from tasks.data import forward_batches, scatter_rows


class Critic:
    def __init__(self, path: str, mesh, device, lr: float, warmup_steps: int, weight_decay: float,
                 max_grad_norm: float, value_clip: float, param_dtype=torch.float32,
                 micro_batch_size: int = 64, decay_steps: int = 0, compile: bool = False,
                 micro_batch_tokens: int = 0):
        """value_clip: a value moves at most this far from the one it had at rollout per update
        (the clipped value loss); the rest as the Actor's."""
        self.model = load_sharded(path, mesh, device, param_dtype, value_head=True, compile=compile)
        self.group = mesh.get_group()  # the trainers: checkpoints are collective over these only
        self.config = self.model.config
        self.max_grad_norm = max_grad_norm
        self.value_clip = value_clip
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = token_budget(self.model, micro_batch_tokens, compile)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay,
                                     betas=(0.9, 0.99), fused=True)
        schedule = partial(lr_factor, warmup_steps, decay_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)

    @torch.no_grad()
    def values(self, batch):
        """V [N, T]: the value of the state before each completion token (tasks.data.Batch)."""
        parts = [(rows, completion_values(self.model, mb))
                 for rows, mb in self.micro_batches(batch)]
        return scatter_rows(parts, *batch["loss_mask"].shape)  # [N, T]

    def micro_batches(self, batch):
        """(rows, micro-batch) of a batch (tasks.data.forward_batches), as many on every trainer."""
        return forward_batches(batch, self.micro_batch_size, self.micro_batch_tokens, self.group)

    def train_step(self, batch, norm: float):
        """One optimizer step on this rank's share of a (mini)batch that holds `values` (the
        critic's at rollout) and `returns` [N, T]: the clipped value loss summed over the loss
        mask's tokens and divided by `norm` (the minibatch's tokens over all trainers / trainers,
        so that FSDP's gradient average is the mean over the whole minibatch). Gradients are
        reduced after the last micro-batch, clipped by global norm; a non-finite norm skips the
        step; norm 0 (no token in the loss anywhere) takes no step. Returns this rank's metric
        sums (value_loss, value_clipped) and maxima (value_grad_norm) as tensors."""
        sums = {"value_loss": 0.0, "value_clipped": 0.0}
        if norm == 0:  # nothing in the loss on any rank (reduced, so the same everywhere): no step
            self.sched.step()
            return sums, {"value_grad_norm": torch.zeros(())}
        mbs = [mb for _, mb in self.micro_batches(batch)]
        for i, mb in enumerate(mbs):
            self.model.set_requires_gradient_sync(i == len(mbs) - 1)
            v = completion_values(self.model, mb)  # [n, T]
            # [n, T]
            loss, clipped = algos.clipped_value_loss(v, mb["values"], mb["returns"], self.value_clip)
            mask = mb["loss_mask"]  # [n, T]
            algos.aggregate(loss, mask, "token", norm).backward()
            sums["value_loss"] += (loss.detach() * mask).sum()
            sums["value_clipped"] += (clipped & (mask > 0)).sum()
        grad_norm, _ = optimizer_step(self.model, self.opt, self.sched, self.max_grad_norm)
        return sums, {"value_grad_norm": grad_norm}
