"""Qwen2-VL (HF's Qwen2VLForConditionalGeneration) on top of models.decoder's decoder: the vision
tower, the splice of its output at the image-pad tokens, and M-RoPE.

The tower is a ViT over patches of 2 frames x 14 x 14 pixels (an image is its own frame twice), with
a 2-D rotary embedding over each patch's (row, column), attention within each image only, and a
patch merger that folds each 2x2 window of patches into one token of the language model's width.
M-RoPE (Qwen2-VL's multimodal RoPE) gives each token three positions (temporal, height, width):
text tokens have all three equal, an image's tokens the rows and columns of its merged grid, and
each rotary frequency of a head reads one of the three (`mrope_section` says how many read each).

Parameter names are HF's legacy ones, which transformers 5 still writes to disk and vLLM reads:
`visual.*` beside the decoder's `model.*` and `lm_head.weight`; transformers 5's in-memory names
(`model.language_model.*`, `model.visual.*`) load too (models.hf.legacy_name).

Supported: Qwen2-VL on images (Qwen/Qwen2-VL-2B/7B/72B-Instruct's architecture). Refused, with a
UserError naming the architecture (REFUSED): Qwen2.5-VL (RMSNorm + SwiGLU vision blocks, window
attention outside `fullatt_block_indexes`, patches reordered by window) and Qwen3-VL (deepstack
features added into early decoder layers, interleaved M-RoPE, a learned position embedding in the
tower). Videos are not handled: `video_token_id` is kept in the config only.

Its config.json side (`Vision`, the flattening of vision_config, the refused architectures) is in
models/config.py; models/hf.py picks `VLTransformer` for a config with `vision`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig, Vision
from models.decoder import Transformer, attention_mask, rotate_half
from utils.errors import UserError

# ---------------------------------------------------------------- M-RoPE positions

def rope_index(tokens, grids, valid, cfg: ModelConfig):
    """M-RoPE positions of a left- or right-padded batch, as transformers' Qwen2-VL get_rope_index:
    text tokens count on from the position after what precedes them (the same on all three axes);
    an image's h*w/4 tokens, at `start` = the position after the text before it, get (start,
    start + row, start + column) of its merged grid, and the text after it starts at start +
    max(rows, columns).

    tokens [B, L] with each image's pad tokens expanded; grids [n_images, 3] (t, h, w) in patches,
    the images of row 0 first, in order; valid bool [B, L] (False = padding; None = all real).
    Returns (positions [3, B, L] long, 0 at padding as transformers puts it; deltas [B] long, the
    position of each row's next token = its largest position + 1, from which decoding goes on 1-D).
    transformers' rope_deltas = deltas - valid.sum(-1)."""
    B, L = tokens.shape
    merge, image = Vision.of(cfg.vision).spatial_merge_size, cfg.image_token_id
    valid = torch.ones(B, L, dtype=torch.bool) if valid is None else valid.cpu()
    images = iter(grids.tolist() if grids is not None else [])
    positions = torch.zeros(3, B, L, dtype=torch.long)
    deltas = torch.zeros(B, dtype=torch.long)
    for b, ids in enumerate(tokens.cpu().tolist()):
        ids = [x for x, real in zip(ids, valid[b].tolist()) if real]
        parts, start, i = [], 0, 0  # parts: [3, n] positions of each run of text or image tokens
        while i < len(ids):
            if ids[i] != image:
                j = ids.index(image, i) if image in ids[i:] else len(ids)
                parts.append(torch.arange(start, start + j - i).expand(3, -1))  # [3, text run]
                start += j - i
            else:
                grid = next(images, None)
                if grid is None:
                    raise UserError(f"row {b} has more images (runs of image-pad tokens) than grids gives")
                t, h, w = grid[0], grid[1] // merge, grid[2] // merge
                j = i + t * h * w
                if ids[i:j] != [image] * (t * h * w):
                    run = next((k for k, x in enumerate(ids[i:j]) if x != image), len(ids) - i)
                    raise UserError(f"row {b}: an image of grid {grid} needs {t * h * w} image-pad tokens in "
                                    f"a row, the prompt has {run} there; expand each <|image_pad|> to its "
                                    f"image's h*w/{merge ** 2} copies")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                parts.append(torch.stack([tt, hh, ww]).flatten(1) + start)  # [3, t*h*w]
                start += max(h, w)
            i = j
        if parts:
            row = torch.cat(parts, 1)  # [3, n real tokens]
            positions[:, b, valid[b]] = row
            deltas[b] = row.max() + 1
    if next(images, None) is not None:
        raise UserError(f"grids has {len(grids)} images, more than the prompts' runs of image-pad tokens")
    return positions.to(tokens.device), deltas.to(tokens.device)


def mrope_cos_sin(positions, inv_freq, section: list[int], dtype):
    """positions [3, B, S] (t, h, w) -> cos, sin [B, 1, S, D]. Frequency j of the D/2 reads the
    axis i % 3 of the section i it falls in (section [16, 24, 24] of a 128-dim head: the first 16
    frequencies the temporal position, the next 24 the row, the last 24 the column), as
    transformers' Qwen2VLRotaryEmbedding."""
    freqs = mrope_freqs(positions, inv_freq, section)  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), -1)[:, None]  # [B, 1, S, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_freqs(positions, inv_freq, section: list[int]):
    """positions [3, B, S] -> rotary angles [B, S, D/2], each frequency reading its section's axis."""
    freqs = positions[..., None].float() * inv_freq.float()  # [3, B, S, D/2]
    return torch.cat([part[i % 3] for i, part in enumerate(freqs.split(section, -1))], -1)  # [B, S, D/2]


