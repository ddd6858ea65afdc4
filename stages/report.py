"""Stage `report`: the paper's tables and figures, read from MLflow.

Every input stage directory names its MLflow run (stage.json); the numbers come from those runs, not from
side files. Methods run once per seed of the grid are shown as mean ± std over seeds. Outputs:
  results.{md,tex,csv}            held-out evaluation, one row per model of evaluate.models
  rl.{md,tex,csv}                 RL runs, one row per rl variant
  benchmarks.{md,tex,csv}         test benchmarks, one row per model of evaluate.models, with significance against
                                  evaluate.baseline (when the experiment has benchmarks)
  reward_vs_step.{png,pdf}        training reward against RL step, a line per variant and a band over seeds
  validation_curves.{png,pdf}     held-out validation reward against RL step (when rl.eval_every was set)
  kl_reward_frontier.{png,pdf}    held-out reward against KL to the base model, per model and seed
  training_curves.{png,pdf}       training losses of every trained stage
  report.md                       all of the above with samples; provenance.json: where each came from

    .venv/bin/snakemake --profile cluster_profiles/local results/<experiment>/report
"""
import ast
import dataclasses
import functools
import json
import statistics
import tempfile
from pathlib import Path

from reports import figures, tables
from runtime.rewards import is_remote, reward_name
from runtime.user_data import repo_path

USES_RAY = False
TEMPLATE = repo_path("reports/report_template.md")


@dataclasses.dataclass
class Config:
    """What the report shows (evaluate.models, evaluate.rewards, the benchmarks and the baseline their tests compare
    against) and what its prose describes (model, data, the stages the DAG holds and the given models, each rl
    variant's settings merged over the rl block by the rule)."""
    models: list
    rewards: list
    benchmarks: dict  # name -> settings (n_samples, pass_k, ...); {} for none
    baseline: str  # the model of `models` the benchmark table's significance tests compare against
    model: dict
    data: dict
    stages: dict  # sft, reward_model, dpo: in the DAG or not (launcher/config.dag_stages)
    given: dict  # sft, reward_model: the `from` directory, or None
    variants: dict

    @classmethod
    def from_params(cls, params: dict) -> "Config":
        evaluate = params["evaluate"]
        return cls(models=evaluate["models"], rewards=evaluate["rewards"], benchmarks=params.get("benchmarks", {}),
                   baseline=evaluate.get("baseline") or evaluate["models"][0], model=params["model"],
                   data=params["data"], stages=params["stages"], given=params["given"], variants=params["variants"])


def describe_reward(reward: str | None, teacher: str | None = None) -> str:
    """`model`, or a reward file's path with the first line of its docstring; None (an rl variant's reward with an
    environment or a teacher): the environment's step rewards; the judge; a reward service; and a variant's teacher."""
    if teacher:
        return f"the teacher {teacher}'s per-token log-ratio" + (f" plus {describe_reward(reward)}" if reward else "")
    if reward is None:
        return "the environment's step rewards"
    if reward == "model":
        return "the reward model's score"
    if reward == "judge":
        return "an LLM judge's score (the `judge` block)"
    if is_remote(reward):
        return f"the reward service at {reward}"
    doc = ast.get_docstring(ast.parse(repo_path(reward).read_text())) or ""
    return f"`{reward}`" + (f": {doc.splitlines()[0]}" if doc else "")


