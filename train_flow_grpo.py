"""Flow-GRPO: GRPO on a flow-matching image model, with FSDP2 and parallel controllers.

    torchrun --standalone --nproc-per-node 2 train_flow_grpo.py                 # the shapes task, offline
    torchrun --standalone --nproc-per-node 2 train_flow_grpo.py --sde dance_grpo  # DanceGRPO's step
    torchrun --standalone --nproc-per-node 2 train_flow_grpo.py --window 4        # MixGRPO's window

A flow model samples an image by integrating dx/dt = v(x, t, prompt) from noise (t = 1) to the
image (t = 0). The ODE has no log-prob; Flow-GRPO (Liu et al. 2025) samples with an SDE of the
same marginals instead, so each denoising step is a Gaussian policy N(mean, std^2) over the next
latent, with a log-prob, and GRPO applies: K images per prompt, a reward per image, the group's
normalised reward as the advantage of every step of its trajectory, PPO's clipped ratio per trained
step, and a KL to the frozen starting model. The sampler, the step log-prob, the loss and the KL
are pure functions in rl/flow.py; `advantages` and `loss_fn` below are the algorithm.

Every rank is the controller of its own share of each step's prompts (G-Core's parallel
controllers): it samples, scores and computes its groups' advantages itself; only FSDP2's
collectives and the metric reductions are shared. The sharded model is its own sampler (no engine,
no weight sync): roles/flow_actor.py. Scaffolding (resume, checkpoints, SIGTERM) is run.py's.
"""
import math
import os
import random
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch

import placement
from models.flow_dit import read_flow_config
from rl import flow
from roles.flow_actor import FlowActor
from roles.reward import Reward, resolve
from flags import Flat, RunArgs, parse
from run import Run, Totals
from tasks import shapes
from tasks.data import prompt_seed
from tasks.image_rewards import IMAGE_REWARDS
from utils import dist
from utils.callables import check_reward
from utils.errors import UserError, check_rules
from utils.logger import Timer
from utils.plot import plot_flow

SUM = torch.distributed.ReduceOp.SUM
TASK = len(shapes.prompts("eval"))  # the built-in task's prompts (the grid of colour x shape x half)


