"""Where a stage's job runs and how big it is, and the checks of that request before anything is queued.

A stage's resources come from the config's `launcher` block, its `launcher.stages.<stage>` entry, then the
Snakemake resources a profile gives the rule (`stage_resources`); each value is checked and the error names
where it came from. On Slurm, `check_slurm` asks `sbatch --test-only` whether the job would be accepted.
`check_stages` runs the same checks, all but `sbatch --test-only`, for every job of the DAG at parse time, and
`check_slurm_stages` that Slurm's commands are there and knows the partitions the stages name.
"""
import functools
import glob
import importlib.util
import math
import os
import re
import shlex
import shutil
import subprocess
import unicodedata

from runtime.models import EMULATED_BF16, NATIVE_BF16_FLAGS, cpu_runs_bf16

# Where a stage's job runs and how big it is. The same names work in the config (`launcher.<key>`,
# `launcher.stages.<stage>.<key>`) and as Snakemake resources in a profile (`default-resources`,
# `set-resources: {<rule>: {<key>: ...}}`). Precedence, lowest first: launcher.<key>,
# launcher.stages.<stage>.<key>, the profile's resources.
RESOURCE_KEYS = ("cluster", "nodes", "gpus_per_node", "cpus_per_node", "mem_gb", "timeout_min", "partition",
                 "account", "sbatch_extra")
# The job's stall watch (runtime/progress.py) and the launcher's one requeue of a stalled job: config keys only.
STALL_KEYS = ("stall_min", "requeue_stalled")
CLUSTERS = ("local", "slurm")
# Resource names of Snakemake's own Slurm executor plugin: easy to write by habit, but not read here.
FOREIGN_RESOURCES = {"slurm_partition": "partition", "slurm_account": "account", "slurm_extra": "sbatch_extra",
                     "runtime": "timeout_min", "cpus_per_task": "cpus_per_node", "gpu": "gpus_per_node",
                     "gpus": "gpus_per_node", "gres": "gpus_per_node or sbatch_extra", "tasks": "nodes",
                     "mem_mb_per_cpu": "mem_gb", "constraint": "sbatch_extra", "qos": "sbatch_extra"}
# sbatch options that the launcher sets itself; sbatch_extra must not contradict them.
OWN_SBATCH_OPTIONS = {"nodes": "nodes", "ntasks": "nodes", "ntasks-per-node": "nodes", "cpus-per-task": "cpus_per_node",
                      "mem": "mem_gb", "mem-per-cpu": "mem_gb", "time": "timeout_min", "partition": "partition",
                      "account": "account", "gpus-per-node": "gpus_per_node", "gpus": "gpus_per_node",
                      "output": None, "error": None, "job-name": None, "signal": None, "open-mode": None,
                      "wrap": None, "array": None}

# mem_gb when the config leaves it null: on Slurm this much; on the local executor this machine's memory.
SLURM_DEFAULT_MEM_GB = 16
# The least memory a stage's job may ask for, in GB (the schema's minimum of mem_gb): its Python with torch alone takes
# about that; Slurm would kill a job of less at its first import, after the stages before it ran.
MIN_MEM_GB = 1


class LaunchConfigError(ValueError):
    """A resource request that cannot work; raised before anything is queued."""


def control_characters(text: str) -> list[str]:
    """The control characters (newline, tab, carriage return, NUL, ...) in `text`, each as Python writes it."""
    return sorted({repr(c)[1:-1] for c in text if unicodedata.category(c) == "Cc"})


