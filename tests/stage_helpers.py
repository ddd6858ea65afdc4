"""What tests that drive a stage's workers without its job share: a stand-in tracker, a small rollout, a tiny model."""


class Tracker:
    """Stands in for a stage's MLflow run (runtime/tracking.py, StageRun): no checkpoints, nothing logged."""
    checkpoint_dir = None

    def __init__(self):
        self.placements: list[dict] = []

    def record_placements(self, placements: list[dict]) -> None:
        self.placements.extend(placements)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        pass

    def set_tags(self, tags: dict) -> None:
        pass


def rollout():
    """Four rows of unequal prompt and response lengths, with advantages and reference and vLLM log-probs."""
    from runtime.experience import Rollout
    prompts = [[5, 6, 7], [5, 6], [9, 10, 11, 12], [4]]
    responses = [[8, 9, 10, 11], [12, 13], [14], [15, 16, 17]]
    per_token = lambda value: [[value] * len(r) for r in responses]
    return Rollout.of(prompts, responses, advantages=per_token(1.0), ref_logp=per_token(-4.0),
                      rollout_logp=per_token(-4.1))


def tiny_reviews_model(out_dir) -> list[list[str]]:
    """A tiny random Llama in `out_dir` with a tokenizer trained on movie reviews; the words of the reviews of 12 or
    more words, to make rows of unequal lengths from."""
    from runtime import models
    from runtime.builtin_data import load_reviews
    texts = [r["text"] for r in load_reviews("rotten_tomatoes")[:300]]
    models.build_tiny(out_dir, {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 400}, 0, texts)
    return [t.split() for t in texts if len(t.split()) >= 12]
