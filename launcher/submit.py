"""Submitting a stage and watching it: what `python -m launcher` does for each rule, on the submitting host.

`launch_stage` works out the stage's resources and checks them before anything is queued
(launcher/resources.py), submits a `runtime.job.StageJob` with submitit (the local executor on a laptop, Slurm
on a cluster: one task per node), streams the job's log to the terminal and into the rule's log file, and
raises with the job id, state, nodes, log path and log tail if the job fails.

Timeouts and preemption: Slurm signals the job (USR2, 90 s before its time limit, or `scancel --signal`);
submitit calls `StageJob.checkpoint`, which resubmits the same StageJob, and requeues the job. The stage keeps
its own resumable state in its checkpoint directory (launcher.checkpoint_dir or the results directory, keyed by the
stage's config), so the requeued job resumes from its last checkpoint; that directory is deleted once the stage
succeeds.

Stalls: a job whose stall watch failed it (no step for launcher.stall_min: runtime/progress.py) is submitted once
more where launcher.requeue_stalled allows it; it resumes from its last checkpoint, and a second stall fails it.
A job that died while its Ray cluster came up (task 0's log shows its head starting and no cluster up: a node's Ray
services failed, before the stage itself began) is submitted once more; a second such failure fails the stage.

No orphans, no double runs. While it waits, the launcher watches the Snakemake that started it: if Snakemake is
stopped (Ctrl-C, SIGTERM, SIGHUP) or dies (kill -9: the launcher is orphaned), it cancels its job (Slurm: scancel;
local: the job's whole process tree) and removes `<output>.partial` rather than leave the job publishing an output
behind Snakemake's back. An output being produced is locked: `<output>.lock` (next to the output, like `.partial`;
Snakemake neither knows it nor touches it, `--unlock` included) names the job id, its host and the launcher's pid.
A second launch on the same output is refused while that job or its launcher lives (it waits a moment for one that
is being cancelled), and proceeds once it is gone: a lock whose holder is gone is taken over. The launcher removes
its lock when it ends.

Files: the launcher runs with umask ALIGNPIPE_UMASK (octal) or, unset, the stricter of the caller's and 027, and
its jobs inherit it (sbatch passes it to Slurm jobs as SLURM_UMASK): results, checkpoints, logs and job pickles are
readable by the owner's group at most. It refuses to submit (and to load a job's result pickle) where the job's
folder or a directory above it up to the results directory is writable by other users; runtime/checkpoints.py
refuses such checkpoint directories.

Nothing here shapes a stage's result, so none of it is part of a stage's code hash (launcher/code_hash.py).
"""
import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import submitit
from submitit.core.utils import JobPaths

from launcher.config import REPO_ROOT, RESULTS_MARKER, config_hash, results_root
from launcher.resources import (LaunchConfigError, check_fits, check_slurm, check_this_machine, describe,
                                stage_resources)
from launcher.supervise import ACTIVE_STATES, OutputLock, StageFailed, Orphaned, supervise, Watch
from runtime.checkpoints import UnsafeDirectory, refuse_world_writable
from runtime.job import StageJob
from runtime.progress import STALL_MARK
from runtime.ray_cluster import CLUSTER_UP, HEAD_STARTING, KEPT_LOGS

FINAL_WAIT_S = 60          # how long a finished job's output may take to appear (network file systems)
STATE_POLL_S = 10          # how often the Slurm state is checked while a job runs
PICKLES = "the job's pickles"
UMASK_ENV = "ALIGNPIPE_UMASK"
DEFAULT_UMASK = 0o027      # results, checkpoints and pickles: readable by the owner's group at most


def tracking_uri(config: dict) -> str:
    """MLFLOW_TRACKING_URI, else tracking.uri, else sqlite under the results. Refuses a URI with credentials in
    it (tracking.uri is on every rule's command line; either would be in the job pickle): MLflow takes them from
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN, which the jobs inherit."""
    from runtime.tracking import TrackingURIError, check_tracking_uri
    try:
        check_tracking_uri(config["tracking"]["uri"], "tracking.uri")
        check_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI")
    except TrackingURIError as err:
        raise StageFailed(str(err)) from None
    return (os.environ.get("MLFLOW_TRACKING_URI") or config["tracking"]["uri"]
            or f"sqlite:///{results_root(config) / 'mlflow.db'}")


