"""The native engine's math: a decoder for generation over `models.decoder`'s weights, and a
seeded sampler.

`FusedDecoder` runs a `Transformer`'s weights with q/k/v and gate/up fused (prefill) and a
one-token step with fewer ops (decode); `sample_tokens` draws by inverse CDF with one
uniform per (prompt seed, sample, position) from a counter-based hash (`uniforms`), so a
sample depends on its prompt's seed only, never on the batch it was put in or on the rank.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.decoder import KVCache
from models.qwen2_vl import mrope_freqs


@dataclass
class SamplingParams:
    n: int = 1
    """completions per prompt"""
    temperature: float = 1.0
    """0 = greedy"""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off"""
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    """stop strings (the completion ends at the token that completes one)"""


M32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (the 0x45d9f3b finaliser), on int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & M32
    return (x >> 16) ^ x


def uniforms(row_keys, t):
    """One uniform in (0, 1) per row and decode position: row_keys int64 and positions t (an int
    or an int64 tensor) broadcast together, e.g. [N] and 3 -> [N], or [N, 1] and [1, T] -> [N, T] fp64."""
    h = _mix32(_mix32(row_keys) ^ _mix32(torch.as_tensor(t + 0x9E3779B9 & M32, device=row_keys.device)))
    return (h.double() + 0.5) / 2.0 ** 32


def row_keys(seeds: list[int], n: int, device):
    """The keys of n samples per prompt seed, prompt-major -> [N]: sample j of a prompt draws
    `uniforms(key, t)` at decode position t, in whatever batch or row it is generated."""
    keys = torch.tensor([s * 7919 + j for s in seeds for j in range(n)], dtype=torch.long,
                        device=device)  # [N]
    return _mix32(keys & M32)


def sample_uniforms(seeds: list[int], n: int, T: int, device):
    """The uniforms of n samples per prompt seed, prompt-major, for decode positions 0..T-1 -> [N, T]."""
    return uniforms(row_keys(seeds, n, device)[:, None], torch.arange(T, device=device)[None])  # [N, T]


TOP_P_FIRST = 1024


