"""The datasets of an experiment: the user's (a JSONL, Parquet or CSV file, a `datasets` save_to_disk directory, or
a hub dataset with a split), and every row checked.

Each role names its keys in the config (data.sft, data.preference, data.prompts, data.eval; schema for details):
  sft         input_key + output_key, or messages_key (a chat whose last message is the assistant's reply)
  preference  chosen_key, rejected_key (text or chat messages); prompt_key (optional in a row); margin_key
  prompts     input_key (text or messages); label_key (passed to reward functions)
  eval        as prompts; output_key (optional): a reference response
`check_datasets` runs in the Snakefile, before any job is queued, and names every bad row (up to 20) with its file
and line; it reads a file a batch at a time (pyarrow for CSV, Parquet and save_to_disk directories), never writing to
the Hugging Face cache. `load_records` is what the preprocess stage reads: a local file as the check read it, a hub
dataset with `datasets` (imported only then).
"""
import codecs
import csv
import hashlib
import itertools
import json
import math
import re
from pathlib import Path

ROLES = ("sft", "preference", "prompts", "eval")
BUILTIN_PREFIX = "builtin:"
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_REPORTED = 20
CHAT_ROLES = ("system", "user", "assistant", "tool")
REPO_ROOT = Path(__file__).resolve().parent.parent


def repo_path(path: str) -> Path:
    """A path of the config (a dataset, model, reward file): absolute, or relative to the repository root."""
    return REPO_ROOT / path  # (an absolute `path` replaces the root)


class DataError(ValueError):
    """Bad rows of a dataset; the message names each with its file and line (or row)."""


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


# Endings of files, never of a hub id: `data/sft.jsonl` that is not there is a local file missing, not a dataset id.
FILE_SUFFIXES = (*FORMATS, ".tsv", ".txt", ".arrow", ".safetensors", ".bin", ".pt", ".gguf")


def is_hub(path: str) -> bool:
    """A hub id (`org/name`) rather than a local path: nothing of that name exists here, it does not end like a file,
    and no folder of its first part exists here (`models/mymodell`, a typo of a local model, stays a local path and is
    refused as missing, not looked up on the hub)."""
    if is_builtin(path) or repo_path(path).exists():
        return False
    org = re.fullmatch(r"([\w.-]+)/[\w.-]+", path)
    return org is not None and not path.endswith(FILE_SUFFIXES) and not repo_path(org.group(1)).is_dir()


def load_records(spec: dict) -> list[dict]:
    """The rows of a user dataset (spec: a data.<role> block), the first `max_samples` of them. A local one is read
    as check_datasets read it before queueing (local_rows: no more rows than it takes, nothing written to the
    Hugging Face cache); whether a hub dataset may be downloaded is the job's environment's to say
    (runtime/job.set_job_env)."""
    if not is_hub(spec["path"]):
        return list(itertools.islice(local_rows(spec), spec["max_samples"]))
    import datasets
    table = datasets.load_dataset(spec["path"], split=spec["split"])
    return table.select(range(min(len(table), spec["max_samples"]))).to_list()


# ---- row checks: each returns the problems of one value ("" keys name the row's key in the message)

def _text(value, key: str) -> list[str]:
    if not isinstance(value, str):
        return [f"{key!r} must be text, got {type(value).__name__}"]
    return [] if value.strip() else [f"{key!r} is empty"]


def _messages(value, key: str) -> list[str]:
    if not isinstance(value, list) or not value:
        return [f"{key!r} must be a non-empty list of chat messages ({{'role', 'content'}})"]
    problems = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            problems.append(f"{key}[{i}] is not a message ({{'role', 'content'}})")
        elif message.get("role") not in CHAT_ROLES:
            problems.append(f"{key}[{i}] has no valid 'role' (one of {', '.join(CHAT_ROLES)})")
        elif not isinstance(message.get("content"), str) or not message["content"].strip():
            problems.append(f"{key}[{i}].content is missing or empty")
    return problems


def _text_or_messages(value, key: str) -> list[str]:
    return _messages(value, key) if isinstance(value, list) else _text(value, key)


