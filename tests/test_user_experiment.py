"""A new user's experiments, with none of the packaged data: their own model directory (tiny random Qwen2, GPT-2 and
Mistral models, built and saved here as a user has them), their SFT, preference, RL-prompt and eval files, their
reward file. Every stage through a Qwen2 chat model; the three experiments of config/ (README, "Your own model and
data"), each holding only its stages: RL with a verifiable reward on a given instruct model (built-in arithmetic,
tiny Mistral) and the full RLHF chain (GPT-2, a base model) run; SFT then DPO on the user's pairs is planned, its
stages being the Qwen2 run's; then an experiment started from an SFT model and a reward model the user already has.
Each run goes through the real parts."""
import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from launcher.config import deep_merge, load_config_files, report_params
from pipeline_helpers import planned_jobs, planned_outputs, snakemake
from stages.report import Config as ReportConfig, describe_experiment
from user_experiments import EVALUATED, GPT2_EVALUATED, TINY_TRAINER, WORDS, shipped_config

pytestmark = pytest.mark.e2e
# The runs these tests read start when the Slurm scenario ends (tests/conftest.py, tests/user_experiments.py).


def data_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def made_stages(results: Path) -> set[str]:
    """The run names of the stages that wrote an output under `results` (each writes a stage.json)."""
    return {str(p.parent.relative_to(results)) for p in results.rglob("stage.json")}


@pytest.fixture(scope="module")
def qwen2_run(user_experiments):
    return user_experiments("qwen2_run")


@pytest.fixture(scope="module")
def gpt2_run(user_experiments):
    return user_experiments("gpt2_run")


@pytest.mark.parametrize("run_name, architecture, evaluated", [("qwen2_run", "Qwen2", EVALUATED),
                                                                ("gpt2_run", "GPT2", GPT2_EVALUATED)])
def test_users_model_data_and_reward_through_the_whole_dag(request, run_name, architecture, evaluated):
    run = request.getfixturevalue(run_name)
    results = run["results"]
    table = list(csv.DictReader((results / "report" / "results.csv").open()))
    assert [row["method"] for row in table] == list(evaluated)
    for row in table:  # the user's reward and the reward model's, on the user's eval prompts
        assert 0 <= float(row["reward_said_the_word_mean"]) <= 1 and row["reward_reward_model_mean"]
    report = (results / "report" / "report.md").read_text()
    assert f"Base model `{run['model_dir']}`" in report and "sft.jsonl" in report and "prompts.parquet" in report
    assert "said_the_word.py`: Did the reply say the requested word?" in report and "movie" not in report
    samples = [json.loads(line) for line in (results / "evaluate" / evaluated[-1] / "seed0" / "samples.jsonl").open()]
    eval_questions = {json.loads(line)["question"] for line in Path(run["files"]["data"]["eval"]["path"]).open()}
    assert {s["input"] for s in samples} <= eval_questions
    assert {s["label"] for s in samples} <= set(WORDS)
    # The architecture's own heads: a sequence classifier for the reward model, a token classifier as PPO's critic.
    assert json.loads((results / "reward_model" / "config.json").read_text())["architectures"] == [
        f"{architecture}ForSequenceClassification"]
    assert all("value_loss" in json.loads(line) for line in (results / "rl" / "ppo" / "seed0" / "train_log.jsonl").open())
    default, every = (["c_attn"], ["c_attn", "c_fc", "c_proj"]) if architecture == "GPT2" else (
        ["q_proj", "v_proj"], ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])
    assert f"LoRA r4 on {', '.join(default)}:" in (results / "logs" / "sft.log").read_text()  # the default
    assert f"LoRA r4 on {', '.join(every)}:" in (results / "logs" / "reward_model.log").read_text()  # all-linear


def test_gspo_overlong_mask_and_packing_through_the_real_parts(qwen2_run):
    """The qwen2 run's grpo: GSPO's loss (clip fraction per sequence), DAPO's overlong mask and packed forwards (fewer
    positions computed than the padded batches hold) every step; its SFT and DPO trained packed too."""
    log = data_rows(qwen2_run["results"] / "rl" / "grpo" / "seed0" / "train_log.jsonl")
    assert len(log) == 4 and all(math.isfinite(s["policy_loss"]) and 0 <= s["clip_fraction"] <= 1 for s in log)
    assert all(s["overlong_masked"] == pytest.approx(s["truncated"]) for s in log)  # a cut row is a masked row
    assert all(0 < s["forward_tokens"] < s["padded_tokens"] for s in log), log
    ppo = data_rows(qwen2_run["results"] / "rl" / "ppo" / "seed0" / "train_log.jsonl")
    assert all(s["forward_tokens"] == s["padded_tokens"] for s in ppo)  # ppo's not packed
    client = qwen2_run["mlflow"]
    [run] = client.search_runs([client.get_experiment_by_name("user-qwen2").experiment_id],
                               "attributes.run_name = 'rl/grpo/seed0'")
    assert run.data.params["rl.policy_loss"] == "gspo" and run.data.params["rl.overlong"] == "mask"
    assert run.data.params["rl.packing"] == "True"
    sft = json.loads((qwen2_run["results"] / "sft" / "metrics.json").read_text())
    assert sft["eval_loss_after"] < sft["eval_loss_before"], sft  # trained packed, evaluated packed


