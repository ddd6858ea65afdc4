"""Stage `evaluate`: sample held-out prompts with vLLM and score the samples.

Metrics (metrics.json, and MLflow): each reward of `evaluate.rewards` (a reward file's reward_fn, `model`, the
reward model's score, `judge`, an LLM judge's, or a reward service's URL) as reward_<name> (mean) and reward_<name>_std, the first of them also as reward_mean; KL to the
reference (base) model, response length, and perplexity of the held-out SFT responses; samples.jsonl keeps a few
generations to read.

Scoring starts once generation is done and the engines are gone: one process (`Scorer`) takes every GPU of the node
and holds one phase's models at a time, the reward model alone for its scores, then the evaluated model with its
reference for the KL and the held-out perplexity. On GPUs each model loads in bf16 and its layers are spread over the
GPUs (accelerate's big-model inference, balanced as transformers' device_map="auto" balances them: each GPU runs its
layers in turn and hands the activations on), so no GPU holds a whole model: Llama-3-70B's evaluated model and
reference, 282 GB in bf16, take about 31 GB each of five 80 GB GPUs. Why this way: the exact KL needs both models'
whole next-token distributions at every position, so the two must be resident together (keeping one model's
log-softmax for the other to meet instead would be 512 samples x 1024 positions x 128k entries of float32, 270 GB).
Spreading the layers needs no process group and no sharded engine, and the stage's few hundred forwards lose little
to GPUs that compute one after the other. ZeRO-3 over frozen ranks (runtime/rl_actors.FrozenScorer) would also split
the models, but with a process per GPU and every layer gathered again at each forward. A model set that does not fit
the node's GPUs is refused before queueing by the memory plan (launcher/memory.py). On CPU the models load in fp32,
one phase at a time as on GPUs, and a job of one node without GPUs runs its engine and scorer in its own process: a
Ray cluster and two actor processes to start would be a third of a small evaluation's time (`uses_ray`).

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/evaluate/sft
"""
import dataclasses
import json
import os
import statistics
from pathlib import Path

import ray
import torch

from runtime import data
from runtime.actor_group import actor_threads, check_gpus_shareable, cluster_gpus
from runtime.environments import EpisodeRunner, context_length, summarise
from runtime.logprobs import (LOGITS_CHUNK_BYTES, logit_chunks, on_device, pad_prompt_response, response_logits,
                              token_logprobs)
from runtime.judge import Judge, greedy_verdicts, judge_context
from runtime.models import load_causal_lm, load_reward_model, load_tokenizer, model_dtype, release_cached_memory
from runtime.remote_reward import RemoteReward
from runtime.rewards import call_reward_fn, is_remote, load_reward_fn, reward_name
from runtime.rollout import VLLMEngine, generate_on, sampling_seed, start_engines
from runtime.user_data import repo_path

SCORE_BATCH = 8


def uses_ray(resources: dict) -> bool:
    """Ray places the engines and the scorer on a job's GPUs, or across its nodes; one node of CPUs needs no placing."""
    return resources["gpus_per_node"] > 0 or resources["nodes"] > 1


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
    precision: str = "auto"  # the scorer's models and the engines' weights (runtime/models.resolved_precision)
    environment: dict | None = None  # the experiment's environment block: its episodes are evaluated
    judge: dict | None = None  # the judge block, where a reward is judge (runtime/judge.py)
    remote_reward: dict | None = None  # how a reward service is called, where a reward is a URL

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        keys = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in params["evaluate"].items() if k in keys}, model=params["model"],
                   seed=params["seed"])


def token_kl(logits: torch.Tensor, ref_logits: torch.Tensor, max_bytes: int = LOGITS_CHUNK_BYTES) -> torch.Tensor:
    """Exact KL(pi(.|prefix) || pi_ref(.|prefix)) at each position, summed over the vocabulary: (B, T, V) -> (B, T),
    in float32. Never negative, whatever distribution the prefixes were sampled from (e.g. at a temperature below 1).
    Memory: the float32 log-softmaxes are made a chunk of positions at a time (runtime/logprobs.logit_chunks, at most
    `max_bytes` each), at most three of them alive at once: beyond its inputs and output the call needs at most
    3 * max_bytes (192 MiB by default)."""
    kl = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for row, span in logit_chunks(logits, max_bytes):
        logp = torch.log_softmax(logits[row, span].float(), -1)
        log_ratio = logp - torch.log_softmax(ref_logits[row, span].float(), -1)
        # KL = sum_v p(v) (log p(v) - log p_ref(v)), the products made in log_ratio's memory
        kl[row, span] = log_ratio.mul_(logp.exp_()).sum(-1)
        del logp, log_ratio  # before the next chunk's are made
    return kl


