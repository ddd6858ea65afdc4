"""`snakemake --profile slurm all` against the real two-node Slurm cluster of tests/slurm/local_cluster.sh.

One module-scoped scenario, run the way a user would from the repository root, that the tests then examine:
  1. a first run; once the SFT job (2 nodes, a Ray cluster across them) is running, it is cancelled with
     scancel: Snakemake must report the failure (job id, state, nodes, log path and tail) and leave no output;
  2. a rerun; once SFT has written a checkpoint, its job is interrupted the way Slurm signals a timeout
     (submitit's `_interrupt(timeout=True)`: USR2): the job must be requeued through submitit's checkpoint
     mechanism and resume from the checkpoint; once the resumed job has written a later checkpoint, a job in
     the higher-priority partition preempts it (PreemptMode=REQUEUE): requeued by Slurm, it must resume from
     that later checkpoint; the run must then complete, every stage as its own Slurm job.
The reward model stage asks for GPUs (the test cluster's placeholder GPUs, local_cluster.sh): --gpus-per-node goes
through sbatch to Ray's nodes, and each DeepSpeed rank gets its own GPU from Ray (its training still runs on CPU).
"""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import submitit
import yaml

from launcher.config import REPO_ROOT, validate_config
from pipeline_helpers import SNAKEMAKE, planned_jobs, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

SFT_EPOCHS, CHECKPOINT_EVERY = 20, 25           # 64 rows / batch 8 = 8 steps per epoch
SFT_STEPS = 8 * SFT_EPOCHS
# One training stage with GPUs: reward_model (one node, its 2 ranks PACKed onto that node's 2 GPUs). Not sft: on GPUs
# Ray PACKs the ranks onto one node, and the sft job must keep its ranks on both nodes (one gloo group across them).
GPU_STAGE, GPUS_PER_NODE = "reward_model", 2
SUBMITTED = re.compile(r"\[alignpipe\] (?P<run>[\w/]+): job (?P<id>\d+) submitted \(.*?\), log (?P<log>\S+)")


def tiny_slurm_config(path: Path, results: Path) -> Path:
    """config/tiny.yaml sized for two nodes of 2 CPUs / 8 GB: SFT on both nodes, long enough to interrupt."""
    config = yaml.safe_load((REPO_ROOT / "config" / "tiny.yaml").read_text())
    config["results_dir"] = str(results)
    config["sft"] |= {"epochs": SFT_EPOCHS, "checkpoint_every": CHECKPOINT_EVERY, "num_workers": 2}
    config["evaluate"]["models"] = ["sft"]
    config["seeds"] = None  # each method once
    config["dpo"] = None  # no DPO: it trains through the same launcher, Ray and DeepSpeed path as sft and reward_model
    # The GPU job's mem_gb: the memory plan (launcher/memory.py) counts 3 GB of host memory per GPU process and lets
    # them fill 85% of mem_gb; the nodes have 8000 MB.
    config["launcher"] = {"mem_gb": 3, "cpus_per_node": 2, "timeout_min": 30,
                          "stages": {"sft": {"nodes": 2}, GPU_STAGE: {"gpus_per_node": GPUS_PER_NODE, "mem_gb": 7.5}}}
    # No RL: on Slurm it would run the parts the other stages run there (DeepSpeed ranks as sft and reward_model, vLLM
    # as evaluate), and its job took 77 s of the scenario's 8.5 minutes (2026-12-04).
    config["rl"]["variants"] = {}
    validate_config(config)
    path.write_text(yaml.safe_dump(config))
    return path