def describe_experiment(cfg: Config) -> str:
    """The experiment in a few sentences, from its config: each stage trained, given or absent."""
    data = cfg.data
    sft_data, pairs, prompts = (f"`{data[role]['path']}`" for role in ("sft", "preference", "prompts"))

    def stage(name: str, trained: str, absent: str) -> str:
        if cfg.given.get(name) and cfg.stages[name]:
            return f"given (`{cfg.given[name]}`, not trained)"
        return trained if cfg.stages[name] else absent

    def reward(settings: dict) -> str:
        named = settings["reward"] or ("" if settings.get("teacher") else "of the environment")
        taught = f"the teacher {settings['teacher']}'s log-ratio" if settings.get("teacher") else ""
        return " plus ".join(part for part in (taught, named) if part)

    variants = ", ".join(f"{name} ({settings['estimator']}, reward {reward(settings)})"
                         for name, settings in cfg.variants.items())
    template = "go through the model's chat template" if data["apply_chat_template"] \
        else f"follow the template {data['input_template']!r}"
    return (f"Base model `{cfg.model['path'] or cfg.model['source']}`. "
            f"SFT model: {stage('sft', f'trained on {sft_data}', 'none (no SFT dataset): the methods start from the base model')}. "
            f"Reward model: {stage('reward_model', f'trained on the pairs of {pairs}', 'none (nothing scores with it)')}. "
            f"DPO: {f'on the pairs of {pairs}' if cfg.stages['dpo'] else 'none'}. "
            f"RL: {f'on the prompts of {prompts}: {variants}' if cfg.variants else 'none'}. Prompts {template}.")


def describe_stages(cfg: Config) -> str:
    """Which stages the DAG held, which were given and which were absent."""
    held = ["base_model", "preprocess"] + [s for s in ("sft", "reward_model", "dpo") if cfg.stages[s]] + \
        (["rl (" + ", ".join(cfg.variants) + ")"] if cfg.variants else []) + ["evaluate", "report"]
    absent = [s for s in ("sft", "reward_model", "dpo") if not cfg.stages[s]] + ([] if cfg.variants else ["rl"])
    given = [f"{s} (`{cfg.given[s]}`)" for s in ("sft", "reward_model") if cfg.given.get(s) and cfg.stages[s]]
    return (f"Stages: {', '.join(held)}" + (f"; given, not trained: {', '.join(given)}" if given else "")
            + (f"; not in this experiment: {', '.join(absent)}" if absent else "") + ".")


def tracked_run(client, stage_dir: Path, histories: tuple[str, ...] = ()) -> dict:
    """The MLflow run that produced `stage_dir`: name, method, seed, params, metrics, provenance, metric histories."""
    run_id = json.loads((stage_dir / "stage.json").read_text())["mlflow_run_id"]
    found = client.get_run(run_id)
    params, tags = found.data.params, found.data.tags
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in histories}
    return {"run_id": run_id, "run_name": found.info.run_name, "given": tags.get("alignpipe.given_model"),
            "method": params.get("model") or params.get("variant") or tags["alignpipe.stage"],
            "seed": int(params["seed"]) if "seed" in params else None,
            "params": dict(params), "metrics": dict(found.data.metrics), "history": history,
            "git_commit": tags.get("git.commit", "unknown"), "config_hash": tags.get("alignpipe.config_hash", "")}


def problem_scores(client, runs: list[dict]) -> dict[str, list[float]]:
    """Each benchmark run's per-problem scores (the mean over the problem's samples), by run id, from its
    samples.jsonl artifact. The significance tests pair problems, so every run of a benchmark must list the same ones
    in the same order."""
    scores, ids = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in runs:  # (each download replaces the last in tmp: read before the next)
            problems = [json.loads(line) for line in
                        Path(client.download_artifacts(r["run_id"], "samples.jsonl", tmp)).read_text().splitlines()]
            scores[r["run_id"]] = [statistics.fmean(p["scores"]) for p in problems]
            if [p["id"] for p in problems] != ids.setdefault(r["params"]["name"], [p["id"] for p in problems]):
                raise ValueError(f"{r['run_name']}: its samples.jsonl has other problems, or another order, than the "
                                 f"first run of benchmark {r['params']['name']}; the paired tests need the same")
    return scores


def provenance(runs: list[dict]) -> dict:
    return {"mlflow_runs": [{k: r[k] for k in ("run_name", "run_id", "config_hash")} for r in runs],
            "git_commits": sorted({r["git_commit"] for r in runs}),
            "config_hashes": sorted({r["config_hash"] for r in runs})}


