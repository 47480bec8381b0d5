#!/usr/bin/env bash
# A real two-node cluster on one Linux machine (root): each node is a network + UTS namespace with its own hostname,
# address and /etc/hosts (bind-mounted in a private mount namespace), the two joined by a veth pair; munge, slurmctld
# (on node0) and one slurmd per node from Debian's packages (installed when missing). What breaks first on a real
# cluster (rendezvous across hosts, the interface gloo picks, a node that dies or drops off the link, scancel) can be
# run here: docs/cluster.md.
#   bash scripts/cluster.sh up                  # namespaces, link, munge, slurmctld, 2 slurmd; prints the nodes
#   bash scripts/cluster.sh exec NODE CMD...    # run CMD on NODE (its hostname, address, SLURM_CONF set)
#   bash scripts/cluster.sh kill NODE           # kill -9 every process of NODE (its slurmd too): the node crashed
#   bash scripts/cluster.sh revive NODE         # start NODE's daemons again (after kill) and wait until it is idle
#   bash scripts/cluster.sh link NODE down|up   # take NODE's link down or up (TCP connections stay open)
#   bash scripts/cluster.sh status              # namespaces, daemons, sinfo
#   bash scripts/cluster.sh down                # everything gone: no namespace, link, daemon, mount left
# Environment: CLUSTER_DIR (default /tmp/pipelinerl-cluster; configs, keys, sockets, logs, SLURM state: every file it
# writes), CLUSTER_PREFIX (default plrl: namespace names PREFIX-node0/1), CLUSTER_NET (default 10.77.0: node i is
# CLUSTER_NET.(i+1)/24), CLUSTER_NO_SLURM=1 (network only). The nodes' interface is named clu0 on both (IFNAME=clu0).
set -euo pipefail
DIR="${CLUSTER_DIR:-/tmp/pipelinerl-cluster}"
PREFIX="${CLUSTER_PREFIX:-plrl}"
NET="${CLUSTER_NET:-10.77.0}"
NODES=(node0 node1)
IFACE=clu0

die() { echo "cluster.sh: $*" >&2; exit 1; }
ns() { echo "$PREFIX-$1"; }
addr() { case "$1" in node0) echo "$NET.1" ;; node1) echo "$NET.2" ;; *) die "unknown node '$1' (node0, node1)" ;; esac; }

