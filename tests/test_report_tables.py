"""Tables and figures of the report from hand-made runs: aggregation over seeds, formats, provenance."""
import csv
import io
import json

import pytest
from PIL import Image

from reports import figures, tables


def fake_run(method, seed, reward, kl, run_id):
    return {"method": method, "seed": seed, "run_id": run_id, "run_name": f"evaluate/{method}/seed{seed}",
            "config_hash": f"hash{run_id}", "git_commit": "c0ffee",
            "metrics": {"reward_mean": reward, "reward_sentiment": reward, "kl_to_reference": kl, "perplexity": 9.0,
                        "response_length": 12.0},
            "history": {"reward_mean": [(1, reward - 0.1), (2, reward)], "loss": [(1, 1.0), (2, 0.5)]}}


RUNS = [fake_run("sft", 0, 0.10, 1.0, "a"), fake_run("grpo", 0, 0.30, 2.0, "b"), fake_run("grpo", 1, 0.50, 4.0, "c")]
COLUMNS = tables.eval_columns(["sentiment"])
KEYS = [key for key, _, _ in COLUMNS]
SOURCE = {"mlflow_runs": [{"run_name": r["run_name"], "run_id": r["run_id"], "config_hash": r["config_hash"]}
                          for r in RUNS], "git_commits": ["c0ffee"], "config_hashes": ["hasha", "hashb", "hashc"]}


def test_summarise_gives_mean_and_sample_std_per_method_in_order():
    rows = tables.summarise(RUNS, KEYS)
    assert [(r["method"], r["n"]) for r in rows] == [("sft", 1), ("grpo", 2)]
    assert rows[0]["reward_sentiment"] == (0.10, None)
    mean, std = rows[1]["reward_sentiment"]
    assert mean == pytest.approx(0.40) and std == pytest.approx(0.1414213562, rel=1e-9)  # sqrt(0.02) by hand
    assert rows[1]["kl_to_reference"][0] == pytest.approx(3.0)


def test_markdown_latex_and_csv_show_the_same_numbers():
    rows = tables.summarise(RUNS, KEYS)
    md = tables.markdown(rows, COLUMNS)
    assert "| sft | 1 | 0.100 |" in md and "| grpo | 2 | 0.400 ± 0.141 |" in md
    tex = tables.latex(rows, COLUMNS, "cap", "tab:x", SOURCE)
    assert "grpo & 2 & $0.400 \\pm 0.141$" in tex and "\\begin{tabular}" in tex
    assert "% git commit: c0ffee" in tex and "%   evaluate/grpo/seed1 c hashc" in tex
    parsed = list(csv.DictReader(io.StringIO(tables.csv_text(rows, COLUMNS, SOURCE))))
    assert [r["method"] for r in parsed] == ["sft", "grpo"]
    assert float(parsed[1]["reward_sentiment_mean"]) == rows[1]["reward_sentiment"][0]
    assert parsed[0]["reward_sentiment_std"] == "" and parsed[1]["mlflow_run_ids"] == "b c"


def test_latex_escapes_names():
    assert tables.latex_escape("kl_to_base 5% ↑") == "kl\\_to\\_base 5\\% $\\uparrow$"


@pytest.mark.parametrize("draw", [figures.reward_vs_step, figures.kl_reward_frontier, figures.training_curves])
def test_figures_are_png_and_pdf_carrying_their_provenance(tmp_path, draw):
    paths = [tmp_path / "fig.png", tmp_path / "fig.pdf"]
    draw(RUNS, paths, metadata=json.dumps(SOURCE))
    image = Image.open(paths[0])
    assert image.size[0] > 300 and json.loads(image.text["Description"]) == SOURCE
    pdf = paths[1].read_bytes()
    assert pdf.startswith(b"%PDF") and b"Subject" in pdf
