"""Every stage runs through here: submitit job -> (Ray cluster) -> the stage's `run` -> atomic output.

Snakemake calls `launch_stage` on the submitting host. It works out where and how big the stage's job is
(`stage_resources`: the config's `launcher` block, its `launcher.stages.<stage>` entry, then the Snakemake
resources a profile gives the rule), checks that request before anything is queued (on Slurm with
`sbatch --test-only`), submits a `StageJob` with submitit (the local executor on a laptop, Slurm on a
cluster: one task per node), streams the job's log to the terminal, and raises with the job id, state,
nodes, log path and log tail if the job fails. Inside the job, a stage that declares `USES_RAY = True` gets a
Ray cluster across the job's nodes (stages/ray_cluster.py) and its driver runs on task 0. Outputs are
written to `<output>.partial` and renamed into place only when the stage succeeds, so a failed or killed job
leaves nothing Snakemake takes as done.

Timeouts and preemption: Slurm signals the job (USR2, 90 s before its time limit, or `scancel --signal`);
submitit calls `StageJob.checkpoint`, which resubmits the same StageJob, and requeues the job. The stage keeps
its own resumable state in `run.checkpoint_dir` (under the results directory, keyed by the stage's config),
so the requeued job resumes from its last checkpoint; that directory is deleted once the stage succeeds.
"""
import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import submitit
from submitit.core.utils import JobPaths

from stages.config import REPO_ROOT, config_hash

# Set for every job and Ray worker: no hub downloads, quiet tokenizers, vLLM in-process on CPU.
JOB_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_enable_metrics_collection": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "PYTHONUNBUFFERED": "1",
    # Ray's native handler prints ~1000 lines of unsymbolised stack frames when Slurm stops a job (SIGTERM on
    # cancel, requeue, preemption), burying the log's useful end.
    "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1",
}

# Where a stage's job runs and how big it is. The same names work in the config (`launcher.<key>`,
# `launcher.stages.<stage>.<key>`) and as Snakemake resources in a profile (`default-resources`,
# `set-resources: {<rule>: {<key>: ...}}`). Precedence, lowest first: launcher.<key>,
# launcher.stages.<stage>.<key>, the profile's resources.
RESOURCE_KEYS = ("cluster", "nodes", "gpus_per_node", "cpus_per_node", "mem_gb", "timeout_min", "partition",
                 "account", "sbatch_extra")
CLUSTERS = ("local", "slurm")
# Resource names of Snakemake's own Slurm executor plugin: easy to write by habit, but not read here.
FOREIGN_RESOURCES = {"slurm_partition": "partition", "slurm_account": "account", "slurm_extra": "sbatch_extra",
                     "runtime": "timeout_min", "cpus_per_task": "cpus_per_node", "gpu": "gpus_per_node",
                     "gpus": "gpus_per_node", "gres": "gpus_per_node or sbatch_extra", "tasks": "nodes",
                     "mem_mb_per_cpu": "mem_gb", "constraint": "sbatch_extra", "qos": "sbatch_extra"}
# sbatch options that the launcher sets itself; sbatch_extra must not contradict them.
OWN_SBATCH_OPTIONS = {"nodes": "nodes", "ntasks": "nodes", "ntasks-per-node": "nodes", "cpus-per-task": "cpus_per_node",
                      "mem": "mem_gb", "mem-per-cpu": "mem_gb", "time": "timeout_min", "partition": "partition",
                      "account": "account", "gpus-per-node": "gpus_per_node", "gpus": "gpus_per_node",
                      "output": None, "error": None, "job-name": None, "signal": None, "open-mode": None,
                      "wrap": None, "array": None}
FINAL_WAIT_S = 60          # how long a finished job's output may take to appear (network file systems)
STATE_POLL_S = 10          # how often the Slurm state is checked while a job runs


class StageFailed(RuntimeError):
    pass


class LaunchConfigError(ValueError):
    """A resource request that cannot work; raised before anything is queued."""


def results_root(config: dict) -> Path:
    root = Path(config["results_dir"])
    return (root if root.is_absolute() else REPO_ROOT / root).resolve()


def tracking_uri(config: dict) -> str:
    return (os.environ.get("MLFLOW_TRACKING_URI") or config["tracking"]["uri"]
            or f"sqlite:///{results_root(config) / 'mlflow.db'}")


def checkpoint_dir(context: dict, run_name: str, params: dict) -> Path:
    """Where a stage keeps resumable state: survives requeues and failures, keyed by the stage's config."""
    return (results_root(context) / context["experiment"] / "checkpoints" / run_name.replace("/", "-")
            / config_hash(params))


