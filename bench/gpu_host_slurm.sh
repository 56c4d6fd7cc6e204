#!/usr/bin/env bash
# A one-node SLURM with the host's GPUs as GRES on a device machine (no SLURM, no package registry, no systemd):
# Debian 12's slurm-wlm 22.05 and munge, downloaded here and unpacked there with `dpkg -x` into /tmp/sroot, never
# into /. Measured on nvidia-h100-x4 (Ubuntu 24.04, Firecracker, cgroup v2) on 2026-11-27: srun --gres=gpu:4 and
# sbatch ran there. Prints the environment a client needs (PATH, LD_LIBRARY_PATH, SLURM_CONF) as `export` lines.
#
# Here, once (the .debs travel with `carry`; .slurmdebs/ is git-excluded):
#   mkdir -p .slurmdebs && (cd .slurmdebs && apt-get download slurmd slurmctld slurm-client \
#       slurm-wlm-basic-plugins munge libmunge2 libhwloc15 libnuma1 liblz4-1 libgcrypt20 libgpg-error0 libudev1 \
#       libaudit1 libcap-ng0 libpam0g libbz2-1.0 zlib1g libdbus-1-3 libsystemd0 libcap2)
# There:
#   eval "$(bash bench/gpu_host_slurm.sh .slurmdebs)"
#
# What it takes on such a host, each found by a failed start there:
# - Debian names the daemons slurmd-wlm, slurmctld-wlm, slurmstepd-wlm (update-alternatives adds the plain names);
#   slurmd runs slurmstepd from the path it was built with, /usr/sbin/slurmstepd: a link there.
# - slurmd always loads its cgroup plugin; cgroup/v2 needs libdbus, and without systemd IgnoreSystemd=yes, its own
#   cgroup in a subtree with the cpu/cpuset/memory controllers, and /sys/fs/cgroup/system.slice with them delegated.
set -euo pipefail
DEBS=$(cd "${1:?usage: $0 DEB_FOLDER}" && pwd)
R=/tmp/sroot
S=/tmp/sstate
mkdir -p "$R" "$S"/{spool,save,log,munge}
for f in "$DEBS"/*.deb; do dpkg -x "$f" "$R"; done
for b in slurmd slurmctld slurmstepd; do ln -sf "$R/usr/sbin/$b-wlm" "$R/usr/sbin/$b"; done
[ -e /usr/sbin/slurmstepd ] || ln -s "$R/usr/sbin/slurmstepd-wlm" /usr/sbin/slurmstepd
L=$R/usr/lib/x86_64-linux-gnu
# Only the libraries the host lacks go on LD_LIBRARY_PATH, which srun passes on to the job's tasks: the trainer must
# keep the host's own zlib, libsystemd, ... rather than Debian 12's.
mkdir -p "$R/extra-lib"
for lib in "$L"/*.so.* "$R"/lib/x86_64-linux-gnu/*.so.*; do
    name=$(basename "$lib")
    ldconfig -p | grep -q " $name " || ln -sf "$lib" "$R/extra-lib/$name"
done
export LD_LIBRARY_PATH=$R/extra-lib:$L/slurm-wlm${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PATH=$R/usr/bin:$R/usr/sbin:$PATH
if [ -e "$S/slurm.conf" ] && SLURM_CONF=$S/slurm.conf sinfo -h >/dev/null 2>&1; then  # started by an earlier call
    echo "export PATH=$PATH LD_LIBRARY_PATH=$LD_LIBRARY_PATH SLURM_CONF=$S/slurm.conf"
    exit 0
fi

dd if=/dev/urandom of="$S/munge/key" bs=1024 count=1 2>/dev/null
chmod 400 "$S/munge/key"
munged --key-file="$S/munge/key" --socket="$S/munge/sock" --pid-file="$S/munge/pid" --log-file="$S/munge/log" \
    --seed-file="$S/munge/seed" --force

gpus=$(find /dev -maxdepth 1 -name 'nvidia[0-9]*' | wc -l)
cpus=$(nproc --all)
mem=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 4096))
cat >"$S/slurm.conf" <<EOF
ClusterName=gpuhost
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$S/munge/sock
CredType=cred/munge
PluginDir=$L/slurm-wlm
StateSaveLocation=$S/save
SlurmdSpoolDir=$S/spool
SlurmctldPidFile=$S/ctld.pid
SlurmdPidFile=$S/d.pid
SlurmctldLogFile=$S/log/ctld.log
SlurmdLogFile=$S/log/d.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0,bf_interval=1
MailProg=/bin/true
ReturnToService=2
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
NodeName=localhost CPUs=$cpus RealMemory=$mem Gres=gpu:$gpus State=UNKNOWN
PartitionName=gpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
echo "Name=gpu File=/dev/nvidia[0-$((gpus - 1))]" >"$S/gres.conf"
printf 'CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n' >"$S/cgroup.conf"
mkdir -p /sys/fs/cgroup/slurmd /sys/fs/cgroup/system.slice
echo "+cpu +cpuset +memory +pids" >/sys/fs/cgroup/cgroup.subtree_control
echo "+cpu +cpuset +memory +pids" >/sys/fs/cgroup/system.slice/cgroup.subtree_control
export SLURM_CONF=$S/slurm.conf
slurmctld
(echo "$BASHPID" >/sys/fs/cgroup/slurmd/cgroup.procs; exec slurmd)
for _ in $(seq 30); do
    sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)' && break
    sleep 1
done
echo "export PATH=$PATH LD_LIBRARY_PATH=$LD_LIBRARY_PATH SLURM_CONF=$SLURM_CONF"
