"""Validation during RL (stages/rl.py, rl.eval_every and rl.keep): the held-out reward before training, every
eval_every steps and at the end (once), the best step (ties: the earliest; the start model included), and with
keep: best the output holds the policy of that step, also when the run was interrupted after a new best and resumed
from an earlier checkpoint. The driver runs with stand-ins for its actors: the policy's "weights" are the number of
updates it took, and the held-out reward is a function of them. Then once through the real stage and its job."""
import json
from pathlib import Path

import pytest

from launcher.config import stage_config, validate_config
from runtime import data
from stages import rl

# The held-out reward of the policy after v updates: best at 5 (7 ties it: the earliest wins).
REWARD = [0.1, 0.5, 0.3, 0.2, 0.6, 0.9, 0.4, 0.9, 0.05]
STEPS = len(REWARD) - 1


class Interrupted(Exception):
    pass


class Policy:
    """The policy's ranks: `version` (its updates) is all its weights; saved models and checkpoints hold it."""

    def __init__(self, crash_at: int | None):
        self.version, self.crash_at = 0, crash_at

    def call(self, method: str, path: str, other: str) -> None:
        out = Path(path) if method == "save_hf" else Path(path) / other  # (a checkpoint: a directory per group)
        if method == "load_checkpoint":
            self.version = json.loads((out / "weights.json").read_text())
        else:
            out.mkdir(parents=True, exist_ok=True)
            (out / "weights.json").write_text(json.dumps(self.version))

    def train(self) -> dict:
        if self.version + 1 == self.crash_at:
            raise Interrupted
        self.version += 1
        return {"policy_loss": 0.0, "clip_fraction": 0.0}


class Tracker:
    """Stands in for the stage's MLflow run, keeping what is logged."""

    def __init__(self, checkpoint_dir):
        self.checkpoint_dir, self.logged = checkpoint_dir, []

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.logged += [(key, step, value) for key, value in metrics.items()]

    def log_artifact(self, path) -> None:
        pass

    def history(self, key: str) -> list:
        return [(step, value) for k, step, value in self.logged if k == key]


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """run(cfg, tracker, crash_at) of the stage's driver on stand-ins; its output directory."""
    (tmp_path / "data").mkdir()
    for split, n in (("train", 8), ("eval", 2)):
        data.write_jsonl(tmp_path / "data" / f"prompts_{split}.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(n)])
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "metrics.json").write_text(json.dumps({"reward_mean": 0.0, "reward_std": 1.0}))
    inputs = {"model": tmp_path / "start", "data": tmp_path / "data", "reward_model": tmp_path / "rm"}
    policies = []

    class Roles:
        def __init__(self, cfg, inputs, total_steps, threads, max_len, tracker):
            self.policy, self.critic, self.episodes = policies[-1], None, None
            self.trainers = {"policy": self.policy}

        def sync_weights(self) -> None:
            pass

        def reward_counts(self) -> dict:
            return {}

    monkeypatch.setattr(rl, "Roles", Roles)
    monkeypatch.setattr(rl, "load_tokenizer", lambda path: lambda text, **kw: {"input_ids": [1, 2]})
    monkeypatch.setattr(rl.ray, "cluster_resources", lambda: {"CPU": 1})
    monkeypatch.setattr(rl, "sample_step", lambda roles, cfg, batch, draw, seed: (None, None, batch, {}))
    monkeypatch.setattr(rl, "make_experience", lambda *args: {"kl": 0.0, "reward_mean": 0.0})
    monkeypatch.setattr(rl, "train_on", lambda group, cfg, rollout, rng: group.train())
    monkeypatch.setattr(rl, "held_out_reward", lambda roles, cfg, prompts: {"eval_reward": REWARD[roles.policy.version]})

    def run(cfg, tracker, crash_at=None):
        policies.append(Policy(crash_at))
        output = tmp_path / "out"
        output.mkdir(exist_ok=True)
        rl.run(cfg, inputs, output, tracker)
        return output
    return run


def config(**changes) -> rl.Config:
    settings = dict(steps=STEPS, rollout_batch_size=2, n_samples=4, batch_size=8) | changes
    return stage_config(rl, {"rl": {"variants": {"grpo": settings}}})


def test_schema_defaults():
    rl_block = validate_config({})["rl"]
    assert (rl_block["eval_every"], rl_block["keep"]) == (0, "last")


@pytest.mark.parametrize("eval_every, keep, steps, best, kept", [
    (1, "best", list(range(STEPS + 1)), 5, 5),
    (1, "last", list(range(STEPS + 1)), 5, STEPS),
    (3, "best", [0, 3, 6, STEPS], 6, 6),
    (4, "best", [0, 4, STEPS], 4, 4),                         # the last step is a multiple: scored once
    (0, "best", [0, STEPS], 0, 0),                            # only got worse: the start model is kept
])
def test_validation_curve_and_kept_policy(driver, tmp_path, eval_every, keep, steps, best, kept):
    tracker = Tracker(tmp_path / "ckpt")
    output = driver(config(eval_every=eval_every, keep=keep), tracker)
    curve = tracker.history("eval_reward")
    assert curve == [(s, REWARD[s]) for s in steps]
    metrics = json.loads((output / "metrics.json").read_text())
    assert (metrics["best_step"], metrics["best_eval_reward"], metrics["kept_step"]) == (best, REWARD[best], kept)
    assert (metrics["eval_reward_before"], metrics["eval_reward"]) == (REWARD[0], REWARD[STEPS])
    assert tracker.history("best_step") == [(STEPS, best)] and tracker.history("kept_step") == [(STEPS, kept)]
    assert json.loads((output / "weights.json").read_text()) == kept
    assert not (output / "best").exists() and not (tmp_path / "ckpt" / "best").exists()