def sample_tokens(logits, params: SamplingParams, u):
    """logits [N, V] fp32, u [N] -> (tokens [N], logprobs [N] of those tokens under
    softmax(logits / temperature), before top-k/top-p filtering, as vLLM reports them)."""
    if params.temperature == 0:
        tok = logits.argmax(-1)  # [N]
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    logp = torch.log_softmax(logits / params.temperature if params.temperature != 1 else logits, -1)  # [N, V]
    probs = logp.exp()
    order = None
    if params.top_k > 0 or params.top_p < 1.0:
        # the candidates, most likely first: top-k's k, or for top-p alone the first TOP_P_FIRST,
        # and the whole vocabulary sorted only for rows where their mass falls short of top_p
        # (flat rows). Sorting 152K tokens for 64 rows took 0.6 s a step on 2 cores.
        V = probs.shape[-1]
        k = min(V, params.top_k or TOP_P_FIRST)
        cand, order = probs.topk(k, -1)  # [N, k] descending
        short = cand.cumsum(-1)[:, -1] < params.top_p if not params.top_k and k < V else None  # [N]
        if short is not None and bool(short.all()):
            cand, order = probs.sort(-1, descending=True)  # [N, V]
        elif short is not None and bool(short.any()):
            cand, order = F.pad(cand, (0, V - k)), F.pad(order, (0, V - k))  # [N, V], probability 0 past k
            cand[short], order[short] = probs[short].sort(-1, descending=True)
        probs = cand
        if params.top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p
            before = probs.cumsum(-1) - probs
            probs = probs.masked_fill(before >= params.top_p, 0)
    idx = inverse_cdf(probs, u)  # [N, 1]
    tok = (order.gather(-1, idx) if order is not None else idx)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def inverse_cdf(probs, u):
    """probs [N, V] >= 0, u [N] in (0, 1) -> [N, 1]: the first index whose running sum reaches
    u * the row's total, i.e. a draw from probs. In two levels: block sums of ~sqrt(V) entries
    in fp32, their running sum in float64, then a float64 running sum inside the chosen block.
    A float64 cumsum over the whole row gives the same index except within ~1e-7 (relative) of a
    boundary, and took 68 ms a step for 64 rows x 152K on 2 cores (the cast to float64 is slow),
    against 19 ms here."""
    N, V = probs.shape
    if V <= 4096:  # small vocabularies: one float64 cumsum costs less than the two levels' extra ops
        cdf = probs.cumsum(-1, dtype=torch.float64)  # [N, V]
        return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=V - 1)
    b = math.isqrt(V - 1) + 1  # block size
    nb = -(-V // b)
    blocks = (F.pad(probs, (0, nb * b - V)) if nb * b > V else probs).view(N, nb, b)  # [N, nb, b]
    mass = blocks.sum(-1).double()  # [N, nb]
    cdf = mass.cumsum(-1)  # [N, nb]
    target = (u * cdf[:, -1])[:, None]  # [N, 1]
    j = torch.searchsorted(cdf, target).clamp(max=nb - 1)  # [N, 1], first block reaching target
    rest = target - (cdf - mass).gather(-1, j)  # [N, 1], > 0: what is left to reach inside block j
    inner = blocks.gather(1, j[:, :, None].expand(N, 1, b))[:, 0].cumsum(-1, dtype=torch.float64)  # [N, b]
    # the block's float64 sum may differ from its fp32 `mass`: never step past its last nonzero entry
    i = torch.searchsorted(inner, torch.minimum(rest, inner[:, -1:])).clamp(max=b - 1)  # [N, 1]
    return j * b + i


class FusedDecoder:
    """Inference copy of a `Transformer` with q/k/v and gate/up fused into one matmul each
    (gpt-fast's trick: at small batch the step is bound by per-op overhead, so fewer and
    larger matmuls win). Same math as `Transformer.forward`; tested against transformers.
    The model's q/k/v and gate/up parameters become views of the fused tensors, so loading
    new weights into the model updates the decoder in place (no second copy per update).
    tp_group (--gen-tp, engines/tp.py): the model holds this rank's part of each block, and the
    partial sums of o_proj and down_proj are all-reduced over the group (Megatron's row-parallel
    linear) before they join the residual."""

    def __init__(self, model, tp_group=None):
        self.cfg, self.inv_freq, self.tp_group = model.config, model.inv_freq, tp_group
        self.embed, self.norm, self.lm_head = (model.model.embed_tokens.weight, model.model.norm,
                                               model.lm_head.weight)
        self.layers, self.parts = [], []  # parts: per layer, (module prefix, rows) of each weight's pieces
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            pre = lambda name: f"model.layers.{i}.{name}"  # noqa: E731
            mlp = () if layer.sparse else (("gate_proj", "up_proj"), ("down_proj",))
            self.parts.append([[(pre(f"self_attn.{n}"), getattr(a, n).out_features) for n in names]
                               for names in (("q_proj", "k_proj", "v_proj"), ("o_proj",))]
                              + [[(pre(f"mlp.{n}"), getattr(m, n).out_features) for n in names]
                                 for names in mlp])
            qkv_b = (_fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None
                     else None)
            qk_norm = (a.q_norm, a.k_norm) if a.qk_norm else None  # Qwen3: RMSNorm of each head's q and k
            # a MoE model's sparse block (models/moe.py) runs as the module itself, in the place of the
            # fused gate/up weight, with no down weight (None)
            wgu, wd = (m, None) if layer.sparse else (_fuse([m.gate_proj.weight, m.up_proj.weight]),
                                                      m.down_proj.weight)
            self.layers.append((
                layer.input_layernorm, _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b,
                a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm, wgu, wd, qk_norm))
        self.call_layers = self.layers  # what `__call__` runs (`prepare` merges LoRA adapters in)

    def __call__(self, tokens, positions, mask, cache: KVCache, embeds=None):
        """tokens, positions [B, S] (M-RoPE: [3, B, S]); mask bool [B, 1, S, L]; embeds [B, S, h]
        instead of the tokens' (a prompt's image features spliced in); returns last-position logits [B, V]."""
        c = self.cfg
        B, S = tokens.shape
        H, KV, D, I = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
        cos, sin = self.rope(positions)  # [B, S, 1, D]
        bias = torch.zeros(mask.shape, dtype=cos.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        h = F.embedding(tokens, self.embed) if embeds is None else embeds  # [B, S, h]
        for i, (ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd, qk_norm) in enumerate(self.call_layers):
            qkv = F.linear(ln1(h), wqkv, bqkv).view(B, S, H + 2 * KV, D)  # [B, S, H+2KV, D]
            qk = qkv[:, :, :H + KV]
            if qk_norm is not None:
                qk = torch.cat((qk_norm[0](qk[:, :, :H]), qk_norm[1](qk[:, :, H:])), 2)  # [B, S, H+KV, D]
            qk = qk * cos + qk.roll(D // 2, -1) * sin  # RoPE on q and k
            q = qk[:, :, :H].transpose(1, 2)  # [B, H, S, D]
            k, v = cache.update(i, qk[:, :, H:].transpose(1, 2),
                                qkv[:, :, H + KV:].transpose(1, 2))  # [B, KV, L, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=KV != H)  # [B, H, S, D]
            o = o.transpose(1, 2).reshape(B, S, H * D)
            h = h + (F.linear(o, wo, bo) if self.tp_group is None else self._summed(F.linear(o, wo), bo))
            if wd is None:  # a sparse block
                h = h + wgu(ln2(h))
                continue
            gate, up = F.linear(ln2(h), wgu).split(I, -1)  # [B, S, I] each
            h = h + (F.linear(F.silu(gate) * up, wd) if self.tp_group is None
                     else self._summed(F.linear(F.silu(gate) * up, wd)))
        cache.pos += S
        return F.linear(self.norm(h[:, -1]), self.lm_head).float()  # [B, V]

    def _summed(self, partial, bias=None):
        """--gen-tp: a row-parallel projection's partial sums [..., h] added over the group, then
        its bias (whole on every rank: engines/tp.py `part`)."""
        torch.distributed.all_reduce(partial, group=self.tp_group)
        return partial if bias is None else partial + bias

    def rope(self, positions):
        """positions [...] -> cos, sin [..., 1, D] in the weights' dtype, the first half of sin
        negated: RoPE is then x * cos + x.roll(D // 2, -1) * sin, as HF's rotate_half (x1, x2) ->
        (-x2, x1) but one op (a roll) instead of two slices, a negation and a cat. M-RoPE's
        positions [3, B, S] (a Qwen2-VL prompt) -> [B, S, 1, D]; decoding after it is 1-D."""
        if positions.dim() == 3:

            freqs = mrope_freqs(positions, self.inv_freq, self.cfg.mrope_section)  # [B, S, D/2]
        else:
            freqs = positions[..., None].float() * self.inv_freq  # [..., D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat((cos, cos), -1)[..., None, :].to(self.embed.dtype),  # [..., 1, D]
                torch.cat((-sin, sin), -1)[..., None, :].to(self.embed.dtype))

    def prepare(self, rows: int, lora: dict | None = None):
        """Build the decode step's weights; call after every weight load. On CPU in fp32 they are
        oneDNN-packed copies for `rows`-row matmuls, each RMSNorm weight folded into the matmul
        after it: one more copy of the weights, for 10-25% faster decode than MKL's sgemm at
        64 rows on the 2-core CI machines. Elsewhere they are the model's own tensors.
        lora {module prefix: (A, B, scale)}: the model holds the base; every call uses the adapted
        weights W + scale B A, merged here (one more copy of them, dropped by `release`)."""
        self.call_layers = self.layers
        if lora:
            self.call_layers = [(ln1, _merged(wqkv, qkv, lora), bqkv, _merged(wo, o, lora), bo, ln2,
                                 _merged(wgu, gu, lora), _merged(wd, d, lora), qkn)
                                for (ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd, qkn), (qkv, o, gu, d)
                                in zip(self.layers, self.parts)]
        pack = (self.embed.device.type == "cpu" and self.embed.dtype == torch.float32
                and torch.backends.mkldnn.is_available())
        if not pack:
            self.step_layers, self.step_head = list(self.call_layers), (self.norm, self.lm_head)
            return

        def packed(w, norm=None):
            return torch.ops.mkldnn._reorder_linear_weight(w if norm is None else w * norm.weight, rows)

        self.step_layers = [(None, packed(wqkv, ln1), bqkv, packed(wo), bo, None, packed(wgu, ln2),
                             packed(wd), qkn) if wd is not None else  # a sparse block keeps its module
                            (None, packed(wqkv, ln1), bqkv, packed(wo), bo, ln2, wgu, wd, qkn)
                            for ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd, qkn in self.call_layers]
        self.step_head = (None, packed(self.lm_head, self.norm))

    def release(self):
        """Drop what `prepare` built (the model's own weights stay)."""
        self.call_layers = self.step_layers = self.step_head = None

    def decode(self, tokens, positions, bias, cache: KVCache):
        """One new token per row, the hot loop of generation: tokens, positions [B]; bias [B, 1, L]
        additive (0 or -inf) over the cache's first L = cache.pos + 1 slots (with `cache.slot`: over
        the whole cache). Returns logits [B, V]. Same math as `__call__` with fewer ops: residual
        adds fused into the matmuls and, in fp32, grouped-query attention as two batched matmuls
        over [B*KV] (no SDPA dispatch). Uses the weights of the last `prepare`."""
        c = self.cfg
        B, L = tokens.shape[0], bias.shape[-1]
        H, KV, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        G = H // KV
        cos, sin = self.rope(positions)  # [B, 1, D]
        mask = bias[:, None]  # [B, 1, 1, L] for SDPA
        bias = bias.expand(B, KV, L).reshape(B * KV, 1, L)  # [B*KV, 1, L]
        h = F.embedding(tokens, self.embed)  # [B, h]
        for i, (ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd, qk_norm) in enumerate(self.step_layers):
            qkv = _linear(_rms(h, ln1, eps), wqkv, bqkv).view(B, H + 2 * KV, D)  # [B, H+2KV, D]
            qk = qkv[:, :H + KV]
            if qk_norm is not None:
                qk = torch.cat((qk_norm[0](qk[:, :H]), qk_norm[1](qk[:, H:])), 1)  # [B, H+KV, D]
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)  # RoPE
            k, v = cache.update(i, qk[:, H:, None], qkv[:, H + KV:, None])  # [B, KV, L, D]
            if h.dtype == torch.float32:  # two batched matmuls over [B*KV]: at one query, fewer ops than SDPA
                s = torch.baddbmm(bias, qk[:, :H].reshape(B * KV, G, D),
                                  k.reshape(B * KV, L, D).transpose(1, 2), alpha=D ** -0.5)  # [B*KV, G, L]
                o = torch.bmm(s.softmax(-1), v.reshape(B * KV, L, D)).view(B, H * D)  # [B, H*D]
            else:  # bf16 (GPU): SDPA keeps the scores in fp32, as the trainer's attention does
                o = F.scaled_dot_product_attention(qk[:, :H, None], k, v, attn_mask=mask,
                                                   enable_gqa=KV != H).view(B, H * D)  # [B, H*D]
            if wd is None:  # a sparse block (never under --gen-tp)
                h = _linear(o, wo, bo, add=h)
                h = h + wgu(_rms(h, ln2, eps))
            elif self.tp_group is None:
                h = _linear(o, wo, bo, add=h)
                h = _linear(_swiglu(_rms(h, ln2, eps), wgu), wd, add=h)
            else:
                h = h + self._summed(_linear(o, wo), bo)
                h = h + self._summed(_linear(_swiglu(_rms(h, ln2, eps), wgu), wd))
        cache.pos += 1
        norm, head = self.step_head
        return _linear(_rms(h, norm, eps), head).float()  # [B, V]


def _rms(x, norm, eps: float):
    """RMSNorm; `norm` is None where its weight was folded into the next matmul's."""
    return norm(x) if norm is not None else F.rms_norm(x, x.shape[-1:], None, eps)


def _linear(x, w, b=None, add=None):
    """x @ w.T + b (+ add), for a plain or a oneDNN-packed w (where the add is fused into the GEMM)."""
    if w.is_mkldnn:
        if add is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, add, w, b, "add")
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
    if add is None:
        return F.linear(x, w, b)
    return torch.addmm(add, x, w.t()) if b is None else add + F.linear(x, w, b)


