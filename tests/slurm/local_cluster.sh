#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for tests.
#
#   bash tests/slurm/local_cluster.sh up     RUN_DIR   # install (if needed) + start; prints RUN_DIR/env.sh
#   bash tests/slurm/local_cluster.sh down   RUN_DIR   # stop everything that `up` started
#   bash tests/slurm/local_cluster.sh status RUN_DIR
#   source RUN_DIR/env.sh && sinfo                     # clients need SLURM_CONF
#
# Layout: slurmctld + slurmdbd + a private MariaDB in the root network namespace; two compute nodes
# n1 (10.77.0.11) and n2 (10.77.0.12), each a slurmd in its own network + UTS + mount namespace, joined by
# the bridge apslurm0 (10.77.0.1, the controller's address). Nodes reach each other, the bridge address and
# their own 127.0.0.1; nothing is routed beyond the bridge (we never enable ip_forward).
# Needs root. Daemons do not auto-start on this image, so every daemon is started here, stdio redirected.
# Facts behind the choices: shared/notes/slurm-local-cluster.md.
#
# GPUs: every node declares AP_SLURM_NODE_GPUS GPUs (GRES gpu, AutoDetect=off), so --gpus-per-node jobs are accepted
# and scheduled as on a GPU cluster; nothing runs on them. Slurm 22.05 drops a file-less GPU from a node's GRES
# ("Removing file-less GPU", Flags=CountOnly too) and the node goes INVAL ("gres/gpu count reported lower than
# configured (0 < 2)"), so gres.conf names placeholder files RUN_DIR/dev/gpu0, gpu1 (empty regular files, not
# devices: slurmd logs "... is not a valid character or block device" once and counts them; with
# ConstrainDevices=no and TaskPlugin=task/none nothing is bound). sacct's AllocTRES shows gres/gpu=N
# (AccountingStorageTRES=gres/gpu).
#
# Environment knobs (all optional):
#   AP_SLURM_NODE_CPUS (2)  AP_SLURM_NODE_MEM_MB (8000)  AP_SLURM_NODE_GPUS (2; 0: no GRES)  AP_SLURM_UP_TIMEOUT (120 s)
#   AP_SLURM_PROCTRACK (auto | cgroup | linuxproc; auto = cgroup where the cgroup v1 freezer is mounted:
#   it kills what a job left behind, linuxproc does not)  AP_SLURM_CRED_EXPIRE (20 s: a requeued job
#   stays PENDING (Reason=BeginTime) about this long before it may start again; Slurm's default is 120)
set -euo pipefail

CMD=${1:-}
RUN_DIR_ARG=${2:-}
if [[ -z "$CMD" || -z "$RUN_DIR_ARG" ]]; then
    echo "usage: $0 up|down|status RUN_DIR" >&2
    exit 2
fi
if [[ $(id -u) != 0 ]]; then
    echo "local_cluster.sh: must run as root (network namespaces, daemons)" >&2
    exit 1
fi
mkdir -p "$RUN_DIR_ARG"
RUN_DIR=$(cd "$RUN_DIR_ARG" && pwd -P)

CLUSTER=alignpipe
PARTITION=debug
PREEMPT_PARTITION=high            # same nodes, higher PriorityTier: its jobs preempt (requeue) debug jobs
BRIDGE=apslurm0
BRIDGE_IP=10.77.0.1
NODES=(n1 n2)
NODE_IPS=(10.77.0.11 10.77.0.12)
NETNS_PREFIX=apslurm-             # netns names: apslurm-n1, apslurm-n2 (hostnames inside: n1, n2)
VETH_PREFIX=apsl-                 # host side of each veth: apsl-n1, apsl-n2
NODE_CPUS=${AP_SLURM_NODE_CPUS:-2}
NODE_MEM_MB=${AP_SLURM_NODE_MEM_MB:-8000}
NODE_GPUS=${AP_SLURM_NODE_GPUS:-2}
UP_TIMEOUT=${AP_SLURM_UP_TIMEOUT:-120}
PROCTRACK=${AP_SLURM_PROCTRACK:-auto}
CRED_EXPIRE=${AP_SLURM_CRED_EXPIRE:-20}
# Which run dir owns the bridge/namespaces now, and the pids its daemons got (so a later `up` can clean
# up even after that run dir was deleted, e.g. by pytest's tmp dir rotation after a killed session).
ACTIVE=/run/alignpipe-slurm
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

