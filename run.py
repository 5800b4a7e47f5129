"""What every train script does around its algorithm (CleanRL's "try not to modify" part):
the flags every run shares and their checks, set-up (the process group, the plan, the prompts,
the engine), the roles beside the algorithm (the actor, the reference, the reward model, the
teacher), the minibatch split, the held-out evaluation, a step's record and its reduction, and
`Run`: resume, the end of a step (the agreed stop, the NaN and unscored guards, HF exports,
checkpoints, SIGTERM) and the finish (the final evaluation, the export, the summary).
train_grpo.py and train_ppo.py use all of it, train_rm.py and train_flow_grpo.py parts; the
algorithm itself (its flags, loss, advantages and update) stays in each script.
"""
import functools
import math
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Annotated, ClassVar, Literal, NamedTuple, TypeVar

import torch
import tyro

import placement
from engines import episodes, tp
from engines.base import Samples
from engines.decode import SamplingParams
from engines.episodes import EnvArgs
from engines.make import check_engine, make_engine
from models import lora
from models.hf import checked_model, read_config
from models.tokenizer import Tokenizer
from models.vision import most_images
from rebalance import move
from roles.actor import Actor, export_hf
from roles.reference import Reference
from roles.reward import Reward
from roles.reward_model import RewardModel
from roles.rollout import serve
from roles.teacher import Teacher
from rollouts import RolloutResult
from tasks.data import BUILTIN, eval_source, load_rows, micro_batches, prompt_seed
from utils import checkpoint, dist, errors
from utils.errors import UserError, check_applies, check_rules
from utils.logger import Logger, Timer
from utils.plot import plot

MAX = torch.distributed.ReduceOp.MAX
T = TypeVar("T")
# a component's flags, nested in a script's Args under their own names (no prefix): Flat[JudgeArgs]
Flat = Annotated[T, tyro.conf.OmitArgPrefixes]


