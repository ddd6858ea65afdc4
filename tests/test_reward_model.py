"""The reward model's optimizer gives the freshly initialised score head its own learning rate."""
import dataclasses

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from launcher.config import stage_config
from stages import reward_model
from stages.reward_model import RewardWorker


def test_score_head_gets_its_own_learning_rate():
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=2, num_labels=1))
    worker = RewardWorker()
    worker.cfg = stage_config(reward_model, {"reward_model": {"head_learning_rate": 1e-3}})
    body, head = worker.param_groups(model, 1e-5)
    assert [p is model.score.weight for p in head["params"]] == [True] and head["lr"] == 1e-3
    assert body["lr"] == 1e-5 and len(body["params"]) == len(list(model.parameters())) - 1
    # Without its own rate the head trains at the backbone's.
    worker.cfg = dataclasses.replace(worker.cfg, head_learning_rate=None)
    assert worker.param_groups(model, 1e-5)[1]["lr"] == 1e-5
    optimizer = torch.optim.AdamW(worker.param_groups(model, 1e-5))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
