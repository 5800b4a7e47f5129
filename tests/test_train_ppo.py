"""The PPO script end to end under torchrun (gloo, with timeouts): it trains and logs the critic's
numbers, is seeded, runs disaggregated as it runs colocated, resumes exactly after kill -9 (critic
and KL controller included), and takes a Bradley-Terry reward model's scores as a reward term
(in the GRPO script too)."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import same_run, start_and_kill_rank_1
from test_fsdp import torchrun
from test_train_grpo import TINY, metrics

from assets.make import random_reward_model
from tests.helpers.runs import differences_within
from utils.logger import differences

PPO_TINY = ["--steps", "3", "--prompts-per-step", "8", "--eval-every", "2", "--eval-prompts", "8",
            "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1"]
ADAPTIVE = ["--kl-coef", "0.05", "--kl-target", "0.01", "--kl-horizon", "100"]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """(run dir, stdout) of a 2-rank colocated PPO run with the adaptive KL controller, launched
    once for the tests that read it (what it logs, its rerun, its disaggregated twin)."""
    path = str(tmp_path_factory.mktemp("ppo") / "run")
    return path, torchrun(2, "train_ppo.py", *PPO_TINY, *ADAPTIVE, "--run-dir", path).stdout


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A random Bradley-Terry reward model on the shipped policy's decoder shape and tokenizer."""
    path = str(tmp_path_factory.mktemp("rm"))
    random_reward_model(path, "assets/arith-tiny", seed=5, std=0.1)
    return path


def test_two_rank_ppo_trains_logs_the_critic_and_is_seeded(ppo_run, tmp_path):
    (a, stdout), b = ppo_run, str(tmp_path / "b")
    assert "step    3/3" in stdout and "vloss" in stdout and "critic update" in stdout
    rows = metrics(a)
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and rows[-1]["final"]
    for r in rows[:3]:
        for key in ("rollout/reward", "train/kl", "train/kl_coef", "train/value_loss",
                    "train/value_clip_frac", "train/explained_variance", "train/pg_loss", "perf/values_s",
                    "perf/critic_train_s",
                    "perf/reference_s", "perf/train_s", "perf/sync_s", "train/logprob_gap_max"):
            assert key in r, key
        assert r["train/logprob_gap_max"] < 1e-4  # fp32 engine and trainer agree on the sampled tokens
    # the adaptive controller moved the coefficient by Ziegler et al.'s rule, at most 20% * 8 / 100 a step
    coefs = [r["train/kl_coef"] for r in rows[:3]]
    assert coefs[0] == 0.05 and coefs[1] != coefs[0]
    for before, after in zip(coefs, coefs[1:]):
        assert abs(after / before - 1) <= 0.2 * 8 / 100 + 1e-9
    assert rows[1]["train/value_loss"] > 0 and rows[1]["train/kl"] != 0  # a critic and a reference exist
    # a zero head, then it learns
    assert rows[0]["train/value_mean"] == 0 and rows[1]["train/value_mean"] != 0
    before = load_file("assets/arith-tiny/model.safetensors")
    after = load_file(os.path.join(a, "final", "model.safetensors"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)

    torchrun(2, "train_ppo.py", *PPO_TINY, *ADAPTIVE, "--run-dir", b)
    assert differences(metrics(a), metrics(b)) == []  # the same command: the same sums in the same order


@pytest.mark.reordered
def test_ppo_disaggregated_on_policy_is_the_colocate_run(ppo_run, tmp_path):
    """2 trainers + 1 rollout rank at --max-staleness 0 against colocate on 2 ranks (ppo_run,
    with the adaptive KL controller): the same prompts, seeds and exactly broadcast weights, so
    every non-timing metric is the same, to rounding (3 ranks get other thread counts than 2:
    tests/helpers/runs.py)."""
    co, dis = ppo_run[0], str(tmp_path / "dis")
    torchrun(3, "train_ppo.py", *PPO_TINY, *ADAPTIVE, "--placement", "disaggregate", "--rollout-ranks", "1",
             "--run-dir", dis)
    a, b = metrics(co), metrics(dis)
    assert len(a) == 4 and differences_within(a, b) == []
    assert all(r["perf/sync_bytes"] > 0 for r in b[:3])


def test_ppo_kill_9_then_resume_is_exact_with_critic_and_kl_controller(tmp_path):
    flags = [f for f in PPO_TINY if f not in ("--steps", "3")]
    flags += ["--steps", "8", "--save-every", "2", *ADAPTIVE]
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    torchrun(2, "train_ppo.py", *flags, "--run-dir", straight)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train_ppo.py", *flags, "--run-dir", killed]
    p = start_and_kill_rank_1(cmd, killed, tmp_path / "killed.log")
    assert p.wait(timeout=120) != 0
    assert len(metrics(killed)) < len(metrics(straight))  # stopped part-way
    meta = json.load(open(os.path.join(straight, "checkpoints", "step_00000008", "meta.json")))
    assert meta["critic"]["architectures"] == ["Qwen2ForSequenceClassification"]
    assert "critic_scheduler" in meta
    assert meta["kl_coef"] != 0.05  # the controller's moved coefficient is what resumes
    out = torchrun(2, "train_ppo.py", *flags, "--resume", "auto", "--run-dir", killed).stdout
    assert "resumed from" in out
    same_run(straight, killed)  # every metric (kl_coef, value loss, explained variance) and the weights


def test_a_grpo_checkpoint_does_not_resume_ppo(tmp_path):
    import subprocess

    run = str(tmp_path / "run")
    torchrun(2, "train_grpo.py", *TINY, "--save-every", "1", "--steps", "1", "--run-dir", run)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train_ppo.py", *PPO_TINY, "--resume", "auto", "--run-dir", run]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0 and "has no critic (a GRPO run's?)" in p.stderr


@pytest.mark.parametrize("script,tiny", [("train_ppo.py", PPO_TINY), ("train_grpo.py", TINY)])
def test_a_reward_model_is_a_weighted_reward_term(tmp_path, reward_model_dir, script, tiny):
    run = str(tmp_path / "run")
    critic = ["--critic-model", reward_model_dir] if script == "train_ppo.py" else []  # PPO: its critic too
    torchrun(2, script, *tiny, "--steps", "2", "--rewards", "accuracy", "rm", "--reward-weights", "1", "0.5",
             "--reward-model", reward_model_dir, *critic, "--run-dir", run)
    rows = metrics(run)[:2]
    if critic:  # the reward model's head values the states from the first step
        assert rows[0]["train/value_mean"] != 0
    for r in rows:
        assert r["perf/reward_model_s"] > 0
        expected = r["rollout/reward/accuracy"] + 0.5 * r["rollout/reward/rm"]
        assert abs(r["rollout/reward"] - expected) < 1e-5
    assert rows[0]["rollout/reward/rm"] != 0  # a random score head scores something
