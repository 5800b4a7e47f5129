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
import os
import signal
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

import torch

import placement
from roles import reward_model
from roles.actor import Actor
from roles.critic import Critic
from roles.reference import Reference
from roles.reward import Reward
from roles.reward_model import RewardModel
from roles.rollout import serve
from utils import algos, checkpoint, dist, errors, memory
from utils.data import (BUILTIN, Tokenizer, dataset_columns, eval_source, load_rows, make_batch,
                        micro_batches, per_sample, prompt_seed, step_prompts, tokenize_rows)
from utils.engines import SamplingParams, make_engine
from utils.errors import UserError
from utils.logger import Logger, Timer
from utils.model import check_checkpoint, local_dir, read_config
from utils.plot import plot

MAX = torch.distributed.ReduceOp.MAX


@dataclass
class Args:
    model: str = "assets/arith-tiny"
    """the policy's Hugging Face checkpoint: a local directory (config.json, *.safetensors,
    tokenizer.json) or a hub id (ORG/NAME, downloaded into the hub's cache; needs the network)"""
    dataset: str = BUILTIN
    """'builtin:arith', a local .jsonl/.json/.parquet file, or a hub dataset id"""
    prompt_column: str = "prompt"
    """dataset column holding the prompt (a string or a list of chat messages)"""
    answer_column: str | None = "answer"
    """dataset column holding the reference answer (none: reward functions get no answer)"""
    eval_dataset: str | None = None
    """held-out prompts; default: the built-in task's eval split, or a hub id's 'test' split"""
    eval_every: int = 100
    """evaluate the held-out reward every this many steps (0: never)"""
    eval_prompts: int = 256
    """at most this many held-out prompts per evaluation"""
    steps: int = 600
    """optimizer steps (one rollout batch each)"""
    prompts_per_step: int = 256
    """prompts per step over all trainer ranks (each takes prompts_per_step / trainers)"""
    num_generations: int = 1
    """completions per prompt (PPO needs no group: the critic is the baseline)"""
    max_new_tokens: int = 8
    """completion length limit"""
    max_prompt_tokens: int = 256
    """longer prompts are skipped and counted"""
    temperature: float = 1.0
    """sampling temperature (also applied to the trainer's log-probs)"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    rewards: tuple[str, ...] = ("accuracy",)
    """reward terms: accuracy, format, code, rm (the --reward-model), or module:function"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward term (default: all 1)"""
    reward_model: str | None = None
    """a Bradley-Terry reward model (a HF ...ForSequenceClassification checkpoint with the policy's
    tokenizer; train_rm.py trains one): the `rm` term of --rewards"""
    reward_timeout_s: float = 60.0
    """a reward function call running longer scores 0 for its samples (counted in reward/failures)"""
    code_timeout_s: float = 5.0
    """the code reward's wall-clock limit per completion (sandboxed process)"""
    code_memory_mb: int = 512
    """the code reward's memory limit per completion"""
    gamma: float = 1.0
    """GAE's discount (1: the score at the end counts fully at every token)"""
    lam: float = 0.95
    """GAE's lambda: 1 = Monte-Carlo returns (no bias, most variance), 0 = one-step TD"""
    whiten_advantages: bool = True
    """whiten the advantages over the whole batch (all trainer ranks)"""
    kl_coef: float = 0.01
    """per-token KL penalty to the reference policy in the reward (0: no reference model is built)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator in the reward (Schulman 2020); k1 = log(pi / ref), as in InstructGPT"""
    kl_target: float | None = None
    """adaptive KL controller (Ziegler et al. 2019): move kl_coef so that the mean KL per completion
    (summed over tokens) approaches this (none: a fixed kl_coef)"""
    kl_horizon: int = 10000
    """adaptive KL controller: completions over which the coefficient's error is corrected"""
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
    max_skipped_steps: int = 10
    """a step whose gradients are NaN/inf is skipped and counted; after this many the run stops"""
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
    the first steps pay the compile (see README: A compiled step)"""
    engine: Literal["auto", "native", "vllm"] = "auto"
    """generation engine: auto = vLLM on GPU when installed, else native (see README for vLLM on CPU)"""
    placement: Literal["colocate", "disaggregate"] = "colocate"
    """colocate: every rank trains and generates, taking turns; disaggregate: --rollout-ranks ranks
    only generate while the others hold actor, critic, reference and reward model and train"""
    rollout_ranks: int = 0
    """disaggregate: the last K ranks generate (each serves (world - K) / K trainers)"""
    max_staleness: int = 0
    """disaggregate: generate up to this many steps ahead while training (0: on-policy)"""
    sync_bucket_mb: float = 64.0
    """disaggregate: weights are gathered and broadcast to the rollout ranks in buckets of this size"""
    seed: int = 0
    """seeds init, data order and sampling (per prompt: results do not depend on the ranks)"""
    run_dir: str = "runs/ppo"
    """metrics.jsonl, config.json and the final policy (final/, HF format) go here"""
    save_final: bool = True
    """write the trained policy as a HF checkpoint to run_dir/final at the end"""
    save_every: int = 50
    """save the sharded training state (DCP: actor, critic, KL coefficient) every this many steps,
    and on SIGTERM (0: SIGTERM only)"""
    keep_last: int = 2
    """complete checkpoints to keep"""
    resume: str = "restart"
    """restart: continue from run_dir's newest complete checkpoint when torchrun restarted the job
    (--max-restarts), else start afresh; auto: continue from it whenever there is one; none; or a path"""
    save_hf_every: int = 0
    """also export a HF checkpoint of the policy (run_dir/hf/step_N) every this many steps (0: off)"""
    track: bool = False
    """log to wandb (pip install wandb)"""
    wandb_project: str = "rl-trainer"
    """wandb project name"""
    timeout_s: float = 300.0
    """a collective waiting longer than this fails (a dead rank must not hang the job)"""


def check_args(args: Args, world: int):
    """Every flag's range and the combinations that cannot work, in the order of Args: a mistake
    stops the run here, before any process group or model load, with what to change."""
    rules = [  # (flag, holds, what to use instead)
        ("eval_every", args.eval_every >= 0, "0 (never) or a number of steps"),
        ("eval_prompts", args.eval_prompts >= 1, "1 or more"),
        ("steps", args.steps >= 1, "1 or more"),
        ("prompts_per_step", args.prompts_per_step >= 1, "1 or more"),
        ("num_generations", args.num_generations >= 1, "1 or more"),
        ("max_new_tokens", args.max_new_tokens >= 1, "1 or more"),
        ("max_prompt_tokens", args.max_prompt_tokens >= 1, "1 or more"),
        ("temperature", 0 < args.temperature < math.inf, "a positive number (1.0: the model as it is)"),
        ("top_p", 0 < args.top_p <= 1, "a number in (0, 1] (1.0: off)"),
        ("top_k", args.top_k >= 0, "0 (off) or a number of tokens"),
        ("rewards", len(args.rewards) >= 1, "at least one reward term"),
        ("rewards", "judge" not in args.rewards, "terms without `judge`: the generative judge (--judge-model) "
         "is train_grpo.py's; train_ppo.py takes rules, functions and a Bradley-Terry `rm`"),
        ("reward_weights", len(args.reward_weights) in (0, len(args.rewards)),
         f"one weight per --rewards term ({len(args.rewards)}), or none"),
        ("reward_model", (args.reward_model is None) == ("rm" not in args.rewards),
         "a reward model together with the `rm` term of --rewards (say both, or neither)"),
        ("reward_timeout_s", args.reward_timeout_s > 0, "a positive number of seconds"),
        ("code_timeout_s", args.code_timeout_s > 0, "a positive number of seconds"),
        ("code_memory_mb", args.code_memory_mb >= 32, "32 or more"),
        ("gamma", 0 <= args.gamma <= 1, "a number in [0, 1]"),
        ("lam", 0 <= args.lam <= 1, "a number in [0, 1]"),
        ("kl_coef", 0 <= args.kl_coef < math.inf, "0 (no KL term) or more"),
        ("kl_target", args.kl_target is None or 0 < args.kl_target < math.inf, "a positive KL, or none"),
        ("kl_target", args.kl_target is None or args.kl_coef > 0, "it adapts --kl-coef: give one above 0"),
        ("kl_horizon", args.kl_horizon >= 1, "1 or more completions"),
        ("lr", 0 < args.lr < math.inf, "a positive learning rate such as 3e-4"),
        ("critic_lr", 0 < args.critic_lr < math.inf, "a positive learning rate such as 1e-3"),
        ("warmup_steps", args.warmup_steps >= 0, "0 or more"),
        ("weight_decay", 0 <= args.weight_decay < math.inf, "0 or more"),
        ("max_grad_norm", 0 < args.max_grad_norm, "a positive norm"),
        ("max_skipped_steps", args.max_skipped_steps >= 0, "0 or more"),
        ("clip_low", 0 <= args.clip_low < 1, "a number in [0, 1)"),
        ("clip_high", 0 <= args.clip_high < math.inf, "0 or more"),
        ("value_clip", 0 < args.value_clip < math.inf, "a positive number"),
        ("minibatches", args.minibatches >= 1, "1 or more"),
        ("micro_batch_size", args.micro_batch_size >= 1, "1 or more"),
        ("rollout_ranks", args.rollout_ranks >= 0, "0 (colocate) or more"),
        ("sync_bucket_mb", 0 < args.sync_bucket_mb < math.inf, "a positive size in MiB"),
        ("sync_bucket_mb", args.sync_bucket_mb == 64.0 or args.placement == "disaggregate",
         "it only applies to --placement disaggregate (drop it)"),
        ("save_every", args.save_every >= 0, "0 (on SIGTERM only) or a number of steps"),
        ("keep_last", args.keep_last >= 1, "1 or more"),
        ("resume", args.resume in ("restart", "auto", "none") or checkpoint.is_complete(args.resume),
         "restart, auto, none or a complete checkpoint, run_dir/checkpoints/step_N (none is at that path)"),
        ("run_dir", not os.path.isfile(args.run_dir), "a directory (this is a file)"),
        ("save_hf_every", args.save_hf_every >= 0, "0 (off) or a number of steps"),
        ("timeout_s", 0 < args.timeout_s < math.inf, "a positive number of seconds"),
    ]
    for flag, holds, use in rules:
        if not holds:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: use {use}")
    if "accuracy" in args.rewards and args.answer_column is None:
        raise UserError("--rewards accuracy compares each completion with the row's answer: pass "
                        "--answer-column, or use other --rewards")
    layout = placement.check(args.placement, world, args.prompts_per_step, args.rollout_ranks,
                             args.max_staleness)
    rows = args.prompts_per_step // layout.dp * args.num_generations  # completions per trainer rank
    if rows % args.minibatches:
        raise UserError(f"--minibatches {args.minibatches} does not split the {rows} completions each "
                        f"trainer rank trains per step: use a divisor of {rows}")
    # hub ids (ORG/NAME) become their downloaded snapshot (computed at runtime)
    args.model = local_dir(args.model)
    if args.critic_model:
        args.critic_model = local_dir(args.critic_model, "--critic-model")
    if args.reward_model:
        args.reward_model = local_dir(args.reward_model, "--reward-model")
    for flag, path in (("model", args.model), ("critic_model", args.critic_model)):
        if path is None:
            continue
        try:
            read_config(path)
            check_checkpoint(path)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"--{flag.replace('_', '-')}: {e}") from None
    try:
        Tokenizer(args.model)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"--model: {e}") from None
    if args.reward_model:
        reward_model.check(args.reward_model, args.model)


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
    """GAE on the per-token reward (the score on the last token, -kl_coef * KL at each), whitened
    over all trainer ranks' tokens in the loss. Returns (adv, returns, kl) [N, T]."""
    mask = batch["loss_mask"]  # [N, T] completion tokens with a reward
    kl = torch.zeros_like(mask)  # [N, T]
    if "ref_logp" in batch:  # the sampling policy's KL to the reference, per token
        kl = algos.kl_estimate(batch["old_logp"], batch["ref_logp"], args.kl_estimator) * mask
    rewards = algos.token_rewards(scores.to(mask.device), kl, mask, kl_coef)  # [N, T]
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


