"""rl/flow.py (Flow-GRPO's sampler, log-probs and loss) and tasks/image_rewards.py against
hand-written formulas and plain loops, with a fixed linear stand-in for the velocity model."""
import math

import pytest
import torch

from rl import flow
from tasks import image_rewards

B, C, H, W, STEPS = 3, 2, 4, 4, 6


def linear_velocity(seed: int = 0, scale: float = 0.3):
    """v = A x (over channels) + t * cond: a fixed map in the role of the model."""
    A = torch.randn(C, C, generator=torch.Generator().manual_seed(seed)) * scale  # [C, C]

    def velocity(x, t, cond):  # x [B, C, H, W], t [B], cond [B, C]
        return torch.einsum("oc,bchw->bohw", A, x) + t.view(-1, 1, 1, 1) * cond[:, :, None, None]
    return velocity


def rollout(sde="flow_grpo", noise_level=0.7, sde_steps=None, seed=1, velocity=None, shift=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=g)
    cond = torch.randn(B, C, generator=g)
    ts = flow.timesteps(STEPS, shift)
    out = flow.sample(velocity or linear_velocity(), x, cond, ts, sde, noise_level, sde_steps, g)
    return out, cond, ts


def test_timesteps_run_from_1_to_0_with_sd3_shift():
    for shift in (1.0, 3.0, 3.1):
        ts = flow.timesteps(STEPS, shift)
        assert ts.shape == (STEPS + 1,) and ts[0].item() == 1.0 and ts[-1].item() == 0.0
        assert (ts[1:] < ts[:-1]).all()
        for i in range(1, STEPS):
            t = 1 - i / STEPS
            assert ts[i].item() == pytest.approx(shift * t / (1 + (shift - 1) * t), abs=1e-6)


def test_without_noise_each_sde_sampler_is_the_ode_sampler():
    """noise_level 0: std is 0 and every sigma^2 term of the mean is 0, so the mean is x + v dt
    in the same ops as the ODE step: equal bits. noise_level 1e-8: the mean's sigma^2 terms
    (~1e-16) vanish under fp32 rounding next to 1, and each step adds std * noise, std <= 1e-8 *
    sqrt(t / (1 - t_next)) * sqrt(|dt|) < 3e-8 here, |noise| < 6: < 2e-7 a step, grown at most
    2x a step by this velocity over 6 steps: < 2e-5 in all. With noise 0.7 they differ by ~0.1."""
    ode, _, _ = rollout("ode")
    for sde in ("flow_grpo", "dance_grpo"):
        assert torch.equal(rollout(sde, 0.0)[0]["xs"], ode["xs"])
        assert torch.equal(rollout(sde, 0.7, sde_steps=[])[0]["xs"], ode["xs"])
        tiny = rollout(sde, 1e-8)[0]
        assert (tiny["xs"] - ode["xs"]).abs().max() < 2e-5
        assert (rollout(sde, 0.7)[0]["xs"] - ode["xs"]).abs().max() > 1e-2


def test_the_ode_sampler_is_euler_from_noise():
    out, cond, ts = rollout("ode")
    v = linear_velocity()
    x = out["xs"][:, 0]
    for i in range(STEPS):
        x = x + v(x, ts[i].expand(B), cond) * (ts[i + 1] - ts[i])
        assert torch.allclose(out["xs"][:, i + 1], x, atol=1e-6)
    assert torch.equal(out["image"], out["xs"][:, -1]) and torch.equal(out["logps"], torch.zeros(B, STEPS))


