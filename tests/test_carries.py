"""builtin:carries (tasks/carries.py), the long-addition task with worked solutions: every line of
a solution is right and the last holds the answer the reward reads; the split is deterministic and
its eval items never train; and its completions have the shape issue 52 asks of a reasoning
workload, in tokens of a tokenizer trained on the task (the solutions, not yet a model's samples)."""
import json
import os
import re
import statistics

from assets.carries import carries_checkpoint
from models.tokenizer import Tokenizer, train_tokenizer
from tasks.carries import NAME, SYSTEM, carry_rows, worked
from tasks.data import load_rows
from tasks.rewards import accuracy
from utils.logger import read_metrics

from launch import ROOT, torchrun

MODEL = os.path.join(ROOT, "assets", "carries-tiny")
STEPS = 12

LINE = re.compile(r"(\d+(?: \+ \d+)*): (\d+(?: \+ \d+)*) = (\d+), carry (\d+), so far (\d+)")


def check_solution(numbers: list[int], solution: str):
    """Every line of `solution` against the method, recomputed here from `numbers`."""
    rest, carry, so_far = [str(x) for x in numbers], 0, ""
    lines = solution.splitlines()
    while rest:
        m = LINE.fullmatch(lines.pop(0))
        assert m is not None
        left, terms, total, carry_out, said = m.groups()
        assert left.split(" + ") == rest  # what is left of the numbers
        digits = [int(x[-1]) for x in rest]
        assert [int(t) for t in terms.split(" + ")] == digits + ([carry] if carry else [])
        assert int(total) == sum(digits) + carry and int(carry_out) == int(total) // 10
        carry, so_far = int(carry_out), str(int(total) % 10) + so_far
        assert said == so_far
        rest = [x[:-1] for x in rest if len(x) > 1]
    if carry:
        assert lines.pop(0) == f"final carry {carry}, so far {carry}{so_far}"
    assert lines == [f"#### {sum(numbers)}"]


def test_every_line_of_a_worked_solution_is_right_and_the_reward_reads_its_answer():
    rows = carry_rows("train", n_train=2000)
    for r in rows:
        numbers = [int(x) for x in r["solution"].split(":")[0].split(" + ")]
        question = "Add " + ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}."
        assert r["prompt"][1]["content"] == question
        assert sum(numbers) == int(r["answer"])
        check_solution(numbers, r["solution"])
    rewards = accuracy(None, [r["solution"] for r in rows], [r["answer"] for r in rows])
    assert rewards == [1.0] * len(rows)
    assert worked([987, 56]).splitlines() == ["987 + 56: 7 + 6 = 13, carry 1, so far 3",
                                              "98 + 5: 8 + 5 + 1 = 14, carry 1, so far 43",
                                              "9: 9 + 1 = 10, carry 1, so far 043",
                                              "final carry 1, so far 1043", "#### 1043"]
    # the rule reads the answer only: a wrong total scores 0 whatever the working, and a right one
    # scores 1 even after wrong working (no rule checks the lines; a model that learns to skip them
    # shows as shorter completions, which the run's length metrics show)
    assert accuracy(None, [worked([12, 30]).replace("#### 42", "#### 43")], ["42"]) == [0.0]
    assert accuracy(None, [worked([12, 30]).replace("2 + 0 = 2", "2 + 0 = 3")], ["42"]) == [1.0]


def test_the_split_is_deterministic_and_eval_items_never_train():
    evals, train = carry_rows("eval"), carry_rows("train", n_train=5000)
    assert evals == carry_rows("eval") and len(evals) == 256
    asked = {r["prompt"][1]["content"] for r in evals}
    assert not asked & {r["prompt"][1]["content"] for r in train}
    rows = load_rows(NAME, "eval", "prompt", "answer")
    assert [r["answer"] for r in rows] == [r["answer"] for r in evals]
    assert all(r["prompt"][0] == {"role": "system", "content": SYSTEM} for r in rows)


