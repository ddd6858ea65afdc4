"""Stage `evaluate`: sample held-out prompts with vLLM and score the samples.

Metrics (metrics.json, and MLflow): each reward of `evaluate.rewards` (a reward file's reward_fn, or `model`, the
reward model's score) as reward_<name> (mean) and reward_<name>_std, the first of them also as reward_mean; KL to the
reference (base) model, response length, and perplexity of the held-out SFT responses; samples.jsonl keeps a few
generations to read.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/evaluate/sft
"""
import dataclasses
import json
import statistics
from pathlib import Path

import ray
import torch

from runtime import data
from runtime.actor_group import cluster_gpus
from runtime.logprobs import on_device, pad_prompt_response, response_logits, token_logprobs
from runtime.models import device, load_causal_lm, load_reward_model, load_tokenizer, model_dtype
from runtime.rewards import call_reward_fn, load_reward_fn, reward_name
from runtime.rollout import generate_on, sampling_seed, start_engines
from runtime.user_data import repo_path

USES_RAY = True
SCORE_BATCH = 8


@dataclasses.dataclass
class Config:
    model: str
    num_prompts: int
    max_new_tokens: int
    temperature: float
    top_p: float
    num_samples_logged: int
    rewards: list
    vllm: dict  # the schema's evaluate.vllm: engines and their GPUs
    seed: int

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        keys = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in params["evaluate"].items() if k in keys}, model=params["model"],
                   seed=params["seed"])


