"""Stage `benchmark`: one test benchmark (`benchmarks.<name>`) on one model and seed.

Each problem of the benchmark gets `n_samples` replies from vLLM (the engines of evaluate.vllm) at the benchmark's
temperature, top_p and max_new_tokens, and each reply a score in [0, 1] from its scorer (runtime/answer_scoring.py:
math, exact, regex; a Python file's reward_fn; `choice`, the option of highest log-likelihood under the model, by a
teacher-forced forward); or the problems, prompts and scores are an lm-evaluation-harness task's
(runtime/lm_eval_tasks.py), run over the same engines and forward. Metrics (metrics.json and MLflow): avg_at_<n>
(pass@1 averaged over the n samples), pass_at_<k> for each k of pass_k (Chen et al. 2021's unbiased estimator),
maj_at_<k> (majority vote over the first k samples' answers, where the scorer extracts answers), num_problems,
response_length, truncated (the share of replies max_new_tokens cut). samples.jsonl keeps every problem with its
replies, answers and scores, so any other statistic, and the report's paired tests, need no new generation.

The problems are the same for every model and seed (a benchmark's rows do not depend on the experiment's seed); the
replies are sampled with the job's seed. Generation and scoring take the job's GPUs in turn, as in stages/evaluate.py.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/benchmark/<name>/sft/seed<k>
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
from runtime.answer_scoring import (MathVerifier, majority_at_k, normalise_answer, pass_at_k, score_exact,
                                    score_regex)
from runtime.builtin_data import arithmetic_rows
from runtime.environments import EpisodeRunner, context_length
from runtime.logprobs import pad_prompt_response, response_logits, token_logprobs
from runtime.models import load_tokenizer, model_dtype, model_positions
from runtime.rewards import RewardFileError, call_reward_fn, load_reward_fn
from runtime.rollout import generate_on, sampling_seed, start_engines
from runtime.user_data import is_builtin, load_records, repo_path
from stages.evaluate import SCORE_BATCH, Engine, Scorer, node_gpus, stop_engines, uses_ray  # noqa: F401 (uses_ray)

# What vLLM's max_model_len adds to the longest prompt and its new tokens (launcher/config.LENGTH_MARGIN).
LENGTH_MARGIN = 8


@dataclasses.dataclass
class Config:
    name: str
    model: str
    seed: int
    benchmark: dict  # the schema's benchmarks.<name>, resolved (launcher/config.resolve_benchmarks)
    vllm: dict  # evaluate.vllm
    precision: str  # evaluate.precision: the engines' and the choice scorer's weights
    chat: dict  # data.apply_chat_template, data.input_template
    environment: dict | None = None  # the experiment's, where the benchmark plays episodes (benchmarks.<name>.environment)

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(**{f.name: params[f.name] for f in dataclasses.fields(cls) if f.name in params})


def read_problems(bench: dict) -> list[dict]:
    """The benchmark's rows, few-shot examples first (builtin:arithmetic: its `test` problems, which no data role
    has, generated from seed 0 whatever the experiment's seed)."""
    count = bench["max_samples"] + bench["few_shot"]
    if is_builtin(bench["path"]):
        return arithmetic_rows("test", count, seed=0)
    rows = load_records({"path": str(repo_path(bench["path"])), "split": bench["split"], "max_samples": count})
    keys = [bench["input_key"], bench["label_key"]] + ([bench["choices_key"]] if bench["choices_key"] else [])
    for i, row in enumerate(rows):
        if missing := [k for k in keys if k not in row]:
            raise ValueError(f"benchmark {bench['path']}: row {i + 1} has no {missing} (it has {sorted(row)}); set "
                             "the benchmark's input_key / label_key / choices_key")
    return rows


def fill(template: str, row: dict, bench: dict) -> str:
    """A template with the row's keys ({input}: input_key's value; {label}: label_key's)."""
    return template.format_map(row | {"input": row[bench["input_key"]], "label": row[bench["label_key"]]})


