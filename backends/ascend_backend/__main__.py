"""``python -m rope_ops_backends.ascend_backend [info|build]``.

info: the backend's availability and its three tiers as JSON (imports torch_npu if installed).
build: build the Ascend C kernels with ascend_kernels/build.sh (needs CANN, torch_npu).
"""

from __future__ import annotations

import json
import subprocess
import sys


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "info"
    if cmd == "info":
        from . import AscendBackend

        b = AscendBackend()
        print(json.dumps({"availability": b.availability(), **b.describe()}, indent=1, default=str))
        return 0
    if cmd == "build":
        from .._paths import source_dir

        return subprocess.call(["bash", str(source_dir("ascend_kernels") / "build.sh"), *argv[1:]])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
