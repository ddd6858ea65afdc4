"""No orphans, no double runs (launcher/supervise.py): a launcher whose Snakemake is killed cancels its job; an output
being produced is locked (`<output>.lock`) and a second launch on it is refused while its job lives; results,
checkpoints and job pickles are not readable by other users, and nothing is loaded from a directory they may write.

Snakemake runs here with its own working directory (--directory), so that `snakemake --unlock` touches no other
run of this checkout."""
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.code_hash import stage_code_hash
from launcher.config import REPO_ROOT, load_config_files
from launcher.submit import apply_umask, died_before_ray_was_up, launch_stage
from launcher.supervise import HOST, OutputLock, StageFailed, cancel_job, proc_stat
from pipeline_helpers import SNAKEMAKE, wait_until, write_config
from runtime import checkpoints
from runtime.ray_cluster import GCS_PORT_TAKEN

SUBMITTED = re.compile(r"\[alignpipe\] base_model: job (?P<id>\d+) submitted \(.*?\), log (?P<log>\S+)")


def snakemake_command(configfile: Path, root: Path, *args: str) -> list[str]:
    return [SNAKEMAKE, "--profile", "cluster_profiles/local", "--snakefile", str(REPO_ROOT / "Snakefile"),
            "--directory", str(root / "wd"), *args, "--configfile", str(configfile)]


def start_snakemake(configfile: Path, root: Path, *args: str, name: str) -> tuple[subprocess.Popen, Path]:
    """`snakemake --profile cluster_profiles/local ARGS` in the background, working directory root/wd."""
    out = root / f"{name}.out"
    proc = subprocess.Popen(snakemake_command(configfile, root, *args), cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                            stdout=out.open("w"), stderr=subprocess.STDOUT)
    return proc, out


