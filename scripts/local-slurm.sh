#!/usr/bin/env bash
# Single-node SLURM on localhost (munged + slurmctld + slurmd) for opskit's tests and demos.
#
#   scripts/local-slurm.sh start|stop|status
#
# State (slurm.conf, state save, spool, pid files, logs, job completion file) lives in
# ${OPSKIT_SLURM_DIR:-/var/lib/opskit-slurm}. /etc/slurm/slurm.conf (where SLURM's commands look
# by default) is a symlink to the slurm.conf there, so sbatch/squeue/... work in any new shell.
# Needs root for start/stop; no systemd needed.
set -euo pipefail

STATE_DIR="${OPSKIT_SLURM_DIR:-/var/lib/opskit-slurm}"
CONF_LINK=/etc/slurm/slurm.conf
CONF="$STATE_DIR/slurm.conf"
CONF_MARKER="# Written by opskit scripts/local-slurm.sh"
MUNGE_DIR="$STATE_DIR/munge"           # munged's pid/log files (the socket stays in /run/munge)
MUNGE_PID="$MUNGE_DIR/munged.pid"
CTLD_PID="$STATE_DIR/slurmctld.pid"
SLURMD_PID="$STATE_DIR/slurmd.pid"
READY_TIMEOUT=20                       # seconds to wait for the node to become usable
STOP_TIMEOUT=10                        # seconds between SIGTERM and SIGKILL

# Daemons live in /usr/sbin, which a non-login PATH may lack.
export PATH="/usr/sbin:/sbin:$PATH"
# Talk to our cluster, whatever SLURM_CONF the caller has exported.
export SLURM_CONF="$CONF_LINK"

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

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

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

write_conf() {
    local cpus mem_mib tmp
    cpus=$(nproc)
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
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Measured here: with defaults a job starts 2-3 s after sbatch and each %1 array task 2 s after the
# previous one ends; with these both take ~1 s (mostly launch cost). One node: backfill passes are cheap.
SchedulerParameters=batch_sched_delay=0,bf_interval=1
# Debian has no /bin/mail (the default), which slurmctld logs as an error on every start.
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=300
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/log/jobcomp.txt
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
    others=$(live_pids "$name")
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
    mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool" "$STATE_DIR/log"
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
        [[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]] && [[ -z $(live_pids slurmstepd) ]] && return 0
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
    local left
    left=$(live_pids slurmstepd)
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

case "${1:-}" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
*)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
