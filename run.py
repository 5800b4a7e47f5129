"""What every train script does around its algorithm (CleanRL's "try not to modify" part; the
flags they share and their checks are flags.py's): set-up (the process group, the plan, the prompts,
the engine), the roles beside the algorithm (the actor, the reference, the reward model, the
teacher), the minibatch split, the held-out evaluation, a step's record and its reduction, and
`Run`: resume, the end of a step (the agreed stop, the NaN and unscored guards, HF exports,
checkpoints, SIGTERM) and the finish (the final evaluation, the export, the summary).
train_grpo.py and train_ppo.py use all of it, train_rm.py and train_flow_grpo.py parts; the
algorithm itself (its flags, loss, advantages and update) stays in each script.
"""
import functools
import os
import signal
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

import placement
from engines import agents, episodes
from engines.base import Samples
from engines.decode import SamplingParams
from engines.episodes import EnvArgs
from engines.make import make_engine
from engines.native import NativeEngine
from engines.vllm_engine import VLLMEngine
from flags import DataArgs
from models import lora, moe
from models.hf import read_config
from models.tokenizer import Tokenizer
from models.vision import most_images
from rebalance import move
from roles.actor import Actor, export_hf
from roles.reference import Reference
from roles.reward import Reward
from roles.reward_model import RewardModel
from roles import stream
from roles.rollout import Start, leave, serve
from roles.teacher import Teacher
from rollouts import RolloutResult
from tasks.data import eval_source, load_rows, micro_batches, prompt_seed
from utils import checkpoint, dist
from utils.errors import UserError
from utils.logger import Logger, Timer
from utils.plot import plot

MAX = torch.distributed.ReduceOp.MAX

def load_prompts(data: DataArgs, tok, env: EnvArgs) -> tuple[list[dict], int, list[dict]]:
    """(train rows, how many were over --max-prompt-tokens, held-out rows): every rank tokenises
    the same rows and later takes its own slice of each step. With --env / --tools a prompt is the
    environment's opening, rendered with the tools (engines/episodes.py)."""
    train_rows = load_rows(data.dataset, "train", data.prompt_column, data.answer_column, data.image_column)
    rows, skipped = episodes.tokenize(train_rows, tok, env, data.max_prompt_tokens)
    held_out = eval_source(data.dataset, data.eval_dataset)
    eval_rows = []
    if held_out and data.eval_every:
        test_rows = load_rows(held_out, "test", data.prompt_column, data.answer_column, data.image_column)
        eval_rows = episodes.tokenize(test_rows, tok, env, data.max_prompt_tokens)[0][:data.eval_prompts]
    return rows, skipped, eval_rows


def set_up(args) -> tuple:
    """What every rank of a GRPO or PPO run does after its flags: the process group, this rank's
    Plan, the prompts (every rank reads them: episodes start from them), and `local_engine`, which
    makes the generation engine this rank holds when placement.engine_for asks for one.
    -> (cfg, tok, plan, (rows, skipped, eval_rows), local_engine)"""
    cfg, tok = read_config(args.data.model), Tokenizer(args.data.model)
    rank, world, device = dist.init(args.run_args.timeout_s)
    where = args.placement
    plan = placement.plan(where.placement, rank, world, device, args.prompts_per_step, where.rollout_ranks,
                          where.max_staleness, args.run_args.timeout_s, where.sampler_ranks, where.gen_tp)
    torch.manual_seed(args.run_args.seed)
    max_len = args.env.context(args.data.max_prompt_tokens + args.sampling.max_new_tokens)
    rows, skipped, eval_rows = load_prompts(args.data, tok, args.env)  # every rank: episodes start from them
    args.reward.check_rows(rows)  # the columns the reward terms read
    serve_lora = args.lora.lora_rank if args.lora.lora_vllm == "adapters" else 0  # vLLM serving adapters
    engine_of = functools.partial(make_engine, args.sampling.engine, args.data.model, cfg, tok, device,
                                  args.compute.dtype, max_len, args.run_args.seed, lora_rank=serve_lora,
                                  max_images=most_images(rows + eval_rows), routes=args.moe.routing_replay)
    local_engine = episodes.wrap(engine_of, args.env, tok, rows + eval_rows,
                                 args.sampling.max_new_tokens)  # --env: an episode's turns
    local_engine = agents.wrap(local_engine, args.agent, tok, rows + eval_rows, args.sampling.max_new_tokens,
                               args.data.max_prompt_tokens, args.sampling.temperature)  # --agent: an endpoint
    return cfg, tok, plan, (rows, skipped, eval_rows), local_engine


