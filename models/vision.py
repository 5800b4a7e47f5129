"""Images for Qwen2-VL prompts: reading a dataset's image, the image processor, the prompt's image tokens.

An image is a uint8 array [H, W, 3] (RGB). `preprocess` turns it into Qwen2-VL's `patches`
float32 [n, 1176] (1176 = 3 channels * 2 frames * 14 * 14) and its `grid` (1, h, w) in 14-px
patches, n = h * w: the numbers transformers' `Qwen2VLImageProcessorPil` gives (bitwise equal on
the sizes of tests/test_vision.py), without torchvision, which this project's torch has none of. The
language model sees h * w / 4 image tokens per image (the vision tower merges 2 x 2 patches), so a
prompt's one <|image_pad|> per image is expanded to that many copies (`expand_image_tokens`) and
the ids travel as an `ImagePrompt`: a list of ints that also carries its images and grids.
"""
import io
import json
import math
import os

import numpy as np
from PIL import Image

from utils.errors import UserError

PATCH, MERGE, TEMPORAL = 14, 2, 2
FACTOR = PATCH * MERGE  # image sides are multiples of this: one merged token per 28 x 28 pixels
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH  # 1176
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # transformers' defaults for Qwen2-VL
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's, which Qwen2-VL's processor uses
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"  # Qwen2-VL's tokens around an image
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
IMAGE_PART = {"type": "image"}  # a chat message's content part that stands for one image


