"""Packed micro-batches: a micro-batch's rows laid back to back in one sequence, with no padding
and each distinct prompt once, its completions attending to it.

The padded layout (tasks.data.make_batch) runs every row's prompt, and pads each row to the
longest in its micro-batch. A GRPO group's n completions share one prompt, and on a reasoning task
the prompt is most of a row (builtin:carries: 161 of ~260 tokens), so the trainer computes the same
prompt n times over and then the padding. Packed, a bin of rows is one sequence:

    [prompt a][completion a1][completion a2] ... [prompt b][completion b1] ...

and a token attends to an earlier token of the same prompt's block that is either in the prompt or
in its own completion (`Segments`). Positions count from each prompt's first real token, so every
completion token sees the same keys at the same positions as in its padded row, and its log-prob is
the padded row's up to fp32 rounding; the gradient reaches the shared prompt's activations from all
of its completions (summed, as the padded rows' would be). Prefix Grouper (Liu et al. 2025,
arXiv 2506.05433) computes the shared prefix once in the same way; the packing of rows by a token
budget is what veRL's and OpenRLHF's remove-padding modes do.

The attention (`Segments`, which models.decoder's Attention takes in place of a mask) computes each
piece's scores over exactly its keys, pieces of like size batched into one SDPA; one SDPA with the
block mask [1, 1, S, S] would compute the S^2 scores the mask hides. flex_attention would skip the
hidden blocks in one kernel; not used (docs/packing.md).
"""
import torch
import torch.nn.functional as F


def plan_bins(keys: list, prompt_lens: list[int], completion_lens: list[int], budget: int,
              rows: int | None = None) -> list[list[int]]:
    """Rows into bins of at most `budget` tokens and `rows` rows, a prompt counted once per bin for
    the rows that share its key (a row alone over the budget is a bin of its own). Rows of one key
    are taken together, keys in order of first appearance -> lists of row indices."""
    first = {}
    for r, k in enumerate(keys):
        first.setdefault(k, r)
    bins, used, held = [], 0, set()
    for r in sorted(range(len(keys)), key=lambda r: first[keys[r]]):
        cost = completion_lens[r] + (0 if keys[r] in held else prompt_lens[r])
        if not bins or used + cost > budget or len(bins[-1]) == rows:
            bins.append([])
            used, held, cost = 0, set(), completion_lens[r] + prompt_lens[r]
        bins[-1].append(r)
        used += cost
        held.add(keys[r])
    return bins


