# Shared by start_multinode.sh, stop_multinode.sh and on_host.sh (sourced, not run): names and
# paths of the multi-host test cluster. Everything lives under one run directory and one name prefix,
# so that the stop script finds exactly what the start script made.
# shellcheck shell=bash

MN_DIR=${SLIMRL_MN_DIR:-/run/slimrl-multinode}
# common.sh keeps its daemon records here: apart from the one-node cluster's.
export SLIMRL_SLURM_RUN_DIR=$MN_DIR/records
MN_PREFIX=${SLIMRL_MN_PREFIX:-slimrl-n}
MN_SUBNET=${SLIMRL_MN_SUBNET:-10.77.0}
MN_BRIDGE=${MN_PREFIX}br
MN_CONF=$MN_DIR/etc/slurm.conf
MN_HOSTS=$MN_DIR/etc/hosts
# The root namespace's address on the bridge: the "login node" that submits jobs.
MN_LOGIN_IP=$MN_SUBNET.254

mn_node() { echo "$MN_PREFIX$1"; }       # host number (1..N) -> node name = namespace = hostname
mn_ip() { echo "$MN_SUBNET.$1"; }        # host number -> its cluster address
mn_mgmt_ip() { echo "192.168.77.$1"; }   # a second address no other host reaches: every host is multi-homed
