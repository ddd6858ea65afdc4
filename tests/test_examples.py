"""The example cluster experiments in config/examples/ (issue #16), checked without a cluster, GPU or network.

For every file there:
  - it validates merged over config/default.yaml, as `snakemake --configfile` merges it;
  - every stage's job passes the launcher's own checks (launcher/resources.py: stage_resources, check_fits) with
    the params its rule hands the launcher, and with the slurm profile's resources;
  - its resources add up: the GPUs every role takes (`gpus_needed`) fill the job exactly, there is a core per GPU
    process, and an estimate of the memory on the fullest GPU and the fullest node (below) fits 80 GB GPUs and the
    job's `mem_gb`;
  - Snakemake's dry run with the slurm profile plans every job: base_model, preprocess, sft, reward_model, dpo
    per seed, rl per variant and seed, evaluate per model (and seed), report. Hub ids (model, datasets) are not
    looked up: the config checks skip them (runtime/user_data.is_hub), so the dry run works offline.
And one vLLM engine more than an example's GPUs hold is refused by check_fits, naming the GPUs.
"""
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.config import REPO_ROOT, ConfigError, load_config_files, method_seeds, rl_variant, stage_jobs
from launcher.resources import LaunchConfigError, check_fits, gpus_needed, stage_resources
from runtime.user_data import is_hub

EXAMPLES = sorted((REPO_ROOT / "config" / "examples").glob("*.yaml"))
DEFAULT = REPO_ROOT / "config" / "default.yaml"
SLURM_PROFILE = REPO_ROOT / "cluster_profiles" / "slurm"
STAGES = ("base_model", "preprocess", "sft", "reward_model", "dpo", "rl", "evaluate", "report")
CPU_STAGES = ("base_model", "preprocess", "report")
TRAINERS = ("sft", "reward_model", "dpo")

# ---- The memory estimate ---------------------------------------------------------------------------------------
# Decimal GB throughout; that understates both an "80 GB" GPU's 80 GiB and Slurm's --mem (GiB), so it errs safe.
GPU_GB = 80.0              # assumed GPU: H100 80GB or A100 80GB (the examples' comments say so)
CUDA_CONTEXT_GB = 1.0      # per process on a GPU: CUDA context, NCCL buffers, allocator slack
HOST_PER_PROCESS_GB = 3.0  # host memory of each GPU process (Python, torch, CUDA libraries; vLLM workers alike)
HOST_USABLE = 0.85         # share of a node's mem_gb the estimate may fill: the rest is Ray's object store, the OS,
                           # and the page cache of the safetensors being read
VLLM_WEIGHTS_MAX = 0.8     # an engine's weights may take at most this share of its GPU memory (the rest: KV cache)
# Stages/evaluate.py scores SCORE_BATCH rows at a time; read from the source so that the estimate follows it.
SCORE_BATCH = int(re.search(r"^SCORE_BATCH = (\d+)", (REPO_ROOT / "stages" / "evaluate.py").read_text(), re.M)[1])


@dataclasses.dataclass(frozen=True)
class ModelSize:
    params: float   # parameters
    layers: int
    hidden: int
    vocab: int


# From the models' config.json (hidden_size, num_hidden_layers, vocab_size) and published parameter counts.
MODEL_SIZES = {
    "meta-llama/Meta-Llama-3-8B-Instruct": ModelSize(8.03e9, 32, 4096, 128256),
    "meta-llama/Meta-Llama-3-70B-Instruct": ModelSize(70.55e9, 80, 8192, 128256),
}

# Checks that the lead's code cannot pass yet, each with why; strict, so the test says when one starts passing.
KNOWN_LIMITS = {
    ("llama3-70b-ppo", "evaluate"): "stages/evaluate.py's Scorer holds the evaluated model, the base model and the "
                                    "reward model unsharded on one GPU (3 x 141 GB bf16 for 70B)",
}