# ---------------------------------------------------------------- the vision tower

def patch_positions(grids, merge: int):
    """(row, column) of each patch, in the order the image processor lays patches out: merge x
    merge windows row-major, the patches of a window row-major inside it; a video's frames
    repeat its frame's. grids [n, 3] -> [N, 2] long."""
    out = []
    for t, h, w in grids.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")  # [h, w] each
        window = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(window).transpose(1, 2).flatten()  # [h*w]
        cols = cols.reshape(window).transpose(1, 2).flatten()  # [h*w]
        out.append(torch.stack([rows, cols], -1).repeat(t, 1))  # [t*h*w, 2]
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.long)


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)  # Qwen2-VL's vision activation (CLIP's)


class VisionAttention(nn.Module):
    def __init__(self, v: Vision):
        super().__init__()
        self.heads = v.num_heads
        self.qkv = nn.Linear(v.embed_dim, 3 * v.embed_dim)
        self.proj = nn.Linear(v.embed_dim, v.embed_dim)

    def forward(self, x, cos, sin, frames: list[int]):
        """x [N, E]; cos, sin [N, 1, Dv]; frames: patches per frame (an image is one), which attend
        to each other and to no other frame's (bidirectional)."""
        N, E = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.heads, E // self.heads).unbind(1)  # [N, Hv, Dv] each
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)  # rotated in fp32, as HF
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        outs = []
        for qf, kf, vf in zip(q.split(frames), k.split(frames), v.split(frames)):  # [n, Hv, Dv] each
            o = F.scaled_dot_product_attention(qf.transpose(0, 1), kf.transpose(0, 1), vf.transpose(0, 1))
            outs.append(o.transpose(0, 1))  # [n, Hv, Dv]
        out = torch.cat(outs) if outs else v  # no frames: v [0, Hv, Dv] keeps qkv in the graph
        return self.proj(out.reshape(N, E))  # [N, E]


class VisionMLP(nn.Module):
    def __init__(self, v: Vision):
        super().__init__()
        self.fc1 = nn.Linear(v.embed_dim, v.mlp_dim)
        self.fc2 = nn.Linear(v.mlp_dim, v.embed_dim)

    def forward(self, x):
        return self.fc2(quick_gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, v: Vision):
        super().__init__()
        self.norm1 = nn.LayerNorm(v.embed_dim, eps=1e-6)
        self.attn = VisionAttention(v)
        self.norm2 = nn.LayerNorm(v.embed_dim, eps=1e-6)
        self.mlp = VisionMLP(v)

    def forward(self, x, cos, sin, frames):
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, v: Vision):
        super().__init__()
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.in_channels, v.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, pixels):
        """pixels [N, C*T*P*P] -> [N, E]. A Conv3d whose stride is its kernel, over one patch
        each, is a matmul with the flattened kernel (same (C, T, P, P) order; ~10x faster on CPU)."""
        return F.linear(pixels.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class PatchMerger(nn.Module):
    def __init__(self, v: Vision):
        super().__init__()
        merged = v.embed_dim * v.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(v.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, v.out_size))

    def forward(self, x):
        """x [N, E], each merge window's patches consecutive -> [N / merge^2, out_size]."""
        x = self.ln_q(x)
        return self.mlp(x.view(-1, self.mlp[0].in_features))


