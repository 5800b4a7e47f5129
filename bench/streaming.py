"""Streaming rollouts (--stream, issue 53) against one step ahead, on the reasoning workload
(builtin:carries, completions of 40-500 tokens) with 1 trainer + 1 rollout rank on 2 CPU cores, so
nothing is oversubscribed. For each way and seed, a GRPO run of --steps steps at --max-staleness 1,
held-out accuracy (128 problems) at its first and last step; then per way, over its seeds:

    samples/s            completions trained per second of the steps without an evaluation
    rollout idle         the rollout rank's seconds waiting (for requests, a version, prompts) per step second
    trainer idle         the trainer's seconds waiting for samples (and the evaluation) per step second
    staleness            per token: versions behind the step that trains it (mean, max)
    accuracy             held-out, at the start and the end (the same number of samples seen in each way)

    python bench/streaming.py                     # 4 ways x 3 seeds x 30 steps, ~25 min on 2 cores
    python bench/streaming.py --seeds 0 --steps 10 --ways ahead,fixed
    python bench/streaming.py --seeds 0 --ways ahead-k2,asap-k2   # at --max-staleness 2
    python bench/streaming.py --ways ahead-vllm,asap-vllm         # on vLLM's engine
    python bench/streaming.py --decode-rows    # a decode step's cost against its rows and context
"""
import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.carries_learning import MODEL, TASK  # noqa: E402
from bench.common import print_table  # noqa: E402
from engines.native import NativeEngine  # noqa: E402
from models.decoder import KVCache  # noqa: E402
from models.hf import iter_checkpoint, read_config  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402
from utils.logger import read_metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DISAGG = ["--placement", "disaggregate", "--rollout-ranks", "1"]
WAYS = {  # name -> flags on top of DISAGG
    "ahead": ["--max-staleness", "1"],  # today: step k+1's batch generated while step k trains
    # the pool, new weights in at a point the data fixes (exact resume)
    "fixed": ["--max-staleness", "1", "--stream"],
    "asap": ["--max-staleness", "1", "--stream", "--stream-swap", "asap"],  # new weights in as they come
    # and the samples running then restart
    "asap-drop": ["--max-staleness", "1", "--stream", "--stream-swap", "asap", "--partial-rollout-drop"],
    # not in the default table (another bound): what the bound of 1 costs the pool
    "asap-k2": ["--max-staleness", "2", "--stream", "--stream-swap", "asap"],
    "ahead-k2": ["--max-staleness", "2"],
    # the same two on vLLM (its core in a process of its own on the rollout rank): a batch per step,
    # against vLLM's scheduler as the pool (engines/vllm_pool.py)
    "ahead-vllm": ["--max-staleness", "1", "--engine", "vllm"],
    "asap-vllm": ["--max-staleness", "1", "--stream", "--stream-swap", "asap", "--engine", "vllm"],
}
DEFAULT = "ahead,fixed,asap,asap-drop"


def run(way: str, seed: int, steps: int, out: str) -> str:
    run_dir = os.path.join(out, f"{way}-seed{seed}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "train_grpo.py"), "--model", MODEL, *TASK, *DISAGG, *WAYS[way],
           "--steps", str(steps), "--eval-every", str(steps - 1), "--save-every", "0", "--no-save-final",
           "--seed", str(seed), "--run-dir", run_dir]
    t = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    print(f"{way} seed {seed}: {time.time() - t:.0f} s", flush=True)
    return run_dir


def measure(run_dir: str) -> dict:
    rows = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if not r.get("final")]
    timed = [r for r in rows if "eval/accuracy" not in r and r["step"] > 0]  # (step 0 starts the pipeline)
    seconds = sum(r["perf/step_s"] for r in timed)
    samples = len(timed) * 16 * 8  # TASK's prompts per step x samples per prompt
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    stale = [r.get("rollout/token_staleness_mean", r["placement/staleness_mean"]) for r in rows]
    return {"samples_s": samples / seconds,
            "rollout_idle": sum(r["placement/rollout_idle_s"] for r in timed) / seconds,
            "trainer_idle": sum(r["placement/trainer_idle_s"] for r in timed) / seconds,
            "stale_mean": sum(stale) / len(stale),
            "stale_max": max(r.get("rollout/token_staleness_max", r["placement/staleness_max"])
                             for r in rows),
            "acc0": evals[0], "acc1": evals[-1],
            "len": sum(r["rollout/response_len"] for r in rows) / len(rows)}


def decode_rows():
    """What a decode step of the tiny model costs here against its rows and context (the native
    engine's step, one thread): whether a batch's tail of few rows is cheap (cost in proportion to
    rows: nothing for continuous batching to win back) or costs nearly a full step (a GPU's
    memory-bound decode: what the pool wins back)."""
    torch.set_num_threads(1)
    engine = NativeEngine(read_config(MODEL), Tokenizer(MODEL))
    engine.load_weights(iter_checkpoint(MODEL))
    engine.decoder.prepare(rows=128)
    rows = []
    for B in (1, 8, 32, 128):
        for L in (200, 600):
            cache = KVCache(engine.cfg, B, L + 1, "cpu", torch.float32)
            cache.k.normal_()
            cache.v.normal_()
            args = (torch.zeros(B, dtype=torch.long), torch.full((B,), L), torch.zeros(B, 1, L + 1), cache)
            for n in (3, 30):  # warm-up, then timed
                t = time.perf_counter()
                for _ in range(n):
                    cache.pos = L
                    engine.decoder.decode(*args)
            ms = (time.perf_counter() - t) / 30 * 1e3
            rows.append((str(B), str(L), f"{ms:.2f}", f"{ms / B:.3f}"))
    print_table(("rows", "context", "ms a step", "ms a row"), rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-rows", action="store_true", help="only the decode step's cost against its rows")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ways", default=DEFAULT, help=f"of {', '.join(WAYS)}")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-streaming"))
    a = ap.parse_args()
    if a.decode_rows:
        return decode_rows()
    seeds, ways = [int(s) for s in a.seeds.split(",")], a.ways.split(",")
    got = {w: [measure(run(w, s, a.steps, a.out)) for s in seeds] for w in ways}
    rows = []
    base = sum(x["samples_s"] for x in got[ways[0]]) / len(seeds)
    for w in ways:
        m = got[w]
        mean = lambda k: sum(x[k] for x in m) / len(m)  # noqa: E731
        rows.append((w, f"{mean('samples_s'):.1f}", f"{mean('samples_s') / base:.2f}x",
                     f"{mean('rollout_idle'):.1%}", f"{mean('trainer_idle'):.1%}",
                     f"{mean('stale_mean'):.2f} / {max(x['stale_max'] for x in m):.0f}",
                     " ".join(f"{x['acc0']:.3f}->{x['acc1']:.3f}" for x in m), f"{mean('len'):.0f}"))
    print(f"\n{a.steps} steps of 128 samples, seeds {a.seeds}; speed relative to '{ways[0]}'")
    print_table(("way", "samples/s", "speed", "rollout idle", "trainer idle", "staleness mean/max",
                 "held-out accuracy per seed", "length"), rows)


if __name__ == "__main__":
    main()
