"""The reward role: rule verifiers, a format reward, and user functions.

A reward is a sum of weighted terms, each either built in or `module:function`:
    accuracy   1 if the completion's final answer equals the row's answer (last number,
               `\\boxed{}` or `#### answer`, as math datasets write it), else 0
    format     1 if the completion ended by itself (EOS or a stop string) with an answer in it
    code       1 if the completion's code (its last ```python block, or all of it) followed by
               the row's `tests` column exits cleanly in a sandbox: a separate process with a
               time limit, a memory limit, no network and its own PID namespace
    rm         a Bradley-Terry reward model's score (--reward-model DIR, roles/reward_model.py); the
               train script runs the model and hands its scores to `Reward.score`
    judge      a generative judge's verdict, +1 yes to -1 no averaged over its samples (--judge-model
               DIR, roles/judge.py); handed in the same way (NaN: the judge failed on that sample)
    pkg.mod:fn any function fn(prompts, completions, **columns) -> list[float]
A user function that raises is retried sample by sample; a sample that still fails scores 0
and is counted in the step's metrics (`reward/failures`); so does a call that runs past the
time limit (all its samples score 0). The wrong number of scores is a bug in the function,
so that is a clear error instead.
"""
import functools
import importlib
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile

import torch

from utils.errors import UserError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last \\boxed{...}, else what follows '####',
    else the last number in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip() or None
    nums = NUMBER.findall(text)
    return nums[-1] if nums else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def same_answer(pred: str | None, gold: str | None) -> bool:
    if pred is None or gold is None:
        return False
    norm = lambda s: s.replace(",", "").replace("$", "").strip().rstrip(".")  # noqa: E731
    p, g = norm(pred), norm(gold)
    try:
        return math.isclose(float(p), float(g), rel_tol=0, abs_tol=1e-6)
    except ValueError:
        return p == g


def accuracy(prompts, completions, answer, **_):
    return [float(same_answer(extract_answer(c), a)) for c, a in zip(completions, answer)]


def format_ok(prompts, completions, finish_reason, **_):
    return [float(r == "stop" and extract_answer(c) is not None) for c, r in zip(completions, finish_reason)]


CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def _limits(memory_mb: int, cpu_s: int):
    """Runs in the child between fork and exec: its own session, memory and CPU caps."""
    def apply():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_sandboxed(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> bool:
    """True if `code` runs to a clean exit inside the limits. util-linux's unshare(1) gives it
    a network namespace with nothing in it and a PID namespace of its own (it is PID 1 there
    and cannot see, signal or ptrace the trainer); rlimits cap memory and CPU; a wall-clock
    limit kills it. Whatever the code does, this process only sees a failed or killed child."""
    sandbox = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
    if os.getuid() != 0:  # unprivileged: a user namespace grants the right to make the others
        sandbox[1:1] = ["--user", "--map-root-user"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "main.py"), "w") as f:
            f.write(code)
        p = subprocess.Popen([*sandbox, sys.executable, "-I", "main.py"], cwd=tmp, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={"PATH": "/usr/bin:/bin"}, preexec_fn=_limits(memory_mb, int(timeout_s) + 1))
        try:
            return p.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the child's whole session: its own children too
            p.wait()
            return False


def check_sandbox():
    """Fails early, with the reason, where the sandbox cannot be built (no unshare(1), or no
    user namespaces for an unprivileged user)."""
    if not run_sandboxed("pass", timeout_s=30):
        raise UserError("the code reward's sandbox does not start here: it needs util-linux's `unshare` "
                        "and root or unprivileged user namespaces "
                        "(sysctl kernel.unprivileged_userns_clone=1)")


def code_passes(prompts, completions, tests, timeout_s=5.0, memory_mb=512, **_):
    out = []
    for c, t in zip(completions, tests):
        blocks = CODE_BLOCK.findall(c)
        code = blocks[-1] if blocks else c
        out.append(float(run_sandboxed(code + "\n" + (t or ""), timeout_s, memory_mb)))
    return out


BUILTIN = {"accuracy": accuracy, "format": format_ok, "code": code_passes}


def resolve(name: str):
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise UserError(f"reward {name!r}: use one of {sorted(BUILTIN)} or 'module:function'")
    module, fn = name.split(":", 1)
    try:
        return getattr(importlib.import_module(module), fn)
    except Exception as e:  # not found, or the module itself fails on import (a SyntaxError too)
        raise UserError(f"reward {name!r} could not be loaded: {type(e).__name__}: {e}") from None


class Reward:
    def __init__(self, names, weights=None, timeout_s: float = 60.0, code_timeout_s: float = 5.0,
                 code_memory_mb: int = 512):
        weights = list(weights) if weights else [1.0] * len(names)
        if len(weights) != len(names):
            raise UserError(f"{len(names)} reward functions but {len(weights)} --reward-weights")
        self.terms = [(n, None if n in ("rm", "judge") else resolve(n), w) for n, w in zip(names, weights)]
        self.timeout_s = timeout_s
        self.failures = {}  # reward name -> what the last of its failed samples raised
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
        total = torch.zeros(len(completions))
        failed = torch.zeros(len(completions), dtype=torch.bool)
        parts = {}
        for name, fn, w in self.terms:
            # the code term has its own per-sample limits, in the sandbox
            timeout_s = self.timeout_s
            if name == "code":
                timeout_s = None
            if name in ("rm", "judge"):
                given = rm if name == "rm" else judge
                scores, term_failed = given.tolist(), (~torch.isfinite(given)).tolist()
                scores = [0.0 if bad else v for v, bad in zip(scores, term_failed)]
            else:
                scores, term_failed = _call(name, fn, prompts, completions, columns, timeout_s, self.failures)
            parts[name] = torch.tensor(scores)
            total += w * parts[name]
            failed |= torch.tensor(term_failed, dtype=torch.bool)
        return total.masked_fill(failed, 0.0), parts, failed

    def last_failure(self) -> str:
        """What the reward functions' failed samples last raised, for a message."""
        seen = [f"{name}: {why}" for name, why in self.failures.items()]
        return "; ".join(seen) or "no exception: they timed out or returned NaN/inf"


class RewardTimeout(BaseException):
    """Not an Exception: a user function's `except Exception` cannot swallow it."""


def _alarm(*_):
    raise RewardTimeout()


def _call(name, fn, prompts, completions, columns, timeout_s, failures: dict):
    """fn's scores, and which samples failed (a failed one scores 0.0 here); what a failed
    sample raised goes to `failures[name]`."""
    if timeout_s:  # a Python function can't be killed, but it can be interrupted
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
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
    except RewardTimeout:
        return [0.0] * len(completions), [True] * len(completions)
    finally:
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
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
