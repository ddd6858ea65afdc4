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


def test_trust_remote_code_follows_the_model_directory(tmp_path, monkeypatch):
    """model.trust_remote_code is recorded in the base model's directory and in every directory linked from it; each
    loader passes it on (off where nothing says otherwise)."""
    import transformers
    from runtime import models
    texts = ["a small corpus for a small tokenizer"] * 20
    models.build_tiny(tmp_path / "base", {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "vocab_size": 300}, 0,
                      texts)
    assert not models.trusts_remote_code(tmp_path / "base")
    models.record_remote_code(tmp_path / "base", True)
    (tmp_path / "given").mkdir()
    models.link_given_model(tmp_path / "base", tmp_path / "base", tmp_path / "given")
    seen = []
    for name in ("AutoTokenizer", "AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        cls = getattr(transformers, name)
        original = cls.from_pretrained.__func__
        monkeypatch.setattr(cls, "from_pretrained", classmethod(
            lambda c, *a, _orig=original, **kw: seen.append(kw["trust_remote_code"]) or _orig(c, *a, **kw)))
    models.load_tokenizer(tmp_path / "given")
    models.load_causal_lm(tmp_path / "given")
    models.load_reward_model(tmp_path / "given")
    assert seen and all(seen)
    assert (tmp_path / "given" / "model.safetensors").is_symlink()
