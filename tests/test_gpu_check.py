"""The GPU check (tests/gpu/check_training.py) in its CPU mode, so that its code path keeps working where CI has no
GPU: every training worker set up by its stage's Config, a few DeepSpeed steps with finite losses, the ZeRO-3 gather
against the exported model, the JSON report; all with Ray hidden behind the placeholder, so any Ray call in the
check fails here."""
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

@pytest.mark.e2e  # six processes with DeepSpeed: about a minute on 2 cores
def test_cpu_mode_runs_every_worker(tmp_path):
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
    for name, entry in report["workers"].items():
        run = entry["check"]
        assert "error" not in run, (name, run.get("error"), run.get("log_tail"))
        assert run["ray"].startswith("placeholder") and run["ray_used"] == []
        assert run["backend"] == "gloo" and run["precision"] == "fp32"
        assert run["gradient_checkpointing"] is True
        assert run["zero3_partitioned"] == (entry["zero_stage"] == 3)
        assert run["zero3_config_at_start"] is False  # no HfDeepSpeedConfig leaks between workers
        assert len(run["steps"]) == report["sizes"]["tiny"]["steps"]
        for step in run["steps"]:
            assert step["stats"] and all(math.isfinite(v) for v in step["stats"].values()), (name, step)
            assert step["seconds"] > 0 and step["tokens"] >= step["real_tokens"] > 0
        assert set(entry["compared"]) <= set(run["steps"][0]["stats"])
        assert entry["comparison"]["ok"]
        assert entry["performance"]["tokens_per_s"] > 0 and entry["performance"]["mfu"] is None
    assert {n for n, e in report["workers"].items() if e["zero_stage"] == 3} >= {"policy"}
    gather = report["workers"]["policy"]["check"]["gather"]
    assert gather["ok"], gather
    assert gather["partitioned_outside_gather"] and gather["partitioned_params"] > 0
    assert gather["tensors"] > 0 and gather["seconds"] > 0 and not gather["value_mismatches"]


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
