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


def run_python(code: str, root, cache_dir) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XDG_CACHE_HOME": str(cache_dir)}
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
    # A working plugin of the same priority ranks above the pure-torch last resort.
    assert result["auto"] == "good"


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
