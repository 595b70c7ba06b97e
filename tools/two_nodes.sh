#!/usr/bin/env bash
# Two "hosts" on this machine for multi-node tests: two network namespaces joined by a veth pair,
# each with its own address and hostname, sharing this machine's filesystem as cluster nodes share
# one. Nothing is routed anywhere else: the namespaces see only each other (and their own loopback).
#
#   tools/two_nodes.sh up DIR         create the hosts; writes DIR/hosts.env (names and addresses)
#   tools/two_nodes.sh exec DIR a|b CMD [ARG...]
#                                     run CMD on host a or b (its network, hostname and /etc/hosts)
#   tools/two_nodes.sh link DIR down|up
#                                     cut or restore the wire between the hosts (a network fault)
#   tools/two_nodes.sh down DIR       kill what runs on the hosts, remove them
#
# Needs root (ip netns, unshare). Exit codes: 0 done, 3 cannot (not root or no `ip`/`unshare`),
# 1 setup failed. The hosts are named stepwise-a / stepwise-b inside; DIR/hosts.env has
#   NODE_A_NS, NODE_B_NS (namespace names), NODE_A_IP, NODE_B_IP, NODE_A_NAME, NODE_B_NAME.
set -euo pipefail
cmd="${1:-}"
dir="${2:-}"

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

can_run() {
  if [[ $(id -u) != 0 ]] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
    echo "two_nodes: needs root with iproute2 (ip netns) and util-linux (unshare)" >&2
    exit 3
  fi
}

up() {
  can_run
  mkdir -p "$dir"
  # A short id of this harness: namespace and link names are unique per DIR, so two test
  # sessions on one machine each get their own pair.
  local id subnet
  id="$(printf '%s' "$(realpath "$dir")" | md5sum | cut -c1-6)"
  # 10.213.X.0/24 with X from the id; another pair's subnet is never reused.
  subnet=$((16#${id:0:2}))
  local taken
  taken="$(ip -o -4 addr; ip -all netns exec ip -o -4 addr 2>/dev/null || true)"
  while grep -q "10\.213\.$subnet\." <<<"$taken"; do subnet=$(((subnet + 1) % 256)); done
  local ns_a="msw-$id-a" ns_b="msw-$id-b" ip_a="10.213.$subnet.1" ip_b="10.213.$subnet.2"
  # Written first: `down DIR` then removes whatever a failed `up` left.
  cat >"$dir/hosts.env" <<EOF
NODE_A_NS=$ns_a
NODE_B_NS=$ns_b
NODE_A_IP=$ip_a
NODE_B_IP=$ip_b
NODE_A_NAME=stepwise-a
NODE_B_NAME=stepwise-b
NODE_LINK=mswa$id
EOF
  ip netns add "$ns_a"
  ip netns add "$ns_b"
  ip link add "mswa$id" type veth peer name "mswb$id"
  ip link set "mswa$id" netns "$ns_a"
  ip link set "mswb$id" netns "$ns_b"
  ip -n "$ns_a" addr add "$ip_a/24" dev "mswa$id"
  ip -n "$ns_b" addr add "$ip_b/24" dev "mswb$id"
  for ns in "$ns_a" "$ns_b"; do
    ip -n "$ns" link set lo up
  done
  ip -n "$ns_a" link set "mswa$id" up
  ip -n "$ns_b" link set "mswb$id" up
  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc: each host resolves both names.
  for ns in "$ns_a" "$ns_b"; do
    mkdir -p "/etc/netns/$ns"
    printf '127.0.0.1 localhost\n%s stepwise-a\n%s stepwise-b\n' "$ip_a" "$ip_b" >"/etc/netns/$ns/hosts"
  done
  # (not `ip ... | grep -q`: grep stops reading early, and pipefail then fails on ip's SIGPIPE)
  grep -q "$ip_b" <<<"$(ip -n "$ns_b" -o addr show)" || { echo "two_nodes: $ns_b has no $ip_b" >&2; exit 1; }
  echo "two_nodes: stepwise-a=$ip_a ($ns_a), stepwise-b=$ip_b ($ns_b)"
}

load() {
  [[ -f $dir/hosts.env ]] || { echo "two_nodes: no hosts in $dir (run: tools/two_nodes.sh up $dir)" >&2; exit 2; }
  # shellcheck disable=SC1091
  source "$dir/hosts.env"
}

run_on() {
  load
  local which="$1"
  shift
  local ns name
  case "$which" in
    a) ns="$NODE_A_NS" name="$NODE_A_NAME" ;;
    b) ns="$NODE_B_NS" name="$NODE_B_NAME" ;;
    *) echo "two_nodes: host must be a or b, not '$which'" >&2; exit 2 ;;
  esac
  # A UTS namespace of its own per command: `hostname` answers the host's name.
  exec ip netns exec "$ns" unshare --uts -- bash -c 'hostname "$0" && exec "$@"' "$name" "$@"
}

link() {
  load
  ip -n "$NODE_A_NS" link set "$NODE_LINK" "$1"
}

down() {
  load
  local ns pid
  for ns in "$NODE_A_NS" "$NODE_B_NS"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  done
  for ns in "$NODE_A_NS" "$NODE_B_NS"; do
    ip netns del "$ns" 2>/dev/null || true  # takes the veth pair with it
    rm -rf "/etc/netns/$ns"
  done
  rm -f "$dir/hosts.env"
}

case "$cmd" in
  up) up ;;
  exec) shift 2; run_on "$@" ;;
  link) link "${3:?down or up}" ;;
  down) down ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
