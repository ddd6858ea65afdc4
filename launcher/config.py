"""Experiment config: validation against workflow/schemas/config.schema.yaml, defaults, what the DAG holds (dag_stages)
and the params each of its jobs gets (stage_jobs).

Imported by the Snakefile, so it must stay light (no torch, no ray).
"""
import copy
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import yaml

from runtime.judge import JudgeError, check_settings
from runtime.models import LINEAR_LAYERS, vocabulary_mismatch
from runtime.remote_reward import check_service
from runtime.rewards import is_remote, reward_name
from runtime.tracking import TrackingURIError, check_tracking_uri, config_hash
from runtime.user_data import first_prompts, is_builtin, is_hub, repo_path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A config that the schema rejects; the message names the file, the key and what is valid."""


@functools.cache
def load_schema() -> dict:
    """The schema, read once per process (with libyaml where PyYAML has it: the pure-Python parser took a tenth of a
    dry run). Callers only read it."""
    return yaml.load(SCHEMA_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


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
        if isinstance(instance.get(key), dict) and "object" in _types(sub):
            _fill_defaults(sub, instance[key])


def _unshared(value):
    """A copy that shares no mapping or list (copy.deepcopy keeps a YAML anchor's aliases shared: two datasets written
    as one anchor would get their defaults filled into one mapping)."""
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return copy.deepcopy(value)


def _types(schema: dict) -> list:
    kind = schema.get("type", [])
    return kind if isinstance(kind, list) else [kind]


def _subschema(schema: dict, path) -> dict:
    for part in path:
        named = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None
        schema = schema.get("properties", {}).get(part, named or schema.get("items", {})) if isinstance(part, str) \
            else schema.get("items", {})
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
    config = _unshared(raw or {})
    problems = [f"{source}: {key} = {value!r} is not a finite number" for key, value in non_finite_numbers(config)]
    validator = Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.absolute_path)))
    if not errors and not problems:
        _fill_defaults(schema, config)
        errors = list(validator.iter_errors(config))
    problems += [_describe(e, schema, source) for e in errors]
    if problems:
        raise ConfigError("invalid experiment config\n" + "\n".join("  " + p for p in problems))
    for key, where in (("results_dir", config), ("checkpoint_dir", config["launcher"])):
        if where[key] is not None:  # (Snakemake and the shell take a path as written: `~` would be a folder)
            where[key] = os.path.expanduser(where[key])
    resolve_evaluation(config)
    resolve_benchmarks(config)
    check_consistency(config, source)
    return config


# ---- what the DAG holds: the rules are stated once, in the schema's header ---------------------------------------

def dag_stages(config: dict) -> dict:
    """The stages an experiment's DAG holds, from its validated config: sft, reward_model and dpo (each True or
    False), the rl `variants`, and the `datasets` preprocess writes (sft, pairs, prompts: one job each, so that adding
    a dataset reruns only what reads it). base_model, evaluate and report are always there."""
    data, variants = config["data"], list(config["rl"]["variants"])
    scorers = [rl_variant(config, name)["reward"] for name in variants] + list(config["evaluate"]["rewards"] or [])
    reward_model, dpo = "model" in scorers, config["dpo"] is not None
    pairs = data["preference"]["path"] is not None and (dpo or reward_model)
    return {"sft": bool(data["sft"]["path"] or config["sft"]["from"]), "reward_model": reward_model, "dpo": dpo,
            "variants": variants,
            "datasets": [name for name, used in (("sft", data["sft"]["path"] is not None), ("pairs", pairs),
                                                 ("prompts", True)) if used]}


def dag_models(config: dict) -> list[str]:
    """Every model the DAG makes, in the results table's order: base, sft, dpo and the rl variants present."""
    stages = dag_stages(config)
    return ["base", *["sft"] * stages["sft"], *["dpo"] * stages["dpo"], *stages["variants"]]


def resolve_evaluation(config: dict) -> None:
    """evaluate.rewards null: the rl variants' rewards (each once, in order; none without RL; a variant's reward null,
    the environment's step rewards alone, is none); evaluate.models null: every model the DAG makes."""
    evaluate = config["evaluate"]
    if evaluate["rewards"] is None:
        rewards = [reward for name in config["rl"]["variants"] if (reward := rl_variant(config, name)["reward"])]
        evaluate["rewards"] = list(dict.fromkeys(rewards))
    if evaluate["models"] is None:
        evaluate["models"] = dag_models(config)


def resolve_benchmarks(config: dict) -> None:
    """Each benchmark filled with the schema's defaults (named entries: _fill_defaults fills only `properties`); its
    pass_k null: [n_samples] when it samples more than once; its system_prompt null: data's."""
    entry = load_schema()["properties"]["benchmarks"]["additionalProperties"]
    for bench in config["benchmarks"].values():
        _fill_defaults(entry, bench)
        if bench["pass_k"] is None:
            bench["pass_k"] = [bench["n_samples"]] if bench["n_samples"] > 1 else []
        if bench["system_prompt"] is None:
            bench["system_prompt"] = config["data"]["system_prompt"]


