"""GRPO with FSDP2 and parallel controllers.

    torchrun --standalone --nproc-per-node 2 train_grpo.py          # the built-in task, offline
    torchrun --standalone --nproc-per-node 3 train_grpo.py --placement disaggregate --rollout-ranks 1 \
        --max-staleness 1                                # 2 trainers + 1 rollout rank, overlapped

Every rank runs this same script and is the controller of its own share of each step's
prompts (G-Core's parallel controllers): it generates, scores and computes its groups'
advantages itself; no rank ever gathers the batch. Only FSDP2's collectives (weight
all-gather, gradient reduce-scatter), the weight sync and the metric reductions are
collective. With --placement disaggregate the rollout ranks run `roles.rollout.serve`
instead, and each trainer talks to its own rollout rank point to point.

The loss is `loss_fn` below; the step loop is at the bottom of the file.
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
from roles.actor import Actor
from roles.reference import Reference
from roles import judge as judge_role
from roles import reward_model
from roles.reward import Reward
from roles.reward_model import RewardModel
from roles.rollout import sample_and_stream, serve
from utils import algos, checkpoint, dist, errors, memory
from utils.data import (BUILTIN, PromptStream, Tokenizer, dataset_columns, eval_source, load_rows, make_batch,
                        micro_batches, per_sample, prompt_seed, step_prompts, tokenize_rows)
from utils.engines import SamplingParams, Samples, make_engine
from utils.errors import UserError
from utils.logger import Logger, Timer
from utils.model import check_checkpoint, local_dir, read_config
from utils.plot import plot

MAX = torch.distributed.ReduceOp.MAX
GROUP_BASELINES = ("grpo", "rloo", "reinforce++_baseline")  # advantage 0 when a group's rewards agree
# G-Core's dynamic-sampling constants (its DynamicSamplingRolloutGenerator's defaults): the running
# groups-per-informative-group ratio starts at 1, decays by 0.9 a step and is capped at 10
DS_INITIAL_EMA, DS_DECAY, DS_MAX_RATIO = 1.0, 0.9, 10.0


@dataclass
class Args:
    model: str = "assets/arith-tiny"
    """Hugging Face checkpoint: a local directory (config.json, *.safetensors, tokenizer.json) or a hub id
    (ORG/NAME, downloaded into the hub's cache; needs the network)"""
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
    steps: int = 800
    """optimizer steps (one rollout batch each)"""
    prompts_per_step: int = 64
    """prompts per step over all trainer ranks (each takes prompts_per_step / trainers)"""
    num_generations: int = 8
    """completions per prompt: the group of GRPO's group-relative advantage"""
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
    """reward terms: accuracy, format, code, rm (the --reward-model), or module:function
    (fn(prompts, completions, **columns))"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward term (default: all 1)"""
    reward_model: str | None = None
    """a Bradley-Terry reward model (a HF ...ForSequenceClassification checkpoint with the policy's
    tokenizer; train_rm.py trains one): the `rm` term of --rewards"""
    judge_model: str | None = None
    """a generative judge, any HF causal checkpoint (assets/judge-tiny for the built-in task): the `judge`
    term of --rewards, +1 for each verdict yes and -1 for no, averaged over --judge-samples"""
    judge_template: str | None = None
    """the judge's prompt, a str.format (or jinja) string or a file holding one, with the fields prompt,
    completion and any dataset column (default: roles.judge.DEFAULT_TEMPLATE, ending in 'Verification: Is
    the answer correct (Yes/No)?')"""
    judge_samples: int = 4
    """verdicts sampled per completion and averaged (G-Core's script: 8)"""
    judge_temperature: float = 0.7
    """the judge's sampling temperature (G-Core's: 0.7)"""
    judge_max_new_tokens: int = 4
    """the length limit of a verdict"""
    judge_chunk: int = 2
    """partial: prompts per chunk that a sampler streams to its judge as soon as they are generated"""
    reward_timeout_s: float = 60.0
    """a reward function call running longer scores 0 for its samples (counted in reward/failures)"""
    code_timeout_s: float = 5.0
    """the code reward's wall-clock limit per completion (sandboxed process)"""
    code_memory_mb: int = 512
    """the code reward's memory limit per completion"""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: the reward falls linearly by up to --overlong-penalty over the last
    this many tokens before --max-new-tokens (0: off)"""
    overlong_penalty: float = 1.0
    """DAPO's soft overlong penalty: the reward lost by a completion that reaches --max-new-tokens"""
    mask_truncated: bool = False
    """completions cut off at --max-new-tokens leave the loss (DAPO's overlong filtering)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling with G-Core's waves: a group whose rewards are all equal (no GRPO
    signal) is dropped, and each rank refills its own share in waves of ceil(gap * ema *
    --ds-oversampling) prompts until it holds its prompts-per-step / trainers informative groups or
    the refills run out; slots still empty are filled with dropped groups that leave the loss"""
    ds_oversampling: float = 1.2
    """dynamic sampling: draw this many times the prompts the running ratio says are needed"""
    ds_max_refills: int = 3
    """dynamic sampling: waves after the first, at most, per step"""
    advantage: Literal["grpo", "rloo", "reinforce++", "reinforce++_baseline", "remax"] = "grpo"
    """grpo: reward minus its group's mean, over the group's std (see --scale-std); rloo: minus the
    mean of the group's other samples; reinforce++: the KL to the reference in the per-token reward
    (not the loss), returns whitened over the whole batch; reinforce++_baseline: the group's mean
    subtracted first; remax: minus the reward of one greedy completion of the prompt"""
    scale_std: bool = True
    """grpo: divide group advantages by the group's reward std; off = Dr. GRPO (with --loss-agg constant)"""
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
    max_skipped_steps: int = 10
    """a step whose gradients are NaN/inf is skipped and counted; after this many the run stops"""
    clip_low: float = 0.2
    """PPO ratio clip below: 1 - clip_low"""
    clip_high: float = 0.28
    """PPO ratio clip above: 1 + clip_high (DAPO's clip-higher)"""
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
    """KL estimator (Schulman 2020)"""
    loss_agg: Literal["token", "sequence", "constant"] = "token"
    """token: every token weighs the same (DAPO); sequence: mean per completion first (GRPO); constant:
    each completion's sum over --max-new-tokens (Dr. GRPO)"""
    minibatches: int = 1
    """optimizer steps per rollout batch (>1: later ones are off-policy; the ratio and clip handle it)"""
    recompute_old_logp: bool = False
    """the trainer recomputes the old policy's log-probs before the update (decoupled PPO): the clip then
    acts on trainer/trainer ratios, and the engine's gap is left to --mismatch"""
    mismatch: Literal["none", "tis", "mis", "icepop"] = "none"
    """the trainer/engine log-prob mismatch, r = trainer-old / engine (implies --recompute-old-logp):
    tis: weight min(r, --mismatch-high) on each token's loss; mis: tokens (sequences) with r outside
    [--mismatch-low, --mismatch-high] leave the loss; icepop: weight r inside that range, 0 outside"""
    mismatch_level: Literal["token", "sequence", "geometric"] = "token"
    """r per token, per sequence (the product over its tokens) or their geometric mean"""
    mismatch_low: float = 0.5
    """mis, icepop: the lower bound on r"""
    mismatch_high: float = 2.0
    """tis: the truncation C; mis, icepop: the upper bound on r"""
    micro_batch_size: int = 256
    """completions per forward/backward on each rank (fewer FSDP gathers per step: 0.30 -> 0.22 s
    of training per step on the tiny default against 64; lower it for a large model's memory)"""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 MixedPrecisionPolicy param dtype (bf16 on GPU; gradients reduce in fp32)"""
    compile: bool = False
    """torch.compile each decoder block of the trained model(s) (torchtitan's per-block compile);
    the first steps pay the compile (see README: A compiled step)"""
    engine: Literal["auto", "native", "vllm"] = "auto"
    """generation engine: auto = vLLM on GPU when installed, else native (see README for vLLM on CPU)"""
    placement: Literal["colocate", "disaggregate", "partial"] = "colocate"
    """colocate: every rank trains and generates, taking turns; disaggregate: --rollout-ranks ranks
    only generate while the others only train; partial: every rank trains, and for the rollout the
    first --sampler-ranks sample while the others judge (--judge-model), at the same time"""
    sampler_ranks: int = 0
    """partial: the first S ranks generate with the policy, the other world - S run the judge"""
    rollout_ranks: int = 0
    """disaggregate: the last K ranks generate (each serves (world - K) / K trainers)"""
    max_staleness: int = 0
    """disaggregate: generate up to this many steps ahead while training, so samples are up to this
    many policy versions old (0: on-policy, the same run as colocate)"""
    sync_bucket_mb: float = 64.0
    """disaggregate: weights are gathered and broadcast to the rollout ranks in buckets of this size"""
    rebalance: bool = False
    """disaggregate: move ranks between training and generation as the run goes, when the measured
    busy seconds predict a faster split that pays for the move (placement.rebalance); a move saves a
    checkpoint and torchrun restarts the workers in the new layout: launch with --max-restarts (one
    per move, plus those for failures)"""
    rebalance_threshold: float = 0.1
    """--rebalance: move only to a split predicted faster by this share of a step"""
    rebalance_window: int = 10
    """--rebalance: the steps whose mean busy seconds a decision reads"""
    rebalance_gap: int = 20
    """--rebalance: steps at least between two moves (and from the start); the horizon a move must
    pay for itself in"""
    rebalance_force: tuple[int, int] | None = None
    """--rebalance, a test hook: STEP K moves to K rollout ranks after STEP steps, whatever the
    measurements say"""
    seed: int = 0
    """seeds init, data order and sampling (per prompt: results do not depend on the ranks)"""
    run_dir: str = "runs/grpo"
    """metrics.jsonl, config.json and the final model (final/, HF format) go here"""
    save_final: bool = True
    """write the trained policy as a HF checkpoint to run_dir/final at the end"""
    save_every: int = 50
    """save the sharded training state (DCP) every this many steps, and on SIGTERM (0: SIGTERM only)"""
    keep_last: int = 2
    """complete checkpoints to keep"""
    resume: str = "restart"
    """restart: continue from run_dir's newest complete checkpoint when torchrun restarted the job
    (--max-restarts), else start afresh; auto: continue from it whenever there is one; none; or a path"""
    save_hf_every: int = 0
    """also export a HF checkpoint (run_dir/hf/step_N) every this many steps (0: off)"""
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
        ("num_generations", args.num_generations >= 2, "2 or more: GRPO's advantage compares the samples of "
         "a prompt's group, and with 1 every advantage is 0, so nothing would train"),
        ("max_new_tokens", args.max_new_tokens >= 1, "1 or more"),
        ("max_prompt_tokens", args.max_prompt_tokens >= 1, "1 or more"),
        ("temperature", 0 < args.temperature < math.inf, "a positive number (1.0: the model as it is)"),
        ("top_p", 0 < args.top_p <= 1, "a number in (0, 1] (1.0: off)"),
        ("top_k", args.top_k >= 0, "0 (off) or a number of tokens"),
        ("rewards", len(args.rewards) >= 1, "at least one reward term"),
        ("reward_weights", len(args.reward_weights) in (0, len(args.rewards)),
         f"one weight per --rewards term ({len(args.rewards)}), or none"),
        ("reward_model", (args.reward_model is None) == ("rm" not in args.rewards),
         "a reward model together with the `rm` term of --rewards (say both, or neither)"),
        ("judge_model", (args.judge_model is None) == ("judge" not in args.rewards),
         "a judge together with the `judge` term of --rewards (say both, or neither)"),
        ("judge_model", args.judge_model is not None or args.placement != "partial",
         "a judge: --placement partial splits the policy's ranks between a sampler and a judge"),
        ("judge_samples", args.judge_samples >= 1, "1 or more"),
        ("judge_temperature", 0 <= args.judge_temperature < math.inf, "0 (greedy) or a positive number"),
        ("judge_max_new_tokens", args.judge_max_new_tokens >= 1, "1 or more"),
        ("judge_chunk", args.judge_chunk >= 1, "1 or more prompts"),
        ("reward_timeout_s", args.reward_timeout_s > 0, "a positive number of seconds"),
        ("code_timeout_s", args.code_timeout_s > 0, "a positive number of seconds"),
        ("code_memory_mb", args.code_memory_mb >= 32, "32 or more"),
        ("lr", 0 < args.lr < math.inf, "a positive learning rate such as 3e-4"),
        ("warmup_steps", args.warmup_steps >= 0, "0 or more"),
        ("weight_decay", 0 <= args.weight_decay < math.inf, "0 or more"),
        ("max_grad_norm", 0 < args.max_grad_norm, "a positive norm"),
        ("overlong_buffer", 0 <= args.overlong_buffer <= args.max_new_tokens,
         f"0 (off) or a number of tokens up to --max-new-tokens ({args.max_new_tokens})"),
        ("overlong_penalty", 0 <= args.overlong_penalty < math.inf, "0 or more"),
        ("advantage", args.advantage != "remax" or args.placement != "partial",
         "another advantage: remax's greedy baseline is not generated in partial placement"),
        ("dynamic_sampling", not args.dynamic_sampling or args.max_staleness == 0,
         "it decides each refill from the last wave's rewards, so it runs on-policy: drop --max-staleness"),
        ("dynamic_sampling", not args.dynamic_sampling or args.advantage in GROUP_BASELINES,
         f"it drops groups whose rewards are all equal, which carry no signal only under a group baseline "
         f"(grpo, rloo, reinforce++_baseline), not --advantage {args.advantage}; drop one of the two"),
        ("rebalance", not args.rebalance or args.placement == "disaggregate",
         "it moves ranks between trainers and rollout ranks: add --placement disaggregate "
         "--rollout-ranks K"),
        ("rebalance", not args.rebalance or not args.dynamic_sampling,
         "dynamic sampling keeps a prompt stream per trainer, which a move would split differently; "
         "drop one"),
        ("rebalance", not args.rebalance or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) >= 1,
         "a move restarts the workers in the new layout: launch with torchrun --max-restarts N (one per "
         "move you allow, plus those for failures)"),
        ("rebalance_threshold", 0 <= args.rebalance_threshold < 1,
         "a share of a step in [0, 1), such as 0.1"),
        ("rebalance_window", args.rebalance_window >= 1, "1 or more steps"),
        ("rebalance_gap", args.rebalance_gap >= args.rebalance_window,
         f"at least --rebalance-window ({args.rebalance_window}): a decision reads only steps since the "
         f"last move"),
        ("rebalance_force", args.rebalance_force is None or args.rebalance,
         "it forces a --rebalance move: add --rebalance"),
        ("ds_oversampling", 0 < args.ds_oversampling < math.inf, "a positive factor such as 1.2"),
        ("ds_max_refills", args.ds_max_refills >= 0, "0 (one wave) or more"),
        ("max_skipped_steps", args.max_skipped_steps >= 0, "0 or more"),
        ("clip_low", 0 <= args.clip_low < 1, "a number in [0, 1)"),
        ("clip_high", 0 <= args.clip_high < math.inf, "0 or more"),
        ("dual_clip_c", args.dual_clip_c > 1, "a bound above 1, such as 3"),
        ("gspo_clip_low", 0 <= args.gspo_clip_low < 1, "a number in [0, 1), such as 3e-4"),
        ("gspo_clip_high", 0 <= args.gspo_clip_high < math.inf, "0 or more, such as 4e-4"),
        ("kl_coef", 0 <= args.kl_coef < math.inf, "0 (no KL term) or more"),
        ("minibatches", args.minibatches >= 1, "1 or more"),
        ("micro_batch_size", args.micro_batch_size >= 1, "1 or more"),
        ("mismatch_low", 0 <= args.mismatch_low <= 1, "a number in [0, 1], such as 0.5"),
        ("mismatch_high", 1 <= args.mismatch_high < math.inf, "1 or more, such as 2"),
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
    # the placement's own checks (rollout ranks, staleness, the batch split) need only the world size
    layout = placement.check(args.placement, world, args.prompts_per_step, args.rollout_ranks,
                             args.max_staleness, args.sampler_ranks)
    rows = args.prompts_per_step // layout.dp * args.num_generations  # completions per trainer rank
    if args.rebalance_force:
        fits = [c.rollout for c in placement.splits(world, args.prompts_per_step, args.max_staleness)
                if c.rollout != layout.rollout]
        if args.rebalance_force[1] not in fits:
            step, k = args.rebalance_force
            raise UserError(f"--rebalance-force {step} {k}: a world of {world} can move from "
                            f"{layout.rollout} rollout ranks to {fits or 'none other'}")
    if rows % args.minibatches:
        raise UserError(f"--minibatches {args.minibatches} does not split the {rows} completions each "
                        f"trainer rank trains per step: use a divisor of {rows}")
    # hub ids (ORG/NAME) become their downloaded snapshot (computed at runtime)
    args.model = local_dir(args.model)
    if args.reward_model:
        args.reward_model = local_dir(args.reward_model, "--reward-model")
    if args.judge_model:
        args.judge_model = local_dir(args.judge_model, "--judge-model")
    try:
        read_config(args.model)
        Tokenizer(args.model)
        check_checkpoint(args.model)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"--model: {e}") from None
    if args.reward_model:
        reward_model.check(args.reward_model, args.model)
    if args.judge_model:
        judge_role.check(args.judge_model, args.judge_template)


def loss_fn(logp, batch, norm: float, args: Args):
    """GRPO's loss on one micro-batch (edit here to try another objective): the policy loss of
    --policy-loss against the old log-probs (by default PPO's clipped surrogate with DAPO's
    clip-higher), times the mismatch correction's weight if any, plus kl_coef times a KL estimate
    to the reference policy (unless REINFORCE++ put the KL in the reward), each summed over
    tokens and divided by `norm` (see `algos.aggregate`). logp [n, T]: the policy's log-probs of
    the completion tokens; batch: utils.data.Batch. Returns (loss, metric sums)."""
    mask, old, adv = batch["loss_mask"], batch["old_logp"], batch["adv"]  # [n, T] each
    if args.policy_loss == "ppo":
        pg, clipped = algos.clipped_surrogate(logp, old, adv, args.clip_low, args.clip_high)  # [n, T]
    elif args.policy_loss == "dual_clip":
        pg, clipped = algos.dual_clip_surrogate(logp, old, adv, args.clip_low, args.clip_high,
                                                args.dual_clip_c)
    elif args.policy_loss == "gspo":
        pg, clipped = algos.gspo_surrogate(logp, old, adv, mask, args.gspo_clip_low, args.gspo_clip_high)
    elif args.policy_loss == "cispo":
        pg, clipped = algos.cispo_loss(logp, old, adv, args.clip_low, args.clip_high)
    if "is_weight" in batch:  # --mismatch tis / icepop
        pg = pg * batch["is_weight"]  # [n, T]
    loss = algos.aggregate(pg, mask, args.loss_agg, norm, args.max_new_tokens)
    sums = {"pg_loss": (pg.detach() * mask).sum(), "clipped_tokens": (clipped & (mask > 0)).sum()}
    if args.kl_coef > 0 and not args.advantage.startswith("reinforce++"):
        kl = algos.kl_estimate(logp, batch["ref_logp"], args.kl_estimator)  # [n, T]
        loss = loss + args.kl_coef * algos.aggregate(kl, mask, args.loss_agg, norm, args.max_new_tokens)
        sums["kl"] = (kl.detach() * mask).sum()
    return loss, sums


def advantages(rewards, scored, batch, greedy, args, plan):
    """adv [N, T] by --advantage, from this rank's rewards and scored [N] (a sample without a reward
    gets 0); greedy [N / n]: remax's baseline, the reward of each prompt's greedy completion."""
    n, mask = args.num_generations, batch["loss_mask"]  # mask [N, T]
    device = mask.device
    if args.advantage == "grpo":
        adv = algos.group_advantages(rewards.view(-1, n), args.scale_std, scored=scored.view(-1, n))  # [G, n]
    elif args.advantage == "rloo":
        adv = algos.rloo_advantages(rewards.view(-1, n), scored.view(-1, n))  # [G, n]
    elif args.advantage == "remax":
        adv = (rewards - greedy.repeat_interleave(n)) * scored  # [N]
    if args.advantage in ("grpo", "rloo", "remax"):  # one advantage per completion, at each of its tokens
        return adv.reshape(-1, 1).to(device).expand_as(mask)
    # reinforce++: the KL to the reference in the per-token reward, returns whitened over all trainers
    baseline = None
    if args.advantage == "reinforce++_baseline":  # the group's mean over its scored samples, first
        kept = torch.where(scored, rewards, 0.0).view(-1, n)  # [G, n]
        mean = kept.sum(-1) / scored.view(-1, n).sum(-1).clamp(min=1)  # [G]
        baseline = mean.repeat_interleave(n).to(device)  # [N]
    kl = torch.zeros_like(mask)  # [N, T]
    if "ref_logp" in batch:
        kl = algos.kl_estimate(batch["old_logp"], batch["ref_logp"], args.kl_estimator) * mask
    returns = algos.reinforce_pp_returns(rewards.to(device), kl, mask, args.kl_coef, baseline)  # [N, T]
    moments = torch.stack(algos.masked_moments(returns, mask))  # [3]: sum, sum of squares, count
    torch.distributed.all_reduce(moments, group=plan.trainer_group)
    return algos.whiten(returns, mask, *moments)


def mismatch(actor, batch, args):
    """--recompute-old-logp / --mismatch: the trainer's old log-probs replace the engine's as the
    ratio's denominator (the engine's kept as engine_logp), and the correction's weight and mask
    go into the batch. Returns its metric sums and maxima (none without --mismatch)."""
    batch["engine_logp"] = batch["old_logp"]
    batch["old_logp"] = actor.logprobs(batch)  # [N, T]
    if args.mismatch == "none":
        return {}, {}
    mask = batch["loss_mask"]  # [N, T]
    weight, kept, r = algos.mismatch_weights(batch["old_logp"], batch["engine_logp"], mask, args.mismatch,
                                             args.mismatch_level, args.mismatch_low, args.mismatch_high)
    batch["is_weight"], batch["loss_mask"] = weight, kept  # [N, T]
    if args.mismatch == "tis":
        touched = r > args.mismatch_high  # [N, T] truncated
    else:
        touched = (r < args.mismatch_low) | (r > args.mismatch_high)  # [N, T] masked (mis) or zeroed (icepop)
    touched = touched & (mask > 0)
    kl = algos.kl_estimate(batch["engine_logp"], batch["old_logp"], "k3") * mask  # KL(engine || trainer)
    sums = {"mismatch_kl": kl.sum(), "mismatch_tokens": touched.sum(), "mismatch_seqs": touched.any(-1).sum(),
            "mismatch_weight": (weight * mask).sum(), "mismatch_count": mask.sum(),
            "mismatch_rows": (mask.sum(-1) > 0).sum()}
    return sums, {"mismatch_weight_max": (weight * mask).max()}


def update(actor, batch, args, plan):
    """--minibatches optimizer steps on this rank's batch. Each minibatch's loss is normalised by
    its token (or completion) count over all trainer ranks, so that FSDP's gradient average is
    the mean over the whole minibatch. Returns the steps' metric sums and maxima."""
    size = len(batch["adv"]) // args.minibatches  # rows per minibatch (check_args: it divides)
    minis = list(micro_batches(batch, size))
    counts = []
    for mini in minis:
        if args.loss_agg == "token":
            counts.append(float(mini["loss_mask"].sum()))
        else:
            counts.append(float((mini["loss_mask"].sum(-1) > 0).sum()))  # completions in the loss
    counts = torch.tensor(counts, dtype=torch.float64)
    torch.distributed.all_reduce(counts, group=plan.trainer_group)
    # the zero-advantage row skip is exact only while every loss term is proportional to the
    # advantage: the KL term in the loss is not (REINFORCE++ puts it in the reward)
    skip = args.kl_coef == 0 or args.advantage.startswith("reinforce++")
    sums, maxes = {}, {}
    for mini, count in zip(minis, counts.tolist()):
        s, m = actor.train_step(mini, partial(loss_fn, args=args), count / plan.dp, skip_zero_adv_rows=skip)
        for k, v in s.items():
            sums[k] = sums.get(k, 0) + v
        for k, v in m.items():
            maxes[k] = torch.maximum(torch.as_tensor(maxes.get(k, v)), torch.as_tensor(v))
    return sums, maxes


