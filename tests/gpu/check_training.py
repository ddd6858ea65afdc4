"""One-GPU check of the training side (issues #16, #22): every GPU call of alignpipe that one GPU can run, in bf16.

    python tests/gpu/check_training.py [--out results.json] [--peak-tflops T]   # repository root; one CUDA GPU

Estimated 4-6 minutes on one H200 (sized to stay under 8; not yet run on a GPU). Needs only Python with torch built
for CUDA, transformers and DeepSpeed: no Ray, vLLM or network. Where DeepSpeed (or a package it or the config code
needs) is missing, carry the wheels that tests/gpu/build_wheels.sh puts in tests/gpu/wheels/ and the check unpacks
them into a temporary directory itself (tests/gpu/README.md). Exit status 0: every check passed; 1: one failed (the
JSON's `failures` says which); 2: it could not run (no GPU).

Each worker (SFTWorker, RewardWorker, DPOWorker, PolicyWorker, CriticWorker) runs in a process of its own (the default
process group is created once per process, and a ZeRO-3 worker's HfDeepSpeedConfig is process-global in transformers:
neither may leak into the next worker), built by `setup` from a Config made by launcher.config.stage_config (the
schema's defaults; lora off, gradient checkpointing on, ZeRO-3 for DPO and the policy, ZeRO-2 for the others; learning
rate LEARNING_RATE without warm-up, so that a few steps move the losses), on world size 1 over NCCL. The report's
`checks`, one per GPU path:

- steps_vs_fp32: a small Llama (hidden 256, 4 layers) for STEPS["check"] optimizer steps (2 micro-batches each) in
  bf16 on the GPU, and the same steps in fp32 on the CPU over gloo (in parallel); every step's losses within each
  worker's tolerance of fp32's (what they are and why: at STEP_RTOL);
- mfu: a ~300 M-parameter Llama (hidden 1536, 8 layers) per worker, 5 steps: step time, tokens/s, model TFLOP/s
  (6 * parameters * tokens trained over the median step time after the first; gradient checkpointing's recomputation
  not counted; DPO's reference log-probs are computed before the steps, as the stage does) and MFU against the GPU's
  dense bf16 peak (--peak-tflops, or PEAK_BF16_TFLOPS by the name torch gives the GPU);
- on the ZeRO-3 PolicyWorker, at both sizes:
  - frozen_zero3: the rl stage's frozen reference and reward model (FrozenScorer with zero_stage 3 and frozen_ranks
    1, as Roles sets them up) score the rollout; the GPU memory their forwards cached (memory_reserved's peak above
    its level before the call) is handed back by the end of each call; the reference's log-probs equal the policy's
    before its first update (PolicyWorker.logprobs through the ZeRO-3 engine);
  - save_hf_peak: the ZeRO-3 per-module gather (runtime.weight_sync.hf_weights, which the weight sync and save_hf
    use): partitioned parameters, the Hugging Face names and shapes, bit-equal to save_hf's export; save_hf's peak
    GPU memory above the rank's shard (max_memory_allocated) at most one module's full weights;
  - cuda_ipc: runtime.weight_sync.send_weights in its `ipc` mode to a second process on the same GPU, which opens
    each handle with weight_sync.WorkerExtension.receive_ipc (the method vLLM's workers run) and holds a copy; every
    tensor it received equals the export, bit for bit (vLLM's side is a stand-in: its worker's load_weights copies
    the tensor; Ray's remote call and ray.get are answered synchronously by that process);
  - offload_reload: rl.vllm.sleep's DeepSpeedWorker.offload_states / reload_states on two fresh ZeRO-3 policies
    trained on the same batches, one offloaded and reloaded before every step: GPU memory allocated before, after
    offloading (freed at least the fp32 master weights and AdamW states moved, into pinned host memory) and after
    reloading, and the losses of every step equal the plain policy's, bit for bit;
- logprobs_128k: runtime.logprobs.token_logprobs (chunked) at a 128k vocabulary, 16 rows of 1024 positions: peak GPU
  memory and time of the forward and of forward + backward, against the unchunked formula it replaced; the values
  and gradients agree.

Ray: the workers' modules import ray at module level; tests/gpu/ray_placeholder.py lets them import without it and
fails on any use (ALIGNPIPE_GPU_CHECK_FAKE_RAY=1 forces the placeholder where Ray is installed, as CI does).

    python tests/gpu/check_training.py --cpu [--out results.json]  # fp32 on CPU, tiny sizes: about 1 min on 2 cores

--cpu runs what a CPU can on a CPU-only machine (tests/test_gpu_check.py, in CI): each worker once on a tiny model
(its run its own reference: steps_vs_fp32 and mfu are skipped), the policy's parts at that size and the log-probs at
2 rows of 160 positions; what needs CUDA (memory statistics, pinned memory, CUDA IPC) is reported as skipped or not
measured, with the reason. Results go to --out as JSON (written after every run, so a run cut short keeps what it
measured): GPU name, versions, every run's losses and step times, and `checks`.
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(HERE))

SEED = 0
MAX_POSITIONS = 512  # runtime.models.build_tiny's max_position_embeddings
# Model sizes (runtime.models.build_tiny; the vocabulary is a BPE trained on the arithmetic texts: 480 tokens) and the
# batches each size trains on: rows of about prompt + response tokens, micro-batches of `micro` rows (pairs for the
# reward model and DPO: 2 * micro sequences), `batch` rows per optimizer step.
SIZES = {
    # tiny: hidden 160 so that the MLP's weights (160 x 640) pass ZeRO-3's persistence threshold and are partitioned
    "tiny": dict(model=dict(hidden_size=160, num_layers=2, num_heads=2), prompt=24, response=8, micro=2, batch=4),
    "check": dict(model=dict(hidden_size=256, num_layers=4, num_heads=4), prompt=96, response=32, micro=4, batch=8),
    # ~300 M parameters (16 * 1536^2 per layer): GEMMs wide enough for a meaningful MFU, seconds per worker
    "bench": dict(model=dict(hidden_size=1536, num_layers=8, num_heads=12), prompt=352, response=96, micro=8,
                  batch=16),
}
STEPS = {"tiny": 2, "check": 5, "bench": 5}
VOCAB = 1024  # asked of the BPE; the arithmetic texts give fewer
# Every worker trains at this rate, without warm-up (the schema's defaults, 1e-6 to 2e-5 after 4 warm-up steps, would
# hardly move a loss in 5 steps, and a step that did not update would then go unnoticed).
LEARNING_RATE = 1e-3
TRAINING = {"learning_rate": LEARNING_RATE, "warmup_steps": 0}
RL_OVERRIDES = {"kl_in_reward": False, "kl_coef": 0.05, "kl_estimator": "k3",  # the KL as a loss term: more code runs
                "critic_learning_rate": LEARNING_RATE}
# bf16 on the GPU against fp32 on the CPU, every step's losses: |device - reference| <= rtol * |reference| + STEP_ATOL,
# rtol the worker's `step_rtol`. Why: bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 0.2 %), with fp32
# accumulation in the matrix products and fp32 master weights in the optimizer. Before the first update the
# difference is the forward's rounding alone; after it the bf16 run follows its own trajectory: Adam's first steps are
# about lr * sign(gradient) per element, and an element whose gradient is near zero gets +lr in one run and -lr in
# the other. Measured on a CPU, bf16 against fp32 with these models, rates and batches (STEP_CALIBRATION), the largest
# relative difference over the 5 steps was 0.04-0.6 % for SFT, DPO, the policy and the reward model and 3.4 % for the
# critic, whose fresh value head leaves the backbone tiny gradients, so that many of them flip (its value loss swings
# 0.23 -> 3.6 -> 0.33 over the steps). The tolerances are 3-5 times those and 2 % at least; a step that did not
# update, a wrong accumulation or a lost optimizer state moves the losses by more (the reference's own change over
# the steps is in the report).
STEP_RTOL, STEP_ATOL = 2e-2, 2e-3
STEP_CALIBRATION = {"measured": "2026-12-02, bf16 against fp32 on a 2-core AVX2 CPU (DeepSpeed 0.19.8, torch 2.13)",
                    "max_rel_diff": {"sft": 3.5e-4, "reward": 6.1e-3, "dpo": 8.7e-4, "policy": 3.8e-3,
                                     "critic": 3.4e-2}}
# The reference's log-probs against the policy's before its first update (the same weights, two forwards): fp32 alike
# to float rounding; bf16 logits are rounded to 8 bits, so a log-prob near -6 may differ by its spacing, 2^-5.
LOGPROB_ATOL = {"fp32": 1e-4, "bf16": 2 ** -4}
# Peak dense bf16 TFLOP/s by a substring of torch.cuda.get_device_name (first match; SXM unless named).
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0)]
SEGMENT = 2 * 2**20  # torch's small-pool segment: what small outputs may keep reserved after a call
# token_logprobs at a Llama 3 vocabulary: rows, positions, vocabulary (GPU: 4.2 GB of bf16 logits, 8.4 GB as the
# float32 copy the unchunked formula made; CPU: 0.1 GB)
LOGPROB_SHAPES = {"cuda": (16, 1024, 128256), "cpu": (2, 160, 128256)}
NOT_ON_CPU = "needs CUDA's allocator statistics (torch.cuda.max_memory_allocated, memory_reserved): --cpu has no GPU"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    stage: str  # the stage module whose Config stage_config builds
    module: str  # where the worker class is
    cls: str
    zero_stage: int
    data: str  # sft rows, preference pairs, or a Rollout
    compared: tuple  # the loss statistics compared with the fp32 reference
    overrides: dict = dataclasses.field(default_factory=dict)
    step_rtol: float = STEP_RTOL  # (STEP_RTOL's comment)


WORKERS = {
    "sft": WorkerSpec("stages.sft", "stages.sft", "SFTWorker", 2, "sft", ("loss",)),
    "reward": WorkerSpec("stages.reward_model", "stages.reward_model", "RewardWorker", 2, "pairs", ("loss",),
                         step_rtol=3e-2),
    # nll_weight: before the first update the policy is its reference, so the plain DPO loss is exactly log 2 in any
    # precision; the NLL term makes the first step's loss depend on the forward.
    "dpo": WorkerSpec("stages.dpo", "stages.dpo", "DPOWorker", 3, "pairs", ("loss",), {"nll_weight": 0.1}),
    "policy": WorkerSpec("stages.rl", "runtime.rl_actors", "PolicyWorker", 3, "rollout",
                         ("policy_loss", "entropy", "kl_loss"), RL_OVERRIDES),
    "critic": WorkerSpec("stages.rl", "runtime.rl_actors", "CriticWorker", 2, "rollout", ("value_loss",),
                         RL_OVERRIDES, step_rtol=0.15),
}
# What the check imports that a GPU machine with only torch and transformers may lack (import names; build_wheels.sh
# has their wheels): DeepSpeed and its dependencies, and jsonschema for launcher/config.py.
NEEDED = ("deepspeed", "hjson", "pydantic", "pydantic_core", "cpuinfo", "msgpack", "einops", "psutil", "jsonschema",
          "referencing", "rpds", "attrs")
WHEELS = HERE / "wheels"
UNPACKED_ENV = "ALIGNPIPE_GPU_CHECK_UNPACKED"


# ---------------------------------------------------------------------------------------------------------------
# Carried wheels

def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def unpack_wheels_and_reexec() -> None:
    """Where DeepSpeed or a package it (or the config code) needs is missing and tests/gpu/wheels/ holds wheels:
    unpack every wheel into a temporary directory (a wheel is a zip of its import tree; no pip, no network) and run
    this script again with that directory first on PYTHONPATH."""
    missing = missing_packages()
    if not missing or os.environ.get(UNPACKED_ENV):
        if missing:
            sys.exit(f"still missing after unpacking {WHEELS}: {missing}")
        return
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        sys.exit(f"missing Python packages {missing}: install them, or run tests/gpu/build_wheels.sh on a machine "
                 f"with network and carry {WHEELS.relative_to(REPO)}/ here (tests/gpu/README.md)")
    target = Path(tempfile.mkdtemp(prefix="alignpipe-gpu-check-site-"))
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    print(f"[gpu-check] missing {missing}: unpacked {len(wheels)} wheels from {WHEELS.relative_to(REPO)}/ into "
          f"{target}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])),
               **{UNPACKED_ENV: str(target)})
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# ---------------------------------------------------------------------------------------------------------------
# Data: the builtin arithmetic task's texts (runtime/builtin_data.py; the movie reviews need a package the GPU
# machine lacks), worked problems strung together to the lengths a size asks for.

def arithmetic_texts(count: int, seed: int) -> list[dict]:
    from runtime.builtin_data import arithmetic_rows
    return arithmetic_rows("preference", count, seed)


def tokenizer_texts() -> list[str]:
    return [f"{r['prompt']} {r['chosen']}" for r in arithmetic_texts(3000, SEED)]


def make_rows(tokenizer, size: dict, count: int, seed: int) -> dict:
    """`count` rows of about size["prompt"] + size["response"] tokens, as SFT rows, preference pairs and token ids
    for a Rollout (the SFT rows' prompt and response)."""
    problems = iter(arithmetic_texts(count * (size["prompt"] + size["response"]), seed))
    length = lambda text: len(tokenizer(" " + text, add_special_tokens=False)["input_ids"])

    def string(tokens: int, answer: str) -> tuple[str, str]:
        right, wrong, used = [], [], 0
        while used < tokens:
            p = next(problems)
            right.append(f"{p['prompt']} {p[answer]}.")
            wrong.append(f"{p['prompt']} {p['rejected']}.")
            used += length(right[-1])
        return " ".join(right), " ".join(wrong)

    sft, pairs = [], []
    for _ in range(count):
        context, _ = string(size["prompt"], "chosen")
        last = next(problems)
        prompt = f"{context} {last['prompt']}"
        right, wrong = string(size["response"], "chosen")
        sft.append({"prompt": prompt, "response": f"{last['chosen']}. {right}"})
        pairs.append({"prompt": prompt, "chosen": f"{last['chosen']}. {right}",
                      "rejected": f"{last['rejected']}. {wrong}"})
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    rollout = {"prompt_ids": [encode(r["prompt"]) for r in sft], "response_ids": [encode(r["response"]) for r in sft]}
    longest = max(len(p) + max(len(encode(r["chosen"])), len(encode(r["rejected"])))
                  for p, r in zip(rollout["prompt_ids"], pairs))
    if longest > MAX_POSITIONS:
        raise ValueError(f"rows of {longest} tokens exceed the model's {MAX_POSITIONS} positions")
    return {"sft": sft, "pairs": pairs, "rollout": rollout}


def rollout_of(data: dict, vocab: int):
    """A Rollout of the rows with every per-token field a policy or critic step reads: old log-probs near a uniform
    policy's (so the PPO ratio, its clipping and truncated IS weights depend on the model), reference log-probs for
    the KL term, positive advantages (the loss is then not a sum near zero), old values and returns for the critic."""
    from runtime.experience import Rollout
    uniform = -math.log(vocab)
    responses = data["response_ids"]
    per_token = lambda value_of_row: [[value_of_row(i)] * len(r) for i, r in enumerate(responses)]
    return Rollout.of(data["prompt_ids"], responses,
                      old_logp=per_token(lambda i: uniform), rollout_logp=per_token(lambda i: uniform - 0.05),
                      ref_logp=per_token(lambda i: uniform + 0.05),
                      advantages=per_token(lambda i: 1.0 if i % 2 == 0 else 0.5),
                      old_values=per_token(lambda i: 0.0), returns=per_token(lambda i: 1.0 if i % 2 == 0 else 0.0))


# ---------------------------------------------------------------------------------------------------------------
# Measuring, in a run's own process

def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measured(fn):
    """fn()'s result, its seconds and, on a GPU, what torch's allocator had allocated and reserved before the call, at
    its peak inside it and after it (bytes; None on CPU)."""
    import torch
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    start = time.perf_counter()
    result = fn()
    sync()
    seconds = time.perf_counter() - start
    memory = None
    if gpu:
        memory = {"allocated_before": allocated, "allocated_peak": torch.cuda.max_memory_allocated(),
                  "allocated_after": torch.cuda.memory_allocated(), "reserved_before": reserved,
                  "reserved_peak": torch.cuda.max_memory_reserved(), "reserved_after": torch.cuda.memory_reserved()}
    return result, seconds, memory


def guarded(fn) -> dict:
    """A part's result, or why it failed: one part's exception must not lose the others' figures."""
    try:
        return fn()
    except Exception as err:
        import traceback
        traceback.print_exc()
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hf_shapes(model_dir: str) -> tuple[dict, int]:
    """The Hugging Face state dict's names and shapes (less an LM head tied to the embeddings, which save_pretrained
    and the weight sync give once) and the parameter count, from a model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes, sum(p.numel() for p in model.parameters())


def load_exported(export_dir: Path) -> dict:
    from safetensors.torch import load_file
    tensors = {}
    for path in sorted(Path(export_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


# ---------------------------------------------------------------------------------------------------------------
# One worker's run: a process of its own (`--child SPEC`)

def worker_config(ws: WorkerSpec, spec: dict):
    """The stage's Config as its job builds it, with the check's batch, precision and training overrides."""
    from launcher.config import stage_config
    size = spec["size_config"]
    block = ws.stage.rsplit(".", 1)[-1]
    overrides = {"zero_stage": ws.zero_stage, "num_workers": 1, "batch_size": size["batch"],
                 "micro_batch_size": size["micro"], "lora_rank": 0, "gradient_checkpointing": True,
                 "precision": spec["precision"], "offload_optimizer": False, **TRAINING, **ws.overrides}
    cfg = stage_config(importlib.import_module(ws.stage), {block: overrides}, block)
    if ws.cls == "CriticWorker":  # as runtime.rl_actors.Roles starts the critic
        cfg = dataclasses.replace(cfg, learning_rate=cfg.critic_learning_rate)
    return cfg


def start_worker(ws: WorkerSpec, cfg, spec: dict):
    """A worker set up as its stage's group does (minus Ray), as rank 0 of 1; later workers of the same process join
    the process group the first one made."""
    from runtime.deepspeed_strategy import Rank
    worker = getattr(importlib.import_module(ws.module), ws.cls)()
    rendezvous = {"master_addr": "127.0.0.1", "master_port": spec["port"], "world_size": 1}
    worker.setup(cfg, Rank(0, rendezvous, spec["threads"], spec["model_dir"], spec["steps"]))
    return worker


def frozen_check(cfg, spec: dict, rollout) -> dict:
    """The rl stage's frozen reference and reward model as Roles starts them with this cfg's zero_stage 3 and
    frozen_ranks 1 (FrozenScorer.setup at world size 1: the whole model on its rank; sharding needs more ranks), each
    scoring the rollout once: its seconds, and on a GPU the memory its forwards cached (memory_reserved's peak above
    its level before the call) and whether the call handed it back (reserved after <= before + one small segment).
    Runs before any ZeRO-3 engine of the process exists: that engine's HfDeepSpeedConfig would partition these loads.
    The reference's log-probs come back as `reference_logp`."""
    import torch
    from runtime.deepspeed_strategy import Rank
    from runtime.rl_actors import FrozenScorer
    rank = Rank(0, {"world_size": 1}, spec["threads"], spec["model_dir"], 0)
    result = {"zero_stage": cfg.zero_stage, "frozen_ranks": cfg.frozen_ranks, "world_size": 1}
    for kind, method, label in (("policy", "logprobs", "reference"), ("reward", "scores", "reward_model")):
        scorer = FrozenScorer()
        scorer.setup(cfg, rank, kind)
        score = getattr(scorer, method)
        score(rollout)  # a first call makes what a process keeps (CUDA's library handles and workspaces)
        output, seconds, memory = measured(functools.partial(score, rollout))
        values = output if torch.is_tensor(output) else torch.tensor(output)
        entry = {"seconds": seconds, "finite": bool(torch.isfinite(values).all()),
                 "sharded": any(hasattr(p, "ds_id") for p in scorer.model.parameters()),
                 "dtype": str(next(scorer.model.parameters()).dtype)}
        if memory:
            entry |= memory | {"cached_by_forwards": memory["reserved_peak"] - memory["reserved_before"],
                               "released": memory["reserved_after"] <= memory["reserved_before"] + SEGMENT}
            # Without forwards that allocate beyond what is reserved, "released" would say nothing.
            entry["ok"] = entry["finite"] and entry["released"] and entry["cached_by_forwards"] > SEGMENT
        else:
            entry["ok"] = entry["finite"]
        result[label] = entry
        if kind == "policy":
            result["reference_logp"] = output
        del scorer, score
    if "released" not in result["reference"]:
        result["not_measured"] = {"memory": NOT_ON_CPU}
    return result


def agreement(policy_logp, reference_logp, precision: str) -> dict:
    difference = float((policy_logp - reference_logp).abs().max())
    return {"max_abs_diff": difference, "atol": LOGPROB_ATOL[precision], "ok": difference <= LOGPROB_ATOL[precision]}


def gather_check(worker, spec: dict, expected: dict) -> dict:
    """runtime.weight_sync.hf_weights over the ZeRO-3 engine: names, shapes, and values against save_hf's export; and
    save_hf's peak GPU memory above the shard the rank holds, against one module's full weights."""
    import torch
    from runtime.weight_sync import hf_weights
    # Under ZeRO-3 a parameter is partitioned (no full copy outside a gather) unless it is below DeepSpeed's
    # stage3_param_persistence_threshold (1e5 elements), which stays whole on every rank (ds_persist).
    model = worker.engine.module
    params = list(model.parameters())
    sharded = [p for p in params if hasattr(p, "ds_id") and not getattr(p, "ds_persist", False)]
    partitioned = all(hasattr(p, "ds_id") for p in params) and bool(sharded) and all(p.numel() == 0 for p in sharded)
    sync()
    start = time.perf_counter()
    shapes, dtypes, duplicates, nbytes = {}, set(), [], 0
    for name, tensor in hf_weights(model, True):
        if name in shapes:
            duplicates.append(name)
        shapes[name] = list(tensor.shape)
        dtypes.add(str(tensor.dtype))
        nbytes += tensor.numel() * tensor.element_size()
    sync()
    seconds = time.perf_counter() - start
    export_dir = Path(spec["export_dir"])
    _, save_s, memory = measured(lambda: worker.save_hf(str(export_dir), spec["model_dir"]))
    full_bytes = lambda p: getattr(p, "ds_numel", p.numel()) * p.element_size()
    largest_module = max(sum(map(full_bytes, m.parameters(recurse=False))) for m in model.modules())
    save_hf = {"seconds": save_s, "largest_module_bytes": largest_module, "model_bytes": sum(map(full_bytes, params))}
    if memory:
        # (At world size 1 ZeRO-3 "gathers" several parameters as views of the rank's own partitions, so a gather of
        # the whole model would stay within this bound too; tests/test_gpu_readiness.py counts the gathered modules.)
        save_hf |= memory | {"peak_above_shard": memory["allocated_peak"] - memory["allocated_before"],
                             "bound": largest_module + SEGMENT}
        save_hf["ok"] = save_hf["peak_above_shard"] <= save_hf["bound"]
    else:
        save_hf["not_measured"] = {"peak_memory": NOT_ON_CPU}
    exported = load_exported(export_dir)
    value_mismatches = []
    for name, tensor in hf_weights(model, True):
        saved = exported.get(name)
        if saved is None or saved.dtype != tensor.dtype or not torch.equal(tensor.detach().cpu(), saved):
            value_mismatches.append(name)
    shape_mismatches = sorted(n for n in set(shapes) & set(expected) if shapes[n] != expected[n])
    result = {
        "tensors": len(shapes), "bytes": nbytes, "dtypes": sorted(dtypes), "seconds": seconds,
        "gbytes_per_s": nbytes / seconds / 1e9 if seconds else None, "save_hf": save_hf,
        "partitioned_outside_gather": partitioned, "partitioned_params": len(sharded),
        "persistent_params": len(params) - len(sharded),
        "missing": sorted(set(expected) - set(shapes)), "unexpected": sorted(set(shapes) - set(expected)),
        "duplicates": duplicates, "shape_mismatches": shape_mismatches,
        "not_exported": sorted(set(shapes) - set(exported)), "exported_only": sorted(set(exported) - set(shapes)),
        "value_mismatches": value_mismatches,
    }
    result["ok"] = partitioned and not any(result[k] for k in ("missing", "unexpected", "duplicates", "shape_mismatches",
                                                                "not_exported", "exported_only", "value_mismatches"))
    return result


def ipc_receiver(connection) -> None:
    """The engine's side of the `ipc` weight hand-over, in a process of its own on the same GPU: each request's handles
    go to weight_sync.WorkerExtension.receive_ipc, as in a vLLM worker; the stand-in for that worker's load_weights
    copies the tensor into this process's own memory, as vLLM's weight loaders copy into their parameters."""
    import ray_placeholder
    ray_placeholder.install()
    import torch
    from runtime.weight_sync import WorkerExtension, gpu_uuid
    torch.cuda.set_device(0)
    received = {}

    def load_weights(weights):
        for name, tensor in weights:
            received[name] = tensor.clone()

    vllm_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(
        model=types.SimpleNamespace(load_weights=load_weights)))
    while True:
        kind, *args = connection.recv()
        try:
            if kind == "ping":
                reply = "ready"
            elif kind == "tensor":
                WorkerExtension.receive_ipc(vllm_worker, *args)
                reply = "ok"
            elif kind == "verify":  # every tensor received against the export (args: its directory)
                exported = load_exported(Path(args[0]))
                reply = {"pid": os.getpid(), "gpu_uuid": gpu_uuid(), "tensors": len(received),
                         "bytes": sum(t.numel() * t.element_size() for t in received.values()),
                         "devices": sorted({str(t.device) for t in received.values()}),
                         "missing": sorted(set(exported) - set(received)),
                         "mismatches": sorted(name for name, t in received.items() if name not in exported
                                              or t.dtype != exported[name].dtype or not torch.equal(t.cpu(),
                                                                                                   exported[name]))}
            else:
                reply = "stopped"
        except Exception as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        connection.send(reply)
        if kind == "stop":
            return


