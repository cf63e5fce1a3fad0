#!/usr/bin/env bash
# Every GPU check from a bare machine: a fresh virtual environment with the packages from PyPI (its Linux torch is
# the CUDA build), then benchmarks/gpu_check.py; the time each part took at the end. Target: 8 minutes on one H100.
#
#   benchmarks/gpu_check.sh [--venv DIR] [--no-install] [-- gpu_check.py's options]
#
# --no-install runs the checks on the python3 already there (a GPU image's own CUDA torch). Exit status:
# gpu_check.py's (1 on any FAIL), or pip's when the install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=/tmp/dist-moe-gpu-check
install=1
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv=$2; shift 2 ;;
    --no-install) install=0; shift ;;
    --) shift; break ;;
    *) echo "gpu_check.sh: unknown option $1 (--venv DIR, --no-install, -- gpu_check.py options)" >&2; exit 2 ;;
  esac
done
start=$SECONDS
python=python3
if [ "$install" = 1 ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q -e '.[deepspeed,megatron]'
  python=$venv/bin/python
fi
if [ "$install" = 0 ] && ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
  echo "gpu_check.sh: --no-install runs the checks on $(command -v "$python"), which has no torch: drop --no-install to install one in $venv" >&2
  exit 2
fi
installed=$((SECONDS - start))
status=0
PYTHONPATH=. "$python" benchmarks/gpu_check.py "$@" || status=$?
echo "gpu_check.sh: install ${installed} s, checks $((SECONDS - start - installed)) s, in all $((SECONDS - start)) s"
exit "$status"
