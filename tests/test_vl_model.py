"""models/qwen2_vl.py (Qwen2-VL) against transformers' Qwen2VLForConditionalGeneration: logits on
a batch of mixed images, M-RoPE positions, the KV-cache path, checkpoints both ways, errors."""
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from models.decoder import KVCache, attention_mask, flops_per_token
from models.hf import build, iter_checkpoint, load_model, read_config, save_model
from models.qwen2_vl import rope_index
from utils.errors import UserError

START, END, IMAGE, VIDEO = 257, 258, 259, 260  # <|vision_start|> <|vision_end|> <|image_pad|> <|video_pad|>
TEXT = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=0,
            bos_token_id=None)
VISION = dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def hf_vl(tie=False, heads=4, seed=0):
    """A random transformers Qwen2-VL: text head dim 32 with mrope_section [4, 6, 6]; vision
    embed_dim 64 in `heads` heads, depth 2. Weights, norms and biases randomised, so that every
    part (the LayerNorms' biases too) shows in the logits."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    cfg = Qwen2VLConfig(text_config=dict(TEXT, rope_parameters=rope),
                        vision_config=dict(VISION, num_heads=heads), image_token_id=IMAGE,
                        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                        tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "norm" in name or "ln_q" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, transformers model) of a random Qwen2-VL saved by transformers."""
    path = str(tmp_path_factory.mktemp("qwen2-vl"))
    ref = hf_vl()
    ref.save_pretrained(path)
    return path, ref