def chosen_checkpoint_root(context: dict) -> Path | None:
    """launcher.checkpoint_dir (relative to the repository root unless absolute), or None where it is not set."""
    chosen = context["launcher"].get("checkpoint_dir")
    return (REPO_ROOT / chosen).resolve() if chosen else None


def mark_as_alignpipes(context: dict) -> None:
    """The marker that tells later runs (launcher/checks.check_output_dirs) that results_dir, and
    launcher.checkpoint_dir where set, are alignpipe's."""
    for root in (results_root(context), chosen_checkpoint_root(context)):
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
            (root / RESULTS_MARKER).touch()


def checkpoint_dir(context: dict, run_name: str, params: dict) -> Path:
    """Where a stage keeps resumable state: survives requeues and failures, keyed by the stage's config. Under
    launcher.checkpoint_dir (a shared filesystem on clusters, relative to the repository root unless absolute)
    or, by default, the experiment's results."""
    chosen = chosen_checkpoint_root(context)
    root = chosen / context["experiment"] if chosen else results_root(context) / context["experiment"] / "checkpoints"
    return root / run_name.replace("/", "-") / config_hash(params)


# --- submitting and waiting -----------------------------------------------------------------------------

def make_executor(stage: str, log_dir: Path, resources: dict) -> submitit.Executor:
    executor = submitit.AutoExecutor(folder=log_dir, cluster=resources["cluster"])
    params = dict(name=f"alignpipe-{stage}", timeout_min=resources["timeout_min"], nodes=resources["nodes"],
                  tasks_per_node=1, stderr_to_stdout=True)
    if resources["cluster"] == "slurm":
        params.update(cpus_per_task=resources["cpus_per_node"], mem_gb=resources["mem_gb"],
                      slurm_additional_parameters={"requeue": True, **resources["sbatch_options"]})
        if resources["gpus_per_node"]:
            params["gpus_per_node"] = resources["gpus_per_node"]
        if resources["partition"]:
            params["slurm_partition"] = resources["partition"]
        if resources["account"]:
            params["slurm_account"] = resources["account"]
    executor.update_parameters(**params)
    return executor