def evaluate(engine, accuracy, rows, args, plan):
    """Held-out accuracy: one sample per prompt at the training temperature, seeded per prompt
    (by its position: the same on any rank). partial: the sampler ranks generate them all."""
    ranks = plan.dp
    if plan.mode == "partial":
        ranks = plan.layout.sampler
    mine = []
    if plan.rank < ranks:
        mine = rows[plan.rank::ranks]
    params = SamplingParams(1, args.temperature, args.top_p, args.top_k, args.max_new_tokens)
    seeds = [prompt_seed(args.seed, -1, plan.rank + i * ranks) for i in range(len(mine))]
    out = Samples.empty()
    if mine:
        out = engine.generate([r["ids"] for r in mine], params, seeds)
    columns = {"answer": [r["answer"] for r in mine], "finish_reason": out.finish_reasons}
    correct = accuracy.score([r["prompt"] for r in mine], out.texts, columns)[0]
    total = dist.reduce({"correct": correct.sum(), "count": len(mine)}, group=plan.trainer_group)
    return total["correct"] / total["count"]


def greedy_rewards(engine, rows, scorer, step, args, plan, timer):
    """ReMax's baseline: one greedy completion per prompt of this rank, scored like the samples.
    Returns (rewards [G], failed [G] bool)."""
    params = SamplingParams(1, 0.0, 1.0, 0, args.max_new_tokens)
    seeds = [prompt_seed(args.seed, step, plan.rank + i * plan.dp) for i in range(len(rows))]
    with timer("generate"):
        out = engine.generate([r["ids"] for r in rows], params, seeds)
    rewards, parts, failed = scorer(rows, seeds, out, None, 1, timer)
    return rewards, failed


