"""A Qwen2 / Qwen3 / Llama decoder in plain torch, with HF safetensors load and save. Qwen3 adds
an RMSNorm over each head's queries and keys before RoPE; Llama 3.x's RoPE scaling is
`rope_frequencies`. Qwen2-VL (Qwen2VLForConditionalGeneration) is this decoder with a vision tower
and M-RoPE, in utils/vl_model.py: `model_class` / `build` pick it for a config with `vision`.

The same decoder with a `score` head instead of `lm_head` is HF's `...ForSequenceClassification`
(a reward model, or with one label the critic's value model): `Transformer.forward` then
returns one score per position and label instead of logits.

Parameter names are the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`),
so a state dict goes to transformers, to vLLM's `load_weights` and back without a
rename table. The model is built on the meta device and materialised with
`to_empty` (torchtitan's pattern), so FSDP2 can shard it before any full copy exists.
"""
import json
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from utils.algos import head_logprobs
from utils.data import read_json
from utils.errors import UserError

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
             "Qwen2ForSequenceClassification": "qwen2", "Qwen3ForSequenceClassification": "qwen3",
             "LlamaForSequenceClassification": "llama", "Qwen2VLForConditionalGeneration": "qwen2_vl"}
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# config.json keys that change the math and that this decoder does not implement, with the value
# under which they change nothing (transformers' default); any other `*_scaling`, `*_multiplier` or
# `*softcapping` key is refused the same way unless it is null
NEUTRAL = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False, "partial_rotary_factor": 1.0,
           "attention_dropout": 0.0, "hidden_dropout": 0.0, "attn_logit_softcapping": None,
           "final_logit_softcapping": None, "logits_scaling": 1.0, "embedding_multiplier": 1.0,
           "residual_multiplier": 1.0, "attention_multiplier": None, "use_qk_norm": False}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "preprocessor_config.json")  # the last: Qwen2-VL's images


