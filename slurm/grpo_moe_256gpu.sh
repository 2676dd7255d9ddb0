#!/usr/bin/env bash
# GRPO on a large MoE (configs/grpo_moe_256gpu.yaml: Qwen3-235B-A22B) over 32 nodes x 8 GPUs.
#
#   sbatch slurm/grpo_moe_256gpu.sh                      # from the repository root
#   SLIMRL_CONFIG=configs/qwen3_30b_a3b_8gpu.yaml sbatch --nodes=1 slurm/grpo_moe_256gpu.sh
#   SLIMRL_CONFIG=configs/tiny_moe_grpo_cpu.yaml sbatch --wait --nodes=1 --gpus-per-node=0 \
#       --cpus-per-task=2 --mem=0 slurm/grpo_moe_256gpu.sh      # one CPU node (see docs/slurm.md)
#
# One Ray node per Slurm node: the head on the node running this script, workers on the others
# (one `srun` step each side), then `slimrl train` here joins that cluster through `ray.address`.
# Command-line options of sbatch override the #SBATCH lines; nothing below hard-codes the sizes.
#
# Environment (sbatch passes the submitting shell's environment to the job):
#   SLIMRL_CONFIG     config file (default: configs/grpo_moe_256gpu.yaml), relative to the
#                     directory the job runs in (the submit directory unless --chdir)
#   SLIMRL_OVERRIDES  extra `key=value` overrides, space separated; they come last and win
#                     (arguments after the script name are appended to them)
#   SLIMRL_VENV       virtualenv to activate first (must exist at the same path on every node)
#   SLIMRL_RAY_PORT   Ray GCS port on the head (default 6379)
#   SLIMRL_RAY_ARGS   extra `ray start` arguments for every node (ports, --object-store-memory, ...)
#   SLIMRL_HEAD_IP    address the other nodes reach the head at (default: resolved from its name)
#   SLIMRL_RAY_WAIT_S how long to wait for every node to join Ray (default 300)
#   SLIMRL_RAY_TMPDIR Ray's temp dirs: <dir>/<node name> on each node (default /tmp/slimrl-ray-<job id>)
#
#SBATCH --job-name=slimrl-grpo
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

