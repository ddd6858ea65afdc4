"""An RL run interrupted after a checkpoint (as a timeout or preemption would: submitit's signal, then a
requeue) resumes from the checkpoint and ends where an uninterrupted run does, on the same prompts."""
import json
import time

import pytest

from stages.config import REPO_ROOT, load_config_files, rl_variant
from stages.launcher import StageJob, make_executor, stage_resources

pytestmark = [pytest.mark.e2e, pytest.mark.needs_verification]
STEPS, EVERY = 6, 2


def test_interrupted_rl_run_resumes_with_the_same_prompts(tiny_run, tmp_path):
    config = load_config_files([REPO_ROOT / "config" / "default.yaml", tiny_run["configfile"]])
    results = tiny_run["results"]
    params = {"rl": rl_variant(config, "grpo") | {"steps": STEPS, "checkpoint_every": EVERY},
              "seed": config["seed"], "variant": "grpo"}
    resources, _ = stage_resources("rl", config["launcher"])
    checkpoints = tmp_path / "checkpoints"
    output = tmp_path / "rl" / "grpo"
    job = make_executor("rl", tmp_path / "logs", resources).submit(StageJob(
        stage="rl", run_name="rl/grpo", params=params, output=str(output), experiment="tiny-resume",
        inputs={"model": str(results / "sft"), "data": str(results / "preprocess"),
                "reward_file": str(REPO_ROOT / params["rl"]["reward"])},
        tracking_uri=tiny_run["mlflow_uri"], resources=resources, checkpoint_dir=str(checkpoints)))

    deadline = time.time() + 900
    while not (checkpoints / "latest.json").exists():
        assert not job.done(), f"the job ended before its first checkpoint:\n{job.stdout()}"
        assert time.time() < deadline, "no checkpoint within 15 minutes"
        time.sleep(1)
    job._interrupt()  # what Slurm's USR2 before a timeout, or a preemption, delivers
    job.result()

    log_text = job.stdout()
    assert "interrupted (timeout or preemption); requeueing" in log_text
    resumed = [int(line.rsplit(" ", 1)[1]) for line in log_text.splitlines()
               if line.startswith("[rl] resumed from checkpoint at step")]
    assert resumed and resumed[0] >= EVERY and resumed[0] % EVERY == 0, log_text[-3000:]

    steps = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    uninterrupted = [json.loads(line) for line in (results / "rl" / "grpo" / "train_log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["prompt_ids"] for s in steps] == [s["prompt_ids"] for s in uninterrupted[:STEPS]]
    assert json.loads((output / "metrics.json").read_text())["steps"] == STEPS
    assert not checkpoints.exists() or not any(checkpoints.iterdir()), "checkpoints are removed after success"
