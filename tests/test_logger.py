"""Comparing two runs' metrics files: every key but the wall-clock ones must match (or, for runs
whose float sums run in another order, match to rounding)."""
import json
import subprocess
import sys

from test_fsdp import ROOT

from tests.helpers.runs import differences_within
from utils.logger import differences


def test_differences_ignore_timings_only():
    a = [{"step": 0, "rollout/reward": 0.5, "perf/step_s": 1.0, "placement/idle_share": 0.1}]
    same = [{"step": 0, "rollout/reward": 0.5, "perf/step_s": 2.0, "placement/idle_share": 0.3}]
    assert differences(a, same) == []
    assert differences(a, [{"step": 0, "rollout/reward": 0.5000001}]) == ["step 0 rollout/reward: 0.5 != 0.5000001"]
    assert differences(a, [{"step": 0, "rollout/reward": 0.5, "train/kl": 0.0}]) == [
        "step 0 train/kl: (absent) != 0.0"]
    assert differences(a, a + a) == ["1 rows against 2"]


def test_runs_in_another_float_order_agree_to_rounding_not_more():
    """tests/helpers/runs.py: last-bit noise (the AVX-512 machine's grad_norm, a log-prob gap of
    1e-6 against 2e-6, a loss cancelling to ~0) passes; a changed sample, a count or a noise
    metric above its bound does not."""
    a = [{"step": 0, "train/grad_norm": 7.611651, "train/pg_loss": -0.0, "train/logprob_gap_max": 1e-06,
          "rollout/reward": 0.3125, "rollout/ds_waves": 2, "final": False, "perf/step_s": 1.0}]
    b = [{**a[0], "train/grad_norm": 7.611649, "train/pg_loss": 2e-06, "train/logprob_gap_max": 2e-06,
          "perf/step_s": 3.0}]
    assert differences_within(a, b) == []
    assert differences(a, b) != []  # what bit-equality would say
    changed = [{**b[0], "rollout/reward": 0.375, "rollout/ds_waves": 3, "train/logprob_gap_max": 0.01}]
    assert differences_within(a, changed) == [
        "step 0 rollout/ds_waves: 2 != 3",
        "step 0 rollout/reward: 0.3125 != 0.375 (off by 0.062 > 1.2e-05)",
        "step 0 train/logprob_gap_max: 1e-06, 0.01 (noise, bounded by 0.0001)"]
    assert differences_within(a, [{**a[0], "train/grad_norm": 7.6118}]) != []  # 2e-5 relative: too far
    assert differences_within(a, a + a) == ["1 rows against 2"]


def test_the_command_line_says_identical_or_exits_1(tmp_path):
    rows = [{"step": 0, "rollout/reward": 0.5, "perf/step_s": 1.0}, {"step": 1, "rollout/reward": 0.6}]
    for name, rs in (("a", rows), ("b", rows), ("c", rows[:1] + [{"step": 1, "rollout/reward": 0.7}])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    cmd = [sys.executable, "-m", "utils.logger"]
    same = subprocess.run([*cmd, tmp_path / "a.jsonl", tmp_path / "b.jsonl"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert same.returncode == 0 and "identical" in same.stdout
    other = subprocess.run([*cmd, tmp_path / "a.jsonl", tmp_path / "c.jsonl"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert other.returncode == 1 and "step 1 rollout/reward: 0.6 != 0.7" in other.stdout

