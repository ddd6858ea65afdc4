"""The stall watch (runtime/progress.py) in a real RL stage: a reward function that hangs inside the tiny experiment's
grpo run (through the launcher, Ray, DeepSpeed and vLLM) is caught within the stage's limit, with the stacks of the
driver and of the actors, the place it hangs and the job id; the stage fails and publishes nothing.
Its own file: it waits out the limit, mostly idle, beside the user-experiment DAGs (tests/conftest.py's
WAITING_FILES), where the small stall tests (tests/test_stall_watch.py) time theirs on a quiet machine."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from launcher.config import REPO_ROOT, load_config_files
from runtime.progress import STALL_MARK
from test_orphans_and_locks import launcher_command

# Longer than any part of the stage's start-up (Ray up, actors and engines started, held-out reward) and of a step
# (responses generated, experience made, trained) on a 2-core machine beside a DAG, each a milestone the stage
# reports (at most 15 s apart here alone, 2026-12-04); CI's machine, ~1.4x slower, once took over 2 min for one.
STAGE_LIMIT_MIN = 3.0


HANGING_REWARD = """
import time

calls = 0


def reward_fn(prompts, completions, labels):
    global calls
    calls += 1
    if calls == 3:  # held-out prompts, step 1, then step 2 hangs
        time.sleep(3600)
    return [float(c.count("a")) for c in completions]
"""


@pytest.mark.e2e
def test_a_reward_function_that_hangs_in_an_rl_stage_is_caught(tiny_run, tmp_path):
    """(The requeue of a stalled job: test_a_job_that_stalls_twice_fails_after_one_requeue; a stage's resume from
    its checkpoint in a requeued job: tests/test_rl_resume.py.)"""
    record = json.loads((tiny_run["results"] / "rl" / "grpo" / "seed0" / "stage.json").read_text())
    reward = tmp_path / "hangs.py"
    reward.write_text(HANGING_REWARD)
    params = record["params"] | {"rl": record["params"]["rl"] | {"steps": 2, "reward": str(reward)}}
    absolute = lambda p: str(p if Path(p).is_absolute() else REPO_ROOT / p)
    inputs = {k: absolute(v) for k, v in record["inputs"].items() if k != "reward_model"} | {"reward_file": str(reward)}
    config = load_config_files([tiny_run["configfile"]])
    job = {"stage": "rl", "run_name": "rl/grpo/seed0", "code": "test", "config": params}
    job_io = {"inputs": inputs, "resources": {},
              "context": {"experiment": "tiny-stall", "results_dir": str(tmp_path / "results"),
                          "launcher": config["launcher"] | {"stall_min": STAGE_LIMIT_MIN},
                          "tracking": {"uri": tiny_run["mlflow_uri"]}}}
    output = tmp_path / "results" / "tiny-stall" / "rl" / "grpo" / "seed0"
    done = subprocess.run(launcher_command(job, job_io, output, tmp_path / "rl.log"), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-6000:]
    log = Path(re.search(r"job \d+ submitted \(local: this machine\), log (\S+)", out).group(1))
    message = re.search(re.escape(STALL_MARK) + r" (.*)", log.read_text()).group(1)
    assert re.match(r"stage rl/grpo/seed0 \(job \d+\) stalled: no progress for", message), message
    assert "last progress: rl/grpo step 2/2: responses generated;" in message, message  # (scored next)
    assert f"the driver waits at {reward}:" in message and "in reward_fn (time.sleep(3600))" in message, message
    idle = float(re.search(r"no progress for ([\d.]+) min", message).group(1))
    # the limit (no step timed yet: the first holds the start-up) and one poll (10 s)
    assert STAGE_LIMIT_MIN <= idle <= STAGE_LIMIT_MIN + 0.25, message
    stacks = log.read_text()
    assert f'File "{reward}", line' in stacks  # the driver's
    assert re.search(r"--- Python stacks of process \d+ on \S+: ray::PolicyWorker", stacks)  # an actor's, with py-spy
    # the terminal: the message, then the launcher's report with the job id and its log
    assert STALL_MARK in out
    assert re.search(r"stage rl/grpo/seed0 failed: job \d+, state \w+, log " + re.escape(str(log)), out), out[-3000:]
    assert "submitted once more" not in out  # (launcher.requeue_stalled is off by default)
    assert not output.exists() and not output.with_name("seed0.partial").exists()
