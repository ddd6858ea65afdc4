"""The memory plan, checked before anything is queued: for every GPU job of the DAG, what its fullest GPU and its
fullest node hold, phase by phase (what is resident at the same time), and the refusal of a job that does not fit.

The model's sizes come from its own config.json: model.path's directory, or a hub id's config.json from the
Hugging Face cache (downloaded there where launcher.hub_downloads allows); sft.from and reward_model.from likewise. A
GPU's memory is launcher.gpu_memory_gb (launcher.stages.<stage>.gpu_memory_gb for one stage), a node's the job's
mem_gb. What each phase counts follows the code that runs it (stages/, runtime/): weights, gradients and optimizer
states by ZeRO stage and offload, activations with and without gradient checkpointing, logits, vLLM's share and its KV
cache, colocated roles together. `snakemake --dry-run` prints the plan (workflow/rules/common.smk).

Imported by the Snakefile (launcher/checks.py), so it must stay light: no torch, no ray; huggingface_hub only for a
hub id.
"""
import dataclasses
import json
import math
import sys
from pathlib import Path

from launcher.config import ConfigError, results_root, stage_jobs
from launcher.resources import stage_resources
from runtime.judge import JUDGE_CONTEXT
from runtime.user_data import is_hub, repo_path

# Decimal GB throughout; that understates both an "80 GB" GPU's 80 GiB and Slurm's --mem (GiB), so it errs safe.
GB = 1e9
CUDA_CONTEXT_GB = 1.0      # per process on a GPU: CUDA context, NCCL buffers, allocator slack
HOST_PER_PROCESS_GB = 3.0  # host memory of each GPU process (Python, torch, CUDA libraries; vLLM workers alike)
HOST_USABLE = 0.85         # share of a node's mem_gb the plan may fill: the rest is Ray's object store, the OS,
                           # and the page cache of the safetensors being read
# DeepSpeed's buckets at its defaults (runtime/deepspeed_strategy.ds_config sets none), in parameters: ZeRO-3 keeps
# up to stage3_max_live_parameters gathered at once; ZeRO-1/2 reduce and all-gather through buckets of this size.
ZERO3_LIVE_PARAMETERS = 1e9
ZERO_BUCKET = 5e8
# Bytes per (position, vocabulary entry) of a language-model head's logits, in bf16. runtime/logprobs.py makes their
# float32 copies a chunk at a time (token_logprobs, entropy_from_logits; stages/evaluate.token_kl too), so beyond the
# logits a pass needs at most LOGITS_CHUNKS_GB of temporaries (4 x runtime/logprobs.LOGITS_CHUNK_BYTES).
LOGITS_FORWARD = 2        # the logits
LOGITS_TRAIN = 4          # the logits, which token_logprobs keeps for the backward pass, and their gradient
LOGITS_ENTROPY_BONUS = 8  # rl.entropy_coef > 0: the graph also keeps every chunk's float32 logits and probabilities
LOGITS_EXACT_KL = 4       # stages/evaluate.token_kl: the evaluated model's and the reference's logits
LOGITS_CHUNKS_GB = 4 * 64 * 2**20 / GB
# stages/evaluate.py scores SCORE_BATCH rows at a time.
SCORE_BATCH = 8
TRAINERS = ("sft", "reward_model", "dpo")


