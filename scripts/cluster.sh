#!/usr/bin/env bash
# A cluster on one machine: N "hosts", each a Linux network namespace with its own link rate, its
# own sshd and its own address, joined by a bridge as by a switch. Jobs launch with the plain
# `horovodrun -H h1:k,h2:k,...` from inside host 1, over ssh, as on a real cluster.
#
#   scripts/cluster.sh up HOSTS [RATE]   e.g. up 4 1gbit (RATE: a tc rate, or "none" for no limit)
#   scripts/cluster.sh down              removes everything `up` made (harmless when nothing is up)
#   scripts/cluster.sh status            the hosts, their addresses and rates
#   scripts/cluster.sh run CMD...        CMD inside host 1 (PATH keeps this shell's, so .venv works)
#
# Every host has an interface named sfnet (horovodrun --network-interface sfnet), the address
# 10.77.0.<i>/24 and the name h<i>; inside a host, this machine's hostname resolves to the host's
# own address (Horovod 0.28's Gloo contexts for process sets use the hostname's address, not
# HOROVOD_GLOO_IFACE). A host's link rate is a token bucket (tc tbf) on both ends of its veth,
# so each host has a link of its own, both ways, as a switch port gives. The bucket holds 2 ms of
# the rate (64 KiB at least; CLUSTER_BURST=bytes sets it): a larger one lets a message of a step
# leave at memory speed after a pause, which a real link of that rate never does. Needs root,
# iproute2 and openssh-server (scripts/install.sh installs them).
set -euo pipefail

PREFIX=${CLUSTER_PREFIX:-sf}          # namespaces sfh1.., bridge sfbr0, veths sfv1..
NET=${CLUSTER_NET:-10.77.0}           # host i is $NET.i
IFACE=sfnet
BRIDGE=${PREFIX}br0
STATE=/run/${PREFIX}cluster
KEY=$HOME/.ssh/id_ed25519

die() { echo "cluster: $*" >&2; exit 1; }
ns() { echo "${PREFIX}h$1"; }

hosts_up() {  # the indices of the hosts that exist now
  ip netns list 2>/dev/null | sed -n "s/^${PREFIX}h\([0-9][0-9]*\).*/\1/p" | sort -n
}

down() {
  local i
  for i in $(hosts_up); do
    if [ -f "$STATE/h$i.pid" ]; then kill "$(cat "$STATE/h$i.pid")" 2>/dev/null || true; fi
    ip netns pids "$(ns "$i")" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$(ns "$i")" 2>/dev/null || true
    ip link del "${PREFIX}v$i" 2>/dev/null || true
    rm -rf "/etc/netns/$(ns "$i")"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE"
}

burst() {  # burst RATE: the bucket's size in bytes, 2 ms at RATE (64 KiB at least), or $CLUSTER_BURST
  if [ -n "${CLUSTER_BURST:-}" ]; then echo "$CLUSTER_BURST"; return; fi
  local value unit
  [[ "$1" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "RATE must be a number with kbit, mbit or gbit (e.g. 100mbit), or none; got '$1'"
  value=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  case $unit in kbit) value=$((value * 1000)) ;; mbit) value=$((value * 1000000)) ;; gbit) value=$((value * 1000000000)) ;; esac
  value=$((value / 8 / 500))  # bytes in 2 ms
  echo $((value > 65536 ? value : 65536))
}

limit() {  # limit DEV RATE [NETNS]: a token bucket on DEV's egress
  local run=()
  [ $# -ge 3 ] && run=(ip netns exec "$3")
  [ "$2" = none ] && return 0
  "${run[@]}" tc qdisc replace dev "$1" root tbf rate "$2" burst "$(burst "$2")" limit 4mb
}

keys() {  # a key root logs in with, listed in authorized_keys; the machine's host keys
  mkdir -p "$HOME/.ssh" && chmod 700 "$HOME/.ssh"
  [ -f "$KEY" ] || ssh-keygen -q -t ed25519 -N "" -f "$KEY"
  touch "$HOME/.ssh/authorized_keys" && chmod 600 "$HOME/.ssh/authorized_keys"
  grep -qxF "$(cat "$KEY.pub")" "$HOME/.ssh/authorized_keys" || cat "$KEY.pub" >> "$HOME/.ssh/authorized_keys"
  ssh-keygen -A >/dev/null
  mkdir -p /run/sshd
}

up() {
  local n=$1 rate=${2:-none} i addr hosts
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 250 ] || die "HOSTS must be 1 to 250, got '$n'"
  [ "$rate" = none ] || burst "$rate" >/dev/null  # a rate it cannot size stops here
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, tc, sshd)"
  command -v tc >/dev/null || die "tc not found: apt-get install iproute2"
  [ -x /usr/sbin/sshd ] || die "/usr/sbin/sshd not found: apt-get install openssh-server"
  down  # a second `up` replaces the first
  trap 'down; die "up failed; removed what it had made"' ERR
  keys
  mkdir -p "$STATE"
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  hosts=""
  for i in $(seq 1 "$n"); do hosts+="$NET.$i h$i"$'\n'; done
  for i in $(seq 1 "$n"); do
    addr=$NET.$i
    ip netns add "$(ns "$i")"
    ip link add "${PREFIX}v$i" type veth peer name "${PREFIX}p$i"
    ip link set "${PREFIX}v$i" master "$BRIDGE" up
    ip link set "${PREFIX}p$i" netns "$(ns "$i")"
    ip netns exec "$(ns "$i")" ip link set "${PREFIX}p$i" name "$IFACE"
    ip netns exec "$(ns "$i")" ip addr add "$addr/24" dev "$IFACE"
    ip netns exec "$(ns "$i")" ip link set "$IFACE" up
    ip netns exec "$(ns "$i")" ip link set lo up
    limit "$IFACE" "$rate" "$(ns "$i")"   # leaving the host
    limit "${PREFIX}v$i" "$rate"          # arriving at the host
    mkdir -p "/etc/netns/$(ns "$i")"
    printf '127.0.0.1 localhost\n%s %s\n%s' "$addr" "$(hostname)" "$hosts" > "/etc/netns/$(ns "$i")/hosts"
    ip netns exec "$(ns "$i")" /usr/sbin/sshd -o ListenAddress="$addr" -o PidFile="$STATE/h$i.pid" \
      -o PermitRootLogin=prohibit-password -o StrictModes=no
    if [ "$rate" = none ]; then echo none; else echo "$rate, burst $(burst "$rate") bytes"; fi > "$STATE/h$i.rate"
  done
  for i in $(seq 1 "$n"); do  # every host answers ssh before `up` returns
    ip netns exec "$(ns 1)" ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
      -o LogLevel=ERROR -o ConnectTimeout=5 "$NET.$i" true || die "ssh to h$i failed"
  done
  trap - ERR
  status
}

status() {
  local i
  [ -n "$(hosts_up)" ] || { echo "cluster: no hosts"; return 0; }
  for i in $(hosts_up); do
    printf 'h%s  %s.%s  %s  rate %s\n' "$i" "$NET" "$i" "$(ns "$i")" "$(cat "$STATE/h$i.rate" 2>/dev/null || echo '?')"
  done
}

run() {
  [ -n "$(hosts_up)" ] || die "no hosts: scripts/cluster.sh up HOSTS [RATE] first"
  exec ip netns exec "$(ns 1)" env PATH="$PATH" "$@"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) status ;;
  run) shift; run "$@" ;;
  *) die "usage: $0 up HOSTS [RATE] | down | status | run CMD..." ;;
esac
