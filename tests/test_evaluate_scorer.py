"""The evaluation's scoring at scale (stages/evaluate.py) changes no number: the exact KL made a chunk of positions at a
time equals the whole-vocabulary one and stays within its memory bound at a 128k vocabulary; the scorer holds one
phase's models at a time (the reward model alone, then the evaluated model with its reference) and gives the scores
the scorer that held all three gave; on GPUs each model's layers spread over the node's GPUs within what the memory
plan counts (launcher/memory.spread_gb; checked on the meta device, Llama-3-70B over 5 x 80 GB); and the engines'
GPUs are free for the scorer once they are stopped (Ray with declared GPUs)."""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hub_configs import LLAMA3_8B_INSTRUCT, LLAMA3_70B_INSTRUCT
from launcher.config import REPO_ROOT, validate_config
from launcher.memory import ModelSize, spread_gb
from runtime import models
from runtime.builtin_data import load_reviews
from runtime.logprobs import LOGITS_CHUNK_BYTES, on_device, pad_prompt_response, response_logits, token_logprobs
from runtime.rollout import start_engines
from stages import evaluate


def whole_vocabulary_kl(logits, ref_logits):
    """The exact KL as stages/evaluate.token_kl computed it before: both float32 log-softmaxes over everything."""
    logp, ref_logp = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_kl_in_chunks_equals_the_whole_vocabulary_at_once(dtype):
    torch.manual_seed(0)
    full, ref = ((3 * torch.randn(3, 10, 50)).to(dtype) for _ in range(2))
    logits, ref_logits = full[:, :-1], ref[:, :-1]  # views that are not contiguous, as response_logits gives them
    for max_bytes in (3 * 50 * 4, 1, LOGITS_CHUNK_BYTES):  # 3 positions a chunk, 1, a whole row
        assert torch.equal(evaluate.token_kl(logits, ref_logits, max_bytes), whole_vocabulary_kl(logits, ref_logits))


MEASURE_PEAK = """
import json, sys, torch
from stages.evaluate import token_kl

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

rows, positions, vocab = json.loads(sys.argv[1])
logits, ref_logits = (torch.empty(rows, positions, vocab, dtype=torch.bfloat16).normal_() for _ in range(2))
open("/proc/self/clear_refs", "w").write("5")  # resets the peak resident set size (VmHWM)
base = status("VmRSS:")
token_kl(logits, ref_logits)
print(json.dumps(status("VmHWM:") - base))
"""


def test_token_kl_at_a_128k_vocabulary_stays_within_the_memory_bound():
    """2 rows of 192 positions at a 128k vocabulary, two models' bf16 logits of 96 MiB each (their float32
    log-softmaxes at once: 384 MiB, plus the exp and the product). Peak resident memory beyond the inputs, in a fresh
    process: token_kl's 3 chunks (within the 4 that launcher/memory.py counts, LOGITS_CHUNKS_GB), give or take the
    few MiB the allocator and torch's kernels keep."""
    proc = subprocess.run([sys.executable, "-c", MEASURE_PEAK, json.dumps([2, 192, 128 * 1024])], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.splitlines()[-1])
    print(f"{peak / 2**20:.0f} MiB; bound {3 * LOGITS_CHUNK_BYTES // 2**20} MiB and what the allocator keeps")
    assert peak <= 3 * LOGITS_CHUNK_BYTES + 16 * 2**20


class ScorerOfThree:
    """The scorer as it was: the evaluated model, its reference and the reward model loaded at once, and the KL over
    the whole vocabulary."""

    def __init__(self, model_dir, reference_dir, reward_model_dir):
        load = lambda loader, path: loader(path, "float32").eval()
        self.model = load(models.load_causal_lm, model_dir)
        self.reference = self.model if model_dir == reference_dir else load(models.load_causal_lm, reference_dir)
        self.reward_model = load(models.load_reward_model, reward_model_dir)
        self.pad_id = models.load_tokenizer(model_dir).pad_token_id

    @torch.no_grad()
    def reward_model_scores(self, prompts, responses):
        scores = []
        for i in range(0, len(prompts), evaluate.SCORE_BATCH):
            rows = slice(i, i + evaluate.SCORE_BATCH)
            batch = on_device(pad_prompt_response(prompts[rows], responses[rows], self.pad_id), self.reward_model)
            scores += self.reward_model(input_ids=batch["input_ids"],
                                        attention_mask=batch["attention_mask"]).logits[:, 0].tolist()
        return scores

    @torch.no_grad()
    def sequence_logprobs(self, prompts, responses, with_reference):
        out = []
        for i in range(0, len(prompts), evaluate.SCORE_BATCH):
            rows = slice(i, i + evaluate.SCORE_BATCH)
            batch = pad_prompt_response(prompts[rows], responses[rows], self.pad_id)
            logits, labels, mask = response_logits(self.model, batch)
            logp = token_logprobs(logits, labels) * mask
            kl = torch.zeros_like(mask)
            if with_reference and self.reference is not self.model:
                kl = whole_vocabulary_kl(logits, response_logits(self.reference, batch)[0]) * mask
            out += [(a, b, n) for a, b, n in zip(logp.sum(1).tolist(), kl.sum(1).tolist(), mask.sum(1).tolist())]
        return out


