"""`Pool`: continuous generation over a `NativeEngine`'s decoder (--stream, roles/stream.py).

A batch (`NativeEngine.generate`) waits for its longest sample: with completions whose lengths differ
by 10x, most of its rows sit finished while a few run on. The pool keeps a fixed number of rows,
each a sample at its own length: it admits a prompt's n samples as soon as n rows are free and
retires each sample when it ends (continuous batching, as vLLM's scheduler does). Each row writes
its keys and values at its own column of the cache (`RowCache`), so rows of any lengths decode
together in one step.

Every token keeps the policy version that sampled it and its log-prob under that version. The
weights may change between two steps (an in-flight update; `refresh`): the live rows' keys and
values are then recomputed under the new weights, so that from there on their tokens are exactly
the new version's (PipelineRL keeps the stale cache instead: cheaper, but the next tokens then come
from neither version), or, with `drop`, the live rows start over under the new weights.

A sample draws the same uniforms as in a batch (`engines.decode.row_keys`: by its prompt's seed,
its index j and its position), so at fixed weights the pool gives a batch's tokens (tests/test_stream.py).
"""
from dataclasses import dataclass

import torch

from engines.base import Samples
from engines.decode import SamplingParams, row_keys, sample_tokens, uniforms
from engines.native import NativeEngine, _cut, _left_padded
from models.decoder import KVCache, attention_mask, positions_from


@dataclass
class Request:
    """One prompt's n samples. `key` orders admission and names the group to whoever asked."""
    key: tuple
    prompt: list[int]
    seed: int


class RowCache(KVCache):
    """A decode step writes each of its B rows' new keys and values at that row's own column `cols`
    [B]; attention reads the first `width` columns of every row (the longest row's), where the
    decode bias masks what a row has not written. The first B rows of the cache take part."""

    def update(self, layer: int, k, v):
        B = k.shape[0]
        rows = torch.arange(B, device=k.device)
        self.k[layer][rows, :, self.cols] = k[:, :, 0]  # k, v [B, KV, 1, D]
        self.v[layer][rows, :, self.cols] = v[:, :, 0]
        # [B, KV, width, D]: a view (rows and heads still merge into one batch dimension)
        return self.k[layer, :B, :, :self.width], self.v[layer, :B, :, :self.width]


