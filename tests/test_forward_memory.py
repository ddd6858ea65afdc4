"""What keeps a forward's memory bounded on GPUs changes no number: forwards where nothing trains run
`forward_micro_batch_size` rows at a time with the same results, and the full-vocabulary entropy builds no autograd
graph unless `entropy_coef` trains on it."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from launcher.config import stage_config
from runtime import rl_actors
from runtime.rl_actors import CriticWorker, PolicyWorker
from stage_helpers import rollout
from stages import rl

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


@pytest.mark.parametrize("size", [1, 3])
def test_micro_batched_forwards_equal_one_forward(size):
    torch.manual_seed(0)
    policy, critic = PolicyWorker(), CriticWorker()
    policy.engine, critic.engine = LlamaForCausalLM(CONFIG).eval(), LlamaForTokenClassification(CONFIG).eval()
    policy.pad_id = critic.pad_id = 0
    policy.cfg = stage_config(rl, {})
    policy.forward_micro_batch_size = critic.forward_micro_batch_size = None
    whole = policy.logprobs(rollout()), critic.values(rollout())
    policy.forward_micro_batch_size = critic.forward_micro_batch_size = size
    pieces = policy.logprobs(rollout()), critic.values(rollout())
    for a, b in zip(whole, pieces):
        assert a.shape == b.shape == rollout().mask.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(a == 0, b == 0)  # padding stays exactly 0


@pytest.mark.parametrize("entropy_coef, with_graph", [(0.0, False), (0.01, True)])
def test_entropy_builds_a_graph_only_when_trained_on(monkeypatch, entropy_coef, with_graph):
    seen = []
    real = rl_actors.entropy_from_logits
    monkeypatch.setattr(rl_actors, "entropy_from_logits", lambda logits: seen.append(real(logits)) or seen[-1])
    policy = PolicyWorker()
    policy.engine, policy.pad_id = LlamaForCausalLM(CONFIG), 0
    policy.cfg = stage_config(rl, {"rl": {"entropy_coef": entropy_coef}})
    loss, stats = policy.loss(rollout())
    loss.backward()
    assert seen[0].requires_grad is with_graph and torch.isfinite(stats["entropy"])
