#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one machine, for tests and for trying
# slurm/ray_cluster.sbatch without a cluster.
#
#   tests/slurm/testbed.sh up       # start (idempotent; running daemons keep their config); prints `export SLURM_CONF=...`
#   tests/slurm/testbed.sh status   # nodes, daemons, queue
#   tests/slurm/testbed.sh down     # stop daemons, delete namespaces (idempotent)
#   tests/slurm/testbed.sh slow n2  # throttle node n2's CPU to SLURM_LAB_SLOW_PCT% of one core, for real
#   tests/slurm/testbed.sh heal n2  # lift the throttle (`down` lifts every node's)
#
# One slurmctld runs on the host. Each node nI runs its own slurmd inside a
# network namespace (IP SUBNET.(10+I) on bridge BRIDGE), a UTS namespace
# (hostname nI) and a mount namespace with a private /etc/hosts, /etc/resolv.conf
# and /tmp. The private /tmp makes the nodes behave like real ones: node-local
# scratch, so two nodes never share a Ray temp dir by accident. Everything else
# (the repository, the venv, LAB) is shared, like a cluster's shared filesystem;
# a repository or venv that lives under /tmp is bind-mounted back into each
# node's private /tmp (SLURM_LAB_SHARE).
#
# Needs root, iproute2, util-linux (nsenter, unshare) and Debian's Slurm:
#   apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge
# Traffic only flows between the host's bridge address and the namespaces; the
# namespaces' default route exists so "which IP am I" lookups work, and with
# ip_forward off nothing leaves the bridge.
set -euo pipefail

# ---- knobs (env vars; defaults shown) ---------------------------------------
LAB=${SLURM_LAB:-/var/tmp/rt-slurm-lab}      # state, logs, per-node /tmp; outside /tmp so nodes see it
NODES=${SLURM_LAB_NODES:-2}                  # number of nodes n1..nN
CPUS=${SLURM_LAB_CPUS:-2}                    # Slurm CPUs per node (declared; need not match cores)
MEM_MB=${SLURM_LAB_MEM_MB:-2000}             # Slurm RealMemory per node
SUBNET=${SLURM_LAB_SUBNET:-192.168.77}       # /24: host .1, node I at .(10+I)
BRIDGE=${SLURM_LAB_BRIDGE:-slbr0}
CTLD_PORT=${SLURM_LAB_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LAB_SLURMD_PORT:-6818}
UP_TIMEOUT=${SLURM_LAB_UP_TIMEOUT:-60}       # seconds to wait for all nodes idle
CRED_EXPIRE=${SLURM_LAB_CRED_EXPIRE:-20}     # step credential lifetime; a requeued job waits this + 1 s
SLOW_PCT=${SLURM_LAB_SLOW_PCT:-20}           # `slow`: a throttled node's share of one core (at 10 Ray fails to start)
FAVOUR=${SLURM_LAB_FAVOUR:-8}                # `slow`: the other nodes' CPU weight against the host's other processes, x the default
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SHARE=${SLURM_LAB_SHARE:-$REPO_ROOT${VIRTUAL_ENV:+:$VIRTUAL_ENV}}  # host paths the nodes must see, ':'-separated

CONF="$LAB/slurm.conf"
NS_PREFIX=sl-                                # netns names: sl-n1, sl-n2, ...

die() { echo "testbed: $*" >&2; exit 1; }
log() { echo "testbed: $*" >&2; }

node_ip() { echo "$SUBNET.$((10 + $1))"; }

# ---- preflight ---------------------------------------------------------------
preflight() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (network namespaces, slurmd)"
    local missing=() bin
    for bin in ip nsenter unshare slurmctld slurmd sinfo munged mungekey; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    ((${#missing[@]} == 0)) || die "missing ${missing[*]}; install with:
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge iproute2 util-linux"
}

# ---- munge: Slurm's authentication between its daemons and clients ------------
start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0                             # a working munged already serves us
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge
    chown munge:munge /run/munge
    runuser -u munge -- munged
    munge -n | unmunge >/dev/null || die "munged started but does not work"
}

# ---- network: one bridge on the host, one namespace + veth per node ----------
setup_network() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    local i ns veth
    for ((i = 1; i <= NODES; i++)); do
        ns="${NS_PREFIX}n$i"
        veth="slv-n$i"
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip link add "$veth" type veth peer name eth0 netns "$ns"
            ip link set "$veth" master "$BRIDGE"
            ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
        fi
        ip link set "$veth" up
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        ip -n "$ns" route replace default via "$SUBNET.1"
    done
}

