"""The memory plan before queueing (launcher/memory.py), against known cases written as alignpipe configs of the same
shape, with each model's published config.json (tests/hub_configs.py):

  - OpenRLHF's 70B PPO layout, which its maintainers confirm runs on 32 x 80 GB GPUs (OpenRLHF issue 566, for
    examples/scripts/train_ppo_llama_ray_70b.sh of 2024-11-28), fits;
  - the reported out-of-memory runs are refused: Qwen2.5-7B GRPO with ZeRO-2 on two 48 GB actor GPUs (OpenRLHF issue
    901) and 7B GRPO with 36,864-token generations on 80 GB GPUs at micro batch 1 (OpenRLHF issue 887);
  - an over-size variant of config/examples/llama3-70b-ppo.yaml is refused by `snakemake --dry-run` before anything
    is queued, naming the job, the GPU, the phase and the numbers, and a dry run whose GPU jobs fit prints the plan.
The repository's examples themselves: tests/test_examples.py (test_memory_fits, test_dry_run_plans_every_job).
"""
import json
import re

import pytest
import yaml

from hub_configs import HUB_CONFIGS, PUBLISHED_PARAMS, hub_sizes
from launcher.config import REPO_ROOT, ConfigError, check_dag_data, stage_jobs, validate_config
from launcher.memory import (LOGITS_CHUNKS_GB, SCORE_BATCH, ModelSize, check_memory, estimate, memory_plan,
                             model_sizes, vllm_share)
from launcher.resources import JUDGE_ROLE, check_stages, gpus_needed, stage_resources
from test_examples import EXAMPLES, dry_run, load_example, refused_jobs

LLAMA_70B, QWEN_7B = "meta-llama/Meta-Llama-3-70B-Instruct", "Qwen/Qwen2.5-7B-Instruct"
REWARD_FILE = "config/rewards/exact_match.py"  # the issues' runs score with a remote reward or a function


def rl_only(model: str, rl: dict, rl_resources: dict, gpu_memory_gb: float = 80, data: dict | None = None) -> dict:
    """A validated config whose only GPU job is rl: `rl` over the schema's defaults (no SFT, no DPO: RL starts from
    the base model), its prompts (and, for a reward model, its pairs) given, `rl_resources` its job."""
    config = validate_config({
        "model": {"path": model},
        "data": {"max_prompt_tokens": 1024, "preference": {"path": "builtin:imdb"}, "prompts": {"path": "builtin:imdb"},
                 **(data or {})},
        "rl": rl, "evaluate": {"rewards": [REWARD_FILE]},
        "launcher": {"cluster": "slurm", "gpu_memory_gb": gpu_memory_gb, "stages": {"rl": rl_resources}}})
    check_dag_data(config, "rl_only")  # the DAG has the data it reads
    assert config["evaluate"]["models"] == ["base", *rl["variants"]], "every model of the DAG is evaluated"
    assert check_stages(stage_jobs(config), config["launcher"]) == [], "the launcher accepts the layout"
    return config


def example_file(name: str):
    return next(path for path in EXAMPLES if path.stem == name)


def rl_job(config: dict):
    (job,) = [job for job in memory_plan(config, sizes=hub_sizes(config)) if job.stage == "rl"]
    return job


def test_parameter_counts_from_config_json_match_the_published_ones():
    """Llama-style keys and GPT-2's (n_embd, n_layer, n_head; GPT-2 small: 124.4M parameters)."""
    for repo, hf in HUB_CONFIGS.items():
        assert ModelSize.from_config(hf, repo).params == pytest.approx(PUBLISHED_PARAMS[repo], rel=2e-3), repo
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
    assert ModelSize.from_config(gpt2, "gpt2").params == pytest.approx(124.44e6, rel=2e-3)


