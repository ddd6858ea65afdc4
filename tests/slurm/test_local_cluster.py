"""The local two-node Slurm cluster works the way the pipeline's tests will use it."""

import os
import subprocess
import sys
import time

import pytest
import submitit
from submitit.core.utils import UncompletedJobError

from pipeline_helpers import wait_until

pytestmark = pytest.mark.slurm


def _run(*cmd: str, timeout: float = 120, env: dict | None = None) -> str:
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, f"{cmd} failed (rc={out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _job_fields(job_id: str) -> dict[str, str]:
    fields = {}
    for word in _run("scontrol", "-o", "show", "job", job_id).split():
        key, _, value = word.partition("=")
        fields[key] = value
    return fields


def _sbatch(tmp_path, *args: str) -> str:
    return _run("sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out", *args).strip()


def test_srun_answers_from_two_hosts(slurm_cluster, tmp_path):
    out = _run("srun", "-N2", "-l", f"--chdir={tmp_path}", "-p", slurm_cluster["partition"], "hostname")
    hosts = sorted(line.split(":", 1)[1].strip() for line in out.splitlines())
    assert hosts == ["n1", "n2"]


def test_nodes_reach_each_other_the_controller_and_their_own_loopback(slurm_cluster, tmp_path):
    """What Ray needs: a head on n1 and a worker on n2 talking TCP; each node's own 127.0.0.1."""
    script = tmp_path / "net.py"
    script.write_text(
        """
import os, socket, sys, time
n1_addr, n2_addr = sys.argv[1], sys.argv[2]
controller, ctld_port, port = sys.argv[3], int(sys.argv[4]), 47123
me = socket.gethostname()
srv = socket.create_server(("127.0.0.1", 0))
with socket.create_connection(srv.getsockname(), timeout=5) as c, srv.accept()[0] as a:
    c.sendall(b"lo")
    assert a.recv(2) == b"lo"
socket.create_connection((controller, ctld_port), timeout=5).close()
if me == "n2":
    with socket.create_server(("0.0.0.0", port)) as s:
        conn, addr = s.accept()
        conn.sendall(me.encode())
        print(me, "served", addr[0], flush=True)
else:
    deadline = time.time() + 30
    while True:
        try:
            c = socket.create_connection((n2_addr, port), timeout=2)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    print(me, "got", c.recv(16).decode(), flush=True)
"""
    )
    ctld_port = next(
        line.split("=")[1].strip()
        for line in _run("scontrol", "show", "config").splitlines()
        if line.startswith("SlurmctldPort")
    )
    nodes = slurm_cluster["nodes"]
    out = _run(
        "srun", "-N2", "--ntasks-per-node=1", f"--chdir={tmp_path}", "-p", slurm_cluster["partition"],
        sys.executable, str(script), nodes["n1"], nodes["n2"], slurm_cluster["controller_addr"], ctld_port,
        timeout=90,
    )
    assert sorted(out.splitlines()) == ["n1 got n2", f"n2 served {nodes['n1']}"], out


def test_submitit_two_node_job_returns_one_result_per_task(slurm_cluster, tmp_path):
    def where():  # defined here so cloudpickle ships it by value (the node cannot import this module)
        import os
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ["ALIGNPIPE_SLURM_CONTROLLER_ADDR"], 9))  # no packet sent: picks the route
            ip = s.getsockname()[0]
        return {"procid": int(os.environ["SLURM_PROCID"]), "host": socket.gethostname(), "ip": ip}

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(
        slurm_partition=slurm_cluster["partition"], nodes=2, tasks_per_node=1, cpus_per_task=1, mem_gb=1,
        timeout_min=5,
    )
    job = executor.submit(where)
    results = sorted(job.results(), key=lambda r: r["procid"])
    assert [r["procid"] for r in results] == [0, 1]
    assert {r["host"] for r in results} == {"n1", "n2"}
    assert {r["ip"] for r in results} == set(slurm_cluster["nodes"].values())
    for r in results:
        assert slurm_cluster["nodes"][r["host"]] == r["ip"]


