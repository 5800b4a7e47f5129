"""`NativeEngine`: a plain batched sampler over our decoder (its math in `engines/decode.py`) with a
preallocated KV cache: the prompt is encoded once (per prompt, not per sample: its cache is copied
to the n samples), then one token per step. A sample depends on its prompt's seed only.
`python -m engines.native --model DIR` samples a few completions of the built-in task's eval split.
"""

import torch

from engines.base import Engine, Samples
from engines.decode import (FusedDecoder, GraphedStep, KeptPrefixes, SamplingParams, sample_tokens,
                            sample_uniforms)
from models.config import ModelConfig
from models.decoder import KVCache, attention_mask, positions_from
from models.hf import build, load_state, read_config
from models.moe import Recorder
from models.qwen2_vl import prompt_inputs


class NativeEngine(Engine):
    takes_adapters = True  # LoRA: after one load of the base, adapters alone (`load_adapters`)
    has_base = False  # set by placement.sync once the base is loaded
    graphs = ("cuda",)  # on these devices (without --gen-tp) a decode step replays one CUDA graph
    # (engines/decode.py GraphedStep; the tests add "cpu", where the same static step runs eagerly)

    def __init__(self, cfg: ModelConfig, tokenizer, device="cpu", dtype=torch.float32, tp_group=None,
                 routes: bool = False):
        """tp_group (--gen-tp): cfg is this rank's part of the model (engines/tp.py), the group its own.
        routes (--routing-replay, a MoE model): each sample carries the experts its tokens went to."""
        self.cfg, self.tok, self.device, self.dtype = cfg, tokenizer, torch.device(device), dtype
        self.tp_group, self.routes = tp_group, routes
        self.model = self.decoder = self.lora = self.kept = None
        self.needs_prepare = True  # weights loaded since the decoder's last `prepare`
        self.eos = torch.tensor(sorted(tokenizer.eos_ids) or [-1], device=self.device)

    def load_weights(self, weights):
        """Replace the weights from (hf_name, tensor) pairs (a full set; with LoRA, the base)."""
        if self.model is None:
            self.model = build(self.cfg, self.device, self.dtype).eval().requires_grad_(False)
            self.decoder = FusedDecoder(self.model, self.tp_group)  # shares the model's storage
        self.needs_prepare = True  # first: a load that fails halfway must not leave old packed weights in use
        self.lora = self.kept = None  # (a kept KV cache is of the old weights)
        load_state(self.model, weights)

    def load_adapters(self, adapters, scales: dict):
        """LoRA: after a load of the *base* weights, take only the adapters, (name, tensor) pairs of
        lora_A and lora_B; generation uses W + scale B A (merged in fp32 by the decoder's `prepare`).
        The model keeps the base: it is loaded once, and kept by `release`."""
        held = {}
        for name, t in adapters:
            prefix, _, leaf = name.rpartition(".")
            held.setdefault(prefix, {})[leaf] = t.to(self.device, copy=True)
        self.lora = {prefix: (ab["lora_A"], ab["lora_B"], scales[prefix]) for prefix, ab in held.items()}
        self.needs_prepare, self.kept = True, None

    def release(self):
        """Drop weights and a kept KV cache (`keep_prefixes`); with LoRA adapters, only the
        merged copies: the base stays for the adapters of the next sync."""
        self.kept = None
        if self.lora is not None:
            self.decoder.release()
            self.needs_prepare = True
        else:
            self.model = self.decoder = None

    def close(self):
        self.release()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> Samples:
        """params.n samples of each prompt, prompt-major, each drawn with its prompt's seed: the prompts
        left-padded, each prefilled once and its cache copied to its n samples' rows, then one token a
        step for every row until all have stopped or made max_new_tokens."""
        assert self.model is not None, "load_weights before generate"
        assert len(seeds) == len(prompts), "one seed per prompt"
        if not prompts:
            return Samples.empty(self.version)
        dev, n, T = self.device, params.n, params.max_new_tokens
        tokens, valid = _left_padded(prompts, self.tok.pad_id, dev)  # [B0, P] each
        P, N = tokens.shape[1], len(prompts) * n
        if self.needs_prepare:
            self.decoder.prepare(rows=N, lora=self.lora)
            self.needs_prepare = False
        recorder = Recorder(self.model, len(prompts), N, T) if self.routes else None
        logits, cache, next_pos = self._prefill(prompts, tokens, valid, n, T)  # [N, V], N rows, [N]
        if recorder:
            recorder.prefill(P)
        u = sample_uniforms(seeds, n, T, dev)  # [N, T]
        bias = _decode_bias(valid, n, T, self.dtype)  # [N, 1, P+T] additive attention mask
        step = self._step(cache, bias, T)
        out_tok = torch.zeros(N, T, dtype=torch.long, device=dev)
        out_lp = torch.zeros(N, T, dtype=torch.float32, device=dev)
        done = torch.zeros(N, dtype=torch.bool, device=dev)  # per sample
        lengths = torch.full((N,), T, dtype=torch.long, device=dev)
        rows = torch.arange(N, device=dev)  # the batch's rows: which samples they are
        where = [None] * N  # keep_prefixes: per sample, the cache (k, v) and row that hold its keys
        for t in range(T):
            tok, lp = self._sample(logits, params, u[rows, t])  # [rows] each
            out_tok[rows, t], out_lp[rows, t] = tok, lp
            finished = ~done[rows] & torch.isin(tok, self.eos)  # [rows]
            if params.stop:
                finished |= self._hit_stop(out_tok[rows, :t + 1], done[rows] | finished, params.stop)
            lengths[rows[finished]] = t + 1
            done[rows[finished]] = True
            going = ~done[rows]  # [rows]
            left = int(going.sum())
            if t == T - 1 or left == 0:
                break
            # half the batch is done: shed finished rows (a CUDA graph keeps its shapes)
            if 2 * left <= len(rows) and not isinstance(step, GraphedStep):
                keep = self._shed(going, rows, cache, where)  # [size] the rows that stay
                rows, tok, next_pos, bias, going = (x[keep] for x in (rows, tok, next_pos, bias, going))
            # finished rows not yet shed still run (their new slot masked)
            bias[:, 0, P + t].masked_fill_(going, 0)
            logits = step(tok, next_pos, bias[:, :, :P + t + 1], cache)  # [rows, V]
            next_pos += 1
            if recorder:
                recorder.step(rows, t, going)
        out = self._samples(out_tok, out_lp, lengths, done, params.stop)
        if recorder:
            out.routes = recorder.finish(prompts, n, out.lengths)
        if self.keep_prefixes:  # for a next request that extends these rows (an episode's next turn)
            self.kept = KeptPrefixes(_held(where, rows, cache), prompts, n, out.tokens.tolist(),
                                     out.lengths.tolist())
        return out

    def _prefill(self, prompts: list[list[int]], tokens, valid, n: int, T: int):
        """Each prompt once, then its keys and values copied to its n samples' rows. Reads the
        left-padded prompts tokens, valid [B0, P]; returns the next token's logits [N, V], a cache of
        N rows and P + T slots filled up to P, and each row's next position [N]."""
        B0, P = tokens.shape
        prompt_cache = KVCache(self.cfg, B0, P, self.device, self.dtype)
        embeds, pos, next_pos = self._prompt_inputs(prompts, tokens, valid)  # pos [B0, P] or [3, B0, P]
        S = self._fill_from_kept(prompts, prompt_cache, embeds)  # the last S columns are left to prefill
        logits = self.decoder(tokens[:, P - S:], pos[..., P - S:], attention_mask(valid, S), prompt_cache,
                              embeds)  # [B0, V]
        cache = KVCache(self.cfg, B0 * n, P + T, self.device, self.dtype)
        # k, v: [layers, N or B0, KV, L, D]
        for full, prompt in ((cache.k, prompt_cache.k), (cache.v, prompt_cache.v)):
            full.unflatten(1, (B0, n))[..., :P, :] = prompt[:, :, None]
        cache.pos = P
        if n > 1:
            logits = logits.repeat_interleave(n, 0)  # [N, V]
            next_pos = next_pos.repeat_interleave(n, 0)  # [N]
        return logits, cache, next_pos

    def _prompt_inputs(self, prompts: list[list[int]], tokens, valid):
        """What the prefill reads besides the left-padded prompts tokens, valid [B0, P]: (input
        embeddings, positions, where decoding goes on [B0]). A text model's: None (its tokens'),
        positions [B0, P] that skip the padding. Qwen2-VL's: embeddings [B0, P, h] with the image
        features at the image pads, M-RoPE positions [3, B0, P]."""
        if self.cfg.vision is None:
            pos = positions_from(valid)  # [B0, P]
            return None, pos, pos[:, -1] + 1
        return prompt_inputs(self.model, prompts, tokens, valid)  # [B0, P, h], [3, B0, P], [B0]

    def _fill_from_kept(self, prompts: list[list[int]], cache: KVCache, embeds) -> int:
        """keep_prefixes: writes into the prompts' `cache` [layers, B0, KV, P, D] the keys and values
        that the last `generate` kept (self.kept) for the rows these prompts extend, so that an
        episode's next turn prefills only its new tokens; the kept ones are used once, then dropped.
        Returns S, the last S columns left to prefill: P when none are kept or with input embeddings
        (a Qwen2-VL model's prompts are prefilled whole)."""
        S = self.kept.fill(prompts, cache) if self.kept is not None and embeds is None else cache.k.shape[3]
        self.kept = None
        return S

    def _step(self, cache: KVCache, bias, T: int):
        """The decode step for T new tokens: the decoder's eager step, or on a device in `graphs`
        (without --gen-tp, for T > 1) a `GraphedStep` captured over this `cache` and `bias`
        [N, 1, P+T], which the loop then updates in place."""
        # (a MoE model's sparse blocks pick their tokens' experts with data-dependent shapes: no graph)
        if self.device.type in self.graphs and self.tp_group is None and T > 1 and self.cfg.moe is None:
            return GraphedStep(self.decoder, cache, bias)
        return self.decoder.decode

    def _sample(self, logits, params: SamplingParams, u):
        """`sample_tokens`: logits [rows, V], uniforms u [rows] -> tokens, log-probs [rows]. --gen-tp:
        every rank takes the group's first rank's tokens, so that the ranks stay in step."""
        tok, lp = sample_tokens(logits, params, u)  # [rows] each
        if self.tp_group is not None:
            torch.distributed.broadcast(tok, group=self.tp_group, group_src=0)
        return tok, lp

    def _shed(self, going, rows, cache: KVCache, where: list):
        """Half the batch is done: its finished rows leave, down to a power of two rows (oneDNN keeps
        state per batch size it sees: ~0.5 MB per 4 MB weight). Reads going [rows] (not finished) and
        rows (which samples they are); keeps the staying rows of `cache`, in order, and returns their
        indices [size]. keep_prefixes: the leaving rows' keys stay in the old cache, for the next
        request, each sample's place noted in `where` (`_held`)."""
        left = int(going.sum())
        size = 1 << (left - 1).bit_length()
        keep = torch.cat([going.nonzero()[:, 0], (~going).nonzero()[:size - left, 0]]).sort().values  # [size]
        if self.keep_prefixes:  # the shed rows' keys stay in this cache, for the next request
            _held(where, rows, cache)
            cache.k, cache.v = cache.k[:, keep], cache.v[:, keep]  # [layers, size, KV, L, D]
        else:  # in place, no second cache: rows only move toward the front (keep is sorted)
            for j, i in enumerate(keep.tolist()):
                cache.k[:, j], cache.v[:, j] = cache.k[:, i], cache.v[:, i]
            cache.k, cache.v = cache.k[:, :size], cache.v[:, :size]  # [layers, size, KV, L, D]
        return keep

    def _samples(self, tokens, logprobs, lengths, done, stop: list[str]) -> Samples:
        """The decode loop's tokens, log-probs [N, T], lengths and done [N] (ended by an end of
        sequence or a stop string) as Samples on the CPU: cut to the longest, zeros past each row's
        length, the texts decoded with any stop string and what follows it cut off."""
        Tmax = int(lengths.max())
        keep = torch.arange(Tmax, device=lengths.device)[None] < lengths[:, None]  # [N, Tmax]
        tokens, logprobs = tokens[:, :Tmax] * keep, logprobs[:, :Tmax] * keep  # [N, Tmax] each
        texts = self.tok.decode_batch([row[:l] for row, l in zip(tokens.tolist(), lengths.tolist())])
        if stop:
            texts = [_cut(t, stop) for t in texts]
        reasons = ["stop" if f else "length" for f in done.tolist()]
        return Samples(tokens.cpu(), logprobs.float().cpu(), lengths.cpu(), reasons, texts, self.version)

    def _hit_stop(self, so_far, skip, stop):
        """Rows (not in `skip`) whose decoded completion now contains a stop string."""
        rows = (~skip).nonzero()[:, 0].tolist()
        hit = torch.zeros(so_far.shape[0], dtype=torch.bool, device=so_far.device)
        if rows:
            texts = self.tok.decode_batch(so_far[rows].tolist())
            for r, text in zip(rows, texts):
                hit[r] = any(s in text for s in stop)
        return hit


