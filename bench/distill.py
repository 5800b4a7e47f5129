"""On-policy distillation against RL (GRPO, 2 CPU ranks): RL alone, distillation alone
(--reward-weights 0) and both (--distill-coef 1 beside the accuracy reward), each seed, the same
number of steps and schedule. Prints held-out accuracy against steps and wall time (the mean over
seeds), the first evaluation at which a run reached the teacher's level (or a share of it), and the
teacher's forward seconds per step. Two tasks:

- arith (the default task): the 0.85M student assets/arith-tiny; the teacher assets/arith-teacher is
  the default 800-step RL run's final policy.
- carries (builtin:carries, docs/reasoning.md): the student assets/carries-tiny with
  bench/carries_learning.py's flags; the teacher assets/carries-teacher is an RL run's final policy
  (its recipe in docs/distill.md).

    python bench/distill.py [--task arith] [--steps 300] [--eval-every 50] [--seeds 0 1 2] [--level 0.9]
    python bench/distill.py --task carries --out runs/distill-carries     # 200 steps, every 25
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.carries_learning import MODEL as CARRIES_MODEL, TASK as CARRIES  # noqa: E402
from utils.logger import read_metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# task: (its flags with the student as --model, the teacher, default steps, default --eval-every)
TASKS = {"arith": ([], "assets/arith-teacher", 300, 50),
         "carries": (["--model", CARRIES_MODEL, *CARRIES], "assets/carries-teacher", 200, 25)}


def modes(teacher: str) -> dict[str, list[str]]:
    return {"RL alone": [], "distill alone": ["--teacher-model", teacher, "--reward-weights", "0"],
            "both": ["--teacher-model", teacher, "--distill-coef", "1"]}


def run(flags: list[str], steps: int, every: int, seed: int, out: str | None = None) -> list[dict]:
    """A run's metrics rows; with `out`, its directory is kept there, and read instead of run when
    it holds a finished run's metrics (its last row the final evaluation's)."""
    metrics = out and os.path.join(out, "metrics.jsonl")
    kept = read_metrics(metrics) if metrics and os.path.exists(metrics) else []
    if kept and kept[-1].get("final"):
        return kept
    with tempfile.TemporaryDirectory() as d:
        run_dir = out or d
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_grpo.py", *flags, "--steps", str(steps), "--eval-every", str(every),
               "--seed", str(seed), "--save-every", "0", "--no-save-final", "--run-dir", run_dir]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def teacher_accuracy(task: list[str], teacher: str, every: int, seeds: list[int]) -> float:
    """The teacher's held-out accuracy by the same evaluation as the runs' (a one-step run's step 0
    with --model the teacher), the mean over the seeds' evaluations (each seed samples its own)."""
    accs = []
    for seed in seeds:
        ms = run([*task, "--model", teacher], 1, every, seed)
        accs.append(next(m["eval/accuracy"] for m in ms if "eval/accuracy" in m))
    return statistics.mean(accs)


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
    ap.add_argument("--task", choices=TASKS, default="arith")
    ap.add_argument("--steps", type=int, default=None, help="default: arith 300, carries 200")
    ap.add_argument("--eval-every", type=int, default=None, help="default: arith 50, carries 25")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--level", type=float, default=0.9, help="also report reaching this share of the teacher")
    ap.add_argument("--out", default=None, help="keep each run's directory here (OUT/<mode>-seedN); a run "
                    "whose metrics.jsonl is already there is read, not run again")
    a = ap.parse_args()
    task, teacher, default_steps, default_every = TASKS[a.task]
    a.steps, a.eval_every = a.steps or default_steps, a.eval_every or default_every
    MODES = modes(teacher)
    goal = teacher_accuracy(task, teacher, a.eval_every, a.seeds)
    print(f"teacher {teacher}: held-out accuracy {goal:.3f} (the mean over seeds {a.seeds})", flush=True)
    curves, teacher_s = {}, {}
    for mode, flags in MODES.items():
        for seed in a.seeds:
            out = a.out and os.path.join(a.out, f"{mode.replace(' ', '-')}-seed{seed}")
            ms = run([*task, *flags], a.steps, a.eval_every, seed, out)
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
