"""A new user's experiments, with none of the packaged data: their own model directory (tiny random Qwen2, GPT-2 and
Mistral models, built and saved here as a user has them), their SFT, preference, RL-prompt and eval files, their
reward file. Every stage through a Qwen2 chat model; the three experiments of config/ (docs/your-experiment.md),
each holding only its stages: RL with a verifiable reward on a given instruct model (built-in arithmetic,
tiny Mistral) and the full RLHF chain (GPT-2, a base model) run; SFT then DPO on the user's pairs is planned, its
stages being the Qwen2 run's; then an experiment started from an SFT model and a reward model the user already has.
Each run goes through the real parts."""
import csv
import json
import math
import random
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas
import pytest
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from transformers import AutoTokenizer

from launcher.config import REPO_ROOT, deep_merge, load_config_files, report_params
from pipeline_helpers import (finish_dag, planned_jobs, planned_outputs, snakemake, start_dag, submit_again, wait_until,
                              write_config)
from runtime.builtin_data import arithmetic_rows
from runtime.data import write_jsonl
from runtime.models import EMULATED_BF16, build_tiny
from stages.report import Config as ReportConfig, describe_experiment
from test_remote_reward import start_service
from test_reproducibility import without_timings

pytestmark = pytest.mark.e2e
WORDS = ("apple pear plum grape lemon melon cherry peach mango olive bread cheese honey pepper onion carrot "
         "river stone cloud storm field forest valley island candle mirror window garden basket ladder button rocket").split()
REWARD_FILE = '''"""Did the reply say the requested word? 1 if the label is one of its words, else 0."""


def reward_fn(prompts, completions, labels):
    return [float(label in completion.replace(".", " ").split()) for completion, label in zip(completions, labels)]
'''


# The models evaluated: a trained one of each kind (DPO's, and an RL policy with its LoRA merged) in the Qwen2 run;
# PPO's in the GPT-2 run (config/rlhf-ppo.yaml), whose own parts are the base model's template, its reward head and
# PPO's GPT-2 critic and LoRA. Evaluating every model of a DAG (the default) is the RL-only run's and the tiny run's.
EVALUATED = ("dpo", "ppo")
GPT2_EVALUATED = ("ppo",)
# The trainers of config/tiny.yaml's size, for the shipped experiments run on a tiny model.
TINY_TRAINER = {"zero_stage": 0, "num_workers": 1, "batch_size": 8, "micro_batch_size": 4, "learning_rate": 1.0e-3,
                "warmup_steps": 1}


def question(word: str, i: int) -> str:
    return ["Repeat the word: {}", "Say {} once.", "Echo this: {}"][i % 3].format(word)


