"""A verifiable reward: 1 when the completion's first number equals the label (the answer), else 0.

For builtin:arithmetic (config/arithmetic.yaml) or any dataset whose prompts carry their answer as `label_key`.
"""
import re

NUMBER = re.compile(r"-?\d+")


def reward_fn(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    scores = []
    for completion, label in zip(completions, labels):
        found = NUMBER.search(completion)
        scores.append(float(found is not None and label is not None and found.group() == str(label).strip()))
    return scores