log() { printf '[slimrl-slurm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

[ -n "${SLURM_JOB_ID:-}" ] || die "run this script with sbatch (no SLURM_JOB_ID)"

# ------------------------------------------------------------------------------ settings
if [ -n "${SLIMRL_VENV:-}" ]; then
  [ -f "$SLIMRL_VENV/bin/activate" ] || die "SLIMRL_VENV=$SLIMRL_VENV: no bin/activate"
  # shellcheck source=/dev/null
  . "$SLIMRL_VENV/bin/activate"
fi
for tool in ray slimrl python3 srun scontrol; do
  command -v "$tool" >/dev/null || die "'$tool' is not on PATH (set SLIMRL_VENV?)"
done
config=${SLIMRL_CONFIG:-configs/grpo_moe_256gpu.yaml}
[ -f "$config" ] || die "config $config not found from $(pwd) (submit from the repository root or use --chdir)"
# Split on whitespace without glob expansion; no override value contains a space.
read -r -a user_overrides <<<"${SLIMRL_OVERRIDES:-}"
user_overrides+=("$@")
port=${SLIMRL_RAY_PORT:-6379}
read -r -a ray_args <<<"${SLIMRL_RAY_ARGS:-}"
wait_s=${SLIMRL_RAY_WAIT_S:-300}

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
num_nodes=${#nodes[@]}
# The head is the node this batch script runs on: the driver below must run on a Ray node.
head=${SLURMD_NODENAME:-$(hostname -s)}
workers=()
for node in "${nodes[@]}"; do [ "$node" = "$head" ] || workers+=("$node"); done
[ "${#workers[@]}" -eq $((num_nodes - 1)) ] || die "batch host $head is not in the node list ${nodes[*]}"
worker_list=$(
  IFS=,
  echo "${workers[*]}"
)

# "8", "h100:8" or "gpu:h100:8" -> 8; --gres=gpu:N jobs only set SLURM_GPUS_ON_NODE.
gpus=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
gpus=${gpus##*:}
[[ "$gpus" =~ ^[0-9]+$ ]] || die "cannot read GPUs per node from '${SLURM_GPUS_PER_NODE:-}'"
cpus=${SLURM_CPUS_PER_TASK:-$(nproc)}
# Slurm 22.05's srun does not inherit --cpus-per-task from sbatch: ask for it again.
step_cpus=()
[ -z "${SLURM_CPUS_PER_TASK:-}" ] || step_cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")

if [ "$gpus" -gt 0 ]; then
  cluster_overrides=("cluster.gpus_per_node=$gpus")
  ray_resources=(--num-cpus="$cpus" --num-gpus="$gpus")
else
  # A CPU run: on CPU `cluster.gpus_per_node` counts process slots and the config's value stands
  # (override it in SLIMRL_OVERRIDES); each slot takes one of the job's CPUs in Ray.
  cluster_overrides=("cluster.device=cpu")
  ray_resources=(--num-cpus="$cpus" --num-gpus=0)
fi

if [ "$num_nodes" -eq 1 ]; then
  # Everything stays on this machine. Ray would turn 127.0.0.1 into the machine's external address
  # (resolve_ip_for_localhost); 127.0.0.2 is loopback too but is kept as given.
  head_ip=${SLIMRL_HEAD_IP:-127.0.0.2}
else
  head_ip=${SLIMRL_HEAD_IP:-}
  # A node may have several addresses (management, storage, cluster network); the one the other
  # nodes surely reach is the one Slurm reaches the head at: its NodeAddr (the node name unless
  # slurm.conf gives an address). (|| true: getent fails for a name it cannot resolve, and
  # set -e would end the script quietly.)
  if [ -z "$head_ip" ]; then
    node_addr=$(scontrol show node "$head" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)
    if [[ "$node_addr" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
      [[ "$node_addr" == 127.* ]] || head_ip=$node_addr
    elif [ -n "$node_addr" ]; then
      head_ip=$(getent ahostsv4 "$node_addr" | awk '$1 !~ /^127\./ { print $1; exit }' || true)
    fi
  fi
  [ -n "$head_ip" ] || head_ip=$(getent ahostsv4 "$head" | awk '$1 !~ /^127\./ { print $1; exit }' || true)
  # Many images map the host name to 127.0.1.1: fall back to the first configured address.
  [ -n "$head_ip" ] || head_ip=$(hostname -I | awk '{ print $1 }' || true)
  [ -n "$head_ip" ] || die "cannot find an address of $head that the other nodes reach; set SLIMRL_HEAD_IP"
fi
address="$head_ip:$port"

# Ray keeps its sockets, logs and the "current cluster" file under --temp-dir. The default
# /tmp/ray is shared with every other Ray on the node, and a plain `ray.init()` there would join
# this cluster instead of starting its own; a per-job directory keeps them apart. Each node takes
# a subdirectory named after itself: nodes that share the directory (a shared /tmp, or a
# SLIMRL_RAY_TMPDIR on a shared filesystem) would otherwise overwrite each other's sockets.
ray_base=${SLIMRL_RAY_TMPDIR:-/tmp/slimrl-ray-$SLURM_JOB_ID}
ray_tmp=$ray_base/$head
# Every process of this job (ray start, its workers, the driver) inherits these through srun.
export RAY_USAGE_STATS_ENABLED=0
# Ray >= 2.5x turns token authentication on for `ray start --head` when ~/.ray/auth_token exists,
# but a driver given an explicit address does not pick the token up and cannot connect. Be
# explicit: token auth with a fresh token for this job, unless the caller chose a mode.
if [ -z "${RAY_AUTH_MODE:-}" ]; then
  export RAY_AUTH_MODE=token
  RAY_AUTH_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
  export RAY_AUTH_TOKEN
fi
# On SIGTERM a Ray node first "drains" for 30 s (meant for Ray Serve); nothing here needs that.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0

log "job $SLURM_JOB_ID: $num_nodes node(s) (head $head at $address), $gpus GPU(s) and $cpus CPU(s) per node"
log "config $config, overrides: ${user_overrides[*]:-none}"

# ------------------------------------------------------------------------------ teardown
step_pids=()
train_pid=""
# shellcheck disable=SC2317  # only ever called by the EXIT trap
teardown() {
  local rc=$? pid i steps
  trap - EXIT INT TERM
  if [ -n "$train_pid" ] && kill -0 "$train_pid" 2>/dev/null; then
    log "stopping slimrl (pid $train_pid)"
    kill -TERM "$train_pid" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do kill -0 "$train_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$train_pid" 2>/dev/null || true
  fi
  # SIGTERM to the Ray steps' tasks: `ray start --block` then stops exactly the Ray processes it
  # started on its node (srun itself, sent SIGTERM, would SIGKILL them). No `ray stop`: it stops
  # every Ray on a node, and a single node may be shared. Whatever is left dies with the step.
  mapfile -t steps < <(squeue --steps --jobs="$SLURM_JOB_ID" --noheader --format='%i %j' 2>/dev/null |
    awk '$2 ~ /^slimrl-ray-/ { print $1 }')
  [ "${#steps[@]}" -eq 0 ] || scancel --signal=TERM "${steps[@]}" 2>/dev/null || true
  # A `ray start` still trying to reach an unreachable head ignores SIGTERM: SIGKILL after 15 s.
  for ((i = 0; i < 20; i++)); do
    local alive=0
    for pid in "${step_pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    if [ "$i" = 15 ] && [ "${#steps[@]}" -gt 0 ]; then
      log "Ray steps still running after SIGTERM: SIGKILL"
      scancel --signal=KILL "${steps[@]}" 2>/dev/null || true
    fi
    sleep 1
  done
  for pid in "${step_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # Keep Ray's logs of a failed run for debugging; after a good one remove every node's.
  if [ "$rc" -eq 0 ]; then
    rm -rf "$ray_tmp"
    if [ "${#workers[@]}" -gt 0 ]; then
      SLIMRL_RAY_BASE=$ray_base timeout 60 srun --job-name=slimrl-ray-cleanup --nodes="${#workers[@]}" \
        --ntasks="${#workers[@]}" --ntasks-per-node=1 --nodelist="$worker_list" \
        bash -c 'rm -rf "$SLIMRL_RAY_BASE/$SLURMD_NODENAME"' || log "could not remove the workers' Ray dirs"
    fi
    rmdir "$ray_base" 2>/dev/null || true
  else
    log "Ray logs: $ray_base/<node> on each node"
  fi
  log "done (exit code $rc)"
  exit "$rc"
}
trap teardown EXIT
# scancel and the time limit send SIGTERM: pass it on to slimrl (it stops cleanly) and tear down.
trap 'log "SIGTERM"; exit 143' TERM
trap 'log "SIGINT"; exit 130' INT

# ------------------------------------------------------------------------------ Ray cluster
ray_start=(ray start --block --disable-usage-stats "${ray_resources[@]}" "${ray_args[@]}")
srun --job-name=slimrl-ray-head --nodes=1 --ntasks=1 "${step_cpus[@]}" --nodelist="$head" \
  "${ray_start[@]}" --temp-dir="$ray_tmp" --head --node-ip-address="$head_ip" --port="$port" \
  --include-dashboard=false &
step_pids+=("$!")

# The head is up once `ray start` has written the cluster's address into its temp dir, here on
# this node. (A driver's ray.init() against a GCS that never comes up retries forever, so the
# Ray check below must not run before this.)
for ((i = 0; i < wait_s; i++)); do
  [ -s "$ray_tmp/ray_current_cluster" ] && break
  kill -0 "${step_pids[0]}" 2>/dev/null || die "the Ray head failed to start (its error is above)"
  sleep 1
done
[ -s "$ray_tmp/ray_current_cluster" ] || die "the Ray head did not come up within $wait_s s"

# Every node must be in the cluster before training starts: the placement group spans all of
# them. Polled from a Ray driver on this (the head) node; it gives up early if a step died.
# On failure it prints one line naming the nodes that are missing (by host name, as Ray sees them).
wait_for_nodes() {
  timeout $((wait_s + 60)) python3 - "$address" "$gpus" "$wait_s" "${nodes[*]}" "${step_pids[@]}" <<'PY'
import os
import sys
import time

import ray

address, gpus, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
expected, steps = sys.argv[4].split(), [int(p) for p in sys.argv[5:]]
deadline = time.monotonic() + timeout


def steps_alive() -> bool:
    for pid in steps:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    return True


def missing(alive: list[dict]) -> str:
    seen = {str(n["NodeManagerHostname"]).split(".")[0] for n in alive}
    names = [name for name in expected if name.split(".")[0] not in seen]
    return ", ".join(names) or f"{len(expected) - len(alive)} of {len(expected)}"


ray.init(address=address, logging_level="ERROR", log_to_driver=False)
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    found = sum(n["Resources"].get("GPU", 0) for n in alive)
    if len(alive) >= len(expected) and found >= len(expected) * gpus:
        print(f"Ray: {len(alive)} node(s), {found:g} GPU(s)", file=sys.stderr)
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(f"Ray: node(s) {missing(alive)} did not join the head at {address} within {timeout:g} s")
    if not steps_alive():
        sys.exit(f"Ray: node(s) {missing(alive)} did not join the head at {address}: their ray start exited")
    time.sleep(2)
PY
}
if [ "${#workers[@]}" -gt 0 ]; then
  # Each worker's --temp-dir names its node, so the task expands it there (exec: SIGTERM still
  # reaches `ray start` itself).
  SLIMRL_RAY_BASE=$ray_base srun --job-name=slimrl-ray-workers "${step_cpus[@]}" --nodes="${#workers[@]}" \
    --ntasks="${#workers[@]}" --ntasks-per-node=1 --nodelist="$worker_list" \
    bash -c 'exec "$@" --temp-dir="$SLIMRL_RAY_BASE/$SLURMD_NODENAME"' ray-worker \
    "${ray_start[@]}" --address="$address" &
  step_pids+=("$!")
fi
# (The python above prints its reason as the last line of its error output.)
wait_out=$(mktemp)
if ! wait_for_nodes 2>"$wait_out"; then
  reason=$(tail -n 1 "$wait_out")
  head -n -1 "$wait_out" >&2
  rm -f "$wait_out"
  die "${reason:-not every node joined Ray}"
fi
cat "$wait_out" >&2
rm -f "$wait_out"

# ------------------------------------------------------------------------------ training
# Run in the background and wait, so a SIGTERM reaches the trap at once instead of after slimrl.
slimrl train "$config" "ray.address=$address" "cluster.num_nodes=$num_nodes" \
  "${cluster_overrides[@]}" "${user_overrides[@]}" &
train_pid=$!
train_rc=0
wait "$train_pid" || train_rc=$?
train_pid=""
log "slimrl train exited with $train_rc"
exit "$train_rc"
