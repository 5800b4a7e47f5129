"""Our GRPO step against TRL's GRPOTrainer at several model sizes and two shapes: same checkpoint,
same prompts and batch shape, one process each.

    python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 trl   # TRL in its own venv
    .venv/bin/python bench/grpo_vs_trl.py                          # 2.6M, 19M and 76M params, both shapes
    .venv/bin/python bench/grpo_vs_trl.py --sizes 256x4 --rounds 3 --shapes today  # one size (HIDDENxLAYERS)

For each size, ../shared/bench/trl_grpo_cpu.py builds the checkpoint (a random Qwen2 of that
--hidden and --layers, its BPE vocabulary, tied head). 8 prompts x 8 samples a step, ref model off
(TRL's default beta is 0). A random model never answers right, so accuracy rewards would give every
group equal rewards and advantages 0: TRL trains on those rows anyway, our actor skips them. For the
same work on both sides we score with `bench.common:parity_reward` (mixed groups: every row trained).
The sides alternate (--rounds); each reports the median step time after its first step.

today: "What is 12 + 34? Answer:" (11-13 tokens) and 64 new tokens in every row (a random model
  runs to the limit). TRL is the shared script (all 64 rows in one micro-batch); ours is
  train_grpo.py eager and `--compile`. Our rows split the step into its phases (perf/generate_s and
  perf/train_s, medians) with each one's share of this machine's fp32 matmul roof, measured in the
  same run. Model FLOPs: generation 2*N per token (plus attention), training 6*N per token of
  prompt+completion (forward + backward); N counts every matmul weight (lm_head included).
  `--compile`'s first step (the compile) is reported with what it costs or saves over a
  default-length run (800 steps).
reasoning: a reasoning run's shape (issue 54): a ~200-token system prompt shared by every prompt, a
  ~50-token question, completions of uneven length up to 384 tokens. The checkpoint is today's with
  its EOS made likely (`eos_checkpoint`): sampled with probability ~1/96 at every position, so that
  both sides draw lengths from the same geometric distribution (mean ~94, 2% at the cap; builtin:carries'
  samples have mean 97, p95 257). TRL runs bench/trl_reasoning.py (one `generate` of the 64 rows,
  then micro-batches of 8 rows: TRL's way to bound memory); ours runs train_grpo.py at its defaults
  (packed micro-batches of <= 2048 tokens, each group's prompt once). Each side's trained tokens per
  step come from its own lengths: TRL pads every row to the longest prompt and the longest
  completion of the step's 64; ours computes each group's prompt once and each completion's own
  tokens. Both sides train at a learning rate of 1e-12: the same work (forward, backward, Adam), with
  the lengths kept as calibrated (at 1e-5, one Adam step of the 76M model's took our mean length
  from 84 to 20 and TRL's the other way, to 266: the sign-like first steps of Adam move EOS's logit
  by nats at that size).
"""
import argparse
import json
import os
import random
import shutil
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
ap.add_argument("--shapes", nargs="+", default=["today", "reasoning"], choices=["today", "reasoning"])
ap.add_argument("--steps", type=int, default=6, help="steps per run at today's shape (the first untimed)")
ap.add_argument("--reasoning-steps", type=int, default=4, help="steps per run at the reasoning shape")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "grpo-vs-trl"))
args = ap.parse_args()
P, G, T = 8, 8, 64
PROMPT_LEN = 12  # "What is 12 + 34? Answer:" in the bench tokenizer: measured range 11-13 tokens
LONG_T, EOS_RATE = 384, 1 / 96  # the reasoning shape's cap and per-token EOS probability
STILL = "1e-12"  # the reasoning shape's learning rate: the model (and so the lengths) stay put


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


def trl(hidden, layers, steps=None, workdir=None, new_tokens=T):
    out, rss = run([args.trl_python, args.trl_script, "--steps", str(steps or args.steps),
                    "--workdir", workdir or args.workdir, "--hidden", str(hidden), "--layers", str(layers),
                    "--prompts-per-step", str(P), "--num-generations", str(G),
                    "--max-new-tokens", str(new_tokens)])
    res = json.loads(out.strip().splitlines()[-1])
    return {"step": res["s_per_step_median"], "rss": rss}, res["model_dir"]


def trl_reasoning(model_dir, data):
    out, rss = run([args.trl_python, os.path.join(ROOT, "bench/trl_reasoning.py"), "--model-dir", model_dir,
                    "--prompts", data, "--steps", str(args.reasoning_steps), "--prompts-per-step", str(P),
                    "--num-generations", str(G), "--max-new-tokens", str(LONG_T),
                    "--workdir", args.workdir + "-trl-reasoning", "--lr", STILL])
    res = json.loads(out.strip().splitlines()[-1])
    return {"step": res["s_per_step_median"], "rss": rss, "len": statistics.mean(res["mean_length"][1:]),
            "max_len": statistics.mean(res["max_length"][1:]), "lens": res["mean_length"]}


