"""The user-experiment DAGs that tests/test_user_experiment.py reads: a new user's experiments with none of the
packaged data, their own model directory (tiny random Qwen2, GPT-2 and Mistral models, built and saved here as a user
has them), their SFT, preference, RL-prompt and eval files, their reward file. (Not a conftest: tests/conftest.py
starts these DAGs when the Slurm scenario ends, so that they run beside the tests after it.)"""
import contextlib
import json
import random
import signal
import threading
from concurrent.futures import Future
from pathlib import Path

import pandas
import yaml
from mlflow.tracking import MlflowClient
from transformers import AutoTokenizer

from launcher.config import REPO_ROOT, deep_merge
from pipeline_helpers import finish_dag, snakemake, start_dag, write_config
from runtime.builtin_data import arithmetic_rows
from runtime.models import build_tiny

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


def build_user_model(out_dir: Path, architecture: str, texts: list[str], chat: bool) -> None:
    """A model directory as users have them: for qwen2, a chat model whose EOS (<|endoftext|>) is not its end of turn
    (<|im_end|>), as Qwen2's; for gpt2, a base model without a chat template."""
    build_tiny(out_dir, {"architecture": architecture, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                         "vocab_size": 400}, 0, texts)
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
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root / "config.yaml"


def run_result(root: Path, proc) -> dict:
    return {"root": root, "results": root / "results" / root.name, "proc": proc,
            "mlflow": MlflowClient(tracking_uri=f"sqlite:///{root / 'results' / 'mlflow.db'}")}


def qwen2_experiment(root: Path) -> dict:
    """Every stage through the user's Qwen2 chat model and files; PPO with the settings of a GPU cluster run that also
    work on CPU (two vLLM engines, ZeRO-3 with the reference and reward model sharded over two ranks, micro-batched
    forwards, gradient checkpointing): its files, model and config."""
    files = write_user_files(root / "my_data", chat=True)
    model_dir = root / "my-qwen2"
    build_user_model(model_dir, "qwen2", files["texts"], chat=True)
    ppo = {"zero_stage": 3, "frozen_ranks": 2, "forward_micro_batch_size": 4, "gradient_checkpointing": True,
           "vllm": {"num_engines": 2}}
    return {"root": root, "files": files, "model_dir": model_dir,
            "configfile": user_config(root, model_dir, files, chat=True, ppo=ppo)}


def given_experiment(root: Path, qwen2: dict) -> dict:
    """A second experiment on the Qwen2 run's model and files, given that run's SFT model and reward model (so it
    starts once that run has ended): GRPO with CISPO's loss from them, scored by the given reward model."""
    qwen2_results = qwen2["root"] / "results" / qwen2["root"].name
    given_sft, given_rm = qwen2_results / "sft", qwen2_results / "reward_model"
    configfile = user_config(
        root, qwen2["model_dir"], qwen2["files"], chat=True, sft={"from": str(given_sft)},
        reward_model={"from": str(given_rm)}, dpo=None,
        rl={"steps": 2, "eval_prompts": 8, "reward": "model",
            "variants": {"grpo": {"estimator": "group_norm", "policy_loss": "cispo"}}},  # CISPO's loss
        evaluate={"models": ["grpo"], "rewards": ["model"]})
    return {"root": root, "configfile": configfile, "given_sft": given_sft, "given_rm": given_rm}


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


ARITHMETIC_TEXTS = [f"{r['prompt']} {r['response']}" for r in arithmetic_rows("sft", 256, 0)]


def rl_only_experiment(root: Path) -> dict:
    """config/rl-verifiable-reward.yaml on a tiny given instruct model (Mistral): its model and config."""
    model_dir = root.parent / "my-mistral-instruct"
    build_user_model(model_dir, "mistral", ARITHMETIC_TEXTS, chat=True)
    overrides = {"model": {"path": str(model_dir)}, "data": {"prompts": {"max_samples": 64}},
                 "rl": {"steps": 4, "eval_prompts": 8, "learning_rate": 1.0e-3}, "evaluate": {"num_prompts": 16}}
    return {"root": root, "configfile": shipped_config("rl-verifiable-reward", root, **overrides), "overrides": overrides,
            "model_dir": model_dir}


# The runs by the name of the fixture that reads each; a run's experiment is made by its function (the given-model
# run's from the Qwen2 run's). Two chains, a DAG of each at a time (each DAG two stages at a time): a DAG leaves
# part of two cores idle (stage start-ups, stretches of one stage), which the other takes; more at once: memory.
EXPERIMENTS = {"qwen2_run": (qwen2_experiment, "user-qwen2"), "given_run": (given_experiment, "user-given"),
               "gpt2_run": (gpt2_experiment, "user-gpt2"), "rl_only_run": (rl_only_experiment, "rl-verifiable-reward")}
CHAINS = (("qwen2_run", "given_run"), ("gpt2_run", "rl_only_run"))
# Below the tests that run beside them (whose stages' start-up milestones and timers are measured): the DAGs take
# the cores those tests leave idle.
NICENESS = 10


@contextlib.contextmanager
def started(wanted: set[str], make_root):
    """Start the runs named in `wanted` (those a session's tests read; the Qwen2 run too when the given-model run
    is wanted), each in a folder `make_root(name)`; yields `result(name)`, which waits for that run to end and returns
    its experiment with its outputs and Snakemake's run (raising as run_dag if it failed). Each run's plan
    (`snakemake all --dry-run`) is made before it runs. Models are built here, in the calling thread: a tiny model's
    weights come from torch's global seed. On exit, DAGs still running are stopped as a user stops one (Ctrl-C)."""
    wanted = wanted | ({"qwen2_run"} if "given_run" in wanted else set())
    experiments, results = {}, {name: Future() for name in wanted}
    for name in (n for chain in CHAINS for n in chain if n in wanted):
        make, folder = EXPERIMENTS[name]
        root = make_root(name) / folder
        experiments[name] = make(root, experiments["qwen2_run"]) if name == "given_run" else make(root)
    running, stopping = {}, threading.Event()

    def run_chain(names):
        for name in names:
            experiment = experiments[name]
            try:
                if stopping.is_set():
                    raise RuntimeError("the session ended before this run started")
                plan = snakemake(experiment["configfile"], "all", "--dry-run").stdout
                running[name] = start_dag(experiment["configfile"], experiment["root"], NICENESS)
                proc = finish_dag(running[name], experiment["root"])
                results[name].set_result(experiment | run_result(experiment["root"], proc) | {"plan": plan})
            except BaseException as error:  # the chain's later runs fail with it (the given run needs the Qwen2 run)
                for rest in names[names.index(name):]:
                    results[rest].set_exception(error)
                return

    threads = [threading.Thread(target=run_chain, args=([n for n in chain if n in wanted],), daemon=True)
               for chain in CHAINS]
    for thread in threads:
        thread.start()
    try:
        yield lambda name: results[name].result()
    finally:
        stopping.set()
        for proc in list(running.values()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for thread in threads:
            thread.join()
