"""Running the workflow from tests as a user would (imported by the test modules; not a conftest, whose
module name would clash with tests/slurm/conftest.py)."""
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
