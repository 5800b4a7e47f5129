"""PPO with a critic, GAE and the KL in the reward, on FSDP2 with parallel controllers.

    torchrun --standalone --nproc-per-node 2 train_ppo.py          # the built-in task, offline
    torchrun --standalone --nproc-per-node 2 train_ppo.py --rewards rm --reward-model runs/rm
                                                 # a Bradley-Terry reward model (train_rm.py makes one)
    torchrun --standalone --nproc-per-node 3 train_ppo.py --placement disaggregate --rollout-ranks 1

The RLHF recipe of Ziegler et al. 2019 and Ouyang et al. 2022 (InstructGPT): each completion's
score goes on its last token, minus kl_coef times a per-token KL to the reference policy at every
token; a critic (the decoder with a value head) estimates each state's value; GAE turns rewards
and values into per-token advantages, whitened over the whole batch; the actor takes PPO's clipped
surrogate step and the critic the clipped value loss step.

As in train_grpo.py, every rank is the controller of its own share of each step's prompts: it
generates, scores, computes values and advantages itself; only FSDP2's collectives, the weight
sync, the whitening's moments and the metric reductions are collective. With --placement
disaggregate the rollout ranks run `roles.rollout.serve` and each trainer holds the actor, critic,
reference and reward model shards.

The actor's loss is `loss_fn` below, the critic's in roles/critic.py; the step loop is at the bottom.
"""
import math
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar, Literal

import torch

import memory
import placement
import rollouts
import flags
import run
from engines.agents import AgentArgs
from engines.episodes import EnvArgs
from models.hf import checked_model, read_config
from models.lora import LoraArgs
from models.moe import MoeArgs
from models.tokenizer import check_same_tokenizer
from placement import PlacementArgs
from rl import algos
from roles.critic import Critic
from roles.reward import RewardArgs, Scorer
from roles.teacher import DistillArgs
from flags import ComputeArgs, DataArgs, Flat, RunArgs, SamplingArgs
from tasks.data import make_batch, per_sample
from utils import dist
from utils.errors import UserError, check_rules
from utils.logger import Timer


@dataclass
class Args:
    steps: int = 600
    """optimizer steps (one rollout batch each)"""
    prompts_per_step: int = 256
    """prompts per step over all trainer ranks (each takes prompts_per_step / trainers)"""
    num_generations: int = 1
    """completions per prompt (PPO needs no group: the critic is the baseline)"""
    data: Flat[DataArgs] = field(default_factory=DataArgs)
    sampling: Flat[SamplingArgs] = field(default_factory=SamplingArgs)
    env: Flat[EnvArgs] = field(default_factory=EnvArgs)
    agent: Flat[AgentArgs] = field(default_factory=AgentArgs)
    reward: Flat[RewardArgs] = field(default_factory=RewardArgs)
    gamma: float = 1.0
    """GAE's discount (1: the score at the end counts fully at every token)"""
    lam: float = 0.95
    """GAE's lambda: 1 = Monte-Carlo returns (no bias, most variance), 0 = one-step TD"""
    whiten_advantages: bool = True
    """whiten the advantages over the whole batch (all trainer ranks)"""
    kl_coef: float = 0.01
    """per-token KL penalty to the reference policy in the reward (0: no reference model is built)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """--kl-coef > 0: the per-token KL estimator in the reward (Schulman 2020); k1 = log(pi / ref), as in
    InstructGPT"""
    kl_target: float | None = None
    """adaptive KL controller (Ziegler et al. 2019): move kl_coef so that the mean KL per completion
    (summed over tokens) approaches this (none: a fixed kl_coef)"""
    kl_horizon: int = 10000
    """--kl-target: the adaptive KL controller's horizon, completions over which its error is corrected"""
    distill: Flat[DistillArgs] = field(default_factory=DistillArgs)
    lr: float = 3e-4
    """the actor's AdamW learning rate (after warm-up)"""
    critic_lr: float = 1e-3
    """the critic's AdamW learning rate (after warm-up)"""
    warmup_steps: int = 3
    """linear learning-rate warm-up (actor and critic)"""
    lr_schedule: Literal["linear", "constant"] = "linear"
    """after the warm-up, linear: decay to 0 at the last step; constant: stay at the rate (both models)"""
    weight_decay: float = 0.0
    """AdamW weight decay (actor and critic)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (each model on its own)"""
    clip_low: float = 0.2
    """PPO ratio clip below: 1 - clip_low"""
    clip_high: float = 0.2
    """PPO ratio clip above: 1 + clip_high"""
    value_clip: float = 0.2
    """the clipped value loss: a value moves at most this far from its rollout value per step"""
    critic_model: str | None = None
    """the critic's start: a causal checkpoint (its decoder, a zero value head) or a reward model's
    (its head too); default: --model"""
    loss_agg: Literal["token", "sequence"] = "token"
    """the actor's loss, token: every token weighs the same; sequence: mean per completion first"""
    minibatches: int = 1
    """optimizer steps per rollout batch for actor and critic (>1: later ones are off-policy)"""
    micro_batch_size: int = 256
    """completions per forward/backward on each rank (lower it for a large model's memory)"""
    micro_batch_tokens: int = 2048
    """>0: micro-batches of at most this many tokens (and --micro-batch-size rows), each packed into
    one sequence without padding and with each group's prompt once, exact to fp32 rounding
    (models/packing.py; docs/packing.md); 0: rows, padded. A Qwen2-VL model and --compile run rows"""
    compute: Flat[ComputeArgs] = field(default_factory=ComputeArgs)
    lora: Flat[LoraArgs] = field(default_factory=LoraArgs)
    moe: Flat[MoeArgs] = field(default_factory=MoeArgs)
    placement: Flat[PlacementArgs] = field(default_factory=PlacementArgs)
    run_args: Flat[RunArgs] = field(default_factory=lambda: RunArgs(run_dir="runs/ppo"))
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "kl_estimator": ("kl_coef", lambda c: c > 0, "a --kl-coef above 0"),
        "kl_horizon": ("kl_target", lambda t: t is not None, "a --kl-target")}


