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

Nothing here shapes a stage's result, so none of it is part of a stage's code hash (launcher/code_hash.py).
"""
import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import submitit
from submitit.core.utils import JobPaths

from launcher.config import REPO_ROOT, config_hash, results_root
from launcher.resources import LaunchConfigError, check_fits, check_slurm, describe, stage_resources
from runtime.job import StageJob

FINAL_WAIT_S = 60          # how long a finished job's output may take to appear (network file systems)
STATE_POLL_S = 10          # how often the Slurm state is checked while a job runs


class StageFailed(RuntimeError):
    pass


def tracking_uri(config: dict) -> str:
    return (os.environ.get("MLFLOW_TRACKING_URI") or config["tracking"]["uri"]
            or f"sqlite:///{results_root(config) / 'mlflow.db'}")


def checkpoint_dir(context: dict, run_name: str, params: dict) -> Path:
    """Where a stage keeps resumable state: survives requeues and failures, keyed by the stage's config. Under
    launcher.checkpoint_dir (a shared filesystem on clusters, relative to the repository root unless absolute)
    or, by default, the experiment's results."""
    chosen = context["launcher"].get("checkpoint_dir")
    root = (REPO_ROOT / chosen).resolve() / context["experiment"] if chosen else \
        results_root(context) / context["experiment"] / "checkpoints"
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
    try:
        resources, sources = stage_resources(stage, context["launcher"], job_io.get("resources"))
        check_fits(stage, job["config"], resources, sources)
        if resources["cluster"] == "slurm":
            check_slurm(run_name, resources, sources)
    except LaunchConfigError as err:
        raise StageFailed(f"stage {run_name} was not submitted: {err}") from None
    inputs = {k: str(Path(v).resolve()) if isinstance(v, str) else [str(Path(p).resolve()) for p in v]
              for k, v in job_io["inputs"].items()}
    output_path = Path(output).resolve()
    partial = output_path.with_name(output_path.name + ".partial")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    log_dir = results_root(context) / context["experiment"] / "logs" / run_name.replace("/", "-") / stamp
    job_spec = StageJob(stage=stage, run_name=run_name, params=job["config"], inputs=inputs,
                        output=str(output_path), experiment=context["experiment"],
                        tracking_uri=tracking_uri(context), resources=resources,
                        checkpoint_dir=str(checkpoint_dir(context, run_name, job["config"])))
    try:
        submitted = make_executor(stage, log_dir, resources).submit(job_spec)
    except Exception as err:  # e.g. sbatch refusing what --test-only accepted a moment ago
        raise StageFailed(f"stage {run_name} could not be submitted ({describe(resources)}): {err}") from None
    logs = [JobPaths(log_dir, job_id=submitted.job_id, task_id=task).stdout for task in range(resources["nodes"])]
    where = f"slurm: {describe(resources)}" if resources["cluster"] == "slurm" else "local: this machine"
    print(f"[alignpipe] {run_name}: job {submitted.job_id} submitted ({where}), log {logs[0]}"
          + (f" (other tasks: {logs[1].name.replace('_1_', '_<task>_')})" if len(logs) > 1 else ""), flush=True)
    with _cancel_on_interrupt(submitted, run_name):
        state = follow_log(submitted, logs[0], run_name, slurm=resources["cluster"] == "slurm")
        if resources["cluster"] == "slurm":
            with contextlib.suppress(Exception):
                submitted.get_info(mode="force")  # let submitit see the final state now, not at its next poll
        try:
            submitted.task(0).result()  # task 0 ran the driver; the other tasks only held Ray nodes
        except Exception as err:  # the job's own exception, or submitit's report of a job that never finished
            shutil.rmtree(partial, ignore_errors=True)  # the job is over: nothing may look half done
            raise StageFailed(failure_report(run_name, submitted, logs, resources, state, err)) from None
    deadline = time.time() + FINAL_WAIT_S
    while not output_path.exists() and time.time() < deadline:
        time.sleep(1)
    if not output_path.exists():
        raise StageFailed(f"stage {run_name}: job {submitted.job_id} finished but wrote no {output_path} "
                          f"(log {logs[0]})")
    print(f"[alignpipe] {run_name}: done -> {output_path}", flush=True)


@contextlib.contextmanager
def _cancel_on_interrupt(submitted, run_name: str):
    """If Snakemake is stopped (Ctrl-C, SIGTERM) while we wait, cancel the job instead of orphaning it."""
    def cancel(signum, frame):
        print(f"[alignpipe] {run_name}: interrupted; cancelling job {submitted.job_id}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            submitted.cancel(check=False)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, cancel) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# Slurm states of a job that is not over yet (submitit's list, plus the rarer transitional ones).
ACTIVE_STATES = {"READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING",
                 "CONFIGURING", "PREEMPTED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "SUSPENDED"}


def follow_log(job, log_path: Path, run_name: str = "", slurm: bool = False, poll_s: float = 1.0) -> str:
    """Echo the job's log (task 0; stdout and stderr merged) to this terminal until the job is over, with its
    Slurm state changes (pending, running, requeued). Returns the last Slurm state seen ('' elsewhere).

    A requeued job keeps its id and appends to the same log, so the echo simply continues. On Slurm the job is
    over when task 0 has stored a successful result, or when Slurm says the job has ended: a result file alone
    does not end it, since a task of an interrupted attempt may have left one before the job was requeued."""
    position, state, last_poll, unknown_since, ran = 0, "", 0.0, None, False
    result_pickle = job.task(0).paths.result_pickle
    while True:
        outcome = _outcome(result_pickle) if slurm else None
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
        if not slurm:
            done = job.done()
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
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        if done:
            return state
        time.sleep(poll_s)


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
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run one alignpipe stage through submitit (called by the rules).")
    parser.add_argument("job", help="JSON: stage, run_name, config, code (a rule's params.stage)")
    parser.add_argument("job_io", help='JSON: {"inputs": the rule\'s named inputs, "resources": its Snakemake '
                                       'resources, "context": experiment, results_dir, launcher, tracking}')
    parser.add_argument("output", help="the stage's output directory")
    parser.add_argument("--log", help="the rule's log file: what this prints, the job's log included, goes there too "
                                      "(Snakemake's --show-failed-logs shows it)")
    args = parser.parse_args(argv)
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
