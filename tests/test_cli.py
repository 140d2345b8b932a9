"""The command line (python -m rope_ops): usage, help, argument errors before anything runs, and
``info`` in its states (automatic, forced backend, unknown backend, plugins, --json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import rope_ops
from rope_ops import cli, info, registry
from rope_ops.backend import Backend
from rope_ops.bench import run as run_mod
from rope_ops.bench.cases import MATRIX, WORKLOADS


def python_m(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "rope_ops", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_no_arguments_and_help_print_a_real_usage(capsys):
    bare = python_m()  # the module entry point itself, once
    assert bare.returncode == 2
    assert cli.main(["--help"]) == 0
    for out in (bare.stdout, capsys.readouterr().out):
        assert "usage: python -m rope_ops" in out and "info" in out and "bench" in out
        assert "W1" in out and "llama3-8b-decode-1" in out and "cpu-prefill-bf16" in out


def test_bench_help_lists_options_and_case_names(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--workloads", "--matrix", "--candidates", "--providers", "--device", "--dtype", "--scale",
                   "--sets", "--repeats", "--time-ms", "--threads", "--no-host", "--json", "--markdown", "--png",
                   "--render"):
        assert option in out
    for name in list(WORKLOADS) + list(MATRIX):
        assert name in out
    assert "hf-compile" in out and "liger" in out


def test_info_help_prints_help_and_does_not_run_info(capsys, monkeypatch):
    monkeypatch.setattr(info, "collect", lambda: pytest.fail("info ran"))
    assert cli.main(["info", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m rope_ops info" in out and "--json" in out


def test_unknown_command(capsys):
    assert cli.main(["benchmark"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if the benchmark starts: argument errors come before any work."""
    monkeypatch.setattr(run_mod, "run", lambda options: pytest.fail("the benchmark ran"))


