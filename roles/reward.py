"""The reward: not a rank's role but a component every trainer holds. `Scorer` scores a rollout's
samples from the reward's terms, calling the reward-model and judge roles where the terms name them.
It lives with the roles because it drives two of them.

A reward is a sum of weighted terms, each either built in or `module:function`:
    accuracy   1 if the completion's final answer equals the row's answer (last number,
               `\\boxed{}` or `#### answer`, as math datasets write it) or the completion is the answer
    format     1 if the completion ended by itself (EOS or a stop string) with an answer in it
    code       1 if the completion's code (its last ```python block, or all of it) followed by
               the row's `tests` column exits cleanly in a sandbox: a separate process with a
               time limit, a memory limit, no network and its own PID namespace (utils/sandbox.py)
    rm         a Bradley-Terry reward model's score (--reward-model DIR, roles/reward_model.py)
    judge      a generative judge's verdict, +1 yes to -1 no averaged over its samples (--judge-model
               DIR, roles/judge.py; NaN: the judge failed on that sample)
    pkg.mod:fn any function fn(prompts, completions, **columns) -> list[float], every dataset column
               and finish_reason by keyword (checked against that call before the steps: check_reward)
    http://... a reward service: the same arguments POSTed as JSON, one number per completion read
               back, with --reward-timeout-s and --reward-retries (tasks/remote.py)
A user function that raises is retried sample by sample; a sample that still fails scores 0 and is
counted in the step's metrics (`reward/failures`); so does a call that runs past the time limit
(all its samples score 0). The wrong number of scores is a bug in the function: a clear error.
"""
import functools
import importlib
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from models.hf import local_dir
from rl import algos
from roles import reward_model
from roles.judge import judge_chunk
from tasks.data import dataset_columns, make_batch, per_sample
from tasks.remote import HttpReward, is_service
from tasks.rewards import REWARDS
from utils.callables import check_reward
from utils.errors import UserError, check_rules
from utils.sandbox import TimeLimit, check_sandbox, time_limit


def resolve(name: str, timeout_s: float = 60.0, retries: int = 2):
    """A --rewards term's function: built in, a reward service's URL (tasks/remote.py), or
    'module:function' imported."""
    if name in REWARDS:
        return REWARDS[name]
    if is_service(name):  # each try gets its share of the call's time limit
        return HttpReward(name, 0.9 * timeout_s / (retries + 1), retries)
    if ":" not in name:
        raise UserError(f"reward {name!r}: use one of {sorted(REWARDS)} or 'module:function'")
    module, fn = name.split(":", 1)
    try:
        return getattr(importlib.import_module(module), fn)
    except Exception as e:  # not found, or the module itself fails on import (a SyntaxError too)
        raise UserError(f"reward {name!r} could not be loaded: {type(e).__name__}: {e}") from None


@dataclass
class RewardArgs:
    rewards: tuple[str, ...] = ("accuracy",)
    """reward terms: accuracy, format, code, rm (the --reward-model), judge (the --judge-model,
    train_grpo.py), or module:function (fn(prompts, completions, **columns))"""
    reward_weights: tuple[float, ...] = ()
    """one weight per reward term (default: all 1)"""
    reward_model: str | None = None
    """a Bradley-Terry reward model (a HF ...ForSequenceClassification checkpoint with the policy's
    tokenizer; train_rm.py trains one): the `rm` term of --rewards"""
    reward_timeout_s: float = 60.0
    """a reward function call running longer scores 0 for its samples (counted in reward/failures); an
    http:// term's request too"""
    reward_retries: int = 2
    """an http:// term: tries again after a connection error, a timeout, HTTP 429 or 5xx, this many times"""
    code_timeout_s: float = 5.0
    """--rewards code: the code reward's wall-clock limit per completion (sandboxed process)"""
    code_memory_mb: int = 512
    """--rewards code: the code reward's memory limit per completion"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "reward_retries": ("rewards", lambda terms: any(map(is_service, terms)),
                           "an http:// term of --rewards"),
        "code_timeout_s": ("rewards", lambda terms: "code" in terms, "the `code` term of --rewards"),
        "code_memory_mb": ("rewards", lambda terms: "code" in terms, "the `code` term of --rewards")}

    def check(self, data):
        """The flags, then (a hub id becomes its snapshot) the reward model's checkpoint."""
        check_rules(self, [
            ("rewards", len(self.rewards) >= 1, "use at least one reward term"),
            ("reward_weights", len(self.reward_weights) in (0, len(self.rewards)),
             f"use one weight per --rewards term ({len(self.rewards)}), or none"),
            ("reward_model", (self.reward_model is None) == ("rm" not in self.rewards),
             "a reward model and the `rm` term of --rewards go together: give both, or neither"),
            ("reward_timeout_s", self.reward_timeout_s > 0, "use a positive number of seconds"),
            ("reward_retries", self.reward_retries >= 0, "use 0 or more"),
            ("code_timeout_s", self.code_timeout_s > 0, "use a positive number of seconds"),
            ("code_memory_mb", self.code_memory_mb >= 32, "use 32 or more")])
        if "accuracy" in self.rewards and data.answer_column is None:
            raise UserError("--rewards accuracy compares each completion with the row's answer: pass "
                            "--answer-column, or use other --rewards")
        if self.reward_model:
            self.reward_model = local_dir(self.reward_model, "--reward-model")
            reward_model.check(self.reward_model, data.model)

    def check_rows(self, rows: list[dict]):
        """What the terms read from the rows, once before the steps: one error now, not every sample
        failing. The code term needs a `tests` column; a module:function term is called with every
        column by keyword (`check_reward`)."""
        if "code" in self.rewards and "tests" not in rows[0]:
            raise UserError(f"--rewards code runs each completion with its row's `tests` column, which the "
                            f"dataset has not (its columns: {', '.join(sorted(rows[0]))}): add one, or use "
                            f"other --rewards")
        columns = [*dataset_columns(rows[:1], 1), "finish_reason"]  # what Scorer.score passes
        for name in self.rewards:
            # (a reward service's URL has no function to check)
            if name not in REWARDS and name not in ("rm", "judge") and not is_service(name):
                check_reward(resolve(name), name, columns)