def make_actor(args, plan) -> Actor:
    """The trained policy of GRPO and PPO (roles/actor.py), from the flags they share."""
    decay_steps = args.steps if args.lr_schedule == "linear" else 0
    return Actor(args.data.model, plan.mesh, plan.device, args.lr, args.warmup_steps, args.weight_decay,
                 args.max_grad_norm, args.compute.dtype, args.sampling.temperature, args.micro_batch_size,
                 decay_steps, compile=args.compute.compile, lora=args.lora, seed=args.run_args.seed,
                 freeze_vision=args.data.freeze_vision, micro_batch_tokens=args.micro_batch_tokens,
                 moe=args.moe)


def frozen_roles(args, plan, actor) -> tuple:
    """The roles GRPO and PPO hold beside the trained ones, which never train: the reference
    (--kl-coef > 0), the reward model (--reward-model) and the teacher (without a --teacher-model
    it does nothing). -> (reference or None, reward model or None, teacher)"""
    device, param_dtype = plan.device, args.compute.dtype
    temperature, micro_batch_size = args.sampling.temperature, args.micro_batch_size
    tokens = args.micro_batch_tokens
    ref = None
    if args.kl_coef > 0 and args.lora.lora_rank:
        ref = lora.Reference(actor)  # the actor with its adapters off: no second model
    elif args.kl_coef > 0:
        ref = Reference(args.data.model, plan.mesh, device, param_dtype, temperature, micro_batch_size,
                        micro_batch_tokens=tokens)
    rm = None
    if args.reward.reward_model:
        rm = RewardModel(args.reward.reward_model, plan.mesh, device, param_dtype, micro_batch_size, tokens)
    return ref, rm, Teacher(args.distill, plan, device, param_dtype, temperature, micro_batch_size,
                            micro_batch_tokens=tokens)


def run_rollout_rank(plan, local_engine, arrival=None):
    """disaggregate: a rollout rank's life in one layout. It builds its engine (or keeps the one
    it had: `arrival.engine`), serves its trainers (roles/rollout.py `serve`) until they say stop,
    and leaves; or until they say move (--rebalance): then it moves with them and returns the next
    layout's Plan and rebalance.Arrival."""

    t = time.perf_counter()
    engine = placement.engine_for(plan, local_engine, kept=arrival and arrival.engine)
    if plan.rank == plan.dp:  # the first rollout rank
        print(f"rollout ranks: {type(engine).__name__}, ready in {time.perf_counter() - t:.0f}s", flush=True)
    moving = serve(plan, engine)
    if isinstance(moving, Start):  # --stream: its own loop, to the end of the run
        if not (isinstance(engine, NativeEngine) or isinstance(engine, VLLMEngine) and moving.swap == "asap"):
            leave(engine, f"rollout rank {plan.rank}: --stream needs the native engine, or vLLM with "
                          f"--stream-swap asap, and this rank has {type(engine).__name__} (--stream-swap "
                          f"{moving.swap}): use --engine native, or add --stream-swap asap")
        stream.serve(plan, engine, moving)
        moving = None
    if moving is None:
        engine.close()
        dist.exit_now(0)
    new, arrived = move(plan, moving.layout, None, moving.bucket_bytes, arrival, {})
    if new.role == "rollout":
        arrived.engine = engine
    else:
        engine.close()
    return new, arrived


class Evaluator:
    """Held-out accuracy every --eval-every steps and at the end: one sample per prompt at the
    training temperature, seeded per prompt (by its position: the same on any rank). partial: the
    sampler ranks generate them all."""

    def __init__(self, rows: list[dict], every: int, steps: int, params: SamplingParams, seed: int, plan):
        self.rows, self.every, self.steps, self.params = rows, every, steps, params
        self.seed, self.plan = seed, plan
        self.accuracy = Reward(["accuracy"])

    def __call__(self, step: int, engine, timer) -> dict:
        """{"eval/accuracy": ...} when an evaluation is due after `step` steps, else {}."""
        if not self.every or not self.rows or (step % self.every and step != self.steps):
            return {}
        plan = self.plan
        ranks = plan.layout.sampler_ranks if plan.mode == "partial" else plan.dp
        mine = self.rows[plan.rank::ranks] if plan.rank < ranks else []
        seeds = [prompt_seed(self.seed, -1, plan.rank + i * ranks) for i in range(len(mine))]
        with timer("eval"):
            out = Samples.empty()
            if mine or getattr(engine, "collective", False):  # --gen-tp: the group generates together
                out = engine.generate([r["ids"] for r in mine], self.params, seeds)
            columns = {"answer": [r["answer"] for r in mine], "finish_reason": out.finish_reasons}
            correct = self.accuracy.score([r["prompt"] for r in mine], out.texts, columns)[0]
            total = dist.reduce({"correct": correct.sum(), "count": len(mine)}, group=plan.trainer_group)
        return {"eval/accuracy": total["correct"] / total["count"]}


