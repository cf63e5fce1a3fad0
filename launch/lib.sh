# shellcheck shell=bash
# Sourced by the launch scripts: the project's .venv first, and a launcher run that passes
# Ctrl-C / kill on to its workers and ends with the first rank's error line.

DIST_MOE_HOME=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

venv_tool() {  # NAME: the project's .venv/bin/NAME (made by `make demo` / `make test`), else NAME on PATH
  if [ -x "$DIST_MOE_HOME/.venv/bin/$1" ]; then echo "$DIST_MOE_HOME/.venv/bin/$1"; return 0; fi
  command -v "$1" || { echo "$(basename "$0"): $1 not found: run 'make demo' (it creates .venv) first" >&2; return 2; }
}

error_dir() {  # a fresh folder where each rank writes its one-line error (dist_moe/errors.py)
  DIST_MOE_ERROR_DIR=$(mktemp -d "${TMPDIR:-/tmp}/dist-moe-errors.XXXXXX")
  export DIST_MOE_ERROR_DIR
}

repeat_first_error() {  # STATUS: when non-zero, print the first rank's error line and echo its exit code
  local first status=$1
  first=$(find "$DIST_MOE_ERROR_DIR" -name 'rank*.err' 2>/dev/null | sort -V | head -n 1)
  if [ "$status" -ne 0 ] && [ -n "$first" ]; then
    printf '\n%s\n' "$(tail -n +2 "$first")" >&2  # below the launcher's own report of the failure
    status=$(head -n 1 "$first")  # that rank's exit code: 2 for a bad config, 1 for a failed run
  fi
  rm -rf "$DIST_MOE_ERROR_DIR"
  echo "$status"
}

run_launcher() {  # CMD...: run it; INT/TERM reach it; on failure repeat the first rank's error line
  # last and return that rank's exit code
  local status pid
  error_dir
  "$@" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null' INT TERM
  while :; do  # a trapped signal ends `wait` early: wait again until the launcher is gone
    status=0
    wait "$pid" || status=$?  # (set -e in the caller must not end the script here)
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - INT TERM
  return "$(repeat_first_error "$status")"
}