def ours(model_dir, data, *flags, steps=None, new_tokens=T, lr="1e-5"):
    steps = steps or args.steps
    run_dir = os.path.join(args.workdir + "-ours", "run")
    out, rss = run([sys.executable, "train_grpo.py", "--model", model_dir, "--dataset", data,
                    "--eval-every", "0", "--steps", str(steps), "--prompts-per-step", str(P),
                    "--num-generations", str(G), "--max-new-tokens", str(new_tokens), "--run-dir", run_dir,
                    "--no-save-final", "--lr", lr, "--rewards", "bench.common:parity_reward", *flags])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][:steps]
    med = {k: statistics.median(r[f"perf/{k}_s"] for r in rows[1:]) for k in ("step", "generate", "train")}
    lens = [r["rollout/response_len"] for r in rows]
    return {**med, "first": rows[0]["perf/step_s"], "rss": rss, "len": statistics.mean(lens[1:]),
            "lens": lens}


def prompts_file(name, make):
    """512 rows {"prompt", "answer"} from make(rng) -> (prompt, answer), as jsonl under the workdir."""
    rng = random.Random(0)
    path = os.path.join(args.workdir + "-ours", name)  # TRL's script wipes its workdir
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(512):
            prompt, answer = make(rng)
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    return path


def addition(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}? Answer:", str(a + b)


SYSTEM = ("You add long lists of numbers. Work from the last digit of each number to the first, write "
          "every partial sum and every carry on its own line, check each line once more, and only then "
          "give the total after the word Answer. ")


def long_sum(rng):
    """The reasoning shape's prompt: SYSTEM (209 tokens in the bench tokenizer), then 22 numbers (49)."""
    xs = [rng.randint(10, 99) for _ in range(22)]
    return f"{SYSTEM}\nWhat is {' + '.join(map(str, xs))}? Answer:", str(sum(xs))


