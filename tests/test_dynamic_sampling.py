"""Dynamic sampling (DAPO's filter in G-Core's waves): the pure rules against hand-computed
values, the prompt stream, padding that carries no loss, and the refill loop end to end."""
import os

import pytest
import torch
from test_fsdp import torchrun

from rl import algos
from tasks.data import PromptStream, step_indices
from tests.helpers.runs import differences_within
from utils.logger import differences, read_metrics

TINY = ["--steps", "3", "--prompts-per-step", "4", "--num-generations", "4", "--eval-every", "2",
        "--eval-prompts", "8", "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1",
        "--dynamic-sampling"]
JUDGE = ["--rewards", "accuracy", "judge", "--reward-weights", "1", "0.5",
         "--judge-model", "assets/judge-tiny", "--judge-samples", "2", "--judge-chunk", "2"]


def metrics(run_dir):
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def test_wave_size_and_ema_follow_g_cores_rules_by_hand():
    # wave: ceil(gap * ema * oversampling); 0 for no gap
    assert algos.wave_size(4, 1.0, 1.2) == 5  # ceil(4.8)
    assert algos.wave_size(5, 1.0, 1.2) == 6  # 6.0 exactly
    assert algos.wave_size(3, 2.5, 1.2) == 9  # ceil(9.0)
    assert algos.wave_size(1, 1.06, 1.2) == 2  # ceil(1.272)
    assert algos.wave_size(0, 3.0, 1.2) == 0
    # a sequence of steps: (generated, informative) summed over ranks
    ema, seen = 1.0, []
    for generated, informative in [(10, 5), (12, 3), (8, 0), (6, 6)]:
        ema = algos.sampling_ema(ema, generated, informative, decay=0.9, max_ratio=10.0)
        seen.append(ema)
    # 0.9*1 + 0.1*2 = 1.1; 0.9*1.1 + 0.1*4 = 1.39; none informative -> the cap 10: 0.9*1.39 + 1 = 2.251;
    # 0.9*2.251 + 0.1*1 = 2.1259
    assert seen == pytest.approx([1.1, 1.39, 2.251, 2.1259], abs=1e-12)
    assert algos.sampling_ema(1.0, 100, 1, 0.9, 10.0) == pytest.approx(1.9)  # the ratio 100 is capped at 10


def test_informative_groups_match_a_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (64, 4), generator=g).float()  # [G, n]
    scored = torch.rand(64, 4, generator=g) > 0.2
    want = []
    for r, s in zip(rewards.tolist(), scored.tolist()):
        kept = [v for v, ok in zip(r, s) if ok]
        want.append(len(kept) >= 2 and max(kept) > min(kept))
    assert algos.informative_groups(rewards, scored).tolist() == want
    assert 0 < sum(want) < 64  # both kinds occur


def test_prompt_streams_split_the_shuffled_epoch_and_hand_back_put_back_prompts_first():
    dp, n_rows = 2, 10
    streams = [PromptStream(n_rows, seed=3, rank=r, dp=dp) for r in range(dp)]
    first = [s.take(5) for s in streams]
    epoch = step_indices(n_rows, 0, n_rows, seed=3)  # the same shuffle as the plain data order
    assert first[0] == epoch[0::2] and first[1] == epoch[1::2]
    assert sorted(first[0] + first[1]) == list(range(n_rows))  # an epoch, each prompt once
    streams[0].put_back([first[0][1], first[0][3]])
    again = streams[0].take(3)
    assert again[:2] == [first[0][1], first[0][3]]  # the buffer first
    assert again[2] == step_indices(n_rows, 1, n_rows, seed=3)[0]  # then the next epoch
    restored = PromptStream(n_rows, seed=3, rank=0, dp=dp)
    restored.load(streams[0].state())
    assert restored.take(4) == streams[0].take(4)


