#!/usr/bin/env bash
# An emulated multi-node cluster on one machine.
#
#   launch/emulate_cluster.sh [--nodes N] [--procs-per-node G] [--rate 400mbit] [--port P]
#                             [--launcher torchrun|deepspeed] SCRIPT|-m MODULE [ARGS...]
#   launch/emulate_cluster.sh --remove-stale      (namespaces left by runs whose script is gone)
#
# Each node is a network namespace; nodes are joined by veth links (a bridge
# namespace for N > 2) throttled with `tc tbf` to --rate in both directions, so
# only inter-node traffic is slow: ranks on one node talk over that namespace's
# loopback. One `torchrun --nnodes N --node_rank i` per node (or, with
# --launcher deepspeed, one `deepspeed --no_ssh --node_rank i` over a generated
# hostfile) runs SCRIPT inside its namespace with the active environment's python (else .venv's, else
# python3). The ranks train on the CPU: parallel.device=auto is the CPU here (dist_moe/distributed/device_choice.py).
# Node 0's output streams here; the other nodes' go to log files, named at the start and kept
# only if the run fails. The first failing rank's line ends a failed run, and its exit code
# is the script's. Namespaces are named dm<this script's pid>...: removed on every exit path,
# by a watcher after a kill -9, and by any later run once their script is gone. Without root
# or iproute2 it says so and runs N launchers on loopback instead (inter-node link NOT throttled).
set -uo pipefail
# shellcheck source=launch/lib.sh
. "$(dirname "$0")/lib.sh"

LAUNCHER=torchrun
NODES=2
PPN=2
RATE=400mbit
PORT=29555
usage() { sed -n '4,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

remove_stale() {  # the namespaces (and root-namespace veths) of runs whose script is no longer alive
  local name owner pid
  for name in $(ip netns list 2>/dev/null | cut -d' ' -f1) \
              $(ip -o link show 2>/dev/null | cut -d: -f2 | cut -d@ -f1); do
    [[ "$name" =~ ^dm([0-9]+)(n[0-9]+|sw|h[0-9]+|p[0-9]+)$ || "$name" =~ ^dmprobe([0-9]+)$ ]] || continue
    owner=${BASH_REMATCH[1]}
    kill -0 "$owner" 2>/dev/null && continue
    if ip netns list | cut -d' ' -f1 | grep -qx "$name"; then
      for pid in $(ip netns pids "$name" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
      ip netns del "$name" 2>/dev/null
      rm -rf "/etc/netns/$name"
    else
      ip link del "$name" 2>/dev/null
    fi
  done
  true
}

while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) need_value "$1" $#; NODES="$2"; shift 2 ;;
    --procs-per-node) need_value "$1" $#; PPN="$2"; shift 2 ;;
    --rate) need_value "$1" $#; RATE="$2"; shift 2 ;;
    --port) need_value "$1" $#; PORT="$2"; shift 2 ;;
    --launcher) need_value "$1" $#; LAUNCHER="$2"; shift 2 ;;
    --remove-stale) remove_stale; exit 0 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) echo "$ME: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "$ME: no SCRIPT given" >&2; usage; }
case "$NODES$PPN" in ''|*[!0-9]*) usage_error "--nodes and --procs-per-node take integers" ;; esac
[ "$NODES" -ge 1 ] && [ "$PPN" -ge 1 ] || usage_error "--nodes and --procs-per-node must be >= 1"
[ "$NODES" -le 200 ] || usage_error "at most 200 nodes"
check_port --port "$PORT"
# tc's own words for a bad rate come after the namespaces exist: check the form first (tc(8): a
# number with a bit or byte unit, e.g. 400mbit, 1gbit, 50mbps)
shopt -s nocasematch
[[ "$RATE" =~ ^[0-9]+(\.[0-9]+)?([kmgt]i?)?(bit|bps)$ && ! "$RATE" =~ ^[0.]+[a-z] ]] ||
  usage_error "--rate takes a rate such as 400mbit, 1gbit or 50mbps, got '$RATE'"
shopt -u nocasematch
case "$LAUNCHER" in
  torchrun|deepspeed) ;;
  *) usage_error "--launcher takes torchrun or deepspeed, got '$LAUNCHER'" ;;
