"""The built-in reasoning task, 'builtin:carries' (issue 52, its first part): long addition written
out column by column, so that a completion is a chain of steps whose length the item sets.

A problem adds 2 to 4 numbers of 1 to 12 digits. The worked solution (`worked`) first restates
the sum, then takes the columns from the right, one line each: the column's digits, the carry
from the column before, their sum, the digit written and the carry passed on; the last line is
'#### ' and the total, which roles/reward.py's `accuracy` reads (`tasks/rewards.py`
`extract_answer`). Most items are short and a few long (`digits` is drawn with a long tail), so a
batch's completions differ in length by 10x and more, the shape reasoning RL trains on.

Every prompt is a chat whose system message, the same for all items, states the method: the
prefix a group's samples (and a whole batch) share. Deterministic in the seed; no eval item is in
train.
"""
import random

NAME = "builtin:carries"
SYSTEM = ("You add whole numbers the long way, one column at a time, and show every step. First "
          "write the sum as given. Then, starting from the rightmost column, write one line per "
          "column: the digits of that column added together with the carry from the column before, "
          "the total of that column, the digit you write down and the carry you pass on to the next "
          "column. A number that has no digit in a column adds nothing there. After the last column, "
          "write the final carry if it is not zero. End with a line that holds four hash signs and "
          "the answer, for example: #### 1234")
MAX_DIGITS = 12


def draw_digits(rng: random.Random) -> int:
    """How long the numbers are: 1 to MAX_DIGITS digits, short ones most often (a geometric tail),
    so a few items are many times longer than the median one."""
    digits = 1
    while digits < MAX_DIGITS and rng.random() < 0.72:
        digits += 1
    return digits


def problem(rng: random.Random) -> list[int]:
    """2 to 4 numbers; the first has the drawn length, the others up to it."""
    digits = draw_digits(rng)
    count = rng.choice((2, 2, 2, 3, 3, 4))
    first = rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)
    return [first] + [rng.randrange(10 ** rng.randint(1, digits)) for _ in range(count - 1)]


def worked(numbers: list[int]) -> str:
    """The worked solution of the sum of `numbers`, column by column from the right."""
    lines = [" + ".join(map(str, numbers))]
    width = max(len(str(x)) for x in numbers)
    carry = 0
    for column in range(width):
        digits = [x // 10 ** column % 10 for x in numbers if x >= 10 ** column or column == 0]
        total = sum(digits) + carry
        terms = " + ".join(map(str, digits + ([carry] if carry else [])))
        lines.append(f"column {column + 1}: {terms} = {total}, write {total % 10}, carry {total // 10}")
        carry = total // 10
    if carry:
        lines.append(f"final carry: write {carry}")
    lines.append(f"#### {sum(numbers)}")
    return "\n".join(lines)


def row(numbers: list[int]) -> dict:
    """A dataset row: the chat prompt, the answer, and the worked solution (the warm start's target)."""
    question = "Add " + ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}."
    return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "answer": str(sum(numbers)), "solution": worked(numbers)}


def carry_rows(split: str, seed: int = 0, n_train: int = 20000, n_eval: int = 256) -> list[dict]:
    """Deterministic in `seed`; the eval split's problems never appear in train."""
    rng, evals = random.Random(f"carries-eval-{seed}"), {}
    while len(evals) < n_eval:
        numbers = problem(rng)
        evals[tuple(numbers)] = row(numbers)
    if split == "eval":
        return list(evals.values())
    rng, train = random.Random(f"carries-train-{seed}"), []
    while len(train) < n_train:
        numbers = problem(rng)
        if tuple(numbers) not in evals:
            train.append(row(numbers))
    return train
