"""LoRA: the adapted model starts as the original, only the adapters (and a fresh head) train, and the merged
export is a plain model that computes exactly what the adapted one does."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from runtime.lora import LoRALinear, apply_lora, merged_state_dict
from runtime.models import load_causal_lm

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              tie_word_embeddings=True, pad_token_id=0)
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def tiny_lm():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def train_adapters(model, steps=3):
    """A few SGD steps on the trainable parameters, so B is no longer zero."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()


def test_starts_as_the_original_and_trains_only_adapters():
    model = tiny_lm()
    before = model(input_ids=IDS).logits
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainable = apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj"], train_head=False)
    adapted = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 2 * CONFIG["num_hidden_layers"]
    assert trainable == sum(m.lora_A.numel() + m.lora_B.numel() for m in adapted)
    torch.testing.assert_close(model(input_ids=IDS).logits, before)
    train_adapters(model)
    assert not torch.allclose(model(input_ids=IDS).logits, before), "the adapters should have changed the output"
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), f"{name} is frozen under LoRA but changed"


def test_merged_export_is_a_plain_model_with_the_same_outputs(tmp_path):
    model = tiny_lm()
    keys = set(model.state_dict())
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "k_proj", "down_proj"], train_head=False)
    train_adapters(model)
    state = merged_state_dict(model)
    assert set(state) == keys
    model.save_pretrained(tmp_path, state_dict=state, safe_serialization=True)
    reloaded = load_causal_lm(tmp_path).eval()
    assert not any(isinstance(m, LoRALinear) for m in reloaded.modules())
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr(), "ties kept"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)


def test_reward_model_head_trains_fully():
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(**CONFIG, num_labels=1))
    apply_lora(model, rank=2, alpha=4, targets=["v_proj"], train_head=True)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "score.weight" in trained
    assert all(name == "score.weight" or name.endswith((".lora_A", ".lora_B")) for name in trained)


def test_unknown_target_names_the_model_layers():
    with pytest.raises(ValueError, match=r"\['qkv'\].*gate_proj"):
        apply_lora(tiny_lm(), rank=2, alpha=4, targets=["q_proj", "qkv"], train_head=False)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)).eval()


@pytest.mark.parametrize("targets, adapted_names", [
    (None, {"c_attn"}),  # GPT-2's default: its fused query/key/value projection
    ("all-linear", {"c_attn", "c_proj", "c_fc"}),
])
def test_gpt2_conv1d_layers_adapt_and_merge(tmp_path, targets, adapted_names):
    """GPT-2 keeps its linear layers as Conv1D, weight (in, out): adapters and the merged export follow that layout."""
    model = tiny_gpt2()
    before = model(input_ids=IDS).logits
    apply_lora(model, rank=4, alpha=8, targets=targets, train_head=False)
    assert {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoRALinear)} == adapted_names
    torch.testing.assert_close(model(input_ids=IDS).logits, before)
    train_adapters(model)
    model.save_pretrained(tmp_path, state_dict=merged_state_dict(model), safe_serialization=True)
    with torch.no_grad():
        torch.testing.assert_close(load_causal_lm(tmp_path).eval()(input_ids=IDS).logits, model(input_ids=IDS).logits,
                                   rtol=1e-5, atol=1e-5)


def test_default_targets_follow_the_architecture():
    model = tiny_lm()
    apply_lora(model, rank=2, alpha=4, targets=None, train_head=False)
    assert {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoRALinear)} == {"q_proj", "v_proj"}
