"""The components the step loops call: chosen from the flags before the loop, and doing nothing
when their flags are off (the end-to-end runs in the other tests check what they do when on)."""
from types import SimpleNamespace

import torch
import tyro

import rollouts
from rebalance import Arrival, Rebalancer
from rl import algos
from rl.mismatch import Correction
from train_grpo import Args
from utils.logger import Timer


def parse(*flags):
    return tyro.cli(Args, args=list(flags))


def plan(mode="colocate"):
    return SimpleNamespace(mode=mode, dp=2, rank=0, is_sampler=True)


def chosen(args, mode="colocate"):
    """The class names of the rollout `rollouts.choose` builds, outermost first."""
    rollout, names = rollouts.choose(None, None, [], args, plan(mode), None, {}), []
    while rollout is not None:
        names.append(type(rollout).__name__)
        rollout = getattr(rollout, "inner", None)
    return names


def test_the_rollout_is_the_placement_s_own_wrapped_by_the_flags():
    assert chosen(parse()) == ["OnPolicy"]
    assert chosen(parse("--placement", "disaggregate", "--max-staleness", "1")) == ["Ahead"]
    assert chosen(parse("--placement", "disaggregate")) == ["OnPolicy"]  # staleness 0: the colocate path
    assert chosen(parse("--placement", "partial"), "partial") == ["Streamed"]
    assert chosen(parse("--dynamic-sampling")) == ["DynamicSampling", "OnPolicy"]
    assert chosen(parse("--advantage", "remax")) == ["ReMax", "OnPolicy"]
    assert rollouts.choose(None, None, [], parse(), plan(), None, {}).saved() == ({}, {})  # no state to carry


def test_flags_keep_their_names_and_land_in_their_component():
    args = parse("--judge-samples", "3", "--ds-oversampling", "2", "--mismatch", "tis", "--rollout-ranks",
                 "1", "--rebalance-gap", "30", "--run-dir", "x", "--model", "m", "--rewards", "format",
                 "--overlong-buffer", "2", "--temperature", "0.5", "--param-dtype", "bfloat16")
    assert (args.judge.judge_samples, args.dynamic_sampling.ds_oversampling) == (3, 2.0)
    assert (args.sampling.temperature, args.compute.param_dtype) == (0.5, "bfloat16")
    assert (args.mismatch.mismatch, args.placement.rollout_ranks) == ("tis", 1)
    assert (args.rebalance.rebalance_gap, args.run_args.run_dir) == (30, "x")
    assert (args.data.model, args.reward.rewards, args.overlong.overlong_buffer) == ("m", ("format",), 2)


def test_components_off_do_nothing():
    batch = {"old_logp": torch.randn(2, 3), "loss_mask": torch.ones(2, 3)}
    before = {k: v.clone() for k, v in batch.items()}
    correction = Correction(parse().mismatch, actor=None)  # off: it never calls the actor
    correction.apply(batch, Timer())
    assert batch.keys() == before.keys() and all(torch.equal(batch[k], before[k]) for k in batch)
    assert (correction.sums, correction.maxes, correction.metrics({}, {})) == ({}, {}, {})
    arrival = Arrival("runs/x", {}, 0.0)
    rebalancer = Rebalancer(parse(), plan("disaggregate"), None, arrival, start=0, log=None)
    assert not rebalancer.after_step(0, {"trainer_busy": 1.0, "rollout_busy": 9.0, "step_s": 10.0})
    assert rebalancer.exit_code == 0 and rebalancer.window == []


def test_the_menu_dicts_call_the_functions_they_name():
    torch.manual_seed(0)
    n, args = 4, parse("--advantage", "rloo", "--num-generations", "4")
    rewards, scored = torch.rand(8), torch.tensor([True] * 7 + [False])
    mask = torch.ones(8, 3)
    got = SimpleNamespace(rewards=rewards, scored=scored, baseline=torch.tensor([0.5, 0.25]))
    rloo = algos.ADVANTAGES["rloo"](got, {"loss_mask": mask}, args, None)
    want = algos.rloo_advantages(rewards.view(-1, n), scored.view(-1, n)).reshape(-1, 1).expand(8, 3)
    assert torch.equal(rloo, want)
    remax_args = parse("--advantage", "remax", "--num-generations", "4")
    remax = algos.ADVANTAGES["remax"](got, {"loss_mask": mask}, remax_args, None)
    assert torch.equal(remax[:, 0], (rewards - torch.tensor([0.5] * 4 + [0.25] * 4)) * scored)
    logp, old, adv = torch.randn(8, 3), torch.randn(8, 3), torch.randn(8, 3)
    a = parse("--policy-loss", "cispo")
    for got_, want in zip(algos.POLICY_LOSSES["cispo"](logp, old, adv, mask, a),
                          algos.cispo_loss(logp, old, adv, a.clip_low, a.clip_high)):
        assert torch.equal(got_, want)