def ipc_check(worker, export_dir: str) -> dict:
    """runtime.weight_sync.send_weights(worker, engines, "ipc") to one engine stand-in whose receive_ipc.remote asks
    the receiving process (ipc_receiver) and returns its answer, so that ray.get (a stand-in too) has nothing to wait
    for; then that process compares what it holds with save_hf's export (the weights have not changed since)."""
    import multiprocessing
    from runtime import weight_sync
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked process
    ours, theirs = context.Pipe()
    receiver = context.Process(target=ipc_receiver, args=(theirs,), daemon=True)
    receiver.start()

    def ask(*message):
        ours.send(message)
        if not ours.poll(120):
            raise TimeoutError(f"the receiving process did not answer {message[0]!r} within 120 s")
        reply = ours.recv()
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"the receiving process failed: {reply['error']}")
        return reply

    engine = types.SimpleNamespace(receive_ipc=types.SimpleNamespace(
        remote=lambda name, handles: ask("tensor", name, handles)))
    real_ray = weight_sync.ray
    weight_sync.ray = types.SimpleNamespace(get=lambda replies: replies)
    try:
        ask("ping")  # the receiver is up (spawn, imports, CUDA) before the hand-over is timed
        sent, seconds, _ = measured(lambda: weight_sync.send_weights(worker, [engine], "ipc"))
    finally:
        weight_sync.ray = real_ray
    received = ask("verify", export_dir)
    ask("stop")
    receiver.join(timeout=60)
    result = {"sent": sent, "seconds": seconds, "sender_pid": os.getpid(), "sender_gpu_uuid": weight_sync.gpu_uuid(),
              "gbytes_per_s": received["bytes"] / seconds / 1e9, "received": received}
    result["ok"] = (sent == received["tensors"] > 0 and not received["missing"] and not received["mismatches"]
                    and received["pid"] != os.getpid() and received["gpu_uuid"] == result["sender_gpu_uuid"]
                    and received["devices"] == ["cuda:0"])
    return result