def format_prompt(tokenizer, cfg: Config, examples: list[dict], row: dict) -> str:
    """The text the model continues: the question after the few-shot examples, through the chat template (examples
    as user and assistant turns) or data.input_template (examples one after another, a blank line apart)."""
    bench = cfg.benchmark
    turns = [(fill(bench["template"], ex, bench), fill(bench["answer_template"], ex, bench)) for ex in examples]
    question = fill(bench["template"], row, bench)
    if not cfg.chat["apply_chat_template"]:
        wrap = (lambda text: cfg.chat["input_template"].format(text)) if cfg.chat["input_template"] else str
        return "".join(f"{wrap(q)}{a}\n\n" for q, a in turns) + wrap(question)
    messages = [{"role": "system", "content": bench["system_prompt"]}] if bench["system_prompt"] is not None else []
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class ChoiceScorer(Scorer):
    """The held model's log-likelihood of continuations (choice; lm-eval's loglikelihood requests)."""

    @torch.no_grad()
    def continuation_logprobs(self, contexts: list[list[int]], continuations: list[list[int]]) -> list[tuple]:
        """(summed log-prob, whether each token is the model's greedy choice) of each continuation after its
        context."""
        out = []
        for i in range(0, len(contexts), SCORE_BATCH):
            batch = pad_prompt_response(contexts[i:i + SCORE_BATCH], continuations[i:i + SCORE_BATCH], self.pad_id)
            logits, labels, mask = response_logits(self.model, batch)
            logp = (token_logprobs(logits, labels) * mask).sum(1)
            greedy = ((logits.argmax(-1) == labels) | (mask == 0)).all(1)
            out += list(zip(logp.tolist(), greedy.tolist()))
        return out


class Models:
    """The job's model behind the two calls a benchmark makes: `generate` (vLLM engines) and `loglikelihood` (a
    teacher-forced scorer); each starts its side on first use, after the other side has given back the GPUs."""

    def __init__(self, cfg: Config, model_dir: str, tokenizer, max_len: int):
        self.cfg, self.model_dir, self.tokenizer, self.max_len = cfg, model_dir, tokenizer, max_len
        self.on_ray = ray.is_initialized()
        self.gpus = self.on_ray and cluster_gpus() > 0
        self.threads = max(1, int(ray.available_resources().get("CPU", 1)) if self.on_ray
                           else len(os.sched_getaffinity(0)))
        self.engines = self.scorer = None

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> list[list[dict]]:
        # Each sample its own request, seeded seed + its index: vLLM draws a request's n samples from seeds
        # seed + 0 .. n - 1, so request i's second sample would repeat request i + 1's first draw.
        samples = self.sample([ids for ids in prompt_ids for _ in range(n)], temperature, top_p, max_new_tokens, seed)
        return [samples[i:i + n] for i in range(0, len(samples), n)]

    def sample(self, requests: list[list[int]], temperature: float, top_p: float, max_new_tokens: int | list[int],
               seed: int, seeds: list[int] | None = None) -> list[dict]:
        """One reply per request, request i seeded seed + i (or seeds[i]); the engines started on first use."""
        self.close_scorer()
        if self.engines is None:
            if not self.on_ray:  # one engine gives the samples of several (each request keeps its seed)
                self.engines = [Engine(self.model_dir, self.cfg.seed, self.max_len, self.cfg.vllm, self.threads,
                                       model_dtype(self.cfg.precision))]
            else:
                if self.gpus and self.cfg.vllm["tensor_parallel_size"] > 1:
                    check_gpus_shareable(f"evaluate.vllm.tensor_parallel_size = {self.cfg.vllm['tensor_parallel_size']}"
                                         " (an engine's actor beside its vLLM worker)")
                self.engines = start_engines(self.model_dir, self.cfg.seed, self.max_len, self.cfg.vllm, self.threads,
                                             1, self.gpus, model_dtype(self.cfg.precision, self.gpus),
                                             engine_cls=Engine)
        sampling = (1, temperature, top_p, max_new_tokens, seed)
        if not self.on_ray:
            samples = self.engines[0].generate(requests, *sampling, seeds=seeds)
        else:
            samples = generate_on(self.engines, requests, *sampling, seeds=seeds)
        return [s[0] for s in samples]

    def loglikelihood(self, contexts: list[list[int]], continuations: list[list[int]]) -> list[tuple]:
        self.close_engines()
        if self.scorer is None:
            if self.on_ray:
                self.scorer = ray.remote(num_cpus=1, num_gpus=node_gpus())(ChoiceScorer).remote(
                    self.tokenizer.pad_token_id, actor_threads(1, self.threads, takes_turns=not self.gpus),
                    self.cfg.precision)
            else:
                self.scorer = ChoiceScorer(self.tokenizer.pad_token_id, self.threads, self.cfg.precision)
            self.call("hold", model_dir=self.model_dir, reference_dir=self.model_dir)
        return self.call("continuation_logprobs", contexts, continuations)

    def call(self, method: str, *args, **kwargs):
        if self.on_ray:
            return ray.get(getattr(self.scorer, method).remote(*args, **kwargs))
        return getattr(self.scorer, method)(*args, **kwargs)

    def close_engines(self) -> None:
        if self.engines is not None and self.on_ray:
            stop_engines(self.engines)  # their GPUs, KV caches and cores go to the scorer
        self.engines = None

    def close_scorer(self) -> None:
        if self.scorer is not None and self.on_ray:
            ray.kill(self.scorer)
        self.scorer = None

    def close(self) -> None:
        self.close_engines()
        self.close_scorer()


