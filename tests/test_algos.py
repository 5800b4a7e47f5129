"""The pure RL functions against plain-Python loops."""
import math

import pytest
import torch

from models import decoder
from rl import algos


def test_group_advantages_match_a_loop():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 0.0]])
    for scale in (True, False):
        got = algos.group_advantages(r, scale_std=scale)
        for g, row in enumerate(r.tolist()):
            mean = sum(row) / len(row)
            std = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))
            for j, x in enumerate(row):
                want = (x - mean) / (std + 1e-6) if scale else x - mean
                assert got[g, j].item() == pytest.approx(want, abs=1e-5)


def test_a_group_of_equal_rewards_has_exactly_zero_advantage():
    """Not the float rounding of its mean divided by a tiny std (0.0074 for eight rewards of 0.1)."""
    r = torch.tensor([[0.1] * 8, [1.1] * 8, [0.1, 0.2] * 4])
    for scale in (True, False):
        got = algos.group_advantages(r, scale_std=scale)
        assert torch.equal(got[:2], torch.zeros(2, 8)) and (got[2] != 0).all()


def test_failed_samples_are_left_out_of_their_group():
    """A sample without a reward (its function raised, timed out or gave NaN) gets advantage 0,
    and its group's mean and std are those of the remaining samples (a plain loop over them);
    a group with fewer than two scored samples carries no advantage."""
    r = torch.tensor([[1.0, 0.0, 9.0, 1.0], [3.0, 1.0, 2.0, 0.0], [1.0, 0.0, 5.0, 5.0], [2.0, 7.0, 1.0, 0.0]])
    scored = torch.tensor([[True, True, False, True], [True] * 4, [True, False, False, False], [False] * 4])
    for scale in (True, False):
        got = algos.group_advantages(r, scale_std=scale, scored=scored)
        for g in range(4):
            rest = [x for x, ok in zip(r[g].tolist(), scored[g].tolist()) if ok]
            for j in range(4):
                if not scored[g, j] or len(rest) < 2:
                    assert got[g, j].item() == 0.0
                    continue
                mean = sum(rest) / len(rest)
                std = math.sqrt(sum((x - mean) ** 2 for x in rest) / (len(rest) - 1))
                want = (r[g, j].item() - mean) / (std + 1e-6) if scale else r[g, j].item() - mean
                assert got[g, j].item() == pytest.approx(want, abs=1e-5)


def test_all_scored_advantages_are_the_plain_formula_bit_for_bit():
    """With every sample scored, the masked statistics are torch's own mean and std, to the bit."""
    torch.manual_seed(0)
    for n in (2, 4, 8, 16):
        r = torch.rand(64, n)
        want = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
        assert torch.equal(algos.group_advantages(r), want)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_a_loop(kind):
    logp, ref = torch.randn(3, 5) - 2, torch.randn(3, 5) - 2
    got = algos.kl_estimate(logp, ref, kind)
    for i in range(3):
        for t in range(5):
            lr = ref[i, t].item() - logp[i, t].item()
            want = {"k1": -lr, "k2": lr * lr / 2, "k3": math.exp(lr) - 1 - lr}[kind]
            assert got[i, t].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        algos.kl_estimate(logp, ref, "k4")


def test_k3_is_unbiased_for_kl():
    """E_pi[k3] = KL(pi || ref) on a small categorical (exactly, by enumeration)."""
    pi, ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    k3 = algos.kl_estimate(pi.log(), ref.log(), "k3")
    assert (pi * k3).sum().item() == pytest.approx((pi * (pi / ref).log()).sum().item(), rel=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
def test_clipped_surrogate_matches_a_loop(per_token):
    """Advantages per token [B, T]: one per completion broadcast (GRPO), or any per token (GAE)."""
    torch.manual_seed(0)
    logp, old = torch.randn(4, 6) * 0.3 - 1, torch.randn(4, 6) * 0.3 - 1
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])[:, None].expand(4, 6)
    if per_token:
        adv = torch.randn(4, 6)
    loss, clipped = algos.clipped_surrogate(logp, old, adv, 0.2, 0.28)
    for i in range(4):
        for t in range(6):
            ratio = math.exp(logp[i, t].item() - old[i, t].item())
            a = adv[i, t].item()
            c = min(max(ratio, 0.8), 1.28)
            assert loss[i, t].item() == pytest.approx(-min(ratio * a, c * a), rel=1e-5)
            assert clipped[i, t].item() == (c * a < ratio * a)


