"""Training losses of the pipeline: reward model, preference (DPO family, KTO) and RL (PPO family).

Every loss is a plain function of tensors. Shapes: B = batch, T = response tokens, V = vocabulary.
Masks are 1 for tokens that count and 0 for padding; padded positions never change a result.
"""
import torch
import torch.nn.functional as F

Tensor = torch.Tensor

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_KINDS = ("k1", "k2", "k3")


# ---------------------------------------------------------------------------------------------
# Masked aggregation
# ---------------------------------------------------------------------------------------------

def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    """Mean of x over positions where mask is 1 (over all of them, or along dim)."""
    mask = mask.to(x.dtype)
    # clamp: an all-padding row gives 0 instead of NaN.
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def aggregate(loss: Tensor, mask: Tensor, mode: str = "token_mean") -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    token_mean          : every valid token of the batch weighs the same (long answers weigh more).
    seq_mean_token_mean : every sequence weighs the same (GRPO's original length normalisation).
    seq_mean_token_sum  : per-sequence sums, averaged over sequences (Dr. GRPO, no length bias).
    """
    if mode == "token_mean":
        return masked_mean(loss, mask)
    if mode == "seq_mean_token_mean":
        return masked_mean(loss, mask, dim=-1).mean()
    if mode == "seq_mean_token_sum":
        return (loss * mask.to(loss.dtype)).sum(-1).mean()
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")


# ---------------------------------------------------------------------------------------------
# Per-token statistics
# ---------------------------------------------------------------------------------------------

def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence", 2020).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1, with log r = logp - ref_logp.
    k1 is unbiased but can be negative; k3 is unbiased and never negative; k2 is biased, low variance.
    No clamping here: callers that fear exp overflow in k3 clamp the log-ratio first.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")


# ---------------------------------------------------------------------------------------------
# Reward model: pairwise losses on scalar rewards (B,), returning a scalar mean
# ---------------------------------------------------------------------------------------------

def pairwise_sigmoid_loss(chosen_reward: Tensor, rejected_reward: Tensor, margin: Tensor | None = None) -> Tensor:
    # Bradley-Terry (Ouyang et al. 2022; margin as in Llama 2, Touvron et al. 2023): -log sigma(r_c - r_r - m)
    diff = chosen_reward - rejected_reward
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def pairwise_logexp_loss(chosen_reward: Tensor, rejected_reward: Tensor, margin: Tensor | None = None) -> Tensor:
    # Same objective written as log(1 + exp(r_r - r_c + m)); softplus keeps it stable for large gaps.
    diff = rejected_reward - chosen_reward
    if margin is not None:
        diff = diff + margin
    return F.softplus(diff).mean()


# ---------------------------------------------------------------------------------------------
# Preference optimisation. Inputs are per-sequence log-probs (B,) of the response under the
# policy and the frozen reference. Each returns (loss, chosen_rewards, rejected_rewards) with
# implicit rewards beta * (logp_policy - logp_ref), detached, for logging.
# ---------------------------------------------------------------------------------------------

def _logratio_margin(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor):
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    return chosen_logratio, rejected_logratio, chosen_logratio - rejected_logratio


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float, label_smoothing: float = 0.0):
    # DPO (Rafailov et al. 2023, eq. 7): -log sigma(beta * h), h = chosen log-ratio - rejected log-ratio.
    # label_smoothing = eps > 0 gives conservative DPO (cDPO): labels flipped with probability eps.
    # Inputs: summed (not averaged) response log-probs.
    chosen_lr, rejected_lr, h = _logratio_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses.mean(), (beta * chosen_lr).detach(), (beta * rejected_lr).detach()


def ipo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float):
    # IPO (Azar et al. 2023): (h - 1/(2 beta))^2, h = chosen log-ratio - rejected log-ratio.
    # Inputs should be length-averaged log-probs (sum / number of response tokens), as in the
    # reference implementations: with summed log-probs h grows with length and the 1/(2 beta)
    # target would mean something different for every length. beta here is IPO's tau.
    chosen_lr, rejected_lr, h = _logratio_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = (h - 1 / (2 * beta)).square()
    return losses.mean(), (beta * chosen_lr).detach(), (beta * rejected_lr).detach()


def simpo_loss(avg_logp_chosen: Tensor, avg_logp_rejected: Tensor, beta: float, gamma: float):
    # SimPO (Meng et al. 2024): -log sigma(beta * (avg_c - avg_r) - gamma), reference-free.
    # Inputs are length-averaged policy log-probs; the rewards are beta * avg log-prob.
    losses = -F.logsigmoid(beta * (avg_logp_chosen - avg_logp_rejected) - gamma)
    return losses.mean(), (beta * avg_logp_chosen).detach(), (beta * avg_logp_rejected).detach()


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, is_desirable: Tensor, kl_ref_point,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    # KTO (Ethayarajh et al. 2024): unpaired samples, value relative to the reference point z0.
    # desirable: w_d * (1 - sigma(beta (r - z0))), undesirable: w_u * (1 - sigma(beta (z0 - r))),
    # r = log pi - log pi_ref (summed log-probs, (B,)); z0 = batch KL estimate, clamped at 0 and
    # detached (the paper does not backpropagate through it). Returns (loss, rewards (B,)).
    log_ratio = policy_logps - ref_logps
    z0 = torch.as_tensor(kl_ref_point, dtype=log_ratio.dtype, device=log_ratio.device).detach().clamp(min=0)
    desirable = is_desirable.bool()
    losses = torch.where(desirable,
                         desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - log_ratio))))
    return losses.mean(), (beta * log_ratio).detach()


def sequence_nll(logps_sum: Tensor, lengths: Tensor) -> Tensor:
    # Length-normalised NLL of the chosen responses, the optional SFT term added to DPO (RPO, Pang et al. 2024).
    return -(logps_sum / lengths.to(logps_sum.dtype)).mean()


# ---------------------------------------------------------------------------------------------
# RL: per-token inputs (B, T) with a response mask (B, T)
# ---------------------------------------------------------------------------------------------

def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token_mean", is_weight: Tensor | None = None):
    """Clipped surrogate policy loss. Returns (loss, clip_fraction).

    PPO clip (Schulman et al. 2017, eq. 7) with the ratio kept in [1 - clip_low, 1 + clip_high]
    (asymmetric "clip-higher", DAPO, Yu et al. 2025) and optional dual clip (Ye et al. 2020):
    for negative advantages the loss is capped at -c * A, so a huge ratio cannot blow it up.
    is_weight (B, T): per-token importance weight (e.g. truncated pi_trainer_old / pi_rollout
    for the inference-engine vs trainer log-prob gap); it scales the loss and gets no gradient.
    clip_fraction: share of valid tokens whose gradient a clip removed (PPO or dual clip).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.max(unclipped, clipped)  # pessimistic: max of losses = min of objectives
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
        was_clipped = was_clipped | dual_clipped
    if is_weight is not None:
        loss = loss * is_weight.detach()
    clip_fraction = masked_mean(was_clipped.to(loss.dtype), mask).detach()
    return aggregate(loss, mask, agg), clip_fraction


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None = None, agg: str = "token_mean") -> Tensor:
    # Clipped value loss (PPO as implemented in OpenAI baselines): 0.5 * max((V - R)^2, (V_clip - R)^2),
    # V_clip = V_old + clamp(V - V_old, -clip, clip); keeps the critic near the one that made the returns.
    loss = (values - returns).square()
    if clip is not None:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.max(loss, (values_clipped - returns).square())
    return 0.5 * aggregate(loss, mask, agg)