def image(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def make_batch(rows, seed=0):
    """rows: lists of parts, an int (that many random text tokens) or an image (uint8 [H, W, 3],
    -> <|vision_start|>, its h*w/4 image pads, <|vision_end|>) -> (tokens [B, L] left-padded with
    0, valid [B, L], pixels [N, 1176], grids [n, 3]), preprocessed by transformers' PIL processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2)
    g = torch.Generator().manual_seed(seed)
    seqs, pixels, grids = [], [], []
    for row in rows:
        ids = []
        for part in row:
            if isinstance(part, int):
                ids += torch.randint(0, 256, (part,), generator=g).tolist()
                continue
            x = processor(images=[part], return_tensors="pt")
            pixels.append(x["pixel_values"])
            grids.append(x["image_grid_thw"])
            ids += [START] + [IMAGE] * (int(x["image_grid_thw"].prod()) // 4) + [END]
        seqs.append(ids)
    L = max(len(s) for s in seqs)
    tokens = torch.tensor([[0] * (L - len(s)) + s for s in seqs])
    valid = torch.tensor([[False] * (L - len(s)) + [True] * len(s) for s in seqs])
    return tokens, valid, torch.cat(pixels), torch.cat(grids)


# images of several sizes (56x56 -> 4 tokens, 112x84 -> 12, 84x140 -> 15); two in one prompt; a
# text-only row; an image that ends its prompt; left padding everywhere but the longest row
ROWS = [[3, image(56, 56, 1), 5],
        [2, image(112, 84, 2), 4, image(84, 140, 3), 3],
        [9],
        [4, image(56, 84, 4)]]


def hf_logits(ref, tokens, valid, pixels, grids):
    """transformers' logits; 5.19 needs mm_token_type_ids (1 at image pads) beside the grids."""
    return ref(input_ids=tokens, attention_mask=valid.long(), pixel_values=pixels, image_grid_thw=grids,
               mm_token_type_ids=(tokens == IMAGE).int(), use_cache=False).logits


def ours_logits(model, tokens, valid, pixels, grids):
    positions, _ = rope_index(tokens, grids, valid, model.config)
    return model(tokens, positions, attention_mask(valid), pixels=pixels, grids=grids)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.reordered
def test_logits_match_transformers_on_a_mixed_batch(checkpoint):
    path, ref = checkpoint
    ours = load_model(path)
    tokens, valid, pixels, grids = make_batch(ROWS)
    assert grids.tolist() == [[1, 4, 4], [1, 8, 6], [1, 6, 10], [1, 4, 6]]
    with torch.no_grad():
        got = ours_logits(ours, tokens, valid, pixels, grids)
        want = hf_logits(ref, tokens, valid, pixels, grids)
        blind = ours_logits(ours, tokens, valid, torch.zeros_like(pixels), grids)
    assert rel_err(got[valid], want[valid]) < 1e-5  # measured 8.6e-7, max |diff| 5.5e-6 (|logits| <= 4.1)
    assert (blind[valid] - want[valid]).abs().max() > 0.1  # the images matter to the logits


def test_rope_index_equals_transformers_get_rope_index(checkpoint):
    _, ref = checkpoint
    cfg = read_config(checkpoint[0])
    tokens, valid, pixels, grids = make_batch(ROWS)
    positions, deltas = rope_index(tokens, grids, valid, cfg)
    want, want_deltas = ref.model.get_rope_index(tokens, mm_token_type_ids=(tokens == IMAGE).int(),
                                                 image_grid_thw=grids, attention_mask=valid.long())
    assert torch.equal(positions, want)  # padding included (0, as transformers leaves it)
    assert torch.equal(deltas, want_deltas[:, 0] + valid.sum(-1))  # theirs is an offset from the 1-D index
    assert deltas.tolist()[2] == 9  # a text-only row: its length
    # the first image (4x4 patches -> 2x2 tokens) after <|vision_start|> at 1-D position 3: start 4
    row0 = positions[:, 0, valid[0]]
    assert row0[:, 4:8].tolist() == [[4, 4, 4, 4], [4, 4, 5, 5], [4, 5, 4, 5]]
    assert row0[:, 8].tolist() == [6, 6, 6]  # <|vision_end|>: start + max(2, 2)


@pytest.mark.reordered
def test_kv_cache_prefill_with_images_then_decode_equals_the_full_forward(checkpoint):
    """Prefill the left-padded prompts (images spliced) into the cache, then 3 greedy one-token
    steps at positions deltas + step (1-D), against a full forward over prompt + tokens so far."""
    ours = load_model(checkpoint[0])
    cfg = ours.config
    tokens, valid, pixels, grids = make_batch(ROWS)
    B, L = tokens.shape
    positions, deltas = rope_index(tokens, grids, valid, cfg)
    cache = KVCache(cfg, B, L + 3, "cpu", torch.float32)
    with torch.no_grad():
        step = ours(tokens, positions, attention_mask(valid), cache, logits_from=L - 1, pixels=pixels,
                    grids=grids)
        for k in range(3):
            nxt = step[:, -1, :256].argmax(-1)  # text tokens only: a sampled image pad would be no image
            tokens = torch.cat([tokens, nxt[:, None]], 1)
            valid = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool)], 1)
            step = ours(nxt[:, None], (deltas + k)[:, None], attention_mask(valid, query_len=1), cache)
            full_positions, _ = rope_index(tokens, grids, valid, cfg)
            assert torch.equal(full_positions[:, :, -1], (deltas + k).expand(3, B))
            full = ours(tokens, full_positions, attention_mask(valid), pixels=pixels, grids=grids)
            assert rel_err(step[:, -1], full[:, -1]) < 1e-5  # measured 5.9e-7 to 6.8e-7
    assert cache.pos == L + 3


def test_our_checkpoint_loads_in_transformers(checkpoint, tmp_path):
    from transformers import AutoModelForImageTextToText

    ours = load_model(checkpoint[0])
    save_model(ours, ours.config, str(tmp_path))
    names = {name for name, _ in iter_checkpoint(str(tmp_path))}
    assert "visual.merger.mlp.2.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
    with open(tmp_path / "config.json") as f:
        assert set(json.load(f)) >= {"text_config", "vision_config"}  # transformers 5's layout
    again = read_config(str(tmp_path))
    assert dataclasses.replace(again, extra={}) == dataclasses.replace(ours.config, extra={})
    ref = AutoModelForImageTextToText.from_pretrained(str(tmp_path)).eval()
    assert type(ref).__name__ == "Qwen2VLForConditionalGeneration"
    tokens, valid, pixels, grids = make_batch(ROWS[:2], seed=1)
    with torch.no_grad():
        got = ours_logits(ours, tokens, valid, pixels, grids)
        want = hf_logits(ref, tokens, valid, pixels, grids)
    assert rel_err(got[valid], want[valid]) < 1e-5


