# Shared by the start_*/stop_* scripts here (sourced, not run).
#
# The local cluster must never touch daemons it did not start: the machine may already run a
# munged or a Slurm of its own. So every daemon we start is recorded as "pid starttime comm"
# (starttime = field 22 of /proc/<pid>/stat, in clock ticks since boot), and a record only counts
# while /proc still shows that very process: a recycled pid has another start time.
# shellcheck shell=bash

RUN_DIR=${SLIMRL_SLURM_RUN_DIR:-/run/slimrl-local-slurm}

log() { printf '[%s %s] %s\n' "$(basename "$0" .sh)" "$(date +%H:%M:%S)" "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

proc_starttime() {
  # comm may contain spaces and parentheses: drop everything up to the last ')' first.
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  # After "comm)" the fields start at field 3 (state); starttime is field 22.
  awk '{ print $20 }' <<<"$stat"
}
proc_comm() { cat "/proc/$1/comm" 2>/dev/null; }

# record_pid NAME PID: remember that we started PID as daemon NAME.
record_pid() {
  mkdir -p "$RUN_DIR"
  printf '%s %s %s\n' "$2" "$(proc_starttime "$2")" "$(proc_comm "$2")" >"$RUN_DIR/$1.rec"
}

# our_pid NAME: print the pid of daemon NAME if we started it and it is still that process.
our_pid() {
  local rec="$RUN_DIR/$1.rec" pid start comm
  [ -s "$rec" ] || return 1
  read -r pid start comm <"$rec"
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  [ "$(proc_starttime "$pid")" = "$start" ] && [ "$(proc_comm "$pid")" = "$comm" ] || return 1
  echo "$pid"
}

# pidfile_pid PIDFILE COMM: print the pid in PIDFILE if a process named COMM has it.
pidfile_pid() {
  local pid
  [ -s "$1" ] || return 1
  pid=$(tr -dc '0-9' <"$1")
  [ -n "$pid" ] && [ "$(proc_comm "$pid")" = "$2" ] || return 1
  echo "$pid"
}

# stop_ours NAME...: SIGTERM every named daemon we started, wait for all of them together
# (each takes ~2 s to exit, so waiting in parallel saves seconds), SIGKILL after 15 s.
stop_ours() {
  local name pid pids=() names=() i alive
  for name in "$@"; do
    if pid=$(our_pid "$name"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
      names+=("$name")
    elif [ -e "$RUN_DIR/$name.rec" ]; then
      log "$name: the process we started is already gone"
    fi
  done
  for ((i = 0; i < 150; i++)); do
    alive=0
    for pid in "${pids[@]}"; do [ -d "/proc/$pid" ] && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if our_pid "${names[$i]}" >/dev/null; then
      log "${names[$i]} (pid ${pids[$i]}) ignored SIGTERM for 15 s: SIGKILL"
      kill -KILL "${pids[$i]}" 2>/dev/null || true
    fi
    log "stopped ${names[$i]} (pid ${pids[$i]})"
  done
  for name in "$@"; do rm -f "$RUN_DIR/$name.rec"; done
}

# start_daemon NAME PIDFILE CMD...: start unless already running; record it only if we started it.
# NAME is the process name (comm), optionally followed by @instance (slurmd@node2: one per host).
start_daemon() {
  local name=$1 pidfile=$2 pid i comm=${1%%@*}
  shift 2
  if pid=$(our_pid "$name"); then
    log "$name already running (ours, pid $pid)"
    return 0
  fi
  if pid=$(pidfile_pid "$pidfile" "$comm"); then
    log "$name already running (pid $pid, not started by us: left alone)"
    return 0
  fi
  rm -f "$pidfile"
  "$@" || die "$name failed to start; see its log under /var/log"
  # The daemons fork into the background and write their pidfile once they are up.
  for ((i = 0; i < 150; i++)); do
    if pid=$(pidfile_pid "$pidfile" "$comm"); then
      record_pid "$name" "$pid"
      log "started $name (pid $pid)"
      return 0
    fi
    sleep 0.1
  done
  die "$name did not write $pidfile within 15 s; see its log under /var/log"
}

# The scheduling part of slurm.conf both local clusters share; $1: the job-completion log.
scheduling_conf() {
  cat <<EOF
ProctrackType=proctrack/$PROCTRACK
# No task/cgroup: jobs stay in the memory cgroup this machine put us in.
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
# Requests this node can never satisfy (--nodes=32, --cpus-per-task=64) fail at submission
# instead of pending forever (sbatch --wait would hang).
EnforcePartLimits=ALL
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd, so no sacct: one line per finished job with its final JobState, read by
# sbatch_wait.sh after the job has left slurmctld's memory.
JobCompType=jobcomp/filetxt
JobCompLoc=$1
# sbatch --wait polls every 2 s only while its sleep is below MinJobAge/2; with the default
# (300) it backs off to 8 s and then 32 s. 2 is the minimum slurmctld accepts; 4 keeps finished
# jobs visible to scontrol a little longer.
MinJobAge=4
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=300
InactiveLimit=0
Waittime=0
EOF
}

# Cancel every job and give slurmd time to kill their processes before it goes away itself.
cancel_all_jobs() {
  local jobs i
  mapfile -t jobs < <(squeue --noheader --format=%A 2>/dev/null || true)
  [ ${#jobs[@]} -gt 0 ] || return 0
  log "cancelling jobs ${jobs[*]}"
  scancel "${jobs[@]}" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    [ -z "$(squeue --noheader --format=%A 2>/dev/null)" ] && break
    sleep 0.2
  done
}
