#!/usr/bin/env bash
# Local SLURM on one machine for opskit's tests and demos: a single node on localhost (the default), or
# a cluster of N nodes, each a network + UTS + mount namespace of its own.
#
#   scripts/local-slurm.sh start|stop|status [--nodes N]
#
# Single node (no --nodes, or --nodes 1): munged + slurmctld + slurmd on localhost. State (slurm.conf,
# state save, spool, pid files, logs, job completion file) lives in ${OPSKIT_SLURM_DIR:-/var/lib/opskit-slurm}.
# /etc/slurm/slurm.conf (where SLURM's commands look by default) is a symlink to the slurm.conf there,
# so sbatch/squeue/... work in any new shell.
#
# N nodes (--nodes N, N >= 2): slurmctld and a private munged on the host, and per node one slurmd
# started with `nsenter --net=<its netns> unshare --uts --mount`: hostname nodeI, address
# <subnet>.(10+I) on a bridge whose host address is <subnet>.1, and /etc/hosts bind-mounted from
# <state>/hosts (node1..nodeN and the controller), so the names resolve on every node and the host's
# /etc/hosts is never touched (the host itself does not resolve nodeI; jobs run on the nodes).
# State lives in ${OPSKIT_SLURM_DIR:-/var/lib/opskit-slurm-multinode}; clients need
# SLURM_CONF=<state>/slurm.conf (/etc/slurm/slurm.conf stays the single-node cluster's). It runs beside
# the single-node cluster: own ClusterName, SlurmctldPort, munged socket (AuthInfo=socket=...), a /24 in
# 10.77.0.0/16 that no host address or route uses, and names with a tag from the state dir's path
# (bridge osk<tag>br, veths osk<tag>v<I>, namespaces opskit-<tag>-node<I>). start records what it
# creates in <state>/created and stop removes exactly that. SlurmdTimeout=10: a dead slurmd's node is
# marked down within ~15 s. stop/status find N in <state>/nodes (written by start), so for a state dir
# given by OPSKIT_SLURM_DIR they need no --nodes; without it, `--nodes N` (any N >= 2) picks the
# multi-node default dir.
#
# Needs root for start/stop; no systemd needed.
set -euo pipefail

usage() {
    echo "usage: $0 start|stop|status [--nodes N]" >&2
    exit 2
}

