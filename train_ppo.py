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

import placement
import rollouts
from placement import PlacementArgs
from roles.actor import Actor
from roles.critic import Critic
from roles.reference import Reference
from roles.reward import RewardArgs, Scorer
from roles.reward_model import RewardModel
from roles.teacher import DistillArgs, Teacher
from run import (DataArgs, Evaluator, Flat, Run, RunArgs, checked_model, load_prompts, parse, reduce_step,
                 run_rollout_rank, step_metrics)
from utils import algos, dist, episodes, lora, memory, tp
from utils.data import Tokenizer, check_same_tokenizer, make_batch, micro_batches, per_sample
from utils.engines import SamplingParams, check_engine, make_engine
from utils.episodes import EnvArgs
from utils.lora import LoraArgs
from utils.errors import UserError, check_applies, check_rules
from utils.logger import Timer
from utils.model import read_config

MAX = torch.distributed.ReduceOp.MAX


@dataclass
class Args:
    data: Flat[DataArgs] = field(default_factory=DataArgs)
    steps: int = 600
    """optimizer steps (one rollout batch each)"""
    prompts_per_step: int = 256
    """prompts per step over all trainer ranks (each takes prompts_per_step / trainers)"""
    num_generations: int = 1
    """completions per prompt (PPO needs no group: the critic is the baseline)"""
    max_new_tokens: int = 8
    """completion length limit"""
    temperature: float = 1.0
    """sampling temperature (also applied to the trainer's log-probs)"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    env: Flat[EnvArgs] = field(default_factory=EnvArgs)
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
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 MixedPrecisionPolicy param dtype (bf16 on GPU; gradients reduce in fp32)"""
    compile: bool = False
    """torch.compile each decoder block of the trained model(s) (torchtitan's per-block compile);
    the first steps pay the compile (see docs/benchmarks.md: A compiled step)"""
    lora: Flat[LoraArgs] = field(default_factory=LoraArgs)
    engine: Literal["auto", "native", "vllm"] = "auto"
    """generation engine: auto = vLLM on GPU when installed, else native (docs/engines.md: vLLM on CPU)"""
    layout: Flat[PlacementArgs] = field(default_factory=PlacementArgs)
    run: Flat[RunArgs] = field(default_factory=lambda: RunArgs(run_dir="runs/ppo"))
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "kl_estimator": ("kl_coef", lambda c: c > 0, "a --kl-coef above 0"),
        "kl_horizon": ("kl_target", lambda t: t is not None, "a --kl-target")}