def write_user_files(root: Path, chat: bool) -> dict:
    """The user's four datasets and reward file; preference pairs as chat messages (chat) or text with a prompt."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    sft = [{"question": question(w, i), "answer": w} for i, w in enumerate(rng.choices(WORDS, k=64))]
    pairs = []
    for i, word in enumerate(rng.choices(WORDS, k=96)):
        wrong = rng.choice([w for w in WORDS if w != word])
        if chat:
            turn = [{"role": "user", "content": question(word, i)}]
            pairs.append({"chosen": turn + [{"role": "assistant", "content": word}],
                          "rejected": turn + [{"role": "assistant", "content": wrong}]})
        else:
            pairs.append({"prompt": question(word, i), "chosen": word, "rejected": wrong})
    prompts = [{"question": question(w, i), "word": w} for i, w in enumerate(rng.choices(WORDS, k=64))]
    held_out = [{"question": question(w, i + 1), "word": w} for i, w in enumerate(rng.choices(WORDS, k=16))]
    for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", pairs), ("eval.jsonl", held_out)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    pandas.DataFrame(prompts).to_parquet(root / "prompts.parquet")
    (root / "said_the_word.py").write_text(REWARD_FILE)
    return {"texts": [r["question"] + " " + r["answer"] for r in sft] * 4, "reward": str(root / "said_the_word.py"),
            "data": {"sft": {"path": str(root / "sft.jsonl"), "input_key": "question", "output_key": "answer",
                             "max_samples": 64, "eval_fraction": 0.1},
                     "preference": {"path": str(root / "pairs.jsonl"), "max_samples": 96, "eval_fraction": 0.2},
                     "prompts": {"path": str(root / "prompts.parquet"), "input_key": "question", "label_key": "word",
                                 "max_samples": 64},
                     "eval": {"path": str(root / "eval.jsonl"), "input_key": "question", "label_key": "word"}}}


def build_user_model(out_dir: Path, architecture: str, texts: list[str], chat: bool, seed: int = 0) -> None:
    """A model directory as users have them: for qwen2, a chat model whose EOS (<|endoftext|>) is not its end of turn
    (<|im_end|>), as Qwen2's; for gpt2, a base model without a chat template. The same texts give the same tokenizer
    whatever the seed of the weights."""
    build_tiny(out_dir, {"architecture": architecture, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                         "vocab_size": 400}, seed, texts)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.eos_token = "<|endoftext|>"
    if not chat:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").unlink(missing_ok=True) if not chat else None
    for name in ("config.json", "generation_config.json"):
        path = out_dir / name
        if path.exists():
            path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": tokenizer.eos_token_id}))


def user_config(root: Path, model_dir: Path, files: dict, chat: bool, ppo: dict | None = None, **overrides) -> Path:
    data = files["data"] | ({} if chat else {"apply_chat_template": False, "input_template": "User: {}\nAssistant: "})
    settings = dict(
        experiment=root.name, seeds=None, model={"path": str(model_dir)}, data=data,
        sft={"lora_rank": 4, "lora_alpha": 8, "packing": True}, dpo={"packing": True},
        reward_model={"lora_rank": 4, "lora_alpha": 8, "lora_targets": "all-linear"},
        rl={"steps": 4, "eval_prompts": 8, "reward": files["reward"],
            # grpo with GSPO's sequence-level loss (its paper's clip range), DAPO's overlong mask, packed forwards
            "variants": {"grpo": {"estimator": "group_norm", "policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4,
                                  "overlong": "mask", "packing": True},
                         "ppo": {"estimator": "gae", "reward": "model", "lora_rank": 4} | (ppo or {})}},
        evaluate={"models": list(EVALUATED), "rewards": [files["reward"], "model"]})
    root.mkdir(parents=True, exist_ok=True)
    return write_config(root / "config.yaml", root / "results", **(settings | overrides))


def shipped_config(name: str, root: Path, **overrides) -> Path:
    """config/<name>.yaml as shipped, with its results under `root` and the test's `overrides` (a tiny model, the
    user's files, fewer steps) merged in key by key."""
    config = yaml.safe_load((REPO_ROOT / "config" / f"{name}.yaml").read_text())
    config = deep_merge(config, {"results_dir": str(root / "results"), "experiment": root.name, **overrides})
    for block in ("sft", "reward_model", "dpo", "rl", "evaluate"):  # in fp32 on any CPU, as config/tiny.yaml
        if block in config:
            config[block].setdefault("precision", "fp32")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root / "config.yaml"


def data_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def made_stages(results: Path) -> set[str]:
    """The run names of the stages that wrote an output under `results` (each writes a stage.json)."""
    return {str(p.parent.relative_to(results)) for p in results.rglob("stage.json")}


def run_result(root: Path, proc) -> dict:
    return {"root": root, "results": root / "results" / root.name, "proc": proc,
            "mlflow": MlflowClient(tracking_uri=f"sqlite:///{root / 'results' / 'mlflow.db'}")}


def user_experiment(root: Path, architecture: str, chat: bool, cluster_settings: bool = False,
                    evaluated: tuple = EVALUATED) -> dict:
    """A user's files, model and config. `cluster_settings`: PPO with the settings of a GPU cluster run that also work
    on CPU (two vLLM engines, ZeRO-3 with the reference and reward model sharded over two ranks, micro-batched
    forwards, gradient checkpointing). `evaluated`: the models evaluated (and rows of the report's table)."""
    files = write_user_files(root / "my_data", chat)
    model_dir = root / f"my-{architecture}"
    build_user_model(model_dir, architecture, files["texts"], chat)
    ppo = {"zero_stage": 3, "frozen_ranks": 2, "forward_micro_batch_size": 4, "gradient_checkpointing": True,
           "vllm": {"num_engines": 2}} if cluster_settings else {}
    configfile = user_config(root, model_dir, files, chat, ppo,
                             evaluate={"models": list(evaluated), "rewards": [files["reward"], "model"]})
    return {"root": root, "files": files, "model_dir": model_dir, "configfile": configfile,
            "results": root / "results" / root.name}