def split_minibatches(batch: dict, minibatches: int, plan) -> list[tuple[dict, float, float]]:
    """This rank's batch in --minibatches slices, each with what its losses are divided by: its
    tokens and its completions in the loss over all trainer ranks, each over the trainers, so that
    FSDP's gradient average is the mean over the whole minibatch. -> [(minibatch, tokens / dp,
    completions / dp)]"""
    size = len(batch["adv"]) // minibatches  # rows per minibatch (check_flags: it divides)
    minis = list(micro_batches(batch, size))
    counts = []  # [minibatches, 2]: tokens, completions in the loss
    for mini in minis:
        counts.append([float(mini["loss_mask"].sum()), float((mini["loss_mask"].sum(-1) > 0).sum())])
    counts = torch.tensor(counts, dtype=torch.float64)
    torch.distributed.all_reduce(counts, group=plan.trainer_group)
    return [(mini, tokens / plan.dp, completions / plan.dp)
            for mini, (tokens, completions) in zip(minis, counts.tolist())]


class Totals(NamedTuple):
    """An update's metric sums and maxima over its optimizer steps, this rank's (Run.end_of_step
    reads the guards among the maxima: skipped, unscored)."""
    sums: dict
    maxes: dict

    def add(self, sums: dict, maxes: dict):
        """One optimizer step's metrics: the sums add up, the maxima keep the largest."""
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0) + v
        for k, v in maxes.items():
            self.maxes[k] = torch.maximum(torch.as_tensor(self.maxes.get(k, v)), torch.as_tensor(v))


@dataclass
class StepRecord:
    """What one step of GRPO or PPO made, as its log reads it (each script's log_step, reduce_step)."""
    step: int
    timer: Timer  # the step's phases
    sync: dict  # placement.sync's: the weight sync's seconds and bytes
    metrics: dict  # the held-out evaluation's, when one was due, else {}
    got: RolloutResult  # this rank's scored samples
    batch: dict  # tasks.data.Batch: one row per completion, with its advantages
    trained: Totals  # update's


def reduce_step(record: StepRecord, engine, plan, sums: dict, maxes: dict) -> tuple[dict, dict]:
    """A step's numbers summed and maxed over the trainers, one reduction each: what both scripts
    log of the rollout, the update and the phases, plus each script's own `sums` and `maxes`."""
    got, timer, mask = record.got, record.timer, record.batch["loss_mask"]
    out, rewards, failed = got.samples, got.rewards, got.failed
    step_s = timer.elapsed()
    staleness = record.step - out.version
    stale_sums, stale_max = token_staleness(out, record.step)
    parts = {f"reward/{name}": part[~failed].sum() for name, part in got.parts.items()}
    total = dist.reduce(group=plan.trainer_group, values={
        **sums, **parts, **phase_metrics(plan, engine, timer.seconds, step_s, got.tally),
        "reward": rewards.sum(), "failures": failed.sum(), "scored": (~failed).sum(),
        "len": out.lengths.sum(),
        "truncated": out.finish_reasons.count("length"), "staleness": staleness, "completions": len(rewards),
        "completion_tokens": mask.sum(), **episodes.sums(out), **stale_sums})
    s = timer.seconds
    peak = dist.reduce(op=MAX, group=plan.trainer_group, values={
        **maxes, "token_staleness_max": stale_max,
        "gen_s": s["generate"], "ref_s": s.get("reference", 0.0), "rm_s": s.get("reward_model", 0.0),
        "train_s": s["train"], "mem_gib": dist.peak_memory_gib(plan.device),
        "mem_added_gib": dist.memory_added_gib(plan.device), "step_s": step_s, "staleness": staleness})
    return total, peak


STALENESS_BINS = 4  # the per-token histogram counts 0, 1, 2 and 3 or more versions behind


