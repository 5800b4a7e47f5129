"""RL math as pure tensor functions: advantages (group-relative, GAE), the clipped surrogate and
value losses, KL estimators and the adaptive KL coefficient, whitening, loss aggregation, the
Bradley-Terry loss. No model, no distributed state; each is tested against a plain loop."""
import torch


def group_advantages(rewards, scale_std: bool = True, eps: float = 1e-6, scored=None):
    """GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath eq. 3):
    A_ij = r_ij - mean_j(r_i), divided by std_j(r_i) when `scale_std` (Dr. GRPO, Liu et al.
    2025, argues for leaving the std out). rewards, scored [G, n] -> [G, n].
    `scored` (default: all) marks the samples that have a reward: the mean and std are over
    those only, and a sample without one gets 0. A group with fewer than two scored samples,
    or whose scored rewards are all equal, gets exactly 0: its float mean can miss the value
    (eight rewards of 0.1 in fp32), and the rounding left over, divided by a std of ~1e-8,
    would be an advantage of ~0.01."""
    if scored is None:
        scored = torch.ones_like(rewards, dtype=torch.bool)
    count = scored.sum(-1, keepdim=True)  # [G, 1]
    kept = torch.where(scored, rewards, 0.0)  # [G, n]
    centred = rewards - kept.sum(-1, keepdim=True) / count.clamp(min=1)  # [G, n]
    if scale_std:
        # unbiased std, as TRL and veRL; in float64, as torch.std computes it (the same bits)
        r = rewards.double()  # [G, n]
        mean = torch.where(scored, r, 0.0).sum(-1, keepdim=True) / count.clamp(min=1)  # [G, 1]
        var = torch.where(scored, r - mean, 0.0).square().sum(-1, keepdim=True) / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt().to(rewards.dtype) + eps)
    highest = torch.where(scored, rewards, -torch.inf).amax(-1, keepdim=True)  # [G, 1]
    lowest = torch.where(scored, rewards, torch.inf).amin(-1, keepdim=True)  # [G, 1]
    no_signal = (highest == lowest) | (count < 2)  # [G, 1]
    return centred.masked_fill(no_signal, 0.0).masked_fill(~scored, 0.0)


def kl_estimate(logp, ref_logp, kind: str):
    """Per-token estimators of KL(pi || ref) from samples of pi (Schulman 2020, "Approximating
    KL divergence"): k1 = log r', k2 = (log r')^2 / 2, k3 = r - 1 - log r with r = ref/pi.
    logp, ref_logp [B, T] -> [B, T]."""
    log_ratio = ref_logp - logp  # log(ref / pi)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def clipped_surrogate(logp, old_logp, adv, clip_low: float, clip_high: float):
    """PPO's clipped objective as a per-token loss (Schulman et al. 2017, eq. 7), with DAPO's
    decoupled clip range [1 - clip_low, 1 + clip_high] (Yu et al. 2025). Advantages are per
    token (GAE gives one per token; GRPO broadcasts one per completion over its tokens).
    logp, old_logp, adv [B, T] -> (loss [B, T], clipped [B, T] bool)."""
    ratio = torch.exp(logp - old_logp)  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv  # [B, T]
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def aggregate(per_token, mask, mode: str, norm: float):
    """Sum of the loss over this shard of the batch, divided by `norm` (the whole batch's
    count per rank, so that FSDP's gradient average over ranks gives the full-batch mean).
    mode 'token': every token weighs the same (DAPO); norm = tokens in the batch / ranks.
    mode 'sequence': mean over each sequence's tokens, then over sequences (GRPO); norm =
    sequences / ranks. per_token, mask [B, T] -> scalar."""
    if mode == "token":
        return (per_token * mask).sum() / norm
    if mode == "sequence":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norm
    raise ValueError(f"unknown loss aggregation {mode!r}; use token or sequence")


