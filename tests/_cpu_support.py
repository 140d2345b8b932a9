"""Fixtures of the cpu backend's tests: the backend, built, and each instruction set this CPU has."""

from __future__ import annotations

import pytest

import rope_ops_backends.cpu_backend as cpu_backend

ISAS = ("generic", "avx2", "avx512", "avx512_bf16")


@pytest.fixture(scope="module")
def backend():
    """The cpu backend, built. Skipped only where the toolchain is missing (its documented
    unavailable state); a build that fails where a compiler exists fails the tests."""
    obj = cpu_backend.CpuBackend()
    reasons = obj.availability()
    if reasons:
        if cpu_backend.toolchain_reasons():
            pytest.skip(f"cpu backend unavailable here: {'; '.join(reasons)}")
        pytest.fail(f"cpu backend failed to build: {'; '.join(reasons)}")
    return obj


@pytest.fixture(params=ISAS)
def isa(request, backend):
    if request.param not in cpu_backend.available_isas():
        pytest.skip(f"this CPU has no {request.param} (it has {cpu_backend.available_isas()})")
    with cpu_backend.use_isa(request.param):
        yield request.param
