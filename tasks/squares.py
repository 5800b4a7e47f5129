"""The built-in visual task, 'builtin:squares': coloured squares on a plain dark background and a
question with a short exact answer, made offline from a seed.

    How many red squares?    "0" to "4" (each count equally often; other colours around them)
    How many squares?        "0" to "4" (all colours)

An image is 56, 84 or 112 pixels a side (multiples of 28: Qwen2-VL's processor keeps them as they
are, 4 to 16 image tokens). Its grid of 28 x 28 cells, one merged image token each, holds at most
one square per cell: 20 px, centred in its cell, of one of three far-apart colours. So a token is a
square of one colour or background, and both questions are sums over tokens: what a two-layer
vision tower and a tiny language model learn (a colour per token, then a count). A third kind,
"Which side has more squares?", was tried and dropped: the tiny model stayed at chance on it after
500 supervised steps, where the counts had begun to learn. The reward is the built-in `accuracy`
(roles/reward.py): the completion is the answer.
"""
import random

import numpy as np

from models.vision import FACTOR, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, with_image_parts

NAME = "builtin:squares"
COLOURS = {"red": (230, 40, 40), "green": (40, 190, 60), "blue": (50, 90, 235)}
BACKGROUND = (24, 24, 24)
SIDES = (56, 84, 112)  # image heights and widths, in pixels
SQUARE = 20  # a square's side, in pixels; it sits in the middle of its 28 x 28 cell
MAX_COUNT = 4


def draw(height: int, width: int, squares: dict) -> np.ndarray:
    """uint8 [H, W, 3]: the background, and a square of colour `name` in each cell (row, column) of
    `squares` {(row, column): name}."""
    image = np.empty((height, width, 3), np.uint8)
    image[:] = BACKGROUND
    margin = (FACTOR - SQUARE) // 2
    for (row, column), name in squares.items():
        top, left = row * FACTOR + margin, column * FACTOR + margin
        image[top:top + SQUARE, left:left + SQUARE] = COLOURS[name]
    return image


def count_problem(rng: random.Random) -> tuple[int, int, dict, str, str]:
    """'How many <colour> squares?': k of that colour (0-4, uniform), and up to 3 of the others."""
    colour, k = rng.choice(list(COLOURS)), rng.randrange(MAX_COUNT + 1)
    sizes = [(h, w) for h in SIDES for w in SIDES if (h // FACTOR) * (w // FACTOR) >= k]
    height, width = rng.choice(sizes)
    cells = [(r, c) for r in range(height // FACTOR) for c in range(width // FACTOR)]
    others = rng.randint(0, min(3, len(cells) - k))
    chosen = rng.sample(cells, k + others)
    squares = {cell: colour for cell in chosen[:k]}
    for cell in chosen[k:]:
        squares[cell] = rng.choice([name for name in COLOURS if name != colour])
    return height, width, squares, f"How many {colour} squares?", str(k)


def total_problem(rng: random.Random) -> tuple[int, int, dict, str, str]:
    """'How many squares?': k squares (0-4, uniform) of any colours."""
    k = rng.randrange(MAX_COUNT + 1)
    height, width = rng.choice([(h, w) for h in SIDES for w in SIDES if (h // FACTOR) * (w // FACTOR) >= k])
    cells = [(r, c) for r in range(height // FACTOR) for c in range(width // FACTOR)]
    squares = {cell: rng.choice(list(COLOURS)) for cell in rng.sample(cells, k)}
    return height, width, squares, "How many squares?", str(k)


def problem(rng: random.Random) -> tuple:
    return count_problem(rng) if rng.random() < 0.5 else total_problem(rng)


def square_rows(split: str, seed: int = 0, n_train: int = 2000, n_eval: int = 256) -> list[dict]:
    """Rows {"prompt": chat messages (an image part, then the question), "images": [uint8 [H, W, 3]],
    "answer"}. Deterministic in `seed`; no eval problem (image and question) is in train."""
    def row(p):
        height, width, squares, question, answer = p
        return {"prompt": with_image_parts(question, 1, NAME), "images": [draw(height, width, squares)],
                "answer": answer}

    def key(p):  # what makes a problem: the image's layout and the question
        return p[0], p[1], tuple(sorted(p[2].items())), p[3]

    rng, evals, seen = random.Random(f"squares-eval-{seed}"), [], set()
    while len(evals) < n_eval:
        p = problem(rng)
        if key(p) not in seen:
            seen.add(key(p))
            evals.append(p)
    if split == "eval":
        return [row(p) for p in evals]
    rng, train = random.Random(f"squares-train-{seed}"), []
    while len(train) < n_train:
        p = problem(rng)
        if key(p) not in seen:
            train.append(p)
    return [row(p) for p in train]


# ---------------------------------------------------------------- a tokenizer for the task

# A short chat format, one special token per role (as assets/make.py's TOOL_TEMPLATE), with each
# {"type": "image"} part written as Qwen2-VL writes it: <|vision_start|><|image_pad|><|vision_end|>
VL_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<|user|>' }}"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{%- if c.type == 'image' %}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{%- elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}{{ '\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|assistant|>' + m.content + eos_token + '\n' }}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
VL_SPECIAL = ("<|user|>", "<|assistant|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


def vl_tokenizer_texts(n: int = 2000) -> list[str]:
    """What a tokenizer of this task is trained on (models.tokenizer.train_tokenizer with VL_TEMPLATE and
    VL_SPECIAL as its special tokens): questions and answers of the train split, as
    question + answer, the frequencies the task has."""
    return [r["prompt"][0]["content"][-1]["text"] + r["answer"] for r in square_rows("train", n_train=n)]
