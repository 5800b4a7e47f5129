"""Images for Qwen2-VL prompts (models/vision.py), the loaders' image column (tasks/data.py) and the
built-in squares task (tasks/squares.py)."""
import io
import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from models import vision
from models.tokenizer import Tokenizer, train_tokenizer
from models.vision import IMAGE_PAD, ImagePrompt, expand_image_tokens, preprocess, read_image, smart_resize
from tasks import squares
from tasks.data import load_rows, tokenize_rows


def random_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vl_tok(tmp_path_factory):
    """The squares task's tokenizer: Qwen2-VL's vision tokens and a template with an image part."""
    path = str(tmp_path_factory.mktemp("vl_tok"))
    train_tokenizer(squares.vl_tokenizer_texts(500), path, 300, squares.VL_TEMPLATE, squares.VL_SPECIAL)
    return Tokenizer(path)


def image_pads(tok, row) -> int:
    return row["ids"].count(tok.tok.token_to_id(IMAGE_PAD))


# ---------------------------------------------------------------- the image processor

# (H, W, min_pixels, max_pixels): square, non-square with rounding, odd sides, one grown to min_pixels,
# one shrunk to max_pixels, one wide
LOW, HIGH = vision.MIN_PIXELS, vision.MAX_PIXELS
SIZES = [(56, 56, LOW, HIGH), (75, 100, LOW, HIGH), (57, 113, LOW, HIGH), (20, 30, LOW, HIGH),
         (300, 410, LOW, 28 * 28 * 16), (40, 400, LOW, 28 * 28 * 64)]


def test_preprocess_equals_transformers_pil_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    worst = 0.0
    for k, (h, w, low, high) in enumerate(SIZES):
        image = random_image(h, w, k)
        hf = Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high)(images=[Image.fromarray(image)],
                                                                       return_tensors="np")
        patches, grid = preprocess(image, low, high)
        assert patches.dtype == np.float32 and patches.shape == hf["pixel_values"].shape
        assert list(grid) == hf["image_grid_thw"][0].tolist()
        worst = max(worst, float(np.abs(patches - hf["pixel_values"]).max()))
    assert worst <= 1e-6, worst
    # the resizing cases did resize: grown to the minimum, shrunk under the maximum
    assert smart_resize(20, 30) == (56, 84) and np.prod(smart_resize(300, 410, 28, 3136, 12544)) <= 12544


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    for h in range(10, 700, 37):
        for w in range(10, 700, 41):
            for low, high in ((56 * 56, 28 * 28 * 1280), (28 * 28 * 4, 28 * 28 * 20)):
                assert smart_resize(h, w, 28, low, high) == hf_resize(h, w, 28, low, high), (h, w, low, high)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010)


def test_image_prompt_is_a_list_that_pickles_with_its_images():
    images = [random_image(56, 56), random_image(60, 90, 1)]
    grids = [vision.grid_of(i) for i in images]
    assert grids == [(1, 4, 4), (1, 4, 6)]
    ids = expand_image_tokens([5, 9, 7, 9, 8], grids, 9)
    assert ids == [5] + [9] * 4 + [7] + [9] * 6 + [8]
    p = ImagePrompt(ids, images, grids)
    assert len(p) == 13 and p == ids and p[:2] == [5, 9] and type(p[1:]) is list
    assert torch.equal(torch.tensor(p), torch.tensor(ids))
    assert p.patches().shape == (16 + 24, 1176) and set(p.__dict__) == {"images", "grids", "min_pixels",
                                                                         "max_pixels"}  # never kept
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        q = pickle.loads(pickle.dumps(p, protocol))
        assert type(q) is ImagePrompt and q == p and q.grids == grids
    assert all(np.array_equal(a, b) for a, b in zip(q.images, images))
    assert torch.equal(q.patches(), p.patches())
    with pytest.raises(ValueError, match="2 <|image_pad|> tokens for 1 images"):
        expand_image_tokens([9, 9], grids[:1], 9)


def test_read_image_from_what_a_row_holds(tmp_path):
    image = random_image(30, 40)
    (tmp_path / "sub").mkdir()
    Image.fromarray(image).save(tmp_path / "sub" / "a.png")
    rgba = Image.fromarray(np.dstack([image, np.full((30, 40), 7, np.uint8)]))
    dicts = [{"bytes": png(image), "path": None}, {"bytes": None, "path": "sub/a.png"}]
    for value in ["sub/a.png", png(image), *dicts, Image.fromarray(image), rgba, image, image / 255.0]:
        got = read_image(value, str(tmp_path))
        assert got.dtype == np.uint8 and np.array_equal(got, image), type(value)
    grey = read_image(image[:, :, 0])
    assert grey.shape == (30, 40, 3) and np.array_equal(grey[:, :, 2], image[:, :, 0])
    with pytest.raises(ValueError, match="not found"):
        read_image("nope.png", str(tmp_path))
    with pytest.raises(ValueError, match="row 3 image 0: not a readable image"):
        vision.row_images(b"not an image", None, "row 3")