class ModelConfigUnavailable(Exception):
    """A model's config.json could not be had (no network, a gated repository, a built-in model not built yet)."""


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What the plan needs of a decoder, computed from its config.json."""
    params: float            # parameters
    layers: int
    hidden: int
    vocab: int
    activation_bytes: float  # what one block keeps per token for its backward pass, bf16
    kv_bytes: float          # K and V of one token over every layer, bf16: vLLM's KV cache per token
    linear_features: float   # in + out features summed over a block's linear layers (LoRA: rank x this per block)

    @classmethod
    def from_config(cls, hf: dict, where: str) -> "ModelSize":
        """From Llama-style keys (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
        intermediate_size, vocab_size, tie_word_embeddings; Llama, Qwen2, Mistral) or GPT-2's (n_embd, n_layer,
        n_head, n_inner). Norms and biases are left out (under 0.1% of a model)."""
        if any(key in hf for key in ("num_local_experts", "num_experts", "n_routed_experts")):
            raise ModelConfigUnavailable(f"{where}: a mixture-of-experts config; the plan counts dense decoders only")
        gpt2 = "n_embd" in hf
        names = {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head"} if gpt2 else \
            {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads"}
        missing = [key for key in (*names.values(), "vocab_size") if not isinstance(hf.get(key), int)]
        if missing:
            raise ModelConfigUnavailable(f"{where}: its config.json has no {', '.join(missing)}")
        hidden, layers, heads, vocab = (hf[names["hidden"]], hf[names["layers"]], hf[names["heads"]],
                                        hf["vocab_size"])
        head_dim = hf.get("head_dim") or hidden // heads
        q, kv = heads * head_dim, (hf.get("num_key_value_heads") or heads) * head_dim
        inner = hf.get("n_inner" if gpt2 else "intermediate_size") or 4 * hidden
        # GPT-2's MLP: fc and proj; the gated MLP of Llama, Qwen2 and Mistral: gate, up and down.
        mlp_matrices = 2 if gpt2 else 3
        layer_params = 2 * hidden * q + 2 * hidden * kv + mlp_matrices * hidden * inner  # q, o; k, v; MLP
        embeddings = vocab * hidden * (1 if hf.get("tie_word_embeddings", True) else 2)  # transformers' default: tied
        if gpt2:
            embeddings += hf.get("n_positions", 1024) * hidden
        # Kept per token for the backward pass, in values (Korthikanti et al. 2022 count 34 x hidden bytes for GPT-3's
        # block; here the same count from the config, without the attention scores that sdpa never stores): the two
        # norms' inputs (2h); the attention's input, q, k and v before and after the rotary embedding, and its
        # output (h + 3q + 3kv); the MLP's input and its gate, up, activation and product (h + 4I; GPT-2: h + 2I).
        values = 4 * hidden + 3 * q + 3 * kv + (2 if gpt2 else 4) * inner
        linear_features = (2 * hidden + 2 * q) + 2 * (hidden + kv) + mlp_matrices * (hidden + inner)
        return cls(params=layers * layer_params + embeddings, layers=layers, hidden=hidden, vocab=vocab,
                   activation_bytes=2 * values, kv_bytes=2 * 2 * layers * kv,
                   linear_features=linear_features)


# ---- Where the model configs come from ------------------------------------------------------------------------

def read_model_config(path: str, where: str, download: bool = False) -> dict:
    """The config.json of a model directory (relative to the repository root or absolute) or of a hub id: from the
    Hugging Face cache, downloaded there if it is not where `download` (launcher.hub_downloads) allows; otherwise
    nothing is asked of the hub (HF_HUB_OFFLINE=1 reads the cache only either way)."""
    if not is_hub(path):
        file = repo_path(path) / "config.json"
        if not file.is_file():
            raise ModelConfigUnavailable(f"{where} = {path!r}: no {file}")
        return json.loads(file.read_text())
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    try:
        cached = try_to_load_from_cache(path, "config.json")  # no request where the cache has it
        if not isinstance(cached, str) and not download:
            raise ModelConfigUnavailable(f"{where} = {path!r}: its config.json is not in the Hugging Face cache "
                                         f"({constants.HF_HUB_CACHE}), and launcher.hub_downloads is false")
        return json.loads(Path(cached if isinstance(cached, str) else hf_hub_download(path, "config.json")).read_text())
    except (OSError, ValueError) as err:  # offline and not cached, gated, no such repository, not JSON
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelConfigUnavailable(f"{where} = {path!r}: its config.json could not be had from the hub or the "
                                     f"Hugging Face cache ({type(err).__name__}: {reason})") from None


def base_model_config(config: dict) -> dict:
    """The base model's config.json: model.path's, the tiny model's as runtime/models.build_tiny writes it, or (the
    built-in SmolLM2, shipped as GGUF) the base_model stage's output once it exists."""
    model = config["model"]
    if model["path"]:
        return read_model_config(model["path"], "model.path", download=config["launcher"]["hub_downloads"])
    if model["source"] == "tiny":
        tiny = model["tiny"]
        if tiny["architecture"] == "gpt2":
            return {"n_embd": tiny["hidden_size"], "n_layer": tiny["num_layers"], "n_head": tiny["num_heads"],
                    "vocab_size": tiny["vocab_size"], "n_positions": 512}
        return {"hidden_size": tiny["hidden_size"], "num_hidden_layers": tiny["num_layers"],
                "num_attention_heads": tiny["num_heads"], "intermediate_size": 4 * tiny["hidden_size"],
                "vocab_size": tiny["vocab_size"], "tie_word_embeddings": True}
    built = results_root(config) / config["experiment"] / "base_model" / "config.json"
    if not built.is_file():
        raise ModelConfigUnavailable(f"model.source = {model['source']}: its config.json exists once the base_model "
                                     f"stage has built {built.parent}")
    return json.loads(built.read_text())


def named_model_size(path: str, key: str) -> ModelSize:
    """The size of the model a config key (`key`) names by its directory or hub id."""
    return ModelSize.from_config(read_model_config(path, key), key)


def model_sizes(config: dict) -> dict[str, ModelSize]:
    """The sizes of the base model, the policy (sft.from, or the base model that SFT trains) and the reward model
    (reward_model.from, or the policy with a score head)."""
    base = ModelSize.from_config(base_model_config(config), "model")
    policy = base
    if config["sft"]["from"]:
        policy = named_model_size(config["sft"]["from"], "sft.from")
    reward = policy
    if config["reward_model"]["from"]:
        reward = named_model_size(config["reward_model"]["from"], "reward_model.from")
    return {"base": base, "policy": policy, "reward": reward}


# ---- What one rank holds -------------------------------------------------------------------------------------

def value_bytes(block: dict) -> int:
    """Bytes of a weight or activation: bf16 on GPUs (precision auto or bf16), 4 with precision fp32."""
    return 4 if block.get("precision") == "fp32" else 2


def trained_params(m: ModelSize, block: dict) -> float:
    """Parameters the optimizer steps: all, or with LoRA (lora_rank > 0) at most rank x (in + out) of every linear
    layer's adapter."""
    return block["lora_rank"] * m.linear_features * m.layers if block["lora_rank"] else m.params


def training_states(m: ModelSize, block: dict, ranks: int, role: str = "") -> dict[str, float]:
    """GB of one DeepSpeed rank's training states, bf16 mixed precision: weights 2 B, gradients 2 B, and the fp32
    master weights with Adam's two moments 12 B per trained parameter, divided over the ranks as far as the ZeRO stage
    shards them (1: optimizer states, 2: and gradients, 3: and weights). offload_optimizer takes the 12 B to CPU
    memory. With LoRA only the adapters train (trained_params). precision fp32: 4 B weights and gradients, Adam's
    moments 8 B."""
    zero, width, trained = block["zero_stage"], value_bytes(block), trained_params(m, block)
    optimizer = 0 if block["offload_optimizer"] else (12 if width == 2 else 8) * trained
    prefix = f"{role} " if role else ""
    return {f"{prefix}weights": width * m.params / (ranks if zero == 3 else 1) / GB,
            f"{prefix}gradients": width * trained / (ranks if zero >= 2 else 1) / GB,
            f"{prefix}optimizer states": optimizer / (ranks if zero >= 1 else 1) / GB}


