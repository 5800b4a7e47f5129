"""Step time and where it goes, colocate vs disaggregate, on the default task with 2 ranks:
the default run's flags (64 prompts x 8 samples per step, the shipped tiny model), N steps
each, no evaluation. Reads each run's metrics.jsonl.

    python bench/placement_modes.py [--steps 30] [--skip 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISAGG = ["--placement", "disaggregate", "--rollout-ranks", "1"]
RUNS = [("colocate, 2 ranks", ["--placement", "colocate"]),
        ("disaggregate 1+1, S=0", [*DISAGG, "--max-staleness", "0"]),
        ("disaggregate 1+1, S=1", [*DISAGG, "--max-staleness", "1"])]

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--skip", type=int, default=3, help="first steps left out of the means (warm-up)")
a = ap.parse_args()

rows = []
with tempfile.TemporaryDirectory() as tmp:
    for name, flags in RUNS:
        run = os.path.join(tmp, name.split(",")[0] + flags[-1])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_grpo.py", "--steps", str(a.steps), "--eval-every", "0", "--save-every", "0",
               "--no-save-final", "--run-dir", run, *flags]
        print(" ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1800)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            ms = [m for m in map(json.loads, f) if not m.get("final")][a.skip:]
        mean = lambda k: statistics.mean(m[k] for m in ms)  # noqa: E731
        rows.append((name, mean("perf/step_s"), mean("perf/generate_s"), mean("perf/train_s"),
                     mean("perf/sync_s"), mean("placement/trainer_idle_s") / mean("perf/step_s"),
                     mean("placement/rollout_idle_s") / mean("perf/step_s"), mean("placement/idle_share"),
                     max(m["placement/staleness_max"] for m in ms), mean("rollout/reward")))

print(f"\nmeans over steps {a.skip + 1}..{a.steps} of each run; 2 CPU cores, gloo\n")
print(f"| {'placement':<22} | {'step s':>6} | {'gen/wait s':>10} | {'train s':>7} | {'sync s':>6} | "
      f"{'trainer idle':>12} | {'rollout idle':>12} | {'device idle':>11} | {'stale':>5} | {'reward':>6} |")
print(f"|{'-' * 24}|{'-' * 8}|{'-' * 12}|{'-' * 9}|{'-' * 8}|{'-' * 14}|{'-' * 14}|{'-' * 13}|"
      f"{'-' * 7}|{'-' * 8}|")
for r in rows:
    print(f"| {r[0]:<22} | {r[1]:6.3f} | {r[2]:10.3f} | {r[3]:7.3f} | {r[4]:6.3f} | {r[5]:12.0%} "
          f"| {r[6]:12.0%} | {r[7]:11.0%} | {r[8]:5.0f} | {r[9]:6.3f} |")
print("\ngen/wait: colocate generates on each rank; disaggregate waits for its rollout rank's samples. "
      "trainer/rollout idle: share of the step each role waits (colocate: while the other role has the "
      "device). device idle: share of all ranks' time in which a device had nothing to do "
      "(placement/idle_share)")
