"""Config validation: bad keys, types and ranges stop the run before any stage starts, naming the key."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher.config import (REPO_ROOT, ConfigError, benchmark_params, check_dag_data, dag_stages, evaluate_params,
                             load_config_files, rl_variant, stage_jobs, validate_config)

GRPO = {"grpo": {"estimator": "group_norm"}}  # an rl variant: the schema's defaults have none (no RL)
IMDB = {"path": "builtin:imdb"}  # one dataset's block; within one config each role gets its own copy (dict(IMDB)):
# a mapping shared by two roles is filled with both roles' defaults (test_a_mapping_shared_by_two_datasets_...)


def test_defaults_fill_every_key():
    """The schema's defaults describe no task: no datasets, no DPO, no RL; evaluate.models and evaluate.rewards are
    resolved from what the DAG holds (only the base model, no rewards without RL)."""
    config = validate_config({})
    assert config["experiment"] == "experiment"
    assert config["sft"]["zero_stage"] == 2
    assert all(config["data"][role]["path"] is None for role in ("sft", "preference", "prompts", "eval"))
    assert config["dpo"] is None
    assert config["rl"]["variants"] == {} and config["rl"]["reward"] == "model"
    assert config["evaluate"]["models"] == ["base"] and config["evaluate"]["rewards"] == []
    assert config["launcher"]["cluster"] == "local"
    # a block given empty gets its defaults; the evaluation follows the models and rewards the DAG makes
    config = validate_config({"data": {"sft": {"path": "builtin:imdb"}}, "dpo": {},
                              "rl": {"variants": {"grpo": {"estimator": "group_norm"}}}})
    assert config["dpo"]["checkpoint_every"] == 0 and config["dpo"]["learning_rate"] == 5.0e-6
    assert config["evaluate"]["models"] == ["base", "sft", "dpo", "grpo"] and config["evaluate"]["rewards"] == ["model"]


def test_shipped_configs_are_valid():
    for path in sorted((REPO_ROOT / "config").glob("*.yaml")):
        load_config_files([path])


@pytest.mark.parametrize("raw, expected", [
    ({"sft": {"lerning_rate": 0.1}}, ["unknown key sft.lerning_rate", "learning_rate"]),
    ({"sedd": 1}, ["unknown key sedd", "seed"]),
    ({"sft": {"learning_rate": "fast"}}, ["sft.learning_rate", "wrong type", "number"]),
    ({"sft": {"zero_stage": 4}}, ["sft.zero_stage", "4", "[0, 1, 2, 3]"]),
    ({"sft": {"num_workers": 0}}, ["sft.num_workers", "out of range", "minimum"]),
    ({"evaluate": {"models": ["base", "gpt5"]}}, ["evaluate.models.1", "gpt5", "base"]),
    ({"data": {"sft": {"path": "builtin:imdb"}}, "sft": {"batch_size": 6, "micro_batch_size": 4, "num_workers": 1}},
     ["sft.batch_size", "multiple"]),
    ({"rl": {"variants": {"grpo": {"estimator": "group_norm", "n_samples": 1}}}},
     ["rl.variants.grpo", "n_samples >= 2"]),
    ({"rl": {"reward": "no/such/file.py", "variants": GRPO}},
     ["rl.variants.grpo.reward", "no/such/file.py", "reward_fn"]),
    ({"rl": {"variants": {"ppo": {"estimatr": "gae"}}}}, ["unknown key rl.variants.ppo.estimatr", "estimator"]),
    ({"rl": {"variants": GRPO}, "evaluate": {"models": ["base", "ppo"]}}, ["evaluate.models.1", "'ppo'", "grpo"]),
    ({"dpo": {"lora_rank": 8, "lora_targets": ["q_proj", "qkv"]}}, ["dpo.lora_targets", "qkv", "v_proj"]),
    ({"rl": {"variants": {"grpo": {"top_p": 0.9}}}}, ["rl.variants.grpo: top_p = 0.9", "whole vocabulary",
                                                      "set top_p: 1.0"]),
    # a reward of null (the environment's step rewards alone, or a teacher's) needs an environment or a teacher
    ({"rl": {"reward": None, "variants": GRPO}}, ["rl.reward = null", "needs an `environment` block",
                                                  "or rl.teacher", "give model, judge, a reward service's URL"]),
    ({"judge": {"template": "Rate {reply}"}, "rl": {"reward": "judge", "variants": GRPO}},
     ["rl.variants.grpo.reward (inherited from rl.reward) = judge", "judge.template has the placeholder {reply}",
      "{completion}"]),
    ({"judge": {"parser": {"min": 5, "max": 1}}, "evaluate": {"rewards": ["judge"]}},
     ["evaluate.rewards.0 = judge", "judge.parser.min (5) must be below judge.parser.max"]),
    ({"judge": {"model": "no/such/judge"}, "evaluate": {"rewards": ["judge"]}},
     ["judge.model = 'no/such/judge'", "not a Hugging Face"]),
    ({"rl": {"variants": {"distil": {"reward": None, "teacher": "no/such/teacher"}}}},
     ["rl.variants.distil.teacher = 'no/such/teacher'", "not a Hugging Face"]),
    ({"remote_reward": {"token_env": "ALIGNPIPE_NO_SUCH_TOKEN"}, "evaluate": {"rewards": ["http://127.0.0.1:9/score"]}},
     ["evaluate.rewards.0 = 'http://127.0.0.1:9/score'", "ALIGNPIPE_NO_SUCH_TOKEN", "not set"]),
    ({"rl": {"variants": {"grpo": {"reward": None}}}}, ["rl.variants.grpo.reward = null", "`environment` block"]),
    ({"environment": {"max_turns": 2}}, ["environment", "'path' is a required property"]),
    ({"environment": {"path": "env.py", "max_turns": 0}}, ["environment.max_turns", "out of range"]),
    ({"environment": {"path": "env.py", "timeout": 0}}, ["environment.timeout", "out of range"]),
    ({"environment": {"path": "env.py", "isolation": "fork"}}, ["environment.isolation", "['thread', 'process']"]),
    ({"environment": {"path": "env.py", "on_error": "retry"}}, ["environment.on_error", "['end', 'observe']"]),
    ({"environment": {"path": "env.py", "turns": 2}}, ["unknown key environment.turns", "max_turns"]),
    ({"benchmarks": {"calc": {"path": "builtin:arithmetic", "environment": True}}},
     ["benchmarks.calc.environment: true", "needs an `environment` block"]),
])
def test_bad_config_names_key_and_valid_values(raw, expected):
    with pytest.raises(ConfigError) as err:
        validate_config(raw, source="my.yaml")
    message = str(err.value)
    assert "my.yaml" in message
    for fragment in expected:
        assert fragment in message


def test_misspelt_key_fails_fast_through_snakemake(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"experiment": "bad", "results_dir": str(tmp_path / "results"),
                                   "sft": {"learnig_rate": 1e-4}}))
    start = time.time()
    proc = subprocess.run([str(Path(sys.executable).with_name("snakemake")), "--profile", "cluster_profiles/local",
                           "all", "--configfile", str(bad)], cwd=REPO_ROOT, capture_output=True, text=True)
    elapsed = time.time() - start
    assert proc.returncode != 0
    assert "sft.learnig_rate" in proc.stdout + proc.stderr
    assert str(bad) in proc.stdout + proc.stderr
    assert elapsed < 10, f"config error took {elapsed:.1f} s"
    assert not (tmp_path / "results").exists(), "nothing may run or be written for a bad config"


def test_code_hash_follows_imports_and_ignores_comments(tmp_path, monkeypatch):
    """A stage's code hash covers the project modules it imports (at the top or inside a function's blocks) and the
    in-job runner, parsed: not comments or docstrings, not modules it does not import, not the launcher."""
    import launcher.code_hash as code_hash
    root = tmp_path / "repo"
    sft = '"""{}"""\nfrom runtime import helper{}\n\n\ndef run():\n    """{}"""\n    try:\n        from runtime.other ' \
          'import thing\n    except ImportError:\n        pass\n'
    files = {"stages/sft.py": sft.format("SFT.", "", "Run."),
             "runtime/helper.py": "X = 1\n", "runtime/other.py": "from launcher import submit\nthing = 1\n",
             "runtime/job.py": "RUNNER = 1\n", "runtime/unrelated.py": "Y = 1\n", "launcher/submit.py": "Z = 1\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(code_hash, "REPO_ROOT", root)
    monkeypatch.setattr(code_hash, "JOB_RUNNER", root / "runtime" / "job.py")
    hashes = [code_hash.stage_code_hash("sft")]

    def edit(name: str, text: str) -> str:
        (root / name).write_text(text)
        hashes.append(code_hash.stage_code_hash("sft"))
        return hashes[-1]

    assert edit("runtime/unrelated.py", "Y = 2\n") == hashes[0]
    assert edit("launcher/submit.py", "Z = 2\n") == hashes[0]
    assert edit("stages/sft.py", sft.format("SFT, said otherwise.", "  # the helper\n# why", "Run it.")) == hashes[0]
    assert edit("runtime/other.py", "from launcher import submit\nthing = 2\n") != hashes[0]
    assert edit("runtime/helper.py", "X = 2\n") != hashes[-2]
    assert edit("runtime/job.py", "RUNNER = 2\n") != hashes[-2]


SAFETENSORS_FRAME = len(b"{}").to_bytes(8, "little") + b"{}"  # a safetensors file of no tensors: its header only


def broken(path: str, name: str, text: bytes) -> str:
    (Path(path) / name).write_bytes(text)
    return path


def fake_model_dir(path, weights: str = "model.safetensors", chat_template: bool = True, **config):
    """A directory that looks like a Hugging Face model to the config checks (they read only its small files)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"} | config))
    (path / weights).write_bytes(SAFETENSORS_FRAME)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"} if chat_template else {}))
    return str(path)


