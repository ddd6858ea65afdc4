"""Stage `base_model`: materialise the experiment's base model as a plain Hugging Face directory.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/base_model
"""
import dataclasses
from pathlib import Path

from runtime import data, models

USES_RAY = False
TOKENIZER_CORPUS = ("rotten_tomatoes", 4000)  # fixed, so the tiny tokenizer does not depend on data.* keys


@dataclasses.dataclass
class Config:
    source: str
    tiny: dict
    trust_remote_code: bool
    seed: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["model"], seed=params["seed"])


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    print(f"[base_model] building {cfg.source}", flush=True)
    if cfg.source == "smollm2-135m-instruct":
        models.build_smollm2(output)
    else:
        source, count = TOKENIZER_CORPUS
        texts = [r["text"] for r in data.load_reviews(source)[:count]]
        models.build_tiny(output, cfg.tiny, cfg.seed, texts)
    model = models.load_causal_lm(output)
    parameters = sum(p.numel() for p in model.parameters())
    tracker.log_metrics({"parameters": parameters})
    print(f"[base_model] {cfg.source}: {parameters / 1e6:.1f}M parameters -> {output}", flush=True)
