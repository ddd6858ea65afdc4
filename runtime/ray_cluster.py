"""A Ray cluster across the nodes of one submitit job, torn down however the stage ends.

Task 0 starts the head, every other task starts a worker that joins it, and task 0 runs the stage's driver
once all nodes have joined. Each `ray start` runs blocking, with explicit ports, a private temp dir and the
dashboard off, in a session of its own, and is stopped by the process ids of that session: never `ray stop`, which
would kill every Ray process of the user on the machine (other jobs' and other nodes' too).

Addresses: on Slurm every node uses its own network address (the one that routes to the other nodes), never
127.0.0.1; on the local executor everything stays on 127.0.0.1.

Locked down (issue #17):
- Token authentication with a fresh secret per job attempt (`RAY_AUTH_MODE=token`, the secret in `RAY_AUTH_TOKEN`):
  it reaches `ray start` and the driver through their environment only, never a command line or a log. A client
  without it is refused (InvalidAuthToken). How the tasks of a multi-node job share it: see `job_token`.
- Addresses: a node advertises and binds what it can to its own address; a one-node local job keeps Ray on
  127.0.0.1 (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: without it Ray swaps 127.0.0.1 for the host's network address).
  On a multi-node job Ray 2.60's own gRPC servers (GCS, raylet, core workers) listen on all interfaces whatever the
  node address is (not configurable): the token is what guards them. The head runs no autoscaler (`--no-monitor`: a
  job's nodes are fixed), whose metrics page (plain HTTP, no token) listened on all interfaces, and whose process
  cost each job's start a CPU-second. What a stage's processes open themselves listens on the
  node's address (issue #25): gloo's sockets (DeepSpeed's ranks, vLLM's groups) on the node's interface
  (`GLOO_SOCKET_IFNAME`, which every Ray process of the node inherits from `ray start`; without it gloo binds
  whatever the host name resolves to), the DeepSpeed ranks' store on the node's address
  (runtime/deepspeed_strategy.init_process_group). The dashboard is off; no fixed metrics-agent or metrics-export
  port is given, so Ray's minimal install reports "metrics agent not available" (an I line) instead of retrying a
  port nobody serves and logging E lines.
- Every Ray process of a task ends with the task's process, also when that is SIGKILLed: see `WATCHDOG`.
"""
import contextlib
import dataclasses
import io
import ipaddress
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from runtime.progress import on_stall, process_stacks

# Offsets from the base port: one fixed port per Ray service, so nodes on a shared host never collide. The metrics
# agent's gRPC port (--dashboard-agent-grpc-port) and --metrics-export-port are left to Ray (0): with the minimal Ray
# these environments install no agent serves metrics, and a fixed port makes the GCS, raylet and every worker retry
# it and log "Failed to establish connection to the metrics exporter agent" at level E.
PORTS = {"port": 0, "node-manager-port": 1, "object-manager-port": 2, "ray-client-server-port": 3,
         "dashboard-agent-listen-port": 4, "runtime-env-agent-port": 6}
WORKER_PORTS = (10, 99)
PORT_BLOCKS = 400         # blocks of 100 ports from 20000
JOIN_TIMEOUT_S = 300      # how long the head waits for every node, and a worker for the head
WORKER_ATTEMPTS = 3       # `ray start --address` tries per worker
STALL_REQUEST = "stalled"  # the file task 0 of a stalled multi-node job puts into the tasks' shared folder
NODE_STACKS_TIMEOUT_S = 120  # how long task 0 waits for the other nodes' stacks
PORT_ATTEMPTS = 3         # blocks a one-node job's head tries (see ray_cluster)
GCS_PORT_TAKEN = "Failed to start the grpc server"  # what the GCS logs when its port is taken
HEAD_MISSES = 3           # a worker leaves after this many failed checks (2 s apart) of the head's port
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 instead of the host's address
# Task 0's log lines as its node starts (again on a retry or a requeued job: the log is appended to) and once every
# node joined; between the two, the launcher resubmits a job that died (launcher/submit.py).
HEAD_STARTING = "starting head at"
CLUSTER_UP = "[ray] cluster up:"