def test_a_local_model_directory_is_read_and_a_config_it_cannot_count_skips_the_plan(tmp_path, capsys):
    """model.path a directory: its config.json; a mixture-of-experts config (or one without the sizes) skips the
    plan with one line saying why, and refuses nothing."""
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(HUB_CONFIGS[QWEN_7B]))
    (model / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")  # a header, no tensors
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    config = validate_config({"model": {"path": str(model)}, "data": {"sft": {"path": "builtin:imdb"}},  # SFT's job
                              "sft": {"zero_stage": 3},
                              "launcher": {"stages": {"sft": {"gpus_per_node": 2, "mem_gb": 64}}}})
    assert model_sizes(config)["policy"].params == pytest.approx(PUBLISHED_PARAMS[QWEN_7B], rel=2e-3)
    assert "trainer GPU" in check_memory(config, "test")
    (model / "config.json").write_text(json.dumps(HUB_CONFIGS[QWEN_7B] | {"num_local_experts": 8}))
    assert check_memory(config, "test") is None
    assert capsys.readouterr().err.count("memory plan skipped: model: a mixture-of-experts config") == 1


def test_the_plan_follows_the_runtime():
    """The numbers the plan takes from the code that runs: the evaluation's batch, the log-probs' float32 chunks and
    the share of a GPU vLLM takes when gpu_memory_utilization is null."""
    from runtime.logprobs import LOGITS_CHUNK_BYTES
    from runtime.rollout import engine_options
    from stages.evaluate import SCORE_BATCH as scored_at_once
    assert SCORE_BATCH == scored_at_once
    assert LOGITS_CHUNKS_GB == 4 * LOGITS_CHUNK_BYTES / 1e9
    for utilization in (None, 0.7):
        for shares_gpu in (False, True):
            vllm = {"gpu_memory_utilization": utilization, "enforce_eager": True, "tensor_parallel_size": 1,
                    "enable_prefix_caching": True, "sleep": False}
            options = engine_options("model", 0, 64, vllm, on_gpu=True, dtype="bfloat16", shares_gpu=shares_gpu)
            assert vllm_share(vllm, shares_gpu) == options["gpu_memory_utilization"]


def openrlhf_70b_ppo() -> dict:
    """OpenRLHF's train_ppo_llama_ray_70b.sh (2024-11-28): Llama-3-70B-Instruct, actor and reference on 8 GPUs
    (colocated), critic and reward model on 8 (colocated), 8 vLLM engines of TP 2 on 16; ZeRO-3, bf16, Adam offload,
    gradient checkpointing, micro batch 2, micro rollout batch 4, rollout 1024 prompts, train batch 128, prompt and
    generation up to 1024 tokens. alignpipe colocates all roles or none (rl.colocate), so the closest layout gives
    the reference and the reward model GPUs of their own: 8 + 8 + 8 + 8 + 16 = 48 GPUs (6 nodes of 8) where OpenRLHF
    uses 32; the test adds up what OpenRLHF puts on one GPU. OpenRLHF packs samples; here rows are padded. Nodes:
    a DGX's 2 TB (mem_gb 1900)."""
    return rl_only(LLAMA_70B, {
        "variants": {"ppo": {"estimator": "gae"}}, "reward": "model", "rollout_batch_size": 1024, "n_samples": 1,
        "max_new_tokens": 1024, "batch_size": 128, "micro_batch_size": 2, "forward_micro_batch_size": 4,
        "zero_stage": 3, "num_workers": 8, "frozen_ranks": 8, "colocate": False, "gradient_checkpointing": True,
        "offload_optimizer": True, "vllm": {"num_engines": 8, "tensor_parallel_size": 2}},
        {"nodes": 6, "gpus_per_node": 8, "cpus_per_node": 64, "mem_gb": 1900})


def test_openrlhf_70b_ppo_layout_fits():
    config = openrlhf_70b_ppo()
    job = rl_job(config)
    assert job.fits, (job.gpu_phase, job.gpu_items, job.node_phase, job.node_items, job.notes)
    # What OpenRLHF colocates on one GPU: an actor rank beside a reference shard, a critic rank beside a reward shard;
    # each peaks while the other only holds its weights (the roles compute in turn).
    (_, _, params), = [j for j in stage_jobs(config) if j[0] == "rl"]
    resources, _ = stage_resources("rl", config["launcher"])
    gpu = estimate("rl", params, config, hub_sizes(config), resources, 80).gpu
    resident = lambda phase: sum(gb for item, gb in gpu[phase].items()
                                 if not item.startswith(("activations", "logits", "forward pass")))
    actor = max(sum(gpu["policy GPU: training"].values()), sum(gpu["policy GPU: log-probs"].values()))
    for trainer, frozen in ((actor, "reference GPU: log-probs"),
                            (sum(gpu["critic GPU: training"].values()), "reward model GPU: scores")):
        trainer_resident = resident("policy GPU: log-probs")
        shared = max(trainer + resident(frozen), sum(gpu[frozen].values()) + trainer_resident)
        assert shared <= 80, (frozen, shared)


def test_qwen25_7b_grpo_zero2_on_48gb_is_refused():
    """OpenRLHF issue 901: Qwen2.5-7B-Instruct GRPO on 4 x A6000 Ada (48 GB): actor on 2 GPUs, reference on 2, no
    reward model, ZeRO-2, bf16, micro batch 2, train batch 64, micro rollout batch 2, rollout 256 prompts x 8 samples,
    prompt up to 1024 tokens, generate_max_len 1 as the issue quotes it (the refusal does not depend on it), no
    offload or checkpointing in what it quotes. alignpipe gives its vLLM engine a GPU of its own: 5 GPUs. ZeRO-2 keeps
    the whole bf16 model (15 GB) and half of the gradients and of the optimizer's 12 B per parameter on each actor
    GPU: 69 GB of training states alone."""
    config = rl_only(QWEN_7B, {
        "variants": {"grpo": {"estimator": "group_norm"}}, "reward": REWARD_FILE, "rollout_batch_size": 256,
        "n_samples": 8, "max_new_tokens": 1, "batch_size": 64, "micro_batch_size": 2, "forward_micro_batch_size": 2,
        "zero_stage": 2, "num_workers": 2, "frozen_ranks": 2, "colocate": False, "kl_in_reward": False,
        "kl_estimator": "k3", "vllm": {"num_engines": 1, "tensor_parallel_size": 1}},
        {"nodes": 1, "gpus_per_node": 5, "cpus_per_node": 40, "mem_gb": 512}, gpu_memory_gb=48)
    job = rl_job(config)
    assert job.gpu_phase == "policy GPU: training" and job.gpu_peak > 48
    assert sum(gb for item, gb in job.gpu_items.items() if item in ("weights", "gradients", "optimizer states")) > 48
    with pytest.raises(ConfigError) as err:
        check_memory(config, "issue-901.yaml", sizes=hub_sizes(config))
    message = str(err.value)
    for fragment in ("issue-901.yaml: jobs that do not fit", "rl/grpo/seed1234: its fullest GPU (policy GPU) needs",
                     "in phase 'training', more than launcher.gpu_memory_gb = 48", "optimizer states 45.7",
                     "rl.variants.grpo.zero_stage (or rl.zero_stage): 3",
                     "rl.variants.grpo.offload_optimizer (or rl.offload_optimizer): true"):
        assert fragment in message, (fragment, message)


def issue_887(**changes) -> dict:
    """OpenRLHF issue 887's run as an alignpipe config (test_7b_grpo_with_32k_responses_at_micro_batch_1_is_refused)."""
    return rl_only(QWEN_7B, {
        "variants": {"grpo": {"estimator": "group_norm"}}, "reward": REWARD_FILE, "rollout_batch_size": 72,
        "n_samples": 8, "max_new_tokens": 36864, "batch_size": 576, "micro_batch_size": 1,
        "forward_micro_batch_size": 1, "zero_stage": 3, "num_workers": 3, "frozen_ranks": 18, "colocate": False,
        "vllm": {"num_engines": 3, "tensor_parallel_size": 1}, **changes},
        {"nodes": 3, "gpus_per_node": 8, "cpus_per_node": 64, "mem_gb": 1024})


def test_7b_grpo_with_32k_responses_at_micro_batch_1_is_refused():
    """OpenRLHF issue 887: a 7B model (Qwen2.5-7B-Instruct here) GRPO on 3 nodes of 8 x H100 80 GB: actor on 3 GPUs,
    reference on 18, 3 vLLM engines of TP 1, ZeRO-3, bf16, micro train and rollout batch 1, train batch 576, rollout
    72 prompts x 8 samples, prompt up to 1024 and generation up to 36,864 tokens; the command as the issue quotes it
    sets neither --gradient_checkpointing nor --adam_offload (OpenRLHF's defaults: off). One row of 37,888 tokens then
    keeps 217 GB of activations. (With both on, alignpipe's plan fits it in about 51 GB: layer inputs only, and
    log-probs whose float32 copies are made in chunks.)"""
    config = issue_887()
    job = rl_job(config)
    assert job.gpu_phase == "policy GPU: training" and job.gpu_items["activations"] > 200
    with pytest.raises(ConfigError) as err:
        check_memory(config, "issue-887.yaml", sizes=hub_sizes(config))
    message = str(err.value)
    for fragment in ("rl/grpo/seed1234: its fullest GPU (policy GPU) needs", "in phase 'training'",
                     "rl.variants.grpo.gradient_checkpointing (or rl.gradient_checkpointing): true",
                     "shorter sequences (rl.variants.grpo.max_new_tokens (or rl.max_new_tokens), "
                     "data.max_prompt_tokens)"):
        assert fragment in message, (fragment, message)
    assert rl_job(issue_887(gradient_checkpointing=True, offload_optimizer=True)).fits


def test_a_stage_of_its_own_gpu_size():
    """launcher.stages.<stage>.gpu_memory_gb: the 70B example's rl fits 80 GB GPUs, not 48 GB ones, and the refusal
    names the key."""
    example = example_file("llama3-70b-ppo")
    config = load_example(example)
    assert all(job.fits for job in memory_plan(config, sizes=hub_sizes(config)) if job.stage == "rl")
    config = load_example(example, {"launcher": {"stages": {"rl": {"gpu_memory_gb": 48}}}})
    refused = [job for job in memory_plan(config, sizes=hub_sizes(config)) if job.stage == "rl"]
    assert refused and not any(job.fits for job in refused)
    assert {job.gpu_source for job in refused} == {"launcher.stages.rl.gpu_memory_gb"}


def test_an_over_size_70b_example_is_refused_before_queueing(tmp_path):
    """`snakemake --profile slurm all --dry-run` with config/examples/llama3-70b-ppo.yaml and rl.offload_optimizer
    false: both rl runs are refused at parse time, each naming its job, its fullest GPU, the phase, the numbers
    (policy and critic optimizer states 26.5 GB each) and the keys to change; nothing is written."""
    oversize = tmp_path / "oversize.yaml"
    oversize.write_text(yaml.safe_dump({"rl": {"offload_optimizer": False}}))
    results = tmp_path / "results"
    proc = dry_run([example_file("llama3-70b-ppo"), oversize], results, tmp_path / "hf")
    assert proc.returncode != 0 and not results.exists()
    assert {"rl/ppo/seed42", "rl/grpo/seed42"} <= refused_jobs(proc.stdout)
    line = re.search(r"^  rl/ppo/seed42: its fullest GPU \(every role's GPU\) needs ([\d.]+) GB in phase '([\w ]+)', "
                     r"more than launcher.gpu_memory_gb = 80: (.*)$", proc.stdout, re.M)
    assert line, proc.stdout[-4000:]
    assert float(line[1]) > 80
    assert "policy optimizer states 26.5 + " in line[3] and "critic optimizer states 26.5" in line[3], line[3]
    assert "rl.variants.ppo.offload_optimizer (or rl.offload_optimizer): true" in proc.stdout


def test_a_dry_run_prints_the_plan_where_there_are_gpu_jobs(tmp_path):
    """The 8B GRPO example with its evaluation on 141 GB GPUs (H200): every GPU job fits, and the dry run prints the
    plan once (stderr), one row per GPU job, naming both GPU sizes; the CPU demo's dry run prints none."""
    h200 = tmp_path / "h200.yaml"
    h200.write_text(yaml.safe_dump({"launcher": {"stages": {"evaluate": {"gpu_memory_gb": 141}}}}))
    proc = dry_run([example_file("llama3-8b-grpo"), h200], tmp_path / "results", tmp_path / "hf")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stderr.count("Memory plan (GB per GPU from launcher.gpu_memory_gb, "
                             "launcher.stages.evaluate.gpu_memory_gb") == 1, proc.stderr
    rows = re.findall(r"^  (\S+) +(.+?: .+?) +([\d.]+) of (\d+) +([\d.]+) of ([\d.]+) \((.+)\) +yes$", proc.stderr,
                      re.M)
    assert [row[0] for row in rows] == ["sft", "reward_model", "dpo/seed42", "rl/grpo/seed42", "evaluate/base/seed42",
                                        "evaluate/sft/seed42", "evaluate/dpo/seed42", "evaluate/grpo/seed42"], rows
    assert {row[3] for row in rows} == {"80", "141"} and {row[3] for row in rows if "evaluate" in row[0]} == {"141"}
    demo = dry_run([], tmp_path / "demo", tmp_path / "hf", profile=REPO_ROOT / "cluster_profiles" / "local")
    assert demo.returncode == 0, demo.stdout[-4000:]
    assert "emory plan" not in demo.stdout + demo.stderr


def test_a_model_config_that_cannot_be_had_skips_the_plan(tmp_path):
    """Offline with an empty Hugging Face cache the hub model's config.json cannot be had: one line says the plan was
    skipped and why, and the dry run goes on."""
    proc = dry_run([example_file("llama3-8b-grpo")], tmp_path / "results", tmp_path / "empty", seed_cache=False)
    assert proc.returncode == 0, proc.stdout[-4000:]
    skipped = [line for line in proc.stderr.splitlines() if "memory plan skipped" in line]
    assert len(skipped) == 1 and "model.path = 'meta-llama/Meta-Llama-3-8B-Instruct'" in skipped[0], proc.stderr


def test_packing_counts_the_packed_rows_logits_and_sleeping_engines_nothing_on_the_host():
    """Packing's forwards hold the packed row's logits and their copy laid out per row at once (logprobs.packed_logits):
    the plan counts both. Engines asleep at level 2 keep nothing in CPU memory (their weights are resent)."""
    config = load_example(example_file("llama3-8b-grpo"))
    (_, _, params), = [j for j in stage_jobs(config) if j[0] == "rl"]
    resources, _ = stage_resources("rl", config["launcher"])
    plain = estimate("rl", params, config, hub_sizes(config), resources, 80)
    params = params | {"rl": params["rl"] | {"packing": True, "attn_implementation": "flash_attention_2"}}
    packed = estimate("rl", params, config, hub_sizes(config), resources, 80)
    training = "every role's GPU: training"
    # the same positions, once in bf16 (the training logits count them twice: values and gradient)
    assert packed.gpu[training]["packed row's logits"] == pytest.approx(
        (plain.gpu[training]["logits"] - LOGITS_CHUNKS_GB) / 2, rel=1e-9)
    assert "packed row's logits" in packed.gpu["every role's GPU: experience"]
    assert "packed row's logits" not in plain.gpu[training]
    assert params["rl"]["vllm"]["sleep"] and not any("vLLM" in item for phase in plain.host.values() for item in phase)


def test_benchmark_jobs_are_in_the_plan_and_a_scorer_on_too_few_gpus_is_refused():
    """The 70B example with an AIME-length sampled benchmark and a multiple-choice one on evaluate's layout (5 x 80
    GB): every benchmark job is planned and fits; on one GPU the choice job's scorer (the 70B model, 141 GB in bf16)
    is refused, naming the keys that would make it fit."""
    benchmarks = {"aime": {"path": "builtin:arithmetic", "scorer": "math", "n_samples": 8, "temperature": 0.6,
                           "max_new_tokens": 4096},
                  "mc": {"path": "builtin:arithmetic", "scorer": "choice", "choices_key": "options"}}
    layout = {"nodes": 1, "gpus_per_node": 5, "cpus_per_node": 40, "mem_gb": 256}
    config = load_example(example_file("llama3-70b-ppo"), {"benchmarks": benchmarks,
                                                           "launcher": {"stages": {"benchmark": layout}}})
    jobs = [job for job in memory_plan(config, sizes=hub_sizes(config)) if job.stage == "benchmark"]
    assert {job.run_name.split("/")[1] for job in jobs} == {"aime", "mc"} and len(jobs) == 2 * 5  # evaluate.models
    assert all(job.fits for job in jobs), [(job.run_name, job.gpu_phase, job.gpu_peak) for job in jobs]
    assert {job.gpu_phase for job in jobs if "/mc/" in job.run_name} == {"scorer GPU: log-likelihoods"}
    config = load_example(example_file("llama3-70b-ppo"), {"benchmarks": benchmarks, "launcher": {"stages": {
        "benchmark": layout | {"gpus_per_node": 1, "cpus_per_node": 8}}}})
    with pytest.raises(ConfigError) as err:
        check_memory(config, "70b-benchmarks.yaml", sizes=hub_sizes(config))
    message = str(err.value)
    assert "benchmark/mc/base/seed42: its fullest GPU (scorer GPU) needs" in message, message
    assert "launcher.stages.benchmark.gpus_per_node" in message and "benchmark/aime/" not in message, message


def test_a_teacher_and_a_judge_are_counted_on_the_gpus_they_take(tmp_path):
    """A teacher (rl.teacher) is a frozen model beside the reference: frozen_ranks GPUs of the job and a phase of its
    own in the plan, its bf16 weights and a log-probs pass. A judge's vLLM engines (rl.reward: judge) take GPUs of
    their own besides the others' and a phase in the plan; a job without room for them is refused naming the judge.
    Without a KL penalty (kl_coef 0) no reference is started: neither its GPUs nor its phase are counted."""
    models = {}
    for name in ("teacher", "judge"):
        models[name] = tmp_path / name
        models[name].mkdir()
        (models[name] / "config.json").write_text(json.dumps(HUB_CONFIGS[QWEN_7B]))
        (models[name] / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")  # no tensors
    variants = {"distil": {"estimator": "reinforce", "reward": None, "teacher": str(models["teacher"])},
                "judged": {"estimator": "group_norm", "reward": "judge"},
                "no_kl": {"estimator": "reinforce", "reward": None, "teacher": str(models["teacher"]), "kl_coef": 0}}
    layout = {"nodes": 1, "gpus_per_node": 8, "cpus_per_node": 64, "mem_gb": 512}

    def config(gpus_per_node: int) -> dict:
        return validate_config({
            "model": {"path": QWEN_7B}, "data": {"max_prompt_tokens": 1024, "prompts": {"path": "builtin:imdb"}},
            "rl": {"variants": variants, "num_workers": 2, "frozen_ranks": 2, "zero_stage": 3, "colocate": False,
                   "micro_batch_size": 1, "forward_micro_batch_size": 2, "gradient_checkpointing": True,
                   "vllm": {"num_engines": 2}},
            "judge": {"model": str(models["judge"]), "vllm": {"num_engines": 2}},
            "evaluate": {"rewards": [REWARD_FILE]},
            "launcher": {"cluster": "slurm", "gpu_memory_gb": 80,
                         "stages": {"rl": layout | {"gpus_per_node": gpus_per_node}}}})

    fits = config(8)
    assert check_stages(stage_jobs(fits), fits["launcher"]) == []
    params = {run: p["rl"] for stage, run, p in stage_jobs(fits) if stage == "rl"}
    assert gpus_needed("rl", params["rl/distil/seed1234"]) == {"policy": 2, "reference": 2, "teacher": 2, "vLLM": 2}
    assert gpus_needed("rl", params["rl/judged/seed1234"]) == {"policy": 2, "reference": 2, "vLLM": 2, JUDGE_ROLE: 2}
    assert gpus_needed("rl", params["rl/no_kl/seed1234"]) == {"policy": 2, "teacher": 2, "vLLM": 2}
    jobs = {job.run_name: job for job in memory_plan(fits, sizes=hub_sizes(fits)) if job.stage == "rl"}
    assert all(job.fits for job in jobs.values()), [(j.run_name, j.gpu_phase, j.gpu_peak) for j in jobs.values()]
    resources, _ = stage_resources("rl", fits["launcher"])
    distil, judged, no_kl = (p for run in ("distil", "judged", "no_kl")
                             for stage, name, p in stage_jobs(fits) if name == f"rl/{run}/seed1234")
    teacher_gpu = estimate("rl", distil, fits, hub_sizes(fits), resources, 80).gpu["teacher GPU: log-probs"]
    assert teacher_gpu["teacher (bf16, sharded)"] == pytest.approx(
        2 * PUBLISHED_PARAMS[QWEN_7B] / 2 / 1e9, rel=2e-3)  # bf16 over 2 ZeRO-3 ranks
    assert "judge vLLM GPU: verdicts" in estimate("rl", judged, fits, hub_sizes(fits), resources, 80).gpu
    assert "reference GPU: log-probs" in estimate("rl", distil, fits, hub_sizes(fits), resources, 80).gpu
    assert "reference GPU: log-probs" not in estimate("rl", no_kl, fits, hub_sizes(fits), resources, 80).gpu
    # colocated, no frozen model at all: every role's GPU holds the policy's states and vLLM, no frozen weights
    alone = no_kl | {"rl": no_kl["rl"] | {"teacher": None, "colocate": True}}
    shared = estimate("rl", alone, fits, hub_sizes(fits), resources, 80).gpu["every role's GPU: training"]
    assert not any(item.startswith(("reference", "teacher")) for item in shared), shared
    too_few = config(7)  # the judged variant's 2 + 2 + 2 and the judge's 2 need 8; the distilled one's 8 too
    problems = check_stages(stage_jobs(too_few), too_few["launcher"])
    assert any("stage rl/judged:" in problem and "stage rl needs 8 GPUs (policy 2, reference 2, vLLM 2, judge vLLM 2; "
               "summed, the judge besides)" in problem for problem in problems), problems
    assert any("stage rl/distil:" in problem and "(policy 2, reference 2, vLLM 2, teacher 2; summed)" in problem
               for problem in problems), problems
