"""Losses checked against numbers worked out by hand (plain Python floats and math)."""
import math

import pytest
import torch

from stages.evaluate import token_kl
from runtime.logprobs import entropy_from_logits, token_logprobs
from runtime.losses import (aggregate, cispo_policy_loss, dpo_loss, gspo_policy_loss, ipo_loss, kl_estimate, kto_loss,
                           masked_mean, overlong_penalty, pairwise_logexp_loss, pairwise_sigmoid_loss, policy_loss,
                           sequence_nll, simpo_loss, value_loss)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert torch.allclose(actual.float(), expected, atol=tol, rtol=0), f"{actual} != {expected}"


def softplus(x):  # log(1 + e^x) = -log sigma(-x)
    return math.log(1 + math.exp(x))


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# --- masked aggregation ------------------------------------------------------------------------

def test_masked_mean_ignores_padding():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), (1 + 2 + 4) / 3)
    close(masked_mean(x, mask, dim=-1), [1.5, 4.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # all padding: 0, not NaN


def test_aggregate_modes():
    loss = t([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])  # 99 = padding
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    close(aggregate(loss, mask, "token_mean"), (1 + 2 + 3 + 4) / 4)          # 2.5
    close(aggregate(loss, mask, "seq_mean_token_mean"), (6 / 3 + 4 / 1) / 2)  # 3.0
    close(aggregate(loss, mask, "seq_mean_token_sum"), (6 + 4) / 2)           # 5.0
    with pytest.raises(ValueError):
        aggregate(loss, mask, "sum")


# --- token statistics --------------------------------------------------------------------------

def test_token_logprobs():
    # position 0: uniform over 3 -> -log 3; position 1: probs (1, 2, 5)/8, label 2 -> log(5/8)
    logits = t([[[0.0, 0.0, 0.0], [0.0, math.log(2), math.log(5)]]])
    labels = torch.tensor([[1, 2]])
    out = token_logprobs(logits, labels)
    assert out.shape == (1, 2)
    close(out, [[-math.log(3), math.log(5 / 8)]])


def test_entropy_from_logits():
    # uniform over 2 -> log 2; probs (1/4, 3/4) -> -(1/4 log 1/4 + 3/4 log 3/4)
    logits = t([[[0.0, 0.0], [0.0, math.log(3)]]])
    close(entropy_from_logits(logits), [[math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])


def test_kl_estimators():
    logp, ref = t([-1.0, -2.0, -0.7]), t([-1.5, -1.0, -0.7])  # log r = 0.5, -1.0, 0.0
    close(kl_estimate(logp, ref, "k1"), [0.5, -1.0, 0.0])
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.5, 0.0])
    # k3 = e^{-log r} + log r - 1
    close(kl_estimate(logp, ref, "k3"), [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0, 0.0])
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_token_kl_exact_over_vocabulary():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3), by hand.
    logits = torch.tensor([[[0.0, 0.0], [1.0, -2.0]]])
    ref = torch.tensor([[[0.0, math.log(3.0)], [1.0, -2.0]]])
    kl = token_kl(logits, ref)
    assert kl.shape == (1, 2)
    assert kl[0, 0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    assert kl[0, 1].item() == pytest.approx(0.0, abs=1e-7)  # same distribution


# --- reward model ------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_fn", [pairwise_sigmoid_loss, pairwise_logexp_loss])
def test_pairwise_reward_losses(loss_fn):
    chosen, rejected = t([2.0, 0.5]), t([1.0, 1.5])  # gaps +1, -1
    # -log sigma(1) = log(1 + e^-1); -log sigma(-1) = log(1 + e)
    close(loss_fn(chosen, rejected), (softplus(-1) + softplus(1)) / 2)
    # margins 0.5 and 0: gaps become 0.5 and -1
    close(loss_fn(chosen, rejected, margin=t([0.5, 0.0])), (softplus(-0.5) + softplus(1)) / 2)
    close(loss_fn(t([3.0]), t([3.0])), math.log(2))


# --- preference --------------------------------------------------------------------------------

def test_dpo_equal_logps_is_log2():
    x = t([-5.0, -7.0])
    loss, chosen_r, rejected_r = dpo_loss(x, x, x, x, beta=0.1)
    close(loss, math.log(2))
    close(chosen_r, [0.0, 0.0])
    close(rejected_r, [0.0, 0.0])


def test_dpo_values_rewards_and_label_smoothing():
    # sample 0: chosen log-ratio -1 - (-2) = 1, rejected -3 - (-2) = -1, h = 2, beta h = 1
    # sample 1: chosen log-ratio 0, rejected log-ratio 2, h = -2, beta h = -1
    pc = t([-1.0, -4.0]).requires_grad_()
    pr, rc, rr = t([-3.0, -1.0]), t([-2.0, -4.0]), t([-2.0, -3.0])
    loss, chosen_r, rejected_r = dpo_loss(pc, pr, rc, rr, beta=0.5)
    close(loss, (softplus(-1) + softplus(1)) / 2)
    close(chosen_r, [0.5, 0.0])
    close(rejected_r, [-0.5, 1.0])
    assert not chosen_r.requires_grad and not rejected_r.requires_grad
    loss.backward()  # the loss itself does carry a gradient
    assert pc.grad is not None and pc.grad.abs().sum() > 0

    # cDPO, eps = 0.1: -(0.9) log sigma(beta h) - 0.1 log sigma(-beta h), per sample
    loss_ls, _, _ = dpo_loss(pc[:1], pr[:1], rc[:1], rr[:1], beta=0.5, label_smoothing=0.1)
    close(loss_ls, 0.9 * softplus(-1) + 0.1 * softplus(1))
    loss_ls, _, _ = dpo_loss(pc[1:], pr[1:], rc[1:], rr[1:], beta=0.5, label_smoothing=0.1)
    close(loss_ls, 0.9 * softplus(1) + 0.1 * softplus(-1))


def test_ipo():
    pc, pr, rc, rr = t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0])  # h = 2
    loss, chosen_r, rejected_r = ipo_loss(pc, pr, rc, rr, beta=0.5)  # target 1/(2*0.5) = 1
    close(loss, (2 - 1) ** 2)
    close(chosen_r, [0.5])
    close(rejected_r, [-0.5])
    loss, _, _ = ipo_loss(pc, pr, rc, rr, beta=0.1)  # target 5
    close(loss, (2 - 5) ** 2)