class Run:
    """`snakemake --profile slurm all` in the background, its output in a file that the test can watch."""

    def __init__(self, name: str, configfile: Path, root: Path, *extra: str, cores: int = 1):
        self.out_path = root / f"{name}.out"
        self.started = time.time()
        # One stage at a time where stages start Ray clusters (`cores`): the two test nodes share this machine's 2
        # cores, and several Ray clusters starting at once on them time out waiting for their GCS.
        self.proc = subprocess.Popen([SNAKEMAKE, "--profile", "slurm", "all", "--cores", str(cores), "--configfile",
                                      str(configfile), *extra],
                                     cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=self.out_path.open("w"),
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def submitted(self, run_name: str) -> dict | None:
        for match in SUBMITTED.finditer(self.output):
            if match["run"] == run_name:
                return match.groupdict()
        return None

    def wait_for(self, what: str, predicate, timeout: float):
        deadline = time.time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                pytest.fail(f"snakemake ended (rc {self.proc.returncode}) before {what}:\n{self.output[-6000:]}")
            if time.time() > deadline:
                self.stop()
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.output[-6000:]}")
            time.sleep(1)

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"snakemake did not finish within {timeout:.0f} s:\n{self.output[-6000:]}")
        self.elapsed = time.time() - self.started
        return self.proc.returncode

    def stop(self):
        """Like Ctrl-C in a terminal: SIGINT to Snakemake and its launchers, which cancel their Slurm jobs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def log_text(path: str) -> str:
    return Path(path).read_text(errors="replace") if Path(path).exists() else ""


def sacct(job_id: str, *fields: str, duplicates: bool = False) -> list[dict]:
    cmd = ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", ",".join(fields)] + (["-D"] if duplicates else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL).stdout
    return [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]


def ray_processes(job_id: str) -> list[str]:
    """Processes that belong to a job's Ray nodes (their temp dirs are /tmp/ray-<job id>-...)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"/tmp/ray-{job_id}-" in cmdline:
                found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.fixture(scope="module")