def check_args(args: Args, world: int):
    """Every flag's range and the combinations that cannot work (each component checks its own,
    flags.py what GRPO and PPO share): a mistake stops the run here, before any process group or
    model load, with what to change."""
    check_rules(args, [  # (flag, holds, what is wrong and what to do: "use 1 or more")
        ("num_generations", args.num_generations >= 1, "use 1 or more"),
        ("gamma", 0 <= args.gamma <= 1, "use a number in [0, 1]"),
        ("lam", 0 <= args.lam <= 1, "use a number in [0, 1]"),
        ("kl_target", args.kl_target is None or 0 < args.kl_target < math.inf, "use a positive KL, or none"),
        ("kl_target", args.kl_target is None or args.kl_coef > 0,
         "it adapts --kl-coef, which is 0 (no KL term): give a --kl-coef above 0, or drop --kl-target"),
        ("kl_horizon", args.kl_horizon >= 1, "use 1 or more completions"),
        ("critic_lr", 0 < args.critic_lr < math.inf, "use a positive learning rate such as 1e-3"),
        ("value_clip", 0 < args.value_clip < math.inf, "use a positive number")])
    check_rules(args.reward, [("rewards", "judge" not in args.reward.rewards, "the generative judge "
                "(--judge-model) is train_grpo.py's: use terms without `judge` (train_ppo.py takes rules, "
                "functions and a Bradley-Terry `rm`)")])
    check_rules(args.placement, [("placement", args.placement.placement != "partial", "partial placement "
                "splits the rollout between a sampler and a judge, which is train_grpo.py's: use colocate or "
                "disaggregate")])
    flags.check_flags(args, world)  # the flags GRPO and PPO share, and the layout: rollout ranks, staleness
    # the checkpoints last: hub ids become their snapshots (computed at runtime)
    flags.check_models(args, world)
    if read_config(args.data.model).vision is not None:
        raise UserError(f"--model {args.data.model} is a vision-language model: PPO's critic would be a "
                        "vision-language value model, which is not implemented; train it with train_grpo.py")
    if args.critic_model:
        args.critic_model = checked_model(args.critic_model, "--critic-model", tokenizer=False)
        check_same_tokenizer(args.critic_model, "--critic-model", args.data.model, "the critic values the "
                             "policy's token ids: start it from a checkpoint with the policy's tokenizer")


def loss_fn(logp, batch, norm: float, args: Args):
    """PPO's actor loss on one micro-batch (edit here to try another objective): the clipped
    surrogate on GAE's per-token advantages, against the engine's log-probs, summed over tokens
    and divided by `norm` (see `algos.aggregate`). The KL is in the reward, not here. logp [n, T]:
    the policy's log-probs of the completion tokens; batch: tasks.data.Batch. Returns (loss, sums)."""
    mask = batch["loss_mask"]  # [n, T]
    pg, clipped = algos.clipped_surrogate(logp, batch["old_logp"], batch["adv"], args.clip_low,
                                          args.clip_high)  # [n, T]
    loss = algos.aggregate(pg, mask, args.loss_agg, norm)
    sums = {"pg_loss": (pg.detach() * mask).sum(), "clipped_tokens": (clipped & (mask > 0)).sum()}
    return loss, sums