# --- resources ------------------------------------------------------------------------------------------

def _coerce(key: str, value, source: str):
    """A resource value as the launcher uses it; LaunchConfigError naming `source` if it is not valid."""
    def bad(expected: str):
        return LaunchConfigError(f"{source} = {value!r} is not valid: expected {expected}")

    if key == "cluster":
        if value not in CLUSTERS:
            raise bad(f"one of {list(CLUSTERS)}")
        return value
    if key in ("partition", "account"):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        if not isinstance(value, str) or any(c.isspace() for c in value):
            raise bad("a name without spaces")
        return value
    if key == "sbatch_extra":
        if value is None:
            return ""
        if not isinstance(value, str):
            raise bad('a string of sbatch options, e.g. "--qos=high --constraint=a100"')
        return value
    if key == "mem_gb":
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad("a number of GB") from None
        if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
            raise bad("a number of GB > 0")
        return number
    minimum = {"nodes": 1, "cpus_per_node": 1, "timeout_min": 1, "gpus_per_node": 0}[key]
    try:
        number = int(value) if not isinstance(value, bool) and float(value) == int(float(value)) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise bad(f"a whole number >= {minimum}")
    return number


def parse_sbatch_extra(text: str, source: str) -> dict:
    """'--qos=high --exclusive' -> {"qos": "high", "exclusive": True} (submitit's additional parameters)."""
    options = {}
    try:
        words = shlex.split(text or "")
    except ValueError as err:
        raise LaunchConfigError(f"{source} = {text!r} is not valid: {err}") from None
    for word in words:
        if not word.startswith("--") or len(word) < 3:
            raise LaunchConfigError(f"{source} = {text!r}: {word!r} is not a long sbatch option; write each as "
                                    f"--name=value or --flag (e.g. --qos=high --exclusive)")
        name, has_value, value = word[2:].partition("=")
        if name in OWN_SBATCH_OPTIONS:
            instead = OWN_SBATCH_OPTIONS[name]
            raise LaunchConfigError(f"{source}: --{name} is set by the launcher"
                                    + (f"; use the resource `{instead}` instead" if instead else ""))
        options[name] = value if has_value else True
    return options


def stage_resources(stage: str, launcher: dict, profile: dict | None = None) -> tuple[dict, dict]:
    """(resources, where each came from) for one stage: the config's launcher block, overridden by its
    `launcher.stages.<stage>` entry, overridden by the Snakemake resources that the profile gave the rule."""
    resources, sources = {}, {}
    for key in RESOURCE_KEYS:
        resources[key], sources[key] = launcher[key], f"launcher.{key}"
    for key, value in (launcher.get("stages") or {}).get(stage, {}).items():
        resources[key], sources[key] = value, f"launcher.stages.{stage}.{key}"
    for key, value in (profile or {}).items():
        if key in FOREIGN_RESOURCES:
            raise LaunchConfigError(f"Snakemake resource `{key}` of rule {stage} is not read by alignpipe's "
                                    f"launcher; use `{FOREIGN_RESOURCES[key]}` (README, 'Cluster use')")
        if key in RESOURCE_KEYS:
            resources[key], sources[key] = value, f"Snakemake resource `{key}` of rule {stage} (profile)"
    for key in RESOURCE_KEYS:
        resources[key] = _coerce(key, resources[key], sources[key])
    resources["sbatch_options"] = parse_sbatch_extra(resources["sbatch_extra"], sources["sbatch_extra"])
    resources["ray_port"] = launcher["ray_port"]
    if resources["cluster"] == "local" and resources["nodes"] > 1:
        raise LaunchConfigError(f"{sources['nodes']} = {resources['nodes']}, but the local executor runs a job on "
                                f"this machine only (1 node): submit to Slurm (snakemake --profile slurm) or "
                                f"set it to 1")
    return resources, sources


def check_fits(stage: str, params: dict, resources: dict, sources: dict) -> None:
    """A training stage's Ray actors (1 CPU each) must fit the job, or Ray would wait for them forever.
    (A stage whose roles share the job's cores, `colocate: true`, places them itself.)"""
    block = params.get(stage) if isinstance(params.get(stage), dict) else {}
    workers = block.get("num_workers")
    capacity = resources["nodes"] * resources["cpus_per_node"]
    if isinstance(workers, int) and workers > capacity and not block.get("colocate"):
        raise LaunchConfigError(
            f"{stage}.num_workers = {workers} Ray actors (1 CPU each) do not fit the stage's job: "
            f"{resources['nodes']} node(s) ({sources['nodes']}) x {resources['cpus_per_node']} CPUs "
            f"({sources['cpus_per_node']}) = {capacity}; raise those or lower {stage}.num_workers")


