"""No orphans, no double runs: what watches a stage's job from the submitting side (launcher/submit.py).

- A launcher whose Snakemake dies (even by SIGKILL) notices that its parent changed (`Watch`), and `supervise`
  cancels the job (`cancel_job`: scancel on Slurm; on the local executor the job's whole process tree, Ray's
  sessions included), removes `<output>.partial` and an empty checkpoint directory.
- `OutputLock`: `<output>.lock` names the job producing an output; a second launch on it is refused while that job
  (or its launcher) lives, and takes over a lock whose holder is gone.
"""
import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

from runtime.checkpoints import remove_if_empty

CANCEL_GRACE_S = 5         # how long a cancelled local job may take to stop before what is left of it is killed
SLURM_CANCEL_WAIT_S = 120  # how long a launcher waits for Slurm to end a job it cancelled, before it leaves
LOCK_CANCEL_WAIT_S = 60    # how long a launch waits for another launcher that is cancelling the output's job
ACTIVE_STATES = {"READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING",
                 "CONFIGURING", "PREEMPTED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "SUSPENDED"}


class StageFailed(RuntimeError):
    pass


HOST = socket.gethostname()
SHELLS = {"sh", "bash", "dash", "zsh", "ksh"}


class Orphaned(Exception):
    """The Snakemake that started this launcher is gone (killed): nobody would take the job's output."""


class ProcStat(typing.NamedTuple):
    """A process's state letter, parent pid, process group and start time (clock ticks since boot), from /proc."""
    state: str
    ppid: int
    pgrp: int
    start: int


def proc_stat(pid: int) -> ProcStat | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _all_procs() -> dict[int, ProcStat]:
    procs = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (stat := proc_stat(int(entry.name))) is not None:
            procs[int(entry.name)] = stat
    return procs


def _alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` runs, and is the one that started at `start` (a pid may be reused); no zombies."""
    stat = proc_stat(pid)
    if stat is None:
        if Path("/proc/self/stat").exists():
            return False
        try:  # no /proc (macOS): existence is all there is to know
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.state not in ("Z", "X") and (start is None or stat.start == start)


def _process_tree(root: int, root_start: int | None) -> dict[int, ProcStat]:
    """The process `root` (if it is still the one that started at `root_start`) and all its descendants."""
    procs = _all_procs()
    if root not in procs or not _alive(root, root_start):
        return {}
    tree, todo = {root: procs[root]}, [root]
    while todo:
        parent = todo.pop()
        for pid, stat in procs.items():
            if stat.ppid == parent and pid not in tree:
                tree[pid] = stat
                todo.append(pid)
    return tree


def _kill_tree(tree: dict[int, ProcStat]) -> None:
    """SIGKILL what is left of a process tree, and of the process groups its processes lead (Ray's `ray start`
    runs in its own session; its processes may have left the tree once it died)."""
    groups = {pid for pid, stat in tree.items() if stat.pgrp == pid}
    for pid, stat in list(tree.items()) + [(p, s) for p, s in _all_procs().items() if s.pgrp in groups]:
        if _alive(pid, stat.start):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _runs_shell_command(pid: int) -> bool:
    """Whether `pid` is a shell running a `-c` command string (how Snakemake runs a rule's shell command)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return os.path.basename(argv[0].decode(errors="replace")).lstrip("-") in SHELLS and b"-c" in argv[1:]


def _supervisor_links() -> list[tuple[int, int]]:
    """(process, its parent) links from this launcher up to Snakemake: its parent, and through a rule's shell
    (`bash -c`) if one stands in between (bash usually execs the command; when it does not, the shell outlives a
    killed Snakemake, waiting on us). Any link that changes (a parent died: the child was reparented) means the
    launcher is orphaned."""
    links = [(os.getpid(), os.getppid())]
    pid = os.getppid()
    while _runs_shell_command(pid) and len(links) < 4:
        stat = proc_stat(pid)
        if stat is None or stat.ppid <= 1:
            break
        links.append((pid, stat.ppid))
        pid = stat.ppid
    return links


class Watch:
    """Who started this launcher (taken when it starts) and how the wait goes: `orphaned()`, which follow_log
    calls while it waits; `over`, set once the job ended by itself (nothing to cancel then); `signal`, one that
    stopped the wait."""

    def __init__(self):
        self.links = _supervisor_links()
        self.over = False
        self.signal = None

    def orphaned(self) -> bool:
        for pid, parent in self.links:
            now = os.getppid() if pid == os.getpid() else getattr(proc_stat(pid), "ppid", None)
            if now != parent:
                return True
        return False


def _say(text: str) -> None:
    """Print to stderr, even where nobody reads it any more (a killed Snakemake's closed pipe)."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def supervise(submitted, run_name: str, cluster: str, partial: Path, checkpoint: Path, lock: "OutputLock",
               watch: Watch):
    """While the launcher waits on its job: if Snakemake is stopped (Ctrl-C, SIGTERM, SIGHUP) or dies (the
    launcher is orphaned, which follow_log's `watch.orphaned` notices within a second), or if anything else ends
    the wait before the job ended, cancel the job and remove its partial output (and its checkpoint directory if
    the job saved nothing there) rather than leave the job running unsupervised."""
    def stop(signum, frame):
        watch.signal = signum
        raise SystemExit(128 + signum)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    except BaseException as err:
        if watch.over:
            raise
        for sig in signals:  # a second Ctrl-C must not cut the cancelling short
            signal.signal(sig, signal.SIG_IGN)
        if isinstance(err, Orphaned):
            why = "the Snakemake that started this launcher is gone"
        elif watch.signal is not None:
            why = f"interrupted ({signal.Signals(watch.signal).name})"
        else:
            why = f"the launcher stopped waiting ({type(err).__name__}: {err})"
        _say(f"[alignpipe] {run_name}: {why}; cancelling job {submitted.job_id}")
        lock.cancelling()
        lock.job_over = cancel_job(submitted, cluster)
        shutil.rmtree(partial, ignore_errors=True)
        if lock.job_over:
            remove_if_empty(checkpoint)  # a checkpoint it saved stays: the next run resumes from it
        if lock.output.exists() and not lock.output_existed:  # published as it was being cancelled: nobody took it
            _say(f"[alignpipe] {run_name}: removing {lock.output}, which job {submitted.job_id} published as it was "
                 f"being cancelled")
            shutil.rmtree(lock.output, ignore_errors=True)
        if not lock.job_over:
            _say(f"[alignpipe] {run_name}: job {submitted.job_id} has not ended yet; its lock {lock.path} stays "
                 f"until it has")
        if isinstance(err, Orphaned):
            raise StageFailed(f"stage {run_name}: {why}; job {submitted.job_id} was cancelled rather than left "
                              f"running unsupervised (run Snakemake again to run the stage)") from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cancel_job(submitted, cluster: str) -> bool:
    """Cancel a job and wait until it is gone; True once nothing of it runs.

    Slurm: scancel (Slurm signals, then kills, every process of the job on every node), then wait for Slurm to
    end it. Local: submitit's cancel (SIGINT to the job's controller, which interrupts its tasks and kills them a
    second later); whatever is left of the job's process tree after CANCEL_GRACE_S (a task's own children: Ray's
    processes, in their own sessions) is killed, at once where the job ignores SIGINT (started in the background
    by a non-interactive shell: `nohup snakemake ... &`)."""
    if cluster == "slurm":
        with contextlib.suppress(Exception):
            submitted.cancel(check=False)
        deadline = time.time() + SLURM_CANCEL_WAIT_S
        while time.time() < deadline:
            if _slurm_job_active(submitted.job_id) is False:
                return True
            time.sleep(2)
        return False
    root = int(submitted.job_id)
    root_start = getattr(proc_stat(root), "start", None)
    tree = _process_tree(root, root_start)
    with contextlib.suppress(Exception):
        submitted.cancel(check=False)
    deadline = time.time() + (0 if _ignores_sigint(root) else CANCEL_GRACE_S)
    while time.time() < deadline:
        with contextlib.suppress(Exception):
            submitted._process.poll()  # reap the controller, a child of this launcher, once it has exited
        tree.update(_process_tree(root, root_start))
        alive = [pid for pid, stat in tree.items() if _alive(pid, stat.start)]
        if not alive:
            return True
        if root not in alive:  # the controller is done: what it left has had its chance to stop
            deadline = min(deadline, time.time() + 2)
        time.sleep(0.2)
    _kill_tree(tree)
    time.sleep(0.5)
    with contextlib.suppress(Exception):
        submitted._process.poll()
    return not any(_alive(pid, stat.start) for pid, stat in tree.items())


def _ignores_sigint(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    ignored = re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M)
    return bool(ignored and int(ignored.group(1), 16) & (1 << (signal.SIGINT - 1)))


def _slurm_job_active(job_id) -> bool | None:
    """Whether Slurm still queues or runs a job: True, False, or None when squeue does not tell."""
    try:
        proc = subprocess.run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"], capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode == 0:
        return any(line.strip() in ACTIVE_STATES for line in proc.stdout.splitlines())
    return False if "Invalid job id" in proc.stderr else None


@contextlib.contextmanager
def _locked_dir(directory: Path):
    """Serialise lock-file changes in `directory` among launchers (flock on the directory; where the file
    system has no flock, the lock file's atomic creation is all there is)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _job_alive(holder: dict) -> bool:
    """Whether the job a lock names still runs (what cannot be checked from here counts as running)."""
    job_id = holder.get("job_id")
    if job_id is None:
        return False
    if holder.get("cluster") == "slurm":
        return _slurm_job_active(job_id) is not False
    return holder.get("host") != HOST or _alive(int(job_id), holder.get("job_started"))


def _holder_alive(holder: dict) -> bool:
    """Whether the launcher or the job that holds a lock still runs."""
    if "launcher_pid" not in holder:
        return True  # not a lock this launcher wrote: leave it to a person
    if holder.get("host") == HOST:
        if _alive(holder["launcher_pid"], holder.get("launcher_started")):
            return True
    elif holder.get("job_id") is None or holder.get("cluster") != "slurm":
        return True  # a launcher or local job on another host: not visible from here
    return _job_alive(holder)


class OutputLock:
    """`<output>.lock`, held while a launcher produces an output: JSON naming the job (id, cluster, its start time
    on this host), the host and the launcher's pid (with its start time: a pid may be reused) and a state
    (submitting, running, cancelling). Created atomically (link of a complete file), changed under a flock of the
    directory; another launch on the same output is refused while its holder lives (and waits up to
    LOCK_CANCEL_WAIT_S for one being cancelled); a lock whose holder is gone is taken over."""

    def __init__(self, output: Path, run_name: str):
        self.output, self.run_name = output, run_name
        self.path = output.with_name(output.name + ".lock")
        self.info: dict | None = None
        self.job_over = False
        self.output_existed = False

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _read(self) -> dict | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
            return holder if isinstance(holder, dict) else {}
        except ValueError:
            return {}

    def _write(self, info: dict, create: bool = False) -> bool:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info, indent=1))
        try:
            if create:
                os.link(tmp, self.path)  # atomic, and fails if a lock is there (on NFS too)
            else:
                os.replace(tmp, self.path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self.info = info
        return True

    def acquire(self) -> None:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        mine = {"run_name": self.run_name, "state": "submitting", "job_id": None, "cluster": None, "host": HOST,
                "launcher_pid": os.getpid(), "launcher_started": getattr(proc_stat(os.getpid()), "start", None),
                "since": datetime.datetime.now().isoformat(timespec="seconds")}
        waiting_since = None
        while True:
            with _locked_dir(self.output.parent):
                holder = self._read()
                if holder is None:
                    if self._write(mine, create=True):
                        self.output_existed = self.output.exists()
                        return
                    continue
                if not _holder_alive(holder):
                    _say(f"[alignpipe] {self.run_name}: taking over {self.path}: its job "
                         f"{holder.get('job_id')} and launcher (pid {holder.get('launcher_pid')} on "
                         f"{holder.get('host')}) are gone")
                    self._write(mine)
                    self.output_existed = self.output.exists()
                    return
            if holder.get("state") != "cancelling" or \
                    (waiting_since is not None and time.time() - waiting_since > LOCK_CANCEL_WAIT_S):
                raise StageFailed(self.refusal(holder))
            if waiting_since is None:
                waiting_since = time.time()
                print(f"[alignpipe] {self.run_name}: job {holder.get('job_id')}, which was producing {self.output}, "
                      f"is being cancelled; waiting for it to end", flush=True)
            time.sleep(0.5)

    def refusal(self, holder: dict) -> str:
        if "launcher_pid" not in holder:
            return (f"stage {self.run_name} was not started: {self.output} is locked by {self.path}, which is not "
                    f"a lock this launcher can read; remove it if no job is producing that output")
        job_id, cluster = holder.get("job_id"), holder.get("cluster")
        how = f"`scancel {job_id}`" if cluster == "slurm" else \
            f"`kill {job_id}` on {holder.get('host')}" if job_id else f"`kill {holder.get('launcher_pid')}`"
        return (f"stage {self.run_name} was not started: job {job_id or '(being submitted)'} is producing "
                f"{self.output} ({cluster or 'submitting'} job on {holder.get('host')}, launcher pid "
                f"{holder.get('launcher_pid')}, {holder.get('state')} since {holder.get('since')}; lock "
                f"{self.path}). Wait for it to end, or stop it ({how}); once it is gone, run again: the lock is then "
                f"taken over (Snakemake's --unlock does not remove it)")

    def holds(self, job_id, cluster: str, log_dir: Path) -> None:
        """Record the submitted job in the lock."""
        started = getattr(proc_stat(int(job_id)), "start", None) if cluster == "local" else None
        self._update(state="running", job_id=str(job_id), cluster=cluster, job_started=started, log_dir=str(log_dir))

    def cancelling(self) -> None:
        self._update(state="cancelling")

    def _update(self, **changes) -> None:
        if self.info is None:
            return
        with contextlib.suppress(OSError), _locked_dir(self.output.parent):
            self._write(self.info | changes)

    def release(self) -> None:
        """Remove the lock, unless its job may still run (a cancel that has not finished): then it stays, and the
        next launch takes it over once that job is gone."""
        if self.info is None:
            return
        with _locked_dir(self.output.parent):
            holder = self._read() or {}
            if (holder.get("host"), holder.get("launcher_pid")) != (HOST, os.getpid()):
                return  # no longer ours
            if not self.job_over and _job_alive(holder):
                return
            self.path.unlink(missing_ok=True)
        self.info = None


# Slurm states of a job that is not over yet (submitit's list, plus the rarer transitional ones).