def evaluate(engine, accuracy, rows, args, plan):
    """Held-out accuracy: one sample per prompt at the training temperature, seeded per prompt."""
    mine = rows[plan.rank::plan.dp]
    params = SamplingParams(1, args.temperature, args.top_p, args.top_k, args.max_new_tokens)
    seeds = [prompt_seed(args.seed, -1, plan.rank + i * plan.dp) for i in range(len(mine))]
    out = engine.generate([r["ids"] for r in mine], params, seeds)
    columns = {"answer": [r["answer"] for r in mine], "finish_reason": out.finish_reasons}
    correct = accuracy.score([r["prompt"] for r in mine], out.texts, columns)[0]
    total = dist.reduce({"correct": correct.sum(), "count": len(mine)}, group=plan.trainer_group)
    return total["correct"] / total["count"]


def eval_due(step: int, args, eval_rows) -> bool:
    if not args.eval_every or not eval_rows:
        return False
    return step % args.eval_every == 0 or step == args.steps


def log_step(log, step, metrics, args, plan, actor, engine, out, scores, batch, kl, kl_coef, train, sync,
             timer, skipped_steps, unscored_steps):
    """Reduce this step's numbers over the trainers (one sum, one max); rank 0 prints and writes them."""
    rewards, parts, failed = scores
    sums, maxes = train
    mask = batch["loss_mask"]  # [N, T]
    error = (batch["returns"] - batch["values"]) * mask  # [N, T] what the critic missed at rollout
    step_s = timer.elapsed()
    phases = placement.phase_metrics(plan, engine, timer.seconds, step_s)
    staleness = step - out.version
    parts = {f"reward/{name}": part[~failed].sum() for name, part in parts.items()}
    total = dist.reduce(group=plan.trainer_group, values={
        **sums, **parts, **phases, "reward": rewards.sum(), "failures": failed.sum(),
        "scored": (~failed).sum(), "len": out.lengths.sum(), "truncated": out.finish_reasons.count("length"),
        "staleness": staleness, "completions": len(rewards), "completion_tokens": mask.sum(),
        "kl_sum": kl.sum(), "values": (batch["values"] * mask).sum(), "returns": batch["returns"].sum(),
        "returns_sq": batch["returns"].square().sum(),
        "error": error.sum(), "error_sq": error.square().sum()})
    seconds = timer.seconds
    peak = dist.reduce(op=MAX, group=plan.trainer_group, values={
        **maxes, **sync, "gen_s": seconds["generate"], "ref_s": seconds.get("reference", 0.0),
        "rm_s": seconds.get("reward_model", 0.0), "values_s": seconds["values"],
        "train_s": seconds["train"], "critic_s": seconds["critic_train"],
        "mem_gib": dist.peak_memory_gib(plan.device),
        "mem_added_gib": dist.memory_added_gib(plan.device), "step_s": step_s, "staleness": staleness})
    if plan.rank != 0:
        return
    N, dp = total["completions"], plan.dp
    S = max(1.0, total["scored"])  # completions with a reward
    T = max(1.0, total["completion_tokens"])  # their tokens: what the losses see
    metrics.update({
        "rollout/reward": total["reward"] / S, "rollout/response_len": total["len"] / N,
        "rollout/truncated": total["truncated"] / N})
    for name in parts:
        metrics[f"rollout/{name}"] = total[name] / S
    # explained variance of the returns by the rollout values: 1 - Var(R - V) / Var(R), over the tokens
    var_returns = total["returns_sq"] / T - (total["returns"] / T) ** 2
    var_error = total["error_sq"] / T - (total["error"] / T) ** 2
    metrics.update({
        "reward/failures": total["failures"], "reward/unscored_steps": unscored_steps,
        "train/pg_loss": total.get("pg_loss", 0.0) / T, "train/kl": total["kl_sum"] / T,
        "train/kl_per_completion": total["kl_sum"] / S, "train/kl_coef": kl_coef,
        "train/clip_frac": total.get("clipped_tokens", 0.0) / T, "train/grad_norm": peak["grad_norm"],
        "train/value_loss": total.get("value_loss", 0.0) / T, "train/value_mean": total["values"] / T,
        "train/value_clip_frac": total.get("value_clipped", 0.0) / T,
        "train/explained_variance": 1 - var_error / var_returns if var_returns > 1e-12 else 0.0,
        "train/value_grad_norm": peak.get("value_grad_norm", 0.0),
        "train/lr": actor.sched.get_last_lr()[0], "train/skipped_steps": skipped_steps,
        "train/logprob_gap_mean": total["gap_sum"] / max(1.0, total["trained_tokens"]),
        "train/logprob_gap_max": peak["gap_max"], "train/rows_trained": total["rows"] / N,
        "perf/generate_s": peak["gen_s"], "perf/reference_s": peak["ref_s"],
        "perf/reward_model_s": peak["rm_s"], "perf/values_s": peak["values_s"],
        "perf/train_s": peak["train_s"],
        "perf/critic_train_s": peak["critic_s"], "perf/sync_s": peak["sync_s"],
        "perf/sync_bytes": peak["sync_bytes"], "perf/step_s": peak["step_s"],
        "perf/tokens_per_s": total["len"] / peak["step_s"], "perf/peak_mem_gib": peak["mem_gib"],
        "perf/peak_mem_added_gib": peak["mem_added_gib"],
        "perf/sync_gather_s": peak["sync_gather_s"]})
    for role in ("trainer_busy", "trainer_idle", "rollout_busy", "rollout_idle"):
        metrics[f"placement/{role}_s"] = total[role] / dp
    metrics.update({
        "placement/idle_share": total["device_idle"] / (plan.layout.world * peak["step_s"]),
        "placement/staleness_max": peak["staleness"], "placement/staleness_mean": total["staleness"] / dp})
    log.log(step, metrics)


