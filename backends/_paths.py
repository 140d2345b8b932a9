"""Where the kernel sources are, installed or in a checkout."""

from __future__ import annotations

from pathlib import Path


def source_dir(name: str) -> Path:
    """The directory of kernel sources ``name`` ("csrc" or "ascend_kernels").

    An installed wheel carries them as ``rope_ops_backends/<name>``; an editable install or a
    checkout has them at the repository root.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kernel sources {name!r} not found next to {here}")
