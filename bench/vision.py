"""GRPO on the built-in visual task (builtin:squares, assets/vl-tiny, a tiny Qwen2-VL; 2 CPU
ranks, colocate, the native engine): held-out accuracy (256 prompts, one sample each at
temperature 1) at the start and the end of each seed's run, its wall time; then the step's cost
against the text task's (builtin:arith, assets/arith-tiny: the same decoder shape) at about the
same tokens per sample: median seconds per step by phase, tokens per step, peak memory per rank.

    python bench/vision.py [--steps 300] [--seeds 0 1 2] [--lr 1e-3]
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
PHASES = ("generate", "train", "sync")


def run(flags: list[str], keep: str | None = None) -> tuple[list[dict], float]:
    """(metrics.jsonl rows, wall seconds of the whole launch) of train_grpo.py on 2 ranks; keep: the
    run directory to write (its final model too), else a temporary one without it."""
    with tempfile.TemporaryDirectory() as d:
        final = ["--run-dir", keep] if keep else ["--no-save-final", "--run-dir", d]
        d = keep or d
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train_grpo.py", *flags, *final]
        t = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t
        if p.returncode:
            sys.exit(p.stdout[-2000:] + p.stderr[-3000:])
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], wall


def summary(rows: list[dict]) -> dict:
    steps = [r for r in rows if "perf/step_s" in r and not r.get("final")]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    out = {"start": evals[0] if evals else None, "end": evals[-1] if evals else None,
           "step_s": statistics.median(r["perf/step_s"] for r in steps),
           "tokens": statistics.median(r["perf/tokens_per_s"] * r["perf/step_s"] for r in steps),
           "peak_gib": max(r.get("perf/peak_mem_gib", 0.0) for r in steps)}
    for phase in PHASES:
        out[phase] = statistics.median(r.get(f"perf/{phase}_s", 0.0) for r in steps)
    return out


def text_twin(path: str) -> str:
    """builtin:squares' train questions as text prompts of the same token counts as the image
    prompts (the image's tokens replaced by 'x ' tokens, as many as fit), written to the jsonl `path`."""
    sys.path.insert(0, ROOT)
    from models.tokenizer import Tokenizer
    from tasks.data import load_rows, tokenize_rows

    tok = Tokenizer(os.path.join(ROOT, "assets/vl-tiny"))
    with open(path, "w") as f:
        for r in tokenize_rows(load_rows("builtin:squares", "train", "prompt", "answer"), tok, 256)[0]:
            question, n = r["prompt"][0]["content"][-1]["text"], len(r["ids"])
            prompt = lambda k: [{"role": "user", "content": "x " * k + question}]  # noqa: E731
            k = n
            while k and len(tok.encode(*tok.render(prompt(k)))) > n:
                k -= 1
            f.write(json.dumps({"prompt": prompt(k), "answer": r["answer"]}) + "\n")
    return path


def picture(final: str, path: str, n: int = 12) -> str:
    """The first n held-out questions, answered greedily by assets/vl-tiny and by the run's final
    model (utils/plot.py plot_answers)."""
    sys.path.insert(0, ROOT)
    from assets.make import vl_answers
    from utils.plot import plot_answers

    answers = {}
    for name, model in (("before", os.path.join(ROOT, "assets/vl-tiny")), ("after", final)):
        rows, answers[name] = vl_answers(model, n, temperature=0.0)
    questions = [r["prompt"][0]["content"][-1]["text"] for r in rows]
    return plot_answers(path, [r["images"][0] for r in rows], questions, [r["answer"] for r in rows],
                        answers["before"], answers["after"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cost-steps", type=int, default=10)
    ap.add_argument("--picture-run", default="runs/vision-bench", help="the first seed's run directory")
    ap.add_argument("--picture", default="assets/vl-run.png", help="held-out answers before and after")
    ap.add_argument("--skip-learning", action="store_true", help="only the step's cost")
    a = ap.parse_args()
    vl = ["--model", "assets/vl-tiny", "--dataset", "builtin:squares", "--lr", str(a.lr)]
    learned = {}
    for seed in [] if a.skip_learning else a.seeds:
        keep = a.picture_run if seed == a.seeds[0] else None
        flags = [*vl, "--steps", str(a.steps), "--eval-every", str(a.steps), "--seed", str(seed)]
        rows, wall = run(flags, keep)
        learned[seed] = {**summary(rows), "wall_s": wall}
        print(json.dumps({"seed": seed, **learned[seed]}), flush=True)
    if learned:
        print(f"wrote {picture(os.path.join(a.picture_run, 'final'), a.picture)}", flush=True)
    # the cost of a step, 64 prompts x 8 samples, no evaluation: the squares task (prompts of 13-26
    # tokens, 4-16 of them an image's; answers 1 token and EOS); its text twin, the same model on
    # the same questions with each image's tokens replaced by as many text tokens (text_twin); and
    # the default text task (arith-tiny, prompts of 4-6 tokens, answers of 1-3)
    twin = text_twin(os.path.join(tempfile.mkdtemp(), "squares-text.jsonl"))
    cost = {}
    for name, flags in (("squares (vl-tiny)", vl),
                        ("its text twin (vl-tiny)", [*vl[:2], "--dataset", twin, "--image-column", "None",
                                                     "--eval-every", "0"]),
                        ("arith (arith-tiny)", [])):
        rows, wall = run([*flags, "--steps", str(a.cost_steps), "--eval-every", "0"])
        cost[name] = summary(rows)
        print(json.dumps({"task": name, **cost[name]}), flush=True)

    print(f"\nbuiltin:squares, assets/vl-tiny, {a.steps} steps at lr {a.lr}, 64 prompts x 8 samples, 2 ranks;"
          " held-out accuracy (256 prompts, 1 sample each, temperature 1) start -> end")
    print(f"{'seed':>5}{'held-out':>18}{'lift':>8}{'step s':>8}{'wall s':>8}")
    for seed, r in learned.items():
        print(f"{seed:>5}{r['start']:>9.3f} -> {r['end']:.3f}{r['end'] - r['start']:>+8.3f}"
              f"{r['step_s']:>8.2f}"
              f"{r['wall_s']:>8.0f}")
    print(f"\nthe step's cost, median of {a.cost_steps} steps: seconds by phase, completion tokens per step "
          "(both ranks), peak memory per rank")
    print(f"{'task':<22}" + "".join(f"{p:>10}" for p in PHASES)
          + f"{'step s':>8}{'tokens':>9}{'peak GiB':>10}")
    for name, r in cost.items():
        print(f"{name:<22}" + "".join(f"{r[p]:>10.2f}" for p in PHASES)
              + f"{r['step_s']:>8.2f}{r['tokens']:>9.0f}{r['peak_gib']:>10.2f}")
