"""The stall watch (runtime/progress.py): a stage whose progress stops prints every process's Python stacks into its
log and fails with its job id and the place it hung, within its limit; the launcher submits it once more where
launcher.requeue_stalled allows it. In small Python processes and a base_model job; a reward function that hangs
inside a real RL stage: tests/test_stall_watch_rl.py."""
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.config import REPO_ROOT
from runtime.progress import STALL_EXIT_CODE, STALL_MARK, STEP_FACTOR, stall_limit
from test_orphans_and_locks import base_model_job, launcher_command

LIMIT_MIN = 0.05  # 3 s


def run_watched(tmp_path: Path, body: str, grace_s: float = 30) -> subprocess.CompletedProcess:
    """Run `body` (which defines `stuck()`) under a StallWatch of LIMIT_MIN in a Python process of its own."""
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""
        import os, signal, subprocess, sys, time
        from runtime.progress import StallWatch, beat
        """) + textwrap.dedent(body) + textwrap.dedent(f"""
        with StallWatch({LIMIT_MIN}, "rl/test", "1234", grace_s={grace_s}):
            beat("warm-up")
            beat("step 1/9")
            stuck()
        """))
    return run_script(script)


def run_script(script: Path) -> subprocess.CompletedProcess:
    """The Python script in a process of its own, with the project on its path."""
    return subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})


def test_the_limit_grows_with_the_slowest_step():
    assert stall_limit(1800, 0) == 1800
    assert stall_limit(1800, 600) == STEP_FACTOR * 600


# Task 1 of a multi-node job, as runtime/ray_cluster.py runs it: it serves its Ray node (here a Python child that
# waits) until the head's port closes, and answers task 0's request for its node's stacks.
TASK_1 = """
import subprocess, sys
from pathlib import Path
from runtime.ray_cluster import _serve_until_head_leaves
node = subprocess.Popen([sys.executable, "-c", "import time\\ndef node_actor_waits(): time.sleep(600)\\nnode_actor_waits()"])
try:
    _serve_until_head_leaves(node, "127.0.0.1", int(sys.argv[1]), Path("/dev/null"), Path(sys.argv[2]), rank=1)
finally:
    node.kill()