def rollout(engine, judge, rows, seeds, sampling, args, plan, timer, tally):
    """This rank's samples of its own prompts (`rows`, `seeds`: one per prompt), and with
    --placement partial their judge scores [N] too, made on the way: this rank's sampler
    generates them while the judge ranks judge finished chunks (else None: `score` judges)."""
    with timer("generate"):
        if plan.mode != "partial":
            return engine.generate([r["ids"] for r in rows], sampling, seeds), None
        if plan.sampler:
            out, judged, busy = sample_and_stream(plan, engine, rows, seeds, sampling, args.judge_chunk)
            tally["sampler_busy"] += busy
        else:
            out, judged, busy, count, unparsed = judge_role.judge_stream(plan, judge, rows, seeds,
                                                                        args.num_generations)
            tally["judge_busy"] += busy
            tally["judge_unparsed"] += unparsed
            tally["judge_verdicts"] += args.judge_samples * count
    return out, judged


def score(rows, seeds, out, judged, n, timer, tally, reward, rm, judge, tok, args, plan):
    """This controller's rewards of its own samples (`rows`, `seeds`: one per prompt, `out`: n
    samples each): the reward model on their token ids, the judge on their text (unless the
    partial placement judged them already: `judged` [N]), then the reward terms, plus DAPO's
    overlong penalty. Returns (rewards [N], {term: [N]}, failed [N] bool: no reward)."""
    if judge and judged is None:
        with timer("judge"):
            judge.load()
            judged, unparsed = judge_role.judge_chunk(judge, rows, seeds, out, n)  # [N]
            judge.release()
        tally["judge_unparsed"] += unparsed
        tally["judge_verdicts"] += args.judge_samples * len(out.texts)
    rm_scores = None
    if rm:
        with timer("reward_model"):
            batch = make_batch(per_sample([r["ids"] for r in rows], n), out.tokens, out.lengths, tok.pad_id,
                               plan.device)
            rm_scores = rm.score(batch)  # [N]
    with timer("reward"):
        columns = dataset_columns(rows, n)  # answer and the rest, one value per completion
        columns["finish_reason"] = out.finish_reasons
        prompts = per_sample([r["prompt"] for r in rows], n)
        # [N], {term: [N]}, [N]
        rewards, parts, failed = reward.score(prompts, out.texts, columns, rm_scores, judged)
        if args.overlong_buffer:  # DAPO: a soft penalty for running into the length limit
            penalty = algos.overlong_penalty(out.lengths, args.max_new_tokens, args.overlong_buffer,
                                             args.overlong_penalty)  # [N]
            parts["overlong"] = penalty * ~failed
            rewards = rewards + parts["overlong"]
    return rewards, parts, failed


