"""rope_ops' conformance suite, shipped in the package and registered as a pytest plugin.

    pytest --pyargs rope_ops.testing --rope-backend NAME

or subclass ``RopeConformance`` in your own tests (see its docstring).
"""

import importlib.util

if importlib.util.find_spec("pytest") is not None:
    import pytest

    pytest.register_assert_rewrite("rope_ops.testing.checks", "rope_ops.testing.suite")
    from .suite import RopeConformance  # noqa: E402

    __all__ = ["RopeConformance"]