def test_simpo():
    # beta (avg_c - avg_r) - gamma = 2 * 0.5 - 0.5 = 0.5 ; second pair: 2 * (-1) - 0.5 = -2.5
    loss, chosen_r, rejected_r = simpo_loss(t([-0.5, -2.0]), t([-1.0, -1.0]), beta=2.0, gamma=0.5)
    close(loss, (softplus(-0.5) + softplus(2.5)) / 2)
    close(chosen_r, [-1.0, -4.0])
    close(rejected_r, [-2.0, -2.0])


def test_kto():
    policy, ref = t([-1.0, -2.0, -3.0]), t([-1.5, -1.5, -2.0])  # r = 0.5, -0.5, -1.0
    desirable = torch.tensor([True, True, False])
    loss, rewards = kto_loss(policy, ref, desirable, kl_ref_point=0.2, beta=1.0,
                             desirable_weight=1.0, undesirable_weight=2.0)
    expected = ((1 - sigmoid(0.5 - 0.2)) + (1 - sigmoid(-0.5 - 0.2)) + 2 * (1 - sigmoid(0.2 + 1.0))) / 3
    close(loss, expected)
    close(rewards, [0.5, -0.5, -1.0])

    # a negative KL estimate is clamped to 0, and the reference point gets no gradient
    kl = t(-0.3).requires_grad_()
    policy_g = policy.clone().requires_grad_()
    loss, rewards = kto_loss(policy_g, ref, desirable, kl_ref_point=kl, beta=2.0)
    close(loss, ((1 - sigmoid(2 * 0.5)) + (1 - sigmoid(2 * -0.5)) + (1 - sigmoid(2 * 1.0))) / 3)
    close(rewards, [1.0, -1.0, -2.0])
    loss.backward()
    assert kl.grad is None and policy_g.grad is not None and not rewards.requires_grad


def test_sequence_nll():
    close(sequence_nll(t([-4.0, -9.0]), torch.tensor([2, 3])), (4 / 2 + 9 / 3) / 2)