esac

SCRIPT_ARGS=("$@")
PY=$(project_tool python) || exit 2
if [ "$LAUNCHER" = deepspeed ]; then DEEPSPEED=$(project_tool deepspeed) || exit 2; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export DIST_MOE_EMULATED_NODES="$NODES"  # the nodes share this host's GPUs, if it has any: their ranks take the CPU
export DIST_MOE_EMULATED_RATE="$RATE"  # the benchmarks' line-rate bound of the inter-node link
# after a kill -9 the watcher runs this script's --remove-stale: this run's namespaces go too
start_run bash "$DIST_MOE_HOME/launch/emulate_cluster.sh" --remove-stale
if [ "$LAUNCHER" = deepspeed ]; then
  # the launcher reads the node list from a hostfile; with --no_ssh each node starts its own ranks
  for i in $(seq 0 $((NODES - 1))); do echo "node$i slots=$PPN"; done >"$RUN_DIR/hostfile"
fi

launcher_cmd() {  # node_rank master_addr: LAUNCH=(the launcher for that node), an array: nothing re-split
  if [ "$LAUNCHER" = deepspeed ]; then
    LAUNCH=("$DEEPSPEED" --hostfile "$RUN_DIR/hostfile" --no_ssh --node_rank "$1" --master_addr "$2"
            --master_port "$PORT")
  else
    LAUNCH=("$PY" -m torch.distributed.run --nnodes "$NODES" --node_rank "$1" --nproc-per-node "$PPN"
            --master-addr "$2" --master-port "$PORT" --log-dir "$RUN_DIR/torchrun$1")
  fi
}

PIDS=()
start_node() {  # i master [prefix...]: node i's supervised launcher (prefix: the namespace's ip netns
  # exec and env, which exec in place, so the script stays the supervisor's parent); node 0 to the terminal
  local i=$1 master=$2
  shift 2
  launcher_cmd "$i" "$master"
  supervised "${LAUNCH[@]}" "$RANK_PY" "${SCRIPT_ARGS[@]}"
  if [ "$i" -eq 0 ]; then
    "$@" "${SUPERVISED[@]}" &
  else  # its ranks also print their error lines into the node's log
    "$@" DIST_MOE_ERROR_ECHO=1 "${SUPERVISED[@]}" >"$RUN_DIR/node$i.log" 2>&1 &
  fi
  PIDS+=($!)
}

stop_nodes() {  # supervise.py stops its launcher (TERM, then KILL after a grace) and the ranks with it
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  wait "${PIDS[@]}" 2>/dev/null
}

wait_nodes() {  # wait for every node; the first failure stops the others (torchrun would wait 5 min)
  local status=0 left=("${PIDS[@]}") still pid done_pid
  while [ ${#left[@]} -gt 0 ]; do
    if ! wait -n -p done_pid "${left[@]}"; then
      status=1
      stop_nodes
      break
    fi
    still=()
    for pid in "${left[@]}"; do [ "$pid" = "$done_pid" ] || still+=("$pid"); done
    left=("${still[@]}")
  done
  end_nodes "$status"
}

end_nodes() {  # STATUS: the first error's line on a failure, node logs kept then; returns the exit code
  finish_run "$1"
  case $RUN_STATUS in 0 | 130 | 143) ;; *) KEEP+=("$RUN_DIR"/node*.log) ;; esac  # named at the start; a run
  # stopped by Ctrl-C or kill did not fail
  return "$RUN_STATUS"
}

trap 'stop_nodes; end_nodes 130; exit $?' INT TERM

LOGS=""
[ "$NODES" -gt 1 ] && LOGS="; nodes 1..$((NODES - 1)) log to $RUN_DIR/node<i>.log (kept if the run fails)"

