"""GPU placement and devices, checked on this CPU machine.

1. Every training and log-prob path keeps its tensors on the model's device: the workers' losses run with the
   model on the `meta` device, where a tensor left on the CPU (a batch not moved, a mask or constant built on the
   CPU) raises.
2. Ray started with GPUs declared: each trainer rank, frozen-model rank and vLLM engine gets its own GPU ids and
   the CUDA_VISIBLE_DEVICES that follows from them; colocated roles share the GPUs of one placement group; a
   tensor-parallel engine names its bundles for vLLM's Ray workers.
   rl.vllm.sleep's cycle (the held-out reward, step 0 with a dynamic-sampling round, a sync, the held-out reward
   again) against an engine with vLLM 0.32's sleep and wake_up semantics: every generation runs on the weights the
   policy last sent (it waited forever at step 0 when only the KV cache woke).
3. A rank's process leaves out the MLflow and scikit-learn that DeepSpeed and transformers would import.
"""
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification

from launcher import resources
from launcher.config import stage_config, validate_config
from runtime.actor_group import ActorGroup, bundles, reserve
from runtime.experience import Rollout
from runtime.logprobs import response_logprobs
from runtime.rl_actors import CriticWorker, PolicyWorker, Roles
from runtime import models
from runtime.rollout import ENGINE_ACTOR_GPU, engine_options, engine_placement, start_engines
from stages import dpo, reward_model, rl, sft

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     pad_token_id=0)


class Tokenizer:
    """Enough of a tokenizer for pair and SFT batches: one id per character."""
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % 60 for c in text]}


def on_meta(model_cls):
    with torch.device("meta"):  # eager attention: sdpa's mask helper reads mask values, which meta tensors lack
        return model_cls._from_config(CONFIG, attn_implementation="eager")


def rollout() -> Rollout:
    responses = [[8, 9, 10, 11], [12, 13]]
    per_token = lambda value: [[value] * len(r) for r in responses]
    return Rollout.of([[5, 6, 7], [5, 6]], responses, advantages=per_token(1.0), ref_logp=per_token(-4.0),
                      rollout_logp=per_token(-4.1), old_logp=per_token(-4.05), old_values=per_token(0.1),
                      returns=per_token(0.5))


PAIRS = [{"prompt": "ab", "chosen": "good", "rejected": "bad", "margin": 1.0},
         {"prompt": "cd", "chosen": "fine", "rejected": "poor", "margin": 0.5}]


def test_losses_and_logprobs_stay_on_the_models_device():
    policy = PolicyWorker()
    policy.engine, policy.pad_id = on_meta(LlamaForCausalLM), 0
    policy.cfg = stage_config(rl, {"rl": {"entropy_coef": 0.01, "kl_in_reward": False, "kl_coef": 0.1}})
    loss, stats = policy.loss(rollout())
    # (the token counts are the host's ints)
    assert loss.device.type == "meta" and all(v.device.type == "meta" for v in stats.values() if torch.is_tensor(v))

    critic = CriticWorker()
    critic.engine, critic.pad_id, critic.cfg = on_meta(LlamaForTokenClassification), 0, policy.cfg
    assert critic.loss(rollout())[0].device.type == "meta"

    logp, mask = response_logprobs(policy.engine, rollout().tokens(0))
    assert logp.device.type == "meta" and mask.device.type == "meta"

    worker = sft.SFTWorker()  # (packed forwards: transformers reads the position ids' values, which meta lacks)
    worker.engine, worker.tokenizer, worker.cfg = policy.engine, Tokenizer(), stage_config(sft, {})
    assert worker.loss([{"prompt": p["prompt"], "response": p["chosen"]} for p in PAIRS])[0].device.type == "meta"

    for loss_name in ("dpo", "kto"):
        worker = dpo.DPOWorker()
        worker.engine, worker.tokenizer = policy.engine, Tokenizer()
        worker.cfg = stage_config(dpo, {"dpo": {"loss": loss_name, "nll_weight": 0.1}})
        reference_logps = lambda rows: [dict.fromkeys(dpo.REFERENCE_KEYS, -5.0) for _ in rows]
        rows = dpo.with_reference(PAIRS, loss_name, reference_logps)
        assert worker.loss(rows)[0].device.type == "meta", loss_name

    worker = reward_model.RewardWorker()
    worker.engine, worker.tokenizer = on_meta(LlamaForSequenceClassification), Tokenizer()
    worker.cfg = stage_config(reward_model, {"reward_model": {"use_margin": True}})
    assert worker.loss(PAIRS)[0].device.type == "meta"


