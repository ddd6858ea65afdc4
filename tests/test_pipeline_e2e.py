"""The whole DAG on the tiny config, through the real parts; then what Snakemake plans after changes."""
import json
import re
from pathlib import Path

import pytest
import mlflow
from mlflow.tracking import MlflowClient

from pipeline_helpers import snakemake, write_config

pytestmark = pytest.mark.e2e
RM_ACCURACY_BAR = 0.55  # measured: 0.586 on 128 held-out pairs
DPO_MARGIN_BAR = 0.02  # measured: +0.060 held-out margin
RL_GAIN_BAR = 0.01  # measured: grpo +0.032, ppo +0.025 (vowel-fraction reward, 64 held-out samples)


def planned_jobs(dry_run_stdout: str) -> dict[str, int]:
    """The 'Job stats' table of `snakemake --dry-run`: rule -> count."""
    if "Nothing to be done" in dry_run_stdout:
        return {}
    table = dry_run_stdout.split("Job stats:")[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


def planned_outputs(dry_run_stdout: str) -> set[str]:
    """The output paths of the jobs a dry run plans, relative to the experiment's results."""
    return {m.group(1).split("/results/tiny/")[-1] for m in re.finditer(r"^\s+output: (\S+)$", dry_run_stdout, re.M)}


def test_outputs_and_metrics(tiny_run):
    results = tiny_run["results"]
    for split in ("sft_train", "sft_eval", "prompts_eval"):
        rows = [json.loads(line) for line in (results / "preprocess" / f"{split}.jsonl").read_text().splitlines()]
        assert rows and all({"prompt", "response", "label"} <= row.keys() for row in rows)
        assert all(row["prompt"].startswith("<|im_start|>user") for row in rows), "chat template not applied"
    stats = json.loads((results / "preprocess" / "stats.json").read_text())
    assert stats["rows_sft_train"] == 64 and stats["response_tokens_max"] <= 24

    sft = results / "sft"
    assert (sft / "model.safetensors").exists() and (sft / "config.json").exists()
    sft_metrics = json.loads((sft / "metrics.json").read_text())
    assert sft_metrics["steps"] == 16  # 64 rows / batch 8 * 2 epochs
    assert sft_metrics["eval_loss_after"] < sft_metrics["eval_loss_before"], "SFT did not lower held-out loss"

    base = json.loads((results / "evaluate" / "base" / "metrics.json").read_text())
    tuned = json.loads((results / "evaluate" / "sft" / "metrics.json").read_text())
    assert base["kl_to_reference"] == pytest.approx(0.0, abs=1e-6), "the base model is its own reference"
    assert tuned["kl_to_reference"] > 0.1
    assert tuned["perplexity"] < base["perplexity"]
    for metrics in (base, tuned):
        assert -1 <= metrics["reward_mean"] <= 1 and 0 < metrics["response_length"] <= 16
    samples = (results / "evaluate" / "sft" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 4

    report = (results / "report" / "report.md").read_text()
    assert "| base |" in report and "| sft |" in report and "| dpo |" in report
    assert f"{tuned['reward_mean']:.3f}" in report
    assert (results / "report" / "training_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(results.rglob("*.partial")), "a partial output was left behind"


def test_reward_model_beats_chance(tiny_run):
    results = tiny_run["results"]
    reward_model = json.loads((results / "reward_model" / "metrics.json").read_text())
    assert reward_model["eval_pairs"] == 128
    assert reward_model["eval_accuracy"] >= RM_ACCURACY_BAR, reward_model
    assert reward_model["reward_std"] > 0
    assert (results / "reward_model" / "model.safetensors").exists()
    config = json.loads((results / "reward_model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert f"{reward_model['eval_accuracy']:.3f}" in (results / "report" / "report.md").read_text()


def test_dpo_widens_held_out_margin(tiny_run):
    dpo = json.loads((tiny_run["results"] / "dpo" / "metrics.json").read_text())
    assert dpo["eval_margin_before"] == pytest.approx(0.0, abs=1e-6), "policy starts as its own reference"
    assert dpo["eval_margin"] > DPO_MARGIN_BAR, dpo
    assert dpo["eval_chosen_reward"] > dpo["eval_rejected_reward"]


@pytest.mark.parametrize("variant, estimator", [("grpo", "group_norm"), ("ppo", "gae")])
def test_rl_raises_held_out_reward(tiny_run, variant, estimator):
    results = tiny_run["results"]
    metrics = json.loads((results / "rl" / variant / "metrics.json").read_text())
    assert metrics["estimator"] == estimator and metrics["steps"] == 32
    assert metrics["eval_reward"] > metrics["eval_reward_before"] + RL_GAIN_BAR, metrics
    log = [json.loads(line) for line in (results / "rl" / variant / "train_log.jsonl").read_text().splitlines()]
    for key in ("reward_mean", "reward_std", "kl", "entropy", "clip_fraction", "response_length", "advantage_mean",
                "time_generate", "time_make_experience", "time_train", "time_weight_sync"):
        assert all(key in step for step in log), key
    assert log[-1]["kl"] > 0, "the policy moved away from the reference"
    if estimator == "gae":
        assert all("value_loss" in step for step in log)
    # Each step draws 8 prompts: two passes over the 128 prompts, each prompt once per pass.
    drawn = [p for step in log for p in step["prompt_ids"]]
    assert sorted(drawn[:128]) == sorted(drawn[128:]) == list(range(128))
    assert (results / "rl" / variant / "model.safetensors").exists()


def test_mlflow_runs(tiny_run):
    client = MlflowClient(tracking_uri=tiny_run["mlflow_uri"])
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("alignpipe.parent") == "true"]
    assert len(parents) == 1
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) == {"base_model", "preprocess", "sft", "reward_model", "dpo", "rl/grpo", "rl/ppo",
                             "evaluate/base", "evaluate/sft", "evaluate/dpo", "evaluate/grpo", "report"}
    sft = children["sft"]
    assert sft.info.status == "FINISHED"
    assert sft.data.params["sft.learning_rate"] == "0.001" and sft.data.params["sft.zero_stage"] == "2"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", sft.data.tags["git.commit"])
    assert sft.data.tags["git.dirty"] in ("true", "false")
    assert sft.data.tags["version.torch"].startswith("2.13.0")
    assert len(sft.data.tags["alignpipe.config_hash"]) == 16
    history = client.get_metric_history(sft.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 17))
    evaluated = children["evaluate/sft"].data.metrics
    on_disk = json.loads((tiny_run["results"] / "evaluate" / "sft" / "metrics.json").read_text())
    assert evaluated["reward_mean"] == pytest.approx(on_disk["reward_mean"])
    artifacts = {a.path for a in client.list_artifacts(children["evaluate/sft"].info.run_id)}
    assert {"config.json", "metrics.json", "samples.jsonl"} <= artifacts


def test_finished_run_plans_nothing(tiny_run):
    proc = snakemake(tiny_run["configfile"], "all", "--dry-run")
    assert planned_jobs(proc.stdout) == {}, proc.stdout[-3000:]


def test_changed_parameter_plans_stage_and_dependents(tiny_run):
    changed = write_config(tiny_run["root"] / "changed.yaml", tiny_run["root"] / "results",
                           sft={"learning_rate": 5e-4})
    proc = snakemake(changed, "all", "--dry-run")
    # SFT feeds the reward model, DPO and two evaluations; the base model's evaluation is untouched.
    assert planned_jobs(proc.stdout) == {"sft": 1, "reward_model": 1, "dpo": 1, "rl": 2, "evaluate": 3, "report": 1,
                                         "all": 1}, proc.stdout[-3000:]
    assert "evaluate/base" not in planned_outputs(proc.stdout) and "evaluate/sft" in planned_outputs(proc.stdout)
    changed_dpo = write_config(tiny_run["root"] / "changed_dpo.yaml", tiny_run["root"] / "results", dpo={"beta": 0.2})
    proc = snakemake(changed_dpo, "all", "--dry-run")
    assert planned_jobs(proc.stdout) == {"dpo": 1, "evaluate": 1, "report": 1, "all": 1}, proc.stdout[-3000:]
    assert planned_outputs(proc.stdout) == {"dpo", "evaluate/dpo", "report"}
    changed_eval = write_config(tiny_run["root"] / "changed_eval.yaml", tiny_run["root"] / "results",
                                evaluate={"temperature": 0.5})
    proc = snakemake(changed_eval, "all", "--dry-run")
    assert planned_jobs(proc.stdout) == {"evaluate": 4, "report": 1, "all": 1}, proc.stdout[-3000:]
    changed_ppo = write_config(tiny_run["root"] / "changed_ppo.yaml", tiny_run["root"] / "results",
                               rl={"variants": {"grpo": {"estimator": "group_norm"}, "ppo": {"estimator": "gae",
                                                                                              "clip_high": 0.28}}})
    proc = snakemake(changed_ppo, "all", "--dry-run")
    # One variant's hyperparameter: only that run and the report (ppo is not evaluated in the tiny config).
    assert planned_jobs(proc.stdout) == {"rl": 1, "report": 1, "all": 1}, proc.stdout[-3000:]
    assert planned_outputs(proc.stdout) == {"rl/ppo", "report"}


def test_failed_stage_reports_job_and_leaves_no_output(tmp_path):
    """A stage that fails inside its job: the terminal shows job id, log path and the error; no output."""
    configfile = write_config(tmp_path / "failing.yaml", tmp_path / "results", experiment="failing",
                              data={"num_train": 100000})
    proc = snakemake(configfile, "all", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    match = re.search(r"stage preprocess failed: job (\d+), state \w+, log (\S+)", output)
    assert match, output[-4000:]
    assert f"/logs/preprocess/" in match.group(2) and Path(match.group(2)).exists()
    assert "data.num_train" in output, "the stage's own error message must reach the terminal"
    results = tmp_path / "results" / "failing"
    assert (results / "base_model" / "config.json").exists()
    assert not (results / "preprocess").exists() and not (results / "preprocess.partial").exists()
