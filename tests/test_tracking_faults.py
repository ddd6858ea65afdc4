"""Tracking under faults (runtime/tracking.py, runtime/tracking_buffer.py): a metrics write that fails is retried,
then buffered, never fatal, and the buffer reaches MLflow later; parallel stages on one sqlite store lose nothing; a
stage whose tracking server dies finishes; a killed attempt's RUNNING run is marked KILLED by the next one;
credentials in the tracking URI are refused; the experiment is a model-training one and its parent run spans its
stages.

The tests that start processes (stages, an MLflow server) are marked e2e; each takes well under a minute."""
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient

from launcher.config import REPO_ROOT
from pipeline_helpers import wait_until
from runtime import tracking, tracking_buffer

# A stage as the job runs one (runtime/job.py): tracking.stage_run around a loop of stepped metrics. argv: uri,
# experiment, run_name, steps, seconds between steps, progress file, step after which the process kills itself
# (-1: never), retry budget in seconds. Prints the run id, its retry/buffer counts and its buffer file.
STAGE = r"""
import json, os, signal, sys, time
from pathlib import Path
from runtime import tracking, tracking_buffer
uri, experiment, run_name, steps, pause, progress, kill_after, budget = sys.argv[1:9]
tracking_buffer.RETRY_BUDGET_S = float(budget)
with tracking.stage_run(uri, experiment, run_name, {"seed": 0, "lr": 0.1}) as run:
    for step in range(int(steps)):
        run.log_metrics({"loss": 1.0 / (step + 1), "reward": step * 0.5}, step=step)
        Path(progress).write_text(str(step))
        if step == int(kill_after):
            os.kill(os.getpid(), signal.SIGKILL)  # as Slurm's SIGKILL at a timeout, or a lost node
        time.sleep(float(pause))
print(json.dumps({"run_id": run.run_id, "stats": run.stats, "buffer": str(run.buffer.path)}), flush=True)
"""


def start_stage(tmp_path: Path, uri: str, experiment: str, run_name: str, steps: int, pause: float = 0.0,
                kill_after: int = -1, budget: float = tracking_buffer.RETRY_BUDGET_S, env: dict | None = None):
    progress = tmp_path / f"progress-{run_name.replace('/', '-')}"
    proc = subprocess.Popen([sys.executable, "-c", STAGE, uri, experiment, run_name, str(steps), str(pause),
                             str(progress), str(kill_after), str(budget)], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ | (env or {}))
    return proc, progress


def steps_done(progress: Path) -> int:
    try:
        return int(progress.read_text() or -1) + 1
    except (FileNotFoundError, ValueError):
        return 0