def legacy_config(ref) -> dict:
    """ref's config.json in the legacy layout of the Qwen2-VL model cards: text keys at the top
    level, rope_scaling {"type": "mrope"}, the vision config's in_chans and spatial_patch_size."""
    text = ref.config.text_config
    vision = {k: VISION[k] for k in ("depth", "embed_dim", "hidden_size", "mlp_ratio", "patch_size",
                                     "spatial_merge_size", "temporal_patch_size")}
    vision.update(num_heads=ref.config.vision_config.num_heads, in_chans=3, spatial_patch_size=14)
    return dict(TEXT, architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl",
                rms_norm_eps=text.rms_norm_eps, rope_theta=10000.0, hidden_act="silu",
                use_sliding_window=False, sliding_window=1024, max_window_layers=2,
                tie_word_embeddings=ref.config.tie_word_embeddings,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, vision_config=vision,
                image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                vision_end_token_id=END)


def test_transformers_in_memory_names_and_the_legacy_config_load(tmp_path):
    """A tied model with 2 vision heads, its tensors under transformers 5's in-memory names
    (model.language_model.*, model.visual.*) and its config.json in the legacy layout: ours and
    transformers read the same model from that directory."""
    from transformers import Qwen2VLForConditionalGeneration

    ref = hf_vl(tie=True, heads=2, seed=1)
    state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    assert any(k.startswith("model.language_model.") for k in state) and any(k.startswith("model.visual.")
                                                                              for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp_path / "config.json", "w") as f:
        json.dump(legacy_config(ref), f)
    ours = load_model(str(tmp_path))
    cfg = ours.config
    assert (cfg.tie_word_embeddings, cfg.mrope_section, cfg.rope_theta) == (True, [4, 6, 6], 10000.0)
    again = Qwen2VLForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    tokens, valid, pixels, grids = make_batch(ROWS[1:], seed=2)
    with torch.no_grad():
        got = ours_logits(ours, tokens, valid, pixels, grids)
        assert rel_err(got[valid], hf_logits(ref, tokens, valid, pixels, grids)[valid]) < 1e-5
        assert rel_err(got[valid], hf_logits(again, tokens, valid, pixels, grids)[valid]) < 1e-5


def test_image_tokens_that_do_not_match_the_images_are_a_clear_error(checkpoint):
    ours = load_model(checkpoint[0])
    tokens, valid, pixels, grids = make_batch([[3, image(56, 56, 1), 2]])
    short = tokens[:, 1:].clone()
    short[0, 3] = 7  # one image pad fewer: 3 tokens for an image of 4
    with pytest.raises(UserError, match="3 image tokens but 4 image features"):
        ours(short, pixels=pixels, grids=grids)
    with pytest.raises(UserError, match="needs 4 image-pad tokens in a row, the prompt has 3"):
        rope_index(short, grids, None, ours.config)
    with pytest.raises(UserError, match="more images .* than grids"):
        rope_index(tokens, grids[:0], valid, ours.config)


def test_a_batch_without_images_runs_the_tower_on_nothing(checkpoint):
    """pixels [0, 1176]: the same logits as without pixels, and every tower parameter gets a
    (zero) gradient, so FSDP ranks with and without images run the same backward."""
    ours = load_model(checkpoint[0])
    tokens = torch.randint(0, 256, (2, 6))
    out = ours(tokens, pixels=torch.zeros(0, 1176), grids=torch.zeros(0, 3, dtype=torch.long))
    assert torch.equal(out, ours(tokens))
    out.sum().backward()
    grads = [p.grad for name, p in ours.named_parameters() if name.startswith("visual.")]
    assert all(g is not None and not g.any() for g in grads)


def test_sizes_and_refusals(checkpoint, tmp_path):
    cfg = read_config(checkpoint[0])
    model = build(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())  # the tower counted
    assert cfg.num_params(vision=False) < cfg.num_params()
    assert flops_per_token(cfg, context=100) > 0
    with open(os.path.join(checkpoint[0], "config.json")) as f:
        d = json.load(f)
    refused = [("Qwen2_5_VLForConditionalGeneration", "Qwen2.5-VL"),
               ("Qwen3VLForConditionalGeneration", "Qwen3-VL")]
    for arch, says in refused:
        with open(tmp_path / "config.json", "w") as f:
            json.dump(dict(d, architectures=[arch]), f)
        with pytest.raises(UserError, match=f"{arch} in config.json: {says}.* is not supported"):
            read_config(str(tmp_path))
    d["text_config"]["rope_parameters"]["mrope_section"] = [4, 6, 4]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(UserError, match=r"mrope_section \[4, 6, 4\] sums to 14"):
        read_config(str(tmp_path))
