"""RL math as pure tensor functions: advantages (group-relative, GAE), the clipped surrogate and
value losses, KL estimators and the adaptive KL coefficient, whitening, loss aggregation, the
Bradley-Terry loss. No model, no distributed state; each is tested against a plain loop."""
import math

import torch

from utils.errors import UserError


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


def distill_advantage(student_logp, teacher_logp, mask, coef: float):
    """On-policy distillation's per-token signal (Agarwal et al. 2024, GKD; Thinking Machines, "On-
    Policy Distillation", 2025): on the student's own samples, the reverse KL KL(student || teacher)
    estimated at each sampled token by k1 = log pi_student - log pi_teacher, negated, scaled by
    `coef` and used as that token's advantage, undiscounted (a token is judged by the teacher's view
    of it alone). k1 rather than k3: as an advantage its expectation under the student's sampling is
    the reverse KL's policy gradient, the recipe's; k3's is not. 0 where the teacher agrees, exactly.
    student_logp, teacher_logp, mask [B, T] -> [B, T], 0 outside the mask."""
    return coef * (teacher_logp - student_logp) * mask


def clipped_surrogate(logp, old_logp, adv, clip_low: float, clip_high: float):
    """PPO's clipped objective as a per-token loss (Schulman et al. 2017, eq. 7), with DAPO's
    decoupled clip range [1 - clip_low, 1 + clip_high] (Yu et al. 2025). Advantages are per
    token (GAE gives one per token; GRPO broadcasts one per completion over its tokens).
    logp, old_logp, adv [B, T] -> (loss [B, T], clip_active [B, T] bool: the clip bounds the term)."""
    ratio = torch.exp(logp - old_logp)  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv  # [B, T]
    clip_active = clipped < unclipped  # [B, T] bool: the clipped term is the smaller, taken
    return -torch.minimum(unclipped, clipped), clip_active


def aggregate(per_token, mask, mode: str, norm: float, max_len: int | None = None):
    """Sum of the loss over this shard of the batch, divided by `norm` (the whole batch's
    count per rank, so that FSDP's gradient average over ranks gives the full-batch mean).
    mode 'token': every token weighs the same (DAPO); norm = tokens in the batch / ranks.
    mode 'sequence': mean over each sequence's tokens, then over sequences (GRPO); norm =
    sequences / ranks. mode 'constant': each sequence's token sum divided by a constant,
    max_len, the completion length limit, then the mean over sequences (Dr. GRPO, Liu et al.
    2025: no length bias); norm = sequences / ranks. per_token, mask [B, T] -> scalar."""
    if mode == "token":
        return (per_token * mask).sum() / norm
    if mode == "sequence":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norm
    if mode == "constant":
        return ((per_token * mask).sum(-1) / max_len).sum() / norm
    raise ValueError(f"unknown loss aggregation {mode!r}; use token, sequence or constant")


# ---------------------------------------------------------------- PPO with a critic