# ---------------------------------------------------------------- the loaders' image column

def test_jsonl_with_image_paths_one_or_several_per_row(tmp_path, vl_tok):
    for name, size in (("a.png", (56, 56)), ("b.png", (112, 84)), ("c.png", (30, 200))):
        Image.fromarray(random_image(*size)).save(tmp_path / name)
    lines = [{"question": "How many red squares?", "image": "a.png", "gold": 2},
             {"question": "Which side has more squares?", "image": str(tmp_path / "b.png"), "gold": "left"}]
    (tmp_path / "one.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    rows = load_rows(str(tmp_path / "one.jsonl"), "train", "question", "gold", "auto")
    assert [len(r["images"]) for r in rows] == [1, 1] and "image" not in rows[0]
    parts = [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]
    assert rows[0]["prompt"] == [{"role": "user", "content": parts}]
    kept, skipped = tokenize_rows(rows, vl_tok, 100)
    assert skipped == 0 and all(isinstance(r["ids"], ImagePrompt) for r in kept)
    assert kept[0]["text"] == ("<|user|><|vision_start|><|image_pad|><|vision_end|>How many red squares?\n"
                               "<|assistant|>")
    assert [image_pads(vl_tok, r) for r in kept] == [4, 12]  # 56x56 -> 2x2 tokens, 112x84 -> 4x3
    # several images per row, under the column name "images"; the prompt already chat messages
    many = {"prompt": [{"role": "user", "content": "Compare."}], "images": ["a.png", "b.png", "c.png"],
            "answer": "x"}
    (tmp_path / "many.jsonl").write_text(json.dumps(many))
    [row] = load_rows(str(tmp_path / "many.jsonl"), "train", "prompt", "answer", "auto")
    assert [part["type"] for part in row["prompt"][0]["content"]] == ["image", "image", "image", "text"]
    [kept] = tokenize_rows([row], vl_tok, 200)[0]
    assert kept["ids"].grids == [(1, 4, 4), (1, 8, 6), (1, 2, 14)]  # 30x200 -> smart_resize 28x196
    assert image_pads(vl_tok, kept) == 4 + 12 + 7 == sum(vision.image_tokens(g) for g in kept["ids"].grids)
    with pytest.raises(ValueError, match="no image column 'picture'.*--image-column"):
        load_rows(str(tmp_path / "many.jsonl"), "train", "prompt", "answer", "picture")
    text_rows = load_rows(str(tmp_path / "many.jsonl"), "train", "prompt", "answer")  # default: no images
    assert text_rows[0]["images"] == ["a.png", "b.png", "c.png"] and text_rows[0]["prompt"] == many["prompt"]


def test_parquet_with_image_byte_dicts_and_image_parts(tmp_path, vl_tok):
    import datasets

    a, b = random_image(56, 56), random_image(56, 112, 1)
    parts = [{"type": "image", "text": None}, {"type": "text", "text": "Which side has more squares?"}]
    datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": parts}], "answer": "left",
         "images": [{"bytes": png(a), "path": None}]},
        {"prompt": [{"role": "user", "content": parts}], "answer": "right",
         "images": [{"bytes": png(b), "path": "ignored.png"}]}]).to_parquet(str(tmp_path / "d.parquet"))
    rows = load_rows(str(tmp_path / "d.parquet"), "train", "prompt", "answer", "auto")
    assert np.array_equal(rows[0]["images"][0], a) and np.array_equal(rows[1]["images"][0], b)
    assert rows[0]["prompt"][0]["content"][0] == {"type": "image"}  # parquet's None fields dropped
    kept, _ = tokenize_rows(rows, vl_tok, 100)
    assert [image_pads(vl_tok, r) for r in kept] == [4, 8]
    two = {"prompt": [{"role": "user", "content": parts}], "answer": "1", "images": [{"bytes": png(a)}] * 2}
    datasets.Dataset.from_list([two]).to_parquet(str(tmp_path / "e.parquet"))
    with pytest.raises(ValueError, match="row 0: its messages hold 1 image parts for 2 images"):
        load_rows(str(tmp_path / "e.parquet"), "train", "prompt", "answer", "auto")