def _left_padded(prompts: list[list[int]], pad_id: int, device):
    """The prompts left-padded to the longest, so that every row's next token goes in the same
    column: tokens [B0, P] (pad_id in the padding) and valid [B0, P] (False there), on `device`."""
    B0, P = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((B0, P), pad_id, dtype=torch.long)  # [B0, P]
    valid = torch.zeros(B0, P, dtype=torch.bool)  # [B0, P]
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = torch.tensor(p)
        valid[i, P - len(p):] = True
    return tokens.to(device), valid.to(device)


def _decode_bias(valid, n: int, T: int, dtype):
    """The decode steps' additive attention mask [N, 1, P+T] over the cache, for n samples of each
    left-padded prompt (valid [B0, P]): -inf at the padding and at the T slots not written yet
    (the decode loop opens each row's new slot as it writes it), 0 elsewhere."""
    B0, P = valid.shape
    bias = torch.zeros(B0 * n, 1, P + T, dtype=dtype, device=valid.device)  # [N, 1, P+T]
    bias[:, 0, :P].masked_fill_(~valid.repeat_interleave(n, 0), float("-inf"))  # left padding
    bias[:, 0, P:] = float("-inf")  # slots not written yet (the eager step reads only written ones)
    return bias


def _held(where: list, rows, cache: KVCache) -> list:
    """where[sample] = (k, v, row): where the batch's rows keep their samples' keys and values."""
    for i, r in enumerate(rows.tolist()):
        where[r] = (cache.k, cache.v, i)
    return where


def _cut(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


if __name__ == "__main__":  # python -m engines.native --model DIR: sample a few completions of the eval split
    import argparse

    from models.hf import iter_checkpoint
    from models.tokenizer import Tokenizer
    from tasks.data import BUILTIN, load_rows

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assets/arith-tiny")
    ap.add_argument("--dataset", default=BUILTIN)
    ap.add_argument("--prompt-column", default="prompt")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args()
    tok = Tokenizer(a.model)
    engine = NativeEngine(read_config(a.model), tok)
    engine.load_weights(iter_checkpoint(a.model))
    rows = load_rows(a.dataset, "eval", a.prompt_column, None)[:4]
    prompts = [tok.encode(*tok.render(r["prompt"])) for r in rows]
    params = SamplingParams(a.n, a.temperature, max_new_tokens=a.max_new_tokens)
    out = engine.generate(prompts, params, list(range(4)))
    for i, text in enumerate(out.texts):
        print(f"{rows[i // a.n]['prompt']!r} -> {text!r} ({out.finish_reasons[i]})")
