"""The algorithm menu's pure functions (rl/algos.py, "the algorithm menu") against plain-Python
loops. Each loop walks one sequence at a time, over its own tokens only; the right padding of
every [B, T] input holds garbage that must not leak into a sequence's result."""
import math

import pytest
import torch

from rl import algos
from utils.errors import UserError

# mixed completion lengths in one batch: a full one, one of length 1, an empty one
LENGTHS = [6, 1, 3, 0, 5, 2]
T = 6


def right_padded(lengths, width=T, dtype=torch.float64):
    """The loss mask of right-padded completions: 1 on each one's first `length` tokens."""
    return (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).to(dtype)  # [B, T]


def with_garbage(x, mask, value):
    """x with `value` in the padding (where mask is 0)."""
    return torch.where(mask > 0, x, torch.full_like(x, value))


def clip(x, low, high):
    return min(max(x, low), high)


# ---------------------------------------------------------------- advantages

def naive_rloo(rewards: list, scored: list) -> list:
    """One group: r_i minus the mean of the other scored rewards; 0 when not scored or when the
    group has fewer than two scored samples."""
    kept = [r for r, ok in zip(rewards, scored) if ok]
    out = []
    for r, ok in zip(rewards, scored):
        if not ok or len(kept) < 2:
            out.append(0.0)
            continue
        out.append(r - (sum(kept) - r) / (len(kept) - 1))
    return out


def test_rloo_matches_a_leave_one_out_loop():
    """Unscored samples (NaN rewards: their function failed) are left out of the others' mean and get
    0; a group with one scored sample, or none, carries no advantage."""
    torch.manual_seed(0)
    G, n = 6, 4
    rewards = torch.randn(G, n, dtype=torch.float64)
    scored = torch.tensor([[True] * 4, [True, False, True, True], [False, True, False, True],
                           [True, False, False, False], [False] * 4, [True] * 4])
    rewards[~scored] = math.nan
    got = algos.rloo_advantages(rewards, scored)
    for g in range(G):
        want = naive_rloo(rewards[g].tolist(), scored[g].tolist())
        assert got[g].tolist() == pytest.approx(want, abs=1e-12)
    assert (got[~scored] == 0).all() and got.isfinite().all()
    # with every sample scored it is GRPO's centred reward (no std) times n / (n - 1)
    full = algos.rloo_advantages(rewards[[0, 5]])
    centred = algos.group_advantages(rewards[[0, 5]], scale_std=False)
    assert full.tolist() == [pytest.approx(row, abs=1e-12) for row in (centred * n / (n - 1)).tolist()]


def test_rloo_of_a_group_of_equal_rewards_is_exactly_zero():
    """Not the float rounding of the others' mean (~1e-8 in fp32 for eight rewards of 0.1): the
    actor skips rows whose advantage is exactly 0. An unscored outlier does not count."""
    r = torch.tensor([[0.1] * 8, [0.7] * 8, [0.3] * 7 + [5.0], [0.1, 0.2] * 4])
    scored = torch.ones(4, 8, dtype=torch.bool)
    scored[2, 7] = False
    got = algos.rloo_advantages(r, scored)
    assert torch.equal(got[:3], torch.zeros(3, 8))
    assert (got[3] != 0).all()
    assert torch.equal(algos.rloo_advantages(torch.full((3, 3), 1.1)), torch.zeros(3, 3))


def test_rloo_needs_two_samples_per_prompt():
    with pytest.raises(UserError, match="--num-generations"):
        algos.rloo_advantages(torch.randn(4, 1))