def trainer_bytes_per_param(zero_stage: int, ranks: int, offload_optimizer: bool) -> float:
    """GPU bytes per parameter of one DeepSpeed rank, bf16 mixed precision: weights 2 B, gradients 2 B, and the fp32
    master weights with Adam's two moments 12 B (16 B in all), divided over the ranks as far as the ZeRO stage shards
    them (1: optimizer states, 2: and gradients, 3: and weights). offload_optimizer takes the 12 B to CPU memory."""
    optimizer = 0 if offload_optimizer else 12
    return {0: 4 + optimizer, 1: 4 + optimizer / ranks, 2: 2 + (2 + optimizer) / ranks,
            3: (4 + optimizer) / ranks}[zero_stage]


def training_activations_gb(m: ModelSize, rows: int, seq: int, logit_positions: int, checkpointing: bool,
                            lm_head: bool) -> float:
    """Activations of one training micro batch. Per token and layer a transformer keeps about 34 x hidden bytes in
    bf16 (Korthikanti et al. 2022, without the attention-score term that sdpa/flash attention never stores); with
    gradient checkpointing only each layer's input (2 x hidden bytes) stays, plus one layer recomputed at a time. A
    language-model head adds its logits over the response positions: bf16, the fp32 copy of the log-softmax and its
    gradient, 12 B per vocabulary entry (value and reward heads have one output: nothing worth counting)."""
    tokens = rows * seq
    layers = tokens * m.hidden * (2 * m.layers + 34) if checkpointing else tokens * m.hidden * 34 * m.layers
    logits = rows * logit_positions * m.vocab * 12 if lm_head else 0
    return (layers + logits) / 1e9


def forward_gb(m: ModelSize, rows: int, seq: int, logit_positions: int, lm_head: bool) -> float:
    """A forward pass without gradients (log-probs, values, scores): one layer's activations at a time and, with a
    language-model head, the logits (bf16, an fp32 copy and the log-sum-exp: 10 B per vocabulary entry)."""
    return (rows * seq * m.hidden * 34 + (rows * logit_positions * m.vocab * 10 if lm_head else 0)) / 1e9


def vllm_share(vllm: dict, shares_gpu: bool) -> float:
    """The share of each engine GPU that vLLM takes, as runtime/rollout.engine_options resolves it."""
    return vllm["gpu_memory_utilization"] or (0.4 if shares_gpu and not vllm.get("sleep") else 0.9)


@dataclasses.dataclass
class Estimate:
    gpu: dict   # phase -> {item: GB} on the fullest GPU
    host: dict  # phase -> {item: GB} on the fullest node
    notes: list = dataclasses.field(default_factory=list)  # other failed conditions


def estimate(stage: str, params: dict, config: dict, resources: dict) -> Estimate:
    """Memory of one stage's job: GB on its fullest GPU and on its fullest node, per phase of the job (what is
    resident at the same time). Ray PACKs one GPU per bundle in order, so the first node holds min(count, GPUs per
    node) ranks of every role."""
    m = MODEL_SIZES[config["model"]["path"]]
    P, g = m.params, resources["gpus_per_node"]
    data = config["data"]
    per_node = lambda count: min(count, g) if g else count
    if stage in ("base_model", "preprocess", "report"):  # base_model counts parameters on the meta device
        return Estimate({}, {"run": {"process": HOST_PER_PROCESS_GB}})
    if stage in TRAINERS:
        return _trainer_estimate(stage, params[stage], m, data, g)
    if stage == "rl":
        return _rl_estimate(params["rl"], m, data, g)
    assert stage == "evaluate", stage
    ev, vllm = params["evaluate"], params["evaluate"]["vllm"]
    tp, engine_gpus = vllm["tensor_parallel_size"], vllm["num_engines"] * vllm["tensor_parallel_size"]
    share = vllm_share(vllm, shares_gpu=False)
    logit_positions = max(ev["max_new_tokens"], data["max_response_tokens"])  # its samples and held-out SFT replies
    scorer_models = 2 + ("model" in ev["rewards"])  # evaluated model, base model (reference), reward model
    notes = []
    if 2 * P / tp / 1e9 > VLLM_WEIGHTS_MAX * share * GPU_GB:
        notes.append(f"evaluate.vllm: {2 * P / tp / 1e9:.1f} GB of weights per GPU leave no KV cache in "
                     f"{share} x {GPU_GB:g} GB")
    return Estimate(
        {"vLLM engine GPU": {"vLLM share": share * GPU_GB},
         "scorer GPU": {"models (bf16, unsharded)": scorer_models * 2 * P / 1e9,
                        "exact KL over the vocabulary (fp32)": SCORE_BATCH * logit_positions * m.vocab * 24 / 1e9,
                        "CUDA context": CUDA_CONTEXT_GB}},
        {"run": {"processes": HOST_PER_PROCESS_GB * per_node(engine_gpus + 1),
                 "scorer loading a model (bf16)": 2 * P / 1e9}}, notes)