def test_prompts_too_long_for_their_images_are_skipped_whole(tmp_path, vl_tok):
    prompt = vision.with_image_parts("How many red squares?", 1, "a row")
    rows = [{"prompt": prompt, "answer": "1", "images": [random_image(s, s, s)]}
            for s in (56, 112, 56, 112, 84)]
    counts = [len(tokenize_rows([r], vl_tok, 1000)[0][0]["ids"]) for r in rows]
    limit = counts[4]  # the 84x84 prompt fits exactly, the 112x112 ones do not
    with pytest.warns(UserWarning, match=f"2 of 5 prompts with images are longer than --max-prompt-tokens="
                                         f"{limit} with their image tokens"):
        kept, skipped = tokenize_rows(rows, vl_tok, limit)
    assert skipped == 2 and len(kept) == 3
    for r in kept:  # never cut: every kept prompt holds all its image tokens
        assert image_pads(vl_tok, r) == sum(vision.image_tokens(g) for g in r["ids"].grids)
    with pytest.raises(ValueError, match=f"raise --max-prompt-tokens to {min(counts)} or more"):
        tokenize_rows(rows, vl_tok, min(counts) - 1)
    # a checkpoint's preprocessor_config.json sets the pixel limits: every image shrinks to 56x56
    shutil.copytree(vl_tok.path, tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / "preprocessor_config.json", "w") as f:
        json.dump({"size": {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}, "patch_size": 14}, f)
    kept, skipped = tokenize_rows(rows, Tokenizer(str(tmp_path / "ckpt")), limit)
    assert skipped == 0 and all(r["ids"].grids == [(1, 4, 4)] for r in kept)
    assert kept[1]["ids"].patches().shape == (16, 1176)  # made with the same limits


def test_images_need_a_vision_tokenizer(tmp_path):
    train_tokenizer(["How many?"] * 5, str(tmp_path), 300, squares.VL_TEMPLATE)  # no <|image_pad|> token
    rows = [{"prompt": vision.with_image_parts("How many?", 1, "a row"), "answer": "1",
             "images": [random_image(56, 56)]}]
    with pytest.raises(ValueError, match=r"has no <\|image_pad\|> token"):
        tokenize_rows(rows, Tokenizer(str(tmp_path)), 100)


# ---------------------------------------------------------------- the built-in squares task

def count_squares(image: np.ndarray, colour=None) -> int:
    """Squares drawn in `image` (of `colour`, or any), by their pixels."""
    part = image
    if colour is None:
        hit = np.any(part != squares.BACKGROUND, axis=-1)
    else:
        hit = np.all(part == squares.COLOURS[colour], axis=-1)
    assert hit.sum() % (squares.SQUARE ** 2) == 0
    return int(hit.sum()) // squares.SQUARE ** 2


def test_squares_rows_are_seeded_and_their_answers_right():
    a = squares.square_rows("train", seed=1, n_train=200)
    b = squares.square_rows("train", seed=1, n_train=200)
    assert [r["answer"] for r in a] == [r["answer"] for r in b]
    assert all(np.array_equal(x["images"][0], y["images"][0]) for x, y in zip(a, b))
    other = squares.square_rows("train", seed=2, n_train=200)
    assert any(not np.array_equal(x["images"][0], y["images"][0]) for x, y in zip(a, other))
    evals = squares.square_rows("eval", seed=1)
    key = lambda r: (r["images"][0].tobytes(), r["prompt"][0]["content"][1]["text"])  # noqa: E731
    assert len(evals) == 256 and not {key(r) for r in evals} & {key(r) for r in a}
    answers = set()
    for r in a + evals:
        [image], question = r["images"], r["prompt"][0]["content"][1]["text"]
        assert r["prompt"][0]["content"][0] == {"type": "image"}
        assert image.dtype == np.uint8 and all(s in (56, 84, 112) for s in image.shape[:2])
        if question == "How many squares?":
            assert r["answer"] == str(count_squares(image))
        else:
            colour = question.split()[2]
            assert question == f"How many {colour} squares?"
            assert r["answer"] == str(count_squares(image, colour))
        answers.add((question == "How many squares?", r["answer"]))
    assert answers == {(total, str(k)) for total in (True, False) for k in range(5)}


def test_squares_load_tokenize_and_reward(vl_tok):
    rows = load_rows(squares.NAME, "eval", "ignored", "ignored")
    kept, skipped = tokenize_rows(rows[:16], vl_tok, 64)
    assert skipped == 0 and all(image_pads(vl_tok, r) == vision.image_tokens(r["ids"].grids[0]) for r in kept)
    for word in ("0", "4"):  # each answer is one token of the task's tokenizer
        assert len(vl_tok.encode(word, False)) == 1, word
    from tasks.rewards import accuracy

    scores = accuracy(None, [" left. ", "2", "right", "3", "I see 3"], answer=["left", "3", "left", "3", "3"])
    assert scores == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_an_engine_makes_room_for_the_most_images_in_one_prompt():
    image = np.zeros((56, 56, 3), np.uint8)
    assert vision.most_images([{"images": [image, image]}, {"prompt": "text only"}, {"images": []}]) == 2
    assert vision.most_images([{"prompt": "text only"}]) == vision.most_images([]) == 1
