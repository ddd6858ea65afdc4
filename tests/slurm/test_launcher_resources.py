"""Where a stage runs and how big its job is: config, per-stage overrides, profile resources, and the errors
a bad request gives before anything is queued. Pure Python (no cluster needed)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import REPO_ROOT, validate_config
from launcher.resources import LaunchConfigError, check_fits, sbatch_flags, stage_resources
from pipeline_helpers import fake_slurm_commands
from runtime.ray_cluster import base_port, node_addresses, ray_start_command


def launcher(**overrides) -> dict:
    return validate_config({"launcher": overrides})["launcher"]


def test_precedence_config_then_stage_then_profile():
    block = launcher(mem_gb=8, partition="cpu", stages={"sft": {"nodes": 2, "partition": "gpu", "gpus_per_node": 4}})
    res, sources = stage_resources("sft", block, {"cluster": "slurm", "account": "lab", "mem_gb": 64, "tmpdir": "/tmp"})
    assert (res["cluster"], res["nodes"], res["gpus_per_node"], res["partition"]) == ("slurm", 2, 4, "gpu")
    assert (res["mem_gb"], res["account"], res["cpus_per_node"]) == (64, "lab", 2)
    assert sources["nodes"] == "launcher.stages.sft.nodes" and sources["cpus_per_node"] == "launcher.cpus_per_node"
    assert "profile" in sources["mem_gb"]
    # Another stage only sees the launcher-wide keys.
    other, _ = stage_resources("evaluate", block, {"cluster": "slurm"})
    assert (other["nodes"], other["partition"], other["gpus_per_node"]) == (1, "cpu", 0)


def test_profile_values_arrive_as_strings_and_are_checked():
    res, _ = stage_resources("sft", launcher(), {"cluster": "slurm", "nodes": "2", "mem_gb": "2.5",
                                                 "sbatch_extra": "--qos=high --exclusive"})
    assert res["nodes"] == 2 and res["mem_gb"] == 2.5
    assert res["sbatch_options"] == {"qos": "high", "exclusive": True}
    assert "--qos=high" in sbatch_flags(res) and "--exclusive" in sbatch_flags(res)
    assert "--nodes=2" in sbatch_flags(res) and "--requeue" in sbatch_flags(res)


def test_memory_left_null_is_16_gb_on_slurm_and_this_machines_locally():
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    machine_gb = int(meminfo["MemTotal"].split()[0]) / (1 << 20)  # (kB)
    local, sources = stage_resources("sft", launcher())
    assert machine_gb - 1 < local["mem_gb"] <= machine_gb and "null: this machine" in sources["mem_gb"]
    on_slurm, sources = stage_resources("sft", launcher(), {"cluster": "slurm"})
    assert on_slurm["mem_gb"] == 16 and "--mem=16GB" in sbatch_flags(on_slurm) and "null: on Slurm" in sources["mem_gb"]
    assert stage_resources("sft", launcher(mem_gb=3), {"cluster": "slurm"})[0]["mem_gb"] == 3


@pytest.mark.parametrize("profile, fragments", [
    ({"nodes": "two"}, ["nodes", "of rule sft", "'two'", "whole number >= 1"]),
    ({"cluster": "kubernetes"}, ["cluster", "'kubernetes'", "local", "slurm"]),
    ({"gpus_per_node": -1}, ["gpus_per_node", "whole number >= 0"]),
    ({"mem_gb": 0}, ["mem_gb", ">= 1"]),
    ({"mem_gb": "0.001"}, ["mem_gb", "'0.001'", ">= 1"]),
    ({"sbatch_extra": "--nodes=4"}, ["--nodes is set by the launcher", "nodes"]),
    ({"sbatch_extra": "--time=10"}, ["--time is set by the launcher", "timeout_min"]),
    ({"sbatch_extra": "-q high"}, ["'-q' is not a long sbatch option"]),
    ({"slurm_partition": "gpu"}, ["slurm_partition", "not read", "use `partition`"]),
    ({"runtime": 60}, ["runtime", "use `timeout_min`"]),
])
def test_bad_profile_resources_name_the_resource(profile, fragments):
    with pytest.raises(LaunchConfigError) as err:
        stage_resources("sft", launcher(), {"cluster": "slurm", **profile})
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_local_executor_cannot_span_nodes():
    with pytest.raises(LaunchConfigError, match=r"launcher.stages.sft.nodes = 2.*local executor.*1 node"):
        stage_resources("sft", launcher(stages={"sft": {"nodes": 2}}), {})
    stage_resources("sft", launcher(stages={"sft": {"nodes": 2}}), {"cluster": "slurm"})  # fine on Slurm


def test_training_workers_must_fit_the_job():
    res, sources = stage_resources("sft", launcher(cpus_per_node=2), {"cluster": "slurm"})
    check_fits("sft", {"sft": {"num_workers": 2}, "seed": 0}, res, sources)
    with pytest.raises(LaunchConfigError, match=r"sft.num_workers = 3 .* 1 node\(s\) .* x 2 CPUs .* = 2"):
        check_fits("sft", {"sft": {"num_workers": 3}, "seed": 0}, res, sources)
    res, sources = stage_resources("sft", launcher(cpus_per_node=2, stages={"sft": {"nodes": 2}}), {"cluster": "slurm"})
    check_fits("sft", {"sft": {"num_workers": 3}, "seed": 0}, res, sources)
    res, sources = stage_resources("rl", launcher(cpus_per_node=2), {"cluster": "slurm"})
    check_fits("rl", {"rl": {"num_workers": 4, "colocate": True}}, res, sources)  # its roles share the cores


def test_schema_rejects_unknown_stage_and_bad_values():
    from launcher.config import ConfigError
    with pytest.raises(ConfigError, match=r"unknown key launcher.stages.stf; valid keys here: .*sft"):
        validate_config({"launcher": {"stages": {"stf": {"nodes": 2}}}})
    with pytest.raises(ConfigError, match=r"launcher.stages.sft.gpus_per_node = -1 is out of range"):
        validate_config({"launcher": {"stages": {"sft": {"gpus_per_node": -1}}}})


def test_slurm_profile_is_found_by_name_from_the_repository_root(tmp_path):
    """`snakemake --profile slurm` resolves ./slurm first: the link to cluster_profiles/slurm."""
    link = REPO_ROOT / "slurm"
    assert link.is_symlink() and link.resolve() == (REPO_ROOT / "cluster_profiles" / "slurm").resolve()
    config = tmp_path / "c.yaml"
    imdb = {"path": "builtin:imdb"}  # every stage: SFT, the reward model (rl's reward), DPO and RL
    config.write_text(json.dumps({"experiment": "profile-check", "results_dir": str(tmp_path / "results"),
                                  "data": {role: imdb for role in ("sft", "preference", "prompts", "eval")},
                                  "dpo": {}, "rl": {"variants": {"grpo": {"estimator": "group_norm"}}}}))
    # Slurm's commands as the checks before queueing want them (this test needs no cluster; a fresh machine has
    # none before the slurm_cluster fixture installs it)
    env = os.environ | {"PATH": f"{fake_slurm_commands(tmp_path / 'bin')}:{os.environ['PATH']}"}
    proc = subprocess.run([str(Path(sys.executable).with_name("snakemake")), "--profile", "slurm", "all", "--configfile",
                           str(config), "--dry-run", "--printshellcmds"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The profile's default resource reaches each launcher call; nothing was run or written.
    assert '"cluster": "slurm"' in proc.stdout
    assert not (tmp_path / "results").exists()


def test_ray_addresses_and_ports():
    assert node_addresses(0, ["anything"], "local") == ("127.0.0.1", "127.0.0.1")
    head, mine = node_addresses(0, ["localhost"], "slurm")  # single node: this host's own address
    assert head == mine
    assert base_port("12", 0, 0) != base_port("12", 0, 1), "a requeued job must get fresh ports"
    assert base_port("12", 0) == base_port("12", 0) and base_port("12", 31000) == 31000
    derived = base_port("12", 0)
    assert base_port("12", 0, free=lambda port: port != derived) == (derived - 20000 + 100) % 40000 + 20000
    with pytest.raises(RuntimeError, match="launcher.ray_port"):
        base_port("12", 0, free=lambda port: False)
    res = {"cpus_per_node": 2, "gpus_per_node": 1, "mem_gb": 4}
    head_cmd = ray_start_command(None, "10.0.0.1", 30000, res, "/tmp/x")
    assert "--head" in head_cmd and "--include-dashboard=false" in head_cmd and "--block" in head_cmd
    assert "--port=30000" in head_cmd and "--num-gpus=1" in head_cmd and "--node-ip-address=10.0.0.1" in head_cmd
    worker_cmd = ray_start_command("10.0.0.1:30000", "10.0.0.2", 30000, res, "/tmp/y")
    assert "--address=10.0.0.1:30000" in worker_cmd and "--head" not in worker_cmd
    assert not any(arg.startswith("--ray-client-server-port") for arg in worker_cmd)


def test_gpu_jobs_count_gpus_per_role():
    """On a GPU job every rank, frozen-model rank and engine GPU takes a GPU: summed, or the largest role when the
    roles share GPUs (colocate); settings that need GPUs are refused on a job without them."""
    rl = {"num_workers": 4, "frozen_ranks": 2, "estimator": "gae", "reward": "model", "colocate": False,
          "zero_stage": 3, "vllm": {"num_engines": 2, "tensor_parallel_size": 2, "sleep": False}}
    res, sources = stage_resources("rl", launcher(gpus_per_node=8), {"cluster": "slurm"})
    with pytest.raises(LaunchConfigError, match=r"needs 16 GPUs \(policy 4, reference 2, vLLM 4, critic 4, reward "
                                                r"model 2; summed\).* 1 node\(s\) .* x 8 GPUs .* = 8"):
        check_fits("rl", {"rl": rl}, res, sources)
    check_fits("rl", {"rl": rl | {"colocate": True}}, res, sources)  # the largest role: 4 of 8
    res2, sources2 = stage_resources("rl", launcher(gpus_per_node=8, stages={"rl": {"nodes": 2}}), {"cluster": "slurm"})
    check_fits("rl", {"rl": rl}, res2, sources2)
    with pytest.raises(LaunchConfigError, match=r"tensor_parallel_size = 16 .* exceed a node's 8"):
        check_fits("rl", {"rl": rl | {"colocate": True, "vllm": {"num_engines": 1, "tensor_parallel_size": 16}}},
                   res2, sources2)
    with pytest.raises(LaunchConfigError, match=r"vllm.sleep needs colocate: true and zero_stage: 3"):
        check_fits("rl", {"rl": rl | {"vllm": {"num_engines": 1, "sleep": True}}}, res2, sources2)
    cpu, cpu_sources = stage_resources("rl", launcher(), {})
    for gpu_only, key in [({"vllm": {"tensor_parallel_size": 2}}, "vllm.tensor_parallel_size"),
                          ({"vllm": {"sleep": True}}, "vllm.sleep"), ({"offload_optimizer": True}, "offload_optimizer")]:
        with pytest.raises(LaunchConfigError, match=rf"rl.{key} = .* needs GPUs"):
            check_fits("rl", {"rl": {"num_workers": 1} | gpu_only}, cpu, cpu_sources)
    res, sources = stage_resources("sft", launcher(gpus_per_node=2), {})
    with pytest.raises(LaunchConfigError, match=r"stage sft needs 4 GPUs \(trainer 4"):
        check_fits("sft", {"sft": {"num_workers": 4}}, res, sources)