class StandInEngine:
    """vLLM's side of rl.vllm.sleep, which the check has not: vLLM 0.32's sleep / wake_up tag semantics (read in
    vllm/v1/engine/core.py, v1/executor/abstract.py, v1/worker/gpu_worker.py) over real device memory, the policy's
    full weights and a KV cache of the same size. Level 2 frees both (the caching allocator's cache emptied, as
    vLLM's CuMem pool unmaps them); waking a tag allocates it again, uninitialized; generating while a tag sleeps is
    what hangs vLLM (its scheduler stays paused), here an error; a generation records whether its weights equal the
    policy's. Its methods answer `.remote(...)` synchronously (the check has no Ray)."""

    def __init__(self, shapes: dict, device):
        self.shapes, self.device, self.sleeping, self.generated = shapes, device, set(), []
        self.weights, self.kv_cache = self._allocate(), self._allocate()
        for method in ("sleep", "wake_up", "finish_weight_update", "generate"):
            setattr(self, method, types.SimpleNamespace(remote=getattr(self, f"_{method}")))

    def _allocate(self) -> dict:
        """Uninitialized memory of the policy's weights' shapes (the KV cache takes as much)."""
        import torch
        return {name: torch.empty(shape, dtype=dtype, device=self.device)
                for name, (shape, dtype) in self.shapes.items()}

    def _sleep(self, level: int = 1) -> None:
        import torch
        assert level == 2, "the rl stage discards the weights it resends"
        if "weights" not in self.sleeping:
            self.weights, self.kv_cache, self.sleeping = None, None, {"weights", "kv_cache"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _wake_up(self, tags=None) -> bool:
        tags = set(tags or self.sleeping)
        if not self.sleeping or not tags <= self.sleeping:
            raise RuntimeError(f"wake_up({sorted(tags)}) while {sorted(self.sleeping)} sleep: vLLM ignores it")
        if "weights" in tags:
            self.weights = self._allocate()
        if "kv_cache" in tags:
            self.kv_cache = self._allocate()
        self.sleeping -= tags
        return not self.sleeping

    def _finish_weight_update(self) -> None:
        pass

    def _generate(self, worker) -> None:
        import torch
        from runtime import weight_sync
        if self.sleeping:
            raise RuntimeError(f"generate while {sorted(self.sleeping)} sleep: vLLM's scheduler stays paused (a hang)")
        self.generated.append(all(torch.equal(self.weights[name], tensor)
                                  for name, tensor in weight_sync.hf_weights(worker.engine.module, True)))


def sleep_check(worker, micro: list) -> dict:
    """rl.vllm.sleep's whole cycle as the rl stage runs it (runtime.rl_actors.Roles: before_generate, after_generate,
    sync_weights), on the trained ZeRO-3 policy and a StandInEngine: the held-out reward's generation, step 0's two
    dynamic-sampling rounds, a training step, the sync, the held-out reward after it. Every generation must see the
    policy's current weights bit for bit (level 2 discards them: before_generate resends them where no sync followed);
    on a GPU, memory allocated while generating (the trainers' states offloaded, the engine awake) and after (the
    engine asleep, the states back)."""
    import torch
    from runtime import rl_actors, weight_sync
    gpu = torch.cuda.is_available()
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in weight_sync.hf_weights(worker.engine.module, True)}
    engine = StandInEngine(shapes, "cuda" if gpu else "cpu")

    def load_weights() -> None:  # what the engine's receive_* does: copy each full tensor in
        for name, tensor in weight_sync.hf_weights(worker.engine.module, True):
            engine.weights[name].copy_(tensor)
    load_weights()  # (as an engine loads the model at its start)

    class Policy:  # the policy's ActorGroup, one rank, called in this process
        def call(self, method, *args):
            if method == "send_weights":
                load_weights()
                return [len(shapes)]
            return [getattr(worker, method)(*args)]

    roles = rl_actors.Roles.__new__(rl_actors.Roles)
    roles.sleeps, roles.engines_asleep, roles.engines, roles.weight_mode = True, set(), [engine], "ipc"
    roles.policy = Policy()
    roles.trainers = {"policy": roles.policy}
    allocated = lambda: torch.cuda.memory_allocated() if gpu else None
    phases = []

    def generation(what: str) -> None:
        roles.before_generate()
        during = allocated()
        engine.generate.remote(worker)
        roles.after_generate()
        phases.append({"generation": what, "allocated_generating": during, "allocated_after": allocated()})

    real_ray = rl_actors.ray
    rl_actors.ray = types.SimpleNamespace(get=lambda replies: replies)
    try:
        generation("held-out reward before training")
        generation("step 0")
        generation("step 0, second dynamic-sampling round")
        worker.train_step(micro)
        roles.sync_weights()
        generation("held-out reward after training")
    finally:
        rl_actors.ray = real_ray
    result = {"generations": phases, "weights_current": engine.generated, "asleep_at_end": sorted(engine.sleeping)}
    result["ok"] = engine.generated == [True] * 4 and engine.sleeping == {"weights", "kv_cache"}
    if not gpu:
        result["not_measured"] = {"memory": NOT_ON_CPU}
    return result


