"""Our GRPO step against TRL's GRPOTrainer at several model sizes: same checkpoint, same batch
shape, one process each.

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl   # TRL in its own venv
    .venv/bin/python bench/grpo_vs_trl.py                          # 2.6M, 19M and 76M params
    .venv/bin/python bench/grpo_vs_trl.py --sizes 256x4 --rounds 3  # one size (HIDDENxLAYERS)

For each size, ../shared/bench/trl_grpo_cpu.py builds the checkpoint (a random Qwen2 of that
--hidden and --layers, vocabulary 1024, tied head) and times TRL; we run train_grpo.py on that
directory with a dataset of the same kind of prompts, 8 prompts x 8 samples x 64 new tokens,
ref model off (TRL's default beta is 0), eager and `--compile`. The three alternate (rounds),
and each reports the median step time after its first step. A random model never answers
right, so accuracy rewards would give every group equal rewards and advantages 0: TRL trains on
those rows anyway, our actor skips them. For the same work on both sides we score with
`bench.common:parity_reward` (mixed groups: every row trained).

Our rows split the step into its phases (perf/generate_s and perf/train_s, medians) with each
one's share of this machine's fp32 matmul roof, measured in the same run. Model FLOPs:
generation 2*N per token (plus attention), training 6*N per token of prompt+completion (forward
+ backward); N counts every matmul weight (lm_head included). `--compile`'s first step (the
compile) is reported with what it costs or saves over a default-length run (800 steps).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

from common import matmul_gflops, print_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from models.decoder import flops_per_token
from models.hf import read_config

ap = argparse.ArgumentParser()
ap.add_argument("--trl-python", default=os.path.join(ROOT, ".venv-trl/bin/python"))
ap.add_argument("--trl-script", default=os.path.join(ROOT, "../shared/bench/trl_grpo_cpu.py"))
ap.add_argument("--sizes", nargs="+", default=["256x4", "512x8", "1024x8"],
                help="HIDDENxLAYERS per model: TRL's script's --hidden and --layers")
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "grpo-vs-trl"))
args = ap.parse_args()
P, G, T = 8, 8, 64
PROMPT_LEN = 12  # "What is 12 + 34? Answer:" in the bench tokenizer: measured range 11-13 tokens


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


def trl(hidden, layers):
    out, rss = run([args.trl_python, args.trl_script, "--steps", str(args.steps), "--workdir", args.workdir,
                    "--hidden", str(hidden), "--layers", str(layers), "--prompts-per-step", str(P),
                    "--num-generations", str(G), "--max-new-tokens", str(T)])
    res = json.loads(out.strip().splitlines()[-1])
    return {"step": res["s_per_step_median"], "rss": rss}, res["model_dir"]


def ours(model_dir, data, *flags):
    run_dir = os.path.join(args.workdir + "-ours", "run")
    out, rss = run([sys.executable, "train_grpo.py", "--model", model_dir, "--dataset", data,
                    "--eval-every", "0", "--steps", str(args.steps), "--prompts-per-step", str(P),
                    "--num-generations", str(G), "--max-new-tokens", str(T), "--run-dir", run_dir,
                    "--no-save-final", "--lr", "1e-5", "--rewards", "bench.common:parity_reward", *flags])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][:args.steps]
    med = {k: statistics.median(r[f"perf/{k}_s"] for r in rows[1:]) for k in ("step", "generate", "train")}
    return {**med, "first": rows[0]["perf/step_s"], "rss": rss,
            "len": statistics.mean(r["rollout/response_len"] for r in rows[1:])}


def prompts_file():
    rng = random.Random(0)
    path = os.path.join(args.workdir + "-ours", "prompts.jsonl")  # TRL's script wipes its workdir
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(512):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"What is {a} + {b}? Answer:", "answer": str(a + b)}) + "\n")
    return path


TRL, EAGER, COMPILED = "TRL GRPOTrainer", "ours", "ours --compile"
data, roof, table, notes = prompts_file(), matmul_gflops(), [], []
for size in args.sizes:
    hidden, layers = map(int, size.split("x"))
    res = {TRL: [], EAGER: [], COMPILED: []}
    for r in range(args.rounds):
        got, model_dir = trl(hidden, layers)
        res[TRL].append(got)
        res[EAGER].append(ours(model_dir, data))
        res[COMPILED].append(ours(model_dir, data, "--compile"))
        print(f"{size} round {r + 1}: " + ", ".join(f"{k} {v[-1]['step']:.3f} s" for k, v in res.items()),
              flush=True)
    cfg = read_config(model_dir)
    gen = sum(flops_per_token(cfg, PROMPT_LEN + t) for t in range(T)) * P * G
    train = 3 * flops_per_token(cfg, (PROMPT_LEN + T) // 2) * (PROMPT_LEN + T) * P * G
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in res.items()}
    for k, m in med.items():
        share = lambda flops, s: f"{s:6.3f} ({flops / s / 1e9 / roof:4.0%})"  # noqa: E731
        phases = (share(gen, m["generate"]), share(train, m["train"])) if k != TRL else ("-", "-")
        table.append((f"{cfg.num_params() / 1e6:.1f}M ({size})", k, f"{m['step']:.3f}",
                      f"{m['step'] / med[TRL]['step']:.2f}x", f"{m['rss']:.0f}",
                      f"{(gen + train) / m['step'] / 1e9 / roof:.1%}", *phases))
    eager, compiled = med[EAGER], med[COMPILED]
    saved = (eager["step"] - compiled["step"]) * 800 - (compiled["first"] - eager["first"])
    notes.append(f"{size}: --compile's first step {compiled['first']:.1f} s (eager {eager['first']:.1f} s); "
                 f"over an 800-step run it {'saves' if saved > 0 else 'costs'} {abs(saved):.0f} s; "
                 f"our mean completion length {eager['len']:.1f}; step GFLOP: generate {gen / 1e9:.0f}, "
                 f"train {train / 1e9:.0f}")

print(f"\n{P} prompts x {G} samples x {T} new tokens; fp32 matmul roof {roof:.0f} GFLOP/s; "
      f"medians of {args.rounds} alternating rounds x {args.steps - 1} steps\n")
print_table(("model", "trainer", "s/step", "vs TRL", "peak RSS MiB", "MFU", "generate s (roof)",
             "train s (roof)"), table)
print("\n" + "\n".join(notes))
