#!/usr/bin/env bash
# start_multinode.sh [--hosts N]: a Slurm cluster of N hosts (default 2) on this one machine, each
# host a network namespace with its own address and hostname, for running the sbatch scripts
# under slurm/ across real (virtual) network links (tests/test_slurm_multinode.py; docs/slurm.md).
#
#   host k (1..N): network namespace slimrl-nk = node name = hostname (UTS namespace), address
#                  10.77.0.k on eth0 (a veth into the bridge slimrl-nbr), plus a second address
#                  192.168.77.k on a link mgmt0 that no other host reaches (multi-homed)
#   the machine:   10.77.0.254 on the bridge: the login node that submits jobs
#   slurmctld on host 1, one slurmd per host, munged shared (its socket is a file, and the hosts
#   share the filesystem, as cluster nodes share a home or project filesystem); each daemon runs
#   under slurm/local/on_host.sh, which also gives it the cluster's hosts file as /etc/hosts
#   (in its own mount namespace: the machine's /etc/hosts is never touched).
#
# Config, state, logs and records live under /run/slimrl-multinode; clients use
# SLURM_CONF=/run/slimrl-multinode/etc/slurm.conf. On success stdout carries KEY=VALUE lines:
# SLURM_CONF, PARTITION, NODES (name:address,...). Any failure tears down what was made.
# Stop with slurm/local/stop_multinode.sh. Needs root (namespaces, slurmd): exit 3 otherwise;
# bad arguments: exit 2.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/local/multinode.sh
. "$HERE/multinode.sh"
# shellcheck source=slurm/local/common.sh
. "$HERE/common.sh"

T_START=$(now)
HOSTS=2
while [ "$#" -gt 0 ]; do
  case "$1" in
    --hosts)
      [ "$#" -ge 2 ] && [[ "$2" =~ ^[2-9]$ ]] || {
        log "--hosts ${2:-}: must be a number of hosts from 2 to 9"
        exit 2
      }
      HOSTS=$2
      shift 2
      ;;
    *)
      log "unknown argument '$1': usage: start_multinode.sh [--hosts N] (N from 2 to 9)"
      exit 2
      ;;
  esac
done
[ "$(id -u)" -eq 0 ] || {
  log "needs root (it creates network namespaces and runs slurmd); run it as root"
  exit 3
}
for tool in ip nsenter unshare; do
  command -v "$tool" >/dev/null || {
    log "needs '$tool' (iproute2 / util-linux)"
    exit 3
  }
done
if [ -e "/run/netns/$(mn_node 1)" ] || [ -d "$MN_DIR" ]; then
  die "a multi-host cluster is already up ($MN_DIR exists); stop it with slurm/local/stop_multinode.sh"
fi

# Packages and the munge key: the one-node script's installer (exit 3 there means impossible here).
"$HERE/start_cluster.sh" --install-only

