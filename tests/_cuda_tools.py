"""Shared by the CUDA source tests: where this machine's nvcc is, and the repo's tools/ scripts
as modules."""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """tools/<name>.py as a module (registered in sys.modules: dataclasses look themselves up
    there)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


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