@pytest.fixture(scope="module")
def scored_models(tmp_path_factory):
    """A tiny Llama (the base model), a copy with other weights (the evaluated model), a reward model saved with its
    score head, and 10 prompts with responses of unequal lengths (two batches of the scorer)."""
    root = tmp_path_factory.mktemp("scorer")
    texts = [r["text"] for r in load_reviews("rotten_tomatoes")[:300]]
    tiny = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 400}
    models.build_tiny(root / "base", tiny, 0, texts)
    models.build_tiny(root / "trained", tiny, 1, texts)  # other random weights, the same tokenizer
    torch.manual_seed(2)
    reward = models.load_reward_model(root / "base")
    reward.save_pretrained(root / "reward", safe_serialization=True)
    models.load_tokenizer(root / "base").save_pretrained(root / "reward")
    tokenizer = models.load_tokenizer(root / "base")
    prompts = [tokenizer(t[:40], add_special_tokens=False)["input_ids"] for t in texts[:10]]
    generator = torch.Generator().manual_seed(3)
    responses = [torch.randint(3, 390, (1 + 3 * i % 11,), generator=generator).tolist() for i in range(10)]
    return {name: str(root / name) for name in ("base", "trained", "reward")}, prompts, responses


def held(scorer) -> list[str]:
    return [name for name, value in vars(scorer).items() if isinstance(value, torch.nn.Module)]


@pytest.mark.parametrize("evaluated", ["trained", "base"])
def test_the_scorer_holds_one_phase_of_models_and_scores_as_before(scored_models, evaluated):
    dirs, prompts, responses = scored_models
    old = ScorerOfThree(dirs[evaluated], dirs["base"], dirs["reward"])
    scorer = evaluate.Scorer(models.load_tokenizer(dirs[evaluated]).pad_token_id, torch.get_num_threads(), "fp32")
    scorer.hold(reward_model_dir=dirs["reward"])
    assert held(scorer) == ["reward_model"]
    assert scorer.reward_model_scores(prompts, responses) == pytest.approx(old.reward_model_scores(prompts, responses),
                                                                           rel=1e-6, abs=1e-6)
    scorer.hold(model_dir=dirs[evaluated], reference_dir=dirs["base"])
    assert held(scorer) == ["model", "reference"] and (scorer.reference is scorer.model) == (evaluated == "base")
    for with_reference in (True, False):  # the samples' log-probs and KL; the held-out responses' log-probs
        new = scorer.sequence_logprobs(prompts, responses, with_reference)
        was = old.sequence_logprobs(prompts, responses, with_reference)
        assert [n for _, _, n in new] == [n for _, _, n in was]
        for values, before in zip(zip(*new), zip(*was)):
            assert list(values) == pytest.approx(list(before), rel=1e-6, abs=1e-6)
    kl = [k for _, k, _ in scorer.sequence_logprobs(prompts, responses, True)]
    assert min(kl) > 0 if evaluated == "trained" else set(kl) == {0.0}  # not vacuous: two models differ


def gpu_bytes(model, device_map: dict) -> dict:
    """Bytes of `model`'s parameters on each device of `device_map` (module name -> device)."""
    used = {}
    for name, param in model.named_parameters():
        prefix = max((p for p in device_map if p == "" or name == p or name.startswith(p + ".")), key=len)
        used[device_map[prefix]] = used.get(device_map[prefix], 0) + param.numel() * param.element_size()
    return used


@pytest.mark.parametrize("hf, gpus", [(LLAMA3_70B_INSTRUCT, 5), (LLAMA3_8B_INSTRUCT, 4)], ids=["70b-5", "8b-4"])
def test_spread_over_gpus_stays_within_the_plan(hf, gpus):
    """The evaluated model, then its reference (another copy), spread over the GPUs' free memory as the scorer spreads
    them: no GPU holds more of either than the plan counts (spread_gb), and all of both on the GPUs; a node with too
    little memory is refused, not offloaded."""
    config = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype",
                                                                    "transformers_version")})
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    bound = spread_gb(ModelSize.from_config(hf, "model"), gpus) * 1e9
    free = {gpu: 80 * 10**9 for gpu in range(gpus)}
    for _ in ("evaluated", "reference"):
        used = gpu_bytes(model, evaluate.spread_over_gpus(model, free))
        assert set(used) == set(free) and max(used.values()) <= bound, (used, bound)
        free = {gpu: free[gpu] - used[gpu] for gpu in free}
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(RuntimeError, match="does not fit the free memory"):
        evaluate.spread_over_gpus(model, {gpu: int(0.6 * whole / gpus) for gpu in range(gpus)})


class GPUProbe(evaluate.Engine):
    """Stands in for a vLLM engine of the evaluate stage (no vLLM): Ray's placement of it is all that matters."""

    def __init__(self, *args):
        pass


class AllGPUs:
    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()


def test_stopped_engines_free_their_gpus_for_the_scorer():
    """Two engines of one GPU each, in the placement groups start_engines reserves on GPUs: once stopped, an actor
    asking for both GPUs (the scorer) starts. Killing the engines alone would give their GPUs back to their placement
    groups only, and the scorer would wait for them forever."""
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-test-", dir="/tmp"))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        vllm = validate_config({})["evaluate"]["vllm"] | {"num_engines": 2, "tensor_parallel_size": 1}
        engines = start_engines("unused", 0, 64, vllm, 1, 1, gpus=True, engine_cls=GPUProbe)
        assert ray.available_resources().get("GPU", 0) == 0
        evaluate.stop_engines(engines)
        scorer = ray.remote(num_cpus=1, num_gpus=2)(AllGPUs).remote()
        assert len(ray.get(scorer.gpu_ids.remote(), timeout=120)) == 2
    finally:
        ray.shutdown()
        del os.environ["RAY_TMPDIR"]
