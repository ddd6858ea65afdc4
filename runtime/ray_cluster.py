"""A Ray cluster across the nodes of one submitit job, torn down however the stage ends.

Task 0 starts the head, every other task starts a worker that joins it, and task 0 runs the stage's driver
once all nodes have joined. Each `ray start` runs blocking, with explicit ports, a private temp dir and the
dashboard off, and is stopped by its process group: never `ray stop`, which would kill every Ray process of
the user on the machine (other jobs' and other nodes' too).

Addresses: on Slurm every node uses its own network address (the one that routes to the other nodes), never
127.0.0.1; on the local executor everything stays on 127.0.0.1.
"""
import contextlib
import dataclasses
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

# Offsets from the base port: one fixed port per Ray service, so nodes on a shared host never collide.
PORTS = {"port": 0, "node-manager-port": 1, "object-manager-port": 2, "ray-client-server-port": 3,
         "dashboard-agent-listen-port": 4, "dashboard-agent-grpc-port": 5, "runtime-env-agent-port": 6,
         "metrics-export-port": 7}
WORKER_PORTS = (10, 99)
JOIN_TIMEOUT_S = 300      # how long the head waits for every node, and a worker for the head
WORKER_ATTEMPTS = 3       # `ray start --address` tries per worker
HEAD_MISSES = 3           # a worker leaves after this many failed checks (2 s apart) of the head's port


@dataclasses.dataclass
class RayNodeInfo:
    """What one task of the job knows about the cluster; `nodes` is filled on the driver (task 0)."""
    is_driver: bool
    rank: int
    num_nodes: int
    ip: str
    head_address: str
    nodes: list = dataclasses.field(default_factory=list)  # [{"hostname", "ip", "cpus", "gpus"}], driver only


def base_port(job_id: str, configured: int, restart: int = 0) -> int:
    """The configured base port, or one derived from the job id and its restart count (all tasks of a job agree
    without talking; a requeued job gets fresh ports in case the previous attempt's processes linger)."""
    if configured:
        return configured
    return 20000 + (zlib.crc32(f"{job_id}.{restart}".encode()) % 400) * 100


def resolve(hostname: str) -> str:
    try:
        return socket.gethostbyname(hostname)
    except OSError as err:
        raise RuntimeError(f"cannot resolve node {hostname!r} to an address: {err}") from None


def route_source(destination: str | None) -> str | None:
    """This host's address on the interface that routes to `destination` (default route if None)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((destination or "10.255.255.255", 9))  # UDP connect sends nothing: it only picks a route
        return sock.getsockname()[0]
    return None


def _is_loopback(ip: str | None) -> bool:
    return ip is None or ipaddress.ip_address(ip).is_loopback


def node_addresses(rank: int, hostnames: list[str], cluster: str) -> tuple[str, str]:
    """(head address, this node's address) for task `rank` of a job on `hostnames` (task 0 on hostnames[0])."""
    if cluster == "local":
        return "127.0.0.1", "127.0.0.1"
    if rank == 0:
        # The head advertises the address that the other nodes reach it by: the one routing towards them.
        towards = resolve(hostnames[1]) if len(hostnames) > 1 else None
        ip = route_source(towards)
        if _is_loopback(ip):
            ip = resolve(hostnames[0])
        if len(hostnames) > 1 and _is_loopback(ip):
            raise RuntimeError(f"node {hostnames[0]} has no non-loopback address for Ray (got {ip})")
        return ip, ip
    head = resolve(hostnames[0])
    if _is_loopback(head):
        raise RuntimeError(f"node {hostnames[0]} (the Ray head) resolves to the loopback address {head} on "
                           f"{socket.gethostname()}; fix its name resolution on the cluster")
    ip = route_source(head)
    if _is_loopback(ip):
        raise RuntimeError(f"no route from {socket.gethostname()} to the Ray head {hostnames[0]} ({head})")
    return head, ip


def ray_start_command(head_address: str | None, ip: str, port: int, res: dict, temp_dir: Path) -> list[str]:
    """`ray start --block` for the head (head_address None) or a worker that joins `head_address`."""
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--block", "--disable-usage-stats",
           f"--node-ip-address={ip}", f"--num-cpus={res['cpus_per_node']}", f"--num-gpus={res['gpus_per_node']}",
           f"--temp-dir={temp_dir}",
           f"--min-worker-port={port + WORKER_PORTS[0]}", f"--max-worker-port={port + WORKER_PORTS[1]}"]
    if res.get("mem_gb"):
        # The object store takes 30 % of the machine by default; keep it inside what Slurm gave the job.
        cmd.append(f"--object-store-memory={max(100 << 20, int(res['mem_gb'] * 0.2 * (1 << 30)))}")
    cmd += [f"--{name}={port + offset}" for name, offset in PORTS.items() if name != "port" and
            not (head_address and name == "ray-client-server-port")]
    if head_address is None:
        cmd += ["--head", f"--port={port}", "--include-dashboard=false", "--dashboard-host=127.0.0.1"]
    else:
        cmd += [f"--address={head_address}"]
    return cmd


