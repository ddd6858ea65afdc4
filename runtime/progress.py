"""Progress of a stage: a periodic line for long loops (step, rate, ETA, the latest metrics), and the stall watch.

A hung collective, weight sync or reward function would otherwise hold the job's allocation until its time limit
with nothing in its log. `StallWatch` runs beside the stage's driver: every finished step (`Progress.update`, or a
stage's own `beat`) is progress. When none comes for the watch's limit (launcher.stall_min, or STEP_FACTOR times the
slowest step so far where that is longer: a stage whose steps take an hour is not stalled after 30 minutes), it
prints the Python stacks of the driver's threads and of every Python process the job started on this node (Ray's
actors included; py-spy) and, in a multi-node job, those of the other nodes (runtime/ray_cluster.py asks their tasks
for them), then fails the stage with the job id and the place the driver waits. The launcher submits
a stalled stage once more where launcher.requeue_stalled allows it (launcher/submit.py).
"""
import contextlib
import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

STALL_MARK = "[alignpipe] STALLED:"  # the launcher recognises a stalled job's log by it
STEP_FACTOR = 4         # the limit grows to this many times the slowest step seen
EXIT_GRACE_S = 60       # after the stage is told to fail: how long its clean-up may take before the process exits
STALL_EXIT_CODE = 75
DUMP_TIMEOUT_S = 30     # one process's py-spy dump


class Progress:
    def __init__(self, name: str, total: int, every_s: float = 10.0):
        self.name, self.total, self.every_s = name, total, every_s
        self.start = self.last_print = time.time()

    def update(self, step: int, **metrics) -> None:
        """Call after finishing `step` (1-based); prints at most every `every_s` seconds, and at the end."""
        beat(f"{self.name} step {step}/{self.total}", step=True)
        now = time.time()
        if step < self.total and now - self.last_print < self.every_s and step != 1:
            return
        self.last_print = now
        per_step = (now - self.start) / step
        eta = per_step * (self.total - step)
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        print(f"[{self.name}] step {step}/{self.total} ({100 * step / self.total:.0f}%) {shown} | "
              f"{per_step:.2f} s/step | ETA {int(eta // 60)}m{int(eta % 60):02d}s", flush=True)


class StageStalled(BaseException):
    """Raised in the driver's main thread when its stage made no progress for the stall watch's limit: not an
    Exception, so that no `except Exception` of the stage or of a library takes it for an error it may retry or log
    and go on. The watch's context turns it into a RuntimeError as it leaves (submitit stores those as the job's)."""


_watch = None  # the StallWatch of the stage running in this process, if any
_stall_hooks: list = []  # what a stalled watch runs after dumping this node's stacks (`on_stall`)


@contextlib.contextmanager
def on_stall(hook):
    """Within this context a stall also runs `hook()` before the stage is failed (the other nodes' stacks)."""
    _stall_hooks.append(hook)
    try:
        yield
    finally:
        _stall_hooks.remove(hook)


def beat(what: str, step: bool = False) -> None:
    """Progress: `what` was just done: a training step (`step`), or a milestone of the stage's start-up such as its
    Ray cluster being up (whose time is not a step's). A no-op where no stall watch runs."""
    if _watch is not None:
        _watch.beat(what, step)


def raise_if_stalled() -> None:
    """Raise the stall that the watch declared, if it did. Its interruption of the driver's main thread can be lost
    (it landed in MLflow's import and the stage went on), and a stalled stage must not publish its output."""
    if _watch is not None and _watch.stalled.is_set():
        raise StageStalled(_watch.message)


def stall_limit(base_s: float, slowest_step_s: float) -> float:
    return max(base_s, STEP_FACTOR * slowest_step_s)


