#!/usr/bin/env bash
# Stop the multi-host cluster of slurm/local/start_multinode.sh and delete everything it made:
# jobs are cancelled, then the daemons it recorded as started by itself are stopped (a munged that
# was already running is left alone), any process still inside one of its network namespaces is
# killed (they are the hosts' own: nothing else runs there), and the namespaces, the bridge and
# /run/slimrl-multinode are deleted. Safe to run twice, or after a half-finished start.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/local/multinode.sh
. "$HERE/multinode.sh"
# shellcheck source=slurm/local/common.sh
. "$HERE/common.sh"

T_START=$(now)
if [ "$(id -u)" -ne 0 ]; then
  log "not root: nothing to stop (start_multinode.sh needs root)"
  exit 0
fi
[ -d "$MN_DIR" ] || {
  log "no multi-host cluster ($MN_DIR does not exist)"
  exit 0
}
export SLURM_CONF=$MN_CONF

our_pid slurmctld >/dev/null && cancel_all_jobs
slurmds=()
for rec in "$SLIMRL_SLURM_RUN_DIR"/slurmd@*.rec; do
  [ -e "$rec" ] && slurmds+=("$(basename "$rec" .rec)")
done
stop_ours "${slurmds[@]}" slurmctld
stop_ours munged

namespaces=()
[ -s "$MN_DIR/namespaces" ] && mapfile -t namespaces <"$MN_DIR/namespaces"
for ns in "${namespaces[@]}"; do
  [ -e "/run/netns/$ns" ] || continue
  mapfile -t left < <(ip netns pids "$ns" 2>/dev/null || true)
  if [ "${#left[@]}" -gt 0 ]; then
    log "WARNING: killing ${#left[@]} process(es) left on host $ns: $(for p in "${left[@]}"; do printf '%s(%s) ' "$p" "$(proc_comm "$p")"; done)"
    kill -KILL "${left[@]}" 2>/dev/null || true
  fi
done
for ((i = 0; i < 50; i++)); do
  busy=0
  for ns in "${namespaces[@]}"; do
    [ -e "/run/netns/$ns" ] && [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && busy=1
  done
  [ "$busy" = 0 ] && break
  sleep 0.1
done
for ns in "${namespaces[@]}"; do
  [ -e "/run/netns/$ns" ] && ip netns del "$ns"
done
# A namespace's veth peers leave the root namespace asynchronously after `ip netns del`: delete
# what is still there (it may vanish meanwhile) and wait until none is left.
links=()
[ -s "$MN_DIR/links" ] && mapfile -t links <"$MN_DIR/links"
for ((i = 0; i < 100; i++)); do
  left=0
  for link in "${links[@]}"; do
    if ip link show "$link" >/dev/null 2>&1; then
      left=1
      ip link del "$link" 2>/dev/null || true
    fi
  done
  [ "$left" = 0 ] && break
  sleep 0.1
done
[ "$left" = 0 ] || log "WARNING: links still present after 10 s: ${links[*]}"
for node in "${namespaces[@]}"; do
  for dir in /sys/fs/cgroup/freezer/slurm_"$node"; do
    [ -d "$dir" ] && find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
done
rm -rf "$MN_DIR"
log "done in $(elapsed "$T_START") s: ${namespaces[*]:-no hosts} and $MN_BRIDGE deleted"