# Runs beside each `ray start --block` (python -c WATCHDOG <task pid> <ray start pid> <kept logs dir> <private dir>
# [<token dir>]), in a session of its own, deaf to the signals Slurm or a user send a job. When the task's process is
# gone (its parent changes, whatever killed it: SIGKILL leaves the task no chance to clean up; a driver that Ray's C++
# aborts, "Failed to register worker to Raylet", when its raylet died), it SIGKILLs every process of `ray start`'s
# session (`ray start` leads it: GCS, raylet, agents and the workers, which have process groups of their own) and any
# process whose command line names the node's private dir, keeps the Ray services' own logs (why a raylet died, say) in
# the job's folder (KEPT_LOGS), then removes the directories. A task that stops its node normally kills the watchdog
# once the node is down. Ray's own fate sharing is not enough: `ray start` dying kills its direct children, but the
# workers and agents that the raylet started outlive it. (A parent-death signal on `ray start` would reach `ray start`
# alone, and needs a preexec_fn, unsafe in a process with threads.)
WATCHDOG = """
import glob, os, shutil, signal, sys, time
task, session, kept, mark = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_IGN)
while os.getppid() == task:
    time.sleep(0.2)
for attempt in range(20):
    found = 0
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                state, _, _, sid = fh.read().rsplit(b")", 1)[1].split()[:4]
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                named = mark.encode() in fh.read()
            if state != b"Z" and (int(sid) == session or named):
                os.kill(pid, signal.SIGKILL)
                found += 1
        except (OSError, ValueError):
            pass
    if not found:
        break
    time.sleep(0.2)
for log in [f"{mark}/ray-start.log"] + glob.glob(f"{mark}/r/session_*/logs/*"):
    if os.path.basename(log).startswith(("ray-start", "raylet", "gcs_server", "dashboard_agent", "runtime_env_agent")):
        try:
            os.makedirs(kept, mode=0o700, exist_ok=True)
            shutil.copy(log, kept)
        except OSError:
            pass
for path in sys.argv[4:]:
    shutil.rmtree(path, ignore_errors=True)
"""
KEPT_LOGS = "ray-logs-{job_id}-{restart}-{rank}"  # the Ray logs of a job attempt's node that ended without stopping it


@dataclasses.dataclass
class RayNodeInfo:
    """What one task of the job knows about the cluster; `nodes` is filled on the driver (task 0)."""
    is_driver: bool
    rank: int
    num_nodes: int
    ip: str
    head_address: str
    nodes: list = dataclasses.field(default_factory=list)  # [{"hostname", "ip", "cpus", "gpus"}], driver only


def base_port(job_id: str, configured: int, restart: int = 0, free=None) -> int:
    """The configured base port, or one derived from the job id and its restart count (all tasks of a job agree
    without talking; a requeued job gets fresh ports in case the previous attempt's processes linger). With `free`
    (a one-node job, whose ports no other task needs to know), the first block from there on whose ports are all
    free: two jobs on one host derive the same block one time in 400 (seen with two DAGs run at once), and
    Ray's GCS then fails to start ("Failed to start the grpc server")."""
    if configured:
        return configured
    first = zlib.crc32(f"{job_id}.{restart}".encode()) % PORT_BLOCKS
    for block in range(first, first + (PORT_BLOCKS if free else 1)):
        port = 20000 + (block % PORT_BLOCKS) * 100
        if free is None or free(port):
            return port
    raise RuntimeError("no block of 100 free ports for Ray between 20000 and 59999 on this host; "
                       "set launcher.ray_port to a base port whose next 100 ports are free")