@dataclass
class DataArgs:
    """The policy and the prompts (GRPO and PPO)."""
    model: str = "assets/arith-tiny"
    """the policy's Hugging Face checkpoint: a local directory (config.json, *.safetensors,
    tokenizer.json) or a hub id (ORG/NAME, downloaded into the hub's cache; needs the network)"""
    dataset: str = BUILTIN
    """'builtin:arith', 'builtin:multiply' (a task that needs its tool: docs/tools.md), a local
    .jsonl/.json/.parquet file, or a hub dataset id"""
    prompt_column: str = "prompt"
    """dataset column holding the prompt (a string or a list of chat messages)"""
    answer_column: str | None = "answer"
    """dataset column holding the reference answer (none: reward functions get no answer)"""
    image_column: str | None = "auto"
    """dataset column holding each row's image or list of images, for a vision-language --model
    (Qwen2-VL: docs/vision.md): a path (relative to the dataset file's folder too), image bytes, or
    {'bytes', 'path'} as parquet stores images; auto: 'images', else 'image', else none; None: no images"""
    eval_dataset: str | None = None
    """--eval-every > 0: held-out prompts; default: the built-in task's eval split, or a hub id's 'test'
    split"""
    eval_every: int = 100
    """evaluate the held-out reward every this many steps (0: never)"""
    eval_prompts: int = 256
    """--eval-every > 0: at most this many held-out prompts per evaluation"""
    max_prompt_tokens: int = 256
    """longer prompts are skipped and counted (a prompt's image tokens count: it is never cut)"""
    freeze_vision: bool = False
    """a vision-language --model: train the language model only; the vision tower keeps its weights"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "eval_dataset": ("eval_every", lambda n: n > 0, "an --eval-every above 0"),
        "eval_prompts": ("eval_every", lambda n: n > 0, "an --eval-every above 0")}

    def check(self):
        check_rules(self, [
            ("eval_every", self.eval_every >= 0, "use 0 (never) or a number of steps"),
            ("eval_prompts", self.eval_prompts >= 1, "use 1 or more"),
            ("max_prompt_tokens", self.max_prompt_tokens >= 1, "use 1 or more")])

    def check_model(self, text_readers: dict | None = None):
        """The checkpoint; for a vision-language one, the components that would read its prompts as
        text (their image tokens without the images) are refused: text_readers {flag: its value}.
        For a text one, --image-column auto means none."""
        self.model = checked_model(self.model)
        if read_config(self.model).vision is None:
            if self.freeze_vision or self.image_column not in ("auto", None):
                flag = "--freeze-vision" if self.freeze_vision else f"--image-column {self.image_column}"
                raise UserError(f"{flag}: --model {self.model} is a text model (it takes no images); leave "
                                "the flag out")
            self.image_column = None
            return
        for flag, value in (text_readers or {}).items():
            if not value:
                continue
            if flag == "--teacher-model" and read_config(checked_model(value, flag)).vision is not None:
                continue  # a vision-language teacher sees the images too
            raise UserError(f"{flag} with a vision-language --model: it would read the prompts as text, "
                            "their image tokens without the images (not supported); leave it out")


@dataclass
class SamplingArgs:
    """How the policy samples its completions: their length, the sampling, the engine (GRPO and PPO)."""
    max_new_tokens: int = 8
    """completion length limit"""
    temperature: float = 1.0
    """sampling temperature (also applied to the trainer's log-probs)"""
    top_p: float = 1.0
    """nucleus sampling mass"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    engine: Literal["auto", "native", "vllm"] = "auto"
    """generation engine: auto = vLLM on GPU when installed, else native (docs/engines.md: vLLM on CPU)"""

    def check(self):
        check_rules(self, [
            ("max_new_tokens", self.max_new_tokens >= 1, "use 1 or more"),
            ("temperature", 0 < self.temperature < math.inf,
             "use a positive number (1.0: the model as it is)"),
            ("top_p", 0 < self.top_p <= 1, "use a number in (0, 1] (1.0: off)"),
            ("top_k", self.top_k >= 0, "use 0 (off) or a number of tokens")])

    def params(self, n: int) -> SamplingParams:
        """n completions per prompt, sampled as these flags say."""
        return SamplingParams(n, self.temperature, self.top_p, self.top_k, self.max_new_tokens)


@dataclass
class ComputeArgs:
    """How the models compute: FSDP2's parameter dtype and torch.compile (GRPO and PPO)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 MixedPrecisionPolicy param dtype (bf16 on GPU; gradients reduce in fp32)"""
    compile: bool = False
    """torch.compile each decoder block of the trained model(s) (torchtitan's per-block compile);
    the first steps pay the compile (see docs/benchmarks.md: A compiled step)"""

    @property
    def dtype(self) -> torch.dtype:
        """--param-dtype as a torch dtype."""
        return getattr(torch, self.param_dtype)


@dataclass
class RunArgs:
    """Where a run writes, how it resumes, logs and guards itself (GRPO and PPO)."""
    seed: int = 0
    """seeds init, data order and sampling (per prompt: results do not depend on the ranks)"""
    run_dir: str = "runs/grpo"
    """metrics.jsonl, config.json and the final policy (final/, HF format) go here"""
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
    """also export a HF checkpoint of the policy (run_dir/hf/step_N) every this many steps (0: off)"""
    max_skipped_steps: int = 10
    """a step whose gradients are NaN/inf is skipped and counted; after this many the run stops"""
    track: bool = False
    """log to wandb (pip install wandb)"""
    wandb_project: str = "rl-trainer"
    """--track: the wandb project's name"""
    timeout_s: float = 300.0
    """a collective waiting longer than this fails (a dead rank must not hang the job)"""
    APPLIES: ClassVar = {"wandb_project": ("track", bool, "--track")}  # (utils.errors.check_applies)

    def check(self):
        check_rules(self, [
            ("save_every", self.save_every >= 0, "use 0 (on SIGTERM only) or a number of steps"),
            ("keep_last", self.keep_last >= 1, "use 1 or more"),
            ("resume", self.resume in ("restart", "auto", "none") or checkpoint.is_complete(self.resume),
             "no complete checkpoint is at that path: use restart, auto, none or a complete checkpoint, "
             "run_dir/checkpoints/step_N"),
            ("save_hf_every", self.save_hf_every >= 0, "use 0 (off) or a number of steps"),
            ("max_skipped_steps", self.max_skipped_steps >= 0, "use 0 or more"),
            ("timeout_s", 0 < self.timeout_s < math.inf, "use a positive number of seconds")])
        writable_dir(self.run_dir, "--run-dir")
        if self.track:  # on every rank, before the process group: one line, not a broken collective
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise UserError("--track logs to wandb, which is not installed: pip install wandb (or drop "
                                "--track)") from None


def writable_dir(path: str, flag: str):
    """A directory this process can create (or write into), tried before any model loads: a
    temporary directory made and removed again in the nearest folder that exists, so that nothing
    is left behind by a run that refuses to start."""
    if os.path.isfile(path):
        raise UserError(f"{flag} {path}: use a directory (this is a file)")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    why = f"{parent} is a file" if not os.path.isdir(parent) else None
    try:
        if why is None:
            os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as e:
        why = f"{e.strerror} in {parent}"
    if why:
        raise UserError(f"{flag} {path}: cannot be created or written ({why}); pass a directory you can "
                        f"write")


def parse(flags_class, check_args):
    """The flags, checked before any process group or model load: a mistake ends the run with
    one line, `error: ...` (RL_DEBUG=1: a traceback)."""
    args = errors.cli(flags_class)
    errors.install()
    run_dir = getattr(getattr(args, "run_args", None), "run_dir", None)
    if run_dir is not None:  # a lost peer's message names the newest checkpoint in it
        errors.newest_checkpoint = functools.partial(checkpoint.newest_said, run_dir)
    check_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    return args


def check_optimizer(args):
    """The ranges of the optimizer's flags that GRPO, PPO and train_rm.py share."""
    check_rules(args, [  # (flag, holds, what is wrong and what to do: "use 1 or more")
        ("steps", args.steps >= 1, "use 1 or more"),
        ("lr", 0 < args.lr < math.inf, "use a positive learning rate such as 3e-4"),
        ("warmup_steps", args.warmup_steps >= 0, "use 0 or more"),
        ("max_grad_norm", 0 < args.max_grad_norm, "use a positive norm")])


def check_flags(args, world: int) -> placement.Layout:
    """The checks of the flags GRPO and PPO share (each script checks its own first): their ranges,
    the shared components' own checks, and the layout (rollout ranks, staleness, the batch split),
    which is returned, with the split of each trainer rank's completions into --minibatches."""
    args.data.check()
    args.sampling.check()
    check_optimizer(args)
    check_rules(args, [  # (flag, holds, what is wrong and what to do: "use 1 or more")
        ("prompts_per_step", args.prompts_per_step >= 1, "use 1 or more"),
        ("weight_decay", 0 <= args.weight_decay < math.inf, "use 0 or more"),
        ("clip_low", 0 <= args.clip_low < 1, "use a number in [0, 1)"),
        ("clip_high", 0 <= args.clip_high < math.inf, "use 0 or more"),
        ("kl_coef", 0 <= args.kl_coef < math.inf, "use 0 (no KL term) or more"),
        ("minibatches", args.minibatches >= 1, "use 1 or more"),
        ("micro_batch_size", args.micro_batch_size >= 1, "use 1 or more")])
    args.env.check()
    args.distill.check()
    args.run_args.check()
    args.lora.check(args.sampling.engine, args.placement.placement)
    # rollout ranks, staleness, the batch split
    layout = args.placement.layout_of(world, args.prompts_per_step)
    rows = args.prompts_per_step // layout.dp * args.num_generations  # completions per trainer rank
    if rows % args.minibatches:
        raise UserError(f"--minibatches {args.minibatches} does not split the {rows} completions each "
                        f"trainer rank trains per step: use a divisor of {rows}")
    return layout


def check_models(args, world: int, text_readers: dict | None = None):
    """What GRPO and PPO check last: a flag set where it does nothing, the engine installed, then
    the checkpoints (hub ids become their snapshots, computed at runtime; a vision-language --model
    refuses the components that would read its prompts as text: `text_readers`, {flag: its value})
    and what reads them: the reward terms, the teacher, the environment's chat template, --gen-tp."""
    check_applies(args)  # a flag set where it does nothing (each component lists its own: APPLIES)
    check_engine(args.sampling.engine, args.placement.placement)  # vLLM installed, before any rank needs it
    args.data.check_model(text_readers)
    args.reward.check(args.data)
    args.distill.check_model(args.data.model)
    args.env.check_model(args.data.model)  # the chat template carries an episode token for token
    tp.check_args(args, world)  # --gen-tp: the model's heads and MLP split over K ranks


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
                                  max_images=most_images(rows + eval_rows))
    local_engine = episodes.wrap(engine_of, args.env, tok, rows + eval_rows,
                                 args.sampling.max_new_tokens)  # --env: an episode's turns
    return cfg, tok, plan, (rows, skipped, eval_rows), local_engine