def token_logprobs(logits, tokens, temperature: float = 1.0):
    """log softmax(logits / T) at `tokens`: logits [B, T, V], tokens [B, T] -> [B, T]."""
    logp = torch.log_softmax(logits.float() / temperature, -1)  # [B, T, V]
    return logp.gather(-1, tokens[..., None])[..., 0]


# ---------------------------------------------------------------- PPO with a critic

def token_rewards(score, kl, mask, kl_coef: float):
    """PPO's per-token reward for RLHF (Ziegler et al. 2019; Ouyang et al. 2022): -kl_coef * KL
    at every completion token, plus the sequence's score on its last token. score [B]; kl,
    mask [B, T] (right-padded completions: mask is 1 on a prefix) -> [B, T]."""
    rewards = -kl_coef * kl * mask  # [B, T]
    last = (mask.sum(-1).long() - 1).clamp(min=0)  # [B] index of the last completion token
    has_tokens = (mask.sum(-1) > 0).to(score.dtype)  # [B] an empty completion gets nothing
    rewards[torch.arange(len(score)), last] += score * has_tokens
    return rewards


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), backwards over each
    completion: delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1},
    with V = 0 after the last token. Returns (advantages, returns = A + V): the critic's target.
    rewards, values, mask [B, T] (right-padded: mask is 1 on a prefix) -> ([B, T], [B, T])."""
    rewards, values = rewards * mask, values * mask  # [B, T]: padding adds nothing
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)  # [B, T]
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # [B] A_{t+1}
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)  # [B]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        running = delta + gamma * lam * running
        adv[:, t] = running
    adv = adv * mask
    return adv, (adv + values) * mask


def masked_moments(x, mask):
    """(sum, sum of squares, count) of x where mask is 1: x, mask [B, T] -> 3 scalars, in
    float64. Summed over ranks, they give the whole batch's mean and variance (`whiten`)."""
    x, mask = x.double(), mask.double()
    return (x * mask).sum(), (x * x * mask).sum(), mask.sum()


def whiten(x, mask, total, total_sq, count, eps: float = 1e-8):
    """(x - mean) / std with the batch's moments (`masked_moments`, summed over all trainer ranks,
    so that every rank whitens by the same numbers), 0 outside the mask. As OpenRLHF and TRL
    whiten PPO's advantages. x, mask [B, T] -> [B, T]."""
    mean = total / count.clamp(min=1)
    var = (total_sq / count.clamp(min=1) - mean * mean).clamp(min=0)
    return ((x - mean) / (var.sqrt() + eps)).to(x.dtype) * mask


def clipped_value_loss(values, old_values, returns, clip: float):
    """PPO's clipped value loss (as in OpenAI baselines' ppo2 and Ziegler et al. 2019): the
    larger of the squared errors of V and of V clipped to old_values +- clip, halved.
    values, old_values, returns [B, T] -> (loss [B, T], clipped [B, T] bool: the clipped error
    was the larger)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)  # [B, T]
    plain = (values - returns) ** 2  # [B, T]
    with_clip = (clipped_values - returns) ** 2  # [B, T]
    return 0.5 * torch.maximum(plain, with_clip), with_clip > plain


def adaptive_kl_coef(coef: float, kl: float, target: float, horizon: int, samples: int) -> float:
    """Ziegler et al. 2019's adaptive KL controller (section 2.2): the error
    e = clip(KL / target - 1, -0.2, 0.2) moves the coefficient by a factor 1 + e * samples / horizon
    after each batch of `samples` completions whose mean KL (summed over tokens) is `kl`."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return coef * (1 + error * samples / horizon)


def bradley_terry_loss(chosen, rejected):
    """The Bradley-Terry loss of a reward model on preference pairs (Ouyang et al. 2022, eq. 1):
    -log sigmoid(r_chosen - r_rejected). chosen, rejected [B] -> [B]."""
    return -torch.nn.functional.logsigmoid(chosen - rejected)
