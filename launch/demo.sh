#!/usr/bin/env bash
# `make demo`: the tiny MoE LM with BRANCH routing, tree-prefix placement and node dedup on
# 4 CPU ranks as 2 emulated nodes x 2 (a throttled link between them; loopback when network
# namespaces are not available), then its communication report. On a GPU host too the emulated
# nodes' ranks run on the CPU (launch/emulate_cluster.sh).
#
#   launch/demo.sh [OUTPUT_DIR [key=value ...]]    (default runs/demo_lm; overrides go to dist-moe train)
#
# `make demo` run again trains the demo again: the previous demo run in OUTPUT_DIR is replaced
# (output.overwrite=true; dist-moe replaces only its own run files there, and only once the new run has
# finished: it trains in OUTPUT_DIR/.next-run, so stopped before, the previous run and its report stay as
# they were). dist-moe comes from the
# active environment (VIRTUAL_ENV, else CONDA_PREFIX), else the project's .venv (launch/lib.sh).
#
# Without the corpus's Debian packages (fortunes-min, wordnet-base; make installs them as
# root) it says so and trains the tabular BRANCH demo in one process instead.
set -euo pipefail
# shellcheck source=launch/lib.sh
. "$(dirname "$0")/lib.sh"
OUT=${1:-runs/demo_lm}
[ $# -gt 0 ] && shift
DIST_MOE=$(project_tool dist-moe) || exit 2
export OMP_NUM_THREADS=1
cd "$DIST_MOE_HOME"
if [ ! -f /usr/share/wordnet/data.noun ] || [ ! -f /usr/share/games/fortunes/fortunes ]; then
  echo "demo: fortunes-min / wordnet-base not installed; training the tabular demo in one process instead" >&2
  exec "$DIST_MOE" train "output.dir=$OUT" output.overwrite=true
fi
launch/emulate_cluster.sh --nodes 2 --procs-per-node 2 --port "${DEMO_PORT:-29655}" \
  "$DIST_MOE" train --config configs/lm_branch.yaml "output.dir=$OUT" output.overwrite=true "$@"
"$DIST_MOE" report "$OUT"
echo "demo: report at $OUT/report.md (plots beside it)"
if [ $# -eq 0 ]; then  # the ratio above is this router's; README's headline is another setup's
  echo "demo: README's 0.25-0.27x node-crossing bytes is BRANCH limited to one node per token (router.subtree_limit=1)"
  echo "  against a flat router's routing; this demo trains unlimited BRANCH, whose experts span both nodes (its loss"
  echo "  is better on this LM: docs/RESULTS.md section 1), so its own layout saves less. The limited demo:"
  echo "  launch/demo.sh runs/demo_limited router.subtree_limit=1"
fi
