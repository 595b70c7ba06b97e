#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests of launch/train_slurm.sbatch:
# munge, slurmctld and slurmd on localhost with a minimal slurm.conf (CPUs only, no GPUs, no
# cgroups, no accounting) in a state directory of its own.
#
#   tools/local_slurm.sh start [DIR [HOSTS]]   install when missing (apt-get, as root), start, wait until
#                                              every node is idle
#   tools/local_slurm.sh stop  [DIR [HOSTS]]   stop the daemons started from DIR
#
# With HOSTS, the state directory of tools/two_nodes.sh (two network namespaces, hosts stepwise-a
# and stepwise-b), the cluster has two nodes: slurmctld and one slurmd on host a, one slurmd on
# host b, each node at its host's address (spool, pid and log files per node, by name). munge
# serves both through its socket file on the shared filesystem. The hosts' addresses are reachable
# only from the hosts: run sbatch and friends there (tools/two_nodes.sh exec HOSTS a sbatch ...).
#
# DIR defaults to $LOCAL_SLURM_DIR, else /tmp/megatron-stepwise-slurm. `start` prints the line
#   export SLURM_CONF=DIR/slurm.conf
# that points sbatch, squeue, sacct and scancel at this cluster. Exit codes: 0 ready, 3 cannot
# install (no root or no apt-get), 1 the daemons did not come up (their logs are in DIR/log).
set -euo pipefail
cmd="${1:-}"
dir="${2:-${LOCAL_SLURM_DIR:-/tmp/megatron-stepwise-slurm}}"
hosts="${3:-}"
conf="$dir/slurm.conf"
node="$(hostname -s)"
two_nodes="$(dirname "${BASH_SOURCE[0]}")/two_nodes.sh"
if [[ -n $hosts ]]; then
  [[ -f $hosts/hosts.env ]] || { echo "local_slurm: no hosts in $hosts (run: tools/two_nodes.sh up $hosts)" >&2; exit 2; }
  # shellcheck disable=SC1091
  source "$hosts/hosts.env"
fi

on() {  # on a|b CMD...: run CMD on that host (two hosts), else here
  local host="$1"
  shift
  if [[ -n $hosts ]]; then bash "$two_nodes" exec "$hosts" "$host" "$@"; else "$@"; fi
}

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

install_if_missing() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
      && command -v sbatch >/dev/null; then
    return 0
  fi
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "local_slurm: slurm-wlm and munge are not installed, and installing them needs root and apt-get" >&2
    exit 3
  fi
  echo "local_slurm: installing slurm-wlm and munge (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >&2 \
    || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
         slurm-wlm munge >&2; } || exit 3
}