def check_fits(cfg: Config, prompt_ids: list[list[int]], model_dir: str) -> int:
    """vLLM's max_model_len for these prompts and max_new_tokens, refused where the model's positions cannot hold
    the longest prompt with them (a long few-shot prompt or an AIME-length reply)."""
    longest = max(map(len, prompt_ids))
    max_len = longest + cfg.benchmark["max_new_tokens"] + LENGTH_MARGIN
    positions = model_positions(model_dir)
    if positions and max_len > positions:
        raise ValueError(f"benchmarks.{cfg.name}: its longest prompt ({longest} tokens) and max_new_tokens = "
                         f"{cfg.benchmark['max_new_tokens']} do not fit the model's {positions} positions; lower "
                         "max_new_tokens, few_shot or the prompts' length")
    return max_len


def score_replies(cfg: Config, rows: list[dict], prompts: list[str], replies: list[list[str]]) -> tuple[list, list]:
    """(answers, scores) per problem and sample. answers are None where the scorer extracts none (a Python file)."""
    bench = cfg.benchmark
    scorer, pattern = bench["scorer"], bench["answer_pattern"]
    golds = [str(row[bench["label_key"]]) for row in rows]
    flat = [(i, text) for i, texts in enumerate(replies) for text in texts]
    if scorer == "math":
        with MathVerifier() as verifier:
            results = verifier.score([t for _, t in flat], [golds[i] for i, _ in flat], pattern)
        if verifier.timeouts:
            print(f"[benchmark] {cfg.name}: {verifier.timeouts} answer(s) timed out in math-verify, scored 0", flush=True)
    elif scorer in ("exact", "regex"):
        score = score_exact if scorer == "exact" else score_regex
        results = [score(text, golds[i], pattern) for i, text in flat]
    else:  # a Python file's reward_fn
        fn = load_reward_fn(repo_path(scorer))
        values = call_reward_fn(fn, scorer, [prompts[i] for i, _ in flat], [t for _, t in flat],
                                [golds[i] for i, _ in flat])
        if bad := [v for v in values if not 0 <= v <= 1]:
            raise RewardFileError(f"{scorer}: a benchmark's reward_fn scores each reply in [0, 1] (1: correct), got "
                                  f"{bad[:5]}")
        results = [(None, v) for v in values]
    answers, scores = [[] for _ in rows], [[] for _ in rows]
    for (i, _), (answer, value) in zip(flat, results):
        answers[i].append(answer)
        scores[i].append(float(value))
    return answers, scores