@pytest.mark.parametrize("argv, expected", [
    (["--workloads", "W9"], ["--workloads: unknown name(s) W9", "W1", "W3i", "llama3-8b-bshd", "cpu-decode"]),
    (["--workloads", "W1,,nope"], ["unknown name(s) nope"]),
    (["--workloads", ""], ["--workloads: unknown name(s)"]),
    (["--providers", "nonsense"], ["--providers: unknown provider(s) nonsense", "cuda", "triton", "torch", "liger",
                                   "hf-compile", "hf-eager"]),
    (["--providers", "torch,rope_ops:nonsense"], ["unknown provider(s) nonsense"]),
    (["--matrix", "--workloads", "W1"], ["not both"]),
    (["--scale", "0"], ["--scale", "positive integer"]),
    (["--sets", "x"], ["--sets", "positive integer"]),
    (["--time-ms", "-1"], ["--time-ms", "positive number"]),
    (["--dtype", "float64"], ["--dtype", "invalid choice"]),
    (["--render", "/nonexistent/results.json"], ["cannot read results"]),
])
def test_bench_argument_errors_before_running(argv, expected, nothing_runs, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")
def test_bench_gpu_only_options_on_a_cpu(nothing_runs, capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert cli.main(["bench", "--candidates"]) == 2
    assert "need a CUDA device" in capsys.readouterr().err


def test_png_without_matplotlib_names_the_extra(monkeypatch, nothing_runs, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli.main(["bench", "--providers", "torch", "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "rope_ops[bench]" in err
    assert not (tmp_path / "x.png").exists()


def test_valid_arguments_reach_the_run(monkeypatch, capsys):
    seen = {}

    def fake_run(options):
        seen["options"] = options
        return {"environment": {"device": "cpu", "cpu": "x", "threads": 1, "cpu_count": 1, "python": "3",
                                "torch": "2", "rope_ops": "0", "commit": "c", "date": "d"},
                "providers": [], "rows": []}

    monkeypatch.setattr(run_mod, "run", fake_run)
    assert cli.main(["bench", "--device", "cpu", "--workloads", "W1,llama3-8b-decode-8,cpu-decode",
                     "--providers", "rope_ops:torch,hf-eager", "--dtype", "float16", "--threads", "1"]) == 0
    options = seen["options"]
    assert [c.name for c in options.cases] == ["W1", "llama3-8b-decode-8", "cpu-decode"]
    assert options.providers == ["torch", "hf-eager"] and options.threads == 1
    assert options.cases[0].seq == 4096 // 32  # GPU-sized workloads are scaled down on a CPU
    assert options.cases[2].seq == 1 and all(c.dtype == "float16" for c in options.cases)
    assert cli.main(["bench", "--device", "cpu"]) == 0  # CPU default: the CPU workloads
    assert [c.group for c in seen["options"].cases] == ["cpu"] * 5
    assert seen["options"].providers == ["cpu", "torch", "hf-eager", "hf-compile"]


# ---------------------------------------------------------------------------------------------
# info


class FakeBackend(Backend):
    device_types = frozenset({"cpu"})

    def __init__(self, name, joins=False, reasons=()):
        self.name = name
        self.joins_auto = joins
        self._reasons = list(reasons)

    def availability(self):
        return list(self._reasons)

    def run(self, args):
        raise NotImplementedError


@pytest.fixture
def backends(monkeypatch):
    from rope_ops_backends.torch_backend import TorchBackend

    monkeypatch.delenv("ROPE_OPS_BACKEND", raising=False)
    fakes = {"torch": TorchBackend(), "triton": FakeBackend("triton", reasons=[
                 "no active triton driver: RuntimeError: 0 active drivers ([]). There should only be one."]),
             "shy": FakeBackend("shy"), "eager": FakeBackend("eager", joins=True)}
    fakes["triton"].device_types = frozenset({"cuda"})
    with registry.override(fakes):
        yield fakes


def test_info_automatic_selection(backends, capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "auto (ROPE_OPS_BACKEND not set)" in out
    assert "cpu   -> torch" in out or "cpu   -> eager" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 2}
    assert "joins automatic selection" in lines["torch"] and "(the fallback)" in lines["torch"]
    assert "does not join automatic selection" in lines["shy"]  # third-party without joins_auto
    assert "joins automatic selection on cpu" in lines["eager"]  # third-party with joins_auto = True
    assert "no GPU driver for Triton" in out and "0 active drivers" not in out
    assert "Plugin problems:\n  none" in out
    assert "{'" not in out  # no raw dicts


def test_info_forced_backend(backends, monkeypatch, capsys):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "shy")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "ROPE_OPS_BACKEND=shy forces backend 'shy'" in out and "cpu   -> shy" in out
    assert "automatic selection would pick" in out
    monkeypatch.setenv("ROPE_OPS_BACKEND", "triton")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cpu   -> error, as a real call would raise:" in out and "triton:" in out
    assert "0 active drivers" not in out


def test_info_unknown_backend_shows_the_error_a_call_raises(backends, monkeypatch, capsys):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "nonsense")
    q = torch.randn(1, 2, 2, 8)
    with pytest.raises(rope_ops.BackendError) as raised:
        rope_ops.apply(q, None, 0)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "not registered" in out and str(raised.value).splitlines()[0] in out


def test_info_plugin_problems_and_json(backends, monkeypatch, capsys):
    loaded, _ = registry.load_all()
    monkeypatch.setattr(registry, "shadowed", lambda: {
        "cuda": "entry point 'cuda' = 'evil:Cuda' of distribution 'evil' ignored: 'cuda' is a built-in rope_ops backend"})
    monkeypatch.setattr(registry, "load_all", lambda: (
        {k: v for k, v in loaded.items() if k != "eager"}, {"eager": "ImportError: no module named eager_impl"}))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "ignored entry point: entry point 'cuda'" in out
    assert "backend 'eager' failed to load: ImportError" in out
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backends"]["eager"]["state"] == "failed to load"
    assert report["backends"]["shy"]["joins_auto"] is False and report["backends"]["torch"]["joins_auto"] is True
    assert report["selection"]["cpu"]["backend"] == "torch" and report["request"]["forced"] is False
    assert len(report["problems"]) == 2


def test_info_json_forced_unknown(backends, monkeypatch, capsys):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "nonsense")
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["request"] == {"value": "nonsense", "from": "ROPE_OPS_BACKEND", "forced": True}
    assert report["selection"]["cpu"]["backend"] is None
    assert "unknown backend(s) ['nonsense']" in report["selection"]["cpu"]["error"]
    assert report["auto_selection"]["cpu"]["backend"] is not None