@dataclass
class ModelConfig:
    architecture: str = "Qwen2ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_llama3: dict | None = None  # Llama 3.x's RoPE scaling (rope_type llama3): the LLAMA3_ROPE keys
    attention_bias: bool = True  # Qwen2 has q/k/v bias, Llama usually not
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None  # ...ForSequenceClassification: scores sit on the last non-pad token
    num_labels: int = 1  # ...ForSequenceClassification: outputs of the score head
    vision: dict | None = None  # Qwen2-VL: config.json's vision_config (utils.vl_model); None: a text model
    image_token_id: int | None = None  # Qwen2-VL: <|image_pad|>, where the tower's outputs go
    vision_start_token_id: int | None = None  # Qwen2-VL: <|vision_start|>, before each image's pads
    mrope_section: list[int] | None = None  # Qwen2-VL: rotary frequencies per (t, h, w) axis, summing to D/2
    extra: dict = field(default_factory=dict)  # the rest of config.json, written back unchanged

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        by_type = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                   "qwen2_vl": "Qwen2VLForConditionalGeneration"}
        arch = archs[0] if archs else by_type.get(d.get("model_type"))
        vl = {}  # the Qwen2-VL fields
        if arch == "Qwen2VLForConditionalGeneration":
            from utils.vl_model import flatten_config
            d, vl = flatten_config(d)  # the language model's keys, flat as in a Qwen2 config.json
        elif arch not in SUPPORTED:
            from utils.vl_model import REFUSED, refusal
            if arch in REFUSED:
                raise refusal(arch)
            raise UserError(
                f"unsupported architecture {arch or d.get('model_type')!r} in config.json; "
                f"this trainer supports {sorted(SUPPORTED)} (decoder-only Qwen2 / Qwen3 / Llama; Qwen2-VL)")
        rope, llama3 = read_rope(d)
        check_math_keys(d)
        heads = d["num_attention_heads"]
        num_labels = 1  # a causal model: unused
        if d.get("id2label"):
            num_labels = len(d["id2label"])
        elif arch.endswith("ForSequenceClassification"):
            # transformers leaves id2label out of config.json for its default, 2 labels
            num_labels = d.get("num_labels") or 2
        written = {f for f in cls.__dataclass_fields__} | {"architectures", "model_type"}  # by to_hf
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            rope_llama3=llama3,
            attention_bias=True if arch.startswith("Qwen2") else bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            num_labels=num_labels,
            extra={k: v for k, v in d.items() if k not in written},
            **vl,
        )

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over each head's queries and keys, before RoPE."""
        return self.architecture.startswith("Qwen3")

    @property
    def o_bias(self) -> bool:
        """attention_bias covers o_proj too in Llama and Qwen3; Qwen2's q/k/v bias does not."""
        return self.attention_bias and not self.architecture.startswith("Qwen2")

    def to_hf(self) -> dict:
        d = dict(self.extra)
        d.update(
            architectures=[self.architecture], model_type=SUPPORTED[self.architecture],
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rope_theta=self.rope_theta,  # older transformers / vLLM read it here
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
        )
        if self.rope_llama3:
            d["rope_parameters"] = {"rope_type": "llama3", "rope_theta": self.rope_theta, **self.rope_llama3}
            d["rope_scaling"] = d["rope_parameters"]  # older transformers / vLLM read it here
        if self.pad_token_id is not None:
            d["pad_token_id"] = self.pad_token_id
        if self.scores:
            labels = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            d.update(id2label=labels, label2id={v: int(k) for k, v in labels.items()})
        if self.architecture.startswith("Llama"):
            d.update(attention_bias=self.attention_bias, mlp_bias=False)
        elif self.qk_norm:
            d.update(attention_bias=self.attention_bias, use_sliding_window=False)
        elif not self.attention_bias:
            raise UserError("Qwen2 always has q/k/v bias; use LlamaForCausalLM for a bias-free model")
        if self.vision is not None:
            from utils.vl_model import nest_config
            return nest_config(d, self)  # transformers 5's layout: text_config, vision_config
        return d

    @property
    def scores(self) -> bool:
        """A sequence-classification model: a `score` head [num_labels, hidden] instead of lm_head."""
        return self.architecture.endswith("ForSequenceClassification")

    def with_score_head(self, num_labels: int = 1) -> "ModelConfig":
        """This decoder as ...ForSequenceClassification (the critic's value model)."""
        from dataclasses import replace
        if self.vision is not None:
            raise UserError(f"{self.architecture} has no sequence-classification form here: a value or "
                            "reward model of a vision-language checkpoint is not implemented")
        arch = self.architecture.replace("ForCausalLM", "ForSequenceClassification")
        return replace(self, architecture=arch, num_labels=num_labels, tie_word_embeddings=False)

    def layer_params(self) -> int:
        """One decoder block's parameters."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        bias = (q + 2 * kv + (h if self.o_bias else 0)) if self.attention_bias else 0
        attn = h * q + 2 * h * kv + q * h + bias + (2 * self.head_dim if self.qk_norm else 0)
        return attn + 3 * h * self.intermediate_size + 2 * h

    def num_params(self, embeddings: bool = True, vision: bool = True) -> int:
        """All parameters (a Qwen2-VL's vision tower too, unless vision=False)."""
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings or self.scores else 2)
        head = self.hidden_size * self.num_labels if self.scores else 0
        body = self.num_hidden_layers * self.layer_params() + self.hidden_size + head
        if vision and self.vision is not None:
            from utils.vl_model import Vision
            body += Vision.of(self.vision).num_params()
        return body + (emb if embeddings else 0)