def describe(resources: dict) -> str:
    text = (f"{resources['nodes']} node(s) x {resources['cpus_per_node']} CPUs, {resources['mem_gb']:g} GB, "
            f"{resources['gpus_per_node']} GPU(s) per node, {resources['timeout_min']} min")
    if resources["cluster"] == "slurm":
        text += f", partition {resources['partition'] or '(default)'}, account {resources['account'] or '(default)'}"
        if resources["sbatch_extra"]:
            text += f", sbatch {resources['sbatch_extra']}"
    return text


def _slurm_mem(mem_gb: float) -> str:
    return f"{int(mem_gb)}GB" if mem_gb == int(mem_gb) else f"{int(mem_gb * 1024)}MB"  # as submitit writes it


def sbatch_flags(resources: dict) -> list[str]:
    """The sbatch options of a stage's job (what submitit writes into its script, minus paths and signal)."""
    flags = [f"--nodes={resources['nodes']}", "--ntasks-per-node=1", f"--cpus-per-task={resources['cpus_per_node']}",
             f"--mem={_slurm_mem(resources['mem_gb'])}", f"--time={resources['timeout_min']}", "--requeue"]
    if resources["gpus_per_node"]:
        flags.append(f"--gpus-per-node={resources['gpus_per_node']}")
    if resources["partition"]:
        flags.append(f"--partition={resources['partition']}")
    if resources["account"]:
        flags.append(f"--account={resources['account']}")
    flags += [f"--{k}" if v is True else f"--{k}={v}" for k, v in resources["sbatch_options"].items()]
    return flags