write_conf() {
  mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/munge"
  if [[ -n $hosts ]]; then mkdir -p "$dir/spool-$NODE_A_NAME" "$dir/spool-$NODE_B_NAME"; fi
  local cpus mem_mb
  cpus="$(nproc)"
  mem_mb="$(awk '/MemTotal/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)"
  local ctld_host="$node" node_files="" nodes="$node" node_lines="NodeName=$node CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
  if [[ -n $hosts ]]; then
    # One slurmd per host, at its host's address; per-node files (%n: the node's name).
    ctld_host="$NODE_A_NAME($NODE_A_IP)" node_files="-%n" nodes="$NODE_A_NAME,$NODE_B_NAME"
    node_lines="NodeName=$NODE_A_NAME NodeAddr=$NODE_A_IP CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
NodeName=$NODE_B_NAME NodeAddr=$NODE_B_IP CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"
  fi
  # Ports of their own, so a system SLURM (if any) is left alone.
  cat >"$conf" <<EOF
ClusterName=stepwise-local
SlurmctldHost=$ctld_host
SlurmctldPort=${LOCAL_SLURM_CTLD_PORT:-16817}
SlurmdPort=${LOCAL_SLURM_D_PORT:-16818}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CryptoType=crypto/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool$node_files
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd$node_files.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd$node_files.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
$node_lines
PartitionName=debug Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Where each slurmd runs and its pid file: here, or one per host.
slurmd_hosts=(a)
slurmd_pids=("$dir/slurmd.pid")
if [[ -n $hosts ]]; then
  slurmd_hosts=(a b)
  slurmd_pids=("$dir/slurmd-$NODE_A_NAME.pid" "$dir/slurmd-$NODE_B_NAME.pid")
fi

start_slurmd() {
  if [[ -z $hosts ]]; then
    slurmd -f "$conf"
    return
  fi
  # slurmd needs the cgroup filesystems even with proctrack/pgid, and a host's /sys (`ip netns exec`
  # mounts a fresh one) has none: mount this machine's cgroup layout (v1, hybrid or v2) again there,
  # in that host's own mount namespace.
  local mounts
  mounts="$(awk '$2 ~ "^/sys/fs/cgroup" { print $3, $4, $1, $2 }' /proc/self/mounts)"
  on "$1" bash -c '
    while read -r type opts src target; do
      mkdir -p "$target" && mount -t "$type" -o "$opts" "$src" "$target"
    done <<<"$1"
    exec slurmd -f "$0"' "$conf" "$mounts"
}

start() {
  install_if_missing
  write_conf
  if [[ ! -s $dir/munge/munge.key ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
  fi
  chmod 700 "$dir/munge"
  # Every daemon on host a (or here): taking the hosts down takes them with it.
  if ! running "$dir/munge/munged.pid"; then
    on a munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
         --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed"
  fi
  export SLURM_CONF="$conf"
  if ! running "$dir/slurmctld.pid"; then
    on a slurmctld -f "$conf" -c  # -c: a clean start, no jobs left from an earlier run
  fi
  local i
  for i in "${!slurmd_hosts[@]}"; do
    running "${slurmd_pids[$i]}" || start_slurmd "${slurmd_hosts[$i]}"
  done
  local idle
  for _ in $(seq 60); do
    idle="$(on a sinfo -h -N -o '%T' 2>/dev/null | grep -cx 'idle' || true)"
    if ((idle == ${#slurmd_hosts[@]})); then
      echo "export SLURM_CONF=$conf"
      return 0
    fi
    sleep 1
  done
  echo "local_slurm: not every node became idle within 60 s; logs in $dir/log" >&2
  on a sinfo -N >&2 || true
  exit 1
}

our_stepds() {  # slurmstepd processes of this cluster (their environment names its slurm.conf)
  local pid
  for pid in $(pgrep -x slurmstepd || true); do
    if { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$conf"; then echo "$pid"; fi
  done
}

stop() {
  # Jobs first, while slurmd still runs: their step daemons (slurmstepd) exit with them instead
  # of waiting for a slurmd that is gone.
  if [[ -f $conf ]] && running "$dir/slurmctld.pid"; then
    SLURM_CONF="$conf" on a scancel --full --partition=debug 2>/dev/null || true
    for _ in $(seq 60); do
      [[ -z $(SLURM_CONF="$conf" on a squeue -h 2>/dev/null) ]] && break
      sleep 0.5
    done
    for _ in $(seq 20); do  # the step daemons of the last jobs
      [[ -z $(our_stepds) ]] && break
      sleep 0.5
    done
  fi
  local pidfiles=("${slurmd_pids[@]}" "$dir/slurmctld.pid" "$dir/munge/munged.pid") pidfile
  for pidfile in "${pidfiles[@]}"; do
    if [[ -f $pidfile ]]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
    fi
  done
  for pidfile in "${pidfiles[@]}"; do
    for _ in $(seq 20); do
      running "$pidfile" || break
      sleep 0.5
    done
  done
  local left
  left="$(our_stepds)"
  if [[ -n $left ]]; then
    kill -9 $left 2>/dev/null || true  # orphaned step daemons wait forever for the slurmd that is gone
  fi
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
