"""Advantage estimators checked against numbers worked out by hand (plain Python floats and math)."""
import math

import pytest
import torch

from runtime.advantages import compute_advantages, discounted_returns, gae

GROUP_ESTIMATORS = ["reinforce_baseline", "rloo", "group_norm", "dr_grpo"]


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert torch.allclose(actual.float(), expected, atol=tol, rtol=0), f"{actual} != {expected}"


def whiten(xs):  # population mean/std of a plain list
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return [(x - mean) / std for x in xs]


def outcome_rewards(scores, lengths, T):
    """Rows with the score on the last valid token and junk (7.0) in the padding."""
    rewards = [[0.0] * (n - 1) + [s] + [7.0] * (T - n) for s, n in zip(scores, lengths)]
    mask = [[1] * n + [0] * (T - n) for n in lengths]
    return t(rewards), t(mask)


# --- GAE ---------------------------------------------------------------------------------------
# rewards (0, 0, 1), values (0.5, 0.6, 0.7), gamma 0.9, lam 0.8 (gamma lam = 0.72):
#   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                 A = 0.3
#   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03               A = 0.03 + 0.72*0.3 = 0.246
#   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04               A = 0.04 + 0.72*0.246 = 0.21712
#   returns = A + V = 0.71712, 0.846, 1.0
GAE_ADV = [0.21712, 0.246, 0.3]
GAE_RET = [0.71712, 0.846, 1.0]


def test_gae_three_tokens():
    rewards, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [GAE_ADV])
    close(ret, [GAE_RET])
    # compute_advantages whitens the advantages over the batch, returns stay the critic's targets
    adv, ret = compute_advantages("gae", rewards, mask, n_samples=1, values=values, gamma=0.9, lam=0.8)
    close(adv, [whiten(GAE_ADV)])
    close(ret, [GAE_RET])


def test_gae_lambda_one_is_return_minus_value():
    rewards, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_padding_left_and_right():
    # same episode right-padded and left-padded, junk reward/value in the padding
    rewards = t([[0.0, 0.0, 1.0, 5.0], [3.0, 0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7, 9.0], [-4.0, 0.5, 0.6, 0.7]])
    mask = t([[1, 1, 1, 0], [0, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [GAE_ADV + [0.0], [0.0] + GAE_ADV])
    close(ret, [GAE_RET + [0.0], [0.0] + GAE_RET])
    adv, _ = compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    w = whiten(GAE_ADV + GAE_ADV)
    close(adv, [w[:3] + [0.0], [0.0] + w[3:]])


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", t([[1.0]]), t([[1]]))


# --- REINFORCE++ -------------------------------------------------------------------------------

def test_discounted_returns():
    rewards, mask = t([[0.0, 0.0, 1.0], [0.0, -1.0, 5.0]]), t([[1, 1, 1], [1, 1, 0]])
    close(discounted_returns(rewards, mask, gamma=1.0), [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    close(discounted_returns(rewards, mask, gamma=0.5), [[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]])
    # per-token KL penalty of 0.1 already subtracted: return-to-go 0.7, 0.8, 0.9
    close(discounted_returns(t([[-0.1, -0.1, 0.9]]), t([[1, 1, 1]])), [[0.7, 0.8, 0.9]])


def test_reinforce_whitens_over_valid_tokens():
    rewards, mask = t([[0.0, 0.0, 1.0], [0.0, -1.0, 5.0]]), t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages("reinforce", rewards, mask, n_samples=1)
    # valid returns 1, 1, 1, -1, -1: mean 0.2, variance (3*0.64 + 2*1.44)/5 = 0.96
    hi, lo = 0.8 / math.sqrt(0.96), -1.2 / math.sqrt(0.96)
    close(adv, [[hi, hi, hi], [lo, lo, 0.0]], tol=1e-4)
    close(ret, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])


def test_reinforce_baseline():
    # groups of 2: scores (1, 0) and (2, 2); row 1 has a single token
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 2.0], [2, 1, 2, 2], T=2)
    adv, ret = compute_advantages("reinforce_baseline", rewards, mask, n_samples=2)
    # minus group mean: 0.5, 0.5 | -0.5 | 0, 0 | 0, 0  -> whitened over these 7 tokens
    w = whiten([0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    close(adv, [w[0:2], [w[2], 0.0], w[3:5], w[5:7]], tol=1e-4)
    close(ret, [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0], [2.0, 2.0]])


# --- group estimators --------------------------------------------------------------------------

def per_token(row_values, lengths, T):
    return [[v] * n + [0.0] * (T - n) for v, n in zip(row_values, lengths)]


def test_rloo():
    # group (1, 0, 2): baselines (0+2)/2 = 1, (1+2)/2 = 1.5, (1+0)/2 = 0.5 -> 0, -1.5, 1.5
    # group (1, 1, 1): all 0
    lengths = [3, 1, 2, 3, 2, 1]
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 1.0, 1.0, 1.0], lengths, T=3)
    adv, ret = compute_advantages("rloo", rewards, mask, n_samples=3)
    close(adv, per_token([0.0, -1.5, 1.5, 0.0, 0.0, 0.0], lengths, T=3))
    close(ret, per_token([1.0, 0.0, 2.0, 1.0, 1.0, 1.0], lengths, T=3))
    # group of 4 (1, 0, 0, 3): baselines 1, 4/3, 4/3, 1/3
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 3.0], [2, 2, 2, 2], T=2)
    adv, _ = compute_advantages("rloo", rewards, mask, n_samples=4)
    close(adv, per_token([0.0, -4 / 3, -4 / 3, 8 / 3], [2] * 4, T=2))


