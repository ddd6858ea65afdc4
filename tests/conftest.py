import collections
import os
import signal
import time

import pytest

from pipeline_helpers import finish_dag, start_dag, write_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SESSION_START = time.monotonic()


@pytest.fixture(scope="session", autouse=True)
def tiny_dag(request, tmp_path_factory):
    """The tiny experiment's DAG, started before the session's first test where a test of the session reads it
    (tiny_run): it runs beside the tests before that one, the Slurm scenario among them, which leaves about a core
    of two idle (its jobs wait on Slurm's scheduling and requeue delays). (root, config file, its snakemake)."""
    if not any("tiny_run" in item.fixturenames for item in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("tiny")
    configfile = write_config(root / "tiny.yaml", root / "results")
    proc = start_dag(configfile, root)
    try:
        yield root, configfile, proc
    finally:
        if proc.poll() is None:  # the session broke off before a test waited for it: Ctrl-C, as a user stops it
            proc.send_signal(signal.SIGINT)
            proc.wait()


@pytest.fixture(scope="session")
def tiny_run(tiny_dag):
    """The tiny experiment run once end to end through the real launcher, Ray, DeepSpeed, vLLM and MLflow."""
    root, configfile, proc = tiny_dag
    return {"root": root, "configfile": configfile, "results": root / "results" / "tiny", "proc": finish_dag(proc, root),
            "mlflow_uri": f"sqlite:///{root / 'results' / 'mlflow.db'}"}


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, per test file (setup, call and teardown; a shared fixture counts in the file that
    first uses it: the tiny DAG, which starts with the session, as the wait for its end), after pytest's slowest tests
    (--durations): so that growth shows in every `make test`."""
    per_file = collections.Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                per_file[report.nodeid.split("::")[0]] += report.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", "time per test file")
    for path, seconds in per_file.most_common():
        terminalreporter.write_line(f"{seconds:7.0f} s  {path}")
    terminalreporter.write_line(f"{time.monotonic() - SESSION_START:7.0f} s  in all (wall clock, collection included)")
