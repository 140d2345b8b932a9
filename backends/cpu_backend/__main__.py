"""``python -m rope_ops_backends.cpu_backend build [--force] [--verbose]`` | ``info`` |
``bench-prologue [...]``

``build`` compiles the CPU extension into the cache (``rope_ops_backends._build.cache_root()``)
so that the first rope_ops call on the CPU does not; ``--force`` removes this extension's cached
builds first. ``info`` says what the backend would say about this machine, building nothing.
``bench-prologue`` times the fused prologue against the unfused pipeline (see ``bench``; its
options after the command name).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from . import EXT_NAME, available_isas, build, compile_flags, isa, toolchain_reasons


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench-prologue"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m rope_ops_backends.cpu_backend")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the CPU extension into the cache")
    b.add_argument("--force", action="store_true", help="remove this extension's cached builds first")
    b.add_argument("--verbose", action="store_true", help="show the compiler commands")
    sub.add_parser("info", help="print the toolchain's reasons and flags, build nothing")
    sub.add_parser("bench-prologue", help="time the fused prologue against the unfused pipeline "
                   "(options: bench-prologue --help)")
    args = parser.parse_args(argv)
    from .._build import cache_root

    if args.cmd == "info":
        print("cache:", cache_root() / EXT_NAME)
        print("flags:", compile_flags())
        for reason in toolchain_reasons():
            print("unavailable:", reason)
        return 0

    if args.force:
        shutil.rmtree(cache_root() / EXT_NAME, ignore_errors=True)
    start = time.monotonic()
    reasons = build(verbose=args.verbose)
    if reasons:
        print("build failed:", "\n".join(reasons), file=sys.stderr)
        return 1
    print(f"rope_ops CPU extension ready in {time.monotonic() - start:.1f} s "
          f"(cache {cache_root() / EXT_NAME}); instruction set {isa()} of {available_isas()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
