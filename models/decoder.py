"""A Qwen2 / Qwen3 / Llama decoder in plain torch, with HF safetensors load and save. Qwen3 adds
an RMSNorm over each head's queries and keys before RoPE; Llama 3.x's RoPE scaling is
`rope_frequencies`. Qwen2-VL (Qwen2VLForConditionalGeneration) is this decoder with a vision tower
and M-RoPE, in models/qwen2_vl.py: `model_class` / `build` pick it for a config with `vision`.

The same decoder with a `score` head instead of `lm_head` is HF's `...ForSequenceClassification`
(a reward model, or with one label the critic's value model): `Transformer.forward` then
returns one score per position and label instead of logits.

Parameter names are the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`),
so a state dict goes to transformers, to vLLM's `load_weights` and back without a
rename table. The model is built on the meta device and materialised with
`to_empty` (torchtitan's pattern), so FSDP2 can shard it before any full copy exists.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.config import LLAMA3_ROPE, ModelConfig
from models.moe import SparseMoe
from models.packing import Segments


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
        if isinstance(mask, Segments):  # a packed sequence (models/packing.py): attention piece by piece
            out = mask.attend(q, k, v, self.gqa)  # [1, H, S, D]
        else:
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
        self.sparse = cfg.moe is not None and cfg.moe.sparse(index)
        self.mlp = SparseMoe(cfg.hidden_size, cfg.moe) if self.sparse else MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, routes=None):
        """routes [B, S, layers, k] (a MoE model's replayed experts, models/moe.py) or None."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, self.index)
        if not self.sparse:
            return x + self.mlp(self.post_attention_layernorm(x))
        mine = None if routes is None else routes[:, :, self.index]  # [B, S, k]
        return x + self.mlp(self.post_attention_layernorm(x), mine)


class Body(nn.Module):
    """Holds the `model.*` parameters, so that names match HF's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KVCache:
    """Preallocated keys and values for a batch: [layers, B, KV, max_len, D]; `pos` is the fill level.
    `slot` (a [1] tensor, engines/decode.py GraphedStep): one token's keys and values are written at
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
                targets=None, temperature: float = 1.0, pick=None, routes=None):
        """tokens [B, S]; positions [B, S] (default 0..S-1 after the cache); mask: bool [B, 1, S, L]
        (True = attend) or None for plain causal. Returns logits [B, S - logits_from, V] in fp32
        (a score model: scores [B, S - logits_from, num_labels]); with targets [B, T], the log-probs
        [B, T] of those tokens under softmax(logits / temperature) (`run`). pick [n, T] (a packed
        sequence, B = 1: models/packing.py): the outputs at those positions instead, [n, T, ...].
        routes [B, S, layers, k] (a MoE model, --routing-replay): each token's experts, -1 to leave a
        token to the router (models/moe.py)."""
        h = self.model.embed_tokens(tokens)  # [B, S, hidden]
        return self.run(h, positions, mask, cache, logits_from, targets, temperature, pick, routes)

    def batch_inputs(self, batch) -> dict:
        """The forward's keywords for a padded batch (tasks.data.make_batch): positions that skip
        left padding and the causal mask over it (Qwen2-VL's subclass adds its images and M-RoPE)."""
        valid = batch["valid"]
        return {"positions": positions_from(valid), "mask": attention_mask(valid)}

    def rope(self, positions, dtype):
        """positions [B, S] -> cos, sin [B, 1, S, D] in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def run(self, h, positions, mask, cache: KVCache | None, logits_from: int, targets=None,
            temperature: float = 1.0, pick=None, routes=None):
        """The decoder over input embeddings h [B, S, hidden] (forward's tokens, embedded); with
        targets [B, T] (T <= S - logits_from), their log-probs [B, T] instead of logits (head_logprobs:
        never the whole batch's logits at once); pick [n, T]: the head runs on h[0][pick] [n, T, hidden]
        instead of h[:, logits_from:]."""
        B, S, _ = h.shape
        start = cache.pos if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + S, device=h.device).expand(B, S)
        cos, sin = self.rope(positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask, cache, routes)
        if cache is not None:
            cache.pos += S
        h = self.model.norm(h[:, logits_from:] if pick is None else h[0][pick])
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


def completion_logprobs(model, batch, temperature: float, replay: bool = False):
    """log pi(token) of each completion token of a padded batch (tasks.data.make_batch) ->
    [N, T]. Logits are made for completion positions only (the prompt's are never needed), and
    never for the whole batch at once (models.decoder.head_logprobs). replay: the batch's "routes"
    (the engine's experts, --routing-replay) in the forward of the policy whose samples they are."""
    P = batch["prompt_len"]
    targets = batch["input_ids"][:, P:]  # [N, T]
    # replay: the routes [N or 1, L or S, layers, k] as the forward's keyword (a model without experts,
    # Qwen2-VL's too, is never asked: its forward takes none)
    if "packed" in batch:  # token t's logits are made at the column before it (models/packing.py)
        routes = {"routes": batch["packed"].get("routes")} if replay else {}
        return model(**packed_inputs(batch, P - 1, P - 1 + targets.shape[1]), targets=targets,
                     temperature=temperature, **routes)  # [N, T]
    routes = {"routes": batch.get("routes")} if replay else {}
    return model(batch["input_ids"], **model.batch_inputs(batch), logits_from=P - 1,
                 targets=targets, temperature=temperature, **routes)  # [N, T]


def completion_values(model, batch):
    """A value model's V(s_t) for each completion token t, the state being the prompt and the
    tokens before t (the position whose logits would sample t) -> [N, T]."""
    P, valid = batch["prompt_len"], batch["valid"]
    if "packed" in batch:
        return model(**packed_inputs(batch, P - 1, valid.shape[1] - 1))[..., 0]  # [N, T]
    out = model(batch["input_ids"], positions_from(valid), attention_mask(valid), logits_from=P - 1)
    return out[:, :-1, 0]  # [N, T]


def sequence_scores(model, batch):
    """A reward model's score of each whole sequence, read at its last non-pad token (as HF's
    ...ForSequenceClassification does) -> [N]. HF finds that token by input_ids != pad_token_id,
    so a real token equal to the pad id (an EOS that is also the pad token, as in
    assets/arith-tiny) is skipped here too: the score sits on the token before it, as in HF."""
    valid = batch["valid"]
    L = valid.shape[1]
    real = valid
    if model.config.pad_token_id is not None:
        real = valid & (batch["input_ids"] != model.config.pad_token_id)  # [N, L]
    last = (torch.arange(L, device=valid.device) * real).argmax(-1)  # [N] the rightmost non-pad token
    if "packed" in batch:
        p = batch["packed"]
        at = p["flat"].gather(1, last[:, None]).clamp(min=0)  # [N, 1] where that token sits
        return model(p["input_ids"], p["positions"], p["mask"], pick=at)[:, 0, 0]  # [N]
    out = model(batch["input_ids"], positions_from(valid), attention_mask(valid))  # [N, L, 1]
    return out[torch.arange(len(last)), last, 0]  # [N]


def packed_inputs(batch, start: int, end: int) -> dict:
    """The forward's keywords for a packed micro-batch (models/packing.py) whose outputs are wanted
    at each row's columns start..end-1 of the padded layout -> tokens, positions, mask, pick [N, end -
    start] (a padding column picks position 0: its output is masked out by the caller)."""
    p = batch["packed"]
    pick = p["flat"][:, start:end].clamp(min=0)  # [N, end - start]
    return {"tokens": p["input_ids"], "positions": p["positions"], "mask": p["mask"], "pick": pick}


def positions_from(valid):
    """Position ids that skip left padding: valid [B, L] -> [B, L]."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


# ---------------------------------------------------------------- HF checkpoint directories


def flops_per_token(cfg: ModelConfig, context: int = 0) -> float:
    """Forward FLOPs per token: 2 x matmul params (embeddings' lookup excluded, lm_head
    included) plus attention scores over `context` keys (Kaplan et al. 2020, table 1). A
    Qwen2-VL's vision tower is left out: it runs per image patch, not per token; a MoE model counts
    the experts a token runs (its active parameters) and its router."""
    n = cfg.num_params(embeddings=False, vision=False, active=True) + cfg.vocab_size * cfg.hidden_size
    return 2 * n + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context


def token_logprobs(logits, tokens, temperature: float = 1.0):
    """log softmax(logits / T) at `tokens`: logits [B, T, V], tokens [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, -1)  # [B, T, V]
    # a tensor of its own, not a view of the gather's [B, T, 1]: the model returns it from its FSDP2
    # root, and FSDP2 warns that an in-place op on a returned view would skip its pre-backward hook
    return logp.gather(-1, tokens[..., None]).squeeze(-1).clone()  # [B, T]


LOGITS_BUDGET = 2 ** 28  # bytes of fp32 logits made at once by head_logprobs (256 MiB)


def head_logprobs(h, weight, tokens, temperature: float = 1.0, budget: int | None = None):
    """token_logprobs((h @ weight.T)[:, :T], tokens, temperature) without the whole batch's logits
    at once: h [B, S, hidden] (S >= T), weight [V, hidden] (the lm_head), tokens [B, T] -> [B, T]
    fp32. Rows go in chunks whose fp32 logits fit `budget`; the backward makes each chunk's logits
    again from h and the saved log-normaliser (one more head matmul per chunk) instead of keeping
    them (Liger's fused linear cross-entropy does the same for a mean loss; here the upstream
    gradient is any [B, T]).
    A batch whose logits fit the budget is one chunk, computed as lm_head then token_logprobs are
    (the same ops, the same bits: over all S positions, as the trainer always made them; a matmul of
    other rows can round otherwise). At a 152K vocabulary, 64 rows x 256 tokens of fp32 logits are
    10 GB; here they are 256 MiB at most."""
    B, S, _ = h.shape
    T = tokens.shape[1]
    rows = max(1, (budget or LOGITS_BUDGET) // max(1, S * weight.shape[0] * 4))
    if rows >= B:
        return token_logprobs(torch.nn.functional.linear(h, weight).float()[:, :T], tokens, temperature)
    return _HeadLogprobs.apply(h[:, :T], weight, tokens, temperature, rows)


class _HeadLogprobs(torch.autograd.Function):
    """head_logprobs over row chunks: saves h, the weight and each token's log-normaliser [B, T]."""

    @staticmethod
    def forward(ctx, h, weight, tokens, temperature: float, rows: int):
        out, lse = [], []
        for i in range(0, h.shape[0], rows):
            z = torch.nn.functional.linear(h[i:i + rows], weight).float() / temperature  # [r, T, V]
            norm = torch.logsumexp(z, -1)  # [r, T]
            out.append(z.gather(-1, tokens[i:i + rows, :, None])[..., 0] - norm)
            lse.append(norm)
        ctx.save_for_backward(h, weight, tokens, torch.cat(lse))
        ctx.temperature, ctx.rows = temperature, rows
        return torch.cat(out)  # [B, T]

    @staticmethod
    def backward(ctx, grad):
        """d logp_t / d z = onehot(t) - softmax(z), z = logits / temperature; grad [B, T]."""
        h, weight, tokens, lse = ctx.saved_tensors
        grad_h, grad_w = torch.empty_like(h), torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        for i in range(0, h.shape[0], ctx.rows):
            hc, g = h[i:i + ctx.rows], grad[i:i + ctx.rows]  # [r, T, hidden], [r, T]
            z = torch.nn.functional.linear(hc, weight).float() / ctx.temperature  # [r, T, V]
            dz = torch.exp(z - lse[i:i + ctx.rows, :, None]).mul_(-g[..., None])  # [r, T, V] -softmax * g
            dz.scatter_add_(-1, tokens[i:i + ctx.rows, :, None], g[..., None])  # + onehot * g
            dz = (dz / ctx.temperature).to(h.dtype)
            grad_h[i:i + ctx.rows] = dz @ weight  # [r, T, hidden]
            grad_w += dz.flatten(0, 1).t().float() @ hc.flatten(0, 1).float()  # [V, hidden]
        return grad_h, grad_w.to(weight.dtype), None, None, None