@contextlib.contextmanager
def ray_cluster(job_env, res: dict):
    """Start this task's Ray node; yield a RayNodeInfo whose `is_driver` is True on task 0, once every node joined.

    `job_env` is a submitit.JobEnvironment; `res` the stage's resolved launcher resources (cluster,
    cpus_per_node, gpus_per_node, mem_gb, ray_port). Workers block inside the context until the head goes away.
    """
    import ray
    rank, num_nodes = job_env.global_rank, job_env.num_nodes
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    port = base_port(job_env.job_id, res["ray_port"], restart)
    head_ip, my_ip = node_addresses(rank, list(job_env.hostnames), res["cluster"])
    head_address = f"{head_ip}:{port}"
    # Ray's unix sockets need a short path; /tmp keeps it under the 107-character limit.
    temp_dir = Path(tempfile.mkdtemp(prefix=f"ray-{job_env.job_id}-{restart}-{rank}-", dir="/tmp"))
    log_path = temp_dir / "ray-start.log"
    info = RayNodeInfo(is_driver=rank == 0, rank=rank, num_nodes=num_nodes, ip=my_ip, head_address=head_address)
    print(f"[ray] task {rank}/{num_nodes} on {socket.gethostname()} ({my_ip}): starting "
          f"{'head at ' + head_address if rank == 0 else 'worker -> ' + head_address}", flush=True)
    proc = None
    log = open(log_path, "w")
    cmd = ray_start_command(None if rank == 0 else head_address, my_ip, port, res, temp_dir)

    def start():
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=os.environ | {"RAY_AUTH_MODE": "disabled"})

    try:
        if rank != 0:
            _wait_for_head(head_ip, port)
            for attempt in range(1, WORKER_ATTEMPTS + 1):  # joining a head that is still starting can fail
                proc = start()
                if _started(proc, log_path):
                    break
                _stop(proc)
                if attempt == WORKER_ATTEMPTS or not _head_alive(head_ip, port):
                    raise RuntimeError(f"the Ray worker could not join the head at {head_address}; its log:\n"
                                       f"{_log_tail(log_path)}")
                print(f"[ray] task {rank}: joining {head_address} failed; retrying", flush=True)
                time.sleep(5)
        else:
            proc = start()
        if rank == 0:
            _connect(head_address, my_ip, proc, log_path)
            info.nodes = wait_for_nodes(num_nodes, proc, log_path)
            shown = ", ".join(f"{n['hostname']} {n['ip']} ({n['cpus']:g} CPU, {n['gpus']:g} GPU)" for n in info.nodes)
            print(f"[ray] cluster up: {len(info.nodes)} node(s): {shown}", flush=True)
            yield info
        else:
            _serve_until_head_leaves(proc, head_ip, port, log_path)
            yield info
    finally:
        if rank == 0 and ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.shutdown()
        if proc is not None:
            _stop(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _started(proc: subprocess.Popen, log_path: Path, timeout_s: float = JOIN_TIMEOUT_S) -> bool:
    """Wait until `ray start` says its node runs (True) or exits (False)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if "Ray runtime started" in _log_tail(log_path, 1 << 20):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.5)
    return False


def _wait_for_head(host: str, port: int, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    deadline = time.time() + timeout_s
    while not _head_alive(host, port):
        if time.time() > deadline:
            raise RuntimeError(f"the Ray head {host}:{port} did not come up within {timeout_s:.0f} s")
        time.sleep(1)


def _connect(address: str, my_ip: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = JOIN_TIMEOUT_S,
             attempts: int = 3) -> None:
    """Connect the driver once the head node is up: `ray start` says "Ray runtime started" when its services
    are (an open GCS port alone is not enough on a loaded machine); a slow GCS gets a few tries."""
    import ray
    deadline = time.time() + timeout_s
    while "Ray runtime started" not in _log_tail(log_path, 1 << 20):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"Ray head did not start (exit code {proc.poll()}); its log:\n{_log_tail(log_path)}")
        time.sleep(0.5)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, _node_ip_address=my_ip, log_to_driver=True, logging_level="WARNING")
            return
        except Exception as err:  # e.g. "Timed out while waiting for GCS to become available"
            with contextlib.suppress(Exception):
                ray.shutdown()
            if attempt == attempts or proc.poll() is not None:
                raise
            print(f"[ray] connecting to the head at {address} failed ({err}); retrying", flush=True)
            time.sleep(5)


def wait_for_nodes(expected: int, proc: subprocess.Popen | None = None, log_path: Path | None = None,
                   timeout_s: float = JOIN_TIMEOUT_S) -> list[dict]:
    """Block until `expected` Ray nodes are alive; return them (hostname, ip, cpus, gpus)."""
    import ray
    deadline = time.time() + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= expected:
            return [{"hostname": n.get("NodeManagerHostname", "?"), "ip": n["NodeManagerAddress"],
                     "cpus": n["Resources"].get("CPU", 0), "gpus": n["Resources"].get("GPU", 0)} for n in alive]
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the Ray head exited (code {proc.returncode}); its log:\n{_log_tail(log_path)}")
        if time.time() > deadline:
            joined = ", ".join(n["NodeManagerAddress"] for n in alive) or "none"
            raise TimeoutError(f"only {len(alive)} of {expected} Ray nodes joined within {timeout_s:.0f} s "
                               f"(joined: {joined}); see the other tasks' logs")
        time.sleep(1)


def _serve_until_head_leaves(proc: subprocess.Popen, head_ip: str, port: int, log_path: Path) -> None:
    """A worker keeps its node alive until the head goes away (the driver finished, failed or was stopped)."""
    misses = 0
    while misses < HEAD_MISSES:
        if proc.poll() is not None:
            if _head_alive(head_ip, port):
                raise RuntimeError(f"the Ray worker exited (code {proc.returncode}) while the head is up; "
                                   f"its log:\n{_log_tail(log_path)}")
            return
        misses = 0 if _head_alive(head_ip, port) else misses + 1
        time.sleep(2)


def _head_alive(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def _stop(proc: subprocess.Popen) -> None:
    """Stop one `ray start --block` and everything it started, by its process group (its own session)."""
    # SIGTERM to `ray start` alone: it drains the node and stops its raylet, GCS, ... in ~2 s. Sent to the whole
    # group, the children die first and `ray start` then hangs (>30 s) draining a node that is gone.
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