def finished(proc, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def history(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


# --- (1) four stages at once on one sqlite store -------------------------------------------------------------

@pytest.mark.e2e
def test_parallel_stages_on_one_sqlite_store_lose_nothing(tmp_path):
    """Four stage processes log 200 steps each into one sqlite store at once (they also create it together), and
    in the middle of it the test holds the database's write lock for longer than sqlite's busy timeout (MLflow
    sets 20 s), so their writes fail with 'database is locked': they retry, carry on, and every step of every
    run is in MLflow."""
    db = tmp_path / "mlflow.db"
    uri, steps = f"sqlite:///{db}", 200
    begun = time.monotonic()
    stages = [start_stage(tmp_path, uri, "parallel", f"sft/seed{i}", steps, pause=0.01) for i in range(4)]
    wait_until(lambda: all(steps_done(p) >= 10 for _, p in stages) or any(s.poll() is not None for s, _ in stages),
               120, "the four stages to log their first steps")
    asked_at = time.monotonic()
    locker = sqlite3.connect(db, timeout=60, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # a writer that takes its time, as on a slow shared file system
    locked_at = time.monotonic()
    time.sleep(22)
    locker.execute("COMMIT")
    locker.close()
    print(f"locked {locked_at - begun:.1f} s after the start (asked {asked_at - begun:.1f} s), at steps "
          f"{[steps_done(p) for _, p in stages]}")
    results = [finished(proc, 120) for proc, _ in stages]
    print(f"all done {time.monotonic() - begun:.1f} s after the start: {[r['stats'] for r in results]}")
    client = MlflowClient(tracking_uri=uri)
    for result in results:
        run = client.get_run(result["run_id"])
        assert run.info.status == "FINISHED"
        assert history(client, result["run_id"], "loss") == list(range(steps))
        assert history(client, result["run_id"], "reward") == list(range(steps))
    assert sum(r["stats"]["retried"] for r in results) >= 1, (results, time.monotonic() - locked_at)
    assert all(r["stats"]["dropped"] == 0 for r in results)
    assert not list((tmp_path / "mlflow-buffer").rglob("*.jsonl")), "a buffer was left behind"
    parent = client.get_run(client.get_run(results[0]["run_id"]).data.tags["mlflow.parentRunId"]).info
    assert parent.status == "FINISHED"
    assert parent.end_time == max(client.get_run(r["run_id"]).info.end_time for r in results)


# --- (2) the tracking server dies in the middle of a stage ------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(tmp_path: Path, db: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on the sqlite store `db`, in its own process group (it starts uvicorn workers)."""
    log = (tmp_path / f"server-{time.monotonic_ns()}.log").open("w")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
                             f"sqlite:///{db}", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})

    def healthy():
        assert proc.poll() is None, (tmp_path / log.name).read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False
    wait_until(healthy, 90, "mlflow server to answer", interval=0.25)
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    """Kill the server outright (as a crashed or unreachable one), its workers with it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.e2e
def test_stage_finishes_when_the_tracking_server_dies(tmp_path, monkeypatch):
    """The server is killed after 15 of 40 steps: the stage retries, then buffers the rest (metrics and the
    run's end) in its buffer file, and exits 0. Once the server is back on the same store, the next stage's start
    (the report's, in a pipeline) delivers the buffer: every step is in MLflow and the run is FINISHED."""
    db, port, steps, cut = tmp_path / "server.db", free_port(), 40, 15
    uri, cache = f"http://127.0.0.1:{port}", tmp_path / "cache"
    for key, value in tracking.HTTP_ENV_DEFAULTS.items() | {("XDG_CACHE_HOME", str(cache))}:
        monkeypatch.setenv(key, value)  # what stage_run sets for a server, restored after the test
    server = start_server(tmp_path, db, port)
    try:
        stage, progress = start_stage(tmp_path, uri, "served", "rl/grpo-seed0", steps, pause=0.1, budget=4)
        wait_until(lambda: steps_done(progress) >= cut or stage.poll() is not None, 90, "the stage's first steps")
        stop_server(server)
        started = time.monotonic()
        result = finished(stage, 90)
        print(f"the stage ended {time.monotonic() - started:.1f} s after the server was killed: {result}")
        assert time.monotonic() - started < 60
        buffer = Path(result["buffer"])
        assert buffer.is_relative_to(cache / "alignpipe" / "mlflow-buffer")
        records = [json.loads(line) for line in buffer.read_text().splitlines()]
        buffered_steps = sorted({m[3] for r in records if r["op"] == "metrics" for m in r["metrics"]})
        assert buffered_steps and buffered_steps[-1] == steps - 1
        assert {"op": "terminate", "status": "FINISHED"}.items() <= records[-1].items()
        assert result["stats"]["buffered"] == len(records)

        server = start_server(tmp_path, db, port)  # back, on the same store
        with tracking.stage_run(uri, "served", "report", {}) as report:
            pass
        client = MlflowClient(tracking_uri=uri)
        assert history(client, result["run_id"], "loss") == list(range(steps))
        assert history(client, result["run_id"], "reward") == list(range(steps))
        assert client.get_run(result["run_id"]).info.status == "FINISHED"
        assert client.get_run(report.run_id).info.status == "FINISHED"
        assert not buffer.exists()
    finally:
        stop_server(server)


# --- (3) credentials in the tracking URI ---------------------------------------------------------------------

@pytest.mark.parametrize("uri", ["http://user:secret@host:5000", "https://secret@mlflow.example.org",
                                 "http://host:5000/?token=secret", "postgresql://mlflow:secret@db/mlflow"])
def test_uri_with_credentials_is_refused(uri, monkeypatch):
    with pytest.raises(tracking.TrackingURIError) as refused:
        tracking.check_tracking_uri(uri, "tracking.uri")
    message = str(refused.value)
    assert "secret" not in message and "tracking.uri" in message
    assert "MLFLOW_TRACKING_USERNAME" in message and "MLFLOW_TRACKING_PASSWORD" in message
    for fine in ("http://host:5000", "https://mlflow.example.org/", "sqlite:////tmp/results/mlflow.db", None):
        tracking.check_tracking_uri(fine)

    from launcher.submit import StageFailed, tracking_uri
    config = {"results_dir": "results", "experiment": "tiny", "tracking": {"uri": uri}}
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(StageFailed, match="MLFLOW_TRACKING_PASSWORD") as launched:
        tracking_uri(config)
    assert "secret" not in str(launched.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(StageFailed, match="MLFLOW_TRACKING_URI: .*MLFLOW_TRACKING_USERNAME"):
        tracking_uri(config | {"tracking": {"uri": None}})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://host:5000")
    assert tracking_uri(config | {"tracking": {"uri": None}}) == "http://host:5000"
    with pytest.raises(tracking.TrackingURIError):
        with tracking.stage_run(uri, "tiny", "sft", {}):
            pass


# --- (4) a killed attempt's run -------------------------------------------------------------------------------

@pytest.mark.e2e
def test_stale_running_run_is_marked_killed_by_the_next_attempt(tmp_path):
    """A stage killed with SIGKILL (a Slurm timeout, a lost node) leaves its run RUNNING; its rerun or requeue
    marks it KILLED, points it to the new run, and the parent run follows the new attempt."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    stage, _ = start_stage(tmp_path, uri, "requeue", "sft/seed0", 50, kill_after=5)
    stage.communicate(timeout=120)
    assert stage.returncode == -signal.SIGKILL
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("requeue").experiment_id
    [stale] = client.search_runs([experiment], "attributes.run_name = 'sft/seed0'")
    assert stale.info.status == "RUNNING"
    parent = stale.data.tags["mlflow.parentRunId"]
    assert client.get_run(parent).info.status == "RUNNING"

    with tracking.stage_run(uri, "requeue", "sft/seed0", {"seed": 0, "lr": 0.1}) as again:
        again.log_metrics({"loss": 0.5}, step=6)
        assert client.get_run(stale.info.run_id).info.status == "KILLED"
    killed = client.get_run(stale.info.run_id)
    assert killed.data.tags["alignpipe.superseded_by"] == again.run_id
    assert client.get_run(again.run_id).info.status == "FINISHED"
    assert client.get_run(parent).info.status == "FINISHED"


# --- (5) the experiment's kind and its parent run --------------------------------------------------------------

def test_experiment_kind_and_parent_run_span_the_stages(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    with tracking.stage_run(uri, "tiny", "sft/seed0", {"seed": 0}) as sft:
        parent = client.get_run(sft.run_id).data.tags["mlflow.parentRunId"]
        assert client.get_run(parent).info.status == "RUNNING"
        time.sleep(1.0)
    experiment = client.get_experiment_by_name("tiny")
    assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == tracking.EXPERIMENT_KIND == "custom_model_development"
    after_sft = client.get_run(parent).info
    assert after_sft.status == "FINISHED" and after_sft.end_time - after_sft.start_time >= 1000  # not 7 ms
    time.sleep(0.5)
    with pytest.raises(RuntimeError):
        with tracking.stage_run(uri, "tiny", "dpo/seed0", {"seed": 0}):
            raise RuntimeError("the stage fails")
    after_dpo = client.get_run(parent).info
    assert after_dpo.status == "FAILED" and after_dpo.end_time >= after_sft.end_time + 500
    with tracking.stage_run(uri, "tiny", "dpo/seed0", {"seed": 0}):  # its rerun succeeds
        pass
    assert client.get_run(parent).info.status == "FINISHED"
    assert tracking.ui_link("http://mlflow:5000/", experiment.experiment_id) == \
        f"http://mlflow:5000/#/experiments/{experiment.experiment_id}?workflowType=machine_learning"


def test_experiment_created_before_the_kind_gets_it(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("old", artifact_location=(tmp_path / "artifacts").as_uri())
    with tracking.stage_run(uri, "old", "preprocess", {}):
        pass
    assert client.get_experiment_by_name("old").tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"


# --- the retry and buffer logic, with a store that fails on purpose ----------------------------------------------

class FlakyClient:
    """Stands in for MlflowClient's writes: fails the next `failures` calls with 'database is locked' (as
    MLflow's sqlite store raises it), or every call while `down`."""

    def __init__(self, failures: int = 0):
        self.failures, self.down, self.metrics, self.calls, self.status = failures, False, [], 0, None

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.calls += 1
        if self.down or self.failures > 0:
            self.failures -= 1
            raise MlflowException("(sqlite3.OperationalError) database is locked", TEMPORARILY_UNAVAILABLE)
        if any(len(str(p.value)) > 6000 for p in params):
            raise MlflowException("param too long", INVALID_PARAMETER_VALUE)
        self.metrics.extend((m.key, m.step, m.timestamp) for m in metrics)

    def set_terminated(self, run_id, status, end_time=None):
        self.log_batch(run_id)
        self.status = status


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(tracking_buffer, "RETRY_DELAYS_S", (0.01, 0.01, 0.01))
    monkeypatch.setattr(tracking_buffer, "RETRY_BUDGET_S", 1.0)
    monkeypatch.setattr(tracking, "RECHECK_S", 0.0)


def test_locked_write_is_retried(quick_retries):
    client = FlakyClient(failures=2)
    run = tracking.StageRun(client, "run1", None)
    run.log_metrics({"loss": 1.0}, step=3)
    assert client.metrics and client.metrics[0][:2] == ("loss", 3) and run.stats["retried"] == 2


def test_failed_writes_are_buffered_then_delivered(tmp_path, quick_retries, monkeypatch):
    client = FlakyClient()
    run = tracking.StageRun(client, "run1", tmp_path / "buffers" / "run1.jsonl")
    run.log_metrics({"loss": 1.0}, step=0)
    client.down = True
    artifact = tmp_path / "metrics.json"
    artifact.write_text("{}")
    for step in range(1, 5):
        run.log_metrics({"loss": 1.0 / step}, step=step)  # never raises
    run.log_artifact(artifact)
    artifact.unlink()  # the stage's own file may be renamed or gone when the buffer is delivered
    run.log_params({"too_long": "x" * 7000})
    monkeypatch.setattr(tracking, "RECHECK_S", 3600.0)
    run.finish("FINISHED")
    lines = [json.loads(line) for line in run.buffer.path.read_text().splitlines()]
    assert [r["op"] for r in lines] == ["metrics"] * 4 + ["artifact", "params", "terminate"]
    assert Path(lines[4]["path"]).read_text() == "{}"

    logged = []
    client.down = False
    client.log_artifact = lambda run_id, path, artifact_path=None: logged.append(Path(path).read_text())
    assert tracking_buffer.flush_buffers(client, tmp_path / "buffers") == (6, 0)  # the too long param is dropped
    assert sorted(step for _, step, _ in client.metrics) == [0, 1, 2, 3, 4]
    assert logged == ["{}"] and client.status == "FINISHED"
    assert not list((tmp_path / "buffers").iterdir())
    assert tracking_buffer.flush_buffers(client, tmp_path / "buffers") == (0, 0)


def test_buffer_of_a_running_stage_is_left_to_it(tmp_path, quick_retries):
    client = FlakyClient()
    client.down = True
    run = tracking.StageRun(client, "run1", tmp_path / "run1.jsonl")
    run.log_metrics({"loss": 1.0}, step=0)
    client.down = False
    other = FlakyClient()
    assert tracking_buffer.flush_buffers(other, tmp_path) == (0, 0) and not other.calls  # locked by its stage
    run.log_metrics({"loss": 0.5}, step=1)  # the store answers again: the buffer goes first
    assert [s for _, s, _ in client.metrics] == [0, 1] and not run.buffer.pending
    run.finish()
    assert not (tmp_path / "run1.jsonl").exists()


def test_secret_looking_params_are_masked():
    """MLflow params are readable by everyone with access to the store: keys that look like secrets are masked."""
    from runtime.tracking import loggable_params
    logged = loggable_params({"data": {"hub_token": "hf_abc", "path": "x"}, "tracking": {"password": "pw"}, "lr": 0.1})
    assert logged == {"data.hub_token": "***", "data.path": "x", "tracking.password": "***", "lr": 0.1}