def check_args(args: Args, world: int):
    """Every flag's range and the combinations that cannot work (each component checks its own):
    a mistake stops the run here, before any process group or model load, with what to change."""
    args.data.check()
    check_rules(args, [  # (flag, holds, what is wrong and what to do: "use 1 or more")
        ("steps", args.steps >= 1, "use 1 or more"),
        ("prompts_per_step", args.prompts_per_step >= 1, "use 1 or more"),
        ("num_generations", args.num_generations >= 1, "use 1 or more"),
        ("max_new_tokens", args.max_new_tokens >= 1, "use 1 or more"),
        ("temperature", 0 < args.temperature < math.inf, "use a positive number (1.0: the model as it is)"),
        ("top_p", 0 < args.top_p <= 1, "use a number in (0, 1] (1.0: off)"),
        ("top_k", args.top_k >= 0, "use 0 (off) or a number of tokens"),
        ("gamma", 0 <= args.gamma <= 1, "use a number in [0, 1]"),
        ("lam", 0 <= args.lam <= 1, "use a number in [0, 1]"),
        ("kl_coef", 0 <= args.kl_coef < math.inf, "use 0 (no KL term) or more"),
        ("kl_target", args.kl_target is None or 0 < args.kl_target < math.inf, "use a positive KL, or none"),
        ("kl_target", args.kl_target is None or args.kl_coef > 0,
         "it adapts --kl-coef, which is 0 (no KL term): give a --kl-coef above 0, or drop --kl-target"),
        ("kl_horizon", args.kl_horizon >= 1, "use 1 or more completions"),
        ("lr", 0 < args.lr < math.inf, "use a positive learning rate such as 3e-4"),
        ("critic_lr", 0 < args.critic_lr < math.inf, "use a positive learning rate such as 1e-3"),
        ("warmup_steps", args.warmup_steps >= 0, "use 0 or more"),
        ("weight_decay", 0 <= args.weight_decay < math.inf, "use 0 or more"),
        ("max_grad_norm", 0 < args.max_grad_norm, "use a positive norm"),
        ("clip_low", 0 <= args.clip_low < 1, "use a number in [0, 1)"),
        ("clip_high", 0 <= args.clip_high < math.inf, "use 0 or more"),
        ("value_clip", 0 < args.value_clip < math.inf, "use a positive number"),
        ("minibatches", args.minibatches >= 1, "use 1 or more"),
        ("micro_batch_size", args.micro_batch_size >= 1, "use 1 or more")])
    check_rules(args.reward, [("rewards", "judge" not in args.reward.rewards, "the generative judge "
                "(--judge-model) is train_grpo.py's: use terms without `judge` (train_ppo.py takes rules, "
                "functions and a Bradley-Terry `rm`)")])
    check_rules(args.layout, [("placement", args.layout.placement != "partial", "partial placement splits "
                "the rollout between a sampler and a judge, which is train_grpo.py's: use colocate or "
                "disaggregate")])
    args.distill.check()
    args.run.check()
    args.lora.check(args.engine, args.layout.placement)
    args.env.check()
    layout = args.layout.check(world, args.prompts_per_step)
    rows = args.prompts_per_step // layout.dp * args.num_generations  # completions per trainer rank
    if rows % args.minibatches:
        raise UserError(f"--minibatches {args.minibatches} does not split the {rows} completions each "
                        f"trainer rank trains per step: use a divisor of {rows}")
    check_applies(args)  # a flag set where it does nothing (each component lists its own: APPLIES)
    check_engine(args.engine, args.layout.placement)  # vLLM installed, before any rank needs it
    args.data.check_model()  # the checkpoints last: hub ids become their snapshots (computed at runtime)
    if read_config(args.data.model).vision is not None:
        raise UserError(f"--model {args.data.model} is a vision-language model: PPO's critic would be a "
                        "vision-language value model, which is not implemented; train it with train_grpo.py")
    if args.critic_model:
        args.critic_model = checked_model(args.critic_model, "--critic-model", tokenizer=False)
        check_same_tokenizer(args.critic_model, "--critic-model", args.data.model, "the critic values the "
                             "policy's token ids: start it from a checkpoint with the policy's tokenizer")
    args.reward.check(args.data)
    args.distill.check_model(args.data.model)
    args.env.check_model(args.data.model)  # the chat template carries an episode token for token
    tp.check_args(args, world)  # --gen-tp: the model's heads and MLP split over K ranks


def loss_fn(logp, batch, norm: float, args: Args):
    """PPO's actor loss on one micro-batch (edit here to try another objective): the clipped
    surrogate on GAE's per-token advantages, against the engine's log-probs, summed over tokens
    and divided by `norm` (see `algos.aggregate`). The KL is in the reward, not here. logp [n, T]:
    the policy's log-probs of the completion tokens; batch: utils.data.Batch. Returns (loss, sums)."""
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


def update(actor, critic, batch, args, plan, timer):
    """--minibatches optimizer steps of the actor, then of the critic, on this rank's batch (the
    two models share nothing, so the order does not matter). Each minibatch's losses are
    normalised by its token (or completion) count over all trainer ranks, so that FSDP's gradient
    average is the mean over the whole minibatch. Returns the steps' metric sums and maxima."""
    size = len(batch["adv"]) // args.minibatches  # rows per minibatch (check_args: it divides)
    minis = list(micro_batches(batch, size))
    counts = []  # [minibatches, 2]: tokens, completions in the loss
    for mini in minis:
        counts.append([float(mini["loss_mask"].sum()), float((mini["loss_mask"].sum(-1) > 0).sum())])
    counts = torch.tensor(counts, dtype=torch.float64)
    torch.distributed.all_reduce(counts, group=plan.trainer_group)
    sums, maxes = {}, {}
    for mini, (tokens, completions) in zip(minis, counts.tolist()):
        actor_norm = tokens if args.loss_agg == "token" else completions
        with timer("train"):
            s, m = actor.train_step(mini, partial(loss_fn, args=args), actor_norm / plan.dp)
        with timer("critic_train"):
            critic_sums, critic_maxes = critic.train_step(mini, tokens / plan.dp)  # a token mean
        for k, v in {**s, **critic_sums}.items():
            sums[k] = sums.get(k, 0) + v
        for k, v in {**m, **critic_maxes}.items():
            maxes[k] = torch.maximum(torch.as_tensor(maxes.get(k, v)), torch.as_tensor(v))
    return sums, maxes