def run(cfg: Config, inputs: dict, output: Path, tracker) -> None:
    client = tracker.client
    evaluations = [tracked_run(client, d) for d in inputs["evaluations"]]
    rl_runs = [tracked_run(client, d, ("reward_mean", "kl", "policy_loss", "eval_reward")) for d in inputs["rl"]]
    benchmark_runs = [tracked_run(client, d) for d in inputs.get("benchmarks", [])]  # (none in older experiments)
    trained = [tracked_run(client, d, ("loss",)) for d in [*inputs["sft"], *inputs["reward_model"], *inputs["dpo"]]]
    reward_model = next((r for r in trained if r["method"] == "reward_model"), None)
    tracker.set_tags({"alignpipe.dag": json.dumps({"stages": cfg.stages, "given": cfg.given,
                                                   "variants": list(cfg.variants)}, sort_keys=True)})
    sources, tables_written = {}, []

    episodes = bool(evaluations) and all("env_success" in r["metrics"] for r in evaluations)
    eval_columns = [c for c in tables.eval_columns([reward_name(r) for r in cfg.rewards], episodes)
                    if all(c[0] in r["metrics"] for r in evaluations)]  # (no perplexity without SFT data)
    eval_rows = tables.summarise(evaluations, [key for key, _, _ in eval_columns])
    rl_rows = tables.summarise(rl_runs, [key for key, _, _ in tables.RL_COLUMNS])
    for name, rows, columns, runs, caption in (
            ("results", eval_rows, eval_columns, evaluations,
             "Held-out evaluation; mean $\\pm$ std over seeds where a method ran with several."),
            ("rl", rl_rows, tables.RL_COLUMNS, rl_runs, "RL runs; mean $\\pm$ std over seeds.")):
        if not runs:
            continue
        source = provenance(runs)
        (output / f"{name}.md").write_text(tables.markdown(rows, columns) + "\n\n" + tables.source_line(source) + "\n")
        (output / f"{name}.tex").write_text(tables.latex(rows, columns, caption, f"tab:{name}", source))
        (output / f"{name}.csv").write_text(tables.csv_text(rows, columns, source))
        sources |= {f"{name}.{ext}": source for ext in ("md", "tex", "csv")}
        tables_written.append(name)

    bench_columns = tables.benchmark_columns(cfg.benchmarks, benchmark_runs)
    if bench_columns:
        bench_rows = tables.benchmark_rows(benchmark_runs, problem_scores(client, benchmark_runs), cfg.models,
                                           cfg.baseline, bench_columns)
        bench_note = tables.benchmark_note(cfg.benchmarks, bench_columns, cfg.baseline)
        source = provenance(benchmark_runs)
        (output / "benchmarks.md").write_text(tables.benchmark_markdown(bench_rows, bench_columns) + "\n\n"
                                              + bench_note + "\n\n" + tables.source_line(source) + "\n")
        (output / "benchmarks.tex").write_text(tables.benchmark_latex(
            bench_rows, bench_columns, tables.latex_escape(bench_note), "tab:benchmarks", source))
        (output / "benchmarks.csv").write_text(tables.benchmark_csv(bench_rows, bench_columns, source))
        sources |= {f"benchmarks.{ext}": source for ext in ("md", "tex", "csv")}
        tables_written.append("benchmarks")

    figures_drawn = []
    # eval_reward at more steps than the first and the last only where rl.eval_every was set
    validated = any(len(r["history"]["eval_reward"]) > 2 for r in rl_runs)
    for name, draw, runs in (("reward_vs_step", figures.reward_vs_step, rl_runs),
                             ("validation_curves", figures.validation_curves, rl_runs if validated else []),
                             ("kl_reward_frontier", functools.partial(figures.kl_reward_frontier,
                                                                      reward=reward_name((cfg.rewards or [""])[0])),
                              evaluations if cfg.rewards else []),  # (evaluate.rewards may be empty: no frontier)
                             ("training_curves", figures.training_curves, trained + rl_runs)):
        if not runs:
            continue
        source = provenance(runs)
        draw(runs, [output / f"{name}.png", output / f"{name}.pdf"], metadata=json.dumps(source))
        sources |= {f"{name}.{ext}": source for ext in ("png", "pdf")}
        figures_drawn.append(name)

    last = evaluations[-1]
    with tempfile.TemporaryDirectory() as tmp:
        samples_path = client.download_artifacts(last["run_id"], "samples.jsonl", tmp)
        samples = [json.loads(line) for line in Path(samples_path).read_text().splitlines()][:4]
    sections = ""
    if reward_model:
        rm, given = reward_model["metrics"], reward_model["given"]
        sections += "\n## Reward model\n\n" + (
            f"Held-out pairwise accuracy **{rm['eval_accuracy']:.3f}** on {int(rm['eval_pairs'])} pairs (chance is 0.5; "
            f"{rm['eval_accuracy_before']:.3f} before training); its rewards have mean {rm['reward_mean']:.3f} and "
            f"std {rm['reward_std']:.3f}." if not given else
            f"Given (`{given}`): held-out pairwise accuracy **{rm['eval_accuracy']:.3f}** on {int(rm['eval_pairs'])} "
            f"pairs; rewards mean {rm['reward_mean']:.3f}, std {rm['reward_std']:.3f}.") + "\n"
        tracker.log_metrics({"reward_model_accuracy": rm["eval_accuracy"]})
    if rl_runs:
        start = "SFT policy" if cfg.stages["sft"] else "base model"
        sections += (f"\n## RL\n\nThe RL reward ({', '.join(sorted({describe_reward(v['reward'], v.get('teacher')) for v in cfg.variants.values()}))}) "
                     f"on held-out prompts, for the {start} each run starts from and for the trained policy.\n\n"
                     + tables.markdown(rl_rows, tables.RL_COLUMNS) + "\n")
    if bench_columns:
        sections += (f"\n## Benchmarks\n\nEvery model on the test benchmarks, each problem sampled n times; † marks an "
                     f"avg@n that differs from the baseline's ({cfg.baseline}).\n\n"
                     + tables.benchmark_markdown(bench_rows, bench_columns) + "\n\n" + bench_note + "\n")
    if figures_drawn:
        titles = {"reward_vs_step": "reward against RL step", "kl_reward_frontier": "reward against KL to the base model",
                  "training_curves": "training curves", "validation_curves": "validation reward against RL step"}
        sections += "\n" + "\n".join(f"![{titles[name]}]({name}.png)" for name in figures_drawn) + "\n"
    text = TEMPLATE.read_text().format(
        experiment=output.parent.name,  # results/<experiment>/report
        description=describe_experiment(cfg),
        stages=describe_stages(cfg),
        num_prompts=int(evaluations[0]["metrics"]["num_prompts"]),
        eval_source=f"`{cfg.data['eval']['path']}`" if cfg.data["eval"]["path"]
        else f"the prompts held out of `{cfg.data['prompts']['path']}`",
        reward_list="Rewards (a column each; the first is the figures'):\n" + "\n".join(
            f"- {reward_name(r)}: {describe_reward(r)}" for r in cfg.rewards) if cfg.rewards else "No rewards "
        "(evaluate.rewards is empty).",
        perplexity="perplexity is on the held-out SFT responses." if any(c[0] == "perplexity" for c in eval_columns)
        else "no perplexity (the experiment has no SFT dataset).",
        table=tables.markdown(eval_rows, eval_columns),
        sections=sections,
        rl_files="".join(f", `{name}.*`" for name in tables_written if name != "results"),
        sample_model=last["run_name"].removeprefix("evaluate/"),
        samples="\n".join(f"- *{s['input']}* → {s['completion'].strip()!r}"
                          + (f" (reward {s['reward']:.2f})" if s["reward"] is not None else "") for s in samples),
        source=tables.source_line(provenance(evaluations + rl_runs + trained + benchmark_runs)),
    )
    (output / "report.md").write_text(text)
    (output / "provenance.json").write_text(json.dumps(sources, indent=2))
    for path in sorted(output.iterdir()):
        tracker.log_artifact(path)
    print(f"[report] {output / 'report.md'}", flush=True)
    print(tables.markdown(eval_rows, eval_columns), flush=True)
