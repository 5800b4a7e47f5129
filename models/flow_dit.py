"""A tiny flow-matching image model in plain torch: a DiT (Peebles & Xie 2023, "Scalable Diffusion
Models with Transformers") with adaLN-Zero conditioning, trained as a rectified flow (Liu et al.
2022, "Flow Straight and Fast"; Esser et al. 2024, SD3) on the built-in image task
(tasks/shapes.py). It is the policy of Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow
Matching Models via Online RL"): what the RL trains is `forward`, the velocity field.

Time runs as in rectified flow: x_t = (1 - t) x0 + t eps, t = 0 the image, t = 1 pure noise; the
model predicts the velocity v = eps - x0, and the ODE dx/dt = v runs from t = 1 down to t = 0.

The condition is three ids (colour, shape, half). The half embedding's row 0 ("anywhere", what
pretraining always asks) is a padding row, zero and never trained, and rows 1, 2 (left, right)
start at zero: a model pretrained on half 0 alone gives the same output whatever the half until
RL trains those rows. The blocks sit in `self.blocks` so that a caller can `fully_shard` each.
Checkpoints are a directory of config.json (model_type "tiny_flow_dit") + model.safetensors.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from models.config import read_json
from utils.errors import UserError

MODEL_TYPE = "tiny_flow_dit"


@dataclass
class FlowConfig:
    image_size: int = 16
    """side of the square images, pixels"""
    channels: int = 3
    """colour channels (RGB)"""
    patch: int = 2
    """side of a patch: (image_size / patch)^2 tokens"""
    hidden: int = 96
    """width of the tokens and of the condition vector"""
    layers: int = 4
    """DiT blocks (`FlowModel.blocks`)"""
    heads: int = 4
    """attention heads; hidden / heads each"""
    mlp_ratio: int = 4
    """the MLP's inner width is mlp_ratio * hidden"""
    colours: int = 8
    """rows of the colour embedding (ids of a task's colours: tasks.shapes.COLOURS has 8)"""
    shapes: int = 3
    """rows of the shape embedding (ids of a task's shapes: tasks.shapes.SHAPES has 3)"""
    halves: int = 3
    """rows of the half embedding; id 0 = anywhere, a zero row that is never trained"""

    def to_hf(self) -> dict:
        """What a checkpoint's meta.json records of the model (utils/checkpoint.py compares shapes on
        resume): config.json's fields."""
        return {"model_type": MODEL_TYPE, "architectures": ["TinyFlowDiT"], **asdict(self), "hidden_size":
                self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads}

    def save(self, path: str):
        """Writes `path`/config.json."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"model_type": MODEL_TYPE, "architectures": ["TinyFlowDiT"], **asdict(self)}, f,
                      indent=2)


def read_flow_config(path: str) -> FlowConfig:
    """`path`/config.json -> FlowConfig; a UserError if it is missing or not a tiny flow model's."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise UserError(f"{path!r} has no config.json; make a flow model with "
                        "`python -m assets.make --flow --out DIR`")
    d = read_json(file)
    if d.get("model_type") != MODEL_TYPE:
        raise UserError(f"{file}: model_type {d.get('model_type')!r} is not {MODEL_TYPE!r} (a language "
                        "model's checkpoint? the image task needs `python -m assets.make --flow` 's)")
    return FlowConfig(**{f.name: d[f.name] for f in fields(FlowConfig) if f.name in d})


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """t [B] in [0, 1] -> [B, dim] sinusoids of 1000 t (DiT's scale: its t runs over 0..1000)."""
    freqs = torch.exp(-math.log(max_period) * torch.arange(dim // 2, device=t.device) / (dim // 2))  # [D/2]
    args = 1000 * t.float()[:, None] * freqs  # [B, D/2]
    return torch.cat([args.cos(), args.sin()], dim=-1)  # [B, D]


def position_embedding(grid: int, dim: int, device=None) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding (MAE / DiT): [grid * grid, dim], row-major tokens; half
    the channels encode the row, half the column. Computed on the fly: no buffer to fill after
    `to_empty`, and 64 x 96 values cost nothing next to a forward."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)  # [D/4]
    pos = torch.arange(grid, device=device, dtype=torch.float32)
    ang = pos[:, None] * omega  # [G, D/4]
    axis = torch.cat([ang.sin(), ang.cos()], dim=-1)  # [G, D/2]
    rows = axis[:, None, :].expand(grid, grid, dim // 2)  # [G, G, D/2] by row
    cols = axis[None, :, :].expand(grid, grid, dim // 2)  # [G, G, D/2] by column
    return torch.cat([rows, cols], dim=-1).reshape(grid * grid, dim)  # [N, D]


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x [B, N, D] normalised, shift and scale [B, D] from the condition."""
    return x * (1 + scale[:, None]) + shift[:, None]


class Block(nn.Module):
    """DiT block with adaLN-Zero: the condition gives shift, scale and gate of attention and MLP;
    the gates start at zero, so each block starts as the identity (DiT section 3.2)."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        d = cfg.hidden
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.mlp_ratio * d, d))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x [B, N, D] tokens, c [B, D] condition -> [B, N, D]."""
        B, N, D = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=-1)  # 6 x [B, D]
        h = modulate(self.norm1(x), shift1, scale1)  # [B, N, D]
        qkv = self.qkv(h).view(B, N, 3, self.heads, D // self.heads)  # [B, N, 3, H, d]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 x [B, H, N, d]
        a = F.scaled_dot_product_attention(q, k, v)  # [B, H, N, d], every patch sees every patch
        x = x + gate1[:, None] * self.proj(a.transpose(1, 2).reshape(B, N, D))  # [B, N, D]
        h = modulate(self.norm2(x), shift2, scale2)  # [B, N, D]
        return x + gate2[:, None] * self.mlp(h)  # [B, N, D]


class FlowModel(nn.Module):
    def __init__(self, cfg: FlowConfig):
        super().__init__()
        assert cfg.image_size % cfg.patch == 0 and cfg.hidden % 4 == 0 and cfg.hidden % cfg.heads == 0, cfg
        self.config = cfg
        d, patch_dim = cfg.hidden, cfg.channels * cfg.patch ** 2
        self.patch_embed = nn.Linear(patch_dim, d)  # a linear map of each p x p patch (a strided conv)
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.colour_embed = nn.Embedding(cfg.colours, d)
        self.shape_embed = nn.Embedding(cfg.shapes, d)
        self.half_embed = nn.Embedding(cfg.halves, d, padding_idx=0)  # row 0, anywhere: zero, no gradient
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.out = nn.Linear(d, patch_dim)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """DiT's init (seed with torch.manual_seed first): xavier-uniform linears, zero biases,
        N(0, 0.02) timestep MLP and colour / shape embeddings; zero adaLN maps and output layer
        (adaLN-Zero: the model starts at v = 0); the half embedding all zero."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        for lin in (self.t_mlp[0], self.t_mlp[2]):
            nn.init.normal_(lin.weight, std=0.02)
        nn.init.normal_(self.colour_embed.weight, std=0.02)
        nn.init.normal_(self.shape_embed.weight, std=0.02)
        nn.init.zeros_(self.half_embed.weight)
        for lin in [b.ada[1] for b in self.blocks] + [self.ada[1], self.out]:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """x [B, C, H, W] noisy images, t [B] in [0, 1] (1 = noise), cond [B, 3] long ids (colour,
        shape, half) -> the velocity eps - x0, [B, C, H, W]."""
        cfg = self.config
        B, C, H, W = x.shape
        p, gh, gw = cfg.patch, H // cfg.patch, W // cfg.patch
        patches = x.view(B, C, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)  # [B, gh, gw, C, p, p]
        patches = patches.reshape(B, gh * gw, C * p * p)  # [B, N, P]
        h = self.patch_embed(patches) + position_embedding(gh, cfg.hidden, x.device)  # [B, N, D]
        c = self.t_mlp(timestep_embedding(t, cfg.hidden))  # [B, D]
        c = c + self.colour_embed(cond[:, 0]) + self.shape_embed(cond[:, 1])  # [B, D]
        c = c + self.half_embed(cond[:, 2])  # [B, D]
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.ada(c).chunk(2, dim=-1)  # 2 x [B, D]
        out = self.out(modulate(self.norm(h), shift, scale))  # [B, N, P]
        return out.view(B, gh, gw, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)  # [B, C, H, W]


def flow_loss(model: FlowModel, x0: torch.Tensor, cond: torch.Tensor, t: torch.Tensor,
              noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow (conditional flow matching) loss mean((v(x_t, t) - (eps - x0))^2) at the
    given t [B] and noise eps [B, C, H, W]; x0 [B, C, H, W], cond [B, 3]. A scalar."""
    tt = t[:, None, None, None]  # [B, 1, 1, 1]
    xt = (1 - tt) * x0 + tt * noise  # [B, C, H, W]
    return ((model(xt, t, cond) - (noise - x0)) ** 2).mean()


def logit_normal(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[n] times t = sigmoid(N(0, 1)): more weight on the middle of the path, SD3's choice
    (Esser et al. 2024, section 3.1, "logit-normal sampling" with m = 0, s = 1)."""
    return torch.sigmoid(torch.randn(n, generator=generator))


def save_flow(weights: dict[str, torch.Tensor], cfg: FlowConfig, path: str):
    """Writes `path`/config.json + model.safetensors (fp32): weights {name: tensor}, a model's
    state_dict or the gathered shards of one (roles/flow_actor.py `export`)."""
    cfg.save(path)
    state = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def load_flow(path: str, device="cpu") -> tuple[FlowModel, FlowConfig]:
    """A flow model saved by `save_flow` -> (model in eval mode on `device`, its config)."""
    cfg = read_flow_config(path)
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise UserError(f"{path!r} has config.json but no model.safetensors")
    model = FlowModel(cfg)
    try:
        model.load_state_dict(load_file(file))
    except RuntimeError as e:  # missing, extra or reshaped tensors
        raise UserError(f"{file} does not match its config.json: {e}") from None
    return model.to(device).eval(), cfg
