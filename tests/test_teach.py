"""teach_grpo.py, the teaching script, is train_grpo.py's default run: with the same flags both log
the same metrics and end with the same weights, to the bit, on 1 rank and on 2 (under torchrun,
gloo). They make the same sums in the same order (the same micro-batches, the same reductions), so
they are compared bit for bit, as a seeded rerun is (tests/helpers/runs.py), not to rounding."""
import os

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp import ROOT, torchrun

from utils.logger import differences, read_metrics

# both scripts take these flags alike; the rest stay at their defaults. An evaluation every 2
# steps (before steps 0, 2 and 4, and after the last) over fewer held-out prompts than the 256
FLAGS = ["--steps", "5", "--eval-every", "2", "--eval-prompts", "64"]
# the runs: on 1 rank the default 512 completions train in micro-batches of 256 (the gradient reduced
# after the last only); on 2 ranks each rank's 256 fit in one, so a third run splits them too
RUNS = {"1-rank": (1, []), "2-ranks": (2, []), "2-ranks-micro-batches": (2, ["--micro-batch-size", "64"])}
# one intra-op thread per rank, as under the suite's 2 workers (conftest.py): the two scripts agree at
# any count, and a lone rank's 2-thread pool on a busy machine ran 9x slower (192 s against 21 s)
ENV = {"RL_THREADS": "1"}


@pytest.mark.parametrize("run", RUNS)
def test_the_teaching_script_gives_the_default_runs_metrics_and_weights(tmp_path, run):
    nproc, flags = RUNS[run]
    runs = {script: str(tmp_path / script) for script in ("teach_grpo.py", "train_grpo.py")}
    for script, run_dir in runs.items():
        torchrun(nproc, script, *FLAGS, *flags, "--run-dir", run_dir, timeout=240, env=ENV)
    teach, full = (read_metrics(os.path.join(d, "metrics.jsonl")) for d in runs.values())
    assert [r["step"] for r in teach] == [0, 1, 2, 3, 4, 4] and teach[-1]["final"]
    assert [i for i, r in enumerate(teach) if "eval/accuracy" in r] == [0, 2, 4, 5]
    assert {"rollout/reward", "rollout/response_len", "rollout/groups_all_same", "train/pg_loss",
            "train/clip_frac", "train/grad_norm", "train/lr", "train/rows_trained"} <= teach[0].keys()
    # every key the teaching script logs is one that train_grpo.py logs: compared bit for bit (the
    # 6 decimals metrics.jsonl keeps; timings left out)
    assert len(teach) == len(full)
    missing = [(r["step"], k) for r, s in zip(teach, full) for k in r if k not in s]
    assert missing == []
    assert differences(teach, [{k: s[k] for k in r} for r, s in zip(teach, full)]) == []

    # the final weights (final/, HF format): equal to the bit, and moved by training
    before = load_file(os.path.join(ROOT, "assets", "arith-tiny", "model.safetensors"))
    a, b = (load_file(os.path.join(d, "final", "model.safetensors")) for d in runs.values())
    assert a.keys() == b.keys() == before.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert any(not torch.equal(a[k], before[k]) for k in a)