def launch_stage(job: dict, job_io: dict, output: str) -> None:
    """Run one stage as a submitit job and wait for it; raise StageFailed with job id and log on failure.

    `job` is the rule's cache key (stage, run_name, config, code); `job_io` its named input paths ("inputs"),
    the Snakemake resources of the job ("resources": what a profile set) and how to submit and track it
    ("context": experiment, results_dir, launcher, tracking)."""
    stage, run_name, context = job["stage"], job["run_name"], job_io["context"]
    watch = Watch()  # now: who started this launcher (later, a dead Snakemake's orphan would not know)
    mark_as_alignpipes(context)
    try:
        resources, sources = stage_resources(stage, context["launcher"], job_io.get("resources"))
        check_fits(stage, job["config"], resources, sources)
        check_this_machine(resources, sources)
        if resources["cluster"] == "slurm":
            check_slurm(run_name, resources, sources)
    except LaunchConfigError as err:
        raise StageFailed(f"stage {run_name} was not submitted: {err}") from None
    inputs = {k: str(Path(v).resolve()) if isinstance(v, str) else [str(Path(p).resolve()) for p in v]
              for k, v in job_io["inputs"].items()}
    output_path = Path(output).resolve()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    log_dir = results_root(context) / context["experiment"] / "logs" / run_name.replace("/", "-") / stamp
    try:  # the job loads its pickle from there, and this launcher the job's result
        refuse_world_writable(log_dir, len(log_dir.relative_to(results_root(context)).parts), PICKLES)
    except UnsafeDirectory as err:
        raise StageFailed(f"stage {run_name} was not submitted: {err}") from None
    job_spec = StageJob(stage=stage, run_name=run_name, params=job["config"], inputs=inputs,
                        output=str(output_path), experiment=context["experiment"],
                        tracking_uri=tracking_uri(context), resources=resources,
                        checkpoint_dir=str(checkpoint_dir(context, run_name, job["config"])),
                        hub_downloads=context["launcher"]["hub_downloads"])
    with OutputLock(output_path, run_name) as lock:  # refuses while another job produces this output
        retries = {StageStalled: 1 if resources["requeue_stalled"] else 0, RayNotUp: 1}
        while True:
            try:
                submitted, logs = run_job(job_spec, resources, log_dir, lock, watch)
                break
            except JobFailed as err:
                if not retries[type(err)]:
                    raise
                retries[type(err)] -= 1
                if isinstance(err, StageStalled):
                    print(f"[alignpipe] {run_name}: job {err.job_id} stalled; submitted once more "
                          "(launcher.requeue_stalled): the stage resumes from its last checkpoint", flush=True)
                else:
                    print(f"[alignpipe] {run_name}: job {err.job_id} died while its Ray cluster came up, before the "
                          f"stage began (its log: {err.log}); submitted once more", flush=True)
        deadline = time.time() + FINAL_WAIT_S
        while not output_path.exists() and time.time() < deadline:
            time.sleep(1)
        if not output_path.exists():
            raise StageFailed(f"stage {run_name}: job {submitted.job_id} finished but wrote no {output_path} "
                              f"(log {logs[0]})")
    print(f"[alignpipe] {run_name}: done -> {output_path}", flush=True)


def run_job(job_spec: StageJob, resources: dict, log_dir: Path, lock: OutputLock, watch: Watch) -> tuple:
    """Submit the stage's job, echo its log until it is over; (the submitit job, its tasks' logs) once it
    succeeded, else StageFailed (StageStalled where its stall watch failed it, RayNotUp where it died as its Ray
    cluster came up) with the job's id, state and log."""
    run_name, partial = job_spec.run_name, Path(job_spec.output + ".partial")
    if watch.orphaned():
        raise StageFailed(f"stage {run_name} was not submitted: the Snakemake that started this launcher is gone")
    try:
        submitted = make_executor(job_spec.stage, log_dir, resources).submit(job_spec)
    except Exception as err:  # e.g. sbatch refusing what --test-only accepted a moment ago
        raise StageFailed(f"stage {run_name} could not be submitted ({describe(resources)}): {err}") from None
    lock.holds(submitted.job_id, resources["cluster"], log_dir)
    watch.over = lock.job_over = False  # (a job before it, stalled, was over)
    logs = [JobPaths(log_dir, job_id=submitted.job_id, task_id=task).stdout for task in range(resources["nodes"])]
    where = f"slurm: {describe(resources)}" if resources["cluster"] == "slurm" else "local: this machine"
    with supervise(submitted, run_name, resources["cluster"], partial, Path(job_spec.checkpoint_dir), lock, watch):
        print(f"[alignpipe] {run_name}: job {submitted.job_id} submitted ({where}), log {logs[0]}"
              + (f" (other tasks: {logs[1].name.replace('_1_', '_<task>_')})" if len(logs) > 1 else ""), flush=True)
        state = follow_log(submitted, logs[0], run_name, slurm=resources["cluster"] == "slurm", watch=watch.orphaned)
        watch.over = lock.job_over = True
        if resources["cluster"] == "slurm":
            with contextlib.suppress(Exception):
                submitted.get_info(mode="force")  # let submitit see the final state now, not at its next poll
        try:
            refuse_world_writable(log_dir, 0, PICKLES)
            if _outcome(submitted.task(0).paths.result_pickle) != "success":  # (task 0 ran the driver)
                submitted.task(0).result()  # raises the job's error (result() waits for the process to end)
        except UnsafeDirectory as err:
            raise StageFailed(f"stage {run_name}: job {submitted.job_id} ended; its result was not read: "
                              f"{err}") from None
        except Exception as err:  # the job's own exception, or submitit's report of a job that never finished
            shutil.rmtree(partial, ignore_errors=True)  # the job is over: nothing may look half done
            report = failure_report(run_name, submitted, logs, resources, state, err)
            log = _read(logs[0])
            if STALL_MARK in log:
                raise StageStalled(report, submitted.job_id, logs[0]) from None
            if died_before_ray_was_up(log) and not state.startswith("CANCELLED"):
                raise RayNotUp(report, submitted.job_id, logs[0]) from None
            raise StageFailed(report) from None
    return submitted, logs


