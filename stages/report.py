"""Stage `report`: the paper's tables and figures, read from MLflow.

Every input stage directory names its MLflow run (stage.json); the numbers come from those runs, not from
side files. Methods run once per seed of the grid are shown as mean ± std over seeds. Outputs:
  results.{md,tex,csv}            held-out evaluation, one row per model of evaluate.models
  rl.{md,tex,csv}                 RL runs, one row per rl variant
  reward_vs_step.{png,pdf}        training reward against RL step, a line per variant and a band over seeds
  kl_reward_frontier.{png,pdf}    held-out reward against KL to the base model, per model and seed
  training_curves.{png,pdf}       training losses of every trained stage
  report.md                       all of the above with samples; provenance.json: where each came from

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/report
"""
import dataclasses
import json
import tempfile
from pathlib import Path

from reports import figures, tables

USES_RAY = False
TEMPLATE = Path(__file__).resolve().parent.parent / "reports" / "report_template.md"


@dataclasses.dataclass
class Config:
    models: list

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(models=params["evaluate"]["models"])


def tracked_run(client, stage_dir: Path, histories: tuple[str, ...] = ()) -> dict:
    """The MLflow run that produced `stage_dir`: name, method, seed, metrics, provenance, metric histories."""
    run_id = json.loads((stage_dir / "stage.json").read_text())["mlflow_run_id"]
    found = client.get_run(run_id)
    params, tags = found.data.params, found.data.tags
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in histories}
    return {"run_id": run_id, "run_name": found.info.run_name,
            "method": params.get("model") or params.get("variant") or tags["alignpipe.stage"],
            "seed": int(params["seed"]) if "seed" in params else None,
            "metrics": dict(found.data.metrics), "history": history,
            "git_commit": tags.get("git.commit", "unknown"), "config_hash": tags.get("alignpipe.config_hash", "")}


def provenance(runs: list[dict]) -> dict:
    return {"mlflow_runs": [{k: r[k] for k in ("run_name", "run_id", "config_hash")} for r in runs],
            "git_commits": sorted({r["git_commit"] for r in runs}),
            "config_hashes": sorted({r["config_hash"] for r in runs})}


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    client = tracker.client
    evaluations = [tracked_run(client, d) for d in inputs["evaluations"]]
    rl_runs = [tracked_run(client, d, ("reward_mean", "kl", "policy_loss")) for d in inputs["rl"]]
    trained = [tracked_run(client, d, ("loss",)) for d in [inputs["sft"], inputs["reward_model"], *inputs["dpo"]]]
    reward_model = next(r for r in trained if r["method"] == "reward_model")
    sources = {}

    eval_rows = tables.summarise(evaluations, [key for key, _, _ in tables.EVAL_COLUMNS])
    rl_rows = tables.summarise(rl_runs, [key for key, _, _ in tables.RL_COLUMNS])
    for name, rows, columns, runs, caption in (
            ("results", eval_rows, tables.EVAL_COLUMNS, evaluations,
             "Held-out evaluation; mean $\\pm$ std over seeds where a method ran with several."),
            ("rl", rl_rows, tables.RL_COLUMNS, rl_runs, "RL runs; mean $\\pm$ std over seeds.")):
        source = provenance(runs)
        (output / f"{name}.md").write_text(tables.markdown(rows, columns) + "\n\n" + tables.source_line(source) + "\n")
        (output / f"{name}.tex").write_text(tables.latex(rows, columns, caption, f"tab:{name}", source))
        (output / f"{name}.csv").write_text(tables.csv_text(rows, columns, source))
        sources |= {f"{name}.{ext}": source for ext in ("md", "tex", "csv")}

    for name, draw, runs in (("reward_vs_step", figures.reward_vs_step, rl_runs),
                             ("kl_reward_frontier", figures.kl_reward_frontier, evaluations),
                             ("training_curves", figures.training_curves, trained + rl_runs)):
        source = provenance(runs)
        draw(runs, [output / f"{name}.png", output / f"{name}.pdf"], metadata=json.dumps(source))
        sources |= {f"{name}.{ext}": source for ext in ("png", "pdf")}

    last = evaluations[-1]
    with tempfile.TemporaryDirectory() as tmp:
        samples_path = client.download_artifacts(last["run_id"], "samples.jsonl", tmp)
        samples = [json.loads(line) for line in Path(samples_path).read_text().splitlines()][:4]
    text = TEMPLATE.read_text().format(
        experiment=output.parent.name,  # results/<experiment>/report
        num_prompts=int(evaluations[0]["metrics"]["num_prompts"]),
        table=tables.markdown(eval_rows, tables.EVAL_COLUMNS),
        rm_accuracy=reward_model["metrics"]["eval_accuracy"], rm_pairs=int(reward_model["metrics"]["eval_pairs"]),
        rm_mean=reward_model["metrics"]["reward_mean"], rm_std=reward_model["metrics"]["reward_std"],
        rl_table=tables.markdown(rl_rows, tables.RL_COLUMNS),
        sample_model=last["run_name"].removeprefix("evaluate/"),
        samples="\n".join(f"- *{s['opening']}* → {s['completion'].strip()!r} (reward {s['reward']:.2f})" for s in samples),
        source=tables.source_line(provenance(evaluations + rl_runs + trained)),
    )
    (output / "report.md").write_text(text)
    (output / "provenance.json").write_text(json.dumps(sources, indent=2))
    for path in sorted(output.iterdir()):
        tracker.log_artifact(path)
    tracker.log_metrics({"reward_model_accuracy": reward_model["metrics"]["eval_accuracy"]})
    print(f"[report] {output / 'report.md'}", flush=True)
    print(tables.markdown(eval_rows, tables.EVAL_COLUMNS), flush=True)
