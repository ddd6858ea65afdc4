"""The one checkpoint helper of every training stage (runtime/checkpoints.py): save, find the latest, resume,
prune to the newest N, remove; a checkpoint counts only once latest.json points at it."""
import json
from pathlib import Path

import pytest

from runtime import checkpoints


class FakeGroup:
    """Stands in for an ActorGroup of DeepSpeed ranks: saving writes <directory>/<tag>/, loading is remembered."""

    def __init__(self):
        self.loaded = []

    def call(self, method: str, directory: str, tag: str) -> list:
        if method == "save_checkpoint":
            (Path(directory) / tag).mkdir(parents=True, exist_ok=True)
            (Path(directory) / tag / "rank0.pt").write_text(directory)
        else:
            assert method == "load_checkpoint"
            self.loaded.append((directory, tag))
        return [None]


def step_dirs(ckpt_dir) -> list[str]:
    return sorted(p.name for p in ckpt_dir.glob("step*"))


def test_save_two_and_resume_from_the_newest(tmp_path):
    policy, critic = FakeGroup(), FakeGroup()
    groups = {"policy": policy, "critic": critic}
    checkpoints.save(tmp_path, 2, groups, {"log": [1, 2], "kl_coef": 0.1}, keep=2)
    checkpoints.save(tmp_path, 4, groups, {"log": [1, 2, 3, 4], "kl_coef": 0.2}, keep=2)
    assert checkpoints.latest(tmp_path) == {"step": 4, "tag": "step4"} and step_dirs(tmp_path) == ["step2", "step4"]
    assert (tmp_path / "step4" / "policy" / "rank0.pt").exists() and (tmp_path / "step4" / "critic").is_dir()
    assert checkpoints.resume(tmp_path, groups, "rl") == (4, {"log": [1, 2, 3, 4], "kl_coef": 0.2})
    assert policy.loaded == [(str(tmp_path / "step4"), "policy")]
    assert critic.loaded == [(str(tmp_path / "step4"), "critic")]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_prune_keeps_the_newest_n(tmp_path, keep):
    group = FakeGroup()
    for step in (2, 4, 6, 8):
        checkpoints.save(tmp_path, step, {"model": group}, {"log": []}, keep=keep)
    assert step_dirs(tmp_path) == ["step2", "step4", "step6", "step8"][-keep:]
    assert not (tmp_path / "latest.json.tmp").exists()


def test_a_checkpoint_without_the_latest_pointer_is_not_used(tmp_path):
    group = FakeGroup()
    checkpoints.save(tmp_path, 2, {"model": group}, {"log": ["two"]}, keep=1)
    # A save cut short (the job killed) after the ranks wrote step4 but before latest.json moved to it.
    group.call("save_checkpoint", str(tmp_path / "step4"), "model")
    assert checkpoints.latest(tmp_path)["step"] == 2
    assert checkpoints.resume(tmp_path, {"model": group}, "sft") == (2, {"log": ["two"]})
    assert group.loaded == [(str(tmp_path / "step2"), "model")]
    # The resumed run saves step 3: the half-written step4 goes, as does step2 (keep 1).
    checkpoints.save(tmp_path, 3, {"model": group}, {"log": ["three"]}, keep=1)
    assert step_dirs(tmp_path) == ["step3"] and checkpoints.latest(tmp_path)["step"] == 3


def test_nothing_to_resume(tmp_path):
    assert checkpoints.latest(None) is None and checkpoints.resume(None, {"model": FakeGroup()}, "sft") is None
    assert checkpoints.resume(tmp_path, {"model": FakeGroup()}, "sft") is None


def test_remove_after_success(tmp_path):
    ckpt = tmp_path / "checkpoints" / "rl-grpo" / "0123abcd"
    ckpt.mkdir(parents=True)
    checkpoints.save(ckpt, 2, {"model": FakeGroup()}, {"log": []}, keep=1)
    assert json.loads((ckpt / "latest.json").read_text())["tag"] == "step2"
    checkpoints.remove(ckpt)
    assert not (tmp_path / "checkpoints").exists()


def test_checkpoint_dir_apart_from_results(tmp_path):
    """launcher.checkpoint_dir (a cluster's scratch) holds the checkpoints; by default they sit in the results."""
    from launcher.config import validate_config
    from launcher.submit import checkpoint_dir
    config = validate_config({"results_dir": str(tmp_path / "results"), "launcher": {"checkpoint_dir": str(tmp_path / "scratch")}})
    context = {key: config[key] for key in ("experiment", "results_dir", "launcher", "tracking")}
    chosen = checkpoint_dir(context, "rl/grpo/seed0", {"rl": {"steps": 8}})
    assert chosen.parent == tmp_path / "scratch" / config["experiment"] / "rl-grpo-seed0"
    context["launcher"] = dict(context["launcher"], checkpoint_dir=None)
    default = checkpoint_dir(context, "rl/grpo/seed0", {"rl": {"steps": 8}})
    assert default.parent == tmp_path / "results" / config["experiment"] / "checkpoints" / "rl-grpo-seed0"
    assert default.name == chosen.name  # keyed by the stage's config either way