def advantages(batch, scores, args, kl_coef: float, plan):
    """GAE on the per-token reward (the score on the last token, -kl_coef * KL at each, and with a
    --teacher-model the distillation term at each), whitened over all trainer ranks' tokens in the
    loss. Returns (adv, returns, kl) [N, T]."""
    mask = batch["loss_mask"]  # [N, T] completion tokens with a reward
    kl = torch.zeros_like(mask)  # [N, T]
    if "ref_logp" in batch:  # the sampling policy's KL to the reference, per token
        kl = algos.kl_estimate(batch["old_logp"], batch["ref_logp"], args.kl_estimator) * mask
    rewards = algos.token_rewards(scores.to(mask.device), kl, mask, kl_coef)  # [N, T]
    if "teacher_logp" in batch:  # on-policy distillation: coef (log teacher - log student) per token
        batch["distill_rest"] = rewards
        batch["distill"] = algos.distill_advantage(batch["old_logp"], batch["teacher_logp"], mask,
                                                   args.distill.distill_coef)  # [N, T]
        rewards = rewards + batch["distill"]
    adv, returns = algos.gae(rewards, batch["values"], mask, args.gamma, args.lam)  # [N, T]
    if args.whiten_advantages:
        moments = torch.stack(algos.masked_moments(adv, mask))  # [3]: sum, sum of squares, count
        torch.distributed.all_reduce(moments, group=plan.trainer_group)
        adv = algos.whiten(adv, mask, *moments)
    return adv, returns, kl


def update(actor, critic, batch, args, plan, timer) -> run.Totals:
    """--minibatches optimizer steps of the actor, then of the critic, on this rank's batch (the
    two models share nothing, so the order does not matter). Each minibatch's losses are
    normalised by its token (or completion) count over all trainer ranks (run.split_minibatches),
    so that FSDP's gradient average is the mean over the whole minibatch. Returns the steps' metric
    sums and maxima."""
    trained = run.Totals({}, {})
    for mini, tokens, completions in run.split_minibatches(batch, args.minibatches, plan):
        actor_norm = tokens if args.loss_agg == "token" else completions
        with timer("train"):
            trained.add(*actor.train_step(mini, partial(loss_fn, args=args), actor_norm))
        with timer("critic_train"):
            trained.add(*critic.train_step(mini, tokens))  # a token mean
    return trained


def adapt_kl(kl_coef: float, kl, failed, args: Args, plan) -> float:
    """Ziegler et al.'s adaptive KL controller (--kl-target), on the step's mean KL per completion;
    the coefficient unchanged without a target."""
    if args.kl_target is None:
        return kl_coef
    seen = dist.reduce({"kl": kl.sum(), "n": (~failed).sum()}, group=plan.trainer_group)
    return algos.adaptive_kl_coef(kl_coef, seen["kl"] / max(1.0, seen["n"]), args.kl_target, args.kl_horizon,
                                  int(seen["n"]))


def log_step(record: run.StepRecord, kl, kl_coef: float, actor, engine, teacher, plan):
    """Reduce this step's numbers over the trainers (run.reduce_step), with the teacher's and the
    KL's (kl [N, T]: the per-token KL in the reward, at kl_coef); rank 0's metrics, else None."""
    batch, metrics = record.batch, record.metrics
    mask = batch["loss_mask"]  # [N, T]
    error = (batch["returns"] - batch["values"]) * mask  # [N, T] what the critic missed at rollout
    s = record.timer.seconds
    total, peak = run.reduce_step(record, engine, plan, sums={
        **record.trained.sums, "kl_sum": kl.sum(), "values": (batch["values"] * mask).sum(),
        "returns": batch["returns"].sum(), "returns_sq": batch["returns"].square().sum(),
        "error": error.sum(), "error_sq": error.square().sum(), **teacher.sums(batch)},
        maxes={**record.trained.maxes, **record.sync, "values_s": s["values"], "critic_s": s["critic_train"],
               "teacher_s": s.get("teacher", 0.0)})
    if plan.rank != 0:
        return None
    S = max(1.0, total["scored"])  # completions with a reward
    T = max(1.0, total["completion_tokens"])  # their tokens: what the losses see
    # explained variance of the returns by the rollout values: 1 - Var(R - V) / Var(R), over the tokens
    var_returns = total["returns_sq"] / T - (total["returns"] / T) ** 2
    var_error = total["error_sq"] / T - (total["error"] / T) ** 2
    metrics.update({
        **run.step_metrics(total, peak, record.got, actor, plan), "train/kl": total["kl_sum"] / T,
        "train/kl_per_completion": total["kl_sum"] / S, "train/kl_coef": kl_coef,
        "train/value_loss": total.get("value_loss", 0.0) / T, "train/value_mean": total["values"] / T,
        "train/value_clip_frac": total.get("value_clipped", 0.0) / T,
        "train/explained_variance": 1 - var_error / var_returns if var_returns > 1e-12 else 0.0,
        "train/value_grad_norm": peak.get("value_grad_norm", 0.0), "perf/values_s": peak["values_s"],
        "perf/critic_train_s": peak["critic_s"], **teacher.metrics(total, peak)})
    return metrics


