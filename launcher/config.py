"""Experiment config: validation against workflow/schemas/config.schema.yaml, defaults, and the config hash.

Imported by the Snakefile, so it must stay light (no torch, no ray).
"""
import copy
import hashlib
import json
import math
from pathlib import Path

import jsonschema
import yaml

from runtime.models import LINEAR_LAYERS
from runtime.rewards import RewardFileError, load_reward_fn
from runtime.tracking import TrackingURIError, check_tracking_uri
from runtime.user_data import is_hub, repo_path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A config that the schema rejects; the message names the file, the key and what is valid."""


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


# Draft 2020-12 counts 2.0 as an integer; a config's integer keys (batch sizes, counts, seeds) take whole numbers
# written as such, so that `batch_size: 2.0` is refused here rather than by a job hours later.
_STRICT_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda checker, instance: isinstance(instance, int) and not isinstance(instance, bool))
Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_STRICT_TYPES)


def non_finite_numbers(value, path: tuple = ()) -> list[tuple[str, float]]:
    """(dotted key, value) of every NaN or infinite number in a config (YAML's .nan, .inf; JSON schema's `number`
    accepts them, and no minimum or maximum refuses NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [(".".join(map(str, path)) or "<top level>", value)]
    if isinstance(value, dict):
        return [found for key, sub in value.items() for found in non_finite_numbers(sub, (*path, key))]
    if isinstance(value, (list, tuple)):
        return [found for i, sub in enumerate(value) for found in non_finite_numbers(sub, (*path, i))]
    return []


def _fill_defaults(schema: dict, instance: dict) -> None:
    for key, sub in schema.get("properties", {}).items():
        if key not in instance and "default" in sub:
            instance[key] = copy.deepcopy(sub["default"])
        if isinstance(instance.get(key), dict) and sub.get("type") == "object":
            _fill_defaults(sub, instance[key])


def _subschema(schema: dict, path) -> dict:
    for part in path:
        schema = schema.get("properties", {}).get(part, schema.get("items", {})) if isinstance(part, str) else schema.get("items", {})
    return schema


def _describe(error: jsonschema.ValidationError, schema: dict, source: str) -> str:
    key = ".".join(str(p) for p in error.absolute_path) or "<top level>"
    sub = _subschema(schema, list(error.absolute_path))
    if error.validator == "additionalProperties":
        unknown = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        valid = ", ".join(sorted(error.schema.get("properties", {})))
        where = f"{key}." if error.absolute_path else ""
        return f"{source}: unknown key {', '.join(where + u for u in unknown)}; valid keys here: {valid}"
    if error.validator == "enum":
        return f"{source}: {key} = {error.instance!r} is not valid; choose one of {error.validator_value}"
    if error.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "minItems"):
        limits = {k: sub[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in sub}
        return f"{source}: {key} = {error.instance!r} is out of range; valid: {limits or error.message}"
    if error.validator == "type" and isinstance(error.instance, float) and "integer" in str(error.validator_value):
        return (f"{source}: {key} = {error.instance!r} is not an integer: write it without a decimal point"
                + (f" ({int(error.instance)})" if error.instance.is_integer() else ""))
    if error.validator == "type":
        return f"{source}: {key} = {error.instance!r} has the wrong type; expected {error.validator_value}"
    return f"{source}: {key}: {error.message}"


def validate_config(raw: dict | None, source: str = "config") -> dict:
    """Return the config with defaults filled in, or raise ConfigError naming `source` and the bad key."""
    schema = load_schema()
    config = copy.deepcopy(raw or {})
    problems = [f"{source}: {key} = {value!r} is not a finite number" for key, value in non_finite_numbers(config)]
    validator = Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if not errors and not problems:
        _fill_defaults(schema, config)
        errors = list(validator.iter_errors(config))
    problems += [_describe(e, schema, source) for e in errors]
    if problems:
        raise ConfigError("invalid experiment config\n" + "\n".join("  " + p for p in problems))
    check_consistency(config, source)
    return config


def check_consistency(config: dict, source: str) -> None:
    """Rules that span several keys, or look at the files the config names, which JSON schema cannot express."""
    try:  # a password in tracking.uri would be on every rule's command line and in the job pickles
        check_tracking_uri(config["tracking"]["uri"], f"{source}: tracking.uri")
    except TrackingURIError as err:
        raise ConfigError(str(err)) from None
    architecture = check_models(config, source)
    trainers = {stage: config[stage] for stage in ("sft", "reward_model", "dpo")}
    trainers |= {f"rl.variants.{name}": rl_variant(config, name) for name in config["rl"]["variants"]}
    for where, trainer in trainers.items():
        per_step = trainer["micro_batch_size"] * trainer["num_workers"]
        if trainer["batch_size"] % per_step:
            raise ConfigError(f"{source}: {where}.batch_size = {trainer['batch_size']} must be a multiple of "
                              f"{where}.micro_batch_size * {where}.num_workers = {per_step}")
        if trainer["lora_rank"]:
            check_lora_targets(trainer["lora_targets"], architecture, f"{source}: {where}.lora_targets")
    for name in config["rl"]["variants"]:
        rl = trainers[f"rl.variants.{name}"]
        if rl["estimator"] not in ("gae", "reinforce") and rl["n_samples"] < 2:
            raise ConfigError(f"{source}: rl.variants.{name}: estimator {rl['estimator']} compares the responses "
                              f"of a prompt and needs n_samples >= 2, got {rl['n_samples']}")
        if (rl["rollout_batch_size"] * rl["n_samples"]) % rl["batch_size"]:
            raise ConfigError(f"{source}: rl.variants.{name}: rollout_batch_size * n_samples = "
                              f"{rl['rollout_batch_size'] * rl['n_samples']} must be a multiple of batch_size = "
                              f"{rl['batch_size']}")
        if rl["reward"] != "model":
            inherited = "" if "reward" in config["rl"]["variants"][name] else " (inherited from rl.reward)"
            check_reward_file(rl["reward"], f"{source}: rl.variants.{name}.reward{inherited}")
    for i, reward in enumerate(config["evaluate"]["rewards"]):
        if reward != "model":
            check_reward_file(reward, f"{source}: evaluate.rewards.{i}")
    models = ["base", "sft", "dpo", *config["rl"]["variants"]]
    for i, model in enumerate(config["evaluate"]["models"]):
        if model not in models:
            raise ConfigError(f"{source}: evaluate.models.{i} = {model!r} is not a model of this experiment; "
                              f"valid: {models}")
    tiny = config["model"]["tiny"]
    if tiny["hidden_size"] % tiny["num_heads"] or tiny["hidden_size"] // tiny["num_heads"] < 32:
        raise ConfigError(f"{source}: model.tiny.hidden_size / model.tiny.num_heads must be a whole number >= 32, "
                          f"got {tiny['hidden_size']} / {tiny['num_heads']}")
    data = config["data"]
    if data["apply_chat_template"] and data["input_template"]:
        raise ConfigError(f"{source}: data.input_template applies only with data.apply_chat_template: false")
    if not data["apply_chat_template"] and data["sft"]["messages_key"]:
        raise ConfigError(f"{source}: data.sft.messages_key (chat messages) needs data.apply_chat_template: true")


def check_model_dir(path: str, where: str, kind: str = "causal-LM") -> dict:
    """A Hugging Face directory the config names: its config.json, after checking it has safetensors weights."""
    directory = repo_path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{where} = {path!r}: not a Hugging Face {kind} directory (no {directory / 'config.json'})")
    if not list(directory.glob("*.safetensors")):
        raise ConfigError(f"{where} = {path!r}: no *.safetensors weights (alignpipe loads safetensors only; convert "
                          "with save_pretrained(..., safe_serialization=True))")
    return json.loads((directory / "config.json").read_text())


def check_models(config: dict, source: str) -> str | None:
    """The base model and the given SFT / reward models; returns the base model's architecture (model_type), None
    for a hub model (known only once downloaded)."""
    model = config["model"]
    if model["path"] is None:
        architecture = model["tiny"]["architecture"] if model["source"] == "tiny" else "llama"
    elif is_hub(model["path"]):
        architecture = None
    else:
        hf_config = check_model_dir(model["path"], f"{source}: model.path")
        architecture = hf_config.get("model_type")
        if hf_config.get("auto_map") and not model["trust_remote_code"]:
            raise ConfigError(f"{source}: model.path = {model['path']!r} comes with its own Python code (auto_map in "
                              "config.json); set model.trust_remote_code: true if you trust it")
        directory = repo_path(model["path"])
        tokenizer_config = directory / "tokenizer_config.json"
        has_template = (directory / "chat_template.jinja").is_file() or (
            tokenizer_config.is_file() and json.loads(tokenizer_config.read_text()).get("chat_template"))
        if config["data"]["apply_chat_template"] and not has_template:
            raise ConfigError(f"{source}: model.path = {model['path']!r} has no chat template; set "
                              "data.apply_chat_template: false and data.input_template (e.g. \"User: {}\\nAssistant: \")")
    if config["sft"]["from"]:
        check_model_dir(config["sft"]["from"], f"{source}: sft.from")
    if config["reward_model"]["from"]:
        hf_config = check_model_dir(config["reward_model"]["from"], f"{source}: reward_model.from",
                                    "sequence-classification")
        if len(hf_config.get("id2label", {})) != 1:
            raise ConfigError(f"{source}: reward_model.from = {config['reward_model']['from']!r} has "
                              f"{len(hf_config.get('id2label', {}))} labels; a reward model has one (a scalar score)")
    return architecture


def check_lora_targets(targets, architecture: str | None, where: str) -> None:
    """Layer names the architecture lacks are refused (an architecture not in LINEAR_LAYERS, or its default targets,
    are checked when its model loads: runtime/lora.py)."""
    layers = LINEAR_LAYERS.get(architecture)
    if layers is None or targets in (None, "all-linear"):
        return
    unknown = sorted(set(targets) - set(layers))
    if unknown:
        raise ConfigError(f"{where} {unknown}: no such linear layer in a {architecture} model; valid: {list(layers)} "
                          "or all-linear")


def check_reward_file(path: str, where: str) -> None:
    """A reward file the config names: a Python file, imported, whose reward_fn takes (prompts, completions,
    labels) (runtime/rewards.load_reward_fn)."""
    try:
        load_reward_fn(repo_path(path))
    except RewardFileError as err:
        raise ConfigError(f"{where}: {err}") from None


def method_seeds(config: dict) -> list[int]:
    """The seeds each method (dpo, every rl variant) runs with: `seeds`, or just `seed`."""
    return config["seeds"] or [config["seed"]]


def seeded_models(config: dict) -> list[str]:
    """The models trained once per seed (the methods); base and sft are shared and have one run."""
    return ["dpo", *config["rl"]["variants"]]


def rl_variant(config: dict, name: str) -> dict:
    """The settings of one RL run: the rl block's keys overridden by the variant's own (rl.vllm key by key)."""
    return deep_merge({k: v for k, v in config["rl"].items() if k != "variants"}, config["rl"]["variants"][name])


def stage_jobs(config: dict):
    """(stage, run name, params) of every job the DAG runs, params as its rule hands them to the launcher (the
    "config" of the rule's stage_key, workflow/rules/*.smk): what the launcher's checks see, before any job exists."""
    seed, seeds = config["seed"], method_seeds(config)
    yield "base_model", "base_model", {"model": config["model"], "seed": seed}
    yield "preprocess", "preprocess", {"data": config["data"], "seed": seed}
    yield "sft", "sft", {"sft": config["sft"], "seed": seed}
    yield "reward_model", "reward_model", {"reward_model": config["reward_model"], "seed": seed}
    for s in seeds:
        yield "dpo", f"dpo/seed{s}", {"dpo": config["dpo"], "seed": s}
    for name in config["rl"]["variants"]:
        for s in seeds:
            yield "rl", f"rl/{name}/seed{s}", {"rl": rl_variant(config, name), "variant": name, "seed": s}
    seeded = seeded_models(config)
    for model in config["evaluate"]["models"]:
        for s in (seeds if model in seeded else [seed]):
            yield "evaluate", f"evaluate/{model}/seed{s}", {"evaluate": config["evaluate"], "model": model, "seed": s}
    yield "report", "report", {k: config[k] for k in ("evaluate", "model", "data")} | {
        "variants": {name: rl_variant(config, name) for name in config["rl"]["variants"]}}


def load_config_files(paths, overrides: dict | None = None) -> dict:
    """Merge YAML files (later wins, like Snakemake's --configfile) and validate the result."""
    merged: dict = {}
    for path in paths:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
        merged = deep_merge(merged, data)
    return validate_config(deep_merge(merged, overrides or {}), source=", ".join(map(str, paths)) or "config")


def stage_config(module, overrides: dict, block: str | None = None, variant: str = "grpo"):
    """`module.Config` of a stage built outside its job (tests, benches) as its job builds it: `overrides`
    validated and filled with the schema's defaults, then the params its rule gives the job (the stage's config
    block, `block`, by default the stage's name; for `rl` the variant's merged settings and its name; the seed).
    So a key added to a stage reaches every caller with its default."""
    config = validate_config(overrides, source="overrides")
    block = block or module.__name__.rsplit(".", 1)[-1]
    if block == "rl":
        params = {"rl": rl_variant(config, variant), "variant": variant, "seed": config["seed"]}
    else:
        params = {block: config[block], "seed": config["seed"]}
    return module.Config.from_params(params)


def deep_merge(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def results_root(config: dict) -> Path:
    """The results directory (`results_dir`, relative to the repository root unless absolute)."""
    root = Path(config["results_dir"])
    return (root if root.is_absolute() else REPO_ROOT / root).resolve()


def config_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