def row_problems(role: str, spec: dict, row) -> list[str]:
    """What is wrong with one row of a dataset of `role` read with the keys of `spec` (empty: nothing)."""
    if not isinstance(row, dict):
        return [f"each row must be an object with keys, got {type(row).__name__}"]
    problems: list[str] = []

    def present(key: str) -> bool:
        if key in row and row[key] is None:
            problems.append(f"{key!r} has no value (null, or an empty cell)")
        elif key not in row:
            problems.append(f"missing key {key!r} (keys here: {', '.join(sorted(row)) or 'none'})")
        return row.get(key) is not None

    if role == "sft" and spec["messages_key"]:
        key = spec["messages_key"]
        if present(key):
            problems += _messages(row[key], key)
            if not problems and row[key][-1]["role"] != "assistant":
                problems.append(f"the last message of {key!r} must be the assistant's reply to learn")
    elif role == "sft":
        if present(spec["input_key"]):
            problems += _text_or_messages(row[spec["input_key"]], spec["input_key"])
        if present(spec["output_key"]):
            problems += _text(row[spec["output_key"]], spec["output_key"])
    elif role == "preference":
        for key in (spec["chosen_key"], spec["rejected_key"]):
            if present(key):
                problems += _text_or_messages(row[key], key)
        if row.get(spec["prompt_key"]) is not None:
            problems += _text_or_messages(row[spec["prompt_key"]], spec["prompt_key"])
        if spec["margin_key"] and present(spec["margin_key"]):
            margin = row[spec["margin_key"]]
            if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
                problems.append(f"{spec['margin_key']!r} must be a finite number, got {margin!r}")
        if not problems and row[spec["chosen_key"]] == row[spec["rejected_key"]]:
            problems.append("chosen and rejected are identical, so the pair says nothing")
        chats = [row[k] for k in (spec["chosen_key"], spec["rejected_key"]) if isinstance(row.get(k), list)]
        if not problems and len(chats) == 2:  # two conversations: one shared context, then the two replies
            chosen, rejected = chats
            if chosen[:-1] != rejected[:-1]:
                problems.append(f"{spec['chosen_key']!r} and {spec['rejected_key']!r} differ before their last "
                                "message; a pair shares its conversation and differs in the last reply only")
            for key, chat in zip((spec["chosen_key"], spec["rejected_key"]), chats):
                if chat[-1]["role"] != "assistant":
                    problems.append(f"the last message of {key!r} must be the assistant's reply")
    else:  # prompts, eval
        if present(spec["input_key"]):
            problems += _text_or_messages(row[spec["input_key"]], spec["input_key"])
        if spec["label_key"]:
            present(spec["label_key"])
        if spec.get("output_key") and present(spec["output_key"]):
            problems += _text(row[spec["output_key"]], spec["output_key"])
    return problems


def _jsonl_problems(role: str, spec: dict, path: Path) -> list[str]:
    """Each line's problems (JSON Lines end at "\n" only: U+2028 and the like may sit inside a JSON string)."""
    problems, kinds, rows = [], {}, 0
    for line_no, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            problems.append(f"{path}, line {line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x}); save the file "
                            "as UTF-8")
            continue
        if not line.strip():
            continue
        rows += 1
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"{path}, line {line_no}: not valid JSON ({err.msg}, column {err.colno})")
            continue
        found = row_problems(role, spec, row)
        if not found:  # Arrow, which `datasets` reads into, needs one type per column
            for key, value in row.items():
                kind = {list: "a list", dict: "an object", str: "text", bool: "true/false", int: "a number",
                        float: "a number"}.get(type(value), type(value).__name__)
                if value is not None and kinds.setdefault(key, (kind, line_no))[0] != kind:
                    found.append(f"{key!r} is {kind} here but {kinds[key][0]} on line {kinds[key][1]} "
                                 "(one type per key in a file)")
        problems += [f"{path}, line {line_no}: {p}" for p in found]
    return problems or ([] if rows else [f"{path}: no rows"])