def ports_free(base: int) -> bool:
    """Whether every port of the block at `base` that a Ray node uses can be bound on every address of this host."""
    for port in range(base, base + WORKER_PORTS[1] + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


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
        cmd += ["--head", f"--port={port}", "--include-dashboard=false", "--dashboard-host=127.0.0.1", "--no-monitor"]
    else:
        cmd += [f"--address={head_address}"]
    return cmd


def job_token(job_env, rank: int, num_nodes: int, restart: int) -> tuple[str, Path | None]:
    """The Ray token of this job attempt: (token, the directory task 0 shared it in or None).

    A one-node job keeps it in memory. In a multi-node job task 0 makes a fresh one and writes it, mode 0600 in a
    0700 directory, into the job's submitit folder (on the shared filesystem, where submitit itself exchanges the
    job's pickles); the other tasks, running as the same user, read it there. Not in the job's pickle (submitit
    writes it world-readable, and it would be one secret for every attempt), not on a command line, not in an
    environment variable of the submitting host. Task 0 removes the directory when its node stops.
    """
    if num_nodes == 1:
        return secrets.token_hex(32), None
    folder = shared_folder(job_env, restart)
    path = folder / "token"
    if rank == 0:
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        token = secrets.token_hex(32)
        tmp = folder / f"token.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(token)
        os.replace(tmp, path)  # whole or not at all for the readers
        return token, folder
    deadline = time.time() + JOIN_TIMEOUT_S
    while not path.exists():
        if time.time() > deadline:
            raise RuntimeError(f"task 0 did not share the job's Ray token within {JOIN_TIMEOUT_S} s ({path})")
        time.sleep(1)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{path} must belong to this user and be readable by it alone (mode "
                           f"{oct(st.st_mode & 0o777)}); not using it")
    return path.read_text().strip(), None


def shared_folder(job_env, restart: int) -> Path:
    """The folder a multi-node job attempt's tasks share (in the job's submitit folder): its Ray token, and a stalled
    stage's request for the other nodes' stacks and their answers."""
    return Path(job_env.paths.folder) / f".ray-auth-{job_env.job_id}-{restart}"


def ask_nodes_for_stacks(folder: Path, ranks, timeout_s: float = NODE_STACKS_TIMEOUT_S) -> None:
    """Task 0 of a stalled multi-node job: ask the other tasks for the Python stacks of their nodes' processes (they
    watch for the request while they serve, `_serve_until_head_leaves`) and print each node's into this log."""
    (folder / STALL_REQUEST).touch()
    deadline = time.monotonic() + timeout_s
    for rank in ranks:
        answer = folder / f"stacks-{rank}.txt"
        while not answer.exists() and time.monotonic() < deadline:
            time.sleep(1)
        print(f"--- the processes of task {rank}'s node ---", flush=True)
        print(answer.read_text() if answer.exists() else f"(task {rank} did not answer within {timeout_s:.0f} s; its "
              "own log may hold them)", flush=True)


def answer_stall_request(folder: Path, rank: int, root: int) -> None:
    """Another task of a stalled job: the stacks of the Python processes below `root` (this task's: its Ray node's
    workers) for task 0, whole or not at all, and into this task's own log."""
    stacks = io.StringIO()
    process_stacks(root, stacks)
    partial = folder / f"stacks-{rank}.txt.partial"
    partial.write_text(stacks.getvalue())
    partial.rename(folder / f"stacks-{rank}.txt")
    print(f"[ray] task {rank}: task 0 reported a stall; this node's Python stacks:\n{stacks.getvalue()}", flush=True)


def interface_of(ip: str) -> str:
    """The name of this host's network interface whose network holds `ip` (lo for 127.0.1.1 too)."""
    import psutil
    address = ipaddress.ip_address(ip)
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6) and a.netmask:
                prefix = bin(int(ipaddress.ip_address(a.netmask))).count("1")
                if address in ipaddress.ip_network(f"{a.address.split('%')[0]}/{prefix}", strict=False):
                    return name
    raise RuntimeError(f"no network interface of {socket.gethostname()} holds its node address {ip}")


def ray_env(token: str, loopback: bool, interface: str) -> dict:
    """What `ray start` and the driver need in their environment: token auth with this job's token, gloo on the
    node's `interface` and, for a one-node local job, Ray kept on 127.0.0.1."""
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "GLOO_SOCKET_IFNAME": interface}
    if loopback:
        env[LOOPBACK_ENV] = "0"
    return env