def reward_file(path, text):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("make, expected", [
    (lambda d: {"model": {"path": str(d / "missing")}}, ["model.path", "not a Hugging Face causal-LM directory"]),
    (lambda d: {"model": {"path": fake_model_dir(d / "m", weights="pytorch_model.bin")}}, ["no *.safetensors"]),
    (lambda d: {"model": {"path": fake_model_dir(d / "m", auto_map={"AutoModel": "x.Y"})}},
     ["own Python code", "trust_remote_code: true"]),
    (lambda d: {"model": {"path": fake_model_dir(d / "m", chat_template=False)}},
     ["has no chat template", "apply_chat_template: false", "input_template"]),
    (lambda d: {"model": {"path": fake_model_dir(d / "m")}, "data": {"sft": IMDB},
                "sft": {"lora_rank": 4, "lora_targets": ["q_proj"]}},
     ["sft.lora_targets ['q_proj']", "gpt2", "c_attn", "all-linear"]),
    (lambda d: {"sft": {"from": str(d / "nothing")}}, ["sft.from", "nothing"]),
    (lambda d: {"reward_model": {"from": fake_model_dir(d / "rm", id2label={"0": "a", "1": "b"})}},
     ["reward_model.from", "2 labels"]),
    (lambda d: {"evaluate": {"rewards": [reward_file(d / "r.txt", "")]}}, ["evaluate.rewards.0", "not a Python file"]),
    (lambda d: {"evaluate": {"rewards": [reward_file(d / "r.py", "def score(x): pass\n")]}},
     ["evaluate.rewards.0", "must define reward_fn"]),
    (lambda d: {"rl": {"reward": reward_file(d / "r.py", "def reward_fn(completions): pass\n"), "variants": GRPO}},
     ["rl.variants.grpo.reward", "reward_fn(completions)", "reward_fn(prompts, completions, labels)"]),
    (lambda d: {"rl": {"reward": reward_file(d / "r.py", "import no_such_module\n"), "variants": GRPO}},
     ["fails to import"]),
    (lambda d: {"data": {"input_template": "Q: {}\nA: "}}, ["input_template", "apply_chat_template: false"]),
    # a model directory's files that are not what their names say: named, with where they break
    (lambda d: {"model": {"path": broken(fake_model_dir(d / "m"), "config.json", b'{"model_type": "gpt2",}')}},
     ["model.path", "m/config.json is not valid JSON", "line 1 column 23"]),
    (lambda d: {"model": {"path": broken(fake_model_dir(d / "m"), "tokenizer_config.json", b"\xff\xfe")}},
     ["model.path", "m/tokenizer_config.json is not valid JSON"]),
    (lambda d: {"model": {"path": broken(fake_model_dir(d / "m"), "model.safetensors", b"PK\x03\x04 a zip")}},
     ["model.path", "m/model.safetensors is not a safetensors file"]),
    (lambda d: {"model": {"path": fake_model_dir(d / "m", n_positions=64)},
                "data": {"max_prompt_tokens": 16, "max_response_tokens": 16},
                "evaluate": {"max_new_tokens": 16},
                "rl": {"reward": reward_file(d / "r.py", SCORES), "max_new_tokens": 100, "variants": GRPO}},
     ["data.max_prompt_tokens + rl.variants.grpo.max_new_tokens = 16 + 100 tokens", "model.path's 64 positions"]),
])
def test_models_and_reward_files_are_checked_before_anything_runs(tmp_path, make, expected):
    with pytest.raises(ConfigError) as err:
        validate_config(make(tmp_path), source="my.yaml")
    for fragment in expected:
        assert fragment in str(err.value), str(err.value)


