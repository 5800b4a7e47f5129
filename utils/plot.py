"""A picture of a run from its metrics.jsonl: the training reward, held-out accuracy (and, with
--tools, the share of episodes that call a tool), response length and each phase's seconds per
step, written to run_dir/curves.png (at the end of every run, and on demand). matplotlib is
optional: without it this says how to get it.

    python -m utils.plot runs/grpo
"""
import os
import sys

from utils.logger import read_metrics

# (metric, label) of the phases of a step, stacked in the last panel
PHASES = [("perf/generate_s", "generate"), ("perf/reference_s", "reference"), ("perf/train_s", "train"),
          ("perf/sync_s", "weight sync")]


def plot(run_dir: str) -> str | None:
    """Writes run_dir/curves.png and returns its path; None (and a line saying why) without
    matplotlib or without any step to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no screen needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("no picture of the run: matplotlib is not installed (pip install matplotlib, then "
              f"python -m utils.plot {run_dir})", flush=True)
        return None
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in rows if not r.get("final") and not r.get("event")]
    if not steps:
        print(f"no picture of the run: {run_dir}/metrics.jsonl has no step yet", flush=True)
        return None
    # x: optimizer steps done. A step's row holds the eval made before its update
    x = [r["step"] + 1 for r in steps]
    evals = [(r["step"], r["eval/accuracy"]) for r in steps if "eval/accuracy" in r]
    evals += [(r["step"] + 1, r["eval/accuracy"]) for r in rows if r.get("final") and "eval/accuracy" in r]
    fig, ((reward, accuracy), (length, seconds)) = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    reward.plot(x, [r["rollout/reward"] for r in steps], lw=1)
    reward.set_title("training reward (mean per step)")
    if evals:
        accuracy.plot([s for s, _ in evals], [a for _, a in evals], "o-")
    accuracy.set_title("held-out accuracy")
    if any("episode/tool_call_rate" in r for r in steps):  # multi-turn episodes with tools
        accuracy.plot(x, [r.get("episode/tool_call_rate", 0.0) for r in steps], lw=1, label="tool-call rate")
        accuracy.set_title("held-out accuracy (dots); episodes that call a tool (line)")
    accuracy.set_ylim(0, 1)
    length.plot(x, [r["rollout/response_len"] for r in steps], lw=1)
    length.set_title("response length (tokens)")
    bottom = [0.0] * len(steps)
    for key, label in PHASES:
        values = [r.get(key, 0.0) for r in steps]
        seconds.fill_between(x, bottom, [b + v for b, v in zip(bottom, values)], label=label, step="mid")
        bottom = [b + v for b, v in zip(bottom, values)]
    seconds.set_title("seconds per step, by phase")
    seconds.legend(loc="upper right", fontsize=8)
    for ax in (length, seconds):
        ax.set_xlabel("optimizer steps")
    for ax in (reward, accuracy, length, seconds):
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir)
    fig.tight_layout()
    path = os.path.join(run_dir, "curves.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m utils.plot RUN_DIR")
    written = plot(sys.argv[1])
    if written:
        print(f"wrote {written}")
