"""The GRPO script end to end under torchrun (2 ranks, gloo), with timeouts."""
import os

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp import torchrun

from utils.logger import differences, read_metrics

TINY = ["--steps", "3", "--prompts-per-step", "4", "--num-generations", "4", "--eval-every", "2",
        "--eval-prompts", "8", "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1"]


def no_eval(flags: list[str]) -> list[str]:
    """flags (TINY's) with the held-out evaluation off, its --eval-prompts gone with it (a flag set
    where it does nothing is refused)."""
    i = flags.index("--eval-prompts")
    return [*flags[:i], *flags[i + 2:], "--eval-every", "0"]


# conftest.grpo_run's: a reference model, a reward that fails now and then
SEEDED = TINY + ["--kl-coef", "0.05", "--rewards", "accuracy", "tests.helpers.rewards:flaky"]


def metrics(run_dir):
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def test_two_rank_run_trains_logs_every_step_and_is_seeded(grpo_run, tmp_path):
    a, stdout = grpo_run  # SEEDED's flags
    b = str(tmp_path / "b")
    assert "step    3/3" in stdout
    rows = metrics(a)
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and rows[-1]["final"]
    for r in rows[:3]:
        for key in ("rollout/reward", "train/kl", "train/clip_frac", "rollout/response_len",
                    "perf/generate_s", "perf/reference_s", "perf/train_s", "perf/sync_s", "perf/tokens_per_s",
                    "train/logprob_gap_mean", "train/logprob_gap_max"):
            assert key in r, key
        assert r["train/logprob_gap_max"] < 1e-4  # fp32 engine and trainer agree on the sampled tokens
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    assert sum(r["reward/failures"] for r in rows[:3]) > 0  # the flaky reward raised, and the run went on
    assert rows[1]["train/kl"] > 0  # the reference model exists and the policy moved away from it
    before = load_file("assets/arith-tiny/model.safetensors")
    after = load_file(os.path.join(a, "final", "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    torchrun(2, "train_grpo.py", *SEEDED, "--run-dir", b)
    assert differences(metrics(a), metrics(b)) == []  # the same command: the same sums in the same order


def test_world_size_that_does_not_fit_says_what_to_change(tmp_path):
    p = torchrun(2, "train_grpo.py", "--prompts-per-step", "3", "--run-dir", str(tmp_path), timeout=120,
                 check=False)
    assert p.returncode != 0
    assert "use a multiple such as [2, 4, 6]" in p.stderr


@pytest.mark.parametrize("what", ["missing", "no_tokenizer"])
def test_a_wrong_model_dir_says_what_is_wrong(tmp_path, what):
    import shutil
    import subprocess
    import sys

    model = tmp_path / "model"
    if what == "no_tokenizer":
        shutil.copytree("assets/arith-tiny", model, ignore=shutil.ignore_patterns("tokenizer.json"))
    cmd = [sys.executable, "train_grpo.py", "--model", str(model), "--run-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    want = "does not exist" if what == "missing" else "has no tokenizer.json"
    assert p.stderr.strip().splitlines()[-1].startswith("error: --model: ") and want in p.stderr, p.stderr


def test_nan_gradients_are_skipped_counted_then_stop_the_run(tmp_path):
    """--lr 1e30 blows the weights up to inf in the first step; the next steps' gradients are NaN:
    they are skipped and counted, and past --max-skipped-steps the run stops with a message."""
    run = str(tmp_path / "nan")
    p = torchrun(2, "train_grpo.py", *TINY, "--steps", "6", "--lr", "1e30", "--max-skipped-steps", "2",
                 "--run-dir", run, check=False)
    assert p.returncode != 0
    assert "3 steps had NaN/inf gradients (--max-skipped-steps 2)" in p.stdout + p.stderr
    rows = metrics(run)
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 2, 3]


def test_a_short_default_run_raises_the_training_reward(tmp_path):
    """A change that breaks learning fails here: 50 steps with the default settings (seed 0) lift
    the mean training reward of the last 10 steps clearly above that of the first 10 (measured
    0.288 -> 0.398; the threshold leaves room for another CPU's float rounding and noise)."""
    run = str(tmp_path / "learn")
    torchrun(2, "train_grpo.py", "--steps", "50", "--eval-every", "0", "--save-every", "0", "--no-save-final",
             "--run-dir", run)
    rewards = [r["rollout/reward"] for r in metrics(run) if not r.get("final")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert len(rewards) == 50 and last > first + 0.04, (first, last)


def test_the_main_job_prints_no_warning(tmp_path):
    """The README's main job, shortened, under torchrun itself (a forked rank would inherit the
    server's warnings already shown): no UserWarning or other warning on either stream. FSDP2 warned
    at the first backward that the model's root returned a view (models.decoder.token_logprobs)."""
    p = torchrun(2, "train_grpo.py", "--steps", "2", "--run-dir", str(tmp_path), fresh=True, timeout=180)
    assert "summary |" in p.stdout
    warned = [line for line in (p.stdout + p.stderr).splitlines() if "Warning" in line or "warn" in line]
    assert warned == []