@pytest.mark.parametrize("with_baseline", [False, True])
def test_reinforce_pp_returns_are_sums_of_future_token_rewards(with_baseline):
    """Per token -kl_coef * KL, the score (minus the baseline) added on the last token, summed from
    each token to the end of its own sequence (gamma 1); 0 in the padding and for an empty one."""
    torch.manual_seed(0)
    mask = right_padded(LENGTHS)  # [B, T]
    B = len(LENGTHS)
    kl = with_garbage(torch.rand(B, T, dtype=torch.float64), mask, 1e4)  # [B, T]
    score = torch.randn(B, dtype=torch.float64)  # [B]
    baseline = torch.randn(B, dtype=torch.float64) if with_baseline else None  # [B]
    got = algos.reinforce_pp_returns(score, kl, mask, 0.05, baseline)
    for i, n in enumerate(LENGTHS):
        per_token = [-0.05 * kl[i, t].item() for t in range(n)]
        if n:
            per_token[-1] += score[i].item() - (baseline[i].item() if with_baseline else 0.0)
        want = [sum(per_token[t:]) for t in range(n)]
        assert got[i, :n].tolist() == pytest.approx(want, abs=1e-12)
        assert (got[i, n:] == 0).all()
    # no KL: every token of a completion carries its (baselined) score
    flat = algos.reinforce_pp_returns(score, kl, mask, 0.0, baseline)
    for i, n in enumerate(LENGTHS):
        s = score[i].item() - (baseline[i].item() if with_baseline else 0.0)
        assert flat[i, :n].tolist() == pytest.approx([s] * n, abs=1e-12)


