"""The whole DAG on the tiny config, through the real parts; then what Snakemake plans after changes."""
import csv
import json
import math
import re
import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from pipeline_helpers import dry_run_with_edited_code, planned_jobs, planned_outputs, snakemake, write_config

pytestmark = pytest.mark.e2e
RM_ACCURACY_BAR = 0.6  # measured: 0.672 on 128 held-out pairs
DPO_MARGIN_BAR = 0.05  # measured: +0.166 and +0.162 held-out margin (seeds 0 and 1)
RL_GAIN_BAR = 0.01  # measured, mean of seeds 0 and 1: grpo +0.040, ppo +0.034 (vowel-fraction reward, 64 samples)


def test_outputs_and_metrics(tiny_run):
    results = tiny_run["results"]
    for dataset, split, keys in (("sft", "sft_train", {"prompt", "response"}), ("sft", "sft_eval", {"prompt", "response"}),
                                 ("prompts", "prompts_eval", {"prompt", "input", "label"})):
        rows = [json.loads(line) for line in (results / "preprocess" / dataset / f"{split}.jsonl").read_text().splitlines()]
        assert rows and all(keys <= row.keys() for row in rows)
        assert all(row["prompt"].startswith("<|im_start|>user") for row in rows), "chat template not applied"
    stats = {dataset: json.loads((results / "preprocess" / dataset / "stats.json").read_text())
             for dataset in ("sft", "pairs", "prompts")}  # one job per dataset
    assert stats["sft"]["rows_sft_train"] == 64 and stats["sft"]["rows_sft_eval"] == 16
    assert stats["sft"]["sft_response_tokens_max"] <= 24 and set(stats["sft"]) == {
        "rows_sft_train", "rows_sft_eval", "sft_rows_read", "sft_prompt_tokens_mean", "sft_prompt_tokens_max",
        "sft_response_tokens_mean", "sft_response_tokens_max", "sft_truncated_response"}
    assert stats["pairs"]["rows_pairs_eval"] == 128 and stats["prompts"]["rows_prompts_train"] == 128

    sft = results / "sft"
    assert (sft / "model.safetensors").exists() and (sft / "config.json").exists()
    sft_metrics = json.loads((sft / "metrics.json").read_text())
    assert sft_metrics["steps"] == 16  # 64 rows / batch 8 * 2 epochs
    assert sft_metrics["eval_loss_after"] < sft_metrics["eval_loss_before"], "SFT did not lower held-out loss"

    base = json.loads((results / "evaluate" / "base" / "seed0" / "metrics.json").read_text())
    tuned = json.loads((results / "evaluate" / "sft" / "seed0" / "metrics.json").read_text())
    assert base["kl_to_reference"] == pytest.approx(0.0, abs=1e-6), "the base model is its own reference"
    assert tuned["kl_to_reference"] > 0.1
    assert tuned["perplexity"] < base["perplexity"]
    for metrics in (base, tuned):
        assert -1 <= metrics["reward_mean"] <= 1 and 0 < metrics["response_length"] <= 16
    samples = (results / "evaluate" / "sft" / "seed0" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 4

    report = (results / "report" / "report.md").read_text()
    assert "| base | 1 |" in report and "| sft | 1 |" in report and "| dpo | 2 |" in report
    assert f"| sft | 1 | {tuned['reward_mean']:.3f} |" in report
    # The DAG that ran, in the report and in MLflow: every stage present, sft and the reward model trained.
    assert "Stages: base_model, preprocess, sft, reward_model, dpo, rl (grpo, ppo), evaluate, report." in report
    assert "Reward model: trained on the pairs of `builtin:rotten_tomatoes`" in report
    assert not list(results.rglob("*.partial")), "a partial output was left behind"
    assert (results.parent / ".alignpipe-results").exists(), "results_dir is marked as alignpipe's"


# What a good run may still print that says "warning" or "error": Snakemake 9's own complaint at its exit (not ours
# to silence). Everything else of that kind is a bug, or a line to add to launcher/submit.QUIET_LINES with why.
ALLOWED_IN_A_GOOD_RUN = re.compile(r"RuntimeWarning: coroutine '.*' was never awaited|Enable tracemalloc to get")


def test_a_good_run_prints_no_warning_or_error(tiny_run):
    """The whole tiny DAG's terminal output: no WARNING or ERROR line (the stages' logs keep vLLM's and DeepSpeed's
    notices of a CPU build; the terminal gets what asks something of the user)."""
    output = tiny_run["proc"].stdout + tiny_run["proc"].stderr
    flagged = [line for line in output.splitlines()
               if re.search(r"warn|error", line, re.I) and not ALLOWED_IN_A_GOOD_RUN.search(line)]
    assert not flagged, "\n".join(flagged[:30])


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


@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_widens_held_out_margin(tiny_run, seed):
    run_dir = tiny_run["results"] / "dpo" / f"seed{seed}"
    dpo = json.loads((run_dir / "metrics.json").read_text())
    first = json.loads((run_dir / "train_log.jsonl").read_text().splitlines()[0])
    # The first step's loss is taken before any update: the policy starts as its own reference.
    assert first["margin"] == pytest.approx(0.0, abs=1e-6) and first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert dpo["eval_margin"] > DPO_MARGIN_BAR, dpo
    assert dpo["eval_chosen_reward"] > dpo["eval_rejected_reward"]


@pytest.mark.parametrize("variant, estimator", [("grpo", "group_norm"), ("ppo", "gae")])
def test_rl_raises_held_out_reward(tiny_run, variant, estimator):
    results = tiny_run["results"]
    gains = []
    for seed in (0, 1):
        run_dir = results / "rl" / variant / f"seed{seed}"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["estimator"] == estimator and metrics["steps"] == 32
        gains.append(metrics["eval_reward"] - metrics["eval_reward_before"])
        log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
        for key in ("reward_mean", "reward_std", "kl", "entropy", "clip_fraction", "response_length",
                    "advantage_mean", "time_generate", "time_make_experience", "time_train", "time_weight_sync"):
            assert all(key in step for step in log), key
        assert log[-1]["kl"] > 0, "the policy moved away from the reference"
        if estimator == "gae":
            assert all("value_loss" in step for step in log)
        # Each step draws 8 prompts: two passes over the 128 prompts, each prompt once per pass.
        drawn = [p for step in log for p in step["prompt_ids"]]
        assert sorted(drawn[:128]) == sorted(drawn[128:]) == list(range(128))
        assert (run_dir / "model.safetensors").exists()
    assert sum(gains) / len(gains) > RL_GAIN_BAR, gains


def mlflow_children(tiny_run) -> dict:
    """The experiment's child runs by name."""
    client = MlflowClient(tracking_uri=tiny_run["mlflow_uri"])
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("alignpipe.parent") == "true"]
    assert len(parents) == 1
    return {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}