def offload_check(ws: WorkerSpec, cfg, spec: dict, step_batches: list) -> dict:
    """rl.vllm.sleep around generation: two fresh ZeRO-3 policies on the same batches, the second offloaded
    (DeepSpeedWorker.offload_states) and reloaded before every step, as the rl stage does. Per step: what offloading
    moved itself (DeepSpeedWorker.optimizer_tensors: fp32 master weights and AdamW's states; DeepSpeed moves the
    gradient buffers), that it went to host memory (pinned on a GPU) and came back, and on a GPU memory allocated
    before, after offloading and after reloading; the two policies' losses must be equal to the bit. Eager attention:
    SDPA's memory-efficient backward, which a right-padded batch gets on CUDA, is not deterministic."""
    import torch
    eager = dataclasses.replace(cfg, attn_implementation="eager")
    plain, offloaded = start_worker(ws, eager, spec), start_worker(ws, eager, spec)
    gpu = torch.cuda.is_available()
    master = lambda: plain.optimizer_tensors()[0].detach().clone()  # a flat partition of fp32 master weights
    master_before = master()
    cycles, plain_stats, offloaded_stats = [], [], []
    for micro in step_batches:
        tensors = offloaded.optimizer_tensors()
        devices, pointers = [t.device for t in tensors], [t.data_ptr() for t in tensors]
        _, offload_s, offloading = measured(offloaded.offload_states)
        cycle = {"tensors": len(tensors), "moved_bytes": sum(t.numel() * t.element_size() for t in tensors),
                 "offload_s": offload_s,
                 "on_host": all(t.device.type == "cpu" and t.data_ptr() != p for t, p in zip(tensors, pointers)),
                 "pinned": all(t.is_pinned() for t in tensors) if gpu else None,
                 "deepspeed_offloaded": sorted(s.name for s in offloaded.engine.optimizer.offloaded_states)}
        _, cycle["reload_s"], reloading = measured(offloaded.reload_states)
        cycle["back"] = [t.device for t in tensors] == devices and not offloaded.engine.optimizer.offloaded_states
        cycle["ok"] = cycle["on_host"] and cycle["back"] and cycle["pinned"] is not False
        if offloading:
            cycle |= {"allocated_before": offloading["allocated_before"],
                      "allocated_offloaded": offloading["allocated_after"],
                      "allocated_reloaded": reloading["allocated_after"],
                      "reserved_before": offloading["reserved_before"],
                      "reserved_offloaded": offloading["reserved_after"]}
            cycle["freed_bytes"] = cycle["allocated_before"] - cycle["allocated_offloaded"]
            cycle["restored_bytes"] = cycle["allocated_reloaded"] - cycle["allocated_offloaded"]
            cycle["ok"] &= cycle["freed_bytes"] >= cycle["moved_bytes"] and \
                cycle["restored_bytes"] >= cycle["moved_bytes"]
        cycles.append(cycle)
        plain_stats.append(plain.train_step(micro))
        offloaded_stats.append(offloaded.train_step(micro))
    result = {"attn_implementation": "eager", "cycles": cycles, "plain_steps": plain_stats,
              "offloaded_steps": offloaded_stats, "identical": plain_stats == offloaded_stats,
              "trained": not torch.equal(master(), master_before)}
    result["ok"] = result["identical"] and result["trained"] and all(c["ok"] for c in cycles)
    if "allocated_before" not in cycles[0]:
        result["not_measured"] = {"memory": NOT_ON_CPU, "pinned": "pinned host memory needs CUDA"}
    return result


