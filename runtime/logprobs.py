"""Token batches of prompt + response, and the log-probabilities a model gives their response tokens.

Shapes: B = batch, K = response positions, V = vocabulary. Every stage that scores responses under a model
(SFT's loss, DPO's log-ratios, RL's log-probs, evaluation's perplexity) goes through here; the training
objectives built on them are in runtime/losses.py.
"""
import torch

Tensor = torch.Tensor


def pad_prompt_response(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict:
    """Right-padded prompt+response ids; `loss_mask` is 1 on response tokens only."""
    ids = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, ids))
    return {
        "input_ids": torch.tensor([x + [pad_id] * (width - len(x)) for x in ids]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
        "loss_mask": torch.tensor([[0] * len(p) + [1] * len(r) + [0] * (width - len(p) - len(r))
                                   for p, r in zip(prompts, responses)], dtype=torch.float32),
    }


def pair_batch(tokenizer, rows: list[dict]) -> dict:
    """prompt+chosen for every row, then prompt+rejected for every row: one padded batch of 2B."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [encode(r["prompt"]) for r in rows]
    responses = [encode(r["chosen"]) for r in rows] + [encode(r["rejected"]) for r in rows]
    return pad_prompt_response(prompts * 2, responses, tokenizer.pad_token_id)


def model_device(model) -> torch.device:
    """Where a model's (or DeepSpeed engine's) weights are: the device its batches must go to."""
    return next(model.parameters()).device


def on_device(batch: dict, model) -> dict:
    """The batch's tensors on the model's device (batches are built on the CPU)."""
    target = model_device(model)
    return {key: value.to(target) for key, value in batch.items()}


def response_logits(model, batch: dict):
    """Next-token logits at the positions that predict response tokens (B, K, V), their labels (B, K) and the
    response mask (B, K), on the model's device. The output layer, a large share of a small model's compute over a
    49k vocabulary, runs only from the first response position of the (right-padded) batch on, not over the prompts."""
    mask = batch["loss_mask"][:, 1:]
    start = int(mask.any(0).nonzero()[0, 0]) if mask.any() else 0  # on the CPU batch: no device sync
    batch = on_device(batch, model)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   logits_to_keep=mask.shape[1] + 1 - start).logits[:, :-1]
    return logits, batch["input_ids"][:, 1 + start:], batch["loss_mask"][:, 1 + start:]


def response_logprobs(model, batch: dict):
    """Log-probability of each response token (B, K), zeroed elsewhere, and the mask (B, K) (see response_logits)."""
    logits, labels, mask = response_logits(model, batch)
    return token_logprobs(logits, labels) * mask, mask


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) per position: logits (B, T, V), labels (B, T) -> (B, T), in float32."""
    # float32: a log-softmax in bf16 loses the small differences that ratios and KL depend on.
    # gather minus logsumexp avoids keeping a full (B, T, V) log-softmax around.
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution: logits (B, T, V) -> (B, T)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    # H = -sum p log p = logsumexp(z) - sum p z
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