def read_rope(d: dict) -> tuple[dict, dict | None]:
    """(the RoPE parameters, Llama 3.x's scaling or None) from config.json, whichever of its
    spellings it uses: `rope_parameters` (transformers 5) and `rope_scaling` (older; either may sit
    beside the other, as in Qwen2.5's model cards with YaRN added), `rope_type` or `type`. A
    scaling other than llama3 is refused, naming the key that asks for it."""
    kinds = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key) or {}
        kinds[key] = rope.get("rope_type", rope.get("type", "default"))
        if kinds[key] not in ("default", "llama3"):
            raise UserError(f"config.json: {key} asks for rope_type {kinds[key]!r}, which this trainer does "
                            "not implement (supported: default, plain RoPE with a theta, and llama3); remove "
                            "it to train with plain RoPE, or use a checkpoint without it")
    if len(set(kinds.values())) > 1 and all(d.get(k) for k in kinds):
        raise UserError(f"config.json: rope_parameters ({kinds['rope_parameters']}) and rope_scaling "
                        f"({kinds['rope_scaling']}) disagree; keep one")
    key = "rope_scaling" if kinds["rope_scaling"] == "llama3" else "rope_parameters"
    rope = d.get(key) or {}
    if kinds[key] != "llama3":
        return rope, None
    missing = [k for k in LLAMA3_ROPE if k not in rope]
    if missing:
        raise UserError(f"config.json: rope_type 'llama3' without {missing} in {key}")
    return rope, {k: rope[k] for k in LLAMA3_ROPE}


def check_math_keys(d: dict):
    """Refuses a config.json key that changes the math and is not implemented here (NEUTRAL; a
    sliding window in `layer_types` too), naming it: training without it would silently be
    another model than the one transformers or vLLM load from the same directory."""
    for key, value in d.items():
        neutral = NEUTRAL.get(key)
        if key not in NEUTRAL and not key.endswith(("_scaling", "_multiplier", "softcapping")):
            continue
        if key == "rope_scaling" or value in (neutral, None):  # rope_scaling: read_rope
            continue
        raise UserError(f"config.json: {key} = {value!r} changes the model's math and is not implemented "
                        f"here; set it to {neutral!r} (or remove it) if the checkpoint was trained that way, "
                        f"else use another checkpoint")
    windows = [t for t in d.get("layer_types") or [] if t != "full_attention"]
    if windows:
        raise UserError(f"config.json: layer_types has {len(windows)} {windows[0]!r} layers; sliding-window "
                        "attention is not implemented here (every layer must be full_attention)")


