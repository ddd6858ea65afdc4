"""Retries and the buffer of MLflow writes, under `tracking.StageRun`.

`retry` tries a write again while the store answers with a transient error (sqlite's 'database is locked' under
many jobs, a server that is down or restarting). A write that still fails goes to its run's buffer file, a JSON
line per write, to be delivered later (`deliver`, `flush_buffers`): MLflow keeps a metric once however often the
same (key, step, timestamp, value) is logged, so a buffer delivered twice changes nothing. Buffers live beside the
store (sqlite: `<db dir>/mlflow-buffer/<experiment>/<run id>.jsonl`; a server:
`~/.cache/alignpipe/mlflow-buffer/<host>/<experiment>/`), not in the stage's output: a failed stage's output is
deleted, and a finished one is Snakemake's to judge, not to be edited by later stages.
"""
import fcntl
import json
import os
import random
import re
import shutil
import time
import urllib.parse
from pathlib import Path

RETRY_BUDGET_S = 30.0                   # how long one write is retried before it is buffered
RETRY_DELAYS_S = (0.5, 1, 2, 4, 8, 15)  # between tries (with jitter), cut short by the budget
# MLflow error codes of a request that is wrong in itself: retrying or buffering it cannot help.
REFUSED_CODES = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "MALFORMED_REQUEST", "RESOURCE_ALREADY_EXISTS",
                 "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "ENDPOINT_NOT_FOUND"}
# ... and of one that the store refuses to this client: not retried, but buffered (credentials can be fixed).
AUTH_CODES = {"PERMISSION_DENIED", "UNAUTHENTICATED", "CUSTOMER_UNAUTHORIZED"}
MAX_BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's log_batch limits


def say(text: str) -> None:
    print(f"[alignpipe] tracking: {text}", flush=True)


# --- retries, and what cannot wait -----------------------------------------------------------------------------

def _code(err: BaseException) -> str | None:
    return getattr(err, "error_code", None)


def hopeless(err: BaseException) -> bool:
    """A write that cannot succeed later either: the store says the request itself is wrong (a changed param, an
    unknown run), or the error is not one of talking to a store (a bug)."""
    return not transient(err) and _code(err) not in AUTH_CODES


def transient(err: BaseException) -> bool:
    """Worth trying again: sqlite locked or busy, a server down, restarting or overloaded, a network error."""
    from mlflow.exceptions import MlflowException
    if isinstance(err, MlflowException):
        return _code(err) not in REFUSED_CODES | AUTH_CODES
    if isinstance(err, FileNotFoundError):  # an artifact that is not there
        return False
    return isinstance(err, (OSError, TimeoutError)) or type(err).__module__.split(".")[0] in (
        "requests", "urllib3", "sqlalchemy", "sqlite3")


def retry(call, budget_s: float | None = None, on_retry=None, sleep=time.sleep):
    """`call()`, tried again after RETRY_DELAYS_S (with jitter, so parallel jobs do not retry in step) while it
    fails with a transient error and the next try starts within `budget_s` (RETRY_BUDGET_S); the last error is
    raised."""
    deadline = time.monotonic() + (RETRY_BUDGET_S if budget_s is None else budget_s)
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return call()
        except Exception as err:
            if delay is None or not transient(err) or time.monotonic() + delay > deadline:
                raise
            if on_retry:
                on_retry(err)
            sleep(delay * random.uniform(0.8, 1.2))


# --- the buffer: writes not yet delivered ---------------------------------------------------------------------

def default_buffer_dir(uri: str, experiment: str) -> Path:
    """Where the buffers of an experiment's runs live: beside a sqlite store, else in the user's cache (a shared
    home on clusters), per server."""
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).parent / "mlflow-buffer" / safe_name(experiment)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    server = urllib.parse.urlsplit(uri).netloc or uri
    return cache / "alignpipe" / "mlflow-buffer" / safe_name(server) / safe_name(experiment)


