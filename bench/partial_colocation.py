"""G-Core's partial colocation against full colocation, on the judge workload: the default task
with the tiny generative judge (assets/judge-tiny) as a second reward term, 2 ranks (--nproc).

  full colocation  every rank samples its own prompts, then judges them (the judge's weights
                   loaded for it and released after), taking turns on its device
  partial S, G     the first S ranks sample every prompt while the other G judge finished chunks
                   as they land (--judge-chunk prompts at a time); all train

Reports per step (means after the warm-up, the slowest rank's): the rollout with judging (the
time from the first prompt to the last score; perf/rollout_judge_s), the whole step, and the
placement metrics. N steps each, no evaluation.

    python bench/partial_colocation.py [--steps 12] [--skip 2] [--judge-samples 4] [--chunks 2 8]
        [--nproc 2 --sampler-ranks 1]
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
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--skip", type=int, default=2, help="first steps left out of the means (warm-up)")
ap.add_argument("--judge-samples", type=int, default=4)
ap.add_argument("--chunks", type=int, nargs="+", default=[2, 8], help="--judge-chunk values for partial")
ap.add_argument("--prompts-per-step", type=int, default=64)
ap.add_argument("--model", default="assets/arith-tiny",
                help="the policy (a random one writes long completions)")
ap.add_argument("--max-new-tokens", type=int, default=8)
ap.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
ap.add_argument("--sampler-ranks", type=int, default=1, help="partial: S (the other ranks judge)")
a = ap.parse_args()
S, G = a.sampler_ranks, a.nproc - a.sampler_ranks

JUDGE = ["--rewards", "accuracy", "judge", "--reward-weights", "1", "0.5",
         "--judge-model", "assets/judge-tiny", "--judge-samples", str(a.judge_samples)]
runs = [("full colocation", [])]
for chunk in a.chunks:
    runs.append((f"partial S={S} G={G}, chunk {chunk}", ["--placement", "partial", "--sampler-ranks", str(S),
                                                         "--judge-chunk", str(chunk)]))
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for name, flags in runs:
        run = os.path.join(tmp, f"run{len(rows)}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
               "train_grpo.py",
               "--steps", str(a.steps), "--eval-every", "0", "--save-every", "0", "--no-save-final",
               "--prompts-per-step", str(a.prompts_per_step), "--model", a.model,
               "--max-new-tokens", str(a.max_new_tokens), "--run-dir", run, *JUDGE, *flags]
        print(" ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=3600)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            ms = [m for m in map(json.loads, f) if not m.get("final")][a.skip:]
        mean = lambda k: statistics.mean(m.get(k, 0.0) for m in ms)  # noqa: E731
        rows.append((name, mean("perf/rollout_judge_s"), mean("perf/step_s"), mean("placement/idle_share"),
                     mean("placement/sampler_busy_s"), mean("placement/judge_busy_s"),
                     mean("rollout/reward/judge")))

base = rows[0][1]
print(f"\n{a.model}, {a.prompts_per_step} prompts x 8 samples of up to {a.max_new_tokens} tokens per step, "
      f"{a.judge_samples} verdicts per completion; means over "
      f"steps {a.skip + 1}..{a.steps}, seconds per step; {a.nproc} ranks on {os.cpu_count()} cores, gloo\n")
print(f"| {'placement':<28} | {'rollout+judge s':>15} | {'vs full':>7} | {'step s':>6} | {'idle share':>10} "
      f"| {'sampler busy s':>14} | {'judge busy s':>12} | {'judge term':>10} |")
print(f"|{'-' * 30}|{'-' * 17}|{'-' * 9}|{'-' * 8}|{'-' * 12}|{'-' * 16}|{'-' * 14}|{'-' * 12}|")
for name, rollout, step, idle, sampler, judge, term in rows:
    print(f"| {name:<28} | {rollout:15.3f} | {100 * (rollout / base - 1):+6.1f}% | {step:6.3f} "
          f"| {idle:10.3f} | {sampler:14.3f} | {judge:12.3f} | {term:10.3f} |")
print("\nsampler / judge busy: seconds per rank in that role (partial only); idle share: device time with "
      "nothing to do, over all ranks")