def processes_mentioning(text: str) -> list[str]:
    """Running processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            found.append(f"{entry.name}: {cmdline[:300]}")
    return found


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.e2e
def test_killed_snakemake_leaves_nothing_running_and_a_rerun_runs_one_job(tmp_path):
    configfile = write_config(tmp_path / "orphans.yaml", tmp_path / "results", experiment="orphans")
    results = tmp_path / "results" / "orphans"
    output, partial, lock = results / "base_model", results / "base_model.partial", results / "base_model.lock"
    rule_log = results / "logs" / "base_model.log"
    first, first_out = start_snakemake(configfile, tmp_path, str(output), name="first")
    try:
        submitted = wait_until(lambda: SUBMITTED.search(read(rule_log)) or first.poll() is not None, 180,
                               "the base_model job to be submitted")
        assert first.poll() is None, read(first_out)[-4000:]
        # Mid-stage: the job's driver has made its partial output and not yet published it.
        wait_until(lambda: partial.exists() or output.exists(), 120, "the job to start its stage")
        assert not output.exists(), "the stage finished before the test could kill Snakemake"
        holder = json.loads(lock.read_text())
        assert holder["job_id"] == submitted["id"] and holder["state"] == "running" and holder["host"] == HOST
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
    killed_at = time.monotonic()
    job_dir = str(Path(submitted["log"]).parent)
    # At once: unlock and rerun, while the orphaned launcher cancels its job.
    unlock = subprocess.run(snakemake_command(configfile, tmp_path, "--unlock"), cwd=REPO_ROOT, capture_output=True,
                            text=True)
    assert unlock.returncode == 0, unlock.stderr[-3000:]
    rerun, rerun_out = start_snakemake(configfile, tmp_path, str(output), name="rerun")
    try:
        gone = wait_until(lambda: not processes_mentioning(job_dir) and _pid_gone(holder["launcher_pid"]), 20)
        assert gone, f"the killed run's job or launcher still runs {time.monotonic() - killed_at:.0f} s after " \
                     f"the kill:\n{processes_mentioning(job_dir)}"
        assert rerun.wait(300) == 0, read(rerun_out)[-6000:] + read(rule_log)[-3000:]
    finally:
        if rerun.poll() is None:
            rerun.kill()
    # The rerun's one job produced the whole output; nothing of either run is left.
    assert (output / "stage.json").exists() and (output / "config.json").exists()
    assert not partial.exists() and not lock.exists()
    reruns = SUBMITTED.findall(read(rule_log))
    assert len(reruns) == 1 and reruns[0][0] != submitted["id"], read(rule_log)[-3000:]
    assert sorted(p.name for p in (results / "logs" / "base_model").iterdir()) == \
        sorted({Path(submitted["log"]).parent.name, Path(reruns[0][1]).parent.name}), "one job per run"
    assert "Job completed successfully" not in read(Path(submitted["log"])), "the killed run's job finished"
    assert wait_until(lambda: not processes_mentioning(str(tmp_path)), 10), processes_mentioning(str(tmp_path))
    # What the stage wrote and the job's pickles: nothing for other users (umask 027).
    pickles = list(Path(reruns[0][1]).parent.glob("*.pkl"))
    assert pickles
    for path in [output, output / "stage.json", output / "config.json", *pickles]:
        assert path.stat().st_mode & 0o007 == 0, f"{path} is open to other users: {stat.filemode(path.stat().st_mode)}"


def _pid_gone(pid: int) -> bool:
    stat_ = proc_stat(pid)
    return stat_ is None or stat_.state in ("Z", "X")


def base_model_job(tmp_path: Path, experiment: str) -> tuple[dict, dict, Path]:
    """The base_model rule's `job` and `job_io` (as the Snakefile builds them) and its output, for the tiny config
    with results under tmp_path/results."""
    configfile = write_config(tmp_path / f"{experiment}.yaml", tmp_path / "results", experiment=experiment)
    config = load_config_files([configfile])
    job = {"stage": "base_model", "run_name": "base_model", "code": stage_code_hash("base_model"),
           "config": {"model": config["model"], "seed": config["seed"]}}
    job_io = {"inputs": {}, "resources": {},
              "context": {k: config[k] for k in ("experiment", "results_dir", "launcher", "tracking")}}
    return job, job_io, tmp_path / "results" / experiment / "base_model"


def launcher_command(job: dict, job_io: dict, output: Path, log: Path) -> list[str]:
    return [sys.executable, "-m", "launcher", json.dumps(job), json.dumps(job_io), str(output), "--log", str(log)]


@pytest.mark.e2e
def test_live_lock_refuses_a_second_launch_until_its_job_is_gone(tmp_path):
    job, job_io, output = base_model_job(tmp_path, "locked")
    lock = output.with_name("base_model.lock")
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = proc_stat(holder.pid).start
        held = {"run_name": "base_model", "state": "running", "job_id": str(holder.pid), "cluster": "local",
                "host": HOST, "launcher_pid": holder.pid, "launcher_started": started, "job_started": started,
                "since": "2026-01-01T00:00:00"}
        lock.write_text(json.dumps(held))
        refused = subprocess.run(launcher_command(job, job_io, output, tmp_path / "refused.log"), cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"was not started: job {holder.pid} is producing {output}" in refused.stderr, refused.stderr
        assert str(lock) in refused.stderr
        assert json.loads(lock.read_text())["launcher_pid"] == holder.pid, "the holder's lock was touched"
        assert not (output.parent / "logs").exists() and not output.exists(), "a job was submitted"
        # A holder that is cancelling its job: the launch waits for it, and proceeds once it is gone.
        lock.write_text(json.dumps(held | {"state": "cancelling"}))
        log = tmp_path / "proceeds.log"
        launch = subprocess.Popen(launcher_command(job, job_io, output, log), cwd=REPO_ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_until(lambda: "is being cancelled; waiting for it to end" in read(log) or launch.poll() is not None, 60,
                   "the launch to wait for the cancelling holder")
        assert launch.poll() is None, launch.stdout.read()
        holder.kill()
        holder.wait()
        out, _ = launch.communicate(timeout=240)
        assert launch.returncode == 0, out[-6000:]
    finally:
        if holder.poll() is None:
            holder.kill()
    assert "taking over" in out and (output / "stage.json").exists() and not lock.exists(), out[-3000:]


@pytest.mark.e2e
def test_a_job_that_dies_while_its_ray_cluster_comes_up_is_submitted_once_more(tmp_path):
    """A job whose Ray cluster does not come up (here the head's port, launcher.ray_port, is taken for good) died
    before its stage began: the launcher submits it once more, and fails the stage with the second job's report."""
    job, job_io, output = base_model_job(tmp_path, "rayless")
    config = load_config_files([tmp_path / "rayless.yaml"])
    job = job | {"stage": "sft", "run_name": "sft", "config": {"sft": config["sft"], "seed": config["seed"]}}
    output = output.with_name("sft")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        job_io["context"]["launcher"] |= {"ray_port": taken.getsockname()[1]}
        done = subprocess.run(launcher_command(job, job_io, output, tmp_path / "sft.log"), cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    jobs = re.findall(r"\[alignpipe\] sft: job (\d+) submitted \(local: this machine\), log (\S+)", out)
    assert len(jobs) == 2, out[-3000:]
    assert out.count("died while its Ray cluster came up, before the stage began") == 1
    assert f"[alignpipe] sft: job {jobs[0][0]} died while its Ray cluster came up, before the stage began (its log: " \
           f"{jobs[0][1]}); submitted once more" in out
    assert re.search(rf"stage sft failed: job {jobs[1][0]}, state \w+, log {re.escape(jobs[1][1])}", out), out[-3000:]
    assert "Ray head did not start" in out and GCS_PORT_TAKEN in out  # why, from the job's log
    assert not output.exists() and not output.with_name("sft.partial").exists()


def test_only_a_job_that_died_during_its_last_ray_bring_up_counts_as_one_whose_ray_was_not_up():
    starting = "[ray] task 0/2 on n1 (10.0.0.1): starting head at 10.0.0.1:20100\n"
    up = "[ray] cluster up: 2 node(s): n1 10.0.0.1 (2 CPU, 0 GPU), n2 10.0.0.2 (2 CPU, 0 GPU)\n"
    assert died_before_ray_was_up("submitit INFO ...\n" + starting + "Traceback ...\n")
    assert not died_before_ray_was_up(starting + up + "[sft] step 3/10 ...\nTraceback ...\n")  # the stage failed
    assert not died_before_ray_was_up("Traceback ...\n")  # a stage without Ray
    assert died_before_ray_was_up(starting + up + "requeued\n" + starting)  # the requeued job's bring-up


def test_files_are_private_and_nothing_loads_from_world_writable_directories(tmp_path, monkeypatch):
    # The umask: ALIGNPIPE_UMASK, else the stricter of the caller's and 027; Slurm jobs get it as SLURM_UMASK (which
    # sbatch would otherwise take from an allocation that Snakemake runs in).
    before = os.umask(0o022)
    try:
        monkeypatch.delenv("ALIGNPIPE_UMASK", raising=False)
        monkeypatch.setenv("SLURM_UMASK", "0022")
        assert apply_umask() == 0o027 and os.environ["SLURM_UMASK"] == "0027"
        os.umask(0o077)
        assert apply_umask() == 0o077
        monkeypatch.setenv("ALIGNPIPE_UMASK", "022")
        assert apply_umask() == 0o022
        monkeypatch.setenv("ALIGNPIPE_UMASK", "rw-r-----")
        with pytest.raises(ValueError, match="ALIGNPIPE_UMASK"):
            apply_umask()
    finally:
        os.umask(before)
    # A checkpoint in a directory that others may write to (or under such a run or root directory) is refused.
    ckpt = tmp_path / "checkpoints" / "sft" / "0123456789abcdef"
    (ckpt / "step2").mkdir(parents=True)
    checkpoints.save(ckpt, 2, {}, {"log": [1, 2]}, keep=1)
    assert checkpoints.resume(ckpt, {}, "sft") == (2, {"log": [1, 2]})
    for unsafe in (ckpt, ckpt.parent, ckpt.parent.parent):
        unsafe.chmod(0o777)
        with pytest.raises(checkpoints.UnsafeDirectory, match=re.escape(f"`chmod o-w {unsafe}`")):
            checkpoints.resume(ckpt, {}, "sft")
        unsafe.chmod(0o750)
    ckpt.parent.chmod(0o1777)  # sticky, like /tmp: others cannot replace what is ours
    assert checkpoints.latest(ckpt) == {"step": 2, "tag": "step2"}
    # The job's pickles: no submission into a results tree that others may write to.
    job, job_io, output = base_model_job(tmp_path, "exposed")
    (tmp_path / "results" / "exposed" / "logs").mkdir(parents=True)
    (tmp_path / "results" / "exposed").chmod(0o777)
    with pytest.raises(StageFailed, match="not submitted: refusing to load the job's pickles .* writable by other"):
        launch_stage(job, job_io, str(output))
    assert not list((tmp_path / "results" / "exposed" / "logs").iterdir())
    assert not output.with_name("base_model.lock").exists()


def test_slurm_lock_holds_while_squeue_knows_the_job(tmp_path, monkeypatch):
    """The Slurm side without a cluster: a fake squeue says whether job 42 is queued or running."""
    state = tmp_path / "state"
    (tmp_path / "bin").mkdir()
    squeue = tmp_path / "bin" / "squeue"
    squeue.write_text(f"#!/bin/sh\nstate=$(cat {state})\nif [ -z \"$state\" ]; then\n"
                      "  echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1\nfi\necho \"$state\"\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    output = tmp_path / "results" / "sft"
    output.parent.mkdir()
    lock = output.with_name("sft.lock")
    # A launcher on another host (gone or not: not visible from here) whose Slurm job is pending.
    lock.write_text(json.dumps({"run_name": "sft", "state": "running", "job_id": "42", "cluster": "slurm",
                                "host": "login-other", "launcher_pid": 1, "launcher_started": 0, "since": "now"}))
    state.write_text("PENDING\n")
    with pytest.raises(StageFailed, match=re.escape(f"job 42 is producing {output}") + ".*`scancel 42`"):
        OutputLock(output, "sft").acquire()
    state.write_text("COMPLETED\n")  # still known to squeue, but over
    with OutputLock(output, "sft") as taken:
        assert json.loads(lock.read_text())["launcher_pid"] == os.getpid()
        taken.holds("43", "slurm", tmp_path)
        state.write_text("RUNNING\n")
    assert lock.exists(), "a lock whose Slurm job still runs stays"
    # As if that launcher had run on another host: only its job counts, and Slurm no longer knows it.
    lock.write_text(json.dumps(json.loads(lock.read_text()) | {"host": "login-other"}))
    state.write_text("")
    with OutputLock(output, "sft"):
        pass
    assert not lock.exists()

    class Submitted:
        job_id, cancelled = "44", []

        def cancel(self, check=True):
            self.cancelled.append(check)
            state.write_text("CANCELLED\n")

    submitted = Submitted()
    state.write_text("RUNNING\n")
    assert cancel_job(submitted, "slurm") and submitted.cancelled == [False]


def test_the_terminal_gets_the_log_without_the_lines_that_ask_nothing(capsys):
    """The launcher echoes a job's log but its QUIET_LINES (and a quieted Python warning's source line), with or
    without Ray's actor prefix; everything else, and the stage's log file, stay whole."""
    from launcher.submit import echo
    log = ("[sft] step 1/16\n"
           "\x1b[36m(Engine pid=12)\x1b[0m WARNING 12-02 10:37:33 [arg_utils.py:1945] The global random seed is set to 0.\n"
           "(SFTWorker pid=3, ip=10.0.0.2) /x/c10d_logger.py:83: FutureWarning: `torch.distributed.all_gather_into_"
           "tensor` is deprecated.\n"
           "(SFTWorker pid=3, ip=10.0.0.2)   return func(*args, **kwargs)\n"
           "INFO 12-02 [cpu_worker.py:140] NUMA binding: Using MEMBIND policy\n"
           "ERROR something the user must see\n"
           "  an indented line of the stage's own\n"
           "[sft] step 2/1")
    rest = echo(log)
    assert capsys.readouterr().out == ("[sft] step 1/16\nERROR something the user must see\n"
                                       "  an indented line of the stage's own\n")
    assert rest == "[sft] step 2/1"
