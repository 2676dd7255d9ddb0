#!/usr/bin/env bash
# Stop the one-node cluster of slurm/local/start_cluster.sh: only the daemons it recorded as
# started by itself (a munged or Slurm that was already running is left alone). Jobs still on
# our controller are cancelled first, so none outlives it. Packages, config and the controller
# state stay, so the next start takes about a second.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/local/common.sh
. "$HERE/common.sh"

T_START=$(now)
if [ "$(id -u)" -ne 0 ]; then
  # Nothing of ours can be running: start_cluster.sh refuses to start daemons without root.
  log "not root: nothing to stop"
  exit 0
fi

our_pid slurmctld >/dev/null && cancel_all_jobs

stop_ours slurmd slurmctld
# munged last: slurmctld and slurmd authenticate through it until they are gone.
stop_ours munged

# A slurmstepd outlives slurmd only if a job did not finish; it is not ours to kill, so report it.
mapfile -t stepds < <(ps -eo pid=,comm= | awk '$2 == "slurmstepd" { print $1 }')
if [ ${#stepds[@]} -gt 0 ]; then
  log "WARNING: slurmstepd still running (pids ${stepds[*]}): a job did not end"
fi
# proctrack/cgroup leaves empty freezer cgroups behind; rmdir never removes a busy one.
for dir in /sys/fs/cgroup/freezer/slurm_*; do
  [ -d "$dir" ] || continue
  find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null || true
done
log "done in $(elapsed "$T_START") s"