def died_before_ray_was_up(log: str) -> bool:
    """Whether task 0's log shows its last Ray bring-up begun and not finished (a requeued job appends to its log)."""
    start = log.rfind(HEAD_STARTING)
    return start >= 0 and CLUSTER_UP not in log[start:]


class JobFailed(StageFailed):
    """A failed job that may be submitted once more: its id and its task 0's log."""

    def __init__(self, report: str, job_id: str, log: Path):
        super().__init__(report)
        self.job_id, self.log = job_id, log


class StageStalled(JobFailed):
    """The job's stall watch failed it (runtime/progress.py)."""


class RayNotUp(JobFailed):
    """The job died while its Ray cluster came up (`died_before_ray_was_up`)."""


def _read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")
    return ""


def follow_log(job, log_path: Path, run_name: str = "", slurm: bool = False, poll_s: float = 1.0,
               watch=None) -> str:
    """Echo the job's log (task 0; stdout and stderr merged) to this terminal until the job is over, with its
    Slurm state changes (pending, running, requeued). Returns the last Slurm state seen ('' elsewhere).

    A requeued job keeps its id and appends to the same log, so the echo simply continues. The job is over when
    task 0 has stored a successful result, or when its process ended (local) or Slurm says the job has ended: a
    failed result alone does not end it on Slurm, since a task of an interrupted attempt may have left one before
    the job was requeued.
    `watch`, if given, is called at every poll; it returning true (the launcher is orphaned) ends the wait with
    Orphaned."""
    position, state, last_poll, unknown_since, ran, pending = 0, "", 0.0, None, False, ""
    result_pickle = job.task(0).paths.result_pickle
    while True:
        if watch is not None and watch():
            raise Orphaned()
        outcome = _outcome(result_pickle)
        if slurm and (time.time() - last_poll > (2 if outcome else STATE_POLL_S)):
            last_poll = time.time()
            new = _slurm_state(job)
            if new and new != state:
                now = new.split()[0]
                ran = ran or state.startswith("RUNNING")
                if ran and now in ("REQUEUED", "PENDING", "PREEMPTED", "REQUEUE_HOLD"):
                    print(f"[alignpipe] {run_name}: job {job.job_id} was requeued ({new}); the stage resumes from "
                          f"its last checkpoint when the job starts again", flush=True)
                else:
                    print(f"[alignpipe] {run_name}: job {job.job_id} {new}", flush=True)
            if new:
                state, unknown_since = new, None
            elif unknown_since is None:
                unknown_since = time.time()
        if not slurm:  # a stored success ends it: the job's process may take seconds more to exit
            done = outcome == "success" or job.done()
        elif outcome == "success":
            done = True
        elif state and unknown_since is None:
            done = state.split()[0] not in ACTIVE_STATES
        else:  # Slurm does not answer (no accounting?): fall back on submitit's own view
            done = unknown_since is not None and time.time() - unknown_since > 60 and job.done()
        if log_path.exists():
            with log_path.open("rb") as fh:
                fh.seek(position)
                chunk = fh.read()
                position += len(chunk)
            if chunk:
                pending = echo(pending + chunk.decode(errors="replace"))
        if done:
            echo(pending + "\n") if pending else None
            return state
        time.sleep(poll_s)


