"""Two RL runs with the params and inputs of the tiny experiment's grpo run, but 8 steps, DAPO's dynamic sampling
(which draws a varying number of prompts per step: the checkpoint keeps where the prompts' order stands) and
asynchronous rollouts (each step's samples generated while the step before trained, with the weights before its
update: the checkpoint keeps the rollout generated ahead): one straight through, one interrupted after a checkpoint
(as a timeout or preemption would: submitit's signal, then a requeue). The interrupted run must resume from its checkpoint and match the straight run step by step: the same
prompts and the same metrics within RL_TOLERANCE (its steps before the interruption are a plain rerun:
reproducibility)."""
import json
import signal
import time

import pytest

from runtime import data
from pipeline_helpers import signal_job_tasks, submit_again

pytestmark = pytest.mark.e2e
# The interruption comes after the first checkpoint: 6 steps after it leave time to signal the job even where a
# tiny step takes 0.2 s.
STEPS, EVERY = 8, 2
SETTINGS = {"dynamic_sampling": True, "max_generation_rounds": 2, "async_rollouts": 1}
RL_TOLERANCE = 1e-6  # docs/reproducibility.md
COMPARED = ("reward_mean", "reward_std", "kl", "policy_loss", "entropy", "response_length", "advantage_mean")


def read_log(output):
    return data.read_jsonl(output / "train_log.jsonl")


def resumed_steps(job_log: str) -> list[int]:
    """The steps a job's rl stage resumed from (its `[rl] resumed from checkpoint at step N` lines)."""
    return [int(line.rsplit(" ", 1)[1]) for line in job_log.splitlines()
            if line.startswith("[rl] resumed from checkpoint at step")]


def assert_same_run(log, reference):
    assert [s["step"] for s in log] == [s["step"] for s in reference] == list(range(1, STEPS + 1))
    assert [s["prompt_ids"] for s in log] == [s["prompt_ids"] for s in reference]
    for step, ref in zip(log, reference):
        for key in COMPARED:
            assert step[key] == pytest.approx(ref[key], abs=RL_TOLERANCE), (step["step"], key)


def test_interrupted_rl_run_resumes_and_matches_a_straight_run(tiny_run, tmp_path):
    first = tiny_run["results"] / "rl" / "grpo" / "seed0"
    # The two runs at once (independent jobs; each stage's threads are its own): the straight one is awaited below.
    straight, straight_out, _ = submit_again(tiny_run, first, tmp_path / "straight", "tiny-straight", steps=STEPS,
                                             checkpoint_every=EVERY, **SETTINGS)
    job, output, checkpoints = submit_again(tiny_run, first, tmp_path / "interrupted", steps=STEPS,
                                            checkpoint_every=EVERY, **SETTINGS)
    deadline = time.time() + 900
    while not (checkpoints / "latest.json").exists():
        assert not job.done(), f"the job ended before its first checkpoint:\n{job.stdout()}"
        assert time.time() < deadline, "no checkpoint within 15 minutes"
        time.sleep(0.1)
    assert signal_job_tasks(job, signal.SIGUSR2) == 1  # what Slurm delivers before a timeout, or on preemption
    job.result()
    straight.result()

    log_text = job.stdout()
    assert "interrupted (timeout or preemption); requeueing" in log_text
    # the job's 2 cores split: the engine generates while the trainers train
    assert "[rl] asynchronous rollouts on 2 CPU threads: the vLLM engines take 1, the trainers and scorers 1" in log_text
    resumed = resumed_steps(log_text)
    assert resumed and resumed[0] >= EVERY and resumed[0] % EVERY == 0, log_text[-3000:]
    assert_same_run(read_log(output), read_log(straight_out))
    log = read_log(output)
    assert all(s["generation_rounds"] >= 1 and s["groups_informative"] + s["groups_set_aside"] >= 8 for s in log)
    assert all(s["time_generate"] > 0 and s["time_wait_rollout"] >= 0 for s in log)
    if not any(s["groups_set_aside"] for s in log):  # no group set aside: the prompts of the plain 32-step run
        uninterrupted = read_log(first)
        assert [s["prompt_ids"] for s in log] == [s["prompt_ids"] for s in uninterrupted[:STEPS]]
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["steps"] == STEPS
    assert metrics["eval_reward"] == pytest.approx(json.loads((straight_out / "metrics.json").read_text())["eval_reward"],
                                                   abs=RL_TOLERANCE)
    assert not checkpoints.exists() or not any(checkpoints.iterdir()), "checkpoints are removed after success"
