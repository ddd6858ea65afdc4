"""Positive sentiment of the completion (VADER compound in [-1, 1]) as a verifiable RL reward.

Use it with `rl.reward: config/rewards/sentiment.py` to run RL without the reward-model stage.
"""
from runtime.rewards import sentiment


def reward_fn(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    return sentiment(completions)
