"""runtime/lm_eval_tasks.py: lm-eval tasks from local YAMLs and JSONL files, scored through fake callbacks, offline."""
import json
import os
import socket

import pytest

from runtime.lm_eval_tasks import run_task
from runtime.user_data import REPO_ROOT

QA = [  # question, answer, the 3 samples the fake model gives
    ("What is the capital of France?", "Paris", [" The answer is PARIS.", " The answer is Lyon.", " Paris"]),
    ("What colour is the sky?", "blue", [" The answer is blue", " The answer is Blue!", " the answer is BLUE"]),
    ("What is the largest planet?", "Jupiter", [" The answer is Saturn.", " Jupiter", " The answer is Mars"]),
    ("What is 2 + 2?", "4", [" The answer is 4"] * 3),
]
QA_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
{extra}filter_list:
  - name: strict
    filter:
      - function: regex
        regex_pattern: "answer is (.+)"
      - function: take_first
  - name: last_word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)\\\\W*$"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""
MC = [  # question, choices, index of the right one, index the fake model prefers
    ("Which is a fruit?", ["carrot", "apple", "potato"], 1, 1),
    ("Which is a metal?", ["iron", "wood"], 0, 1),
    ("Which is a colour?", ["seven", "red", "north"], 1, 1),
]
MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """Any connection attempt is recorded and refused; datasets caches under tmp_path."""
    import datasets.config

    attempts = []

    def refuse(sock, address, *args):
        attempts.append(address)
        raise OSError(f"test: no network ({address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    yield
    assert attempts == []


def write_task(tmp_path, yaml_text, rows, task, data=None, **fmt):
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir(exist_ok=True)
    path = tmp_path / f"{task}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tasks_dir / f"{task}.yaml").write_text(yaml_text.format(task=task, data=data or path, **fmt))
    return tasks_dir


def fake_generate(calls):
    def generate(contexts, until, max_new_tokens, n, temperature):
        calls.append(dict(contexts=contexts, until=until, max_new_tokens=max_new_tokens, n=n, temperature=temperature))
        samples = {f"Q: {q}\nA:": texts for q, _, texts in QA}
        return [samples[context.rsplit("\n\n", 1)[-1]][:n] for context in contexts]
    return generate


def no_loglikelihood(pairs):
    raise AssertionError("a generative task asked for log-likelihoods")


def test_generate_until_scores_every_sample(tmp_path):
    tasks_dir = write_task(tmp_path, QA_YAML, [{"question": q, "answer": a} for q, a, _ in QA], "qa", extra="")
    calls = []
    records = run_task("qa", include_path=str(tasks_dir), generate=fake_generate(calls),
                       loglikelihood=no_loglikelihood, n_samples=3, limit=3, seed=1, temperature=0.7)

    assert len(calls) == 1  # one call, for every document's n samples; later passes read the cache
    assert calls[0]["contexts"] == [f"Q: {q}\nA:" for q, _, _ in QA[:3]]  # limit=3
    assert calls[0]["until"] == [["\n"]] * 3 and calls[0]["max_new_tokens"] == [32] * 3
    assert calls[0]["n"] == 3 and calls[0]["temperature"] == 0.7  # the YAML sets no temperature
    assert [r["doc_id"] for r in records] == [0, 1, 2]
    assert [r["input"] for r in records] == [f"Q: {q}\nA:" for q, _, _ in QA[:3]]
    assert [r["label"] for r in records] == ["Paris", "blue", "Jupiter"]
    assert [r["completions"] for r in records] == [texts for _, _, texts in QA[:3]]
    # The first filter (strict: "answer is ..."), not last_word, which would score " Paris" and " Jupiter" right.
    assert [r["answers"] for r in records] == [["PARIS.", "Lyon.", "[invalid]"], ["blue", "Blue!", "BLUE"],
                                               ["Saturn.", "[invalid]", "Mars"]]
    assert [r["scores"] for r in records] == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert {r["metric"] for r in records} == {"exact_match"}


def test_few_shot_prompts_are_seeded_and_the_same_on_every_pass(tmp_path):
    """Few-shot examples are drawn again on each pass: re-seeded, every pass builds the first pass's prompts."""
    tasks_dir = write_task(tmp_path, QA_YAML, [{"question": q, "answer": a} for q, a, _ in QA], "qa_fewshot",
                           extra="num_fewshot: 2\nfewshot_split: test\n")
    yaml_path = tasks_dir / "qa_fewshot.yaml"
    text = yaml_path.read_text().replace("  max_gen_toks: 32\n", "  max_gen_toks: 32\n  temperature: 0.2\n")
    yaml_path.write_text(text)

    def run(seed):
        calls = []
        records = run_task(str(yaml_path), include_path=None, generate=fake_generate(calls),
                           loglikelihood=no_loglikelihood, n_samples=3, limit=None, seed=seed, temperature=0.7)
        assert len(calls) == 1 and calls[0]["temperature"] == 0.2  # the YAML's temperature wins
        return records

    records = run(seed=5)
    assert len(records) == 4 and all(r["input"].count("Q: ") == 3 for r in records)  # 2 examples + the question
    assert all(r["input"].endswith(f"Q: {q}\nA:") for r, (q, _, _) in zip(records, QA))
    assert [r["scores"] for r in records][:3] == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert [r["input"] for r in run(seed=5)] == [r["input"] for r in records]


def test_relative_data_files_and_default_generation_kwargs(tmp_path, monkeypatch):
    """data_files relative to the repository root, run from elsewhere; a task without generation_kwargs samples at
    run_task's temperature (not the greedy 0 lm-eval fills in), until lm-eval's default, the few-shot delimiter."""
    rows = [{"question": q, "answer": a} for q, a, _ in QA]
    relative = os.path.relpath(tmp_path / "qa_rel.jsonl", REPO_ROOT)
    tasks_dir = write_task(tmp_path, QA_YAML, rows, "qa_rel", data=relative, extra="")
    yaml_path = tasks_dir / "qa_rel.yaml"
    yaml_path.write_text(yaml_path.read_text().replace('generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 32\n',
                                                       ""))
    assert "generation_kwargs" not in yaml_path.read_text()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    calls = []
    records = run_task("qa_rel", include_path=str(tasks_dir), generate=fake_generate(calls),
                       loglikelihood=no_loglikelihood, n_samples=1, limit=2, seed=0, temperature=0.9)
    assert [r["scores"] for r in records] == [[1.0], [1.0]]
    assert calls[0]["temperature"] == 0.9 and calls[0]["until"] == [["\n\n"]] * 2


def test_multiple_choice_by_loglikelihood(tmp_path):
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a, _ in MC]
    tasks_dir = write_task(tmp_path, MC_YAML, rows, "mc")
    calls = []

    def loglikelihood(pairs):
        calls.append(pairs)
        preferred = {f"Q: {q}\nA:": " " + c[p] for q, c, _, p in MC}
        return [(-1.0 if preferred[ctx] == cont else -5.0 - len(cont), preferred[ctx] == cont) for ctx, cont in pairs]

    def generate(*args):
        raise AssertionError("a multiple-choice task asked for generations")

    records = run_task("mc", include_path=str(tasks_dir), generate=generate, loglikelihood=loglikelihood,
                       n_samples=4, limit=None, seed=0)
    assert len(calls) == 1 and len(calls[0]) == 3 + 2 + 3  # every choice of every document, once
    assert calls[0][:3] == [("Q: Which is a fruit?\nA:", " carrot"), ("Q: Which is a fruit?\nA:", " apple"),
                            ("Q: Which is a fruit?\nA:", " potato")]
    assert [r["label"] for r in records] == ["apple", "iron", "red"]
    assert [r["answers"] for r in records] == [["apple"], ["wood"], ["red"]]
    assert [r["scores"] for r in records] == [[1.0], [0.0], [1.0]]  # deterministic: one pass, one score
    assert all(r["completions"] == [] and r["metric"] == "acc" for r in records)


def test_unknown_task_and_broken_yaml(tmp_path):
    tasks_dir = write_task(tmp_path, QA_YAML, [{"question": "q", "answer": "a"}], "qa_known", extra="")
    (tasks_dir / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    kwargs = dict(generate=fake_generate([]), loglikelihood=no_loglikelihood, n_samples=1, limit=None, seed=0)
    with pytest.raises(ValueError, match=r"'no_such_task'.*tasks.*qa_known"):
        run_task("no_such_task", include_path=str(tasks_dir), **kwargs)
    with pytest.raises(ValueError, match=r"broken\.yaml.*does not load"):
        run_task(str(tasks_dir / "broken.yaml"), include_path=None, **kwargs)
