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
# launcher's LOCAL_SIZE / CROSS_SIZE; on CPU-only nodes DeepSpeed runs on gloo.
set -euo pipefail
LAUNCHER_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    -h|--help) sed -n '4,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) LAUNCHER_ARGS+=("$1"); shift ;;
  esac
done
# shellcheck source=launch/lib.sh
. "$(dirname "$0")/lib.sh"
DEEPSPEED=$(venv_tool deepspeed) || exit 2
DIST_MOE=$(venv_tool dist-moe) || exit 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
run_launcher "$DEEPSPEED" "${LAUNCHER_ARGS[@]}" "$DIST_MOE" train engine=deepspeed "$@"
