"""What runs inside a stage's job: `StageJob`, pickled by the launcher and called by submitit on the job's nodes.

A stage that declares `USES_RAY = True` (or whose `uses_ray(resources)` says so for the job's resources) gets a Ray
cluster across the job's nodes (runtime/ray_cluster.py) and its driver runs on task 0. The stage writes into
`<output>.partial`, renamed into place only when it succeeds, so a failed or killed job leaves nothing Snakemake takes
as done. Its resumable state lives in `checkpoint_dir` (kept across requeues and failures, removed once the stage
succeeds). A stall watch (runtime/progress.py) fails the stage, with every process's stacks in its log, when its
steps stop coming for launcher.stall_min.

This module is part of every stage's code hash (launcher/code_hash.py): what it does shapes every output.
"""
import dataclasses
import importlib
import json
import os
import random
import shutil
from collections.abc import MutableMapping
from pathlib import Path

import submitit

from runtime import checkpoints, tracking
from runtime.models import resolved_precision
from runtime.progress import StallWatch, beat, raise_if_stalled

# Set for every job and Ray worker: no hub downloads (unless the config allows them: set_job_env), quiet tokenizers,
# vLLM in-process on CPU.
JOB_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # For a process-local ray.init (the benches). A job's own Ray cluster overrides it: token auth with a fresh
    # secret per job, in the environment of `ray start` and the driver only (runtime/ray_cluster.py).
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
# The hub's offline switches of JOB_ENV.
HUB_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def set_job_env(environ: MutableMapping, hub_downloads: bool) -> None:
    """Set JOB_ENV in `environ` (a job's os.environ, before anything reads it; its Ray workers inherit it). Where the
    config lets the run download (launcher.hub_downloads), the hub's offline switches are removed instead, also
    those the submitting shell set: the config says whether the stages may download."""
    environ.update(JOB_ENV)
    if hub_downloads:
        for key in HUB_OFFLINE:
            del environ[key]


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
    resources: dict        # launcher.resources.stage_resources(): cluster, nodes, cpus/gpus per node, ray_port, ...
    checkpoint_dir: str
    hub_downloads: bool    # launcher.hub_downloads: the stage may download hub models and datasets

    def __call__(self):
        set_job_env(os.environ, self.hub_downloads)
        env = submitit.JobEnvironment()
        # Task 0 runs the driver, which sees every step; the other tasks serve Ray until it leaves.
        with StallWatch(self.resources["stall_min"] if env.global_rank == 0 else 0, self.run_name, env.job_id):
            module = importlib.import_module(f"stages.{self.stage}")
            uses_ray = module.uses_ray(self.resources) if hasattr(module, "uses_ray") else module.USES_RAY
            if not uses_ray:
                return self.run_driver(module)
            from runtime.ray_cluster import ray_cluster
            with ray_cluster(env, self.resources) as node:
                if node.is_driver:
                    beat("the job's Ray cluster is up")
                    return self.run_driver(module, ray_nodes=node.nodes)

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on a timeout or preemption signal, before it requeues the job: the requeued job
        runs this same StageJob, and the stage resumes from what it saved in `checkpoint_dir`."""
        print(f"[alignpipe] {self.run_name}: interrupted (timeout or preemption); requeueing; the stage resumes "
              f"from its last checkpoint in {self.checkpoint_dir}", flush=True)
        return super().checkpoint(*args, **kwargs)

    def run_driver(self, module, ray_nodes: list | None = None):
        output = Path(self.output)
        if output.exists() and not (output / "stage.json").exists():  # a stage replaces only what a stage made
            raise RuntimeError(f"{output} exists and no stage wrote it (it has no stage.json): move it aside and run "
                               "again")
        partial = output.with_name(output.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        ckpt = Path(self.checkpoint_dir)
        ckpt.mkdir(parents=True, exist_ok=True)
        seed = self.params.get("seed", 0)
        random.seed(seed)
        cfg = module.Config.from_params(self.params)
        try:
            # What `precision: auto` became on this job's devices (bf16 or fp32): recorded, numbers differ between
            # them; inside the try, so that a refused bf16 leaves no .partial behind
            precision = resolved_precision(cfg.precision, self.resources.get("gpus_per_node", 0) > 0) \
                if hasattr(cfg, "precision") else None
            with tracking.stage_run(self.tracking_uri, self.experiment, self.run_name, self.params) as tracker:
                tracker.checkpoint_dir = ckpt  # persistent across requeues; removed below once the stage succeeded
                module.run(cfg, {k: _paths(v) for k, v in self.inputs.items()}, partial, tracker)
                job = job_record(self.resources, ray_nodes, tracker.placements) | \
                    ({"precision": precision} if precision else {})
                _tag_run(tracker, job)
                (partial / "stage.json").write_text(json.dumps(
                    {"stage": self.stage, "params": self.params, "config_hash": tracking.config_hash(self.params),
                     "inputs": self.inputs, "mlflow_run_id": tracker.run_id, "job": job}, indent=2))
                raise_if_stalled()
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            checkpoints.remove_if_empty(ckpt)  # kept if the stage saved one: its rerun (or requeue) resumes from it
            raise
        shutil.rmtree(output, ignore_errors=True)
        partial.rename(output)
        checkpoints.remove(ckpt)
        return str(output)


def _paths(value):
    return [Path(v) for v in value] if isinstance(value, list) else Path(value)


def job_record(resources: dict, ray_nodes: list | None, placements: list[dict]) -> dict:
    """Where the stage ran: for stage.json and the MLflow run."""
    requested = {k: v for k, v in resources.items() if k not in ("sbatch_options", "ray_port")}
    record = {"cluster": resources["cluster"], "resources": requested}
    if "SLURM_JOB_ID" in os.environ:
        record["slurm"] = {"job_id": os.environ["SLURM_JOB_ID"], "nodes": os.environ.get("SLURM_JOB_NODELIST"),
                           "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                           "partition": os.environ.get("SLURM_JOB_PARTITION")}
    if ray_nodes is not None:
        record["ray_nodes"] = ray_nodes
    if placements:
        record["actors"] = placements
    return record


def _tag_run(tracker, job: dict) -> None:
    tags = {"launcher.cluster": job["cluster"], "launcher.resources": json.dumps(job["resources"])}
    if "ray_nodes" in job:
        tags["ray.nodes"] = ",".join(f"{n['hostname']}={n['ip']}" for n in job["ray_nodes"])
    if "actors" in job:
        tags["ray.actors"] = json.dumps([{k: p[k] for k in ("group", "rank", "hostname", "ip")} for p in job["actors"]])
    if "slurm" in job:
        tags["slurm.restarts"] = str(job["slurm"]["restarts"])
    if "precision" in job:
        tags["precision"] = job["precision"]
    tracker.set_tags({key: value[:5000] for key, value in tags.items()})  # retried, else buffered: never fatal
