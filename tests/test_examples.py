"""The example cluster experiments in config/examples/ (issue #16), checked without a cluster, GPU or network.

For every file there:
  - it stands on its own: it validates read over the schema's defaults alone, as `snakemake --configfile` reads it
    (config/default.yaml, the demo, is not read), and gives every dataset its DAG's stages need;
  - every stage's job passes the launcher's own checks (launcher/resources.py: stage_resources, check_fits) with
    the params its rule hands the launcher, and with the slurm profile's resources;
  - its resources add up: the GPUs every role takes (`gpus_needed`) fill the job exactly, there is a core per GPU
    process, and the memory plan (launcher/memory.py) of every GPU job fits its fullest GPU (80 GB) and fullest node
    (the job's `mem_gb`);
  - Snakemake's dry run with the slurm profile plans every job: base_model, preprocess per dataset (sft, pairs,
    prompts), sft, reward_model, dpo per seed, rl per variant and seed, evaluate per model (and seed), report, and
    prints the memory plan, one row per GPU job, each fitting, in the order of the DAG's jobs. The examples let
    their jobs download (launcher.hub_downloads), so their hub ids pass uncached and the datasets' are not looked up;
    the model's config.json comes from a Hugging Face cache seeded with the published ones (tests/hub_configs.py), so
    the dry run works offline.
And one vLLM engine more than an example's GPUs hold is refused by check_fits, naming the GPUs.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hub_configs import HUB_CONFIGS, hf_env, hub_sizes, seed_hf_cache
from launcher.config import (REPO_ROOT, ConfigError, check_dag_data, dag_stages, load_config_files, method_seeds,
                             rl_variant, stage_jobs)
from launcher.memory import breakdown, memory_plan
from launcher.resources import LaunchConfigError, check_fits, gpus_needed, stage_resources
from pipeline_helpers import fake_slurm_commands
from runtime.user_data import is_hub

EXAMPLES = sorted((REPO_ROOT / "config" / "examples").glob("*.yaml"))
SLURM_PROFILE = REPO_ROOT / "cluster_profiles" / "slurm"
STAGES = ("base_model", "preprocess", "sft", "reward_model", "dpo", "rl", "evaluate", "report")
CPU_STAGES = ("base_model", "preprocess", "report")


# ---- What the launcher gets ------------------------------------------------------------------------------------

def load_example(path: Path, overrides: dict | None = None) -> dict:
    """The example alone (over the schema's defaults), as `snakemake --configfile <example>` reads it."""
    return load_config_files([path], overrides)


def profile_resources() -> dict:
    """The Snakemake resources the slurm profile gives every rule (its default-resources)."""
    profile = yaml.safe_load((SLURM_PROFILE / "config.yaml").read_text())
    return dict(profile.get("default-resources") or {})


def example_jobs() -> list:
    jobs = []
    for path in EXAMPLES:
        config = load_example(path)
        for stage, run_name, params in stage_jobs(config):
            if stage in CPU_STAGES:
                continue
            jobs.append(pytest.param(path, stage, run_name, id=f"{path.stem}:{run_name}"))
    return jobs


def job_params(path: Path, run_name: str) -> tuple[dict, str, dict]:
    config = load_example(path)
    stage, params = next((s, p) for s, r, p in stage_jobs(config) if r == run_name)
    return config, stage, params


# ---- The tests -------------------------------------------------------------------------------------------------

def test_the_8b_examples_exist():
    assert {"llama3-8b-ppo", "llama3-8b-grpo"} <= {p.stem for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_validates_on_its_own(path):
    config = load_example(path)
    check_dag_data(config, path.name)  # every dataset its stages read is given, none from the demo
    stages = dag_stages(config)
    assert stages["sft"] and stages["reward_model"] and stages["dpo"] and stages["variants"], stages
    assert stages["datasets"] == ["sft", "pairs", "prompts"]
    lines = path.read_text().splitlines()
    header = "\n".join(lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])
    command = f"snakemake --profile slurm all --configfile config/examples/{path.name}"
    assert command in header, f"{path.name} must start with a comment showing how to run it: {command}"
    assert config["experiment"] == path.stem
    assert is_hub(config["model"]["path"]) or Path(config["model"]["path"]).is_absolute(), \
        "model.path: a hub id or an absolute path on the cluster"
    assert config["model"]["path"] in HUB_CONFIGS, "add the model's config.json to tests/hub_configs.py"
    for role in ("sft", "preference", "prompts"):
        assert not config["data"][role]["path"].startswith("builtin:"), f"data.{role}: the demo's data is left over"
    launcher = config["launcher"]
    assert launcher["cluster"] == "slurm"
    assert launcher["checkpoint_dir"] and Path(launcher["checkpoint_dir"]).is_absolute(), \
        "launcher.checkpoint_dir: a shared filesystem (scratch), absolute"
    assert set(launcher["stages"]) == set(STAGES), "every stage's job is sized in launcher.stages"
    assert set(config["evaluate"]["models"]) == {"base", "sft", "dpo", *config["rl"]["variants"]}, \
        "every model of the experiment is evaluated"
    assert config["data"]["system_prompt"] is None, "the chat template's own system prompt, not the demo's"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_job_passes_the_launcher_checks(path):
    config = load_example(path)
    for stage, run_name, params in stage_jobs(config):
        for profile in ({}, profile_resources()):  # the config alone, and under the slurm profile
            resources, sources = stage_resources(stage, config["launcher"], profile)
            assert resources["cluster"] == "slurm", run_name
            check_fits(stage, params, resources, sources)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_gpus_per_role_fill_each_job(path):
    """GPU stages: the GPUs every role takes (one per DeepSpeed rank, frozen rank and engine GPU, one for the
    evaluation's scorer; the largest role's count where rl colocates) are exactly the job's, so no GPU is requested
    for nothing; a TP engine fits within a node; a core per GPU process. CPU stages: no GPU, one node."""
    config = load_example(path)
    for stage, run_name, params in stage_jobs(config):
        resources, _ = stage_resources(stage, config["launcher"], {})
        nodes, gpus = resources["nodes"], resources["gpus_per_node"]
        if stage in CPU_STAGES:
            assert (gpus, nodes) == (0, 1), f"{run_name}: a CPU job of one node"
            continue
        block = params[stage]
        assert gpus > 0, f"{run_name}: a GPU job"
        assert block.get("precision", "auto") in ("auto", "bf16")
        roles = gpus_needed(stage, block)
        colocated = stage == "rl" and block["colocate"]
        needed = max(roles.values()) if colocated else sum(roles.values())
        assert needed == nodes * gpus, (f"{run_name}: roles {roles} take {needed} GPUs "
                                        f"({'colocated' if colocated else 'summed'}), the job has {nodes} x {gpus}")
        if colocated:
            assert set(roles.values()) == {needed}, f"{run_name}: every colocated role spans all GPUs: {roles}"
        if "vllm" in block and nodes > 1:  # engines fill the GPUs in order: none may start on one node, end on another
            assert gpus % block["vllm"]["tensor_parallel_size"] == 0, f"{run_name}: an engine straddles two nodes"
        processes = (sum(roles.values()) if colocated else needed) / nodes
        assert resources["cpus_per_node"] >= processes, f"{run_name}: {processes:g} GPU processes per node"


@pytest.mark.parametrize("path,stage,run_name", example_jobs())
def test_memory_fits(path, stage, run_name):
    """The memory plan of one GPU job (launcher/memory.py, from the model's published config.json): its fullest GPU
    (launcher.gpu_memory_gb, 80) and its fullest node (HOST_USABLE of mem_gb) in every phase, and vLLM's KV cache."""
    config = load_example(path)
    job = next(job for job in memory_plan(config, sizes=hub_sizes(config)) if job.run_name == run_name)
    assert job.fits, (f"{path.name} {run_name}:\n  GPU, {job.gpu_phase}: {breakdown(job.gpu_items)} (of {job.gpu_gb:g})"
                      f"\n  node, {job.node_phase}: {breakdown(job.node_items)} (of {job.node_gb:.0f})\n  "
                      + "\n  ".join(job.notes))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_one_more_vllm_engine_is_refused(path):
    """The examples' engines fill their jobs' GPUs, so one engine more does not fit: check_fits refuses it before
    anything is queued, naming the GPUs needed and those of the job."""
    config = load_example(path)
    launcher = config["launcher"]
    engines = config["rl"]["vllm"]["num_engines"]
    bigger = load_example(path, {"rl": {"vllm": {"num_engines": engines + 1}}})
    resources, sources = stage_resources("rl", launcher, {})
    capacity = resources["nodes"] * resources["gpus_per_node"]
    for name in bigger["rl"]["variants"]:
        rl = rl_variant(bigger, name)
        needed = rl["vllm"]["num_engines"] * rl["vllm"]["tensor_parallel_size"]
        assert needed > capacity
        with pytest.raises(LaunchConfigError) as err:
            check_fits("rl", {"rl": rl, "variant": name, "seed": 0}, resources, sources)
        message = str(err.value)
        for fragment in (f"needs {needed} GPUs", f"vLLM {needed}", f"= {capacity}", "launcher.stages.rl.gpus_per_node",
                         "launcher.stages.rl.nodes"):
            assert fragment in message, (fragment, message)
    ev = config["evaluate"]["vllm"]
    resources, sources = stage_resources("evaluate", launcher, {})
    # The scorer runs after the engines, on their GPUs: engines on every GPU of the job fit, one more GPU does not.
    every_gpu = resources["nodes"] * resources["gpus_per_node"] // ev["tensor_parallel_size"]
    for engines, fits in ((every_gpu, True), (every_gpu + 1, False)):
        changed = load_example(path, {"evaluate": {"vllm": {"num_engines": engines}}})
        fit = lambda: check_fits("evaluate", {"evaluate": changed["evaluate"], "model": "sft", "seed": 0}, resources,
                                 sources)
        if fits:
            fit()
            continue
        with pytest.raises(LaunchConfigError, match=r"stage evaluate needs \d+ GPUs \(vLLM \d+, scorer 1; in turn"):
            fit()


def test_an_example_with_a_bad_key_is_refused(tmp_path):
    """The examples go through the same validation as any config: a misspelt stage in launcher.stages fails."""
    bad = tmp_path / "bad.yaml"
    config = yaml.safe_load(EXAMPLES[0].read_text())
    config["launcher"]["stages"]["ppo"] = config["launcher"]["stages"].pop("rl")
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="launcher.stages.ppo"):
        load_config_files([bad])