def offloaded_optimizer_gb(m: ModelSize, block: dict, ranks: int) -> float:
    """CPU memory of one rank's offloaded optimizer states (offload_optimizer): its shard of the 12 B per parameter."""
    return 12 * trained_params(m, block) / ranks / GB if block["offload_optimizer"] else 0.0


def deepspeed_buffers_gb(m: ModelSize, zero_stage: int) -> float:
    """DeepSpeed's working buffers at its defaults: ZeRO-3's gathered parameters (up to ZERO3_LIVE_PARAMETERS in
    bf16), ZeRO-1/2's reduce and all-gather buckets (ZERO_BUCKET each, bf16)."""
    if zero_stage == 3:
        return 2 * min(ZERO3_LIVE_PARAMETERS, m.params) / GB
    return 2 * 2 * min(ZERO_BUCKET, m.params) / GB if zero_stage else 0.0


def logit_positions(rows: int, seq: int, response: int) -> int:
    """Positions the output layer runs over (runtime/logprobs.response_logits): from the first response position of
    the right-padded batch on, so the shortest prompt of a batch of several rows sets it: up to the whole sequence."""
    return response if rows == 1 else seq


def activations_gb(m: ModelSize, rows: int, seq: int, checkpointing: bool, width: int = 2) -> float:
    """Activations one training micro batch keeps for its backward pass: every block's (ModelSize.activation_bytes
    per token); with gradient checkpointing only each block's input (hidden values per token) plus one block
    recomputed at a time."""
    per_token = m.layers * m.hidden * 2 + m.activation_bytes if checkpointing else m.layers * m.activation_bytes
    return rows * seq * per_token * width / 2 / GB


def forward_gb(m: ModelSize, rows: int, seq: int, width: int = 2) -> float:
    """A forward pass without gradients (log-probs, values, scores): one block's activations at a time."""
    return rows * seq * m.activation_bytes * width / 2 / GB


def logits_gb(m: ModelSize, rows: int, positions: int, bytes_per_entry: int, chunked: bool = True) -> float:
    """The logits of `rows` x `positions` and, where runtime/logprobs.py makes their float32 copies in chunks, those
    chunks' temporaries."""
    return rows * positions * m.vocab * bytes_per_entry / GB + (LOGITS_CHUNKS_GB if chunked else 0.0)


def packed_logits_gb(m: ModelSize, block: dict, rows: int, positions: int) -> dict:
    """packing: runtime/logprobs.packed_logits computes the logits of the packed row (at most rows x positions) and
    then lays them out per row, a second copy, both alive at that moment. Packing on GPUs runs flash-attention's
    variable-length kernel (launcher/resources.check_attention refuses the dense block-diagonal mask of sdpa): no
    mask to count."""
    return {"packed row's logits": rows * positions * m.vocab * LOGITS_FORWARD / GB} if block.get("packing") else {}


def vllm_share(vllm: dict, shares_gpu: bool) -> float:
    """The share of each engine GPU that vLLM takes, as runtime/rollout.engine_options resolves it."""
    return vllm["gpu_memory_utilization"] or (0.5 if shares_gpu else 0.9)


def vllm_items(m: ModelSize, vllm: dict, share_gb: float, max_model_len: int, where: str, notes: list) -> dict:
    """An engine GPU's share, as its weights (bf16, split over tensor_parallel_size GPUs) and the rest: the KV cache
    and vLLM's activations. vLLM refuses to start when its KV cache cannot hold one max_model_len sequence: a note.
    (vLLM's own activation peak fits in what decimal GB leave out of a GPU's GiB.)"""
    tp = vllm["tensor_parallel_size"]
    weights = 2 * m.params / tp / GB
    sequence = m.kv_bytes * max_model_len / tp / GB
    if share_gb - weights < sequence:
        notes.append(f"{where}: {weights:.1f} GB of weights per GPU leave {share_gb - weights:.1f} GB of vLLM's "
                     f"{share_gb:.1f} GB share for the KV cache, less than one sequence of {max_model_len} tokens "
                     f"takes ({sequence:.2f} GB): vLLM would refuse to start; raise {where}.gpu_memory_utilization or "
                     f"{where}.tensor_parallel_size")
    return {"vLLM weights": weights, "vLLM KV cache and activations": share_gb - weights}


# ---- Each stage's job ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Estimate:
    gpu: dict   # "<which GPU>: <phase>" -> {item: GB} on the fullest such GPU
    host: dict  # phase -> {item: GB} on the fullest node
    notes: list = dataclasses.field(default_factory=list)  # other conditions that fail (vLLM's KV cache)


def estimate(stage: str, params: dict, config: dict, sizes: dict, resources: dict, gpu_gb: float) -> Estimate:
    """Memory of one GPU job: GB on its fullest GPU and on its fullest node, per phase of the job. Ray PACKs one GPU
    per bundle in order, so a node holds at most gpus_per_node ranks of a role, and colocated roles put one rank of
    each on a GPU."""
    g = resources["gpus_per_node"]
    if stage in TRAINERS:
        return _trainer_estimate(stage, params[stage], config, sizes, g)
    if stage == "rl":
        return _rl_estimate(params["rl"], config["data"], sizes, g, gpu_gb)
    if stage == "benchmark":
        return _benchmark_estimate(params, config, sizes, g, gpu_gb)
    assert stage == "evaluate", stage
    return _evaluate_estimate(params, config, sizes, g, gpu_gb)


