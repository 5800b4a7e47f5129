"""A checkpoint's config.json as our models read it: `ModelConfig` for the Qwen2 / Qwen3 / Llama
decoder (models/decoder.py) and its score-head variants, and Qwen2-VL's vision_config (`Vision`,
flattened into the decoder's config and nested back for HF), with the architectures we refuse.
Pure data and checks: no tensors are built here.
"""
import json
from dataclasses import dataclass, field, replace

from utils.errors import UserError

# transformers' Qwen2VLConfig defaults, used when config.json leaves a key out
IMAGE_TOKEN_ID, VISION_START_TOKEN_ID, MROPE_SECTION = 151655, 151652, [16, 24, 24]

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
             "Qwen2ForSequenceClassification": "qwen2", "Qwen3ForSequenceClassification": "qwen3",
             "LlamaForSequenceClassification": "llama", "Qwen2VLForConditionalGeneration": "qwen2_vl",
             "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3MoeForSequenceClassification": "qwen3_moe"}


# config.json keys that change the math and that this decoder does not implement, with the value
# under which they change nothing (transformers' default); any other `*_scaling`, `*_multiplier` or
# `*softcapping` key is refused the same way unless it is null
NEUTRAL = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False, "partial_rotary_factor": 1.0,
           "attention_dropout": 0.0, "hidden_dropout": 0.0, "attn_logit_softcapping": None,
           "final_logit_softcapping": None, "logits_scaling": 1.0, "embedding_multiplier": 1.0,
           "residual_multiplier": 1.0, "attention_multiplier": None, "use_qk_norm": False}


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
    vision: dict | None = None  # Qwen2-VL: config.json's vision_config (models.qwen2_vl); None: a text model
    image_token_id: int | None = None  # Qwen2-VL: <|image_pad|>, where the tower's outputs go
    vision_start_token_id: int | None = None  # Qwen2-VL: <|vision_start|>, before each image's pads
    mrope_section: list[int] | None = None  # Qwen2-VL: rotary frequencies per (t, h, w) axis, summing to D/2
    moe: "Moe | None" = None  # Qwen3-MoE: the sparse blocks' shape (models/moe.py); None: a dense model
    extra: dict = field(default_factory=dict)  # the rest of config.json, written back unchanged

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        by_type = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                   "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen3_moe": "Qwen3MoeForCausalLM"}
        arch = archs[0] if archs else by_type.get(d.get("model_type"))
        vl = {}  # the Qwen2-VL fields, or Qwen3-MoE's
        if arch == "Qwen2VLForConditionalGeneration":
            d, vl = flatten_config(d)  # the language model's keys, flat as in a Qwen2 config.json
        elif arch not in SUPPORTED:
            if arch in REFUSED:
                raise refusal(arch)
            raise UserError(
                f"unsupported architecture {arch or d.get('model_type')!r} in config.json; "
                f"this trainer supports {sorted(SUPPORTED)} (decoder-only Qwen2 / Qwen3 / Llama; Qwen3-MoE; "
                "Qwen2-VL)")
        if arch.startswith("Qwen3Moe"):
            d = dict(d)
            vl = {"moe": Moe.of(d)}  # its keys taken out of d (to_hf writes them back)
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
            return nest_config(d, self)  # transformers 5's layout: text_config, vision_config
        if self.moe is not None:
            d.update(self.moe.to_hf())
        return d

    @property
    def scores(self) -> bool:
        """A sequence-classification model: a `score` head [num_labels, hidden] instead of lm_head."""
        return self.architecture.endswith("ForSequenceClassification")

    def with_score_head(self, num_labels: int = 1) -> "ModelConfig":
        """This decoder as ...ForSequenceClassification (the critic's value model)."""
        if self.vision is not None:
            raise UserError(f"{self.architecture} has no sequence-classification form here: a value or "
                            "reward model of a vision-language checkpoint is not implemented")
        arch = self.architecture.replace("ForCausalLM", "ForSequenceClassification")
        return replace(self, architecture=arch, num_labels=num_labels, tie_word_embeddings=False)

    def layer_params(self, layer: int = 0, active: bool = False) -> int:
        """Decoder block `layer`'s parameters (a MoE model's sparse block: its router and all of its
        experts, or with `active` the top-k experts a token runs)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        bias = (q + 2 * kv + (h if self.o_bias else 0)) if self.attention_bias else 0
        attn = h * q + 2 * h * kv + q * h + bias + (2 * self.head_dim if self.qk_norm else 0)
        if self.moe is not None and self.moe.sparse(layer):
            return attn + self.moe.block_params(h, active) + 2 * h
        return attn + 3 * h * self.intermediate_size + 2 * h

    def num_params(self, embeddings: bool = True, vision: bool = True, active: bool = False) -> int:
        """All parameters (a Qwen2-VL's vision tower too, unless vision=False; a MoE model's active
        parameters per token with `active`)."""
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings or self.scores else 2)
        head = self.hidden_size * self.num_labels if self.scores else 0
        blocks = sum(self.layer_params(i, active) for i in range(self.num_hidden_layers))
        body = blocks + self.hidden_size + head
        if vision and self.vision is not None:
            body += Vision.of(self.vision).num_params()
        return body + (emb if embeddings else 0)


@dataclass(frozen=True)
class Moe:
    """config.json's mixture-of-experts keys (Qwen3MoeConfig's names and defaults); the sparse
    block itself is models/moe.py."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1 (Qwen3-30B-A3B: true)
    decoder_sparse_step: int = 1  # every this many layers is sparse
    mlp_only_layers: tuple = ()  # these layers keep a dense MLP of intermediate_size

    @classmethod
    def of(cls, d: dict) -> "Moe":
        """Read a config.json dict, taking its MoE keys out of it (transformers 5 writes the expert
        count as num_local_experts, the model cards as num_experts). router_aux_loss_coef stays in
        the config's other keys, written back unchanged: the trainer's coefficient is --router-aux-coef."""
        experts = d.pop("num_experts", None) or d.pop("num_local_experts", None)
        d.pop("num_local_experts", None)
        moe = cls(num_experts=experts or 128, num_experts_per_tok=d.pop("num_experts_per_tok", 8),
                  moe_intermediate_size=d.pop("moe_intermediate_size", 768),
                  norm_topk_prob=bool(d.pop("norm_topk_prob", False)),
                  decoder_sparse_step=d.pop("decoder_sparse_step", 1) or 1,
                  mlp_only_layers=tuple(d.pop("mlp_only_layers", None) or ()))
        if not 0 < moe.num_experts_per_tok <= moe.num_experts:
            raise UserError(f"config.json: num_experts_per_tok {moe.num_experts_per_tok} must be between 1 "
                            f"and num_experts ({moe.num_experts})")
        return moe

    def to_hf(self) -> dict:
        return {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers)}

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the sparse block (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def block_params(self, hidden: int, active: bool = False) -> int:
        """One sparse block's parameters: the router and every expert (active: the top-k experts a
        token runs, for FLOPs)."""
        experts = self.num_experts_per_tok if active else self.num_experts
        return hidden * self.num_experts + experts * 3 * hidden * self.moe_intermediate_size


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


ARCH = "Qwen2VLForConditionalGeneration"


REFUSED = {
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL (its vision tower's RMSNorm + SwiGLU blocks and "
                                          "window attention with fullatt_block_indexes)",
    "Qwen3VLForConditionalGeneration": "Qwen3-VL (deepstack features, interleaved M-RoPE, the tower's "
                                       "learned position embedding)",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL-MoE (a mixture-of-experts decoder besides Qwen3-VL's "
                                          "vision differences)",
    "Qwen2MoeForCausalLM": "Qwen2-MoE (a shared expert beside the routed ones, under a sigmoid gate; and "
                           "Qwen2's attention bias)",
}


# config.json keys that sit at the top level in transformers 5's layout, beside text_config and
# vision_config; every other key belongs to the language model (in the legacy layout, that of the
# Qwen2-VL model cards, all are at the top level)
TOP_KEYS = ("architectures", "model_type", "image_token_id", "video_token_id", "vision_start_token_id",
            "vision_end_token_id", "vision_token_id", "tie_word_embeddings", "transformers_version",
            "dtype", "torch_dtype")


def refusal(arch: str) -> UserError:
    if arch == "Qwen2MoeForCausalLM":
        return UserError(f"{arch} in config.json: {REFUSED[arch]} is not supported; this trainer's "
                         "mixture-of-experts model is Qwen3-MoE (Qwen3MoeForCausalLM, e.g. "
                         "Qwen/Qwen3-30B-A3B)")
    return UserError(f"{arch} in config.json: {REFUSED[arch]} is not supported; this trainer's "
                     f"vision-language model is Qwen2-VL ({ARCH}, e.g. Qwen/Qwen2-VL-2B-Instruct)")


@dataclass(frozen=True)
class Vision:
    """The tower's dimensions, read from a vision_config dict (either layout) with HF's defaults."""
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    out_size: int  # the language model's hidden size (vision_config's `hidden_size`)
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def of(cls, v: dict) -> "Vision":
        return cls(depth=v.get("depth", 32), embed_dim=v.get("embed_dim", 1280),
                   num_heads=v.get("num_heads", 16), mlp_ratio=v.get("mlp_ratio", 4),
                   out_size=v.get("hidden_size", 3584),
                   patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2),
                   in_channels=v.get("in_channels", v.get("in_chans", 3)),  # in_chans: the legacy name
                   rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 10000.0))

    @property
    def patch_dim(self) -> int:
        """Pixels in one flattened patch: 3 * 2 * 14 * 14 = 1176."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def mlp_dim(self) -> int:
        return int(self.embed_dim * self.mlp_ratio)

    def num_params(self) -> int:
        e, m, merged = self.embed_dim, self.mlp_dim, self.embed_dim * self.spatial_merge_size ** 2
        # two LayerNorms, qkv, proj, fc1, fc2
        block = 4 * e + (3 * e * e + 3 * e) + (e * e + e) + (e * m + m) + (m * e + e)
        merger = 2 * e + (merged * merged + merged) + (merged * self.out_size + self.out_size)
        return e * self.patch_dim + self.depth * block + merger


def flatten_config(d: dict) -> tuple[dict, dict]:
    """A Qwen2-VL config.json, transformers 5's layout (text_config and vision_config sub-dicts,
    rope_parameters with mrope_section) or the legacy one (text keys at the top level, rope_scaling
    {"type": "mrope", "mrope_section": ...}) -> (the language model's keys as one flat dict, as a
    Qwen2 config.json has them, with plain RoPE; ModelConfig's VL fields)."""
    flat = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
    flat.update(d.get("text_config") or {})
    # as transformers' Qwen2VLConfig: the top-level value, else one that an older save left in text_config
    flat["tie_word_embeddings"] = bool(d.get("tie_word_embeddings") or flat.get("tie_word_embeddings"))
    # as transformers' Qwen2VLTextConfig: rope_scaling (the legacy {"type": "mrope"}), if any, wins over
    # rope_parameters; "mrope" is plain RoPE whose frequencies read three positions
    scaling, parameters = flat.pop("rope_scaling", None), flat.pop("rope_parameters", None)
    rope = dict(scaling or parameters or {})
    section = list(rope.pop("mrope_section", MROPE_SECTION))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    flat["rope_theta"] = rope.pop("rope_theta", flat.get("rope_theta", 1e6))  # 1e6: transformers' default
    if kind not in ("default", "mrope") or rope:
        raise UserError(f"config.json: Qwen2-VL's RoPE is {kind!r} with {rope}; only plain M-RoPE "
                        "(rope_theta and mrope_section) is implemented here")
    hidden, heads = flat.get("hidden_size", 0), flat.get("num_attention_heads", 1)
    if flat.get("head_dim", hidden // heads) != hidden // heads:
        raise UserError(f"config.json: head_dim {flat['head_dim']} is not hidden_size / num_attention_heads; "
                        "transformers' and vLLM's Qwen2-VL ignore head_dim, so the checkpoint means another "
                        "model to each of them: remove head_dim")
    if sum(section) * 2 != hidden // heads:
        raise UserError(f"config.json: mrope_section {section} sums to {sum(section)}, but a head of "
                        f"{hidden // heads} dims has {hidden // heads // 2} rotary frequencies; the sections "
                        "must cover them")
    vision = dict(d.get("vision_config") or {})
    if vision.get("hidden_act", "quick_gelu") != "quick_gelu":
        raise UserError(f"config.json: vision_config.hidden_act {vision['hidden_act']!r}: Qwen2-VL's tower "
                        "is implemented with quick_gelu only")
    v = Vision.of(vision)
    if v.out_size != hidden:
        raise UserError(f"config.json: vision_config.hidden_size {v.out_size} (the merger's output) differs "
                        f"from the language model's hidden_size {hidden}")
    if v.embed_dim % v.num_heads or (v.embed_dim // v.num_heads) % 4:
        raise UserError(f"config.json: vision_config embed_dim {v.embed_dim} / num_heads {v.num_heads} "
                        "must be a head size divisible by 4 (half of it rotates with the row, half with the "
                        "column)")
    fields = dict(vision=vision, image_token_id=flat.pop("image_token_id", IMAGE_TOKEN_ID),
                  vision_start_token_id=flat.pop("vision_start_token_id", VISION_START_TOKEN_ID),
                  mrope_section=section)
    return flat, fields


def nest_config(flat: dict, cfg: ModelConfig) -> dict:
    """ModelConfig.to_hf's flat dict of a Qwen2-VL -> transformers 5's layout, the one
    transformers 5.19 writes and vLLM 0.32 loads (through transformers' Qwen2VLConfig)."""
    text = dict(flat)
    top = {k: text.pop(k) for k in TOP_KEYS if k in text}
    text.pop("rope_scaling", None)  # transformers reads rope_scaling before rope_parameters: one place only
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                               "mrope_section": list(cfg.mrope_section)}
    text["model_type"] = "qwen2_vl_text"
    # the dtype a save wrote into a sub-config would outlive the next save in another dtype: save_model
    # writes the model's dtype at the top level only
    vision = {k: v for k, v in cfg.vision.items() if k not in ("dtype", "torch_dtype")}
    top.update(architectures=[ARCH], model_type="qwen2_vl", text_config=text, vision_config=vision,
               image_token_id=cfg.image_token_id, vision_start_token_id=cfg.vision_start_token_id,
               tie_word_embeddings=cfg.tie_word_embeddings)
    return top


def read_json(file: str):
    """A JSON file's content, or a UserError naming the file and the place it breaks."""
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"{file} is not valid JSON: {e.msg} at line {e.lineno}, "
                            f"column {e.colno}") from None


LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
