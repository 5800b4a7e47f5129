"""Flow-GRPO's math as pure tensor functions: the sampler's steps (ODE, Flow-GRPO's SDE, DanceGRPO's
SDE), the Gaussian log-prob of a step, the whole trajectory and the log-probs of its trained steps
under the current model, MixGRPO's window, the group advantages, the clipped loss and the KL.

Rectified flow (Liu et al. 2022; SD3, Esser et al. 2024): x_t = (1 - t) x0 + t eps, the model
predicts v ~ eps - x0, and sampling runs from t = 1 (noise) to t = 0; a step goes from t to
t_next < t, dt = t_next - t < 0. An SDE step is a Gaussian N(mean, std^2) per element, which is
what makes a step a policy with a log-prob (Flow-GRPO, Liu et al. 2025, "Flow-GRPO: Training Flow
Matching Models via Online RL"). All the math is in fp32, as flow_grpo casts before its step
("bf16 can overflow here").

Checked against the public code: yifan123/flow_grpo `sde_step_with_logprob`
(flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_type='sde') and the loss, KL and advantage
lines of scripts/train_sd3.py and flow_grpo/stat_tracking.py; XueZeyue/DanceGRPO `flux_step`
(fastvideo/train_grpo_flux.py, sde_solver=True) and its `sd3_time_shift`; Tencent-Hunyuan/MixGRPO
(fastvideo/utils/sampling_utils.py, scripts/finetune/finetune_flux_grpo_MixGRPO.sh) for the window.
"""
import math

import torch

from rl import algos

SDES = ("flow_grpo", "dance_grpo", "ode")


def timesteps(steps: int, shift: float = 1.0) -> torch.Tensor:
    """t from 1 down to 0 in `steps` equal steps, then SD3's shift t' = s t / (1 + (s - 1) t)
    (Esser et al. 2024; DanceGRPO's `sd3_time_shift`): s > 1 spends more steps at high noise.
    -> [steps + 1]. The ends are set to exactly 1 and 0: Flow-GRPO's sigma_t tests t == 1."""
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)  # [S + 1]
    t = shift * t / (1 + (shift - 1) * t)
    t[0], t[-1] = 1.0, 0.0
    return t.float()


def _per_row(t, x: torch.Tensor) -> torch.Tensor:
    """A float, a 0-d tensor or one value per row [B] -> fp32, broadcastable to x [B, ...]."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 1:
        t = t.view(-1, *([1] * (x.ndim - 1)))  # [B, 1, ..., 1]
    return t


def ode_step(x, v, t, t_next) -> torch.Tensor:
    """Euler's step of dx/dt = v: x + v dt. x, v [B, C, H, W]; t, t_next floats or [B]."""
    dt = _per_row(t_next, x) - _per_row(t, x)
    return x.float() + v.float() * dt


def flow_grpo_step(x, v, t, t_next, noise_level: float, noise):
    """Flow-GRPO's SDE step (Liu et al. 2025, eq. 9; flow_grpo's `sde_step_with_logprob`): the
    reverse-time SDE with the same marginals as the ODE, noise sigma_t = a sqrt(t / (1 - t)),
    a = noise_level. At t == 1 the denominator uses t_next (flow_grpo: sigma_max = sigmas[1],
    the first step's t_next, which a step from t = 1 is). x, v, noise [B, C, H, W]; t, t_next
    floats or [B] -> (x_next [B, C, H, W] (None when noise is None), mean [B, C, H, W], std
    broadcastable to x: sigma_t sqrt(-dt))."""
    x, v = x.float(), v.float()
    t, t_next = _per_row(t, x), _per_row(t_next, x)
    dt = t_next - t
    sigma = torch.sqrt(t / (1 - torch.where(t == 1, t_next, t))) * noise_level
    mean = x * (1 + sigma ** 2 / (2 * t) * dt) + v * (1 + sigma ** 2 * (1 - t) / (2 * t)) * dt
    std = sigma * torch.sqrt(-dt)
    x_next = None if noise is None else mean + std * noise
    return x_next, mean, std


def dance_grpo_step(x, v, t, t_next, eta: float, noise):
    """DanceGRPO's SDE step (Xue et al. 2025; `flux_step` with sde_solver=True): the Euler step
    plus a score term, score = -(x - (1 - t) x0_hat) / t^2 with x0_hat = x - t v, and noise of
    std eta sqrt(-dt). Same shapes and returns as `flow_grpo_step`."""
    x, v = x.float(), v.float()
    t, t_next = _per_row(t, x), _per_row(t_next, x)
    dt = t_next - t
    x0_hat = x - t * v  # [B, C, H, W]
    score = -(x - x0_hat * (1 - t)) / t ** 2  # [B, C, H, W]
    mean = x + dt * v + (-0.5 * eta ** 2 * score) * dt
    std = eta * torch.sqrt(-dt)
    x_next = None if noise is None else mean + std * noise
    return x_next, mean, std


