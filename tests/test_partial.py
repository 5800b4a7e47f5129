"""The judge in a run: colocated (in-process, taking turns) and G-Core's partial placement
(first S ranks sample while the others judge finished chunks, all ranks train), with the same
rewards; a judge that fails is counted, and a run whose every reward fails stops clearly."""
import os

import pytest
from test_fsdp import torchrun

import placement
from tests.helpers.runs import differences_within, weights_apart
from utils.errors import UserError
from utils.logger import read_metrics

TINY = ["--steps", "3", "--prompts-per-step", "4", "--num-generations", "4", "--eval-every", "2",
        "--eval-prompts", "8", "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1"]
JUDGE = ["--rewards", "accuracy", "judge", "--reward-weights", "1", "0.5",
         "--judge-model", "assets/judge-tiny", "--judge-samples", "2", "--judge-chunk", "2"]
PARTIAL = ["--placement", "partial", "--sampler-ranks", "1"]


def metrics(run_dir):
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def test_partial_sizes_that_do_not_fit_say_what_would():
    with pytest.raises(UserError, match=r"fits: --sampler-ranks in \[1, 2\]"):
        placement.layout_of("partial", 3, 6, sampler_ranks=3)
    with pytest.raises(UserError, match=r"fits: --sampler-ranks in \[1\]"):
        placement.layout_of("partial", 2, 4, sampler_ranks=0)
    with pytest.raises(UserError, match="at least 2 ranks"):
        placement.layout_of("partial", 1, 4, sampler_ranks=1)
    with pytest.raises(UserError, match="on-policy"):
        placement.layout_of("partial", 2, 4, max_staleness=1, sampler_ranks=1)
    with pytest.raises(UserError, match="applies to --placement partial only"):
        placement.layout_of("colocate", 2, 4, sampler_ranks=1)
    with pytest.raises(UserError, match="does not split over 3 trainer ranks"):
        placement.layout_of("partial", 3, 4, sampler_ranks=1)
    layout = placement.layout_of("partial", 5, 10, sampler_ranks=2)
    assert [layout.sampler_of(r) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [layout.judges_of(s) for s in range(2)] == [[2, 4], [3]]
    assert placement.layout_of("partial", 3, 6, sampler_ranks=2).judges_of(1) == [2]  # G < S: shared


@pytest.mark.reordered
def test_partial_placement_is_the_colocate_run_with_the_same_judge(tmp_path):
    """Every rank a controller of its own prompts with per-prompt seeds, verdicts seeded per
    completion: splitting the rollout between a sampler and a judge changes where the work
    runs, not the experiment, so every non-timing metric (the judge's term, the rewards, the
    losses, held-out accuracy) and the final weights are the same. (With dynamic sampling too:
    tests/test_dynamic_sampling.py.)"""
    co, pa = str(tmp_path / "co"), str(tmp_path / "pa")
    torchrun(2, "train_grpo.py", *TINY, *JUDGE, "--run-dir", co)
    torchrun(2, "train_grpo.py", *TINY, *JUDGE, *PARTIAL, "--run-dir", pa)
    a, b = metrics(co), metrics(pa)
    # the trainers are the same 2 ranks with the same threads, and the sampler generates each
    # rank's 2 prompts as one --judge-chunk 2 batch, the batch a colocated engine sees; the judge's
    # and held-out batches differ in shape, which only pick tokens (a verdict, an answer). Compared
    # as reordered runs are all the same (tests/helpers/runs.py): not to the bit, which holds on
    # this CPU's kernels but is not what the placement promises.
    assert len(a) == 4 and differences_within(a, b) == []
    for r in b[:3]:
        assert "rollout/reward/judge" in r and r["reward/judge_unparsed_share"] < 0.5
        assert r["placement/sampler_busy_s"] > 0 and r["placement/judge_busy_s"] > 0
        assert 0 <= r["placement/idle_share"] <= 1
    from safetensors.torch import load_file
    wa = load_file(os.path.join(co, "final", "model.safetensors"))
    wb = load_file(os.path.join(pa, "final", "model.safetensors"))
    apart = weights_apart(wa, wb, load_file("assets/arith-tiny/model.safetensors"))
    assert apart <= 1e-3, apart  # as test_disaggregate's: last-bit noise moves Adam's updates as much


def test_a_judge_that_always_times_out_is_counted_then_stops_the_run(tmp_path):
    """Every judge call runs past --reward-timeout-s (here on the judge rank of a partial run;
    in-process it is the same `Judge.score`, tests/test_judge.py): its samples have no reward
    (counted in reward/failures); with the judge as the only reward every sample fails, and
    after --max-skipped-steps such steps the run stops, saying so."""
    run = str(tmp_path / "run")
    p = torchrun(2, "train_grpo.py", *TINY, "--rewards", "judge", "--judge-model", "assets/judge-tiny",
                 "--reward-timeout-s", "1e-6", "--max-skipped-steps", "1", *PARTIAL, "--run-dir", run,
                 check=False)
    assert p.returncode != 0
    assert "every reward failed" in p.stdout + p.stderr and "judg" in p.stdout + p.stderr
    rows = metrics(run)
    assert rows and all(r["reward/failures"] == 16 for r in rows if "reward/failures" in r)


@pytest.mark.reordered
def test_a_sampler_judge_move_in_process_keeps_the_run(tmp_path):
    """--rebalance in partial placement, 3 ranks: after step 2 the split moves from 1 sampler + 2
    judges to 2 + 1 in process (forced; the measured decision is rebalance.decide's partial branch,
    tests/test_rebalance.py). Every rank trains in both layouts and each prompt's samples and
    verdicts are seeded by the prompt, not by the rank that makes them, so the run is the unmoved
    one: the same 3 trainers reduce in the same order, and the sampler generates each rank's 2
    prompts as one --judge-chunk 2 batch in either split. Compared as every moved layout is, to
    rounding (tests/helpers/runs.py): the judges' batches change shape with the split."""
    flags = ["--steps", "4", "--prompts-per-step", "6", "--num-generations", "4", "--eval-every", "0",
             "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1", *JUDGE, *PARTIAL]
    still, moved = str(tmp_path / "still"), str(tmp_path / "moved")
    torchrun(3, "train_grpo.py", *flags, "--run-dir", still)
    forced = ["--rebalance", "--rebalance-window", "1", "--rebalance-gap", "1", "--rebalance-force", "2", "2"]
    out = torchrun(3, "train_grpo.py", *flags, *forced, "--run-dir", moved).stdout
    assert "1 -> 2 sampler ranks: forced" in out and "(in process)" in out, out[-3000:]
    rows = metrics(moved)
    events = [r for r in rows if r.get("event") == "placement/moved"]
    assert len(events) == 1 and events[0]["placement/move_state_equal"] == 1.0
    assert events[0]["placement/sampler_ranks"] == 2
    after = [r for r in rows if not r.get("event") and r["step"] >= 2 and not r.get("final")]
    assert after and all(r["placement/judge_busy_s"] > 0 for r in after)
    assert differences_within(metrics(still), rows) == []
