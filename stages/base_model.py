"""Stage `base_model`: the experiment's base model as a plain Hugging Face directory.

`model.path`: your own model directory, linked (weights) and copied (config, tokenizer) into the output; a hub id
likewise from its snapshot in the Hugging Face cache (downloaded into it where launcher.hub_downloads allows; the
jobs run offline otherwise), so its weights stay in the cache, which every node must see. Otherwise a built-in
model: SmolLM2-135M-Instruct from its package, or a tiny random model built from `model.tiny`. The directory records
`model.trust_remote_code` for every later loader.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/base_model
"""
import dataclasses
from pathlib import Path

from runtime import models
from runtime.builtin_data import load_reviews
from runtime.user_data import repo_path

USES_RAY = False
TOKENIZER_CORPUS = ("rotten_tomatoes", 4000)  # fixed, so the tiny tokenizer does not depend on data.* keys


@dataclasses.dataclass
class Config:
    path: str | None
    source: str
    tiny: dict
    trust_remote_code: bool
    seed: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**params["model"], seed=params["seed"])


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    name = cfg.path or cfg.source
    print(f"[base_model] {name}", flush=True)
    if cfg.path and repo_path(cfg.path).exists():
        models.link_model(repo_path(cfg.path), output)
    elif cfg.path:
        from huggingface_hub import snapshot_download
        # (not into local_dir=output: offline, snapshot_download would look for the model there, not in the cache)
        snapshot = snapshot_download(cfg.path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                               "*.jinja", *(["*.py"] * cfg.trust_remote_code)])
        models.link_model(Path(snapshot), output)
    elif cfg.source == "smollm2-135m-instruct":
        models.build_smollm2(output)
    else:
        source, count = TOKENIZER_CORPUS
        models.build_tiny(output, cfg.tiny, cfg.seed, [r["text"] for r in load_reviews(source)[:count]])
    models.record_remote_code(output, cfg.trust_remote_code)
    models.record_tokenizer_class(output)
    model = models.meta_causal_lm(output)  # the architecture without weights: counts a 70B model in no memory
    parameters = sum(p.numel() for p in model.parameters())
    tracker.log_metrics({"parameters": parameters})
    tracker.set_tags({"alignpipe.base_model": name})
    print(f"[base_model] {name} ({model.config.model_type}): {parameters / 1e6:.1f}M parameters -> {output}", flush=True)
