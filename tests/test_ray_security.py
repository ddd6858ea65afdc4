"""A job's Ray, locked (issue #17): token authentication with a fresh secret per job that appears on no command line
and in no log, Ray on 127.0.0.1 for a one-node local job, no E-level lines from Ray, and no Ray process left once
the job's process is gone, also after SIGKILL. What a stage's processes listen on themselves (issue #25): the
DeepSpeed ranks' rendezvous store and gloo's sockets on the node's address too.

The job's process is a subprocess that starts its node with runtime.ray_cluster.ray_cluster as runtime/job.py
does for the local executor (the JOB_ENV environment, Ray imported first as a stage module would, a stand-in for
submitit's JobEnvironment with the fields ray_cluster reads), runs one Ray task, optionally starts a group of
DeepSpeed ranks as a stage does (ActorGroup, then each rank's init_distributed: a gloo process group) and waits for a
line on stdin. As task 0 of a two-node job it shares its token by file and waits for a second node that never comes.
"""
import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import types
import uuid
from pathlib import Path

import pytest

from launcher.config import REPO_ROOT
from pipeline_helpers import wait_until
from runtime.ray_cluster import LOOPBACK_ENV, base_port, job_token, ports_free

JOB = textwrap.dedent("""
    import json, os, sys, types
    sys.path.insert(0, sys.argv[1])
    from runtime.job import JOB_ENV
    os.environ.update(JOB_ENV)
    import ray  # as a stage module would, before its cluster starts
    import runtime.ray_cluster
    from runtime.ray_cluster import ray_cluster

    nodes = int(sys.argv[4])  # with 2, task 0 of a two-node job: it shares the token by file, then waits for task 1
    ranks = int(sys.argv[5])  # DeepSpeed ranks to start, as a stage starts its trainers
    if sys.argv[6]:  # a block that its check finds free, as if it were taken just after (two heads starting at once)
        checked = runtime.ray_cluster.ports_free
        runtime.ray_cluster.ports_free = lambda base: base == int(sys.argv[6]) or checked(base)
    job_env = types.SimpleNamespace(job_id=sys.argv[2], global_rank=0, num_nodes=nodes,
                                    hostnames=["localhost"] * nodes, paths=types.SimpleNamespace(folder=sys.argv[3]))
    # (the ranks take one of the 2 CPUs: a client's task gets the other)
    res = {"cluster": "local", "cpus_per_node": 2, "gpus_per_node": 0, "mem_gb": 1, "ray_port": 0}
    with ray_cluster(job_env, res) as node:
        worker = ray.get(ray.remote(lambda: os.getpid()).remote())
        up = {"head": node.head_address, "worker": worker, "nodes": node.nodes}
        if ranks:
            from runtime.actor_group import ActorGroup
            from runtime.deepspeed_strategy import DeepSpeedWorker
            group = ActorGroup(DeepSpeedWorker, ranks, cpus_per_actor=1 / ranks)
            ray.get([actor.init_distributed.remote(r, group.rendezvous, 1) for r, actor in enumerate(group.actors)])
            up |= {"ranks": [p["pid"] for p in group.placements], "rendezvous": group.rendezvous}
        print("[test] " + json.dumps(up), flush=True)
        sys.stdin.readline()  # the test says when to stop, or SIGKILLs this process
    print("[test] stopped; RAY_AUTH_MODE=" + os.environ.get("RAY_AUTH_MODE", "") +
          " token in env: " + str("RAY_AUTH_TOKEN" in os.environ), flush=True)
""")

CLIENT = textwrap.dedent("""
    import sys, ray
    try:
        ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
        print("CONNECTED", ray.get(ray.remote(lambda: 41 + 1).remote()))
    except Exception as err:
        print("REFUSED", type(err).__name__, err)
""")

# A Ray C++ log line at level E ("[2026-12-01 02:21:56,558 E 3313 3313] (gcs_server) ..."), or its Python ERROR.
E_LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,]+ E \d+|\d{4}-\d\d-\d\d [\d:,]+\s+ERROR\s")


