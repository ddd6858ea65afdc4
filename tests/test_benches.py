"""The benches stay alive: each runs its own code path (the stage Configs from the schema's defaults, alignpipe's
trainer actors, vLLM, the results file) as `make bench-*` does, but for one step on the schema's tiny model.
Measures nothing (docs/benchmarks.md). TRL's side needs the bench-only extra (bench/requirements.txt), which the
test environment does not have: `--sides alignpipe`."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.models import cpu_bf16_flags

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
    """GRPO's bench: its asynchronous side, two steps so that a rollout is generated ahead (the plain and packed
    sides run the same path with one setting changed: test_every_grpo_bench_side_is_a_valid_rl_config)."""
    out = tmp_path / "result.json"
    sides, steps = (["alignpipe-async"], 2) if script == "grpo_throughput.py" else (["alignpipe"], 1)
    run_bench(script, "--tiny", "--steps", str(steps), "--warmup", "0", "--sides", ",".join(sides), "--model",
              str(tiny_model), "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result) == {*sides, "setup", "machine"}
    assert result["machine"]["cores"] >= 1 and set(result["machine"]["native_bf16"]) <= {"amx_bf16", "avx512_bf16"}
    assert all(rate > 0 for rate in result["machine"]["matmul_gflops"].values())
    assert result["setup"]["steps"] == steps and result["setup"]["warmup_steps_excluded"] == 0
    for side in map(result.get, sides):
        assert len(side["step_seconds"]) == steps and all(seconds > 0 for seconds in side["step_seconds"])
        assert side["steady_seconds_per_step"] == pytest.approx(sum(side["step_seconds"]) / steps) and side[rate] > 0
        if script == "grpo_throughput.py":  # each phase of the rl stage's step was timed
            assert set(side["phase_seconds"]) == {"generate", "make_experience", "train", "weight_sync"}
            assert all(seconds > 0 for seconds in side["phase_seconds"].values())
            assert side["train_gflops"] > 0
        else:  # DPO's step is all training: its rate
            assert side["train_gflops"] > 0


@pytest.mark.skipif(not cpu_bf16_flags(), reason="this CPU has no native bf16 (AMX or AVX-512 BF16)")
def test_the_grpo_bench_runs_in_bf16_on_a_cpu_with_native_bf16(tmp_path, tiny_model):
    """`--precision bf16`: the rl stage's machinery with fp32 weights under bf16 autocast (the trainers and frozen
    models on a CPU) and a bf16 vLLM engine, for one step."""
    out = tmp_path / "result.json"
    run_bench("grpo_throughput.py", "--tiny", "--steps", "1", "--warmup", "0", "--sides", "alignpipe", "--precision",
              "bf16", "--model", str(tiny_model), "--out", str(out))
    result = json.loads(out.read_text())
    assert result["setup"]["precision"] == "bf16" and result["alignpipe"]["train_gflops"] > 0


def test_every_grpo_bench_side_is_a_valid_rl_config(monkeypatch):
    """Each alignpipe side of GRPO's bench is the rl stage's Config with its one setting changed, as the schema
    takes it."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import grpo_throughput
    assert set(grpo_throughput.ALIGNPIPE_SIDES) == {"alignpipe", "alignpipe-async", "alignpipe-packed"}
    plain = grpo_throughput.rl_config(2, 0, 1)
    for changed in grpo_throughput.ALIGNPIPE_SIDES.values():
        cfg = grpo_throughput.rl_config(2, 0, 1, changed)
        assert {key: getattr(cfg, key) for key in changed} == changed
        assert {k: v for k, v in vars(cfg).items() if k not in changed} == \
               {k: v for k, v in vars(plain).items() if k not in changed}


def test_trl_runs_at_equal_settings_or_at_its_own_defaults(monkeypatch):
    """TRL's sides: `trl` with the keys that make its work alignpipe's (precision, no gradient checkpointing);
    `trl-defaults` with none of them (TRL's bf16 and gradient checkpointing), a default side only on a CPU with native
    bf16 (elsewhere its bf16 would be emulated)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import argparse
    import benchlib
    assert benchlib.trl_defaults(False, "bf16") == {"bf16": True, "fp16": False, "gradient_checkpointing": False}
    assert benchlib.trl_defaults(False, "fp32")["bf16"] is False and benchlib.trl_defaults(True, "fp32") == {}
    for native in ([], ["amx_bf16"]):
        monkeypatch.setattr("runtime.models.cpu_bf16_flags", lambda: native)
        parser = argparse.ArgumentParser()
        benchlib.add_common_args(parser, "b", steps=9, warmup=1)
        assert parser.parse_args([]).sides == "alignpipe,trl" + (",trl-defaults" if native else "")


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
