"""GPU check of the training side (issue #16): every DeepSpeed training worker on one GPU, in bf16.

    python tests/gpu/check_training.py [--out results.json]        # from the repository root; one GPU

Estimated 3-5 minutes on one H200 (sized to stay well under 8; not yet run on a GPU). Needs only Python with torch built for CUDA,
transformers and DeepSpeed: no Ray, vLLM or network. Where DeepSpeed (or a package it or the config code needs) is
missing, carry the wheels that tests/gpu/build_wheels.sh puts in tests/gpu/wheels/ and the check unpacks them into a
temporary directory itself (tests/gpu/README.md). Exit status 0: every check passed; 1: one failed (the JSON says
which); 2: it could not run (no GPU).

What it does, each worker (SFTWorker, RewardWorker, DPOWorker, PolicyWorker, CriticWorker) in a process of its own
(the default process group is created once per process, and a ZeRO-3 worker's HfDeepSpeedConfig is process-global in
transformers: neither may leak into the next worker), built by `setup` from a Config made by
launcher.config.stage_config (the schema's defaults; lora off, gradient checkpointing on, ZeRO-3 for DPO and the
policy, ZeRO-2 for the others: the reward and critic heads are freshly initialised, which under ZeRO-3's zero.Init
may draw from the GPU's random generator rather than the CPU reference's), on world size 1:

1. check: a small Llama (hidden 256, 4 layers) on the GPU in bf16 over NCCL, STEPS["check"] train_step calls on fixed
   batches (2 micro-batches each, so gradient accumulation runs too); every loss finite;
2. reference: the same steps of the same model on the CPU in fp32 over gloo (in parallel with the GPU runs); the
   first step's losses must agree within RTOL/ATOL (bf16 against fp32; the first step is before any update, so it
   compares the forward and loss code; later steps are reported, not judged, as bf16 weights round the updates);
3. bench: a larger Llama (hidden 2048, 16 layers, ~1.1 B parameters) on the GPU, for step time, tokens/s and MFU
   (model FLOPs 6 * parameters * tokens trained + 2 * parameters * tokens of frozen forwards (DPO's reference), over
   the median step time after the first, against the GPU's dense bf16 peak: H100/H200 989 TFLOP/s, A100 312, other
   GPUs unknown; gradient checkpointing's recomputation is not counted);
4. the ZeRO-3 gather the trainer->vLLM weight sync uses (runtime.weight_sync.hf_weights), on the ZeRO-3 PolicyWorker
   after its steps (check and bench sizes): the parameters are partitioned; the gathered tensors have exactly the
   Hugging Face state dict's names and shapes (less the LM head tied to the embeddings) and equal, bit for bit, the
   model the worker exports (save_hf); the gather's time is reported.

Ray: the workers' modules import ray at module level; tests/gpu/ray_placeholder.py lets them import without it and
fails on any use (ALIGNPIPE_GPU_CHECK_FAKE_RAY=1 forces the placeholder where Ray is installed, as CI does).

    python tests/gpu/check_training.py --cpu [--out results.json]  # fp32 on CPU, tiny model, 2 steps: about 1 min

--cpu runs the same code on a CPU-only machine (tests/test_gpu_check.py, in CI): each worker once, its run being its
own reference, no bench size and no MFU. Results go to --out as JSON (written after every worker, so a run cut short
keeps what it measured): GPU name, versions, every worker's losses and step times, comparisons, the gather check.
"""
import argparse
import contextlib
import dataclasses
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
    "bench": dict(model=dict(hidden_size=2048, num_layers=16, num_heads=16), prompt=352, response=96, micro=8,
                  batch=16),
}
STEPS = {"tiny": 2, "check": 3, "bench": 5}
VOCAB = 1024  # asked of the BPE; the arithmetic texts give fewer
RTOL, ATOL = 2e-2, 1e-3  # bf16 (8 mantissa bits, fp32 accumulation) against fp32, on the first step's losses
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense, SXM
RL_OVERRIDES = {"kl_in_reward": False, "kl_coef": 0.05, "kl_estimator": "k3"}  # the KL as a loss term: more code runs


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    stage: str  # the stage module whose Config stage_config builds
    module: str  # where the worker class is
    cls: str
    zero_stage: int
    data: str  # sft rows, preference pairs, or a Rollout
    compared: tuple  # the loss statistics compared with the fp32 reference
    overrides: dict = dataclasses.field(default_factory=dict)


