"""Where a PPO step's time goes, beside a GRPO step, on the default task with 2 ranks (colocate):
each script's default flags (GRPO: 64 prompts x 8 samples; PPO: 256 prompts x 1 sample, a critic,
a reference for the KL in the reward), and PPO once more with a Bradley-Terry reward model as a
second reward term. N steps each, no evaluation; reads each run's metrics.jsonl. Peak memory is
each run's peak RSS per rank (CPU) or peak allocated memory (GPU).

    python bench/ppo_phases.py [--steps 30] [--skip 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from assets.make import random_reward_model

PHASES = [("generate", "perf/generate_s"), ("reference", "perf/reference_s"),
          ("reward model", "perf/reward_model_s"), ("critic values", "perf/values_s"),
          ("critic update", "perf/critic_train_s"), ("actor update", "perf/train_s"), ("sync", "perf/sync_s")]

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--skip", type=int, default=3, help="first steps left out of the means (warm-up)")
a = ap.parse_args()

rows = []
with tempfile.TemporaryDirectory() as tmp:
    rm = os.path.join(tmp, "rm")  # a random reward model: its time does not depend on its weights
    random_reward_model(rm, os.path.join(ROOT, "assets/arith-tiny"))
    runs = [("GRPO (64 x 8)", "train_grpo.py", []),
            ("PPO (256 x 1)", "train_ppo.py", []),
            ("PPO + reward model", "train_ppo.py", ["--rewards", "accuracy", "rm", "--reward-model", rm])]
    for name, script, flags in runs:
        run = os.path.join(tmp, f"run{len(rows)}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script,
               "--steps", str(a.steps), "--eval-every", "0", "--save-every", "0", "--no-save-final",
               "--run-dir", run, *flags]
        print(" ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1800)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            ms = [m for m in map(json.loads, f) if not m.get("final")][a.skip:]
        mean = lambda k: statistics.mean(m.get(k, 0.0) for m in ms)  # noqa: E731
        completions = json.load(open(os.path.join(run, "config.json")))
        completions = completions["prompts_per_step"] * completions["num_generations"]
        rows.append((name, completions, mean("perf/step_s"), [mean(k) for _, k in PHASES],
                     max(m["perf/peak_mem_gib"] for m in ms)))

print(f"\nmeans over steps {a.skip + 1}..{a.steps} of each run, seconds per step (the slowest rank's); "
      "2 ranks, colocate, gloo\n")
head = "".join(f" {p:>13} |" for p, _ in PHASES)
print(f"| {'run':<18} | {'compl.':>6} | {'step s':>6} |{head} {'peak GiB':>8} |")
print(f"|{'-' * 20}|{'-' * 8}|{'-' * 8}|" + "".join(f"{'-' * 15}|" for _ in PHASES) + f"{'-' * 10}|")
for name, n, step, phases, mem in rows:
    cells = "".join(f" {s:13.3f} |" for s in phases)
    print(f"| {name:<18} | {n:6d} | {step:6.3f} |{cells} {mem:8.2f} |")
print("\ncompl.: completions per step over both ranks. The phases do not add up to the step: the reward "
      "rules, the advantages and the logging are the rest")
