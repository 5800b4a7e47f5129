"""The rebalancing decision (placement.rebalance), from made-up timings: a steady skew moves,
noise does not, a move that does not pay is not made, and no move leaves what `check` accepts."""
import random

from placement import Layout, rebalance

N = 4  # ranks


def window(trainer_busy, rollout_busy, steps=10, noise=0.0, seed=0):
    """Per-step reduced timings of an overlapped run (S >= 1): the slower side sets the step."""
    rng = random.Random(seed)
    rows = []
    for _ in range(steps):
        t, r = (x * (1 + rng.uniform(-noise, noise)) for x in (trainer_busy, rollout_busy))
        rows.append({"trainer_busy": t, "rollout_busy": r, "step_s": max(t, r)})
    return rows


def decide(rows, rollout=1, staleness=1, cost=5.0, horizon=100, threshold=0.1, since=50, gap=20, prompts=12):
    layout = Layout("disaggregate", N, dp=N - rollout, rollout=rollout)
    return rebalance(rows, layout, prompts, staleness, cost, horizon, threshold, since, gap)


def test_generation_bound_moves_a_trainer_to_rollout():
    """3 trainers idle while 1 rollout rank generates 3x longer: 2+2 halves the work per rollout rank."""
    move = decide(window(trainer_busy=1.0, rollout_busy=3.0))
    assert move.layout is not None and (move.layout.dp, move.layout.rollout) == (2, 2), move
    # train work 3 s over 2 trainers, generate work 3 s over 2 rollout ranks: 1.5 s per step
    assert abs(move.predicted_s - 1.5) < 1e-9 and abs(move.step_s - 3.0) < 1e-9
    assert abs(move.gain_s - ((3.0 - 1.5) * 100 - 5.0)) < 1e-9


def test_training_bound_moves_back():
    move = decide(window(trainer_busy=3.0, rollout_busy=1.0), rollout=2)  # 2+2, training the bottleneck
    assert (move.layout.dp, move.layout.rollout) == (3, 1), move  # 6 s of training over 3: 2 s


def test_a_balanced_split_stays_under_noise():
    for seed in range(20):
        move = decide(window(trainer_busy=1.0, rollout_busy=1.0, noise=0.15, seed=seed), rollout=2)
        assert move.layout is None and "under the threshold" in move.why, move


def test_a_move_that_does_not_pay_is_not_made():
    rows = window(trainer_busy=1.0, rollout_busy=3.0)
    move = decide(rows, cost=200.0, horizon=100)  # saves 1.5 s x 100 steps = 150 s < 200 s
    assert move.layout is None and "costs 200s" in move.why, move
    assert decide(rows, cost=200.0, horizon=200).layout is not None  # a longer run pays for it


def test_no_move_within_the_minimum_gap():
    move = decide(window(trainer_busy=1.0, rollout_busy=3.0), since=5, gap=20)
    assert move.layout is None and "minimum gap" in move.why


def test_only_layouts_that_check_accepts():
    """Every rollout rank serves as many trainers, and the trainers split the prompts: of 4
    ranks, K=3 would leave 1 trainer for 3 rollout ranks (refused) even when generation is all
    the work, so 2+2; with 10 prompts, 3 trainers (K=1) cannot split them."""
    move = decide(window(trainer_busy=0.1, rollout_busy=3.0), prompts=12)
    assert move.layout.rollout == 2
    move = decide(window(trainer_busy=3.0, rollout_busy=0.1), rollout=2, prompts=10)
    assert move.layout is None and "no other split" in move.why  # K=1 would leave 3 trainers for 10


def test_on_policy_runs_add_the_sides():
    """S=0: the sides take turns, so a step is train / T + generate / K; 3+1 with 1 s and 3 s:
    now 1 + 3 = 4 s, 2+2 gives 1.5 + 1.5 = 3 s."""
    rows = [{"trainer_busy": 1.0, "rollout_busy": 3.0, "step_s": 4.0}] * 10
    move = decide(rows, staleness=0)
    assert (move.layout.dp, move.layout.rollout) == (2, 2) and abs(move.predicted_s - 3.0) < 1e-9
