"""A Ray cluster across the nodes of one submitit job, torn down however the stage ends.

Task 0 starts the head, every other task starts a worker that joins it, and task 0 runs the stage's driver
once all nodes have joined. Each process is started with explicit ports and a private temp dir and stopped
by its process group: never `ray stop`, which would kill every Ray process of the user on the machine.
"""
import contextlib
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


def base_port(job_id: str, configured: int) -> int:
    """The configured base port, or one derived from the job id (all tasks of a job agree without talking)."""
    return configured or 20000 + (zlib.crc32(str(job_id).encode()) % 400) * 100


def node_ip(hostname: str | None = None) -> str:
    if hostname is None:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            return sock.getsockname()[0]
        return "127.0.0.1"
    return socket.gethostbyname(hostname)


def ray_start_command(head_address: str | None, ip: str, port: int, num_cpus: int, temp_dir: Path) -> list[str]:
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--block", "--disable-usage-stats",
           f"--node-ip-address={ip}", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}",
           f"--min-worker-port={port + WORKER_PORTS[0]}", f"--max-worker-port={port + WORKER_PORTS[1]}"]
    cmd += [f"--{name}={port + offset}" for name, offset in PORTS.items() if name != "port" and
            not (head_address and name == "ray-client-server-port")]
    if head_address is None:
        cmd += ["--head", f"--port={port}", "--include-dashboard=false"]
    else:
        cmd += [f"--address={head_address}"]
    return cmd


def wait_for_nodes(expected: int, timeout_s: float = 300) -> None:
    import ray
    deadline = time.time() + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= expected:
            return
        if time.time() > deadline:
            raise TimeoutError(f"only {len(alive)} of {expected} Ray nodes joined within {timeout_s:.0f} s")
        time.sleep(1)


@contextlib.contextmanager
def ray_cluster(job_env, launcher: dict):
    """Start this task's Ray node; yield True on the task that should run the driver (task 0)."""
    import ray
    rank, num_nodes = job_env.global_rank, job_env.num_nodes
    port = base_port(job_env.job_id, launcher["ray_port"])
    hostnames = job_env.hostnames
    head_ip = node_ip(hostnames[0]) if num_nodes > 1 else "127.0.0.1"
    my_ip = head_ip if rank == 0 else node_ip(hostnames[rank])
    # Ray's unix sockets need a short path; /tmp keeps it under the 107-character limit.
    temp_dir = Path(tempfile.mkdtemp(prefix=f"ray-{job_env.job_id}-{rank}-", dir="/tmp"))
    head_address = None if rank == 0 else f"{head_ip}:{port}"
    cmd = ray_start_command(head_address, my_ip, port, launcher["cpus_per_node"], temp_dir)
    print(f"[ray] task {rank}/{num_nodes} on {socket.gethostname()} ({my_ip}): starting "
          f"{'head' if rank == 0 else 'worker -> ' + head_address}", flush=True)
    log = open(temp_dir / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=os.environ | {"RAY_AUTH_MODE": "disabled"})
    try:
        if rank == 0:
            _connect(f"{head_ip}:{port}", proc, temp_dir)
            wait_for_nodes(num_nodes)
            print(f"[ray] cluster up: {num_nodes} node(s), {ray.cluster_resources().get('CPU', 0):.0f} CPUs", flush=True)
            yield True
        else:
            # Workers just keep their node alive until the head goes away (its driver finished).
            while proc.poll() is None and _head_alive(head_ip, port):
                time.sleep(2)
            yield False
    finally:
        if rank == 0 and ray.is_initialized():
            ray.shutdown()
        _stop(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _connect(address: str, proc: subprocess.Popen, temp_dir: Path, timeout_s: float = 120) -> None:
    import ray
    host, port = address.split(":")
    deadline = time.time() + timeout_s
    while not _head_alive(host, int(port)):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"Ray head did not start; its log:\n{(temp_dir / 'ray-start.log').read_text()[-3000:]}")
        time.sleep(0.5)
    ray.init(address=address, log_to_driver=True, logging_level="WARNING")


def _head_alive(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
