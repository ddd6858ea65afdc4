"""A rollout trained on once, in one optimizer step, needs no pass for the policy's old log-probs: the loss
without them equals the loss with old log-probs from a pass of the same weights."""
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from runtime.experience import Rollout, trains_once
from launcher.config import stage_config
from runtime.logprobs import response_logprobs
from runtime.rl_actors import PolicyWorker
from stages import rl


def rl_config(**changes) -> rl.Config:
    return stage_config(rl, {"rl": dict(ppo_epochs=1, rollout_batch_size=8, n_samples=4, batch_size=32,
                                        kl_in_reward=False) | changes})


@pytest.mark.parametrize("changes, once", [
    ({}, True),
    ({"batch_size": 16}, False),        # two optimizer steps per rollout: the second is off-policy
    ({"ppo_epochs": 2}, False),
    ({"kl_in_reward": True}, False),    # the reward's KL is computed before training, from the old log-probs
])
def test_trains_once(changes, once):
    assert trains_once(rl_config(**changes)) is once


def test_policy_loss_without_old_logprobs_equals_recomputed():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2))
    worker = PolicyWorker()
    worker.engine, worker.pad_id = model, 0
    worker.cfg = rl_config(clip_low=0.2, clip_high=0.2, dual_clip=None, loss_agg="token_mean", is_cap=2.0,
                           entropy_coef=0.0, kl_in_reward=False, kl_coef=0.1, kl_estimator="k3")
    response_ids = [[8, 9, 10, 11], [12, 13]]
    per_token = lambda value: [[value] * len(r) for r in response_ids]
    rows = Rollout.of([[5, 6, 7], [5, 6]], response_ids, advantages=[[1.0] * 4, [-1.0] * 2],
                      ref_logp=per_token(-4.0), rollout_logp=per_token(-4.1))
    with torch.no_grad():
        logp, mask = response_logprobs(model, rows.tokens(0))
    recomputed = dataclasses.replace(rows, old_logp=rows.from_batch(logp, mask))

    loss_without, stats_without = worker.loss(rows)
    loss_without.backward()
    grads_without = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_with, stats_with = worker.loss(recomputed)
    loss_with.backward()

    assert loss_without.item() == pytest.approx(loss_with.item(), abs=1e-6)
    as_floats = lambda stats: {key: float(value) for key, value in stats.items()}
    assert as_floats(stats_without) == pytest.approx(as_floats(stats_with), abs=1e-6)
    for a, p in zip(grads_without, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads_without), "the loss trains the policy"