def _coerce(key: str, value, source: str):
    """A resource value as the launcher uses it; LaunchConfigError naming `source` if it is not valid."""
    def bad(expected: str):
        return LaunchConfigError(f"{source} = {value!r} is not valid: expected {expected}")

    if isinstance(value, str) and control_characters(value):
        # A newline in an option ends its `#SBATCH` line in the job script: sbatch stops reading options at the
        # first line that is not one, so every option after it would be dropped without a word.
        raise LaunchConfigError(f"{source} = {value!r} is not valid: it contains the control character(s) "
                                f"{', '.join(control_characters(value))}; each goes into an #SBATCH line of the job "
                                "script: write it on one line (sbatch options separated by spaces)")

    if key == "cluster":
        if value not in CLUSTERS:
            raise bad(f"one of {list(CLUSTERS)}")
        return value
    if key in ("partition", "account"):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        if not isinstance(value, str) or any(c.isspace() for c in value):
            raise bad("a name without spaces")
        return value
    if key == "sbatch_extra":
        if value is None:
            return ""
        if not isinstance(value, str):
            raise bad('a string of sbatch options, e.g. "--qos=high --constraint=a100"')
        return value
    if key == "mem_gb":
        if value is None:
            return None  # (stage_resources: the default of the stage's executor)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad("a number of GB") from None
        if isinstance(value, bool) or not math.isfinite(number) or number < MIN_MEM_GB:
            raise bad(f"a number of GB >= {MIN_MEM_GB} (a stage's Python with torch alone takes about that)")
        return number
    minimum = {"nodes": 1, "cpus_per_node": 1, "timeout_min": 1, "gpus_per_node": 0}[key]
    # An int, or the digits of one (profile values may arrive as text); 2.0, "2.0", inf and NaN are refused.
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        number = int(value)
    else:
        number = None
    if number is None or number < minimum:
        raise bad(f"a whole number >= {minimum}")
    return number


def parse_sbatch_extra(text: str, source: str) -> dict:
    """'--qos=high --exclusive' -> {"qos": "high", "exclusive": True} (submitit's additional parameters)."""
    options = {}
    try:
        words = shlex.split(text or "")
    except ValueError as err:
        raise LaunchConfigError(f"{source} = {text!r} is not valid: {err}") from None
    for word in words:
        if not word.startswith("--") or len(word) < 3:
            raise LaunchConfigError(f"{source} = {text!r}: {word!r} is not a long sbatch option; write each as "
                                    f"--name=value or --flag (e.g. --qos=high --exclusive)")
        name, has_value, value = word[2:].partition("=")
        if name in OWN_SBATCH_OPTIONS:
            instead = OWN_SBATCH_OPTIONS[name]
            raise LaunchConfigError(f"{source}: --{name} is set by the launcher"
                                    + (f"; use the resource `{instead}` instead" if instead else ""))
        options[name] = value if has_value else True
    return options


def stage_resources(stage: str, launcher: dict, profile: dict | None = None) -> tuple[dict, dict]:
    """(resources, where each came from) for one stage: the config's launcher block, overridden by its
    `launcher.stages.<stage>` entry, overridden by the Snakemake resources that the profile gave the rule."""
    resources, sources = {}, {}
    for key in RESOURCE_KEYS + STALL_KEYS:
        resources[key], sources[key] = launcher[key], f"launcher.{key}"
    for key, value in (launcher.get("stages") or {}).get(stage, {}).items():
        resources[key], sources[key] = value, f"launcher.stages.{stage}.{key}"
    for key, value in (profile or {}).items():
        if key in FOREIGN_RESOURCES:
            raise LaunchConfigError(f"Snakemake resource `{key}` of rule {stage} is not read by alignpipe's "
                                    f"launcher; use `{FOREIGN_RESOURCES[key]}` (docs/cluster.md)")
        if key in RESOURCE_KEYS:
            resources[key], sources[key] = value, f"Snakemake resource `{key}` of rule {stage} (profile)"
    for key in RESOURCE_KEYS:
        resources[key] = _coerce(key, resources[key], sources[key])
    if resources["mem_gb"] is None:
        local = resources["cluster"] == "local"
        resources["mem_gb"] = machine_memory_gb() if local else SLURM_DEFAULT_MEM_GB
        sources["mem_gb"] += f" (null: {'this machine' if local else 'on Slurm'}, {resources['mem_gb']:g} GB)"
    resources["sbatch_options"] = parse_sbatch_extra(resources["sbatch_extra"], sources["sbatch_extra"])
    resources["ray_port"] = launcher["ray_port"]
    if resources["cluster"] == "local" and resources["nodes"] > 1:
        raise LaunchConfigError(f"{sources['nodes']} = {resources['nodes']}, but the local executor runs a job on "
                                f"this machine only (1 node): submit to Slurm (snakemake --profile slurm) or "
                                f"set it to 1")
    return resources, sources


JUDGE_ROLE = "judge vLLM"


