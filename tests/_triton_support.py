"""Shared by the Triton backend's tests: where they run. Under TRITON_INTERPRET=1 (set on the
command line: triton reads it when imported) on CPU tensors through the interpreter; without it
on CUDA tensors where there is a GPU; otherwise the tests are skipped (``needs_device``)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_device = pytest.mark.skipif(
    DEVICE is None, reason="needs TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device")
