"""The policy under FSDP2: log-probs, the clipped-surrogate update, full weights for the engine."""
import torch

from utils import algos
from utils.data import micro_batches, take_rows
from utils.dist import full_tensors, load_sharded, reduce, weight_specs
from utils.model import completion_logprobs


class Actor:
    def __init__(self, path: str, mesh, device, lr: float, warmup_steps: int, weight_decay: float,
                 max_grad_norm: float, param_dtype=torch.float32):
        self.model = load_sharded(path, mesh, device, param_dtype)
        self.group = mesh.get_group()  # the trainers: checkpoints are collective over these only
        self.param_dtype = param_dtype
        self.config = self.model.config
        self.max_grad_norm = max_grad_norm
        # fused: one kernel for all parameters (the per-tensor loop cost 30 ms a step on the 2.5M-param bench model, this 5)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99),
                                     fused=True)
        # linear warm-up to lr over warmup_steps optimizer steps, then constant
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))

    def full_weights(self, exact: bool = False):
        """(hf_name, full tensor) for the engine, gathered one FSDP2 block at a time in the
        training param dtype, each valid until the next is asked for (copy it); exact=True:
        tensor by tensor in the fp32 master dtype, tensors of their own (exports)."""
        return full_tensors(self.model, exact)

    def weight_specs(self):
        """(hf_name, full shape, dtype) in `full_weights` order: what a remote engine must expect."""
        return weight_specs(self.model, self.param_dtype)

    def train_step(self, batch, *, temperature, clip_low, clip_high, kl_coef, kl_estimator, loss_agg, norm,
                   micro_batch_size):
        """One optimizer step on this rank's share of a (mini)batch: batch['adv'] [N],
        batch['behaviour'] [N, T] the engine's log-probs (the importance ratio's denominator),
        batch['ref'] [N, T] when kl_coef > 0; `norm` is the per-rank normaliser of
        `algos.aggregate`. Returns this rank's metric sums and maxima (tensors; the caller
        reduces them over ranks at log time).

        Without a KL term, rows whose advantage is exactly 0 (e.g. groups whose rewards are all
        equal) add exactly nothing to the loss or its gradient, so they are not run: see
        `rows_to_train`. The optimizer still steps, as it would on their zero gradient."""
        if kl_coef == 0:
            batch = self.rows_to_train(batch)
        sums = {"pg_loss": 0.0, "kl": 0.0, "clipped_tokens": 0.0, "gap_sum": 0.0, "rows": len(batch["adv"]),
                "tokens": batch["mask"].sum()}
        gap_max = torch.zeros((), device=batch["mask"].device)
        mbs = list(micro_batches(batch, micro_batch_size))
        for i, mb in enumerate(mbs):
            # reduce-scatter the gradients after the last micro-batch only: no traffic for the others
            self.model.set_requires_gradient_sync(i == len(mbs) - 1)
            logp = completion_logprobs(self.model, mb, temperature)  # [n, T]
            mask, old = mb["mask"], mb["behaviour"]  # [n, T]
            pg, clipped = algos.clipped_surrogate(logp, old, mb["adv"], clip_low, clip_high)  # [n, T]
            loss = algos.aggregate(pg, mask, loss_agg, norm)
            if kl_coef > 0:
                kl = algos.kl_estimate(logp, mb["ref"], kl_estimator)  # [n, T]
                loss = loss + kl_coef * algos.aggregate(kl, mask, loss_agg, norm)
                sums["kl"] += (kl.detach() * mask).sum()
            loss.backward()
            gap = (logp.detach() - old).abs() * mask  # trainer vs engine log-prob of the same tokens
            sums["pg_loss"] += (pg.detach() * mask).sum()
            sums["clipped_tokens"] += (clipped & (mask > 0)).sum()
            sums["gap_sum"] += gap.sum()
            gap_max = torch.maximum(gap_max, gap.max())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        finite = bool(torch.isfinite(grad_norm))  # the same on every rank: the norm is global
        if finite:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return sums, {"gap_max": gap_max, "grad_norm": grad_norm, "skipped": float(not finite)}

    def rows_to_train(self, batch):
        """The rows with a nonzero advantage first (in order), then zero-advantage rows, K rows
        in all, K = the most nonzero rows on any trainer rank (at least 1): every rank then runs
        the same number of micro-batches, so FSDP's collectives pair up."""
        adv = batch["adv"]  # [N]
        most = reduce({"rows": (adv != 0).sum()}, op=torch.distributed.ReduceOp.MAX, group=self.group)["rows"]
        K = max(1, int(most))
        return take_rows(batch, torch.argsort((adv == 0).to(torch.uint8), stable=True)[:K])  # K rows
