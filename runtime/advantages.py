"""Advantage estimators for the RL stage.

Shapes: B = sampled responses, T = response tokens.
  rewards (B, T): per-token rewards. The sequence score sits on the last valid token; a per-token
                  KL penalty may already be subtracted from every valid token.
  mask    (B, T): 1 for response tokens, 0 for padding (left or right). Padded positions are
                  skipped (they neither add reward nor break the discounting) and come back as 0.
  values  (B, T): critic values, for gae only.
The n_samples responses of one prompt are contiguous rows: rows i*n .. i*n+n-1.

Every estimator first forms the discounted return-to-go G_t of the rewards. The group-based
ones take a sample's score to be G at its first valid token (with gamma=1 and no KL penalty:
the plain sequence score), compute a baseline per sample from its group's scores, and give
token t the advantage G_t - baseline (divided by the group std for group_norm). Without a KL
penalty every token of a response therefore gets the same advantage, as in GRPO/RLOO.
"""
import torch

from .losses import masked_mean

Tensor = torch.Tensor

ESTIMATORS = ("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo")
GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")
GROUP_STD_EPS = 1e-6


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma * G_(next valid token), over valid tokens: (B, T) -> (B, T)."""
    valid = mask.bool()
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * valid


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float):
    """GAE (Schulman et al. 2016): A_t = sum_l (gamma lam)^l delta_(t+l), delta_t = r_t + gamma V_(t+1) - V_t.

    The value after the last valid token is 0 (the response ended). Returns (advantages, returns),
    returns = A + V being the critic's targets; both (B, T), 0 at padding.
    """
    valid = mask.bool()
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    running_gae = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running_gae = torch.where(valid[:, t], delta + gamma * lam * running_gae, running_gae)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = running_gae
    return advantages * valid, (advantages + values) * valid


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid tokens of the whole batch (population std); 0 at padding."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


def group_baseline(estimator: str, scores: Tensor, n_samples: int):
    """Per-sample baseline and scale (B,) from the scores (B,) of each group of n_samples."""
    groups = scores.view(-1, n_samples)
    mean = groups.mean(-1, keepdim=True).expand_as(groups)
    scale = torch.ones_like(groups)
    if estimator == "rloo":
        # RLOO (Ahmadian et al. 2024): baseline = mean score of the other n-1 samples.
        baseline = (groups.sum(-1, keepdim=True) - groups) / (n_samples - 1)
    elif estimator == "group_norm":
        # GRPO (Shao et al. 2024): (score - group mean) / (group std + eps), unbiased std.
        baseline = mean
        scale = groups.std(-1, keepdim=True).expand_as(groups) + GROUP_STD_EPS
    else:
        # dr_grpo (Liu et al. 2025): no std division, which would reweight easy/hard prompts;
        # reinforce_baseline (Hu 2025, REINFORCE++-baseline): group mean, whitened afterwards.
        baseline = mean
    return baseline.reshape(-1), scale.reshape(-1)


@torch.no_grad()
def compute_advantages(estimator: str, rewards: Tensor, mask: Tensor, n_samples: int = 1,
                       values: Tensor | None = None, gamma: float = 1.0, lam: float = 0.95):
    """Returns (advantages (B, T), returns (B, T)); both 0 at padded positions.

    gae                : GAE advantages whitened over the batch; returns = GAE targets for the critic.
    reinforce          : REINFORCE++ (Hu 2025): return-to-go, whitened over the batch's valid tokens.
    reinforce_baseline : return-to-go minus the group mean score, then whitened over the batch.
    rloo               : return-to-go minus the mean score of the other n-1 samples of the group.
    group_norm         : GRPO, (return-to-go - group mean) / (group std + eps).
    dr_grpo            : return-to-go - group mean.
    For all but gae, returns = the discounted return-to-go G_t.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")
    rewards = rewards.float()
    valid = mask.bool()

    if estimator == "gae":
        if values is None:
            raise ValueError("estimator 'gae' needs critic values (B, T)")
        advantages, returns = gae(rewards, values.float(), valid, gamma, lam)
        return masked_whiten(advantages, valid), returns

    returns = discounted_returns(rewards, valid, gamma)
    if estimator == "reinforce":
        return masked_whiten(returns, valid), returns

    if n_samples < 2:
        raise ValueError(f"estimator {estimator!r} compares the n_samples responses of a prompt and "
                         f"needs n_samples >= 2, got {n_samples}")
    if rewards.shape[0] % n_samples:
        raise ValueError(f"batch of {rewards.shape[0]} rows is not a whole number of groups of {n_samples}")
    # Score = return from the first valid token (argmax picks the first 1 of the mask).
    first_valid = valid.int().argmax(-1, keepdim=True)
    scores = returns.gather(1, first_valid).squeeze(1)
    baseline, scale = group_baseline(estimator, scores, n_samples)
    advantages = (returns - baseline[:, None]) / scale[:, None] * valid
    if estimator == "reinforce_baseline":
        advantages = masked_whiten(advantages, valid)
    return advantages, returns
