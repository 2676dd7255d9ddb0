#!/usr/bin/env bash
# sbatch_wait.sh [sbatch options] SCRIPT [script args]
#
# Submit with `sbatch --parsable --wait`, print the job id on stdout, and exit 0 only if the job's
# final state is COMPLETED. `sbatch --wait` alone is not enough: it returns 0 for a job that was
# cancelled while pending (or while running, under proctrack/linuxproc), and 1 for a timeout
# without saying so. On failure the exit code is sbatch's when non-zero, else 1.
#
# The final state comes from the jobcomp/filetxt log (the local cluster writes one; the job leaves
# slurmctld's memory MinJobAge seconds after it ends), else from sacct, else from scontrol.
set -euo pipefail

log() { printf '[sbatch_wait] %s\n' "$*" >&2; }

out=$(mktemp)
trap 'rm -f "$out"' EXIT
rc=0
sbatch --parsable --wait "$@" >"$out" || rc=$?
# --parsable prints "jobid" or "jobid;cluster".
job=$(head -n 1 "$out" | cut -d';' -f1)
if ! [[ "$job" =~ ^[0-9]+$ ]]; then
  log "submission failed (sbatch exit code $rc)"
  exit $((rc ? rc : 1))
fi
echo "$job"

jobcomp_log=$(scontrol show config 2>/dev/null | awk '$1 == "JobCompLoc" { print $3 }')
final_state() {
  local state=""
  if [ -r "$jobcomp_log" ]; then
    state=$(grep -E "^JobId=$job " "$jobcomp_log" | tail -n 1 | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
  fi
  if [ -z "$state" ] && command -v sacct >/dev/null; then
    state=$(sacct --noheader --parsable2 --format=State --jobs="$job" -X 2>/dev/null | head -n 1 | cut -d' ' -f1 || true)
  fi
  if [ -z "$state" ]; then
    state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
  fi
  echo "$state"
}

# The completion record may lag the end of `sbatch --wait` a little; states that are not final
# (or none yet) are retried for up to 10 s.
state=""
for ((i = 0; i < 20; i++)); do
  state=$(final_state)
  case "$state" in
    "" | PENDING | RUNNING | CONFIGURING | COMPLETING | SUSPENDED | REQUEUED | RESIZING) sleep 0.5 ;;
    *) break ;;
  esac
done
log "job $job: state ${state:-unknown}, sbatch exit code $rc"
[ "$rc" -eq 0 ] || exit "$rc"
[ "$state" = COMPLETED ] || exit 1