def _trainer_estimate(stage: str, block: dict, config: dict, sizes: dict, g: int) -> Estimate:
    data, W = config["data"], block["num_workers"]
    m = sizes["reward"] if stage == "reward_model" and block.get("from") else sizes["policy"]
    width = value_bytes(block)
    seq, response = data["max_prompt_tokens"] + data["max_response_tokens"], data["max_response_tokens"]
    pairs = stage in ("reward_model", "dpo")  # a pair is two rows, chosen and rejected
    rows = block["micro_batch_size"] * (2 if pairs else 1)
    head = stage != "reward_model"  # the reward model's score head has one output: no logits worth counting
    held = training_states(m, block, W) | {"DeepSpeed buffers": deepspeed_buffers_gb(m, block["zero_stage"]),
                                           "CUDA context": CUDA_CONTEXT_GB}
    train = held | {"activations": activations_gb(m, rows, seq, block["gradient_checkpointing"], width)}
    if head:
        train["logits"] = logits_gb(m, rows, logit_positions(rows, seq, response), LOGITS_TRAIN)
        train |= packed_logits_gb(m, block, rows, logit_positions(rows, seq, response))
    if stage == "dpo" and block["loss"] == "kto":  # KTO's KL reference point: a forward of the mismatched pairs
        train["forward pass"] = forward_gb(m, block["micro_batch_size"], seq, width)
    # Forwards where nothing trains, in pieces of forward_micro_batch_size rows (pairs; null: micro_batch_size;
    # runtime/trainer.forward_pieces): the held-out rows (pairs) and, for DPO, the reference log-probs once before
    # training.
    forward_rows = (block["forward_micro_batch_size"] or block["micro_batch_size"]) * (2 if pairs else 1)
    phase = "reference and held-out forward" if stage == "dpo" else "held-out forward"
    forward = held | {"forward pass": forward_gb(m, forward_rows, seq, width)}
    if head:
        forward["logits"] = logits_gb(m, forward_rows, logit_positions(forward_rows, seq, response), LOGITS_FORWARD)
        forward |= packed_logits_gb(m, block, forward_rows, logit_positions(forward_rows, seq, response))
    ranks = min(W, g)
    processes = {"processes": HOST_PER_PROCESS_GB * ranks}
    load = dict(processes)
    if block["zero_stage"] != 3:  # without zero.Init every rank materialises the whole model before DeepSpeed
        load["models loaded on the CPU first"] = width * m.params * ranks / GB
    train_host = processes | ({"offloaded optimizer states": offloaded_optimizer_gb(m, block, W) * ranks}
                              if block["offload_optimizer"] else {})
    host = {"load": load, "train": train_host}
    if not block.get("from"):  # runtime/deepspeed_strategy.save_hf: rank 0 gathers a CPU copy of the whole model
        host["save"] = train_host | {"rank 0's copy of the model (bf16)": 2 * m.params / GB}
    return Estimate({"trainer GPU: train": train, f"trainer GPU: {phase}": forward}, host)


def spread_gb(m: ModelSize, gpus: int) -> float:
    """GB of one GPU's part of a bf16 model whose layers stages/evaluate.spread_over_gpus spreads over `gpus` GPUs:
    accelerate's balanced budget, 1/gpus of the model plus 1.25 times its largest piece that is never split (a decoder
    layer; here the larger of a layer and the embedding matrix), at most the whole model."""
    whole = 2 * m.params / GB
    largest = 2 * max(m.params / m.layers, m.vocab * m.hidden) / GB
    return min(whole, whole / gpus + 1.25 * largest)


def judge_size(judge: dict, sizes: dict) -> ModelSize:
    """The judge model's size: the base model's, or judge.model's directory's."""
    if judge["model"] == "base":
        return sizes["base"]
    return named_model_size(judge["model"], "judge.model")


def _evaluate_estimate(params: dict, config: dict, sizes: dict, g: int, gpu_gb: float) -> Estimate:
    ev, data = params["evaluate"], config["data"]
    vllm = ev["vllm"]
    evaluated = sizes["base"] if params["model"] == "base" else sizes["policy"]
    engine_gpus = vllm["num_engines"] * vllm["tensor_parallel_size"]
    notes = []
    max_model_len = data["max_prompt_tokens"] + ev["max_new_tokens"] + 8  # stages/evaluate.py's max_len
    engine = vllm_items(evaluated, vllm, vllm_share(vllm, shares_gpu=False) * gpu_gb, max_model_len,
                        "evaluate.vllm", notes)
    # stages/evaluate.Scorer, once the engines are gone, on every GPU of the node: each model in bf16 with its layers
    # spread over the g GPUs (spread_gb); the reward model alone, then the evaluated model with its reference (the base
    # model; for `base` the model itself); SCORE_BATCH rows per forward pass. The logits come back to the first GPU.
    with_reference = params["model"] != "base"
    models = {"evaluated model (bf16, spread)": spread_gb(evaluated, g)}
    if with_reference:
        models["base model (reference, bf16, spread)"] = spread_gb(sizes["base"], g)
    context = {"CUDA context": CUDA_CONTEXT_GB}
    samples_seq = data["max_prompt_tokens"] + ev["max_new_tokens"]
    held_out_seq = data["max_prompt_tokens"] + data["max_response_tokens"]
    positions = lambda seq, response: logit_positions(SCORE_BATCH, seq, response)
    samples_logits = positions(samples_seq, ev["max_new_tokens"])
    gpu = {
        "vLLM engine GPU: generation": engine,
        "scorer GPU: KL to the reference": models | context | {
            "forward pass": forward_gb(evaluated, SCORE_BATCH, samples_seq),
            "logits": logits_gb(evaluated, SCORE_BATCH, samples_logits,
                                LOGITS_EXACT_KL if with_reference else LOGITS_FORWARD)},
        "scorer GPU: held-out perplexity": models | context | {
            "forward pass": forward_gb(evaluated, SCORE_BATCH, held_out_seq),
            "logits": logits_gb(evaluated, SCORE_BATCH, positions(held_out_seq, data["max_response_tokens"]),
                                LOGITS_FORWARD)},
    }
    loaded = [evaluated] + ([sizes["base"]] if with_reference else [])
    if "model" in ev["rewards"]:  # the score head has one output: no logits
        gpu["scorer GPU: reward model scores"] = {"reward model (bf16, spread)": spread_gb(sizes["reward"], g)} | \
            context | {"forward pass": forward_gb(sizes["reward"], SCORE_BATCH, samples_seq)}
        loaded.append(sizes["reward"])
    if "judge" in ev["rewards"]:  # its engines between the evaluated model's and the scorer (stages/evaluate.judged)
        gpu["judge vLLM GPU: verdicts"] = vllm_items(judge_size(ev["judge"], sizes), ev["judge"]["vllm"],
                                                     vllm_share(ev["judge"]["vllm"], False) * gpu_gb, JUDGE_CONTEXT,
                                                     "judge.vllm", notes)
    # Each model loads into CPU memory before its layers go to the GPUs; one at a time.
    host = {"generation": {"processes": HOST_PER_PROCESS_GB * min(engine_gpus, g)},
            "scoring": {"processes": HOST_PER_PROCESS_GB,
                        "scorer loading a model (bf16)": max(2 * m.params for m in loaded) / GB}}
    return Estimate(gpu, host, notes)


