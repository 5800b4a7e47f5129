"""Rule rewards on images, for Flow-GRPO's built-in shapes task ("a red circle on the left").

Each is `fn(prompts, images) -> Tensor [B]`, the language rewards' order (roles/reward.py: the
images are the completions): prompts B strings, images [B, 3, H, W] in [-1, 1].
A prompt names a colour (COLOURS) and maybe a half ("on the left" / "on the right"), read here
with a word lookup (the task's own parser lives in tasks/shapes.py; these rewards read any text).
An image is a bright shape on a dark background: its foreground is the pixels whose brightest
channel, on the [0, 1] scale, is over FOREGROUND (the shapes task draws its background at 0-0.1).
    colour           share of the foreground pixels whose nearest colour is the asked one
    position         share of the foreground pixels in the asked half
    compressibility  -(zlib-compressed bytes / raw bytes) of the uint8 image
A prompt without the needed word, or an image without foreground, scores as written under each.
"""
import re
import zlib

import torch

# RGB in [0, 1], the palette of the shapes task
COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0),
           "yellow": (1.0, 1.0, 0.0), "cyan": (0.0, 1.0, 1.0), "magenta": (1.0, 0.0, 1.0),
           "white": (1.0, 1.0, 1.0), "orange": (1.0, 0.5, 0.0)}
HALVES = ("left", "right")
FOREGROUND = 0.35  # a pixel whose brightest channel is over this is the shape's


def prompt_words(prompt: str) -> tuple[str | None, str | None]:
    """"a red circle on the left" -> ("red", "left"); the first colour word and the first half
    word of the prompt, None where there is none."""
    words = re.findall(r"[a-z]+", prompt.lower())
    colour = next((w for w in words if w in COLOURS), None)
    half = next((w for w in words if w in HALVES), None)
    return colour, half


def _check(images: torch.Tensor, prompts: list[str]):
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"image rewards take images [B, 3, H, W] in [-1, 1], got {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts: one prompt per image")


def _unit(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> [0, 1], fp32: [B, 3, H, W]."""
    return ((images.float() + 1) / 2).clamp(0, 1)


def foreground(images: torch.Tensor) -> torch.Tensor:
    """bool [B, H, W]: the pixels of the shape. images [B, 3, H, W] in [-1, 1]."""
    return _unit(images).amax(1) > FOREGROUND


def nearest_colour(images: torch.Tensor) -> torch.Tensor:
    """The index in COLOURS of each pixel's nearest colour (Euclidean in RGB): [B, 3, H, W] -> [B, H, W].
    A loop over the 8 colours keeps the memory at one [B, H, W] map."""
    rgb = _unit(images)  # [B, 3, H, W]
    best = torch.full(rgb[:, 0].shape, float("inf"), device=rgb.device)  # [B, H, W]
    index = torch.zeros(rgb[:, 0].shape, dtype=torch.long, device=rgb.device)  # [B, H, W]
    for k, value in enumerate(COLOURS.values()):
        ref = torch.tensor(value, device=rgb.device).view(1, 3, 1, 1)
        dist = ((rgb - ref) ** 2).sum(1)  # [B, H, W]
        closer = dist < best
        best = torch.where(closer, dist, best)
        index = torch.where(closer, k, index)
    return index


def colour(prompts: list[str], images: torch.Tensor) -> torch.Tensor:
    """The share of the foreground pixels whose nearest colour is the prompt's; 0 when the image
    has no foreground or the prompt names no colour. -> [B] in [0, 1]."""
    _check(images, prompts)
    fg = foreground(images)  # [B, H, W]
    nearest = nearest_colour(images)  # [B, H, W]
    names = list(COLOURS)
    out = torch.zeros(len(prompts))
    for b, prompt in enumerate(prompts):
        asked, _ = prompt_words(prompt)
        count = fg[b].sum()
        if asked is None or count == 0:
            continue
        out[b] = ((nearest[b] == names.index(asked)) & fg[b]).sum() / count
    return out


def position(prompts: list[str], images: torch.Tensor) -> torch.Tensor:
    """The share of the foreground pixels in the half the prompt names (a middle column, with an
    odd width, counts half to each side); 0 when the image has no foreground. A prompt that names
    no half scores 0.5, the share an image placed anywhere gets on average: a constant across
    its group, so it adds no advantage. -> [B] in [0, 1]."""
    _check(images, prompts)
    fg = foreground(images).float()  # [B, H, W]
    W = fg.shape[-1]
    column = torch.arange(W, dtype=torch.float32, device=fg.device)  # [W]
    left = (W / 2 - column).clamp(0, 1)  # [W] weight of each column on the left
    out = torch.full((len(prompts),), 0.5)
    for b, prompt in enumerate(prompts):
        _, half = prompt_words(prompt)
        if half is None:
            continue
        total = fg[b].sum()
        if total == 0:
            out[b] = 0.0
            continue
        side = left if half == "left" else 1 - left  # [W]
        out[b] = (fg[b] * side).sum() / total
    return out


def compressibility(prompts: list[str], images: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's compressibility reward (as in DDPO, Black et al. 2023: minus the JPEG size) without
    an image library: the image quantised to uint8 (H, W, 3 bytes) and compressed with zlib (level 6),
    reward = -(compressed bytes / raw bytes). Near 0 for a flat image, about -1 for noise (zlib's
    header can push incompressible data just past -1). -> [B]."""
    _check(images, prompts)
    pixels = (_unit(images) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()  # [B, H, W, 3]
    out = torch.zeros(len(prompts))
    for b in range(len(prompts)):
        raw = pixels[b].contiguous().numpy().tobytes()
        out[b] = -len(zlib.compress(raw, 6)) / len(raw)
    return out


IMAGE_REWARDS = {"colour": colour, "position": position, "compressibility": compressibility}
