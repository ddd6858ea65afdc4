"""The checks that run before anything is queued, at Snakefile parse time (workflow/rules/common.smk): hub ids that
the offline jobs would not find in the Hugging Face cache, every job's resource request as the launcher will check it
(launcher/resources.py), Slurm's commands and partitions where stages run on Slurm, the users' dataset rows
(runtime/user_data.check_datasets), batches that the data cannot fill, datasets none of whose prompts fits
data.max_prompt_tokens, and the environment file (environment.path: imported in a child process).

Imported by the Snakefile, so it must stay light (no torch, no ray).
"""
import ast
import itertools
import shutil
import tempfile
from pathlib import Path

from launcher.config import (DATASET_ROLES, REPO_ROOT, RESULTS_FILES, RESULTS_MARKER, ConfigError, check_dag_data,
                             check_environment_file, dag_stages, results_root, stage_jobs, trained_stages)
from launcher.memory import check_memory
from launcher.resources import FOREIGN_RESOURCES, RESOURCE_KEYS, check_slurm_stages, check_stages
from runtime.builtin_data import review_pool_sizes
from runtime.user_data import check_datasets, count_rows, is_builtin, is_hub, local_rows, repo_path

# What a job reads of itself; a resource expression that names one is known only once its job exists.
JOB_NAMES = {"input", "wildcards", "attempt", "threads", "rulename", "async_run", "output", "params", "resources"}


def check_before_queueing(config: dict, source: str, resource_settings) -> str | None:
    """Every check a validated config gets before the DAG runs; ConfigError or DataError naming the key. What
    check_datasets remembers (its cache) is written only once every check has passed. Returns the memory plan of
    the GPU jobs as a table (launcher/memory.py), None without GPU jobs."""
    check_output_dirs(config, source)
    check_dag_data(config, source)
    if config["environment"] is not None:  # (read by rl and evaluate: runtime/environments.load_environment)
        check_environment_file(config["environment"]["path"], f"{source}: environment.path")
    check_hub_ids(config, source)
    jobs, profile_for = list(stage_jobs(config)), lambda rule: profile_resources(resource_settings, rule)
    problems = check_stages(jobs, config["launcher"], profile_for)
    if problems:
        raise ConfigError(f"{source}: jobs the launcher would refuse (nothing was queued)\n"
                          + "\n".join("  " + p for p in problems))
    problems = check_slurm_stages(jobs, config["launcher"], profile_for)
    if problems:
        raise ConfigError(f"{source}: jobs Slurm cannot take (nothing was queued)\n"
                          + "\n".join("  " + p for p in problems))
    memory_plan = check_memory(config, source, profile_for)
    checked = results_root(config) / config["experiment"] / ".checked_datasets.json"
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / checked.name
        if checked.is_file():
            shutil.copyfile(checked, staged)
        check_datasets(config["data"], staged)
        check_batches(config, source)
        check_prompt_lengths(config, source)
        if staged.is_file() and (not checked.is_file() or staged.read_bytes() != checked.read_bytes()):
            checked.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(staged, checked)
    return memory_plan


# Directories that hold a system's or everyone's files: never a results or checkpoint directory.
SYSTEM_DIRS = {Path(p) for p in ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media",
                                 "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr",
                                 "/var", "/var/tmp", "/scratch")}


def check_output_dirs(config: dict, source: str) -> None:
    """results_dir and launcher.checkpoint_dir: stages write (and replace their own outputs) there, so each must be
    new, empty or alignpipe's own (its marker, or what alignpipe writes there), never a system directory, a home
    directory or a folder of the repository other than results/; and no experiment takes the name of a file of
    results_dir itself."""
    if config["experiment"] in RESULTS_FILES:
        raise ConfigError(f"{source}: experiment = {config['experiment']!r} is the name of a file of results_dir "
                          f"itself ({', '.join(RESULTS_FILES)}); choose another name")
    # what alignpipe writes into each directory itself (results_dir: RESULTS_FILES, the benches' models among them)
    chosen = [("results_dir", config["results_dir"], (*RESULTS_FILES, config["experiment"])),
              ("launcher.checkpoint_dir", config["launcher"]["checkpoint_dir"], (config["experiment"],))]
    for key, value, alignpipes in chosen:
        if value is None:
            continue
        path = (REPO_ROOT / value).resolve()
        inside_repo = path == REPO_ROOT or REPO_ROOT in path.parents
        if path in SYSTEM_DIRS or path == Path.home().resolve() or len(path.parts) < 3 and not inside_repo:
            raise ConfigError(f"{source}: {key} = {value!r} ({path}) is a system or home directory; alignpipe writes "
                              "into it and replaces what its stages made there: give a directory of its own, e.g. "
                              f"{Path.home() / 'alignpipe-results'}")
        if inside_repo and path.relative_to(REPO_ROOT).parts[:1] != ("results",):
            raise ConfigError(f"{source}: {key} = {value!r} ({path}) is a folder of the repository; inside it only "
                              "results/ (the default) and what lies below it are for results")
        if path.is_dir() and not (path / RESULTS_MARKER).exists() and not any(
                (path / name).exists() for name in alignpipes) and any(path.iterdir()):
            raise ConfigError(f"{source}: {key} = {value!r} ({path}) holds files that alignpipe did not write (no "
                              f"{RESULTS_MARKER} there); give a new or empty directory, or one alignpipe wrote before")


