"""Guess the number: a multi-turn game that ignores the dataset's prompt text. config/agent-guess.yaml trains on it:
    .venv/bin/snakemake --profile cluster_profiles/local all --configfile config/agent-guess.yaml

The secret is drawn in 1..100 from the episode's seed, which the n episodes of a prompt group share: they play the
same game, so GRPO compares their play. The protocol, as the first user message (RULES) tells the model:
    a number (the reply's first integer)  -> "Higher." or "Lower.", reward 0; right: reward 1.0, the episode ends
    no number                             -> "Say a number between 1 and 100."
Binary search wins within 7 guesses (2^7 > 100), the experiment's max_turns.
"""
import random
import re

RULES = ("I am thinking of a number between 1 and 100. Guess it: reply with a number, and I will say whether the "
         "secret is higher or lower.")
NUMBER = re.compile(r"-?\d+")


class Environment:
    def reset(self, prompt: str, label, seed: int):
        self.secret = random.Random(seed).randint(1, 100)
        return RULES

    def step(self, reply):
        found = NUMBER.search(reply.text)
        if found is None:
            return "Say a number between 1 and 100.", 0.0, False
        guess = int(found.group())
        if guess == self.secret:
            return [], 1.0, True, {"success": True}
        return "Higher." if guess < self.secret else "Lower.", 0.0, False
