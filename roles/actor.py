"""The policy under FSDP2: the update's mechanics around an editable loss, and full weights for
the engine."""
from functools import partial

import torch

from models import lora
from models.decoder import completion_logprobs
from models.hf import save_model
from models.lora import is_adapter, merged
from models.lora import scales as lora_scales
from models.moe import Routing
from models.packing import token_budget
from models.parallelize import load_sharded
from tasks.data import forward_batches, scatter_rows, take_rows
from utils.dist import full_tensors, reduce, weight_specs


def lr_factor(warmup_steps: int, decay_steps: int, step: int) -> float:
    """The learning rate's multiplier at optimizer step `step`: a linear warm-up over
    warmup_steps, times a linear decay to 0 at decay_steps (none when decay_steps is 0)."""
    factor = min(1.0, (step + 1) / max(1, warmup_steps))
    if decay_steps:
        factor *= max(0.0, 1 - step / decay_steps)
    return factor


def optimizer_step(model, opt, sched, max_grad_norm: float) -> tuple[torch.Tensor, bool]:
    """The end of every role's update: clip the gradients by their global norm, step the optimizer
    unless that norm is NaN/inf (the same on every rank: the norm is global), clear the gradients,
    step the LR schedule. -> (the norm, whether the optimizer stepped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return grad_norm, finite


class Actor:
    def __init__(self, path: str, mesh, device, lr: float, warmup_steps: int, weight_decay: float,
                 max_grad_norm: float, param_dtype=torch.float32, temperature: float = 1.0,
                 micro_batch_size: int = 64, decay_steps: int = 0, compile: bool = False, lora=None,
                 seed: int = 0, freeze_vision: bool = False, micro_batch_tokens: int = 0, moe=None):
        """temperature: the sampling temperature, applied to the trainer's log-probs too;
        micro_batch_size: completions per forward/backward; decay_steps: the learning rate decays
        linearly to 0 over this many optimizer steps (0: constant after the warm-up); compile:
        torch.compile each decoder block (models.parallelize.shard); lora: models.lora.LoraArgs (a rank
        above 0: only adapters train, started from `seed`; engines get the merged weights);
        freeze_vision: a Qwen2-VL's vision tower takes no gradient and has no optimizer state;
        micro_batch_tokens: micro-batches of at most this many tokens, packed without padding, a
        group's prompt once (tasks.data.forward_batches; 0: micro_batch_size rows, padded); moe:
        models.moe.MoeArgs, a MoE policy's routing replay, frozen routers, load-balancing loss and
        routing metrics (models.moe.Routing; nothing for a dense policy)."""
        self.model = load_sharded(path, mesh, device, param_dtype, compile=compile, lora=lora, seed=seed)
        self.freeze_vision = freeze_vision  # checkpoints record it: the tower is then not saved
        if freeze_vision:
            self.model.visual.requires_grad_(False)
        self.lora = lora if lora is not None and lora.lora_rank else None
        self.scales = lora_scales(self.model) if self.lora else {}
        self.routing = Routing(self.model, moe)  # before the optimizer: --freeze-router
        self.group = mesh.get_group()  # the trainers: checkpoints are collective over these only
        self.param_dtype = param_dtype
        self.config = self.model.config
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = token_budget(self.model, micro_batch_tokens, compile)
        # fused: one kernel for all parameters (the per-tensor loop cost 30 ms a step on the
        # 2.5M-param bench model, this 5)
        trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters only
        self.opt = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99), fused=True)
        schedule = partial(lr_factor, warmup_steps, decay_steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)

    def full_weights(self, exact: bool = False, base: bool = False):
        """(hf_name, full tensor) for the engine, gathered one FSDP2 block at a time in the
        training param dtype, each valid until the next is asked for (copy it); exact=True:
        tensor by tensor in the fp32 master dtype, tensors of their own (exports). With LoRA the
        engine's stream (exact=False) carries the merged weights, W + (alpha / r) B A, and no
        adapters; exact=True carries both as they are; base=True the base weights alone, unmerged
        (then `adapter_weights`: a disaggregated native engine merges them itself)."""
        if self.scales and base:
            return ((name, t) for name, t in full_tensors(self.model, exact) if not is_adapter(name))
        if self.scales and not exact:
            return merged(full_tensors(self.model, exact), self.scales)
        return full_tensors(self.model, exact)

    def adapter_weights(self):
        """LoRA: (name, full tensor) of each adapter in the training param dtype, gathered one
        tensor at a time (every trainer iterates in step)."""
        for name, p in self.model.named_parameters():
            if is_adapter(name):
                t = p.detach()
                yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t).to(self.param_dtype)

    def adapter_specs(self):
        """(name, full shape, dtype) in `adapter_weights` order."""
        return [(name, tuple(p.shape), self.param_dtype) for name, p in self.model.named_parameters()
                if is_adapter(name)]

    def weight_specs(self):
        """(hf_name, full shape, dtype) in `full_weights` order: what a remote engine must expect."""
        return [s for s in weight_specs(self.model, self.param_dtype) if not is_adapter(s[0])]

    @torch.no_grad()
    def logprobs(self, batch):
        """[N, T]: the current policy's log-probs of the completion tokens (the old policy's, when
        taken before the update: decoupled PPO's trainer-side old log-probs)."""
        parts = [(rows, completion_logprobs(self.model, mb, self.temperature, self.routing.replay))
                 for rows, mb in self.micro_batches(batch)]
        return scatter_rows(parts, *batch["loss_mask"].shape)  # [N, T]

    def train_step(self, batch, loss_fn, norm: float, skip_zero_adv_rows: bool = False):
        """One optimizer step on this rank's share of a (mini)batch (tasks.data.Batch).

        For each micro-batch: the trainer's log-probs of the completion tokens, logp [n, T], then
        `loss, sums = loss_fn(logp, micro_batch, norm)` and its backward. Gradients are reduced
        over the trainers after the last micro-batch only and clipped by global norm; a step
        whose gradient norm is not finite is skipped (the optimizer does not step).

        skip_zero_adv_rows: do not run rows whose advantage is 0 at every token (e.g. groups whose
        rewards are all equal). It is exact only while every term of the loss is proportional to
        the advantage, as the clipped surrogate alone is: such rows then add exactly nothing to
        the loss or its gradient. A KL or entropy term breaks that: pass False with one.

        A minibatch with nothing in the loss on any rank (norm 0: every reward failed) is not run,
        and the optimizer does not step (`unscored`).

        Returns this rank's metric sums (loss_fn's, plus rows, trained_tokens and gap_sum, the
        trainer-vs-engine log-prob gap) and maxima (gap_max, grad_norm, skipped, unscored), as
        tensors: the caller reduces them over ranks at log time."""
        if norm == 0:  # the same on every rank (reduced): no collective is left unpaired
            self.sched.step()
            nothing = torch.zeros(())
            return {"gap_sum": 0.0, "rows": 0, "trained_tokens": 0.0}, {
                "gap_max": nothing, "grad_norm": nothing, "skipped": 0.0, "unscored": 1.0}
        if skip_zero_adv_rows:
            batch = self.rows_to_train(batch)
        sums = {"gap_sum": 0.0, "rows": len(batch["adv"]), "trained_tokens": batch["loss_mask"].sum()}
        gap_max = torch.zeros((), device=batch["loss_mask"].device)
        if self.routing.replay and len(batch["adv"]) and "routes" not in batch:
            raise RuntimeError("--routing-replay: the samples carry no experts (their engine did not record "
                               "them)")
        mbs = [mb for _, mb in self.micro_batches(batch)]
        self.routing.start()
        for i, mb in enumerate(mbs):
            # reduce-scatter the gradients after the last micro-batch only: no traffic for the others
            self.model.set_requires_gradient_sync(i == len(mbs) - 1)
            logp = completion_logprobs(self.model, mb, self.temperature, self.routing.replay)  # [n, T]
            loss, loss_sums = loss_fn(logp, mb, norm)
            (loss + self.routing.aux_loss() / len(mbs)).backward()  # a MoE policy's --router-aux-coef
            for k, v in loss_sums.items():
                sums[k] = sums.get(k, 0.0) + v
            # the trainer's and the engine's log-prob of the same tokens (the engine's are the
            # old ones, unless the trainer recomputed those: then they are kept apart)
            engine_logp = mb.get("engine_logp", mb["old_logp"])  # [n, T]
            gap = (logp.detach() - engine_logp).abs() * mb["loss_mask"]  # [n, T]
            sums["gap_sum"] += gap.sum()
            gap_max = torch.maximum(gap_max, gap.max())
        grad_norm, finite = optimizer_step(self.model, self.opt, self.sched, self.max_grad_norm)
        maxes = {"gap_max": gap_max, "grad_norm": grad_norm, "skipped": float(not finite), "unscored": 0.0}
        return {**sums, **self.routing.sums()}, maxes

    def micro_batches(self, batch):
        """(rows, micro-batch) of a batch (tasks.data.forward_batches), as many on every trainer."""
        return forward_batches(batch, self.micro_batch_size, self.micro_batch_tokens, self.group)

    def rows_to_train(self, batch):
        """The rows with a nonzero advantage first (in order), then zero-advantage rows, K rows
        in all, K = the most nonzero rows on any trainer rank (at least 1): every rank then runs
        the same number of micro-batches, so FSDP's collectives pair up."""
        nonzero = (batch["adv"] != 0).any(-1)  # [N]
        most = reduce({"rows": nonzero.sum()}, op=torch.distributed.ReduceOp.MAX, group=self.group)["rows"]
        K = max(1, int(most))
        order = torch.argsort((~nonzero).to(torch.uint8), stable=True)  # nonzero rows first
        return take_rows(batch, order[:K])  # K rows


def export_hf(actor, path: str, rank: int, tokenizer_dir: str):
    """A HF checkpoint of the policy (safetensors, config, tokenizer): every rank joins the
    per-tensor gathers, rank 0 writes."""

    if actor.lora:  # a PEFT adapter directory, or the merged model (--merge-on-export)

        return lora.export(actor, path, rank, tokenizer_dir, actor.lora, tokenizer_dir)
    weights = [(name, t.cpu()) for name, t in actor.full_weights(exact=True)]
    if rank == 0:
        save_model(weights, actor.config, path, tokenizer_dir=tokenizer_dir)
