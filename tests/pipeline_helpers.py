"""Running the workflow from tests as a user would (imported by the test modules; not a conftest, whose
module name would clash with tests/slurm/conftest.py)."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from launcher.config import REPO_ROOT

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))
DAG_JOBS = 2


def snakemake_command(configfile: Path, *args: str) -> list[str]:
    """The workflow's command as a user runs it, from the repository root with the local profile."""
    return [SNAKEMAKE, "--profile", "cluster_profiles/local", *args, "--configfile", str(configfile)]


def checked(proc: subprocess.CompletedProcess, check: bool = True) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(proc.args[3:-2])} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def snakemake(configfile: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the workflow as a user would (`env`: set in its environment too); raise with its output's ends if it fails
    (unless not `check`)."""
    return checked(subprocess.run(snakemake_command(configfile, *args), cwd=REPO_ROOT, capture_output=True, text=True,
                                  env=os.environ | env if env else None), check)


def dag_args(*args: str) -> tuple[str, ...]:
    """The whole DAG (`all`), two stages at a time where the DAG allows (the local profile runs one): a tiny stage
    leaves about 40% of two cores idle (process, Ray and vLLM start-up, log polling), and its results do not depend
    on what runs beside it (each stage's threads and seeds come from its config)."""
    return "all", "--jobs", str(DAG_JOBS), *args


def run_dag(configfile: Path, *args: str) -> subprocess.CompletedProcess:
    return snakemake(configfile, *dag_args(*args))


def start_dag(configfile: Path, out_dir: Path, env: dict | None = None) -> subprocess.Popen:
    """run_dag's DAG in the background, its output in `out_dir` (dag.out, dag.err); finish_dag waits for it."""
    return subprocess.Popen(snakemake_command(configfile, *dag_args()), cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                            stdout=(out_dir / "dag.out").open("w"), stderr=(out_dir / "dag.err").open("w"),
                            env=os.environ | env if env else None)


def finish_dag(proc: subprocess.Popen, out_dir: Path) -> subprocess.CompletedProcess:
    """What run_dag returns, for a DAG that start_dag started: once it has ended; raises as run_dag if it failed."""
    proc.wait()
    return checked(subprocess.CompletedProcess(proc.args, proc.returncode, (out_dir / "dag.out").read_text(),
                                               (out_dir / "dag.err").read_text()))


def planned_jobs(dry_run_stdout: str) -> dict[str, int]:
    """The 'Job stats' table of `snakemake --dry-run`: rule -> count."""
    if "Nothing to be done" in dry_run_stdout:
        return {}
    table = dry_run_stdout.split("Job stats:")[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


def planned_outputs(dry_run_stdout: str, experiment: str = "tiny") -> set[str]:
    """The output paths of the jobs a dry run plans, relative to the experiment's results."""
    return {m.group(1).split(f"/{experiment}/")[-1] for m in re.finditer(r"^\s+output: (\S+)$", dry_run_stdout, re.M)}


def dry_run_with_edited_code(configfile: Path, copy_dir: Path, edits: dict[str, tuple[str, str]]) -> str:
    """What `snakemake all --dry-run` plans once the project's code is edited: the repository's files are copied to
    `copy_dir`, each edit {path: (old, new)} is applied there, and the copy's Snakefile plans against this
    checkout's working directory (its results and Snakemake's records of the runs). Returns the dry run's stdout."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO_ROOT / name).is_file():
            (copy_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, copy_dir / name)
    for name, (old, new) in edits.items():
        text = (copy_dir / name).read_text()
        assert old in text, f"{name} no longer contains {old!r}: update the test's edit"
        (copy_dir / name).write_text(text.replace(old, new, 1))
    return snakemake(configfile, "all", "--dry-run", "--snakefile", str(copy_dir / "Snakefile")).stdout


def wait_until(predicate, timeout: float, what: str | None = None, interval: float = 0.5):
    """Call `predicate` until it returns something true, and return that. After `timeout` seconds: raise naming
    `what` if given, else return its last (false) value for the caller's own assertion."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            if what:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            return value
        time.sleep(interval)
    return value


def fake_slurm_commands(directory: Path, partitions: str = "debug*", sinfo_fails: bool = False) -> Path:
    """A folder of stand-ins for Slurm's `sbatch` and `sinfo`, to put first on PATH: the checks before queueing
    want both there and ask `sinfo` for the cluster's partitions (`partitions`, comma-separated, the default marked
    `*`: printed one a line), or it fails as without a reachable controller; the stand-in sbatch submits nothing."""
    directory.mkdir(parents=True, exist_ok=True)
    answer = ("echo 'sinfo: error: Unable to contact slurm controller (connect failure)' >&2\nexit 1" if sinfo_fails
              else f"printf '%s\\n' {' '.join(map(shlex.quote, partitions.split(',')))}")
    (directory / "sinfo").write_text(f"#!/bin/sh\n{answer}\n")
    (directory / "sbatch").write_text("#!/bin/sh\necho 'sbatch: a stand-in, nothing submitted' >&2\nexit 1\n")
    for command in ("sbatch", "sinfo"):
        (directory / command).chmod(0o755)
    return directory


def write_config(path: Path, results_dir: Path, **overrides) -> Path:
    """The tiny config, with results under `results_dir` and `overrides` merged in (one level deep)."""
    config = yaml.safe_load((REPO_ROOT / "config" / "tiny.yaml").read_text())
    config["results_dir"] = str(results_dir)
    for key, value in overrides.items():
        config[key] = config.get(key, {}) | value if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(config))
    return path


def submit_again(tiny_run: dict, stage_dir: Path, out_root: Path, experiment: str = "tiny-rerun", **overrides):
    """Submit the stage that wrote `stage_dir` once more through the launcher's StageJob, with the params and
    inputs its stage.json records (the stage's own settings updated by `overrides`), writing under `out_root`
    and tracking to MLflow experiment `experiment` (jobs that run at once need their own: a stage's new run marks
    a RUNNING one of its name stale). Returns (submitit job, output dir, checkpoint dir)."""
    from launcher.config import load_config_files
    from launcher.resources import stage_resources
    from launcher.submit import make_executor
    from runtime.job import StageJob
    record = json.loads((stage_dir / "stage.json").read_text())
    params = record["params"]
    if overrides:
        params = params | {record["stage"]: params[record["stage"]] | overrides}
    launcher = load_config_files([tiny_run["configfile"]])["launcher"]
    resources, _ = stage_resources(record["stage"], launcher)
    absolute = lambda p: str(p if Path(p).is_absolute() else REPO_ROOT / p)
    inputs = {k: [absolute(p) for p in v] if isinstance(v, list) else absolute(v) for k, v in record["inputs"].items()}
    run_name = str(stage_dir.relative_to(tiny_run["results"]))
    output, checkpoints = out_root / run_name, out_root / "checkpoints" / run_name.replace("/", "-")
    job = make_executor(record["stage"], out_root / "logs", resources).submit(StageJob(
        stage=record["stage"], run_name=run_name, params=params, inputs=inputs, output=str(output),
        experiment=experiment, tracking_uri=tiny_run["mlflow_uri"], resources=resources,
        checkpoint_dir=str(checkpoints), hub_downloads=launcher["hub_downloads"]))
    return job, output, checkpoints


def signal_job_tasks(job, signum: int) -> int:
    """Send `signum` to the tasks of a local submitit job, as Slurm signals a job's tasks before a timeout or on
    preemption. (submitit's own `job._interrupt()` signals the local executor's controller process, which does
    not forward USR2 and dies of it.) Returns how many tasks were signalled."""
    controller, signalled = job._process.pid, 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == controller:
                os.kill(int(stat.parent.name), signum)
                signalled += 1
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return signalled