teardown_network() {
    local i
    for ((i = 1; i <= NODES; i++)); do
        ip link del "slv-n$i" 2>/dev/null || true      # deletes the peer eth0 too
        ip netns del "${NS_PREFIX}n$i" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

# ---- files: slurm.conf, per-node hosts/resolv.conf/tmp ------------------------
write_files() {
    local host i
    host=$(hostname -s)
    mkdir -p "$LAB/state" "$LAB/log" "$LAB/etc"
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 $host"
        for ((i = 1; i <= NODES; i++)); do echo "$(node_ip "$i") n$i"; done
    } >"$LAB/etc/hosts"
    # Without this every name lookup inside a node waits 10 s for the host's DNS.
    echo "nameserver 127.0.0.1" >"$LAB/etc/resolv.conf"
    for ((i = 1; i <= NODES; i++)); do
        mkdir -p "$LAB/spool/n$i" "$LAB/nodes/n$i/tmp"
        chmod 1777 "$LAB/nodes/n$i/tmp"
    done
    cat >"$CONF" <<EOF
# Written by tests/slurm/testbed.sh; rewritten on every \`up\`.
ClusterName=rtlab
SlurmctldHost=$host($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MailProg=/bin/true
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$LAB/slurmctld.pid
SlurmdPidFile=$LAB/slurmd.%n.pid
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
# Declared CPUs win over the host's real core count.
SlurmdParameters=config_overrides
# Fast feedback: short kill grace, frequent scheduling, finished jobs kept 10 min,
# and a requeued job may start again after $((CRED_EXPIRE + 1)) s instead of Slurm's 121 s.
KillWait=10
MinJobAge=600
SchedulerParameters=sched_interval=2
AuthInfo=cred_expire=$CRED_EXPIRE
EOF
    for ((i = 1; i <= NODES; i++)); do
        echo "NodeName=n$i NodeHostname=n$i NodeAddr=$(node_ip "$i") CPUs=$CPUS Sockets=1" \
            "CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

# ---- daemons -------------------------------------------------------------------
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_daemons() {
    if ! pid_alive "$LAB/slurmctld.pid"; then
        slurmctld -f "$CONF"
    fi
    local i ns
    local -a under_tmp
    mapfile -t under_tmp < <(shares_under_tmp)
    for ((i = 1; i <= NODES; i++)); do
        pid_alive "$LAB/slurmd.n$i.pid" && continue
        ns="${NS_PREFIX}n$i"
        # Not `ip netns exec`: it remounts /sys and slurmd then fails with
        # "No filesystem mounted on /sys/fs/cgroup". nsenter joins only the netns.
        # Shared paths under /tmp are bound aside first, then back on top of the
        # private /tmp. unshare's mounts are private: the host sees none of them.
        # shellcheck disable=SC2016  # $1.. expand in the inner sh, on purpose
        nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c '
            lab=$1 node=$2 conf=$3
            shift 3
            mount --bind "$lab/etc/hosts" /etc/hosts &&
                mount --bind "$lab/etc/resolv.conf" /etc/resolv.conf || exit 1
            k=0
            for p in "$@"; do
                k=$((k + 1))
                mkdir -p "$lab/nodes/$node/share/$k" && mount --bind "$p" "$lab/nodes/$node/share/$k" || exit 1
            done
            mount --bind "$lab/nodes/$node/tmp" /tmp || exit 1
            k=0
            for p in "$@"; do
                k=$((k + 1))
                mkdir -p "$p" && mount --bind "$lab/nodes/$node/share/$k" "$p" || exit 1
            done
            hostname "$node" && exec slurmd -f "$conf" -N "$node"' sh "$LAB" "n$i" "$CONF" "${under_tmp[@]}"
    done
}

# The SHARE paths that a private /tmp would hide from the nodes.
shares_under_tmp() {
    local p real
    local -a paths
    IFS=: read -ra paths <<<"$SHARE"
    for p in "${paths[@]}"; do
        [[ -n $p && -d $p ]] || continue
        real=$(readlink -f "$p")
        [[ $real == /tmp/* ]] && echo "$real"
    done
    return 0
}

# Stops a daemon by the PID in its pid file, never by name: other Slurm or
# test daemons may run on this machine.
stop_pidfile() {
    local pidfile=$1 pid t
    [[ -s $pidfile ]] || return 0
    pid=$(cat "$pidfile")
    if kill -TERM "$pid" 2>/dev/null; then
        for ((t = 0; t < 100; t++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

wait_idle() {
    local deadline=$((SECONDS + UP_TIMEOUT)) idle
    while :; do
        idle=$(SLURM_CONF=$CONF sinfo -h -t idle -o %D 2>/dev/null | head -n1)
        [[ ${idle:-0} -eq $NODES ]] && return 0
        if ((SECONDS >= deadline)); then
            SLURM_CONF=$CONF sinfo -N >&2 || true
            die "nodes not idle after ${UP_TIMEOUT}s; see $LAB/log/"
        fi
        sleep 0.5
    done
}

# ---- a slow node: a CPU quota on everything in its namespace ----------------------
# A cgroup per throttled node, under the cpu controller (v1: cpu.cfs_quota_us; v2: cpu.max). Its
# slurmd and every process running in the node move in; the steps slurmd starts later inherit it.
# The other nodes share one cgroup of FAVOUR times the default weight: the host's other work (a
# test suite's other worker) then cannot starve them down to the throttled node's speed, which
# would leave it nothing to be told apart from (CI saw a healthy node's GEMM at 23% of its own).
CG_PREFIX=rt-slurm-lab-
cpu_cgroup_root() {
    if [[ -e /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]]; then echo /sys/fs/cgroup/cpu
    elif grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then echo /sys/fs/cgroup
    else return 1; fi
}

node_number() {   # nI -> I, or fail
    [[ $1 =~ ^n([0-9]+)$ ]] && ((BASH_REMATCH[1] >= 1 && BASH_REMATCH[1] <= NODES)) || die "no node $1 (n1..n$NODES)"
    echo "${BASH_REMATCH[1]}"
}

cmd_slow() {
    local node=$1 root cg pid
    node_number "$node" >/dev/null
    [[ -e /run/netns/${NS_PREFIX}$node ]] || die "node $node is not up"
    root=$(cpu_cgroup_root) || die "no cgroup cpu controller to throttle with"
    cg=$root/$CG_PREFIX$node
    mkdir -p "$cg"
    if [[ -e $cg/cpu.cfs_quota_us ]]; then
        echo 100000 >"$cg/cpu.cfs_period_us"
        echo $((SLOW_PCT * 1000)) >"$cg/cpu.cfs_quota_us"
    else
        grep -qw cpu "$root/cgroup.subtree_control" || echo +cpu >"$root/cgroup.subtree_control"
        echo "$((SLOW_PCT * 1000)) 100000" >"$cg/cpu.max"
    fi
    for pid in $(ip netns pids "${NS_PREFIX}$node"); do echo "$pid" >"$cg/cgroup.procs" 2>/dev/null || true; done
    log "$node throttled to ${SLOW_PCT}% of one core ($cg)"
    favour_others "$root" "$node"
}

favour_others() {
    local root=$1 slow=$2 cg=$1/${CG_PREFIX}favoured i pid
    mkdir -p "$cg"
    if [[ -e $cg/cpu.shares ]]; then echo $((FAVOUR * 1024)) >"$cg/cpu.shares"; else echo $((FAVOUR * 100)) >"$cg/cpu.weight"; fi
    for ((i = 1; i <= NODES; i++)); do
        [[ n$i != "$slow" && -e /run/netns/${NS_PREFIX}n$i ]] || continue
        for pid in $(ip netns pids "${NS_PREFIX}n$i"); do echo "$pid" >"$cg/cgroup.procs" 2>/dev/null || true; done
    done
}

unfavour_others() {
    local root=$1 cg=$1/${CG_PREFIX}favoured pid
    [[ -d $cg ]] || return 0
    while read -r pid; do echo "$pid" >"$root/cgroup.procs" 2>/dev/null || true; done <"$cg/cgroup.procs"
    rmdir "$cg" 2>/dev/null || true  # a process exiting meanwhile: left in place, at a weight that harms nothing
}

cmd_heal() {
    local node=$1 root cg pid
    root=$(cpu_cgroup_root) || return 0
    unfavour_others "$root"
    cg=$root/$CG_PREFIX$node
    [[ -d $cg ]] || return 0
    # Unthrottled first: a process that cannot be moved out (exiting meanwhile) keeps running at full speed.
    if [[ -e $cg/cpu.cfs_quota_us ]]; then echo -1 >"$cg/cpu.cfs_quota_us"; else echo max >"$cg/cpu.max"; fi
    while read -r pid; do echo "$pid" >"$root/cgroup.procs" 2>/dev/null || true; done <"$cg/cgroup.procs"
    rmdir "$cg" 2>/dev/null || log "$node: $cg still holds processes; left in place, unthrottled"
    log "$node healed"
}

# ---- commands --------------------------------------------------------------------
cmd_up() {
    preflight
    start_munge
    setup_network
    # No controller running means the last testbed died without `down` (a killed
    # session, a reboot). Its saved jobs would be recovered and hold the nodes
    # "alloc" forever, so a cold start drops them and anything left in the nodes.
    if ! pid_alive "$LAB/slurmctld.pid"; then
        stop_namespace_processes KILL
        rm -rf "$LAB/state" "$LAB/spool" "$LAB/nodes"
    fi
    write_files
    start_daemons
    # A node left DOWN by an earlier unclean stop stays down otherwise.
    SLURM_CONF=$CONF scontrol update nodename="n[1-$NODES]" state=resume 2>/dev/null || true
    wait_idle
    log "up: $NODES nodes idle (lab $LAB)"
    echo "export SLURM_CONF=$CONF"
}

# Everything running inside a node's network namespace belongs to the testbed:
# slurmd, slurmstepd and the jobs' processes (Ray included).
stop_namespace_processes() {
    local sig=$1 i pids
    for ((i = 1; i <= NODES; i++)); do
        [[ -e /run/netns/${NS_PREFIX}n$i ]] || continue
        pids=$(ip netns pids "${NS_PREFIX}n$i" 2>/dev/null || true)
        [[ -z $pids ]] || xargs -r kill "-$sig" <<<"$pids" 2>/dev/null || true
    done
}

namespaces_empty() {
    local i
    for ((i = 1; i <= NODES; i++)); do
        [[ -e /run/netns/${NS_PREFIX}n$i ]] || continue
        [[ -z $(ip netns pids "${NS_PREFIX}n$i" 2>/dev/null || true) ]] || return 1
    done
}

cmd_down() {
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    local i t
    # Cancel jobs first so their cleanup runs; then stop whatever is left.
    if pid_alive "$LAB/slurmctld.pid"; then
        SLURM_CONF=$CONF scancel --quiet --user=root 2>/dev/null || true
        for ((t = 0; t < 60; t++)); do
            [[ -z $(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.5
        done
    fi
    for ((i = 1; i <= NODES; i++)); do stop_pidfile "$LAB/slurmd.n$i.pid"; done
    stop_namespace_processes TERM
    for ((t = 0; t < 50; t++)); do namespaces_empty && break; sleep 0.2; done
    stop_namespace_processes KILL
    for ((i = 1; i <= NODES; i++)); do cmd_heal "n$i"; done
    stop_pidfile "$LAB/slurmctld.pid"
    teardown_network
    # Job state is disposable; keep logs for post-mortems until the next `up`.
    rm -rf "$LAB/state" "$LAB/spool" "$LAB/nodes"
    log "down"
}

cmd_status() {
    local i
    echo "export SLURM_CONF=$CONF"
    pid_alive "$LAB/slurmctld.pid" && echo "slurmctld: running" || echo "slurmctld: stopped"
    for ((i = 1; i <= NODES; i++)); do
        pid_alive "$LAB/slurmd.n$i.pid" && echo "slurmd n$i: running" || echo "slurmd n$i: stopped"
    done
    if pid_alive "$LAB/slurmctld.pid"; then
        SLURM_CONF=$CONF sinfo -N
        SLURM_CONF=$CONF squeue
    fi
}

case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    slow) cmd_slow "${2:?usage: $0 slow NODE}" ;;
    heal) cmd_heal "${2:?usage: $0 heal NODE}" ;;
    *) die "usage: $0 up|down|status|slow NODE|heal NODE" ;;
esac