@dataclass
class Args:
    model: str = "assets/flow-tiny"
    """the flow model: a directory of config.json + model.safetensors (`python -m assets.make --flow
    --out DIR` makes the built-in one; docs/flow.md says how to put another model behind the sampler)"""
    steps: int = 30
    """rollout batches (each --minibatches optimizer steps)"""
    prompts_per_step: int = 8
    """prompts per step over all ranks (each rank samples prompts_per_step / ranks of them)"""
    num_generations: int = 8
    """images per prompt: the GRPO group"""
    rewards: tuple[str, ...] = ("colour", "compressibility")
    """reward terms: colour, position, compressibility (tasks/image_rewards.py) or module:function
    (fn(prompts, images [B, 3, H, W] in [-1, 1]) -> B floats)"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward term (default: all 1)"""
    reward_timeout_s: float = 60.0
    """a reward function call running longer scores nothing for its images (counted in reward/failures)"""
    sde: Literal["flow_grpo", "dance_grpo"] = "flow_grpo"
    """the sampler's SDE step: flow_grpo (Liu et al. 2025: noise sigma_t = a sqrt(t / (1 - t))) or
    dance_grpo (Xue et al. 2025: noise eta sqrt(|dt|) and a score term)"""
    noise_level: float | None = None
    """the SDE's noise: flow_grpo's a, dance_grpo's eta (default: their papers' 0.7 and 0.3)"""
    train_steps: int = 10
    """denoising steps of the training rollouts (few: Flow-GRPO's "denoising reduction")"""
    eval_steps: int = 40
    """denoising steps of the held-out evaluation (the ODE: no noise)"""
    shift: float = 1.0
    """SD3's time shift of the schedule (t' = s t / (1 + (s - 1) t); 1: uniform steps)"""
    window: int = 0
    """MixGRPO (Li et al. 2025): the SDE, and training, only in a window of this many of the
    --train-steps, the ODE elsewhere; the window slides one step later every --window-every steps
    (0: the SDE at every step)"""
    window_every: int = 10
    """--window: steps (rollout batches) between two moves of the window"""
    timestep_fraction: float = 1.0
    """train a random share of the SDE steps each step (DanceGRPO's timestep_fraction; 1: all)"""
    kl_coef: float = 0.05
    """beta of the KL to the starting model, mean |mu - mu_ref|^2 / (2 std^2) per trained step
    (0: no reference model); raise it when the reward is hacked (flow_grpo's advice)"""
    clip_range: float = 1e-4
    """PPO's clip of the per-step ratio (Flow-GRPO's is tiny: its ratios are means over pixels)"""
    adv_clip: float = 5.0
    """advantages are clipped to [-adv_clip, adv_clip] (flow_grpo's adv_clip_max)"""
    minibatches: int = 2
    """optimizer steps per rollout batch (each on a share of the images; after the first the
    ratio moves off 1 and the clip acts)"""
    lr: float = 1e-3
    """AdamW's learning rate (the tiny model's; flow_grpo trains SD3's LoRA at 3e-4)"""
    warmup_steps: int = 1
    """optimizer steps of linear warm-up"""
    weight_decay: float = 0.0
    """AdamW's weight decay"""
    max_grad_norm: float = 1.0
    """gradients are clipped to this global norm; a step whose norm is NaN/inf is skipped"""
    micro_batch_size: int = 64
    """images per forward (and per backward, at one trained step)"""
    eval_every: int = 10
    """evaluate the held-out reward every this many steps (0: never; the end always, with 1 or more)"""
    eval_prompts: int = 72
    """held-out prompts (the task's grid of colour x shape x half); one image each"""
    run_args: Flat[RunArgs] = field(default_factory=lambda: RunArgs(run_dir="runs/flow", save_every=10))


def check_args(args: Args, world: int):
    """Every flag against the others and the world size, before any model loads: one line each."""
    args.run_args.check()
    if args.noise_level is None:
        args.noise_level = {"flow_grpo": 0.7, "dance_grpo": 0.3}[args.sde]
    try:
        read_flow_config(args.model)  # a flow model's directory, else one line naming what it is
    except UserError as e:
        raise UserError(f"--model: {e}") from None
    check_rules(args, [
        ("steps", args.steps >= 1, "use 1 or more"),
        ("num_generations", args.num_generations >= 2, "use 2 or more (a group needs a spread)"),
        ("prompts_per_step", 1 <= args.prompts_per_step <= TASK and args.prompts_per_step % (
            world * args.minibatches) == 0, f"use a multiple of the {world} rank(s) x --minibatches "
         f"({args.minibatches}), at most the task's {TASK} prompts"),
        ("noise_level", 0 < args.noise_level < math.inf, "use a positive number such as 0.7"),
        ("train_steps", args.train_steps >= 1, "use 1 or more"),
        ("eval_steps", args.eval_steps >= 1, "use 1 or more"),
        ("shift", 0 < args.shift < math.inf, "use a positive number (1: uniform steps)"),
        ("window", 0 <= args.window <= args.train_steps,
         f"use 0 (off) to --train-steps ({args.train_steps})"),
        ("window_every", args.window_every >= 1, "use 1 or more"),
        ("timestep_fraction", 0 < args.timestep_fraction <= 1, "use a share in (0, 1]"),
        ("kl_coef", 0 <= args.kl_coef < math.inf, "use 0 (off) or a positive number"),
        ("clip_range", 0 < args.clip_range < math.inf, "use a positive number such as 1e-4"),
        ("adv_clip", 0 < args.adv_clip < math.inf, "use a positive number such as 5"),
        ("minibatches", args.minibatches >= 1, "use 1 or more"),
        ("lr", 0 < args.lr < math.inf, "use a positive learning rate such as 3e-4"),
        ("micro_batch_size", args.micro_batch_size >= 1, "use 1 or more"),
        ("eval_every", args.eval_every >= 0, "use 0 (never) or a number of steps"),
        ("eval_prompts", 1 <= args.eval_prompts <= TASK and args.eval_prompts % world == 0,
         f"use a multiple of the {world} rank(s), at most the task's {TASK} prompts"),
        ("max_grad_norm", 0 < args.max_grad_norm, "use a positive norm such as 1"),
        ("rewards", len(args.rewards) >= 1, "use one term or more, e.g. colour compressibility"),
        ("reward_timeout_s", args.reward_timeout_s > 0, "use a positive number of seconds")])
    for name in args.rewards:
        if name not in IMAGE_REWARDS and ":" not in name:
            raise UserError(f"--rewards {name}: use {', '.join(IMAGE_REWARDS)} or module:function")
        if ":" in name:
            # imports now: a wrong module or name, or a function the trainer cannot call as fn(prompts,
            # images), is one line before any model loads
            check_reward(resolve(name), name, [], "images")
    if args.run_args.save_hf_every:
        raise UserError("--save-hf-every exports language models; train_flow_grpo.py writes its final model "
                        "(run_dir/final) and checkpoints (--save-every): drop --save-hf-every")
    if args.reward_weights and len(args.reward_weights) != len(args.rewards):
        raise UserError(f"{len(args.rewards)} --rewards but {len(args.reward_weights)} --reward-weights: "
                        "give one weight per term")


