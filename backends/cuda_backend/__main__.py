"""``python -m rope_ops_backends.cuda_backend build [--force] [--arch 90] [--verbose]``

Prebuilds the CUDA extension into the cache so that the first rope_ops call does not compile.
``--arch`` builds for the given compute capabilities (e.g. ``90`` or ``80,90``) without needing a
visible device; otherwise the visible GPUs decide. ``--force`` removes earlier builds first.
``info`` prints what the backend would say about this process without building.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import build, cache_dir, environment_reasons, toolchain_reasons, visible_archs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_ops_backends.cuda_backend")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the CUDA extension into the cache")
    b.add_argument("--force", action="store_true", help="remove earlier builds first")
    b.add_argument("--arch", help="compute capabilities, e.g. 90 or 80,90 (default: visible GPUs)")
    b.add_argument("--verbose", action="store_true", help="show the compiler commands")
    sub.add_parser("info", help="print environment and toolchain reasons, build nothing")
    args = parser.parse_args(argv)

    if args.cmd == "info":
        print("cache:", cache_dir())
        for r in environment_reasons() + toolchain_reasons():
            print("unavailable:", r)
        return 0

    if args.arch:
        os.environ["ROPE_OPS_CUDA_ARCH"] = args.arch
    else:
        env = environment_reasons()
        if env:
            print("cannot build for the visible devices:", "; ".join(env), file=sys.stderr)
            print("(pass --arch 90 to build without a device)", file=sys.stderr)
            return 1
    archs = visible_archs()
    reasons = build(archs, force=args.force, verbose=args.verbose)
    if reasons:
        print("build failed:", "\n".join(reasons), file=sys.stderr)
        return 1
    print(f"built the rope_ops CUDA extension for sm_{','.join(archs)} in {cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
