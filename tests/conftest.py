import collections
import os
import signal
import sys
import time
from pathlib import Path

import pytest

# Set before anything loads torch's OpenMP runtime; every job, stage and Ray worker of the session inherits it. Here
# DAGs and tests share 2 cores, and OpenMP's threads by default spin while they wait at the end of each parallel
# region, on cores the other processes need: two 2-thread torch trainers side by side (a tiny GPT-2, this 2-core
# machine) ran 1.7 it/s each spinning, 3.3-4.2 passive; alone, 7.2-8.0 spinning and 5.4-7.1 passive.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pipeline_helpers import finish_dag, start_dag, write_config  # noqa: E402

SESSION_START = time.monotonic()
CPU_TIME = collections.Counter()  # per test file: the machine's CPU seconds, all processes, busy and in all


def cpu_seconds() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine since boot, from /proc/stat (idle and iowait count as idle)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / ticks, sum(fields) / ticks


# The order of the session's test files, each keeping its tests' order: the Slurm tests first, beside the tiny DAG
# (`tiny_dag`); then the rest, beside the user-experiment DAGs (`user_runs`), which take the cores they leave idle:
# first the files that keep about one core of two busy (WAITING_FILES: they wait on servers, Ray and engine
# start-ups, a stall's limit; run after the DAGs had ended, 20-59% of the machine), while the DAGs certainly run,
# then those that keep both busy; then test_user_experiment.py and LAST_DAG_FILES (the last DAGs'), whose tests wait
# for those DAGs (a wait before the rest had run would leave those DAGs alone on the machine); last the files that
# time something against a short limit (TIMED_FILES: a refusal within seconds, a stall within 3 s), with the machine
# to themselves: beside a DAG, a dry run's refusal took up to 29 s instead of 2-3.
WAITING_FILES = ("test_ray_security.py", "test_tracking_faults.py", "test_user_data.py", "test_weight_sync.py",
                 "test_stall_watch_rl.py")
LAST_DAG_FILES = ("test_agent_rl.py", "test_rewards_and_teachers.py")
TIMED_FILES = ("test_checks_before_queueing.py", "test_config.py", "test_stall_watch.py")


def pytest_collection_modifyitems(items):
    def group(item) -> int:
        name = item.path.name
        return 0 if item.path.parent.name == "slurm" else 1 if name in WAITING_FILES else \
            3 if name == "test_user_experiment.py" else 3.5 if name in LAST_DAG_FILES else \
            4 if name in TIMED_FILES else 2
    items.sort(key=group)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    busy, total = cpu_seconds()
    yield
    busy_after, total_after = cpu_seconds()
    path = item.nodeid.split("::")[0]
    CPU_TIME[path, "busy"] += busy_after - busy
    CPU_TIME[path, "all"] += total_after - total


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


@pytest.fixture(scope="session", autouse=True)
def user_runs(request, tmp_path_factory, tiny_dag):
    """tests/test_user_experiment.py's DAG runs that the session's tests read, in the background from the session's
    start once the tiny DAG has ended (test_user_experiment.UserRuns); None where no test reads one."""
    module = sys.modules.get("test_user_experiment")  # (there where the session collected it)
    wanted = {name for item in request.session.items for name in item.fixturenames if name in module.USER_RUNS} \
        if module else set()
    if not wanted:
        yield None
        return
    runs = module.UserRuns(tmp_path_factory, wanted,
                           busy=lambda: tiny_dag is not None and tiny_dag[2].poll() is None)
    try:
        yield runs
    finally:
        runs.close()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, per test file (setup, call and teardown; a shared fixture counts in the file that
    first uses it: the tiny DAG, which starts with the session, as the wait for its end), after pytest's slowest tests
    (--durations): so that growth shows in every `make test`. Beside each, how busy the machine's CPUs were meanwhile
    (all processes): where they idle, a test waits (on Slurm, a timeout, a stall) and something could run beside it."""
    per_file = collections.Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                per_file[report.nodeid.split("::")[0]] += report.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", "time per test file")
    for path, seconds in per_file.most_common():
        all_s = CPU_TIME[path, "all"]
        busy = f"{100 * CPU_TIME[path, 'busy'] / all_s:3.0f}% busy" if all_s else ""
        terminalreporter.write_line(f"{seconds:7.0f} s  {busy:9}  {path}")
    terminalreporter.write_line(f"{time.monotonic() - SESSION_START:7.0f} s  in all (wall clock, collection included)")
