#!/usr/bin/env bash
# Everything rope_ops does on a CUDA machine, in one script: set up (offline), build the CUDA
# extension, verify both GPU backends, benchmark. Used with the device tool, e.g.
#
#   run(command="bash tools/gpu_run.sh setup build verify", carry=[".whl"])
#   run(command="bash tools/gpu_run.sh setup build perf bench", carry=[".whl", ".gpu_cache"])
#
# Phases: setup build verify perf bench probe (default: all but probe). Results and logs go to $OUT.
#   verify: conformance suite on cuda and on triton, compute-sanitizer memcheck on a cuda subset
#           and on the lean-kernel pass, and the CUDA check's ~1000 accuracy cases, all at once
#           (correctness only: they share the GPU, so no timing is taken here).
#   perf:   the backends' own timing checks (variants and sweeps), one after the other.
#   bench:  python -m rope_ops bench (PERF.md workloads, same-run copy, peers), JSON + PNG.
#   probe:  tools/kernel_probe.py on $PROBE_SOURCE (default tools/probes/flat_steps.cu) with
#           $PROBE_ARGS: kernel variations against the library's kernels and a copy.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
# A build carried back from an earlier run (.gpu_cache, an ignored folder) saves the compile.
export ROPE_OPS_CACHE=${ROPE_OPS_CACHE:-$PWD/.gpu_cache}
status=0
phases=("$@")
[ "${#phases[@]}" -eq 0 ] && phases=(setup build verify perf bench)

step() { echo; echo "=== $* ($(date +%T))"; }
has() { for p in "${phases[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

# Packages the machine lacks travel as wheels in .whl (stevedore, liger-kernel).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if has setup; then
  step setup
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  python3 -m pip install -q --no-build-isolation --no-deps -e . -e examples/rope_ops_example_backend 2>&1 | tail -2
  python3 -c "import torch, triton, rope_ops; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'commit', '$(git rev-parse --short HEAD 2>/dev/null)')"
fi
if has build; then
  step "build CUDA extension"
  python3 -m rope_ops_backends.cuda_backend build 2>&1 | tail -20 || status=1
  python3 -m rope_ops info | tee "$OUT/info.txt"
  # Send the build back so the next call can carry it (.gpu_cache) instead of compiling.
  (cd "$ROPE_OPS_CACHE" && tar czf "$OUT/gpu_cache.tgz" .) 2>/dev/null
fi
if has verify; then
  step "verify: conformance cuda + triton, sanitizer, cuda accuracy cases (in parallel)"
  ROPE_OPS_TEST_EXAMPLES=40 timeout 480 python3 -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing \
    --rope-backend cuda > "$OUT/conformance_cuda.txt" 2>&1 & p1=$!
  ROPE_OPS_TEST_EXAMPLES=40 timeout 480 python3 -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing \
    --rope-backend triton > "$OUT/conformance_triton.txt" 2>&1 & p2=$!
  timeout 480 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    --pyargs rope_ops.testing --rope-backend cuda \
    -k "test_forward and (beyond or near_2p20 or negative or packed or transposed or caller_tables or thd or inplace) and (float32 or bfloat16)" \
    > "$OUT/sanitizer.txt" 2>&1 & p3=$!
  timeout 480 python3 tools/gpu_cuda_check.py --no-perf > "$OUT/cuda_accuracy.txt" 2>&1 & p4=$!
  # the flat path's lean kernel takes only calls larger than the suite's: its forced pass
  timeout 480 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/gpu_cuda_check.py --lean-only \
    > "$OUT/sanitizer_lean.txt" 2>&1 & p5=$!
  for job in "$p1:conformance cuda:conformance_cuda" "$p2:conformance triton:conformance_triton" \
             "$p3:sanitizer:sanitizer" "$p4:cuda accuracy cases:cuda_accuracy" \
             "$p5:sanitizer, lean kernel pass:sanitizer_lean"; do
    IFS=: read -r pid label file <<< "$job"
    wait "$pid"; rc=$?
    echo "--- $label: exit $rc"; tail -6 "$OUT/$file.txt"
    [ "$rc" -ne 0 ] && status=1
  done
fi
if has perf; then
  step "perf: CUDA timing check with sweep"
  timeout 300 python3 tools/gpu_cuda_check.py --perf-only --sweep 2>&1 | tee "$OUT/cuda_perf.txt" | tail -45 || status=1
  step "perf: Triton timing check with sweep and peers"
  timeout 300 python3 tools/gpu_triton_check.py --no-pytest 2>&1 | tee "$OUT/triton_perf.txt" | tail -45 || status=1
  step "host cost per call"
  timeout 120 python3 tools/host_cost.py --backend cuda 2>&1 | tee "$OUT/host_cost.txt"
  timeout 120 python3 tools/host_cost.py --backend triton 2>&1 | tee -a "$OUT/host_cost.txt"
fi
if has bench; then
  step "benchmark (PERF.md workloads, same-run copy, peers)"
  timeout 500 python3 -m rope_ops bench --json "$OUT/bench.json" --png "$OUT/bench.png" --markdown "$OUT/bench.md" 2>&1 | tee "$OUT/bench.txt" || status=1
fi
if has probe; then
  step "probe kernels (${PROBE_SOURCE:-tools/probes/flat_steps.cu})"
  # shellcheck disable=SC2086
  timeout 400 python3 tools/kernel_probe.py "${PROBE_SOURCE:-tools/probes/flat_steps.cu}" ${PROBE_ARGS:-} 2>&1 \
    | tee "$OUT/probe.txt" || status=1
fi
echo; echo "gpu_run.sh: exit $status"
exit $status
