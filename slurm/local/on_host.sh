#!/usr/bin/env bash
# on_host.sh NODE CMD [ARGS...]: run CMD "on" a host of the multi-host test cluster
# (start_multinode.sh): in NODE's network namespace, with NODE as hostname (its own UTS namespace)
# and the cluster's hosts file as /etc/hosts (its own mount namespace, nothing changes outside).
# Every other path is the machine's own: the hosts share one filesystem, like the shared home or
# project filesystem of a real cluster.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/local/multinode.sh
. "$HERE/multinode.sh"

[ "$#" -ge 2 ] || {
  echo "usage: on_host.sh NODE CMD [ARGS...] (NODE: one of $(ip netns list 2>/dev/null | awk -v p="$MN_PREFIX" 'index($1, p) == 1 { printf "%s ", $1 }'))" >&2
  exit 2
}
node=$1
shift
[ -e "/run/netns/$node" ] || {
  echo "on_host.sh: no host $node (no network namespace /run/netns/$node; start_multinode.sh makes them)" >&2
  exit 2
}
exec nsenter --net="/run/netns/$node" -- unshare --uts --mount --propagation slave -- \
  bash -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' on_host "$MN_HOSTS" "$node" "$@"