def test_completions_are_long_and_uneven_and_prompts_share_a_long_prefix(tmp_path):
    """Issue 52's targets for the workload: mean completion >= 40 tokens, the 95th percentile >= 3x
    the median, some >= 200 tokens, a shared system prompt >= 64 tokens."""
    rows = carry_rows("train", n_train=4000)
    texts = [SYSTEM] + [r["prompt"][1]["content"] + "\n" + r["solution"] for r in rows]
    train_tokenizer(texts, str(tmp_path))
    tok = Tokenizer(str(tmp_path))
    lengths = sorted(len(tok.encode(r["solution"])) for r in rows)
    p95, median = lengths[int(0.95 * len(lengths))], statistics.median(lengths)
    assert statistics.mean(lengths) >= 40 and p95 >= 3 * median and lengths[-1] >= 200, (median, p95)
    assert len(tok.encode(SYSTEM)) >= 64


def test_a_slipped_solution_follows_from_its_wrong_totals():
    """The warm start's noisy steps (assets/carries.py): a slipped total is one off, and the rest of
    the working follows from it, so the answer is wrong the way a careless student's is."""
    solution = worked([987, 56], slip=lambda total: total + 1)
    assert solution.splitlines() == ["987 + 56: 7 + 6 = 14, carry 1, so far 4",
                                     "98 + 5: 8 + 5 + 1 = 15, carry 1, so far 54",
                                     "9: 9 + 1 = 11, carry 1, so far 154",
                                     "final carry 1, so far 1154", "#### 1154"]
    assert accuracy(None, [solution], ["1043"]) == [0.0]
    assert worked([987, 56], slip=lambda total: total) == worked([987, 56])


def test_the_tiny_model_builder_is_reproducible(tmp_path):
    """assets/carries.py, a few steps of each phase twice: the same bytes; and the slips alone from
    build a's clean model (--clean-out, then --from-clean) give those bytes too."""
    a, b, c, clean = (tmp_path / x for x in ("a", "b", "c", "clean"))
    carries_checkpoint(str(a), sft_steps=3, noisy_steps=2, batch=4, clean_out=str(clean))
    carries_checkpoint(str(b), sft_steps=3, noisy_steps=2, batch=4)
    carries_checkpoint(str(c), sft_steps=0, noisy_steps=2, batch=4, from_clean=str(clean))  # no clean steps
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        for other in (b, c):
            assert (a / name).read_bytes() == (other / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (clean / "model.safetensors").read_bytes()


def test_a_short_grpo_run_on_carries_raises_the_training_reward(tmp_path):
    """GRPO on 2 ranks from assets/carries-tiny, the same 8 short sums every step (2-3 lines of
    working: the run stays under a minute): the mean training reward of the last 5 steps is clearly
    above that of the first 5. Measured 0.603 -> 0.750 in 12 steps on the rebuilt carries-tiny
    (2026-12-07; the same under ATEN_CPU_CAPABILITY=default and RL_THREADS=2); the threshold, +0.1,
    leaves room for another CPU's rounding and for sampling noise (8 prompts x 8 samples)."""
    rows = [r for r in carry_rows("train") if len(r["solution"].splitlines()) in (3, 4)][:8]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    run = str(tmp_path / "run")
    torchrun(2, "train_grpo.py", "--model", MODEL, "--dataset", str(data), "--max-new-tokens", "512",
             "--prompts-per-step", "8", "--num-generations", "8", "--lr", "2e-4", "--micro-batch-size", "8",
             "--steps", str(STEPS), "--eval-every", "0", "--save-every", "0", "--no-save-final",
             "--run-dir", run, timeout=120)
    steps = read_metrics(os.path.join(run, "metrics.jsonl"))
    rewards = [r["rollout/reward"] for r in steps if not r.get("final")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert len(rewards) == STEPS and last > first + 0.1, (first, last)
