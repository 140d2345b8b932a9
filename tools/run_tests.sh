#!/usr/bin/env bash
# The whole test run, in the project's environment (set up by .ci/run): unit tests, then the
# conformance suite on every backend that runs on a CPU. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0   # a stray torch_npu without CANN must not break `import torch`
export PYTHONDONTWRITEBYTECODE=1
py=${PYTHON:-python}

echo "== the C++ cpu backend, built once into the extension cache (\$ROPE_OPS_CACHE or ~/.cache/rope_ops)"
"$py" -m rope_ops_backends.cpu_backend build
echo "== unit tests: core, registry, frequencies vs HF, build cache, CUDA sources and host emulation,"
echo "   Ascend CPU emulation, cpu backend, HF integration, distributed (gloo), bench and CLI"
"$py" -m pytest -q tests
echo "== triton backend unit tests through the Triton interpreter (skipped above without it)"
TRITON_INTERPRET=1 "$py" -m pytest -q -p no:cacheprovider tests/test_triton_backend.py \
    tests/test_triton_variants.py tests/test_triton_prologue.py
for backend in torch cpu complex; do
    echo "== conformance: $backend backend"
    "$py" -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing --rope-backend "$backend"
done
echo "== conformance: triton backend through the Triton interpreter on the CPU"
TRITON_INTERPRET=1 ROPE_OPS_TEST_EXAMPLES=10 "$py" -m pytest -q -p no:cacheprovider --pyargs rope_ops.testing --rope-backend triton
