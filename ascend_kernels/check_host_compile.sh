#!/usr/bin/env bash
# Compile-and-link check of the host glue (rope_host.cpp) against torch_npu's headers WITHOUT CANN
# and without installing torch_npu (installing it without CANN breaks `import torch`):
#   pip download --no-deps "torch-npu==<torch version>" -d /tmp/npu && \
#     mkdir /tmp/npu/x && python -m zipfile -e /tmp/npu/torch_npu-*.whl /tmp/npu/x
#   bash ascend_kernels/check_host_compile.sh /tmp/npu/x/torch_npu
# The aclrtlaunch_* symbols stay undefined (they come from the kernels, which need bisheng).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
npu="${1:?path of an unpacked torch_npu package directory}"
PY="${PYTHON:-python3}"
torch="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
pyinc="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
out="${OUT:-$(mktemp -d)}/rope_host_check.so"
"${CXX:-g++}" -std=c++20 -fPIC -shared -Wall -Wno-unused-function -I"$torch/include" \
  -I"$torch/include/torch/csrc/api/include" -I"$pyinc" -I"$npu/include" -I"$here" "$here/rope_host.cpp" \
  -o "$out" -L"$torch/lib" -L"$npu/lib" -ltorch -ltorch_cpu -lc10 -ltorch_npu
echo "ok: $out"