def _rl_estimate(rl: dict, data: dict, sizes: dict, g: int, gpu_gb: float) -> Estimate:
    m, rm = sizes["policy"], sizes["reward"]
    W, F, width = rl["num_workers"], rl["frozen_ranks"], value_bytes(rl)
    vllm, tp = rl["vllm"], rl["vllm"]["tensor_parallel_size"]
    engine_gpus = vllm["num_engines"] * tp
    critic, reward_model, sleep = rl["estimator"] == "gae", rl["reward"] == "model", vllm["sleep"]
    seq, new = data["max_prompt_tokens"] + rl["max_new_tokens"], rl["max_new_tokens"]
    sharded = rl["zero_stage"] == 3 and F > 1  # runtime/rl_actors.FrozenScorer: ZeRO-3 inference across the ranks
    teacher = rl["teacher"] and named_model_size(rl["teacher"], "rl.teacher")
    # (no reference without a KL penalty: runtime/rl_actors.Roles does not start it)
    frozen_models = ({"reference": m} if rl["kl_coef"] else {}) | ({"reward model": rm} if reward_model else {}) | \
        ({"teacher": teacher} if teacher else {})
    frozen = {f"{name} (bf16{', sharded' if sharded else ''})": width * size.params / (F if sharded else 1) / GB
              for name, size in frozen_models.items()}
    buffers = deepspeed_buffers_gb(m, rl["zero_stage"])
    # Forward passes where nothing trains (old and reference log-probs, values, rewards), forward_micro_batch_size
    # rows at a time; null: a rank's whole share of a step's rows (or of the held-out prompts' samples) at once.
    prompts = max(rl["rollout_batch_size"], rl["eval_prompts"])
    forward_rows = rl["forward_micro_batch_size"] or math.ceil(prompts * rl["n_samples"] / min(W, F))
    mb = rl["micro_batch_size"]
    logprobs_pass = {"forward pass": forward_gb(m, forward_rows, seq, width),
                     "logits": logits_gb(m, forward_rows, logit_positions(forward_rows, seq, new), LOGITS_FORWARD)} \
        | packed_logits_gb(m, rl, forward_rows, logit_positions(forward_rows, seq, new))
    policy_step = {"activations": activations_gb(m, mb, seq, rl["gradient_checkpointing"], width),
                   "logits": logits_gb(m, mb, logit_positions(mb, seq, new),
                                       LOGITS_TRAIN + (LOGITS_ENTROPY_BONUS if rl["entropy_coef"] else 0))} \
        | packed_logits_gb(m, rl, mb, logit_positions(mb, seq, new))
    states = training_states(m, rl, W, "policy") | (training_states(m, rl, W, "critic") if critic else {})
    max_model_len = data["max_prompt_tokens"] + new + 8  # stages/rl.py's max_len
    notes = []
    if rl["colocate"]:
        share = vllm_share(vllm, shares_gpu=True) * gpu_gb
        engine = vllm_items(m, vllm, share, max_model_len, "rl.vllm", notes)
        roles = 2 + critic + len(frozen_models)  # policy, vLLM worker, critic, reference, reward model, teacher
        # the roles compute one at a time (stages/rl.py, runtime/experience.py): one role's DeepSpeed buffers
        held = states | frozen | {"DeepSpeed buffers": buffers, "CUDA contexts": CUDA_CONTEXT_GB * roles}
        awake = {} if sleep else engine  # vllm.sleep: vLLM frees its weights and KV cache while the others work
        gpu = {
            # runtime/rl_actors.Roles starts the trainers first: vLLM takes its share while their states are resident
            "every role's GPU: vLLM start": held | engine,
            "every role's GPU: experience": held | awake | logprobs_pass,
            "every role's GPU: training": held | awake | policy_step,
            # the weight sync gathers one module's full weights at a time (the largest: the embedding or LM head);
            # under vllm.sleep it wakes vLLM's weights (not its KV cache) while the trainers hold their states
            "every role's GPU: weight sync": held | ({"vLLM weights": engine["vLLM weights"]} if sleep else engine)
                                             # and its copy offered over CUDA IPC (weight_sync.send_weights)
                                             | {"gathered module and its IPC copy (bf16)":
                                                2 * 2 * m.vocab * m.hidden / GB},
        }
    else:  # every role on GPUs of its own
        engine = vllm_items(m, vllm, vllm_share(vllm, shares_gpu=False) * gpu_gb, max_model_len, "rl.vllm", notes)
        policy = training_states(m, rl, W) | {"DeepSpeed buffers": buffers, "CUDA context": CUDA_CONTEXT_GB}

        def frozen_gpu(name: str, size: ModelSize, lm_head: bool) -> dict:
            """A frozen rank's GPU: its shard (or copy) and its forward pass (the reward model's score head has one
            output: no logits)."""
            own = {name: frozen[name], "CUDA context": CUDA_CONTEXT_GB}
            if sharded:
                own["DeepSpeed buffers"] = deepspeed_buffers_gb(size, 3)
            return own | (logprobs_pass if lm_head else {"forward pass": forward_gb(size, forward_rows, seq, width)})

        names = dict(zip(frozen_models, frozen))  # reference, reward model, teacher -> the frozen entry's name
        gpu = {"policy GPU: training": policy | policy_step,
               "policy GPU: log-probs": policy | logprobs_pass}
        if "reference" in names:
            gpu["reference GPU: log-probs"] = frozen_gpu(names["reference"], m, lm_head=True)
        gpu["vLLM GPU: generation"] = engine
        if reward_model:
            gpu["reward model GPU: scores"] = frozen_gpu(names["reward model"], rm, lm_head=False)
        if teacher:
            gpu["teacher GPU: log-probs"] = frozen_gpu(names["teacher"], teacher, lm_head=True)
        if critic:  # the critic's value head has one output: no logits
            gpu["critic GPU: training"] = policy | {"activations": policy_step["activations"]}
    judge_gpus = 0
    if rl["reward"] == "judge":  # the judge's engines, on GPUs of their own (runtime/rl_actors.Roles)
        judge = rl["judge"]
        gpu["judge vLLM GPU: verdicts"] = vllm_items(judge_size(judge, sizes), judge["vllm"], vllm_share(judge["vllm"], False) * gpu_gb,
                                                     JUDGE_CONTEXT, "judge.vllm", notes)  # (its most)
        judge_gpus = judge["vllm"]["num_engines"] * judge["vllm"]["tensor_parallel_size"]
    largest = max(frozen_models.values(), key=lambda size: size.params, default=None)
    host = _rl_host(rl, m, largest, g, critic, len(frozen_models), engine_gpus + judge_gpus)
    return Estimate(gpu, host, notes)


