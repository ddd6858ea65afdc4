"""Every check before queueing (issue #17): a bad input stops `snakemake --dry-run` at parse time, in seconds, naming
the key and where it came from, and nothing is written under results_dir. One test per class of bad input:
non-finite numbers, a float where an integer is meant, the launcher's resource checks of stages other than
base_model (config and profile resources), control characters in sbatch_extra, reward files (imported, and called
on the experiment's prompts), batches that the data cannot fill (rl rollout_batch_size, sft batch_size, dpo
batch_size), a key written twice in a config file, a stage whose dataset is not given, prompts that a local model's
tokenizer finds all too long, absurd mem_gb and steps, a partition the Slurm cluster does not have, and hub ids that
the offline jobs would not find in the Hugging Face cache (issue #25).
And what the DAG holds (issue #23): an experiment file stands on its own (a file
with only a ppo variant plans no grpo), and without --configfile the demo (config/default.yaml) is planned."""
import glob
import json
import os
import random
import re
import subprocess
import sys
import time

import pytest
import yaml

from hub_configs import cache_hub_dataset, cache_hub_model, hf_env
from launcher.checks import PROMPT_CHECK_ROWS, check_batches, check_prompt_lengths
from launcher.config import REPO_ROOT, ConfigError, check_dag_data, load_config_files, stage_jobs, validate_config
from runtime.builtin_data import review_pool_sizes
from runtime.job import set_job_env
from runtime.user_data import count_rows
from launcher.resources import LaunchConfigError, check_slurm_stages, check_stages, stage_resources
from pipeline_helpers import SNAKEMAKE, fake_slurm_commands, planned_jobs, planned_outputs, snakemake, write_config
from test_config import fake_model_dir
from test_user_data import write_rows

LIMIT_S = 10
CPUS, GPUS = len(os.sched_getaffinity(0)), len(glob.glob("/dev/nvidia[0-9]*"))  # this machine's, for the local executor


def refused(tmp_path, *args: str, **overrides) -> str:
    """Dry-run the tiny config with `overrides` (merged one level deep) as a user would; assert that it fails
    within LIMIT_S seconds and writes nothing under results_dir. Returns stdout + stderr."""
    results = tmp_path / "results"
    return refused_file(write_config(tmp_path / "bad.yaml", results, **overrides), results, *args)


def refused_file(configfile, results, *args: str) -> str:
    """refused() for a config file of one's own, its results under `results`."""
    start = time.monotonic()
    proc = snakemake(configfile, "all", "--dry-run", "--config", f"results_dir={results}", *args, check=False)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert elapsed < LIMIT_S, f"the refusal took {elapsed:.1f} s"
    assert not results.exists(), f"a refused config wrote {sorted(results.rglob('*'))}"
    assert "This was a dry-run" not in output
    return output


def test_non_finite_numbers_are_refused(tmp_path):
    output = refused(tmp_path, sft={"learning_rate": float("nan")}, rl={"kl_coef": float("inf")})
    assert "sft.learning_rate = nan is not a finite number" in output, output[-3000:]
    assert "rl.kl_coef = inf is not a finite number" in output
    assert "bad.yaml" in output  # the file it came from


def test_a_float_for_an_integer_is_refused(tmp_path):
    output = refused(tmp_path, dpo={"batch_size": 8.0})
    assert "dpo.batch_size = 8.0 is not an integer: write it without a decimal point (8)" in output, output[-3000:]
    assert "bad.yaml" in output


@pytest.mark.parametrize("overrides, fragments", [
    ({"launcher": {"stages": {"sft": {"nodes": 2}}}},
     ["stage sft: launcher.stages.sft.nodes = 2", "local executor"]),
    ({"launcher": {"stages": {"dpo": {"cpus_per_node": 1}}}},
     ["stage dpo: dpo.num_workers = 2 Ray actors", "x 1 CPUs (launcher.stages.dpo.cpus_per_node) = 1"]),
    ({"launcher": {"stages": {"evaluate": {"sbatch_extra": "--time=10"}}}},
     ["stage evaluate: launcher.stages.evaluate.sbatch_extra: --time is set by the launcher", "timeout_min"]),
    ({"launcher": {"stages": {"rl": {"gpus_per_node": 2}}}},  # colocated: 2 policy ranks, 1 engine of 1 GPU
     ["stages rl/grpo, rl/ppo: rl.colocate = true on GPUs", "rl.num_workers = 2, but rl.vllm.num_engines x "
      "rl.vllm.tensor_parallel_size = 1 x 1 = 1; set num_workers = 1 or vllm.num_engines = 2, or colocate: false"]),
    ({"launcher": {"cpus_per_node": 1000}},
     [f"launcher.cpus_per_node = 1000, but this machine, where the local executor runs the job, has {CPUS} CPUs"]),
    ({"launcher": {"stages": {"sft": {"gpus_per_node": GPUS + 2}}}},  # (sft's 2 ranks fit)
     [f"stage sft: launcher.stages.sft.gpus_per_node = {GPUS + 2}, but this machine", f"has {GPUS} GPUs"]),
    ({"launcher": {"mem_gb": 100000}},
     ["launcher.mem_gb = 100000, but this machine, where the local executor runs the job, has", "GB of memory",
      "mem_gb: null"]),
], ids=["sft-nodes-on-local", "dpo-workers-do-not-fit", "evaluate-sbatch-extra", "rl-colocated-ranks-not-engine-gpus",
        "more-cpus-than-this-machine", "more-gpus-than-this-machine", "more-memory-than-this-machine"])