def qwen2_experiment(root: Path) -> dict:
    """Every stage through the user's Qwen2 chat model, with the settings of a GPU cluster run that work on CPU."""
    return user_experiment(root, "qwen2", chat=True, cluster_settings=True)


class UserRuns:
    """The module's DAG runs that the session's tests read (`wanted`, fixture names of USER_RUNS), in threads of their
    own from the session's start (tests/conftest.py's `user_runs`): a DAG leaves part of two cores idle (stage
    start-ups, stretches of one stage), and so do most test files, which run beside them. None while `busy()` (the
    tiny DAG runs: its tests come first); one at a time beside other files' tests, two once a test waits for a run
    (two DAGs at once, not more, for memory); slots go to the runs in USER_RUNS's order, the given-model run once the
    Qwen2 run's models exist. Their models and files are made at once, in the main thread (a tiny model's weights
    come from torch's global seed). `result(name)` returns a run's result once it has ended."""

    def __init__(self, tmp_path_factory, wanted: set, busy):
        self.busy, self.lock, self.running = busy, threading.Lock(), []
        self.awaited, self.closing, self.procs = False, False, []
        made = {}
        for name, (make, directory, experiment) in USER_RUNS.items():
            if name in wanted:
                root = tmp_path_factory.mktemp(directory) / experiment
                made[name] = (make(root, made["qwen2_run"]) if name == "given_run" else make(root)) \
                    | {"over": threading.Event()}
        self.waiting = [experiment for experiment in made.values() if "ready" not in experiment]  # (in this order)
        self.pool = ThreadPoolExecutor(len(made))
        self.started = {name: self.pool.submit(self._run, experiment) for name, experiment in made.items()}

    def result(self, name: str) -> dict:
        with self.lock:
            self.awaited = True
        return self.started[name].result()

    def close(self):
        """The session ended: runs not started give up, running ones are stopped as Ctrl-C stops them."""
        with self.lock:
            self.closing = True
            for proc in self.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
        self.pool.shutdown()

    def _take_slot(self, experiment: dict) -> bool:
        with self.lock:
            assert not self.closing, "the session ended"
            slots = 0 if self.busy() else 2 if self.awaited else 1
            if self.waiting[0] is experiment and len(self.running) < slots:
                self.running.append(self.waiting.pop(0))
                return True
            return False

    def _run(self, experiment: dict) -> dict:
        try:
            if "ready" in experiment:
                experiment["ready"]()  # (without a slot: another DAG may run meanwhile)
                with self.lock:
                    self.waiting.append(experiment)
            wait_until(lambda: self._take_slot(experiment), 7200, "a slot for a DAG")
            try:
                plan = snakemake(experiment["configfile"], "all", "--dry-run", env=experiment.get("env")).stdout
                with self.lock:
                    assert not self.closing, "the session ended"
                    proc = start_dag(experiment["configfile"], experiment["root"], experiment.get("env"))
                    self.procs.append(proc)
                return experiment | run_result(experiment["root"], finish_dag(proc, experiment["root"])) | {"plan": plan}
            finally:
                with self.lock:
                    self.running.remove(experiment)
        finally:
            experiment["over"].set()


@pytest.fixture(scope="module")
def qwen2_run(user_runs):
    return user_runs.result("qwen2_run")


@pytest.fixture(scope="module")
def gpt2_run(user_runs):
    return user_runs.result("gpt2_run")


def gpt2_experiment(root: Path) -> dict:
    """The full RLHF chain (config/rlhf-ppo.yaml: SFT, reward model, PPO) on the user's GPT-2 base model and files:
    its files, model and config."""
    files = write_user_files(root / "my_data", chat=False)
    model_dir = root / "my-gpt2"
    build_user_model(model_dir, "gpt2", files["texts"], chat=False)
    configfile = shipped_config(
        "rlhf-ppo", root, seed=0, model={"path": str(model_dir)},
        data=files["data"] | {"apply_chat_template": False, "input_template": "User: {}\nAssistant: ",
                              "system_prompt": None, "max_prompt_tokens": 48},
        sft=TINY_TRAINER | {"lora_rank": 4, "lora_alpha": 8},
        reward_model=TINY_TRAINER | {"epochs": 1, "lora_rank": 4, "lora_alpha": 8, "lora_targets": "all-linear"},
        rl={"steps": 4, "eval_prompts": 8, "max_new_tokens": 16, "learning_rate": 1.0e-3,
            "variants": {"ppo": {"estimator": "gae", "n_samples": 1, "lora_rank": 4}}},
        evaluate={"models": list(GPT2_EVALUATED), "rewards": [files["reward"], "model"], "num_prompts": 16,
                  "max_new_tokens": 16})
    return {"root": root, "configfile": configfile, "files": files, "model_dir": model_dir}


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