def _rl_host(rl: dict, m: ModelSize, largest_frozen: ModelSize | None, g: int, critic: bool, frozen_roles: int,
             engine_gpus: int) -> dict:
    """The rl job's fullest node. Colocated, GPU i holds rank i of every role, so the first node holds min(count,
    GPUs per node) ranks of each; on GPUs of their own, a node holds any gpus_per_node of the processes, counted here
    with as many trainer ranks as fit (they hold the most). The roles load one after another
    (runtime/rl_actors.Roles): one role's loading at a time."""
    W, F, width = rl["num_workers"], rl["frozen_ranks"], value_bytes(rl)
    trainers = 1 + critic
    if rl["colocate"]:
        processes = trainers * min(W, g) + frozen_roles * min(F, g) + min(engine_gpus, g)
        trainer_ranks = trainers * min(W, g)
    else:
        processes = min(trainers * W + frozen_roles * F + engine_gpus, g)
        trainer_ranks = min(trainers * W, g)
    on_node = {"processes": HOST_PER_PROCESS_GB * processes}
    loads = {}  # what one role loads into CPU memory on the node before moving it to its GPUs
    if rl["zero_stage"] != 3:  # without zero.Init every rank materialises the whole model
        loads["a trainer's ranks loading the model on the CPU first"] = width * m.params * min(W, g) / GB
    if largest_frozen and (rl["zero_stage"] != 3 or F == 1):  # not sharded: each frozen rank loads a whole copy
        loads["a frozen model's ranks loading it on the CPU first"] = \
            width * largest_frozen.params * min(F, g) / GB
    load = on_node | (dict([max(loads.items(), key=lambda item: item[1])]) if loads else {})
    train = dict(on_node)
    if rl["offload_optimizer"]:
        train["offloaded optimizer states"] = offloaded_optimizer_gb(m, rl, W) * trainer_ranks
    host = {"load": load, "experience and training": train}
    if rl["vllm"]["sleep"]:
        # vLLM sleeps at level 2 (its weights discarded, resent by the sync; only its small CUDA-graph and runtime
        # pools wait in CPU memory, within HOST_PER_PROCESS_GB); while it generates, the trainers' gradients, fp32
        # master weights and optimizer states wait there (runtime/deepspeed_strategy.offload_states)
        offloaded = 14 * trained_params(m, rl) / W * trainer_ranks / GB  # gradients 2 B, master and Adam 12 B
        host["generation"] = on_node | {"offloaded training states": offloaded}
    host["save"] = train | {"rank 0's copy of the policy (bf16)": 2 * m.params / GB}
    return host


# ---- The plan of every GPU job ---------------------------------------------------------------------------------

@dataclasses.dataclass
class JobPlan:
    """One GPU job's plan: its peak phase on the fullest GPU and on the fullest node, with their items (GB)."""
    run_name: str
    stage: str
    gpu_phase: str
    gpu_items: dict
    gpu_gb: float        # the GPU's memory
    gpu_source: str      # where gpu_gb came from
    node_phase: str
    node_items: dict
    node_gb: float       # what the plan may fill of the node: HOST_USABLE x mem_gb
    mem_source: str
    notes: list

    @property
    def gpu_peak(self) -> float:
        return sum(self.gpu_items.values())

    @property
    def node_peak(self) -> float:
        return sum(self.node_items.values())

    @property
    def fits(self) -> bool:
        return self.gpu_peak <= self.gpu_gb and self.node_peak <= self.node_gb and not self.notes


