#!/usr/bin/env bash
# Multi-node dist-moe training under the deepspeed launcher (engine deepspeed).
#
#   launch/deepspeed.sh --hostfile launch/hostfile.example [launcher options] -- [dist-moe train arguments...]
#
# As DeepSpeed users run it:
#   pdsh/ssh from node 0:  launch/deepspeed.sh --hostfile H -- --config C
#   each node on its own:  launch/deepspeed.sh --hostfile H --no_ssh --node_rank I --master_addr A -- --config C
# Options before `--` go to the deepspeed launcher unchanged (--num_gpus, --master_port, ...);
# the rest to `dist-moe train`, with engine=deepspeed added. The topology comes from the
# launcher's LOCAL_SIZE / CROSS_SIZE; on CPU-only nodes DeepSpeed runs on gloo. A --hostfile
# that does not exist is refused (the launcher would train one local process instead).
# A launch from node 0 (a hostfile, no --no_ssh) reaches the other nodes' ranks with DeepSpeed's own
# variables (NCCL_*, PYTHON*, ...) only: OMP_NUM_THREADS and DIST_MOE_* go there through an environment file of
# this run (DS_ENV_FILE) that also holds the entries of the user's ~/.deepspeed_env and ./.deepspeed_env.
set -euo pipefail
# shellcheck source=launch/lib.sh
. "$(dirname "$0")/lib.sh"
LAUNCHER_ARGS=()
HOSTFILE=""
NO_SSH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    -h|--help) sed -n '4,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -H|--hostfile) need_value "$1" $#; HOSTFILE="$2"; LAUNCHER_ARGS+=("$1" "$2"); shift 2 ;;
    --hostfile=*) HOSTFILE="${1#*=}"; LAUNCHER_ARGS+=("$1"); shift ;;
    --master_port) need_value "$1" $#; check_port "$1" "$2"; LAUNCHER_ARGS+=("$1" "$2"); shift 2 ;;
    --master_port=*) check_port --master_port "${1#*=}"; LAUNCHER_ARGS+=("$1"); shift ;;
    --no_ssh) NO_SSH=1; LAUNCHER_ARGS+=("$1"); shift ;;
    *) LAUNCHER_ARGS+=("$1"); shift ;;
  esac
done
if [ -n "$HOSTFILE" ] && [ ! -f "$HOSTFILE" ]; then
  usage_error "--hostfile '$HOSTFILE': no such file (without one the launcher would train one local process)"
fi
PY=$(project_tool python) || exit 2
DEEPSPEED=$(project_tool deepspeed) || exit 2
DIST_MOE=$(project_tool dist-moe) || exit 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# a pdsh/ssh launch from node 0 brings every rank's output back through the launcher: show it as is
[ -z "$HOSTFILE" ] && [ -f /job/hostfile ] && HOSTFILE=/job/hostfile  # DeepSpeed's default hostfile
PASS=()
if [ "$NO_SSH" = 0 ] && [ -n "$HOSTFILE" ] && [ "$(grep -cvE '^[[:space:]]*(#|$)' "$HOSTFILE")" -gt 1 ]; then
  PASS=(--passthrough)
fi
start_run
if [ "$NO_SSH" = 0 ] && [ -n "$HOSTFILE" ]; then
  # a launch from node 0 starts the other nodes' ranks with only the variables DeepSpeed forwards and those of
  # its environment file: this run's file holds OMP_NUM_THREADS and DIST_MOE_* and then the user's own entries
  # (launch/deepspeed_env.py); the user's files are read, never written
  said=$("$PY" "$DIST_MOE_HOME/launch/deepspeed_env.py" "$RUN_DIR/deepspeed_env" 2>&1) || usage_error "$said"
  export DS_ENV_FILE="$RUN_DIR/deepspeed_env"  # absolute: DeepSpeed reads it in place of ~/ and ./.deepspeed_env
fi
status=0
run_launcher "${PASS[@]}" "$DEEPSPEED" "${LAUNCHER_ARGS[@]}" "$RANK_PY" "$DIST_MOE" train engine=deepspeed "$@" ||
  status=$?
exit "$status"