def gpus_needed(stage: str, block: dict) -> dict[str, int]:
    """The GPUs each role of a stage's job takes on a GPU cluster (one per DeepSpeed rank, frozen-model rank and
    engine GPU; evaluation's scorer one at least, after the engines: it takes every GPU of its node)."""
    vllm = block.get("vllm") or {}
    engines = vllm.get("num_engines", 1) * vllm.get("tensor_parallel_size", 1)
    if stage == "rl":
        roles = {"policy": block["num_workers"]}
        if block.get("kl_coef") != 0:  # no reference without a KL penalty (absent: the schema's default, a penalty)
            roles["reference"] = block.get("frozen_ranks", 1)
        roles["vLLM"] = engines
        if block.get("estimator") == "gae":
            roles["critic"] = block["num_workers"]
        if block.get("reward", "model") == "model":
            roles["reward model"] = block.get("frozen_ranks", 1)
        if block.get("teacher"):
            roles["teacher"] = block.get("frozen_ranks", 1)
        if block.get("reward") == "judge":  # GPUs of their own, colocated or not (runtime/rl_actors.Roles)
            judge = block["judge"]["vllm"]
            roles[JUDGE_ROLE] = judge["num_engines"] * judge["tensor_parallel_size"]
        return roles
    if stage in ("evaluate", "benchmark"):
        roles = {"vLLM": engines, "scorer": 1}
        if "judge" in block.get("rewards", []):  # its engines in turn with the others (stages/evaluate.judged)
            roles["judge"] = block["judge"]["vllm"]["num_engines"] * block["judge"]["vllm"]["tensor_parallel_size"]
        return roles
    return {"trainer": block["num_workers"]} if "num_workers" in block else {}


