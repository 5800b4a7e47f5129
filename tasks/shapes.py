"""The built-in image task of the flow model (models/flow_dit.py, Flow-GRPO): "a red circle",
"a blue triangle on the left". One filled shape of one colour on a dark background, drawn on
the fly at any size; a prompt is three ids (colour, shape, half), half 0 = "anywhere".

The checks here (`colour_fraction`, `half_fraction`) read an image the way a reward would: the
bright pixels are the shape, the rest is background.
"""
import math
import random
import re

import torch

from utils.errors import UserError

# RGB in [0, 1]; the order is the ids the model's colour embedding is indexed by
COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0),
           "yellow": (1.0, 1.0, 0.0), "cyan": (0.0, 1.0, 1.0), "magenta": (1.0, 0.0, 1.0),
           "white": (1.0, 1.0, 1.0), "orange": (1.0, 0.5, 0.0)}
SHAPES = ("square", "circle", "triangle")
HALVES = ("", "left", "right")  # id 0: anywhere (the prompt names no place)
BRIGHT = 0.35  # a pixel whose brightest channel (in [0, 1]) is over this is the shape's; background <= 0.15


def prompt_text(colour: int, shape: int, half: int) -> str:
    """Ids -> "a red circle on the left" (half 0: "a red circle"; "an" before a vowel)."""
    name = list(COLOURS)[colour]
    text = f"{'an' if name[0] in 'aeiou' else 'a'} {name} {SHAPES[shape]}"
    if half:
        text += f" on the {HALVES[half]}"
    return text


def parse_prompt(text: str) -> tuple[int, int, int]:
    """"a red circle on the left" -> (colour id, shape id, half id); an unknown word or form is a
    UserError (a ValueError) that names the allowed words."""
    m = re.fullmatch(r"an? (\w+) (\w+)(?: on the (\w+))?", text.strip().lower())
    colours = list(COLOURS)
    if m is None or m[1] not in colours or m[2] not in SHAPES or (m[3] or "") not in HALVES:
        raise UserError(f"prompt {text!r}: write 'a <colour> <shape>' or 'a <colour> <shape> on the <half>' "
                        f"with colour in {colours}, shape in {list(SHAPES)}, half in {list(HALVES[1:])}")
    return colours.index(m[1]), SHAPES.index(m[2]), HALVES.index(m[3] or "")


def shape_mask(shape: int, cx: float, cy: float, r: float, size: int) -> torch.Tensor:
    """bool [H, W]: the pixels (centres at i + 0.5) inside a shape centred at (cx, cy) of radius r.
    A square of side 1.77 r has the circle's area; the triangle points up, base and height 2 r."""
    c = torch.arange(size, dtype=torch.float32) + 0.5
    y, x = c[:, None], c[None, :]  # [H, 1], [1, W]
    if SHAPES[shape] == "square":
        half_side = r * math.sqrt(math.pi) / 2
        return ((x - cx).abs() <= half_side) & ((y - cy).abs() <= half_side)
    if SHAPES[shape] == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    depth = y - (cy - r)  # [H, 1] below the apex
    return (depth >= 0) & (depth <= 2 * r) & ((x - cx).abs() <= depth / 2)


def draw(colour: int, shape: int, half: int, size: int, rng: random.Random,
         noise: float = 0.02) -> torch.Tensor:
    """One image [3, H, W] in [-1, 1]: a filled shape of the asked colour, radius 0.15-0.24 of the
    side, at a uniform place where it fits whole (inside the asked half when half != 0), on a
    background of grey level 0-0.1, plus Gaussian pixel noise of std `noise` (on the [0, 1] scale)."""
    r = size * rng.uniform(0.15, 0.24)
    lo, hi = r, size - r  # the centre's range along x
    if HALVES[half] == "left":
        hi = size / 2 - r
    elif HALVES[half] == "right":
        lo = size / 2 + r
    cx, cy = rng.uniform(lo, hi), rng.uniform(r, size - r)
    image = torch.full((3, size, size), rng.uniform(0.0, 0.1))  # [3, H, W]
    mask = shape_mask(shape, cx, cy, r, size)  # [H, W]
    image[:, mask] = torch.tensor(COLOURS[list(COLOURS)[colour]])[:, None]
    if noise:
        g = torch.Generator().manual_seed(rng.getrandbits(63))
        image += noise * torch.randn(image.shape, generator=g)
    return (image * 2 - 1).clamp(-1, 1)


def draw_batch(n: int, size: int, rng: random.Random,
               half: int | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n images of random colours and shapes -> (images [n, 3, H, W], ids [n, 3] (colour, shape,
    half)). half: the one half id for all (0: anywhere, what pretraining uses), or None for random."""
    images, ids = [], []
    for _ in range(n):
        c, s = rng.randrange(len(COLOURS)), rng.randrange(len(SHAPES))
        h = rng.randrange(len(HALVES)) if half is None else half
        images.append(draw(c, s, h, size, rng))
        ids.append((c, s, h))
    return torch.stack(images), torch.tensor(ids)


def prompts(split: str, n: int | None = None) -> list[dict]:
    """Rows {"prompt": text}. "eval": the whole grid colour x shape x half (72 prompts) in a fixed
    order, the first n of it; there are no held-out prompts, the task is the grid itself. "train":
    the same grid, shuffled (seeded) pass after pass, n rows (default one pass)."""
    grid = [prompt_text(c, s, h) for c in range(len(COLOURS)) for s in range(len(SHAPES))
            for h in range(len(HALVES))]
    if split == "eval":
        return [{"prompt": p} for p in grid[:n]]
    if split != "train":
        raise UserError(f"prompts split {split!r}: use 'train' or 'eval'")
    rng, rows = random.Random("shapes-train"), []
    while len(rows) < (len(grid) if n is None else n):
        rows += [{"prompt": p} for p in rng.sample(grid, len(grid))]
    return rows[:len(grid) if n is None else n]


def bright(images: torch.Tensor) -> torch.Tensor:
    """images [B, 3, H, W] in [-1, 1] -> bool [B, H, W]: the shape's pixels (not background)."""
    return (images.amax(1) + 1) / 2 > BRIGHT


def colour_fraction(images: torch.Tensor, colour_ids: torch.Tensor) -> torch.Tensor:
    """[B]: the share of each image's bright pixels whose nearest colour of COLOURS is the asked
    one (0 for an image with no bright pixel). images [B, 3, H, W] in [-1, 1], colour_ids [B]."""
    rgb = torch.tensor(list(COLOURS.values()))  # [K, 3]
    pixels = (images.permute(0, 2, 3, 1) + 1) / 2  # [B, H, W, 3]
    nearest = ((pixels[..., None, :] - rgb) ** 2).sum(-1).argmin(-1)  # [B, H, W]
    mask = bright(images)  # [B, H, W]
    hits = (mask & (nearest == colour_ids[:, None, None])).sum((1, 2))  # [B]
    return hits / mask.sum((1, 2)).clamp(min=1)


def half_fraction(images: torch.Tensor, half_ids: torch.Tensor) -> torch.Tensor:
    """[B]: the share of each image's bright pixels inside the asked half (1 where half is 0,
    anywhere; 0 for an image with no bright pixel). images [B, 3, H, W], half_ids [B]."""
    mask = bright(images).float()  # [B, H, W]
    W = images.shape[-1]
    left = mask[..., :W // 2].sum((1, 2))  # [B]
    total = mask.sum((1, 2))  # [B]
    inside = torch.where(half_ids == 1, left, total - left)  # [B]
    share = inside / total.clamp(min=1)  # [B]
    return torch.where(half_ids == 0, (total > 0).float(), share)