WORKERS = {
    "sft": WorkerSpec("stages.sft", "stages.sft", "SFTWorker", 2, "sft", ("loss",)),
    "reward": WorkerSpec("stages.reward_model", "stages.reward_model", "RewardWorker", 2, "pairs", ("loss",)),
    # nll_weight: before the first update the policy is its reference, so the plain DPO loss is exactly log 2 in any
    # precision; the NLL term makes the first step's loss depend on the forward.
    "dpo": WorkerSpec("stages.dpo", "stages.dpo", "DPOWorker", 3, "pairs", ("loss",), {"nll_weight": 0.1}),
    "policy": WorkerSpec("stages.rl", "runtime.rl_actors", "PolicyWorker", 3, "rollout",
                         ("policy_loss", "entropy", "kl_loss"), RL_OVERRIDES),
    "critic": WorkerSpec("stages.rl", "runtime.rl_actors", "CriticWorker", 2, "rollout", ("value_loss",),
                         RL_OVERRIDES),
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
# One worker's run: a process of its own (`--child SPEC`)

def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
    for path in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def gather_check(worker, spec: dict, expected: dict) -> dict:
    """runtime.weight_sync.hf_weights over the ZeRO-3 engine: names, shapes, and values against save_hf's export."""
    import torch
    from runtime.weight_sync import hf_weights
    # Under ZeRO-3 a parameter is partitioned (no full copy outside a gather) unless it is below DeepSpeed's
    # stage3_param_persistence_threshold (1e5 elements), which stays whole on every rank (ds_persist).
    params = list(worker.engine.module.parameters())
    sharded = [p for p in params if hasattr(p, "ds_id") and not getattr(p, "ds_persist", False)]
    partitioned = all(hasattr(p, "ds_id") for p in params) and bool(sharded) and all(p.numel() == 0 for p in sharded)
    sync()
    start = time.perf_counter()
    shapes, dtypes, duplicates, nbytes = {}, set(), [], 0
    for name, tensor in hf_weights(worker.engine.module, True):
        if name in shapes:
            duplicates.append(name)
        shapes[name] = list(tensor.shape)
        dtypes.add(str(tensor.dtype))
        nbytes += tensor.numel() * tensor.element_size()
    sync()
    seconds = time.perf_counter() - start
    export_dir = Path(spec["export_dir"])
    start = time.perf_counter()
    worker.save_hf(str(export_dir), spec["model_dir"])
    save_s = time.perf_counter() - start
    exported = load_exported(export_dir)
    value_mismatches = []
    for name, tensor in hf_weights(worker.engine.module, True):
        saved = exported.get(name)
        if saved is None or saved.dtype != tensor.dtype or not torch.equal(tensor.detach().cpu(), saved):
            value_mismatches.append(name)
    shape_mismatches = sorted(n for n in set(shapes) & set(expected) if shapes[n] != expected[n])
    result = {
        "tensors": len(shapes), "bytes": nbytes, "dtypes": sorted(dtypes), "seconds": seconds,
        "gbytes_per_s": nbytes / seconds / 1e9 if seconds else None, "save_hf_seconds": save_s,
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


def run_worker(spec: dict) -> dict:
    """Set up one worker as its stage does (minus Ray), train spec["steps"] steps and measure them."""
    import ray_placeholder
    ray_status = ray_placeholder.install()
    import torch
    from transformers.integrations import is_deepspeed_zero3_enabled
    from launcher.config import stage_config
    from runtime.deepspeed_strategy import Rank
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
           "precision": "bf16" if on_gpu else "fp32", "ray": ray_status,
           "zero3_config_at_start": is_deepspeed_zero3_enabled()}
    if out["zero3_config_at_start"]:
        raise RuntimeError("a ZeRO-3 HfDeepSpeedConfig is alive before this worker's setup")
    expected, params = hf_shapes(spec["model_dir"])
    out["params"] = params

    block = ws.stage.rsplit(".", 1)[-1]
    overrides = {"zero_stage": ws.zero_stage, "num_workers": 1, "batch_size": size["batch"],
                 "micro_batch_size": size["micro"], "lora_rank": 0, "gradient_checkpointing": True,
                 "precision": "bf16" if on_gpu else "fp32", "offload_optimizer": False, **ws.overrides}
    cfg = stage_config(importlib.import_module(ws.stage), {block: overrides}, block)
    if name == "critic":  # as runtime.rl_actors.Roles starts the critic
        cfg = dataclasses.replace(cfg, learning_rate=cfg.critic_learning_rate)
    worker = getattr(importlib.import_module(ws.module), ws.cls)()
    rendezvous = {"master_addr": "127.0.0.1", "master_port": spec["port"], "world_size": 1}
    start = time.perf_counter()
    worker.setup(cfg, Rank(0, rendezvous, spec["threads"], spec["model_dir"], spec["steps"]))
    sync()
    out["setup_s"] = time.perf_counter() - start
    out["backend"] = torch.distributed.get_backend()
    out["attn_implementation"] = cfg.attn_implementation
    out["gradient_checkpointing"] = worker.engine.module.is_gradient_checkpointing
    out["zero3_partitioned"] = all(hasattr(p, "ds_id") for p in worker.engine.module.parameters())
    if out["zero3_partitioned"] != (ws.zero_stage == 3):
        raise RuntimeError(f"ZeRO-{ws.zero_stage} worker, but its parameters are "
                           f"{'' if out['zero3_partitioned'] else 'not '}ZeRO-3 partitioned")

    data = json.loads(Path(spec["rows"]).read_text())
    tokenizer = load_tokenizer(spec["model_dir"])
    if ws.data == "rollout":
        rows = rollout_of(data["rollout"], len(tokenizer))
        batch_of = lambda piece: piece.tokens(tokenizer.pad_token_id)
    else:
        rows = data[ws.data]
        batch_of = (lambda piece: tokenize_sft(tokenizer, piece)) if ws.data == "sft" else \
            (lambda piece: pair_batch(tokenizer, piece))
    steps, step_rows = [], size["batch"]
    for step in range(spec["steps"]):
        chunk = rows[step * step_rows:(step + 1) * step_rows]
        micro = [chunk[i:i + size["micro"]] for i in range(0, step_rows, size["micro"])]
        batches = [batch_of(piece) for piece in micro]
        padded = sum(b["input_ids"].numel() for b in batches)
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        frozen = padded if name == "dpo" and cfg.loss != "simpo" else 0  # the reference's forward
        sync()
        start = time.perf_counter()
        stats = worker.train_step(micro)
        sync()
        seconds = time.perf_counter() - start
        steps.append({"seconds": seconds, "stats": stats, "tokens": padded, "real_tokens": real,
                      "frozen_tokens": frozen})
        print(f"[{name} {spec['device']} {spec['size']}] step {step + 1}: {seconds:.3f} s "
              + " ".join(f"{k} {v:.5g}" for k, v in stats.items()), flush=True)
    out["steps"] = steps
    if name == "policy" and ws.zero_stage == 3:
        out["gather"] = gather_check(worker, spec, expected)
    if on_gpu:
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["ray_used"] = list(ray_placeholder.USED)
    return out


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_worker(spec)
    except BaseException as err:
        import traceback
        traceback.print_exc()
        result = {"worker": spec["worker"], "device": spec["device"], "size": spec["size"],
                  "error": f"{type(err).__name__}: {err}"}
    Path(spec["out"]).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    # Skip interpreter teardown: NCCL and DeepSpeed's threads can hang at exit, and everything is written.
    os._exit(0 if "error" not in result else 1)


# ---------------------------------------------------------------------------------------------------------------
# The driver

class Runner:
    def __init__(self, workdir: Path, timeout_s: int):
        self.workdir, self.timeout_s = workdir, timeout_s
        self.lock = threading.Lock()

    def __call__(self, worker: str, device: str, size: str, model_dir: Path, rows: Path, threads: int) -> dict:
        tag = f"{worker}-{device}-{size}"
        spec = {"worker": worker, "device": device, "size": size, "size_config": SIZES[size], "steps": STEPS[size],
                "model_dir": str(model_dir), "rows": str(rows), "threads": threads, "port": free_port(),
                "export_dir": str(self.workdir / f"export-{tag}"), "out": str(self.workdir / f"{tag}.json")}
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
            {"worker": worker, "device": device, "size": size, "error": f"exit {code}, no result"}
        result["wall_s"] = wall
        if "error" in result:
            result["log_tail"] = log.read_text(errors="replace")[-4000:]
        with self.lock:
            status = "ok" if "error" not in result else f"FAILED: {result['error']}"
            print(f"[gpu-check] {tag}: {wall:.1f} s, {status}", flush=True)
            if "error" in result:
                print(result["log_tail"], flush=True)
        return result


def finite(run: dict) -> bool:
    return "steps" in run and all(math.isfinite(v) for s in run["steps"] for v in s["stats"].values())


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b) + ATOL