def test_lora_targets_of_the_models_architecture_pass(tmp_path):
    base = fake_model_dir(tmp_path / "m")  # sft, dpo and the reward model (evaluate.rewards: model) in the DAG
    validate_config({"model": {"path": base}, "data": {"sft": IMDB}, "evaluate": {"rewards": ["model"]},
                     "sft": {"lora_rank": 4, "lora_targets": ["c_attn", "c_fc"]},
                     "dpo": {"lora_rank": 4, "lora_targets": "all-linear"}, "reward_model": {"lora_rank": 4}})


# ---- config files: a key written twice ----------------------------------------------------------------------

@pytest.mark.parametrize("text, line, first, key", [
    ("experiment: a\nseed: 1\nexperiment: b\n", 3, 1, "experiment"),
    ("rl:\n  steps: 4\n  kl_coef: 0.01\n  steps: 8\n", 4, 2, "steps"),
    ("data:\n  prompts: {path: \"builtin:imdb\", path: \"builtin:arithmetic\"}\n", 2, 2, "path"),
], ids=["top-level", "nested", "flow-mapping"])
def test_a_key_written_twice_is_refused_naming_file_and_line(tmp_path, text, line, first, key):
    """PyYAML (and so Snakemake) would keep the last one silently; the file (of the files given) and the second key's
    line are named."""
    ok, path = tmp_path / "ok.yaml", tmp_path / "twice.yaml"
    ok.write_text("seed: 2\n")
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config_files([ok, path])
    message = str(err.value)
    assert message.startswith(f"{path}: line {line}: key {key!r} is written twice"), message
    assert f"first on line {first}" in message, message