# A benchmark's scorers besides a Python file (runtime/answer_scoring.py; choice: stages/benchmark.py).
SCORERS = ("math", "exact", "regex", "choice")


def check_benchmarks(config: dict, source: str) -> None:
    """Each benchmark's dataset, scorer and sampling, before anything is queued."""
    for name, bench in config["benchmarks"].items():
        where = f"{source}: benchmarks.{name}"
        if bench["lm_eval"]:
            task, include = bench["lm_eval"]["task"], bench["lm_eval"]["include_path"]
            if bench["path"]:
                raise ConfigError(f"{where}: path and lm_eval both given; an lm-eval task names its own dataset (in "
                                  "its YAML): remove one")
            if task.endswith((".yaml", ".yml")) and not repo_path(task).is_file():
                raise ConfigError(f"{where}.lm_eval.task = {task!r}: no such task YAML file")
            if include and not repo_path(include).is_dir():
                raise ConfigError(f"{where}.lm_eval.include_path = {include!r}: no such directory")
            if not task.endswith((".yaml", ".yml")) and not include:
                raise ConfigError(f"{where}.lm_eval.task = {task!r} is a task name: give include_path, the directory "
                                  "of its YAML (tasks are read offline), or the YAML file itself")
        elif bench["path"] is None:
            raise ConfigError(f"{where}.path is not set: give the benchmark's problems (a file, directory, hub id or "
                              "builtin:arithmetic) or an lm_eval task")
        elif is_builtin(bench["path"]) and bench["path"] != "builtin:arithmetic":
            raise ConfigError(f"{where}.path = {bench['path']!r}: the built-in benchmark is builtin:arithmetic")
        elif not is_builtin(bench["path"]) and not is_hub(bench["path"]) and not repo_path(bench["path"]).exists():
            raise ConfigError(f"{where}.path = {bench['path']!r}: no such file or directory (relative paths are taken "
                              "from the repository root)")
        scorer, pattern = bench["scorer"], bench["answer_pattern"]
        if bench["environment"] and (config["environment"] is None or bench["lm_eval"]):
            raise ConfigError(f"{where}.environment: true plays the experiment's environment on each problem: it needs "
                              "an `environment` block (environment.path) and a dataset (path), not lm_eval")
        if not bench["lm_eval"] and not bench["environment"]:
            if scorer not in SCORERS and not scorer.endswith(".py"):
                raise ConfigError(f"{where}.scorer = {scorer!r} is not valid; choose one of {list(SCORERS)} or a "
                                  "Python file defining reward_fn(prompts, completions, labels)")
            if scorer.endswith(".py"):
                check_reward_file(scorer, f"{where}.scorer")
            if scorer == "regex" and not pattern:
                raise ConfigError(f"{where}: scorer regex needs answer_pattern (a regular expression finding the "
                                  "answer)")
            if scorer == "choice" and (not bench["choices_key"] or bench["n_samples"] != 1):
                raise ConfigError(f"{where}: scorer choice ranks each row's options (choices_key, got "
                                  f"{bench['choices_key']!r}) by their log-likelihood, once: n_samples must be 1 "
                                  f"(got {bench['n_samples']})")
        if pattern:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"{where}.answer_pattern = {pattern!r} is not a regular expression: {err}") from None
        if bench["temperature"] == 0 and bench["n_samples"] > 1:
            raise ConfigError(f"{where}: temperature 0 is greedy decoding, the same reply each time; n_samples = "
                              f"{bench['n_samples']} needs a temperature above 0 (or n_samples: 1)")
        if too_many := [k for k in bench["pass_k"] if k > bench["n_samples"]]:
            raise ConfigError(f"{where}.pass_k = {bench['pass_k']}: pass@k needs k <= n_samples = "
                              f"{bench['n_samples']} ({too_many} is not)")
    baseline = config["evaluate"]["baseline"]
    if baseline is not None and baseline not in config["evaluate"]["models"]:
        raise ConfigError(f"{source}: evaluate.baseline = {baseline!r} is not a row of the results; valid: "
                          f"{config['evaluate']['models']} (evaluate.models)")


