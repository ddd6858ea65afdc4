"""A group of Ray actors that act as one distributed trainer (one DeepSpeed rank each).

The driver calls a method on every rank at once and gets the per-rank results back in rank order; rank 0's
node address becomes the torch.distributed rendezvous for the group. The ranks are placed with a placement
group (SPREAD: across the job's nodes when there are several) and each rank reports the node it runs on:
`placements`, which the stage hands to its tracker (stage.json and MLflow tags), and a line in the log.
"""
import os
import socket

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_TIMEOUT_S = 300


def _where(self) -> dict:
    """Runs inside the actor: the node and process it lives in."""
    return {"hostname": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


class ActorGroup:
    def __init__(self, actor_cls, num_actors: int, cpus_per_actor: float = 1, strategy: str = "SPREAD",
                 env: dict | None = None):
        # SPREAD places ranks on different nodes when there are several, and packs them on one otherwise.
        bundles = [{"CPU": cpus_per_actor}] * num_actors
        self.placement = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement)
            raise RuntimeError(
                f"Ray could not place {num_actors} {actor_cls.__name__} actors of {cpus_per_actor:g} CPU each "
                f"within {PLACEMENT_TIMEOUT_S} s; the cluster has {ray.cluster_resources()} "
                f"({len([n for n in ray.nodes() if n['Alive']])} node(s)). Give the stage more nodes or CPUs "
                f"(launcher.stages.<stage>.nodes / cpus_per_node) or fewer workers.") from None
        # A subclass with one extra method, so that each rank can say where it runs.
        located = type(actor_cls.__name__, (actor_cls,), {"actor_group_where": _where})
        remote_cls = ray.remote(num_cpus=cpus_per_actor)(located)
        self.actors = [
            remote_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
                runtime_env={"env_vars": env or {}},
            ).remote()
            for i in range(num_actors)
        ]
        self.placements = [{"group": actor_cls.__name__, "rank": rank, **where}
                           for rank, where in enumerate(self.call("actor_group_where"))]
        print(f"[ray] {actor_cls.__name__}: " + ", ".join(f"rank {p['rank']} on {p['hostname']} ({p['ip']})"
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
        ray.util.remove_placement_group(self.placement)
