"""Running the workflow from tests as a user would (imported by the test modules; not a conftest, whose
module name would clash with tests/slurm/conftest.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from stages.config import REPO_ROOT

SNAKEMAKE = str(Path(sys.executable).with_name("snakemake"))


def snakemake(configfile: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the workflow as a user would, from the repository root with the local profile."""
    proc = subprocess.run([SNAKEMAKE, "--profile", "cluster_profiles/local", *args, "--configfile", str(configfile)],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def write_config(path: Path, results_dir: Path, **overrides) -> Path:
    """The tiny config, with results under `results_dir` and `overrides` merged in (one level deep)."""
    config = yaml.safe_load((REPO_ROOT / "config" / "tiny.yaml").read_text())
    config["results_dir"] = str(results_dir)
    for key, value in overrides.items():
        config[key] = config.get(key, {}) | value if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(config))
    return path


def submit_again(tiny_run: dict, stage_dir: Path, out_root: Path, **overrides):
    """Submit the stage that wrote `stage_dir` once more through the launcher's StageJob, with the params and
    inputs its stage.json records (the stage's own settings updated by `overrides`), writing under `out_root`
    and tracking to MLflow experiment `tiny-rerun`. Returns (submitit job, output dir, checkpoint dir)."""
    from stages.config import load_config_files
    from stages.launcher import StageJob, make_executor, stage_resources
    record = json.loads((stage_dir / "stage.json").read_text())
    params = record["params"]
    if overrides:
        params = params | {record["stage"]: params[record["stage"]] | overrides}
    resources, _ = stage_resources(record["stage"], load_config_files([tiny_run["configfile"]])["launcher"])
    absolute = lambda p: str(p if Path(p).is_absolute() else REPO_ROOT / p)
    inputs = {k: [absolute(p) for p in v] if isinstance(v, list) else absolute(v) for k, v in record["inputs"].items()}
    run_name = str(stage_dir.relative_to(tiny_run["results"]))
    output, checkpoints = out_root / run_name, out_root / "checkpoints" / run_name.replace("/", "-")
    job = make_executor(record["stage"], out_root / "logs", resources).submit(StageJob(
        stage=record["stage"], run_name=run_name, params=params, inputs=inputs, output=str(output),
        experiment="tiny-rerun", tracking_uri=tiny_run["mlflow_uri"], resources=resources,
        checkpoint_dir=str(checkpoints)))
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
