"""pytest11 entry point: options and markers of the conformance suite.

Loaded in every pytest run of an environment that has rope_ops installed, so it imports
nothing heavy (no torch).
"""

import os


def pytest_addoption(parser):
    group = parser.getgroup("rope_ops")
    group.addoption("--rope-backend", default=None,
                    help="backend the conformance suite tests (default: $ROPE_OPS_TEST_BACKEND or torch)")
    group.addoption("--rope-device", default=None,
                    help="device to test on (default: the backend's first available device)")


def pytest_configure(config):
    for marker in ("cuda: needs a CUDA device", "npu: needs an Ascend NPU",
                   "triton: needs triton", "slow: long-running"):
        config.addinivalue_line("markers", marker)
    name = config.getoption("--rope-backend", default=None)
    if name:
        import pytest

        from rope_ops import registry  # only when the suite is asked for: torch is heavy

        if name not in registry.names():
            raise pytest.UsageError(f"--rope-backend {name!r}: no such rope_ops backend; "
                                    f"registered: {', '.join(registry.names())}")


def pytest_report_header(config):
    backend = config.getoption("--rope-backend", default=None) or os.environ.get("ROPE_OPS_TEST_BACKEND")
    variables = {k: v for k, v in os.environ.items() if k.startswith(("ROPE_OPS", "TRITON_INTERPRET"))}
    return [f"rope_ops: backend under test={backend or 'torch (default)'}; environment={variables}"]