def _trainer_estimate(stage: str, block: dict, m: ModelSize, data: dict, g: int) -> Estimate:
    P, W = m.params, block["num_workers"]
    seq = data["max_prompt_tokens"] + data["max_response_tokens"]
    rows = block["micro_batch_size"] * (2 if stage in ("reward_model", "dpo") else 1)  # a pair is two rows
    lm_head = stage != "reward_model"
    gpu = {"training states": trainer_bytes_per_param(block["zero_stage"], W, block["offload_optimizer"]) * P / 1e9,
           "activations": training_activations_gb(m, rows, seq, data["max_response_tokens"],
                                                  block["gradient_checkpointing"], lm_head),
           "CUDA context": CUDA_CONTEXT_GB}
    ranks = min(W, g)
    load = {"processes": HOST_PER_PROCESS_GB * ranks}
    if stage == "dpo" and block["loss"] != "simpo":  # stages/dpo.py: an unsharded bf16 reference on every rank
        gpu["reference (bf16, unsharded)"] = 2 * P / 1e9
        load["references loaded on the CPU first"] = 2 * P * ranks / 1e9
    if block["zero_stage"] != 3:  # without zero.Init every rank materialises the whole model before DeepSpeed
        load["models loaded on the CPU first"] = 2 * P * ranks / 1e9
    train = {"processes": HOST_PER_PROCESS_GB * ranks}
    if block["offload_optimizer"]:
        train["offloaded optimizer states"] = 12 * P / W * ranks / 1e9
    return Estimate({"train": gpu}, {"load": load, "train": train})