# Run a command on a node: its network namespace, a UTS namespace with its hostname, and a private mount namespace in
# which the cluster's hosts file covers /etc/hosts (every node resolves every hostname to its link address; the
# mount ends with the node's last process, so nothing is left behind).
node_argv() {
  local node=$1
  shift
  addr "$node" >/dev/null
  ARGV=(ip netns exec "$(ns "$node")" unshare --uts --mount --propagation private
    env SLURM_CONF="$DIR/slurm.conf" sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
    sh "$node" "$DIR/hosts" "$@")
}
in_node() {
  node_argv "$@"
  "${ARGV[@]}"
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then return; fi
  [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are missing and installing them needs root"
  echo "installing slurm-wlm and munge (Debian packages)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
}

write_configs() {
  mkdir -p "$DIR"/{log,munge,slurm/state}
  chmod 700 "$DIR/munge"
  printf '127.0.0.1 localhost\n::1 localhost\n%s node0\n%s node1\n' "$(addr node0)" "$(addr node1)" >"$DIR/hosts"
  [ -n "${CLUSTER_NO_SLURM:-}" ] && return
  [ -f "$DIR/munge/munge.key" ] || { head -c 1024 /dev/urandom >"$DIR/munge/munge.key"; chmod 400 "$DIR/munge/munge.key"; }
  # slurmd (22.05) refuses to start without a cgroup.conf beside slurm.conf, even with cgroups unused
  printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nIgnoreSystemd=yes\n' >"$DIR/cgroup.conf"
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=$PREFIX
SlurmctldHost=node0($(addr node0))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/slurm/state
SlurmdSpoolDir=$DIR/slurm/spool-%n
SlurmctldPidFile=$DIR/slurm/slurmctld.pid
SlurmdPidFile=$DIR/slurm/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# no cgroups in this container: processes tracked by parentage, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
# a crashed node is marked down after 30 s; scancel's SIGTERM becomes SIGKILL after KillWait (the trainer's own
# stop deadline is 25 s: docs/fault_tolerance.md)
SlurmdTimeout=30
KillWait=30
InactiveLimit=0
NodeName=node0 NodeAddr=$(addr node0) CPUs=$(nproc) State=UNKNOWN
NodeName=node1 NodeAddr=$(addr node1) CPUs=$(nproc) State=UNKNOWN
PartitionName=main Nodes=node0,node1 Default=YES MaxTime=INFINITE State=UP
EOF
}

up() {
  [ "$(id -u)" = 0 ] || die "up needs root (network namespaces, daemons)"
  for n in "${NODES[@]}"; do
    if ip netns list | grep -qw "$(ns "$n")"; then die "namespace $(ns "$n") exists: run 'down' first"; fi
  done
  [ -n "${CLUSTER_NO_SLURM:-}" ] || install_packages
  write_configs
  # `ip netns add` makes /run/netns a mount point the first time: noted, so that `down` can take it away again
  if [ ! -e /run/netns ]; then touch "$DIR/.made-run-netns"; elif ! mountpoint -q /run/netns; then touch "$DIR/.made-netns-mount"; fi
  for n in "${NODES[@]}"; do
    ip netns add "$(ns "$n")"
    ip -n "$(ns "$n")" link set lo up
  done
  ip link add "$PREFIX-a" type veth peer name "$PREFIX-b"
  local end=("$PREFIX-a" "$PREFIX-b")
  for i in 0 1; do
    local n=${NODES[$i]}
    ip link set "${end[$i]}" netns "$(ns "$n")"
    ip -n "$(ns "$n")" link set "${end[$i]}" name "$IFACE"
    ip -n "$(ns "$n")" addr add "$(addr "$n")/24" dev "$IFACE"
    ip -n "$(ns "$n")" link set "$IFACE" up
  done
  [ "$(in_node node0 getent hosts node1)" = "$(addr node1)       node1" ] || die "node0 does not resolve node1"
  if [ -z "${CLUSTER_NO_SLURM:-}" ]; then
    munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
      --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    in_node node0 slurmctld -f "$DIR/slurm.conf"
    for n in "${NODES[@]}"; do in_node "$n" slurmd -f "$DIR/slurm.conf" -N "$n"; done
    # both slurmd registered with slurmctld over the link: the nodes reach each other
    wait_idle node0 node1
  fi
  status
}

# wait (30 s at most) until slurmctld reports every named node idle
wait_idle() {
  local t n ok
  for t in $(seq 1 30); do
    ok=1
    for n in "$@"; do
      [ "$(in_node node0 sinfo -h -n "$n" -o '%T' 2>/dev/null)" = idle ] || ok=
    done
    [ -n "$ok" ] && return 0
    sleep 1
  done
  die "nodes $* not idle after 30 s: $DIR/log/"
}

revive() {
  # shellcheck disable=SC2046
  all_gone $(pid_of "$DIR/slurm/slurmd-$1.pid") || die "slurmd of $1 is running"
  # node0 also runs slurmctld, which died with it
  # shellcheck disable=SC2046
  if [ "$1" = node0 ] && all_gone $(pid_of "$DIR/slurm/slurmctld.pid"); then in_node node0 slurmctld -f "$DIR/slurm.conf"; fi
  in_node "$1" slurmd -f "$DIR/slurm.conf" -N "$1"
  wait_idle "$1"
  echo "$1: slurmd up, idle"
}

pid_of() { [ -f "$1" ] && cat "$1" || true; }

# true once none of the pids is alive (a zombie counts as gone: this container's init may reap late)
all_gone() {
  local p
  for p in "$@"; do
    if [ -e "/proc/$p" ] && [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]; then return 1; fi
  done
}

down() {
  local n p t pids
  # the daemons by their pid files, then whatever else runs on a node (jobs this cluster started)
  pids="$(pid_of "$DIR/slurm/slurmctld.pid") $(pid_of "$DIR/slurm/slurmd-node0.pid") \
    $(pid_of "$DIR/slurm/slurmd-node1.pid") $(pid_of "$DIR/munge/munged.pid")"
  for n in "${NODES[@]}"; do
    if ip netns list | grep -qw "$(ns "$n")"; then pids="$pids $(ip netns pids "$(ns "$n")")"; fi
  done
  # shellcheck disable=SC2086
  for p in $pids; do kill -9 "$p" 2>/dev/null || true; done
  for t in $(seq 50); do
    # shellcheck disable=SC2086
    if all_gone $pids; then break; fi
    sleep 0.1
  done
  for n in "${NODES[@]}"; do
    if ip netns list | grep -qw "$(ns "$n")"; then ip netns del "$(ns "$n")"; fi
  done
  ip link del "$PREFIX-a" 2>/dev/null || true
  if [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then
    if [ -e "$DIR/.made-run-netns" ] || [ -e "$DIR/.made-netns-mount" ]; then umount /run/netns 2>/dev/null || true; fi
    if [ -e "$DIR/.made-run-netns" ]; then rmdir /run/netns; fi
  fi
  rm -f "$DIR/.made-run-netns" "$DIR/.made-netns-mount"
  rm -f "$DIR"/slurm/*.pid "$DIR/munge/munged.pid" "$DIR/munge/munge.socket" "$DIR/munge/munge.socket.lock"
  echo "down: no namespace $(ns node0)/$(ns node1), no daemon; logs kept in $DIR/log"
}

status() {
  local n
  for n in "${NODES[@]}"; do
    if ip netns list | grep -qw "$(ns "$n")"; then
      echo "$n: namespace $(ns "$n"), $IFACE $(addr "$n"), $(ip netns pids "$(ns "$n")" | wc -l) processes"
    else
      echo "$n: down"
    fi
  done
  if [ -z "${CLUSTER_NO_SLURM:-}" ] && ip netns list | grep -qw "$(ns node0)" && [ -f "$DIR/slurm.conf" ]; then
    in_node node0 sinfo -N -o '%N %T %c' || true
  fi
}

kill_node() {
  local p pids
  pids=$(ip netns pids "$(ns "$1")")
  for p in $pids; do kill -9 "$p" 2>/dev/null || true; done
  echo "killed $(echo "$pids" | wc -w) processes on $1"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  exec)
    [ $# -ge 2 ] || die "usage: exec NODE CMD..."
    node_argv "$@"
    exec "${ARGV[@]}" # the command replaces this shell: its pid is the caller's child, on the node
    ;;
  kill) [ $# = 1 ] || die "usage: kill NODE"; addr "$1" >/dev/null; kill_node "$1" ;;
  revive) [ $# = 1 ] || die "usage: revive NODE"; addr "$1" >/dev/null; revive "$1" ;;
  link)
    [ $# = 2 ] && [[ $2 =~ ^(up|down)$ ]] || die "usage: link NODE up|down"
    addr "$1" >/dev/null
    ip -n "$(ns "$1")" link set "$IFACE" "$2"
    ;;
  *) die "usage: cluster.sh up|down|status|exec NODE CMD...|kill NODE|revive NODE|link NODE up|down" ;;
esac
