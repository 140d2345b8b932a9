"""``python -m rope_ops info [--json]`` and ``python -m rope_ops bench [options]``."""

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        from .info import main as info_main

        return info_main(rest)
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    print(f"unknown command {command!r}\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
