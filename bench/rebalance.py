"""Dynamic placement against the best static split, 4 CPU ranks.

--placement disaggregate (default), on a workload whose balance shifts: one step of staleness
(generation overlaps training), a random 2.5M-param model whose completions run to
--max-new-tokens (the rollout ranks' work), scored by `bench.common:slowing_reward`, a scorer that
gets slower as the run goes (the trainers' work, nothing for the first --slow-from of the run, then
rising to --slow-s seconds per completion by the end: generation-bound at first, then
training-bound). Runs each static split that fits 4 ranks (3 trainers + 1 rollout rank, 2 + 2),
the dynamic run (--rebalance, starting from 2 + 2, moving in process) and the same by restart
(--rebalance-restart).

--placement partial: G-Core's partial colocation with the tiny generative judge (assets/judge-tiny,
--judge-samples verdicts per completion) on the built-in task: each static sampler/judge split
S + G = 4 and the dynamic run from S = --start (--rebalance, S:G moves in process).

Prints each run's total time (start-up and moves included), mean step time, idle share
(placement/idle_share: the share of all ranks' time in which a device had nothing to do, weighted
by step time) and its moves.

    python bench/rebalance.py [--steps 100] [--placement partial --steps 60 --gap 10]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import qwen2_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--slow-s", type=float, default=0.1, help="the scorer's seconds per completion at the end")
ap.add_argument("--slow-from", type=float, default=0.5, help="the share of the run before the scorer slows")
ap.add_argument("--max-new-tokens", type=int, default=160)
ap.add_argument("--gap", type=int, default=50, help="--rebalance-gap: the horizon a move must pay back in")
ap.add_argument("--placement", choices=["disaggregate", "partial"], default="disaggregate")
ap.add_argument("--judge-samples", type=int, default=4, help="partial: verdicts per completion")
ap.add_argument("--start", type=int, default=3, help="partial: the dynamic run's first S (the judges: 4 - S)")
a = ap.parse_args()
DYNAMIC = ["--rebalance", "--rebalance-window", "5", "--rebalance-gap", str(a.gap)]
RUNS = [("static 3 + 1", ["--rollout-ranks", "1"]), ("static 2 + 2", ["--rollout-ranks", "2"]),
        ("dynamic from 2 + 2", ["--rollout-ranks", "2", *DYNAMIC]),
        ("dynamic from 2 + 2, by restart", ["--rollout-ranks", "2", *DYNAMIC, "--rebalance-restart"])]
WORKLOAD = ["--model", "MODEL", "--max-new-tokens", str(a.max_new_tokens), "--lr", "1e-5",
            "--rewards", "bench.common:slowing_reward", "--placement", "disaggregate", "--max-staleness", "1"]
if a.placement == "partial":
    RUNS = [(f"static S={s} G={4 - s}", ["--sampler-ranks", str(s)]) for s in (1, 2, 3)]
    RUNS.append((f"dynamic from S={a.start} G={4 - a.start}", ["--sampler-ranks", str(a.start), *DYNAMIC]))
    WORKLOAD = ["--rewards", "accuracy", "judge", "--reward-weights", "1", "0.5", "--judge-model",
                "assets/judge-tiny", "--judge-samples", str(a.judge_samples), "--placement", "partial"]


def run(tmp, name, flags):
    run_dir = os.path.join(tmp, name.replace(" ", "_").replace("+", ""))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLOW_FILE": os.path.join(run_dir + ".scored"),
           "SLOW_COMPLETIONS": str(a.steps * 12 * 4), "SLOW_S": str(a.slow_s), "SLOW_FROM": str(a.slow_from),
           "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "--max-restarts=3", "train_grpo.py", "--steps", str(a.steps), "--prompts-per-step", "12",
           "--num-generations", "4", "--eval-every", "0", "--save-every", "0", "--no-save-final",
           *[model if f == "MODEL" else f for f in WORKLOAD], "--run-dir", run_dir, *flags]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    total = time.perf_counter() - t
    if p.returncode:
        sys.exit(f"{name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if not r.get("final") and not r.get("event")]
    step_s = sum(r["perf/step_s"] for r in steps)
    idle = sum(r["placement/idle_share"] * r["perf/step_s"] for r in steps) / step_s
    q = len(steps) // 4
    first, last = (sum(r["perf/step_s"] for r in part) / len(part) for part in (steps[:q], steps[-q:]))
    moves = []
    if os.path.isfile(os.path.join(run_dir, "placement.json")):
        moves = json.load(open(os.path.join(run_dir, "placement.json")))["moves"]
    moved = [r["placement/move_s"] for r in rows if r.get("event") == "placement/moved"]
    return {"total": total, "step": step_s / len(steps), "idle": idle, "first": first, "last": last,
            "moves": [(m["step"], m["from"], m["to"]) for m in moves], "move_s": moved}


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model")
    qwen2_checkpoint(model)
    results = {name: run(tmp, name, flags) for name, flags in RUNS}

if a.placement == "partial":
    print(f"\n4 ranks, partial placement, {a.steps} steps of 12 prompts x 4 samples, the tiny judge with "
          f"{a.judge_samples} verdicts per completion\n")
else:
    print(f"\n4 ranks, {a.steps} steps of 12 prompts x 4 samples x {a.max_new_tokens} tokens, "
          f"--max-staleness 1; the scorer's seconds per completion rise from 0 at {a.slow_from:.0%} of the "
          f"run to {a.slow_s} at its end\n")
side = "S -> S'" if a.placement == "partial" else "K -> K'"
print("| run | total s | mean step s | first quarter s/step | last quarter s/step | idle share "
      f"| moves (after step: {side}) | move s |")
print("|---|---|---|---|---|---|---|---|")
for name, r in results.items():
    moves = ", ".join(f"{s}: {f} -> {t}" for s, f, t in r["moves"]) or "-"
    move_s = ", ".join(f"{s:.1f}" for s in r["move_s"]) or "-"
    print(f"| {name} | {r['total']:.1f} | {r['step']:.3f} | {r['first']:.3f} | {r['last']:.3f} "
          f"| {r['idle']:.1%} | {moves} | {move_s} |")
static = min((r for n, r in results.items() if n.startswith("static")), key=lambda r: r["total"])
dyn = next(r for n, r in results.items() if n.startswith("dynamic"))
print(f"\nbest static: {static['total']:.1f} s, idle {static['idle']:.1%}; dynamic: {dyn['total']:.1f} s "
      f"({dyn['total'] / static['total'] - 1:+.1%}), idle {dyn['idle']:.1%} "
      f"({dyn['idle'] / static['idle']:.2f}x) "
      f"(goal, disaggregate: idle at most 0.5x the best static's, total at least 5% below it)")