def _table_batches(path: Path, spec: dict):
    """The rows of a CSV or Parquet file or a save_to_disk directory, a batch (a list of rows) at a time, read with
    pyarrow: never the whole file in memory, nothing written to the Hugging Face cache. A CSV's types are inferred
    as `datasets` infers them (an empty cell, NA or null: no value)."""
    import pyarrow
    if path.suffix == ".csv":
        import pyarrow.csv
        batches = pyarrow.csv.open_csv(path, convert_options=pyarrow.csv.ConvertOptions(strings_can_be_null=True))
    elif path.suffix == ".parquet":
        import pyarrow.parquet
        batches = pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=1024)
    else:
        batches = _saved_dataset_batches(path, spec)
    for batch in batches:
        yield batch.to_pylist()


def _saved_dataset_batches(path: Path, spec: dict):
    """The record batches of a `datasets` save_to_disk directory: a Dataset, or the `split` of a DatasetDict."""
    import pyarrow
    split = path / spec["split"] if (path / "dataset_dict.json").is_file() else path
    for entry in json.loads((split / "state.json").read_text())["_data_files"]:
        with pyarrow.memory_map(str(split / entry["filename"])) as source:
            yield from pyarrow.ipc.open_stream(source)


def _table_problems(role: str, spec: dict, path: Path) -> list[str]:
    first_line = 2 if path.suffix == ".csv" else 0  # a CSV's line 1 is its header
    where = (lambda i: f"line {i + first_line}") if first_line else (lambda i: f"row {i}")
    problems, rows = [], 0
    try:
        for batch in _table_batches(path, spec):
            problems += [f"{path}, {where(rows + i)}: {p}" for i, row in enumerate(batch)
                         for p in row_problems(role, spec, row)]
            rows += len(batch)
    except Exception as err:  # what pyarrow says of a file it cannot read, with the file named
        kind = FORMATS.get(path.suffix, "a datasets save_to_disk directory")
        problems.append(f"{path}: cannot be read as {kind} (after {rows} rows): {type(err).__name__}: {err}")
    return problems or ([] if rows else [f"{path}: no rows"])


def local_rows(spec: dict):
    """The rows of a local dataset file or directory in file order, read as check_datasets reads them (a JSON Lines
    line that is not JSON is left out): for looking at a few rows, or all of them, without holding them all."""
    path = repo_path(spec["path"])
    if path.suffix == ".json" and _starts_with(path, b"["):
        yield from json.loads(path.read_bytes())
    elif path.suffix in (".jsonl", ".json"):
        with path.open("rb") as fh:
            for line in fh:  # (split at "\n" only, as _jsonl_problems splits)
                try:
                    yield json.loads(line)
                except ValueError:  # blank, not JSON or not UTF-8
                    continue
    else:
        for batch in _table_batches(path, spec):
            yield from batch


def first_prompts(role: str, spec: dict, count: int, seed: int, builtin: dict) -> tuple[list[str], list]:
    """(inputs, labels) of the first `count` rows of a prompts or eval dataset, built in or local, that pass
    row_problems (among the first 100 of a local file): an input as written (a chat's as its last message's text;
    the template is preprocess's), labels None without a label_key."""
    if is_builtin(spec["path"]):
        from runtime.builtin_data import builtin_rows
        rows = builtin_rows(spec["path"], role, count, seed, builtin, lambda texts: texts)
    else:
        rows = [row for row in itertools.islice(local_rows(spec), 100) if not row_problems(role, spec, row)][:count]
    inputs = [row[spec["input_key"]] for row in rows]
    return ([text if isinstance(text, str) else text[-1]["content"] for text in inputs],
            [row[spec["label_key"]] if spec["label_key"] else None for row in rows])