def check_slurm(run_name: str, resources: dict, sources: dict) -> None:
    """Ask Slurm whether it would accept the job (`sbatch --test-only`: nothing is queued)."""
    if shutil.which("sbatch") is None:
        raise LaunchConfigError(f"{sources['cluster']} = slurm, but there is no `sbatch` on this machine's PATH")
    cmd = ["sbatch", "--test-only", *sbatch_flags(resources), f"--job-name=alignpipe-{run_name.split('/')[0]}",
           "--output=/dev/null", "--wrap=true"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LaunchConfigError("`sbatch --test-only` did not answer within 60 s: is slurmctld reachable?") from None
    if proc.returncode != 0:
        said = " ".join(line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip())
        origin = "; ".join(f"{k} from {sources[k]}" for k in RESOURCE_KEYS if k != "cluster")
        raise LaunchConfigError(f"Slurm would not accept the job of stage {run_name} ({describe(resources)}): "
                                f"{said}\n  where the values come from: {origin}")


# --- the job --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StageJob(submitit.helpers.Checkpointable):
    """What runs inside the submitit job (pickled to it). Checkpointable: on a timeout or preemption signal,
    submitit calls `checkpoint`, which resubmits this same StageJob, and requeues the job."""
    stage: str
    run_name: str
    params: dict           # the stage's cache key config: the only config the stage may read
    inputs: dict
    output: str
    experiment: str
    tracking_uri: str
    resources: dict        # stage_resources(): cluster, nodes, cpus/gpus per node, mem_gb, ray_port, ...
    checkpoint_dir: str

    def __call__(self):
        os.environ.update(JOB_ENV)
        module = importlib.import_module(f"stages.{self.stage}")
        if not getattr(module, "USES_RAY", False):
            return self.run_driver(module)
        from stages.ray_cluster import ray_cluster
        env = submitit.JobEnvironment()
        with ray_cluster(env, self.resources) as node:
            if node.is_driver:
                return self.run_driver(module, ray_nodes=node.nodes)

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on a timeout or preemption signal, before it requeues the job: the requeued job
        runs this same StageJob, and the stage resumes from what it saved in `checkpoint_dir`."""
        print(f"[alignpipe] {self.run_name}: interrupted (timeout or preemption); requeueing; the stage resumes "
              f"from its last checkpoint in {self.checkpoint_dir}", flush=True)
        return super().checkpoint(*args, **kwargs)

    def run_driver(self, module, ray_nodes: list | None = None):
        from stages import tracking
        output = Path(self.output)
        partial = output.with_name(output.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        ckpt = Path(self.checkpoint_dir)
        ckpt.mkdir(parents=True, exist_ok=True)
        seed = self.params.get("seed", 0)
        random.seed(seed)
        cfg = module.Config.from_params(self.params)
        _actor_placements(clear=True)  # a fresh record for this stage
        try:
            with tracking.stage_run(self.tracking_uri, self.experiment, self.run_name, self.params) as run:
                run.checkpoint_dir = ckpt  # persistent across requeues; removed below once the stage succeeded
                module.run(cfg, {k: _paths(v) for k, v in self.inputs.items()}, partial, run)
                placements = _actor_placements()
                job = job_record(self.resources, ray_nodes, placements)
                _tag_run(run, job)
                (partial / "stage.json").write_text(json.dumps(
                    {"stage": self.stage, "params": self.params, "config_hash": config_hash(self.params),
                     "inputs": self.inputs, "mlflow_run_id": run.run_id, "job": job}, indent=2))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            _remove_empty(ckpt)  # kept if the stage saved a checkpoint: its rerun (or requeue) resumes from it
            raise
        shutil.rmtree(output, ignore_errors=True)
        partial.rename(output)
        _remove_checkpoints(ckpt)
        return str(output)


def _paths(value):
    return [Path(v) for v in value] if isinstance(value, list) else Path(value)


def _actor_placements(clear: bool = False) -> list[dict]:
    """Where the stage's Ray actors ran (recorded by stages.actor_group, if the stage used it)."""
    module = sys.modules.get("stages.actor_group")
    if module is None:
        return []
    placements = list(module.PLACEMENTS)
    if clear:
        module.PLACEMENTS.clear()
    return placements


def job_record(resources: dict, ray_nodes: list | None, placements: list[dict]) -> dict:
    """Where the stage ran: for stage.json and the MLflow run."""
    record = {"cluster": resources["cluster"], "resources": {k: resources[k] for k in RESOURCE_KEYS}}
    if "SLURM_JOB_ID" in os.environ:
        record["slurm"] = {"job_id": os.environ["SLURM_JOB_ID"], "nodes": os.environ.get("SLURM_JOB_NODELIST"),
                           "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                           "partition": os.environ.get("SLURM_JOB_PARTITION")}
    if ray_nodes is not None:
        record["ray_nodes"] = ray_nodes
    if placements:
        record["actors"] = placements
    return record


def _tag_run(run, job: dict) -> None:
    tags = {"launcher.cluster": job["cluster"], "launcher.resources": json.dumps(job["resources"])}
    if "ray_nodes" in job:
        tags["ray.nodes"] = ",".join(f"{n['hostname']}={n['ip']}" for n in job["ray_nodes"])
    if "actors" in job:
        tags["ray.actors"] = json.dumps([{k: p[k] for k in ("group", "rank", "hostname", "ip")} for p in job["actors"]])
    if "slurm" in job:
        tags["slurm.restarts"] = str(job["slurm"]["restarts"])
    for key, value in tags.items():
        with contextlib.suppress(Exception):  # tags are a record; never fail a finished stage over one
            run.client.set_tag(run.run_id, key, value[:5000])


def _remove_checkpoints(ckpt: Path) -> None:
    shutil.rmtree(ckpt, ignore_errors=True)
    _remove_empty(ckpt)


def _remove_empty(ckpt: Path) -> None:
    """Remove checkpoints/<run>/<hash>/, checkpoints/<run>/ and checkpoints/ where they are empty."""
    for directory in (ckpt, ckpt.parent, ckpt.parent.parent):
        with contextlib.suppress(OSError):
            directory.rmdir()


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


def launch_stage(job: dict, job_io: dict, output: str, context: dict) -> None:
    """Run one stage as a submitit job and wait for it; raise StageFailed with job id and log on failure.

    `job` is the rule's cache key (stage, run_name, config, code); `job_io` its named input paths ("inputs")
    and the Snakemake resources of the job ("resources": what a profile set); `context` says how to submit
    and track it (experiment, results_dir, launcher, tracking)."""
    stage, run_name = job["stage"], job["run_name"]
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run one alignpipe stage through submitit (called by the rules).")
    parser.add_argument("job", help="JSON: stage, run_name, config, code (a rule's params.stage)")
    parser.add_argument("job_io", help='JSON: {"inputs": the rule\'s named inputs, "resources": its Snakemake resources}')
    parser.add_argument("output", help="the stage's output directory")
    parser.add_argument("--context", required=True, help="JSON: experiment, results_dir, launcher, tracking")
    args = parser.parse_args(argv)
    try:
        launch_stage(json.loads(args.job), json.loads(args.job_io), args.output, json.loads(args.context))
    except StageFailed as err:
        print(f"[alignpipe] ERROR {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
