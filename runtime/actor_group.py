"""Ray placement of a stage's actors: a group of ranks that act as one distributed trainer (one DeepSpeed rank
each), and the placement groups they and the vLLM engines run in.

The driver calls a method on every rank at once and gets the per-rank results back in rank order; rank 0's
node address becomes the torch.distributed rendezvous for the group. On CPU the ranks are SPREAD across the job's
nodes (packed on one when there is one). On GPUs each rank's bundle holds a GPU and the ranks are PACKed onto as
few nodes as possible (as OpenRLHF packs them: NCCL inside a node is fastest); Ray gives each actor its own GPU id and
sets CUDA_VISIBLE_DEVICES to it. Ray numbers a group's bundles in the order they were asked for, not by node, so rank
i sits in the i-th bundle in node order (`bundles_by_node`): a node's ranks are consecutive. Roles that share GPUs
(`colocate`) share one placement group: rank i of every role sits in the same bundle, with a fraction of its GPU.
Each rank reports where it runs (node, process, GPU ids): `placements`, which the stage hands to its tracker
(stage.json and MLflow tags), and a line in the log.
"""
import os
import shutil
import socket
import subprocess

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_TIMEOUT_S = 300


def cluster_gpus() -> int:
    """GPUs in the stage's Ray cluster (what the job's nodes declared: Slurm's --gpus-per-node)."""
    return int(ray.cluster_resources().get("GPU", 0))


def gpu_compute_modes() -> dict[str, str]:
    """This node's GPUs' compute modes as nvidia-smi names them ("Default", "Exclusive_Process", "Prohibited"), by
    GPU index; {} where nvidia-smi is absent or fails (nothing to tell)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    query = subprocess.run([smi, "--query-gpu=index,compute_mode", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=60)
    rows = [line.split(",") for line in query.stdout.splitlines() if line.count(",") == 1]
    return {index.strip(): mode.strip() for index, mode in rows} if query.returncode == 0 else {}


def node_compute_modes() -> tuple[str, dict[str, str]]:
    return socket.gethostname(), gpu_compute_modes()


def check_gpus_shareable(why: str) -> None:
    """Several processes on one GPU (colocated roles, CUDA IPC, a tensor-parallel engine's actor beside its vLLM
    worker) need every GPU of the job in compute mode Default: under EXCLUSIVE_PROCESS, common on Slurm sites, the
    second process's first CUDA call fails, far from its cause. Asks nvidia-smi on every node of the stage's cluster
    and fails at the start, naming the GPUs; `why` says what shares them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU")]
    task = ray.remote(num_cpus=0)(node_compute_modes)
    found = ray.get([task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                     for node in nodes])
    problem = compute_mode_problem(found, why)
    if problem:
        raise RuntimeError(problem)


def compute_mode_problem(found: list[tuple[str, dict[str, str]]], why: str) -> str | None:
    """The failure message for the GPUs not in compute mode Default, from (host, {index: mode}) per node; None if all
    are."""
    wrong = [f"{host} GPU {index}: {mode}" for host, modes in found for index, mode in modes.items()
             if mode.lower() != "default"]
    if not wrong:
        return None
    return (f"{why} puts several processes on one GPU, which needs the GPUs' compute mode Default; found "
            f"{', '.join(wrong)} (nvidia-smi --query-gpu=index,compute_mode). Ask your cluster's admins for a partition "
            "or an sbatch option with compute mode Default (some sites: --gpu-compute-mode or a constraint), or set "
            "rl.colocate: false and vllm.tensor_parallel_size: 1 (one process per GPU)")


def reserve(bundles: list[dict], strategy: str, what: str):
    """A ready placement group of `bundles`; a clear error naming `what` if the cluster cannot hold it."""
    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not place {what} ({len(bundles)} x {bundles[0]}) within {PLACEMENT_TIMEOUT_S} s; the cluster "
            f"has {ray.cluster_resources()} ({len([n for n in ray.nodes() if n['Alive']])} node(s)). Give the stage "
            f"more nodes, CPUs or GPUs (launcher.stages.<stage>.nodes / cpus_per_node / gpus_per_node) or fewer "
            f"workers.") from None
    return group


def bundles(count: int, cpus: float, gpus: float) -> list[dict]:
    return [{"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus} for _ in range(count)]


def bundles_by_node(group) -> list[int]:
    """The bundle indices of a ready placement group, those of one node together: nodes in the order of their
    first bundle, each node's bundles in index order (under PACK, bundles 0-3 may lie on nodes A, B, A, B)."""
    nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
    by_node: dict[str, list[int]] = {}
    for index in sorted(nodes):
        by_node.setdefault(nodes[index], []).append(index)
    return [index for indices in by_node.values() for index in indices]


def actor_threads(cpus: float, job_threads: int, takes_turns: bool) -> int:
    """Torch threads for an actor that reserves `cpus` Ray CPUs: those, at least 1; or all the job's `job_threads`
    where the stage's actors take the job's cores in turn (on CPU: the rl stage's colocated roles, which generate,
    then score, then train; evaluation's engine, then its scorer), whatever their Ray CPU counts."""
    return job_threads if takes_turns else max(1, int(cpus))


def _where(self) -> dict:
    """Runs inside the actor: the node, process and GPUs it has."""
    return {"hostname": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def located(actor_cls):
    """`actor_cls` with one extra method, so that each actor can say where it runs."""
    return type(actor_cls.__name__, (actor_cls,), {"actor_group_where": _where})


class ActorGroup:
    def __init__(self, actor_cls, num_actors: int, cpus_per_actor: float = 1, gpus_per_actor: float = 0,
                 shared=None, env: dict | None = None):
        """`num_actors` ranks of `actor_cls`, each with `cpus_per_actor` CPUs and `gpus_per_actor` GPUs (a fraction
        where roles share GPUs), in a placement group of their own, or in the first num_actors bundles of `shared`
        in node order."""
        self.own_placement = shared is None
        self.placement = reserve(bundles(num_actors, cpus_per_actor, gpus_per_actor),
                                 "PACK" if gpus_per_actor else "SPREAD",
                                 f"{num_actors} {actor_cls.__name__} actors") if shared is None else shared
        remote_cls = ray.remote(num_cpus=cpus_per_actor, num_gpus=gpus_per_actor)(located(actor_cls))
        self.actors = [
            remote_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
                runtime_env={"env_vars": env or {}},
            ).remote()
            for i in bundles_by_node(self.placement)[:num_actors]
        ]
        self.placements = [{"group": actor_cls.__name__, "rank": rank, **where}
                           for rank, where in enumerate(self.call("actor_group_where"))]
        print(f"[ray] {actor_cls.__name__}: " + ", ".join(
            f"rank {p['rank']} on {p['hostname']} ({p['ip']})" + (f" GPU {','.join(p['gpu_ids'])}" if p["gpu_ids"] else "")
            for p in self.placements), flush=True)
        master_addr, master_port = ray.get(self.actors[0].rendezvous_address.remote())
        self.rendezvous = {"master_addr": master_addr, "master_port": master_port, "world_size": num_actors}

    def call(self, method: str, *args, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; returns results in rank order."""
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def call_per_rank(self, method: str, per_rank_args: list) -> list:
        """Call `method` on rank i with per_rank_args[i] (e.g. each rank's share of a batch)."""
        return ray.get([getattr(a, method).remote(arg) for a, arg in zip(self.actors, per_rank_args)])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if self.own_placement:
            ray.util.remove_placement_group(self.placement)