# ---- hub ids the jobs would not find ----------------------------------------------------------------------------
# The jobs run offline (runtime/job.set_job_env) unless launcher.hub_downloads allows downloads: a hub model or dataset
# that is not in the Hugging Face cache would fail its stage only after the stages before it ran. Nothing here asks
# the hub.

def hub_model_in_cache(repo: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of model `repo` with its config.json and safetensors weights
    (what the base_model stage links, offline)."""
    from huggingface_hub import try_to_load_from_cache
    try:
        config = try_to_load_from_cache(repo, "config.json")
    except ValueError:  # not a valid repository id (huggingface_hub's HFValidationError)
        return False
    return isinstance(config, str) and any(Path(config).parent.glob("*.safetensors"))


def hub_dataset_cache(repo: str) -> Path:
    """Where `datasets` keeps hub dataset `repo` once it prepared it, one directory per config, version and hash: the
    only place its load_dataset looks offline (a snapshot in the hub cache, as `hf download` leaves it, is not read)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase
    org, name = repo.split("/")
    return Path(datasets.config.HF_DATASETS_CACHE).expanduser() / f"{org}___{camelcase_to_snakecase(name)}"


def check_hub_ids(config: dict, source: str) -> None:
    """With launcher.hub_downloads false, every hub id the DAG reads (model.path; data.<role>.path of each dataset
    preprocess writes) must be in the cache the jobs read: a model as hub_model_in_cache says, a dataset as
    hub_dataset_cache. (sft.from and reward_model.from are local directories: launcher/config.check_model_dir.)"""
    if config["launcher"]["hub_downloads"]:
        return
    problems = []
    model = config["model"]["path"]
    if model and is_hub(model) and not hub_model_in_cache(model):
        from huggingface_hub import constants
        problems.append(f"{source}: model.path = {model!r}: no snapshot of it with config.json and *.safetensors "
                        f"weights in the Hugging Face cache ({constants.HF_HUB_CACHE}); download it there first, on a "
                        f"machine with network and the same HF_HOME: hf download {model}")
    roles = [role for dataset in dag_stages(config)["datasets"] for role in DATASET_ROLES[dataset]]
    for role in roles:
        path, split = config["data"][role]["path"], config["data"][role]["split"]
        if not path or not is_hub(path):
            continue
        cache = hub_dataset_cache(path)
        if not any(prepared.is_dir() for prepared in cache.glob("*/*/*")):
            problems.append(f"{source}: data.{role}.path = {path!r}: not in the `datasets` cache ({cache}, all that "
                            "load_dataset reads offline; `hf download` does not fill it); load it there once, on a "
                            "machine with network and the same HF_HOME: python -c \"import datasets; "
                            f"datasets.load_dataset({path!r}, split={split!r})\"")
    if problems:
        raise ConfigError("hub ids the jobs would not find: they run offline (launcher.hub_downloads: false) on the "
                          "Hugging Face cache, and nothing was downloaded or queued\n"
                          + "\n".join("  " + p for p in problems)
                          + "\n  valid: a local path that exists, a hub id already in the cache (as above), or "
                          "launcher.hub_downloads: true to let the stages download (their nodes need network)")


def profile_resources(settings, rule: str) -> dict:
    """The Snakemake resources that a profile's default-resources / set-resources (or the same command-line flags)
    give `rule`, as far as they are known at parse time: plain values, and expressions that read nothing of a job
    (a string such as "--qos=high" too). Those that read the job (input, wildcards, attempt, threads) are left to
    the launcher's check of that job. No rule here declares resources of its own."""
    try:  # what Snakemake (9.x) gives each rule it defines (workflow.py: the rule's resources)
        merged = dict(settings._parsed_default_resources.items())
        merged.update(settings._parsed_overwrite_resources.get(rule, {}).items())
    except AttributeError:  # another Snakemake: the config's resources are checked here, the profile's per job
        return {}
    known = {}
    for name, resource in merged.items():
        if name in FOREIGN_RESOURCES:
            known[name] = None  # refused whatever its value
        elif name in RESOURCE_KEYS:
            if not resource.is_evaluable():
                known[name] = resource.value
                continue
            if not isinstance(resource.raw, str):
                continue
            try:
                names = {n.id for n in ast.walk(ast.parse(resource.raw, mode="eval")) if isinstance(n, ast.Name)}
            except SyntaxError:
                names = set()  # plain text: Snakemake takes it as the string itself
            if names & JOB_NAMES:
                continue
            try:
                known[name] = resource.evaluate(wildcards=None, input=None, attempt=1, threads=1, rulename=rule,
                                                async_run=None).value
            except Exception:
                continue  # its job's own check will say what is wrong with it
    return known


# ---- batches the data cannot fill ---------------------------------------------------------------------------
# The preprocess stage reads at most data.<role>.max_samples rows of a dataset, drops those too long for the token
# limits and holds out a seeded eval_fraction (stages/preprocess.py, hold_out). The counts below are what it can
# give at best (no row dropped), computed without a tokenizer; a batch larger than that can never be filled.

def _rows_read(config: dict, role: str) -> tuple[int, str]:
    """(rows the preprocess stage reads at most for `role`, how that was counted): max_samples, or fewer where a
    local file or a built-in dataset has fewer. A hub dataset is not looked up (nothing is downloaded here)."""
    data, spec = config["data"], config["data"][role]
    path, limit = spec["path"], spec["max_samples"]
    available = None
    if is_builtin(path) and path.split(":", 1)[1] != "arithmetic":  # builtin:arithmetic generates max_samples
        prompt_words = data["builtin"]["prompt_words"]
        available = review_pool_sizes(path.split(":", 1)[1], config["seed"], prompt_words).get(role)
        what = f"{available} reviews long enough for data.builtin.prompt_words = {prompt_words}"
    elif not is_builtin(path) and not is_hub(path):
        available = count_rows(repo_path(path), spec)
        what = f"{available} rows in the file"
    if available is None or available >= limit:
        return limit, f"data.{role}.max_samples = {limit}"
    return available, f"{what} (data.{role}.max_samples = {limit})"


def _train_rows(config: dict, role: str) -> tuple[int, str]:
    """(training rows preprocess can give at most for `role`, how): rows read less the held-out ones."""
    rows, how = _rows_read(config, role)
    spec = config["data"][role]
    if role == "prompts" and config["data"]["eval"]["path"]:  # the eval dataset is held out instead
        return rows, f"data.{role} = {spec['path']!r}: {rows} rows at most, from {how}"
    held = max(1, round(spec["eval_fraction"] * rows)) if rows else 0  # stages/preprocess.py, hold_out
    return rows - held, (f"data.{role} = {spec['path']!r}: {rows} rows at most, from {how}, less {held} held out "
                         f"(data.{role}.eval_fraction = {spec['eval_fraction']})")


def check_batches(config: dict, source: str) -> None:
    """Refuse a batch that the experiment's data cannot fill, before preprocess runs: sft.batch_size over the SFT
    training rows, reward_model / dpo batch_size over the training pairs (runtime/trainer.steps_for), an rl
    variant's rollout_batch_size over the training prompts (stages/rl.py). Counts are upper bounds (rows too long
    for the token limits are dropped later), so what is refused here would fail in its job. Local files are
    counted, built-in datasets sized; a hub dataset is bounded by its max_samples only (nothing is downloaded)."""
    checks = []  # (key, batch, role, what the batch counts)
    trained = trained_stages(config)  # (not a given model, nor a stage the DAG does not hold)
    for stage, role, what in (("sft", "sft", "training rows"), ("reward_model", "preference", "training pairs"),
                              ("dpo", "preference", "training pairs")):
        if stage in trained:
            checks.append((f"{stage}.batch_size", config[stage]["batch_size"], role, what))
    variants = config["rl"]["variants"]
    inheriting = [name for name in variants if "rollout_batch_size" not in variants[name]]
    if inheriting:
        checks.append((f"rl.rollout_batch_size (variant{'s' if len(inheriting) > 1 else ''} {', '.join(inheriting)})",
                       config["rl"]["rollout_batch_size"], "prompts", "training prompts"))
    checks += [(f"rl.variants.{name}.rollout_batch_size", variants[name]["rollout_batch_size"], "prompts",
                "training prompts") for name in variants if name not in inheriting]
    problems, counted = [], {}
    for key, batch, role, what in checks:
        if role not in counted:
            counted[role] = _train_rows(config, role)
        rows, how = counted[role]
        if batch > rows:
            problems.append(f"{source}: {key} = {batch} is larger than the {what} the data can give: at most "
                            f"{max(rows, 0)} ({how}); lower {key.split(' ')[0]} or give data.{role} more rows")
    if problems:
        raise ConfigError("batches the data cannot fill\n" + "\n".join("  " + p for p in problems))


# ---- prompts too long for data.max_prompt_tokens ------------------------------------------------------------------
# The preprocess stage drops each row whose prompt is longer and fails with fewer than 2 left, after base_model ran.
# Where model.path is a local model with a tokenizer.json, its tokenizer counts the prompts here first: each input as
# written (input_template applied; the chat template, which only adds tokens, left out), so a count is at most the
# stage's and a refusal here is one there. The work is bounded (PROMPT_CHECK_ROWS rows, PROMPT_CHECK_CHARACTERS of
# prompts, and the check stops at the second prompt that fits), which keeps it within seconds on a large file; where
# a bound stops it before every row preprocess reads was counted, nothing is refused.
PROMPT_CHECK_ROWS = 2000
PROMPT_CHECK_CHARACTERS = 2_000_000


def _prompt_input(role: str, spec: dict, row: dict):
    """The input a row's prompt is made of (text or chat messages), as preprocess takes it; None: a pair without
    one (preprocess keeps it whatever max_prompt_tokens)."""
    if role == "sft":
        return row[spec["messages_key"]][:-1] if spec["messages_key"] else row[spec["input_key"]]
    if role == "preference":
        if row.get(spec["prompt_key"]) is not None:
            return row[spec["prompt_key"]]
        chosen = row[spec["chosen_key"]]
        return chosen[:-1] if isinstance(chosen, list) and len(chosen) > 1 else None
    return row[spec["input_key"]]


def check_prompt_lengths(config: dict, source: str) -> None:
    """Refuse a local dataset of the DAG among whose first rows (the first data.<role>.max_samples, which preprocess
    reads, up to PROMPT_CHECK_ROWS) fewer than 2 prompts fit data.max_prompt_tokens, counted with model.path's
    tokenizer.json (see above); nothing is checked without one (a tiny or hub model). Rows are those
    check_datasets passed."""
    model_path = config["model"]["path"]
    tokenizer_file = model_path and not is_hub(model_path) and repo_path(model_path) / "tokenizer.json"
    if not tokenizer_file or not tokenizer_file.is_file():
        return
    from tokenizers import Tokenizer
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception:  # a format this tokenizers cannot read: transformers loads it in preprocess, which counts
        return
    data, limit = config["data"], config["data"]["max_prompt_tokens"]
    template = data["input_template"] if not data["apply_chat_template"] else None
    roles = [role for dataset in dag_stages(config)["datasets"] for role in DATASET_ROLES[dataset]]
    problems = []
    for role in roles:
        spec = data[role]
        if not spec["path"] or is_builtin(spec["path"]) or is_hub(spec["path"]):
            continue
        rows = itertools.islice(local_rows(spec), spec["max_samples"])  # the rows preprocess reads
        fitting, longer, read, characters, exhausted = 0, [], 0, 0, False
        while fitting < 2 and read < PROMPT_CHECK_ROWS and characters < PROMPT_CHECK_CHARACTERS:
            batch = list(itertools.islice(rows, min(256, PROMPT_CHECK_ROWS - read)))
            if not batch:
                exhausted = True
                break
            read += len(batch)
            texts = []
            for row in batch:
                value = _prompt_input(role, spec, row)
                if value is None:
                    fitting += 1
                elif isinstance(value, str):
                    texts.append(template.format(value) if template else value)
                else:  # a chat: its messages' texts (the template adds the rest)
                    texts.append("\n".join(message["content"] for message in value))
            characters += sum(map(len, texts))
            for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
                if len(encoding.ids) <= limit:
                    fitting += 1
                else:
                    longer.append(len(encoding.ids))
        every_row_counted = exhausted or read == spec["max_samples"]
        if fitting < 2 and every_row_counted:
            shortest = f"; the shortest{' of the others' if fitting else ''} is {min(longer)} tokens" if longer else ""
            problems.append(f"{source}: data.{role}.path = {spec['path']!r}: {fitting} of the {read} rows preprocess "
                            f"reads (data.{role}.max_samples = {spec['max_samples']}) have a prompt within "
                            f"data.max_prompt_tokens = {limit}, and it needs 2{shortest} (model.path's tokenizer, "
                            "before the chat template); raise data.max_prompt_tokens or give shorter prompts")
    if problems:
        raise ConfigError("datasets whose prompts are too long\n" + "\n".join("  " + p for p in problems))
