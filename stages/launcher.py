"""Every stage runs through here: submitit job -> (Ray cluster) -> the stage's `run` -> atomic output.

Snakemake calls `launch_stage` on the submitting host. It submits a `StageJob` with submitit (the local
executor on a laptop, Slurm on a cluster), streams the job's log to the terminal, and raises with the job id
and log path if the job fails. Inside the job, a stage that declares `USES_RAY = True` gets a Ray cluster
across the job's nodes, and its driver runs on task 0. Outputs are written to `<output>.partial` and renamed
into place only when the stage succeeds, so a failed or killed job leaves nothing Snakemake takes as done.
"""
import argparse
import dataclasses
import datetime
import importlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import submitit

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
}


class StageFailed(RuntimeError):
    pass


def results_root(config: dict) -> Path:
    root = Path(config["results_dir"])
    return (root if root.is_absolute() else REPO_ROOT / root).resolve()


def tracking_uri(config: dict) -> str:
    return (os.environ.get("MLFLOW_TRACKING_URI") or config["tracking"]["uri"]
            or f"sqlite:///{results_root(config) / 'mlflow.db'}")


@dataclasses.dataclass
class StageJob(submitit.helpers.Checkpointable):
    """What runs inside the submitit job (pickled to it). Checkpointable: Slurm timeouts requeue it."""
    stage: str
    run_name: str
    params: dict           # the stage's cache key config: the only config the stage may read
    inputs: dict
    output: str
    experiment: str
    tracking_uri: str
    launcher: dict

    def __call__(self):
        os.environ.update(JOB_ENV)
        module = importlib.import_module(f"stages.{self.stage}")
        if not getattr(module, "USES_RAY", False):
            return self.run_driver(module)
        from stages.ray_cluster import ray_cluster
        env = submitit.JobEnvironment()
        with ray_cluster(env, self.launcher) as is_driver:
            if is_driver:
                return self.run_driver(module)

    def run_driver(self, module):
        from stages import tracking
        output = Path(self.output)
        partial = output.with_name(output.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        seed = self.params.get("seed", 0)
        random.seed(seed)
        cfg = module.Config.from_params(self.params)
        try:
            with tracking.stage_run(self.tracking_uri, self.experiment, self.run_name, self.params) as run:
                module.run(cfg, {k: _paths(v) for k, v in self.inputs.items()}, partial, run)
                (partial / "stage.json").write_text(json.dumps(
                    {"stage": self.stage, "params": self.params, "config_hash": config_hash(self.params),
                     "inputs": self.inputs, "mlflow_run_id": run.run_id}, indent=2))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(output, ignore_errors=True)
        partial.rename(output)
        return str(output)


def _paths(value):
    return [Path(v) for v in value] if isinstance(value, list) else Path(value)


def make_executor(stage: str, log_dir: Path, launcher: dict) -> submitit.Executor:
    executor = submitit.AutoExecutor(folder=log_dir, cluster=launcher["cluster"])
    executor.update_parameters(name=f"alignpipe-{stage}", timeout_min=launcher["timeout_min"],
                               nodes=1, tasks_per_node=1, stderr_to_stdout=True)
    return executor


def launch_stage(job: dict, inputs: dict, output: str, context: dict) -> None:
    """Run one stage as a submitit job and wait for it; raise StageFailed with job id and log on failure.

    `job` is the rule's cache key (stage, run_name, config, code), `inputs` its named input paths, and
    `context` says how to submit and track it (experiment, results_dir, launcher, tracking)."""
    inputs = {k: str(Path(v).resolve()) if isinstance(v, str) else [str(Path(p).resolve()) for p in v]
              for k, v in inputs.items()}
    output_path = Path(output).resolve()
    run_name = job["run_name"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    log_dir = results_root(context) / context["experiment"] / "logs" / run_name.replace("/", "-") / stamp
    job_spec = StageJob(stage=job["stage"], run_name=run_name, params=job["config"], inputs=inputs,
                        output=str(output_path), experiment=context["experiment"],
                        tracking_uri=tracking_uri(context), launcher=context["launcher"])
    submitted = make_executor(job["stage"], log_dir, context["launcher"]).submit(job_spec)
    log_path = Path(str(submitted.paths.stdout).replace("%t", "0"))
    print(f"[alignpipe] {run_name}: job {submitted.job_id} submitted ({context['launcher']['cluster']}), "
          f"log {log_path}", flush=True)
    follow_log(submitted, log_path)
    try:
        submitted.result()
    except Exception as err:  # submitit re-raises the job's exception or reports a lost job
        raise StageFailed(f"stage {run_name} failed: job {submitted.job_id}, state {submitted.state}, "
                          f"log {log_path}\n--- last lines of the log ---\n{tail(log_path)}\n--- error ---\n{err}"
                          ) from None
    if not output_path.exists():
        raise StageFailed(f"stage {run_name}: job {submitted.job_id} finished but wrote no {output_path} "
                          f"(log {log_path})")
    print(f"[alignpipe] {run_name}: done -> {output_path}", flush=True)


def follow_log(job, log_path: Path, poll_s: float = 1.0) -> None:
    """Echo the job's log to this terminal while it runs (stdout and stderr are merged by submitit)."""
    position = 0
    while True:
        done = job.done()
        if log_path.exists():
            with log_path.open("rb") as fh:
                fh.seek(position)
                chunk = fh.read()
                position += len(chunk)
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        if done:
            return
        time.sleep(poll_s)


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log was written)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run one alignpipe stage through submitit (called by the rules).")
    parser.add_argument("job", help="JSON: stage, run_name, config, code (a rule's params.stage)")
    parser.add_argument("inputs", help="JSON: the rule's named inputs")
    parser.add_argument("output", help="the stage's output directory")
    parser.add_argument("--context", required=True, help="JSON: experiment, results_dir, launcher, tracking")
    args = parser.parse_args(argv)
    try:
        launch_stage(json.loads(args.job), json.loads(args.inputs), args.output, json.loads(args.context))
    except StageFailed as err:
        print(f"[alignpipe] ERROR {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