if __name__ == "__main__":
    args = errors.cli(Args)
    errors.install()  # a UserError ends the run with one line, `error: ...` (RL_DEBUG=1: a traceback)
    check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    cfg, tok = read_config(args.model), Tokenizer(args.model)
    rank, world, device = dist.init(args.timeout_s)
    plan = placement.plan(args.placement, rank, world, device, args.prompts_per_step, args.rollout_ranks,
                          args.max_staleness, args.timeout_s)
    torch.manual_seed(args.seed)
    param_dtype = getattr(torch, args.param_dtype)
    max_len = args.max_prompt_tokens + args.max_new_tokens
    local_engine = partial(make_engine, args.engine, args.model, cfg, tok, device, param_dtype, max_len,
                           args.seed)
    if plan.role == "rollout":
        # disaggregate: this rank only generates, in its own loop (roles/rollout.py), until told to stop
        t = time.perf_counter()
        engine = placement.engine_for(plan, local_engine)
        if rank == plan.dp:  # the first rollout rank
            ready_s = time.perf_counter() - t
            print(f"rollout ranks: {type(engine).__name__}, ready in {ready_s:.0f}s", flush=True)
        serve(plan, engine)
        engine.close()
        dist.exit_now(0)

    # data: every rank tokenises the same rows and later takes its own slice of each step
    train_rows = load_rows(args.dataset, "train", args.prompt_column, args.answer_column)
    rows, skipped = tokenize_rows(train_rows, tok, args.max_prompt_tokens)
    held_out = eval_source(args.dataset, args.eval_dataset)
    eval_rows = []
    if held_out and args.eval_every:
        test_rows = load_rows(held_out, "test", args.prompt_column, args.answer_column)
        eval_rows = tokenize_rows(test_rows, tok, args.max_prompt_tokens)[0][:args.eval_prompts]

    # roles: on every trainer rank, the actor, the critic, the reference and the reward model shards
    decay_steps = args.steps if args.lr_schedule == "linear" else 0
    dist.mark_memory_start(device)  # what the models and steps add is measured from here
    if rank == 0:
        critic_dir = args.critic_model or args.model
        print(memory.for_run(args, cfg, plan.mode, plan.dp, plan.layout.rollout, device,
                             max(len(r["ids"]) for r in rows), len(eval_rows), critic_dir), flush=True)
    actor = Actor(args.model, plan.mesh, device, args.lr, args.warmup_steps, args.weight_decay,
                  args.max_grad_norm, param_dtype, args.temperature, args.micro_batch_size, decay_steps,
                  compile=args.compile)
    critic = Critic(args.critic_model or args.model, plan.mesh, device, args.critic_lr, args.warmup_steps,
                    args.weight_decay, args.max_grad_norm, args.value_clip, param_dtype,
                    args.micro_batch_size, decay_steps, compile=args.compile)
    ref = None
    if args.kl_coef > 0:
        ref = Reference(args.model, plan.mesh, device, param_dtype, args.temperature, args.micro_batch_size)
    rm = None
    if args.reward_model:
        rm = RewardModel(args.reward_model, plan.mesh, device, param_dtype, args.micro_batch_size)
    reward = Reward(args.rewards, args.reward_weights, args.reward_timeout_s, args.code_timeout_s,
                    args.code_memory_mb)
    accuracy = Reward(["accuracy"])  # the held-out metric
    engine = placement.engine_for(plan, local_engine, actor.weight_specs(), int(args.sync_bucket_mb * 2**20))
    sampling = SamplingParams(args.num_generations, args.temperature, args.top_p, args.top_k,
                              args.max_new_tokens)

    resumed = checkpoint.resume(args.run_dir, args.resume, actor, rank, critic)
    start = resumed["step"]  # steps already done
    kl_coef = resumed.get("kl_coef", args.kl_coef)  # the adaptive controller's state
    stop = {"sigterm": False}  # torchrun (or a scheduler) asks us to stop: save, then exit
    signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(sigterm=True))  # Ctrl-C: the same
    log = None
    if rank == 0:
        log = Logger(args.run_dir, asdict(args), args.steps, args.track, args.wandb_project, start)
        print(f"{world} rank(s), {args.placement} ({plan.dp} trainer(s)), {type(engine).__name__}; PPO; "
              f"model "
              f"{args.model} ({actor.config.num_params() / 1e6:.2f}M params), critic from "
              f"{args.critic_model or args.model}; {len(rows)} train prompts ({skipped} over "
              f"--max-prompt-tokens skipped), {len(eval_rows)} eval", flush=True)

    n = args.num_generations
    skipped_steps = 0  # NaN/inf gradients
    unscored_steps = 0  # every reward failed
    stopped = False  # some rank was asked to stop (SIGTERM)
    in_flight = {}  # step -> (this rank's rows, ticket): rollouts sent ahead of training
    submitted = start  # the next step whose prompts go out
    for step in range(start, args.steps + 1):  # the extra step only evaluates the final policy
        timer = Timer()
        metrics = {}
        # sync: the policy after `step` updates goes to the engine (the critic's weights never do)
        with timer("wait"):
            engine.collect()
        with timer("sync"):
            sync = placement.sync(plan, actor, engine, version=step)
        if eval_due(step, args, eval_rows):
            with timer("eval"):
                metrics["eval/accuracy"] = evaluate(engine, accuracy, eval_rows, args, plan)
        if step == args.steps:
            engine.release()
            if rank == 0:
                log.log(step - 1, {"final": True, **metrics})
            break

        # rollout: this rank's prompts only (and, with --max-staleness S, up to S steps ahead)
        with timer("generate"):
            while submitted <= min(step + args.max_staleness, args.steps - 1):
                ahead, seeds = step_prompts(rows, submitted, args.prompts_per_step, args.seed, rank, plan.dp)
                in_flight[submitted] = ahead, engine.submit([r["ids"] for r in ahead], sampling, seeds)
                submitted += 1
            local, ticket = in_flight.pop(step)
            out = engine.result(ticket)
        engine.release()
        prompt_ids = per_sample([r["ids"] for r in local], n)
        batch = make_batch(prompt_ids, out.tokens, out.lengths, tok.pad_id, device)
        batch["old_logp"] = out.logprobs.to(device)  # [N, T]

        # reward: this controller scores its own samples (the reward model on its token ids)
        rm_scores = None
        if rm:
            with timer("reward_model"):
                rm_scores = rm.score(batch)  # [N]
        with timer("reward"):
            columns = dataset_columns(local, n)  # answer and the rest, one value per completion
            columns["finish_reason"] = out.finish_reasons
            prompts = per_sample([r["prompt"] for r in local], n)
            # [N], {term: [N]}, [N]
            rewards, parts, failed = reward.score(prompts, out.texts, columns, rm_scores)
        batch["loss_mask"] = batch["loss_mask"] * (~failed)[:, None].to(device)  # [N, T]: no reward, no loss
        if ref:
            with timer("reference"):
                batch["ref_logp"] = ref.logprobs(batch)  # [N, T]
        with timer("values"):
            batch["values"] = critic.values(batch)  # [N, T]

        # advantages: GAE per token, the KL in the reward, whitened over the whole batch
        batch["adv"], batch["returns"], kl = advantages(batch, rewards, args, kl_coef, plan)

        # update: the actor's clipped surrogate, then the critic's clipped value loss, per minibatch
        train = update(actor, critic, batch, args, plan, timer)

        halt = dist.reduce({"skipped": train[1]["skipped"], "unscored": train[1]["unscored"],
                            "sigterm": stop["sigterm"]}, op=MAX, group=plan.trainer_group)
        skipped_steps += int(halt["skipped"])
        unscored_steps += int(halt["unscored"])
        log_step(log, step, metrics, args, plan, actor, engine, out, (rewards, parts, failed), batch, kl,
                 kl_coef, train, sync, timer, skipped_steps, unscored_steps)
        if args.kl_target is not None:  # Ziegler et al.'s controller, on the step's mean KL per completion
            seen = dist.reduce({"kl": kl.sum(), "n": (~failed).sum()}, group=plan.trainer_group)
            kl_coef = algos.adaptive_kl_coef(kl_coef, seen["kl"] / max(1.0, seen["n"]), args.kl_target,
                                             args.kl_horizon, int(seen["n"]))
        if skipped_steps > args.max_skipped_steps:
            raise UserError(f"stopping: {skipped_steps} steps had NaN/inf gradients (--max-skipped-steps "
                            f"{args.max_skipped_steps}); lower --lr or check the rewards and the data. "
                            f"{checkpoint.last_complete(args.run_dir)}")
        if unscored_steps > args.max_skipped_steps:
            raise UserError(f"stopping: in {unscored_steps} steps every reward failed (--max-skipped-steps "
                            f"{args.max_skipped_steps}); check --rewards {' '.join(args.rewards)}: "
                            f"{reward.last_failure()}. {checkpoint.last_complete(args.run_dir)}")
        if args.save_hf_every and (step + 1) % args.save_hf_every == 0:
            path = os.path.join(args.run_dir, "hf", f"step_{step + 1}")
            checkpoint.export_hf(actor, path, rank, args.model)
        save_due = args.save_every and (step + 1) % args.save_every == 0
        if halt["sigterm"] or save_due:
            checkpoint.save_and_report(args.run_dir, step + 1, actor, args.keep_last, rank, critic,
                                       extra={"kl_coef": kl_coef})
        if halt["sigterm"]:
            stopped = True
            break
    # `stopped` is the same on every rank (reduced), as it must be: the export is collective
    if args.save_final and not stopped:
        checkpoint.export_hf(actor, os.path.join(args.run_dir, "final"), rank, args.model)
    if rank == 0:
        final_dir = None
        if args.save_final and not stopped:
            final_dir = os.path.join(args.run_dir, "final")
        log.summary(final_dir, plot(args.run_dir))
        log.close()
    engine.close()  # before the process group: vLLM built its own groups on it
    dist.exit_now(0)