def smart_resize(height: int, width: int, factor: int = FACTOR, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The size an image is resized to, as transformers' qwen2_vl `smart_resize`: each side rounded
    to a multiple of `factor` (Python's round: halves to even), then, when the area is outside
    [min_pixels, max_pixels], both sides scaled by one factor (floored to fit under the maximum,
    ceiled to reach the minimum), keeping the aspect ratio as near as the multiples allow."""
    if max(height, width) / min(height, width) > 200:
        raise UserError(f"an image of {height} x {width} pixels: Qwen2-VL takes aspect ratios up to 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def grid_of(image: np.ndarray, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> tuple:
    """(1, h, w): an image's grid of 14-px patches after `smart_resize` (its size only, no pixels)."""
    h, w = smart_resize(image.shape[0], image.shape[1], FACTOR, min_pixels, max_pixels)
    return (1, h // PATCH, w // PATCH)


def patchify(image: np.ndarray) -> np.ndarray:
    """[H, W, 3] float32 (H, W multiples of 28) -> [H/14 * W/14, 1176], in Qwen2-VL's order: the
    patches of each 2 x 2 merge window together (windows row-major, then patches row-major inside a
    window), each patch flattened as (channel, frame, row, column) with the one frame repeated as
    the temporal patch (as transformers' Qwen2VLImageProcessorPil.patchify)."""
    H, W, C = image.shape
    gh, gw = H // PATCH, W // PATCH
    x = image.reshape(gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH, C)  # [bh, mh, ph, bw, mw, pw, C]
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # [bh, bw, mh, mw, C, ph, pw]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], TEMPORAL, PATCH, PATCH))  # [.., C, T, ph, pw]
    return x.reshape(gh * gw, C * TEMPORAL * PATCH * PATCH)


def preprocess(image: np.ndarray, min_pixels: int = MIN_PIXELS,
               max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 [H, W, 3] -> (patches float32 [n, 1176], grid (1, h, w)): Qwen2VLImageProcessorPil's
    steps and dtypes: PIL bicubic resize of the uint8 image to `smart_resize`'s size, times 1/255
    in float64 then float32, minus CLIP's mean over its std in float32, then `patchify`."""
    H, W = image.shape[:2]
    h, w = smart_resize(H, W, FACTOR, min_pixels, max_pixels)
    resized = np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.BICUBIC))  # [h, w, 3] uint8
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)  # [h, w, 3]
    x = (x - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)  # [h, w, 3] float32
    return patchify(x), (1, h // PATCH, w // PATCH)


def image_tokens(grid) -> int:
    """How many tokens the language model sees for an image of this grid: one per 2 x 2 patches."""
    t, h, w = grid
    return t * h * w // (MERGE * MERGE)


def expand_image_tokens(ids: list[int], grids: list, image_token_id: int) -> list[int]:
    """Each <|image_pad|> of `ids` (one per image, in order) -> `image_tokens(grid)` copies of it."""
    if ids.count(image_token_id) != len(grids):
        raise UserError(f"a prompt holds {ids.count(image_token_id)} {IMAGE_PAD} tokens for {len(grids)} "
                        f"images: one each (the chat template writes one per {IMAGE_PART} part)")
    out, grid = [], iter(grids)
    for t in ids:
        if t == image_token_id:
            out.extend([t] * image_tokens(next(grid)))
        else:
            out.append(t)
    return out


class ImagePrompt(list):
    """A prompt's token ids, each <|image_pad|> already expanded, that also carries its `images`
    (uint8 [H, W, 3] each), their `grids` ((1, h, w) each) and the pixel limits they were sized
    with. Everywhere else it is the plain list of ints (len, slices, ==, torch.tensor); a slice or
    a sum is a plain list. Pickles with its attributes. `patches()` is made anew at each call and
    never kept here (a row lives all run, and patches are 8x the image's bytes): make_batch and the
    native engine make a prompt's once per step."""

    def __init__(self, ids=(), images=(), grids=(), min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS):
        super().__init__(ids)
        self.images, self.grids = list(images), [tuple(g) for g in grids]
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        if len(self.images) != len(self.grids):
            raise ValueError(f"ImagePrompt: {len(self.images)} images but {len(self.grids)} grids")

    def patches(self):
        """The images preprocessed, concatenated: float32 tensor [sum n, 1176] (HF's pixel_values)."""
        import torch

        made = []
        for image, grid in zip(self.images, self.grids):
            patches, got = preprocess(image, self.min_pixels, self.max_pixels)
            assert got == grid, f"image grid {got} != the prompt's {grid}"
            made.append(torch.from_numpy(np.ascontiguousarray(patches)))
        return torch.cat(made) if made else torch.zeros(0, PATCH_DIM)


# ---------------------------------------------------------------- images in dataset rows

def read_image(value, root: str | None = None, where: str = "an image") -> np.ndarray:
    """What a dataset row can hold as an image -> uint8 [H, W, 3] RGB: a file path (tried under
    `root`, the dataset file's folder, then as given), bytes of an encoded image, a PIL image, a
    dict {"bytes", "path"} (how parquet files and `datasets` store images), or a numpy array
    ([H, W], [H, W, 3] or [H, W, 4]; uint8, or floats in [0, 1]). Anything else is a UserError
    naming `where`. Alpha is dropped and palettes and greys become RGB (PIL's convert("RGB"))."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise UserError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, str):
        places = [os.path.join(root, value), value] if root else [value]
        file = next((p for p in places if os.path.isfile(p)), None)
        if file is None:
            raise UserError(f"{where}: image file {value!r} not found (looked in {places})")
        value = _open(file, where)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        value = _open(io.BytesIO(bytes(value)), where)
    if isinstance(value, Image.Image):
        return np.asarray(value.convert("RGB")).copy()
    if isinstance(value, np.ndarray):
        return _array_rgb(value, where)
    raise UserError(f"{where}: an image must be a file path, bytes, a {{'bytes', 'path'}} dict, a PIL image "
                    f"or a numpy array, got {type(value).__name__}")


def _open(file, where: str) -> Image.Image:
    try:
        image = Image.open(file)
        image.load()
    except Exception as e:  # PIL's UnidentifiedImageError, a truncated file, ...
        raise UserError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    return image


def _array_rgb(a: np.ndarray, where: str) -> np.ndarray:
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))) or a.size == 0:
        raise UserError(f"{where}: an image array must be [H, W], [H, W, 3] or [H, W, 4], got "
                        f"{list(a.shape)}")
    if np.issubdtype(a.dtype, np.floating):
        if not (np.all(a >= 0) and np.all(a <= 1)):
            raise UserError(f"{where}: a float image array must hold values in [0, 1]")
        a = np.round(a * 255)
    elif a.dtype != np.uint8 and (a.min() < 0 or a.max() > 255):
        raise UserError(f"{where}: an integer image array must hold values in [0, 255]")
    a = a.astype(np.uint8)
    if a.ndim == 2:
        return np.repeat(a[:, :, None], 3, axis=2)
    return np.ascontiguousarray(a[:, :, :3])


def row_images(value, root: str | None, where: str) -> list[np.ndarray]:
    """A row's image column -> its images as uint8 arrays: one image, a list of them, or None / []
    (a row without images)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        value = [value]
    return [read_image(v, root, f"{where} image {k}") for k, v in enumerate(value)]


def with_image_parts(prompt, n_images: int, where: str) -> list[dict]:
    """A prompt with the placeholders of its `n_images` images: a string becomes one user message
    whose content is n {"type": "image"} parts, then the text (as Qwen2-VL's chat template expects);
    chat messages that hold no image part get them at the start of the first user message; messages
    that hold them keep them, and must hold n. Content parts lose their None fields (a parquet file
    gives every part every field, and Qwen2-VL's template reads a part with an 'image' key as an image)."""
    if isinstance(prompt, str):
        parts = [dict(IMAGE_PART) for _ in range(n_images)]
        return [{"role": "user", "content": parts + [{"type": "text", "text": prompt}]}]
    messages = []
    for m in prompt:
        content = m["content"]
        if isinstance(content, list):
            content = [{k: v for k, v in part.items() if v is not None} for part in content]
        messages.append({**m, "content": content})
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
    found = sum(p.get("type") == "image" for p in parts)
    if found and found != n_images:
        raise UserError(f"{where}: its messages hold {found} image parts for {n_images} images: give one "
                        "part per image")
    if found:
        return messages
    user = next((m for m in messages if m["role"] == "user"), None)
    if user is None:
        raise UserError(f"{where}: images need a user message to go in; the row has none")
    text = user["content"]
    user["content"] = [dict(IMAGE_PART) for _ in range(n_images)]
    user["content"] += [{"type": "text", "text": text}] if isinstance(text, str) else text
    return messages


# ---------------------------------------------------------------- a tokenizer's image tokens

def pixel_limits(path: str) -> tuple[int, int]:
    """(min_pixels, max_pixels) from a checkpoint's preprocessor_config.json (transformers 5 writes
    size.shortest_edge / size.longest_edge, older files min_pixels / max_pixels), else transformers'
    defaults. A processor that is not the one `preprocess` implements is a UserError."""
    file = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(file):
        return MIN_PIXELS, MAX_PIXELS
    with open(file) as f:
        conf = json.load(f)
    expect = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": TEMPORAL}
    for key, value in expect.items():
        if conf.get(key, value) != value:
            raise UserError(f"{file}: {key} {conf[key]}; this trainer's image processor (models/vision.py) "
                            f"takes {value}")
    for key, value in (("image_mean", CLIP_MEAN), ("image_std", CLIP_STD)):
        if not np.allclose(conf.get(key, value), value):
            raise UserError(f"{file}: {key} {conf[key]}; models/vision.py normalises with OpenAI CLIP's "
                            f"{value}")
    size = conf.get("size") or {}
    low = size.get("shortest_edge", conf.get("min_pixels", MIN_PIXELS))
    high = size.get("longest_edge", conf.get("max_pixels", MAX_PIXELS))
    return int(low), int(high)


def most_images(rows: list[dict]) -> int:
    """The most images in one of these rows' prompts (at least 1): what an engine makes room for."""
    return max([len(r.get("images") or ()) for r in rows] + [1])


def write_preprocessor_config(path: str, min_pixels: int = 56 * 56, max_pixels: int = 112 * 112):
    """The preprocessor_config.json of a checkpoint whose images `preprocess` makes, as transformers 5
    writes Qwen2-VL's (what vLLM's processor and `pixel_limits` read); min/max_pixels for older readers."""
    conf = {"image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_resize": True,
            "do_rescale": True, "do_normalize": True, "rescale_factor": 1 / 255, "resample": 3,
            "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "patch_size": PATCH,
            "merge_size": MERGE, "temporal_patch_size": TEMPORAL, "min_pixels": min_pixels,
            "max_pixels": max_pixels, "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(conf, f, indent=2)


class ImageTokens:
    """How a tokenizer's prompts take images: the id of <|image_pad|> and the pixel limits of the
    checkpoint at tok.path. `prompt(ids, images)` -> the ImagePrompt of a rendered prompt."""

    def __init__(self, tok):
        self.image_token_id = tok.tok.token_to_id(IMAGE_PAD)
        if self.image_token_id is None or tok.chat_template is None:
            missing = f"no {IMAGE_PAD} token" if self.image_token_id is None else "no chat template"
            raise UserError(f"the dataset's rows hold images, but the tokenizer in {tok.path} has {missing}: "
                            f"a Qwen2-VL checkpoint's tokenizer has both, its template writing each "
                            f"{IMAGE_PART} part as {VISION_START}{IMAGE_PAD}{VISION_END}")
        self.min_pixels, self.max_pixels = pixel_limits(tok.path)

    def prompt(self, ids: list[int], images: list[np.ndarray]) -> ImagePrompt:
        grids = [grid_of(image, self.min_pixels, self.max_pixels) for image in images]
        expanded = expand_image_tokens(ids, grids, self.image_token_id)
        return ImagePrompt(expanded, images, grids, self.min_pixels, self.max_pixels)