def test_merge_keys_and_a_key_in_two_files_are_not_duplicates(tmp_path):
    """A YAML merge key (<<) and a key it brings in set again, and a key set by two files (the later wins): not a
    key written twice in one mapping."""
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("seed: 1\nsft: &trainer {zero_stage: 0, num_workers: 1}\n"
                     "dpo: {<<: *trainer, zero_stage: 1}\n")
    second.write_text("seed: 2\n")
    config = load_config_files([first, second])
    assert config["seed"] == 2
    assert (config["dpo"]["zero_stage"], config["dpo"]["num_workers"]) == (1, 1)


# ---- what the DAG holds --------------------------------------------------------------------------------------

def test_a_file_with_only_a_ppo_variant_plans_only_ppo(tmp_path):
    """rl.variants is the file's alone (no grpo from the demo or the schema): the DAG trains and evaluates ppo only,
    with the reward model its default reward (rl.reward: model) asks for, and no SFT or DPO."""
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump({"experiment": "ppo-only", "rl": {"variants": {"ppo": {"estimator": "gae"}}},
                                    "data": {"preference": dict(IMDB), "prompts": dict(IMDB)}}))
    config = load_config_files([path])
    check_dag_data(config, str(path))
    assert list(config["rl"]["variants"]) == ["ppo"]
    assert config["evaluate"]["models"] == ["base", "ppo"] and config["evaluate"]["rewards"] == ["model"]
    runs = [run for _, run, _ in stage_jobs(config)]
    assert runs == ["base_model", "preprocess/pairs", "preprocess/prompts", "reward_model", "rl/ppo/seed1234",
                    "evaluate/base/seed1234", "evaluate/ppo/seed1234", "report"]
    assert not any("grpo" in run for run in runs)
    report = next(params for stage, _, params in stage_jobs(config) if stage == "report")
    assert list(report["variants"]) == ["ppo"]
    assert report["stages"] == {"sft": False, "reward_model": True, "dpo": False}