def check_dag_data(config: dict, source: str) -> None:
    """Each dataset a stage of the DAG reads is given; what is not in the DAG needs nothing. (At parse time, with the
    other checks of a whole experiment: launcher/checks.py. A config for one stage built on its own, as tests and
    benches build them, needs no datasets.)"""
    stages, data = dag_stages(config), config["data"]
    uses = [f"rl.variants.{name}.reward" for name in stages["variants"] if rl_variant(config, name)["reward"] == "model"]
    uses += ["evaluate.rewards"] * ("model" in config["evaluate"]["rewards"])
    needs = []  # (the dataset, the stage that reads it)
    if stages["dpo"]:
        needs.append(("preference", "dpo (the `dpo` block is present; remove it or set dpo: null for no DPO)"))
    if stages["reward_model"]:  # trained on the pairs, or given and measured on them (RL normalises by its scores)
        needs.append(("preference", f"the reward model ({' and '.join(uses)} score with `model`), trained on the pairs "
                                    "or, given by reward_model.from, measured on them"))
    if stages["variants"]:
        needs.append(("prompts", f"rl (rl.variants: {', '.join(stages['variants'])})"))
    problems = [f"{source}: data.{role}.path is not set, but {stage} needs it" for role, stage in needs
                if data[role]["path"] is None]
    if data["eval"]["path"] is None and data["prompts"]["path"] is None:
        problems.append(f"{source}: the evaluation needs prompts: set data.eval.path (or data.prompts.path, whose "
                        "held-out share is then evaluated)")
    if config["reward_model"]["from"] and not stages["reward_model"]:
        problems.append(f"{source}: reward_model.from is given but nothing scores with `model` (an rl variant's "
                        "reward or evaluate.rewards); remove it or use it")
    if problems:
        raise ConfigError("the experiment's stages need data it does not give\n" + "\n".join("  " + p for p in problems))


def check_consistency(config: dict, source: str) -> None:
    """Rules that span several keys, or look at the files the config names, which JSON schema cannot express."""
    try:  # a password in tracking.uri would be on every rule's command line and in the job pickles
        check_tracking_uri(config["tracking"]["uri"], f"{source}: tracking.uri")
    except TrackingURIError as err:
        raise ConfigError(str(err)) from None
    architecture = check_models(config, source)
    trainers = {stage: config[stage] for stage in trained_stages(config)}
    trainers |= {f"rl.variants.{name}": rl_variant(config, name) for name in config["rl"]["variants"]}
    for where, trainer in trainers.items():
        per_step = trainer["micro_batch_size"] * trainer["num_workers"]
        if trainer["batch_size"] % per_step:
            raise ConfigError(f"{source}: {where}.batch_size = {trainer['batch_size']} must be a multiple of "
                              f"{where}.micro_batch_size * {where}.num_workers = {per_step}")
        if trainer["lora_rank"]:
            check_lora_targets(trainer["lora_targets"], architecture, f"{source}: {where}.lora_targets")
    check_rewards_without_environment(config, source)
    prompts = reward_check_prompts(config)
    for name in config["rl"]["variants"]:
        rl = trainers[f"rl.variants.{name}"]
        if rl["dynamic_sampling"] and rl["n_samples"] < 2:
            raise ConfigError(f"{source}: rl.variants.{name}: dynamic_sampling compares the responses of a prompt and "
                              f"needs n_samples >= 2, got {rl['n_samples']}")
        if rl["async_rollouts"] and not rl["is_cap"]:
            raise ConfigError(f"{source}: rl.variants.{name}: async_rollouts trains on samples of the weights before "
                              f"the last update; is_cap (the importance weight of that gap) must be set, got null")
        if rl["top_p"] < 1:
            raise ConfigError(f"{source}: rl.variants.{name}: top_p = {rl['top_p']} samples from the nucleus of each "
                              "distribution, renormalised, while the trainer's and the reference's log-probs cover the "
                              "whole vocabulary: the importance ratios and the KL would compare distributions nobody "
                              "sampled from; set top_p: 1.0 (temperature is applied on both sides)")
        if rl["async_rollouts"] and rl["vllm"]["sleep"]:
            raise ConfigError(f"{source}: rl.variants.{name}: async_rollouts generates while DeepSpeed trains; "
                              f"vllm.sleep (vLLM asleep while DeepSpeed trains) cannot go with it")
        if rl["overlong"] == "penalty" and rl["overlong_buffer"] > rl["max_new_tokens"]:
            raise ConfigError(f"{source}: rl.variants.{name}: overlong_buffer = {rl['overlong_buffer']} must be at most "
                              f"max_new_tokens = {rl['max_new_tokens']}")
        if rl["estimator"] not in ("gae", "reinforce") and rl["n_samples"] < 2:
            raise ConfigError(f"{source}: rl.variants.{name}: estimator {rl['estimator']} compares the responses "
                              f"of a prompt and needs n_samples >= 2, got {rl['n_samples']}")
        if (rl["rollout_batch_size"] * rl["n_samples"]) % rl["batch_size"]:
            raise ConfigError(f"{source}: rl.variants.{name}: rollout_batch_size * n_samples = "
                              f"{rl['rollout_batch_size'] * rl['n_samples']} must be a multiple of batch_size = "
                              f"{rl['batch_size']}")
        inherited = lambda key: "" if key in config["rl"]["variants"][name] else f" (inherited from rl.{key})"
        check_reward(rl["reward"], config, f"{source}: rl.variants.{name}.reward{inherited('reward')}", prompts)
        if rl["teacher"]:
            check_teacher(rl["teacher"], config, f"{source}: rl.variants.{name}.teacher{inherited('teacher')}")
    columns = {}  # each reward's column of the results (reward_<file name>): two files may not share one
    for i, reward in enumerate(config["evaluate"]["rewards"]):
        check_reward(reward, config, f"{source}: evaluate.rewards.{i}", prompts)
        if (other := columns.setdefault(reward_name(reward), reward)) != reward:
            raise ConfigError(f"{source}: evaluate.rewards: {other!r} and {reward!r} would both be the results' column "
                              f"{reward_name(reward)!r} (a reward's column is its file's name, `remote` for any "
                              "reward service); keep one of them")
    models = dag_models(config)
    for i, model in enumerate(config["evaluate"]["models"]):
        if model not in models:
            raise ConfigError(f"{source}: evaluate.models.{i} = {model!r} is not a model this experiment's DAG makes; "
                              f"valid: {models} (sft needs data.sft.path or sft.from, dpo the `dpo` block, an rl "
                              "variant its entry in rl.variants)")
    check_benchmarks(config, source)
    tiny = config["model"]["tiny"]
    if tiny["hidden_size"] % tiny["num_heads"] or tiny["hidden_size"] // tiny["num_heads"] < 32:
        raise ConfigError(f"{source}: model.tiny.hidden_size / model.tiny.num_heads must be a whole number >= 32, "
                          f"got {tiny['hidden_size']} / {tiny['num_heads']}")
    data = config["data"]
    if data["apply_chat_template"] and data["input_template"]:
        raise ConfigError(f"{source}: data.input_template applies only with data.apply_chat_template: false")
    if not data["apply_chat_template"] and data["sft"]["messages_key"]:
        raise ConfigError(f"{source}: data.sft.messages_key (chat messages) needs data.apply_chat_template: true")