def _rl_estimate(rl: dict, m: ModelSize, data: dict, g: int) -> Estimate:
    P, W, F = m.params, rl["num_workers"], rl["frozen_ranks"]
    vllm, tp = rl["vllm"], rl["vllm"]["tensor_parallel_size"]
    engine_gpus = vllm["num_engines"] * tp
    critic, reward_model, sleep = rl["estimator"] == "gae", rl["reward"] == "model", rl["vllm"]["sleep"]
    trainers = 1 + critic
    seq, new = data["max_prompt_tokens"] + rl["max_new_tokens"], rl["max_new_tokens"]
    states = trainers * trainer_bytes_per_param(rl["zero_stage"], W, rl["offload_optimizer"]) * P / 1e9
    frozen = (1 + reward_model) * 2 * P / (F if rl["zero_stage"] == 3 and F > 1 else 1) / 1e9
    # null: a rank's whole share of the step's rows at once
    forward_rows = rl["forward_micro_batch_size"] or math.ceil(rl["rollout_batch_size"] * rl["n_samples"] / min(W, F))
    transient = max(
        training_activations_gb(m, rl["micro_batch_size"], seq, new, rl["gradient_checkpointing"], lm_head=True),
        forward_gb(m, forward_rows, seq, new, lm_head=True))
    share = vllm_share(vllm, shares_gpu=rl["colocate"]) * GPU_GB
    notes = []
    if 2 * P / tp / 1e9 > VLLM_WEIGHTS_MAX * share:
        notes.append(f"rl.vllm: {2 * P / tp / 1e9:.1f} GB of weights per GPU leave no KV cache in {share:g} GB")
    if rl["colocate"]:
        roles = 3 + critic + reward_model  # policy, reference, vLLM worker, critic, reward model: one process each
        held = {"training states": states, "frozen shards": frozen, "CUDA contexts": CUDA_CONTEXT_GB * roles}
        gpu = {
            # runtime/rl_actors.Roles starts the trainers first: vLLM takes its share while their states are resident
            "vLLM start": held | {"vLLM share": share},
            "experience and training": held | {"activations or forward pass": transient}
                                       | ({} if sleep else {"vLLM share": share}),
        }
        if sleep:  # the weight sync wakes vLLM's weights (not its KV cache) while the trainers hold their states,
            # and gathers one module's full weights at a time to send them (the largest: the embedding or LM head)
            gpu["weight sync"] = held | {"vLLM weights": 2 * P / tp / 1e9,
                                         "gathered module": 2 * m.vocab * m.hidden / 1e9}
    else:  # every role on GPUs of its own: the fullest is a trainer's or the vLLM share
        gpu = {"trainer GPU": {"training states": states / trainers, "activations": transient,
                               "CUDA context": CUDA_CONTEXT_GB},
               "frozen GPU": {"frozen shard": frozen / (1 + reward_model), "forward pass": transient,
                              "CUDA context": CUDA_CONTEXT_GB},
               "vLLM GPU": {"vLLM share": share}}
    ranks, frozen_ranks = min(W, g), min(F, g)
    processes = HOST_PER_PROCESS_GB * (trainers * ranks + (1 + reward_model) * frozen_ranks + min(engine_gpus, g))
    engines_on_node = min(engine_gpus, g) / tp
    load = {"processes": processes}
    if rl["zero_stage"] != 3:
        load["models loaded on the CPU first"] = 2 * P * (trainers * ranks + (1 + reward_model) * frozen_ranks) / 1e9
    elif F == 1:
        load["frozen models loaded on the CPU first"] = 2 * P * (1 + reward_model) / 1e9
    train = {"processes": processes}
    if rl["offload_optimizer"]:
        train["offloaded optimizer states"] = trainers * 12 * P / W * ranks / 1e9
    host = {"load": load, "experience and training": train}
    if sleep:  # vLLM's weights wait in CPU memory while DeepSpeed trains; DeepSpeed's states while vLLM generates
        train["sleeping vLLM weights"] = 2 * P * engines_on_node / 1e9
        host["generation"] = {"processes": processes, "offloaded training states": trainers * 16 * P / W * ranks / 1e9}
    return Estimate(gpu, host, notes)


# ---- What the launcher gets ------------------------------------------------------------------------------------

def load_example(path: Path, overrides: dict | None = None) -> dict:
    return load_config_files([DEFAULT, path], overrides)


def profile_resources() -> dict:
    """The Snakemake resources the slurm profile gives every rule (its default-resources)."""
    profile = yaml.safe_load((SLURM_PROFILE / "config.yaml").read_text())
    return dict(profile.get("default-resources") or {})


def example_jobs() -> list:
    jobs = []
    for path in EXAMPLES:
        config = load_example(path)
        for stage, run_name, params in stage_jobs(config):
            limit = KNOWN_LIMITS.get((path.stem, stage))
            marks = [pytest.mark.xfail(reason=limit, strict=True)] if limit else []
            jobs.append(pytest.param(path, stage, run_name, id=f"{path.stem}:{run_name}", marks=marks))
    return jobs


def job_params(path: Path, run_name: str) -> tuple[dict, str, dict]:
    config = load_example(path)
    stage, params = next((s, p) for s, r, p in stage_jobs(config) if r == run_name)
    return config, stage, params


# ---- The tests -------------------------------------------------------------------------------------------------