def token_staleness(out: Samples, step: int) -> tuple[dict, float]:
    """How many versions behind `step` each sampled token's policy was (Samples.token_versions where
    the tokens carry their own: --stream, episodes; else the samples' version): (sums for the mean
    and the histogram, {"tokens_versioned", "token_staleness", "token_staleness/k"}; the largest, 0
    without tokens)."""
    T = out.tokens.shape[1]
    sampled = torch.arange(T)[None] < out.lengths[:, None]  # [N, T]
    versions = out.token_versions
    if versions is None:
        versions = torch.full_like(out.tokens, out.version)
    sampled &= versions >= 0  # (an episode's environment tokens: -1)
    behind = (step - versions)[sampled]  # [tokens]
    sums = {"tokens_versioned": float(len(behind)), "token_staleness": float(behind.sum())}
    for k in range(STALENESS_BINS):
        hit = behind >= k if k == STALENESS_BINS - 1 else behind == k
        sums[f"token_staleness/{k}"] = float(hit.sum())
    return sums, float(behind.max()) if len(behind) else 0.0


def step_metrics(total: dict, peak: dict, got, actor, plan) -> dict:
    """rank 0: what both scripts log from `reduce_step`'s numbers (rollout/, reward/, train/,
    perf/, placement/); each script adds its own."""
    N = total["completions"]
    S = max(1.0, total["scored"])  # completions with a reward
    T = max(1.0, total["completion_tokens"])  # their tokens: what the loss sees
    metrics = {"rollout/reward": total["reward"] / S, "rollout/response_len": total["len"] / N,
               "rollout/truncated": total["truncated"] / N}
    for name in got.parts:
        metrics[f"rollout/reward/{name}"] = total[f"reward/{name}"] / S
    metrics.update({
        "reward/failures": total["failures"], "train/pg_loss": total.get("pg_loss", 0.0) / T,
        "train/clip_frac": total.get("clipped_tokens", 0.0) / T, "train/grad_norm": peak["grad_norm"],
        "train/lr": actor.sched.get_last_lr()[0],
        "train/logprob_gap_mean": total["gap_sum"] / max(1.0, total["trained_tokens"]),
        "train/logprob_gap_max": peak["gap_max"],
        "train/rows_trained": total["rows"] / N,  # the rest had advantage 0 (and no KL term): not run
        "perf/generate_s": peak["gen_s"], "perf/reference_s": peak["ref_s"],
        "perf/reward_model_s": peak["rm_s"],
        "perf/train_s": peak["train_s"], "perf/sync_s": peak["sync_s"], "perf/sync_bytes": peak["sync_bytes"],
        "perf/step_s": peak["step_s"], "perf/tokens_per_s": total["len"] / peak["step_s"],
        "perf/peak_mem_gib": peak["mem_gib"], "perf/peak_mem_added_gib": peak["mem_added_gib"],
        "perf/sync_gather_s": peak["sync_gather_s"]})
    metrics.update(placement_metrics(plan, total, peak))
    if got.samples.token_versions is not None:  # per token (--stream: a sample's tokens span versions)
        count = max(1.0, total["tokens_versioned"])
        metrics.update({"rollout/token_staleness_mean": total["token_staleness"] / count,
                        "rollout/token_staleness_max": peak["token_staleness_max"]})
        for k in range(STALENESS_BINS):
            metrics[f"rollout/token_staleness/{k}"] = total[f"token_staleness/{k}"] / count
    metrics.update(episodes.metrics(total))  # multi-turn episodes: turns, tool calls and errors, stops
    metrics.update(moe.metrics(total))  # a MoE policy's routing: load per expert, entropy, replayed share
    return metrics


