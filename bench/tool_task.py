"""Does RL teach the tiny model to use its tool? GRPO on builtin:multiply (products of 2-3-digit
numbers, which a 1M-parameter model cannot compute) with the calculator `tasks.env:multiply`,
from assets/tool-tiny (warm-started to call it on ~1 in 5 samples), on 2 CPU ranks, for several
seeds; and the control: the same run without --tools (a call then runs nothing, the model must
answer in its head); with --agent-seeds, the same task as an ordinary openai-client agent trained
through the run's endpoint (--agent tasks.agents:multiply_agent, engines/agents.py). Prints
held-out accuracy at the start and the end, the tool-call rate of the first and last steps, and
the wall time. Then the throughput of episodes against single-turn generation on the same model
and prompts (native engine, in this process), and of the agent's episodes through the endpoint.

    python bench/tool_task.py [--seeds 0 1 2] [--steps 120] [--control-seeds 0] [--agent-seeds 0 1 2]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the tool task's run: also in docs/tools.md and tests/test_tools_run.py
FLAGS = ["--model", "assets/tool-tiny", "--dataset", "builtin:multiply", "--max-prompt-tokens", "32",
         "--max-new-tokens", "96", "--prompts-per-step", "16", "--num-generations", "8", "--eval-every", "20",
         "--save-every", "0", "--no-save-final"]
TOOLS = ["--tools", "tasks.env:multiply"]
AGENT = ["--agent", "tasks.agents:multiply_agent"]
RUNS = {"tools": TOOLS, "control (no tools)": [], "agent (openai client)": AGENT}


def learning(seeds, steps: int, kind: str) -> list[dict]:
    rows = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as run:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "train_grpo.py", *FLAGS, *RUNS[kind], "--steps", str(steps),
                   "--seed", str(seed), "--run-dir", run]
            t = time.time()
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
            wall = time.time() - t
            if p.returncode:
                sys.exit(p.stderr[-3000:])
            with open(os.path.join(run, "metrics.jsonl")) as f:
                ms = [json.loads(line) for line in f]
        steps_ = [m for m in ms if not m.get("final")]
        evals = [m["eval/accuracy"] for m in ms if "eval/accuracy" in m]
        rate = [m.get("episode/tool_call_rate", float("nan")) for m in steps_]  # nan: no tools, no episodes
        rows.append({"run": kind, "seed": seed, "acc_start": evals[0],
                     "acc_end": evals[-1], "rate_start": rate[0], "rate_end": sum(rate[-5:]) / len(rate[-5:]),
                     "reward_end": sum(m["rollout/reward"] for m in steps_[-5:]) / 5, "wall_s": wall})
        print(json.dumps(rows[-1]), flush=True)
    return rows


class Timed:
    """An engine that records each request: (turn, prompt tokens, tokens generated, seconds)."""

    def __init__(self, engine):
        self.engine, self.calls, self.version = engine, [], 0

    def generate(self, prompts, params, seeds):
        t = time.perf_counter()
        out = self.engine.generate(prompts, params, seeds)
        self.calls.append((len(self.calls), sum(map(len, prompts)), int(out.lengths.sum()),
                           time.perf_counter() - t))
        return out

    def close(self):
        pass


def throughput(model: str, prompts: int = 64, n: int = 8, rounds: int = 3) -> tuple[list[dict], list]:
    """Episodes (tools on, temperature 1) against single-turn generation of the same prompts
    and budget, native engine, this process on all cores: episodes/s and model tokens/s, with each
    turn's prefill after the KV cache kept from the turn before (the default) and whole; and the
    best round's requests, turn by turn."""
    import torch

    from engines.agents import AgentArgs, Agents
    from engines.decode import SamplingParams
    from engines.episodes import EnvArgs, Episodes, tokenize
    from engines.native import NativeEngine
    from models.hf import iter_checkpoint, read_config
    from models.tokenizer import Tokenizer
    from tasks.data import multiply_rows

    tok = Tokenizer(model)
    cfg = EnvArgs(tools=("tasks.env:multiply",))
    cfg.check()
    rows = tokenize(multiply_rows("eval")[:prompts], tok, cfg, 32)[0]
    engine = NativeEngine(read_config(model), tok)
    engine.load_weights(iter_checkpoint(model))
    timed = Timed(engine)
    episodes = Episodes(timed, cfg, tok, rows, 96)
    agents = Agents(timed, AgentArgs(agent="tasks.agents:multiply_agent"), tok, rows, 96, 32, 1.0)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=96)
    out, turns = [], {}
    for name, eng, p, keep in [
            ("single-turn", engine, SamplingParams(n=n, temperature=1.0, max_new_tokens=48), False),
            ("episodes (tools)", episodes, params, True),
            ("episodes, each turn prefilled whole", episodes, params, False),
            ("agent through the endpoint (--agent)", agents, params, True)]:
        engine.keep_prefixes = keep  # on: a turn prefills only what follows the last turn's KV cache
        best = None
        for r in range(rounds):
            timed.calls = []
            t = time.perf_counter()
            got = eng.generate([x["ids"] for x in rows], p, list(range(r * prompts, (r + 1) * prompts)))
            dt = time.perf_counter() - t
            mask = got.model_mask if got.model_mask is not None else (
                torch.arange(got.tokens.shape[1])[None] < got.lengths[:, None]).float()
            stats = {"mode": name, "s": dt, "episodes_per_s": len(got.texts) / dt,
                     "model_tokens_per_s": float(mask.sum()) / dt, "all_tokens": int(got.lengths.sum()),
                     "turns": float(got.episode["turns"].mean()) if got.episode else 1.0,
                     "calling": float((got.episode["tool_calls"] > 0).float().mean()) if got.episode else 0.0}
            if best is None or dt < best["s"]:
                best = stats
                turns[name] = list(timed.calls)
        out.append(best)
    episodes.close()
    agents.endpoint.stop()
    return out, turns


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--control-seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--agent-seeds", type=int, nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip-learning", action="store_true")
    ap.add_argument("--models", nargs="+", default=["assets/tool-tiny"],
                    help="the throughput's models (e.g. a trained one too: runs/tools/final)")
    a = ap.parse_args()
    table = []
    if not a.skip_learning:
        table = (learning(a.seeds, a.steps, "tools")
                 + learning(a.control_seeds, a.steps, "control (no tools)")
                 + learning(a.agent_seeds, a.steps, "agent (openai client)"))
        print(f"\n{'run':<20} {'seed':>4} {'held-out acc':>14} {'tool-call rate':>16} "
              f"{'reward (last 5)':>16} {'wall s':>7}")
        for r in table:
            print(f"{r['run']:<20} {r['seed']:>4} {r['acc_start']:>6.3f} -> {r['acc_end']:.3f} "
                  f"{r['rate_start']:>7.3f} -> {r['rate_end']:.3f} {r['reward_end']:>16.3f} "
                  f"{r['wall_s']:>7.0f}")
    for model in a.models:
        rows, turns = throughput(os.path.join(ROOT, model))
        print(f"\n{model + ': 64 prompts x 8':<36} {'s':>6} {'episodes/s':>11} {'model tok/s':>12} "
              f"{'turns':>6} {'calling':>8}")
        for r in rows:
            print(f"{r['mode']:<36} {r['s']:>6.2f} {r['episodes_per_s']:>11.1f} "
                  f"{r['model_tokens_per_s']:>12.0f} {r['turns']:>6.2f} {r['calling']:>8.2f}")
        for name in [r["mode"] for r in rows[1:]]:
            print(f"  {name}:")
            for turn, context, made, seconds in turns[name]:
                print(f"    request {turn}: {context} context tokens, {made} generated, {seconds:.2f} s")