def check_rewards_without_environment(config: dict, source: str) -> None:
    """rl.reward null (the rl block's, or a variant's own) leaves the reward to an episode's step rewards or a
    teacher's: refused without an `environment`, where the variant has no teacher either."""
    if config["environment"] is not None:
        return
    rl = config["rl"]
    untaught = [name for name in rl["variants"] if not rl_variant(config, name)["teacher"]]
    inherit = [name for name in untaught if "reward" not in rl["variants"][name]]
    keys = ["rl.reward"] * (rl["reward"] is None and (bool(inherit) or not rl["variants"] and not rl["teacher"])) + [
        f"rl.variants.{name}.reward" for name in untaught
        if "reward" in rl["variants"][name] and rl["variants"][name]["reward"] is None]
    if keys:
        raise ConfigError(f"{source}: {' and '.join(keys)} = null: a reward of null (the environment's step rewards "
                          "alone, or a teacher's) needs an `environment` block (environment.path: a Python file "
                          "defining class Environment) or rl.teacher; without either give model, judge, a reward "
                          "service's URL or a Python file defining reward_fn(prompts, completions, labels)")


def check_reward(reward: str | None, config: dict, where: str, prompts: dict | None) -> None:
    """A reward the config names, as what it is: the judge's settings and model, a reward service that answers
    (unless remote_reward.check is false), or a reward file (`model`, the reward model, is checked with the data)."""
    if reward in ("model", None):
        return
    if reward == "judge":
        judge = config["judge"]
        try:
            check_settings(judge, "judge")
        except JudgeError as err:
            raise ConfigError(f"{where} = judge: {err}") from None
        if judge["model"] != "base":
            check_model_dir(judge["model"], f"{where} = judge: judge.model")
    elif is_remote(reward):
        settings = config["remote_reward"]
        if settings["token_env"] and not os.environ.get(settings["token_env"]):
            raise ConfigError(f"{where} = {reward!r}: remote_reward.token_env names {settings['token_env']}, which is "
                              "not set in this environment (the jobs read the token from it)")
        if settings["check"]:
            key = (reward, json.dumps(prompts, default=str))
            if key not in _services_checked:
                sample = prompts or {"prompts": ["What is 2 + 2?"], "labels": [None]}
                _services_checked[key] = check_service(reward, settings, sample["prompts"], sample["labels"])
            if _services_checked[key]:
                raise ConfigError(f"{where}: {_services_checked[key]}")
    else:
        check_reward_file(reward, where, prompts)