def scenario(slurm_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-pipeline")
    results = root / "results"
    configfile = tiny_slurm_config(root / "tiny-slurm.yaml", results)
    data = {"root": root, "configfile": configfile, "results": results / "tiny", "cluster": slurm_cluster}

    runs = []  # stopped (like Ctrl-C: their launchers cancel their jobs) if the scenario breaks off
    try:
        # 1. Cancel the SFT job while its two-node Ray cluster is up. Until then only SFT starts Ray: the stages
        # before it (base_model, preprocess) run two at a time, one on each node.
        first = Run("first", configfile, root, cores=2)
        runs.append(first)
        sft = first.wait_for("the sft job to be submitted", lambda: first.submitted("sft"), 900)
        first.wait_for("Ray to be up across the sft job's nodes",
                       lambda: "[ray] cluster up: 2 node(s)" in log_text(sft["log"]), 600)
        subprocess.run(["scancel", sft["id"]], check=True)
        data["cancel"] = {"job": sft, "rc": first.wait(600), "output": first.output,
                          "left": sorted(str(p.relative_to(results)) for p in (results / "tiny").glob("sft*"))}
        wait_until(lambda: not ray_processes(sft["id"]), 60)
        data["cancel"]["ray_left"] = ray_processes(sft["id"])

        # 2. Rerun; interrupt SFT as a timeout would, once it has saved a checkpoint; then preempt the resumed job.
        second = Run("second", configfile, root)
        runs.append(second)
        sft2 = second.wait_for("the rerun's sft job to be submitted", lambda: second.submitted("sft"), 600)
        checkpoint = second.wait_for("a first SFT checkpoint", lambda: re.search(
            r"\[checkpoint\] step (\d+) ", log_text(sft2["log"])), 900)
        job = submitit.SlurmJob(folder=Path(sft2["log"]).parent, job_id=sft2["id"], tasks=(0, 1))
        job._interrupt(timeout=True)  # what Slurm does before a time limit (`scancel --signal USR2`)
        second.wait_for("the requeued SFT job to resume and save a later checkpoint", lambda: re.search(
            r"resumed from checkpoint at step \d+\n.*\[checkpoint\] step \d+ ", log_text(sft2["log"]), re.S), 900)
        high = subprocess.run(["sbatch", "--parsable", "-p", slurm_cluster["preempt_partition"], "-N2", "--exclusive",
                               f"--output={root}/high-%j.out", "--job-name=preemptor", "--wrap", "sleep 5"],
                              capture_output=True, text=True, check=True).stdout.strip()
        data["requeue"] = {"job": sft2, "first_checkpoint": int(checkpoint.group(1)), "preemptor": high,
                           "rc": second.wait(1800), "output": second.output, "elapsed": second.elapsed}
        wait_until(lambda: not ray_processes(sft2["id"]), 60)
        data["requeue"]["ray_left"] = ray_processes(sft2["id"])
    finally:
        for run in runs:
            run.stop()
    yield data


def test_cancelled_stage_reports_job_and_log_and_leaves_no_output(scenario):
    cancel = scenario["cancel"]
    job_id, output = cancel["job"]["id"], cancel["output"]
    assert cancel["rc"] != 0, output[-4000:]
    match = re.search(r"stage sft failed: job (\d+), state (\w+), log (\S+)\n\s+nodes: (\S+) \| sacct: State=CANCELLED", output)
    assert match, output[-6000:]
    assert match.group(1) == job_id and match.group(2) == "CANCELLED"
    assert match.group(3) == cancel["job"]["log"] and Path(match.group(3)).is_file()
    assert "/logs/sft/" in match.group(3)
    assert match.group(4) == "n[1-2]", "the failure names the job's nodes"
    tail = output.split("--- last lines of the log ---", 1)[1]
    assert "[ray] cluster up: 2 node(s)" in tail, "the log's tail is in Snakemake's output"
    assert sacct(job_id, "State")[0]["State"].startswith("CANCELLED")
    results = scenario["results"]
    assert (results / "base_model" / "stage.json").exists() and (results / "preprocess" / "prompts" / "stage.json").exists()
    assert cancel["left"] == [], "a cancelled stage leaves no output (nor a .partial) behind"
    assert cancel["ray_left"] == [], f"Ray processes of the cancelled job are still running: {cancel['ray_left']}"
    rerun_jobs = [m["run"] for m in SUBMITTED.finditer(scenario["requeue"]["output"])]
    assert "sft" in rerun_jobs and "base_model" not in rerun_jobs, "the rerun redid only what had not finished"


def test_rerun_completes_with_every_stage_as_a_slurm_job(scenario):
    run = scenario["requeue"]
    assert run["rc"] == 0, run["output"][-6000:]
    results = scenario["results"]
    assert (results / "report" / "report.md").exists()
    stage_dirs = sorted(p.parent for p in results.rglob("stage.json"))
    stages = {json.loads((d / "stage.json").read_text())["stage"] for d in stage_dirs}
    assert {"base_model", "preprocess", "sft", "evaluate", "report"} <= stages
    for directory in stage_dirs:
        record = json.loads((directory / "stage.json").read_text())
        assert record["job"]["cluster"] == "slurm", directory
        job_id = record["job"]["slurm"]["job_id"]
        wait_until(lambda: sacct(job_id, "State")[0]["State"] == "COMPLETED", 120)  # the last may be tearing down
        [row] = sacct(job_id, "JobID", "JobName", "State", "NodeList")
        assert row["JobName"] == f"alignpipe-{record['stage']}" and row["State"] == "COMPLETED", (directory, row)
    assert not list(results.rglob("*.partial")), "a partial output was left behind"
    assert not (results / "checkpoints").exists(), "checkpoints are deleted once their stage succeeded"


def test_sft_ran_on_a_two_node_ray_cluster_with_work_on_both(scenario):
    results = scenario["results"]
    nodes = scenario["cluster"]["nodes"]  # {"n1": "10.77.0.11", "n2": "10.77.0.12"}
    job = json.loads((results / "sft" / "stage.json").read_text())["job"]
    assert job["slurm"]["nodes"] == "n[1-2]"
    assert {(n["hostname"], n["ip"]) for n in job["ray_nodes"]} == set(nodes.items())
    ranks = [a for a in job["actors"] if a["group"] == "SFTWorker"]
    assert sorted(a["rank"] for a in ranks) == [0, 1]
    assert {a["hostname"] for a in ranks} == {"n1", "n2"}, f"the two DeepSpeed ranks shared a node: {ranks}"
    assert all(nodes[a["hostname"]] == a["ip"] for a in ranks), "Ray must use the node addresses, not loopback"
    assert all(a["gpu_ids"] == [] for a in ranks) and all(n["gpus"] == 0 for n in job["ray_nodes"]), \
        "sft's job has no GPUs (only the GPU stage asks for them)"
    # The ranks trained together (one gloo group across the nodes) for every step.
    assert json.loads((results / "sft" / "metrics.json").read_text())["steps"] == SFT_STEPS
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{results.parent / 'mlflow.db'}")
    run = client.get_run(json.loads((results / "sft" / "stage.json").read_text())["mlflow_run_id"])
    assert {a["hostname"] for a in json.loads(run.data.tags["ray.actors"])} == {"n1", "n2"}
    assert run.data.tags["slurm.nodes"] == "n[1-2]"


def test_gpu_stage_gets_its_gpus_from_slurm_and_each_rank_its_own_gpu_from_ray(scenario):
    """launcher.stages.reward_model.gpus_per_node: 2 -> sbatch --gpus-per-node=2 -> `ray start --num-gpus=2` -> one GPU
    per DeepSpeed rank, each rank's CUDA_VISIBLE_DEVICES naming the GPU Ray gave it."""
    results = scenario["results"]
    record = json.loads((results / GPU_STAGE / "stage.json").read_text())
    job = record["job"]
    assert job["resources"]["gpus_per_node"] == GPUS_PER_NODE
    assert [n["gpus"] for n in job["ray_nodes"]] == [GPUS_PER_NODE], job["ray_nodes"]
    assert {a["group"] for a in job["actors"]} == {"RewardWorker"}, job["actors"]
    ranks = sorted(job["actors"], key=lambda a: a["rank"])
    assert [a["rank"] for a in ranks] == [0, 1]
    assert all(len(a["gpu_ids"]) == 1 for a in ranks), f"each rank gets exactly one GPU: {ranks}"
    assert sorted(a["gpu_ids"][0] for a in ranks) == ["0", "1"], f"the ranks share a GPU: {ranks}"
    for a in ranks:
        assert a["cuda_visible_devices"] == a["gpu_ids"][0], a
    # What the job asked Slurm for: submitit's sbatch script, and what Slurm allocated (sacct's AllocTRES).
    job_id = job["slurm"]["job_id"]
    scripts = list((results / "logs" / GPU_STAGE).glob(f"*/{job_id}_submission.sh"))
    assert len(scripts) == 1, scripts
    assert f"#SBATCH --gpus-per-node={GPUS_PER_NODE}" in scripts[0].read_text().splitlines()
    [row] = sacct(job_id, "AllocTRES")
    assert f"gres/gpu={GPUS_PER_NODE}" in row["AllocTRES"].split(","), row
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{results.parent / 'mlflow.db'}")
    run = client.get_run(record["mlflow_run_id"])
    assert json.loads(run.data.tags["launcher.resources"])["gpus_per_node"] == GPUS_PER_NODE


def sft_log_attempts(scenario) -> list[str]:
    """The SFT job's task-0 log, one piece per run of the job (a requeued job appends to the same log)."""
    job_id = scenario["requeue"]["job"]["id"]
    pieces = re.split(rf"(?=submitit INFO \([^)]*\) - Starting with JobEnvironment\(job_id={job_id}, )",
                      log_text(scenario["requeue"]["job"]["log"]))
    return [piece for piece in pieces if piece.startswith("submitit INFO")]


def checkpoints_in(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"\[checkpoint\] step (\d+) ", text)]


