"""GPU placement, checked on this CPU machine with GPUs declared to Ray (issue #22), and ZeRO-3 ranks that must run
the same forwards:

1. A colocated GPU config whose policy ranks and engine GPUs differ (its CUDA IPC weight sync would fail with a
   KeyError) and tensor-parallel engines that cannot lie on one node are refused before queueing.
2. On two nodes with GPUs declared: every tensor-parallel engine's GPUs lie on one node, whatever order Ray numbers
   the bundles in or the GPUs other roles left; the engine's own actor sees the GPU of its first bundle, and vLLM's
   workers fit beside it, on the GPUs of the policy ranks when the roles are colocated. Frozen and engine actors get
   the torch threads of the CPUs they reserve.
3. Two ZeRO-3 frozen-model ranks (real DeepSpeed on gloo) given 3 rows, 1 row per forward, then 1 row: both ranks
   run the same number of forwards (else the one with more waits in a gather forever) and the results equal one
   rank's.
"""
import importlib.util
import os
import sys
import tempfile

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher.config import REPO_ROOT, load_config_files, stage_config, stage_jobs, validate_config
from launcher.resources import check_stages
from runtime import models
from runtime.actor_group import ActorGroup, actor_threads, compute_mode_problem, gpu_compute_modes
from runtime.builtin_data import load_reviews
from runtime.deepspeed_strategy import Rank
from runtime.experience import Rollout, split_call
from runtime.rl_actors import FrozenScorer
from runtime.rollout import start_engines
from stages import rl

EXAMPLE = [REPO_ROOT / "config" / "examples" / "llama3-8b-grpo.yaml"]  # on its own, as --configfile reads it
CALL_TIMEOUT_S = 120  # a hang in a collective shows as a timeout
REAL_FIND_SPEC = importlib.util.find_spec


def rl_problems(**rl_overrides) -> list[str]:
    """What the launcher says of the 8B GRPO example's rl job (2 nodes x 8 GPUs, colocated) with `rl_overrides`."""
    config = load_config_files(EXAMPLE)
    config["rl"] |= rl_overrides
    return [p for p in check_stages(stage_jobs(validate_config(config)), config["launcher"]) if "stage rl" in p]


def test_colocated_policy_ranks_must_be_the_engine_gpus():
    assert rl_problems() == []  # 16 policy ranks, 8 engines of 2 GPUs
    [problem] = rl_problems(vllm={"num_engines": 4, "tensor_parallel_size": 2})
    assert "rl.num_workers = 16, but rl.vllm.num_engines x rl.vllm.tensor_parallel_size = 4 x 2 = 8" in problem, problem
    assert "set num_workers = 8 or vllm.num_engines = 8, or colocate: false" in problem
    [problem] = rl_problems(num_workers=8, frozen_ranks=8)
    assert "rl.num_workers = 8, but" in problem and "= 16; set num_workers = 16 or vllm.num_engines = 4" in problem
    # Not colocated, each engine loads the weights over NCCL from policy rank 0: any counts work.
    assert rl_problems(colocate=False, num_workers=4, frozen_ranks=2, vllm={"num_engines": 2, "sleep": False}) == []


def test_tensor_parallel_engines_that_cannot_lie_on_one_node_are_refused():
    config = load_config_files(EXAMPLE)
    config["launcher"]["stages"]["rl"] |= {"gpus_per_node": 6}  # 2 nodes
    config["rl"] |= {"num_workers": 8, "frozen_ranks": 8, "vllm": {"num_engines": 2, "tensor_parallel_size": 4}}
    [problem] = [p for p in check_stages(stage_jobs(validate_config(config)), config["launcher"]) if "stage rl" in p]
    assert "2 engines x tensor_parallel_size 4 = 8 GPUs span nodes of 6 GPUs" in problem, problem
    assert "choose a tensor_parallel_size that divides 6" in problem