def test_cluster_settings_run_on_cpu(qwen2_run):
    """The qwen2 run's PPO: two vLLM engines, reference and reward model each sharded (ZeRO-3) over two ranks."""
    record = json.loads((qwen2_run["results"] / "rl" / "ppo" / "seed0" / "stage.json").read_text())
    ranks = [(a["group"], a["rank"]) for a in record["job"]["actors"]]
    assert ranks.count(("FrozenScorer", 0)) == 2 and ranks.count(("FrozenScorer", 1)) == 2, ranks
    log = (qwen2_run["results"] / "logs" / "rl-ppo-seed0.log").read_text()
    assert "ZeRO-3 ranks" in log and log.count("VLLMEngine pid=") and "held-out reward" in log
    metrics = json.loads((qwen2_run["results"] / "rl" / "ppo" / "seed0" / "metrics.json").read_text())
    assert metrics["steps"] == 4 and math.isfinite(metrics["final_kl"])


def test_responses_end_with_the_end_of_turn_not_eos(qwen2_run, gpt2_run):
    """Qwen2's replies end with <|im_end|> though its eos_token is <|endoftext|>; a base model's with its EOS."""
    chat_rows = [json.loads(line) for line in (qwen2_run["results"] / "preprocess" / "sft" / "sft_train.jsonl").open()]
    assert all(r["response"].endswith("<|im_end|>") and "<|endoftext|>" not in r["response"] for r in chat_rows)
    assert all(r["prompt"].startswith("<|im_start|>user\n") for r in chat_rows)
    pairs = [json.loads(line) for line in (qwen2_run["results"] / "preprocess" / "pairs" / "pairs_train.jsonl").open()]
    assert all(p["prompt"].startswith("<|im_start|>user\n") and p["chosen"].endswith("<|im_end|>") for p in pairs)
    base_rows = [json.loads(line) for line in (gpt2_run["results"] / "preprocess" / "sft" / "sft_train.jsonl").open()]
    assert all(r["prompt"].startswith("User: ") and r["prompt"].endswith("\nAssistant: ") for r in base_rows)
    assert all(r["response"].endswith("<|endoftext|>") for r in base_rows)


@pytest.fixture(scope="module")
def given_run(user_experiments):
    return user_experiments("given_run")


def test_start_from_a_given_sft_model_and_reward_model(given_run):
    """The SFT model and reward model of the first experiment, given to a second: nothing is trained for them, RL
    starts from them, and the report and MLflow say they were given. (No DPO: a method starts from `sft` whatever
    made it, test_sft_then_dpo_on_the_users_pairs.)"""
    given_sft, given_rm, proc = given_run["given_sft"], given_run["given_rm"], given_run["proc"]
    assert f"sft: using the given model {given_sft} (not trained)" in proc.stdout + proc.stderr
    results = given_run["results"]
    sft = json.loads((results / "sft" / "metrics.json").read_text())
    assert sft["steps"] == 0 and sft["given"] == str(given_sft) and not (results / "sft" / "train_log.jsonl").exists()
    assert (results / "sft" / "model.safetensors").resolve() == (given_sft / "model.safetensors").resolve()
    rm = json.loads((results / "reward_model" / "metrics.json").read_text())
    assert rm["steps"] == 0 and rm["given"] == str(given_rm)
    # The same pairs, the same model: the given reward model scores exactly as it did where it was trained.
    trained = json.loads((given_rm / "metrics.json").read_text())
    assert rm["eval_accuracy"] == trained["eval_accuracy"] and rm["reward_mean"] == pytest.approx(trained["reward_mean"])
    inputs = json.loads((results / "rl" / "grpo" / "seed0" / "stage.json").read_text())["inputs"]
    assert Path(inputs["model"]) == (results / "sft").resolve()
    assert all(math.isfinite(s["policy_loss"]) for s in data_rows(results / "rl" / "grpo" / "seed0" / "train_log.jsonl"))
    assert Path(json.loads((results / "rl" / "grpo" / "seed0" / "stage.json").read_text())["inputs"]["reward_model"]) \
        == (results / "reward_model").resolve()
    report = (results / "report" / "report.md").read_text()
    assert f"SFT model: given (`{given_sft}`, not trained)" in report
    assert f"Reward model: given (`{given_rm}`, not trained)" in report
    client = given_run["mlflow"]
    runs = client.search_runs([client.get_experiment_by_name("user-given").experiment_id])
    tags = {r.info.run_name: r.data.tags.get("alignpipe.given_model") for r in runs}
    assert tags["sft"] == str(given_sft) and tags["reward_model"] == str(given_rm) and tags["rl/grpo/seed0"] is None


