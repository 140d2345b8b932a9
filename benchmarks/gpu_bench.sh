#!/usr/bin/env bash
# The benchmark on a CUDA machine, one command: set up and build (tools/gpu_run.sh setup build),
# then `python3 -m rope_ops bench` phases; results and logs go to $OUT. With the device tool:
#
#   run(command="bash benchmarks/gpu_bench.sh", carry=[".whl", ".gpu_cache"])
#   run(command="bash benchmarks/gpu_bench.sh setup candidates", carry=[".whl", ".gpu_cache"])
#
# Phases (default: setup matrix):
#   setup       tools/gpu_run.sh setup build: offline install (wheels in .whl: stevedore,
#               liger-kernel), the CUDA extension (built, or loaded from a carried .gpu_cache)
#   matrix      W1-W5 and every matrix case, every provider, and host time per eager call:
#               matrix.json (rewritten after each case), results-h200.md, results-h200.png
#   matrix-a    the same in two halves, for two shorter calls: matrix_a.json, matrix_b.json
#   matrix-b    (host time with the second); then `render` merges them
#   render      results-h200.md / .png from matrix.json, or from matrix_a.json + matrix_b.json
#   candidates  every kernel candidate of the cuda and triton backends on every case:
#               candidates.json, candidates.md (Triton compiles each candidate: several minutes;
#   candidates-cuda, candidates-triton: one backend each, candidates_<backend>.json / .md)
#   workloads   W1-W5 and host time only (what tools/gpu_run.sh's bench phase runs)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export ROPE_OPS_CACHE=${ROPE_OPS_CACHE:-$PWD/.gpu_cache}
export ROPE_OPS_COMMIT=${ROPE_OPS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || cat .commit 2>/dev/null || echo unknown)}
phases=("$@")
[ "${#phases[@]}" -eq 0 ] && phases=(setup matrix)
status=0
step() { echo; echo "=== $* ($(date +%T))"; }
bench() { python3 -m rope_ops bench "$@"; }
# The carried wheels (pure Python: stevedore, liger-kernel), installed into .whl/site (ignored,
# like .whl) and put on the path of every phase.
SITE=$PWD/.whl/site
use_site() {
  if [ -d .whl ] && [ ! -d "$SITE" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  fi
  case ":${PYTHONPATH:-}:" in
    *":$SITE:"*) ;;
    *) [ -d "$SITE" ] && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} ;;
  esac
}
# Seconds left for a timed phase: the device tool stops a command at 600 s (BUDGET_S, 570 by
# default, leaves time to render what a cut-short phase saved).
left() { local s=$(( ${BUDGET_S:-570} - SECONDS )); [ "$s" -lt 60 ] && s=60; echo "$s"; }

matrix_cases() {  # the names of W1-W5 and the matrix, half $1 of 2 (a or b)
  python3 -c "
from rope_ops.bench.cases import MATRIX, WORKLOADS
names = list(WORKLOADS) + list(MATRIX)
half = (len(names) + 1) // 2
print(','.join(names[:half] if '$1' == 'a' else names[half:]))"
}

for phase in "${phases[@]}"; do
  use_site
  case "$phase" in
    setup)
      step "setup and build (tools/gpu_run.sh setup build)"
      bash tools/gpu_run.sh setup build || status=1
      use_site
      python3 -c "import liger_kernel.ops.rope" 2>/dev/null && echo "liger-kernel importable" \
        || echo "liger-kernel NOT importable: its rows will be skipped (carry its wheel in .whl)"
      ;;
    matrix)
      step "bench --matrix"
      timeout "$(left)" python3 -m rope_ops bench --matrix --json "$OUT/matrix.json" --markdown "$OUT/results-h200.md" \
        --png "$OUT/results-h200.png" 2>&1 | tee "$OUT/matrix.txt"
      rc=${PIPESTATUS[0]}
      if [ "$rc" -ne 0 ]; then
        status=1
        echo "bench --matrix exit $rc (124: timed out; matrix.json holds the cases done)"
        [ -f "$OUT/matrix.json" ] && bench --render "$OUT/matrix.json" --markdown "$OUT/results-h200.md" \
          --png "$OUT/results-h200.png" > /dev/null
      fi
      ;;
    matrix-a)
      step "bench, first half of the matrix"
      timeout "$(left)" python3 -m rope_ops bench --no-host --workloads "$(matrix_cases a)" --json "$OUT/matrix_a.json" \
        2>&1 | tee "$OUT/matrix_a.txt"
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      ;;
    matrix-b)
      step "bench, second half of the matrix, host time"
      timeout "$(left)" python3 -m rope_ops bench --workloads "$(matrix_cases b)" --json "$OUT/matrix_b.json" \
        2>&1 | tee "$OUT/matrix_b.txt"
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      ;;
    render)
      step "render results-h200.md"
      if [ -f "$OUT/matrix_a.json" ] && [ -f "$OUT/matrix_b.json" ]; then
        src="$OUT/matrix_a.json,$OUT/matrix_b.json"
      else
        src="$OUT/matrix.json"
      fi
      bench --render "$src" --markdown "$OUT/results-h200.md" --png "$OUT/results-h200.png" --json "$OUT/results-h200.json" \
        | tail -5 || status=1
      ;;
    candidates)
      step "bench --candidates"
      timeout "$(left)" python3 -m rope_ops bench --candidates --json "$OUT/candidates.json" --markdown "$OUT/candidates.md" \
        2>&1 | tee "$OUT/candidates.txt"
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      ;;
    candidates-cuda|candidates-triton)
      backend=${phase#candidates-}
      step "bench --candidates --providers $backend"
      timeout "$(left)" python3 -m rope_ops bench --candidates --providers "$backend" \
        --json "$OUT/candidates_$backend.json" --markdown "$OUT/candidates_$backend.md" 2>&1 | tee "$OUT/candidates_$backend.txt"
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      ;;
    workloads)
      step "bench (W1-W5, host time)"
      timeout "$(left)" python3 -m rope_ops bench --json "$OUT/workloads.json" --markdown "$OUT/workloads.md" \
        --png "$OUT/workloads.png" 2>&1 | tee "$OUT/workloads.txt"
      [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
      ;;
    *)
      echo "unknown phase $phase (setup matrix matrix-a matrix-b render candidates candidates-cuda" \
           "candidates-triton workloads)"; status=2
      ;;
  esac
done
echo; echo "gpu_bench.sh: exit $status"
exit $status
