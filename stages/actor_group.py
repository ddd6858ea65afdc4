"""A group of Ray actors that act as one distributed trainer (one DeepSpeed rank each).

The driver calls a method on every rank at once and gets the per-rank results back in rank order; rank 0's
node address becomes the torch.distributed rendezvous for the group.
"""
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class ActorGroup:
    def __init__(self, actor_cls, num_actors: int, cpus_per_actor: float = 1, strategy: str = "SPREAD",
                 env: dict | None = None):
        # SPREAD places ranks on different nodes when there are several, and packs them on one otherwise.
        self.placement = placement_group([{"CPU": cpus_per_actor}] * num_actors, strategy=strategy)
        ray.get(self.placement.ready())
        remote_cls = ray.remote(num_cpus=cpus_per_actor)(actor_cls)
        self.actors = [
            remote_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
                runtime_env={"env_vars": env or {}},
            ).remote()
            for i in range(num_actors)
        ]
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
