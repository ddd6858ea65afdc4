"""Agentic RL end to end (config/agent-calculator.yaml on the tiny model: real Ray, DeepSpeed, vLLM, MLflow): GRPO
on multi-turn episodes against the calculator environment with asynchronous rollouts, the trained model evaluated
on held-out problems with the same environment; and the run interrupted after a checkpoint, resumed, equal to a
straight run (the episodes' seeds per step, episode and turn replay them)."""
import csv
import json
import signal
import time

import pytest

from pipeline_helpers import signal_job_tasks, submit_again
from test_rl_resume import RL_TOLERANCE, read_log, resumed_steps
from test_user_experiment import data_rows, made_stages, planned_jobs

pytestmark = pytest.mark.e2e
COMPARED = ("reward_mean", "reward_std", "policy_loss", "response_length", "episode_turns", "episode_env_tokens",
            "episode_truncated")


@pytest.fixture(scope="module")
def agent_run(user_runs):
    return user_runs.result("agent_run")


def test_grpo_trains_on_episodes_and_evaluates_them_on_held_out_problems(agent_run):
    results = agent_run["results"]
    assert planned_jobs(agent_run["plan"]) == {"base_model": 1, "preprocess": 1, "rl": 2, "evaluate": 2,
                                               "benchmark": 2, "report": 1, "all": 1}
    models = ("base", "grpo")
    assert made_stages(results) == {"base_model", "preprocess/prompts", "rl/grpo/seed1234", "rl/ppo/seed1234",
                                    "report"} | {f"{stage}/{model}/seed1234" for model in models
                                                 for stage in ("evaluate", "benchmark/calc")}
    client = agent_run["mlflow"]
    for variant in ("grpo", "ppo"):
        record = json.loads((results / "rl" / variant / "seed1234" / "stage.json").read_text())
        inputs = record["inputs"]
        # kl_coef 0 and the environment's rewards: no frozen model (reference, reward model) started
        assert "FrozenScorer" not in {actor["group"] for actor in record["job"]["actors"]}, record["job"]["actors"]
        assert inputs["environment_file"].endswith("config/environments/calculator.py") and "reward_file" in inputs
        log = data_rows(results / "rl" / variant / "seed1234" / "train_log.jsonl")
        assert len(log) == 4 and all(0 <= s["episode_truncated"] <= 1 and s["episode_errors"] == 0 for s in log)
        assert any(s["reward_std"] > 0 and s["policy_loss"] != 0 for s in log)  # rewards differ: it trains
        assert not any("kl" in s for s in log)  # kl_coef 0: no reference log-probs
        [run] = client.search_runs([client.get_experiment_by_name("agent-calculator").experiment_id],
                                   f"attributes.run_name = 'rl/{variant}/seed1234'")
        # a random model seldom writes a number: the calculator asks again, so episodes take more than one turn
        assert run.data.metrics["episode_turns"] > 1 and run.data.metrics["episode_env_tokens"] > 0
        assert {"eval_success", "eval_turns"} <= set(run.data.metrics)
    ppo = data_rows(results / "rl" / "ppo" / "seed1234" / "train_log.jsonl")
    assert all("value_loss" in s for s in ppo)  # a critic
    assert sum(s["forward_tokens"] for s in ppo) < sum(s["padded_tokens"] for s in ppo)  # packed
    assert all(s["generation_rounds"] >= 1 for s in ppo)  # dynamic sampling
    for model in models:
        metrics = json.loads((results / "evaluate" / model / "seed1234" / "metrics.json").read_text())
        assert 0 <= metrics["env_success"] <= 1 and metrics["env_turns"] > 1 and metrics["env_tokens"] > 0
        assert metrics["num_prompts"] == 16 and metrics["env_errors"] == metrics["env_timeouts"] == 0
        sample = data_rows(results / "evaluate" / model / "seed1234" / "samples.jsonl")[0]
        assert "You can use a calculator" in sample["episode"] and sample["stats"]["turns"] >= 1
    table = list(csv.DictReader((results / "report" / "results.csv").open()))
    assert [row["method"] for row in table] == list(models)
    rl_table = list(csv.DictReader((results / "report" / "rl.csv").open()))  # no KL to report: an empty cell, a dash
    assert [(row["method"], row["final_kl_mean"]) for row in rl_table] == [("grpo", ""), ("ppo", "")]
    assert all(line.endswith("| – |") for line in (results / "report" / "rl.md").read_text().splitlines()[2:4])
    assert all(0 <= float(row["env_success_mean"]) <= 1 and float(row["env_turns_mean"]) > 1 for row in table)
    # the benchmark plays 2 episodes per test problem: avg@2 and pass@2 of their success
    for model in models:
        bench = json.loads((results / "benchmark" / "calc" / model / "seed1234" / "metrics.json").read_text())
        assert bench["num_problems"] == 8 and 0 <= bench["avg_at_2"] <= bench["pass_at_2"] <= 1
        problems = data_rows(results / "benchmark" / "calc" / model / "seed1234" / "samples.jsonl")
        assert all(len(p["scores"]) == 2 and set(p["scores"]) <= {0.0, 1.0} for p in problems)
    assert "calc" in (results / "report" / "benchmarks.md").read_text()


def test_an_interrupted_agent_run_resumes_equal_to_a_straight_run(agent_run, tmp_path):
    """The straight run is the agent DAG's own (its 4 steps); the same stage again, checkpointing every step,
    interrupted after its first checkpoint, must resume to the same numbers."""
    first = agent_run["results"] / "rl" / "grpo" / "seed1234"
    run = {"configfile": agent_run["configfile"], "results": agent_run["results"],
           "mlflow_uri": f"sqlite:///{agent_run['root'] / 'results' / 'mlflow.db'}"}
    job, output, checkpoints = submit_again(run, first, tmp_path / "interrupted", "agent-interrupted",
                                            checkpoint_every=1)
    deadline = time.time() + 900
    while not (checkpoints / "latest.json").exists():
        assert not job.done(), f"the job ended before its first checkpoint:\n{job.stdout()}"
        assert time.time() < deadline, "no checkpoint within 15 minutes"
        time.sleep(0.1)
    assert signal_job_tasks(job, signal.SIGUSR2) == 1
    job.result()
    assert "interrupted (timeout or preemption); requeueing" in job.stdout()
    resumed = resumed_steps(job.stdout())
    assert resumed and 1 <= resumed[0] < 4, job.stdout()[-3000:]
    log, reference = read_log(output), read_log(first)
    assert [s["step"] for s in log] == [s["step"] for s in reference] == [1, 2, 3, 4]
    assert [s["prompt_ids"] for s in log] == [s["prompt_ids"] for s in reference]
    for step, ref in zip(log, reference):
        for key in COMPARED:
            assert step[key] == pytest.approx(ref[key], abs=RL_TOLERANCE), (step["step"], key)
    assert json.loads((output / "metrics.json").read_text())["eval_reward"] == pytest.approx(
        json.loads((first / "metrics.json").read_text())["eval_reward"], abs=RL_TOLERANCE)
