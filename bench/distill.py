"""On-policy distillation against RL on the default task (GRPO, 2 CPU ranks, the 0.85M student
assets/arith-tiny; the teacher assets/arith-teacher is the default 800-step RL run's final policy,
held-out accuracy 0.758): RL alone, distillation alone (--reward-weights 0) and both (--distill-coef
1 beside the accuracy reward), each seed, the same number of steps and schedule. Prints held-out
accuracy against steps and wall time (the mean over seeds), the first evaluation at which a run
reached the teacher's level (or a share of it), and the teacher's forward seconds per step.

    python bench/distill.py [--steps 300] [--eval-every 50] [--seeds 0 1 2] [--level 0.9]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER = "assets/arith-teacher"
MODES = {"RL alone": [], "distill alone": ["--teacher-model", TEACHER, "--reward-weights", "0"],
         "both": ["--teacher-model", TEACHER, "--distill-coef", "1"]}


def run(flags: list[str], steps: int, every: int, seed: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_grpo.py", "--steps", str(steps), "--eval-every", str(every), "--seed", str(seed),
               "--save-every", "0", "--no-save-final", *flags, "--run-dir", d]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def teacher_accuracy(every: int) -> float:
    """The teacher's held-out accuracy, by the same evaluation (its step 0, one step run)."""
    ms = run(["--model", TEACHER], 1, every, 0)
    return next(m["eval/accuracy"] for m in ms if "eval/accuracy" in m)


def curve(ms: list[dict]) -> list[tuple[int, float, float]]:
    """(step, seconds since the run's start, held-out accuracy) at each evaluation."""
    out, elapsed = [], 0.0
    for m in ms:
        if "eval/accuracy" in m:
            out.append((m["step"], elapsed, m["eval/accuracy"]))
        elapsed += m.get("perf/step_s", 0.0)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--level", type=float, default=0.9, help="also report reaching this share of the teacher")
    a = ap.parse_args()
    goal = teacher_accuracy(a.eval_every)
    print(f"teacher {TEACHER}: held-out accuracy {goal:.3f}", flush=True)
    curves, teacher_s = {}, {}
    for mode, flags in MODES.items():
        for seed in a.seeds:
            ms = run(flags, a.steps, a.eval_every, seed)
            curves[mode, seed] = curve(ms)
            seconds = [m["perf/teacher_s"] for m in ms if "perf/teacher_s" in m]
            if seconds:
                teacher_s[mode, seed] = statistics.median(seconds)
            print(json.dumps({"mode": mode, "seed": seed, "curve": curves[mode, seed]}), flush=True)

    print(f"\nheld-out accuracy, mean over seeds {a.seeds} (teacher {goal:.3f}); seconds: mean wall time of "
          f"the steps before it")
    steps = [s for s, _, _ in curves["RL alone", a.seeds[0]]]
    print(f"{'step':>6} " + " ".join(f"{mode:>22}" for mode in MODES))
    for i, step in enumerate(steps):
        cells = []
        for mode in MODES:
            accs = [curves[mode, s][i][2] for s in a.seeds]
            secs = statistics.mean(curves[mode, s][i][1] for s in a.seeds)
            cells.append(f"{statistics.mean(accs):.3f} ({min(accs):.3f}-{max(accs):.3f}) {secs:4.0f}s")
        print(f"{step:>6} " + " ".join(f"{c:>22}" for c in cells))
    for share in (1.0, a.level):
        print(f"\nfirst evaluation at {share:.0%} of the teacher's accuracy ({share * goal:.3f}), per seed:")
        for mode in MODES:
            hits = []
            for s in a.seeds:
                hit = next(((st, sec) for st, sec, acc in curves[mode, s] if acc >= share * goal), None)
                hits.append(f"step {hit[0]} ({hit[1]:.0f}s)" if hit else "not reached")
            print(f"  {mode:<14} " + ", ".join(hits))
    if teacher_s:
        print(f"\nthe teacher's forward: median {statistics.median(teacher_s.values()):.3f} s a step")