def _swiglu(x, wgu):
    """silu(x @ gate.T) * (x @ up.T), wgu the fused [2I, h] gate/up weight (plain or packed). One
    GEMM of 2I columns then silu and the product beat two GEMMs with oneDNN's fused silu and
    product (~375 vs ~410 us at 64 x 256 x 2*512: the fused silu is slow on AVX2)."""
    gate, up = _linear(x, wgu).chunk(2, -1)  # [B, I] each
    return F.silu(gate) * up


def _merged(w, parts, lora: dict):
    """LoRA: w [sum of rows, in], the fused base weight of `parts` ((module prefix, rows), in w's
    row order), with scale B A added to each adapted part in fp32 and rounded once to w's dtype (as
    models.lora.merged); w itself when no part is adapted."""
    if not any(prefix in lora for prefix, _ in parts):
        return w
    out = []
    for (prefix, _), piece in zip(parts, w.split([rows for _, rows in parts])):
        if prefix in lora:
            a, b, scale = lora[prefix]
            piece = (piece.float() + scale * (b.float() @ a.float())).to(w.dtype)
        out.append(piece)
    return torch.cat(out)


def _fuse(params):
    """One tensor holding `params` stacked along dim 0; each parameter becomes a view of it."""
    fused = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = fused[start:start + p.shape[0]]
        start += p.shape[0]
    return fused