def naive_overlong(length: int, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO eq. 13, scaled by the penalty."""
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / buffer * penalty
    return -penalty


def test_overlong_penalty_before_inside_and_at_the_end_of_the_buffer():
    lengths = torch.tensor([0, 10, 15, 16, 18, 20, 25])  # max_len 20, the buffer starts at 15
    got = algos.overlong_penalty(lengths, max_len=20, buffer=5, penalty=0.5)
    assert got.tolist() == pytest.approx([0, 0, 0, -0.1, -0.3, -0.5, -0.5], abs=1e-7)
    assert (got[:3] == 0).all() and got[5].item() == -0.5  # exactly 0 before, -penalty at max_len
    every = torch.arange(0, 40)
    got = algos.overlong_penalty(every, max_len=32, buffer=8, penalty=1.0)
    want = [naive_overlong(n, 32, 8, 1.0) for n in range(40)]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    # a buffer as long as max_len: the penalty rises from the first token
    got = algos.overlong_penalty(torch.tensor([1, 2, 4]), max_len=4, buffer=4, penalty=2.0)
    assert got.tolist() == pytest.approx([-0.5, -1.0, -2.0], abs=1e-7)


def test_aggregate_constant_divides_each_sequence_sum_by_max_len():
    """Dr. GRPO: per sequence the sum over its own tokens / max_len, summed, / norm."""
    torch.manual_seed(0)
    mask = right_padded(LENGTHS)
    per = with_garbage(torch.randn(len(LENGTHS), T, dtype=torch.float64), mask, 1e4)
    got = algos.aggregate(per, mask, "constant", norm=3.0, max_len=16)
    want = sum(sum(per[i, t].item() for t in range(n)) / 16 for i, n in enumerate(LENGTHS)) / 3.0
    assert got.item() == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="token, sequence or constant"):
        algos.aggregate(per, mask, "tokens", 1.0)


# ---------------------------------------------------------------- policy losses

def random_policy_inputs(scale: float, seed: int = 0):
    """logp, old_logp [B, T] (log-ratios ~ scale * N(0, 1), and two of 2.0, a ratio of 7.4: one on a
    negative advantage, one on a positive), adv [B, T]: one per completion, broadcast, half of them
    negative, with garbage in the padding; and the mask."""
    torch.manual_seed(seed)
    mask = right_padded(LENGTHS)
    B = len(LENGTHS)
    old = -1.0 - torch.rand(B, T, dtype=torch.float64)
    logp = old + scale * torch.randn(B, T, dtype=torch.float64)
    logp[1, 0], logp[0, 2] = old[1, 0] + 2.0, old[0, 2] + 2.0  # A = -2 (length 1), A = 1
    adv = torch.tensor([1.0, -2.0, 0.5, -1.0, -0.7, 1.5], dtype=torch.float64)[:, None].expand(B, T)
    return with_garbage(logp, mask, 7.0), with_garbage(old, mask, -7.0), with_garbage(adv, mask, 3.0), mask


def test_dual_clip_and_cispo_match_a_loop():
    logp, old, adv, mask = random_policy_inputs(scale=1.0)
    dual, dual_clipped = algos.dual_clip_surrogate(logp, old, adv, 0.2, 0.28, c=3.0)
    cispo, cispo_clipped = algos.cispo_loss(logp, old, adv, 0.2, 0.28)
    seen = set()
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            lp, a = logp[i, t].item(), adv[i, t].item()
            ratio = math.exp(lp - old[i, t].item())
            c_ratio = clip(ratio, 0.8, 1.28)
            ppo = -min(ratio * a, c_ratio * a)
            want, capped = ppo, False
            if a < 0 and ppo > -3.0 * a:
                want, capped = -3.0 * a, True
            seen.add(capped)
            assert dual[i, t].item() == pytest.approx(want, abs=1e-12)
            assert dual_clipped[i, t].item() == (c_ratio * a < ratio * a or capped)
            assert cispo[i, t].item() == pytest.approx(-c_ratio * a * lp, abs=1e-12)
            assert cispo_clipped[i, t].item() == (c_ratio != ratio)
    assert seen == {True, False}  # the dual bound acted on some tokens, not all
    assert cispo_clipped[mask > 0].any() and not cispo_clipped[mask > 0].all()


def test_dual_clip_only_changes_negative_advantage_tokens_with_a_huge_ratio():
    """Where it differs from PPO's clipped surrogate, the advantage is negative and the ratio above
    c, and the loss there is -c * A: bounded, however large the ratio."""
    logp, old, adv, mask = random_policy_inputs(scale=1.5, seed=1)
    ratio = torch.exp(logp - old)
    ppo, ppo_clipped = algos.clipped_surrogate(logp, old, adv, 0.2, 0.28)
    dual, dual_clipped = algos.dual_clip_surrogate(logp, old, adv, 0.2, 0.28, c=3.0)
    changed = dual != ppo
    assert torch.equal(changed, (adv < 0) & (ratio > 3.0))
    assert changed[mask > 0].any() and ((adv > 0) & (ratio > 3.0))[mask > 0].any()
    assert torch.equal(dual[changed], -3.0 * adv[changed])
    assert torch.equal(dual_clipped, ppo_clipped | changed)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """d loss / d logp = -clip(r) * A on every token, clipped or not; PPO's clipped surrogate has
    gradient -r * A where it is not clipped and exactly 0 where it is."""
    logp, old, adv, mask = random_policy_inputs(scale=0.5, seed=2)
    logp = logp.clone().requires_grad_(True)
    loss, clipped = algos.cispo_loss(logp, old, adv, 0.2, 0.28)
    (g_cispo,) = torch.autograd.grad((loss * mask).sum(), logp)
    loss, ppo_clipped = algos.clipped_surrogate(logp, old, adv, 0.2, 0.28)
    (g_ppo,) = torch.autograd.grad((loss * mask).sum(), logp)
    own = mask > 0
    assert (clipped & own).any() and (ppo_clipped & own).any()
    for i, n in enumerate(LENGTHS):
        for t in range(n):
            ratio = math.exp(logp[i, t].item() - old[i, t].item())
            a = adv[i, t].item()
            assert g_cispo[i, t].item() == pytest.approx(-clip(ratio, 0.8, 1.28) * a, abs=1e-12)
            assert g_cispo[i, t].item() != 0
            if ppo_clipped[i, t]:
                assert g_ppo[i, t].item() == 0.0
            else:
                assert g_ppo[i, t].item() == pytest.approx(-ratio * a, abs=1e-12)
    assert (g_cispo[~own] == 0).all() and (g_ppo[~own] == 0).all()


def at_the_bound_inputs():
    """float32 logp, old_logp [1, 4] whose log-ratios are exact binary fractions, and torch's own
    ratios of them (the same op on the same tensor: the same bits as inside the losses)."""
    old = torch.full((1, 4), -1.0)
    logp = old + torch.tensor([[0.25, -0.25, 0.375, -0.375]])  # exact: at high, at low, past, past
    ratio = torch.exp(logp - old)  # [1, 4]
    clip_high = ratio[0, 0].item() - 1  # 1 + clip_high == ratio[0, 0] exactly
    clip_low = 1 - ratio[0, 1].item()  # 1 - clip_low == ratio[0, 1] exactly
    adv = torch.tensor([[1.5, -2.0, 1.5, -2.0]])  # the bound that matters for each sign
    return logp, old, adv, ratio, clip_low, clip_high


@pytest.mark.parametrize("loss_name", ["ppo", "dual_clip"])
def test_a_ratio_at_the_clip_bound_is_not_clipped(loss_name):
    """r == 1 + clip_high (A > 0) or r == 1 - clip_low (A < 0): both branches give the same loss,
    -r * A, and the token is not counted as clipped; just past the bound it is."""
    logp, old, adv, ratio, clip_low, clip_high = at_the_bound_inputs()
    assert ratio[0, 0].item() == 1 + clip_high and ratio[0, 1].item() == 1 - clip_low
    if loss_name == "ppo":
        loss, clipped = algos.clipped_surrogate(logp, old, adv, clip_low, clip_high)
    else:
        loss, clipped = algos.dual_clip_surrogate(logp, old, adv, clip_low, clip_high, c=10.0)
    assert clipped.tolist() == [[False, False, True, True]]
    want = [-(1 + clip_high) * 1.5, (1 - clip_low) * 2.0, -(1 + clip_high) * 1.5, (1 - clip_low) * 2.0]
    assert loss[0].tolist() == pytest.approx(want, abs=1e-6)


def test_a_ratio_at_the_dual_clip_bound_c():
    """A < 0 and r == c: PPO's loss -r * A equals the bound -c * A, not capped; past c, capped."""
    old = torch.full((1, 3), -1.0)
    logp = old + torch.tensor([[1.5, 1.625, 1.25]])  # exact log-ratios
    ratio = torch.exp(logp - old)
    c = ratio[0, 0].item()  # ~4.48
    adv = torch.tensor([[-2.0, -2.0, -2.0]])
    loss, clipped = algos.dual_clip_surrogate(logp, old, adv, 0.2, 0.28, c)
    assert clipped.tolist() == [[False, True, False]]  # r = 3.49 < c: neither clip acts for A < 0
    assert loss[0, 0].item() == pytest.approx(2.0 * c, abs=1e-6) and loss[0, 1].item() == loss[0, 0].item()
    assert loss[0, 2].item() == pytest.approx(2.0 * ratio[0, 2].item(), abs=1e-6)


def test_a_cispo_weight_at_the_clip_bound_is_not_clipped():
    logp, old, adv, ratio, clip_low, clip_high = at_the_bound_inputs()
    loss, clipped = algos.cispo_loss(logp, old, adv, clip_low, clip_high)
    assert clipped.tolist() == [[False, False, True, True]]
    weights = [ratio[0, 0].item(), ratio[0, 1].item(), 1 + clip_high, 1 - clip_low]
    want = [-w * a * lp for w, a, lp in zip(weights, adv[0].tolist(), logp[0].tolist())]
    assert loss[0].tolist() == pytest.approx(want, abs=1e-6)


def naive_gspo(logp: list, old: list, adv: list, clip_low: float, clip_high: float):
    """One sequence, its own tokens: (loss, clipped) of s = exp(mean log(pi / pi_old)) on the mean
    advantage."""
    n = len(logp)
    if n == 0:
        return 0.0, False
    s = math.exp(sum(lp - o for lp, o in zip(logp, old)) / n)
    a = sum(adv) / n
    clipped = clip(s, 1 - clip_low, 1 + clip_high) * a
    return -min(s * a, clipped), clipped < s * a


@pytest.mark.parametrize("clip_low,clip_high", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_matches_a_per_sequence_loop(clip_low, clip_high):
    """The sequence's loss, identical at each of its tokens; advantages per token (garbage in the
    padding), averaged over the sequence's own tokens."""
    torch.manual_seed(3)
    mask = right_padded(LENGTHS)
    B = len(LENGTHS)
    old = with_garbage(-1.0 - torch.rand(B, T, dtype=torch.float64), mask, -1e4)
    logp = with_garbage(old + 0.3 * torch.randn(B, T, dtype=torch.float64), mask, 1e4)
    adv = with_garbage(torch.randn(B, T, dtype=torch.float64), mask, 1e4)
    logp[0, :6], adv[0, :6] = old[0, :6] + 0.5, adv[0, :6].abs()  # s = 1.65 on a positive advantage
    loss, clipped = algos.gspo_surrogate(logp, old, adv, mask, clip_low, clip_high)
    flags = set()
    for i, n in enumerate(LENGTHS):
        want, want_clipped = naive_gspo(logp[i, :n].tolist(), old[i, :n].tolist(), adv[i, :n].tolist(),
                                        clip_low, clip_high)
        flags.add(want_clipped)
        assert len(set(loss[i, :n].tolist())) <= 1  # the same value, to the bit, at every token
        assert loss[i, :n].tolist() == pytest.approx([want] * n, abs=1e-12)
        assert clipped[i, :n].tolist() == [want_clipped] * n
    if clip_high == 0.28:
        assert flags == {True, False}


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_gspo_gradient_matches_a_naive_per_sequence_loss(mode):
    """Autograd through gspo_surrogate + aggregate against autograd through a scalar loop over each
    sequence's own tokens: the same gradient w.r.t. logp, and none in the padding."""
    torch.manual_seed(4)
    mask = right_padded(LENGTHS)
    B = len(LENGTHS)
    old = with_garbage(-1.0 - torch.rand(B, T, dtype=torch.float64), mask, -1e4)
    start = with_garbage(old + 0.2 * torch.randn(B, T, dtype=torch.float64), mask, 1e4)
    adv = with_garbage(torch.randn(B, T, dtype=torch.float64), mask, 1e4)
    clip_low, clip_high = 0.1, 0.12

    logp = start.clone().requires_grad_(True)
    loss, clipped = algos.gspo_surrogate(logp, old, adv, mask, clip_low, clip_high)
    norm = mask.sum().item() if mode == "token" else B
    (got,) = torch.autograd.grad(algos.aggregate(loss, mask, mode, norm), logp)

    leaf = start.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        log_s = sum(leaf[i, t] - old[i, t] for t in range(n)) / n
        s = torch.exp(log_s)
        a = sum(adv[i, t].item() for t in range(n)) / n
        seq_loss = -torch.minimum(s * a, s.clamp(1 - clip_low, 1 + clip_high) * a)
        total = total + (seq_loss * n if mode == "token" else seq_loss)  # token: once per token
    (want,) = torch.autograd.grad(total / norm, leaf)

    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert (got[mask == 0] == 0).all()
    own = mask > 0
    assert (clipped & own).any() and (~clipped & own).any()  # both branches: zero and nonzero rows
    assert (got[clipped & own] == 0).all() and (got[~clipped & own] != 0).all()


def test_gspo_at_the_clip_bound():
    """A sequence ratio s exactly 1 + clip_high (A > 0) or 1 - clip_low (A < 0, a sequence of
    length 1) is not clipped and its loss is -s * A; past the bound it is clipped."""
    old = torch.full((4, 2), -1.0)
    logp = torch.tensor([[-0.75, -0.25], [-1.5, 9.0], [-0.375, -0.375], [-1.625, 9.0]])  # 9: garbage
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 3.0], [-2.0, 5.0], [2.0, 2.0], [-2.0, 5.0]])  # mean over own tokens: 2, -2
    # mean log-ratios 0.5, -0.5, 0.625, -0.625, exact; s as torch computes it over a [B] tensor
    s = torch.exp(torch.tensor([0.5, -0.5, 0.625, -0.625]))
    clip_high, clip_low = s[0].item() - 1, 1 - s[1].item()
    loss, clipped = algos.gspo_surrogate(logp, old, adv, mask, clip_low, clip_high)
    assert clipped[:, 0].tolist() == [False, False, True, True]
    want = [-2.0 * s[0].item(), 2.0 * s[1].item(), -2.0 * (1 + clip_high), 2.0 * (1 - clip_low)]
    assert loss[:, 0].tolist() == pytest.approx(want, abs=1e-6)
    assert torch.equal(loss[[0, 2], 0], loss[[0, 2], 1])  # the same at each token of a sequence