class StallWatch:
    """Fail the stage run inside this context (in the main thread) when no `beat` comes for `stall_limit`."""

    def __init__(self, limit_min: float, run_name: str, job_id: str, grace_s: float = EXIT_GRACE_S):
        self.base_s, self.run_name, self.job_id, self.grace_s = limit_min * 60, run_name, job_id, grace_s
        self.last = time.monotonic()
        self.last_what, self.last_step, self.slowest, self.stalled = "the stage started", None, 0.0, threading.Event()
        self.message = f"stage {run_name} (job {job_id}) stalled"  # (with its place once the watch has found it)
        self._over = threading.Event()
        self._main = threading.main_thread().ident

    def beat(self, what: str, step: bool) -> None:
        now = time.monotonic()
        if step:  # the time between two steps (the first step's also holds the start-up: not a step's time)
            if self.last_step is not None:
                self.slowest = max(self.slowest, now - self.last_step)
            self.last_step = now
        self.last, self.last_what = now, what

    def __enter__(self) -> "StallWatch":
        global _watch
        if self.base_s > 0:
            self._previous = signal.signal(signal.SIGUSR1, self._raise)
            _watch = self
            threading.Thread(target=self._watch, name="stall-watch", daemon=True).start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _watch
        if self.base_s > 0:
            _watch = None
            signal.signal(signal.SIGUSR1, self._previous)
            if not self.stalled.is_set():  # a stalled stage's process exits within the grace, however its end goes
                self._over.set()
        if exc_type is StageStalled:
            raise RuntimeError(str(exc)) from None

    def _raise(self, signum, frame):
        raise StageStalled(self.message)

    def _watch(self) -> None:
        while not self._over.wait(min(10.0, self.base_s / 4)):
            idle, limit = time.monotonic() - self.last, stall_limit(self.base_s, self.slowest)
            if idle > limit:
                self._stalled(idle, limit)
                return

    def _stalled(self, idle: float, limit: float) -> None:
        self.stalled.set()
        where = driver_place(sys._current_frames().get(self._main))
        self.message = (f"stage {self.run_name} (job {self.job_id}) stalled: no progress for {idle / 60:.2f} min "
                        f"(limit {limit / 60:.2f} min: launcher.stall_min, or {STEP_FACTOR}x the slowest step); last "
                        f"progress: {self.last_what}; the driver waits at {where}. Every process's Python stacks are "
                        "in the job's log above this line")
        print(f"\n[alignpipe] {self.run_name}: no progress for {idle / 60:.2f} min; the Python stacks of the driver's "
              f"threads and of the job's processes on each node follow", flush=True)
        dump_stacks()
        for hook in list(_stall_hooks):
            hook()
        print(f"{STALL_MARK} {self.message}", flush=True)
        signal.pthread_kill(self._main, signal.SIGUSR1)  # interrupts a blocking call of the main thread
        if not self._over.wait(self.grace_s):
            print(f"[alignpipe] {self.run_name}: the stalled stage did not end within {self.grace_s:.0f} s of being "
                  f"told to; its process exits now (status {STALL_EXIT_CODE})", flush=True)
            os._exit(STALL_EXIT_CODE)


def driver_place(frame) -> str:
    """file:line in function of the innermost frame of the stage's own code (the repository's, or a user's file
    such as a reward function), else the innermost frame."""
    stack = traceback.extract_stack(frame) if frame is not None else []
    if not stack:
        return "(unknown)"
    libraries = tuple({sys.prefix, sys.base_prefix, os.path.dirname(os.__file__)})
    own = [f for f in stack if not f.filename.startswith(libraries) and not f.filename.startswith("<")]
    f = (own or stack)[-1]
    return f"{f.filename}:{f.lineno} in {f.name} ({(f.line or '').strip()})"


def dump_stacks() -> None:
    """The stacks of this process's threads (faulthandler), then those of the Python processes it started (py-spy)."""
    sys.stdout.flush()
    print("--- Python stacks of the driver (this process) ---", flush=True)
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    process_stacks(os.getpid(), sys.stdout)


def process_stacks(root: int, out) -> None:
    """Write the stacks of the Python processes below `root` to `out` (py-spy)."""
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for pid in python_descendants(root):
        cmdline = _cmdline(pid)
        print(f"--- Python stacks of process {pid} on {socket.gethostname()}: {cmdline[:200]} ---", file=out, flush=True)
        if spy is None:
            print("(py-spy is not installed: `pip install py-spy` to see them)", file=out, flush=True)
            break
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=DUMP_TIMEOUT_S, stdin=subprocess.DEVNULL)
            print((done.stdout + done.stderr).strip(), file=out, flush=True)


def python_descendants(root: int) -> list[int]:
    """The Python processes below `root` (Ray's actors and workers, vLLM's and DeepSpeed's helpers), but Ray's own
    daemons (log monitor, dashboard agents, `ray start`), whose stacks say nothing of the stage."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        todo += children.get(pid, [])
        cmdline = _cmdline(pid)
        with contextlib.suppress(OSError):
            is_python = "python" in Path(os.readlink(f"/proc/{pid}/exe")).name
            if cmdline.startswith("ray::") or (is_python and "/ray/" not in cmdline and "/bin/ray " not in cmdline):
                found.append(pid)
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return ""
