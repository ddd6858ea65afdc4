"""Same config and seed, same numbers: SFT, the reward model and DPO, submitted again with the params and inputs
their first run recorded, reproduce its metrics and per-step losses exactly on CPU. (RL: tests/test_rl_resume.py
reruns it and checks the tolerance that docs/reproducibility.md states.)"""
import json

import pytest

from pipeline_helpers import submit_again
from runtime import data

pytestmark = pytest.mark.e2e


def without_timings(step: dict) -> dict:
    return {k: v for k, v in step.items() if not k.startswith("time")}


STAGES = ("sft", "reward_model", "dpo/seed1")


@pytest.fixture(scope="module")
def reruns(tiny_run, tmp_path_factory):
    """The three stages submitted again at once (independent jobs; what each computes depends on its config only)."""
    root = tmp_path_factory.mktemp("reruns")
    return {stage: submit_again(tiny_run, tiny_run["results"] / stage, root)[:2] for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_stage_rerun_reproduces_its_metrics(tiny_run, reruns, stage):
    first = tiny_run["results"] / stage
    job, output = reruns[stage]
    job.result()
    assert json.loads((output / "metrics.json").read_text()) == json.loads((first / "metrics.json").read_text())
    log, first_log = ([without_timings(step) for step in data.read_jsonl(d / "train_log.jsonl")] for d in (output, first))
    assert log == first_log
