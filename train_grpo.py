"""GRPO with FSDP2 and parallel controllers.

    torchrun --standalone --nproc-per-node 2 train_grpo.py          # the built-in task, offline
    torchrun --standalone --nproc-per-node 3 train_grpo.py --placement disaggregate --rollout-ranks 1 \\
        --max-staleness 1                                # 2 trainers + 1 rollout rank, overlapped

Every rank runs this same script and is the controller of its own share of each step's
prompts (G-Core's parallel controllers): it generates, scores and computes its groups'
advantages itself; no rank ever gathers the batch. Only FSDP2's collectives, the weight sync
and the metric reductions are collective. With --placement disaggregate the rollout ranks run
`roles.rollout.serve` instead, and each trainer talks to its own rollout rank point to point.

Read from the step loop in `train` at the bottom: `rollouts.py` makes each step's scored
samples, `advantages` and `loss_fn` are GRPO, `update` runs the optimizer steps (roles/actor.py),
`placement.sync` moves the weights; features that are not the algorithm are components chosen
before the loop (rollouts, rl/mismatch.py, rebalance.py) and run.py holds the scaffolding.
"""
import math
import time
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
from models.lora import LoraArgs
from models.moe import MoeArgs
from placement import PlacementArgs
from rebalance import RebalanceArgs, Rebalancer, arrive, window_entry
from rl import algos
from rl.mismatch import Correction, MismatchArgs
from roles import judge as judge_role
from roles.reward import OverlongArgs, RewardArgs, Scorer
from roles.stream import StreamArgs
from roles.teacher import DistillArgs
from rollouts import DynamicSamplingArgs
from flags import ComputeArgs, DataArgs, Flat, RunArgs, SamplingArgs
from tasks.data import make_batch, per_sample
from utils import dist
from utils.errors import check_rules
from utils.logger import Timer


