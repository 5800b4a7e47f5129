"""LoRA against full fine-tuning on the default task (GRPO, 2 CPU ranks, the shipped tiny model):
a learning-rate sweep of LoRA on seed 0, then full fine-tuning and LoRA at the best rate on every
seed, at the same number of steps. Prints held-out accuracy at the end, its mean over the seeds,
and each run's training seconds per step and peak memory.

    python bench/lora.py [--steps 200] [--seeds 0 1 2] [--rank 8] [--lrs 1e-3 3e-3 1e-2]
"""
import argparse
import json
import os
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    ap.add_argument("--full-lr", type=float, default=3e-4, help="the default run's")
    a = ap.parse_args()
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
