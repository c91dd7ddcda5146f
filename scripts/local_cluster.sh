#!/usr/bin/env bash
# A Ray cluster of several nodes on this one machine, for tests and for trying multi-node runs.
#
#   scripts/local_cluster.sh start [NODES] [CPUS_PER_NODE]   # default 3 nodes x 2 CPUs
#   scripts/local_cluster.sh add [CPUS]      # one more worker node (e.g. replacing a lost one)
#   scripts/local_cluster.sh stop
#
# Node i gets its own loopback address (127.0.0.2, .3, ...; ray start --node-ip-address), its own
# temp dir (nodes sharing one unpack a job's working_dir over each other) and free ports (Ray's defaults
# collide with any other Ray on the machine); each
# runs in a session of its own, and `stop` kills exactly those sessions (never `ray stop`, which
# would take down every Ray on the machine). State: $RLHF_CLUSTER_DIR (default /tmp/rlhf-cluster),
# which also holds `address` (for cluster.address=), `dashboard` (for launch/submit.sh --address)
# and `env` (source it: the cluster's private auth token and RAY_ADDRESS). The job's `python` is
# the one beside this script's ray. The nodes inherit this script's environment.
#
# RLHF_HEAD_CPUS=N: the head's CPUs (default CPUS_PER_NODE; 0: a KubeRay-style head that runs only
# drivers). RLHF_PRIVATE_DIR=DIR: the last node of `start` gets a disk of its own at DIR (an empty
# tmpfs in a mount namespace of its own; needs root), to try what a cluster without a shared disk
# does there.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${RLHF_CLUSTER_DIR:-/tmp/rlhf-cluster}
RAY=${RAY_CLI:-.venv/bin/ray}
[ -x "$RAY" ] || RAY=$(command -v ray)
RAY="$(cd "$(dirname "$RAY")" && pwd)/$(basename "$RAY")"  # absolute: the nodes' PATH gets its dir

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop() {
  [ -d "$DIR" ] || return 0
  for f in "$DIR"/node-*.sid; do
    [ -e "$f" ] || continue
    sid=$(cat "$f")
    for sig in TERM KILL; do
      pids=$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
      [ -n "$pids" ] || break
      kill -s "$sig" $pids 2>/dev/null || true
      sleep 2
    done
    rm -f "$f"
  done
  echo "stopped the local cluster in $DIR"
}

# start_node INDEX CPUS PORT DASHBOARD_PORT [PRIVATE_DIR]: node INDEX at 127.0.0.(INDEX+2) (0 = the head)
start_node() {
  local i=$1 cpus=$2 port=$3 dash=$4 private=${5:-}
  local ip="127.0.0.$((i + 2))" tmp="/tmp/rlhf-n$i-$$"  # short: Ray's socket paths must stay < 108 bytes
  local args=(--node-ip-address="$ip" --num-cpus="$cpus" --temp-dir="$tmp" --block --disable-usage-stats)
  # Ray's fixed dashboard-agent port (52365) collides with any other Ray on this machine (a
  # test session's own): every node gets a free one
  args+=(--dashboard-agent-listen-port="$(free_port)")
  if [ "$i" -eq 0 ]; then
    args+=(--head --port="$port" --dashboard-host=127.0.0.2 --dashboard-port="$dash" --include-dashboard=true)
  else
    args+=(--address="127.0.0.2:$port")
  fi
  if [ -n "$private" ]; then
    mkdir -p "$private"
    # unshare and sh exec: the pid stays setsid's, so `stop` still finds the session
    setsid unshare --mount --propagation private sh -c 'mount -t tmpfs rlhf-private "$0" && exec "$@"' \
      "$private" "$RAY" start "${args[@]}" >"$DIR/node-$i.log" 2>&1 &
  else
    setsid "$RAY" start "${args[@]}" >"$DIR/node-$i.log" 2>&1 &
  fi
  echo $! >"$DIR/node-$i.sid"  # setsid's child leads its own session: its pid is the session id
}

