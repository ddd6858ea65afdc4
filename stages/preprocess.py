"""Stage `preprocess`: movie reviews -> prompt/response rows with the chat template applied.

Task: continue a movie review from its opening. SFT rows pair the opening of a positive review (prompt) with
its true continuation (response); evaluation prompts are openings of held-out reviews of both labels, so a
model only scores well if it steers even a negative opening toward a positive review. Preference pairs
continue one opening with the text of a positive review (chosen) and of a negative one (rejected), each cut
from a review whose text there reads clearly positive or negative (`pair_min_sentiment`: the middle of a
review is often neutral, and a pair of two neutral snippets teaches nothing), unless the config names the
user's own preference files. Keys follow OpenRLHF's conventions (prompt, response, label,
chosen, rejected).

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/preprocess
"""
import dataclasses
import json
import random
import statistics
from pathlib import Path

from runtime import data, models, rewards

USES_RAY = False


@dataclasses.dataclass
class Config:
    source: str
    prompt_words: int
    max_prompt_tokens: int
    max_response_tokens: int
    num_train: int
    num_eval: int
    instruction: str
    system_prompt: str | None
    num_pairs_train: int
    num_pairs_eval: int
    pair_min_sentiment: float
    num_rl_prompts: int
    preference_train_file: str | None
    preference_eval_file: str | None
    seed: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["data"], seed=params["seed"])