@dataclass
class Args:
    data: Flat[DataArgs] = field(default_factory=DataArgs)
    steps: int = 800
    """optimizer steps (one rollout batch each)"""
    prompts_per_step: int = 64
    """prompts per step over all trainer ranks (each takes prompts_per_step / trainers)"""
    num_generations: int = 8
    """completions per prompt: the group of GRPO's group-relative advantage"""
    advantage: Literal["grpo", "rloo", "reinforce++", "reinforce++_baseline", "remax"] = "grpo"
    """grpo: reward minus its group's mean, over the group's std (see --scale-std); rloo: minus the
    mean of the group's other samples; reinforce++: the KL to the reference in the per-token reward
    (not the loss), returns whitened over the whole batch; reinforce++_baseline: the group's mean
    subtracted first; remax: minus the reward of one greedy completion of the prompt"""
    scale_std: bool = True
    """grpo: divide group advantages by the group's reward std; off = Dr. GRPO (with --loss-agg constant)"""
    sampling: Flat[SamplingArgs] = field(default_factory=SamplingArgs)
    env: Flat[EnvArgs] = field(default_factory=EnvArgs)
    agent: Flat[AgentArgs] = field(default_factory=AgentArgs)
    reward: Flat[RewardArgs] = field(default_factory=RewardArgs)
    overlong: Flat[OverlongArgs] = field(default_factory=OverlongArgs)
    judge: Flat[judge_role.JudgeArgs] = field(default_factory=judge_role.JudgeArgs)
    dynamic_sampling: Flat[DynamicSamplingArgs] = field(default_factory=DynamicSamplingArgs)
    lr: float = 3e-4
    """AdamW learning rate (after warm-up)"""
    warmup_steps: int = 3
    """linear learning-rate warm-up"""
    lr_schedule: Literal["linear", "constant"] = "linear"
    """after the warm-up, linear: decay to 0 at the last step; constant: stay at --lr. At a constant
    rate the update noise stays as large once the policy is good, and it wanders off: the tiny
    default run's held-out accuracy went 0.46 at step 200 -> 0.33 at 250 (constant) against a
    steady rise to 0.76 (linear)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    clip_low: float = 0.2
    """ppo, dual_clip, cispo: the ratio clip below, 1 - clip_low"""
    clip_high: float = 0.28
    """ppo, dual_clip, cispo: the ratio clip above, 1 + clip_high (DAPO's clip-higher)"""
    policy_loss: Literal["ppo", "dual_clip", "gspo", "cispo"] = "ppo"
    """ppo: the clipped surrogate per token; dual_clip: with a lower bound --dual-clip-c * A for negative
    advantages; gspo: the ratio of the whole sequence (geometric mean), clipped by --gspo-clip-*; cispo:
    the clipped ratio as a stop-gradient weight on A * log pi (clipped tokens keep their gradient)"""
    dual_clip_c: float = 3.0
    """dual_clip: the bound c (> 1) on the loss of tokens with negative advantage"""
    gspo_clip_low: float = 3e-4
    """gspo: sequence ratio clip below, 1 - this (the paper's 3e-4)"""
    gspo_clip_high: float = 4e-4
    """gspo: sequence ratio clip above, 1 + this (the paper's 4e-4)"""
    kl_coef: float = 0.0
    """KL penalty to the reference policy (0: no reference model is built)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """--kl-coef > 0: the KL estimator (Schulman 2020)"""
    distill: Flat[DistillArgs] = field(default_factory=DistillArgs)
    loss_agg: Literal["token", "sequence", "constant"] = "token"
    """token: every token weighs the same (DAPO); sequence: mean per completion first (GRPO); constant:
    each completion's sum over --max-new-tokens (Dr. GRPO)"""
    minibatches: int = 1
    """optimizer steps per rollout batch (>1: later ones are off-policy; the ratio and clip handle it)"""
    mismatch: Flat[MismatchArgs] = field(default_factory=MismatchArgs)
    micro_batch_size: int = 256
    """completions per forward/backward on each rank (fewer FSDP gathers per step: 0.30 -> 0.22 s
    of training per step on the tiny default against 64; lower it for a large model's memory)"""
    micro_batch_tokens: int = 2048
    """>0: micro-batches of at most this many tokens (and --micro-batch-size rows), each packed into
    one sequence without padding and with each group's prompt once, exact to fp32 rounding
    (models/packing.py; docs/packing.md); 0: rows, padded. A Qwen2-VL model and --compile run rows.
    The default: as fast as 4096 on a reasoning shape, and a third less memory (docs/packing.md)"""
    compute: Flat[ComputeArgs] = field(default_factory=ComputeArgs)
    lora: Flat[LoraArgs] = field(default_factory=LoraArgs)
    moe: Flat[MoeArgs] = field(default_factory=MoeArgs)
    placement: Flat[PlacementArgs] = field(default_factory=PlacementArgs)
    stream: Flat[StreamArgs] = field(default_factory=StreamArgs)
    rebalance: Flat[RebalanceArgs] = field(default_factory=RebalanceArgs)
    run_args: Flat[RunArgs] = field(default_factory=RunArgs)
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "scale_std": ("advantage", lambda a: a == "grpo", "--advantage grpo"),
        "clip_low": ("policy_loss", lambda p: p != "gspo", "--policy-loss ppo, dual_clip or cispo"),
        "clip_high": ("policy_loss", lambda p: p != "gspo", "--policy-loss ppo, dual_clip or cispo"),
        "dual_clip_c": ("policy_loss", lambda p: p == "dual_clip", "--policy-loss dual_clip"),
        "gspo_clip_low": ("policy_loss", lambda p: p == "gspo", "--policy-loss gspo"),
        "gspo_clip_high": ("policy_loss", lambda p: p == "gspo", "--policy-loss gspo"),
        "kl_estimator": ("kl_coef", lambda c: c > 0, "a --kl-coef above 0")}


