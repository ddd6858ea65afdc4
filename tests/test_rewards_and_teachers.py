"""Rewards beyond a Python file, end to end (test_user_experiment.rewards_experiment on the user's tiny Qwen2 model:
real Ray, DeepSpeed, vLLM, MLflow and a real HTTP service on 127.0.0.1): GRPO against a reward service that is
slow once (retried) and then down (the stage fails naming it, nothing published); GRPO scored by an LLM judge whose
parsed verdicts are the reward and whose unparsed ones are counted; on-policy distillation of a teacher, whose
held-out reverse KL falls; and the refusals before queueing: an unreachable service, a teacher of another tokenizer."""
import csv
import json
import re

import pytest
import yaml

from pipeline_helpers import snakemake, submit_again
from runtime.models import cpu_bf16_flags
from test_remote_reward import dead_url
from test_user_experiment import WORDS, build_user_model, data_rows, made_stages, planned_jobs, write_user_files

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rewards_run(user_runs):
    return user_runs.result("rewards_run")


def test_rl_against_a_reward_service_that_answers_late_once(rewards_run):
    results, service = rewards_run["results"], rewards_run["service"]
    assert planned_jobs(rewards_run["plan"]) == {"base_model": 1, "preprocess": 1, "rl": 3, "evaluate": 1,
                                                 "report": 1, "all": 1}
    assert made_stages(results) == {"base_model", "preprocess/prompts", "report", "evaluate/distil/seed0"} | {
        f"rl/{variant}/seed0" for variant in ("remote", "judge", "distil")}
    log = data_rows(results / "rl" / "remote" / "seed0" / "train_log.jsonl")
    assert len(log) == 4 and sum(s["remote_retries"] for s in log) == 1, log  # the one late answer, sent again
    assert all(s["remote_requests"] >= s["generation_rounds"] for s in log)  # dynamic sampling scores each round
    # the service's scores (len of each reply) are the rewards: their spread is the replies' lengths' spread
    assert any(s["reward_std"] > 0 and s["policy_loss"] != 0 for s in log)
    bodies = [body for body in service.state["bodies"] if len(body["prompts"]) == 32]
    assert bodies and all(set(body) == {"query", "prompts", "completions", "labels"} for body in bodies)
    assert all(set(body["labels"]) <= set(WORDS) and all("<|im_start|>user" in p for p in body["prompts"])
               for body in bodies)
    assert bodies[0]["query"][0] == bodies[0]["prompts"][0] + bodies[0]["completions"][0]
    record = json.loads((results / "rl" / "remote" / "seed0" / "stage.json").read_text())
    assert record["params"]["rl"]["reward"] == service.url and "reward_file" not in record["inputs"]
    assert record["params"]["rl"]["remote_reward"]["timeout"] == 2.0  # its settings are in the cache key
    metrics = json.loads((results / "evaluate" / "distil" / "seed0" / "metrics.json").read_text())
    sample = data_rows(results / "evaluate" / "distil" / "seed0" / "samples.jsonl")[0]
    assert sample["rewards"]["remote"] == len(sample["completion"])
    assert metrics["reward_remote"] > 0 and "judge_unparsed" in metrics
    table = list(csv.DictReader((results / "report" / "results.csv").open()))
    assert [row["method"] for row in table] == ["distil"] and float(table[0]["reward_remote_mean"]) > 0
    report = (results / "report" / "report.md").read_text()
    assert f"the reward service at {service.url}" in report and "an LLM judge's score" in report


def test_precision_auto_is_recorded_as_what_it_became_on_this_cpu(rewards_run):
    """The run leaves precision at auto: its stages ran in bf16 on a CPU with native bf16 instructions and in fp32 on
    one without, and stage.json and the MLflow run say which."""
    from mlflow.tracking import MlflowClient
    expected = "bf16" if cpu_bf16_flags() else "fp32"
    client = MlflowClient(f"sqlite:///{rewards_run['results'].parent / 'mlflow.db'}")
    for stage in ("rl/remote/seed0", "rl/distil/seed0", "evaluate/distil/seed0"):
        record = json.loads((rewards_run["results"] / stage / "stage.json").read_text())
        section = record["params"]["evaluate" if stage.startswith("evaluate") else "rl"]
        assert section["precision"] == "auto" and record["job"]["precision"] == expected, (stage, record["job"])
        assert client.get_run(record["mlflow_run_id"]).data.tags["precision"] == expected
    assert "precision" not in json.loads((rewards_run["results"] / "report" / "stage.json").read_text())["job"]


