"""Comparing two runs' metrics files: every key but the wall-clock ones must match."""
import json
import subprocess
import sys

from test_fsdp import ROOT

from utils.logger import differences


def test_differences_ignore_timings_only():
    a = [{"step": 0, "rollout/reward": 0.5, "perf/step_s": 1.0, "placement/idle_share": 0.1}]
    same = [{"step": 0, "rollout/reward": 0.5, "perf/step_s": 2.0, "placement/idle_share": 0.3}]
    assert differences(a, same) == []
    assert differences(a, [{"step": 0, "rollout/reward": 0.5000001}]) == ["step 0 rollout/reward: 0.5 != 0.5000001"]
    assert differences(a, [{"step": 0, "rollout/reward": 0.5, "train/kl": 0.0}]) == [
        "step 0 train/kl: (absent) != 0.0"]
    assert differences(a, a + a) == ["1 rows against 2"]


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
