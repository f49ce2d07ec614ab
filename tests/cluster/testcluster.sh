#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one machine, for hpcjobs' tests.
#
# Hosts are network namespaces (each with its own UTS hostname, address and a private mount namespace in which
# /etc/hosts, /etc/resolv.conf and /etc/slurm are bind-mounted from the cluster folder, so the real /etc is never
# written). A bridge inside the "head" namespace joins them, so nothing is routed out of the machine.
#   head   10.233.77.1   slurmctld, slurmdbd, MariaDB (socket only) and the clients: sbatch, squeue, pytest
#   node1  10.233.77.11  slurmd, 16 CPUs, 8 count-only GPUs
#   node2  10.233.77.12  slurmd, 16 CPUs, 8 count-only GPUs   ... up to nodeN (HPCJOBS_CLUSTER_NODES, default 2)
# munged runs in the root namespace with its socket in the cluster folder, bind-mounted at /run/munge in every host
# (Slurm's clients ignore AuthInfo's socket= when they talk to slurmdbd, so the default path must work).
#
# Usage:  testcluster.sh install | up | down | restart | status | exec CMD... | node N CMD...
#   up        install what is missing, tear down leftovers, write the config, start every daemon, wait for nodes
#   down      stop every daemon and every process in the namespaces, delete the namespaces and the cluster folder
#   restart   rewrite slurm.conf from the switches below and restart slurmctld + slurmds (jobs' state is kept)
#   exec      run CMD "on the login node" (the head namespace), with HPCJOBS_TEST_CLUSTER set
#   node N    run CMD on compute node N (debugging)
# Switches (environment):
#   HPCJOBS_CLUSTER_DIR=/tmp/hpcjobs-cluster     where config, state, logs and the database live
#   HPCJOBS_CLUSTER_NODES=2                      compute nodes `up` starts (1-64), node1..nodeN at 10.233.77.11...;
#                                                the other commands keep the count the cluster was started with
#   HPCJOBS_CLUSTER_ACCOUNTING=1                 0: no slurmdbd/MariaDB, sacct fails as on sites without accounting
#   HPCJOBS_CLUSTER_MIN_JOB_AGE=300              seconds squeue keeps a finished job (Slurm's MinJobAge; it forgets
#                                                it at its next purge, up to a minute later)
#   HPCJOBS_CLUSTER_USER_SIGNAL=1                1: preemption sends the job's own --signal (preempt_send_user_signal)
#                                                0: preemption sends SIGTERM, then SIGKILL after GraceTime
#   HPCJOBS_CLUSTER_OCI_TASK_ENV=0               1: oci.conf's RunTimeRun goes through ociwrap.sh, which adds the
#                                                per-task variables Slurm 22.05 leaves out of a --container step
#                                                0: as Slurm ships (hpcjobs finds each rank's index itself)
set -euo pipefail

D=${HPCJOBS_CLUSTER_DIR:-/tmp/hpcjobs-cluster}
P=hpcj
NET=10.233.77
NODE_COUNT=${HPCJOBS_CLUSTER_NODES:-2}  # `up` starts this many; the other commands act on the cluster that is up
[ -z "${HPCJOBS_CLUSTER_NODES:-}" ] && [ "${1:-}" != up ] && [ -s "$D/node-count" ] && NODE_COUNT=$(cat "$D/node-count")
[[ "$NODE_COUNT" =~ ^[0-9]+$ ]] && [ "$NODE_COUNT" -ge 1 ] && [ "$NODE_COUNT" -le 64 ] || {
  printf '[testcluster] error: HPCJOBS_CLUSTER_NODES=%s; valid: 1-64. HINT: unset it for the default 2.\n' \
    "$NODE_COUNT" >&2; exit 2; }
NODES=()
for ((i = 1; i <= NODE_COUNT; i++)); do NODES+=("node$i"); done
ACCOUNTING=${HPCJOBS_CLUSTER_ACCOUNTING:-1}
USER_SIGNAL=${HPCJOBS_CLUSTER_USER_SIGNAL:-1}
SELF=$(readlink -f "$0")
OCI_TASK_ENV=${HPCJOBS_CLUSTER_OCI_TASK_ENV:-0}
# ch-run, runc (Slurm's --container through oci.conf) and jq (ociwrap.sh): the containers tests
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server iproute2 util-linux charliecloud-runtime runc jq)