ETC=$RUN_DIR/etc
LOG=$RUN_DIR/log
PIDS=$RUN_DIR/run
STATE=$RUN_DIR/state
SPOOL=$RUN_DIR/spool
DB=$RUN_DIR/mysql
CONF=$ETC/slurm.conf
T0=$(date +%s%N)

say() {
    local ds=$((($(date +%s%N) - T0) / 100000000))
    printf '[local_cluster %4d.%ds] %s\n' $((ds / 10)) $((ds % 10)) "$*" >&2
}
die() {
    echo "local_cluster.sh: ERROR: $*" >&2
    dump_logs >&2
    exit 1
}
dump_logs() {
    local f
    for f in "$LOG"/*.log; do
        [[ -f "$f" ]] || continue
        echo "----- tail $f -----"
        tail -n 25 "$f" || true
    done
}

# --- processes by pid file (never by name) -------------------------------------------------------
pid_of() {  # pid_of PIDFILE COMM -> pid if alive and its comm matches
    local pf=$1 comm=$2 pid
    [[ -s "$pf" ]] || return 1
    pid=$(tr -dc '0-9' <"$pf")
    [[ -n "$pid" && -r /proc/$pid/comm ]] || return 1
    [[ "$(cat /proc/"$pid"/comm 2>/dev/null)" == "$comm" ]] || return 1
    echo "$pid"
}
stop_pidfiles() {  # stop_pidfiles WAIT_S PIDFILE:COMM...  (SIGTERM all at once, SIGKILL stragglers)
    local wait_s=$1 pf comm pid i alive=()
    shift
    for pair in "$@"; do
        pf=${pair%:*} comm=${pair##*:}
        if pid=$(pid_of "$pf" "$comm"); then
            kill -TERM "$pid" 2>/dev/null || true
            alive+=("$pid($comm)")
        fi
        rm -f "$pf"
    done
    for ((i = 0; i < wait_s * 10; i++)); do
        for pid in "${!alive[@]}"; do [[ -d /proc/${alive[$pid]%(*} ]] || unset "alive[$pid]"; done
        [[ ${#alive[@]} -eq 0 ]] && return 0
        sleep 0.1
    done
    say "pids ${alive[*]} ignored SIGTERM for ${wait_s}s; SIGKILL"
    for pid in "${alive[@]}"; do kill -KILL "${pid%(*}" 2>/dev/null || true; done
}
kill_netns_pids() {  # every process in one of OUR namespaces is ours (slurmd, slurmstepd, jobs)
    local ns=$1 pids i
    [[ -e /run/netns/$ns ]] || return 0
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [[ -n "${pids// /}" ]] || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
        [[ -n "${pids// /}" ]] || return 0
        sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
}

# --- packages ----------------------------------------------------------------------------------
ensure_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    say "installing ${missing[*]}"
    # Keep the packages' own services from starting (on this image policy-rc.d already says 101).
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
    fi
    local rc=0
    {
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=300 update -q &&
            apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${PACKAGES[@]}"
    } </dev/null >"$RUN_DIR/apt.log" 2>&1 || rc=$?
    [[ $made_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d
    if [[ $rc != 0 ]]; then
        tail -n 30 "$RUN_DIR/apt.log" >&2
        die "apt-get failed (rc=$rc); full log: $RUN_DIR/apt.log"
    fi
    say "packages installed"
}

# --- ports -------------------------------------------------------------------------------------
port_free() { ! ss -Htln "( sport = :$1 )" 2>/dev/null | grep -q .; }
pick_port() {  # pick_port START [EXCLUDED...]
    local p=$1 x ok
    shift
    while true; do
        ok=1
        for x in "$@"; do [[ $p == "$x" ]] && ok=0; done
        [[ $ok == 1 ]] && port_free "$p" && break
        p=$((p + 1))
    done
    echo "$p"
}

# --- teardown ----------------------------------------------------------------------------------
thaw_cgroups() {  # a frozen (suspended) job ignores SIGKILL until thawed
    local n
    for n in "${NODES[@]}"; do
        [[ -d /sys/fs/cgroup/freezer/slurm_$n ]] || continue
        find "/sys/fs/cgroup/freezer/slurm_$n" -name freezer.state -exec sh -c 'echo THAWED >"$1"' _ {} \; 2>/dev/null
    done
    return 0
}
remove_cgroups() {  # proctrack/cgroup (v1) leaves slurm_<node>/uid_*/job_* behind when slurmd dies first
    local n d
    for n in "${NODES[@]}"; do
        for d in /sys/fs/cgroup/*/slurm_"$n"; do
            [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
        done
    done
    return 0
}
cleanup_network() {  # also ends every process left in our namespaces (they are all ours)
    local n
    thaw_cgroups
    for n in "${NODES[@]}"; do kill_netns_pids "$NETNS_PREFIX$n"; done
    remove_cgroups
    for n in "${NODES[@]}"; do
        [[ -e /run/netns/$NETNS_PREFIX$n ]] && ip netns del "$NETNS_PREFIX$n"
        ip link show "$VETH_PREFIX$n" >/dev/null 2>&1 && ip link del "$VETH_PREFIX$n"
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
    return 0
}
record_pid() {  # record_pid PIDFILE COMM: remember a daemon we started, outside the run dir
    local pid
    pid=$(pid_of "$1" "$2") && echo "$pid $2" >>"$ACTIVE/pids"
    return 0
}
stop_recorded() {
    local pid comm pairs=()
    [[ -f "$ACTIVE/pids" ]] || return 0
    while read -r pid comm; do
        [[ -n "$pid" ]] || continue
        echo "$pid" >"$ACTIVE/pid.$pid" && pairs+=("$ACTIVE/pid.$pid:$comm")
    done <"$ACTIVE/pids"
    [[ ${#pairs[@]} -eq 0 ]] || stop_pidfiles 30 "${pairs[@]}"
    rm -f "$ACTIVE/pids"
}
down_dir() {  # stop the daemons that a run dir's pid files name
    local d=$1 n
    [[ -d "$d" ]] || return 0
    local slurmds=() dbs=("$d/run/slurmdbd.pid:slurmdbd" "$d/mysql/mysqld.pid:mariadbd") pid
    for n in "${NODES[@]}"; do slurmds+=("$d/run/slurmd-$n.pid:slurmd"); done
    if [[ -f "$d/run/munged.started" ]]; then  # only a munged that our `up` started
        dbs+=("/run/munge/munged.pid:munged")
        rm -f "$d/run/munged.started"
    fi
    # slurmctld saves its state on SIGTERM (a few s); slurmd may wait for a step that keeps retrying an RPC
    # to the stopped controller, so it only gets 3 s. Their jobs die with the namespaces (cleanup_network).
    if pid=$(pid_of "$d/run/slurmctld.pid" slurmctld); then kill -TERM "$pid" 2>/dev/null || true; fi
    stop_pidfiles 3 "${slurmds[@]}"
    stop_pidfiles 15 "$d/run/slurmctld.pid:slurmctld"
    stop_pidfiles 30 "${dbs[@]}"
    say "daemons of $d stopped"
    rm -rf "$d/mysql" "$d/state" "$d/spool" "$d/dev" "$d/env.sh"
}
active_run_dir() { cat "$ACTIVE/run_dir" 2>/dev/null || true; }
kill_jobs() {
    # Jobs first (everything in our namespaces: slurmd, slurmstepd, job processes), so no slurmd waits
    # on a step that keeps retrying an RPC to a controller that is going away.
    local n
    thaw_cgroups
    for n in "${NODES[@]}"; do kill_netns_pids "$NETNS_PREFIX$n"; done
}
cmd_down() {
    local active
    active=$(active_run_dir)
    if [[ -z "$active" || "$active" == "$RUN_DIR" ]]; then kill_jobs; fi
    down_dir "$RUN_DIR"
    if [[ -z "$active" || "$active" == "$RUN_DIR" ]]; then
        stop_recorded
        rm -rf "$ACTIVE"
        cleanup_network
    else
        say "the bridge and namespaces belong to $active; left alone"
    fi
    say "down: $RUN_DIR"
}

# --- bring-up ------------------------------------------------------------------------------------
start_mariadb() {
    local port=$1 i
    mkdir -p "$DB"
    mariadb-install-db --no-defaults --datadir="$DB/data" --user=root --skip-test-db \
        --auth-root-authentication-method=socket </dev/null >"$LOG/mariadb-install.log" 2>&1 ||
        die "mariadb-install-db failed (see $LOG/mariadb-install.log)"
    # --no-defaults: never read /etc/mysql (the system server's socket, port, datadir).
    setsid mariadbd --no-defaults --user=root --datadir="$DB/data" --socket="$DB/mysqld.sock" \
        --pid-file="$DB/mysqld.pid" --port="$port" --bind-address=127.0.0.1 --skip-name-resolve \
        --log-error="$LOG/mariadb.log" --innodb-buffer-pool-size=128M --innodb-log-file-size=16M \
        --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 --innodb-use-native-aio=0 \
        --innodb-lock-wait-timeout=900 --skip-log-bin </dev/null >>"$LOG/mariadb.log" 2>&1 &
    for ((i = 0; i < 300; i++)); do
        mariadb --no-defaults -S "$DB/mysqld.sock" -u root -e 'SELECT 1' >/dev/null 2>&1 && break
        sleep 0.1
    done
    ((i < 300)) || die "MariaDB did not come up"
    record_pid "$DB/mysqld.pid" mariadbd
    mariadb --no-defaults -S "$DB/mysqld.sock" -u root <<SQL || die "could not create the accounting DB"
CREATE DATABASE slurm_acct_db;
CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'alignpipe-test';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL
}

start_munge() {
    if pid_of /run/munge/munged.pid munged >/dev/null; then return 0; fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        install -d -o munge -g munge -m 0700 /etc/munge
        (umask 077 && dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none)
        chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    # munged refuses root with a key owned by munge ("Keyfile is insecure"): run it as munge.
    runuser -u munge -- /usr/sbin/munged </dev/null >>"$LOG/munged-start.log" 2>&1 ||
        die "munged failed to start (see /var/log/munge/munged.log)"
    local i
    for ((i = 0; i < 50; i++)); do
        pid_of /run/munge/munged.pid munged >/dev/null && [[ -S /run/munge/munge.socket.2 ]] && break
        sleep 0.1
    done
    pid_of /run/munge/munged.pid munged >/dev/null || die "munged not running after start"
    touch "$PIDS/munged.started"
    record_pid /run/munge/munged.pid munged
}

write_configs() {
    local ctld_port=$1 dbd_port=$2 db_port=$3 host proctrack_line n i
    host=$(hostname -s)
    if [[ $PROCTRACK == auto ]]; then
        if [[ -f /sys/fs/cgroup/freezer/cgroup.procs ]]; then PROCTRACK=cgroup; else PROCTRACK=linuxproc; fi
    fi
    [[ $NODE_GPUS =~ ^[0-9]+$ ]] || die "AP_SLURM_NODE_GPUS must be a whole number, not $NODE_GPUS"
    case $PROCTRACK in
        cgroup) proctrack_line="ProctrackType=proctrack/cgroup" ;;
        linuxproc) proctrack_line="ProctrackType=proctrack/linuxproc" ;;
        *) die "AP_SLURM_PROCTRACK must be auto, cgroup or linuxproc, not $PROCTRACK" ;;
    esac
    cat >"$CONF" <<EOF
# Written by tests/slurm/local_cluster.sh for $RUN_DIR
ClusterName=$CLUSTER
SlurmctldHost=$host($BRIDGE_IP)
SlurmctldPort=$ctld_port
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL/%n
SlurmctldPidFile=$PIDS/slurmctld.pid
SlurmdPidFile=$PIDS/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
$proctrack_line
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$BRIDGE_IP
AccountingStoragePort=$dbd_port
AccountingStorageTRES=gres/gpu
GresTypes=gpu
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SchedulerType=sched/backfill
# Scheduling passes every few seconds (defaults 60/30 s), so a requeued job restarts soon after its BeginTime.
SchedulerParameters=sched_interval=5,bf_interval=5
InactiveLimit=0
KillWait=5
MinJobAge=300
SlurmctldTimeout=60
SlurmdTimeout=60
MessageTimeout=10
EOF
    local gres=""
    if [[ $NODE_GPUS -gt 0 ]]; then gres=" Gres=gpu:$NODE_GPUS"; fi
    for i in "${!NODES[@]}"; do
        n=${NODES[$i]}
        echo "NodeName=$n NodeHostname=$n NodeAddr=${NODE_IPS[$i]} CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB$gres State=UNKNOWN" >>"$CONF"
    done
    local nodelist
    nodelist=$(IFS=,; echo "${NODES[*]}")
    # GPUs without hardware (see the top): AutoDetect=off (no NVML/RSMI probing) and placeholder files, which every
    # node shares. slurmd reads gres.conf next to slurm.conf.
    rm -rf "$RUN_DIR/dev"
    {
        echo "# Written by tests/slurm/local_cluster.sh: $NODE_GPUS placeholder GPU(s) per node, no hardware"
        echo "AutoDetect=off"
        if [[ $NODE_GPUS -gt 0 ]]; then
            mkdir -p "$RUN_DIR/dev"
            for ((i = 0; i < NODE_GPUS; i++)); do : >"$RUN_DIR/dev/gpu$i"; done
            echo "NodeName=$nodelist Name=gpu File=$RUN_DIR/dev/gpu[0-$((NODE_GPUS - 1))]"
        fi
    } >"$ETC/gres.conf"
    cat >>"$CONF" <<EOF
PartitionName=$PARTITION Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=$PREEMPT_PARTITION Nodes=$nodelist Default=NO MaxTime=INFINITE State=UP PriorityTier=10
EOF
    cat >"$ETC/cgroup.conf" <<EOF
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
    # slurmdbd has no -f: it reads slurmdbd.conf next to \$SLURM_CONF, and insists on 0600.
    (umask 077 && cat >"$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$host
DbdPort=$dbd_port
SlurmUser=root
PidFile=$PIDS/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=alignpipe-test
StorageLoc=slurm_acct_db
EOF
    )
    chmod 0600 "$ETC/slurmdbd.conf"
    {
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        echo "$BRIDGE_IP $host"
        for i in "${!NODES[@]}"; do echo "${NODE_IPS[$i]} ${NODES[$i]}"; done
    } >"$ETC/hosts"
}

setup_network() {
    local i n ns veth
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_IP/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in "${!NODES[@]}"; do
        n=${NODES[$i]} ns=$NETNS_PREFIX${NODES[$i]} veth=$VETH_PREFIX${NODES[$i]}
        ip netns add "$ns"
        ip link add "$veth" type veth peer name "${veth}p"
        ip link set "${veth}p" netns "$ns"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" link set "${veth}p" name eth0
        ip -n "$ns" addr add "${NODE_IPS[$i]}/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        ip -n "$ns" route add default via "$BRIDGE_IP"
    done
}

start_slurmd() {  # in its own net (existing netns) + UTS + mount namespace, /etc/hosts bound to ours
    local n=$1 ns=$NETNS_PREFIX$1
    mkdir -p "$SPOOL/$n"
    # `ip netns exec` would remount /sys and lose /sys/fs/cgroup; nsenter --net does not.
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
        sh -c "mount --bind '$ETC/hosts' /etc/hosts && hostname '$n' && exec env SLURM_CONF='$CONF' slurmd -f '$CONF' -N '$n'" \
        </dev/null >>"$LOG/slurmd-$n.start.log" 2>&1 || die "slurmd $n failed to start"
}

wait_for() {  # wait_for TIMEOUT_S DESCRIPTION CMD...
    local timeout=$1 what=$2 deadline
    shift 2
    deadline=$(($(date +%s) + timeout))
    until "$@" >/dev/null 2>&1; do
        (($(date +%s) < deadline)) || die "timed out after ${timeout}s waiting for $what"
        sleep 0.25
    done
}
nodes_idle() {
    local out n
    out=$(timeout 10 sinfo -h -N -p "$PARTITION" -o '%N %T' 2>/dev/null) || return 1
    for n in "${NODES[@]}"; do grep -qx "$n idle" <<<"$out" || return 1; done
}
tcp_from_ns() {  # tcp_from_ns NS IP PORT: can a process in NS open a TCP connection to IP:PORT?
    nsenter --net="/run/netns/$1" timeout 5 bash -c ": </dev/tcp/$2/$3"
}

cmd_up() {
    [[ ${#RUN_DIR} -le 80 ]] || die "RUN_DIR path too long for Slurm's unix sockets (${#RUN_DIR} > 80): $RUN_DIR"
    # Clean leftovers: whichever cluster held the bridge before (even if its run dir is gone), then ours.
    local prev
    prev=$(active_run_dir)
    kill_jobs
    if [[ -n "$prev" && "$prev" != "$RUN_DIR" ]]; then
        say "cleaning the previous cluster of $prev"
        down_dir "$prev"
    fi
    stop_recorded
    down_dir "$RUN_DIR"
    cleanup_network
    rm -rf "$ACTIVE" "$LOG"
    mkdir -p "$ETC" "$LOG" "$PIDS" "$STATE" "$SPOOL" "$ACTIVE"
    echo "$RUN_DIR" >"$ACTIVE/run_dir"

    ensure_packages
    export SLURM_CONF=$CONF

    local db_port ctld_port dbd_port
    db_port=$(pick_port 13306)
    ctld_port=$(pick_port 16817 "$db_port")
    dbd_port=$(pick_port 16819 "$db_port" "$ctld_port")
    write_configs "$ctld_port" "$dbd_port" "$db_port"
    setup_network
    say "network up ($BRIDGE $BRIDGE_IP; ${NODES[*]} = ${NODE_IPS[*]})"

    start_munge
    start_mariadb "$db_port"
    say "mariadb up (127.0.0.1:$db_port)"

    slurmdbd </dev/null >>"$LOG/slurmdbd.start.log" 2>&1 || die "slurmdbd failed to start"
    wait_for 60 "slurmdbd" timeout 10 sacctmgr -n -P list cluster format=cluster
    record_pid "$PIDS/slurmdbd.pid" slurmdbd
    say "slurmdbd up (port $dbd_port)"
    # sacctmgr exits 1 for "nothing new added"; check the result instead of the exit code.
    timeout 30 sacctmgr -i add cluster "$CLUSTER" >>"$LOG/sacctmgr.log" 2>&1 || true
    timeout 30 sacctmgr -i add account "$CLUSTER" Cluster="$CLUSTER" Description=tests Organization=alignpipe \
        >>"$LOG/sacctmgr.log" 2>&1 || true
    timeout 30 sacctmgr -i add user root Account="$CLUSTER" Cluster="$CLUSTER" >>"$LOG/sacctmgr.log" 2>&1 || true
    timeout 30 sacctmgr -n -P list associations cluster="$CLUSTER" account="$CLUSTER" user=root format=user |
        grep -qx root || die "could not register cluster/account $CLUSTER in slurmdbd"

    slurmctld -f "$CONF" </dev/null >>"$LOG/slurmctld.start.log" 2>&1 || die "slurmctld failed to start"
    wait_for 30 "slurmctld" timeout 10 scontrol ping
    record_pid "$PIDS/slurmctld.pid" slurmctld
    say "slurmctld up (port $ctld_port)"

    local n
    for n in "${NODES[@]}"; do start_slurmd "$n"; done
    wait_for "$UP_TIMEOUT" "nodes ${NODES[*]} idle in partition $PARTITION" nodes_idle
    for n in "${NODES[@]}"; do record_pid "$PIDS/slurmd-$n.pid" slurmd; done
    say "nodes idle"

    # Reachability that Ray and friends rely on: node -> controller address, node -> node. (These bare
    # connects show up as "Zero Bytes were transmitted or received" errors in the slurmd/slurmctld logs.)
    tcp_from_ns "$NETNS_PREFIX${NODES[0]}" "$BRIDGE_IP" "$ctld_port" || die "n1 cannot reach $BRIDGE_IP"
    tcp_from_ns "$NETNS_PREFIX${NODES[0]}" "${NODE_IPS[1]}" 6818 || die "${NODES[0]} cannot reach ${NODE_IPS[1]}"
    tcp_from_ns "$NETNS_PREFIX${NODES[1]}" "${NODE_IPS[0]}" 6818 || die "${NODES[1]} cannot reach ${NODE_IPS[0]}"

    cat >"$RUN_DIR/env.sh" <<EOF
# source this to talk to the test cluster in $RUN_DIR
export SLURM_CONF=$CONF
export ALIGNPIPE_SLURM_RUN_DIR=$RUN_DIR
export ALIGNPIPE_SLURM_PARTITION=$PARTITION
export ALIGNPIPE_SLURM_PREEMPT_PARTITION=$PREEMPT_PARTITION
export ALIGNPIPE_SLURM_NODES="${NODES[*]}"
export ALIGNPIPE_SLURM_NODE_ADDRS="${NODE_IPS[*]}"
export ALIGNPIPE_SLURM_NODE_GPUS=$NODE_GPUS
export ALIGNPIPE_SLURM_CONTROLLER_ADDR=$BRIDGE_IP
EOF
    say "up: source $RUN_DIR/env.sh"
}

cmd_status() {
    local n rc=0
    report() { printf '%-10s %s\n' "$1" "$2"; }
    for pair in "slurmctld:$PIDS/slurmctld.pid" "slurmdbd:$PIDS/slurmdbd.pid" "mariadbd:$DB/mysqld.pid" \
        "munged:/run/munge/munged.pid"; do
        if pid_of "${pair#*:}" "${pair%%:*}" >/dev/null; then report "${pair%%:*}" running; else report "${pair%%:*}" stopped; rc=1; fi
    done
    for n in "${NODES[@]}"; do
        if pid_of "$PIDS/slurmd-$n.pid" slurmd >/dev/null; then report "slurmd-$n" running; else report "slurmd-$n" stopped; rc=1; fi
    done
    if pid_of "$PIDS/slurmctld.pid" slurmctld >/dev/null; then SLURM_CONF=$CONF timeout 10 sinfo -N || rc=1; fi
    return $rc
}

case $CMD in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) echo "usage: $0 up|down|status RUN_DIR" >&2; exit 2 ;;
esac
