"""Shared by the benchmarks: this machine's fp32 matmul rate, peak RSS, a tiny HF checkpoint."""
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matmul_gflops(n: int = 2048, reps: int = 5, device="cpu", dtype=torch.float32) -> float:
    """Best-of-`reps` rate of one large matmul (fp32 on the CPU): the roof the MFU figures divide by."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def sync(device):
    """Waits for the device's queued work (timings on a GPU); nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def print_table(head: tuple, rows: list[tuple]):
    """A markdown table, each column as wide as its widest cell (cells already formatted as text)."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def qwen2_checkpoint(path: str, hidden=256, layers=4, vocab=1024, seed=0):
    """A random Qwen2 of the shape ../shared/bench/trl_grpo_cpu.py builds (2.6M params at the
    defaults), saved by transformers, with the built-in task's tokenizer."""
    import transformers

    from assets.make import make_tokenizer

    eos = make_tokenizer(path, vocab_size=vocab)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, eos_token_id=eos, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def parity_reward(prompts, completions, **columns):
    """A reward for benchmarks of random models: the parity of the completion's CRC32, so that
    (unlike accuracy, always 0 for a random model) nearly every group has unequal rewards and
    every row is trained, as TRL trains them. Loaded as `bench.common:parity_reward`."""
    import zlib

    return [float(zlib.crc32(c.encode()) % 2) for c in completions]


def slowing_reward(prompts, completions, **columns):
    """A scorer that gets slower as the run goes, like a remote verifier or judge whose queue fills:
    each completion costs nothing until a share SLOW_FROM of the run's SLOW_COMPLETIONS completions
    is scored, then up to SLOW_S seconds by the end, linearly (counted in the file $SLOW_FILE, which
    every trainer appends to and which outlives a --rebalance restart). The time is slept, not
    computed, as a remote scorer's would be, so that on a small CPU the trainers' growing work does
    not take cores from the rollout ranks, and it scores every completion 0 (no group carries a
    signal: the actor skips them), so that the trainers' work is the scorer's alone: the run goes
    from generation-bound to training-bound."""
    import time

    path = os.environ["SLOW_FILE"]
    with open(path, "ab") as f:
        f.write(b"x" * len(completions))
    done = os.path.getsize(path) / float(os.environ["SLOW_COMPLETIONS"])  # share of the run
    start = float(os.environ.get("SLOW_FROM", "0"))
    slowed = min(1.0, max(0.0, done - start) / (1 - start))
    time.sleep(len(completions) * float(os.environ["SLOW_S"]) * slowed)
    return [0.0] * len(completions)
