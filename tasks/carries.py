"""The built-in reasoning task, 'builtin:carries' (issue 52): long addition written out column by
column, so that a completion is a chain of steps whose length the item sets.

A problem adds 2 to 4 numbers of 1 to 8 digits. The worked solution (`worked`) has one line per
column, from the right. A line first restates what is left of the numbers (the first line is the
sum as asked; each next line drops every number's last digit, and a number with no digit left
drops out), then adds the last digits and the carry from the line before, and ends with the carry
passed on and the answer so far (the total's last digit written in front of the previous line's).
A final carry gets a line of its own, and the last line is '#### ' and the total, which
`tasks.rewards.accuracy` reads. Every step looks only at the line before it, so a tiny model can
learn the method (the first form of this file asked it to find the k-th digit of each number in
the question instead). Most items are short and a few long (`draw_digits` has a long tail), so a
batch's completions differ in length by 10x and more, the shape reasoning RL trains on.

Every prompt is a chat whose system message, the same for all items, states the method: the
prefix a group's samples (and a whole batch) share. Deterministic in the seed; no eval item is in
train.
"""
import random

NAME = "builtin:carries"
SYSTEM = ("You add whole numbers the long way, one column at a time, and show every step. Write one "
          "line per column, starting from the rightmost. Begin each line with what is left of the "
          "numbers: the sum as given on the first line, and on each next line the same numbers with "
          "their last digit taken off, leaving out a number that has no digits left. Then add the "
          "last digits and the carry from the line before, and write the total, the carry you pass "
          "on and the answer so far. If a carry is left at the end, write it on a line of its own. "
          "End with a line that holds four hash signs and the answer, for example: #### 1234")
MAX_DIGITS = 8


def draw_digits(rng: random.Random) -> int:
    """How long the numbers are: 1 to MAX_DIGITS digits, short ones most often (a geometric tail),
    so a few items are many times longer than the median one."""
    digits = 1
    while digits < MAX_DIGITS and rng.random() < 0.65:
        digits += 1
    return digits


def problem(rng: random.Random) -> list[int]:
    """2 to 4 numbers; the first has the drawn length, the others up to it."""
    digits = draw_digits(rng)
    count = rng.choice((2, 2, 2, 3, 3, 4))
    first = rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)
    return [first] + [rng.randrange(10 ** rng.randint(1, digits)) for _ in range(count - 1)]


def worked(numbers: list[int], slip=None) -> str:
    """The worked solution of the sum of `numbers`, one line per column from the right, e.g.
    [987, 56]: '987 + 56: 7 + 6 = 13, carry 1, so far 3' / '98 + 5: 8 + 5 + 1 = 14, carry 1, so
    far 43' / '9: 9 + 1 = 10, carry 1, so far 043' / 'final carry 1, so far 1043' / '#### 1043'.
    slip: None, or a function of a column's true total that returns the total written (the rest of
    the working then follows from it, as a careless student's would: assets/carries.py)."""
    lines, rest, carry, so_far = [], [str(x) for x in numbers], 0, ""
    while rest:
        digits = [int(x[-1]) for x in rest]
        total = sum(digits) + carry
        if slip is not None:
            total = slip(total)
        terms = " + ".join(map(str, digits + ([carry] if carry else [])))
        carry, so_far = total // 10, str(total % 10) + so_far
        lines.append(f"{' + '.join(rest)}: {terms} = {total}, carry {carry}, so far {so_far}")
        rest = [x[:-1] for x in rest if len(x) > 1]
    if carry:
        so_far = str(carry) + so_far
        lines.append(f"final carry {carry}, so far {so_far}")
    lines.append(f"#### {int(so_far)}")  # int: a leading 0 of the working is not written
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