def check_args(args: Args, world: int):
    """Every flag's range and the combinations that cannot work (each component checks its own,
    flags.py what GRPO and PPO share): a mistake stops the run here, before any process group or
    model load, with what to change."""
    check_rules(args, [  # (flag, holds, what is wrong and what to do: "use 1 or more")
        ("num_generations", args.num_generations >= 2 or args.distill.alone(args.reward), "use 2 or more: "
         "GRPO's advantage compares the samples of a prompt's group, and with 1 every advantage is 0, so "
         "nothing would train (1 only for distillation alone: --teacher-model with --reward-weights 0)"),
        ("advantage", args.advantage != "remax" or args.placement.placement != "partial",
         "remax's greedy baseline is not generated in partial placement: use another --advantage, or "
         "another --placement"),
        ("dual_clip_c", args.dual_clip_c > 1, "use a bound above 1, such as 3"),
        ("gspo_clip_low", 0 <= args.gspo_clip_low < 1, "use a number in [0, 1), such as 3e-4"),
        ("gspo_clip_high", 0 <= args.gspo_clip_high < math.inf, "use 0 or more, such as 4e-4")])
    layout = flags.check_flags(args, world)  # what GRPO and PPO share; the layout: rollout ranks, staleness
    args.overlong.check(args.sampling.max_new_tokens)
    args.dynamic_sampling.check(args)
    args.stream.check(args)
    args.mismatch.check()
    args.rebalance.check(args, world, layout)
    # the checkpoints last: hub ids become their snapshots (computed at runtime); a vision-language
    # --model refuses what would read its prompts as text
    flags.check_models(args, world, {"--tools": args.env.tools, "--env": args.env.env,
                                   "--judge-model": args.judge.judge_model,
                                   "--reward-model": args.reward.reward_model,
                                   "--teacher-model": args.distill.teacher_model})
    args.judge.check(args)


def loss_fn(logp, batch, norm: float, args: Args):
    """GRPO's loss on one micro-batch (edit here to try another objective): the policy loss of
    --policy-loss against the old log-probs (by default PPO's clipped surrogate with DAPO's
    clip-higher), times the mismatch correction's weight if any, plus kl_coef times a KL estimate
    to the reference policy (unless REINFORCE++ put the KL in the reward), each summed over
    tokens and divided by `norm` (see `algos.aggregate`). logp [n, T]: the policy's log-probs of
    the completion tokens; batch: tasks.data.Batch. Returns (loss, metric sums)."""
    mask, old, adv = batch["loss_mask"], batch["old_logp"], batch["adv"]  # [n, T] each
    if args.policy_loss == "ppo":
        pg, clip_active = algos.clipped_surrogate(logp, old, adv, args.clip_low, args.clip_high)  # [n, T]
    else:  # the rest of the menu (rl/algos.py POLICY_LOSSES)
        pg, clip_active = algos.POLICY_LOSSES[args.policy_loss](logp, old, adv, mask, args)  # [n, T]
    if "is_weight" in batch:  # --mismatch tis / icepop
        pg = pg * batch["is_weight"]  # [n, T]
    loss = algos.aggregate(pg, mask, args.loss_agg, norm, args.sampling.max_new_tokens)
    sums = {"pg_loss": (pg.detach() * mask).sum(), "clipped_tokens": (clip_active & (mask > 0)).sum()}
    if args.kl_coef > 0 and not args.advantage.startswith("reinforce++"):
        kl = algos.kl_estimate(logp, batch["ref_logp"], args.kl_estimator)  # [n, T]
        loss = loss + args.kl_coef * algos.aggregate(kl, mask, args.loss_agg, norm,
                                                     args.sampling.max_new_tokens)
        sums["kl"] = (kl.detach() * mask).sum()
    return loss, sums


def advantages(got, batch, args: Args, plan):
    """adv [N, T] by --advantage, from this rank's rewards got.rewards [N] (a sample that is not
    got.scored gets 0), plus with a --teacher-model the per-token distillation term. GRPO: each
    completion's reward minus its group's mean over the scored samples, over the group's std (Shao
    et al. 2024), the same at each of its tokens."""
    n, mask = args.num_generations, batch["loss_mask"]  # mask [N, T]
    rewards, scored = got.rewards, got.scored  # [N] each
    if args.distill.alone(args.reward):  # no reward term trains (they are still logged)
        adv = torch.zeros_like(mask)
    elif args.advantage == "grpo":
        adv = algos.group_advantages(rewards.view(-1, n), args.scale_std, scored=scored.view(-1, n))  # [G, n]
        adv = adv.reshape(-1, 1).to(mask.device).expand_as(mask)  # [N, T]
    else:  # the rest of the menu (rl/algos.py ADVANTAGES): rloo, remax, reinforce++ (batch-whitened)
        reduce_sum = partial(torch.distributed.all_reduce, group=plan.trainer_group)
        adv = algos.ADVANTAGES[args.advantage](got, batch, args, reduce_sum)  # [N, T]
    if "teacher_logp" in batch:  # on-policy distillation: coef (log teacher - log student) per token
        batch["distill_rest"] = adv
        batch["distill"] = algos.distill_advantage(batch["old_logp"], batch["teacher_logp"], mask,
                                                   args.distill.distill_coef)  # [N, T]
        adv = adv + batch["distill"]
    return adv