class Pool:
    """`rows` live samples of `params` (its n per request) on `engine`'s decoder, in a cache of
    `context` columns (the longest prompt plus params.max_new_tokens). `admit` requests while
    `free` rows last, `step` decodes one token for every live row and returns the requests whose
    n samples have all ended, `refresh` after the engine's weights change."""

    def __init__(self, engine: NativeEngine, params: SamplingParams, rows: int, context: int):
        self.engine, self.params, self.R, self.L = engine, params, rows, context
        cfg, dev = engine.cfg, engine.device
        self.T = params.max_new_tokens
        self.cache = RowCache(cfg, rows, context, dev, engine.dtype)
        self.cache.k.zero_()  # an empty row reads column 0: finite, never NaN
        self.cache.v.zero_()
        self.cache.cols = torch.zeros(rows, dtype=torch.long, device=dev)  # where each row writes next
        self.bias = torch.full((rows, 1, context), float("-inf"), dtype=engine.dtype, device=dev)  # [R, 1, L]
        self.bias[:, 0, 0] = 0
        self.logits = torch.zeros(rows, cfg.vocab_size, device=dev)  # [R, V] each live row's next token's
        self.keys = torch.zeros(rows, dtype=torch.long, device=dev)  # [R] its sample's uniform key
        self.t = torch.zeros(rows, dtype=torch.long, device=dev)  # [R] its tokens so far
        self.tokens = torch.zeros(rows, self.T, dtype=torch.long, device=dev)  # [R, T]
        self.logprobs = torch.zeros(rows, self.T, device=dev)  # [R, T] under the version that sampled
        self.versions = torch.zeros(rows, self.T, dtype=torch.long, device=dev)  # [R, T]
        self.slot = [None] * rows  # per row: (Request, j) or None (free)
        self.ended = {}  # request key -> {j: (tokens, logprobs, versions, reason)} of its ended samples
        self.requests = {}  # request key -> Request, while any of its samples is live

    @property
    def free(self) -> int:
        return self.slot.count(None)

    @property
    def live(self) -> int:
        return self.R - self.free

    def admit(self, requests: list[Request]):
        """Each request's prompt prefilled once (all of them in one batch), its keys and values
        copied to n free rows. Needs n free rows per request."""
        n = self.params.n
        assert len(requests) * n <= self.free, "admit only what the free rows hold"
        if not requests:
            return
        free = [s for s, r in enumerate(self.slot) if r is None]
        rows = []
        for i, req in enumerate(requests):
            self.requests[req.key] = req
            self.ended[req.key] = {}
            for j in range(n):
                s = free[i * n + j]
                self.slot[s] = (req, j)
                rows.append(s)
        keys = row_keys([r.seed for r in requests], n, self.engine.device)  # [k * n]
        self._start(rows, [r.prompt for r in requests for _ in range(n)], keys, restart=True)

    def _start(self, rows: list[int], contexts: list[list[int]], keys, restart: bool):
        """Prefill `contexts` (one per row: a prompt, or a prompt and the row's tokens so far) into
        those rows of the cache; restart: the rows' samples begin afresh (keys [rows] their
        uniform keys). Duplicate contexts (a request's n rows) are prefilled once."""
        dev = self.engine.device
        self._prepare()
        unique = {}
        for c in contexts:
            unique.setdefault(tuple(c), len(unique))
        firsts = [list(c) for c in unique]
        tokens, valid = _left_padded(firsts, self.engine.tok.pad_id, dev)  # [B, P] each
        B, P = tokens.shape
        cache = KVCache(self.engine.cfg, B, P, dev, self.engine.dtype)
        logits = self.engine.decoder(tokens, positions_from(valid), attention_mask(valid), cache)  # [B, V]
        index = torch.tensor(rows, device=dev)
        which = torch.tensor([unique[tuple(c)] for c in contexts], device=dev)  # [rows]: its prefill row
        for r, w, c in zip(rows, which.tolist(), contexts):
            n = len(c)
            self.cache.k[:, r, :, :n] = cache.k[:, w, :, P - n:]  # [layers, KV, n, D]
            self.cache.v[:, r, :, :n] = cache.v[:, w, :, P - n:]
            self.bias[r, 0].fill_(float("-inf"))
            self.bias[r, 0, :n] = 0
            self.cache.cols[r] = n
        self.logits[index] = logits[which]
        if restart:
            self.keys[index] = keys
            self.t[index] = 0

    def _prepare(self):
        if self.engine.needs_prepare:  # weights loaded since: the decoder's step weights for R rows
            self.engine.decoder.prepare(rows=self.R, lora=self.engine.lora)
            self.engine.needs_prepare = False

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, Samples]]:
        """One token for every live row, sampled under the engine's current version; rows whose
        sample ends (an end-of-sequence token, a stop string, max_new_tokens) are freed. Returns
        the requests whose n samples have now all ended, with their Samples."""
        if not self.live:
            return []
        self._prepare()
        params, dev = self.params, self.engine.device
        live = torch.tensor([s is not None for s in self.slot], device=dev)
        idx = live.nonzero()[:, 0]  # [live]
        t = self.t[idx]
        tok, lp = sample_tokens(self.logits[idx], params, uniforms(self.keys[idx], t))  # [live] each
        self.tokens[idx, t], self.logprobs[idx, t] = tok, lp
        self.versions[idx, t] = self.engine.version
        self.t[idx] = t + 1
        ends = torch.isin(tok, self.engine.eos)  # [live]
        if params.stop:
            texts = self.engine.tok.decode_batch([self.tokens[r, :self.t[r]].tolist() for r in idx.tolist()])
            ends |= torch.tensor([any(s in x for s in params.stop) for x in texts], device=dev)
        cut = (t + 1 >= self.T) & ~ends  # [live] ran into max_new_tokens
        done = []
        for r, stop, length in zip(idx.tolist(), ends.tolist(), cut.tolist()):
            if stop or length:
                done += self._end(r, "stop" if stop else "length")
        self._compact()
        live = self.live  # the first `live` rows, each fed the token it just sampled
        if live:
            # the rows in a power of two (oneDNN keeps state per batch size it sees), the columns up
            # to the longest row's
            B = min(self.R, 1 << (live - 1).bit_length())
            rows = torch.arange(live, device=dev)
            fed = torch.zeros(B, dtype=torch.long, device=dev)
            fed[:live] = self.tokens[rows, self.t[rows] - 1]
            cols = torch.zeros(B, dtype=torch.long, device=dev)  # the free rows write column 0
            cols[:live] = self.cache.cols[:live]
            self.bias[rows, 0, cols[:live]] = 0  # each row sees its new token
            write, self.cache.cols, self.cache.width = self.cache.cols, cols, int(cols.max()) + 1
            logits = self.engine.decoder.decode(fed, cols, self.bias[:B, :, :self.cache.width],
                                                self.cache)  # [B, V]
            self.cache.cols = write
            self.cache.cols[:live] += 1
            self.logits[:live] = logits[:live]
        return done

    def _compact(self):
        """The last live rows move into the free rows before them, so that the live ones are the
        first (a step then runs only as many rows as are live, rounded up)."""
        live = [s for s, r in enumerate(self.slot) if r is not None]
        free = [s for s, r in enumerate(self.slot) if r is None]
        for src, dst in zip(reversed(live), free):
            if dst > src:
                break
            n = int(self.cache.cols[src])
            self.cache.k[:, dst, :, :n] = self.cache.k[:, src, :, :n]
            self.cache.v[:, dst, :, :n] = self.cache.v[:, src, :, :n]
            for x in (self.bias, self.logits, self.keys, self.t, self.tokens, self.logprobs, self.versions,
                      self.cache.cols):
                x[dst] = x[src]
            self.bias[src, 0].fill_(float("-inf"))
            self.bias[src, 0, 0] = 0
            self.slot[dst], self.slot[src] = self.slot[src], None

    def _end(self, r: int, reason: str) -> list:
        """Row r's sample ended: keep it with its request, free the row; the request and its
        Samples once all n have ended."""
        req, j = self.slot[r]
        length = int(self.t[r])
        # copies: the row is reused (on a CPU, .cpu() would be a view of it)
        self.ended[req.key][j] = (self.tokens[r, :length].clone().cpu(),
                                  self.logprobs[r, :length].float().clone().cpu(),
                                  self.versions[r, :length].clone().cpu(), reason)
        self.slot[r] = None
        self.bias[r, 0].fill_(float("-inf"))
        self.bias[r, 0, 0] = 0
        if len(self.ended[req.key]) < self.params.n:
            return []
        del self.requests[req.key]
        return [(req, self._samples(self.ended.pop(req.key)))]

    def _samples(self, ended: dict) -> Samples:
        """A request's n ended samples (by j) as Samples, with each token's version ([n, T], -1 past
        a sample's end)."""
        n = self.params.n
        parts = [ended[j] for j in range(n)]
        lengths = torch.tensor([len(p[0]) for p in parts])
        T = max(1, int(lengths.max()))
        tokens = torch.zeros(n, T, dtype=torch.long)
        logprobs = torch.zeros(n, T)
        versions = torch.full((n, T), -1, dtype=torch.long)
        for j, (tok, lp, ver, _) in enumerate(parts):
            tokens[j, :len(tok)], logprobs[j, :len(tok)], versions[j, :len(tok)] = tok, lp, ver
        texts = self.engine.tok.decode_batch([p[0].tolist() for p in parts])
        if self.params.stop:
            texts = [_cut(x, self.params.stop) for x in texts]
        sampled = versions[versions >= 0]
        version = int(sampled.min()) if len(sampled) else self.engine.version
        return Samples(tokens, logprobs, lengths, [p[3] for p in parts], texts, version,
                       token_versions=versions)

    def update(self, load, drop: bool = False):
        """New weights between two steps: `load()` puts them into the engine (and its version), then
        `refresh`."""
        load()
        self.refresh(drop)

    def refresh(self, drop: bool = False):
        """After the engine's weights changed (its version with them): every live row's keys and
        values recomputed under the new weights from its prompt and its tokens so far (they keep the
        versions and log-probs they were sampled with); drop: the live rows start over instead."""
        rows = [s for s, r in enumerate(self.slot) if r is not None]
        if not rows:
            return
        contexts = []
        for r in rows:
            req, _ = self.slot[r]
            contexts.append(req.prompt if drop else req.prompt + self.tokens[r, :self.t[r]].tolist())
        self._start(rows, contexts, None, restart=False)
        if drop:
            self.t[torch.tensor(rows, device=self.engine.device)] = 0

    def state(self) -> dict:
        """What a checkpoint keeps of the pool (on the CPU): each row's request and sample so far,
        and the ended samples of requests still live; `load` then `refresh` rebuild the cache."""
        rows = []
        for r, held in enumerate(self.slot):
            if held is not None:
                t = int(self.t[r])
                rows.append((r, held[0], held[1], int(self.keys[r]), self.tokens[r, :t].clone().cpu(),
                             self.logprobs[r, :t].clone().cpu(), self.versions[r, :t].clone().cpu()))
        return {"rows": rows, "ended": self.ended, "requests": self.requests}

    def load(self, state: dict):
        """The pool as `state` saw it (rows in the same places); call `refresh` once weights are in."""
        dev = self.engine.device
        self.ended, self.requests = state["ended"], state["requests"]
        for r, req, j, key, tok, lp, ver in state["rows"]:
            t = len(tok)
            self.slot[r] = (req, j)
            self.keys[r], self.t[r] = key, t
            self.tokens[r, :t], self.logprobs[r, :t] = tok.to(dev), lp.to(dev)
            self.versions[r, :t] = ver.to(dev)