def token_rewards(score, kl, mask, kl_coef: float):
    """PPO's per-token reward for RLHF (Ziegler et al. 2019; Ouyang et al. 2022): -kl_coef * KL
    at every completion token, plus the sequence's score on its last token. score [B]; kl,
    mask [B, T] (1 on the tokens the policy chose: a prefix, or with multi-turn episodes the
    model's turns, the environment's tokens 0 between them) -> [B, T]."""
    rewards = -kl_coef * kl * mask  # [B, T]
    T = mask.shape[-1]
    last = T - 1 - (mask > 0).flip(-1).int().argmax(-1)  # [B] index of the last token in the mask
    has_tokens = (mask.sum(-1) > 0).to(score.dtype)  # [B] an empty completion gets nothing
    rewards[torch.arange(len(score)), last] += score * has_tokens
    return rewards


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), backwards over each
    completion's tokens in the mask: delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma
    * lam * A_next, where "next" is the next token in the mask (tokens outside it, the
    environment's in a multi-turn episode, are skipped: the policy made no choice there) and V = 0
    after the last. Returns (advantages, returns = A + V): the critic's target.
    rewards, values, mask [B, T] -> ([B, T], [B, T]), 0 outside the mask."""
    rewards, values = rewards * mask, values * mask  # [B, T]: padding adds nothing
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)  # [B, T]
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # [B] A at the next token
    next_value = torch.zeros_like(running)  # [B] V at the next token
    for t in reversed(range(T)):
        on = mask[:, t] > 0  # [B]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        running = torch.where(on, delta + gamma * lam * running, running)
        next_value = torch.where(on, values[:, t], next_value)
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


# ---------------------------------------------------------------- the algorithm menu (train_grpo.py)

def rloo_advantages(rewards, scored=None):
    """RLOO's leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - mean of
    the other scored samples of the group. A sample without a reward gets 0; so does a group with
    fewer than two scored samples, or whose scored rewards are all equal: exactly 0, not the
    rounding of the others' mean (~1e-8 for eight rewards of 0.1 in fp32), so that the actor's
    zero-advantage row skip sees it. rewards, scored [G, n] -> [G, n]."""
    if rewards.shape[-1] < 2:
        raise UserError("RLOO's baseline is the mean of a prompt's other samples: with "
                        "--num-generations 1 there are none; use 2 or more")
    if scored is None:
        scored = torch.ones_like(rewards, dtype=torch.bool)
    kept = torch.where(scored, rewards, 0.0)  # [G, n]
    count = scored.sum(-1, keepdim=True)  # [G, 1]
    others = (kept.sum(-1, keepdim=True) - kept) / (count - 1).clamp(min=1)  # [G, n]
    adv = rewards - others  # [G, n]
    highest = torch.where(scored, rewards, -torch.inf).amax(-1, keepdim=True)  # [G, 1]
    lowest = torch.where(scored, rewards, torch.inf).amin(-1, keepdim=True)  # [G, 1]
    no_signal = (highest == lowest) | (count < 2)  # [G, 1]
    return adv.masked_fill(no_signal, 0.0).masked_fill(~scored, 0.0)


def reinforce_pp_returns(rewards, kl, mask, kl_coef: float, baseline=None):
    """REINFORCE++ (Hu 2025): the per-token reward -kl_coef * KL with the score on the last token,
    summed from each token to the end (gamma = 1: GAE with no critic and lambda 1), to be
    whitened over the whole batch (`whiten`). Its baseline variant subtracts the group's mean
    reward from the score first (baseline [B], default none). rewards [B]; kl, mask [B, T] ->
    [B, T]."""
    score = rewards if baseline is None else rewards - baseline  # [B]
    per_token = token_rewards(score, kl, mask, kl_coef)  # [B, T]
    returns, _ = gae(per_token, torch.zeros_like(per_token), mask, 1.0, 1.0)  # [B, T]
    return returns


def overlong_penalty(lengths, max_len: int, buffer: int, penalty: float = 1.0):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_len - buffer, then
    falling linearly to -penalty at max_len (and -penalty beyond). lengths [B] -> [B]."""
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0) / buffer  # [B] share of the buffer used
    return -penalty * over.clamp(max=1.0)


def dual_clip_surrogate(logp, old_logp, adv, clip_low: float, clip_high: float, c: float):
    """Dual-clip PPO (Ye et al. 2020, eq. 5): for negative advantages the clipped objective is
    bounded below by c * A (c > 1), so a huge ratio on a bad token cannot make the loss unbounded.
    logp, old_logp, adv [B, T] -> (loss [B, T], clipped [B, T] bool: either clip acted)."""
    loss, clipped = clipped_surrogate(logp, old_logp, adv, clip_low, clip_high)  # [B, T]
    bound = -c * adv  # [B, T] the loss's upper bound where A < 0
    capped = (adv < 0) & (loss > bound)  # [B, T]
    return torch.where(capped, bound, loss), clipped | capped