def phase_metrics(plan, engine, seconds: dict, step_s: float, tally: dict | None = None) -> dict:
    """Where this rank's step went, per role: the busy and idle seconds of the trainer role and
    of the rollout role, and `device_idle`, the seconds in which this rank's device (and, in
    disaggregate, its share of its rollout rank's) had nothing to do. Summed over the trainers
    these are the `placement/` metrics, and what a rebalancer would read. `seconds` holds the
    step's phases (utils.logger.Timer): wait, sync, eval, generate, and the trainer's own (reward,
    reference, train; PPO's reward_model, values, critic_train). partial: `tally` holds the
    seconds this rank spent sampling or judging inside its rollout ("generate")."""
    phase = lambda name: seconds.get(name, 0.0)  # noqa: E731
    # the trainer role waits while samples are made (colocate: this rank makes them; disaggregate:
    # its rollout rank does), and is busy in every other phase but the sync: scoring, the
    # reference, the critic, training
    trainer_idle = phase("wait") + phase("eval") + phase("generate")
    trainer_busy = 0.0
    for name, s in seconds.items():
        if name not in ("wait", "eval", "generate", "sync"):
            trainer_busy += s
    if plan.mode == "partial":
        # each rank is a trainer, and during the rollout a sampler or a judge
        sampler_busy = 0.0
        if plan.is_sampler:
            sampler_busy = tally["sampler_busy"] + phase("eval")
        judge_busy = tally["judge_busy"]
        rollout_busy = sampler_busy + judge_busy
        device_idle = max(0.0, step_s - rollout_busy - trainer_busy - phase("sync"))
        out = {"trainer_busy": trainer_busy, "trainer_idle": trainer_idle, "rollout_busy": rollout_busy,
               "rollout_idle": step_s - rollout_busy, "device_idle": device_idle,
               "sampler_busy": sampler_busy, "judge_busy": judge_busy,
               "sampler_idle": 0.0, "judge_idle": 0.0}
        if plan.is_sampler:
            out["sampler_idle"] = step_s - sampler_busy
        else:
            out["judge_idle"] = step_s - judge_busy
        return out
    pool = {}
    if plan.mode == "disaggregate":
        rollout = engine.take_stats()  # the rollout rank's seconds since the last step
        rollout_busy = rollout["busy_s"] + rollout["sync_s"]
        rollout_idle = rollout["idle_s"]
        device_idle = trainer_idle + rollout_idle * plan.layout.rollout_ranks / plan.dp
        if "rows_s" in rollout:  # --stream: how full the pool ran, and its decode steps' seconds
            pool = {"pool_rows_s": rollout["rows_s"], "pool_decode_s": rollout["decode_s"],
                    "pool_steps": rollout["steps"]}
    else:
        rollout_busy = phase("generate") + phase("eval")
        rollout_idle = step_s - rollout_busy
        # one device takes turns: it idles only while waiting on other ranks
        device_idle = max(0.0, step_s - rollout_busy - trainer_busy - phase("sync"))
    return {"trainer_busy": trainer_busy, "trainer_idle": trainer_idle, "rollout_busy": rollout_busy,
            "rollout_idle": rollout_idle, "device_idle": device_idle, **pool}


def placement_metrics(plan, total: dict, peak: dict) -> dict:
    """The placement/ metrics from a step's reduced sums (phase_metrics' over the trainers) and
    maxima: per role, the mean over the trainer ranks (partial: per sampler and per judge rank)."""
    out = {}
    for role in ("trainer_busy", "trainer_idle", "rollout_busy", "rollout_idle"):
        out[f"placement/{role}_s"] = total[role] / plan.dp
    if plan.mode == "partial":
        for role in ("sampler_busy", "sampler_idle"):
            out[f"placement/{role}_s"] = total[role] / plan.layout.sampler_ranks
        for role in ("judge_busy", "judge_idle"):
            out[f"placement/{role}_s"] = total[role] / plan.layout.judge
    out["placement/idle_share"] = total["device_idle"] / (plan.layout.world * peak["step_s"])
    if "pool_steps" in total:  # --stream: the live rows of a decode step, and its milliseconds (means)
        out["placement/pool_rows"] = total["pool_rows_s"] / max(1e-9, total["pool_decode_s"])
        out["placement/pool_step_ms"] = 1e3 * total["pool_decode_s"] / max(1.0, total["pool_steps"])
    out["placement/staleness_max"] = peak["staleness"]
    out["placement/staleness_mean"] = total["staleness"] / plan.dp
    return out