if __name__ == "__main__":
    args = flags.parse(Args, check_args)
    cfg, tok, plan, (rows, skipped, eval_rows), local_engine = run.set_up(args)  # the process group, the plan
    if plan.role == "rollout":  # disaggregate: this rank only generates, in its own loop, then leaves
        run.run_rollout_rank(plan, local_engine)

    # the roles on every trainer rank: the actor, the critic, the reference, the reward model
    device = plan.device
    critic_dir = args.critic_model or args.data.model
    dist.mark_memory_start(device)  # what the models and steps add is measured from here
    if plan.rank == 0:
        print(memory.for_run(args, cfg, plan.mode, plan.dp, plan.layout.rollout_ranks, device,
                             max(len(r["ids"]) for r in rows), len(eval_rows), critic_dir), flush=True)
    actor = run.make_actor(args, plan)
    critic = Critic(critic_dir, plan.mesh, device, args.critic_lr, args.warmup_steps, args.weight_decay,
                    args.max_grad_norm, args.value_clip, args.compute.dtype, args.micro_batch_size,
                    args.steps if args.lr_schedule == "linear" else 0, compile=args.compute.compile,
                    micro_batch_tokens=args.micro_batch_tokens)
    ref, rm, teacher = run.frozen_roles(args, plan, actor)  # ref, rm: None without their flags
    bucket_bytes = int(args.placement.sync_bucket_mb * 2**20)
    engine = placement.engine_for(plan, local_engine, actor.weight_specs(), bucket_bytes)

    # the components, chosen once
    scorer = Scorer(args.reward, rm, None, tok.pad_id, device, args.sampling.max_new_tokens)
    session = run.Run(args, plan, actor, scorer, critic)
    kl_coef = session.resumed.get("kl_coef", args.kl_coef)  # the adaptive controller's state
    # generate ahead, or on-policy
    kind = rollouts.Ahead if args.placement.max_staleness else rollouts.OnPolicy
    rollout = kind(engine, scorer, rows, args, plan)
    evaluate = run.Evaluator(eval_rows, args.data.eval_every, args.steps, args.sampling.params(1),
                             args.run_args.seed, plan)
    if plan.rank == 0:
        print(f"{plan.layout.world} rank(s), {plan.mode} ({plan.dp} trainer(s)), {type(engine).__name__}; "
              f"PPO; model {args.data.model} ({actor.config.num_params() / 1e6:.2f}M params), critic from "
              f"{critic_dir}; {len(rows)} train prompts ({skipped} over --max-prompt-tokens skipped), "
              f"{len(eval_rows)} eval", flush=True)

    n = args.num_generations
    for step in range(session.start, args.steps):
        timer = Timer()
        sync = placement.sync(plan, actor, engine, step, timer)  # the policy (the critic's weights never go)
        metrics = evaluate(step, engine, timer)  # held-out accuracy, when due
        got = rollout.step(step, timer)  # this rank's prompts -> samples -> rewards

        # the batch: one row per completion; a sample without a reward leaves the loss
        prompt_ids = got.samples.prompts or per_sample([r["ids"] for r in got.rows], n)  # --agent: its own
        batch = make_batch(prompt_ids, got.samples.tokens, got.samples.lengths, tok.pad_id, device,
                           got.samples.model_mask, got.samples.routes)  # episodes: env tokens out of the loss
        batch["old_logp"] = got.samples.logprobs.to(device)  # [N, T]
        batch["loss_mask"] = batch["loss_mask"] * got.keep[:, None].to(device)  # [N, T]
        if ref:
            with timer("reference"):
                batch["ref_logp"] = ref.logprobs(batch)  # [N, T]
        teacher.score(batch, timer)  # --teacher-model: its log-probs of the sampled tokens
        with timer("values"):
            batch["values"] = critic.values(batch)  # [N, T]

        # advantages: GAE per token, the KL in the reward, whitened over the whole batch
        batch["adv"], batch["returns"], kl = advantages(batch, got.rewards, args, kl_coef, plan)

        # update: the actor's clipped surrogate, then the critic's clipped value loss, per minibatch
        trained = update(actor, critic, batch, args, plan, timer)

        record = run.StepRecord(step, timer, sync, metrics, got, batch, trained)
        metrics = log_step(record, kl, kl_coef, actor, engine, teacher, plan)
        kl_coef = adapt_kl(kl_coef, kl, got.failed, args, plan)
        if session.end_of_step(step, metrics, trained, ({"kl_coef": kl_coef}, {})):
            break
    session.finish(engine, evaluate)
