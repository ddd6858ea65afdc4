"""vLLM generation as a Ray actor: the rollout engine of evaluation and (later) RL.

On CPU vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the launcher) with eager execution;
on GPU the same interface holds. After the trainer changes weights, `update_weights` reloads them and resets
the prefix cache, without which long prompts would reuse KV blocks computed with the old weights.
"""
import torch


class VLLMEngine:
    def __init__(self, model_dir: str, seed: int, max_model_len: int, trust_remote_code: bool = False,
                 num_threads: int | None = None):
        from vllm import LLM
        if num_threads:
            torch.set_num_threads(num_threads)
        on_gpu = torch.cuda.is_available()
        self.llm = LLM(model=model_dir, tokenizer=model_dir, seed=seed, max_model_len=max_model_len,
                       dtype="bfloat16" if on_gpu else "float32", enforce_eager=not on_gpu,
                       trust_remote_code=trust_remote_code, gpu_memory_utilization=0.5 if on_gpu else 0.9)

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> list[list[dict]]:
        """Samples per prompt: [[{"token_ids", "text"} x n] x prompts]; request i is seeded with seed + i,
        so results do not depend on batching."""
        from vllm import SamplingParams, TokensPrompt
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed + i)
                  for i in range(len(prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids), "text": c.text} for c in out.outputs] for out in outputs]

    def update_weights(self, hf_dir: str) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": hf_dir})
        self.llm.reset_prefix_cache()