@pytest.mark.reordered
def test_a_padded_group_carries_exactly_zero_loss_and_gradient():
    """Padding groups enter the batch with a zero loss mask: whatever their log-probs and
    advantages, the loss and its gradient are those of the batch without them."""
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(8, 5, generator=g).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(8, 5, generator=g)
    adv = torch.randn(8, 1, generator=g).expand(8, 5)
    mask = torch.ones(8, 5)
    mask[4:] = 0  # the last group (4 samples) is padding
    pg, _ = algos.clipped_surrogate(logp, old, adv, 0.2, 0.28)
    loss = algos.aggregate(pg, mask, "token", float(mask.sum()), 5)
    loss.backward()
    assert torch.equal(logp.grad[4:], torch.zeros(4, 5))
    kept = logp.detach()[:4].clone().requires_grad_()
    pg4, _ = algos.clipped_surrogate(kept, old[:4], adv[:4], 0.2, 0.28)
    loss4 = algos.aggregate(pg4, mask[:4], "token", float(mask[:4].sum()), 5)
    loss4.backward()
    assert torch.equal(logp.grad[:4], kept.grad)  # elementwise: the same ops on the same values
    # the loss sums 40 terms (20 exact zeros) against 20: a vectorised sum may split them into lanes
    # otherwise, the same terms in another order (tests/helpers/runs.py): within ~8 eps of their size
    scale = float((pg4.detach().abs() * mask[:4]).sum() / mask[:4].sum())
    assert abs(loss.item() - loss4.item()) <= 1e-6 * scale, (loss.item(), loss4.item())


@pytest.mark.reordered
def test_dynamic_sampling_is_the_same_run_in_every_placement_and_after_a_resume(tmp_path):
    """With the judge as a second reward: colocate on 2 ranks, disaggregate (2 trainers + 1
    rollout rank, staleness 0), partial (1 sampler + 1 judge) and a resume from colocate's
    step-2 checkpoint draw the same waves with the same seeds, so every non-timing metric is the
    same: to rounding across placements (3 ranks get other thread counts than 2, the partial
    sampler generates in chunks of another batch shape: tests/helpers/runs.py), to the bit after
    the resume; each step holds exactly --prompts-per-step groups (kept + padded) of those
    generated."""
    co, dis, pa, re = (str(tmp_path / d) for d in ("co", "dis", "pa", "re"))
    flags = [*TINY, *JUDGE]
    torchrun(2, "train_grpo.py", *flags, "--run-dir", co, "--save-every", "2")
    torchrun(3, "train_grpo.py", *flags, "--placement", "disaggregate", "--rollout-ranks", "1",
             "--run-dir", dis)
    torchrun(2, "train_grpo.py", *flags, "--placement", "partial", "--sampler-ranks", "1", "--run-dir", pa)
    step2 = os.path.join(co, "checkpoints", "step_00000002")
    torchrun(2, "train_grpo.py", *flags, "--run-dir", re, "--resume", step2)
    a = metrics(co)
    assert len(a) == 4 and differences_within(a, metrics(dis)) == []
    assert differences_within(a, metrics(pa)) == []
    # the same ranks, threads and batches as colocate's steps 2-3, hence the same sums in the same
    # order: bit-equal, so the prompt stream and the ema came back exactly
    assert differences(a[2:], metrics(re)) == []
    for r in a[:3]:
        assert r["rollout/ds_groups_kept"] + r["rollout/ds_groups_padded"] == 4
        assert r["rollout/ds_groups_generated"] >= 4 and 1 <= r["rollout/ds_waves"] <= 4
        assert r["rollout/ds_groups_kept"] <= r["rollout/ds_groups_informative"]
    assert a[0]["rollout/ds_ema"] == pytest.approx(
        0.9 + 0.1 * a[0]["rollout/ds_groups_generated"] / a[0]["rollout/ds_groups_informative"])


def test_a_step_that_finds_too_few_informative_groups_pads_them_out_of_the_loss(tmp_path):
    """A reward that is the same for every sample makes every group uninformative: the refills
    run out (1 + 3 waves), the step is filled with padding, nothing trains, and the ema climbs
    toward the cap."""
    run = str(tmp_path / "pad")
    torchrun(2, "train_grpo.py", *TINY, "--rewards", "tests.helpers.rewards:constant", "--run-dir", run,
             "--no-save-final")
    rows = metrics(run)
    for r in rows[:3]:
        assert r["rollout/ds_waves"] == 4 and r["rollout/ds_groups_kept"] == 0
        assert r["rollout/ds_groups_padded"] == 4 and r["train/rows_trained"] == 0
    assert rows[0]["rollout/ds_ema"] == pytest.approx(0.9 + 0.1 * 10)
