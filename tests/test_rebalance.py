"""The rebalancing decision (rebalance.decide), from made-up timings: a steady skew moves,
noise does not, a move that does not pay is not made, and no move leaves what `check` accepts."""
import random

from placement import Layout
from rebalance import decide as rebalance
from rebalance import splits

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
    layout = Layout("disaggregate", N, dp=N - rollout, rollout_ranks=rollout)
    fits = splits(N, prompts, staleness)
    return rebalance(rows, layout, fits, staleness, cost, horizon, threshold, since, gap)


def test_generation_bound_moves_a_trainer_to_rollout():
    """3 trainers idle while 1 rollout rank generates 3x longer: 2+2 halves the work per rollout rank."""
    move = decide(window(trainer_busy=1.0, rollout_busy=3.0))
    assert move.layout is not None and (move.layout.dp, move.layout.rollout_ranks) == (2, 2), move
    # train work 3 s over 2 trainers, generate work 3 s over 2 rollout ranks: 1.5 s per step
    assert abs(move.predicted_s - 1.5) < 1e-9 and abs(move.step_s - 3.0) < 1e-9
    assert abs(move.gain_s - ((3.0 - 1.5) * 100 - 5.0)) < 1e-9


def test_training_bound_moves_back():
    move = decide(window(trainer_busy=3.0, rollout_busy=1.0), rollout=2)  # 2+2, training the bottleneck
    assert (move.layout.dp, move.layout.rollout_ranks) == (3, 1), move  # 6 s of training over 3: 2 s


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
    assert move.layout.rollout_ranks == 2
    move = decide(window(trainer_busy=3.0, rollout_busy=0.1), rollout=2, prompts=10)
    assert move.layout is None and "no other split" in move.why  # K=1 would leave 3 trainers for 10


def test_on_policy_runs_add_the_sides():
    """S=0: the sides take turns, so a step is train / T + generate / K; 3+1 with 1 s and 3 s:
    now 1 + 3 = 4 s, 2+2 gives 1.5 + 1.5 = 3 s."""
    rows = [{"trainer_busy": 1.0, "rollout_busy": 3.0, "step_s": 4.0}] * 10
    move = decide(rows, staleness=0)
    assert (move.layout.dp, move.layout.rollout_ranks) == (2, 2) and abs(move.predicted_s - 3.0) < 1e-9


def test_partial_moves_the_sampler_judge_split():
    """Partial, 4 ranks, 1 s of training per step: samplers and judges stream side by side, so
    the rollout takes max(generate / S, judge / G). 1 sampler + 3 judges with 4 s of generation
    and 3 s of judging: 4 s, a 5 s step; 2 + 2 gives max(2, 1.5) + 1 = 3 s, 3 + 1 max(1.33, 3) + 1 =
    4 s. Judge-bound the other way (1 s and 6 s at 3 + 1: a 7 s step): 1 + 3, max(1, 2) + 1 = 3 s."""
    def partial(sampler, generate, judge, step_s):
        layout = Layout("partial", N, dp=N, sampler_ranks=sampler)
        row = {"trainer_busy": 1.0, "rollout_busy": 0.0, "sampler_busy": generate, "judge_busy": judge,
               "step_s": step_s}
        return rebalance([row] * 10, layout, splits(N, 12, 0, "partial"), 0, 5.0, 100, 0.1, 50, 20)

    move = partial(1, 4.0, 3.0, 5.0)
    assert move.layout.sampler_ranks == 2 and abs(move.predicted_s - 3.0) < 1e-9, move
    assert "1 -> 2 sampler ranks" in move.why
    move = partial(3, 1.0, 6.0, 7.0)
    assert move.layout.sampler_ranks == 1 and abs(move.predicted_s - 3.0) < 1e-9, move


# ---------------------------------------------------------------- the move, end to end

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402
from test_fsdp import ROOT  # noqa: E402
from test_train_grpo import metrics  # noqa: E402

from tests.helpers.runs import differences_within  # noqa: E402
from utils.errors import UserError  # noqa: E402

MOVE_RUN = ["--steps", "6", "--prompts-per-step", "12", "--num-generations", "4", "--eval-every", "0",
            "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1", "--placement", "disaggregate",
            "--rollout-ranks", "1"]
