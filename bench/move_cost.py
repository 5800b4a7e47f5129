"""What a --rebalance move costs, in process against by restart, at two model sizes: 4 ranks on
this CPU, disaggregated, a forced move from 3 trainers + 1 rollout rank to 2 + 2 after step 2
(--rebalance-force, the test hook; the same move a measured decision makes). Each run's
`placement/moved` row gives the move's seconds from the decision to the first step after it, and
for a move in process where they went, each part the slowest rank's: the digest of the state
(sha256, checked again after the move, outside these seconds), the checkpoint the move saves,
telling the rollout ranks, the new groups, the state moved (the full weights and Adam's moments:
bytes and seconds), and rebuilding the roles (the frozen models read again, the moved state
restored, the engines built or kept and joined).

    python bench/move_cost.py [--sizes tiny,100m]
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
SIZES = {"tiny": {"hidden": 256, "layers": 4}, "100m": {"hidden": 1024, "layers": 10, "vocab": 1024}}
ap = argparse.ArgumentParser()
ap.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, of {list(SIZES)}")
a = ap.parse_args()


def run(tmp: str, model: str, restart: bool) -> dict:
    run_dir = os.path.join(tmp, f"{os.path.basename(model)}-{'restart' if restart else 'inproc'}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           f"--max-restarts={int(restart)}", "train_grpo.py", "--model", model, "--steps", "4",
           "--prompts-per-step", "12", "--num-generations", "4", "--max-new-tokens", "8", "--eval-every", "0",
           "--save-every", "0", "--no-save-final", "--rewards", "bench.common:parity_reward",
           "--placement", "disaggregate", "--rollout-ranks", "1", "--rebalance", "--rebalance-window", "1",
           "--rebalance-gap", "1", "--rebalance-force", "2", "2", "--run-dir", run_dir]
    if restart:
        cmd.append("--rebalance-restart")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode:
        sys.exit(f"{run_dir} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    moved = [r for r in rows if r.get("event") == "placement/moved"]
    assert len(moved) == 1 and moved[0]["placement/move_state_equal"] == 1.0, moved
    steps = [r["perf/step_s"] for r in rows if not r.get("event") and not r.get("final")]
    return {**moved[0], "total": time.perf_counter() - t, "step_s": sum(steps) / len(steps)}


with tempfile.TemporaryDirectory() as tmp:
    results = []
    for size in a.sizes.split(","):
        model = os.path.join(tmp, size)
        params = sum(p.numel() for p in qwen2_checkpoint(model, **SIZES[size]).parameters()) / 1e6
        for restart in (True, False):
            print(f"{size} ({params:.1f}M params), {'restart' if restart else 'in process'} ...", flush=True)
            results.append((size, params, restart, run(tmp, model, restart)))

print("\n4 ranks, a forced move from 3 trainers + 1 rollout rank to 2 + 2 after step 2 of 4; seconds from "
      "the decision to the next step (each part: the slowest rank's)\n")
print("| model | move | move s | mean step s | digest s | checkpoint s | tell s | groups s | state moved s "
      "| state MiB | roles rebuilt s |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for size, params, restart, r in results:
    parts = "| - | - | - | - | - | - | - "
    if not restart:
        parts = (f"| {r['placement/move_digest_s']:.2f} | {r['placement/move_checkpoint_s']:.2f} "
                 f"| {r['placement/move_agree_s']:.3f} "
                 f"| {r['placement/move_groups_s']:.3f} | {r['placement/move_state_s']:.2f} "
                 f"| {r['placement/move_state_bytes'] / 2**20:.0f} | {r['placement/move_rebuild_s']:.2f} ")
    how = "restart" if restart else "in process"
    print(f"| {size} ({params:.1f}M) | {how} | {r['placement/move_s']:.2f} | {r['step_s']:.2f} {parts}|")