# ---------------------------------------------------------------- trainer/engine mismatch

MISMATCH_LENGTHS = [6, 1, 3, 0, 5, 2, 4, 1, 6, 2, 3, 1]


def mismatch_inputs():
    torch.manual_seed(5)
    mask = right_padded(MISMATCH_LENGTHS)
    B = len(MISMATCH_LENGTHS)
    engine = -1.0 - torch.rand(B, T, dtype=torch.float64)
    old = engine + 0.6 * torch.randn(B, T, dtype=torch.float64)
    old[4, :5] = engine[4, :5] + 1.0  # r = e per token: outside [0.5, 2] at every level
    return with_garbage(old, mask, 1e4), with_garbage(engine, mask, -1e4), mask


def naive_ratios(old: list, engine: list, level: str) -> list:
    """One sequence's r at each of its own tokens: r_t, prod_t r_t, or exp(mean_t log r_t)."""
    token = [math.exp(o - e) for o, e in zip(old, engine)]
    if level == "token":
        return token
    if level == "sequence":
        return [math.prod(token)] * len(token)
    return [math.exp(sum(o - e for o, e in zip(old, engine)) / len(old))] * len(old) if old else []


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("kind", ["tis", "mis", "icepop"])
def test_mismatch_weights_match_a_loop(kind, level):
    """tis: weight min(r, high), mask unchanged; mis: weight 1, tokens (at the sequence levels, whole
    sequences) with r outside [low, high] leave the mask; icepop: weight r inside, 0 outside, mask
    unchanged. The padding stays out of the mask."""
    old, engine, mask = mismatch_inputs()
    low, high = 0.5, 2.0
    weight, kept, r = algos.mismatch_weights(old, engine, mask, kind, level, low, high)
    assert not weight.requires_grad and kept.dtype == mask.dtype
    inside_seen = set()
    for i, n in enumerate(MISMATCH_LENGTHS):
        ratios = naive_ratios(old[i, :n].tolist(), engine[i, :n].tolist(), level)
        assert r[i, :n].tolist() == pytest.approx(ratios, rel=1e-12)
        for t, rt in enumerate(ratios):
            inside = low <= rt <= high
            inside_seen.add(inside)
            if kind == "tis":
                want_w, want_k = min(rt, high), 1.0
            elif kind == "mis":
                want_w, want_k = 1.0, float(inside)
            else:
                want_w, want_k = (rt if inside else 0.0), 1.0
            assert weight[i, t].item() == pytest.approx(want_w, rel=1e-12)
            assert kept[i, t].item() == want_k
        assert (kept[i, n:] == 0).all()
        if level != "token" and kind == "mis":  # a whole sequence stays or leaves
            assert len(set(kept[i, :n].tolist())) <= 1
    assert inside_seen == {True, False}  # both branches ran at this level
    if kind == "tis":
        assert (weight <= high).all() and (weight[(r > high) & (mask > 0)] == high).all()