class Job:
    """One job's process with its Ray node, as the local executor runs it."""

    def __init__(self, root: Path, nodes: int = 1, ranks: int = 0, job_id: str | None = None,
                 free_when_checked: int | None = None):
        self.job_id = job_id or f"sec{uuid.uuid4().hex[:8]}"
        while job_id is None and nodes > 1 and not ports_free(base_port(self.job_id, 0)):
            # (a multi-node job keeps the block its id derives, as a Slurm job's tasks must agree on it: one whose
            # port is held at the moment, e.g. an outgoing connection's, failed its head once in a full make test)
            self.job_id = f"sec{uuid.uuid4().hex[:8]}"
        self.folder = root / self.job_id
        self.folder.mkdir()
        self.log = self.folder / "job.log"
        script = self.folder / "job.py"
        script.write_text(JOB)
        with self.log.open("w") as out:
            # (PYTHONPATH: Ray's workers import this checkout, not the one the environment has installed)
            self.proc = subprocess.Popen([sys.executable, str(script), str(REPO_ROOT), self.job_id, str(self.folder),
                                          str(nodes), str(ranks), str(free_when_checked or "")],
                                         stdin=subprocess.PIPE, stdout=out,
                                         stderr=subprocess.STDOUT, text=True, cwd=self.folder,
                                         env=os.environ | {"PYTHONPATH": str(REPO_ROOT)})
        ready = (lambda: re.search(r"^\[test\] (\{.*\})$", self.text(), re.M)) if nodes == 1 else \
            (lambda: "Ray runtime started" in self.ray_start_log() and "head up")
        up = wait_until(lambda: ready() or self.proc.poll() is not None, 120, "the job's Ray node")
        assert up is not True, f"the job failed:\n{self.text()[-4000:]}"
        self.up = json.loads(up.group(1)) if nodes == 1 else {}
        self.private_dir = next(Path("/tmp").glob(f"ray-{self.job_id}-0-0-*"))
        self.ray_start = next(pid for pid, cmd in processes().items() if "ray start" in cmd and
                              f"--temp-dir={self.private_dir}/" in cmd)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def ray_start_log(self) -> str:
        found = list(Path("/tmp").glob(f"ray-{self.job_id}-0-0-*/ray-start.log"))
        return found[0].read_text(errors="replace") if found else ""

    def ray_processes(self) -> dict[int, str]:
        """Processes of this job's Ray node: its `ray start`'s session, or naming its private temp dir."""
        return {pid: cmd for pid, cmd in processes().items()
                if session_of(pid) == self.ray_start or str(self.private_dir) in cmd}

    def token(self) -> str:
        environ = Path(f"/proc/{self.ray_start}/environ").read_bytes().split(b"\0")
        return next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"RAY_AUTH_TOKEN="))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        self.proc.wait(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def processes() -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return found


def listening(pids) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]]:
    """(address, port, pid) of every TCP socket that the processes `pids` listen on (/proc/net/tcp and tcp6)."""
    inodes = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words in the host's (little-endian) byte order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((ipaddress.ip_address(raw), int(port, 16), inodes[fields[9]]))
    return found


def is_loopback(address) -> bool:
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


def session_of(pid: int) -> int | None:
    try:
        state, _, _, sid = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[:4]
    except (OSError, ValueError):
        return None
    return None if state == b"Z" else int(sid)


def client(address: str, **env) -> subprocess.Popen:
    """`ray.init(address=...)` from a process of its own, with `env` for the RAY_AUTH_* variables."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.Popen([sys.executable, "-c", CLIENT, address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=base | {LOOPBACK_ENV: "0"} | env)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A one-node job whose own block of ports (derived from its id) is held while its node starts, as another job's
    head starting at the same moment on this host would hold it: taken after the job's check found it free."""
    job_id = f"sec{uuid.uuid4().hex[:8]}"
    taken = base_port(job_id, 0)
    with socket.create_server(("127.0.0.1", taken)):
        assert not ports_free(taken)
        job = Job(tmp_path_factory.mktemp("ray-security"), ranks=2, job_id=job_id, free_when_checked=taken)
    job.taken = taken
    yield job
    job.kill()