log() { printf '[testcluster] %s\n' "$*" >&2; }
die() { printf '[testcluster] error: %s\n' "$*" >&2; exit 1; }

node_ip() { echo "$NET.$((10 + ${1#node}))"; }

install_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "packages missing (${missing[*]}) and not root. HINT: run as root or install them."
  command -v apt-get >/dev/null || die "packages missing (${missing[*]}) and no apt-get. HINT: install Slurm 22.05 + munge by hand."
  log "installing ${missing[*]}"
  local rc_guard=""
  # On hosts with systemd, keep apt from starting the packaged daemons: the cluster starts its own.
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; rc_guard=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  [ -n "$rc_guard" ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

# Runs CMD inside host HOST: its network namespace, a fresh private mount + UTS namespace with the cluster's binds.
on_host() {
  local host=$1; shift
  nsenter --net="/run/netns/$P-$host" unshare --mount --uts --propagation private "$SELF" _inside "$host" "$@"
}

inside() {  # the second half of on_host, already in the new namespaces
  local host=$1; shift
  hostname "$host"
  mount --bind "$D/etc/hosts" /etc/hosts
  mount --bind "$D/etc/resolv.conf" /etc/resolv.conf
  mount --bind "$D/etc/slurm" /etc/slurm
  mount --bind "$D/munge-run" /run/munge
  [ "$host" = head ] && [ -d /run/mysqld ] && mount --bind "$D/mysql/run" /run/mysqld
  export HPCJOBS_TEST_CLUSTER="$D"
  exec "$@"
}

write_slurm_conf() {
  local acct="AccountingStorageType=accounting_storage/none"
  [ "$ACCOUNTING" = 1 ] && acct=$'AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=head'
  local ctld_params=""
  [ "$USER_SIGNAL" = 1 ] && ctld_params="SlurmctldParameters=preempt_send_user_signal"
  {
    cat <<EOF
# Written by tests/cluster/testcluster.sh; accounting=$ACCOUNTING user_signal=$USER_SIGNAL
ClusterName=hpcj
SlurmctldHost=head($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5: a requeued job otherwise waits 120 s (Reason=BeginTime) before it may run again.
AuthInfo=cred_expire=5
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/slurmd-%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in here: linuxproc tracking, no task plugin.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, each job takes all of a node's memory and jobs run one at a time.
DefMemPerCPU=256
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2,batch_sched_delay=0,sched_min_interval=0
JobRequeue=1
KillWait=10
MinJobAge=${HPCJOBS_CLUSTER_MIN_JOB_AGE:-300}
InactiveLimit=0
SlurmdTimeout=60
GresTypes=gpu
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
$ctld_params
$acct
JobCompType=jobcomp/none
EOF
    for n in "${NODES[@]}"; do
      echo "NodeName=$n NodeAddr=$(node_ip "$n") CPUs=16 RealMemory=16000 Gres=gpu:8 State=UNKNOWN"
    done
    echo "PartitionName=low Nodes=ALL Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=20 MaxTime=INFINITE State=UP"
    # high has a MaxTime so that `hpcjobs doctor`'s check of --time against it has a real partition to fail on.
    echo "PartitionName=high Nodes=ALL PriorityTier=10 PreemptMode=OFF MaxTime=1:00:00 State=UP"
  } >"$D/etc/slurm/slurm.conf"
  # GPUs without hardware: Slurm 22.05 drops file-less GPUs ("Removing file-less GPU"), so each node gets 8 empty
  # placeholder files. Jobs asking for GPUs schedule (and see CUDA_VISIBLE_DEVICES) and then run on the CPU.
  printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/dev/gpu[0-7]\n' "$(IFS=,; echo "${NODES[*]}")" "$D" \
    >"$D/etc/slurm/gres.conf"
  cat >"$D/etc/slurm/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
EOF
}

write_oci_conf() {
  # Slurm's own `srun --container=BUNDLE` with runc (measured: /work/shared/docs/containers-on-the-test-cluster.md).
  # slurmstepd reads this file only for a step that asks for a container, so it changes no other job. The
  # container's name holds the node (%n): both nodes share $D/ocistate. RunTimeRun starts with `exec`: Slurm runs it
  # through /bin/sh -c, and without it the shell is the task (a signal kills it and the container's exit code is lost).
  local runc="runc --root=$D/ocistate" name="%n.%u.%j.%s.%t" wrap=""
  [ "$OCI_TASK_ENV" = 1 ] && wrap="$D/etc/slurm/ociwrap.sh %n %b "
  cat >"$D/etc/slurm/oci.conf" <<EOF
RunTimeQuery="$runc state $name"
RunTimeKill="$runc kill -a $name"
RunTimeDelete="$runc delete --force $name"
RunTimeRun="exec $wrap$runc run $name -b %b"
EOF
  # ociwrap.sh NODE BUNDLE RUNTIME...: the container gets Slurm 22.05's job and step variables but no per-task ones
  # (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID, SLURMD_NODENAME); with one task per node per step (22.05), a task's
  # index is its node's place in the step's host list. It adds them to the generated config.json, then runs RUNTIME.
  cat >"$D/etc/slurm/ociwrap.sh" <<'EOF'
#!/bin/sh
set -eu
node=$1 config=$2/config.json; shift 2
nodes=$(jq -r '.process.env[] | select(startswith("SLURM_STEP_NODELIST=")) | sub("^[^=]*="; "")' "$config")
i=$(scontrol show hostnames "$nodes" | grep -nx "$node" | cut -d: -f1)
jq --arg n "$node" --arg i "$((i - 1))" '.process.env += ["SLURMD_NODENAME=\($n)", "SLURM_NODEID=\($i)",
  "SLURM_PROCID=\($i)", "SLURM_LOCALID=0"]' "$config" >"$config.new"
mv "$config.new" "$config"
exec "$@"
EOF
  chmod 755 "$D/etc/slurm/ociwrap.sh"
}

write_config() {
  rm -rf "$D"
  mkdir -p "$D"/{etc/slurm,munge,munge-run,state,spool,run,log,mysql/data,mysql/run,ocistate}
  chmod 755 "$D"
  echo "$NODE_COUNT" >"$D/node-count"
  {
    echo "127.0.0.1 localhost"
    echo "$NET.1 head"
    for n in "${NODES[@]}"; do echo "$(node_ip "$n") $n"; done
  } >"$D/etc/hosts"
  echo "nameserver 127.0.0.1" >"$D/etc/resolv.conf"  # unknown names fail fast instead of timing out
  for n in "${NODES[@]}"; do mkdir -p "$D/spool/slurmd-$n"; done  # slurmd does not create its %n folder
  mkdir -p "$D/dev" && touch "$D"/dev/gpu{0..7}
  dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
  chmod 700 "$D/munge"; chmod 400 "$D/munge/munge.key"
  chown -R mysql:mysql "$D/mysql"
  write_slurm_conf
  write_oci_conf
  cat >"$D/etc/slurm/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=head
DbdAddr=$NET.1
SlurmUser=root
PidFile=$D/run/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$D/etc/slurm/slurmdbd.conf"
}

make_network() {
  ip netns add "$P-head"
  ip -n "$P-head" link set lo up
  ip -n "$P-head" link add br0 type bridge
  ip -n "$P-head" addr add "$NET.1/24" dev br0
  ip -n "$P-head" link set br0 up
  for n in "${NODES[@]}"; do
    ip netns add "$P-$n"
    ip -n "$P-$n" link set lo up
    ip link add "$P-v$n" type veth peer name eth0 netns "$P-$n"
    ip link set "$P-v$n" netns "$P-head"
    ip -n "$P-head" link set "$P-v$n" master br0 up
    ip -n "$P-$n" addr add "$(node_ip "$n")/24" dev eth0
    ip -n "$P-$n" link set eth0 up
  done
}

wait_for() {  # wait_for SECONDS WHAT CMD...
  local t=$1 what=$2; shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || { tail -n 20 "$D"/log/*.log >&2 2>/dev/null || true; die "timed out waiting for $what"; }
    sleep 0.2
  done
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_slurm() {
  on_host head slurmctld
  wait_for 20 slurmctld on_host head scontrol ping
  for n in "${NODES[@]}"; do
    on_host "$n" slurmd -N "$n"
    wait_for 20 "slurmd on $n" pid_alive "$D/run/slurmd-$n.pid"
  done
  wait_for 30 "nodes up" nodes_up
}

nodes_up() {  # every node answers (idle, or busy with jobs kept across a restart)
  local states
  states=$(on_host head sinfo -h -N -p low -o '%T')
  [ -n "$states" ] && ! grep -qvE '^(idle|mixed|allocated|completing)$' <<<"$states"
}

start_accounting() {
  mariadb-install-db --no-defaults --user=mysql --datadir="$D/mysql/data" --auth-root-authentication-method=socket \
    --skip-test-db >"$D/log/mariadb-install.log" 2>&1
  on_host head setsid mariadbd --no-defaults --user=mysql --datadir="$D/mysql/data" --skip-networking \
    --socket=/run/mysqld/mysqld.sock --pid-file="$D/mysql/run/mysqld.pid" --log-error="$D/log/mariadb.log" \
    </dev/null >/dev/null 2>&1 &
  wait_for 30 mariadb test -S "$D/mysql/run/mysqld.sock"
  on_host head slurmdbd
  wait_for 20 slurmdbd on_host head sacctmgr -n list cluster
  on_host head sacctmgr -i add cluster hpcj >/dev/null 2>&1 || true
}

up() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, bind mounts). HINT: run as root."
  install_packages
  down quiet
  local t0=$SECONDS
  write_config
  mkdir -p /etc/slurm /run/munge  # mount points for the binds (empty; nothing is written into them)
  make_network
  munged --force --socket="$D/munge-run/munge.socket.2" --key-file="$D/munge/munge.key" \
    --pid-file="$D/munge/munged.pid" --log-file="$D/log/munged.log" --seed-file="$D/munge/munged.seed"
  wait_for 10 munged test -S "$D/munge-run/munge.socket.2"
  [ "$ACCOUNTING" = 1 ] && start_accounting
  start_slurm
  log "up in $((SECONDS - t0)) s: $(on_host head sinfo -h -o '%P %D %T %G' | tr '\n' ';') accounting=$ACCOUNTING user_signal=$USER_SIGNAL"
}

stop_pidfile() {
  local f=$1
  if pid_alive "$f"; then kill "$(cat "$f")" 2>/dev/null || true; fi
}

down() {
  local quiet=${1:-}
  for f in "$D"/run/*.pid "$D/mysql/run/mysqld.pid"; do [ -e "$f" ] && stop_pidfile "$f"; done
  # Everything else living in the namespaces (job steps, stray ranks) goes too.
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$P-" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -TERM 2>/dev/null || true
  done
  sleep 0.5
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$P-" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns del "$ns"
  done
  [ -e "$D/munge/munged.pid" ] && stop_pidfile "$D/munge/munged.pid"
  if [ -n "${HPCJOBS_CLUSTER_KEEP_LOGS:-}" ] && [ -d "$D/log" ]; then
    mkdir -p "$HPCJOBS_CLUSTER_KEEP_LOGS" && cp -r "$D/log/." "$HPCJOBS_CLUSTER_KEEP_LOGS/" || true
  fi
  [ -d "$D" ] && rm -rf "$D"
  [ -z "$quiet" ] && log "down: no daemons, no namespaces left"
  return 0
}

restart() {
  [ -d "$D/etc/slurm" ] || die "no cluster at $D. HINT: testcluster.sh up"
  [ "$NODE_COUNT" = "$(cat "$D/node-count")" ] || die "the cluster has $(cat "$D/node-count") nodes, \
HPCJOBS_CLUSTER_NODES=$NODE_COUNT. HINT: a new node count needs \`testcluster.sh up\`."
  write_slurm_conf
  stop_pidfile "$D/run/slurmctld.pid"
  for n in "${NODES[@]}"; do stop_pidfile "$D/run/slurmd-$n.pid"; done
  for f in "$D/run/slurmctld.pid" "$D"/run/slurmd-*.pid; do
    local end=$((SECONDS + 15))
    while pid_alive "$f" && [ $SECONDS -lt $end ]; do sleep 0.1; done
  done
  start_slurm
  log "restarted: accounting=$ACCOUNTING user_signal=$USER_SIGNAL"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  install) install_packages ;;
  up) up ;;
  down) down ;;
  restart) restart ;;
  status) on_host head sinfo; on_host head squeue ;;
  exec) [ $# -gt 0 ] || die "exec needs a command"; on_host head "$@" ;;
  node) n=$1; shift; on_host "node$n" "$@" ;;
  _inside) inside "$@" ;;
  *) die "usage: testcluster.sh install|up|down|restart|status|exec CMD...|node N CMD..." ;;
esac