def run_worker(spec: dict) -> dict:
    """Set up one worker as its stage does (minus Ray), train spec["steps"] steps and measure them; the policy's run
    with `extras` also runs the parts above."""
    import ray_placeholder
    ray_status = ray_placeholder.install()
    import torch
    from transformers.integrations import is_deepspeed_zero3_enabled
    from runtime.logprobs import pair_batch
    from runtime.models import load_tokenizer
    from stages.sft import tokenize_sft

    name, size = spec["worker"], spec["size_config"]
    ws = WORKERS[name]
    on_gpu = torch.cuda.is_available()
    if spec["device"] == "cuda" and not on_gpu:
        raise RuntimeError("this run is for the GPU, but torch sees none")
    if spec["device"] == "cpu" and on_gpu:
        raise RuntimeError("the CPU reference must not see a GPU (CUDA_VISIBLE_DEVICES='')")
    out = {"worker": name, "device": spec["device"], "size": spec["size"], "zero_stage": ws.zero_stage,
           "precision": spec["precision"], "ray": ray_status, "zero3_config_at_start": is_deepspeed_zero3_enabled()}
    if out["zero3_config_at_start"]:
        raise RuntimeError("a ZeRO-3 HfDeepSpeedConfig is alive before this worker's setup")
    expected, params = hf_shapes(spec["model_dir"])
    out["params"] = params
    cfg = worker_config(ws, spec)
    data = json.loads(Path(spec["rows"]).read_text())
    tokenizer = load_tokenizer(spec["model_dir"])
    if ws.data == "rollout":
        rows = rollout_of(data["rollout"], len(tokenizer))
        batch_of = lambda piece: piece.tokens(tokenizer.pad_token_id)
    else:
        rows = data[ws.data]
        batch_of = (lambda piece: tokenize_sft(tokenizer, piece)) if ws.data == "sft" else \
            (lambda piece: pair_batch(tokenizer, piece))
    extras = spec["extras"] and name == "policy"
    if extras:
        out["frozen"] = guarded(lambda: frozen_check(cfg, spec, rows))
        reference_logp = out["frozen"].pop("reference_logp", None)

    start = time.perf_counter()
    worker = start_worker(ws, cfg, spec)
    sync()
    out["setup_s"] = time.perf_counter() - start
    out["backend"] = torch.distributed.get_backend()
    out["attn_implementation"] = cfg.attn_implementation
    out["gradient_checkpointing"] = worker.engine.module.is_gradient_checkpointing
    out["zero3_partitioned"] = all(hasattr(p, "ds_id") for p in worker.engine.module.parameters())
    if out["zero3_partitioned"] != (ws.zero_stage == 3):
        raise RuntimeError(f"ZeRO-{ws.zero_stage} worker, but its parameters are "
                           f"{'' if out['zero3_partitioned'] else 'not '}ZeRO-3 partitioned")
    if extras and reference_logp is not None:  # the old policy's log-probs through the ZeRO-3 engine, before any update
        out["frozen"]["policy_agreement"] = agreement(worker.logprobs(rows), reference_logp, spec["precision"])
    if name == "dpo":  # the reference pass before any update, as stages/dpo.py's run does it
        from stages.dpo import with_reference
        rows = with_reference(rows, cfg.loss, worker.reference_logps)

    step_rows = size["batch"]
    step_batches = []
    for step in range(spec["steps"]):
        chunk = rows[step * step_rows:(step + 1) * step_rows]
        step_batches.append([chunk[i:i + size["micro"]] for i in range(0, step_rows, size["micro"])])
    steps = []
    for step, micro in enumerate(step_batches):
        batches = [batch_of(piece) for piece in micro]
        padded = sum(b["input_ids"].numel() for b in batches)
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        sync()
        start = time.perf_counter()
        stats = worker.train_step(micro)
        sync()
        seconds = time.perf_counter() - start
        steps.append({"seconds": seconds, "stats": stats, "tokens": padded, "real_tokens": real})
        print(f"[{name} {spec['device']} {spec['size']}] step {step + 1}: {seconds:.3f} s "
              + " ".join(f"{k} {v:.5g}" for k, v in stats.items()), flush=True)
    out["steps"] = steps
    if on_gpu:
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if extras:
        out["gather"] = guarded(lambda: gather_check(worker, spec, expected))
        out["ipc"] = guarded(lambda: ipc_check(worker, spec["export_dir"])) if on_gpu else \
            {"skipped": "CUDA IPC (torch.multiprocessing.reductions.reduce_tensor of a CUDA tensor) needs a GPU"}
        out["offload"] = guarded(lambda: offload_check(ws, cfg, spec, step_batches))
        out["sleep"] = guarded(lambda: sleep_check(worker, step_batches[0]))
    out["ray_used"] = list(ray_placeholder.USED)
    return out