def check_teacher(teacher: str, config: dict, where: str) -> None:
    """An rl variant's teacher: a model directory whose tokenizer is the policy's, where the policy's is known
    before anything runs (a model.path directory, or sft.from; otherwise the rl stage checks it as it starts)."""
    check_model_dir(teacher, where)
    student = config["sft"]["from"] or config["model"]["path"]
    if student and not is_hub(student) and (problem := vocabulary_mismatch(repo_path(student), repo_path(teacher))):
        raise ConfigError(f"{where}: {problem}")


_services_checked: dict = {}  # (url, prompts) -> the problem found, or None: each once per process


def read_json_file(path: Path, where: str) -> dict:
    """A model directory's JSON file, or a ConfigError naming it and where its JSON breaks."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}: {path} is not valid JSON ({err})") from None


def check_safetensors(path: Path, where: str) -> None:
    """A safetensors file's frame: an 8-byte little-endian header length, then that much JSON (what safe_open reads
    first; nothing else of the file is read)."""
    with path.open("rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = fh.read(size) if 2 <= size <= 100_000_000 else b""
    try:
        if not isinstance(json.loads(header), dict):
            raise ValueError
    except ValueError:
        raise ConfigError(f"{where}: {path} is not a safetensors file (no safetensors header at its start)") from None


def check_model_dir(path: str, where: str, kind: str = "causal-LM") -> dict:
    """A Hugging Face directory the config names: its config.json, after checking it has safetensors weights."""
    directory = repo_path(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{where} = {path!r}: not a Hugging Face {kind} directory (no {directory / 'config.json'})")
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"{where} = {path!r}: no *.safetensors weights (alignpipe loads safetensors only; convert "
                          "with save_pretrained(..., safe_serialization=True))")
    for file in weights:
        check_safetensors(file, f"{where} = {path!r}")
    return read_json_file(directory / "config.json", f"{where} = {path!r}")


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
            tokenizer_config.is_file() and read_json_file(tokenizer_config, f"{source}: model.path").get("chat_template"))
        if config["data"]["apply_chat_template"] and not has_template:
            raise ConfigError(f"{source}: model.path = {model['path']!r} has no chat template; set "
                              "data.apply_chat_template: false and data.input_template (e.g. \"User: {}\\nAssistant: \")")
        check_lengths(config, source, hf_config.get("max_position_embeddings") or hf_config.get("n_positions"))
    if config["sft"]["from"]:
        check_model_dir(config["sft"]["from"], f"{source}: sft.from")
    if config["reward_model"]["from"]:
        hf_config = check_model_dir(config["reward_model"]["from"], f"{source}: reward_model.from",
                                    "sequence-classification")
        if len(hf_config.get("id2label", {})) != 1:
            raise ConfigError(f"{source}: reward_model.from = {config['reward_model']['from']!r} has "
                              f"{len(hf_config.get('id2label', {}))} labels; a reward model has one (a scalar score)")
    return architecture


# What the stages add to a prompt's and its new tokens' length for vLLM's max_model_len (stages/rl.py, evaluate.py).
LENGTH_MARGIN = 8


def check_lengths(config: dict, source: str, positions: int | None) -> None:
    """A prompt and what is generated or trained after it must fit the model's positions: vLLM refuses a longer
    max_model_len, and a model with learned position embeddings (GPT-2) fails on one, in the stage, after the stages
    before it ran."""
    if not positions:
        return
    prompt = config["data"]["max_prompt_tokens"]
    lengths = [("data.max_response_tokens", config["data"]["max_response_tokens"]),
               ("evaluate.max_new_tokens", config["evaluate"]["max_new_tokens"])]
    lengths += [(f"rl.variants.{name}.max_new_tokens", rl_variant(config, name)["max_new_tokens"])
                for name in config["rl"]["variants"]]
    for key, tokens in lengths:
        if prompt + tokens + LENGTH_MARGIN > positions:
            raise ConfigError(f"{source}: data.max_prompt_tokens + {key} = {prompt} + {tokens} tokens (+ {LENGTH_MARGIN} "
                              f"spare) do not fit model.path's {positions} positions (its config.json); lower them")
    for name, bench in config["benchmarks"].items():  # (its stage checks each prompt with them: stages/benchmark.py)
        if bench["max_new_tokens"] + LENGTH_MARGIN > positions:
            raise ConfigError(f"{source}: benchmarks.{name}.max_new_tokens = {bench['max_new_tokens']} (+ {LENGTH_MARGIN} "
                              f"spare) leave no room for a prompt in model.path's {positions} positions; lower it")


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


# How long a reward file's check may take: its import and the call of reward_fn (it runs at every dry run; a hang
# becomes a refusal).
REWARD_CHECK_S = 60
# The prompts reward_fn is called on in its check: the first rows of the experiment's RL prompts.
REWARD_CHECK_ROWS = 4
_reward_files_checked: dict = {}  # (path, mtime, prompts) -> the problem found, or None: each once per process
_prompts_read: dict = {}  # (where the prompts come from, the dataset's mtime) -> reward_check_prompts's answer


def reward_check_prompts(config: dict) -> dict | None:
    """The prompts a reward file's check calls reward_fn on, {"prompts", "labels", "where"}: the first
    REWARD_CHECK_ROWS good rows of data.prompts, RL's prompts (data.eval in a DAG without them), built in or a local
    file or directory (runtime/user_data.first_prompts), read once per process; None for a hub dataset (nothing is
    downloaded here), none, or one that cannot be read (check_datasets names what is wrong with it)."""
    data = config["data"]
    role = "prompts" if data["prompts"]["path"] else "eval"
    path = data[role]["path"]
    if path is None or is_hub(path) or not (is_builtin(path) or repo_path(path).is_file() or repo_path(path).is_dir()):
        return None  # (a missing file, or a pipe that reading would wait on)
    source = (role, data[role], config["seed"], data["builtin"])
    key = (json.dumps(source, sort_keys=True), None if is_builtin(path) else repo_path(path).stat().st_mtime_ns)
    if key not in _prompts_read:
        try:
            prompts, labels = first_prompts(role, data[role], REWARD_CHECK_ROWS, config["seed"], data["builtin"])
        except Exception:  # a file that cannot be read: check_datasets names it
            prompts, labels = [], []
        read = {"prompts": prompts, "labels": labels, "where": f"data.{role} ({path})"}
        _prompts_read[key] = read if prompts else None
    return _prompts_read[key]


def check_reward_file(path: str, where: str, prompts: dict | None = None) -> None:
    """A reward file the config names: a Python file whose reward_fn takes (prompts, completions, labels)
    (runtime/rewards.load_reward_fn) and returns one finite number per completion when called on the `prompts`
    (reward_check_prompts) with made-up completions (runtime/rewards.check_reward_call); imported and called in a
    child process, once per file and prompts: whatever it does (exit, signal, KeyboardInterrupt, a hang past
    REWARD_CHECK_S) becomes a refusal that names it, never the end of the dry run."""
    file = repo_path(path)
    key = (str(file), file.stat().st_mtime_ns if file.is_file() else None, json.dumps(prompts, default=str))
    if key not in _reward_files_checked:
        _reward_files_checked[key] = reward_file_problem(file, prompts)
    if _reward_files_checked[key]:
        raise ConfigError(f"{where}: {_reward_files_checked[key]}")


# What a file-checking child process prints last (child_check_problem): its verdict.
CHILD_CHECKED, CHILD_REFUSED = "alignpipe: file checked", "alignpipe: file refused: "
REWARD_CHILD = f"""import json, sys
from runtime.rewards import RewardFileError, check_reward_call, load_reward_fn
call = json.load(sys.stdin)  # the prompts, their labels and where they come from; null: none
try:
    reward_fn = load_reward_fn(sys.argv[1])
    if call:
        check_reward_call(reward_fn, sys.argv[1], call["prompts"], call["labels"], call["where"])
