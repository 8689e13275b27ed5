#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to run the batch files without a cluster.
#   sudo scripts/slurm/local_cluster.sh up     # munge + slurmctld + slurmd; prints SLURM_CONF
#   export SLURM_CONF=/tmp/dhelix-slurm/slurm.conf
#   sbatch --nodes=1 --ntasks-per-node=2 scripts/slurm/dhelix.sbatch configs/slurm/local.env \
#          train --config tiny --tensor-model-parallel-size 2 --sequence-parallel --dhelix
#   sudo scripts/slurm/local_cluster.sh down   # stops what `up` started, removes its files
# Needs root and Debian's slurm-wlm and munge (apt-get install slurm-wlm munge). One node
# with all this machine's CPUs; no GPUs, no cgroups, no accounting database (a finished
# job's state stays visible to `squeue -t all` / `scontrol show job` for MinJobAge).
set -euo pipefail
DIR=${DHELIX_SLURM_DIR:-/tmp/dhelix-slurm}
CONF=$DIR/slurm.conf
cmd=${1:-}

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

up() {
  [ "$(id -u)" = 0 ] || die "needs root (munge key, daemons)"
  for b in munged slurmctld slurmd sbatch; do
    command -v "$b" >/dev/null || die "$b not found: apt-get install slurm-wlm munge"
  done
  if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    echo "already up: export SLURM_CONF=$CONF"; return
  fi
  mkdir -p "$DIR"/{state,spool,log,munge}
  # munge: a key of our own, a socket of our own (never touch a system munged)
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none
  chmod 400 "$DIR/munge/munge.key"
  # daemons get no terminal and no pipe of the caller (it would wait for them to close it)
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/socket" \
         --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
         --seed-file="$DIR/munge/seed" </dev/null >>"$DIR/log/munged.out" 2>&1
  local node; node=$(hostname -s)
  cat > "$CONF" <<CONF
ClusterName=dhelix-local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${DHELIX_SLURMCTLD_PORT:-16817}
SlurmdPort=${DHELIX_SLURMD_PORT:-16818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
InactiveLimit=0
KillWait=5
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(getconf _NPROCESSORS_ONLN) State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  export SLURM_CONF=$CONF
  slurmctld -f "$CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1
  slurmd -f "$CONF" </dev/null >>"$DIR/log/slurmd.out" 2>&1
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "up: export SLURM_CONF=$CONF"; return
    fi
    sleep 0.5
  done
  down || true
  die "the node did not come up; see $DIR/log/"
}

down() {
  export SLURM_CONF=$CONF
  if [ -f "$CONF" ]; then scancel --full --quiet -u "$(id -un)" 2>/dev/null || true; fi
  for pidf in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    if [ -f "$pidf" ]; then
      pid=$(cat "$pidf")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$DIR"
  echo "down"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  *) die "usage: local_cluster.sh up|down" ;;
esac