@pytest.mark.parametrize("checkpoint_every", [0, 3])
def test_interrupted_after_a_new_best_resumes_and_keeps_the_best(driver, tmp_path, checkpoint_every):
    """Interrupted in step 6: after the checkpoint at step 3 (best then: 1) and a new best at 5, saved. The resumed
    run (from step 3, or from the start without checkpoints) trains steps 4-8 again and keeps step 5's policy."""
    cfg = config(eval_every=1, keep="best", checkpoint_every=checkpoint_every)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(Interrupted):
        driver(cfg, Tracker(ckpt), crash_at=6)
    if checkpoint_every:  # the checkpoint's best and the new one, saved after it
        assert sorted(p.name for p in (ckpt / "best").iterdir()) == ["step1", "step5"]
        # the resumed run trusts only what its checkpoint names: step 5's policy is saved again when found
        (ckpt / "best" / "step5" / "weights.json").write_text("-1")
    tracker = Tracker(ckpt)
    output = driver(cfg, tracker)
    curve = tracker.history("eval_reward")
    assert curve == [(s, REWARD[s]) for s in range(STEPS + 1)]  # the checkpoint's points logged again
    assert tracker.history("resumed_from_step") == ([(3, 3)] if checkpoint_every else [])
    metrics = json.loads((output / "metrics.json").read_text())
    assert (metrics["best_step"], metrics["kept_step"]) == (5, 5)
    assert json.loads((output / "weights.json").read_text()) == 5


# Training prompts are rewarded for vowels (the policy learns); the held-out ones (label "eval") get a set score per
# scoring, so that the best step is known: the start model, tied by the last step (the earliest wins). A fourth
# scoring (the last step's twice) fails the stage.
SCRIPTED_REWARD = """
HELD_OUT = [0.5, 0.25, 0.5]
scored = 0


def reward_fn(prompts, completions, labels):
    global scored
    if labels and labels[0] == "eval":
        scored += 1
        return [HELD_OUT[scored - 1]] * len(completions)
    return [sum(c in "aeiou" for c in text) / max(1, len(text)) for text in completions]
"""


@pytest.mark.e2e
def test_real_rl_stage_validates_every_step_and_keeps_its_best(tmp_path):
    """The stage through its job (Ray, DeepSpeed, vLLM, MLflow) with eval_every 1 and keep: best (the best kept
    beside a checkpoint), its held-out scores scripted (best: step 0): MLflow's eval_reward has a point at every
    step, best_step is its first maximum, and the output's weights are the start model's, not the trained last
    policy's."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from launcher.config import rl_variant
    from launcher.resources import stage_resources
    from launcher.submit import make_executor
    from runtime.job import StageJob
    from stage_helpers import tiny_reviews_model

    words = tiny_reviews_model(tmp_path / "start")
    (tmp_path / "data").mkdir()
    for split, rows in (("train", words[:8]), ("eval", words[8:12])):
        data.write_jsonl(tmp_path / "data" / f"prompts_{split}.jsonl",
                         [{"id": i, "prompt": " ".join(w[:5]), "label": split} for i, w in enumerate(rows)])
    (tmp_path / "reward.py").write_text(SCRIPTED_REWARD)
    settings = dict(steps=2, eval_every=1, keep="best", rollout_batch_size=4, n_samples=4, batch_size=16,
                    micro_batch_size=4, num_workers=1, zero_stage=0, max_new_tokens=8, learning_rate=1e-3,
                    eval_prompts=4, reward=str(tmp_path / "reward.py"), checkpoint_every=1)
    config = validate_config({"rl": {"variants": {"grpo": settings}}})
    params = {"rl": rl_variant(config, "grpo"), "variant": "grpo", "seed": 0}
    resources, _ = stage_resources("rl", config["launcher"])
    output, uri = tmp_path / "rl" / "grpo", f"sqlite:///{tmp_path / 'mlflow.db'}"
    inputs = {"model": str(tmp_path / "start"), "data": str(tmp_path / "data"), "reward_file": settings["reward"]}
    job = make_executor("rl", tmp_path / "logs", resources).submit(StageJob(
        stage="rl", run_name="rl/grpo/seed0", params=params, inputs=inputs, output=str(output),
        experiment="rl-validation", tracking_uri=uri, resources=resources, checkpoint_dir=str(tmp_path / "ckpt"),
        hub_downloads=False))
    job.result()

    run_id = json.loads((output / "stage.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=uri)
    curve = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval_reward"))
    assert curve == [(0, 0.5), (1, 0.25), (2, 0.5)]
    logged = client.get_run(run_id).data.metrics
    metrics = json.loads((output / "metrics.json").read_text())
    for chosen in (logged, metrics):
        assert (chosen["best_step"], chosen["best_eval_reward"], chosen["kept_step"]) == (0, 0.5, 0)
    log = data.read_jsonl(output / "train_log.jsonl")
    assert [s["step"] for s in log] == [1, 2] and log[-1]["kl"] != 0  # the last policy is not the start model
    start, kept = load_file(tmp_path / "start" / "model.safetensors"), load_file(output / "model.safetensors")
    assert kept.keys() == start.keys() and all(kept[k].equal(start[k]) for k in start)
    assert not (output / "best").exists() and not (tmp_path / "ckpt").exists()
