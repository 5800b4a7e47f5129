"""Rank 0's metrics: one printed line per step, the same numbers appended to a JSONL file,
and wandb when asked (imported only then); a timer for a step's phases; and a comparison of
two runs' metrics files.

    python -m utils.logger runs/a/metrics.jsonl runs/b/metrics.jsonl   # same run, timings aside?
"""
import json
import os
import sys
import time
from contextlib import contextmanager

from utils.errors import UserError

TIMING_PREFIXES = ("perf/", "placement/")  # wall-clock numbers: they differ between any two runs


class Logger:
    def __init__(self, run_dir: str, config: dict, total_steps: int, track: bool = False, project: str = "rl",
                 resume_step: int = 0):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        kept = []
        if resume_step and os.path.isfile(self.path):  # keep the rows before the checkpoint, drop the rest
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] < resume_step
                        and not json.loads(line).get("final")]
        self.file = open(self.path, "w")
        self.file.writelines(kept)
        self.total, self.start, self.first = total_steps, time.time(), resume_step
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)
        self.wandb = None
        if track:
            try:
                import wandb
            except ImportError as e:
                raise UserError("--track needs wandb: pip install wandb") from e
            self.wandb = wandb.init(project=project, config=config, dir=run_dir)

    def log(self, step: int, metrics: dict):
        rounded = {k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}
        metrics = {"step": step, **rounded}
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        print(self.line(step, metrics), flush=True)

    def line(self, step: int, m: dict) -> str:
        done = step + 1
        elapsed = time.time() - self.start
        eta = elapsed / max(1, done - self.first) * (self.total - done) if done < self.total else 0
        g = lambda k, f="{:.3f}": f.format(m[k]) if k in m else "-"  # noqa: E731
        if m.get("final"):
            return f"final policy | eval {g('eval/accuracy' if 'eval/accuracy' in m else 'eval/reward')} | " \
                   f"{elapsed:.0f}s in all"
        if m.get("event") == "placement/rebalance":
            return (f"rebalance after step {done} | {m['placement/rebalance_why']}; the move costs about "
                    f"{g('placement/rebalance_cost_s', '{:.1f}')}s")
        if m.get("event"):
            shown = [f"{k} {v}" for k, v in m.items() if k not in ("step", "event")]
            return f"{m['event']} | " + ", ".join(shown)
        if "perf/sample_s" in m:  # train_flow_grpo.py: images, no tokens
            return (f"step {done:>4}/{self.total} | reward {g('rollout/reward')} | eval {g('eval/reward')} "
                    f"| kl {g('train/kl', '{:.4f}')} | clip {g('train/clip_frac')} | sample "
                    f"{g('perf/sample_s', '{:.2f}')}s reward {g('perf/reward_s', '{:.2f}')}s ref "
                    f"{g('perf/reference_s', '{:.2f}')}s train {g('perf/train_s', '{:.2f}')}s "
                    f"| {elapsed:.0f}s, eta {eta:.0f}s")
        critic = ""
        if "train/value_loss" in m:  # PPO: the critic's numbers and its phases
            critic = (f"| vloss {g('train/value_loss', '{:.4f}')} "
                      f"ev {g('train/explained_variance', '{:.2f}')} "
                      f"kl_coef {g('train/kl_coef', '{:.4f}')} values {g('perf/values_s', '{:.2f}')}s "
                      f"critic {g('perf/critic_train_s', '{:.2f}')}s ")
        return (f"step {done:>4}/{self.total} | reward {g('rollout/reward')} | eval {g('eval/accuracy')} "
                f"| kl {g('train/kl', '{:.4f}')} | clip {g('train/clip_frac')} "
                f"| len {g('rollout/response_len', '{:.1f}')} "
                f"| gen {g('perf/generate_s', '{:.2f}')}s ref {g('perf/reference_s', '{:.2f}')}s "
                f"train {g('perf/train_s', '{:.2f}')}s sync {g('perf/sync_s', '{:.2f}')}s "
                f"{critic}| {g('perf/tokens_per_s', '{:.0f}')} tok/s | {elapsed:.0f}s, eta {eta:.0f}s")

    def summary(self, final_dir: str | None, picture: str | None) -> str:
        """The run in a few lines: held-out accuracy at the start and the end, the time and each
        phase's share of it, tokens/s, peak memory, and where the model and the picture are."""
        self.file.flush()
        rows = read_metrics(self.path)
        steps = [r for r in rows if not r.get("final") and not r.get("event")]
        held = "eval/accuracy" if any("eval/accuracy" in r for r in rows) else "eval/reward"  # flow: a reward
        evals = [r[held] for r in rows if held in r]
        total_s = time.time() - self.start
        step_s = sum(r.get("perf/step_s", 0.0) for r in steps)
        lines = []
        if evals:
            lines.append(f"held-out {held[5:]} {evals[0]:.3f} at the start, {evals[-1]:.3f} at the end "
                         f"({len(evals)} evals)")
        if steps and step_s > 0:
            shares = []
            for key, name in (("perf/generate_s", "generate"), ("perf/sample_s", "sample"),
                              ("perf/reward_s", "reward"), ("perf/reference_s", "reference"),
                              ("perf/reward_model_s", "reward model"), ("perf/values_s", "critic values"),
                              ("perf/critic_train_s", "critic update"), ("perf/train_s", "train"),
                              ("perf/sync_s", "weight sync")):
                share = sum(r.get(key, 0.0) for r in steps) / step_s
                if share >= 0.005:
                    shares.append(f"{name} {share:.0%}")
            tokens = sum(r.get("perf/tokens_per_s", 0.0) * r.get("perf/step_s", 0.0) for r in steps)
            memory = max(r.get("perf/peak_mem_gib", 0.0) for r in steps)
            added = max(r.get("perf/peak_mem_added_gib", 0.0) for r in steps)
            speed = f"{tokens / step_s:.0f} tokens/s; " if tokens else ""
            lines.append(f"{len(steps)} steps in {total_s:.0f}s ({step_s:.0f}s in steps: "
                         f"{', '.join(shares)}); {speed}peak memory {memory:.2f} GiB "
                         f"({added:.2f} GiB for the models and steps)")
        where = [f"metrics {self.path}"]
        if final_dir:
            where.append(f"final model {final_dir}")
        if picture:
            where.append(f"picture {picture}")
        lines.append("; ".join(where))
        text = "\n".join(f"summary | {line}" for line in lines)
        print(text, flush=True)
        return text

    def close(self):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