def test_gpu_settings_that_would_fail_or_gain_nothing_are_refused_before_queueing(monkeypatch):
    """On GPUs: flash_attention_2 without the flash-attn package (it would fail at the first model load, in the job);
    packing with sdpa or eager (a dense mask over the packed row: slower than padding, eager out of memory);
    async_rollouts with colocated roles (nothing can overlap on shared GPUs). On CPU flash_attention_2 needs GPUs."""
    flash_attn = lambda found: lambda name, *args: found if name == "flash_attn" else REAL_FIND_SPEC(name, *args)
    monkeypatch.setattr(importlib.util, "find_spec", flash_attn(None))
    [problem] = rl_problems(attn_implementation="flash_attention_2")
    assert "rl.attn_implementation = 'flash_attention_2' needs the flash-attn package, which this environment lacks" \
        in problem and "pip install flash-attn --no-build-isolation" in problem, problem
    [problem] = rl_problems(packing=True)
    assert "rl.packing = true with rl.attn_implementation = 'sdpa' on GPUs" in problem, problem
    assert "needs attn_implementation: flash_attention_2" in problem
    monkeypatch.setattr(importlib.util, "find_spec", flash_attn(object()))
    assert rl_problems(attn_implementation="flash_attention_2", packing=True) == []  # where flash-attn is installed
    [problem] = rl_problems(async_rollouts=1, vllm={"sleep": False})
    assert "rl.async_rollouts = 1 overlaps generation with training, but with rl.colocate = true" in problem, problem
    assert rl_problems(async_rollouts=1, colocate=False, num_workers=4, frozen_ranks=2,
                       vllm={"num_engines": 2, "sleep": False}) == []
    config = validate_config({"sft": {"attn_implementation": "flash_attention_2"}, "data": {"sft": {"path": "x"}}})
    problems = check_stages(stage_jobs(config), config["launcher"])
    assert any("sft.attn_implementation = 'flash_attention_2' needs GPUs" in p for p in problems), problems


