"""GRPO on the reasoning workload (builtin:carries, issue 52): does RL lift the tiny model's
held-out accuracy, how fast, and what happens to its completions' lengths? For each seed, a run of
train_grpo.py on 2 CPU ranks from assets/carries-tiny; then the start and each run's final policy
sampled on the held-out problems (8 samples each, temperature 1, assets.carries.sample_stats).
Prints the learning table (held-out accuracy at step 0, at the last evaluation within 10 minutes of
steps, the issue's bar, and at the end) and the length table, and draws the picture (held-out
accuracy against seconds, and the completion lengths before and after).

    python bench/carries_learning.py                      # 3 seeds, ~11 min each on 2 cores (270 steps)
    python bench/carries_learning.py --seeds 0 --steps 50 --out runs/carries-short   # a quick look
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from assets.carries import MAX_NEW_TOKENS, sample_stats  # noqa: E402
from bench.common import print_table  # noqa: E402
from utils.logger import read_metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "assets", "carries-tiny")
TASK = ["--dataset", "builtin:carries", "--max-new-tokens", str(MAX_NEW_TOKENS), "--prompts-per-step", "16",
        "--num-generations", "8", "--lr", "2e-4", "--micro-batch-size", "8", "--eval-prompts", "128"]
FLAGS = ["--model", MODEL, *TASK, "--eval-every", "25", "--save-every", "0"]
BAR_S = 600  # issue 52's bar: a lift of 0.3 within 10 minutes of steps


def train(run_dir: str, seed: int, steps: int, extra: list[str]) -> float:
    """One GRPO run on 2 ranks; returns its wall seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "train_grpo.py"), *FLAGS, "--steps", str(steps), "--seed", str(seed),
           "--run-dir", run_dir, *extra]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.time() - t0


def curve(run_dir: str) -> list[tuple[int, float, float]]:
    """[(step, seconds so far (the steps' perf/step_s summed), held-out accuracy)] of a run."""
    out, seconds = [], 0.0
    for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")):
        seconds += r.get("perf/step_s", 0.0)
        if "eval/accuracy" in r:
            out.append((r["step"], seconds, r["eval/accuracy"]))
    return out


def draw(path: str, curves: dict, before: list[int], after: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for seed, points in curves.items():
        a.plot([s for _, s, _ in points], [acc for _, _, acc in points], marker="o", label=f"seed {seed}")
    a.set(xlabel="seconds of training (2 CPU ranks)", ylabel="held-out accuracy (temperature 1)",
          title="GRPO on builtin:carries")
    a.axvline(BAR_S, color="gray", linestyle="--", linewidth=1, label="10 minutes")
    a.legend()
    bins = list(range(0, MAX_NEW_TOKENS + 17, 16))
    b.hist(before, bins=bins, alpha=0.5, label="before RL (assets/carries-tiny)")
    for seed, lengths in after.items():
        b.hist(lengths, bins=bins, histtype="step", linewidth=1.5, label=f"after RL, seed {seed}")
    b.set(xlabel="completion length (tokens)", ylabel="held-out samples", yscale="log",
          title="completion lengths, 8 samples of 256 held-out problems")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=270)  # ~2.2-2.4 s a step: about 10 minutes (BAR_S)
    ap.add_argument("--out", default="runs/carries")
    ap.add_argument("--picture", default=None, help="default: OUT/carries-run.png")
    ap.add_argument("--reuse", action="store_true",
                    help="a seed whose OUT/seedN/final exists is not trained again")
    ap.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="more flags for train_grpo.py")
    a = ap.parse_args()
    start = sample_stats(MODEL, keep_lengths=True)
    curves, finals, walls = {}, {}, {}
    for seed in a.seeds:
        run_dir = os.path.join(a.out, f"seed{seed}")
        reused = a.reuse and os.path.isdir(os.path.join(run_dir, "final"))
        walls[seed] = None if reused else train(run_dir, seed, a.steps, a.flags)
        curves[seed] = curve(run_dir)
        finals[seed] = sample_stats(os.path.join(run_dir, "final"), keep_lengths=True)
    rows = []
    for seed in a.seeds:
        points = curves[seed]
        first, last = points[0][2], points[-1][2]
        step, _, acc = [p for p in points if p[1] <= BAR_S][-1]  # the last evaluation within the bar's time
        rows.append((f"{seed}", f"{first:.3f}", f"{acc:.3f} (step {step})", f"{acc - first:+.3f}",
                     f"{last:.3f}", f"{last - first:+.3f}", f"{points[-1][1]:.0f}",
                     "-" if walls[seed] is None else f"{walls[seed]:.0f}", f"{points[-1][1] / a.steps:.2f}"))
    print_table(("seed", "held-out acc. at step 0", f"within {BAR_S} s", "lift", f"at step {a.steps}", "lift",
                 "train s", "wall s", "s/step"), rows)
    table = [("before RL", start)] + [(f"after RL, seed {s}", finals[s]) for s in a.seeds]
    print_table(("policy", "accuracy", "pass@8", "length mean", "median", "p95", "max", "p95/median"),
                [(name, f"{st['accuracy']:.3f}", f"{st['pass@8']:.3f}", f"{st['length_mean']:.0f}",
                  f"{st['length_median']:.0f}", f"{st['length_p95']}", f"{st['length_max']}",
                  f"{st['length_p95'] / st['length_median']:.1f}") for name, st in table])
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"curves": curves, "start": start, "finals": finals, "walls": walls,
                   "flags": FLAGS + a.flags}, f)
    draw(a.picture or os.path.join(a.out, "carries-run.png"), curves, start["lengths"],
         {s: finals[s]["lengths"] for s in a.seeds})


if __name__ == "__main__":
    main()