def dataset_problems(role: str, spec: dict) -> list[str]:
    """Every problem of a local dataset of `role`, each naming the file and line (JSONL, CSV) or row."""
    path = repo_path(spec["path"])
    if not path.exists():
        return [f"data.{role}.path = {spec['path']!r}: no such file or directory (relative paths are taken from "
                "the repository root)"]
    if not path.is_file() and not path.is_dir():  # reading a named pipe would wait for a writer forever
        return [f"data.{role}.path = {spec['path']!r}: not a regular file or directory (a pipe or a device?)"]
    if path.is_file() and path.suffix not in FORMATS:
        return [f"data.{role}.path = {spec['path']!r}: unknown format; use {', '.join(FORMATS)} or a "
                "`datasets` save_to_disk directory"]
    if path.suffix == ".json" and _starts_with(path, b"["):  # one JSON array of rows, as `datasets` also reads it
        return _json_array_problems(role, spec, path)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_problems(role, spec, path)
    if path.suffix == ".csv" and (where := _not_utf8(path)):
        return [f"{path}, {where}: not UTF-8 text; save the file as UTF-8"]
    return _table_problems(role, spec, path)


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as fh:
        return fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(prefix)


def _not_utf8(path: Path) -> str | None:
    """Where a file stops being UTF-8 ("line N (byte 0x..)"), read a megabyte at a time; None if it is UTF-8."""
    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    with path.open("rb") as fh:
        while chunk := fh.read(2**20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                line += chunk[:err.start].count(b"\n")
                return f"line {line} (byte 0x{chunk[err.start]:02x})"
            line += chunk.count(b"\n")
    return None


def _json_array_problems(role: str, spec: dict, path: Path) -> list[str]:
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        return [f"{path}, {_not_utf8(path)}: not UTF-8 text; save the file as UTF-8"]
    except json.JSONDecodeError as err:
        return [f"{path}: a JSON array that is not valid JSON ({err.msg}, line {err.lineno}, column {err.colno})"]
    if not isinstance(rows, list):
        return [f"{path}: a .json file holds one array of rows, or one row per line (JSON Lines)"]
    problems = [f"{path}, row {i}: {p}" for i, row in enumerate(rows) for p in row_problems(role, spec, row)]
    return problems or ([] if rows else [f"{path}: no rows"])


def _fingerprint(role: str, spec: dict) -> str:
    """Changes when the file (size, modification time), or how it is read, changes."""
    path = repo_path(spec["path"])
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return hashlib.sha256(json.dumps([role, spec, stats], sort_keys=True).encode()).hexdigest()


def check_datasets(data: dict, cache_file: Path) -> None:
    """Check every row of every local dataset of the config's `data` block; raise DataError naming the bad rows
    (up to MAX_REPORTED, then how many more). A dataset that passed is remembered in `cache_file` by its files' sizes
    and modification times, so an unchanged rerun does not read it again."""
    passed = set(json.loads(cache_file.read_text())) if cache_file.is_file() else set()
    problems, newly_passed = [], []
    for role in ROLES:
        spec = data[role]
        if not spec["path"] or is_builtin(spec["path"]) or is_hub(spec["path"]):
            continue  # none, built in, or a hub dataset (checked where it is loaded)
        fingerprint = _fingerprint(role, spec) if repo_path(spec["path"]).exists() else None
        if fingerprint in passed:
            continue
        found = dataset_problems(role, spec)
        problems += found
        if not found:
            newly_passed.append(fingerprint)
    if newly_passed:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(sorted(passed | set(newly_passed))))
    if problems:
        shown = problems[:MAX_REPORTED]
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise DataError(f"{len(problems)} bad rows or files in the experiment's datasets:\n  "
                        + "\n  ".join(shown) + more)


def count_rows(path: Path, spec: dict) -> int | None:
    """Rows in a local dataset file or save_to_disk directory, counted without loading it; None for a format this
    does not know (left to the preprocess stage)."""
    try:
        if path.is_file() and path.suffix in (".jsonl", ".json"):  # one row a line, as check_datasets reads them
            with path.open("rb") as fh:
                return sum(1 for line in fh if line.strip())
        if path.is_file() and path.suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as fh:
                return max(0, sum(1 for row in csv.reader(fh) if row) - 1)  # less the header
        if path.is_file() and path.suffix == ".parquet":
            import pyarrow.parquet
            return pyarrow.parquet.read_metadata(path).num_rows
        if path.is_dir():  # a `datasets` save_to_disk directory: a Dataset, or a DatasetDict of splits
            return sum(batch.num_rows for batch in _saved_dataset_batches(path, spec))
    except Exception:  # a format the count does not know: left to the preprocess stage
        return None
    return None