def test_resource_errors_of_any_stage_are_refused(tmp_path, overrides, fragments):
    output = refused(tmp_path, **overrides)
    assert "jobs the launcher would refuse" in output and "bad.yaml" in output, output[-3000:]
    for fragment in fragments:
        assert fragment in output, (fragment, output[-3000:])


def test_profile_resources_are_checked_at_parse_time(tmp_path):
    """What --set-resources / a profile's set-resources give a rule is known before the job exists."""
    output = refused(tmp_path, "--set-resources", "reward_model:cpus_per_node=1")
    assert "stage reward_model: reward_model.num_workers = 2" in output, output[-3000:]
    assert "Snakemake resource `cpus_per_node` of rule reward_model (profile)" in output


@pytest.mark.parametrize("where, text", [
    ({"sbatch_extra": "--qos=high\n--comment=x"}, "launcher.sbatch_extra = '--qos=high\\n--comment=x'"),
    ({"stages": {"rl": {"sbatch_extra": "--qos=high\r"}}}, "launcher.stages.rl.sbatch_extra = '--qos=high\\r'"),
], ids=["newline", "carriage-return"])
def test_control_characters_in_sbatch_extra_are_refused(tmp_path, where, text):
    output = refused(tmp_path, launcher=where)
    assert text in output and "control character" in output, output[-3000:]


@pytest.mark.parametrize("reward, fragment", [
    ("reward.txt", "is not a Python file (.py)"),
    ("a_directory.py", "is a directory, not a Python file"),
    ("missing.py", "no such file"),
    ("no_fn.py", "must define reward_fn(prompts, completions, labels)"),
    ("signature.py", "reward_fn(completions) cannot be called as reward_fn(prompts, completions, labels)"),
    # called once on the first 4 of tiny's RL prompts (builtin:rotten_tomatoes), with made-up completions
    ("raises.py", "reward_fn raised KeyError: 'answer' (called on 4 prompts of data.prompts (builtin:rotten_tomatoes) "
                  "with made-up completions ['42', 'Yes.', 'I liked this film.', 'No'])"),
    ("nan.py", "reward_fn returned nan for completion 0 ('42'); every score must be a finite number"),
    ("count.py", "reward_fn returned 1 scores for 4 completions (called on 4 prompts of data.prompts"),
])
def test_reward_files_are_imported_and_checked(tmp_path, reward, fragment):
    files = tmp_path / "rewards"
    files.mkdir()
    (files / "reward.txt").write_text("def reward_fn(prompts, completions, labels): return [0.0] * len(completions)\n")
    (files / "a_directory.py").mkdir()
    (files / "no_fn.py").write_text("def score(prompts, completions, labels): pass\n")
    (files / "signature.py").write_text("def reward_fn(completions): pass\n")
    for name, scores in (("raises.py", "[{}['answer'] for c in completions]"),
                         ("nan.py", "[float('nan')] * len(completions)"), ("count.py", "[1.0]")):
        (files / name).write_text(f"def reward_fn(prompts, completions, labels):\n    return {scores}\n")
    output = refused(tmp_path, rl={"reward": str(files / reward)})
    assert f"rl.variants.grpo.reward (inherited from rl.reward): {files / reward}" in output, output[-3000:]
    assert fragment in output, output[-3000:]


ENVIRONMENT = ("class Environment:\n    def reset(self, prompt, label, seed):\n        return prompt\n"
               "    def step(self, reply):\n        return 'done', 1.0, True\n")


