"""Qwen3-MoE (issue 56, docs/moe.md): our model against transformers on random configs, and the
log-prob gap between engine and trainer with and without routing replay.

    python bench/moe.py parity                       # the largest logit difference against transformers
    python bench/moe.py gap --model assets/moe-tiny  # the gap, fp32 and bf16 engines, replay on and off
    python bench/moe.py experts                      # the experts' loop against torch's grouped matmul

`gap` samples the built-in task's held-out prompts with the native engine (recording each token's
experts), then computes the trainer's log-probs of the same tokens (packed micro-batches, as the
trainer runs) with its own routing and with the engine's (models/moe.py): the |difference| over
the sampled tokens, and the share of (token, layer) routes on which the trainer's own top-k differs
from the engine's; engine and trainer in fp32, the engine in bf16 against an fp32 trainer, both in
bf16 (a `--param-dtype bfloat16` run).
"""
import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import print_table  # noqa: E402
from engines.decode import SamplingParams  # noqa: E402
from engines.native import NativeEngine  # noqa: E402
from models.decoder import attention_mask, completion_logprobs, positions_from  # noqa: E402
from models.hf import iter_checkpoint, load_model, read_config  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402
from tasks.data import arith_rows, forward_batches, make_batch, scatter_rows  # noqa: E402

CONFIGS = [  # Qwen3MoeConfig overrides on a 2-layer, hidden-64 model: the three kinds of layout
    dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=2),
    dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3),
]


def parity():
    """Random transformers Qwen3MoeForCausalLM (routers at std 0.3: decisive choices), saved, loaded by
    models.hf, a left-padded batch through both in fp32."""
    import transformers

    rows = []
    for i, kw in enumerate(CONFIGS):
        torch.manual_seed(i)
        cfg = transformers.Qwen3MoeConfig(**{
            "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **kw})
        ref = transformers.Qwen3MoeForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.3)
        with tempfile.TemporaryDirectory() as path:
            ref.save_pretrained(path)
            ours = load_model(path)
        x = torch.randint(0, 512, (4, 32))
        valid = torch.ones(4, 32, dtype=torch.bool)
        valid[1, :9] = False
        with torch.no_grad():
            want = ref(x, attention_mask=valid.long(), position_ids=positions_from(valid)).logits[valid]
            got = ours(x, positions_from(valid), attention_mask(valid))[valid]
        layout = ", ".join(f"{k} {v}" for k, v in kw.items())
        rows.append((layout, f"{(got - want).abs().max().item():.2e}",
                     f"{((got - want).norm() / want.norm()).item():.2e}"))
    print_table(("config (experts, top-k, layout)", "max abs logit diff", "relative (norm)"), rows)


def own_routes(model, batch) -> torch.Tensor:
    """The experts the trainer's own routers pick over the batch -> [N, L, layers, k] (-1: dense)."""
    blocks = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if layer.sparse]
    for _, b in blocks:
        b.record = []
    with torch.no_grad():
        completion_logprobs(model, batch, 1.0)
    N, L = batch["input_ids"].shape
    used = torch.full((N, L, len(model.model.layers), model.config.moe.num_experts_per_tok), -1,
                      dtype=torch.long)
    for i, b in blocks:
        used[:, :, i] = b.record.pop()
        b.record = None
    return used


def packed_logprobs(model, batch, replay: bool):
    """The trainer's log-probs as train_grpo.py makes them by default: packed micro-batches of at most
    2048 tokens (--micro-batch-tokens)."""
    parts = [(rows, completion_logprobs(model, mb, 1.0, replay))
             for rows, mb in forward_batches(batch, 256, 2048)]
    return scatter_rows(parts, *batch["loss_mask"].shape)  # [N, T]