def test_mlflow_runs(tiny_run):
    client = MlflowClient(tracking_uri=tiny_run["mlflow_uri"])
    children = mlflow_children(tiny_run)
    grid = [f"{method}/seed{seed}" for method in ("dpo", "rl/grpo", "rl/ppo", "evaluate/dpo")
            for seed in (0, 1)]
    assert set(children) == {"base_model", "preprocess/sft", "preprocess/pairs", "preprocess/prompts", "sft",
                             "reward_model", "evaluate/base/seed0", "evaluate/sft/seed0", "report", *grid}
    assert json.loads(children["report"].data.tags["alignpipe.dag"]) == {
        "stages": {"sft": True, "reward_model": True, "dpo": True}, "given": {"sft": None, "reward_model": None},
        "variants": ["grpo", "ppo"]}
    sft = children["sft"]
    assert sft.info.status == "FINISHED"
    assert sft.data.params["sft.learning_rate"] == "0.001" and sft.data.params["sft.zero_stage"] == "2"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", sft.data.tags["git.commit"])
    assert sft.data.tags["git.dirty"] in ("true", "false")
    assert sft.data.tags["version.torch"].startswith("2.13.0")
    assert len(sft.data.tags["alignpipe.config_hash"]) == 16
    history = client.get_metric_history(sft.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 17))
    assert children["rl/ppo/seed1"].data.params["seed"] == "1" and children["dpo/seed0"].data.params["seed"] == "0"
    evaluated = children["evaluate/sft/seed0"].data.metrics
    on_disk = json.loads((tiny_run["results"] / "evaluate" / "sft" / "seed0" / "metrics.json").read_text())
    assert evaluated["reward_mean"] == pytest.approx(on_disk["reward_mean"])
    artifacts = {a.path for a in client.list_artifacts(children["evaluate/sft/seed0"].info.run_id)}
    assert {"config.json", "metrics.json", "samples.jsonl"} <= artifacts