def unchunked_logprobs(logits, labels):
    """token_logprobs as it was before issue #22: one float32 copy of all the logits and a logsumexp over it."""
    import torch
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def run_logprobs(spec: dict) -> dict:
    """runtime.logprobs.token_logprobs (chunked) at a 128k vocabulary against unchunked_logprobs, on random bf16 logits
    of spec["shape"] taken as response_logits gives them (a view that drops the last position): the forward (no
    autograd) and forward + backward, each timed (median of 3 after a warm-up call on a GPU; once on CPU) and, on a
    GPU, its peak memory above what was allocated before (the logits). The chunked forward must stay within 4 chunks
    beyond its input and (B, T) outputs, its backward within that plus the gradient of the logits (twice their size:
    token_logprobs' own, and the view's backward into the whole tensor); values and gradients must agree."""
    import torch
    from runtime.logprobs import LOGITS_CHUNK_BYTES, token_logprobs
    torch.set_num_threads(spec["threads"])
    rows, positions, vocab = spec["shape"]
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    generator = torch.Generator(device).manual_seed(SEED)
    full = torch.randn(rows, positions + 1, vocab, generator=generator, device=device, dtype=torch.bfloat16).mul_(3)
    labels = torch.randint(0, vocab, (rows, positions), generator=generator, device=device)
    logits_bytes = full.numel() * full.element_size()
    outputs_bytes = 2 * rows * positions * 4  # the (B, T) float32 log-probs and logsumexp
    bounds = {"forward": 4 * LOGITS_CHUNK_BYTES + outputs_bytes,
              "forward_backward": 2 * logits_bytes + 4 * LOGITS_CHUNK_BYTES + outputs_bytes}

    def forward(fn):
        with torch.no_grad():
            return fn(full[:, :-1], labels)

    def forward_backward(fn):
        full.requires_grad_()
        fn(full[:, :-1], labels).sum().backward()
        grad, full.grad = full.grad, None
        full.requires_grad_(False)
        return grad

    result = {"shape": {"rows": rows, "positions": positions, "vocab": vocab}, "logits_bytes": logits_bytes,
              "chunk_bytes": LOGITS_CHUNK_BYTES, "bounds": bounds, "timing": "median of 3 after a warm-up call"
              if gpu else "one call"}
    values = {}
    for label, fn in (("chunked", token_logprobs), ("unchunked", unchunked_logprobs)):
        result[label] = {}
        for mode, run in (("forward", forward), ("forward_backward", forward_backward)):
            if gpu:
                run(fn)
            seconds = []
            for _ in range(3 if gpu else 1):
                values[label, mode] = None  # (the previous call's output is not kept alive through the next)
                values[label, mode], call_seconds, memory = measured(lambda: run(fn))
                seconds.append(call_seconds)
            entry = {"seconds": statistics.median(seconds)}
            if memory:
                entry["peak_above_logits"] = memory["allocated_peak"] - memory["allocated_before"]
            result[label][mode] = entry
            print(f"[logprobs {device}] {label} {mode}: {entry}", flush=True)
    # (row by row: a float32 difference of the whole gradients would take 4 times the logits' memory)
    max_abs_diff = lambda a, b: max(float((a[row].float() - b[row].float()).abs().max()) for row in range(rows))
    result["max_abs_diff"] = {"logprobs": max_abs_diff(values["chunked", "forward"], values["unchunked", "forward"]),
                              "grad": max_abs_diff(values["chunked", "forward_backward"],
                                                   values["unchunked", "forward_backward"])}
    # float32 alike (the same float32 operations per position); the gradients are stored in bf16 (spacing 2^-8
    # below 1, where every entry of 1[v = y] - softmax(z)_v lies).
    result["tolerance"] = {"logprobs": 1e-4, "grad": 2 ** -8}
    result["ok"] = all(result["max_abs_diff"][k] <= result["tolerance"][k] for k in result["tolerance"])
    values.clear()
    result["tempered"] = tempered_check(full[:4, :-1], labels[:4])
    if "peak_above_logits" in result["chunked"]["forward"]:
        within = {mode: result["chunked"][mode]["peak_above_logits"] <= bounds[mode] for mode in bounds}
        result["within_bounds"] = within
        result["ok"] &= all(within.values())
    else:
        result["not_measured"] = {"memory": NOT_ON_CPU + " (tests/test_gpu_readiness.py measures the CPU's peak "
                                  "resident memory of the same calls)"}
    return result


def tempered_check(logits, labels, temperature: float = 0.7) -> dict:
    """RL's log-probs at the sampling temperature as the trainer takes them (token_logprobs divides each float32 chunk
    of the bf16 logits), forward and backward, against float64 log_softmax(logits / temperature) and its gradient."""
    import torch
    from runtime.logprobs import token_logprobs
    leaf = logits.detach().clone().requires_grad_()
    token_logprobs(leaf * 1, labels, temperature).sum().backward()  # (* 1: a non-leaf, as a model's output)
    exact_leaf = logits.detach().double().requires_grad_()
    exact = torch.log_softmax(exact_leaf / temperature, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    exact.sum().backward()
    with torch.no_grad():
        logp = token_logprobs(logits, labels, temperature)
    # the gradient (1[v = y] - softmax)_v / temperature lies in (-1 / 0.7, 1 / 0.7), stored in bf16: spacing 2^-7
    result = {"temperature": temperature, "rows": logits.shape[0],
              "max_abs_diff": {"logprobs": float((logp.double() - exact).abs().max()),
                               "grad": float((leaf.grad.double() - exact_leaf.grad).abs().max())},
              "tolerance": {"logprobs": 1e-4, "grad": 2 ** -7}}
    result["ok"] = all(result["max_abs_diff"][k] <= result["tolerance"][k] for k in result["tolerance"])
    return result


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_worker(spec) if spec["part"] == "worker" else run_logprobs(spec)
    except BaseException as err:
        import traceback
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"}
    result |= {"tag": spec["tag"], "device": spec["device"]}
    Path(spec["out"]).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    # Skip interpreter teardown: NCCL and DeepSpeed's threads can hang at exit, and everything is written.
    os._exit(0 if "error" not in result else 1)


# ---------------------------------------------------------------------------------------------------------------
# The driver

class Runner:
    """Runs one part in a child process (`--child SPEC`) and returns its result, or why there is none."""

    def __init__(self, workdir: Path, timeout_s: int):
        self.workdir, self.timeout_s = workdir, timeout_s
        self.lock = threading.Lock()

    def __call__(self, tag: str, device: str, threads: int, **fields) -> dict:
        spec = {"tag": tag, "device": device, "threads": threads, "port": free_port(),
                "export_dir": str(self.workdir / f"export-{tag}"), "out": str(self.workdir / f"{tag}.json"), **fields}
        spec_path = self.workdir / f"{tag}.spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads),
                   PYTHONUNBUFFERED="1")
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = self.workdir / f"{tag}.log"
        start = time.perf_counter()
        with log.open("w") as fh:
            try:
                proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                                      cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=self.timeout_s)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        wall = time.perf_counter() - start
        out = Path(spec["out"])
        result = json.loads(out.read_text()) if out.is_file() else \
            {"tag": tag, "device": device, "error": f"exit {code}, no result"}
        result["wall_s"] = wall
        if "error" in result:
            result["log_tail"] = log.read_text(errors="replace")[-4000:]
        with self.lock:
            status = "ok" if "error" not in result else f"FAILED: {result['error']}"
            print(f"[gpu-check] {tag}: {wall:.1f} s, {status}", flush=True)
            if "error" in result:
                print(result["log_tail"], flush=True)
        return result

    def worker(self, worker: str, device: str, size: str, prepared: dict, threads: int, extras: bool) -> dict:
        model_dir, rows = prepared[size]
        return self(f"{worker}-{device}-{size}", device, threads, part="worker", worker=worker, size=size,
                    size_config=SIZES[size], steps=STEPS[size], model_dir=str(model_dir), rows=str(rows),
                    precision="bf16" if device == "cuda" else "fp32", extras=extras)