def gspo_surrogate(logp, old_logp, adv, mask, clip_low: float, clip_high: float):
    """GSPO (Zheng et al. 2025): the importance ratio of the whole sequence,
    s = exp(mean_t log(pi / pi_old)), clipped to [1 - clip_low, 1 + clip_high] (a small range,
    3e-4..4e-4 in the paper), on the sequence's advantage (the mean of adv over its tokens).
    The per-token loss is the sequence's, at each of its tokens. logp, old_logp, adv, mask
    [B, T] -> (loss [B, T], clipped [B, T] bool)."""
    length = mask.sum(-1).clamp(min=1)  # [B]
    log_s = ((logp - old_logp) * mask).sum(-1) / length  # [B]
    s = torch.exp(log_s)  # [B]
    a = (adv * mask).sum(-1) / length  # [B]
    unclipped, clipped = s * a, s.clamp(1 - clip_low, 1 + clip_high) * a  # [B]
    loss = -torch.minimum(unclipped, clipped)  # [B]
    return loss[:, None].expand_as(logp), (clipped < unclipped)[:, None].expand_as(logp)


def cispo_loss(logp, old_logp, adv, clip_low: float, clip_high: float):
    """CISPO (MiniMax-M1, 2025, eq. 4): -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi.
    The clip bounds the importance weight but never drops a token's gradient, as PPO's clip does.
    logp, old_logp, adv [B, T] -> (loss [B, T], clipped [B, T] bool: the weight was clipped)."""
    ratio = torch.exp(logp - old_logp).detach()  # [B, T]
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)  # [B, T]
    return -weight * adv * logp, weight != ratio


def mismatch_weights(old_logp, engine_logp, mask, kind: str, level: str, low: float, high: float):
    """Corrections for the gap between the trainer's and the engine's log-probs of the same
    sampled tokens, r = pi_old(trainer) / pi_engine, at `level` token (r_t), sequence
    (prod_t r_t) or geometric (exp(mean_t log r_t)); see ../shared/DESIGN.md:
      tis     weight min(r, high) on the token's loss (truncated importance sampling)
      mis     tokens (or sequences) with r outside [low, high] leave the loss (masked IS)
      icepop  weight r inside [low, high], 0 outside; the tokens stay in the normaliser
    old_logp, engine_logp, mask [B, T] -> (weight [B, T] (no gradient), kept [B, T] mask, r [B, T])."""
    log_r = (old_logp - engine_logp).detach() * mask  # [B, T]
    if level == "token":
        r = torch.exp(log_r)  # [B, T]
    elif level == "sequence":
        r = torch.exp(log_r.sum(-1, keepdim=True)).expand_as(log_r)  # [B, T]
    elif level == "geometric":
        r = torch.exp(log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_r)
    else:
        raise ValueError(f"unknown mismatch level {level!r}; use token, sequence or geometric")
    inside = (r >= low) & (r <= high)  # [B, T]
    ones = torch.ones_like(r)
    if kind == "tis":
        return r.clamp(max=high), mask, r
    if kind == "mis":
        return ones, mask * inside, r
    if kind == "icepop":
        return torch.where(inside, r, 0.0), mask, r
    raise ValueError(f"unknown mismatch correction {kind!r}; use tis, mis or icepop")


# ---- dynamic sampling (DAPO, Yu et al. 2025, sec. 3.2, with G-Core's waves; ../shared/DESIGN.md)

def informative_groups(rewards, scored):
    """DAPO's filter: a group carries GRPO signal only if its scored rewards are not all equal
    (with fewer than two scored samples it carries none). rewards, scored [G, n] -> [G] bool."""
    high = torch.where(scored, rewards, -torch.inf).max(-1).values  # [G]
    low = torch.where(scored, rewards, torch.inf).min(-1).values  # [G]
    return (scored.sum(-1) >= 2) & (high > low)