def test_aggregate_matches_a_loop():
    per = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).float()
    tok = sum(per[i, t].item() for i in range(3) for t in range(4) if mask[i, t]) / 7
    seq = sum(sum(per[i, t].item() for t in range(4) if mask[i, t]) / mask[i].sum().item()
              for i in range(3)) / 3
    assert algos.aggregate(per, mask, "token", 7).item() == pytest.approx(tok, rel=1e-5)
    assert algos.aggregate(per, mask, "sequence", 3).item() == pytest.approx(seq, rel=1e-5)


def test_token_logprobs_match_a_loop():
    logits, tokens = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    got = decoder.token_logprobs(logits, tokens, temperature=0.5)
    for b in range(2):
        for t in range(3):
            z = [x / 0.5 for x in logits[b, t].tolist()]
            lse = math.log(sum(math.exp(x) for x in z))
            assert got[b, t].item() == pytest.approx(z[tokens[b, t]] - lse, rel=1e-5)


@pytest.mark.reordered
def test_head_logprobs_in_chunks_are_the_whole_batchs_with_their_gradients():
    """The chunked head (rows of 2 under a tiny budget) against lm_head then token_logprobs on the
    whole batch: the same log-probs and gradients of h and of the head's weight. Both take the
    log-softmax in fp32 (logits are cast, as the trainer's are), so they agree to fp32's rounding
    of values of order 1: within 1e-5 (the weight's gradient sums over chunks in another order)."""
    torch.manual_seed(0)
    h = torch.randn(5, 4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    tokens, g = torch.randint(0, 11, (5, 4)), torch.randn(5, 4, dtype=torch.float64)
    whole = decoder.token_logprobs(torch.nn.functional.linear(h, w), tokens, temperature=0.7)  # [5, 4]
    whole_grads = torch.autograd.grad((whole * g).sum(), (h, w))
    budget = 2 * 4 * 11 * 4  # two rows of fp32 logits
    chunked = decoder.head_logprobs(h, w, tokens, temperature=0.7, budget=budget)
    chunked_grads = torch.autograd.grad((chunked * g).sum(), (h, w))
    assert chunked.dtype == torch.float32 and whole.dtype == torch.float32
    assert torch.allclose(chunked, whole, atol=1e-6)
    for a, b in zip(chunked_grads, whole_grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()
    # one chunk (the budget holds the batch): the very ops of the whole batch, the same bits
    assert torch.equal(decoder.head_logprobs(h, w, tokens, temperature=0.7), whole)


def test_the_learning_rate_warms_up_then_decays_linearly_to_zero():
    from roles.actor import lr_factor

    assert [round(lr_factor(3, 10, s), 6) for s in range(11)] == [
        round(min(1, (s + 1) / 3) * (1 - s / 10), 6) for s in range(11)]
    assert lr_factor(3, 10, 10) == 0.0 and lr_factor(3, 10, 2) == 0.8
    assert lr_factor(3, 0, 500) == 1.0  # constant after the warm-up


# ---------------------------------------------------------------- PPO with a critic

def test_token_rewards_match_a_loop():
    """-kl_coef * KL on every completion token, the score added on the last one; padding and an
    empty completion get nothing."""
    torch.manual_seed(0)
    lengths = [4, 1, 0, 2]
    T = 4
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()  # [B, T]
    kl, score = torch.rand(4, T), torch.randn(4)
    got = algos.token_rewards(score, kl, mask, kl_coef=0.05)
    for i, n in enumerate(lengths):
        for t in range(T):
            want = -0.05 * kl[i, t].item() if t < n else 0.0
            if t == n - 1:
                want += score[i].item()
            assert got[i, t].item() == pytest.approx(want, abs=1e-6)


def naive_gae(rewards: list, values: list, gamma: float, lam: float):
    """One completion's GAE, backwards over its own tokens only: (advantages, returns) lists."""
    adv, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_matches_a_backward_loop_per_sequence(gamma, lam):
    """Completions of different lengths in one batch (one of length 1, one empty): each sees only
    its own tokens. Rewards and values in the padding are garbage and must be ignored."""
    torch.manual_seed(0)
    lengths = [6, 1, 3, 0, 5]
    B, T = len(lengths), 6
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()  # [B, T]
    rewards, values = torch.randn(B, T), torch.randn(B, T)  # nonzero in the padding too
    adv, returns = algos.gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        want_adv, want_ret = naive_gae(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(want_adv, abs=1e-5)
        assert returns[i, :n].tolist() == pytest.approx(want_ret, abs=1e-5)
        assert (adv[i, n:] == 0).all() and (returns[i, n:] == 0).all()
        if gamma == 1.0 and lam == 1.0:  # the values cancel: the return is the sum of future rewards
            r = rewards[i, :n].tolist()
            assert returns[i, :n].tolist() == pytest.approx([sum(r[t:]) for t in range(n)], abs=1e-5)


def test_clipped_value_loss_matches_a_loop():
    torch.manual_seed(0)
    old = torch.randn(4, 8)
    values = old + torch.randn(4, 8) * 0.5  # many move further than the clip
    returns = torch.randn(4, 8)
    loss, clipped = algos.clipped_value_loss(values, old, returns, clip=0.2)
    for i in range(4):
        for t in range(8):
            v, o, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
            vc = o + min(max(v - o, -0.2), 0.2)
            plain, with_clip = (v - r) ** 2, (vc - r) ** 2
            assert loss[i, t].item() == pytest.approx(0.5 * max(plain, with_clip), rel=1e-5, abs=1e-6)
            assert clipped[i, t].item() == (with_clip > plain)
    assert clipped.any() and not clipped.all()  # both branches were tested


def test_masked_moments_and_whiten_match_a_loop():
    """Mean 0 and (population) std 1 over the mask, 0 outside it, whatever the padding holds."""
    torch.manual_seed(0)
    lengths = [5, 1, 3, 0]
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).float()  # [B, T]
    x = 3.0 + 2.0 * torch.randn(4, 5)
    x[mask == 0] = 1e4  # garbage in the padding
    total, total_sq, count = algos.masked_moments(x, mask)
    kept = [x[i, t].item() for i in range(4) for t in range(5) if mask[i, t]]
    assert total.dtype == torch.float64
    assert count.item() == len(kept) and total.item() == pytest.approx(sum(kept), rel=1e-6)
    assert total_sq.item() == pytest.approx(sum(v * v for v in kept), rel=1e-6)
    got = algos.whiten(x, mask, total, total_sq, count)
    assert got.dtype == x.dtype
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept))
    out = [got[i, t].item() for i in range(4) for t in range(5) if mask[i, t]]
    assert out == pytest.approx([(v - mean) / (std + 1e-8) for v in kept], abs=1e-5)
    assert sum(out) / len(out) == pytest.approx(0.0, abs=1e-6)
    assert math.sqrt(sum(v * v for v in out) / len(out)) == pytest.approx(1.0, abs=1e-5)
    assert (got[mask == 0] == 0).all()


def test_adaptive_kl_coef_follows_the_clipped_error():
    """Ziegler et al. 2019: beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * samples / horizon."""
    f = 256 / 10000

    def step(kl):
        return algos.adaptive_kl_coef(0.1, kl, target=6.0, horizon=10000, samples=256)

    assert step(6.0) == pytest.approx(0.1)  # on target: unchanged
    assert step(6.6) == pytest.approx(0.1 * (1 + 0.1 * f))  # 10% above: up
    assert step(5.4) == pytest.approx(0.1 * (1 - 0.1 * f))  # 10% below: down
    assert step(60.0) == pytest.approx(0.1 * (1 + 0.2 * f))  # the error is clipped at +0.2
    assert step(0.0) == pytest.approx(0.1 * (1 - 0.2 * f))  # and at -0.2
    assert step(6.6) > 0.1 > step(5.4)