def check_fits(stage: str, params: dict, resources: dict, sources: dict) -> None:
    """A stage's Ray actors must fit its job, or Ray would wait for them forever: on CPU 1 CPU per DeepSpeed rank
    (unless the roles share the cores, `colocate: true`); on GPUs the GPUs every role takes (`gpus_needed`; summed,
    or the largest role's where the roles share GPUs). Settings that need GPUs are refused on a job without them; a
    tensor-parallel engine's GPUs lie on one node; colocated on GPUs, the policy ranks are the engine GPUs (the weight
    sync over CUDA IPC needs a policy rank on each)."""
    block = params.get(stage) if isinstance(params.get(stage), dict) else {}
    if stage == "benchmark":  # its engines are evaluate.vllm's
        block = {"vllm": params["vllm"]}
    workers = block.get("num_workers")
    capacity = resources["nodes"] * resources["cpus_per_node"]
    gpus = resources["gpus_per_node"]
    where = f"{resources['nodes']} node(s) ({sources['nodes']}) x"
    if isinstance(workers, int) and workers > capacity and not block.get("colocate") and not gpus:
        raise LaunchConfigError(
            f"{stage}.num_workers = {workers} Ray actors (1 CPU each) do not fit the stage's job: {where} "
            f"{resources['cpus_per_node']} CPUs ({sources['cpus_per_node']}) = {capacity}; raise those or lower "
            f"{stage}.num_workers")
    vllm = block.get("vllm") or {}
    if not gpus:
        gpu_only = {"vllm.tensor_parallel_size": vllm.get("tensor_parallel_size", 1) > 1,
                    "vllm.sleep": vllm.get("sleep", False), "offload_optimizer": block.get("offload_optimizer", False),
                    "attn_implementation": block.get("attn_implementation") == "flash_attention_2"}
        for key, used in gpu_only.items():
            if used:
                raise LaunchConfigError(f"{stage}.{key} = {_value(block, key)!r} needs GPUs, but the stage's job has "
                                        f"none ({sources['gpus_per_node']} = 0); set gpus_per_node or change {key}")
        # bf16 on CPUs needs their bf16 instructions: known here for this machine's jobs; on Slurm's CPU nodes the
        # stage checks as it starts (runtime/models.model_dtype)
        if block.get("precision") == "bf16" and resources["cluster"] == "local" and not cpu_runs_bf16():
            raise LaunchConfigError(f"{stage}.precision = 'bf16' on this machine's CPU, which has no native bf16 "
                                    f"instructions ({' or '.join(NATIVE_BF16_FLAGS)} in /proc/cpuinfo): it would be "
                                    "emulated, slower than fp32; use precision auto or fp32, or GPUs (or, for a "
                                    f"tiny model, {EMULATED_BF16}=1 in the environment: bf16 emulated)")
        return
    check_attention(stage, block)
    if stage == "rl" and block.get("colocate") and block.get("async_rollouts"):
        raise LaunchConfigError(f"{stage}.async_rollouts = {block['async_rollouts']} overlaps generation with training, "
                                f"but with {stage}.colocate = true on GPUs the engines and the trainers share the same "
                                "GPUs, which run one at a time: nothing would overlap; set async_rollouts: 0, or "
                                "colocate: false (engines on GPUs of their own)")
    roles = gpus_needed(stage, block)
    if not roles:
        return
    shared = stage == "rl" and block.get("colocate")
    # evaluation's scorer starts once its engines are gone, on their GPUs (stages/evaluate.py)
    how = "colocated: the largest role" if shared else "in turn: the largest role" if stage in ("evaluate", "benchmark") \
        else "summed"
    shared_roles = [count for role, count in roles.items() if role != JUDGE_ROLE]
    needed = (sum(shared_roles) if how == "summed" else max(shared_roles)) + roles.get(JUDGE_ROLE, 0)
    if needed > resources["nodes"] * gpus:
        parts = ", ".join(f"{role} {count}" for role, count in roles.items())
        raise LaunchConfigError(
            f"stage {stage} needs {needed} GPUs ({parts}; {how}{', the judge besides' if JUDGE_ROLE in roles else ''}), "
            f"but its job has {where} {gpus} GPUs ({sources['gpus_per_node']}) = {resources['nodes'] * gpus}; "
            f"raise those or lower the stage's num_workers / frozen_ranks / vllm.num_engines")
    tp, engines = vllm.get("tensor_parallel_size", 1), vllm.get("num_engines", 1)
    if tp > gpus:
        raise LaunchConfigError(f"{stage}.vllm.tensor_parallel_size = {tp} GPUs per engine "
                                f"exceed a node's {gpus} ({sources['gpus_per_node']}): an engine runs on one node")
    if engines * tp > gpus and gpus % tp:
        raise LaunchConfigError(
            f"{stage}.vllm: {engines} engines x tensor_parallel_size {tp} = {engines * tp} GPUs span nodes of {gpus} "
            f"GPUs ({sources['gpus_per_node']}), and {tp} does not divide {gpus}: some engine's GPUs would straddle "
            f"two nodes (an engine runs on one); choose a tensor_parallel_size that divides {gpus}")
    if shared and workers != engines * tp:
        # runtime/weight_sync.py, `ipc`: each vLLM worker loads the weights from the policy rank on its own GPU.
        valid = f"num_workers = {engines * tp}"
        if workers % tp == 0:
            valid += f" or vllm.num_engines = {workers // tp}"
        raise LaunchConfigError(
            f"{stage}.colocate = true on GPUs hands the policy's weights to each vLLM GPU from the policy rank on that "
            f"GPU, so the policy ranks and the engine GPUs must be the same GPUs: {stage}.num_workers = {workers}, but "
            f"{stage}.vllm.num_engines x {stage}.vllm.tensor_parallel_size = {engines} x {tp} = {engines * tp}; set "
            f"{valid}, or colocate: false")
    if vllm.get("sleep") and not (shared and block.get("zero_stage") == 3):
        raise LaunchConfigError(f"{stage}.vllm.sleep needs colocate: true and zero_stage: 3 (DeepSpeed's ZeRO-3 "
                                "states leave the GPUs while vLLM generates)")


def check_attention(stage: str, block: dict) -> None:
    """On GPUs: flash_attention_2 only where the flash-attn package is installed (envs/gpu.txt cannot hold it: PyPI has
    only its source, which builds with nvcc against the node's torch and CUDA), and packing only with it. With sdpa or
    eager, transformers turns a packed row's position ids into a dense block-diagonal mask over the whole row
    (masking_utils): attention over N x N positions, slower than the padding it saves (~1.9x at 8B and 32k packed
    tokens), and eager's N x N scores run out of memory."""
    attention = block.get("attn_implementation")
    if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise LaunchConfigError(
            f"{stage}.attn_implementation = 'flash_attention_2' needs the flash-attn package, which this environment "
            "lacks (PyPI has no wheel of it, only its source: build it on a GPU node with `pip install flash-attn "
            "--no-build-isolation` into .venv-gpu, nvcc and torch's CUDA needed); or set attn_implementation: sdpa")
    if block.get("packing") and attention in ("sdpa", "eager"):
        raise LaunchConfigError(
            f"{stage}.packing = true with {stage}.attn_implementation = {attention!r} on GPUs: transformers would build "
            "a dense block-diagonal mask over each whole packed row, attending over N x N positions (slower than the "
            "padding packing saves; eager runs out of memory); packing on GPUs needs attn_implementation: "
            "flash_attention_2 (its variable-length kernel), or set packing: false")