def test_the_8b_examples_exist():
    assert {"llama3-8b-ppo", "llama3-8b-grpo"} <= {p.stem for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_validates_over_the_default(path):
    config = load_example(path)
    lines = path.read_text().splitlines()
    header = "\n".join(lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])
    command = f"snakemake --profile slurm all --configfile config/examples/{path.name}"
    assert command in header, f"{path.name} must start with a comment showing how to run it: {command}"
    assert config["experiment"] == path.stem
    assert is_hub(config["model"]["path"]) or Path(config["model"]["path"]).is_absolute(), \
        "model.path: a hub id or an absolute path on the cluster"
    assert config["model"]["path"] in MODEL_SIZES, "add the model's size to MODEL_SIZES for the memory estimate"
    for role in ("sft", "preference", "prompts"):
        assert not config["data"][role]["path"].startswith("builtin:"), f"data.{role}: the demo's data is left over"
    launcher = config["launcher"]
    assert launcher["cluster"] == "slurm"
    assert launcher["checkpoint_dir"] and Path(launcher["checkpoint_dir"]).is_absolute(), \
        "launcher.checkpoint_dir: a shared filesystem (scratch), absolute"
    assert set(launcher["stages"]) == set(STAGES), "every stage's job is sized in launcher.stages"
    assert set(config["evaluate"]["models"]) == {"base", "sft", "dpo", *config["rl"]["variants"]}, \
        "every model of the experiment is evaluated"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_job_passes_the_launcher_checks(path):
    config = load_example(path)
    for stage, run_name, params in stage_jobs(config):
        for profile in ({}, profile_resources()):  # the config alone, and under the slurm profile
            resources, sources = stage_resources(stage, config["launcher"], profile)
            assert resources["cluster"] == "slurm", run_name
            check_fits(stage, params, resources, sources)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_gpus_per_role_fill_each_job(path):
    """GPU stages: the GPUs every role takes (one per DeepSpeed rank, frozen rank and engine GPU, one for the
    evaluation's scorer; the largest role's count where rl colocates) are exactly the job's, so no GPU is requested
    for nothing; a TP engine fits within a node; a core per GPU process. CPU stages: no GPU, one node."""
    config = load_example(path)
    for stage, run_name, params in stage_jobs(config):
        resources, _ = stage_resources(stage, config["launcher"], {})
        nodes, gpus = resources["nodes"], resources["gpus_per_node"]
        if stage in CPU_STAGES:
            assert (gpus, nodes) == (0, 1), f"{run_name}: a CPU job of one node"
            continue
        block = params[stage]
        assert gpus > 0, f"{run_name}: a GPU job"
        assert block.get("precision", "auto") in ("auto", "bf16")
        roles = gpus_needed(stage, block)
        colocated = stage == "rl" and block["colocate"]
        needed = max(roles.values()) if colocated else sum(roles.values())
        assert needed == nodes * gpus, (f"{run_name}: roles {roles} take {needed} GPUs "
                                        f"({'colocated' if colocated else 'summed'}), the job has {nodes} x {gpus}")
        if colocated:
            assert set(roles.values()) == {needed}, f"{run_name}: every colocated role spans all GPUs: {roles}"
        if "vllm" in block and nodes > 1:  # engines fill the GPUs in order: none may start on one node, end on another
            assert gpus % block["vllm"]["tensor_parallel_size"] == 0, f"{run_name}: an engine straddles two nodes"
        processes = (sum(roles.values()) if colocated else needed) / nodes
        assert resources["cpus_per_node"] >= processes, f"{run_name}: {processes:g} GPU processes per node"


@pytest.mark.parametrize("path,stage,run_name", example_jobs())
def test_memory_fits(path, stage, run_name):
    """The estimate above on the fullest GPU (80 GB) and the fullest node (HOST_USABLE of mem_gb), phase by phase."""
    config, stage, params = job_params(path, run_name)
    resources, sources = stage_resources(stage, config["launcher"], {})
    est = estimate(stage, params, config, resources)
    problems = list(est.notes)
    for phase, items in est.gpu.items():
        if sum(items.values()) > GPU_GB:
            problems.append(f"GPU, {phase}: {_sum(items)} > {GPU_GB:g} GB")
    for phase, items in est.host.items():
        if sum(items.values()) > HOST_USABLE * resources["mem_gb"]:
            problems.append(f"node, {phase}: {_sum(items)} > {HOST_USABLE} x {resources['mem_gb']:g} GB "
                            f"({sources['mem_gb']})")
    assert not problems, f"{path.name} {run_name}:\n  " + "\n  ".join(problems)


