"""RL math as pure tensor functions: advantages, the clipped surrogate, KL estimators,
loss aggregation. No model, no distributed state; each is tested against a plain loop."""
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