def machine_memory_gb() -> float:
    """This machine's memory in GB (GiB, as mem_gb counts it), to a tenth, rounded down."""
    return math.floor(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30) * 10) / 10


def check_this_machine(resources: dict, sources: dict) -> None:
    """A job of the local executor runs on this machine: no more CPUs, GPUs or memory than it has (Ray counts what it
    is told, so 1000 CPUs would start 1000 torch threads; GPUs that are not there fail in the stage, hours in; the
    memory plan and Ray's object store are sized from mem_gb)."""
    if resources["cluster"] != "local":
        return
    have = {("cpus_per_node", "CPUs"): len(os.sched_getaffinity(0)),
            ("gpus_per_node", "GPUs"): len(glob.glob("/dev/nvidia[0-9]*")),
            ("mem_gb", "GB of memory"): machine_memory_gb()}
    for (key, what), count in have.items():
        if resources[key] > count:
            null = " (or mem_gb: null, this machine's memory)" if key == "mem_gb" else ""
            raise LaunchConfigError(f"{sources[key]} = {resources[key]:g}, but this machine, where the local executor "
                                    f"runs the job, has {count:g} {what}; set at most {count:g}{null}, or submit to "
                                    "Slurm (snakemake --profile slurm)")


def _value(block: dict, dotted: str):
    for part in dotted.split("."):
        block = block.get(part) if isinstance(block, dict) else None
    return block


def describe(resources: dict) -> str:
    text = (f"{resources['nodes']} node(s) x {resources['cpus_per_node']} CPUs, {resources['mem_gb']:g} GB, "
            f"{resources['gpus_per_node']} GPU(s) per node, {resources['timeout_min']} min")
    if resources["cluster"] == "slurm":
        text += f", partition {resources['partition'] or '(default)'}, account {resources['account'] or '(default)'}"
        if resources["sbatch_extra"]:
            text += f", sbatch {resources['sbatch_extra']}"
    return text


def _slurm_mem(mem_gb: float) -> str:
    return f"{int(mem_gb)}GB" if mem_gb == int(mem_gb) else f"{int(mem_gb * 1024)}MB"  # as submitit writes it


def sbatch_flags(resources: dict) -> list[str]:
    """The sbatch options of a stage's job (what submitit writes into its script, minus paths and signal)."""
    flags = [f"--nodes={resources['nodes']}", "--ntasks-per-node=1", f"--cpus-per-task={resources['cpus_per_node']}",
             f"--mem={_slurm_mem(resources['mem_gb'])}", f"--time={resources['timeout_min']}", "--requeue"]
    if resources["gpus_per_node"]:
        flags.append(f"--gpus-per-node={resources['gpus_per_node']}")
    if resources["partition"]:
        flags.append(f"--partition={resources['partition']}")
    if resources["account"]:
        flags.append(f"--account={resources['account']}")
    flags += [f"--{k}" if v is True else f"--{k}={v}" for k, v in resources["sbatch_options"].items()]
    return flags