@pytest.mark.parametrize("environment, fragment", [
    ("missing.py", "no such file"),
    ("environment.txt", "is not a Python file (.py)"),
    ("no_class.py", "must define class Environment"),
    ("no_step.py", "Environment has no method step"),
    ("signature.py", "cannot be called as reset(prompt, label, seed)"),
    ("fails.py", "fails to import: ZeroDivisionError"),
    ("exits.py", "the process exited with status 3 before class Environment was checked"),
])
def test_environment_files_are_imported_and_checked(tmp_path, environment, fragment):
    """environment.path is loaded as the rl and evaluate stages load it (runtime/environments.load_environment), in
    a child process, before anything is queued; the refusal names the key and the file."""
    files = tmp_path / "environments"
    files.mkdir()
    (files / "environment.txt").write_text(ENVIRONMENT)
    (files / "no_class.py").write_text("class Env:\n    pass\n")
    (files / "no_step.py").write_text("class Environment:\n    def reset(self, prompt, label, seed):\n        pass\n")
    (files / "signature.py").write_text(ENVIRONMENT.replace("reset(self, prompt, label, seed)", "reset(self)"))
    (files / "fails.py").write_text("1 / 0\n" + ENVIRONMENT)
    (files / "exits.py").write_text("import sys\nsys.exit(3)\n")
    output = refused(tmp_path, environment={"path": str(files / environment)},
                     rl={"variants": {"grpo": {"reward": None}}})
    assert f"environment.path: {files / environment}" in output, output[-3000:]
    assert fragment in output, output[-3000:]


def test_an_environment_is_an_input_of_rl_and_evaluate(tmp_path):
    """The environment file is an input of every rl and evaluate job (a changed file reruns them); a variant whose
    reward is null reads no reward file and needs no reward model."""
    results = tmp_path / "results"
    environment = tmp_path / "game.py"
    environment.write_text(ENVIRONMENT)
    configfile = write_config(tmp_path / "env.yaml", results, environment={"path": str(environment)},
                              rl={"reward": None, "variants": {"grpo": {"estimator": "group_norm"}}},
                              evaluate={"models": ["base", "sft", "grpo"], "rewards": ["config/rewards/sentiment.py"]},
                              dpo=None)
    proc = snakemake(configfile, "all", "--dry-run", "--config", f"results_dir={results}", "--printshellcmds")
    jobs = planned_jobs(proc.stdout)
    assert "reward_model" not in jobs and jobs["rl"] == 2 and jobs["evaluate"] == 4, proc.stdout[-3000:]
    inputs = {rule: [m.group(1) for m in re.finditer(rf"^rule {rule}:\n\s+input: (.*)$", proc.stdout, re.M)]
              for rule in ("rl", "evaluate", "benchmark")}
    assert len(inputs["rl"]) == 2 and len(inputs["evaluate"]) == 4, proc.stdout[-3000:]
    assert all(str(environment) in line for line in inputs["rl"] + inputs["evaluate"])
    assert not any("vowel_fraction" in line for line in inputs["rl"])
    assert not results.exists()


def test_two_reward_files_of_one_name_are_refused(tmp_path):
    """Each reward is a column of the results, named after its file: two files named alike would share one."""
    other = tmp_path / "rw" / "sentiment.py"
    other.parent.mkdir()
    other.write_text("def reward_fn(prompts, completions, labels):\n    return [0.0] * len(completions)\n")
    output = refused(tmp_path, evaluate={"rewards": ["config/rewards/sentiment.py", str(other)]})
    assert (f"evaluate.rewards: 'config/rewards/sentiment.py' and '{other}' would both be the results' column "
            "'sentiment'") in output, output[-3000:]


def test_rollout_batch_over_the_prompts_is_refused(tmp_path):
    # tiny: 128 prompts (data.prompts.max_samples) and an eval dataset, so all 128 are training prompts
    output = refused(tmp_path, rl={"rollout_batch_size": 160, "batch_size": 16})
    assert "rl.rollout_batch_size (variants grpo, ppo) = 160 is larger than the training prompts" in output, \
        output[-3000:]
    assert "at most 128" in output and "data.prompts.max_samples = 128" in output


def test_sft_batch_over_its_rows_is_refused(tmp_path):
    """A local file of 12 rows: 10 train (2 held out, eval_fraction 0.2), fewer than a batch of 16. The dataset's
    rows pass check_datasets, whose record of that is not written since the run is refused."""
    rows = tmp_path / "sft.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i}"}) + "\n" for i in range(12)))
    output = refused(tmp_path, sft={"batch_size": 16, "micro_batch_size": 4},
                     data={"sft": {"path": str(rows), "max_samples": 384, "eval_fraction": 0.2}})
    assert "sft.batch_size = 16 is larger than the training rows the data can give: at most 10" in output, \
        output[-3000:]
    assert "12 rows in the file" in output and "less 2 held out" in output