@pytest.mark.e2e
def test_unauthenticated_client_is_refused_and_the_token_connects(job):
    address = job.up["head"]
    assert address.startswith("127.0.0.1:") and [n["ip"] for n in job.up["nodes"]] == ["127.0.0.1"]
    token = job.token()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    clients = {"no token": client(address, RAY_AUTH_MODE="disabled"),
               "wrong token": client(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
               "the job's token": client(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)}
    out = {name: proc.communicate(timeout=120)[0] for name, proc in clients.items()}
    for name in ("no token", "wrong token"):
        assert "REFUSED" in out[name] and "CONNECTED" not in out[name], out[name][-3000:]
        assert "InvalidAuthToken" in out[name] or "Unauthenticated" in out[name], out[name][-3000:]
    assert "CONNECTED 42" in out["the job's token"], out["the job's token"][-3000:]


@pytest.mark.e2e
def test_a_block_of_ports_in_use_on_the_host_is_passed_over(job):
    """Two jobs on one host whose ids derive the same block (two DAGs at once), the second's check passing before the
    first's head bound its ports (in a full test run): the second's head fails there and it starts on a free block."""
    port = int(job.up["head"].rsplit(":", 1)[1])
    assert port != job.taken and port % 100 == 0 and 20000 <= port < 60000, (port, job.taken)
    assert f"a port of the block at {job.taken} was taken while the head started" in job.text()


@pytest.mark.e2e
def test_token_on_no_command_line_and_in_no_log(job):
    token = job.token()
    assert not [pid for pid, cmd in processes().items() if token in cmd]
    logs = [p for p in job.private_dir.rglob("*") if p.is_file() and not p.is_socket()]
    assert any(p.name == "ray-start.log" for p in logs) and any(p.name == "raylet.out" for p in logs)
    assert not [str(p) for p in logs if token.encode() in p.read_bytes()]
    assert token not in job.text()


@pytest.mark.e2e
def test_ray_stays_on_loopback_in_a_private_dir(job):
    """Every socket a Ray process of a one-node local job listens on is bound to 127.0.0.1, Ray's own on a port of
    the job's own range (no fixed port that jobs on one host would share; no autoscaler, whose metrics page took
    44217); Ray's own temp dir (world-writable, with the raylet's sockets) sits in a directory that only this user
    can enter."""
    assert not [cmd for cmd in job.ray_processes().values() if "autoscaler" in cmd], "the head runs no autoscaler"
    found = listening(set(job.ray_processes()) | {job.proc.pid})
    assert found, "no listening socket found for the job's Ray processes"
    assert all(is_loopback(address) for address, _, _ in found), \
        [(str(address), port, pid, processes().get(pid, "")[:80]) for address, port, pid in found
         if not is_loopback(address)]
    base = int(job.up["head"].rsplit(":", 1)[1])
    # (the DeepSpeed ranks' store and gloo take free ports: test_stage_listens_on_the_node_address_only)
    ports = sorted(port for _, port, pid in found if pid not in job.up["ranks"])
    assert all(base <= port < base + 100 for port in ports), (base, ports)
    assert job.private_dir.stat().st_mode & 0o777 == 0o700


@pytest.mark.e2e
def test_stage_listens_on_the_node_address_only(job):
    """The sockets a stage's own processes listen on, beside Ray's: rank 0 of a DeepSpeed group serves the group's
    rendezvous store, and gloo gives every rank sockets of its own. Both on the node's address (a one-node local
    job: 127.0.0.1), never on every interface: torch's TCPStore binds `::` unless handed a bound socket, and gloo
    binds the address the host name resolves to unless GLOO_SOCKET_IFNAME names an interface, which every Ray
    process of the node inherits from `ray start`."""
    ranks, rendezvous = job.up["ranks"], job.up["rendezvous"]
    assert rendezvous["master_addr"] == "127.0.0.1"
    found = listening(ranks)
    assert (ipaddress.ip_address("127.0.0.1"), rendezvous["master_port"], ranks[0]) in found, found
    for pid in ranks:  # the core worker's gRPC server and gloo's at least
        assert len([port for _, port, owner in found if owner == pid]) >= 2, (pid, found)
        assert b"GLOO_SOCKET_IFNAME=lo" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert all(is_loopback(address) for address, _, _ in found), [(str(a), port, pid) for a, port, pid in found]


@pytest.mark.e2e
def test_clean_stop_leaves_no_process_and_no_e_lines(job):
    """A successful start and stop: Ray reports the metrics agent as not available at level I instead of retrying
    a port nobody serves (E lines from the GCS, raylet and every worker); nothing of the node is left."""
    ray_logs = "\n".join(p.read_text(errors="replace") for p in job.private_dir.rglob("*")
                         if p.is_file() and p.suffix in (".out", ".err", ".log"))
    assert "Metrics agent not available" in ray_logs
    job.stop()
    assert job.proc.returncode == 0, job.text()[-4000:]
    output = job.text()
    assert "[test] stopped; RAY_AUTH_MODE=disabled token in env: False" in output, output[-3000:]
    assert not E_LINE.search(output) and "exporter agent" not in output, output[-4000:]
    assert not E_LINE.search(ray_logs), [line for line in ray_logs.splitlines() if E_LINE.search(line)][:5]
    assert not job.ray_processes() and not job.private_dir.exists()


@pytest.mark.e2e
@pytest.mark.parametrize("nodes", [1, 2])
def test_sigkilled_job_leaves_no_ray_process(tmp_path, nodes):
    """SIGKILL of the job's process (no cleanup code of it runs): within seconds no process of its Ray node is left,
    its temp dir is gone and, for task 0 of a multi-node job, so is the token it shared in the job's folder; the Ray
    services' own logs are kept in the job's folder (a driver that Ray's C++ aborts leaves no other trace of why)."""
    job = Job(tmp_path, nodes)
    token_dir, kept = job.folder / f".ray-auth-{job.job_id}-0", job.folder / f"ray-logs-{job.job_id}-0-0"
    try:
        token = job.token()
        before = job.ray_processes()
        assert len(before) >= 5, before  # ray start, GCS, raylet, agents, ...
        if nodes == 1:
            assert job.up["worker"] in before
        else:
            assert token_dir.stat().st_mode & 0o777 == 0o700
            assert (token_dir / "token").read_text() == job.token()
            assert (token_dir / "token").stat().st_mode & 0o777 == 0o600
        job.proc.send_signal(signal.SIGKILL)
        job.proc.wait()
        gone = wait_until(lambda: not job.ray_processes() and not job.private_dir.exists() and
                          not token_dir.exists(), 20)
        assert gone, (f"left after SIGKILL of the job: {job.ray_processes()}, temp dir {job.private_dir.exists()}, "
                      f"token dir {token_dir.exists()}")
        kept_logs = list(kept.iterdir())
        assert {"ray-start.log", "raylet.out", "gcs_server.out"} <= {p.name for p in kept_logs}, kept_logs
        assert "Ray runtime started" in (kept / "ray-start.log").read_text()
        assert kept.stat().st_mode & 0o777 == 0o700 and not [p for p in kept_logs if token.encode() in p.read_bytes()]
    finally:
        for pid in job.ray_processes():  # never leave them to the next test
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_multi_node_token_is_shared_through_a_private_file(tmp_path):
    """Task 0 of a multi-node job writes a fresh token, mode 0600 in a 0700 directory of the job's folder; the other
    tasks read it there. Every attempt (restart) gets its own."""
    job_env = types.SimpleNamespace(job_id="77", paths=types.SimpleNamespace(folder=str(tmp_path)))
    token, folder = job_token(job_env, 0, 2, 0)
    assert re.fullmatch(r"[0-9a-f]{64}", token) and folder is not None
    assert folder.stat().st_mode & 0o777 == 0o700 and (folder / "token").stat().st_mode & 0o777 == 0o600
    assert job_token(job_env, 1, 2, 0) == (token, None)
    assert job_token(job_env, 0, 2, 1)[0] != token
    os.chmod(folder / "token", 0o644)
    with pytest.raises(RuntimeError, match="readable by it alone"):
        job_token(job_env, 1, 2, 0)
    single, none = job_token(job_env, 0, 1, 0)
    assert none is None and single != token
