"""``python -m rope_ops info``: every backend, whether it can run here and why, and what
automatic selection picks on each visible device."""

from __future__ import annotations

import json
import os
import platform

import torch

from . import _select, registry
from .backend import RopeCall

_PROBE_DTYPE = {"cpu": torch.float32}


def visible_devices() -> list[str]:
    devices = ["cpu"]
    for name in ("cuda", "npu", "xpu", "mps"):
        module = getattr(torch, name, None)
        try:
            if module is not None and module.is_available():
                devices.append(name)
        except Exception:  # a broken device runtime is reported by its backend, not here
            pass
    return devices


def probe_call(device_type: str, **changes) -> RopeCall:
    """A typical call (Llama-like bf16 prefill, or float32 on the CPU) to report selection for."""
    call = RopeCall(device_type, _PROBE_DTYPE.get(device_type, torch.bfloat16), "bshd", "neox", 128, 128,
                    32, 8, False, torch.int64, False, False, True)
    return call._replace(**changes)


def collect() -> dict:
    loaded, failures = registry.load_all()
    backends = {}
    for name in registry.names():
        if name in failures:
            backends[name] = {"loaded": False, "available": False, "reasons": [f"failed to load: {failures[name]}"]}
            continue
        backend = loaded[name]
        reasons = list(backend.availability())
        entry = {"loaded": True, "available": not reasons, "reasons": reasons,
                 "class": f"{type(backend).__module__}.{type(backend).__qualname__}",
                 "capabilities": backend.describe()}
        backends[name] = entry
    selection = {}
    for device_type in visible_devices():
        call = probe_call(device_type)
        try:
            chosen = _select.decide("auto", call).name
            selection[device_type] = {"auto": chosen, "call": _select.describe(call)}
        except Exception as error:  # report, don't crash: info is a diagnostic tool
            selection[device_type] = {"auto": None, "error": str(error)}
    return {
        "rope_ops": __import__("rope_ops").__version__,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "machine": platform.machine(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("ROPE_OPS") or k == "TRITON_INTERPRET"},
        "request": _select.current_request(),
        "backends": backends,
        "auto_selection": selection,
    }


def render(report: dict) -> str:
    lines = [f"rope_ops {report['rope_ops']}  torch {report['torch']} (CUDA {report['cuda']})  "
             f"python {report['python']} {report['machine']}",
             f"request: {report['request']!r}  environment: {report['environment'] or '{}'}", "", "backends:"]
    for name, entry in report["backends"].items():
        state = "available" if entry["available"] else "unavailable"
        lines.append(f"  {name:8s} {state}")
        for reason in entry["reasons"]:
            lines.append(f"           - {reason}")
        caps = entry.get("capabilities")
        if caps:
            summary = ", ".join(f"{k}={v}" for k, v in caps.items() if k not in ("tiers", "build"))
            lines.append(f"           {summary}")
            for key in ("tiers", "build"):
                if key in caps:
                    lines.append(f"           {key}: {caps[key]}")
    lines += ["", "automatic selection (for a typical call on each visible device):"]
    for device, entry in report["auto_selection"].items():
        if entry.get("auto"):
            lines.append(f"  {device:5s} -> {entry['auto']}")
        else:
            lines.append(f"  {device:5s} -> none: {entry['error']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    report = collect()
    print(json.dumps(report, indent=2, default=str) if "--json" in argv else render(report))
    return 0