# Lines of a good run that ask nothing of the user: kept in the stage's log, not echoed to the terminal.
QUIET_LINES = re.compile("|".join([
    # vLLM's CPU build at each engine start: the settings runtime/rollout.engine_options chooses on CPU (eager, fp32,
    # seeded requests, chunked prefill off: tests/test_weight_sync.py checks vLLM's log-probs against the trainer's
    # after every sync) and a build without Triton, tcmalloc or Intel OpenMP
    r"The global random seed is set to", r"does not officially support disabling chunked prefill",
    r"Enforce eager set, disabling torch.compile", r"Inductor compilation was disabled by user settings",
    r"Triton is not installed", r"Triton not available, find_triton_kernels", r"Model Runner V2 requires Triton",
    r"Reset SSM cache type to float32", r"is not found in LD_PRELOAD",
    r"allow to use `torch.set_num_threads` after the thread binding", r"NUMA binding: Using MEMBIND policy",
    r"Setting accelerator to CPU\. If you have GPU",  # DeepSpeed on a job without GPUs
    r"FutureWarning: `torch\.distributed\.",  # torch's deprecations inside DeepSpeed and vLLM
]))
RAY_PREFIX = re.compile(r"^(\x1b\[\d+m)?\(\w+ pid=\d+(, ip=[\d.]+)?\)(\x1b\[0m)? ")  # "(SFTWorker pid=12, ip=..) "


def echo(text: str) -> str:
    """Print the whole lines of `text` but the QUIET_LINES (a Python warning's source line after it goes too);
    return the unfinished last line."""
    lines = text.split("\n")
    quiet_source = False
    for line in lines[:-1]:
        if quiet_source and RAY_PREFIX.sub("", line).startswith("  "):
            quiet_source = False
            continue
        quiet = QUIET_LINES.search(line) is not None
        quiet_source = quiet and "Warning: " in line
        if not quiet:
            sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return lines[-1]


def _outcome(result_pickle: Path) -> str | None:
    """'success' or 'error' from a task's result file, None while there is none (or it is being written)."""
    if not result_pickle.exists():
        return None
    with contextlib.suppress(Exception):
        return submitit.core.utils.pickle_load(result_pickle)[0]
    return None


def _slurm_state(job) -> str:
    """The job's state from squeue (while the controller knows it) or sacct; '' if neither answers."""
    with contextlib.suppress(Exception):
        proc = subprocess.run(["squeue", "-h", "-t", "all", "-j", str(job.job_id), "-o", "%T|%r|%N"],
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        out = proc.stdout.strip()
        if proc.returncode == 0 and out:
            state, reason, nodes = (out.splitlines()[0].split("|") + ["", ""])[:3]
            if state == "PENDING":
                return f"PENDING ({reason})" if reason and reason != "None" else "PENDING"
            if state in ACTIVE_STATES:
                return f"{state} on {nodes}" if nodes else state
    return sacct(job.job_id).get("State", "")  # finished jobs: accounting has the final word


def sacct(job_id) -> dict:
    """The accounting record of a job's latest run: State, NodeList, ExitCode, Elapsed, plus Attempts."""
    with contextlib.suppress(Exception):
        out = subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-j", str(job_id), "-o",
                              "JobID,State,NodeList,ExitCode,Elapsed"], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL).stdout
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        if rows:
            record = dict(zip(("JobID", "State", "NodeList", "ExitCode", "Elapsed"), rows[-1]))
            record["Attempts"] = str(len(rows))
            return record
    return {}


