"""Users' datasets: every row checked before anything runs (file and line of each bad one), then turned into the
model's prompts and responses; the built-in datasets go through the same path."""
import json
import os
import sys

import pytest

from launcher.config import ConfigError, stage_config, validate_config
from pipeline_helpers import snakemake, write_config
from runtime import builtin_data, user_data
from runtime.models import CHATML, train_tiny_tokenizer
from stages import preprocess


def write_rows(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def data_block(**roles) -> dict:
    """The data block of a validated config whose datasets are `roles` ({role: spec overrides})."""
    return validate_config({"data": roles})["data"]


GOOD_PAIRS = [
    {"prompt": "Review this film.", "chosen": "A delight.", "rejected": "A bore."},
    {"chosen": [{"role": "user", "content": "Thoughts?"}, {"role": "assistant", "content": "Loved it."}],
     "rejected": [{"role": "user", "content": "Thoughts?"}, {"role": "assistant", "content": "Hated it."}]},
]
BAD_PAIRS = [  # (row, what the message says), each on its own line after a good one
    ('{"prompt": "p", "chosen": "yes"', "not valid JSON"),
    ({"prompt": "p", "chosen": "yes"}, "missing key 'rejected'"),
    ({"prompt": "p", "chosen": "   ", "rejected": "no"}, "'chosen' is empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "identical"),
    ({"chosen": [{"content": "hi"}], "rejected": "x"}, "chosen[0] has no valid 'role'"),
    ({"chosen": [{"role": "assistant", "content": ""}], "rejected": "x"}, "chosen[0].content is missing or empty"),
    ({"chosen": 3, "rejected": "x"}, "'chosen' must be text"),
    ('{"chosen": "a", "rejected": "b", "margin": NaN}', "'margin' must be a finite number, got nan"),
    ({"chosen": [{"role": "user", "content": "Thoughts?"}, {"role": "assistant", "content": "Loved it."}],
      "rejected": [{"role": "user", "content": "Opinions?"}, {"role": "assistant", "content": "Hated it."}]},
     "'chosen' and 'rejected' differ before their last message"),
    ({"chosen": [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Great."}],
      "rejected": [{"role": "assistant", "content": "Hi."}, {"role": "assistant", "content": "Bad."}]},
     "the last message of 'chosen' must be the assistant's reply"),
]


def with_margins(rows):
    """The rows with a margin where they have none (the tests name a margin_key, which makes it required)."""
    return [{"margin": 1.0} | row if isinstance(row, dict) else row for row in rows]


def test_every_bad_row_is_named_with_file_and_line(tmp_path):
    path = write_rows(tmp_path / "pairs.jsonl", with_margins([GOOD_PAIRS[0], *[row for row, _ in BAD_PAIRS]]))
    data = data_block(preference={"path": str(path), "margin_key": "margin"})
    with pytest.raises(user_data.DataError) as err:
        user_data.check_datasets(data, tmp_path / "checked.json")
    message = str(err.value)
    for line, (_, fragment) in enumerate(BAD_PAIRS, start=2):
        assert any(f"{path}, line {line}: " in m and fragment in m for m in message.splitlines()), (line, message)
    assert f"{len(BAD_PAIRS)} bad rows" in message and not (tmp_path / "checked.json").exists()


def test_other_roles_and_formats(tmp_path):
    """SFT with custom keys and with chat messages, prompts with labels in Parquet and CSV."""
    import pandas
    sft = write_rows(tmp_path / "sft.jsonl", [{"question": "q", "answer": "a"}, {"question": "q"},
                                             {"question": "", "answer": "a"}])
    chat = write_rows(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]},
        {"messages": "hi"}])
    pandas.DataFrame({"text": ["2+2?", None, "3+3?"], "answer": ["4", "x", None]}).to_parquet(tmp_path / "p.parquet")
    (tmp_path / "eval.csv").write_text("text,answer\n1+1?,2\n,3\n")
    data = data_block(sft={"path": str(sft), "input_key": "question", "output_key": "answer"},
                      prompts={"path": str(tmp_path / "p.parquet"), "input_key": "text", "label_key": "answer"},
                      eval={"path": str(tmp_path / "eval.csv"), "input_key": "text", "label_key": "answer"})
    with pytest.raises(user_data.DataError) as err:
        user_data.check_datasets(data, tmp_path / "checked.json")
    message = str(err.value)
    assert f"{sft}, line 2: missing key 'answer'" in message and f"{sft}, line 3: 'question' is empty" in message
    assert f"{tmp_path / 'p.parquet'}, row 1: 'text' has no value (null, or an empty cell)" in message
    assert f"{tmp_path / 'p.parquet'}, row 2: 'answer' has no value" in message
    assert f"{tmp_path / 'eval.csv'}, line 3: 'text' has no value" in message
    assert "line 2" not in message.split(str(tmp_path / "eval.csv"))[0].split(str(tmp_path / "p.parquet"))[-1]
    data = data_block(sft={"path": str(chat), "messages_key": "messages"})
    with pytest.raises(user_data.DataError) as err:
        user_data.check_datasets(data, tmp_path / "checked.json")
    assert f"{chat}, line 2: the last message of 'messages' must be the assistant's" in str(err.value)
    assert f"{chat}, line 3: 'messages' must be a non-empty list of chat messages" in str(err.value)


