#!/usr/bin/env bash
# An emulated multi-node cluster on one machine (see ../shared/notes/emulated-cluster.md).
#
#   launch/emulate_cluster.sh [--nodes N] [--procs-per-node G] [--rate 400mbit] [--launcher torchrun|deepspeed] SCRIPT [ARGS...]
#
# Each node is a network namespace; nodes are joined by veth links (a bridge
# namespace for N > 2) throttled with `tc tbf` to --rate in both directions, so
# only inter-node traffic is slow: ranks on one node talk over that namespace's
# loopback. One `torchrun --nnodes N --node_rank i` per node (or, with
# --launcher deepspeed, one `deepspeed --no_ssh --node_rank i` over a generated
# hostfile) runs SCRIPT inside its namespace with the project's .venv python (else the first on PATH).
# Node 0's output streams here; the other nodes' go to log files named at the
# end. Exits non-zero if any node fails. Namespaces carry a per-run suffix and
# are removed on every exit path. Without root or iproute2 it says so and runs
# N torchrun invocations on loopback instead (inter-node link NOT throttled).
set -uo pipefail

LAUNCHER=torchrun
NODES=2
PPN=2
RATE=400mbit
PORT=29555
usage() { sed -n '4,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --procs-per-node) PPN="$2"; shift 2 ;;
    --rate) RATE="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --launcher) LAUNCHER="$2"; shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) echo "emulate_cluster: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "emulate_cluster: no SCRIPT given" >&2; usage; }
case "$NODES$PPN" in *[!0-9]*) echo "emulate_cluster: --nodes and --procs-per-node take integers" >&2; exit 2 ;; esac
[ "$NODES" -ge 1 ] && [ "$PPN" -ge 1 ] || { echo "emulate_cluster: --nodes and --procs-per-node must be >= 1" >&2; exit 2; }
[ "$NODES" -le 200 ] || { echo "emulate_cluster: at most 200 nodes" >&2; exit 2; }

case "$LAUNCHER" in torchrun|deepspeed) ;; *) echo "emulate_cluster: --launcher takes torchrun or deepspeed" >&2; exit 2 ;; esac

SCRIPT_ARGS=("$@")
# shellcheck source=launch/lib.sh
. "$(dirname "$0")/lib.sh"
PY=$(venv_tool python) || exit 2
LOGDIR=$(mktemp -d "${TMPDIR:-/tmp}/emulate_cluster.XXXXXX")
error_dir  # every node's ranks write their error lines here (the namespaces share the file system)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$LAUNCHER" = deepspeed ]; then
  DEEPSPEED=$(venv_tool deepspeed) || exit 2
  # the launcher reads the node list from a hostfile; with --no_ssh each node starts its own ranks
  for i in $(seq 0 $((NODES - 1))); do echo "node$i slots=$PPN"; done >"$LOGDIR/hostfile"
fi

torchrun_cmd() {  # node_rank master_addr: the launcher command for one node
  if [ "$LAUNCHER" = deepspeed ]; then
    echo "$DEEPSPEED" --hostfile "$LOGDIR/hostfile" --no_ssh --node_rank "$1" --master_addr "$2" \
      --master_port "$PORT"
  else
    echo "$PY" -m torch.distributed.run --nnodes "$NODES" --node_rank "$1" --nproc-per-node "$PPN" \
      --master-addr "$2" --master-port "$PORT"
  fi
}

PIDS=()
start_node() {  # i master [prefix...]: torchrun for node i in its own session; node 0 to the terminal
  local i=$1 master=$2
  shift 2
  if [ "$i" -eq 0 ]; then
    # shellcheck disable=SC2046
    setsid "$@" $(torchrun_cmd "$i" "$master") "${SCRIPT_ARGS[@]}" &
  else
    # shellcheck disable=SC2046
    setsid "$@" $(torchrun_cmd "$i" "$master") "${SCRIPT_ARGS[@]}" >"$LOGDIR/node$i.log" 2>&1 &
  fi
  PIDS+=($!)
}

stop_nodes() {  # each node runs in its own session (setsid): stop the whole process group
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
  sleep 3  # torchrun blocked in a rendezvous or exit barrier ignores TERM until its store call returns
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
}

wait_nodes() {  # wait for every node; the first failure stops the others (torchrun would wait 5 min)
  local status=0 n
  for n in "${PIDS[@]}"; do
    if ! wait -n; then
      status=1
      stop_nodes
      break
    fi
  done
  wait
  if [ "$NODES" -gt 1 ]; then echo "emulate_cluster: logs of nodes 1..$((NODES - 1)): $LOGDIR/node<i>.log" >&2; fi
  [ "$status" -eq 0 ] || echo "emulate_cluster: a node failed; the others were stopped" >&2
  return "$(repeat_first_error "$status")"
}

trap 'stop_nodes; exit 130' INT TERM

can_namespace() {
  [ -z "${EMULATE_CLUSTER_LOOPBACK:-}" ] || return 1  # force the loopback fallback (tests)
  [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null && command -v tc >/dev/null || return 1
  local probe="dmprobe$$"
  ip netns add "$probe" 2>/dev/null || return 1
  ip netns del "$probe"
}

if ! can_namespace; then
  echo "emulate_cluster: cannot create network namespaces (needs root and iproute2); running $NODES" \
       "torchrun invocations on loopback: the inter-node link is NOT throttled" >&2
  for i in $(seq 0 $((NODES - 1))); do start_node "$i" 127.0.0.1 env; done
  wait_nodes
  exit $?
fi

RUN="dm$$"                   # per-run suffix: a crashed run's leftovers never collide
NS=()
for i in $(seq 0 $((NODES - 1))); do NS+=("${RUN}n$i"); done
SW="${RUN}sw"
cleanup() {
  local ns
  for ns in "${NS[@]}" "$SW"; do ip netns del "$ns" 2>/dev/null; done
  true
}
trap cleanup EXIT

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

MASTER=$(addr 0)
[ "$NODES" -eq 1 ] && MASTER=127.0.0.1
echo "emulate_cluster: $NODES node(s) x $PPN process(es), inter-node link $RATE, master $MASTER" >&2
for i in $(seq 0 $((NODES - 1))); do
  IFNAME="${RUN}h$i"
  [ "$NODES" -eq 1 ] && IFNAME=lo
  start_node "$i" "$MASTER" ip netns exec "${NS[$i]}" env PATH="$PATH" GLOO_SOCKET_IFNAME="$IFNAME"
done
wait_nodes