def sde_step(sde: str, x, v, t, t_next, noise_level: float, noise):
    """The step of `sde` ('flow_grpo' or 'dance_grpo'): the one code path of `sample` and
    `recompute`, so that the log-probs of the two agree bit for bit."""
    if sde == "flow_grpo":
        return flow_grpo_step(x, v, t, t_next, noise_level, noise)
    if sde == "dance_grpo":
        return dance_grpo_step(x, v, t, t_next, noise_level, noise)
    raise ValueError(f"unknown SDE {sde!r}; use flow_grpo or dance_grpo")


def step_logprob(x_next, mean, std) -> torch.Tensor:
    """log N(x_next; mean, std^2) per element, averaged over all but the batch dim (as flow_grpo
    and DanceGRPO do: a mean, not the sum, so the ratio stays near 1 at any image size); fp32.
    With the constants, as flow_grpo; DanceGRPO's leave them out, which changes no ratio (std
    depends on the times only).
    x_next is detached: the gradient flows through the mean. x_next, mean [B, ...]; std a float,
    [B] or broadcastable -> [B]."""
    x_next, mean = x_next.detach().float(), mean.float()
    std = _per_row(std, mean)
    logp = -((x_next - mean) ** 2) / (2 * std ** 2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return logp.mean(dim=tuple(range(1, logp.ndim)))


def _sde_mask(sde: str, sde_steps, steps: int) -> list[bool]:
    """Which steps are SDE: none for 'ode'; all when sde_steps is None; else sde_steps is a bool
    mask [S] or a collection of step indices."""
    if sde not in SDES:
        raise ValueError(f"unknown sampler {sde!r}; use one of {SDES}")
    if sde == "ode":
        return [False] * steps
    if sde_steps is None:
        return [True] * steps
    if isinstance(sde_steps, torch.Tensor) and sde_steps.dtype == torch.bool:
        sde_steps = sde_steps.tolist()
    if len(sde_steps) == steps and all(isinstance(s, bool) for s in sde_steps):
        return list(sde_steps)
    ids = {int(i) for i in sde_steps}
    if ids and (min(ids) < 0 or max(ids) >= steps):
        raise ValueError(f"SDE steps {sorted(ids)}: each in [0, {steps})")
    return [i in ids for i in range(steps)]


@torch.no_grad()
def sample(velocity, x, cond, ts, sde: str = "flow_grpo", noise_level: float = 0.7, sde_steps=None,
           generator: torch.Generator | None = None, noises: torch.Tensor | None = None) -> dict:
    """The whole trajectory from x (noise at t = ts[0] = 1) through the times ts [S + 1]:
    `velocity(x, t_vec [B], cond) -> v`; an SDE step (with its log-prob) at the steps in
    `sde_steps` (MixGRPO's window, Li et al. 2025; None: all), the ODE elsewhere. A noise draw
    is made at every step, SDE or not, so that step i's noise does not depend on the window
    (or given: noises [B, S, C, H, W], drawn per image so that an image does not depend on its batch).
    noise_level 0 (or no SDE step) gives the ODE sampler's latents exactly (its log-probs are
    then NaN: std 0). x [B, C, H, W] -> {"xs": [B, S + 1, C, H, W] every latent, "logps": [B, S]
    (0 at ODE steps), "sde": [S] bool, "image": [B, C, H, W] the last latent, "x0_hat": the last
    step's x - t v (DanceGRPO decodes this one: the last SDE step leaves noise in the latent)}."""
    B, S = x.shape[0], len(ts) - 1
    on = _sde_mask(sde, sde_steps, S)
    x, ts = x.float(), ts.to(x.device)
    xs = [x]
    logps = torch.zeros(B, S, device=x.device)  # [B, S]
    for i in range(S):
        v = velocity(x, ts[i].expand(B), cond)  # [B, C, H, W]
        noise = noises[:, i] if noises is not None else torch.randn(x.shape, generator=generator,
                                                                    device=x.device)  # [B, C, H, W]
        if on[i]:
            x, mean, std = sde_step(sde, x, v, ts[i], ts[i + 1], noise_level, noise)
            logps[:, i] = step_logprob(x, mean, std)
        else:
            x = ode_step(x, v, ts[i], ts[i + 1])
        xs.append(x)
    x0_hat = xs[-2] - ts[S - 1] * v.float()  # the last step's prediction of the clean image
    return {"xs": torch.stack(xs, 1), "logps": logps, "sde": torch.tensor(on), "image": x, "x0_hat": x0_hat}


def recompute(velocity, xs, cond, ts, step_ids, sde: str, noise_level: float):
    """The log-prob of each stored x_{j+1} given x_j under the current `velocity`, at the trained
    steps j in step_ids [J] (what the loss differentiates). Same step code as `sample`: before
    any update it returns the rollout's log-probs exactly, given the rollout's batch (a part of it
    goes through other GEMM kernels: ~1e-7 off, measured with models/flow_dit.py on CPU, far
    inside a clip range of 1e-4). xs [B, S + 1, C, H, W] -> (logp [B, J], mean [B, J, C, H, W])."""
    B, ts = xs.shape[0], ts.to(xs.device)
    logps, means = [], []
    for j in step_ids:
        x = xs[:, j].contiguous()  # [B, C, H, W] laid out as the rollout's x was: the same kernels
        v = velocity(x, ts[j].expand(B), cond)  # [B, C, H, W]
        _, mean, std = sde_step(sde, x, v, ts[j], ts[j + 1], noise_level, None)
        logps.append(step_logprob(xs[:, j + 1], mean, std))
        means.append(mean)
    return torch.stack(logps, 1), torch.stack(means, 1)


def step_std(ts, step_ids, sde: str, noise_level: float) -> torch.Tensor:
    """The std of each trained step's Gaussian (it depends on the times only, not on the model),
    through the same step function on a dummy latent. ts [S + 1], step_ids [J] -> [J]."""
    ids = torch.as_tensor(list(step_ids), dtype=torch.long)
    x = torch.zeros(len(ids), 1, device=ts.device)  # [J, 1]
    _, _, std = sde_step(sde, x, x, ts[ids], ts[ids + 1], noise_level, None)
    return std.expand(len(ids), 1)[:, 0]


def window(steps: int, size: int, shift_every: int, step: int) -> list[int]:
    """MixGRPO's sliding window of SDE (and trained) steps (Li et al. 2025, "MixGRPO", sec. 4.2;
    their script: progressive, overlap step 1, roll back): it starts at step 0 and moves one step
    later every `shift_every` training steps; past the last place it fits, it rolls back to 0.
    -> the `size` step indices at training step `step`."""
    if not 1 <= size <= steps or shift_every < 1:
        raise ValueError(f"window of {size} steps every {shift_every}: need 1 <= size <= {steps}, "
                         f"shift_every >= 1")
    start = (step // shift_every) % (steps - size + 1)
    return list(range(start, start + size))


def group_advantages(rewards, clip: float, eps: float = 1e-4, scored=None) -> torch.Tensor:
    """GRPO's advantage per prompt group as flow_grpo's PerPromptStatTracker computes it:
    (r - mean) / (std + eps) with the population std (np.std), then clipped to [-clip, clip]
    (flow_grpo's adv_clip_max, 5). rewards [P, K] (K samples of each of P prompts) -> [P, K].
    scored [P, K] bool: an image whose reward failed is left out of its group's mean and std and
    gets advantage 0 (out of the loss), as a failed text reward is (roles/reward.py)."""
    scored = torch.ones_like(rewards, dtype=torch.bool) if scored is None else scored
    w = scored.float()  # [P, K]
    count = w.sum(-1, keepdim=True).clamp(min=1)  # [P, 1]
    mean = (rewards * w).sum(-1, keepdim=True) / count  # [P, 1]
    std = (((rewards - mean) ** 2 * w).sum(-1, keepdim=True) / count).sqrt()  # [P, 1] population
    return ((rewards - mean) / (std + eps)).clamp(-clip, clip) * w


def clipped_loss(logp, old_logp, adv, clip_range: float) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017) on each trained step's ratio
    exp(logp - old_logp), the image's advantage at each of its steps, mean over steps and rows
    (flow_grpo's train_sd3.py; its clip range is tiny, 1e-4). logp, old_logp [B, J], adv [B]
    -> scalar."""
    per_step, _ = algos.clipped_surrogate(logp, old_logp, adv[:, None].expand_as(logp),
                                          clip_range, clip_range)  # [B, J]
    return per_step.mean()


def kl_to_reference(mean, ref_mean, std) -> torch.Tensor:
    """KL between the policy's and the reference's step Gaussians, which share their std:
    |mu - mu_ref|^2 / (2 std^2) per element, averaged over the non-batch dims like the log-prob
    (flow_grpo's train_sd3.py). With std = the step's std (`step_std`) it is the exact KL;
    flow_grpo passes sigma_t = std / sqrt(-dt) instead, a KL |dt| times smaller.
    mean, ref_mean [B, J, ...], std [B, J] or [J] -> [B, J]."""
    sq = (mean.float() - ref_mean.float()) ** 2  # [B, J, ...]
    return sq.mean(dim=tuple(range(2, sq.ndim))) / (2 * std ** 2)
