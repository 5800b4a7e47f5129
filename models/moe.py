"""Qwen3-MoE's sparse block (transformers' Qwen3MoeSparseMoeBlock, vLLM's Qwen3MoeForCausalLM):
a router picks each token's top-k of E experts, each expert a SwiGLU MLP, and the token's output
is the experts' outputs weighed by the router's probabilities (Shazeer et al. 2017; Qwen3 report,
arXiv 2505.09388). Parameter names are HF's on-disk names (`mlp.gate.weight`,
`mlp.experts.{e}.gate_proj.weight`), so checkpoints go in and out without a rename table.

Routing replay (R3, Ma et al. 2025, arXiv 2510.11370): the engine records each token's experts and
the trainer's forward uses them instead of its own top-k, so that the two compute the same function
of the weights; the gradient still reaches the router through the gates of the replayed experts
(their softmax probabilities). `routes` [N, k] of -1 leaves a token to the router (a token no
engine recorded: the last sampled one, a multi-turn episode's kept prefix).
"""
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.config import Moe, ModelConfig
from utils.errors import UserError, check_rules


class Expert(nn.Module):
    """One expert: a SwiGLU MLP (models.decoder.MLP's math, HF's names)."""

    def __init__(self, hidden: int, size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, size, bias=False)
        self.up_proj = nn.Linear(hidden, size, bias=False)
        self.down_proj = nn.Linear(size, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Router `gate` [E, hidden] and E experts. The experts run one after the other on the tokens
    routed to each (index_select, the expert, index_add: transformers' eager loop); every expert runs,
    on zero tokens if none chose it, so that each has a gradient on every rank (FSDP2 reduces the
    same tensors everywhere).

    `stats`: None, or a dict that `Routing` (below) starts, reads and clears: per forward it adds each
    expert's count of assignments ("load" [E]), the routing entropy summed over tokens ("entropy"),
    the tokens ("tokens") and those replayed ("replayed"); with the load-balancing loss on, what it
    reads ("aux_count", "aux_prob" with its gradient, "aux_rows").
    `record`: None, or a list each forward appends its experts to, [..., k] (`Recorder`)."""

    def __init__(self, hidden: int, moe: Moe):
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        size = moe.moe_intermediate_size
        self.experts = nn.ModuleList([Expert(hidden, size) for _ in range(moe.num_experts)])
        self.stats = None
        self.record = None

    def forward(self, x, routes=None):
        """x [B, S, hidden]; routes [B, S, k] (int, -1: the router's own choice) -> [B, S, hidden]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, hidden]
        logits = self.gate(x)  # [N, E]
        probs = torch.softmax(logits, -1, dtype=torch.float32)  # [N, E]
        weights, chosen = torch.topk(probs, self.top_k, -1)  # [N, k] each
        if routes is not None:
            routes = routes.reshape(-1, self.top_k).long()  # [N, k]
            replay = (routes >= 0).all(-1, keepdim=True)  # [N, 1] tokens with a recorded route
            chosen = torch.where(replay, routes, chosen)
            weights = probs.gather(-1, chosen)  # [N, k] the replayed experts' probabilities
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        if self.record is not None:
            self.record.append(chosen.view(*shape[:-1], self.top_k))
        if self.stats is not None:
            self._count(probs, chosen, None if routes is None else replay)
        out = torch.zeros_like(x)  # [N, hidden]
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)  # [n_e] each
            y = expert(x.index_select(0, token)) * weights[token, slot, None]  # [n_e, hidden]
            out.index_add_(0, token, y)
        return out.view(shape)

    def _count(self, probs, chosen, replay):
        """Add this forward's load, entropy and (with the load-balancing loss) its term to `stats`."""
        s = self.stats
        with torch.no_grad():
            E = probs.shape[-1]
            s["load"] = s.get("load", 0) + torch.bincount(chosen.flatten(), minlength=E).float()  # [E]
            s["entropy"] = s.get("entropy", 0) - (probs * probs.clamp_min(1e-20).log()).sum()
            s["tokens"] = s.get("tokens", 0) + probs.shape[0]
            if replay is not None:
                s["replayed"] = s.get("replayed", 0) + replay.sum()
        if s.get("aux_coef"):  # what the load-balancing loss reads (Routing.aux_loss)
            count = torch.bincount(chosen.flatten(), minlength=probs.shape[-1])  # [E]
            s["aux_count"] = s.get("aux_count", 0) + count
            s["aux_prob"] = s.get("aux_prob", 0) + probs.sum(0)  # [E], with its gradient
            s["aux_rows"] = s.get("aux_rows", 0) + probs.shape[0]


class Recorder:
    """The experts a model's sparse blocks chose during one `NativeEngine.generate` (routing replay):
    the prefill's for the prompts, then each decode step's for the token it fed. -> per sample, its
    prompt's and completion's routes [len(prompt) + length, layers, k] int16, -1 where none was
    recorded (a dense layer; the last sampled token, never fed; a kept prefix, never prefilled)."""

    def __init__(self, model, B0: int, N: int, T: int):
        cfg = model.config
        self.blocks = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if layer.sparse]
        self.layers = torch.tensor([i for i, _ in self.blocks])  # the sparse layers' indices
        for _, block in self.blocks:
            block.record = []
        self.shape = (cfg.num_hidden_layers, cfg.moe.num_experts_per_tok)
        self.B0, self.prompt = B0, None
        self.completion = torch.full((N, T, *self.shape), -1, dtype=torch.int16)  # [N, T, layers, k]

    def _take(self):
        """The sparse blocks' records of the last forward, one copy to the CPU for all of them (not one
        device sync per layer) -> [..., sparse layers, k] int16."""
        return torch.stack([block.record.pop() for _, block in self.blocks], -2).to("cpu", torch.int16)

    def prefill(self, P: int):
        """After the prefill of the left-padded prompts [B0, P] (its last S columns prefilled)."""
        self.prompt = torch.full((self.B0, P, *self.shape), -1, dtype=torch.int16)  # [B0, P, layers, k]
        got = self._take()  # [B0, S, sparse layers, k]
        self.prompt[:, P - got.shape[1]:, self.layers] = got

    def step(self, rows, t: int, going):
        """After the decode step that fed completion token t of samples `rows` [r]; going [r]: the rows
        not finished. A finished row still in the batch is fed too, its own slot masked (engines/native.py):
        what its token's experts would be is not recorded."""
        live = going.cpu()
        got = self._take()  # [r, sparse layers, k]
        self.completion[rows.cpu()[live][:, None], t, self.layers[None, :]] = got[live]  # [r', layers, k]

    def finish(self, prompts: list, n: int, lengths) -> list:
        for _, block in self.blocks:
            block.record = None
        P = self.prompt.shape[1]
        return [torch.cat((self.prompt[r // n, P - len(prompts[r // n]):], self.completion[r, :length]))
                for r, length in enumerate(lengths.tolist())]


@dataclass
class MoeArgs:
    routing_replay: bool = False
    """a MoE --model: the engine records each token's experts and the trainer's forward uses them instead
    of its own router's choice (R3), so that both compute the same function; the router still trains
    through the replayed experts' gates. Native engine only (docs/moe.md)"""
    freeze_router: bool = False
    """a MoE --model: the routers take no gradient and have no optimizer state"""
    router_aux_coef: float = 0.0
    """a MoE --model: the load-balancing loss (Switch Transformer's, transformers' form) at this weight in
    the policy loss; 0 (off), as RL runs usually keep it: a term that moves the routing toward balance moves
    the policy too, which the reward then has to pay for (docs/moe.md)"""
    APPLIES: ClassVar = {}

    def check(self):
        check_rules(self, [("router_aux_coef", 0 <= self.router_aux_coef < math.inf, "use 0 (off) or more")])

    def check_model(self, cfg: ModelConfig, args, engine: str):
        """The flags against the checkpoint: these flags need a MoE model, and a MoE model what is
        not built for it (LoRA adapters on experts, --gen-tp, --compile, vLLM with replay) refused.
        engine: the engine --engine resolves to on this machine (auto: vLLM on a GPU where installed)."""
        if cfg.moe is None:
            flags = (("--routing-replay", self.routing_replay), ("--freeze-router", self.freeze_router),
                     ("--router-aux-coef", self.router_aux_coef))
            used = [flag for flag, on in flags if on]
            if used:
                raise UserError(f"{used[0]}: --model {args.data.model} is a dense model (no experts); "
                                "leave it out")
            return
        refused = [("--lora-rank", args.lora.lora_rank, "adapters on the experts are not implemented"),
                   ("--gen-tp", args.placement.gen_tp > 1, "the sparse blocks are not split over ranks"),
                   ("--compile", args.compute.compile, "the experts' token counts change every forward"),
                   (f"--routing-replay with --engine {args.sampling.engine} (here: vllm)",
                    self.routing_replay and engine == "vllm",
                    "our vLLM engine does not return the experts yet (vLLM's enable_return_routed_experts; "
                    "docs/moe.md): use --engine native"),
                   ("--router-aux-coef with --freeze-router", self.router_aux_coef and self.freeze_router,
                    "frozen routers cannot move toward balance, and the loss would only move the layers "
                    "below them"),
                   ("--routing-replay with --env or --tools",
                    self.routing_replay and bool(args.env.env or args.env.tools),
                    "multi-turn episodes do not carry the experts of their turns yet")]
        for flag, on, why in refused:
            if on:
                raise UserError(f"{flag} with a mixture-of-experts --model ({cfg.architecture}): {why}; "
                                "leave it out")


class Routing:
    """The trainer's side of a MoE policy (nothing for a dense one): freezes the routers
    (--freeze-router), adds the load-balancing loss (--router-aux-coef), and counts what its forwards
    routed: each expert's share of the tokens, the routing entropy, the share of replayed tokens
    (`sums`, summed over ranks at log time; `metrics` turns them into train/moe_*)."""

    def __init__(self, model, args: MoeArgs | None):
        self.blocks = [layer.mlp for layer in model.model.layers if getattr(layer, "sparse", False)]
        self.replay = bool(args and args.routing_replay)
        self.aux_coef = args.router_aux_coef if args else 0.0
        for block in self.blocks:
            block.stats = {"aux_coef": self.aux_coef}
            if args and args.freeze_router:
                block.gate.requires_grad_(False)

    def start(self):
        """Before a step's forwards: the counts start again."""
        for block in self.blocks:
            block.stats = {"aux_coef": self.aux_coef}

    def aux_loss(self):
        """The load-balancing loss of the forwards since the last call, times --router-aux-coef (0 when
        off): Switch Transformer's E * sum_e f_e P_e (Fedus et al. 2021, eq. 4), f_e the share of
        top-k assignments that went to expert e and P_e its mean router probability, both over the
        tokens of every sparse layer together, as transformers' load_balancing_loss_func computes it."""
        if not self.aux_coef or not self.blocks:
            return 0.0
        count, prob, rows = (sum(b.stats.pop(k) for b in self.blocks)
                             for k in ("aux_count", "aux_prob", "aux_rows"))
        return self.aux_coef * len(prob) * ((count / rows) * (prob / rows)).sum()

    def sums(self) -> dict:
        """This rank's counts since `start`, as metric sums: moe_load/E (assignments to expert E, all
        sparse layers), moe_entropy (nats, summed over tokens and layers), moe_tokens, moe_replayed."""
        if not self.blocks:
            return {}
        out = {"moe_tokens": 0.0, "moe_entropy": 0.0, "moe_replayed": 0.0}
        load = 0
        for b in self.blocks:
            s = b.stats
            load = load + s.get("load", 0)
            out["moe_tokens"] += float(s.get("tokens", 0))
            out["moe_entropy"] += float(s.get("entropy", 0))
            out["moe_replayed"] += float(s.get("replayed", 0))
        if torch.is_tensor(load):
            out.update({f"moe_load/{e}": float(c) for e, c in enumerate(load.tolist())})
        return out


def metrics(total: dict) -> dict:
    """train/moe_*: the routing entropy per token and layer (log E when uniform), each expert's share
    of the assignments (1/E when balanced; with 16 experts or fewer), the largest share over the mean
    (1 when balanced), the share of tokens whose experts were replayed."""
    if "moe_tokens" not in total:
        return {}
    tokens = max(1.0, total["moe_tokens"])
    experts = sum(1 for k in total if k.startswith("moe_load/"))
    load = [total[f"moe_load/{e}"] for e in range(experts)]
    out = {"train/moe_entropy": total["moe_entropy"] / tokens,
           "train/moe_replayed": total["moe_replayed"] / tokens}
    if load:
        whole = max(1.0, sum(load))
        out["train/moe_load_max"] = max(load) / (whole / len(load))
        if len(load) <= 16:
            out.update({f"train/moe_load/{e}": c / whole for e, c in enumerate(load)})
    return out
