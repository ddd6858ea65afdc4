"""What the GPU path needs, checked on CPU (issue #22): the ZeRO-3 trainers' states leave and come back around vLLM's
generation (rl.vllm.sleep) with torch's AdamW and no change to training; save_hf never gathers more than one module
under ZeRO-3 and writes the same files as before; the frozen models hand cached memory back after their forwards;
token log-probs and entropies at a 128k vocabulary stay within a stated memory bound, with the same values and
gradients; and every loader returns a model without dropout. What only a GPU shows (memory actually freed on the
device, pinned copies) is left to the one-GPU check, tests/gpu/check_training.py."""
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from launcher.config import stage_config
from runtime import models, rl_actors
from runtime.deepspeed_strategy import Rank
from runtime.logprobs import LOGITS_CHUNK_BYTES, entropy_from_logits, token_logprobs
from runtime.rl_actors import FrozenScorer, PolicyWorker
from stage_helpers import rollout
from stages import rl

REPO = Path(__file__).resolve().parent.parent
TEXTS = ["a small corpus for a small tokenizer, with some more words in it"] * 20


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-3 policy ranks (world size 1 over gloo, in this process), built by PolicyWorker.setup as the rl stage does

@pytest.fixture(scope="module")
def one_rank():
    """A free rendezvous for one rank; afterwards the process group, the ZeRO-3 HF config, the environment variables
    and torch's thread count are as they were (the rest of the suite runs in this process)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    environ, threads = dict(os.environ), torch.get_num_threads()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield {"master_addr": "127.0.0.1", "master_port": port, "world_size": 1}
    unset_hf_deepspeed_config()
    if torch.distributed.is_initialized():
        import deepspeed.comm  # (DeepSpeed's own: it also drops the groups it keeps, which later tests would reuse)
        deepspeed.comm.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """hidden 160: the MLP weights (160 x 640) exceed ZeRO-3's persistence threshold (1e5 elements) and are
    partitioned; smaller tensors stay whole on every rank. Tied embeddings, as build_tiny makes them."""
    model_dir = tmp_path_factory.mktemp("llama")
    models.build_tiny(model_dir, {"hidden_size": 160, "num_layers": 2, "num_heads": 2, "vocab_size": 300}, 0, TEXTS)
    return model_dir


def zero3_policy(rendezvous, model_dir, lora_rank: int = 0) -> PolicyWorker:
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    lora = {"lora_rank": lora_rank, "lora_alpha": 2 * lora_rank, "lora_targets": "all-linear"} if lora_rank else {}
    cfg = stage_config(rl, {"rl": {"zero_stage": 3, "num_workers": 1, "batch_size": 4, "micro_batch_size": 4,
                                   "learning_rate": 1e-2, "warmup_steps": 0, "kl_in_reward": False, "kl_coef": 0.1,
                                   "precision": "fp32", **lora}})  # (the same on every CPU)
    worker = PolicyWorker()
    worker.setup(cfg, Rank(0, rendezvous, 1, str(model_dir), 8))
    unset_hf_deepspeed_config()  # the model is built: later loads in this process must not be ZeRO-3 partitioned
    return worker


def test_zero3_states_offload_and_reload_without_changing_training(one_rank, tiny_llama):
    """rl.vllm.sleep: DeepSpeed's own offload_states asserts its FusedAdam (a CUDA build) for optimizer states and
    master weights; the trainers' torch AdamW states move without it, and training is bit-identical on CPU."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    plain, offloaded = zero3_policy(one_rank, tiny_llama), zero3_policy(one_rank, tiny_llama)
    assert type(offloaded.engine.optimizer.optimizer) is torch.optim.AdamW
    plain_losses, offloaded_losses, moved = [], [], []
    for _ in range(3):  # as the rl stage runs: generation (states offloaded) before every step, the first too
        before = [t.data_ptr() for t in offloaded.optimizer_tensors()]
        moved.append(len(before))
        offloaded.offload_states()
        # The master weights and the optimizer's states moved (fresh CPU storage here, CPU memory on GPUs); DeepSpeed
        # moved the gradient buffers.
        assert all(t.device.type == "cpu" and t.data_ptr() != p for t, p in zip(offloaded.optimizer_tensors(), before))
        assert OffloadStateTypeEnum.lp_grads in offloaded.engine.optimizer.offloaded_states
        offloaded.reload_states()
        assert not offloaded.engine.optimizer.offloaded_states and not offloaded.offloaded
        offloaded_losses.append(offloaded.train_step([rollout()])["policy_loss"])
        plain_losses.append(plain.train_step([rollout()])["policy_loss"])
    assert moved[0] < moved[1] == moved[2]  # torch's AdamW makes its states at the first step
    assert offloaded_losses == plain_losses and len(set(plain_losses)) == 3  # the steps train