class Run:
    """This rank's run around the step loop: the resume point, the stop signals, rank 0's
    logger, and the counters of steps the guards skipped."""

    def __init__(self, args, plan, actor, reward, critic=None, arrival=None):
        """reward: the scorer (its last failure is the reason when every reward keeps failing);
        arrival: rebalance.Arrival, which after a --rebalance move in process carries the state (in
        place of a checkpoint) and rank 0's logger."""
        self.args, self.cfg, self.plan, self.actor, self.critic = args, args.run_args, plan, actor, critic
        self.reward = reward
        if arrival is not None and arrival.carried is not None:
            self.resumed = checkpoint.restore(actor, arrival.carried)
            arrival.carried = None  # the moved weights are in the model now: no second copy kept
        else:
            self.resumed = checkpoint.resume(self.cfg.run_dir, self.cfg.resume, actor, plan.rank, critic)
        self.start = self.resumed["step"]  # steps already done
        self.sigterm = False  # torchrun (or a scheduler) asks us to stop: save, then exit
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "sigterm", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "sigterm", True))  # Ctrl-C: the same
        self.stopped = False  # some rank was asked to stop: the same on every rank (reduced)
        self.skipped_steps = 0  # NaN/inf gradients
        self.unscored_steps = 0  # every reward failed
        self.log = arrival.log if arrival is not None else None
        if plan.rank == 0 and self.log is None:
            cfg = self.cfg
            self.log = Logger(cfg.run_dir, asdict(args), args.steps, cfg.track, cfg.wandb_project, self.start)

    def end_of_step(self, step: int, metrics: dict | None, trained, saved=({}, {})) -> bool:
        """After step `step` (0-based): stop together (skipped steps and SIGTERM are agreed over
        the trainers), log rank 0's `metrics`, stop on too many NaN or unscored steps, export and
        save when due. `trained`: the update's (sums, maxima), Totals, whose maxima hold the guards
        (skipped, unscored). `saved`: (meta.json extras, this rank's state) of the components that
        carry state. True: stop."""
        reward = self.reward
        cfg, rank = self.cfg, self.plan.rank
        guards = trained.maxes
        halt = dist.reduce({"skipped": guards["skipped"], "unscored": guards["unscored"],
                            "sigterm": self.sigterm}, op=MAX, group=self.plan.trainer_group)
        self.skipped_steps += int(halt["skipped"])
        self.unscored_steps += int(halt["unscored"])
        if rank == 0:
            metrics["reward/unscored_steps"] = self.unscored_steps
            metrics["train/skipped_steps"] = self.skipped_steps
            self.log.log(step, metrics)
        if self.skipped_steps > cfg.max_skipped_steps:
            raise UserError(f"stopping: {self.skipped_steps} steps had NaN/inf gradients "
                            f"(--max-skipped-steps {cfg.max_skipped_steps}); lower --lr or check the rewards "
                            f"and the data. {checkpoint.last_complete(cfg.run_dir)}")
        if self.unscored_steps > cfg.max_skipped_steps:
            raise UserError(f"stopping: in {self.unscored_steps} steps every reward failed "
                            f"(--max-skipped-steps {cfg.max_skipped_steps}); check --rewards "
                            f"{' '.join(reward.names)}: {reward.last_failure()}. "
                            f"{checkpoint.last_complete(cfg.run_dir)}")
        if cfg.save_hf_every and (step + 1) % cfg.save_hf_every == 0:
            path = os.path.join(cfg.run_dir, "hf", f"step_{step + 1}")
            export_hf(self.actor, path, rank, self.args.data.model)
        if halt["sigterm"] or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            checkpoint.save_and_report(cfg.run_dir, step + 1, self.actor, cfg.keep_last, rank, self.critic,
                                       extra=saved[0], rank_state=saved[1])
        self.stopped = bool(halt["sigterm"])
        return self.stopped

    def finish(self, engine, evaluate: Evaluator, exit_code: int | None = 0):
        """The end of the run. After the last step (not after a stop, or a move: `exit_code`
        nonzero, rebalance.MOVE_EXIT), the final policy goes to the engine for the last
        evaluation, then out as a HF checkpoint; rank 0 prints the summary and the picture.
        Then every rank leaves with `exit_code`; None (a --rebalance move in process): it returns,
        rank 0's logger open, for the next layout."""
        cfg, rank, steps = self.cfg, self.plan.rank, self.args.steps
        moved = exit_code != 0
        done = not (self.stopped or moved)
        if done:
            timer = Timer()
            placement.sync(self.plan, self.actor, engine, steps, timer)
            metrics = evaluate(steps, engine, timer)
            engine.release()
            if rank == 0:
                self.log.log(steps - 1, {"final": True, **metrics})
        if cfg.save_final and done:
            export_hf(self.actor, os.path.join(cfg.run_dir, "final"), rank, self.args.data.model)
        if exit_code is None:  # the handlers hold this Run (its actor): the next layout's Run sets its own
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            return
        if rank == 0:
            if not moved:
                final_dir = os.path.join(cfg.run_dir, "final") if cfg.save_final and done else None
                self.log.summary(final_dir, plot(cfg.run_dir))
            self.log.close()
        engine.close()  # before the process group: vLLM built its own groups on it; stops the rollout ranks
        dist.exit_now(exit_code)