"""


def test_a_stalled_driver_fails_with_its_stacks_the_place_and_the_job_id(tmp_path):
    # The stage's Python child (as Ray's actors are) waits too: its stack is in the dump as well. So does the node of
    # the job's task 1, whose stacks come through the tasks' shared folder (ray_cluster.ask_nodes_for_stacks).
    (tmp_path / "task1.py").write_text(TASK_1)
    (tmp_path / "shared").mkdir()
    done = run_watched(tmp_path, f"""
        import socket
        from pathlib import Path
        from runtime.progress import on_stall
        from runtime.ray_cluster import ask_nodes_for_stacks
        head = socket.create_server(("127.0.0.1", 0))
        subprocess.Popen([sys.executable, "{tmp_path / 'task1.py'}", str(head.getsockname()[1]), "{tmp_path / 'shared'}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        other_nodes = on_stall(lambda: ask_nodes_for_stacks(Path("{tmp_path / 'shared'}"), [1, 2], timeout_s=10))
        other_nodes.__enter__()
        """ + """
        def stuck():
            child = subprocess.Popen([sys.executable, "-c", "import time\\ndef actor_waits(): time.sleep(600)\\nactor_waits()"])
            try:
                time.sleep(600)  # the driver's wait
            finally:
                child.kill()
        """)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "RuntimeError: stage rl/test (job 1234) stalled" in done.stderr, out[-3000:]
    message = re.search(re.escape(STALL_MARK) + r" (.*)", out).group(1)
    script = tmp_path / "stuck.py"
    assert message.startswith("stage rl/test (job 1234) stalled: no progress for ")
    assert "last progress: step 1/9" in message
    assert f"the driver waits at {script}:" in message and "in stuck (time.sleep(600)" in message, message
    idle = float(re.search(r"no progress for ([\d.]+) min", message).group(1))
    assert LIMIT_MIN <= idle <= LIMIT_MIN + 0.05, message  # within the limit and one poll (a quarter of the limit)
    driver = out[out.index("--- Python stacks of the driver"):]
    assert f'File "{script}", line' in driver and "stuck" in driver
    child = out[out.index("--- Python stacks of process"):]
    assert "actor_waits" in child, child[:2000]
    task_1 = out[out.index("--- the processes of task 1's node ---"):out.index("--- the processes of task 2's node")]
    assert "node_actor_waits (<string>:2)" in task_1, task_1[:3000]  # its frame, as py-spy shows it
    assert "(task 2 did not answer within 10 s" in out  # (a task that never answers: task 0 goes on)
    assert out.index("did not answer") < out.index(STALL_MARK)


def test_a_driver_that_cannot_be_interrupted_exits_after_the_grace(tmp_path):
    done = run_watched(tmp_path, """
        def stuck():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # as a thread stuck in native code
            time.sleep(600)
        """, grace_s=1)
    out = done.stdout + done.stderr
    assert done.returncode == STALL_EXIT_CODE, out[-3000:]
    assert STALL_MARK in out and "did not end within 1 s of being told to" in out


def test_a_stall_whose_interruption_is_lost_still_fails_the_stage_before_it_publishes(tmp_path):
    """The watch's interruption of the driver can be lost (it once landed in MLflow's import, and the stage went on
    to finish within the grace): a stage that the watch declared stalled fails all the same, with nothing published."""
    script = tmp_path / "lost.py"
    script.write_text(textwrap.dedent(f"""
        import time, types
        from pathlib import Path
        from runtime import progress, tracking
        from runtime.job import StageJob
        from runtime.progress import StallWatch, beat

        def run(cfg, inputs, output, tracker):
            (output / "model.txt").write_text("trained")
            beat("trained")
            while not progress._watch.stalled.wait(0.1):
                pass
            try:
                time.sleep(5)  # the watch interrupts this wait ...
            except BaseException:
                pass  # ... and the interruption is lost

        stage = types.SimpleNamespace(Config=types.SimpleNamespace(from_params=lambda params: None), run=run)
        out = Path("{tmp_path}")
        job = StageJob(stage="base_model", run_name="base_model", params={{"seed": 0}}, inputs={{}},
                       output=str(out / "base_model"), experiment="lost", tracking_uri=f"sqlite:///{{out}}/mlflow.db",
                       resources={{"cluster": "local"}}, checkpoint_dir=str(out / "checkpoint"), hub_downloads=False)
        with tracking.stage_run(job.tracking_uri, "lost", "warm-up", {{}}):
            pass  # the store's tables made, MLflow imported: the stage starts within the limit
        with StallWatch({LIMIT_MIN}, "base_model", "1234", grace_s=60):
            job.run_driver(stage)
        print("published")
        """))
    done = run_script(script)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "RuntimeError: stage base_model (job 1234) stalled" in done.stderr, out[-3000:]
    assert STALL_MARK in out and "published" not in done.stdout
    assert "last progress: trained" in out and f"the driver waits at {script}:" in out, out[-3000:]
    assert not (tmp_path / "base_model").exists() and not (tmp_path / "base_model.partial").exists()


@pytest.mark.e2e
def test_a_job_that_stalls_twice_fails_after_one_requeue(tmp_path):
    """The base_model stage under a limit shorter than its start-up: it stalls, is submitted once more, stalls
    again, and the launcher fails with the job's report."""
    job, job_io, output = base_model_job(tmp_path, "stalls")
    job_io["context"]["launcher"] |= {"stall_min": 0.01, "requeue_stalled": True}
    log = tmp_path / "stalls.log"
    done = subprocess.run(launcher_command(job, job_io, output, log), cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert out.count("stalled; submitted once more (launcher.requeue_stalled)") == 1, out[-3000:]
    assert len(re.findall(r"job \d+ submitted", out)) == 2
    assert "stage base_model failed: job" in out and out.count(STALL_MARK) >= 2
    assert not output.exists() and not output.with_name("base_model.partial").exists()
    assert not output.with_name("base_model.lock").exists()