def safetensors_of(model_dir) -> dict:
    return {name: t for path in sorted(Path(model_dir).glob("*.safetensors")) for name, t in load_file(path).items()}


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_zero3_save_hf_gathers_one_module_at_a_time(one_rank, tiny_llama, tmp_path, monkeypatch, lora_rank):
    """At 70B one gather of every parameter is the whole model (141 GB in bf16) on every rank. Counted here: at every
    gather, the partitioned parameters whose full weights are present (ds_status AVAILABLE) belong to one module."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus
    from runtime.lora import merged_state_dict
    worker = zero3_policy(one_rank, tiny_llama, lora_rank)
    worker.train_step([rollout()])  # LoRA's B matrices start at 0: after a step the merged weights differ
    model = worker.engine.module
    owner = {}  # parameter -> the module that holds it (a tied weight: its first)
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), name)
    partitioned = [p for p in model.parameters() if not p.ds_persist]
    assert len(partitioned) >= 6 and all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in partitioned)
    gathered_modules = []
    real_enter = GatheredParameters.__enter__

    def counting_enter(self):
        real_enter(self)
        gathered_modules.append({owner[id(p)] for p in partitioned if p.ds_status == ZeroParamStatus.AVAILABLE})

    monkeypatch.setattr(GatheredParameters, "__enter__", counting_enter)
    worker.save_hf(str(tmp_path / "saved"), str(tiny_llama))
    assert gathered_modules and max(map(len, gathered_modules)) == 1, gathered_modules
    monkeypatch.undo()

    # The same files as the previous save_hf wrote (everything gathered, then save_pretrained from the module).
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        model.save_pretrained(tmp_path / "before", state_dict=merged_state_dict(model) if lora_rank else None,
                              safe_serialization=True)
    assert sorted(p.name for p in (tmp_path / "saved").glob("*.safetensors")) == ["model.safetensors"]
    saved, before = safetensors_of(tmp_path / "saved"), safetensors_of(tmp_path / "before")
    assert saved.keys() == before.keys() and "lm_head.weight" not in saved  # tied to the embeddings
    for name in saved:
        assert saved[name].dtype == before[name].dtype and torch.equal(saved[name], before[name]), name
    # It loads as a plain model that computes what the trained engine computes.
    batch = rollout().tokens(worker.pad_id)
    loaded = models.load_causal_lm(tmp_path / "saved").eval()
    worker.engine.eval()
    with torch.no_grad():
        want = worker.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Frozen models

def test_frozen_forwards_release_cached_memory(monkeypatch):
    """Each call of the reference's log-probs and the reward model's scores hands the allocator's cache back once
    (a no-op on CPU; the real check, GPU memory freed, belongs in tests/gpu/check_training.py)."""
    releases = []
    monkeypatch.setattr(rl_actors, "release_cached_memory", lambda: releases.append(1))
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, pad_token_id=0)
    reference, reward = FrozenScorer(), FrozenScorer()
    reference.model = transformers.LlamaForCausalLM(config).eval()
    reward.model = transformers.LlamaForSequenceClassification(config).eval()
    reference.tokenizer = reward.tokenizer = types.SimpleNamespace(pad_token_id=0)
    reference.forward_micro_batch_size = reward.forward_micro_batch_size = 2  # two forwards per call
    reference.logprobs(rollout())
    assert len(releases) == 1
    reward.scores(rollout())
    assert len(releases) == 2


# ---------------------------------------------------------------------------------------------------------------
# Log-probs and entropy over the full vocabulary, chunked

def reference_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def reference_entropy(logits):
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_unchunked_with_gradients(dtype):
    torch.manual_seed(0)
    full = (3 * torch.randn(3, 9, 50)).to(dtype).requires_grad_()
    logits = full[:, :-1]  # as response_logits gives them: a view that is not contiguous
    labels = torch.randint(0, 50, (3, 8))
    weights = torch.randn(3, 8)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    got = token_logprobs(logits, labels, max_bytes=3 * 50 * 4)  # 3 positions a chunk: rows split into pieces
    (got * weights).sum().backward()
    got_grad, full.grad = full.grad, None
    want = reference_logprobs(logits, labels)
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, full.grad, **tolerance)
    entropy = entropy_from_logits(logits, max_bytes=3 * 50 * 4)
    torch.testing.assert_close(entropy, reference_entropy(logits), rtol=1e-5, atol=1e-5)


def test_entropy_gradient_through_chunks():
    """An entropy bonus (entropy_coef) trains through the chunked entropy."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 40, requires_grad=True)
    entropy_from_logits(logits, max_bytes=2 * 40 * 4).sum().backward()
    got, logits.grad = logits.grad, None
    reference_entropy(logits).sum().backward()
    torch.testing.assert_close(got, logits.grad, rtol=1e-5, atol=1e-6)