def update(actor, batch, args: Args, plan) -> run.Totals:
    """--minibatches optimizer steps on this rank's batch. Each minibatch's loss is normalised by
    its token (or completion) count over all trainer ranks (run.split_minibatches), so that FSDP's
    gradient average is the mean over the whole minibatch. Returns the steps' metric sums and maxima."""
    # the zero-advantage row skip is exact only while every loss term is proportional to the
    # advantage: the KL term in the loss is not (REINFORCE++ puts it in the reward)
    skip = args.kl_coef == 0 or args.advantage.startswith("reinforce++")
    trained = run.Totals({}, {})
    for mini, tokens, completions in run.split_minibatches(batch, args.minibatches, plan):
        norm = tokens if args.loss_agg == "token" else completions  # completions: sequence, constant
        trained.add(*actor.train_step(mini, partial(loss_fn, args=args), norm, skip_zero_adv_rows=skip))
    return trained


def log_step(record: run.StepRecord, actor, engine, correction, teacher, args: Args, plan):
    """Reduce this step's numbers over the trainers (run.reduce_step: one sum, one max), with those
    of the components that have metrics of their own (the correction, the teacher). Returns (what
    --rebalance reads: each role's busy seconds per rank, the same on every trainer; rank 0's
    metrics, else None)."""
    n = args.num_generations
    got, batch, metrics = record.got, record.batch, record.metrics
    groups = got.rewards.view(-1, n)  # [prompts, n]
    s = record.timer.seconds
    total, peak = run.reduce_step(record, engine, plan, sums={
        **record.trained.sums, **correction.sums, **teacher.sums(batch),
        "all_same": (groups.max(-1).values == groups.min(-1).values).sum(),
        "judge_unparsed": got.tally["judge_unparsed"], "judge_verdicts": got.tally["judge_verdicts"]}, maxes={
        **record.trained.maxes, **correction.maxes, **record.sync, "judge_s": s.get("judge", 0.0),
        "rollout_judge_s": s["generate"] + s.get("judge", 0.0), "old_logp_s": s.get("old_logp", 0.0),
        "teacher_s": s.get("teacher", 0.0)})
    entry = window_entry(total, peak, plan)  # what --rebalance reads: the same on every rank
    if plan.rank != 0:
        return entry, None
    T = max(1.0, total["completion_tokens"])
    metrics.update({**got.metrics, **run.step_metrics(total, peak, got, actor, plan),
                    "rollout/groups_all_same": total["all_same"] / (total["completions"] / n),
                    "train/kl": total.get("kl", 0.0) / T, "perf/old_logp_s": peak["old_logp_s"]})
    if args.judge.judge_model:
        metrics.update(judge_role.metrics(total, peak))
    metrics.update({**correction.metrics(total, peak), **teacher.metrics(total, peak)})
    return entry, metrics