def run_jobs(jobs: dict, lanes: int, done) -> None:
    """Every job (a callable), `lanes` at a time, in order; done(key, result) as each finishes."""
    with concurrent.futures.ThreadPoolExecutor(lanes) as pool:
        futures = {pool.submit(job): key for key, job in jobs.items()}
        for future in concurrent.futures.as_completed(futures):
            done(futures[future], future.result())


def finite(run: dict) -> bool:
    return "steps" in run and all(math.isfinite(v) for s in run["steps"] for v in s["stats"].values())


def compare(run: dict, ref: dict, keys: tuple, rtol: float) -> dict:
    """Every step's `keys` against the reference's same step (|run - ref| <= rtol * |ref| + STEP_ATOL), and how far the
    reference's first key moved over its steps (what a step that did not train would miss by)."""
    close = lambda a, b: abs(a - b) <= rtol * abs(b) + STEP_ATOL
    if "steps" not in run or "steps" not in ref:
        return {"ok": False, "why": "a run failed"}
    steps = []
    for s, r in zip(run["steps"], ref["steps"]):
        steps.append({key: {"device": s["stats"].get(key), "reference": r["stats"].get(key),
                            "rel_diff": abs(s["stats"][key] - r["stats"][key]) / max(abs(r["stats"][key]), 1e-12)
                            if key in s["stats"] and key in r["stats"] else None,
                            "ok": key in s["stats"] and key in r["stats"] and close(s["stats"][key], r["stats"][key])}
                      for key in keys})
    first, last = ref["steps"][0]["stats"][keys[0]], ref["steps"][-1]["stats"][keys[0]]
    return {"ok": len(steps) == len(ref["steps"]) and all(v["ok"] for step in steps for v in step.values()),
            "rtol": rtol, "atol": STEP_ATOL, "steps": steps,
            "max_rel_diff": max(v["rel_diff"] or 0.0 for step in steps for v in step.values()),
            "reference_change": {"key": keys[0], "first": first, "last": last,
                                 "rel": abs(last - first) / max(abs(first), 1e-12)}}


def performance(run: dict, params: int, peak_tflops: float | None) -> dict:
    """Median step time after the first (the first allocates and warms up), tokens/s, model TFLOP/s and MFU."""
    if "steps" not in run:
        return {}
    timed = run["steps"][1:] or run["steps"]
    seconds = statistics.median(s["seconds"] for s in timed)
    tokens = statistics.median(s["tokens"] for s in timed)
    real = statistics.median(s["real_tokens"] for s in timed)
    tflops = 6 * params * tokens / seconds / 1e12
    return {"step_s": seconds, "tokens_per_step": tokens, "tokens_per_s": tokens / seconds,
            "real_tokens_per_s": real / seconds, "model_tflops_per_s": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None, "timed_steps": len(timed)}


def part_check(results: dict, what: str) -> dict:
    """One entry of the report's `checks` from a part's result per size: skipped when every size skipped it (with
    the reason), failed when one is missing or not ok, else passed; what a size could not measure is listed."""
    check = {"what": what, "results": results}
    if results and all(r is not None and "skipped" in r for r in results.values()):
        return check | {"status": "skipped", "reason": next(iter(results.values()))["skipped"]}
    check["status"] = "passed" if results and all(r is not None and r.get("ok") for r in results.values()) else "failed"
    not_measured = {k: v for r in results.values() if r for k, v in r.get("not_measured", {}).items()}
    return check | ({"not_measured": not_measured} if not_measured else {})


def build_checks(report: dict, runs: dict, logprobs: dict, cpu_mode: bool) -> dict:
    """The report's `checks`: one per GPU path (the module docstring), from the runs' results."""
    policy = runs["policy"]
    per_size = lambda pick: {size: pick(run) for size, run in policy.items()}
    checks = {
        "offload_reload": part_check(per_size(lambda run: run.get("offload")),
                                     "DeepSpeedWorker.offload_states / reload_states on the ZeRO-3 policy"),
        "frozen_zero3": part_check(per_size(lambda run: frozen_result(run.get("frozen"))),
                                   "FrozenScorer (zero_stage 3, frozen_ranks 1) forwards hand cached memory back"),
        "sleep_cycle": part_check(per_size(lambda run: run.get("sleep")),
                                  "rl.vllm.sleep's cycle (Roles.before_generate / after_generate / sync_weights) on "
                                  "the ZeRO-3 policy with a stand-in for vLLM's sleep level 2 over real GPU memory"),
        "tempered_logprobs": part_check({"logprobs": logprobs.get("tempered") if "error" not in logprobs else None},
                                        "response log-probs at temperature 0.7 (logits divided in place under "
                                        "autograd) against float64 log_softmax(logits / 0.7), values and gradients"),
        "cuda_ipc": part_check(per_size(lambda run: run.get("ipc")),
                               "weight_sync.send_weights 'ipc' to a second process on the GPU (receive_ipc)"),
        "save_hf_peak": part_check(per_size(lambda run: save_hf_result(run.get("gather"))),
                                   "ZeRO-3 per-module gather equals save_hf's export; save_hf's peak memory above "
                                   "the shard <= one module's full weights"),
        "logprobs_128k": part_check({"logprobs": logprobs if "error" not in logprobs else None},
                                    "token_logprobs at a 128k vocabulary: peak memory and time, forward and backward"),
    }
    if cpu_mode:
        checks["steps_vs_fp32"] = {"what": "several bf16 optimizer steps on the GPU against fp32 on the CPU",
                                   "status": "skipped", "reason": "--cpu: no bf16 GPU run to compare (each run is its "
                                   "own reference)"}
    else:
        comparisons = {worker: report["workers"][worker]["comparison"] for worker in WORKERS}
        checks["steps_vs_fp32"] = {
            "what": f"{STEPS['check']} bf16 optimizer steps on the GPU against fp32 on the CPU, every step",
            "tolerance": {"rtol": {w: s.step_rtol for w, s in WORKERS.items()}, "atol": STEP_ATOL,
                          "calibration": STEP_CALIBRATION},
            "status": "passed" if all(c["ok"] for c in comparisons.values()) else "failed",
            "max_rel_diff": {w: c.get("max_rel_diff") for w, c in comparisons.items()},
            "reference_change": {w: c.get("reference_change") for w, c in comparisons.items()}}
    peak = report["device"]["peak_bf16_tflops"]
    mfu = {worker: report["workers"][worker]["performance"].get("mfu") for worker in WORKERS}
    checks["mfu"] = {"what": "6 * params * tokens / step time / dense bf16 peak, per worker at the bench size",
                     "peak_bf16_tflops": peak, "peak_source": report["device"]["peak_source"]}
    if cpu_mode and peak is None:
        checks["mfu"] |= {"status": "skipped", "reason": "--cpu: no bf16 peak for a CPU (give --peak-tflops)"}
    elif peak is None:
        checks["mfu"] |= {"status": "skipped", "reason": f"no dense bf16 peak known for {report['device']['name']} "
                          "(give --peak-tflops)"}
    else:  # an MFU outside (0, 1) would be a timing error (a missing synchronize)
        checks["mfu"] |= {"mfu": mfu, "status": "passed" if all(m is not None and 0 < m < 1 for m in mfu.values())
                          else "failed"}
    return checks


def save_hf_result(gather: dict | None) -> dict | None:
    """save_hf's part of the gather check, whose `ok` needs the gather's too (the export it measured is compared)."""
    if gather is None or "save_hf" not in gather:
        return gather
    return gather["save_hf"] | {"gather_ok": gather["ok"], "ok": gather["ok"] and gather["save_hf"].get("ok", True)}


def frozen_result(frozen: dict | None) -> dict | None:
    """The frozen part's result with its `ok`: both scorers, and their agreement with the policy."""
    if frozen is None or "error" in frozen:
        return frozen
    return frozen | {"ok": all(frozen.get(k, {}).get("ok") for k in ("reference", "reward_model", "policy_agreement"))}