# The environment the nodes start in: this cluster's token (not one from the caller's env), no
# RAY_ADDRESS (ray start takes --address), the ray beside this script on PATH.
use_cluster_env() {
  # shellcheck disable=SC1091
  . "$DIR/env"
  unset RAY_ADDRESS RAY_AUTH_TOKEN
  export RAY_USAGE_STATS_ENABLED=0 PATH="$(dirname "$RAY"):$PATH"
}

alive_nodes() { "$RAY" status --address="$1" 2>/dev/null | grep -c " node_" || true; }

# add [CPUS]: the next free index joins the running cluster (a replacement for a lost node gets a
# new address, as a new machine would)
add() {
  local cpus=${1:-2} address i=1
  [ -f "$DIR/address" ] || { echo "no local cluster in $DIR: start one first" >&2; exit 1; }
  address=$(cat "$DIR/address")
  use_cluster_env
  while [ -e "$DIR/node-$i.sid" ]; do i=$((i + 1)); done  # a lost node's file stays: new address
  start_node "$i" "$cpus" "${address##*:}" 0
  # `ray start` prints this once the raylet registered with the head
  for _ in $(seq 1 120); do
    grep -q "Ray runtime started" "$DIR/node-$i.log" 2>/dev/null && break
    sleep 1
  done
  if ! grep -q "Ray runtime started" "$DIR/node-$i.log" 2>/dev/null; then
    echo "node 127.0.0.$((i + 2)) did not join within 120 s; log: $DIR/node-$i.log" >&2
    exit 1
  fi
  echo "node 127.0.0.$((i + 2)) (${cpus} CPUs) joined the local cluster at $address"
}

start() {
  local nodes=${1:-3} cpus=${2:-2}
  stop
  mkdir -p "$DIR"
  local port dash
  port=$(free_port)
  dash=$(free_port)
  # Token authentication with a private token (Ray 2.60 turns token auth on by itself once
  # ~/.ray/auth_token exists): source $DIR/env to talk to this cluster.
  python3 -c 'import secrets; print(secrets.token_hex(32))' >"$DIR/auth_token"
  chmod 600 "$DIR/auth_token"
  printf 'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=%s RAY_ADDRESS=%s\n' "$DIR/auth_token" "127.0.0.2:$port" >"$DIR/env"
  use_cluster_env
  for i in $(seq 0 $((nodes - 1))); do
    local node_cpus=$cpus private=""
    [ "$i" -eq 0 ] && node_cpus=${RLHF_HEAD_CPUS:-$cpus}
    [ -n "${RLHF_PRIVATE_DIR:-}" ] && [ "$i" -gt 0 ] && [ "$i" -eq $((nodes - 1)) ] && private=$RLHF_PRIVATE_DIR
    start_node "$i" "$node_cpus" "$port" "$dash" "$private"
    if [ "$i" -eq 0 ]; then  # the others join the head: wait until it answers
      for _ in $(seq 1 120); do
        "$RAY" status --address="127.0.0.2:$port" >/dev/null 2>&1 && break
        sleep 1
      done
    fi
  done
  echo "127.0.0.2:$port" >"$DIR/address"
  echo "http://127.0.0.2:$dash" >"$DIR/dashboard"
  for _ in $(seq 1 120); do
    alive=$(alive_nodes "127.0.0.2:$port")
    [ "$alive" -ge "$nodes" ] && break
    sleep 1
  done
  if [ "${alive:-0}" -lt "$nodes" ]; then
    echo "only ${alive:-0} of $nodes nodes joined within 120 s; logs: $DIR/node-*.log" >&2
    stop
    exit 1
  fi
  echo "local cluster: $nodes nodes x $cpus CPUs at 127.0.0.2:$port (dashboard http://127.0.0.2:$dash)"
}

case "${1:-}" in
  start) shift; start "$@" ;;
  add) shift; add "$@" ;;
  stop) stop ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