def test_nodes_declare_gpus_that_jobs_can_ask_for(slurm_cluster, tmp_path):
    """Placeholder GPUs (local_cluster.sh): --gpus-per-node is accepted up to a node's count and allocated; the job
    learns its count from SLURM_GPUS_ON_NODE. Slurm binds no device, so it sets no CUDA_VISIBLE_DEVICES (nor
    SLURM_JOB_GPUS): inside a job, Ray hands out the GPU ids (`ray start --num-gpus`)."""
    gpus = slurm_cluster["gpus_per_node"]
    assert gpus >= 1, "the cluster was started with AP_SLURM_NODE_GPUS=0"
    for node in slurm_cluster["nodes"]:
        fields = dict(w.partition("=")[::2] for w in _run("scontrol", "-o", "show", "node", node).split())
        assert fields["Gres"] == f"gpu:{gpus}" and f"gres/gpu={gpus}" in fields["CfgTRES"].split(","), fields
    part = ["-p", slurm_cluster["partition"]]
    _run("sbatch", "--test-only", *part, "-N2", f"--gpus-per-node={gpus}", "--wrap=true")
    too_many = subprocess.run(["sbatch", "--test-only", *part, f"--gpus-per-node={gpus + 1}", "--wrap=true"],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert too_many.returncode != 0 and "Requested node configuration is not available" in too_many.stderr
    # Not the caller's CUDA_VISIBLE_DEVICES: sbatch/srun export the submitting environment to the job.
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS")}
    out = _run("srun", "-N2", "--ntasks-per-node=1", f"--gpus-per-node={gpus}", f"--chdir={tmp_path}", *part,
               "bash", "-c", 'echo "$(hostname) $SLURM_JOB_ID ${SLURM_GPUS_ON_NODE:-unset} '
               '${CUDA_VISIBLE_DEVICES:-unset} ${SLURM_JOB_GPUS:-unset}"', timeout=90, env=env)
    rows = sorted(line.split() for line in out.splitlines())
    assert [(r[0], r[2], r[3], r[4]) for r in rows] == [(n, str(gpus), "unset", "unset") for n in ("n1", "n2")], out
    job_id = rows[0][1]
    alloc_tres = lambda: _run("sacct", "-X", "-n", "-P", "-j", job_id, "-o", "AllocTRES").strip()
    # slurmdbd may not have the job's record at once
    assert wait_until(lambda: f"gres/gpu={2 * gpus}" in alloc_tres().split(","), 60), alloc_tres()


def test_sacct_lists_the_finished_job(slurm_cluster, tmp_path):
    job_id = _sbatch(tmp_path, "--wait", "--job-name=acct-check", "--wrap", "echo hello")

    expected = f"{job_id}|acct-check|COMPLETED|0:0"
    seen = []

    def state():
        # slurmdbd may first record the job under a placeholder name ("allocation"); wait for the full record.
        seen.append(_run("sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,JobName,State,ExitCode").strip())
        return seen[-1] == expected

    try:
        wait_until(state, 60, f"sacct to list job {job_id}")
    except AssertionError:
        raise AssertionError(f"sacct never showed {expected!r}; last: {seen[-1:]}") from None


def test_cancelled_submitit_job_raises_uncompleted(slurm_cluster, tmp_path):
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(slurm_partition=slurm_cluster["partition"], timeout_min=10, cpus_per_task=1, mem_gb=1)
    job = executor.submit(time.sleep, 600)
    # force: submitit otherwise backs off its sacct polls (2, 4, 8, ... s after submission)
    wait_until(lambda: job.get_info(mode="force").get("State") == "RUNNING", 60, f"job {job.job_id} to run")
    job.cancel(check=True)
    wait_until(lambda: job.done(force_check=True), 120, f"job {job.job_id} to be seen as finished")
    assert job.state.startswith("CANCELLED")
    with pytest.raises(UncompletedJobError):
        job.result()


def test_scontrol_requeue_restarts_a_running_job(slurm_cluster, tmp_path):
    job_id = _sbatch(
        tmp_path, "--requeue", "--open-mode=append", "--wrap", "echo start restarts=${SLURM_RESTART_COUNT:-0}; sleep 600"
    )
    log = tmp_path / f"slurm-{job_id}.out"

    def log_text():
        return log.read_text() if log.exists() else ""

    try:
        # RUNNING comes before slurmstepd has started the script: requeue only once its first line is written.
        wait_until(lambda: "restarts=0" in log_text(), 60, f"job {job_id} to start its script")
        _run("scontrol", "requeue", job_id)
        assert _job_fields(job_id)["Restarts"] == "1"
        # Requeued jobs wait cred_expire (20 s in local_cluster.sh) before they may start again.
        wait_until(lambda: _job_fields(job_id)["JobState"] == "RUNNING", 90, f"job {job_id} to run again")
        wait_until(lambda: "restarts=1" in log_text(), 30, "the restarted job's output")
        starts = [line for line in log.read_text().splitlines() if line.startswith("start")]
        assert starts == ["start restarts=0", "start restarts=1"]
    finally:
        subprocess.run(["scancel", job_id], check=False)


def test_high_partition_preempts_and_requeues_a_debug_job(slurm_cluster, tmp_path):
    low = _sbatch(tmp_path, "-p", slurm_cluster["partition"], "-N2", "--exclusive", "--requeue", "--wrap", "sleep 600")
    high = None
    try:
        wait_until(lambda: _job_fields(low)["JobState"] == "RUNNING", 60, f"job {low} to run")
        high = _sbatch(tmp_path, "-p", slurm_cluster["preempt_partition"], "-N1", "--wrap", "sleep 600")
        wait_until(lambda: _job_fields(high)["JobState"] == "RUNNING", 60, f"preempting job {high} to run")
        low_fields = _job_fields(low)
        assert low_fields["Restarts"] == "1"
        assert low_fields["JobState"] in {"PENDING", "REQUEUED", "COMPLETING"}
    finally:
        subprocess.run(["scancel", low] + ([high] if high else []), check=False)
