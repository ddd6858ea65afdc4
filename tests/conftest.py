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


def pytest_collection_modifyitems(items):
    """tests/test_user_experiment.py's tests last (the others in their order): the user-experiment DAGs they read run
    beside every test before them (user_experiments)."""
    items.sort(key=lambda item: item.path.name == "test_user_experiment.py")


USER_RUNS = ("qwen2_run", "given_run", "gpt2_run", "rl_only_run")  # tests/user_experiments.py's


@pytest.fixture(scope="session")
def wanted_user_runs(request) -> set[str]:
    """The user-experiment runs that the session's tests read: named as fixtures, or as a parameter of a test that
    asks for its fixture by name (request.getfixturevalue)."""
    wanted = set()
    for item in request.session.items:
        params = item.callspec.params.values() if hasattr(item, "callspec") else ()
        wanted.update(name for name in USER_RUNS if name in item.fixturenames or name in params)
    return wanted


@pytest.fixture(scope="session")
def user_experiments(wanted_user_runs, tmp_path_factory):
    """The user-experiment DAGs that the session's tests read (tests/user_experiments.py), started with the first
    test after the Slurm scenario (user_experiments_after_slurm): they run beside the tests up to
    tests/test_user_experiment.py, which leave a quarter to most of two cores idle, and below them (niced), so that
    those tests' timers see little of them. Returns `result(name)`, which waits for a run's end."""
    from user_experiments import started
    with started(wanted_user_runs, tmp_path_factory.mktemp) as result:
        yield result


@pytest.fixture(autouse=True)
def user_experiments_after_slurm(request, wanted_user_runs):
    """Starts user_experiments with the session's first test outside tests/slurm (whose Slurm scenario leaves no core
    idle), where a test of the session reads them."""
    if wanted_user_runs and request.node.path.parent.name != "slurm":
        request.getfixturevalue("user_experiments")


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