def dry_run(configfiles: list, results: Path, hf_home: Path, seed_cache: bool = True,
            profile: Path = SLURM_PROFILE) -> subprocess.CompletedProcess:
    """`snakemake --profile <profile> all --dry-run --configfile <configfiles>` from the repository root, results in
    `results`, offline, with a Hugging Face cache at `hf_home` seeded with the hub's config.json files
    (tests/hub_configs.py) or left empty. The checks before queueing want Slurm's commands where stages run on Slurm:
    stand-ins come first on PATH (the examples name no partition; nothing is submitted in a dry run)."""
    env = os.environ | (seed_hf_cache(hf_home) if seed_cache else hf_env(hf_home))
    env["PATH"] = f"{fake_slurm_commands(results.parent / 'slurm-commands')}:{env['PATH']}"
    return subprocess.run(
        [str(Path(sys.executable).with_name("snakemake")), "--profile", str(profile.relative_to(REPO_ROOT)), "all",
         "--dry-run", *(["--configfile", *map(str, configfiles)] if configfiles else []),
         "--config", f"results_dir={results}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)


def refused_jobs(output: str) -> set[str]:
    """The jobs a memory-plan refusal names (one line each, two spaces in)."""
    assert "jobs that do not fit their GPUs or nodes (the memory plan; nothing was queued)" in output, output[-4000:]
    return set(re.findall(r"^  ([\w/]+): ", output, re.M))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_dry_run_plans_every_job(path, tmp_path):
    """The example's dry run, with results in a temporary directory so that no earlier run is found: it plans every
    job and prints the memory plan, one row per GPU job, each fitting. Nothing is written there and no hub is
    asked."""
    config = load_example(path)
    results = tmp_path / "results"
    proc = dry_run([path], results, tmp_path / "hf")
    gpu_runs = [run for stage, run, _ in stage_jobs(config) if stage not in CPU_STAGES]
    assert not results.exists(), "a dry run writes nothing"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    seeds, variants = method_seeds(config), list(config["rl"]["variants"])
    runs = [(p["model"], p["seed"]) for stage, _, p in stage_jobs(config) if stage == "evaluate"]
    table = proc.stdout.split("Job stats:")[1]
    planned = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}
    assert planned == {"base_model": 1, "preprocess": 3, "sft": 1, "reward_model": 1, "dpo": len(seeds),
                       "rl": len(variants) * len(seeds), "evaluate": len(runs), "report": 1, "all": 1}, planned
    root = results / config["experiment"]
    outputs = {Path(m[1]).relative_to(root).as_posix() for m in re.finditer(r"^\s+output: (\S+)$", proc.stdout, re.M)}
    expected = {"base_model", "preprocess/sft", "preprocess/pairs", "preprocess/prompts", "sft", "reward_model",
                "report"} | {f"dpo/seed{s}" for s in seeds} | \
        {f"rl/{v}/seed{s}" for v in variants for s in seeds} | {f"evaluate/{mo}/seed{s}" for mo, s in runs}
    assert outputs == expected
    plan = proc.stderr.split("Memory plan")[1]
    assert re.findall(r"^  (\S+) .* yes$", plan, re.M) == gpu_runs, plan