def cut_response(text: str, cfg: Config, tokenizer, stats: dict) -> str:
    """`text` cut at max_response_tokens; a response that ends on its own gets the EOS token."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stats["response_tokens"].append(min(len(ids), cfg.max_response_tokens))
    if len(ids) > cfg.max_response_tokens:
        stats["truncated_response"] += 1
        return tokenizer.decode(ids[:cfg.max_response_tokens])
    return text + tokenizer.eos_token


def keep_prompt(prompt: str, cfg: Config, tokenizer, stats: dict) -> bool:
    tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if tokens > cfg.max_prompt_tokens:
        stats["dropped_long_prompt"] += 1
        return False
    stats["prompt_tokens"].append(tokens)
    return True


def split_review(review: dict, cfg: Config, stats: dict) -> tuple[str, str] | None:
    """(opening, continuation) of a review, or None when it is too short to continue."""
    words = review["text"].split()
    if len(words) < cfg.prompt_words + 3:
        stats["dropped_short"] += 1
        return None
    return " ".join(words[:cfg.prompt_words]), " " + " ".join(words[cfg.prompt_words:])


def task_prompt(opening: str, cfg: Config, tokenizer) -> str:
    chat = [{"role": "user", "content": cfg.instruction}]
    if cfg.system_prompt is not None:  # otherwise the template's own (SmolLM2's default is 20 tokens long)
        chat.insert(0, {"role": "system", "content": cfg.system_prompt})
    # The assistant turn starts with the opening, so the model's job is to continue it.
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + opening


def make_row(review: dict, cfg: Config, tokenizer, stats: dict) -> dict | None:
    """One prompt/response row, or None when the review is too short or the prompt too long."""
    parts = split_review(review, cfg, stats)
    if parts is None:
        return None
    opening, continuation = parts
    prompt = task_prompt(opening, cfg, tokenizer)
    if not keep_prompt(prompt, cfg, tokenizer, stats):
        return None
    return {"prompt": prompt, "response": cut_response(continuation, cfg, tokenizer, stats),
            "label": review["label"], "opening": opening}


def make_pairs(reviews: list[dict], count: int, cfg: Config, tokenizer, stats: dict, rng: random.Random) -> list[dict]:
    """Openings continued by a positive review's text (chosen) and a negative review's (rejected), keeping
    only continuations whose sentiment agrees with their review's label by at least cfg.pair_min_sentiment.
    Each text is used once while the pool lasts (a reward model learns to recognise repeated texts, not their
    sentiment), then the pool is reused evenly."""
    split = [(r["label"], split_review(r, cfg, stats)) for r in reviews]
    openings = [p[0] for _, p in split if p]
    continuations = [(label, p[1]) for label, p in split if p]
    # Judged as the model will see them: cut to max_response_tokens (the stats count only the texts used).
    unused_stats = {"response_tokens": [], "truncated_response": 0}
    polarity = rewards.sentiment([cut_response(text, cfg, tokenizer, unused_stats) for _, text in continuations])
    threshold = cfg.pair_min_sentiment
    positives = [text for (label, text), s in zip(continuations, polarity) if label == 1 and s >= threshold]
    negatives = [text for (label, text), s in zip(continuations, polarity) if label == 0 and s <= -threshold]
    rng.shuffle(positives)
    rng.shuffle(negatives)
    pairs = []
    for opening in openings:
        if len(pairs) == count or not (positives and negatives):
            break
        prompt = task_prompt(opening, cfg, tokenizer)
        if keep_prompt(prompt, cfg, tokenizer, stats):
            i = len(pairs)
            pairs.append({"prompt": prompt,
                          "chosen": cut_response(positives[i % len(positives)], cfg, tokenizer, stats),
                          "rejected": cut_response(negatives[i % len(negatives)], cfg, tokenizer, stats)})
    if len(pairs) < count:
        raise ValueError(f"data.source {cfg.source!r} yields only {len(pairs)} usable pairs, fewer than the "
                         f"{count} asked for (data.num_pairs_train / data.num_pairs_eval); lower them or "
                         f"data.pair_min_sentiment ({threshold})")
    return pairs


def user_pairs(path: str, cfg: Config, tokenizer, stats: dict) -> list[dict]:
    """A user's preference file as prompt/chosen/rejected text: chat message lists go through the chat
    template; without a prompt, the conversation before the last message of `chosen` is the prompt."""
    pairs = []
    for row in data.read_preference_file(path):
        def last_text(value):
            return value if isinstance(value, str) else value[-1]["content"]
        if "prompt" in row:
            messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        else:
            messages = [] if isinstance(row["chosen"], str) else row["chosen"][:-1]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) if messages else ""
        if prompt and not keep_prompt(prompt, cfg, tokenizer, stats):
            continue
        pair = {"prompt": prompt, "chosen": cut_response(last_text(row["chosen"]), cfg, tokenizer, stats),
                "rejected": cut_response(last_text(row["rejected"]), cfg, tokenizer, stats)}
        if "margin" in row:
            pair["margin"] = row["margin"]
        pairs.append(pair)
    return pairs


def take(reviews, count, cfg, tokenizer, stats) -> list[dict]:
    rows = []
    for review in reviews:
        if len(rows) == count:
            break
        row = make_row(review, cfg, tokenizer, stats)
        if row is not None:
            rows.append(row)
    if len(rows) < count:
        raise ValueError(f"data.source {cfg.source!r} yields only {len(rows)} usable rows, fewer than the "
                         f"{count} asked for (data.num_train / data.num_eval); lower them or data.prompt_words")
    return rows


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    tokenizer = models.load_tokenizer(inputs["model"])
    reviews = data.load_reviews(cfg.source)
    random.Random(cfg.seed).shuffle(reviews)
    held_out, train_pool = reviews[:len(reviews) // 5], reviews[len(reviews) // 5:]
    stats = {"dropped_short": 0, "dropped_long_prompt": 0, "truncated_response": 0,
             "prompt_tokens": [], "response_tokens": []}
    positives = [r for r in train_pool if r["label"] == 1]
    splits = {
        "sft_train": take(positives, cfg.num_train, cfg, tokenizer, stats),
        "sft_eval": take([r for r in held_out if r["label"] == 1], cfg.num_eval, cfg, tokenizer, stats),
        "prompts_eval": take(held_out[len(held_out) // 2:], cfg.num_eval, cfg, tokenizer, stats),
        # RL prompts: openings of training reviews of both labels (their continuations are not used).
        "prompts_train": take(train_pool[:len(train_pool) // 2], cfg.num_rl_prompts, cfg, tokenizer, stats),
    }
    if cfg.preference_train_file:
        splits["pairs_train"] = user_pairs(cfg.preference_train_file, cfg, tokenizer, stats)
        splits["pairs_eval"] = user_pairs(cfg.preference_eval_file, cfg, tokenizer, stats)
    else:
        pair_rng = random.Random(cfg.seed + 1)
        # The half of the training reviews that the RL prompts do not come from.
        splits["pairs_train"] = make_pairs(train_pool[len(train_pool) // 2:], cfg.num_pairs_train, cfg,
                                           tokenizer, stats, pair_rng)
        splits["pairs_eval"] = make_pairs(held_out[:len(held_out) // 2], cfg.num_pairs_eval, cfg, tokenizer, stats,
                                          pair_rng)
    for name, rows in splits.items():
        data.write_jsonl(output / f"{name}.jsonl", [{"id": i, **row} for i, row in enumerate(rows)])
    summary = {f"rows_{name}": len(rows) for name, rows in splits.items()}
    summary |= {k: stats[k] for k in ("dropped_short", "dropped_long_prompt", "truncated_response")}
    for key in ("prompt_tokens", "response_tokens"):
        summary[f"{key}_mean"] = statistics.fmean(stats[key])
        summary[f"{key}_max"] = max(stats[key])
    summary["prompts_eval_positive_fraction"] = statistics.fmean(r["label"] for r in splits["prompts_eval"])
    (output / "stats.json").write_text(json.dumps(summary, indent=2))
    tracker.log_metrics(summary)
    tracker.log_artifact(output / "stats.json")
    print("[preprocess] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in summary.items()), flush=True)
