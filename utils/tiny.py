"""Tiny checkpoints, made offline: a tokenizer trained on the built-in task, a random
model, and a short supervised warm start that leaves the model partly right on the task
(so that RL has something to improve, in minutes on 2 CPU cores).

    python -m utils.tiny --out assets/arith-tiny            # what the default run uses (~5 min)
    python -m utils.tiny --out /tmp/rand --sft-steps 0       # random weights (tests)
"""
import argparse
import random
import time

import torch

from utils.data import Tokenizer, arith_rows, train_tokenizer
from utils.model import ModelConfig, build, save_model

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # head_dim >= 32 for vLLM's CPU kernels


def make_tokenizer(path: str, vocab_size: int = 512, chat_template: str | None = None) -> int:
    texts = [r["prompt"] + r["answer"] for r in arith_rows("train", n_train=2000)]
    return train_tokenizer(texts, path, vocab_size, chat_template)


def random_checkpoint(path: str, seed: int = 0, architecture: str = "Qwen2ForCausalLM", **overrides) -> ModelConfig:
    """A random model in HF format with the built-in task's tokenizer."""
    eos = make_tokenizer(path)
    cfg = ModelConfig(**{**TINY, "architecture": architecture, "eos_token_id": eos,
                         "attention_bias": architecture == "Qwen2ForCausalLM", **overrides})
    model = build(cfg)
    model.init_weights(seed)
    save_model(model, cfg, path)
    return cfg


def random_reward_model(path: str, policy: str, seed: int = 0, std: float = 0.02) -> ModelConfig:
    """A random Bradley-Terry reward model (...ForSequenceClassification, one score) with the
    decoder shape and the tokenizer of the checkpoint at `policy` (tests and benchmarks)."""
    from dataclasses import replace

    from utils.model import read_config

    cfg = replace(read_config(policy).with_score_head(1), pad_token_id=Tokenizer(policy).pad_id)
    model = build(cfg)
    model.init_weights(seed, std)
    save_model(model, cfg, path, tokenizer_dir=policy)
    return cfg


def sft_batch(rows, tok: Tokenizer, eos: int):
    """Right-padded 'prompt answer<eos>' sequences; loss only on the answer and EOS."""
    seqs, masks = [], []
    for r in rows:
        p, a = tok.encode(r["prompt"]), tok.encode(r["answer"]) + [eos]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    L = max(map(len, seqs))
    x = torch.tensor([s + [eos] * (L - len(s)) for s in seqs])
    m = torch.tensor([s + [0] * (L - len(s)) for s in masks], dtype=torch.float32)
    return x, m


def warm_start(path: str, steps: int, batch: int = 64, lr: float = 1e-3, seed: int = 0, log_every: int = 250):
    """Supervised steps on the built-in task's train split, in place on the checkpoint at `path`."""
    from utils.model import load_model

    torch.manual_seed(seed)
    model = load_model(path).train()
    tok = Tokenizer(path)
    eos = min(tok.eos_ids)
    rows = arith_rows("train", seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0 = time.time()
    for step in range(steps):
        x, m = sft_batch(rng.sample(rows, batch), tok, eos)
        logits = model(x[:, :-1])  # [B, L-1, V]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # [B, L-1]
        loss = (nll * m[:, 1:]).sum() / m[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    save_model(model, model.config, path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sft-steps", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)  # one thread: the same float reduction order, hence the same bits, each run
    random_checkpoint(a.out, a.seed)
    if a.sft_steps:
        warm_start(a.out, a.sft_steps, seed=a.seed)
    print(f"wrote {a.out}")