POLICY_LOSSES = ("ppo", "gspo", "cispo")


def gspo_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                     clip_low: float = 3e-4, clip_high: float = 4e-4, is_weight: Tensor | None = None):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7). Returns (loss, clip_fraction).

    The importance ratio is the sequence's, length-normalised: s_i = exp(mean_t (logp - old_logp)) over the response
    tokens, clipped per sequence to [1 - clip_low, 1 + clip_high] (the paper's ranges are ~1e-4 wide, not PPO's 0.2).
    GSPO-token form (eq. 7): s_i,t = sg[s_i] * pi_t / sg[pi_t], equal to s_i in value, so the gradient reaches every
    token, scaled by its sequence's ratio. Each sequence weighs the same (the mean over sequences of the mean over
    its tokens); clip_fraction: the share of sequences whose gradient the clip removed.
    """
    seq_log_ratio = masked_mean(logp - old_logp, mask, dim=-1)  # (B,)
    ratio = torch.exp(seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.max(unclipped, clipped)
    if is_weight is not None:
        loss = loss * is_weight.detach()
    sequences = mask.sum(-1) > 0
    seq_clipped = (((clipped > unclipped) & mask.bool()).any(-1) & sequences).to(loss.dtype)
    clip_fraction = (seq_clipped.sum() / sequences.sum().clamp(min=1)).detach()
    return aggregate(loss, mask, "seq_mean_token_mean"), clip_fraction


def cispo_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                      clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token_mean",
                      is_weight: Tensor | None = None):
    """CISPO (MiniMax-M1, MiniMax 2025, eqs. 4-5). Returns (loss, clip_fraction).

    J = E[ sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi(y_t) ], r_t = pi / pi_old: the importance weight
    is clipped and detached, never the token, so every token keeps its gradient (PPO's clip drops the gradient of the
    tokens whose ratio left the range, often the rare ones that start a new line of reasoning). Its gradient equals
    PPO's unclipped one, -A r grad log pi, wherever the ratio is in range. clip_fraction: the share of tokens whose
    weight was clipped.
    """
    ratio = torch.exp(logp - old_logp).detach()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -weight * advantages * logp
    if is_weight is not None:
        loss = loss * is_weight.detach()
    clip_fraction = masked_mean((weight != ratio).to(loss.dtype), mask).detach()
    return aggregate(loss, mask, agg), clip_fraction


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int) -> Tensor:
    # DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_tokens - buffer tokens, then falling
    # linearly to -1 at max_tokens: ((max_tokens - buffer) - |y|) / buffer.
    start = max_tokens - buffer
    return ((start - lengths.to(torch.float32)) / buffer).clamp(-1.0, 0.0)