def split_to(bins: list[list[int]], count: int) -> list[list[int]]:
    """Up to `count` bins from fewer, halving the bin of most rows each time (every rank of an FSDP
    group must run as many forwards), until every bin is one row."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        i = max(range(len(bins)), key=lambda j: len(bins[j]))
        if len(bins[i]) < 2:
            break
        half = len(bins[i]) // 2
        bins[i:i + 1] = [bins[i][:half], bins[i][half:]]
    return bins


def pack(input_ids, valid, prompt_len: int, key, routes=None) -> dict:
    """One packed sequence of a padded micro-batch's rows: input_ids, valid [n, P+T] (prompts
    left-padded to P, completions right-padded), key [n] (`prompt_keys`: rows of one key hold one
    copy of their prompt). -> {"input_ids" [1, S], "positions" [1, S], "mask": its `Segments`,
    "flat" [n, P+T]: where each padded column's token sits in the sequence (-1 on padding)}. Row by
    row: the row's prompt if no earlier row holds it, then its completion. routes [n, P+T, layers, k]
    (a MoE model's replayed experts): packed the same way, "routes" [1, S, layers, k] (a shared
    prompt's are its holder's)."""
    P = prompt_len
    ids, valid, key = input_ids.cpu(), valid.cpu(), key.cpu()
    n = ids.shape[0]
    first = torch.full((int(key.max()) + 1,), n).scatter_reduce(0, key, torch.arange(n), "amin")[key]  # [n]
    is_first = first == torch.arange(n)  # [n] the row that holds its prompt
    kept = valid.clone()  # [n, P+T] the cells the sequence holds, in row-major order
    kept[:, :P] &= is_first[:, None]
    S = int(kept.sum())
    flat = torch.full(valid.shape, -1, dtype=torch.long)
    flat[kept] = torch.arange(S)
    flat[:, :P] = torch.where(valid[:, :P], flat[first, :P], -1)  # a shared prompt: its holder's cells
    positions = (valid.long().cumsum(-1) - 1)[kept]  # [S] from each prompt's first real token
    prompt_lens, completion_lens = valid[:, :P].sum(-1), valid[:, P:].sum(-1)  # [n]
    prompt_at = flat[:, P - 1]  # [n] the prompt's last token
    prompt_start = prompt_at - prompt_lens + 1
    pieces = []
    rows = zip(is_first.tolist(), prompt_start.tolist(), prompt_lens.tolist(), flat[:, P].tolist(),
               completion_lens.tolist())
    for holds, ps, pl, cs, cl in rows:
        if holds:
            pieces.append(((ps, pl),))
        if cl:
            pieces.append(((ps, pl), (cs, cl)))
    dev = input_ids.device
    out = {"input_ids": ids[kept][None].to(dev), "positions": positions[None].to(dev),
           "mask": Segments(pieces).to(dev), "flat": flat.to(dev)}
    if routes is not None:
        out["routes"] = routes[kept.to(routes.device)][None]  # [1, S, layers, k]
    return out


def prompt_keys(input_ids, valid, prompt_len: int):
    """[n]: one integer per distinct prompt (its tokens and length) of a padded batch's rows."""
    prompts = input_ids[:, :prompt_len].masked_fill(~valid[:, :prompt_len], -1)  # [n, P]
    return torch.unique(prompts, dim=0, return_inverse=True)[1]  # [n]


class Segments:
    """The attention of a packed sequence, in place of a mask: a prompt's queries see its own earlier
    tokens (causal), a completion's see its prompt and its own earlier tokens (causal aligned to the
    bottom right: query i of a completion after a prompt of p tokens sees keys 0..p+i). Nothing is
    computed for what a block mask over the whole sequence would hide (S^2 scores: on builtin:carries'
    groups, 3x the time of the attention done piece by piece).

    pieces: in sequence order, ((start, length),) for a prompt and ((its prompt's start, length),
    (start, length)) for a completion; a piece's queries are its last span, its keys all of its spans.
    Pieces of like size go together into one SDPA (`buckets`), each padded to the bucket's longest
    queries and keys, its padding masked: one call per piece costs ~0.1 ms of overhead forward and
    backward (the default task's 144 pieces a layer made its training step 1.7x slower), one call for
    pieces of unlike size computes the padding."""

    def __init__(self, pieces: list[tuple], waste: float = 1.25):
        self.buckets = [self._bucket(b) for b in buckets(pieces, waste)]
        where = torch.cat([q[ok] for q, _, _, ok in self.buckets])  # [S] each output's position, bucket order
        self.order = torch.empty_like(where)
        self.order[where] = torch.arange(len(where))  # [S]: sequence position -> its output's row

    @staticmethod
    def _bucket(pieces: list[tuple]):
        """(queries [m, Lq], keys [m, Lk] as sequence positions (0 on padding), mask [m, 1, Lq, Lk]
        bool, real queries [m, Lq] bool) of one bucket."""
        K = max(map(len, pieces))
        spans = torch.tensor([[(0, 0)] * (K - len(p)) + list(p) for p in pieces])  # [m, K, 2] (start, length)
        starts, lens = spans[..., 0], spans[..., 1]  # [m, K] each
        ends = lens.cumsum(-1)  # [m, K] where each span's keys end in the piece's keys
        lq, lk = lens[:, -1:], ends[:, -1:]  # [m, 1] each: the queries are the last span
        Lq, Lk = int(lq.max()), int(lk.max())
        j = torch.arange(Lk)  # [Lk]
        span = (j[None, None, :] >= ends[:, :, None]).sum(1).clamp(max=K - 1)  # [m, Lk] each key's span
        keys = starts.gather(1, span) + j - (ends - lens).gather(1, span)  # [m, Lk]
        keys = torch.where(j < lk, keys, 0)
        queries = torch.where(torch.arange(Lq) < lq, starts[:, -1:] + torch.arange(Lq), 0)  # [m, Lq]
        i, j = torch.arange(Lq)[None, :, None], j[None, None, :]  # [1, Lq, 1], [1, 1, Lk]
        seen = (j <= i + (lk - lq)[:, :, None]) & (j < lk[:, :, None])  # [m, Lq, Lk]
        seen |= j == 0  # a padding query sees key 0: no empty softmax (its output is dropped)
        return queries, keys, seen[:, None], torch.arange(Lq)[None] < lq

    def to(self, device):
        """This layout's index tensors on `device` (once per micro-batch, not per layer)."""
        self.buckets = [tuple(t.to(device) for t in b) for b in self.buckets]
        self.order = self.order.to(device)
        return self

    def attend(self, q, k, v, gqa: bool):
        """q [1, H, S, D], k, v [1, KV, S, D] -> [1, H, S, D]."""
        out = []
        for queries, keys, mask, ok in self.buckets:
            qq = gather(q, queries)  # [m, H, Lq, D]
            kk, vv = gather(k, keys), gather(v, keys)  # [m, KV, Lk, D]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=gqa)  # [m, H, Lq, D]
            out.append(o.transpose(1, 2)[ok])  # [real queries, H, D]
        return torch.cat(out)[self.order].transpose(0, 1)[None]  # [1, H, S, D] in sequence order


def gather(x, index):
    """x [1, H, S, D] at sequence positions index [m, L] -> [m, H, L, D] (index_select: its backward
    is one index_add; advanced indexing's accumulating index_put took 1.35x as long on a [1, 2, 4204, 64]
    gather of 64 x 76 positions, forward and backward, 2 threads)."""
    m, L = index.shape
    return x[0].index_select(1, index.flatten()).unflatten(1, (m, L)).transpose(0, 1)


def buckets(pieces: list[tuple], waste: float) -> list[list[tuple]]:
    """Pieces grouped for batched attention: by query length, longest first, a piece joining the
    current bucket while the bucket's padded area (pieces x longest queries x longest keys) stays
    within `waste` times the sum of its pieces' own areas."""
    def size(p):
        return p[-1][1], sum(n for _, n in p)  # (queries, keys)
    out, area, Lq, Lk = [], 0, 0, 0
    for p in sorted(pieces, key=size, reverse=True):  # Lq: the bucket's first piece's queries
        lq, lk = size(p)
        if out and (len(out[-1]) + 1) * Lq * max(Lk, lk) <= waste * (area + lq * lk):
            out[-1].append(p)
            area, Lk = area + lq * lk, max(Lk, lk)
            continue
        out.append([p])
        area, Lq, Lk = lq * lk, lq, lk
    return out


def token_budget(model, tokens: int, compile: bool = False) -> int:
    """--micro-batch-tokens for this model's forward: `tokens`, or 0 (rows, padded) for a Qwen2-VL
    model, whose M-RoPE positions and images are made over the padded layout (models/qwen2_vl.py),
    and under --compile (each block compiled whole, fullgraph: `Segments` indexes by masks and its
    buckets change with every micro-batch)."""
    return tokens if getattr(model.config, "vision", None) is None and not compile else 0