def device_info(cpu_mode: bool, peak_tflops: float | None) -> dict:
    import torch
    source = "--peak-tflops" if peak_tflops else None
    if cpu_mode or not torch.cuda.is_available():
        return {"name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                "peak_bf16_tflops": peak_tflops, "peak_source": source}
    name = torch.cuda.get_device_name(0)
    if not peak_tflops:
        match = next(((key, value) for key, value in PEAK_BF16_TFLOPS if key in name), None)
        peak_tflops, source = (match[1], f"table: {match[0]}") if match else (None, None)
    return {"name": name, "peak_bf16_tflops": peak_tflops, "peak_source": source, "cuda": torch.version.cuda,
            "nccl": nccl_version(), "count": torch.cuda.device_count(),
            "memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}


def nccl_version() -> str | None:
    import torch
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a torch without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def versions() -> dict:
    import importlib.metadata as metadata
    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "deepspeed", "tokenizers", "safetensors"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[package] = metadata.version(package)
    return found


def prepare(size: str, workdir: Path, texts: list[str]) -> tuple[Path, Path, int]:
    """The size's model directory (runtime.models.build_tiny, seed SEED) and its rows file; the vocabulary size."""
    from runtime.models import build_tiny, load_tokenizer
    model_dir, rows_path = workdir / f"model-{size}", workdir / f"rows-{size}.json"
    start = time.perf_counter()
    build_tiny(model_dir, {"architecture": "llama", "vocab_size": VOCAB, **SIZES[size]["model"]}, SEED, texts)
    tokenizer = load_tokenizer(model_dir)
    rows = make_rows(tokenizer, SIZES[size], STEPS[size] * SIZES[size]["batch"], SEED + 1)
    rows_path.write_text(json.dumps(rows))
    print(f"[gpu-check] model {size} {SIZES[size]['model']} vocab {len(tokenizer)}: built in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return model_dir, rows_path, len(tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="fp32 on CPU, tiny sizes (CI)")
    parser.add_argument("--out", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak in TFLOP/s, for MFU "
                        "(default: by the GPU's name, from a small table)")
    parser.add_argument("--workdir", type=Path, help="keep models, exports and logs here (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one run's process may take")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
        return
    unpack_wheels_and_reexec()
    import ray_placeholder
    ray_status = ray_placeholder.install()
    import torch
    started = time.perf_counter()
    cpu_mode = args.cpu
    if not cpu_mode and not torch.cuda.is_available():
        print("[gpu-check] torch sees no CUDA GPU (torch.version.cuda = {}); on a CPU-only machine run with --cpu"
              .format(torch.version.cuda), file=sys.stderr)
        sys.exit(2)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = args.workdir.resolve()
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="alignpipe-gpu-check-")))
        report = {"mode": "cpu" if cpu_mode else "gpu", "command": " ".join(["python", *sys.argv]),
                  "device": device_info(cpu_mode, args.peak_tflops), "versions": versions(), "ray": ray_status,
                  "learning_rate": LEARNING_RATE,
                  "reference": "the run itself (--cpu: there is no device to compare with)" if cpu_mode else
                  "the same model and steps on the CPU in fp32 over gloo",
                  "mfu_definition": "6 * params * tokens / median step time "
                  "after the first / dense bf16 peak; padded tokens; recomputation not counted",
                  "sizes": {}, "workers": {}, "checks": {}, "failures": []}

        def write():
            report["total_s"] = time.perf_counter() - started
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))

        texts = tokenizer_texts()
        sizes = ["tiny"] if cpu_mode else ["check", "bench"]
        prepared = {}
        for size in sizes:
            model_dir, rows, vocab = prepare(size, workdir, texts)
            _, params = hf_shapes(str(model_dir))
            prepared[size] = (model_dir, rows)
            report["sizes"][size] = {**SIZES[size], "vocab": vocab, "params": params, "steps": STEPS[size]}
        write()
        run = Runner(workdir, args.timeout)
        check_size = sizes[0]
        references: dict = {}
        device = "cpu" if cpu_mode else "cuda"
        if cpu_mode:
            # Two runs at a time: each is a process that spends most of its time importing (one core).
            lanes = min(2, cores)
            device_threads = max(1, cores // lanes)
        else:
            lanes = 1  # one GPU: its runs one after another, each alone on it (timings, memory figures)
            # The CPU references run alongside the GPU runs, on most of the cores.
            device_threads = min(4, cores)
            ref_threads = max(1, cores - device_threads)

            def run_references():
                for worker in WORKERS:
                    references[worker] = run.worker(worker, "cpu", check_size, prepared, ref_threads, extras=False)
            reference_thread = threading.Thread(target=run_references, daemon=True)
            reference_thread.start()
        runs = {worker: {} for worker in WORKERS}

        def done(key, result):
            if key == "logprobs":
                report["logprobs"] = result
            else:
                worker, size = key
                runs[worker][size] = result
                report["workers"].setdefault(worker, {"zero_stage": WORKERS[worker].zero_stage})[size] = result
            write()

        order = ["policy"] + [w for w in WORKERS if w != "policy"]  # the longest run first
        jobs = {(w, check_size): functools.partial(run.worker, w, device, check_size, prepared, device_threads, True)
                for w in order}
        jobs["logprobs"] = functools.partial(run, f"logprobs-{device}", device, device_threads, part="logprobs",
                                             shape=LOGPROB_SHAPES[device])
        if not cpu_mode:
            jobs |= {(w, "bench"): functools.partial(run.worker, w, device, "bench", prepared, device_threads, True)
                     for w in order}
        run_jobs(jobs, lanes, done)
        report["workers"] = {worker: report["workers"][worker] for worker in WORKERS}
        logprobs = report["logprobs"]
        if not cpu_mode:
            reference_thread.join()
        else:
            references = {worker: runs[worker][check_size] for worker in WORKERS}

        peak = report["device"]["peak_bf16_tflops"]
        failures = report["failures"]
        for worker, spec in WORKERS.items():
            entry = report["workers"][worker]
            entry["reference"] = references.get(worker) if not cpu_mode else "the check run itself"
            entry["compared"] = list(spec.compared)
            entry["comparison"] = compare(runs[worker][check_size], references.get(worker, {}), spec.compared,
                                          spec.step_rtol)
            perf_size = sizes[-1]
            entry["performance"] = performance(runs[worker][perf_size], report["sizes"][perf_size]["params"], peak)
            labelled = [(size, result) for size, result in runs[worker].items()]
            if not cpu_mode:
                labelled.append(("reference", references.get(worker) or {"error": "no result"}))
            for label, result in labelled:
                if "error" in result:
                    failures.append(f"{worker} {label}: {result['error']}")
                elif not finite(result):
                    failures.append(f"{worker} {label}: a loss is not finite")
                elif result.get("ray_used"):
                    failures.append(f"{worker} {label}: used Ray ({result['ray_used']})")
        if "error" in logprobs:
            failures.append(f"logprobs: {logprobs['error']}")
        report["checks"] = build_checks(report, runs, logprobs, cpu_mode)
        failures += [f"check {name} failed" for name, check in report["checks"].items() if check["status"] == "failed"]
        report["passed"] = not failures
        write()
        print_summary(report)
    if os.environ.get(UNPACKED_ENV):  # the wheels unpacked by unpack_wheels_and_reexec
        shutil.rmtree(os.environ[UNPACKED_ENV], ignore_errors=True)
    if args.out:
        print(f"[gpu-check] results -> {args.out}")
    sys.exit(0 if report["passed"] else 1)


def print_summary(report: dict) -> None:
    device = report["device"]
    print(f"\n[gpu-check] {report['mode']} mode on {device['name']}; " +
          ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + f"; ray: {report['ray']}")
    print(f"{'worker':8} {'ZeRO':>4} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}  largest relative "
          f"difference to the reference over the steps")
    for worker, entry in report["workers"].items():
        perf = entry.get("performance") or {}
        mfu = f"{perf['mfu']:.1%}" if perf.get("mfu") is not None else "n/a"
        diff = entry["comparison"].get("max_rel_diff")
        diff = f"{diff:.2e}" if diff is not None else entry["comparison"].get("why", "")
        if perf:
            print(f"{worker:8} {entry['zero_stage']:>4} {perf['step_s']:>8.3f} {perf['tokens_per_s']:>10.0f} "
                  f"{perf['model_tflops_per_s']:>8.2f} {mfu:>6}  {diff}")
        else:
            print(f"{worker:8} {entry['zero_stage']:>4} {'failed':>8}")
    for name, check in report["checks"].items():
        detail = check.get("reason") or "; ".join(f"{k} not measured" for k in check.get("not_measured", {}))
        print(f"check {name:15} {check['status']:8} {detail}")
    print(f"total {report['total_s']:.0f} s; " + ("PASSED" if report["passed"] else
                                                 "FAILED:\n  " + "\n  ".join(report["failures"])))


if __name__ == "__main__":
    main()
