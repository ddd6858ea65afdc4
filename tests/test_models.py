"""Response log-probs computed with the output layer over the response positions only equal those from the
logits of every position; a hub model in the Hugging Face cache becomes the base model offline."""
import json
import os
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hub_configs import cache_hub_model, hf_env
from launcher.config import REPO_ROOT
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


def test_a_recorded_tokenizer_class_loads_what_autotokenizer_loads(tmp_path):
    """load_tokenizer takes the class that record_tokenizer_class wrote down (AutoTokenizer's choice: for Qwen2 not the
    class tokenizer_config.json names), in a process that never imports AutoTokenizer and its modelling code."""
    from transformers import AutoTokenizer
    from runtime import models
    texts = ["a small corpus for a small tokenizer, with <|im_end|> and digits 12345"] * 20
    for architecture in models.LINEAR_LAYERS:
        model_dir = tmp_path / architecture
        models.build_tiny(model_dir, {"architecture": architecture, "hidden_size": 64, "num_layers": 1, "num_heads": 2,
                                      "vocab_size": 300}, 0, texts)
        models.record_remote_code(model_dir, False)
        models.record_tokenizer_class(model_dir)
        auto = AutoTokenizer.from_pretrained(model_dir)
        recorded = json.loads((model_dir / models.TOKENIZER_CLASS_FILE).read_text())["tokenizer_class"]
        assert recorded == type(auto).__name__, architecture
        script = (f"import json, sys; from runtime.models import load_tokenizer; t = load_tokenizer({str(model_dir)!r}); "
                  f"print(json.dumps([type(t).__name__, t.get_vocab(), t.all_special_tokens, t.chat_template, "
                  f"t.pad_token, t({texts[0]!r})['input_ids'], "
                  f"'transformers.models.auto.tokenization_auto' in sys.modules, 'torch' in sys.modules]))")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        name, vocab, specials, template, pad, ids, auto_imported, torch_imported = json.loads(proc.stdout)
        auto.pad_token = auto.pad_token or auto.eos_token
        assert [name, vocab, specials, template, pad, ids] == [type(auto).__name__, auto.get_vocab(),
                                                               auto.all_special_tokens, auto.chat_template,
                                                               auto.pad_token, auto(texts[0])["input_ids"]]
        assert not auto_imported and not torch_imported, architecture
    assert json.loads((tmp_path / "qwen2" / "tokenizer_config.json").read_text())["tokenizer_class"] != \
        json.loads((tmp_path / "qwen2" / models.TOKENIZER_CLASS_FILE).read_text())["tokenizer_class"]


# The base_model stage in a process of its own, as its job runs it: the job's environment first (offline), then the
# stage on model.path argv[1], writing into argv[2].
BASE_MODEL_JOB = """import os, sys
from pathlib import Path
from runtime.job import set_job_env
set_job_env(os.environ, hub_downloads=False)
sys.path.insert(0, "tests")
from stage_helpers import Tracker
from stages import base_model
model = {"path": sys.argv[1], "source": "tiny", "tiny": {}, "trust_remote_code": False}
base_model.run(base_model.Config.from_params({"model": model, "seed": 0}), {}, Path(sys.argv[2]), Tracker())
"""


def test_a_hub_model_in_the_cache_is_the_base_model_offline(tmp_path):
    """model.path a hub id whose snapshot is in the Hugging Face cache: the base_model stage, offline as every job runs
    unless launcher.hub_downloads, links the snapshot's weights and copies its config and tokenizer (not into
    snapshot_download's local_dir, where offline it would look for the model instead of in the cache)."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    snapshot = cache_hub_model(tmp_path / "hf", "someorg/tiny-llama", config.to_dict(), weights=True)
    (snapshot / "tokenizer.json").write_text("{}")
    output = tmp_path / "base_model"
    output.mkdir()
    proc = subprocess.run([sys.executable, "-c", BASE_MODEL_JOB, "someorg/tiny-llama", str(output)], cwd=REPO_ROOT,
                          capture_output=True, text=True,
                          env=os.environ | hf_env(tmp_path / "hf") | {"PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "someorg/tiny-llama (llama)" in proc.stdout, proc.stdout
    assert (output / "model.safetensors").resolve() == (snapshot / "model.safetensors").resolve()
    assert json.loads((output / "config.json").read_text())["hidden_size"] == 32
    assert (output / "tokenizer.json").is_file() and not (output / "tokenizer.json").is_symlink()