def test_full_rlhf_chain_holds_only_its_stages(gpt2_run):
    """config/rlhf-ppo.yaml: SFT, a reward model trained because PPO scores with it, PPO from the SFT model; no DPO."""
    results = gpt2_run["results"]
    assert made_stages(results) == {"base_model", "preprocess/sft", "preprocess/pairs", "preprocess/prompts", "sft",
                                    "reward_model", "rl/ppo/seed0", "evaluate/ppo/seed0", "report"}
    inputs = json.loads((results / "rl" / "ppo" / "seed0" / "stage.json").read_text())["inputs"]
    assert Path(inputs["model"]) == (results / "sft").resolve()
    assert Path(inputs["reward_model"]) == (results / "reward_model").resolve()
    report = (results / "report" / "report.md").read_text()
    assert "Stages: base_model, preprocess, sft, reward_model, rl (ppo), evaluate, report; not in this experiment: " \
           "dpo." in report and "DPO: none." in report


@pytest.fixture(scope="module")
def rl_only_run(user_experiments):
    return user_experiments("rl_only_run")


def test_rl_only_experiment_holds_only_its_stages(rl_only_run):
    """RL with a verifiable reward on a given instruct model: no SFT, no reward model, no DPO, no preference data."""
    config = yaml.safe_load(rl_only_run["configfile"].read_text())
    assert "preference" not in config["data"] and "sft" not in config["data"] and "dpo" not in config
    assert planned_jobs(rl_only_run["plan"]) == {"base_model": 1, "preprocess": 1, "rl": 1, "evaluate": 2, "report": 1,
                                                 "all": 1}
    results = rl_only_run["results"]
    assert made_stages(results) == {"base_model", "preprocess/prompts", "rl/grpo/seed1234", "evaluate/base/seed1234",
                                    "evaluate/grpo/seed1234", "report"}
    # RL starts from the given model itself (base_model), scored by the exact-match reward on the prompts' labels.
    inputs = json.loads((results / "rl" / "grpo" / "seed1234" / "stage.json").read_text())["inputs"]
    assert Path(inputs["model"]) == (results / "base_model").resolve() and "reward_model" not in inputs
    assert json.loads((results / "base_model" / "config.json").read_text())["model_type"] == "mistral"
    # DAPO's recipe of the config: dynamic sampling (a tiny random model answers almost nothing right: most groups
    # score all 0 and are set aside; a step ends once 8 groups differ or after max_generation_rounds, then fills up
    # with set-aside groups) and the overlong penalty, logged every step.
    log = data_rows(results / "rl" / "grpo" / "seed1234" / "train_log.jsonl")
    for step in log:
        assert 1 <= step["generation_rounds"] <= 3 and step["groups_informative"] <= 8, step
        assert step["groups_informative"] == 8 or step["generation_rounds"] == 3, step
        assert step["groups_informative"] + step["groups_set_aside"] >= 8 and -1 <= step["overlong_penalty"] <= 0
    assert any(step["groups_set_aside"] for step in log)
    prompts = [json.loads(line) for line in (results / "preprocess" / "prompts" / "prompts_eval.jsonl").open()]
    assert all(p["input"].startswith("What is ") and p["label"].lstrip("-").isdigit() for p in prompts)
    table = list(csv.DictReader((results / "report" / "results.csv").open()))
    assert [row["method"] for row in table] == ["base", "grpo"]  # evaluate.models: every model the DAG makes
    assert all(0 <= float(row["reward_exact_match_mean"]) <= 1 for row in table)
    assert "perplexity_mean" not in table[0]  # no SFT dataset: no held-out responses to measure it on
    report = (results / "report" / "report.md").read_text()
    assert "Stages: base_model, preprocess, rl (grpo), evaluate, report; not in this experiment: sft, reward_model, " \
           "dpo." in report
    assert "SFT model: none (no SFT dataset): the methods start from the base model." in report
    assert "## Reward model" not in report and "for the base model each run starts from" in report
    client = rl_only_run["mlflow"]
    runs = client.search_runs([client.get_experiment_by_name("rl-verifiable-reward").experiment_id])
    report_run = next(r for r in runs if r.info.run_name == "report")
    assert json.loads(report_run.data.tags["alignpipe.dag"])["stages"] == {"sft": False, "reward_model": False,
                                                                            "dpo": False}