def test_ppo_with_lora_syncs_and_exports_the_merged_policy(qwen2_run):
    """The qwen2 run's PPO trains LoRA adapters (policy and critic, the default q_proj and v_proj) under ZeRO-3: vLLM
    samples from the merged policy the trainer trains (its log-probs equal the trainer's at every step), and the
    exported model is a plain model in which only the adapted layers changed."""
    results = qwen2_run["results"]
    log_text = (results / "logs" / "rl-ppo-seed0.log").read_text()
    assert "[PolicyWorker] LoRA r4 on q_proj, v_proj" in log_text and "[CriticWorker] LoRA r4" in log_text
    log = data_rows(results / "rl" / "ppo" / "seed0" / "train_log.jsonl")
    assert [s["step"] for s in log] == [1, 2, 3, 4]
    for step in log[1:]:  # from step 2 on vLLM serves weights synced from the LoRA trainer
        assert step["vllm_logprob_gap"] < 1e-4, f"step {step['step']}: vLLM samples from other weights"
    sft = load_file(results / "sft" / "model.safetensors")
    exported = load_file(results / "rl" / "ppo" / "seed0" / "model.safetensors")
    assert set(exported) == set(sft), "the export is the plain model: no adapter tensors"
    adapted = {name for name in sft if name.endswith(("q_proj.weight", "v_proj.weight"))}
    assert adapted
    for name in sft:
        if name in adapted:
            assert not exported[name].equal(sft[name]), f"{name} has adapters but did not change"
        else:
            assert exported[name].equal(sft[name]), f"{name} is frozen under LoRA but changed"


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
def given_run(qwen2_run, user_runs):
    return user_runs.result("given_run")


def given_experiment(root: Path, qwen2: dict) -> dict:
    """An experiment given the Qwen2 run's SFT model and reward model: its config; `ready` waits for those models and
    copies them (Snakemake locks the outputs of the Qwen2 run while it goes on), so that it can run beside the rest
    of the Qwen2 run. Its RL and evaluation run in bf16 (`env`: emulated where the CPU has no native bf16), the only
    DAG that does on every machine."""
    given = {stage: root / "given" / stage for stage in ("sft", "reward_model")}

    def ready():
        made = lambda: all((qwen2["results"] / stage / "stage.json").exists() for stage in given)  # (whole, or absent)
        wait_until(lambda: made() or qwen2["over"].is_set(), 3600)
        assert made(), "the Qwen2 run ended without its SFT model and reward model"
        for stage, copy in given.items():
            shutil.copytree(qwen2["results"] / stage, copy, symlinks=True)

    configfile = user_config(
        root, qwen2["model_dir"], qwen2["files"], chat=True, sft={"from": str(given["sft"])},
        reward_model={"from": str(given["reward_model"])}, dpo=None,
        rl={"steps": 2, "eval_prompts": 8, "reward": "model", "precision": "bf16",
            "variants": {"grpo": {"estimator": "group_norm", "policy_loss": "cispo"}}},  # CISPO's loss
        evaluate={"models": ["grpo"], "rewards": ["model"], "precision": "bf16"})
    return {"root": root, "configfile": configfile, "given": given, "ready": ready, "env": {EMULATED_BF16: "1"}}


def test_start_from_a_given_sft_model_and_reward_model(given_run):
    """The SFT model and reward model of the Qwen2 run, given to a second experiment: nothing is trained for them, RL
    starts from them, and the report and MLflow say they were given. (No DPO: a method starts from `sft` whatever
    made it, test_sft_then_dpo_on_the_users_pairs.) Its RL and evaluation ran in bf16: on a CPU the trainers',
    reference's and reward model's fp32 weights under bf16 autocast, the bf16 vLLM engine the weights are synced into."""
    given_sft, given_rm = given_run["given"]["sft"], given_run["given"]["reward_model"]
    root, proc, results = given_run["root"], given_run["proc"], given_run["results"]
    assert f"sft: using the given model {given_sft} (not trained)" in proc.stdout + proc.stderr
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
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'results' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("user-given").experiment_id])
    tags = {r.info.run_name: r.data.tags.get("alignpipe.given_model") for r in runs}
    assert tags["sft"] == str(given_sft) and tags["reward_model"] == str(given_rm) and tags["rl/grpo/seed0"] is None
    for run_name in ("rl/grpo/seed0", "evaluate/grpo/seed0"):
        assert json.loads((results / run_name / "stage.json").read_text())["job"]["precision"] == "bf16"
    assert {r.info.run_name: r.data.tags.get("precision") for r in runs}["rl/grpo/seed0"] == "bf16"
    # vLLM samples from the trainer's weights, to bf16's rounding (fp32 runs stay under 1e-4)
    assert all(s["vllm_logprob_gap"] < 1e-2 for s in data_rows(results / "rl" / "grpo" / "seed0" / "train_log.jsonl"))


