import collections
import os
import time

import pytest

from pipeline_helpers import run_dag, write_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SESSION_START = time.monotonic()


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The tiny experiment run once end to end through the real launcher, Ray, DeepSpeed, vLLM and MLflow."""
    root = tmp_path_factory.mktemp("tiny")
    configfile = write_config(root / "tiny.yaml", root / "results")
    proc = run_dag(configfile)
    return {"root": root, "configfile": configfile, "results": root / "results" / "tiny", "proc": proc,
            "mlflow_uri": f"sqlite:///{root / 'results' / 'mlflow.db'}"}


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, per test file (setup, call and teardown; a shared fixture counts in the file that
    first uses it), after pytest's slowest tests (--durations): so that growth shows in every `make test`."""
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
