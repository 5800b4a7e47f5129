"""The flow-matching policy of train_flow_grpo.py under FSDP2: each DiT block sharded, then the root
(torchtitan's order, as utils/dist.py shards the language model), AdamW over the fp32 master shards,
the velocity field for the sampler, and the update's mechanics around an editable loss. With
`frozen` it is the reference policy of the KL term (no optimizer).

Every trainer rank samples its own prompts through this same sharded model (no separate engine and
no weight sync: the model is the sampler), so the ranks must call it the same number of times: each
rank's share of a step is the same size, and so is each micro-batch count.
"""
from functools import partial

import torch

from models.flow_dit import load_flow, save_flow
from roles.actor import lr_factor, optimizer_step


class FlowActor:
    def __init__(self, path: str, mesh, device, lr: float = 0.0, warmup_steps: int = 1,
                 weight_decay: float = 0.0, max_grad_norm: float = 1.0, micro_batch_size: int = 32,
                 frozen: bool = False):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.model, self.config = load_flow(path, device)
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)
        self.group = mesh.get_group()  # the trainers: checkpoints are collective over these
        self.lora = None  # (utils/checkpoint.py asks)
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        if frozen:
            self.model.requires_grad_(False)
            return
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay,
                                     betas=(0.9, 0.999), fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, partial(lr_factor, warmup_steps, 0))

    @torch.no_grad()
    def velocity(self, x, t, cond, chunks=None):
        """v [B, C, H, W] at images x [B, C, H, W], times t [B], conditions cond [B, 3], one forward
        per (lo, hi) of `chunks` (default: --micro-batch-size rows each). The sampler and the
        reference pass the training pieces' rows, so that the recomputed log-probs go through the
        same kernels as the rollout's (on a GPU, cuBLAS picks its algorithm by shape)."""
        n = self.micro_batch_size
        chunks = chunks or [(i, min(i + n, len(x))) for i in range(0, len(x), n)]
        return torch.cat([self.model(x[lo:hi], t[lo:hi], cond[lo:hi]) for lo, hi in chunks])

    def train_step(self, pieces: list, loss_fn) -> dict:
        """One optimizer step over this rank's `pieces` (a micro-batch of rows at one trained
        denoising step; every rank has as many): `loss_fn(piece)` returns (loss, its metric sums),
        each piece's backward on its own (one step's graph at a time, as flow_grpo accumulates over
        timesteps), the gradients reduced over the trainers after the last one only, clipped by
        global norm; a step whose norm is not finite is skipped. -> the sums, grad_norm, skipped."""
        sums = {}
        for i, piece in enumerate(pieces):
            self.model.set_requires_gradient_sync(i == len(pieces) - 1)
            loss, parts = loss_fn(piece)
            loss.backward()
            for k, v in parts.items():  # a "_max" metric is a maximum, the rest sums
                sums[k] = max(sums.get(k, 0.0), v) if k.endswith("_max") else sums.get(k, 0.0) + v
        grad_norm, finite = optimizer_step(self.model, self.opt, self.sched, self.max_grad_norm)
        return {**sums, "grad_norm": float(grad_norm), "skipped": float(not finite)}

    def full_weights(self):
        """(name, full tensor) of every parameter, gathered one at a time (every rank in step)."""
        for name, p in self.model.named_parameters():
            t = p.detach()
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)

    def export(self, path: str, rank: int):
        """The policy as a loadable flow checkpoint (models/flow_dit.py `load_flow`): every rank
        gathers, rank 0 writes."""
        weights = {name: t.cpu().contiguous() for name, t in self.full_weights()}
        if rank == 0:
            save_flow(weights, self.config, path)
