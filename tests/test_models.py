"""Response log-probs computed with the output layer over the response positions only equal those from the
logits of every position."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from runtime.logprobs import pad_prompt_response, response_logprobs, token_logprobs


def test_response_logprobs_match_full_logits():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2)).eval()
    # Prompts of different lengths, so the rows' responses start at different positions.
    prompts = [[5, 6, 7, 8, 9], [5, 6], [10, 11, 12]]
    responses = [[20, 21], [22, 23, 24, 25], [26]]
    batch = pad_prompt_response(prompts, responses, pad_id=0)
    with torch.no_grad():
        logp, mask = response_logprobs(model, batch)
        full = token_logprobs(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1],
                              batch["input_ids"][:, 1:])
    full_mask = batch["loss_mask"][:, 1:]
    assert logp.shape[1] < full.shape[1], "the prompt-only positions are skipped"
    for row in range(len(prompts)):
        got = logp[row][mask[row].bool()]
        want = full[row][full_mask[row].bool()]
        assert len(got) == len(responses[row])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