def gpu_memory(stage: str, launcher: dict) -> tuple[float, str]:
    """(GB of one GPU, the key it came from) for a stage's job."""
    own = (launcher.get("stages") or {}).get(stage, {})
    if "gpu_memory_gb" in own:
        return float(own["gpu_memory_gb"]), f"launcher.stages.{stage}.gpu_memory_gb"
    return float(launcher["gpu_memory_gb"]), "launcher.gpu_memory_gb"


def gpu_jobs(config: dict, profile_for=None) -> list:
    """(stage, run name, params, resources, sources) of every job of the DAG whose resources have GPUs."""
    jobs = []
    for stage, run_name, params in stage_jobs(config):
        resources, sources = stage_resources(stage, config["launcher"], profile_for(stage) if profile_for else None)
        if resources["gpus_per_node"] > 0 and stage in (*TRAINERS, "rl", "evaluate", "benchmark"):
            jobs.append((stage, run_name, params, resources, sources))
    return jobs


def memory_plan(config: dict, profile_for=None, sizes: dict | None = None) -> list[JobPlan]:
    """The plan of every GPU job (`profile_for(stage)`: the Snakemake resources a profile gives the rule, as
    launcher/checks.profile_resources knows them); `sizes` as model_sizes gives them (read from the configs if None).
    ModelConfigUnavailable if a model's config.json cannot be had."""
    jobs = gpu_jobs(config, profile_for)
    if jobs and sizes is None:
        sizes = model_sizes(config)
    plan = []
    for stage, run_name, params, resources, sources in jobs:
        gpu_gb, gpu_source = gpu_memory(stage, config["launcher"])
        est = estimate(stage, params, config, sizes, resources, gpu_gb)
        gpu_phase = max(est.gpu, key=lambda phase: sum(est.gpu[phase].values()))
        node_phase = max(est.host, key=lambda phase: sum(est.host[phase].values()))
        plan.append(JobPlan(run_name, stage, gpu_phase, est.gpu[gpu_phase], gpu_gb, gpu_source, node_phase,
                            est.host[node_phase], HOST_USABLE * resources["mem_gb"], sources["mem_gb"], est.notes))
    return plan


def _benchmark_estimate(params: dict, config: dict, sizes: dict, g: int, gpu_gb: float) -> Estimate:
    """stages/benchmark.py: the engines of evaluate.vllm sample the replies, then (choice, lm-eval's log-likelihoods)
    the evaluated model alone scores options, spread over the node's GPUs like evaluation's scorer. A prompt is taken
    as data.max_prompt_tokens per question, its few-shot examples' included (the stage refuses, before generating, a
    prompt that does not fit the model's positions)."""
    bench, vllm = params["benchmark"], params["vllm"]
    evaluated = sizes["base"] if params["model"] == "base" else sizes["policy"]
    prompt = config["data"]["max_prompt_tokens"] * (bench["few_shot"] + 1)
    notes, gpu = [], {}
    choice = bench["scorer"] == "choice" and not bench["lm_eval"]
    if not choice:  # (choice starts no engine)
        gpu["vLLM engine GPU: generation"] = vllm_items(evaluated, vllm, vllm_share(vllm, shares_gpu=False) * gpu_gb,
                                                        prompt + bench["max_new_tokens"] + 8, "evaluate.vllm", notes)
    if choice or bench["lm_eval"]:
        seq = prompt + bench["max_new_tokens"]
        gpu["scorer GPU: log-likelihoods"] = {"evaluated model (bf16, spread)": spread_gb(evaluated, g),
                                              "CUDA context": CUDA_CONTEXT_GB,
                                              "forward pass": forward_gb(evaluated, SCORE_BATCH, seq),
                                              "logits": logits_gb(evaluated, SCORE_BATCH, seq, LOGITS_FORWARD)}
    engine_gpus = vllm["num_engines"] * vllm["tensor_parallel_size"]
    host = {} if choice else {"generation": {"processes": HOST_PER_PROCESS_GB * min(engine_gpus, g)}}
    if choice or bench["lm_eval"]:
        host["scoring"] = {"processes": HOST_PER_PROCESS_GB, "scorer loading a model (bf16)": 2 * evaluated.params / GB}
    return Estimate(gpu, host, notes)


def breakdown(items: dict) -> str:
    """'a 1.0 + b 2.0 = 3.0 GB' (items under 0.05 GB left out)."""
    return " + ".join(f"{name} {gb:.1f}" for name, gb in items.items() if gb >= 0.05) + \
        f" = {sum(items.values()):.1f} GB"