def test_dpo_batch_over_the_pairs_is_refused(tmp_path):
    # tiny: 1152 pairs less 128 held out (eval_fraction 0.1112) = 1024 training pairs
    output = refused(tmp_path, dpo={"batch_size": 2048})
    assert "dpo.batch_size = 2048 is larger than the training pairs the data can give: at most 1024" in output, \
        output[-3000:]


def test_a_key_written_twice_is_refused_with_its_file_and_line(tmp_path):
    """Snakemake's YAML keeps the last of a key written twice; the workflow reads each --configfile again and refuses
    it, naming the file and both lines (load_config_files alike: tests/test_config.py)."""
    results = tmp_path / "results"
    configfile = write_config(tmp_path / "twice.yaml", results)
    lines = configfile.read_text().splitlines()
    first = lines.index("experiment: tiny") + 1
    configfile.write_text("\n".join(lines + ["experiment: tiny-again"]) + "\n")
    output = refused_file(configfile, results)
    message = (f"{configfile}: line {len(lines) + 1}: key 'experiment' is written twice in one mapping (first on line "
               f"{first}); write it once")
    assert message in output, output[-3000:]


def test_a_stage_without_its_dataset_is_refused(tmp_path):
    """check_dag_data, first of the checks before queueing: tiny without prompts, which its rl variants read."""
    output = refused(tmp_path, data={"prompts": {"path": None}})
    assert "the experiment's stages need data it does not give" in output, output[-3000:]
    assert "bad.yaml + --config: data.prompts.path is not set, but rl (rl.variants: grpo, ppo) needs it" in output


def word_model(path) -> str:
    """A model directory whose tokenizer.json counts words (one token each), for the checks of a local model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    directory = fake_model_dir(path)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "word": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return directory


def test_prompts_all_longer_than_max_prompt_tokens_are_refused(tmp_path):
    """A local model's tokenizer counts the prompts of a local dataset: none of 20 (the shortest 21 words) fits 16
    tokens, which preprocess would find only after base_model ran. Two that fit (rows 30 and 40: the check reads on
    until then) pass; so do rows past what the check reads (PROMPT_CHECK_ROWS), which it cannot judge."""
    prompts = write_rows(tmp_path / "long.jsonl", [{"prompt": "word " * (21 + i)} for i in range(20)])
    overrides = {"model": {"path": word_model(tmp_path / "model")},
                 "data": {"max_prompt_tokens": 16, "prompts": {"path": str(prompts), "max_samples": 128}}}
    output = refused(tmp_path, **overrides)
    assert (f"data.prompts.path = '{prompts}': 0 of the 20 rows preprocess reads (data.prompts.max_samples = 128) "
            "have a prompt within data.max_prompt_tokens = 16, and it needs 2; the shortest is 21 tokens") in output, \
        output[-3000:]
    write_rows(prompts, [{"prompt": "word " * (3 if i in (30, 40) else 21)} for i in range(50)])
    config = load_config_files([write_config(tmp_path / "good.yaml", tmp_path / "results", **overrides)])
    check_prompt_lengths(config, "good.yaml")
    write_rows(prompts, [{"prompt": "word " * 21}] * (PROMPT_CHECK_ROWS + 1))
    config["data"]["prompts"]["max_samples"] = PROMPT_CHECK_ROWS + 1
    check_prompt_lengths(config, "good.yaml")
    config["data"]["prompts"]["max_samples"] = PROMPT_CHECK_ROWS
    with pytest.raises(ConfigError, match=f"0 of the {PROMPT_CHECK_ROWS} rows preprocess reads"):
        check_prompt_lengths(config, "good.yaml")


@pytest.mark.parametrize("overrides, args, fragment", [
    ({"launcher": {"mem_gb": 0.001}}, (), "launcher.mem_gb = 0.001 is out of range; valid: {'minimum': 1}"),
    ({"launcher": {"stages": {"rl": {"mem_gb": 0.5}}}}, (),
     "launcher.stages.rl.mem_gb = 0.5 is out of range; valid: {'minimum': 1}"),
    ({}, ("--set-resources", "dpo:mem_gb=0"),  # (Snakemake's resources are whole numbers)
     "Snakemake resource `mem_gb` of rule dpo (profile) = 0 is not valid: expected a number of GB >= 1"),
    ({"rl": {"steps": 1000000000000}}, (),
     "rl.steps = 1000000000000 is out of range; valid: {'minimum': 1, 'maximum': 1000000}"),
], ids=["mem-gb", "stage-mem-gb", "profile-mem-gb", "steps"])
def test_absurd_memory_and_steps_are_refused(tmp_path, overrides, args, fragment):
    output = refused(tmp_path, *args, **overrides)
    assert fragment in output, output[-3000:]


def test_a_partition_slurm_does_not_have_is_refused(tmp_path, monkeypatch):
    """Stages on Slurm: sbatch and sinfo must be on PATH, and each partition named one of the cluster's (stand-ins
    for Slurm's commands here; tests/slurm runs the real ones)."""
    monkeypatch.setenv("PATH", f"{fake_slurm_commands(tmp_path / 'bin', 'debug*,cpu')}:{os.environ['PATH']}")
    output = refused(tmp_path, launcher={"cluster": "slurm", "partition": "cpu",
                                         "stages": {"rl": {"partition": "gpux"}}})
    assert ("jobs Slurm cannot take (nothing was queued)\n  stages rl/grpo, rl/ppo: launcher.stages.rl.partition = "
            "'gpux' is not a partition of this Slurm cluster; its partitions: debug, cpu") in output, output[-3000:]


