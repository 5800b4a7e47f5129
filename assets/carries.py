"""The tiny model of builtin:carries (tasks/carries.py), assets/carries-tiny: a tokenizer with a
chat template that renders the system message, a random decoder of assets.make's TINY shape, and a
supervised warm start on the worked solutions, made so that RL has room: it learns the method on
clean solutions, then takes a few steps on solutions with slips (a column's total one off, the
rest of the working following from it), so that at temperature 1 it slips now and then and a
long sum, with more columns to slip in, is more often wrong; greedy it is mostly right, and
pass@8 shows the answers within reach. RL's job is to stop the slips.

    python -m assets.carries --out assets/carries-tiny         # ~40 min on 2 cores (docs/reasoning.md)
    python -m assets.carries --out /tmp/c --sft-steps 20 --noisy-steps 0   # a quick one (tests)
    python -m assets.carries --out /tmp/s --from-clean CLEAN --noise 0.25  # other slips from a --clean-out
"""
import argparse
import random
import statistics
import time

import torch

from assets.make import TINY, masked_nll, padded, sft_model
from engines.decode import SamplingParams
from engines.native import NativeEngine
from models.hf import iter_checkpoint, load_state, read_config, save_model
from models.tokenizer import Tokenizer, train_tokenizer
from tasks.carries import SYSTEM, carry_rows, worked
from tasks.rewards import accuracy

# one special token per role; the end of an assistant turn is EOS and a newline (as Qwen's "<|im_end|>\n")
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ '<|system|>' + m.content + '\n' }}"
    "{%- elif m.role == 'user' %}{{ '<|user|>' + m.content + '\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|assistant|>' + m.content + eos_token + '\n' }}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
CHAT_SPECIAL = ("<|system|>", "<|user|>", "<|assistant|>")
MAX_NEW_TOKENS = 512  # the longest worked solution of the train split is 419 tokens


def carries_tokenizer(path: str) -> int:
    """A byte-level BPE of 512 tokens (digits one token each) trained on the task's text; EOS's id."""
    rows = carry_rows("train")[:4000]
    texts = [SYSTEM] + [r["prompt"][1]["content"] + "\n" + r["solution"] for r in rows]
    return train_tokenizer(texts, path, TINY["vocab_size"], CHAT_TEMPLATE, CHAT_SPECIAL)


def example(row: dict, solution: str, tok: Tokenizer, eos: int) -> tuple[list[int], list[int]]:
    """(ids, loss mask): the rendered chat prompt, then `solution` and EOS, the loss on the latter."""
    prompt = tok.encode(tok.chat(row["prompt"], True), special=False)
    answer = tok.encode(solution, special=False) + [eos]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def sft_step(model, examples: list, eos: int):
    """One backward over `examples`, sorted by length and cut in two micro-batches (the short 3/4
    and the long 1/4: the lengths differ by 10x, so one padded batch would be mostly padding); the
    loss is the mean NLL over all their answer tokens. Returns it."""
    examples = sorted(examples, key=lambda e: len(e[0]))
    total = sum(sum(mask) for _, mask in examples)
    cut, loss = len(examples) * 3 // 4, 0.0
    for part in (examples[:cut], examples[cut:]):
        nll, _ = masked_nll(model, *padded([ids for ids, _ in part], [mask for _, mask in part], eos))
        (nll / total).backward()
        loss += nll.item() / total
    return loss


def carries_checkpoint(path: str, seed: int = 0, sft_steps: int = 3000, noisy_steps: int = 300,
                       noise: float = 0.35, batch: int = 32, lr: float = 2e-3, noisy_lr: float = 3e-4,
                       log_every: int = 100, clean_out: str | None = None, from_clean: str | None = None):
    """Writes the tiny carries model at `path`: `sft_steps` on clean worked solutions (AdamW, one
    cycle up to `lr`), then `slip_steps`. With `clean_out`, the model before the slips is written
    there too; `from_clean` starts from such a model instead of the clean steps (the same bytes as
    the whole build with these settings: the slips draw only from their own generator)."""

    eos = carries_tokenizer(path)
    tok = Tokenizer(path)
    cfg, model, opt, sched = sft_model(eos, seed, lr, sft_steps)
    if from_clean:
        load_state(model, iter_checkpoint(from_clean))
    else:
        clean_steps(model, opt, sched, tok, eos, sft_steps, seed, batch, log_every)
    if clean_out:
        save_model(model, cfg, clean_out, tokenizer_dir=path)
    slip_steps(model, tok, eos, noisy_steps, noise, batch, noisy_lr, seed, log_every)
    save_model(model, cfg, path)


