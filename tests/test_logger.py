"""Comparing two runs' metrics files: every key but the wall-clock ones must match (or, for runs
whose float sums run in another order, match to rounding); --track's wandb records."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from test_fsdp import ROOT
from test_train_grpo import TINY, metrics

from tests.helpers.runs import differences_within
from utils.logger import differences


def test_differences_ignore_timings_only():
    a = [{"step": 0, "rollout/reward": 0.5, "perf/step_s": 1.0, "placement/idle_share": 0.1}]
    same = [{"step": 0, "rollout/reward": 0.5, "perf/step_s": 2.0, "placement/idle_share": 0.3}]
    assert differences(a, same) == []
    assert differences(a, [{"step": 0, "rollout/reward": 0.5000001}]) == [
        "step 0 rollout/reward: 0.5 != 0.5000001"]
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


def wandb_history(run_dir: str) -> dict[int, dict]:
    """{step: the values logged at it} from the offline run's .wandb file under run_dir: a
    LevelDB-style log (32 KiB blocks of chunks, each a 7-byte header: crc32c, length, type) of
    wandb's own protobuf Records after a 7-byte ':W&B' header. wandb >= 0.2x has no Python
    reader of it any more (its Go core reads it), so the chunks are joined here."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    history, pos, record, block = {}, 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # padding to the end of the block
            pos += block - pos % block
            continue
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            r = wandb_internal_pb2.Record()
            r.ParseFromString(record)
            record = b""
            if r.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in r.history.item}
                history[row["_step"]] = row
    return history


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb not installed (requirements-dev.txt)")
def test_track_sends_every_metric_to_wandb_offline(tmp_path):
    """--track with WANDB_MODE=offline: each step's metrics, as metrics.jsonl has them, are in
    the run's local wandb records (a step logged twice, as the last step and the final
    evaluation are, is one wandb row with both)."""
    run = str(tmp_path / "run")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing in ~
        env[name] = str(tmp_path / name.lower())
    p = subprocess.run([sys.executable, "train_grpo.py", *TINY, "--track", "--run-dir", run], cwd=ROOT,
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    want = {}
    for row in metrics(run):
        want.setdefault(row["step"], {}).update(row)
    got = wandb_history(run)
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for step, row in want.items():
        assert {k: got[step].get(k, "(absent)") for k in row} == row, step
    assert want[2]["final"] and "train/grad_norm" in got[2] and "eval/accuracy" in got[2]


def test_track_without_wandb_says_how_to_install_it_in_one_line(tmp_path):
    """`import wandb` made to fail (a wandb.py first on PYTHONPATH that raises ImportError):
    a 2-rank --track run ends with one error line, which says how to install wandb, and no
    traceback."""
    stub = tmp_path / "no_wandb"
    stub.mkdir()
    (stub / "wandb.py").write_text("raise ImportError('wandb is made unimportable by the test')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(stub)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "train_grpo.py", *TINY, "--track", "--run-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1, errors or p.stderr[-3000:]
    assert "pip install wandb" in errors[0], errors
    assert "[rank0]: Traceback" not in p.stderr and "[rank1]: Traceback" not in p.stderr, p.stderr[-3000:]