def make_actor(args, plan) -> Actor:
    """The trained policy of GRPO and PPO (roles/actor.py), from the flags they share."""
    decay_steps = args.steps if args.lr_schedule == "linear" else 0
    return Actor(args.data.model, plan.mesh, plan.device, args.lr, args.warmup_steps, args.weight_decay,
                 args.max_grad_norm, args.compute.dtype, args.sampling.temperature, args.micro_batch_size,
                 decay_steps, compile=args.compute.compile, lora=args.lora, seed=args.run_args.seed,
                 freeze_vision=args.data.freeze_vision)


def frozen_roles(args, plan, actor) -> tuple:
    """The roles GRPO and PPO hold beside the trained ones, which never train: the reference
    (--kl-coef > 0), the reward model (--reward-model) and the teacher (without a --teacher-model
    it does nothing). -> (reference or None, reward model or None, teacher)"""
    device, param_dtype = plan.device, args.compute.dtype
    temperature, micro_batch_size = args.sampling.temperature, args.micro_batch_size
    ref = None
    if args.kl_coef > 0 and args.lora.lora_rank:
        ref = lora.Reference(actor)  # the actor with its adapters off: no second model
    elif args.kl_coef > 0:
        ref = Reference(args.data.model, plan.mesh, device, param_dtype, temperature, micro_batch_size)
    rm = None
    if args.reward.reward_model:
        rm = RewardModel(args.reward.reward_model, plan.mesh, device, param_dtype, micro_batch_size)
    return ref, rm, Teacher(args.distill, plan, device, param_dtype, temperature, micro_batch_size)


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
    parts = {f"reward/{name}": part[~failed].sum() for name, part in got.parts.items()}
    total = dist.reduce(group=plan.trainer_group, values={
        **sums, **parts, **phase_metrics(plan, engine, timer.seconds, step_s, got.tally),
        "reward": rewards.sum(), "failures": failed.sum(), "scored": (~failed).sum(),
        "len": out.lengths.sum(),
        "truncated": out.finish_reasons.count("length"), "staleness": staleness, "completions": len(rewards),
        "completion_tokens": mask.sum(), **episodes.sums(out)})
    s = timer.seconds
    peak = dist.reduce(op=MAX, group=plan.trainer_group, values={
        **maxes, "gen_s": s["generate"], "ref_s": s.get("reference", 0.0), "rm_s": s.get("reward_model", 0.0),
        "train_s": s["train"], "mem_gib": dist.peak_memory_gib(plan.device),
        "mem_added_gib": dist.memory_added_gib(plan.device), "step_s": step_s, "staleness": staleness})
    return total, peak


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
    metrics.update(episodes.metrics(total))  # multi-turn episodes: turns, tool calls and errors, stops
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
    if plan.mode == "disaggregate":
        rollout = engine.take_stats()  # the rollout rank's seconds since the last step
        rollout_busy = rollout["busy_s"] + rollout["sync_s"]
        rollout_idle = rollout["idle_s"]
        device_idle = trainer_idle + rollout_idle * plan.layout.rollout_ranks / plan.dp
    else:
        rollout_busy = phase("generate") + phase("eval")
        rollout_idle = step_s - rollout_busy
        # one device takes turns: it idles only while waiting on other ranks
        device_idle = max(0.0, step_s - rollout_busy - trainer_busy - phase("sync"))
    return {"trainer_busy": trainer_busy, "trainer_idle": trainer_idle, "rollout_busy": rollout_busy,
            "rollout_idle": rollout_idle, "device_idle": device_idle}


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
        guards = trained[1]
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