def dynamic_sampling(step, rows, stream, ema, generate, scorer, args, plan, timer, metrics):
    """DAPO's dynamic sampling in G-Core's waves, on this rank's own share (no rank gathers the
    batch). Each wave draws ceil(gap * ema * --ds-oversampling) prompts for this rank's `gap`
    missing informative groups (rewards not all equal), from `stream` (prompts put back first);
    the waves go on while any rank has a gap (one max-reduce a wave), at most 1 + --ds-max-refills
    of them, so every rank runs the same number; a rank without a gap sends an empty wave. Slots
    still empty are filled with uninformative groups, `padded`, which leave the loss: every rank
    trains prompts_per_step / trainers groups. Informative groups beyond the target put their
    prompt back. Samples are seeded per (seed, step, wave, position in the wave).
    Returns (rows, Samples, (rewards, parts, failed), padded [N] bool, the next ema); the counts
    (summed over the trainers, as the ema's update needs) go into `metrics`."""
    n, target = args.num_generations, args.prompts_per_step // plan.dp
    drawn, outs, scores = [], [], []  # per wave: row indices, Samples, (rewards, parts, failed)
    informative = []  # per group drawn, in order
    waves = 0
    for wave in range(1 + args.ds_max_refills):
        gap = target - min(target, sum(informative))
        if dist.reduce({"gap": gap}, op=MAX, group=plan.trainer_group)["gap"] == 0:
            break
        picked = stream.take(algos.wave_size(gap, ema, args.ds_oversampling))
        wave_rows = [rows[i] for i in picked]
        seeds = [prompt_seed(args.seed, step, plan.rank + i * plan.dp, wave) for i in range(len(picked))]
        out, judged = generate(wave_rows, seeds)
        waves += 1
        if not picked:  # this rank's share is full: it only took part (a remote engine expects every rank)
            continue
        rewards, parts, failed = scorer(wave_rows, seeds, out, judged, n, timer)  # [k * n] each
        informative += algos.informative_groups(rewards.view(-1, n), (~failed).view(-1, n)).tolist()
        drawn.append(picked)
        outs.append(out)
        scores.append((rewards, parts, failed))
    # the step's groups: informative ones first (in draw order) up to the target, then padding
    flat = [i for picked in drawn for i in picked]
    good = [g for g, ok in enumerate(informative) if ok]
    bad = [g for g, ok in enumerate(informative) if not ok]
    chosen = good[:target] + bad[:target - len(good[:target])]
    stream.put_back([flat[g] for g in good[target:]])
    out = Samples.cat(outs)
    sample_rows = [g * n + j for g in chosen for j in range(n)]
    rewards = torch.cat([r for r, _, _ in scores])[sample_rows]
    failed = torch.cat([f for _, _, f in scores])[sample_rows]
    parts = {}
    for name in scores[0][1]:
        parts[name] = torch.cat([p[name] for _, p, _ in scores])[sample_rows]
    padded = torch.tensor([not informative[g] for g in chosen]).repeat_interleave(n)  # [N]
    kept_tokens = out.lengths[sample_rows][~padded].sum()
    counts = dist.reduce(group=plan.trainer_group, values={
        "generated": len(informative), "informative": sum(informative), "kept": len(good[:target]),
        "padded": int(padded.sum()) // n, "unused_tokens": out.lengths.sum() - kept_tokens})
    ema = algos.sampling_ema(ema, counts["generated"], counts["informative"], DS_DECAY, DS_MAX_RATIO)
    metrics.update({
        "rollout/ds_waves": waves, "rollout/ds_groups_generated": counts["generated"],
        "rollout/ds_groups_informative": counts["informative"], "rollout/ds_groups_kept": counts["kept"],
        "rollout/ds_groups_padded": counts["padded"], "rollout/ds_unused_tokens": counts["unused_tokens"],
        "rollout/ds_ema": ema})
    return [rows[flat[g]] for g in chosen], out.take(sample_rows), (rewards, parts, failed), padded, ema


def eval_due(step: int, args, eval_rows) -> bool:
    if not args.eval_every or not eval_rows:
        return False
    return step % args.eval_every == 0 or step == args.steps


def log_step(log, step, metrics, args, plan, actor, engine, out, scores, batch, train, sync, timer, tally,
             skipped_steps, unscored_steps):
    """Reduce this step's numbers over the trainers (one sum, one max); rank 0 prints and writes them."""
    rewards, parts, failed = scores
    sums, maxes = train
    n = args.num_generations
    groups = rewards.view(-1, n)  # [prompts, n]
    all_same = (groups.max(-1).values == groups.min(-1).values).sum()
    step_s = timer.elapsed()
    phases = placement.phase_metrics(plan, engine, timer.seconds, step_s, tally)
    staleness = step - out.version
    parts = {f"reward/{name}": part[~failed].sum() for name, part in parts.items()}
    total = dist.reduce(group=plan.trainer_group, values={
        **sums, **parts, **phases, "reward": rewards.sum(), "failures": failed.sum(),
        "scored": (~failed).sum(), "len": out.lengths.sum(), "truncated": out.finish_reasons.count("length"),
        "all_same": all_same, "staleness": staleness, "completions": len(rewards),
        "completion_tokens": batch["loss_mask"].sum(), "judge_unparsed": tally["judge_unparsed"],
        "judge_verdicts": tally["judge_verdicts"]})
    seconds = timer.seconds
    judge_s = seconds.get("judge", 0.0)
    peak = dist.reduce(op=MAX, group=plan.trainer_group, values={
        **maxes, **sync, "gen_s": seconds["generate"], "judge_s": judge_s,
        "rollout_judge_s": seconds["generate"] + judge_s, "ref_s": seconds.get("reference", 0.0),
        "rm_s": seconds.get("reward_model", 0.0), "old_logp_s": seconds.get("old_logp", 0.0),
        "train_s": seconds["train"], "mem_gib": dist.peak_memory_gib(plan.device),
        "mem_added_gib": dist.memory_added_gib(plan.device), "step_s": step_s,
        "staleness": staleness})
    # what --rebalance reads, the same on every trainer: each role's busy seconds per rank
    entry = {"trainer_busy": total["trainer_busy"] / plan.dp, "rollout_busy": total["rollout_busy"] / plan.dp,
             "step_s": peak["step_s"]}
    if plan.rank != 0:
        return entry
    N, dp = total["completions"], plan.dp
    S = max(1.0, total["scored"])  # completions with a reward
    T = max(1.0, total["completion_tokens"])  # their tokens: what the loss sees
    metrics.update({
        "rollout/reward": total["reward"] / S, "rollout/response_len": total["len"] / N,
        "rollout/truncated": total["truncated"] / N, "rollout/groups_all_same": total["all_same"] / (N / n)})
    for name in parts:
        metrics[f"rollout/{name}"] = total[name] / S
    metrics.update({
        "reward/failures": total["failures"], "reward/unscored_steps": unscored_steps,
        "train/pg_loss": total.get("pg_loss", 0.0) / T, "train/kl": total.get("kl", 0.0) / T,
        "train/clip_frac": total.get("clipped_tokens", 0.0) / T, "train/grad_norm": peak["grad_norm"],
        "train/lr": actor.sched.get_last_lr()[0], "train/skipped_steps": skipped_steps,
        "train/logprob_gap_mean": total["gap_sum"] / max(1.0, total["trained_tokens"]),
        "train/logprob_gap_max": peak["gap_max"],
        # the rest had advantage 0 (and no KL term): not run
        "train/rows_trained": total["rows"] / N,
        "perf/generate_s": peak["gen_s"], "perf/reference_s": peak["ref_s"],
        "perf/reward_model_s": peak["rm_s"], "perf/old_logp_s": peak["old_logp_s"],
        "perf/train_s": peak["train_s"],
        "perf/sync_s": peak["sync_s"], "perf/sync_bytes": peak["sync_bytes"], "perf/step_s": peak["step_s"],
        "perf/tokens_per_s": total["len"] / peak["step_s"], "perf/peak_mem_gib": peak["mem_gib"],
        "perf/peak_mem_added_gib": peak["mem_added_gib"],
        "perf/sync_gather_s": peak["sync_gather_s"]})
    if args.judge_model:  # the judge: verdicts that did not parse (they count 0), and its time
        metrics.update({
            "reward/judge_unparsed": total["judge_unparsed"],
            "reward/judge_unparsed_share": total["judge_unparsed"] / max(1.0, total["judge_verdicts"]),
            "perf/judge_s": peak["judge_s"], "perf/rollout_judge_s": peak["rollout_judge_s"]})
    if "mismatch_kl" in total:  # --mismatch: how far the engine is from the trainer, what it corrected
        count, rows = max(1.0, total["mismatch_count"]), max(1.0, total["mismatch_rows"])
        metrics.update({
            "train/mismatch_kl": total["mismatch_kl"] / count,
            "train/mismatch_token_share": total["mismatch_tokens"] / count,
            "train/mismatch_seq_share": total["mismatch_seqs"] / rows,
            "train/mismatch_weight_mean": total["mismatch_weight"] / count,
            "train/mismatch_weight_max": peak["mismatch_weight_max"]})
    # per role, mean over the trainer ranks (rollout: over the rollout ranks serving them)
    for role in ("trainer_busy", "trainer_idle", "rollout_busy", "rollout_idle"):
        metrics[f"placement/{role}_s"] = total[role] / dp
    if plan.mode == "partial":  # per sampler rank and per judge rank
        for role in ("sampler_busy", "sampler_idle"):
            metrics[f"placement/{role}_s"] = total[role] / plan.layout.sampler
        for role in ("judge_busy", "judge_idle"):
            metrics[f"placement/{role}_s"] = total[role] / plan.layout.judge
    metrics.update({
        "placement/idle_share": total["device_idle"] / (plan.layout.world * peak["step_s"]),
        "placement/staleness_max": peak["staleness"], "placement/staleness_mean": total["staleness"] / dp})
    log.log(step, metrics)
    return entry


def rebalance_start(args, plan, actor, moved: dict, start: int, launched: float, log) -> float:
    """--rebalance, before the first step: the seconds a move costs (the last move's, measured from
    its decision to here; before any, this launch's start-up), the same on every trainer. Right
    after a move, the training state must be the one it left with, exactly (a digest of it)."""
    last = moved["moves"][-1] if moved else None
    since = last["at"] if last else launched
    cost_s = dist.reduce({"s": time.time() - since}, op=MAX, group=plan.trainer_group)["s"]
    if last and last["step"] == start:
        if checkpoint.digest(actor) != last["digest"]:
            raise RuntimeError(f"the move after step {start} did not carry the training state exactly (its "
                               f"digest differs): a bug; {checkpoint.last_complete(args.run_dir)}")
        if plan.rank == 0:
            log.log(start - 1, {"event": "placement/moved", "placement/move_s": cost_s,
                                "placement/move_state_equal": 1.0,
                                "placement/rollout_ranks": plan.layout.rollout})
    return cost_s


def rebalance_move(step: int, move, args, plan, actor, ema, stream, log, cost_s: float) -> bool:
    """The move after `step`: a checkpoint, then rank 0 writes the new layout (run_dir/placement.json)
    and logs why; every rank then stops and torchrun restarts them in it. False (no move) when the
    checkpoint failed: the run goes on as it was."""
    record = {"step": step + 1, "at": time.time(), "from": plan.layout.rollout, "to": move.layout.rollout,
              "why": move.why, "step_s": move.step_s, "predicted_s": move.predicted_s, "gain_s": move.gain_s,
              "cost_s": cost_s, "digest": checkpoint.digest(actor)}
    saved = checkpoint.save(args.run_dir, step + 1, actor, args.keep_last, plan.rank, extra={"ds_ema": ema},
                            rank_state={"stream": stream.state()})
    if saved["path"] is None:
        if plan.rank == 0:
            print(f"rebalance after step {step + 1}: {move.why}; not moving: the checkpoint failed "
                  f"({saved['error']})", flush=True)
        return False
    if plan.rank == 0:
        placement.record_move(args.run_dir, record)
        log.log(step, {"event": "placement/rebalance", "placement/rebalance_why": move.why,
                       "placement/rebalance_from": record["from"],
                       "placement/rebalance_to": record["to"], "placement/rebalance_step_s": move.step_s,
                       "placement/rebalance_predicted_s": move.predicted_s,
                       "placement/rebalance_gain_s": move.gain_s, "placement/rebalance_cost_s": cost_s})
    torch.distributed.barrier(group=plan.trainer_group)  # the new layout is on disk before any rank leaves
    return True


def decide_move(step: int, args, plan, window: list[dict], since_move: int, cost_s: float) -> placement.Move:
    """--rebalance after `step` (0-based): placement.rebalance over the splits this run accepts
    (check's, whose trainers can also split the minibatches), or --rebalance-force's."""
    fits = [c for c in placement.splits(plan.layout.world, args.prompts_per_step, args.max_staleness)
            if args.prompts_per_step // c.dp * args.num_generations % args.minibatches == 0]
    if args.rebalance_force and args.rebalance_force[0] == step + 1:
        to = next(c for c in fits if c.rollout == args.rebalance_force[1])
        return placement.Move(to, f"{plan.layout.rollout} -> {to.rollout} rollout ranks: forced "
                                  f"(--rebalance-force)", window[-1]["step_s"], window[-1]["step_s"])
    horizon = min(args.rebalance_gap, args.steps - step - 1)
    return placement.rebalance(window[-args.rebalance_window:], plan.layout, fits, args.max_staleness, cost_s,
                               horizon, args.rebalance_threshold, since_move, args.rebalance_gap)


if __name__ == "__main__":
    launched = time.time()
    args = errors.cli(Args)
    errors.install()  # a UserError ends the run with one line, `error: ...` (RL_DEBUG=1: a traceback)
    check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    moved = placement.moves(args.run_dir) if args.rebalance and (restarted or args.resume == "auto") else {}
    if moved:  # --rebalance moved the ranks: this launch resumes in the layout it moved to
        args.rollout_ranks = moved["rollout_ranks"]
    cfg, tok = read_config(args.model), Tokenizer(args.model)
    rank, world, device = dist.init(args.timeout_s)
    plan = placement.plan(args.placement, rank, world, device, args.prompts_per_step, args.rollout_ranks,
                          args.max_staleness, args.timeout_s, args.sampler_ranks)
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

    # roles
    dist.mark_memory_start(device)  # what the models and steps add is measured from here
    if rank == 0:
        print(memory.for_run(args, cfg, plan.mode, plan.dp, plan.layout.rollout, device,
                             max(len(r["ids"]) for r in rows), len(eval_rows)), flush=True)
    actor = Actor(args.model, plan.mesh, device, args.lr, args.warmup_steps, args.weight_decay,
                  args.max_grad_norm, param_dtype, args.temperature, args.micro_batch_size,
                  decay_steps=args.steps if args.lr_schedule == "linear" else 0, compile=args.compile)
    ref = None
    if args.kl_coef > 0:
        ref = Reference(args.model, plan.mesh, device, param_dtype, args.temperature, args.micro_batch_size)
    rm = None
    if args.reward_model:
        rm = RewardModel(args.reward_model, plan.mesh, device, param_dtype, args.micro_batch_size)
    reward = Reward(args.rewards, args.reward_weights, args.reward_timeout_s, args.code_timeout_s,
                    args.code_memory_mb)
    accuracy = Reward(["accuracy"])  # the held-out metric
    judge = None  # partial: only the judge ranks hold it
    if args.judge_model and (plan.mode != "partial" or not plan.sampler):
        judge_len = max_len + 512 + args.judge_max_new_tokens  # the template's own words: under 512 tokens
        judge = judge_role.make_judge(args.judge_model, args.engine, device, param_dtype, judge_len,
                                      args.seed, args.judge_template, args.judge_samples,
                                      args.judge_temperature, args.judge_max_new_tokens, args.reward_timeout_s)
        judge_role.check_template(judge.template, [*dataset_columns(rows[:1], 1), "finish_reason"])
    engine = placement.engine_for(plan, local_engine, actor.weight_specs(), int(args.sync_bucket_mb * 2**20))
    sampling = SamplingParams(args.num_generations, args.temperature, args.top_p, args.top_k,
                              args.max_new_tokens)

    scorer = partial(score, reward=reward, rm=rm, judge=judge, tok=tok, args=args, plan=plan)
    resumed = checkpoint.resume(args.run_dir, args.resume, actor, rank)
    start = resumed["step"]  # steps already done
    # dynamic sampling: this rank's own prompt stream and the running ratio, carried by checkpoints
    stream = PromptStream(len(rows), args.seed, rank, plan.dp)
    if "stream" in resumed.get("rank_state", {}):
        stream.load(resumed["rank_state"]["stream"])
    ema = resumed.get("ds_ema", DS_INITIAL_EMA)
    stop = {"sigterm": False}  # torchrun (or a scheduler) asks us to stop: save, then exit
    signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(sigterm=True))  # Ctrl-C: the same
    log = None
    if rank == 0:
        log = Logger(args.run_dir, asdict(args), args.steps, args.track, args.wandb_project, start)
        print(f"{world} rank(s), {args.placement} ({plan.dp} trainer(s)), {type(engine).__name__}; model "
              f"{args.model} ({actor.config.num_params() / 1e6:.2f}M params); {len(rows)} train prompts "
              f"({skipped} over --max-prompt-tokens skipped), {len(eval_rows)} eval", flush=True)

    n = args.num_generations
    skipped_steps = 0  # NaN/inf gradients
    unscored_steps = 0  # every reward failed
    stopped = False  # some rank was asked to stop (SIGTERM)
    in_flight = {}  # step -> (this rank's rows, ticket): rollouts sent ahead of training
    submitted = start  # the next step whose prompts go out
    window, since_move, moving, move_cost_s, warned_restarts = [], 0, False, 0.0, False  # --rebalance
    if args.rebalance:
        move_cost_s = rebalance_start(args, plan, actor, moved, start, launched, log)
    for step in range(start, args.steps + 1):  # the extra step only evaluates the final policy
        timer = Timer()
        metrics = {}
        # sync: the policy after `step` updates goes to this rank's engine (colocate) or is
        # broadcast to the rollout ranks (disaggregate) once they have answered every request
        # sent ahead (they serve in order)
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

        # rollout and reward: this controller's own prompts only, scored by itself (the reward
        # model on their token ids). With --max-staleness S the prompts of up to S steps ahead go
        # out too, so that the rollout ranks generate them while this rank trains; their samples
        # are then up to S versions old, and the ratio to the engine's log-probs corrects it.
        # --dynamic-sampling instead generates and scores in waves until the groups are informative
        padded = torch.zeros(args.prompts_per_step // plan.dp * n, dtype=torch.bool)  # [N]
        tally = {"sampler_busy": 0.0, "judge_busy": 0.0, "judge_unparsed": 0, "judge_verdicts": 0}
        generate = partial(rollout, engine, judge, sampling=sampling, args=args, plan=plan, timer=timer,
                           tally=tally)
        score_with = partial(scorer, tally=tally)
        if args.dynamic_sampling:
            local, out, (rewards, parts, failed), padded, ema = dynamic_sampling(
                step, rows, stream, ema, generate, score_with, args, plan, timer, metrics)
        elif plan.mode == "partial":
            local, seeds = step_prompts(rows, step, args.prompts_per_step, args.seed, rank, plan.dp)
            out, judged = generate(local, seeds)
            rewards, parts, failed = score_with(local, seeds, out, judged, n, timer)
        else:
            with timer("generate"):
                while submitted <= min(step + args.max_staleness, args.steps - 1):
                    ahead, seeds = step_prompts(rows, submitted, args.prompts_per_step, args.seed, rank,
                                                plan.dp)
                    ticket = engine.submit([r["ids"] for r in ahead], sampling, seeds)
                    in_flight[submitted] = ahead, seeds, ticket
                    submitted += 1
                local, seeds, ticket = in_flight.pop(step)
                out = engine.result(ticket)
            rewards, parts, failed = score_with(local, seeds, out, None, n, timer)  # [N], {term: [N]}, [N]
        greedy = None
        if args.advantage == "remax":  # the baseline: the reward of each prompt's greedy completion
            greedy, greedy_failed = greedy_rewards(engine, local, score_with, step, args, plan, timer)
        engine.release()
        prompt_ids = per_sample([r["ids"] for r in local], n)
        batch = make_batch(prompt_ids, out.tokens, out.lengths, tok.pad_id, device)
        scored = ~failed  # [N]
        if args.advantage == "remax":
            scored = scored & ~greedy_failed.repeat_interleave(n)  # no baseline, no advantage

        # a sample without a reward (or, with --mask-truncated, cut off at the length limit, or a
        # dynamic-sampling padding group) is left out of the loss
        keep = scored & ~padded
        if args.mask_truncated:
            keep = keep & torch.tensor([r != "length" for r in out.finish_reasons])
        batch["loss_mask"] = batch["loss_mask"] * keep[:, None].to(device)  # [N, T]
        batch["old_logp"] = out.logprobs.to(device)  # [N, T]
        if ref:
            with timer("reference"):
                batch["ref_logp"] = ref.logprobs(batch)  # [N, T]

        # advantages, by --advantage (GRPO: group-relative over the samples that have a reward, one
        # per completion, the same for each of its tokens)
        batch["adv"] = advantages(rewards, scored, batch, greedy, args, plan)  # [N, T]

        # update (with --recompute-old-logp / --mismatch, the trainer's old log-probs first)
        corrections = {}, {}
        if args.recompute_old_logp or args.mismatch != "none":
            with timer("old_logp"):
                corrections = mismatch(actor, batch, args)
        with timer("train"):
            train = update(actor, batch, args, plan)
        train[0].update(corrections[0])
        train[1].update(corrections[1])

        # log, then stop together: skipped steps and SIGTERM are agreed over the trainers
        halt = dist.reduce({"skipped": train[1]["skipped"], "unscored": train[1]["unscored"],
                            "sigterm": stop["sigterm"]}, op=MAX, group=plan.trainer_group)
        skipped_steps += int(halt["skipped"])
        unscored_steps += int(halt["unscored"])
        entry = log_step(log, step, metrics, args, plan, actor, engine, out, (rewards, parts, failed), batch,
                         train, sync, timer, tally, skipped_steps, unscored_steps)
        if skipped_steps > args.max_skipped_steps:
            raise UserError(f"stopping: {skipped_steps} steps had NaN/inf gradients (--max-skipped-steps "
                            f"{args.max_skipped_steps}); lower --lr or check the rewards and the data. "
                            f"{checkpoint.last_complete(args.run_dir)}")
        if unscored_steps > args.max_skipped_steps:
            why = reward.last_failure()
            if judge and judge.last_error:
                why = f"the judge: {judge.last_error}"
            raise UserError(f"stopping: in {unscored_steps} steps every reward failed (--max-skipped-steps "
                            f"{args.max_skipped_steps}); check --rewards {' '.join(args.rewards)}: "
                            f"{why}. {checkpoint.last_complete(args.run_dir)}")
        if args.save_hf_every and (step + 1) % args.save_hf_every == 0:
            path = os.path.join(args.run_dir, "hf", f"step_{step + 1}")
            checkpoint.export_hf(actor, path, rank, args.model)
        save_due = args.save_every and (step + 1) % args.save_every == 0
        if halt["sigterm"] or save_due:
            checkpoint.save_and_report(args.run_dir, step + 1, actor, args.keep_last, rank,
                                       extra={"ds_ema": ema}, rank_state={"stream": stream.state()})
        if halt["sigterm"]:
            stopped = True
            break
        if args.rebalance:
            window.append(entry)
            since_move += 1
            move = decide_move(step, args, plan, window, since_move, move_cost_s)
            restarts_left = int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) - int(
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if move.layout is not None and restarts_left < 1:
                if rank == 0 and not warned_restarts:
                    print(f"rebalance after step {step + 1}: {move.why}; not moving: torchrun has no restart "
                          f"left (--max-restarts used up)", flush=True)
                warned_restarts, move.layout = True, None
            if move.layout is not None and rebalance_move(step, move, args, plan, actor, ema, stream, log,
                                                          move_cost_s):
                moving = stopped = True
                break
    # `stopped` is the same on every rank (reduced), as it must be: the export is collective
    if args.save_final and not stopped:
        checkpoint.export_hf(actor, os.path.join(args.run_dir, "final"), rank, args.model)
    if rank == 0:
        final_dir = None
        if args.save_final and not stopped:
            final_dir = os.path.join(args.run_dir, "final")
        if moving:
            k = move.layout.rollout
            print(f"moving: every rank stops; torchrun restarts them as {plan.layout.world - k} trainers + "
                  f"{k} rollout ranks, resuming at step {step + 2}", flush=True)
        else:
            log.summary(final_dir, plot(args.run_dir))
        log.close()
    engine.close()  # before the process group: vLLM built its own groups on it; stops the rollout ranks
    dist.exit_now(placement.MOVE_EXIT if moving else 0)