def compare(run: dict, ref: dict, keys: tuple) -> dict:
    """The first step's `keys` against the reference (judged), and the largest relative difference of each later step
    (reported)."""
    if "steps" not in run or "steps" not in ref:
        return {"ok": False, "why": "a run failed"}
    first = {}
    for key in keys:
        a, b = run["steps"][0]["stats"].get(key), ref["steps"][0]["stats"].get(key)
        both = a is not None and b is not None
        first[key] = {"device": a, "reference": b, "rel_diff": abs(a - b) / max(abs(b), 1e-12) if both else None,
                      "ok": both and close(a, b)}
    later = []
    for s, r in zip(run["steps"][1:], ref["steps"][1:]):
        later.append(max(abs(s["stats"][k] - r["stats"][k]) / max(abs(r["stats"][k]), 1e-12) for k in keys))
    return {"ok": all(v["ok"] for v in first.values()), "first_step": first, "later_steps_max_rel_diff": later}


def performance(run: dict, params: int, peak_tflops: float | None) -> dict:
    """Median step time after the first (the first allocates and warms up), tokens/s, model TFLOP/s and MFU."""
    if "steps" not in run:
        return {}
    timed = run["steps"][1:] or run["steps"]
    seconds = statistics.median(s["seconds"] for s in timed)
    tokens = statistics.median(s["tokens"] for s in timed)
    real = statistics.median(s["real_tokens"] for s in timed)
    frozen = statistics.median(s["frozen_tokens"] for s in timed)
    flops = 6 * params * tokens + 2 * params * frozen
    tflops = flops / seconds / 1e12
    return {"step_s": seconds, "tokens_per_step": tokens, "tokens_per_s": tokens / seconds,
            "real_tokens_per_s": real / seconds, "model_tflops_per_s": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None, "timed_steps": len(timed)}