ACTION=${1:-}
[[ $# -gt 0 ]] && shift
NODES=""
while (($#)); do
    case $1 in
    --nodes)
        [[ $# -ge 2 ]] || usage
        NODES=$2
        shift 2
        ;;
    --nodes=*)
        NODES=${1#--nodes=}
        shift
        ;;
    *) usage ;;
    esac
done
MAX_NODES=64                           # node addresses are <subnet>.11 ... <subnet>.74
if [[ -n $NODES ]] && ! { [[ $NODES =~ ^[1-9][0-9]*$ ]] && ((NODES <= MAX_NODES)); }; then
    printf 'local-slurm: --nodes: expected a whole number from 1 to %s, got %s\n' "$MAX_NODES" "'$NODES'" >&2
    exit 2
fi
# The default state dir depends on the kind of cluster asked for; a state dir records its node count.
if [[ -z ${OPSKIT_SLURM_DIR:-} && ${NODES:-1} -gt 1 ]]; then
    STATE_DIR=/var/lib/opskit-slurm-multinode
else
    STATE_DIR="${OPSKIT_SLURM_DIR:-/var/lib/opskit-slurm}"
fi
NODES_FILE="$STATE_DIR/nodes"
RECORDED_NODES=$(cat "$NODES_FILE" 2>/dev/null || true)
NODES=${NODES:-${RECORDED_NODES:-1}}

CONF_LINK=/etc/slurm/slurm.conf
CONF="$STATE_DIR/slurm.conf"
CONF_MARKER="# Written by opskit scripts/local-slurm.sh"
# Whether a user other than root (munged runs as munge) can reach PATH: every existing folder on the way lets
# others in. A clone under a mode-700 home (/root) does not.
others_can_reach() {
    local dir
    dir=$(realpath -m "$1")
    while [[ ! -d $dir ]]; do dir=$(dirname "$dir"); done
    while :; do
        [[ $(stat -c %A "$dir") == *[xt] ]] || return 1
        [[ $dir == / ]] && return 0
        dir=$(dirname "$dir")
    done
}
# munged's pid/log files (the single node's socket stays in /run/munge): in the state dir (made mode 755 by start)
# where the munge user can reach it, else in /run under a tag of the state dir's path (one per state dir, as stop
# expects).
if others_can_reach "$(dirname "$(realpath -m "$STATE_DIR")")"; then
    MUNGE_DIR="$STATE_DIR/munge"
else
    MUNGE_DIR="/run/opskit-munge-$(realpath -m "$STATE_DIR" | sha1sum | cut -c1-6)"
fi
MUNGE_PID="$MUNGE_DIR/munged.pid"
# slurmd's spool holds each step's Unix socket, SPOOL/nodeN/nodeN_JOB.STEP, whose path may not pass 107 bytes: a state
# dir deep in a home folder moves it to /run (one per state dir; stop removes it).
SPOOL_DIR="$STATE_DIR/spool"
if (($(realpath -m "$SPOOL_DIR" | wc -c) > 60)); then
    SPOOL_DIR="/run/opskit-spool-$(realpath -m "$STATE_DIR" | sha1sum | cut -c1-6)"
fi
MUNGE_SOCKET=""                        # empty: munge's default socket (single node)
CTLD_PID="$STATE_DIR/slurmctld.pid"
SLURMD_PID="$STATE_DIR/slurmd.pid"
READY_TIMEOUT=20                       # seconds to wait for the node to become usable
STOP_TIMEOUT=10                        # seconds between SIGTERM and SIGKILL

# Daemons live in /usr/sbin, which a non-login PATH may lack.
export PATH="/usr/sbin:/sbin:$PATH"
# Talk to our cluster, whatever SLURM_CONF the caller has exported.
export SLURM_CONF="$CONF_LINK"

if ((NODES > 1)); then
    export SLURM_CONF="$CONF"
    MUNGE_SOCKET="$MUNGE_DIR/munge.socket"   # a private munged: the single-node cluster owns the default one
    CREATED="$STATE_DIR/created"             # "netns NAME" / "link NAME", one a line, in creation order
    NET_FILE="$STATE_DIR/net.env"            # SUBNET and CTLD_PORT picked by the first start
    HOSTS="$STATE_DIR/hosts"                 # bind-mounted on /etc/hosts in every node
    SLURMD_PORT=6818                         # each node has its own network namespace: no clash
    CLUSTER_NAME=opskit-multinode
    # Names carry a tag of the state dir's path: two clusters never share, and stop never touches, a name.
    TAG=$(realpath -m "$STATE_DIR" | sha1sum | cut -c1-6)
    BRIDGE="osk${TAG}br"
    READY_TIMEOUT=$((20 + 2 * NODES))
fi

log() { printf '%s\n' "$*"; }
die() { printf 'local-slurm: %s\n' "$1" >&2; exit "${2:-1}"; }

# PID of a live (non-zombie) process NAME recorded in PIDFILE, else nothing.
# PID 1 here reaps slowly, so `kill -0` also succeeds on zombies: read the state from /proc.
pid_of() {
    local name=$1 pidfile=$2 pid stat
    [[ -r $pidfile ]] || return 0
    pid=$(tr -dc '0-9' <"$pidfile")
    [[ -n $pid ]] || return 0
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 0
    [[ ${stat##*) } == Z* ]] && return 0
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 0
    printf '%s\n' "$pid"
}

alive() {  # alive PID: true while PID exists and is not a zombie
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    [[ ${stat##*) } != Z* ]]
}

# Live (non-zombie) processes called NAME, space separated. Reads /proc itself: pgrep also lists
# zombies, and procps is not installed on minimal Debian.
live_pids() {
    local dir comm out=""
    for dir in /proc/[0-9]*; do
        comm=$(cat "$dir/comm" 2>/dev/null) || continue
        [[ $comm == "$1" ]] && alive "${dir#/proc/}" && out+="${dir#/proc/} "
    done
    printf '%s' "${out% }"
}

# The -f argument PID's daemon was started with (its slurm.conf), or nothing.
conf_of() {
    local args=() i
    mapfile -d '' args <"/proc/$1/cmdline" 2>/dev/null || return 0
    for ((i = 1; i < ${#args[@]} - 1; i++)); do
        [[ ${args[i]} == -f ]] && printf '%s' "${args[i + 1]}" && return 0
    done
    return 0
}

# Live daemons NAME of this cluster: single node, those started without -f (they read /etc/slurm/slurm.conf)
# or with our conf; N nodes, those started with -f our conf. A multi-node cluster's daemons run beside.
cluster_pids() {
    local pid conf out=""
    for pid in $(live_pids "$1"); do
        conf=$(conf_of "$pid")
        if ((NODES > 1)); then
            [[ $conf == "$CONF" ]] && out+="$pid "
        elif [[ -z $conf || $conf == "$CONF" ]]; then
            out+="$pid "
        fi
    done
    printf '%s' "${out% }"
}

# Our nodes' network namespaces, one path a line (none for the single node: it is the host's).
node_netns_paths() {
    ((NODES > 1)) || return 0
    local i
    for ((i = 1; i <= NODES; i++)); do
        [[ -e /run/netns/$(node_netns "$i") ]] && printf '/run/netns/%s\n' "$(node_netns "$i")"
    done
    return 0
}

# Live job step daemons of this cluster: those in the host's network namespace (single node) or in
# our nodes' namespaces (N nodes).
stepd_pids() {
    local want=() pid ns out=""
    if ((NODES > 1)); then
        local path
        while read -r path; do
            [[ -n $path ]] && want+=("net:[$(stat -L -c %i "$path")]")
        done < <(node_netns_paths)
    else
        want=("$(readlink /proc/self/ns/net)")
    fi
    for pid in $(live_pids slurmstepd); do
        ns=$(readlink "/proc/$pid/ns/net" 2>/dev/null) || continue
        [[ " ${want[*]} " == *" $ns "* ]] && out+="$pid "
    done
    printf '%s' "${out% }"
}

munge_ok() { munge ${MUNGE_SOCKET:+-S "$MUNGE_SOCKET"} -n 2>/dev/null | unmunge ${MUNGE_SOCKET:+-S "$MUNGE_SOCKET"} >/dev/null 2>&1; }

# Node state as sinfo reports it (idle, mixed, allocated, down*, ...); empty if slurmctld is unreachable.
# Clients retry for seconds (squeue: 9 s here) against a dead slurmctld, hence the timeout.
node_state() { timeout 5 sinfo -h -n localhost -o %T 2>/dev/null | head -n1 || true; }
node_usable() { [[ $(node_state) =~ ^(idle|mixed|allocated|alloc|mix)$ ]]; }

need_root() { [[ $(id -u) -eq 0 ]] || die "$1 needs root (it starts/stops system daemons and writes $CONF_LINK)" 2; }

install_packages() {
    local missing=()
    local cmd
    for cmd in sbatch sinfo slurmctld slurmd munged munge; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    ((${#missing[@]} == 0)) && return 0
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        die "missing ${missing[*]}; install slurm-wlm and munge (needs root with apt-get)" 2
    fi
    # apt/dpkg chatter (debconf, invoke-rc.d warnings without init) goes to a log, shown on failure.
    local apt_log="$STATE_DIR/log/apt-install.log"
    mkdir -p "$STATE_DIR/log"
    log "Installing slurm-wlm munge (missing: ${missing[*]}; log $apt_log) ..."
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >"$apt_log" 2>&1; then
        tail -n 20 "$apt_log" >&2
        die "apt-get install slurm-wlm munge failed; see $apt_log"
    fi
}

# slurm.conf lines both clusters share: no cgroups, CPUs as the consumable, fast scheduling, no accounting.
scheduler_conf() {
    cat <<'EOF'
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Measured here: with defaults a job starts 2-3 s after sbatch and each %1 array task 2 s after the
# previous one ends; with these both take ~1 s (mostly launch cost). A few nodes: backfill passes are cheap.
SchedulerParameters=batch_sched_delay=0,bf_interval=1
# Debian has no /bin/mail (the default), which slurmctld logs as an error on every start.
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=300
EOF
}

accounting_conf() {
    cat <<EOF
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/log/jobcomp.txt
EOF
}

write_conf() {
    local cpus mem_mib tmp
    # The machine's online CPUs, what slurmd detects and `opskit rehearse` asks (os.cpu_count()): nproc obeys
    # OMP_NUM_THREADS (CPUs=1 with it at 1: such a job pends forever on PartitionConfig); nproc --all counts
    # offline CPUs too.
    cpus=$(getconf _NPROCESSORS_ONLN)
    # Leave 10% of RAM to the OS; slurmd drains the node if RealMemory exceeds what it sees.
    mem_mib=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    tmp="$CONF.tmp"
    cat >"$tmp" <<EOF
$CONF_MARKER -- regenerated on every start; edit the script, not this file.
ClusterName=opskit
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
$(scheduler_conf)
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
$(accounting_conf)
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mib State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    if cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
    else
        mv -f "$tmp" "$CONF"
        if [[ -n $(pid_of slurmctld "$CTLD_PID") || -n $(pid_of slurmd "$SLURMD_PID") ]]; then
            log "note: $CONF changed while SLURM runs; run stop then start to apply it"
        fi
    fi
}

link_conf() {
    # Never overwrite a slurm.conf that somebody else wrote (a dangling symlink is fair game).
    if [[ -e $CONF_LINK ]]; then
        if [[ $(readlink -f "$CONF_LINK") != "$(readlink -f "$CONF")" ]] &&
            ! grep -qF "$CONF_MARKER" "$CONF_LINK" 2>/dev/null; then
            die "$CONF_LINK exists and was not written by this script; move it away first" 2
        fi
    fi
    mkdir -p "$(dirname "$CONF_LINK")"
    ln -sfn "$CONF" "$CONF_LINK"
}

start_munged() {
    if [[ -n $(pid_of munged "$MUNGE_PID") ]]; then return 0; fi
    # A munged we did not start (e.g. a system one) is fine as long as it answers.
    if munge_ok; then return 0; fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        chown munge: /etc/munge
        chmod 700 /etc/munge
        if command -v mungekey >/dev/null 2>&1; then
            runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
        else
            create-munge-key -f
        fi
    fi
    mkdir -p /run/munge "$MUNGE_DIR"
    chown munge: /run/munge "$MUNGE_DIR"
    chmod 755 "$MUNGE_DIR"  # so that a non-root `status` can read the pid file
    # --force: reuse the socket path if a killed munged left it behind.
    runuser -u munge -- munged --force --pid-file="$MUNGE_PID" --log-file="$MUNGE_DIR/munged.log"
    local i
    for ((i = 0; i < 50; i++)); do
        munge_ok && return 0
        sleep 0.1
    done
    tail -n 5 "$MUNGE_DIR/munged.log" >&2 || true
    die "munged started but 'munge -n | unmunge' fails"
}

# A slurmctld/slurmd we did not start (other state dir, by hand) would hold the ports, and we could
# not stop it by pid: refuse before touching the config it may be using.
refuse_foreign() {
    local name=$1 pidfile=$2 others
    [[ -n $(pid_of "$name" "$pidfile") ]] && return 0
    others=$(cluster_pids "$name")
    [[ -z $others ]] || die "a $name not started by this script is running (pid $others); stop it first"
}

# Start DAEMON (slurmctld/slurmd) unless its pid file names a live one.
start_slurm_daemon() {
    local name=$1 pidfile=$2 logfile=$3
    shift 3
    [[ -n $(pid_of "$name" "$pidfile") ]] && return 0
    if ! "$name" "$@"; then
        tail -n 20 "$logfile" >&2 || true
        die "$name failed to start; log: $logfile"
    fi
}

cmd_start() {
    install_packages
    need_root start

    local ctld slurmd munged
    ctld=$(pid_of slurmctld "$CTLD_PID")
    slurmd=$(pid_of slurmd "$SLURMD_PID")
    munged=$(pid_of munged "$MUNGE_PID")
    if [[ -n $ctld && -n $slurmd ]] && munge_ok && node_usable; then
        log "SLURM already up: slurmctld pid $ctld, slurmd pid $slurmd, munged pid ${munged:-external}, node $(node_state), conf $CONF_LINK, state $STATE_DIR"
        return 0
    fi

    refuse_foreign slurmctld "$CTLD_PID"
    refuse_foreign slurmd "$SLURMD_PID"
    local t0=$SECONDS
    mkdir -p "$STATE_DIR/state" "$SPOOL_DIR" "$STATE_DIR/log"
    chmod 755 "$STATE_DIR"
    write_conf
    link_conf
    start_munged
    start_slurm_daemon slurmctld "$CTLD_PID" "$STATE_DIR/log/slurmctld.log"
    # The host is not called localhost, so tell slurmd which NodeName it is.
    start_slurm_daemon slurmd "$SLURMD_PID" "$STATE_DIR/log/slurmd.log" -N localhost

    local deadline=$((SECONDS + READY_TIMEOUT)) state=""
    while ((SECONDS < deadline)); do
        state=$(node_state)
        [[ $state =~ ^(idle|mixed|allocated|alloc|mix)$ ]] && break
        sleep 0.2
    done
    if ! [[ $state =~ ^(idle|mixed|allocated|alloc|mix)$ ]]; then
        tail -n 10 "$STATE_DIR/log/slurmctld.log" "$STATE_DIR/log/slurmd.log" >&2 || true
        die "node not usable after ${READY_TIMEOUT}s (sinfo state: '${state:-no answer}')"
    fi
    munged=$(pid_of munged "$MUNGE_PID")
    log "SLURM up: slurmctld pid $(pid_of slurmctld "$CTLD_PID"), slurmd pid $(pid_of slurmd "$SLURMD_PID"), munged pid ${munged:-external}, node $state, conf $CONF_LINK, state $STATE_DIR ($((SECONDS - t0))s)"
}

# SIGTERM, wait up to STOP_TIMEOUT, then SIGKILL; prints what it did.
stop_pid() {
    local name=$1 pidfile=$2 pid i
    pid=$(pid_of "$name" "$pidfile")
    if [[ -z $pid ]]; then
        rm -f "$pidfile"
        return 1
    fi
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then
        log "$name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT}s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            alive "$pid" || break
            sleep 0.1
        done
    fi
    rm -f "$pidfile"
    log "stopped $name (pid $pid)"
}

# Cancel every job and wait until none is left running/completing: running jobs survive a slurmd
# stop, and a leftover job could later kill a new job that reuses its id.
cancel_jobs() {
    local ids
    ids=$(timeout 5 squeue -h -o %F 2>/dev/null | sort -u | tr '\n' ' ') || {
        log "warning: slurmctld not answering; cannot cancel jobs"
        return 0
    }
    [[ -n ${ids// /} ]] || return 0
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086  # word splitting of the id list is intended
    timeout 10 scancel --full $ids 2>/dev/null || true
    # KillWait=5 plus slack.
    local deadline=$((SECONDS + 15))
    while ((SECONDS < deadline)); do
        [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]] && [[ -z $(stepd_pids) ]] && return 0
        sleep 0.1
    done
    log "warning: jobs still present after 15s: $(timeout 5 squeue -h -o '%i:%T' 2>/dev/null | tr '\n' ' ')"
}

cmd_stop() {
    need_root stop
    local any=0
    if [[ -n $(pid_of slurmctld "$CTLD_PID") ]]; then
        cancel_jobs
    fi
    stop_pid slurmd "$SLURMD_PID" && any=1
    stop_pid slurmctld "$CTLD_PID" && any=1
    stop_pid munged "$MUNGE_PID" && any=1
    if [[ $MUNGE_DIR == /run/opskit-munge-* ]]; then rm -rf "$MUNGE_DIR"; fi
    if [[ $SPOOL_DIR == /run/opskit-spool-* ]]; then rm -rf "$SPOOL_DIR"; fi
    local left
    left=$(stepd_pids)
    [[ -z $left ]] || log "warning: job step daemons still running (slurmstepd pid $left); a later start re-adopts them"
    if ((any == 0)); then
        log "SLURM not running (state $STATE_DIR); nothing to stop"
    fi
    return 0
}

cmd_status() {
    local rc=0 pid name pidfile
    for name in munged slurmctld slurmd; do
        case $name in
        munged) pidfile=$MUNGE_PID ;;
        slurmctld) pidfile=$CTLD_PID ;;
        slurmd) pidfile=$SLURMD_PID ;;
        esac
        pid=$(pid_of "$name" "$pidfile")
        if [[ -n $pid ]]; then
            log "$name: running (pid $pid)"
        elif [[ $name == munged ]] && munge_ok; then
            log "munged: running (not started by this script)"
        else
            log "$name: not running"
            rc=1
        fi
    done
    if [[ -n $(pid_of slurmctld "$CTLD_PID") ]]; then
        timeout 5 sinfo || rc=1
        node_usable || rc=1
    fi
    return "$rc"
}

# ---------------------------------------------------------------------------------------------------
# N nodes: one slurmd per network namespace (see the header). The functions below are used only when
# NODES > 1; the single-node functions above are unchanged by them.

node_netns() { printf 'opskit-%s-node%s' "$TAG" "$1"; }
node_veth() { printf 'osk%sv%s' "$TAG" "$1"; }
node_ip() { printf '%s.%d' "$SUBNET" $((10 + $1)); }
slurmd_pidfile() { printf '%s/slurmd-node%s.pid' "$STATE_DIR" "$1"; }

# Node states, one "NAME STATE" a line; empty if slurmctld is unreachable.
node_states() { timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null || true; }
nodes_usable() {
    local states
    states=$(node_states)
    (($(grep -cE ' (idle|mixed|allocated|alloc|mix)$' <<<"$states") == NODES))
}

record() {  # record KIND NAME: remember that start created it (stop removes exactly what is recorded)
    grep -qxF "$1 $2" "$CREATED" 2>/dev/null || printf '%s %s\n' "$1" "$2" >>"$CREATED"
}

port_listened() {  # port_listened PORT: true if some TCP socket on the host listens on PORT
    local hex
    hex=$(printf ':%04X ' "$1")
    awk -v h="$hex" '$4 == "0A" && index($2 " ", h) {found = 1} END {exit !found}' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

subnet_used() {  # subnet_used A.B.C: true if a host address or a route (other than default) overlaps A.B.C.0/24
    [[ -n $(ip -4 -o addr show to "$1.0/24" 2>/dev/null) ]] && return 0
    [[ -n $(ip -4 route show root "$1.0/24" 2>/dev/null) ]] && return 0
    ip -4 route show match "$1.0/24" 2>/dev/null | grep -qv '^default'
}

# The subnet and controller port, picked once per state dir (kept across stop/start, so slurmctld's
# saved state and the nodes' addresses stay consistent).
pick_network() {
    if [[ -s $NET_FILE ]]; then
        # shellcheck source=/dev/null
        . "$NET_FILE"
        return 0
    fi
    local x
    for ((x = 77; x < 255; x++)); do
        subnet_used "10.77.$x" && continue
        port_listened $((6900 + x)) && continue
        SUBNET="10.77.$x"
        CTLD_PORT=$((6900 + x))
        printf 'SUBNET=%s\nCTLD_PORT=%s\n' "$SUBNET" "$CTLD_PORT" >"$NET_FILE"
        return 0
    done
    die "no free /24 in 10.77.77.0-10.77.254.0 (with a free port 6977-7154) for the cluster's bridge"
}

write_multinode_conf() {
    local mem_mib tmp i
    mem_mib=$(awk -v n="$NODES" '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9 / n}' /proc/meminfo)
    tmp="$CONF.tmp"
    {
        cat <<EOF
$CONF_MARKER -- regenerated on every start; edit the script, not this file.
# $NODES nodes, each a network namespace on bridge $BRIDGE ($SUBNET.0/24); clients: SLURM_CONF=$CONF
ClusterName=$CLUSTER_NAME
SlurmctldHost=$(hostname -s)($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
$(scheduler_conf)
# A node whose slurmd stops answering is marked down within ~SlurmdTimeout + a ping interval.
SlurmdTimeout=10
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$SPOOL_DIR/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
$(accounting_conf)
EOF
        for ((i = 1; i <= NODES; i++)); do
            printf 'NodeName=node%d NodeAddr=%s CPUs=1 RealMemory=%d State=UNKNOWN\n' "$i" "$(node_ip "$i")" "$mem_mib"
        done
        printf 'PartitionName=debug Nodes=node[1-%d] Default=YES MaxTime=INFINITE State=UP\n' "$NODES"
    } >"$tmp"
    if cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
    else
        mv -f "$tmp" "$CONF"
    fi
    {
        printf '127.0.0.1 localhost\n%s.1 %s\n' "$SUBNET" "$(hostname -s)"
        for ((i = 1; i <= NODES; i++)); do
            printf '%s node%d\n' "$(node_ip "$i")" "$i"
        done
    } >"$HOSTS"
    chmod 644 "$CONF" "$HOSTS"
}

# The bridge and, per node, a namespace with a veth pair (eth0 inside, the other end on the bridge).
# Each step is skipped when already done, so a half-finished start is completed by the next one.
setup_network() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        record link "$BRIDGE"
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    local i ns veth
    for ((i = 1; i <= NODES; i++)); do
        ns=$(node_netns "$i")
        veth=$(node_veth "$i")
        if [[ ! -e /run/netns/$ns ]]; then
            record netns "$ns"
            ip netns add "$ns"
        fi
        if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
            ip link del "$veth" 2>/dev/null || true   # a half-made pair of an interrupted start
            record link "$veth"
            ip link add "$veth" type veth peer name "osk${TAG}p$i"
            ip link set "osk${TAG}p$i" netns "$ns"
            ip -n "$ns" link set "osk${TAG}p$i" name eth0
            ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
        fi
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
    done
}

# Remove what start recorded, newest first, then the record.
teardown_network() {
    [[ -s $CREATED ]] || return 0
    local kind name
    while read -r kind name; do
        case $kind in
        netns) [[ -e /run/netns/$name ]] && ip netns del "$name" && log "removed network namespace $name" ;;
        link) ip link show "$name" >/dev/null 2>&1 && ip link del "$name" && log "removed link $name" ;;
        esac
    done < <(tac "$CREATED")
    rm -f "$CREATED"
}

start_private_munged() {
    if [[ -n $(pid_of munged "$MUNGE_PID") ]] && munge_ok; then return 0; fi
    [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (start the single-node cluster once, or mungekey --create)"
    mkdir -p "$MUNGE_DIR"
    chown munge: "$MUNGE_DIR"
    chmod 755 "$MUNGE_DIR"
    runuser -u munge -- munged --force --socket="$MUNGE_SOCKET" --pid-file="$MUNGE_PID" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
    local i
    for ((i = 0; i < 50; i++)); do
        munge_ok && return 0
        sleep 0.1
    done
    tail -n 5 "$MUNGE_DIR/munged.log" >&2 || true
    die "munged started but 'munge -S $MUNGE_SOCKET -n | unmunge' fails"
}

# slurmd of node I inside its namespaces; it daemonizes and writes slurmd-nodeI.pid itself.
start_node_slurmd() {
    local i=$1 ns
    [[ -n $(pid_of slurmd "$(slurmd_pidfile "$i")") ]] && return 0
    ns=$(node_netns "$i")
    mkdir -p "$SPOOL_DIR/node$i"
    # shellcheck disable=SC2016  # $1..$3 are the inner sh's arguments
    if ! nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c \
        'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3"' sh "node$i" "$HOSTS" "$CONF"; then
        tail -n 20 "$STATE_DIR/log/slurmd-node$i.log" >&2 || true
        die "slurmd of node$i failed to start; log: $STATE_DIR/log/slurmd-node$i.log"
    fi
}

slurmd_summary() {
    local i out=""
    for ((i = 1; i <= NODES; i++)); do
        out+="node$i:$(pid_of slurmd "$(slurmd_pidfile "$i")") "
    done
    printf '%s' "${out% }"
}

multinode_up() {
    local i
    [[ -n $(pid_of slurmctld "$CTLD_PID") && -n $(pid_of munged "$MUNGE_PID") ]] || return 1
    for ((i = 1; i <= NODES; i++)); do
        [[ -n $(pid_of slurmd "$(slurmd_pidfile "$i")") ]] || return 1
    done
    munge_ok && nodes_usable
}

# Daemons of this cluster (started with -f our conf) that our pid files do not name: we could not stop them.
refuse_foreign_multinode() {
    local name pid known i
    known=" $(pid_of slurmctld "$CTLD_PID") "
    for ((i = 1; i <= NODES; i++)); do
        known+="$(pid_of slurmd "$(slurmd_pidfile "$i")") "
    done
    for name in slurmctld slurmd; do
        for pid in $(cluster_pids "$name"); do
            [[ $known == *" $pid "* ]] || die "a $name using $CONF not started by this start/stop (pid $pid) is running; stop it first"
        done
    done
}

cmd_start_multinode() {
    install_packages
    need_root start
    if [[ -n $RECORDED_NODES && $RECORDED_NODES != "$NODES" ]] &&
        [[ -n $(pid_of slurmctld "$CTLD_PID") || -s ${CREATED} ]]; then
        die "$STATE_DIR holds a running $RECORDED_NODES-node cluster; stop it before starting $NODES nodes" 2
    fi
    if [[ -s $NET_FILE ]]; then pick_network; fi
    if [[ -n ${SUBNET:-} ]] && multinode_up; then
        log "SLURM already up ($NODES nodes): slurmctld pid $(pid_of slurmctld "$CTLD_PID"), slurmd $(slurmd_summary), munged pid $(pid_of munged "$MUNGE_PID"), conf $CONF, state $STATE_DIR"
        return 0
    fi
    refuse_foreign_multinode
    local t0=$SECONDS i
    mkdir -p "$STATE_DIR/state" "$SPOOL_DIR" "$STATE_DIR/log"
    chmod 755 "$STATE_DIR"
    printf '%s\n' "$NODES" >"$NODES_FILE"
    pick_network
    write_multinode_conf
    setup_network
    start_private_munged
    start_slurm_daemon slurmctld "$CTLD_PID" "$STATE_DIR/log/slurmctld.log" -f "$CONF"
    for ((i = 1; i <= NODES; i++)); do
        start_node_slurmd "$i"
    done
    local deadline=$((SECONDS + READY_TIMEOUT))
    until nodes_usable; do
        if ((SECONDS >= deadline)); then
            tail -n 10 "$STATE_DIR/log/slurmctld.log" "$STATE_DIR"/log/slurmd-node*.log >&2 || true
            die "nodes not usable after ${READY_TIMEOUT}s (sinfo: $(node_states | tr '\n' ' '))"
        fi
        sleep 0.2
    done
    log "SLURM up ($NODES nodes): slurmctld pid $(pid_of slurmctld "$CTLD_PID"), slurmd $(slurmd_summary), munged pid $(pid_of munged "$MUNGE_PID"), nodes $SUBNET.11-$((10 + NODES)) on $BRIDGE, conf $CONF (clients: SLURM_CONF=$CONF), state $STATE_DIR ($((SECONDS - t0))s)"
}

# Whatever still runs in a node's namespace once its slurmd is gone (a job's escaped child): by PID.
kill_namespace_leftovers() {
    local i ns pids
    for ((i = 1; i <= NODES; i++)); do
        ns=$(node_netns "$i")
        [[ -e /run/netns/$ns ]] || continue
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
        [[ -n ${pids// /} ]] || continue
        log "killing processes left in $ns: $pids"
        # shellcheck disable=SC2086  # word splitting of the pid list is intended
        kill -KILL $pids 2>/dev/null || true
    done
}

cmd_stop_multinode() {
    need_root stop
    local any=0 i
    [[ -s $NET_FILE ]] && pick_network
    if [[ -n $(pid_of slurmctld "$CTLD_PID") ]]; then
        cancel_jobs
    fi
    for ((i = 1; i <= NODES; i++)); do
        stop_pid slurmd "$(slurmd_pidfile "$i")" && any=1
    done
    stop_pid slurmctld "$CTLD_PID" && any=1
    stop_pid munged "$MUNGE_PID" && any=1
    if [[ $MUNGE_DIR == /run/opskit-munge-* ]]; then rm -rf "$MUNGE_DIR"; fi
    if [[ $SPOOL_DIR == /run/opskit-spool-* ]]; then rm -rf "$SPOOL_DIR"; fi
    kill_namespace_leftovers
    [[ -s $CREATED ]] && any=1
    teardown_network
    if ((any == 0)); then
        log "SLURM not running ($NODES nodes, state $STATE_DIR); nothing to stop"
    fi
    return 0
}

cmd_status_multinode() {
    local rc=0 pid i
    pid=$(pid_of munged "$MUNGE_PID")
    if [[ -n $pid ]]; then log "munged: running (pid $pid, socket $MUNGE_SOCKET)"; else log "munged: not running"; rc=1; fi
    pid=$(pid_of slurmctld "$CTLD_PID")
    if [[ -n $pid ]]; then log "slurmctld: running (pid $pid, conf $CONF)"; else log "slurmctld: not running"; rc=1; fi
    for ((i = 1; i <= NODES; i++)); do
        pid=$(pid_of slurmd "$(slurmd_pidfile "$i")")
        if [[ -n $pid ]]; then
            log "slurmd node$i: running (pid $pid, netns $(node_netns "$i"))"
        else
            log "slurmd node$i: not running"
            rc=1
        fi
    done
    if [[ -n $(pid_of slurmctld "$CTLD_PID") ]]; then
        timeout 5 sinfo -N -o '%N %T %c %o' || rc=1
        nodes_usable || rc=1
    fi
    return "$rc"
}

MODE=""
((NODES > 1)) && MODE=_multinode
case "$ACTION" in
start | stop | status) "cmd_$ACTION$MODE" ;;
*) usage ;;
esac
