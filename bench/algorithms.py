"""The algorithm menu on the default task: held-out accuracy after the same number of steps for
each algorithm, over seeds, and its step time relative to GRPO's. Each run is train_grpo.py with
the default flags (64 prompts x 8 samples, the shipped tiny model, the LR decaying to 0 at the
last step) and the algorithm's own; the accuracy is the final policy's on the 256 held-out
prompts (about +-0.03 of sampling noise alone).

    python bench/algorithms.py [--steps 200] [--seeds 0 1 2] [--only GRPO RLOO ...]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = [  # (name, flags): one visible choice each; see the README's table for the papers
    ("GRPO", []),
    ("Dr. GRPO", ["--no-scale-std", "--loss-agg", "constant"]),
    ("DAPO overlong", ["--overlong-buffer", "4", "--mask-truncated"]),
    ("GSPO", ["--policy-loss", "gspo", "--loss-agg", "sequence"]),
    ("CISPO", ["--policy-loss", "cispo"]),
    ("dual-clip PPO", ["--policy-loss", "dual_clip"]),
    ("RLOO", ["--advantage", "rloo"]),
    ("REINFORCE++", ["--advantage", "reinforce++", "--kl-coef", "0.01", "--kl-estimator", "k1"]),
    ("REINFORCE++ baseline", ["--advantage", "reinforce++_baseline", "--kl-coef", "0.01",
                              "--kl-estimator", "k1"]),
    ("ReMax", ["--advantage", "remax"]),
    ("decoupled + TIS", ["--mismatch", "tis"]),
    ("decoupled + MIS (seq)", ["--mismatch", "mis", "--mismatch-level", "sequence"]),
    ("decoupled + IcePop", ["--mismatch", "icepop"]),
]

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
ap.add_argument("--only", nargs="+", default=None, help="names of the algorithms to run (default: all)")
a = ap.parse_args()

rows = []
with tempfile.TemporaryDirectory() as tmp:
    for name, flags in ALGORITHMS:
        if a.only and name not in a.only:
            continue
        accuracy, step_s = [], []
        for seed in a.seeds:
            run = os.path.join(tmp, f"{len(rows)}-{seed}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "train_grpo.py", "--steps", str(a.steps), "--eval-every", str(a.steps),
                   "--save-every", "0", "--no-save-final", "--seed", str(seed), "--run-dir", run, *flags]
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=3600)
            with open(os.path.join(run, "metrics.jsonl")) as f:
                ms = list(map(json.loads, f))
            accuracy.append(ms[-1]["eval/accuracy"])
            step_s.append(statistics.median(m["perf/step_s"] for m in ms if "perf/step_s" in m))
            print(f"{name:<22} seed {seed}: held-out {accuracy[-1]:.3f}, {step_s[-1]:.3f} s/step", flush=True)
        rows.append((name, " ".join(flags) or "(defaults)", accuracy, statistics.mean(step_s)))

grpo_s = rows[0][3] if rows and rows[0][0] == "GRPO" else None
print(f"\nheld-out accuracy of the final policy after {a.steps} steps, seeds {a.seeds}; "
      "step time: median per run, mean over seeds; 2 ranks, colocate, 2 CPU cores\n")
print(f"| {'algorithm':<22} | {'flags':<62} | {'mean':>5} | {'min..max':>11} | {'s/step':>6} "
      f"| {'vs GRPO':>7} |")
print(f"|{'-' * 24}|{'-' * 64}|{'-' * 7}|{'-' * 13}|{'-' * 8}|{'-' * 9}|")
for name, flags, acc, s in rows:
    relative = f"{s / grpo_s:.2f}x" if grpo_s else "-"
    spread = f"{min(acc):.3f}..{max(acc):.3f}"
    mean = statistics.mean(acc)
    print(f"| {name:<22} | {flags:<62} | {mean:5.3f} | {spread:>11} | {s:6.3f} | {relative:>7} |")