@pytest.mark.parametrize("make, fragments", [
    (lambda d: {"dpo": {}, "data": {"eval": IMDB}},
     ["data.preference.path is not set, but dpo (the `dpo` block is present"]),
    (lambda d: {"rl": {"variants": GRPO}, "data": {"prompts": IMDB}},
     ["data.preference.path is not set, but the reward model (rl.variants.grpo.reward and evaluate.rewards score "
      "with `model`)"]),
    (lambda d: {"evaluate": {"rewards": ["model"]}, "data": {"eval": IMDB}},
     ["data.preference.path is not set, but the reward model (evaluate.rewards score with `model`)"]),
    (lambda d: {"rl": {"variants": GRPO, "reward": "config/rewards/sentiment.py"}, "data": {"eval": IMDB}},
     ["data.prompts.path is not set, but rl (rl.variants: grpo) needs it"]),
    (lambda d: {}, ["the evaluation needs prompts: set data.eval.path (or data.prompts.path"]),
    (lambda d: {"reward_model": {"from": fake_model_dir(d / "rm", id2label={"0": "score"})}, "data": {"eval": IMDB}},
     ["reward_model.from is given but nothing scores with `model`"]),
    (lambda d: {"dpo": {}, "rl": {"variants": GRPO}},  # every problem at once, each on its line
     ["data.preference.path is not set, but dpo", "data.preference.path is not set, but the reward model",
      "data.prompts.path is not set, but rl (rl.variants: grpo)", "the evaluation needs prompts"]),
], ids=["dpo-no-pairs", "rl-reward-model-no-pairs", "evaluate-reward-model-no-pairs", "rl-no-prompts",
        "no-eval-no-prompts", "reward-model-from-unused", "all-at-once"])
def test_a_dag_missing_its_data_is_refused_naming_the_key(tmp_path, make, fragments):
    config = validate_config(make(tmp_path), source="my.yaml")  # valid alone: the DAG's data is checked before queueing
    with pytest.raises(ConfigError) as err:
        check_dag_data(config, "my.yaml")
    message = str(err.value)
    assert message.startswith("the experiment's stages need data it does not give\n"), message
    for fragment in fragments:
        assert f"  my.yaml: {fragment}" in message, (fragment, message)
    assert len(message.splitlines()) == 1 + len(fragments), message


@pytest.mark.parametrize("raw", [
    {"data": {"eval": IMDB}},  # the base model alone, evaluated
    {"data": {"prompts": IMDB}},  # evaluated on the prompts' held-out share
    {"data": {"prompts": IMDB}, "rl": {"variants": GRPO, "reward": "config/rewards/sentiment.py"}},  # no reward model
    {"data": {"eval": dict(IMDB), "preference": dict(IMDB)}, "evaluate": {"rewards": ["model"]}},
], ids=["base-only", "prompts-only", "rl-reward-file", "reward-model-for-evaluation"])
def test_a_dag_with_the_data_it_reads_passes(raw):
    check_dag_data(validate_config(raw, source="my.yaml"), "my.yaml")