def test_slurm_commands_and_a_cluster_that_does_not_answer(tmp_path, monkeypatch):
    config = validate_config({"launcher": {"cluster": "slurm", "stages": {"sft": {"partition": "gpu,cpu"}}},
                              "data": {"sft": {"path": "builtin:imdb"}}})
    jobs = lambda: stage_jobs(config)
    monkeypatch.setenv("PATH", str(fake_slurm_commands(tmp_path / "up", "debug*,gpu,cpu")))
    assert check_slurm_stages(jobs(), config["launcher"]) == []
    monkeypatch.setenv("PATH", str(fake_slurm_commands(tmp_path / "down", sinfo_fails=True)))
    assert check_slurm_stages(jobs(), config["launcher"]) == [
        "stage sft: cannot check the partitions they name (gpu, cpu): `sinfo` failed (exit status 1): sinfo: error: "
        "Unable to contact slurm controller (connect failure)"]
    (tmp_path / "down" / "sbatch").unlink()
    problems = check_slurm_stages(jobs(), config["launcher"])
    assert problems == ["stages base_model, preprocess, sft, evaluate, report: launcher.cluster = slurm, but `sbatch` "
                        "is not on this machine's PATH; run where Slurm's commands are (a login node), or set "
                        "cluster: local"], problems
    local = validate_config({})
    assert check_slurm_stages(stage_jobs(local), local["launcher"]) == []  # local stages need no Slurm


# ---- hub ids: in the Hugging Face cache, or downloads allowed ------------------------------------------------------

HUB_MODEL, HUB_PROMPTS = "someorg/tiny-chat", "someorg/PromptSet"  # nothing of these names is here
HUB_ROWS = [{"prompt": f"Say the number {i}.", "label": str(i)} for i in range(8)]


def hub_experiment(tmp_path, monkeypatch, **launcher) -> tuple:
    """The tiny experiment with a hub model and hub RL prompts, and a Hugging Face cache of its own (empty, offline)
    for the dry runs: (config file, its results, HF_HOME)."""
    hf = tmp_path / "hf"
    for key, value in hf_env(hf).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    results = tmp_path / "results"
    configfile = write_config(tmp_path / "hub.yaml", results, model={"path": HUB_MODEL}, launcher=launcher, data={
        "prompts": {"path": HUB_PROMPTS, "max_samples": 128, "label_key": "label"}})
    return configfile, results, hf


