"""train_flow_grpo.py end to end on CPU (gloo): the ratio is exactly 1 before the first update, a
2-rank step is the 1-rank step, resume after kill -9 is exact, and a short run raises the reward.
The model is the shipped assets/flow-tiny (assets/make.py --flow)."""
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import start_and_kill_rank_1
from test_fsdp import torchrun
from test_train_grpo import metrics

from tests.helpers.runs import assert_same_first_step
from utils.logger import differences

SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--train-steps", "4", "--eval-steps", "8",
         "--eval-prompts", "8", "--micro-batch-size", "8", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """The weights after one step with 1 and with 2 ranks (same seeds), and the runs' metrics."""
    out = {}
    for ranks in (1, 2):
        run = str(tmp_path_factory.mktemp("flow") / f"r{ranks}")
        torchrun(ranks, "train_flow_grpo.py", *SMALL, "--steps", "1", "--minibatches", "1",
                 "--eval-every", "0", "--run-dir", run)
        out[ranks] = run
    return out


def test_the_ratio_is_exactly_one_before_the_first_update(one_step):
    """One minibatch: every trained step's log-prob, recomputed with gradients by the loss, is the
    rollout's bit for bit (the same step code, the same rows per forward), so no ratio moves.
    (With --minibatches 2 the second minibatch's ratios move: the resume test's runs.)"""
    for run in one_step.values():
        rows = [r for r in metrics(run) if not r.get("final")]
        assert rows[0]["train/ratio_dev_max"] == 0.0 and rows[0]["train/clip_frac"] == 0.0, rows[0]
        assert rows[0]["train/trained_steps"] == 4 and rows[0]["train/grad_norm"] > 0


@pytest.mark.reordered
def test_two_ranks_step_as_one(one_step):
    """1 and 2 ranks, one optimizer step: the weights that took Adam's whole first step agree to
    rounding (tests/helpers/runs.py); not the others, such as the key bias's slice of each block's
    qkv.bias, whose gradient is 0 in exact arithmetic (no RoPE here: softmax ignores it)."""
    a = load_file(os.path.join(one_step[1], "final", "model.safetensors"))
    b = load_file(os.path.join(one_step[2], "final", "model.safetensors"))
    before = load_file("assets/flow-tiny/model.safetensors")
    assert_same_first_step(a, b, before, lr=1e-3)
    assert any(not torch.equal(a[k], before[k]) for k in a)
    ra, rb = (metrics(one_step[r])[0] for r in (1, 2))
    assert ra["rollout/reward"] == pytest.approx(rb["rollout/reward"], abs=1e-6)  # the same images


def test_resume_after_kill_9_is_exact(tmp_path):
    """6 steps straight == 3 steps, kill -9 of a rank, --resume auto: the same metrics and weights
    (every image's noise is seeded by its step and prompt, the data order by the step)."""
    flags = [*SMALL, "--steps", "6", "--save-every", "3", "--eval-every", "3"]
    straight = str(tmp_path / "straight")
    torchrun(2, "train_flow_grpo.py", *flags, "--run-dir", straight)
    killed = str(tmp_path / "killed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train_flow_grpo.py", *flags, "--run-dir", killed]
    p = start_and_kill_rank_1(cmd, killed, tmp_path / "killed.log")
    assert p.wait(timeout=120) != 0
    out = torchrun(2, "train_flow_grpo.py", *flags, "--run-dir", killed, "--resume", "auto").stdout
    assert "resumed from" in out
    assert not differences(metrics(straight), metrics(killed))
    rows = [r for r in metrics(straight) if not r.get("final")]  # 2 minibatches: the first unmoved
    assert all(r["train/ratio_dev_first"] == 0.0 and r["train/ratio_dev_max"] > 0 for r in rows)
    a = load_file(os.path.join(straight, "final", "model.safetensors"))
    b = load_file(os.path.join(killed, "final", "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.isfile(os.path.join(straight, "curves.png"))  # the curves and the samples


def test_twenty_steps_raise_the_reward(tmp_path):
    """The default rewards (colour + compressibility) on a small batch: measured with the code of
    commit 0bb74d1, the mean training reward of the first 5 steps 0.198, of the last 5 0.48 over 30
    steps; over the 20 this test runs (e393616, 2026-12-06), 0.233 -> 0.419, and 0.233 -> 0.420 with
    ATEN_CPU_CAPABILITY=default (the threshold leaves room for another CPU's rounding and the noise of
    16 images a step)."""
    run = str(tmp_path / "learn")
    torchrun(2, "train_flow_grpo.py", "--steps", "20", "--prompts-per-step", "4", "--num-generations", "4",
             "--train-steps", "6", "--eval-every", "0", "--no-save-final", "--run-dir", run, timeout=400)
    rewards = [r["rollout/reward"] for r in metrics(run) if not r.get("final")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert len(rewards) == 20 and last > first + 0.1, (first, last)


@pytest.mark.parametrize("flags,says", [
    (["--model", "assets/arith-tiny"], "--model: assets/arith-tiny/config.json: model_type 'qwen2' is not"),
    (["--rewards", "accuracy"], "--rewards accuracy: use colour, position, compressibility or module:"),
    (["--window", "11"], "--window 11"),
    (["--prompts-per-step", "3"], "a multiple of the 2 rank(s)"),
    (["--rewards", "colour", "--reward-weights", "1", "2"], "give one weight per term"),
    (["--num-generations", "1"], "2 or more"),
    (["--prompts-per-step", "6"], "x --minibatches (2)"),  # 3 prompts a rank: not split in 2 minibatches
    (["--eval-prompts", "73"], "at most the task's 72 prompts"),
    (["--rewards", "nosuch.module:fn"], "could not be loaded"),
    (["--save-hf-every", "5"], "drop --save-hf-every"),
])
def test_a_bad_flag_is_one_clear_error(flags, says, tmp_path):
    import tyro

    import train_flow_grpo
    from utils.errors import UserError

    args = tyro.cli(train_flow_grpo.Args, args=[*flags, "--run-dir", str(tmp_path / "run")])
    with pytest.raises(UserError) as e:
        train_flow_grpo.check_args(args, 2)
    assert says in str(e.value)