def test_bf16_rl_and_evaluation_rerun_to_the_same_bits(given_run, tmp_path, monkeypatch):
    """Same config and seed, same numbers, in bf16 too (docs/reproducibility.md): the given-model run's RL stage and
    its evaluation, submitted again with the params and inputs they recorded, give the same metrics, per-step log,
    weights and samples, bit for bit (emulated bf16 on a CPU without native bf16, native on one with it)."""
    monkeypatch.setenv(EMULATED_BF16, "1")  # (submitit's local jobs take the environment at submission)
    run = given_run | {"mlflow_uri": f"sqlite:///{given_run['root'] / 'results' / 'mlflow.db'}"}
    made = {"rl/grpo/seed0": "model.safetensors", "evaluate/grpo/seed0": "samples.jsonl"}  # (what each stage makes)
    reruns = {stage: submit_again(run, given_run["results"] / stage, tmp_path, experiment="user-given-rerun")[:2]
              for stage in made}  # (independent: evaluate reads the first RL's)
    for stage, (job, output) in reruns.items():
        job.result()
        first = given_run["results"] / stage
        assert json.loads((output / "stage.json").read_text())["job"]["precision"] == "bf16"
        assert json.loads((output / "metrics.json").read_text()) == json.loads((first / "metrics.json").read_text())
        name = made[stage]
        assert (output / name).read_bytes() == (first / name).read_bytes(), f"{stage}: {name} differs"
    log, first_log = ([without_timings(step) for step in data_rows(directory / "train_log.jsonl")]
                      for directory in (reruns["rl/grpo/seed0"][1], given_run["results"] / "rl" / "grpo" / "seed0"))
    assert log == first_log and len(log) == 2


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


ARITHMETIC_TEXTS = [f"{r['prompt']} {r['response']}" for r in arithmetic_rows("sft", 256, 0)]