def test_a_gpu_not_in_compute_mode_default_is_named_at_the_start(tmp_path, monkeypatch):
    """Colocation and CUDA IPC need several processes on a GPU: nvidia-smi's compute modes are read (here a stand-in
    nvidia-smi on PATH prints them) and a GPU in EXCLUSIVE_PROCESS mode fails the job at its start, named."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, Default'\necho '1, Exclusive_Process'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    modes = gpu_compute_modes()
    assert modes == {"0": "Default", "1": "Exclusive_Process"}
    problem = compute_mode_problem([("node7", modes)], "rl.colocate: true")
    assert "rl.colocate: true puts several processes on one GPU" in problem and "node7 GPU 1: Exclusive_Process" in \
        problem and "GPU 0" not in problem, problem
    assert compute_mode_problem([("node7", {"0": "Default"}), ("node8", {})], "x") is None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_compute_modes() == {}  # no nvidia-smi: nothing to tell


def test_actor_threads_follow_what_the_actor_reserves():
    assert actor_threads(0, 64, takes_turns=False) == 1  # colocated on GPUs: no CPU of its own
    assert actor_threads(1, 64, takes_turns=False) == 1
    assert actor_threads(0.25, 2, takes_turns=True) == 2  # colocated on CPU: the roles take the job's cores in turn


# ---- two nodes with GPUs declared -------------------------------------------------------------------------

GPUS_PER_NODE = 3


class EngineProbe:
    """Stands in for a vLLM engine: what Ray gave it, and where the bundles it names for vLLM's workers lie."""

    def __init__(self, model_dir, seed, max_model_len, vllm, num_threads, *rest):
        self.num_threads = num_threads

    def seen(self) -> dict:
        group = ray.util.get_current_placement_group()
        nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
        indices = [int(i) for i in os.environ.get("VLLM_RAY_BUNDLE_INDICES", "0").split(",")]
        return {"node": ray.get_runtime_context().get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "group": group, "bundles": indices,
                "bundle_nodes": [nodes[i] for i in indices], "num_threads": self.num_threads,
                "per_worker_gpus": float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1"))}


class RankProbe:
    def rendezvous_address(self):
        return "127.0.0.1", 0

    def seen(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), str(ray.get_gpu_ids()[0])


@ray.remote(num_cpus=0)
class WorkerProbe:
    """Stands in for one of vLLM's Ray workers (vllm/v1/executor/ray_executor.py: num_cpus=0,
    num_gpus=VLLM_RAY_PER_WORKER_GPUS, in the bundle it is given)."""

    def seen(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), str(ray.get_gpu_ids()[0])


def start_vllm_workers(seen: dict) -> list[tuple[str, str]]:
    """vLLM's workers of one engine, as its Ray executor starts them; (node, GPU) of each, once they all run."""
    workers = [WorkerProbe.options(num_gpus=seen["per_worker_gpus"], scheduling_strategy=PlacementGroupSchedulingStrategy(
        seen["group"], placement_group_bundle_index=i)).remote() for i in seen["bundles"]]
    return ray.get([w.seen.remote() for w in workers], timeout=60)  # a worker that does not fit would wait forever


@pytest.fixture(scope="module")
def two_gpu_nodes():
    """Two Ray nodes of GPUS_PER_NODE declared GPUs, each with a resource naming it (to place bundles by hand)."""
    # A private temp dir: the cluster's sessions, and its address file (else /tmp/ray's, which ray.init("auto") reads)
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-test-", dir="/tmp"))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": GPUS_PER_NODE, "resources": {"node_a": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE, resources={"node_b": 1})
    ray.init(address=cluster.address, logging_level="WARNING")
    yield
    ray.shutdown()
    cluster.shutdown()
    del os.environ["RAY_TMPDIR"]


@pytest.mark.e2e
def test_tensor_parallel_engines_of_their_own_lie_on_one_node(two_gpu_nodes):
    """Another role holds one GPU of node B, so the four GPUs of two engines of 2 are node A's 3 and one of B's:
    packed as one group, the second engine would straddle the nodes."""
    trainer_rank = ray.remote(num_cpus=0, num_gpus=1, resources={"node_b": 0.01})(RankProbe).remote()
    ray.get(trainer_rank.seen.remote())
    vllm = validate_config({})["rl"]["vllm"] | {"num_engines": 2, "tensor_parallel_size": 2}
    engines = start_engines("model", 0, 64, vllm, 8, 1, gpus=True, engine_cls=EngineProbe)
    seen = ray.get([e.seen.remote() for e in engines])
    for engine in seen:
        assert len(set(engine["bundle_nodes"])) == 1 and engine["bundle_nodes"][0] == engine["node"], seen
        assert engine["gpu_ids"] and engine["visible"] == engine["gpu_ids"][0], "its actor sees its first GPU"
        assert engine["num_threads"] == 1, "the torch threads of the 1 CPU it reserves, not the caller's 8"
        workers = start_vllm_workers(engine)
        assert workers[0] == (engine["node"], engine["gpu_ids"][0]) and len(set(workers)) == 2
    assert len({engine["node"] for engine in seen}) == 2
    for actor in engines + [trainer_rank]:
        ray.kill(actor)
    for engine in seen:
        ray.util.remove_placement_group(engine["group"])


@pytest.mark.e2e
def test_colocated_engines_sort_the_shared_bundles_by_node(two_gpu_nodes):
    """A shared placement group whose bundles Ray numbered A, B, A, B: each engine of 2 GPUs takes two bundles of
    one node, and its vLLM workers sit on the GPUs of the policy ranks (for the CUDA IPC weight sync)."""
    shared = placement_group([{"CPU": 0.1, "GPU": 1, node: 0.01} for node in ("node_a", "node_b", "node_a", "node_b")],
                             strategy="PACK")
    ray.get(shared.ready(), timeout=60)
    nodes = ray.util.placement_group_table(shared)["bundles_to_node_id"]
    assert nodes[0] == nodes[2] != nodes[1] == nodes[3]
    share = 1 / 3  # policy, reference, engines
    policy = ActorGroup(RankProbe, 4, cpus_per_actor=0, gpus_per_actor=share, shared=shared)
    reference = ActorGroup(RankProbe, 4, cpus_per_actor=0, gpus_per_actor=share, shared=shared)
    ranks = policy.call("seen")
    assert [r[0] for r in ranks][:2] == [ranks[0][0]] * 2 and ranks[2][0] == ranks[3][0] != ranks[0][0], \
        "a node's ranks are consecutive"
    assert reference.call("seen") == ranks
    vllm = validate_config({})["rl"]["vllm"] | {"num_engines": 2, "tensor_parallel_size": 2}
    engines = start_engines("model", 0, 64, vllm, 8, 0, gpus=True, shared=shared, gpu_share=share,
                            engine_cls=EngineProbe)
    seen = ray.get([e.seen.remote() for e in engines])
    vllm_gpus = []
    for engine in seen:
        assert len(set(engine["bundle_nodes"])) == 1, f"engine bundles {engine['bundles']} straddle two nodes"
        assert engine["visible"] == engine["gpu_ids"][0] and engine["num_threads"] == 1
        vllm_gpus += start_vllm_workers(engine)  # they fit beside the policy, the reference and the engine actor
    assert sorted(vllm_gpus) == sorted(ranks), "every vLLM worker's GPU holds the policy rank that hands it weights"
    for actor in engines:
        ray.kill(actor)
    policy.shutdown()
    reference.shutdown()
    ray.util.remove_placement_group(shared)


# ---- ZeRO-3 ranks run the same forwards -----------------------------------------------------------------------

class CountingScorer(FrozenScorer):
    """A FrozenScorer that counts its model's forwards."""

    def setup(self, cfg, rank, kind) -> None:
        super().setup(cfg, rank, kind)
        self.forwards = 0
        self.model.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))

    def forward_count(self) -> int:
        return self.forwards


