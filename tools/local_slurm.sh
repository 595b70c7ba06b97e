#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests of launch/train_slurm.sbatch:
# munge, slurmctld and slurmd on localhost with a minimal slurm.conf (CPUs only, no GPUs, no
# cgroups, no accounting) in a state directory of its own.
#
#   tools/local_slurm.sh start [DIR]   install when missing (apt-get, as root), start, wait until the node is idle
#   tools/local_slurm.sh stop  [DIR]   stop the daemons started from DIR
#
# DIR defaults to $LOCAL_SLURM_DIR, else /tmp/megatron-stepwise-slurm. `start` prints the line
#   export SLURM_CONF=DIR/slurm.conf
# that points sbatch, squeue, sacct and scancel at this cluster. Exit codes: 0 ready, 3 cannot
# install (no root or no apt-get), 1 the daemons did not come up (their logs are in DIR/log).
set -euo pipefail
cmd="${1:-}"
dir="${2:-${LOCAL_SLURM_DIR:-/tmp/megatron-stepwise-slurm}}"
conf="$dir/slurm.conf"
node="$(hostname -s)"

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
  local cpus mem_mb
  cpus="$(nproc)"
  mem_mb="$(awk '/MemTotal/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)"
  # Ports of their own, so a system SLURM (if any) is left alone.
  cat >"$conf" <<EOF
ClusterName=stepwise-local
SlurmctldHost=$node
SlurmctldPort=${LOCAL_SLURM_CTLD_PORT:-16817}
SlurmdPort=${LOCAL_SLURM_D_PORT:-16818}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CryptoType=crypto/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
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
NodeName=$node CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start() {
  install_if_missing
  write_conf
  if [[ ! -s $dir/munge/munge.key ]]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$dir/munge/munge.key"
  fi
  chmod 700 "$dir/munge"
  if ! [[ -f $dir/munge/munged.pid ]] || ! kill -0 "$(cat "$dir/munge/munged.pid")" 2>/dev/null; then
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
           --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed"
  fi
  export SLURM_CONF="$conf"
  if ! [[ -f $dir/slurmctld.pid ]] || ! kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    slurmctld -f "$conf" -c  # -c: a clean start, no jobs left from an earlier run
  fi
  if ! [[ -f $dir/slurmd.pid ]] || ! kill -0 "$(cat "$dir/slurmd.pid")" 2>/dev/null; then
    slurmd -f "$conf"
  fi
  for _ in $(seq 60); do
    if sinfo -h -N -o '%T' 2>/dev/null | grep -qx 'idle'; then
      echo "export SLURM_CONF=$conf"
      return 0
    fi
    sleep 1
  done
  echo "local_slurm: the node did not become idle within 60 s; logs in $dir/log" >&2
  sinfo -N >&2 || true
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
  if [[ -f $conf ]] && [[ -f $dir/slurmctld.pid ]] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    SLURM_CONF="$conf" scancel --full --partition=debug 2>/dev/null || true
    for _ in $(seq 60); do
      [[ -z $(SLURM_CONF="$conf" squeue -h 2>/dev/null) ]] && break
      sleep 0.5
    done
    for _ in $(seq 20); do  # the step daemons of the last jobs
      [[ -z $(our_stepds) ]] && break
      sleep 0.5
    done
  fi
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    if [[ -f $pidfile ]]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
    fi
  done
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    for _ in $(seq 20); do
      [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null || break
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
