"""LoRA through the real launcher, Ray, DeepSpeed and vLLM: the tiny experiment's PPO run (policy and critic) again
with adapters on q_proj and v_proj. vLLM must sample from the merged policy the trainer trains (its log-probs equal
the trainer's at every step), and the exported model must be a plain model in which only the adapted layers
changed."""
import pytest
from safetensors.torch import load_file

from pipeline_helpers import submit_again
from runtime import data

pytestmark = pytest.mark.e2e
STEPS = 3


def test_ppo_with_lora_syncs_and_exports_the_merged_policy(tiny_run, tmp_path):
    first = tiny_run["results"] / "rl" / "ppo" / "seed0"
    job, output, _ = submit_again(tiny_run, first, tmp_path, steps=STEPS, lora_rank=4, lora_alpha=8,
                                  lora_targets=["q_proj", "v_proj"])
    job.result()
    stdout = job.stdout()
    assert "[PolicyWorker] LoRA r4 on q_proj, v_proj" in stdout and "[CriticWorker] LoRA r4" in stdout, stdout[-3000:]
    log = data.read_jsonl(output / "train_log.jsonl")
    assert [s["step"] for s in log] == list(range(1, STEPS + 1))
    for step in log[1:]:  # from step 2 on vLLM serves weights synced from the LoRA trainer
        assert step["vllm_logprob_gap"] < 1e-4, f"step {step['step']}: vLLM samples from other weights"

    sft = load_file(tiny_run["results"] / "sft" / "model.safetensors")
    exported = load_file(output / "model.safetensors")
    assert set(exported) == set(sft), "the export is the plain model: no adapter tensors"
    adapted = {name for name in sft if name.endswith(("q_proj.weight", "v_proj.weight"))}
    assert adapted
    for name in sft:
        if name in adapted:
            assert not exported[name].equal(sft[name]), f"{name} has adapters but did not change"
        else:
            assert exported[name].equal(sft[name]), f"{name} is frozen under LoRA but changed"