def adapt_kl(kl_coef: float, kl, failed, args: Args, plan) -> float:
    """Ziegler et al.'s adaptive KL controller (--kl-target), on the step's mean KL per completion;
    the coefficient unchanged without a target."""
    if args.kl_target is None:
        return kl_coef
    seen = dist.reduce({"kl": kl.sum(), "n": (~failed).sum()}, group=plan.trainer_group)
    return algos.adaptive_kl_coef(kl_coef, seen["kl"] / max(1.0, seen["n"]), args.kl_target, args.kl_horizon,
                                  int(seen["n"]))


def log_step(step, metrics, got, batch, kl, kl_coef, train, sync, timer, actor, engine, teacher, plan):
    """Reduce this step's numbers over the trainers (run.reduce_step); rank 0's metrics, else None."""
    mask = batch["loss_mask"]  # [N, T]
    error = (batch["returns"] - batch["values"]) * mask  # [N, T] what the critic missed at rollout
    s = timer.seconds
    total, peak = reduce_step(step, got, mask, timer, engine, plan, sums={
        **train[0], "kl_sum": kl.sum(), "values": (batch["values"] * mask).sum(),
        "returns": batch["returns"].sum(), "returns_sq": batch["returns"].square().sum(),
        "error": error.sum(), "error_sq": error.square().sum(), **teacher.sums(batch)},
        maxes={**train[1], **sync, "values_s": s["values"], "critic_s": s["critic_train"],
               "teacher_s": s.get("teacher", 0.0)})
    if plan.rank != 0:
        return None
    S = max(1.0, total["scored"])  # completions with a reward
    T = max(1.0, total["completion_tokens"])  # their tokens: what the losses see
    # explained variance of the returns by the rollout values: 1 - Var(R - V) / Var(R), over the tokens
    var_returns = total["returns_sq"] / T - (total["returns"] / T) ** 2
    var_error = total["error_sq"] / T - (total["error"] / T) ** 2
    metrics.update({
        **step_metrics(total, peak, got, actor, plan), "train/kl": total["kl_sum"] / T,
        "train/kl_per_completion": total["kl_sum"] / S, "train/kl_coef": kl_coef,
        "train/value_loss": total.get("value_loss", 0.0) / T, "train/value_mean": total["values"] / T,
        "train/value_clip_frac": total.get("value_clipped", 0.0) / T,
        "train/explained_variance": 1 - var_error / var_returns if var_returns > 1e-12 else 0.0,
        "train/value_grad_norm": peak.get("value_grad_norm", 0.0), "perf/values_s": peak["values_s"],
        "perf/critic_train_s": peak["critic_s"], **teacher.metrics(total, peak)})
    return metrics


