"""The one-GPU check (tests/gpu/check_training.py) in its CPU mode, so that its code path keeps working where CI has
no GPU: every training worker set up by its stage's Config, a few DeepSpeed steps with finite losses, and each of the
report's `checks` that a CPU can run (the ZeRO-3 policy's offload / reload with identical losses, the frozen scorers
at zero_stage 3, the per-module gather against save_hf's export, token log-probs at a 128k vocabulary), the others
reported as skipped or not measured with their reason; all with Ray hidden behind the placeholder, so any Ray call in
the check fails here."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "gpu" / "check_training.py"
WORKERS = {"sft", "reward", "dpo", "policy", "critic"}
CHECKS = {"offload_reload", "frozen_zero3", "sleep_cycle", "tempered_logprobs", "cuda_ipc", "save_hf_peak",
          "logprobs_128k", "steps_vs_fp32", "mfu"}


@pytest.mark.e2e  # six processes with DeepSpeed, two at a time: 46 s on 2 shared cores
def test_cpu_mode_runs_every_worker_and_check(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ, ALIGNPIPE_GPU_CHECK_FAKE_RAY="1", CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    print(f"check_training.py --cpu: {seconds:.0f} s")
    assert report["passed"] and not report["failures"]
    assert report["mode"] == "cpu"
    assert report["ray"].startswith("placeholder"), report["ray"]
    assert set(report["workers"]) == WORKERS
    steps = report["sizes"]["tiny"]["steps"]
    for name, entry in report["workers"].items():
        run = entry["tiny"]
        assert "error" not in run, (name, run.get("error"), run.get("log_tail"))
        assert run["ray"].startswith("placeholder") and run["ray_used"] == []
        assert run["backend"] == "gloo" and run["precision"] == "fp32"
        assert run["gradient_checkpointing"] is True
        assert run["zero3_partitioned"] == (entry["zero_stage"] == 3)
        assert run["zero3_config_at_start"] is False  # no HfDeepSpeedConfig leaks between workers
        assert len(run["steps"]) == steps
        for step in run["steps"]:
            assert step["stats"] and all(math.isfinite(v) for v in step["stats"].values()), (name, step)
            assert step["seconds"] > 0 and step["tokens"] >= step["real_tokens"] > 0
        assert set(entry["compared"]) <= set(run["steps"][0]["stats"])
        assert entry["comparison"]["ok"] and len(entry["comparison"]["steps"]) == steps  # (the run against itself)
        assert entry["performance"]["tokens_per_s"] > 0 and entry["performance"]["mfu"] is None

    checks = report["checks"]
    assert set(checks) == CHECKS
    assert {name: check["status"] for name, check in checks.items()} == {
        "offload_reload": "passed", "frozen_zero3": "passed", "save_hf_peak": "passed", "logprobs_128k": "passed",
        "sleep_cycle": "passed", "tempered_logprobs": "passed", "cuda_ipc": "skipped", "steps_vs_fp32": "skipped",
        "mfu": "skipped"}
    # rl.vllm.sleep: each of the four generations saw the policy's current weights (level 2 discarded them)
    assert checks["sleep_cycle"]["results"]["tiny"]["weights_current"] == [True] * 4
    for name, check in checks.items():
        assert check["what"] and (check["status"] != "skipped" or check["reason"]), name
    assert "GPU" in checks["cuda_ipc"]["reason"] and "--cpu" in checks["steps_vs_fp32"]["reason"]
    for name in ("offload_reload", "frozen_zero3", "sleep_cycle", "save_hf_peak", "logprobs_128k"):  # only CUDA's
        assert all("CUDA" in reason for reason in checks[name]["not_measured"].values()), name

    # rl.vllm.sleep: the fp32 master weights and AdamW's states leave for host memory and come back before every
    # step, DeepSpeed moves the gradient buffers, and the offloaded policy trains exactly as the plain one.
    offload = checks["offload_reload"]["results"]["tiny"]
    assert offload["identical"] and offload["trained"] and len(offload["cycles"]) == steps
    assert all(c["on_host"] and c["back"] and c["pinned"] is None for c in offload["cycles"])
    assert {"lp_grads", "contiguous_grad_buffer"} <= set(offload["cycles"][-1]["deepspeed_offloaded"])
    moved = [c["moved_bytes"] for c in offload["cycles"]]
    assert 0 < moved[0] < moved[1]  # AdamW makes its states at the first step
    assert [s["policy_loss"] for s in offload["offloaded_steps"]] == [s["policy_loss"] for s in offload["plain_steps"]]

    # The frozen reference and reward model at zero_stage 3 and one rank: whole models, finite scores, and the
    # reference's log-probs are the policy's before its first update (through its ZeRO-3 engine).
    frozen = checks["frozen_zero3"]["results"]["tiny"]
    assert frozen["zero_stage"] == 3 and frozen["world_size"] == 1
    for scorer in (frozen["reference"], frozen["reward_model"]):
        assert scorer["finite"] and scorer["sharded"] is False and scorer["seconds"] > 0
    assert frozen["policy_agreement"]["max_abs_diff"] <= frozen["policy_agreement"]["atol"] == 1e-4

    gather = report["workers"]["policy"]["tiny"]["gather"]
    assert gather["ok"], gather
    assert gather["partitioned_outside_gather"] and gather["partitioned_params"] > 0
    assert gather["tensors"] > 0 and gather["seconds"] > 0 and not gather["value_mismatches"]
    save_hf = checks["save_hf_peak"]["results"]["tiny"]
    assert 0 < save_hf["largest_module_bytes"] < save_hf["model_bytes"] and save_hf["seconds"] > 0

    logprobs = checks["logprobs_128k"]["results"]["logprobs"]
    assert logprobs["shape"]["vocab"] == 128256
    assert logprobs["shape"]["positions"] * logprobs["shape"]["vocab"] * 4 > logprobs["chunk_bytes"]  # several chunks
    for label in ("chunked", "unchunked"):
        assert all(logprobs[label][mode]["seconds"] > 0 for mode in ("forward", "forward_backward"))
    assert all(logprobs["max_abs_diff"][k] <= logprobs["tolerance"][k] for k in ("logprobs", "grad"))


def test_ray_placeholder_fails_on_use():
    """With the placeholder forced, the workers' modules import and any Ray use raises (in a fresh interpreter: this
    pytest process may have the real Ray loaded)."""
    code = """
import sys
sys.path.insert(0, "tests/gpu")
import ray_placeholder
assert ray_placeholder.install().startswith("placeholder")
import runtime.rl_actors, runtime.weight_sync, stages.sft, stages.reward_model, stages.dpo, stages.rl
import ray
from runtime.deepspeed_strategy import DeepSpeedWorker
assert ray_placeholder.is_placeholder(ray)
try:
    DeepSpeedWorker().rendezvous_address()
except ray_placeholder.RayUnavailable as err:
    print(err)
else:
    raise SystemExit("no error")
try:
    ray.get([])
except ray_placeholder.RayUnavailable:
    pass
print(ray_placeholder.USED)
"""
    env = dict(os.environ, ALIGNPIPE_GPU_CHECK_FAKE_RAY="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Ray is not available in the GPU check: ray.util.get_node_ip_address was called" in proc.stdout
    assert "['ray.util.get_node_ip_address', 'ray.get']" in proc.stdout
