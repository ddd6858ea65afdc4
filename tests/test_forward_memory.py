"""What keeps a forward's memory bounded on GPUs changes no number: forwards where nothing trains run
`forward_micro_batch_size` rows at a time with the same results, and the full-vocabulary entropy builds no autograd
graph unless `entropy_coef` trains on it."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification

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
    monkeypatch.setattr(rl_actors, "entropy_from_logits",
                        lambda logits, *args: seen.append(real(logits, *args)) or seen[-1])
    policy = PolicyWorker()
    policy.engine, policy.pad_id = LlamaForCausalLM(CONFIG), 0
    policy.cfg = stage_config(rl, {"rl": {"entropy_coef": entropy_coef}})
    loss, stats = policy.loss(rollout())
    loss.backward()
    assert seen[0].requires_grad is with_graph and torch.isfinite(stats["entropy"])


def test_forwards_that_generate_nothing_keep_no_kv_cache():
    """Every forward that does not generate runs with use_cache=False, whatever the model's config says (its
    use_cache: true is the default): a KV cache there is ~4 GB per forward at 8B that nothing reads and the memory
    plan does not count. The policy's log-probs and loss, the reference's log-probs, the critic's values and loss, the
    reward model's scores (RL, its own stage, evaluation) and evaluation's log-probs, each checked at the backbone's
    output."""
    from stages import evaluate, reward_model
    cached = []
    record = lambda module, args, kwargs, output: cached.append(output.past_key_values is not None)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         pad_token_id=0, num_labels=1)
    lm, value, scorer = LlamaForCausalLM(config).eval(), LlamaForTokenClassification(config).eval(), \
        LlamaForSequenceClassification(config).eval()
    assert config.use_cache
    for model in (lm, value, scorer):
        model.base_model.register_forward_hook(record, with_kwargs=True)
    policy, critic = PolicyWorker(), CriticWorker()
    policy.engine, critic.engine, policy.pad_id, critic.pad_id = lm, value, 0, 0
    policy.cfg = critic.cfg = stage_config(rl, {})
    policy.forward_micro_batch_size = critic.forward_micro_batch_size = None
    frozen = rl_actors.FrozenScorer()
    frozen.model, frozen.tokenizer, frozen.forward_micro_batch_size, frozen.temperature = lm, Tokenizer(), None, 1.0
    rows = rollout()
    rows.old_values = rows.returns = rows.advantages
    policy.logprobs(rows), policy.loss(rows), critic.values(rows), critic.loss(rows)
    frozen.logprobs(rows)
    frozen.model = scorer
    frozen.scores(rows)
    reward_model.score_pairs(scorer, Tokenizer(), [{"prompt": "ab", "chosen": "cd", "rejected": "e"}])
    evaluation = evaluate.Scorer(0, 1, "fp32")
    evaluation.model = evaluation.reference = lm
    evaluation.reward_model = scorer
    evaluation.sequence_logprobs([[5, 6]], [[7, 8]], with_reference=True)
    evaluation.reward_model_scores([[5, 6]], [[7, 8]])
    assert len(cached) == 9 and not any(cached), cached


class Tokenizer:
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 60 for c in text]}