@contextlib.contextmanager
def _driver_env(env: dict):
    """The driver (this process, its Ray workers get theirs from the raylet) runs with `env`; restored after."""
    import ray._private.ray_constants as ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config
    saved = {key: os.environ.get(key) for key in env}
    saved_cluster = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(env)
    # Read at import: a stage module may have imported Ray already.
    ray_constants.ENABLE_RAY_CLUSTER = env.get(LOOPBACK_ENV) != "0"
    Config.initialize("")  # re-read RAY_AUTH_MODE (as Ray's own _enable_token_auth does)
    AuthenticationTokenLoader.instance().reset_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        ray_constants.ENABLE_RAY_CLUSTER = saved_cluster
        with contextlib.suppress(Exception):
            AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def ray_cluster(job_env, res: dict):
    """Start this task's Ray node; yield a RayNodeInfo whose `is_driver` is True on task 0, once every node joined.

    `job_env` is a submitit.JobEnvironment (job_id, global_rank, num_nodes, hostnames, and paths.folder for a
    multi-node job); `res` the stage's resolved launcher resources (cluster, cpus_per_node, gpus_per_node, mem_gb,
    ray_port). Workers block inside the context until the head goes away.
    """
    rank, num_nodes = job_env.global_rank, job_env.num_nodes
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    passed_over = set()
    while True:
        free = (lambda base: base not in passed_over and ports_free(base)) if num_nodes == 1 else None
        port = base_port(job_env.job_id, res["ray_port"], restart, free=free)
        try:
            yield from _job_node(job_env, res, rank, num_nodes, restart, port)
            return
        except HeadDidNotStart as err:
            # The block was free when checked, and a port of it was taken before Ray bound it: by another job's head
            # that derived the same block and started at the same moment (jobs 18627 and 18630 of a full test run,
            # three stages submitted at once), or as the ephemeral port of an outgoing connection. A one-node job's
            # ports are its own: it takes the next free block. The GCS says when its port is taken; the raylet only
            # times out.
            taken = GCS_PORT_TAKEN in str(err) or not ports_free(port)
            if free is None or res["ray_port"] or not taken or len(passed_over) + 1 == PORT_ATTEMPTS:
                raise
            passed_over.add(port)
            print(f"[ray] a port of the block at {port} was taken while the head started; trying the next free block",
                  flush=True)


def _job_node(job_env, res: dict, rank: int, num_nodes: int, restart: int, port: int):
    """One attempt of `ray_cluster`, on the block of ports at `port`."""
    head_ip, my_ip = node_addresses(rank, list(job_env.hostnames), res["cluster"])
    head_address = f"{head_ip}:{port}"
    # Ray's unix sockets need a short path; /tmp keeps it under the 107-character limit. Ray makes its temp dir
    # world-writable (0777), the raylet's and object store's sockets in it, so Ray's temp dir is the subdirectory
    # "r" of a private dir (0700, from mkdtemp) that no other user can enter; the private dir holds ray-start.log.
    private_dir = Path(tempfile.mkdtemp(prefix=f"ray-{job_env.job_id}-{restart}-{rank}-", dir="/tmp"))
    info = RayNodeInfo(is_driver=rank == 0, rank=rank, num_nodes=num_nodes, ip=my_ip, head_address=head_address)
    print(f"[ray] task {rank}/{num_nodes} on {socket.gethostname()} ({my_ip}): starting "
          f"{HEAD_STARTING + ' ' + head_address if rank == 0 else 'worker -> ' + head_address}", flush=True)
    token_dir = None
    try:
        token, token_dir = job_token(job_env, rank, num_nodes, restart)
        env = ray_env(token, loopback=_is_loopback(my_ip) and num_nodes == 1, interface=interface_of(my_ip))
        shared = shared_folder(job_env, restart) if num_nodes > 1 else None
        with _driver_env(env) if rank == 0 else contextlib.nullcontext():
            kept = Path(job_env.paths.folder) / KEPT_LOGS.format(job_id=job_env.job_id, restart=restart, rank=rank)
            yield from _run_node(info, head_ip, head_address, port, res, private_dir, kept, env, token_dir, shared)
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)
        if token_dir is not None:
            shutil.rmtree(token_dir, ignore_errors=True)


