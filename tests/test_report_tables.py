"""Tables and figures of the report from hand-made runs: aggregation over seeds, formats, provenance."""
import csv
import io
import json

import pytest
from PIL import Image

from reports import figures, stats, tables
from stages.report import Config


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


def test_paired_bootstrap_p_values():
    a = [1.0] * 50
    b = [0.0] * 45 + [1.0] * 5
    assert stats.paired_bootstrap(b, b) == 1.0  # every resampled difference is 0: no evidence either way
    assert stats.paired_bootstrap(a, b) < 0.01 and stats.paired_bootstrap(b, a) < 0.01  # two-sided
    assert stats.paired_bootstrap(a, b, seed=3) == stats.paired_bootstrap(a, b, seed=3)
    with pytest.raises(ValueError, match="50 scores against 49"):
        stats.paired_bootstrap(a, b[:49])


def test_standard_error_by_hand():
    assert stats.standard_error([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.6454972244, rel=1e-9)  # sqrt(5/3) / 2
    assert stats.standard_error([0.5]) is None


def fake_bench_run(model, seed, bench, scores, run_id):
    """A benchmark run with each problem's mean sample score; gsm8k samples 4 times and votes, math_500 once."""
    n = 4 if bench == "gsm8k" else 1
    metrics = {f"avg_at_{n}": sum(scores) / len(scores), "num_problems": len(scores), "response_length": 20.0}
    if bench == "gsm8k":
        metrics |= {"pass_at_4": sum(s > 0 for s in scores) / len(scores), "maj_at_4": sum(s > 0.5 for s in scores)
                    / len(scores)}
    params = {"model": model, "name": bench, "seed": str(seed)}  # (a job's params that the table reads)
    return {"method": model, "seed": seed, "run_id": run_id, "run_name": f"benchmark/{bench}/{model}/seed{seed}",
            "config_hash": f"hash{run_id}", "git_commit": "c0ffee", "params": params, "metrics": metrics,
            "history": {}}


SAMPLING = {"temperature": 0.7, "top_p": 1.0, "max_new_tokens": 256, "lm_eval": None}
BENCHMARKS = {"gsm8k": {"n_samples": 4, "pass_k": [1, 4], "scorer": "math"} | SAMPLING,
              "math_500": {"n_samples": 1, "pass_k": [], "scorer": "rewards/my_scorer.py"} | SAMPLING}
WEAK = [0.0, 0.25, 0.5] * 10  # 30 problems: the base model; sft scores the same
STRONG = [0.75, 1.0, 1.0] * 10
BENCH_SCORES = {("base", 0): WEAK, ("sft", 0): WEAK, ("grpo", 0): STRONG, ("grpo", 1): [1.0, 0.75, 0.75] * 10}
BENCH_RUNS = [fake_bench_run(model, seed, bench, scores, f"{bench}-{model}-{seed}")
              for bench in BENCHMARKS for (model, seed), scores in BENCH_SCORES.items()]
PROBLEM_SCORES = {r["run_id"]: BENCH_SCORES[r["method"], r["seed"]] for r in BENCH_RUNS}


def bench_table():
    columns = tables.benchmark_columns(BENCHMARKS, BENCH_RUNS)
    return tables.benchmark_rows(BENCH_RUNS, PROBLEM_SCORES, ["base", "sft", "grpo"], "base", columns), columns


def test_benchmark_table_cells_significance_and_formats():
    rows, columns = bench_table()
    assert [title for _, _, title, _ in columns] == ["gsm8k avg@4", "gsm8k pass@4", "gsm8k maj@4", "math_500 avg@1"]
    assert [(r["method"], r["n"], r["baseline"]) for r in rows] == [("base", 1, True), ("sft", 1, False),
                                                                     ("grpo", 2, False)]
    assert rows[1]["p"] == {"gsm8k": 1.0, "math_500": 1.0} and rows[2]["p"]["gsm8k"] < 0.05
    mean, std, se = rows[2]["gsm8k", "avg_at_4"]
    assert (mean, std, se) == pytest.approx((0.875, 0.0589255651, 0.0416666667))  # 11/12 and 10/12, by hand
    md = tables.benchmark_markdown(rows, columns)
    assert "| gsm8k avg@4 | gsm8k pass@4 | gsm8k maj@4 | math_500 avg@1 |" in md
    assert "| base (baseline) | 1 | 0.250 | 0.667 | 0.000 | 0.250 |" in md
    assert "| sft | 1 | 0.250 | 0.667 | 0.000 | 0.250 |" in md  # equal to the baseline: no †
    assert "| grpo | 2 | 0.875 ± 0.059 (SE 0.042)† | 1.000 ± 0.000 (SE 0.000) |" in md
    assert len(md.splitlines()) == 5 and md.count("†") == 2  # a row per model; the mark on avg@n only
    note = tables.benchmark_note(BENCHMARKS, columns, "base")
    assert "gsm8k: 4 samples per problem at temperature 0.7, top_p 1.0, max_new_tokens 256, scorer math" in note
    assert "math_500: 1 sample per problem" in note and "baseline's (base)" in note
    assert "paired bootstrap over problems (10,000 resamples" in note
    parsed = list(csv.DictReader(io.StringIO(tables.benchmark_csv(rows, columns, SOURCE))))
    assert [(r["method"], r["baseline"]) for r in parsed] == [("base", "True"), ("sft", "False"), ("grpo", "False")]
    assert parsed[0]["gsm8k_p_value"] == "" and float(parsed[1]["math_500_p_value"]) == 1.0
    assert float(parsed[2]["gsm8k_avg_at_4_mean"]) == rows[2]["gsm8k", "avg_at_4"][0]
    assert parsed[0]["gsm8k_avg_at_4_std"] == "" and float(parsed[2]["gsm8k_avg_at_4_stderr"]) == se
    assert parsed[2]["mlflow_run_ids"] == "gsm8k-grpo-0 gsm8k-grpo-1 math_500-grpo-0 math_500-grpo-1"


def test_benchmark_latex_escapes_headers_and_marks():
    rows, columns = bench_table()
    caption = tables.latex_escape(tables.benchmark_note(BENCHMARKS, columns, "base"))
    tex = tables.benchmark_latex(rows, columns, caption, "tab:benchmarks", SOURCE)
    assert "method & seeds & gsm8k avg@4 & gsm8k pass@4 & gsm8k maj@4 & math\\_500 avg@1 \\\\" in tex
    assert "base (baseline) & 1 & $0.250$" in tex
    assert "grpo & 2 & $0.875 \\pm 0.059\\ (\\mathrm{SE}\\ 0.042)^{\\dagger}$" in tex
    assert "rewards/my\\_scorer.py" in caption and "$\\pm$ is the std" in caption and "p $<$ 0.05" in caption
    assert "$^\\dagger$: avg@n differs" in caption and "% git commit: c0ffee" in tex


def test_benchmark_rows_need_each_model_on_each_benchmark():
    columns = tables.benchmark_columns(BENCHMARKS, BENCH_RUNS)
    with pytest.raises(ValueError, match="no benchmark run of dpo on gsm8k"):
        tables.benchmark_rows(BENCH_RUNS, PROBLEM_SCORES, ["base", "dpo"], "base", columns)


def test_validation_curves_drawn(tmp_path):
    runs = [fake_run("grpo", seed, 0.5, 1.0, f"v{seed}") for seed in (0, 1)] + [fake_run("ppo", 0, 0.3, 1.0, "v2")]
    for i, run in enumerate(runs):
        run["history"]["eval_reward"] = [(0, 0.1), (10, 0.4 + 0.1 * i), (20, 0.35), (25, 0.5)]
        run["metrics"] |= {"best_step": 25.0 if i else 10.0, "best_eval_reward": 0.5 if i else 0.4}
    paths = [tmp_path / "validation_curves.png", tmp_path / "validation_curves.pdf"]
    figures.validation_curves(runs, paths, metadata=json.dumps(SOURCE))
    assert all(path.stat().st_size > 0 for path in paths) and Image.open(paths[0]).size[0] > 300


def test_report_config_reads_benchmarks_and_baseline():
    params = {"evaluate": {"models": ["sft", "dpo"], "rewards": [], "baseline": None}, "model": {}, "data": {},
              "stages": {}, "given": {}, "variants": {}}
    assert (Config.from_params(params).baseline, Config.from_params(params).benchmarks) == ("sft", {})
    params |= {"benchmarks": BENCHMARKS, "evaluate": params["evaluate"] | {"baseline": "dpo"}}
    assert (Config.from_params(params).baseline, Config.from_params(params).benchmarks) == ("dpo", BENCHMARKS)
