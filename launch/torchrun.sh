#!/usr/bin/env bash
# One node, N processes: dist-moe training under torchrun.
#
#   launch/torchrun.sh [--nproc N] [--port P] [dist-moe train arguments...]
#   e.g. launch/torchrun.sh --nproc 4 --config configs/demo.yaml parallel.dedup=node
#
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
PORT=29500
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) need_value "$1" $#; NPROC="$2"; shift 2 ;;
    --port) need_value "$1" $#; PORT="$2"; shift 2 ;;
    -h|--help) sed -n '4,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
case "$NPROC" in ''|*[!0-9]*|0*) usage_error "--nproc takes a positive integer, got '$NPROC'" ;; esac
check_port --port "$PORT"
PY=$(project_tool python) || exit 2
DIST_MOE=$(project_tool dist-moe) || exit 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start_run
status=0
run_launcher "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" --master-port "$PORT" \
  --log-dir "$RUN_DIR/torchrun" "$RANK_PY" "$DIST_MOE" train "$@" || status=$?
exit "$status"