def test_bf16_on_a_cpu_needs_its_native_bf16_instructions(monkeypatch):
    """Without GPUs precision auto is bf16 where the CPU has AMX or AVX-512 BF16 and fp32 where it has neither; bf16
    there is refused (by the launcher for this machine's jobs, by the stage where it starts) unless the environment
    asks for emulated bf16 (the tests' bf16 runs on any CPU), and auto stays fp32 then. On GPUs auto is bf16."""
    if torch.cuda.is_available():
        pytest.skip("a CPU-only check")
    monkeypatch.delenv(models.EMULATED_BF16, raising=False)
    assert set(models.cpu_bf16_flags()) <= set(models.NATIVE_BF16_FLAGS)
    assert models.model_dtype("auto") == ("bfloat16" if models.cpu_bf16_flags() else "float32")  # this machine's
    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    assert (models.model_dtype("bf16"), models.model_dtype("auto"), models.model_dtype("fp32")) == \
        ("bfloat16", "bfloat16", "float32")
    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: [])
    assert (models.model_dtype("auto"), models.model_dtype("fp32"), models.model_dtype("auto", gpus=True)) == \
        ("float32", "float32", "bfloat16")
    assert [models.resolved_precision(p, gpus=True) for p in ("auto", "bf16", "fp32")] == ["bf16", "bf16", "fp32"]
    with pytest.raises(ValueError, match="precision bf16 on a CPU needs its native bf16 instructions"):
        models.model_dtype("bf16")
    launcher = validate_config({})["launcher"]
    job, sources = resources.stage_resources("sft", launcher)
    params = {"sft": {"precision": "bf16", "num_workers": 1}}
    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: ["amx_bf16"])
    resources.check_fits("sft", params, job, sources)
    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: [])
    with pytest.raises(resources.LaunchConfigError, match=r"sft.precision = 'bf16' on this machine's CPU"):
        resources.check_fits("sft", params, job, sources)
    resources.check_fits("sft", params, job | {"cluster": "slurm"}, sources)  # a Slurm CPU node's: the stage checks
    monkeypatch.setenv(models.EMULATED_BF16, "1")
    resources.check_fits("sft", params, job, sources)
    assert (models.model_dtype("bf16"), models.model_dtype("auto")) == ("bfloat16", "float32")


def test_bf16_on_a_cpu_keeps_fp32_weights_under_autocast(tmp_path):
    """bf16 on a CPU is fp32 weights whose forwards run under bf16 autocast (bf16 weights trained worse there:
    runtime/models._load): the weights stay fp32, the matrix products are bf16."""
    if torch.cuda.is_available():
        pytest.skip("a CPU-only check")
    LlamaForCausalLM(CONFIG).save_pretrained(tmp_path)
    model = models.load_causal_lm(tmp_path, "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ids = torch.tensor([[1, 2, 3]])
    assert model(input_ids=ids).logits.dtype == torch.bfloat16
    assert models.load_causal_lm(tmp_path, "float32")(input_ids=ids).logits.dtype == torch.float32


def test_engine_options_and_placements_follow_the_config(tmp_path):
    vllm = validate_config({"rl": {"vllm": {"num_engines": 2, "tensor_parallel_size": 2}}})["rl"]["vllm"]
    (tmp_path / "config.json").write_text("{}")
    cpu = engine_options(str(tmp_path), 0, 128, vllm, on_gpu=False, dtype="float32", shares_gpu=False)
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] and "tensor_parallel_size" not in cpu
    assert engine_options(str(tmp_path), 0, 128, vllm, on_gpu=False, dtype="bfloat16", shares_gpu=False)["dtype"] == \
        "bfloat16"  # (precision bf16 on a CPU with native bf16)
    gpu = engine_options(str(tmp_path), 0, 128, vllm, on_gpu=True, dtype="bfloat16", shares_gpu=True)
    assert (gpu["dtype"], gpu["tensor_parallel_size"], gpu["distributed_executor_backend"]) == ("bfloat16", 2, "ray")
    assert gpu["gpu_memory_utilization"] == 0.5 and gpu["enforce_eager"] is False and gpu["enable_prefix_caching"]
    assert engine_options(str(tmp_path), 0, 128, vllm, True, "bfloat16", shares_gpu=False)["gpu_memory_utilization"] == 0.9
    placed = engine_placement([2, 3], 0.25)
    assert (placed["bundle"], placed["num_gpus"], placed["env"]["VLLM_RAY_BUNDLE_INDICES"]) == (2, ENGINE_ACTOR_GPU,
                                                                                               "2,3")
    # the engine's actor and its worker in bundle 2 together take the bundle's share, no more
    assert float(placed["env"]["VLLM_RAY_PER_WORKER_GPUS"]) + ENGINE_ACTOR_GPU == pytest.approx(0.25)
    assert engine_placement([1], 1.0) == {"bundle": 1, "num_gpus": 1.0, "env": {}}


