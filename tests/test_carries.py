"""builtin:carries (tasks/carries.py), the long-addition task with worked solutions: every line of
a solution is right and the last holds the answer the reward reads; the split is deterministic and
its eval items never train; and its completions have the shape issue 52 asks of a reasoning
workload, in tokens of a tokenizer trained on the task (the solutions, not yet a model's samples)."""
import re
import statistics

from models.tokenizer import Tokenizer, train_tokenizer
from tasks.carries import NAME, SYSTEM, carry_rows, worked
from tasks.data import load_rows
from tasks.rewards import accuracy

LINE = re.compile(r"column (\d+): ([\d + ]+) = (\d+), write (\d), carry (\d+)")


def test_every_line_of_a_worked_solution_is_right_and_the_reward_reads_its_answer():
    rows = carry_rows("train", n_train=2000)
    for r in rows:
        numbers = [int(x) for x in r["solution"].splitlines()[0].split(" + ")]
        assert sum(numbers) == int(r["answer"])
        written, carry = [], 0
        for no, line in enumerate(r["solution"].splitlines()[1:], 1):
            m = LINE.fullmatch(line)
            if m is None:
                break
            column, terms, total, digit, carry_out = m.groups()
            expected = [x // 10 ** (no - 1) % 10 for x in numbers if x >= 10 ** (no - 1) or no == 1]
            assert int(column) == no
            assert [int(t) for t in terms.split(" + ")] == expected + ([carry] if carry else []), line
            assert int(total) == sum(expected) + carry and int(digit) == int(total) % 10
            assert int(carry_out) == int(total) // 10
            written.append(digit)
            carry = int(carry_out)
        final = str(carry) if carry else ""
        assert final + "".join(reversed(written)) == r["answer"].lstrip("0") or r["answer"] == "0"
    rewards = accuracy(None, [r["solution"] for r in rows], [r["answer"] for r in rows])
    assert rewards == [1.0] * len(rows)
    # a wrong total scores 0
    assert accuracy(None, [worked([12, 30]).replace("#### 42", "#### 43")], ["42"]) == [0.0]


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
    train_tokenizer([SYSTEM] + [r["prompt"][1]["content"] + "\n" + r["solution"] for r in rows], str(tmp_path))
    tok = Tokenizer(str(tmp_path))
    lengths = sorted(len(tok.encode(r["solution"])) for r in rows)
    p95, median = lengths[int(0.95 * len(lengths))], statistics.median(lengths)
    assert statistics.mean(lengths) >= 40 and p95 >= 3 * median and lengths[-1] >= 200, (median, p95)
    assert len(tok.encode(SYSTEM)) >= 64