def test_grid_tables_equal_mlflow(tiny_run):
    """dpo x 2 seeds (and grpo and ppo x 2 in the RL table): a row per method, mean ± std equal to MLflow's."""
    children = mlflow_children(tiny_run)
    report = tiny_run["results"] / "report"
    for table, prefix, methods, keys in (
            ("results.csv", "evaluate/", {"base": 1, "sft": 1, "dpo": 2},
             ["reward_sentiment", "reward_reward_model", "kl_to_reference", "perplexity", "response_length"]),
            ("rl.csv", "rl/", {"grpo": 2, "ppo": 2}, ["eval_reward", "eval_reward_before", "final_kl"])):
        rows = list(csv.DictReader((report / table).open()))
        assert [(r["method"], int(r["seeds"])) for r in rows] == list(methods.items()), table
        for row in rows:
            runs = [children[f"{prefix}{row['method']}/seed{seed}"] for seed in range(methods[row["method"]])]
            assert row["mlflow_run_ids"].split() == [r.info.run_id for r in runs]
            for key in keys:
                values = [r.data.metrics[key] for r in runs]
                assert float(row[f"{key}_mean"]) == pytest.approx(statistics.fmean(values), rel=1e-12), (table, key)
                if len(values) > 1:
                    assert float(row[f"{key}_std"]) == pytest.approx(statistics.stdev(values), rel=1e-12)
                else:
                    assert row[f"{key}_std"] == ""
            if len(runs) > 1:  # (the tiny model's sentiment reward is the same for every seed, its KL is not)
                assert any(float(row[f"{key}_std"]) > 0 for key in keys), "the seeds' runs agree exactly"
    tex = (report / "results.tex").read_text()
    assert "\\begin{tabular}" in tex and "dpo & 2 & $" in tex and "\\pm" in tex
    assert children["evaluate/dpo/seed1"].info.run_id in tex
    md = (report / "results.md").read_text()
    assert "| dpo | 2 |" in md and children["evaluate/dpo/seed0"].info.run_id[:8] in md


def test_figures_and_provenance(tiny_run):
    children = mlflow_children(tiny_run)
    report = tiny_run["results"] / "report"
    provenance = json.loads((report / "provenance.json").read_text())
    for name in ("reward_vs_step", "kl_reward_frontier", "training_curves"):
        image = Image.open(report / f"{name}.png")
        assert image.size[0] >= 500, name
        source = json.loads(image.text["Description"])
        assert source == provenance[f"{name}.png"]
        for run in source["mlflow_runs"]:
            assert children[run["run_name"]].info.run_id == run["run_id"]
            assert children[run["run_name"]].data.tags["alignpipe.config_hash"] == run["config_hash"]
        assert source["git_commits"] == sorted({children[r["run_name"]].data.tags["git.commit"]
                                                for r in source["mlflow_runs"]})
        assert (report / f"{name}.pdf").read_bytes().startswith(b"%PDF")
    assert {r["run_name"] for r in provenance["reward_vs_step.png"]["mlflow_runs"]} == {
        f"rl/{v}/seed{s}" for v in ("grpo", "ppo") for s in (0, 1)}


def test_snakemake_html_report(tiny_run):
    html = tiny_run["root"] / "report.html"
    snakemake(tiny_run["configfile"], "--report", str(html))
    text = html.read_text()
    for expected in ("reward_vs_step.png", "kl_reward_frontier.png", "results.csv", "rulegraph",
                     "a dot per seed and the"):
        assert expected in text, expected


def test_finished_run_plans_nothing(tiny_run):
    proc = snakemake(tiny_run["configfile"], "all", "--dry-run")
    assert planned_jobs(proc.stdout) == {}, proc.stdout[-3000:]


