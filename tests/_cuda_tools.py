"""Shared by the CUDA source tests: where this machine's nvcc is."""

import os
import shutil
from pathlib import Path


def find_nvcc() -> str | None:
    """$NVCC, nvcc on PATH, or $CUDA_HOME / /usr/local/cuda's; None when there is none."""
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None
