"""``python -m rope_ops {info,bench}``: see rope_ops.cli."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
