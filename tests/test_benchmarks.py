"""Benchmarks' pieces without an engine: the config's refusals before queueing, prompts with few-shot examples, the
metrics from per-sample scores, and the job's length check. The whole path (vLLM, math-verify, lm-eval, MLflow, the
report's table): tests/test_user_experiment.py::test_benchmarks_are_scored_per_sample_and_tabled_with_significance."""
import json

import pytest

from launcher.config import ConfigError, stage_jobs, validate_config
from stages import benchmark
from stages.benchmark import Config, benchmark_metrics, check_fits, format_prompt

ARITH = {"path": "builtin:arithmetic", "scorer": "math"}


def config_with(benchmarks: dict, **more) -> dict:
    return validate_config({"model": {"source": "tiny"}, "data": {"eval": {"path": "builtin:arithmetic"}},
                            "benchmarks": benchmarks, **more})


def test_defaults_and_one_job_per_benchmark_model_and_seed():
    config = config_with({"arith": ARITH | {"n_samples": 4, "temperature": 0.6}},
                         dpo={}, seeds=[0, 1], data={"preference": {"path": "builtin:arithmetic"},
                                                     "eval": {"path": "builtin:arithmetic"}})
    bench = config["benchmarks"]["arith"]
    assert bench["pass_k"] == [4] and bench["max_new_tokens"] == 256 and bench["template"] == "{input}"
    jobs = [name for stage, name, _ in stage_jobs(config) if stage == "benchmark"]
    # base once, with the shared seed; dpo on each seed of the grid
    assert jobs == ["benchmark/arith/base/seed1234", "benchmark/arith/dpo/seed0", "benchmark/arith/dpo/seed1"]


@pytest.mark.parametrize("bench, fragment", [
    (ARITH | {"n_samples": 4, "temperature": 1.0, "pass_k": [8]}, "pass@k needs k <= n_samples = 4 ([8] is not)"),
    (ARITH | {"n_samples": 4}, "temperature 0 is greedy decoding"),
    ({"path": "builtin:arithmetic", "scorer": "regex"}, "scorer regex needs answer_pattern"),
    (ARITH | {"answer_pattern": "(unclosed"}, "answer_pattern = '(unclosed' is not a regular expression"),
    ({"path": "builtin:arithmetic", "scorer": "choice", "choices_key": "options", "n_samples": 2, "temperature": 1},
     "n_samples must be 1"),
    ({"path": "builtin:arithmetic", "scorer": "f1"}, "scorer = 'f1' is not valid; choose one of"),
    ({"path": "data/nowhere.jsonl"}, "benchmarks.b.path = 'data/nowhere.jsonl': no such file or directory"),
    ({"path": "builtin:imdb"}, "the built-in benchmark is builtin:arithmetic"),
    ({}, "benchmarks.b.path is not set"),
    ({"lm_eval": {"task": "gsm8k"}}, "is a task name: give include_path"),
    ({"lm_eval": {"task": "tasks/none.yaml"}}, "no such task YAML file"),
    ({"path": "builtin:arithmetic", "lm_eval": {"task": "x.yaml"}}, "path and lm_eval both given"),
])
def test_a_bad_benchmark_is_refused_naming_its_key(bench, fragment):
    with pytest.raises(ConfigError) as err:
        config_with({"b": bench})
    assert fragment in str(err.value), str(err.value)


def test_a_bad_baseline_or_benchmark_name_is_refused():
    with pytest.raises(ConfigError, match="evaluate.baseline = 'sft' is not a row"):
        config_with({"b": ARITH}, evaluate={"baseline": "sft"})
    with pytest.raises(ConfigError, match="benchmarks"):
        config_with({"b/../x": ARITH})


class ChatTokenizer:
    """Writes the messages it is given as `role: content` lines (a chat template that shows what it got)."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def bench_config(chat: bool, **keys) -> Config:
    bench = config_with({"b": ARITH | keys})["benchmarks"]["b"]
    return Config(name="b", model="base", seed=0, benchmark=bench, vllm={}, precision="fp32",
                  chat={"apply_chat_template": chat, "input_template": None if chat else "Q: {}\nA: "})


def test_prompts_put_the_few_shot_examples_before_the_question():
    rows = [{"q": "1 + 1", "label": "2"}, {"q": "2 + 2", "label": "4"}, {"q": "3 + 3", "label": "6"}]
    keys = {"input_key": "q", "template": "Compute {input}.", "answer_template": "\\boxed{{{label}}}",
            "system_prompt": "Be brief."}
    chat = format_prompt(ChatTokenizer(), bench_config(True, **keys), rows[:2], rows[2])
    assert chat == ("system: Be brief.\nuser: Compute 1 + 1.\nassistant: \\boxed{2}\nuser: Compute 2 + 2.\n"
                    "assistant: \\boxed{4}\nuser: Compute 3 + 3.\nassistant:")
    plain = format_prompt(None, bench_config(False, **keys), rows[:1], rows[2])
    assert plain == "Q: Compute 1 + 1.\nA: \\boxed{2}\n\nQ: Compute 3 + 3.\nA: "


def test_metrics_from_the_samples_scores():
    problems = [{"scores": [1, 0, 0, 0], "answers": ["5", "3", "3", None]},  # right once; the majority is wrong
                {"scores": [1, 1, 1, 1], "answers": ["4"] * 4},
                {"scores": [0, 0, 0, 0], "answers": [None] * 4}]
    metrics = benchmark_metrics(problems, [1, 2, 4], with_answers=True)
    assert metrics["avg_at_4"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert metrics["pass_at_1"] == pytest.approx(metrics["avg_at_4"])
    assert metrics["pass_at_2"] == pytest.approx((0.5 + 1 + 0) / 3)  # 1 - C(3,2)/C(4,2) = 0.5
    assert metrics["pass_at_4"] == pytest.approx(2 / 3)
    assert metrics["maj_at_4"] == pytest.approx(1 / 3) and metrics["maj_at_1"] == pytest.approx(2 / 3)
    assert "maj_at_4" not in benchmark_metrics(problems, [4], with_answers=False)


def test_a_prompt_that_cannot_fit_the_models_positions_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    cfg = bench_config(True, max_new_tokens=32)
    assert check_fits(cfg, [[1] * 20], str(tmp_path)) == 20 + 32 + benchmark.LENGTH_MARGIN
    with pytest.raises(ValueError, match="its longest prompt \\(30 tokens\\) and max_new_tokens = 32 do not fit"):
        check_fits(cfg, [[1] * 10, [1] * 30], str(tmp_path))