def write_benchmark_files(directory: Path) -> dict:
    """A multiple-choice benchmark (JSONL) and an lm-evaluation-harness task YAML over a local JSONL of questions."""
    rows = arithmetic_rows("test", 12, seed=7)
    rng = random.Random(7)
    choices = []
    for row in rows[:8]:
        options = [row["label"], str(int(row["label"]) + rng.randint(1, 9)), str(int(row["label"]) - rng.randint(1, 9))]
        rng.shuffle(options)
        choices.append({"question": row["prompt"], "options": options, "answer": options.index(row["label"])})
    write_jsonl(directory / "choices.jsonl", choices)
    write_jsonl(directory / "questions.jsonl", [{"question": r["prompt"], "answer": r["label"]} for r in rows])
    (directory / "qa_task.yaml").write_text(yaml.safe_dump({
        "task": "arith_qa", "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
        "dataset_kwargs": {"data_files": {"test": str(directory / "questions.jsonl")}},
        "doc_to_text": "Q: {{question}}\nA:", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": True}]}))
    return {"choices": str(directory / "choices.jsonl"), "task": str(directory / "qa_task.yaml"), "rows": choices}


def rl_only_experiment(root: Path) -> dict:
    """config/rl-verifiable-reward.yaml on a tiny given instruct model (Mistral): its model and config, with three
    test benchmarks: arithmetic problems scored as mathematics, a multiple-choice file and an lm-eval task."""
    model_dir = root.parent / "my-mistral-instruct"
    build_user_model(model_dir, "mistral", ARITHMETIC_TEXTS, chat=True)
    files = write_benchmark_files(root.parent)
    overrides = {"model": {"path": str(model_dir)}, "data": {"prompts": {"max_samples": 64}},
                 "rl": {"steps": 4, "eval_prompts": 8, "learning_rate": 1.0e-3}, "evaluate": {"num_prompts": 16},
                 "benchmarks": {
                     "arith": {"path": "builtin:arithmetic", "max_samples": 16, "scorer": "math",
                               "answer_pattern": r"^\s*(-?\d+)", "n_samples": 4, "pass_k": [1, 2, 4],
                               "temperature": 1.0, "max_new_tokens": 8},
                     "pick": {"path": files["choices"], "input_key": "question", "label_key": "answer",
                              "choices_key": "options", "scorer": "choice"},
                     "qa": {"lm_eval": {"task": files["task"]}, "n_samples": 2, "temperature": 1.0,
                            "max_new_tokens": 8}}}
    return {"root": root, "configfile": shipped_config("rl-verifiable-reward", root, **overrides), "overrides": overrides,
            "model_dir": model_dir, "benchmark_files": files}


def agent_experiment(root: Path) -> dict:
    """config/agent-calculator.yaml (multi-turn episodes with a calculator tool) on the tiny random model, 4 steps,
    with a final reward file beside the environment's step rewards (each at its own turn): a random model never
    answers right, and the vowel fraction of its last reply gives the groups something to tell apart. Beside the
    config's GRPO, PPO (a critic) with packing and dynamic sampling; base and GRPO evaluated, and benchmarked on the
    calculator's test problems (tests/test_agent_rl.py)."""
    overrides = {"model": {"source": "tiny", "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2,
                                                       "vocab_size": 512}},
                 "data": {"prompts": {"max_samples": 64}, "eval": {"max_samples": 16}},
                 "environment": {"turn_rewards": True},
                 "rl": {"steps": 4, "eval_prompts": 8, "eval_every": 2, "rollout_batch_size": 4, "batch_size": 16,
                        "micro_batch_size": 8, "learning_rate": 1.0e-3, "reward": "config/rewards/vowel_fraction.py",
                        "variants": {"ppo": {"estimator": "gae", "packing": True, "dynamic_sampling": True}}},
                 "evaluate": {"num_prompts": 16, "models": ["base", "grpo"]},
                 "benchmarks": {"calc": {"path": "builtin:arithmetic", "max_samples": 8, "environment": True,
                                         "n_samples": 2, "temperature": 1.0, "max_new_tokens": 16}}}
    return {"root": root, "configfile": shipped_config("agent-calculator", root, **overrides), "overrides": overrides}


def train_teacher(student: Path, out_dir: Path, sft_file: Path) -> None:
    """A teacher for `student`: a copy of it (the same tokenizer) trained on the user's SFT rows as chats, until it
    answers the word and ends its turn (60 full-batch AdamW steps: seconds)."""
    import torch
    from transformers import AutoModelForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student)
    chats = [[{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
             for row in data_rows(sft_file)]
    batch = tokenizer([tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats], return_tensors="pt",
                      padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        optimizer.zero_grad()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def rewards_experiment(root: Path) -> dict:
    """Rewards beyond a Python file, on the user's Qwen2 model and word prompts (tests/test_rewards_and_teachers.py).
    GRPO against a reward service on 127.0.0.1 (the longer reply scores higher), with dynamic sampling; the first
    request of a step's 32 rows answers after the client's timeout, so it is sent again. GRPO with asynchronous
    rollouts scored by an LLM judge: the base model itself, whose greedy verdict on a random model's reply repeats the
    reply's last token, which is one of the words (a score by the word) for some replies and not for others.
    REINFORCE++ distilling a teacher trained on the SFT rows (train_teacher) with no other reward, packed. The
    student evaluated with the service and the judge."""
    files = write_user_files(root / "my_data", chat=True)
    student, teacher = root / "my-qwen2", root / "teacher"
    build_user_model(student, "qwen2", files["texts"], chat=True)
    train_teacher(student, teacher, Path(files["data"]["sft"]["path"]))
    slowed = threading.Event()

    def sleep(body, number):  # one slow answer: to a step's rollout (rollout_batch_size 8 x n_samples 4 rows)
        if len(body["prompts"]) == 32 and not slowed.is_set():
            slowed.set()
            return 4.0
        return 0.0

    service = start_service(sleep=sleep)
    config = {
        "experiment": root.name, "seed": 0, "results_dir": str(root / "results"), "model": {"path": str(student)},
        "data": {"max_prompt_tokens": 48, "max_response_tokens": 16,
                 "prompts": files["data"]["prompts"], "eval": files["data"]["eval"]},
        "rl": {"steps": 4, "zero_stage": 0, "num_workers": 1, "rollout_batch_size": 8, "n_samples": 4,
               "max_new_tokens": 16, "batch_size": 32, "micro_batch_size": 8, "learning_rate": 1.0e-3,
               "kl_coef": 0.0, "eval_prompts": 8, "reward": service.url,
               "variants": {"remote": {"estimator": "group_norm", "dynamic_sampling": True},
                            "judge": {"estimator": "group_norm", "reward": "judge", "async_rollouts": 1},
                            # the teacher's return-to-go credits a reply that ends where the teacher would
                            "distil": {"estimator": "reinforce", "reward": None, "teacher": str(teacher),
                                       "packing": True, "steps": 8, "learning_rate": 1.0e-2, "batch_size": 8}}},
        "remote_reward": {"timeout": 2.0, "backoff": 0.1},
        "judge": {"model": "base", "chat": False, "max_new_tokens": 8, "unparsed_score": 0.25,
                  "template": "Which word does this reply say? {completion}",
                  "parser": {"kind": "choice", "choices": {word: (i % 3) / 2 for i, word in enumerate(WORDS)}}},
        "evaluate": {"models": ["distil"], "rewards": [service.url, "judge"], "num_prompts": 16,
                     "max_new_tokens": 16}}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return {"root": root, "configfile": root / "config.yaml", "files": files, "student": student, "teacher": teacher,
            "service": service}


# The runs UserRuns makes, in this order: (how, its temporary directory, its experiment's name and directory).
USER_RUNS = {"qwen2_run": (qwen2_experiment, "qwen2", "user-qwen2"), "given_run": (given_experiment, "given", "user-given"),
             "gpt2_run": (gpt2_experiment, "gpt2", "user-gpt2"),
             "rl_only_run": (rl_only_experiment, "rl-only", "rl-verifiable-reward"),
             "agent_run": (agent_experiment, "agent", "agent-calculator"),
             "rewards_run": (rewards_experiment, "rewards", "rewards-teachers")}


@pytest.fixture(scope="module")
def rl_only_run(user_runs):
    return user_runs.result("rl_only_run")


def test_rl_only_experiment_holds_only_its_stages(rl_only_run):
    """RL with a verifiable reward on a given instruct model: no SFT, no reward model, no DPO, no preference data."""
    config = yaml.safe_load(rl_only_run["configfile"].read_text())
    assert "preference" not in config["data"] and "sft" not in config["data"] and "dpo" not in config
    assert planned_jobs(rl_only_run["plan"]) == {"base_model": 1, "preprocess": 1, "rl": 1, "evaluate": 2,
                                                 "benchmark": 6, "report": 1, "all": 1}
    results = rl_only_run["results"]
    benchmarks = {f"benchmark/{name}/{model}/seed1234" for name in ("arith", "pick", "qa") for model in ("base", "grpo")}
    assert made_stages(results) == {"base_model", "preprocess/prompts", "rl/grpo/seed1234", "evaluate/base/seed1234",
                                    "evaluate/grpo/seed1234", "report"} | benchmarks
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


def test_benchmarks_are_scored_per_sample_and_tabled_with_significance(rl_only_run):
    """Three benchmarks on base and grpo through the real vLLM, math-verify, lm-eval and MLflow: every problem's samples
    kept and scored, metrics recomputable from them, and the report's table with every model x benchmark cell and a
    significance mark exactly where the paired test's p-value is below 0.05."""
    results = rl_only_run["results"]
    for model in ("base", "grpo"):
        arith = results / "benchmark" / "arith" / model / "seed1234"
        problems = data_rows(arith / "samples.jsonl")
        metrics = json.loads((arith / "metrics.json").read_text())
        assert len(problems) == metrics["num_problems"] == 16
        assert all(len(p["completions"]) == len(p["scores"]) == len(p["answers"]) == 4 for p in problems)
        # the answer anchored at the reply's start (answer_pattern): a number inside prose is no answer
        assert all(a is None or a.lstrip("-").isdigit() for p in problems for a in p["answers"])
        assert all(s == float(a is not None and int(a) == int(p["label"]))
                   for p in problems for a, s in zip(p["answers"], p["scores"]))
        assert metrics["avg_at_4"] == pytest.approx(sum(sum(p["scores"]) / 4 for p in problems) / 16)
        solved = sum(any(p["scores"]) for p in problems) / 16
        assert metrics["pass_at_4"] == pytest.approx(solved) and metrics["pass_at_1"] == pytest.approx(metrics["avg_at_4"])
        assert metrics["avg_at_4"] <= metrics["pass_at_2"] <= metrics["pass_at_4"]
        pick = data_rows(results / "benchmark" / "pick" / model / "seed1234" / "samples.jsonl")
        assert len(pick) == 8
        for problem, row in zip(pick, data_rows(Path(rl_only_run["benchmark_files"]["choices"]))):
            assert problem["answers"][0] in row["options"] and problem["completions"] == []
            assert problem["scores"] == [float(row["options"].index(problem["answers"][0]) == row["answer"])]
        qa = data_rows(results / "benchmark" / "qa" / model / "seed1234" / "samples.jsonl")
        assert len(qa) == 12 and all(len(p["completions"]) == 2 and p["input"].startswith("Q: What is ") for p in qa)
        assert all(s in (0.0, 1.0) and (s == 0 or p["label"] in c) for p in qa for c, s in zip(p["completions"],
                                                                                                p["scores"]))
    # the samples of one problem are drawn independently of the next problem's (each sample its own seed)
    qa = data_rows(results / "benchmark" / "qa" / "base" / "seed1234" / "samples.jsonl")
    assert not any(a["completions"][1] == b["completions"][0] for a, b in zip(qa, qa[1:]) if a["completions"][1])
    table = list(csv.DictReader((results / "report" / "benchmarks.csv").open()))
    assert [row["method"] for row in table] == ["base", "grpo"]
    for column in ("arith_avg_at_4", "arith_pass_at_2", "arith_pass_at_4", "arith_maj_at_4", "pick_avg_at_1",
                   "qa_avg_at_2", "qa_pass_at_2"):
        assert all(0 <= float(row[f"{column}_mean"]) <= 1 for row in table), column
    markdown = (results / "report" / "benchmarks.md").read_text()
    grpo_line = next(line for line in markdown.splitlines() if line.startswith("| grpo |"))
    marked = [cell.strip().endswith("†") for cell in grpo_line.split("|")[3:-1]]
    p_values = {name: float(table[1][f"{name}_p_value"]) for name in ("arith", "pick", "qa")}
    header = next(line for line in markdown.splitlines() if line.startswith("| method |")).split("|")[3:-1]
    for title, mark in zip(header, marked):
        name, metric = title.strip().split()
        assert mark == (metric.startswith("avg@") and p_values[name] < 0.05), (title, grpo_line, p_values)
    assert "| base (baseline) |" in markdown and "paired bootstrap" in markdown
    assert "## Benchmarks" in (results / "report" / "report.md").read_text()


def test_adding_a_benchmark_to_a_finished_experiment_plans_only_its_jobs_and_the_report(rl_only_run):
    overrides = deep_merge(rl_only_run["overrides"], {"benchmarks": {"arith_greedy": {
        "path": "builtin:arithmetic", "max_samples": 8, "scorer": "exact", "max_new_tokens": 8}}})
    configfile = shipped_config("rl-verifiable-reward", rl_only_run["root"], **overrides)
    plan = snakemake(configfile, "all", "--dry-run").stdout
    assert planned_outputs(plan, "rl-verifiable-reward") == {
        "benchmark/arith_greedy/base/seed1234", "benchmark/arith_greedy/grpo/seed1234", "report"}, plan[-3000:]


def test_adding_dpo_to_a_finished_rl_only_experiment_plans_only_dpo(rl_only_run):
    """DPO and its pairs added: the pairs' preprocessing, DPO, its evaluation and benchmarks and the report; RL, its
    evaluations and benchmarks and the prompts' preprocessing stay."""
    configfile = shipped_config("rl-verifiable-reward", rl_only_run["root"], **deep_merge(rl_only_run["overrides"], {
        "data": {"preference": {"path": "builtin:arithmetic", "max_samples": 96, "eval_fraction": 0.2}},
        "dpo": TINY_TRAINER}))
    plan = snakemake(configfile, "all", "--dry-run").stdout
    assert planned_outputs(plan, "rl-verifiable-reward") == {
        "preprocess/pairs", "dpo/seed1234", "evaluate/dpo/seed1234", "report",
        *(f"benchmark/{name}/dpo/seed1234" for name in ("arith", "pick", "qa"))}, plan[-3000:]


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