class Timer:
    """Seconds per phase of one step: `with timer("generate"): ...` adds to timer.seconds["generate"]."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = {}

    @contextmanager
    def __call__(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def without_timings(rows: list[dict]) -> list[dict]:
    """The rows of a metrics file without its wall-clock keys (perf/, placement/) and events
    (a --rebalance move's)."""
    kept = []
    for row in rows:
        if row.get("event"):
            continue
        kept.append({k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)})
    return kept


# differences(rel=...): the metrics file keeps 6 decimals (Logger.log rounds), so two values a hair
# apart can land 1e-6 apart; one more unit for the noise itself
FLOOR = 2e-6
# rounding noise itself (the engine's log-probs against the trainer's, of the same tokens): with a
# tolerance, never compared across runs, only bounded in each
NOISE, NOISE_BOUND = ("train/logprob_gap_mean", "train/logprob_gap_max"), 1e-4


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def differences(a: list[dict], b: list[dict], rel: float | None = None) -> list[str]:
    """Where two runs' metrics differ, timings aside: one line per differing step and key.
    rel None: bit for bit (two runs that make the same reductions in the same order). rel: a
    float may differ by FLOOR + rel * max(1, |value|), NOISE keys are only held under
    NOISE_BOUND, integers, flags and names must still be equal (runs whose sums run in
    another order: tests/helpers/runs.py says why and how much)."""
    a, b = without_timings(a), without_timings(b)
    if len(a) != len(b):
        return [f"{len(a)} rows against {len(b)}"]
    out = []
    for row_a, row_b in zip(a, b):
        for key in sorted(set(row_a) | set(row_b)):
            x, y = row_a.get(key, "(absent)"), row_b.get(key, "(absent)")
            where = f"step {row_a.get('step')} {key}"
            if rel is None or not (_number(x) and _number(y)):
                if x != y:
                    out.append(f"{where}: {x} != {y}")
            elif key in NOISE:
                if not (abs(x) < NOISE_BOUND and abs(y) < NOISE_BOUND):
                    out.append(f"{where}: {x}, {y} (noise, bounded by {NOISE_BOUND})")
            elif isinstance(x, float) or isinstance(y, float):
                tolerance = FLOOR + rel * max(1.0, abs(x), abs(y))
                if abs(x - y) > tolerance:
                    out.append(f"{where}: {x} != {y} (off by {abs(x - y):.2g} > {tolerance:.2g})")
            elif x != y:
                out.append(f"{where}: {x} != {y}")
    return out


if __name__ == "__main__":
    # python -m utils.logger A/metrics.jsonl B/metrics.jsonl [--rel 1e-5]: bit for bit, or within rel
    first, second = sys.argv[1:3]
    rel = float(sys.argv[sys.argv.index("--rel") + 1]) if "--rel" in sys.argv else None
    rows = read_metrics(first)
    diff = differences(rows, read_metrics(second), rel)
    keys = {k for r in without_timings(rows) for k in r}
    print("\n".join(diff[:50]))
    print(f"{len(rows)} rows, {len(keys)} keys compared (perf/ and placement/ left out): "
          f"{'identical' if not diff else f'{len(diff)} differences'}")
    sys.exit(1 if diff else 0)