@pytest.mark.parametrize("raw, index, model, valid", [
    ({"rl": {"variants": GRPO}, "evaluate": {"models": ["base", "grpo", "dpo"]}}, 2, "dpo", ["base", "grpo"]),
    ({"dpo": {}, "evaluate": {"models": ["sft", "dpo"]}}, 0, "sft", ["base", "dpo"]),
    ({"data": {"sft": IMDB}, "evaluate": {"models": ["base", "sft", "grpo"]}}, 2, "grpo", ["base", "sft"]),
], ids=["dpo-without-its-block", "sft-without-its-data", "grpo-without-its-variant"])
def test_evaluating_a_model_the_dag_does_not_make_is_refused(raw, index, model, valid):
    with pytest.raises(ConfigError) as err:
        validate_config(raw, source="my.yaml")
    message = str(err.value)
    assert f"my.yaml: evaluate.models.{index} = {model!r} is not a model this experiment's DAG makes" in message
    assert f"valid: {valid}" in message, message


def test_a_mapping_shared_by_two_datasets_is_read_as_two(tmp_path):
    """A YAML anchor for two datasets (or a dict shared in Python) gives each role its own block and defaults."""
    path = tmp_path / "anchor.yaml"
    path.write_text('data:\n  preference: &imdb {path: "builtin:imdb"}\n  prompts: *imdb\n')
    config = load_config_files([path])
    assert config["data"]["preference"]["path"] == config["data"]["prompts"]["path"] == "builtin:imdb"
    assert "input_key" not in config["data"]["preference"] and "chosen_key" not in config["data"]["prompts"]


SCORES = "def reward_fn(prompts, completions, labels):\n    return [0.0] * len(completions)\n"


@pytest.mark.parametrize("at_import, fragments", [
    ("import os\nos._exit(0)\n", ["the process exited with status 0 before reward_fn was checked"]),
    ("import sys\nprint('bye')\nsys.exit(3)\n", ["exited with status 3", "its last output: bye"]),
    ("raise KeyboardInterrupt\n", ["was killed by signal 2"]),
    ("import time\ntime.sleep(1000)\n", ["its import did not finish within 3 s"]),
])
def test_a_reward_file_that_ends_or_hangs_its_import_is_refused(tmp_path, monkeypatch, at_import, fragments):
    """A reward file is imported in a child process with a time limit: what its import does ends the check, never
    the dry run, and the refusal names the key and the file."""
    from launcher import config as config_module
    monkeypatch.setattr(config_module, "REWARD_CHECK_S", 3)
    path = reward_file(tmp_path / "ends.py", at_import + SCORES)
    with pytest.raises(ConfigError) as err:
        validate_config({"rl": {"reward": path, "variants": GRPO}}, source="my.yaml")
    assert f"my.yaml: rl.variants.grpo.reward (inherited from rl.reward): {path}: " in str(err.value), str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_a_reward_file_is_called_on_the_experiments_first_prompts(tmp_path):
    """reward_fn is called once, as RL calls it, on the first 4 good rows of data.prompts (a chat's input as its
    last message's text, the labels of label_key) with made-up completions."""
    calls = tmp_path / "calls.json"
    path = reward_file(tmp_path / "recorded.py", f"import json\ndef reward_fn(prompts, completions, labels):\n"
                       f"    open({str(calls)!r}, 'w').write(json.dumps([prompts, completions, labels]))\n"
                       "    return [0.0] * len(completions)\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in [
        {"question": "2+2?", "answer": 4}, {"question": " ", "answer": 0},  # an empty input: not a prompt
        {"question": [{"role": "user", "content": "Hi."}, {"role": "user", "content": "3+2?"}], "answer": 5},
        {"question": "1+0?", "answer": 1}, {"question": "1+1?", "answer": 2}, {"question": "1+2?", "answer": 3}]))
    validate_config({"data": {"prompts": {"path": str(prompts), "input_key": "question", "label_key": "answer"}},
                     "rl": {"reward": path, "variants": GRPO}})
    assert json.loads(calls.read_text()) == [["2+2?", "3+2?", "1+0?", "1+1?"],
                                             ["42", "Yes.", "I liked this film.", "No"], [4, 5, 1, 2]]