def clean_steps(model, opt, sched, tok: Tokenizer, eos: int, steps: int, seed: int = 0, batch: int = 32,
                log_every: int = 100):
    """`steps` supervised steps, in place, on clean worked solutions drawn from the train split."""
    rng, train = random.Random(seed), carry_rows("train", seed)
    t0 = time.time()
    for step in range(steps):
        opt.zero_grad()
        loss = sft_step(model, [example(r, r["solution"], tok, eos) for r in rng.sample(train, batch)], eos)
        opt.step()
        sched.step()
        if (step + 1) % log_every == 0:
            seconds = time.time() - t0
            print(f"carries sft step {step + 1}/{steps} loss {loss:.3f} ({seconds:.0f}s)", flush=True)


def slip_steps(model, tok: Tokenizer, eos: int, steps: int, noise: float, batch: int = 32, lr: float = 3e-4,
               seed: int = 0, log_every: int = 100):
    """`steps` more supervised steps, in place, with a fresh AdamW at a constant `lr`, on worked
    solutions in which each column's total is one off with probability `noise` (the working then
    follows from the wrong total): the model learns that it slips now and then."""

    rng, train = random.Random(f"carries-slips-{seed}"), carry_rows("train", seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def slip(total: int) -> int:
        return max(0, total + rng.choice((-1, 1))) if rng.random() < noise else total

    t0 = time.time()
    for step in range(steps):
        opt.zero_grad()
        rows = rng.sample(train, batch)
        loss = sft_step(model, [example(r, worked(_numbers(r), slip), tok, eos) for r in rows], eos)
        opt.step()
        if (step + 1) % log_every == 0:
            seconds = time.time() - t0
            print(f"carries slip step {step + 1}/{steps} loss {loss:.3f} ({seconds:.0f}s)", flush=True)


def _numbers(row: dict) -> list[int]:
    return [int(x) for x in row["solution"].split(":")[0].split(" + ")]


@torch.no_grad()
def sample_stats(path: str, n_prompts: int = 256, n: int = 8, temperature: float = 1.0, seed: int = 0,
                 keep_lengths: bool = False) -> dict:
    """The checkpoint at `path` on builtin:carries' first `n_prompts` held-out problems, `n` samples
    each through the native engine: accuracy (the mean over samples: one sample's accuracy at this
    temperature), pass@n (the share of problems with a right sample), and the completions' length
    in tokens (mean, median, p95, max; with keep_lengths, every sample's too)."""

    tok = Tokenizer(path)
    rows = carry_rows("eval")[:n_prompts]
    engine = NativeEngine(read_config(path), tok)
    engine.load_weights(iter_checkpoint(path))
    prompts = [tok.encode(tok.chat(r["prompt"], True), special=False) for r in rows]
    out = engine.generate(prompts, SamplingParams(n, temperature, max_new_tokens=MAX_NEW_TOKENS),
                          list(range(seed, seed + len(rows))))
    right = accuracy(None, out.texts, [r["answer"] for r in rows for _ in range(n)])
    lengths = sorted(out.lengths.tolist())
    kept = {"lengths": out.lengths.tolist()} if keep_lengths else {}
    return {**kept, "accuracy": sum(right) / len(right),
            f"pass@{n}": sum(max(right[i * n:(i + 1) * n]) for i in range(len(rows))) / len(rows),
            "length_mean": statistics.mean(lengths), "length_median": statistics.median(lengths),
            "length_p95": lengths[int(0.95 * len(lengths))], "length_max": lengths[-1]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sft-steps", type=int, default=3000, help="steps on clean worked solutions")
    ap.add_argument("--noisy-steps", type=int, default=300, help="then steps on solutions with slips")
    ap.add_argument("--noise", type=float, default=0.35, help="the chance that a column's total is one off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clean-out", help="also write the model before the slips here (its ceiling for RL)")
    ap.add_argument("--from-clean", help="start from a --clean-out model: the slip steps alone")
    a = ap.parse_args()
    torch.set_num_threads(2)  # the bits then depend on the CPU, as assets/tool-tiny's
    carries_checkpoint(a.out, a.seed, a.sft_steps, a.noisy_steps, a.noise, clean_out=a.clean_out,
                       from_clean=a.from_clean)
    got = sample_stats(a.out, seed=a.seed)
    print(f"wrote {a.out}: held-out, 8 samples a problem at temperature 1: "
          + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()))
    print(f"greedy: accuracy {sample_stats(a.out, n=1, temperature=0.0)['accuracy']:.3f}")