def test_the_geometric_level_is_the_mean_log_ratio_of_each_sequence_own_tokens():
    old, engine, mask = mismatch_inputs()
    _, _, token = algos.mismatch_weights(old, engine, mask, "tis", "token", 0.5, 2.0)
    _, _, geo = algos.mismatch_weights(old, engine, mask, "tis", "geometric", 0.5, 2.0)
    _, _, seq = algos.mismatch_weights(old, engine, mask, "tis", "sequence", 0.5, 2.0)
    for i, n in enumerate(MISMATCH_LENGTHS):
        logs = [math.log(x) for x in token[i, :n].tolist()]
        if n:
            assert geo[i, :n].tolist() == pytest.approx([math.exp(sum(logs) / n)] * n, rel=1e-12)
            assert seq[i, :n].tolist() == pytest.approx([math.exp(sum(logs))] * n, rel=1e-12)


def test_mismatch_bounds_are_inclusive():
    """r exactly low or high is inside: mis keeps the token, icepop keeps its weight r, tis leaves
    it at r (= high)."""
    old, engine, mask = mismatch_inputs()
    r = torch.exp((old - engine) * mask)  # the token ratios, as mismatch_weights computes them
    low, high = r[0, 0].item(), r[0, 1].item()
    if low > high:
        low, high = high, low
    for kind in ("tis", "mis", "icepop"):
        weight, kept, _ = algos.mismatch_weights(old, engine, mask, kind, "token", low, high)
        at = (r == low) | (r == high)
        assert at[0, :2].all() and (kept[at & (mask > 0)] == 1).all()
        if kind != "mis":
            assert torch.equal(weight[0, :2], r[0, :2])
    with pytest.raises(ValueError, match="tis, mis or icepop"):
        algos.mismatch_weights(old, engine, mask, "is", "token", 0.5, 2.0)
    with pytest.raises(ValueError, match="token, sequence or geometric"):
        algos.mismatch_weights(old, engine, mask, "tis", "tokens", 0.5, 2.0)