def safe_name(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def send(client, records: list[dict]) -> None:
    """Send `records` (consecutive writes of one kind, one run) to MLflow."""
    import mlflow.entities as entities
    first = records[0]
    run_id, op = first["run_id"], first["op"]
    if op == "metrics":
        client.log_batch(run_id, metrics=[entities.Metric(k, v, ts, step)
                                          for r in records for k, v, ts, step in r["metrics"]])
    elif op == "params":
        client.log_batch(run_id, params=[entities.Param(k, v) for r in records for k, v in r["params"].items()])
    elif op == "tags":
        client.log_batch(run_id, tags=[entities.RunTag(k, v) for r in records for k, v in r["tags"].items()])
    elif op == "artifact":
        client.log_artifact(run_id, first["path"], first.get("artifact_path"))
    elif op == "terminate":
        client.set_terminated(run_id, first["status"], first["end_time"])
    else:
        raise ValueError(f"unknown buffered write {op!r}")


def _groups(records: list[dict]) -> list[list[dict]]:
    """Consecutive records of one kind and run batched together (up to MLflow's batch limits)."""
    groups: list[list[dict]] = []
    size = 0
    for record in records:
        op, items = record["op"], len(record.get(record["op"], ())) if record["op"] in MAX_BATCH else 0
        last = groups[-1][-1] if groups else None
        if last and op in MAX_BATCH and last["op"] == op and last["run_id"] == record["run_id"] \
                and size + items <= MAX_BATCH[op]:
            groups[-1].append(record)
            size += items
        else:
            groups.append([record])
            size = items
    return groups


def deliver(client, records: list[dict]) -> tuple[list[dict], BaseException | None, int]:
    """Send buffered `records` in order, one try each, until the store fails transiently. Returns the records
    left (from that failure on), the error, and how many were dropped: a write the store refuses outright, shown
    in a line of the log, as it cannot succeed later either."""
    groups, dropped = _groups(records), 0
    for index, group in enumerate(groups):
        try:
            if group[0]["op"] == "artifact" and not Path(group[0]["path"]).exists():
                raise FileNotFoundError(f"the buffered copy {group[0]['path']} is gone")
            send(client, group)
        except Exception as err:
            if hopeless(err):
                say(f"a buffered write cannot be delivered, dropped ({str(err)[:300]}): {json.dumps(group)[:500]}")
                dropped += len(group)
                continue
            return [r for g in groups[index:] for r in g], err, dropped
        for record in group:
            if record["op"] == "artifact" and record.get("copy"):
                shutil.rmtree(Path(record["path"]).parent, ignore_errors=True)
    return [], None, dropped


class RunBuffer:
    """One run's buffer file: JSON lines, appended by its stage, which holds an exclusive lock on it for as long
    as it runs, so that other stages delivering leftover buffers skip it. Written artifacts are copied beside it
    (`<run id>.artifacts/`): the stage's own file may be gone, or renamed, by the time they are delivered."""

    def __init__(self, path: Path):
        self.path, self.fh, self.pending, self.copies = path, None, 0, 0

    def _open(self):
        if self.fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = self.path.open("a+")
            fcntl.flock(self.fh, fcntl.LOCK_EX)

    def append(self, record: dict) -> None:
        self._open()
        if record["op"] == "artifact":
            source = Path(record["path"])
            self.copies += 1
            copy = self.path.with_suffix(".artifacts") / str(self.copies) / source.name
            copy.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if source.is_dir() else shutil.copy2)(source, copy)
            record = record | {"path": str(copy), "copy": True}
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        self.pending += 1

    def records(self) -> list[dict]:
        self.fh.seek(0)
        return _parse(self.fh.read(), self.path)

    def replace(self, records: list[dict]) -> None:
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write("".join(json.dumps(r) + "\n" for r in records))
        self.fh.flush()
        self.pending = len(records)

    def close(self) -> None:
        """Remove the file if nothing is left in it; release it either way."""
        if self.fh is None:
            return
        if not self.pending:
            self.path.unlink(missing_ok=True)
            shutil.rmtree(self.path.with_suffix(".artifacts"), ignore_errors=True)
        else:
            os.fsync(self.fh.fileno())
        self.fh.close()
        self.fh = None


def _parse(text: str, path: Path) -> list[dict]:
    """The records of a buffer file; a line cut short (its job killed while writing it) is skipped."""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            if line.strip():
                say(f"skipped a line of {path} that is not a whole record: {line[:200]}")
    return records


def flush_buffers(client, directory: Path) -> tuple[int, int]:
    """Deliver the buffers left in `directory` by stages that have ended (a buffer whose stage still runs is
    locked, and skipped). Stops at the first transient failure: the store is down, the rest can wait. Returns
    (writes delivered, writes left)."""
    delivered = left = 0
    if not directory.is_dir():
        return 0, 0
    for path in sorted(directory.glob("*.jsonl")):
        try:
            fh = path.open("r+")
        except FileNotFoundError:  # delivered meanwhile by another stage
            continue
        with fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its stage is still running
                continue
            records = _parse(fh.read(), path)
            if not records:  # being created by its stage right now, or already delivered
                continue
            rest, err, dropped = deliver(client, records)
            delivered += len(records) - len(rest) - dropped
            if rest:
                fh.seek(0)
                fh.truncate()
                fh.write("".join(json.dumps(r) + "\n" for r in rest))
                left += len(rest)
                say(f"MLflow still fails ({err}); {len(rest)} buffered writes stay in {path}")
                break
            path.unlink(missing_ok=True)
            shutil.rmtree(path.with_suffix(".artifacts"), ignore_errors=True)
    if delivered:
        say(f"delivered {delivered} buffered writes of earlier stages from {directory}")
    return delivered, left
