"""The reward role: rule verifiers, a format reward, and user functions.

A reward is a sum of weighted terms, each either built in or `module:function`:
    accuracy   1 if the completion's final answer equals the row's answer (last number,
               `\\boxed{}` or `#### answer`, as math datasets write it), else 0
    format     1 if the completion ended by itself (EOS or a stop string) with an answer in it
    pkg.mod:fn any function fn(prompts, completions, **columns) -> list[float]
A user function that raises is retried sample by sample; a sample that still fails scores 0
and is counted in the step's metrics (`reward/failures`). The wrong number of scores is a
bug in the function, so that is a clear error instead.
"""
import importlib
import math
import re

import torch

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


BUILTIN = {"accuracy": accuracy, "format": format_ok}


def resolve(name: str):
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"reward {name!r}: use one of {sorted(BUILTIN)} or 'module:function'")
    module, fn = name.split(":", 1)
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {name!r} could not be loaded: {e}") from e


class Reward:
    def __init__(self, names, weights=None):
        weights = list(weights) if weights else [1.0] * len(names)
        if len(weights) != len(names):
            raise ValueError(f"{len(names)} reward functions but {len(weights)} --reward-weights")
        self.terms = [(n, resolve(n), w) for n, w in zip(names, weights)]

    def score(self, prompts: list, completions: list[str], columns: dict[str, list]):
        """One score per completion; columns hold per-completion lists (answer, finish_reason,
        and any other dataset column). Returns (rewards [N], {term name: [N]}, failures)."""
        total = torch.zeros(len(completions))
        parts, failures = {}, 0
        for name, fn, w in self.terms:
            scores, failed = _call(name, fn, prompts, completions, columns)
            parts[name] = torch.tensor(scores)
            total += w * parts[name]
            failures += failed
        return total, parts, failures


def _call(name, fn, prompts, completions, columns):
    try:
        out = fn(prompts, completions, **columns)
    except Exception:  # isolate the failing samples: one bad sample must not zero the batch
        out, failed = [], 0
        for i in range(len(completions)):
            try:
                [v] = fn(prompts[i:i + 1], completions[i:i + 1], **{k: c[i:i + 1] for k, c in columns.items()})
                if not math.isfinite(float(v)):
                    raise ValueError("non-finite score")
                out.append(float(v))
            except Exception:
                out.append(0.0)
                failed += 1
        return out, failed
    if len(out) != len(completions):
        raise ValueError(f"reward function {name!r} returned {len(out)} scores for {len(completions)} completions; "
                         "it must return one float per completion")
    out = [float(v) for v in out]
    bad = sum(not math.isfinite(v) for v in out)  # NaN/inf scores count as failures, score 0
    return [v if math.isfinite(v) else 0.0 for v in out], bad
