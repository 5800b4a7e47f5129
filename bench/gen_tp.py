"""--gen-tp: colocated generation tensor-parallel over pairs of ranks against each rank's whole
engine, at a ~100M-param random Qwen2 (2 ranks on this CPU, colocate). Per run: the mean
seconds of generation per step and of the whole step (the first step left out: it builds the
engines), the peak memory per rank (perf/peak_mem_gib: the largest rank's), and the engine's own
weights per rank (the blocks split in K, the embedding and head whole on every rank).

    python bench/gen_tp.py [--steps 5] [--hidden 1024 --layers 10]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from common import qwen2_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--layers", type=int, default=10)
ap.add_argument("--max-new-tokens", type=int, default=32)
a = ap.parse_args()


def run(tmp: str, model: str, k: int) -> dict:
    run_dir = os.path.join(tmp, f"k{k}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train_grpo.py", "--model", model, "--steps", str(a.steps), "--prompts-per-step", "8",
           "--num-generations", "8", "--max-new-tokens", str(a.max_new_tokens), "--eval-every", "0",
           "--save-every", "0", "--no-save-final", "--rewards", "bench.common:parity_reward",
           "--gen-tp", str(k), "--run-dir", run_dir]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode:
        sys.exit(f"--gen-tp {k} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if not r.get("final")][1:]
    mean = lambda key: statistics.mean(r[key] for r in steps)  # noqa: E731
    return {"gen": mean("perf/generate_s"), "step": mean("perf/step_s"),
            "mem": max(r["perf/peak_mem_gib"] for r in steps), "tokens": mean("rollout/response_len")}


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model")
    net = qwen2_checkpoint(model, hidden=a.hidden, layers=a.layers)
    params = sum(p.numel() for p in net.parameters())
    whole = sum(p.numel() for n, p in net.named_parameters() if ".layers." not in n)  # embedding, norm
    results = {k: run(tmp, model, k) for k in (1, 2)}

print(f"\n2 ranks, colocate, a random Qwen2 of {params / 1e6:.1f}M params (hidden {a.hidden}, {a.layers} "
      f"layers); 8 prompts x 8 samples x up to {a.max_new_tokens} tokens per step; means over steps "
      f"2..{a.steps}\n")
print("| --gen-tp | generate s/step | step s | peak memory per rank GiB | engine weights per rank MiB "
      "| mean completion tokens |")
print("|---|---|---|---|---|---|")
for k, r in results.items():
    engine = (whole + (params - whole) / k) * 4 / 2**20
    print(f"| {k} | {r['gen']:.3f} | {r['step']:.3f} | {r['mem']:.2f} | {engine:.0f} | {r['tokens']:.1f} |")
