"""Flow-GRPO on the built-in shapes task (train_flow_grpo.py, 2 CPU ranks, assets/flow-tiny, the
default rewards colour + compressibility): the held-out reward (ODE, 40 steps, the 72 prompts of the
grid) at the start and the end of each seed's run, its wall time and the seconds per step split
into sampling, scoring, the reference and training; then the samplers on the same budget:
flow_grpo's SDE, dance_grpo's, and MixGRPO's window (--window 4 of the 10 steps).

    python bench/flow.py [--steps 30] [--seeds 0 1 2] [--compare-seeds 0]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLERS = {"flow_grpo": [], "dance_grpo": ["--sde", "dance_grpo"], "flow_grpo --window 4": ["--window", "4"]}
PHASES = ("sample", "reward", "reference", "train", "eval")


def run(flags: list[str], steps: int, seed: int) -> tuple[list[dict], float]:
    """(metrics.jsonl rows, wall seconds of the whole launch)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_flow_grpo.py", "--steps", str(steps), "--eval-every", str(steps), "--seed", str(seed),
               "--no-save-final", *flags, "--run-dir", d]
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t
        if p.returncode:
            sys.exit(p.stderr[-3000:])
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], wall


def summary(rows: list[dict]) -> dict:
    steps = [r for r in rows if "perf/step_s" in r]
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    out = {"start": evals[0], "end": evals[-1],
           "train_first5": statistics.mean(r["rollout/reward"] for r in steps[:5]),
           "train_last5": statistics.mean(r["rollout/reward"] for r in steps[-5:]),
           "step_s": statistics.median(r["perf/step_s"] for r in steps)}
    for phase in PHASES:
        out[phase] = statistics.median(r.get(f"perf/{phase}_s", 0.0) for r in steps)
    final = next(r for r in rows if r.get("final"))
    out.update({k.split(":")[-1]: v for k, v in final.items() if k.startswith("eval/reward/")})
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--compare-seeds", type=int, nargs="+", default=[0])
    a = ap.parse_args()
    results = {}
    for name, flags in SAMPLERS.items():
        for seed in a.seeds if name == "flow_grpo" else a.compare_seeds:
            rows, wall = run(flags, a.steps, seed)
            results[name, seed] = {**summary(rows), "wall_s": wall}
            print(json.dumps({"sampler": name, "seed": seed, **results[name, seed]}), flush=True)

    print(f"\n{a.steps} steps, 8 prompts x 8 images, 10 SDE steps, 2 ranks; held-out reward (ODE, 40 "
          f"steps, 72 prompts) start -> end, its colour and compressibility terms at the end; training "
          f"reward (first 5 -> last 5 steps); median seconds per step by phase; wall time of the launch")
    print(f"{'sampler':<22}{'seed':>5}{'held-out':>17}{'colour':>8}{'compress':>10}{'train':>16}"
          + "".join(f"{p:>10}" for p in PHASES) + f"{'step s':>8}{'wall s':>8}")
    for (name, seed), r in results.items():
        print(f"{name:<22}{seed:>5}{r['start']:>8.3f} -> {r['end']:.3f}{r.get('colour', 0):>8.3f}"
              f"{r.get('compressibility', 0):>10.3f}{r['train_first5']:>7.3f} -> {r['train_last5']:.3f}"
              + "".join(f"{r[p]:>10.2f}" for p in PHASES) + f"{r['step_s']:>8.2f}{r['wall_s']:>8.0f}")
