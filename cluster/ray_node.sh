#!/usr/bin/env bash
# Start, check and stop one node of a private, per-job Ray cluster.
# Scheduler-neutral: slurm/ray_cluster.sbatch uses it, and PBS, LSF or plain-ssh
# setups can call it the same way on their own nodes.
#
#   ray_node.sh init     # create the job's private temp dir and a fresh auth token (head node)
#   ray_node.sh head     # run the Ray head here, in the foreground, until signalled
#   ray_node.sh worker   # run a Ray worker here; reads the token from stdin if it has no file
#   ray_node.sh wait     # poll until RAY_EXPECTED_NODES have joined; name the missing on timeout
#   ray_node.sh stop     # stop this job's Ray processes on this node, and only those
#   ray_node.sh env      # print the resolved settings for this node (KEY=value lines)
#
# Example without a scheduler (the token never appears in argv or env):
#   export RAY_CLUSTER_ID=42
#   head$ cluster/ray_node.sh init && cluster/ray_node.sh head &
#   head$ ssh n2 "RAY_CLUSTER_ID=42 RAY_HEAD_ADDRESS=<head ip>:<gcs port> cluster/ray_node.sh worker" \
#             <"$(cluster/ray_node.sh env RAY_AUTH_TOKEN_PATH)" &
#   head$ RAY_EXPECTED_NODES=2 RAY_HEAD_ADDRESS=... cluster/ray_node.sh wait
#
# Security: token auth is always on. The token lives in a 0600 file inside the
# job's 0700 temp dir; `worker` reads it from stdin when it has no file, so it
# never shows up in a command line. The dashboard listens on 127.0.0.1 only
# (with RAY_DASHBOARD=0 Ray 2.60 still runs one, without its web UI).
set -euo pipefail

# ---- knobs (env vars; defaults shown) -------------------------------------------
# RAY_CLUSTER_ID          =$SLURM_JOB_ID|$PBS_JOBID|$LSB_JOBID  names the temp dir, picks the port block
# RAY_TMPDIR              =$TMPDIR/rt-<id> if that is short, else /tmp/rt-<id>   node-local, private (0700)
# RAY_AUTH_TOKEN_PATH     =$RAY_TMPDIR/auth_token   token file (0600); created by `init`
# RAY_PORT_MIN            =20000   port blocks live in [MIN, MAX]: above the ports a default
# RAY_PORT_MAX            =32767     Ray uses (6379, 8265, 10001-19999), below the kernel's
#                                    ephemeral range (32768+) so no client socket takes ours
# RAY_PORT_BASE           =MIN + (id mod blocks) * 200   first port of this job's 200-port block
# RAY_NODE_IP             =(detected)  this node's IP; per node, so don't export it to all nodes
# RAY_NODE_IFACE          =(none)   take the node IP from this interface (multi-NIC nodes)
# RAY_NODE_NAME           =$SLURMD_NODENAME|$(hostname -s)   the name `wait` reports
# RAY_HEAD_ADDRESS        =(none)   head GCS ip:port; needed by worker and wait
# RAY_NUM_CPUS            =$SLURM_CPUS_PER_TASK|$SLURM_CPUS_ON_NODE|$(nproc)
# RAY_NUM_GPUS            =#CUDA_VISIBLE_DEVICES|$SLURM_GPUS_ON_NODE|0 under Slurm|Ray's detection
# RAY_OBJECT_STORE_BYTES  =min(30% of node memory (or $SLURM_MEM_PER_NODE), 80% of free /dev/shm)
# RAY_DASHBOARD           =0        1: run the dashboard, bound to 127.0.0.1 only
# RAY_EXPECTED_NODES      =(none)   for wait: node names ("n1 n2") or a count
# RAY_JOIN_TIMEOUT        =120      seconds: worker waiting for the head, and `wait`
# RAY_STOP_TIMEOUT        =15       seconds `stop` waits before SIGKILL
# RAY_KEEP_TMPDIR         =0        1: keep the temp dir (Ray's logs) when the node stops
# RAY_START_EXTRA_ARGS    =(none)   extra `ray start` flags, split on spaces
# RAY_worker_niceness     =0        the ranks' niceness (Ray's own default is 15: any nice-0
#                                    process on the node, a loader worker of another job, wins)
# RAY_BIN                 =ray      the `ray` CLI
# RAY_PYTHON              =the python beside $RAY_BIN, else python3
# NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME  =the interface that carries RAY_NODE_IP
RAY_CLUSTER_ID=${RAY_CLUSTER_ID:-${SLURM_JOB_ID:-${PBS_JOBID:-${LSB_JOBID:-}}}}
RAY_PORT_MIN=${RAY_PORT_MIN:-20000}
RAY_PORT_MAX=${RAY_PORT_MAX:-32767}
RAY_NODE_IP=${RAY_NODE_IP:-}
RAY_NODE_IFACE=${RAY_NODE_IFACE:-}
RAY_NODE_NAME=${RAY_NODE_NAME:-${SLURMD_NODENAME:-$(hostname -s)}}
RAY_HEAD_ADDRESS=${RAY_HEAD_ADDRESS:-}
RAY_DASHBOARD=${RAY_DASHBOARD:-0}
RAY_EXPECTED_NODES=${RAY_EXPECTED_NODES:-}
RAY_JOIN_TIMEOUT=${RAY_JOIN_TIMEOUT:-120}
RAY_STOP_TIMEOUT=${RAY_STOP_TIMEOUT:-15}
RAY_KEEP_TMPDIR=${RAY_KEEP_TMPDIR:-0}
RAY_START_EXTRA_ARGS=${RAY_START_EXTRA_ARGS:-}
RAY_worker_niceness=${RAY_worker_niceness:-0}
RAY_BIN=${RAY_BIN:-ray}