def resumed_in(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"\[sft\] resumed from checkpoint at step (\d+)", text)]


def mlflow_sft_runs(scenario) -> dict:
    """MLflow's SFT runs of this experiment, by the step they resumed from (0: started from scratch)."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{scenario['results'].parent / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    runs = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == "sft"]
    return client, {int(r.data.metrics.get("resumed_from_step", 0)): r for r in runs}


def test_interrupted_stage_is_requeued_and_resumes_from_its_checkpoint(scenario):
    run = scenario["requeue"]
    assert run["rc"] == 0, run["output"][-6000:]
    job_id = run["job"]["id"]
    attempts = sft_log_attempts(scenario)
    assert len(attempts) == 3, "the SFT job ran three times: interrupted, preempted, finished"
    first, second = attempts[0], attempts[1]
    # Interrupted like a timeout: submitit caught USR2, called StageJob.checkpoint and requeued the same job.
    assert "Caught signal SIGUSR2 on n1" in first and "Calling checkpoint method" in first
    assert "interrupted (timeout or preemption); requeueing" in first
    assert f"Requeued job {job_id}" in first or "DUE TO JOB REQUEUE" in first
    assert resumed_in(first) == [] and checkpoints_in(first)[0] == run["first_checkpoint"]
    # ... and resumed from the last checkpoint it had saved, not from step 0.
    step = checkpoints_in(first)[-1]
    assert 0 < step < SFT_STEPS
    assert resumed_in(second) == [step], second[-5000:]
    client, runs = mlflow_sft_runs(scenario)
    trained = [m.step for m in client.get_metric_history(runs[step].info.run_id, "loss")]
    assert trained[0] == step + 1, f"the resumed job redid steps it had checkpointed: {trained[:5]}"
    assert f"[alignpipe] sft: job {job_id} was requeued" in run["output"], "the launcher kept waiting through it"
    states = wait_until(lambda: (s := [r["State"] for r in sacct(job_id, "State", duplicates=True)])[-1] == "COMPLETED"
                        and s, 120)
    assert states and states[0] == "REQUEUED", sacct(job_id, "State", duplicates=True)


def test_preempted_stage_is_requeued_by_slurm_and_resumes_from_its_last_checkpoint(scenario):
    run = scenario["requeue"]
    assert run["rc"] == 0, run["output"][-6000:]
    job_id, results = run["job"]["id"], scenario["results"]
    _, second, third = sft_log_attempts(scenario)
    assert f"JOB {job_id} ON n1 CANCELLED AT" in second and "DUE TO PREEMPTION" in second
    assert sacct(run["preemptor"], "State")[0]["State"] == "COMPLETED", "the preempting job ran"
    step = checkpoints_in(second)[-1]
    assert resumed_in(second)[0] < step < SFT_STEPS
    assert resumed_in(third) == [step], third[-5000:]
    states = wait_until(lambda: (s := [r["State"] for r in sacct(job_id, "State", duplicates=True)])[-1] == "COMPLETED"
                        and s, 120)
    assert states == ["REQUEUED", "PREEMPTED", "COMPLETED"], states
    record = json.loads((results / "sft" / "stage.json").read_text())
    assert record["job"]["slurm"]["restarts"] == 2
    # The finished run is the one that resumed last; it trained exactly the steps after that checkpoint, and the
    # training log (restored from the checkpoints) has every step once.
    client, runs = mlflow_sft_runs(scenario)
    finished = runs[step]
    assert finished.info.run_id == record["mlflow_run_id"] and finished.info.status == "FINISHED"
    trained = [m.step for m in client.get_metric_history(finished.info.run_id, "loss")]
    assert trained == list(range(step + 1, SFT_STEPS + 1))
    log_rows = [json.loads(line) for line in (results / "sft" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log_rows] == list(range(1, SFT_STEPS + 1))
    assert run["ray_left"] == [], f"Ray processes of the finished job are still running: {run['ray_left']}"


def slurm_plan(configfile: Path, *extra: str) -> dict[str, int]:
    """What `snakemake --profile slurm all --dry-run` would run: rule -> count."""
    proc = subprocess.run([SNAKEMAKE, "--profile", "slurm", "all", "--configfile", str(configfile), "--dry-run", *extra],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return planned_jobs(proc.stdout)


def test_where_a_stage_runs_is_not_part_of_its_cache_key(scenario):
    """Other resources, from the config's launcher block or from the profile, plan exactly what the finished
    run's own config plans (nothing, unless someone edited the code in the meantime)."""
    config = yaml.safe_load(scenario["configfile"].read_text())
    config["launcher"] = {"mem_gb": 2, "timeout_min": 60, "partition": "debug", "stages": {"sft": {"nodes": 1}}}
    changed = scenario["root"] / "changed-launcher.yaml"
    changed.write_text(yaml.safe_dump(config))
    same = slurm_plan(scenario["configfile"])
    assert slurm_plan(changed, "--set-resources", "sft:mem_gb=3", "report:cluster=local") == same


def test_impossible_request_fails_before_anything_is_queued(slurm_cluster, tmp_path):
    """More memory than a node has: Slurm says so at once (sbatch --test-only), and no job is queued."""
    config = tiny_slurm_config(tmp_path / "big.yaml", tmp_path / "results")
    config.write_text(config.read_text().replace("mem_gb: 3", "mem_gb: 16"))
    before = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID", "-S", "now-1hours"], capture_output=True,
                            text=True, check=True).stdout.split()
    start = time.time()
    proc = subprocess.run([SNAKEMAKE, "--profile", "slurm", "all", "--configfile", str(config)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "stage base_model was not submitted: Slurm would not accept the job" in output, output[-4000:]
    assert "Requested node configuration is not available" in output and "16 GB" in output
    assert "mem_gb from launcher.mem_gb" in output, "the message says where the value came from"
    assert time.time() - start < 120
    after = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID", "-S", "now-1hours"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert after == before, "a job was queued"
    assert not (tmp_path / "results" / "tiny" / "base_model").exists()
