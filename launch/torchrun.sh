#!/usr/bin/env bash
# dist-moe training under torchrun: one node, or one invocation per node of several.
#
#   launch/torchrun.sh [--nproc N] [--port P] [--nnodes N --node-rank R --master-addr A] [dist-moe train arguments...]
#   e.g. launch/torchrun.sh --nproc 4 --config configs/demo.yaml parallel.dedup=node
#        launch/torchrun.sh --nproc 8 --nnodes 2 --node-rank 0 --master-addr node0 --config C   (on node0; then
#        --node-rank 1 on the other node)
#
# Nodes: --nnodes, --node-rank, --master-addr and --port, else NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT from
# the environment (what a scheduler's job script exports), else one node. One node runs torchrun --standalone; more
# run torchrun --nnodes --node-rank --master-addr --master-port: its static rendezvous, hosted by node 0 at A:P,
# which every node must reach, so every node names the same A and P and its own R in 0..N-1.
# Every process joins one gloo (CPU) or NCCL (GPU) group; the topology comes from
# torchrun's variables (WORLD_SIZE, LOCAL_WORLD_SIZE), or DIST_MOE_TOPOLOGY=node=2,gpu=2
# to describe a layout the launcher cannot see. Uses the active environment's python and
# dist-moe (VIRTUAL_ENV, else CONDA_PREFIX), else the project's .venv, else those on PATH. Ctrl-C or kill stop
# every rank, and so does a kill -9 of this script; a failed run ends with the first failing
# rank's error line alone (torchrun's own report is kept out of sight, see launch/README.md).
set -euo pipefail
# shellcheck source=launch/lib.sh
. "$(dirname "$0")/lib.sh"
NPROC=2
PORT=${MASTER_PORT:-29500} PORT_FROM=MASTER_PORT
NNODES=${NNODES:-1} NNODES_FROM=NNODES
NODE_RANK=${NODE_RANK:-} NODE_RANK_FROM=NODE_RANK
MASTER=${MASTER_ADDR:-} MASTER_FROM=MASTER_ADDR
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) need_value "$1" $#; NPROC="$2"; shift 2 ;;
    --port) need_value "$1" $#; PORT="$2"; PORT_FROM=$1; shift 2 ;;
    --nnodes) need_value "$1" $#; NNODES="$2"; NNODES_FROM=$1; shift 2 ;;
    --node-rank) need_value "$1" $#; NODE_RANK="$2"; NODE_RANK_FROM=$1; shift 2 ;;
    --master-addr) need_value "$1" $#; MASTER="$2"; MASTER_FROM=$1; shift 2 ;;
    -h|--help) sed -n '4,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
case "$NPROC" in ''|*[!0-9]*|0*) usage_error "--nproc takes a positive integer, got '$NPROC'" ;; esac
case "$NNODES" in ''|*[!0-9]*|0*|???????*) usage_error "$NNODES_FROM takes a positive integer, got '$NNODES'" ;; esac
check_port "$PORT_FROM" "$PORT"
given() { if [ "${1#--}" != "$1" ]; then echo "$1 $2"; else echo "$1=$2"; fi; }  # as the user gave it
if [ "$NNODES" -eq 1 ]; then
  # one node: torchrun's standalone rendezvous on this host; a node rank can only be 0, a master address is unused
  case "$NODE_RANK" in
    '' | 0) ;;
    *) usage_error "$(given "$NODE_RANK_FROM" "$NODE_RANK") with one node: the only node rank is 0" ;;
  esac
  [ "$MASTER_FROM" != --master-addr ] || usage_error "--master-addr $MASTER with one node: give --nnodes too"
  NODES=(--standalone)
else
  NODES_GIVEN=$(given "$NNODES_FROM" "$NNODES")
  [ -n "$NODE_RANK" ] ||
    usage_error "$NODES_GIVEN needs --node-rank (or NODE_RANK): this node's rank, 0..$((NNODES - 1))"
  [ -n "$MASTER" ] || usage_error "$NODES_GIVEN needs --master-addr (or MASTER_ADDR): the address of node rank 0"
  bad_rank="$NODE_RANK_FROM takes a node rank in 0..$((NNODES - 1)), got '$NODE_RANK'"
  case "$NODE_RANK" in *[!0-9]* | 0?* | ???????*) usage_error "$bad_rank" ;; esac
  [ "$NODE_RANK" -lt "$NNODES" ] || usage_error "$bad_rank"
  # a host name, an IPv4 address or an IPv6 one (brackets allowed); never an option or two words
  [[ "$MASTER" =~ ^[][A-Za-z0-9.:%_][][A-Za-z0-9.:%_-]*$ ]] ||
    usage_error "$MASTER_FROM takes a host name or address, got '$MASTER'"
  NODES=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER")
fi
PY=$(project_tool python) || exit 2
DIST_MOE=$(project_tool dist-moe) || exit 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start_run
status=0
run_launcher "$PY" -m torch.distributed.run "${NODES[@]}" --nproc-per-node "$NPROC" --master-port "$PORT" \
  --log-dir "$RUN_DIR/torchrun" "$RANK_PY" "$DIST_MOE" train "$@" || status=$?
exit "$status"