def gap(model_dir: str, prompts: int, n: int, new_tokens: int):
    tok = Tokenizer(model_dir)
    rows = arith_rows("eval")[:prompts]
    ids = [tok.encode(*tok.render(r["prompt"])) for r in rows]
    table = []
    for dtype, trainer_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                 (torch.bfloat16, torch.bfloat16)):
        trainer = load_model(model_dir).to(trainer_dtype)
        engine = NativeEngine(read_config(model_dir), tok, dtype=dtype, routes=True)
        engine.load_weights(iter_checkpoint(model_dir))
        out = engine.generate(ids, SamplingParams(n, 1.0, max_new_tokens=new_tokens), list(range(len(ids))))
        batch = make_batch([p for p in ids for _ in range(n)], out.tokens, out.lengths, tok.pad_id,
                           routes=out.routes)
        known = batch["routes"] >= 0
        flipped = (own_routes(trainer, batch)[known] != batch["routes"].long()[known]).float().mean().item()
        mask = batch["loss_mask"].bool()
        for replay in (False, True):
            with torch.no_grad():
                d = (packed_logprobs(trainer, batch, replay) - out.logprobs).abs()[mask]
            table.append((str(dtype).removeprefix("torch."), str(trainer_dtype).removeprefix("torch."),
                          "on" if replay else "off", f"{int(mask.sum())}",
                          f"{flipped:.4f}", f"{d.mean().item():.2e}", f"{d.quantile(0.99).item():.2e}",
                          f"{d.max().item():.2e}", f"{int((d > 0.1).sum())}"))
    print_table(("engine", "trainer", "replay", "tokens", "routes the trainer picks otherwise", "gap mean",
                 "gap p99", "gap max", "tokens over 0.1"), table)


def experts(shapes):
    """The sparse block's experts, forward and backward, two ways: models/moe.py's loop over experts
    (index_select, the expert's SwiGLU, index_add) against torch's grouped matmul (F.grouped_mm, on CPU
    in torch 2.13) over the tokens sorted by expert, with the experts' weights stacked [E, h, I] once
    per call (our parameters are one Linear per expert, HF's names) or already stacked."""
    import time

    import torch.nn.functional as F

    from models.config import Moe
    from models.moe import SparseMoe

    def grouped(block, x, stacked=None):
        probs = torch.softmax(block.gate(x), -1, dtype=torch.float32)  # [N, E]
        weights, chosen = torch.topk(probs, block.top_k, -1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        order = chosen.flatten().argsort(stable=True)  # [N k] assignments by expert
        token = order // block.top_k
        counts = torch.bincount(chosen.flatten(), minlength=len(block.experts))
        offs = counts.cumsum(0).to(torch.int32)
        gate, up, down = stacked or (torch.stack([getattr(e, n).weight.t() for e in block.experts])
                                     for n in ("gate_proj", "up_proj", "down_proj"))
        xs = x.index_select(0, token)  # [N k, h]
        y = F.grouped_mm(F.silu(F.grouped_mm(xs, gate, offs=offs)) * F.grouped_mm(xs, up, offs=offs), down,
                         offs=offs)  # [N k, h]
        y = y * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)

    rows = []
    for hidden, size, E, k, N in shapes:
        block = SparseMoe(hidden, Moe(E, k, size, True))
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.05)
        x = torch.randn(N, hidden, requires_grad=True)
        stacked = [torch.stack([getattr(e, n).weight.t() for e in block.experts]).detach().requires_grad_()
                   for n in ("gate_proj", "up_proj", "down_proj")]
        ways = {"loop (models/moe.py)": lambda: block(x),
                "grouped_mm, stacked per call": lambda: grouped(block, x),
                "grouped_mm, weights stacked": lambda: grouped(block, x, stacked)}
        want = block(x)
        assert all((f() - want).abs().max() < 1e-4 for f in ways.values())
        for name, f in ways.items():
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                f().square().sum().backward()
                best = min(best, time.perf_counter() - t)
            shape = f"h {hidden}, {E} experts of {size}, top-{k}, {N} tokens"
            rows.append((shape, name, f"{best * 1e3:.1f}"))
    print_table(("block", "experts computed by", "forward + backward ms (best of 5)"), rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("parity", "gap", "experts"))
    ap.add_argument("--model", default="assets/moe-tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.what == "parity":
        parity()
    elif a.what == "experts":
        experts([(128, 128, 8, 2, 2048), (1024, 512, 32, 4, 2048), (2048, 768, 128, 8, 512)])
    else:
        gap(a.model, a.prompts, a.n, a.new_tokens)


if __name__ == "__main__":
    main()