def token_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi(.|prefix) || pi_ref(.|prefix)) at each position, summed over the vocabulary: (B, T, V) -> (B, T).
    Never negative, whatever distribution the prefixes were sampled from (e.g. at a temperature below 1)."""
    logp, ref_logp = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


class Scorer:
    """Teacher-forced log-probabilities under the evaluated model and the reference model."""

    def __init__(self, model_dir: str, reference_dir: str, reward_model_dir: str | None, num_threads: int):
        torch.set_num_threads(num_threads)
        # fp32 on the CPU; on a GPU (the one Ray gave this actor) bf16.
        load = lambda loader, path: loader(path, model_dtype("auto")).to(device()).eval()
        self.model = load(load_causal_lm, model_dir)
        self.reference = self.model if model_dir == reference_dir else load(load_causal_lm, reference_dir)
        self.reward_model = load(load_reward_model, reward_model_dir) if reward_model_dir else None
        self.pad_id = load_tokenizer(model_dir).pad_token_id

    @torch.no_grad()
    def reward_model_scores(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        scores = []
        for i in range(0, len(prompts), SCORE_BATCH):
            batch = on_device(pad_prompt_response(prompts[i:i + SCORE_BATCH], responses[i:i + SCORE_BATCH],
                                                  self.pad_id), self.reward_model)
            scores += self.reward_model(input_ids=batch["input_ids"],
                                        attention_mask=batch["attention_mask"]).logits[:, 0].tolist()
        return scores

    @torch.no_grad()
    def sequence_logprobs(self, prompts: list[list[int]], responses: list[list[int]], with_reference: bool):
        """Per sequence: summed log-prob under the model, summed per-token KL to the reference (0 without
        it), and the token count."""
        out = []
        for i in range(0, len(prompts), SCORE_BATCH):
            batch = pad_prompt_response(prompts[i:i + SCORE_BATCH], responses[i:i + SCORE_BATCH], self.pad_id)
            logits, labels, mask = response_logits(self.model, batch)
            logp = token_logprobs(logits, labels) * mask
            kl = torch.zeros_like(mask)
            if with_reference and self.reference is not self.model:
                kl = token_kl(logits, response_logits(self.reference, batch)[0]) * mask
            out += [(a, b, n) for a, b, n in zip(logp.sum(1).tolist(), kl.sum(1).tolist(), mask.sum(1).tolist())]
        return out


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    tokenizer = load_tokenizer(inputs["model"])
    rows = data.read_jsonl(inputs["data"] / "prompts_eval.jsonl")[:cfg.num_prompts]
    prompt_ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    threads = max(1, int(ray.available_resources().get("CPU", 1)))
    max_len = max(map(len, prompt_ids)) + cfg.max_new_tokens + 8
    reward_fns = {reward: load_reward_fn(repo_path(reward)) for reward in cfg.rewards if reward != "model"}

    print(f"[evaluate] {cfg.model}: generating {len(rows)} prompts x {cfg.max_new_tokens} tokens with vLLM", flush=True)
    gpus = cluster_gpus() > 0
    engines = start_engines(str(inputs["model"]), cfg.seed, max_len, cfg.vllm, threads, 1, gpus)
    # The scorer loads its models meanwhile (mostly imports and file reads); it computes only after generation.
    reward_model = str(inputs["reward_model"]) if "model" in cfg.rewards else None
    scorer = ray.remote(num_cpus=1, num_gpus=int(gpus))(Scorer).remote(str(inputs["model"]), str(inputs["reference"]),
                                                                       reward_model, threads)
    samples = generate_on(engines, prompt_ids, 1, cfg.temperature, cfg.top_p, cfg.max_new_tokens,
                          sampling_seed(cfg.seed, "evaluate"))
    for engine in engines:
        ray.kill(engine)  # free its cores and KV cache before scoring
    completions = [s[0] for s in samples]
    texts = [c["text"] for c in completions]
    scores = {}
    for reward in cfg.rewards:
        if reward == "model":
            responses = [c["token_ids"] or [tokenizer.pad_token_id] for c in completions]  # an empty one still scores
            scores["reward_model"] = ray.get(scorer.reward_model_scores.remote(prompt_ids, responses))
        else:
            scores[reward_name(reward)] = call_reward_fn(reward_fns[reward], reward, [r["prompt"] for r in rows], texts,
                                                         [r["label"] for r in rows])

    print(f"[evaluate] {cfg.model}: scoring KL to the reference and perplexity", flush=True)
    logps = ray.get(scorer.sequence_logprobs.remote(prompt_ids, [c["token_ids"] for c in completions], True))
    held_out = data.read_jsonl(inputs["data"] / "sft_eval.jsonl")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    references = ray.get(scorer.sequence_logprobs.remote([encode(r["prompt"]) for r in held_out],
                                                         [encode(r["response"]) for r in held_out], False))
    ray.kill(scorer)

    # KL(model || reference) per response: the exact KL of the next-token distributions, summed over the
    # positions of the model's own samples (a log-ratio estimate would be biased, even negative, when the
    # samples are drawn at a temperature below 1).
    kl = statistics.fmean(kl for _, kl, _ in logps)
    nll = -sum(lp for lp, _, _ in references) / sum(n for _, _, n in references)
    main = scores[reward_name(cfg.rewards[0])]
    metrics = {"reward_mean": statistics.fmean(main), "reward_std": statistics.pstdev(main)}
    for name, values in scores.items():
        metrics |= {f"reward_{name}": statistics.fmean(values), f"reward_{name}_std": statistics.pstdev(values)}
    metrics |= {
        "kl_to_reference": kl,
        "response_length": statistics.fmean(len(c["token_ids"]) for c in completions),
        "perplexity": float(torch.tensor(nll).exp()),
        "num_prompts": len(rows),
    }
    (output / "metrics.json").write_text(json.dumps({"model": cfg.model, **metrics}, indent=2))
    data.write_jsonl(output / "samples.jsonl", [
        {"input": r["input"], "label": r["label"], "completion": t, "reward": main[i],
         "rewards": {name: values[i] for name, values in scores.items()}}
        for i, (r, t) in enumerate(list(zip(rows, texts))[:cfg.num_samples_logged])])
    tracker.log_metrics(metrics)
    tracker.log_artifact(output / "metrics.json")
    tracker.log_artifact(output / "samples.jsonl")
    print(f"[evaluate] {cfg.model}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()), flush=True)