def check_slurm(run_name: str, resources: dict, sources: dict) -> None:
    """Ask Slurm whether it would accept the job (`sbatch --test-only`: nothing is queued)."""
    if shutil.which("sbatch") is None:
        raise LaunchConfigError(f"{sources['cluster']} = slurm, but there is no `sbatch` on this machine's PATH")
    cmd = ["sbatch", "--test-only", *sbatch_flags(resources), f"--job-name=alignpipe-{run_name.split('/')[0]}",
           "--output=/dev/null", "--wrap=true"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LaunchConfigError("`sbatch --test-only` did not answer within 60 s: is slurmctld reachable?") from None
    if proc.returncode != 0:
        said = " ".join(line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip())
        origin = "; ".join(f"{k} from {sources[k]}" for k in RESOURCE_KEYS if k != "cluster")
        raise LaunchConfigError(f"Slurm would not accept the job of stage {run_name} ({describe(resources)}): "
                                f"{said}\n  where the values come from: {origin}")


def stage_label(stage: str, params: dict) -> str:
    """How a problem names a job's stage: the stage, or rl/<variant> (the seeds of a method share their settings)."""
    return f"rl/{params['variant']}" if stage == "rl" else stage


def stage_list(labels: list[str]) -> str:
    """'stage sft' or 'stages rl/grpo, rl/ppo': the stages (rl: its variants) a problem stops, each once."""
    labels = list(dict.fromkeys(labels))
    return f"stage{'s' if len(labels) > 1 else ''} {', '.join(labels)}"


@functools.lru_cache(maxsize=None)
def slurm_partitions(sinfo: str, slurm_conf: str | None) -> tuple[tuple[str, ...], str | None]:
    """(the partitions of the Slurm cluster that `sinfo` (a path) and SLURM_CONF reach, hidden ones too, the default's
    `*` mark stripped; what went wrong, or None): asked once per process and cluster."""
    try:
        proc = subprocess.run([sinfo, "--all", "--noheader", "--format=%P"], capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return (), "`sinfo` did not answer within 30 s: is slurmctld reachable?"
    if proc.returncode != 0:
        said = " ".join(line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip())
        return (), f"`sinfo` failed (exit status {proc.returncode}): {said}"
    return tuple(dict.fromkeys(line.strip().rstrip("*") for line in proc.stdout.splitlines() if line.strip())), None


def check_slurm_stages(jobs, launcher: dict, profile_for=None) -> list[str]:
    """Where a job of the DAG runs on Slurm: `sbatch` (to submit) and `sinfo` on PATH, and every partition a stage
    names (a comma-separated list too, as sbatch takes it) one of the cluster's, asked once (`sinfo`). `jobs`,
    `profile_for` and what is returned as check_stages's; the values are check_stages's, already checked."""
    on_slurm: dict[str, str] = {}  # the stages sent to Slurm -> where `cluster: slurm` came from
    named: dict[tuple[str, str], list[str]] = {}  # (partition, where it came from) -> the stages that name it
    for stage, _, params in jobs:
        label = stage_label(stage, params)
        resources, sources = stage_resources(stage, launcher, profile_for(stage) if profile_for else None)
        if resources["cluster"] != "slurm":
            continue
        on_slurm[label] = sources["cluster"]
        for partition in (resources["partition"] or "").split(","):
            if partition:
                named.setdefault((partition, sources["partition"]), []).append(label)
    problems = [f"{stage_list(list(on_slurm))}: {'; '.join(dict.fromkeys(on_slurm.values()))} = slurm, but "
                f"`{command}` is not on this machine's PATH; run where Slurm's commands are (a login node), or set "
                "cluster: local" for command in ("sbatch", "sinfo") if on_slurm and not shutil.which(command)]
    if problems or not named:
        return problems
    partitions, failed = slurm_partitions(shutil.which("sinfo"), os.environ.get("SLURM_CONF"))
    if failed:
        return [f"{stage_list([label for labels in named.values() for label in labels])}: cannot check the partitions "
                f"they name ({', '.join(dict.fromkeys(p for p, _ in named))}): {failed}"]
    return [f"{stage_list(labels)}: {source} = {partition!r} is not a partition of this Slurm cluster; its partitions: "
            f"{', '.join(partitions) or 'none'}" for (partition, source), labels in named.items()
            if partition not in partitions]


def check_stages(jobs, launcher: dict, profile_for=None) -> list[str]:
    """The launcher's own checks (stage_resources, check_fits; not `sbatch --test-only`, which needs Slurm and stays
    with each job) of every job the DAG runs, before any is queued. `jobs`: (stage, run name, params) as the rules
    hand them to the launcher (launcher/config.stage_jobs); `profile_for(stage)`: the Snakemake resources a profile
    gives that rule, as far as they are known before the job exists. Returns the problems, each naming the key and
    where its value came from, once with the stages (rl: its variants) it stops."""
    problems: dict[str, list[str]] = {}
    for stage, run_name, params in jobs:
        label = stage_label(stage, params)
        try:
            resources, sources = stage_resources(stage, launcher, profile_for(stage) if profile_for else None)
            check_fits(stage, params, resources, sources)
            check_this_machine(resources, sources)
        except LaunchConfigError as err:
            labels = problems.setdefault(str(err), [])
            if label not in labels:
                labels.append(label)
    return [f"{stage_list(labels)}: {err}" for err, labels in problems.items()]