def test_group_norm_grpo():
    # (1, 0, 2): mean 1, unbiased std sqrt((0 + 1 + 1)/2) = 1 ; (1, 1, 1): std 0 -> advantages 0, no NaN
    lengths = [3, 1, 2, 3, 2, 1]
    rewards, mask = outcome_rewards([1.0, 0.0, 2.0, 1.0, 1.0, 1.0], lengths, T=3)
    adv, _ = compute_advantages("group_norm", rewards, mask, n_samples=3)
    close(adv, per_token([0.0, -1.0, 1.0, 0.0, 0.0, 0.0], lengths, T=3))
    # (1, 0, 0, 3): mean 1, unbiased variance (0 + 1 + 1 + 4)/3 = 2
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 3.0], [2, 2, 2, 2], T=2)
    adv, _ = compute_advantages("group_norm", rewards, mask, n_samples=4)
    s = math.sqrt(2)
    close(adv, per_token([0.0, -1 / s, -1 / s, 2 / s], [2] * 4, T=2))


def test_dr_grpo():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 3.0], [2, 1, 2, 1], T=2)
    adv, _ = compute_advantages("dr_grpo", rewards, mask, n_samples=4)
    close(adv, per_token([0.0, -1.0, -1.0, 2.0], [2, 1, 2, 1], T=2))
    # the same group left-padded (junk 7.0 in the padding) gives the same advantages
    adv, _ = compute_advantages("dr_grpo", t([[0.0, 1.0], [7.0, 0.0], [0.0, 0.0], [7.0, 3.0]]),
                                t([[1, 1], [0, 1], [1, 1], [0, 1]]), n_samples=4)
    close(adv, [[0.0, 0.0], [0.0, -1.0], [-1.0, -1.0], [0.0, 2.0]])


def test_group_baseline_with_kl_shaped_rewards():
    # row 0: score 1 with a KL penalty of 0.1 per token -> rewards (-0.1, 0.9), G = (0.8, 0.9)
    # row 1: score 0, no penalty -> G = (0, 0). Group mean of the scores G_0: 0.4
    adv, ret = compute_advantages("dr_grpo", t([[-0.1, 0.9], [0.0, 0.0]]), t([[1, 1], [1, 1]]), n_samples=2)
    close(adv, [[0.4, 0.5], [-0.4, -0.4]])
    close(ret, [[0.8, 0.9], [0.0, 0.0]])


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_need_two_samples(estimator):
    rewards, mask = outcome_rewards([1.0, 0.0], [2, 2], T=2)
    with pytest.raises(ValueError, match="n_samples >= 2"):
        compute_advantages(estimator, rewards, mask, n_samples=1)
    with pytest.raises(ValueError, match="groups"):
        compute_advantages(estimator, rewards, mask, n_samples=3)  # 2 rows, groups of 3


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown"):
        compute_advantages("ppo", t([[1.0]]), t([[1]]))
