"""The conformance suite as shipped: ``pytest --pyargs rope_ops.testing --rope-backend NAME``."""

from rope_ops.testing.suite import RopeConformance


class TestConformance(RopeConformance):
    pass