def test_a_reward_file_is_imported_once_per_dry_run(tmp_path):
    """Two rl variants and the evaluation name one file: one import, in one child process."""
    from pipeline_helpers import snakemake, write_config
    imports = tmp_path / "imports.txt"
    path = reward_file(tmp_path / "counted.py", f"open({str(imports)!r}, 'a').write('x')\n" + SCORES)
    configfile = write_config(tmp_path / "c.yaml", tmp_path / "results", rl={"reward": path},
                              evaluate={"rewards": [path]})
    snakemake(configfile, "all", "--dry-run")
    assert imports.read_text() == "x"


ENVIRONMENT_DEFAULTS = {"max_turns": 4, "max_episode_tokens": 512, "max_env_tokens": 256, "timeout": 30,
                        "isolation": "thread", "concurrency": 32, "on_error": "end", "turn_rewards": False}


def test_an_environment_block_gets_its_defaults_and_reaches_rl_and_evaluate_only():
    """`environment` is null by default; a block with its path gets every other key's default, and is part of each
    rl variant's and each evaluation's params (their cache keys), and a benchmark's only where it plays episodes
    (benchmarks.<name>.environment). A reward of null with it: no reward model, no reward file, no column of the
    evaluation."""
    config = validate_config({})
    assert config["environment"] is None
    assert rl_variant(validate_config({"rl": {"variants": GRPO}}), "grpo")["environment"] is None
    assert evaluate_params(config)["environment"] is None
    config = validate_config({"environment": {"path": "envs/game.py", "max_turns": 2},
                              "rl": {"variants": {"grpo": {"reward": None}, "ppo": {"estimator": "gae"}}},
                              "benchmarks": {"math": {"path": "builtin:arithmetic"},
                                             "calc": {"path": "builtin:arithmetic", "environment": True}}})
    environment = {"path": "envs/game.py", **ENVIRONMENT_DEFAULTS, "max_turns": 2}
    assert config["environment"] == environment
    assert rl_variant(config, "grpo")["environment"] == environment and rl_variant(config, "grpo")["reward"] is None
    assert rl_variant(config, "ppo")["environment"] == environment and rl_variant(config, "ppo")["reward"] == "model"
    assert evaluate_params(config)["environment"] == environment
    assert benchmark_params(config, "math", "base", 0)["environment"] is None
    assert benchmark_params(config, "calc", "base", 0)["environment"] == environment
    assert config["evaluate"]["rewards"] == ["model"]  # (grpo's null is no column)
    assert dag_stages(config)["reward_model"]  # (ppo's reward is model)
    jobs = {run: params for _, run, params in stage_jobs(config)}
    assert jobs["rl/grpo/seed1234"]["rl"]["environment"] == environment
    assert jobs["evaluate/grpo/seed1234"]["evaluate"]["environment"] == environment
    assert jobs["benchmark/math/grpo/seed1234"]["environment"] is None
    assert all(v["environment"] == environment for v in jobs["report"]["variants"].values())
    # the environment's rewards alone: no reward model in the DAG, no rewards evaluated
    config = validate_config({"environment": {"path": "envs/game.py"}, "rl": {"reward": None, "variants": GRPO}})
    assert not dag_stages(config)["reward_model"] and config["evaluate"]["rewards"] == []
    from launcher.memory import check_memory
    check_memory(config, "c.yaml", lambda rule: {})  # (the memory plan reads reward null as no reward model)
