# Config validation, result paths and the launch command shared by every rule.
import json
import re
import shlex
import sys
from pathlib import PurePosixPath

sys.path.insert(0, workflow.basedir)
from launcher.code_hash import stage_code_hash
from launcher.checks import check_before_queueing
from launcher.config import (ConfigError, benchmark_params, dag_stages, evaluate_params, method_seeds, preprocess_params,
                             read_config_file, report_params, rl_variant, seeded_models, stage_jobs, validate_config)
from runtime.rewards import is_remote
from runtime.user_data import DataError, ROLES, is_builtin, is_hub

try:
    _sources = [str(f) for f in workflow.configfiles] + (["--config"] if workflow.config_settings.config else [])
    _source = " + ".join(_sources) or "config"
    for _file in workflow.configfiles:  # Snakemake keeps the last of a key written twice: refused, with its line
        read_config_file(_file)
    _validated = validate_config(config, source=_source)
    # Every job's resources, the users' data and the batches it must fill: a bad one stops the run here, before
    # any stage is queued, not when its stage comes up hours later. The GPU jobs' memory plan comes back as a table.
    _memory_plan = check_before_queueing(_validated, _source, workflow.resource_settings)
except (ConfigError, DataError) as err:
    raise WorkflowError(str(err)) from None
if _memory_plan and workflow.output_settings.dryrun:  # (workflow.dryrun is known only once the DAG runs)
    print(_memory_plan, file=sys.stderr)
config.clear()
config.update(_validated)

RESULTS = f"{config['results_dir']}/{config['experiment']}"
# What the DAG holds (launcher/config.dag_stages), and the grid: every method (dpo, each rl variant) runs once per
# seed; the shared stages run once, with `seed`.
STAGES = dag_stages(config)
SEEDS = method_seeds(config)
SEEDED_MODELS = seeded_models(config)
RL_VARIANTS = STAGES["variants"]
# How stages are submitted and tracked: passed to the launcher, never part of a stage's cache key.
RUN_CONTEXT = {key: config[key] for key in ("experiment", "results_dir", "launcher", "tracking")}
# Which of the stages ready to start goes first (Snakemake starts the highest first; evaluate and report are 0): the
# training stages, longest-waited-on first, so that a DAG's last minutes are not one long RL run after the evaluations.
PRIORITY = {"sft": 4, "reward_model": 3, "rl": 2, "dpo": 1}
LAUNCH = "{params.launch} {params.stage:q} {params.job_io:q} {output:q} --log {log:q}"


def stage_key(stage, *keys, derive=None):
    """A rule's `stage` param, its cache key: the config subtrees the stage reads (`keys`, plus what
    `derive(wildcards)` picks), its wildcards (a `seed` wildcard replaces the shared seed) and the hash of its
    code and imports. (A param computed from `input` would be left out of Snakemake's params trigger.)"""
    code = stage_code_hash(stage)

    def key(wildcards):
        selected = {k: config[k] for k in keys} | (derive(wildcards) if derive else {})
        wild = dict(wildcards.items())
        if "seed" in wild:  # a grid run: its own seed, not the shared one
            wild["seed"] = int(wild["seed"])
        return json.dumps({
            "stage": stage,
            # e.g. evaluate/sft/seed0, rl/grpo/seed1: the path of the output under the experiment's results
            "run_name": str(PurePosixPath(stage, *(f"seed{v}" if k == "seed" else v for k, v in wildcards.items()))),
            "config": selected | wild,
            "code": code,
        }, sort_keys=True)

    return key


# The two params below are functions of `resources`, which Snakemake's params trigger leaves out (it counts them as
# derived, like those computed from `input`): where and how a stage runs, or where the venv lies, never reruns it.
def job_io(wildcards, input, resources):
    """A rule's `job_io` param, for the launcher, as JSON: its named inputs, the Snakemake resources of the job (what
    a profile's default-resources / set-resources give it: where and how big the job runs) and how to submit and
    track it (experiment, results_dir, launcher, tracking)."""
    return json.dumps({"inputs": dict(input.items()),
                       "resources": {k: v for k, v in resources.items() if not k.startswith("_")},
                       "context": RUN_CONTEXT})


def launch(wildcards, resources):
    """The launcher, run by the Python that runs this Snakemake (the project's pinned venv)."""
    return f"{shlex.quote(sys.executable)} -m launcher"