def spread_over_gpus(model, free_bytes: dict[int, int]) -> dict:
    """A device map of `model` over the GPUs of `free_bytes` (GPU index -> bytes free there), balanced as
    from_pretrained(device_map="auto") balances it (accelerate's get_balanced_memory: each GPU but the last takes up
    to 1/len(free_bytes) of the model plus 1.25 times its largest decoder layer, which is never split), and all on the
    GPUs: refused where they cannot hold it (no offload to CPU memory or disk)."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory
    no_split = model._no_split_modules
    budgets = get_balanced_memory(model, max_memory=dict(free_bytes), no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=no_split)
    if not set(device_map.values()) <= set(free_bytes):
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        raise RuntimeError(f"{type(model).__name__} ({size / 1e9:.1f} GB) does not fit the free memory of the "
                           f"scorer's {len(free_bytes)} GPU(s) ({sum(free_bytes.values()) / 1e9:.1f} GB)")
    return device_map


def load_for_scoring(loader, path: str, precision: str):
    """A model to score with, in eval mode, in `precision` (auto: bf16 on GPUs and on CPUs with native bf16, else
    fp32); on GPUs its layers spread over every GPU this process sees (spread_over_gpus, by their free memory: a
    model loaded before takes its part first)."""
    model = loader(path, model_dtype(precision)).eval()
    if not torch.cuda.is_available():
        return model
    from accelerate import dispatch_model
    free = {gpu: torch.cuda.mem_get_info(gpu)[0] for gpu in range(torch.cuda.device_count())}
    return dispatch_model(model, spread_over_gpus(model, free))


class Scorer:
    """Teacher-forced scores under the models it holds (`hold`, one phase's at a time): the reward model's scores of
    the samples; the evaluated model's log-probabilities and their exact KL to the reference's."""

    def __init__(self, pad_id: int, num_threads: int, precision: str):
        torch.set_num_threads(num_threads)
        self.pad_id, self.precision = pad_id, precision
        self.model = self.reference = self.reward_model = None

    def hold(self, model_dir: str | None = None, reference_dir: str | None = None,
             reward_model_dir: str | None = None) -> None:
        """Free the models held, then load these (a reference from the model's own directory is the model itself)."""
        self.model = self.reference = self.reward_model = None
        release_cached_memory()
        if model_dir:
            self.model = load_for_scoring(load_causal_lm, model_dir, self.precision)
            self.reference = self.model if reference_dir == model_dir else \
                load_for_scoring(load_causal_lm, reference_dir, self.precision)
        if reward_model_dir:
            self.reward_model = load_for_scoring(load_reward_model, reward_model_dir, self.precision)

    @torch.no_grad()
    def reward_model_scores(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        scores = []
        for i in range(0, len(prompts), SCORE_BATCH):
            batch = on_device(pad_prompt_response(prompts[i:i + SCORE_BATCH], responses[i:i + SCORE_BATCH],
                                                  self.pad_id), self.reward_model)
            scores += self.reward_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                        use_cache=False).logits[:, 0].tolist()
        return scores

    @torch.no_grad()
    def sequence_logprobs(self, prompts: list[list[int]], responses: list[list[int]], with_reference: bool,
                          masks: list[list[float]] | None = None):
        """Per sequence: summed log-prob under the model, summed per-token KL to the reference (0 without
        it), and the token count; `masks`: over the tokens they mark (an episode's replies)."""
        out = []
        for i in range(0, len(prompts), SCORE_BATCH):
            batch = pad_prompt_response(prompts[i:i + SCORE_BATCH], responses[i:i + SCORE_BATCH], self.pad_id,
                                        masks=masks and masks[i:i + SCORE_BATCH])
            logits, labels, mask = response_logits(self.model, batch)
            logp = token_logprobs(logits, labels) * mask
            kl = torch.zeros_like(mask)
            if with_reference and self.reference is not self.model:
                ref_logits = response_logits(self.reference, batch)[0].to(logits.device)  # (each on its first GPU)
                kl = token_kl(logits, ref_logits) * mask
            out += [(a, b, n) for a, b, n in zip(logp.sum(1).tolist(), kl.sum(1).tolist(), mask.sum(1).tolist())]
        return out


class Engine(VLLMEngine):
    """The stage's vLLM engine, which can say where its GPUs are reserved (stop_engines)."""

    def placement_group(self):
        """The placement group this engine's GPUs are reserved in (start_engines gives each engine its own on GPUs;
        None on CPU)."""
        return ray.util.get_current_placement_group()


def stop_engines(engines: list) -> None:
    """Kill the engines and free their GPUs for the scorer: a killed actor's GPUs go back to its placement group, not
    to the cluster, so the engines' placement groups are removed too."""
    groups = ray.get([engine.placement_group.remote() for engine in engines])
    for engine in engines:
        ray.kill(engine)
    for group in groups:
        if group is not None:
            ray.util.remove_placement_group(group)


def sample_or_play(generate, runner, rows: list[dict], prompt_ids: list[list[int]], sampling: tuple) -> list:
    """One sample per prompt, [[{"token_ids", "text", ...}]]: a reply, or with an environment (`runner`) an episode,
    its text the last reply, with its own prompt ids, loss mask (its replies) and stats."""
    if runner is None:
        return generate(prompt_ids)
    play = lambda contexts, seeds, max_tokens: [s[0] for s in generate(contexts, seeds, max_tokens)]
    episodes = runner.run(play, [r | {"prompt_ids": ids} for r, ids in zip(rows, prompt_ids)], 1, sampling[4],
                          sampling[3])
    return [[{"token_ids": e.ids or runner.format.eot_ids[:1], "mask": e.mask if e.ids else [0.0],
              "prompt_ids": e.prompt_ids, "text": e.replies[-1] if e.replies else "", "episode": stats}]
            for e, stats in episodes]


def judged(cfg: Config, judge_dir: str, on_ray: bool, threads: int, rows: list[dict], samples: list) -> tuple:
    """The judge's scores of the samples' replies and how many of its verdicts gave none: its engines start once the
    evaluated model's are gone, and are gone before the scorer's models load (nothing returned holds them)."""
    context = judge_context(judge_dir)
    if on_ray:
        gpus = cluster_gpus() > 0
        engines = start_engines(judge_dir, cfg.seed, context, cfg.judge["vllm"], threads, 1, gpus,
                                model_dtype(cfg.precision, gpus), engine_cls=Engine)
        generate = lambda *args: generate_on(engines, *args)
    else:
        engine = Engine(judge_dir, cfg.seed, context, cfg.judge["vllm"], threads, model_dtype(cfg.precision))
        generate = engine.generate
    judge = Judge(cfg.judge, load_tokenizer(judge_dir), greedy_verdicts(generate, context))
    scores = judge([r["prompt"] for r in rows], [s[0]["text"] for s in samples], [r["label"] for r in rows])
    if on_ray:
        stop_engines(engines)
    return scores, judge.unparsed


def node_gpus() -> int:
    """The GPUs of the stage's largest node: all that one process, the scorer, can spread its models over."""
    return int(max((node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]), default=0))


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    tokenizer = load_tokenizer(inputs["model"])
    rows = data.read_jsonl(inputs["data"] / "prompts_eval.jsonl")[:cfg.num_prompts]
    prompt_ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    on_ray = ray.is_initialized()
    threads = max(1, int(ray.available_resources().get("CPU", 1)) if on_ray else len(os.sched_getaffinity(0)))
    max_len = context_length(max(map(len, prompt_ids)), cfg.max_new_tokens, cfg.environment,
                             inputs["model"])
    runner = cfg.environment and EpisodeRunner(cfg.environment, inputs["environment_file"], tokenizer, max_len)
    reward_fns = {reward: RemoteReward(reward, cfg.remote_reward) if is_remote(reward) else
                  load_reward_fn(repo_path(reward)) for reward in cfg.rewards if reward not in ("model", "judge")}

    print(f"[evaluate] {cfg.model}: generating {len(rows)} prompts x {cfg.max_new_tokens} tokens with vLLM", flush=True)
    sampling = (1, cfg.temperature, cfg.top_p, cfg.max_new_tokens, sampling_seed(cfg.seed, "evaluate"))
    if on_ray:
        gpus = cluster_gpus() > 0
        if gpus and cfg.vllm["tensor_parallel_size"] > 1:
            check_gpus_shareable(f"evaluate.vllm.tensor_parallel_size = {cfg.vllm['tensor_parallel_size']} (an "
                                 "engine's actor beside its vLLM worker)")
        engines = start_engines(str(inputs["model"]), cfg.seed, max_len, cfg.vllm, threads, 1, gpus,
                                model_dtype(cfg.precision, gpus), engine_cls=Engine)
        new_scorer = lambda: ray.remote(num_cpus=1, num_gpus=node_gpus())(Scorer).remote(
            tokenizer.pad_token_id, actor_threads(1, threads, takes_turns=not gpus), cfg.precision)
        # On CPU the scorer's process starts while the engines generate (it loads no model until `hold`); on GPUs it
        # waits for the engines' GPUs.
        scorer = None if gpus else new_scorer()
        generate = lambda ids, seeds=None, max_tokens=None: generate_on(
            engines, ids, *sampling[:3], max_tokens or sampling[3], sampling[4], seeds=seeds)
        samples = sample_or_play(generate, runner, rows, prompt_ids, sampling)
        stop_engines(engines)  # their GPUs, KV caches and cores go to the judge, then the scorer
    else:  # one engine gives the samples of several (each request keeps its own seed: runtime/rollout.py)
        engine = Engine(str(inputs["model"]), cfg.seed, max_len, cfg.vllm, threads, model_dtype(cfg.precision))
        generate = lambda ids, seeds=None, max_tokens=None: engine.generate(
            ids, *sampling[:3], max_tokens or sampling[3], sampling[4], seeds=seeds)
        samples = sample_or_play(generate, runner, rows, prompt_ids, sampling)
        del engine  # its KV cache, before the judge's engine and the scorer's models load
    judging = judged(cfg, str(inputs["judge_model"]), on_ray, threads, rows, samples) \
        if "judge" in cfg.rewards else None
    if on_ray:
        scorer = scorer or new_scorer()
        call = lambda method, *args, **kwargs: ray.get(getattr(scorer, method).remote(*args, **kwargs))
    else:
        scorer = Scorer(tokenizer.pad_token_id, threads, cfg.precision)
        call = lambda method, *args, **kwargs: getattr(scorer, method)(*args, **kwargs)
    completions = [s[0] for s in samples]
    texts = [c["text"] for c in completions]
    prompt_ids = [c.get("prompt_ids", ids) for c, ids in zip(completions, prompt_ids)]  # (an episode's own)
    masks = [c["mask"] for c in completions] if runner else None
    scores = {}
    for reward in cfg.rewards:
        if reward == "model":
            responses = [c["token_ids"] or [tokenizer.pad_token_id] for c in completions]  # an empty one still scores
            call("hold", reward_model_dir=str(inputs["reward_model"]))
            scores["reward_model"] = call("reward_model_scores", prompt_ids, responses)
        elif reward == "judge":
            scores["judge"] = judging[0]
        else:
            scores[reward_name(reward)] = call_reward_fn(reward_fns[reward], reward, [r["prompt"] for r in rows], texts,
                                                         [r["label"] for r in rows])

    print(f"[evaluate] {cfg.model}: scoring KL to the reference and perplexity", flush=True)
    call("hold", model_dir=str(inputs["model"]), reference_dir=str(inputs["reference"]))
    logps = call("sequence_logprobs", prompt_ids, [c["token_ids"] for c in completions], True, masks)
    references = None  # perplexity of the held-out SFT responses, where the experiment has an SFT dataset
    if "sft_data" in inputs:
        held_out = data.read_jsonl(inputs["sft_data"] / "sft_eval.jsonl")
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        references = call("sequence_logprobs", [encode(r["prompt"]) for r in held_out],
                          [encode(r["response"]) for r in held_out], False)
    if on_ray:
        ray.kill(scorer)

    # KL(model || reference) per response: the exact KL of the next-token distributions, summed over the
    # positions of the model's own samples (a log-ratio estimate would be biased, even negative, when the
    # samples are drawn at a temperature below 1).
    kl = statistics.fmean(kl for _, kl, _ in logps)
    main = scores[reward_name(cfg.rewards[0])] if cfg.rewards else None  # (evaluate.rewards may be empty)
    metrics = {"reward_mean": statistics.fmean(main), "reward_std": statistics.pstdev(main)} if main else {}
    for name, values in scores.items():
        metrics |= {f"reward_{name}": statistics.fmean(values), f"reward_{name}_std": statistics.pstdev(values)}
    metrics |= {
        "kl_to_reference": kl,
        "response_length": statistics.fmean(len(c["token_ids"]) for c in completions),
        "num_prompts": len(rows),
    }
    if runner:  # the episodes' success rate, reward (the sum of their step rewards), turns and what went wrong
        metrics |= {"env_" + key.removeprefix("env_"): value
                    for key, value in summarise([c["episode"] for c in completions]).items()}
    if judging:
        metrics["judge_unparsed"] = judging[1]
    if references is not None:
        nll = -sum(lp for lp, _, _ in references) / sum(n for _, _, n in references)
        metrics["perplexity"] = float(torch.tensor(nll).exp())
    (output / "metrics.json").write_text(json.dumps({"model": cfg.model, **metrics}, indent=2))
    data.write_jsonl(output / "samples.jsonl", [
        {"input": r["input"], "label": r["label"], "completion": t, "reward": main[i] if main else None,
         "rewards": {name: values[i] for name, values in scores.items()}}
        | ({"episode": tokenizer.decode(prompt_ids[i] + completions[i]["token_ids"]), "stats": completions[i]["episode"]}
           if runner else {})
        for i, (r, t) in enumerate(list(zip(rows, texts))[:cfg.num_samples_logged])])
    tracker.log_metrics(metrics)
    tracker.log_artifact(output / "metrics.json")
    tracker.log_artifact(output / "samples.jsonl")
    print(f"[evaluate] {cfg.model}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()), flush=True)
