#!/usr/bin/env bash
# Run a command in a network namespace whose loopback is rate-limited (DESIGN §4):
# gloo collectives between local ranks become wire-bound, like a cluster whose links are
# slow relative to its compute. The namespace is removed on exit, also on failure.
#   usage: scripts/slow_link.sh RATE [LATENCY] -- COMMAND ...
#   e.g.:  scripts/slow_link.sh 200mbit -- python scripts/measure_layer_step.py
set -euo pipefail
rate="${1:?rate, e.g. 200mbit}"; shift
delay=""
if [ "${1:-}" != "--" ]; then delay="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
ns="dhelix$$"
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
ip netns add "$ns"
# small token bucket (a real link has no free burst); it must hold one packet: MTU 9000
ip -n "$ns" link set lo mtu 9000
ip -n "$ns" link set lo up
if [ -n "$delay" ]; then
  ip netns exec "$ns" tc qdisc add dev lo root handle 1: netem delay "$delay"
  ip netns exec "$ns" tc qdisc add dev lo parent 1: handle 2: tbf rate "$rate" burst 32kb latency 400ms
else
  ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 32kb latency 400ms
fi
ip netns exec "$ns" "$@"