class VisionTower(nn.Module):
    """HF's `visual`: the patches of all images -> their language-model tokens."""

    def __init__(self, v: Vision):
        super().__init__()
        self.dims = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList([VisionBlock(v) for _ in range(v.depth)])
        self.merger = PatchMerger(v)
        self.register_buffer("inv_freq", torch.empty(v.embed_dim // v.num_heads // 4), persistent=False)

    def init_buffers(self):
        quarter = self.dims.embed_dim // self.dims.num_heads // 2  # half a head rotates with the row
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / self.dims.rope_theta ** (torch.arange(0, quarter, 2).float() / quarter))

    def rope(self, grids):
        """grids [n, 3] -> cos, sin [N, 1, Dv] fp32: a head's first half of frequencies read the
        patch's row, the second half its column (HF's 2-D rotary over (h, w))."""
        rc = patch_positions(grids, self.dims.spatial_merge_size).to(self.inv_freq.device)  # [N, 2]
        freqs = (rc[..., None].float() * self.inv_freq.float()).flatten(1)  # [N, Dv/2]: rows', columns'
        emb = torch.cat((freqs, freqs), -1)[:, None]  # [N, 1, Dv]
        return emb.cos(), emb.sin()

    def forward(self, pixels, grids):
        """pixels [N, C*T*P*P] (all images, in order), grids [n, 3] long -> [N / merge^2, hidden]."""
        x = self.patch_embed(pixels)  # [N, E]
        cos, sin = self.rope(grids)
        frames = [h * w for t, h, w in grids.tolist() for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)  # [N / merge^2, hidden]


# ---------------------------------------------------------------- the language model

class VLTransformer(Transformer):
    """models.decoder's decoder with HF's `visual` tower beside it and M-RoPE; `model.layers` as in
    the text decoder (FSDP2 wraps each layer; the tower is in the root's group)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.visual = VisionTower(Vision.of(cfg.vision))

    def init_buffers(self):
        super().init_buffers()
        self.visual.init_buffers()

    def batch_inputs(self, batch) -> dict:
        """The causal mask over a padded batch, its rows' M-RoPE positions and images (batch_inputs)."""
        return {"mask": attention_mask(batch["valid"]), **batch_inputs(self.config, batch)}

    def init_weights(self, seed: int = 0, std: float = 0.02):
        super().init_weights(seed, std)
        with torch.no_grad():  # LayerNorms start as identities (the base init knows RMSNorm weights only)
            for m in self.visual.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.fill_(1.0)
                    m.bias.zero_()

    def rope(self, positions, dtype):
        """positions [3, B, S] (t, h, w), or [B, S] for text (the same on all three) -> cos, sin
        [B, 1, S, D]."""
        if positions.dim() == 2:
            positions = positions.expand(3, *positions.shape)
        return mrope_cos_sin(positions, self.inv_freq, self.config.mrope_section, dtype)

    def forward(self, tokens, positions=None, mask=None, cache=None, logits_from: int = 0, pixels=None,
                grids=None, prompt_len: int | None = None, feature_rows=None, targets=None,
                temperature: float = 1.0):
        """Transformer.forward, with pixels [N, 1176] and grids [n, 3] of the batch's images (row 0's
        first), whose tower outputs replace the image-pad tokens' embeddings in order. positions
        [3, B, S] (rope_index; [B, S] = text), default: 1-D from the cache's fill level (right for
        text only; after a prefill with images, decode at deltas + step). Pass pixels of shape
        [0, 1176] for a batch without images where ranks must run the same modules (FSDP).
        prompt_len: image pads from this column on are text (a sampled one); feature_rows [M]: the
        row of the tower's output each image-pad takes (when images repeat: models.qwen2_vl.images_of);
        targets, temperature: as Transformer.forward."""
        h = self.model.embed_tokens(tokens)  # [B, S, h]
        if pixels is not None:
            features = self.visual(pixels, grids)  # [M', h]
            if feature_rows is not None:  # images shared by several rows ran once
                features = features[feature_rows]  # [M, h]
            h = splice_images(h, image_pads(tokens, self.config, prompt_len), features)
        return self.run(h, positions, mask, cache, logits_from, targets, temperature)


def image_pads(tokens, cfg: ModelConfig, prompt_len: int | None = None):
    """bool [B, S]: where image features go, the image-pad tokens of the prompt (its first
    prompt_len columns, all when None). A completion that samples the image-pad token gets the
    token's own embedding, in the trainer as in both engines (they splice the prompt's only)."""
    pads = tokens == cfg.image_token_id  # [B, S]
    if prompt_len is not None:
        pads[:, prompt_len:] = False
    return pads


def images_of(rows: list, cfg: ModelConfig, device) -> tuple:
    """The images of rows, each distinct one once (a prompt's n samples share theirs): (pixels
    [N, 1176] and grids [n, 3] long of the distinct images; grids [n', 3] of every row's images in
    order; feature_rows [M] long, the row of the tower's output that each image-pad token of the
    rows takes). No image: pixels [0, 1176], so that every rank still runs the tower (FSDP2's
    collectives pair up). rows: per row, (patches, grids) or None (tasks.data.make_batch's `images`)."""
    merge, first = Vision.of(cfg.vision).spatial_merge_size, {}  # first: id(patches) -> its feature rows
    pixels, grids, row_grids, feature_rows, done = [], [], [], [], 0
    for x in rows:
        if x is None:
            continue
        if id(x[0]) not in first:
            tokens = int(x[1].prod(-1).sum()) // merge ** 2
            first[id(x[0])] = torch.arange(done, done + tokens)
            pixels.append(x[0])
            grids.append(x[1])
            done += tokens
        row_grids.append(x[1])
        feature_rows.append(first[id(x[0])])
    if not pixels:
        empty = torch.zeros(0, Vision.of(cfg.vision).patch_dim, device=device)
        none = torch.zeros(0, 3, dtype=torch.long, device=device)
        return empty, none, none, None
    cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
    return cat(pixels), cat(grids), cat(row_grids), cat(feature_rows)


def batch_inputs(cfg: ModelConfig, batch) -> dict:
    """forward's positions, images and prompt_len for a padded batch (tasks.data.make_batch): the
    prompts' M-RoPE positions (rope_index over the first prompt_len columns), the completions'
    going on 1-D from each prompt's deltas, as the engines decode them."""
    ids, valid, P = batch["input_ids"], batch["valid"], batch["prompt_len"]
    rows = batch.get("images") or [None] * len(ids)
    pixels, grids, row_grids, feature_rows = images_of(rows, cfg, ids.device)
    prompt, deltas = rope_index(ids[:, :P], row_grids, valid[:, :P], cfg)  # [3, N, P], [N]
    steps = deltas[:, None] + torch.arange(ids.shape[1] - P, device=ids.device)  # [N, T]
    positions = torch.cat([prompt, steps.expand(3, -1, -1)], -1)  # [3, N, P + T]
    return {"positions": positions, "pixels": pixels, "grids": grids, "prompt_len": P,
            "feature_rows": feature_rows}


def prompt_inputs(model, prompts: list, tokens, valid) -> tuple:
    """A native engine's prefill of left-padded prompts tokens, valid [B, P] (ImagePrompt or
    text rows) -> (input embeddings [B, P, h] with the images' features at their pads, M-RoPE
    positions [3, B, P], deltas [B]: where each row's decoding goes on)."""
    rows = [(p.patches(), torch.tensor(p.grids)) if getattr(p, "images", None) else None for p in prompts]
    pixels, grids, row_grids, feature_rows = images_of(rows, model.config, tokens.device)
    positions, deltas = rope_index(tokens, row_grids, valid, model.config)  # [3, B, P], [B]
    h = model.model.embed_tokens(tokens)  # [B, P, h]
    if len(grids):
        features = model.visual(pixels.to(h.dtype), grids)[feature_rows]  # [M, h]
        h = splice_images(h, image_pads(tokens, model.config), features)
    return h, positions, deltas


def splice_images(h, is_image, features):
    """h [B, S, hidden] with the rows of `features` [M, hidden] at the True places of is_image
    [B, S], in row-major order (each image's tokens in the processor's order)."""
    n, m = int(is_image.sum()), features.shape[0]
    if n != m:
        raise UserError(f"{n} image tokens but {m} image features: each <|image_pad|> must be expanded to "
                        "its image's h*w/4 copies (grids), every image of the batch passed once, and no "
                        "completion may contain the image-pad token")
    return h.masked_scatter(is_image[..., None], features.to(h.dtype))
