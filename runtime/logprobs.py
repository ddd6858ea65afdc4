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


# float32 logits made at a time by token_logprobs and entropy_from_logits: 64 MiB is 128 positions at a 128k
# vocabulary. Unchunked, a (B, T, V) float32 copy plus logsumexp's temporaries is 20-40 GB at 16 rows of 1-2k tokens.
LOGITS_CHUNK_BYTES = 64 * 2**20


def logit_chunks(logits: Tensor, max_bytes: int):
    """(row, positions) indices into logits (B, T, V), each at most `max_bytes` of float32 (at least one position)."""
    rows, positions, vocab = logits.shape
    step = max(1, max_bytes // (4 * vocab))
    for row in range(rows):
        for start in range(0, positions, step):
            yield row, slice(start, start + step)


class TokenLogprobs(torch.autograd.Function):
    """log p(label) = z_label - logsumexp(z) over a chunk of positions at a time, forward and backward. The graph
    keeps only the logits (which the model's graph holds anyway) and the (B, T) logsumexp; no float32 copy of them."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, max_bytes: int) -> Tensor:
        logp = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        for row, span in logit_chunks(logits, max_bytes):
            z = logits[row, span].float()
            lse[row, span] = torch.logsumexp(z, dim=-1)
            logp[row, span] = z.gather(-1, labels[row, span, None]).squeeze(-1) - lse[row, span]
        ctx.save_for_backward(logits, labels, lse)
        ctx.max_bytes = max_bytes
        return logp

    @staticmethod
    def backward(ctx, grad_logp: Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for row, span in logit_chunks(logits, ctx.max_bytes):
            g = grad_logp[row, span, None]
            # d log p(y) / d z_v = 1[v = y] - softmax(z)_v
            chunk = (logits[row, span].float() - lse[row, span, None]).exp_().mul_(-g)
            grad[row, span] = chunk.scatter_add_(-1, labels[row, span, None], g)
        return grad, None, None


def token_logprobs(logits: Tensor, labels: Tensor, max_bytes: int = LOGITS_CHUNK_BYTES) -> Tensor:
    """log p(label) per position: logits (B, T, V), labels (B, T) -> (B, T), in float32.

    float32: a log-softmax in bf16 loses the small differences that ratios and KL depend on. Memory: the float32
    logits are made `max_bytes` at a time; with that chunk's temporaries the call needs at most 4 * max_bytes beyond
    its input and (B, T) output (256 MiB by default), and its backward pass beyond that only the logits' gradient."""
    return TokenLogprobs.apply(logits, labels, max_bytes)


def entropy_from_logits(logits: Tensor, max_bytes: int = LOGITS_CHUNK_BYTES) -> Tensor:
    """Entropy of the next-token distribution: logits (B, T, V) -> (B, T), in float32. Memory as token_logprobs'
    without autograd (at most 4 * max_bytes beyond input and output); with autograd (an entropy bonus trained on)
    the graph keeps every chunk's float32 logits and probabilities for the backward pass."""
    entropy = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for row, span in logit_chunks(logits, max_bytes):
        z = logits[row, span].float()
        # H = -sum p log p = logsumexp(z) - sum p z
        entropy[row, span] = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return entropy