def test_the_steps_follow_the_published_formulas_element_by_element():
    """flow_grpo's sde_step_with_logprob and DanceGRPO's flux_step, written out with floats for one
    element each: the first step (t == 1: sigma uses t_next) and a middle one."""
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(B, C, H, W, generator=g) for _ in range(3))
    a, idx = 0.7, (1, 0, 2, 3)
    for t, tn in ((1.0, 0.9), (0.6, 0.45)):
        xi, vi, zi, dt = x[idx].item(), v[idx].item(), z[idx].item(), tn - t
        sigma = a * math.sqrt(t / (1 - (tn if t == 1 else t)))
        mean = xi * (1 + sigma ** 2 / (2 * t) * dt) + vi * (1 + sigma ** 2 * (1 - t) / (2 * t)) * dt
        x_next, m, s = flow.flow_grpo_step(x, v, t, tn, a, z)
        assert m[idx].item() == pytest.approx(mean, rel=1e-5)
        assert x_next[idx].item() == pytest.approx(mean + sigma * math.sqrt(-dt) * zi, rel=1e-5)
        x0 = xi - t * vi
        score = -(xi - (1 - t) * x0) / t ** 2
        mean = xi + dt * vi - 0.5 * a ** 2 * score * dt
        x_next, m, s = flow.dance_grpo_step(x, v, t, tn, a, z)
        assert m[idx].item() == pytest.approx(mean, rel=1e-5)
        assert x_next[idx].item() == pytest.approx(mean + a * math.sqrt(-dt) * zi, rel=1e-5)


def test_per_row_times_equal_one_call_per_row():
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn(B, C, H, W, generator=g) for _ in range(3))
    t, tn = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.8, 0.5, 0.0])
    for step in (flow.flow_grpo_step, flow.dance_grpo_step):
        x_next, mean, std = step(x, v, t, tn, 0.7, z)
        for b in range(B):
            row = step(x[b:b + 1], v[b:b + 1], t[b].item(), tn[b].item(), 0.7, z[b:b + 1])
            assert torch.allclose(x_next[b:b + 1], row[0], atol=1e-6)
            assert torch.allclose(mean[b:b + 1], row[1], atol=1e-6)


def test_step_logprob_is_the_gaussian_density_averaged():
    g = torch.Generator().manual_seed(0)
    x_next, mean = torch.randn(B, C, H, W, generator=g), torch.randn(B, C, H, W, generator=g)
    std = torch.tensor([0.5, 1.0, 2.0])
    got = flow.step_logprob(x_next, mean, std)
    assert got.shape == (B,)
    for b in range(B):
        s = std[b].item()
        dens = [-(xv - mv) ** 2 / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)
                for xv, mv in zip(x_next[b].flatten().tolist(), mean[b].flatten().tolist())]
        assert got[b].item() == pytest.approx(sum(dens) / len(dens), rel=1e-5)
    normal = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(x_next)
    assert torch.allclose(got, normal.mean((1, 2, 3)), atol=1e-5)


@pytest.mark.parametrize("sde", ["flow_grpo", "dance_grpo"])
def test_recompute_gives_the_rollouts_logprobs_exactly(sde):
    steps = flow.window(STEPS, 3, 2, step=3)  # [1, 2, 3]
    out, cond, ts = rollout(sde, 0.7, sde_steps=steps)
    assert (out["logps"][:, steps] != 0).all() and (out["logps"][:, [0, 4, 5]] == 0).all()
    logp, mean = flow.recompute(linear_velocity(), out["xs"], cond, ts, steps, sde, 0.7)
    assert logp.shape == (B, 3) and mean.shape == (B, 3, C, H, W)
    assert torch.equal(logp, out["logps"][:, steps])
    moved, _ = flow.recompute(linear_velocity(scale=0.31), out["xs"], cond, ts, steps, sde, 0.7)
    assert not torch.allclose(moved, logp, atol=1e-6)


def test_sampling_is_reproducible_from_the_generator():
    assert torch.equal(rollout(seed=5)[0]["xs"], rollout(seed=5)[0]["xs"])
    assert not torch.equal(rollout(seed=5)[0]["xs"], rollout(seed=6)[0]["xs"])


def test_step_std_is_the_steps_std():
    ts = flow.timesteps(STEPS, 3.0)
    x = torch.zeros(1, C, H, W)
    for sde in ("flow_grpo", "dance_grpo"):
        got = flow.step_std(ts, [0, 2, 5], sde, 0.7)
        for k, j in enumerate([0, 2, 5]):
            _, _, std = flow.sde_step(sde, x, x, ts[j], ts[j + 1], 0.7, None)
            assert got[k].item() == pytest.approx(std.item(), rel=1e-6)


def test_the_window_slides_one_step_every_shift_every_and_rolls_back():
    got = [flow.window(6, 4, 25, step) for step in (0, 24, 25, 50, 74, 75)]
    assert got == [[0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 5], [0, 1, 2, 3]]
    assert flow.window(4, 4, 1, 7) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        flow.window(4, 5, 1, 0)


