"""The config.json of the hub models the memory-plan tests need, as their publishers wrote them (huggingface.co,
each repository's config.json), and a Hugging Face cache seeded with them (or with other models and datasets, in the
layouts that huggingface_hub and `datasets` read offline) so that everything runs offline."""
import json
from pathlib import Path

LLAMA3_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA3_70B_INSTRUCT = LLAMA3_8B_INSTRUCT | {
    "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
}
QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
HUB_CONFIGS = {
    "meta-llama/Meta-Llama-3-8B-Instruct": LLAMA3_8B_INSTRUCT,
    "meta-llama/Meta-Llama-3-70B-Instruct": LLAMA3_70B_INSTRUCT,
    "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B_INSTRUCT,
}
# Their published parameter counts (the model cards), which the plan's count from config.json must match.
PUBLISHED_PARAMS = {"meta-llama/Meta-Llama-3-8B-Instruct": 8.03e9, "meta-llama/Meta-Llama-3-70B-Instruct": 70.55e9,
                    "Qwen/Qwen2.5-7B-Instruct": 7.62e9}


def hf_env(home: Path) -> dict:
    """The environment that makes huggingface_hub use the cache under `home` and nothing else (offline)."""
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1"}


def cache_hub_model(home: Path, repo: str, config: dict, weights: bool = False) -> Path:
    """Model `repo` in the hub cache's layout under `home` (models--org--name: refs/main names the snapshot that holds
    its files): its config.json and, with `weights`, a safetensors file (a header, no tensors). Returns the snapshot."""
    revision = "0" * 40
    cached = home / "hub" / f"models--{repo.replace('/', '--')}"
    (cached / "refs").mkdir(parents=True, exist_ok=True)
    (cached / "refs" / "main").write_text(revision)
    snapshot = cached / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    if weights:
        (snapshot / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")
    return snapshot


def cache_hub_dataset(home: Path, repo: str, rows: list[dict], split: str = "train") -> Path:
    """Hub dataset `repo` as `datasets` leaves it once its load_dataset prepared it, with HF_HOME `home`:
    dataset_info.json and the split's Arrow file in datasets/<org>___<name in snake case>/<config>/<version>/<hash>/,
    the directory that load_dataset reads offline. Returns it."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from datasets.naming import camelcase_to_snakecase, filename_prefix_for_split
    org, name = repo.split("/")
    prepared = home / "datasets" / f"{org}___{camelcase_to_snakecase(name)}" / "default" / "0.0.0" / ("0" * 16)
    prepared.mkdir(parents=True)
    table = datasets.Dataset.from_list(rows)
    splits = datasets.SplitDict(dataset_name=name)
    splits.add(datasets.SplitInfo(name=split, num_examples=len(rows), dataset_name=name))
    datasets.DatasetInfo(features=table.features, config_name="default", dataset_name=name,
                         splits=splits).write_to_directory(str(prepared))
    with ArrowWriter(path=str(prepared / f"{filename_prefix_for_split(name, split)}.arrow")) as writer:
        writer.write_table(table.data.table)
    return prepared


def seed_hf_cache(home: Path) -> dict:
    """A Hugging Face cache under `home` with each model's config.json (cache_hub_model); returns hf_env(home)."""
    for repo, config in HUB_CONFIGS.items():
        cache_hub_model(home, repo, config)
    return hf_env(home)


def hub_sizes(config: dict) -> dict:
    """launcher/memory.model_sizes of a validated config whose model.path is one of HUB_CONFIGS (sft.from and
    reward_model.from unset), read from the published config.json in this process, without a Hugging Face cache."""
    from launcher.memory import ModelSize
    size = ModelSize.from_config(HUB_CONFIGS[config["model"]["path"]], config["model"]["path"])
    return {"base": size, "policy": size, "reward": size}