can_namespace() {
  [ -z "${EMULATE_CLUSTER_LOOPBACK:-}" ] || return 1  # force the loopback fallback (tests)
  [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null && command -v tc >/dev/null || return 1
  local probe="dmprobe$$"
  ip netns add "$probe" 2>/dev/null || return 1
  ip netns del "$probe"
}

if ! can_namespace; then
  echo "$ME: cannot create network namespaces (needs root and iproute2); running $NODES" \
       "launchers on loopback: the inter-node link is NOT throttled$LOGS" >&2
  for i in $(seq 0 $((NODES - 1))); do start_node "$i" 127.0.0.1 env; done
  wait_nodes
  exit $?
fi

remove_stale  # leftovers of runs killed before their watcher could clean up
RUN="dm$$"    # the owner's pid names every namespace and veth: remove_stale knows whose they are
NS=()
for i in $(seq 0 $((NODES - 1))); do NS+=("${RUN}n$i"); done
SW="${RUN}sw"
remove_namespaces() {
  local ns
  for ns in "${NS[@]}" "$SW"; do ip netns del "$ns" 2>/dev/null; rm -rf "/etc/netns/$ns"; done
  true
}
trap 'remove_namespaces; end_run' EXIT

shape() { tc -n "$1" qdisc add dev "$2" root tbf rate "$RATE" burst 256kb latency 100ms; }
addr() { echo "10.77.$(( $1 / 250 )).$(( $1 % 250 + 1 ))"; }   # node i's address, inside our namespaces only

set -e
for i in $(seq 0 $((NODES - 1))); do
  ip netns add "${NS[$i]}"
  ip -n "${NS[$i]}" link set lo up
done
if [ "$NODES" -eq 2 ]; then
  ip link add "${RUN}h0" type veth peer name "${RUN}h1"
  for i in 0 1; do
    ip link set "${RUN}h$i" netns "${NS[$i]}"
    ip -n "${NS[$i]}" addr add "$(addr "$i")/16" dev "${RUN}h$i"
    ip -n "${NS[$i]}" link set "${RUN}h$i" up
    shape "${NS[$i]}" "${RUN}h$i"
  done
elif [ "$NODES" -gt 2 ]; then
  ip netns add "$SW"
  ip -n "$SW" link add br0 type bridge
  ip -n "$SW" link set br0 up
  for i in $(seq 0 $((NODES - 1))); do
    ip link add "${RUN}h$i" type veth peer name "${RUN}p$i"
    ip link set "${RUN}h$i" netns "${NS[$i]}"
    ip link set "${RUN}p$i" netns "$SW"
    ip -n "$SW" link set "${RUN}p$i" master br0
    ip -n "$SW" link set "${RUN}p$i" up
    ip -n "${NS[$i]}" addr add "$(addr "$i")/16" dev "${RUN}h$i"
    ip -n "${NS[$i]}" link set "${RUN}h$i" up
    shape "${NS[$i]}" "${RUN}h$i"   # node egress
    shape "$SW" "${RUN}p$i"         # node ingress
  done
fi
set +e
# Each node's /etc/hosts (ip netns exec mounts /etc/netns/<ns>/hosts over it) names every node, also as the
# IPv4-mapped IPv6 address torch's store accepts peers on: the store looks up each peer's name, which the
# host's DNS, unreachable from inside, would not answer (c10d's "hostname ... cannot be retrieved").
for i in $(seq 0 $((NODES - 1))); do
  mkdir -p "/etc/netns/${NS[$i]}" 2>/dev/null || continue
  { echo "127.0.0.1 localhost"; for j in $(seq 0 $((NODES - 1))); do
      echo "$(addr "$j") node$j"; echo "::ffff:$(addr "$j") node$j"; done; } \
    > "/etc/netns/${NS[$i]}/hosts.$$" && mv -f "/etc/netns/${NS[$i]}/hosts.$$" "/etc/netns/${NS[$i]}/hosts"
done

MASTER=$(addr 0)
[ "$NODES" -eq 1 ] && MASTER=127.0.0.1
echo "$ME: $NODES node(s) x $PPN process(es), inter-node link $RATE, master $MASTER$LOGS" >&2
for i in $(seq 0 $((NODES - 1))); do
  IFNAME="${RUN}h$i"
  [ "$NODES" -eq 1 ] && IFNAME=lo
  start_node "$i" "$MASTER" ip netns exec "${NS[$i]}" env PATH="$PATH" GLOO_SOCKET_IFNAME="$IFNAME"
done
wait_nodes