FORCED = ["--rebalance", "--rebalance-window", "1", "--rebalance-gap", "1", "--rebalance-force", "3", "2"]
THERE_AND_BACK = [*FORCED, "5", "1"]  # 3 + 1 -> 2 + 2 after step 3, back to 3 + 1 after step 5


def launch(args, run_dir, restarts=0, log=None, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           f"--max-restarts={restarts}", "train_grpo.py", *args, "--run-dir", run_dir]
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def finished(p, timeout=300):
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def unmoved(tmp_path_factory):
    """The run the moves are compared with: 3 trainers + 1 rollout rank throughout."""
    run = str(tmp_path_factory.mktemp("still"))
    finished(launch(MOVE_RUN, run))
    return [r for r in metrics(run) if not r.get("event")]


def same_run(a, b):
    """The same prompts, seeds and (exactly carried) weights make every reward and length
    identical; losses and gradients of another number of trainers agree to 1e-4 (tests/helpers/runs.py,
    with 10x its room for 6 steps of the same float sums in another order); rows_trained counts each
    trainer's padded rows, so it follows the split."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(6)) + [5]
    drop = {"train/rows_trained"}
    assert differences_within([{k: v for k, v in r.items() if k not in drop} for r in a],
                              [{k: v for k, v in r.items() if k not in drop} for r in b], rel=1e-4) == []
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k.startswith("rollout/")} == \
            {k: v for k, v in y.items() if k.startswith("rollout/")}, x["step"]


@pytest.mark.reordered
def test_moves_in_process_there_and_back_carry_the_state_exactly(tmp_path, unmoved):
    """4 ranks, on-policy: after step 3 the ranks move in process from 3 trainers + 1 rollout rank
    to 2 + 2 (rank 2 becomes a rollout rank, rank 3 keeps its engine), after step 5 back to 3 + 1
    (rank 2 trains again, its state arriving from trainer 0): no restart (torchrun has none to
    give). After each move the digest of the full weights, Adam's moments and the LR equals the
    one before (the run checks it and logs placement/move_state_equal; a mismatch would stop it),
    and the run is the unmoved one, step for step."""
    run = str(tmp_path / "run")
    out = finished(launch([*MOVE_RUN, *THERE_AND_BACK], run))
    assert "1 -> 2 rollout ranks: forced" in out and "2 -> 1 rollout ranks: forced" in out, out[-3000:]
    assert out.count("(in process)") == 2 and "resumed from" not in out
    assert "4 rank(s), disaggregate (2 trainer(s))" in out
    state = json.load(open(os.path.join(run, "placement.json")))
    assert [(m["step"], m["from"], m["to"]) for m in state["moves"]] == [(3, 1, 2), (5, 2, 1)]
    rows = metrics(run)
    events = [r for r in rows if r.get("event")]
    assert [e["event"] for e in events] == ["placement/rebalance", "placement/moved"] * 2
    for moved in events[1::2]:
        assert moved["placement/move_state_equal"] == 1.0 and moved["placement/move_in_process"] == 1.0
        assert 0 < moved["placement/move_state_s"] < moved["placement/move_s"]
        assert moved["placement/move_state_bytes"] > 3 * 4 * 0.8e6  # weights and two moments, fp32
    same_run(unmoved, [r for r in rows if not r.get("event")])


@pytest.mark.reordered
def test_a_move_by_restart_carries_the_state_exactly(tmp_path, unmoved):
    """--rebalance-restart, the fallback: a checkpoint, the new layout, torchrun's restart, the
    resume; the same checks and the same run."""
    run = str(tmp_path / "run")
    out = finished(launch([*MOVE_RUN, *FORCED, "--rebalance-restart"], run, restarts=1))
    assert "(torchrun restarts them)" in out and "resumed from" in out, out[-3000:]
    assert "4 rank(s), disaggregate (2 trainer(s))" in out
    rows = metrics(run)
    moved = [r for r in rows if r.get("event") == "placement/moved"]
    assert len(moved) == 1 and moved[0]["placement/move_state_equal"] == 1.0
    assert moved[0]["placement/move_in_process"] == 0.0
    same_run(unmoved, [r for r in rows if not r.get("event")])


def test_moves_with_staleness_keep_the_bound(tmp_path):
    """--max-staleness 1: the prompts sent ahead of a move are generated again after it, by the
    policy of the move's step, so the samples' ages (and so the metrics) differ from a run without
    the moves; what must hold is the bound, on every step, and the exact state."""
    run = str(tmp_path / "run")
    out = finished(launch([*MOVE_RUN, *THERE_AND_BACK, "--max-staleness", "1"], run))
    rows = metrics(run)
    steps = [r for r in rows if not r.get("event") and not r.get("final")]
    assert len(steps) == 6 and all(r["placement/staleness_max"] <= 1 for r in steps), out[-3000:]
    assert any(r["placement/staleness_max"] == 1 for r in steps)  # it did overlap
    moved = [r for r in rows if r.get("event") == "placement/moved"]
    assert [r["placement/move_state_equal"] for r in moved] == [1.0] * 2


def test_a_rank_that_dies_during_a_move_fails_the_job_and_the_checkpoint_resumes(tmp_path):
    """Rank 1 killed inside the move (after its checkpoint, while every rank waits in the move:
    the test hook RL_TEST_MOVE_PAUSE_S holds them there) fails the job: torchrun names the rank and
    the signal. The move's checkpoint and layout are intact: a new launch with --resume auto goes on
    from them, in the new layout."""
    run, log = str(tmp_path / "run"), str(tmp_path / "out.log")
    p = launch([*MOVE_RUN, *FORCED], run, log=log, env={"RL_TEST_MOVE_PAUSE_S": "20"})
    deadline = time.monotonic() + 240
    while "(in process)" not in open(log).read():  # every rank is now in the move, waiting
        assert time.monotonic() < deadline and p.poll() is None, open(log).read()[-3000:]
        time.sleep(0.05)
    for c in psutil.Process(p.pid).children():
        if c.environ().get("RANK") == "1":
            c.kill()
    assert p.wait(timeout=120) != 0
    out = open(log).read()
    assert "rebalance after step 3" in out and "exitcode  : -9" in out, out[-3000:]
    assert json.load(open(os.path.join(run, "placement.json")))["rollout_ranks"] == 2
    again = finished(launch([*MOVE_RUN, "--rebalance", "--resume", "auto"], run))
    assert "resumed from" in again and "step_00000003" in again, again[-3000:]
    assert "4 rank(s), disaggregate (2 trainer(s))" in again and "final policy" in again


def check(monkeypatch, restarts, *flags):
    import tyro

    from train_grpo import Args, check_args

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(restarts))
    args = tyro.cli(Args, args=[*MOVE_RUN, *flags])
    with pytest.raises(UserError) as e:
        check_args(args, 4)
    return str(e.value)


def test_the_rebalance_flags_say_what_to_change(monkeypatch):
    assert "add --placement disaggregate" in check(monkeypatch, 1, "--rebalance", "--placement", "colocate",
                                                   "--rollout-ranks", "0")
    said = check(monkeypatch, 0, "--rebalance", "--rebalance-restart")
    assert "launch with torchrun --max-restarts N" in said
    assert "add --rebalance" in check(monkeypatch, 1, "--rebalance-restart")
    said = check(monkeypatch, 0, "--rebalance", "--engine", "vllm")
    assert "add --rebalance-restart, or --engine native" in said
    said = check(monkeypatch, 1, "--rebalance", "--rebalance-force", "3", "3")
    assert "can move from 1 rollout ranks to [2]" in said
    said = check(monkeypatch, 1, "--rebalance", "--rebalance-force", "3", "2", "5", "2")
    assert "--rebalance-force 5 2: a world of 4 can move from 2 rollout ranks to [1]" in said
    assert "pairs STEP K" in check(monkeypatch, 1, "--rebalance", "--rebalance-force", "3")
    assert "it forces a --rebalance move" in check(monkeypatch, 1, "--rebalance-force", "3", "2")
    assert "at least --rebalance-window" in check(monkeypatch, 1, "--rebalance", "--rebalance-gap", "2")
