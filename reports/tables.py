"""Tables of evaluation metrics, one row per model."""

COLUMNS = [  # (metrics.json key, column header, format)
    ("reward_mean", "reward (sentiment) ↑", "{:.3f}"),
    ("positive_fraction", "positive ↑", "{:.2f}"),
    ("kl_to_reference", "KL to base", "{:.2f}"),
    ("perplexity", "perplexity ↓", "{:.2f}"),
    ("response_length", "length (tokens)", "{:.1f}"),
]


def markdown_table(rows: list[dict]) -> str:
    """rows: metrics.json contents, each with a "model" key, in display order."""
    header = "| model | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(COLUMNS)
    body = ["| " + row["model"] + " | " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |"
            for row in rows]
    return "\n".join([header, rule, *body])


def rl_table(runs: list[dict]) -> str:
    """runs: the rl stage's metrics.json contents, one per variant."""
    lines = ["| RL run | estimator | steps | held-out RL reward: SFT → trained | KL to SFT (last step) |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['estimator']} | {r['steps']} | {r['eval_reward_before']:.3f} → "
              f"{r['eval_reward']:.3f} | {r['final_kl']:.3f} |" for r in runs]
    return "\n".join(lines)
