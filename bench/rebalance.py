"""Dynamic placement against the best static split, on a workload whose balance shifts: 4 CPU
ranks, disaggregated, one step of staleness (generation overlaps training), a random 2.5M-param
model whose completions run to --max-new-tokens (the rollout ranks' work), scored by
`bench.common:slowing_reward`, a scorer that gets slower as the run goes (the trainers' work,
nothing for the first --slow-from of the run, then rising to --slow-s seconds per completion by
the end: generation-bound at first, then training-bound). Runs
each static split that fits 4 ranks (3 trainers + 1 rollout rank, 2 + 2) and the dynamic run
(--rebalance, starting from 2 + 2), and prints each one's total time (start-up and moves
included), mean step time, idle share (placement/idle_share: the share of all ranks' time in
which a device had nothing to do, weighted by step time) and its moves.

    python bench/rebalance.py [--steps 100]
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
a = ap.parse_args()
RUNS = [("static 3 + 1", ["--rollout-ranks", "1"]), ("static 2 + 2", ["--rollout-ranks", "2"]),
        ("dynamic from 2 + 2", ["--rollout-ranks", "2", "--rebalance", "--rebalance-window", "5",
                                "--rebalance-gap", str(a.gap)])]


def run(tmp, name, flags):
    run_dir = os.path.join(tmp, name.replace(" ", "_").replace("+", ""))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLOW_FILE": os.path.join(run_dir + ".scored"),
           "SLOW_COMPLETIONS": str(a.steps * 12 * 4), "SLOW_S": str(a.slow_s), "SLOW_FROM": str(a.slow_from),
           "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "--max-restarts=3", "train_grpo.py", "--model", model, "--steps", str(a.steps),
           "--prompts-per-step", "12",
           "--num-generations", "4", "--max-new-tokens", str(a.max_new_tokens), "--eval-every", "0",
           "--save-every", "0", "--no-save-final", "--lr", "1e-5",
           "--rewards", "bench.common:slowing_reward",
           "--placement", "disaggregate", "--max-staleness", "1", "--run-dir", run_dir, *flags]
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

print(f"\n4 ranks, {a.steps} steps of 12 prompts x 4 samples x {a.max_new_tokens} tokens, --max-staleness 1; "
      f"the scorer's seconds per completion rise from 0 at {a.slow_from:.0%} of the run to {a.slow_s} "
      f"at its end\n")
print("| run | total s | mean step s | first quarter s/step | last quarter s/step | idle share "
      "| moves (after step: K -> K') | move s |")
print("|---|---|---|---|---|---|---|---|")
for name, r in results.items():
    moves = ", ".join(f"{s}: {f} -> {t}" for s, f, t in r["moves"]) or "-"
    move_s = ", ".join(f"{s:.1f}" for s in r["move_s"]) or "-"
    print(f"| {name} | {r['total']:.1f} | {r['step']:.3f} | {r['first']:.3f} | {r['last']:.3f} "
          f"| {r['idle']:.1%} | {moves} | {move_s} |")
static = min((r for n, r in results.items() if n.startswith("static")), key=lambda r: r["total"])
dyn = results["dynamic from 2 + 2"]
print(f"\nbest static: {static['total']:.1f} s, idle {static['idle']:.1%}; dynamic: {dyn['total']:.1f} s, "
      f"idle {dyn['idle']:.1%} (goal: idle at most half the best static's, total below it)")
