# shellcheck shell=bash
# Sourced by the launch scripts: the active environment's tools (else .venv's), checked options, and a launcher run
# (launch/supervise.py) that dies with the script, passes Ctrl-C / kill on once, keeps the launcher's
# own noise out of sight and ends a failure with the first failing rank's line alone.

DIST_MOE_HOME=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RANK_PY="$DIST_MOE_HOME/launch/rank.py"  # what the launchers start in place of the user's script
ME=$(basename "$0")

usage_error() {  # MESSAGE: the script's one line for a bad option, exit 2
  echo "$ME: $1" >&2
  exit 2
}

need_value() {  # OPTION ARGC: an option given as the last argument has no value
  [ "$2" -ge 2 ] || usage_error "$1 needs a value"
}

check_port() {  # OPTION VALUE: a TCP port, 1..65535 (torchrun and deepspeed take any number and fail later)
  case "$2" in
    '' | *[!0-9]* | 0*) ;;
    *) [ "${#2}" -le 5 ] && [ "$2" -le 65535 ] && return 0 ;;
  esac
  usage_error "$1 takes a port number in 1..65535, got '$2'"
}

project_tool() {  # NAME: the active environment's bin/NAME (VIRTUAL_ENV, else CONDA_PREFIX), else the project's
  # .venv/bin/NAME (made by `make demo` / `make test`), else NAME on PATH (python: python3). The active environment
  # comes first: a GPU image's CUDA torch is there, and a CPU .venv would train on the CPU with gloo instead
  local env=${VIRTUAL_ENV:-${CONDA_PREFIX:-}} name=$1
  if [ -n "$env" ]; then
    if [ -x "$env/bin/$name" ]; then echo "$env/bin/$name"; return 0; fi
    echo "$ME: the active environment $env has no $name: install dist-moe there (pip install -e .), or deactivate it" >&2
    return 2
  fi
  if [ -x "$DIST_MOE_HOME/.venv/bin/$name" ]; then echo "$DIST_MOE_HOME/.venv/bin/$name"; return 0; fi
  [ "$name" != python ] || name=python3
  command -v "$name" || { echo "$ME: $name not found: run 'make demo' (it creates .venv) first" >&2; return 2; }
}

start_run() {  # [CLEANUP...]: RUN_DIR for this run's error lines and launcher logs, removed when the
  # script ends (end_run); a kill -9 runs no trap, so a watcher removes it then and runs CLEANUP
  RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/dist-moe-launch.XXXXXX") || exit 1
  DIST_MOE_ERROR_DIR="$RUN_DIR/errors"  # every rank writes its line here (dist_moe/errors.py)
  mkdir "$DIST_MOE_ERROR_DIR"
  export DIST_MOE_ERROR_DIR
  export DIST_MOE_RANK_LINE=1  # each rank says its torch build, device and backend (dist_moe/distributed/rank_line.py)
  KEEP=()  # logs a printed line named: end_run leaves them
  "$PY" "$DIST_MOE_HOME/launch/supervise.py" --watch "$$" --remove "$RUN_DIR" -- "$@" </dev/null >/dev/null 2>&1 &
  WATCHER=$!
  trap end_run EXIT
}

end_run() {  # remove RUN_DIR but the logs in KEEP; dismiss the watcher
  local f k kept
  while IFS= read -r -d '' f; do
    kept=0
    for k in "${KEEP[@]}"; do [ "$f" = "$k" ] && kept=1; done
    [ "$kept" = 1 ] || rm -f -- "$f"
  done < <(find "$RUN_DIR" -mindepth 1 ! -type d -print0 2>/dev/null)
  find "$RUN_DIR" -depth -type d -empty -delete 2>/dev/null
  kill -USR1 "$WATCHER" 2>/dev/null
  true
}

supervised() {  # [--passthrough] LAUNCHER...: the command that runs LAUNCHER under launch/supervise.py
  local pass=()
  if [ "${1:-}" = --passthrough ]; then pass=(--passthrough); shift; fi
  SUPERVISED=("$PY" "$DIST_MOE_HOME/launch/supervise.py" --parent "$$" --dir "$RUN_DIR" "${pass[@]}" -- "$@")
}

first_error() {  # the file of the line to show: the lowest rank's user error or interruption (exit 2
  # or 130: every rank says the same), else a rank killed by a signal (supervise.py: the cause of the
  # others' "a collective failed"), else the earliest rank's error, else the earliest launcher's
  local f code ns r key
  for f in "$DIST_MOE_ERROR_DIR"/*.err; do
    [ -f "$f" ] && read -r code ns <"$f" || continue
    case "$code$ns" in '' | *[!0-9]*) continue ;; esac
    case "${f##*/}" in
      rank*) r=${f##*/rank}; r=${r%.err}; case $code in 2 | 130) key="0 $r" ;; *) key="2 $ns" ;; esac ;;
      killed*) key="1 $ns" ;;
      *) key="3 $ns" ;;
    esac
    printf '%s %s\n' "$key" "$f"
  done | sort -k1,1n -k2,2n | head -n 1 | cut -d' ' -f3-
}

finish_run() {  # STATUS: RUN_STATUS, and on failure the first error's line on stderr, alone
  local first keep line
  RUN_STATUS=$1
  [ "$RUN_STATUS" -ne 0 ] || return 0
  first=$(first_error)
  [ -n "$first" ] || return 0
  { read -r RUN_STATUS _; IFS= read -r line; IFS= read -r keep; } <"$first"
  printf '%s\n' "$line" >&2
  [ -z "$keep" ] || KEEP+=("$keep")
}

run_launcher() {  # [--passthrough] LAUNCHER...: run it supervised; INT/TERM sent to this script go on
  # to it (supervise.py passes on the first only, so a Ctrl-C that reached both counts once); then
  # finish_run; returns RUN_STATUS
  local status pid
  supervised "$@"
  "${SUPERVISED[@]}" &
  pid=$!
  trap 'kill -INT "$pid" 2>/dev/null' INT
  trap 'kill -TERM "$pid" 2>/dev/null' TERM
  while :; do  # a trapped signal ends `wait` early: wait again until the launcher is gone
    status=0
    wait "$pid" || status=$?  # (set -e in the caller must not end the script here)
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - INT TERM
  finish_run "$status"
  return "$RUN_STATUS"
}