@dataclass
class OverlongArgs:
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: the reward falls linearly by up to --overlong-penalty over the last
    this many tokens before --max-new-tokens (0: off)"""
    overlong_penalty: float = 1.0
    """--overlong-buffer > 0: the reward lost by a completion that reaches --max-new-tokens (DAPO's soft
    overlong penalty)"""
    mask_truncated: bool = False
    """completions cut off at --max-new-tokens leave the loss (DAPO's overlong filtering)"""
    APPLIES: ClassVar = {"overlong_penalty": ("overlong_buffer", lambda n: n > 0, "an --overlong-buffer > 0")}

    def check(self, max_new_tokens: int):
        check_rules(self, [
            ("overlong_buffer", 0 <= self.overlong_buffer <= max_new_tokens,
             f"use 0 (off) or a number of tokens up to --max-new-tokens ({max_new_tokens})"),
            ("overlong_penalty", 0 <= self.overlong_penalty < math.inf, "use 0 or more")])


class Scorer:
    """The component: this controller's rewards of its own samples, from its rollout's output: the
    reward model on their token ids, the judge on their text (unless the partial placement judged
    them already), then the terms' sum (`Reward.score`), plus DAPO's overlong penalty
    (--overlong-buffer)."""

    def __init__(self, cfg: RewardArgs, rm, judge, pad_id: int, device, max_new_tokens: int,
                 overlong: OverlongArgs | None = None):
        self.names, self.rm, self.judge, self.pad_id, self.device = cfg.rewards, rm, judge, pad_id, device
        self.max_new_tokens, self.overlong = max_new_tokens, overlong or OverlongArgs()
        self.reward = Reward(cfg.rewards, cfg.reward_weights, cfg.reward_timeout_s, cfg.code_timeout_s,
                             cfg.code_memory_mb, cfg.reward_retries)

    def score(self, rows, seeds, out, judged, n: int, timer, tally: dict):
        """rows, seeds: one per prompt; out: n samples each; judged [N] or None. Returns
        (rewards [N], {term: [N]}, failed [N] bool: no reward)."""
        if self.judge and judged is None:
            with timer("judge"):
                self.judge.load()
                judged, unparsed = judge_chunk(self.judge, rows, seeds, out, n)  # [N]
                self.judge.release()
            tally["judge_unparsed"] += unparsed
            tally["judge_verdicts"] += self.judge.params.n * len(out.texts)
        rm_scores = None
        if self.rm:
            with timer("reward_model"):
                prompt_ids = per_sample([r["ids"] for r in rows], n)
                batch = make_batch(prompt_ids, out.tokens, out.lengths, self.pad_id, self.device)
                rm_scores = self.rm.score(batch)  # [N]
        with timer("reward"):
            columns = dataset_columns(rows, n)  # answer and the rest, one value per completion
            columns["finish_reason"] = out.finish_reasons
            prompts = per_sample([r["prompt"] for r in rows], n)
            rewards, parts, failed = self.reward.score(prompts, out.texts, columns, rm_scores, judged)
            if out.episode:  # multi-turn episodes: the environment's own rewards, summed over its turns
                if "failed" in out.episode:  # --agent: a failed episode has no reward, and leaves the loss
                    failed = failed | (out.episode["failed"] > 0)
                    rewards = rewards.masked_fill(failed, 0.0)
                parts["env"] = out.episode["env_reward"] * ~failed
                rewards = rewards + parts["env"]
            cfg = self.overlong
            if cfg.overlong_buffer:  # DAPO: a soft penalty for running into the length limit
                penalty = algos.overlong_penalty(out.lengths, self.max_new_tokens, cfg.overlong_buffer,
                                                 cfg.overlong_penalty)  # [N]
                parts["overlong"] = penalty * ~failed
                rewards = rewards + parts["overlong"]
        return rewards, parts, failed

    def last_failure(self) -> str:
        if self.judge and self.judge.last_error:
            return f"the judge: {self.judge.last_error}"
        return self.reward.last_failure()


class Reward:
    """The reward's terms and their weighted sum over completions' text (and the rm and judge
    scores, when given): what `Scorer` calls after it has run the reward model and the judge, and
    what teach_grpo.py calls alone (its one term, accuracy)."""

    def __init__(self, names, weights=None, timeout_s: float = 60.0, code_timeout_s: float = 5.0,
                 code_memory_mb: int = 512, retries: int = 2):
        weights = list(weights) if weights else [1.0] * len(names)
        if len(weights) != len(names):
            raise UserError(f"{len(names)} reward functions but {len(weights)} --reward-weights")
        self.terms = [(n, None if n in ("rm", "judge") else resolve(n, timeout_s, retries), w)
                      for n, w in zip(names, weights)]
        self.names, self.timeout_s, self.failures = list(names), timeout_s, {}  # failures: name -> its error
        if "code" in names:
            check_sandbox()
            self.terms = [(n, functools.partial(fn, timeout_s=code_timeout_s, memory_mb=code_memory_mb)
                           if n == "code" else fn, w) for n, fn, w in self.terms]

    def score(self, prompts: list, completions: list[str], columns: dict[str, list], rm=None, judge=None):
        """One score per completion; columns hold per-completion lists (answer, finish_reason,
        and any other dataset column); rm, judge [N]: the reward model's and the judge's scores.
        Returns (rewards [N], {term name: [N]}, failed [N] bool): a sample whose term raised,
        timed out or gave NaN/inf has no reward (it reads 0 here; the trainer leaves it out of its
        group's statistics and of the loss)."""
        total, parts = torch.zeros(len(completions)), {}
        failed = torch.zeros(len(completions), dtype=torch.bool)
        for name, fn, w in self.terms:
            timeout_s = None if name == "code" else self.timeout_s  # code: its own limits, in the sandbox
            if name in ("rm", "judge"):
                given = rm if name == "rm" else judge
                scores, term_failed = given.tolist(), (~torch.isfinite(given)).tolist()
                scores = [0.0 if bad else v for v, bad in zip(scores, term_failed)]
            else:
                scores, term_failed = _call(name, fn, prompts, completions, columns, timeout_s, self.failures)
                if any(term_failed) and getattr(fn, "last_error", None):  # a reward service's failure
                    self.failures[name] = fn.last_error
            parts[name] = torch.tensor(scores)
            total += w * parts[name]
            failed |= torch.tensor(term_failed, dtype=torch.bool)
        return total.masked_fill(failed, 0.0), parts, failed

    def last_failure(self) -> str:
        """What the reward functions' failed samples last raised, for a message."""
        seen = [f"{name}: {why}" for name, why in self.failures.items()]
        return "; ".join(seen) or "no exception: they timed out or returned NaN/inf"


def _call(name, fn, prompts, completions, columns, timeout_s, failures: dict):
    """fn's scores, and which samples failed (a failed one scores 0.0 here); what a failed
    sample raised goes to `failures[name]`."""
    try:
        with time_limit(timeout_s):
            try:
                out = fn(prompts, completions, **columns)
            except Exception:  # isolate the failing samples: one bad sample must not zero the batch
                out, failed = [], []
                for i in range(len(completions)):
                    try:
                        one = {k: c[i:i + 1] for k, c in columns.items()}
                        [v] = fn(prompts[i:i + 1], completions[i:i + 1], **one)
                        if not math.isfinite(float(v)):
                            raise ValueError("non-finite score")
                        out.append(float(v))
                        failed.append(False)
                    except Exception as e:
                        out.append(0.0)
                        failed.append(True)
                        failures[name] = f"{type(e).__name__}: {e}"
                return out, failed
    except TimeLimit:
        return [0.0] * len(completions), [True] * len(completions)
    if not hasattr(out, "__len__") or isinstance(out, str):
        raise UserError(f"reward function {name!r} returned {out!r}: it must return one float per "
                        f"completion, a list of {len(completions)} here (is its `return` missing?)")
    if len(out) != len(completions):
        raise UserError(f"reward function {name!r} returned {len(out)} scores for {len(completions)} "
                        "completions; it must return one float per completion")
    try:
        out = [float(v) for v in out]
    except (TypeError, ValueError):
        raise UserError(f"reward function {name!r} returned {out[:4]!r}...: it must return one float per "
                        "completion") from None
    failed = [not math.isfinite(v) for v in out]  # NaN/inf scores are failures
    return [0.0 if bad else v for v, bad in zip(out, failed)], failed
