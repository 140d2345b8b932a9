#!/usr/bin/env bash
# Everything rope_ops does on a CUDA machine, in one script: set up (offline), build the CUDA
# extension, verify both GPU backends, measure. Results and logs go to $OUT (default gpu_out/).
#
#   bash tools/gpu_run.sh                      # setup build verify host (about 6-8 minutes)
#   bash tools/gpu_run.sh setup build candidates bench
#
# Phases:
#   setup       install the carried wheels (.whl/*.whl: stevedore, liger-kernel) and rope_ops
#               itself (editable, no dependencies, offline)
#   build       the CUDA extension (python -m rope_ops_backends.cuda_backend build), into
#               $ROPE_OPS_CACHE (default .gpu_cache/; $OUT/gpu_cache.tgz, unpacked into
#               .gpu_cache, lets a later call carry it instead of compiling)
#   verify      at once (correctness only: they share the GPU, so nothing is timed):
#                 the conformance suite on cuda and on triton;
#                 tools/gpu_cuda_check.py: every accuracy case with the CUDA policy's choice and
#                 with every other kernel configuration that can take it, and the checks of
#                 allocated outputs, bound launchers, autograd in C++, PDL chains, extreme
#                 positions, > 2^31 elements;
#                 compute-sanitizer memcheck on gpu_cuda_check.py --coverage (calls whose
#                 candidates reach every kernel instantiation) and on the suite's forward cases
#                 with positions past the table, views and caller tables; and on Triton's
#                 prologue tests (cache writes with slots outside the cache among them);
#                 the transformers models, mRoPE, prologue (against HF, float8 q, Triton's
#                 kernels) and torch-backend tests on the GPU; the distributed checks on 2 ranks
#   recheck     the torch.compile tests of the suite on cuda and triton, and the distributed
#               checks (with Python tracebacks on crashes)
#   host        tools/host_cost.py: host time per call of each way in (decode and training)
#   prologue    tools/gpu_cuda_check.py --prologue-only --prologue-timing: the CUDA fused
#               prologue's cases, then its GPU time against a same-bytes copy and Triton
#   prologue-study
#               tools/gpu_triton_check.py --no-pytest --prologue: Triton's prologue candidates,
#               the backward's own (token block, warps, stages, programs per SM) and the decode
#               without table reads, on rotated inputs (then its rope cases while time is left)
#   e2e         examples/hf_end_to_end.py: a Llama's training step, prefill and decode with and
#               without rope_ops (transformers' rotary code, patch(model), patch(model, exact=True))
#   candidates  python -m rope_ops bench --candidates --providers $CANDIDATES (default cuda; or
#               triton, whose candidates each compile: minutes): every kernel configuration of
#               every benchmark case timed next to the policy's choice
#   bench       python -m rope_ops bench --matrix: W1-W5 and the public matrix, every provider,
#               host time per eager call: results-h200.md / .png, matrix.json (rewritten after
#               each case; a run cut short is rendered from it). $BENCH_WORKLOADS, a comma list
#               of case names: those cases only. Several runs' JSON merge into one results file
#               with `python -m rope_ops bench --render a.json,b.json --markdown ... --png ...`.
# Each timed phase is cut at the time left of BUDGET_S (570 s by default, for a 600 s call).
# PACK_LOGS=1 packs the logs into $OUT/logs.tgz at the end (see there).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
export ROPE_OPS_CACHE=${ROPE_OPS_CACHE:-$PWD/.gpu_cache}
# The commit the results files name (set it where the checkout has no git metadata).
export ROPE_OPS_COMMIT=${ROPE_OPS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0
phases=("$@")
[ "${#phases[@]}" -eq 0 ] && phases=(setup build verify host)

step() { echo; echo "=== $* ($(date +%T))"; }
has() { for p in "${phases[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
left() { local s=$(( ${BUDGET_S:-570} - SECONDS )); [ "$s" -lt 30 ] && s=30; echo "$s"; }

# The carried wheels, installed once into .whl/site (ignored, like .whl) and put on the path.
SITE=$PWD/.whl/site
if [ -d .whl ]; then
  [ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if has setup; then
  step setup
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . \
    $( [ -d examples/rope_ops_example_backend ] && printf "%s" "-e examples/rope_ops_example_backend" ) 2>&1 | tail -2
  python3 -c "import torch, triton, rope_ops; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'commit', '$(git rev-parse --short HEAD 2>/dev/null)')"
fi
if has build; then
  step "build the CUDA extension"
  # A carried cache the build refuses (files of another user, say) is removed and rebuilt.
  timeout "$(left)" python3 -m rope_ops_backends.cuda_backend build 2>&1 | tail -20
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    timeout "$(left)" python3 -m rope_ops_backends.cuda_backend build --force 2>&1 | tail -20
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
  fi
  python3 -m rope_ops info | tee "$OUT/info.txt"
  # The build, for a later call to carry as .gpu_cache (unpack it there).
  (cd "$ROPE_OPS_CACHE" && tar czf "$OUT/gpu_cache.tgz" .) 2>/dev/null
fi
if has verify; then
  step "verify: conformance cuda + triton, CUDA cases with every candidate, sanitizer (at once)"
  t=$(left)
  ROPE_OPS_TEST_EXAMPLES=40 timeout "$t" python3 -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing \
    --rope-backend cuda > "$OUT/conformance_cuda.txt" 2>&1 & p1=$!
  ROPE_OPS_TEST_EXAMPLES=20 timeout "$t" python3 -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing \
    --rope-backend triton > "$OUT/conformance_triton.txt" 2>&1 & p2=$!
  timeout "$t" python3 tools/gpu_cuda_check.py > "$OUT/cuda_check.txt" 2>&1 & p3=$!
  timeout "$t" compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/gpu_cuda_check.py --coverage \
    > "$OUT/sanitizer_coverage.txt" 2>&1 & p4=$!
  timeout "$t" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    --pyargs rope_ops.testing --rope-backend cuda \
    -k "test_forward and (beyond or near_2p20 or negative or packed or transposed or caller_tables or thd or inplace) and (float32 or bfloat16)" \
    > "$OUT/sanitizer_suite.txt" 2>&1 & p5=$!
  # Triton's prologue kernels: forward, cache writes with slots outside the cache, backward
  timeout "$t" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_triton_prologue.py -k "forward or cache_write or backward or float8" \
    > "$OUT/sanitizer_triton_prologue.txt" 2>&1 & p8=$!
  # the models on the GPU with the cuda and triton backends (inductor there too), on the CPU with
  # the torch and cpu backends
  timeout "$t" python3 -m pytest -q -p no:cacheprovider tests/test_integration_transformers.py \
    tests/test_mrope.py tests/test_prologue_hf.py tests/test_prologue_q_float8.py \
    tests/test_triton_prologue.py tests/test_torch_backend_slices.py \
    --deselect "tests/test_integration_transformers.py::test_compile_inductor[auto]" \
    > "$OUT/tests_hf_torch.txt" 2>&1 & p6=$!
  PYTHONFAULTHANDLER=1 timeout "$t" python3 tests/_distributed_checks.py --device cuda --rope-backend cuda,torch \
    --world-size 2 > "$OUT/distributed_cuda.txt" 2>&1 & p7=$!
  for job in "$p1:conformance cuda:conformance_cuda" "$p2:conformance triton:conformance_triton" \
             "$p3:CUDA cases, every candidate:cuda_check" "$p4:sanitizer, every kernel:sanitizer_coverage" \
             "$p5:sanitizer, suite forward cases:sanitizer_suite" \
             "$p6:transformers models on cuda and triton, mRoPE, prologue vs HF, float8 q, Triton prologue, torch backend on CUDA:tests_hf_torch" \
             "$p7:distributed checks, 2 ranks on the GPU:distributed_cuda" \
             "$p8:sanitizer, Triton prologue (invalid slots too):sanitizer_triton_prologue"; do
    IFS=: read -r pid label file <<< "$job"
    wait "$pid"; rc=$?
    echo "--- $label: exit $rc"; tail -4 "$OUT/$file.txt"
    [ "$rc" -ne 0 ] && status=1
  done
fi
if has recheck; then
  step "recheck: torch.compile conformance on cuda and triton, distributed checks (tracebacks on crashes)"
  t=$(left)
  timeout "$t" python3 -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing --rope-backend cuda \
    -k "compile" > "$OUT/recheck_cuda.txt" 2>&1 & p1=$!
  timeout "$t" python3 -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing --rope-backend triton \
    -k "compile" > "$OUT/recheck_triton.txt" 2>&1 & p2=$!
  PYTHONFAULTHANDLER=1 timeout "$t" python3 tests/_distributed_checks.py --device cuda --rope-backend cuda,torch \
    --world-size 2 > "$OUT/distributed_cuda.txt" 2>&1 & p3=$!
  for job in "$p1:compile, cuda:recheck_cuda" "$p2:compile, triton:recheck_triton" "$p3:distributed:distributed_cuda"; do
    IFS=: read -r pid label file <<< "$job"
    wait "$pid"; rc=$?
    echo "--- $label: exit $rc"; tail -4 "$OUT/$file.txt"
    [ "$rc" -ne 0 ] && status=1
  done
fi
if has host; then
  step "host time per call"
  timeout "$(left)" python3 tools/host_cost.py --backend cuda 2>&1 | tee "$OUT/host_cost.txt"
  timeout "$(left)" python3 tools/host_cost.py --backend triton 2>&1 | tee -a "$OUT/host_cost.txt"
fi
if has prologue; then
  step "CUDA fused prologue: cases and GPU time (against a copy and Triton)"
  timeout "$(left)" python3 tools/gpu_cuda_check.py --prologue-only --prologue-timing 2>&1 | tee "$OUT/prologue_cuda.txt"
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
fi
if has prologue-study; then
  step "Triton prologue study: every candidate configuration, on rotated inputs"
  timeout "$(left)" python3 tools/gpu_triton_check.py --no-pytest --prologue --budget "$(( $(left) - 10 ))" \
    --json "$OUT/prologue_study.json" 2>&1 | tee "$OUT/prologue_study.txt"
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
fi
if has e2e; then
  step "end to end: a Llama-3-8B-shaped model (2 layers) with and without rope_ops"
  timeout "$(left)" python3 examples/hf_end_to_end.py --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt"
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
fi
if has candidates; then
  backend=${CANDIDATES:-cuda}
  step "bench --candidates ($backend)"
  timeout "$(left)" python3 -m rope_ops bench --candidates --providers "$backend" \
    --json "$OUT/candidates_$backend.json" --markdown "$OUT/candidates_$backend.md" 2>&1 \
    | tee "$OUT/candidates_$backend.txt"
  [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
fi
if has bench; then
  step "bench --matrix (W1-W5 and the public matrix, every provider)"
  cases=(--matrix); [ -n "${BENCH_WORKLOADS:-}" ] && cases=(--workloads "$BENCH_WORKLOADS")
  timeout "$(left)" python3 -m rope_ops bench "${cases[@]}" --json "$OUT/matrix.json" --markdown "$OUT/results-h200.md" \
    --png "$OUT/results-h200.png" 2>&1 | tee "$OUT/matrix.txt"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    status=1
    echo "bench exit $rc (124: cut at the budget; matrix.json holds the cases done)"
    [ -f "$OUT/matrix.json" ] && python3 -m rope_ops bench --render "$OUT/matrix.json" \
      --markdown "$OUT/results-h200.md" --png "$OUT/results-h200.png" > /dev/null
  fi
fi
# PACK_LOGS=1: the logs (*.txt, *.json) moved into one logs.tgz, for machines that hand back
# only a few files of $OUT (results, plots and the build cache stay beside it).
if [ "${PACK_LOGS:-0}" = 1 ]; then
  (cd "$OUT" && logs=$(ls -- *.txt *.json 2>/dev/null) && [ -n "$logs" ] \
    && tar czf logs.tgz $logs && rm -f $logs)
fi
echo; echo "gpu_run.sh: exit $status"
exit $status
