"""The flags every train script shares (CleanRL's one dataclass, split by job: each is nested in a
script's `Args` with `Flat[...]`, so its flags keep their own names), and their checks, made before
any process group or model load: `parse` reads them, `check_flags` checks what GRPO and PPO share
and returns the layout, `check_models` reads the checkpoints and the user's callables.
"""
import functools
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, TypeVar

import torch
import tyro

import placement
from engines import tp
from engines.decode import SamplingParams
from engines.make import check_engine, engine_kind
from models.hf import checked_model, read_config
from tasks.data import BUILTIN
from utils import checkpoint, errors
from utils.errors import UserError, check_applies, check_rules

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
    """'builtin:arith', 'builtin:multiply' (a task that needs its tool: docs/tools.md), 'builtin:carries'
    (long additions worked out column by column: docs/reasoning.md), 'builtin:squares' (images:
    docs/vision.md), a local .jsonl/.json/.parquet file, or a hub dataset id"""
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
        ("micro_batch_size", args.micro_batch_size >= 1, "use 1 or more"),
        ("micro_batch_tokens", args.micro_batch_tokens >= 0, "use 0 (rows, padded) or more")])
    args.env.check()
    args.agent.check(args.env)
    args.distill.check()
    args.run_args.check()
    args.lora.check(args.sampling.engine, args.placement.placement)
    args.moe.check()
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
    engine = engine_kind(args.sampling.engine, "cuda" if torch.cuda.is_available() else "cpu")
    args.moe.check_model(read_config(args.data.model), args, engine)  # a MoE model's flags, what it refuses
