"""The built-in reward terms for text (`--rewards accuracy,format,code`), each
`fn(prompts, completions, **columns) -> list[float]` as a user's `module:function` is; roles/reward.py
weighs and sums them (tasks/image_rewards.py holds the image task's).
"""
import math
import re

from utils.sandbox import run_sandboxed

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


def accuracy(prompts, completions, answer, **_):  # a whole completion may be the answer too (a word)
    return [float(same_answer(extract_answer(c), a) or same_answer(c, a))
            for c, a in zip(completions, answer)]


def format_ok(prompts, completions, finish_reason, **_):
    return [float(r == "stop" and extract_answer(c) is not None) for c, r in zip(completions, finish_reason)]


CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def code_passes(prompts, completions, tests, timeout_s=5.0, memory_mb=512, **_):
    out = []
    for c, t in zip(completions, tests):
        blocks = CODE_BLOCK.findall(c)
        code = blocks[-1] if blocks else c
        out.append(float(run_sandboxed(code + "\n" + (t or ""), timeout_s, memory_mb)))
    return out


REWARDS = {"accuracy": accuracy, "format": format_ok, "code": code_passes}
