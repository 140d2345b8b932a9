"""Discovery through stevedore: broken plugins are recorded, never fatal; no stale cache."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import rope_ops
from rope_ops import registry

GOOD = textwrap.dedent("""
    from rope_ops.backend import Backend
    from rope_ops_backends.torch_backend import TorchBackend

    class GoodBackend(TorchBackend):
        name = "good"

    class Misnamed(Backend):
        name = "something-else"

    class NotABackend:
        pass
    """)


def make_plugin_dist(root, entries: dict[str, str], modules: dict[str, str]) -> None:
    """A minimal installed distribution on ``root`` registering ``entries`` in our group."""
    dist = root / "fakeplugins-1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplugins\nVersion: 1.0\n")
    lines = ["[rope_ops.backends]"] + [f"{name} = {target}" for name, target in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


def run_python(code: str, root, cache_dir, env_extra=None) -> dict:
    # a fresh stevedore cache (XDG_CACHE_HOME), but this process's extension cache: the cpu
    # backend, picked for CPU tensors, is not rebuilt in every subprocess
    from rope_ops_backends._build import cache_root

    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XDG_CACHE_HOME": str(cache_dir), "ROPE_OPS_CACHE": str(cache_root()),
           **(env_extra or {})}
    env.pop("ROPE_OPS_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = textwrap.dedent("""
    import json, torch, rope_ops
    from rope_ops import registry
    loaded, failures = registry.load_all()
    q = torch.randn(1, 3, 2, 8)
    out, _ = rope_ops.apply(q, None, 0)
    print(json.dumps({"names": registry.names(), "loaded": sorted(loaded), "failures": failures,
                      "auto": rope_ops.select_backend(q, None, 0)}))
    """)


def test_broken_plugins_are_recorded_and_harmless(tmp_path):
    make_plugin_dist(tmp_path, {
        "good": "goodmod:GoodBackend",
        "missing": "no_such_module_xyz:Backend",
        "asserts": "assertmod:Backend",
        "raises": "raisemod:Backend",
        "misnamed": "goodmod:Misnamed",
        "notbackend": "goodmod:NotABackend",
    }, {"goodmod": GOOD, "assertmod": "assert False, 'plugin asserts at import'\n",
        "raisemod": "raise RuntimeError('no device SDK')\n"})
    result = run_python(PROBE, tmp_path, tmp_path / "cache")
    assert "good" in result["loaded"] and "torch" in result["loaded"]
    failures = result["failures"]
    assert "ModuleNotFoundError" in failures["missing"]
    assert "AssertionError" in failures["asserts"]
    assert "no device SDK" in failures["raises"]
    assert "differs" in failures["misnamed"]
    assert "not a rope_ops.backend.Backend" in failures["notbackend"]
    # A third-party plugin joins automatic selection only when it declares it.
    assert result["auto"] in ("torch", "cpu")


HANGS = textwrap.dedent("""
    import time
    time.sleep(3600)
    """)

JOINS = textwrap.dedent("""
    from rope_ops_backends.torch_backend import TorchBackend

    class Joins(TorchBackend):
        name = "joins"
        priority = 5
        joins_auto = True

    class FakeTorch(TorchBackend):
        name = "torch"
    """)


def test_plugin_that_hangs_times_out_and_blocks_no_other_name(tmp_path):
    """A plugin whose import never returns holds up only its own name, and only for
    ROPE_OPS_PLUGIN_TIMEOUT; named and automatic calls on other backends run."""
    make_plugin_dist(tmp_path, {"hangs": "hangmod:Backend"}, {"hangmod": HANGS})
    code = textwrap.dedent("""
        import json, threading, time, torch, rope_ops
        from rope_ops import registry
        q = torch.randn(1, 3, 2, 8)
        t = threading.Thread(target=lambda: rope_ops.apply(q, None, 0, backend="hangs,torch"), daemon=True)
        t.start()
        time.sleep(0.5)
        start = time.monotonic()
        rope_ops.apply(q, None, 0, backend="torch")  # not blocked by the hanging load
        named = time.monotonic() - start
        t.join(30)
        auto = rope_ops.select_backend(q, None, 0)
        print(json.dumps({"named_s": named, "thread_done": not t.is_alive(), "auto": auto,
                          "failure": registry.load_all()[1].get("hangs", "")}))
        """)
    env_extra = {"ROPE_OPS_PLUGIN_TIMEOUT": "3"}
    result = run_python(code, tmp_path, tmp_path / "cache", env_extra)
    assert result["named_s"] < 2.0
    assert result["thread_done"] and result["auto"] in ("torch", "cpu")
    assert "did not finish within 3 s" in result["failure"]


def test_third_party_cannot_take_a_builtin_name_and_can_join_auto(tmp_path):
    make_plugin_dist(tmp_path, {"torch": "joinsmod:FakeTorch", "joins": "joinsmod:Joins"},
                     {"joinsmod": JOINS})
    code = textwrap.dedent("""
        import json, torch, rope_ops
        from rope_ops import registry
        q = torch.randn(1, 3, 2, 8)
        print(json.dumps({"torch_module": type(registry.get("torch")).__module__,
                          "shadowed": registry.shadowed(),
                          "auto": rope_ops.select_backend(q, None, 0, backend="joins,torch"),
                          "auto_plain": rope_ops.select_backend(q, None, 0)}))
        """)
    result = run_python(code, tmp_path, tmp_path / "cache")
    assert result["torch_module"] == "rope_ops_backends.torch_backend"
    assert "built-in" in result["shadowed"]["torch"] and "fakeplugins" in result["shadowed"]["torch"]
    assert result["auto"] == "joins"
    # it declared joins_auto with priority 5 > torch's 0; the C++ cpu backend (priority 10) wins where built
    assert result["auto_plain"] in ("joins", "cpu")


def test_new_plugin_seen_despite_stevedore_disk_cache(tmp_path):
    """stevedore's on-disk cache can hide a plugin installed within ~2 minutes; we don't."""
    cache = tmp_path / "cache"
    make_plugin_dist(tmp_path, {"good": "goodmod:GoodBackend"}, {"goodmod": GOOD})
    first = run_python(PROBE, tmp_path, cache)
    assert "good" in first["names"] and "late" not in first["names"]
    make_plugin_dist(tmp_path, {"good": "goodmod:GoodBackend", "late": "goodmod:GoodBackend"}, {})
    second = run_python(PROBE, tmp_path, cache)
    assert "late" in second["names"]


def test_in_tree_backends_registered_through_entry_points():
    names = registry.names()
    for name in ("torch", "triton", "cuda", "ascend"):
        assert name in names
    torch_backend = registry.get("torch")
    assert type(torch_backend).__module__ == "rope_ops_backends.torch_backend"


def test_unknown_name_is_a_backend_error():
    with pytest.raises(rope_ops.BackendError, match="unknown backend 'nope'"):
        registry.get("nope")


def test_backends_not_installed_as_top_level_package():
    import importlib.util

    assert importlib.util.find_spec("rope_ops_backends") is not None
    spec = importlib.util.find_spec("backends")
    assert spec is None or "rope_ops" not in str(spec.origin or "")


def _liar(kind):
    """A third-party backend that misbehaves in a way rope_ops checks on a kind's first call."""
    import torch

    from rope_ops_backends.torch_backend import TorchBackend

    class Liar(TorchBackend):
        name = "liar"
        allocates_outputs = kind == "wrong_shape"

        def run(self, args):
            if kind == "wrong_shape":
                return torch.empty(1), None if args.k is None else torch.empty(1)
            if kind == "no_write":
                return None
            return super().run(args)

    return Liar()


@pytest.mark.parametrize("kind", ["wrong_shape", "no_write"])
def test_third_party_outputs_are_checked_once_per_kind(kind):
    import torch

    from rope_ops_backends.torch_backend import TorchBackend

    with registry.override({"liar": _liar(kind), "torch": TorchBackend()}):
        q = torch.randn(2, 3, 4, 8)
        with pytest.raises(rope_ops.BackendError, match="liar") as info:
            rope_ops.apply(q, q.clone(), 0, backend="liar")
        assert info.value.refusals is None  # a failure, not a refusal


def test_good_third_party_backend_is_checked_then_trusted():
    import torch

    from rope_ops import _ops
    from rope_ops_backends.torch_backend import TorchBackend

    good = _liar("none")
    with registry.override({"liar": good, "torch": TorchBackend()}):
        q = torch.randn(2, 3, 4, 8)
        _ops._verified.clear()
        for _ in range(3):
            rope_ops.apply(q, q.clone(), 0, backend="liar")
        assert [v for v in _ops._verified if v[0] == "liar"]
