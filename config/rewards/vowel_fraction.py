"""A verifiable reward for the tiny test model: the fraction of letters in the completion that are vowels.

Any file like this works as `rl.reward: path/to/file.py`: it defines
reward_fn(prompts, completions, labels) -> one float per completion.
It is smooth and learnable by a tiny random model in a few steps, which is all the tests need.
"""


def reward_fn(prompts: list[str], completions: list[str], labels: list) -> list[float]:
    scores = []
    for text in completions:
        letters = [c for c in text.lower() if c.isalpha()]
        scores.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return scores