# From here on, whatever fails leaves nothing behind.
# shellcheck disable=SC2317  # called by the trap
on_exit() {
  local rc=$?
  trap - EXIT
  if [ "$rc" -ne 0 ]; then
    log "start failed (exit code $rc): tearing down"
    tail -n 5 "$MN_DIR"/log/*.log >&2 2>/dev/null || true
    "$HERE/stop_multinode.sh" || true
  fi
  exit "$rc"
}
trap on_exit EXIT

# ------------------------------------------------------------------------------ 1. network
install -d -m 0755 "$MN_DIR" "$MN_DIR/etc" "$MN_DIR/records"
# What the stop script deletes (written before it is made, so a half-made one goes too).
echo "$MN_BRIDGE" >"$MN_DIR/links"
ip link add "$MN_BRIDGE" type bridge
ip addr add "$MN_LOGIN_IP/24" dev "$MN_BRIDGE"
ip link set "$MN_BRIDGE" up
{
  echo "127.0.0.1 localhost"
  echo "$MN_LOGIN_IP ${MN_PREFIX}login"
} >"$MN_HOSTS"
nodes=()
for ((k = 1; k <= HOSTS; k++)); do
  node=$(mn_node "$k")
  nodes+=("$node")
  echo "$node" >>"$MN_DIR/namespaces"
  ip netns add "$node"
  ip -n "$node" link set lo up
  # The management link comes first, so `hostname -I` lists its address first: a script that
  # takes the first address of a host gets one that no other host reaches.
  # (A veth pair with both ends in the host: kernels without the dummy driver have veth.)
  ip -n "$node" link add mgmt0 type veth peer name mgmt0peer
  ip -n "$node" addr add "$(mn_mgmt_ip "$k")/24" dev mgmt0
  ip -n "$node" link set mgmt0peer up
  ip -n "$node" link set mgmt0 up
  echo "${MN_PREFIX}v$k" >>"$MN_DIR/links"
  ip link add "${MN_PREFIX}v$k" type veth peer name eth0 netns "$node"
  ip link set "${MN_PREFIX}v$k" master "$MN_BRIDGE" up
  ip -n "$node" addr add "$(mn_ip "$k")/24" dev eth0
  ip -n "$node" link set eth0 up
  echo "$(mn_ip "$k") $node" >>"$MN_HOSTS"
done
log "network: ${nodes[*]} on $MN_BRIDGE ($MN_SUBNET.0/24, login $MN_LOGIN_IP)"

# ------------------------------------------------------------------------------ 2. config
PROCTRACK=linuxproc
if awk '$2 == "/sys/fs/cgroup/freezer" && $3 == "cgroup" { found = 1 } END { exit !found }' /proc/mounts; then
  PROCTRACK=cgroup
fi
HW=$(slurmd -C | head -1)
CPUS=$(grep -o 'CPUs=[0-9]*' <<<"$HW" | cut -d= -f2)
TOPOLOGY=$(grep -o 'Boards=.* ThreadsPerCore=[0-9]*' <<<"$HW")
# The hosts share the machine's memory: each declares its share (nothing enforces it).
REAL_MEMORY=$(awk -v n="$HOSTS" '/^MemTotal:/ { print int($2 / 1024 * 0.9 / n) }' /proc/meminfo)
install -d -o slurm -g slurm -m 0755 "$MN_DIR/state" "$MN_DIR/log" "$MN_DIR/run" "$MN_DIR/spool"
for node in "${nodes[@]}"; do install -d -o slurm -g slurm -m 0755 "$MN_DIR/spool/$node"; done
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
cat >"$MN_CONF" <<EOF
# generated by slimrl slurm/local/start_multinode.sh: $HOSTS hosts, one per network namespace
ClusterName=slimrl-multinode
SlurmctldHost=$(mn_node 1)($(mn_ip 1))
SlurmUser=slurm
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
# Every daemon listens on the address its host name resolves to (the hosts file), not 0.0.0.0.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
MailProg=/bin/true
StateSaveLocation=$MN_DIR/state
SlurmdSpoolDir=$MN_DIR/spool/%n
SlurmctldPidFile=$MN_DIR/run/slurmctld.pid
SlurmdPidFile=$MN_DIR/run/slurmd-%n.pid
SlurmctldLogFile=$MN_DIR/log/slurmctld.log
SlurmdLogFile=$MN_DIR/log/slurmd-%n.log
$(scheduling_conf "$MN_DIR/log/jobcomp.log")
EOF
for ((k = 1; k <= HOSTS; k++)); do
  echo "NodeName=$(mn_node "$k") NodeAddr=$(mn_ip "$k") CPUs=$CPUS $TOPOLOGY RealMemory=$REAL_MEMORY State=UNKNOWN" >>"$MN_CONF"
done
echo "PartitionName=multi Nodes=${MN_PREFIX}[1-$HOSTS] Default=YES MaxTime=INFINITE State=UP" >>"$MN_CONF"
if [ "$PROCTRACK" = cgroup ]; then
  printf '%s\n' "# generated by slimrl slurm/local/start_multinode.sh" "CgroupPlugin=cgroup/v1" \
    "CgroupAutomount=no" "ConstrainCores=no" "ConstrainRAMSpace=no" "ConstrainDevices=no" >"$MN_DIR/etc/cgroup.conf"
fi
export SLURM_CONF=$MN_CONF

# ------------------------------------------------------------------------------ 3. daemons
T_DAEMONS=$(now)
start_daemon munged /run/munge/munged.pid runuser -u munge -- /usr/sbin/munged
munge -n | unmunge >/dev/null || die "munge cannot decode its own credential"
start_daemon slurmctld "$MN_DIR/run/slurmctld.pid" "$HERE/on_host.sh" "$(mn_node 1)" /usr/sbin/slurmctld -f "$MN_CONF"
for node in "${nodes[@]}"; do
  start_daemon "slurmd@$node" "$MN_DIR/run/slurmd-$node.pid" "$HERE/on_host.sh" "$node" /usr/sbin/slurmd -f "$MN_CONF"
done

# Up once every slurmd has registered with slurmctld on host 1 (the links work) and the login
# node sees them idle (through the bridge).
states=""
for ((i = 0; i < 300; i++)); do
  states=$(sinfo --noheader --Node --format='%N %T' 2>/dev/null || true)
  [ -n "$states" ] && ! awk '$2 != "idle" { bad = 1 } END { exit !bad }' <<<"$states" &&
    [ "$(wc -l <<<"$states")" -eq "$HOSTS" ] && break
  sleep 0.2
done
[ "$(awk '$2 == "idle"' <<<"$states" | wc -l)" -eq "$HOSTS" ] ||
  die "not every node is idle after 60 s: $(tr '\n' ' ' <<<"$states")"
log "cluster up: ${nodes[*]} idle, proctrack/$PROCTRACK (daemons $(elapsed "$T_DAEMONS") s, total $(elapsed "$T_START") s)"
echo "SLURM_CONF=$MN_CONF"
echo "PARTITION=multi"
printf 'NODES='
for ((k = 1; k <= HOSTS; k++)); do printf '%s%s:%s' "$([ "$k" -eq 1 ] || echo ,)" "$(mn_node "$k")" "$(mn_ip "$k")"; done
echo