def train(args: Args, plan, arrival, cfg, tok, prompts: tuple, local_engine):
    """This rank as a trainer in one layout: its roles, the components, the step loop. At the end
    of the run it leaves the process; after a --rebalance move in process it returns the next
    layout's Plan and rebalance.Arrival, which carries the state moved onto it."""
    # the roles on every trainer rank: the actor, the reference, the reward model, the judge
    rows, skipped, eval_rows = prompts
    device = plan.device
    max_len = args.env.context(args.data.max_prompt_tokens + args.sampling.max_new_tokens)
    dist.mark_memory_start(device)  # what the models and steps add is measured from here
    if plan.rank == 0:
        print(memory.for_run(args, cfg, plan.mode, plan.dp, plan.layout.rollout_ranks, device,
                             max(len(r["ids"]) for r in rows), len(eval_rows)), flush=True)
    actor = run.make_actor(args, plan)
    ref, rm, teacher = run.frozen_roles(args, plan, actor)  # ref, rm: None without their flags
    # partial: the judge ranks only
    judge = judge_role.for_run(args, plan, rows, device, args.compute.dtype, max_len)
    bucket_bytes = int(args.placement.sync_bucket_mb * 2**20)
    engine = placement.engine_for(plan, local_engine, actor.weight_specs(), bucket_bytes)

    # the components, chosen once: each does nothing when its flags are off
    scorer = Scorer(args.reward, rm, judge, tok.pad_id, device, args.sampling.max_new_tokens, args.overlong)
    session = run.Run(args, plan, actor, scorer, arrival=arrival)
    rollout = rollouts.choose(engine, scorer, rows, args, plan, judge, session.resumed)
    evaluate = run.Evaluator(eval_rows, args.data.eval_every, args.steps, args.sampling.params(1),
                             args.run_args.seed, plan)
    correction = Correction(args.mismatch, actor)
    rebalancer = Rebalancer(args, plan, actor, arrival, session.start, session.log, rollout.saved, engine)
    if plan.rank == 0:
        print(f"{plan.layout.world} rank(s), {plan.mode} ({plan.dp} trainer(s)), {type(engine).__name__}; "
              f"model {args.data.model} ({actor.config.num_params() / 1e6:.2f}M params); {len(rows)} train "
              f"prompts ({skipped} over --max-prompt-tokens skipped), {len(eval_rows)} eval", flush=True)

    n = args.num_generations
    for step in range(session.start, args.steps):
        timer = Timer()
        sync = placement.sync(plan, actor, engine, step, timer)  # the policy after `step` updates
        metrics = evaluate(step, engine, timer)  # held-out accuracy, when due
        got = rollout.step(step, timer)  # this rank's prompts -> samples -> rewards

        # the batch: one row per completion; samples that are not kept leave the loss
        prompt_ids = got.samples.prompts or per_sample([r["ids"] for r in got.rows], n)  # --agent: its own
        batch = make_batch(prompt_ids, got.samples.tokens, got.samples.lengths, tok.pad_id, device,
                           got.samples.model_mask, got.samples.routes)  # episodes: env tokens out of the loss
        batch["loss_mask"] = batch["loss_mask"] * got.keep[:, None].to(device)  # [N, T]
        batch["old_logp"] = got.samples.logprobs.to(device)  # [N, T] the engine's
        if ref:
            with timer("reference"):
                batch["ref_logp"] = ref.logprobs(batch)  # [N, T]
        teacher.score(batch, timer)  # --teacher-model: its log-probs of the sampled tokens

        # advantages, by --advantage (GRPO: group-relative over the scored samples; + distillation)
        batch["adv"] = advantages(got, batch, args, plan)  # [N, T]

        # update: --mismatch / --recompute-old-logp first (nothing when off), then the optimizer steps
        correction.apply(batch, timer)
        with timer("train"):
            trained = update(actor, batch, args, plan)

        record = run.StepRecord(step, timer, sync, metrics, got, batch, trained)
        entry, metrics = log_step(record, actor, engine, correction, teacher, args, plan)
        if session.end_of_step(step, metrics, trained, rollout.saved()) or rebalancer.after_step(step, entry):
            break  # a stop (SIGTERM), or a move to another layout
    session.finish(engine, evaluate, rebalancer.exit_code)  # leaves the process, unless a move goes on in it
    return rebalancer.next_layout(actor, rollout.saved(), arrival, session.log)


if __name__ == "__main__":
    args = flags.parse(Args, check_args)
    arrival = arrive(args, time.time())  # --rebalance-restart moved the ranks: resume in their layout
    cfg, tok, plan, prompts, local_engine = run.set_up(args)  # the process group, the plan, prompts, engine
    while True:  # each layout of the run: a --rebalance move in process (rebalance.py) goes on here
        if plan.role == "rollout":  # disaggregate: this rank only generates, in its own loop
            plan, arrival = run.run_rollout_rank(plan, local_engine, arrival)
        else:
            plan, arrival = train(args, plan, arrival, cfg, tok, prompts, local_engine)