def wave_size(gap: int, ema: float, oversampling: float) -> int:
    """G-Core's refill: prompts to draw for `gap` missing groups, ceil(gap * ema * oversampling),
    where ema estimates how many groups it takes to find one informative group."""
    if gap <= 0:
        return 0
    return math.ceil(gap * ema * oversampling)


def sampling_ema(ema: float, generated: int, informative: int, decay: float, max_ratio: float) -> float:
    """G-Core's update after a step, from the counts summed over the trainer ranks: the step's
    groups-per-informative-group ratio (max_ratio when none was informative, and at most it),
    folded into the running average: decay * ema + (1 - decay) * ratio."""
    if informative == 0:
        current = max_ratio
    else:
        current = min(generated / informative, max_ratio)
    return decay * ema + (1 - decay) * current


# ---- the menu: --policy-loss and --advantage choices beyond GRPO's own (which train_grpo.py writes out).
# Plain dicts of adapters from the script's batch and flags to the functions above.

POLICY_LOSSES = {  # (logp, old_logp, adv, mask [n, T] each, args) -> (loss, clipped) [n, T]
    "dual_clip": lambda logp, old, adv, mask, a: dual_clip_surrogate(logp, old, adv, a.clip_low, a.clip_high,
                                                                     a.dual_clip_c),
    "gspo": lambda logp, old, adv, mask, a: gspo_surrogate(logp, old, adv, mask, a.gspo_clip_low,
                                                           a.gspo_clip_high),
    "cispo": lambda logp, old, adv, mask, a: cispo_loss(logp, old, adv, a.clip_low, a.clip_high),
}


def _per_completion(adv, mask):
    """One advantage per completion [N] -> at each of its tokens [N, T]."""
    return adv.reshape(-1, 1).to(mask.device).expand_as(mask)


def _rloo(got, batch, args, reduce_sum):
    n = args.num_generations
    return _per_completion(rloo_advantages(got.rewards.view(-1, n), got.scored.view(-1, n)),
                           batch["loss_mask"])


def _remax(got, batch, args, reduce_sum):
    adv = (got.rewards - got.baseline.repeat_interleave(args.num_generations)) * got.scored  # [N]
    return _per_completion(adv, batch["loss_mask"])


def _reinforce_pp(got, batch, args, reduce_sum):
    """REINFORCE++ (Hu et al. 2025): the KL to the reference in the per-token reward, returns whitened
    over the whole batch (`reduce_sum` all-reduces the moments over the trainers); _baseline: the
    group's mean over its scored samples subtracted first."""
    # mask [N, T]
    n, mask, rewards, scored = args.num_generations, batch["loss_mask"], got.rewards, got.scored
    baseline = None
    if args.advantage == "reinforce++_baseline":
        kept = torch.where(scored, rewards, 0.0).view(-1, n)  # [G, n]
        mean = kept.sum(-1) / scored.view(-1, n).sum(-1).clamp(min=1)  # [G]
        baseline = mean.repeat_interleave(n).to(mask.device)  # [N]
    kl = torch.zeros_like(mask)  # [N, T]
    if "ref_logp" in batch:
        kl = kl_estimate(batch["old_logp"], batch["ref_logp"], args.kl_estimator) * mask
    returns = reinforce_pp_returns(rewards.to(mask.device), kl, mask, args.kl_coef, baseline)  # [N, T]
    moments = torch.stack(masked_moments(returns, mask))  # [3]: sum, sum of squares, count
    reduce_sum(moments)
    return whiten(returns, mask, *moments)


ADVANTAGES = {  # (rollout, batch, args, reduce_sum) -> adv [N, T]
    "rloo": _rloo, "remax": _remax, "reinforce++": _reinforce_pp, "reinforce++_baseline": _reinforce_pp,
}
