# Config validation, result paths and the launch command shared by every rule.
import json
import sys

sys.path.insert(0, workflow.basedir)
from stages.config import ConfigError, method_seeds, rl_variant, seeded_models, stage_code_hash, validate_config
from stages.data import PreferenceDataError, read_preference_file

try:
    _sources = [str(f) for f in workflow.configfiles] + (["--config"] if workflow.config_settings.config else [])
    _validated = validate_config(config, source=" + ".join(_sources) or "config")
    # Users' data is checked here too: a bad row stops the run before any stage is queued.
    for _key in ("preference_train_file", "preference_eval_file"):
        if _validated["data"][_key]:
            read_preference_file(_validated["data"][_key])
except (ConfigError, PreferenceDataError) as err:
    raise WorkflowError(str(err)) from None
config.clear()
config.update(_validated)

RESULTS = f"{config['results_dir']}/{config['experiment']}"
# The grid: every method (dpo, each rl variant) runs once per seed; the shared stages run once, with `seed`.
SEEDS = method_seeds(config)
SEEDED_MODELS = seeded_models(config)
# How stages are submitted and tracked: passed to the launcher, never part of a stage's cache key.
RUN_CONTEXT = json.dumps({key: config[key] for key in ("experiment", "results_dir", "launcher", "tracking")})
PYTHON = sys.executable
LAUNCH = "{PYTHON} -m stages.launcher {params.stage:q} {params.inputs:q} {output:q} --context {RUN_CONTEXT:q}"


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
            "run_name": "/".join([stage, *(f"seed{v}" if k == "seed" else v for k, v in wildcards.items())]),
            "config": selected | wild,
            "code": code,
        }, sort_keys=True)

    return key


def named_inputs(wildcards, input, resources):
    """A rule's `inputs` param, for the launcher: its named inputs, and the Snakemake resources of the job (what
    a profile's default-resources / set-resources give it: where and how big the job runs), as JSON. Computed
    from input and resources, so Snakemake's params trigger ignores it: where a stage runs never reruns it."""
    return json.dumps({"inputs": dict(input.items()),
                       "resources": {k: v for k, v in resources.items() if not k.startswith("_")}})