def test_changed_parameter_plans_stage_and_dependents(tiny_run):
    changed = write_config(tiny_run["root"] / "changed.yaml", tiny_run["root"] / "results",
                           sft={"learning_rate": 5e-4})
    proc = snakemake(changed, "all", "--dry-run")
    # SFT feeds the reward model, DPO and RL (2 seeds each) and every evaluation (each scores with the reward model,
    # evaluate.rewards); the base model and the preprocessed data are untouched.
    assert planned_jobs(proc.stdout) == {"sft": 1, "reward_model": 1, "dpo": 2, "rl": 4, "evaluate": 4, "report": 1,
                                         "all": 1}, proc.stdout[-3000:]
    assert "evaluate/sft/seed0" in planned_outputs(proc.stdout)
    changed_dpo = write_config(tiny_run["root"] / "changed_dpo.yaml", tiny_run["root"] / "results", dpo={"beta": 0.2})
    proc = snakemake(changed_dpo, "all", "--dry-run")
    assert planned_outputs(proc.stdout) == {"dpo/seed0", "dpo/seed1", "evaluate/dpo/seed0", "evaluate/dpo/seed1",
                                            "report"}, proc.stdout[-3000:]
    changed_eval = write_config(tiny_run["root"] / "changed_eval.yaml", tiny_run["root"] / "results",
                                evaluate={"temperature": 0.5})
    proc = snakemake(changed_eval, "all", "--dry-run")
    assert planned_jobs(proc.stdout) == {"evaluate": 4, "report": 1, "all": 1}, proc.stdout[-3000:]
    changed_ppo = write_config(tiny_run["root"] / "changed_ppo.yaml", tiny_run["root"] / "results",
                               rl={"variants": {"grpo": {"estimator": "group_norm"}, "ppo": {"estimator": "gae",
                                                                                              "clip_high": 0.28}}})
    proc = snakemake(changed_ppo, "all", "--dry-run")
    # One method's hyperparameter: only that method's runs and the report (the tiny config evaluates no rl variant).
    assert planned_outputs(proc.stdout) == {"rl/ppo/seed0", "rl/ppo/seed1", "report"}, proc.stdout[-3000:]
    more_seeds = write_config(tiny_run["root"] / "more_seeds.yaml", tiny_run["root"] / "results", seeds=[0, 1, 2])
    proc = snakemake(more_seeds, "all", "--dry-run")
    # A third seed: only the new seed's method runs, their evaluations and the report; shared stages are kept.
    assert planned_outputs(proc.stdout) == {"dpo/seed2", "rl/grpo/seed2", "rl/ppo/seed2", "evaluate/dpo/seed2",
                                            "report"}, proc.stdout[-3000:]


def test_comment_or_docstring_edit_plans_nothing(tiny_run, tmp_path):
    """A stage's code hash is taken from the parsed code without its comments and docstrings."""
    stdout = dry_run_with_edited_code(tiny_run["configfile"], tmp_path, {
        "stages/sft.py": ('"""Stage `sft`: ', '"""Stage `sft` (docstring edited): '),
        "runtime/losses.py": ("\nimport ", "\n# A comment added by a test.\nimport "),
    })
    assert planned_jobs(stdout) == {}, stdout[-3000:]


def test_launcher_edit_plans_nothing(tiny_run, tmp_path):
    """Submission, Slurm watching, resource checks and config validation do not shape a result: editing them
    (an upgrade of the pipeline between runs of a paper) must not rerun anything."""
    stdout = dry_run_with_edited_code(tiny_run["configfile"], tmp_path, {
        "launcher/submit.py": ("STATE_POLL_S = 10 ", "STATE_POLL_S = 11 "),
        "launcher/resources.py": ('raise bad("a number of GB")', 'raise bad("a number of gigabytes")'),
        "launcher/config.py": ("has the wrong type; expected", "has the wrong type; expected a value of type"),
    })
    assert planned_jobs(stdout) == {}, stdout[-3000:]


def test_loss_edit_plans_its_stages_and_dependents(tiny_run, tmp_path):
    """runtime/losses.py holds the training objectives: the reward model, DPO and RL import it; base_model,
    preprocess, SFT and evaluation do not (they take log-probabilities from runtime/logprobs.py)."""
    stdout = dry_run_with_edited_code(tiny_run["configfile"], tmp_path, {
        "runtime/losses.py": ("def dpo_loss(", "EDITED = True\n\n\ndef dpo_loss("),
    })
    # The reward model feeds every evaluation (its column of the table) and grpo and ppo (reward `model` or not, every
    # rl run reads the trained objectives); base_model, preprocess and sft themselves stay.
    assert planned_jobs(stdout) == {"reward_model": 1, "dpo": 2, "rl": 4, "evaluate": 4, "report": 1, "all": 1}, \
        stdout[-3000:]
    assert not {"sft", "base_model", "preprocess/sft"} & planned_outputs(stdout)


def test_failed_stage_reports_job_and_leaves_no_output(tmp_path):
    """A stage that fails inside its job: the terminal shows job id, log path and the error; no output."""
    configfile = write_config(tmp_path / "failing.yaml", tmp_path / "results", experiment="failing",
                              data={"max_prompt_tokens": 8})  # every prompt is longer: no row left
    proc = snakemake(configfile, "all", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    match = re.search(r"stage preprocess/\w+ failed: job (\d+), state \w+, log (\S+)", output)
    assert match, output[-4000:]
    assert "/logs/preprocess-" in match.group(2) and Path(match.group(2)).exists()
    assert "raise data.max_prompt_tokens" in output, "the stage's own error message must reach the terminal"
    results = tmp_path / "results" / "failing"
    assert (results / "base_model" / "config.json").exists()
    assert not list((results / "preprocess").glob("*")) if (results / "preprocess").exists() else True