def noises(seed: int, shape: tuple, count: int) -> torch.Tensor:
    """[count, *shape] standard normal draws from their own seed: an image's noise is the same on
    any rank and in any batch (the 2-rank run is the 1-rank run; a resumed run the same run)."""
    return torch.randn((count, *shape), generator=torch.Generator().manual_seed(seed))


def rollout(step: int, rows: list[dict], args: Args, actor, reward, ts, plan, timer) -> dict:
    """This rank's prompts of step `step`, K SDE trajectories each, scored. -> xs [n, S + 1, C, H,
    W], logps [n, S], cond [n, 3], rewards [n], scored [n], parts {term: [n]}, sde_on [S]."""
    order = random.Random(f"{args.run_args.seed}-order-{step}").sample(range(len(rows)),
                                                                       args.prompts_per_step)
    # this rank's share of each minibatch (global minibatch m is the same prompts on any world size)
    P, M, W = args.prompts_per_step, args.minibatches, plan.dp
    share = P // (M * W)
    mine = [(i, order[i]) for m in range(M) for i in range(m * P // M + plan.rank * share,
                                                           m * P // M + (plan.rank + 1) * share)]
    K, cfg, S = args.num_generations, actor.config, args.train_steps
    prompts = [rows[r]["prompt"] for _, r in mine for _ in range(K)]
    cond = torch.tensor([shapes.parse_prompt(p) for p in prompts], device=plan.device)  # [n, 3]
    image = (cfg.channels, cfg.image_size, cfg.image_size)
    z = torch.cat([noises(prompt_seed(args.run_args.seed, step, i), (S + 1, *image), K) for i, _ in mine])
    on = flow.window(S, args.window, args.window_every, step) if args.window else None  # MixGRPO
    with timer("sample"):
        velocity = partial(actor.velocity, chunks=pieces(len(prompts), args))
        got = flow.sample(velocity, z[:, 0].to(plan.device), cond, ts, args.sde, args.noise_level,
                          on, noises=z[:, 1:].to(plan.device))
    # DanceGRPO scores the last step's prediction of the clean image: its last SDE step leaves noise
    image = got["x0_hat"] if args.sde == "dance_grpo" else got["image"]
    with timer("reward"):
        rewards, parts, failed = reward.score(prompts, image.clamp(-1, 1).cpu(), {})
    return {**got, "cond": cond, "rewards": rewards, "scored": ~failed, "parts": parts, "prompts": prompts}


def pieces(n: int, args: Args) -> list[tuple[int, int]]:
    """This rank's rows [0, n) as the update runs them: each minibatch's rows in micro-batches of
    --micro-batch-size. -> [(lo, hi)]."""
    per = n // args.minibatches
    return [(lo, min(lo + args.micro_batch_size, (m + 1) * per)) for m in range(args.minibatches)
            for lo in range(m * per, (m + 1) * per, args.micro_batch_size)]


def advantages(got: dict, args: Args) -> torch.Tensor:
    """GRPO's group advantage of each image [n] (K images per prompt, all on this rank): its reward
    normalised within its group, clipped at --adv-clip; a failed reward: 0 (out of the loss)."""
    K = args.num_generations
    rewards, scored = got["rewards"].view(-1, K), got["scored"].view(-1, K)  # [P, K]
    return flow.group_advantages(rewards, args.adv_clip, scored=scored).view(-1)  # [n]


def trained_steps(step: int, sde_on: torch.Tensor, args: Args) -> list[int]:
    """The denoising steps trained at `step`: the SDE steps (all, or MixGRPO's window), a random
    --timestep-fraction of them (seeded by the step: the same on every rank)."""
    on = [j for j, s in enumerate(sde_on.tolist()) if s]
    keep = max(1, round(args.timestep_fraction * len(on)))
    return sorted(random.Random(f"{args.run_args.seed}-steps-{step}").sample(on, keep))


def loss_fn(piece, got, adv, ref_mean, std, ts, args: Args, actor, norm: float):
    """One micro-batch of rows [lo, hi) at trained step j: Flow-GRPO's loss. piece (lo, hi, j, jj):
    jj is j's place among the trained steps. The rows' log-prob of the stored next latent under the
    current model (rl/flow.py `recompute`: the same step code as the sampler), PPO's clipped
    ratio to the rollout's log-prob with the image's advantage, and beta x the KL to the reference
    (its mean at the same latent). Summed over rows / norm (this rank's share of all images)."""
    lo, hi, j, jj = piece
    logp, mean = flow.recompute(actor.model, got["xs"][lo:hi], got["cond"][lo:hi], ts, [j], args.sde,
                                args.noise_level)  # [b, 1], [b, 1, C, H, W]
    old = got["logps"][lo:hi, j:j + 1]  # [b, 1] the rollout's
    ratio = torch.exp(logp - old)  # [b, 1]
    surrogate = flow.clipped_loss(logp, old, adv[lo:hi], args.clip_range) * (hi - lo)  # sum over rows
    kl = torch.zeros(())
    if ref_mean is not None:
        kl = flow.kl_to_reference(mean, ref_mean[lo:hi, jj:jj + 1], std[jj:jj + 1]).sum()  # over rows
    loss = (surrogate + args.kl_coef * kl) / norm
    clipped = ((ratio - 1).abs() > args.clip_range).float().sum()
    return loss, {"loss": float(loss.detach()) * norm, "kl": float(kl.detach()), "clip_frac": float(clipped),
                  "ratio_dev_max": float((ratio.detach() - 1).abs().max())}


def reference_means(ref, got, steps: list[int], ts, args: Args):
    """The reference's step mean at each trained step's stored latent: [n, J, C, H, W] (None: no KL)."""
    if ref is None:
        return None
    velocity = partial(ref.velocity, chunks=pieces(len(got["xs"]), args))
    return flow.recompute(velocity, got["xs"], got["cond"], ts, steps, args.sde, args.noise_level)[1]


def update(actor, got, adv, steps: list[int], ref_mean, ts, args: Args, plan) -> dict:
    """--minibatches optimizer steps over this rank's images, each over every trained step of its
    rows, micro-batch by micro-batch (`pieces`: the same number on every rank). The first
    minibatch's largest |ratio - 1| is kept apart: before any update it must be 0."""
    per = len(adv) // args.minibatches
    std = flow.step_std(ts, steps, args.sde, args.noise_level)  # [J]
    # a mean over the minibatch's images on all ranks and its trained steps: FSDP2 averages the
    # gradients over the ranks, so each rank divides its sum by its own rows x steps
    norm = per * len(steps)
    out = {}
    for m in range(args.minibatches):
        mine = [(lo, hi, j, jj) for lo, hi in pieces(len(adv), args) if m * per <= lo < (m + 1) * per
                for jj, j in enumerate(steps)]
        sums = actor.train_step(mine, lambda p: loss_fn(p, got, adv, ref_mean, std, ts, args, actor, norm))
        if m == 0:
            out["ratio_dev_first"] = sums["ratio_dev_max"]
        for k, v in sums.items():  # grad_norm, skipped and the "_max" ones: the largest
            out[k] = max(out.get(k, 0.0), v) if k in ("grad_norm", "skipped") or k.endswith("_max") \
                else out.get(k, 0.0) + v
    return out


def evaluate(rows: list[dict], args: Args, actor, reward, plan, timer) -> tuple[dict, torch.Tensor]:
    """The held-out reward: one image per prompt with the ODE over --eval-steps, each from its own
    noise (seeded by its place: the same at every eval and on any rank). -> the metrics and this
    rank's images (the picture's)."""
    with timer("eval"):
        per = min(len(rows), args.eval_prompts) // plan.dp
        mine = list(range(plan.rank * per, (plan.rank + 1) * per))
        prompts = [rows[i]["prompt"] for i in mine]
        cfg = actor.config
        image = (cfg.channels, cfg.image_size, cfg.image_size)
        z = torch.cat([noises(prompt_seed(args.run_args.seed, -1, i), image, 1)
                       for i in mine]).to(plan.device)
        cond = torch.tensor([shapes.parse_prompt(p) for p in prompts], device=plan.device)
        ts = flow.timesteps(args.eval_steps, args.shift)
        images = flow.sample(actor.velocity, z, cond, ts, "ode")["image"].clamp(-1, 1).cpu()
        total, parts, failed = reward.score(prompts, images, {})
        scored = (~failed).float()
        sums = {"reward": (total * scored).sum(), "count": scored.sum(), "failures": failed.sum(),
                **{f"reward/{k}": (v * scored).sum() for k, v in parts.items()}}
        sums = dist.reduce(sums, op=SUM, group=plan.trainer_group)
    count, failures = max(1.0, sums.pop("count")), sums.pop("failures")
    return {**{f"eval/{k}": v / count for k, v in sums.items()}, "eval/failures": failures}, images


def gathered(images: torch.Tensor, plan) -> torch.Tensor:
    """Every rank's held-out images, in prompt order (the same count on each): [N, C, H, W]."""
    parts = [torch.empty_like(images) for _ in range(plan.dp)]
    torch.distributed.all_gather(parts, images.contiguous(), group=plan.trainer_group)
    return torch.cat(parts)


def log_step(step, got, train, timer, args: Args, plan, metrics: dict) -> tuple[dict, dict]:
    """The step's metrics over all ranks (rank 0 logs them), and the guards' maxima."""
    scored = got["scored"].float()
    sums = {"reward": (got["rewards"] * scored).sum(), "scored": scored.sum(), "images": float(len(scored)),
            **{f"reward/{k}": (v * scored).sum() for k, v in got["parts"].items()},
            **{k: train[k] for k in ("loss", "kl", "clip_frac")}}
    total = dist.reduce(sums, op=SUM, group=plan.trainer_group)
    peak = dist.reduce({"ratio_dev": train["ratio_dev_max"], "ratio_dev_first": train["ratio_dev_first"],
                        "grad_norm": train["grad_norm"],
                        "peak_mem_gib": dist.peak_memory_gib(plan.device),
                        "peak_mem_added_gib": dist.memory_added_gib(plan.device),
                        **{f"{k}_s": v for k, v in timer.seconds.items()}},
                       op=torch.distributed.ReduceOp.MAX, group=plan.trainer_group)
    trained = total["images"] * max(1, len(got["trained"]))  # (image, trained step) pairs
    metrics.update({
        "rollout/reward": total["reward"] / max(1.0, total["scored"]),
        **{f"rollout/{k}": total[k] / max(1.0, total["scored"]) for k in total if k.startswith("reward/")},
        "reward/failures": total["images"] - total["scored"],
        "train/loss": total["loss"] / trained, "train/kl": total["kl"] / trained,
        "train/clip_frac": total["clip_frac"] / trained, "train/ratio_dev_max": peak["ratio_dev"],
        "train/ratio_dev_first": peak["ratio_dev_first"],
        "train/grad_norm": peak["grad_norm"], "train/trained_steps": len(got["trained"]),
        "perf/step_s": timer.elapsed(), **{f"perf/{k}": v for k, v in peak.items() if k.endswith("_s")},
        "perf/peak_mem_gib": peak["peak_mem_gib"], "perf/peak_mem_added_gib": peak["peak_mem_added_gib"]})
    return metrics, {"skipped": train["skipped"], "unscored": float(total["scored"] == 0)}


if __name__ == "__main__":
    args = parse(Args, check_args)
    rank, world, device = dist.init(args.run_args.timeout_s)
    plan = placement.plan("colocate", rank, world, device, args.prompts_per_step,
                          timeout_s=args.run_args.timeout_s)
    torch.manual_seed(args.run_args.seed)
    rows, eval_rows = shapes.prompts("train"), shapes.prompts("eval")

    # the roles on every rank: the policy (its own sampler), the reference, the rewards
    dist.mark_memory_start(device)
    actor = FlowActor(args.model, plan.mesh, device, args.lr, args.warmup_steps, args.weight_decay,
                      args.max_grad_norm, args.micro_batch_size)
    ref = FlowActor(args.model, plan.mesh, device, micro_batch_size=args.micro_batch_size,
                    frozen=True) if args.kl_coef > 0 else None
    names = [f"tasks.image_rewards:{n}" if n in IMAGE_REWARDS else n for n in args.rewards]
    reward = Reward(names, args.reward_weights, args.reward_timeout_s)
    session = Run(args, plan, actor, reward)
    ts = flow.timesteps(args.train_steps, args.shift).to(device)  # [S + 1]: 1 (noise) to 0 (the image)
    first_images = None
    if rank == 0:
        size = sum(p.numel() for p in actor.model.parameters()) / 1e6
        print(f"{world} rank(s); flow model {args.model} ({size:.2f}M params); {len(rows)} train prompts, "
              f"{len(eval_rows)} eval; {args.sde} SDE, "
              f"{args.train_steps} steps to train, {args.eval_steps} to evaluate", flush=True)

    for step in range(session.start, args.steps):
        timer = Timer()
        metrics = {}
        if args.eval_every and step % args.eval_every == 0:
            held_out, images = evaluate(eval_rows, args, actor, reward, plan, timer)
            metrics.update(held_out)
            first_images = images if first_images is None else first_images
        got = rollout(step, rows, args, actor, reward, ts, plan, timer)  # K trajectories per prompt, scored
        adv = advantages(got, args).to(device)  # [n] GRPO: per group of K
        got["trained"] = trained_steps(step, got["sde"], args)  # the SDE steps (MixGRPO's window) to train
        with timer("reference"):
            ref_mean = reference_means(ref, got, got["trained"], ts, args)
        with timer("train"):
            train = update(actor, got, adv, got["trained"], ref_mean, ts, args, plan)
        metrics, guards = log_step(step, got, train, timer, args, plan, metrics)
        if session.end_of_step(step, metrics if rank == 0 else None, Totals({}, guards)):
            break

    # the end: the held-out reward, the policy, the picture of the curves and the samples
    if not session.stopped:
        held_out, images = evaluate(eval_rows, args, actor, reward, plan, Timer())
        if rank == 0:
            session.log.log(args.steps - 1, {"final": True, **held_out})
        if args.run_args.save_final:
            actor.export(os.path.join(args.run_args.run_dir, "final"), rank)
        before = gathered(first_images, plan) if first_images is not None else None
        after = gathered(images, plan)
    if rank == 0:
        picture = plot_flow(args.run_args.run_dir, before, after) if not session.stopped else None
        final_dir = os.path.join(args.run_args.run_dir, "final") if args.run_args.save_final else None
        session.log.summary(final_dir, picture)
        session.log.close()
    dist.exit_now(0)