# Which files a rule reads, where the config picks them.
def dataset_files(wildcards):
    """The user's dataset files and directories (not built-in or hub datasets) of one preprocess job: a changed file
    reruns that job."""
    data = preprocess_params(config, wildcards.dataset)["data"]
    return [spec["path"] for spec in map(data.get, ROLES)
            if spec and spec["path"] and not is_builtin(spec["path"]) and not is_hub(spec["path"])]


def preprocessed(dataset):
    return f"{RESULTS}/preprocess/{dataset}"


def start_model(wildcards=None):
    """Where the methods and the reward model start: the SFT model, or the base model in a DAG without SFT."""
    return f"{RESULTS}/sft" if STAGES["sft"] else f"{RESULTS}/base_model"


def given_model(stage):
    """The model the config gives a stage instead of training one (`<stage>.from`), as its input `given`."""
    return lambda wildcards: {"given": config[stage]["from"]} if config[stage]["from"] else {}


def environment_input():
    """The environment file (environment.path) as the input `environment_file`, where the config gives one: a changed
    file reruns rl and evaluate."""
    return {"environment_file": config["environment"]["path"]} if config["environment"] else {}


def judge_input(rewards):
    """The judge's model as the input `judge_model` where one of `rewards` is judge: the base model, or judge.model's
    directory."""
    if "judge" not in rewards:
        return {}
    return {"judge_model": f"{RESULTS}/base_model" if config["judge"]["model"] == "base" else config["judge"]["model"]}


def evaluate_inputs(wildcards):
    """The reward model, judge model and reward files evaluate.rewards names (a reward service is no file), the SFT
    held-out rows (perplexity) if any, and the environment file if any."""
    rewards = config["evaluate"]["rewards"]
    return ({"reward_model": rules.reward_model.output[0]} if "model" in rewards else {}) | judge_input(rewards) | \
        {"reward_files": [r for r in rewards if r not in ("model", "judge") and not is_remote(r)]} | \
        ({"sft_data": preprocessed("sft")} if "sft" in STAGES["datasets"] else {}) | environment_input()


def rl_reward_inputs(wildcards):
    """The variant's reward (the reward model, the judge's model, or its reward file; none for a reward service, or
    reward null: the environment's step rewards or the teacher's alone), its teacher and the environment file if
    any."""
    variant = rl_variant(config, wildcards.variant)
    reward = variant["reward"]
    rewards = {"reward_model": rules.reward_model.output[0]} if reward == "model" else judge_input([reward]) | \
        ({"reward_file": reward} if reward and reward != "judge" and not is_remote(reward) else {})
    return rewards | ({"teacher": variant["teacher"]} if variant["teacher"] else {}) | environment_input()


def model_dir(wildcards):
    if wildcards.model in SEEDED_MODELS:
        return f"{RESULTS}/dpo/seed{wildcards.seed}" if wildcards.model == "dpo" else \
            f"{RESULTS}/rl/{wildcards.model}/seed{wildcards.seed}"
    return {"base": f"{RESULTS}/base_model", "sft": f"{RESULTS}/sft"}[wildcards.model]


def benchmark_inputs(wildcards):
    """The files a benchmark reads, where they are local: its dataset, its scorer file, its lm-eval task file or
    directory (a changed one reruns its jobs)."""
    bench = config["benchmarks"][wildcards.name]
    lm_eval = bench["lm_eval"] or {}
    files = [bench["path"]] if bench["path"] and not is_builtin(bench["path"]) and not is_hub(bench["path"]) else []
    files += [bench["scorer"]] if bench["scorer"].endswith(".py") else []
    files += [lm_eval["task"]] if lm_eval.get("task", "").endswith((".yaml", ".yml")) else []
    files += [lm_eval["include_path"]] if lm_eval.get("include_path") else []
    return {"benchmark_files": files} | (environment_input() if bench["environment"] else {})


def report_inputs(wildcards):
    """The outputs of every evaluation (in the order of evaluate.models) and training stage the DAG holds, by stage
    (launcher/config.stage_jobs); each names its MLflow run."""
    runs = {"evaluate": [], "sft": [], "reward_model": [], "dpo": [], "rl": [], "benchmark": []}
    for stage, run_name, _ in stage_jobs(config):
        runs.get(stage, []).append(f"{RESULTS}/{run_name}")
    return {"evaluations": runs.pop("evaluate"), "benchmarks": runs.pop("benchmark")} | runs