def _sum(items: dict) -> str:
    return " + ".join(f"{name} {gb:.1f}" for name, gb in items.items()) + f" = {sum(items.values()):.1f} GB"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_one_more_vllm_engine_is_refused(path):
    """The examples' engines fill their jobs' GPUs, so one engine more does not fit: check_fits refuses it before
    anything is queued, naming the GPUs needed and those of the job."""
    config = load_example(path)
    launcher = config["launcher"]
    engines = config["rl"]["vllm"]["num_engines"]
    bigger = load_example(path, {"rl": {"vllm": {"num_engines": engines + 1}}})
    resources, sources = stage_resources("rl", launcher, {})
    capacity = resources["nodes"] * resources["gpus_per_node"]
    for name in bigger["rl"]["variants"]:
        rl = rl_variant(bigger, name)
        needed = rl["vllm"]["num_engines"] * rl["vllm"]["tensor_parallel_size"]
        assert needed > capacity
        with pytest.raises(LaunchConfigError) as err:
            check_fits("rl", {"rl": rl, "variant": name, "seed": 0}, resources, sources)
        message = str(err.value)
        for fragment in (f"needs {needed} GPUs", f"vLLM {needed}", f"= {capacity}", "launcher.stages.rl.gpus_per_node",
                         "launcher.stages.rl.nodes"):
            assert fragment in message, (fragment, message)
    ev = config["evaluate"]["vllm"]
    bigger = load_example(path, {"evaluate": {"vllm": {"num_engines": ev["num_engines"] + 1}}})
    resources, sources = stage_resources("evaluate", launcher, {})
    with pytest.raises(LaunchConfigError, match=r"stage evaluate needs \d+ GPUs \(vLLM \d+, scorer 1; summed\)"):
        check_fits("evaluate", {"evaluate": bigger["evaluate"], "model": "sft", "seed": 0}, resources, sources)


def test_an_example_with_a_bad_key_is_refused(tmp_path):
    """The examples go through the same validation as any config: a misspelt stage in launcher.stages fails."""
    bad = tmp_path / "bad.yaml"
    config = yaml.safe_load(EXAMPLES[0].read_text())
    config["launcher"]["stages"]["ppo"] = config["launcher"]["stages"].pop("rl")
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="launcher.stages.ppo"):
        load_config_files([DEFAULT, bad])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_dry_run_plans_every_job(path, tmp_path):
    """`snakemake --profile slurm all --configfile <example> --dry-run` from the repository root (the slurm profile
    only sets resources: a dry run needs no sbatch), with results in a temporary directory so that no earlier run
    is found. Nothing is written there and no hub is asked."""
    config = load_example(path)
    results = tmp_path / "results"
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("snakemake")), "--profile", str(SLURM_PROFILE.relative_to(REPO_ROOT)),
         "all", "--dry-run", "--configfile", str(path), "--config", f"results_dir={results}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    seeds, variants = method_seeds(config), list(config["rl"]["variants"])
    runs = [(p["model"], p["seed"]) for stage, _, p in stage_jobs(config) if stage == "evaluate"]
    table = proc.stdout.split("Job stats:")[1]
    planned = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m[1] != "total"}
    assert planned == {"base_model": 1, "preprocess": 1, "sft": 1, "reward_model": 1, "dpo": len(seeds),
                       "rl": len(variants) * len(seeds), "evaluate": len(runs), "report": 1, "all": 1}, planned
    root = results / config["experiment"]
    outputs = {Path(m[1]).relative_to(root).as_posix() for m in re.finditer(r"^\s+output: (\S+)$", proc.stdout, re.M)}
    expected = {"base_model", "preprocess", "sft", "reward_model", "report"} | {f"dpo/seed{s}" for s in seeds} | \
        {f"rl/{v}/seed{s}" for v in variants for s in seeds} | {f"evaluate/{mo}/seed{s}" for mo, s in runs}
    assert outputs == expected
    assert not results.exists(), "a dry run writes nothing"