def choose(models: Models, tokenizer, cfg: Config, rows: list[dict], prompt_ids: list[list[int]]) -> tuple:
    """choice: (answers, scores): each problem's option of highest summed log-likelihood after the prompt (lm-eval's
    `acc`), right if it is the label (the option's index or its text)."""
    bench = cfg.benchmark
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    options = [[str(o) for o in row[bench["choices_key"]]] for row in rows]
    pairs = [(ids, encode(option)) for ids, opts in zip(prompt_ids, options) for option in opts]
    logps = iter(models.loglikelihood([c for c, _ in pairs], [o for _, o in pairs]))
    answers, scores = [], []
    for row, opts in zip(rows, options):
        best = max(range(len(opts)), key=[next(logps)[0] for _ in opts].__getitem__)
        gold = row[bench["label_key"]]
        right = best == gold if isinstance(gold, int) else normalise_answer(opts[best]) == normalise_answer(str(gold))
        answers.append([opts[best]])
        scores.append([float(right)])
    return answers, scores


def run_lm_eval(models: Models, tokenizer, cfg: Config) -> list[dict]:
    """An lm-eval task's problems as samples.jsonl rows, its generation and log-likelihoods on the job's model."""
    from runtime.lm_eval_tasks import run_task
    bench = cfg.benchmark
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(contexts, until, max_new_tokens, n, temperature):
        ids = [encode(c) for c in contexts]
        models.max_len = check_fits(cfg, ids, models.model_dir)
        samples = models.generate(ids, n, temperature, bench["top_p"], bench["max_new_tokens"],
                                  sampling_seed(cfg.seed, f"benchmark/{cfg.name}"))
        texts = []
        for stops, outs in zip(until, samples):
            cut = [min([s["text"].find(stop) for stop in stops if stop and stop in s["text"]] or [len(s["text"])])
                   for s in outs]
            texts.append([s["text"][:c] for s, c in zip(outs, cut)])
        return texts

    def loglikelihood(pairs):
        return models.loglikelihood([encode(c) for c, _ in pairs], [encode(o) for _, o in pairs])

    task = bench["lm_eval"]
    include = task["include_path"] and str(repo_path(task["include_path"]))
    name = str(repo_path(task["task"])) if task["task"].endswith((".yaml", ".yml")) else task["task"]
    records = run_task(name, include_path=include, generate=generate, loglikelihood=loglikelihood,
                       n_samples=bench["n_samples"], limit=bench["max_samples"], seed=cfg.seed,
                       temperature=bench["temperature"])
    return [{"id": r["doc_id"], **{key: r[key] for key in ("input", "label", "completions", "answers", "scores")}}
            for r in records]


def play(models: Models, tokenizer, cfg: Config, rows: list[dict], prompt_ids: list[list[int]], environment_file,
         seed: int) -> tuple[list, list, list, list]:
    """n_samples episodes per problem against the experiment's environment (runtime/environments.py): per problem its
    episodes' last replies and scores (1: the episode succeeded); the episodes' lengths and truncations."""
    bench = cfg.benchmark
    runner = EpisodeRunner(cfg.environment, environment_file, tokenizer, models.max_len)
    episodes = runner.run(lambda contexts, seeds, max_tokens: models.sample(contexts, bench["temperature"],
                                                                            bench["top_p"], max_tokens, seed, seeds),
                          [{"input": str(row[bench["input_key"]]), "label": str(row[bench["label_key"]]),
                            "prompt_ids": ids} for row, ids in zip(rows, prompt_ids)],
                          bench["n_samples"], seed, bench["max_new_tokens"])
    n = bench["n_samples"]
    groups = [episodes[i:i + n] for i in range(0, len(episodes), n)]
    replies = [[e.replies[-1] if e.replies else "" for e, _ in group] for group in groups]
    scores = [[float(stats["success"]) for _, stats in group] for group in groups]
    return replies, scores, [len(e.ids) for e, _ in episodes], [stats["truncated"] for _, stats in episodes]