readonly PORT_BLOCK=200          # ports B..B+10 for services, B+100..B+199 for worker processes
readonly SOCKET_PATH_MAX=107     # AF_UNIX sun_path limit (108 bytes with the NUL)
# What Ray appends to the temp dir for its longest socket:
# /ray/session_2025-01-01_00-00-00_123456_1234567/sockets/plasma_store
readonly SOCKET_SUFFIX_LEN=70

ROLE=${1:-}
log() { echo "ray_node[$ROLE@$RAY_NODE_NAME]: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---- derived settings --------------------------------------------------------------
resolve_python() {
    if [[ -n ${RAY_PYTHON:-} ]]; then return; fi
    local ray_path
    ray_path=$(command -v "$RAY_BIN" || true)
    [[ -n $ray_path ]] || die "'$RAY_BIN' not found; activate the venv with Ray or set RAY_BIN"
    if [[ -x $(dirname "$ray_path")/python ]]; then
        RAY_PYTHON=$(dirname "$ray_path")/python
    else
        RAY_PYTHON=python3
    fi
}

resolve_tmpdir() {
    [[ -n $RAY_CLUSTER_ID ]] || die "RAY_CLUSTER_ID is empty: set it to the job id (it names the temp dir and picks the ports)"
    local limit=$((SOCKET_PATH_MAX - SOCKET_SUFFIX_LEN)) candidate
    if [[ -z ${RAY_TMPDIR:-} ]]; then
        # $TMPDIR is often the scheduler's per-job scratch; use it unless its path
        # would push Ray's socket paths past the 107-byte limit.
        candidate="${TMPDIR:-/tmp}"
        RAY_TMPDIR="${candidate%/}/rt-$RAY_CLUSTER_ID"
        ((${#RAY_TMPDIR} <= limit)) || RAY_TMPDIR="/tmp/rt-$RAY_CLUSTER_ID"
    fi
    ((${#RAY_TMPDIR} <= limit)) ||
        die "RAY_TMPDIR=$RAY_TMPDIR is ${#RAY_TMPDIR} chars; Ray's socket paths would exceed $SOCKET_PATH_MAX bytes. Use a path of at most $limit chars."
    RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH:-$RAY_TMPDIR/auth_token}
}

resolve_ports() {
    if [[ -z ${RAY_PORT_BASE:-} ]]; then
        local id_num blocks
        # Job ids are numbers on Slurm/LSF and "123.server" on PBS; hash anything else.
        id_num=${RAY_CLUSTER_ID%%[!0-9]*}
        [[ -n $id_num ]] || id_num=$(printf '%s' "$RAY_CLUSTER_ID" | cksum | cut -d' ' -f1)
        blocks=$(((RAY_PORT_MAX - RAY_PORT_MIN + 1) / PORT_BLOCK))
        ((blocks > 0)) || die "RAY_PORT_MIN..RAY_PORT_MAX holds no $PORT_BLOCK-port block"
        RAY_PORT_BASE=$((RAY_PORT_MIN + (10#$id_num % blocks) * PORT_BLOCK))
    fi
    ((RAY_PORT_BASE > 0 && RAY_PORT_BASE + PORT_BLOCK <= 65536)) || die "RAY_PORT_BASE=$RAY_PORT_BASE is out of range"
    GCS_PORT=$RAY_PORT_BASE
}

iface_ip() {   # first global IPv4 address of interface $1
    { ip -4 -o addr show dev "$1" scope global 2>/dev/null || true; } | awk '{split($4, a, "/"); print a[1]; exit}'
}

ip_iface() {   # interface that carries IPv4 address $1
    { ip -4 -o addr show 2>/dev/null || true; } | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}'
}

resolve_node_ip() {
    NODE_IP_SOURCE=RAY_NODE_IP
    if [[ -n $RAY_NODE_IP ]]; then
        return
    elif [[ -n $RAY_NODE_IFACE ]]; then
        RAY_NODE_IP=$(iface_ip "$RAY_NODE_IFACE")
        NODE_IP_SOURCE="interface $RAY_NODE_IFACE"
        [[ -n $RAY_NODE_IP ]] || die "interface '$RAY_NODE_IFACE' has no IPv4 address on this node (see: ip -4 addr)"
    elif [[ -n $RAY_HEAD_ADDRESS && $ROLE != head ]]; then
        # The source address the kernel uses to reach the head is, by
        # construction, on a network the head can reach back on.
        RAY_NODE_IP=$({ ip -4 route get "${RAY_HEAD_ADDRESS%:*}" 2>/dev/null || true; } |
            awk '{for (i = 1; i < NF; i++) if ($i == "src") {print $(i + 1); exit}}')
        NODE_IP_SOURCE="route to the head"
    fi
    if [[ -z $RAY_NODE_IP ]]; then
        # Head: the address the cluster's name service gives this host, which is
        # what other nodes will use; skip loopback entries from /etc/hosts.
        RAY_NODE_IP=$({ getent ahostsv4 "$(hostname)" 2>/dev/null || true; } | awk '$1 !~ /^127\./ {print $1; exit}')
        NODE_IP_SOURCE="hostname lookup"
    fi
    if [[ -z $RAY_NODE_IP ]]; then
        RAY_NODE_IP=$({ hostname -I 2>/dev/null || true; } | awk '{print $1}')
        NODE_IP_SOURCE="first address of hostname -I"
    fi
    [[ -n $RAY_NODE_IP ]] || die "cannot find this node's IP; set RAY_NODE_IFACE or RAY_NODE_IP"
}

resolve_resources() {
    if [[ -z ${RAY_NUM_CPUS:-} ]]; then
        # The allocation, never the whole machine (nproc honours CPU affinity).
        RAY_NUM_CPUS=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
    fi
    if [[ -z ${RAY_NUM_GPUS:-} ]]; then
        if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
            # Slurm sets it to the GPUs of this step; Ray then numbers GPUs within it.
            if [[ -z $CUDA_VISIBLE_DEVICES || $CUDA_VISIBLE_DEVICES == NoDevFiles ]]; then
                RAY_NUM_GPUS=0
            else
                RAY_NUM_GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
            fi
        elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
            RAY_NUM_GPUS=$SLURM_GPUS_ON_NODE
        elif [[ -n ${SLURM_JOB_ID:-} ]]; then
            RAY_NUM_GPUS=0   # no GPUs allocated: don't let Ray count other jobs' GPUs
        fi
    fi
    if [[ -z ${RAY_OBJECT_STORE_BYTES:-} ]]; then
        # Explicit, so a small /dev/shm never makes Ray fail or fall back to disk
        # silently, and two jobs on one node never each claim 30% of all memory.
        local mem_bytes shm_free_bytes
        if [[ -n ${SLURM_MEM_PER_NODE:-} ]]; then
            mem_bytes=$((SLURM_MEM_PER_NODE * 1024 * 1024))
        else
            mem_bytes=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 1024))
        fi
        shm_free_bytes=$(($(df -Pk /dev/shm | awk 'NR == 2 {print $4}') * 1024))
        RAY_OBJECT_STORE_BYTES=$((mem_bytes * 3 / 10))
        ((shm_free_bytes * 8 / 10 >= RAY_OBJECT_STORE_BYTES)) || RAY_OBJECT_STORE_BYTES=$((shm_free_bytes * 8 / 10))
        ((RAY_OBJECT_STORE_BYTES >= 100 * 1024 * 1024)) ||
            die "only $((RAY_OBJECT_STORE_BYTES >> 20)) MiB for Ray's object store (/dev/shm is small?); set RAY_OBJECT_STORE_BYTES"
    fi
}

resolve_all() {
    resolve_tmpdir
    resolve_ports
    resolve_node_ip
    resolve_resources
    # NCCL and Gloo pick an interface on their own, often the wrong one (docker0,
    # lo, a management NIC). Default them to the one Ray uses, unless the user chose.
    local iface=${RAY_NODE_IFACE:-$(ip_iface "$RAY_NODE_IP")}
    if [[ -n $iface ]]; then
        export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$iface}
        export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$iface}
    fi
}

# ---- the private temp dir and the token -------------------------------------------
# The dir holds the token and Ray's sockets, so it must be ours alone: created
# 0700, never a symlink, never someone else's (a shared /tmp/ray owned by another
# user is a classic failure), and never shared with another node.
prepare_tmpdir() {
    local marker="$RAY_TMPDIR/.raytrain-node"
    if mkdir -m 0700 "$RAY_TMPDIR" 2>/dev/null; then
        printf '%s\n' "$RAY_NODE_NAME" >"$marker"
        return
    fi
    [[ ! -L $RAY_TMPDIR && -d $RAY_TMPDIR ]] || die "cannot create $RAY_TMPDIR (exists and is not a directory, or parent missing)"
    local owner mode
    owner=$(stat -c %u "$RAY_TMPDIR")
    mode=$(stat -c %a "$RAY_TMPDIR")
    [[ $owner == "$(id -u)" ]] ||
        die "$RAY_TMPDIR belongs to uid $owner, not you (stale or someone else's); remove it or set RAY_TMPDIR"
    [[ $mode == 700 ]] || die "$RAY_TMPDIR has mode $mode, must be 700; remove it or set RAY_TMPDIR"
    if [[ -s $marker && $(<"$marker") != "$RAY_NODE_NAME" ]]; then
        die "$RAY_TMPDIR is also used by node $(<"$marker"): this filesystem is shared between nodes; set RAY_TMPDIR to node-local storage"
    fi
    [[ -s $marker ]] || printf '%s\n' "$RAY_NODE_NAME" >"$marker"
}

write_token() {   # stdin -> token file, 0600, no trailing newline
    local token
    IFS= read -r token || [[ -n $token ]] || true
    [[ -n $token ]] || return 1
    (umask 077 && printf '%s' "$token" >"$RAY_AUTH_TOKEN_PATH")
}

new_token() {     # 32 random bytes as 64 hex chars
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n'
}

# ---- ports --------------------------------------------------------------------------
# Ray's gRPC servers set SO_REUSEPORT, so a second job on the same ports binds
# *without error* and clients land on either cluster at random. A bind probe
# without SO_REUSEPORT fails on any such listener, so clashes surface here.
check_ports_free() {
    local busy
    busy=$("$RAY_PYTHON" - "$RAY_PORT_BASE" "$PORT_BLOCK" <<'PY'
import socket, sys
base, size = int(sys.argv[1]), int(sys.argv[2])
busy = []
for port in list(range(base, base + 11)) + list(range(base + 100, base + size)):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
    try:
        s.bind(("", port))
    except OSError:
        busy.append(str(port))
    finally:
        s.close()
print(" ".join(busy))
PY
)
    [[ -z $busy ]] ||
        die "ports in use on this node: $busy (another job or a stale Ray?). Set RAY_PORT_BASE to a free $PORT_BLOCK-port block, or find the owner with: ss -ltnp"
}

ray_client_available() {   # `ray start` refuses --ray-client-server-port without grpc
    "$RAY_PYTHON" -c 'import grpc' 2>/dev/null
}

wait_for_port() {   # host port timeout_s -> 0 when something accepts TCP connections
    local host=$1 port=$2 deadline=$((SECONDS + $3))
    while ((SECONDS < deadline)); do
        # timeout: a SYN to an unreachable host otherwise hangs for minutes.
        # shellcheck disable=SC2016  # $1/$2 expand in the inner bash
        if timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    return 1
}

# ---- running a node -----------------------------------------------------------------
ray_start_args() {   # fills the global array START_ARGS for $ROLE
    local b=$RAY_PORT_BASE
    START_ARGS=(
        --node-ip-address="$RAY_NODE_IP"
        --node-name="$RAY_NODE_NAME"
        --num-cpus="$RAY_NUM_CPUS"
        --object-store-memory="$RAY_OBJECT_STORE_BYTES"
        --temp-dir="$RAY_TMPDIR/ray"
        --node-manager-port=$((b + 1))
        --object-manager-port=$((b + 2))
        --dashboard-agent-listen-port=$((b + 4))
        --dashboard-agent-grpc-port=$((b + 5))
        --metrics-export-port=$((b + 6))
        --runtime-env-agent-port=$((b + 7))
        --min-worker-port=$((b + 100))
        --max-worker-port=$((b + PORT_BLOCK - 1))
        --disable-usage-stats
        --block
    )
    [[ -z ${RAY_NUM_GPUS:-} ]] || START_ARGS+=(--num-gpus="$RAY_NUM_GPUS")
    if [[ $ROLE == head ]]; then
        START_ARGS+=(--head --port="$GCS_PORT" --dashboard-host=127.0.0.1 --dashboard-port=$((b + 8)))
        if [[ $RAY_DASHBOARD == 1 ]]; then
            START_ARGS+=(--include-dashboard=true)
        else
            START_ARGS+=(--include-dashboard=false)
        fi
        # Left at its default, the Ray Client server of every job binds 10001.
        if ray_client_available; then START_ARGS+=(--ray-client-server-port=$((b + 3))); fi
    else
        START_ARGS+=(--address="$RAY_HEAD_ADDRESS")
    fi
    if [[ -n $RAY_START_EXTRA_ARGS ]]; then
        local extra
        read -r -a extra <<<"$RAY_START_EXTRA_ARGS"
        START_ARGS+=("${extra[@]}")
    fi
}

export_auth_env() {
    # Explicit token auth: with RAY_AUTH_MODE unset, `ray start --head` decides
    # from whatever token it happens to find (~/.ray/auth_token, ...), and a
    # client that names an address does not turn auth on by itself.
    export RAY_AUTH_MODE=token
    export RAY_AUTH_TOKEN_PATH
    unset RAY_AUTH_TOKEN                     # it would win over the file
    export RAY_USAGE_STATS_ENABLED=0
}

export_node_env() {
    export_auth_env
    # SIGTERM otherwise waits up to 30 s for the node to drain.
    export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
    # The node's workers (the ranks, and their loader workers) at the priority torchrun's get.
    export RAY_worker_niceness
    # Head-only ports that have no flag; harmless on workers.
    export AUTOSCALER_METRIC_PORT=$((RAY_PORT_BASE + 9))
    export DASHBOARD_METRIC_PORT=$((RAY_PORT_BASE + 10))
    export RAY_TMPDIR
}

print_ray_logs() {   # the tails that usually say why a node died
    local logs="$RAY_TMPDIR/ray/session_latest/logs" f
    for f in "$RAY_TMPDIR/ray_start.out" "$logs"/raylet.err "$logs"/gcs_server.err "$logs"/raylet.out; do
        [[ -s $f ]] || continue
        log "--- last lines of $f"
        tail -n 15 "$f" >&2 || true
    done
}

cleanup_node() {
    rm -f "$RAY_TMPDIR/ray_node.pid"
    if [[ $RAY_KEEP_TMPDIR == 1 ]]; then
        rm -f "$RAY_AUTH_TOKEN_PATH"
    elif [[ -f $RAY_TMPDIR/.raytrain-node ]]; then
        rm -rf "$RAY_TMPDIR"                 # only a dir we created (it has our marker)
    fi
}

run_node() {
    resolve_python
    resolve_all
    prepare_tmpdir
    # From here on the dir holds a token: remove it however this script ends,
    # and stop at once if the scheduler cancels us before Ray runs.
    trap cleanup_node EXIT
    trap 'exit 143' TERM INT HUP
    if [[ ! -s $RAY_AUTH_TOKEN_PATH ]]; then
        if [[ $ROLE == head ]]; then
            new_token | write_token
        elif [[ -t 0 ]] || ! write_token; then
            die "no auth token: put the head's token in $RAY_AUTH_TOKEN_PATH or pipe it on stdin"
        fi
    fi
    if [[ $ROLE == worker ]]; then
        [[ -n $RAY_HEAD_ADDRESS ]] || die "RAY_HEAD_ADDRESS (head ip:port) is not set"
        log "waiting for the head at $RAY_HEAD_ADDRESS (up to ${RAY_JOIN_TIMEOUT}s)"
        wait_for_port "${RAY_HEAD_ADDRESS%:*}" "${RAY_HEAD_ADDRESS##*:}" "$RAY_JOIN_TIMEOUT" ||
            die "the head's GCS at $RAY_HEAD_ADDRESS did not accept connections within ${RAY_JOIN_TIMEOUT}s"
    fi
    check_ports_free
    export_node_env
    ray_start_args
    log "ip $RAY_NODE_IP ($NODE_IP_SOURCE), cpus $RAY_NUM_CPUS, gpus ${RAY_NUM_GPUS:-auto}," \
        "object store $((RAY_OBJECT_STORE_BYTES >> 20)) MiB, ports $RAY_PORT_BASE-$((RAY_PORT_BASE + PORT_BLOCK - 1)), tmp $RAY_TMPDIR"

    echo "$$" >"$RAY_TMPDIR/ray_node.pid"
    export RAYTRAIN_RAY_NODE=$RAY_TMPDIR     # tags every Ray process of this node, for `stop`
    # Ray's INFO chatter (including its advice to run `ray stop`, which would
    # stop every Ray on the node) goes to a file; warnings and errors still
    # reach the job log on stderr, and the file's tail is shown on failure.
    "$RAY_BIN" start "${START_ARGS[@]}" </dev/null >"$RAY_TMPDIR/ray_start.out" &
    local ray_pid=$! status stopping=0
    # `ray start --block` stops every process of this node when it gets SIGTERM.
    trap 'stopping=1; kill -TERM "$ray_pid" 2>/dev/null || true' TERM INT HUP
    while :; do
        status=0
        wait "$ray_pid" || status=$?
        kill -0 "$ray_pid" 2>/dev/null || break      # else a trapped signal woke us
    done
    if ((stopping == 0)); then
        log "ray start exited with status $status"
        print_ray_logs
        ((status != 0)) || status=1              # a node that stops on its own is a failure
    else
        status=0
    fi
    exit "$status"                               # the EXIT trap removes the temp dir
}

# ---- wait for nodes to join ------------------------------------------------------------
cmd_wait() {
    resolve_python
    resolve_tmpdir
    [[ -n $RAY_HEAD_ADDRESS ]] || die "RAY_HEAD_ADDRESS (head ip:port) is not set"
    [[ -n $RAY_EXPECTED_NODES ]] || die "RAY_EXPECTED_NODES (node names, or a count) is not set"
    local start=$SECONDS
    wait_for_port "${RAY_HEAD_ADDRESS%:*}" "${RAY_HEAD_ADDRESS##*:}" "$RAY_JOIN_TIMEOUT" ||
        die "the head's GCS at $RAY_HEAD_ADDRESS did not accept connections within ${RAY_JOIN_TIMEOUT}s"
    export_auth_env
    # Polls Ray's own view of the cluster. The outer timeout is a backstop in
    # case connecting itself hangs. The poll gets what is left of the budget, and
    # its error names the budget the user set, not what was left of it.
    timeout $((RAY_JOIN_TIMEOUT + 30)) "$RAY_PYTHON" - "$RAY_HEAD_ADDRESS" "$RAY_EXPECTED_NODES" \
        "$RAY_JOIN_TIMEOUT" $((RAY_JOIN_TIMEOUT - (SECONDS - start))) \
        "ray_node[$ROLE@$RAY_NODE_NAME]" <<'PY'
import sys, time, logging
import ray

address, expected, timeout_s, left_s, prefix = (
    sys.argv[1], sys.argv[2].split(), sys.argv[3], float(sys.argv[4]), sys.argv[5])
deadline = time.monotonic() + max(left_s, 1.0)

def fail(message):
    print(f"{prefix}: ERROR: {message}", file=sys.stderr)
    sys.exit(1)

try:
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
except Exception as e:  # a head that died meanwhile, a wrong token, ...
    fail(f"cannot connect to the head at {address}: {type(e).__name__}: {str(e)[:300]}")

while True:
    try:
        alive = sorted(n["NodeName"] for n in ray.nodes() if n["Alive"])
    except Exception as e:
        fail(f"lost the head at {address}: {type(e).__name__}: {str(e)[:300]}")
    if len(expected) == 1 and expected[0].isdigit():
        want = int(expected[0])
        missing = [f"{want - len(alive)} more node(s)"] if len(alive) < want else []
    else:
        missing = [name for name in expected if name not in alive]
    if not missing:
        print(f"{prefix}: all {len(alive)} nodes joined: {' '.join(alive)}", file=sys.stderr)
        sys.exit(0)
    if time.monotonic() >= deadline:
        fail(f"node(s) did not join within {timeout_s}s: {' '.join(missing)}"
             f" (joined: {' '.join(alive) or 'none'})")
    time.sleep(1)
PY
}

# ---- stop this job's Ray processes on this node ---------------------------------------
# Never `ray stop`: it stops every Ray on the node, other users' and jobs' included.
job_pids() {   # this job's Ray processes: those naming our temp dir, plus descendants
    # The path goes in through the environment: in awk's own argv it would match awk.
    local tagged
    # Every process `ray start` spawned carries RAYTRAIN_RAY_NODE in its
    # environment, even workers whose raylet already died (orphans).
    tagged=$(grep -lzxF "RAYTRAIN_RAY_NODE=$RAY_TMPDIR" /proc/[0-9]*/environ 2>/dev/null |
        cut -d/ -f3 | tr '\n' ' ' || true)
    # The path goes in through the environment: in awk's own argv it would match awk.
    ps -ww -e -o pid=,ppid=,uid=,args= | DIR="$RAY_TMPDIR/ray" TAGGED=" $tagged" awk -v uid="$(id -u)" -v self=$$ '
        { pid[NR] = $1; ppid[NR] = $2; line = $0 " "; dir = ENVIRON["DIR"]
          if ($3 == uid && $1 != self &&
              (index(line, dir "/") || index(line, dir " ") || index(ENVIRON["TAGGED"], " " $1 " ")))
              mark[$1] = 1 }
        END {
            do { grew = 0
                 for (i = 1; i <= NR; i++)
                     if ((ppid[i] in mark) && !(pid[i] in mark)) { mark[pid[i]] = 1; grew = 1 }
            } while (grew)
            for (p in mark) print p }'
}

cmd_stop() {
    resolve_tmpdir
    local pidfile="$RAY_TMPDIR/ray_node.pid" pids t
    if [[ -s $pidfile ]]; then
        kill -TERM "$(<"$pidfile")" 2>/dev/null || true   # the head/worker wrapper stops Ray itself
    fi
    for ((t = 0; t < RAY_STOP_TIMEOUT * 5; t++)); do
        pids=$(job_pids)
        [[ -n $pids ]] || break
        if ((t == 0)); then
            log "stopping processes of $RAY_TMPDIR: ${pids//$'\n'/ }"
            xargs -r kill -TERM <<<"$pids" 2>/dev/null || true
        fi
        sleep 0.2
    done
    pids=$(job_pids)
    if [[ -n $pids ]]; then
        log "SIGKILL to leftover processes: $(tr '\n' ' ' <<<"$pids")"
        xargs -r kill -KILL <<<"$pids" 2>/dev/null || true
    fi
    cleanup_node
}

cmd_env() {
    resolve_python
    resolve_all
    local -A values=(
        [RAY_CLUSTER_ID]=$RAY_CLUSTER_ID [RAY_TMPDIR]=$RAY_TMPDIR
        [RAY_AUTH_TOKEN_PATH]=$RAY_AUTH_TOKEN_PATH [RAY_PORT_BASE]=$RAY_PORT_BASE
        [RAY_GCS_PORT]=$GCS_PORT [RAY_NODE_NAME]=$RAY_NODE_NAME [RAY_NODE_IP]=$RAY_NODE_IP
        [RAY_NODE_IP_SOURCE]=$NODE_IP_SOURCE [RAY_NUM_CPUS]=$RAY_NUM_CPUS
        [RAY_NUM_GPUS]=${RAY_NUM_GPUS:-auto} [RAY_OBJECT_STORE_BYTES]=$RAY_OBJECT_STORE_BYTES
        [NCCL_SOCKET_IFNAME]=${NCCL_SOCKET_IFNAME:-} [GLOO_SOCKET_IFNAME]=${GLOO_SOCKET_IFNAME:-}
        [RAY_PYTHON]=$RAY_PYTHON
    )
    if [[ -n ${2:-} ]]; then
        [[ -n ${values[$2]+set} ]] || die "unknown setting '$2'"
        printf '%s\n' "${values[$2]}"
        return
    fi
    local key
    for key in $(printf '%s\n' "${!values[@]}" | sort); do printf '%s=%s\n' "$key" "${values[$key]}"; done
}

case $ROLE in
    init)
        resolve_tmpdir
        prepare_tmpdir
        new_token | write_token
        ;;
    head | worker) run_node ;;
    wait) cmd_wait ;;
    stop) cmd_stop ;;
    env) cmd_env "$@" ;;
    *) echo "usage: $0 init|head|worker|wait|stop|env [NAME]" >&2; exit 2 ;;
esac