class Waiting:
    """An ActorGroup whose calls fail after CALL_TIMEOUT_S instead of hanging in a collective."""

    def __init__(self, group: ActorGroup):
        self.actors = group.actors

    def call_per_rank(self, method: str, per_rank_args: list) -> list:
        refs = [getattr(a, method).remote(arg) for a, arg in zip(self.actors, per_rank_args)]
        try:
            return ray.get(refs, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            pytest.fail(f"{method} did not return within {CALL_TIMEOUT_S} s: a rank waits for the others in ZeRO-3")


@pytest.mark.e2e
def test_zero3_ranks_run_as_many_forwards_as_each_other(two_gpu_nodes, tmp_path):
    base = tmp_path / "base"
    models.build_tiny(base, {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 400}, 0,
                      [r["text"] for r in load_reviews("rotten_tomatoes")[:300]])
    cfg = stage_config(rl, {"rl": {"zero_stage": 3, "frozen_ranks": 2, "forward_micro_batch_size": 1}})
    rows = Rollout.of([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21, 22], [23], [24, 25]])

    one = FrozenScorer()
    one.setup(cfg, Rank(0, {"world_size": 1}, 1, str(base), 0), "policy")
    expected = one.logprobs(rows)

    group = ActorGroup(CountingScorer, 2, cpus_per_actor=1)
    ray.get([a.setup.remote(cfg, Rank(r, group.rendezvous, 1, str(base), 0), "policy")
             for r, a in enumerate(group.actors)])
    ranks = Waiting(group)
    logp = torch.cat(split_call(ranks, "logprobs", rows))  # shares of 2 rows and 1 (+ a filler): 2 forwards each
    assert group.call("forward_count") == [2, 2]
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-6)
    # Fewer rows than ranks: the rank without a row of its own runs the forward too (on a filler row).
    only = torch.cat(split_call(ranks, "logprobs", rows[:1]))
    assert group.call("forward_count") == [3, 3]
    torch.testing.assert_close(only, expected[:1], rtol=1e-5, atol=1e-6)
    group.shutdown()