def failure_report(run_name: str, job, logs: list[Path], resources: dict, state: str, err: Exception) -> str:
    if resources["cluster"] == "slurm":
        info = sacct(job.job_id)
        state = info.get("State") or state or str(job.state)
        nodes = info.get("NodeList") or "unknown"
        details = (f"\n  nodes: {nodes} | sacct: State={state} ExitCode={info.get('ExitCode', '?')} "
                   f"Elapsed={info.get('Elapsed', '?')} Attempts={info.get('Attempts', '?')}")
    else:
        state, details = str(job.state), "\n  nodes: this machine (local executor)"
    word = (state.split() or ["UNKNOWN"])[0]
    text = (f"stage {run_name} failed: job {job.job_id}, state {word}, log {logs[0]}{details}\n"
            f"--- last lines of the log ---\n{tail(logs[0])}\n")
    for other in logs[1:]:
        if other.exists():
            text += f"--- last lines of {other.name} ---\n{tail(other, 15)}\n"
    kept = sorted(logs[0].parent.glob(KEPT_LOGS.format(job_id=job.job_id, restart="*", rank="*")))
    if kept:  # (a node whose task died: why its raylet or GCS went, if they went first)
        text += "--- Ray's own logs of the nodes that ended with their task ---\n" + \
            "\n".join(str(path) for path in kept) + "\n"
    return text + f"--- error ---\n{err}"


NATIVE_FRAME = re.compile(r"^(\[[^]]*\] )?(\S+: )?(\S+\.cc:\d+: )?\s*(@ |PC: @|\*\*\* SIG\w+ received)")


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log, without native stack dumps (noted in one line where they were)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log was written)"
    kept, dropped = [], 0
    for line in text:
        if NATIVE_FRAME.match(line):
            dropped += 1
            continue
        if dropped:
            kept.append(f"(... {dropped} lines of a native stack dump left out ...)")
            dropped = 0
        kept.append(line)
    if dropped:
        kept.append(f"(... {dropped} lines of a native stack dump left out ...)")
    return "\n".join(kept[-lines:])


class _Tee:
    """A stream that writes to the terminal and to the rule's log file."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        with contextlib.suppress(OSError, ValueError):  # the terminal of a killed Snakemake: the log still gets it
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()


def apply_umask() -> int:
    """Set the launcher's umask, which its jobs inherit: the octal ALIGNPIPE_UMASK if set (e.g. 022 to share
    results with everyone), else the stricter of the caller's umask and 027: results, checkpoints, logs and job
    pickles are then readable by the owner's group at most. Returns it. Slurm jobs get it as SLURM_UMASK, which
    sbatch sets from the umask unless SLURM_UMASK is already set (Snakemake run inside an allocation): so it is
    set here."""
    current = os.umask(0o077)
    os.umask(current)
    value = os.environ.get(UMASK_ENV, "").strip()
    if value:
        try:
            mask = int(value, 8)
        except ValueError:
            mask = -1
        if not 0 <= mask <= 0o777:
            raise ValueError(f"{UMASK_ENV}={value!r} is not a umask: give an octal number such as 027")
    else:
        mask = current | DEFAULT_UMASK
    os.umask(mask)
    os.environ["SLURM_UMASK"] = f"{mask:04o}"
    return mask


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run one alignpipe stage through submitit (called by the rules).")
    parser.add_argument("job", help="JSON: stage, run_name, config, code (a rule's params.stage)")
    parser.add_argument("job_io", help='JSON: {"inputs": the rule\'s named inputs, "resources": its Snakemake '
                                       'resources, "context": experiment, results_dir, launcher, tracking}')
    parser.add_argument("output", help="the stage's output directory")
    parser.add_argument("--log", help="the rule's log file: what this prints, the job's log included, goes there too "
                                      "(Snakemake's --show-failed-logs shows it)")
    args = parser.parse_args(argv)
    try:
        apply_umask()
    except ValueError as err:
        print(f"[alignpipe] ERROR {err}", file=sys.stderr, flush=True)
        return 2
    with contextlib.ExitStack() as stack:
        if args.log:
            Path(args.log).parent.mkdir(parents=True, exist_ok=True)
            log = stack.enter_context(open(args.log, "w"))
            stack.enter_context(contextlib.redirect_stdout(_Tee(sys.stdout, log)))
            stack.enter_context(contextlib.redirect_stderr(_Tee(sys.stderr, log)))
        try:
            launch_stage(json.loads(args.job), json.loads(args.job_io), args.output)
        except StageFailed as err:
            print(f"[alignpipe] ERROR {err}", file=sys.stderr, flush=True)
            return 1
    return 0