def remedies(job: JobPlan, params: dict) -> list[str]:
    """What would lower the peak of the job's fullest GPU: the keys that shrink each of its items (as far as they
    are not at their most frugal already), the largest item's first, then more GPUs."""
    stage = job.stage
    block = params[stage] if stage != "benchmark" else params["benchmark"] | {"vllm": params["vllm"]}
    key = (lambda k: f"rl.variants.{params['variant']}.{k} (or rl.{k})") if stage == "rl" else \
        (lambda k: f"{stage}.{k}")
    lengths = {"rl": f"{key('max_new_tokens')}, data.max_prompt_tokens", "evaluate": "evaluate.max_new_tokens, "
               "data.max_prompt_tokens", "benchmark": f"benchmarks.{params.get('name')}.max_new_tokens and few_shot, "
               "data.max_prompt_tokens"}.get(stage, "data.max_prompt_tokens, data.max_response_tokens")
    training = job.gpu_phase.endswith(("train", "training"))
    suggestions: dict[str, float] = {}  # what to change -> GB of the items it shrinks

    def add(text: str, gb: float) -> None:
        suggestions[text] = suggestions.get(text, 0.0) + gb

    for item, gb in job.gpu_items.items():
        if item.endswith(("weights", "gradients", "optimizer states")) and not item.startswith("vLLM"):
            if block["zero_stage"] < 3:
                add(f"{key('zero_stage')}: 3 (weights, gradients and optimizer states sharded over the ranks)", gb)
            if item.endswith("optimizer states") and not block["offload_optimizer"]:
                add(f"{key('offload_optimizer')}: true (optimizer states in CPU memory)", gb)
        elif item in ("activations", "logits", "forward pass"):
            if item == "activations" and not block.get("gradient_checkpointing", True):
                add(f"{key('gradient_checkpointing')}: true", gb)
            if training or (stage not in ("evaluate", "benchmark") and item == "activations"):
                add(f"a smaller {key('micro_batch_size')}", gb)
            elif stage not in ("evaluate", "benchmark"):
                add(f"a smaller {key('forward_micro_batch_size')}", gb)
            add(f"shorter sequences ({lengths})", gb)
        elif stage == "rl" and item.startswith(("reference", "reward model")) and "sharded" not in item:
            add(f"{key('frozen_ranks')} > 1 with {key('zero_stage')}: 3 (the reference and reward model sharded)", gb)
        elif item.startswith("vLLM"):
            vllm = key("vllm") if stage == "rl" else "evaluate.vllm"
            add(f"a lower {vllm}.gpu_memory_utilization" if item != "vLLM weights" else
                f"a larger {vllm}.tensor_parallel_size", gb)
            if stage == "rl" and block["colocate"] and not block["vllm"]["sleep"] and block["zero_stage"] == 3:
                add(f"{key('vllm.sleep')}: true (vLLM and DeepSpeed take turns on the GPUs)", gb)
        elif stage in ("evaluate", "benchmark") and item.endswith("spread)"):  # the scorer's models, spread over the node's GPUs
            add(f"more GPUs per node for {stage} (launcher.stages.{stage}.gpus_per_node: the scorer spreads each "
                f"model over them all) or GPUs with more memory (launcher.stages.{stage}.gpu_memory_gb)", gb)
    ordered = sorted(suggestions, key=suggestions.get, reverse=True)
    if stage not in ("evaluate", "benchmark"):
        ordered.append(f"more GPUs (launcher.stages.{stage}.nodes / gpus_per_node, with num_workers"
                       + (" and frozen_ranks" if stage == "rl" else "") + " to match)")
    return ordered


def check_memory(config: dict, source: str, profile_for=None, sizes: dict | None = None) -> str | None:
    """The memory plan of the config's GPU jobs as a table, or None where it has none (memory_plan's arguments).
    ConfigError naming each job that does not fit: the GPU or node, the phase, the numbers and the keys to change.
    Without a model's config.json one line says the plan was skipped and why, and nothing is refused."""
    if not gpu_jobs(config, profile_for):
        return None
    try:
        plan = memory_plan(config, profile_for, sizes)
    except ModelConfigUnavailable as err:
        print(f"[alignpipe] memory plan skipped: {err}", file=sys.stderr, flush=True)
        return None
    params = {run_name: p for _, run_name, p in stage_jobs(config)}
    problems = []
    for job in plan:
        if job.gpu_peak > job.gpu_gb:
            problems.append(f"{job.run_name}: its fullest GPU ({job.gpu_phase.split(':')[0]}) needs "
                            f"{job.gpu_peak:.1f} GB in phase '{job.gpu_phase.split(': ')[1]}', more than "
                            f"{job.gpu_source} = {job.gpu_gb:g}: {breakdown(job.gpu_items)}\n      to change: "
                            + "; ".join(remedies(job, params[job.run_name])))
        if job.node_peak > job.node_gb:
            problems.append(f"{job.run_name}: its fullest node needs {job.node_peak:.1f} GB in phase "
                            f"'{job.node_phase}', more than {HOST_USABLE:g} x mem_gb ({job.mem_source}) = "
                            f"{job.node_gb:.1f}: {breakdown(job.node_items)}\n      to change: a larger mem_gb "
                            f"({job.mem_source}), or more nodes")
        problems += [f"{job.run_name}: {note}" for note in job.notes]
    if problems:
        raise ConfigError(f"{source}: jobs that do not fit their GPUs or nodes (the memory plan; nothing was queued)\n"
                          + "\n".join("  " + p for p in problems))
    return format_plan(plan)


def format_plan(plan: list[JobPlan]) -> str:
    """One row per GPU job: its peak phase, GB on the fullest GPU of the GPU's, GB on the fullest node of what the
    plan may fill of it, and whether it fits."""
    rows = [("job", "peak phase (GPU)", "fullest GPU, GB", "fullest node, GB (phase)", "fits")]
    rows += [(job.run_name, job.gpu_phase, f"{job.gpu_peak:.1f} of {job.gpu_gb:g}",
              f"{job.node_peak:.1f} of {job.node_gb:.4g} ({job.node_phase})", "yes" if job.fits else "no")
             for job in plan]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    sources = sorted({job.gpu_source for job in plan})
    return (f"Memory plan (GB per GPU from {', '.join(sources)}; per node {HOST_USABLE:.0%} of mem_gb, the rest left "
            "to Ray's object store, the OS and the page cache):\n" + "\n".join("  " + line for line in lines))
