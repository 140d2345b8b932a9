#!/usr/bin/env bash
# Build rope_ops' Ascend C kernels on a machine with CANN, torch and torch_npu:
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh
#   bash ascend_kernels/build.sh            # -> ascend_kernels/build/librope_ops_ascend.so
# SOC_VERSION defaults to the first NPU's name from npu-smi (e.g. Ascend910B1); set it to cross-build.
# AscendBackend finds the library there (or at $ROPE_OPS_ASCEND_LIB) and loads it lazily.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${ASCEND_HOME_PATH:?CANN not set up: source <CANN>/set_env.sh first}"
PY="${PYTHON:-python3}"
if [[ -z "${SOC_VERSION:-}" ]]; then
  name="$(npu-smi info 2>/dev/null | awk '/^\| [0-9]+ +[0-9A-Za-z]+/ {print $3; exit}' || true)"
  SOC_VERSION="Ascend${name:-910B1}"
fi
TORCH_CMAKE="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
TORCH_NPU="$("$PY" -c 'import os, torch_npu; print(os.path.dirname(torch_npu.__file__))')"
build="${BUILD_DIR:-$here/build}"
echo "rope_ops: building Ascend kernels for $SOC_VERSION into $build"
cmake -S "$here" -B "$build" -DSOC_VERSION="$SOC_VERSION" -DASCEND_CANN_PACKAGE_PATH="$ASCEND_HOME_PATH" \
  -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" -DTORCH_NPU_PATH="$TORCH_NPU" -DPython3_EXECUTABLE="$(command -v "$PY")"
cmake --build "$build" -j "$(nproc)"
ls -l "$build/librope_ops_ascend.so"
"$PY" - "$build/librope_ops_ascend.so" <<'PYEOF'
import sys, torch, torch_npu  # noqa: F401
torch.ops.load_library(sys.argv[1])
print("loaded:", torch.ops.rope_ops_ascend.rotary_embedding, torch.ops.rope_ops_ascend.rotary_embedding_grad)
PYEOF