class KeptPrefixes:
    """A `generate`'s KV cache, kept for the next request (NativeEngine.keep_prefixes: multi-turn
    episodes, engines/episodes.py). A prompt that extends a kept row's tokens takes that row's keys
    and values for them, and only the rest is prefilled: an episode's next turn prefills the
    model's last token and the environment's reply, not the whole history again (vLLM's prefix
    caching does the same by blocks). Sample r's keys and values are row `where[r]` of the cache
    (k, v) it was in when it finished (the batch sheds finished rows), prompt r // n right-aligned
    to column P, its completion from column P; its last sampled token was never fed: no keys."""

    def __init__(self, where: list, prompts: list[list[int]], n: int, tokens: list, lengths: list):
        P = max(map(len, prompts))
        self.rows = {}  # the token ids a sample has keys for -> ((k, v, row), its first column)
        for r, (row, length) in enumerate(zip(tokens, lengths)):
            p = prompts[r // n]
            self.rows[tuple(p) + tuple(row[:length - 1])] = (where[r], P - len(p))
        self.lengths = sorted({len(ids) for ids in self.rows}, reverse=True)

    def fill(self, prompts: list[list[int]], cache: KVCache) -> int:
        """Writes into `cache` (the new request's prompt cache, prompts right-aligned to its width P)
        the kept keys and values of each prompt's longest kept prefix, short of its last token (its
        logits are needed); sets cache.pos and returns S: the last S columns are left to prefill."""
        P = cache.k.shape[3]
        found = []  # per prompt: (kept tokens, ((k, v, row), first column) or None)
        for p in prompts:
            ids = tuple(p)
            found.append(next(((n, self.rows[ids[:n]]) for n in self.lengths if n < len(p) and
                               ids[:n] in self.rows), (0, None)))
        S = max(len(p) - n for p, (n, _) in zip(prompts, found))
        cache.k[..., :P - S, :].zero_()  # the padding's slots: masked, but 0 * NaN would be NaN
        cache.v[..., :P - S, :].zero_()
        for i, (p, (_, at)) in enumerate(zip(prompts, found)):
            take = len(p) - S  # > 0: this prompt's tokens in the columns before the prefilled ones
            if take > 0:
                (k, v, r), c = at
                for new, old in ((cache.k, k), (cache.v, v)):  # [layers, B, KV, L, D]
                    new[:, i, :, P - len(p):P - S] = old[:, r, :, c:c + take]
        cache.pos = P - S
        return S


class GraphedStep:
    """`FusedDecoder.decode` replayed as one CUDA graph per token (on a GPU, without --gen-tp).
    At batch 64 a decode step's matmuls are small and the GPU waits on the CPU's ~15 kernel
    launches per layer; a graph launches them all at once (gpt-fast compiles its step with CUDA
    graphs for this reason). Captured once per `generate` over that call's cache, mask and
    weights: the step writes its token at `cache.slot` and attends over the whole cache, the
    slots not yet written masked by `bias` (-inf), so its shapes and addresses never change.
    On an H200 (bench/decode_compiled.py, bf16, batch 64) a replayed step took 0.047 s for 63
    tokens against the eager step's 0.423 s at 19M parameters, 0.321 against 1.194 at 174M."""

    def __init__(self, decoder: FusedDecoder, cache: KVCache, bias):
        """cache: filled up to cache.pos (its later slots are zeroed here: a masked slot must not
        hold NaN, 0 * NaN is NaN); bias [B, 1, max_len] additive, -inf past the filled slots."""
        B, dev = bias.shape[0], bias.device
        cache.k[..., cache.pos:, :].zero_()
        cache.v[..., cache.pos:, :].zero_()
        self.tokens = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        cache.slot = torch.full((1,), cache.pos, dtype=torch.long, device=dev)
        self.decoder, self.bias, self.graph = decoder, bias, None
        if dev.type != "cuda":  # (tests on a CPU: the same static step, run eagerly)
            return
        side = torch.cuda.Stream()  # warm up off the capturing stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (it writes slot cache.pos, which the first step rewrites)
            decoder.decode(self.tokens, self.positions, bias, cache)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decoder.decode(self.tokens, self.positions, bias, cache)  # [B, V], reused
        cache.pos -= 2  # the two calls above only counted

    def __call__(self, tokens, positions, bias, cache: KVCache):
        """As `FusedDecoder.decode`, but `bias` is not read: the graph reads the tensor it was
        captured with, which the caller updates in place. The logits are overwritten by the next call."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        if self.graph is None:
            self.logits = self.decoder.decode(self.tokens, self.positions, self.bias, cache)
        else:
            self.graph.replay()
            cache.pos += 1
        cache.slot += 1
        return self.logits