# --- policy loss -------------------------------------------------------------------------------
# Tokens (ratio r, advantage A) with clip_low 0.2, clip_high 0.28, i.e. r kept in [0.8, 1.28].
# loss = max(-A r, -A clamp(r)):
#   a r=1.0  A=+1   -> -1.0                    not clipped
#   b r=1.5  A=+1   -> max(-1.5, -1.28) = -1.28 clipped (above 1 + clip_high)
#   c r=1.25 A=+1   -> -1.25                   not clipped (would be with symmetric 0.2)
#   d r=0.5  A=-1   -> max(0.5, 0.8) = 0.8     clipped (below 1 - clip_low)
#   e r=0.5  A=+1   -> max(-0.5, -0.8) = -0.5  not clipped
#   f r=4.0  A=-0.5 -> max(2.0, 0.64) = 2.0    not clipped by PPO; dual clip c=3 caps it at 1.5
#   g r=4.0  A=+0.5 -> max(-2.0, -0.64) = -0.64 clipped; dual clip never touches A > 0
# row 0 = a b c <pad>, row 1 = d e f g; the pad has a wild ratio and advantage.
RATIOS = [[1.0, 1.5, 1.25, 50.0], [0.5, 0.5, 4.0, 4.0]]
ADVS = [[1.0, 1.0, 1.0, -100.0], [-1.0, 1.0, -0.5, 0.5]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]
ROW0 = [-1.0, -1.28, -1.25]
ROW1 = [0.8, -0.5, 2.0, -0.64]


def ppo_inputs():
    logp = t([[math.log(r) for r in row] for row in RATIOS])
    return logp, torch.zeros_like(logp), t(ADVS), t(MASK)


def test_policy_loss_asymmetric_clip_and_aggregations():
    logp, old, adv, mask = ppo_inputs()
    kw = dict(clip_low=0.2, clip_high=0.28)
    loss, clip_frac = policy_loss(logp, old, adv, mask, **kw)
    close(loss, (sum(ROW0) + sum(ROW1)) / 7)  # -1.87 / 7
    close(clip_frac, 3 / 7)                     # b, d, g
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq_mean_token_mean", **kw)
    close(loss, (sum(ROW0) / 3 + sum(ROW1) / 4) / 2)
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq_mean_token_sum", **kw)
    close(loss, (sum(ROW0) + sum(ROW1)) / 2)   # -0.935


def test_policy_loss_symmetric_clip():
    logp, old, adv, mask = ppo_inputs()
    loss, clip_frac = policy_loss(logp, old, adv, mask)  # [0.8, 1.2]: c becomes -1.2, g -0.6
    close(loss, (-1.0 - 1.2 - 1.2 + 0.8 - 0.5 + 2.0 - 0.6) / 7)
    close(clip_frac, 4 / 7)  # b, c, d, g


def test_policy_loss_dual_clip():
    logp, old, adv, mask = ppo_inputs()
    loss, clip_frac = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    close(loss, (sum(ROW0) + 0.8 - 0.5 + 1.5 - 0.64) / 7)  # f: 2.0 -> 3 * 0.5
    close(clip_frac, 4 / 7)                                  # b, d, f, g
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_policy_loss_importance_weight_and_gradients():
    logp, old, adv, mask = ppo_inputs()
    weight = t([[0.5, 1.0, 1.0, 9.0], [1.0, 1.0, 2.0, 1.0]]).requires_grad_()
    logp.requires_grad_()
    loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, is_weight=weight)
    close(loss, (-0.5 - 1.28 - 1.25 + 0.8 - 0.5 + 4.0 - 0.64) / 7)
    loss.backward()
    assert weight.grad is None  # the weight is a constant
    # clipped tokens (b, d, g) and the pad get no gradient; d(-A r)/d logp = -A r at the others
    close(logp.grad * 7, [[-0.5 * 1.0, 0.0, -1.25, 0.0], [0.0, -0.5, 2 * 0.5 * 4.0, 0.0]])


def test_policy_loss_padding_does_not_matter():
    logp, old, adv, mask = ppo_inputs()
    base, base_frac = policy_loss(logp, old, adv, mask)
    logp2, adv2 = logp.clone(), adv.clone()
    logp2[0, 3], adv2[0, 3] = -20.0, 1e4
    loss, frac = policy_loss(logp2, old, adv2, mask)
    close(loss, base)
    close(frac, base_frac)


# --- value loss --------------------------------------------------------------------------------