def test_a_reward_service_that_stays_down_fails_the_stage_naming_it(rewards_run, tmp_path):
    """The same stage against a URL where nothing listens: it fails at step 1 naming the URL and the step, after its
    retries, and publishes nothing."""
    run = {"configfile": rewards_run["configfile"], "results": rewards_run["results"],
           "mlflow_uri": f"sqlite:///{rewards_run['root'] / 'results' / 'mlflow.db'}"}
    url = dead_url()
    settings = json.loads((rewards_run["results"] / "rl" / "remote" / "seed0" / "stage.json").read_text())
    job, output, _ = submit_again(run, rewards_run["results"] / "rl" / "remote" / "seed0", tmp_path, "rewards-down",
                                  reward=url, steps=2, eval_every=0,
                                  remote_reward=settings["params"]["rl"]["remote_reward"] | {"retries": 1})
    with pytest.raises(Exception) as failure:
        job.result()
    message = str(failure.value)
    assert re.search(rf"rl/remote, (step 1 of 2|the held-out reward after step 0): reward service {re.escape(url)}: "
                     r"no answer after 2 tries \(connection refused\)", message), message[-3000:]
    assert not output.exists() or not any(output.iterdir()), "a failed stage published something"


def test_a_judges_parsed_verdicts_are_the_reward_and_the_others_are_counted(rewards_run):
    results = rewards_run["results"]
    log = data_rows(results / "rl" / "judge" / "seed0" / "train_log.jsonl")
    scored, unparsed = sum(s["judge_scored"] for s in log), sum(s["judge_unparsed"] for s in log)
    assert len(log) == 4 and 0 < unparsed < scored, (scored, unparsed)
    # unparsed verdicts score 0.25, parsed ones 0, 0.5 or 1: a step's rewards differ from 0.25 where the judge scored
    assert any(s["reward_std"] > 0 and s["reward_mean"] != 0.25 and s["policy_loss"] != 0 for s in log), log
    text = (results / "logs" / "rl-judge-seed0.log").read_text()
    assert re.search(r"\[judge\] \d+ of 32 outputs gave no score \(scored 0.25\)", text)
    record = json.loads((results / "rl" / "judge" / "seed0" / "stage.json").read_text())
    assert "judge_model" in record["inputs"] and record["params"]["rl"]["judge"]["unparsed_score"] == 0.25
    assert record["params"]["rl"]["async_rollouts"] == 1  # scored by the judge from the rollout thread
    metrics = json.loads((results / "evaluate" / "distil" / "seed0" / "metrics.json").read_text())
    assert 0 <= metrics["judge_unparsed"] <= 16 and "reward_judge" in metrics


def test_on_policy_distillation_brings_the_student_closer_to_the_teacher(rewards_run):
    """The student's held-out reverse KL to the teacher (the sum over a reply's tokens of log pi_student - log
    pi_teacher, the same prompts and seeds) falls from the student before training, with no other reward."""
    results = rewards_run["results"]
    metrics = json.loads((results / "rl" / "distil" / "seed0" / "metrics.json").read_text())
    assert metrics["eval_teacher_kl"] < 0.9 * metrics["eval_teacher_kl_before"], metrics
    log = data_rows(results / "rl" / "distil" / "seed0" / "train_log.jsonl")
    assert len(log) == 8 and all(s["reward_mean"] == 0 and s["teacher_kl"] > 0 for s in log)
    assert all(0 < s["forward_tokens"] < s["padded_tokens"] for s in log)  # packed
    record = json.loads((results / "rl" / "distil" / "seed0" / "stage.json").read_text())
    assert record["inputs"]["teacher"] == str(rewards_run["teacher"])
    report = (results / "report" / "report.md").read_text()
    assert f"distil (reinforce, reward the teacher {rewards_run['teacher']}'s log-ratio)" in report


def test_an_unreachable_service_and_a_teacher_of_another_tokenizer_are_refused_before_queueing(tmp_path):
    """A dry run asks the reward service once and refuses a URL where nothing answers; a teacher whose vocabulary is
    not the student's is refused naming both directories."""
    files = write_user_files(tmp_path / "data", chat=True)
    student, other = tmp_path / "student", tmp_path / "other-teacher"
    build_user_model(student, "qwen2", files["texts"], chat=True)
    build_user_model(other, "qwen2", [text.upper() for text in files["texts"]], chat=True)
    url = dead_url()
    config = {"experiment": "refused", "results_dir": str(tmp_path / "results"), "model": {"path": str(student)},
              "data": {"prompts": files["data"]["prompts"]}, "evaluate": {"rewards": [files["reward"]]},
              "rl": {"reward": url, "variants": {"grpo": {"estimator": "group_norm"}}}}
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    refused = snakemake(configfile, "all", "--dry-run", check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and f"nothing answers at {url} (connection refused)" in output, output[-3000:]
    assert "rl.variants.grpo.reward (inherited from rl.reward)" in output and "remote_reward.check: false" in output
    config["rl"] = {"reward": None, "variants": {"distil": {"estimator": "reinforce", "teacher": str(other)}}}
    configfile.write_text(yaml.safe_dump(config))
    refused = snakemake(configfile, "all", "--dry-run", check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "rl.variants.distil.teacher" in output, output[-3000:]
    assert f"the teacher {other}'s tokenizer" in output and f"is not the student {student}'s" in output
    assert not (tmp_path / "results").exists()
