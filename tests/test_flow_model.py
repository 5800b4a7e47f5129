"""The tiny flow model (models/flow_dit.py) and its image task (tasks/shapes.py): shapes, the
zero half embedding (a model pretrained on half 0 ignores the half until RL trains it), the
checkpoint round trip, prompts, drawing, and that pretraining steps lower the loss."""
import os
import random

import pytest
import torch

from assets.make import flow_pretrain
from models.flow_dit import FlowConfig, FlowModel, flow_loss, load_flow, read_flow_config, save_flow
from tasks.shapes import (COLOURS, HALVES, SHAPES, colour_fraction, draw, draw_batch, half_fraction,
                          parse_prompt, prompt_text, prompts)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSET = os.path.join(ROOT, "assets", "flow-tiny")
SMALL = FlowConfig(image_size=8, hidden=32, layers=2, heads=2, mlp_ratio=2)


def random_model(cfg: FlowConfig = SMALL, seed: int = 0) -> FlowModel:
    """A fresh model whose adaLN maps and output layer are random too: a fresh FlowModel outputs
    exactly 0 (adaLN-Zero), which would make every comparison below pass trivially."""
    torch.manual_seed(seed)
    model = FlowModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "half_embed" not in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def inputs(cfg: FlowConfig, n: int = 4, half: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.channels, cfg.image_size, cfg.image_size, generator=g)  # [B, C, H, W]
    t = torch.rand(n, generator=g)  # [B]
    cond = torch.tensor([[i % len(COLOURS), i % len(SHAPES), half] for i in range(n)])  # [B, 3]
    return x, t, cond


def test_output_shape_and_finite():
    model = random_model()
    x, t, cond = inputs(SMALL)
    v = model(x, t, cond)
    assert v.shape == x.shape
    assert torch.isfinite(v).all()
    assert v.abs().sum() > 0  # the random adaLN maps make the output depend on the input


def test_a_fresh_model_outputs_zero():
    """adaLN-Zero: the output layer starts at zero (DiT)."""
    torch.manual_seed(0)
    model = FlowModel(SMALL)
    x, t, cond = inputs(SMALL)
    assert torch.equal(model(x, t, cond), torch.zeros_like(x))


def test_the_half_is_ignored_until_trained():
    model = random_model()
    x, t, cond = inputs(SMALL, half=0)
    anywhere = model(x, t, cond)
    for half in (1, 2):
        cond[:, 2] = half
        assert torch.equal(model(x, t, cond), anywhere)
    with torch.no_grad():  # a trained row does change the output: the check above can fail
        model.half_embed.weight[1].normal_()
    cond[:, 2] = 1
    assert not torch.allclose(model(x, t, cond), anywhere)


def test_the_half_zero_row_gets_no_gradient():
    model = random_model()
    x, t, cond = inputs(SMALL, half=0)
    flow_loss(model, x.clamp(-1, 1), cond, t, torch.randn_like(x)).backward()
    assert torch.equal(model.half_embed.weight.grad, torch.zeros_like(model.half_embed.weight))


@pytest.mark.skipif(not os.path.isdir(ASSET), reason="no assets/flow-tiny (python -m assets.make --flow)")
def test_the_shipped_asset_ignores_the_half():
    model, cfg = load_flow(ASSET)
    assert torch.equal(model.half_embed.weight, torch.zeros_like(model.half_embed.weight))
    x, t, cond = inputs(cfg, n=8)
    anywhere = model(x, t, cond)
    assert anywhere.abs().mean() > 0.1  # pretrained: not the zero output of a fresh model
    cond[:, 2] = 1
    assert torch.equal(model(x, t, cond), anywhere)


def test_save_load_round_trip(tmp_path):
    model = random_model()
    save_flow(model.state_dict(), SMALL, str(tmp_path))
    loaded, cfg = load_flow(str(tmp_path))
    assert cfg == SMALL
    x, t, cond = inputs(SMALL)
    assert torch.equal(loaded(x, t, cond), model(x, t, cond))


def test_a_language_model_config_is_refused(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        f.write('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="tiny_flow_dit"):
        read_flow_config(str(tmp_path))


def test_parse_prompt_round_trips_every_prompt():
    rows = prompts("eval")
    assert len(rows) == len(COLOURS) * len(SHAPES) * len(HALVES)
    for c in range(len(COLOURS)):
        for s in range(len(SHAPES)):
            for h in range(len(HALVES)):
                assert parse_prompt(prompt_text(c, s, h)) == (c, s, h)
    assert prompt_text(7, 1, 1) == "an orange circle on the left"
    assert len(prompts("train", 100)) == 100 and prompts("train") == prompts("train")


def test_parse_prompt_names_the_allowed_words():
    with pytest.raises(ValueError) as e:
        parse_prompt("a purple circle")
    for word in list(COLOURS) + list(SHAPES) + ["left", "right"]:
        assert word in str(e.value)
    with pytest.raises(ValueError):
        parse_prompt("a red circle on the top")


@pytest.mark.parametrize("half", [1, 2])
def test_draw_puts_the_shape_in_the_asked_half(half):
    rng = random.Random(half)
    for c in range(len(COLOURS)):
        for s in range(len(SHAPES)):
            image = draw(c, s, half, 16, rng)  # [3, H, W]
            assert image.shape == (3, 16, 16) and image.min() >= -1 and image.max() <= 1
            mass = (image.amax(0) > 0).float()  # [H, W] the shape's pixels
            left, right = mass[:, :8].sum(), mass[:, 8:].sum()
            assert (left, right)[half - 1] > 0 and (right, left)[half - 1] == 0, (c, s)
    images, ids = draw_batch(8, 16, rng, half=half)
    assert half_fraction(images, ids[:, 2]).min() == 1
    assert half_fraction(images, 3 - ids[:, 2]).max() == 0


def test_colour_fraction_reads_the_drawn_colour():
    images, ids = draw_batch(32, 16, random.Random(0))
    assert colour_fraction(images, ids[:, 0]).min() == 1
    assert colour_fraction(images, (ids[:, 0] + 1) % len(COLOURS)).max() == 0


def test_a_few_pretraining_steps_lower_the_loss():
    cfg = FlowConfig(image_size=8, hidden=32, layers=1, heads=2, mlp_ratio=2)
    torch.manual_seed(0)
    model = FlowModel(cfg)
    x0, cond = draw_batch(64, cfg.image_size, random.Random(123))  # held out: another seed
    g = torch.Generator().manual_seed(1)
    t, noise = torch.rand(64, generator=g), torch.randn(x0.shape, generator=g)
    with torch.no_grad():
        before = flow_loss(model, x0, cond, t, noise).item()
    flow_pretrain(model, steps=30, batch=32, lr=3e-3, log_every=1000)
    with torch.no_grad():
        after = flow_loss(model.eval(), x0, cond, t, noise).item()
    assert after < 0.8 * before, (before, after)