def test_non_utf8_missing_file_and_a_cap_on_the_list(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n{"prompt": ""}\n')  # the scan goes on after it
    many = write_rows(tmp_path / "many.jsonl", [{"prompt": ""}] * 30)
    data = data_block(sft={"path": str(tmp_path / "nope.jsonl")}, prompts={"path": str(latin)},
                      eval={"path": str(many)})
    with pytest.raises(user_data.DataError) as err:
        user_data.check_datasets(data, tmp_path / "checked.json")
    message = str(err.value)
    assert "nope.jsonl': no such file" in message and f"{latin}, line 2: not UTF-8 text (byte 0xe9)" in message
    assert f"{latin}, line 3: 'prompt' is empty" in message
    assert "33 bad rows" in message and "... and 13 more" in message


def test_line_separators_inside_json_strings_are_text(tmp_path):
    """JSON Lines end at "\\n" only: U+2028, U+2029 and U+0085 inside a string are part of the text."""
    rows = [{"prompt": f"first{sep}second", "label": "x"} for sep in ("\u2028", "\u2029", "\x85")]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    user_data.check_datasets(data_block(prompts={"path": str(path), "label_key": "label"}), tmp_path / "checked.json")


def test_csv_parquet_and_saved_rows_are_read_in_batches_without_datasets(tmp_path, monkeypatch):
    """A CSV (over pyarrow's 1 MB block), a Parquet file (over its 1024-row batch) and a save_to_disk directory are
    checked a batch at a time with pyarrow: `datasets`, whose load_dataset copies a file into ~/.cache/huggingface,
    is not imported, and a row past the first batch keeps its line (CSV) or row number. The preprocess stage's
    load_records reads them the same way, and only the rows it keeps."""
    import datasets
    rows = [{"prompt": f"Say the number {i} please.", "label": str(i)} for i in range(60_000)]
    rows[59_000]["prompt"] = None
    (tmp_path / "p.csv").write_text("prompt,label\n" + "".join(f"{row['prompt'] or ''},{row['label']}\n"
                                                               for row in rows))
    datasets.Dataset.from_list(rows[:3000]).to_parquet(str(tmp_path / "p.parquet"))
    datasets.Dataset.from_list(rows[58_990:59_010]).save_to_disk(str(tmp_path / "saved"))
    assert (tmp_path / "p.csv").stat().st_size > 2**20
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    data = data_block(prompts={"path": str(tmp_path / "p.csv"), "label_key": "label"},
                      eval={"path": str(tmp_path / "saved"), "label_key": "label"})
    with pytest.raises(user_data.DataError) as err:
        user_data.check_datasets(data, tmp_path / "checked.json")
    assert str(err.value).splitlines()[1:] == [
        f"  {tmp_path / 'p.csv'}, line 59002: 'prompt' has no value (null, or an empty cell)",
        f"  {tmp_path / 'saved'}, row 10: 'prompt' has no value (null, or an empty cell)"], str(err.value)
    parquet = tmp_path / "p.parquet"
    pyarrow_rows = [row for row in user_data.local_rows({"path": str(parquet), "split": "train"})]
    assert len(pyarrow_rows) == 3000 and pyarrow_rows[2500] == rows[2500]
    user_data.check_datasets(data_block(prompts={"path": str(parquet), "label_key": "label"}),
                             tmp_path / "checked.json")
    load = lambda path, count: user_data.load_records({"path": str(path), "split": "train", "max_samples": count})
    assert load(parquet, 5) == rows[:5] and load(tmp_path / "saved", 3) == rows[58_990:58_993]
    assert [row["prompt"] for row in load(tmp_path / "p.csv", 4)] == [row["prompt"] for row in rows[:4]]


def test_a_checked_file_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    path = write_rows(tmp_path / "pairs.jsonl", [GOOD_PAIRS[0], {"prompt": "Well?", "chosen": "Yes.", "rejected": "No."}])
    data = data_block(preference={"path": str(path)})
    cache = tmp_path / "checked.json"
    user_data.check_datasets(data, cache)
    reads = []
    monkeypatch.setattr(user_data, "dataset_problems", lambda role, spec: reads.append(role) or [])
    user_data.check_datasets(data, cache)
    assert reads == []
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    user_data.check_datasets(data, cache)
    assert reads == ["preference"]


def tokenizer(chat: bool = True):
    tok = train_tiny_tokenizer(["a delight a bore loved it hated it thoughts review this film"] * 20, 300)
    tok.chat_template = CHATML if chat else None
    return tok


def formatter(chat: bool = True, **data) -> preprocess.Formatter:
    cfg = stage_config(preprocess, {"data": {"max_prompt_tokens": 200, "max_response_tokens": 100} | data}, "data")
    return preprocess.Formatter(cfg, tokenizer(chat))


def test_pairs_and_sft_rows_in_the_model_format():
    fmt = formatter()
    spec = stage_config(preprocess, {}, "data").preference | {"margin_key": None}
    first, second = (fmt.pair(row, spec) for row in GOOD_PAIRS)
    assert first["prompt"] == "<|im_start|>user\nReview this film.<|im_end|>\n<|im_start|>assistant\n"
    assert first["chosen"] == "A delight.<|im_end|>"
    assert second["prompt"] == "<|im_start|>user\nThoughts?<|im_end|>\n<|im_start|>assistant\n"
    assert (second["chosen"], second["rejected"]) == ("Loved it.<|im_end|>", "Hated it.<|im_end|>")
    # A base model: its own template, and responses end with its EOS token.
    base = formatter(chat=False, apply_chat_template=False, input_template="User: {}\nAssistant: ")
    sft_spec = stage_config(preprocess, {}, "data").sft | {"input_key": "q", "output_key": "a"}
    assert base.sft({"q": "Thoughts?", "a": "Loved it."}, sft_spec) == {
        "prompt": "User: Thoughts?\nAssistant: ", "response": "Loved it.<|im_end|>"}


def test_end_of_turn_is_the_templates_not_eos():
    """Qwen2-style: eos_token ends a document, <|im_end|> a turn; a reply must learn the latter."""
    fmt = formatter()
    fmt.tokenizer.eos_token = "<|endoftext|>"
    fmt.end = preprocess.end_of_turn(fmt.tokenizer)
    assert fmt.fit_response("Loved it.") == "Loved it.<|im_end|>"


@pytest.mark.parametrize("mode, counter", [("drop", "dropped_long_response"), ("truncate", "truncated_response")])
def test_too_long_rows_are_dropped_or_cut_and_counted(mode, counter):
    fmt = formatter(max_prompt_tokens=24, max_response_tokens=5, long_responses=mode)
    spec = stage_config(preprocess, {}, "data").sft | {"input_key": "q", "output_key": "a"}
    assert fmt.sft({"q": "review this film " * 10, "a": "ok"}, spec) is None
    row = fmt.sft({"q": "x", "a": "a delight a bore loved it hated it"}, spec)
    assert (row is None) == (mode == "drop")
    if row:
        assert len(fmt.tokens(row["response"])) <= 5 and not row["response"].endswith("<|im_end|>")
    assert fmt.stats["sft"]["dropped_long_prompt"] == 1 and fmt.stats["sft"][counter] == 1


def test_builtin_arithmetic_answers_a_held_out_eval_and_a_test_set():
    train = builtin_data.arithmetic_rows("prompts", 200, seed=0)
    held_out = builtin_data.arithmetic_rows("eval", 50, seed=0)
    test = builtin_data.arithmetic_rows("test", 200, seed=0)  # the benchmark's problems
    for row in train + held_out + test:
        a, op, b = row["prompt"].removeprefix("What is ").split("?")[0].split()
        assert row["label"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    prompts = lambda rows: {r["prompt"] for r in rows}
    assert not prompts(train) & prompts(held_out) and not prompts(test) & (prompts(train) | prompts(held_out))
    pairs = builtin_data.arithmetic_rows("preference", 20, seed=0)
    assert all(p["chosen"] != p["rejected"] for p in pairs)


def test_bad_rows_stop_snakemake_before_any_job_and_leave_results_alone(tmp_path):
    pairs = write_rows(tmp_path / "pairs.jsonl", with_margins([GOOD_PAIRS[0], *[row for row, _ in BAD_PAIRS]]))
    results = tmp_path / "results" / "bad"
    (results / "sft").mkdir(parents=True)
    (results / "sft" / "metrics.json").write_text("{}")
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*")}
    configfile = write_config(tmp_path / "c.yaml", tmp_path / "results", experiment="bad",
                              data={"preference": {"path": str(pairs), "margin_key": "margin"}})
    proc = snakemake(configfile, "all", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for line in range(2, 2 + len(BAD_PAIRS)):
        assert f"{pairs}, line {line}: " in output, output[-3000:]
    assert {p: p.stat().st_mtime_ns for p in results.rglob("*")} == before, "existing results changed"
    assert "submitted" not in output


def test_a_key_must_keep_one_type_in_a_file(tmp_path):
    """Arrow, which `datasets` reads a file into, needs one type per column: text pairs and chat pairs go in
    separate files. (Whole and decimal numbers are both numbers.)"""
    mixed = write_rows(tmp_path / "mixed.jsonl", [{"margin": 1} | GOOD_PAIRS[0], {"margin": 0.5} | GOOD_PAIRS[1]])
    with pytest.raises(user_data.DataError) as err:
        user_data.check_datasets(data_block(preference={"path": str(mixed), "margin_key": "margin"}),
                                 tmp_path / "checked.json")
    assert f"{mixed}, line 2: 'chosen' is a list here but text on line 1" in str(err.value)
    assert "'margin'" not in str(err.value)


def test_a_local_path_with_a_typo_is_not_taken_for_a_hub_id(tmp_path):
    """`org/name` that is not here is a hub id, unless it ends like a file or its first folder exists here: then it
    is a local path with a typo, refused before anything is queued, not looked up on the hub in its stage."""
    assert user_data.is_hub("meta-llama/Meta-Llama-3-8B-Instruct") and user_data.is_hub("Qwen/Qwen2.5-0.5B")
    assert not user_data.is_hub("data/good_sfft.jsonl") and not user_data.is_hub("config/mymodell")
    with pytest.raises(user_data.DataError, match="good_sfft.jsonl': no such file"):
        user_data.check_datasets(data_block(sft={"path": "data/good_sfft.jsonl"}), tmp_path / "checked.json")
    with pytest.raises(ConfigError, match="model.path = 'config/mymodell': not a Hugging Face causal-LM directory"):
        validate_config({"model": {"path": "config/mymodell"}})


def test_a_json_array_a_latin1_csv_and_a_named_pipe_are_each_named(tmp_path):
    """A pretty-printed .json array is read as the array it is (rows named by index), a CSV that is not UTF-8 is
    named with its line, and a named pipe is refused at once (reading it would wait for a writer forever)."""
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"prompt": "p", "label": "x"}, {"prompt": "", "label": "y"}], indent=2))
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"prompt,label\nok,1\ncaf\xe9,2\n")
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)
    data = data_block(prompts={"path": str(array), "label_key": "label"}, eval={"path": str(latin), "label_key": "label"},
                      sft={"path": str(pipe)})
    with pytest.raises(user_data.DataError) as err:
        user_data.check_datasets(data, tmp_path / "checked.json")
    message = str(err.value)
    assert f"{array}, row 1: 'prompt' is empty" in message and "row 0" not in message, message
    assert f"{latin}, line 3 (byte 0xe9): not UTF-8 text" in message, message
    assert "pipe.jsonl': not a regular file or directory (a pipe or a device?)" in message, message
    array.write_text(json.dumps([{"prompt": "p", "label": "x"}], indent=2))
    user_data.check_datasets(data_block(prompts={"path": str(array), "label_key": "label"}), tmp_path / "checked.json")