def test_hub_ids_not_in_the_cache_are_refused(tmp_path, monkeypatch):
    """launcher.hub_downloads false (the default): the jobs run offline on the Hugging Face cache, so a hub model
    without a snapshot there that holds config.json and safetensors weights, and a hub dataset that `datasets` has not
    prepared there, are refused by the dry run, each naming its key, the id, where it was looked for and how to get it
    there. Once both are there, as huggingface_hub and `datasets` leave them, the dry run passes, and the preprocess
    job's load_records, offline, reads the dataset's rows from there."""
    configfile, results, hf = hub_experiment(tmp_path, monkeypatch)
    output = refused_file(configfile, results)
    assert ("hub ids the jobs would not find: they run offline (launcher.hub_downloads: false) on the Hugging Face "
            "cache, and nothing was downloaded or queued") in output, output[-3000:]
    assert (f"hub.yaml + --config: model.path = '{HUB_MODEL}': no snapshot of it with config.json and *.safetensors "
            f"weights in the Hugging Face cache ({hf / 'hub'}); download it there first, on a machine with network "
            f"and the same HF_HOME: hf download {HUB_MODEL}") in output, output[-3000:]
    assert (f"hub.yaml + --config: data.prompts.path = '{HUB_PROMPTS}': not in the `datasets` cache "
            f"({hf / 'datasets' / 'someorg___prompt_set'}, all that load_dataset reads offline; `hf download` does "
            "not fill it); load it there once, on a machine with network and the same HF_HOME: python -c \"import "
            f"datasets; datasets.load_dataset('{HUB_PROMPTS}', split='train')\"") in output, output[-3000:]
    assert ("valid: a local path that exists, a hub id already in the cache (as above), or launcher.hub_downloads: "
            "true to let the stages download (their nodes need network)") in output
    cache_hub_model(hf, HUB_MODEL, {"model_type": "llama"})  # config.json alone: base_model would find no weights
    cache_hub_dataset(hf, HUB_PROMPTS, HUB_ROWS)
    output = refused_file(configfile, results)
    assert f"model.path = '{HUB_MODEL}'" in output and "data.prompts.path" not in output, output[-3000:]
    cache_hub_model(hf, HUB_MODEL, {"model_type": "llama"}, weights=True)
    snakemake(configfile, "all", "--dry-run", "--config", f"results_dir={results}")
    assert not results.exists()
    spec = load_config_files([configfile])["data"]["prompts"]
    read = ("import json, os, sys\nfrom runtime.job import set_job_env\nset_job_env(os.environ, hub_downloads=False)\n"
            "from runtime.user_data import load_records\nprint(json.dumps(load_records(json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", read, json.dumps(spec)], cwd=REPO_ROOT, capture_output=True,
                          text=True, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == HUB_ROWS


def test_with_hub_downloads_hub_ids_not_in_the_cache_pass(tmp_path, monkeypatch):
    """launcher.hub_downloads: true lets the stages download: the same hub ids, in an empty cache, pass the dry run,
    and nothing is downloaded at parse time (the cache stays empty)."""
    configfile, results, hf = hub_experiment(tmp_path, monkeypatch, hub_downloads=True)
    proc = snakemake(configfile, "all", "--dry-run", "--config", f"results_dir={results}")
    assert planned_jobs(proc.stdout)["base_model"] == 1, proc.stdout[-3000:]
    assert not hf.exists() and not results.exists()


