"""Token batches of prompt + response, and the log-probabilities a model gives their response tokens.

Shapes: B = batch, K = response positions, V = vocabulary. Every stage that scores responses under a model
(SFT's loss, DPO's log-ratios, RL's log-probs, evaluation's perplexity) goes through here; the training
objectives built on them are in runtime/losses.py.
"""
import torch

Tensor = torch.Tensor


def pad_prompt_response(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                        packed: bool = False, masks: list[list[float]] | None = None) -> dict:
    """Right-padded prompt+response ids; `loss_mask` is 1 on response tokens only (`masks`: on those a row's mask
    marks, e.g. an episode's replies, not the environment's messages between them). `packed`: the same batch also as
    one row without padding (`packed_ids`, `position_ids`), which response_logits then runs instead."""
    ids = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, ids))
    masks = masks or [[1] * len(r) for r in responses]
    batch = {
        "input_ids": torch.tensor([x + [pad_id] * (width - len(x)) for x in ids]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
        "loss_mask": torch.tensor([[0] * len(p) + list(m) + [0] * (width - len(p) - len(m))
                                   for p, m in zip(prompts, masks)], dtype=torch.float32),
    }
    if packed:
        batch["packed_ids"] = torch.tensor([[token for x in ids for token in x]])
        batch["position_ids"] = torch.tensor([[i for x in ids for i in range(len(x))]])
    return batch


def pair_batch(tokenizer, rows: list[dict], packed: bool = False) -> dict:
    """prompt+chosen for every row, then prompt+rejected for every row: one batch of 2B (pad_prompt_response)."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [encode(r["prompt"]) for r in rows]
    responses = [encode(r["chosen"]) for r in rows] + [encode(r["rejected"]) for r in rows]
    return pad_prompt_response(prompts * 2, responses, tokenizer.pad_token_id, packed)


def forward_tokens(batch: dict) -> int:
    """The token positions a forward of the batch computes: the packed row's, or every padded row's whole width."""
    return batch["packed_ids"].numel() if "packed_ids" in batch else batch["input_ids"].numel()


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
    49k vocabulary, runs only from the first response position of the (right-padded) batch on, not over the prompts.
    A packed batch (pad_prompt_response(packed=True)) gives the same (B, K) results from its one row (packed_logits)."""
    mask = batch["loss_mask"][:, 1:]
    start = int(mask.any(0).nonzero()[0, 0]) if mask.any() else 0  # on the CPU batch: no device sync
    if "packed_ids" in batch:
        logits = packed_logits(model, batch, start)
        return logits, batch["input_ids"][:, 1 + start:].to(logits.device), \
            batch["loss_mask"][:, 1 + start:].to(logits.device)
    batch = on_device(batch, model)
    # use_cache=False: a forward that generates nothing needs no KV cache (~4 GB per forward at 8B)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   logits_to_keep=mask.shape[1] + 1 - start, use_cache=False).logits[:, :-1]
    return logits, batch["input_ids"][:, 1 + start:], batch["loss_mask"][:, 1 + start:]


def packed_logits(model, batch: dict, start: int) -> Tensor:
    """The padded batch's next-token logits from position `start` on (B, K, V), computed on its packed row: the
    sequences one after another without padding, position ids restarting at each, no attention mask. transformers
    then lets each token attend to its own sequence only (masking_utils.find_packed_sequence_indices: a block-diagonal
    causal mask with sdpa or eager, flash-attention's variable-length kernel with flash_attention_2). The output layer
    runs at the positions that predict a response token only; the other (B, K) entries repeat one of those (finite,
    and masked out by loss_mask)."""
    lengths = batch["attention_mask"].sum(1)
    offsets = torch.cumsum(lengths, 0) - lengths
    positions = offsets[:, None] + start + torch.arange(batch["input_ids"].shape[1] - 1 - start)  # (B, K)
    predicts = batch["loss_mask"][:, 1 + start:].bool()
    keep = positions[predicts] if predicts.any() else positions[:1, :1].flatten()  # sorted: rows, then positions
    index = torch.searchsorted(keep, positions).clamp(max=len(keep) - 1)
    target = model_device(model)
    # use_cache=False: with a KV cache transformers takes the position ids as a continuation, not as packing
    logits = model(input_ids=batch["packed_ids"].to(target), position_ids=batch["position_ids"].to(target),
                   logits_to_keep=keep.to(target), use_cache=False).logits[0]  # (len(keep), V)
    return logits[index.to(target)]


def response_logprobs(model, batch: dict, temperature: float = 1.0):
    """Log-probability of each response token (B, K) at `temperature` (token_logprobs), zeroed elsewhere, and the
    mask (B, K) (see response_logits)."""
    logits, labels, mask = response_logits(model, batch)
    return token_logprobs(logits, labels, temperature) * mask, mask


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


def float_chunk(logits: Tensor, row: int, span: slice, temperature: float) -> Tensor:
    """One chunk of the logits in float32, divided by the sampling temperature there (in float32, as vLLM's sampler
    does: dividing bf16 logits would round them again). A copy where it divides (float32 logits' .float() would be
    the logits themselves)."""
    if temperature == 1.0:
        return logits[row, span].float()
    return logits[row, span].to(torch.float32, copy=True).div_(temperature)


class TokenLogprobs(torch.autograd.Function):
    """log p(label) = z_label - logsumexp(z), z = logits / temperature, over a chunk of positions at a time, forward
    and backward. The graph keeps only the logits (which the model's graph holds anyway) and the (B, T) logsumexp; no
    float32 copy of them."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, max_bytes: int, temperature: float) -> Tensor:
        logp = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        for row, span in logit_chunks(logits, max_bytes):
            z = float_chunk(logits, row, span, temperature)
            lse[row, span] = torch.logsumexp(z, dim=-1)
            logp[row, span] = z.gather(-1, labels[row, span, None]).squeeze(-1) - lse[row, span]
        ctx.save_for_backward(logits, labels, lse)
        ctx.max_bytes, ctx.temperature = max_bytes, temperature
        return logp

    @staticmethod
    def backward(ctx, grad_logp: Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for row, span in logit_chunks(logits, ctx.max_bytes):
            g = grad_logp[row, span, None] / ctx.temperature
            # d log p(y) / d logits_v = (1[v = y] - softmax(z)_v) / temperature
            chunk = (float_chunk(logits, row, span, ctx.temperature) - lse[row, span, None]).exp_().mul_(-g)
            grad[row, span] = chunk.scatter_add_(-1, labels[row, span, None], g)
        return grad, None, None, None


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0,
                   max_bytes: int = LOGITS_CHUNK_BYTES) -> Tensor:
    """log p(label) per position under softmax(logits / temperature): logits (B, T, V), labels (B, T) -> (B, T), in
    float32. RL takes them at its sampling temperature: the distribution vLLM samples from, whose log-probs it returns
    (rollout.engine_options), so that the importance ratios compare the same distribution.

    float32: a log-softmax in bf16 loses the small differences that ratios and KL depend on. Memory: the float32
    logits are made `max_bytes` at a time; with that chunk's temporaries the call needs at most 4 * max_bytes beyond
    its input and (B, T) output (256 MiB by default), and its backward pass beyond that only the logits' gradient."""
    return TokenLogprobs.apply(logits, labels, max_bytes, temperature)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, max_bytes: int = LOGITS_CHUNK_BYTES) -> Tensor:
    """Entropy of the next-token distribution softmax(logits / temperature): logits (B, T, V) -> (B, T), in float32.
    Memory as token_logprobs' without autograd (at most 4 * max_bytes beyond input and output); with autograd (an
    entropy bonus trained on) the graph keeps every chunk's float32 logits and probabilities for the backward pass."""
    entropy = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for row, span in logit_chunks(logits, max_bytes):
        z = float_chunk(logits, row, span, temperature)
        # H = -sum p log p = logsumexp(z) - sum p z
        entropy[row, span] = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return entropy
