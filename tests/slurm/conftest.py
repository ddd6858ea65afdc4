"""One real two-node Slurm cluster per pytest session (see local_cluster.sh for what it is)."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("local_cluster.sh")
UP_TIMEOUT_S = 900  # a fresh machine installs the Debian packages first (~30 s here, more on a slow mirror)


def _read_env_sh(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            env[key] = value
    return env


def _script(cmd: str, run_dir: Path, timeout: float) -> subprocess.CompletedProcess:
    # stdin/stdout/stderr are ours; the script redirects every daemon's, so this returns when it does.
    return subprocess.run(
        ["bash", str(SCRIPT), cmd, str(run_dir)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running cluster: nodes n1 (10.77.0.11) and n2 (10.77.0.12), each CPUs=2 RealMemory=8000 Gres=gpu:2
    (placeholder GPUs: jobs may ask for --gpus-per-node, nothing runs on them; see local_cluster.sh).

    Sets SLURM_CONF (and the ALIGNPIPE_SLURM_* variables of env.sh) in os.environ for the session, so
    submitit, sbatch and sacct called from the tests find the cluster. Yields a dict:
      run_dir, slurm_conf, env (os.environ with those variables), partition ("debug", the default),
      preempt_partition ("high": same nodes, its jobs preempt and requeue debug jobs),
      nodes ({"n1": "10.77.0.11", "n2": "10.77.0.12"}), gpus_per_node (2), controller_addr ("10.77.0.1"), script.
    Job ids restart at 1 in every session: give each submitit executor a fresh folder.
    """
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (network namespaces, daemons, apt-get)")
    run_dir = tmp_path_factory.mktemp("slurm-cluster")
    try:
        up = _script("up", run_dir, UP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        _script("down", run_dir, 300)
        pytest.fail(f"local_cluster.sh up took over {UP_TIMEOUT_S}s:\n{e.stderr}", pytrace=False)
    if up.returncode != 0:
        _script("down", run_dir, 300)
        pytest.fail(
            f"local_cluster.sh up failed (rc={up.returncode}):\n{up.stdout[-3000:]}\n{up.stderr[-6000:]}",
            pytrace=False,
        )
    exported = _read_env_sh(run_dir / "env.sh")
    patch = pytest.MonkeyPatch()
    for key, value in exported.items():
        patch.setenv(key, value)
    try:
        yield {
            "run_dir": run_dir,
            "slurm_conf": exported["SLURM_CONF"],
            "env": dict(os.environ),
            "partition": exported["ALIGNPIPE_SLURM_PARTITION"],
            "preempt_partition": exported["ALIGNPIPE_SLURM_PREEMPT_PARTITION"],
            "nodes": dict(
                zip(exported["ALIGNPIPE_SLURM_NODES"].split(), exported["ALIGNPIPE_SLURM_NODE_ADDRS"].split())
            ),
            "gpus_per_node": int(exported["ALIGNPIPE_SLURM_NODE_GPUS"]),
            "controller_addr": exported["ALIGNPIPE_SLURM_CONTROLLER_ADDR"],
            "script": SCRIPT,
        }
    finally:
        patch.undo()
        down = _script("down", run_dir, 300)
        if down.returncode != 0:
            print(f"local_cluster.sh down failed (rc={down.returncode}):\n{down.stderr[-3000:]}")
