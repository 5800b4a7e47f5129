"""Dynamic sampling late in training: from a policy that already solves most of the default
task (the default run's final model), many groups are all correct and carry no GRPO signal.
Without the filter they are trained on with advantage 0 (wasted); with --dynamic-sampling the
waves refill them. Reports per step (means after the warm-up): waves, groups generated and
informative, generation seconds, and generation seconds per informative group trained on.

    torchrun --standalone --nproc-per-node 2 train_grpo.py      # first: the default run -> runs/grpo/final
    python bench/dynamic_sampling.py [--model runs/grpo/final] [--steps 12] [--skip 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=os.path.join(ROOT, "runs/grpo/final"))
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--skip", type=int, default=2, help="first steps left out of the means (warm-up)")
a = ap.parse_args()
if not os.path.isfile(os.path.join(a.model, "config.json")):
    sys.exit(f"{a.model} is not a checkpoint: run the default job first (torchrun --standalone "
             "--nproc-per-node 2 train_grpo.py), or pass --model DIR")

rows = []
with tempfile.TemporaryDirectory() as tmp:
    for name, flags in [("no filter", []), ("dynamic sampling", ["--dynamic-sampling"])]:
        run = os.path.join(tmp, f"run{len(rows)}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_grpo.py",
               "--model", a.model, "--steps", str(a.steps), "--eval-every", "0", "--save-every", "0",
               "--no-save-final", "--lr", "1e-5", "--warmup-steps", "0", "--run-dir", run, *flags]
        print(" ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=3600)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            ms = [m for m in map(json.loads, f) if not m.get("final")][a.skip:]
        config = json.load(open(os.path.join(run, "config.json")))
        groups = config["prompts_per_step"]
        mean = lambda k, default=0.0: statistics.mean(m.get(k, default) for m in ms)  # noqa: E731
        if flags:
            generated, informative = mean("rollout/ds_groups_generated"), mean("rollout/ds_groups_kept")
            waves = mean("rollout/ds_waves")
        else:  # every group is trained on; those whose rewards agree have advantage 0
            generated, informative = groups, groups * (1 - mean("rollout/groups_all_same"))
            waves = 1
        gen = mean("perf/generate_s")
        rows.append((name, waves, generated, informative, gen, gen / informative, mean("perf/step_s"),
                     mean("rollout/reward")))

print(f"\n{a.model}, default flags (64 prompts x 8), lr 1e-5; means over steps {a.skip + 1}..{a.steps}; "
      "2 ranks, colocate, gloo\n")
print(f"| {'run':<17} | {'waves':>5} | {'groups made':>11} | {'informative trained':>19} "
      f"| {'generate s':>10} | {'gen s / informative group':>25} | {'step s':>6} | {'reward':>6} |")
print(f"|{'-' * 19}|{'-' * 7}|{'-' * 13}|{'-' * 21}|{'-' * 12}|{'-' * 27}|{'-' * 8}|{'-' * 8}|")
for name, waves, made, useful, gen, per, step, reward in rows:
    print(f"| {name:<17} | {waves:5.2f} | {made:11.1f} | {useful:19.1f} | {gen:10.3f} | {per:25.4f} "
          f"| {step:6.3f} | {reward:6.3f} |")
print("\nreward: the mean over the trained batch (with the filter: informative groups and any padding)")