def test_value_loss():
    values = t([[1.0, 2.0, 1.2, 9.0]])
    old = t([[0.8, 1.0, 1.0, -9.0]])
    returns = t([[1.5, 1.0, 1.5, 100.0]])
    mask = t([[1, 1, 1, 0]])
    # no clip: squared errors 0.25, 1.0, 0.09
    close(value_loss(values, old, returns, mask), 0.5 * (0.25 + 1.0 + 0.09) / 3)
    # clip 0.1: V_clip = 0.9, 1.1, 1.1 -> errors 0.36, 0.01, 0.16; max with unclipped: 0.36, 1.0, 0.16
    close(value_loss(values, old, returns, mask, clip=0.1), 0.5 * (0.36 + 1.0 + 0.16) / 3)
    close(value_loss(values, old, returns, mask, clip=0.1, agg="seq_mean_token_sum"), 0.5 * (0.36 + 1.0 + 0.16))


def test_gspo_sequence_ratio_clip_and_gradient():
    """Hand-derived: tokens with log-ratios 0.1 and 0.3 give the sequence ratio s = exp(0.2) = 1.2214 (their mean,
    length-normalised); at clip_high 0.1 a positive advantage is clipped (loss -1.1, no gradient), a negative one is
    not (loss 1.2214, each token's gradient s / 2: the sequence's ratio spread over its 2 tokens)."""
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    logp = (old + torch.tensor([[0.1, 0.3], [0.1, 0.3]])).requires_grad_()
    mask = torch.ones(2, 2)
    for advantage, value, grad, clipped in ((1.0, -1.1, 0.0, 1.0), (-1.0, math.exp(0.2), math.exp(0.2) / 2, 0.0)):
        logp.grad = None
        loss, clip_fraction = gspo_policy_loss(logp, old, torch.full((2, 2), advantage), mask, 0.1, 0.1)
        loss.backward()
        assert loss.item() == pytest.approx(value, abs=1e-6) and clip_fraction.item() == clipped
        assert logp.grad[0].tolist() == pytest.approx([grad / 2, grad / 2], abs=1e-6)  # mean over the 2 sequences
    # Padding changes nothing: a third token masked out, whatever its log-ratio.
    padded_logp = torch.cat([logp.detach(), torch.full((2, 1), 5.0)], 1)
    padded = gspo_policy_loss(padded_logp, torch.cat([old, torch.zeros(2, 1)], 1), torch.full((2, 3), -1.0),
                              torch.tensor([[1.0, 1, 0], [1, 1, 0]]), 0.1, 0.1)[0]
    assert padded.item() == pytest.approx(math.exp(0.2), abs=1e-6)


def test_cispo_clips_the_weight_never_the_token():
    """Hand-derived: ratio 2 (logp = log 0.5, old = log 0.25) at clip_high 0.28: weight 1.28 (detached), loss
    -1.28 * A * log 0.5 = 0.8873 for A = 1, gradient -1.28 * A: the token keeps its gradient where PPO's clip drops it."""
    old = torch.log(torch.tensor([[0.25, 0.5]]))
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    advantages, mask = torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    loss, clip_fraction = cispo_policy_loss(logp, old, advantages, mask, 0.2, 0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.28 * math.log(0.5), abs=1e-6) and clip_fraction.item() == 1.0
    assert logp.grad[0].tolist() == pytest.approx([-1.28, 0.0], abs=1e-6)
    ppo = logp.detach().clone().requires_grad_()
    policy_loss(ppo, old, advantages, mask, 0.2, 0.28)[0].backward()
    assert ppo.grad.tolist() == [[0.0, 0.0]]  # PPO: the clipped token's gradient is gone
    # In range, CISPO's gradient is PPO's unclipped one, -A * ratio: ratio exp(0.1) at A = -2.
    inside = (old + 0.1).requires_grad_()
    cispo_policy_loss(inside, old, torch.full((1, 2), -2.0), torch.ones(1, 2), 0.2, 0.28)[0].backward()
    assert inside.grad[0].tolist() == pytest.approx([math.exp(0.1)] * 2, abs=1e-6)  # -A * ratio / 2 tokens


def test_overlong_penalty():
    """DAPO eq. 13 with max_tokens 10 and a buffer of 4: 0 up to 6 tokens, then -1/4 per token, -1 at 10."""
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
