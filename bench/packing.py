"""The trainer's forward and backward on a GRPO step's rows, padded against packed (models/packing.py:
rows back to back, each group's prompt once): tokens and FLOPs computed, seconds, peak memory.

    .venv/bin/python bench/packing.py                          # 2.6M, 19M and 76M params, both shapes
    .venv/bin/python bench/packing.py --sizes 256x4 --rounds 2  # one size (HIDDENxLAYERS)

The models are bench/grpo_vs_trl.py's (a random Qwen2 of that hidden size and depth, vocabulary
1024, 4 heads, 2 KV heads, tied head). The rows are made, not generated, so that both layouts
train exactly the same tokens; 8 prompts x 8 samples a step:
  - today: grpo_vs_trl.py's shape, a 12-token prompt and 64 new tokens in every row (a random model
    runs to --max-new-tokens);
  - reasoning: a 200-token system prompt shared by every prompt, then a 50-token question, and
    completions of uneven length: geometric with mean 96, capped at 384 (as a reasoning task's:
    builtin:carries' samples have mean 97, p95 257).
Each (size, shape, layout) runs in its own process (its peak RSS is its own), one thread for each
of this machine's 2 cores, the layouts alternating over --rounds; each reports the median of
--steps steps after --warmup untimed ones. A step is what the actor's train_step runs:
forward_batches' micro-batches (`LAYOUTS`), the log-probs, a loss, its backward. A layout killed
for memory (this machine has 24 GiB) is a row that says so. FLOPs: 6 x matmul params per token
computed (forward and backward), plus 12 x layers x heads x head_dim per attention score computed
(padded: every row's L x L, its mask's hidden ones too; packed: the buckets' padded areas).
"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPTS, N_GEN = 8, 8
SHAPES = ("today", "reasoning")
# (--micro-batch-size, --micro-batch-tokens): padded at the default rows (all 64 in one micro-batch),
# padded in micro-batches of 8 (rows sorted by length first: less padding), packed at the default
LAYOUTS = {"padded": (256, 0), "padded, 8 rows": (8, 0), "packed": (256, 4096)}


def rows(shape: str, seed: int = 0):
    """(prompts, completion lengths) of one step's 64 rows, prompt-major."""
    rng = random.Random(seed)
    if shape == "today":
        prompts = [[rng.randrange(3, 1024) for _ in range(12)] for _ in range(PROMPTS)]
        return [p for p in prompts for _ in range(N_GEN)], [64] * (PROMPTS * N_GEN)
    system = [rng.randrange(3, 1024) for _ in range(200)]
    prompts = [system + [rng.randrange(3, 1024) for _ in range(50)] for _ in range(PROMPTS)]
    lengths = [min(384, 1 + int(rng.expovariate(1 / 95))) for _ in range(PROMPTS * N_GEN)]
    return [p for p in prompts for _ in range(N_GEN)], lengths


def one(size: str, shape: str, rows_per: int, budget: int, steps: int, warmup: int) -> dict:
    """In this process: `warmup` + `steps` forward/backward passes of one layout -> its figures."""
    import torch

    from models.config import ModelConfig
    from models.decoder import completion_logprobs, flops_per_token
    from models.hf import build
    from tasks.data import forward_batches, make_batch

    torch.set_num_threads(2)
    hidden, layers = map(int, size.split("x"))
    cfg = ModelConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, tie_word_embeddings=True)
    model = build(cfg)
    model.init_weights(seed=0)
    prompts, lengths = rows(shape)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1024, (len(prompts), max(lengths)), generator=g)
    batch = make_batch(prompts, tokens, torch.tensor(lengths), 0)
    computed, scores, times = 0, 0, []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        for _, mb in forward_batches(batch, rows_per, budget):
            logp = completion_logprobs(model, mb, 1.0)  # [n, T]
            (logp * mb["loss_mask"]).sum().backward()
            if step == 0:
                if "packed" in mb:
                    computed += mb["packed"]["input_ids"].shape[1]
                    scores += sum(q.numel() * k.shape[1] for q, k, _, _ in mb["packed"]["mask"].buckets)
                else:
                    computed += mb["input_ids"].numel()
                    scores += mb["input_ids"].shape[0] * mb["input_ids"].shape[1] ** 2
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    matmul = 3 * flops_per_token(cfg) * computed  # forward and backward: 3x the forward's 2N
    attention = 12 * layers * cfg.num_attention_heads * cfg.head_dim * scores
    return {"s": statistics.median(times[warmup:]), "tokens": computed, "trained": sum(lengths),
            "gflop": (matmul + attention) / 1e9, "params": cfg.num_params(),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main():
    from common import print_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["256x4", "512x8", "1024x8"], help="HIDDENxLAYERS")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # size shape rows tokens: one, in this process
    args = ap.parse_args()
    if args.one:
        size, shape, rows_per, budget = args.one
        print(json.dumps(one(size, shape, int(rows_per), int(budget), args.steps, args.warmup)))
        return
    table = []
    for size in args.sizes:
        for shape in args.shapes:
            got = {k: [] for k in args.layouts}
            for r in range(args.rounds):
                for name in args.layouts:
                    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--warmup", str(args.warmup),
                           "--one", size, shape, *map(str, LAYOUTS[name])]
                    env = {**os.environ, "OMP_NUM_THREADS": "2"}
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if p.returncode:  # killed for memory (SIGKILL) or failed: a row that says so
                        why = ", killed (out of memory)" if p.returncode == -9 else ""
                        got[name].append({"failed": f"exit {p.returncode}{why}"})
                        print(p.stderr[-2000:], file=sys.stderr)
                    else:
                        got[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
                last = ", ".join(f"{k} {v[-1].get('s', v[-1].get('failed'))}" for k, v in got.items())
                print(f"{size} {shape} round {r + 1}: {last}", flush=True)
            base = [x["s"] for x in got.get("padded", []) if "s" in x]
            for name, runs in got.items():
                ok = [x for x in runs if "s" in x]
                if not ok:
                    table.append((size, shape, name, "-", "-", "-", runs[0]["failed"], "-", "-", "-"))
                    continue
                m = {f: statistics.median(x[f] for x in ok) for f in ok[0]}
                vs = f"{m['s'] / statistics.median(base):.2f}x" if base else "-"
                table.append((f"{m['params'] / 1e6:.1f}M ({size})", shape, name, f"{m['tokens']:.0f}",
                              f"{m['trained']:.0f}", f"{m['gflop']:.0f}", f"{m['s']:.3f}", vs,
                              f"{m['gflop'] / m['s']:.0f}", f"{m['rss']:.0f}"))
    print(f"\n{PROMPTS} prompts x {N_GEN} samples; forward + backward of one step's rows; medians of "
          f"{args.rounds} rounds x {args.steps} steps after {args.warmup} untimed, 2 threads\n")
    print_table(("model", "shape", "layout", "tokens computed", "completion tokens", "GFLOP", "s/step",
                 "vs padded", "GFLOP/s", "peak RSS MiB"), table)


if __name__ == "__main__":
    main()
