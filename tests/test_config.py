"""Config validation: bad keys, types and ranges stop the run before any stage starts, naming the key."""
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from stages.config import REPO_ROOT, ConfigError, load_config_files, stage_code_hash, validate_config


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


def test_code_hash_follows_imports(tmp_path, monkeypatch):
    """A stage's cache key covers the project modules it imports, not only its own file."""
    import stages.config as config_module
    fake_root = tmp_path / "repo"
    (fake_root / "stages").mkdir(parents=True)
    for name in ("launcher.py", "__init__.py"):
        (fake_root / "stages" / name).write_text("")
    (fake_root / "stages" / "sft.py").write_text("from stages import helper\nfrom stages.other import thing\n")
    (fake_root / "stages" / "helper.py").write_text("X = 1\n")
    (fake_root / "stages" / "other.py").write_text("thing = 1\n")
    (fake_root / "stages" / "unrelated.py").write_text("Y = 1\n")
    monkeypatch.setattr(config_module, "REPO_ROOT", fake_root)
    before = stage_code_hash("sft")
    (fake_root / "stages" / "unrelated.py").write_text("Y = 2\n")
    assert stage_code_hash("sft") == before
    (fake_root / "stages" / "other.py").write_text("thing = 2\n")
    after_other = stage_code_hash("sft")
    assert after_other != before
    (fake_root / "stages" / "helper.py").write_text("X = 2\n")
    assert stage_code_hash("sft") != after_other