if __name__ == "__main__":
    args = parse(Args, check_args)
    cfg, tok = read_config(args.data.model), Tokenizer(args.data.model)
    rank, world, device = dist.init(args.run.timeout_s)
    plan = placement.plan(args.layout.placement, rank, world, device, args.prompts_per_step,
                          args.layout.rollout_ranks, args.layout.max_staleness, args.run.timeout_s,
                          gen_tp=args.layout.gen_tp)
    torch.manual_seed(args.run.seed)
    param_dtype = getattr(torch, args.param_dtype)
    max_len = args.env.context(args.data.max_prompt_tokens + args.max_new_tokens)
    rows, skipped, eval_rows = load_prompts(args.data, tok, args.env)  # every rank: episodes start from them
    args.reward.check_rows(rows)  # the columns the reward terms read
    serve_lora = args.lora.lora_rank if args.lora.lora_vllm == "adapters" else 0  # vLLM serving adapters
    engine_of = partial(make_engine, args.engine, args.data.model, cfg, tok, device, param_dtype, max_len,
                        args.run.seed, lora_rank=serve_lora)
    local_engine = episodes.wrap(engine_of, args.env, tok, rows + eval_rows, args.max_new_tokens)  # --env
    if plan.role == "rollout":  # disaggregate: this rank only generates, in its own loop, then leaves
        run_rollout_rank(plan, local_engine)

    # the roles on every trainer rank: the actor, the critic, the reference, the reward model
    decay_steps = args.steps if args.lr_schedule == "linear" else 0
    critic_dir = args.critic_model or args.data.model
    dist.mark_memory_start(device)  # what the models and steps add is measured from here
    if rank == 0:
        print(memory.for_run(args, cfg, plan.mode, plan.dp, plan.layout.rollout, device,
                             max(len(r["ids"]) for r in rows), len(eval_rows), critic_dir), flush=True)
    actor = Actor(args.data.model, plan.mesh, device, args.lr, args.warmup_steps, args.weight_decay,
                  args.max_grad_norm, param_dtype, args.temperature, args.micro_batch_size, decay_steps,
                  compile=args.compile, lora=args.lora, seed=args.run.seed,
                  freeze_vision=args.data.freeze_vision)
    critic = Critic(critic_dir, plan.mesh, device, args.critic_lr, args.warmup_steps, args.weight_decay,
                    args.max_grad_norm, args.value_clip, param_dtype, args.micro_batch_size, decay_steps,
                    compile=args.compile)
    ref = None
    if args.kl_coef > 0 and args.lora.lora_rank:
        ref = lora.Reference(actor)  # the actor with its adapters off: no second model
    elif args.kl_coef > 0:
        ref = Reference(args.data.model, plan.mesh, device, param_dtype, args.temperature,
                        args.micro_batch_size)
    rm = None
    if args.reward.reward_model:
        rm = RewardModel(args.reward.reward_model, plan.mesh, device, param_dtype, args.micro_batch_size)
    teacher = Teacher(args.distill, plan, device, param_dtype, args.temperature, args.micro_batch_size)
    bucket_bytes = int(args.layout.sync_bucket_mb * 2**20)
    engine = placement.engine_for(plan, local_engine, actor.weight_specs(), bucket_bytes)

    # the components, chosen once
    scorer = Scorer(args.reward, rm, None, tok.pad_id, device, args.max_new_tokens)
    run = Run(args, plan, actor, scorer, critic)
    kl_coef = run.resumed.get("kl_coef", args.kl_coef)  # the adaptive controller's state
    kind = rollouts.Ahead if args.layout.max_staleness else rollouts.OnPolicy  # generate ahead, or on-policy
    rollout = kind(engine, scorer, rows, args, plan)
    evaluate = Evaluator(eval_rows, args.data.eval_every, args.steps, SamplingParams(
        1, args.temperature, args.top_p, args.top_k, args.max_new_tokens), args.run.seed, plan)
    if rank == 0:
        print(f"{world} rank(s), {plan.mode} ({plan.dp} trainer(s)), {type(engine).__name__}; PPO; model "
              f"{args.data.model} ({actor.config.num_params() / 1e6:.2f}M params), critic from {critic_dir}; "
              f"{len(rows)} train prompts ({skipped} over --max-prompt-tokens skipped), {len(eval_rows)} "
              f"eval", flush=True)

    n = args.num_generations
    for step in range(run.start, args.steps):
        timer = Timer()
        sync = placement.sync(plan, actor, engine, step, timer)  # the policy (the critic's weights never go)
        metrics = evaluate(step, engine, timer)  # held-out accuracy, when due
        got = rollout.step(step, timer)  # this rank's prompts -> samples -> rewards

        # the batch: one row per completion; a sample without a reward leaves the loss
        prompt_ids = per_sample([r["ids"] for r in got.rows], n)
        batch = make_batch(prompt_ids, got.samples.tokens, got.samples.lengths, tok.pad_id, device,
                           got.samples.model_mask)  # episodes: the environment's tokens leave the loss
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
        train = update(actor, critic, batch, args, plan, timer)

        metrics = log_step(step, metrics, got, batch, kl, kl_coef, train, sync, timer, actor, engine, teacher,
                           plan)
        kl_coef = adapt_kl(kl_coef, kl, got.failed, args, plan)
        if run.end_of_step(step, metrics, train, ({"kl_coef": kl_coef}, {})):
            break
    run.finish(engine, evaluate)