MEASURE_PEAK = """
import json, sys, torch
from runtime.logprobs import entropy_from_logits, token_logprobs

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

def extra_peak(fn):
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak resident set size (VmHWM)
    base = status("VmRSS:")
    fn()
    return status("VmHWM:") - base

rows, positions, vocab = json.loads(sys.argv[1])
full = torch.empty(rows, positions + 1, vocab, dtype=torch.bfloat16).normal_()
labels = torch.randint(0, vocab, (rows, positions))
out = {}
with torch.no_grad():
    out["logprobs"] = extra_peak(lambda: token_logprobs(full[:, :-1], labels))
    out["entropy"] = extra_peak(lambda: entropy_from_logits(full[:, :-1]))
full.requires_grad_()
out["train"] = extra_peak(lambda: token_logprobs(full[:, :-1], labels).sum().backward())
print(json.dumps(out))
"""


def test_logprobs_at_a_128k_vocabulary_stay_within_the_memory_bound():
    """2 rows of 320 positions at a 128k vocabulary: 160 MiB of bf16 logits, whose unchunked float32 copy alone is
    320 MiB. Peak resident memory beyond the input, measured in a fresh process: at most 4 chunks (the docstrings'
    bound) without autograd; with the backward pass, plus the logits' gradient (twice the input's size: ours, and
    the slice's backward into the whole logits)."""
    rows, positions, vocab = 2, 320, 128 * 1024
    proc = subprocess.run([sys.executable, "-c", MEASURE_PEAK, json.dumps([rows, positions, vocab])], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.splitlines()[-1])
    logits_bytes = rows * (positions + 1) * vocab * 2
    print({key: round(value / 2**20) for key, value in peak.items()}, "MiB; bound", 4 * LOGITS_CHUNK_BYTES // 2**20)
    assert peak["logprobs"] <= 4 * LOGITS_CHUNK_BYTES
    assert peak["entropy"] <= 4 * LOGITS_CHUNK_BYTES
    assert peak["train"] <= 2 * logits_bytes + 4 * LOGITS_CHUNK_BYTES


# ---------------------------------------------------------------------------------------------------------------
# Dropout

@pytest.fixture(scope="module")
def models_with_dropout(tmp_path_factory):
    """A GPT-2 with its usual 0.1 dropouts and a Llama saved with attention_dropout 0.1."""
    root = tmp_path_factory.mktemp("dropout")
    tokenizer = models.train_tiny_tokenizer(TEXTS, 300)
    special = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    configs = {
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.1,
                                        embd_pdrop=0.1, attn_pdrop=0.1, **special),
        "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, attention_dropout=0.1, **special),
    }
    dirs = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


@pytest.mark.parametrize("loader", [models.load_causal_lm, models.load_reward_model, models.load_value_model])
@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_loaders_turn_dropout_off(models_with_dropout, tmp_path, loader, architecture):
    """In train mode (as the trainers run) two forwards give the same outputs, and a saved model says so."""
    model = loader(models_with_dropout[architecture]).train()
    batch = {"input_ids": torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]] * 2), "attention_mask": torch.ones(2, 8, dtype=int)}
    first = model(**batch).logits
    second = model(**batch).logits
    assert torch.equal(first, second)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    rates = {key: value for key, value in saved.items() if "dropout" in key or "pdrop" in key}
    assert rates and all(value == 0 for value in rates.values() if isinstance(value, float)), rates