except RewardFileError as err:
    print({CHILD_REFUSED!r} + str(err), flush=True)
    sys.exit(0)
print({CHILD_CHECKED!r}, flush=True)
"""


def child_check_problem(script: str, file: Path, timeout_s: float, doing: str, checked: str,
                        stdin: str = "") -> str | None:
    """Run `script` (Python that checks the file named by its sys.argv[1] and prints CHILD_REFUSED + the problem, or
    CHILD_CHECKED, last) in a child process of this Python, within `timeout_s`; return the problem it found, or what
    stopped it (`doing`: what the child does, for a timeout; `checked`: what it checks, for an early end), or None."""
    try:
        proc = subprocess.run([sys.executable, "-c", script, str(file)], cwd=REPO_ROOT, capture_output=True, text=True,
                              errors="replace", timeout=timeout_s, input=stdin,
                              env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
    except subprocess.TimeoutExpired:
        return f"{file}: {doing} did not finish within {timeout_s} s (does it wait for something?)"
    lines = proc.stdout.splitlines()
    if lines and lines[-1].startswith(CHILD_REFUSED):
        return lines[-1].removeprefix(CHILD_REFUSED)
    if proc.returncode == 0 and lines and lines[-1] == CHILD_CHECKED:
        return None
    how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with status {proc.returncode}"
    said = (proc.stdout + proc.stderr).strip()[-400:]
    return (f"{file}: importing or calling it, the process {how} before {checked} was checked (sys.exit, os._exit, "
            f"a signal or KeyboardInterrupt?)" + (f"; its last output: {said}" if said else ""))


def reward_file_problem(file: Path, prompts: dict | None = None) -> str | None:
    """What load_reward_fn and a call of reward_fn on the `prompts`, run in a child process of this Python, say of
    `file`; or what stopped them."""
    return child_check_problem(REWARD_CHILD, file, REWARD_CHECK_S,
                               f"its import{' and a call of reward_fn' if prompts else ''}", "reward_fn",
                               stdin=json.dumps(prompts, default=str))


# How long an environment file's check (its import, the class's methods) may take; a hang becomes a refusal.
ENVIRONMENT_CHECK_S = 60
_environment_files_checked: dict = {}  # (path, mtime) -> the problem found, or None: each once per process
ENVIRONMENT_CHILD = f"""import sys
from runtime.environments import EnvironmentFileError, load_environment
try:
    load_environment(sys.argv[1])
