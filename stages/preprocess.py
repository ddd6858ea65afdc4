"""Stage `preprocess`: movie reviews -> prompt/response rows with the chat template applied.

Task: continue a movie review from its opening. SFT rows pair the opening of a positive review (prompt) with
its true continuation (response); evaluation prompts are openings of held-out reviews of both labels, so a
model only scores well if it steers even a negative opening toward a positive review. Keys follow OpenRLHF's
conventions (prompt, response, label).

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/preprocess
"""
import dataclasses
import json
import random
import statistics
from pathlib import Path

from stages import data, models

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
    seed: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["data"], seed=params["seed"])


def make_row(review: dict, cfg: Config, tokenizer, stats: dict) -> dict | None:
    """One prompt/response row, or None when the review is too short or the prompt too long."""
    words = review["text"].split()
    if len(words) < cfg.prompt_words + 3:
        stats["dropped_short"] += 1
        return None
    opening = " ".join(words[:cfg.prompt_words])
    chat = [{"role": "user", "content": cfg.instruction}]
    # The assistant turn starts with the opening, so the model's job is to continue it.
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + opening
    prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if prompt_tokens > cfg.max_prompt_tokens:
        stats["dropped_long_prompt"] += 1
        return None
    continuation = tokenizer(" " + " ".join(words[cfg.prompt_words:]), add_special_tokens=False)["input_ids"]
    if len(continuation) > cfg.max_response_tokens:
        stats["truncated_response"] += 1
        response = tokenizer.decode(continuation[:cfg.max_response_tokens])
    else:
        response = tokenizer.decode(continuation) + tokenizer.eos_token
    stats["prompt_tokens"].append(prompt_tokens)
    stats["response_tokens"].append(min(len(continuation), cfg.max_response_tokens))
    return {"prompt": prompt, "response": response, "label": review["label"], "opening": opening}


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


def run(cfg: Config, inputs: dict, output: Path, run) -> None:
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
    }
    for name, rows in splits.items():
        data.write_jsonl(output / f"{name}.jsonl", rows)
    summary = {f"rows_{name}": len(rows) for name, rows in splits.items()}
    summary |= {k: stats[k] for k in ("dropped_short", "dropped_long_prompt", "truncated_response")}
    for key in ("prompt_tokens", "response_tokens"):
        summary[f"{key}_mean"] = statistics.fmean(stats[key])
        summary[f"{key}_max"] = max(stats[key])
    summary["prompts_eval_positive_fraction"] = statistics.fmean(r["label"] for r in splits["prompts_eval"])
    (output / "stats.json").write_text(json.dumps(summary, indent=2))
    run.log_metrics(summary)
    run.log_artifact(output / "stats.json")
    print("[preprocess] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in summary.items()), flush=True)