def test_jobs_run_offline_unless_the_config_allows_downloads(tmp_path):
    """set_job_env, the first thing a StageJob does: the hub's offline switches are on by default, so that
    huggingface_hub and `datasets` ask the hub nothing; with launcher.hub_downloads they are off, also where the
    submitting shell turned one on; the rest of the environment stays."""
    switches = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    shell = {key: value for key, value in os.environ.items() if key not in switches} | {"HF_HOME": str(tmp_path),
                                                                                      "HF_HUB_OFFLINE": "1"}
    offline, online = dict(shell), dict(shell)
    set_job_env(offline, hub_downloads=False)
    set_job_env(online, hub_downloads=True)
    assert [offline.get(key) for key in switches] == ["1", "1", "1"], offline
    assert not set(switches) & set(online), online
    assert online["HF_HOME"] == str(tmp_path) and online["TOKENIZERS_PARALLELISM"] == "false"
    says = ("import datasets, huggingface_hub.constants as hub\n"
            "print(hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)")
    for env, expected in ((offline, ["True", "True"]), (online, ["False", "False"])):
        proc = subprocess.run([sys.executable, "-c", says], env=env, capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.split() == expected, proc.stdout + proc.stderr[-2000:]


# ---- what the DAG holds ----------------------------------------------------------------------------------------

def test_a_file_with_only_a_ppo_variant_plans_only_ppo(tmp_path):
    """A file stands on its own: no grpo comes from the demo (Snakemake would merge rl.variants over its), no SFT
    or DPO since the file asks for neither; the reward model is there because ppo's reward is `model`."""
    results = tmp_path / "results"
    configfile = tmp_path / "ppo.yaml"
    configfile.write_text(yaml.safe_dump({
        "experiment": "ppo-only", "model": {"source": "tiny"},
        "data": {"preference": {"path": "builtin:imdb"}, "prompts": {"path": "builtin:imdb"}},
        "rl": {"variants": {"ppo": {"estimator": "gae"}}}}))
    proc = snakemake(configfile, "all", "--dry-run", "--config", f"results_dir={results}")
    assert planned_jobs(proc.stdout) == {"base_model": 1, "preprocess": 2, "reward_model": 1, "rl": 1, "evaluate": 2,
                                         "report": 1, "all": 1}, proc.stdout[-3000:]
    assert planned_outputs(proc.stdout, "ppo-only") == {
        "base_model", "preprocess/pairs", "preprocess/prompts", "reward_model", "rl/ppo/seed1234",
        "evaluate/base/seed1234", "evaluate/ppo/seed1234", "report"}
    assert "grpo" not in proc.stdout + proc.stderr
    assert not results.exists()


def test_without_a_configfile_the_demo_is_planned(tmp_path):
    """`snakemake all` with no --configfile reads config/default.yaml: its whole DAG."""
    results = tmp_path / "results"
    proc = subprocess.run([SNAKEMAKE, "--profile", "cluster_profiles/local", "all", "--dry-run",
                           "--config", f"results_dir={results}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert planned_jobs(proc.stdout) == {"base_model": 1, "preprocess": 3, "sft": 1, "reward_model": 1, "dpo": 1,
                                         "rl": 1, "evaluate": 4, "report": 1, "all": 1}, proc.stdout[-3000:]
    assert planned_outputs(proc.stdout, "imdb-positive") == {
        "base_model", "preprocess/sft", "preprocess/pairs", "preprocess/prompts", "sft", "reward_model",
        "dpo/seed1234", "rl/grpo/seed1234", *(f"evaluate/{model}/seed1234" for model in ("base", "sft", "dpo", "grpo")),
        "report"}
    assert re.search(rf"output: {re.escape(str(results))}/imdb-positive/report$", proc.stdout, re.M)
    assert not results.exists()


# ---- the same checks without Snakemake --------------------------------------------------------------------

SHIPPED = sorted((REPO_ROOT / "config").glob("*.yaml")) + \
    sorted((REPO_ROOT / "config" / "examples").glob("*.yaml"))  # each file alone, as --configfile reads it


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_shipped_configs_pass_every_check(path):
    config = load_config_files([path])
    check_dag_data(config, path.name)
    assert check_stages(stage_jobs(config), config["launcher"]) == []
    check_batches(config, "shipped")


def test_profile_integers_are_whole_and_finite():
    launcher = validate_config({})["launcher"]
    assert stage_resources("sft", launcher, {"nodes": " 1 "})[0]["nodes"] == 1
    for value in (2.0, "2.0", float("inf"), float("nan"), "1e3", True):
        with pytest.raises(LaunchConfigError, match=r"timeout_min.* whole number >= 1"):
            stage_resources("sft", launcher, {"timeout_min": value})
    with pytest.raises(LaunchConfigError, match=r"partition.*control character.*\\x00"):
        stage_resources("sft", launcher, {"partition": "gpu\x00"})


def test_integer_keys_anywhere_refuse_floats_and_numbers_keep_ints():
    with pytest.raises(ConfigError, match=r"launcher.stages.sft.nodes = 2.0 is not an integer"):
        validate_config({"launcher": {"stages": {"sft": {"nodes": 2.0}}}})
    with pytest.raises(ConfigError, match=r"seeds.1 = 1.5 is not an integer"):
        validate_config({"seeds": [0, 1.5]})
    validate_config({"sft": {"learning_rate": 1}, "launcher": {"mem_gb": 8}})  # an int is a number


def test_review_pool_sizes_follow_the_builtin_data():
    """The row counts of a built-in movie-review dataset, computed without building its rows, match
    runtime/builtin_data's rows: same seeded split, same length filter."""
    from runtime.builtin_data import load_reviews, split_review
    for seed, prompt_words in ((0, 4), (3, 30)):
        reviews = load_reviews("rotten_tomatoes")
        random.Random(seed).shuffle(reviews)
        held_out, train = reviews[:len(reviews) // 5], reviews[len(reviews) // 5:]
        pools = {"sft": [r for r in train if r["label"] == 1], "prompts": train[:len(train) // 2],
                 "preference": train[len(train) // 2:], "eval": held_out}
        expected = {role: sum(1 for r in pool if split_review(r, prompt_words)) for role, pool in pools.items()}
        assert review_pool_sizes("rotten_tomatoes", seed, prompt_words) == expected


def test_local_row_counts(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n\n{"x": 2}\n{"x": 3}\n')
    (tmp_path / "b.csv").write_text('prompt,response\n"multi\nline",b\nc,d\n')
    spec = {"split": "train"}
    assert count_rows(tmp_path / "a.jsonl", spec) == 3
    assert count_rows(tmp_path / "b.csv", spec) == 2
    import datasets
    table = datasets.Dataset.from_list([{"prompt": str(i)} for i in range(7)])
    table.to_parquet(str(tmp_path / "c.parquet"))
    table.save_to_disk(str(tmp_path / "d"))
    datasets.DatasetDict({"train": table, "test": table.select(range(2))}).save_to_disk(str(tmp_path / "e"))
    assert count_rows(tmp_path / "c.parquet", spec) == 7
    assert count_rows(tmp_path / "d", spec) == 7
    assert count_rows(tmp_path / "e", spec) == 7 and count_rows(tmp_path / "e", {"split": "test"}) == 2


# ---- where results go --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, fragments", [
    (lambda d: {"results_dir": "/"}, ["results_dir = '/'", "system or home directory"]),
    (lambda d: {"results_dir": "/etc"}, ["results_dir = '/etc'", "system or home directory"]),
    (lambda d: {"results_dir": "config"}, ["results_dir = 'config'", "a folder of the repository", "results/"]),
    (lambda d: {"results_dir": str(REPO_ROOT)}, ["a folder of the repository"]),
    (lambda d: {"results_dir": str(d / "mine")}, ["holds files that alignpipe did not write", ".alignpipe-results"]),
    (lambda d: {"launcher": {"checkpoint_dir": "/"}}, ["launcher.checkpoint_dir = '/'", "system or home directory"]),
    (lambda d: {"experiment": "mlflow.db"}, ["experiment = 'mlflow.db' is the name of a file of results_dir"]),
])
def test_results_and_checkpoint_directories_must_be_alignpipes(tmp_path, make, fragments):
    """A stage replaces its output directory: results_dir and checkpoint_dir are new, empty or alignpipe's. Nothing
    is written anywhere, the user's own files (here a folder with a notes file) stay."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    overrides = make(tmp_path)
    configfile = write_config(tmp_path / "bad.yaml", overrides.pop("results_dir", tmp_path / "results"), **overrides)
    proc = snakemake(configfile, "all", "--dry-run", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and all(f in output for f in fragments), output[-3000:]
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    assert not (tmp_path / "results").exists()


def test_a_results_directory_alignpipe_wrote_is_taken_and_home_is_expanded(tmp_path, monkeypatch):
    from launcher.checks import check_output_dirs
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / "other-experiment").mkdir()
    (marked / ".alignpipe-results").touch()
    check_output_dirs(validate_config({"results_dir": str(marked)}), "test")
    benched = tmp_path / "benched"  # what `make bench-grpo` leaves in results/ before any experiment ran
    (benched / "bench" / "smollm2-135m-instruct").mkdir(parents=True)
    check_output_dirs(validate_config({"results_dir": str(benched)}), "test")
    monkeypatch.setenv("HOME", str(tmp_path))
    config = validate_config({"results_dir": "~/alignpipe-results", "launcher": {"checkpoint_dir": "~/ckpt"}})
    assert config["results_dir"] == str(tmp_path / "alignpipe-results")
    assert config["launcher"]["checkpoint_dir"] == str(tmp_path / "ckpt")
    check_output_dirs(config, "test")


def test_a_stage_never_replaces_a_directory_it_did_not_write(tmp_path):
    """An output directory in the way that no stage wrote (no stage.json) stays, and the stage does not run."""
    import types
    from runtime.job import StageJob
    output = tmp_path / "results" / "tiny" / "sft"
    output.mkdir(parents=True)
    (output / "thesis.tex").write_text("mine")

    def run(cfg, inputs, out, tracker):
        raise AssertionError("the stage ran")

    stage = types.SimpleNamespace(Config=types.SimpleNamespace(from_params=lambda params: None), run=run)
    job = StageJob(stage="sft", run_name="sft", params={"seed": 0}, inputs={}, output=str(output), experiment="tiny",
                   tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", resources={"cluster": "local"},
                   checkpoint_dir=str(tmp_path / "ckpt"), hub_downloads=False)
    with pytest.raises(RuntimeError, match="no stage wrote it"):
        job.run_driver(stage)
    assert [p.name for p in output.iterdir()] == ["thesis.tex"] and not output.with_name("sft.partial").exists()