class Probe:
    """Stands in for a rank or an engine: what Ray gave it (ActorGroup adds actor_group_where)."""

    def __init__(self, *args):
        self.args = args

    def rendezvous_address(self):
        return "127.0.0.1", 0

    def devices(self) -> dict:
        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "bundle_indices": os.environ.get("VLLM_RAY_BUNDLE_INDICES")}


@pytest.fixture(scope="module")
def ray_with_gpus():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ray.init(num_cpus=2, num_gpus=8, include_dashboard=False, logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ray-test-", dir="/tmp"))
    yield
    ray.shutdown()


@pytest.mark.e2e
def test_each_rank_and_engine_gets_its_own_gpu(ray_with_gpus):
    trainers = ActorGroup(Probe, 4, cpus_per_actor=0.1, gpus_per_actor=1)
    frozen = ActorGroup(Probe, 2, cpus_per_actor=0.1, gpus_per_actor=1)
    vllm = validate_config({})["rl"]["vllm"] | {"num_engines": 2}
    engines = start_engines("model", 0, 64, vllm, 1, 0.1, gpus=True, engine_cls=Probe)
    seen = trainers.call("devices") + frozen.call("devices") + ray.get([e.devices.remote() for e in engines])
    ids = [tuple(s["gpu_ids"]) for s in seen]
    assert all(len(i) == 1 for i in ids) and len(set(ids)) == 8, seen  # eight distinct GPUs of the eight declared
    assert all(s["visible"] == s["gpu_ids"][0] for s in seen), "each process sees its own GPU only, as device 0"
    assert [p["gpu_ids"] for p in trainers.placements] == [s["gpu_ids"] for s in seen[:4]]
    for group in (trainers, frozen):
        group.shutdown()
    for engine in engines:
        ray.kill(engine)


@pytest.mark.e2e
def test_colocated_roles_share_each_gpu(ray_with_gpus):
    shared = reserve(bundles(4, 0.4, 1), "PACK", "colocated roles")
    policy = ActorGroup(Probe, 4, cpus_per_actor=0, gpus_per_actor=1 / 3, shared=shared)
    reference = ActorGroup(Probe, 4, cpus_per_actor=0, gpus_per_actor=1 / 3, shared=shared)
    vllm = validate_config({})["rl"]["vllm"] | {"num_engines": 2, "tensor_parallel_size": 2}
    engines = start_engines("model", 0, 64, vllm, 1, 0, gpus=True, shared=shared, gpu_share=1 / 3, engine_cls=Probe)
    ranks = [s["gpu_ids"] for s in policy.call("devices")]
    assert len({tuple(r) for r in ranks}) == 4
    assert [s["gpu_ids"] for s in reference.call("devices")] == ranks, "rank i of every role on bundle i's GPU"
    tp = ray.get([e.devices.remote() for e in engines])
    assert [t["bundle_indices"] for t in tp] == ["0,1", "2,3"]
    assert [(t["gpu_ids"], t["visible"]) for t in tp] == [(ranks[0], ranks[0][0]), (ranks[2], ranks[2][0])], \
        "a tensor-parallel engine sees the GPU of its first bundle"
    for engine in engines:
        ray.kill(engine)
    policy.shutdown()
    reference.shutdown()
    ray.util.remove_placement_group(shared)


class SleepingEngine:
    """A GPU engine's sleep and wake-up as vLLM 0.32 does them (vllm/v1/engine/core.py, vllm/v1/executor/abstract.py,
    vllm/v1/worker/gpu_worker.py), with VLLMEngine's methods: sleep(level) frees weights and KV cache, level 1 keeping
    the weights in CPU memory, level 2 discarding them (they come back as unset memory, here None); a second sleep
    does nothing; wake_up(tags) brings back those tags (None: all), none if a tag is not asleep; the scheduler
    resumes only once nothing sleeps, and until then a request waits (LLM.generate loops, forever: here WAIT_S).
    Weights are the version number the policy sends."""
    WAIT_S = 2.0

    def __init__(self):
        self.sleeping, self.weights, self.cpu_copy, self.used = set(), 0, None, []

    def sleep(self, level: int = 1) -> None:
        if "weights" not in self.sleeping:
            self.cpu_copy, self.weights = (self.weights if level == 1 else None), None
            self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags=None) -> bool:
        tags = set(tags or self.sleeping)
        if self.sleeping and tags <= self.sleeping:
            if "weights" in tags:
                self.weights = self.cpu_copy
            self.sleeping -= tags
        return not self.sleeping

    def receive(self, version: int) -> None:
        assert "weights" not in self.sleeping, "a weight loaded into memory vLLM has unmapped"
        self.weights = version

    def finish_weight_update(self) -> None:
        pass

    def generate(self, prompt_token_ids, n, temperature, top_p, max_new_tokens, seed, ignore_eos=False, seeds=None):
        deadline = time.monotonic() + self.WAIT_S
        while self.sleeping:  # (nothing can wake it while this call runs: the actor runs one call at a time)
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's scheduler stays paused while {sorted(self.sleeping)} sleep: generate waits")
            time.sleep(0.05)
        self.used.append(self.weights)
        return [[{"token_ids": [1 + j], "text": f"response {j}", "truncated": False, "logprobs": [-1.0]}
                 for j in range(n)] for _ in prompt_token_ids]

    def weights_used(self) -> list:
        return self.used