def eos_checkpoint(src: str, dst: str, rate: float) -> tuple[float, float]:
    """Writes a copy of checkpoint `src` to `dst` whose EOS token is sampled with probability ~rate
    at every position (and whose context holds the reasoning shape). Every token's embedding gets
    the same value in coordinate 0, so the final norm's output has a large coordinate 0 at every
    position; with the tied head, that adds one constant to every logit (no change) except EOS's,
    whose row's coordinate 0 is then set so that its mean probability over random sequences is
    `rate`. EOS's logit is linear in that coordinate, so two forwards and a bisection find it.
    Returns the mean and std over positions of EOS's probability."""
    import torch

    from models.hf import load_model, save_model

    cfg = read_config(src)
    cfg.max_position_embeddings = 1024
    model, eos = load_model(src), cfg.eos_token_id
    emb = model.model.embed_tokens.weight  # [V, H]; tied: also the head
    x = torch.randint(3, cfg.vocab_size, (4, 256 + LONG_T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        emb[:, 0] = 1.0
        logits = model(x).float()  # [4, L, V]
        emb[eos, 0] = 2.0
        slope = model(x).float()[..., eos] - logits[..., eos]  # [4, L]: EOS's logit per unit of emb[eos, 0]
        others = torch.cat([logits[..., :eos], logits[..., eos + 1:]], -1).logsumexp(-1)  # [4, L]
        prob = lambda d: torch.sigmoid(logits[..., eos] + d * slope - others)  # noqa: E731
        lo, hi = -100.0, 100.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if prob(mid).mean() < rate else (lo, mid)
        emb[eos, 0] = 1.0 + lo
    save_model(model, cfg, dst, tokenizer_dir=src)
    return prob(lo).mean().item(), prob(lo).std().item()


def medians(res):
    """{side: [run's figures]} -> {side: {figure: median over the runs}} (the per-step lengths left out)."""
    return {k: {f: statistics.median(x[f] for x in v) for f in v[0] if f != "lens"} for k, v in res.items()}


def today(size):
    """Today's shape at one size: table rows and a note."""
    hidden, layers = map(int, size.split("x"))
    res, table = {TRL: [], EAGER: [], COMPILED: []}, []
    data = prompts_file("prompts.jsonl", addition)
    for r in range(args.rounds):
        got, model_dir = trl(hidden, layers)
        res[TRL].append(got)
        res[EAGER].append(ours(model_dir, data))
        res[COMPILED].append(ours(model_dir, data, "--compile"))
        print(f"{size} today round {r + 1}: "
              + ", ".join(f"{k} {v[-1]['step']:.3f} s" for k, v in res.items()), flush=True)
    cfg = read_config(model_dir)
    gen = sum(flops_per_token(cfg, PROMPT_LEN + t) for t in range(T)) * P * G
    train = 3 * flops_per_token(cfg, (PROMPT_LEN + T) // 2) * (PROMPT_LEN + T) * P * G
    med = medians(res)
    for k, m in med.items():
        share = lambda flops, s: f"{s:6.3f} ({flops / s / 1e9 / roof:4.0%})"  # noqa: E731
        phases = (share(gen, m["generate"]), share(train, m["train"])) if k != TRL else ("-", "-")
        table.append((f"{cfg.num_params() / 1e6:.1f}M ({size})", k, f"{m['step']:.3f}",
                      f"{m['step'] / med[TRL]['step']:.2f}x", f"{m['rss']:.0f}",
                      f"{(gen + train) / m['step'] / 1e9 / roof:.1%}", *phases))
    eager, compiled = med[EAGER], med[COMPILED]
    saved = (eager["step"] - compiled["step"]) * 800 - (compiled["first"] - eager["first"])
    return table, (f"{size}: --compile's first step {compiled['first']:.1f} s "
                   f"(eager {eager['first']:.1f} s); "
                   f"over an 800-step run it {'saves' if saved > 0 else 'costs'} {abs(saved):.0f} s; "
                   f"our mean completion length {eager['len']:.1f}; step GFLOP: generate {gen / 1e9:.0f}, "
                   f"train {train / 1e9:.0f}")


def reasoning(size):
    """The reasoning shape at one size: table rows and a note."""
    from models.tokenizer import Tokenizer

    hidden, layers = map(int, size.split("x"))
    _, built = trl(hidden, layers, steps=1, workdir=args.workdir + "-build", new_tokens=4)
    model_dir = os.path.join(args.workdir + "-ours", f"eos-{size}")
    shutil.rmtree(model_dir, ignore_errors=True)
    p_eos, p_std = eos_checkpoint(built, model_dir, EOS_RATE)
    data = prompts_file("long_prompts.jsonl", long_sum)
    tok = Tokenizer(model_dir)
    lens = [len(tok.encode(json.loads(line)["prompt"])) for line in open(data)]
    res = {TRL: [], EAGER: []}
    for r in range(args.rounds):
        res[TRL].append(trl_reasoning(model_dir, data))
        res[EAGER].append(ours(model_dir, data, "--max-prompt-tokens", "512", steps=args.reasoning_steps,
                               new_tokens=LONG_T, lr=STILL))
        print(f"{size} reasoning round {r + 1}: "
              + ", ".join(f"{k} {v[-1]['step']:.3f} s" for k, v in res.items()), flush=True)
    cfg = read_config(model_dir)
    per_step = {k: " ".join(f"{n:.0f}" for x in v for n in x["lens"]) for k, v in res.items()}
    med = medians(res)
    p_mean, p_max = statistics.mean(lens), max(lens)
    # TRL: every row padded to the longest prompt and the step's longest completion; ours: each
    # group's prompt once, each completion's own tokens (packed)
    tokens = {TRL: P * G * (p_max + med[TRL]["max_len"]), EAGER: P * p_mean + P * G * med[EAGER]["len"]}
    context = {TRL: (p_max + med[TRL]["max_len"]) / 2, EAGER: p_mean + med[EAGER]["len"] / 2}
    table = []
    for k, m in med.items():
        flops = 3 * flops_per_token(cfg, context[k]) * tokens[k]
        table.append((f"{cfg.num_params() / 1e6:.1f}M ({size})", k, f"{m['step']:.3f}",
                      f"{m['step'] / med[TRL]['step']:.2f}x", f"{m['rss']:.0f}", f"{m['len']:.1f}",
                      f"{tokens[k]:.0f}", f"{flops / 1e9:.0f}"))
    return table, (f"{size}: prompts {min(lens)}-{p_max} tokens (mean {p_mean:.1f}); EOS probability "
                   f"{p_eos:.4f} (std over positions {p_std:.4f}); mean completion a step (first ones "
                   f"untimed): TRL {per_step[TRL]}, ours {per_step[EAGER]}; TRL's longest completion a step "
                   f"{med[TRL]['max_len']:.0f}; ours: generate {med[EAGER]['generate']:.2f} s, train "
                   f"{med[EAGER]['train']:.2f} s")


TRL, EAGER, COMPILED = "TRL GRPOTrainer", "ours", "ours --compile"
roof, tables, notes = matmul_gflops(), {"today": [], "reasoning": []}, []
for size in args.sizes:
    for shape in args.shapes:
        rows, note = (today if shape == "today" else reasoning)(size)
        tables[shape] += rows
        notes.append(note)

print(f"\nfp32 matmul roof {roof:.0f} GFLOP/s; medians of {args.rounds} alternating rounds")
if tables["today"]:
    print(f"\ntoday: {P} prompts x {G} samples x {T} new tokens, {args.steps - 1} steps a run\n")
    print_table(("model", "trainer", "s/step", "vs TRL", "peak RSS MiB", "MFU", "generate s (roof)",
                 "train s (roof)"), tables["today"])
if tables["reasoning"]:
    print(f"\nreasoning: {P} prompts x {G} samples, up to {LONG_T} new tokens, {args.reasoning_steps - 1} "
          "steps a run\n")
    print_table(("model", "trainer", "s/step", "vs TRL", "peak RSS MiB", "mean completion",
                 "trained tokens", "train GFLOP"), tables["reasoning"])
print("\n" + "\n".join(notes))