def device_info(cpu_mode: bool) -> dict:
    import torch
    if cpu_mode or not torch.cuda.is_available():
        return {"name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                "peak_bf16_tflops": None}
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return {"name": name, "peak_bf16_tflops": peak, "cuda": torch.version.cuda,
            "nccl": nccl_version(),
            "count": torch.cuda.device_count(),
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
    parser.add_argument("--cpu", action="store_true", help="fp32 on CPU, tiny model, 2 steps (CI)")
    parser.add_argument("--out", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--workdir", type=Path, help="keep models, exports and logs here (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one worker's process may take")
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
                  "device": device_info(cpu_mode), "versions": versions(), "ray": ray_status,
                  "tolerance": {"rtol": RTOL, "atol": ATOL, "judged": "first step's losses: |device - reference| "
                                "<= rtol * |reference| + atol"},
                  "reference": "the run itself (--cpu: there is no device to compare with)" if cpu_mode else
                  "the same model and steps on the CPU in fp32 over gloo",
                  "mfu_definition": "(6 * params * tokens + 2 * params * frozen-forward tokens) / median step time "
                  "after the first / dense bf16 peak; padded tokens; recomputation not counted",
                  "sizes": {}, "workers": {}, "failures": []}

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
        if cpu_mode:
            device_threads, reference_thread = cores, None
        else:
            # The CPU references run alongside the GPU runs, on most of the cores.
            device_threads = min(4, cores)
            ref_threads = max(1, cores - device_threads)

            def run_references():
                for worker in WORKERS:
                    references[worker] = run(worker, "cpu", check_size, *prepared[check_size], ref_threads)
            reference_thread = threading.Thread(target=run_references, daemon=True)
            reference_thread.start()
        device = "cpu" if cpu_mode else "cuda"
        runs = {}
        for worker in WORKERS:
            runs[worker] = {"check": run(worker, device, check_size, *prepared[check_size], device_threads)}
            report["workers"][worker] = {"zero_stage": WORKERS[worker].zero_stage, "check": runs[worker]["check"]}
            write()
        if not cpu_mode:
            for worker in WORKERS:
                runs[worker]["bench"] = run(worker, device, "bench", *prepared["bench"], device_threads)
                report["workers"][worker]["bench"] = runs[worker]["bench"]
                write()
            reference_thread.join()
        else:
            references = {worker: runs[worker]["check"] for worker in WORKERS}

        peak = report["device"]["peak_bf16_tflops"]
        failures = report["failures"]
        for worker, spec in WORKERS.items():
            entry = report["workers"][worker]
            entry["reference"] = references.get(worker) if not cpu_mode else "the check run itself"
            entry["compared"] = list(spec.compared)
            entry["comparison"] = compare(runs[worker]["check"], references.get(worker, {}), spec.compared)
            perf_run = runs[worker].get("bench", runs[worker]["check"])
            entry["performance"] = performance(perf_run, report["sizes"][perf_run.get("size", check_size)]["params"],
                                               peak)
            for label, result in [("check", runs[worker]["check"]), ("bench", runs[worker].get("bench")),
                                  ("reference", None if cpu_mode else references.get(worker))]:
                if result is None:
                    continue
                if "error" in result:
                    failures.append(f"{worker} {label}: {result['error']}")
                elif not finite(result):
                    failures.append(f"{worker} {label}: a loss is not finite")
                elif result.get("ray_used"):
                    failures.append(f"{worker} {label}: used Ray ({result['ray_used']})")
                if "gather" in result and not result["gather"]["ok"]:
                    failures.append(f"{worker} {label}: ZeRO-3 gather check failed")
            if not entry["comparison"]["ok"] and "why" not in entry["comparison"]:
                failures.append(f"{worker}: first step differs from the fp32 reference "
                                f"({entry['comparison']['first_step']})")
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
    peak = device["peak_bf16_tflops"]
    print(f"{'worker':8} {'ZeRO':>4} {'size':>6} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}  "
          f"first-step losses (device / reference)")
    for worker, entry in report["workers"].items():
        perf = entry.get("performance") or {}
        size = "bench" if "bench" in entry else entry["check"].get("size", "?")
        mfu = f"{perf['mfu']:.1%}" if perf.get("mfu") is not None else "n/a"
        losses = ", ".join(f"{k} {v['device']:.5g} / {v['reference']:.5g}" if v["device"] is not None and
                           v["reference"] is not None else f"{k} missing"
                           for k, v in entry["comparison"].get("first_step", {}).items())
        if perf:
            print(f"{worker:8} {entry['zero_stage']:>4} {size:>6} {perf['step_s']:>8.3f} {perf['tokens_per_s']:>10.0f} "
                  f"{perf['model_tflops_per_s']:>8.2f} {mfu:>6}  {losses or 'no comparison'}")
        else:
            print(f"{worker:8} {entry['zero_stage']:>4} {size:>6} {'failed':>8}")
    if peak is None:
        print(f"MFU: n/a (no dense bf16 peak known for {device['name']})")
    for worker, entry in report["workers"].items():
        for label in ("check", "bench"):
            gather = (entry.get(label) or {}).get("gather")
            if gather:
                print(f"ZeRO-3 gather ({worker}, {entry[label]['size']} model): {gather['tensors']} tensors, "
                      f"{gather['bytes'] / 2**20:.1f} MiB in {gather['seconds']:.3f} s "
                      f"({gather['gbytes_per_s']:.2f} GB/s); equals save_hf's export and the HF names/shapes: "
                      f"{'yes' if gather['ok'] else 'NO'}")
    print(f"total {report['total_s']:.0f} s; " + ("PASSED" if report["passed"] else
                                                 "FAILED:\n  " + "\n  ".join(report["failures"])))


if __name__ == "__main__":
    main()