def test_adding_dpo_to_a_finished_rl_only_experiment_plans_only_dpo(rl_only_run):
    """DPO and its pairs added: the pairs' preprocessing, DPO, its evaluation and the report; RL, its evaluations and
    the prompts' preprocessing stay."""
    configfile = shipped_config("rl-verifiable-reward", rl_only_run["root"], **deep_merge(rl_only_run["overrides"], {
        "data": {"preference": {"path": "builtin:arithmetic", "max_samples": 96, "eval_fraction": 0.2}},
        "dpo": TINY_TRAINER}))
    plan = snakemake(configfile, "all", "--dry-run").stdout
    assert planned_outputs(plan, "rl-verifiable-reward") == {
        "preprocess/pairs", "dpo/seed1234", "evaluate/dpo/seed1234", "report"}, plan[-3000:]


def test_dpo_only_and_sft_only_experiments_plan_only_their_stages(tmp_path):
    """A config stands on its own: a file with a model, its data and one method plans that method's stages only."""
    arithmetic = lambda **keys: {"path": "builtin:arithmetic", "max_samples": 64} | keys
    common = {"results_dir": str(tmp_path / "results"), "model": {"source": "tiny"},
              "evaluate": {"rewards": ["config/rewards/exact_match.py"]}}
    for name, config, expected in (
            ("dpo-only", {"dpo": {}, "data": {"preference": arithmetic(), "eval": arithmetic(label_key="label")}},
             {"preprocess": 2, "dpo": 1, "evaluate": 2}),  # pairs, eval prompts; base and dpo
            ("sft-only", {"data": {"sft": arithmetic(), "eval": arithmetic(label_key="label")}},
             {"preprocess": 2, "sft": 1, "evaluate": 2})):  # sft rows, eval prompts; base and sft
        configfile = tmp_path / f"{name}.yaml"
        configfile.write_text(yaml.safe_dump(common | config | {"experiment": name}))
        plan = snakemake(configfile, "all", "--dry-run").stdout
        assert planned_jobs(plan) == expected | {"base_model": 1, "report": 1, "all": 1}, plan[-3000:]


def test_sft_then_dpo_on_the_users_pairs(qwen2_run, tmp_path):
    """config/sft-dpo.yaml on the user's Qwen2 model and files plans SFT, DPO from it, their evaluation and the
    report; no reward model, no RL. Its stages are the Qwen2 run's (the same model and files, SFT then DPO from it on
    the user's pairs): the file is planned here and its report's prose written, not run a second time."""
    root = tmp_path / "sft-dpo"
    files = qwen2_run["files"]
    configfile = shipped_config(
        "sft-dpo", root, seed=0, model={"path": str(qwen2_run["model_dir"])},
        data={k: files["data"][k] for k in ("sft", "preference", "eval")} | {"max_prompt_tokens": 48,
                                                                            "max_response_tokens": 24},
        sft=TINY_TRAINER, dpo=TINY_TRAINER | {"learning_rate": 5.0e-4},
        evaluate={"rewards": [files["reward"]], "num_prompts": 16, "max_new_tokens": 16})
    plan = snakemake(configfile, "all", "--dry-run").stdout
    assert planned_outputs(plan, "sft-dpo") == {  # evaluate.models: every model the DAG makes
        "base_model", "preprocess/sft", "preprocess/pairs", "preprocess/prompts", "sft", "dpo/seed0",
        "evaluate/base/seed0", "evaluate/sft/seed0", "evaluate/dpo/seed0", "report"}, plan[-3000:]
    prose = describe_experiment(ReportConfig.from_params(report_params(load_config_files([configfile]))))
    assert "Reward model: none (nothing scores with it)." in prose and "DPO: on the pairs of" in prose \
        and "RL: none." in prose
    results = qwen2_run["results"]
    inputs = json.loads((results / "dpo" / "seed0" / "stage.json").read_text())["inputs"]
    assert Path(inputs["model"]) == (results / "sft").resolve()
    dpo = json.loads((results / "dpo" / "seed0" / "metrics.json").read_text())
    assert dpo["eval_margin"] > 0, dpo  # the user's pairs: the requested word over another
