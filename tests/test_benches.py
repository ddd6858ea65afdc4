"""The benches stay alive: each runs its own code path (the stage Configs from the schema's defaults, alignpipe's
trainer actors, vLLM, the results file) as `make bench-*` does, but for one step on the schema's tiny model.
Measures nothing (docs/benchmarks.md). TRL's side needs the bench-only extra (bench/requirements.txt), which the
test environment does not have: `--sides alignpipe`."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e  # Ray actors, DeepSpeed ranks, vLLM


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """Where the benches share their tiny base model: the first bench to run builds it there."""
    return tmp_path_factory.mktemp("bench") / "tiny-model"


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.parametrize("script, rate", [("dpo_throughput.py", "pairs_per_second"),
                                          ("grpo_throughput.py", "samples_per_second")], ids=["dpo", "grpo"])
def test_throughput_bench_runs_a_tiny_step(tmp_path, tiny_model, script, rate):
    """GRPO's bench: its asynchronous and packed sides (the plain side's path with one setting changed; two steps,
    so that a rollout is generated ahead)."""
    out = tmp_path / "result.json"
    sides, steps = (["alignpipe-async", "alignpipe-packed"], 2) if script == "grpo_throughput.py" else (["alignpipe"], 1)
    run_bench(script, "--tiny", "--steps", str(steps), "--warmup", "0", "--sides", ",".join(sides), "--model",
              str(tiny_model), "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result) == {*sides, "setup"}
    assert result["setup"]["steps"] == steps and result["setup"]["warmup_steps_excluded"] == 0
    for side in map(result.get, sides):
        assert len(side["step_seconds"]) == steps and all(seconds > 0 for seconds in side["step_seconds"])
        assert side["steady_seconds_per_step"] == pytest.approx(sum(side["step_seconds"]) / steps) and side[rate] > 0
        if script == "grpo_throughput.py":  # each phase of the rl stage's step was timed
            assert set(side["phase_seconds"]) == {"generate", "make_experience", "train", "weight_sync"}
            assert all(seconds > 0 for seconds in side["phase_seconds"].values())


def test_deepspeed_step_bench_runs_a_tiny_step(tmp_path, tiny_model):
    """Two ZeRO-2 ranks training LoRA adapters: the bench's multi-rank, DeepSpeed and LoRA branches at once."""
    out = tmp_path / "result.json"
    proc = run_bench("deepspeed_step.py", "2", "2", "--tiny", "--steps", "1", "--lora-rank", "4",
                     "--model", str(tiny_model), "--out", str(out))
    result = json.loads(out.read_text())
    assert result["setup"] | {"model": None} == {
        "mode": "ZeRO-2", "ranks": 2, "optimizer": "foreach", "lora_rank": 4, "lora_targets": ["q_proj", "v_proj"],
        "global_batch": 8, "prompt_tokens": 34, "response_tokens": 24, "model": None}
    [step] = result["steps"]
    assert set(step) == {"forward", "backward", "optimizer", "total"} and all(v > 0 for v in step.values())
    assert "ZeRO-2 x2 foreach LoRA r4 q_proj,v_proj step 0:" in proc.stdout
