"""The conformance suite fails on wrong backends (a suite that cannot fail proves nothing)."""

import pytest

pytest_plugins = ["pytester"]

BROKEN = '''
import pytest
import torch
from rope_ops import registry
from rope_ops.backend import KernelArgs
from rope_ops.testing import RopeConformance
from rope_ops_backends.torch_backend import TorchBackend


class Broken(TorchBackend):
    name = "broken"
    bug = "{bug}"

    def run(self, args: KernelArgs) -> None:
        if self.bug == "sign":
            args = args._replace(inverse=not args.inverse)
        elif self.bug == "clamp_table":  # reads the last row for positions beyond the table
            pos = args.pos if args.pos is not None else None
            if pos is not None:
                args = args._replace(pos=pos.clamp(0, args.cos.shape[0] - 1), freq_turns=None)
        super().run(args)
        if self.bug == "no_passthrough" and not args.inplace and args.rotary_dim < args.q.shape[-1]:
            args.q_out[..., args.rotary_dim:] = 0
        if self.bug == "low_precision":
            args.q_out.copy_(args.q_out.to(torch.float16).to(args.q_out.dtype))
        if self.bug == "writes_input" and not args.inplace:
            args.q.mul_(1.0000001)


@pytest.fixture(autouse=True)
def only_broken():
    with registry.override({{"broken": Broken(), "torch": TorchBackend()}}):
        yield


class TestBroken(RopeConformance):
    backend = "broken"
'''


@pytest.mark.parametrize("bug, selection", [
    ("sign", "test_forward and base"),
    ("clamp_table", "test_forward and pos_beyond_table"),
    ("no_passthrough", "test_forward and partial_neox"),
    ("low_precision", "test_forward and base and float32"),
    ("writes_input", "test_forward and base and float32"),
])
def test_suite_fails_on_bug(pytester, bug, selection):
    pytester.makepyfile(test_broken=BROKEN.format(bug=bug))
    result = pytester.runpytest_subprocess("-q", "-k", selection, "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1, result.stdout.str()[-2000:]


def test_suite_passes_on_correct_backend(pytester):
    pytester.makepyfile(test_broken=BROKEN.format(bug="none"))
    result = pytester.runpytest_subprocess("-q", "-k", "test_forward and (base or partial_neox or beyond)",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=16)