class SleepPolicy:
    """The policy's ActorGroup as Roles calls it: offload and reload of its states, and send_weights, which hands the
    engines its weights' version."""

    def __init__(self):
        self.version, self.calls = 0, []

    def call(self, method: str, *args):
        self.calls.append(method)
        if method == "send_weights":
            engines, _mode = args
            ray.get([engine.receive.remote(self.version) for engine in engines])
        return [None]


@pytest.mark.e2e
def test_sleeping_engines_generate_with_the_weights_last_sent(ray_with_gpus):
    engines = [ray.remote(SleepingEngine).remote() for _ in range(2)]
    roles = Roles.__new__(Roles)  # Roles' own sleep, wake and sync, its actors stood in for
    policy = SleepPolicy()
    roles.sleeps, roles.engines_asleep, roles.engines, roles.weight_mode = True, set(), engines, "ipc"
    roles.policy, roles.trainers, roles.reward_model, roles.reward_file = policy, {"policy": policy}, None, "equal.py"
    roles.reward_fn = lambda prompts, completions, labels: [1.0] * len(completions)  # every group uninformative
    roles.episodes = roles.teacher = None
    cfg = stage_config(rl, {"rl": {"n_samples": 2, "rollout_batch_size": 2, "batch_size": 4, "micro_batch_size": 2,
                                   "dynamic_sampling": True,
                                   "max_generation_rounds": 2}})
    prompts = [{"id": i, "prompt": f"p{i}", "prompt_ids": [3, 4 + i]} for i in range(4)]

    assert rl.held_out_reward(roles, cfg, prompts) == {"eval_reward": 1.0}
    rollout, _, _, counts = rl.sample_step(roles, cfg, prompts[:2], lambda k: prompts[:k], seed=0)
    assert counts["generation_rounds"] == 2 and len(rollout) == 4
    policy.version = 1  # trained
    roles.sync_weights()
    rl.held_out_reward(roles, cfg, prompts)
    # the held-out reward, step 0's two rounds, then the held-out reward after the update, each on the policy's
    # weights (None: memory that sleep level 2 discarded)
    assert [ray.get(engine.weights_used.remote()) for engine in engines] == [[0, 0, 0, 1]] * 2
    assert roles.engines_asleep == {"weights", "kv_cache"}, "asleep after generating: the trainers have the GPUs"
    generations = [i for i, call in enumerate(policy.calls) if call == "offload_states"]
    assert len(generations) == 4 and all(policy.calls[i + 1] == "reload_states" for i in generations), policy.calls
    assert policy.calls.count("send_weights") == 3, "resent before step 0 and its second round, sent once trained"
    for engine in engines:
        ray.kill(engine)


def test_a_ranks_process_leaves_out_mlflow_and_scikit_learn():
    """DeepSpeed's autotuner imports MLflow, transformers' assisted generation scikit-learn, each costing every
    process seconds of CPU; a rank's process, as a Ray worker starts it (the actors' module, then joining its group
    and loading a model), imports neither, and can still import both."""
    rank = """
import socket, sys
from runtime.rl_actors import PolicyWorker
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
worker = PolicyWorker()
worker.init_distributed(0, {"master_addr": "127.0.0.1", "master_port": port, "world_size": 1}, 1)
from transformers import AutoModelForCausalLM, LlamaConfig
model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=2))
import torch
from deepspeed.autotuning import autotuner
print("group", torch.distributed.get_world_size(), "mlflow" in sys.modules, autotuner.has_mlflow,
      "sklearn" in sys.modules)
import mlflow, sklearn.metrics
print("later", mlflow.MlflowClient.__name__, sklearn.metrics.roc_curve.__name__)
"""
    proc = subprocess.run([sys.executable, "-c", rank], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "group 1 False False False" in proc.stdout and "later MlflowClient roc_curve" in proc.stdout, proc.stdout