def test_group_advantages_match_a_loop():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 0.0], [100.0, 0, 0, 0]])
    got = flow.group_advantages(r, clip=1.5)
    for p, row in enumerate(r.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / len(row))  # population, as np.std
        for k, x in enumerate(row):
            want = min(1.5, max(-1.5, (x - mean) / (std + 1e-4)))
            assert got[p, k].item() == pytest.approx(want, abs=1e-5)
    assert got[3, 0].item() == 1.5  # 1.73 before the clip
    scored = torch.tensor([[True, True, False, True]] + [[True] * 4] * 3)  # a failed reward: left out
    masked = flow.group_advantages(r, clip=1.5, scored=scored)
    kept = [1.0, 0.0, 1.0]
    mean = sum(kept) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in kept) / 3)
    want = [(x - mean) / (std + 1e-4) for x in kept]
    assert masked[0].tolist() == pytest.approx([want[0], want[1], 0.0, want[2]], abs=1e-5)
    assert torch.equal(masked[1:], got[1:])


def test_clipped_loss_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 3, generator=g)
    logp = old + 0.3 * torch.randn(4, 3, generator=g)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    for clip in (1e-4, 0.2):
        total = 0.0
        for b in range(4):
            for j in range(3):
                r = math.exp(logp[b, j].item() - old[b, j].item())
                a = adv[b].item()
                total += max(-a * r, -a * min(max(r, 1 - clip), 1 + clip))
        assert flow.clipped_loss(logp, old, adv, clip).item() == pytest.approx(total / 12, rel=1e-5)


def test_kl_to_reference_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(2, 3, C, H, W, generator=g), torch.randn(2, 3, C, H, W, generator=g)
    std = torch.rand(2, 3, generator=g) + 0.5
    got = flow.kl_to_reference(mean, ref, std)
    for b in range(2):
        for j in range(3):
            sq = [(m - r) ** 2 for m, r in zip(mean[b, j].flatten().tolist(), ref[b, j].flatten().tolist())]
            want = sum(sq) / len(sq) / (2 * std[b, j].item() ** 2)
            assert got[b, j].item() == pytest.approx(want, rel=1e-5)


def square(colour, half, size=16, background=0.05):
    """[3, H, W] in [-1, 1]: a filled square of `colour` in the middle of a half of a dark image."""
    img = torch.full((3, size, size), background)
    x0 = 2 if half == "left" else size // 2 + 2
    img[:, 4:10, x0:x0 + 5] = torch.tensor(image_rewards.COLOURS[colour])[:, None, None]
    return img * 2 - 1


def test_colour_and_position_on_hand_made_images():
    images = torch.stack([square("red", "left")] * 3 + [square("blue", "right")])
    prompts = ["a red square on the left", "a red square on the right", "a green square", "a blue circle"]
    col = image_rewards.colour(prompts, images)
    pos = image_rewards.position(prompts, images)
    assert col.tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0])
    assert pos.tolist() == pytest.approx([1.0, 0.0, 0.5, 0.5])
    dark = torch.full((1, 3, 16, 16), -0.9)  # no foreground
    assert image_rewards.colour(["a red square"], dark).item() == 0.0
    assert image_rewards.position(["a red square on the left"], dark).item() == 0.0


def test_position_splits_the_middle_column_of_an_odd_width():
    img = -torch.ones(1, 3, 5, 5)
    img[:, :, :, 1:3] = 1.0  # columns 1 and 2 (the middle) white: left 1 + 0.5, right 0.5
    assert image_rewards.position(["a white square on the left"], img).item() == pytest.approx(0.75)


def test_a_flat_image_compresses_better_than_noise():
    flat = square("red", "left", size=32)[None]
    noise = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    got = image_rewards.compressibility(["a red square"] * 2, torch.cat([flat, noise]))
    assert got[0] > -0.2 and got[1] < -0.9


def test_image_rewards_refuse_a_wrong_batch():
    with pytest.raises(ValueError, match="one prompt per image"):
        image_rewards.colour(["a red square"], torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match="B, 3, H, W"):
        image_rewards.IMAGE_REWARDS["position"](["a", "b"], torch.zeros(2, 4, 4))
    assert image_rewards.prompt_words("An orange triangle on the right") == ("orange", "right")