def rope_frequencies(head_dim: int, theta: float, llama3: dict | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies -> [D/2]. llama3: Llama 3.1's scaling (Meta's release, as
    transformers' `rope_type: llama3`): wavelengths longer than original_len / low_freq_factor are
    stretched by `factor`, those shorter than original_len / high_freq_factor kept, and those
    between interpolated linearly in original_len / wavelength."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D/2]
    if not llama3:
        return inv
    factor, low, high, original = (llama3[k] for k in LLAMA3_ROPE)
    wavelen = 2 * math.pi / inv  # [D/2]
    smooth = (original / wavelen - low) / (high - low)  # [D/2], 0 at the long edge, 1 at the short
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    out = torch.where(wavelen > original / low, inv / factor, inv)  # [D/2]
    return torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, out)  # [D/2]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                  cfg.head_dim)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        self.gqa = self.n_kv != self.n_heads  # a bool: under torch.compile(dynamic=True) ints are symbols
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer: int):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = self.k_proj(x).view(B, S, self.n_kv, self.head_dim)  # [B, S, KV, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, S, D], [B, KV, S, D]
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)  # [B, KV, S, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:  # write this step's keys into the preallocated cache, attend to all so far
            k, v = cache.update(layer, k, v)  # [B, KV, L, D]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and S > 1, enable_gqa=self.gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))  # [B, S, h]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """Holds the `model.*` parameters, so that names match HF's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KVCache:
    """Preallocated keys and values for a batch: [layers, B, KV, max_len, D]; `pos` is the fill level.
    `slot` (a [1] tensor, utils/decode.py GraphedStep): one token's keys and values are written at
    that slot and attention reads the whole cache, its unfilled slots masked, so that a step's
    shapes and addresses never change (a CUDA graph replays it)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.pos, self.slot = 0, None

    def update(self, layer: int, k, v):
        if self.slot is not None:
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            return self.k[layer], self.v[layer]
        end = self.pos + k.shape[2]
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        if cfg.scores:  # HF's ...ForSequenceClassification: a bias-free score head, no lm_head
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings and not cfg.scores:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)

    def init_buffers(self):
        """Fill the non-persistent RoPE buffer (it is garbage after `to_empty`)."""
        c = self.config
        with torch.no_grad():
            self.inv_freq.copy_(rope_frequencies(c.head_dim, c.rope_theta, c.rope_llama3))

    def init_weights(self, seed: int = 0, std: float = 0.02):
        """Random init (for tests and fresh models), deterministic in `seed` whatever the device."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        self.init_buffers()

    def forward(self, tokens, positions=None, mask=None, cache: KVCache | None = None, logits_from: int = 0,
                targets=None, temperature: float = 1.0):
        """tokens [B, S]; positions [B, S] (default 0..S-1 after the cache); mask: bool [B, 1, S, L]
        (True = attend) or None for plain causal. Returns logits [B, S - logits_from, V] in fp32
        (a score model: scores [B, S - logits_from, num_labels]); with targets [B, T], the log-probs
        [B, T] of those tokens under softmax(logits / temperature) (`run`)."""
        h = self.model.embed_tokens(tokens)  # [B, S, hidden]
        return self.run(h, positions, mask, cache, logits_from, targets, temperature)

    def rope(self, positions, dtype):
        """positions [B, S] -> cos, sin [B, 1, S, D] in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def run(self, h, positions, mask, cache: KVCache | None, logits_from: int, targets=None,
            temperature: float = 1.0):
        """The decoder over input embeddings h [B, S, hidden] (forward's tokens, embedded); with
        targets [B, T] (T <= S - logits_from), their log-probs [B, T] instead of logits (algos.head_logprobs:
        never the whole batch's logits at once)."""
        B, S, _ = h.shape
        start = cache.pos if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + S, device=h.device).expand(B, S)
        cos, sin = self.rope(positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask, cache)
        if cache is not None:
            cache.pos += S
        h = self.model.norm(h[:, logits_from:])
        if self.config.scores:
            return self.score(h).float()  # [B, S', num_labels]
        if targets is not None:
            return head_logprobs(h, self.lm_head.weight, targets, temperature)  # [B, T]
        return self.lm_head(h).float()  # [B, S', V]


def attention_mask(valid, query_len: int | None = None):
    """Causal mask over a left/right padded batch. valid: bool [B, L] (False = padding).
    Returns bool [B, 1, Q, L] for the last Q query positions (Q = L by default). Every query
    also sees itself, so a padding row never has an empty softmax (its output is ignored)."""
    B, L = valid.shape
    Q = L if query_len is None else query_len
    q_idx = torch.arange(L - Q, L, device=valid.device)[:, None]  # [Q, 1]
    k_idx = torch.arange(L, device=valid.device)[None, :]  # [1, L]
    causal = k_idx <= q_idx  # [Q, L]
    return ((causal[None] & valid[:, None, :]) | (k_idx == q_idx)[None])[:, None]  # [B, 1, Q, L]


def completion_logprobs(model, batch, temperature: float):
    """log pi(token) of each completion token of a packed batch (utils.data.make_batch) ->
    [N, T]. Logits are made for completion positions only (the prompt's are never needed), and
    never for the whole batch at once (utils.algos.head_logprobs)."""
    P = batch["prompt_len"]
    return model(batch["input_ids"], **batch_inputs(model, batch), logits_from=P - 1,
                 targets=batch["input_ids"][:, P:], temperature=temperature)  # [N, T]


def batch_inputs(model, batch) -> dict:
    """The forward's keywords for a packed batch: positions that skip left padding and the causal
    mask over it; a Qwen2-VL's M-RoPE positions and its rows' images too (utils.vl_model.batch_inputs)."""
    valid = batch["valid"]
    if model.config.vision is not None:
        from utils.vl_model import batch_inputs as vision_inputs

        return {"mask": attention_mask(valid), **vision_inputs(model.config, batch)}
    return {"positions": positions_from(valid), "mask": attention_mask(valid)}


def completion_values(model, batch):
    """A value model's V(s_t) for each completion token t, the state being the prompt and the
    tokens before t (the position whose logits would sample t) -> [N, T]."""
    P, valid = batch["prompt_len"], batch["valid"]
    out = model(batch["input_ids"], positions_from(valid), attention_mask(valid), logits_from=P - 1)
    return out[:, :-1, 0]  # [N, T]


def sequence_scores(model, batch):
    """A reward model's score of each whole sequence, read at its last non-pad token (as HF's
    ...ForSequenceClassification does) -> [N]. HF finds that token by input_ids != pad_token_id,
    so a real token equal to the pad id (an EOS that is also the pad token, as in
    assets/arith-tiny) is skipped here too: the score sits on the token before it, as in HF."""
    valid = batch["valid"]
    out = model(batch["input_ids"], positions_from(valid), attention_mask(valid))  # [N, L, 1]
    L = valid.shape[1]
    real = valid
    if model.config.pad_token_id is not None:
        real = valid & (batch["input_ids"] != model.config.pad_token_id)  # [N, L]
    last = (torch.arange(L, device=valid.device) * real).argmax(-1)  # [N] the rightmost non-pad token
    return out[torch.arange(len(last)), last, 0]  # [N]


def positions_from(valid):
    """Position ids that skip left padding: valid [B, L] -> [B, L]."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


# ---------------------------------------------------------------- HF checkpoint directories

HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]  # config, weights, tokenizer


def local_dir(path: str, flag: str = "--model") -> str:
    """A checkpoint directory: `path` itself, or, for a hub id (ORG/NAME) that is no local path,
    its snapshot in the Hugging Face cache (downloaded with huggingface_hub: config, weights and
    tokenizer files only). Without the network, one error that says to pass a local directory."""
    parts = path.split("/")
    if os.path.exists(path) or len(parts) != 2 or not all(parts) or path.startswith((".", "~")):
        return path  # a local path (read_config says what is missing)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=HUB_FILES)
    except Exception as e:  # offline, unknown id, no access: the same advice
        raise UserError(f"{flag} {path}: no such local directory, and downloading it from the Hugging Face "
                        f"hub failed ({type(e).__name__}); without the network, pass a local checkpoint "
                        "directory (config.json, *.safetensors, tokenizer.json)") from None


def read_config(path: str) -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(
            f"{path!r} has no config.json; point --model at a Hugging Face checkpoint directory "
            "(config.json, *.safetensors, tokenizer.json)")
    d = read_json(cfg_file)
    try:
        return ModelConfig.from_hf(d)
    except KeyError as e:
        raise UserError(f"{cfg_file} has no {e} (is it a Qwen2 / Llama config.json?)") from None


def model_class(cfg: ModelConfig) -> type:
    """Transformer, or for a config with `vision` (Qwen2-VL) its subclass utils.vl_model.VLTransformer."""
    if cfg.vision is None:
        return Transformer
    from utils.vl_model import VLTransformer
    return VLTransformer


def build(cfg: ModelConfig, device="cpu", dtype=torch.float32) -> Transformer:
    """Build on meta, then allocate on `device` (weights uninitialised: load or init them)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and not cfg.scores:  # to_empty/to make a new tensor per module: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_buffers()
    return model


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")


def iter_checkpoint(path: str):
    """Yields (hf_name, tensor) from a checkpoint directory, one tensor at a time (names as
    `legacy_name` gives them)."""
    for file in safetensors_files(path):
        with _open_safetensors(file) as f:
            for name in f.keys():
                yield legacy_name(name), f.get_tensor(name)


# transformers >= 4.52 names Qwen2-VL's parts model.language_model.* and model.visual.* in memory
# (and in some saved files); the older names, which transformers 5 writes and vLLM reads, are ours
NEW_NAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def legacy_name(name: str) -> str:
    for new, old in NEW_NAMES:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def check_checkpoint(path: str):
    """Every safetensors file of a checkpoint opens (its header is whole and covers the file):
    a truncated or foreign file fails here, named, before any process group or model is built."""
    for file in safetensors_files(path):
        with _open_safetensors(file):
            pass


def _open_safetensors(file: str):
    try:
        return safe_open(file, framework="pt")
    except FileNotFoundError:
        raise UserError(f"{file} is listed in the checkpoint's index but does not exist") from None
    except Exception as e:  # safetensors' own error: a bad header, a file cut short
        raise UserError(f"{file} is not a readable safetensors file ({e}): was it cut short while "
                        "copying or downloading? Copy or export it again") from None


def load_state(model: Transformer, weights, strict: bool = True, may_lack: tuple[str, ...] = ()):
    """Copies (hf_name, tensor) pairs into `model` in place (DTensor-aware: a sharded
    parameter takes its local shard of the full tensor). A score model skips a causal
    checkpoint's lm_head; parameters named in `may_lack` keep their values when the checkpoint
    has none (a value head started from a policy)."""
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, tensor in weights:
            name = legacy_name(name)
            if name == "lm_head.weight" and (model.config.tie_word_embeddings or model.config.scores):
                continue
            if name not in params:
                if strict:
                    raise UserError(f"checkpoint tensor {name!r} has no matching parameter")
                continue
            p = params[name]
            if tuple(tensor.shape) != tuple(p.shape):
                raise UserError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                f"model {tuple(p.shape)} (is this checkpoint from a different model config?)")
            if hasattr(p, "device_mesh"):  # DTensor under FSDP2: copy our shard only
                from torch.distributed.tensor import distribute_tensor
                # src_data_rank=None: every rank read the same file, so each slices locally (no traffic)
                tensor = distribute_tensor(tensor.to(p.device, p.dtype), p.device_mesh, p.placements,
                                           src_data_rank=None).to_local()
                p.to_local().copy_(tensor)
            else:
                p.copy_(tensor)
            seen.add(name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(params) - seen - set(may_lack) - tied
    if strict and missing:
        raise UserError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def load_model(path: str, device="cpu", dtype=torch.float32) -> Transformer:
    model = build(read_config(path), device, dtype)
    load_state(model, iter_checkpoint(path))
    return model


def save_model(model_or_state, cfg: ModelConfig, path: str, tokenizer_dir: str | None = None, dtype=None):
    """Writes config.json + model.safetensors (HF layout; tied lm_head left out as HF does),
    and copies tokenizer files from `tokenizer_dir`."""
    os.makedirs(path, exist_ok=True)
    items = model_or_state.state_dict().items() if isinstance(model_or_state, nn.Module) else model_or_state
    state = {}
    for name, t in items:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.detach().cpu()
        state[name] = (t.to(dtype) if dtype else t).contiguous()
    hf = cfg.to_hf()
    hf["torch_dtype"] = hf["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer_dir:
        copy_tokenizer(tokenizer_dir, path)


def copy_tokenizer(src: str, dst: str):
    """The tokenizer files of checkpoint `src` into directory `dst` (a HF export, a PEFT adapter)."""
    if os.path.abspath(src) == os.path.abspath(dst):
        return
    import shutil
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def flops_per_token(cfg: ModelConfig, context: int = 0) -> float:
    """Forward FLOPs per token: 2 x matmul params (embeddings' lookup excluded, lm_head
    included) plus attention scores over `context` keys (Kaplan et al. 2020, table 1). A
    Qwen2-VL's vision tower is left out: it runs per image patch, not per token."""
    n = cfg.num_params(embeddings=False, vision=False) + cfg.vocab_size * cfg.hidden_size  # per text token
    return 2 * n + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context

