"""Our GRPO step against TRL's GRPOTrainer: same checkpoint, same batch shape, one process each.

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl   # TRL in its own venv
    .venv/bin/python bench/grpo_vs_trl.py --trl-python .venv-trl/bin/python

../shared/bench/trl_grpo_cpu.py builds the checkpoint (a random 2.6M-param Qwen2) and times
TRL; we run train_grpo.py on that directory with a dataset of the same kind of prompts,
8 prompts x 8 samples x 64 new tokens, ref model off (TRL's default beta is 0). The two
alternate (rounds), and each reports the median step time after its first step.
A random model never answers right, so every group's accuracy rewards are all equal and
their advantages 0: TRL trains on those rows anyway, our actor skips them. For the same work
on both sides, our headline run scores with `bench.common:parity_reward` (mixed groups: every
row trained); a third row shows the accuracy reward, where our training is skipped; a fourth,
`--compile` (each decoder block under torch.compile), with the first step's compile time and
what it costs or saves over a default-length run (800 steps). The
step's model FLOPs: generation 2*N per token (plus attention), training 6*N per token of
prompt+completion (forward + backward); N counts every matmul weight (lm_head included).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

from common import matmul_gflops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from utils.model import flops_per_token, read_config  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl/bin/python"))
ap.add_argument("--trl-script", default=os.path.join(ROOT, "../shared/bench/trl_grpo_cpu.py"))
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "grpo-vs-trl"))
args = ap.parse_args()
P, G, T = 8, 8, 64


def run(cmd):
    """Runs one process; returns its stdout and its own peak RSS in MiB (os.wait4's rusage)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        out.seek(0), err.seek(0)
        stdout = out.read()
        if status:
            sys.exit(f"{cmd[:3]} failed:\n{stdout[-2000:]}\n{err.read()[-3000:]}")
    return stdout, usage.ru_maxrss / 1024


def trl():
    out, rss = run([args.trl_python, args.trl_script, "--steps", str(args.steps), "--workdir", args.workdir,
                    "--prompts-per-step", str(P), "--num-generations", str(G), "--max-new-tokens", str(T)])
    res = json.loads(out.strip().splitlines()[-1])
    return res["s_per_step_median"], rss, res["model_dir"]


def ours(model_dir, data, reward, *flags):
    run_dir = os.path.join(args.workdir + "-ours", "run")
    out, rss = run([sys.executable, "train_grpo.py", "--model", model_dir, "--dataset", data,
                    "--eval-every", "0", "--steps", str(args.steps), "--prompts-per-step", str(P),
                    "--num-generations", str(G), "--max-new-tokens", str(T), "--run-dir", run_dir,
                    "--no-save-final", "--lr", "1e-5",
                    "--rewards", reward, *flags])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][:args.steps]
    first[flags] = rows[0]["perf/step_s"]
    rows = rows[1:]
    trained = statistics.mean(r["train/rows_trained"] for r in rows)
    mean_len = statistics.mean(r["rollout/response_len"] for r in rows)
    return statistics.median(r["perf/step_s"] for r in rows), rss, mean_len, trained


SAME, SKIP, COMPILED = "ours (train_grpo.py)", "ours, accuracy reward", "ours, --compile"
results = {"TRL GRPOTrainer": [], SAME: [], SKIP: [], COMPILED: []}
first = {}  # the first step's seconds, by flags: the compile happens there
rss = {k: 0.0 for k in results}
trained = {"TRL GRPOTrainer": 1.0}
model_dir = data = mean_len = None
for r in range(args.rounds):
    s, m, model_dir = trl()
    results["TRL GRPOTrainer"].append(s)
    rss["TRL GRPOTrainer"] = max(rss["TRL GRPOTrainer"], m)
    if data is None:
        rng = random.Random(0)
        data = os.path.join(args.workdir + "-ours", "prompts.jsonl")  # TRL's script wipes its workdir
        os.makedirs(os.path.dirname(data), exist_ok=True)
        with open(data, "w") as f:
            for _ in range(512):
                a, b = rng.randint(0, 99), rng.randint(0, 99)
                f.write(json.dumps({"prompt": f"What is {a} + {b}? Answer:", "answer": str(a + b)}) + "\n")
    for name, reward, flags in ((SAME, "bench.common:parity_reward", ()), (SKIP, "accuracy", ()),
                                (COMPILED, "bench.common:parity_reward", ("--compile",))):
        s, m, length, trained[name] = ours(model_dir, data, reward, *flags)
        mean_len = length if name == SAME else mean_len
        results[name].append(s)
        rss[name] = max(rss[name], m)

cfg = read_config(model_dir)
prompt_len = 12  # "What is 12 + 34? Answer:" in the bench tokenizer: measured range 11-13 tokens
gen = sum(flops_per_token(cfg, prompt_len + t) for t in range(T)) * P * G
train = 3 * flops_per_token(cfg, (prompt_len + T) // 2) * (prompt_len + T) * P * G
roof = matmul_gflops()
print(f"\n{P} prompts x {G} samples x {T} new tokens; {cfg.num_params() / 1e6:.2f}M params; "
      f"step FLOPs {(gen + train) / 1e9:.0f} G (generate {gen / 1e9:.0f} + train {train / 1e9:.0f}); "
      f"fp32 matmul roof {roof:.0f} GFLOP/s; our mean completion length {mean_len:.1f}\n")
print(f"| {'trainer':<22} | {'s/step (median)':>15} | {'peak RSS MiB':>12} | {'MFU':>6} "
      f"| {'rows trained':>12} |")
print(f"|{'-' * 24}|{'-' * 17}|{'-' * 14}|{'-' * 8}|{'-' * 14}|")
for k, v in results.items():
    s = statistics.median(v)
    mfu = f"{(gen + train) / s / 1e9 / roof:6.1%}" if k != SKIP else f"{'-':>6}"  # it skipped the training
    print(f"| {k:<22} | {s:15.3f} | {rss[k]:12.0f} | {mfu} | {trained[k]:12.0%} |")
ratio = statistics.median(results[SAME]) / statistics.median(results["TRL GRPOTrainer"])
print(f"\nours / TRL seconds per step: {ratio:.2f}x   (per-round: {results})")
eager, compiled = statistics.median(results[SAME]), statistics.median(results[COMPILED])
compile_s = first[("--compile",)] - first[()]  # the last round's first steps
saved = (eager - compiled) * 800 - compile_s
print(f"--compile: first step {first[('--compile',)]:.1f} s (eager {first[()]:.1f} s), then "
      f"{compiled:.3f} s/step against {eager:.3f}; over an 800-step run it "
      f"{'saves' if saved > 0 else 'costs'} {abs(saved):.0f} s")
