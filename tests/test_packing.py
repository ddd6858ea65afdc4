"""Packed forwards (`packing`: a micro-batch's sequences in one row without padding, runtime/logprobs.packed_logits)
give the padded forwards' log-probabilities, losses and gradients, on each architecture the tests build users'
models of, with sdpa's and eager attention; and compute fewer token positions where the lengths differ."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from runtime.logprobs import forward_tokens, pad_prompt_response, response_logprobs
from stage_helpers import rollout

# float32 on CPU; the two layouts differ only in the shapes of their attention products
TOLERANCE = 1e-5
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "qwen2": lambda: Qwen2Config(**SIZES),
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=None),
    "gpt2": lambda: GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=128),
}
PAD = 0


def tiny_model(architecture: str, attention: str):
    """In eval mode: no dropout (GPT-2's config has some; runtime/models.py's loaders turn it off for training too)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[architecture](), attn_implementation=attention).float().eval()


def rows(count: int = 6, seed: int = 0):
    """Prompts and responses of unequal lengths (1-20 and 1-12 tokens), no pad token among them."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 20))] for _ in range(count)]
    responses = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 12))] for _ in range(count)]
    return prompts, responses


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_log_probs_loss_and_gradients_equal_the_padded_ones(architecture, attention):
    model = tiny_model(architecture, attention)
    prompts, responses = rows()
    results = {}
    for packed in (False, True):
        model.zero_grad()
        logp, mask = response_logprobs(model, pad_prompt_response(prompts, responses, PAD, packed))
        loss = -logp.sum() / mask.sum()  # SFT's loss
        loss.backward()
        results[packed] = (logp.detach(), mask, loss.detach(), [p.grad.clone() for p in model.parameters()])
    (logp, mask, loss, grads), (packed_logp, packed_mask, packed_loss, packed_grads) = results[False], results[True]
    assert torch.equal(mask, packed_mask) and mask.sum() == sum(map(len, responses))
    assert torch.allclose(packed_logp, logp, atol=TOLERANCE, rtol=0), (packed_logp - logp).abs().max()
    assert packed_loss == pytest.approx(float(loss), abs=TOLERANCE)
    for grad, packed_grad in zip(grads, packed_grads):
        assert torch.allclose(packed_grad, grad, atol=TOLERANCE, rtol=0), (packed_grad - grad).abs().max()
    # Against a model that saw each sequence alone: no token of the packed row attended to another sequence's.
    alone = torch.cat([response_logprobs(model, pad_prompt_response([p], [r], PAD))[0][0, -len(r):]
                       for p, r in zip(prompts, responses)])
    assert torch.allclose(packed_logp[packed_mask.bool()], alone.detach(), atol=TOLERANCE, rtol=0)


def test_packing_computes_only_the_real_tokens():
    prompts, responses = rows(count=16, seed=1)
    padded, packed = (pad_prompt_response(prompts, responses, PAD, p) for p in (False, True))
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    assert forward_tokens(packed) == sum(lengths) and forward_tokens(padded) == len(lengths) * max(lengths)
    assert forward_tokens(packed) < 0.8 * forward_tokens(padded)
    assert packed["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]


def test_a_packed_rollout_gives_the_padded_rollouts_log_probs():
    """RL's path: Rollout.tokens(packed) through response_logprobs, back to response-aligned rows (from_batch)."""
    model = tiny_model("qwen2", "sdpa")
    rows_ = rollout()
    with torch.no_grad():
        padded, packed = (rows_.from_batch(*response_logprobs(model, rows_.tokens(PAD, p))) for p in (False, True))
    assert torch.allclose(packed, padded, atol=TOLERANCE, rtol=0) and packed.abs().sum() > 0