except EnvironmentFileError as err:
    print({CHILD_REFUSED!r} + str(err), flush=True)
    sys.exit(0)
print({CHILD_CHECKED!r}, flush=True)
"""


def check_environment_file(path: str, where: str) -> None:
    """The environment file the config names (environment.path): a Python file defining class Environment with reset
    and step (runtime/environments.load_environment), imported in a child process once per file and mtime: whatever
    its import does (exit, signal, a hang past ENVIRONMENT_CHECK_S) becomes a refusal naming `where` and the file."""
    file = repo_path(path)
    key = (str(file), file.stat().st_mtime_ns if file.is_file() else None)
    if key not in _environment_files_checked:
        _environment_files_checked[key] = child_check_problem(ENVIRONMENT_CHILD, file, ENVIRONMENT_CHECK_S,
                                                              "its import", "class Environment")
    if _environment_files_checked[key]:
        raise ConfigError(f"{where}: {_environment_files_checked[key]}")


def method_seeds(config: dict) -> list[int]:
    """The seeds each method (dpo, every rl variant) runs with: `seeds`, or just `seed`."""
    return config["seeds"] or [config["seed"]]


def seeded_models(config: dict) -> list[str]:
    """The models trained once per seed (the methods present); base and sft are shared and have one run."""
    return ["dpo"] * (config["dpo"] is not None) + list(config["rl"]["variants"])


def trained_stages(config: dict) -> list[str]:
    """The stages of the DAG among sft, reward_model and dpo that train (not given by `<stage>.from`)."""
    stages = dag_stages(config)
    return [stage for stage in ("sft", "reward_model", "dpo") if stages[stage] and not config[stage].get("from")]


# The data.<role> blocks each dataset preprocess writes reads (dag_stages's `datasets`).
DATASET_ROLES = {"sft": ("sft",), "pairs": ("preference",), "prompts": ("prompts", "eval")}


def preprocess_params(config: dict, dataset: str) -> dict:
    """What preprocess reads to write one dataset (its cache key): the formatting keys of `data` and the dataset's
    own blocks (prompts: data.prompts and data.eval, whose held-out share or rows it writes)."""
    roles = DATASET_ROLES[dataset]
    data = {k: v for k, v in config["data"].items() if k not in ("sft", "preference", "prompts", "eval") or k in roles}
    return {"data": data, "dataset": dataset, "seed": config["seed"]}


def rl_variant(config: dict, name: str) -> dict:
    """The settings of one RL run: the rl block's keys overridden by the variant's own (rl.vllm key by key), and the
    `environment` its episodes run against (None: single-turn)."""
    variant = deep_merge({k: v for k, v in config["rl"].items() if k != "variants"}, config["rl"]["variants"][name])
    return variant | {"environment": config["environment"]} | reward_settings(config, [variant["reward"]])


def reward_settings(config: dict, rewards: list) -> dict:
    """The blocks that say how `rewards` score, for the stages that call them (their cache key): `judge` where one is
    judge, `remote_reward` where one is a reward service's URL (None where none is)."""
    return {"judge": config["judge"] if "judge" in rewards else None,
            "remote_reward": config["remote_reward"] if any(map(is_remote, rewards)) else None}