def benchmark_metrics(problems: list[dict], pass_k: list[int], with_answers: bool) -> dict:
    """avg@n, pass@k and (with answers) maj@k over the problems, each problem weighing the same."""
    n = len(problems[0]["scores"])  # (an lm-eval task of log-likelihoods scores each problem once)
    metrics = {f"avg_at_{n}": statistics.fmean(statistics.fmean(p["scores"]) for p in problems)}
    for k in [k for k in pass_k if k <= n]:
        metrics[f"pass_at_{k}"] = statistics.fmean(pass_at_k(n, sum(s == 1 for s in p["scores"]), k) for p in problems)
        if with_answers:
            metrics[f"maj_at_{k}"] = statistics.fmean(majority_at_k(p["answers"], p["scores"], k) for p in problems)
    return metrics


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    bench, model_dir = cfg.benchmark, str(inputs["model"])
    tokenizer = load_tokenizer(model_dir)
    models = Models(cfg, model_dir, tokenizer, max_len=0)
    seed = sampling_seed(cfg.seed, f"benchmark/{cfg.name}")
    print(f"[benchmark] {cfg.name} on {cfg.model}: {bench['n_samples']} sample(s) per problem at temperature "
          f"{bench['temperature']}", flush=True)
    lengths, truncated = [], []
    try:
        if bench["lm_eval"]:
            problems = run_lm_eval(models, tokenizer, cfg)
            with_answers = any(p["completions"] for p in problems)
        else:
            rows = read_problems(bench)
            examples, rows = rows[:bench["few_shot"]], rows[bench["few_shot"]:]
            prompts = [format_prompt(tokenizer, cfg, examples, row) for row in rows]
            prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
            if bench["environment"]:
                models.max_len = context_length(max(map(len, prompt_ids)), bench["max_new_tokens"], cfg.environment,
                                                model_dir)
                replies, scores, lengths, truncated = play(models, tokenizer, cfg, rows, prompt_ids,
                                                           inputs["environment_file"], seed)
                answers = [[] for _ in rows]
            elif bench["scorer"] == "choice":
                answers, scores = choose(models, tokenizer, cfg, rows, prompt_ids)
                replies = [[] for _ in rows]
            else:
                models.max_len = check_fits(cfg, prompt_ids, model_dir)
                samples = models.generate(prompt_ids, bench["n_samples"], bench["temperature"], bench["top_p"],
                                          bench["max_new_tokens"], seed)
                replies = [[s["text"] for s in outs] for outs in samples]
                lengths = [len(s["token_ids"]) for outs in samples for s in outs]
                truncated = [s["truncated"] for outs in samples for s in outs]
                answers, scores = score_replies(cfg, rows, prompts, replies)
            problems = [{"id": i, "input": str(row[bench["input_key"]]), "label": str(row[bench["label_key"]]),
                         "completions": texts, "answers": a, "scores": s}
                        for i, (row, texts, a, s) in enumerate(zip(rows, replies, answers, scores))]
            with_answers = bench["scorer"] in ("math", "exact", "regex", "choice") and not bench["environment"]
    finally:
        models.close()
    if not problems:
        raise ValueError(f"benchmarks.{cfg.name}: no problems to score (max_samples, few_shot and the dataset's rows)")
    metrics = benchmark_metrics(problems, bench["pass_k"], with_answers) | {"num_problems": len(problems)}
    if lengths:
        metrics |= {"response_length": statistics.fmean(lengths), "truncated": statistics.fmean(truncated)}
    (output / "metrics.json").write_text(json.dumps({"benchmark": cfg.name, "model": cfg.model, **metrics}, indent=2))
    data.write_jsonl(output / "samples.jsonl", problems)
    tracker.log_metrics(metrics)
    tracker.log_artifact(output / "metrics.json")
    tracker.log_artifact(output / "samples.jsonl")
    print(f"[benchmark] {cfg.name} on {cfg.model}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()),
          flush=True)