def _run_node(info: RayNodeInfo, head_ip: str, head_address: str, port: int, res: dict, private_dir: Path,
              kept: Path, env: dict, token_dir: Path | None, shared: Path | None):
    """The body of `_job_node`: start this task's node (with its watchdog, which keeps Ray's logs in `kept` if the
    task dies), join, yield, stop. `shared`: the folder of a multi-node job's tasks, through which a stall watch on
    task 0 asks the others for their stacks."""
    import ray
    rank, num_nodes, my_ip = info.rank, info.num_nodes, info.ip
    log_path = private_dir / "ray-start.log"
    proc = None
    log = open(log_path, "w")
    cmd = ray_start_command(None if rank == 0 else head_address, my_ip, port, res, private_dir / "r")

    def start():
        # The token travels in the environment (readable by this user alone), never on the command line.
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=os.environ | env)
        child.watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(child.pid), str(kept), str(private_dir)] +
            ([str(token_dir)] if token_dir else []),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={"PATH": os.environ.get("PATH", "")})
        return child

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
            print(f"{CLUSTER_UP} {len(info.nodes)} node(s): {shown}", flush=True)
            with on_stall(lambda: ask_nodes_for_stacks(shared, range(1, num_nodes))) if shared else \
                    contextlib.nullcontext():
                yield info
        else:
            _serve_until_head_leaves(proc, head_ip, port, log_path, shared, rank)
            yield info
    finally:
        if rank == 0 and ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.shutdown()
        if proc is not None:
            _stop(proc)
        log.close()


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


class HeadDidNotStart(RuntimeError):
    pass


def _connect(address: str, my_ip: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = JOIN_TIMEOUT_S,
             attempts: int = 3) -> None:
    """Connect the driver once the head node is up: `ray start` says "Ray runtime started" when its services
    are (an open GCS port alone is not enough on a loaded machine); a slow GCS gets a few tries."""
    import ray
    from ray._private import auto_init_hook
    deadline = time.time() + timeout_s
    while "Ray runtime started" not in _log_tail(log_path, 1 << 20):
        # A GCS that cannot bind its port says so at once; `ray start` reports it ~40 s later.
        port_taken = [line for err in log_path.parent.glob("r/session_*/logs/gcs_server.err")
                      for line in _log_tail(err, 1 << 20).splitlines() if GCS_PORT_TAKEN in line]
        if port_taken:  # nothing to drain: `ray start` would wait out its ~40 s for the GCS, deaf to SIGTERM
            proc.kill()
            proc.wait()
        if proc.poll() is not None or time.time() > deadline:
            raise HeadDidNotStart(f"Ray head did not start (exit code {proc.poll()}); its log:\n{_log_tail(log_path)}"
                                  + "".join(f"\n{line}" for line in port_taken))
        time.sleep(0.5)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, _node_ip_address=my_ip, log_to_driver=True, logging_level="WARNING")
            # Once the stage's cluster is shut down (an interruption), a thread still calling Ray (a rollout
            # generated ahead, an episode's next turn) must fail in Python: Ray's automatic ray.init would connect
            # again and abort the process in its token loader, before the job's requeue is written.
            auto_init_hook.enable_auto_connect = False
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


def _serve_until_head_leaves(proc: subprocess.Popen, head_ip: str, port: int, log_path: Path,
                             shared: Path | None = None, rank: int = 0) -> None:
    """A worker keeps its node alive until the head goes away (the driver finished, failed or was stopped); it
    answers a stall watch's request for its node's stacks (`ask_nodes_for_stacks`) once."""
    misses, answered = 0, False
    while misses < HEAD_MISSES:
        if shared is not None and not answered and (shared / STALL_REQUEST).exists():
            answer_stall_request(shared, rank, os.getpid())
            answered = True
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


def session_processes(session: int) -> list[int]:
    """The live processes of a session (`ray start` leads its own: its node's GCS, raylet, agents and workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                state, _, _, sid = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[:4]
                if int(sid) == session and state != b"Z":
                    found.append(int(entry.name))
    return found


def _stop(proc: subprocess.Popen) -> None:
    """Stop one `ray start --block` and everything it started (its session), then the watchdog beside it."""
    # SIGTERM to `ray start` alone: it drains the node and stops its raylet, GCS, ... in ~2 s. Sent to the whole
    # group, the children die first and `ray start` then hangs (>30 s) draining a node that is gone.
    if proc.poll() is None:  # not after it exited: its pid may be another process's by now
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        pass
    # Whatever is left of the session: workers and agents have process groups of their own.
    for _ in range(10):
        left = [pid for pid in session_processes(proc.pid) if pid != proc.pid or proc.poll() is None]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    watchdog = getattr(proc, "watchdog", None)
    if watchdog is not None:
        watchdog.kill()
        watchdog.wait()