def stage_jobs(config: dict):
    """(stage, run name, params) of every job the DAG runs, params as its rule hands them to the launcher (the
    "config" of the rule's stage_key, workflow/rules/*.smk): what the launcher's checks see, before any job exists."""
    seed, seeds, stages = config["seed"], method_seeds(config), dag_stages(config)
    yield "base_model", "base_model", {"model": config["model"], "seed": seed}
    for dataset in stages["datasets"]:
        yield "preprocess", f"preprocess/{dataset}", preprocess_params(config, dataset)
    for stage in ("sft", "reward_model"):
        if stages[stage]:
            yield stage, stage, {stage: config[stage], "seed": seed}
    for s in seeds if stages["dpo"] else []:
        yield "dpo", f"dpo/seed{s}", {"dpo": config["dpo"], "seed": s}
    for name in config["rl"]["variants"]:
        for s in seeds:
            yield "rl", f"rl/{name}/seed{s}", {"rl": rl_variant(config, name), "variant": name, "seed": s}
    seeded = seeded_models(config)
    for model in config["evaluate"]["models"]:
        for s in (seeds if model in seeded else [seed]):
            yield "evaluate", f"evaluate/{model}/seed{s}", {"evaluate": evaluate_params(config), "model": model,
                                                              "seed": s}
    for name in config["benchmarks"]:
        for model in config["evaluate"]["models"]:
            for s in (seeds if model in seeded else [seed]):
                yield "benchmark", f"benchmark/{name}/{model}/seed{s}", benchmark_params(config, name, model, s)
    yield "report", "report", report_params(config)


def benchmark_params(config: dict, name: str, model: str, seed: int) -> dict:
    """What one benchmark job reads (its cache key): the benchmark's own settings, how prompts are formatted, the
    engines, the model and the seed; nothing of another benchmark, so adding one reruns no other's jobs."""
    data, bench = config["data"], config["benchmarks"][name]
    return {"benchmark": bench, "name": name, "model": model, "seed": seed, "vllm": config["evaluate"]["vllm"],
            "precision": config["evaluate"]["precision"],
            "chat": {"apply_chat_template": data["apply_chat_template"], "input_template": data["input_template"]},
            "environment": config["environment"] if bench["environment"] else None}


def evaluate_params(config: dict) -> dict:
    """The evaluate block as one evaluation reads it: without `models` (each job's own model is its wildcard), so that
    adding a model to the table reruns no other model's evaluation; with the `environment` whose episodes it scores
    (None: none)."""
    return {k: v for k, v in config["evaluate"].items() if k != "models"} | {"environment": config["environment"]} | \
        reward_settings(config, config["evaluate"]["rewards"])


def report_params(config: dict) -> dict:
    """What the report shows and describes: evaluate, model, data, the stages the DAG holds and each rl variant's
    merged settings."""
    stages = dag_stages(config)
    return {k: config[k] for k in ("evaluate", "model", "data", "benchmarks")} | {
        "stages": {k: stages[k] for k in ("sft", "reward_model", "dpo")},
        "given": {stage: config[stage]["from"] for stage in ("sft", "reward_model")},
        "variants": {name: rl_variant(config, name) for name in config["rl"]["variants"]}}


class DuplicateKey(yaml.YAMLError):
    pass


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key written twice in one mapping (PyYAML, and so Snakemake, silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        lines: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise DuplicateKey(f"line {line}: key {key!r} is written twice in one mapping (first on line "
                                   f"{lines[key]}); write it once")
            lines[key] = line
        return super().construct_mapping(node, deep)


def read_config_file(path) -> dict:
    """One experiment file as a mapping; ConfigError naming the file (and line) if it is not one."""
    try:
        data = yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader) or {}
    except DuplicateKey as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def load_config_files(paths, overrides: dict | None = None) -> dict:
    """Merge YAML files (later wins, like Snakemake's --configfile) and validate the result."""
    merged: dict = {}
    for path in paths:
        merged = deep_merge(merged, read_config_file(path))
    return validate_config(deep_merge(merged, overrides or {}), source=", ".join(map(str, paths)) or "config")


def stage_config(module, overrides: dict, block: str | None = None, variant: str = "grpo"):
    """`module.Config` of a stage built outside its job (tests, benches) as its job builds it: `overrides`
    validated and filled with the schema's defaults, then the params its rule gives the job (the stage's config
    block, `block`, by default the stage's name; for `rl` the variant's merged settings and its name; the seed).
    So a key added to a stage reaches every caller with its default."""
    block = block or module.__name__.rsplit(".", 1)[-1]
    if block == "dpo":  # a stage built on its own runs whether or not an experiment would hold it
        overrides = {"dpo": {}} | overrides
    if block == "rl":
        overrides = deep_merge({"rl": {"variants": {variant: {}}}}, overrides)
    config = validate_config(overrides, source="overrides")
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


# Says that a directory is alignpipe's: results_dir and launcher.checkpoint_dir must be new, empty or marked by it.
RESULTS_MARKER = ".alignpipe-results"
# Files alignpipe writes into results_dir itself (bench: the benches' models): no experiment may take their names.
RESULTS_FILES = ("mlflow.db", "mlartifacts", "bench", RESULTS_MARKER)


def results_root(config: dict) -> Path:
    """The results directory (`results_dir`, relative to the repository root unless absolute)."""
    root = Path(config["results_dir"])
    return (root if root.is_absolute() else REPO_ROOT / root).resolve()
