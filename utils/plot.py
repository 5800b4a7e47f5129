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
    return _save(fig, plt, run_dir)


def _save(fig, plt, run_dir: str) -> str:
    """run_dir/curves.png, titled with the run's directory."""
    fig.suptitle(run_dir)
    fig.tight_layout()
    path = os.path.join(run_dir, "curves.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def grid(images, columns: int = 12):
    """images [N, 3, H, W] in [-1, 1] -> one [rows * (H + 1), columns * (W + 1), 3] array in [0, 1]
    (a 1-pixel gap between images)."""
    import torch

    n, _, h, w = images.shape
    rows = -(-n // columns)
    out = torch.ones(rows * (h + 1), columns * (w + 1), 3) * 0.5
    for i in range(n):
        r, c = divmod(i, columns)
        top, left = r * (h + 1), c * (w + 1)
        out[top:top + h, left:left + w] = ((images[i] + 1) / 2).clamp(0, 1).permute(1, 2, 0)  # [H, W, 3]
    return out.numpy()


def plot_flow(run_dir: str, before, after) -> str | None:
    """train_flow_grpo.py's picture, run_dir/curves.png: the training reward and the held-out
    reward against steps, and the held-out images (the same prompts and noise) at the first
    evaluation and at the end. None (and a line saying why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no picture of the run: matplotlib is not installed (pip install matplotlib)", flush=True)
        return None
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in rows if not r.get("final") and not r.get("event")]
    evals = [(r["step"], r["eval/reward"]) for r in steps if "eval/reward" in r]
    evals += [(r["step"] + 1, r["eval/reward"]) for r in rows if r.get("final") and "eval/reward" in r]
    shown = [(name, images) for name, images in (("before", before), ("after", after)) if images is not None]
    fig, axes = plt.subplots(1 + len(shown), 1, figsize=(10, 3.2 + 2.4 * len(shown)),
                             gridspec_kw={"height_ratios": [1.4] + [1] * len(shown)})
    curve = axes[0]
    curve.plot([r["step"] + 1 for r in steps], [r["rollout/reward"] for r in steps], lw=1, label="training")
    if evals:
        curve.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="held-out (ODE)")
    curve.set_xlabel("optimizer steps")
    curve.set_title("reward (mean per step)")
    curve.grid(alpha=0.3)
    curve.legend(loc="lower right", fontsize=8)
    for ax, (name, images) in zip(axes[1:], shown):
        ax.imshow(grid(images), interpolation="nearest")
        ax.set_title(f"held-out samples, {name} (one per prompt, same noise)")
        ax.axis("off")
    return _save(fig, plt, run_dir)


def plot_answers(path: str, images, questions, truths, before, after) -> str | None:
    """A vision-language model's answers to held-out questions, one panel an image: the question,
    the right answer and the model's answer before and after training (bench/vision.py). images:
    uint8 [H, W, 3] each. None (and a line saying why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no picture: matplotlib is not installed (pip install matplotlib)", flush=True)
        return None
    columns = min(6, len(images))
    rows = -(-len(images) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.1 * columns, 2.9 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, q, truth, b, a in zip(axes.flat, images, questions, truths, before, after):
        ax.imshow(image, interpolation="nearest")
        mark = lambda x: f"{x!r} {'ok' if x.strip() == truth else 'x'}"  # noqa: E731
        ax.set_title(f"{q}\nanswer {truth}; before {mark(b)}\nafter {mark(a)}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m utils.plot RUN_DIR")
    written = plot(sys.argv[1])
    if written:
        print(f"wrote {written}")
