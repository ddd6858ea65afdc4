"""Config validation: bad keys, types and ranges stop the run before any stage starts, naming the key."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launcher.config import REPO_ROOT, ConfigError, load_config_files, validate_config


def test_defaults_fill_every_key():
    config = validate_config({})
    assert config["sft"]["zero_stage"] == 2
    assert config["evaluate"]["models"] == ["base", "sft", "dpo", "grpo"]
    assert config["rl"]["variants"] == {"grpo": {"estimator": "group_norm"}} and config["rl"]["reward"] == "model"
    assert config["dpo"]["checkpoint_every"] == 0 and config["dpo"]["learning_rate"] == 5.0e-6
    assert config["launcher"]["cluster"] == "local"


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
    ({"sft": {"batch_size": 6, "micro_batch_size": 4, "num_workers": 1}}, ["sft.batch_size", "multiple"]),
    ({"rl": {"variants": {"grpo": {"estimator": "group_norm", "n_samples": 1}}}}, ["rl.variants.grpo", "n_samples >= 2"]),
    ({"rl": {"reward": "no/such/file.py"}}, ["rl.variants.grpo.reward", "no/such/file.py", "reward_fn"]),
    ({"rl": {"variants": {"ppo": {"estimatr": "gae"}}}}, ["unknown key rl.variants.ppo.estimatr", "estimator"]),
    ({"evaluate": {"models": ["base", "ppo"]}}, ["evaluate.models.1", "'ppo'", "grpo"]),
    ({"dpo": {"lora_rank": 8, "lora_targets": ["q_proj", "qkv"]}}, ["dpo.lora_targets", "qkv", "v_proj"]),
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
    """A stage's code hash covers the project modules it imports and the in-job runner, parsed: not comments or
    docstrings, not modules it does not import, not the launcher."""
    import launcher.code_hash as code_hash
    root = tmp_path / "repo"
    files = {"stages/sft.py": '"""SFT."""\nfrom runtime import helper\nfrom runtime.other import thing\n',
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
    assert edit("stages/sft.py", '"""SFT, said otherwise."""\n# why\nfrom runtime import helper  # the helper\n'
                                 "from runtime.other import thing\n") == hashes[0]
    assert edit("runtime/other.py", "from launcher import submit\nthing = 2\n") != hashes[0]
    assert edit("runtime/helper.py", "X = 2\n") != hashes[-2]
    assert edit("runtime/job.py", "RUNNER = 2\n") != hashes[-2]


def fake_model_dir(path, weights: str = "model.safetensors", chat_template: bool = True, **config):
    """A directory that looks like a Hugging Face model to the config checks (they read only its small files)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"} | config))
    (path / weights).write_bytes(b"")
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
    (lambda d: {"model": {"path": fake_model_dir(d / "m")}, "sft": {"lora_rank": 4, "lora_targets": ["q_proj"]}},
     ["sft.lora_targets ['q_proj']", "gpt2", "c_attn", "all-linear"]),
    (lambda d: {"sft": {"from": str(d / "nothing")}}, ["sft.from", "nothing"]),
    (lambda d: {"reward_model": {"from": fake_model_dir(d / "rm", id2label={"0": "a", "1": "b"})}},
     ["reward_model.from", "2 labels"]),
    (lambda d: {"evaluate": {"rewards": [reward_file(d / "r.txt", "")]}}, ["evaluate.rewards.0", "not a Python file"]),
    (lambda d: {"evaluate": {"rewards": [reward_file(d / "r.py", "def score(x): pass\n")]}},
     ["evaluate.rewards.0", "must define reward_fn"]),
    (lambda d: {"rl": {"reward": reward_file(d / "r.py", "def reward_fn(completions): pass\n")}},
     ["rl.variants.grpo.reward", "reward_fn(completions)", "reward_fn(prompts, completions, labels)"]),
    (lambda d: {"rl": {"reward": reward_file(d / "r.py", "import no_such_module\n")}}, ["fails to import"]),
    (lambda d: {"data": {"input_template": "Q: {}\nA: "}}, ["input_template", "apply_chat_template: false"]),
])
def test_models_and_reward_files_are_checked_before_anything_runs(tmp_path, make, expected):
    with pytest.raises(ConfigError) as err:
        validate_config(make(tmp_path), source="my.yaml")
    for fragment in expected:
        assert fragment in str(err.value), str(err.value)


def test_lora_targets_of_the_models_architecture_pass(tmp_path):
    base = fake_model_dir(tmp_path / "m")
    validate_config({"model": {"path": base}, "sft": {"lora_rank": 4, "lora_targets": ["c_attn", "c_fc"]},
                     "dpo": {"lora_rank": 4, "lora_targets": "all-linear"}, "reward_model": {"lora_rank": 4}})
