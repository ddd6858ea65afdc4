"""Stage `report`: a Markdown table of every evaluated model, the reward model's accuracy, and a PNG of the
training curves.

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/report
"""
import dataclasses
import json
from pathlib import Path

from reports import figures, tables
from stages import data

USES_RAY = False
TEMPLATE = Path(__file__).resolve().parent.parent / "reports" / "report_template.md"


@dataclasses.dataclass
class Config:
    models: list

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        return cls(models=params["evaluate"]["models"])


def run(cfg: Config, inputs: dict, output: Path, run) -> None:
    evaluations = [json.loads((d / "metrics.json").read_text()) for d in inputs["evaluations"]]
    trained = [*inputs["training"], inputs["reward_model"], *inputs["rl"]]
    curves = {(f"rl/{d.name}" if d.parent.name == "rl" else d.name): data.read_jsonl(d / "train_log.jsonl")
              for d in trained}
    rl_runs = [json.loads((d / "metrics.json").read_text()) for d in inputs["rl"]]
    reward_model = json.loads((inputs["reward_model"] / "metrics.json").read_text())
    figures.training_curves(curves, output / "training_curves.png")
    last_dir = inputs["evaluations"][-1]
    samples = data.read_jsonl(last_dir / "samples.jsonl")[:4]
    text = TEMPLATE.read_text().format(
        experiment=output.parent.name,  # results/<experiment>/report
        num_prompts=evaluations[0]["num_prompts"],
        table=tables.markdown_table(evaluations),
        rm_accuracy=reward_model["eval_accuracy"], rm_pairs=reward_model["eval_pairs"],
        rm_mean=reward_model["reward_mean"], rm_std=reward_model["reward_std"],
        rl_table=tables.rl_table(rl_runs),
        sample_model=evaluations[-1]["model"],
        samples="\n".join(f"- *{s['opening']}* → {s['completion'].strip()!r} (reward {s['reward']:.2f})" for s in samples),
    )
    (output / "report.md").write_text(text)
    provenance = {str(d): json.loads((d / "stage.json").read_text()).get("mlflow_run_id")
                  for d in [*inputs["evaluations"], *trained]}
    (output / "provenance.json").write_text(json.dumps(provenance, indent=2))
    for name in ("report.md", "training_curves.png"):
        run.log_artifact(output / name)
    print(f"[report] {output / 'report.md'}", flush=True)
    print(tables.markdown_table(evaluations), flush=True)
    run.log_metrics({"reward_model_accuracy": reward_model["eval_accuracy"]})
